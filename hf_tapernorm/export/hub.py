"""Write a folded model to a folder (safetensors, config with auto_map, modeling code, model card) and push it.

``save_pretrained`` of the folded class does the writing (transformers copies ``modeling_folded.py``
because the classes are registered for the Auto classes); this adds the two things an export needs
on top: no silent overwrite of an existing folder, and the model card filled with the run facts.

An export records the files it wrote in ``.hf_tapernorm_export.json`` (its manifest). Pushing uploads
exactly those files (``modeling_folded.upload_export``, also behind ``folded.push_to_hub``): anything else
in the folder (a ``.env`` with a token, notes) is listed and refused unless ``include`` names it, because
``upload_folder`` publishes whatever a folder holds. The package's own bookkeeping files (``.hf_tapernorm_*``:
a command's lock with its pid and host, a manifest) are never uploaded, whatever ``include`` says.

The model card and the robustness scan state figures of the files they were written with, so the manifest
also records the sha256 of every file as the export wrote it (a writer that rewrites one inside
``recording_export``, the scan or the card, records its new digest), and a push verifies them: weights edited, a
fine-tuned model saved over the export, an edited config.json, modeling code or scan would otherwise be
published under a card and a scan that describe another model.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any, Optional

from transformers import PreTrainedModel

from .._temporaries import (
    make_marked_folder,
    marked_and_abandoned,
    move_up,
    remove_abandoned,
    remove_abandoned_inside,
    remove_listed,
    temporary_name,
    writing_inside,
)
from ..config_fields import check_tokenizer_to_save
from ..errors import ConfigurationError, TaperStateError
from ..utils import expand_user, file_in_the_way
from .model_card import attach_model_card
from .modeling_folded import FoldedModelMixin, upload_export

logger = logging.getLogger(__name__)

EXPORT_MANIFEST_NAME = ".hf_tapernorm_export.json"
#: The manifest's record of the files the card and the scan describe: file -> its sha256 as the export wrote it.
DIGESTS_KEY = "files_sha256"
#: The model card: written with the export, but prose its owner may edit by hand before a push.
CARD_NAME = "README.md"
#: The start of the names of the package's bookkeeping files (the manifest, a command's lock): no export content.
BOOKKEEPING_PREFIX = ".hf_tapernorm_"
#: The kind of the hidden folder an export is replaced through (``.NAME.export-PID``: _temporaries.py).
EXPORT_KIND = "export"


def _is_bookkeeping(relative: str) -> bool:
    return "/" not in relative and relative.startswith(BOOKKEEPING_PREFIX)


def _folder_files(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``folder`` (relative posix path -> (size, mtime_ns)), the bookkeeping files excluded."""
    found = {}
    for root, dirs, names in os.walk(folder):
        for name in [*names, *(d for d in dirs if Path(root, d).is_symlink())]:
            path = Path(root, name)
            relative = path.relative_to(folder).as_posix()
            if not _is_bookkeeping(relative):
                info = path.lstat()
                found[relative] = (info.st_size, info.st_mtime_ns)
    return found


def _read_manifest(folder: Path) -> Optional[dict[str, Any]]:
    """The export manifest of ``folder`` (checked: every entry a relative path inside it), or None without one."""
    path = folder / EXPORT_MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
        entries, digests = manifest.get("files"), manifest.get(DIGESTS_KEY, {})
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        entries = digests = None
    valid = (
        isinstance(entries, list)
        and all(
            isinstance(e, str) and e and not os.path.isabs(e) and ".." not in Path(e).parts and "\\" not in e
            for e in entries
        )
        and isinstance(digests, dict)
        and all(name in entries and isinstance(digest, str) for name, digest in digests.items())
    )
    if not valid:
        raise ConfigurationError(f"the export manifest {path} is damaged or was edited; re-export the model")
    return manifest


def export_manifest(folder: str | os.PathLike) -> Optional[list[str]]:
    """The files an export wrote (its manifest), each a relative path inside ``folder``; None without one."""
    manifest = _read_manifest(Path(folder))
    return None if manifest is None else list(manifest["files"])


