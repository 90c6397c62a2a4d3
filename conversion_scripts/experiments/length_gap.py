#!/usr/bin/env python
"""The gap at one long window length, read on many windows: a finer reading of the scan's longest row.

The robustness scan reads as many tokens at each length, so its longest windows are few (16 of 1024 tokens at
``--windows 128``) and their gap is rough: a 90% interval several points wide. This script reads one length
only, on as many windows as asked, drawn from a larger stream of the same text; every run reads the same windows
(they depend on the text, the length and ``--seed`` only), so runs compare window by window. Where along the
windows the gap lies is length_profile.py's question. The windows'
per-token losses go to ``<run>/length_gap_<text>_<length>.json``::

    python -m conversion_scripts.experiments.length_gap runs/fidelity_cpu_bf16/steps600/final_norm_sink_3/seed42 \\
        --length 1024 --windows 64
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Optional

import torch

from hf_tapernorm.evaluation import draw_offsets, gap_interval, score_models

from .scan_runs import TEXTS, load_run, text_set


def length_gap(run: Path, text: str, length: int, windows: int, blocks: int, seed: int) -> dict[str, Any]:
    """Folded against baseline on ``windows`` windows of ``length`` tokens (sink included) of one text."""
    result_file = run / f"length_gap_{text}_{length}.json"
    if result_file.is_file():
        cached = json.loads(result_file.read_text())
        if (cached["windows_asked"], cached["blocks"], cached["seed"]) == (windows, blocks, seed):
            return cached
    report, tokenizer, folded, reference, sink = load_run(run)
    source = text_set(report, tokenizer, text, blocks, sink)
    span = length - source.prefix_length
    offsets = draw_offsets(len(source.stream), span, windows, seed)
    prefix = source.blocks[0, : source.prefix_length]
    ids = torch.cat([prefix.expand(len(offsets), -1), source.stream[offsets[:, None] + torch.arange(span)]], dim=1)
    with torch.inference_mode():
        scores = score_models(
            {"model": folded, "reference": reference},
            ids,
            prefix_length=source.prefix_length,
            batch_size=1,
            desc=f"{run}: {text}, {length} tokens",
        )
    model_ce, reference_ce = scores["model"].cross_entropy, scores["reference"].cross_entropy
    result = {
        "run": str(run),
        "text": text,
        "length": length,
        "windows_asked": windows,
        "blocks": blocks,
        "seed": seed,
        "stream_tokens": len(source.stream),
        "offsets": offsets.tolist(),
        "model_loss": float(model_ce.double().mean()),
        "reference_loss": float(reference_ce.double().mean()),
        "gap": float(model_ce.double().sum() / reference_ce.double().sum() - 1),
        "gap_interval": gap_interval(model_ce, reference_ce),
        "model_window_losses": model_ce.double().mean(1).tolist(),
        "reference_window_losses": reference_ce.double().mean(1).tolist(),
    }
    result_file.write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="Finished taper run folders (folded/, report.json).")
    parser.add_argument("--text", choices=TEXTS, default="held-out", help="The text to read.")
    parser.add_argument("--length", type=int, default=1024, help="Window length in tokens, the sink included.")
    parser.add_argument("--windows", type=int, default=64, help="Windows to read.")
    parser.add_argument("--blocks", type=int, default=1024, help="Blocks of the run's block size in the text's draw.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the windows' offsets.")
    args = parser.parse_args(argv)
    print("| run | windows | stream tokens | baseline | folded | gap | 90% interval |")
    print("|---|---|---|---|---|---|---|")
    for run in args.runs:
        r = length_gap(run, args.text, args.length, args.windows, args.blocks, args.seed)
        low, high = r["gap_interval"] or (float("nan"), float("nan"))
        print(
            f"| {run} | {len(r['offsets'])} | {r['stream_tokens']} | {r['reference_loss']:.4f} | "
            f"{r['model_loss']:.4f} | {100 * r['gap']:+.2f}% | {100 * low:+.1f}% to {100 * high:+.1f}% |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
