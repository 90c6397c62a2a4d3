"""TaperCallback: the whole recipe as a ``transformers.Trainer`` callback, over :class:`TaperController`.

``Trainer(..., callbacks=[TaperCallback()])`` on a model from ``patch_model`` is all it takes: the
taper window, the scale loss and the distillation come from the model's TaperNormConfig; the run
length comes from ``state.max_steps``; the gate from ``state.global_step`` alone (so a resumed run is
right even though the Trainer restores callback state only with
``restore_callback_states_from_checkpoint``). Every checkpoint gets ``tapernorm_config.json`` and, when
distilling, the teacher's snapshot; a resumed run checks the first against the model's config and
reloads the second.

Where the Trainer calls us (transformers v5, ``Trainer._inner_training_loop``): ``on_step_begin``
before the first micro-batch of each optimizer step (the gate is then constant over the accumulated
micro-batches); ``on_step_end`` after ``optimizer.step()`` and ``global_step += 1``, before logging,
evaluation and checkpointing; ``on_log`` (the gradient norm's only appearance) before saving. So a
divergence stops training before a broken state is saved.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

from torch import nn
from transformers import TrainerCallback
from transformers.trainer_callback import TrainerState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..config import Step, TaperNormConfig, config_of
from ..errors import ConfigurationError, TaperStateError
from ..layers.loss_terms import loss_terms_of
from ..layers.scale_anchor import scale_anchors
from ..layers.taper_norm import refuse_replaced_forward, tapered_norms
from ..utils import true_or_false
from .controller import TaperController, lowest_gate
from .distributed import refuse_unsupported_sharding, refuse_unsupported_trainer_sharding
from .divergence import DivergenceThresholds, divergence_thresholds
from .recipe_check import (
    AllowedChanges,
    allowed_changes,
    is_adapter_checkpoint,
    refuse_adapter_checkpoint,
    resume_candidates,
    stop_watching_checkpoint_loads,
    watch_checkpoint_loads,
)
from .schedule import (
    TaperSchedule,
    decay_learning_rate_after_the_taper,
    decay_steps_missing,
    decay_steps_of,
    fit_default_window,
    forget_written_decay,
    stable_steps_without_decay,
    written_decay_run_length,
    written_decay_steps,
)

logger = logging.getLogger(__name__)

#: The Trainer's state file in every checkpoint (``transformers.trainer.TRAINER_STATE_NAME``).
TRAINER_STATE_NAME = "trainer_state.json"


class TaperCallback(TrainerCallback):
    """Warm up at g = 1, calibrate at ``taper_start``, cosine-decay the gate to exactly 0 at ``taper_end``.

    ``taper_start``/``taper_end``: optimizer steps (int) or fractions of ``max_steps`` (float);
    None means the model's TaperNormConfig. ``allow_incomplete=True`` lets a run end before g reaches
    0 (warning instead of error). ``thresholds``: the divergence watch (:class:`DivergenceThresholds`;
    ``max_scale_ratio`` is a shortcut for its first field). ``allow_changes``: TaperNormConfig options a
    resumed run may change on purpose (any other difference from the checkpoint's config is refused).

    Logs ``taper/gate``, ``taper/scale_loss``, ``taper/residual_scale`` and ``taper/distill`` with every
    training log. The order it needs: the Trainer lists its reporting callbacks (``report_to``:
    TensorBoard, W&B, ...) before the ones passed as ``callbacks=`` and hands them one shared ``logs`` dict
    in that order, so only the callbacks after this one read the keys. :func:`place_first` (after building
    the Trainer) moves it to the front; ``on_train_begin`` warns when ``report_to`` names reporters and it
    was not placed first (``trainer_state.json`` gets the keys either way).

    Resuming reads the checkpoint the Trainer restored: ``TrainingArguments.resume_from_checkpoint`` when
    set, else ``<output_dir>/checkpoint-<global_step>`` (where ``resume_from_checkpoint=True`` and the
    Trainer's own checkpoints point); the folder's ``trainer_state.json`` must be the restored state, or
    the run is refused (a checkpoint outside ``output_dir``: set ``resume_from_checkpoint`` in the
    arguments too).

    A checkpoint written under another recipe is refused by name of the fields that differ (``allow_changes``
    aside) when the Trainer loads its weights into the model (:func:`~.recipe_check.watch_checkpoint_loads`), which
    is before the Trainer loads the optimizer's state and before ``on_train_begin``, in every ``train()``; one that
    tapered other norms is refused there too where its folder is unknown (outside output_dir, not in the arguments);
    a PEFT checkpoint (adapters only, no TaperNorm state) is refused as not resumable. The watch starts when the
    Trainer is built: a callback added later with ``trainer.add_callback`` starts it at its first ``on_train_begin``,
    after that ``train()``'s loads (the Trainer sends such a callback no event before them), where the model's own
    watch (``patch_model``'s) still refuses a checkpoint that tapered other norms, without naming the fields.

    Refused before the first step: ``load_best_model_at_end=True`` (the Trainer would put a checkpoint of a
    higher gate back over the tapered model), ``label_smoothing_factor`` where the recipe adds terms to the model's
    loss (the Trainer would compute the loss itself and drop them), and TaperNorms whose forward a kernel patch
    (liger-kernel) replaced: when the Trainer is built, or at ``on_train_begin`` for a callback added with
    ``trainer.add_callback``. ``Trainer(compute_loss_func=...)``, which callbacks are not shown, is refused for the
    same reason at the end of the first step, whose forwards returned no loss.
    """

    def __init__(
        self,
        taper_start: Optional[Step] = None,
        taper_end: Optional[Step] = None,
        *,
        allow_incomplete: bool = False,
        max_scale_ratio: Optional[float] = None,
        thresholds: Optional[DivergenceThresholds] = None,
        allow_changes: AllowedChanges = (),
        trust_sharded_checkpoint: bool = False,
    ) -> None:
        self.taper_start, self.taper_end = taper_start, taper_end
        self.trust_sharded_checkpoint = trust_sharded_checkpoint  # a sharded teacher's index is a pickle
        self.allow_changes = allowed_changes(allow_changes)  # one string is one name, not its letters
        self.allow_incomplete = true_or_false(allow_incomplete, "TaperCallback: allow_incomplete=")  # "no" is true
        thresholds = divergence_thresholds(thresholds, max_scale_ratio, "TaperCallback")
        self.thresholds = thresholds
        if taper_start is not None or taper_end is not None:  # checked now, not at the first step
            TaperSchedule(taper_start if taper_start is not None else 0.05, taper_end if taper_end is not None else 0.7)
        self.controller: Optional[TaperController] = None
        self.placed_first = False  # set by place_first(trainer)
        self._watched: Optional[nn.Module] = None  # the model whose load watch it plugged into
        self._training_ended = False  # on_train_end came (since the Trainer was built)
        self._watched_args = None  # the TrainingArguments whose checkpoints it may resume from
        self._trainer_built_seen = False  # on_init_end came: Trainer(callbacks=[...]), not trainer.add_callback
        self._loss_checked = False  # the first step's forwards returned the model's loss

    def _schedule(self, config: TaperNormConfig, total_steps: int) -> TaperSchedule:
        """The schedule of a run of ``total_steps``: this callback's window, else the config's (at its defaults,
        fitted to a short run as the CLI and TaperController fit it: fit_default_window)."""
        if total_steps < 2:
            raise ConfigurationError(
                f"TaperCallback: the Trainer runs {total_steps} optimizer step (max_steps, or the steps of its "
                "epochs): a taper needs at least 2, one at g = 1 to calibrate and one at g = 0"
            )
        start, end = fit_default_window(
            config.taper_start if self.taper_start is None else self.taper_start,
            config.taper_end if self.taper_end is None else self.taper_end,
            total_steps,
            start_set=True if self.taper_start is not None else None,  # None: the config's, told by value
            end_set=True if self.taper_end is not None else None,
        )
        return TaperSchedule(start, end, allow_incomplete=self.allow_incomplete).resolve(total_steps)

    def on_init_end(self, args, state, control, model=None, **kwargs):
        refuse_a_second_taper_callback(self, state)
        self._trainer_built_seen = True
        self._check_the_trainer(args, model)
        if stable_steps_without_decay(args):  # transformers' get_wsd_schedule fails in train() without it
            raise ConfigurationError(
                "TaperCallback: lr_scheduler_type='warmup_stable_decay' with num_stable_steps needs num_decay_steps "
                "in lr_scheduler_kwargs too (the scheduler fails in train() without it); add num_decay_steps, or leave "
                "num_stable_steps out and TaperCallback sets num_decay_steps to the steps after the gate reaches 0"
            )
        max_steps = getattr(args, "max_steps", None)
        if model is not None and max_steps and max_steps > 0:  # a schedule that does not fit fails here, not later
            decay_learning_rate_after_the_taper(args, self._schedule(config_of(model), max_steps))
        elif decay_steps_missing(args):  # the Trainer builds the scheduler in train(), before any event of ours
            forget_written_decay(args)
            raise ConfigurationError(
                "TaperCallback: lr_scheduler_type='warmup_stable_decay' without num_decay_steps decays the learning "
                "rate after the gate reaches 0, a step known only from max_steps, and this run is set by "
                "num_train_epochs; set max_steps in TrainingArguments, or lr_scheduler_kwargs={'num_decay_steps': N}"
            )

    def _check_the_trainer(self, args, model) -> None:
        """What is refused before training: when the Trainer is built (on_init_end), or at on_train_begin for a
        callback added with ``trainer.add_callback``, which the Trainer never sends on_init_end."""
        # Fail inside Trainer(...): an unpatched model would otherwise reach the checkpoint loader first,
        # which drops the TaperNorm state (non-strict load) or fails on the optimizer's parameter groups.
        if model is not None and not any(tapered_norms(model, include_kept=True)):
            raise TaperStateError(
                f"TaperCallback: {type(model).__name__} has no TaperNorm layers: call hf_tapernorm.patch_model(model) "
                "before building the Trainer (also when resuming from a checkpoint)"
            )
        if getattr(args, "load_best_model_at_end", False):
            raise ConfigurationError(
                "TaperCallback: load_best_model_at_end=True makes the Trainer load its best checkpoint over the "
                "tapered model at the end, which can be one saved before the gate reached 0 (a normalized model, "
                "which fold_model refuses); set load_best_model_at_end=False (the last step's model is the tapered one)"
            )
        if model is not None and getattr(args, "label_smoothing_factor", 0):
            refuse_loss_outside_the_model(
                model,
                f"label_smoothing_factor={args.label_smoothing_factor:g} makes the Trainer compute the loss itself "
                "from the logits, taking the labels from the model's inputs",
                "set label_smoothing_factor=0",
            )
        # DeepSpeed ZeRO-3 and FSDP v1 (asked for, or already applied to the model) fail here, before training.
        refuse_unsupported_trainer_sharding(args)
        if model is not None:
            refuse_unsupported_sharding(model)
            refuse_replaced_forward(model, "TaperCallback")  # a kernel patch applied after patch_model
            self._watch_checkpoint_loads(args, model)
        refuse_ddp_without_unused_parameters(args, model)

    def _watch_checkpoint_loads(self, args, model) -> None:
        """Watch every load of weights into ``model`` from now on (recipe_check.watch_checkpoint_loads): the Trainer
        loads a checkpoint's weights, then its optimizer's state, in train() before on_train_begin, and in every
        train() of the Trainer, the second after a finished one too."""
        self._watched_args = args  # the latest Trainer's: its output_dir and resume_from_checkpoint
        self._training_ended = False  # this Trainer's train() may resume a checkpoint
        if self._watched is model:
            return
        if self._watched is not None:  # the same callback given to another Trainer's model
            stop_watching_checkpoint_loads(self._watched)
        candidates = lambda: resume_candidates(self._watched_args)  # noqa: E731 (read at each load)
        resuming = lambda: not self._training_ended  # noqa: E731 (adapters loaded after training are evaluated)
        watch_checkpoint_loads(model, candidates, "TaperCallback", self.allow_changes, resuming)
        self._watched = model

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        refuse_a_second_taper_callback(self, state)  # train() starts a new state: one added by add_callback counts
        if not self._trainer_built_seen:  # trainer.add_callback(...): the checks of Trainer(...) run now, before a step
            self._check_the_trainer(args, model)
        refuse_replaced_forward(model, "TaperCallback")  # the Trainer applies use_liger_kernel in train()
        reporters = [name for name in (args.report_to or []) if name != "none"]
        if reporters and not self.placed_first:
            logger.warning(
                "TaperCallback: the reporting callbacks of report_to=%s run before it and miss the taper/* log keys; "
                "call hf_tapernorm.training.place_first(trainer) before trainer.train()",
                reporters,
            )
        config = config_of(model)
        self.controller = TaperController(model, self._schedule(config, state.max_steps), thresholds=self.thresholds)
        self._refuse_anothers_decay(args, state.max_steps)  # the Trainer built the scheduler before this event
        self._loss_checked = not loss_terms_on_the_model_loss(model)  # nothing to lose: nothing to check
        loss_terms_of(model).forwards_without_loss = 0  # counted from this run's first forward
        if state.global_step > 0:
            self._resume(args, state, config)
        else:
            self._refuse_a_tapered_model(model)
        schedule = self.controller.schedule
        logger.info(
            "TaperCallback (recipe %s): g = 1 for steps 1-%d (calibration), cosine to g = 0 at step %d of %d%s",
            config.recipe,
            schedule.k_start,
            schedule.k_end,
            schedule.total_steps,
            f"; distilling (weight {config.distillation.weight:g}, teacher: {config.experimental.distill_from})"
            if self.controller.distillation is not None
            else "",
        )

    def _refuse_anothers_decay(self, args, max_steps: int) -> None:
        """Refuse a num_decay_steps that a TaperCallback wrote into the arguments for another window or run length
        than this run's: the Trainer has built the scheduler with it, before this first event of train(), so the
        learning rate would decay from another taper end. Written by another Trainer's callback sharing the arguments
        (built after this Trainer, or before this callback added with trainer.add_callback), or by this one for
        a max_steps changed since this Trainer was built."""
        written, own = written_decay_steps(args), decay_steps_of(self.controller.schedule)
        if written is None or written == own:
            return
        held = f"TaperCallback: lr_scheduler_kwargs holds num_decay_steps={written}"
        if not self._trainer_built_seen:
            raise ConfigurationError(
                f"{held}, which another Trainer's TaperCallback set for its window on these TrainingArguments (this "
                f"run's is {own}), and the Trainer built the scheduler with it before this callback, added with "
                "trainer.add_callback, saw a step; pass the callback in Trainer(callbacks=[...]) (it sets the value "
                "when the Trainer is built), or set num_decay_steps in lr_scheduler_kwargs"
            )
        computed_for = written_decay_run_length(args)
        if computed_for != max_steps:
            why = f"set for max_steps={computed_for} when the Trainer was built, but this run has max_steps={max_steps}"
        else:
            why = "which another Trainer's TaperCallback set for its window on these shared TrainingArguments"
        raise ConfigurationError(
            f"{held}, {why} (this run's is {own}), and the Trainer built the scheduler with it; give each Trainer "
            "its own TrainingArguments and change none after building it, or set num_decay_steps in "
            "lr_scheduler_kwargs"
        )

    def _resume(self, args, state, config: TaperNormConfig) -> None:
        folder = resumed_checkpoint(args, state)
        if is_adapter_checkpoint(folder):
            refuse_adapter_checkpoint(folder, "TaperCallback")
        self.controller._load_state(folder, "TaperCallback", self.trust_sharded_checkpoint, self.allow_changes)
        self.controller.check_resume(state.global_step)

    def _refuse_a_tapered_model(self, model) -> None:
        """A train() from step 0 (no resume) of a model an earlier train() or run tapered: its first step would set
        the gate back up over a model trained at a lower one (a second train() of a finished Trainer is a new run)."""
        held = lowest_gate(model)
        first = self.controller.schedule.gate(1)
        if first > held + 1e-6:
            raise TaperStateError(
                f"TaperCallback: the model holds gate {held:.6f}, so an earlier train() or run tapered it, and this "
                f"train() starts at step 0, whose gate {first:.6f} would set it back up over a model trained at the "
                "lower one; resume that run's checkpoint (train(resume_from_checkpoint=...)), or patch a fresh model "
                "for a new run"
            )

    def on_step_begin(self, args, state, control, **kwargs):
        self.controller.step_begin(state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        if not self._loss_checked:
            self._loss_checked = True
            self._refuse_a_lost_loss()
        self.controller.step_end(state.global_step - 1)

    def _refuse_a_lost_loss(self) -> None:
        """After the first step: refuse training forwards that all returned no loss. Trainer(compute_loss_func=...)
        or a Trainer subclass's compute_loss takes the labels from the model's inputs, and no callback is shown
        either: what they leave, the model's forwards without a loss, is the first sign."""
        terms = loss_terms_of(self.controller.model)
        if terms.pending_loss is None and terms.forwards_without_loss:
            refuse_loss_outside_the_model(
                self.controller.model,
                "the model's training forwards returned no loss: the Trainer computes it outside the model "
                "(Trainer(compute_loss_func=...), or a compute_loss that takes the labels from the model's inputs)",
                "leave compute_loss_func out",
            )

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or "loss" not in logs or self.controller is None:
            return  # evaluation and end-of-training summaries carry no taper metrics
        if isinstance(logs.get("grad_norm"), (int, float)):
            self.controller.check(state.global_step - 1, grad_norm=float(logs["grad_norm"]))
        add_to_training_log(state, logs, self.controller.log_metrics())

    def on_train_end(self, args, state, control, **kwargs):
        self._training_ended = True  # a checkpoint's adapters loaded from now on are a user's (evaluated), not resumed
        if self.controller is not None:  # after the final checkpoint: the teacher goes, the model's attention is back
            self.controller.end()

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if self.controller is None:
            return
        # An FSDP2 teacher is written by all ranks together: every rank calls, whatever its view of the folder.
        if self.controller.saves_collectively or (state.is_world_process_zero and folder.is_dir()):
            # the checkpoint the Trainer has just written with this run's weights (a re-run into the same
            # output_dir rewrites another run's checkpoint-N): its recipe is this run's, never a guarded one
            self.controller._save_state(folder, writes_weights=True)


def refuse_ddp_without_unused_parameters(args, model) -> None:
    """TaperNorm leaves parameters out of the graph by phase (taper_weight while g = 1, an RMS weight at g = 0), which
    plain DDP rejects unless it looks for unused parameters. The Trainer turns that off with activation
    checkpointing, and its DDP settings are fixed before callbacks run: fail early."""
    checkpointing = getattr(args, "activation_checkpointing", False) or getattr(
        model, "is_activation_checkpointing", False
    )
    find_unused = getattr(args, "ddp_find_unused_parameters", None)
    if find_unused is None:
        find_unused = not checkpointing
    distributed = getattr(args, "world_size", 1) > 1 and not getattr(args, "deepspeed", None)
    if distributed and not getattr(args, "fsdp", None) and not find_unused:
        raise ConfigurationError(
            "TaperCallback: distributed (DDP) training needs ddp_find_unused_parameters=True in TrainingArguments "
            "(the Trainer disables it with activation checkpointing): TaperNorm leaves taper_weight unused while "
            "g = 1 and the norm weight unused at g = 0"
        )


def loss_terms_on_the_model_loss(model) -> list[str]:
    """The recipe's terms that are added to ``outputs.loss`` (by their options, ``distill_weight=1``); none: the
    recipe adds nothing to the model's loss, and a loss computed outside the model loses nothing of it."""
    config = config_of(model)
    terms = [("scale_loss_weight", config.scale_loss_weight if scale_anchors(model) else 0.0)]
    terms += [("distill_weight", config.distillation.weight)]
    terms += [("sink_attention_weight", config.distillation.sink_attention_weight)]
    return [f"{name}={weight:g}" for name, weight in terms if weight > 0]


def refuse_loss_outside_the_model(model, what: str, advice: str) -> None:
    """Refuse a Trainer that computes the loss itself (``what`` says how it was told; ``advice``: the way back to the
    model's loss), where the recipe adds terms to the model's loss: the Trainer takes the labels out of the model's
    inputs, ``outputs.loss`` is None, and every term is dropped (a gated-mlp recipe ran to g = 0 with none of them,
    and one WARNING blamed missing labels)."""
    terms = loss_terms_on_the_model_loss(model)
    if not terms:
        return
    raise ConfigurationError(
        f"TaperCallback: {what}, so outputs.loss is None and the recipe's terms added to it ({', '.join(terms)}) "
        f"would all be dropped; {advice} (the model's own loss carries them), or set those weights to 0 in the "
        "TaperNormConfig"
    )


def resumed_checkpoint(args, state: TrainerState) -> Path:
    """The checkpoint folder the Trainer restored ``state`` from, found through public state only.

    Candidates: ``args.resume_from_checkpoint`` (a path), then ``<output_dir>/checkpoint-<global_step>``
    (``resume_from_checkpoint=True`` takes the last of those). A candidate is the one when its
    ``trainer_state.json`` holds the restored step and log history: a folder of another run is not taken.
    """
    candidates = []
    if isinstance(getattr(args, "resume_from_checkpoint", None), str):
        candidates.append(Path(args.resume_from_checkpoint))
    candidates.append(Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
    for folder in candidates:
        saved = folder / TRAINER_STATE_NAME
        if not saved.is_file():
            continue
        restored = TrainerState.load_from_json(str(saved))
        if restored.global_step == state.global_step and restored.log_history == state.log_history:
            return folder
    raise TaperStateError(
        f"TaperCallback: resuming at step {state.global_step}, but no checkpoint with that state is in "
        f"{' or '.join(str(c) for c in candidates)}; a checkpoint outside output_dir must also be named in "
        "TrainingArguments(resume_from_checkpoint=...), where TaperCallback reads the recipe's state"
    )


#: The attribute of a TrainerState where each TaperCallback the Trainer calls with it writes itself down: callbacks
#: are not shown the Trainer's list, but every callback of one Trainer gets the same state (a new one per train()).
_SEEN_ON_STATE = "_tapernorm_callbacks"


def refuse_a_second_taper_callback(callback: TaperCallback, state: TrainerState) -> None:
    """Refuse a Trainer holding two TaperCallbacks (or one twice): each would set the gate at every step, and the last
    one's window would win without a word. Called first in on_init_end and on_train_begin, which the Trainer sends
    each callback once per state: the second one called finds the first written down."""
    if state is None:  # called by hand, outside a Trainer: nothing to count
        return
    seen = state.__dict__.setdefault(_SEEN_ON_STATE, [])
    seen.append(callback)
    refuse_other_than_one(len(seen), "TaperCallback", at_least=True)


def refuse_other_than_one(count: int, who: str, *, at_least: bool = False) -> None:
    """The Trainer must hold exactly one TaperCallback (``count`` of them found; ``at_least``: more may follow)."""
    if count == 1:
        return
    held = f"{count} or more" if at_least else str(count)
    advice = (
        "pass one in Trainer(callbacks=[...])"
        if count == 0
        else "keep one: each sets the gate at every step, and the last one's window would win (pass one in "
        "Trainer(callbacks=[...]), or add one with trainer.add_callback, not both)"
    )
    raise ConfigurationError(f"{who}: the Trainer holds {held} TaperCallback(s); {advice}")


def place_first(trainer) -> TaperCallback:
    """Move the trainer's TaperCallback to the front of its callbacks, so that every callback (reporters
    included) reads the ``taper/*`` log keys; returns it. Call it after building the Trainer, before
    ``train()``: ``Trainer.callback_handler.callbacks`` is the list the Trainer calls in order."""
    callbacks = trainer.callback_handler.callbacks
    found = [callback for callback in callbacks if isinstance(callback, TaperCallback)]
    refuse_other_than_one(len(found), "place_first")
    callbacks.remove(found[0])
    callbacks.insert(0, found[0])
    found[0].placed_first = True
    return found[0]


def add_to_training_log(state, logs: dict, metrics: dict[str, float]) -> None:
    """Add ``metrics`` to a training log from ``on_log``: to ``logs`` and to its copy in ``state.log_history``.

    Trainer.log copies ``logs`` into the history before ``on_log``; without the second update
    trainer_state.json (and everything read from it) would miss the keys.
    """
    logs.update(metrics)
    if state.log_history and state.log_history[-1].get("step") == state.global_step:
        state.log_history[-1].update(metrics)


__all__ = ["TaperCallback", "add_to_training_log", "place_first", "resumed_checkpoint"]
