"""Atomic writes of a file or a folder (nothing half-written ever carries the final name), and the exact names
of what a killed write leaves behind.

A write goes into a hidden sibling ``.NAME.partial-PID`` and is renamed to ``NAME``; a folder it replaces is set
aside as ``.NAME.old-PID`` until the new one is in place (:func:`partial_name`, :func:`old_name`). Such a name is
a leftover of ours only when its writer recorded it: a run folder records each one in its manifest before it is
created (run_folder.py), so a user's ``.folded.old-2023/`` or ``.report.md.partial-1`` is not one; beside an
export outside a run folder, only one whose process is gone is.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
from collections import Counter
from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import Optional

from .run_lock import RunFolderError, is_pid, process_running

#: The form of what write_file and write_folder write before the rename (``.NAME.partial-PID``) and of the older
#: folder write_folder sets aside (``.NAME.old-PID``): the only names a killed write leaves.
LEFTOVER = re.compile(r"\.(?P<name>.+)\.(?:partial|old)-[0-9]+")


def partial_name(path: Path) -> Path:
    """The hidden sibling this process writes ``path`` into before renaming it (``.NAME.partial-PID``)."""
    return path.with_name(f".{path.name}.partial-{os.getpid()}")


def old_name(path: Path) -> Path:
    """The hidden sibling this process moves the older folder ``path`` to while replacing it (``.NAME.old-PID``)."""
    return path.with_name(f".{path.name}.old-{os.getpid()}")


def writer_gone(leftover: Path) -> bool:
    """Whether the process a ``.NAME.partial-PID`` / ``.NAME.old-PID`` is named after is gone (a live one is still
    writing it; a number that is no pid names no writer of ours)."""
    pid = int(leftover.name.rpartition("-")[2])
    return is_pid(pid) and pid != os.getpid() and not process_running(pid)


def folders_of(relative: str) -> list[str]:
    """The folders ``relative`` lies in, outermost first (``a/b/c`` -> ``a``, ``a/b``)."""
    parts = relative.split("/")
    return ["/".join(parts[:depth]) for depth in range(1, len(parts))]


def listing(files: list[str], present: Iterable[str] = ()) -> str:
    """The files a refusal names (the first eight). A folder of several files that are all among ``files`` (of the
    ``present`` ones) is named once, as ``folder/``: a user's copied checkpoint does not hide the next name."""
    holds = Counter(folder for relative in present for folder in folders_of(relative))
    listed = Counter(folder for relative in files for folder in folders_of(relative))
    names = []
    for relative in files:
        whole = next((f for f in folders_of(relative) if listed[f] > 1 and holds[f] == listed[f]), None)
        names.append(relative if whole is None else f"{whole}/")
    names = list(dict.fromkeys(names))
    return ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")


def write_file(path: Path, text: str) -> None:
    """Write ``text`` into a hidden ``.NAME.partial-PID`` sibling, then rename it to ``path``: a kill leaves the old
    file or the new one, and the partial name is one the run folder knows as unfinished."""
    tmp = partial_name(path)
    tmp.write_text(text)
    os.replace(tmp, path)


def write_folder(
    final: Path,
    write: Callable[[Path], None],
    *,
    before_rename: Optional[Callable[[list[str]], None]] = None,
    keep: Callable[[], Collection[str]] = tuple,
    abandoned: Callable[[Path], bool] = writer_gone,
) -> None:
    """``write`` into a hidden temporary sibling, then rename it to ``final``; on failure remove it.

    Nothing half-written ever carries the final name, and an older complete folder survives a failed
    rewrite. ``before_rename`` receives the written files (relative) before the rename (a manifest records
    them). A symbolic link at ``final`` is refused: its target is not ours to replace. ``keep``: the files of the
    older ``final`` that are not the writer's (relative; asked once the new folder is written, just before the
    rename): they are moved into the new folder, never deleted, and a new file of the same name is refused
    before anything is replaced. ``abandoned``: whether a ``.NAME.partial-PID`` / ``.NAME.old-PID`` beside
    ``final`` is a killed write's leftover, deleted then (default: its process is gone; a run folder: it recorded
    the name).
    """
    if final.is_symlink() or (final.exists() and not final.is_dir()):
        raise RunFolderError(f"'{final}' is a symbolic link or a file; a folder written here would replace it")
    tmp = partial_name(final)
    if tmp.exists():
        shutil.rmtree(tmp)
    _remove_abandoned(final, ".partial-", abandoned)  # a killed write of ``final`` (SIGKILL, power loss) left these
    try:
        write(tmp)
        written = sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file())
        kept = keep() if final.is_dir() else ()
        _refuse_clashes(final, written, kept)
        if before_rename is not None:
            before_rename(written)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        # The older folder is set aside, the new one renamed in, the older one deleted. When it holds someone
        # else's files, its name aside is a visible one that no cleanup deletes (not .NAME.old-PID), and each of
        # their files moves into the new folder by a rename: a kill at any moment leaves each under a name.
        old = final.with_name(f"{final.name}.kept-{os.getpid()}") if kept else old_name(final)
        os.replace(final, old)
        os.replace(tmp, final)
        for relative in kept:
            (final / relative).parent.mkdir(parents=True, exist_ok=True)
            os.replace(old / relative, final / relative)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    _remove_abandoned(final, ".old-", abandoned)  # earlier copies a killed rewrite set aside: ``final`` is whole again


def _refuse_clashes(final: Path, written: list[str], keep: Collection[str]) -> None:
    """Refuse (RunFolderError, before anything is replaced) to write a file where a kept file is, or a folder."""
    taken = {*written, *(folder for relative in written for folder in folders_of(relative))}
    clashes = [relative for relative in keep if relative in taken or set(folders_of(relative)) & set(written)]
    if clashes:
        raise RunFolderError(
            f"'{final}' holds files this command did not write ({listing(clashes)}) where it writes its own; "
            "nothing was replaced: move them away, then run it again (a taper run: with --resume)"
        )


def _remove_abandoned(final: Path, marker: str, abandoned: Callable[[Path], bool]) -> None:
    """Delete the ``.NAME<marker>PID`` folders beside ``final`` that are a killed write's leftovers (``abandoned``)."""
    prefix = f".{final.name}{marker}"
    for sibling in final.parent.glob(glob.escape(prefix) + "*") if final.parent.is_dir() else ():
        pid = sibling.name[len(prefix) :]
        if pid.isascii() and pid.isdigit() and sibling.is_dir() and not sibling.is_symlink() and abandoned(sibling):
            shutil.rmtree(sibling, ignore_errors=True)


__all__ = [
    "LEFTOVER",
    "folders_of",
    "listing",
    "old_name",
    "partial_name",
    "write_file",
    "write_folder",
    "writer_gone",
]
