"""Where ``TaperNormConfig.from_pretrained`` finds a recipe: a tapered checkpoint's ``tapernorm_config.json``, or a
folded export's ``config.json`` (the recipe is its ``tapernorm_config`` field: an export is one config and its
weights), in a local folder or a Hub repository.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional, Union

from .errors import ConfigurationError
from .utils import expand_user

#: The file a tapered checkpoint keeps its recipe in.
CONFIG_NAME = "tapernorm_config.json"


def recipe_values(name_or_path: Union[str, os.PathLike], revision: Optional[str], token: Union[str, bool, None]) -> Any:
    """The recipe's values (``TaperNormConfig.from_dict`` reads them) in a local folder, else in the Hub repository
    ``name_or_path`` (``revision`` and ``token`` passed to ``huggingface_hub.hf_hub_download``)."""
    local = expand_user(name_or_path, f"TaperNormConfig.from_pretrained: '{name_or_path}'")
    if local.is_dir():
        if (local / CONFIG_NAME).is_file():
            return _json(local / CONFIG_NAME)
        return _recipe_of_export(local / "config.json", str(name_or_path))
    if _looks_like_a_path(str(name_or_path)):
        raise ConfigurationError(f"TaperNormConfig.from_pretrained: no folder '{name_or_path}'")
    try:
        return _json(Path(_download(str(name_or_path), CONFIG_NAME, revision, token)))
    except ConfigurationError as missing:  # an export on the Hub keeps its recipe in config.json
        try:
            config = Path(_download(str(name_or_path), "config.json", revision, token))
        except ConfigurationError:
            raise missing from None
        return _recipe_of_export(config, str(name_or_path))


def _recipe_of_export(config_file: Path, name: str) -> dict[str, Any]:
    """The recipe a folded export's config.json holds (``tapernorm_config``), refused in one line where it holds none:
    a FlashNorm export (folded without a taper) or no export of this package."""
    config = _json(config_file) if config_file.is_file() else None
    values = config.get("tapernorm_config") if isinstance(config, dict) else None
    if isinstance(values, dict) and values:
        return values
    if isinstance(values, dict):
        raise ConfigurationError(
            f"'{name}' is a FlashNorm export (its norm weights folded without a taper): it was made with no "
            "TaperNormConfig"
        )
    raise ConfigurationError(
        f"no {CONFIG_NAME} in '{name}', nor a tapernorm_config in its config.json: neither a tapered checkpoint nor "
        "an export written by hf_tapernorm"
    )


def _json(path: Path) -> Any:
    """The JSON value in ``path`` (TaperNormConfig.from_dict names a value that is no object)."""
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigurationError(f"{path} is not valid JSON: {error}") from None


def _looks_like_a_path(name: str) -> bool:
    """A Hub repository id is ``name`` or ``owner/name``; anything else can only be a local path."""
    return not name or name.count("/") > 1 or name.startswith((".", "/", "~")) or "\\" in name


def _download(repo_id: str, filename: str, revision: Optional[str], token: Union[str, bool, None]) -> str:
    from huggingface_hub import hf_hub_download

    try:
        return hf_hub_download(repo_id, filename, revision=revision, token=token)
    except Exception as error:  # huggingface_hub raises many types (offline, not found, gated, network)
        reason = (str(error).strip().splitlines() or [""])[0]
        raise ConfigurationError(
            f"TaperNormConfig.from_pretrained('{repo_id}'): not a local folder, and {filename} could not be "
            f"read from the Hub ({type(error).__name__}: {reason}); check the name, the network, HF_HUB_OFFLINE"
        ) from None


__all__ = ["CONFIG_NAME", "recipe_values"]
