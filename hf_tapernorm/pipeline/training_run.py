"""One Trainer run of the pipeline: Ctrl-C saves a resumable checkpoint, every checkpoint records the run.

First Ctrl-C: finish the current optimizer step, save a checkpoint (the Trainer's own: model, optimizer,
scheduler, RNG, trainer state, plus what TaperCallback adds), stop; ``--resume`` continues it. A second
Ctrl-C aborts without one. Each checkpoint also gets the run's identity (``tapernorm_run.json``), and
the run folder's manifest is refreshed, so a later command knows these files are the run's.
"""

from __future__ import annotations

import copy
import json
import logging
import signal
from pathlib import Path
from typing import Any, Optional

import torch
from transformers import Trainer, TrainerCallback, default_data_collator
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from ..utils import all_reduce_max
from .report import history_from_log
from .run_folder import RunFolder

logger = logging.getLogger(__name__)

IDENTITY_NAME = "tapernorm_run.json"

# Logged keys of TaperCallback -> report keys.
LOG_KEYS = {
    "loss": "loss",
    "learning_rate": "learning_rate",
    "grad_norm": "grad_norm",
    "taper/gate": "gate",
    "taper/scale_loss": "scale_loss",
    "taper/residual_scale": "residual_scale",
    "taper/distill": "distill",
}


class InterruptCallback(TrainerCallback):
    """Ctrl-C as a Trainer stop with a save (see the module docstring)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def on_train_begin(self, args, state, control, **kwargs):
        if self._previous is None:
            self._previous = signal.signal(signal.SIGINT, self._handle)

    def on_step_end(self, args, state, control, **kwargs):
        if self.poll():
            logger.warning("interrupted: saving a checkpoint at step %d (rerun with --resume)", state.global_step)
            control.should_save = True
            control.should_training_stop = True
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self.uninstall()

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        logger.warning("Ctrl-C: stopping after this step with a checkpoint (press again to abort without one)")

    def poll(self) -> bool:
        """The flag, agreed across processes so every rank stops (and saves) at the same step."""
        flag = torch.tensor([1.0 if self.requested else 0.0])
        self.requested = bool(all_reduce_max(flag).item())
        return self.requested


class RecordCallback(TrainerCallback):
    """Writes the run's identity into each checkpoint and refreshes the run folder's manifest."""

    def __init__(self, run_folder: RunFolder, identity: dict[str, Any]) -> None:
        self.run_folder, self.identity = run_folder, identity

    def on_save(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if folder.is_dir():
            (folder / IDENTITY_NAME).write_text(json.dumps(self.identity, indent=2, sort_keys=True) + "\n")
        self.run_folder.record()


def last_checkpoint(folder: Path) -> Optional[str]:
    return get_last_checkpoint(str(folder)) if folder.is_dir() else None


def train(
    model,
    training_args,
    train_dataset,
    output_dir: Path,
    callbacks: list,
    *,
    resume: bool,
    history: list,
) -> tuple[Trainer, bool]:
    """One Trainer run into ``output_dir``; returns (trainer, interrupted).

    ``history`` receives the per-step records even when training fails (a divergence report needs
    the curve up to the failure).
    """
    args = copy.copy(training_args)
    args.output_dir = str(output_dir)
    interrupt = InterruptCallback()
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=train_dataset,
        data_collator=default_data_collator,
        callbacks=[*callbacks, interrupt],
    )
    checkpoint = last_checkpoint(output_dir) if resume else None
    if resume and checkpoint is None:
        logger.info("no checkpoint in %s: starting this training from step 0", output_dir)
    try:
        trainer.train(resume_from_checkpoint=checkpoint)
    finally:
        interrupt.uninstall()
        history[:] = training_history(trainer)
    return trainer, interrupt.requested


def training_history(trainer: Trainer) -> list[dict[str, Any]]:
    """Per-step records of a run; ``ce`` is the logged objective minus the scale loss and distillation."""
    records = history_from_log(trainer.state.log_history, LOG_KEYS)
    for record in records:
        if "loss" in record:
            record["ce"] = record["loss"] - record.get("scale_loss", 0.0) - record.get("distill", 0.0)
    return records


__all__ = [
    "IDENTITY_NAME",
    "InterruptCallback",
    "LOG_KEYS",
    "RecordCallback",
    "last_checkpoint",
    "train",
    "training_history",
]
