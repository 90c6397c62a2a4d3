"""Whether a tapered checkpoint or an export belongs to the taper run folder it lies in.

A run folder's facts (its report's baseline and original, its data, its tokenizer) describe the models that run
wrote: its ``tapered/``, ``folded/`` and ``checkpoint-N`` folders. A folder copied in from elsewhere (another run's
checkpoint as ``checkpoint-99``, another run's export as ``foldedG``) lies there too, and those facts are not its: a
robustness scan against that run's original would score it against a model it never was; so would one against an
original model folder given another model since the run recorded it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from ..errors import ConfigurationError
from ..utils import json_object
from .checkpoint_files import IDENTITY_NAME, checkpoint_of, unrecorded_checkpoints
from .fingerprints import holds_recorded_weights
from .run_folder import RunFolder


def records_same_model(own: dict, identity: object) -> bool:
    """Whether a checkpoint's own record (``own``) and its run's ``identity`` name the same model: the same path as
    typed and the same recorded files. Where either records no model there is nothing to tell them apart by."""
    if not isinstance(identity, dict) or not isinstance(own.get("model"), str) or "model" not in identity:
        return True
    return own["model"] == identity["model"] and own.get("model_contents") == identity.get("model_contents")


def checkpoint_of_another_run(checkpoint: Path) -> bool:
    """Whether the tapered ``checkpoint`` records (its own tapernorm_run.json) another model than the run folder it
    lies in does (a checkpoint of another run put there)."""
    identity = (RunFolder(checkpoint.parent).manifest() or {}).get("identity")
    return not records_same_model(json_object(checkpoint / IDENTITY_NAME), identity)


def holds_the_runs_model(original: Path, run_folder: Path) -> bool:
    """Whether ``original`` still holds the model the run in ``run_folder`` recorded (its manifest's model_contents:
    the weights and config.json), where the run recorded them: a folder given other weights or another config since
    (a fine-tune saved over it, another model copied there) is not the run's original, and a scan against it would
    compare with a stranger; a notes file beside them or a re-saved tokenizer setting changes no model."""
    identity = (RunFolder(run_folder).manifest() or {}).get("identity")
    contents = identity.get("model_contents") if isinstance(identity, dict) else None
    return not isinstance(contents, dict) or holds_recorded_weights(str(original), contents)


def holds_the_runs_baseline(baseline: Path, facts: dict) -> bool:
    """Whether ``baseline`` still holds the normalized model the run (its report ``facts``) recorded when it trained
    or named it (export.baseline_contents: the weights and config.json), as holds_the_runs_model asks of the original;
    a report of an earlier version, which recorded none, cannot tell."""
    export = facts.get("export")
    contents = export.get("baseline_contents") if isinstance(export, dict) else None
    return not isinstance(contents, dict) or holds_recorded_weights(str(baseline), contents)


def check_resumed_baseline(folder: Path, baseline: Path) -> None:
    """Refuse a ``--resume`` of the run in ``folder`` whose ``--baseline_from`` ``baseline`` holds other weight files
    or another config.json than the run recorded of it (its report's export.baseline_contents): the resumed run
    measured the gap against another model and recorded that one as its baseline, without a word. A run that wrote
    no report yet recorded none."""
    if not holds_the_runs_baseline(baseline, json_object(folder / "report.json")):
        raise ConfigurationError(
            f"--resume: --baseline_from '{baseline}' holds other weight files or another config.json than when the "
            f"run in '{folder}' recorded it, so the gap would be measured against another model: restore that "
            "baseline, or start over with --overwrite"
        )


def _unrecorded_checkpoint(model: Path, entries: list[str]) -> bool:
    """Whether ``model`` is a complete checkpoint (its run record written last) the run folder counts as its own
    though its manifest does not list it yet (a kill between its save and the record): checkpoint_files'
    unrecorded_checkpoints, the run folder's own rule."""
    if not (model / IDENTITY_NAME).is_file():
        return False
    files = [f"{model.name}/{path.relative_to(model).as_posix()}" for path in model.rglob("*") if path.is_file()]
    return model.name in unrecorded_checkpoints(files, {checkpoint_of(entry) for entry in entries})


def not_the_runs(model: Path) -> Optional[str]:
    """Why the checkpoint or export folder ``model`` (resolved) is not the run's whose folder it lies in, or None: the
    run's manifest lists no file of it (a folder copied in, which that run never wrote), or it records another model
    (checkpoint_of_another_run). A folder without a run's manifest above it is no run's: None, for the callers'
    own "not in a run folder"."""
    manifest = RunFolder(model.parent).manifest()
    if manifest is None:
        return None
    entries = [entry for entry in manifest.get("files", []) if isinstance(entry, str)]
    listed = any(entry.startswith(model.name + "/") for entry in entries)
    if not (listed or _unrecorded_checkpoint(model, entries)):
        return f"the run in {model.parent} did not write it (its manifest lists no file of {model.name}/)"
    if checkpoint_of_another_run(model):
        return f"it records another model than the run in {model.parent} (a checkpoint of another run)"
    return None


__all__ = [
    "check_resumed_baseline",
    "checkpoint_of_another_run",
    "holds_the_runs_model",
    "not_the_runs",
    "records_same_model",
]
