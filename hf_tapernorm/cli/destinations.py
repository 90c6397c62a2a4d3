"""Where ``eval`` and ``fold`` write, checked before anything loads: eval's ``--output_json`` result file and fold's
export folder (its ``--output_dir``). Each may replace only what an earlier run of the same command wrote there; a
model's file or a user's is never written over, nor a folder a running hf-tapernorm command holds; and neither lies in
a local dataset the command reads (eval's data, the run's texts that fold's scan reads): it would become part of it.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

from .._parsing import UsageError
from .._temporaries import live_write_of, remove_abandoned_inside
from ..app.checkpoint_files import CHECKPOINT_NAME
from ..app.data_checks import (
    RUN_EXPORT,
    check_output_outside,
    check_output_outside_models,
    datasets_read,
    refuse_dangling_output,
    run_manifest,
)
from ..app.folder_writes import check_folder_destination, check_path_length, temporary_name
from ..app.run_folder import LOCK_NAME
from ..app.run_lock import check_destination, refuse_while_running, resolved_path, unreadable_place
from ..evaluation.scan import SCAN_FILE
from ..export.manifest import EXPORT_MANIFEST_NAME, edited_files, edited_refusal, export_manifest
from ..utils import file_in_the_way

#: What an export folder holds (export_folded + the tokenizer); anything else in it is the user's.
EXPORT_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "modeling_folded.py",
    "folded_sink.py",
    "folded_input.py",
    "README.md",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    SCAN_FILE,
)


#: The longest path an export's write passes through inside its folder: a shard of the weights, or the robustness
#: scan written through its ``.NAME.partial-PID`` (of the longest pid): the temporary path's length is checked with it.
LONGEST_EXPORT_PATH = max(
    ["model-00001-of-00001.safetensors", temporary_name(Path(SCAN_FILE), "partial", 2**22).name, *EXPORT_FILES],
    key=len,
)

#: Marks a result file of ``eval --output_json``: the only kind of existing file it replaces.
RESULT_MARK = "hf-tapernorm eval"


def check_result_file(given: str | os.PathLike) -> None:
    """``--output_json`` may name a new file in an existing folder, or an earlier result of ``eval``; nothing else.

    Checked before the model loads; a model's config.json or a user's file is never written over, and a path whose
    temporary sibling would pass PATH_MAX is refused (before the absolute path it resolves to could be). ``given``:
    the path as the user wrote it (refuse_folder_name reads its trailing '/', which Path drops).
    """
    refuse_folder_name(given)
    path = Path(given)
    refuse_dangling_output("--output_json", path, folder=False)  # as every output refuses it
    check_path_length(path, f"--output_json {path}")
    try:
        blocking = file_in_the_way(path.parent)  # "the folder does not exist; create it" could not be followed
        if blocking:
            raise UsageError(f"--output_json {path}: '{path.parent if blocking == 'it' else blocking}' is a file")
        if not resolved_path(path.parent, f"--output_json {path}").is_dir():  # a symbolic link loop: one line
            raise UsageError(f"--output_json {path}: the folder '{path.parent}' does not exist; create it first")
        if path.is_symlink() or (path.exists() and not path.is_file()):
            raise UsageError(f"--output_json {path} is a symbolic link or a folder; name a new file")
        refuse_while_running(path, f"--output_json {path}", advice="name a file outside it")
    except OSError as error:  # a folder on the way that this user cannot read (Path.exists raises EACCES)
        raise UsageError(unreadable_place(f"--output_json {path}", error)) from None
    if not path.exists():
        if not os.access(path.parent, os.W_OK):
            raise UsageError(f"--output_json {path}: the folder '{path.parent}' is not writable")
        return
    try:
        earlier = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        earlier = None
    if not (isinstance(earlier, dict) and earlier.get("written_by") == RESULT_MARK):
        raise UsageError(
            f"--output_json {path} exists and is not an earlier result of hf-tapernorm eval; it is left as it is, "
            "name a new file"
        )


def refuse_folder_name(given: str | os.PathLike) -> None:
    """Refuse an ``--output_json`` that names a folder by its form: no file name at all (``.``, ``/``, ``./``: the
    temporary name of the write has none to build on), or a trailing '/' or '/.' (``nodir/``, ``earlier.json/.``):
    Path drops them, so the result went to a file of that name, where the user named a folder."""
    text = os.fspath(given)
    if not Path(text).name:
        raise UsageError(f"--output_json {text} is a symbolic link or a folder; name a new file")
    for ending in ("/", os.sep, "/.", os.sep + "."):
        if text.endswith(ending):
            raise UsageError(f"--output_json {text} ends with '{ending}', which names a folder; name a file")


def check_result_outside_data(path: Path, data: Any) -> None:
    """Refuse a result file in a local dataset folder that eval reads (``data``: its data arguments), or that is
    its dataset file: the result would be read as more of that dataset (app/data_checks.check_output_outside)."""
    check_output_outside("--output_json", path, datasets_read(data), reader="eval", written="the result")


def check_result_outside_models(path: Path, models: Mapping[str, Optional[str]]) -> None:
    """Refuse a result file in a model folder eval reads (``models``: option -> its path: the model, the scan's
    reference) or in any other saved model's folder (an export): it would join that model, and push would upload it
    or refuse the export (app/data_checks.check_output_outside_models)."""
    check_output_outside_models("--output_json", path, models, reader="eval", written="the result")


def check_export_outside_models(folder: Path, checkpoint: Path) -> None:
    """Refuse an export folder (fold's ``--output_dir``) inside another saved model's folder (an earlier export, a base
    model) or inside a taper run's folder but as the run's own ``folded/``: the export would join that model (push
    then refuses the outer export) or the run (its --overwrite and --resume refuse it as no file of theirs). The
    folder itself may be an earlier export: check_export_folder judges whether it may be replaced. A run's own
    ``folded/`` takes only a fold of that run's ``checkpoint`` (check_run_export_source)."""
    check_output_outside_models("--output_dir", folder, {}, reader="fold", written="the export", export=True)
    check_run_export_source(folder, checkpoint)


def check_run_export_source(folder: Path, checkpoint: Path) -> None:
    """Refuse a fold into a taper run's own ``folded/`` (``folder``) of a ``checkpoint`` that is not that run's
    ``tapered/`` or one of its ``checkpoint-N`` (resolved paths): the run would take another model's export as its
    own, while its report and card describe its own fold and losses."""
    target = resolved_path(folder, f"--output_dir '{folder}'")
    run = target.parent
    if target.name != RUN_EXPORT or run_manifest(run) is None:
        return
    source = resolved_path(checkpoint, f"--checkpoint '{checkpoint}'")
    if source.parent == run and (source.name == "tapered" or CHECKPOINT_NAME.fullmatch(source.name)):
        return
    raise UsageError(
        f"--output_dir '{folder}' is the export of the taper run in '{run}', and --checkpoint '{checkpoint}' is not "
        f"that run's (its tapered/ or a checkpoint-N), while the run's report describes its own fold: fold "
        f"'{run / 'tapered'}' into it, or write this export to a folder outside the run"
    )


def check_export_outside_data(folder: Path, data: Any) -> None:
    """Refuse an export folder in a local dataset folder that fold's robustness scan reads (``data``: the data
    arguments of the run's recorded texts): the export's files would be read as more of the run's own texts by this
    scan and every later one."""
    reader = f"fold's robustness scan (--scan_windows {data.scan_windows})"
    check_export_outside_run_data(folder, datasets_read(data), reader)


def check_export_outside_run_data(folder: Path, datasets: Mapping[str, Optional[str]], reader: str) -> None:
    """Refuse an export folder in a local dataset of the run it folds (``datasets``: option -> its path; ``reader``:
    who reads them), whatever ``--scan_windows`` is: the export's files would be read as more of the run's texts by
    every later scan of that run and its ``--resume`` (app/data_checks.check_output_outside)."""
    inputs = {f"the run's {option}": name for option, name in datasets.items()}
    check_output_outside("--output_dir", folder, inputs, reader=reader, written="the export")


def check_export_folder(folder: Path, overwrite: bool, *, locked: bool = False) -> None:
    """An export may replace only an empty folder or, with ``--overwrite``, an earlier export and nothing else.

    An earlier export is a folder whose export manifest lists every file in it, or (exports written before
    the manifest) a folded model's folder (config.json with a ``tapernorm_*`` model_type) holding only the
    files an export writes. An ordinary model folder uses the same file names, so names alone never decide.
    The folder's lock file is no content; ``locked``: this command holds it (only the folders above are checked
    for another command's). A mount point, a ``..`` after a missing folder and a path too long for the export's
    temporary files are refused too (check_folder_destination): the write would fail at the end, after the fold; so
    is a folder an ``export_folded`` is writing into (or anew, beside it), and what a killed one left inside is
    deleted first.
    """
    what = f"output folder '{folder}'"
    try:
        link = folder.is_symlink()
    except OSError as error:  # a folder on the way that this user cannot read (lstat raises EACCES)
        raise UsageError(unreadable_place(what, error)) from None
    if link:
        raise UsageError(f"output folder '{folder}' is a symbolic link; pass the folder it points to")
    check_folder_destination(folder, f"--output_dir '{folder}'", inside=LONGEST_EXPORT_PATH)
    advice = "wait for it to finish, or choose a folder outside it"  # a running command may write it: one is lost
    check_destination(folder, what, advice=advice, above=locked, renamed_into_parent=True)
    # an export_folded writing into it (its files and this export's would mix), or writing it anew beside it (the
    # second rename into place fails, after the fold)
    live = live_write_of(folder)
    if live:
        raise UsageError(f"{what}: {live}; wait for it to finish, or choose another --output_dir")
    remove_abandoned_inside(folder)  # a killed export_folded's leftover is no user's file: deleted, as it does
    if not folder.is_dir() or not any(p.name != LOCK_NAME for p in folder.iterdir()):
        return
    if not overwrite:
        raise UsageError(f"output folder '{folder}' is not empty; pass --overwrite to replace an earlier export")
    present = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() or p.is_symlink())
    present = [f for f in present if f != LOCK_NAME]
    manifest = export_manifest(folder)
    if manifest is not None:
        foreign = [f for f in present if f not in manifest and f != EXPORT_MANIFEST_NAME]
    elif _is_folded_config(folder / "config.json"):
        foreign = [f for f in present if f not in EXPORT_FILES and not _SHARD.fullmatch(f)]
    else:
        raise UsageError(
            f"refusing to --overwrite '{folder}': it is not an earlier export (no {EXPORT_MANIFEST_NAME}, and its "
            "config.json is not a folded model's); choose another --output_dir"
        )
    links = [f for f in present if (folder / f).is_symlink()]
    if foreign or links:
        raise UsageError(
            f"refusing to --overwrite '{folder}': it holds files an export does not write "
            f"({', '.join((foreign or links)[:8])}); move them away first"
        )
    edited = [] if manifest is None else edited_files(folder)
    if edited:
        raise UsageError(f"refusing to --overwrite '{folder}': {edited_refusal(edited)}")


#: The weight shards an export of an earlier version wrote (save_pretrained's names), beside EXPORT_FILES.
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors|model\.safetensors\.index\.json")


def _is_folded_config(path: Path) -> bool:
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(config, dict) and str(config.get("model_type", "")).startswith("tapernorm_")


__all__ = [
    "EXPORT_FILES",
    "LONGEST_EXPORT_PATH",
    "RESULT_MARK",
    "check_export_folder",
    "check_export_outside_data",
    "check_export_outside_models",
    "check_export_outside_run_data",
    "check_result_file",
    "check_result_outside_data",
    "check_result_outside_models",
]
