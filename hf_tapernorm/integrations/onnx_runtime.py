"""A causal LM (a folded export, or any transformers causal LM) as one ONNX graph with its KV cache, run in
ONNX Runtime.

The graph is the base model's forward (``torch.onnx.export``, the dynamo exporter) called with an explicit
cache, in fp32: inputs ``input_ids`` [batch, seq], ``attention_mask`` [batch, past + seq], ``position_ids``
[batch, seq] and ``past.{i}.key``/``past.{i}.value`` [batch, kv_heads, past, head_dim] per layer; outputs
``logits`` and ``present.{i}.key``/``present.{i}.value``. The same graph prefills and decodes.

The graph takes its cache and positions as given; what the export's own forward does around it (its stored
sink at the start of every cache, a leading sink in the input read as that sink, left padding, masks and
positions, its learned position table) ``OnnxCausalLM`` does with the export's own code
(``folded_input.read_input``, over the contract ``onnx_layout.json`` records), so both read one input alike;
what the graph cannot take (ids that are not ``[batch, seq]`` token ids of its vocabulary, a mask of another shape
than the call needs, a state of another batch) is refused in one line before ONNX Runtime sees it.
The sink's keys, values and logits are in ``sink.npz``. A model without a sink starts from one zero column
masked out (the graph's past length is at least 1).
"""

from __future__ import annotations

import copy
import errno
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel

from ..app.folder_writes import check_folder_destination
from ..app.run_folder import write_folder
from ..app.run_lock import refuse_while_running, resolved_path
from ..errors import ConfigurationError, first_line
from ..export.folded_input import SinkContract, check_positions, read_input
from ..export.folded_sink import restore_logits
from ..utils import expand_user, file_in_the_way
from .exports import base_class, load_export, local_path
from .extras import require

logger = logging.getLogger(__name__)

FEATURE = "hf_tapernorm.integrations.onnx_runtime (ONNX Runtime)"
GRAPH_NAME = "model.onnx"
LAYOUT_NAME = "onnx_layout.json"
SINK_NAME = "sink.npz"
MAX_LENGTH = 1 << 16  # the largest past + seq the exported dynamic shapes admit


