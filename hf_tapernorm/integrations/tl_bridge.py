"""A folded export in TransformerLens: its ``TransformerBridge`` (TransformerLens 4 has no ``HookedTransformer``).

The bridge wraps the export's own module, so its forward is the export's, hooks on every component
(``blocks.{i}.hook_resid_pre``, ``blocks.{i}.attn.hook_pattern``, ...). Two things make its logits the export's:

- a folded norm is an ``nn.Identity`` in the export, but the bridge's normalization component recomputes a
  norm from scratch by default; on those slots it is switched to the wrapped module's own forward, whose
  ``hook_scale`` then reads 1 and ``hook_normalized`` its input (kept norms stay real norms, hooks and all; a
  weightless one, whose weight went into the modules it feeds, runs its own forward too, with its real scale);
- the export holds its attention sink as a cache prefix, which its forward puts in front of the text; the
  bridge's attention components read the cache from ``past_key_values`` while transformers passes it as
  ``cache``, so each attention component is handed it under both names. Attention patterns then have one
  column per sink position before the text's.

The bridge runs eager attention (for its pattern hooks); an export compared with it should too.
TransformerLens's analysis tools (``direct_logit_attribution``, ``logit_lens``) ask for
``enable_compatibility_mode()``; its weight processing keeps the export's log-probabilities and sink
(tests/test_integrations.py), shifting each position's logits by one constant (the centred unembedding).
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
from torch import nn

from ..errors import ConfigurationError, first_line
from ..export.modeling_folded import FoldedChannelScale
from .exports import ExportSource, base_class, load_export
from .extras import require

FEATURE = "hf_tapernorm.integrations.tl_bridge (TransformerLens)"


def _cache_under_both_names(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    if kwargs.get("past_key_values") is None and kwargs.get("cache") is not None:
        kwargs["past_key_values"] = kwargs["cache"]
    return args, kwargs


def _saved_tokenizer(where: str) -> Any:
    """The tokenizer saved in the folder (or Hub repository) ``where``, or a TaperNormError asking for one."""
    if not where:
        raise ConfigurationError(
            "transformer_bridge: this folded model was not loaded from a folder or Hub id, so it names no tokenizer; "
            "pass tokenizer= (the tokenizer of the model it was folded from)"
        )
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(where)
    except (OSError, ValueError) as error:
        raise ConfigurationError(
            f"transformer_bridge: no tokenizer could be loaded from '{where}' ({first_line(error)}); pass tokenizer="
        ) from None


def transformer_bridge(
    source: ExportSource,
    *,
    tokenizer: Optional[Any] = None,
    device: Optional[str] = None,
    dtype: Union[torch.dtype, str, None] = None,
):
    """A ``TransformerBridge`` over the folded export ``source`` (a folder or a folded model) whose logits are
    the export's on the same text (the sink, when the export has one, stays in place).

    ``tokenizer``: the bridge's tokenizer (default: the one saved with the export: in its folder, or where the
    folded model was loaded from); a model built in memory (``fold_model`` of a model from a config) names none,
    so it needs ``tokenizer=``. ``dtype``: as for ``load_export`` (a folder's, float32 by default; a model keeps its
    own, and another dtype is refused).
    """
    model_bridge = require("transformer_lens.model_bridge", FEATURE)
    normalization = require("transformer_lens.model_bridge.generalized_components.normalization", FEATURE)
    attention = require("transformer_lens.model_bridge.generalized_components.attention", FEATURE)
    model = load_export(source, dtype=dtype)
    name = model.config.name_or_path  # a folder's, "~" expanded, or where a model was loaded from
    bridge = model_bridge.TransformerBridge.boot_transformers(
        name or base_class(model).__name__,
        hf_model=model,
        # The adapter is chosen by architecture: the folded class extends this one and keeps its module names.
        hf_config_overrides={"architectures": [base_class(model).__name__]},
        tokenizer=tokenizer if tokenizer is not None else _saved_tokenizer(name),
        device=device or str(next(model.parameters()).device),
        dtype=model.dtype,
    )
    for module in bridge.modules():
        component = getattr(module, "original_component", None)
        # An Identity, a channel scale or a weightless norm: the bridge's recomputed norm would apply a weight.
        own_forward = isinstance(component, FoldedChannelScale) or getattr(component, "weight", None) is None
        if isinstance(module, normalization.NormalizationBridge) and component is not None and own_forward:
            module.use_native_layernorm_autograd = True  # the wrapped module's forward, not a recomputed norm
        elif isinstance(module, attention.AttentionBridge):
            module.register_forward_pre_hook(_cache_under_both_names, with_kwargs=True)
    return bridge


__all__ = ["transformer_bridge"]
