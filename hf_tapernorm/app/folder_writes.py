"""Atomic writes of a file or a folder (nothing half-written ever carries the final name), and the exact names
of what a killed write leaves behind.

A write goes into a hidden sibling ``.NAME.partial-PID`` and is renamed to ``NAME``; a folder it replaces is set
aside as ``.NAME.old-PID`` until the new one is in place (:func:`partial_name`, :func:`old_name`). Those names
always fit the filesystem: beside a long ``NAME`` (up to its NAME_MAX) they hold its start and a digest of it
instead (:func:`temporary_name`), so a valid destination never fails at the rename after all the work. A folder
is written as ``.NAME.partial-PID/w`` (:data:`INNER`, never ``NAME`` again), so a temporary path is only a few
bytes longer than the final one; check_folder_destination refuses, before anything loads, the destination whose
temporary paths would still pass the system's PATH_MAX, a mount point (a rename cannot replace one) and a ``..``
after a folder that does not exist (the kernel takes it for no folder, a lexical reading for the one above).

Such a name is a leftover of ours only when its writer proved it: a run folder records each one in its manifest
before it is created (run_folder.py), so a user's ``.folded.old-2023/`` or ``.report.md.partial-1`` is not one;
outside a run folder, write_folder's temporary folders are containers it makes itself with its mark
(:data:`WRITE_MARK`) in them before anything else, the folder being written (or the one set aside) inside as
:data:`INNER`, so
only a marked one whose process is gone is deleted and the mark never reaches the written folder. Anything else
of that form is left alone, and named when it is in the way of a write.
"""

from __future__ import annotations

import os
import shutil
from collections import Counter
from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import Optional

from .._temporaries import (
    DEFAULT_NAME_MAX,
    LEFTOVER,
    WRITE_MARK,
    filesystem_limit,
    leftover_of,
    marked_and_abandoned,
    name_max,
    remove_abandoned,
    remove_abandoned_inside,
    temporary_name,
    writer_gone,
)
from .._temporaries import make_marked_folder as _make_container
from ..utils import dangling_parent_step, some_names
from .run_lock import RunFolderError

#: The name of the folder inside each temporary container (``.NAME.partial-PID/w``, ``.NAME.old-PID/w``): short and
#: fixed, not ``NAME``, so a temporary path never holds the destination's name twice.
INNER = "w"
#: The longest path (bytes, with its terminating NUL) assumed where the system does not say (Linux's PATH_MAX).
DEFAULT_PATH_MAX = 4096


def path_max(folder: Path) -> int:
    """The longest path (bytes, with its terminating NUL) the system takes on the filesystem of ``folder``;
    DEFAULT_PATH_MAX where it does not say."""
    return filesystem_limit(folder, "PC_PATH_MAX", DEFAULT_PATH_MAX)


def check_path_length(final: Path, what: str, *, inside: Optional[str] = None) -> None:
    """Refuse (RunFolderError naming ``what``), before anything loads, a destination whose longest temporary path
    passes the system's PATH_MAX: the file ``final``'s ``.NAME.partial-PID`` (write_file), or with ``inside`` (the
    longest relative path written into the folder ``final``) ``.NAME.partial-PID/w/INSIDE`` (write_folder). The
    operating system's answer would come at the end, after all the work; the final paths are shorter."""
    longest = partial_name(final) if inside is None else partial_name(final) / INNER / inside
    size, limit = len(os.fsencode(str(longest))), path_max(final)
    if size >= limit:
        raise RunFolderError(
            f"{what}: its files are written through paths of up to {size} bytes ('{longest.name}' ...), over the "
            f"{limit - 1} a path may have here; choose a shorter path"
        )


def check_folder_destination(final: Path, what: str, *, inside: str) -> None:
    """Refuse (RunFolderError naming ``what``), before anything loads, a folder write_folder could not write in
    the end: a name longer than its filesystem takes (check_name_length), a ``..`` after a folder that does not
    exist (a lexical reading takes it for the folder above, the kernel for no folder, and creating the missing one
    would leave a folder the command never writes), a mount point (mount_point_refusal), or one whose temporary
    paths pass PATH_MAX (check_path_length, ``inside``: the longest relative path written into it)."""
    check_name_length(final, what)
    dangling = dangling_parent_step(final, what)  # export_folded refuses it with the same words
    if dangling:
        raise RunFolderError(dangling)
    if is_mount_point(final):
        raise RunFolderError(mount_point_refusal(final, what))
    check_path_length(final, what, inside=inside)


