"""Everything ``taper`` checks before it loads weights or touches the output folder.

The recipe is planned on a weightless (meta-device) copy of the model built from its config, so a bad
``keep_norms`` pattern, an unsupported layout, a schedule longer than the run, a block size beyond the
model's positions or a resumed run that is not the saved one all fail in seconds. Errors about recipe
and training fields name them (``TaperNormConfig.taper_end``); the CLI writes them as its flags.

The checks ``taper`` runs before work starts are split by what they read, so each has one place:
validation.py the request and the model's config (the recipe, schedule, positions, the run's identity);
preflight.py the Trainer's options and the disk; resume_check.py the files of a checkpoint to resume.
A new check goes where its input is: this module, for a check on an option of the recipe or the model's config.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from transformers import AutoModelForCausalLM, PreTrainedConfig

from ..config import TaperNormConfig, sink_token_id
from ..data.sources import EMBEDDED_CORPUS
from ..errors import ConfigurationError, UnsupportedModelError, first_line
from ..evaluation.models import ModelSource, ModelSourceError, holds_tokenizer, load_tokenizer, read_model_config
from ..training.schedule import TaperSchedule, fit_default_window
from ..utils import expand_user, json_object
from .checkpoint_files import IDENTITY_NAME
from .data_checks import check_data_paths, check_output_outside_models
from .fingerprints import compared_identity, fingerprint, with_data_as_read, with_legacy_fingerprints
from .record import differences
from .run_folder import RunFolder
from .run_folder_hints import checkpoints, refuse_run_folder, taper_hint

logger = logging.getLogger(__name__)


@dataclass
class TaperRequest:
    """The parsed arguments of one ``taper`` command (cli/arguments.py). Each argument class checks its own options
    as it is built; where the run folder may be, which depends on the model's and the data's, is checked here,
    before the command reads or writes anything (its lock is a file in that folder), as are its data paths."""

    model: Any
    data: Any
    taper: Any
    run: Any
    training: Any

    def __post_init__(self) -> None:
        refuse_run_folder(self.model.model_name_or_path, "--model_name_or_path", taper_hint)
        check_output_outside_models(  # nor in another run, an export or a saved model, as bench, eval and fold
            "--output_dir",
            self.training.output_dir,
            {
                "--model_name_or_path": self.model.model_name_or_path,
                "--dataset_name": self.data.dataset_name,
                "--out_of_corpus_dataset": self.data.out_of_corpus_dataset,
            },
            reader="the run",
            written="its checkpoints and reports",
            run=True,
        )
        check_data_paths(self.data, own_folder=self.training.output_dir)  # as eval, fold's scan and bench check theirs


def recipe_config(request: TaperRequest, model, tokenizer) -> TaperNormConfig:
    """The TaperNormConfig of the flags: the preset (``--preset``), with every explicitly set option on top.

    ``request.taper`` holds one attribute per stable TaperNormConfig option (None: the recipe's value), already in
    the config's types (cli/arguments.py generates them from the config's options), plus ``preset`` and
    ``sink``, which the command line spells its own way."""
    flags = request.taper
    overrides: dict[str, Any] = {
        name: getattr(flags, name)
        for name in TaperNormConfig.option_fields()
        if name not in ("recipe", "sink_token_ids") and getattr(flags, name, None) is not None
    }
    if flags.sink == "none":
        overrides["sink_token_ids"] = []
    elif flags.sink == "bos":
        bos = sink_token_id(tokenizer)
        if bos is None:
            raise ConfigurationError("--sink bos: the tokenizer has neither a BOS nor an EOS token; pass --sink none")
        overrides["sink_token_ids"] = [bos]
    if flags.preset == "paper":
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


def fit_default_schedule(config: TaperNormConfig, flags: Any, max_steps: int) -> TaperNormConfig:
    """The recipe's taper window made to fit a short run (fit_default_window: the library's rule), where the user
    left it to the recipe (flag unset); a window the user set is left alone (check_schedule names what is wrong)."""
    start, end = fit_default_window(
        config.taper_start,
        config.taper_end,
        max_steps,
        start_set=getattr(flags, "taper_start", None) is not None,
        end_set=getattr(flags, "taper_end", None) is not None,
    )
    changed = (start, end) != (config.taper_start, config.taper_end)
    return dataclasses.replace(config, taper_start=start, taper_end=end) if changed else config


def fit_default_warmup(training_args, schedule: TaperSchedule) -> None:
    """The default ``--warmup_steps`` (a fraction of the run) cut to end at the taper's start when it would end
    after it (short runs: the fraction rounds up, the taper start down); an explicit warmup is left as set (the
    preflight refuses one that ends after the taper starts)."""
    default = next(f.default for f in dataclasses.fields(training_args) if f.name == "warmup_steps")
    if (
        training_args.warmup_steps == default
        and training_args.get_warmup_steps(schedule.total_steps) > schedule.k_start
    ):
        training_args.warmup_steps = schedule.k_start


def check_inputs_outside(output_dir: Path, inputs: dict[str, Optional[str]], verb: str) -> None:
    """Refuse an input (option -> local path) that lies inside the run folder that ``verb`` (``--overwrite``,
    ``--resume``) deletes or rewrites: the run would delete the model, data or baseline it reads."""
    root = expand_user(output_dir, f"--output_dir '{output_dir}'").resolve()
    for option, value in inputs.items():
        if not value or not expand_user(value, f"{option} '{value}'").exists():
            continue  # a Hub name, or nothing
        path = expand_user(value).resolve()
        if path.is_relative_to(root):
            raise ConfigurationError(
                f"{option} '{value}' lies inside --output_dir '{output_dir}', which {verb} deletes or rewrites: "
                "copy it out of the run folder first, or choose another --output_dir"
            )


def weightless_model(source: ModelSource, trust_remote_code: bool):
    """The model's structure on the meta device, from its config alone (seconds, no weights)."""
    hf_config = read_model_config(source, trust_remote_code)
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(hf_config, trust_remote_code=trust_remote_code)
    except ValueError as error:  # e.g. an encoder-decoder (T5) config: no causal-LM class
        raise UnsupportedModelError(
            f"'{source.describe()}' is a {getattr(hf_config, 'model_type', '?')} model without a causal-LM class in "
            f"transformers ({str(error).splitlines()[0][:160]}); taper needs a decoder-only language model"
        ) from None


