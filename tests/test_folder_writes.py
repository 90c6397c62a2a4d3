"""folder_writes: a destination whose name is long but valid is written (its temporary siblings' names always fit
the filesystem), and beside a destination outside a run folder only a temporary folder our write made (its mark
in it) is ever deleted; a user's folder named like one is kept, and named when it is in the way."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from hf_tapernorm.app.folder_writes import (
    WRITE_MARK,
    check_folder_destination,
    is_mount_point,
    leftover_of,
    name_max,
    old_name,
    partial_name,
    temporary_name,
    write_file,
    write_folder,
)
from hf_tapernorm.app.run_folder import RunFolder
from hf_tapernorm.app.run_lock import RunFolderError
from hf_tapernorm.export.manifest import EXPORT_MANIFEST_NAME
from tests.conftest import corpus_documents
from tests.helpers import error_of, run_main, snapshot, tapered_checkpoint
from tests.helpers import short_eval_argv as evaluate
from tests.helpers import short_fold_argv as fold

DEAD = 2**22 + 54321  # no such process (pids stop at 2**22)


def _write(files: dict[str, str]):
    """A ``write`` for write_folder that creates its folder with ``files``."""

    def write(folder: Path) -> None:
        folder.mkdir()
        for name, text in files.items():
            (folder / name).write_text(text)

    return write


def _killed_write(final: Path) -> None:
    """Run write_folder of ``final`` in a child process that is killed (SIGKILL) in the middle of the write."""
    child = os.fork()
    if child == 0:
        try:

            def killed(folder: Path) -> None:
                _write({"config.json": "{}"})(folder)
                os.kill(os.getpid(), signal.SIGKILL)

            write_folder(final, killed)
        finally:
            os._exit(1)
    os.waitpid(child, 0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tapered checkpoint at g = 0 and a corpus beside it (``corpus.txt``) for fold and eval."""
    root = tmp_path_factory.mktemp("folder_writes")
    (root / "corpus.txt").write_text("\n\n".join(corpus_documents(150)))
    return tapered_checkpoint(root / "tapered")


