"""``.hf_tapernorm_run.lock``: one command at a time in a folder (a taper run's folder, a fold's export folder).

The lock is created with O_EXCL and records its owner: the pid, the host, the process's start time
(``/proc/<pid>/stat`` field 22, where the system has it) and when it was taken. A lock whose owner is gone
is taken over: on the same host, a pid that no longer runs, or that now belongs to another process (its start
time is not the recorded one: a restarted container gives its first processes the same pids again). A lock
of another host (a shared disk, a container or pod restarted under a new hostname, a copied folder) cannot be
checked from here, so it is refused, and the message says how to tell that it is stale and which file to
delete.

A held folder is held with everything in it: every command that writes (taper, fold, ``eval --output_json``,
``bench --output_dir``) or uploads (push) looks for a live lock at its destination and in every folder above
it, on the resolved path (a symbolic link into a running run leads into that run), through one check
(:func:`refuse_while_running`; :func:`check_destination` adds a file on the way and an unwritable place).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any, Optional

from ..errors import ConfigurationError

logger = logging.getLogger(__name__)

LOCK_NAME = ".hf_tapernorm_run.lock"


class RunFolderError(ConfigurationError):
    """The output folder cannot be used as asked (the message says why and lists foreign files)."""


def process_start_time(pid: int) -> Optional[int]:
    """When process ``pid`` started (clock ticks since boot, ``/proc/<pid>/stat`` field 22), or None where the
    system does not say (no ``/proc``) or there is no such process. With the pid it names one process for good."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()  # the command name (field 2) may hold spaces and parentheses
    try:
        return int(fields[22 - 3])  # fields[0] is field 3
    except (IndexError, ValueError):
        return None


class RunLock:
    """``.hf_tapernorm_run.lock`` in ``folder``: see the module docstring."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.path = folder / LOCK_NAME
        self.created_folder = False
        self.held = False

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
        try:
            self.created_folder = not self.folder.exists()
            self.folder.mkdir(parents=True, exist_ok=True)
            for _ in range(2):
                try:
                    descriptor = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                except FileExistsError:
                    if not self._owner_is_gone():
                        raise RunFolderError(
                            f"output folder '{self.folder}' is in use by another hf-tapernorm command "
                            f"({self.owner_text()}); wait for it to finish, or choose another --output_dir"
                        ) from None
                    logger.warning("taking over the lock of %s: %s", self.folder, self._why_gone())
                    self.path.unlink(missing_ok=True)
                    continue
                with os.fdopen(descriptor, "w") as handle:
                    json.dump(_this_process(), handle)
                self.held = True
                return
        except OSError as error:
            reason = errno.errorcode.get(error.errno, "") if error.errno else ""
            raise RunFolderError(
                f"cannot write into output folder '{self.folder}': {error.strerror or error} {reason}".rstrip()
                + "; choose a writable --output_dir"
            ) from None
        raise RunFolderError(f"output folder '{self.folder}': cannot take its lock {self.path}")

    def _owner(self) -> dict[str, Any]:
        try:
            owner = json.loads(self.path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return {}
        return owner if isinstance(owner, dict) else {}

    def owner_text(self) -> str:
        """Who holds the lock, how to tell that it is stale, and the file to delete then (one line)."""
        owner = self._owner()
        if not isinstance(owner.get("pid"), int):
            return (
                f"its lock {self.path} is unreadable; if no hf-tapernorm command is using the folder, the lock is "
                f"stale: delete {self.path}"
            )
        pid, host, since = owner["pid"], owner.get("host"), owner.get("since")
        return (
            f"pid {pid} on host {host}{f' since {since}' if since else ''}; if no hf-tapernorm command runs as pid "
            f"{pid} on {host} (it was killed, its container or pod restarted, or the folder was copied), the lock is "
            f"stale: delete {self.path}"
        )

    def _why_gone(self) -> Optional[str]:
        """Why the lock's owner is gone (its process ended, or its pid now names another process), or None."""
        owner = self._owner()
        pid, host, started = owner.get("pid"), owner.get("host"), owner.get("started")
        if not isinstance(pid, int) or host != socket.gethostname():
            return None  # another machine's (a shared disk) or unreadable: not ours to judge
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return f"its process {pid} is gone"
        except PermissionError:
            pass  # alive, another user's: its start time still tells whether it is the lock's owner
        now = process_start_time(pid)
        if isinstance(started, int) and now is not None and now != started:
            return f"pid {pid} now belongs to another process (started at another time than the lock's owner)"
        return None

    def _owner_is_gone(self) -> bool:
        return self._why_gone() is not None

    def held_by_another(self) -> Optional[str]:
        """Who holds this folder's lock (owner_text), when another live command does (None: free, or its owner is
        gone)."""
        if self.held or not self.path.is_file() or self._owner_is_gone():
            return None
        return self.owner_text()

    def release(self) -> None:
        if not self.held:
            return
        self.path.unlink(missing_ok=True)
        self.held = False
        if self.created_folder and self.folder.is_dir() and not any(self.folder.iterdir()):
            self.folder.rmdir()  # a command refused before it wrote anything leaves no folder behind


