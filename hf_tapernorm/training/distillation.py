"""Distillation from a frozen copy of the model while the gate closes (the default for gated-MLP models).

The term is ``weight * KL(teacher || student)`` on the next-token distributions, added to training
losses through ``layers/loss_terms.py``. The teacher is the model itself, frozen at one moment:
when the gate first falls below 1 (``distill_from="gate_start"``, the default: the model has then already
adapted to the new data at g = 1, so the KL repairs only what tapering breaks) or, as an experimental option
(``TaperNormConfig.experimental``), before training.
It costs a second copy of the weights (no gradients, no optimizer state; under FSDP2 a second shard per
rank) and a teacher forward per training forward; with
``distill_until="taper_end"`` the teacher is released once the gate reaches 0, and later steps cost what a
normalized step costs. ``TaperController`` (and so ``TaperCallback``) builds it from the model's
TaperNormConfig and saves the snapshot with checkpoints; nobody needs to build one by hand.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
from safetensors.torch import load_model, save_model
from torch import nn

from ..config import DistillationConfig, ExperimentalOptions, TaperNormConfig
from ..config_fields import DistillSchedule, DistillUntil, Teacher
from ..errors import ConfigurationError
from ..layers.load_watch import load_watch_of
from ..layers.loss_terms import ForwardInputs, add_training_loss_term, remove_training_loss_term
from ..layers.patching import gate_of
from ..layers.taper_norm import normalized, tapered_norms
from .distributed import sharded_copy, sharding_engine
from .sink_attention import SinkAttention

logger = logging.getLogger(__name__)

SNAPSHOT_NAME = "distillation_teacher.safetensors"
SHARDED_SNAPSHOT_NAME = "distillation_teacher"  # the FSDP2 teacher: a torch.distributed.checkpoint folder
_TERM = "distillation"


def frozen_copy(model: nn.Module) -> nn.Module:
    """A frozen copy of a patched model that computes what its norms compute: every gate held at 1.

    A TaperNorm at gate 1 is exactly the norm it replaced, so the copy needs no unpatching and keeps
    the model's parameter names (its state dict loads the model's weights as they are). The copy
    carries no training hooks: it adds no loss terms and gathers no statistics. The copy of an FSDP2-sharded
    model is sharded the same way (``distributed.sharded_copy``): one more shard of the weights per rank.
    """
    if sharding_engine(model) == "fsdp2":
        teacher = sharded_copy(model)
    else:
        loss_terms = model.__dict__.pop("_tapernorm_loss_terms", None)
        try:
            teacher = copy.deepcopy(model)
        finally:
            if loss_terms is not None:
                model.__dict__["_tapernorm_loss_terms"] = loss_terms
        teacher._forward_pre_hooks.clear()  # the sink marker: a teacher at gate 1 normalizes every position anyway
        teacher._forward_hooks.clear()
    load_watch_of(teacher).stand_down()  # the model's state, statistics of tapered norms included, loads into it
    for _, layer in tapered_norms(teacher, include_kept=True):
        layer.anchor = None
        if layer.tapered:
            layer.tapered = False  # the gate of a copy never moves
            layer.gate.fill_(1.0)
            layer._phase = type(layer._phase).NORM
    return teacher.eval().requires_grad_(False)


class Distillation:
    """``weight * KL(teacher || student)`` added to every training loss of the model it is attached to.

    The keywords are TaperNormConfig's options of the same names (``weight`` is ``distill_weight``), with the
    same values and, but for ``weight``, the same defaults (:meth:`from_config`). ``distill_from`` and
    ``distill_schedule`` other than their defaults are experimental options (``config.experimental``).
    ``teacher``: a frozen model with the student's parameter names (``frozen_copy(model)``), fixed for the
    run with ``distill_from="original"``. With ``"gate_start"`` (the default) it may be None, and the teacher is then
    made at the snapshot: its weights are replaced by the student's at the first step whose gate is below 1
    (:meth:`step_begin`, or the first training forward below 1 when no controller drives it); the term is 0
    before that. ``distill_until="taper_end"``: the term ends, and the teacher is released, at the first
    step with gate 0. ``distill_schedule="gate"``: the weight times the current gate. Positions whose next
    label is -100 (padding, the sink's first-token prediction) are left out. ``sink_attention_weight`` > 0
    adds the sink-attention term (:mod:`.sink_attention`) on the same teacher forward, over the first
    ``sink_length`` positions (the sink tokens).

    ``distill_from="current"``: no copy at all; the teacher is the model itself with every gate at 1,
    evaluated on the same batch without gradient. It follows what the normalized model learns from the data
    while the gate falls (a snapshot stays where it was), and costs a forward but no memory.
    """

    def __init__(
        self,
        teacher: Optional[nn.Module] = None,
        *,
        weight: float = 1.0,
        distill_from: Teacher = ExperimentalOptions.distill_from,
        distill_until: DistillUntil = DistillationConfig.until,
        distill_schedule: DistillSchedule = ExperimentalOptions.distill_schedule,
        sink_attention_weight: float = DistillationConfig.sink_attention_weight,
        sink_length: int = 0,
    ) -> None:
        for name, value, allowed in (
            ("distill_from", distill_from, ExperimentalOptions.choices("distill_from")),
            ("distill_until", distill_until, DistillationConfig.choices("until")),
            ("distill_schedule", distill_schedule, ExperimentalOptions.choices("distill_schedule")),
        ):
            if value not in allowed:
                raise ConfigurationError(f"Distillation: {name} must be one of {', '.join(allowed)}, got {value!r}")
        if weight < 0 or sink_attention_weight < 0:
            raise ConfigurationError(
                f"Distillation needs weight >= 0 and sink_attention_weight >= 0, got {weight}, {sink_attention_weight}"
            )
        if distill_from == "current" and teacher is not None:
            raise ConfigurationError('Distillation(distill_from="current") uses the model itself: pass no teacher')
        if teacher is None and distill_from == "original":
            raise ConfigurationError(
                'Distillation needs a teacher unless distill_from is "gate_start" (which snapshots one) or "current"'
            )
        self.distill_from, self.distill_until, self.distill_schedule = distill_from, distill_until, distill_schedule
        live, from_gate_start = distill_from == "current", distill_from == "gate_start"
        self._live = live
        self._released = False
        self.teacher: Optional[nn.Module] = teacher.eval().requires_grad_(False) if teacher is not None else None
        self.weight = float(weight)
        self._from_gate_start = from_gate_start
        self._until_taper_end = distill_until == "taper_end"
        self._fade_with_gate = distill_schedule == "gate"
        # The model as it stands was trained at g = 1 only: a step (or training forward) at g = 1 ran in this process,
        # or the caller said the previous update's gate was 1 (a run resumed at the taper's start).
        self._saw_gate_one = False
        self._teacher_final = not from_gate_start  # no later change of the teacher
        self._gate: Optional[float] = None  # the current step's gate, when a controller tells it
        self._window = torch.zeros(2)  # sum of the terms added to training losses, forwards (since the last log)
        self._model: Optional[nn.Module] = None
        self.sink_attention = SinkAttention(sink_attention_weight, sink_length) if sink_attention_weight > 0 else None

    @classmethod
    def from_config(cls, config: TaperNormConfig, teacher: Optional[nn.Module] = None) -> Distillation:
        """The term a TaperNormConfig asks for (its ``distillation``, the sink-attention term over
        ``sink_token_ids``, and the experimental ``distill_from`` and ``distill_schedule``); ``teacher``: the
        frozen copy for ``distill_from="original"``."""
        return cls(
            teacher,
            weight=config.distillation.weight,
            distill_from=config.experimental.distill_from,
            distill_until=config.distillation.until,
            distill_schedule=config.experimental.distill_schedule,
            sink_attention_weight=config.distillation.sink_attention_weight,
            sink_length=len(config.sink_token_ids),
        )

    # ------------------------------------------------------------------ the teacher
    def load_teacher_from(self, model: nn.Module) -> None:
        """Copy ``model``'s current weights into the teacher (gates and statistics are not the teacher's)."""
        weights = {k: v for k, v in model.state_dict().items() if not _is_taper_state(k)}
        missing, _ = self.teacher.load_state_dict(weights, strict=False)
        missing = [k for k in missing if not _is_taper_state(k)]
        if missing:
            raise ConfigurationError(
                f"Distillation: {type(model).__name__} has no weights for the teacher's {missing[:3]} "
                f"({len(missing)} missing); the teacher must be a copy of this model"
            )

    @property
    def has_snapshot(self) -> bool:
        """Whether the teacher holds a state of the run that a checkpoint must carry (the gate-start
        snapshot, or the model before training, which a resumed run cannot rebuild either)."""
        return self.teacher is not None and self._teacher_final

    def save_snapshot(self, path: Path) -> None:
        save_model(self.teacher, str(path))

    def load_snapshot(self, path: Path, model: Optional[nn.Module] = None) -> None:
        """Restore the teacher saved with a checkpoint (a resumed run); ``model`` shapes it if none exists yet."""
        load_model(self.restored_teacher(model), str(path), strict=False)
        logger.info("Distillation: restored the gate-start teacher from %s", path)

    def restored_teacher(self, model: Optional[nn.Module] = None) -> nn.Module:
        """The teacher a checkpoint's snapshot is loaded into (made from ``model`` if none exists yet), marked as
        the run's final teacher: the snapshot replaces the one this process would otherwise take."""
        if self.teacher is None:
            if model is None:
                raise ConfigurationError("Distillation: restoring a snapshot needs the model to shape a teacher from")
            self.teacher = frozen_copy(model)
        self._saw_gate_one = self._teacher_final = True
        return self.teacher

    def step_begin(self, model: nn.Module, gate: float, *, previous_gate: Optional[float] = None) -> None:
        """Before the forwards of an optimizer step with ``gate``: snapshot or release the teacher when due.

        ``previous_gate``: the schedule's gate of the update before this one, when the caller knows it. At 1, the
        model as it stands was trained at g = 1 only, so it is the gate-start model even in a process that ran no
        step at g = 1: a run resumed from a checkpoint of the taper's first step (written before any snapshot was
        due) takes the snapshot the uninterrupted run took, without a warning."""
        self._gate = gate
        if previous_gate is not None and previous_gate >= 1.0:
            self._saw_gate_one = True
        self._update_teacher(model, gate)

    def _update_teacher(self, model: nn.Module, gate: float) -> None:
        if self._until_taper_end and gate <= 0.0 and self.sink_attention is not None:
            # The term ends here, so the sink-attention term (which reads its teacher) is idle from now on: the
            # model gets its own attention implementation back instead of the one that reports the sink's share.
            self.sink_attention.detach()
        if self._live:
            if self._until_taper_end and gate <= 0.0 and not self._released:
                self._released = True
                logger.info("Distillation: the gate reached 0; the term ends")
            return
        if self._until_taper_end and gate <= 0.0:
            if self.teacher is not None:
                logger.info("Distillation: the gate reached 0; the teacher is released and the term ends")
            self.teacher, self._teacher_final = None, True
            return
        if self._teacher_final:
            return
        if gate >= 1.0:
            self._saw_gate_one = True
            return
        if not self._saw_gate_one:
            logger.warning(
                'Distillation(distill_from="gate_start"): training started with the gate already below 1 (a resumed '
                "run?) and the snapshot taken at the start of the taper is not in the checkpoint; this run "
                "distils from %s",
                "the teacher as given" if self.teacher is not None else "the model as resumed",
            )
        elif self.teacher is None:
            self.teacher = frozen_copy(model)
            logger.info("Distillation: the teacher is now the model at the start of the taper")
        else:
            self.load_teacher_from(model)
            logger.info("Distillation: the teacher is now the model at the start of the taper")
        if self.teacher is None:
            self.teacher = frozen_copy(model)
        self._teacher_final = True

    # ------------------------------------------------------------------ the term
    def __call__(
        self,
        student_logits: torch.Tensor,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``weight * KL`` (mean over the positions with a label) for one forward's logits on ``input_ids`` (at
        ``position_ids``, when the student's forward had them)."""
        teacher_logits = self._teacher_logits(self._model, input_ids, attention_mask, position_ids)
        summed, count = self._kl_sum(student_logits, teacher_logits, attention_mask, labels, self._gate)
        return summed / count.clamp_min(1.0)

    @torch.no_grad()
    def _teacher_logits(self, model: Optional[nn.Module], input_ids, attention_mask, position_ids=None) -> torch.Tensor:
        teacher = model if self._live else self.teacher
        extra = self.sink_attention.teacher_call_arguments(teacher) if self.sink_attention is not None else {}
        if position_ids is not None:  # a batch that carries positions: the teacher reads the student's
            extra["position_ids"] = position_ids
        if not self._live:
            device = input_ids.device
            if next(teacher.parameters()).device != device:
                teacher.to(device)
            output = teacher(input_ids=input_ids, attention_mask=attention_mask, **extra)
        else:
            mode = model.training
            model.eval()  # no statistics, no scale loss, no checkpointing: a plain forward at gate 1
            try:
                with normalized(model):
                    output = model(input_ids=input_ids, attention_mask=attention_mask, **extra)
            finally:
                model.train(mode)
        if self.sink_attention is not None:
            self.sink_attention.keep_teacher_attentions(output.attentions)
        return output.logits

    def _kl_sum(
        self, student_logits, teacher_logits, attention_mask, labels, gate: Optional[float] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        device = student_logits.device
        if labels is not None:
            mask = labels[..., 1:] != -100
        elif attention_mask is not None:
            mask = attention_mask[..., 1:].bool()
        else:
            mask = torch.ones(student_logits.shape[:-1], dtype=torch.bool, device=device)[..., 1:]
        kl = _kl(student_logits[..., :-1, :], teacher_logits[..., :-1, :])
        mask = mask.to(kl.dtype)
        weight = self.weight * (gate if self._fade_with_gate and gate is not None else 1.0)
        return weight * (kl * mask).sum(), mask.sum()

    def attach(self, model: nn.Module) -> Distillation:
        """Add the term to ``outputs.loss`` of every training forward of ``model``."""
        self._model = model
        add_training_loss_term(model, _TERM, self._term)
        if self.sink_attention is not None:  # after the distillation term, whose teacher forward it reads
            self.sink_attention.attach(model)
        return self

    def _term(self, model: nn.Module, inputs: ForwardInputs, output: Any):
        if getattr(output, "loss", None) is None or self.weight == 0:
            return None
        gate = self._gate if self._gate is not None else gate_of(model)
        self._update_teacher(model, gate)
        if self._live:
            idle = self._released or gate >= 1.0
        else:
            idle = self.teacher is None or not self._teacher_final
        if idle:  # before the gate moves (or the snapshot), after the release: a 0 term
            self._log(torch.zeros((), device=output.loss.device))
            return None
        teacher_logits = self._teacher_logits(
            model, inputs.get("input_ids"), inputs.get("attention_mask"), inputs.get("position_ids")
        )
        labels = inputs.get("labels")
        summed, count = self._kl_sum(output.logits, teacher_logits, inputs.get("attention_mask"), labels, gate)
        self._log((summed / count.clamp_min(1.0)).detach().float())
        return summed, count

    def _log(self, mean: torch.Tensor) -> None:
        if self._window.device != mean.device:  # summed where the loss lives: no sync per forward
            self._window = self._window.to(mean.device)
        self._window += torch.stack([mean, torch.ones((), device=mean.device)])

    def log_metrics(self) -> dict[str, float]:
        """``taper/distill``: the mean term per training forward since the previous call (then reset); 0 after
        the teacher was released. The part of the logged training loss that is not cross-entropy."""
        total, forwards = self._window.tolist()
        self._window.zero_()
        metrics = {"taper/distill": total / forwards} if forwards else {}
        if self.sink_attention is not None:
            metrics.update(self.sink_attention.log_metrics())
        return metrics

    def remove(self) -> None:
        """Detach from the model: later training forwards return the plain loss (and, with the sink-attention
        term, the model has its own attention implementation back)."""
        if self._model is not None:
            remove_training_loss_term(self._model, _TERM)
            if self.sink_attention is not None:
                self.sink_attention.detach()
            self._model = None


def _is_taper_state(key: str) -> bool:
    """TaperNorm/anchor state (gate, c, EMAs, linear gains): the student's, never the teacher's."""
    leaf = key.rsplit(".", 1)[-1]
    return ".anchor." in key or leaf in ("gate", "c", "ema_num", "ema_den", "ema_steps", "calibrated", "taper_weight")


def _kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    log_p = F.log_softmax(teacher_logits.float(), dim=-1)
    log_q = F.log_softmax(student_logits.float(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def distillation_loss(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Mean over tokens of KL(teacher || student) on the next-token distributions (fp32)."""
    kl = _kl(student_logits, teacher_logits)
    if mask is None:
        return kl.mean()
    mask = mask.to(kl.dtype)
    return (kl * mask).sum() / mask.sum().clamp_min(1.0)


__all__ = ["SHARDED_SNAPSHOT_NAME", "SNAPSHOT_NAME", "Distillation", "distillation_loss", "frozen_copy"]
