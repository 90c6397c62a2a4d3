"""Which model the robustness scan of a run's export or checkpoint compares with: the normalized baseline the run
trained or named, else its original model, each only while it still holds the model the run recorded of it (a
fine-tune saved over it, an edited config.json, another model copied there would be a stranger to score against).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

from .record import recorded_path
from .run_membership import holds_the_runs_baseline, holds_the_runs_model

logger = logging.getLogger(__name__)


def recorded_reference(facts: dict[str, Any], run_folder: Path) -> Optional[tuple[Path, str]]:
    """The model a scan of the run in ``run_folder`` (report ``facts``) compares with, and its name: the normalized
    baseline it saved (its own ``baseline/model``, wherever the folder was copied) or named (``"baseline"``), else its
    original (``"original"``), each while it holds the weights and config.json the run recorded (run_membership); None
    when neither does. A recorded model that is gone or holds another model now is said in one warning line."""
    export, model = facts.get("export") or {}, facts.get("model") or {}
    own = run_folder / "baseline" / "model"  # a run trained with --baseline: its own, also in a copied run folder
    named = export.get("baseline_model") and (own / "config.json").is_file()
    baseline = own if named else recorded_path(facts, run_folder, export.get("baseline_model"))
    baseline_there = baseline is not None and _is_there(baseline)
    if baseline_there and holds_the_runs_baseline(baseline, facts):
        return baseline, "baseline"
    original = recorded_path(facts, run_folder, model.get("source")) if model.get("kind") != "hub" else None
    there = original is not None and _is_there(original)
    found = there and holds_the_runs_model(original, run_folder)
    if original is not None and not found and baseline is None:
        logger.warning(
            "the original model that the run in %s recorded %s: the robustness scan has no model of the run to compare "
            "with",
            run_folder,
            f"holds another model now ({original}: {_CHANGED})" if there else f"is not there ({original})",
        )
    if baseline is not None:
        logger.warning(
            "the baseline that the run in %s recorded %s: the robustness scan compares with %s",
            run_folder,
            f"holds another model now ({baseline}: {_CHANGED})" if baseline_there else f"is not there ({baseline})",
            f"the original model instead ({original})" if found else _no_original(original, there),
        )
    return (original, "original") if found else None


def _no_original(original: Optional[Path], there: bool) -> str:
    """What a scan without its baseline compares with when the original is no reference either: why not."""
    if there:
        return f"no model of the run (its original, {original}, holds another model now: {_CHANGED})"
    return "no model of the run (nor is its original there)"


#: Why a recorded model folder is another model now, and the way to compare with it all the same.
_CHANGED = "its weights or config.json changed since the run recorded them; a re-save by another transformers version"
_CHANGED += " counts too; --scan_reference compares with it anyway"


def _is_there(path: Path) -> bool:
    """Whether a recorded path is there; a path this system cannot even look up (a name too long) is not."""
    try:
        return path.exists()
    except OSError:
        return False


__all__ = ["recorded_reference"]