def check_within_positions(what: str, length: int, hf_config) -> None:
    """Refuse ``length`` tokens (``what``: the options that ask for them) beyond the model's positions."""
    positions = max_positions(hf_config)
    if positions is not None and length > positions:
        raise ConfigurationError(f"{what} exceeds the model's {positions} positions")


def check_lengths_within_positions(data, hf_config) -> None:
    """Refuse a taper's blocks (``data``: the command's data arguments) longer than the model's positions."""
    check_within_positions(f"--block_size {data.block_size}", data.block_size, hf_config)


def check_vocabulary(tokenizer, hf_config, model_name: str) -> None:
    """Refuse a tokenizer with more tokens than the model has embeddings: its higher ids would index past them
    (an IndexError once the data, whatever the sink, reaches the model)."""
    vocab = getattr(getattr(hf_config, "get_text_config", lambda: hf_config)(), "vocab_size", None)
    if isinstance(vocab, int) and vocab > 0 and len(tokenizer) > vocab:
        raise ConfigurationError(
            f"the tokenizer of '{model_name}' has {len(tokenizer)} tokens, more than the model's vocab_size {vocab}: "
            "its higher ids have no embedding; use the model's own tokenizer, or resize the embeddings "
            "(model.resize_token_embeddings(len(tokenizer))) and save the model again"
        )


