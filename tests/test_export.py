"""export_folded (overwrite protection, model card, the tokenizer, use_cache, fine-tuning a sink export) and
push_to_hub at the huggingface_hub client boundary."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import numpy
import pytest
import torch
from huggingface_hub import HfApi
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from hf_tapernorm import ConfigurationError, TaperStateError, export_folded, fold_model
from hf_tapernorm.evaluation.models import load_model, resolve_model
from hf_tapernorm.export.hub import files_to_push
from hf_tapernorm.export.manifest import export_manifest
from tests.conftest import build, tiny_llama_config
from tests.helpers import TEXT, relative, sink_tapered, tapered, with_sink, word_tokenizer


@pytest.fixture(scope="module")
def folded():
    return fold_model(tapered("gpt2", "all"))


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_export_refuses_a_non_empty_folder_without_overwrite(folded, tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(
        ConfigurationError, match=rf"{tmp_path} is not empty; choose a new folder or pass overwrite=True"
    ):
        export_folded(folded, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    export_folded(folded, tmp_path / "out", facts={"base_model": "openai-community/gpt2"})
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        ".hf_tapernorm_export.json",
        "README.md",
        "config.json",
        "folded_input.py",
        "folded_sink.py",
        "generation_config.json",
        "model.safetensors",
        "modeling_folded.py",
    ]
    assert export_manifest(tmp_path / "out") == [
        "README.md",
        "config.json",
        "folded_input.py",
        "folded_sink.py",
        "generation_config.json",
        "model.safetensors",
        "modeling_folded.py",
    ]
    assert "base_model: openai-community/gpt2" in (tmp_path / "out" / "README.md").read_text()
    with pytest.raises(ConfigurationError, match="it is a file"):
        export_folded(folded, tmp_path / "notes.txt")


def _user_folder(folder: Path) -> dict[str, bytes]:
    folder.mkdir()
    (folder / "README.md").write_text("# my notes\n")
    (folder / "generation_config.json").write_text('{"temperature": 0.3}\n')
    return _files(folder)


def test_export_folded_overwrite_refuses_a_folder_that_is_not_an_export(folded, tmp_path):
    """overwrite=True replaced a user's README.md and generation_config.json without a word (only a folder holding
    a non-export config.json was refused); now, as fold --overwrite, it replaces only an earlier export."""
    before = _user_folder(tmp_path / "mine")
    with pytest.raises(ConfigurationError) as caught:
        export_folded(folded, tmp_path / "mine", overwrite=True)
    assert str(caught.value) == (
        f"refusing overwrite=True of {tmp_path / 'mine'}: it is not an earlier export (no .hf_tapernorm_export.json), "
        "and overwrite=True replaces only one; choose a new folder"
    )
    assert _files(tmp_path / "mine") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


@pytest.mark.parametrize("name", ["notes.txt", ".hf_tapernorm_notes.txt", ".hf_tapernorm_run.lock"])
def test_export_folded_overwrite_refuses_a_users_file_a_bookkeeping_look_alike_or_a_commands_lock(
    folded, tmp_path, name
):
    """An earlier export is replaced whole, so a file of the user's in it would go with it: it is named, kept. A
    user's file named like the package's bookkeeping went with the earlier export, and a running fold's lock was
    swapped away under it: every bookkeeping name but the manifest is named as no file of the export now."""
    export = export_folded(folded, tmp_path / "export")
    (export / name).write_text("mine")
    before = _files(export)
    with pytest.raises(ConfigurationError) as caught:
        export_folded(folded, export, overwrite=True)
    assert str(caught.value) == (
        f"refusing overwrite=True of {export}: it holds files the export did not write ({name}), which would stay "
        "beside the new export's (a replacement deletes only the files of the earlier one's manifest), and push "
        "refuses an export mixed with other files; move them away first"
    )
    assert _files(export) == before and (export / name).read_text() == "mine"


@pytest.mark.parametrize("leftover", ["", json.dumps({"pid": 2**22 + 12345, "host": socket.gethostname()})])
def test_export_folded_into_a_folder_holding_only_a_killed_commands_lock_writes_the_export(
    folded, tmp_path, caplog, leftover
):
    """A fold killed once it had taken its lock leaves a folder holding only that lock (empty, or naming a process
    that is gone); export_folded called it "not empty" (overwrite=True: "not an earlier export"), where fold takes it
    over and writes. The stale lock is deleted, as fold's taking it over would, with a WARNING; the export written."""
    from hf_tapernorm.export.manifest import LOCK_NAME

    folder = tmp_path / "killed"
    folder.mkdir()
    (folder / LOCK_NAME).write_text(leftover)
    with caplog.at_level(logging.WARNING, logger="hf_tapernorm"):
        assert export_folded(folded, folder) == folder
    assert (folder / "model.safetensors").is_file() and not (folder / LOCK_NAME).exists()
    assert f"deleted the lock {folder / LOCK_NAME}, left by a command that is gone: " in caplog.text


def test_export_folded_inside_a_folder_a_running_command_holds_is_refused_but_not_inside_its_own(folded, tmp_path):
    """export_folded looked only at its own folder's lock: into a subfolder of a running taper's run folder it wrote
    without a word, where every command refuses (refuse_while_running). It judges the folders above as they do; a
    lock this process holds (a taper run writing its own folded/) is its own command's, and not refused."""
    from hf_tapernorm.app.run_lock import RunLock
    from hf_tapernorm.export.manifest import LOCK_NAME

    live = tmp_path / "live"
    live.mkdir()
    (live / LOCK_NAME).write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname()}))
    with pytest.raises(ConfigurationError) as refusal:
        export_folded(folded, live / "sub" / "export")
    assert str(refusal.value) == (
        f"cannot export into {live / 'sub' / 'export'}: it lies in '{live}', which a running hf-tapernorm command "
        f"owns (pid {os.getppid()} on host {socket.gethostname()}; if no hf-tapernorm command runs as pid "
        f"{os.getppid()} on {socket.gethostname()} (it was killed, its container or pod restarted, or the folder was "
        f"copied), the lock is stale: delete {live / LOCK_NAME}); wait for it to finish, or choose a folder outside it"
    )
    assert sorted(p.name for p in live.iterdir()) == [LOCK_NAME]
    own = RunLock(tmp_path / "run")
    own.acquire()
    try:
        assert export_folded(folded, tmp_path / "run" / "folded") == tmp_path / "run" / "folded"
    finally:
        own.release()


