"""How a folded export reads one call's input against its stored sink: a leading sink, left padding, 2D and 4D
masks, positions, a learned position table.

Copied next to every export with ``modeling_folded.py`` and ``folded_sink.py`` (which imports it relatively), so it
imports only torch. ``read_input`` over a ``SinkContract`` is the one reading: the export's forward uses it
(``folded_sink.prepare_sink_call``), and so does every integration that runs the export's weights another way
(hf_tapernorm.integrations.onnx_runtime).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn


@dataclass(frozen=True)
class SinkContract:
    """What a model's input must be read against: its stored sink and its learned position table.

    ``owner`` names the model in messages; ``token_ids`` are the stored sink's tokens (empty: no sink);
    ``max_positions`` is the learned position table's size (0: none); ``has_logits`` says whether the sink's
    logits are stored (exports of an earlier hf_tapernorm hold its keys/values only); ``input_embeddings`` (None
    where unknown) is the model's input embedding module, whose output for the sink tokens tells ``inputs_embeds``
    that start with the sink, as its ids tell ``input_ids`` (read only for a call given ``inputs_embeds``: the
    contract is built at every forward, decode steps included).
    """

    owner: str
    token_ids: tuple[int, ...] = ()
    max_positions: int = 0
    has_logits: bool = True
    input_embeddings: Optional[nn.Module] = field(default=None, compare=False)

    @classmethod
    def of(cls, model: nn.Module) -> SinkContract:
        """The contract of a loaded model: a folded export's from its config and buffers, any other model's from
        its position table."""
        config = model.config
        sink = tuple(getattr(config, "sink_token_ids", None) or ())
        limit = (getattr(config, "sink_max_positions", 0) or 0) if sink else learned_positions(model)
        stores_logits = getattr(model, "sink_logits", None) is not None
        return cls(type(model).__name__, sink, int(limit), stores_logits, model.get_input_embeddings())


@dataclass
class SinkState:
    """What the first call of a cache leaves for the calls that continue it (kept on the cache as ``sink_state``)."""

    in_input: bool = False  # the first call's input started with the sink: its masks and positions count it
    row_offset: Optional[torch.Tensor] = None  # per-row left padding of the first call (positions not given)
    mask_order: Optional[torch.Tensor] = None  # caller's column of each cache column (left-padded sink-first input)


@dataclass
class SinkRestore:
    """What the output of a call whose input carried the sink needs to line up with that input again."""

    keep: torch.Tensor  # [batch, length]: True at the columns the base model computed, False at the sink's
    keep_logits: Any  # the caller's logits_to_keep still to apply; None when the base model applied it
    labels: Optional[torch.Tensor]  # the caller's labels, over every column (the loss is computed on the full row)

    def sink_columns(self) -> torch.Tensor:
        """``[batch, n]``: the caller's columns of the sink in each row."""
        batch, length = self.keep.shape
        return torch.arange(length, device=self.keep.device).expand(batch, -1)[~self.keep].view(batch, -1)


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


