"""What ``taper --resume`` checks in a run's checkpoint before any weights load.

A resumed run is the same run only if every piece of state the Trainer saved comes back: without
``optimizer.pt`` Adam restarts from zero moments, without ``scheduler.pt`` the learning rate restarts its
warmup, without ``rng_state.pth`` the dropout and data order differ, without the distillation teacher's
snapshot the run distils from another teacher. The Trainer resumes silently in each case, so each missing or
unreadable file is refused here with its name: the files the Trainer reads, and every file the checkpoint held
when it was written (listed in its ``tapernorm_run.json``), the distillation teacher with the sha256 recorded there
too (a teacher copied from another run, or edited, would be distilled from without a word; a checkpoint of an older
version records none and resumes as before). ``trainer_state.json`` is read too: the folder's
name must be exactly ``checkpoint-<the step it holds>`` (a renamed checkpoint, ``checkpoint-03`` too, fails late:
the Trainer and TaperCallback look for the canonical name once the model has loaded). A checkpoint that holds a
sharded (torch.distributed.checkpoint) folder is read only when the user trusts it (its index is a pickle).

The checks ``taper`` runs before work starts are split by what they read, so each has one place:
validation.py the request and the model's config (the recipe, schedule, positions, the run's identity);
preflight.py the Trainer's options and the disk; resume_check.py the files of a checkpoint to resume.
A new check goes where its input is: this module, for a check on a file a resumed checkpoint must hold.
"""

from __future__ import annotations

import json
import logging
import pickle
from pathlib import Path
from typing import Optional

import torch
from safetensors import SafetensorError, safe_open
from transformers.trainer_pt_utils import safe_globals
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..config import CONFIG_NAME, TaperNormConfig
from ..errors import ConfigurationError, first_line
from ..training.distillation import SNAPSHOT_NAME
from ..training.sharded import METADATA_NAME, refuse_untrusted_sharded_checkpoint
from .training_run import (
    CHECKPOINT_DIGESTS_KEY,
    CHECKPOINT_FILES_KEY,
    IDENTITY_NAME,
    file_digests,
    incomplete_checkpoints,
    last_checkpoint,
)

logger = logging.getLogger(__name__)

#: The Trainer's files a resume restores, and what is lost without each.
REQUIRED_STATE = {
    "trainer_state.json": "the step, the log and the callbacks' state",
    "optimizer.pt": "the optimizer's moments (Adam would restart from zero)",
    "scheduler.pt": "the learning-rate schedule's position",
}
#: What is lost without a file a checkpoint listed (besides REQUIRED_STATE): said when it is missing.
LISTED_STATE = {SNAPSHOT_NAME: "the distillation teacher (the run cannot take it again: its model has trained since)"}


class ResumeCheckError(ConfigurationError):
    """A checkpoint that would not resume the same run (the message names the file and what to do)."""


def check_resumable(run_folder: Path, *, trust_sharded_checkpoint: bool = False) -> list[Path]:
    """Check the last complete checkpoint of ``run_folder`` and of its ``baseline/`` run, if any.

    Returns the incomplete checkpoints (newer than the last complete one: being written when the run was
    killed), for the caller to remove once everything else has been checked.
    """
    stale: list[Path] = []
    for folder in (run_folder, run_folder / "baseline"):
        incomplete = incomplete_checkpoints(folder) if folder.is_dir() else []
        checkpoint = last_checkpoint(folder) if folder.is_dir() else None
        if checkpoint is None:
            if incomplete:
                raise ResumeCheckError(
                    f"--resume: {incomplete[-1]} is incomplete (the run stopped while writing it: no {IDENTITY_NAME}) "
                    "and no complete checkpoint precedes it; start over with --overwrite"
                )
            continue
        check_checkpoint(Path(checkpoint), trust_sharded_checkpoint=trust_sharded_checkpoint)
        stale += incomplete
    return stale


