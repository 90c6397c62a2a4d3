"""The fields of ``TaperNormConfig`` (config.py): what each one accepts, checked on its own, and its groups.

Every field is declared once, with its help text (the CLI's ``--help``), its ``Literal`` choices and its bounds;
:class:`Checked` runs the same checks for the config and for each group, so a value is refused the same way
(``ConfigurationError`` naming ``TaperNormConfig.<group>.<field>``) whichever object the user built.
:class:`DistillationConfig` groups the teacher's settings; :class:`ExperimentalOptions` holds the options kept
for the research, whose defaults are the recipe's own behaviour. It sits beside config_migrations.py at the
bottom of the layers: it imports nothing of the package but its errors.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, NamedTuple, Optional, Union

from .errors import ConfigurationError

Scope = Literal["internal", "final", "all"]
LinearFit = Literal["paper", "per_channel"]
Teacher = Literal["gate_start", "original", "current"]
DistillUntil = Literal["end", "taper_end"]
DistillSchedule = Literal["constant", "gate"]
#: Where a config's values came from: the names the presets write (``scope="final"`` marks its variant), or custom.
Recipe = Literal[
    "paper",
    "paper+keep_qk_norms",
    "gated-mlp",
    "paper (final norm)",
    "paper+keep_qk_norms (final norm)",
    "gated-mlp (final norm)",
    "custom",
]
Step = Union[int, float]  # int: an optimizer step; float in (0, 1]: a fraction of the run

#: A number field's range (``bounds`` in its metadata): the test, and what the error says the value must be.
BOUNDS = {
    ">= 0": (lambda v: v >= 0, "must be >= 0"),
    "> 0": (lambda v: v > 0, "must be positive"),
    "(0, 1]": (lambda v: 0 < v <= 1, "must be in (0, 1]"),
}


def declared(default: Any, help: str, **metadata: Any) -> Any:
    """A field with its help text: the one declaration the CLI's flags are generated from. ``metadata``:
    ``bounds`` (a key of ``BOUNDS``), ``flag`` (a grouped field's option name)."""
    if callable(default):
        return field(default_factory=default, metadata={"help": help, **metadata})
    return field(default=default, metadata={"help": help, **metadata})


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


class Checked:
    """Fields checked and normalized on construction, each on its own (``ConfigurationError`` naming
    ``<LABEL>.<field>``): the config and its groups share the checks, so a value is refused the same way
    whichever object the user built."""

    LABEL: ClassVar[str]

    def __post_init__(self) -> None:
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name, value in self.check_values(**values).items():
            object.__setattr__(self, name, value)  # the groups are frozen

    def __setattr__(self, name: str, value: Any) -> None:
        """Assigning a name that is no field fails: it would change nothing (``config.distill_weight = 1`` after
        the teacher's settings moved into ``config.distillation``)."""
        known = [f.name for f in dataclasses.fields(self)]
        if name not in known:
            raise AttributeError(f"{self.LABEL} has no field {name!r}; fields: {', '.join(known)}")
        object.__setattr__(self, name, value)

    @classmethod
    def choices(cls, name: str) -> Optional[tuple[str, ...]]:
        """The values a ``Literal`` field allows (None for a field without choices)."""
        hint = type_hints(cls)[name]
        return typing.get_args(hint) if typing.get_origin(hint) is Literal else None

    @classmethod
    def check_values(cls, **values: Any) -> dict[str, Any]:
        """Each given field checked and normalized on its own; the checks between fields run on construction."""
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ConfigurationError(f"{cls.LABEL} has no field {unknown[0]!r}; known: {', '.join(known)}")
        return {name: checked(cls, name, value) for name, value in values.items()}


@dataclass(frozen=True)
class DistillationConfig(Checked):
    """The teacher's settings: a KL term to the model as it was when the gate first fell below 1
    (training/distillation.py), and the sink-attention term that reads the same teacher forward. The options
    (the CLI's flags, the presets' keywords) name them ``distill_weight``, ``distill_until`` and
    ``sink_attention_weight``."""

    LABEL: ClassVar[str] = "TaperNormConfig.distillation"

    weight: float = declared(
        0.0,
        "Weight of the KL term to the teacher (the model when the gate first falls below 1), >= 0 (0: off).",
        flag="distill_weight",
        bounds=">= 0",
    )
    until: DistillUntil = declared(
        "end",
        "Distil to the end of the run, or only until the gate reaches 0 (taper_end): the teacher is then "
        "dropped and a step costs what a normalized step costs.",
        flag="distill_until",
    )
    sink_attention_weight: float = declared(
        0.0,
        "Weight of the sink-attention term, >= 0 (0: off): KL between the teacher's and the model's share of "
        "attention on the sink tokens (sink_token_ids), per layer, head and position. It reads the distillation's "
        "teacher forward (needs distill_weight > 0); training forwards report the sink's share through sdpa (eager "
        "attention for models sdpa cannot serve).",
        flag="sink_attention_weight",
        bounds=">= 0",
    )


@dataclass(frozen=True)
class ExperimentalOptions(Checked):
    """Options kept for the research in conversion_scripts/experiments: they work, the project measured them
    and chose otherwise (docs/method.md, docs/fidelity.md), and they may change or go. Each default is the
    recipe's own behaviour, so ``ExperimentalOptions()`` (the config's default) changes nothing. No preset sets
    one and ``taper`` has no flag for them: set them in Python (``config.replace(experimental={...})``) or, for
    a ``taper`` run, through its extension point (``TaperExtension(experimental={...})``)."""

    LABEL: ClassVar[str] = "TaperNormConfig.experimental"

    linear_fit: LinearFit = declared(
        "paper",
        "Start of the linear branch: paper (scalar c from the warmup's EMA) | per_channel (per-channel least "
        "squares over the same warmup statistics).",
    )
    calibration_scale: float = declared(
        1.0, "Multiply every calibrated c by this (< 1: a conservative linear branch); > 0.", bounds="> 0"
    )
    distill_from: Teacher = declared(
        "gate_start",
        "The teacher: gate_start (the recipe's: a frozen copy of the model when the gate first falls below 1) | "
        "original (a frozen copy before training) | current (the model itself at gate 1, on the same batch: no "
        "copy).",
    )
    distill_schedule: DistillSchedule = declared(
        "constant",
        "The KL term's weight over the run: constant (the recipe's: distill_weight throughout) | gate "
        "(distill_weight times the current gate, fading to 0 as the gate closes).",
    )

    def to_dict(self) -> dict[str, Any]:
        """The options set away from the recipe's behaviour (empty: none), as the config records them."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) != f.default}


class OptionField(NamedTuple):
    """One option of the stable recipe: the config's field, or a grouped field (``group``: the config's field
    holding it, ``owner``: its class) named by its flag."""

    group: Optional[str]
    owner: type
    field: dataclasses.Field

    @property
    def hint(self) -> Any:
        """The field's type (a ``Literal`` of its choices, ``float``, ``list[str]``, ...)."""
        return type_hints(self.owner)[self.field.name]

    @property
    def path(self) -> str:
        """Where the option lives in the config, as errors name it: ``scope``, ``distillation.weight``."""
        return f"{self.group}.{self.field.name}" if self.group else self.field.name