# ============================================================================= a long name that is valid
def test_a_long_destination_name_is_written_through_temporary_names_that_fit(tmp_path):
    """A 250-byte folder name was valid but its ``.NAME.partial-PID`` was not: OSError File name too long at the
    rename, after all the work. Folders (new, replaced, replaced around a kept file) and files of names up to the
    filesystem's limit (multi-byte characters too) are written; nothing is left beside them."""
    limit = name_max(tmp_path)
    names = ["a" * 250, "b" * limit, "é" * (limit // 2)]
    for name in names:
        final = tmp_path / name
        for text in ("first", "second"):  # a new folder, then one that replaces it (its older copy set aside)
            write_folder(final, _write({"config.json": text}))
        (final / "notes.txt").write_text("mine")
        write_folder(final, _write({"config.json": "third"}), keep=lambda: ["notes.txt"])
        assert snapshot(final) == {"config.json": b"third", "notes.txt": b"mine"}
        for temporary in (partial_name(final), old_name(final), temporary_name(final, "kept", 99, hidden=False)):
            assert len(os.fsencode(temporary.name)) <= limit and leftover_of(temporary.name, final) == (
                temporary.name.startswith(".")
            )
        assert not leftover_of(partial_name(tmp_path / (name[:-1] + "x")).name, final)  # another name's is not
    result = tmp_path / ("c" * (limit - 5) + ".json")
    write_file(result, '{"a": 1}\n')
    assert result.read_text() == '{"a": 1}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*names, result.name])


def test_a_killed_write_of_a_long_name_leaves_a_leftover_the_next_write_removes(tmp_path):
    """The shortened temporary names are the ones leftovers are recognised by: a write killed mid-way leaves one
    (under the shortened name), and the next write of the same folder deletes it; a run folder forgets its
    recorded temporary names once the output is written."""
    final = tmp_path / ("a" * 250)
    _killed_write(final)
    left = list(tmp_path.iterdir())
    assert len(left) == 1 and ".partial-" in left[0].name and leftover_of(left[0].name, final), left
    write_folder(final, _write({"config.json": "{}"}))
    assert sorted(p.name for p in tmp_path.iterdir()) == [final.name]
    run = RunFolder(tmp_path / "run")
    run.record()
    run.write_output("b" * 250, _write({"config.json": "{}"}))
    assert run.manifest()["writes"] == [] and run.manifest()["files"] == [f"{'b' * 250}/config.json"]


def test_fold_and_eval_write_a_destination_whose_name_is_long_but_valid(checkpoint, tmp_path):
    """``fold --output_dir t/<250 x a>`` and ``eval --output_json t/<248 x b>.json`` ended in an OSError traceback
    (exit 1) after folding or evaluating: the names were valid, their temporary siblings' were not."""
    export = tmp_path / ("a" * 250)
    code, _, stderr = run_main(fold(checkpoint, export))
    assert code == 0, stderr[-2000:]
    assert json.loads((export / "config.json").read_text())["model_type"] == "tapernorm_llama"
    result = tmp_path / ("b" * 248 + ".json")
    options = ("--output_json", str(result), "--data_cache_dir", str(tmp_path / "cache"))
    code, _, stderr = run_main(evaluate(export, *options, data=checkpoint.parent / "corpus.txt"))
    assert code == 0, stderr[-2000:]
    assert json.loads(result.read_text())["kind"] == "folded"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["cache", export.name, result.name])


# ============================================================================= a user's folder named like a leftover
def test_a_user_s_folders_named_like_leftovers_beside_a_destination_are_never_deleted(tmp_path):
    """Outside a run folder any ``.exp.old-N/`` or ``.exp.partial-N/`` whose pid was not running was deleted as a
    killed write's leftover: a user's ``.exp.old-2023/thesis.tex`` with it. Only a folder our write made (its
    mark in it) is; the mark never reaches the written folder nor the file list its manifest is made of."""
    final = tmp_path / "exp"
    users = {f".exp.old-{DEAD}/thesis.tex": "my thesis", f".exp.partial-{DEAD + 1}/notes.txt": "my notes"}
    users |= {".exp.old-2023/thesis.tex": "my thesis", f".exp.partial-{DEAD + 2}": "a file of mine"}
    for relative, text in users.items():
        (tmp_path / relative).parent.mkdir(exist_ok=True)
        (tmp_path / relative).write_text(text)
    _killed_write(final)  # ours: removed by the next write
    seen: list = []
    for text in ("first", "second"):
        write_folder(final, _write({"config.json": text}), before_rename=seen.append)
    assert seen == [["config.json"], ["config.json"]]
    assert snapshot(final) == {"config.json": b"second"}
    assert snapshot(tmp_path) == {"exp/config.json": b"second", **{k: v.encode() for k, v in users.items()}}


def test_a_user_s_folder_under_this_process_s_temporary_name_is_refused_not_replaced(tmp_path):
    """A folder or file under the very name this process writes through (``.NAME.partial-PID`` of its own pid) was
    deleted (write_folder) or written over (write_file) without a word; it is named and kept."""
    final = tmp_path / "exp"
    (tmp_path / partial_name(final).name).mkdir()
    (tmp_path / partial_name(final).name / "notes.txt").write_text("my notes")
    before = snapshot(tmp_path)
    with pytest.raises(RunFolderError) as error:
        write_folder(final, _write({"config.json": "{}"}))
    assert str(error.value) == (
        f"'{partial_name(final)}' is in the way of writing '{final}': hf-tapernorm writes through that name, and "
        "this one is not a leftover of its writes; nothing was written or deleted: move it away, then run this again"
    )
    assert snapshot(tmp_path) == before and not final.exists()
    result = tmp_path / "result.json"
    partial_name(result).write_text("my draft")
    with pytest.raises(RunFolderError, match=r"is in the way of writing '.*result.json'"):
        write_file(result, "{}")
    assert partial_name(result).read_text() == "my draft" and not result.exists()


def test_fold_beside_a_user_s_folders_named_like_its_leftovers_keeps_them(checkpoint, tmp_path):
    """``fold --output_dir t/exp`` beside ``t/.exp.old-N/thesis.tex`` and ``t/.exp.partial-N/notes.txt`` (no such
    process) deleted both, exit 0, no word. They stay; the export holds exactly the files its manifest lists."""
    users = {f".exp.old-{DEAD}/thesis.tex": b"my thesis", f".exp.partial-{DEAD}/notes.txt": b"my notes"}
    for relative, data in users.items():
        (tmp_path / relative).parent.mkdir()
        (tmp_path / relative).write_bytes(data)
    for extra in ((), ("--overwrite",)):
        code, _, stderr = run_main(fold(checkpoint, tmp_path / "exp", *extra))
        assert code == 0, stderr[-2000:]
    assert {k: v for k, v in snapshot(tmp_path).items() if not k.startswith("exp/")} == users
    manifest = json.loads((tmp_path / "exp" / EXPORT_MANIFEST_NAME).read_text())["files"]
    assert sorted([*manifest, EXPORT_MANIFEST_NAME]) == sorted(snapshot(tmp_path / "exp"))
    assert WRITE_MARK not in manifest


# ============================================================================= destinations a rename cannot reach
def _long_folder(root: Path, length: int) -> Path:
    """A path of ``length`` bytes under ``root``: nested 200-byte folders (created), then a new folder's name."""
    folder = root
    while len(os.fsencode(str(folder))) + 1 + 200 + 1 + 100 < length:
        folder = folder / ("b" * 200)
    folder.mkdir(parents=True, exist_ok=True)
    return folder / ("c" * (length - len(os.fsencode(str(folder))) - 1))


def test_a_destination_near_path_max_is_written_through_a_temporary_path_a_few_bytes_longer(tmp_path):
    """A folder's temporary path held its name twice (``.NAME.partial-PID/NAME/file``): a valid destination whose
    files fit PATH_MAX failed with OSError File name too long at the end. The inner folder is ``w``: written; one
    whose temporary paths would still pass PATH_MAX is refused before anything is written, naming the option."""
    final = _long_folder(tmp_path, 4095 - 60)  # its temporary files fit (a few bytes more); the name twice would not
    for text in ("first", "second"):  # a new folder, then one that replaces it (set aside as .NAME.old-PID/w)
        write_folder(final, _write({"model.safetensors.index.json": text}))
    assert snapshot(final) == {"model.safetensors.index.json": b"second"}
    assert sorted(p.name for p in final.parent.iterdir()) == [final.name]
    check_folder_destination(final, "--output_dir X", inside="model.safetensors.index.json")
    too_long = _long_folder(tmp_path, 4095 - 20)
    with pytest.raises(RunFolderError, match=r"^--output_dir X: its files are written through paths of up to 41"):
        check_folder_destination(too_long, "--output_dir X", inside="model.safetensors.index.json")


def test_fold_into_a_path_whose_temporary_files_pass_path_max_is_one_line_before_loading(checkpoint, tmp_path):
    """``fold --output_dir <a path within a few bytes of PATH_MAX>`` failed with an OSError traceback (exit 1)
    after load, fold and fold check; one line naming --output_dir, nothing written."""
    export = _long_folder(tmp_path, 4095 - 20)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    said = error_of(fold(checkpoint, export))
    assert said.startswith(f"hf-tapernorm fold: error: --output_dir '{export}': its files are written through paths")
    assert said.endswith("a path may have here; choose a shorter path")
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


@pytest.mark.parametrize("failing", ["set aside", "renamed in"])
def test_a_rename_that_fails_puts_the_older_folder_back_and_leaves_no_temporary_folder(tmp_path, monkeypatch, failing):
    """A rename refused at the end (EBUSY: a mount point) left the finished folder in ``.NAME.partial-PID/`` and
    an empty ``.NAME.old-PID/``. The older folder is back under its name, byte for byte, and nothing is beside it."""
    final = tmp_path / "exp"
    write_folder(final, _write({"config.json": "older"}))
    replace, refused = os.replace, []

    def busy(source, target):  # the first rename of ``final`` (aside) or into it (the new folder) is refused
        if (Path(source), Path(target))[failing == "renamed in"] == final and not refused:
            refused.append(source)
            raise OSError(errno.EBUSY, "Device or resource busy", str(source))
        replace(source, target)

    monkeypatch.setattr(os, "replace", busy)
    with pytest.raises(OSError, match="Device or resource busy"):
        write_folder(final, _write({"config.json": "newer"}))
    assert snapshot(tmp_path) == {"exp/config.json": b"older"}


def test_a_mount_point_is_refused_in_one_line_before_anything_is_written(checkpoint, tmp_path, monkeypatch):
    """``fold --output_dir t/mnt`` with ``mnt`` an empty mount point (a container's volume) failed with EBUSY
    after load, fold and fold check, leaving ``.mnt.partial-PID/`` and ``.mnt.old-PID/``. One line before loading;
    write_folder itself refuses one too (the last guard)."""
    mount = tmp_path / "mnt"
    mount.mkdir()
    real = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda path: Path(path) == mount or real(path))
    assert error_of(fold(checkpoint, mount)) == (
        f"hf-tapernorm fold: error: --output_dir '{mount}': the folder is a mount point, which a write cannot replace "
        f"by a rename; name a folder inside it ('{mount / 'export'}')"
    )
    with pytest.raises(RunFolderError, match="the folder is a mount point"):
        write_folder(mount, _write({"config.json": "{}"}))
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["mnt"]


