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


@torch.no_grad()
def heldout_loss(
    model: nn.Module,
    blocks: torch.Tensor,
    *,
    batch_size: int = 4,
    desc: str = "evaluating",
    device: Optional[torch.device] = None,
) -> dict[str, float]:
    """Token-weighted mean next-token cross-entropy over ``blocks`` (``[n, block_size]`` ids).

    Returns ``{"loss", "perplexity", "tokens"}``; ``tokens`` counts predicted tokens
    (``block_size - 1`` per block). The model is put in eval mode and left there.
    """
    if blocks.dim() != 2 or blocks.shape[0] == 0:
        raise ValueError(f"expected a non-empty [n, block_size] tensor of token ids, got shape {tuple(blocks.shape)}")
    model.eval()
    device = device or next(model.parameters()).device
    total, count = 0.0, 0
    for start in tqdm(range(0, blocks.shape[0], batch_size), desc=desc, unit="batch", leave=False):
        ids = blocks[start : start + batch_size].to(device)
        logits = model(input_ids=ids).logits[:, :-1].float()
        targets = ids[:, 1:]
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
        total += float(loss)
        count += targets.numel()
    mean = total / count
    return {"loss": mean, "perplexity": math.exp(min(mean, 700.0)), "tokens": count}
