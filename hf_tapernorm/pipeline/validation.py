"""Everything ``taper`` checks before it loads weights or touches the output folder.

The recipe is planned on a weightless (meta-device) copy of the model built from its config, so a bad
``keep_norms`` pattern, an unsupported layout, a schedule longer than the run, a block size beyond the
model's positions or a resumed run that is not the saved one all fail in seconds. Errors about recipe
and training fields name them (``TaperNormConfig.taper_end``); the CLI writes them as its flags.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ..config import TaperNormConfig
from ..errors import ConfigurationError
from ..training.schedule import TaperSchedule
from .data import EMBEDDED_CORPUS
from .models import ModelSource
from .record import differences
from .run_folder import RunFolder


@dataclass
class TaperRequest:
    """The parsed arguments of one ``taper`` command (cli/arguments.py)."""

    model: Any
    data: Any
    taper: Any
    run: Any
    training: Any


def recipe_config(request: TaperRequest, model, tokenizer) -> TaperNormConfig:
    """The TaperNormConfig of the flags: the recipe (``--recipe``), with every explicitly set field on top.

    ``request.taper`` holds one attribute per TaperNormConfig field (None: the recipe's value), already in
    the config's types (cli/arguments.py generates them from the config's fields), plus ``recipe`` and
    ``sink``, which the command line spells its own way."""
    flags = request.taper
    overrides: dict[str, Any] = {
        f.name: getattr(flags, f.name)
        for f in dataclasses.fields(TaperNormConfig)
        if f.name not in ("recipe", "sink_token_ids") and getattr(flags, f.name, None) is not None
    }
    if flags.sink == "none":
        overrides["sink_token_ids"] = []
    elif flags.sink == "bos":
        bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        if bos is None:
            raise ConfigurationError("--sink bos: the tokenizer has neither a BOS nor an EOS token; pass --sink none")
        overrides["sink_token_ids"] = [int(bos)]
    if flags.recipe == "paper":
        return TaperNormConfig.paper(**overrides)
    return TaperNormConfig.for_model(model, tokenizer, **overrides)


def check_schedule(config: TaperNormConfig, max_steps: int) -> TaperSchedule:
    """The resolved schedule, or an error naming the fields (the CLI writes them as its flags)."""
    k_start, k_end = TaperSchedule.from_config(config).steps_for(max_steps)
    start, end, steps = "TaperNormConfig.taper_start", "TaperNormConfig.taper_end", "TrainingArguments.max_steps"
    if k_start < 1:
        raise ConfigurationError(
            f"{start} {config.taper_start} is step {k_start} of {max_steps}: calibration needs at least "
            f"one optimizer step at g = 1; raise {start} or {steps}"
        )
    if k_end <= k_start:
        raise ConfigurationError(f"{end} (step {k_end}) must come after {start} (step {k_start})")
    if k_end > max_steps:
        gate = TaperSchedule(k_start, k_end).gate(max_steps)
        raise ConfigurationError(
            f"{end} {config.taper_end} is step {k_end}, after the last step {max_steps} ({steps}): "
            f"the gate would end at g = {gate:.4f} and the model could not be folded; lower {end} or raise {steps}"
        )
    return TaperSchedule(k_start, k_end).resolve(max_steps)


def weightless_model(source: ModelSource, trust_remote_code: bool):
    """The model's structure on the meta device, from its config alone (seconds, no weights)."""
    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    try:
        hf_config = AutoConfig.from_pretrained(source.path, trust_remote_code=trust_remote_code, **kwargs)
    except Exception as error:  # noqa: BLE001 - transformers raises many types; all mean "unreadable config"
        raise ConfigurationError(
            f"cannot read the config of '{source.describe()}': {type(error).__name__}: {error}"
        ) from None
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config, trust_remote_code=trust_remote_code)


def max_positions(hf_config) -> Optional[int]:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(hf_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def run_identity(request: TaperRequest, source: ModelSource, config: TaperNormConfig) -> dict[str, Any]:
    """What makes this run this run: a resumed run must match it (checked option by option)."""
    training, data = request.training, request.data
    return {
        "model": source.describe(),
        "data": {
            "dataset": data.dataset_name or EMBEDDED_CORPUS,
            "config": data.dataset_config_name,
            "split": data.dataset_split,
            "text_column": data.text_column,
            "sample_by": data.sample_by,
            "block_size": data.block_size,
            "heldout_percentage": data.heldout_percentage,
        },
        "taper": config.to_dict(),
        "training": {
            "max_steps": training.max_steps,
            "per_device_train_batch_size": training.per_device_train_batch_size,
            "gradient_accumulation_steps": training.gradient_accumulation_steps,
            "world_size": training.world_size,
            "learning_rate": training.learning_rate,
            "lr_scheduler_type": str(getattr(training.lr_scheduler_type, "value", training.lr_scheduler_type)),
            "lr_scheduler_kwargs": training.lr_scheduler_kwargs,
            "warmup_steps": training.warmup_steps,
            "weight_decay": training.weight_decay,
            "seed": training.seed,
        },
        "baseline": request.run.baseline,
    }


def check_resume_identity(folder: RunFolder, identity: dict[str, Any], allowed: set[str]) -> dict[str, Any]:
    """Refuse a ``--resume`` whose options differ from the saved run's, except the ``--allow_changes`` ones."""
    saved = (folder.manifest() or {}).get("identity")
    if saved is None:
        raise ConfigurationError(f"--resume: '{folder.path}' records no run identity; it cannot be checked, start over")
    changed = differences(saved, identity)
    refused = {k: v for k, v in changed.items() if k.rsplit(".", 1)[-1] not in allowed and k not in allowed}
    if refused:
        listing = "; ".join(f"{k}: {old!r} in the run, {new!r} now" for k, (old, new) in list(refused.items())[:6])
        raise ConfigurationError(
            f"--resume: these options differ from the run in '{folder.path}': {listing}. Rerun with the original "
            "options, or name the ones to change with --allow_changes"
        )
    return {k: {"run": old, "now": new} for k, (old, new) in changed.items()}


__all__ = [
    "TaperRequest",
    "check_resume_identity",
    "check_schedule",
    "max_positions",
    "recipe_config",
    "run_identity",
    "weightless_model",
]
