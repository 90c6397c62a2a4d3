"""An export's manifest (``.hf_tapernorm_export.json``): the files it wrote, each with its sha256.

Pushing uploads exactly the files of the manifest (hub.py): anything else in the folder (a ``.env`` with a token,
notes) is no export file. The package's own bookkeeping files (``.hf_tapernorm_*``: a command's lock with its pid and
host, a manifest) are never export content.

The model card and the robustness scan state figures of the files they were written with, so the manifest also
records the sha256 of every file as the export wrote it (a writer that rewrites one inside ``recording_export``, the
scan or the card, records its new digest), and a push verifies them: weights edited, a fine-tuned model saved over the
export, an edited config.json, modeling code or scan would otherwise be published under a card and a scan that
describe another model. The files its owner may edit by hand (:data:`OWNER_EDITABLE`: the card, the generation
defaults) describe no weight or logit: push uploads them edited, and a replacement of the export refuses to lose them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

from transformers import GenerationConfig

from ..errors import ConfigurationError, first_line
from ..utils import some_names

logger = logging.getLogger(__name__)

EXPORT_MANIFEST_NAME = ".hf_tapernorm_export.json"
#: The manifest's record of the files the card and the scan describe: file -> its sha256 as the export wrote it.
DIGESTS_KEY = "files_sha256"
#: The model card: written with the export, but prose its owner may edit by hand before a push.
CARD_NAME = "README.md"
#: The generation defaults (do_sample, temperature, max_new_tokens): its owner's to edit, as the card is.
GENERATION_CONFIG_NAME = "generation_config.json"
#: The files of an export its owner may edit by hand before a push: neither changes the weights or the logits that
#: the card and the robustness scan describe, so push uploads them edited (an INFO line names them), and a
#: replacement of the export refuses to lose the edits (edited_files). tokenizer_config.json is not among them: an
#: edit there changes tokenization (add_bos_token, which a stored sink relies on; the chat template).
OWNER_EDITABLE = (CARD_NAME, GENERATION_CONFIG_NAME)
#: The start of the names of the package's bookkeeping files (the manifest, a command's lock): no export content.
BOOKKEEPING_PREFIX = ".hf_tapernorm_"
#: A running command's lock (app/run_lock.py takes it), in a run folder or an export a command writes.
LOCK_NAME = BOOKKEEPING_PREFIX + "run.lock"


def is_bookkeeping(relative: str) -> bool:
    """Whether the file ``relative`` (a posix path in an export) is bookkeeping, never export content: a name of the
    package's (``.hf_tapernorm_*``), or a file anywhere under a folder of such a name (a write's
    ``.hf_tapernorm_writing-PID/``, with a half-written model and the write's mark)."""
    return any(part.startswith(BOOKKEEPING_PREFIX) for part in relative.split("/"))


