"""Measurements on a (patched or not) model: token scales at every norm, and CE against per-kind gates.

``scale_stats``: for every norm's input, the RMS of position 0 (the sink) and of the largest other
token over the median non-sink token (what SmolLM2's reports call the massive activation and the
outliers). ``gate_grid``: the training-free table of SmolLM2's ``sublayer_gates.json`` (held-out CE
with the attention norms at one gate and the MLP norms at another, right after calibration).

    python -m conversion_scripts.experiments.mlp_norms.probe --testbed swiglu_s
"""

from __future__ import annotations

import argparse
import copy
import json
import math
from collections.abc import Iterable, Sequence
from typing import Optional

import torch
from torch import nn

from hf_tapernorm.layers import tapered_norms
from hf_tapernorm.training import calibrate

from .patching import patch


def norm_paths(model: nn.Module) -> list[str]:
    """Qualified names of every internal norm (input_layernorm, post_attention_layernorm) in order."""
    names = []
    for name, _ in model.named_modules():
        if name.endswith("input_layernorm") or name.endswith("post_attention_layernorm"):
            names.append(name)
    return names


def layer_index(name: str) -> int:
    return int(name.split(".layers.")[1].split(".")[0])


def kind_of(name: str) -> str:
    return "mlp" if name.endswith("post_attention_layernorm") else "attn"


@torch.no_grad()
def scale_stats(model: nn.Module, blocks: torch.Tensor, batch: int = 8, sink: int = 1) -> dict:
    """Per norm input: sink/median, max non-sink/median, 99.9th percentile/median, share of tokens > 4x."""
    paths = norm_paths(model)
    rows: dict[str, list[torch.Tensor]] = {p: [] for p in paths}

    def hook_for(path):
        def hook(module, args):
            h = args[0].float()
            rows[path].append(h.pow(2).mean(-1).sqrt())  # [b, t]

        return hook

    handles = [model.get_submodule(p).register_forward_pre_hook(hook_for(p)) for p in paths]
    # Update sizes: RMS of each attention / MLP output (what the sublayer adds to the residual).
    updates: dict[str, list[torch.Tensor]] = {}

    def out_hook_for(path):
        def hook(module, args, output):
            o = output[0] if isinstance(output, tuple) else output
            updates.setdefault(path, []).append(o.float().pow(2).mean(-1).sqrt())

        return hook

    for name, module in model.named_modules():
        if name.endswith(".self_attn") or name.endswith(".mlp"):
            handles.append(module.register_forward_hook(out_hook_for(name)))
    was = model.training
    model.eval()
    try:
        for i in range(0, len(blocks), batch):
            model(input_ids=blocks[i : i + batch])
    finally:
        for h in handles:
            h.remove()
        model.train(was)
    out = {}
    for p in paths:
        r = torch.cat(rows[p], 0)
        rest = r[:, sink:].reshape(-1)
        med = rest.median()
        ratio = rest / med
        out[p] = {
            "sink_ratio": float(r[:, :sink].mean() / med) if sink else math.nan,
            "max_ratio": float(ratio.max()),
            "p999_ratio": float(torch.quantile(ratio, 0.999)),
            "share_above_4x": float((ratio > 4).float().mean()),
            "median": float(med),
        }
        # median over non-sink tokens of |sublayer update| / |residual entering it|
        block = p.rsplit(".", 1)[0]
        sub = block + (".self_attn" if kind_of(p) == "attn" else ".mlp")
        if sub in updates:
            u = torch.cat(updates[sub], 0)[:, sink:]
            out[p]["update_ratio"] = float((u / r[:, sink:]).median())
    return out


def summarize_scales(stats: dict) -> dict:
    """The figures the reproduction table compares with SmolLM2."""
    sinks = {layer_index(p): v["sink_ratio"] for p, v in stats.items() if kind_of(p) == "attn"}
    maxes = [v["max_ratio"] for v in stats.values()]
    layers = sorted(sinks)
    peak_layer = max(layers, key=lambda i: sinks[i])
    big = [i for i in layers if sinks[i] > 0.5 * sinks[peak_layer]]
    return {
        "sink_ratio_peak": sinks[peak_layer],
        "sink_ratio_peak_layer": peak_layer,
        "sink_ratio_by_layer": [round(sinks[i], 1) for i in layers],
        "sink_massive_from_layer": min(big) if big else None,
        "other_max_ratio_range": [min(maxes), max(maxes)],
        "other_max_ratio_by_layer": [
            round(max(v["max_ratio"] for p, v in stats.items() if layer_index(p) == i), 1) for i in layers
        ],
        "share_above_4x_max": max(v["share_above_4x"] for v in stats.values()),
        "attn_update_ratio_by_layer": [
            round(stats[p].get("update_ratio", math.nan), 2) for p in stats if kind_of(p) == "attn"
        ],
        "mlp_update_ratio_by_layer": [
            round(stats[p].get("update_ratio", math.nan), 2) for p in stats if kind_of(p) == "mlp"
        ],
    }