def test_fold_into_a_missing_folder_s_dotdot_is_refused_and_creates_nothing(checkpoint, tmp_path):
    """``fold --output_dir t/nope/..`` (``nope`` missing) passed the first check; fold's lock created ``t/nope``,
    and after loading fold said the folder was not empty, leaving ``t/nope``. One line before loading, nothing
    created."""
    target = tmp_path / "t"
    target.mkdir()
    assert error_of(fold(checkpoint, f"{target}/nope/..")) == (
        f"hf-tapernorm fold: error: --output_dir '{target}/nope/..': '{target}/nope' does not exist, so the '..' "
        f"after it names no folder; name the folder without '..' ('{target}')"
    )
    assert list(target.iterdir()) == []


def test_eval_into_a_result_file_whose_temporary_sibling_passes_path_max_is_one_line_before_loading(
    checkpoint, tmp_path
):
    """``eval --output_json <a file within a few bytes of PATH_MAX>``: its ``.NAME.partial-PID`` sibling did not
    fit, an OSError at the end of the evaluation. One line naming --output_json, nothing written."""
    result = _long_folder(tmp_path, 4095 - 8).with_suffix(".json")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    said = error_of(evaluate(checkpoint, "--output_json", str(result), data=checkpoint.parent / "corpus.txt"))
    assert said.startswith(f"hf-tapernorm eval: error: --output_json {result}: its files are written through paths")
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_a_bind_mount_from_the_same_filesystem_is_a_mount_point(tmp_path):
    """A container's volume is a bind mount, often of the same filesystem: os.path.ismount (devices compared) did not
    see it, and fold failed with EBUSY at the end. The kernel's list of mount points is read too (needs root)."""
    source, mount = tmp_path / "src", tmp_path / "mnt"
    source.mkdir()
    mount.mkdir()
    bound = os.geteuid() == 0 and shutil.which("mount") is not None
    if not bound or subprocess.run(["mount", "--bind", str(source), str(mount)], capture_output=True).returncode:
        pytest.skip("a bind mount needs root")
    try:
        assert is_mount_point(mount) and not is_mount_point(source)
        with pytest.raises(RunFolderError, match="the folder is a mount point"):
            write_folder(mount, _write({"config.json": "{}"}))
    finally:
        subprocess.run(["umount", str(mount)], check=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mnt", "src"]


def test_a_first_write_removes_a_killed_fresh_exports_leftover_beside_it(tmp_path):
    """export_folded writes every export beside its folder (``.NAME.export-PID``) and renames it into place, so one
    killed before the rename leaves no folder under the name, only the leftover. ``fold --output_dir NAME`` (a
    write_folder of a folder not there yet) removed such leftovers only beside a folder that was there, and left
    this one for good; now any write of the folder removes it (marked, its writer gone), and keeps a live one's."""
    final = tmp_path / "exp"
    for pid in (DEAD, os.getppid()):  # a killed writer's, and a running process's
        (tmp_path / f".exp.export-{pid}" / "new").mkdir(parents=True)
        (tmp_path / f".exp.export-{pid}" / WRITE_MARK).write_text("")
    write_folder(final, _write({"config.json": "{}"}))
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".exp.export-{os.getppid()}", "exp"]


