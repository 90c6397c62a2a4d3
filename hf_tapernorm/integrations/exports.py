"""Open a folded export (or, where an integration takes any causal LM, a plain one) for the integrations: the
loaded model, and the transformers class it is built on."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from ..errors import ConfigurationError
from ..export.folded_sink import plain_load_of_export
from ..export.modeling_folded import FoldedModelMixin

ExportSource = Union[str, os.PathLike, PreTrainedModel]


def local_path(path: Union[str, os.PathLike]) -> Path:
    """``path`` with ``~`` expanded: every folder the integrations take or write, as the CLI and ``export_folded``
    read it ("~/exp" is the home folder's, not a folder named "~")."""
    return Path(path).expanduser()


def load_export(
    source: ExportSource, *, dtype: Optional[torch.dtype] = None, folded_only: bool = True
) -> PreTrainedModel:
    """The folded model of ``source`` (a folder ``export_folded`` wrote, or a folded model), in eval mode.

    ``dtype``: a folder loads in it (default float32); a model stays in its own, and a ``dtype`` other than its
    own is refused rather than converted: converting in place would change the caller's model, and a copy
    would double its memory without a word.
    Refuses a folder without a config, and (``folded_only``) a model that is not folded: the integrations that
    need the export's structure (folded norms as identities, the stored sink) set it. Refuses an export loaded
    as its plain base class (its config.json's ``model_type`` edited): its sink and folded norms would be lost.
    """
    if isinstance(source, PreTrainedModel):
        model = source
        if dtype is not None and dtype != model.dtype:
            raise ConfigurationError(
                f"dtype={dtype} applies to an export folder; the {type(model).__name__} given is {model.dtype}: "
                f"convert it first (model.to({dtype})) and pass it without dtype="
            )
    else:
        folder = local_path(source)
        if not (folder / "config.json").is_file():
            raise ConfigurationError(f"'{folder}' holds no config.json: name the folder export_folded wrote")
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype or torch.float32)
    problem = plain_load_of_export(type(model).__name__, model.config)
    if problem is not None:
        raise ConfigurationError(problem)
    if folded_only and not isinstance(model, FoldedModelMixin):
        raise ConfigurationError(
            f"{type(model).__name__} is not a folded export: fold_model and export_folded make one "
            "(hf-tapernorm fold, or the folded/ folder of hf-tapernorm taper)"
        )
    return model.eval()


def base_class(model: PreTrainedModel) -> type:
    """The transformers ``*ForCausalLM`` class of ``model``: the one a folded model class extends
    (``LlamaForCausalLM``, ...), or the model's own class."""
    return next(c for c in type(model).__mro__ if c.__module__.startswith("transformers.models."))


__all__ = ["ExportSource", "base_class", "load_export", "local_path"]
