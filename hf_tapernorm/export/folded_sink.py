"""The attention-sink prefix of a folded export, and how an export reads its input, in one place.

Copied next to every export with ``modeling_folded.py`` (which imports it relatively), so it imports only torch and
transformers (huggingface_hub, their dependency, lazily). ``modeling_folded`` calls ``prepare_sink_call`` before
and ``finish_sink_call`` after the base model's forward; what one call needs travels in its own ``SinkCall``, so
concurrent calls of one model do not share state.

The input contract (a leading sink, left padding, 2D and 4D masks, positions, a learned position table) is
``read_input`` over a ``SinkContract``: the export's forward uses it, and so does every integration that runs the
export's weights another way (hf_tapernorm.integrations.onnx_runtime). An export loaded as its plain base class
(config.json's ``model_type`` edited) is refused at load (``plain_load_of_export``, on transformers' load report).
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import re
import warnings
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn
from transformers import DynamicCache

#: The keyword that carries a read-only sink cache past the decoder layers under gradient checkpointing.
SINK_CACHE_KEY = "tapernorm_sink_cache"
#: The start of every folded model_type (``tapernorm_llama``); modeling_folded builds the classes under it.
PREFIX = "tapernorm_"


@dataclass
class SinkCall:
    """What ``finish_sink_call`` needs from ``prepare_sink_call`` for one forward."""

    restore: Optional[tuple] = None  # (kept columns, logits_to_keep to apply, labels) when the input held the sink
    cache_only: bool = False  # the caller asked for no cache: the one made for the sink is not returned
    wants_tuple: bool = False  # the caller asked for return_dict=False


@dataclass(frozen=True)
class SinkContract:
    """What a model's input must be read against: its stored sink and its learned position table.

    ``owner`` names the model in messages; ``token_ids`` are the stored sink's tokens (empty: no sink);
    ``max_positions`` is the learned position table's size (0: none); ``has_logits`` says whether the sink's
    logits are stored (exports of an earlier hf_tapernorm hold its keys/values only).
    """

    owner: str
    token_ids: tuple[int, ...] = ()
    max_positions: int = 0
    has_logits: bool = True

    @classmethod
    def of(cls, model: nn.Module) -> SinkContract:
        """The contract of a loaded model: a folded export's from its config and buffers, any other model's from
        its position table."""
        config = model.config
        sink = tuple(getattr(config, "sink_token_ids", None) or ())
        limit = (getattr(config, "sink_max_positions", 0) or 0) if sink else learned_positions(model)
        return cls(type(model).__name__, sink, int(limit), getattr(model, "sink_logits", None) is not None)


@dataclass
class SinkState:
    """What the first call of a cache leaves for the calls that continue it (kept on the cache as ``sink_state``)."""

    in_input: bool = False  # the first call's input started with the sink: its masks and positions count it
    row_offset: Optional[torch.Tensor] = None  # per-row left padding of the first call (positions not given)
    mask_order: Optional[torch.Tensor] = None  # caller's column of each cache column (left-padded sink-first input)


def learned_positions(model: nn.Module) -> int:
    """The size of the model's learned position table (GPT-2's ``wpe``, OPT's ``embed_positions``), else 0.

    A sink export stores its sink at the first positions: with a table, sink and text share its rows.
    """
    limit = getattr(model.config, "max_position_embeddings", None)
    if not isinstance(limit, int):
        return 0
    embeddings = model.get_input_embeddings()
    for module in model.modules():
        if isinstance(module, nn.Embedding) and module is not embeddings and module.num_embeddings >= limit:
            return limit
    return 0


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


def prepare_sink_call(model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict, SinkCall]:
    """Give the forward the stored sink keys/values as the start of its cache, whichever way the caller passes state.

    - The cache comes as ``cache=`` or the older ``past_key_values=`` (transformers renames it; both are the same
      object here, so a decode step costs the same either way).
    - A fresh forward (no cache, or an empty one) gets a cache that starts with the stored sink; a continued cache
      already holds it, and remembers how its first call was read (``SinkState``).
    - The input itself (a leading sink, padding, masks, positions) is read by ``read_input``.
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
    checkpointing = model.training and model.is_gradient_checkpointing and torch.is_grad_enabled()
    if checkpointing and cache is not None:
        raise ValueError(
            f"{type(model).__name__}: a cache cannot be passed while training with gradient checkpointing (the "
            "layers replay their forward); call it without cache=, or in eval mode / under torch.no_grad()"
        )
    call = SinkCall(wants_tuple=kwargs.get("return_dict", getattr(model.config, "return_dict", True)) is False)
    if call.wants_tuple:
        kwargs["return_dict"] = True  # the output hook edits a ModelOutput, then returns the tuple
    state = None
    if cache is None or cache.get_seq_length() == 0:
        if cache is None:
            call.cache_only = checkpointing or kwargs.get("use_cache", model.config.use_cache) is False
            cache = SinkPrefixCache(config=model.config, read_only=checkpointing)
            if checkpointing:
                kwargs[SINK_CACHE_KEY] = cache
        _fill_sink(model, cache, inputs.shape[0])
        kwargs["cache"], kwargs["use_cache"] = cache, True
    else:
        state = getattr(cache, "sink_state", None) or SinkState()
    cache.sink_state, call.restore = read_input(SinkContract.of(model), kwargs, cache.get_seq_length(), state)
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


