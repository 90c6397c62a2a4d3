"""Write a folded model to a folder (safetensors, config with auto_map, modeling code, model card) and push it.

``save_pretrained`` of the folded class does the writing (transformers copies ``modeling_folded.py``
because the classes are registered for the Auto classes); this adds the two things an export needs
on top: no silent overwrite of an existing folder, and the model card filled with the run facts.
Pushing uploads the folder as written (``modeling_folded.upload_export``, also behind
``folded.push_to_hub``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

from transformers import PreTrainedModel

from ..errors import ConfigurationError, TaperStateError
from .model_card import attach_model_card
from .modeling_folded import FoldedModelMixin, upload_export

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
    replaced). ``facts`` fills the model card (see ``hf_tapernorm.export.model_card.FACT_KEYS``); the card
    is attached to the model, so a later ``model.push_to_hub`` uploads the same README.md.
    """
    if not isinstance(model, FoldedModelMixin):
        raise TaperStateError(
            f"export_folded expects a folded model from fold_model, got {type(model).__name__}; "
            "call fold_model(model) after tapering to gate 0"
        )
    folder = Path(save_directory)
    if folder.exists() and not folder.is_dir():
        raise ConfigurationError(f"cannot export into {folder}: it is a file")
    if folder.is_dir() and any(folder.iterdir()) and not overwrite:
        raise ConfigurationError(
            f"{folder} is not empty; choose a new folder or pass overwrite=True to replace its files"
        )
    if facts is not None or model.model_card is None:
        attach_model_card(model, facts)
    model.save_pretrained(folder)
    logger.info("exported %s to %s", type(model).__name__, folder)
    return folder


def push_export(folder: str | os.PathLike, repo_id: str, **options: Any):
    """Upload a folded export folder (weights, config, code, tokenizer, card) as it is on disk."""
    return upload_export(folder, repo_id, **options)


__all__ = ["export_folded", "push_export"]
