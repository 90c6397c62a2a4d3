"""TaperNormConfig: every choice of a taper recipe in one serializable object (as PEFT's ``LoraConfig``).

``patch_model(model, config)`` applies it; ``TaperCallback``/``TaperController`` read the schedule,
the distillation and the scale loss from the config the patched model carries; the CLI builds it from
its flags; tapered checkpoints save it as ``tapernorm_config.json`` and folded exports record it in
their ``config.json``. So a run is described by one object, wherever it was started.

Two presets:

- :meth:`TaperNormConfig.paper` is the published recipe (every internal norm, scalar c from the
  warmup's EMA, the absolute fixed-target scale loss, no sink, no distillation);
- :meth:`TaperNormConfig.for_model` derives the recipe for a pretrained model from its structure
  (``architectures/recipe_rules.py``): models with a gated (SwiGLU/GeGLU) MLP get the recipe measured on
  SmolLM2 (the norms in front of the gated MLPs, any q/k norms and the attention norms of the layers
  where a runaway starts kept, the BOS kept normalized as the attention sink, the relative scale loss,
  distillation from the model as it was when the gate started to fall, with the sink-attention term);
  GELU families (GPT-2) get the paper's recipe, minus any q/k norms.
  The evidence is in docs/fidelity.md.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import operator
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

from torch import nn

from ._version import __version__
from .architectures.recipe_rules import norms_to_keep
from .architectures.sites import architecture_of
from .config_migrations import CONFIG_VERSION, CONFIG_VERSION_KEY, migrated
from .errors import ConfigurationError, TaperStateError

logger = logging.getLogger(__name__)

CONFIG_NAME = "tapernorm_config.json"
#: The key of ``tapernorm_config.json`` (and of an export's ``config.json``) that records the package version.
VERSION_KEY = "hf_tapernorm_version"

Scope = Literal["internal", "final", "all"]
LinearFit = Literal["paper", "per_channel"]
Teacher = Literal["gate_start", "original", "current"]
DistillUntil = Literal["end", "taper_end"]
DistillSchedule = Literal["constant", "gate"]
Step = Union[int, float]  # int: an optimizer step; float in (0, 1]: a fraction of the run

#: Marks the help of the options kept for research (docs/method.md): they work, but are not the recipe.
EXPERIMENTAL = "[experimental]"


def _option(default: Any, help: str, **kwargs: Any) -> Any:
    """A recipe field with its help text: the one declaration the CLI's flags are generated from."""
    if callable(default):
        return field(default_factory=default, metadata={"help": help}, **kwargs)
    return field(default=default, metadata={"help": help}, **kwargs)


def check_step(name: str, value: Any) -> None:
    """An optimizer step (an int >= 0, checked against the run's length later) or a fraction of the run in (0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigurationError(
            f"{name} must be an int (optimizer step) or a float (fraction of the run), got {value!r}"
        )
    if isinstance(value, float) and not 0.0 < value <= 1.0:
        raise ConfigurationError(
            f"{name}={value!r}: a float is a fraction of the run and must be in (0, 1]; pass an int for an "
            "optimizer step"
        )
    if isinstance(value, int) and value < 0:
        raise ConfigurationError(f"{name}={value!r}: an optimizer step cannot be negative")


def parse_step(text: Union[str, Step], name: str) -> Step:
    """A step written as text: ``"5"`` -> 5 (an optimizer step), ``"0.05"`` -> 0.05 (a fraction of the run).
    Errors name the field (``TaperNormConfig.<name>``)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        step = text
    else:
        try:
            step = float(text) if any(ch in str(text) for ch in ".eE") else int(text)
        except ValueError:
            raise ConfigurationError(
                f"TaperNormConfig.{name} must be an optimizer step (int) or a fraction of the run (float), got {text!r}"
            ) from None
    check_step(f"TaperNormConfig.{name}", step)
    return step