@pytest.mark.parametrize("number", ["1099511627776", "0", "pid_max"])
def test_a_marked_write_named_after_no_pid_is_no_live_writer(tmp_path, number):
    """A marked ``.hf_tapernorm_writing-N`` inside an export whose N is no pid (0, above 2**31 - 1, or above the
    system's pid_max) was taken for a live write: fold --overwrite, export_folded and push said "another write ... is
    in progress; wait" forever. No process has such a number: it is a killed write's leftover, deleted by the next
    write, and named by no refusal."""
    from hf_tapernorm._temporaries import (
        WRITE_MARK,
        remove_abandoned_inside,
        system_pid_max,
        write_in_progress,
        writer_gone,
    )

    if number == "pid_max":
        if not Path("/proc/sys/kernel/pid_max").is_file():
            pytest.skip("the system does not say its pid_max")
        number = str(system_pid_max() + 1)
    export = tmp_path / "export"
    leftover = export / f".hf_tapernorm_writing-{number}"
    leftover.mkdir(parents=True)
    (leftover / WRITE_MARK).write_text("")
    assert writer_gone(leftover) and write_in_progress(export) is None
    remove_abandoned_inside(export)
    assert not leftover.exists() and export.is_dir()


def _command_line_shown(pid: int, seconds: float = 10.0) -> bool:
    """Whether /proc says the command line ``pid`` was started with (a ``python -c`` that sleeps) within
    ``seconds``: a process just started may not show it yet (seen on a loaded CI machine), and a sandbox may never
    show it."""
    from hf_tapernorm._temporaries import process_command

    deadline = time.monotonic() + seconds
    while "time.sleep(60)" not in (process_command(pid) or ""):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_live_write_is_named_by_its_command_line_and_its_folder_never_called_a_killed_write_s(tmp_path, monkeypatch):
    """A live library export_folded (a Python script, no hf-tapernorm command) into E, then fold --overwrite into E:
    the refusal said "if no hf-tapernorm command is running, pid N is another program's ...: delete" its folder, and
    a user who followed it lost both exports. Now it names the process by its command line (/proc/N/cmdline) and
    says to delete the folder only if that process is not writing the export; where the system does not say, the
    pid alone."""
    import sys

    from hf_tapernorm import _temporaries
    from hf_tapernorm._temporaries import WRITE_MARK, write_in_progress

    if not Path("/proc/self/cmdline").is_file():
        pytest.skip("the system does not say a process's command line")
    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "libwrite.py"])
    try:
        if not _command_line_shown(writer.pid):
            pytest.skip("the system did not say the writer's command line")
        export = tmp_path / "export"
        live = export / f".hf_tapernorm_writing-{writer.pid}"
        live.mkdir(parents=True)
        (live / WRITE_MARK).write_text("")
        advice = f"; delete '{live}' only if process {writer.pid} is not writing this export, its pid reused after"
        assert write_in_progress(export) == (
            f"another write of {export} is in progress (pid {writer.pid}: {sys.executable} -c import time; "
            f"time.sleep(60) libwrite.py, through '{live.name}'{advice} a restart)"
        )
        monkeypatch.setattr(_temporaries, "process_command", lambda pid: None)  # no /proc
        assert write_in_progress(export) == (
            f"another write of {export} is in progress (pid {writer.pid}, through '{live.name}'{advice} a restart)"
        )
        assert "no hf-tapernorm command" not in write_in_progress(export) and live.is_dir()
    finally:
        writer.kill()
        writer.wait()


