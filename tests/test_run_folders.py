"""Run and export folders: one command at a time in a folder (and a stale lock said to be stale), the disk a run
needs counted before it trains, and a resume refused early when its checkpoint lost a file or its name.

Each case checks the exit code, the first line of the error, and the files on disk.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import AutoModelForCausalLM

from hf_tapernorm.app.run_folder import LOCK_NAME, RunFolder, RunFolderError
from hf_tapernorm.app.run_lock import process_start_time
from hf_tapernorm.training.checkpoints import tapered_config_of
from tests.conftest import save_tiny_model
from tests.helpers import error_of, run_main, snapshot, taper_argv


@pytest.fixture(scope="module")
def run(workspace, tmp_path_factory) -> Path:
    """A finished 10-step run with distillation (the default recipe) and checkpoints every 3 steps, the last two
    kept (checkpoint-9, checkpoint-10): the cases edit copies of it."""
    out = tmp_path_factory.mktemp("run_folders") / "run"
    code, _, stderr = run_main(run_argv(workspace, out))
    assert code == 0, stderr
    assert (out / "checkpoint-10" / "distillation_teacher.safetensors").is_file()
    return out


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
    lock.write_text("")  # killed between creating the lock and writing it
    message = error_of(taper_argv(workspace, out, steps=5))
    assert f"its lock {lock} is unreadable; if no hf-tapernorm command is using the folder, the lock is stale: " in (
        message
    )
    assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]  # nothing written, the lock left as it was
    lock.unlink()  # what the message says to do
    assert run_main(fold_argv(run / "tapered", out))[0] == 0


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


def test_what_the_disk_check_counts_is_what_a_run_writes(workspace, run):
    """run_writes, part by part, against the files of a finished fp32 run: never more, and the same bytes up to
    file headers and the TaperNorm state (the tiny model's weights are few, so those weigh a few percent)."""
    from hf_tapernorm.app.preflight import run_writes

    model = AutoModelForCausalLM.from_pretrained(workspace / "llama")
    config = tapered_config_of(run / "checkpoint-10")
    writes = run_writes(model, SimpleNamespace(optim="adamw_torch"), config, dtype=None, baseline=False)
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
    gone = SimpleNamespace(**{**vars(config), "distill_until": "taper_end"})  # the teacher is released at g = 0
    assert "its distillation teacher" not in run_writes(model, SimpleNamespace(optim="sgd"), gone, dtype=None,
                                                        baseline=False)  # fmt: skip


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
        "it from a copy, or start over with --overwrite"
    )
    assert snapshot(folder) == before


def test_resume_refuses_a_truncated_trainer_state_before_loading_anything(workspace, run, tmp_path, monkeypatch):
    folder = copy_of(run, tmp_path)
    state = folder / "checkpoint-10" / "trainer_state.json"
    state.write_text(state.read_text()[:40])
    before = snapshot(folder)
    no_loading(monkeypatch, "load_tokenizer")
    message = error_of([*run_argv(workspace, folder), "--resume"])
    assert message.startswith(f"hf-tapernorm taper: error: --resume: cannot read {state} (JSONDecodeError: ")
    assert message.endswith("truncated or damaged); restore it from a copy, or start over with --overwrite")
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
