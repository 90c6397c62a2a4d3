"""A small runnable copy of a model whose weights are not loaded, for discovery's probe forward.

``hf-tapernorm taper`` and ``fold`` plan their patch on the model's structure alone (built on the meta device from
its config: seconds, no weights), and the FSDP2 teacher is rebuilt the same way. Discovery cannot describe a meta
model: its probe forward computes, and transformers' mask code reads a value (``Tensor.item()``), which meta tensors
do not hold. So it probes a stand-in: the same class and config, with random weights, two decoder layers and a small
vocabulary. The description it yields is per decoder layer (paths relative to a layer), so it is the full model's.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from .discovery import is_norm_module

#: Decoder layers the stand-in keeps: one layer's norms describe them all, and two show that the layers agree.
STAND_IN_LAYERS = 2

#: The stand-in's vocabulary (more where a special token id needs it): the probe reads a few ids only.
STAND_IN_VOCABULARY = 512


def is_weightless(model: nn.Module) -> bool:
    """Whether the model's parameters are on the meta device (its structure alone, built from its config)."""
    return any(p.is_meta for p in model.parameters())


def runnable_stand_in(model: nn.Module) -> nn.Module:
    """A small copy of ``model`` (a transformers model built from ``model.config``) with random weights on the CPU,
    in float32. Its norm weights are drawn away from 1 and 0, so that the numeric check of each norm's formula
    (discovery.detect_style) cannot take one formula for another by the coincidence of an initial value."""
    config = copy.deepcopy(model.config)
    layers = getattr(config, "num_hidden_layers", None)
    if isinstance(layers, int) and layers > STAND_IN_LAYERS:
        for key, value in vars(config).items():  # per-layer settings (layer_types, ...) follow the layer count
            if isinstance(value, (list, tuple)) and len(value) == layers:
                setattr(config, key, type(value)(value[:STAND_IN_LAYERS]))
        config.num_hidden_layers = STAND_IN_LAYERS
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int) and vocab > STAND_IN_VOCABULARY:
        ids = [getattr(config, k, None) for k in ("pad_token_id", "bos_token_id", "eos_token_id")]
        config.vocab_size = max([STAND_IN_VOCABULARY, *(i + 1 for i in ids if isinstance(i, int))])
    with torch.device("cpu"):
        stand_in = type(model)(config).float()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in stand_in.modules():
            if is_norm_module(module):
                for parameter in module.parameters(recurse=False):
                    parameter.copy_(0.5 + torch.rand(parameter.shape, generator=generator))
    return stand_in


__all__ = ["STAND_IN_LAYERS", "is_weightless", "runnable_stand_in"]
