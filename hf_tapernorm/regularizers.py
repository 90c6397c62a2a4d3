"""Training-time regularisers that prepare a pretrained model for the gate to close.

Neither changes what folding sees: they are extra loss terms, active only in training-mode forwards.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from safetensors.torch import load_model, save_model
from torch import nn
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .calibration import in_backward_recompute
from .callback import add_to_training_log
from .patching import gate_of
from .taper_norm import TaperNorm

logger = logging.getLogger(__name__)


class TokenScalePenalty:
    """Penalise tokens whose residual scale exceeds ``ratio`` x the median token, at every tapered norm.

    Once the gate closes, a token k times larger than the typical one reaches attention and the MLP
    k times too large (and the MLP's output grows about as k^2), so outlier tokens run away. The
    penalty ``weight * mean_layers mean_tokens relu(log r(h) - log(ratio * median r))^2`` teaches the
    model uniform token scales while the norms still hide them (start it at gate 1). The median is
    per layer and per forward, detached; the first ``sink_tokens`` positions (kept normalized) are
    exempt. Install once; add ``penalty()`` to the loss after each forward.
    """

    def __init__(self, model: nn.Module, *, weight: float = 0.01, ratio: float = 4.0, sink_tokens: int = 0) -> None:
        if weight < 0 or ratio < 1:
            raise ValueError(f"TokenScalePenalty needs weight >= 0 and ratio >= 1, got {weight} and {ratio}")
        self.weight = float(weight)
        self.log_ratio = math.log(ratio)
        self.sink_tokens = int(sink_tokens)
        self._terms: list[torch.Tensor] = []
        layers = [m for m in model.modules() if isinstance(m, TaperNorm) and m.tapered]
        if not layers:
            raise ValueError(f"{type(model).__name__} has no tapered TaperNorm layers; call patch_model first")
        self._handles = [layer.register_forward_pre_hook(self._observe) for layer in layers]
        self._layers = len(layers)

    def _token_log_scales(self, layer: TaperNorm, args: tuple) -> Optional[torch.Tensor]:
        """Per non-sink token, log RMS of the layer's input; None outside counted training forwards."""
        if not layer.training or self.weight == 0 or in_backward_recompute():
            return None
        x = args[0]
        if self.sink_tokens:
            x = x[..., self.sink_tokens :, :]
        return 0.5 * torch.log(x.float().pow(2).mean(-1) + layer.eps).reshape(-1)

    def _observe(self, layer: TaperNorm, args: tuple) -> None:
        log_r = self._token_log_scales(layer, args)
        if log_r is None:
            return
        excess = F.relu(log_r - log_r.detach().median() - self.log_ratio)
        self._terms.append(excess.pow(2).mean())

    def attach(self, model: nn.Module) -> "TokenScalePenalty":
        """Add the penalty to ``outputs.loss`` of every training forward of ``model`` (for ``Trainer``).

        Under gradient accumulation the penalty is weighted by the micro-batch's share of the step's
        labels (see :func:`add_to_training_loss`).
        """
        self._handles += add_to_training_loss(model, lambda module, kwargs, output: self())
        return self

    def __call__(self) -> torch.Tensor:
        """The penalty of the forwards since the last call (0 when none), and reset."""
        if not self._terms:
            return torch.zeros(())
        value = self.weight * torch.stack(self._terms).sum() / self._layers
        self._terms = []
        return value

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def add_to_training_loss(model: nn.Module, term) -> list:
    """Hooks adding ``term(module, kwargs, output)`` to ``output.loss`` of every training forward of ``model``.

    ``term`` is a mean over this forward. Under gradient accumulation (``num_items_in_batch`` passed, as
    ``Trainer`` does) the model's CE is a sum over the whole optimizer step's labels; the term is then
    weighted by this micro-batch's share of them, so accumulation gives the same gradient as one large
    batch. Returns the hook handles.
    """
    captured: dict = {}

    def before(module: nn.Module, args: tuple, kwargs: dict) -> None:
        captured.clear()
        captured.update(kwargs)
        if args:  # input_ids given positionally
            captured.setdefault("input_ids", args[0])

    def after(module: nn.Module, args: tuple, kwargs: dict, output):
        call = dict(captured)
        captured.clear()
        value = term(module, call, output)
        loss = getattr(output, "loss", None)
        if not module.training or loss is None:
            return output
        items, labels = call.get("num_items_in_batch"), call.get("labels")
        if items is not None and labels is not None:
            share = (labels[..., 1:] != -100).sum().to(loss.device) / torch.as_tensor(items, device=loss.device)
            value = value.to(loss.device) * share
        output.loss = loss + value.to(device=loss.device, dtype=loss.dtype)
        return output

    return [model.register_forward_pre_hook(before, with_kwargs=True),
            model.register_forward_hook(after, with_kwargs=True)]


class ScaleGrowthPenalty(TokenScalePenalty):
    """Penalise tokens whose scale, relative to the median token, grows from one tapered norm to the next.

    The runaway that breaks a tapering pretrained model (``conversion_scripts/experiments/runaway_trace.py``)
    is a token slightly above the typical scale (1.5-3x) whose excess grows sublayer after sublayer once
    the norms stop bounding it, then squares through the SwiGLU MLPs (3.4x -> 8.5x -> 20x -> 124x -> inf
    in SmolLM2). A norm makes every sublayer contract such excesses; this penalty,
    ``weight * mean_pairs mean_tokens relu(d_next - d)^2`` over the tokens with ``d > log(ratio)``,
    where ``d`` is a token's log RMS minus the median's at a tapered norm's input and the pairs are
    consecutive tapered norms in forward order, teaches the sublayers to keep contracting while the
    gate closes. It is near 0 for a normalized model and grows as the gate falls, on exactly the
    tokens that are about to run away. The sink positions are exempt.
    """

    def __init__(self, model: nn.Module, *, weight: float = 1.0, ratio: float = 1.0, sink_tokens: int = 0) -> None:
        super().__init__(model, weight=weight, ratio=ratio, sink_tokens=sink_tokens)
        self._first = next(m for m in model.modules() if isinstance(m, TaperNorm) and m.tapered)

    def _observe(self, layer: TaperNorm, args: tuple) -> None:
        log_r = self._token_log_scales(layer, args)
        if log_r is None:
            return
        if layer is self._first or not self._terms:
            self._terms.append([])  # a new forward starts at the first tapered norm
        self._terms[-1].append(log_r - log_r.detach().median())

    def __call__(self) -> torch.Tensor:
        """The penalty of the forwards since the last call (0 when none), and reset."""
        forwards, self._terms = self._terms, []
        pairs = [
            F.relu(after - before).pow(2).mul(before.detach() > self.log_ratio).mean()
            for deviations in forwards
            for before, after in zip(deviations, deviations[1:])
        ]
        if not pairs:
            return torch.zeros(())
        return self.weight * torch.stack(pairs).sum() / max(1, self._layers - 1)


class Distillation:
    """Add ``weight * KL(teacher || student)`` on the next-token distributions to every training loss.

    The teacher is a frozen, unpatched copy of the model made before patching. Distilling from it
    while the gate closes pulls the tapered model back to the function the norms computed.

    ``from_gate_start=True`` distils from the model as it was when the gate first dropped below 1
    instead of from the original: at the first training forward with g < 1 the model's current
    weights are loaded into the teacher (patching keeps the norms' parameter names), and the term is
    0 before that. The original pins the model to where it started, and with it to the data it was
    trained on; the snapshot has already adapted to the new data during the warmup at g = 1, so
    distilling from it repairs what tapering breaks without undoing that adaptation. Measured on
    SmolLM2 (attention norms tapered in 300 steps, weight 1; about 1.35x the step time): the gap
    to the normalized run was +3.3% without distillation, +2.1% from the original and +0.3% from
    the snapshot (conversion_scripts/experiments/reports/smollm2_fidelity.md, session 4).
    With ``Trainer``, :class:`DistillationCallback` saves the snapshot into every checkpoint and
    restores it on resume; a run resumed after the gate started closing without it distils from the
    teacher as given (the original), with a warning.

    Positions whose next label is -100 (padding, the sink's first-token prediction) are left out.
    """

    def __init__(self, teacher: nn.Module, *, weight: float = 1.0, from_gate_start: bool = False) -> None:
        if weight < 0:
            raise ValueError(f"Distillation needs weight >= 0, got {weight}")
        self.teacher = teacher.eval().requires_grad_(False)
        self.weight = float(weight)
        self.from_gate_start = from_gate_start
        self._saw_gate_one = False  # a training forward at g = 1 ran in this process
        self._teacher_final = not from_gate_start  # no later change of the teacher
        self._window = torch.zeros(2)  # sum of the terms added to training losses, forwards (since the last log)

    def __call__(self, student_logits: torch.Tensor, input_ids: torch.Tensor,
                 attention_mask: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``weight * KL`` for one forward's logits on ``input_ids``."""
        device = student_logits.device
        if next(self.teacher.parameters()).device != device:
            self.teacher.to(device)
        with torch.no_grad():
            teacher_logits = self.teacher(input_ids=input_ids, attention_mask=attention_mask).logits
        mask = None
        if labels is not None:
            mask = labels[..., 1:] != -100
        elif attention_mask is not None:
            mask = attention_mask[..., 1:].bool()
        kl = distillation_loss(student_logits[..., :-1, :], teacher_logits[..., :-1, :], mask)
        return self.weight * kl

    def load_teacher_from(self, model: nn.Module) -> None:
        """Copy ``model``'s current weights into the teacher (the taper's own state is not the teacher's)."""
        missing, _ = self.teacher.load_state_dict(model.state_dict(), strict=False)
        if missing:
            raise ValueError(
                f"Distillation: {type(model).__name__} has no weights for the teacher's {missing[:3]} "
                f"({len(missing)} missing); the teacher must be a copy of this model made before patch_model"
            )

    def log_metrics(self) -> dict[str, float]:
        """``taper/distill``: the mean term added per training forward since the previous call (then reset).

        It is the part of the logged training loss that is not cross-entropy (with equal label counts per
        micro-batch, as in packed blocks).
        """
        total, forwards = self._window.tolist()
        self._window.zero_()
        return {"taper/distill": total / forwards} if forwards else {}

    @property
    def has_snapshot(self) -> bool:
        """Whether the teacher is the gate-start snapshot (so a checkpoint must carry it)."""
        return self.from_gate_start and self._teacher_final and self._saw_gate_one

    def save_snapshot(self, path: Path) -> None:
        save_model(self.teacher, str(path))

    def load_snapshot(self, path: Path) -> None:
        """Restore the gate-start teacher saved with a checkpoint (a resumed run)."""
        load_model(self.teacher, str(path))
        self._saw_gate_one = self._teacher_final = True
        logger.info("Distillation: restored the gate-start teacher from %s", path)

    def teacher_ready(self, model: nn.Module) -> bool:
        """Whether this training forward is distilled; takes the gate-start snapshot when it is due."""
        if self._teacher_final:
            return True
        if gate_of(model) >= 1.0:
            self._saw_gate_one = True
            return False
        if self._saw_gate_one:
            self.load_teacher_from(model)
            logger.info("Distillation: the teacher is now the model at the start of the taper")
        else:
            logger.warning(
                "Distillation(from_gate_start=True): training started with the gate already below 1 (a resumed "
                "run?); the snapshot at the start of the taper is not in the checkpoint, so this run distils from "
                "the teacher as given (the original model)"
            )
        self._teacher_final = True
        return True

    def attach(self, model: nn.Module) -> "Distillation":
        """Add the term to ``outputs.loss`` of every training forward of ``model`` (for ``Trainer``)."""

        def term(module: nn.Module, kwargs: dict, output) -> torch.Tensor:
            if not module.training or getattr(output, "loss", None) is None:
                return torch.zeros(())
            value = torch.zeros(())
            if self.weight > 0 and self.teacher_ready(module):
                value = self(output.logits, kwargs["input_ids"], kwargs.get("attention_mask"), kwargs.get("labels"))
            logged = value.detach().float()
            if self._window.device != logged.device:  # summed where the loss lives: no sync per forward
                self._window = self._window.to(logged.device)
            self._window += torch.stack([logged, torch.ones((), device=logged.device)])
            return value

        self._handles = add_to_training_loss(model, term)
        return self

    def remove(self) -> None:
        """Detach from the model: later training forwards return the plain loss."""
        for handle in getattr(self, "_handles", []):
            handle.remove()
        self._handles = []


class DistillationCallback(TrainerCallback):
    """A :class:`Distillation` in ``Trainer`` runs: its gate-start teacher in checkpoints, its term in the logs.

    The snapshot is a state of the run that the model's own checkpoint does not hold: without it a
    resumed run would distil from a different teacher than the uninterrupted run. It is written as
    ``distillation_teacher.safetensors`` into each checkpoint folder saved after the gate started
    closing, and read back when training resumes from ``<output_dir>/checkpoint-<step>``.
    Each training log gets ``taper/distill`` (:meth:`Distillation.log_metrics`), also in
    ``state.log_history``; reporting callbacks listed before this one do not see it.
    """

    FILE = "distillation_teacher.safetensors"

    def __init__(self, distillation: Distillation) -> None:
        self.distillation = distillation

    def _folder(self, args, state) -> Path:
        return Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"

    def on_train_begin(self, args, state, control, **kwargs):
        path = self._folder(args, state) / self.FILE
        if state.global_step > 0 and self.distillation.from_gate_start and path.is_file():
            self.distillation.load_snapshot(path)

    def on_save(self, args, state, control, **kwargs):
        folder = self._folder(args, state)
        if self.distillation.has_snapshot and state.is_world_process_zero and folder.is_dir():
            self.distillation.save_snapshot(folder / self.FILE)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or "loss" not in logs:
            return
        add_to_training_log(state, logs, self.distillation.log_metrics())


def distillation_loss(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Mean over tokens of KL(teacher || student) on the next-token distributions (fp32)."""
    log_p = F.log_softmax(teacher_logits.float(), dim=-1)
    log_q = F.log_softmax(student_logits.float(), dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    if mask is None:
        return kl.mean()
    mask = mask.to(kl.dtype)
    return (kl * mask).sum() / mask.sum().clamp_min(1.0)


__all__ = ["Distillation", "DistillationCallback", "ScaleGrowthPenalty", "add_to_training_loss", "TokenScalePenalty", "distillation_loss"]