class _CachedForward(nn.Module):
    """The base model's forward with the cache as flat tensors in and out (what an ONNX graph can carry).

    Every layer's cache keeps all its positions (a plain ``DynamicCache``), sliding-window layers included: a
    sliding layer's own cache drops what leaves its window and offsets its mask by a count the trace would bake in
    (Gemma 2's mixed sliding and full layers then read past the mask on a continued state). The window is applied
    by the mask alone, which sees exactly the positions the torch export's sliding cache keeps."""

    def __init__(self, model: PreTrainedModel, layers: int) -> None:
        super().__init__()
        self.model, self.layers = model, layers

    def forward(self, input_ids, attention_mask, position_ids, *past: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cache = DynamicCache()  # no config: no sliding layers (see the class docstring)
        for index in range(self.layers):
            cache.update(past[2 * index], past[2 * index + 1], index)
        out = _base_forward(
            self.model,
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=True,
        )
        present = [tensor for layer in out.cache.layers[: self.layers] for tensor in (layer.keys, layer.values)]
        return (out.logits, *present)


def _base_forward(model: PreTrainedModel, **kwargs: Any) -> Any:
    """The transformers class's forward: a folded export's own forward would put its stored sink in the cache
    again; here the cache (and the input contract, in ``OnnxCausalLM``) is given explicitly."""
    return base_class(model).forward(model, **kwargs)


def _cache_layout(model: PreTrainedModel) -> dict[str, int]:
    """Layers, kv heads and head size of the model's cache, read off one forward of two tokens."""
    ids = torch.zeros(1, 2, dtype=torch.long, device=next(model.parameters()).device)
    with torch.no_grad():
        cache = _base_forward(model, input_ids=ids, use_cache=True).cache
    keys = cache.layers[0].keys
    return {"layers": len(cache.layers), "kv_heads": int(keys.shape[1]), "head_dim": int(keys.shape[3])}


def _in_fp32(model: PreTrainedModel) -> PreTrainedModel:
    """The model in eval mode and fp32: ONNX Runtime's CPU kernels lack bf16 for several of the graph's operators,
    so a graph traced in bf16 would not run; a model in another dtype is copied (the caller's is left as it is)."""
    if all(p.dtype == torch.float32 for p in model.parameters()):
        return model.eval()
    logger.info("export_onnx: tracing an fp32 copy of %s (its weights are not fp32)", type(model).__name__)
    return copy.deepcopy(model).float().eval()


def export_onnx(source: Union[str, os.PathLike, PreTrainedModel], output_dir: Union[str, os.PathLike]) -> Path:
    """Export ``source`` (a folded export's folder, a folded model, or any causal LM's folder or model) to
    ``output_dir``: ``model.onnx`` (fp32, its weights in ``model.onnx.data``), ``onnx_layout.json`` (the cache
    layout and the input contract) and, for an export with a sink, ``sink.npz``.

    Returns the folder. Refuses, before loading anything, a name longer than its filesystem takes, a symbolic link
    loop or a file on the way to it, a ``..`` after a missing folder, a mount point (no rename replaces it), a path
    too long for its temporary files, a folder a running hf-tapernorm command holds (or one inside it), and a
    non-empty folder (an earlier graph would be mixed with this one's files). The files are written into a hidden
    sibling folder that is renamed to ``output_dir`` once whole (``write_folder``), so a failed export (a full
    disk) leaves no truncated graph under that name, and is one ConfigurationError naming the folder.
    """
    folder = local_path(output_dir)
    longest = max([GRAPH_NAME + ".data", LAYOUT_NAME, SINK_NAME], key=len)
    # A name too long, a mount point, a `..` after a missing folder: one line, not an OSError at the end.
    check_folder_destination(folder, f"cannot export ONNX into '{folder}'", inside=longest)
    resolved_path(folder, f"cannot export ONNX into '{folder}'")  # a symbolic link loop on the way: one line
    refuse_while_running(folder, f"cannot export ONNX into '{folder}'")  # a live run's folder is that run's
    blocking = file_in_the_way(folder)
    if blocking:
        raise ConfigurationError(f"cannot export ONNX into '{folder}': {blocking} is a file; choose a folder")
    if folder.is_dir() and any(folder.iterdir()):
        raise ConfigurationError(f"cannot export ONNX into '{folder}': it exists and is not an empty folder")
    require("onnx", FEATURE)  # torch.onnx.export writes through onnx, and translates through onnxscript
    require("onnxscript", FEATURE)
    numpy = require("numpy", FEATURE)
    model = _in_fp32(load_export(source, folded_only=False))
    try:
        write_folder(folder, lambda partial: _write_graph(model, partial, numpy))
    except OSError as error:
        full = error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # else the error itself says what is wrong
        advice = "free space (or choose another folder)" if full else "choose another folder"
        raise ConfigurationError(
            f"cannot export ONNX into '{folder}': {first_line(error)}; nothing was written there: {advice} and "
            "export again"
        ) from None
    logger.info("exported %s to %s", type(model).__name__, folder / GRAPH_NAME)
    return folder


def _write_graph(model: PreTrainedModel, folder: Path, numpy: Any) -> None:
    """Write ``export_onnx``'s files of ``model`` (fp32, eval mode) into ``folder`` (created)."""
    folder.mkdir(parents=True)
    layout = _cache_layout(model)
    contract = SinkContract.of(model)
    layout.update(
        sink_positions=len(contract.token_ids),
        sink_token_ids=list(contract.token_ids),
        max_positions=contract.max_positions,
        vocab_size=int(model.config.get_text_config().vocab_size),
    )
    device = next(model.parameters()).device
    batch, seq, past = 2, 3, 4
    example = (
        torch.zeros(batch, seq, dtype=torch.long, device=device),
        torch.ones(batch, past + seq, dtype=torch.long, device=device),
        torch.arange(past, past + seq, device=device).expand(batch, -1).contiguous(),
        *[
            torch.zeros(batch, layout["kv_heads"], past, layout["head_dim"], device=device)
            for _ in range(2 * layout["layers"])
        ],
    )
    dim = torch.export.Dim
    rows, length, cached = dim("batch", max=1024), dim("seq", max=MAX_LENGTH), dim("past", max=MAX_LENGTH)
    shapes = {
        "input_ids": {0: rows, 1: length},
        "attention_mask": {0: rows, 1: dim("total", min=2, max=2 * MAX_LENGTH)},
        "position_ids": {0: rows, 1: length},
        "past": tuple({0: rows, 2: cached} for _ in range(2 * layout["layers"])),
    }
    names = [f"past.{i}.{part}" for i in range(layout["layers"]) for part in ("key", "value")]
    outputs = ["logits", *(name.replace("past.", "present.") for name in names)]
    with torch.no_grad():
        torch.onnx.export(
            _CachedForward(model, layout["layers"]).eval(),
            example,
            str(folder / GRAPH_NAME),
            input_names=["input_ids", "attention_mask", "position_ids", *names],
            output_names=outputs,
            dynamic_shapes=shapes,
            dynamo=True,
            optimize=True,
        )
    if contract.token_ids:
        stored = {"keys": model.sink_keys, "values": model.sink_values}
        if contract.has_logits:
            stored["logits"] = model.sink_logits
        numpy.savez(folder / SINK_NAME, **{k: v.detach().float().cpu().numpy() for k, v in stored.items()})
    (folder / LAYOUT_NAME).write_text(json.dumps(layout, indent=2) + "\n")


class OnnxCausalLM:
    """An ``export_onnx`` folder in an ONNX Runtime session: logits and greedy decoding, reading its input as the
    torch export does (a leading sink, left padding with ``attention_mask``, its position table).

    ``threads``: the session's intra-op threads (default: ONNX Runtime's). ``optimized_path``: where ONNX
    Runtime writes the graph after its optimizations (to count its nodes).
    """

    def __init__(
        self,
        folder: Union[str, os.PathLike],
        *,
        threads: Optional[int] = None,
        optimized_path: Optional[Union[str, os.PathLike]] = None,
    ) -> None:
        ort = require("onnxruntime", FEATURE)
        self.np = require("numpy", FEATURE)
        folder = local_path(folder)
        if not (folder / GRAPH_NAME).is_file() or not (folder / LAYOUT_NAME).is_file():
            raise ConfigurationError(f"'{folder}' holds no {GRAPH_NAME} and {LAYOUT_NAME}: export it with export_onnx")
        self.folder = folder
        self.layout = json.loads((folder / LAYOUT_NAME).read_text())
        if self.layout["sink_positions"] and "sink_token_ids" not in self.layout:
            raise ConfigurationError(
                f"'{folder}' was exported by an earlier hf_tapernorm: {LAYOUT_NAME} does not name the sink tokens, so "
                "an input that starts with them would be read with the sink twice; export it again with export_onnx"
            )
        options = ort.SessionOptions()
        if threads is not None:
            options.intra_op_num_threads = threads
        if optimized_path is not None:
            options.optimized_model_filepath = str(expand_user(optimized_path, f"optimized_path '{optimized_path}'"))
        self.session = ort.InferenceSession(str(folder / GRAPH_NAME), options, providers=["CPUExecutionProvider"])
        self.past_names = [i.name for i in self.session.get_inputs() if i.name.startswith("past.")]
        self.dtype = self.np.float32
        self.sink, self.sink_logits = None, None
        if self.layout["sink_positions"]:
            with self.np.load(folder / SINK_NAME) as stored:
                self.sink = (stored["keys"].astype(self.dtype), stored["values"].astype(self.dtype))
                if "logits" in stored:
                    self.sink_logits = torch.from_numpy(stored["logits"].astype(self.dtype))
        self.contract = SinkContract(
            f"OnnxCausalLM('{folder}')",
            tuple(self.layout.get("sink_token_ids", ())),
            int(self.layout.get("max_positions", 0)),
            self.sink_logits is not None,
        )

    def start(self, batch: int) -> dict[str, Any]:
        """The state before any text: the sink's keys/values, else one masked zero column (the graph's past)."""
        np = self.np
        if self.sink is not None:
            keys, values = self.sink
            n = keys.shape[2]
            past = [
                np.ascontiguousarray(np.broadcast_to(t[i], (batch, *t[i].shape)))
                for i in range(len(keys))
                for t in (keys, values)
            ]
            return {"past": past, "mask": np.ones((batch, n), dtype=np.int64), "length": n, "sink": None}
        shape = (batch, self.layout["kv_heads"], 1, self.layout["head_dim"])
        past = [np.zeros(shape, dtype=self.dtype) for _ in self.past_names]
        return {"past": past, "mask": np.zeros((batch, 1), dtype=np.int64), "length": 0, "sink": None}

    def forward(
        self, input_ids: Any, state: Optional[dict[str, Any]] = None, attention_mask: Any = None
    ) -> tuple[Any, dict[str, Any]]:
        """Logits [batch, seq, vocab] of ``input_ids`` after ``state`` (default: ``start``), and the next state.

        ``input_ids`` may start with the sink (as a tokenizer that adds it gives them) or not, as for the torch
        export; ``attention_mask`` (optional, over the state's tokens and these, with or without the sink) marks
        padding.
        """
        return self._forward(input_ids, state, attention_mask, per_row=False)

    def _forward(
        self, input_ids: Any, state: Optional[dict[str, Any]], attention_mask: Any, per_row: bool
    ) -> tuple[Any, dict[str, Any]]:
        """:meth:`forward`; ``per_row``: a fresh call without a sink counts each left-padded row from its own first
        token, as ``generate()`` does (``forward`` counts columns then, as the torch export and transformers' own
        model do; with a sink both count per row, as the export's forward does). A continued state keeps the way
        its first call counted."""
        np = self.np
        kwargs = {"input_ids": torch.from_numpy(self._rows("input_ids", input_ids))}
        if attention_mask is not None:
            kwargs["attention_mask"] = torch.from_numpy(self._rows("attention_mask", attention_mask))
        state = state or self.start(kwargs["input_ids"].shape[0])
        self._check_batch(kwargs, state)
        past = state["length"]
        # The mask columns every call takes: the state's tokens and these, without the stored sink.
        needed = past - len(self.contract.token_ids) + kwargs["input_ids"].shape[1]
        given = kwargs["attention_mask"].shape[1] if "attention_mask" in kwargs else needed
        try:
            sink_state, restore = read_input(self.contract, kwargs, past, state["sink"])
        except ValueError as error:  # the export's own reading refused the input: the same words, one line
            raise ConfigurationError(str(error)) from None
        ids = kwargs["input_ids"].numpy()
        batch, length = ids.shape
        if "attention_mask" in kwargs and kwargs["attention_mask"].shape[1] != past + length:
            n = len(self.contract.token_ids)
            also = f" ({needed + n} counting the stored sink)" if n and state["sink"] is not None else ""
            raise ConfigurationError(
                f"{self.contract.owner}: attention_mask has {given} columns; it must cover the tokens the state holds "
                f"and these input_ids: {needed} columns{also}"
            )
        extra = 0 if self.sink is not None else 1  # the masked zero column of a graph without a sink
        if "attention_mask" in kwargs:
            mask = np.concatenate([state["mask"][:, :extra], kwargs["attention_mask"].numpy()], axis=1)
        else:
            mask = np.concatenate([state["mask"], np.ones((batch, length), dtype=np.int64)], axis=1)
        per_row = state.get("per_row", per_row) if state["length"] else per_row
        positions = kwargs.get("position_ids")
        if positions is None or not (self.sink is not None or per_row):
            positions = torch.arange(past, past + length).expand(batch, -1)
            self._check_columns(past + length)  # read_input checked the positions it counts per row
        feed = {"input_ids": ids, "attention_mask": mask, "position_ids": np.ascontiguousarray(positions.numpy())}
        feed.update(zip(self.past_names, state["past"]))
        logits, *present = self.session.run(None, feed)
        if restore is not None:
            logits = restore_logits(torch.from_numpy(logits), restore, self.sink_logits).numpy()
        return logits, {"past": present, "mask": mask, "length": past + length, "sink": sink_state, "per_row": per_row}

    def _check_columns(self, end: int) -> None:
        """Refuse a call fed at its columns (no sink, ``forward``) that reach past the position table, in the words
        of the torch export, which feeds transformers' GPT-2 its columns too."""
        try:
            check_positions(self.contract, None, end)
        except ValueError as error:
            raise ConfigurationError(str(error)) from None

    def _rows(self, name: str, values: Any) -> Any:
        """``values`` (``input_ids`` or ``attention_mask``) as an int64 ``[batch, columns]`` array, or a one-line
        refusal naming what the graph takes: 2-D integers with a column in each row, ids of its vocabulary.

        A 1-D sequence is refused, not read as one row: the logits and the state answer the batch given, as the
        torch export's forward does, so one sequence is passed as ``[ids]`` (what ``tokenizer(text)["input_ids"]``
        needs around it) and its logits come back as ``[1, seq, vocab]`` on purpose, not by a guess. A mask of
        another real dtype (bool, ``mask.float()``) holding only 0 and 1 is read as those integers, as the torch
        export reads it; any other value in it (0.5, NaN) is refused rather than rounded.
        """
        np, owner = self.np, self.contract.owner
        try:
            array = np.asarray(values)
        except ValueError as error:  # rows of unequal length
            raise ConfigurationError(f"{owner}: {name} must be [batch, seq] integers ({first_line(error)})") from None
        if name == "attention_mask" and array.dtype.kind == "f" and array.ndim == 2:
            if not np.isin(array, (0, 1)).all():
                wrong = array[~np.isin(array, (0, 1))].flat[0]
                raise ConfigurationError(
                    f"{owner}: attention_mask must hold 1 (a token) and 0 (padding), got {array.dtype} holding {wrong}"
                )
            array = array.astype(np.int64)
        if array.ndim != 2 or 0 in array.shape or array.dtype.kind not in "biu":
            advice = "; pass one sequence as a batch of one: [ids]" if array.ndim == 1 else ""
            raise ConfigurationError(
                f"{owner}: {name} must be [batch, seq] integers with a column in each row, got {array.dtype} of "
                f"shape {list(array.shape)}{advice}"
            )
        vocab = self.layout.get("vocab_size")
        if name == "input_ids" and vocab and (array.min() < 0 or array.max() >= vocab):
            raise ConfigurationError(
                f"{owner}: input_ids must be token ids of the model's vocabulary (0..{vocab - 1}), got ids from "
                f"{array.min()} to {array.max()}"
            )
        return array.astype(np.int64)

    def _check_batch(self, kwargs: dict[str, Any], state: dict[str, Any]) -> None:
        """Refuse a mask or a state (from ``start`` or an earlier ``forward``) for another number of rows."""
        rows, owner = kwargs["input_ids"].shape[0], self.contract.owner
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.shape[0] != rows:
            raise ConfigurationError(
                f"{owner}: attention_mask has {mask.shape[0]} row(s) and input_ids {rows}: give one mask row per row"
            )
        held = state["mask"].shape[0]
        if held != rows:
            raise ConfigurationError(
                f"{owner}: the state continues {held} row(s) and input_ids has {rows}: continue a state with as many "
                "rows as the call that made it, or start a new one (forward(ids) without a state)"
            )

    def generate(self, input_ids: Any, max_new_tokens: int, attention_mask: Any = None) -> Any:
        """Greedy continuation: ``input_ids`` (left padding marked by ``attention_mask``) followed by
        ``max_new_tokens`` argmax tokens (KV-cached); 0 returns the input.

        The ids go through ``forward``'s own check (``_rows``) before anything else, so what ``forward`` refuses
        (float ids, ragged rows) is refused here in the same words, never cast; a negative count is refused rather
        than read as nothing to generate."""
        np = self.np
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
            raise ConfigurationError(
                f"{self.contract.owner}: max_new_tokens must be a whole number of tokens, 0 or more, got "
                f"{max_new_tokens!r}"
            )
        ids = self._rows("input_ids", input_ids)
        logits, state = self._forward(ids, None, attention_mask, per_row=True)
        tokens = [ids]
        for step in range(max_new_tokens):
            token = logits[:, -1:].argmax(-1).astype(np.int64)
            tokens.append(token)
            if step + 1 < max_new_tokens:
                logits, state = self.forward(token, state)
        return np.concatenate(tokens, axis=1)


def node_counts(folder: Union[str, os.PathLike]) -> dict[str, int]:
    """Nodes of the exported graph, and of the graph ONNX Runtime runs after its optimizations."""
    onnx = require("onnx", FEATURE)
    folder = local_path(folder)
    exported = onnx.load(str(folder / GRAPH_NAME), load_external_data=False)
    with tempfile.TemporaryDirectory(prefix="hf_tapernorm_ort_") as work:
        optimized_path = Path(work) / "optimized.onnx"
        OnnxCausalLM(folder, optimized_path=optimized_path)
        optimized = onnx.load(str(optimized_path), load_external_data=False)
    return {"onnx_nodes": _nodes(exported), "ort_nodes": _nodes(optimized)}


def _nodes(model: Any) -> int:
    """Nodes of the main graph plus those inside the local functions it calls (the exporter may emit some)."""
    return len(model.graph.node) + sum(len(function.node) for function in model.functions)


__all__ = ["GRAPH_NAME", "LAYOUT_NAME", "SINK_NAME", "OnnxCausalLM", "export_onnx", "node_counts"]
