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
    """True while autograd re-runs a forward (gradient checkpointing), so it is not counted twice."""
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