def read_input(
    contract: SinkContract, kwargs: dict, past: int, state: Optional[SinkState] = None
) -> tuple[SinkState, Optional[SinkRestore]]:
    """Rewrite one call's keyword inputs, in place, into what the base model computes after the stored sink.

    ``past``: the columns the cache holds before this call, the sink's included; ``state``: None for a fresh call
    (the cache holds the sink alone), else what the fresh call returned. Returns the state for the calls that
    continue the cache and, when the input carried the sink, what its output needs to line up with it again
    (``SinkRestore``: ``folded_sink.finish_sink_call`` puts the sink's stored logits, hidden states and attentions
    back in its columns).

    - A fresh call either starts every row with the sink tokens, as a tokenizer that adds BOS gives them, or with
      their embeddings in ``inputs_embeds``, as the tapered model takes them (at each row's first attended column
      under left padding): those columns are dropped and stand for the stored ones
      (positions count from the sink, the sink's logits come back from the stored ones; given ``position_ids`` that
      put the sink elsewhere than at 0 are refused: its states are stored as computed there); or it is the text
      alone: positions count from the first text token, and a mask may leave out the sink's columns.
    - A mask (2D ``[batch, keys]`` or 4D ``[batch, heads, queries, keys]``, boolean or additive) one sink shorter
      than cache + input counts without the sink: the sink's columns are put in front, attended by every query.
    - Without ``position_ids``, each left-padded row counts from its own first token, as ``generate()`` does; the
      pads before it get position 0 (they are masked, and a learned position table has no negative rows).
    - ``token_type_ids`` (GPT-2) are refused: they would change the sink's embedding, whose states the export stores
      as computed without them, so no call with them could give the tapered model's answer.
    - A call that reaches past a learned position table is refused (``max_positions``; an export without a sink
      refuses it too, with ``check_plain_call``): past the largest of the positions it is computed at (the sink's
      counted), so a left-padded row's pads do not count.
    """
    if contract.token_ids and kwargs.get("token_type_ids") is not None:
        raise ValueError(
            f"{contract.owner}: token_type_ids would change the embedding of the sink {list(contract.token_ids)}, "
            "whose states this export stores as computed without them; pass no token_type_ids"
        )
    continued = state is not None
    inputs = kwargs.get("input_ids")
    if inputs is None:
        inputs = kwargs["inputs_embeds"]
    _check_shape(contract, inputs, "input_ids" if kwargs.get("input_ids") is not None else "inputs_embeds")
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
            batch, length = _input_of(kwargs).shape[:2]
            if length == 0:  # the model would run on no token: say what to do instead of a reshape error
                raise ValueError(
                    f"the input is only the stored sink {list(contract.token_ids)}: its logits are stored "
                    "(model.sink_logits) and the model reads the text after it; pass at least one token after the sink"
                )
        # Where each cache column came from in the caller's columns, when the sink was not in front of every row.
        state = SinkState(columns is not None, offset, order if padding is not None else None)
        counts_without_sink, order = columns is None, None
    else:
        counts_without_sink, order = not state.in_input, state.mask_order
    mask = kwargs.get("attention_mask")
    if mask is not None and mask.dim() in (2, 4):
        counts_without_sink = mask.shape[-1] == past + length - n
        if counts_without_sink and n:
            kwargs["attention_mask"] = _with_sink_columns(mask, n)
        elif order is not None and mask.shape[0] == order.shape[0] and mask.shape[-1] >= order.shape[1]:
            # The caller's mask has each left-padded row's sink after its pads; the cache has it first.
            kwargs["attention_mask"] = _reorder_keys(mask, order)
    if continued and not state.in_input and state.row_offset is not None and mask is not None and mask.dim() in (2, 4):
        # A row all padding in the first call has its first token later: its padding is counted on the whole mask.
        text = mask[..., n:] if mask.shape[-1] == past + length else mask  # the text's columns, the sink's left out
        if text.shape[-1] == past - n + length and text.shape[0] == state.row_offset.shape[0]:
            state.row_offset = _leading_padding(_attended(text)).to(state.row_offset.device)
    positions = kwargs.get("position_ids")
    if positions is not None:
        if counts_without_sink and n:
            kwargs["position_ids"] = positions + n
    elif state.row_offset is not None and state.row_offset.shape[0] == batch:
        steps = torch.arange(past, past + length, device=state.row_offset.device)
        kwargs["position_ids"] = (steps[None, :] - state.row_offset[:, None]).clamp(min=0)
    check_positions(contract, kwargs.get("position_ids"), past + length)
    return state, restore


def check_plain_call(model: nn.Module, limit: int, args: tuple, kwargs: dict) -> None:
    """Refuse a call of an export without a stored sink that reaches past its learned position table of ``limit``
    rows (``check_positions``, as ``read_input`` refuses it for a sink export): its base class would fail in
    ``torch.embedding`` with an IndexError that names neither the table nor the call. The positions it reads are
    its ``position_ids`` where given (``generate()`` gives them from the mask), else the cache's and the input's
    columns."""
    inputs = args[0] if args else kwargs.get("input_ids")
    if inputs is None:
        inputs = kwargs.get("inputs_embeds")
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    past = cache.get_seq_length() if hasattr(cache, "get_seq_length") else 0
    if inputs is not None and inputs.dim() >= 2:
        contract = SinkContract(type(model).__name__, max_positions=limit)
        check_positions(contract, kwargs.get("position_ids"), past + inputs.shape[1])