def check_checkpoint(checkpoint: Path, *, trust_sharded_checkpoint: bool = False) -> None:
    """Every file a Trainer resume reads is present and readable (see the module docstring)."""
    restart = (
        "; restore it from a copy, move it out of the run folder to resume from the checkpoint before it, or start "
        "over with --overwrite"
    )
    for name, what in REQUIRED_STATE.items():
        # FSDP writes its optimizer state as a sharded folder (optimizer_0/) instead of optimizer.pt
        present = (checkpoint / name).is_file() or (name == "optimizer.pt" and any(checkpoint.glob("optimizer_*")))
        if not present:
            raise ResumeCheckError(f"--resume: {checkpoint} has no {name}, which holds {what}{restart}")
    _check_trainer_state(checkpoint, restart)
    rng_files = sorted(checkpoint.glob("rng_state*.pth"))
    if not rng_files:
        raise ResumeCheckError(
            f"--resume: {checkpoint} has no rng_state.pth (the random state: dropout and data order would differ)"
            f"{restart}"
        )
    for state in [*(checkpoint / n for n in ("optimizer.pt", "scheduler.pt", "scaler.pt")), *rng_files]:
        problem = _unloadable(state) if state.is_file() else None
        if problem:
            raise ResumeCheckError(
                f"--resume: cannot read {state} ({problem}): the Trainer loads it as tensors only (weights_only), "
                f"so a file that is damaged or holds other pickled objects stops the resume{restart}"
            )
    for sharded in [p.parent for p in checkpoint.rglob(METADATA_NAME)]:
        refuse_untrusted_sharded_checkpoint(sharded, trust_sharded_checkpoint)
    weights = [p for p in checkpoint.glob("*.safetensors") if not p.name.startswith("distillation_")]
    if not weights and not list(checkpoint.glob(f"**/{METADATA_NAME}")):
        raise ResumeCheckError(f"--resume: {checkpoint} has no model.safetensors (the weights){restart}")
    for path in [*weights, *checkpoint.glob("distillation_*.safetensors")]:
        problem = _unreadable(path)
        if problem:
            raise ResumeCheckError(f"--resume: cannot read {path} ({problem}: truncated or damaged){restart}")
    record = _check_listed_files(checkpoint, restart)
    _check_digests(checkpoint, record)
    _check_recipe_unedited(checkpoint, restart)


def _check_trainer_state(checkpoint: Path, restart: str) -> None:
    """``trainer_state.json`` is a readable state whose step is the one the folder's name says (the Trainer and
    TaperCallback look for ``checkpoint-<its global_step>``)."""
    path = checkpoint / "trainer_state.json"
    try:
        state = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ResumeCheckError(
            f"--resume: cannot read {path} ({first_line(error)}: truncated or damaged){restart}"
        ) from None
    step = state.get("global_step") if isinstance(state, dict) else None
    if not isinstance(step, int) or isinstance(step, bool):
        raise ResumeCheckError(f"--resume: {path} holds no Trainer state (no integer global_step){restart}")
    canonical = f"{PREFIX_CHECKPOINT_DIR}-{step}"
    if checkpoint.name != canonical:
        named = int(checkpoint.name.split("-")[-1])
        says = f"not of step {named} as its name says" if named != step else f"and its name is not {canonical}"
        raise ResumeCheckError(
            f"--resume: {checkpoint} holds the state of step {step} ({path.name}: global_step {step}), {says}: it was "
            f"renamed; rename it back to {checkpoint.with_name(canonical)}, or start over with --overwrite"
        )


def _check_listed_files(checkpoint: Path, restart: str) -> dict:
    """Every file the checkpoint held when it was written (its record's list) is still there; returns the record."""
    try:
        record = json.loads((checkpoint / IDENTITY_NAME).read_text())
        listed = record.get(CHECKPOINT_FILES_KEY)
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as error:
        raise ResumeCheckError(
            f"--resume: cannot read {checkpoint / IDENTITY_NAME} ({first_line(error)}){restart}"
        ) from None
    listed = listed if isinstance(listed, list) else []  # a checkpoint of an older version lists nothing
    missing = [name for name in listed if isinstance(name, str) and not (checkpoint / name).is_file()]
    if missing:
        what = LISTED_STATE.get(missing[0], "a file the run wrote into it")
        raise ResumeCheckError(
            f"--resume: {checkpoint} has no {missing[0]}{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}"
            f", which holds {what}{restart}"
        )
    return record