def test_export_folded_overwrite_refuses_an_export_whose_card_was_edited(folded, tmp_path):
    """overwrite=True replaced a README.md card its owner had edited without a word; now the edited card (its sha256
    is not the manifest's) is refused in one line, the export left as it was. Moved aside or deleted, the export is
    replaced; an export whose manifest has no digest of its card (an earlier version's) is replaced as before; and
    push's check of the files still takes an edited card (the card is prose its owner edits before a push)."""
    from hf_tapernorm.export.manifest import DIGESTS_KEY, EXPORT_MANIFEST_NAME, check_export_files

    export = export_folded(folded, tmp_path / "export")
    (export / "README.md").write_text("# my card\n")
    check_export_files(export)  # push takes it
    before = _files(export)
    with pytest.raises(ConfigurationError) as caught:
        export_folded(folded, export, overwrite=True)
    assert str(caught.value) == (
        f"refusing overwrite=True of {export}: its README.md was edited after the export wrote it (its sha256 is not "
        "the one .hf_tapernorm_export.json recorded), and replacing the export would lose the edits; move README.md "
        "out of the folder to keep it, or delete it to let the export be replaced"
    )
    assert _files(export) == before
    (export / "README.md").unlink()
    export_folded(folded, export, overwrite=True)
    assert (export / "README.md").read_text() != "# my card\n"
    manifest = json.loads((export / EXPORT_MANIFEST_NAME).read_text())
    del manifest[DIGESTS_KEY]["README.md"]  # as an export written before the card's digest was checked
    (export / EXPORT_MANIFEST_NAME).write_text(json.dumps(manifest))
    (export / "README.md").write_text("# my card\n")
    export_folded(folded, export, overwrite=True)
    assert (export / "README.md").read_text() != "# my card\n"


def test_export_folded_overwrite_refuses_an_export_whose_generation_config_was_edited(folded, tmp_path):
    """overwrite=True replaced a generation_config.json its owner had edited (sampling defaults: do_sample,
    temperature) with only a WARNING, where an edited card is refused; now the generation defaults are its owner's to
    edit as the card is: the replacement is refused in one line naming the file, and the export left byte for byte.
    With the card edited too, both are named in the same words."""
    export = export_folded(folded, tmp_path / "export")
    config = json.loads((export / "generation_config.json").read_text())
    (export / "generation_config.json").write_text(json.dumps({**config, "do_sample": True, "temperature": 0.7}))
    before = _files(export)
    with pytest.raises(ConfigurationError) as caught:
        export_folded(folded, export, overwrite=True)
    assert str(caught.value) == (
        f"refusing overwrite=True of {export}: its generation_config.json was edited after the export wrote it (its "
        "sha256 is not the one .hf_tapernorm_export.json recorded), and replacing the export would lose the edits; "
        "move generation_config.json out of the folder to keep it, or delete it to let the export be replaced"
    )
    assert _files(export) == before
    (export / "README.md").write_text("# my card\n")
    with pytest.raises(ConfigurationError) as caught:
        export_folded(folded, export, overwrite=True)
    assert str(caught.value) == (
        f"refusing overwrite=True of {export}: its README.md and generation_config.json were edited after the export "
        "wrote them (their sha256 are not the ones .hf_tapernorm_export.json recorded), and replacing the export "
        "would lose the edits; move README.md and generation_config.json out of the folder to keep them, or delete "
        "them to let the export be replaced"
    )


def test_export_folded_overwrite_takes_a_killed_commands_lock_for_bookkeeping_not_a_users_file(folded, tmp_path):
    """A push killed mid-upload leaves its run lock (no process holds it) in the export; export_folded(overwrite=True)
    refused it as a file "the export did not write ... push refuses an export mixed with other files", though push
    and fold --overwrite take such a lock over. A lock no one holds is the package's own: the export is replaced.
    export_folded judges it as the lock's own taker does (one reader): an empty lock (its command killed as it took
    it) and one whose pid now names another process (another start time) are left over too, as fold takes them."""

    from hf_tapernorm.app.run_lock import process_start_time
    from hf_tapernorm.export.manifest import LOCK_NAME

    export = export_folded(folded, tmp_path / "export")
    record = {"pid": 2**22 + 12345, "host": socket.gethostname(), "command": "push"}
    reused = {"pid": os.getpid(), "host": socket.gethostname(), "started": (process_start_time(os.getpid()) or 0) + 1}
    for leftover in (json.dumps(record) + "\n", "", json.dumps(reused)):
        (export / LOCK_NAME).write_text(leftover)
        assert export_folded(folded, export, overwrite=True) == export
        assert (export / "model.safetensors").is_file() and not (export / LOCK_NAME).exists()  # not left in it
    for other in ({**record, "pid": os.getpid()}, {**record, "host": "another-host"}):  # may run: not a leftover
        (export / LOCK_NAME).write_text(json.dumps(other) + "\n")
        with pytest.raises(
            ConfigurationError, match=r"holds files the export did not write \(\.hf_tapernorm_run\.lock\)"
        ):
            export_folded(folded, export, overwrite=True)


@pytest.mark.parametrize("failure", ["OSError", "SafetensorError"])
def test_export_folded_onto_a_full_disk_says_so_naming_the_folder(folded, tmp_path, monkeypatch, failure):
    """export_folded onto a full disk raised "could not write the export E: [Errno 27] File too large:
    '.../hf_tapernorm/export/modeling_folded.py' -> '.E.export-PID/new/...'" (the package's source and a temporary
    name), or safetensors' bare SafetensorError. It is one ConfigurationError naming the folder and the disk."""
    import errno

    from safetensors import SafetensorError

    import hf_tapernorm.export.writing as writing

    def full(folder, model, tokenizer):
        if failure == "OSError":
            raise OSError(errno.EFBIG, "File too large", str(folder / "modeling_folded.py"))
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(writing, "_write_export", full)
    with pytest.raises(ConfigurationError) as caught:
        export_folded(folded, tmp_path / "export")
    reason = (
        "OSError: [Errno 27] File too large"
        if failure == "OSError"
        else "SafetensorError: Error while serializing: I/O error: No space left on device (os error 28)"
    )
    assert str(caught.value) == (
        f"could not write the export {tmp_path / 'export'}: its disk is full or a file-size limit was reached "
        f"({reason}); nothing was written: free space, or choose a folder on another disk"
    )
    assert not (tmp_path / "export").exists()


