"""What a local file or folder holds, by digest: a run records its model's and data's (run_identity), so the same
path with other contents (another model under a relative path, a fine-tune saved over it, edited data) is told
apart on --resume, by a run folder's hints and by the tokenizer a fold or eval finds.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Optional

from ..data.local_folders import data_file_names
from ..utils import expand_user

#: The weight files of a model folder (or a GGUF file): identified by size and sampled chunks; with config.json,
#: what makes two folders the same model.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf")

#: Files above this size are identified by size and modification time instead of their SHA-256.
_HASHED_BYTES = 1 << 30


#: A large file's fingerprint reads this many evenly spaced chunks of _SAMPLE_BYTES (the whole file when smaller).
_SAMPLES, _SAMPLE_BYTES = 32, 1 << 18


def _sampled_digest(file: Path, size: int) -> str:
    """SHA-256 of evenly spaced chunks of ``file``: other weights of the same size (a fine-tune of the same model
    saved over it) change every tensor, so they differ here too, at the cost of a few MiB read, not the file."""
    digest = hashlib.sha256()
    with file.open("rb") as handle:
        if size <= _SAMPLES * _SAMPLE_BYTES:
            digest.update(handle.read())
        else:
            for index in range(_SAMPLES):
                handle.seek((size - _SAMPLE_BYTES) * index // (_SAMPLES - 1))
                digest.update(handle.read(_SAMPLE_BYTES))
    return digest.hexdigest()


def fingerprint(path: Optional[str], *, weights_by_size: bool = False) -> Optional[dict[str, Any]]:
    """What a local file or folder holds (relative name -> SHA-256, or size): the same path with other contents is
    another dataset or model. None for a Hub name. ``weights_by_size``: identify ``*.safetensors``/``*.bin``/``*.gguf``
    by size and a hash of evenly spaced chunks (hashing a model's weights whole at every start costs minutes)."""
    root = expand_user(path) if path else None
    if root is None or not root.exists():
        return None
    files = [root] if root.is_file() else _visible_files(root)
    found = {}
    for file in files:
        name = file.name if root.is_file() else file.relative_to(root).as_posix()
        info = file.stat()
        by_size = info.st_size > _HASHED_BYTES or (weights_by_size and file.suffix in WEIGHT_SUFFIXES)
        if by_size:
            found[name] = f"{info.st_size} bytes, sampled sha256 {_sampled_digest(file, info.st_size)}"
        else:
            with file.open("rb") as handle:
                found[name] = hashlib.file_digest(handle, "sha256").hexdigest()
    return found


def _visible_files(root: Path) -> list[Path]:
    """The files under ``root`` but hidden ones and those in hidden folders (``.git/`` of a cloned model repository,
    ``.cache/`` of a Hub download): what git or a download tool writes there is no part of the model or data."""
    found = []
    for folder, folders, names in os.walk(root):
        folders[:] = [name for name in folders if not name.startswith(".")]
        found += [Path(folder, name) for name in names if not name.startswith(".") and Path(folder, name).is_file()]
    return sorted(found)


def visible_contents(contents: dict[str, Any]) -> dict[str, Any]:
    """Recorded ``contents`` without the files in hidden folders, which older versions recorded too (they left out
    hidden file names already; a single hidden file given as a dataset or model is its own contents)."""
    return {name: value for name, value in contents.items() if not any(p.startswith(".") for p in name.split("/")[:-1])}


#: What a model folder carries beside the model (its card, notes, licence, pictures): no load reads it, so adding or
#: editing one changes neither the model nor a run of it.
_DOCUMENTATION_SUFFIXES = (".md", ".png", ".jpg", ".jpeg", ".gif", ".svg", ".webp")
_DOCUMENTATION_STEMS = ("LICENSE", "LICENCE", "NOTICE", "COPYING")


def model_files(contents: dict[str, Any]) -> dict[str, Any]:
    """A model folder's recorded ``contents`` as a run compares them: visible_contents without its documentation (a
    README.md or NOTES.md added, a model card edited, a licence file)."""
    return {
        name: value
        for name, value in visible_contents(contents).items()
        if Path(name).suffix.lower() not in _DOCUMENTATION_SUFFIXES
        and Path(name).stem.upper() not in _DOCUMENTATION_STEMS
    }


def with_data_as_read(saved: dict[str, Any], current: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Two identities (compared_identity's) with a dataset folder's contents cut to the files read as data
    (data_file_names, of the names either records): a notes.md added beside JSON Lines changes no data. A dataset
    that is one file is its own contents, whatever its name."""
    old, new = saved.get("data"), current.get("data")
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return saved, current
    contents = [part.get("contents") for part in (old, new)]
    folder = expand_user(str(new.get("dataset") or ""), strict=False)
    if not all(isinstance(c, dict) for c in contents) or not folder.is_dir():
        return saved, current
    read = data_file_names(set(contents[0]) | set(contents[1]))
    cut = [{**part, "contents": {k: v for k, v in c.items() if k in read}} for part, c in zip((old, new), contents)]
    return {**saved, "data": cut[0]}, {**current, "data": cut[1]}


def compared_identity(identity: dict[str, Any]) -> dict[str, Any]:
    """A run's ``identity`` as ``--resume`` compares it: its model's contents as model_files, its data's as
    visible_contents (a dataset folder's README.md is data). A run an older version recorded with its model's
    ``.git/`` files resumes after a git action there, and a notes file added beside the model changes no run."""
    identity = {**identity}
    if isinstance(identity.get("model_contents"), dict):
        identity["model_contents"] = model_files(identity["model_contents"])
    data = identity.get("data")
    if isinstance(data, dict) and isinstance(data.get("contents"), dict):
        identity["data"] = {**data, "contents": visible_contents(data["contents"])}
    return identity


def _defines_the_model(name: str) -> bool:
    """A weight file (``WEIGHT_SUFFIXES``) or the config: what the model computes (a changed activation or rope base
    is another model with the same weights); notes and tokenizer settings are not."""
    return Path(name).suffix in WEIGHT_SUFFIXES or name == "config.json"


def weights_and_config(path: str) -> Optional[dict[str, Any]]:
    """The fingerprint of the weight files and config.json of the local model at ``path`` (None: not there), what
    holds_recorded_weights compares later: a run records its baseline's, so a scan does not compare with that
    folder once other weights are saved over it."""
    found = fingerprint(path, weights_by_size=True)
    return None if found is None else {name: value for name, value in found.items() if _defines_the_model(name)}


def holds_recorded_weights(path: str, contents: dict[str, Any]) -> bool:
    """Whether the local model at ``path`` holds the weight files and config.json a run recorded of its model,
    whatever else changed beside them (a notes file, a re-saved tokenizer_config.json, a weight file transformers does
    not load: a ``.bin`` beside safetensors, a ``consolidated.safetensors`` beside the model's): the same model to
    compare with. config.json is compared by its bytes (only its digest was recorded), so a re-save by another
    transformers version counts as a change. Where no weight file was recorded, every recorded file
    (holds_recorded_contents). The same tensors saved into other files (shards joined) cannot be told the same
    without reading them: not the recorded files."""
    recorded = {name: v for name, v in visible_contents(contents).items() if _defines_the_model(name)}
    if not any(Path(name).suffix in WEIGHT_SUFFIXES for name in recorded):
        return holds_recorded_contents(path, contents)
    if any(name.endswith(".safetensors") for name in recorded):  # what transformers loads beside a .bin
        recorded = {name: v for name, v in recorded.items() if not name.endswith(".bin")}
    try:
        found = fingerprint(path, weights_by_size=True) or {}
    except OSError:  # unreadable here: not shown to hold the run's model
        return False
    if not any(name.endswith(".safetensors") for name in recorded) and any(n.endswith(".safetensors") for n in found):
        return False  # safetensors where the run read a .bin: what transformers loads now
    if "model.safetensors" in found and "model.safetensors" not in recorded:
        return False  # one file beside the shards the run read: transformers loads it first
    weights = {name: found[name] for name in recorded if name in found}  # other files beside are not loaded
    return with_legacy_fingerprints({"model_contents": recorded}, {"model_contents": weights})["model_contents"] == (
        recorded
    )


def holds_recorded_contents(path: str, contents: dict[str, Any]) -> bool:
    """Whether the local model at ``path`` holds the files a run recorded of its model (``model_contents`` of
    run_identity), a weight file an older version recorded by its size alone ("N bytes") matching by that size."""
    try:
        found = fingerprint(path, weights_by_size=True)
    except OSError:  # unreadable here: not shown to hold the run's model
        return False
    if found is None:
        return False
    contents = model_files(contents)
    recorded = {"model_contents": contents}
    return with_legacy_fingerprints(recorded, {"model_contents": model_files(found)})["model_contents"] == contents


def with_legacy_fingerprints(saved: dict[str, Any], identity: dict[str, Any]) -> dict[str, Any]:
    """``identity`` with each sampled weight fingerprint cut to the "N bytes" that runs of older versions recorded
    for the same file, so such a run still resumes (its weights were identified by size only)."""
    old, new = saved.get("model_contents"), identity.get("model_contents")
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return identity
    contents = {
        name: old[name]
        if isinstance(old.get(name), str) and old[name].endswith(" bytes") and str(value).startswith(old[name] + ",")
        else value
        for name, value in new.items()
    }
    return {**identity, "model_contents": contents}


__all__ = [
    "WEIGHT_SUFFIXES",
    "fingerprint",
    "holds_recorded_contents",
    "holds_recorded_weights",
    "visible_contents",
    "compared_identity",
    "with_data_as_read",
    "model_files",
    "with_legacy_fingerprints",
]
