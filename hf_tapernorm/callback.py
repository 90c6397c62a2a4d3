"""TaperCallback: the taper as a ``transformers.Trainer`` callback, over :class:`TaperController`.

``Trainer(..., callbacks=[TaperCallback()])`` is all it takes: the run length comes from
``state.max_steps``, the gate from ``state.global_step`` alone (so a resumed run is right even
though the Trainer restores callback state only with ``restore_callback_states_from_checkpoint``),
and all other state lives in the model's buffers, which checkpoints carry.

Where the Trainer calls us (transformers v5, ``Trainer._run_epoch``): ``on_step_begin`` before the
first micro-batch of each optimizer step (the gate is then constant over the accumulated
micro-batches); ``on_step_end`` after ``optimizer.step()`` and ``global_step += 1``, before logging,
evaluation and checkpointing, so a divergence stops training before a broken state is saved.
"""

from __future__ import annotations

import logging
import sys
from typing import Optional

from transformers import TrainerCallback
from transformers.trainer_callback import CallbackHandler

from .controller import TaperController
from .patching import is_patched
from .schedule import CONTINUED_PRETRAINING, Step, TaperSchedule

logger = logging.getLogger(__name__)


def _running_handler() -> Optional[CallbackHandler]:
    """The CallbackHandler dispatching the current event (found on the call stack), if any."""
    frame = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, CallbackHandler):
            return owner
        frame = frame.f_back
    return None


class TaperCallback(TrainerCallback):
    """Warm up at g = 1, calibrate at ``taper_start``, cosine-decay the gate to exactly 0 at ``taper_end``.

    ``taper_start``/``taper_end``: optimizer steps (int) or fractions of ``max_steps`` (float);
    None means our continued-pretraining default (5% and 70%). ``allow_incomplete=True`` lets a run
    end before g reaches 0 (warning instead of error). ``max_scale_ratio``: see
    :class:`TaperController`.

    Logs ``taper/gate``, ``taper/scale_loss`` and ``taper/residual_scale`` with every training log.
    The Trainer places reporting callbacks (TensorBoard, W&B, ...) before user callbacks and passes
    them one shared ``logs`` dict, so at ``on_train_begin`` this callback moves itself to the front
    of the Trainer's callback list: its ``on_log`` then adds the keys before any reporter reads them.
    """

    def __init__(
        self,
        taper_start: Optional[Step] = None,
        taper_end: Optional[Step] = None,
        *,
        allow_incomplete: bool = False,
        max_scale_ratio: float = 100.0,
    ) -> None:
        self.schedule = TaperSchedule(
            CONTINUED_PRETRAINING[0] if taper_start is None else taper_start,
            CONTINUED_PRETRAINING[1] if taper_end is None else taper_end,
            allow_incomplete=allow_incomplete,
        )
        self.max_scale_ratio = max_scale_ratio
        self.controller: Optional[TaperController] = None

    def on_init_end(self, args, state, control, model=None, **kwargs):
        # Fail inside Trainer(...): an unpatched model would otherwise reach the checkpoint loader first,
        # which drops the TaperNorm state (non-strict load) or fails on the optimizer's parameter groups.
        if model is not None and not is_patched(model):
            raise ValueError(
                f"TaperCallback: {type(model).__name__} has no TaperNorm layers: call hf_tapernorm.patch_model(model) "
                "before building the Trainer (also when resuming from a checkpoint)"
            )
        # TaperNorm leaves parameters out of the graph by phase (taper_weight while g = 1, an RMS weight at
        # g = 0), which plain DDP rejects unless it looks for unused parameters. The Trainer turns that off
        # with activation checkpointing, and its DDP settings are fixed before callbacks run: fail early.
        checkpointing = args.activation_checkpointing or getattr(model, "is_activation_checkpointing", False)
        find_unused = args.ddp_find_unused_parameters
        if find_unused is None:
            find_unused = not checkpointing
        if args.world_size > 1 and not args.deepspeed and not args.fsdp and not find_unused:
            raise ValueError(
                "TaperCallback: distributed (DDP) training needs ddp_find_unused_parameters=True in TrainingArguments "
                "(the Trainer disables it with activation checkpointing): TaperNorm leaves taper_weight unused while "
                "g = 1 and the norm weight unused at g = 0"
            )

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        handler = _running_handler()
        if handler is None:
            logger.warning(
                "TaperCallback could not find the Trainer's callback list; reporting callbacks listed before it "
                "will not receive the taper/* log keys"
            )
        elif handler.callbacks[0] is not self:
            # Index-safe while the handler iterates: the callbacks after us keep their positions.
            handler.callbacks.remove(self)
            handler.callbacks.insert(0, self)
        self.controller = TaperController(
            model, self.schedule, state.max_steps, max_scale_ratio=self.max_scale_ratio
        )
        self.controller.check_resume(state.global_step)
        schedule = self.controller.schedule
        logger.info(
            "TaperCallback: g = 1 for steps 1-%d (calibration), cosine to g = 0 at step %d of %d",
            schedule.k_start, schedule.k_end, schedule.total_steps,
        )

    def on_step_begin(self, args, state, control, **kwargs):
        self.controller.step_begin(state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        self.controller.step_end(state.global_step - 1)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or "loss" not in logs or self.controller is None:
            return  # evaluation and end-of-training summaries carry no taper metrics
        add_to_training_log(state, logs, self.controller.log_metrics())


def add_to_training_log(state, logs: dict, metrics: dict[str, float]) -> None:
    """Add ``metrics`` to a training log from ``on_log``: to ``logs`` and to its copy in ``state.log_history``.

    Trainer.log copies ``logs`` into the history before ``on_log``; without the second update
    trainer_state.json (and everything read from it) would miss the keys.
    """
    logs.update(metrics)
    if state.log_history and state.log_history[-1].get("step") == state.global_step:
        state.log_history[-1].update(metrics)


__all__ = ["TaperCallback"]