def read_input(
    contract: SinkContract, kwargs: dict, past: int, state: Optional[SinkState] = None
) -> tuple[SinkState, Optional[tuple]]:
    """Rewrite one call's keyword inputs, in place, into what the base model computes after the stored sink.

    ``past``: the columns the cache holds before this call, the sink's included; ``state``: None for a fresh call
    (the cache holds the sink alone), else what the fresh call returned. Returns the state for the calls that
    continue the cache and, when the input carried the sink, what ``restore_logits`` needs.

    - A fresh call either starts every row with the sink tokens, as a tokenizer that adds BOS gives them (at each
      row's first attended column under left padding): those columns are dropped and stand for the stored ones
      (positions count from the sink, the sink's logits come back from the stored ones); or it is the text alone:
      positions count from the first text token, and a mask may leave out the sink's columns.
    - A mask (2D ``[batch, keys]`` or 4D ``[batch, heads, queries, keys]``, boolean or additive) one sink shorter
      than cache + input counts without the sink: the sink's columns are put in front, attended by every query.
    - Without ``position_ids``, each left-padded row counts from its own first token, as ``generate()`` does; the
      pads before it get position 0 (they are masked, and a learned position table has no negative rows).
    - A call that reaches past a learned position table is refused (``max_positions``).
    """
    inputs = kwargs.get("input_ids")
    if inputs is None:
        inputs = kwargs["inputs_embeds"]
    batch, length = inputs.shape[0], inputs.shape[1]
    n = len(contract.token_ids)
    restore = None
    if state is None:
        columns = _sink_columns(contract, kwargs)
        padding = _first_attended(kwargs, length)  # per row, the leading masked columns
        padding = padding if padding is not None and bool(padding.any()) else None
        offset = padding if kwargs.get("position_ids") is None else None
        order = None
        if columns is not None:
            order, restore = _take_sink_from_input(contract, kwargs, columns)
            batch, length = kwargs["input_ids"].shape
        # Where each cache column came from in the caller's columns, when the sink was not in front of every row.
        state = SinkState(columns is not None, offset, order if padding is not None else None)
        counts_without_sink, order = columns is None, None
    else:
        counts_without_sink, order = not state.in_input, state.mask_order
    _check_positions(contract, past + length)
    mask = kwargs.get("attention_mask")
    if mask is not None and mask.dim() in (2, 4):
        counts_without_sink = mask.shape[-1] == past + length - n
        if counts_without_sink and n:
            kwargs["attention_mask"] = _with_sink_columns(mask, n)
        elif order is not None and mask.shape[0] == order.shape[0] and mask.shape[-1] >= order.shape[1]:
            # The caller's mask has each left-padded row's sink after its pads; the cache has it first.
            kwargs["attention_mask"] = _reorder_keys(mask, order)
    positions = kwargs.get("position_ids")
    if positions is not None:
        if counts_without_sink and n:
            kwargs["position_ids"] = positions + n
    elif state.row_offset is not None and state.row_offset.shape[0] == batch:
        steps = torch.arange(past, past + length, device=state.row_offset.device)
        kwargs["position_ids"] = (steps[None, :] - state.row_offset[:, None]).clamp(min=0)
    return state, restore


