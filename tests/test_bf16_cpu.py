"""``--bf16`` on a machine without an accelerator: bf16 autocast on the CPU, said when the CPU is slow at it; by
default, bf16 exactly where it is fast; and bf16 training leaves no autocast on evaluation, fold or export."""

from __future__ import annotations

import contextlib
import io
import json
import logging

import pytest
import torch
from transformers import HfArgumentParser, TrainingArguments

import hf_tapernorm.cli.arguments as arguments
from hf_tapernorm import TaperNormConfig, patch_model
from hf_tapernorm._parsing import parse
from hf_tapernorm.app.record import precision_line
from hf_tapernorm.app.report import render_markdown
from hf_tapernorm.cli import main
from hf_tapernorm.cli.arguments import TaperTrainingArguments
from hf_tapernorm.layers import set_gate
from hf_tapernorm.training import calibrate
from hf_tapernorm.utils import accelerator_available, cpu_has_fast_bf16
from tests.conftest import build, corpus_documents, random_batches, save_tiny_model, tiny_llama_config
from tests.helpers import run_main, taper_argv


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


def test_fp32_asked_for_asks_nothing_of_the_cpu(monkeypatch, tmp_path):
    monkeypatch.setattr(arguments, "cpu_has_fast_bf16", lambda: pytest.fail("timed bf16 with --bf16 false"))
    (args,) = parse([TaperTrainingArguments], ["--bf16", "false", "--output_dir", str(tmp_path)], "hf-tapernorm taper")
    assert args.bf16 is False


@pytest.mark.parametrize("fast", [True, False])
def test_by_default_a_cpu_trains_in_bf16_exactly_where_bf16_is_fast(cpu_only, monkeypatch, tmp_path, caplog, fast):
    monkeypatch.setattr(arguments, "cpu_has_fast_bf16", lambda: fast)
    with caplog.at_level(logging.INFO, logger="hf_tapernorm"):
        (args,) = parse([TaperTrainingArguments], ["--output_dir", str(tmp_path)], "hf-tapernorm taper")
    assert args.bf16 is fast and args.use_cpu is fast
    line = precision_line(args)  # the first line of the run's log and of its report
    expected = "bf16 autocast, chosen by this machine, where bf16 is fast" if fast else "fp32, chosen by this machine"
    assert line.startswith(f"precision: {expected}"), line
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # fp32 on a slow CPU is no warning


def test_precision_asked_for_is_said_to_be_asked_and_opens_the_report(tmp_path):
    (args,) = parse([TaperTrainingArguments], ["--bf16", "false", "--output_dir", str(tmp_path)], "hf-tapernorm taper")
    line = precision_line(args)
    assert line == "precision: fp32, as asked; evaluation and export in fp32"
    report = render_markdown({"status": "finished", "training": {"precision": line}}, {})
    assert report.splitlines()[:3] == ["# hf_tapernorm run report", "", "**" + line.capitalize() + "**"]


def test_fp16_asked_for_is_not_joined_by_bf16(cpu_only, monkeypatch, tmp_path):
    monkeypatch.setattr(arguments, "cpu_has_fast_bf16", lambda: True)
    monkeypatch.setattr(TrainingArguments, "__post_init__", lambda self: None)  # fp16 needs a GPU in transformers
    (args,) = parse([TaperTrainingArguments], ["--fp16", "--output_dir", str(tmp_path)], "hf-tapernorm taper")
    assert args.fp16 and not args.bf16


def test_a_bare_bf16_flag_and_its_values_still_parse_in_any_script(cpu_only, monkeypatch, tmp_path):
    """Scripts of their own parse these arguments with transformers' HfArgumentParser (the experiments do)."""
    monkeypatch.setattr(arguments, "cpu_has_fast_bf16", lambda: False)
    cases = (([], False), (["--bf16"], True), (["--bf16", "true"], True), (["--bf16", "no"], False))
    for argv, expected in cases:
        (ours,) = parse([TaperTrainingArguments], [*argv, "--output_dir", str(tmp_path)], "hf-tapernorm taper")
        (theirs,) = HfArgumentParser([TaperTrainingArguments]).parse_args_into_dataclasses(
            args=[*argv, "--output_dir", str(tmp_path)]
        )
        assert ours.bf16 is expected and theirs.bf16 is expected, argv
    assert TaperTrainingArguments(output_dir=str(tmp_path)).bf16 is False  # in Python too


