"""The attention-sink prefix of a folded export: put in front of every fresh cache, and put back in front of the
outputs of an input that carried it.

Copied next to every export with ``modeling_folded.py`` (which imports it relatively), so it imports only torch and
transformers (huggingface_hub, their dependency, lazily) and its sibling ``folded_input.py`` (copied too).
``modeling_folded`` calls ``prepare_sink_call`` before and ``finish_sink_call`` after the base model's forward; what
one call needs travels in its own ``SinkCall``, so concurrent calls of one model do not share state.

The input contract (a leading sink, left padding, 2D and 4D masks, positions, a learned position table) is
``folded_input.read_input``. An input that starts with the sink gets outputs with one column per input column: the
base model never runs the sink, whose logits, hidden states and attention rows are constants stored at fold time
(``sink_logits``, ``sink_hidden_states``, ``sink_attentions``). An export loaded as its plain base class
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

from .folded_input import SinkContract, SinkRestore, SinkState, read_input

#: The keyword that carries a read-only sink cache past the decoder layers under gradient checkpointing.
SINK_CACHE_KEY = "tapernorm_sink_cache"
#: The start of every folded model_type (``tapernorm_llama``); modeling_folded builds the classes under it.
PREFIX = "tapernorm_"


@dataclass
class SinkCall:
    """What ``finish_sink_call`` needs from ``prepare_sink_call`` for one forward."""

    restore: Optional[SinkRestore] = None  # when the input carried the sink: how its outputs line up with it again
    key_order: Optional[torch.Tensor] = None  # the caller's column of each cache column, when they differ
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
    call.key_order = cache.sink_state.mask_order
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


def restore_logits(logits: torch.Tensor, restore: SinkRestore, sink_logits: Optional[torch.Tensor]) -> torch.Tensor:
    """The logits of every column of an input that carried the sink: the text's where the base model computed them,
    the stored sink's elsewhere (NaN, with a warning, for an export that does not store them), then the caller's
    ``logits_to_keep`` applied."""
    if sink_logits is None:
        _warn_unstored(["logits"])
    return _logits_to_keep(_with_sink_rows(logits, restore.keep, sink_logits), restore.keep_logits)


def _logits_to_keep(full: torch.Tensor, keep_logits: Any) -> torch.Tensor:
    """The columns of ``full`` that the caller's ``logits_to_keep`` (a count, or indices) asks for."""
    if isinstance(keep_logits, int):
        return full[:, -keep_logits:] if keep_logits > 0 else full
    return full[:, keep_logits]


def _warn_unstored(what: list[str]) -> None:
    """One warning for the sink outputs an export of an earlier hf_tapernorm does not store (NaN in their place)."""
    named = " and ".join([", ".join(what[:-1]), what[-1]] if len(what) > 1 else what)
    warnings.warn(
        f"This export (from an earlier hf_tapernorm) stores its sink's keys/values but not its {named}: the {named} "
        "at the sink's columns are NaN, the text's are exact (fold the tapered model again to store them)",
        stacklevel=3,
    )


def _with_sink_rows(tensor: torch.Tensor, keep: torch.Tensor, stored: Optional[torch.Tensor]) -> torch.Tensor:
    """``tensor`` (``[batch, kept, ...]``) spread over the columns where ``keep`` (``[batch, length]``), ``stored``
    (``[n, ...]`` for every row, or ``[batch, n, ...]``) at the others, NaN there when ``stored`` is None."""
    full = tensor.new_empty(*keep.shape, *tensor.shape[2:])
    full[keep] = tensor.reshape(-1, *tensor.shape[2:])
    if stored is None:
        full[~keep] = float("nan")
    else:
        stored = stored.to(tensor.dtype)
        stored = stored.expand(keep.shape[0], *stored.shape) if stored.dim() < tensor.dim() else stored
        full[~keep] = stored.reshape(-1, *tensor.shape[2:])
    return full