def restore_logits(
    logits: torch.Tensor, keep: torch.Tensor, keep_logits: Any, sink_logits: Optional[torch.Tensor]
) -> torch.Tensor:
    """The logits of every column of an input that carried the sink: the text's where ``keep``, the stored sink's
    elsewhere (NaN for an export that does not store them), then ``logits_to_keep`` applied."""
    full = logits.new_empty(*keep.shape, logits.shape[-1])
    full[keep] = logits.reshape(-1, logits.shape[-1])
    if sink_logits is None:
        warnings.warn(
            "This export (from an earlier hf_tapernorm) stores its sink's keys/values but not its logits: the "
            "logits at the sink's columns are NaN, the text's are exact (fold the tapered model again to store them)",
            stacklevel=2,
        )
        full[~keep] = float("nan")
    else:
        full[~keep] = sink_logits.to(logits.dtype).repeat(keep.shape[0], 1)
    if isinstance(keep_logits, int):
        return full[:, -keep_logits:] if keep_logits > 0 else full
    return full[:, keep_logits]


def _attended(mask: torch.Tensor) -> torch.Tensor:
    """``[batch, keys]``: True where a 2D mask is non-zero, or where some query of a 4D mask (first head) attends
    (True in a boolean mask, above the dtype's minimum in an additive one): a pad is a key no query reads."""
    if mask.dim() == 2:
        return mask.ne(0)
    rows = mask[:, 0]
    if rows.dtype != torch.bool:
        rows = rows > torch.finfo(rows.dtype).min / 2 if rows.is_floating_point() else rows.ne(0)
    return rows.any(dim=1)


def _first_attended(kwargs: dict, length: int) -> Optional[torch.Tensor]:
    """Per row, the first column a 2D or 4D ``attention_mask`` over ``length`` columns attends (None without one)."""
    mask = kwargs.get("attention_mask")
    if mask is None or mask.dim() not in (2, 4) or mask.shape[-1] != length:
        return None
    return _attended(mask).int().argmax(dim=1)


def _sink_columns(contract: SinkContract, kwargs: dict) -> Optional[torch.Tensor]:
    """Columns ``[batch, n]`` of a leading sink in ``input_ids`` (at each row's first attended column), else None.

    A tokenizer that adds BOS puts the sink in the input itself; those tokens are then the stored ones.
    Every row starts with the sink or none does: a batch that mixes both has no single meaning. Text that
    itself starts with the sink id (an EOS sink after a document boundary) is read as starting with the
    sink, as the tapered model reads position 0: pass the sink first to say so without doubt.
    """
    ids = kwargs.get("input_ids")
    sink = contract.token_ids
    if not sink or ids is None or ids.dim() != 2 or ids.shape[1] < len(sink):
        return None
    start = _first_attended(kwargs, ids.shape[1])
    if start is None:
        start = torch.zeros(ids.shape[0], dtype=torch.long, device=ids.device)
    columns = (start[:, None] + torch.arange(len(sink), device=ids.device)).clamp(max=ids.shape[1] - 1)
    found = ids.gather(1, columns).eq(torch.tensor(sink, device=ids.device)).all(dim=1)
    if not bool(found.any()):
        return None
    if not bool(found.all()):
        raise ValueError(
            f"{contract.owner}: some rows of input_ids start with the sink token(s) {list(sink)} and others do not; "
            "start every row with the sink (unambiguous, also when the sink id occurs in text), or none"
        )
    return columns