def test_a_live_writers_command_line_is_shown_on_one_line_and_cut(tmp_path):
    """A writer started as a multi-line ``python -c`` made the one-line refusal span three lines (its newlines
    printed raw), and one with a 6000-character command line printed all of it. The command line is shown on one
    line now, control characters escaped, cut after 200 characters."""
    import sys

    from hf_tapernorm._temporaries import process_command

    if not Path("/proc/self/cmdline").is_file():
        pytest.skip("the system does not say a process's command line")
    writers = [
        subprocess.Popen([sys.executable, "-c", "import time\ntime.sleep(60)"]),
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "x" * 6000]),
    ]
    try:
        if not all(_command_line_shown(writer.pid) for writer in writers):
            pytest.skip("the system did not say the writers' command lines")
        shown = [process_command(writer.pid) for writer in writers]
    finally:
        for writer in writers:
            writer.kill()
            writer.wait()
    assert shown[0] == f"{sys.executable} -c import time\\ntime.sleep(60)"
    assert "\n" not in shown[1] and len(shown[1]) == 203 and shown[1].endswith("xxx...")


def test_a_chain_of_links_to_a_missing_folder_names_its_last_link(tmp_path):
    """``dl2 -> dl -> nothere``: the refusal named dl2 and its target dl ("create that folder"), itself a dangling
    link that cannot be created as a folder. The last link of the chain is named, with the target that is missing."""
    from hf_tapernorm.utils import dangling_link

    (tmp_path / "dl").symlink_to(tmp_path / "nothere")
    (tmp_path / "dl2").symlink_to(tmp_path / "dl")
    assert dangling_link(tmp_path / "dl2" / "run") == (
        f"'{tmp_path / 'dl'}' is a link to a folder that does not exist ('{tmp_path / 'nothere'}'); create that "
        "folder, or choose another"
    )
    (tmp_path / "nothere").mkdir()
    assert dangling_link(tmp_path / "dl2" / "run") is None


