#!/usr/bin/env python
"""The length arms of the fidelity harness: ``hf-tapernorm taper`` on training blocks of two lengths, or on
blocks whose positions spread past their tokens.

Why: the taper trains on short blocks (128 tokens by default) and users feed the model its whole context.
Without its attention input norms the model has only seen the positions of a short block, and a long input
costs more than a short one. Two ways of showing the taper long inputs' positions were measured
(reports/fidelity_record.md, "Long steps in the mix" and "Position spans") and rejected: on SmolLM2 neither
mends the cost of long inputs at 300 steps, and the default budget does. They stay here, as arms, not as
options of the product:

- ``--long_block_size N --long_block_every K``: every Kth optimizer step reads blocks of N tokens instead of
  the short ones, as many per step (:class:`LengthMix`, :class:`MixedLengthBlocks`);
- ``--position_span N``: each training block keeps its tokens, in order, and only its position ids change so
  that its distances reach N, as PoSE does (:func:`spread_positions`).

Both run the whole ``taper`` command (run folder, report, ``--resume``, the baseline reading the same blocks)
through its extension point, ``TaperExtension.training_data``; the options are part of the run's identity, so a
``--resume`` or a ``--baseline_from`` with another mix is refused. Every other option is ``taper``'s::

    python -m conversion_scripts.experiments.length_arms --long_block_size 512 --long_block_every 8 \\
        --output_dir runs/x --max_steps 300 --per_device_train_batch_size 2 --block_size 128 --baseline
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import datasets
import torch
from torch.utils.data import IterableDataset

from hf_tapernorm import ConfigurationError
from hf_tapernorm.app.taper import TaperExtension, TrainingData, TrainingInputs
from hf_tapernorm.cli.main import main as hf_tapernorm_main
from hf_tapernorm.data import is_heldout, load_documents, pack_documents

logger = logging.getLogger("length_arms")


# ============================================================================= training blocks of two lengths
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


class MixedLengthBlocks(IterableDataset):
    """The training blocks of a run with long steps: an endless stream of examples, ``blocks_per_step`` at a time
    of one length, each set in a seeded order.

    A batch stacks blocks of one length, so a long step is made of long blocks only. The Trainer batches a
    map-style dataset in its sampler's shuffled order, which would mix the two lengths; the mix is therefore an
    ``IterableDataset`` (the Trainer reads it in order) that yields each optimizer step's blocks together: per
    device x gradient accumulation x processes of them, all of one length. Under several processes accelerate
    dispatches an iterable dataset's batches from the main process, taking one batch per process for each
    micro-step, so every process's share of a step has the step's length. The order is seeded and the same on
    every pass, so a resumed run, which the Trainer fast-forwards by the steps it has trained, reads the blocks
    the interrupted one would have read.
    """

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


def long_training_blocks(inputs: TrainingInputs, short_blocks: int, size: int, count: int) -> datasets.Dataset:
    """``count`` training blocks of ``size`` tokens, from the training documents after the first ``short_blocks``
    short blocks' (no text in both): the documents are read again and packed as the run packed them."""
    data, packed = inputs.data, inputs.packed
    documents = load_documents(data)
    texts = (
        text
        for text in (row.get(packed.text_column) for row in documents)
        if isinstance(text, str) and not is_heldout(text, data.heldout_percentage)
    )
    prefix, tokenizer = packed.prefix_ids, inputs.tokenizer
    pack_documents(texts, tokenizer, data.block_size, max_blocks=short_blocks, desc="skipping", prefix_ids=prefix)
    long = pack_documents(texts, tokenizer, size, max_blocks=count, desc="long training blocks", prefix_ids=prefix)
    if not long:
        raise ConfigurationError(
            f"dataset '{packed.source}' has no text left for one training block of {size} tokens after the "
            f"{short_blocks} shorter blocks: use more text or a smaller --long_block_size"
        )
    if len(long) < count:
        logger.warning(
            "%d long training blocks of %d tokens, fewer than the %d the run reads: some repeat", len(long), size, count
        )
    n = len(prefix)  # as the library packs: the first text token, predicted at the sink, is not a target
    labels = [block[:n] + [-100] + block[n + 1 :] for block in long] if n else long
    return datasets.Dataset.from_dict({"input_ids": long, "labels": labels}).with_format("torch")


# ============================================================================= positions spread over a span
def spread_positions(length: int, prefix_length: int, span: int, generator: torch.Generator) -> list[int]:
    """Position ids for one block of ``length`` tokens (``prefix_length`` of them sink tokens) spread over ``span``.

    As PoSE (Zhu et al., 2023): the sink tokens keep positions ``0 .. n-1``; the text is cut at a random point
    into two parts, and two random skips, together at most ``span - length``, are added: one between the sink
    and the first part, one between the two parts. Distances between the sink and the text, and between the two
    parts, then range up to ``span``; distances within a part stay as they are.
    """
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
    """``dataset``'s blocks with ``position_ids`` spread over ``span`` and an all-ones ``attention_mask``; block
    ``i``'s positions depend on ``seed`` and ``i`` alone (a resumed run and the baseline see the same ones).

    The mask matters: without one, transformers reads position ids that jump as several sequences packed into
    one row and would mask attention between the parts; with one, attention stays causal over the whole block.
    """

    def add(example: dict, index: int) -> dict:
        length = len(example["input_ids"])
        generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
        return {
            "position_ids": spread_positions(length, prefix_length, span, generator),
            "attention_mask": [1] * length,
        }

    spread = dataset.with_format(None).map(add, with_indices=True, desc="position spans", load_from_cache_file=False)
    return spread.with_format("torch")


