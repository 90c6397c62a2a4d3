"""``fold`` and ``eval`` on a finished run: paths as users type them ('~' quoted, a trailing slash), a Trainer
checkpoint that reads the run's tokenizer, a destination that cannot be written refused before loading, and an
--overwrite of the run's own export that writes the same model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hf_tapernorm import (
    export_folded,
    fold_model,
)
from hf_tapernorm.evaluation.models import load_tokenizer, resolve_model
from tests.helpers import copy_run as copy_of
from tests.helpers import finished_run, one_model_workspace, refused, run_main, tapered
from tests.helpers import short_eval_argv as evaluate
from tests.helpers import short_fold_argv as fold
from tests.helpers import short_taper_argv as taper


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    return one_model_workspace(tmp_path_factory.mktemp("fold_and_eval"))


@pytest.fixture(scope="module")
def baseline_run(ws) -> Path:
    """A finished 6-step run with --baseline (checkpoint-6, tapered/, folded/, baseline/, report.json)."""
    return finished_run(taper(ws, ws / "run", "--baseline"))


@pytest.fixture(scope="module")
def run(baseline_run) -> Path:
    """The finished run, as the cases that read only its tapered/ and folded/ call it."""
    return baseline_run


# ============================================================================= paths as typed
def test_fold_eval_and_export_read_a_quoted_home_path(run, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert run_main(fold(run / "tapered", "~/export"))[0] == 0
    assert (tmp_path / "export" / "model.safetensors").is_file()
    code, _, stderr = run_main(evaluate(run / "folded", "--output_json", "~/result.json"))
    assert code == 0, stderr[-2000:]
    assert json.loads((tmp_path / "result.json").read_text())["kind"] == "folded"
    assert export_folded(fold_model(tapered("llama")), "~/api_export") == tmp_path / "api_export"
    assert not (tmp_path / "~").exists()


def test_fold_of_a_checkpoint_with_a_trailing_slash_and_eval_in_float16(run, tmp_path):
    assert run_main(fold(str(run / "checkpoint-6") + "/", tmp_path / "export"))[0] == 0
    assert json.loads((tmp_path / "export" / "config.json").read_text())["model_type"] == "tapernorm_llama"
    code, out, _ = run_main(evaluate(run / "folded", "--dtype", "float16"))
    assert code == 0 and json.loads(out.splitlines()[0])["kind"] == "folded"


def test_eval_and_fold_of_a_trainer_checkpoint_find_the_runs_tokenizer(ws, baseline_run, tmp_path):
    checkpoint = next(baseline_run.glob("checkpoint-*"))
    assert not (checkpoint / "tokenizer.json").exists()
    code, stdout, stderr = run_main(
        ["eval", "--model_name_or_path", str(checkpoint), "--dataset_name", str(ws / "corpus.txt"),
         "--block_size", "32", "--heldout_blocks", "4", "--heldout_percentage", "10", "--out_of_corpus_blocks", "0",
         "--scan_windows", "0"]
    )  # fmt: skip
    assert code == 0, stderr
    result = json.loads(stdout.strip().splitlines()[0])
    report = json.loads((baseline_run / "report.json").read_text())
    assert result["kind"] == "tapered" and result["loss"] == pytest.approx(report["heldout"]["tapered"]["loss"], 1e-5)
    export = tmp_path / "export"
    code, _, stderr = run_main(
        ["fold", "--checkpoint", str(checkpoint), "--output_dir", str(export), "--scan_windows", "0"]
    )
    assert code == 0, stderr
    assert load_tokenizer(resolve_model(str(export)))("ab")["input_ids"] == [97, 98]


# ============================================================================= where fold writes
def test_fold_to_an_unwritable_destination_is_refused_before_loading(baseline_run, tmp_path, monkeypatch):
    import hf_tapernorm.cli.commands as commands

    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(commands.os, "access", lambda path, mode: Path(path) != locked and real_access(path, mode))
    monkeypatch.setattr(commands, "load_model", lambda *a, **k: pytest.fail("loaded before the destination check"))
    fold = ["fold", "--checkpoint", str(baseline_run / "tapered"), "--output_dir", str(locked / "export")]
    refused(fold, f"'{locked}' is not writable")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_fold_into_a_read_only_folder(baseline_run, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        refused(["fold", "--checkpoint", str(baseline_run / "tapered"), "--output_dir", str(locked / "x")], "writable")
    finally:
        locked.chmod(0o755)


def test_fold_overwrite_of_the_runs_own_export_replaces_it_with_the_same_model(run, tmp_path):
    folder = copy_of(run, tmp_path)
    before = (folder / "folded" / "model.safetensors").read_bytes()
    assert run_main(fold(folder / "tapered", folder / "folded", "--overwrite"))[0] == 0
    assert (folder / "folded" / "model.safetensors").read_bytes() == before
