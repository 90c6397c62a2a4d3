"""A run folder that knows what it wrote: the manifest, the overwrite/resume policy, and atomic writes.

Every file a run creates in its folder is recorded in ``.hf_tapernorm_run.json`` (refreshed after each
checkpoint, export and report). A later command may replace or continue the folder only when nothing
else is in it: ``--overwrite`` on a folder holding a file the manifest does not list, or on a folder that
no run of ours wrote, is refused with the foreign files named, and nothing is deleted before every
argument, the model and the data have been checked. A half-written output never carries its final name.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from ..errors import ConfigurationError

MANIFEST_NAME = ".hf_tapernorm_run.json"
#: Temporary siblings written by write_folder; a crash can leave one behind, which is ours.
_PARTIAL_MARKERS = (".partial-", ".old-")


class RunFolderError(ConfigurationError):
    """The output folder cannot be used as asked (the message says why and lists foreign files)."""


class RunFolder:
    """The output folder of one command, with its manifest."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.manifest_path = self.path / MANIFEST_NAME

    # ------------------------------------------------------------------ what is there
    def files(self) -> list[str]:
        """Every file under the folder, relative, the manifest excluded (sorted)."""
        if not self.path.is_dir():
            return []
        found = []
        for root, _, names in os.walk(self.path):
            for name in names:
                relative = Path(root, name).relative_to(self.path).as_posix()
                if relative != MANIFEST_NAME:
                    found.append(relative)
        return sorted(found)

    def manifest(self) -> Optional[dict[str, Any]]:
        if not self.manifest_path.is_file():
            return None
        try:
            return json.loads(self.manifest_path.read_text())
        except (OSError, json.JSONDecodeError):
            return None

    def foreign_files(self) -> list[str]:
        """Files this command did not write (everything, when there is no manifest)."""
        manifest = self.manifest()
        ours = set(manifest.get("files", [])) if manifest else set()
        return [f for f in self.files() if f not in ours and not any(m in f for m in _PARTIAL_MARKERS)]

    def is_empty(self) -> bool:
        return not self.path.exists() or not any(self.path.iterdir())

    # ------------------------------------------------------------------ policy
    def check(self, *, overwrite: bool, resume: bool, has_checkpoint: Callable[[], bool]) -> bool:
        """Refuse a folder this command may not use; True when it must be emptied (after validation).

        Checked before anything slow; the emptying itself waits until the model and data have loaded.
        """
        if self.path.exists() and not self.path.is_dir():
            raise RunFolderError(f"output folder '{self.path}' is a file")
        if self.is_empty():
            return False
        manifest = self.manifest()
        foreign = self.foreign_files()
        listing = ", ".join(foreign[:8]) + (f" and {len(foreign) - 8} more" if len(foreign) > 8 else "")
        if resume:
            if manifest is None or not has_checkpoint():
                raise RunFolderError(
                    f"--resume: '{self.path}' holds no checkpoint of an hf-tapernorm run to continue"
                    + (f" (it holds {listing})" if foreign else "")
                    + "; choose another --output_dir, or start over with --overwrite in an empty folder"
                )
            if foreign:
                raise RunFolderError(
                    f"--resume: '{self.path}' holds files this command did not write ({listing}); "
                    "move them away first, a finished run replaces its outputs"
                )
            return False
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
        if manifest is None or foreign:
            what = "was not written by hf-tapernorm" if manifest is None else "holds files hf-tapernorm did not write"
            raise RunFolderError(f"refusing to --overwrite '{self.path}': it {what} ({listing}); move them away first")
        return True

    def empty(self) -> None:
        """Delete what the manifest lists (and our partial folders), then the empty subfolders; nothing else."""
        manifest = self.manifest() or {}
        for relative in manifest.get("files", []):
            target = self.path / relative
            if target.is_file() or target.is_symlink():
                target.unlink()
        for child in self.path.iterdir():
            if child.is_dir() and any(m in child.name for m in _PARTIAL_MARKERS):
                shutil.rmtree(child)
        for root, dirs, _ in sorted(os.walk(self.path), key=lambda item: -len(item[0])):
            for name in dirs:
                folder = Path(root, name)
                if folder.is_dir() and not any(folder.iterdir()):
                    folder.rmdir()
        self.manifest_path.unlink(missing_ok=True)

    # ------------------------------------------------------------------ record
    def record(self, **fields: Any) -> None:
        """Rewrite the manifest with every file now in the folder (they are this run's: it started empty)."""
        self.path.mkdir(parents=True, exist_ok=True)
        manifest = self.manifest() or {"tool": "hf-tapernorm"}
        manifest.update(fields)
        manifest["files"] = self.files()
        tmp = self.manifest_path.with_name(MANIFEST_NAME + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, self.manifest_path)


def write_folder(final: Path, write: Callable[[Path], None]) -> None:
    """``write`` into a hidden temporary sibling, then rename it to ``final``; on failure remove it.

    Nothing half-written ever carries the final name, and an older complete folder survives a
    failed rewrite.
    """
    tmp = final.with_name(f".{final.name}.partial-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)


__all__ = ["MANIFEST_NAME", "RunFolder", "RunFolderError", "write_folder"]