def field_named(cls: type, name: str) -> dataclasses.Field:
    """The dataclass field ``name`` of ``cls`` (its help, flag and bounds)."""
    return next(f for f in dataclasses.fields(cls) if f.name == name)


@functools.cache
def option_fields(cls: type) -> dict[str, OptionField]:
    """The options of the config class ``cls``: each plain field by its name, each field of a group by its flag;
    the experimental options are none (``TaperNormConfig.option_fields``)."""
    table: dict[str, OptionField] = {}
    for config_field in dataclasses.fields(cls):
        hint = type_hints(cls)[config_field.name]
        if hint is ExperimentalOptions:
            continue
        if dataclasses.is_dataclass(hint):
            grouped = dataclasses.fields(hint)
            table.update({f.metadata["flag"]: OptionField(config_field.name, hint, f) for f in grouped})
        else:
            table[config_field.name] = OptionField(None, cls, config_field)
    return table


def checked(cls: type, name: str, value: Any) -> Any:
    """One field's value, normalized (a single pattern or id becomes a list, a mapping its group), or a
    ConfigurationError naming the field."""
    label = f"{cls.LABEL}.{name}"
    choices = cls.choices(name)
    hint = type_hints(cls)[name]
    metadata = field_named(cls, name).metadata
    if choices is not None:
        if value not in choices:
            raise ConfigurationError(f"{label} must be one of {', '.join(choices)}, got {value!r}")
    elif dataclasses.is_dataclass(hint):
        if isinstance(value, Mapping):
            value = hint(**hint.check_values(**value))  # an unknown key is refused, named
        elif not isinstance(value, hint):
            raise ConfigurationError(f"{label} must be a {hint.__name__} or a mapping of its fields, got {value!r}")
    elif name == "keep_norms":
        value = [] if value is None else [value] if isinstance(value, str) else value
        if not isinstance(value, (list, tuple)) or not all(isinstance(p, str) for p in value):
            raise ConfigurationError(f"{label} must be a list of fnmatch patterns (strings), got {value!r}")
        value = list(value)
        if any(not p.strip() for p in value):
            raise ConfigurationError(f"{label} holds an empty pattern: {value!r}")
    elif name == "sink_token_ids":
        value = _token_ids(label, value)
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
    if "bounds" in metadata:
        within, must = BOUNDS[metadata["bounds"]]
        if not within(value):  # NaN is within no bounds
            raise ConfigurationError(f"{label} {must}, got {value}")
    return value


