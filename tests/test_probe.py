"""Issue 34's probe: every input a user can hand the CLI and the pipeline gets a clear early word or the right result.

Each case is what a new user did (on tiny random models): data loss, silently wrong results, raw tracebacks,
late errors and wrong refusals. Each test would fail on the code before its fix.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from hf_tapernorm import TaperNormConfig, patch_model
from hf_tapernorm._parsing import UsageError, parse
from hf_tapernorm.app.preflight import check_trainer_options
from hf_tapernorm.app.record import FAR_WORSE, far_worse_warning
from hf_tapernorm.app.report import render_markdown, summary_lines
from hf_tapernorm.app.validation import (
    TaperRequest,
    check_schedule,
    fit_default_schedule,
    fit_default_warmup,
    recipe_config,
    weightless_model,
)
from hf_tapernorm.cli.arguments import (
    DataArguments,
    ModelArguments,
    RunArguments,
    TaperArguments,
    TaperTrainingArguments,
)
from hf_tapernorm.errors import ConfigurationError, UnsupportedModelError
from hf_tapernorm.evaluation.models import ModelSourceError, load_tokenizer, resolve_model
from hf_tapernorm.export.folding import fold_model
from hf_tapernorm.export.model_card import render_model_card
from hf_tapernorm.layers.patching import set_gate
from hf_tapernorm.training import calibrate
from hf_tapernorm.training.schedule import decay_learning_rate_after_the_taper
from tests.conftest import build, char_tokenizer, corpus_documents, save_tiny_model, tiny_llama_config
from tests.helpers import run_main

TAPER_OPTIONS = [ModelArguments, DataArguments, TaperArguments, RunArguments, TaperTrainingArguments]


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("probe")
    save_tiny_model(root / "llama", "llama")
    (root / "corpus.txt").write_text("\n\n".join(corpus_documents(150)))
    return root


def argv(ws: Path, out: Path, *extra: str, steps: int = 6, model: str | None = None) -> list[str]:
    return [
        "taper", "--model_name_or_path", model or str(ws / "llama"), "--dataset_name", str(ws / "corpus.txt"),
        "--block_size", "32", "--heldout_blocks", "4", "--heldout_percentage", "10", "--max_steps", str(steps),
        "--per_device_train_batch_size", "2", "--taper_start", "2", "--taper_end", "4", "--output_dir", str(out),
        "--use_cpu", "--disable_tqdm", "true", "--data_cache_dir", str(ws / "cache"), "--out_of_corpus_blocks", "0",
        "--scan_windows", "0", *extra,
    ]  # fmt: skip


def refused(arguments: list[str], *expected: str) -> str:
    """Run a command that must stop with one line (exit 2) holding every ``expected`` fragment."""
    code, _, stderr = run_main(arguments)
    line = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    assert code == 2 and line.startswith("hf-tapernorm "), stderr
    for fragment in expected:
        assert fragment in line, line
    return line


@pytest.fixture(scope="module")
def baseline_run(ws) -> Path:
    """A finished run with --baseline (its baseline/model and checkpoint-6 are what the cases below point at)."""
    out = ws / "run"
    code, _, stderr = run_main(argv(ws, out, "--baseline"))
    assert code == 0, stderr
    return out


def _files(folder: Path) -> dict[str, float]:
    return {p.relative_to(folder).as_posix(): p.stat().st_mtime for p in folder.rglob("*") if p.is_file()}


# ----------------------------------------------------------------------------- 1. data loss
def test_overwrite_refuses_a_model_or_baseline_inside_the_folder_it_deletes(ws, baseline_run, tmp_path):
    before = _files(baseline_run)
    inner = str(baseline_run / "baseline" / "model")
    refused(argv(ws, baseline_run, "--overwrite", model=inner), "--model_name_or_path", "inside --output_dir")
    refused(
        argv(ws, baseline_run, "--overwrite", "--baseline_from", str(baseline_run)), "--baseline_from", "--overwrite"
    )
    refused(argv(ws, baseline_run, "--resume", "--baseline", model=inner), "--model_name_or_path", "--resume")
    assert _files(baseline_run) == before  # nothing deleted, nothing rewritten


# ----------------------------------------------------------------------------- 2. silently wrong
def test_resume_with_another_dtype_is_refused(ws, baseline_run):
    refused(argv(ws, baseline_run, "--resume", "--baseline", "--dtype", "bfloat16"), "dtype", "None in the run")


def test_a_jsonl_whose_rows_name_their_text_differently_is_refused(ws, tmp_path):
    rows = [{"text" if i % 2 else "content": text} for i, text in enumerate(corpus_documents(60))]
    data = tmp_path / "mixed.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out"
    refused([*argv(ws, out), "--dataset_name", str(data)], "has no 'text' value", "content", "--text_column")
    assert not out.exists()


def test_baseline_from_a_run_with_other_options_is_refused_with_what_differs(ws, baseline_run, tmp_path):
    line = refused(argv(ws, tmp_path / "a", "--baseline_from", str(baseline_run), "--seed", "7"), "--baseline_from")
    assert "training.seed: 42 there, 7 now" in line
    refused(argv(ws, tmp_path / "b", "--baseline_from", str(baseline_run), steps=8), "training.max_steps: 6 there")
    # The recipe is not part of a baseline's identity (it never tapered); the same data and training options are.
    code, _, stderr = run_main(argv(ws, tmp_path / "c", "--baseline_from", str(baseline_run), "--distill_weight", "0"))
    assert code == 0, stderr
    report = json.loads((tmp_path / "c" / "report.json").read_text())
    assert report["export"]["baseline_model"] == str(baseline_run / "baseline" / "model")
    assert report["gap"]["tapered_vs_baseline"] is not None


# ----------------------------------------------------------------------------- 3. raw tracebacks
def test_yaml_numbers_without_a_dot_are_numbers(ws, tmp_path):
    options = tmp_path / "run.yaml"
    options.write_text("max_grad_norm: 1e-1\nlearning_rate: 3e-4\nmax_steps: 2e1\noutput_dir: out\n")
    assert isinstance(yaml.safe_load(options.read_text())["learning_rate"], str)  # YAML 1.1: text, not a float
    *_, training = parse(TAPER_OPTIONS, [str(options)], "hf-tapernorm taper")
    assert (training.max_grad_norm, training.learning_rate, training.max_steps) == (0.1, 3e-4, 20)
    options.write_text("learning_rate: fast\n")
    with pytest.raises(UsageError, match="learning_rate must be a number, got 'fast'"):
        parse(TAPER_OPTIONS, [str(options)], "hf-tapernorm taper")
    options.write_text("max_steps: 2.5\n")
    with pytest.raises(UsageError, match="max_steps must be an integer"):
        parse(TAPER_OPTIONS, [str(options)], "hf-tapernorm taper")
    options.write_text("max_steps: [1\n")
    with pytest.raises(UsageError, match="cannot read it"):
        parse(TAPER_OPTIONS, [str(options)], "hf-tapernorm taper")


def test_a_tokenizer_larger_than_the_vocabulary_is_refused_before_loading(ws, tmp_path):
    folder = tmp_path / "small_vocab"
    build(tiny_llama_config(vocab_size=100)).save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)  # 128 tokens
    out = tmp_path / "out"
    refused(
        argv(ws, out, "--sink", "none", model=str(folder)), "128 tokens", "vocab_size 100", "resize_token_embeddings"
    )
    assert not out.exists()
    eval_argv = [
        "eval",
        "--model_name_or_path",
        str(folder),
        "--dataset_name",
        str(ws / "corpus.txt"),
        "--sink",
        "none",
    ]
    refused([*eval_argv, "--block_size", "32", "--out_of_corpus_blocks", "0"], "vocab_size 100")


@pytest.mark.parametrize("state", ["rng_state.pth", "optimizer.pt", "scheduler.pt"])
def test_a_pickle_in_the_trainer_state_stops_resume_early(ws, baseline_run, tmp_path, state):
    copy = tmp_path / "run"
    shutil.copytree(baseline_run, copy)
    checkpoint = next(copy.glob("checkpoint-*"))
    torch.save({"payload": _Payload()}, checkpoint / state)
    line = refused(argv(ws, copy, "--resume", "--baseline"), f"cannot read {checkpoint / state}", "pickled")
    assert "--overwrite" in line


class _Payload:
    """A pickle that would run code (torch's weights_only load refuses to)."""

    def __reduce__(self):
        return (print, ("this pickle ran",))


# ----------------------------------------------------------------------------- 4. late errors, wrong refusals
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


def test_use_liger_kernel_is_refused_before_loading(ws, tmp_path):
    out = tmp_path / "out"
    refused(argv(ws, out, "--use_liger_kernel", "true"), "--use_liger_kernel", "bypassed")
    assert not out.exists()


def test_resume_names_the_same_model_and_data_by_another_path(ws, baseline_run, tmp_path, monkeypatch):
    copy = tmp_path / "run"
    shutil.copytree(baseline_run, copy)
    monkeypatch.chdir(ws)  # the run recorded absolute paths; name them relative now
    arguments = argv(ws, copy, "--resume", "--baseline", model="llama")
    arguments[arguments.index("--dataset_name") + 1] = "corpus.txt"
    code, _, stderr = run_main(arguments)
    assert code == 0, stderr
    # Another file under the same name is still another dataset.
    (tmp_path / "corpus.txt").write_text("\n\n".join(corpus_documents(150, seed=3)))
    monkeypatch.chdir(tmp_path)
    arguments = argv(ws, copy, "--resume", "--baseline")
    arguments[arguments.index("--dataset_name") + 1] = "corpus.txt"
    refused(arguments, "data.contents")


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


def test_a_change_allowed_on_resume_is_in_report_md():
    facts = {"status": "finished", "allowed_changes": {"training.max_grad_norm": {"run": 1.0, "now": 0.5}}}
    markdown = render_markdown(facts, {})
    assert "--allow_changes" in markdown and "| training.max_grad_norm | `1.0` | `0.5` |" in markdown
    assert "allow_changes" not in render_markdown({"status": "finished"}, {})


def test_unmerged_peft_models_are_refused_with_merge_and_unload(ws, tmp_path):
    peft = pytest.importorskip("peft")
    model = AutoModelForCausalLM.from_pretrained(ws / "llama")
    wrapped = peft.get_peft_model(model, peft.LoraConfig(target_modules=["q_proj"], r=2))
    with pytest.raises(UnsupportedModelError, match=r"merge_and_unload\(\)"):
        patch_model(wrapped, TaperNormConfig(sink_token_ids=[]))
    wrapped.save_pretrained(tmp_path / "adapter")
    with pytest.raises(ModelSourceError, match="PEFT adapters.*merge_and_unload"):
        resolve_model(str(tmp_path / "adapter"))
    patched = patch_model(AutoModelForCausalLM.from_pretrained(ws / "llama"), TaperNormConfig(sink_token_ids=[]))
    patched.train()
    patched(torch.randint(1, 127, (2, 16)))
    calibrate(patched)
    set_gate(patched, 0.0)
    lora = peft.get_peft_model(patched, peft.LoraConfig(target_modules=["q_proj"], r=2))
    with pytest.raises(UnsupportedModelError, match=r"fold_model\(model.merge_and_unload\(\)\)"):
        fold_model(lora)


# ----------------------------------------------------------------------------- 5. a failed run says so
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


# ----------------------------------------------------------------------------- 6. defaults that agree
def _validate(source, tokenizer, skeleton, *flags: str) -> None:
    """What taper checks before it loads the weights, on these flags (raises what it would refuse)."""
    request = TaperRequest(*parse(TAPER_OPTIONS, ["--use_cpu", *flags], "hf-tapernorm taper"))
    steps = request.training.max_steps
    config = fit_default_schedule(recipe_config(request, skeleton, tokenizer), request.taper, steps)
    schedule = check_schedule(config, steps)
    fit_default_warmup(request.training, schedule)
    decay_learning_rate_after_the_taper(request.training, schedule)
    check_trainer_options(request.training, schedule, config)
    return request, schedule


def test_defaults_agree_for_every_max_steps(ws, caplog):
    source = resolve_model(str(ws / "llama"))
    tokenizer, skeleton = load_tokenizer(source), weightless_model(source, False)
    caplog.set_level(logging.ERROR)
    for steps in [*range(2, 130), 150, 299, 300, 301, 1000, 4096]:
        for recipe in ("auto", "paper"):
            request, schedule = _validate(source, tokenizer, skeleton, "--max_steps", str(steps), "--recipe", recipe)
            assert 1 <= schedule.k_start < schedule.k_end <= steps, steps
            assert request.training.get_warmup_steps(steps) <= schedule.k_start, steps
    request, schedule = _validate(source, tokenizer, skeleton, "--max_steps", "24")
    assert (schedule.k_start, request.training.get_warmup_steps(24)) == (1, 1)
    request, schedule = _validate(source, tokenizer, skeleton, "--max_steps", "300")  # the fractions, untouched
    assert (schedule.k_start, schedule.k_end, request.training.warmup_steps) == (15, 210, 0.05)
    # What the user sets is not moved: an explicit warmup past the taper start is still refused.
    with pytest.raises(ConfigurationError, match="--warmup_steps 5"):
        _validate(source, tokenizer, skeleton, "--max_steps", "24", "--warmup_steps", "5")
    with pytest.raises(ConfigurationError, match="--max_steps must be at least 2"):
        parse(TAPER_OPTIONS, ["--max_steps", "1"], "hf-tapernorm taper")


def test_taper_with_24_steps_and_every_default_runs(ws, tmp_path):
    out = tmp_path / "out"
    arguments = [
        "taper", "--model_name_or_path", str(ws / "llama"), "--dataset_name", str(ws / "corpus.txt"), "--block_size",
        "32", "--heldout_blocks", "2", "--heldout_percentage", "10", "--max_steps", "24", "--output_dir", str(out),
        "--use_cpu", "--disable_tqdm", "true", "--data_cache_dir", str(ws / "cache"), "--out_of_corpus_blocks", "0",
        "--scan_windows", "0", "--per_device_train_batch_size", "1",
    ]  # fmt: skip
    code, _, stderr = run_main(arguments)
    assert code == 0, stderr
    report = json.loads((out / "report.json").read_text())
    assert report["taper"]["taper_start_step"] == 1 and report["training"]["final_gate"] == 0.0