def check_positions(contract: SinkContract, positions: Optional[torch.Tensor], end: int) -> None:
    """Refuse a call whose positions reach past the contract's learned position table: one past its largest
    position where ``positions`` are given (a left-padded row starts at 0 after its pads), else ``end`` (the cache's
    columns and the input's). One max over the positions, only where there is a table."""
    if contract.max_positions and positions is not None and positions.numel():
        end = int(positions.max()) + 1
    _check_positions(contract, end)


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
    """Per row, the first column a 2D or 4D ``attention_mask`` over ``length`` columns attends (None without one);
    ``length`` for a row it does not attend at all (all padding so far: its first token comes in a later call)."""
    mask = kwargs.get("attention_mask")
    if mask is None or mask.dim() not in (2, 4) or mask.shape[-1] != length:
        return None
    return _leading_padding(_attended(mask))


def _leading_padding(attended: torch.Tensor) -> torch.Tensor:
    """Per row of a ``[batch, columns]`` boolean, the columns before its first True (all of them where it has none)."""
    first = attended.int().argmax(dim=1)
    return torch.where(attended.any(dim=1), first, torch.full_like(first, attended.shape[1]))


def _input_of(kwargs: dict) -> torch.Tensor:
    """The call's ``input_ids``, else its ``inputs_embeds``."""
    ids = kwargs.get("input_ids")
    return ids if ids is not None else kwargs["inputs_embeds"]


