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
  SmolLM2 (the norms in front of the gated MLPs and any q/k norms kept, the BOS kept normalized as the
  attention sink, the relative scale loss, distillation from the model as it was when the gate
  started to fall); GELU families (GPT-2) get the paper's recipe, minus any q/k norms.
  The evidence is in docs/fidelity.md.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

from torch import nn

from .architectures.recipe_rules import norms_to_keep
from .architectures.sites import architecture_of
from .errors import ConfigurationError, TaperStateError

logger = logging.getLogger(__name__)

CONFIG_NAME = "tapernorm_config.json"
SCOPES = ("internal", "final", "all")
LINEAR_FITS = ("paper", "per_channel")
TEACHERS = ("gate_start", "original", "current")
DISTILL_UNTIL = ("end", "taper_end")

Scope = Literal["internal", "final", "all"]
Step = Union[int, float]  # int: an optimizer step; float in (0, 1]: a fraction of the run


def _check_choice(name: str, value: Any, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ConfigurationError(f"TaperNormConfig.{name} must be one of {', '.join(choices)}, got {value!r}")


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


def parse_step(text: str, name: str) -> Step:
    """A step written as text (a flag): ``"5"`` -> 5 (an optimizer step), ``"0.05"`` -> 0.05 (a fraction of the run)."""
    try:
        step = float(text) if any(ch in str(text) for ch in ".eE") else int(text)
    except ValueError:
        raise ConfigurationError(
            f"--{name} must be an optimizer step (int) or a fraction of the run (float), got {text!r}"
        ) from None
    check_step(f"--{name}", step)
    return step


@dataclass
class TaperNormConfig:
    """Every choice of a taper recipe. Fields are validated on construction (``ConfigurationError``).

    Which norms taper:
        scope: ``"internal"`` (every norm inside the decoder layers; the final norm stays and anchors the
            output scale), ``"final"`` or ``"all"``.
        keep_norms: fnmatch patterns of qualified module names whose norms stay real norms although
            ``scope`` covers them (``"model.layers.*.post_attention_layernorm"``). A single string is one
            pattern. Every pattern must match a norm of the model.
        sink_token_ids: leading token ids every sequence starts with (e.g. ``[bos]``), kept normalized at
            every gate and folded as a constant key/value prefix (layers/sink.py).
    The linear branch:
        linear_fit: ``"paper"`` (scalar c from the EMA over the warmup) or ``"per_channel"`` (a
            per-channel least-squares start fitted on a few training batches before training).
        calibration_scale: multiplies every calibrated c (< 1: a conservative linear branch).
        ema_rate: new-sample weight of the calibration and scale-target EMAs.
    The scale anchor (METHOD section 4):
        scale_loss_weight: lambda of the fixed-target scale loss (0 disables the loss, keeps the measurement).
        relative_scale_loss: penalise ``(s / s_tgt - 1)^2`` instead of ``(s - s_tgt)^2``.
    Distillation (KL to a frozen, unpatched copy of the model):
        distill_weight: 0 turns it off.
        distill_from: ``"gate_start"`` (a frozen copy of the model as it was when the gate first fell below 1),
            ``"original"`` (a frozen copy of the model before training) or ``"current"`` (no copy: the model
            itself with every gate at 1, on the same batch).
        distill_until: ``"end"`` of the run, or ``"taper_end"`` (the step the gate reaches 0): after it the
            teacher is dropped and a step costs what a normalized step costs.
    The schedule:
        taper_start, taper_end: optimizer steps (int) or fractions of the run (float) where the gate starts
            to fall (calibration ends) and where it reaches 0.
    recipe: a name recording where the values came from (``"paper"``, ``"gated-mlp"``, ``"custom"``).
    """

    scope: Scope = "internal"
    keep_norms: list[str] = field(default_factory=list)
    sink_token_ids: list[int] = field(default_factory=list)
    linear_fit: str = "paper"
    calibration_scale: float = 1.0
    ema_rate: float = 0.01
    scale_loss_weight: float = 0.1
    relative_scale_loss: bool = False
    distill_weight: float = 0.0
    distill_from: str = "gate_start"
    distill_until: str = "end"
    taper_start: Step = 0.05
    taper_end: Step = 0.70
    recipe: str = "custom"

    def __post_init__(self) -> None:
        if self.keep_norms is None:
            self.keep_norms = []
        elif isinstance(self.keep_norms, str):
            self.keep_norms = [self.keep_norms]
        self.keep_norms = [str(p) for p in self.keep_norms]
        if any(not p.strip() for p in self.keep_norms):
            raise ConfigurationError(f"TaperNormConfig.keep_norms holds an empty pattern: {self.keep_norms!r}")
        if self.sink_token_ids is None:
            self.sink_token_ids = []
        elif isinstance(self.sink_token_ids, int) and not isinstance(self.sink_token_ids, bool):
            self.sink_token_ids = [self.sink_token_ids]
        try:
            self.sink_token_ids = [int(i) for i in self.sink_token_ids]
        except (TypeError, ValueError):
            raise ConfigurationError(
                f"TaperNormConfig.sink_token_ids must be token ids, got {self.sink_token_ids!r}"
            ) from None
        if any(i < 0 for i in self.sink_token_ids):
            raise ConfigurationError(f"TaperNormConfig.sink_token_ids must be non-negative, got {self.sink_token_ids}")
        _check_choice("scope", self.scope, SCOPES)
        _check_choice("linear_fit", self.linear_fit, LINEAR_FITS)
        _check_choice("distill_from", self.distill_from, TEACHERS)
        _check_choice("distill_until", self.distill_until, DISTILL_UNTIL)
        if not 0.0 < self.ema_rate <= 1.0:
            raise ConfigurationError(f"TaperNormConfig.ema_rate must be in (0, 1], got {self.ema_rate}")
        if not self.calibration_scale > 0:
            raise ConfigurationError(
                f"TaperNormConfig.calibration_scale must be positive, got {self.calibration_scale}"
            )
        if not self.scale_loss_weight >= 0:
            raise ConfigurationError(f"TaperNormConfig.scale_loss_weight must be >= 0, got {self.scale_loss_weight}")
        if not self.distill_weight >= 0:
            raise ConfigurationError(f"TaperNormConfig.distill_weight must be >= 0, got {self.distill_weight}")
        check_step("TaperNormConfig.taper_start", self.taper_start)
        check_step("TaperNormConfig.taper_end", self.taper_end)
        if type(self.taper_start) is type(self.taper_end) and not self.taper_end > self.taper_start:
            raise ConfigurationError(
                f"TaperNormConfig.taper_end ({self.taper_end}) must come after taper_start ({self.taper_start})"
            )

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
            }
        if overrides.get("scope") == "final":  # no internal norm tapers: nothing to keep, no sink, no teacher
            values.update(
                recipe=f"{values['recipe']} (final norm)", keep_norms=[], sink_token_ids=[], distill_weight=0.0
            )
        return cls(**{**values, **overrides})

    @staticmethod
    def _sink(model: nn.Module, tokenizer: Any) -> list[int]:
        bos = _bos_token_id(model, tokenizer)
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
        """The config of ``values``; unknown keys are an error (a file from a newer version, or a typo)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigurationError(f"unknown TaperNormConfig field(s) {unknown}; known: {', '.join(sorted(known))}")
        return cls(**values)

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def save_pretrained(self, folder: Union[str, os.PathLike]) -> Path:
        """Write ``tapernorm_config.json`` into ``folder`` (created if missing); returns the file."""
        path = Path(folder) / CONFIG_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json_string())
        return path

    @classmethod
    def from_pretrained(cls, folder: Union[str, os.PathLike]) -> TaperNormConfig:
        path = Path(folder) / CONFIG_NAME
        if not path.is_file():
            raise ConfigurationError(
                f"no {CONFIG_NAME} in '{folder}': not a tapered checkpoint written by hf_tapernorm"
            )
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except json.JSONDecodeError as error:
            raise ConfigurationError(f"{path} is not valid JSON: {error}") from None

    def replace(self, **changes: Any) -> TaperNormConfig:
        return dataclasses.replace(self, **changes)


def _bos_token_id(model: nn.Module, tokenizer: Any) -> Optional[int]:
    """The tokenizer's BOS (else its EOS, which GPT-2-style tokenizers use as both), else the config's BOS."""
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


__all__ = ["CONFIG_NAME", "TaperNormConfig", "check_step", "config_of", "parse_step"]
