"""What ``eval`` and ``fold`` check of a tapered checkpoint before its weights load.

The sink (``sink_token_ids``) is the one field of a checkpoint's recipe its weights cannot vouch for: an edited
``scope`` or ``keep_norms`` is caught by the gates the norms were saved at (load_tapered), but the sink tokens are
the positions every sequence starts with, not a tensor. A checkpoint whose ``tapernorm_config.json`` names other
sink tokens than the model was trained with is evaluated, folded and checked consistently, and its export stores
the wrong sink. The run that wrote a checkpoint records its recipe: a Trainer checkpoint in its
``tapernorm_run.json`` (the run's identity), the run's ``tapered/`` folder in the run's ``report.json``. Where such
a record is there the two must agree. A checkpoint nothing records (``save_tapered``'s folder, a copy taken out of
its run) has nothing to tell an edit from an intent by, and is not checked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import torch

from ..config import CONFIG_NAME
from ..errors import ConfigurationError
from ..export.folding import tied_head_unused
from ..training.checkpoints import tapered_config_of, weightless_tapered
from ..utils import json_object
from .training_run import IDENTITY_NAME


def _recorded_sink(checkpoint: Path) -> Optional[tuple[list[int], Path]]:
    """The sink token ids the run that wrote ``checkpoint`` recorded, and the file that records them; None where no
    run's record of this checkpoint is there, or it names no readable list of ids."""
    checkpoint = checkpoint.resolve()  # "." inside tapered/ is the run's tapered/ too
    records = [checkpoint / IDENTITY_NAME]
    if checkpoint.name == "tapered":  # a run's tapered/ folder (app/taper.py writes it), beside the run's report
        records.append(checkpoint.parent / "report.json")
    for path in records:
        recipe = json_object(path).get("taper")
        ids = recipe.get("sink_token_ids") if isinstance(recipe, dict) else None
        if isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            return ids, path
    return None


def check_recorded_sink(checkpoint: Union[str, Path]) -> None:
    """Refuse a tapered checkpoint whose ``tapernorm_config.json`` names other sink tokens than its run recorded
    (see the module's docstring), naming both. Either may be the edited one (a report.json edited by hand, a
    tapernorm_config.json edited or copied from another run): the refusal says they disagree, and names neither as
    the one to change."""
    checkpoint = Path(checkpoint)
    found = _recorded_sink(checkpoint)
    if found is None:
        return
    recorded, record = found
    ids = list(tapered_config_of(checkpoint).sink_token_ids)
    if ids != recorded:
        raise ConfigurationError(
            f"tapered checkpoint '{checkpoint}': its {CONFIG_NAME} names sink_token_ids {ids}, but its run's record "
            f"{record} names {recorded}: the two records of the sink it was trained with disagree, and its weights "
            "cannot tell which is right; one of the files was edited since, or the checkpoint is not that run's: "
            "restore the edited one as the run wrote it"
        )


def refuse_unfoldable_gate(checkpoint: Union[str, Path], gate: Optional[float]) -> None:
    """Refuse to fold ``checkpoint`` saved at ``gate`` > 0 (None: not known yet, nothing refused): only a model at
    g = 0 is a fixed linear map. ``fold`` asks with the gate read from the files (saved_gate) before the weights
    load, and with the loaded model's where the files could not tell (a sharded checkpoint)."""
    if gate is not None and gate > 0.0:
        raise ConfigurationError(
            f"'{checkpoint}' was saved at gate {gate:.4g}: only a model at g = 0 folds; finish its taper (resume the "
            "run) and fold the checkpoint written at g = 0"
        )


def refuse_unused_tied_head(
    checkpoint: Union[str, Path], tied_head: str, model: Optional[torch.nn.Module] = None
) -> None:
    """Refuse ``fold --tied_head scale`` of ``checkpoint`` where the choice changes nothing (tied_head_unused: an
    untied head, or a kept final norm): the export would be the default one, without a word. ``model``: the loaded
    checkpoint; without it a weightless copy built from the checkpoint's config and recipe answers, before the
    weights load (where that copy cannot be built, nothing is refused: fold asks again with the loaded model)."""
    if tied_head != "scale":
        return
    if model is None:
        model = _weightless(Path(checkpoint))
    reason = tied_head_unused(model) if model is not None else None
    if reason is not None:
        raise ConfigurationError(
            f"--tied_head scale has no effect on '{checkpoint}': {reason}; the export would be the default one, so "
            "leave --tied_head out"
        )


def _weightless(checkpoint: Path) -> Optional[torch.nn.Module]:
    """The patched tapered ``checkpoint`` on the meta device (its config and recipe, no weights); None where it
    cannot be built from them (loading the checkpoint then names the problem)."""
    try:
        return weightless_tapered(checkpoint)
    except Exception:  # noqa: BLE001 - transformers raises many types; the loaded model is checked instead
        return None


__all__ = ["check_recorded_sink", "refuse_unfoldable_gate", "refuse_unused_tied_head"]
