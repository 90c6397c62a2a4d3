"""Run and export folders: one command at a time in a folder (and a stale lock said to be stale), nothing deleted or
written over that the command did not write (the manifest is no list of paths, symbolic links are refused), no
partial copy left by a kill, the disk a run needs counted before it trains, and a resume refused early when its
checkpoint lost a file or its name.

Each case checks the exit code, the first line of the error, and the files on disk.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import AutoModelForCausalLM

from hf_tapernorm import TaperNormConfig
from hf_tapernorm.app.run_folder import LOCK_NAME, MANIFEST_NAME, RunFolder, RunFolderError
from hf_tapernorm.app.run_lock import process_start_time
from hf_tapernorm.export.hub import files_to_push
from hf_tapernorm.training.checkpoints import tapered_config_of
from tests.conftest import build, save_tiny_model, tiny_llama_config
from tests.helpers import error_of, run_main, snapshot, taper_argv, tapered_checkpoint


@pytest.fixture(scope="module")
def run(workspace, tmp_path_factory) -> Path:
    """A finished 10-step run with distillation (the default recipe) and checkpoints every 3 steps, the last two
    kept (checkpoint-9, checkpoint-10): the cases edit copies of it."""
    out = tmp_path_factory.mktemp("run_folders") / "run"
    code, _, stderr = run_main(run_argv(workspace, out))
    assert code == 0, stderr
    assert (out / "checkpoint-10" / "distillation_teacher.safetensors").is_file()
    return out


@pytest.fixture(scope="module")
def reference(run) -> Path:
    """The finished run, as the cases that only read its tapered checkpoint or count its files call it."""
    return run


def run_argv(workspace: Path, out: Path, *extra: str) -> list[str]:
    return taper_argv(workspace, out, "--save_steps", "3", "--save_total_limit", "2", *extra, steps=10)


def fold_argv(checkpoint: Path, out: Path, *extra: str) -> list[str]:
    return ["fold", "--checkpoint", str(checkpoint), "--output_dir", str(out), "--scan_windows", "0", *extra]


def copy_of(run: Path, tmp_path: Path) -> Path:
    shutil.copytree(run, tmp_path / "run", symlinks=True)
    return tmp_path / "run"


def no_loading(monkeypatch, *names: str) -> None:
    """Make the taper pipeline fail if it loads the model or its data (and ``names``): the refusal must come
    before."""
    import hf_tapernorm.app.taper as taper_pipeline

    def refuse(*args, **kwargs):
        raise AssertionError("loaded the model or the data before refusing")

    for name in ("load_model", "prepare_run_data", *names):
        monkeypatch.setattr(taper_pipeline, name, refuse)


def write_lock(folder: Path, **owner) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / LOCK_NAME).write_text(json.dumps(owner))
    return folder / LOCK_NAME


# ============================================================================= one command at a time
def test_two_folds_into_one_folder_at_once_the_second_is_refused(run, tmp_path, monkeypatch):
    """Both passed the folder's checks, then both wrote it: each reported success and one export replaced the
    other. fold now holds the folder's lock from its checks to its last write."""
    import hf_tapernorm.cli.commands as commands

    out = tmp_path / "export"
    out.mkdir()  # an empty folder both were pointed at
    second: list = []
    fold_model = commands.fold_model

    def fold_while_another_runs(*args, **kwargs):
        if not second:  # the first fold has checked the folder and is now folding: a second one starts
            second.append(None)
            second[0] = run_main(fold_argv(run / "tapered", out))
        return fold_model(*args, **kwargs)

    monkeypatch.setattr(commands, "fold_model", fold_while_another_runs)
    code, _, stderr = run_main(fold_argv(run / "tapered", out))
    assert code == 0, stderr
    status, _, err = second[0]
    assert status == 2, err
    line = [line for line in err.splitlines() if line.startswith("hf-tapernorm")][-1]
    assert line.startswith(
        f"hf-tapernorm fold: error: output folder '{out}' is in use: a running hf-tapernorm command owns it (pid "
        f"{os.getpid()} on host {socket.gethostname()}"
    ), line
    assert line.endswith("wait for it to finish, or choose a folder outside it")
    assert (out / "model.safetensors").is_file() and not (out / LOCK_NAME).exists()
    assert not list(tmp_path.glob(".export.*"))  # no partial copy of the refused fold


def test_a_fold_refused_under_its_lock_leaves_no_folder_and_no_lock(run, tmp_path, monkeypatch):
    import hf_tapernorm.cli.commands as commands

    def fail(*args, **kwargs):
        raise commands.UsageError("the fold check failed")

    monkeypatch.setattr(commands, "fold_model", fail)
    out = tmp_path / "new" / "export"
    assert error_of(fold_argv(run / "tapered", out)) == "hf-tapernorm fold: error: the fold check failed"
    assert not out.exists()


def test_a_lock_of_another_host_says_how_to_tell_it_is_stale_and_which_file_to_delete(workspace, run, tmp_path):
    """A run killed in a container or pod that restarted under another hostname, or a copied folder: its lock
    was refused for ever with 'wait for it to finish'."""
    out = tmp_path / "out"
    lock = write_lock(out, pid=4242, host="pod-7f9c", started=123, since="2026-01-02 03:04:05 UTC")
    stale = (
        "pid 4242 on host pod-7f9c since 2026-01-02 03:04:05 UTC; if no hf-tapernorm command runs as pid 4242 on "
        f"pod-7f9c (it was killed, its container or pod restarted, or the folder was copied), the lock is stale: "
        f"delete {lock}"
    )
    message = error_of(taper_argv(workspace, out, steps=5))
    assert message == (
        f"hf-tapernorm taper: error: output folder '{out}' is in use by another hf-tapernorm command ({stale}); "
        "wait for it to finish, or choose another --output_dir"
    )
    message = error_of(fold_argv(run / "tapered", out))
    assert message.startswith(f"hf-tapernorm fold: error: output folder '{out}' is in use: a running hf-tapernorm")
    assert f"({stale})" in message
    lock.write_text("{not a record")  # no hf-tapernorm command wrote this
    message = error_of(taper_argv(workspace, out, steps=5))
    assert f"its lock {lock} is unreadable; if no hf-tapernorm command is using the folder, the lock is stale: " in (
        message
    )
    assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]  # nothing written, the lock left as it was
    lock.unlink()  # what the message says to do
    assert run_main(fold_argv(run / "tapered", out))[0] == 0
    shutil.rmtree(out)
    write_lock(out).write_text("")  # killed between creating the lock and writing it: no one holds it, it is free
    assert run_main(fold_argv(run / "tapered", out))[0] == 0 and not (out / LOCK_NAME).exists()


def test_a_lock_whose_pid_now_names_another_process_is_taken_over(run, tmp_path, caplog):
    """A pid is reused: by any process on a busy host, and by the first processes of a restarted container (often
    the very pid of the command that was killed). The lock records its process's start time, so a live pid that
    started at another time is not the lock's owner."""
    here = socket.gethostname()
    alive = os.getppid()
    out = tmp_path / "export"
    write_lock(out, pid=alive, host=here, started=process_start_time(alive) + 1)
    code, _, stderr = run_main(fold_argv(run / "tapered", out))
    assert code == 0, stderr
    assert f"pid {alive} now belongs to another process" in caplog.text
    assert (out / "model.safetensors").is_file() and not (out / LOCK_NAME).exists()
    folder = tmp_path / "restarted"
    write_lock(folder, pid=os.getpid(), host=here, started=process_start_time(os.getpid()) - 1)  # this very pid
    lock = RunFolder(folder).lock()
    assert json.loads((folder / LOCK_NAME).read_text())["started"] == process_start_time(os.getpid())
    lock.release()
    write_lock(folder, pid=alive, host=here, started=process_start_time(alive))  # its owner, alive
    with pytest.raises(RunFolderError, match="is in use by another hf-tapernorm command"):
        RunFolder(folder).lock()


# ============================================================================= the disk a run writes
def test_an_fp32_run_the_disk_cannot_hold_is_refused_before_the_model_loads(workspace, tmp_path, monkeypatch):
    """The check counted 2 bytes per weight when --dtype was left out: an fp32 model (SmolLM2 with 2 GB free)
    passed, trained, and died writing its final checkpoint (weights, optimizer, teacher)."""
    import hf_tapernorm.app.preflight as preflight

    model = tmp_path / "fp32"
    save_tiny_model(model)
    weights = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model).parameters())
    # fp32: the final checkpoint's weights, two Adam moments and the teacher, then the tapered and folded copies
    needed = weights * 4 * (1 + 2 + 1 + 1 + 1)
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda path: SimpleNamespace(free=needed - 1))
    no_loading(monkeypatch)
    out = tmp_path / "run"
    argv = taper_argv(workspace, out, steps=5)
    argv[argv.index("--model_name_or_path") + 1] = str(model)
    message = error_of(argv)
    assert message.startswith(f"hf-tapernorm taper: error: --output_dir {out}: its disk has "), message
    gigabytes = f"{weights * 4 / 1e9:.2f} GB"
    assert (
        f"(the final checkpoint's weights {gigabytes}, its optimizer state (two moments per weight) "
        f"{weights * 8 / 1e9:.2f} GB, its distillation teacher {gigabytes}, the tapered checkpoint {gigabytes}, "
        f"the folded export {gigabytes}); free space or choose an --output_dir on another disk"
    ) in message, message
    assert not out.exists()
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda path: SimpleNamespace(free=needed))
    assert "loaded the model or the data" in str(pytest.raises(AssertionError, run_main, argv).value)  # passes


