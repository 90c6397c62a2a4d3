"""TaperNormConfig: every choice of a taper recipe in one serializable object (as PEFT's ``LoraConfig``).

``patch_model(model, config)`` applies it; ``TaperCallback``/``TaperController`` read the schedule,
the distillation and the scale loss from the config the patched model carries; the CLI builds it from
its flags; tapered checkpoints save it as ``tapernorm_config.json`` and folded exports record it in
their ``config.json``. So a run is described by one object, wherever it was started.

The stable fields are flat, except the teacher's settings, grouped in :class:`DistillationConfig`. Options
the project measured and did not adopt live apart, in :class:`ExperimentalOptions` (``experimental``): their
defaults are the recipe's own behaviour, no preset sets one, and the ``taper`` command has no flag for them.
The presets, :meth:`TaperNormConfig.replace` and the CLI speak one vocabulary, the *options*: the fields by
name, the distillation group's by its flags (``distill_weight``, ``distill_until``, ``sink_attention_weight``),
and ``experimental`` as a mapping of its fields; reports and run identities record the config in it
(:meth:`TaperNormConfig.options`).

Two presets:

- :meth:`TaperNormConfig.paper` is the published recipe (every internal norm, scalar c from the
  warmup's EMA, the absolute fixed-target scale loss, no sink, no distillation);
- :meth:`TaperNormConfig.for_model` derives the recipe for a pretrained model from its structure
  (``architectures/recipe_rules.py``): models with a gated (SwiGLU/GeGLU) MLP get the recipe measured on
  SmolLM2 (every norm tapers, the final one too, but the norms in front of the gated MLPs, any q/k norms
  and the attention norms of the layers where a runaway starts; the BOS kept normalized as the attention
  sink, the relative scale loss, distillation from the model as it was when the gate started to fall, with
  the sink-attention term);
  GELU families (GPT-2) get the paper's recipe, minus any q/k norms.
  The evidence is in docs/fidelity.md.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Optional, Union

from torch import nn

from ._recipe_sources import CONFIG_NAME, recipe_values
from ._version import __version__
from .architectures.recipe_rules import norms_to_keep
from .architectures.sites import architecture_of
from .config_fields import (
    Checked,
    DistillationConfig,
    ExperimentalOptions,
    OptionField,
    Recipe,
    Scope,
    Step,
    check_step,
    check_tokenizer,
    checked,
    declared,
    field_named,
    parse_step,
    type_hints,
)
from .config_fields import option_fields as option_table
from .config_migrations import CONFIG_VERSION, CONFIG_VERSION_KEY, migrated
from .errors import ConfigurationError, TaperNormError, TaperStateError
from .utils import expand_user, file_in_the_way, holds_model_weights, saved_model_type

logger = logging.getLogger(__name__)

#: The file of tapered checkpoints written before TaperNormConfig (patch_model's options): still read.
LEGACY_CONFIG_NAME = "tapernorm.json"
#: The ``model_type`` prefix of a tapered checkpoint's config.json. transformers knows no such type, so
#: ``AutoModelForCausalLM.from_pretrained`` refuses the folder instead of loading a plain model with its norms back;
#: ``load_tapered`` restores the base type (layers/saving.py writes it; defined here, where every save of a config
#: checks its folder: check_save_destination).
TAPERED_TYPE_PREFIX = "hf_tapernorm_tapered_"
#: The key of ``tapernorm_config.json`` (and of an export's ``config.json``) that records the package version.
VERSION_KEY = "hf_tapernorm_version"


@dataclass
class TaperNormConfig(Checked):
    """Every choice of a taper recipe. Fields are validated on construction (``ConfigurationError``, naming
    the field); each field's ``metadata["help"]`` is its documentation, and the CLI's ``--help``.

    ``distillation`` groups the teacher's settings (:class:`DistillationConfig`); ``experimental`` holds the
    research options (:class:`ExperimentalOptions`, none set by default). Both take a mapping of their fields
    too. Presets: :meth:`paper` and :meth:`for_model`. A bare ``TaperNormConfig()`` holds the paper's values
    (``recipe="custom"``: nothing derived from a model), while ``patch_model(model)`` without a config applies
    :meth:`for_model` and logs that it did. The method behind the fields: docs/method.md.
    """

    LABEL: ClassVar[str] = "TaperNormConfig"

    # Which norms taper
    scope: Scope = declared(
        "internal",
        "Which norms taper: internal (every norm inside the decoder layers; the final norm stays and anchors "
        "the output scale) | final | all.",
    )
    keep_norms: list[str] = declared(
        list,
        "fnmatch patterns of qualified module names whose norms stay real norms although scope covers them, "
        "e.g. 'model.layers.*.post_attention_layernorm'; each must match a norm. A single string is one pattern.",
    )
    sink_token_ids: list[int] = declared(
        list,
        "Leading token ids every sequence starts with (e.g. the BOS), kept normalized at every gate and folded "
        "as a constant key/value prefix.",
    )
    # The linear branch and the scale anchor
    ema_rate: float = declared(
        0.01, "New-sample weight of the calibration and scale-target EMAs, in (0, 1].", bounds="(0, 1]"
    )
    scale_loss_weight: float = declared(
        0.1,
        "lambda of the fixed-target scale loss on the residual stream entering the final norm, >= 0 (0 turns "
        "the loss off; the scale is still measured).",
        bounds=">= 0",
    )
    relative_scale_loss: bool = declared(False, "Penalise (s / s_tgt - 1)^2 instead of the paper's (s - s_tgt)^2.")
    distillation: DistillationConfig = declared(
        DistillationConfig, "The teacher's settings: distill_weight, distill_until, sink_attention_weight."
    )
    # The schedule
    taper_start: Step = declared(
        0.05,
        "Optimizer step (int) or fraction of the run (float in (0, 1]) where the gate starts to fall "
        "(calibration ends).",
    )
    taper_end: Step = declared(
        0.70, "Optimizer step (int) or fraction of the run (float in (0, 1]) where the gate reaches 0."
    )
    recipe: Recipe = declared(
        "custom",
        "Where the values came from: a preset's name (paper, paper+keep_qk_norms, gated-mlp, each with a "
        "' (final norm)' variant) or custom; recorded in reports and exports.",
    )
    experimental: ExperimentalOptions = declared(
        ExperimentalOptions, "Research options, none set by default (ExperimentalOptions; no taper flag)."
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        teacher = self.distillation
        if teacher.sink_attention_weight > 0 and (teacher.weight == 0 or not self.sink_token_ids):
            missing = (
                "TaperNormConfig.distillation.weight > 0 (its teacher)"
                if teacher.weight == 0
                else "sink_token_ids (the sink)"
            )
            raise ConfigurationError(
                f"TaperNormConfig.distillation.sink_attention_weight={teacher.sink_attention_weight:g} needs "
                f"{missing}; set sink_attention_weight=0 to train without the term"
            )
        if type(self.taper_start) is type(self.taper_end) and not self.taper_end > self.taper_start:
            raise ConfigurationError(
                f"TaperNormConfig.taper_end ({self.taper_end}) must come after taper_start ({self.taper_start})"
            )

    # ------------------------------------------------------------------ options: the presets' and the CLI's names
    @classmethod
    def option_fields(cls) -> dict[str, OptionField]:
        """Every option of the stable recipe by its name: the config's fields, the distillation group's by their
        flags. ``experimental`` is no option of the recipe: the presets and :meth:`replace` take it as a mapping,
        and the ``taper`` command has no flag for it."""
        return option_table(cls)

    @classmethod
    def check_options(cls, **values: Any) -> dict[str, Any]:
        """Each given option checked and normalized on its own (the CLI calls this when it parses its flags)."""
        table = cls.option_fields()
        unknown = sorted(set(values) - set(table))
        if unknown:
            raise ConfigurationError(f"TaperNormConfig has no option {unknown[0]!r}; options: {', '.join(table)}")
        return {name: checked(table[name].owner, table[name].field.name, v) for name, v in values.items()}

    def options(self) -> dict[str, Any]:
        """The config by option names, as reports and run identities record it (a resumed run's
        ``--allow_changes`` names options): every option, and ``experimental`` with the options set.

        ``keep_norms`` is a set of patterns (a norm stays when any of them matches): listed sorted, once each, so
        that the same patterns in another order, or one given twice, are the same recipe to every comparison (a
        resumed run's identity, a checkpoint's recipe), a recorded list of an older version included."""
        values: dict[str, Any] = {}
        for name, (group, _, option) in self.option_fields().items():
            value = getattr(getattr(self, group) if group else self, option.name)
            values[name] = list(value) if isinstance(value, list) else value
        values["keep_norms"] = sorted(set(self.keep_norms))
        values["experimental"] = self.experimental.to_dict()
        return values

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> TaperNormConfig:
        """The config of ``options`` (the vocabulary of :meth:`options`, the presets and the CLI); an option not
        given takes its default."""
        table = cls.option_fields()
        unknown = sorted(set(options) - set(table) - {"experimental"})
        if unknown:
            raise ConfigurationError(
                f"TaperNormConfig has no option {unknown[0]!r}; options: {', '.join(table)}, and experimental (a "
                "mapping of ExperimentalOptions fields)"
            )
        values: dict[str, Any] = {}
        for name, value in options.items():
            group, _, option = table[name] if name in table else (None, cls, field_named(cls, name))
            if group is None:
                values[option.name] = value
            else:
                values.setdefault(group, {})[option.name] = value
        return cls(**values)

    @classmethod
    def from_recorded(cls, values: Mapping[str, Any]) -> TaperNormConfig:
        """The config a run recorded: by option names (:meth:`options`: a run identity's ``taper``, a report's), or,
        by a run of a version before the options had ``experimental``, by the fields of its
        ``tapernorm_config.json`` (read through the migrations, as :meth:`from_dict` reads them)."""
        if CONFIG_VERSION_KEY in values or "experimental" not in values:
            return cls.from_dict(dict(values))
        return cls.from_options(values)

    def replace(self, **options: Any) -> TaperNormConfig:
        """This config with ``options`` changed (option names, as the presets take them)."""
        return type(self).from_options({**self.options(), **options})

    # ------------------------------------------------------------------ presets
    @classmethod
    def paper(cls, **options: Any) -> TaperNormConfig:
        """The published recipe (arXiv 2602.10408): every internal norm, the absolute scale loss, no sink,
        no distillation, taper from 5% to 70% of the run. For GELU models and training from scratch.
        ``options`` (option names) replace any value."""
        return cls.from_options({"recipe": "paper", **options})

    @classmethod
    def for_model(cls, model: nn.Module, tokenizer: Any = None, **options: Any) -> TaperNormConfig:
        """The recipe for ``model``, derived from its architecture (module docstring, docs/fidelity.md).

        ``tokenizer`` (or, without one, ``model.config.bos_token_id``) gives the BOS id that gated-MLP
        recipes keep as the attention sink; every training sequence must then start with it. ``options``
        (option names: ``distill_weight=0``, ``keep_norms=[...]``) replace any value.
        """
        arch = architecture_of(model)
        keep = norms_to_keep(model)
        for path, reason in keep.items():
            logger.debug("recipe keeps %s: %s", path, reason)
        if not arch.gated_mlp:
            values: dict[str, Any] = {"recipe": "paper+keep_qk_norms" if keep else "paper", "keep_norms": list(keep)}
        else:
            # The final norm goes too (an affine readout): the sink term at weight 3 holds the sink's share of
            # attention past the runaway band without it; with the final norm kept, weight 1 measured best.
            scope = options.get("scope", "all")
            values = {
                "recipe": "gated-mlp",
                "scope": scope,
                "keep_norms": list(keep),
                "sink_token_ids": cls._sink(model, tokenizer),
                "relative_scale_loss": True,
                "distill_weight": 1.0,
                "sink_attention_weight": 3.0 if scope == "all" else 1.0,
            }
        if options.get("scope") == "final":  # no internal norm tapers: nothing to keep, no sink, no teacher
            values.update(
                recipe=f"{values['recipe']} (final norm)",
                keep_norms=[],
                sink_token_ids=[],
                distill_weight=0.0,
                sink_attention_weight=0.0,
            )
        values = {**values, **options}
        if "sink_attention_weight" not in options and values.get("sink_attention_weight", 0.0) > 0:
            # The term follows what it needs: without a teacher or a sink (overridden away), it is off, not refused.
            lacking = [name for name in ("distill_weight", "sink_token_ids") if not values.get(name)]
            if lacking:
                logger.info("recipe: no sink-attention term (%s overridden to none)", " and ".join(lacking))
                values["sink_attention_weight"] = 0.0
        return cls.from_options(values)

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
        """Every field (``distillation`` as a mapping, ``experimental`` with the options set) and the layout's
        version (``config_version``), so that :meth:`from_dict` reads any recorded dict of any version."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values.update(
            keep_norms=list(self.keep_norms),
            sink_token_ids=list(self.sink_token_ids),
            distillation=dataclasses.asdict(self.distillation),
            experimental=self.experimental.to_dict(),
        )
        return {**values, CONFIG_VERSION_KEY: CONFIG_VERSION}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TaperNormConfig:
        """The config of ``values`` (``to_dict`` or a ``tapernorm_config.json``), migrated from the layout it
        records (config_migrations.py). Keys this version does not know (a file from a newer version) are dropped
        with one warning naming them, as PEFT does, so an older install still reads a newer file; the recorded
        package version is not a field."""
        if not isinstance(values, Mapping):
            raise ConfigurationError(
                f"TaperNormConfig.from_dict expects a mapping of field names to values, got a {type(values).__name__}"
            )
        values = dict(values)
        version = values.pop(VERSION_KEY, None)
        values = migrated(values, values.pop(CONFIG_VERSION_KEY, 1))
        values, unknown = _known_fields(cls, values)
        for group in ("distillation", "experimental"):
            if isinstance(values.get(group), Mapping):
                values[group], dropped = _known_fields(type_hints(cls)[group], values[group])
                unknown += [f"{group}.{name}" for name in dropped]
        if unknown:
            logger.warning(
                "TaperNormConfig: ignoring unknown field(s) %s (written by hf_tapernorm %s; this is %s)",
                ", ".join(unknown),
                version or "of an unknown version",
                __version__,
            )
        return cls(**values)

    def to_json_string(self) -> str:
        """``tapernorm_config.json``: every field, the layout's version and the package version that wrote it."""
        return json.dumps({**self.to_dict(), VERSION_KEY: __version__}, indent=2, sort_keys=True) + "\n"

    def save_pretrained(self, folder: Union[str, os.PathLike]) -> Path:
        """Write ``tapernorm_config.json`` into ``folder`` (created if missing); returns the file. Refused, before
        anything is written, under a file and into another model's folder (check_save_destination)."""
        path = expand_user(folder, f"TaperNormConfig.save_pretrained: '{folder}'") / CONFIG_NAME
        check_save_destination(path.parent, f"TaperNormConfig.save_pretrained: cannot save {CONFIG_NAME}", recipe=self)
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
        """The recipe in a local folder or a Hub repository: a tapered checkpoint's ``tapernorm_config.json``, or a
        folded export's ``config.json`` (its ``tapernorm_config``), downloaded with ``huggingface_hub.hf_hub_download``
        (``revision`` and ``token`` are passed on)."""
        return cls.from_dict(recipe_values(name_or_path, revision, token))


