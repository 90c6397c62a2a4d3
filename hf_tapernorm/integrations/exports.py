"""Open a folded export for the integrations: the loaded model, and the transformers class it is built on."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Union

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from ..errors import ConfigurationError
from ..export.modeling_folded import FoldedModelMixin

ExportSource = Union[str, os.PathLike, PreTrainedModel]


def load_export(source: ExportSource, *, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """The folded model of ``source`` (a folder ``export_folded`` wrote, or a folded model), in eval mode.

    Refuses a folder without a config, and a model that is not folded: the integrations rely on the export's
    structure (folded norms as identities, the stored sink).
    """
    if isinstance(source, PreTrainedModel):
        model = source
    else:
        folder = Path(source)
        if not (folder / "config.json").is_file():
            raise ConfigurationError(f"'{folder}' holds no config.json: name the folder export_folded wrote")
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    if not isinstance(model, FoldedModelMixin):
        raise ConfigurationError(
            f"{type(model).__name__} is not a folded export: fold_model and export_folded make one "
            "(hf-tapernorm fold, or the folded/ folder of hf-tapernorm taper)"
        )
    return model.eval()


def base_class(model: PreTrainedModel) -> type:
    """The transformers ``*ForCausalLM`` class a folded model class extends (``LlamaForCausalLM``, ...)."""
    return next(c for c in type(model).__mro__[1:] if c.__module__.startswith("transformers.models."))


__all__ = ["ExportSource", "base_class", "load_export"]