@dataclass
class TaperNormConfig:
    """Every choice of a taper recipe. Fields are validated on construction (``ConfigurationError``, naming
    the field); each field's ``metadata["help"]`` is its documentation, and the CLI's ``--help``.

    Fields marked experimental (``linear_fit="per_channel"``, ``calibration_scale``, ``distill_from`` other
    than ``"gate_start"``, ``distill_schedule="gate"``) are kept for the research in
    conversion_scripts/experiments; no preset uses them. Presets: :meth:`paper` and :meth:`for_model`. A bare
    ``TaperNormConfig()`` holds the paper's values (``recipe="custom"``: nothing derived from a model), while
    ``patch_model(model)`` without a config applies :meth:`for_model` and logs that it did. The method
    behind the fields: docs/method.md.
    """

    # Which norms taper
    scope: Scope = _option(
        "internal",
        "Which norms taper: internal (every norm inside the decoder layers; the final norm stays and anchors "
        "the output scale) | final | all.",
    )
    keep_norms: list[str] = _option(
        list,
        "fnmatch patterns of qualified module names whose norms stay real norms although scope covers them, "
        "e.g. 'model.layers.*.post_attention_layernorm'; each must match a norm. A single string is one pattern.",
    )
    sink_token_ids: list[int] = _option(
        list,
        "Leading token ids every sequence starts with (e.g. the BOS), kept normalized at every gate and folded "
        "as a constant key/value prefix.",
    )
    # The linear branch
    linear_fit: LinearFit = _option(
        "paper",
        "Start of the linear branch: paper (scalar c from the warmup's EMA) | per_channel "
        f"{EXPERIMENTAL} (per-channel least squares over the same warmup statistics).",
    )
    calibration_scale: float = _option(
        1.0, f"{EXPERIMENTAL} Multiply every calibrated c by this (< 1: a conservative linear branch); > 0."
    )
    ema_rate: float = _option(0.01, "New-sample weight of the calibration and scale-target EMAs, in (0, 1].")
    # The scale anchor
    scale_loss_weight: float = _option(
        0.1,
        "lambda of the fixed-target scale loss on the residual stream entering the final norm, >= 0 (0 turns "
        "the loss off; the scale is still measured).",
    )
    relative_scale_loss: bool = _option(False, "Penalise (s / s_tgt - 1)^2 instead of the paper's (s - s_tgt)^2.")
    # Distillation (KL to a teacher)
    distill_weight: float = _option(0.0, "Weight of the KL term to the teacher (distill_from), >= 0 (0: off).")
    distill_from: Teacher = _option(
        "gate_start",
        "Teacher: gate_start (a frozen copy of the model when the gate first falls below 1) | original "
        f"{EXPERIMENTAL} (a frozen copy before training) | current {EXPERIMENTAL} (the model itself at gate 1, "
        "on the same batch: no copy).",
    )
    distill_until: DistillUntil = _option(
        "end",
        "Distil to the end of the run, or only until the gate reaches 0 (taper_end): the teacher is then "
        "dropped and a step costs what a normalized step costs.",
    )
    distill_schedule: DistillSchedule = _option(
        "constant",
        f"The KL term's weight over the run: constant (distill_weight throughout) | gate {EXPERIMENTAL} "
        "(distill_weight times the current gate: full while the model is still normalized, fading to 0 as the "
        "gate closes).",
    )
    sink_attention_weight: float = _option(
        0.0,
        "Weight of the sink-attention term, >= 0 (0: off): KL between the teacher's and the model's share of "
        "attention on the sink tokens (sink_token_ids), per layer, head and position. It reads the distillation's "
        "teacher forward (needs distill_weight > 0); training forwards report the sink's share through sdpa (eager "
        "attention for models sdpa cannot serve).",
    )
    # The schedule
    taper_start: Step = _option(
        0.05,
        "Optimizer step (int) or fraction of the run (float in (0, 1]) where the gate starts to fall "
        "(calibration ends).",
    )
    taper_end: Step = _option(
        0.70, "Optimizer step (int) or fraction of the run (float in (0, 1]) where the gate reaches 0."
    )
    recipe: str = _option(
        "custom", "Where the values came from (paper, gated-mlp, custom), recorded in reports and exports."
    )

    def __post_init__(self) -> None:
        for name, value in self.check_values(
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        ).items():
            setattr(self, name, value)
        if self.sink_attention_weight > 0 and (self.distill_weight == 0 or not self.sink_token_ids):
            missing = "distill_weight > 0 (its teacher)" if self.distill_weight == 0 else "sink_token_ids (the sink)"
            raise ConfigurationError(
                f"TaperNormConfig.sink_attention_weight={self.sink_attention_weight:g} needs {missing}; "
                "set sink_attention_weight=0 to train without the term"
            )
        if type(self.taper_start) is type(self.taper_end) and not self.taper_end > self.taper_start:
            raise ConfigurationError(
                f"TaperNormConfig.taper_end ({self.taper_end}) must come after taper_start ({self.taper_start})"
            )

    @classmethod
    def choices(cls, name: str) -> Optional[tuple[str, ...]]:
        """The values a ``Literal`` field allows (None for a field without choices)."""
        hint = _type_hints(cls)[name]
        return typing.get_args(hint) if typing.get_origin(hint) is Literal else None

    @classmethod
    def check_values(cls, **values: Any) -> dict[str, Any]:
        """Each given field checked and normalized on its own (``ConfigurationError`` naming the field); the
        checks between fields run on construction. The CLI calls this when it parses its flags."""
        known = {f.name for f in dataclasses.fields(cls)}
        checked = {}
        for name, value in values.items():
            if name not in known:
                raise ConfigurationError(f"TaperNormConfig has no field {name!r}; known: {', '.join(sorted(known))}")
            checked[name] = _checked(cls, name, value)
        return checked

    # ------------------------------------------------------------------ presets
    @classmethod
    def paper(cls, **overrides: Any) -> TaperNormConfig:
        """The published recipe (arXiv 2602.10408): every internal norm, the absolute scale loss, no sink,
        no distillation, taper from 5% to 70% of the run. For GELU models and training from scratch."""
        return cls(**{"recipe": "paper", **overrides})

    @classmethod
    def for_model(cls, model: nn.Module, tokenizer: Any = None, **overrides: Any) -> TaperNormConfig:
        """The recipe for ``model``, derived from its architecture (module docstring, docs/fidelity.md).

        ``tokenizer`` (or, without one, ``model.config.bos_token_id``) gives the BOS id that gated-MLP
        recipes keep as the attention sink; every training sequence must then start with it. ``overrides``
        replace any field.
        """
        arch = architecture_of(model)
        keep = norms_to_keep(model)
        for path, reason in keep.items():
            logger.debug("recipe keeps %s: %s", path, reason)
        if not arch.gated_mlp:
            values: dict[str, Any] = {"recipe": "paper+keep_qk_norms" if keep else "paper", "keep_norms": list(keep)}
        else:
            values = {
                "recipe": "gated-mlp",
                "keep_norms": list(keep),
                "sink_token_ids": cls._sink(model, tokenizer),
                "relative_scale_loss": True,
                "distill_weight": 1.0,
                "distill_from": "gate_start",
                "sink_attention_weight": 1.0,
            }
        if overrides.get("scope") == "final":  # no internal norm tapers: nothing to keep, no sink, no teacher
            values.update(
                recipe=f"{values['recipe']} (final norm)",
                keep_norms=[],
                sink_token_ids=[],
                distill_weight=0.0,
                sink_attention_weight=0.0,
            )
        values = {**values, **overrides}
        if "sink_attention_weight" not in overrides and values.get("sink_attention_weight", 0.0) > 0:
            # The term follows what it needs: without a teacher or a sink (overridden away), it is off, not refused.
            lacking = [name for name in ("distill_weight", "sink_token_ids") if not values.get(name)]
            if lacking:
                logger.info("recipe: no sink-attention term (%s overridden to none)", " and ".join(lacking))
                values["sink_attention_weight"] = 0.0
        return cls(**values)

    @staticmethod
    def _sink(model: nn.Module, tokenizer: Any) -> list[int]:
        bos = sink_token_id(tokenizer, model)
        if bos is None:
            logger.warning(
                "%s: no BOS token id (tokenizer BOS/EOS, or config.bos_token_id), so the recipe keeps no attention "
                "sink normalized; pretrained Llama-family models park a massive activation on their first token "
                "(docs/fidelity.md)",
                type(model).__name__,
            )
            return []
        return [bos]

    # ------------------------------------------------------------------ serialization
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TaperNormConfig:
        """The config of ``values`` (``to_dict`` or a ``tapernorm_config.json``). Keys this version does not
        know (a file from a newer version) are dropped with one warning naming them, as PEFT does, so an
        older install still reads a newer file; the recorded package version is not a field."""
        if not isinstance(values, Mapping):
            raise ConfigurationError(
                f"TaperNormConfig.from_dict expects a mapping of field names to values, got a {type(values).__name__}"
            )
        values = dict(values)
        version = values.pop(VERSION_KEY, None)
        values = migrated(values, values.pop(CONFIG_VERSION_KEY, 1))
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            logger.warning(
                "TaperNormConfig: ignoring unknown field(s) %s (written by hf_tapernorm %s; this is %s)",
                ", ".join(unknown),
                version or "of an unknown version",
                __version__,
            )
        return cls(**{k: v for k, v in values.items() if k in known})

    def to_json_string(self) -> str:
        """``tapernorm_config.json``: every field, the package version that wrote it and the layout's version."""
        values = {**self.to_dict(), VERSION_KEY: __version__, CONFIG_VERSION_KEY: CONFIG_VERSION}
        return json.dumps(values, indent=2, sort_keys=True) + "\n"

    def save_pretrained(self, folder: Union[str, os.PathLike]) -> Path:
        """Write ``tapernorm_config.json`` into ``folder`` (created if missing); returns the file."""
        path = Path(folder) / CONFIG_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json_string())
        return path

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: Union[str, os.PathLike],
        *,
        revision: Optional[str] = None,
        token: Union[str, bool, None] = None,
    ) -> TaperNormConfig:
        """The config in a local folder, or in a Hub repository (``tapernorm_config.json`` at its root,
        downloaded with ``huggingface_hub.hf_hub_download``; ``revision`` and ``token`` are passed on)."""
        path = Path(name_or_path) / CONFIG_NAME
        if Path(name_or_path).is_dir():
            if not path.is_file():
                raise ConfigurationError(
                    f"no {CONFIG_NAME} in '{name_or_path}': not a tapered checkpoint written by hf_tapernorm"
                )
        elif _looks_like_a_path(str(name_or_path)):
            raise ConfigurationError(f"TaperNormConfig.from_pretrained: no folder '{name_or_path}'")
        else:
            path = Path(_download(str(name_or_path), revision, token))
        try:
            values = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ConfigurationError(f"{path} is not valid JSON: {error}") from None
        return cls.from_dict(values)

    def replace(self, **changes: Any) -> TaperNormConfig:
        return dataclasses.replace(self, **changes)


