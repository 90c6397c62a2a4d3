"""Drive a taper from any training loop: one object, two calls per optimizer step.

``TaperController`` holds no state that a checkpoint would need: the gate comes from the step
number, and the statistics, c and the scale target are buffers of the model. A loop resumed at
step N just starts calling it at N. :class:`~hf_tapernorm.callback.TaperCallback` is a thin
Trainer adapter over the same object.
"""

from __future__ import annotations

import logging
import math
from typing import Optional

import torch
from torch import nn

from .calibration import calibrate, update_statistics
from .patching import is_patched, set_gate, tapered_norms
from .scale_loss import DEVIATION_SUM, FORWARDS, LOSS_SUM, SCALE_SUM, TOKENS, ScaleAnchor, reduce_pending, scale_anchors
from .schedule import TaperSchedule

logger = logging.getLogger(__name__)


class TaperDivergenceError(RuntimeError):
    """Training diverged while tapering: the message names the step, the gate and the layer."""


def _refuse_sharded_parameters(model: nn.Module) -> None:
    """Calibration copies gamma into gammat and folding reads whole weights outside forward: both need
    full parameters. Under DeepSpeed ZeRO-3 and FSDP1 they are empty or flat shards there, so the copy
    would silently do nothing (or mix shards). Refuse instead of producing a wrong model."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(hasattr(p, "ds_id") for p in model.parameters()):
        engine = "DeepSpeed ZeRO-3"
    elif any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        engine = "FSDP (v1)"
    else:
        return
    raise NotImplementedError(
        f"hf_tapernorm does not support {engine} parameter sharding yet: calibration must copy each norm's "
        "gain into taper_weight with the parameters gathered. Use DDP (the Trainer's default for several "
        "processes) or ZeRO stage 1/2"
    )


class TaperController:
    """Sets the gate, gathers statistics, calibrates and watches for divergence, per optimizer step.

    ``step`` arguments count optimizer steps already completed (the Trainer's ``state.global_step``,
    or ``i`` in ``for i in range(total_steps)``): the update about to run is number ``step + 1`` of
    the schedule. Every rank of a distributed run must make the same calls (statistics are
    all-reduced, so all ranks compute the same c and target).

    ``max_scale_ratio``: once the scale target is frozen, a step whose mean residual scale (the
    final norm's input) exceeds this multiple of the target stops training with
    :class:`TaperDivergenceError`; a non-finite loss or scale always does.
    """

    def __init__(
        self,
        model: nn.Module,
        schedule: Optional[TaperSchedule] = None,
        total_steps: Optional[int] = None,
        *,
        max_scale_ratio: float = 100.0,
    ) -> None:
        if not is_patched(model):
            raise ValueError(
                f"{type(model).__name__} has no TaperNorm layers: call hf_tapernorm.patch_model(model) before "
                "training (and before resuming from a checkpoint, whose TaperNorm state would otherwise be dropped)"
            )
        if not any(True for _ in tapered_norms(model)):
            raise ValueError(f"{type(model).__name__} is patched but nothing tapers: check patch_model's scope")
        _refuse_sharded_parameters(model)
        schedule = schedule if schedule is not None else TaperSchedule()
        if total_steps is not None:
            schedule = schedule.resolve(total_steps)
        elif schedule.total_steps is None:
            raise ValueError("TaperController needs total_steps (or a schedule built with total_steps)")
        self.model = model
        self.schedule = schedule
        self.max_scale_ratio = float(max_scale_ratio)
        self.gate = 1.0
        self.anchors: list[ScaleAnchor] = scale_anchors(model)
        self._window = torch.zeros(5, dtype=torch.float64)  # anchor sums since the last log_metrics()

    # ------------------------------------------------------------------ resume checks
    def check_resume(self, step: int) -> None:
        """Refuse a model whose TaperNorm state does not fit ``step`` (e.g. dropped by a non-strict load)."""
        if step > 0:
            # Past k_start every layer must be calibrated; before it, every layer must hold statistics.
            missing = [
                layer.site_name
                for _, layer in tapered_norms(self.model)
                if not layer.is_calibrated and (step > self.schedule.k_start or int(layer.ema_steps) == 0)
            ]
            if missing:
                raise RuntimeError(
                    f"resuming at optimizer step {step} (k_start={self.schedule.k_start}) but {len(missing)} "
                    f"TaperNorm layer(s) lack their calibration state (first: {missing[0]}): the checkpoint carries "
                    "no TaperNorm state. Patch the model with patch_model(...) before the run that wrote the "
                    "checkpoint and before resuming"
                )
        if step > 0:
            expected = self.schedule.gate(step)
            for _, layer in tapered_norms(self.model):
                if not math.isclose(float(layer.gate), expected, abs_tol=1e-6):
                    logger.warning(
                        "resuming at step %d: %s has gate %.6f but the schedule gives %.6f for the last step; "
                        "the schedule changed since the checkpoint was written",
                        step, layer.site_name, float(layer.gate), expected,
                    )
                break

    # ------------------------------------------------------------------ per optimizer step
    def step_begin(self, step: int) -> float:
        """Before the micro-batches of update ``step + 1``: calibrate at k_start, set and return its gate."""
        number = step + 1
        gate = self.schedule.gate(number)
        if number > self.schedule.k_start:
            uncalibrated = [layer for _, layer in tapered_norms(self.model) if not layer.is_calibrated]
            if uncalibrated or any(not a.is_frozen for a in self.anchors):
                values = calibrate(self.model)
                if values:
                    logger.info(
                        "calibrated %d TaperNorm layer(s) after %d optimizer step(s) at g = 1 (c from %.4g to %.4g)",
                        len(values), step, min(values.values()), max(values.values()),
                    )
                else:  # every linear branch was fitted before training (e.g. fit_linear_branch)
                    logger.info("froze the scale anchor after %d optimizer step(s) at g = 1", step)
        set_gate(self.model, gate)
        self.gate = gate
        return gate

    def step_end(self, step: int, loss: Optional[float] = None) -> None:
        """After update ``step + 1``: one EMA step from all micro-batches (all-reduced); divergence watch.

        ``loss``: the step's loss when the loop computes it outside the model (the model's own
        ``outputs.loss`` is watched automatically).
        """
        update_statistics(self.model)
        totals = reduce_pending(self.anchors)
        for anchor, row in zip(self.anchors, totals):
            anchor.fold_pending(row)
        if len(totals):
            self._window += totals.sum(0).double()
        self._watch(step + 1, totals, loss)

    # ------------------------------------------------------------------ divergence watch
    def _watch(self, number: int, totals: torch.Tensor, loss: Optional[float]) -> None:
        where = f"at optimizer step {number} (gate {self.gate:.4f})"
        losses = [float(loss)] if loss is not None else []
        scales: list[tuple[ScaleAnchor, float]] = []
        for anchor, row in zip(self.anchors, totals.tolist()):
            if row[FORWARDS] > 0:
                losses.append(row[LOSS_SUM])
            if row[TOKENS] > 0:
                scales.append((anchor, row[SCALE_SUM] / row[TOKENS]))
        if any(not math.isfinite(value) for value in losses):
            raise TaperDivergenceError(f"training diverged {where}: the loss is not finite. {self._culprit()}")
        for anchor, scale in scales:
            if not math.isfinite(scale):
                raise TaperDivergenceError(
                    f"training diverged {where}: the residual scale entering {anchor.site_name} is not finite. "
                    f"{self._culprit()}"
                )
            if anchor.is_frozen and scale > self.max_scale_ratio * float(anchor.target):
                raise TaperDivergenceError(
                    f"training diverged {where}: the residual scale entering {anchor.site_name} is {scale:.4g}, "
                    f"{scale / float(anchor.target):.1f}x its target {float(anchor.target):.4g} (limit "
                    f"{self.max_scale_ratio:g}x). {self._culprit()}"
                )

    def _culprit(self) -> str:
        """Name the first TaperNorm (in model order) whose parameters or c stopped being finite."""
        for _, layer in tapered_norms(self.model):
            tensors = [layer.c, layer.taper_weight] + [p for p in (layer.weight, layer.bias) if p is not None]
            if not all(bool(torch.isfinite(t).all()) for t in tensors):
                return (
                    f"First layer with non-finite parameters: {layer.site_name} (c={float(layer.c):.4g}). Lower "
                    "the learning rate, taper more slowly (a later k_end) or raise scale_loss_weight"
                )
        return (
            "All TaperNorm parameters are still finite. Lower the learning rate, taper more slowly "
            "(a later k_end) or raise scale_loss_weight"
        )

    # ------------------------------------------------------------------ logging
    def log_metrics(self) -> dict[str, float]:
        """Gate, scale loss and residual scale averaged since the previous call (then reset)."""
        window = self._window
        self._window = torch.zeros_like(window)
        metrics = {"taper/gate": self.gate}
        if window[TOKENS] > 0:
            metrics["taper/residual_scale"] = float(window[SCALE_SUM] / window[TOKENS])
            weight = float(self.anchors[0].scale_loss_weight) if self.anchors else 0.0
            metrics["taper/scale_loss"] = weight * float(window[DEVIATION_SUM] / window[TOKENS])
        return metrics


__all__ = ["TaperController", "TaperDivergenceError"]
