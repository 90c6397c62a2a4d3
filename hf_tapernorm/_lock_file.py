"""Reading a ``.hf_tapernorm_run.lock`` file: whether its flock is held, who its record names, whether they are gone.

The lock itself (taking, holding and releasing it, the messages of the commands it refuses) is app/run_lock.py's.
The export layer reads the same file (export_folded refuses to replace an export a push is uploading, and takes a
killed command's lock for the package's own), and it sits below app/; so the reading lives here, one layer down,
and both judge a lock alike: held while someone holds its flock, stale when no one does and its record is empty (its
command was killed as it took it) or names a process of this host that is gone or whose pid now names another.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import stat
import time
from pathlib import Path
from typing import Any, NamedTuple, Optional

from ._temporaries import is_pid, process_running

#: How long a flock is asked for before the lock counts as held: another command's look at the lock holds a
#: shared flock for a moment; a holder holds its exclusive one for the whole command.
_FLOCK_TRIES, _FLOCK_PAUSE = 10, 0.002
#: The most of a lock file read: a record is one short JSON line.
RECORD_BYTES = 65536
#: What a lock path names when it is no regular file (never opened for reading: a named pipe blocks its reader).
FILE_KINDS = {
    stat.S_IFIFO: "a named pipe",
    stat.S_IFLNK: "a symbolic link",
    stat.S_IFDIR: "a folder",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a device",
    stat.S_IFBLK: "a device",
}


class NotALockFile(Exception):
    """The lock's path names something other than a regular file (``kind``: FILE_KINDS' words)."""

    def __init__(self, path: Path, kind: str) -> None:
        super().__init__(f"{path} is {kind}")
        self.kind = kind


class LockLook(NamedTuple):
    """What a look at a lock file found: whether no one holds its flock, and its record (its owner, as bytes)."""

    free: bool
    record: bytes

    @property
    def stale(self) -> bool:
        """Free, and left by a command that is gone: its record is empty or names an owner that is gone."""
        return self.free and (not self.record or why_gone(parsed_record(self.record)) is not None)

    @property
    def held_here(self) -> bool:
        """Held, by this process (its record names this pid and host): a command writing inside the folder it holds
        (a taper run its folded/) is not another command at work there."""
        owner = parsed_record(self.record)
        return not self.free and pid_of(owner) == os.getpid() and owner.get("host") == socket.gethostname()


def process_start_time(pid: int) -> Optional[int]:
    """When process ``pid`` started (clock ticks since boot, ``/proc/<pid>/stat`` field 22), or None where the
    system does not say (no ``/proc``) or there is no such process. With the pid it names one process for good."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat_line[stat_line.rfind(")") + 2 :].split()  # the command name (field 2) may hold spaces, parentheses
    try:
        return int(fields[22 - 3])  # fields[0] is field 3
    except (IndexError, ValueError):
        return None