def _drop_columns(tensor: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``tensor[b, keep[b]]`` for a ``[batch, length, ...]`` tensor, keeping as many columns in every row."""
    if tensor.shape[0] != keep.shape[0]:
        tensor = tensor.expand(keep.shape[0], *tensor.shape[1:])
    return tensor[keep].view(keep.shape[0], -1, *tensor.shape[2:])


def _with_sink_columns(mask: torch.Tensor, n: int) -> torch.Tensor:
    """``mask`` with ``n`` leading key columns that every query attends: 1 (2D, or a boolean or integer 4D mask)
    or 0 (an additive 4D mask)."""
    head = mask.new_zeros if mask.dim() == 4 and mask.is_floating_point() else mask.new_ones
    return torch.cat([head(*mask.shape[:-1], n), mask], dim=-1)


def _reorder_keys(mask: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``mask`` with its first ``order.shape[1]`` key columns taken in ``order`` (``[batch, columns]``), row by row."""
    width = order.shape[1]
    index = order.view(order.shape[0], *([1] * (mask.dim() - 2)), width).expand(*mask.shape[:-1], width)
    return torch.cat([mask[..., :width].gather(-1, index), mask[..., width:]], dim=-1)


def _take_sink_from_input(contract: SinkContract, kwargs: dict, columns: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    """Drop the sink's columns from a fresh call's inputs (ids, mask rows and columns, positions, labels).

    Returns the caller's column of every cache column (``[batch, n + length]``: the sink's first, then the
    rest) and what ``restore_logits`` needs: (kept columns, logits_to_keep still to apply, labels).
    """
    ids = kwargs["input_ids"]
    batch, length = ids.shape
    n = columns.shape[1]
    labels = kwargs.pop("labels", None)
    if labels is not None and not contract.has_logits:
        raise ValueError(
            f"{contract.owner}: input_ids start with the sink token(s) {list(contract.token_ids)}, whose logits this "
            "export (from an earlier hf_tapernorm) does not store, so a loss over them cannot be computed; pass the "
            "text and its labels without the sink (tokenizer(..., add_special_tokens=False)) or fold the model again"
        )
    keep = torch.ones_like(ids, dtype=torch.bool).scatter_(1, columns, False)
    kept = torch.arange(length, device=ids.device).expand(batch, -1)[keep].view(batch, -1)
    order = torch.cat([columns, kept], dim=1)
    kwargs["input_ids"] = _drop_columns(ids, keep)
    mask = kwargs.get("attention_mask")
    if mask is not None and mask.dim() == 2 and mask.shape[-1] == length:
        kwargs["attention_mask"] = torch.cat([mask.new_ones(batch, n), _drop_columns(mask, keep)], dim=-1)
    elif mask is not None and mask.dim() == 4 and mask.shape[-2:] == (length, length):
        # The sink's query rows go (its logits are stored); its key columns move to the front, as in the cache.
        mask = mask.expand(batch, *mask.shape[1:])
        rows = mask.gather(2, kept[:, None, :, None].expand(-1, mask.shape[1], -1, length))
        kwargs["attention_mask"] = _reorder_keys(rows, order)
    positions = kwargs.get("position_ids")
    if positions is None:
        positions = torch.arange(length, device=ids.device).expand(batch, -1)
    if positions.dim() == 2:
        positions = positions.expand(batch, -1) if positions.shape[0] != batch else positions
        # The stored keys sit at positions 0..n-1: each row counts from its own first sink token (pads before it: 0).
        counted = positions - positions.gather(1, columns[:, :1])
        kwargs["position_ids"] = _drop_columns(counted, keep).clamp(min=0)
    keep_logits = kwargs.get("logits_to_keep", 0)
    # The last k columns come out of the model unchanged when no row's sink is among them.
    passes = isinstance(keep_logits, int) and keep_logits > 0 and length - keep_logits > int(columns.max())
    if not passes:
        kwargs["logits_to_keep"] = 0
    return order, (keep, None if passes else keep_logits, labels)


def _check_positions(contract: SinkContract, end: int) -> None:
    """Refuse a call past a learned position table (with a sink, its first ``n`` positions are the sink's)."""
    limit, n = contract.max_positions, len(contract.token_ids)
    if limit and end > limit:
        held = (
            f"the stored sink takes position(s) 0..{n - 1} of this model's {limit} learned positions, so the sink "
            f"and the text together hold at most {limit} tokens ({limit - n} of text; sink_max_positions in "
            "config.json)"
            if n
            else f"this model has {limit} learned positions"
        )
        raise ValueError(f"{contract.owner}: {held}; this call reaches {end}: shorten the input or crop the cache")


def finish_sink_call(model: nn.Module, kwargs: dict, output: Any, call: SinkCall) -> Any:
    """Put the sink's stored logits back in their columns, compute a loss on the full sequence, honour the
    caller's ``use_cache=False`` and ``return_dict=False``."""
    if call.restore is not None:
        keep, keep_logits, labels = call.restore
        if keep_logits is not None:
            output["logits"] = restore_logits(output.logits, keep, keep_logits, getattr(model, "sink_logits", None))
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


# ---------------------------------------------------------------------------------------- an export loaded as its base
def plain_load_of_export(class_name: str, config: Any) -> Optional[str]:
    """What is wrong when a model of class ``class_name`` and ``config`` (a config, or config.json's dict) is a
    folded export loaded as its plain base class, else None.

    An export's config.json edited to its base ``model_type`` (to load without remote code) keeps the fields only
    folding writes; the base class then runs the folded norms as norms of ones and drops the stored sink.
    """
    get = config.get if isinstance(config, dict) else lambda name, default: getattr(config, name, default)
    base, model_type = get("base_model_type", None), str(get("model_type", ""))
    if not base or get("hf_tapernorm_version", None) is None or model_type.startswith(PREFIX):
        return None
    return (
        f"{class_name}: '{get('name_or_path', '')}' is a folded export whose config.json names model_type "
        f"'{model_type}' instead of '{PREFIX}{base}'; loaded as a plain model it runs its folded norms as norms of "
        f'ones and drops its stored sink, so its logits are not the export\'s. Restore "model_type": '
        f'"{PREFIX}{base}" and load it where hf_tapernorm is imported, or with trust_remote_code=True'
    )


class _RefusePlainLoad(logging.Filter):
    """Raise ``plain_load_of_export``'s error on transformers' load report of a folded export loaded as its base
    class: the report (logged while transformers' warnings are on) is the only public trace of such a load."""

    def filter(self, record: logging.LogRecord) -> bool:
        found = re.search(r"([A-Z]\w*) LOAD REPORT\S* from: (.+)", str(record.msg))
        if found is None:
            return True
        source = found.group(2).strip()
        try:
            config = Path(source, "config.json")
            if not config.is_file():  # a Hub id: its config.json as the load just cached it
                from huggingface_hub import try_to_load_from_cache

                cached = try_to_load_from_cache(source, "config.json")
                config = Path(cached if isinstance(cached, str) else os.devnull)
            values = json.loads(config.read_text() or "{}")
        except (OSError, ValueError):  # not a folder or a valid Hub id, or an unreadable config: nothing to check
            return True
        problem = plain_load_of_export(found.group(1), {**values, "name_or_path": source})
        if problem is not None:
            raise OSError(problem)
        return True


_REPORTS = logging.getLogger("transformers.modeling_utils")
if not any(type(existing).__name__ == _RefusePlainLoad.__name__ for existing in _REPORTS.filters):
    _REPORTS.addFilter(_RefusePlainLoad())  # once, also when this file is loaded again as an export's remote code