def test_what_the_disk_check_counts_is_what_a_run_writes(workspace, run, tmp_path):
    """run_writes, part by part, against the files of a finished fp32 run: never more, and the same bytes up to
    file headers and the TaperNorm state (the tiny model's weights are few, so those weigh a few percent)."""
    from hf_tapernorm.app.preflight import run_writes

    model = AutoModelForCausalLM.from_pretrained(workspace / "llama")
    config = tapered_config_of(run / "checkpoint-10")
    one_save = _trainer_options(tmp_path, optim="adamw_torch", max_steps=10)  # checkpoint-10 alone: no earlier one
    writes = run_writes(model, one_save, config, dtype=None, baseline=False)
    written = {
        "the final checkpoint's weights": run / "checkpoint-10" / "model.safetensors",
        "its optimizer state (two moments per weight)": run / "checkpoint-10" / "optimizer.pt",
        "its distillation teacher": run / "checkpoint-10" / "distillation_teacher.safetensors",
        "the tapered checkpoint": run / "tapered" / "model.safetensors",
        "the folded export": run / "folded" / "model.safetensors",
    }
    assert writes.keys() == written.keys()
    for what, path in written.items():
        assert 0.85 * path.stat().st_size <= writes[what] <= path.stat().st_size, what
    gone = config.replace(distill_until="taper_end")  # the teacher is released at g = 0
    sgd = _trainer_options(tmp_path, optim="sgd", max_steps=10)
    assert "its distillation teacher" not in run_writes(model, sgd, gone, dtype=None, baseline=False)


# ============================================================================= resume: every file, early
def test_resume_refuses_a_checkpoint_that_lost_its_distillation_teacher(workspace, run, tmp_path, monkeypatch):
    """It resumed with one log warning and distilled from another teacher (another result)."""
    folder = copy_of(run, tmp_path)
    (folder / "checkpoint-10" / "distillation_teacher.safetensors").unlink()
    before = snapshot(folder)
    no_loading(monkeypatch, "load_tokenizer")
    message = error_of([*run_argv(workspace, folder), "--resume"])
    assert message == (
        f"hf-tapernorm taper: error: --resume: {folder / 'checkpoint-10'} has no distillation_teacher.safetensors, "
        "which holds the distillation teacher (the run cannot take it again: its model has trained since); restore "
        "it from a copy, move it out of the run folder to resume from the checkpoint before it, or start over with "
        "--overwrite"
    )
    assert snapshot(folder) == before