def folder_files(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``folder`` (relative posix path -> (size, mtime_ns)), the bookkeeping files excluded."""
    found = {}
    for root, dirs, names in os.walk(folder):
        for name in [*names, *(d for d in dirs if Path(root, d).is_symlink())]:
            path = Path(root, name)
            relative = path.relative_to(folder).as_posix()
            if not is_bookkeeping(relative):
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
    before = folder_files(folder) if folder.is_dir() else {}
    yield folder
    after = folder_files(folder)
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
    written with: each file of the manifest but those its owner may edit (:data:`OWNER_EDITABLE`, named in an INFO
    line when edited) must still have the sha256 the export recorded."""
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
    changed = changed_export_files(folder)
    if changed:
        raise ConfigurationError(
            f"'{folder}': {some_names(changed, 4)} changed after the export wrote "
            f"{'it' if len(changed) == 1 else 'them'} (the "
            f"sha256 {EXPORT_MANIFEST_NAME} recorded differs: edited, or a model saved over the export), so the "
            "upload would not be the model its README.md and robustness scan describe; write a fresh export with "
            "hf-tapernorm fold --overwrite from the tapered checkpoint, whose card and scan are of its files "
            "(weights changed on purpose need a card of their own: hf-tapernorm eval --scan_reference measures them)"
        )
    edited = edited_files(folder)
    if GENERATION_CONFIG_NAME in edited:
        _check_generation_config(folder)
    if edited:
        logger.info(
            "%s: %s edited after the export wrote %s (the sha256 %s recorded differs); uploading the edit, which "
            "changes no weight the card and the robustness scan describe",
            folder,
            " and ".join(edited),
            "it" if len(edited) == 1 else "them",
            EXPORT_MANIFEST_NAME,
        )


def _check_generation_config(folder: Path) -> None:
    """Refuse an edited generation_config.json that transformers cannot read (broken JSON, a list, a value it
    refuses such as max_new_tokens -5): from_pretrained of the pushed repository would fail, or drop the edit."""
    try:
        GenerationConfig.from_pretrained(folder)
    except (OSError, TypeError, ValueError) as error:
        raise ConfigurationError(
            f"{folder}: its {GENERATION_CONFIG_NAME} was edited after the export wrote it, and transformers cannot "
            f"read it ({first_line(error)}), so the pushed model would not load, or would drop the edit; fix "
            "the edit, or move the file out and write a fresh export (hf-tapernorm fold --overwrite)"
        ) from None


def changed_export_files(folder: str | os.PathLike) -> list[str]:
    """The files of the export in ``folder``'s manifest, but those its owner may edit (:data:`OWNER_EDITABLE`), that
    are missing or no longer have the sha256 the export recorded; none for an export of a version that recorded no
    digests."""
    folder = Path(folder)
    manifest = _read_manifest(folder)
    if manifest is None or DIGESTS_KEY not in manifest:
        return []
    recorded = manifest[DIGESTS_KEY]
    return [
        name
        for name in manifest["files"]
        if name not in OWNER_EDITABLE
        and (not (folder / name).is_file() or recorded.get(name) != _sha256(folder / name))
    ]


def warn_changed_export(folder: str | os.PathLike, replacing: str) -> None:
    """Name (WARNING) the files of the earlier export in ``folder`` changed since it wrote them (weights saved over
    it, an edited config.json): a replacement (``replacing``: who replaces it, e.g. ``"overwrite=True of E"``)
    deletes them as asked, but they may be someone's work (an edited card or generation_config.json is refused
    instead: edited_files). export_folded, fold --overwrite and a run's
    --overwrite/--resume of its folded/ all warn here, in the same words."""
    folder = Path(folder)
    changed = [name for name in changed_export_files(folder) if (folder / name).is_file()]  # not a killed move's
    if changed:
        pronoun = "it" if len(changed) == 1 else "them"
        logger.warning(
            "%s replaces %s, changed after the earlier export wrote %s (the sha256 %s recorded differs): copy %s out "
            "of the folder first to keep the changes",
            replacing,
            ", ".join(changed),
            pronoun,
            EXPORT_MANIFEST_NAME,
            pronoun,
        )


def missing_export_files(folder: str | os.PathLike) -> list[str]:
    """The files ``folder``'s export manifest lists that are not in it (a write killed while it moved them into
    place; a file deleted since); none without a manifest, or with a damaged one (its readers say so)."""
    try:
        listed = export_manifest(folder) or []
    except ConfigurationError:
        return []
    present = folder_files(Path(folder))
    return [name for name in listed if name not in present]


#: The files of an export that loading it does not read (the card, generation defaults, the robustness scan): an
#: export lacking only these still loads, so eval, bench and taper warn of them where push refuses them.
NOT_LOADED = frozenset({CARD_NAME, GENERATION_CONFIG_NAME, "robustness_scan.json"})


def incomplete_export(folder: str | os.PathLike, what: str, *, loading: bool = False) -> Optional[str]:
    """The refusal (a line starting with ``what``: the option and its value) of an export in ``folder`` that lacks
    files of its manifest, or None: push, eval and every reader of the folder say the same, before anything loads.
    ``loading`` (a reader that loads the model, not push): refuse only where a file loading reads is missing, and
    name the others (:data:`NOT_LOADED`) in a WARNING: a deleted card does not stop an evaluation."""
    missing = missing_export_files(folder)
    if loading and missing and all(name in NOT_LOADED for name in missing):
        logger.warning(
            "%s lacks %s of its export, which its manifest lists: it loads without %s, but push refuses it until it "
            "is exported again (hf-tapernorm fold --overwrite)",
            what,
            ", ".join(missing),
            "it" if len(missing) == 1 else "them",
        )
        return None
    if not missing:
        return None
    if all(name in OWNER_EDITABLE for name in missing):  # deleted by its owner, most likely: say what takes its place
        place = "its place" if len(missing) == 1 else "their place"
        return (
            f"{what} lacks {' and '.join(missing)}, which its export wrote and push publishes with its weights (a "
            f"copy an earlier push left on the Hub would stay beside these); write your own in {place} (push uploads "
            "its owner's edits), or export it again with overwrite=True (hf-tapernorm fold --overwrite)"
        )
    return (
        f"{what} is an incomplete export: it lacks files of its export ({some_names(missing)}), which its manifest "
        "lists (a write killed while it moved them into place, or files deleted since); export it again with "
        "overwrite=True (hf-tapernorm fold --overwrite)"
    )


def edited_refusal(edited: list[str]) -> str:
    """Why an export whose owner edited ``edited`` (edited_files) is not replaced, and what to do: export_folded's,
    fold's and a run's --overwrite/--resume refusals, in the same words."""
    names = " and ".join(edited)
    one = len(edited) == 1
    it = "it" if one else "them"
    return (
        f"its {names} {'was' if one else 'were'} edited after the export wrote {it} "
        f"({'its sha256 is not the one' if one else 'their sha256 are not the ones'} {EXPORT_MANIFEST_NAME} "
        f"recorded), and replacing the export would lose the edits; move {names} out of the folder to keep {it}, or "
        f"delete {it} to let the export be replaced"
    )


def edited_files(folder: str | os.PathLike) -> list[str]:
    """The files its owner may edit (:data:`OWNER_EDITABLE`: the card, the generation defaults) that the export in
    ``folder`` holds and did not write so: its owner's edits, which replacing the export would delete without a word,
    and which push uploads. A file whose digest the manifest did not record (an earlier version's export) cannot
    tell, and is replaced as before; a deleted one is an incomplete export's (incomplete_export)."""
    folder = Path(folder)
    recorded = (_read_manifest(folder) or {}).get(DIGESTS_KEY, {})
    return [
        name
        for name in OWNER_EDITABLE
        if name in recorded
        and (folder / name).is_file()
        and not (folder / name).is_symlink()
        and _sha256(folder / name) != recorded[name]
    ]


__all__ = [
    "BOOKKEEPING_PREFIX",
    "CARD_NAME",
    "DIGESTS_KEY",
    "EXPORT_MANIFEST_NAME",
    "GENERATION_CONFIG_NAME",
    "LOCK_NAME",
    "NOT_LOADED",
    "OWNER_EDITABLE",
    "changed_export_files",
    "check_export_files",
    "edited_files",
    "edited_refusal",
    "export_files",
    "export_manifest",
    "folder_files",
    "incomplete_export",
    "is_bookkeeping",
    "missing_export_files",
    "recording_export",
    "warn_changed_export",
]
