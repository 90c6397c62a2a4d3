"""``.hf_tapernorm_run.lock``: one command at a time in a folder (a taper run's folder, a fold's export folder).

The lock is held by whoever holds an exclusive ``flock`` on the file its path names, for as long as the command
runs (the file stays open). Taking it is atomic: of two commands that find the same stale lock at once, the
second one's flock fails while the first holds it; a lock file is deleted only by its holder, and a command that
locked a file the path no longer names (its holder released it meanwhile) tries again.

The file records its owner: the pid, the host, the process's start time (``/proc/<pid>/stat`` field 22, where
the system has it) and when it was taken; it names the owner in messages, and it judges a lock whose flock no one
holds. On this host, one whose process is gone, or whose pid now belongs to another process (its start time is
not the recorded one: a restarted container gives its first processes the same pids again), is taken over, as is
an empty one (its command was killed as it took it); one whose process runs is not (a command that kept no
flock). A lock of another host (a shared disk, a container or pod restarted under a new hostname, a copied
folder) cannot be checked from here, so it is refused, and the message says how to tell that it is stale and
which file to delete. A lock that is not a regular file is refused and never read (a named pipe blocks its
reader). A record whose pid is no pid (not an integer in 1 .. 2**31 - 1) is unreadable: refused, naming the file.

A flock belongs to the open file, and a process forked from the holder (a DataLoader worker, a fork-based pool)
shares it: were the holder killed, that child would hold the lock for a command that is gone. A child forked
through ``os.fork`` closes its copy at once (``os.register_at_fork``), so the lock ends with its command; a
process that still holds it otherwise (forked outside Python) is named as such, with the recorded pid gone.

A held folder is held with everything in it: every command that writes (taper, fold, ``eval --output_json``,
``bench --output_dir``, the datasets cache of ``--data_cache_dir``) or uploads (push) looks for a live lock at its
destination and in every folder above it, on the resolved path (a symbolic link into a running run leads into that
run), through one check (:func:`refuse_while_running`; :func:`check_destination` adds a file on the way and an
unwritable place). A path through a symbolic link loop is refused there in one line (:func:`resolved_path`).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
from pathlib import Path
from typing import Optional

from .._lock_file import (
    RECORD_BYTES,
    NotALockFile,
    flocked,
    live_owner,
    look_at_lock,
    open_lock_file,
    owner_text,
    parsed_record,
    process_start_time,
    this_process_record,
    why_gone,
)
from .._temporaries import is_pid, process_running
from ..errors import ConfigurationError
from ..export.manifest import LOCK_NAME
from ..utils import expand_user

logger = logging.getLogger(__name__)

#: How often a lock released meanwhile (the path names another file, or none) is taken again.
_TAKE_TRIES = 10


def _file_id(status: os.stat_result) -> tuple[int, int]:
    return status.st_dev, status.st_ino


class RunFolderError(ConfigurationError):
    """The output folder cannot be used as asked (the message says why and lists foreign files)."""


#: The locks this process holds (until released, whether or not their RunLock is still referenced): a child it
#: forks closes its copies of their files (see the module docstring).
_HELD: set[RunLock] = set()


def _let_go_in_child() -> None:
    """In a forked child: close the inherited lock files without unlocking them (flock's LOCK_UN would free the
    parent's lock too); the parent keeps holding them, and a child of a killed holder no longer does."""
    for lock in list(_HELD):
        if lock._descriptor is not None:
            os.close(lock._descriptor)
        lock._descriptor, lock.held = None, False
    _HELD.clear()


os.register_at_fork(after_in_child=_let_go_in_child)


class RunLock:
    """``.hf_tapernorm_run.lock`` in ``folder``: see the module docstring."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.path = folder / LOCK_NAME
        self.created_folders: list[Path] = []  # by mkdir, deepest first: removed again while empty
        self.held = False
        self._descriptor: Optional[int] = None  # the open lock file whose flock this process holds

    def acquire(self) -> None:
        """Take the lock (creating the folder); RunFolderError when another live command holds it, or holds a
        folder above it (looked for again once the lock is held: of two commands starting at once, one inside
        the other's folder, the inner one sees the outer lock, or the outer one finds the inner one's lock in its
        folder and names that command)."""
        what, advice = f"output folder '{self.folder}'", "wait for it to finish, or choose a folder outside it"
        check_destination(self.folder, what, advice=advice, above=True)
        self._take()
        try:
            refuse_while_running(self.folder, what, advice=advice, above=True)
            self._refuse_running_inside(what)
        except RunFolderError:
            self.release()
            raise

    def _refuse_running_inside(self, what: str) -> None:
        """Refuse (RunFolderError) a folder holding a folder that a live hf-tapernorm command holds: that command
        writes there, so its files are neither this command's to replace nor a user's to move away."""
        for root, dirs, names in os.walk(self.folder):
            if Path(root) != self.folder and LOCK_NAME in names:
                owner = RunLock(Path(root)).held_by_another()
                if owner is not None:
                    inner = Path(root).relative_to(self.folder).as_posix()
                    raise RunFolderError(
                        f"{what} holds '{inner}', which a running hf-tapernorm command owns ({owner}); wait for it "
                        "to finish, or choose another --output_dir"
                    )
            dirs[:] = [d for d in dirs if not Path(root, d).is_symlink()]

    def _take(self) -> None:
        """Hold the lock: an exclusive flock on the file the path names (created if there is none), then this
        process's record written into it; RunFolderError when another live command holds it."""
        try:
            self.created_folders = [p for p in [self.folder, *self.folder.parents] if not os.path.lexists(p)]
            self.folder.mkdir(parents=True, exist_ok=True)
            for _ in range(_TAKE_TRIES):
                try:
                    descriptor = self._open(os.O_RDWR | os.O_CREAT)
                except PermissionError:
                    if not self.path.exists():
                        raise  # a folder this user cannot write into
                    owner = self.held_by_another()  # another user's lock file: whether it is held still decides
                    if owner is not None:
                        raise self._in_use(owner) from None
                    raise RunFolderError(
                        f"output folder '{self.folder}': its lock {self.path} is stale, but this user cannot open it "
                        f"for writing ({self._unwritable_why()}), so it cannot be taken over: delete it"
                    ) from None
                try:
                    taken = self._take_file(descriptor)
                except BaseException:
                    os.close(descriptor)
                    raise
                if taken:
                    self._descriptor, self.held = descriptor, True
                    _HELD.add(self)
                    return
                os.close(descriptor)
        except OSError as error:
            reason = errno.errorcode.get(error.errno, "") if error.errno else ""
            raise RunFolderError(
                f"cannot write into output folder '{self.folder}': {error.strerror or error} {reason}".rstrip()
                + "; choose a writable --output_dir"
            ) from None
        raise RunFolderError(f"output folder '{self.folder}': cannot take its lock {self.path}")

    def _take_file(self, descriptor: int) -> bool:
        """Take the lock through the open lock file ``descriptor``; False when the path no longer names that file
        (released meanwhile: try again), RunFolderError when another live command holds it."""
        if not flocked(descriptor, fcntl.LOCK_EX):
            raise self._in_use(self.owner_text(os.pread(descriptor, RECORD_BYTES, 0)))
        if self._named() != _file_id(os.fstat(descriptor)):
            return False
        record = os.pread(descriptor, RECORD_BYTES, 0)
        if record:
            why = why_gone(parsed_record(record))
            if why is None:
                raise self._in_use(self.owner_text(record))
            logger.warning("taking over the lock of %s: %s", self.folder, why)
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, this_process_record(), 0)
        return True

    def _unwritable_why(self) -> str:
        """Why this user cannot open the lock file for writing: its mode, or its owner."""
        status = os.lstat(self.path)
        if status.st_uid == os.geteuid():
            return f"it is read-only, mode {stat.S_IMODE(status.st_mode):04o}"
        return "it is another user's file"

    def _in_use(self, owner: str) -> RunFolderError:
        return RunFolderError(
            f"output folder '{self.folder}' is in use by another hf-tapernorm command ({owner}); wait for it to "
            "finish, or choose another --output_dir"
        )

    def _named(self) -> Optional[tuple[int, int]]:
        """The file the lock's path names now (device, inode), or None."""
        try:
            return _file_id(os.lstat(self.path))
        except FileNotFoundError:
            return None

    def _open(self, flags: int) -> int:
        """The lock file opened (open_lock_file); RunFolderError, without opening it, when it is not a regular file."""
        try:
            return open_lock_file(self.path, flags)
        except NotALockFile as not_a_file:
            raise RunFolderError(
                f"output folder '{self.folder}': its lock {self.path} is {not_a_file.kind}, not a file hf-tapernorm "
                "wrote; remove it if no hf-tapernorm command is using the folder, or choose another --output_dir"
            ) from None

    def owner_text(self, record: bytes) -> str:
        """Who holds the lock (``record``: the lock file's content): _lock_file.owner_text."""
        return owner_text(self.path, record)

    def held_by_another(self) -> Optional[str]:
        """Who holds this folder's lock (owner_text), when another live command does (None: free, or its owner is
        gone). It only looks: a lock that is not a regular file is no lock of ours here, and is never read."""
        return None if self.held else live_owner(self.path)

    def is_stale(self) -> bool:
        """Whether the path is a lock file a gone command left (LockLook.stale; not another host's, nor unreadable)."""
        try:
            look = None if self.held else look_at_lock(self.path)
            return look is not None and look.stale
        except OSError:
            return False

    def remove_stale(self) -> None:
        """Delete the lock file when it is stale, as a command taking it takes it over (under its exclusive flock):
        of this and a command taking it at the same moment, one holds it first, the other is refused or finds none."""
        if self.is_stale():
            self._take()
            self.release()

    def release(self) -> None:
        """Delete the lock file (while its flock is still held, so no one takes the file being deleted), then let
        go of it; the folder too when the lock created it and it is still empty, and the ones above it created with
        it (``--output_dir new/run``: no stray new/)."""
        if not self.held or self._descriptor is None:
            return
        try:
            if self._named() == _file_id(os.fstat(self._descriptor)):
                self.path.unlink()
        finally:
            os.close(self._descriptor)
            self._descriptor, self.held = None, False
            _HELD.discard(self)
        for folder in self.created_folders:  # a command refused before it wrote anything leaves no folder behind
            if not folder.is_dir() or any(folder.iterdir()):
                break
            folder.rmdir()