def test_export_folded_through_a_link_names_a_live_write_beside_its_target(folded, tmp_path):
    """``export_folded(m, LINK, overwrite=True)`` with a live ``.Y.export-PID`` beside LINK's target Y went ahead:
    the check looked beside LINK only. Beside the target is looked at too."""

    from hf_tapernorm._temporaries import WRITE_MARK

    target = export_folded(folded, tmp_path / "y")
    (tmp_path / "link").symlink_to(target, target_is_directory=True)
    live = tmp_path / f".y.export-{os.getppid()}"
    live.mkdir()
    (live / WRITE_MARK).write_text("")
    with pytest.raises(ConfigurationError, match=r"another write of .*y is in progress"):
        export_folded(folded, tmp_path / "link", overwrite=True)


def test_export_folded_overwrite_deletes_a_killed_replacements_leftover_and_keeps_a_live_ones(folded, tmp_path):
    """A killed export_folded(overwrite=True) left its hidden ``.NAME.export-*`` folder (a random name, no mark)
    beside the export, and nothing ever deleted it; now it is ``.NAME.export-PID``, marked before anything goes in
    (as write_folder marks its own), and the next replacement deletes it once its writer is gone. A look-alike
    without the mark stays; a live writer's is a write in progress, refused (its rename would fail, or replace this
    export); one under this write's own name that is no leftover is refused."""

    from hf_tapernorm._temporaries import WRITE_MARK, process_command

    export = export_folded(folded, tmp_path / "export")
    dead, alive = 2**22 + 54321, os.getppid()  # no such process; this test's parent
    for name in (f".export.export-{dead}", f".export.export-{alive}", f".export.export-{dead + 1}"):
        (tmp_path / name / "new").mkdir(parents=True)
        (tmp_path / name / "new" / "config.json").write_text("{}")
        if name != f".export.export-{dead + 1}":  # the look-alike carries no mark
            (tmp_path / name / WRITE_MARK).write_text("")
    live = tmp_path / f".export.export-{alive}"
    with pytest.raises(ConfigurationError) as caught:
        export_folded(folded, export, overwrite=True)
    assert str(caught.value) == (
        f"cannot export into {export}: another write of {export} is in progress (pid {alive}: "
        f"{process_command(alive)}, through '{live.name}'; delete '{live}' only if process {alive} is not writing "
        "this export, its pid reused after a restart); wait for it to finish, or choose a new folder"
    )
    shutil.rmtree(live)
    export_folded(folded, export, overwrite=True)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([f".export.export-{dead + 1}", "export"]), left
    (tmp_path / f".fresh.export-{os.getpid()}").mkdir()  # unmarked, under the name a new folder's write needs
    with pytest.raises(ConfigurationError) as caught:
        export_folded(folded, tmp_path / "fresh")
    assert str(caught.value) == (
        f"could not write the export {tmp_path / 'fresh'}: '{tmp_path / f'.fresh.export-{os.getpid()}'}' is in the "
        "way (hf-tapernorm writes through that name, and this one is no leftover of a write that is gone); nothing "
        "was written: move it away, then export again"
    )
    assert not (tmp_path / "fresh").exists()
    (export / f".hf_tapernorm_writing-{os.getpid()}").mkdir()  # unmarked, where a replacement writes (inside)
    before = _files(export)
    with pytest.raises(ConfigurationError, match=rf"\(\.hf_tapernorm_writing-{os.getpid()}\), which would stay"):
        export_folded(folded, export, overwrite=True)
    assert _files(export) == before


def test_export_folded_overwrite_replaces_an_earlier_export_whole(folded, tmp_path):
    """overwrite=True left the earlier export's tokenizer files and robustness_scan.json beside the new export and
    in its manifest, so push uploaded them as the new export's; now the earlier export is replaced whole (written
    beside, then swapped, as fold --overwrite does), and nothing of the write is left beside it."""
    from hf_tapernorm.export.hub import files_to_push
    from hf_tapernorm.export.manifest import recording_export

    earlier = export_folded(fold_model(sink_tapered("llama")), tmp_path / "export", tokenizer=word_tokenizer(True))
    with recording_export(earlier):
        (earlier / "robustness_scan.json").write_text("{}\n")
    assert {"tokenizer.json", "tokenizer_config.json", "robustness_scan.json"} <= set(export_manifest(earlier))
    fresh = export_folded(folded, tmp_path / "fresh")
    export_folded(folded, earlier, overwrite=True)
    assert export_manifest(earlier) == export_manifest(fresh)
    assert files_to_push(earlier) == export_manifest(fresh)
    assert sorted(p.name for p in earlier.iterdir()) == sorted(p.name for p in fresh.iterdir())
    assert json.loads((earlier / "config.json").read_text())["model_type"] == "tapernorm_gpt2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "fresh"]  # no .export.export-* left


class _Killed(BaseException):
    """A kill: raised inside the write, with the write's own cleanup switched off (SIGKILL runs none)."""


