"""Write a folded model to a folder: safetensors, config with auto_map, modeling code, model card, tokenizer.

``save_pretrained`` of the folded class does the writing (transformers copies ``modeling_folded.py`` because the
classes are registered for the Auto classes); this adds what an export needs on top: no silent overwrite of an
existing folder, the model card filled with the run facts, a manifest of the files written (manifest.py), and writes a
kill never leaves half done under the export's name.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

from safetensors import SafetensorError
from transformers import PreTrainedModel

from .._disk_errors import disk_error_text, says_disk_full
from .._lock_file import live_owner, look_at_lock, owner_text, parsed_record, pid_of, remove_stale_lock
from .._temporaries import (
    live_write_of,
    make_marked_folder,
    marked_and_abandoned,
    move_up,
    process_command,
    remove_abandoned,
    remove_abandoned_inside,
    remove_listed,
    temporary_name,
    writing_inside,
)
from ..config_fields import check_tokenizer_to_save
from ..errors import ConfigurationError, TaperStateError
from ..utils import dangling_link, dangling_parent_step, expand_user, file_in_the_way, some_names, true_or_false
from .manifest import (
    EXPORT_MANIFEST_NAME,
    LOCK_NAME,
    edited_files,
    edited_refusal,
    export_manifest,
    folder_files,
    is_bookkeeping,
    recording_export,
    warn_changed_export,
)
from .model_card import render_model_card
from .modeling_folded import FoldedModelMixin

logger = logging.getLogger(__name__)

#: The kind of the hidden folder a new export is written through (``.NAME.export-PID``: _temporaries.py).
EXPORT_KIND = "export"

#: The folders (their real paths) this process's export_folded calls are writing now. A second call's write of one
#: goes through the same ``.hf_tapernorm_writing-PID`` (or ``.NAME.export-PID``), which its pid cannot tell from
#: a killed write's (writer_gone counts this process's own pid as gone): it would delete the first's files.
_WRITING_NOW: set[str] = set()
_WRITING_NOW_LOCK = threading.Lock()


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
    export manifest) or that holds files its export did not write (a user's, named), as ``fold --overwrite`` does;
    a folder another write is in progress in (another process's, or another thread's of this one), a ``..`` after a
    missing folder, and an ``overwrite`` that is not a bool (``"no"`` is true) are refused too. Files of an
    earlier export changed since it wrote them (its weights, its config) are named in a WARNING as they are replaced.
    A new folder is written beside, in a hidden ``.NAME.export-PID``, and renamed into place when complete; an
    existing one (empty, or an earlier export) is kept and written inside, in a hidden ``.hf_tapernorm_writing-PID``
    whose files move up when complete, the manifest first (a killed write's leftover is deleted by the next write): a
    kill never leaves a half export a retry cannot replace. An earlier export is replaced whole, so none of its files
    (a tokenizer, a robustness scan) stays to be pushed as the new export's; a failed write leaves it as it was.
    ``facts`` fills the model card (see ``hf_tapernorm.export.model_card.FACT_KEYS``; an unknown fact, or one of
    another type, is refused before anything is written or warned of); the card is attached to the
    model, so a later ``model.push_to_hub`` uploads the same README.md. Every file written (the tokenizer's too) is in
    the export's manifest, so ``push_export`` uploads it.
    """
    if not isinstance(model, FoldedModelMixin):
        raise TaperStateError(
            f"export_folded expects a folded model from fold_model, got {type(model).__name__}; "
            "call fold_model(model) after tapering to gate 0"
        )
    check_tokenizer_to_save(tokenizer, "export_folded")
    overwrite = true_or_false(overwrite, "export_folded: overwrite=")
    folder = expand_user(save_directory, f"export_folded: save_directory '{save_directory}'")  # "~/out": $HOME/out
    dangling = dangling_parent_step(folder, f"export_folded: save_directory '{save_directory}'")
    if dangling:  # "DIR/nothere/..": creating nothere/ would write into DIR, a folder no check looked at
        raise ConfigurationError(dangling)
    if facts is not None and not isinstance(facts, Mapping):  # before the folder's check, which warns of changes
        raise ConfigurationError(
            f"export_folded: facts= must be a mapping of model card facts, got {type(facts).__name__}"
        )
    # The card first: unknown facts are refused before the folder's check, which warns of what it replaces.
    card = render_model_card(model, facts) if facts is not None or model.model_card is None else None
    with _only_write_in_this_process(folder):  # before the leftovers' cleanup, which would take its folder for one
        remove_abandoned_inside(folder)
        replace = _check_export_folder(folder, overwrite)
        if card is not None:
            model.model_card = card  # attach_model_card's, once the folder is known to be written
        _write_to(folder, model, tokenizer, replace)
    logger.info("exported %s to %s", type(model).__name__, folder)
    return folder


@contextmanager
def _only_write_in_this_process(folder: Path) -> Iterator[None]:
    """Hold ``folder`` as written by this call for its duration; refuse it while another thread's call writes it
    (_WRITING_NOW): both would write through the same pid-named folder, and each would take the other's for a
    killed write's leftover. A link to the folder and the folder itself are one folder."""
    key = os.path.realpath(folder)
    with _WRITING_NOW_LOCK:
        busy = key in _WRITING_NOW
        _WRITING_NOW.add(key)
    if busy:
        raise ConfigurationError(
            f"cannot export into {folder}: another write of {folder} is in progress (export_folded in another thread "
            f"of this process, pid {os.getpid()}); wait for it to finish, or choose a new folder"
        )
    try:
        yield
    finally:
        with _WRITING_NOW_LOCK:
            _WRITING_NOW.discard(key)


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
    except (OSError, SafetensorError) as error:
        _refuse_full_disk(error, folder, "write the export", "nothing was written")
        if isinstance(error, SafetensorError):
            raise
        raise ConfigurationError(f"could not write the export {folder}: {error}; nothing was written") from error
    finally:
        shutil.rmtree(container, ignore_errors=True)