def export_files(folder: str | os.PathLike) -> list[str]:
    """The files the export in ``folder`` recorded as its own (relative), its manifest among them; none where it is
    no export, a link, or its manifest is damaged. A run folder takes them as its own in its ``folded/``: a fold
    into it (with a scan the run's export had not) replaces the run's export with another of the same run."""
    folder = Path(folder)
    try:
        listed = None if folder.is_symlink() else export_manifest(folder)
    except ConfigurationError:
        return []
    return [] if listed is None else [*listed, EXPORT_MANIFEST_NAME]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


@contextmanager
def recording_export(folder: str | os.PathLike) -> Iterator[Path]:
    """Add every file written or rewritten inside the ``with`` block to ``folder``'s export manifest, with its
    sha256 (a file left untouched keeps the digest recorded when it was written)."""
    folder = Path(folder)
    before = _folder_files(folder) if folder.is_dir() else {}
    yield folder
    after = _folder_files(folder)
    previous = _read_manifest(folder) or {"files": []}
    written = {name for name, stamp in after.items() if before.get(name) != stamp}
    files = sorted({*(name for name in previous["files"] if name in after), *written})
    recorded = previous.get(DIGESTS_KEY, {})
    digests = {
        name: recorded[name] if name in recorded and name not in written else _sha256(folder / name)
        for name in files
        if (folder / name).is_file() and not (folder / name).is_symlink()  # push refuses a link
    }
    (folder / EXPORT_MANIFEST_NAME).write_text(
        json.dumps({"tool": "hf-tapernorm", "files": files, DIGESTS_KEY: digests}, indent=2, sort_keys=True) + "\n"
    )


def check_export_files(folder: str | os.PathLike) -> None:
    """Refuse (ConfigurationError, the files named) an export whose files are not the ones its card and scan were
    written with: each file of the manifest but the card itself must still have the sha256 the export recorded."""
    folder = Path(folder)
    manifest = _read_manifest(folder)
    if manifest is None:
        return  # files_to_push refuses it
    if DIGESTS_KEY not in manifest:
        logger.warning(
            "%s was exported by an earlier version, which recorded no digest of its files: push cannot check that "
            "its model card and robustness scan describe them; re-export it with hf-tapernorm fold to have them "
            "checked",
            folder,
        )
        return
    recorded = manifest[DIGESTS_KEY]
    changed = [
        name
        for name in manifest["files"]
        if name != CARD_NAME  # the card is prose its owner may edit; what it is about is checked
        and (not (folder / name).is_file() or recorded.get(name) != _sha256(folder / name))
    ]
    if changed:
        listed = ", ".join(changed[:4]) + (f" and {len(changed) - 4} more" if len(changed) > 4 else "")
        raise ConfigurationError(
            f"'{folder}': {listed} changed after the export wrote {'it' if len(changed) == 1 else 'them'} (the "
            f"sha256 {EXPORT_MANIFEST_NAME} recorded differs: edited, or a model saved over the export), so the "
            "upload would not be the model its README.md and robustness scan describe; write a fresh export with "
            "hf-tapernorm fold --overwrite from the tapered checkpoint, whose card and scan are of its files "
            "(weights changed on purpose need a card of their own: hf-tapernorm eval --scan_reference measures them)"
        )


