"""Fitting the linear branches from explicit batches, robustly to outlier tokens: the fidelity experiments' fit.

The product calibrates from the EMA of the warmup's training forwards (training/calibration.py; per channel
with the experimental option ``TaperNormConfig(experimental={"linear_fit": "per_channel"})``). This fit, on
held-out batches, with outlier trimming and a sequential layer-by-layer mode, was measured no better
(docs/fidelity.md) and stays experimental.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch

from hf_tapernorm import CalibrationError
from hf_tapernorm.architectures import NormStyle
from hf_tapernorm.layers import TaperNorm

DELTA = 1e-12  # guards a division by an empty statistic, as the package's own calibration does


@torch.no_grad()
def typical_token_sums(
    h: torch.Tensor, eps: float, *, centred: bool, trim: float | None, skip: int = 0
) -> torch.Tensor:
    """Per-channel sums over typical tokens of x_j^2 / r(x) and x_j^2, and their count: shape [3, d].

    ``trim``: tokens whose r exceeds ``trim`` x the batch median r are left out (the massive
    activations that dominate the least-squares fit, FINDINGS.md); None keeps every token.
    ``skip``: leading positions left out (sink tokens that stay normalized).
    """
    x = h.detach().float()
    if skip and x.dim() >= 2:
        x = x[..., skip:, :]
    x = x.reshape(-1, x.shape[-1])
    if centred:
        x = x - x.mean(-1, keepdim=True)
    r = torch.sqrt(x.pow(2).mean(-1) + eps)
    if trim is not None:
        keep = r <= trim * r.median()
        x, r = x[keep], r[keep]
    sq = x.pow(2)
    count = torch.full_like(sq[0], float(x.shape[0]))
    return torch.stack([(sq / r[:, None]).sum(0), sq.sum(0), count])


class _Collected(Exception):
    """Raised by a collecting hook to end a forward early (sequential fits need one layer's input only)."""


@torch.no_grad()
def _collect(model, batches, layers, trim, *, stop_after: bool) -> dict:
    """Typical-token sums of each layer's input over ``batches`` (eval mode, no gradient)."""
    sums: dict = {}

    def hook(layer, args):
        s = typical_token_sums(
            args[0], layer.eps, centred=layer.style is NormStyle.LAYER, trim=trim, skip=layer.sink_tokens
        )
        sums[layer] = s if layer not in sums else sums[layer] + s
        if stop_after:
            raise _Collected

    handles = [layer.register_forward_pre_hook(hook) for layer in layers]
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            with contextlib.suppress(_Collected):
                model(**batch) if isinstance(batch, dict) else model(batch)
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    return sums


def _fit_one(layer, sums, per_channel: bool) -> float:
    name = layer.site_name or "a TaperNorm layer"
    if sums is None:
        raise CalibrationError(f"{name} saw no tokens while fitting its linear branch; pass non-empty batches")
    num, den, _ = sums.double()
    gain = layer.effective_gain().detach().double().to(num.device)
    weighted_den = (den * gain.pow(2)).sum()
    c = float((num * gain.pow(2)).sum() / (weighted_den + DELTA))
    if not (torch.isfinite(num).all() and torch.isfinite(den).all() and weighted_den > 0 and c > 0):
        raise CalibrationError(
            f"calibration statistics of {name} are not usable: the activations reaching this norm are "
            "zero or not finite"
        )
    per = torch.where(den > 0, num / den.clamp_min(DELTA), torch.full_like(num, c)) if per_channel else None
    layer.mark_calibrated(c, per)
    return c


def fit_linear_branch(
    model: torch.nn.Module,
    batches: Iterable[dict | torch.Tensor],
    *,
    trim: float | None = None,
    per_channel: bool = True,
    sequential: bool = False,
) -> dict[str, float]:
    """Calibrate every uncalibrated tapered layer from explicit batches, robustly to outlier tokens.

    The paper's least-squares c is dominated by a few massive activations (5-32x too small for the
    typical token of a pretrained model's middle layers). This fit uses typical tokens only (``trim``, sink
    positions excluded) and, with ``per_channel``, starts ``taper_weight`` from the per-channel
    least-squares gains a_j = sum x_j^2/r / sum x_j^2, so the folded map stays per-channel linear:
    ``c * taper_weight_j = a_j * gain_j``, with the scalar c the least-squares fit over channels.
    With ``trim=None, per_channel=False`` it is exactly the paper's c over these batches.

    ``sequential``: fit the layers one at a time in forward order, each on the inputs it receives
    when every earlier layer is already linear (gate 0): each c then corrects the scale drift that
    the layers before it introduce, instead of compounding it. Costs one (truncated) forward of
    ``batches`` per layer. The gates are back at 1 afterwards.

    Forwards run without gradients; returns ``{name: c}``. Call it before training (or before
    k_start): ``calibrate``/the TaperController then skip these layers and only freeze the scale
    anchor's target at k_start.
    """
    layers = [m for m in model.modules() if isinstance(m, TaperNorm) and m.tapered and not m.is_calibrated]
    batches = list(batches)
    values: dict[str, float] = {}
    if not sequential:
        sums = _collect(model, batches, layers, trim, stop_after=False)
        for layer in layers:
            values[layer.site_name] = _fit_one(layer, sums.get(layer), per_channel)
        return values
    try:
        for layer in layers:
            sums = _collect(model, batches, [layer], trim, stop_after=True)
            values[layer.site_name] = _fit_one(layer, sums.get(layer), per_channel)
            layer.set_gate(0.0)
    finally:
        for layer in layers:
            layer.set_gate(1.0)
    return values


__all__ = ["fit_linear_branch", "typical_token_sums"]
