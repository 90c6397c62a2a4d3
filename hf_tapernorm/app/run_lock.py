"""``.hf_tapernorm_run.lock``: one command at a time in a folder (a taper run's folder, a fold's export folder).

The lock is created with O_EXCL and records its owner: the pid, the host, the process's start time
(``/proc/<pid>/stat`` field 22, where the system has it) and when it was taken. A lock whose owner is gone
is taken over: on the same host, a pid that no longer runs, or that now belongs to another process (its start
time is not the recorded one: a restarted container gives its first processes the same pids again). A lock
of another host (a shared disk, a container or pod restarted under a new hostname, a copied folder) cannot be
checked from here, so it is refused, and the message says how to tell that it is stale and which file to
delete.
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
        """Take the lock (creating the folder); RunFolderError when another live command holds it."""
        for parent in [self.folder, *self.folder.parents]:
            if parent.exists() and not parent.is_dir():
                raise RunFolderError(f"output folder '{self.folder}': '{parent}' is a file")
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


def running_command_around(path: Path) -> Optional[tuple[Path, str]]:
    """The folder at or above ``path`` that a live hf-tapernorm command holds, with its owner; or None."""
    resolved = Path(os.path.abspath(path))
    for folder in [resolved, *resolved.parents]:
        owner = RunLock(folder).held_by_another()
        if owner is not None:
            return folder, owner
    return None


def refuse_while_running(path: Path, what: str) -> None:
    """Refuse (RunFolderError) to read ``path`` (``what``: the option naming it) while a live hf-tapernorm command
    holds it or a folder around it: that command is writing it (a taper run its export, a fold its folder), so
    what is read now may be half one export, half another."""
    path = Path(path).expanduser().resolve()  # a link into a held folder is that folder
    running = running_command_around(path)
    if running is None:
        return
    folder, owner = running
    where = (
        "is in use: a running hf-tapernorm command owns it"
        if folder == path
        else f"lies in '{folder}', which a running hf-tapernorm command owns"
    )
    raise RunFolderError(f"{what} {where} ({owner}); wait for it to finish, then run this again")


__all__ = [
    "LOCK_NAME",
    "RunFolderError",
    "RunLock",
    "process_start_time",
    "refuse_while_running",
    "running_command_around",
]
