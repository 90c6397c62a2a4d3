"""Push a folded export to the Hub: exactly the files its manifest records, checked against their digests.

Pushing uploads the files of the export's manifest (``modeling_folded.upload_export``, also behind
``folded.push_to_hub``): anything else in the folder (a ``.env`` with a token, notes) is listed and refused unless
``include`` names it, because ``upload_folder`` publishes whatever a folder holds. The package's own bookkeeping files
(``.hf_tapernorm_*``) are never uploaded, whatever ``include`` says; files changed since the export wrote them are
refused (``manifest.check_export_files``), so a card and a scan are published only with the weights they describe,
but the card and generation_config.json, which its owner may edit (``manifest.OWNER_EDITABLE``), go up edited.
"""

from __future__ import annotations

import fnmatch
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path, PurePosixPath
from typing import Optional

from .._temporaries import is_write_folder, live_write_of, writes_inside
from ..errors import ConfigurationError
from ..utils import expand_user, some_names, true_or_false
from .manifest import (
    BOOKKEEPING_PREFIX,
    EXPORT_MANIFEST_NAME,
    LOCK_NAME,
    check_export_files,
    export_manifest,
    folder_files,
    incomplete_export,
    is_bookkeeping,
)
from .modeling_folded import upload_export

logger = logging.getLogger(__name__)


def files_to_push(folder: str | os.PathLike, include: Sequence[str] = ()) -> list[str]:
    """The files ``push_export`` uploads: the export's manifest, plus the other files ``include`` names.

    Refuses (ConfigurationError, the files listed) a folder without a manifest, one holding a symbolic link,
    one missing a file of its manifest, one holding a file neither the manifest nor ``include`` names, one a write
    is in progress in or a killed write left its temporary folder in, and one whose files are not those its card
    and scan were written with (check_export_files). The bookkeeping files (``.hf_tapernorm_*``: a lock, a manifest,
    everything under a write's ``.hf_tapernorm_writing-PID/``) are never uploaded, whatever ``include`` names.
    """
    folder = Path(folder)
    include = _include_patterns([include] if isinstance(include, str) else include)  # a string's letters: "*"
    _refuse_writes_inside(folder)
    manifest = export_manifest(folder)
    if manifest is None:
        raise ConfigurationError(
            f"'{folder}' has no export manifest ({EXPORT_MANIFEST_NAME}), so which files are the export is "
            "unknown; re-export it with hf-tapernorm fold (or taper) and push that folder"
        )
    present = folder_files(folder)
    links = [name for name in present if (folder / name).is_symlink()]
    if links:
        raise ConfigurationError(f"'{folder}' holds symbolic links ({', '.join(links[:8])}); push refuses them")
    incomplete = incomplete_export(folder, f"'{folder}'")
    if incomplete:
        raise ConfigurationError(incomplete)
    extra = sorted(name for name in present if name not in manifest)
    included = [name for name in extra if _matches(name, include)]
    refused = [name for name in extra if name not in included]
    if refused:
        raise ConfigurationError(
            f"'{folder}' holds files the export did not write ({some_names(refused)}); they are not uploaded: move "
            "them away, or name the ones to publish with --include PATTERN"
        )
    check_export_files(folder)
    _warn_bookkeeping_only(folder, include)
    return sorted([*manifest, *included])


def _warn_bookkeeping_only(folder: Path, include: Sequence[str]) -> None:
    """Warn of each --include pattern whose every match in ``folder`` is a bookkeeping name (``.hf_tapernorm_*``,
    never uploaded): a user's file named so would stay behind without a word, though a pattern named it. The
    WARNING names only such files that are not the package's own (_package_own): advising to rename the export's
    manifest out of those names would unmake the export, so a pattern matching only the package's files says
    nothing."""
    names = sorted(path.relative_to(folder).as_posix() for path in folder.rglob("*") if not path.is_dir())
    for pattern in include:
        matched = [name for name in names if _matches(name, [pattern])]
        users = [name for name in matched if not _package_own(folder, name)]
        if users and all(is_bookkeeping(name) for name in matched):
            logger.warning(
                "--include %r names only hf-tapernorm's bookkeeping files (%s), which are never uploaded: rename a "
                "file of yours out of the %s* names to publish it",
                pattern,
                some_names(users),
                BOOKKEEPING_PREFIX,
            )


#: The files hf-tapernorm itself keeps in an export: its manifest, and a running command's lock.
_PACKAGE_FILES = (EXPORT_MANIFEST_NAME, LOCK_NAME)


def _package_own(folder: Path, name: str) -> bool:
    """Whether the file ``name`` (relative to ``folder``) is one hf-tapernorm keeps there, never a user's: an
    export's manifest, a lock, or a file in a write's marked temporary folder (is_write_folder)."""
    parts = name.split("/")
    if len(parts) == 1 and name in _PACKAGE_FILES:  # kept at the export's top only: deeper, a user's look-alike
        return True
    return any(is_write_folder(folder.joinpath(*parts[: depth + 1])) for depth in range(len(parts) - 1))