def check_same_tokenizer(
    tokenizer, model_name: str, reference: ModelSource, *, trust_remote_code: bool = False
) -> None:
    """Refuse a reference model (the robustness scan's) whose tokenizer is another than the evaluated model's: the
    same ids would be other text for it, so its losses on the model's blocks measure nothing, whatever the sizes of
    the two vocabularies. A local folder that holds no tokenizer cannot be checked (a WARNING says so); a tokenizer
    that is there but cannot be read (a damaged GGUF file or tokenizer.json) is refused here, before the evaluated
    model loads, not after the whole evaluation when the scan loads the reference."""
    if _holds_no_tokenizer(reference):
        logger.warning(
            "the scan reference %s has no tokenizer: it is assumed to share the model's", reference.describe()
        )
        return
    try:
        other = load_tokenizer(reference, trust_remote_code=trust_remote_code)
    except ModelSourceError as error:
        cause = first_line(error.__cause__ or error)
        if reference.kind == "hub":  # nothing is damaged: a name that is no local folder, not in the cache
            raise ConfigurationError(
                f"--scan_reference '{reference.describe()}': no local folder of that name, so it was taken as a Hub "
                f"id, whose tokenizer cannot be read ({cause}): check the path, or the network and cache"
            ) from None
        raise ConfigurationError(
            f"--scan_reference '{reference.describe()}': its tokenizer cannot be read ({cause}), so the scan could "
            "not score the model's blocks with it: repair or replace it, or pass another --scan_reference"
        ) from None
    ours, theirs = tokenizer.get_vocab(), other.get_vocab()
    if ours != theirs:
        texts, other_texts = {i: t for t, i in ours.items()}, {i: t for t, i in theirs.items()}
        differ = sum(texts.get(i) != other_texts.get(i) for i in texts.keys() | other_texts.keys())
        raise ConfigurationError(
            f"the scan reference '{reference.describe()}' has another tokenizer than '{model_name}' ({differ} of "
            f"{max(len(texts), len(other_texts))} token ids are other text): it would be scored on text it does not "
            "read; pass a --scan_reference with the model's own tokenizer (its original, or a baseline trained from it)"
        )


def _holds_no_tokenizer(reference: ModelSource) -> bool:
    """A local folder (no GGUF file) without a tokenizer of its own: load_tokenizer's refusal that is no damage."""
    local = reference.kind in ("folder", "tapered", "folded") and not reference.gguf_file
    return local and not holds_tokenizer(Path(reference.path))


