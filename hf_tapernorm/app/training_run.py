"""One Trainer run of the pipeline: Ctrl-C or SIGTERM saves a resumable checkpoint, every checkpoint records the run.

First Ctrl-C (SIGINT) or SIGTERM (what ``docker stop``, Slurm and Kubernetes send): finish the current optimizer
step, save a checkpoint (the Trainer's own: model, optimizer, scheduler, RNG, trainer state, plus what TaperCallback
adds), stop; ``--resume`` continues it. A second signal aborts without one. (Only the main thread receives them: a
run started from another thread, a notebook's or a web UI's worker, stops so once the main thread has ended.) Each
checkpoint also gets the run's identity (``tapernorm_run.json``), written last, so its presence marks a complete
checkpoint (a kill while one is written leaves an incomplete one, which ``--resume`` skips), with the list of the
files the checkpoint holds then (a resume refuses one that lost a file: the distillation teacher's snapshot, say,
which the run cannot rebuild) and the sha256 of that snapshot (a resume refuses a teacher replaced by another run's
or edited: the run would distil from it without a word), and the run folder's manifest is refreshed, so a later
command knows these files are the run's.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import signal
import threading
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Optional

import torch
from accelerate.utils import extract_model_from_parallel
from transformers import Trainer, TrainerCallback, default_data_collator
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..training.callback import TaperCallback, place_first
from ..training.distillation import SNAPSHOT_NAME
from ..utils import all_reduce_max
from .checkpoint_files import IDENTITY_NAME
from .report import history_from_log
from .run_folder import RunFolder

logger = logging.getLogger(__name__)

#: The key of IDENTITY_NAME that lists the checkpoint's files (relative paths); the rest is the run's identity.
CHECKPOINT_FILES_KEY = "checkpoint_files"
#: The key of IDENTITY_NAME that maps the checkpoint's files a resume cannot rebuild (the teacher) to their sha256.
CHECKPOINT_DIGESTS_KEY = "checkpoint_sha256"
#: The files of a checkpoint whose sha256 its record keeps: one hash at each save and at each resume.
DIGESTED_FILES = (SNAPSHOT_NAME,)

#: Logged keys of TaperCallback -> report keys (read-only: an experiment adds its own with a TaperExtension).
LOG_KEYS: Mapping[str, str] = MappingProxyType(
    {
        "loss": "loss",
        "learning_rate": "learning_rate",
        "grad_norm": "grad_norm",
        "taper/gate": "gate",
        "taper/scale_loss": "scale_loss",
        "taper/residual_scale": "residual_scale",
        "taper/distill": "distill",
        "taper/sink_attention": "sink_attention",
    }
)

#: The report keys of LOG_KEYS that are loss terms added to the cross-entropy (each logged as its mean).
LOSS_TERM_KEYS: tuple[str, ...] = ("scale_loss", "distill", "sink_attention")


#: The signals that stop a run with a checkpoint.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class InterruptCallback(TrainerCallback):
    """Ctrl-C or SIGTERM as a Trainer stop with a save (see the module docstring)."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name: Optional[str] = None
        self._previous: dict[int, Any] = {}
        self._outside_main = False

    def on_train_begin(self, args, state, control, **kwargs):
        if threading.current_thread() is not threading.main_thread():  # only the main thread may set a handler
            self._outside_main = True
            logger.info(
                "taper runs outside the main thread: Ctrl-C and SIGTERM reach the main thread, not this run; should "
                "the main thread end, the run stops after its step with a checkpoint"
            )
            return
        if not self._previous:
            self._previous = {number: signal.signal(number, self._handle) for number in STOP_SIGNALS}

    def on_step_end(self, args, state, control, **kwargs):
        if self.poll():
            logger.warning("interrupted: saving a checkpoint at step %d (rerun with --resume)", state.global_step)
            control.should_save = True
            control.should_training_stop = True
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self.uninstall()

    def uninstall(self) -> None:
        for number, previous in self._previous.items():
            signal.signal(number, previous)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self.signal_name = signal.Signals(signum).name
        logger.warning(
            "%s: stopping after this step with a checkpoint (send it again to abort without one)", self.signal_name
        )

    def poll(self) -> bool:
        """The flag, agreed across processes so every rank stops (and saves) at the same step. A run in another
        thread stops once the main thread has ended (an uncaught Ctrl-C there): the interpreter is shutting down, and
        the export's loaders would fail in it."""
        if self._outside_main and not self.requested and not threading.main_thread().is_alive():
            logger.warning("the main thread has ended: stopping after this step with a checkpoint")
            self.requested, self.signal_name = True, "SIGINT"
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
            files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
            tmp = folder / (IDENTITY_NAME + ".tmp")
            record = {**self.identity, CHECKPOINT_FILES_KEY: files, CHECKPOINT_DIGESTS_KEY: file_digests(folder)}
            tmp.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
            os.replace(tmp, folder / IDENTITY_NAME)
        self.run_folder.record(identity=self.identity)  # a resumed run's identity, once it has trained


