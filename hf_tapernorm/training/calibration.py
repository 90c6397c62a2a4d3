"""Calibration of the linear branch's scalar c (docs/method.md, section 3).

Training-mode forwards add per-token sums to each layer's pending statistics; once per optimizer
step ``update_statistics`` folds the step's mean (over all micro-batches and, when distributed, all
ranks) into two bias-corrected EMAs; ``calibrate`` turns them into c = a_hat / (b_hat + delta).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ..errors import CalibrationError, TaperStateError
from ..layers.taper_norm import TaperNorm, tapered_norms
from ..utils import all_reduce_sum

DELTA = 1e-12


def _collecting_layers(model: nn.Module) -> list[TaperNorm]:
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
    flat = torch.cat(
        [
            m.pending.to(device) if m.pending is not None else torch.zeros(m.statistics_size, device=device)
            for m in layers
        ]
    )
    flat = all_reduce_sum(flat).to(layers[0].ema_num.device)
    counted, offset = 0, 0
    for layer in layers:
        sums, offset = flat[offset : offset + layer.statistics_size], offset + layer.statistics_size
        layer.pending = None
        num, den, count = sums[:3].tolist()
        if count == 0:
            continue
        counted = int(count)
        rate = layer.ema_rate
        layer.ema_num.mul_(1.0 - rate).add_(rate * num / count)
        layer.ema_den.mul_(1.0 - rate).add_(rate * den / count)
        if layer.per_channel:
            channels = sums[3:].view(2, -1) / count
            layer.ema_num_channels.mul_(1.0 - rate).add_(rate * channels[0].to(layer.ema_num_channels.device))
            layer.ema_den_channels.mul_(1.0 - rate).add_(rate * channels[1].to(layer.ema_den_channels.device))
        layer.ema_steps.add_(1)
    return counted


def channel_ratio(layer: TaperNorm, c: float) -> torch.Tensor | None:
    """The per-channel least-squares factors a_j of a per-channel layer (c where a channel saw nothing)."""
    if not layer.per_channel:
        return None
    num, den = layer.ema_num_channels.double(), layer.ema_den_channels.double()
    return torch.where(den > 0, num / den.clamp_min(DELTA), torch.full_like(num, c)).float()


def calibrated_c(layer: TaperNorm) -> float:
    """c = a_hat / (b_hat + delta) from the bias-corrected EMAs; refuses missing or broken statistics."""
    steps = int(layer.ema_steps)
    name = layer.site_name or "a TaperNorm layer"
    if steps == 0:
        raise CalibrationError(
            f"{name} has no calibration statistics: run training-mode forwards (model.train()) before "
            "calibrating, and make sure the gate is held at 1 for at least one optimizer step"
        )
    correction = 1.0 - (1.0 - layer.ema_rate) ** steps
    num = float(layer.ema_num) / correction
    den = float(layer.ema_den) / correction
    c = num / (den + DELTA)
    if not (torch.isfinite(torch.tensor([num, den, c])).all() and num > 0 and den > 0):
        raise CalibrationError(
            f"calibration statistics of {name} are not usable (numerator {num!r}, denominator {den!r}): "
            "the activations reaching this norm are zero or not finite"
        )
    return c


def calibrate(model: nn.Module, layers: Iterable[TaperNorm] | None = None) -> dict[str, float]:
    """Freeze c for every uncalibrated tapered layer, pending statistics included.

    Copies each norm's gain into ``taper_weight`` in place and freezes the scale anchor's target,
    so the linear branch starts as the least-squares match of the norm. Returns ``{name: c}``.
    Raises before changing anything if any layer lacks usable statistics, and on an unpatched model.
    """
    if not any(tapered_norms(model, include_kept=True)):
        raise TaperStateError(
            f"{type(model).__name__} has no TaperNorm layers to calibrate: call hf_tapernorm.patch_model(model) first"
        )
    update_statistics(model)
    targets = (
        list(layers)
        if layers is not None
        else [m for m in model.modules() if isinstance(m, TaperNorm) and m.tapered and not m.is_calibrated]
    )
    values = {layer.site_name: calibrated_c(layer) for layer in targets}
    for layer in targets:
        c = values[layer.site_name]
        layer.mark_calibrated(c, channel_ratio(layer, c))
    for module in model.modules():
        if isinstance(module, TaperNorm) and module.anchor is not None:
            module.anchor.freeze()
    return values


def calibration_table(model: nn.Module) -> dict[str, dict[str, float]]:
    """Per tapered layer: c, and the spread of the linear branch's effective per-channel gain c * taper_weight."""
    table = {}
    for name, layer in tapered_norms(model):
        gain = (layer.c * layer.taper_weight.detach().float()).abs()
        table[name] = {
            "c": float(layer.c),
            "calibrated": layer.is_calibrated,
            "gain_median": float(gain.median()),
            "gain_max": float(gain.max()),
        }
    return table


__all__ = ["DELTA", "calibrate", "calibrated_c", "calibration_table", "channel_ratio", "update_statistics"]