# ============================================================================= the arms as a taper extension
@dataclass(frozen=True)
class LengthArms:
    """The options of this script (0: off) and the ``TaperExtension`` that trains with them."""

    long_block_size: int = 0
    long_block_every: int = 16
    position_span: int = 0

    def facts(self) -> dict[str, int]:
        """The options that are on, as the run's identity and report record them."""
        facts = {"long_block_size": self.long_block_size, "long_block_every": self.long_block_every}
        return {
            **(facts if self.long_block_size else {}),
            **({"position_span": self.position_span} if self.position_span else {}),
        }

    def extension(self) -> TaperExtension:
        return TaperExtension(training_data=self.training_data, data_facts=self.facts())

    def check(self, inputs: TrainingInputs) -> Optional[LengthMix]:
        """Refuse options that are none, beyond the model's positions, or that no step of the run reaches."""
        block_size, steps = inputs.data.block_size, inputs.training.max_steps
        for flag in ("long_block_size", "position_span"):
            if getattr(self, flag) < 0:
                raise ConfigurationError(f"--{flag} must be >= 0, got {getattr(self, flag)}")
        if self.position_span and self.position_span <= block_size:
            raise ConfigurationError(
                f"--position_span {self.position_span} must be longer than --block_size {block_size} (0 keeps the "
                "positions contiguous)"
            )
        positions = max_positions(inputs.model_config)
        for flag in ("long_block_size", "position_span"):
            if positions is not None and getattr(self, flag) > positions:
                raise ConfigurationError(f"--{flag} {getattr(self, flag)} exceeds the model's {positions} positions")
        if not self.long_block_size:
            return None
        mix = LengthMix(block_size, self.long_block_size, self.long_block_every)
        if mix.long_steps(steps) == 0:
            raise ConfigurationError(
                f"--long_block_size {mix.long_size} --long_block_every {mix.every}: the first long step is step "
                f"{mix.every}, and this run has {steps} (--max_steps), so no step would read long blocks; a long "
                f"step needs --max_steps {mix.every} or more, or --long_block_every {steps} or less"
            )
        return mix

    def training_data(self, inputs: TrainingInputs) -> TrainingData:
        """The packed blocks (their positions spread with ``--position_span``), or with long steps their mix, in the
        order of the Trainer's seed (``--data_seed``, else ``--seed``)."""
        mix = self.check(inputs)
        training, packed, per_step = inputs.training, inputs.packed, inputs.blocks_per_step
        seed = training.data_seed if training.data_seed is not None else training.seed
        short_blocks = (training.max_steps - (mix.long_steps(training.max_steps) if mix else 0)) * per_step
        short = packed.train.select(range(min(short_blocks, len(packed.train))))
        if self.position_span:
            short = with_spread_positions(short, self.position_span, len(packed.prefix_ids), seed)
        if mix is None:
            return TrainingData(short)
        long = long_training_blocks(inputs, short_blocks, mix.long_size, mix.long_steps(training.max_steps) * per_step)
        return TrainingData(
            MixedLengthBlocks(short, long, mix, blocks_per_step=per_step, seed=seed),
            facts={"train_blocks": len(short), "long_train_blocks": len(long)},
            tokens=lambda steps: mix.tokens(steps, per_step),
        )


def max_positions(model_config: Any) -> Optional[int]:
    """The model's position limit (``max_position_embeddings`` or its other names), or None."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(model_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m conversion_scripts.experiments.length_arms",
        description=__doc__.split("\n\n")[0],
        epilog="Every other option is hf-tapernorm taper's (hf-tapernorm taper --help).",
        allow_abbrev=False,
    )
    parser.add_argument(
        "--long_block_size",
        type=int,
        default=0,
        help="every --long_block_every-th optimizer step trains on blocks of this many tokens instead of --block_size "
        "(as many blocks per step; 0: off)",
    )
    parser.add_argument(
        "--long_block_every", type=int, default=16, help="with --long_block_size: which steps read long blocks"
    )
    parser.add_argument(
        "--position_span",
        type=int,
        default=0,
        help="spread each training block's position ids over this many positions (PoSE; 0: contiguous)",
    )
    options, rest = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    arms = LengthArms(options.long_block_size, options.long_block_every, options.position_span)
    return hf_tapernorm_main(["taper", *rest], extension=arms.extension())


if __name__ == "__main__":
    sys.exit(main())