# ------------------------------------------------------------------------------ calibration
class ChannelStats:
    """Per-channel least-squares statistics of each tapered norm's input (sink positions excluded).

    a_j = sum_t x_tj^2 / r_t / sum_t x_tj^2 is the per-channel gain that best matches the norm's
    1/r_t over the seen tokens; ``apply`` sets ``taper_weight_j = gain_j * a_j / c`` after
    ``calibrate`` froze c, so the linear branch c * taper_weight is still a per-channel map.
    """

    def __init__(self, model: nn.Module, sink: int) -> None:
        self.sink = sink
        self.sums: dict[str, torch.Tensor] = {}
        self.layers = dict(tapered_norms(model))
        self.handles = [m.register_forward_pre_hook(self._hook(n)) for n, m in self.layers.items()]
        self.active = True

    def _hook(self, name):
        def hook(module, args):
            if not self.active or not module.training or module.is_calibrated:
                return
            with torch.no_grad():
                x = args[0].detach().float()
                if self.sink:
                    x = x[:, self.sink :]
                x = x.reshape(-1, x.shape[-1])
                r = torch.sqrt(x.pow(2).mean(-1) + module.eps)
                sq = x.pow(2)
                s = torch.stack([(sq / r[:, None]).sum(0), sq.sum(0)])
                self.sums[name] = s if name not in self.sums else self.sums[name] + s

        return hook

    def reset(self) -> None:
        self.sums.clear()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    @torch.no_grad()
    def apply(self) -> None:
        for name, layer in self.layers.items():
            if name not in self.sums:
                continue
            num, den = self.sums[name].double()
            per = torch.where(den > 0, num / den.clamp_min(1e-12), torch.zeros_like(num))
            gain = layer.effective_gain().detach().double()
            c = float(layer.c)
            layer.taper_weight.copy_((gain * per / c).to(layer.taper_weight.dtype))


@torch.no_grad()
def calibrate_on(model: nn.Module, batches: Iterable[torch.Tensor], *, per_channel: bool = True, sink: int = 1) -> None:
    """Training-mode forwards without gradient on ``batches``, then freeze c (and the per-channel gains)."""
    stats = ChannelStats(model, sink) if per_channel else None
    was = model.training
    model.train()
    for x in batches:
        model(input_ids=x)
    calibrate(model)
    if stats is not None:
        stats.apply()
        stats.remove()
    model.train(was)


def set_gates(model: nn.Module, attn: float, mlp: float) -> None:
    for name, layer in tapered_norms(model):
        layer.set_gate(mlp if kind_of(name) == "mlp" else attn)


def gate_grid(
    model: nn.Module, calib: Sequence[torch.Tensor], held: torch.Tensor, pairs, *, sink: int = 1, ce_fn=None
) -> list[dict]:
    """Held-out CE with the attention norms at gate a and the MLP norms at gate m, no training."""
    patched = copy.deepcopy(model)
    patch(patched, scope="internal", sink_token_ids=[int(held[0, 0])] if sink else None)
    calibrate_on(patched, calib, sink=sink)
    rows = []
    for a, m in pairs:
        set_gates(patched, a, m)
        ce = ce_fn(patched, held)
        rows.append({"attn_gate": a, "mlp_gate": m, "held_out_ce": ce if math.isfinite(ce) else None})
    return rows


def fragility(
    model: nn.Module,
    calib: Sequence[torch.Tensor],
    held: torch.Tensor,
    *,
    ce_fn,
    sink: int = 1,
    gates=(0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.6, 0.5, 0.4, 0.3, 0.25, 0.2, 0.15, 0.1, 0.05, 0.0),
) -> dict:
    """Training-free: lower the MLP norms' gate (attention norms at 1) until held-out CE is not finite.

    Returns the CE curve and ``break_gate``, the highest gate with a non-finite CE (None if none).
    """
    patched = copy.deepcopy(model)
    patch(patched, scope="internal", sink_token_ids=[int(held[0, 0])] if sink else None)
    calibrate_on(patched, calib, sink=sink)
    curve, broke = [], None
    for g in gates:
        set_gates(patched, 1.0, g)
        ce = ce_fn(patched, held)
        curve.append([g, ce if math.isfinite(ce) else None])
        if not math.isfinite(ce):
            broke = g
            break
    return {"break_gate": broke, "curve": curve}


def main(argv: Optional[list[str]] = None) -> None:
    from .data import corpus_for, held_out_blocks, training_batches
    from .testbed import held_out_ce, load_testbed

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--testbed", required=True)
    p.add_argument("--blocks", type=int, default=32)
    p.add_argument("--grid", action="store_true", help="also the training-free gate grid")
    p.add_argument("--out", default=None, help="write the JSON here")
    p.add_argument("--fragility", action="store_true", help="also the training-free MLP-gate break point")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.testbed == "smollm2":
        from .smollm2 import load_smollm2, shuffled_batches, token_blocks

        model, tok = load_smollm2()
        train, held = token_blocks(tok, 128, "top")
        held = held[: args.blocks]
        meta = {"name": "smollm2", "parameters": sum(p.numel() for p in model.parameters())}
        batches = shuffled_batches(train, 2, seed=99)
        calib_count = 4
    else:
        model, meta = load_testbed(args.testbed)
        corpus = corpus_for(meta.get("tokenizer", "bytes"))
        held = held_out_blocks(corpus, meta["seq"], args.blocks)
        batches = training_batches(corpus, 16, meta["seq"], seed=99)
        calib_count = 4
    stats = scale_stats(model, held)
    result = {"testbed": meta, "held_out_ce": held_out_ce(model, held), "scales": summarize_scales(stats)}
    calib = [next(batches) for _ in range(calib_count)]
    if args.grid:
        pairs = [(1, 1), (0.5, 1), (0, 1), (1, 0.75), (1, 0.5), (1, 0.25), (1, 0), (0.5, 0.5), (0, 0)]
        result["gate_grid"] = gate_grid(model, calib, held, pairs, ce_fn=held_out_ce)
    if args.fragility:
        result["fragility"] = fragility(model, calib, held, ce_fn=held_out_ce)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