def _scale_teacher(checkpoint: Path) -> Path:
    """The checkpoint's distillation teacher with every value times 1.01, saved with its metadata as it was."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = checkpoint / "distillation_teacher.safetensors"
    with safe_open(str(path), framework="pt") as handle:
        tensors, metadata = {k: handle.get_tensor(k) * 1.01 for k in handle.keys()}, handle.metadata()  # noqa: SIM118
    save_file(tensors, str(path), metadata=metadata)
    return path


def test_resume_refuses_a_distillation_teacher_the_run_did_not_write(workspace, run, tmp_path, monkeypatch):
    """A checkpoint's teacher replaced (another run's, or its values scaled by 1.01) resumed without a word and the
    run distilled from it, while a deleted one was refused: the checkpoint's record now keeps the teacher's sha256,
    and a resume refuses one that differs, before loading anything."""
    import hashlib

    folder = copy_of(run, tmp_path)
    record = json.loads((folder / "checkpoint-10" / "tapernorm_run.json").read_text())
    written = (folder / "checkpoint-10" / "distillation_teacher.safetensors").read_bytes()
    assert record["checkpoint_sha256"] == {"distillation_teacher.safetensors": hashlib.sha256(written).hexdigest()}
    teacher = _scale_teacher(folder / "checkpoint-10")
    before = snapshot(folder)
    no_loading(monkeypatch, "load_tokenizer")
    message = error_of([*run_argv(workspace, folder), "--resume"])
    assert message == (
        f"hf-tapernorm taper: error: --resume: {teacher} is not the distillation teacher this run wrote (its sha256 "
        "differs from the one tapernorm_run.json recorded: another run's teacher, or edited), and the run would "
        "distil from it; restore the run's own from a copy, move checkpoint-10 out of the run folder to resume from "
        "the checkpoint before it, or start over with --overwrite"
    )
    assert snapshot(folder) == before


def test_resume_of_a_checkpoint_without_the_teachers_digest_goes_on(workspace, run, tmp_path, monkeypatch, caplog):
    """A checkpoint an older version wrote records no sha256 of its teacher: its resume is not refused (a log line
    says the teacher was not checked)."""
    folder = copy_of(run, tmp_path)
    identity = folder / "checkpoint-10" / "tapernorm_run.json"
    record = json.loads(identity.read_text())
    del record["checkpoint_sha256"]
    identity.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    _scale_teacher(folder / "checkpoint-10")
    no_loading(monkeypatch)
    with caplog.at_level("INFO", logger="hf_tapernorm.app.resume_check"):
        failure = pytest.raises(AssertionError, run_main, [*run_argv(workspace, folder), "--resume"])
    assert "loaded the model or the data" in str(failure.value)  # past every check of the checkpoint
    assert (
        f"{folder / 'checkpoint-10'} records no sha256 of distillation_teacher.safetensors (an older version wrote "
        "it): not checked"
    ) in caplog.messages


def test_resume_refuses_a_truncated_trainer_state_before_loading_anything(workspace, run, tmp_path, monkeypatch):
    folder = copy_of(run, tmp_path)
    state = folder / "checkpoint-10" / "trainer_state.json"
    state.write_text(state.read_text()[:40])
    before = snapshot(folder)
    no_loading(monkeypatch, "load_tokenizer")
    message = error_of([*run_argv(workspace, folder), "--resume"])
    assert message.startswith(f"hf-tapernorm taper: error: --resume: cannot read {state} (JSONDecodeError: ")
    assert message.endswith(
        "truncated or damaged); restore it from a copy, move it out of the run folder to resume from the checkpoint "
        "before it, or start over with --overwrite"
    )
    assert snapshot(folder) == before


def test_resume_refuses_a_renamed_checkpoint_naming_its_step(workspace, run, tmp_path, monkeypatch):
    """checkpoint-10 renamed checkpoint-99 failed after the model and data had loaded, naming a checkpoint-10
    that no longer existed."""
    folder = copy_of(run, tmp_path)
    (folder / "checkpoint-10").rename(folder / "checkpoint-99")
    no_loading(monkeypatch, "load_tokenizer")
    message = error_of([*run_argv(workspace, folder), "--resume"])
    assert message == (
        f"hf-tapernorm taper: error: --resume: {folder / 'checkpoint-99'} holds the state of step 10 "
        "(trainer_state.json: global_step 10), not of step 99 as its name says: it was renamed; rename it back to "
        f"{folder / 'checkpoint-10'}, or start over with --overwrite"
    )


def test_a_checkpoint_record_lists_its_files_but_is_not_part_of_the_run_identity(run):
    from hf_tapernorm.app.training_run import CHECKPOINT_FILES_KEY, IDENTITY_NAME, recorded_identity

    record = json.loads((run / "checkpoint-10" / IDENTITY_NAME).read_text())
    assert set(record[CHECKPOINT_FILES_KEY]) == {
        p.name for p in (run / "checkpoint-10").iterdir() if p.name != IDENTITY_NAME
    }
    manifest = json.loads((run / ".hf_tapernorm_run.json").read_text())
    assert recorded_identity(run) == manifest["identity"]


# ============================================================================= only what the command wrote
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
    # Only its shards' names are an export's: a user's model-notes.txt went with it (as any model-* name did).
    (export / "model-notes.txt").write_text("user file")
    assert "holds files an export does not write (model-notes.txt)" in error_of([*fold, str(export), "--overwrite"])
    (export / "model-notes.txt").unlink()
    assert run_main([*fold, str(export), "--overwrite"])[0] == 0
    link = tmp_path / "link"
    link.symlink_to(export, target_is_directory=True)
    assert "is a symbolic link" in error_of([*fold, str(link), "--overwrite"])


def test_fold_overwrite_refuses_an_export_whose_card_was_edited(workspace, tmp_path):
    """fold --overwrite replaced an export's README.md card that its owner had edited, without a word; now the
    edited card (its sha256 is not the manifest's) is refused in one line and kept, push still uploads it, and once
    it is moved aside the export is replaced."""
    checkpoint = tapered_checkpoint(tmp_path / "tapered")
    export = tmp_path / "export"
    fold = ["fold", "--checkpoint", str(checkpoint), "--output_dir", str(export)]
    assert run_main(fold)[0] == 0
    (export / "README.md").write_text("# my card\n")
    before = snapshot(export)
    assert error_of([*fold, "--overwrite"]) == (
        f"hf-tapernorm fold: error: refusing to --overwrite '{export}': its README.md was edited after the export "
        "wrote it (its sha256 is not the one .hf_tapernorm_export.json recorded), and replacing the export would "
        "lose the edits; move README.md out of the folder to keep it, or delete it to let the export be replaced"
    )
    assert snapshot(export) == before
    assert "README.md" in files_to_push(export)  # push's check of the files takes an edited card
    (export / "README.md").rename(tmp_path / "my_card.md")
    assert run_main([*fold, "--overwrite"])[0] == 0
    assert (export / "README.md").read_text() != "# my card\n"


def test_fold_overwrite_refuses_an_export_whose_generation_config_was_edited(workspace, tmp_path):
    """fold --overwrite replaced a generation_config.json its owner had edited (do_sample, temperature,
    max_new_tokens) with only a WARNING, and push's refusal of the edit advised exactly that fold --overwrite: the
    edit was lost. Now it is refused as an edited card is, in one line naming the file, the export left byte for
    byte; push uploads the edit; once the file is moved aside the export is replaced."""
    checkpoint = tapered_checkpoint(tmp_path / "tapered")
    export = tmp_path / "export"
    fold = ["fold", "--checkpoint", str(checkpoint), "--output_dir", str(export)]
    assert run_main(fold)[0] == 0
    generation = export / "generation_config.json"
    edited = {**json.loads(generation.read_text()), "do_sample": True, "temperature": 0.7, "max_new_tokens": 64}
    generation.write_text(json.dumps(edited))
    before = snapshot(export)
    assert error_of([*fold, "--overwrite"]) == (
        f"hf-tapernorm fold: error: refusing to --overwrite '{export}': its generation_config.json was edited after "
        "the export wrote it (its sha256 is not the one .hf_tapernorm_export.json recorded), and replacing the export "
        "would lose the edits; move generation_config.json out of the folder to keep it, or delete it to let the "
        "export be replaced"
    )
    assert snapshot(export) == before
    assert "generation_config.json" in files_to_push(export)  # push's check of the files takes the edit
    generation.rename(tmp_path / "my_generation_config.json")
    assert run_main([*fold, "--overwrite"])[0] == 0
    assert "do_sample" not in json.loads(generation.read_text())


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


def test_an_export_killed_by_sigkill_leaves_no_partial_copy_for_ever(tmp_path):
    from hf_tapernorm.app.folder_writes import WRITE_MARK
    from hf_tapernorm.app.run_folder import write_folder

    dead, alive = 2**22 + 54321, os.getppid()  # no such process; this test's parent
    for name in (f".export.partial-{dead}", f".export.old-{dead}", f".export.partial-{alive}", ".other.partial-1"):
        (tmp_path / name).mkdir()
        (tmp_path / name / WRITE_MARK).write_text("")  # what write_folder puts into each before anything else
        (tmp_path / name / "model.safetensors").write_text("a killed write's copy")
    write_folder(tmp_path / "export", lambda tmp: (tmp.mkdir(), (tmp / "config.json").write_text("{}")))
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == [".export.partial-" + str(alive), ".other.partial-1", "export"], left


def test_a_killed_export_folded_overwrite_in_a_run_is_no_users_file(workspace, run, tmp_path):
    """export_folded(overwrite=True) of a run's folded/ killed mid-write left ``.folded.export-*`` in the run, and
    the run's --overwrite named it as a user's file, for good; now it is marked and named after its writer's pid
    (_temporaries.py), so --overwrite deletes it once the writer is gone. A live writer's is still refused."""
    from hf_tapernorm._temporaries import WRITE_MARK

    folder = copy_of(run, tmp_path)
    dead, alive = 2**22 + 54321, os.getppid()  # no such process; this test's parent
    for pid in (dead, alive):
        (folder / f".folded.export-{pid}" / "new").mkdir(parents=True)
        (folder / f".folded.export-{pid}" / WRITE_MARK).write_text("")  # what export_folded puts in first
        (folder / f".folded.export-{pid}" / "new" / "config.json").write_text("{}")
    argv = [*run_argv(workspace, folder), "--overwrite"]
    assert f"another write of {folder / 'folded'} is in progress (pid {alive}" in error_of(argv)  # a live write
    assert (folder / f".folded.export-{dead}" / "new" / "config.json").is_file()  # refused: nothing deleted
    shutil.rmtree(folder / f".folded.export-{alive}")
    code, _, stderr = run_main(argv)
    assert code == 0, stderr[-2000:]
    assert not list(folder.glob(".folded.*")) and (folder / "folded" / "model.safetensors").is_file()


@pytest.mark.parametrize("option", ["--overwrite", "--resume"])
@pytest.mark.parametrize("inside", ["folded", ".", "checkpoint-10"])
def test_taper_names_a_live_export_folded_write_in_its_run_folder(
    workspace, run, tmp_path, monkeypatch, option, inside
):
    """A live export_folded's marked ``.hf_tapernorm_writing-PID/`` in RUN/folded/ (or in RUN), then taper
    --overwrite or --resume: it was refused as "files hf-tapernorm did not write ...; move them away first", and
    moving a live write's folder breaks that write. Now the run names the write in progress as fold does
    (write_in_progress), before the folder's files are judged, and nothing is touched: in any folder directly in the
    run, a checkpoint-N too (it was still named a user's file there)."""
    from hf_tapernorm._temporaries import WRITE_MARK, write_in_progress

    folder, alive = copy_of(run, tmp_path), os.getppid()  # this test's parent: a live process
    live = folder / inside / f".hf_tapernorm_writing-{alive}"
    live.mkdir()
    (live / WRITE_MARK).write_text("")
    (live / "model.safetensors").write_bytes(b"half")
    before = snapshot(folder)
    no_loading(monkeypatch)
    words = write_in_progress(live.parent)
    assert words.startswith(f"another write of {live.parent} is in progress (pid {alive}")
    assert error_of([*run_argv(workspace, folder), option]) == (
        f"hf-tapernorm taper: error: output folder '{folder}': {words}; wait for it to finish, or choose another "
        "--output_dir"
    )
    assert snapshot(folder) == before


@pytest.mark.parametrize("option", ["--overwrite", "--resume"])
@pytest.mark.parametrize(("output", "present"), [("folded", False), ("folded", True), ("tapered", True)])
def test_taper_names_a_live_export_folded_write_beside_an_output_folder(
    workspace, run, tmp_path, monkeypatch, option, output, present
):
    """A live export_folded of a new RUN/folded writes through a marked ``.folded.export-PID/`` beside it, in the run
    folder; taper --overwrite or --resume then refused with "it holds files hf-tapernorm did not write
    (.folded.export-N/...); move them away first", and moving a live write's folder breaks it. Now the run names
    that write in progress (write_beside_in_progress), as it names one inside, and nothing is touched."""
    from hf_tapernorm._temporaries import WRITE_MARK, process_command

    folder, alive = copy_of(run, tmp_path), os.getppid()  # this test's parent: a live process
    if not present:
        shutil.rmtree(folder / output)
    live = folder / f".{output}.export-{alive}"
    (live / "new").mkdir(parents=True)
    (live / WRITE_MARK).write_text("")
    (live / "new" / "model.safetensors").write_bytes(b"half")
    before = snapshot(folder)
    no_loading(monkeypatch)
    assert error_of([*run_argv(workspace, folder), option]) == (
        f"hf-tapernorm taper: error: output folder '{folder}': another write of {folder / output} is in progress "
        f"(pid {alive}: {process_command(alive)}, through '{live.name}'; delete '{live}' only if process {alive} is "
        "not writing this export, its pid reused after a restart); wait for it to finish, or choose another "
        "--output_dir"
    )
    assert snapshot(folder) == before


def test_fold_names_a_live_export_folded_writing_its_output_folder_anew(reference, tmp_path, monkeypatch):
    """fold into a folder not there yet, while a live export_folded of it writes through a marked
    ``.NAME.export-PID/`` beside it: fold went ahead, and the other writer's rename into place then failed. The live
    write is named before anything loads, as one inside the folder is."""
    import hf_tapernorm.cli.commands as commands
    from hf_tapernorm._temporaries import WRITE_MARK, process_command

    export, alive = tmp_path / "export", os.getppid()  # this test's parent: a live process
    live = tmp_path / f".export.export-{alive}"
    (live / "new").mkdir(parents=True)
    (live / WRITE_MARK).write_text("")
    monkeypatch.setattr(commands, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    assert error_of(fold_argv(reference / "tapered", export)) == (
        f"hf-tapernorm fold: error: output folder '{export}': another write of {export} is in progress (pid {alive}: "
        f"{process_command(alive)}, through '{live.name}'; delete '{live}' only if process {alive} is not writing "
        "this export, its pid reused after a restart); wait for it to finish, or choose another --output_dir"
    )
    assert not export.exists() and (live / WRITE_MARK).is_file()


def test_a_fold_with_a_scan_into_the_runs_folded_is_the_runs_export(workspace, tmp_path):
    """push's hint for an unscanned export (fold --output_dir RUN/folded --overwrite --scan_windows N), followed:
    the run's --overwrite then named folded/robustness_scan.json as no file of its own. The files the export in
    folded/ recorded in its manifest are the run's export's now, whichever command wrote it."""
    folder, argv = tmp_path / "run", taper_argv(workspace, tmp_path / "run", "--scan_windows", "0", steps=5)
    assert run_main([*argv, "--distill_weight", "0"])[0] == 0
    assert not (folder / "folded" / "robustness_scan.json").exists()
    fold = fold_argv(folder / "tapered", folder / "folded", "--overwrite", "--scan_windows", "2")
    code, _, stderr = run_main(fold)
    assert code == 0, stderr[-2000:]
    assert "robustness_scan.json" in json.loads((folder / "folded" / ".hf_tapernorm_export.json").read_text())["files"]
    (folder / "folded" / "notes.txt").write_text("mine")  # not in the export's manifest: still the user's
    assert "(folded/notes.txt)" in error_of([*argv, "--overwrite"])
    (folder / "folded" / "notes.txt").unlink()
    code, _, stderr = run_main([*argv, "--overwrite"])
    assert code == 0, stderr[-2000:]
    assert not (folder / "folded" / "robustness_scan.json").exists()  # the new run wrote no scan (--scan_windows 0)


@pytest.mark.parametrize("name", ["README.md", "generation_config.json"])
@pytest.mark.parametrize("option", ["--overwrite", "--resume"])
def test_taper_refuses_to_replace_a_run_export_whose_card_was_edited(
    workspace, run, tmp_path, monkeypatch, option, name
):
    """taper --overwrite, and --resume of the finished run (which writes its export anew), replaced an edited
    README.md card in the run's folded/ without a word, where fold --overwrite refuses it; now both refuse in one
    line, before anything is loaded, deleted or trained, and the card is kept. An edited generation_config.json (its
    owner's sampling defaults, which push uploads) was replaced with only a WARNING: it is refused and kept too."""
    folder = copy_of(run, tmp_path)
    edited = folder / "folded" / name
    edited.write_text(edited.read_text() + "\n")  # still JSON, for generation_config.json
    before = snapshot(folder)
    no_loading(monkeypatch)
    assert error_of([*run_argv(workspace, folder), option]) == (
        f"hf-tapernorm taper: error: refusing to {option} '{folder}', which writes its export '{folder / 'folded'}' "
        f"anew: its {name} was edited after the export wrote it (its sha256 is not the one "
        f".hf_tapernorm_export.json recorded), and replacing the export would lose the edits; move {name} out of "
        "the folder to keep it, or delete it to let the export be replaced"
    )
    assert snapshot(folder) == before


def _flip_last_byte(path: Path) -> bytes:
    """Change ``path`` as a model saved over an export would (its sha256 no longer the one the export recorded)."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    return bytes(data)


def _changed_warnings(caplog) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "changed after" in r.getMessage()
    ]


def test_fold_overwrite_warns_of_weights_changed_since_the_export(reference, tmp_path, caplog):
    """fold --overwrite of an export whose model.safetensors its owner had saved over replaced it without a word,
    where export_folded(overwrite=True) names it in a WARNING (fold writes through write_folder, around that check).
    It still replaces them, as asked, with the same WARNING (manifest.warn_changed_export), once fold goes ahead:
    a fold refused after its check of the folder (its fold check, here) said "replaces" though nothing was."""
    export = tmp_path / "export"
    code, _, stderr = run_main(fold_argv(reference / "tapered", export))
    assert code == 0, stderr[-2000:]
    changed = _flip_last_byte(export / "model.safetensors")
    caplog.set_level(logging.WARNING)
    code, _, stderr = run_main(fold_argv(reference / "tapered", export, "--overwrite", "--tolerance", "1e-300"))
    assert code != 0 and "logits differ from the unfolded" in stderr, stderr[-2000:]
    assert _changed_warnings(caplog) == [] and (export / "model.safetensors").read_bytes() == changed
    code, _, stderr = run_main(fold_argv(reference / "tapered", export, "--overwrite"))
    assert code == 0, stderr[-2000:]
    assert _changed_warnings(caplog) == [
        f"--overwrite of '{export}' replaces model.safetensors, changed after the earlier export wrote it (the sha256 "
        ".hf_tapernorm_export.json recorded differs): copy it out of the folder first to keep the changes"
    ]
    assert (export / "model.safetensors").read_bytes() != changed


def test_fold_overwrite_without_a_scan_names_the_scan_it_drops(reference, tmp_path, caplog):
    """fold --scan_windows 2 into EXPORT, then fold --overwrite with --scan_windows 0: the earlier (unedited)
    robustness_scan.json was deleted without a word, where a run's --overwrite/--resume names it. Now fold names it
    in the run's words once it goes ahead (not when refused later, by its fold check); a fold that scans says
    nothing."""
    export = tmp_path / "export"
    code, _, stderr = run_main(fold_argv(reference / "tapered", export, "--scan_windows", "2"))
    assert code == 0 and (export / "robustness_scan.json").is_file(), stderr[-2000:]
    caplog.set_level(logging.WARNING)
    code, _, stderr = run_main(fold_argv(reference / "tapered", export, "--overwrite", "--tolerance", "1e-300"))
    assert code != 0 and "logits differ from the unfolded" in stderr, stderr[-2000:]
    assert not [r for r in caplog.records if "robustness_scan.json" in r.getMessage()]
    code, _, stderr = run_main(fold_argv(reference / "tapered", export, "--overwrite", "--scan_windows", "2"))
    assert code == 0, stderr[-2000:]
    assert not [r for r in caplog.records if "robustness_scan.json" in r.getMessage()]
    code, _, stderr = run_main(fold_argv(reference / "tapered", export, "--overwrite"))
    assert code == 0, stderr[-2000:]
    assert [r.getMessage() for r in caplog.records if "robustness_scan.json" in r.getMessage()] == [
        f"--overwrite of '{export}' writes an export without a scan, and its robustness_scan.json (the robustness "
        "scan a fold wrote there) goes with the old export: copy it out of the folder to keep it, or scan the new "
        "export with fold --scan_windows N"
    ]
    assert not (export / "robustness_scan.json").exists()


def test_fold_overwrite_refused_by_a_folder_in_the_way_says_nothing_of_what_it_would_replace(
    reference, tmp_path, caplog
):
    """fold --overwrite of an export whose weights had changed, with a folder not of its writes under the name it
    writes through (a pid clash), named the changed weights as replaced, then refused the write: nothing was
    replaced. The WARNING comes once write_folder's checks have passed (its before_write)."""
    from hf_tapernorm.app.folder_writes import partial_name

    export = tmp_path / "export"
    code, _, stderr = run_main(fold_argv(reference / "tapered", export))
    assert code == 0, stderr[-2000:]
    changed = _flip_last_byte(export / "model.safetensors")
    (partial_name(export) / "mine").mkdir(parents=True)  # not a leftover: no writers' mark
    caplog.set_level(logging.WARNING)
    code, _, stderr = run_main(fold_argv(reference / "tapered", export, "--overwrite"))
    assert code == 2 and f"'{partial_name(export)}' is in the way of writing '{export}'" in stderr, stderr[-2000:]
    assert _changed_warnings(caplog) == [] and (export / "model.safetensors").read_bytes() == changed
    assert (partial_name(export) / "mine").is_dir()


@pytest.mark.parametrize("option", ["--overwrite", "--resume"])
def test_taper_warns_of_weights_changed_in_the_run_export_it_replaces(
    workspace, run, tmp_path, monkeypatch, caplog, option
):
    """taper --overwrite, and --resume of the finished run, replaced a model.safetensors and config.json saved over
    the run's folded/ export without a word; they name them in fold's WARNING now. It came before the checks that
    then refused the run (a --block_size beyond the model's positions): "replaces ..." though nothing was. Now it
    comes once the run goes ahead (prepare_run_folder, before the folder is emptied or cleaned), and a refused run
    says nothing of it."""
    import hf_tapernorm.app.taper as taper_pipeline

    folder = copy_of(run, tmp_path)
    _flip_last_byte(folder / "folded" / "model.safetensors")
    (folder / "folded" / "config.json").write_text((folder / "folded" / "config.json").read_text() + "\n")
    caplog.set_level(logging.WARNING)
    code, _, stderr = run_main([*run_argv(workspace, folder), option, "--block_size", "100000"])
    assert code == 2 and "--block_size 100000" in stderr, stderr[-2000:]
    assert _changed_warnings(caplog) == []

    def stop(*args, **kwargs):
        raise AssertionError("stopped once the folder was prepared")

    monkeypatch.setattr(taper_pipeline, "new_run_record", stop)  # right after prepare_run_folder: nothing trains
    with pytest.raises(AssertionError, match="stopped once the folder was prepared"):
        run_main([*run_argv(workspace, folder), option])
    assert _changed_warnings(caplog) == [
        f"{option} of {folder}, which writes its export {folder / 'folded'} anew, replaces config.json, "
        "model.safetensors, changed after the earlier export wrote them (the sha256 .hf_tapernorm_export.json "
        "recorded differs): copy them out of the folder first to keep the changes"
    ]


def test_resume_of_a_finished_run_names_the_scan_its_new_export_drops(workspace, tmp_path, caplog):
    """fold --scan_windows N into RUN/folded (push's hint), then taper --resume of the finished run: the resume folds
    and exports again (its --scan_windows 0 writes no scan) and dropped robustness_scan.json without a word. The
    export is the run's (fold takes only the run's own checkpoint into it), so it is still replaced, and a WARNING
    names the scan first; a resume that scans writes a scan of its own and says nothing."""
    folder, argv = tmp_path / "run", taper_argv(workspace, tmp_path / "run", "--scan_windows", "0", steps=5)
    assert run_main([*argv, "--distill_weight", "0"])[0] == 0
    fold = fold_argv(folder / "tapered", folder / "folded", "--overwrite", "--scan_windows", "2")
    assert run_main(fold)[0] == 0
    caplog.set_level("WARNING")
    code, _, stderr = run_main([*argv, "--distill_weight", "0", "--resume"])
    assert code == 0, stderr[-2000:]
    assert not (folder / "folded" / "robustness_scan.json").exists()
    warned = [r.getMessage() for r in caplog.records if "robustness_scan.json" in r.getMessage()]
    assert warned == [
        f"--resume of {folder} writes its export {folder / 'folded'} anew, and its robustness_scan.json (the "
        "robustness scan a fold wrote there) goes with the old export: copy it out of the folder to keep it, or "
        "scan the new export with fold --scan_windows N"
    ]


# ============================================================================= a live owner's lock, a dead owner's lock
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


# ============================================================================= the disk check counts every copy
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


def test_the_disk_check_counts_every_copy_the_run_writes(workspace, tmp_path):
    from hf_tapernorm.app.preflight import check_disk_space

    model = build(tiny_llama_config())
    weights = sum(p.numel() for p in model.parameters())
    adam, sgd = (_trainer_options(tmp_path, optim=optim, max_steps=10) for optim in ("adamw_torch", "sgd"))
    distilled, plain = TaperNormConfig.paper(distill_weight=1.0), TaperNormConfig.paper(distill_weight=0.0)
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


# ============================================================================= the peak a run writes, any length
def _trainer_options(tmp_path: Path, **options):
    from hf_tapernorm.cli.arguments import TaperTrainingArguments

    return TaperTrainingArguments(output_dir=str(tmp_path / "run"), use_cpu=True, bf16=False, **options)


def test_the_disk_check_counts_the_checkpoints_that_coexist_while_the_last_is_written(tmp_path):
    """With --save_steps 500 < --max_steps 600 (the defaults) the checkpoint of step 500 is still on disk while the
    one of step 600 is written (--save_total_limit 1 deletes it only after): the check counted one."""
    from hf_tapernorm.app.preflight import run_writes

    model = build(tiny_llama_config())
    weights = sum(p.numel() for p in model.parameters()) * 4  # fp32
    checkpoint = weights * (1 + 2 + 1)  # its weights, two Adam moments, the distillation teacher
    config = TaperNormConfig.paper(distill_weight=1.0)

    def needed(**options) -> dict[str, int]:
        args = _trainer_options(tmp_path, optim="adamw_torch", **options)
        return run_writes(model, args, config, dtype=None, baseline=False)

    defaults = needed(max_steps=600)  # saves at 500 and 600
    assert defaults["1 earlier checkpoint(s) still on disk while it is written"] == checkpoint
    assert sum(defaults.values()) == 2 * checkpoint  # more than the end: 1 checkpoint + the tapered + the folded
    assert sum(needed(max_steps=500).values()) == checkpoint + 2 * weights  # one save: the end is the peak
    assert sum(needed(max_steps=10, save_steps=3, save_total_limit=2).values()) == 3 * checkpoint  # 6, 9 and 10
    all_kept = needed(max_steps=10, save_steps=3, save_total_limit=None)  # none deleted: all four at the end
    assert sum(all_kept.values()) == 4 * checkpoint + 2 * weights
    assert sum(needed(max_steps=10, save_steps=0.5, save_total_limit=1).values()) == 2 * checkpoint  # at 5 and 10
    assert sum(needed(max_steps=10, save_strategy="no").values()) == 2 * weights  # the tapered and the folded


def test_a_run_s_checkpoints_coexist_as_the_disk_check_counts(workspace, tmp_path, monkeypatch):
    """What the check assumes of the Trainer, on a run: at each save, one checkpoint more than --save_total_limit
    is on disk until the oldest is deleted."""
    import transformers.trainer

    from hf_tapernorm.app.preflight import run_writes

    rotate, seen = transformers.trainer.rotate_checkpoints, []

    def counting(output_dir, **kwargs):
        seen.append(len(list(Path(output_dir).glob("checkpoint-*"))))
        return rotate(output_dir=output_dir, **kwargs)

    monkeypatch.setattr(transformers.trainer, "rotate_checkpoints", counting)
    out = tmp_path / "run"
    code, _, stderr = run_main(taper_argv(workspace, out, "--save_steps", "2", "--out_of_corpus_blocks", "0", steps=6))
    assert code == 0, stderr
    assert seen == [1, 2, 2]  # steps 2, 4 and 6, --save_total_limit 1 (the default)
    args = _trainer_options(tmp_path, max_steps=6, save_steps=2)
    model = AutoModelForCausalLM.from_pretrained(workspace / "llama")
    writes = run_writes(model, args, tapered_config_of(out / "tapered"), dtype=None, baseline=False)
    assert "1 earlier checkpoint(s) still on disk while it is written" in writes


def test_an_absurd_max_steps_is_checked_at_once(workspace, tmp_path, monkeypatch):
    """``"max_steps": 1e20`` in run.json (or --max_steps 100000000000000000000) parsed, then the preflight stepped
    the learning-rate schedule once per training step: the command hung before loading anything."""
    import signal

    def too_long(signum, frame):
        raise TimeoutError("the checks before loading took over a minute")

    argv = taper_argv(workspace, tmp_path / "run", "--taper_start", "0.05", "--taper_end", "0.7")
    options = {argv[i][2:]: argv[i + 1] for i in range(1, len(argv) - 1) if argv[i].startswith("--")}
    options.update(max_steps=1e20, use_cpu=True)
    (tmp_path / "run.json").write_text(json.dumps(options))
    no_loading(monkeypatch)
    previous = signal.signal(signal.SIGALRM, too_long)
    signal.alarm(60)
    try:
        with pytest.raises(AssertionError, match="loaded the model or the data"):  # every check passed
            run_main(["taper", str(tmp_path / "run.json")])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# ============================================================================= only the run's files, in every folder
def test_overwrite_names_user_folders_that_only_look_like_checkpoints(workspace, run, tmp_path, monkeypatch):
    """Every file under a folder named ``checkpoint-*`` counted as the run's: --overwrite deleted a user's
    ``checkpoint-10-keep`` copy and ``checkpoint-notes/notes.txt`` without naming them."""
    out = copy_of(run, tmp_path)
    shutil.copytree(out / "checkpoint-10", out / "checkpoint-10-keep")
    (out / "checkpoint-notes").mkdir()
    (out / "checkpoint-notes" / "notes.txt").write_text("my notes")
    (out / "checkpoint-10" / "notes.txt").write_text("a note in a checkpoint the run recorded")
    before = snapshot(out)
    no_loading(monkeypatch)
    message = error_of([*run_argv(workspace, out), "--overwrite"])
    assert message == (
        f"hf-tapernorm taper: error: refusing to --overwrite '{out}': it holds files hf-tapernorm did not write "
        "(checkpoint-10-keep/, checkpoint-10/notes.txt, checkpoint-notes/notes.txt); move them away first"
    )
    copied = {f"checkpoint-10-keep/{p.relative_to(out / 'checkpoint-10').as_posix()}" for p in out.rglob("*")
              if p.is_file() and p.is_relative_to(out / "checkpoint-10") and p.name != "notes.txt"}  # fmt: skip
    foreign = {*copied, "checkpoint-notes/notes.txt", "checkpoint-10/notes.txt"}
    assert set(RunFolder(out).foreign_files()) == foreign
    assert snapshot(out) == before
    # a checkpoint the run saved but had not recorded yet (killed in between) is still the run's
    folder = RunFolder(out)
    for name in ("checkpoint-10-keep", "checkpoint-notes"):
        shutil.rmtree(out / name)
    (out / "checkpoint-10" / "notes.txt").unlink()
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    manifest["files"] = [f for f in manifest["files"] if not f.startswith("checkpoint-10/")]
    (out / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert folder.foreign_files() == []
    assert "checkpoint-10/trainer_state.json" in {p.relative_to(out).as_posix() for p in folder._emptied_files()}


def test_no_command_writes_inside_a_folder_a_running_command_holds(workspace, tmp_path, monkeypatch):
    """taper never looked above its --output_dir (a run inside a running run's folded/ was lost when that run wrote
    its export), and every lock search walked the path as written: through a symbolic link, eval, fold and taper
    wrote into a running run."""
    live = tmp_path / "live"
    (live / "folded").mkdir(parents=True)
    (live / "tapered").mkdir()
    (live / LOCK_NAME).write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname()}))
    (tmp_path / "lnk").symlink_to(live / "folded", target_is_directory=True)
    (tmp_path / "lnk_tap").symlink_to(live / "tapered", target_is_directory=True)
    before = snapshot(live)
    no_loading(monkeypatch)
    for out in (live / "folded" / "B", live / "sub", tmp_path / "lnk_tap" / "newrun"):
        message = error_of(taper_argv(workspace, out, steps=2))
        assert message.startswith(f"hf-tapernorm taper: error: output folder '{out}' lies in '{live}', which a "), out
        assert message.endswith("wait for it to finish, or choose a folder outside it")
    checkpoint = tapered_checkpoint(tmp_path / "tapered")
    message = error_of(fold_argv(checkpoint, tmp_path / "lnk" / "sub"))
    assert message.startswith(f"hf-tapernorm fold: error: output folder '{tmp_path / 'lnk' / 'sub'}' lies in '{live}'")
    corpus = str(workspace / "corpus.txt")
    evaluate = ["eval", "--model_name_or_path", str(workspace / "llama"), "--dataset_name", corpus,
                "--block_size", "32", "--heldout_blocks", "2", "--heldout_percentage", "10"]  # fmt: skip
    result = tmp_path / "lnk" / "res.json"
    assert error_of([*evaluate, "--output_json", str(result)]) == (
        f"hf-tapernorm eval: error: --output_json {result} lies in '{live}', which a running hf-tapernorm command "
        f"owns (pid {os.getppid()} on host {socket.gethostname()}; if no hf-tapernorm command runs as pid "
        f"{os.getppid()} on {socket.gethostname()} (it was killed, its container or pod restarted, or the folder was "
        f"copied), the lock is stale: delete {live / LOCK_NAME}); name a file outside it"
    )
    assert snapshot(live) == before and sorted(p.name for p in (live / "folded").iterdir()) == []