def _check_digests(checkpoint: Path, record: dict) -> None:
    """The files whose sha256 the checkpoint's ``record`` keeps (the teacher) are the ones the run wrote."""
    recorded = record.get(CHECKPOINT_DIGESTS_KEY)
    if not isinstance(recorded, dict):
        if (checkpoint / SNAPSHOT_NAME).is_file():
            logger.info(
                "%s records no sha256 of %s (an older version wrote it): not checked", checkpoint, SNAPSHOT_NAME
            )
        return
    found = file_digests(checkpoint)
    for name, digest in recorded.items():
        if name in found and found[name] != digest:
            raise ResumeCheckError(
                f"--resume: {checkpoint / name} is not the distillation teacher this run wrote (its sha256 differs "
                f"from the one {IDENTITY_NAME} recorded: another run's teacher, or edited), and the run would distil "
                f"from it; restore the run's own from a copy, move {checkpoint.name} out of the run folder to resume "
                "from the checkpoint before it, or start over with --overwrite"
            )


def _check_recipe_unedited(checkpoint: Path, restart: str) -> None:
    """The checkpoint's tapernorm_config.json still says what the run recorded in its identity when it wrote it.

    TaperCallback compares the file with the run's recipe too, but only once the model has loaded; an edited
    file is a damaged checkpoint, refused here before any work."""
    saved, identity = checkpoint / CONFIG_NAME, checkpoint / IDENTITY_NAME
    if not (saved.is_file() and identity.is_file()):
        return  # a baseline's checkpoint (no recipe), or one of an older version: TaperCallback checks it
    try:
        values, recorded = json.loads(saved.read_text()), json.loads(identity.read_text()).get("taper")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as error:
        raise ResumeCheckError(f"--resume: cannot read {saved} ({first_line(error)}){restart}") from None
    if not isinstance(values, dict) or not isinstance(recorded, dict):
        raise ResumeCheckError(f"--resume: {saved} holds no TaperNormConfig{restart}")
    try:  # both by option names, whichever layout each was written in
        values, recorded = (
            TaperNormConfig.from_dict(values).options(),
            TaperNormConfig.from_recorded(recorded).options(),
        )
    except ConfigurationError as error:
        raise ResumeCheckError(
            f"--resume: {saved} holds no TaperNormConfig this version reads ({error}){restart}"
        ) from None
    edited = [f"{k}: {values.get(k)!r} in the file, {v!r} recorded" for k, v in recorded.items() if values.get(k) != v]
    if edited:
        raise ResumeCheckError(
            f"--resume: {saved} was edited after the run wrote it ({'; '.join(edited[:3])}){restart}"
        )


def _unloadable(path: Path) -> Optional[str]:
    """Why the Trainer's ``torch.load(path, weights_only=True)`` (numpy's RNG state allowed, as the Trainer allows it)
    would fail, or None. Memory-mapped: an optimizer state as large as the model is not read whole."""
    try:
        with safe_globals():
            torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError:
        return "it holds pickled Python objects besides tensors, which torch refuses to load"
    except Exception as error:  # noqa: BLE001 - zipfile and torch raise many types; all mean "unloadable"
        return first_line(error)
    return None


def _unreadable(path: Path) -> Optional[str]:
    """Why ``path`` is not a whole safetensors file, or None (the header and every tensor's bytes are read)."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open has keys(), no __iter__
                handle.get_tensor(key)
    except (SafetensorError, OSError, RuntimeError, ValueError) as error:
        return first_line(error)
    return None


__all__ = ["REQUIRED_STATE", "ResumeCheckError", "check_checkpoint", "check_resumable"]
