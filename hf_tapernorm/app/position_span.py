"""Training blocks whose positions span more than their tokens: the distances of long inputs at a short block's cost.

Why: the taper trains on short blocks (128 tokens by default) and users feed the model its whole context. A
rotary-position model sees positions only as distances between a query and a key, so a model tapered on short
blocks has never adapted what its attention does at long distances, and long inputs cost it more than short
ones (docs/fidelity.md, "Longer inputs still cost"). Training on long blocks costs what their tokens cost. This
follows PoSE (Zhu et al., 2023, "Efficient Context Window Extension of LLMs via Positional Skip-wise Training"):
each training block keeps its tokens, in order, and only its position ids change, so that its distances reach
``span``:

- the sink tokens keep positions ``0 .. n-1``;
- the text is cut at a random point into two parts, and two random skips, together at most
  ``span - block_size``, are added: one between the sink and the first part, one between the two parts.

Distances between the sink and the text, and between the two parts, then range up to ``span``; distances within
a part stay as they are. The teacher of the distillation reads the same positions, so the taper is shown the
normalized model's own behaviour at those distances. Skips are drawn per block from the run's seed and the
block's index: a resumed run, and the baseline that reads the same blocks, see the same positions.

Each block also carries an all-ones ``attention_mask``. Without a mask, transformers reads position ids that
jump as several sequences packed into one row (``masking_utils.find_packed_sequence_indices``) and would mask
attention between the parts; with one, the mask stays causal over the whole block.
"""

from __future__ import annotations

import datasets
import torch

from ..errors import ConfigurationError


def spread_positions(length: int, prefix_length: int, span: int, generator: torch.Generator) -> list[int]:
    """Position ids for one block of ``length`` tokens (``prefix_length`` of them sink tokens) spread over ``span``."""
    if span < length:
        raise ConfigurationError(f"--position_span {span} must be at least the block's {length} tokens")
    text = length - prefix_length
    room = span - length  # the most the two skips add together
    total = int(torch.randint(0, room + 1, (), generator=generator))
    first = int(torch.randint(0, total + 1, (), generator=generator))  # sink -> first part; the rest between parts
    cut = int(torch.randint(1, text, (), generator=generator)) if text > 1 else text
    positions = list(range(prefix_length))
    positions += [prefix_length + first + i for i in range(cut)]
    positions += [prefix_length + total + i for i in range(cut, text)]
    return positions


def with_spread_positions(dataset: datasets.Dataset, span: int, prefix_length: int, seed: int) -> datasets.Dataset:
    """``dataset``'s blocks with ``position_ids`` spread over ``span`` (see the module docstring) and an all-ones
    ``attention_mask``; block ``i``'s positions depend on ``seed`` and ``i`` alone."""

    def add(example: dict, index: int) -> dict:
        length = len(example["input_ids"])
        generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
        return {
            "position_ids": spread_positions(length, prefix_length, span, generator),
            "attention_mask": [1] * length,
        }

    spread = dataset.with_format(None).map(add, with_indices=True, desc="position spans", load_from_cache_file=False)
    return spread.with_format("torch")


__all__ = ["spread_positions", "with_spread_positions"]