def export_folded(
    model: PreTrainedModel,
    save_directory: str | os.PathLike,
    *,
    tokenizer: Any = None,
    overwrite: bool = False,
    facts: Optional[Mapping[str, Any]] = None,
) -> Path:
    """Save a folded model (from ``fold_model``) with its model card, and its tokenizer when given; returns the folder.

    Refuses a non-empty folder unless ``overwrite=True``, and even then one that is not an earlier export (no
    export manifest) or that holds files its export did not write (a user's, named), as ``fold --overwrite`` does.
    A new folder is written beside, in a hidden ``.NAME.export-PID``, and renamed into place when complete; an
    existing one (empty, or an earlier export) is kept and written inside, in a hidden ``.hf_tapernorm_writing-PID``
    whose files move up when complete, the manifest first (a killed write's leftover is deleted by the next write): a
    kill never leaves a half export a retry cannot replace. An earlier export is replaced whole, so none of its files
    (a tokenizer, a robustness scan) stays to be pushed as the new export's; a failed write leaves it as it was.
    ``facts`` fills the model card (see ``hf_tapernorm.export.model_card.FACT_KEYS``); the card is attached to the
    model, so a later ``model.push_to_hub`` uploads the same README.md. Every file written (the tokenizer's too) is in
    the export's manifest, so ``push_export`` uploads it.
    """
    if not isinstance(model, FoldedModelMixin):
        raise TaperStateError(
            f"export_folded expects a folded model from fold_model, got {type(model).__name__}; "
            "call fold_model(model) after tapering to gate 0"
        )
    check_tokenizer_to_save(tokenizer, "export_folded")
    folder = expand_user(save_directory, f"export_folded: save_directory '{save_directory}'")  # "~/out": $HOME/out
    remove_abandoned_inside(folder)
    replace = _check_export_folder(folder, overwrite)
    if facts is not None and not isinstance(facts, Mapping):
        raise ConfigurationError(
            f"export_folded: facts= must be a mapping of model card facts, got {type(facts).__name__}"
        )
    if facts is not None or model.model_card is None:
        attach_model_card(model, facts)
    _write_to(folder, model, tokenizer, replace)
    logger.info("exported %s to %s", type(model).__name__, folder)
    return folder


def _write_export(folder: Path, model: PreTrainedModel, tokenizer: Any) -> None:
    """Save the model (and the tokenizer) into ``folder``, every file in its manifest."""
    with recording_export(folder):
        model.save_pretrained(folder)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
            _log_sink_handling(model, tokenizer)


def _write_to(folder: Path, model: PreTrainedModel, tokenizer: Any, replace: bool) -> None:
    """Write a new folder beside it, an existing one (empty, or an earlier export) inside it, which keeps the folder:
    its owner, group, ACLs, a link to it, a mount point, a shell in it. Killed writes' leftovers beside go first."""
    remove_abandoned(folder, EXPORT_KIND, lambda leftover: _abandoned_export(leftover, folder))
    if folder.name in ("", ".", ".."):
        folder.mkdir(parents=True, exist_ok=True)  # no name to write beside: "." or "new/.."
    if folder.is_dir():
        _write_inside(folder, model, tokenizer, replace)
    else:
        _write_beside(folder, model, tokenizer)


def _claim(folder: Path, container: Path, what: str) -> Path:
    """Make the marked ``container`` a write of ``folder`` goes through; refuse a folder in the way (no leftover)."""
    if os.path.lexists(container):
        raise ConfigurationError(
            f"could not {what} {folder}: '{container}' is in the way (hf-tapernorm writes through that name, and this "
            "one is no leftover of a write that is gone); nothing was written: move it away, then export again"
        )
    make_marked_folder(container)
    return container


def _write_beside(folder: Path, model: PreTrainedModel, tokenizer: Any) -> None:
    """Write a new ``folder``'s export in the hidden, marked ``.NAME.export-PID`` beside it (_temporaries.py), then
    rename it into place: a kill leaves a recognisable leftover, never a half export under the final name."""
    container = _claim(folder, temporary_name(folder, EXPORT_KIND, os.getpid()), "write the export")
    new = container / "new"
    try:
        _write_export(new, model, tokenizer)
        os.replace(new, folder)
    except OSError as error:
        raise ConfigurationError(f"could not write the export {folder}: {error}; nothing was written") from error
    finally:
        shutil.rmtree(container, ignore_errors=True)


