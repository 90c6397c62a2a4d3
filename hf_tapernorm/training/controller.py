"""Drive a taper from any training loop: one object, two calls per optimizer step.

``TaperController`` reads the recipe from the model's TaperNormConfig (schedule window, distillation)
and keeps no state a checkpoint would need beyond what :meth:`save_state` writes: the gate comes from
the step number, and the statistics, c and the scale target are buffers of the model; only the
distillation teacher's snapshot lives outside it. A loop resumed at step N calls :meth:`load_state`
and then starts calling it at N. :class:`~hf_tapernorm.TaperCallback` is a thin Trainer adapter over
the same object.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Optional, Union

import torch
from torch import nn

from ..config import CONFIG_NAME, TaperNormConfig, check_save_destination, config_of
from ..errors import ConfigurationError, TaperStateError
from ..layers.loss_terms import loss_terms_of
from ..layers.patching import set_gate
from ..layers.scale_anchor import DEVIATION_SUM, SCALE_SUM, TOKENS, ScaleAnchor, scale_anchors
from ..layers.taper_norm import tapered_norms
from ..utils import all_reduce_sum, expand_user
from .calibration import calibrate, update_statistics
from .controller_checks import (
    check_controller_arguments,
    refuse_norms_in_modules_to_save,
    watched_value,
    whole_step,
)
from .distillation import SHARDED_SNAPSHOT_NAME, SNAPSHOT_NAME, Distillation, frozen_copy
from .distributed import (
    is_main_process,
    load_sharded_module,
    refuse_unsupported_sharding,
    refuse_untrusted_sharded_checkpoint,
    save_sharded_module,
    sharding_engine,
)
from .divergence import DivergenceThresholds, DivergenceWatch, divergence_thresholds
from .recipe_check import AllowedChanges, refuse_another_recipe
from .schedule import TaperSchedule, fit_default_window

logger = logging.getLogger(__name__)

_ANCHOR_SIZE = 3


def lowest_gate(model: nn.Module, default: float = 1.0) -> float:
    """The lowest gate of the model's tapered norms (``default`` where it has none): the gate a model holds, which a
    new run's first step must not raise (TaperController, TaperCallback)."""
    return min((float(layer.gate) for _, layer in tapered_norms(model)), default=default)