def test_memory_is_not_pinned_without_an_accelerator(cpu_only, tmp_path, recwarn):
    """Pinning needs an accelerator: on a CPU the option is off, and the data loader does not warn on every run."""
    import torch

    (args,) = parse([TaperTrainingArguments], ["--output_dir", str(tmp_path)], "hf-tapernorm taper")
    assert args.dataloader_pin_memory is False
    list(torch.utils.data.DataLoader(list(range(4)), batch_size=2, pin_memory=args.dataloader_pin_memory))
    assert not [w for w in recwarn if "pin_memory" in str(w.message)]


def test_the_cpu_s_flags_decide_where_the_kernel_lists_them(tmp_path, monkeypatch):
    import hf_tapernorm.utils as utils

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f amx_bf16\nbogomips\t: 4000\n")
    assert utils.cpu_flags(info) == {"fpu", "sse", "avx2", "avx512f", "amx_bf16"}
    info.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")  # an arm64 kernel: no x86 flag list
    assert utils.cpu_flags(info) is None
    assert utils.cpu_flags(tmp_path / "missing") is None  # another operating system
    for flags, fast in (({"avx2", "avx512_bf16"}, True), ({"avx2", "amx_bf16"}, True), ({"avx2", "avx512f"}, False)):
        monkeypatch.setattr(utils, "cpu_flags", lambda flags=flags: frozenset(flags))
        monkeypatch.setattr(utils, "_bf16_products_timed_faster", lambda: pytest.fail("timed with flags listed"))
        utils.cpu_has_fast_bf16.cache_clear()
        assert utils.cpu_has_fast_bf16() is fast, flags
    monkeypatch.setattr(utils, "cpu_flags", lambda: None)
    monkeypatch.setattr(utils, "_bf16_products_timed_faster", lambda: True)
    utils.cpu_has_fast_bf16.cache_clear()
    assert utils.cpu_has_fast_bf16() is True  # no flags: timed
    utils.cpu_has_fast_bf16.cache_clear()  # the next caller measures this machine again


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


# ============================================================================= mixed precision is contained
def test_bf16_training_leaves_no_autocast_on_evaluation_fold_or_export(workspace, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    code, _, stderr = run_main(taper_argv(workspace, out, "--distill_weight", "0", "--bf16", steps=8))
    assert code == 0, stderr
    fold = json.loads((out / "report.json").read_text())["fold"]
    assert fold["max_rel_diff"] <= 1e-5 and fold["float64_max_rel_diff"] is None, fold  # no float64 rescue
    assert run_main(["fold", "--checkpoint", str(out / "tapered"), "--output_dir", str(tmp_path / "refold")])[0] == 0
    ids = torch.randint(0, 127, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        exported = AutoModelForCausalLM.from_pretrained(out / "folded").eval()(input_ids=ids).logits
        refolded = AutoModelForCausalLM.from_pretrained(tmp_path / "refold").eval()(input_ids=ids).logits
    assert float((exported - refolded).abs().max()) <= 1e-6


def test_the_fold_check_under_autocast_fails_instead_of_calling_the_fold_exact():
    from hf_tapernorm import FoldCheckError, fold_model

    model = patch_model(build(tiny_llama_config()), TaperNormConfig.paper()).train()
    for ids in random_batches():
        model(input_ids=ids)
    calibrate(model)
    set_gate(model, 0.0)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(FoldCheckError, match="autocast is on"):
        fold_model(model.eval())
    assert fold_model(model).fold_report.max_rel_diff <= 1e-5  # the same model, autocast off
