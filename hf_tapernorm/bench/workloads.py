"""What is timed: one unit of work per variant, split into an untimed ``prepare`` and a timed ``run``.

The split lets decoding be timed without its prefill, and lets every workload be driven by the same
interleaving loop (measure.py), ONNX Runtime's (``OrtLogits``, ``OrtDecode``) with torch's. The training
workloads live in train_workloads.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import nn
from transformers import DynamicCache, StaticCache

from .arguments import Case


class Workload:
    """``prepare()`` builds the untimed state (e.g. the prefilled cache), ``run(state)`` is timed.

    ``steps`` is the number of model forwards in one ``run``: operation counts are per forward.
    """

    steps = 1

    def prepare(self) -> Any:
        return None

    def run(self, state: Any) -> torch.Tensor:
        raise NotImplementedError


class Logits(Workload):
    """One forward without a cache: the logits of every position, or of the last one only."""

    def __init__(self, call: Callable, ids: torch.Tensor, last_only: bool) -> None:
        self.call, self.ids, self.keep = call, ids, 1 if last_only else 0

    @torch.no_grad()
    def run(self, state: Any) -> torch.Tensor:
        return self.call(input_ids=self.ids, use_cache=False, logits_to_keep=self.keep).logits


class Decode(Workload):
    """Greedy decoding with a KV cache: a dynamic cache in eager mode, a static one when compiled
    (a static cache keeps shapes fixed, so the compiled step is one graph without breaks)."""

    def __init__(self, model: nn.Module, call: Callable, ids: torch.Tensor, new_tokens: int, static: bool) -> None:
        self.model, self.call, self.ids, self.steps, self.static = model, call, ids, new_tokens, static
        length = ids.shape[1]
        self.positions = [torch.tensor([[length + i]], device=ids.device) for i in range(new_tokens)]

    @torch.no_grad()
    def prepare(self) -> tuple[Any, torch.Tensor]:
        config = self.model.config
        if self.static:
            cache = StaticCache(config=config, max_cache_len=self.ids.shape[1] + self.steps)
        else:
            cache = DynamicCache(config=config)
        out = self.call(input_ids=self.ids, cache=cache, use_cache=True, logits_to_keep=1)
        return cache, out.logits[:, -1:].argmax(-1)

    @torch.no_grad()
    def run(self, state: tuple[Any, torch.Tensor]) -> torch.Tensor:
        cache, token = state
        tokens = []
        for position in self.positions:
            out = self.call(input_ids=token, position_ids=position, cache=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            tokens.append(token)
        return torch.cat(tokens, 1)


class OrtLogits(Workload):
    """One ONNX Runtime forward of the whole batch from the start state (the graph returns every position's
    logits; ``last`` and ``full`` differ only in what torch computes)."""

    def __init__(self, runtime: Any, ids: torch.Tensor) -> None:
        self.runtime, self.ids = runtime, ids.cpu().numpy()

    def run(self, state: Any) -> Any:
        return self.runtime.forward(self.ids)[0]


class OrtDecode(Workload):
    """Greedy decoding in ONNX Runtime with its KV cache; the prefill is untimed, as in ``Decode``."""

    def __init__(self, runtime: Any, ids: torch.Tensor, new_tokens: int) -> None:
        self.runtime, self.ids, self.steps = runtime, ids.cpu().numpy(), new_tokens

    def prepare(self) -> tuple[Any, Any]:
        logits, state = self.runtime.forward(self.ids)
        return state, logits[:, -1:].argmax(-1)

    def run(self, state: tuple[Any, Any]) -> Any:
        cache, token = state
        tokens = []
        for _ in range(self.steps):
            logits, cache = self.runtime.forward(token, cache)
            token = logits[:, -1:].argmax(-1)
            tokens.append(token)
        return tokens


def onnx_workload(runtime: Any, case: Case, ids: torch.Tensor) -> Workload:
    """The ONNX Runtime workload of an inference mode for one exported variant (``OnnxCausalLM``)."""
    if case.mode == "decode":
        return OrtDecode(runtime, ids, case.new_tokens)
    return OrtLogits(runtime, ids)


def compiled(model: nn.Module, options: Optional[dict[str, Any]]) -> Callable:
    """``torch.compile(model, **options)``, or the model itself (eager) when ``options`` is None."""
    return model if options is None else torch.compile(model, **options)


def inference_workload(
    model: nn.Module, case: Case, ids: torch.Tensor, compile_options: Optional[dict[str, Any]]
) -> Workload:
    """The workload of an inference mode (``last``, ``full``, ``decode``) for one variant."""
    call = compiled(model, compile_options)
    if case.mode == "decode":
        return Decode(model, call, ids, case.new_tokens, static=case.compiled)
    return Logits(call, ids, last_only=case.mode == "last")


__all__ = [
    "Decode",
    "Logits",
    "OrtDecode",
    "OrtLogits",
    "Workload",
    "compiled",
    "inference_workload",
    "onnx_workload",
]