class TaperController:
    """Sets the gate, gathers statistics, calibrates, distils and watches for divergence, per optimizer step.

    ``step`` arguments count optimizer steps already completed (the Trainer's ``state.global_step``,
    or ``i`` in ``for i in range(total_steps)``): the update about to run is number ``step + 1`` of
    the schedule. Every rank of a distributed run must make the same calls (statistics are
    all-reduced, so all ranks compute the same c, target and divergence decision).

    ``schedule``: default, the taper window of the model's TaperNormConfig (where it is at its defaults, moved to
    fit a short run as the CLI moves it: ``fit_default_window``). ``thresholds``: the
    divergence watch (:class:`DivergenceThresholds`). ``distillation``: default, built from the config
    when ``config.distillation.weight > 0`` (``False`` turns it off; a :class:`Distillation` replaces it).
    """

    def __init__(
        self,
        model: nn.Module,
        schedule: Optional[TaperSchedule] = None,
        total_steps: Optional[int] = None,
        *,
        thresholds: Optional[DivergenceThresholds] = None,
        max_scale_ratio: Optional[float] = None,
        distillation: Union[Distillation, bool, None] = None,
    ) -> None:
        check_controller_arguments(model, schedule, distillation)
        if not any(tapered_norms(model, include_kept=True)):
            raise TaperStateError(
                f"{type(model).__name__} has no TaperNorm layers: call hf_tapernorm.patch_model(model) before "
                "training (and before resuming from a checkpoint, whose TaperNorm state would otherwise be dropped)"
            )
        if not any(True for _ in tapered_norms(model)):
            raise ConfigurationError(f"{type(model).__name__} is patched but nothing tapers: check its TaperNormConfig")
        refuse_norms_in_modules_to_save(model)
        refuse_unsupported_sharding(model)
        self.config: TaperNormConfig = config_of(model)
        if schedule is None:  # the config's window; one left at its defaults fits a short run, as in the CLI
            window = (self.config.taper_start, self.config.taper_end)
            schedule = TaperSchedule(*(window if total_steps is None else fit_default_window(*window, total_steps)))
        if total_steps is not None:
            schedule = schedule.resolve(total_steps)
        elif schedule.total_steps is None:
            raise ConfigurationError("TaperController needs total_steps (or a schedule built with total_steps)")
        thresholds = divergence_thresholds(thresholds, max_scale_ratio, "TaperController")
        self.model = model
        self._sharded = sharding_engine(model) == "fsdp2"
        self.schedule = schedule
        self.watch = DivergenceWatch(thresholds)
        self.gate = 1.0
        self.anchors: list[ScaleAnchor] = scale_anchors(model)
        self.distillation = self._distillation(distillation)
        self._window = torch.zeros(_ANCHOR_SIZE, dtype=torch.float64)  # anchor sums since the last log_metrics()
        self._trainable_checked = False
        self._last_step: Optional[int] = None  # the latest step_begin's (or check_resume's): steps never go back
        self._last_call = ""  # the latest of step_begin, step_end and check_resume (with its step), for the refusals
        self._open_step: Optional[int] = None  # the step step_begin began and step_end has not ended
        self._ended_step: Optional[int] = None  # the step the latest step_end ended: begun again, it counts twice
        self._resumed_unchecked = False  # load_state ran, check_resume did not: the next step_begin checks the gate
        self._started = False  # a step (not a replay) began, or check_resume past 0: the gate is the run's
        self._gate_met = lowest_gate(model)  # the model's gate before any step of this controller (a replay's too)

    def _distillation(self, given: Union[Distillation, bool, None]) -> Optional[Distillation]:
        if isinstance(given, Distillation):
            return given if given._model is self.model else given.attach(self.model)
        if given is False or self.config.distillation.weight == 0:
            return None
        teacher = frozen_copy(self.model) if self.config.experimental.distill_from == "original" else None
        return Distillation.from_config(self.config, teacher).attach(self.model)

    # ------------------------------------------------------------------ checkpoints and resume
    @property
    def saves_collectively(self) -> bool:
        """Whether :meth:`save_state` is a collective (every rank must call it): the teacher of an FSDP2 model
        is sharded, and each rank writes its own shards."""
        return self._sharded

    def save_state(self, folder: Union[str, Path]) -> None:
        """Write what the model's own checkpoint does not hold: the config and the distillation teacher.

        The main process writes the files; under FSDP2 every rank must call it, and the teacher is written as a
        torch.distributed.checkpoint folder (``distillation_teacher/``) by all ranks together. Refused beside weights
        trained with another recipe (check_save_destination)."""
        self._save_state(folder)

    def _save_state(self, folder: Union[str, Path], *, writes_weights: bool = False) -> None:
        """:meth:`save_state`; ``writes_weights``: the caller's own checkpoint, whose weights it has just written
        (TaperCallback into the Trainer's checkpoint-N, save_sharded_checkpoint), so the folder's recipe goes
        with the weights it was written for, whatever run wrote the folder before."""
        folder = expand_user(folder, f"TaperController.save_state: '{folder}'")
        # On every rank, before anything is written: a refusal on the main process alone would leave the others
        # waiting in the teacher's collective save.
        recipe = None if writes_weights else self.config
        check_save_destination(folder, "TaperController.save_state: cannot save the taper state", recipe=recipe)
        if is_main_process():
            folder.mkdir(parents=True, exist_ok=True)
            (folder / CONFIG_NAME).write_text(self.config.to_json_string())
        if self.distillation is None or not self.distillation.has_snapshot:
            return
        if sharding_engine(self.distillation.teacher) == "fsdp2":
            save_sharded_module(folder / SHARDED_SNAPSHOT_NAME, self.distillation.teacher)
        elif is_main_process():
            self.distillation.save_snapshot(folder / SNAPSHOT_NAME)

    def load_state(
        self,
        folder: Union[str, Path],
        *,
        trust_sharded_checkpoint: bool = False,
        allow_changes: AllowedChanges = (),
    ) -> None:
        """Restore :meth:`save_state`'s files from a checkpoint folder (before resuming at its step).

        The folder's ``tapernorm_config.json`` must be the model's config: a folder written under another recipe
        is refused, naming the fields that differ (``allow_changes``: options the resumed run may change on
        purpose; one string is one name), because its teacher's snapshot and the model's state belong to another
        taper. A sharded teacher (FSDP2) is read only with ``trust_sharded_checkpoint=True``: its DCP index is a
        pickle. Call :meth:`check_resume` with the step the loop resumes at next: later steps must not go below it.
        """
        self._load_state(folder, "TaperController.load_state", trust_sharded_checkpoint, allow_changes)

    def _load_state(
        self, folder: Union[str, Path], who: str, trust_sharded_checkpoint: bool, allow_changes: AllowedChanges
    ) -> None:
        """:meth:`load_state`, its messages starting with ``who`` (TaperCallback's resume calls it)."""
        folder = expand_user(folder, f"{who}: '{folder}'")
        if not folder.is_dir():  # a mistyped folder would restore nothing, and the teacher would be the model itself
            raise TaperStateError(f"{who}: no folder '{folder}'")
        if not refuse_another_recipe(folder, self.config, who, allow_changes):
            logger.warning("%s: %s holds no %s; cannot check that the recipe is unchanged", who, folder, CONFIG_NAME)
        self._resumed_unchecked = True  # the next step_begin must not raise the model's gate (check_resume clears it)
        if self.distillation is None:
            return
        if (folder / SHARDED_SNAPSHOT_NAME).is_dir():
            refuse_untrusted_sharded_checkpoint(folder / SHARDED_SNAPSHOT_NAME, trust_sharded_checkpoint)
            load_sharded_module(folder / SHARDED_SNAPSHOT_NAME, self.distillation.restored_teacher(self.model))
        elif (folder / SNAPSHOT_NAME).is_file():
            self.distillation.load_snapshot(folder / SNAPSHOT_NAME, self.model)

    def check_resume(self, step: int) -> None:
        """Refuse a model whose TaperNorm state does not fit ``step`` (dropped by a non-strict load, or a
        checkpoint written with another schedule). The resumed loop goes on from ``step``: a later step_begin below
        it is refused, as a step that goes back is (a loop that forgot its start step would raise the gate again)."""
        step = whole_step(step, "check_resume")
        self._last_step, self._last_call, self._resumed_unchecked = step, f"check_resume({step})", False
        if step <= 0:  # a resume at step 0 is a fresh start: its first step is checked as one
            return
        self._started = True
        # Past k_start every layer must be calibrated; before it, every layer must hold statistics.
        missing = [
            layer.site_name
            for _, layer in tapered_norms(self.model)
            if not layer.is_calibrated and (step > self.schedule.k_start or int(layer.ema_steps) == 0)
        ]
        if missing:
            raise TaperStateError(
                f"resuming at optimizer step {step} (k_start={self.schedule.k_start}) but {len(missing)} "
                f"TaperNorm layer(s) lack their calibration state (first: {missing[0]}): the checkpoint carries "
                "no TaperNorm state. Patch the model with patch_model(...) before the run that wrote the "
                "checkpoint and before resuming"
            )
        expected = self.schedule.gate(step)
        for _, layer in tapered_norms(self.model):
            if not math.isclose(float(layer.gate), expected, abs_tol=1e-6):
                raise TaperStateError(
                    f"resuming at step {step}: {layer.site_name} has gate {float(layer.gate):.6f} but this run's "
                    f"schedule (taper {self.schedule.k_start} -> {self.schedule.k_end} of {self.schedule.total_steps} "
                    f"steps) gives {expected:.6f} for that step: the schedule changed since the checkpoint was "
                    "written. Resume with the original max_steps and taper window"
                )
            break

    # ------------------------------------------------------------------ per optimizer step
    def step_begin(self, step: int, *, replay: bool = False) -> float:
        """Before the micro-batches of update ``step + 1``: calibrate at k_start, set and return its gate.

        Steps never go back, nor is a step step_end ended begun again (refused); ``replay=True`` runs an earlier step
        again on purpose, as a benchmark that times the same steps over and over does (the gate rises with it). After
        a step never ended, the update's statistics start afresh (_discard_pending)."""
        step = whole_step(step, "step_begin")
        number = step + 1
        gate = self.schedule.gate(number)
        if not replay:
            self._refuse_going_back(step)
            self._refuse_an_ended_step(step)
            self._refuse_a_rising_gate(step, gate)
        if self._open_step is not None:  # a step begun and never ended: a retry, or a step given up
            self._discard_pending(step)
        self._last_step, self._last_call, self._open_step = step, f"step_begin({step})", step
        if not self._trainable_checked:  # at the first step, when the loop has chosen what trains
            self._trainable_checked = True
            warn_if_taper_parameters_frozen(self.model)
        if number > self.schedule.k_start:
            uncalibrated = [layer for _, layer in tapered_norms(self.model) if not layer.is_calibrated]
            if uncalibrated or any(not a.is_frozen for a in self.anchors):
                values = calibrate(self.model)
                if values:
                    logger.info(
                        "calibrated %d TaperNorm layer(s) after %d optimizer step(s) at g = 1 (c from %.4g to %.4g)",
                        len(values),
                        step,
                        min(values.values()),
                        max(values.values()),
                    )
                else:  # every linear branch was fitted before training (e.g. fit_linear_branch)
                    logger.info("froze the scale anchor after %d optimizer step(s) at g = 1", step)
        set_gate(self.model, gate)
        self.gate = gate
        if self.distillation is not None:
            self.distillation.step_begin(self.model, gate, previous_gate=self.schedule.gate(step))
        return gate

    def _refuse_going_back(self, step: int) -> None:
        """Refuse a step below the previous one. The gate follows the step, so a counter that restarts (the batch
        index of each epoch) would raise the gate again over a model already trained at a lower one; no run goes
        back (a resumed run is a new controller, which load_state restores and check_resume starts at its step). The
        same step again, before its step_end, is a retried update, and allowed (_refuse_an_ended_step)."""
        if self._last_step is None or step >= self._last_step:
            return
        advice = (
            "start the resumed loop at the step given to check_resume (for step in range(start_step, total_steps))"
            if self._last_call.startswith("check_resume")
            else "count steps across epochs (a global step, not the batch index of an epoch), or build a new "
            "TaperController for a new run"
        )
        raise TaperStateError(
            f"TaperController.step_begin({step}) after {self._last_call}: steps count the optimizer updates of the "
            "whole run and must not go back (the gate follows them, and would rise again over a model trained at a "
            f"lower one); {advice}"
        )

    def _refuse_an_ended_step(self, step: int) -> None:
        """Refuse step_begin of the step step_end ended: begun and ended again, its statistics and watch would count
        twice under one number. A retry calls step_begin again before step_end; a benchmark's repeats say replay."""
        if step == self._ended_step:
            raise TaperStateError(
                f"TaperController.step_begin({step}) after step_end({step}): that update was ended and its statistics "
                f"counted; the next update is step_begin({step + 1}) (a retried update calls step_begin({step}) again "
                "before step_end, and replay=True repeats steps on purpose)"
            )

    def _discard_pending(self, step: int) -> None:
        """Drop what micro-batches gathered in a step begun and never ended (an attempt given up after an out-of-memory
        error, a step skipped): no completed update's, which step_end would fold into this one. Forwards before the
        first step are kept (calibration reads them). Local: every rank makes the same calls; step_end all-reduces."""
        holders = [*(layer for _, layer in tapered_norms(self.model, include_kept=True)), *self.anchors]
        dropped = [holder for holder in holders if holder.pending is not None]
        for holder in dropped:
            holder.pending = None
        if loss_terms_of(self.model).take_pending_loss() is not None or dropped:
            logger.info("TaperController.step_begin(%d): dropped what a step never ended gathered", step)

    def _refuse_a_rising_gate(self, step: int, gate: float) -> None:
        """The first step after load_state (check_resume not called), or of a new controller: refuse a gate above the
        model's. A resumed model holds the gate of its checkpoint's step, which the schedule never exceeds later on,
        and a model below gate 1 was tapered by an earlier run (or train()); a loop that starts again at 0 (its start
        step forgotten), or a new schedule from its start, would set it back up over a model trained at the lower one.
        """
        after_load_state = self._resumed_unchecked
        if not after_load_state and self._started:
            return
        self._resumed_unchecked, self._started = False, True
        held = lowest_gate(self.model, gate)
        if not after_load_state:  # a replayed step may have raised it: the gate held is the one met
            held = min(held, self._gate_met)
        if gate <= held + 1e-6:
            return
        if after_load_state:
            raise TaperStateError(
                f"TaperController.step_begin({step}) after load_state: the model holds gate {held:.6f} and step "
                f"{step} would set it back up to {gate:.6f} over a model trained at the lower one; start the resumed "
                "loop at its step (for step in range(start_step, total_steps)) and call check_resume(start_step) "
                "after load_state"
            )
        raise TaperStateError(
            f"TaperController.step_begin({step}): the model holds gate {held:.6f}, so an earlier run tapered it, and "
            f"this controller's step {step} would set it back up to {gate:.6f} over a model trained at the lower one; "
            "to go on with that run, load_state(its checkpoint) and check_resume(its step) first; for a new run, patch "
            "a fresh model"
        )

    def step_end(self, step: int, loss: Optional[float] = None, grad_norm: Optional[float] = None) -> None:
        """After update ``step + 1``: one EMA step from all micro-batches (all-reduced); divergence watch. It ends
        the step ``step_begin(step)`` began, once (refused otherwise).

        ``loss``: the step's loss when the loop computes it outside the model (the model's own
        ``outputs.loss`` is watched automatically). ``grad_norm``: the step's gradient norm, when known.
        """
        step = whole_step(step, "step_end")  # before the statistics step: a refused call changes nothing
        loss, grad_norm = watched_value(loss, "loss", "step_end"), watched_value(grad_norm, "grad_norm", "step_end")
        self._refuse_another_step_end(step)
        self._open_step, self._ended_step, self._last_call = None, step, f"step_end({step})"
        update_statistics(self.model)
        anchor_rows, own_loss = self._reduce_step()
        for anchor, row in zip(self.anchors, anchor_rows):
            anchor.fold_pending(row)
        if len(anchor_rows):
            self._window += anchor_rows.sum(0).double()
        if loss is None and own_loss is not None:
            loss = own_loss
        scales = tuple(
            (anchor.site_name, float(row[SCALE_SUM] / row[TOKENS]), float(anchor.target) if anchor.is_frozen else None)
            for anchor, row in zip(self.anchors, anchor_rows)
            if row[TOKENS] > 0
        )
        self.check(step, loss=loss, grad_norm=grad_norm, scales=scales)

    def _refuse_another_step_end(self, step: int) -> None:
        """Refuse a step_end that ends no step_begin's step: the EMA statistics it folds in and the divergence watch
        it feeds are of the update step_begin set the gate for, so one with no step_begin (or a second for the same
        step) would count micro-batches twice or at a gate never set, and another step number would log the watch
        under the wrong update."""
        if self._open_step == step:
            return
        began = f"the step step_begin({self._open_step}) began" if self._open_step is not None else "no step begun"
        ended = f": step {step} has ended already" if step == self._ended_step and self._open_step is None else ""
        raise TaperStateError(
            f"TaperController.step_end({step}) with {began} (the last call was {self._last_call or 'none'}{ended}): "
            "each optimizer update is step_begin(step) before its forward passes, then step_end(step) with the same "
            "step after optimizer.step()"
        )

    def check(self, step: int, *, loss=None, grad_norm=None, scales=()) -> None:
        """Feed the divergence watch for update ``step + 1`` (the Trainer adapter adds the gradient norm here)."""
        step = whole_step(step, "check")
        loss, grad_norm = watched_value(loss, "loss", "check"), watched_value(grad_norm, "grad_norm", "check")
        self.watch.check(
            f"at optimizer step {step + 1} (gate {self.gate:.4f})",
            loss=loss,
            grad_norm=grad_norm,
            scales=scales,
            culprit=self._culprit() if _needs_culprit(loss, scales) else _ADVICE,
        )

    def _reduce_step(self) -> tuple[torch.Tensor, Optional[float]]:
        """This step's anchor sums and mean model loss over all micro-batches and ranks, in one all-reduce."""
        device = self.anchors[0].ema.device if self.anchors else torch.device("cpu")
        rows = []
        for anchor in self.anchors:
            pending, anchor.pending = anchor.pending, None
            rows.append(pending.to(device) if pending is not None else torch.zeros(_ANCHOR_SIZE, device=device))
        pending_loss = loss_terms_of(self.model).take_pending_loss()
        rows.append(pending_loss.to(device).reshape(2) if pending_loss is not None else torch.zeros(2, device=device))
        flat = all_reduce_sum(torch.cat([r.reshape(-1).float() for r in rows])).cpu()
        anchors = flat[: _ANCHOR_SIZE * len(self.anchors)].reshape(len(self.anchors), _ANCHOR_SIZE)
        loss_sum, forwards = flat[-2:].tolist()
        return anchors, (loss_sum / forwards if forwards else None)

    def _culprit(self) -> str:
        """Name the first TaperNorm (in model order) whose parameters or c stopped being finite."""
        for _, layer in tapered_norms(self.model):
            tensors = [layer.c, layer.taper_weight] + [p for p in (layer.weight, layer.bias) if p is not None]
            if not all(bool(torch.isfinite(t).all()) for t in tensors):
                return f"First layer with non-finite parameters: {layer.site_name} (c={float(layer.c):.4g}). {_ADVICE}"
        return f"All TaperNorm parameters are still finite. {_ADVICE}"

    def end(self) -> None:
        """After the last step: the distillation's terms leave the model, its teacher is released and the model
        has its own attention implementation back (the sink-attention term trains with an attention that reports
        the sink's share). Call it once training is over and the last checkpoint saved; the controller drives
        nothing after it."""
        if self.distillation is not None:
            self.distillation.remove()
            self.distillation = None

    # ------------------------------------------------------------------ logging
    def log_metrics(self) -> dict[str, float]:
        """Gate, scale loss, residual scale and distillation term averaged since the previous call (then reset)."""
        window = self._window
        self._window = torch.zeros_like(window)
        metrics = {"taper/gate": self.gate}
        if window[TOKENS] > 0:
            metrics["taper/residual_scale"] = float(window[SCALE_SUM] / window[TOKENS])
            weight = float(self.anchors[0].scale_loss_weight) if self.anchors else 0.0
            metrics["taper/scale_loss"] = weight * float(window[DEVIATION_SUM] / window[TOKENS])
        if self.distillation is not None:
            metrics.update(self.distillation.log_metrics())
        return metrics