def _sink_columns(contract: SinkContract, kwargs: dict) -> Optional[torch.Tensor]:
    """Columns ``[batch, n]`` of a leading sink in ``input_ids`` (at each row's first attended column), or in
    ``inputs_embeds`` (the sink's own embeddings, exactly, as the tapered model takes them), else None.

    A tokenizer that adds BOS puts the sink in the input itself; those tokens are then the stored ones.
    Every row starts with the sink or none does: a batch that mixes both has no single meaning. Text that
    itself starts with the sink id (an EOS sink after a document boundary) is read as starting with the
    sink, as the tapered model reads position 0: pass the sink first to say so without doubt.
    """
    ids, sink = _input_of(kwargs), contract.token_ids
    embedded = kwargs.get("input_ids") is None
    if not sink or ids.dim() != (3 if embedded else 2) or ids.shape[1] < len(sink):
        return None
    if embedded and contract.input_embeddings is None:
        return None
    start = _first_attended(kwargs, ids.shape[1])
    if start is None:
        start = torch.zeros(ids.shape[0], dtype=torch.long, device=ids.device)
    columns = (start[:, None] + torch.arange(len(sink), device=ids.device)).clamp(max=ids.shape[1] - 1)
    if embedded:
        table = contract.input_embeddings
        with torch.no_grad():  # the module's own output (some scale it), as a caller's inputs_embeds hold it
            embedded_sink = table(torch.tensor(sink, device=table.weight.device))
        leading = ids.gather(1, columns[..., None].expand(-1, -1, ids.shape[-1]))
        found = leading.eq(embedded_sink.to(ids.device, ids.dtype)).flatten(1).all(dim=1)
    else:
        found = ids.gather(1, columns).eq(torch.tensor(sink, device=ids.device)).all(dim=1)
    padding_only = start >= ids.shape[1]  # rows whose text comes in a later call: they start with nothing yet
    found &= ~padding_only
    if not bool(found.any()):
        return None
    if bool(padding_only.any()):
        rows = padding_only.nonzero().flatten().tolist()
        raise ValueError(
            f"{contract.owner}: row(s) {rows} of this call are all padding while the others start with the sink "
            f"token(s) {list(sink)}, so their sink would come in a later call, after the cache began; give every "
            "row's first tokens in the first call (the whole prompt in one call), or leave the sink out of the input"
        )
    if not bool(found.all()):
        raise ValueError(
            f"{contract.owner}: some rows of {'inputs_embeds' if embedded else 'input_ids'} start with the sink "
            f"token(s) {list(sink)} and others do not; "
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


def _take_sink_from_input(
    contract: SinkContract, kwargs: dict, columns: torch.Tensor
) -> tuple[torch.Tensor, SinkRestore]:
    """Drop the sink's columns from a fresh call's inputs (ids, mask rows and columns, positions, labels).

    Returns the caller's column of every cache column (``[batch, n + length]``: the sink's first, then the
    rest) and what the output needs to line up with the input again.
    """
    key = "input_ids" if kwargs.get("input_ids") is not None else "inputs_embeds"
    ids = kwargs[key]
    batch, length = ids.shape[:2]
    n = columns.shape[1]
    labels = kwargs.pop("labels", None)
    if labels is not None and not contract.has_logits:
        raise ValueError(
            f"{contract.owner}: input_ids start with the sink token(s) {list(contract.token_ids)}, whose logits this "
            "export (from an earlier hf_tapernorm) does not store, so a loss over them cannot be computed; pass the "
            "text and its labels without the sink (tokenizer(..., add_special_tokens=False)) or fold the model again"
        )
    keep = torch.ones(batch, length, dtype=torch.bool, device=ids.device).scatter_(1, columns, False)
    kept = torch.arange(length, device=ids.device).expand(batch, -1)[keep].view(batch, -1)
    order = torch.cat([columns, kept], dim=1)
    kwargs[key] = _drop_columns(ids, keep)
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
        # The stored keys sit at positions 0..n-1: each row counts from its own first sink token (pads before it: 0).
        counted = torch.arange(length, device=ids.device).expand(batch, -1)
        kwargs["position_ids"] = _drop_columns(counted - columns[:, :1], keep).clamp(min=0)
    elif positions.dim() in (1, 2):  # one row (1D, as GPT-2 takes it, or [1, L]) stands for every row
        if positions.shape[-1] != length:
            raise ValueError(
                f"{contract.owner}: position_ids hold {positions.shape[-1]} positions for {length} input columns; "
                "give one position per column, or pass no position_ids"
            )
        positions = positions.reshape(1, -1) if positions.dim() == 1 else positions
        positions = positions.expand(batch, -1) if positions.shape[0] != batch else positions
        _check_sink_positions(contract, positions, columns)
        kwargs["position_ids"] = _drop_columns(positions, keep).clamp(min=0)  # pads before the sink: 0, masked
    keep_logits = kwargs.get("logits_to_keep", 0)
    # The last k columns come out of the model unchanged when no row's sink is among them.
    passes = isinstance(keep_logits, int) and keep_logits > 0 and length - keep_logits > int(columns.max())
    if not passes:
        kwargs["logits_to_keep"] = 0
    return order, SinkRestore(keep, None if passes else keep_logits, labels)


def _check_sink_positions(contract: SinkContract, positions: torch.Tensor, columns: torch.Tensor) -> None:
    """Refuse given ``position_ids`` that put a row's sink elsewhere than at 0..n-1: the export stores the sink's
    states as computed there, so no other position can be honoured, and counting the text from it silently drops
    the caller's offset. ``generate()`` gives the sink 0 in every row (its positions count the mask)."""
    n = columns.shape[1]
    given = positions.gather(1, columns)
    wrong = given.ne(torch.arange(n, device=given.device)).any(dim=1)
    if bool(wrong.any()):
        row = int(wrong.nonzero()[0])
        at = given[row].tolist()
        where = f"position {at[0]}" if n == 1 else f"positions {at}"
        stored = "position 0" if n == 1 else f"positions 0..{n - 1}"
        raise ValueError(
            f"{contract.owner}: position_ids put the stored sink {list(contract.token_ids)} at {where} in row {row}; "
            f"this export stores its states at {stored}: count positions from the sink (0), or pass no position_ids"
        )


def _check_shape(contract: SinkContract, inputs: torch.Tensor, name: str) -> None:
    """Refuse inputs that are not ``[batch, seq]`` ids (``[batch, seq, hidden]`` embeddings): every column the
    contract reads (a leading sink, a mask's columns, positions) is a column of one row."""
    rank = 2 if name == "input_ids" else 3
    if inputs.dim() != rank:
        shape = "[batch, seq]" if rank == 2 else "[batch, seq, hidden]"
        raise ValueError(
            f"{contract.owner}: {name} must be {shape}, got shape {list(inputs.shape)}; pass one sequence as a "
            "batch of one (ids[None], or [ids])"
        )


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