def flocked(descriptor: int, operation: int) -> bool:
    """Whether the flock ``operation`` (LOCK_EX, LOCK_SH) was granted, asked for a moment without blocking."""
    for attempt in range(_FLOCK_TRIES):
        try:
            fcntl.flock(descriptor, operation | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if attempt + 1 < _FLOCK_TRIES:
                time.sleep(_FLOCK_PAUSE)
    return False


def parsed_record(record: bytes) -> dict[str, Any]:
    """A lock's record as a dict ({} when it is not one)."""
    try:
        owner = json.loads(record.decode())
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return owner if isinstance(owner, dict) else {}


def pid_of(owner: dict[str, Any]) -> Optional[int]:
    """The pid a record names, or None when it is no pid (``is_pid``)."""
    pid = owner.get("pid")
    return pid if is_pid(pid) else None


def why_gone(owner: dict[str, Any]) -> Optional[str]:
    """Why the recorded ``owner`` is gone (its process ended, or its pid now names another process), or None: alive,
    unreadable, or another host's (a shared disk), which only that host can judge."""
    pid, host, started = pid_of(owner), owner.get("host"), owner.get("started")
    if pid is None or host != socket.gethostname():
        return None
    if not process_running(pid):
        return f"its process {pid} is gone"
    now = process_start_time(pid)  # alive: its start time tells whether it is still the lock's owner
    if isinstance(started, int) and now is not None and now != started:
        return f"pid {pid} now belongs to another process (started at another time than the lock's owner)"
    return None


def owner_text(path: Path, record: bytes) -> str:
    """Who holds the lock at ``path`` (``record``: its content), how to tell that it is stale, and the file to delete
    then (one line)."""
    owner = parsed_record(record)
    pid = pid_of(owner)
    if pid is None:
        return (
            f"its lock {path} is unreadable; if no hf-tapernorm command is using the folder, the lock is stale: "
            f"delete {path}"
        )
    why = why_gone(owner)
    if why is not None:  # asked of a held flock only: a process the owner started holds it
        return (
            f"a process that pid {pid} started still holds its lock {path} ({why}: a child it forked keeps the lock "
            "file open); wait for that process to end, or stop it"
        )
    host, since = owner.get("host"), owner.get("since")
    return (
        f"pid {pid} on host {host}{f' since {since}' if since else ''}; if no hf-tapernorm command runs as pid {pid} "
        f"on {host} (it was killed, its container or pod restarted, or the folder was copied), the lock is stale: "
        f"delete {path}"
    )


def live_owner(path: Path, *, this_process_too: bool = True) -> Optional[str]:
    """Who holds the lock at ``path`` (owner_text), when a live command does; None when there is none, it is stale,
    or it is no regular file (no lock of ours, never read); unless ``this_process_too``, None for a lock this process
    holds too. A lock this user cannot read is held by someone it cannot name; a folder on the way this user cannot
    search raises PermissionError, for the caller to name."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return None
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        look = look_at_lock(path)
    except PermissionError:
        return owner_text(path, b"")
    if look is None or look.stale or (look.held_here and not this_process_too):
        return None
    return owner_text(path, look.record)


def remove_stale_lock(path: Path) -> Optional[str]:
    """Delete the lock file at ``path`` where it is stale (LockLook.stale), as a command taking it over and letting it
    go would, under its exclusive flock (a command taking it at the same moment finds the path names no file it
    locked, and tries again); returns why it was stale, None where nothing was deleted (none, held, or not stale)."""
    try:
        descriptor = open_lock_file(path, os.O_RDWR)
    except (OSError, NotALockFile):  # none, or one this user cannot write: not this caller's to delete
        return None
    try:
        if not flocked(descriptor, fcntl.LOCK_EX):
            return None
        status, named = os.fstat(descriptor), os.lstat(path)
        if (status.st_dev, status.st_ino) != (named.st_dev, named.st_ino):
            return None  # taken and let go meanwhile: another file now
        record = os.pread(descriptor, RECORD_BYTES, 0)
        why = why_gone(parsed_record(record)) if record else "it is empty (its command was killed as it took it)"
        if why is not None:
            os.unlink(path)
        return why
    except FileNotFoundError:
        return None
    finally:
        os.close(descriptor)


def this_process_record() -> bytes:
    """The lock's record of its owner, this process: its pid, host, start time, and when it took the lock."""
    return json.dumps(
        {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": process_start_time(os.getpid()),
            "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        }
    ).encode()


def open_lock_file(path: Path, flags: int) -> int:
    """The lock file opened without following a link and without waiting (``flags``: os.O_RDONLY, os.O_RDWR |
    os.O_CREAT); NotALockFile, without opening it, when it is not a regular file."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = stat.S_IFREG
    if stat.S_ISREG(mode):
        descriptor = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        mode = os.fstat(descriptor).st_mode
        if stat.S_ISREG(mode):
            return descriptor
        os.close(descriptor)  # replaced between the look and the open
    raise NotALockFile(path, FILE_KINDS.get(stat.S_IFMT(mode), "no file"))


def look_at_lock(path: Path) -> Optional[LockLook]:
    """Whether the lock file at ``path`` is free (a shared flock granted for a moment) and its record; None when
    there is none or it is no regular file. An unreadable one raises PermissionError, for the caller to judge."""
    try:
        descriptor = open_lock_file(path, os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError, NotALockFile):
        return None
    try:
        free = flocked(descriptor, fcntl.LOCK_SH)
        if free:
            fcntl.flock(descriptor, fcntl.LOCK_UN)
        return LockLook(free, os.pread(descriptor, RECORD_BYTES, 0))
    finally:
        os.close(descriptor)


__all__ = [
    "FILE_KINDS",
    "LockLook",
    "NotALockFile",
    "RECORD_BYTES",
    "flocked",
    "live_owner",
    "look_at_lock",
    "open_lock_file",
    "owner_text",
    "parsed_record",
    "pid_of",
    "process_start_time",
    "remove_stale_lock",
    "this_process_record",
    "why_gone",
]
