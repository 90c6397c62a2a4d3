"""A run folder that knows what it wrote: the manifest, the lock, the overwrite/resume policy, atomic writes.

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
(run_lock.py) keeps a second command out of a folder in use. A half-written output never carries its final name.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
from collections import Counter
from collections.abc import Callable, Collection, Iterable
from pathlib import Path, PurePosixPath
from typing import Any, Optional

from .checkpoint_files import checkpoint_of as _checkpoint_of
from .checkpoint_files import unrecorded_checkpoints
from .run_lock import LOCK_NAME, RunFolderError, RunLock

logger = logging.getLogger(__name__)

MANIFEST_NAME = ".hf_tapernorm_run.json"
#: Bookkeeping files of the folder itself: never listed, never foreign.
_BOOKKEEPING = (MANIFEST_NAME, MANIFEST_NAME + ".tmp", LOCK_NAME)
#: Temporary siblings written by write_folder (``.NAME.partial-PID``, ``.NAME.old-PID``); a crash can leave one
#: behind, which is ours.
_PARTIAL_MARKERS = (".partial-", ".old-")
#: The report's atomic writes (app/report.py: ``report.json.tmp``, ``report.md.tmp``).
_TEMPORARY_FILES = ("report.json.tmp", "report.md.tmp")
#: The Trainer's TensorBoard logs (``--report_to tensorboard``), the run's and its baseline run's: what a
#: library writes as it goes, so whatever is in them is the run's.
TRAINER_LOGS = ("runs/", "baseline/runs/")


def _is_partial(relative: str) -> bool:
    """What an interrupted write of ours leaves: a file inside a ``.NAME.partial-PID`` folder, or a report temp."""
    parts = relative.split("/")
    in_partial_folder = len(parts) > 1 and any(
        part.startswith(".") and marker in part for part in parts[:-1] for marker in _PARTIAL_MARKERS
    )
    return in_partial_folder or relative in _TEMPORARY_FILES


def _is_output(relative: str, outputs: Iterable[str]) -> bool:
    """``relative`` is one of ``outputs`` (a file name) or lies in one of its folders (names ending in "/")."""
    return any(relative == o or (o.endswith("/") and relative.startswith(o)) for o in outputs)


def _folders(relative: str) -> list[str]:
    """The folders ``relative`` lies in, outermost first (``a/b/c`` -> ``a``, ``a/b``)."""
    parts = relative.split("/")
    return ["/".join(parts[:depth]) for depth in range(1, len(parts))]


def _listing(files: list[str], present: Iterable[str] = ()) -> str:
    """The files a refusal names (the first eight). A folder of several files that are all among ``files`` (of the
    ``present`` ones) is named once, as ``folder/``: a user's copied checkpoint does not hide the next name."""
    holds = Counter(folder for relative in present for folder in _folders(relative))
    listed = Counter(folder for relative in files for folder in _folders(relative))
    names = []
    for relative in files:
        whole = next((f for f in _folders(relative) if listed[f] > 1 and holds[f] == listed[f]), None)
        names.append(relative if whole is None else f"{whole}/")
    names = list(dict.fromkeys(names))
    return ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")


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
    manifest is rebuilt from them on ``--resume``. ``adopted``: folders a library fills while the command runs (a
    datasets cache inside the run folder; the Trainer's logs always are), whose files are the command's. Only
    these, the checkpoints and the files a write registers are ever recorded as the command's: a file someone
    else puts into the folder (or into an output folder) while the command runs stays foreign, so no later
    ``--overwrite`` deletes it.
    """

    def __init__(self, path: str | os.PathLike, outputs: Iterable[str] = (), adopted: Iterable[str] = ()) -> None:
        self.path = Path(path)
        self.outputs = tuple(outputs)
        self.adopted = (*TRAINER_LOGS, *adopted)
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
        """The manifest's entries, each checked to name a file inside the folder (else RunFolderError)."""
        manifest = self.manifest() or {}
        return [self._checked_entry(entry) for entry in manifest.get("files", [])]

    def _checked_entry(self, entry: Any) -> str:
        """``entry`` when it is a relative path that stays inside the folder without crossing a link."""
        bad = not isinstance(entry, str) or not entry or "\\" in entry or "\0" in entry
        pure = PurePosixPath(entry) if not bad else PurePosixPath()
        if bad or pure.is_absolute() or ".." in pure.parts or Path(entry).is_absolute():
            raise RunFolderError(
                f"the manifest {self.manifest_path} lists {entry!r}, which is not a path inside the folder: it was "
                "edited by hand; nothing was deleted, delete or move the folder yourself"
            )
        root = self.path.resolve()
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
        is one a checkpoint holds). A file added to a checkpoint it recorded, or to an output folder, is not."""
        files = list(files)
        unrecorded = unrecorded_checkpoints(files, {_checkpoint_of(entry) for entry in listed})
        return [f for f in files if f in listed or _is_output(f, self.adopted) or _checkpoint_of(f) in unrecorded]

    def foreign_files(self) -> list[str]:
        """Files this command did not write (everything, when there is no manifest)."""
        manifest = self.manifest()
        present = [f for f in self.files() if not _is_partial(f)]
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
        resolved = self.path.resolve()
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
        for target in self._emptied_files():
            target.unlink()
        self.remove_partials()
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
        """Delete what an interrupted write left (``.NAME.partial-PID``/``.old-PID`` folders, ``*.tmp`` files).

        Called while this command holds the lock, so no other process is writing them.
        """
        for name in _TEMPORARY_FILES:
            target = self.path / name
            if target.is_file() and not target.is_symlink():
                target.unlink()
        for child in self.path.iterdir() if self.path.is_dir() else ():
            hidden_partial = child.name.startswith(".") and any(m in child.name for m in _PARTIAL_MARKERS)
            if hidden_partial and child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)

    # ------------------------------------------------------------------ record
    def record(self, *, expect: Iterable[str] = (), **fields: Any) -> None:
        """Rewrite the manifest with the command's files now in the folder: those it listed before, its new
        checkpoints and what the ``adopted`` folders hold (``_own``; the folder started empty, but another process
        may have added files since, even into an output folder: they stay foreign).

        ``expect``: files about to be written (registered before they exist, so a kill while they are written
        leaves nothing foreign).
        """
        self.path.mkdir(parents=True, exist_ok=True)
        manifest = self.manifest() or {"tool": "hf-tapernorm"}
        manifest.update(fields)
        listed = {entry for entry in manifest.get("files", []) if isinstance(entry, str)}
        ours = self._own([f for f in self.files() if not _is_partial(f)], listed)
        manifest["files"] = sorted({*ours, *expect})
        self._write_manifest(manifest)

    def _write_manifest(self, manifest: dict[str, Any]) -> None:
        tmp = self.manifest_path.with_name(MANIFEST_NAME + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, self.manifest_path)

    def write_output(self, name: str, write: Callable[[Path], None]) -> Path:
        """``write_folder`` of the subfolder ``name``, its files registered in the manifest before the rename.

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

        write_folder(final, write, before_rename=register, keep=foreign_inside)
        self.record()
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
    taken = {*written, *(folder for relative in written for folder in _folders(relative))}
    clashes = [relative for relative in keep if relative in taken or set(_folders(relative)) & set(written)]
    if clashes:
        raise RunFolderError(
            f"'{final}' holds files this command did not write ({_listing(clashes)}) where it writes its own; "
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


__all__ = [
    "LOCK_NAME",
    "MANIFEST_NAME",
    "TRAINER_LOGS",
    "RunFolder",
    "RunFolderError",
    "RunLock",
    "write_file",
    "write_folder",
]
