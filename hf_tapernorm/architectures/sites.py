"""The norm sites of one model instance: every norm with its full path, what it feeds, and what absorbs it.

The one place that turns an :class:`Architecture` (paths relative to a decoder layer) into the paths of
a concrete model; patching, folding, the recipe rules and the benchmark all enumerate norms through
:func:`norm_sites`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

from torch import nn

from ..errors import UnsupportedModelError
from ..utils import base_model_prefix
from .discovery import DiscoveryError, discover_architecture
from .stand_in import is_weightless, runnable_stand_in
from .table import ARCHITECTURES, Architecture, SiteKind, architecture_for, supported_model_types

logger = logging.getLogger(__name__)

# Discovery runs a probe forward; its result is kept on the model (same structure for copies and patches).
_CACHE_ATTRIBUTE = "_tapernorm_architecture"


@dataclass(frozen=True)
class Site:
    """One norm of a model: ``path`` and ``modules`` (its consumers, or the producer it folds into) are
    paths from the ``*ForCausalLM`` model; ``role`` is the table's role, or ``"final"`` for the final norm."""

    path: str
    kind: SiteKind
    role: str
    modules: tuple[str, ...]
    layer: Optional[int]  # None for the final norm
    sequence_dim: int = -2  # the input's sequence axis (NormSite.sequence_dim)

    @property
    def is_final(self) -> bool:
        return self.layer is None


def model_type_of(model: nn.Module) -> str:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type is None:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no config.model_type; hf_tapernorm expects a Hugging Face "
            "PreTrainedModel such as LlamaForCausalLM or GPT2LMHeadModel"
        )
    return model_type


def architecture_of(model: nn.Module) -> Architecture:
    """The table entry for the model's type, or, when there is none, the discovered description (logged once)."""
    config = model.config
    model_type = model_type_of(model)
    if model_type in ARCHITECTURES:
        return architecture_for(model_type, config)
    cached = model.__dict__.get(_CACHE_ATTRIBUTE)
    if cached is not None:
        return cached
    try:  # a model on the meta device cannot run the probe forward: a small copy with weights runs it
        arch = discover_architecture(runnable_stand_in(model) if is_weightless(model) else model)
    except DiscoveryError as error:
        raise DiscoveryError(
            f"model_type '{model_type}' is not supported by hf_tapernorm; supported model types: "
            f"{', '.join(supported_model_types())}; automatic discovery refused it too: {error}"
        ) from None
    logger.info(
        "model_type '%s' has no table entry; discovered its norms automatically: %s, final norm '%s'",
        model_type,
        ", ".join(f"{s.path} -> {'/'.join(s.consumers)} ({s.kind}, {s.role})" for s in arch.sites),
        arch.final_norm,
    )
    model.__dict__[_CACHE_ATTRIBUTE] = arch
    return arch


def norm_sites(model: nn.Module, arch: Optional[Architecture] = None) -> list[Site]:
    """Every norm the architecture declares, layer by layer in forward order, then the final norm."""
    arch = arch if arch is not None else architecture_of(model)
    prefix = base_model_prefix(model)
    base = getattr(model, "base_model", model)
    try:
        count = len(base.get_submodule(arch.layers))
    except AttributeError:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no decoder-layer list at '{arch.layers}' as its architecture entry "
            f"({arch.model_type}) declares"
        ) from None
    sites = []
    for index in range(count):
        layer = f"{prefix}{arch.layers}.{index}."
        for site in arch.sites:
            consumers = tuple(layer + m for m in site.consumers)
            sites.append(Site(layer + site.path, site.kind, site.role, consumers, index, site.sequence_dim))
    sites.append(Site(prefix + arch.final_norm, "input", "final", (arch.lm_head,), None))
    return sites


__all__ = ["Site", "architecture_of", "model_type_of", "norm_sites"]
