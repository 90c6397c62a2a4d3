"""Held-out loss and perplexity of any causal LM on packed blocks (plain cross-entropy, eval mode).

One function for every model kind the CLI compares (original, normalized baseline, tapered at
g = 0, folded export), so their numbers differ only by the model.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn
from tqdm.auto import tqdm

from ..layers.sink import check_sink_first


@torch.no_grad()
def heldout_loss(
    model: nn.Module,
    blocks: torch.Tensor,
    *,
    batch_size: int = 4,
    desc: str = "evaluating",
    device: Optional[torch.device] = None,
    prefix_length: int = 0,
) -> dict[str, float]:
    """Token-weighted mean next-token cross-entropy over ``blocks`` (``[n, block_size]`` ids).

    Returns ``{"loss", "perplexity", "tokens"}``; ``tokens`` counts predicted tokens
    (``block_size - 1`` per block). The model is put in eval mode and left there.

    ``prefix_length`` > 0: every block starts with that many sink tokens, and only the text tokens
    after the first are targets (``block_size - prefix_length - 1`` per block), the same for every
    model. A folded model that holds the sink itself (``config.sink_token_ids``) reads the same blocks
    (their leading sink stands for its stored one), so the sink must equal the blocks' prefix.
    """
    if blocks.dim() != 2 or blocks.shape[0] == 0:
        raise ValueError(f"expected a non-empty [n, block_size] tensor of token ids, got shape {tuple(blocks.shape)}")
    trained_sink = getattr(getattr(model, "tapernorm_config", None), "sink_token_ids", None)
    if trained_sink:  # a patched model with a sink: every block must start with it
        check_sink_first(blocks, trained_sink, "heldout_loss")
    held_sink = list(getattr(getattr(model, "config", None), "sink_token_ids", None) or [])
    if held_sink and (prefix_length != len(held_sink) or blocks[:, :prefix_length].ne(torch.tensor(held_sink)).any()):
        raise ValueError(
            f"{type(model).__name__} holds the sink token(s) {held_sink} as a cache prefix, so the held-out blocks "
            f"must start with exactly them (got prefix_length={prefix_length}, first block starts "
            f"{blocks[0, : len(held_sink)].tolist()})"
        )
    model.eval()
    device = device or next(model.parameters()).device
    total, count = 0.0, 0
    for start in tqdm(range(0, blocks.shape[0], batch_size), desc=desc, unit="batch", leave=False):
        ids = blocks[start : start + batch_size].to(device)
        logits = model(input_ids=ids).logits[:, prefix_length:-1].float()
        targets = ids[:, prefix_length + 1 :]
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
        total += float(loss)
        count += targets.numel()
    mean = total / count
    return {"loss": mean, "perplexity": math.exp(min(mean, 700.0)), "tokens": count}
