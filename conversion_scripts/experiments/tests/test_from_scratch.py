"""Plumbing of the from-scratch reproduction script (conversion_scripts/experiments/from_scratch.py).

Two optimizer steps of tiny models: every variant of both architectures runs, tapered variants end
at g = 0, the report files carry the expected keys, cached runs are reused, and the corpus split is
deterministic and by file.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "from_scratch.py"


@pytest.fixture(scope="module")
def from_scratch():
    spec = importlib.util.spec_from_file_location("from_scratch_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


TINY = [
    "--steps", "2", "--seeds", "0", "--batch-size", "2", "--seq-len", "16", "--hidden", "32",
    "--layers", "2", "--heads", "2", "--train-bytes", "20000", "--valid-bytes", "2000",
    "--valid-blocks", "4", "--eval-every", "1", "--threads", "1",
]  # fmt: skip


def test_grid_runs_every_variant_and_writes_the_report(from_scratch, tmp_path):
    report = from_scratch.main(TINY + ["--out", str(tmp_path)])

    assert set(report["summary"]) == {"llama", "gpt2"}
    for arch, variants in report["summary"].items():
        assert set(variants) == set(from_scratch.VARIANTS), arch
        for key, entry in variants.items():
            assert math.isfinite(entry["mean"]) and entry["seeds"] == [0]
            assert ("gap_pct_of_means" in entry) == (key != "baseline")
        assert variants["internal_taper_aux"]["paper_band_pct"] == [0.71, 1.52]
        assert variants["all_taper_aux"]["paper_band_pct"] == [0.78, 1.82]
        assert "paper_band_pct" not in variants["all_taper_noaux"]

    runs = {(r["settings"]["arch"], r["settings"]["variant"]): r for r in report["runs"]}
    assert len(runs) == 10
    for (arch, variant), run in runs.items():
        assert run["final_gate"] == (1.0 if variant.startswith("baseline") else 0.0), (arch, variant)
        assert run["evals"]["step"] == [1, 2]
    # The ablation keeps every norm (gate 1 on both steps) but its scale loss is on after k_start = 1.
    ablation = json.loads((tmp_path / "runs" / "llama_baseline_aux_seed0.json").read_text())
    assert ablation["curve"]["gate"] == [1.0, 1.0]
    assert ablation["curve"]["aux"][0] == 0.0 and ablation["curve"]["aux"][1] > 0.0

    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert set(on_disk) == {"command", "corpus", "settings", "parameters", "seconds_total", "summary", "plots", "runs"}
    assert on_disk["plots"] == ["prelogit_scale.png", "validation_loss.png"]
    for name in on_disk["plots"]:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    markdown = (tmp_path / "report.md").read_text()
    assert "| llama | All-Taper (no aux) |" in markdown and "![pre-logit scale](prelogit_scale.png)" in markdown
    cached = sorted(p.name for p in (tmp_path / "runs").glob("*.json"))
    assert len(cached) == 10 and "gpt2_all_taper_noaux_seed0.json" in cached

    # A second call with the same settings reuses the cache (identical results, no retraining) and
    # appends the hand-written reading to the Markdown.
    notes = tmp_path / "notes.md"
    notes.write_text("Tapered runs track the baseline.\n")
    again = from_scratch.main(TINY + ["--out", str(tmp_path), "--notes", str(notes)])
    assert again["summary"] == report["summary"]
    assert again["seconds_total"] == report["seconds_total"]
    assert (tmp_path / "report.md").read_text().endswith("## Reading\n\nTapered runs track the baseline.\n")


def test_corpus_split_is_by_file_and_deterministic(from_scratch, tmp_path):
    for index in range(25):
        (tmp_path / f"m{index:02d}.py").write_text(f"x = {index}\n" * 20)
    corpus = from_scratch.load_corpus(1000, 200, root=tmp_path)
    held_out = b"".join((tmp_path / f"m{i:02d}.py").read_bytes() + b"\n" for i in (0, 10, 20))
    assert bytes(corpus.valid.to(torch.uint8).tolist()) == held_out[:200]
    assert b"x = 0\n" not in bytes(corpus.train.tolist())
    again = from_scratch.load_corpus(1000, 200, root=tmp_path)
    assert corpus.train.equal(again.train) and corpus.valid.equal(again.valid)
    with pytest.raises(ValueError, match="lower --train-bytes/--valid-bytes"):
        from_scratch.load_corpus(10**7, 200, root=tmp_path)
