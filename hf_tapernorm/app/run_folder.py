"""A run folder that knows what it wrote: the manifest, the lock, the overwrite/resume policy.

Every file a run creates in its folder is recorded in ``.hf_tapernorm_run.json`` before the file gets its
final name (exports and reports are registered first, then written or renamed into place; a Trainer checkpoint
is recorded as soon as it is saved, and one the run has not recorded yet is the run's), so a run killed at any
point finds only its own files on ``--resume`` or ``--overwrite``. Only what the run writes is recorded: a file
someone puts into the folder, or into one of its output folders, while the run works stays foreign, and an
output folder the run replaces keeps it where it is. A later command may replace or continue the folder only
when nothing else is in it: a folder holding a file the manifest does not list, or one that no run of ours
wrote, is refused with the foreign files named (with or without ``--overwrite``), and nothing is deleted
before every argument, the model and the data have been checked.

The manifest is data a user can edit, so it is never trusted as a list of paths: an entry that is absolute,
climbs with ``..``, passes through a symbolic link or resolves outside the folder is refused before anything
is deleted, and a folder holding symbolic links is refused before any work. ``.hf_tapernorm_run.lock``
(run_lock.py) keeps a second command out of a folder in use. A half-written output never carries its final name
(folder_writes.py), and a leftover of such a write is the run's to delete only under the exact name (with the
writer's pid) that the manifest recorded, in ``writes``, before the write created it: a user's ``.folded.old-2023/``
is foreign, and one of a run killed mid-write is the run's.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable, Collection, Iterable
from fnmatch import fnmatchcase
from pathlib import Path, PurePosixPath
from typing import Any, Optional

from .._temporaries import abandoned_write_folder
from ..export.manifest import export_files
from .checkpoint_files import checkpoint_of as _checkpoint_of
from .checkpoint_files import unrecorded_checkpoints
from .folder_writes import (
    LEFTOVER,
    folders_of,
    leftover_of,
    old_name,
    partial_name,
    write_file,
    write_folder,
)
from .folder_writes import listing as _listing
from .run_lock import LOCK_NAME, RunFolderError, RunLock, resolved_path

logger = logging.getLogger(__name__)

MANIFEST_NAME = ".hf_tapernorm_run.json"
#: Bookkeeping files of the folder itself: never listed, never foreign.
_BOOKKEEPING = (MANIFEST_NAME, MANIFEST_NAME + ".tmp", LOCK_NAME)
#: The Trainer's TensorBoard logs (``--report_to tensorboard``), the run's and its baseline run's. In them, the
#: files its writer writes (``TRAINER_LOG_FILES``, in a subfolder per run) are the run's, recorded or not (the
#: Trainer writes them as it goes); anything else there is someone else's.
TRAINER_LOGS = ("runs/", "baseline/runs/")
TRAINER_LOG_FILES = "events.out.tfevents.*"


def _is_trainer_log(relative: str) -> bool:
    """``relative`` is an event file the Trainer's TensorBoard writer wrote into one of its log folders."""
    return relative.startswith(TRAINER_LOGS) and fnmatchcase(relative.rpartition("/")[2], TRAINER_LOG_FILES)


def _is_output(relative: str, outputs: Iterable[str]) -> bool:
    """``relative`` is one of ``outputs`` (a file name) or lies in one of its folders (names ending in "/"); in the
    Trainer's log folders, only its event files are (whatever folder of ``outputs`` holds them)."""
    if relative.startswith(TRAINER_LOGS):
        return _is_trainer_log(relative)
    return any(relative == o or (o.endswith("/") and relative.startswith(o)) for o in outputs)


def _names(value: Any) -> list[str]:
    """The text items of a manifest list (a hand-edited manifest may hold anything there)."""
    return [item for item in value if isinstance(item, str)] if isinstance(value, list) else []


