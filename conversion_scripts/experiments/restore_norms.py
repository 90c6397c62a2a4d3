#!/usr/bin/env python
"""Which tapered norms carry a break: a finished run's tapered model re-scored with some of them normalizing again.

A ``taper`` run whose folded model breaks on a block (``broken_blocks`` in its report) is loaded from its
``tapered/`` checkpoint; for each ``--restore`` group, the tapered attention input norms of those layers are set
back to gate 1 (the norm they replaced, with the weights the run trained), and the run's evaluation blocks are
scored again against its baseline. A group that mends the broken blocks without moving the other blocks is
where the break starts; that decides which norms a remedy keeps. No training: each group costs the scoring of
the sets once::

    python -m conversion_scripts.experiments.restore_norms runs/fidelity/steps600/default/seed42 \\
        --restore 0-3 1 2 14-17 --blocks 0   # the broken blocks alone
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_tapernorm.data import EvaluationSet
from hf_tapernorm.evaluation import BROKEN_BLOCK_NATS, evaluate_set
from hf_tapernorm.layers import tapered_norms
from hf_tapernorm.training import load_tapered

from .scan_runs import reference_of, text_set

NORM = "input_layernorm"


def layer_range(text: str) -> list[int]:
    """``"0-3"`` -> [0, 1, 2, 3]; ``"2"`` -> [2]."""
    low, _, high = text.partition("-")
    return list(range(int(low), int(high or low) + 1))


def evaluation_sets(report: dict[str, Any], tokenizer) -> list[EvaluationSet]:
    """The run's held-out and out-of-corpus sets, drawn as its report's were."""
    sink = report["taper"]["sink_token_ids"] or []
    return [
        text_set(report, tokenizer, name, report["evaluation_sets"][name]["blocks"], sink)
        for name in ("held-out", "out-of-corpus")
    ]


def subset(evaluation: EvaluationSet, indices: list[int]) -> EvaluationSet:
    """The blocks ``indices`` of ``evaluation`` (the other fields as they are: only the blocks are scored)."""
    chosen = torch.tensor(indices)
    evaluation.blocks, evaluation.target_documents = evaluation.blocks[chosen], evaluation.target_documents[chosen]
    return evaluation


def broken_of(report: dict[str, Any]) -> dict[str, list[int]]:
    """The blocks the report found broken, per set."""
    held = (report.get("heldout_documents") or {}).get("broken_blocks") or {}
    ooc = (report.get("out_of_corpus_blocks") or {}).get("broken_blocks") or {}
    return {"held-out": list(held.get("blocks", [])), "out-of-corpus": list(ooc.get("blocks", []))}


def set_norms(model: torch.nn.Module, layers: list[int], gate: float) -> int:
    """Set the gate of the tapered attention input norms of ``layers``; how many there were."""
    found = 0
    for name, norm in tapered_norms(model):
        parts = name.split(".")
        if parts[-1] == NORM and int(parts[-2]) in layers:
            norm.set_gate(gate)
            found += 1
    return found


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="A finished taper run folder (tapered/, report.json, a baseline).")
    parser.add_argument("--restore", nargs="+", default=["0-3"], help="Layer groups, e.g. 0-3 1 14-17.")
    parser.add_argument(
        "--blocks", type=int, default=None, help="Score the first N blocks of each set and its broken ones (all)."
    )
    parser.add_argument("--eval_batch_size", type=int, default=8)
    parser.add_argument("--output", type=Path, default=None, help="JSON of the results (<run>/restore_norms.json).")
    args = parser.parse_args(argv)
    report = json.loads((args.run / "report.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(args.run / "folded")
    model = load_tapered(args.run / "tapered").eval()
    baseline = AutoModelForCausalLM.from_pretrained(reference_of(args.run, report)).eval()
    broken = broken_of(report)
    sets, indices = [], {}
    for evaluation in evaluation_sets(report, tokenizer):
        count = len(evaluation.blocks) if args.blocks is None else min(args.blocks, len(evaluation.blocks))
        # the report's broken blocks are scored even when --blocks leaves them out
        chosen = sorted(set(range(count)) | set(broken[evaluation.name]))
        if chosen:  # --blocks 0 scores the broken blocks alone
            indices[evaluation.name] = chosen
            sets.append(subset(evaluation, chosen))
    result: dict[str, Any] = {
        "run": str(args.run),
        "threshold_nats": BROKEN_BLOCK_NATS,
        "blocks": {name: len(i) for name, i in indices.items()},
        "variants": {},
    }
    reference = {
        e.name: evaluate_set({"baseline": baseline}, e, batch_size=args.eval_batch_size)["baseline"] for e in sets
    }
    for group in ["as trained", *args.restore]:
        layers = [] if group == "as trained" else layer_range(group)
        if layers and not set_norms(model, layers, 1.0):
            raise SystemExit(f"no tapered {NORM} in layers {group} of {args.run / 'tapered'}")
        row = {}
        for evaluation in sets:
            scores = evaluate_set({"model": model}, evaluation, batch_size=args.eval_batch_size)["model"]
            mine, theirs = scores.per_block(), reference[evaluation.name].per_block()
            row[evaluation.name] = {
                "loss": scores.summary()["loss"],
                "baseline": reference[evaluation.name].summary()["loss"],
                "broken": [
                    block for block, a, b in zip(indices[evaluation.name], mine, theirs) if a - b > BROKEN_BLOCK_NATS
                ],
            }
        set_norms(model, layers, 0.0)
        result["variants"][group] = row
        shown = [
            f"{name} {v['loss']:.4f} ({100 * (v['loss'] / v['baseline'] - 1):+.2f}% vs baseline), broken {v['broken']}"
            for name, v in row.items()
        ]
        print(f"{group:>10}: " + "; ".join(shown), flush=True)
    output = args.output or args.run / "restore_norms.json"
    output.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