def resolved_path(path: str | os.PathLike, what: str) -> Path:
    """``path`` expanded (expand_user) with every symbolic link followed; RunFolderError naming ``what`` and the link
    when one on the way leads back into itself (Path.resolve raises RuntimeError there up to Python 3.12)."""
    path = expand_user(path, what)
    try:
        resolved = path.resolve()
        os.stat(resolved)
    except RuntimeError:
        pass
    except OSError as error:
        if error.errno != errno.ELOOP:
            return resolved  # a missing part (to be created) or one this user cannot read: the callers' to tell
    else:
        return resolved
    looping = next((p for p in [*reversed(path.absolute().parents), path.absolute()] if _loops(p)), path)
    raise RunFolderError(
        f"{what}: the symbolic link '{looping}' on the way leads back into itself (a loop); fix or remove it"
    )


def _loops(path: Path) -> bool:
    try:
        os.stat(path)
    except OSError as error:
        return error.errno == errno.ELOOP
    return False


def running_command_around(path: Path, *, above: bool = False) -> Optional[tuple[Path, str]]:
    """The folder at (unless ``above``) or above ``path`` that a live hf-tapernorm command holds, with its owner; or
    None. The path is resolved first: a symbolic link into a held folder leads into that folder."""
    resolved = resolved_path(path, f"'{path}'")
    for folder in [*([] if above else [resolved]), *resolved.parents]:
        owner = RunLock(folder).held_by_another()
        if owner is not None:
            return folder, owner
    return None


