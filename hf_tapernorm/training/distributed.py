"""Which parameter-sharding engines a taper supports, and the checks that refuse the others.

Calibration copies each norm's gain into ``taper_weight`` in place, and folding reads whole weights,
both outside forward. DDP and ZeRO 1/2 keep full parameters on every rank. FSDP2 (``fully_shard``)
keeps DTensor shards, which in-place elementwise copies handle shard by shard (docs/distributed.md).
DeepSpeed ZeRO-3 and FSDP v1 hold empty or flattened shards outside forward, where the copy would
silently do nothing or mix shards: they are refused with a pointer to FSDP2.
"""

from __future__ import annotations

from torch import nn

from ..errors import ConfigurationError


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


def refuse_unsupported_sharding(model: nn.Module) -> None:
    engine = sharding_engine(model)
    if engine not in ("deepspeed-zero3", "fsdp1"):
        return
    name = {"deepspeed-zero3": "DeepSpeed ZeRO-3", "fsdp1": "FSDP (v1)"}[engine]
    raise ConfigurationError(
        f"hf_tapernorm does not support {name} parameter sharding: calibration copies each norm's gain into "
        "taper_weight outside forward, where this engine holds no whole parameters. Shard with FSDP2 instead "
        "(torch.distributed.fsdp.fully_shard, or accelerate/Trainer with fsdp_version: 2; see "
        "docs/distributed.md), or use DDP / ZeRO stage 1-2"
    )


__all__ = ["refuse_unsupported_sharding", "sharding_engine"]
