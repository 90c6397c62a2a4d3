#!/usr/bin/env python
"""Where long inputs lose: a finished run's tapered model against its baseline, by position in long windows.

The robustness scan gives one gap per window length; this script splits long windows by the position of the
predicted token (bins ``[1, 128)``, ``[128, 256)``, ... of the sink-first window), so it tells whether the
tapered model loses at every position of a long input or only at positions it never trained on (the taper
trains on blocks of the run's block size). For a few windows it also reads, per layer and position bin, each
model's mean share of attention on the sink (eager attention) and the median content token's residual RMS,
so a loss at far positions can be traced to the sink losing its share there or to the residual growing::

    python -m conversion_scripts.experiments.length_profile runs/fidelity/steps300/default/seed42 \\
        --text held-out --length 1024 --windows 16

Windows are drawn with the scan's ``hf_tapernorm.evaluation.scan.draw_offsets`` from the text and ``--seed``
alone, so every run reads the same windows. Writes ``<run>/length_profile_<text>_<length>.json`` and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_tapernorm.evaluation import draw_offsets, score_models
from hf_tapernorm.training import load_tapered

from .scan_runs import TEXTS, reference_of, text_set


def position_bins(length: int, block_size: int) -> list[tuple[int, int]]:
    """``[start, end)`` position bins of a window: the training length, then doubling up to ``length``."""
    edges = [1, block_size]
    while edges[-1] < length:
        edges.append(min(2 * edges[-1], length))
    return list(zip(edges[:-1], edges[1:]))


@torch.no_grad()
def attention_and_residuals(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[layers, positions]`` each: the mean (over heads) share of attention on position 0 of every query, and
    every position's residual RMS after each layer (the last one before the final norm). One forward in eager
    attention, whose weights transformers returns (the implementation is restored)."""
    previous = model.config._attn_implementation
    try:
        model.set_attn_implementation("eager")
        output = model.eval()(input_ids=ids, output_attentions=True, output_hidden_states=True)
    finally:
        model.set_attn_implementation(previous)
    shares = torch.stack([weights[0, :, :, 0].double().mean(0) for weights in output.attentions])
    residual = torch.stack([h[0].double().pow(2).mean(-1).sqrt() for h in output.hidden_states[1:-1]])
    return shares, residual


