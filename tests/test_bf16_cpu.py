"""``--bf16`` on a machine without an accelerator: bf16 autocast on the CPU, said when the CPU is slow at it."""

from __future__ import annotations

import contextlib
import io
import json
import logging

import pytest

import hf_tapernorm.cli.arguments as arguments
from hf_tapernorm._parsing import parse
from hf_tapernorm.cli import main
from hf_tapernorm.cli.arguments import TaperTrainingArguments
from hf_tapernorm.utils import accelerator_available, cpu_has_fast_bf16
from tests.conftest import corpus_documents, save_tiny_model


@pytest.fixture
def cpu_only(monkeypatch):
    monkeypatch.setattr(arguments, "accelerator_available", lambda: False)


def test_bf16_without_an_accelerator_means_bf16_autocast_on_the_cpu(cpu_only, monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(arguments, "cpu_has_fast_bf16", lambda: True)
    with caplog.at_level(logging.INFO, logger="hf_tapernorm"):
        (args,) = parse([TaperTrainingArguments], ["--bf16", "--output_dir", str(tmp_path)], "hf-tapernorm taper")
    assert args.bf16 and args.use_cpu  # transformers alone stops with "Your setup doesn't support bf16/gpu"
    assert "training on the CPU with bf16 autocast" in caplog.text and "slower than fp32" not in caplog.text


def test_bf16_on_a_cpu_without_fast_bf16_says_so_in_one_line(cpu_only, monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(arguments, "cpu_has_fast_bf16", lambda: False)
    with caplog.at_level(logging.WARNING, logger="hf_tapernorm"):
        (args,) = parse([TaperTrainingArguments], ["--bf16", "--output_dir", str(tmp_path)], "hf-tapernorm taper")
    assert args.use_cpu
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "no fast bf16 matrix products" in warning and "drop --bf16" in warning and "\n" not in warning


def test_fp32_asks_nothing_of_the_cpu(monkeypatch, tmp_path):
    monkeypatch.setattr(arguments, "cpu_has_fast_bf16", lambda: pytest.fail("timed bf16 without --bf16"))
    (args,) = parse([TaperTrainingArguments], ["--output_dir", str(tmp_path)], "hf-tapernorm taper")
    assert not args.bf16


def test_memory_is_not_pinned_without_an_accelerator(cpu_only, tmp_path, recwarn):
    """Pinning needs an accelerator: on a CPU the option is off, and the data loader does not warn on every run."""
    import torch

    (args,) = parse([TaperTrainingArguments], ["--output_dir", str(tmp_path)], "hf-tapernorm taper")
    assert args.dataloader_pin_memory is False
    list(torch.utils.data.DataLoader(list(range(4)), batch_size=2, pin_memory=args.dataloader_pin_memory))
    assert not [w for w in recwarn if "pin_memory" in str(w.message)]


def test_the_bf16_check_measures_this_machine():
    assert isinstance(cpu_has_fast_bf16(), bool) and cpu_has_fast_bf16() is cpu_has_fast_bf16()  # measured once
    assert isinstance(accelerator_available(), bool)


@pytest.mark.skipif(accelerator_available(), reason="runs the CPU autocast path")
def test_a_bf16_run_on_the_cpu_records_its_precision(tmp_path):
    save_tiny_model(tmp_path / "llama")
    (tmp_path / "corpus.txt").write_text("\n\n".join(corpus_documents(150)))
    argv = [
        "taper", "--model_name_or_path", str(tmp_path / "llama"), "--dataset_name", str(tmp_path / "corpus.txt"),
        "--block_size", "32", "--heldout_blocks", "4", "--heldout_percentage", "10", "--max_steps", "6",
        "--per_device_train_batch_size", "2", "--taper_start", "2", "--taper_end", "4", "--output_dir",
        str(tmp_path / "run"), "--disable_tqdm", "true", "--out_of_corpus_blocks", "0", "--scan_windows", "0",
        "--data_cache_dir", str(tmp_path / "cache"), "--bf16",
    ]  # fmt: skip
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert main(argv) == 0, err.getvalue()
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["training"]["mixed_precision"] == "bf16" and report["model"]["dtype"] == "float32"
    assert "bf16 autocast" in out.getvalue()