def test_a_command_that_finds_a_running_command_above_once_locked_gives_its_folder_back(tmp_path, monkeypatch):
    """Two commands starting at once, one inside the other's folder: the inner one looks above again once its lock
    is held, so either it sees the outer lock or the outer one finds the inner folder in its own."""
    from hf_tapernorm.app.run_lock import RunLock

    outer, inner = tmp_path / "A", tmp_path / "A" / "folded" / "B"
    take = RunLock._take

    def outer_starts_meanwhile(self):
        take(self)
        (outer / LOCK_NAME).write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname()}))

    monkeypatch.setattr(RunLock, "_take", outer_starts_meanwhile)
    with pytest.raises(RunFolderError, match=f"output folder '{inner}' lies in '{outer}', which a running"):
        RunFolder(inner).lock()
    # the folded/ its lock created is removed with it (no stray folder); the outer one holds a lock
    assert not inner.exists() and sorted(p.name for p in outer.iterdir()) == [LOCK_NAME]


def test_files_put_into_a_run_s_output_folders_while_it_works_stay_the_users(workspace, tmp_path, monkeypatch, caplog):
    """Notes put into folded/, tapered/ and baseline/ while the run trained: the first two were deleted when the run
    wrote its outputs, and baseline/notes.txt was recorded as the run's, so the next --overwrite deleted it."""
    import hf_tapernorm.app.taper as taper_pipeline

    out = tmp_path / "run"
    save_tapered = taper_pipeline.save_tapered

    def with_user_notes(*args, **kwargs):
        for folder in ("folded", "tapered", "baseline"):
            (out / folder).mkdir(exist_ok=True)
            (out / folder / "notes.txt").write_text(f"my notes in {folder}")
        return save_tapered(*args, **kwargs)

    monkeypatch.setattr(taper_pipeline, "save_tapered", with_user_notes)
    argv = taper_argv(workspace, out, "--distill_weight", "0", "--out_of_corpus_blocks", "0", steps=6)
    code, _, stderr = run_main(argv)
    assert code == 0, stderr[-2000:]
    for folder in ("folded", "tapered", "baseline"):
        assert (out / folder / "notes.txt").read_text() == f"my notes in {folder}"
    assert (out / "folded" / "model.safetensors").is_file() and (out / "tapered" / "config.json").is_file()
    assert f"{out / 'folded'} holds files this command did not write (notes.txt): they stay where they are" in (
        caplog.text
    )
    manifest = json.loads((out / MANIFEST_NAME).read_text())["files"]
    assert not [f for f in manifest if f.endswith("notes.txt")] and "folded/model.safetensors" in manifest
    assert sorted(p.name for p in out.iterdir() if ".kept-" in p.name or ".old-" in p.name) == []
    monkeypatch.setattr(taper_pipeline, "save_tapered", save_tapered)
    before = snapshot(out)
    assert error_of([*argv, "--overwrite"]) == (
        f"hf-tapernorm taper: error: refusing to --overwrite '{out}': it holds files hf-tapernorm did not write "
        "(baseline/notes.txt, folded/notes.txt, tapered/notes.txt); move them away first"
    )
    assert snapshot(out) == before