def profile(
    run: Path, text: str, length: int, windows: int, traced: int, seed: int, batch: int, blocks: int
) -> dict[str, Any]:
    report = json.loads((run / "report.json").read_text())
    block_size = report["data"]["block_size"]
    tokenizer = AutoTokenizer.from_pretrained(run / "folded")
    tapered = load_tapered(run / "tapered")
    baseline = AutoModelForCausalLM.from_pretrained(reference_of(run, report))
    sink = list(tapered.tapernorm_config.sink_token_ids or [])
    source = text_set(report, tokenizer, text, blocks, sink)
    offsets = draw_offsets(len(source.stream), length - len(sink), windows, seed + length)
    ids = torch.cat(
        [
            torch.tensor(sink).expand(len(offsets), -1),
            source.stream[offsets[:, None] + torch.arange(length - len(sink))],
        ],
        dim=1,
    )
    scores = score_models(
        {"tapered": tapered, "baseline": baseline},
        ids,
        prefix_length=len(sink),
        batch_size=max(1, batch * block_size // length),
    )
    mine, theirs = scores["tapered"].cross_entropy.double(), scores["baseline"].cross_entropy.double()
    # target j of a window is the token at position prefix + 1 + j; bins are over those positions
    positions = torch.arange(len(sink) + 1, length)
    bins = position_bins(length, block_size)
    rows = []
    for start, end in bins:
        take = (positions >= start) & (positions < end)
        a, b = mine[:, take], theirs[:, take]
        per_window = a.mean(1) - b.mean(1)
        rows.append(
            {
                "positions": [start, end],
                "tapered": float(a.mean()),
                "baseline": float(b.mean()),
                "gap": float(a.mean() / b.mean() - 1),
                "median_window_excess": float(per_window.median()),
                "windows_worse": int((per_window > 0).sum()),
            }
        )
    traces = []
    for i in range(min(traced, len(offsets))):
        window = ids[i : i + 1]
        (my_share, my_rms), (their_share, their_rms) = (
            attention_and_residuals(model, window) for model in (tapered, baseline)
        )
        per_bin = []
        for start, end in bins:
            per_bin.append(
                {
                    "positions": [start, end],
                    "sink_share": {
                        "tapered": my_share[:, start:end].mean(1).tolist(),
                        "baseline": their_share[:, start:end].mean(1).tolist(),
                    },
                    "median_residual": {
                        "tapered": my_rms[:, start:end].median(1).values.tolist(),
                        "baseline": their_rms[:, start:end].median(1).values.tolist(),
                    },
                }
            )
        traces.append({"offset": int(offsets[i]), "bins": per_bin})
    return {
        "run": str(run),
        "text": text,
        "length": length,
        "windows": len(offsets),
        "seed": seed,
        "rows": rows,
        "traces": traces,
    }


def _layers_summary(traces: list[dict[str, Any]], key: str) -> list[str]:
    """Per position bin, tapered / baseline averaged over the traced windows, every fourth layer."""
    if not traces:
        return []
    lines = []
    layers = len(traces[0]["bins"][0][key]["tapered"])
    shown = list(range(0, layers, 4)) + ([layers - 1] if (layers - 1) % 4 else [])
    lines.append(f"| positions | {' | '.join(f'L{layer}' for layer in shown)} |")
    lines.append("|---" * (len(shown) + 1) + "|")
    for b in range(len(traces[0]["bins"])):
        cells = []
        for layer in shown:
            mine = sum(t["bins"][b][key]["tapered"][layer] for t in traces) / len(traces)
            theirs = sum(t["bins"][b][key]["baseline"][layer] for t in traces) / len(traces)
            cells.append(f"{mine:.2f}/{theirs:.2f}")
        start, end = traces[0]["bins"][b]["positions"]
        lines.append(f"| {start}-{end - 1} | {' | '.join(cells)} |")
    return lines


def table(result: dict[str, Any]) -> str:
    lines = [
        f"{result['run']}: {result['text']}, {result['windows']} windows of {result['length']} tokens",
        "",
        "| positions | baseline | tapered | gap | median window excess (nats) | windows worse |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        start, end = row["positions"]
        lines.append(
            f"| {start}-{end - 1} | {row['baseline']:.4f} | {row['tapered']:.4f} | {100 * row['gap']:+.2f}% | "
            f"{row['median_window_excess']:+.4f} | {row['windows_worse']}/{result['windows']} |"
        )
    if result["traces"]:
        lines += ["", f"sink share, tapered/baseline ({len(result['traces'])} windows):", ""]
        lines += _layers_summary(result["traces"], "sink_share")
        lines += ["", "median residual RMS, tapered/baseline:", ""]
        lines += _layers_summary(result["traces"], "median_residual")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="A finished taper run folder (tapered/, folded/, report.json).")
    parser.add_argument("--text", choices=TEXTS, default="held-out")
    parser.add_argument("--length", type=int, default=1024, help="Window tokens, sink included.")
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--traced", type=int, default=4, help="Windows whose attention and residuals are read.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--blocks", type=int, default=256, help="Blocks of the text's draw (its stream's size).")
    parser.add_argument("--eval_batch_size", type=int, default=8, help="Blocks of the block size per forward.")
    args = parser.parse_args(argv)
    result = profile(
        args.run, args.text, args.length, args.windows, args.traced, args.seed, args.eval_batch_size, args.blocks
    )
    out = args.run / f"length_profile_{args.text}_{args.length}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
