"""The attention-sink prefix of a folded export: its stored keys/values start every fresh cache.

Copied next to every export with ``modeling_folded.py`` (which imports it relatively), so it imports only torch
and transformers. ``modeling_folded`` calls ``prepare_sink_call`` before and ``finish_sink_call`` after the
base model's forward; everything one call needs travels in its own ``SinkCall``, so concurrent calls of one
model do not share state.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, fields
from typing import Any, Optional

import torch
from torch import nn
from transformers import DynamicCache

#: The keyword that carries a read-only sink cache past the decoder layers under gradient checkpointing.
SINK_CACHE_KEY = "tapernorm_sink_cache"


@dataclass
class SinkCall:
    """What ``finish_sink_call`` needs from ``prepare_sink_call`` for one forward."""

    restore: Optional[tuple] = None  # (kept columns, logits_to_keep to apply, labels) when the input held the sink
    cache_only: bool = False  # the caller asked for no cache: the one made for the sink is not returned
    wants_tuple: bool = False  # the caller asked for return_dict=False


class SinkPrefixCache(DynamicCache):
    """The dynamic cache a sink export starts: the stored sink first, then the caller's tokens.

    ``read_only`` (a training forward under gradient checkpointing): once the sink is in, each layer gets the
    sink followed by its new states and nothing more is stored, so the layer's replay in the backward pass sees
    the same prefix. A checkpointed decoder layer drops the cache it is given (layers write to it); the cache
    then also travels as ``SINK_CACHE_KEY``, which transformers passes down to the attention modules, and
    ``give_back_sink_cache`` hands it to them.
    """

    def __init__(self, *args: Any, read_only: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.read_only = read_only
        self.holds_sink = False

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        if not (self.read_only and self.holds_sink):
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        layer = self.layers[layer_idx]
        return torch.cat([layer.keys, key_states], dim=-2), torch.cat([layer.values, value_states], dim=-2)


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The modules that read and write the cache: the innermost ones whose forward takes ``cache``."""
    takes_cache = []
    for module in model.modules():
        try:
            if "cache" in inspect.signature(module.forward).parameters:
                takes_cache.append(module)
        except (TypeError, ValueError):
            continue
    inner = []
    for module in takes_cache:
        if not any(other is not module and other in takes_cache for other in module.modules()):
            inner.append(module)
    return inner


