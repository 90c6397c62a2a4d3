"""How the Trainer cuts a run's optimizer steps out of epochs of its training data, for taper's check and record.

The Trainer ends an epoch with an optimizer step whatever the gradient accumulation has gathered: each epoch
trains ``ceil(batches / gradient_accumulation_steps)`` steps, the last of them on the batches left over. A
``--gradient_accumulation_steps`` larger than one epoch's batches therefore makes every step one epoch (the
run's blocks per step are not what it asked for: refused), and one that does not divide the epoch makes the
epoch's last step short (the blocks trained are fewer than steps x blocks per step: counted here, for the
report's tokens).

The batches of an epoch are the Trainer's data loader's on one process: ``--per_device_train_batch_size``
examples a batch (the last, partial one dropped with ``--dataloader_drop_last``), dealt to the processes by
accelerate, which drops the batches left over with ``drop_last`` and otherwise gives every process one more
(filled from the start of the data); on one process the last batch stays partial.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from ..errors import ConfigurationError


def batches_per_epoch(training_args: Any, examples: int) -> int:
    """The batches one process reads in one epoch of ``examples`` training examples."""
    per_device, processes = training_args.per_device_train_batch_size, max(1, training_args.world_size)
    drop_last = training_args.dataloader_drop_last
    batches = examples // per_device if drop_last else math.ceil(examples / per_device)
    return batches // processes + int(not drop_last and batches % processes > 0)


def _examples(dataset: Any) -> Optional[int]:
    """How many examples ``dataset`` holds, or None for one read as a stream (no length: no epochs)."""
    try:
        return len(dataset)
    except TypeError:
        return None


def check_accumulation_within_epoch(training_args: Any, dataset: Any) -> None:
    """Refuse a gradient accumulation over more batches than one epoch holds (see the module docstring)."""
    examples = _examples(dataset)
    accumulation = training_args.gradient_accumulation_steps
    if examples is None or accumulation <= 1:
        return
    batches = batches_per_epoch(training_args, examples)
    if 0 < batches < accumulation:
        raise ConfigurationError(
            f"--gradient_accumulation_steps {accumulation} is more than the {batches} batches of one epoch of the "
            f"training data ({examples} blocks): the Trainer ends each step at the epoch's end, so every step would "
            f"train on one epoch; use --gradient_accumulation_steps {batches} or fewer, or more training text"
        )


def blocks_trained(training_args: Any, dataset: Any, steps: int) -> int:
    """The blocks (over every process) that the first ``steps`` optimizer steps train on from ``dataset``: steps x
    blocks per step, less the batches each finished epoch's short last step lacked (a stream has no epochs)."""
    per_batch = training_args.per_device_train_batch_size * max(1, training_args.world_size)
    accumulation = training_args.gradient_accumulation_steps
    examples = _examples(dataset)
    batches = batches_per_epoch(training_args, examples) if examples is not None else 0
    if batches <= 0:
        return steps * accumulation * per_batch
    epoch_steps = math.ceil(batches / accumulation)
    epochs, rest = divmod(steps, epoch_steps)
    one_process_short = training_args.world_size <= 1 and not training_args.dataloader_drop_last  # a partial batch
    epoch_blocks = examples if one_process_short else batches * per_batch
    return epochs * epoch_blocks + rest * accumulation * per_batch


__all__ = ["batches_per_epoch", "blocks_trained", "check_accumulation_within_epoch"]
