"""The run folder before a taper run trains: what ``--overwrite`` and ``--resume`` may delete or rewrite (nothing
the run reads, no export whose card was edited, only checkpoints a stopped run left incomplete), then the folder
emptied or cleaned and its files recorded. The pipeline (taper.py) calls these before the weights load.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

from .._temporaries import live_write_of
from ..evaluation.models import ModelSource
from .resume_check import check_resumable
from .run_export import check_run_export, warn_run_export
from .run_folder import RunFolder, RunFolderError
from .training_run import recorded_identity
from .validation import TaperRequest, check_inputs_outside

logger = logging.getLogger(__name__)


def finished_run(folder: Path) -> bool:
    """Whether ``folder`` holds the report of a finished run (a failed --resume of it must not replace that report,
    whose tapered/ and folded/ outputs are still there)."""
    try:
        return json.loads((folder / "report.json").read_text()).get("status") == "finished"
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return False


def check_run_folder(request: TaperRequest, output: RunFolder, source: ModelSource) -> tuple[bool, list[Path]]:
    """Whether the run folder must be emptied (``--overwrite``) and the checkpoints a resumed run must drop, after
    checking that nothing the run reads lies in what it deletes or rewrites."""
    refuse_live_writes(output)
    must_empty = output.check(
        overwrite=request.run.overwrite,
        resume=request.run.resume,
        has_checkpoint=lambda: bool(list(output.path.glob("**/checkpoint-*"))),
        recorded_identity=lambda: recorded_identity(output.path),
    )
    if must_empty or request.run.resume:  # nothing this run reads may lie in what it deletes or rewrites
        inputs = {
            "--model_name_or_path": source.describe() if source.kind != "hub" else None,
            "--dataset_name": request.data.dataset_name,
            "--out_of_corpus_dataset": request.data.out_of_corpus_dataset,
            "--baseline_from": request.run.baseline_from,
        }
        check_inputs_outside(output.path, inputs, "--overwrite" if request.run.overwrite else "--resume")
        check_run_export(output.path, resume=request.run.resume)
    stale_checkpoints = (
        check_resumable(output.path, trust_sharded_checkpoint=request.model.trust_sharded_checkpoint)
        if request.run.resume
        else []
    )
    return must_empty, stale_checkpoints


def refuse_live_writes(output: RunFolder) -> None:
    """Refuse a run folder that a write is going on in now, naming that write as fold does: an ``export_folded`` (or
    fold) writing into the folder or a folder directly in it (its ``folded/``, a ``checkpoint-N``) through a
    ``.hf_tapernorm_writing-PID`` (write_in_progress), or writing one of its output folders not there yet through a
    ``.NAME.export-PID`` beside it, in the run folder (live_write_of). Checked before the folder's files
    are judged: among them that write's folder would be named a user's file to move away, and moving a live write's
    folder breaks it."""
    words = next(_live_writes(output), None)
    if words:
        raise RunFolderError(
            f"output folder '{output.path}': {words}; wait for it to finish, or choose another --output_dir"
        )


def _live_writes(output: RunFolder) -> Iterator[str]:
    """The words naming each live write in the run folder (refuse_live_writes), the run folder's own first."""
    outputs = [output.path / name.rstrip("/") for name in output.outputs if name.endswith("/")]
    try:
        inner = sorted(entry for entry in output.path.iterdir() if entry.is_dir() and not entry.is_symlink())
    except OSError:  # no folder yet (nothing written in it), or one this user may not list: its own checks say so
        inner = []
    for folder in [output.path, *dict.fromkeys([*outputs, *inner])]:
        words = live_write_of(folder)
        if words:
            yield words


def prepare_run_folder(
    output: RunFolder, must_empty: bool, stale_checkpoints: Optional[list[Path]], identity, *, scans: bool
) -> None:
    """Empty the folder (``must_empty``), or, resuming (``stale_checkpoints`` not None), remove what a stopped run
    was writing; then record the folder's files (a resumed run's identity is rewritten once it has trained). First
    the WARNING of what the new export replaces (warn_run_export; ``scans``: the run scans its export): the run goes
    ahead now, every check that could refuse it passed."""
    resume = stale_checkpoints is not None
    if must_empty or resume:
        warn_run_export(output.path, resume=resume, scans=scans)
    if must_empty:
        output.empty()
    if stale_checkpoints is None:
        output.record(identity=identity)
        return
    output.remove_partials()
    for checkpoint in stale_checkpoints:
        logger.warning("removing %s: it was being written when the run stopped (incomplete)", checkpoint)
        shutil.rmtree(checkpoint)
    output.record()


__all__ = ["check_run_folder", "finished_run", "prepare_run_folder", "refuse_live_writes"]
