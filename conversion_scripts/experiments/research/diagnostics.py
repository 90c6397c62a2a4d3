"""Per-layer diagnostics of a tapering run, for research reports: where and why a tapered model loses quality.

All functions read a patched model (any gate) and explicit held-out batches; none changes the model.
Experimental: a lower API promise than the stable package.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from hf_tapernorm.layers import TaperNorm, tapered_norms
from hf_tapernorm.training import calibration_table


@torch.no_grad()
def _per_layer_inputs(model: nn.Module, batches: Iterable[torch.Tensor], fn) -> dict[str, list]:
    """Run ``batches`` in eval mode and apply ``fn(layer, h)`` to every tapered layer's input."""
    results: dict[str, list] = {}
    handles = []
    for name, layer in tapered_norms(model):

        def hook(module: TaperNorm, args, name=name):
            results.setdefault(name, []).append(fn(module, args[0].float()))

        handles.append(layer.register_forward_pre_hook(hook))
    was = model.training
    model.eval()
    try:
        for batch in batches:
            model(input_ids=batch)
    finally:
        for handle in handles:
            handle.remove()
        model.train(was)
    return results


def residual_scale_by_position(
    model: nn.Module, batches: Sequence[torch.Tensor], *, sink_tokens: int = 1
) -> dict[str, dict[str, float]]:
    """Per tapered layer: RMS of the sink positions and of the typical token, and the outliers' ratios.

    ``sink_ratio`` = mean RMS of positions < sink_tokens / median RMS of the rest; ``max_ratio`` and
    ``frac_above_4x`` describe the rest (the tokens the linear branch must handle).
    """

    def stats(layer, h):
        r = torch.sqrt(h.pow(2).mean(-1) + layer.eps)
        return r[..., :sink_tokens].reshape(-1), r[..., sink_tokens:].reshape(-1)

    table = {}
    for name, parts in _per_layer_inputs(model, batches, stats).items():
        sink = torch.cat([p[0] for p in parts])
        rest = torch.cat([p[1] for p in parts])
        median = rest.median()
        table[name] = {
            "median_rms": float(median),
            "sink_ratio": float(sink.mean() / median) if sink.numel() else float("nan"),
            "max_ratio": float(rest.max() / median),
            "frac_above_4x": float((rest > 4 * median).float().mean()),
        }
    return table


def branch_distance(model: nn.Module, batches: Sequence[torch.Tensor], *, sink_tokens: int = 1) -> dict[str, float]:
    """Per tapered layer: ||linear(h) - norm(h)|| / ||norm(h)|| over held-out non-sink tokens.

    0 means the layer's linear branch reproduces its norm exactly on those tokens: the gate can
    close there without changing the model. Measured on the inputs the layer receives at the current
    gate (so, at gate 1, on the original model's residual stream).
    """

    def dist(layer, h):
        h = h[..., sink_tokens:, :]
        norm = layer._normalized(h).float()
        lin = layer._linear(h).float()
        return torch.stack([(lin - norm).pow(2).sum(), norm.pow(2).sum()])

    return {
        name: float(torch.sqrt(sum(parts)[0] / sum(parts)[1]))
        for name, parts in _per_layer_inputs(model, batches, dist).items()
    }


def loss_rise_gate(curve: Sequence[tuple[float, float]], tolerance: float = 0.02) -> float | None:
    """The first gate at which held-out CE exceeds its gate-1 reference by more than ``tolerance``.

    ``curve``: (gate, CE) pairs in step order; the reference is the lowest CE measured at gate 1.
    Returns None when the loss never rises that far (or no point was measured at gate 1).
    """
    at_one = [ce for gate, ce in curve if gate >= 1.0]
    if not at_one:
        return None
    limit = min(at_one) * (1.0 + tolerance)
    return next((gate for gate, ce in curve if gate < 1.0 and not ce <= limit), None)


def diagnostics(model: nn.Module, batches: Sequence[torch.Tensor], *, sink_tokens: int = 1) -> dict[str, dict]:
    """Everything the report needs per layer, in one dict of tables."""
    return {
        "calibration": calibration_table(model),
        "residual_scale": residual_scale_by_position(model, batches, sink_tokens=sink_tokens),
        "branch_distance": branch_distance(model, batches, sink_tokens=sink_tokens),
    }


__all__ = ["calibration_table", "residual_scale_by_position", "branch_distance", "loss_rise_gate", "diagnostics"]