def test_eval_output_json_under_a_file_is_named_as_a_file(tmp_path):
    """``eval --output_json corpus.txt/r.json`` (a file where its folder goes) said "the folder 'corpus.txt' does
    not exist; create it first", which could not be done. The file is named."""
    from hf_tapernorm._parsing import UsageError
    from hf_tapernorm.cli.destinations import check_result_file

    (tmp_path / "corpus.txt").write_text("text\n")
    (tmp_path / "filelink").symlink_to(tmp_path / "corpus.txt")
    for parent in ("corpus.txt", "filelink"):
        with pytest.raises(UsageError) as caught:
            check_result_file(tmp_path / parent / "r.json")
        assert str(caught.value) == f"--output_json {tmp_path / parent / 'r.json'}: '{tmp_path / parent}' is a file"


def test_the_largest_pid_is_the_system_s_where_it_says_and_any_system_s_elsewhere(monkeypatch):
    """A number is no pid above /proc/sys/kernel/pid_max (less one) on Linux; where there is no /proc, above the
    largest any system gives (2**31 - 1), as before."""
    from hf_tapernorm import _temporaries

    if Path("/proc/sys/kernel/pid_max").is_file():
        assert _temporaries.system_pid_max() == int(Path("/proc/sys/kernel/pid_max").read_text()) - 1
    real = Path.read_text

    def no_proc(path: Path, *args, **kwargs) -> str:
        if str(path).startswith("/proc/"):
            raise FileNotFoundError(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", no_proc)
    assert _temporaries.system_pid_max() == 2**31 - 1
