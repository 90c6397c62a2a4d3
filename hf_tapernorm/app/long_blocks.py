"""Training blocks of two lengths: every Nth optimizer step reads long blocks instead of the short ones.

Why: the taper trains on short blocks (128 tokens by default) and users feed the model its whole context.
Without its attention input norms the model has only seen the positions of a short block, and a long
input costs more than a short one (docs/fidelity.md, "Longer inputs still cost"). A few long steps show
the taper those positions for a fraction of what training every step at length would cost.

A batch stacks blocks of one length, so a long step is made of long blocks only. The Trainer batches a
map-style dataset in its sampler's shuffled order, which would mix the two lengths; the mix is therefore an
``IterableDataset`` (the Trainer reads it in order) that yields each optimizer step's blocks together:
per device x gradient accumulation x processes of them, all of one length. Under several processes
accelerate dispatches an iterable dataset's batches from the main process, taking one batch per process
for each micro-step, so every process's share of a step has the step's length.

The order is seeded (``seed``) and the same on every pass, so a resumed run, which the Trainer fast-forwards
by the steps it has trained, reads the blocks the interrupted one would have read.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Optional, Union

import datasets
import torch
from torch.utils.data import IterableDataset

from ..data.corpus import PackedData
from ..errors import ConfigurationError
from .position_span import with_spread_positions
from .record import global_batch_blocks


@dataclass(frozen=True)
class LengthMix:
    """Every ``every``-th optimizer step (the ``every``-th, the ``2 * every``-th, ...) reads blocks of ``long_size``
    tokens; the others blocks of ``short_size``."""

    short_size: int
    long_size: int
    every: int

    def __post_init__(self) -> None:
        if self.long_size <= self.short_size:
            raise ConfigurationError(
                f"--long_block_size {self.long_size} must be longer than --block_size {self.short_size} "
                "(0 turns the long steps off)"
            )
        if self.every < 2:
            raise ConfigurationError(
                f"--long_block_every must be at least 2, got {self.every} (every step long: raise --block_size)"
            )

    def is_long(self, step: int) -> bool:
        """Whether optimizer step ``step`` (0-based) reads long blocks."""
        return (step + 1) % self.every == 0

    def long_steps(self, steps: int) -> int:
        """How many of the first ``steps`` optimizer steps read long blocks."""
        return steps // self.every

    def tokens(self, steps: int, blocks_per_step: int) -> int:
        """The tokens ``steps`` optimizer steps read, each ``blocks_per_step`` blocks over every process."""
        long = self.long_steps(steps)
        return blocks_per_step * (long * self.long_size + (steps - long) * self.short_size)


def length_mix(data) -> Optional[LengthMix]:
    """The mix a command's data arguments ask for (``--long_block_size``, ``--long_block_every``), or None."""
    if not data.long_block_size:
        return None
    return LengthMix(data.block_size, data.long_block_size, data.long_block_every)


def training_blocks(data, steps: int, per_step: int) -> tuple[int, int]:
    """How many short and long blocks ``steps`` optimizer steps of ``per_step`` blocks read (``data``: the command's
    data arguments)."""
    mix = length_mix(data)
    long_steps = mix.long_steps(steps) if mix else 0
    return (steps - long_steps) * per_step, long_steps * per_step


def trained_tokens(data, steps: int, per_step: int) -> int:
    """The tokens ``steps`` optimizer steps of ``per_step`` blocks read, long steps counted at their length."""
    mix = length_mix(data)
    return mix.tokens(steps, per_step) if mix else steps * per_step * data.block_size


def training_dataset(data, training_args, packed: PackedData) -> Union[datasets.Dataset, MixedLengthBlocks]:
    """What the Trainer reads: the packed blocks (with ``--position_span``, their positions spread:
    app/position_span.py), or with long steps their mix, in the order of the Trainer's seed (``--data_seed``,
    else ``--seed``)."""
    seed = training_args.data_seed if training_args.data_seed is not None else training_args.seed
    short = packed.train
    if data.position_span:
        short = with_spread_positions(short, data.position_span, len(packed.prefix_ids), seed)
    mix = length_mix(data)
    if mix is None or packed.long_train is None:
        return short
    return MixedLengthBlocks(
        short, packed.long_train, mix, blocks_per_step=global_batch_blocks(training_args), seed=seed
    )


class MixedLengthBlocks(IterableDataset):
    """The training blocks of a run with long steps (see the module docstring): an endless stream of examples
    (``input_ids``, ``labels``), ``blocks_per_step`` at a time of one length, each set in a seeded order."""

    def __init__(
        self, short: datasets.Dataset, long: datasets.Dataset, mix: LengthMix, *, blocks_per_step: int, seed: int
    ) -> None:
        for name, dataset in (("short", short), ("long", long)):
            if len(dataset) < blocks_per_step:
                raise ConfigurationError(
                    f"the training set has {len(dataset)} {name} blocks, fewer than one step's {blocks_per_step}: "
                    "use more data or a smaller batch"
                )
        self.short, self.long, self.mix = short, long, mix
        self.blocks_per_step, self.seed = blocks_per_step, seed

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        streams = (_shuffled(self.short, self.seed), _shuffled(self.long, self.seed + 1))
        step = 0
        while True:
            source = streams[self.mix.is_long(step)]
            for _ in range(self.blocks_per_step):
                yield next(source)
            step += 1


def _shuffled(dataset: datasets.Dataset, seed: int) -> Iterator[dict[str, torch.Tensor]]:
    """The examples of ``dataset`` in a seeded order, reshuffled on every pass (as the Trainer's sampler does)."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        for index in torch.randperm(len(dataset), generator=generator).tolist():
            yield dataset[index]


__all__ = [
    "LengthMix",
    "MixedLengthBlocks",
    "length_mix",
    "trained_tokens",
    "training_blocks",
    "training_dataset",
]