def refuse_while_running(
    path: Path, what: str, *, advice: str = "wait for it to finish, then run this again", above: bool = False
) -> None:
    """Refuse (RunFolderError) to use ``path`` (``what``: how the message names it) while a live hf-tapernorm command
    holds it or a folder around it (``above``: only the folders around it): that command is writing there (a
    taper run its checkpoints and export, a fold its folder), so what is read now may be half one export, half
    another, and what is written now may be replaced by that command's next write. The one check every command
    that writes (taper, fold, eval --output_json, bench --output_dir) or reads an export to upload (push) makes."""
    resolved = resolved_path(path, what)
    running = running_command_around(resolved, above=above)
    if running is None:
        return
    folder, owner = running
    where = (
        "is in use: a running hf-tapernorm command owns it"
        if folder == resolved
        else f"lies in '{folder}', which a running hf-tapernorm command owns"
    )
    raise RunFolderError(f"{what} {where} ({owner}); {advice}")


def unreadable_place(what: str, error: OSError) -> str:
    """The one-line refusal of a destination whose folder this user cannot look into (``error``)."""
    where = f" '{error.filename}'" if error.filename else ""
    return f"{what}: cannot read the folder{where} ({error.strerror or error}); choose a folder you can read and write"


def check_destination(
    folder: Path,
    what: str,
    *,
    advice: str,
    above: bool = False,
    renamed_into_parent: bool = False,
    option: str = "--output_dir",
) -> None:
    """Refuse (RunFolderError) a folder a command is about to write, before it loads anything: a file on the way
    to it, a live hf-tapernorm command holding it or a folder around it (refuse_while_running: ``advice`` says
    what to do then; ``above``: the folder's own lock is the caller's business), a place it cannot write into
    (the folder, or its first existing parent; ``renamed_into_parent``: the folder is written beside itself and
    renamed into place, so what must be writable is the first existing folder above it; ``option``: the option that
    names the folder, which the unwritable place's message asks to change)."""
    folder = expand_user(folder, what)
    try:
        for parent in [folder, *folder.parents]:
            if parent.exists() and not parent.is_dir():
                raise RunFolderError(f"{what} is a file" if parent == folder else f"{what}: '{parent}' is a file")
        refuse_while_running(folder, what, advice=advice, above=above)
        above_it = folder.absolute().parents  # `.` has no parents of its own
        candidates = above_it if renamed_into_parent else [folder, *above_it]
        writable_from = next(p for p in candidates if p.exists())  # the written files land in there
    except OSError as error:  # a folder on the way that this user cannot read (Path.exists raises EACCES)
        raise RunFolderError(unreadable_place(what, error)) from None
    if not os.access(writable_from, os.W_OK | os.X_OK):
        raise RunFolderError(f"{what}: '{writable_from}' is not writable; choose a writable {option}")


__all__ = [
    "LOCK_NAME",
    "RunFolderError",
    "RunLock",
    "check_destination",
    "is_pid",
    "process_running",
    "process_start_time",
    "refuse_while_running",
    "resolved_path",
    "running_command_around",
    "unreadable_place",
]
