"""Open a folded export (or, where an integration takes any causal LM, a plain one) for the integrations: the
loaded model, and the transformers class it is built on."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Union

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from ..config import TaperNormConfig
from ..errors import ConfigurationError
from ..export.folded_sink import PREFIX as FOLDED_TYPE_PREFIX
from ..export.folded_sink import plain_load_of_export
from ..export.modeling_folded import FoldedModelMixin
from ..layers.saving import TAPERED_TYPE_PREFIX
from ..training.checkpoints import is_tapered_checkpoint
from ..utils import expand_user, load_dtype, saved_model_type

ExportSource = Union[str, os.PathLike, PreTrainedModel]


def local_path(path: Union[str, os.PathLike]) -> Path:
    """``path`` with ``~`` expanded: every folder the integrations take or write, as the CLI and ``export_folded``
    read it ("~/exp" is the home folder's, not a folder named "~")."""
    return expand_user(path)


def _refuse_tapered(source: Union[Path, PreTrainedModel]) -> None:
    """Refuse a tapered checkpoint (a run's ``tapered/`` or ``checkpoint-N``, ``save_tapered``'s folder) or a
    patched model where an export is expected, saying what it is and how to get an export.

    The one check of every integration (each opens its source through ``load_export``): transformers' own answer
    to a tapered checkpoint's config.json is "does not recognize this architecture ... pip install --upgrade
    transformers", advice that cannot work, and a checkpoint of an older version (its base ``model_type``) would
    load as the plain model with its norms back.
    """
    if isinstance(source, PreTrainedModel):
        if isinstance(getattr(source, "tapernorm_config", None), TaperNormConfig):
            raise ConfigurationError(
                f"{type(source).__name__} is a tapered model (patch_model), not an export: fold it first "
                "(hf_tapernorm.fold_model, then export_folded to save it)"
            )
        return
    model_type = saved_model_type(source / "config.json")  # "" when unreadable: from_pretrained says why
    if model_type.startswith(FOLDED_TYPE_PREFIX):
        return
    if model_type.startswith(TAPERED_TYPE_PREFIX) or is_tapered_checkpoint(source):
        raise ConfigurationError(
            f"'{source}' is a tapered checkpoint (its norms are TaperNorm layers), not an export: fold it first "
            f"(hf-tapernorm fold --checkpoint {source} --output_dir FOLDER, or hf_tapernorm.fold_model / "
            "export_folded) and pass the folded folder, or load it with hf_tapernorm.load_tapered"
        )


def load_export(
    source: ExportSource, *, dtype: Union[torch.dtype, str, None] = None, folded_only: bool = True
) -> PreTrainedModel:
    """The folded model of ``source`` (a folder ``export_folded`` wrote, or a folded model), in eval mode.

    ``dtype`` (a torch dtype, its name as text: ``"bfloat16"`` or ``"bf16"``, or ``"auto"``): a folder loads in it
    (default float32; ``"auto"``: the dtype its config.json records, as ``from_pretrained`` reads it); a model stays
    in its own (``"auto"``: whatever that is), and a ``dtype`` other than its own is refused rather than converted:
    converting in place would change the caller's model, and a copy would double its memory without a word.
    Refuses a folder without a config, a tapered checkpoint or patched model (fold it first), and
    (``folded_only``) a model that is not folded: the integrations that need the export's structure (folded norms
    as identities, the stored sink) set it. Refuses an export loaded as its plain base class (its config.json's
    ``model_type`` edited): its sink and folded norms would be lost.
    """
    dtype = load_dtype(dtype, "an export")
    if isinstance(source, PreTrainedModel):
        _refuse_tapered(source)
        model = source
        if dtype not in (None, "auto") and dtype != model.dtype:
            raise ConfigurationError(
                f"dtype={dtype} applies to an export folder; the {type(model).__name__} given is {model.dtype}: "
                f"convert it first (model.to({dtype})) and pass it without dtype="
            )
    else:
        folder = local_path(source)
        if not (folder / "config.json").is_file():
            raise ConfigurationError(f"'{folder}' holds no config.json: name the folder export_folded wrote")
        _refuse_tapered(folder)
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