def _write_inside(folder: Path, model: PreTrainedModel, tokenizer: Any, replace: bool) -> None:
    """Write the export into the existing ``folder`` through a hidden, marked ``.hf_tapernorm_writing-PID`` inside it
    (bookkeeping: never uploaded; on its filesystem, so the moves are renames), then move it up: an earlier export's
    files are deleted only once the new export is complete (a failed write leaves it as it was), and the new manifest
    goes up first, so a kill mid-move leaves an export (incomplete: push refuses it) that overwrite=True replaces."""
    what = "replace the earlier export" if replace else "write the export"
    container = _claim(folder, writing_inside(folder, os.getpid()), what)
    moving = False
    try:
        _write_export(container, model, tokenizer)
        moving = True
        if replace:
            remove_listed(folder, export_manifest(folder) or ())  # the manifest: replaced by the new one's
        move_up(container, folder, first=EXPORT_MANIFEST_NAME)
    except OSError as error:
        left = "the export in it is incomplete; export again with overwrite=True" if moving else "it is as it was"
        raise ConfigurationError(f"could not {what} {folder}: {error}; {left}") from error
    finally:
        shutil.rmtree(container, ignore_errors=True)


def _abandoned_export(leftover: Path, folder: Path) -> bool:
    """Whether ``leftover`` is a killed export's folder (marked_and_abandoned), deleted then. One that holds a whole
    earlier export of ``folder`` while nothing is under that name (a replacement killed between its two renames) is
    named in a WARNING: that export goes with it, and only there could the user have taken it back."""
    if not marked_and_abandoned(leftover):
        return False
    if (leftover / "old" / EXPORT_MANIFEST_NAME).is_file() and not os.path.lexists(folder):
        logger.warning(
            "deleting '%s', left by an export_folded(overwrite=True) of %s killed before it renamed its new export "
            "into place: it held the earlier export (old/), which the new one written now replaces",
            leftover,
            folder,
        )
    return True


def _check_export_folder(folder: Path, overwrite: bool) -> bool:
    """Refuse, before anything is written: a file on the way to ``folder``, a non-empty folder without
    ``overwrite``, and (even with it) a folder that is not an earlier export (no manifest: a user's model or files,
    which the export would replace) or an export holding files it did not write (a user's, which go with it).
    Returns whether ``folder`` holds an earlier export to replace."""
    blocking = file_in_the_way(folder)
    if blocking:
        raise ConfigurationError(f"cannot export into {folder}: {blocking} is a file")
    if not folder.is_dir() or not any(folder.iterdir()):
        return False
    if not overwrite:
        raise ConfigurationError(
            f"{folder} is not empty; choose a new folder or pass overwrite=True to replace an earlier export"
        )
    refusal = f"refusing overwrite=True of {folder}"
    manifest = export_manifest(folder)
    if manifest is None:
        raise ConfigurationError(
            f"{refusal}: it is not an earlier export (no {EXPORT_MANIFEST_NAME}), and overwrite=True replaces only "
            "one; choose a new folder"
        )
    foreign = sorted(set(_folder_files(folder)) - set(manifest))
    # A bookkeeping name but the manifest is no file of the export: a running command's lock, or a user's look-alike.
    foreign += sorted(p.name for p in folder.iterdir() if _is_bookkeeping(p.name) and p.name != EXPORT_MANIFEST_NAME)
    if foreign:
        listed = ", ".join(foreign[:8]) + (f" and {len(foreign) - 8} more" if len(foreign) > 8 else "")
        raise ConfigurationError(
            f"{refusal}: it holds files the export did not write ({listed}), which replacing it would delete; "
            "move them away first"
        )
    if edited_card(folder):
        raise ConfigurationError(f"{refusal}: {EDITED_CARD}")
    return True


#: Why an export whose card its owner edited is not replaced, and what to do (export_folded's and fold's refusals).
EDITED_CARD = (
    f"its {CARD_NAME} was edited after the export wrote it (its sha256 is not the one {EXPORT_MANIFEST_NAME} "
    f"recorded), and replacing the export would lose the edits; move {CARD_NAME} out of the folder to keep it, or "
    "delete it to let the export be replaced"
)


def edited_card(folder: str | os.PathLike) -> bool:
    """Whether the export in ``folder`` holds a model card that is not the one it wrote: its owner's edits, which
    replacing the export would delete without a word. An export whose manifest recorded no digest of its card (an
    earlier version's) cannot tell, and is replaced as before; push uploads an edited card (check_export_files)."""
    folder = Path(folder)
    manifest = _read_manifest(folder)
    recorded = (manifest or {}).get(DIGESTS_KEY, {}).get(CARD_NAME)
    card = folder / CARD_NAME
    if recorded is None or not card.is_file() or card.is_symlink():
        return False
    return _sha256(card) != recorded