def _options_file_hint(files: list[str]) -> str:
    """A refusal's last words when a foreign file may be the command's own options file (``taper run.json`` with
    ``output_dir`` the folder run.json is in): no run of ours wrote it, so it blocks that folder for good."""
    options = [f for f in files if "/" not in f and f.lower().endswith((".json", ".yaml", ".yml"))]
    return (
        f"; if {options[0]} is this command's options file, keep it outside the --output_dir it names"
        if options
        else ""
    )


class RunFolder:
    """The output folder of one command, with its manifest and lock.

    ``outputs``: the names the command writes besides its checkpoints (files, or folders ending in "/"): a lost
    manifest is rebuilt from them on ``--resume``, and an interrupted write of one of them leaves a leftover of
    the command's (folder_writes.py). ``adopted``: folders a library fills while the command runs (a datasets cache
    inside the run folder), whose files are the command's; in the Trainer's log folders (``TRAINER_LOGS``) only its
    event files are. Only these, the checkpoints and the files a write registers are ever recorded as the
    command's: a file someone else puts into the folder (or into an output folder) while the command runs stays
    foreign, so no later ``--overwrite`` deletes it.
    """

    def __init__(self, path: str | os.PathLike, outputs: Iterable[str] = (), adopted: Iterable[str] = ()) -> None:
        self.path = Path(path)
        self.outputs = tuple(outputs)
        self.adopted = tuple(adopted)
        self.manifest_path = self.path / MANIFEST_NAME
        self._lock: Optional[RunLock] = None

    # ------------------------------------------------------------------ what is there
    def files(self) -> list[str]:
        """Every file under the folder, relative, the bookkeeping files excluded (sorted); links not followed."""
        if not self.path.is_dir():
            return []
        found = []
        for root, dirs, names in os.walk(self.path):
            for name in [*names, *(d for d in dirs if Path(root, d).is_symlink())]:
                relative = Path(root, name).relative_to(self.path).as_posix()
                if relative not in _BOOKKEEPING:
                    found.append(relative)
        return sorted(found)

    def symlinks(self) -> list[str]:
        """Symbolic links inside the folder (relative): refused, a link's target is nobody's to replace."""
        return [f for f in self.files() if (self.path / f).is_symlink()]

    def manifest(self) -> Optional[dict[str, Any]]:
        if not self.manifest_path.is_file():
            return None
        try:
            manifest = json.loads(self.manifest_path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return None
        return manifest if isinstance(manifest, dict) and isinstance(manifest.get("files", []), list) else None

    def owned_files(self) -> list[str]:
        """The manifest's entries, each checked to name a file inside the folder (else RunFolderError); in the
        Trainer's log folders only its event files (a manifest of an earlier version took whatever was there)."""
        manifest = self.manifest() or {}
        entries = [self._checked_entry(entry) for entry in manifest.get("files", [])]
        return [entry for entry in entries if not entry.startswith(TRAINER_LOGS) or _is_trainer_log(entry)]

    def _recorded_writes(self) -> set[str]:
        """The temporary names (relative) the command's writers recorded before creating them (``writes``): each a
        ``.NAME.partial-PID`` or ``.NAME.old-PID`` (an entry of an earlier version, an output's name, is none)."""
        recorded = _names((self.manifest() or {}).get("writes"))
        return {name for name in recorded if LEFTOVER.fullmatch(name.rpartition("/")[2])}

    def _without_leftovers(self, files: Iterable[str]) -> list[str]:
        """``files`` less the leftovers of the command's interrupted writes (those under a recorded temporary name;
        a user's ``.thesis.old-2023/`` or ``.report.md.partial-1`` stays among them) and those of other hf-tapernorm
        commands that are gone (``_abandoned``)."""
        files = list(files)
        left = self._recorded_writes() | self._abandoned(files)
        return [f for f in files if not left.intersection([*folders_of(f), f])]

    def _abandoned(self, files: Iterable[str]) -> set[str]:
        """What another hf-tapernorm command that is gone left among ``files``, anywhere in the folder (a ``fold`` into
        its ``folded/`` killed by SIGKILL): the stale lock of a folder inside it (RunLock.is_stale: the lock a command
        taking it takes over) and a write's marked temporary folder whose writer is gone (abandoned_write_folder: a
        ``.NAME.KIND-PID``, an export_folded's ``.hf_tapernorm_writing-PID``). They are hf-tapernorm's, not a user's:
        --overwrite and --resume delete them (remove_partials). A held lock, no lock record, an unmarked one are not."""
        left: set[str] = set()
        containers: dict[str, bool] = {}
        for relative in files:
            for folder in folders_of(relative):
                if folder not in containers:
                    containers[folder] = abandoned_write_folder(self.path / folder)
            container = next((folder for folder in folders_of(relative) if containers[folder]), None)
            inner, _, name = relative.rpartition("/")
            if container is not None:
                left.add(container)
            elif inner and name == LOCK_NAME and RunLock(self.path / inner).is_stale():
                left.add(relative)
        return left

    def _writes_with(self, added: Iterable[str] = (), dropped: Collection[str] = ()) -> list[str]:
        """The manifest's ``writes`` with the temporary names ``added`` and without ``dropped``."""
        recorded = _names((self.manifest() or {}).get("writes"))
        return sorted({*(name for name in recorded if name not in dropped), *added})

    def _relative(self, path: Path) -> str:
        return path.relative_to(self.path).as_posix()

    def _checked_entry(self, entry: Any) -> str:
        """``entry`` when it is a relative path that stays inside the folder without crossing a link."""
        bad = not isinstance(entry, str) or not entry or "\\" in entry or "\0" in entry
        pure = PurePosixPath(entry) if not bad else PurePosixPath()
        if bad or pure.is_absolute() or ".." in pure.parts or Path(entry).is_absolute():
            raise RunFolderError(
                f"the manifest {self.manifest_path} lists {entry!r}, which is not a path inside the folder: it was "
                "edited by hand; nothing was deleted, delete or move the folder yourself"
            )
        root = resolved_path(self.path, f"output folder '{self.path}'")
        current = self.path
        for part in pure.parts:
            current = current / part
            if current.is_symlink():
                raise RunFolderError(
                    f"the manifest {self.manifest_path} lists {entry!r}, which passes through the symbolic link "
                    f"'{current}'; nothing was deleted, remove the link first"
                )
        if not current.resolve().is_relative_to(root):
            raise RunFolderError(
                f"the manifest {self.manifest_path} lists {entry!r}, which resolves outside the folder; nothing "
                "was deleted, delete or move the folder yourself"
            )
        return pure.as_posix()

    def _own(self, files: Iterable[str], listed: Collection[str]) -> list[str]:
        """Which of ``files`` are the command's: those its manifest lists (``listed``), those in an ``adopted``
        folder, and those of a checkpoint it has not recorded yet (the Trainer saves a checkpoint whole, then the
        command records it: a kill in between leaves it unrecorded; checkpoint_files.py: only when every file in it
        is one a checkpoint holds), and those an export in an output folder recorded (hub.export_files: a fold
        into RUN/folded). A file added to a checkpoint it recorded, or to an output folder, is not."""
        files = list(files)
        unrecorded = unrecorded_checkpoints(files, {_checkpoint_of(entry) for entry in listed})
        listed = {*listed, *(o + f for o in self.outputs if o.endswith("/") for f in export_files(self.path / o))}
        return [f for f in files if f in listed or _is_output(f, self.adopted) or _checkpoint_of(f) in unrecorded]

    def foreign_files(self) -> list[str]:
        """Files this command did not write (everything, when there is no manifest)."""
        manifest = self.manifest()
        present = self._without_leftovers(self.files())
        if manifest is None:
            return present
        ours = set(self._own(present, set(self.owned_files())))
        return [f for f in present if f not in ours]

    def is_empty(self) -> bool:
        return not self.path.exists() or not any(
            child.name not in _BOOKKEEPING or child.name == MANIFEST_NAME for child in self.path.iterdir()
        )

    # ------------------------------------------------------------------ policy
    def check(
        self,
        *,
        overwrite: bool,
        resume: bool,
        has_checkpoint: Callable[[], bool],
        recorded_identity: Callable[[], Optional[dict[str, Any]]] = lambda: None,
        outputs: Optional[Iterable[str]] = None,
    ) -> bool:
        """Refuse a folder this command may not use; True when it must be emptied (after validation).

        Checked before anything slow; the emptying itself waits until the model and data have loaded.
        ``recorded_identity``: the identity a checkpoint of the run recorded, to rebuild a lost manifest on
        ``--resume``; ``outputs``: the names the run writes (default: the folder's own ``outputs``).
        """
        for parent in [self.path, *self.path.parents]:
            if parent.exists() and not parent.is_dir():
                raise RunFolderError(f"output folder '{self.path}': '{parent}' is a file")
        if self.is_empty():
            if resume:
                raise RunFolderError(
                    f"--resume: '{self.path}' holds no run to continue (it is empty or new); start the run without "
                    "--resume, or name the folder of the interrupted run"
                )
            return False
        links = self.symlinks()
        if links:
            raise RunFolderError(
                f"output folder '{self.path}' holds symbolic links ({', '.join(links[:8])}); a run replaces only "
                "files of its own: remove the links or choose another --output_dir"
            )
        manifest = self.manifest()
        if resume and manifest is None and has_checkpoint():
            manifest = self._rebuild(recorded_identity(), tuple(self.outputs if outputs is None else outputs))
        self.owned_files()  # every entry inside the folder, before anything else is decided
        for relative in self._recorded_writes():  # and every recorded temporary name
            self._checked_entry(relative)
        foreign = self.foreign_files()
        listing, hint = _listing(foreign, self.files()), _options_file_hint(foreign)
        if resume:
            if manifest is None or not has_checkpoint():
                raise RunFolderError(
                    f"--resume: '{self.path}' holds no checkpoint of an hf-tapernorm run to continue"
                    + (f" (it holds {listing})" if foreign else "")
                    + "; choose another --output_dir, or start over with --overwrite in an empty folder"
                    + hint
                )
            if foreign:
                raise RunFolderError(
                    f"--resume: '{self.path}' holds files this command did not write ({listing}); "
                    f"move them away first, a finished run replaces its outputs{hint}"
                )
            return False
        return self._check_overwrite(overwrite, manifest, foreign, listing, hint)

    def _check_overwrite(
        self, overwrite: bool, manifest: Optional[dict[str, Any]], foreign: list[str], listing: str, hint: str
    ) -> bool:
        """check() for a folder that is not empty, without --resume: True when --overwrite may empty it."""
        damaged = manifest is None and self.manifest_path.is_file()  # which files are the run's is unknown
        if not overwrite and foreign and not damaged:  # --overwrite would refuse them too: say so now
            raise RunFolderError(
                f"output folder '{self.path}' holds files hf-tapernorm did not write ({listing}), which neither "
                f"--overwrite nor --resume replaces: move them away, or choose another --output_dir{hint}"
            )
        if not overwrite:
            raise RunFolderError(
                f"output folder '{self.path}' is not empty; pass --overwrite to replace it, or --resume to continue "
                "the run in it"
            )
        resolved = resolved_path(self.path, f"output folder '{self.path}'")
        protected = {Path.cwd().resolve(), Path.home().resolve(), Path(resolved.anchor)}
        if resolved in protected or Path.cwd().resolve().is_relative_to(resolved):
            raise RunFolderError(
                f"refusing to --overwrite '{self.path}': it is the current, home or root folder or contains it"
            )
        if damaged:
            raise RunFolderError(
                f"refusing to --overwrite '{self.path}': its manifest {self.manifest_path.name} is unreadable, so "
                "which files the run wrote is unknown; --resume rebuilds it from the last checkpoint, or delete the "
                "folder yourself"
            )
        if manifest is None and not foreign:  # nothing in it but what commands that are gone left (_abandoned)
            return True
        if manifest is None or foreign:
            what = "was not written by hf-tapernorm" if manifest is None else "holds files hf-tapernorm did not write"
            raise RunFolderError(
                f"refusing to --overwrite '{self.path}': it {what} ({listing}); move them away first{hint}"
            )
        return True

    def _rebuild(self, identity: Optional[dict[str, Any]], outputs: tuple[str, ...]) -> Optional[dict[str, Any]]:
        """A lost or unreadable manifest on ``--resume``: rebuilt from the checkpoint's own record of the run.

        Only the checkpoints and the run's own output names are taken as the run's; every other file stays
        foreign (check() lists them and refuses).
        """
        if identity is None:
            raise RunFolderError(
                f"--resume: the manifest {self.manifest_path} is missing or unreadable and no checkpoint in "
                f"'{self.path}' records the run; start over with --overwrite in a new --output_dir"
            )
        logger.warning("rebuilding the lost manifest of %s from its last checkpoint's record", self.path)
        files = self.files()
        checkpoints = unrecorded_checkpoints(files, ())
        ours = [f for f in files if _checkpoint_of(f) in checkpoints or _is_output(f, (*outputs, *self.adopted))]
        self._write_manifest({"tool": "hf-tapernorm", "identity": identity, "files": ours})
        return self.manifest()

    def empty(self) -> None:
        """Delete what the manifest lists (and our partial folders), then the empty subfolders; nothing else.

        Every entry is checked first (owned_files): one entry outside the folder and nothing is deleted.
        """
        if self.symlinks():
            raise RunFolderError(f"output folder '{self.path}' holds symbolic links; nothing was deleted")
        targets = self._emptied_files()
        self.remove_partials()
        for target in targets:
            target.unlink(missing_ok=True)
        for root, dirs, _ in sorted(os.walk(self.path), key=lambda item: -len(item[0])):
            for name in dirs:
                folder = Path(root, name)
                if folder.is_dir() and not folder.is_symlink() and not any(folder.iterdir()):
                    folder.rmdir()
        self.manifest_path.unlink(missing_ok=True)

    def reclaimable_bytes(self) -> int:
        """The bytes :meth:`empty` would delete: the command's files (``_own``)."""
        return sum(target.stat().st_size for target in self._emptied_files() if not target.is_symlink())

    def _emptied_files(self) -> list[Path]:
        """The files :meth:`empty` deletes (each entry checked by owned_files), once each."""
        owned = self.owned_files()
        targets = dict.fromkeys(self.path / relative for relative in [*owned, *self._own(self.files(), set(owned))])
        return [target for target in targets if target.is_file()]

    def remove_partials(self) -> None:
        """Delete what an interrupted write of the command left: the ``.NAME.partial-PID`` or ``.NAME.old-PID`` (file
        or folder) under each temporary name the manifest recorded (``_recorded_writes``; each checked to lie inside
        the folder, not through a link, before anything is deleted), and forget those names; and what other
        hf-tapernorm commands that are gone left in it (``_abandoned``: a stale lock is taken over, then deleted);
        nothing else.

        Called while this command holds the lock, so no other process is writing them.
        """
        recorded = sorted(self._recorded_writes())
        targets = [self.path / self._checked_entry(relative) for relative in recorded]
        for relative in sorted(self._abandoned(self.files())):
            if relative.rpartition("/")[2] == LOCK_NAME:
                RunLock(self.path / relative.rpartition("/")[0]).remove_stale()
            else:
                targets.append(self.path / relative)
        for target in targets:
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
        if recorded:
            self.record(writes=self._writes_with(dropped=set(recorded)))

    # ------------------------------------------------------------------ record
    def record(self, *, expect: Iterable[str] = (), **fields: Any) -> None:
        """Rewrite the manifest with the command's files now in the folder: those it listed before, its new
        checkpoints and what the ``adopted`` folders hold (``_own``; the folder started empty, but another process
        may have added files since, even into an output folder: they stay foreign).

        ``expect``: files about to be written (registered before they exist, so a kill while they are written
        leaves nothing foreign); of those that are the command's ``outputs``, written by write_file, the partial name
        it writes first is recorded too (``writes``), so a kill during the write leaves a leftover of the command's.
        """
        self.path.mkdir(parents=True, exist_ok=True)
        manifest = self.manifest() or {"tool": "hf-tapernorm"}
        manifest.update(fields)
        partials = [self._relative(partial_name(self.path / name)) for name in expect if name in self.outputs]
        if partials:
            manifest["writes"] = sorted({*_names(manifest.get("writes")), *partials})
        listed = {entry for entry in manifest.get("files", []) if isinstance(entry, str)}
        ours = self._own(self._without_leftovers(self.files()), listed)
        manifest["files"] = sorted({*ours, *expect})
        self._write_manifest(manifest)

    def _write_manifest(self, manifest: dict[str, Any]) -> None:
        tmp = self.manifest_path.with_name(MANIFEST_NAME + ".tmp")
        try:
            tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
            os.replace(tmp, self.manifest_path)
        except OSError:  # a full disk: no half-written manifest is left in the user's folder
            tmp.unlink(missing_ok=True)
            raise

    def write_output(self, name: str, write: Callable[[Path], None]) -> Path:
        """``write_folder`` of the subfolder ``name``, its files registered in the manifest before the rename, and the
        temporary names it gives them (``.NAME.partial-PID``, ``.NAME.old-PID``) before it creates them: a kill while
        it writes leaves a leftover of the command's, which it (or a later --resume or --overwrite) deletes; an
        unrecorded one beside it is someone else's and stays. Once written, its leftovers' names are forgotten.

        Files someone else put into that folder while the command ran (the manifest does not list them) are kept
        where they are, and stay foreign: a later ``--overwrite`` or ``--resume`` names them and refuses.
        """
        final = self.path / name

        def foreign_inside() -> list[str]:
            kept = [f.removeprefix(f"{name}/") for f in self.foreign_files() if f.startswith(f"{name}/")]
            if kept:
                logger.warning(
                    "%s holds files this command did not write (%s): they stay where they are, and --overwrite and "
                    "--resume refuse the folder until they are moved away",
                    final,
                    _listing(kept),
                )
            return kept

        def register(files: list[str]) -> None:
            self.record(expect=[f"{name}/{f}" for f in files])

        def recorded(leftover: Path) -> bool:
            return self._relative(leftover) in self._recorded_writes()

        self.record(writes=self._writes_with([self._relative(partial_name(final)), self._relative(old_name(final))]))
        write_folder(final, write, before_rename=register, keep=foreign_inside, abandoned=recorded)
        gone = {  # its leftovers, deleted now (or never made)
            relative
            for relative in self._recorded_writes()
            if (self.path / relative).parent == final.parent
            and leftover_of(relative.rpartition("/")[2], final)
            and not os.path.lexists(self.path / relative)
        }
        self.record(writes=self._writes_with(dropped=gone))
        return final

    # ------------------------------------------------------------------ lock
    def lock(self) -> RunLock:
        """Take the folder's lock (creating the folder); RunFolderError when another live command holds it."""
        self._lock = RunLock(self.path)
        self._lock.acquire()
        return self._lock

    def unlock(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None


def inside_folder(path: Optional[str], output_dir: str) -> tuple[str, ...]:
    """``path`` (``--data_cache_dir``) as a folder of the run in ``output_dir`` when it lies inside it (its name
    relative to the run folder, ending in "/": a folder the run adopts), else nothing."""
    if not path:
        return ()
    folder = resolved_path(path, f"--data_cache_dir '{path}'")
    root = resolved_path(output_dir, f"--output_dir '{output_dir}'")
    return (folder.relative_to(root).as_posix() + "/",) if folder != root and folder.is_relative_to(root) else ()


__all__ = [
    "LOCK_NAME",
    "MANIFEST_NAME",
    "TRAINER_LOGS",
    "TRAINER_LOG_FILES",
    "RunFolder",
    "RunFolderError",
    "RunLock",
    "inside_folder",
    "write_file",
    "write_folder",
]