def test_a_killed_fresh_export_leaves_a_leftover_the_next_export_deletes_not_a_half_export(
    folded, tmp_path, monkeypatch
):
    """export_folded into a new folder, killed after the weights and before the tokenizer, left a half export (no
    tokenizer, no manifest) under its final name, which export_folded(overwrite=True) then refused as "not an earlier
    export". Now a fresh export is written in the hidden ``.NAME.export-PID`` folder and renamed when complete: the
    kill leaves only that leftover, which the next export (overwrite or not) deletes."""

    from hf_tapernorm.export import writing

    tokenizer = word_tokenizer(False)
    with monkeypatch.context() as patched:
        patched.setattr(type(tokenizer), "save_pretrained", mock.Mock(side_effect=_Killed))
        patched.setattr(writing, "shutil", SimpleNamespace(rmtree=lambda *a, **k: None))
        with pytest.raises(_Killed):
            export_folded(folded, tmp_path / "exp", tokenizer=tokenizer)
    leftover = f".exp.export-{os.getpid()}"
    assert sorted(p.name for p in tmp_path.iterdir()) == [leftover]
    assert (tmp_path / leftover / "new" / "model.safetensors").is_file()
    export_folded(folded, tmp_path / "exp", tokenizer=tokenizer, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp"]
    assert {"tokenizer.json", "model.safetensors"} <= set(export_manifest(tmp_path / "exp"))


def test_an_export_into_an_existing_empty_folder_keeps_the_folder_its_group_and_a_link(folded, tmp_path):
    """An existing empty folder was replaced by a new one (a rename onto it): its inode, owner, setgid group and ACLs
    were lost, the files got the writer's group, and a shell sitting in it was left in a deleted folder. Now the
    export is written inside it (through a hidden ``.hf_tapernorm_writing-PID`` there, moved up when complete): the
    folder stays, with its group, which its files take; a link to an empty folder is written through, kept."""

    empty = tmp_path / "empty"
    empty.mkdir()
    if os.geteuid() == 0:
        group = 54321  # root may give a folder any group
    else:
        group = next((g for g in os.getgroups() if g != os.getegid()), None)
        if group is None:
            pytest.skip("needs root or a second group to give the folder")
    os.chown(empty, -1, group)
    empty.chmod(0o2750)  # a shared folder: its files take its group
    before = empty.stat()
    export_folded(folded, empty)
    after = empty.stat()
    assert (after.st_ino, after.st_gid, after.st_mode & 0o7777) == (before.st_ino, group, 0o2750)
    assert {p.stat().st_gid for p in empty.iterdir()} == {group}
    assert set(export_manifest(empty)) == {p.name for p in empty.iterdir()} - {".hf_tapernorm_export.json"}
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    export_folded(folded, tmp_path / "link")
    assert (tmp_path / "link").is_symlink() and (tmp_path / "target" / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "link", "target"]
    assert not [p for p in (tmp_path / "target").iterdir() if p.name.startswith(".hf_tapernorm_writing")]


@pytest.mark.parametrize("earlier, kill", [(False, SystemExit), (True, KeyboardInterrupt)])
def test_a_kill_mid_move_in_the_working_folder_leaves_an_export_overwrite_replaces(
    folded, tmp_path, monkeypatch, earlier, kill
):
    """export_folded into the working folder (written in place) killed after the weights left a half export (no
    tokenizer, no manifest) that a retry with overwrite=True refused as "not an earlier export", and overwrite=True of
    the working folder was refused outright. Now the export is written in a marked ``.hf_tapernorm_writing-PID``
    inside it and moved up manifest first: a kill mid-move (a SIGKILL: the hidden folder stays) leaves an incomplete
    export, which push refuses, and the retry with overwrite=True deletes the leftover and replaces it, in place."""

    from hf_tapernorm.export import writing
    from hf_tapernorm.export.hub import files_to_push

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    inode, fresh = work.stat().st_ino, export_folded(folded, tmp_path / "fresh")
    if earlier:
        export_folded(fold_model(sink_tapered("llama")), ".", tokenizer=word_tokenizer(True))
    container, real_replace, moved = f".hf_tapernorm_writing-{os.getpid()}", os.replace, []

    def replace_then_die(source, destination):
        if Path(source).parent.name == container:
            moved.append(Path(source).name)
            if len(moved) > 1:
                raise kill()
        real_replace(source, destination)

    with monkeypatch.context() as patched:
        patched.setattr(os, "replace", replace_then_die)
        patched.setattr(writing, "shutil", SimpleNamespace(rmtree=lambda *a, **k: None))
        with pytest.raises(kill):
            export_folded(folded, ".", overwrite=earlier)
    assert moved[0] == ".hf_tapernorm_export.json" and (work / container).is_dir()
    assert export_manifest(work) == export_manifest(fresh)
    assert not (work / "tokenizer.json").exists()  # the earlier export's files went before the move
    with pytest.raises(ConfigurationError, match=rf"holds '{container}', the leftover of a killed write"):
        files_to_push(work)
    export_folded(folded, ".", overwrite=True)
    assert work.stat().st_ino == inode
    assert sorted(p.name for p in work.iterdir()) == sorted(p.name for p in fresh.iterdir())
    assert files_to_push(work) == export_manifest(fresh)


def test_every_export_deletes_a_killed_swaps_leftover_and_warns_of_the_export_in_it(folded, tmp_path, caplog):
    """export_folded(overwrite=True) killed between its two renames left ``.exp.export-PID/`` (the earlier export in
    old/, the new one in new/) and no exp/; the next export_folded(m, "exp") wrote exp/ but left the leftover beside
    it, as only the replacing path removed leftovers. Every write removes them now, and one that holds the earlier
    export while nothing is under its name is named in a WARNING (that export goes with it)."""

    from hf_tapernorm._temporaries import WRITE_MARK

    exp, leftover = tmp_path / "exp", tmp_path / f".exp.export-{2**22 + 54321}"  # no such process
    export_folded(folded, exp)
    leftover.mkdir()
    (leftover / WRITE_MARK).write_text("")
    os.replace(exp, leftover / "old")
    export_folded(folded, leftover / "new")
    with caplog.at_level(logging.WARNING, logger="hf_tapernorm.export.writing"):
        export_folded(folded, exp)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp"]
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        f"deleting '{leftover}', left by an export_folded(overwrite=True) of {exp} killed before it renamed its new "
        "export into place: it held the earlier export (old/), which the new one written now replaces"
    ]


def test_export_refuses_an_unfolded_model(tmp_path):
    model = tapered("llama")
    with pytest.raises(
        TaperStateError, match="export_folded expects a folded model from fold_model, got LlamaForCausalLM"
    ):
        export_folded(model, tmp_path / "out")


