"""Calibration of the linear branch's scalar c (METHOD section 3).

Training-mode forwards add per-token sums to each layer's pending statistics; once per optimizer
step ``update_statistics`` folds the step's mean (over all micro-batches and, when distributed, all
ranks) into two bias-corrected EMAs; ``calibrate`` turns them into c = a_hat / (b_hat + delta).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # pragma: no cover
    from .taper_norm import TaperNorm

DELTA = 1e-12


def in_backward_recompute() -> bool:
    """True while autograd re-runs a forward (gradient checkpointing), so it is not counted twice.

    Under torch.compile the answer is False: a compiled region recomputes checkpointed activations
    inside its backward graph without re-running this Python, and the graph-task query (it returns
    a Python int) would otherwise break the graph on every training forward.
    """
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1


@torch.no_grad()
def branch_statistics(h: torch.Tensor, gain: torch.Tensor, eps: float, *, centred: bool) -> torch.Tensor:
    """Sums over tokens of ||h g||^2 / r(h) and ||h g||^2, and the token count, in fp32.

    ``centred`` selects the LayerNorm form (h - mu and sigma instead of h and the RMS).
    """
    x = h.detach().float().reshape(-1, h.shape[-1])
    if centred:
        x = x - x.mean(-1, keepdim=True)
    r = torch.sqrt(x.pow(2).mean(-1) + eps)
    energy = (x * gain.detach().float()).pow(2).sum(-1)
    count = torch.tensor(float(x.shape[0]), device=x.device)
    return torch.stack([(energy / r).sum(), energy.sum(), count])


def _all_reduce(flat: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    return flat


def _collecting_layers(model: torch.nn.Module) -> list["TaperNorm"]:
    from .taper_norm import TaperNorm

    return [m for m in model.modules() if isinstance(m, TaperNorm) and m.tapered and not m.is_calibrated]


@torch.no_grad()
def update_statistics(model: torch.nn.Module) -> int:
    """Fold this step's pending sums into the EMAs, one EMA step per layer; returns tokens counted.

    Every rank must call it (it all-reduces once when torch.distributed is initialized), so all
    ranks hold the same EMAs and later compute the same c.
    """
    layers = _collecting_layers(model)
    if not layers:
        return 0
    device = layers[0].ema_num.device
    flat = torch.stack(
        [m.pending.to(device) if m.pending is not None else torch.zeros(3, device=device) for m in layers]
    )
    flat = _all_reduce(flat).cpu()
    counted = 0
    for layer, (num, den, count) in zip(layers, flat.tolist()):
        layer.pending = None
        if count == 0:
            continue
        counted = int(count)
        rate = layer.ema_rate
        layer.ema_num.mul_(1.0 - rate).add_(rate * num / count)
        layer.ema_den.mul_(1.0 - rate).add_(rate * den / count)
        layer.ema_steps.add_(1)
    return counted


def calibrated_c(layer: "TaperNorm") -> float:
    """c = a_hat / (b_hat + delta) from the bias-corrected EMAs; refuses missing or broken statistics."""
    steps = int(layer.ema_steps)
    name = layer.site_name or "a TaperNorm layer"
    if steps == 0:
        raise RuntimeError(
            f"{name} has no calibration statistics: run training-mode forwards (model.train()) before "
            "calibrating, and make sure the gate is held at 1 for at least one optimizer step"
        )
    correction = 1.0 - (1.0 - layer.ema_rate) ** steps
    num = float(layer.ema_num) / correction
    den = float(layer.ema_den) / correction
    c = num / (den + DELTA)
    if not (torch.isfinite(torch.tensor([num, den, c])).all() and num > 0 and den > 0):
        raise RuntimeError(
            f"calibration statistics of {name} are not usable (numerator {num!r}, denominator {den!r}): "
            "the activations reaching this norm are zero or not finite"
        )
    return c


def calibrate(model: torch.nn.Module, layers: Iterable["TaperNorm"] | None = None) -> dict[str, float]:
    """Freeze c for every uncalibrated tapered layer, pending statistics included.

    Copies each norm's gain into ``taper_weight`` in place and freezes the scale anchor's target,
    so the linear branch starts as the least-squares match of the norm. Returns ``{name: c}``.
    Raises before changing anything if any layer lacks usable statistics.
    """
    from .taper_norm import TaperNorm

    update_statistics(model)
    targets = list(layers) if layers is not None else [
        m for m in model.modules() if isinstance(m, TaperNorm) and m.tapered and not m.is_calibrated
    ]
    values = {layer.site_name: calibrated_c(layer) for layer in targets}
    for layer in targets:
        layer.mark_calibrated(values[layer.site_name])
    for module in model.modules():
        if isinstance(module, TaperNorm) and module.anchor is not None:
            module.anchor.freeze()
    return values


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
    from .taper_norm import NormStyle

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
            try:
                model(**batch) if isinstance(batch, dict) else model(batch)
            except _Collected:
                pass
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    return sums


def _fit_one(layer, sums, per_channel: bool) -> float:
    name = layer.site_name or "a TaperNorm layer"
    if sums is None:
        raise RuntimeError(f"{name} saw no tokens while fitting its linear branch; pass non-empty batches")
    num, den, _ = sums.double()
    gain = layer.effective_gain().detach().double().to(num.device)
    weighted_den = (den * gain.pow(2)).sum()
    c = float((num * gain.pow(2)).sum() / (weighted_den + DELTA))
    if not (torch.isfinite(num).all() and torch.isfinite(den).all() and weighted_den > 0 and c > 0):
        raise RuntimeError(
            f"calibration statistics of {name} are not usable: the activations reaching this norm are "
            "zero or not finite"
        )
    layer.mark_calibrated(c)
    if per_channel:
        per = torch.where(den > 0, num / den.clamp_min(DELTA), torch.full_like(num, c))
        with torch.no_grad():
            layer.taper_weight.copy_((gain * per / c).to(layer.taper_weight.dtype))
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
    typical token of SmolLM2's layers 12-28). This fit uses typical tokens only (``trim``, sink
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
    from .taper_norm import TaperNorm

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