def file_digests(checkpoint: Path) -> dict[str, str]:
    """The sha256 of each of ``checkpoint``'s DIGESTED_FILES that it holds."""
    found = {}
    for name in DIGESTED_FILES:
        if (checkpoint / name).is_file():
            with (checkpoint / name).open("rb") as handle:
                found[name] = hashlib.file_digest(handle, "sha256").hexdigest()
    return found


def complete_checkpoints(folder: Path) -> list[Path]:
    """The ``checkpoint-N`` folders whose run record was written (written last: the checkpoint is whole), by N."""
    if not folder.is_dir():
        return []
    found = [
        child
        for child in folder.glob(f"{PREFIX_CHECKPOINT_DIR}-*")
        if child.is_dir() and child.name.split("-")[-1].isdigit() and (child / IDENTITY_NAME).is_file()
    ]
    return sorted(found, key=lambda child: int(child.name.split("-")[-1]))


def last_checkpoint(folder: Path) -> Optional[str]:
    """The last complete checkpoint (complete_checkpoints), or None."""
    complete = complete_checkpoints(folder)
    return str(complete[-1]) if complete else None


def incomplete_checkpoints(folder: Path) -> list[Path]:
    """``checkpoint-N`` folders newer than the last complete one: being written when the run was killed."""
    complete = complete_checkpoints(folder)
    last = int(complete[-1].name.split("-")[-1]) if complete else -1
    return sorted(
        child
        for child in folder.glob(f"{PREFIX_CHECKPOINT_DIR}-*")
        if child.is_dir() and child.name.split("-")[-1].isdigit() and int(child.name.split("-")[-1]) > last
    )


def resume_advice(folder: Path) -> str:
    """What to do after a run into ``folder`` stopped on a full disk, and what ``--resume`` would continue from."""
    checkpoint = last_checkpoint(folder)
    if checkpoint is None:
        return (
            "it kept no complete checkpoint for --resume to continue from: free space (or lift the file-size limit) "
            "and start over with --overwrite, or choose an --output_dir on another disk"
        )
    return (
        "free space (or lift the file-size limit), then rerun the same command with --resume: it continues from "
        f"the last complete checkpoint, {checkpoint}"
    )


def recorded_identity(folder: Path) -> Optional[dict[str, Any]]:
    """The run identity recorded in the last complete checkpoint (to rebuild a lost manifest)."""
    complete = complete_checkpoints(folder)
    if not complete:
        return None
    try:
        identity = json.loads((complete[-1] / IDENTITY_NAME).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(identity, dict):
        return None
    identity.pop(CHECKPOINT_FILES_KEY, None)
    identity.pop(CHECKPOINT_DIGESTS_KEY, None)
    return identity


def train(
    model,
    training_args,
    train_dataset,
    output_dir: Path,
    callbacks: list,
    *,
    resume: bool,
    history: list,
    log_keys: Mapping[str, str] = LOG_KEYS,
    loss_terms: tuple[str, ...] = LOSS_TERM_KEYS,
) -> tuple[Trainer, Optional[str]]:
    """One Trainer run into ``output_dir``; returns (trainer, the name of the signal that stopped it or None).

    ``history`` receives the per-step records even when training fails (a divergence report needs
    the curve up to the failure), with the logged keys ``log_keys`` names (training_history).
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
    if any(isinstance(callback, TaperCallback) for callback in callbacks):
        place_first(trainer)  # the TensorBoard logs (report_to) get the taper/* keys
    checkpoint = last_checkpoint(output_dir) if resume else None  # validated before the model loaded
    if resume and checkpoint is None:
        logger.info("no checkpoint in %s: starting this training from step 0", output_dir)
    try:
        trainer.train(resume_from_checkpoint=checkpoint)
    finally:
        interrupt.uninstall()
        history[:] = training_history(trainer, log_keys, loss_terms)
        # Mixed precision (--bf16/--fp16) leaves an autocast wrapper on the model's forward; without removing it
        # every later evaluation, the fold, its check and the sink capture would run in the autocast dtype.
        extract_model_from_parallel(model, keep_fp32_wrapper=False)
    return trainer, (interrupt.signal_name or "SIGINT") if interrupt.requested else None  # another rank's signal


def training_history(
    trainer: Trainer, log_keys: Mapping[str, str] = LOG_KEYS, loss_terms: tuple[str, ...] = LOSS_TERM_KEYS
) -> list[dict[str, Any]]:
    """Per-step records of a run (``log_keys``: logged key -> record key); ``ce`` is the logged objective minus
    its loss terms (``loss_terms``)."""
    records = history_from_log(trainer.state.log_history, log_keys)
    for record in records:
        if "loss" in record:
            record["ce"] = record["loss"] - sum(record.get(key, 0.0) for key in loss_terms)
    return records


__all__ = [
    "CHECKPOINT_DIGESTS_KEY",
    "CHECKPOINT_FILES_KEY",
    "IDENTITY_NAME",
    "InterruptCallback",
    "LOG_KEYS",
    "LOSS_TERM_KEYS",
    "RecordCallback",
    "STOP_SIGNALS",
    "complete_checkpoints",
    "file_digests",
    "incomplete_checkpoints",
    "last_checkpoint",
    "recorded_identity",
    "resume_advice",
    "train",
    "training_history",
]
