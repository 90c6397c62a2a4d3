"""The tokenizer of a model a command reads, and where a tapered checkpoint without one finds its run's.

The Trainer saves no tokenizer into its ``checkpoint-N`` folders, and a checkpoint may be copied out of its run; fold
and eval still need the tokenizer the run trained with: its tapered/ export's, else the original model's that the run
(or the checkpoint itself, in ``tapernorm_run.json``) recorded, where that path still holds the recorded files.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

from ..evaluation.models import ModelSource, ModelSourceError, load_tokenizer, resolve_model
from ..utils import expand_user
from .fingerprints import holds_recorded_contents
from .run_folder import RunFolder
from .run_lock import resolved_path
from .training_run import IDENTITY_NAME

logger = logging.getLogger(__name__)


def tokenizer_of(source: ModelSource, *, trust_remote_code: bool = False):
    """The model's tokenizer; for a tapered checkpoint without one (a Trainer ``checkpoint-N``, or one copied out of
    its run) its run's: its tapered/ export's, else the original model's that the run or the checkpoint recorded.
    ModelSourceError when there is none."""
    try:
        return load_tokenizer(source, trust_remote_code=trust_remote_code)
    except ModelSourceError as error:
        folder = resolved_path(source.path, f"model '{source.path}'")
        sources = _checkpoint_tokenizer_sources(folder)
        if not sources and not folder.name.startswith("checkpoint-"):
            raise
        for candidate in sources:
            try:
                tokenizer = load_tokenizer(candidate, trust_remote_code=trust_remote_code)
            except ModelSourceError:
                continue
            logger.info("%s holds no tokenizer: using its run's, from %s", source.path, candidate.describe())
            return tokenizer
        raise ModelSourceError(f"{error}; nor does its run folder hold one (tapered/, or the recorded model)") from None


def _checkpoint_tokenizer_sources(folder: Path) -> list[ModelSource]:
    """Where the tokenizer of the checkpoint ``folder`` is: its run's (a ``checkpoint-N``: the folder above it, and a
    baseline's run above that), then the model the checkpoint's own record names."""
    runs = []
    if folder.name.startswith("checkpoint-"):
        runs = [folder.parent, folder.parent.parent] if folder.parent.name == "baseline" else [folder.parent]
    sources = _run_tokenizer_sources(runs)
    try:
        own = json.loads((folder / IDENTITY_NAME).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        own = None
    recorded = _recorded_model(own if isinstance(own, dict) else {})
    return sources + ([recorded] if recorded is not None else [])


def _run_tokenizer_sources(runs: list[Path]) -> list[ModelSource]:
    """Where a taper run's tokenizer is: each run folder's tapered/ export, then the original model it recorded. Only
    the tokenizer is wanted: a tapered/ that cannot lend it (its tapernorm_config.json lost) is skipped, as the
    recorded model is; refusing it refused eval of a complete checkpoint-N."""
    sources = []
    for run in runs:
        if (run / "tapered" / "config.json").is_file():
            try:
                sources.append(resolve_model(str(run / "tapered"), weights=False))  # only its tokenizer is read
            except ModelSourceError as error:
                logger.info("%s lends no tokenizer: %s", run / "tapered", error)
        recorded = _recorded_model((RunFolder(run).manifest() or {}).get("identity") or {})
        if recorded is not None:
            sources.append(recorded)
    return sources


def _recorded_model(identity: dict) -> Optional[ModelSource]:
    """The original model a run's ``identity`` records (its ``model``, as typed), where that path holds it here
    (_holds_recorded_model); None otherwise."""
    recorded = identity.get("model")
    if not isinstance(recorded, str) or not _holds_recorded_model(recorded, identity.get("model_contents")):
        return None
    try:
        return resolve_model(recorded, weights=False)
    except ModelSourceError:
        return None


def _holds_recorded_model(recorded: str, contents: object) -> bool:
    """Whether the model path a run recorded (as typed) holds that model from this working folder: an absolute path
    that is there, or a relative one whose files are the ones the run recorded (``contents``). A relative path is
    relative to the taper's working folder, which the manifest does not record: from another folder it may name
    another model, whose tokenizer would score the checkpoint without a word."""
    path = expand_user(recorded, strict=False)  # recorded on another machine, a ~user may be unknown here
    if not path.exists():
        return False
    if path.is_absolute() or (isinstance(contents, dict) and holds_recorded_contents(recorded, contents)):
        return True
    logger.warning(
        "the run recorded its model as '%s', relative to the folder it was started in; '%s' here holds another model, "
        "whose tokenizer is not used",
        recorded,
        path.resolve(),
    )
    return False


__all__ = ["tokenizer_of"]