def _checked(cls: type, name: str, value: Any) -> Any:
    """One field's value, normalized (a single pattern or id becomes a list), or a ConfigurationError."""
    label = f"TaperNormConfig.{name}"
    choices = cls.choices(name)
    hint = _type_hints(cls)[name]
    if choices is not None:
        if value not in choices:
            raise ConfigurationError(f"{label} must be one of {', '.join(choices)}, got {value!r}")
    elif name == "keep_norms":
        value = [] if value is None else [value] if isinstance(value, str) else value
        if not isinstance(value, (list, tuple)) or not all(isinstance(p, str) for p in value):
            raise ConfigurationError(f"{label} must be a list of fnmatch patterns (strings), got {value!r}")
        value = list(value)
        if any(not p.strip() for p in value):
            raise ConfigurationError(f"{label} holds an empty pattern: {value!r}")
    elif name == "sink_token_ids":
        value = [] if value is None else [value] if isinstance(value, int) and not isinstance(value, bool) else value
        try:
            value = [_token_id(i) for i in value]
        except (TypeError, ValueError):
            raise ConfigurationError(f"{label} must be integer token ids, got {value!r}") from None
        if any(i < 0 for i in value):
            raise ConfigurationError(f"{label} must be non-negative, got {value}")
    elif name in ("taper_start", "taper_end"):
        check_step(label, value)
    elif hint is bool:
        if not isinstance(value, bool):  # bool("no") is True: a string or number here is a mistake, not a choice
            raise ConfigurationError(f"{label} must be true or false, got {value!r}")
    elif hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigurationError(f"{label} must be a number, got {value!r}")
        value = float(value)
        if math.isinf(value):  # an infinite loss weight makes the first step's loss inf
            raise ConfigurationError(f"{label} must be a finite number, got {value}")
    elif hint is str and not isinstance(value, str):
        raise ConfigurationError(f"{label} must be a string, got {value!r}")
    if name == "ema_rate" and not 0.0 < value <= 1.0:
        raise ConfigurationError(f"{label} must be in (0, 1], got {value}")
    elif name == "calibration_scale" and not value > 0:
        raise ConfigurationError(f"{label} must be positive, got {value}")
    elif name in ("scale_loss_weight", "distill_weight", "sink_attention_weight") and not value >= 0:
        raise ConfigurationError(f"{label} must be >= 0, got {value}")
    return value