def _this_process() -> dict[str, Any]:
    """The lock's record of its owner: this process."""
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": process_start_time(os.getpid()),
        "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def running_command_around(path: Path, *, above: bool = False) -> Optional[tuple[Path, str]]:
    """The folder at (unless ``above``) or above ``path`` that a live hf-tapernorm command holds, with its owner; or
    None. The path is resolved first: a symbolic link into a held folder leads into that folder."""
    resolved = Path(path).expanduser().resolve()
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
    running = running_command_around(path, above=above)
    if running is None:
        return
    folder, owner = running
    where = (
        "is in use: a running hf-tapernorm command owns it"
        if folder == Path(path).expanduser().resolve()
        else f"lies in '{folder}', which a running hf-tapernorm command owns"
    )
    raise RunFolderError(f"{what} {where} ({owner}); {advice}")


def unreadable_place(what: str, error: OSError) -> str:
    """The one-line refusal of a destination whose folder this user cannot look into (``error``)."""
    where = f" '{error.filename}'" if error.filename else ""
    return f"{what}: cannot read the folder{where} ({error.strerror or error}); choose a folder you can read and write"


def check_destination(
    folder: Path, what: str, *, advice: str, above: bool = False, renamed_into_parent: bool = False
) -> None:
    """Refuse (RunFolderError) a folder a command is about to write, before it loads anything: a file on the way
    to it, a live hf-tapernorm command holding it or a folder around it (refuse_while_running: ``advice`` says
    what to do then; ``above``: the folder's own lock is the caller's business), a place it cannot write into
    (the folder, or its first existing parent; ``renamed_into_parent``: the folder is written beside itself and
    renamed into place, so what must be writable is the first existing folder above it)."""
    folder = Path(folder).expanduser()
    try:
        for parent in [folder, *folder.parents]:
            if parent.exists() and not parent.is_dir():
                raise RunFolderError(f"{what} is a file" if parent == folder else f"{what}: '{parent}' is a file")
        refuse_while_running(folder, what, advice=advice, above=above)
        candidates = folder.parents if renamed_into_parent else [folder, *folder.parents]
        writable_from = next(p for p in candidates if p.exists())  # the written files land in there
    except OSError as error:  # a folder on the way that this user cannot read (Path.exists raises EACCES)
        raise RunFolderError(unreadable_place(what, error)) from None
    if not os.access(writable_from, os.W_OK | os.X_OK):
        raise RunFolderError(f"{what}: '{writable_from}' is not writable; choose a writable --output_dir")


__all__ = [
    "LOCK_NAME",
    "RunFolderError",
    "RunLock",
    "check_destination",
    "process_start_time",
    "refuse_while_running",
    "running_command_around",
    "unreadable_place",
]