def max_positions(hf_config) -> Optional[int]:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(hf_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


#: TrainingArguments that cannot change what is trained (bookkeeping, logging, saving, the Hub, evaluation,
#: which taper refuses): left out of a run's identity, so a resume may change them freely. Every other option
#: is part of it: a resume that changes one is refused unless --allow_changes names it.
RESULT_NEUTRAL_OPTIONS = frozenset(
    {
        "output_dir", "run_name", "project", "report_to", "disable_tqdm", "debug", "local_rank", "skip_memory_metrics",
        "logging_strategy", "logging_steps", "logging_first_step", "logging_nan_inf_filter", "log_level",
        "log_level_replica", "log_on_each_node", "save_strategy", "save_steps", "save_total_limit",
        "save_on_each_node", "save_only_model", "restore_callback_states_from_checkpoint", "resume_from_checkpoint",
        "enable_jit_checkpoint", "push_to_hub", "hub_always_push", "hub_model_id", "hub_private_repo",
        "hub_revision", "hub_strategy", "hub_token", "trackio_bucket_id", "trackio_space_id",
        "trackio_static_space_id", "do_train", "do_eval", "do_predict", "eval_strategy", "eval_steps", "eval_delay",
        "eval_accumulation_steps", "eval_do_concat_batches", "eval_on_start", "eval_use_gather_object",
        "per_device_eval_batch_size", "batch_eval_metrics", "include_for_metrics", "prediction_loss_only",
        "metric_for_best_model", "greater_is_better", "load_best_model_at_end", "bf16_full_eval", "fp16_full_eval",
        "dataloader_num_workers", "dataloader_prefetch_factor", "dataloader_pin_memory",
        "dataloader_persistent_workers", "dataloader_multiprocessing_context", "ddp_timeout",
        "torch_empty_cache_steps", "include_num_input_tokens_seen",
    }
)  # fmt: skip
#: Options a Trainer resume takes from optimizer.pt/scheduler.pt (param_groups, base_lrs), not from the command.
IGNORED_ON_RESUME = frozenset({"learning_rate", "adam_beta1", "adam_beta2", "adam_epsilon", "weight_decay", "optim"})


def run_identity(
    request: TaperRequest, source: ModelSource, config: TaperNormConfig, data_facts: Optional[Mapping[str, Any]] = None
) -> dict[str, Any]:
    """What makes this run this run: a resumed run must match it (checked option by option).

    The model and the data are identified by their contents as well as their names; the Trainer's options by all
    of them except the RESULT_NEUTRAL_OPTIONS. ``data_facts`` (an extension's ``data_facts``: the options of its
    training data) join the data's, which they must not rename.
    """
    training, data = request.training, request.data
    trainer_options = {k: v for k, v in training.to_dict().items() if k not in RESULT_NEUTRAL_OPTIONS}
    trainer_options["world_size"] = training.world_size
    trainer_options["lr_scheduler_type"] = str(getattr(training.lr_scheduler_type, "value", training.lr_scheduler_type))
    identity = {
        "model": source.describe(),
        "dtype": request.model.dtype,  # None (as transformers loads it): absent from the runs of older versions
        "model_contents": fingerprint(source.describe() if source.gguf_file else source.path, weights_by_size=True),
        "data": {
            "dataset": data.dataset_name or EMBEDDED_CORPUS,
            "contents": fingerprint(data.dataset_name),
            "config": data.dataset_config_name,
            "split": data.dataset_split or "train",  # none named reads what train reads, where both are read
            "text_column": data.text_column,
            "sample_by": data.sample_by,
            "block_size": data.block_size,
            "heldout_percentage": data.heldout_percentage,
        },
        "taper": config.options(),  # by option names: --allow_changes names them
        "training": json.loads(json.dumps(trainer_options, default=str)),
        "baseline": request.run.baseline,
    }
    taken = sorted(set(data_facts or {}) & set(identity["data"]))
    if taken:
        raise ValueError(f"TaperExtension: data_facts {taken} are keys of the run's own data identity")
    identity["data"].update(json.loads(json.dumps(dict(data_facts or {}), default=str)))
    return identity


def _with_current_recipe(saved: dict[str, Any]) -> dict[str, Any]:
    """``saved`` with its recipe by this version's option names (a run of an earlier version recorded the fields of
    its tapernorm_config.json: ``TaperNormConfig.from_recorded`` reads both)."""
    taper = saved.get("taper")
    if not isinstance(taper, dict):
        return saved
    try:
        return {**saved, "taper": TaperNormConfig.from_recorded(taper).options()}
    except ConfigurationError:  # not a recipe this version reads: the comparison names what differs
        return saved


def _same_contents_same_name(saved: dict[str, Any], identity: dict[str, Any]) -> dict[str, Any]:
    """``identity`` with the model's and the dataset's names taken from ``saved`` where their recorded contents are
    the same files: ``./corpus.txt`` and ``/home/me/corpus.txt`` (or a moved copy) are the same data."""
    identity = {**identity}
    if saved.get("model_contents") and saved.get("model_contents") == identity.get("model_contents"):
        identity["model"] = saved.get("model")
    old, new = saved.get("data"), identity.get("data")
    if (
        isinstance(old, dict)
        and isinstance(new, dict)
        and old.get("contents")
        and old["contents"] == new.get("contents")
    ):
        identity["data"] = {**new, "dataset": old.get("dataset")}
    return identity


def _loaded_dtype(model: Optional[str], requested: Optional[str]) -> Optional[str]:
    """The dtype ``model`` (a run identity's) loads in with ``--dtype requested``: unset and auto mean the model's
    own, which its config records (transformers' ``dtype="auto"``); the request itself where the config does not say
    (a GGUF file, a config without a dtype), or cannot be read."""
    if requested not in (None, "auto") or not model or model.lower().endswith(".gguf"):
        return requested
    try:
        config, _ = PreTrainedConfig.get_config_dict(model)
    except (OSError, ValueError):
        return requested
    own = config.get("dtype") or config.get("torch_dtype")
    return own if isinstance(own, str) and own != "auto" else requested


def _with_loaded_dtype(saved: dict[str, Any], identity: dict[str, Any]) -> tuple[dict, dict]:
    """Both identities with the dtype each loads this model in: a run started without --dtype on a float32 model is
    the same run with ``--dtype float32``, as a resolved ``--bf16`` and ``--sink`` are the same."""
    model = identity.get("model")
    return tuple({**v, "dtype": _loaded_dtype(model, v.get("dtype"))} for v in (saved, identity))


#: The parts of a run's identity a ``--baseline_from`` baseline must share (its recipe is not one: it never tapered).
BASELINE_IDENTITY = ("model", "dtype", "model_contents", "data", "training")
#: Training options the run derives from its taper window (decay_learning_rate_after_the_taper, fit_default_warmup):
#: a difference in one is named by the option it follows, which the user passed.
DERIVED_FROM_TAPER = {
    "training.lr_scheduler_kwargs.num_decay_steps": ("taper_end", "the learning rate decays from the taper's end"),
    "training.warmup_steps": ("taper_start", "the default warmup ends by the taper's start"),
}


def _baseline_difference(key: str, old: Any, new: Any, taper_there: dict, taper_now: dict) -> str:
    """One difference between a baseline's identity and this run's, by the option the user passed."""
    option, why = DERIVED_FROM_TAPER.get(key, (None, ""))
    if option is None or taper_there.get(option) == taper_now.get(option):
        return f"{key}: {old!r} there, {new!r} now"
    return (
        f"--{option}: {taper_there.get(option)!r} there, {taper_now.get(option)!r} now, and {why} "
        f"({key.rsplit('.', 1)[-1]}: {old!r} there, {new!r} now)"
    )


def check_baseline_identity(baseline: ModelSource, identity: dict[str, Any]) -> None:
    """Refuse a ``--baseline_from`` baseline trained from another model, data or training options than this run
    (the gap against it would measure those differences, not the taper); one that records no run is used with a
    warning."""
    folder = Path(baseline.path)
    manifest = RunFolder(folder.parent.parent).manifest() if folder.parent.name == "baseline" else None
    saved = (manifest or {}).get("identity")
    trained = checkpoints(folder.parent) if isinstance(saved, dict) else []
    if trained:  # what the baseline trained with: a resume that trained no step may record other options since
        own = json_object(folder.parent / trained[-1] / IDENTITY_NAME)
        saved = {**saved, **{k: v for k, v in own.items() if k in saved}}
    if not isinstance(saved, dict):
        logger.warning(
            "--baseline_from %s is not the baseline/model of a recorded taper run: it cannot be checked to match this "
            "run's model, data and training options",
            baseline.path,
        )
        return
    taper = (_with_current_recipe(saved).get("taper") or {}, identity.get("taper") or {})
    compared = (compared_identity(saved), compared_identity(identity))  # a README.md added changes no model
    saved, current = _with_loaded_dtype(*({k: v.get(k) for k in BASELINE_IDENTITY} for v in compared))
    changed = differences(saved, _same_contents_same_name(saved, current))
    if changed:
        listing = "; ".join(_baseline_difference(k, old, new, *taper) for k, (old, new) in list(changed.items())[:6])
        raise ConfigurationError(
            f"--baseline_from '{baseline.path}' was trained with other options than this run ({listing}"
            f"{' ...' if len(changed) > 6 else ''}): the gap would measure those; pass the same options, or train a "
            "baseline with this run (--baseline)"
        )


def _spellings(name: str) -> set[str]:
    """The names an ``--allow_changes`` name may stand for: as typed, and as the flag it may be written as
    (``--max-grad-norm``, ``max-grad-norm``: max_grad_norm)."""
    bare = name.lstrip("-")
    return {name, bare, bare.replace("-", "_")}


def _leaf_keys(values: dict[str, Any], prefix: str = "") -> set[str]:
    """The dotted keys of every value of an identity, as ``differences`` names them."""
    keys = set()
    for key, value in values.items():
        keys |= _leaf_keys(value, f"{prefix}{key}.") if isinstance(value, dict) and value else {f"{prefix}{key}"}
    return keys


def _names_of_change(key: str) -> set[str]:
    """The names ``--allow_changes`` may give a changed ``key`` of a run's identity: the key itself, and the option it
    records (``training.max_grad_norm``: max_grad_norm) or, for a file of the model or the data, its name in the
    folder (``data.contents.corpus.txt``: corpus.txt; cut at its last dot, that key named the file's extension, and
    ``json`` allowed every changed .json file, the model's config.json among them)."""
    for files in ("model_contents.", "data.contents."):
        if key.startswith(files):
            return {key, key.removeprefix(files)}
    return {key, key.rsplit(".", 1)[-1]}


def check_resume_identity(folder: RunFolder, identity: dict[str, Any], allowed: set[str]) -> dict[str, Any]:
    """Refuse a ``--resume`` whose options differ from the saved run's, except the ``--allow_changes`` ones."""
    saved = (folder.manifest() or {}).get("identity")
    if saved is None:
        raise ConfigurationError(f"--resume: '{folder.path}' records no run identity; it cannot be checked, start over")
    saved, current = with_data_as_read(compared_identity(saved), compared_identity(identity))
    saved, current = _with_loaded_dtype(_with_current_recipe(saved), current)
    changed = differences(saved, _same_contents_same_name(saved, with_legacy_fingerprints(saved, current)))
    spellings = set().union(*(_spellings(name) for name in allowed))
    refused = {k: v for k, v in changed.items() if not spellings & _names_of_change(k)}
    if refused:
        listing = "; ".join(f"{k}: {old!r} in the run, {new!r} now" for k, (old, new) in list(refused.items())[:6])
        named = set().union(*(_names_of_change(k) for k in changed))
        unmatched = sorted(name for name in allowed if not _spellings(name) & named)
        if unmatched:  # a path as typed, a group, a misspelt option: say so, not only what differs
            listing += f" (--allow_changes {','.join(unmatched)} names none of them)"
        precision = refused.get("training.bf16")
        hint = (  # taper chooses bf16 by itself where it is fast: a run of another precision was not asked for
            f" (--bf16 {str(precision[0]).lower()} resumes it in its own precision)"
            if precision and isinstance(precision[0], bool)
            else ""
        )
        raise ConfigurationError(
            f"--resume: these options differ from the run in '{folder.path}': {listing}. Rerun with the original "
            f"options{hint}, or name the ones to change with --allow_changes"
        )
    known = set().union(*(_names_of_change(k) for k in _leaf_keys(saved) | _leaf_keys(current)))
    unknown = sorted(name for name in allowed if not _spellings(name) & known)
    if unknown:  # a misspelt name allowed nothing: said, as the refusal says it
        logger.warning(
            "--allow_changes %s: names nothing --resume compares (the options that shape the result, the model's "
            "and the data's files), so it allowed nothing",
            ",".join(unknown),
        )
    ignored = sorted(k for k in changed if k.startswith("training.") and k.rsplit(".", 1)[-1] in IGNORED_ON_RESUME)
    if ignored:
        raise ConfigurationError(
            f"--allow_changes cannot allow {', '.join(k.rsplit('.', 1)[-1] for k in ignored)}: a resumed Trainer "
            f"restores {', '.join(ignored)} from the checkpoint's optimizer and scheduler state, so the new value "
            "would be ignored; keep the run's value, or start over with --overwrite"
        )
    return {k: {"run": old, "now": new} for k, (old, new) in changed.items()}


__all__ = [
    "IGNORED_ON_RESUME",
    "RESULT_NEUTRAL_OPTIONS",
    "BASELINE_IDENTITY",
    "TaperRequest",
    "check_baseline_identity",
    "check_resume_identity",
    "check_same_tokenizer",
    "check_schedule",
    "check_inputs_outside",
    "check_lengths_within_positions",
    "check_vocabulary",
    "check_within_positions",
    "fit_default_schedule",
    "fit_default_warmup",
    "max_positions",
    "recipe_config",
    "run_identity",
    "weightless_model",
]