def test_an_output_folder_is_never_replaced_over_a_user_file_of_the_same_name(tmp_path):
    from hf_tapernorm.app.run_folder import write_folder

    final = tmp_path / "folded"
    final.mkdir()
    (final / "config.json").write_text("the user's")
    (final / "notes").mkdir()
    (final / "notes" / "a.txt").write_text("kept")

    def write(tmp: Path) -> None:
        tmp.mkdir()
        (tmp / "config.json").write_text("{}")

    with pytest.raises(RunFolderError, match=r"holds files this command did not write \(config.json\) where it"):
        write_folder(final, write, keep=lambda: ["config.json", "notes/a.txt"])
    assert snapshot(final) == {"config.json": b"the user's", "notes/a.txt": b"kept"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folded"]
    (final / "config.json").unlink()
    write_folder(final, write, keep=lambda: ["notes/a.txt"])
    assert snapshot(final) == {"config.json": b"{}", "notes/a.txt": b"kept"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folded"]


def test_an_options_file_kept_in_its_output_folder_is_named_at_the_first_refusal(workspace, tmp_path, monkeypatch):
    """``taper runs/oj/run.json`` with ``output_dir: runs/oj``: 'not empty; pass --overwrite', and following that
    advice, 'not written by hf-tapernorm (run.json)'."""
    out = tmp_path / "oj"
    out.mkdir()
    options = out / "run.json"
    values = {"model_name_or_path": str(workspace / "llama"), "dataset_name": str(workspace / "corpus.txt"),
              "block_size": 32, "max_steps": 2, "use_cpu": True, "output_dir": str(out)}  # fmt: skip
    options.write_text(json.dumps(values))
    no_loading(monkeypatch)
    hint = "; if run.json is this command's options file, keep it outside the --output_dir it names"
    assert error_of(["taper", str(options)]) == (
        f"hf-tapernorm taper: error: output folder '{out}' holds files hf-tapernorm did not write (run.json), which "
        f"neither --overwrite nor --resume replaces: move them away, or choose another --output_dir{hint}"
    )
    options.write_text(json.dumps({**values, "overwrite": True}))
    assert error_of(["taper", str(options)]) == (
        f"hf-tapernorm taper: error: refusing to --overwrite '{out}': it was not written by hf-tapernorm (run.json); "
        f"move them away first{hint}"
    )
    assert sorted(p.name for p in out.iterdir()) == ["run.json"]


def test_a_user_folder_named_like_an_unrecorded_checkpoint_is_named_and_never_deleted(
    workspace, run, tmp_path, monkeypatch
):
    """An unrecorded ``checkpoint-<digits>`` counted as the run's whatever it held: --overwrite deleted a user's
    ``checkpoint-99/notes.txt``, and --resume removed ``checkpoint-11/notes.txt`` as an incomplete checkpoint."""
    out = copy_of(run, tmp_path)
    (out / "checkpoint-99").mkdir()
    (out / "checkpoint-99" / "notes.txt").write_text("my notes")
    shutil.copytree(out / "checkpoint-10", out / "checkpoint-11")  # a whole copy plus a note: a user's too
    (out / "checkpoint-11" / "notes.txt").write_text("my notes")
    before = snapshot(out)
    no_loading(monkeypatch)
    assert error_of([*run_argv(workspace, out), "--overwrite"]) == (
        f"hf-tapernorm taper: error: refusing to --overwrite '{out}': it holds files hf-tapernorm did not write "
        "(checkpoint-11/, checkpoint-99/notes.txt); move them away first"
    )
    assert error_of([*run_argv(workspace, out), "--resume"]).startswith(
        f"hf-tapernorm taper: error: --resume: '{out}' holds files this command did not write (checkpoint-11/, "
        "checkpoint-99/notes.txt); move them away first"
    )
    assert snapshot(out) == before
    # without the note, the unrecorded copy holds only what a checkpoint holds: the run's (saved, not recorded)
    (out / "checkpoint-11" / "notes.txt").unlink()
    assert RunFolder(out).foreign_files() == ["checkpoint-99/notes.txt"]


def test_a_folder_a_running_command_owns_inside_the_output_folder_is_named_as_that_command(tmp_path):
    """``taper --output_dir R/sub`` started a moment before ``taper --output_dir R``: the outer one was refused
    calling ``sub/.hf_tapernorm_run.lock`` a file hf-tapernorm did not write, and told to move it away."""
    outer = tmp_path / "R"
    lock = write_lock(outer / "sub", pid=os.getppid(), host=socket.gethostname())
    with pytest.raises(RunFolderError) as refused:
        RunFolder(outer).lock()
    assert str(refused.value).startswith(
        f"output folder '{outer}' holds 'sub', which a running hf-tapernorm command owns (pid {os.getppid()} on host "
    )
    assert str(refused.value).endswith("wait for it to finish, or choose another --output_dir")
    assert sorted(p.name for p in outer.iterdir()) == ["sub"] and lock.is_file()
    lock.write_text(json.dumps({"pid": 2**22 + 1, "host": socket.gethostname()}))  # its owner is gone: free
    RunFolder(outer).lock()


def test_a_destination_under_a_folder_this_user_cannot_read_is_one_line(workspace, tmp_path, monkeypatch):
    """As a non-root user, an output under /root (mode 0700): Path.exists raised PermissionError, a traceback."""
    from pathlib import Path as PathType

    closed = tmp_path / "closed"
    exists, is_dir = PathType.exists, PathType.is_dir

    def denied(original):
        def check(self, *args, **kwargs):
            if self.is_relative_to(closed) and self != closed:
                raise PermissionError(13, "Permission denied", str(self))
            return original(self, *args, **kwargs)

        return check

    monkeypatch.setattr(PathType, "exists", denied(exists))
    monkeypatch.setattr(PathType, "is_dir", denied(is_dir))
    no_loading(monkeypatch)
    checkpoint, result = tapered_checkpoint(tmp_path / "tapered"), closed / "s" / "r.json"
    for command, argv, what in (
        ("fold", fold_argv(checkpoint, closed / "f"), f"output folder '{closed / 'f'}'"),
        ("taper", taper_argv(workspace, closed / "t", steps=2), f"output folder '{closed / 't'}'"),
        ("eval", ["eval", "--model_name_or_path", str(workspace / "llama"), "--output_json", str(result)],
         f"--output_json {result}"),
    ):  # fmt: skip
        message = error_of(argv)
        assert message.startswith(f"hf-tapernorm {command}: error: {what}: cannot read the folder '{closed}/"), message
        assert message.endswith("(Permission denied); choose a folder you can read and write"), message


# ============================================================================= what is the run's: exact names only
def test_a_user_file_in_the_trainer_log_folder_stays_the_users(workspace, run, tmp_path, monkeypatch):
    """``runs/`` (the Trainer's TensorBoard folder) was the run's whole: a user's ``runs/notes.txt`` was deleted by
    --overwrite, and recorded as the run's when --resume rebuilt a lost manifest. Only the event files the
    Trainer's writer writes there are the run's."""
    out = copy_of(run, tmp_path)
    events = out / "runs" / "Jan01_00-00-00_host" / "events.out.tfevents.1767225600.host.4242.0"
    events.parent.mkdir(parents=True)
    events.write_bytes(b"the Trainer's TensorBoard events")
    (out / "runs" / "notes.txt").write_text("my notes")
    before = snapshot(out)
    no_loading(monkeypatch)
    refusal = (
        f"hf-tapernorm taper: error: refusing to --overwrite '{out}': it holds files hf-tapernorm did not write "
        "(runs/notes.txt); move them away first"
    )
    assert error_of([*run_argv(workspace, out), "--overwrite"]) == refusal
    assert snapshot(out) == before
    (out / MANIFEST_NAME).unlink()  # lost: --resume rebuilds it from the last checkpoint's record
    assert error_of([*run_argv(workspace, out), "--resume"]) == (
        f"hf-tapernorm taper: error: --resume: '{out}' holds files this command did not write (runs/notes.txt); "
        "move them away first, a finished run replaces its outputs"
    )
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert events.relative_to(out).as_posix() in manifest["files"] and "runs/notes.txt" not in manifest["files"]
    manifest["files"].append("runs/notes.txt")  # what an earlier version recorded: still not the run's to delete
    (out / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert error_of([*run_argv(workspace, out), "--overwrite"]) == refusal
    assert (out / "runs" / "notes.txt").read_text() == "my notes" and events.read_bytes() == before[
        events.relative_to(out).as_posix()
    ]


def test_only_the_exact_names_of_an_interrupted_write_are_the_run_s_leftovers(workspace, run, tmp_path, monkeypatch):
    """Any top-level hidden name holding ``.old-`` or ``.partial-`` (and ``report.json.tmp``) was taken for the run's
    own leftover and deleted without a word: a user's ``.thesis.old-2023/`` and ``.notes.partial-v2/``; then any
    ``.NAME.partial-<digits>`` / ``.NAME.old-<digits>`` of an output: a user's ``.folded.old-2023/`` (a copy of the
    export) and ``.report.md.partial-1`` (a draft). Only the exact names the run recorded before writing are."""
    from hf_tapernorm.app.taper import RUN_OUTPUTS

    out = copy_of(run, tmp_path)
    users = {".thesis.old-2023/draft.txt": "my draft", ".notes.partial-v2/draft.txt": "my notes"}
    users |= {"report.json.tmp": "my own json", ".tapered.partial-/x.txt": "mine", "tapered/.notes.partial-1": "mine"}
    users |= {".folded.old-2023/config.json": "my copy", ".report.md.partial-1": "my report draft"}
    ours = {".tapered.partial-4242/config.json": "{}", ".folded.old-4242/config.json": "{}"}
    ours |= {".report.json.partial-4242": "{}", ".heldout_losses.json.partial-17": "[]"}
    for relative, text in {**users, **ours}.items():
        (out / relative).parent.mkdir(parents=True, exist_ok=True)
        (out / relative).write_text(text)
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    manifest["writes"] = sorted(relative.split("/")[0] for relative in ours)  # what a killed run recorded
    (out / MANIFEST_NAME).write_text(json.dumps(manifest))
    before = snapshot(out)
    no_loading(monkeypatch)
    named = ".folded.old-2023/config.json, .notes.partial-v2/draft.txt, .report.md.partial-1, .tapered.partial-/x.txt, "
    named += ".thesis.old-2023/draft.txt, report.json.tmp, tapered/.notes.partial-1"
    assert error_of([*run_argv(workspace, out), "--overwrite"]) == (
        f"hf-tapernorm taper: error: refusing to --overwrite '{out}': it holds files hf-tapernorm did not write "
        f"({named}); move them away first"
    )
    assert error_of([*run_argv(workspace, out), "--resume"]) == (
        f"hf-tapernorm taper: error: --resume: '{out}' holds files this command did not write ({named}); move them "
        "away first, a finished run replaces its outputs"
    )
    assert snapshot(out) == before
    RunFolder(out, outputs=RUN_OUTPUTS).remove_partials()  # what --resume does once the folder is the run's
    after = snapshot(out)
    assert {k: v for k, v in after.items() if k != MANIFEST_NAME} == {
        k: v for k, v in before.items() if k not in ours and k != MANIFEST_NAME
    }
    assert not any((out / relative.split("/")[0]).exists() for relative in ours)
    assert json.loads((out / MANIFEST_NAME).read_text())["writes"] == []


def test_an_output_folder_is_recorded_before_it_is_written_so_its_leftover_is_the_run_s(tmp_path):
    """``baseline/model`` is no name of ``outputs``: its write records it first, so a kill while it is written
    leaves ``baseline/.model.partial-PID``, a leftover of the run, not a foreign folder that blocks --resume."""
    folder = RunFolder(tmp_path / "run")
    folder.record()
    seen: list = []

    def write(tmp: Path) -> None:
        tmp.mkdir(parents=True)
        (tmp / "config.json").write_text("{}")
        seen.append((tmp.relative_to(folder.path).as_posix(), folder.foreign_files()))

    folder.write_output("baseline/model", write)
    assert seen == [(f"baseline/.model.partial-{os.getpid()}/w", [])]
    assert folder.manifest()["writes"] == []  # written: its temporary names are forgotten
    (folder.path / "baseline" / ".model.old-99").mkdir()  # no write of the run's made this one
    (folder.path / "baseline" / ".model.old-99" / "config.json").write_text("{}")
    assert folder.foreign_files() == ["baseline/.model.old-99/config.json"]
    folder.remove_partials()
    folder.write_output("baseline/model", write)
    assert sorted(p.name for p in (folder.path / "baseline").iterdir()) == [".model.old-99", "model"]


def _killed_while_writing(folder: RunFolder) -> int:
    """A process that writes ``folder``'s ``tapered/`` and its report.json and is killed in the middle of each (the
    write never returns); its pid."""
    import signal

    import hf_tapernorm.app.folder_writes as folder_writes

    child = os.fork()
    if child == 0:
        try:

            def killed(tmp: Path) -> None:
                tmp.mkdir()
                (tmp / "config.json").write_text("{}")
                os.kill(os.getpid(), signal.SIGKILL)

            if os.fork() == 0:  # killed writing tapered/
                folder.write_output("tapered", killed)
            os.wait()
            folder.record(expect=["report.json"])
            folder_writes.os.replace = lambda *args: os.kill(os.getpid(), signal.SIGKILL)  # before the rename
            folder_writes.write_file(folder.path / "report.json", "{}")
        finally:
            os._exit(1)
    os.waitpid(child, 0)
    return child


def test_a_run_killed_while_writing_leaves_leftovers_it_recorded_and_resume_or_overwrite_remove_them(tmp_path):
    """The other direction: a leftover of a write killed mid-way (SIGKILL) was recorded before the write made it,
    so --resume and --overwrite still find it the run's, and delete it; a user's one of the same form is not."""
    from hf_tapernorm.app.taper import RUN_OUTPUTS

    folder = RunFolder(tmp_path / "run", outputs=RUN_OUTPUTS)
    folder.record()
    pid = _killed_while_writing(folder)
    left = sorted(p.name for p in folder.path.iterdir() if p.name != MANIFEST_NAME)
    assert f".report.json.partial-{pid}" in left and any(name.startswith(".tapered.partial-") for name in left)
    (folder.path / ".report.json.partial-1").write_text("my draft")
    assert folder.foreign_files() == [".report.json.partial-1"]
    with pytest.raises(RunFolderError, match=r"holds files this command did not write \(.report.json.partial-1\)"):
        folder.check(overwrite=False, resume=True, has_checkpoint=lambda: True)
    (folder.path / ".report.json.partial-1").unlink()
    assert folder.check(overwrite=False, resume=True, has_checkpoint=lambda: True) is False
    assert folder.check(overwrite=True, resume=False, has_checkpoint=lambda: True) is True
    folder.remove_partials()  # what --resume does (--overwrite: empty(), which calls it)
    assert sorted(p.name for p in folder.path.iterdir()) == [MANIFEST_NAME]
    assert folder.manifest()["writes"] == []


# ============================================================================= the lock: atomic, never read blocking
def _contend(folder: Path, step, held, index: int, trials: int) -> None:
    """One of several processes that take the same folder's lock at once, ``trials`` times (see the test)."""
    from hf_tapernorm.app.run_lock import RunLock

    for _ in range(trials):
        step.wait()  # the stale lock is in place
        lock = RunLock(folder)
        try:
            lock.acquire()
            held[index] = 1
        except RunFolderError:
            held[index] = 0
        step.wait()  # every process has tried
        lock.release()
        step.wait()  # every lock is released


def test_two_commands_taking_over_one_stale_lock_at_once_never_both_hold_it(tmp_path):
    """Each saw the dead owner, deleted the lock and created its own: the slower one deleted the faster one's fresh
    lock, and both held the folder (79 of 300 trials). The takeover is a flock on the file the path names."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    folder, processes, trials = tmp_path / "run", 4, 120
    folder.mkdir()
    step, held = context.Barrier(processes + 1, timeout=30), context.Array("i", processes)
    workers = [context.Process(target=_contend, args=(folder, step, held, i, trials)) for i in range(processes)]
    for worker in workers:
        worker.start()
    holders = []
    try:
        for _ in range(trials):
            write_lock(folder, pid=2**22 + 1, host=socket.gethostname(), started=1)  # its process is gone
            step.wait()
            step.wait()
            holders.append(sum(held))
            step.wait()
    finally:
        for worker in workers:
            worker.join(timeout=30)
    assert [worker.exitcode for worker in workers] == [0] * processes
    assert holders == [1] * trials, f"{sum(h > 1 for h in holders)} of {trials} trials: several held the lock"
    assert sorted(os.listdir(folder)) == []


def test_a_lock_that_is_not_a_file_is_refused_in_one_line_and_never_read(workspace, run, tmp_path, monkeypatch):
    """``mkfifo .hf_tapernorm_run.lock``: fold read the named pipe to learn its owner and never returned."""
    import signal
    import stat

    out = tmp_path / "export"
    out.mkdir()
    os.mkfifo(out / LOCK_NAME)

    def hung(signum, frame):
        raise AssertionError("blocked reading the named pipe")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(30)
    try:
        fold_message = error_of(fold_argv(run / "tapered", out))
        no_loading(monkeypatch)
        taper_message = error_of(taper_argv(workspace, out, steps=5))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    refusal = (
        f"error: output folder '{out}': its lock {out / LOCK_NAME} is a named pipe, not a file hf-tapernorm wrote; "
        "remove it if no hf-tapernorm command is using the folder, or choose another --output_dir"
    )
    assert fold_message == f"hf-tapernorm fold: {refusal}"
    assert taper_message == f"hf-tapernorm taper: {refusal}"
    assert os.listdir(out) == [LOCK_NAME] and stat.S_ISFIFO(os.lstat(out / LOCK_NAME).st_mode)


# ============================================================================= a path no command can use
def test_a_destination_through_a_symbolic_link_loop_is_one_line_naming_the_option(workspace, tmp_path, monkeypatch):
    """``ln -s loop lp/loop``, then ``--output_dir lp/loop/x``: Path.resolve raised RuntimeError (Symlink loop), a
    traceback from taper, fold, bench and push."""
    from hf_tapernorm.cli.commands import check_export_folder

    (tmp_path / "lp").mkdir()
    (tmp_path / "lp" / "loop").symlink_to("loop")
    looping, target = tmp_path / "lp" / "loop", tmp_path / "lp" / "loop" / "x"
    loop = f"the symbolic link '{looping}' on the way leads back into itself (a loop); fix or remove it"
    no_loading(monkeypatch)
    bench = ["bench", "--model_name_or_path", str(workspace / "llama"), "--output_dir", str(target)]
    for command, argv, what in (
        ("taper", taper_argv(workspace, target, steps=2), f"--output_dir '{target}'"),
        ("bench", bench, f"--output_dir '{target}'"),
        ("push", ["push", "--export_dir", str(target), "--repo_id", "me/x"], f"--export_dir '{target}'"),
    ):
        assert error_of(argv) == f"hf-tapernorm {command}: error: {what}: {loop}"
    with pytest.raises(RunFolderError) as refused:  # what fold checks its --output_dir with
        check_export_folder(target, overwrite=False)
    assert str(refused.value) == f"output folder '{target}': {loop}"
    checkpoint = tapered_checkpoint(tmp_path / "tapered")
    fold = ["fold", "--checkpoint", str(checkpoint), "--output_dir", str(target)]
    assert error_of(fold).startswith("hf-tapernorm fold: error: ") and error_of(fold).endswith(loop)
    cache = taper_argv(workspace, tmp_path / "run", "--data_cache_dir", str(looping / "c"), steps=2)
    assert error_of(cache) == f"hf-tapernorm taper: error: --data_cache_dir '{looping / 'c'}': {loop}"
    evaluate = ["eval", "--model_name_or_path", str(looping)]  # a dangling link is a local path, not a Hub id
    assert (
        error_of(evaluate)
        == f"hf-tapernorm eval: error: model '{looping}' is a symbolic link that leads to no folder or file"
    )
    assert sorted(os.listdir(tmp_path)) == ["lp", "tapered"] and os.listdir(tmp_path / "lp") == ["loop"]


def test_fold_into_a_folder_this_user_cannot_read_is_one_line(tmp_path):
    """As uid 65534, ``fold --output_dir /root/f``: check_export_folder's first look at the folder (is it a symbolic
    link?) raised PermissionError, a traceback, before the guarded checks."""
    import multiprocessing

    from hf_tapernorm.cli.commands import check_export_folder

    closed = tmp_path / "closed"
    closed.mkdir(mode=0o700)
    target = closed / "f"

    def look(answer) -> None:
        if os.geteuid() == 0:  # root reads every folder: look as another user, as the probe did (setpriv)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
        try:
            check_export_folder(target, overwrite=False)
            answer.put("accepted")
        except Exception as error:  # noqa: BLE001 - which error it is, is the point
            answer.put(f"{type(error).__name__}: {error}")

    context = multiprocessing.get_context("fork")
    answer = context.Queue()
    if os.geteuid() != 0:
        closed.chmod(0)
    try:
        process = context.Process(target=look, args=(answer,))
        process.start()
        result = answer.get(timeout=60)
        process.join(timeout=60)
    finally:
        closed.chmod(0o700)
    assert result == (
        f"UsageError: output folder '{target}': cannot read the folder '{target}' (Permission denied); choose a "
        "folder you can read and write"
    )


# ============================================================================= a lock's record and its holder
def test_a_lock_record_whose_pid_is_no_pid_is_unreadable_in_one_line(workspace, run, tmp_path):
    """``{"pid": 1099511627776, ...}`` (hand-edited, or a foreign tool's): os.kill overflowed, a traceback from fold,
    eval --output_json and RunLock.acquire(). A pid outside 1 .. 2**31 - 1, or a bool, is no pid."""
    from hf_tapernorm.app.run_lock import RunLock

    out = tmp_path / "out"
    for pid in (2**40, 2**31, 0, -1, True):
        lock = write_lock(out, pid=pid, host=socket.gethostname(), started=1)
        unreadable = (
            f"its lock {lock} is unreadable; if no hf-tapernorm command is using the folder, the lock is stale: "
            f"delete {lock}"
        )
        with pytest.raises(RunFolderError) as refused:
            RunLock(out).acquire()
        assert str(refused.value) == (
            f"output folder '{out}' is in use by another hf-tapernorm command ({unreadable}); wait for it to finish, "
            "or choose another --output_dir"
        ), pid
        fold = error_of(fold_argv(run / "tapered", out))
        assert fold.startswith(f"hf-tapernorm fold: error: output folder '{out}' is in use") and unreadable in fold
        result = out / "r.json"
        evaluate = error_of(["eval", "--model_name_or_path", str(workspace / "llama"), "--output_json", str(result)])
        assert evaluate == (
            f"hf-tapernorm eval: error: --output_json {result} lies in '{out.resolve()}', which a running "
            f"hf-tapernorm command owns ({unreadable}); name a file outside it"
        )
        assert os.listdir(out) == [LOCK_NAME] and json.loads(lock.read_text())["pid"] == pid


def test_a_stale_lock_this_user_cannot_open_for_writing_says_why(tmp_path):
    """As uid 65534, its own stale lock made read-only (0444): 'another user's file', which it was not."""
    import multiprocessing
    import tempfile

    from hf_tapernorm.app.run_lock import RunLock

    root = os.geteuid() == 0  # root opens every file: take it as another user, as the probe did (setpriv)
    base = Path(tempfile.mkdtemp()) if root else tmp_path  # pytest's folders are root's own (0700)
    folder = base / "mine"
    lock = write_lock(folder, pid=2**22 + 1, host=socket.gethostname(), started=1)  # its process is gone
    lock.chmod(0o444)
    for path in (base, folder, lock) if root else ():
        os.chown(path, 65534, 65534)

    def take(answer) -> None:
        if os.geteuid() == 0:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
        try:
            RunLock(folder).acquire()
            answer.put("taken")
        except RunFolderError as error:
            answer.put(str(error))

    context = multiprocessing.get_context("fork")
    answer = context.Queue()
    process = context.Process(target=take, args=(answer,))
    process.start()
    try:
        message = answer.get(timeout=60)
        process.join(timeout=60)
        assert message == (
            f"output folder '{folder}': its lock {lock} is stale, but this user cannot open it for writing (it is "
            "read-only, mode 0444), so it cannot be taken over: delete it"
        )
        assert os.listdir(folder) == [LOCK_NAME] and json.loads(lock.read_text())["pid"] == 2**22 + 1
    finally:
        if root:
            shutil.rmtree(base)


def test_a_lock_held_by_a_child_of_its_killed_owner_says_so(tmp_path):
    """The owner's flock is shared with a process it forked; killed, the owner left the lock held by that child, and
    the next command said 'in use by pid N', a pid that is gone. (A child forked through os.fork closes its copy,
    see the next test; one forked otherwise still holds it, here as a second open of the file.)"""
    import fcntl

    from hf_tapernorm.app.run_lock import RunLock

    folder = tmp_path / "run"
    gone = 2**22 + 1
    lock = write_lock(folder, pid=gone, host=socket.gethostname(), started=1)
    holder = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        with pytest.raises(RunFolderError) as refused:
            RunLock(folder).acquire()
        assert RunLock(folder).held_by_another() == (
            f"a process that pid {gone} started still holds its lock {lock} (its process {gone} is gone: a child it "
            "forked keeps the lock file open); wait for that process to end, or stop it"
        )
    finally:
        os.close(holder)
    assert str(refused.value) == (
        f"output folder '{folder}' is in use by another hf-tapernorm command (a process that pid {gone} started "
        f"still holds its lock {lock} (its process {gone} is gone: a child it forked keeps the lock file open); wait "
        "for that process to end, or stop it); wait for it to finish, or choose another --output_dir"
    )
    assert json.loads(lock.read_text())["pid"] == gone
    taken = RunLock(folder)
    taken.acquire()  # the child ended: the lock is free, and taken over
    taken.release()


def test_a_child_forked_by_the_lock_owner_does_not_keep_the_lock_once_the_owner_is_killed(tmp_path):
    """A DataLoader worker or fork-based pool inherits the open lock file and so its flock: with the owner SIGKILLed,
    the lock stayed held until the child exited. A forked child closes its copy (os.register_at_fork)."""
    import signal

    from hf_tapernorm.app.run_lock import RunLock

    folder = tmp_path / "run"
    ready, told = os.pipe()
    owner = os.fork()
    if owner == 0:  # the command: takes the lock, forks a worker, is killed
        try:
            RunLock(folder).acquire()
            if os.fork() == 0:  # the worker: lives on
                os.write(told, str(os.getpid()).encode())
                time.sleep(60)
                os._exit(0)
            time.sleep(60)
        finally:
            os._exit(1)
    worker = int(os.read(ready, 32))
    try:
        os.kill(owner, signal.SIGKILL)
        os.waitpid(owner, 0)
        taken = RunLock(folder)
        taken.acquire()  # while the worker lives
        assert json.loads((folder / LOCK_NAME).read_text())["pid"] == os.getpid()
        taken.release()
    finally:
        os.kill(worker, signal.SIGKILL)
        os.close(ready)
        os.close(told)


def test_eval_output_json_through_a_symbolic_link_loop_names_the_loop(workspace, tmp_path):
    """``eval --output_json lp/loop/r.json`` (``lp/loop -> loop``) said the folder 'does not exist; create it first'."""
    (tmp_path / "lp").mkdir()
    (tmp_path / "lp" / "loop").symlink_to("loop")
    result = tmp_path / "lp" / "loop" / "r.json"
    evaluate = ["eval", "--model_name_or_path", str(workspace / "llama"), "--output_json", str(result)]
    assert error_of(evaluate) == (
        f"hf-tapernorm eval: error: --output_json {result}: the symbolic link '{tmp_path / 'lp' / 'loop'}' on the way "
        "leads back into itself (a loop); fix or remove it"
    )
    assert os.listdir(tmp_path / "lp") == ["loop"]


# ============================================================================= a killed export_folded's leftover
def _marked_write_inside(folder: Path, pid: int) -> Path:
    """The ``.hf_tapernorm_writing-PID`` a killed (or running) export_folded(overwrite=True) has in ``folder``."""
    from hf_tapernorm._temporaries import WRITE_MARK

    container = folder / f".hf_tapernorm_writing-{pid}"
    container.mkdir(parents=True)
    (container / WRITE_MARK).write_text("")
    (container / "model.safetensors").write_bytes(b"half written")
    return container


def test_a_killed_export_folded_leftover_in_a_runs_export_is_no_users_file(tmp_path):
    """export_folded(RUN/folded, overwrite=True) killed mid-write left its marked ``.hf_tapernorm_writing-PID/`` in the
    run's export, and taper --resume and --overwrite refused its files as "files this command did not write": only
    another export_folded removed it. Now the run folder takes it for what it is (a killed write's, its writer gone),
    never a user's file, and deletes it as it deletes the other leftovers; a running writer's stays foreign."""
    run = tmp_path / "run"
    (run / "folded").mkdir(parents=True)
    (run / "folded" / "config.json").write_text("{}")
    (run / MANIFEST_NAME).write_text(json.dumps({"tool": "hf-tapernorm", "files": ["folded/config.json"]}))
    dead = _marked_write_inside(run / "folded", 2**22 + 54321)  # no such process
    folder = RunFolder(run, outputs=("folded/",))
    assert folder.foreign_files() == []
    assert folder.check(overwrite=False, resume=True, has_checkpoint=lambda: True) is False
    assert folder.check(overwrite=True, resume=False, has_checkpoint=lambda: True) is True
    folder.remove_partials()
    assert not dead.exists() and (run / "folded" / "config.json").is_file()
    live = _marked_write_inside(run / "folded", os.getppid())  # a running process's write
    assert folder.foreign_files() == [
        f"folded/{live.name}/.hf_tapernorm_write",
        f"folded/{live.name}/model.safetensors",
    ]


def test_fold_deletes_a_killed_export_folded_leftover_and_names_a_running_one(tmp_path):
    """fold --output_dir D --overwrite of an earlier export holding a killed export_folded's marked
    ``.hf_tapernorm_writing-PID/`` refused it as "files an export does not write", though push's advice was to export
    again. Now fold's check deletes it (export_folded does the same), and a running writer's is named."""
    from hf_tapernorm import export_folded, fold_model
    from hf_tapernorm._parsing import UsageError
    from hf_tapernorm._temporaries import process_command
    from hf_tapernorm.cli.commands import check_export_folder
    from tests.helpers import tapered

    export = export_folded(fold_model(tapered("gpt2", "all")), tmp_path / "export")
    listed = sorted(os.listdir(export))
    dead = _marked_write_inside(export, 2**22 + 54321)
    check_export_folder(export, overwrite=True)
    assert not dead.exists() and sorted(os.listdir(export)) == listed
    live = _marked_write_inside(export, os.getppid())
    with pytest.raises(UsageError) as refused:
        check_export_folder(export, overwrite=True)
    assert str(refused.value) == (
        f"output folder '{export}': another write of {export} is in progress (pid {os.getppid()}: "
        f"{process_command(os.getppid())}, through '{live.name}'; delete '{live}' only if process {os.getppid()} is "
        "not writing this export, its pid reused after a restart); wait for it to finish, or choose another "
        "--output_dir"
    )
