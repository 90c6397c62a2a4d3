"""Which parameter-sharding engines a taper supports, the checks that refuse the others, and FSDP2's mechanics.

Calibration copies each norm's gain into ``taper_weight`` in place, and folding reads whole weights,
both outside forward. DDP and ZeRO 1/2 keep full parameters on every rank. FSDP2 (``fully_shard``)
keeps DTensor shards, which in-place elementwise copies handle shard by shard (docs/distributed.md).
DeepSpeed ZeRO-3 and FSDP v1 hold empty or flattened shards outside forward, where the copy would
silently do nothing or mix shards: they are refused with a pointer to FSDP2, from the model (the
``TaperController``, which ``TaperCallback`` builds) and, earlier, from the Trainer's arguments.

FSDP2 refuses ``copy.deepcopy`` ("FSDP does not support deepcopy"), so the distillation teacher of a
sharded model is built here (:func:`sharded_copy`), sharded like the student; it is saved and restored
with torch.distributed.checkpoint (:func:`save_sharded_module`), every rank writing its own shards.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from ..config import config_of
from ..errors import ConfigurationError, TaperStateError
from ..layers.patching import patch_weightless
from ..layers.taper_norm import tapered_norms

METADATA_NAME = ".metadata"  # written by DCP; marks a sharded checkpoint
_NAMES = {"deepspeed-zero3": "DeepSpeed ZeRO-3", "fsdp1": "FSDP (v1)"}


def sharding_engine(model: nn.Module) -> str | None:
    """``"deepspeed-zero3"``, ``"fsdp1"``, ``"fsdp2"`` or None (full parameters on every rank)."""
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        return "deepspeed-zero3"
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        return "fsdp1"
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch < 2.6
        return None
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        return "fsdp2"
    return None


def _refusal(engine: str) -> ConfigurationError:
    return ConfigurationError(
        f"hf_tapernorm does not support {_NAMES[engine]} parameter sharding: calibration copies each norm's gain into "
        "taper_weight outside forward, where this engine holds no whole parameters. Shard with FSDP2 instead "
        "(torch.distributed.fsdp.fully_shard, or accelerate/Trainer with fsdp_version: 2; see "
        "docs/distributed.md), or use DDP / ZeRO stage 1-2"
    )


def refuse_unsupported_sharding(model: nn.Module) -> None:
    """Refuse a model sharded by DeepSpeed ZeRO-3 or FSDP v1, and a per-channel fit under FSDP2."""
    engine = sharding_engine(model)
    if engine in _NAMES:
        raise _refusal(engine)
    if engine == "fsdp2":
        _refuse_patching_after_sharding(model)
        per_channel = [
            layer.site_name for _, layer in tapered_norms(model) if layer.per_channel and not layer.is_calibrated
        ]
        if per_channel:
            # TaperNorm.mark_calibrated multiplies the sharded gain by a whole per-channel vector, which
            # DTensor refuses ("aten.mul.Tensor got mixed torch.Tensor and DTensor") at k_start.
            raise ConfigurationError(
                f"linear_fit='per_channel' is not supported under FSDP2 ({per_channel[0]} and {len(per_channel) - 1} "
                "more would fit per-channel gains into sharded parameters at k_start); use linear_fit='paper', "
                "or DDP"
            )


def _refuse_patching_after_sharding(model: nn.Module) -> None:
    """A TaperNorm built from an already sharded norm holds DTensor parameters that no FSDP2 group manages:
    forward would mix them with gathered tensors ("got mixed torch.Tensor and DTensor")."""
    from torch.distributed.tensor import DTensor

    for name, layer in tapered_norms(model, include_kept=True):
        managed = getattr(layer, "_is_fsdp_managed_module", False)  # set by fully_shard on every module it manages
        if not managed and any(isinstance(p, DTensor) for p in layer.parameters(recurse=False)):
            raise ConfigurationError(
                f"{name} was patched after fully_shard: FSDP2 does not manage its parameters. Call "
                "patch_model(model) on the unsharded model, then fully_shard (or let accelerate/Trainer shard it)"
            )


def refuse_unsupported_trainer_sharding(args: Any) -> None:
    """Refuse ``TrainingArguments`` that ask for DeepSpeed ZeRO-3 or FSDP v1, when the Trainer is built
    (before the engine has partitioned the model)."""
    deepspeed = getattr(args, "hf_deepspeed_config", None)
    if deepspeed is not None and deepspeed.is_zero3():
        raise _refusal("deepspeed-zero3")
    if getattr(args, "fsdp", None) and int((getattr(args, "fsdp_config", None) or {}).get("version", 2)) == 1:
        raise _refusal("fsdp1")


def has_process_group() -> bool:
    return dist.is_available() and dist.is_initialized()


def is_main_process() -> bool:
    """Rank 0 of the default process group, or a process without one."""
    return not has_process_group() or dist.get_rank() == 0


def local_parameter_bytes(model: nn.Module) -> int:
    """Bytes of parameter storage this rank holds: the local shards of DTensor (FSDP2) parameters, whole
    tensors otherwise (shared parameters counted once)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for param in model.parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        total += local.numel() * local.element_size()
    return total


