"""Secure and recoverable: no code runs from a checkpoint, nothing outside a run folder is touched, push
uploads only the export, and every run survives its own interruption (SIGTERM, SIGKILL at several points).

Each case checks the exit code, the first line of the error, and the files on disk.
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from hf_tapernorm import TaperNormConfig, TaperStateError, load_tapered, patch_model, save_tapered
from hf_tapernorm.app.run_folder import LOCK_NAME, MANIFEST_NAME, RunFolder, RunFolderError
from hf_tapernorm.errors import ConfigurationError
from hf_tapernorm.layers import set_gate
from hf_tapernorm.training import calibrate
from hf_tapernorm.training.sharded import load_sharded_checkpoint, read_sharded_model_state
from tests.conftest import build, char_tokenizer, random_batches, save_tiny_model, tiny_llama_config
from tests.helpers import REPO, error_of, run_main, signal_at_step, snapshot, taper_argv

ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


@pytest.fixture(scope="module")
def reference(workspace, tmp_path_factory):
    """An uninterrupted run of the command the interruption tests kill (no distillation: faster, same paths)."""
    out = tmp_path_factory.mktemp("secure") / "reference"
    code, _, stderr = run_main(killable_argv(workspace, out))
    assert code == 0, stderr
    return out


def killable_argv(workspace, out: Path) -> list[str]:
    """A 10-step run with checkpoints every 3 steps (the last two kept)."""
    extra = ("--distill_weight", "0", "--save_steps", "3", "--save_total_limit", "2")
    return taper_argv(workspace, out, *extra, steps=10)


def assert_same_weights(run: Path, reference: Path) -> None:
    for folder in ("tapered", "folded"):
        got, expected = (
            load_file(str(run / folder / "model.safetensors")),
            load_file(str(reference / folder / "model.safetensors")),
        )
        assert got.keys() == expected.keys()
        for key in got:
            assert torch.equal(got[key], expected[key]), (folder, key)


def tapered_checkpoint(folder: Path) -> Path:
    model = patch_model(build(tiny_llama_config()), TaperNormConfig.paper()).train()
    for ids in random_batches():
        model(input_ids=ids)
    calibrate(model)
    set_gate(model, 0.0)
    save_tapered(model, folder, char_tokenizer())
    return folder


# ============================================================================= 1. no pickle from a checkpoint
class Payload:
    """Unpickling this creates the marker file: proof that code from the checkpoint ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_crafted_sharded_checkpoint_runs_no_code(tmp_path):
    crafted = tapered_checkpoint(tmp_path / "downloaded")
    marker = tmp_path / "PAYLOAD_RAN"
    (crafted / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    for argv in (
        ["fold", "--checkpoint", str(crafted), "--output_dir", str(tmp_path / "export")],
        ["eval", "--model_name_or_path", str(crafted), "--heldout_blocks", "2", "--block_size", "32"],
    ):
        message = error_of(argv)
        assert message.startswith(f"hf-tapernorm {argv[0]}: error: '{crafted}' is a sharded"), message
        assert "pass --trust_sharded_checkpoint (trust_sharded_checkpoint=True)" in message
        assert not marker.exists() and not (tmp_path / "export").exists()
    model = patch_model(build(tiny_llama_config()), TaperNormConfig.paper())
    for load in (
        lambda: load_tapered(crafted),
        lambda: read_sharded_model_state(crafted),
        lambda: load_sharded_checkpoint(crafted, model),
    ):
        with pytest.raises(TaperStateError, match="trust_sharded_checkpoint=True"):
            load()
        assert not marker.exists()
    # The control: opting in reads the pickle, so the refusal above is what kept the payload from running.
    with pytest.raises(Exception):  # noqa: B017 - what the payload returns is no Metadata
        load_tapered(crafted, trust_sharded_checkpoint=True)
    assert marker.exists()


def test_resume_refuses_a_sharded_folder_planted_in_a_checkpoint(reference, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    marker = tmp_path / "PAYLOAD_RAN"
    planted = run / "checkpoint-10" / "distillation_teacher"
    planted.mkdir()
    (planted / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    from hf_tapernorm.app.resume_check import check_resumable

    with pytest.raises(TaperStateError, match=r"distillation_teacher' is a sharded .*--trust_sharded_checkpoint"):
        check_resumable(run)
    assert not marker.exists()


# ============================================================================= 1b. the manifest is no list of paths
@pytest.mark.parametrize("entry", ["../victim/thesis.tex", "ABSOLUTE"])
def test_overwrite_never_deletes_a_manifest_entry_outside_the_folder(workspace, tmp_path, entry):
    victim = tmp_path / "victim" / "thesis.tex"
    victim.parent.mkdir()
    victim.write_text("years of work")
    out = tmp_path / "run"
    out.mkdir()
    (out / "report.md").write_text("ours")
    listed = str(victim) if entry == "ABSOLUTE" else entry
    (out / MANIFEST_NAME).write_text(json.dumps({"tool": "hf-tapernorm", "files": ["report.md", listed]}))
    before = snapshot(out)
    message = error_of([*taper_argv(workspace, out), "--overwrite"])
    assert message.startswith(f"hf-tapernorm taper: error: the manifest {out / MANIFEST_NAME} lists {listed!r}")
    assert "nothing was deleted" in message
    assert victim.read_text() == "years of work" and snapshot(out) == before
    with pytest.raises(RunFolderError):
        RunFolder(out).empty()
    assert victim.read_text() == "years of work" and snapshot(out) == before


def test_symbolic_links_in_a_run_folder_are_refused_before_any_work(workspace, tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "thesis.tex").write_text("years of work")
    out = tmp_path / "run"
    out.mkdir()
    (out / "folded").symlink_to(victim, target_is_directory=True)
    (out / MANIFEST_NAME).write_text(json.dumps({"tool": "hf-tapernorm", "files": ["folded/thesis.tex"]}))
    for flag in ("--overwrite", "--resume"):
        message = error_of([*taper_argv(workspace, out), flag])
        assert message.startswith(f"hf-tapernorm taper: error: output folder '{out}' holds symbolic links (folded)")
        assert (victim / "thesis.tex").read_text() == "years of work"
    with pytest.raises(RunFolderError, match="passes through the symbolic link"):
        RunFolder(out).owned_files()


# ============================================================================= 1c. push uploads only the export
def test_push_uploads_only_the_files_of_the_export(reference, tmp_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    export = tmp_path / "folded"
    shutil.copytree(reference / "folded", export)
    written = sorted(p.relative_to(export).as_posix() for p in export.rglob("*") if p.is_file())
    manifest = json.loads((export / ".hf_tapernorm_export.json").read_text())["files"]
    assert {"model.safetensors", "config.json", "README.md", "tokenizer.json"} <= set(manifest)
    assert set(manifest) == set(written) - {".hf_tapernorm_export.json"}
    (export / ".env").write_text("HF_TOKEN=hf_secret")
    (export / "notes").mkdir()
    (export / "notes" / "private.txt").write_text("private")
    calls = []
    monkeypatch.setattr(
        huggingface_hub.HfApi,
        "create_repo",
        lambda self, repo_id, **kw: calls.append(("create", repo_id, kw)) or SimpleNamespace(repo_id=repo_id),
    )
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", lambda self, **kw: calls.append(("upload", kw)))
    push = ["push", "--export_dir", str(export), "--repo_id", "me/tiny-normfree"]
    message = error_of(push)
    assert message == (
        f"hf-tapernorm push: error: '{export}' holds files the export did not write (.env, notes/private.txt); they "
        "are not uploaded: move them away, or name the ones to publish with --include PATTERN"
    )
    assert "HF_TOKEN" not in message and calls == []
    assert error_of([*push, "--include", "notes/*"]).endswith("did not write (.env); they are not uploaded: "
                                                               "move them away, or name the ones to publish with "
                                                               "--include PATTERN")  # fmt: skip
    (export / ".env").unlink()
    code, _, stderr = run_main([*push, "--include", "notes/*"])
    assert code == 0, stderr
    assert calls[0] == ("create", "me/tiny-normfree", {"private": True, "exist_ok": True, "repo_type": "model"})
    uploaded = set(filter_repo_objects(written + ["notes/private.txt"], allow_patterns=calls[1][1]["allow_patterns"]))
    assert uploaded == set(manifest) | {"notes/private.txt"}
    calls.clear()
    assert run_main([*push, "--no_private"])[0] == 2  # notes/ is refused again without --include
    shutil.rmtree(export / "notes")
    assert run_main([*push, "--no_private"])[0] == 0 and calls[0][2]["private"] is False
    assert set(filter_repo_objects(written, allow_patterns=calls[1][1]["allow_patterns"])) == set(manifest)


def test_push_refuses_an_export_without_a_manifest(reference, tmp_path):
    export = tmp_path / "folded"
    shutil.copytree(reference / "folded", export)
    (export / ".hf_tapernorm_export.json").unlink()
    message = error_of(["push", "--export_dir", str(export), "--repo_id", "me/x"])
    assert message.startswith(f"hf-tapernorm push: error: '{export}' has no export manifest")


# ============================================================================= 2. data loss
def test_fold_overwrite_replaces_only_an_earlier_export(workspace, tmp_path):
    checkpoint = tapered_checkpoint(tmp_path / "tapered")
    model_folder = save_tiny_model(tmp_path / "my_model")  # only names an export also writes
    (model_folder / "README.md").write_text("my model card")
    before = snapshot(model_folder)
    fold = ["fold", "--checkpoint", str(checkpoint), "--output_dir"]
    message = error_of([*fold, str(model_folder), "--overwrite"])
    assert message == (
        f"hf-tapernorm fold: error: refusing to --overwrite '{model_folder}': it is not an earlier export (no "
        ".hf_tapernorm_export.json, and its config.json is not a folded model's); choose another --output_dir"
    )
    assert snapshot(model_folder) == before
    export = tmp_path / "export"
    assert run_main([*fold, str(export)])[0] == 0
    (export / "mine.txt").write_text("user file")
    assert "holds files an export does not write (mine.txt)" in error_of([*fold, str(export), "--overwrite"])
    (export / "mine.txt").unlink()
    assert run_main([*fold, str(export), "--overwrite"])[0] == 0  # an earlier export is replaced
    (export / ".hf_tapernorm_export.json").unlink()  # an export written before the manifest existed
    assert run_main([*fold, str(export), "--overwrite"])[0] == 0
    link = tmp_path / "link"
    link.symlink_to(export, target_is_directory=True)
    assert "is a symbolic link" in error_of([*fold, str(link), "--overwrite"])


def test_eval_output_json_never_writes_over_a_file_it_did_not_create(workspace, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(workspace / "llama", model)
    before = snapshot(model)
    corpus = str(workspace / "corpus.txt")
    evaluate = ["eval", "--model_name_or_path", str(model), "--dataset_name", corpus, "--block_size", "32",
                "--heldout_blocks", "2", "--heldout_percentage", "10", "--output_json"]  # fmt: skip
    message = error_of([*evaluate, str(model / "config.json")])
    assert message == (
        f"hf-tapernorm eval: error: --output_json {model / 'config.json'} exists and is not an earlier result of "
        "hf-tapernorm eval; it is left as it is, name a new file"
    )
    assert snapshot(model) == before
    missing = tmp_path / "no_such_folder" / "result.json"
    assert error_of([*evaluate, str(missing)]).endswith(
        f"the folder '{missing.parent}' does not exist; create it first"
    )
    result = tmp_path / "result.json"
    assert run_main([*evaluate, str(result)])[0] == 0
    assert json.loads(result.read_text())["written_by"] == "hf-tapernorm eval"
    assert run_main([*evaluate, str(result)])[0] == 0  # an earlier result is replaced


def test_a_second_command_is_locked_out_and_a_dead_owner_lock_is_taken_over(workspace, tmp_path, caplog):
    out = tmp_path / "run"
    out.mkdir()
    (out / LOCK_NAME).write_text(json.dumps({"pid": os.getppid(), "host": os.uname().nodename}))  # a live process
    message = error_of([*taper_argv(workspace, out, steps=5), "--overwrite"])
    assert message.startswith(f"hf-tapernorm taper: error: output folder '{out}' is in use by another hf-tapernorm")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (out / LOCK_NAME).write_text(json.dumps({"pid": dead.pid, "host": os.uname().nodename}))
    code, _, stderr = run_main(taper_argv(workspace, out, "--distill_weight", "0", steps=5))
    assert code == 0, stderr
    assert "taking over the lock" in caplog.text and not (out / LOCK_NAME).exists()
    file = tmp_path / "a_file"
    file.write_text("x")
    assert error_of([*taper_argv(workspace, file / "run", steps=5)]).endswith(f"'{file}' is a file")


def test_fold_and_eval_never_write_into_a_folder_a_running_command_owns(workspace, reference, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_NAME).write_text(json.dumps({"pid": os.getppid(), "host": os.uname().nodename}))  # a live taper
    fold = ["fold", "--checkpoint", str(reference / "tapered"), "--output_dir", str(run / "folded")]
    message = error_of(fold)
    assert message.startswith(f"hf-tapernorm fold: error: output folder '{run / 'folded'}' lies in '{run}', which a")
    assert message.endswith("wait for it to finish, or choose a folder outside it")
    corpus = str(workspace / "corpus.txt")
    evaluate = ["eval", "--model_name_or_path", str(workspace / "llama"), "--dataset_name", corpus,
                "--block_size", "32", "--heldout_blocks", "2", "--heldout_percentage", "10"]  # fmt: skip
    assert "which a running hf-tapernorm command owns" in error_of([*evaluate, "--output_json", str(run / "r.json")])
    assert sorted(p.name for p in run.iterdir()) == [LOCK_NAME]  # nothing written
    (run / LOCK_NAME).unlink()  # the command finished
    assert run_main(fold)[0] == 0 and (run / "folded" / "config.json").is_file()


def test_a_refused_resume_keeps_the_recorded_identity(workspace, reference, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    for folder in ("checkpoint-10", "tapered", "folded"):  # back to the run's state at its step-9 checkpoint
        shutil.rmtree(run / folder)
    assert (run / "checkpoint-9").is_dir()
    identity = json.loads((run / MANIFEST_NAME).read_text())["identity"]
    # The gate was 0 at step 9; a taper that starts at step 9 says 1 there: the resume is refused in training.
    changed = [*killable_argv(workspace, run), "--taper_start", "9", "--taper_end", "10"]
    allowed = "taper_start,taper_end,lr_scheduler_kwargs,num_decay_steps"
    message = error_of([*changed, "--resume", "--allow_changes", allowed], code=2)
    assert "resuming at step 9" in message, message
    assert json.loads((run / MANIFEST_NAME).read_text())["identity"] == identity
    code, _, stderr = run_main([*killable_argv(workspace, run), "--resume"])
    assert code == 0, stderr
    assert_same_weights(run, reference)


def test_a_lost_manifest_is_rebuilt_from_the_checkpoint_record(workspace, reference, tmp_path, caplog):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    shutil.rmtree(run / "folded")
    (run / MANIFEST_NAME).write_text('{"tool": "hf-tap')  # truncated
    code, _, stderr = run_main([*killable_argv(workspace, run), "--resume"])
    assert code == 0, stderr
    assert "rebuilding the lost manifest" in caplog.text
    assert_same_weights(run, reference)
    (run / MANIFEST_NAME).unlink()
    (run / "mine.txt").write_text("user file")
    message = error_of([*killable_argv(workspace, run), "--resume"])
    assert "holds files this command did not write (mine.txt)" in message
    for checkpoint in run.glob("checkpoint-*"):
        (checkpoint / "tapernorm_run.json").unlink()
    (run / MANIFEST_NAME).unlink(missing_ok=True)
    message = error_of([*killable_argv(workspace, run), "--resume"])
    assert "is missing or unreadable and no checkpoint" in message or "incomplete" in message, message


def test_resume_refuses_a_checkpoint_without_its_optimizer_state(workspace, reference, tmp_path):
    for name, expected in (
        ("optimizer.pt", "has no optimizer.pt, which holds the optimizer's moments"),
        ("scheduler.pt", "has no scheduler.pt"),
        ("rng_state.pth", "has no rng_state.pth"),
        ("model.safetensors", "has no model.safetensors"),
    ):
        run = tmp_path / name
        shutil.copytree(reference, run)
        (run / "checkpoint-10" / name).unlink()
        before = snapshot(run)
        message = error_of([*killable_argv(workspace, run), "--resume"])
        assert message.startswith(f"hf-tapernorm taper: error: --resume: {run / 'checkpoint-10'} {expected}"), message
        assert message.endswith("restore it from a copy, or start over with --overwrite")
        assert snapshot(run) == before
    run = tmp_path / "truncated"
    shutil.copytree(reference, run)
    weights = run / "checkpoint-10" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    assert "cannot read" in error_of([*killable_argv(workspace, run), "--resume"])


# ============================================================================= 3. signals and kills
def test_sigterm_saves_a_checkpoint_and_resume_is_bit_identical(workspace, reference, tmp_path):
    out = tmp_path / "run"
    code, output = signal_at_step(killable_argv(workspace, out), ENV, step=4, signum=signal.SIGTERM)
    assert code == 143, output
    assert "SIGTERM: stopping after this step with a checkpoint" in output
    checkpoints = sorted(out.glob("checkpoint-*"), key=lambda c: int(c.name.split("-")[1]))
    assert [c.name for c in checkpoints] == ["checkpoint-3", "checkpoint-4"]  # every 3 steps, and the signal's
    assert not (out / LOCK_NAME).exists()
    code, _, stderr = run_main([*killable_argv(workspace, out), "--resume"])
    assert code == 0, stderr
    assert_same_weights(out, reference)


KILLER = textwrap.dedent(
    """
    import os, signal, sys
    import hf_tapernorm.app.taper as taper
    import hf_tapernorm.app.training_run as training_run
    from transformers import Trainer
    POINT = sys.argv[1]

    def kill():
        os.kill(os.getpid(), signal.SIGKILL)

    def after(owner, name, when=lambda *a, **k: True):
        original = getattr(owner, name)
        def wrapped(*args, **kwargs):
            result = original(*args, **kwargs)
            if when(*args, **kwargs):
                kill()
            return result
        setattr(owner, name, wrapped)

    if POINT == "after_checkpoint":  # the step-6 checkpoint is whole and recorded
        after(training_run.RecordCallback, "on_save", lambda self, args, state, *a, **k: state.global_step == 6)
    elif POINT == "checkpoint_write":  # the step-6 checkpoint has weights and optimizer, no RNG state yet
        after(Trainer, "_save_optimizer_and_scheduler", lambda self, *a, **k: self.state.global_step == 6)
    elif POINT == "evaluation":
        after(taper, "evaluate_set", lambda models, evaluation, **k: evaluation.name == "held-out")
    elif POINT == "export":  # the export is written into its temporary folder, not renamed yet
        after(taper, "save_export")
    elif POINT == "report":
        after(taper, "write_report", lambda output_dir, record: record.status == "finished")
    from hf_tapernorm.cli import main
    sys.exit(main(sys.argv[2:]))
    """
)


@pytest.mark.parametrize("point", ["after_checkpoint", "checkpoint_write", "evaluation", "export", "report"])
def test_sigkill_at_any_point_then_resume_is_bit_identical(workspace, reference, tmp_path, point, caplog):
    out = tmp_path / "run"
    script = tmp_path / "killer.py"
    script.write_text(KILLER)
    done = subprocess.run(
        [sys.executable, str(script), point, *killable_argv(workspace, out)], cwd=REPO, env=ENV, capture_output=True
    )
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    assert (out / LOCK_NAME).exists()  # the killed process could not release it
    if point == "export":
        assert list(out.glob(".folded.partial-*"))
    code, _, stderr = run_main([*killable_argv(workspace, out), "--resume"])
    assert code == 0, stderr
    assert "taking over the lock" in caplog.text
    assert not list(out.glob(".*.partial-*")) and not (out / LOCK_NAME).exists()
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "finished" and [r["step"] for r in report["history"]] == list(range(1, 11))
    assert_same_weights(out, reference)


# ============================================================================= 4. refused before the model loads
@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--adam_beta2", "2"], "with these options: ValueError: Invalid beta parameter at index 1: 2.0"),
        (["--learning_rate", "nan"], "--learning_rate must be a finite number, got nan"),
        (["--learning_rate", "-1"], "ValueError: Invalid learning rate: -1.0"),
        (["--max_grad_norm", "inf"], "--max_grad_norm must be a finite number, got inf (0 turns clipping off)"),
        # a reporter whose package is absent (wandb comes with the interpretability extra's TransformerLens)
        (["--report_to", "clearml"], "--report_to ['clearml']: RuntimeError: ClearMLCallback requires 'clearml'"),
        (["--optim", "adamw_bnb_8bit"], "--optim adamw_bnb_8bit with these options:"),
        (["--eval_strategy", "steps"], "--eval_strategy steps: taper gives the Trainer no evaluation set"),
        (["--push_to_hub"], "--push_to_hub would upload the run folder from inside training"),
        (["--gradient_accumulation_steps", "0"], "--gradient_accumulation_steps must be a positive integer, got 0"),
        (["--per_device_train_batch_size", "0"], "--per_device_train_batch_size must be a positive integer, got 0"),
        (["--calibration_scale", "inf"], "calibration_scale"),
        (["--scale_loss_weight", "inf"], "scale_loss_weight"),
        (["--distill_weight", "inf"], "distill_weight"),
        (
            ["--resume_from_checkpoint", "x"],
            "--resume_from_checkpoint is the Trainer's flag and taper does not read it",
        ),
        (["--label_smoothing_factor", "0.1"], "--label_smoothing_factor 0.1: the Trainer would compute its own loss"),
        (["--seed", "-1"], "--seed must be in [0, 2**32 - 1], got -1"),  # was NumPy's traceback, after the load
        (["--max_grad_norm", "-1"], "--max_grad_norm must be >= 0, got -1.0"),  # was clipping silently off
        (["--weight_decay", "-1"], "--weight_decay must be >= 0, got -1.0"),  # was accepted: weights pushed to grow
        (["--lr_scheduler_kwargs", '{"num_decay_steps": 500}'], "more than --max_steps 10"),
        (["--warmup_steps", "5"], "--warmup_steps 5.0 is 5 steps, past the taper's start (step 2)"),
        (
            ["--per_device_train_batch_size", "5000", "--max_steps", "2", "--taper_start", "1", "--taper_end", "2"],
            "fewer than one batch (5000: --per_device_train_batch_size x processes): training would run 0 steps",
        ),
    ],
)
def test_trainer_options_are_refused_before_the_model_loads(workspace, tmp_path, monkeypatch, flags, expected):
    import hf_tapernorm.app.taper as taper_pipeline

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(taper_pipeline, "load_model", no_load)
    out = tmp_path / "run"
    message = error_of([*taper_argv(workspace, out), *flags])
    assert message.startswith("hf-tapernorm taper: error: ") and expected in message, message
    assert "inf" in message or expected not in ("calibration_scale", "scale_loss_weight", "distill_weight"), message
    assert not out.exists()


# ============================================================================= 4. mixed precision is contained
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


# ============================================================================= 4. models that are not what they say
def test_models_that_are_not_what_their_config_says_are_refused(workspace, tmp_path):
    from safetensors.torch import save_file
    from transformers import T5Config, T5ForConditionalGeneration

    three_layers = tmp_path / "three_layers"
    shutil.copytree(workspace / "llama", three_layers)
    config = json.loads((three_layers / "config.json").read_text())
    (three_layers / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    argv = taper_argv(workspace, tmp_path / "o1")
    argv[argv.index("--model_name_or_path") + 1] = str(three_layers)
    message = error_of(argv)
    assert message.startswith(
        f"hf-tapernorm taper: error: model '{three_layers}' lacks 9 weight(s) its config declares"
    )
    assert "model.layers.2." in message and not (tmp_path / "o1").exists()

    poisoned = tmp_path / "poisoned"
    shutil.copytree(workspace / "llama", poisoned)
    state = load_file(poisoned / "model.safetensors")
    state["model.layers.1.mlp.up_proj.weight"][0, 0] = float("nan")
    save_file(state, poisoned / "model.safetensors", metadata={"format": "pt"})
    evaluate = ["eval", "--dataset_name", str(workspace / "corpus.txt"), "--block_size", "32", "--heldout_blocks", "2"]
    message = error_of([*evaluate, "--model_name_or_path", str(poisoned)])
    assert "non-finite values (NaN or inf) in model.layers.1.mlp.up_proj.weight" in message

    listed = tmp_path / "listed"
    shutil.copytree(workspace / "llama", listed)
    (listed / "config.json").write_text("[1, 2]")
    assert error_of([*evaluate, "--model_name_or_path", str(listed)]).endswith("holds a JSON list, not a model config")

    t5 = tmp_path / "t5"
    T5ForConditionalGeneration(
        T5Config(vocab_size=128, d_model=16, d_ff=32, num_layers=1, num_heads=2)
    ).save_pretrained(t5)
    char_tokenizer().save_pretrained(t5)
    argv = taper_argv(workspace, tmp_path / "o2")
    argv[argv.index("--model_name_or_path") + 1] = str(t5)
    assert "is a t5 model without a causal-LM class" in error_of(argv)

    assert error_of([*evaluate, "--model_name_or_path", str(workspace / "llama"), "--block_size", "100"]).endswith(
        "--block_size 100 exceeds the model's 64 positions"
    )
    options = tmp_path / "options.json"
    options.write_text("[1, 2]")
    assert error_of(["taper", str(options)]).endswith("an options file holds one object of option names and values")


# ============================================================================= 4. a resumed run is the same run
def test_resume_checks_the_data_contents_and_every_option_that_shapes_the_result(workspace, reference, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    corpus = tmp_path / "corpus.txt"
    shutil.copy(workspace / "corpus.txt", corpus)
    argv = killable_argv(workspace, run)
    argv[argv.index("--dataset_name") + 1] = str(corpus)
    (run / MANIFEST_NAME).write_text(  # the run as if it had read this copy (same bytes, another path)
        (run / MANIFEST_NAME).read_text().replace(str(workspace / "corpus.txt"), str(corpus))
    )
    corpus.write_text(corpus.read_text() + "\n\nanother document at the end")
    before = snapshot(run)
    message = error_of([*argv, "--resume"])
    assert "data.contents.corpus.txt: '" in message and "--allow_changes" in message, message
    shutil.copy(workspace / "corpus.txt", corpus)
    message = error_of([*argv, "--resume", "--adam_beta2", "0.9"])
    assert "training.adam_beta2: 0.95 in the run, 0.9 now" in message
    assert snapshot(run) == before
    code, _, stderr = run_main([*argv, "--resume", "--save_steps", "5", "--logging_steps", "2"])  # bookkeeping only
    assert code == 0, stderr
    message = error_of([*argv, "--resume", "--adam_beta2", "0.9", "--allow_changes", "adam_beta2"])
    assert "a resumed Trainer restores training.adam_beta2 from the checkpoint's optimizer" in message
    assert json.loads((run / MANIFEST_NAME).read_text())["identity"]["training"]["adam_beta2"] == 0.95
    code, _, stderr = run_main([*argv, "--resume", "--max_grad_norm", "0.5", "--allow_changes", "max_grad_norm"])
    assert code == 0, stderr
    report = json.loads((run / "report.json").read_text())
    assert report["allowed_changes"]["training.max_grad_norm"] == {"run": 1.0, "now": 0.5}


def test_sigterm_outside_training_unwinds_the_command(monkeypatch):
    cli = importlib.import_module("hf_tapernorm.cli.main")  # the package exports main(), which hides the module

    def busy(argv):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
        return 0

    original = signal.getsignal(signal.SIGTERM)
    monkeypatch.setitem(cli.COMMANDS, "fold", (busy, "stand-in"))
    code, _, stderr = run_main(["fold"])
    assert code == 143 and stderr.strip().endswith("hf-tapernorm fold: terminated")
    assert signal.getsignal(signal.SIGTERM) is original


def test_a_sharded_teacher_planted_in_a_trainer_checkpoint_is_not_unpickled(tmp_path):
    from hf_tapernorm import TaperController

    model = patch_model(build(tiny_llama_config()), TaperNormConfig.paper().replace(distill_weight=0.5))
    controller = TaperController(model, total_steps=20)
    assert controller.distillation is not None
    marker = tmp_path / "PAYLOAD_RAN"
    (tmp_path / "checkpoint-4" / "distillation_teacher").mkdir(parents=True)
    (tmp_path / "checkpoint-4" / "distillation_teacher" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(TaperStateError, match="distillation_teacher' is a sharded .*--trust_sharded_checkpoint"):
        controller.load_state(tmp_path / "checkpoint-4")  # what TaperCallback calls on a Trainer resume
    assert not marker.exists()


def test_a_run_killed_during_its_export_can_be_overwritten(workspace, reference, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    shutil.move(run / "folded", run / ".folded.partial-99999")  # what a kill before the rename leaves
    (run / LOCK_NAME).write_text(json.dumps({"pid": 2**22 + 12345, "host": os.uname().nodename}))  # no such process
    code, _, stderr = run_main([*killable_argv(workspace, run), "--overwrite"])
    assert code == 0, stderr
    assert not list(run.glob(".*.partial-*")) and not (run / LOCK_NAME).exists()
    assert_same_weights(run, reference)


# ============================================================================= 5. cases of the re-probe
def test_a_file_put_into_the_run_folder_while_it_runs_stays_the_users(workspace, tmp_path, monkeypatch):
    """The manifest once adopted every file present at the end: a later --overwrite deleted the user's notes."""
    import hf_tapernorm.app.taper as taper_pipeline

    out = tmp_path / "run"
    original = taper_pipeline.save_export

    def with_a_user_file(*args, **kwargs):
        (out / "notes.txt").write_text("my notes, written while the run trained")
        return original(*args, **kwargs)

    monkeypatch.setattr(taper_pipeline, "save_export", with_a_user_file)
    argv = taper_argv(workspace, out, "--distill_weight", "0", "--out_of_corpus_blocks", "0", steps=6)
    code, _, stderr = run_main(argv)
    assert code == 0, stderr
    manifest = json.loads((out / MANIFEST_NAME).read_text())["files"]
    assert "notes.txt" not in manifest and "folded/model.safetensors" in manifest and "report.json" in manifest
    monkeypatch.setattr(taper_pipeline, "save_export", original)
    message = error_of([*argv, "--overwrite"])
    assert message == (
        f"hf-tapernorm taper: error: refusing to --overwrite '{out}': it holds files hf-tapernorm did not write "
        "(notes.txt); move them away first"
    )
    assert (out / "notes.txt").read_text() == "my notes, written while the run trained"


def test_bench_never_writes_over_result_files_it_did_not_write(tmp_path):
    from hf_tapernorm.bench.arguments import parse_arguments

    (tmp_path / "bench.json").write_text('{"mine": 1}')
    (tmp_path / "bench.png").write_text("my picture")
    with pytest.raises(ConfigurationError, match=r"holds bench.json, bench.png that no earlier hf-tapernorm bench"):
        parse_arguments(["--output_dir", str(tmp_path)])
    (tmp_path / "bench.json").unlink()
    with pytest.raises(ConfigurationError, match=r"holds bench.png that no earlier"):
        parse_arguments(["--output_dir", str(tmp_path)])
    earlier = {"settings": {}, "results": [], "environment": {}}
    (tmp_path / "bench.json").write_text(json.dumps(earlier))  # an earlier benchmark's pair is replaced
    assert parse_arguments(["--output_dir", str(tmp_path)]).output_dir == str(tmp_path)
    assert (tmp_path / "bench.png").read_text() == "my picture" and json.loads((tmp_path / "bench.json").read_text())


def test_resume_refuses_other_weights_of_the_same_size(workspace, reference, tmp_path):
    """The weights were identified by their size: a fine-tune saved over the base model resumed silently, with
    the report's original-model figures (and a distillation teacher) of other weights."""
    run, model = tmp_path / "run", tmp_path / "model"
    shutil.copytree(reference, run)
    shutil.copytree(workspace / "llama", model)
    argv = killable_argv(workspace, run)
    argv[argv.index("--model_name_or_path") + 1] = str(model)
    for path in (run / MANIFEST_NAME, *run.glob("checkpoint-*/tapernorm_run.json")):
        path.write_text(path.read_text().replace(str(workspace / "llama"), str(model)))  # as if it had read the copy
    size = (model / "model.safetensors").stat().st_size
    build(tiny_llama_config(), seed=7).save_pretrained(model)  # other weights, the same size
    assert (model / "model.safetensors").stat().st_size == size
    before = snapshot(run)
    message = error_of([*argv, "--resume"])
    assert "model_contents.model.safetensors: " in message and "--allow_changes" in message, message
    assert snapshot(run) == before


def test_a_legacy_weight_fingerprint_still_resumes():
    from hf_tapernorm.app.validation import _with_legacy_fingerprints

    saved = {"model_contents": {"model.safetensors": "100 bytes", "config.json": "abc"}}
    now = {"model_contents": {"model.safetensors": "100 bytes, sampled sha256 ff", "config.json": "abc"}}
    assert _with_legacy_fingerprints(saved, now)["model_contents"] == saved["model_contents"]
    other = {"model_contents": {"model.safetensors": "101 bytes, sampled sha256 ff", "config.json": "abc"}}
    assert _with_legacy_fingerprints(saved, other) == other


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "tapernorm_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_a_tapered_checkpoint_whose_config_or_weights_were_edited_is_refused(tmp_path):
    from safetensors.torch import save_file

    saved = tapered_checkpoint(tmp_path / "saved")
    assert load_tapered(saved) is not None
    kept = tmp_path / "kept"  # a trained (tapered, g = 0) norm declared kept: evaluated as a real norm, silently
    shutil.copytree(saved, kept)
    _edit_config(kept, keep_norms=["model.layers.0.input_layernorm"])
    with pytest.raises(TaperStateError, match=r"model.layers.0.input_layernorm is kept as a norm by its tapernorm_"):
        load_tapered(kept)
    gates = tmp_path / "gates"
    shutil.copytree(saved, gates)
    state = load_file(str(gates / "model.safetensors"))
    state["model.layers.1.input_layernorm.gate"].fill_(0.5)
    save_file(state, str(gates / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(TaperStateError, match=r"tapered norms were saved at different gates \(0, 0.5\)"):
        load_tapered(gates)
    damaged = tmp_path / "nan"  # was folded, then "the fold check failed: pass a larger tolerance"
    shutil.copytree(saved, damaged)
    state = load_file(str(damaged / "model.safetensors"))
    state["model.layers.0.mlp.up_proj.weight"][0, 0] = float("nan")
    save_file(state, str(damaged / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(TaperStateError, match=r"non-finite values \(NaN or inf\) in model.layers.0.mlp.up_proj"):
        load_tapered(damaged)
    sink = tmp_path / "sink"  # was an IndexError traceback from the embedding
    shutil.copytree(saved, sink)
    _edit_config(sink, sink_token_ids=[100000])
    with pytest.raises(ConfigurationError, match=r"sink_token_ids \[100000\] are not token ids of LlamaForCausalLM"):
        load_tapered(sink)
    listed = tmp_path / "listed"  # was a ValueError traceback from dict()
    shutil.copytree(saved, listed)
    (listed / "tapernorm_config.json").write_text("[1, 2]")
    with pytest.raises(ConfigurationError, match=r"holds a JSON list, not a TaperNormConfig"):
        load_tapered(listed)
    message = error_of(["fold", "--checkpoint", str(kept), "--output_dir", str(tmp_path / "export")])
    assert message.startswith(f"hf-tapernorm fold: error: tapered checkpoint '{kept}': model.layers.0.input_layernorm")
    assert not (tmp_path / "export").exists()


@pytest.mark.parametrize(
    "values, expected",
    [
        ({"relative_scale_loss": "no"}, "relative_scale_loss must be true or false, got 'no'"),  # was True
        ({"sink_token_ids": [1.7]}, "sink_token_ids must be integer token ids, got [1.7]"),  # was cut to 1
        ({"ema_rate": "0.5"}, "ema_rate must be a number, got '0.5'"),  # the next three were TypeErrors
        ({"calibration_scale": None}, "calibration_scale must be a number, got None"),
        ({"scale_loss_weight": [1]}, "scale_loss_weight must be a number, got [1]"),
        ({"keep_norms": [1, 2]}, "keep_norms must be a list of fnmatch patterns (strings), got [1, 2]"),
        ({"recipe": 3}, "recipe must be a string, got 3"),
    ],
)
def test_a_tapernorm_config_of_the_wrong_types_is_refused(tmp_path, values, expected):
    (tmp_path / "tapernorm_config.json").write_text(json.dumps(values))
    with pytest.raises(ConfigurationError) as caught:
        TaperNormConfig.from_pretrained(tmp_path)
    assert str(caught.value) == f"TaperNormConfig.{expected}"


def test_an_unreadable_tapernorm_config_is_one_configuration_error(tmp_path):
    import numpy as np

    (tmp_path / "tapernorm_config.json").write_bytes(b"\xff\xfe not utf-8")
    with pytest.raises(ConfigurationError, match="is not valid JSON: 'utf-8' codec can't decode"):
        TaperNormConfig.from_pretrained(tmp_path)
    (tmp_path / "tapernorm_config.json").write_text("null")
    with pytest.raises(
        ConfigurationError, match="from_dict expects a mapping of field names to values, got a NoneType"
    ):
        TaperNormConfig.from_pretrained(tmp_path)
    assert TaperNormConfig(sink_token_ids=[np.int64(5), torch.tensor(6), "7"]).sink_token_ids == [5, 6, 7]


def test_corpus_that_is_not_utf8_or_one_long_line_is_explained(workspace, tmp_path, monkeypatch):
    import hf_tapernorm.app.taper as taper_pipeline

    monkeypatch.setattr(taper_pipeline, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes(("caf\xe9 na\xefve r\xe9sum\xe9 " * 200).encode("latin-1"))
    argv = taper_argv(workspace, tmp_path / "run", "--data_cache_dir", str(tmp_path / "cache"))
    argv[argv.index("--dataset_name") + 1] = str(latin1)
    message = error_of(argv)  # was "DatasetGenerationError: An error occurred while generating the dataset"
    assert message.startswith(f"hf-tapernorm taper: error: dataset '{latin1}' is not UTF-8 text (invalid continu")
    assert message.endswith("convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8), or pass a text file")
    one_line = tmp_path / "one_line.txt"
    one_line.write_text(" ".join(["the quick brown fox"] * 3000))
    argv[argv.index("--dataset_name") + 1] = str(one_line)
    message = error_of(argv)  # was only "too small", of a file of 12,000 words
    assert (
        "held-out split (10% of documents held out) does not fill one block of 32 tokens; it holds only 1 " in message
    )
    assert message.endswith("split the text into more (blank lines between paragraphs, or --sample_by line)")
    assert not (tmp_path / "run").exists()


def test_a_mistyped_model_path_is_named_as_such(workspace, tmp_path):
    message = error_of(["fold", "--checkpoint", "no_such/folder", "--output_dir", str(tmp_path / "export")])
    assert (
        message == "hf-tapernorm fold: error: --checkpoint 'no_such/folder': no such folder; fold reads a local "
        "tapered checkpoint"
    )
    status, _, stderr = run_main(["eval", "--model_name_or_path", "no_such/folder", "--dataset_name", "x.txt"])
    lines = stderr.strip().splitlines()
    assert status == 2 and len(lines) == 1, stderr  # transformers' message runs over two lines
    assert "'no_such/folder' (no local folder of that name, so it was taken as a Hub id: check the path" in lines[0]


def test_an_export_killed_by_sigkill_leaves_no_partial_copy_for_ever(tmp_path):
    from hf_tapernorm.app.run_folder import write_folder

    dead, alive = 2**22 + 54321, os.getppid()  # no such process; this test's parent
    for name in (f".export.partial-{dead}", f".export.old-{dead}", f".export.partial-{alive}", ".other.partial-1"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_text("a killed write's copy")
    write_folder(tmp_path / "export", lambda tmp: (tmp.mkdir(), (tmp / "config.json").write_text("{}")))
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == [".export.partial-" + str(alive), ".other.partial-1", "export"], left


@pytest.mark.parametrize("tolerance", [-1.0, float("nan"), float("inf"), "1e-4"])
def test_fold_model_refuses_a_tolerance_that_is_no_positive_number(tmp_path, tolerance):
    """-1 and NaN were reported as a failed fold check ("pass a larger tolerance"); inf passed any fold."""
    from hf_tapernorm import fold_model

    model = load_tapered(tapered_checkpoint(tmp_path / "saved"))
    with pytest.raises(ConfigurationError, match=r"^fold_model: tolerance must be a positive finite number, got "):
        fold_model(model, tolerance=tolerance)


def test_a_run_the_disk_cannot_hold_is_refused_before_the_model_loads(workspace, tmp_path, monkeypatch):
    import hf_tapernorm.app.preflight as preflight
    import hf_tapernorm.app.taper as taper_pipeline

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(taper_pipeline, "load_model", no_load)
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda path: SimpleNamespace(free=1000))
    out = tmp_path / "run"
    message = error_of(taper_argv(workspace, out, "--baseline"))
    assert "--output_dir" in message and "its disk has 0.00 GB free, and this run writes at least" in message
    assert "the baseline run" in message and "another disk" in message, message
    assert not out.exists()


def test_the_disk_check_counts_every_copy_the_run_writes(workspace):
    from hf_tapernorm.app.preflight import check_disk_space

    model = build(tiny_llama_config())
    weights = sum(p.numel() for p in model.parameters())
    adam, sgd = SimpleNamespace(optim="adamw_torch"), SimpleNamespace(optim="sgd")
    distilled, plain = TaperNormConfig.paper(), TaperNormConfig.paper()
    distilled.distill_weight, plain.distill_weight = 1.0, 0.0
    here = Path(workspace)

    def needed(args, config, **kw) -> int:
        return check_disk_space(here / "not_yet" / "run", model, args, config, **kw)

    # checkpoint (weights, 2 Adam moments, the teacher) + tapered + folded; the baseline adds 1 + 2 + its model.
    assert needed(adam, distilled, dtype="float32", baseline=True) == weights * 4 * (4 + 2 + 4)
    assert needed(adam, plain, dtype="float32", baseline=False) == weights * 4 * (3 + 2)
    assert needed(sgd, plain, dtype="bfloat16", baseline=False) == weights * 2 * (1 + 2)
    assert needed(adam, plain, dtype=None, baseline=False) == weights * 4 * (3 + 2)  # the model's own dtype: fp32


def test_overwrite_counts_the_old_run_as_free_space(reference, tmp_path):
    folder = tmp_path / "old"
    shutil.copytree(reference, folder)
    run = RunFolder(folder)
    reclaimable = run.reclaimable_bytes()

    def total() -> int:
        return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())

    listed = set(run.files())  # the run's files; the bookkeeping files (manifest, record) are not counted
    bookkeeping = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and
                      p.relative_to(folder).as_posix() not in listed)  # fmt: skip
    before = total()
    assert reclaimable == before - bookkeeping > 0
    run.empty()
    assert before - total() >= reclaimable  # empty() frees at least what the disk check counted