def _token_id(value: Any) -> int:
    """An integer token id (an int, a NumPy/torch integer, or its digits); a float or bool is refused, not cut."""
    if isinstance(value, bool):
        raise TypeError(value)
    if isinstance(value, str):
        return int(value.strip())
    return operator.index(value)


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _looks_like_a_path(name: str) -> bool:
    """A Hub repository id is ``name`` or ``owner/name``; anything else can only be a local path."""
    return not name or name.count("/") > 1 or name.startswith((".", "/", "~")) or "\\" in name


def _download(repo_id: str, revision: Optional[str], token: Union[str, bool, None]) -> str:
    from huggingface_hub import hf_hub_download

    try:
        return hf_hub_download(repo_id, CONFIG_NAME, revision=revision, token=token)
    except Exception as error:  # huggingface_hub raises many types (offline, not found, gated, network)
        reason = (str(error).strip().splitlines() or [""])[0]
        raise ConfigurationError(
            f"TaperNormConfig.from_pretrained('{repo_id}'): not a local folder, and {CONFIG_NAME} could not be "
            f"read from the Hub ({type(error).__name__}: {reason}); check the name, the network, HF_HUB_OFFLINE"
        ) from None


def sink_token_id(tokenizer: Any = None, model: Optional[nn.Module] = None) -> Optional[int]:
    """The token every block starts with as the attention sink: the tokenizer's BOS, else its EOS (GPT-2-style
    tokenizers use one token as both); without a tokenizer, the model config's BOS. None when there is none."""
    if isinstance(tokenizer, (str, os.PathLike)):  # a name has no BOS: the recipe would silently lose its sink
        raise ConfigurationError(
            f"tokenizer= must be a tokenizer, got the name {str(tokenizer)!r}: pass AutoTokenizer.from_pretrained(name)"
        )
    if tokenizer is not None:
        for name in ("bos_token_id", "eos_token_id"):
            if getattr(tokenizer, name, None) is not None:
                return int(getattr(tokenizer, name))
        return None
    bos = getattr(getattr(model, "config", None), "bos_token_id", None)
    if isinstance(bos, list):  # some configs list several
        bos = bos[0] if bos else None
    return int(bos) if bos is not None else None


def config_of(model: nn.Module) -> TaperNormConfig:
    """The config a patched model was patched with."""
    config = getattr(model, "tapernorm_config", None)
    if not isinstance(config, TaperNormConfig):
        raise TaperStateError(f"{type(model).__name__} is not patched: call hf_tapernorm.patch_model(model) first")
    return config


__all__ = [
    "CONFIG_NAME",
    "CONFIG_VERSION",
    "CONFIG_VERSION_KEY",
    "EXPERIMENTAL",
    "VERSION_KEY",
    "TaperNormConfig",
    "check_step",
    "config_of",
    "parse_step",
    "sink_token_id",
]
