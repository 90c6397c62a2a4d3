"""Atomic writes of a file or a folder (nothing half-written ever carries the final name), and the exact names
of what a killed write leaves behind.

A write goes into a hidden sibling ``.NAME.partial-PID`` and is renamed to ``NAME``; a folder it replaces is set
aside as ``.NAME.old-PID`` until the new one is in place. Only these names, of a name the writer writes, are a
leftover of ours (:func:`leftover_of`): a user's ``.thesis.old-2023/`` or ``.notes.partial-v2/`` is not one.
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

from .run_lock import RunFolderError

#: What write_file and write_folder write before the rename (``.NAME.partial-PID``) and the older folder
#: write_folder sets aside (``.NAME.old-PID``): the only names of a killed write's leftovers.
LEFTOVER = re.compile(r"\.(?P<name>.+)\.(?:partial|old)-[0-9]+")


def leftover_of(relative: str) -> Optional[str]:
    """The name (relative, as ``relative`` is) whose write left ``relative`` behind: ``relative`` is, or lies in,
    a ``.NAME.partial-PID`` or ``.NAME.old-PID`` (the first one on its way); None for any other path. Whether
    NAME is one the caller writes is the caller's to decide."""
    parts = relative.split("/")
    for depth, part in enumerate(parts):
        match = LEFTOVER.fullmatch(part)
        if match:
            return "/".join([*parts[:depth], match["name"]])
    return None


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
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_folder(
    final: Path,
    write: Callable[[Path], None],
    *,
    before_rename: Optional[Callable[[list[str]], None]] = None,
    keep: Callable[[], Collection[str]] = tuple,
) -> None:
    """``write`` into a hidden temporary sibling, then rename it to ``final``; on failure remove it.

    Nothing half-written ever carries the final name, and an older complete folder survives a failed
    rewrite. ``before_rename`` receives the written files (relative) before the rename (a manifest records
    them). A symbolic link at ``final`` is refused: its target is not ours to replace. ``keep``: the files of the
    older ``final`` that are not the writer's (relative; asked once the new folder is written, just before the
    rename): they are moved into the new folder, never deleted, and a new file of the same name is refused
    before anything is replaced.
    """
    if final.is_symlink() or (final.exists() and not final.is_dir()):
        raise RunFolderError(f"'{final}' is a symbolic link or a file; a folder written here would replace it")
    tmp = final.with_name(f".{final.name}.partial-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    _remove_abandoned(final, ".partial-")  # a write of ``final`` killed earlier (SIGKILL, power loss) left these
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
        old = final.with_name(f"{final.name}.kept-{os.getpid()}" if kept else f".{final.name}.old-{os.getpid()}")
        os.replace(final, old)
        os.replace(tmp, final)
        for relative in kept:
            (final / relative).parent.mkdir(parents=True, exist_ok=True)
            os.replace(old / relative, final / relative)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    _remove_abandoned(final, ".old-")  # earlier copies a killed rewrite set aside: ``final`` is whole again


def _refuse_clashes(final: Path, written: list[str], keep: Collection[str]) -> None:
    """Refuse (RunFolderError, before anything is replaced) to write a file where a kept file is, or a folder."""
    taken = {*written, *(folder for relative in written for folder in folders_of(relative))}
    clashes = [relative for relative in keep if relative in taken or set(folders_of(relative)) & set(written)]
    if clashes:
        raise RunFolderError(
            f"'{final}' holds files this command did not write ({listing(clashes)}) where it writes its own; "
            "nothing was replaced: move them away, then run it again (a taper run: with --resume)"
        )


def _remove_abandoned(final: Path, marker: str) -> None:
    """Delete the ``.NAME<marker>PID`` folders beside ``final`` whose process is gone (a live one is still writing)."""
    prefix = f".{final.name}{marker}"
    for sibling in final.parent.glob(glob.escape(prefix) + "*") if final.parent.is_dir() else ():
        pid = sibling.name[len(prefix) :]
        if pid.isdigit() and int(pid) != os.getpid() and sibling.is_dir() and not sibling.is_symlink():
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                shutil.rmtree(sibling, ignore_errors=True)
            except PermissionError:
                pass  # alive, another user's


__all__ = ["LEFTOVER", "folders_of", "leftover_of", "listing", "write_file", "write_folder"]
