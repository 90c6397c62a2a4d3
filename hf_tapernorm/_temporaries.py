"""The temporary folders a write goes through beside its destination: their names, their mark, and whether a
killed write left one.

A write of ``NAME`` goes through hidden siblings ``.NAME.KIND-PID`` (app/folder_writes.py: ``partial``, ``old``;
export/writing.py's write of an export: ``export``). Each is created with :data:`WRITE_MARK` in it before
anything else (:func:`make_marked_folder`), so a kill at any moment leaves a folder that provably is a write's of
ours, named after its writer's pid: a later write of the same destination, and a run folder's ``--overwrite`` or
``--resume`` around it, delete one whose writer is gone (:func:`marked_and_abandoned`), and leave alone a live
writer's and a user's look-alike without the mark. Here, at the bottom of the package's layers, so that both
writers (export/ sits below app/) name and mark theirs in one way, and every cleanup recognises both.

A write into a folder that exists and must stay (its owner, group and ACLs, a link to it, a shell sitting in it:
export_folded into an existing folder) goes through a marked ``.hf_tapernorm_writing-PID`` INSIDE it instead
(:func:`writing_inside`; a bookkeeping name, never uploaded; on the folder's filesystem, so :func:`move_up` renames),
and the next write of the folder (export_folded, fold, a run's ``--overwrite`` or ``--resume``) deletes a killed
one's (:func:`remove_abandoned_inside`, :func:`abandoned_write_folder`), while a live one's is named
(:func:`write_in_progress`) and push refuses either.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, Optional

#: The form of a write's temporary sibling (``name``: the destination's name, or for a long one its start and a
#: digest: temporary_name; ``kind``: which write made it).
LEFTOVER = re.compile(r"\.(?P<name>.+)\.(?P<kind>partial|old|export)-(?P<pid>[0-9]+)")
#: The file each writer puts into each temporary folder it makes, before anything else: what proves a leftover
#: outside a run folder ours.
WRITE_MARK = ".hf_tapernorm_write"
#: The longest file name (bytes) assumed where the filesystem does not say (Linux's NAME_MAX).
DEFAULT_NAME_MAX = 255
#: The largest pid a system gives (Linux: at most 2**22; os.kill overflows beyond a C int).
_MAX_PID = 2**31 - 1
_DIGEST_LENGTH = 12
#: The form of the temporary folder a write into an existing folder goes through, inside it (writing_inside).
WRITING_INSIDE = re.compile(r"\.hf_tapernorm_writing-[0-9]+")


def filesystem_limit(folder: Path, setting: str, default: int) -> int:
    """The filesystem limit ``setting`` (os.pathconf) of ``folder``, or of its first existing parent (a folder still
    to be created lies on that one's filesystem); ``default`` where the system does not say."""
    for place in [folder, *folder.parents]:
        try:
            limit = os.pathconf(place, setting)
        except (OSError, ValueError):  # missing (yet), too long itself, or no such setting on this system
            continue
        return limit if limit > 0 else default
    return default


def name_max(folder: Path) -> int:
    """The longest file name (in bytes) the filesystem of ``folder`` takes; DEFAULT_NAME_MAX where it does not say."""
    return filesystem_limit(folder, "PC_NAME_MAX", DEFAULT_NAME_MAX)


def temporary_name(path: Path, kind: str, pid: int, *, hidden: bool = True) -> Path:
    """The sibling ``.NAME.KIND-PID`` (``hidden``; else ``NAME.KIND-PID``) of ``path``. Where that would be longer
    than a file name may be, ``NAME`` is cut and a digest of the whole name added (``NAME-START~DIGEST``): the same
    ``path``, kind and pid always give the same name, and a different name a different one."""
    lead, suffix = ("." if hidden else ""), f".{kind}-{pid}"
    room = name_max(path.parent) - len(os.fsencode(lead + suffix))
    name = path.name
    if len(os.fsencode(name)) > room:
        digest = hashlib.sha256(os.fsencode(name)).hexdigest()[:_DIGEST_LENGTH]
        while name and len(os.fsencode(name)) + 1 + _DIGEST_LENGTH > room:
            name = name[:-1]
        name = f"{name}~{digest}"
    return path.with_name(f"{lead}{name}{suffix}")


def leftover_of(name: str, final: Path, kinds: Collection[str] = ("partial", "old")) -> bool:
    """Whether ``name`` is a temporary name a write of ``final`` gives (``.NAME.KIND-PID`` of ``kinds``, any pid):
    exactly what temporary_name makes, so another destination's (or a user's look-alike, ``.exp.old-007``) is not."""
    found = LEFTOVER.fullmatch(name)
    return (
        found is not None
        and found["kind"] in kinds
        and temporary_name(final, found["kind"], int(found["pid"])).name == name
    )


def is_pid(value: Any) -> bool:
    """Whether ``value`` can name a process: an int in 1 .. 2**31 - 1, not a bool (os.kill overflows beyond, and
    0 and -1 name process groups)."""
    return type(value) is int and 0 < value <= _MAX_PID


def process_running(pid: int) -> bool:
    """Whether process ``pid`` (``is_pid``) runs, this user's or another's."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    return True


def system_pid_max() -> int:
    """The largest pid this system gives (Linux: /proc/sys/kernel/pid_max, less one); where it does not say (no
    /proc), the largest any system gives (_MAX_PID)."""
    try:
        return min(int(Path("/proc/sys/kernel/pid_max").read_text()) - 1, _MAX_PID)
    except (OSError, ValueError):
        return _MAX_PID


def writer_gone(leftover: Path) -> bool:
    """Whether the process a ``.NAME.KIND-PID`` is named after is gone (a live one is still writing it). A number
    that is no pid here (0, or above the system's largest: system_pid_max) names no writer at all, so no live one.
    One of this process's own pid is no write in progress either: each writer removes its own before it returns, so
    it is an earlier process's of that pid.

    A running process of that pid is taken for the writer whatever it runs: its command line (/proc/PID/cmdline)
    is not asked whether it is Python. The writer may be a Python embedded in another program or renamed by it
    (uwsgi, a frozen executable, setproctitle), so "not Python" would delete a live write's folder under it, which
    is data lost; a reused pid (a reboot, a container's pid 1) costs a refusal only, and that refusal
    (write_in_progress) names the process, and which folder to delete if it is not the writer."""
    pid = int(leftover.name.rpartition("-")[2])
    if not is_pid(pid) or pid > system_pid_max():
        return True
    return pid == os.getpid() or not process_running(pid)


def marked_and_abandoned(leftover: Path) -> bool:
    """A killed write's leftover outside a run folder's records: a folder a writer made (its mark is in it, a file)
    whose writer is gone. A user's ``.exp.old-2023/`` carries no mark, and is never deleted."""
    return _marked(leftover) and writer_gone(leftover)


def _marked(folder: Path) -> bool:
    """Whether ``folder`` holds the writers' mark (a file, not a link): it was made by make_marked_folder."""
    mark = folder / WRITE_MARK
    return mark.is_file() and not mark.is_symlink()


def make_marked_folder(folder: Path) -> None:
    """Create the temporary ``folder`` (and the folders above it) with the writers' mark in it, before anything
    else goes in: a kill from here on leaves a folder that is provably a write's of ours."""
    folder.mkdir(parents=True)
    (folder / WRITE_MARK).write_text(
        "hf-tapernorm writes a folder through this one; a later write of the same folder deletes it once its "
        "writer is gone\n"
    )


def remove_abandoned(final: Path, kind: str, abandoned: Callable[[Path], bool] = marked_and_abandoned) -> None:
    """Delete the ``.NAME.KIND-PID`` folders beside ``final`` (any pid; leftover_of) that are a killed write's
    leftovers (``abandoned``)."""
    try:
        siblings = list(final.parent.iterdir())
    except OSError:  # no folder yet (nothing to remove), or one this user may write but not list
        return
    for sibling in siblings:
        ours = leftover_of(sibling.name, final, (kind,)) and sibling.is_dir() and not sibling.is_symlink()
        if ours and abandoned(sibling):
            shutil.rmtree(sibling, ignore_errors=True)


def writing_inside(folder: Path, pid: int) -> Path:
    """The hidden ``.hf_tapernorm_writing-PID`` folder inside ``folder`` that a write of process ``pid`` goes
    through."""
    return folder / f".hf_tapernorm_writing-{pid}"


def is_write_folder(path: Path) -> bool:
    """Whether ``path`` is a write's marked temporary folder: named ``.NAME.KIND-PID`` (beside what it writes) or
    ``.hf_tapernorm_writing-PID`` (inside), a folder (not a link) holding the writers' mark."""
    named = LEFTOVER.fullmatch(path.name) or WRITING_INSIDE.fullmatch(path.name)
    return bool(named) and path.is_dir() and not path.is_symlink() and _marked(path)


def abandoned_write_folder(path: Path) -> bool:
    """Whether ``path`` is a killed write's temporary folder (is_write_folder, its writer gone): hf-tapernorm's to
    delete, never a user's file, wherever it lies (a run folder's ``folded/``, an export)."""
    return is_write_folder(path) and writer_gone(path)


def writes_inside(folder: Path) -> list[Path]:
    """The marked ``.hf_tapernorm_writing-PID`` folders inside ``folder`` (writing_inside), live or killed."""
    try:
        entries = sorted(folder.iterdir()) if folder.is_dir() else []
    except OSError:  # a folder this user may not list: the write's own checks say so
        return []
    return [entry for entry in entries if WRITING_INSIDE.fullmatch(entry.name) and is_write_folder(entry)]


#: The most characters of a writer's command line a refusal shows (a long one would fill the terminal).
_COMMAND_SHOWN = 200


def process_command(pid: int) -> Optional[str]:
    """The command line of process ``pid`` as the system says it (/proc/PID/cmdline, its arguments joined by
    spaces, on one line: control characters escaped, cut after _COMMAND_SHOWN characters), or None where it does
    not say (no /proc, another user's process hidden, the process gone)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    words = [os.fsdecode(word) for word in raw.split(b"\0") if word]
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in " ".join(words))  # one line: \n escaped
    return (text if len(text) <= _COMMAND_SHOWN else text[:_COMMAND_SHOWN] + "...") or None


def write_in_progress(folder: Path) -> Optional[str]:
    """The words naming a live write into ``folder`` (its ``.hf_tapernorm_writing-PID``, writer running), or None:
    a second write would mix its files with that one's, so each write refuses the folder, saying so.

    The writer may be any Python program calling export_folded, not only an hf-tapernorm command, so the words name
    the process by its command line where the system says it, and say to delete the folder only if that process is
    not the writer (a pid reused after a restart): deleting a live write's folder loses the earlier export and the
    new one."""
    live = [entry for entry in writes_inside(folder) if not writer_gone(entry)]
    return _naming_live_write(folder, live[0]) if live else None


def write_beside_in_progress(final: Path) -> Optional[str]:
    """The words naming a live write of ``final`` through a temporary folder beside it (``.NAME.KIND-PID``, marked,
    writer running: export_folded of a folder not there yet, or fold's write_folder), or None, as write_in_progress
    names one inside (live_write_of asks both): a run's ``--overwrite`` would otherwise take that folder for a user's
    file to move away, and moving it breaks the write."""
    try:
        siblings = sorted(final.parent.iterdir())
    except OSError:  # no folder yet, or one this user may not list: no write of ours goes on in it
        return None
    live = [
        entry
        for entry in siblings
        if leftover_of(entry.name, final, ("partial", "old", "export"))
        and is_write_folder(entry)
        and not writer_gone(entry)
    ]
    return _naming_live_write(final, live[0]) if live else None


def live_write_of(folder: Path) -> Optional[str]:
    """The words naming a live write of ``folder``: inside it (write_in_progress), or beside it under its own name or,
    through a link or '.', its target's (write_beside_in_progress); None for none. A second write of a folder being
    written mixes its files with the first's or loses one export, and a push of it uploads half of each, so fold,
    export_folded, push and a run's --overwrite/--resume each refuse it, naming the writer."""
    try:
        target = folder.resolve()
    except (OSError, RuntimeError):  # a link loop: the folder's own checks say so
        target = folder
    return write_in_progress(folder) or write_beside_in_progress(folder) or write_beside_in_progress(target)


def _naming_live_write(folder: Path, live: Path) -> str:
    """The words naming the live write of ``folder`` through ``live`` (a marked temporary folder named after its
    writer's pid): the process by its command line where the system says it, and which folder to delete only if
    that process is not the writer."""
    pid = live.name.rpartition("-")[2]
    command = process_command(int(pid))
    process = f"pid {pid}: {command}" if command else f"pid {pid}"
    return (
        f"another write of {folder} is in progress ({process}, through '{live.name}'; delete '{live}' only if "
        f"process {pid} is not writing this export, its pid reused after a restart)"
    )


def remove_abandoned_inside(folder: Path) -> None:
    """Delete the ``.hf_tapernorm_writing-PID`` folders inside ``folder`` that killed writes left (marked, writer
    gone), before the folder is judged empty or an earlier write's; a live writer's stays. Every write into an
    existing folder calls it first: export_folded, fold's write_folder and its check of the folder."""
    for entry in writes_inside(folder):
        if writer_gone(entry):
            shutil.rmtree(entry, ignore_errors=True)


def remove_listed(folder: Path, names: Collection[str]) -> None:
    """Delete the files ``names`` (relative paths) in ``folder``, and the folders inside it they leave empty."""
    for name in names:
        path = folder / name
        path.unlink(missing_ok=True)
        for parent in path.parents:
            if parent == folder or any(parent.iterdir()):
                break
            parent.rmdir()


def move_up(container: Path, folder: Path, *, first: str) -> None:
    """Rename every entry of ``container`` (its mark left) into ``folder``, ``first`` before the others: a write's
    record of its files goes up first, so a kill mid-move leaves a folder that names itself an (incomplete) write."""
    names = sorted(n for n in os.listdir(container) if n not in (first, WRITE_MARK))
    for name in [first, *names]:
        os.replace(container / name, folder / name)


__all__ = [
    "DEFAULT_NAME_MAX",
    "LEFTOVER",
    "WRITE_MARK",
    "WRITING_INSIDE",
    "abandoned_write_folder",
    "filesystem_limit",
    "is_pid",
    "is_write_folder",
    "leftover_of",
    "make_marked_folder",
    "marked_and_abandoned",
    "move_up",
    "name_max",
    "process_command",
    "process_running",
    "remove_abandoned",
    "remove_abandoned_inside",
    "remove_listed",
    "temporary_name",
    "system_pid_max",
    "live_write_of",
    "write_beside_in_progress",
    "write_in_progress",
    "writer_gone",
    "writes_inside",
    "writing_inside",
]
