#!/usr/bin/env python
"""The robustness scan of finished ``taper`` runs, on their own evaluation texts and on a text none has seen.

Each run folder's folded export is scanned against the run's normalized baseline (``baseline/model`` of the
run, or the ``--baseline_from`` model its report names) with ``hf_tapernorm.evaluation.scan.robustness_scan``,
on three texts: the run's held-out documents, the Python documentation topics (the out-of-corpus text of
every report), and a text none of the runs has seen: the English text files that ship with IDLE in every
CPython (``idlelib/*.txt``: change logs, read-me, credits), which neither the embedded corpus (``.py`` files)
nor the documentation topics contain. The scan's windows depend on the texts and ``--seed`` only, so every
run reads the same ones. Results go to ``<run>/scan.json`` (``--texts`` scans some of the three, into
``<run>/scan_<texts>.json``); the table of every run to stdout and ``--table``::

    python -m conversion_scripts.experiments.scan_runs runs/fidelity/steps300/default/seed42 \\
        runs/fidelity/steps300/default/seed7 --windows 64 --table runs/fidelity/steps300/default/scan.md
"""

from __future__ import annotations

import argparse
import idlelib
import json
import re
import sys
from pathlib import Path
from typing import Any, Optional

from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_tapernorm  # noqa: F401  (registers the folded model classes)
from hf_tapernorm.data import EvaluationSet, embedded_corpus, heldout_documents, python_docs_documents, sample_blocks
from hf_tapernorm.evaluation import robustness_scan

IDLE = "idle"


def idle_documents() -> list[tuple[str, str]]:
    """The unseen English text: each paragraph of IDLE's text files, as the CLI reads a text file."""
    documents = []
    for path in sorted(Path(idlelib.__file__).parent.glob("*.txt")):
        paragraphs = re.split(r"\n\s*\n", path.read_text(encoding="utf-8", errors="replace"))
        documents += [(f"{path.name}:{i}", p.strip()) for i, p in enumerate(paragraphs) if p.strip()]
    return documents


TEXTS = ("held-out", "out-of-corpus", IDLE)


def text_set(report: dict[str, Any], tokenizer, name: str, count: int, sink: list[int]) -> EvaluationSet:
    """``count`` blocks of one of the TEXTS of a run on the embedded corpus, sampled as its report's sets are."""
    data = report["data"]
    if data["source"] != "python-stdlib":
        raise SystemExit(f"these scripts read runs on the embedded corpus; this one read {data['source']}")
    sources = {
        "held-out": lambda: heldout_documents(embedded_corpus(), percentage=data["heldout_percentage"]),
        "out-of-corpus": python_docs_documents,
        IDLE: idle_documents,
    }
    return sample_blocks(
        sources[name](), tokenizer, block_size=data["block_size"], count=count, prefix_ids=sink, name=name
    )


def texts(report: dict[str, Any], tokenizer, sink: list[int], blocks: int, names=TEXTS) -> list[EvaluationSet]:
    """The held-out, out-of-corpus and unseen texts of one run (those of ``names``), ``blocks`` blocks each."""
    return [text_set(report, tokenizer, name, blocks, sink) for name in names]


def reference_of(run: Path, report: dict[str, Any]) -> Path:
    own = run / "baseline" / "model"
    return own if own.is_dir() else Path(report["export"]["baseline_model"])


def load_run(run: Path) -> tuple[dict[str, Any], Any, Any, Any, list[int]]:
    """A finished run's report, its export's tokenizer, the folded export, its baseline and the export's sink ids."""
    report = json.loads((run / "report.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(run / "folded")
    folded = AutoModelForCausalLM.from_pretrained(run / "folded")
    reference = AutoModelForCausalLM.from_pretrained(reference_of(run, report))
    return report, tokenizer, folded, reference, list(folded.config.sink_token_ids or [])


def scan_run(run: Path, windows: int, blocks: int, seed: int, batch: int, names=TEXTS) -> dict[str, Any]:
    names = list(names)
    result_file = run / ("scan.json" if names == list(TEXTS) else f"scan_{'_'.join(names)}.json")
    if result_file.is_file():
        cached = json.loads(result_file.read_text())
        if cached.get("windows_asked") == windows and cached.get("seed") == seed:
            return cached
    report, tokenizer, folded, reference, sink = load_run(run)
    block_size = report["data"]["block_size"]
    result = robustness_scan(
        folded,
        reference,
        texts(report, tokenizer, sink, blocks, names),
        block_size=block_size,
        windows=windows,
        max_positions=folded.config.max_position_embeddings,
        tokenizer=tokenizer,
        seed=seed,
        batch_tokens=batch * block_size,
    ).to_dict()
    result["windows_asked"] = windows
    result_file.write_text(json.dumps(result, indent=2) + "\n")
    return result


def rows(run: Path, result: dict[str, Any]) -> list[str]:
    out = []
    for row in result["rows"]:
        without, interval = row["gap_without_broken"], row.get("gap_interval")
        out.append(
            f"| {run} | {row['text']} | {row['length']} | {row['windows']} | {100 * row['gap']:+.2f}% | "
            f"{'-' if not interval else f'{100 * interval[0]:+.1f}% to {100 * interval[1]:+.1f}%'} | "
            f"{row['broken']} | {'-' if without is None else f'{100 * without:+.2f}%'} |"
        )
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="Finished taper run folders (folded/, report.json).")
    parser.add_argument("--windows", type=int, default=64, help="Windows per text at the block size.")
    parser.add_argument("--blocks", type=int, default=256, help="Blocks of each text's draw (its stream's size).")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the windows' offsets.")
    parser.add_argument("--eval_batch_size", type=int, default=8, help="Blocks of the block size per forward.")
    parser.add_argument("--table", type=Path, default=None, help="Also write the table to this Markdown file.")
    parser.add_argument(
        "--texts",
        nargs="+",
        choices=TEXTS,
        default=list(TEXTS),
        help="The texts to scan (all three; results in scan.json, a subset in scan_<texts>.json).",
    )
    args = parser.parse_args(argv)
    lines = [
        "| run | text | window tokens | windows | folded vs baseline | 90% interval | broken | gap without them |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in args.runs:
        result = scan_run(run, args.windows, args.blocks, args.seed, args.eval_batch_size, args.texts)
        lines += rows(run, result)
        print("\n".join(rows(run, result)), flush=True)
    table = "\n".join(lines) + "\n"
    print(table)
    if args.table:
        args.table.write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