def _token_ids(label: str, value: Any) -> list[int]:
    """The sink's ids as a list (None: no sink; one integer, a NumPy or torch one too: one id). A string is refused,
    not read character by character ("127" was [1, 2, 7], "" no sink), and so is a mapping or another iterable than
    a list or tuple that holds anything but integers (a set or tensor of ids is taken)."""
    if value is None:
        return []
    one = _one_id(value)
    if one is not None:
        return [one]
    items = None if isinstance(value, (str, bytes, bytearray, Mapping)) else _items(value)
    read = _token_id if isinstance(value, (list, tuple)) else _integer_id
    try:
        if items is not None:
            return [read(i) for i in items]
    except (TypeError, ValueError):
        pass
    raise ConfigurationError(
        f"{label} must be a list of integer token ids, got {value!r}: write {_id_list_example(value, items)}"
    )


def _one_id(value: Any) -> int | None:
    """One id given alone: a Python, NumPy or torch integer, a 0-d array or tensor too (as 5 is taken, so is
    np.int64(5)); None for anything else, a bool or a boolean scalar included."""
    if isinstance(value, (bool, str, bytes, bytearray)) or getattr(value, "ndim", 0) != 0:
        return None
    if "bool" in str(getattr(value, "dtype", "")):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _items(value: Any) -> list | None:
    """The items of an iterable (read once: a generator is spent), or None for a value that is not one."""
    try:
        return list(value)
    except TypeError:
        return None


def _id_list_example(value: Any, items: list | None) -> str:
    """What to write instead of ``value``: its digits as a list ("127" -> [127], "1,2" -> [1, 2], "" -> []), or a
    list of ids in general (bytes iterate as character codes: no example of them)."""
    if isinstance(value, str):
        parts = value.replace(",", " ").split()
    elif items is None or isinstance(value, (bytes, bytearray)):
        parts = ["?"]
    else:
        parts = [str(i) for i in items]
    if all(p.strip().isdigit() for p in parts):
        return f"[{', '.join(str(int(p)) for p in parts)}]" + (" (no sink)" if not parts else "")
    return "a list of ids such as [1, 2]"


def _integer_id(value: Any) -> int:
    """An integer token id of an iterable other than a list (a set, a tensor): an integer only, never digits."""
    if isinstance(value, (bool, str, bytes)):
        raise TypeError(value)
    return operator.index(value)


