"""What a run reports: a run far worse than its reference says so first (report.json's summary, report.md, the model
card, and the last line on stdout), a change allowed on resume is listed in report.md, and the data is named with
its split and configuration.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_tapernorm import TaperNormConfig, patch_model
from hf_tapernorm.app.record import FAR_WORSE, far_worse_warning
from hf_tapernorm.app.report import render_markdown, summary_lines
from hf_tapernorm.export.folding import fold_model
from hf_tapernorm.export.model_card import render_model_card
from hf_tapernorm.layers.patching import set_gate
from hf_tapernorm.training import calibrate
from tests.helpers import one_model_workspace, run_main
from tests.helpers import short_taper_argv as argv


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    return one_model_workspace(tmp_path_factory.mktemp("report"))


def test_a_change_allowed_on_resume_is_in_report_md():
    facts = {"status": "finished", "allowed_changes": {"training.max_grad_norm": {"run": 1.0, "now": 0.5}}}
    markdown = render_markdown(facts, {})
    assert "--allow_changes" in markdown and "| training.max_grad_norm | `1.0` | `0.5` |" in markdown
    assert "allow_changes" not in render_markdown({"status": "finished"}, {})


# ============================================================================= a failed run says so
def _facts(tapered: float, folded: float, original: float = 2.55, baseline: float | None = None) -> dict:
    heldout = {"original": {"loss": original, "perplexity": 1.0}, "tapered": {"loss": tapered, "perplexity": 1.0}}
    heldout["folded"] = {"loss": folded, "perplexity": 1.0}
    if baseline is not None:
        heldout["baseline"] = {"loss": baseline, "perplexity": 1.0}
    return {
        "status": "finished",
        "heldout": heldout,
        "training": {"steps": 40, "max_steps": 40, "global_batch_blocks": 4},
        "data": {"block_size": 256},
    }


def test_a_run_far_worse_than_its_reference_says_so_first():
    facts = _facts(6.90, 6.95)
    line = far_worse_warning(facts)
    assert line.startswith("WARNING:") and "folded model is +172.5% worse than the original" in line
    assert "40 steps of 4 x 256 tokens" in line and "300 steps" in line and "docs/fidelity.md" in line
    assert summary_lines(facts)[0] == line
    assert render_markdown(facts, {}).splitlines()[3] == line  # the report's first lines: title, blank, ```, this
    # Against the baseline when there is one; a run within the margin has no warning.
    assert "than the baseline" in far_worse_warning(_facts(3.0, 3.0, original=3.2, baseline=2.6))
    ok = 2.55 * (1 + FAR_WORSE / 2)
    assert far_worse_warning(_facts(ok, ok)) is None and not summary_lines(_facts(ok, ok))[0].startswith("WARNING")


def test_the_model_card_shows_the_warning(ws):
    patched = patch_model(AutoModelForCausalLM.from_pretrained(ws / "llama"), TaperNormConfig(sink_token_ids=[]))
    patched.train()
    patched(torch.randint(1, 127, (2, 16)))
    calibrate(patched)
    set_gate(patched, 0.0)
    folded = fold_model(patched)
    warning = far_worse_warning(_facts(6.9, 6.9))
    card = render_model_card(folded, {"warning": warning})
    title = next(i for i, line in enumerate(card.splitlines()) if line.startswith("# "))
    assert f"> **{warning}**" in card.splitlines()[title : title + 4]
    assert "WARNING" not in render_model_card(folded, {})


def test_a_failed_tiny_run_prints_the_warning_last(ws, tmp_path, monkeypatch):
    import hf_tapernorm.app.taper as taper

    monkeypatch.setattr(taper, "far_worse_warning", lambda facts: "WARNING: the run failed (test)")
    code, stdout, stderr = run_main(argv(ws, tmp_path / "out", steps=4))
    assert code == 0, stderr
    assert stdout.strip().splitlines()[-1] == "WARNING: the run failed (test)"


# ============================================================================= the data is named with its split
def test_report_md_and_the_card_name_the_split_the_run_read(ws, tmp_path):
    """`taper --dataset_name testonly --dataset_split test`: report.md said "data: <folder>" and the model card
    "Training data | <folder>", as for the train split; only report.json recorded the split. Both now name it (and
    a configuration, where one is set); the default (the train split, no configuration) reads as before."""
    folder = tmp_path / "testonly"
    folder.mkdir()
    (folder / "test.txt").write_text((ws / "corpus.txt").read_text())
    code, _, stderr = run_main([*argv(ws, tmp_path / "out", steps=4, data=str(folder)), "--dataset_split", "test"])
    assert code == 0, stderr[-2000:]
    report = (tmp_path / "out" / "report.md").read_text()
    assert f"\ndata: {folder} (split test), blocks of 32 tokens, held-out " in report
    card = (tmp_path / "out" / "folded" / "README.md").read_text()
    assert f"\n| Training data | {folder} (split test) |\n" in card
    from hf_tapernorm.app.record import named_data  # how both name the data: a Hub configuration too

    assert (
        named_data({"source": "me/d", "config": "c1", "split": "validation"})
        == "me/d (configuration c1, split validation)"
    )
    assert named_data({"source": "me/d", "config": "c1", "split": None}) == "me/d (configuration c1)"
    assert named_data({"source": "corpus.txt", "config": None, "split": "train"}) == "corpus.txt"


# ============================================================================= the tokens a run trained
def test_the_tokens_count_the_short_last_step_of_each_epoch(ws, tmp_path):
    """On a corpus read more than once, with --gradient_accumulation_steps not dividing the batches of an epoch, the
    Trainer ends each epoch with a short step: report.json counted steps x blocks per step x block size anyway
    (more tokens than trained). It now counts what the Trainer fed: its own count, num_input_tokens_seen."""
    import json

    from tests.conftest import corpus_documents

    (tmp_path / "small.txt").write_text("\n\n".join(corpus_documents(20)))
    flags = ["--gradient_accumulation_steps", "10", "--include_num_input_tokens_seen", "true"]
    code, _, stderr = run_main([*argv(ws, tmp_path / "out", steps=6, data=str(tmp_path / "small.txt")), *flags])
    assert code == 0, stderr[-2000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    training, blocks = report["training"], report["data"]["train_blocks"]
    state = json.loads((tmp_path / "out" / "checkpoint-6" / "trainer_state.json").read_text())
    batches = blocks // 2
    assert batches % 10 and batches < 6 * 10  # the case: short steps, more than one epoch
    assert training["global_batch_blocks"] == 20 and training["tokens"] < 6 * 20 * 32
    assert training["tokens"] == state["num_input_tokens_seen"]
