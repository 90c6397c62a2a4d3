"""Write a folded model to a folder: safetensors, config with auto_map, modeling code, model card.

``save_pretrained`` of the folded class does the writing (transformers copies ``modeling_folded.py``
because the classes are registered for the Auto classes); this adds the two things an export needs
on top: no silent overwrite of an existing folder, and the model card filled with the run facts.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Mapping, Optional

from transformers import PreTrainedModel

from .model_card import attach_model_card
from .modeling_folded import FoldedModelMixin

logger = logging.getLogger(__name__)


def export_folded(
    model: PreTrainedModel,
    save_directory: str | os.PathLike,
    *,
    overwrite: bool = False,
    facts: Optional[Mapping[str, Any]] = None,
) -> Path:
    """Save a folded model (from ``fold_model``) with its model card; returns the folder.

    Refuses a non-empty folder unless ``overwrite=True`` (then files of the same names are
    replaced). ``facts`` fills the model card (see ``hf_tapernorm.model_card.FACT_KEYS``); the card
    is attached to the model, so a later ``model.push_to_hub`` uploads the same README.md.
    """
    if not isinstance(model, FoldedModelMixin):
        raise TypeError(
            f"export_folded expects a folded model from fold_model, got {type(model).__name__}; "
            "call fold_model(model) after tapering to gate 0"
        )
    folder = Path(save_directory)
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(f"cannot export into {folder}: it is a file")
    if folder.is_dir() and any(folder.iterdir()) and not overwrite:
        raise FileExistsError(
            f"{folder} is not empty; choose a new folder or pass overwrite=True (CLI: --overwrite) to replace its files"
        )
    attach_model_card(model, facts)
    model.save_pretrained(folder)
    logger.info("exported %s to %s", type(model).__name__, folder)
    return folder


__all__ = ["export_folded"]