_ADVICE = "Lower the learning rate, taper more slowly (a later taper_end) or keep more norms (keep_norms)"


def warn_if_taper_parameters_frozen(model: nn.Module) -> None:
    """Warn when the model trains but its TaperNorms' own parameters do not (PEFT/LoRA freezes them).

    The taper then runs with each linear map fixed at its calibration: the recipe lets those maps (and the
    norm weights folded with them) adapt while the gate falls, and a frozen run ends worse without saying why.
    """
    if not any(p.requires_grad for p in model.parameters()):
        return  # nothing trains (an evaluation loop): nothing to say
    frozen = [
        f"{name}.{attribute}"
        for name, layer in tapered_norms(model)
        for attribute in ("weight", "bias", "taper_weight")
        if isinstance(getattr(layer, attribute, None), nn.Parameter) and not getattr(layer, attribute).requires_grad
    ]
    if frozen:
        logger.warning(
            "%d TaperNorm parameter(s) are frozen while the model trains (%s%s): the taper's linear maps cannot "
            "adapt as the gate falls. PEFT/LoRA freezes them: call "
            "hf_tapernorm.layers.train_tapernorm_parameters(model) after get_peft_model (docs: 'LoRA / PEFT')",
            len(frozen),
            ", ".join(frozen[:2]),
            ", ..." if len(frozen) > 2 else "",
        )


def _needs_culprit(loss: Optional[float], scales) -> bool:
    values = ([loss] if loss is not None else []) + [scale for _, scale, _ in scales]
    return any(not math.isfinite(v) for v in values)


__all__ = ["TaperController"]