def _token_id(value: Any) -> int:
    """An integer token id (an int, a NumPy/torch integer, or its digits); a float or bool is refused, not cut."""
    if isinstance(value, bool):
        raise TypeError(value)
    if isinstance(value, str):
        return int(value.strip())
    return operator.index(value)


def check_tokenizer(tokenizer: Any) -> None:
    """Refuse a ``tokenizer=`` that is no tokenizer: a name, a class, a number, a dict of ids. It has no BOS/EOS id to
    read, so the recipe would silently lose its sink (a WARNING that blamed the model's config was all it said).
    Duck-typed on what is read of it: ``bos_token_id`` and ``eos_token_id``, and a call on text."""
    if isinstance(tokenizer, (str, os.PathLike)):
        raise ConfigurationError(
            f"tokenizer= must be a tokenizer, got the name {str(tokenizer)!r}: pass AutoTokenizer.from_pretrained(name)"
        )
    if isinstance(tokenizer, type):
        what = f"the class {tokenizer.__name__}"
    elif not callable(tokenizer) or not all(hasattr(tokenizer, n) for n in ("bos_token_id", "eos_token_id")):
        kind = type(tokenizer).__name__
        what = f"an object of type {kind} (a tokenizer has bos_token_id, eos_token_id, is called on text)"
    else:
        return
    raise ConfigurationError(
        f"tokenizer= must be a tokenizer, got {what}: pass AutoTokenizer.from_pretrained(name), or leave it out to "
        "take the model config's bos_token_id as the sink"
    )


def check_tokenizer_to_save(tokenizer: Any, who: str) -> None:
    """Refuse, before anything is written, a ``tokenizer=`` that a save (``who``: export_folded, save_tapered) must not
    write: anything but a transformers tokenizer or processor. A name has no ``save_pretrained`` (save_tapered failed
    after the model's files were written); a model or a config has one, which wrote its own config.json (and weights)
    over the checkpoint's or the export's. None: no tokenizer to save."""
    from transformers import FeatureExtractionMixin, ImageProcessingMixin, PreTrainedTokenizerBase, ProcessorMixin

    if tokenizer is None or isinstance(
        tokenizer, (PreTrainedTokenizerBase, ProcessorMixin, ImageProcessingMixin, FeatureExtractionMixin)
    ):
        return
    raise ConfigurationError(
        f"{who}: tokenizer= must be a transformers tokenizer or processor, got {_not_a_tokenizer(tokenizer)}"
    )


def _not_a_tokenizer(value: Any) -> str:
    """What ``check_tokenizer_to_save`` got instead of a tokenizer, and what to pass."""
    from torch import nn
    from transformers import PreTrainedConfig

    advice = "pass the model's tokenizer (AutoTokenizer.from_pretrained(name))"
    if isinstance(value, (str, os.PathLike)):
        return f"the name {str(value)!r}: pass AutoTokenizer.from_pretrained(name)"
    if isinstance(value, nn.Module):
        return (
            f"the model {type(value).__name__}, whose save_pretrained would write its own config.json and weights "
            f"over the ones saved: {advice}"
        )
    if isinstance(value, PreTrainedConfig):
        return f"the config {type(value).__name__}, whose save_pretrained would write over config.json: {advice}"
    kind = f"the class {value.__name__}" if isinstance(value, type) else f"an object of type {type(value).__name__}"
    return f"{kind}: {advice}"


@functools.cache
def type_hints(cls: type) -> dict[str, Any]:
    """The resolved annotations of a config class (cached: every check reads them)."""
    return typing.get_type_hints(cls)


__all__ = [
    "BOUNDS",
    "Checked",
    "DistillSchedule",
    "DistillUntil",
    "DistillationConfig",
    "ExperimentalOptions",
    "LinearFit",
    "OptionField",
    "Recipe",
    "Scope",
    "Step",
    "Teacher",
    "check_step",
    "check_tokenizer_to_save",
    "checked",
    "declared",
    "field_named",
    "option_fields",
    "parse_step",
    "type_hints",
]
