"""The layouts of ``tapernorm_config.json`` and the steps between them.

A file records the layout of its fields (``config_version``; absent means version 1). A field added later
takes its dataclass default when an older file lacks it, which is right only while that default means what
the older version did; where it does not, a migration step writes the old meaning in, so that a later change
of a default cannot change what an old checkpoint means.
"""

from __future__ import annotations

import logging
from typing import Any

from .errors import ConfigurationError

logger = logging.getLogger(__name__)

#: The key of ``tapernorm_config.json`` that records the layout of its fields (absent: version 1).
CONFIG_VERSION_KEY = "config_version"
#: The layout this version writes. ``TaperNormConfig.from_dict`` migrates an older one step by step.
CONFIG_VERSION = 3


def _from_version_1(values: dict[str, Any]) -> dict[str, Any]:
    """Version 1 (files without ``config_version``) could lack the distillation and linear-branch fields
    added later; an absent one meant what version 1 did, which is written in now, so that a later change of a
    default cannot change what an old checkpoint means."""
    implied = {"distill_until": "end", "distill_schedule": "constant", "linear_fit": "paper", "calibration_scale": 1.0}
    return {**{k: v for k, v in implied.items() if k not in values}, **values}


#: Version 3's closed set of recipe names (version 2 recorded any text): the names its presets wrote, and custom.
_RECIPES_3 = (
    "paper",
    "paper+keep_qk_norms",
    "gated-mlp",
    "paper (final norm)",
    "paper+keep_qk_norms (final norm)",
    "gated-mlp (final norm)",
    "custom",
)


def _from_version_2(values: dict[str, Any]) -> dict[str, Any]:
    """Version 3 groups the teacher's settings (``distill_weight``, ``distill_until`` and
    ``sink_attention_weight`` become ``distillation``'s ``weight``, ``until`` and ``sink_attention_weight``), moves
    the research options (``linear_fit``, ``calibration_scale``, ``distill_from``, ``distill_schedule``) into
    ``experimental`` under their names, and names the recipe from a closed set: a name no preset wrote (version 2
    took any text) is ``custom``, which is what such a name meant (values set by hand); a value that is no text
    is left for the config to refuse."""
    result = dict(values)
    grouped = {"distill_weight": "weight", "distill_until": "until", "sink_attention_weight": "sink_attention_weight"}
    result["distillation"] = {new: result.pop(old) for old, new in grouped.items() if old in result}
    research = ("linear_fit", "calibration_scale", "distill_from", "distill_schedule")
    result["experimental"] = {name: result.pop(name) for name in research if name in result}
    if isinstance(result.get("recipe"), str) and result["recipe"] not in _RECIPES_3:
        result["recipe"] = "custom"
    return result


#: Migration steps: ``MIGRATIONS[n]`` turns the fields of version n into those of version n + 1.
MIGRATIONS = {1: _from_version_1, 2: _from_version_2}


def migrated(values: dict[str, Any], version: Any) -> dict[str, Any]:
    """``values`` of layout ``version`` migrated to CONFIG_VERSION, with one log line naming what changed."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ConfigurationError(f"TaperNormConfig: {CONFIG_VERSION_KEY} must be a positive integer, got {version!r}")
    if version > CONFIG_VERSION:
        logger.warning(
            "TaperNormConfig: written with %s %d, newer than this version's %d; reading the fields it knows",
            CONFIG_VERSION_KEY,
            version,
            CONFIG_VERSION,
        )
        return values
    result = dict(values)
    for step in range(version, CONFIG_VERSION):
        result = MIGRATIONS[step](result)
    added = {k: v for k, v in result.items() if k not in values or values[k] != v}
    if added:
        logger.warning(
            "TaperNormConfig: migrated a %s %d config to %d: %s (what version %d meant); save it again to keep it",
            CONFIG_VERSION_KEY,
            version,
            CONFIG_VERSION,
            ", ".join(f"{k}={v!r}" for k, v in sorted(added.items())),
            version,
        )
    return result