def is_mount_point(folder: Path) -> bool:
    """Whether ``folder`` is a mount point: os.path.ismount (another device than its parent's), or a mount point the
    kernel lists (/proc/self/mountinfo, where there is one): a bind mount from the same filesystem (a container's
    volume) has its parent's device, and os.path.ismount does not see it."""
    if os.path.ismount(folder):
        return True
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:  # no such file (not Linux): os.path.ismount's answer
        return False
    where = os.path.realpath(folder)
    unescape = {"\\040": " ", "\\011": "\t", "\\012": "\n", "\\134": "\\"}
    for line in lines:
        fields = line.split(" ")
        if len(fields) > 4:
            point = fields[4]
            for code, char in unescape.items():
                point = point.replace(code, char)
            if point == where:
                return True
    return False


def mount_point_refusal(final: Path, what: str) -> str:
    """The one-line refusal of a destination folder that is a mount point (a container's volume): write_folder
    writes beside it and renames the new folder into place, and the kernel refuses to rename a mount point."""
    return (
        f"{what}: the folder is a mount point, which a write cannot replace by a rename; name a folder inside it "
        f"('{final / 'export'}')"
    )


def check_name_length(path: Path, what: str) -> None:
    """Refuse (RunFolderError naming ``what``), before anything loads, a ``path`` with a name longer than its
    filesystem takes: it could never be written, and the operating system's answer would come at the end."""
    limit = name_max(path)
    for part in path.parts:
        size = len(os.fsencode(part))
        if size > limit:
            raise RunFolderError(
                f"{what}: the name '{part[:40]}...' is {size} bytes long, over the {limit} its filesystem takes; "
                "choose a shorter name"
            )


def partial_name(path: Path) -> Path:
    """The hidden sibling this process writes ``path`` into before renaming it (``.NAME.partial-PID``)."""
    return temporary_name(path, "partial", os.getpid())


def old_name(path: Path) -> Path:
    """The hidden sibling this process moves the older folder ``path`` to while replacing it (``.NAME.old-PID``)."""
    return temporary_name(path, "old", os.getpid())


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
    return some_names(names)


def write_file(path: Path, text: str) -> None:
    """Write ``text`` into a hidden ``.NAME.partial-PID`` sibling, then rename it to ``path``: a kill leaves the old
    file or the new one, and the partial name is one the run folder knows as unfinished. A file already under that
    name is not this write's: it is refused (named), never written over."""
    tmp = partial_name(path)
    try:
        with open(tmp, "x") as handle:
            handle.write(text)
    except FileExistsError:
        raise RunFolderError(_in_the_way(tmp, path)) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


