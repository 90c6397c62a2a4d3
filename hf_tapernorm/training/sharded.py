"""Sharded checkpoints of a taper run (torch.distributed.checkpoint, DCP): the FSDP2 counterpart of
``save_tapered`` and of a Trainer checkpoint, for custom loops.

A sharded checkpoint is a DCP folder (``.metadata`` plus one ``__<rank>_0.distcp`` file per rank that
held data) with everything a resumed run needs: the model's state (weights and every TaperNorm/anchor
buffer: gate, c, EMAs, scale target), the optimizer's state, the optimizer step and the divergence
watch's history; beside it the run's ``tapernorm_config.json``, the base model's ``config.json`` (and a
tokenizer when given), so the folder describes itself; and, when distilling, the teacher snapshot
(``distillation_teacher/``, a DCP folder sharded like the teacher, or a safetensors file without FSDP2).

Each rank writes and reads only its own shards, so neither saving nor resuming ever holds a whole
model on one rank. DCP reshards on load: a checkpoint written by N ranks resumes on M ranks, or in one
process, which is how ``load_tapered`` (and so ``hf-tapernorm fold``/``eval``) read it
(:func:`read_sharded_model_state`).

DCP stores a checkpoint's index (``.metadata``) as a pickle, and unpickling runs whatever code the file
names. So nothing here reads a sharded checkpoint unless the caller says it trusts it
(``trust_sharded_checkpoint=True``; ``--trust_sharded_checkpoint`` on the CLI): a downloaded folder is
refused before a byte of it is unpickled, as transformers refuses pickled weights by default.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from ..config import CONFIG_NAME, TaperNormConfig, check_save_destination, config_of
from ..config_fields import check_tokenizer_to_save
from ..errors import TaperStateError
from ..utils import expand_user, refuse_weights_of_another_format
from .controller import TaperController
from .distributed import METADATA_NAME, dcp_load, dcp_save, is_main_process, refuse_untrusted_sharded_checkpoint
from .recipe_check import recipe_differences

_MODEL = "model"


def is_sharded_checkpoint(folder: Union[str, os.PathLike]) -> bool:
    return (Path(folder) / METADATA_NAME).is_file()


def _watch_state(controller: TaperController) -> dict[str, Any]:
    watch = controller.watch
    return {
        name: {"values": list(detector.values), "consecutive": detector.consecutive}
        for name, detector in (("loss", watch.loss), ("grad_norm", watch.grad_norm))
    }


def save_sharded_checkpoint(
    folder: Union[str, os.PathLike],
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    step: int = 0,
    controller: Optional[TaperController] = None,
    *,
    tokenizer: Any = None,
) -> Path:
    """Write a sharded checkpoint of a patched model after ``step`` optimizer steps; every rank calls it.

    ``model``: FSDP2-sharded, DDP-replicated (pass the module inside DDP) or whole in one process.
    ``controller``: adds the divergence watch's history and the distillation teacher (otherwise a resumed
    run would start a fresh watch and, past the gate start, distil from the resumed model). Returns the folder.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    folder = expand_user(folder)
    config = config_of(model)
    # on every rank; no recipe guard: the save writes the folder's weights and their recipe together
    what = "save_sharded_checkpoint: cannot save a sharded checkpoint"
    check_tokenizer_to_save(tokenizer, "save_sharded_checkpoint")  # a model's save_pretrained would add its weights
    check_save_destination(folder, what)
    refuse_weights_of_another_format(folder, True, what)
    if is_main_process():  # before the collective save, which orders every rank's return after these files
        folder.mkdir(parents=True, exist_ok=True)
        (folder / CONFIG_NAME).write_text(config.to_json_string())
        base_config = getattr(model, "config", None)
        if hasattr(base_config, "save_pretrained"):
            base_config.save_pretrained(folder)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
    state: dict[str, Any] = {_MODEL: get_model_state_dict(model), "step": int(step)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    if controller is not None:
        state["divergence_watch"] = _watch_state(controller)
    dcp_save(state, folder)
    if controller is not None:
        controller._save_state(folder, writes_weights=True)
    return folder


def load_sharded_checkpoint(
    folder: Union[str, os.PathLike],
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    controller: Optional[TaperController] = None,
    *,
    trust_sharded_checkpoint: bool = False,
) -> int:
    """Restore :func:`save_sharded_checkpoint`'s folder into a model patched with the same TaperNormConfig
    (sharded or not, on any number of ranks); returns the step to resume at. Every rank calls it.

    With ``controller`` it also restores the watch and the teacher and checks the TaperNorm state against
    the schedule (``check_resume``). A config that differs from the checkpoint's is refused: the saved c,
    gate and statistics belong to that recipe. ``trust_sharded_checkpoint=True`` is required: DCP unpickles
    the folder's ``.metadata`` (module docstring).
    """
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    folder = expand_user(folder)
    if not is_sharded_checkpoint(folder):
        raise TaperStateError(
            f"'{folder}' is not a sharded checkpoint: no {METADATA_NAME} (written by save_sharded_checkpoint)"
        )
    refuse_untrusted_sharded_checkpoint(folder, trust_sharded_checkpoint)
    differences = recipe_differences(folder, config_of(model))  # the comparison every resume makes
    if differences is None:  # no recipe saved: reading it says what is missing
        TaperNormConfig.from_pretrained(folder)
    if differences:
        raise TaperStateError(
            f"the sharded checkpoint {folder} was written with another TaperNormConfig ({differences}); "
            "patch the model with the checkpoint's config (TaperNormConfig.from_pretrained) to resume it"
        )
    saved_keys = {key.split(".", 1)[0] for key in _metadata(folder).state_dict_metadata}
    if optimizer is not None and "optimizer" not in saved_keys:
        raise TaperStateError(f"the sharded checkpoint {folder} holds no optimizer state (saved without an optimizer)")
    state: dict[str, Any] = {_MODEL: get_model_state_dict(model), "step": 0}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    restore_watch = controller is not None and "divergence_watch" in saved_keys
    if restore_watch:
        state["divergence_watch"] = _watch_state(controller)
    dcp_load(state, folder)
    set_model_state_dict(model, state[_MODEL])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
    step = int(state["step"])
    if restore_watch:
        for name, detector in (("loss", controller.watch.loss), ("grad_norm", controller.watch.grad_norm)):
            detector.values.clear()
            detector.values.extend(state["divergence_watch"][name]["values"])
            detector.consecutive = state["divergence_watch"][name]["consecutive"]
    if controller is not None:
        controller.load_state(folder, trust_sharded_checkpoint=trust_sharded_checkpoint)
        controller.check_resume(step)
    return step


def _metadata(folder: Path) -> Any:
    import torch.distributed.checkpoint as dcp

    return dcp.FileSystemReader(str(folder)).read_metadata()


def read_sharded_model_state(
    folder: Union[str, os.PathLike], *, trust_sharded_checkpoint: bool = False
) -> dict[str, torch.Tensor]:
    """The model's whole tensors from a sharded checkpoint, read in one process without a process group
    (every shard is stitched back; the optimizer state is not read). Needs ``trust_sharded_checkpoint=True``:
    DCP unpickles the folder's ``.metadata`` (module docstring)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    refuse_untrusted_sharded_checkpoint(folder, trust_sharded_checkpoint)
    prefix = _MODEL + "."
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in _metadata(Path(folder)).state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }
    if not state:
        raise TaperStateError(f"sharded checkpoint '{folder}' holds no model tensors")
    dcp_load(state, folder, collective=False)
    return {key[len(prefix) :]: value for key, value in state.items()}


__all__ = [
    "METADATA_NAME",
    "is_sharded_checkpoint",
    "load_sharded_checkpoint",
    "read_sharded_model_state",
    "refuse_untrusted_sharded_checkpoint",
    "save_sharded_checkpoint",
]