def _known_fields(cls: type, values: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``values`` of the fields ``cls`` has, and the names of the others (sorted)."""
    known = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in values.items() if k in known}, sorted(set(values) - known)


def sink_token_id(tokenizer: Any = None, model: Optional[nn.Module] = None) -> Optional[int]:
    """The token every block starts with as the attention sink: the tokenizer's BOS, else its EOS (GPT-2-style
    tokenizers use one token as both); without a tokenizer, the model config's BOS. None when there is none."""
    if tokenizer is not None:
        check_tokenizer(tokenizer)
        for name in ("bos_token_id", "eos_token_id"):
            if getattr(tokenizer, name, None) is not None:
                return int(getattr(tokenizer, name))
        return None
    bos = getattr(getattr(model, "config", None), "bos_token_id", None)
    if isinstance(bos, list):  # some configs list several
        bos = bos[0] if bos else None
    return int(bos) if bos is not None else None


def recorded_config_file(folder: Path) -> Optional[Path]:
    """The recipe file loading reads a checkpoint's weights with (its own, an older version's ``tapernorm.json``, an
    old Trainer ``checkpoint-N``'s in its run folder); None: no tapered checkpoint. Saves check the same file."""
    candidates = [folder / CONFIG_NAME, folder / LEGACY_CONFIG_NAME]
    if folder.name.startswith("checkpoint-"):  # a Trainer checkpoint inside a run folder of an older version
        candidates += [folder.parent / CONFIG_NAME, folder.parent / LEGACY_CONFIG_NAME]
    return next((c for c in candidates if c.is_file()), None)