def write_folder(
    final: Path,
    write: Callable[[Path], None],
    *,
    before_rename: Optional[Callable[[list[str]], None]] = None,
    before_write: Optional[Callable[[], None]] = None,
    keep: Callable[[], Collection[str]] = tuple,
    abandoned: Callable[[Path], bool] = marked_and_abandoned,
) -> None:
    """``write`` a folder (a path that does not exist yet: ``w`` inside the hidden temporary ``.NAME.partial-PID``),
    then rename it to ``final``; on failure (the write's or the rename's) remove it.

    Nothing half-written ever carries the final name, and an older complete folder survives a failed
    rewrite under its name. ``before_rename`` receives the written files (relative) before the rename (a manifest
    records them); ``before_write`` is called once every check of ``final`` has passed, before anything is written
    (a WARNING of what the write replaces belongs after every refusal). A symbolic link at ``final`` is refused:
    its target is not ours to replace; so is a mount point, which no rename replaces. ``keep``: the files of the
    older ``final`` that are not the writer's (relative; asked once the new folder is written, just before the
    rename): they are moved into the new folder, never deleted, and a new file of the same name is refused
    before anything is replaced. ``abandoned``: whether a ``.NAME.partial-PID`` / ``.NAME.old-PID`` beside
    ``final`` is a killed write's leftover, deleted then (default: it carries the mark and its process is gone;
    a run folder: it recorded the name); one that is not, under a name this write needs, is refused (named).
    """
    if final.is_symlink() or (final.exists() and not final.is_dir()):
        raise RunFolderError(f"'{final}' is a symbolic link or a file; a folder written here would replace it")
    if is_mount_point(final):  # the commands refuse it before loading (check_folder_destination); the last guard
        raise RunFolderError(mount_point_refusal(final, f"'{final}'"))
    tmp, old = partial_name(final), old_name(final)
    remove_abandoned(final, "partial", abandoned)  # a killed write of ``final`` (SIGKILL, power loss) left these
    remove_abandoned(final, "export", abandoned)  # and a killed export_folded of it (it writes beside, then renames)
    if final.is_dir():
        remove_abandoned(final, "old", abandoned)  # ``final`` is whole: what a killed rewrite set aside is older
        remove_abandoned_inside(final)  # and what a killed export_folded into it left inside (never a user's file)
    for needed in (tmp, old) if final.is_dir() else (tmp,):
        if os.path.lexists(needed):
            raise RunFolderError(_in_the_way(needed, final))
    if before_write is not None:
        before_write()
    _make_container(tmp)
    new = tmp / INNER
    try:
        write(new)
        written = sorted(p.relative_to(new).as_posix() for p in new.rglob("*") if p.is_file())
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
        aside = _swap(final, new, tmp, old, kept)
        for relative in kept:
            (final / relative).parent.mkdir(parents=True, exist_ok=True)
            os.replace(aside / relative, final / relative)
        shutil.rmtree(aside if kept else old)
    else:
        try:
            os.replace(new, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    shutil.rmtree(tmp)
    remove_abandoned(final, "old", abandoned)  # earlier copies a killed rewrite set aside: ``final`` is whole again


def _swap(final: Path, new: Path, tmp: Path, old: Path, kept: Collection[str]) -> Path:
    """Set the older folder ``final`` aside and rename ``new`` into its place; returns where the older one is. A
    rename that fails (a busy folder) puts the older folder back under ``final`` and removes the temporary
    folders: a failed write never strands the finished one beside an older copy."""
    aside = temporary_name(final, "kept", os.getpid(), hidden=False) if kept else old / INNER
    try:
        if not kept:
            _make_container(old)
        os.replace(final, aside)
        try:
            os.replace(new, final)
        except BaseException:
            os.replace(aside, final)
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if not kept and not os.path.lexists(aside):  # else the older folder could not be put back: it stays there
            shutil.rmtree(old, ignore_errors=True)
        raise
    return aside


def _in_the_way(taken: Path, final: Path) -> str:
    """The refusal of a ``.NAME.partial-PID`` / ``.NAME.old-PID`` that a write of ``final`` needs but did not make."""
    return (
        f"'{taken}' is in the way of writing '{final}': hf-tapernorm writes through that name, and this one is not "
        "a leftover of its writes; nothing was written or deleted: move it away, then run this again"
    )


def _refuse_clashes(final: Path, written: list[str], keep: Collection[str]) -> None:
    """Refuse (RunFolderError, before anything is replaced) to write a file where a kept file is, or a folder."""
    taken = {*written, *(folder for relative in written for folder in folders_of(relative))}
    clashes = [relative for relative in keep if relative in taken or set(folders_of(relative)) & set(written)]
    if clashes:
        raise RunFolderError(
            f"'{final}' holds files this command did not write ({listing(clashes)}) where it writes its own; "
            "nothing was replaced: move them away, then run it again (a taper run: with --resume)"
        )


__all__ = [
    "DEFAULT_NAME_MAX",
    "DEFAULT_PATH_MAX",
    "INNER",
    "LEFTOVER",
    "WRITE_MARK",
    "check_folder_destination",
    "check_name_length",
    "check_path_length",
    "folders_of",
    "is_mount_point",
    "leftover_of",
    "listing",
    "marked_and_abandoned",
    "mount_point_refusal",
    "name_max",
    "old_name",
    "partial_name",
    "path_max",
    "temporary_name",
    "write_file",
    "write_folder",
    "writer_gone",
]