def give_back_sink_cache(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook of each attention module: the read-only sink cache a checkpointed layer dropped."""
    cache = kwargs.pop(SINK_CACHE_KEY, None)
    if cache is not None and kwargs.get("cache") is None:
        kwargs["cache"] = cache
    return args, kwargs


def _sink_columns(model: nn.Module, kwargs: dict) -> Optional[torch.Tensor]:
    """Columns ``[batch, n]`` of a leading sink in ``input_ids`` (at each row's first attended column), else None.

    A tokenizer that adds BOS puts the sink in the input itself; those tokens are then the stored ones.
    Every row starts with the sink or none does: a batch that mixes both has no single meaning. Text that
    itself starts with the sink id (an EOS sink after a document boundary) is read as starting with the
    sink, as the tapered model reads position 0: pass the sink first to say so without doubt.
    """
    ids = kwargs.get("input_ids")
    sink = model.config.sink_token_ids
    if ids is None or ids.dim() != 2 or ids.shape[1] < len(sink):
        return None
    mask = kwargs.get("attention_mask")
    if mask is not None and mask.dim() == 2 and mask.shape[-1] == ids.shape[1]:
        start = mask.ne(0).int().argmax(dim=1)  # left padding: the first attended column
    else:
        start = torch.zeros(ids.shape[0], dtype=torch.long, device=ids.device)
    columns = (start[:, None] + torch.arange(len(sink), device=ids.device)).clamp(max=ids.shape[1] - 1)
    found = ids.gather(1, columns).eq(torch.tensor(sink, device=ids.device)).all(dim=1)
    if not bool(found.any()):
        return None
    if not bool(found.all()):
        raise ValueError(
            f"{type(model).__name__}: some rows of input_ids start with the sink token(s) {sink} and others do not; "
            "start every row with the sink (unambiguous, also when the sink id occurs in text), or none"
        )
    return columns


def _left_padding(kwargs: dict, length: int) -> Optional[torch.Tensor]:
    """Per-row count of leading masked columns of a 2D ``attention_mask`` (None without left padding)."""
    mask = kwargs.get("attention_mask")
    if mask is None or mask.dim() != 2 or mask.shape[-1] != length:
        return None
    start = mask.ne(0).int().argmax(dim=1)
    return start if bool(start.any()) else None


def _drop_columns(tensor: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``tensor[b, keep[b]]`` for a ``[batch, length, ...]`` tensor, keeping as many columns in every row."""
    if tensor.shape[0] != keep.shape[0]:
        tensor = tensor.expand(keep.shape[0], *tensor.shape[1:])
    return tensor[keep].view(keep.shape[0], -1, *tensor.shape[2:])


def prepare_sink_call(model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict, SinkCall]:
    """Give the forward the stored sink keys/values as the start of its cache, whichever way the caller passes state.

    - The cache comes as ``cache=`` or the older ``past_key_values=`` (transformers renames it; both are the same
      object here, so a decode step costs the same either way).
    - A fresh forward (no cache, or an empty one) either starts with the sink tokens, as a tokenizer that adds BOS
      gives them: those columns are dropped and stand for the stored ones (positions count from the sink, the
      returned logits include the sink's, stored as well); or it is the text alone: ``position_ids`` count from the
      first text token and a 2D ``attention_mask`` may leave out the sink's columns.
    - A continued cache already holds the sink. A 2D mask one sink shorter than cache + input marks a caller
      that counts without the sink (its positions are shifted); the cache remembers how it was started.
    - A compileable (static) cache is refused: its masks are built before this hook can put the sink in it.
    - A training forward under gradient checkpointing gets a read-only prefix (``SinkPrefixCache``): the
      checkpointed layers may read it, and their replay in the backward pass reads the same states.

    What the output needs (``finish_sink_call``) comes back in a ``SinkCall``, not on the module: one model
    serves calls from several threads at once.
    """
    if len(args) > 1:
        raise TypeError(
            f"{type(model).__name__} with a sink prefix takes its inputs by keyword (got {len(args)} positional)"
        )
    cache = _the_cache(model, args, kwargs)
    args = ()
    inputs = kwargs.get("input_ids")
    if inputs is None:
        inputs = kwargs["inputs_embeds"]
    batch, length = inputs.shape[0], inputs.shape[1]
    n = model.sink_keys.shape[2]
    checkpointing = model.training and model.is_gradient_checkpointing and torch.is_grad_enabled()
    if checkpointing and cache is not None:
        raise ValueError(
            f"{type(model).__name__}: a cache cannot be passed while training with gradient checkpointing (the "
            "layers replay their forward); call it without cache=, or in eval mode / under torch.no_grad()"
        )
    call = SinkCall(wants_tuple=kwargs.get("return_dict", getattr(model.config, "return_dict", True)) is False)
    if call.wants_tuple:
        kwargs["return_dict"] = True  # the output hook edits a ModelOutput, then returns the tuple
    if cache is None or cache.get_seq_length() == 0:
        columns = _sink_columns(model, kwargs)
        padding = _left_padding(kwargs, length)
        offset = padding if kwargs.get("position_ids") is None else None
        order = None
        if columns is not None:
            order = _take_sink_from_input(model, kwargs, columns, call)
            batch, length = kwargs["input_ids"].shape
        if cache is None:
            call.cache_only = checkpointing or kwargs.get("use_cache", model.config.use_cache) is False
            cache = SinkPrefixCache(config=model.config, read_only=checkpointing)
            if checkpointing:
                kwargs[SINK_CACHE_KEY] = cache
        _fill_sink(model, cache, batch)
        cache.sink_in_input, cache.sink_row_offset = columns is not None, offset
        # Where each cache column came from in the caller's columns, when the sink was not in front of every row.
        cache.sink_mask_order = order if padding is not None else None
        kwargs["cache"], kwargs["use_cache"] = cache, True
        counts_without_sink, order = columns is None, None
    else:
        counts_without_sink = not getattr(cache, "sink_in_input", False)
        order = getattr(cache, "sink_mask_order", None)
    past = cache.get_seq_length()
    _check_positions(model, past + length, n)
    mask = kwargs.get("attention_mask")
    if mask is not None and mask.dim() == 2:
        counts_without_sink = mask.shape[-1] == past + length - n
        if counts_without_sink:
            kwargs["attention_mask"] = torch.cat([mask.new_ones(batch, n), mask], dim=-1)
        elif order is not None and mask.shape[0] == order.shape[0] and mask.shape[-1] >= order.shape[1]:
            # The caller's mask has each left-padded row's sink after its pads; the cache has it first.
            head = mask[:, : order.shape[1]].gather(1, order)
            kwargs["attention_mask"] = torch.cat([head, mask[:, order.shape[1] :]], dim=-1)
    positions = kwargs.get("position_ids")
    if positions is not None:
        if counts_without_sink:
            kwargs["position_ids"] = positions + n
    elif getattr(cache, "sink_row_offset", None) is not None and cache.sink_row_offset.shape[0] == batch:
        # Left padding without position_ids: each row counts from its own first token, as generate() does.
        steps = torch.arange(past, past + length, device=cache.sink_row_offset.device)
        kwargs["position_ids"] = steps[None, :] - cache.sink_row_offset[:, None]
    return args, kwargs, call


def _the_cache(model: nn.Module, args: tuple, kwargs: dict) -> Any:
    """Move a positional ``input_ids`` into ``kwargs``, take the cache under either name; refuse a static one."""
    if args:
        kwargs["input_ids"] = args[0]
    legacy = kwargs.pop("past_key_values", None)
    if legacy is not None:
        if kwargs.get("cache") is not None:
            raise TypeError(f"{type(model).__name__}: pass the cache once, as cache= (or the older past_key_values=)")
        kwargs["cache"] = legacy
    cache = kwargs.get("cache")
    if cache is not None and getattr(cache, "is_compileable", False):
        raise ValueError(
            f"{type(model).__name__} holds its attention sink as a cache prefix and cannot fill a static "
            f"({type(cache).__name__}) cache; use the default dynamic cache (generate() without "
            "cache_implementation='static', or cache=DynamicCache(config=model.config))"
        )
    return cache


def _fill_sink(model: nn.Module, cache: Any, batch: int) -> None:
    """Put the stored sink keys/values of every layer at the start of a fresh cache."""
    dtype = model.get_input_embeddings().weight.dtype
    for index in range(model.sink_keys.shape[0]):
        keys = model.sink_keys[index].to(dtype).expand(batch, -1, -1, -1).contiguous()
        values = model.sink_values[index].to(dtype).expand(batch, -1, -1, -1).contiguous()
        cache.update(keys, values, index)
    if isinstance(cache, SinkPrefixCache):
        cache.holds_sink = True


def _check_positions(model: nn.Module, end: int, n: int) -> None:
    """Refuse a sequence past a learned position table: the stored sink holds its first ``n`` positions."""
    limit = getattr(model.config, "sink_max_positions", 0) or 0
    if limit and end > limit:
        raise ValueError(
            f"{type(model).__name__}: the stored sink takes position(s) 0..{n - 1} of this model's {limit} learned "
            f"positions, so the sink and the text together hold at most {limit} tokens ({limit - n} of text; "
            f"sink_max_positions in config.json); this call reaches {end}: shorten the input or crop the cache"
        )


def _take_sink_from_input(model: nn.Module, kwargs: dict, columns: torch.Tensor, call: SinkCall) -> torch.Tensor:
    """Drop the sink's columns from a fresh forward's inputs; record how to put the sink's logits back.

    Returns the caller's column of every cache column (``[batch, length]``: the sink's first, then the rest).
    """
    ids = kwargs["input_ids"]
    batch, length = ids.shape
    n = columns.shape[1]
    if not hasattr(model, "sink_logits"):
        raise ValueError(
            f"{type(model).__name__}: input_ids start with the sink token(s) {model.config.sink_token_ids}, which "
            "this export (from an older hf_tapernorm) holds as stored keys/values only; pass the text without them "
            "(tokenizer(..., add_special_tokens=False)) or re-export the model"
        )
    keep = torch.ones_like(ids, dtype=torch.bool).scatter_(1, columns, False)
    kwargs["input_ids"] = _drop_columns(ids, keep)
    mask = kwargs.get("attention_mask")
    if mask is not None and mask.dim() == 2 and mask.shape[-1] == length:
        kwargs["attention_mask"] = torch.cat([mask.new_ones(batch, n), _drop_columns(mask, keep)], dim=-1)
    positions = kwargs.get("position_ids")
    if positions is None:
        positions = torch.arange(length, device=ids.device).expand(batch, -1)
    if positions.dim() == 2:
        positions = positions.expand(batch, -1) if positions.shape[0] != batch else positions
        # The stored keys sit at positions 0..n-1: each row counts from its own first sink token.
        kwargs["position_ids"] = _drop_columns(positions - positions.gather(1, columns[:, :1]), keep)
    labels = kwargs.pop("labels", None)
    keep_logits = kwargs.get("logits_to_keep", 0)
    # The last k columns come out of the model unchanged when no row's sink is among them.
    passes = isinstance(keep_logits, int) and keep_logits > 0 and length - keep_logits > int(columns.max())
    if not passes:
        kwargs["logits_to_keep"] = 0
    call.restore = (keep, None if passes else keep_logits, labels)
    kept = torch.arange(length, device=ids.device).expand(batch, -1)[keep].view(batch, -1)
    return torch.cat([columns, kept], dim=1)


def finish_sink_call(model: nn.Module, kwargs: dict, output: Any, call: SinkCall) -> Any:
    """Put the sink's stored logits back in their columns, compute a loss on the full sequence, honour the
    caller's ``use_cache=False`` and ``return_dict=False``."""
    if call.restore is not None:
        keep, keep_logits, labels = call.restore
        if keep_logits is not None:
            logits = output.logits
            full = logits.new_empty(*keep.shape, logits.shape[-1])
            full[keep] = logits.reshape(-1, logits.shape[-1])
            full[~keep] = model.sink_logits.to(logits.dtype).repeat(keep.shape[0], 1)
            if isinstance(keep_logits, int):
                full = full[:, -keep_logits:] if keep_logits > 0 else full
            else:
                full = full[:, keep_logits]
            output["logits"] = full
        if labels is not None:
            loss_kwargs = {key: kwargs[key] for key in ("num_items_in_batch", "ignore_index") if key in kwargs}
            output["loss"] = model.loss_function(
                logits=output.logits, labels=labels, vocab_size=model.config.vocab_size, **loss_kwargs
            )
    if call.cache_only and getattr(output, "cache", None) is not None:
        output["cache"] = None  # item, not attribute: ModelOutput ignores setting an attribute to None
    if call.wants_tuple:  # in field order, as ModelOutput.to_tuple gives it, without the None fields
        return tuple(getattr(output, item.name) for item in fields(output) if getattr(output, item.name) is not None)
    return output
