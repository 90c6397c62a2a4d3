"""The tokenizer of a model a command reads, and where a tapered checkpoint without one finds its run's.

The Trainer saves no tokenizer into its ``checkpoint-N`` folders, and a checkpoint may be copied out of its run; fold
and eval still need the tokenizer the run trained with: its tapered/ export's, else the original model's that the run
(or the checkpoint itself, in ``tapernorm_run.json``) recorded, where that path still holds the recorded files.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

from ..evaluation.models import TOKENIZER_FILES, ModelSource, ModelSourceError, load_tokenizer, resolve_model
from ..utils import expand_user, json_object
from .fingerprints import fingerprint, holds_recorded_contents
from .run_folder import RunFolder
from .run_lock import resolved_path
from .run_membership import records_same_model
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
        sources, foreign = _checkpoint_tokenizer_sources(folder)
        if not (sources or foreign or folder.name.startswith("checkpoint-") or (folder / IDENTITY_NAME).is_file()):
            raise  # no checkpoint of a run
        for candidate in sources:
            try:
                tokenizer = load_tokenizer(candidate, trust_remote_code=trust_remote_code)
            except ModelSourceError:
                continue
            logger.info("%s holds no tokenizer: using its run's, from %s", source.path, candidate.describe())
            return tokenizer
        if foreign:
            raise ModelSourceError(
                f"{error}; it is a checkpoint of another run than the folder '{foreign[0]}' it lies in (its "
                f"{IDENTITY_NAME} records another model), and the model it records holds no tokenizer here: copy "
                "that run's tokenizer files into it"
            ) from None
        raise ModelSourceError(f"{error}; nor does its run folder hold one (tapered/, or the recorded model)") from None


def _checkpoint_tokenizer_sources(folder: Path) -> tuple[list[ModelSource], list[Path]]:
    """Where the tokenizer of the checkpoint ``folder`` is: its run's (a ``checkpoint-N``: the folder above it, and a
    baseline's run above that), then the model the checkpoint's own record names; and the run folders passed over
    because the checkpoint records another model than they do (a checkpoint of another run put there), whose
    tokenizer would score it without a word."""
    runs = []
    if folder.name.startswith("checkpoint-"):
        runs = [folder.parent, folder.parent.parent] if folder.parent.name == "baseline" else [folder.parent]
    own = json_object(folder / IDENTITY_NAME)
    identities = [(run, (RunFolder(run).manifest() or {}).get("identity")) for run in runs]
    foreign = [run for run, identity in identities if not records_same_model(own, identity)]
    for run in foreign:
        logger.info("%s records another model than its run folder %s: that run's tokenizer is not used", folder, run)
    mine = [(run, identity) for run, identity in identities if run not in foreign]
    sources = _run_tokenizer_sources(mine)
    told = any(isinstance(identity, dict) and identity.get("model") == own.get("model") for _, identity in mine)
    recorded = None if told else _recorded_model(own)  # the run's record named the same model: looked at once
    return sources + ([recorded] if recorded is not None else []), foreign


def _run_tokenizer_sources(runs: list[tuple[Path, object]]) -> list[ModelSource]:
    """Where a taper run's tokenizer is: each run folder's tapered/ export, then the original model its ``identity``
    recorded. Only the tokenizer is wanted: a tapered/ that cannot lend it (its tapernorm_config.json lost) is
    skipped, as the recorded model is; refusing it refused eval of a complete checkpoint-N."""
    sources = []
    for run, identity in runs:
        if (run / "tapered" / "config.json").is_file():
            try:
                sources.append(resolve_model(str(run / "tapered"), weights=False))  # only its tokenizer is read
            except ModelSourceError as error:
                logger.info("%s lends no tokenizer: %s", run / "tapered", error)
        recorded = _recorded_model(identity if isinstance(identity, dict) else {})
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
    """Whether the model path a run recorded (as typed) holds that model's tokenizer from this working folder. An
    absolute path must still hold the tokenizer files the run recorded (``contents``, its model_contents): a model
    given another tokenizer since would lend it without a word, as --resume refuses; a run of an older version that
    recorded no contents has only its path. A relative path is relative to the taper's working folder, which the
    manifest does not record: from another folder it may name another model, so all its recorded files must match."""
    path = expand_user(recorded, strict=False)  # recorded on another machine, a ~user may be unknown here
    if not path.exists():
        return False
    if not isinstance(contents, dict):
        if path.is_absolute():
            return True
    elif path.is_absolute():
        if _holds_recorded_tokenizer(path, contents):
            return True
        logger.warning(
            "the run recorded its model '%s', whose tokenizer files are not the ones the run recorded (changed "
            "since): its tokenizer is not used",
            recorded,
        )
        return False
    elif holds_recorded_contents(recorded, contents):
        return True
    logger.warning(
        "the run recorded its model as '%s', relative to the folder it was started in; '%s' here holds another model, "
        "whose tokenizer is not used",
        recorded,
        path.resolve(),
    )
    return False


def _holds_recorded_tokenizer(path: Path, contents: dict) -> bool:
    """Whether the model folder ``path`` holds the tokenizer files (TOKENIZER_FILES) its recorded ``contents`` list,
    by sha256, and no other: only its tokenizer is lent, so new weights saved over the model change nothing. A GGUF
    file, or contents that list no tokenizer file, must match whole."""
    recorded = {name: digest for name, digest in contents.items() if name in TOKENIZER_FILES}
    if path.is_file() or not recorded:
        return holds_recorded_contents(str(path), contents)
    found = {}
    for name in TOKENIZER_FILES:
        try:
            found.update(fingerprint(str(path / name)) or {})
        except OSError:
            return False
    return found == recorded


__all__ = ["tokenizer_of"]
