"""The fixed-target scale anchor (docs/method.md, section 4).

A :class:`ScaleAnchor` lives on the final TaperNorm (``final_norm.anchor``) and observes the
residual stream that ENTERS the final norm. During the gate warmup it keeps a bias-corrected EMA
of the batch-mean scale s (r(h) for RMS models, sigma for LayerNorm models); ``calibrate`` freezes
it as the target. From then on every training-mode forward adds

    lambda * E_tokens (s(h) - s_tgt)^2        (non-padding tokens only)

or, with ``relative=True``, ``lambda * E_tokens (s(h) / s_tgt - 1)^2``: the same anchor made
dimensionless. A pretrained model's residual scale is often far from 1 and its per-token scales vary
around it, so the absolute term can dominate the cross-entropy and every clipped update; the
relative term keeps the paper's behaviour for models whose scale is near 1 and stays comparable to
the cross-entropy elsewhere (docs/fidelity.md). The term reaches ``outputs.loss`` through
``loss_terms.py``; evaluation-mode forwards add nothing.

State that must survive a checkpoint (EMA, its step count, the target, the frozen flag, lambda) is
in persistent buffers. The per-step sums are plain attributes (DDP broadcasts buffers from rank 0
on every forward and would overwrite them) and are all-reduced once per optimizer step by
:func:`reduce_pending`.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from torch import nn

from ..errors import CalibrationError, ConfigurationError
from ..utils import all_reduce_sum, in_backward_recompute
from .loss_terms import ForwardInputs, TrainingLossTerms, add_training_loss_term, loss_terms_of

logger = logging.getLogger(__name__)

# Layout of ScaleAnchor.pending (per optimizer step, summed over micro-batches):
# scale sum, token count, squared-deviation sum.
SCALE_SUM, TOKENS, DEVIATION_SUM = range(3)
_PENDING_SIZE = 3


class ScaleAnchor(nn.Module):
    """Measures the final norm's input scale and, once frozen, penalises its drift from the target."""

    def __init__(
        self, *, centred: bool, eps: float, weight: float = 0.1, ema_rate: float = 0.01, relative: bool = False
    ) -> None:
        super().__init__()
        if weight < 0:
            raise ConfigurationError(f"scale_loss_weight must be >= 0, got {weight}")
        if not 0.0 < ema_rate <= 1.0:
            raise ConfigurationError(f"ema_rate must be in (0, 1], got {ema_rate}")
        self.centred = centred  # LayerNorm models: s = sigma(h); RMS models: s = r(h)
        self.relative = relative  # penalise (s / s_tgt - 1)^2 instead of (s - s_tgt)^2
        self.eps = float(eps)
        self.ema_rate = float(ema_rate)
        self.site_name = ""  # the final norm's qualified name, for messages
        self.register_buffer("scale_loss_weight", torch.tensor(float(weight)))  # lambda
        self.register_buffer("ema", torch.zeros(()))
        self.register_buffer("ema_steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("target", torch.zeros(()))
        self.register_buffer("frozen", torch.zeros((), dtype=torch.bool))
        self._frozen_mirror = False  # Python mirror of `frozen`: forward branches without a host sync
        self._weight_mirror = float(weight)
        self.pending: Optional[torch.Tensor] = None
        self._forwards: Optional[TrainingLossTerms] = None  # the model's loss terms: the current forward's inputs
        self._term: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # (deviation sum, tokens), with grad
        self._warned_no_loss = False

    # ------------------------------------------------------------------ state
    @property
    def is_frozen(self) -> bool:
        return self._frozen_mirror

    @property
    def active(self) -> bool:
        """True when the scale loss is added (frozen target and lambda > 0)."""
        return self._frozen_mirror and self._weight_mirror > 0

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # noqa: D401 - torch hook
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._frozen_mirror = bool(self.frozen)
        self._weight_mirror = float(self.scale_loss_weight)

    def scale(self, h: torch.Tensor) -> torch.Tensor:
        """Per-token scale s(h) in fp32: r(h) = sqrt(mean(h^2) + eps), or sigma for LayerNorm models."""
        x = h.float()
        if self.centred:
            x = x - x.mean(-1, keepdim=True)
        return torch.sqrt(x.pow(2).mean(-1) + self.eps)

    # ------------------------------------------------------------------ forward (called by the final norm)
    def forward(self, h: torch.Tensor) -> None:
        if not self.training or in_backward_recompute():
            return
        s = self.scale(h)
        mask = self._forwards.inputs.get("attention_mask") if self._forwards is not None else None
        if mask is not None and mask.dim() == 2 and mask.shape == s.shape:
            keep = mask.to(device=s.device, dtype=torch.bool)
        else:
            keep = torch.ones_like(s, dtype=torch.bool)
        keep_f = keep.to(s.dtype)
        tokens = keep_f.sum()
        deviation = None
        if self._frozen_mirror:
            difference = s - self.target
            if self.relative:
                difference = difference / self.target
            deviation = (difference**2 * keep_f).sum()
            if self._weight_mirror > 0:
                self._term = (deviation, tokens)
        sums = torch.stack(
            [
                (s.detach() * keep_f).sum(),
                tokens,
                deviation.detach() if deviation is not None else torch.zeros((), device=s.device),
            ]
        )
        self._add(sums)

    def _add(self, sums: torch.Tensor) -> None:
        if self.pending is None or self.pending.device != sums.device:
            self.pending = torch.zeros(_PENDING_SIZE, dtype=torch.float32, device=sums.device)
        self.pending += sums

    # ------------------------------------------------------------------ the loss term
    def attach(self, model: nn.Module) -> None:
        """Add the scale loss to ``outputs.loss`` of ``model``'s training forwards (and read their padding mask)."""
        self._forwards = loss_terms_of(model)
        add_training_loss_term(model, "scale_loss", self._loss_term)

    def _loss_term(self, model: nn.Module, inputs: ForwardInputs, output: Any):
        term, self._term = self._term, None
        if term is None:
            return None
        if getattr(output, "loss", None) is None:
            if not self._warned_no_loss:
                logger.warning(
                    "the scale loss is active but %s returned no loss (no labels?): it is not added; "
                    "pass labels so outputs.loss carries it",
                    type(model).__name__,
                )
                self._warned_no_loss = True
            return None
        deviation, tokens = term
        return self.scale_loss_weight * deviation, tokens

    # ------------------------------------------------------------------ once per optimizer step
    @torch.no_grad()
    def fold_pending(self, totals: torch.Tensor) -> None:
        """One EMA step of the batch-mean scale from this step's (all-reduced) totals, until frozen."""
        if self._frozen_mirror or totals[TOKENS] <= 0:
            return
        self.ema.mul_(1.0 - self.ema_rate).add_(self.ema_rate * totals[SCALE_SUM] / totals[TOKENS])
        self.ema_steps.add_(1)

    @torch.no_grad()
    def freeze(self) -> float:
        """Freeze the bias-corrected EMA as the target (called by ``calibrate``); returns the target."""
        if self._frozen_mirror:
            return float(self.target)
        totals = reduce_pending([self])[0]
        self.fold_pending(totals)
        steps = int(self.ema_steps)
        if steps == 0:
            raise CalibrationError(
                f"the scale anchor on {self.site_name or 'the final norm'} has no statistics: run training-mode "
                "forwards of the top-level model before calibrating"
            )
        target = float(self.ema) / (1.0 - (1.0 - self.ema_rate) ** steps)
        if not (target > 0 and torch.isfinite(torch.tensor(target))):
            raise CalibrationError(
                f"the scale target of {self.site_name or 'the final norm'} is not usable: {target!r}"
            )
        self.target.fill_(target)
        self.frozen.fill_(True)
        self._frozen_mirror = True
        return target


def reduce_pending(anchors: list[ScaleAnchor]) -> torch.Tensor:
    """Take every anchor's per-step sums (resetting them), all-reduced over ranks: [n_anchors, 3] fp32 on CPU."""
    if not anchors:
        return torch.zeros(0, _PENDING_SIZE)
    device = anchors[0].ema.device
    flat = torch.stack(
        [a.pending.to(device) if a.pending is not None else torch.zeros(_PENDING_SIZE, device=device) for a in anchors]
    )
    for anchor in anchors:
        anchor.pending = None
    return all_reduce_sum(flat).cpu()


def scale_anchors(model: nn.Module) -> list[ScaleAnchor]:
    return [m for m in model.modules() if isinstance(m, ScaleAnchor)]


__all__ = ["ScaleAnchor", "reduce_pending", "scale_anchors"]