def _refuse_writes_inside(folder: Path) -> None:
    """Refuse an export a write is in progress in, or one a killed write left its ``.hf_tapernorm_writing-PID`` in
    (half-written files, never uploaded): the export beside it may be incomplete, or about to be replaced."""
    live = live_write_of(folder)  # a write into it, or a replacement of it
    if live:
        raise ConfigurationError(f"'{folder}': {live}; wait for it to finish, then push")
    left = [entry.name for entry in writes_inside(folder)]
    if left:
        raise ConfigurationError(
            f"'{folder}' holds '{left[0]}', the leftover of a killed write of the export (its half-written files are "
            "never uploaded, and the export beside it may be incomplete); export again with overwrite=True "
            "(hf-tapernorm fold --overwrite), which deletes it, then push"
        )


def _include_patterns(include: Iterable[str]) -> list[str]:
    """The --include patterns as paths relative to the export folder: a leading ``./`` (the folder itself) is
    dropped, so ``./notes.txt`` names ``notes.txt``; a pattern reaching outside (``..``) or absolute is refused, since
    no file of the folder has such a relative path and a silent non-match would only refuse the file it meant."""
    patterns = []
    for given in include:
        pattern = given
        while pattern.startswith("./"):
            pattern = pattern[2:]
        if not pattern.strip():  # --include= : a pattern that names no file, given by mistake
            raise ConfigurationError(
                f"--include {given!r}: an empty pattern names no file; name the files to add (e.g. 'samples/*.txt')"
            )
        if PurePosixPath(pattern).is_absolute() or ".." in PurePosixPath(pattern).parts:
            raise ConfigurationError(
                f"--include {given!r}: a pattern is a path inside the export folder, relative to it (e.g. "
                "'samples/*.txt'); '..' and absolute paths name nothing there"
            )
        patterns.append(pattern)
    return patterns


def _matches(name: str, patterns: Iterable[str]) -> bool:
    """Whether an --include pattern names ``name``, the file's path relative to the export folder, as fnmatch reads
    it (``*`` also matches ``/``, as upload_folder's allow_patterns do) or literally (``[v2].txt`` is a file name as
    well as a character class). Only the whole path counts, never the file name alone: ``extra.json`` names the
    top-level file, not a ``private/extra.json`` the user did not mean to publish."""
    return any(p == name or fnmatch.fnmatchcase(name, p) for p in patterns)


def push_export(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    include: Sequence[str] = (),
    before_upload: Optional[Callable[[list[str]], None]] = None,
    private: bool = True,
    token: Optional[str | bool] = None,
    revision: Optional[str] = None,
    commit_message: Optional[str] = None,
    commit_description: Optional[str] = None,
    create_pr: bool = False,
):
    """Upload the files of a folded export (``files_to_push``: its manifest, plus ``include``) to ``repo_id``.

    A repository it creates is private unless ``private=False``, as ``hf-tapernorm push`` makes it unless
    ``--no_private`` (the Hub's own default for a user is public); ``token``, ``revision``, ``commit_message``,
    ``commit_description`` and ``create_pr`` are ``huggingface_hub.HfApi.upload_folder``'s.

    ``before_upload`` receives those files once the folder has passed every check, before anything is sent (the
    command line says there what the export's scan found). A ``repo_id`` without an owner (``name``) is the
    token's user's, as on the Hub; the log names the repository it becomes and, before anything is sent, the files
    (those ``include`` added named apart).

    It takes no lock on the folder: the run lock is app/'s (run_lock.RunLock), which this layer does not import.
    ``hf-tapernorm push`` holds it around this call, so a fold or export_folded(overwrite=True) replacing the export
    during the upload is refused; a library caller gets the checks above (a write in progress then is refused) and
    holds the lock itself where a write of the export may race the upload."""
    private = true_or_false(private, "push_export: private=")  # "no" is true: a private repository made public
    create_pr = true_or_false(create_pr, "push_export: create_pr=")
    folder = expand_user(folder, f"push_export: '{folder}'")
    files = files_to_push(folder, include)
    if before_upload is not None:
        before_upload(files)
    if "/" not in repo_id:
        from huggingface_hub import HfApi

        owner = HfApi(token=token).whoami()["name"]
        logger.info(
            "repo id %s names no owner: the Hub puts it under the token's user, as %s/%s", repo_id, owner, repo_id
        )
        repo_id = f"{owner}/{repo_id}"
    added = sorted(set(files) - set(export_manifest(folder) or ()))
    logger.info(
        "uploading %d files of %s to %s: %s%s",
        len(files),
        folder,
        repo_id,
        ", ".join(files),
        f"; not written by the export, named by --include: {', '.join(added)}" if added else "",
    )
    return upload_export(
        folder,
        repo_id,
        token=token,
        private=private,
        commit_message=commit_message,
        commit_description=commit_description,
        revision=revision,
        create_pr=create_pr,
        allow_patterns=[glob_escape(name) for name in files],
    )


def glob_escape(name: str) -> str:
    """``name`` as an fnmatch pattern that matches only itself (upload_folder's allow_patterns are patterns)."""
    return "".join(f"[{c}]" if c in "*?[]" else c for c in name)


__all__ = ["files_to_push", "glob_escape", "push_export"]
