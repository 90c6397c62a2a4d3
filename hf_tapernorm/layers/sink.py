"""The attention-sink prefix: leading tokens kept normalized while every other position tapers.

Pretrained Llama-family models park a massive activation (orders of magnitude above the median
token's RMS) on their first position from the middle layers on; every other token attends to it. No
fixed linear map can stand in for a norm on such a token and on ordinary tokens at once, and with
it in the fit the whole model breaks when the gate closes (docs/fidelity.md).

The way out costs nothing at inference: if every sequence starts with the same ``n`` sink tokens
(e.g. BOS) and those positions stay on the normalized branch at every gate, they attend only to
themselves, so their keys and values at every layer are constants of the weights. Folding stores
them once (``sink_keys`` / ``sink_values``); the folded model puts them in front of a fresh cache,
so it computes no norm for any token and never runs the sink tokens at all.

Because the sink positions always take the normalized branch, their keys and values are exactly
those of the model with every gate at 1: :func:`sink_prefix` computes them that way.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch import nn

from ..config import config_of
from ..errors import ConfigurationError, TaperStateError, UnsupportedModelError
from .taper_norm import TaperNorm, tapered_norms


def sink_token_ids_of(model: nn.Module) -> list[int]:
    """The sink token ids a patched model was trained with (``[]`` when it has none or is not patched).

    Raises when the layers disagree with the model's TaperNormConfig, which would make the folded prefix wrong.
    """
    config = getattr(model, "tapernorm_config", None)
    ids = list(config.sink_token_ids) if config is not None else []
    wrong = [(name, layer.sink_tokens) for name, layer in tapered_norms(model) if layer.sink_tokens != len(ids)]
    if wrong:
        raise TaperStateError(
            f"{len(wrong)} tapered layer(s) of {type(model).__name__} disagree with its TaperNormConfig "
            f"({len(ids)} sink token(s)); first: {wrong[0][0]} keeps {wrong[0][1]} position(s) normalized. "
            "Set both through patch_model(model, TaperNormConfig(sink_token_ids=...)) or set_sink_tokens(model, ids)"
        )
    return ids


def set_sink_tokens(model: nn.Module, token_ids: Optional[Sequence[int]]) -> None:
    """Keep the first ``len(token_ids)`` positions normalized in every tapered layer; ``None``/``[]``: off.

    Every training and evaluation sequence must then start with exactly ``token_ids`` (prepend them
    when packing, see ``data.corpus.pack_documents(prefix_ids=...)``); the ids are recorded in the
    model's TaperNormConfig, so a saved checkpoint and the folded export know them.
    """
    ids = [int(i) for i in (token_ids or [])]
    config = config_of(model)
    for _, layer in tapered_norms(model):
        layer.sink_tokens = len(ids)
    model.tapernorm_config = config.replace(sink_token_ids=ids)
    if ids and not getattr(model, "_tapernorm_sink_hooked", False):
        model.register_forward_pre_hook(_mark_sink_forwards, with_kwargs=True)
        model._tapernorm_sink_hooked = True


def _mark_sink_forwards(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """Only a forward that starts at position 0 holds the sink; one that continues a cache does not.

    A fresh forward must start with the sink tokens (:func:`check_sink_first`; given as ``inputs_embeds``, with
    their embeddings: :func:`check_sink_embedded`), in training mode and in eval mode alike: this is where every
    batch of TaperCallback, TaperController or a hand-written loop enters the model, before any statistic is
    gathered or gradient computed, and where evaluation and generation enter it. Text
    without the sink would have its first token kept normalized as the sink, so its logits would be neither the
    trained model's nor its export's (which reads such text as stored sink + text). Looks the layers up on every
    call (not in a closure), so a deep-copied model marks its own. It also tells them the input's length, for a
    norm that reads its input flattened to ``[batch * seq, hidden]`` (OPT's MLP norm: ``TaperNorm.sequence_length``).
    """
    cache = kwargs.get("cache")
    if cache is None:
        cache = kwargs.get("past_key_values")  # the older name, which transformers 5 still accepts
    fresh = cache is None or not hasattr(cache, "get_seq_length") or cache.get_seq_length() == 0
    length = None
    if fresh:
        ids = model.tapernorm_config.sink_token_ids
        check_sink_not_padded(_forward_argument(model, args, kwargs, "attention_mask"), ids, type(model).__name__)
        where, also = (
            (f"training {type(model).__name__}", "") if model.training else (type(model).__name__, _EXPORT_READS_TEXT)
        )
        input_ids = _forward_argument(model, args, kwargs, "input_ids")
        inputs_embeds = _forward_argument(model, args, kwargs, "inputs_embeds")
        if input_ids is not None:
            check_sink_first(input_ids, ids, where, also=also)
        elif inputs_embeds is not None:
            check_sink_embedded(inputs_embeds, model.get_input_embeddings(), ids, where, also=also)
        given = input_ids if input_ids is not None else inputs_embeds
        length = int(given.shape[1]) if given is not None and given.dim() >= 2 else None
    for module in model.modules():
        if isinstance(module, TaperNorm):
            module.sink_active = fresh
            module.sequence_length = length


def _forward_argument(model: nn.Module, args: tuple, kwargs: dict, name: str) -> Any:
    """The forward's argument ``name`` whether it was given by keyword or by position (``model(ids, mask)``)."""
    if name in kwargs or not args:
        return kwargs.get(name)
    try:
        return inspect.signature(model.forward).bind_partial(*args).arguments.get(name)
    except TypeError:  # more positions than the forward names: the forward itself will say so
        return None


#: What an eval-mode refusal adds: the export reads text without the sink (the stored sink in front of it).
_EXPORT_READS_TEXT = "; the folded export (export_folded) reads text without the sink"


def check_sink_first(input_ids: torch.Tensor, token_ids: Sequence[int], where: str, *, also: str = "") -> None:
    """Raise at a batch whose sequences do not all start with ``token_ids`` (one comparison of ``[:, :n]``).

    A model patched with a sink keeps those positions normalized and leaves them out of calibration; a batch
    that starts otherwise would treat its first text token as the sink, and the export would compute
    something else than the trained model. ``also``: advice the caller appends to the message.
    """
    ids = [int(i) for i in token_ids]
    n = len(ids)
    if not n:
        return
    wrong = input_ids.dim() != 2 or input_ids.shape[1] < n
    if not wrong:
        wrong = bool(input_ids[:, :n].ne(torch.tensor(ids, device=input_ids.device)).any())
    if wrong:
        first = input_ids.reshape(-1)[:n].tolist() if input_ids.numel() else []
        raise ConfigurationError(_not_sink_first(where, ids, f"it starts {first}", also))


def check_sink_embedded(
    inputs_embeds: torch.Tensor, embedding: nn.Module, token_ids: Sequence[int], where: str, *, also: str = ""
) -> None:
    """Raise at ``inputs_embeds`` whose rows do not all start with ``embedding`` of ``token_ids``: the
    :func:`check_sink_first` of a forward given embeddings instead of ids.

    The patched model keeps the first ``n`` positions normalized whatever they hold, so embedded text without the
    sink in front would be read as sink + text, as ids would. Compared in the embeddings' own dtype (a sink embedded
    in bfloat16 is the sink of a bfloat16 caller) at a tolerance far below any two distinct tokens' distance.
    """
    ids = [int(i) for i in token_ids]
    n = len(ids)
    if not n:
        return
    wrong = inputs_embeds.dim() != 3 or inputs_embeds.shape[1] < n
    if not wrong:
        weight = next(embedding.parameters())
        with torch.no_grad():
            sink = embedding(torch.tensor([ids], device=weight.device)).to(inputs_embeds.device, inputs_embeds.dtype)
            given = inputs_embeds[:, :n].detach()
            wrong = not torch.allclose(given.float(), sink.float().expand_as(given), rtol=1e-5, atol=1e-6)
    if wrong:
        raise ConfigurationError(_not_sink_first(where, ids, "inputs_embeds do not start with their embeddings", also))


def _not_sink_first(where: str, ids: list[int], what: str, also: str) -> str:
    """The refusal of a batch that does not start with the sink ``ids``: what it starts with, and the three fixes."""
    return (
        f"{where}: a batch does not start with the sink token(s) {ids} ({what}); prepend them to "
        "every sequence (the tokenizer's BOS), pack with "
        f"hf_tapernorm.data.corpus.pack_documents(..., prefix_ids={ids}), or patch without a sink: "
        f"TaperNormConfig(sink_token_ids=[]){also}"
    )


def check_sink_not_padded(attention_mask: Optional[torch.Tensor], token_ids: Sequence[int], where: str) -> None:
    """Raise at a left-padded batch: one whose ``attention_mask`` marks any of the first ``len(token_ids)`` columns
    of a row as padding.

    The patched model keeps the first columns normalized as the sink, whatever they hold, so a row's pads would be
    taken for its sink and its real sink (after the pads) would taper: its logits would differ from the row's
    alone. Finding the sink per row would need per-row positions in every norm; the folded export does that.
    A 2D mask marks padding with 0; a 4D one (``[batch, heads, queries, keys]``, boolean, additive float or
    integer) marks a column as padding when the row's own query at that column cannot attend to it (its
    diagonal entry is masked: False, 0, or at most half the dtype's lowest value, ``-inf`` included) or attends to
    a later column (a pad row set back to all-attend, as transformers' SDPA masks do).
    """
    n = len(token_ids)
    if not n or not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() not in (2, 4):
        return
    if attention_mask.dim() == 2:
        padded, how = attention_mask[:, :n].eq(0), "attention_mask 0"
    else:
        masked, ahead = _padded_queries(attention_mask, n)
        padded = masked | ahead
        how = "the 4D attention_mask " + (
            "masks the diagonal" if bool(masked.any()) else "lets a pad row attend to later columns"
        )
    if bool(padded.any()):
        raise ConfigurationError(
            f"{where}: a left-padded batch ({how} in the first {n} column(s)): the patched model reads "
            f"the first column(s) as the sink {list(token_ids)}, not each row's; run such rows alone, pad on the "
            "right (tokenizer.padding_side = 'right'), or use the folded export (export_folded), which finds the "
            "sink after the pads"
        )


def _padded_queries(mask: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Whether each row's query at key column ``j < n`` is a pad's, two ``[batch, heads, columns]`` tensors: masked
    from its own column (the diagonal), and attending to a later column ``k > j``, which no causal real query does
    (transformers' SDPA masks set a fully masked pad row back to all-attend, so its diagonal is not masked).

    The queries are the last ``mask.shape[2]`` of the ``mask.shape[3]`` key positions; a column before the first
    query has no query of its own and is not read.
    """
    queries, keys = mask.shape[-2:]
    offset = keys - queries
    columns = torch.arange(max(offset, 0), min(n, keys), device=mask.device)
    rows = mask[:, :, columns - offset, :]  # [batch, heads, columns, keys]
    if rows.dtype == torch.bool:
        allowed = rows
    elif rows.is_floating_point():
        allowed = rows > torch.finfo(rows.dtype).min / 2
    else:
        allowed = rows.ne(0)
    diagonal = allowed.gather(-1, columns.expand(*rows.shape[:2], -1)[..., None])[..., 0]
    later = torch.arange(keys, device=mask.device)[None, :] > columns[:, None]  # [columns, keys]
    return ~diagonal, (allowed & later).any(-1)


def warn_if_tokenizer_omits_sink(tokenizer: Any, token_ids: Sequence[int], stacklevel: int = 3) -> bool:
    """Warn (once per call) when ``tokenizer`` does not itself start its output with the sink tokens; True if so.

    Such a tokenizer (Qwen's adds no BOS) gives sequences that break the sink contract unless the data
    pipeline prepends the sink. ``stacklevel``: the frames up to the user's call, which the warning names.
    """
    ids = [int(i) for i in token_ids]
    if not ids:
        return False
    try:
        start = [int(i) for i in tokenizer("a")["input_ids"][: len(ids)]]
    except Exception:  # noqa: BLE001 - any callable that is not a tokenizer: nothing to check
        return False
    if start == ids:
        return False
    warnings.warn(
        f"the tokenizer does not start its output with the sink token(s) {ids} (it starts {start}): prepend them "
        f"to every training and evaluation sequence (pack_documents(..., prefix_ids={ids})), or patch without a "
        "sink: TaperNormConfig(sink_token_ids=[])",
        UserWarning,
        stacklevel=stacklevel,
    )
    return True


def sink_prefix(model: nn.Module, token_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of the sink tokens at every layer: two ``[layers, kv_heads, n, head_dim]`` tensors.

    Runs ``model`` on the sink tokens alone with every tapered gate at 1 (the branch those
    positions always take) and reads the cache; keys are stored as the cache holds them (after
    RoPE, at positions ``0 .. n-1``). Gates and training mode are restored.
    """
    keys, values, _ = sink_outputs(model, token_ids)
    return keys, values


@torch.no_grad()
def sink_outputs(model: nn.Module, token_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`sink_prefix`'s keys and values, and the ``[n, vocab]`` logits at the sink positions (constants too)."""
    ids = torch.tensor([list(token_ids)], device=next(model.parameters()).device)
    if ids.shape[1] == 0:
        raise TaperStateError("sink_prefix needs at least one sink token id")
    layers = [layer for _, layer in tapered_norms(model)]
    gates = [float(layer.gate) for layer in layers]
    was_training = model.training
    model.eval()
    try:
        for layer in layers:
            layer.set_gate(1.0)
        output = model(input_ids=ids, use_cache=True)
    finally:
        for layer, gate in zip(layers, gates):
            layer.set_gate(gate)
        model.train(was_training)
    cache = output.cache
    if cache is None or not getattr(cache, "layers", None):
        raise UnsupportedModelError(f"{type(model).__name__} returned no key/value cache; the sink prefix needs one")
    try:
        keys = torch.stack([layer.keys[0] for layer in cache.layers])
        values = torch.stack([layer.values[0] for layer in cache.layers])
    except (AttributeError, TypeError, RuntimeError) as error:
        raise UnsupportedModelError(
            f"{type(model).__name__}'s cache ({type(cache).__name__}) does not hold one key/value tensor per layer "
            f"of equal shape, so its sink prefix cannot be stored ({error})"
        ) from None
    return keys, values, output.logits[0]


__all__ = [
    "check_sink_embedded",
    "check_sink_first",
    "check_sink_not_padded",
    "set_sink_tokens",
    "sink_outputs",
    "sink_prefix",
    "sink_token_ids_of",
    "warn_if_tokenizer_omits_sink",
]