def _log_sink_handling(model: PreTrainedModel, tokenizer: Any) -> None:
    """Say (info) how a sink export reads the tokenizer's output: a leading sink stands for the stored one."""
    sink = list(getattr(model.config, "sink_token_ids", None) or [])
    if sink and tokenizer("a")["input_ids"][: len(sink)] == sink:
        logger.info(
            "the tokenizer adds the sink token(s) %s itself: the export reads a leading sink as its stored one, so "
            "model(**tokenizer(text)) and the text tokenized with add_special_tokens=False give the same logits",
            sink,
        )


def files_to_push(folder: str | os.PathLike, include: Sequence[str] = ()) -> list[str]:
    """The files ``push_export`` uploads: the export's manifest, plus the other files ``include`` names.

    Refuses (ConfigurationError, the files listed) a folder without a manifest, one holding a symbolic link,
    one missing a file of its manifest, one holding a file neither the manifest nor ``include`` names, and one
    whose files are not those its card and scan were written with (check_export_files). The bookkeeping files
    (``.hf_tapernorm_*``: a lock, a manifest) are never uploaded, whatever ``include`` names.
    """
    folder = Path(folder)
    include = _include_patterns([include] if isinstance(include, str) else include)  # a string's letters: "*"
    manifest = export_manifest(folder)
    if manifest is None:
        raise ConfigurationError(
            f"'{folder}' has no export manifest ({EXPORT_MANIFEST_NAME}), so which files are the export is "
            "unknown; re-export it with hf-tapernorm fold (or taper) and push that folder"
        )
    present = _folder_files(folder)
    links = [name for name in present if (folder / name).is_symlink()]
    if links:
        raise ConfigurationError(f"'{folder}' holds symbolic links ({', '.join(links[:8])}); push refuses them")
    missing = [name for name in manifest if name not in present]
    if missing:
        raise ConfigurationError(
            f"'{folder}' lacks files of its export ({', '.join(missing[:8])}); re-export it with hf-tapernorm fold"
        )
    extra = sorted(name for name in present if name not in manifest)
    included = [name for name in extra if _matches(name, include)]
    refused = [name for name in extra if name not in included]
    if refused:
        raise ConfigurationError(
            f"'{folder}' holds files the export did not write ({', '.join(refused[:8])}"
            f"{f' and {len(refused) - 8} more' if len(refused) > 8 else ''}); they are not uploaded: move them "
            "away, or name the ones to publish with --include PATTERN"
        )
    check_export_files(folder)
    return sorted([*manifest, *included])


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
    **options: Any,
):
    """Upload the files of a folded export (``files_to_push``: its manifest, plus ``include``) to ``repo_id``.

    ``before_upload`` receives those files once the folder has passed every check, before anything is sent (the
    command line says there what the export's scan found). A ``repo_id`` without an owner (``name``) is the
    token's user's, as on the Hub; the log names the repository it becomes and, before anything is sent, the files
    (those ``include`` added named apart)."""
    folder = expand_user(folder, f"push_export: '{folder}'")
    files = files_to_push(folder, include)
    if before_upload is not None:
        before_upload(files)
    if "/" not in repo_id:
        from huggingface_hub import HfApi

        owner = HfApi(token=options.get("token")).whoami()["name"]
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
    return upload_export(folder, repo_id, allow_patterns=[glob_escape(name) for name in files], **options)


def glob_escape(name: str) -> str:
    """``name`` as an fnmatch pattern that matches only itself (upload_folder's allow_patterns are patterns)."""
    return "".join(f"[{c}]" if c in "*?[]" else c for c in name)


__all__ = [
    "EDITED_CARD",
    "EXPORT_MANIFEST_NAME",
    "BOOKKEEPING_PREFIX",
    "DIGESTS_KEY",
    "check_export_files",
    "edited_card",
    "export_folded",
    "export_manifest",
    "files_to_push",
    "push_export",
    "recording_export",
]