def _readable_recipe(path: Path) -> Optional[TaperNormConfig]:
    try:  # None: a damaged file, which a save may replace
        return TaperNormConfig.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, TaperNormError):  # JSON and decoding errors are ValueErrors
        return None


def check_save_destination(
    folder: Path, what: str, *, writes_model: bool = False, recipe: Optional[TaperNormConfig] = None
) -> None:
    """Refuse, before anything is written, a ``folder`` the save ``what`` ("save_tapered: cannot save a tapered
    checkpoint": the message's start) would fail in or damage; every save of a tapered checkpoint or of its parts
    checks here, so each refuses alike. A file on the way to ``folder`` is named. With ``writes_model`` (the save
    writes config.json and weights) a config.json of no tapered checkpoint is refused, which it would replace;
    otherwise a model's config.json with weights and no recipe (loading's: recorded_config_file), which a
    ``tapernorm_config.json`` would make read as a damaged tapered checkpoint (``eval`` and ``fold`` refuse it).
    ``recipe``: the config a save that keeps the folder's weights writes (save_tapered, save_sharded_checkpoint and
    TaperCallback write them too: none); weights beside a readable file of another recipe (what they were trained
    with) are refused. No weights or a damaged file: written over, as ``PretrainedConfig.save_pretrained`` does.
    """
    blocking = file_in_the_way(folder)
    if blocking:
        raise ConfigurationError(f"{what} into {folder}: {blocking} is a file; name a folder")
    recorded, holds_weights = recorded_config_file(folder), holds_model_weights(folder)
    there = _readable_recipe(recorded) if recipe is not None and recorded and holds_weights else None
    if there is not None:
        here = recipe.options()
        changed = "; ".join(f"{k}: {v!r} there, {here[k]!r} here" for k, v in there.options().items() if here[k] != v)
        if changed:
            raise ConfigurationError(
                f"{what} into {folder}: {recorded} records another recipe ({changed}), the one its weights were "
                "trained with, which the save would replace; save into this recipe's checkpoint or a new folder"
            )
    config = folder / "config.json"
    if not config.is_file():
        return
    model_type = saved_model_type(config)
    if model_type.startswith(TAPERED_TYPE_PREFIX):
        return
    if writes_model:
        raise ConfigurationError(
            f"{what} into {folder}: it holds another model ({config.name} of type {model_type or 'unknown'!r}), "
            "whose weights the save would replace; choose a new folder"
        )
    if recorded is None and holds_weights:
        raise ConfigurationError(
            f"{what} into {folder}: it holds a model that is not a tapered checkpoint ({config.name} of type "
            f"{model_type or 'unknown'!r} and its weights), which {CONFIG_NAME} would mark as one (eval and fold "
            "would then refuse it as damaged, taper as tapered already); save it where the tapered model is "
            "(save_tapered's folder, the Trainer's checkpoint-N) or into a new folder"
        )


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
    "VERSION_KEY",
    "DistillationConfig",
    "ExperimentalOptions",
    "OptionField",
    "TaperNormConfig",
    "check_step",
    "config_of",
    "parse_step",
    "sink_token_id",
]
