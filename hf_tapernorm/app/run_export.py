"""What ``taper --overwrite`` and ``--resume`` of a run replace in its ``folded/`` export, checked before anything is
deleted or trained.

Either writes the run's export anew (a ``--resume`` of a finished run too: it folds its tapered model again and
re-exports), so what its owner added to the export since goes with it. A model card or generation_config.json edited
after the export wrote it is refused, as ``fold --overwrite`` refuses it (export/manifest.py ``edited_files``), and
weights or a config changed since are named in a WARNING (``warn_changed_export``, as fold's) once the run goes
ahead. The robustness scan a later ``fold --scan_windows N`` wrote into ``folded/`` is the run's to replace (the
export's manifest lists it, and the export was made from the run's own tapered/, fold_main checks that), but a run
with ``--scan_windows 0`` writes none in its place: a WARNING names it, after every refusal and before anything is
deleted.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..errors import ConfigurationError
from ..evaluation.scan import SCAN_FILE
from ..export.manifest import edited_files, edited_refusal, export_manifest, warn_changed_export
from .data_checks import RUN_EXPORT
from .run_lock import RunFolderError

logger = logging.getLogger(__name__)


def check_run_export(run: Path, *, resume: bool) -> None:
    """Refuse ``--overwrite`` or ``--resume`` (``resume``) of the run in ``run`` whose export holds an edited card or
    generation_config.json (its owner's edits, which the new export would lose)."""
    export = run / RUN_EXPORT
    try:
        edited = edited_files(export)
    except ConfigurationError:  # a damaged export manifest: none of its files are the run's (RunFolder.check)
        return
    if edited:
        verb = "--resume" if resume else "--overwrite"
        raise RunFolderError(
            f"refusing to {verb} '{run}', which writes its export '{export}' anew: {edited_refusal(edited)}"
        )


def warn_run_export(run: Path, *, resume: bool, scans: bool) -> None:
    """Warn of the files of the run's export changed since the export wrote them (weights saved over it), and of a
    robustness scan in it that the new export does not replace (``scans``: the run scans its export). Called once
    the run goes ahead (prepare_run_folder, after every check that can refuse it): a refused run replaces nothing."""
    export = run / RUN_EXPORT
    verb = "--resume" if resume else "--overwrite"
    try:
        warn_changed_export(export, f"{verb} of {run}, which writes its export {export} anew,")
    except ConfigurationError:  # a damaged export manifest: none of its files are the run's (RunFolder.check)
        return
    if not scans:
        warn_dropped_scan(export, f"{verb} of {run} writes its export {export} anew, and")


def warn_dropped_scan(export: Path, replacing: str) -> None:
    """Warn that the robustness scan an earlier fold wrote into ``export`` (its manifest lists it) goes with the
    export, where the new one has none (``--scan_windows 0``): a run's --overwrite/--resume of its folded/ and fold
    --overwrite say so in the same words (``replacing``: who replaces it, and how), once they go ahead."""
    try:
        files = export_manifest(export) or []
    except ConfigurationError:  # a damaged export manifest: its files are no export's, and the write refuses them
        return
    if SCAN_FILE in files and (export / SCAN_FILE).is_file():
        logger.warning(
            "%s its %s (the robustness scan a fold wrote there) goes with the old export: copy it out of the folder "
            "to keep it, or scan the new export with fold --scan_windows N",
            replacing,
            SCAN_FILE,
        )


__all__ = ["check_run_export", "warn_dropped_scan", "warn_run_export"]