def _refuse_full_disk(error: BaseException, folder: Path, what: str, left: str) -> None:
    """Refuse a write that failed for want of room (_disk_errors.says_disk_full) in one line naming ``folder`` and the
    disk, not the writer's hidden temporary file (the OSError names it); raised from ``error``, which the CLI's
    full-disk line reads. Any other error: nothing (the caller raises its own)."""
    if says_disk_full(error):
        raise ConfigurationError(
            f"could not {what} {folder}: its disk is full or a file-size limit was reached ({disk_error_text(error)}); "
            f"{left}: free space, or choose a folder on another disk"
        ) from error


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
    except (OSError, SafetensorError) as error:
        left = "the export in it is incomplete; export again with overwrite=True" if moving else "it is as it was"
        _refuse_full_disk(error, folder, what, left)
        if isinstance(error, SafetensorError):
            raise
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
    link = dangling_link(folder)  # the write would fail at its end, in the OS's words (a link above it too)
    if link:
        raise ConfigurationError(f"cannot export into {folder}: {link}")
    blocking = file_in_the_way(folder)
    if blocking:
        raise ConfigurationError(f"cannot export into {folder}: {blocking} is a file")
    live = live_write_of(folder)  # its files and this export's would mix, or one export be lost
    if live:
        raise ConfigurationError(f"cannot export into {folder}: {live}; wait for it to finish, or choose a new folder")
    held = _held_by_a_command(folder)
    if held:
        raise ConfigurationError(f"cannot export into {folder}: {held}")
    _remove_stale_lock(folder)
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
    foreign = sorted(set(folder_files(folder)) - set(manifest))
    # A bookkeeping name but the manifest is no file of the export: a running command's lock, or a user's look-alike.
    foreign += sorted(p.name for p in folder.iterdir() if is_bookkeeping(p.name) and p.name != EXPORT_MANIFEST_NAME)
    if foreign:
        raise ConfigurationError(
            f"{refusal}: it holds files the export did not write ({some_names(foreign)}), which would stay beside the "
            "new export's (a replacement deletes only the files of the earlier one's manifest), and push refuses an "
            "export mixed with other files; move them away first"
        )
    edited = edited_files(folder)
    if edited:
        raise ConfigurationError(f"{refusal}: {edited_refusal(edited)}")
    warn_changed_export(folder, f"overwrite=True of {folder}")
    return True


def _remove_stale_lock(folder: Path) -> None:
    """Delete ``folder``'s run lock where it is stale (_lock_file.remove_stale_lock: a killed push's or fold's, an
    empty one), as a fold or taper into the folder takes it over and lets it go: not counted as the folder's content,
    nor left in the export. A lock of a live process without its flock, another host's, or a file of the user's
    under that name stays, and is named as a file the export did not write."""
    why = remove_stale_lock(folder / LOCK_NAME)
    if why is not None:
        logger.warning("deleted the lock %s, left by a command that is gone: %s", folder / LOCK_NAME, why)


def _held_by_a_command(folder: Path) -> Optional[str]:
    """Why ``folder`` is another command's now (its refusal's reason and way out), or None: a command holds its run
    lock (_lock_holder), or the lock of a folder above it (a taper run writing its checkpoints and export, a fold),
    judged as the commands judge a folder they write into (app/run_lock.refuse_while_running): a lock another host's
    command or an unreadable record may hold counts too. A lock this process holds is its own command's, writing
    inside its folder."""
    holder = _lock_holder(folder)
    if holder:
        return f"a running hf-tapernorm command holds it ({holder}); wait for it to finish, or choose a new folder"
    for above in Path(os.path.realpath(folder)).parents:
        try:
            owner = live_owner(above / LOCK_NAME, this_process_too=False)
        except PermissionError:  # a folder on the way this user cannot search: its lock's owner cannot be told
            owner = owner_text(above / LOCK_NAME, b"")
        except OSError:
            continue
        if owner is not None:
            return (
                f"it lies in '{above}', which a running hf-tapernorm command owns ({owner}); wait for it to finish, "
                "or choose a folder outside it"
            )
    return None


def _lock_holder(folder: Path) -> Optional[str]:
    """The process holding ``folder``'s run lock (``.hf_tapernorm_run.lock`` under a flock: a push uploading the
    export, a fold writing it), named by its pid and command line; None when no one holds it (none, or a killed
    command's). Replacing the export under a push would publish a mix of two exports. The lock itself is app/'s
    (run_lock.py); this only looks (_lock_file.look_at_lock), as its other readers do."""
    try:
        look = look_at_lock(folder / LOCK_NAME)
    except OSError:  # one this user cannot read: the folder's other checks name it
        return None
    if look is None or look.free:
        return None  # none, or a killed command's, which the foreign files' check judges
    pid = pid_of(parsed_record(look.record))
    if pid is None:
        return "its lock's record is unreadable"
    command = process_command(pid)
    return f"pid {pid}: {command}" if command else f"pid {pid}"


def _log_sink_handling(model: PreTrainedModel, tokenizer: Any) -> None:
    """Say (info) how a sink export reads the tokenizer's output: a leading sink stands for the stored one."""
    sink = list(getattr(model.config, "sink_token_ids", None) or [])
    if sink and tokenizer("a")["input_ids"][: len(sink)] == sink:
        logger.info(
            "the tokenizer adds the sink token(s) %s itself: the export reads a leading sink as its stored one, so "
            "model(**tokenizer(text)) and the text tokenized with add_special_tokens=False give the same logits",
            sink,
        )


__all__ = ["export_folded"]
