"""A small runnable copy of a model whose weights are not loaded, for discovery's probe forward.

``hf-tapernorm taper`` and ``fold`` plan their patch on the model's structure alone (built on the meta device from
its config: seconds, no weights), and the FSDP2 teacher is rebuilt the same way. Discovery cannot describe a meta
model: its probe forward computes, and transformers' mask code reads a value (``Tensor.item()``), which meta tensors
do not hold. So it probes a stand-in: the same class and config, with random weights, a small vocabulary and the
first decoder layers, as many as it takes to hold one layer of every kind the model has (at least two). A layer's
kind is its module tree (names and classes), read from the meta model itself: a mixture-of-experts model whose
first layers are dense (``decoder_sparse_step``, ``mlp_only_layers``, ``first_k_dense_replace``, ...) was probed
on dense layers alone, accepted, and refused only after its weights had loaded. The description discovery yields
is per decoder layer (paths relative to a layer), and it checks that every layer it sees agrees, so with every kind
in the stand-in it is the full model's.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch import nn

from .discovery import is_norm_module

logger = logging.getLogger(__name__)

#: The fewest decoder layers the stand-in keeps: one layer's norms describe a layer, and two show that layers agree.
STAND_IN_LAYERS = 2

#: The stand-in's vocabulary (more where a special token id needs it): the probe reads a few ids only.
STAND_IN_VOCABULARY = 512

#: A decoder layer's kind: ``(path relative to the layer, class name)`` of the layer and each of its submodules.
LayerSignature = tuple[tuple[str, str], ...]


def is_weightless(model: nn.Module) -> bool:
    """Whether the model's parameters are on the meta device (its structure alone, built from its config)."""
    return any(p.is_meta for p in model.parameters())


def layer_signature(layer: nn.Module) -> LayerSignature:
    """The kind of a decoder layer: its module tree, names and classes (no weights needed, so meta layers too)."""
    return tuple((name, type(module).__name__) for name, module in layer.named_modules())


def decoder_layers(model: nn.Module, count: int) -> Optional[nn.ModuleList]:
    """The model's decoder layers: the first list of ``count`` modules that hold norms, or None where none does."""
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == count > 0 and all(map(_holds_a_norm, module)):
            return module
    return None


def _holds_a_norm(layer: nn.Module) -> bool:
    return any(is_norm_module(module) for module in layer.modules())


def layers_to_keep(signatures: Sequence[LayerSignature]) -> int:
    """How many first layers hold one layer of every kind in ``signatures`` (at least ``STAND_IN_LAYERS``)."""
    first: dict[LayerSignature, int] = {}
    for index, signature in enumerate(signatures):
        first.setdefault(signature, index)
    return max(STAND_IN_LAYERS, 1 + max(first.values(), default=0))


def _stand_in_config(config: Any, layers: int) -> Any:
    """A copy of ``config`` with at most ``layers`` decoder layers (per-layer lists cut to match) and a small
    vocabulary."""
    config = copy.deepcopy(config)
    count = getattr(config, "num_hidden_layers", None)
    if isinstance(count, int) and count > layers:
        for key, value in vars(config).items():  # per-layer settings (layer_types, ...) follow the layer count
            if isinstance(value, (list, tuple)) and len(value) == count:
                setattr(config, key, type(value)(value[:layers]))
        config.num_hidden_layers = layers
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int) and vocab > STAND_IN_VOCABULARY:
        ids = [getattr(config, k, None) for k in ("pad_token_id", "bos_token_id", "eos_token_id")]
        config.vocab_size = max([STAND_IN_VOCABULARY, *(i + 1 for i in ids if isinstance(i, int))])
    return config


def _built(model: nn.Module, config: Any) -> nn.Module:
    """``type(model)(config)`` on the CPU in float32, its norm weights drawn away from 1 and 0, so that the numeric
    check of each norm's formula (discovery.detect_style) cannot take one formula for another by the coincidence
    of an initial value."""
    with torch.device("cpu"):
        stand_in = type(model)(config).float()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in stand_in.modules():
            if is_norm_module(module):
                for parameter in module.parameters(recurse=False):
                    parameter.copy_(0.5 + torch.rand(parameter.shape, generator=generator))
    return stand_in


def runnable_stand_in(model: nn.Module) -> nn.Module:
    """A small copy of ``model`` (a transformers model built from ``model.config``) with random weights on the CPU,
    in float32, that holds one decoder layer of every kind ``model`` has.

    It keeps the first layers up to the first layer of the last kind to appear, and checks that the shorter config
    builds those layers as the model has them; where it does not (a layer kind that a shorter config cannot build),
    it keeps every layer, so that no kind goes unprobed."""
    count = getattr(model.config, "num_hidden_layers", None)
    layers = decoder_layers(model, count) if isinstance(count, int) else None
    if layers is None:  # no list of decoder layers to read kinds from: the first layers, as discovery sees them
        return _built(model, _stand_in_config(model.config, STAND_IN_LAYERS))
    signatures = [layer_signature(layer) for layer in layers]
    keep = layers_to_keep(signatures)
    if keep < count:
        stand_in = _built(model, _stand_in_config(model.config, keep))
        kept = decoder_layers(stand_in, keep)
        if kept is not None and [layer_signature(layer) for layer in kept] == signatures[:keep]:
            return stand_in
        logger.info(
            "%s: a config of %d decoder layers builds other layers than the model's first %d; discovery probes a "
            "stand-in with all %d layers",
            type(model).__name__,
            keep,
            keep,
            count,
        )
    return _built(model, _stand_in_config(model.config, count))


__all__ = [
    "STAND_IN_LAYERS",
    "decoder_layers",
    "is_weightless",
    "layer_signature",
    "layers_to_keep",
    "runnable_stand_in",
]
