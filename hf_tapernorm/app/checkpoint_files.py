"""Which files a Trainer checkpoint folder (``checkpoint-<step>``) of a run holds, to tell it from a user's folder.

A checkpoint the run has not recorded in its manifest yet (the Trainer saved it, the run was killed before it
recorded it) is the run's only when every file in it has a name the Trainer or this package writes into a
checkpoint: a user's ``checkpoint-99/notes.txt`` is someone else's folder of the same name, named and refused by
``--overwrite`` and ``--resume``, never deleted.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable
from fnmatch import fnmatchcase
from typing import Optional

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

#: A Trainer's checkpoint folder, ``checkpoint-<step>``: only that name (``checkpoint-6-keep`` is a user's).
CHECKPOINT_NAME = re.compile(rf"{re.escape(PREFIX_CHECKPOINT_DIR)}-[0-9]+")

#: The file a tapered checkpoint records its run in (the run's identity and the checkpoint's files).
IDENTITY_NAME = "tapernorm_run.json"

#: Files the Trainer (model, optimizer, scheduler, scaler, RNG states, state, arguments, config, tokenizer,
#: PEFT adapter, sharded weights, DeepSpeed's pointers) and this package (run identity, TaperNorm config,
#: distillation teacher) write directly into a checkpoint folder.
CHECKPOINT_FILES = (
    "model.safetensors",
    "model-*-of-*.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model-*-of-*.bin",
    "pytorch_model.bin.index.json",
    "pytorch_model_fsdp_*.bin",
    "adapter_model.safetensors",
    "adapter_model.bin",
    "adapter_config.json",
    "optimizer.pt",
    "optimizer.bin",
    "optimizer_*.bin",
    "scheduler.pt",
    "scaler.pt",
    "rng_state.pth",
    "rng_state_*.pth",
    "trainer_state.json",
    "training_args.bin",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
    "latest",
    "zero_to_fp32.py",
    IDENTITY_NAME,
    "tapernorm_config.json",
    "tapernorm.json",
    "distillation_teacher.safetensors",
)
#: Folders inside a checkpoint that a library fills (sharded torch.distributed.checkpoint states of FSDP and of
#: the distillation teacher, DeepSpeed's ``global_step<N>``): whatever they hold is the checkpoint's.
CHECKPOINT_FOLDERS = ("distillation_teacher", "pytorch_model_fsdp_*", "optimizer_*", "global_step*")


def checkpoint_of(relative: str) -> Optional[str]:
    """The Trainer checkpoint folder (``checkpoint-6``, or ``baseline/checkpoint-6`` of the baseline run) that the
    file ``relative`` lies in, or None."""
    parts = relative.split("/")
    depth = 1 if parts[0] == "baseline" else 0
    if len(parts) > depth + 1 and CHECKPOINT_NAME.fullmatch(parts[depth]):
        return "/".join(parts[: depth + 1])
    return None


def is_checkpoint_file(relative: str) -> bool:
    """``relative`` (a path inside a checkpoint folder) has a name a Trainer checkpoint holds."""
    parts = relative.split("/")
    patterns = CHECKPOINT_FILES if len(parts) == 1 else CHECKPOINT_FOLDERS
    return any(fnmatchcase(parts[0], pattern) for pattern in patterns)


def unrecorded_checkpoints(files: Iterable[str], recorded: Collection[Optional[str]]) -> set[str]:
    """The checkpoint folders among ``files`` (relative to the run folder) that are not ``recorded`` and hold only
    files a Trainer checkpoint holds: a checkpoint saved before the run could record it. Any other file makes
    the folder a user's."""
    files = list(files)
    candidates = {checkpoint_of(f) for f in files} - set(recorded) - {None}
    foreign = {
        folder
        for f in files
        if (folder := checkpoint_of(f)) in candidates and not is_checkpoint_file(f[len(folder) + 1 :])
    }
    return {folder for folder in candidates - foreign if folder is not None}


__all__ = [
    "CHECKPOINT_FILES",
    "CHECKPOINT_FOLDERS",
    "CHECKPOINT_NAME",
    "checkpoint_of",
    "is_checkpoint_file",
    "unrecorded_checkpoints",
]
