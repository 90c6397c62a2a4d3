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

import copy
import json
import os
from collections.abc import Callable, Mapping
from typing import Any, Optional, Union

import torch
from torch import nn
from transformers import PreTrainedModel

from ..errors import ConfigurationError, first_line
from ..export.modeling_folded import PREFIX, FoldedChannelScale
from .exports import ExportSource, base_class, load_export, local_path
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


def _source_config(source: ExportSource) -> Mapping[str, Any]:
    """The config of ``source`` as a mapping, read before anything is loaded: a model's, or a folder's
    config.json as text ({} when there is none to read: ``load_export`` then says why)."""
    if isinstance(source, PreTrainedModel):
        return source.config.to_dict()
    if not isinstance(source, (str, os.PathLike)):
        return {}
    try:
        values = json.loads((local_path(source) / "config.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    return values if isinstance(values, dict) else {}


def _base_model_type(config: Mapping[str, Any]) -> str:
    """The family of an export's config (``base_model_type``; a folded ``model_type`` is ``tapernorm_<family>``)."""
    base = config.get("base_model_type")
    return base if isinstance(base, str) else str(config.get("model_type", "")).removeprefix(PREFIX)


def _grouped_falcon(config: Mapping[str, Any]) -> Optional[str]:
    """Falcon's new decoder layout with several key/value heads (Falcon-40B's): its fused ``query_key_value`` groups
    each key/value head with its queries; TransformerLens's Falcon adapter splits it as all queries, then all keys,
    then all values (and, under the default ``multi_query``, with one key/value head), so the bridge fails in a
    tensor split or gives other hooks and logits than the model's."""
    kv_heads = config.get("num_kv_heads")
    if config.get("new_decoder_architecture") is True and isinstance(kv_heads, int) and kv_heads > 1:
        return (
            f"TransformerLens cannot read Falcon's new_decoder_architecture with num_kv_heads={kv_heads} (its Falcon "
            "adapter splits query_key_value as if queries, keys and values were not grouped per key/value head)"
        )
    return None


def _alibi_falcon(config: Mapping[str, Any]) -> Optional[str]:
    """Falcon with ALiBi positions (Falcon-RW's layout): the bridge's ALiBi attention computes as transformers'
    eager Falcon attention does, and that adds the ALiBi bias twice (folded into the attention mask, and again
    to the scores), where the export's default attention (sdpa) adds it once: the bridge's logits, hooks and
    patterns are not the export's."""
    if config.get("alibi") is True:
        return (
            "TransformerLens cannot give Falcon with alibi=True the export's logits (its ALiBi attention computes as "
            "transformers' eager Falcon attention, which adds the ALiBi bias twice, in the mask and to the scores, "
            "where the export's sdpa attention adds it once)"
        )
    return None


def _codegen(config: Mapping[str, Any]) -> Optional[str]:
    """CodeGen: TransformerLens's CodeGen attention reads the rotary table as ``CodeGenAttention.embed_positions``,
    which transformers 5's CodeGen keeps in the model's ``CodeGenRotaryEmbedding`` instead, so the bridge fails
    with an AttributeError on its first forward (as over a plain CodeGen)."""
    return (
        "TransformerLens cannot run CodeGen (its CodeGen attention reads the rotary table as "
        "CodeGenAttention.embed_positions, which transformers' CodeGen keeps in its CodeGenRotaryEmbedding)"
    )


#: Layouts TransformerLens reads wrongly, by family: each check returns its reason where the config has the layout.
MISREAD_LAYOUTS: dict[str, tuple[Callable[[Mapping[str, Any]], Optional[str]], ...]] = {
    "falcon": (_grouped_falcon, _alibi_falcon),
    "codegen": (_codegen,),
}


def _refuse_misread_layout(config: Mapping[str, Any]) -> None:
    """Refuse, before loading it, an export whose layout TransformerLens reads wrongly (``MISREAD_LAYOUTS``),
    pointing to nnsight, which runs the export's own modules."""
    for misread in MISREAD_LAYOUTS.get(_base_model_type(config), ()):
        reason = misread(config)
        if reason is not None:
            raise ConfigurationError(
                f"transformer_bridge: {reason}; trace this export with hf_tapernorm.integrations.nnsight_model instead"
            )


def _bridge_tokenizer(tokenizer: Any) -> Any:
    """A copy of the caller's tokenizer for TransformerLens, which edits the one it is given: a tokenizer without
    a BOS gets its EOS as pad and BOS tokens, and the next bridge from the same tokenizer then tried to reload it
    by a name it never had (KeyError: 'name_or_path'). The caller's tokenizer stays as it was."""
    return copy.deepcopy(tokenizer)


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
    so it needs ``tokenizer=``; the bridge gets a copy of the one given (TransformerLens edits its tokenizer).
    Refuses, before loading it, a layout TransformerLens reads wrongly (``MISREAD_LAYOUTS``: Falcon's new decoder
    architecture with several key/value heads, Falcon with ALiBi, CodeGen), pointing to nnsight. ``dtype``: as for
    ``load_export`` (a folder's, float32 by default; a model keeps its own, and another dtype is refused).
    """
    model_bridge = require("transformer_lens.model_bridge", FEATURE)
    normalization = require("transformer_lens.model_bridge.generalized_components.normalization", FEATURE)
    attention = require("transformer_lens.model_bridge.generalized_components.attention", FEATURE)
    _refuse_misread_layout(_source_config(source))
    model = load_export(source, dtype=dtype)
    name = model.config.name_or_path  # a folder's, "~" expanded, or where a model was loaded from
    bridge = model_bridge.TransformerBridge.boot_transformers(
        name or base_class(model).__name__,
        hf_model=model,
        # The adapter is chosen by architecture: the folded class extends this one and keeps its module names.
        hf_config_overrides={"architectures": [base_class(model).__name__]},
        tokenizer=_bridge_tokenizer(tokenizer) if tokenizer is not None else _saved_tokenizer(name),
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