def _keys_in_caller_order(weights: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Attention ``weights`` (``[batch, heads, queries, keys]``) with their first ``order.shape[1]`` key columns moved
    from the cache's order to the caller's (``order``: the caller's column of each cache column, row by row)."""
    width = order.shape[1]
    if weights.shape[0] != order.shape[0] or weights.shape[-1] < width:
        return weights
    index = order[:, None, None, :].expand(*weights.shape[:-1], width)
    head = torch.empty_like(weights[..., :width]).scatter_(-1, index, weights[..., :width])
    return torch.cat([head, weights[..., width:]], dim=-1)


def _with_sink_attention(weights: torch.Tensor, restore: SinkRestore, stored: Optional[torch.Tensor]) -> torch.Tensor:
    """Attention ``weights`` (keys in the caller's order) with the sink's query rows back in their columns: the stored
    ``[heads, n, n]`` rows over the sink's own keys (the sink attends only to itself), zero over the others."""
    batch, heads, _, keys = weights.shape
    columns = restore.sink_columns()
    n = columns.shape[1]
    rows = None
    if stored is not None:
        index = columns[:, None, None, :].expand(batch, heads, n, n)
        source = stored.to(weights.dtype).expand(batch, -1, -1, -1)
        rows = weights.new_zeros(batch, heads, n, keys).scatter_(-1, index, source).transpose(1, 2)
    return _with_sink_rows(weights.transpose(1, 2), restore.keep, rows).transpose(1, 2)


def _restore_outputs(model: nn.Module, output: Any, call: SinkCall) -> None:
    """Give ``output`` one column per input column: the sink's stored logits, hidden states and attention rows in
    its columns (NaN, with one warning, for what an earlier export does not store), attention keys in the
    caller's order."""
    attentions = getattr(output, "attentions", None) or ()
    if call.key_order is not None and attentions:
        output["attentions"] = tuple(
            None if a is None else _keys_in_caller_order(a, call.key_order) for a in attentions
        )
    restore = call.restore
    if restore is None:
        return
    asked = {
        "logits": restore.keep_logits is not None,
        "hidden_states": bool(getattr(output, "hidden_states", None)),
        "attentions": any(a is not None for a in attentions),
    }
    stored = {name: getattr(model, f"sink_{name}", None) for name, wanted in asked.items() if wanted}
    unstored = [name.replace("_", " ") for name, tensor in stored.items() if tensor is None]
    if unstored:
        _warn_unstored(unstored)
    if "logits" in stored:
        full = _with_sink_rows(output.logits, restore.keep, stored["logits"])
        output["logits"] = _logits_to_keep(full, restore.keep_logits)
    if "hidden_states" in stored:
        sink = stored["hidden_states"]  # [entries, n, widest]: each entry zero-padded to the widest
        output["hidden_states"] = tuple(
            _with_sink_rows(h, restore.keep, None if sink is None else sink[i, ..., : h.shape[-1]])
            for i, h in enumerate(output.hidden_states)
        )
    if "attentions" in stored:
        sink = stored["attentions"]  # [layers, heads, n, n]
        output["attentions"] = tuple(
            None if a is None else _with_sink_attention(a, restore, None if sink is None else sink[i])
            for i, a in enumerate(output.attentions)
        )


def finish_sink_call(model: nn.Module, kwargs: dict, output: Any, call: SinkCall) -> Any:
    """Line the outputs up with the input (``_restore_outputs``), compute a loss on the full sequence, honour the
    caller's ``use_cache=False`` and ``return_dict=False``."""
    _restore_outputs(model, output, call)
    labels = call.restore.labels if call.restore is not None else None
    if labels is not None:
        loss_kwargs = {key: kwargs[key] for key in ("num_items_in_batch", "ignore_index") if key in kwargs}
        output["loss"] = model.loss_function(
            logits=output.logits, labels=labels, vocab_size=model.config.vocab_size, **loss_kwargs
        )
    if call.cache_only and getattr(output, "cache", None) is not None:
        output = _without_cache(output)
    if call.wants_tuple:  # in field order, as ModelOutput.to_tuple gives it, without the None fields
        return tuple(getattr(output, item.name) for item in fields(output) if getattr(output, item.name) is not None)
    return output


def _without_cache(output: Any) -> Any:
    """``output`` as the base model returns it when no cache was asked for: without a ``cache`` entry at all.

    Setting the entry to None would leave the key in the output, and ``generate`` hands any ``cache`` key on to the
    next step: beam search without a cache then tries to reorder None ("the cache cannot be reordered"), and
    ``to_tuple`` or an index into the output would count it. A ModelOutput refuses ``del``, so a new one is built.
    """
    return type(output)(**{key: value for key, value in output.items() if key != "cache"})


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
