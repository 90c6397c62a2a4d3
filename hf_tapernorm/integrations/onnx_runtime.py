"""A causal LM (a folded export, or any transformers causal LM) as one ONNX graph with its KV cache, run in
ONNX Runtime.

The graph is the model's own forward (``torch.onnx.export``, the dynamo exporter) called with an explicit
cache: inputs ``input_ids`` [batch, seq], ``attention_mask`` [batch, past + seq], ``position_ids``
[batch, seq] and ``past.{i}.key``/``past.{i}.value`` [batch, kv_heads, past, head_dim] per layer; outputs
``logits`` and ``present.{i}.key``/``present.{i}.value``. The same graph prefills and decodes.

A folded export's stored sink is the start of every cache: ``OnnxCausalLM`` feeds the sink keys/values
(``sink.npz``, written next to the graph) as the first past, its columns unmasked, and counts positions from
the sink as the export does; the text is passed without the sink tokens. A model without a sink starts
from one zero column masked out (the graph's past length is at least 1). The export's forward hooks are
bypassed while tracing (the class's ``forward`` is called directly): the graph takes the cache as given.

Batches are unpadded (every row the same length); greedy decoding is ``OnnxCausalLM.generate``.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel

from ..errors import ConfigurationError
from .exports import load_export
from .extras import require

logger = logging.getLogger(__name__)

FEATURE = "hf_tapernorm.integrations.onnx_runtime (ONNX Runtime)"
GRAPH_NAME = "model.onnx"
LAYOUT_NAME = "onnx_layout.json"
SINK_NAME = "sink.npz"
MAX_LENGTH = 1 << 16  # the largest past + seq the exported dynamic shapes admit


class _CachedForward(nn.Module):
    """The model's forward with the cache as flat tensors in and out (what an ONNX graph can carry)."""

    def __init__(self, model: PreTrainedModel, layers: int) -> None:
        super().__init__()
        self.model, self.layers = model, layers

    def forward(self, input_ids, attention_mask, position_ids, *past: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cache = DynamicCache(config=self.model.config)
        for index in range(self.layers):
            cache.update(past[2 * index], past[2 * index + 1], index)
        # The class's forward, not the module's __call__: a folded export's sink hooks must not add the sink again.
        out = type(self.model).forward(
            self.model,
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=True,
        )
        present = [tensor for layer in out.cache.layers[: self.layers] for tensor in (layer.keys, layer.values)]
        return (out.logits, *present)


def _cache_layout(model: PreTrainedModel) -> dict[str, int]:
    """Layers, kv heads and head size of the model's cache, read off one forward of two tokens."""
    ids = torch.zeros(1, 2, dtype=torch.long, device=next(model.parameters()).device)
    with torch.no_grad():
        cache = type(model).forward(model, input_ids=ids, use_cache=True).cache
    keys = cache.layers[0].keys
    return {"layers": len(cache.layers), "kv_heads": int(keys.shape[1]), "head_dim": int(keys.shape[3])}


def export_onnx(source: Union[str, os.PathLike, PreTrainedModel], output_dir: Union[str, os.PathLike]) -> Path:
    """Export ``source`` (a folded export's folder, a folded model, or any causal LM) to ``output_dir``:
    ``model.onnx``, ``onnx_layout.json`` (the cache layout) and, for an export with a sink, ``sink.npz``.

    Returns the folder. Refuses a non-empty folder (an earlier graph would be mixed with this one's files).
    """
    require("onnxscript", FEATURE)  # the dynamo exporter translates through onnxscript
    numpy = require("numpy", FEATURE)
    model = load_export(source) if not isinstance(source, PreTrainedModel) else source.eval()
    folder = Path(output_dir)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ConfigurationError(f"cannot export ONNX into '{folder}': it exists and is not an empty folder")
    folder.mkdir(parents=True, exist_ok=True)
    layout = _cache_layout(model)
    sink = bool(getattr(model.config, "sink_token_ids", None))
    layout.update(sink_positions=int(model.sink_keys.shape[2]) if sink else 0, vocab_size=_vocab(model))
    device = next(model.parameters()).device
    dtype = model.get_input_embeddings().weight.dtype
    batch, seq, past = 2, 3, 4
    example = (
        torch.zeros(batch, seq, dtype=torch.long, device=device),
        torch.ones(batch, past + seq, dtype=torch.long, device=device),
        torch.arange(past, past + seq, device=device).expand(batch, -1).contiguous(),
        *[
            torch.zeros(batch, layout["kv_heads"], past, layout["head_dim"], dtype=dtype, device=device)
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
    if sink:
        numpy.savez(
            folder / SINK_NAME,
            keys=model.sink_keys.detach().float().cpu().numpy(),
            values=model.sink_values.detach().float().cpu().numpy(),
        )
    (folder / LAYOUT_NAME).write_text(json.dumps(layout, indent=2) + "\n")
    logger.info("exported %s to %s", type(model).__name__, folder / GRAPH_NAME)
    return folder


def _vocab(model: PreTrainedModel) -> int:
    return int(model.config.get_text_config().vocab_size)


class OnnxCausalLM:
    """An ``export_onnx`` folder in an ONNX Runtime session: logits of unpadded batches, greedy decoding.

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
        folder = Path(folder)
        if not (folder / GRAPH_NAME).is_file() or not (folder / LAYOUT_NAME).is_file():
            raise ConfigurationError(f"'{folder}' holds no {GRAPH_NAME} and {LAYOUT_NAME}: export it with export_onnx")
        self.folder = folder
        self.layout = json.loads((folder / LAYOUT_NAME).read_text())
        options = ort.SessionOptions()
        if threads is not None:
            options.intra_op_num_threads = threads
        if optimized_path is not None:
            options.optimized_model_filepath = str(optimized_path)
        self.session = ort.InferenceSession(str(folder / GRAPH_NAME), options, providers=["CPUExecutionProvider"])
        self.past_names = [i.name for i in self.session.get_inputs() if i.name.startswith("past.")]
        self.dtype = self.np.float32
        self.sink = None
        if self.layout["sink_positions"]:
            with self.np.load(folder / SINK_NAME) as stored:
                self.sink = (stored["keys"].astype(self.dtype), stored["values"].astype(self.dtype))

    def start(self, batch: int) -> dict[str, Any]:
        """The state before any text: the sink's keys/values (positions counted from it), else one masked column."""
        np = self.np
        if self.sink is not None:
            keys, values = self.sink
            n = keys.shape[2]
            past = [
                np.ascontiguousarray(np.broadcast_to(t[i], (batch, *t[i].shape)))
                for i in range(len(keys))
                for t in (keys, values)
            ]
            return {"past": past, "mask": np.ones((batch, n), dtype=np.int64), "position": n}
        shape = (batch, self.layout["kv_heads"], 1, self.layout["head_dim"])
        past = [np.zeros(shape, dtype=self.dtype) for _ in self.past_names]
        return {"past": past, "mask": np.zeros((batch, 1), dtype=np.int64), "position": 0}

    def forward(self, input_ids: Any, state: Optional[dict[str, Any]] = None) -> tuple[Any, dict[str, Any]]:
        """Logits [batch, seq, vocab] of ``input_ids`` after ``state`` (default: ``start``), and the next state."""
        np = self.np
        ids = np.asarray(input_ids, dtype=np.int64)
        batch, length = ids.shape
        state = state or self.start(batch)
        mask = np.concatenate([state["mask"], np.ones((batch, length), dtype=np.int64)], axis=1)
        positions = np.broadcast_to(np.arange(state["position"], state["position"] + length), (batch, length))
        feed = {"input_ids": ids, "attention_mask": mask, "position_ids": np.ascontiguousarray(positions)}
        feed.update(zip(self.past_names, state["past"]))
        logits, *present = self.session.run(None, feed)
        return logits, {"past": present, "mask": mask, "position": state["position"] + length}

    def generate(self, input_ids: Any, max_new_tokens: int) -> Any:
        """Greedy continuation: ``input_ids`` followed by ``max_new_tokens`` argmax tokens (KV-cached)."""
        np = self.np
        ids = np.asarray(input_ids, dtype=np.int64)
        logits, state = self.forward(ids)
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
    folder = Path(folder)
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
