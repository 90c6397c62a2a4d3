"""What a run's report shows beyond the losses: operations per generated token, and greedy continuations.

Operations are aten calls counted with ``torch.profiler`` during cached decoding: they do not depend on
the machine's load, and on a GPU at small batch each one is a kernel launch, which is where removing
the per-token norms pays. The continuations put the models side by side on held-out prompts, so a
reader sees what a gap in cross-entropy means.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile
from transformers import DynamicCache


def count_aten_ops(run: Callable[[], Any], calls: int = 1) -> dict[str, float]:
    """aten operations per call of ``run`` (all, nested included, and top level: called from Python)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    top = [e for e in events if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    return {"aten_ops": len(events) / calls, "top_level_ops": len(top) / calls}


@torch.no_grad()
def ops_per_generated_token(model: nn.Module, prompt: torch.Tensor, new_tokens: int = 8) -> dict[str, float]:
    """aten ops of one cached greedy decoding step, averaged over ``new_tokens`` steps after an untimed prefill.

    ``prompt`` ([1, T]) starts with the sink tokens when the model has any: a folded model that holds them
    takes the leading sink for its stored one, so every model decodes the same text.
    """
    model.eval()
    cache = DynamicCache(config=model.config)
    token = model(input_ids=prompt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
    start = prompt.shape[1]

    def decode() -> None:
        nonlocal token
        for i in range(new_tokens):
            position = torch.tensor([[start + i]], device=prompt.device)
            token = model(input_ids=token, position_ids=position, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)

    return count_aten_ops(decode, calls=new_tokens)


@torch.no_grad()
def greedy_continuations(
    models: dict[str, nn.Module], prompts: torch.Tensor, tokenizer, *, new_tokens: int = 24, sink: Sequence[int] = ()
) -> list[dict[str, str]]:
    """For each prompt ([n, T], starting with ``sink``), the prompt text and each model's greedy continuation."""
    rows = []
    for prompt in prompts:
        text = prompt[len(sink) :]
        row = {"prompt": tokenizer.decode(text, skip_special_tokens=True)}
        for name, model in models.items():
            ids = prompt[None].to(next(model.parameters()).device)  # a folded model takes the sink for its stored one
            out = model.eval().generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.eos_token_id,
            )
            row[name] = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        rows.append(row)
    return rows


__all__ = ["count_aten_ops", "greedy_continuations", "ops_per_generated_token"]
