"""Tapered checkpoints: a patched model saved mid-recipe or at g = 0, and rebuilt exactly.

A tapered checkpoint is the base model's ``save_pretrained`` folder (the usual weight names plus each
TaperNorm's ``taper_weight`` and buffers) with the run's ``tapernorm_config.json`` beside it, as PEFT
keeps ``adapter_config.json`` beside adapter weights. Trainer checkpoints of a ``TaperCallback`` run
are tapered checkpoints too (the callback writes the config into each). Loading rebuilds the base
model from its config, patches it with the saved TaperNormConfig and loads every tensor strictly, so
no TaperNorm state is silently dropped.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Optional, Union

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from torch import nn
from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedConfig

from ..config import (
    CONFIG_NAME,
    LEGACY_CONFIG_NAME,
    TAPERED_TYPE_PREFIX,
    TaperNormConfig,
    check_save_destination,
    config_of,
    recorded_config_file,
)
from ..config_fields import check_tokenizer_to_save
from ..errors import ConfigurationError, TaperStateError, UnsupportedModelError, first_line
from ..layers.load_watch import load_watch_of
from ..layers.patching import is_headless, patch_model, patch_weightless, wraps_peft_adapters
from ..layers.saving import TAPERED_NOTE_KEY, mark_config_as_tapered
from ..layers.taper_norm import tapered_norms
from ..utils import expand_user, load_dtype, refuse_weights_of_another_format
from .sharded import is_sharded_checkpoint, read_sharded_model_state

logger = logging.getLogger(__name__)


def save_tapered(model: nn.Module, folder: Union[str, os.PathLike], tokenizer: Any = None) -> Path:
    """Save a patched model (weights, taper state, base config) and its TaperNormConfig; returns the folder.

    Its config.json names the model type ``hf_tapernorm_tapered_<type>``, so the folder cannot be mistaken for a
    plain checkpoint of the base model: read it with ``load_tapered``. (A patched model's own ``save_pretrained``
    writes the same folder without the tokenizer: layers/saving.py.)
    """
    if str(folder) == "":  # Path("") is the working folder: the checkpoint would land among whatever it holds
        raise ConfigurationError(
            "save_tapered: an empty path names no folder (it would be the working folder); name one"
        )
    folder = expand_user(folder, f"save_tapered: folder '{folder}'")
    config = config_of(model)
    if is_headless(model):  # its weights would be written under names no causal LM of its type loads
        raise UnsupportedModelError(
            f"save_tapered: {type(model).__name__} has no LM head, and a tapered checkpoint is of a causal LM (what "
            "load_tapered, fold and eval read); patch the model AutoModelForCausalLM loads"
        )
    if wraps_peft_adapters(model):  # PEFT's save would write its adapters, then config.json would be missing
        raise UnsupportedModelError(
            f"save_tapered: {type(model).__name__} wraps the model in PEFT adapters, and a tapered checkpoint holds "
            "the whole model: merge them first, save_tapered(model.merge_and_unload(), ...), or save the adapters "
            "alone with model.save_pretrained(...)"
        )
    check_tokenizer_to_save(tokenizer, "save_tapered")  # before the model's files, which it would leave alone
    what = "save_tapered: cannot save a tapered checkpoint"
    refuse_weights_of_another_format(folder, False, what)  # first: a sharded one's config.json reads as "another model"
    check_save_destination(folder, what, writes_model=True)
    model.save_pretrained(folder)
    mark_config_as_tapered(folder / "config.json")  # a model whose save_pretrained was replaced after patching
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    (folder / CONFIG_NAME).write_text(config.to_json_string())  # with its weights: no other recipe's file to keep
    return folder


def tapered_model_config(folder: Union[str, os.PathLike]) -> PreTrainedConfig:
    """The base model's config of a tapered checkpoint: config.json with its base ``model_type`` restored.

    A Trainer checkpoint of a taper run (or one saved by an older version) has the base type already.
    """
    folder = Path(folder)
    try:
        values = json.loads((folder / "config.json").read_text())
        model_type = str(values.get("model_type", ""))
        if not model_type.startswith(TAPERED_TYPE_PREFIX):
            return AutoConfig.from_pretrained(folder)
        base = model_type[len(TAPERED_TYPE_PREFIX) :]
        for key in ("model_type", TAPERED_NOTE_KEY):
            values.pop(key, None)
        config = CONFIG_MAPPING[base].from_dict(values)
    except Exception as error:  # noqa: BLE001 - JSON, a missing file, an unknown base type: all an unreadable config
        raise ConfigurationError(
            f"cannot read the config of tapered checkpoint '{folder}': {type(error).__name__}: {error}"
        ) from None
    config.name_or_path = str(folder)
    return config


def is_tapered_checkpoint(folder: Union[str, os.PathLike]) -> bool:
    return recorded_config_file(Path(folder)) is not None


def tapered_config_of(folder: Union[str, os.PathLike]) -> TaperNormConfig:
    """The TaperNormConfig a tapered checkpoint was saved with."""
    folder = Path(folder)
    if not folder.is_dir():
        what = "it is a file, not a folder" if folder.exists() else "no such folder"
        raise ConfigurationError(f"tapered checkpoint '{folder}' not found: {what}")
    path = recorded_config_file(folder)
    if path is None:
        raise ConfigurationError(f"'{folder}' is not a tapered checkpoint: no {CONFIG_NAME} in it")
    try:
        values = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigurationError(f"cannot read {path}: {error}") from None
    if not isinstance(values, dict):
        raise ConfigurationError(f"{path} holds a JSON {type(values).__name__}, not a TaperNormConfig; re-save it")
    return TaperNormConfig.from_dict(values)


def weightless_tapered(folder: Union[str, os.PathLike], dtype: Optional[torch.dtype] = None) -> nn.Module:
    """The tapered checkpoint ``folder`` as a patched model on the meta device: its config and its recipe, no
    weights. For what the structure alone tells before the weights load (the export's size, which norms fold)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tapered_model_config(folder), dtype=dtype)
    return patch_weightless(model, tapered_config_of(folder))


def load_tapered(
    folder: Union[str, os.PathLike],
    *,
    dtype: Union[torch.dtype, str, None] = None,
    trust_sharded_checkpoint: bool = False,
) -> nn.Module:
    """Rebuild a patched model from a tapered checkpoint (or a Trainer checkpoint of a taper run, or a sharded
    checkpoint of ``save_sharded_checkpoint``, read whole in this process).

    ``dtype`` (a torch dtype, its name as text, or ``"auto"``, as ``load_export`` takes it): the model loads in
    it; None or ``"auto"``: in the dtype its weights are stored in (the most common one of its matrices).

    Every tensor of the checkpoint must land in the patched model and every TaperNorm tensor must
    be present; anything else is an error naming the file or the tensors, because a partly loaded
    TaperNorm computes a different function than the one that was trained. A sharded checkpoint is read
    only with ``trust_sharded_checkpoint=True`` (its index is a pickle; training/sharded.py); everything
    else is safetensors and JSON.
    """
    folder = expand_user(folder, f"load_tapered: folder '{folder}'")  # "~/tap": the home folder's, as save_tapered's
    dtype = load_dtype(dtype, "a tapered checkpoint")  # before anything is read
    taper_config = tapered_config_of(folder)
    if is_sharded_checkpoint(folder):
        state = read_sharded_model_state(folder, trust_sharded_checkpoint=trust_sharded_checkpoint)
    else:
        state = _read_safetensors(folder)
    config = tapered_model_config(folder)
    config.use_cache = type(config)().use_cache  # a Trainer's use_cache=False (gradient checkpointing): not the model's
    weights = [t.dtype for t in state.values() if t.is_floating_point() and t.dim() >= 2]
    torch_dtype = dtype if dtype not in (None, "auto") else max(set(weights), key=weights.count)
    model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    _read_generation_config(model, folder)
    patch_model(model, taper_config)
    expected = model.state_dict()
    mismatched = [
        f"{k} {tuple(v.shape)} (model {tuple(expected[k].shape)})"
        for k, v in state.items()
        if k in expected and tuple(v.shape) != tuple(expected[k].shape)
    ]
    if mismatched:
        raise TaperStateError(
            f"tapered checkpoint '{folder}' holds tensors whose shapes do not fit its own config: {mismatched[:3]}"
            f"{' ...' if len(mismatched) > 3 else ''}; it was modified or written for another model"
        )
    with load_watch_of(model).paused():  # _check_loaded_state names what does not fit, and this folder
        result = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    missing = [k for k in result.missing_keys if k not in tied]
    if missing or result.unexpected_keys:
        raise TaperStateError(
            f"tapered checkpoint '{folder}' does not match a {type(model).__name__} patched with its "
            f"{CONFIG_NAME}: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, unexpected "
            f"{result.unexpected_keys[:5]}"
        )
    _check_loaded_state(model, folder, state)
    model.tie_weights()
    return model.eval()


def _read_generation_config(model: nn.Module, folder: Path) -> None:
    """The checkpoint's own generation_config.json, as ``from_pretrained`` reads a model's: ``from_config`` derives
    one from config.json, whose ``use_cache`` a Trainer sets to false, and every export folded from the checkpoint
    then generated without a KV cache, recomputing the whole sequence at each token. Unreadable, it is derived, as
    ``from_pretrained`` does, with a WARNING."""
    if not (folder / "generation_config.json").is_file():
        return
    try:
        model.generation_config = GenerationConfig.from_pretrained(folder)
    except OSError as error:  # transformers' own reading error of a broken file
        logger.warning(
            "%s is unreadable (%s): generating with settings from config.json",
            folder / "generation_config.json",
            first_line(error),
        )


def _check_loaded_state(model: nn.Module, folder: Path, state: dict[str, torch.Tensor]) -> None:
    """Refuse weights that are not finite, and a tapernorm_config.json that no longer describes the weights.

    A kept norm's gate never leaves 1 and every tapered norm shares the one global gate: a kept norm saved at
    another gate, or tapered norms at different gates, mean the config's ``keep_norms``/``scope`` were edited
    after training, and the model would compute another function than the one trained (evaluated, folded and
    checked consistently wrong).
    """
    bad = next(
        (name for name, tensor in state.items() if tensor.is_floating_point() and not tensor.isfinite().all()), None
    )
    if bad is not None:
        raise TaperStateError(
            f"tapered checkpoint '{folder}' holds non-finite values (NaN or inf) in {bad}; it is damaged or its run "
            "diverged: use an earlier checkpoint"
        )
    layers = list(tapered_norms(model, include_kept=True))
    moved = [(name, float(layer.gate)) for name, layer in layers if not layer.tapered and float(layer.gate) != 1.0]
    gates = sorted({float(layer.gate) for _, layer in layers if layer.tapered})
    if moved or len(gates) > 1:
        what = (
            f"{moved[0][0]} is kept as a norm by its {CONFIG_NAME} but was saved at gate {moved[0][1]:.4g}"
            if moved
            else f"its tapered norms were saved at different gates ({', '.join(f'{g:.4g}' for g in gates[:4])})"
        )
        raise TaperStateError(
            f"tapered checkpoint '{folder}': {what}; {CONFIG_NAME} (keep_norms, scope) no longer matches the weights "
            "it was saved with: restore the file the run wrote"
        )


def saved_gate(folder: Union[str, os.PathLike]) -> Optional[float]:
    """The gate a tapered checkpoint was saved at, read from its ``*.gate`` tensors alone (``safe_open`` reads one
    scalar without the weights), so that a command refuses a checkpoint it cannot use before loading it: the
    lowest one (every tapered norm holds the global gate, a kept norm 1). None where none can be read so (a sharded
    checkpoint, an unreadable file): the load reads the gate, and names any problem."""
    gates = []
    for shard in _weight_files(Path(folder)):
        try:
            with safe_open(str(shard), framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 - no __iter__
                    if key.endswith(".gate") and handle.get_slice(key).get_shape() == []:  # a TaperNorm's buffer
                        gates.append(float(handle.get_tensor(key)))
        except (SafetensorError, OSError):
            return None
    return min(gates) if gates else None


def holds_tapered_weights(folder: Union[str, os.PathLike]) -> bool:
    """Whether a tapered checkpoint's folder holds the weights ``load_tapered`` reads (its safetensors files, or a
    sharded checkpoint's index), told from the file names alone so that a command refuses a checkpoint without
    them before it reads anything else."""
    folder = Path(folder)
    return is_sharded_checkpoint(folder) or bool(_weight_files(folder))


def _weight_files(folder: Path) -> list[Path]:
    """The model's safetensors files of a tapered checkpoint (not the distillation teacher's snapshot)."""
    return [s for s in sorted(folder.glob("*.safetensors")) if not s.name.startswith("distillation_")]


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    shards = _weight_files(folder)
    if not shards:
        raise TaperStateError(f"tapered checkpoint '{folder}' has no .safetensors weights")
    state = {}
    for shard in shards:
        try:
            state.update(load_file(str(shard)))
        except (SafetensorError, OSError) as error:
            raise TaperStateError(
                f"cannot read {shard} (truncated or not a safetensors file?): {error}; re-save the checkpoint"
            ) from None
    return state


__all__ = [
    "LEGACY_CONFIG_NAME",
    "TAPERED_TYPE_PREFIX",
    "holds_tapered_weights",
    "is_tapered_checkpoint",
    "load_tapered",
    "save_tapered",
    "saved_gate",
    "tapered_config_of",
    "weightless_tapered",
    "tapered_model_config",
]