def test_export_into_the_home_of_a_user_this_machine_does_not_have_is_one_line(folded, tmp_path, monkeypatch):
    """export_folded(model, "~nosuchuser/x") raised Path.expanduser's bare "RuntimeError: Could not determine home
    directory."."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigurationError) as refused:
        export_folded(folded, "~nosuchuser/x")
    assert str(refused.value) == (
        "export_folded: save_directory '~nosuchuser/x': there is no user 'nosuchuser' on this machine, so "
        "'~nosuchuser' names no home folder; write the path in full, or start it with ~/ for your own home folder"
    )
    assert list(tmp_path.iterdir()) == []


def test_push_to_hub_uploads_exactly_the_export(folded, tmp_path):
    facts = {"base_model": "openai-community/gpt2", "repo_id": "me/gpt2-normfree", "license": "mit"}
    local = _files(export_folded(folded, tmp_path / "local", facts=facts))  # attaches the card to the model
    del local[".hf_tapernorm_export.json"]  # the export's own list of its files, not a file of the model
    uploaded = {}

    def upload_folder(self, *, repo_id, folder_path, **kwargs):
        uploaded.update(repo_id=repo_id, files=_files(Path(folder_path)), **kwargs)
        return "commit-info"

    create_repo = mock.Mock(return_value=SimpleNamespace(repo_id="me/gpt2-normfree"))
    with mock.patch.object(HfApi, "create_repo", create_repo), mock.patch.object(HfApi, "upload_folder", upload_folder):
        result = folded.push_to_hub("me/gpt2-normfree", private=True, commit_message="norm-free GPT-2")
    assert result == "commit-info"
    create_repo.assert_called_once_with("me/gpt2-normfree", private=True, exist_ok=True, repo_type="model")
    assert uploaded["repo_id"] == "me/gpt2-normfree" and uploaded["commit_message"] == "norm-free GPT-2"
    assert uploaded["create_pr"] is False and uploaded["revision"] is None
    assert (
        sorted(uploaded["files"])
        == sorted(local)
        == [
            "README.md",
            "config.json",
            "folded_input.py",
            "folded_sink.py",
            "generation_config.json",
            "model.safetensors",
            "modeling_folded.py",
        ]
    )
    for name, content in local.items():
        assert uploaded["files"][name] == content, name
    assert "base_model: openai-community/gpt2" in uploaded["files"]["README.md"].decode()


@pytest.mark.parametrize("first", ["hf_tapernorm", "transformers"])
def test_an_export_loads_through_the_auto_classes_in_a_fresh_process(folded, tmp_path, first):
    """``import hf_tapernorm`` registers the folded types lazily, whichever of the two is imported first."""
    import subprocess
    import sys

    folder = export_folded(folded, tmp_path / "out")
    imports = {
        "hf_tapernorm": "import hf_tapernorm\nfrom transformers import AutoModelForCausalLM",
        "transformers": "from transformers import AutoModelForCausalLM\nimport hf_tapernorm",
    }[first]
    code = f"{imports}\nmodel = AutoModelForCausalLM.from_pretrained({str(folder)!r})\nprint(type(model).__name__)\n"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-W", "error::UserWarning", "-c", code], capture_output=True, text=True,
                          env=env, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == type(folded).__name__


# ============================================================================= a sink export and its users
def test_export_folded_writes_the_tokenizer_into_the_manifest_and_says_how_a_leading_sink_is_read(tmp_path, caplog):
    model = sink_tapered("llama")
    folded = fold_model(model)
    tokenizer = word_tokenizer(adds_bos=True)
    with caplog.at_level(logging.INFO, logger="hf_tapernorm.export.writing"):
        folder = export_folded(folded, tmp_path / "out", tokenizer=tokenizer)
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(export_manifest(folder))
    messages = [r for r in caplog.records if "adds the sink token(s)" in r.getMessage()]
    assert [r.levelno for r in messages] == [logging.INFO]
    assert "the same logits" in messages[0].getMessage()
    # What the message says holds: with and without the tokenizer's BOS, the text's logits agree.
    reloaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    loaded_tokenizer = AutoTokenizer.from_pretrained(folder)
    text = "the quick brown fox jumps over a lazy dog"
    with torch.no_grad():
        with_bos = reloaded(**loaded_tokenizer(text, return_tensors="pt")).logits
        without = reloaded(**loaded_tokenizer(text, return_tensors="pt", add_special_tokens=False)).logits
    assert relative(without, with_bos[:, 1:]) <= 1e-6


def test_export_folded_refuses_a_tokenizer_that_is_not_one(tmp_path):
    from hf_tapernorm import ConfigurationError

    folded = fold_model(sink_tapered("llama"))
    with pytest.raises(ConfigurationError, match="tokenizer= must be a transformers tokenizer"):
        export_folded(folded, tmp_path / "out", tokenizer="gpt2")
    assert not (tmp_path / "out").exists()


def test_export_folded_refuses_a_model_as_its_tokenizer_before_anything_is_written(tmp_path):
    """export_folded(folded, out, tokenizer=plain_model) took the model (it has save_pretrained): its config.json and
    model.safetensors overwrote the export's, which then reloaded as the plain, unfolded model under a card and a
    manifest of a folded one. Only a transformers tokenizer or processor is taken now, checked before writing."""
    with pytest.raises(ConfigurationError) as caught:
        export_folded(fold_model(sink_tapered("llama")), tmp_path / "out", tokenizer=build(tiny_llama_config()))
    assert str(caught.value) == (
        "export_folded: tokenizer= must be a transformers tokenizer or processor, got the model LlamaForCausalLM, "
        "whose save_pretrained would write its own config.json and weights over the ones saved: pass the model's "
        "tokenizer (AutoTokenizer.from_pretrained(name))"
    )
    assert list(tmp_path.iterdir()) == []


def test_the_export_restores_use_cache_that_a_trainer_turned_off(tmp_path):
    model = sink_tapered("llama")
    model.config.use_cache = False  # what Trainer leaves on a model it trained with gradient checkpointing
    folder = export_folded(fold_model(model), tmp_path / "out")
    assert json.loads((folder / "config.json").read_text())["use_cache"] is True
    reloaded = AutoModelForCausalLM.from_pretrained(folder)
    assert reloaded(input_ids=TEXT).cache is not None


def test_fine_tuning_a_sink_export_with_gradient_checkpointing_matches_without(tmp_path):
    folded = fold_model(sink_tapered("llama"))
    folded.train()
    labels = with_sink(TEXT)
    plain = folded(input_ids=labels, labels=labels)
    plain.loss.backward()
    grads = {n: p.grad.clone() for n, p in folded.named_parameters() if p.grad is not None}
    folded.zero_grad()
    folded.gradient_checkpointing_enable()
    checkpointed = folded(input_ids=labels, labels=labels)
    checkpointed.loss.backward()
    assert torch.allclose(checkpointed.loss, plain.loss, atol=1e-6)
    assert all(torch.allclose(p.grad, grads[n], atol=1e-6) for n, p in folded.named_parameters() if n in grads)
    with pytest.raises(ValueError, match="a cache cannot be passed while training with gradient checkpointing"):
        folded(input_ids=labels, cache=DynamicCache(config=folded.config))


def _users_folder(folder: Path) -> dict[str, bytes]:
    folder.mkdir()
    (folder / "README.md").write_text("MINE")
    (folder / "config.json").write_text('{"mine": 1}')
    return _files(folder)


def test_export_folded_refuses_a_dotdot_after_a_missing_folder_before_creating_it(folded, tmp_path, monkeypatch):
    """export_folded(m, "DIR/nothere/..") (DIR a user's folder) created nothere/ and wrote into DIR, replacing its
    README.md and config.json: the non-empty check looked at a folder that did not exist. Likewise "new/.." from a
    non-empty working folder. Now both are refused, as fold --output_dir refuses them, before anything is created."""
    mine = tmp_path / "mine"
    before = _users_folder(mine)
    with pytest.raises(ConfigurationError) as refused:
        export_folded(folded, mine / "nothere" / "..")
    assert str(refused.value) == (
        f"export_folded: save_directory '{mine / 'nothere' / '..'}': '{mine / 'nothere'}' does not exist, so the "
        f"'..' after it names no folder; name the folder without '..' ('{mine}')"
    )
    monkeypatch.chdir(mine)
    with pytest.raises(ConfigurationError, match=r"^export_folded: save_directory 'new/..': 'new' does not exist"):
        export_folded(folded, "new/..")
    assert _files(mine) == before and sorted(p.name for p in mine.iterdir()) == ["README.md", "config.json"]


def test_export_folded_names_a_link_to_a_missing_folder_before_writing(folded, tmp_path, monkeypatch):
    """export_folded(m, "dl"), dl a symbolic link to a folder that does not exist: the whole export was written
    beside and the rename failed at the end, "[Errno 20] Not a directory: '.dl.export-PID/new' -> 'dl'". Now it is
    refused before anything is written, saying that dl is a link to a missing folder; nothing is left beside."""
    monkeypatch.chdir(tmp_path)
    Path("dl").symlink_to("nothere")
    with pytest.raises(ConfigurationError) as refused:
        export_folded(folded, "dl")
    assert str(refused.value) == (
        "cannot export into dl: 'dl' is a link to a folder that does not exist ('nothere'); create that folder, or "
        "choose another"
    )
    assert [p.name for p in tmp_path.iterdir()] == ["dl"]


def test_export_folded_names_a_write_in_progress_in_the_folder(folded, tmp_path):
    """A live export_folded writing into D (its marked ``.hf_tapernorm_writing-PID`` there), then export_folded(D):
    refused as "not empty", and with overwrite=True as "not an earlier export": the live write was never named. Now
    both say another write of D is in progress, with its pid; nothing is touched."""

    from hf_tapernorm._temporaries import WRITE_MARK, process_command

    target, pid = tmp_path / "target", os.getppid()  # a running process
    (target / f".hf_tapernorm_writing-{pid}").mkdir(parents=True)
    (target / f".hf_tapernorm_writing-{pid}" / WRITE_MARK).write_text("")
    before = _files(target)
    for overwrite in (False, True):
        with pytest.raises(ConfigurationError) as refused:
            export_folded(folded, target, overwrite=overwrite)
        assert str(refused.value) == (
            f"cannot export into {target}: another write of {target} is in progress (pid {pid}: "
            f"{process_command(pid)}, through '.hf_tapernorm_writing-{pid}'; delete "
            f"'{target / f'.hf_tapernorm_writing-{pid}'}' only if process {pid} is not writing this export, its pid "
            "reused after a restart); wait for it to finish, or choose a new folder"
        )
    assert _files(target) == before


def test_export_folded_overwrite_warns_of_weights_changed_since_the_export(folded, tmp_path, caplog):
    """export_folded(overwrite=True) of an export whose model.safetensors its owner had saved over replaced it without
    a word (an edited card is refused, and push refuses such weights). It still replaces them, as asked, and names the
    changed files in a WARNING; an unchanged export is replaced without one."""
    export = export_folded(folded, tmp_path / "export")
    export_folded(folded, export, overwrite=True)
    weights = export / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="hf_tapernorm.export.manifest"):
        export_folded(folded, export, overwrite=True)
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        f"overwrite=True of {export} replaces model.safetensors, changed after the earlier export wrote it (the "
        "sha256 .hf_tapernorm_export.json recorded differs): copy it out of the folder first to keep the changes"
    ]
    assert weights.read_bytes() != bytes(data)


@pytest.mark.parametrize(
    "deleted", [["README.md"], ["generation_config.json"], ["README.md", "generation_config.json"]]
)
def test_an_export_lacking_only_files_loading_does_not_read_loads_with_a_warning(folded, tmp_path, caplog, deleted):
    """eval, bench and taper (resolve_model) refused an export whose only missing files were its README.md card or
    generation_config.json as "an incomplete export", though the model loads without them. It loads now, and a
    WARNING names them; push (files_to_push) still refuses them missing, saying that a file of the owner's may take
    their place."""
    export = export_folded(folded, tmp_path / "export")
    for name in deleted:
        (export / name).unlink()
    with caplog.at_level(logging.WARNING):
        source = resolve_model(str(export), option="--model_name_or_path")
    assert source.kind == "folded"
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        f"--model_name_or_path '{export}' lacks {', '.join(deleted)} of its export, which its manifest lists: it "
        f"loads without {'it' if len(deleted) == 1 else 'them'}, but push refuses it until it is exported again "
        "(hf-tapernorm fold --overwrite)"
    ]
    assert torch.equal(load_model(source).lm_head.weight, folded.lm_head.weight)
    with pytest.raises(ConfigurationError) as refusal:
        files_to_push(export)
    place = "its place" if len(deleted) == 1 else "their place"
    assert str(refusal.value) == (  # deleted by its owner: what may take its place is said
        f"'{export}' lacks {' and '.join(deleted)}, which its export wrote and push publishes with its weights (a copy "
        f"an earlier push left on the Hub would stay beside these); write your own in {place} (push uploads its "
        "owner's edits), or export it again with overwrite=True (hf-tapernorm fold --overwrite)"
    )
    for name in deleted:  # an owner's own file in its place is an owner's edit, pushed
        (export / name).write_text("{}" if name.endswith(".json") else "# my card\n")
    assert set(deleted) <= set(files_to_push(export))


def test_an_export_lacking_a_file_loading_reads_is_refused_by_its_option(folded, tmp_path):
    """An export missing a file loading reads (here config.json, beside its card) is still refused before loading,
    and the refusal names the option the path came from (it said "model '...'", whatever the option)."""
    export = export_folded(folded, tmp_path / "export")
    for name in ("README.md", "config.json"):
        (export / name).unlink()
    with pytest.raises(ConfigurationError) as caught:
        resolve_model(str(export), option="--scan_reference")
    assert str(caught.value) == (
        f"--scan_reference '{export}' is an incomplete export: it lacks files of its export (README.md, config.json), "
        "which its manifest lists (a write killed while it moved them into place, or files deleted since); export it "
        "again with overwrite=True (hf-tapernorm fold --overwrite)"
    )


def test_export_folded_refuses_unknown_facts_before_it_warns_of_what_it_replaces(folded, tmp_path, caplog):
    """``export_folded(overwrite=True, facts={"bogus_fact": 1})`` of an export whose weights changed warned "replaces
    model.safetensors" and then refused the facts: nothing was replaced. The card is rendered first now, so a refusal
    comes before the WARNING, and the export is as it was."""
    export = export_folded(folded, tmp_path / "exp")
    with (export / "model.safetensors").open("ab") as weights:
        weights.write(b"\0")  # changed after the export wrote it
    before = (export / "model.safetensors").read_bytes()
    with caplog.at_level(logging.WARNING), pytest.raises(ValueError, match="bogus_fact"):
        export_folded(folded, export, overwrite=True, facts={"bogus_fact": 1})
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert (export / "model.safetensors").read_bytes() == before


def test_export_folded_names_a_link_to_a_missing_folder_above_it(folded, tmp_path):
    """``export_folded(m, "dl/sub")``, dl a link to a folder that does not exist, raised FileExistsError; only a link
    that was the folder itself was named. A link anywhere above it is named now, before anything is written."""
    (tmp_path / "dl").symlink_to(tmp_path / "nothere")
    with pytest.raises(ConfigurationError) as caught:
        export_folded(folded, tmp_path / "dl" / "sub")
    assert str(caught.value) == (
        f"cannot export into {tmp_path / 'dl' / 'sub'}: '{tmp_path / 'dl'}' is a link to a folder that does not exist "
        f"('{tmp_path / 'nothere'}'); create that folder, or choose another"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dl"]


def test_export_folded_overwrite_of_an_export_with_a_git_clone_says_why_it_refuses(folded, tmp_path):
    """An earlier export holding ``.git/`` and ``.gitattributes`` (a clone of the pushed repository) was refused
    "which replacing it would delete": no longer true, a replacement deletes only the files of the earlier
    manifest. The refusal stands (push refuses an export mixed with other files), with that reason."""
    export = export_folded(folded, tmp_path / "export")
    (export / ".git").mkdir()
    (export / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (export / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    before = _files(export)
    with pytest.raises(ConfigurationError) as refused:
        export_folded(folded, export, overwrite=True)
    assert str(refused.value) == (
        f"refusing overwrite=True of {export}: it holds files the export did not write (.git/HEAD, .gitattributes), "
        "which would stay beside the new export's (a replacement deletes only the files of the earlier one's "
        "manifest), and push refuses an export mixed with other files; move them away first"
    )
    assert _files(export) == before


_WRONG_FACTS = [
    ({"tags": "abc"}, "model card facts of the wrong type: 'tags' takes a list of str, got str"),
    ({"tags": ["ok", 1]}, "model card facts of the wrong type: 'tags' takes a list of str, got a list holding int"),
    ({"schedule": "abc"}, "model card facts of the wrong type: 'schedule' takes a mapping, got str"),
    (
        {"robustness_scan": "bogus", "tokens": True},
        "model card facts of the wrong type: 'robustness_scan' takes a mapping (ScanResult.to_dict()), got str; "
        "'tokens' takes an int or a str, got bool",
    ),
    (
        {"eval_loss": {"heldout": {"before": 2.0, "after": 2.1}}},
        "model card facts of the wrong type: 'eval_loss' takes a mapping of numbers or str, got a dict holding dict",
    ),
    (
        {"speed": {"a": True}, "eval_loss": {"b": 2.0, "c": torch.tensor([1.0, 2.0])}},
        "model card facts of the wrong type: 'speed' takes a mapping of numbers or str, got a dict holding bool; "
        "'eval_loss' takes a mapping of numbers or str, got a dict holding Tensor",
    ),
    (  # int() of a timedelta64 (a numpy integer) raised a TypeError
        {"speed": {"t": numpy.timedelta64(5, "s")}},
        "model card facts of the wrong type: 'speed' takes a mapping of numbers or str, got a dict holding timedelta64",
    ),
    (  # a sparse tensor of one element: reshape raised a RuntimeError; it holds the number 2.5, read as such
        {"eval_loss": {"h": torch.tensor([[2.5]]).to_sparse(), "x": numpy.datetime64("2026-01-01")}},
        "model card facts of the wrong type: 'eval_loss' takes a mapping of numbers or str, got a dict holding "
        "datetime64",
    ),
    (
        {1: 2},
        "unknown model card facts: 1; expected some of base_model, license, repo_id, model_name, dataset, tokens, "
        "schedule, eval_loss, speed, robustness_scan, tags, warning",
    ),
]


@pytest.mark.parametrize(("facts", "message"), _WRONG_FACTS)
def test_export_folded_refuses_facts_of_the_wrong_type_before_anything_is_written(
    folded, tmp_path, caplog, facts, message
):
    """``facts={"tags": "abc"}`` gave a card tagged a, b and c; ``{1: 2}``, ``{"schedule": "abc"}`` and
    ``{"robustness_scan": "bogus"}`` raised a bare TypeError or ValueError from inside the card's rendering; an
    eval_loss of nested mappings showed a dict in the card's table. Each fact's type is checked first now (eval_loss's
    and speed's values: numbers or str): one ConfigurationError names the facts and the types they take, before the
    WARNING of what an overwrite replaces, and nothing is written."""
    export = export_folded(folded, tmp_path / "exp")
    with (export / "model.safetensors").open("ab") as weights:
        weights.write(b"\0")  # changed after the export wrote it: a write that went ahead would warn
    before = _files(tmp_path)
    with caplog.at_level(logging.WARNING), pytest.raises(ConfigurationError) as refused:
        export_folded(folded, export, overwrite=True, facts=facts)
    assert str(refused.value) == message
    with pytest.raises(ConfigurationError) as refused_new:
        export_folded(folded, tmp_path / "new", facts=facts)
    assert str(refused_new.value) == message
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert _files(tmp_path) == before


def test_export_folded_takes_no_tags_as_none(folded, tmp_path):
    """``facts={"tags": None}`` raised "TypeError: Value after * must be an iterable"; None is a fact not given, as
    for every other fact: the card is the one without tags."""
    with_none = export_folded(folded, tmp_path / "none", facts={"base_model": "org/model", "tags": None})
    without = export_folded(folded, tmp_path / "without", facts={"base_model": "org/model"})
    assert (with_none / "README.md").read_text() == (without / "README.md").read_text()


@pytest.mark.parametrize("overwrite", ["no", 0, None])
def test_export_folded_refuses_an_overwrite_that_is_not_a_bool(folded, tmp_path, overwrite):
    """``export_folded(m, EXPORT, overwrite="no")`` replaced the export ("no" is a true string). An ``overwrite``
    that is not True or False is refused now, in one line naming it, and the export is as it was."""
    export = export_folded(folded, tmp_path / "exp")
    before = _files(tmp_path)
    with pytest.raises(ConfigurationError) as refused:
        export_folded(folded, export, overwrite=overwrite)
    assert str(refused.value) == (f"export_folded: overwrite= must be True or False, got {type(overwrite).__name__}")
    assert _files(tmp_path) == before


@pytest.mark.parametrize(("overwrite", "name"), [(numpy.int64(1), "numpy.int64"), (torch.tensor(1), "torch.Tensor")])
def test_export_folded_names_the_type_of_an_overwrite_that_is_not_a_bool_by_its_module(
    folded, tmp_path, overwrite, name
):
    """``overwrite=np.True_`` was refused as "must be True or False, got bool" (numpy 2 calls its bool ``bool``),
    which contradicts itself. A type that is no builtin is named with its module now."""
    export = export_folded(folded, tmp_path / "exp")
    before = _files(tmp_path)
    with pytest.raises(ConfigurationError) as refused:
        export_folded(folded, export, overwrite=overwrite)
    assert str(refused.value) == f"export_folded: overwrite= must be True or False, got {name}"
    assert _files(tmp_path) == before


@pytest.mark.parametrize(
    ("yes", "no"),
    [
        (numpy.True_, numpy.False_),
        (torch.tensor(True), torch.tensor([False])),
        (numpy.array([True]), numpy.array(False)),
    ],
)
def test_export_folded_takes_a_numpy_or_torch_bool_as_the_bool_it_holds(folded, tmp_path, yes, no):
    """``overwrite=np.True_`` (or ``a > b`` of tensors) was refused; a numpy bool, and a bool tensor or array of one
    element, is read as the bool it holds now: True replaces an earlier export, False refuses it."""
    export = export_folded(folded, tmp_path / "exp")
    (export / "README.md").unlink()  # a replacement writes it again
    with pytest.raises(ConfigurationError, match="is not empty; choose a new folder or pass overwrite=True"):
        export_folded(folded, export, overwrite=no)
    assert not (export / "README.md").exists()
    assert export_folded(folded, export, overwrite=yes) == export
    assert (export / "README.md").is_file()


@pytest.mark.parametrize("place", ["new", "empty", "export"])
def test_a_second_thread_exporting_the_same_folder_is_refused_as_a_write_in_progress(
    folded, tmp_path, monkeypatch, place
):
    """Two threads of one process calling export_folded on one folder both wrote through the same pid-named
    ``.hf_tapernorm_writing-PID`` (or ``.NAME.export-PID``), and each took the other's for a killed write's leftover
    (this process's own pid counts as gone): one deleted the other's files, so a call returned with the export
    lacking files, or a refusal said "it is as it was" of a folder that had changed. A second call while the first
    writes is refused now as a write in progress, touching nothing, and the first completes its export."""
    import threading

    from hf_tapernorm.export import writing
    from hf_tapernorm.export.manifest import changed_export_files, missing_export_files

    target = tmp_path / "target"
    if place == "empty":
        target.mkdir()
    elif place == "export":
        export_folded(folded, target)
    inside, release = threading.Event(), threading.Event()
    real_write_export = writing._write_export

    def held_write_export(folder, model, tokenizer):
        real_write_export(folder, model, tokenizer)
        if threading.current_thread() is thread:  # the first write waits, inside, until the second was tried
            inside.set()
            assert release.wait(60)

    monkeypatch.setattr(writing, "_write_export", held_write_export)
    errors: list[BaseException] = []

    def first() -> None:
        try:
            export_folded(folded, target, overwrite=True)
        except BaseException as error:  # noqa: BLE001 - reported by the test
            errors.append(error)

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert inside.wait(60)
        before = _files(tmp_path)
        for overwrite in (False, True):
            with pytest.raises(ConfigurationError) as refused:
                export_folded(folded, target, overwrite=overwrite)
            assert str(refused.value) == (
                f"cannot export into {target}: another write of {target} is in progress (export_folded in another "
                f"thread of this process, pid {os.getpid()}); wait for it to finish, or choose a new folder"
            )
        assert _files(tmp_path) == before
    finally:
        release.set()
        thread.join(60)
    assert errors == []
    assert missing_export_files(target) == [] and changed_export_files(target) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]
    export_folded(folded, target, overwrite=True)  # the folder is free again once the first write returned