# ---------------------------------------------------------------------------------------------- FSDP2
def _fsdp_modules(model: nn.Module) -> dict[str, nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return {name: m for name, m in model.named_modules() if isinstance(m, FSDPModule)}


def _shard_options(module: nn.Module, mesh: Any) -> dict[str, Any]:
    """The mesh, mixed-precision and offload policies ``fully_shard`` gave ``module`` (FSDP2's own records;
    the defaults where a torch version keeps them elsewhere)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None) or [getattr(state, "_fsdp_param_group", None)]
    group = groups[0] if groups and groups[0] is not None else None
    options: dict[str, Any] = {"mesh": group.mesh_info.mesh if group is not None else mesh}
    for name in ("mp_policy", "offload_policy"):
        if getattr(group, name, None) is not None:
            options[name] = getattr(group, name)
    return options


def sharded_copy(model: nn.Module) -> nn.Module:
    """A frozen copy of an FSDP2-sharded patched model, sharded like it: one more shard of the weights per rank.

    FSDP2 refuses ``copy.deepcopy``, and a whole copy on every rank would undo the sharding. So the copy is
    rebuilt from ``model.config`` on the meta device (no memory), patched with the model's TaperNormConfig
    (the same parameter names), given no training hooks, ``fully_shard``-ed on the same modules with the
    same mesh and policies (resharding after every forward: it never runs backward), materialized, and
    filled with this rank's shards and buffers of ``model`` (a local copy, no communication). The caller
    holds its gates at 1 (``distillation.frozen_copy``).
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor import DTensor

    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    unsharded = [name for name, p in params.items() if not isinstance(p, DTensor)]
    if unsharded:
        raise TaperStateError(
            f"cannot copy {type(model).__name__} while FSDP2 holds its parameters unsharded ({unsharded[0]}); "
            "make the copy between optimizer steps (TaperController.step_begin does)"
        )
    base = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))  # the class before fully_shard
    config = getattr(model, "config", None)
    if config is None or not hasattr(base, "_from_config"):
        raise ConfigurationError(
            f"the distillation teacher of an FSDP2-sharded {type(model).__name__} is rebuilt from its Hugging Face "
            "config (FSDP2 modules cannot be deep-copied), and this model has none"
        )
    first = next(iter(params.values()))
    with torch.device("meta"):
        copy = base._from_config(config, dtype=first.dtype)
    patch_weightless(copy, config_of(model))
    copy.__dict__.pop("_tapernorm_loss_terms", None)  # the training hooks patch_model added (loss terms, sink)
    copy._forward_pre_hooks.clear()
    copy._forward_hooks.clear()
    copy.requires_grad_(False)
    shapes = {name: tuple(p.shape) for name, p in copy.named_parameters()}
    expected = {name: tuple(p.shape) for name, p in params.items()}
    if shapes != expected:
        different = sorted(set(shapes.items()) ^ set(expected.items()))
        raise ConfigurationError(
            f"{type(model).__name__} differs from a model built from its config ({different[:3]}): the teacher of an "
            "FSDP2 run is rebuilt from model.config, so the model must not be modified beyond its config"
        )
    modules = _fsdp_modules(model)
    for name in sorted(modules, key=lambda n: n.count(".") + bool(n), reverse=True):  # bottom-up, the root last
        fully_shard(
            copy.get_submodule(name), reshard_after_forward=True, **_shard_options(modules[name], first.device_mesh)
        )
    copy.to_empty(device=first.to_local().device)
    with torch.no_grad():
        for name, param in copy.named_parameters():
            param.copy_(params[name])
        for name, buffer in copy.named_buffers():  # non-persistent ones (rotary inv_freq) too
            buffer.copy_(buffers[name])
    return copy


# ---------------------------------------------------------------------------------------------- DCP
@contextlib.contextmanager
def _single_process_quietly() -> Iterator[None]:
    # DCP warns on every save/load without a process group, even when told so (no_dist=True).
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def dcp_save(state: dict[str, Any], folder: Union[str, os.PathLike]) -> None:
    """``torch.distributed.checkpoint.save`` of ``state`` into ``folder``: collective under a process group,
    a plain save in a process without one."""
    import torch.distributed.checkpoint as dcp

    with _single_process_quietly():
        dcp.save(state, checkpoint_id=Path(folder), no_dist=not has_process_group())


def dcp_load(state: dict[str, Any], folder: Union[str, os.PathLike], *, collective: Optional[bool] = None) -> None:
    """``torch.distributed.checkpoint.load`` into ``state`` (in place); ``collective=False`` reads in this process
    alone although a process group exists (default: collective when there is one)."""
    import torch.distributed.checkpoint as dcp

    collective = has_process_group() if collective is None else collective
    with _single_process_quietly():
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(folder)), no_dist=not collective)


def save_sharded_module(folder: Union[str, os.PathLike], module: nn.Module) -> None:
    """Write ``module``'s state as a torch.distributed.checkpoint folder; every rank calls it (collective)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    dcp_save({"model": get_model_state_dict(module)}, folder)


def refuse_untrusted_sharded_checkpoint(folder: Union[str, os.PathLike], trusted: bool) -> None:
    """Raise unless ``trusted``: reading a DCP folder unpickles its ``.metadata`` (see the module docstring)."""
    if not trusted:
        raise TaperStateError(
            f"'{folder}' is a sharded (torch.distributed.checkpoint) checkpoint, whose {METADATA_NAME} is a pickle "
            "that can run code when read; pass --trust_sharded_checkpoint (trust_sharded_checkpoint=True) only "
            "for a checkpoint you wrote or trust"
        )


def load_sharded_module(folder: Union[str, os.PathLike], module: nn.Module) -> None:
    """Read :func:`save_sharded_module`'s folder into ``module`` (sharded or not, any number of ranks)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    state = {"model": get_model_state_dict(module)}
    dcp_load(state, folder)
    set_model_state_dict(module, state["model"])


__all__ = [
    "METADATA_NAME",
    "dcp_load",
    "dcp_save",
    "has_process_group",
    "is_main_process",
    "load_sharded_module",
    "local_parameter_bytes",
    "refuse_unsupported_sharding",
    "refuse_untrusted_sharded_checkpoint",
    "refuse_unsupported_trainer_sharding",
    "save_sharded_module",
    "sharded_copy",
    "sharding_engine",
]
