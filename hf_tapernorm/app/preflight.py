"""The Trainer options of ``taper``, checked before the model loads: each would otherwise fail late, or train
something other than the recipe without saying so.

Where transformers or torch validate an option themselves, their validation is called here, early, on a stand-in:
the optimizer is built the way the Trainer builds it (torch's own range checks on the learning rate, betas, eps and
weight decay; the import of an ``--optim`` that needs a missing package), the learning-rate scheduler likewise, and
``--report_to`` is resolved by transformers' integration table (which imports the integration; wandb is asked
whether it can log in). What only this recipe knows is checked by name: options that bypass its loss or
its schedule, a Trainer evaluation without an evaluation set, checkpoints that could not be resumed, and a Hub push
from inside the run. And the disk: a run whose folder cannot hold the checkpoint and the exports it will write is
refused before it trains, and a fold whose folder cannot hold its export before its weights load (one check,
check_free_space, for both; a disk that fills up anyway while an export, a checkpoint or a report is written is one
line too: full_disk.py).

The checks ``taper`` runs before work starts are split by what they read, so each has one place:
validation.py the request and the model's config (the recipe, schedule, positions, the run's identity);
preflight.py the Trainer's options and the disk; resume_check.py the files of a checkpoint to resume.
A new check goes where its input is: this module, for a check on a TrainingArguments option or on a resource
the run needs.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
from accelerate.utils import DynamoBackend, TorchDynamoPlugin
from safetensors import SafetensorError, safe_open
from transformers import Trainer, get_scheduler
from transformers.integrations import get_reporting_integration_callbacks

from ..config import TaperNormConfig
from ..errors import ConfigurationError, first_line
from ..export.folding import unties_head
from ..training.checkpoints import weightless_tapered
from ..training.schedule import TaperSchedule, checked_scheduler_kwargs
from ..utils import check_compile_options, check_seeds, expand_user


def check_trainer_options(training_args, schedule: TaperSchedule, config: TaperNormConfig) -> None:
    """Refuse (ConfigurationError, one line naming the option) what the recipe cannot run; see the module docstring."""
    _refuse_recipe_bypasses(training_args)
    _require_finite(training_args, config)
    _require_positive_counts(training_args)
    _check_runtime(training_args)
    _check_optimizer(training_args)
    _check_scheduler(training_args, schedule)
    try:  # each integration checks that its package is installed when it is made
        [callback() for callback in get_reporting_integration_callbacks(training_args.report_to)]
    except (ImportError, RuntimeError, ValueError) as error:
        raise ConfigurationError(f"--report_to {training_args.report_to}: {first_line(error)}") from None
    if "wandb" in training_args.report_to:
        _check_wandb_login(training_args.report_to)


def _check_wandb_login(report_to: list[str]) -> None:
    """wandb's init in the Trainer needs credentials once the model is loaded: ask wandb now, through its public
    ``wandb.login`` (which reads the key where wandb keeps it, asks for one at a terminal, and raises without one
    where it cannot ask). A mode that needs no account (WANDB_MODE offline, dryrun or disabled) needs no login."""
    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "dryrun", "disabled"):
        return
    import wandb  # importable: the integration check above imported it

    try:
        wandb.login(anonymous="never", verify=False)
    except Exception as error:  # wandb.errors.UsageError (no key, no terminal) and its kin
        raise ConfigurationError(
            f"--report_to {report_to}: wandb cannot log in here ({first_line(error)}), so its start in the Trainer "
            "would fail once the model is loaded: run `wandb login`, set WANDB_API_KEY, or set WANDB_MODE=offline "
            "to log to local files"
        ) from None


def check_training_blocks(training_args, train_blocks: int) -> None:
    """Refuse a per-device batch larger than the training set: the Trainer would run 0 steps (drop_last)."""
    per_step = training_args.per_device_train_batch_size * max(1, training_args.world_size)
    if train_blocks < per_step:
        raise ConfigurationError(
            f"the training set has {train_blocks} blocks, fewer than one batch ({per_step}: "
            "--per_device_train_batch_size x processes): training would run 0 steps; use more data, a smaller "
            "--block_size or a smaller batch"
        )


def _refuse_recipe_bypasses(args) -> None:
    if getattr(args, "resume_from_checkpoint", None):
        raise ConfigurationError(
            "--resume_from_checkpoint is the Trainer's flag and taper does not read it: continue a run with --resume "
            "(same --output_dir), which also checks that the run is the same"
        )
    if getattr(args, "save_only_model", False):
        raise ConfigurationError(
            "--save_only_model: taper's checkpoints are what --resume continues from (Ctrl-C and SIGTERM stop a run "
            "with one), and a checkpoint without the optimizer, scheduler and random state cannot be resumed; leave "
            "it off (--save_total_limit bounds the checkpoints a run keeps)"
        )
    if getattr(args, "label_smoothing_factor", 0.0):
        raise ConfigurationError(
            f"--label_smoothing_factor {args.label_smoothing_factor}: the Trainer would compute its own loss and "
            "bypass the recipe's (the scale loss and the distillation term would never be optimised); leave it at 0"
        )
    refuse_trainer_evaluation(args)
    if _value(args.logging_strategy) == "no":  # on_log: TaperCallback's metrics, the report's history and figures
        raise ConfigurationError(
            "--logging_strategy no: the report's training history and loss figure, and the divergence watch's "
            "gradient norm, are read from the Trainer's logs, which would be empty; log less often with "
            "--logging_steps N instead"
        )
    every = args.logging_steps if args.logging_steps >= 1 else math.ceil(args.max_steps * args.logging_steps)
    if _value(args.logging_strategy) == "steps" and args.max_steps > 0 and every > args.max_steps:
        raise ConfigurationError(
            f"--logging_steps {args.logging_steps}: the first log would come after the run's last step (--max_steps "
            f"{args.max_steps}), so the report's training history and the divergence watch would read nothing; log "
            f"at most every {args.max_steps} steps"
        )
    if getattr(args, "use_liger_kernel", False):
        raise ConfigurationError(
            "--use_liger_kernel replaces the model's norm modules with Liger's fused kernels, so the TaperNorms would "
            "be bypassed (nothing would taper, nothing could fold); leave it off"
        )
    if getattr(args, "push_to_hub", False):
        raise ConfigurationError(
            "--push_to_hub would upload the run folder from inside training; push the folded export afterwards "
            "with hf-tapernorm push"
        )


def refuse_trainer_evaluation(args) -> None:
    """Refuse (one line) a Trainer option that evaluates, or picks a checkpoint by an evaluation's metric: taper
    gives the Trainer no evaluation set (it measures the held-out blocks itself, before and after training), so
    each would fail once the model is loaded (an evaluation without a set; --save_strategy best without a metric)
    or be ignored without a word (no step is ever "best": --save_strategy best writes no checkpoint, so a stopped
    run could not be resumed). Reads the options as given or as TrainingArguments has converted them: taper's
    arguments call it before TrainingArguments' own checks, whose message for --load_best_model_at_end would
    point to --save_strategy best."""
    strategy = _value(args.eval_strategy)
    needs_evaluation = {  # the option as given -> what taper does instead
        f"--eval_strategy {strategy}": (strategy != "no", "leave it at 'no'"),
        "--eval_on_start": (args.eval_on_start, "leave it off"),
        "--save_strategy best": (
            _value(args.save_strategy) == "best",
            "no step is ever best, so no checkpoint would be written; use steps (every --save_steps) or epoch",
        ),
        "--load_best_model_at_end": (
            args.load_best_model_at_end,
            "there is no best checkpoint to load, and taper exports the last step's model; leave it off",
        ),
        f"--metric_for_best_model {args.metric_for_best_model}": (
            args.metric_for_best_model is not None,
            "no checkpoint is compared by a metric; leave it out",
        ),
        "--greater_is_better": (
            args.greater_is_better is not None,
            "no checkpoint is compared by a metric; leave it out",
        ),
    }
    for option, (given, instead) in needs_evaluation.items():
        if given:
            raise ConfigurationError(
                f"{option}: taper gives the Trainer no evaluation set (it evaluates the held-out blocks itself, "
                f"before and after training): {instead}"
            )


def _require_finite(args, config: TaperNormConfig) -> None:
    """Every float option finite: NaN passes most range checks (every comparison is False) and inf many."""
    for field in dataclasses.fields(args):
        value = getattr(args, field.name, None)
        if isinstance(value, float) and not math.isfinite(value):
            hint = " (0 turns clipping off)" if field.name == "max_grad_norm" else ""
            raise ConfigurationError(f"--{field.name} must be a finite number, got {value}{hint}")
    for name, value in config.options().items():  # by option names: the flags
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigurationError(f"--{name} must be a finite number, got {value}")


def _require_positive_counts(args) -> None:
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps"):
        value = getattr(args, name)
        if not isinstance(value, int) or value < 1:
            raise ConfigurationError(f"--{name} must be a positive integer, got {value}")
    check_seeds(args)  # --seed, --data_seed: the Trainer seeds NumPy and the data order after the model has loaded
    if args.max_grad_norm is not None and args.max_grad_norm < 0:  # the Trainer clips only above 0: silently off
        raise ConfigurationError(f"--max_grad_norm must be >= 0, got {args.max_grad_norm} (0 turns clipping off)")
    if args.weight_decay < 0:  # passed per parameter group, which torch's optimizers do not range-check
        raise ConfigurationError(f"--weight_decay must be >= 0, got {args.weight_decay}")


def _check_runtime(args) -> None:
    """The options the Trainer reads only once the model is loaded, or on the first step: how the model is compiled,
    sharded and trained (NEFTune's noise). transformers and torch raise on them then, as a traceback."""
    if args.torch_compile:
        backend, mode = args.torch_compile_backend, args.torch_compile_mode
        check_compile_options(backend, mode, ("--torch_compile_backend", "--torch_compile_mode"))
        try:  # as the Trainer makes it: accelerate's backends are fewer than torch's
            TorchDynamoPlugin(backend=backend, mode=mode)
        except ValueError:
            backends = ", ".join(known.value.lower() for known in DynamoBackend)
            raise ConfigurationError(
                f"--torch_compile_backend {backend}: not a backend accelerate compiles the Trainer's model with: "
                f"{backends}"
            ) from None
    if args.fsdp and not args.fsdp_config.get("xla", False) and _value(args.parallel_mode) != "distributed":
        raise ConfigurationError(
            "--fsdp: FSDP shards the model over the processes of a distributed launch, and this run is one process; "
            "launch it with torchrun --nproc_per_node N (or accelerate launch), or leave --fsdp out"
        )
    if args.neftune_noise_alpha is not None and args.neftune_noise_alpha < 0:
        raise ConfigurationError(
            f"--neftune_noise_alpha must be >= 0 (the scale of the noise NEFTune adds to the embeddings), got "
            f"{args.neftune_noise_alpha}; leave it out for no noise"
        )


def _check_optimizer(args) -> None:
    """Build the optimizer the Trainer would build (its class and kwargs) on one stand-in parameter."""
    try:
        optimizer_class, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
        optimizer_class([torch.nn.Parameter(torch.zeros(2, 2, device=args.device))], **kwargs)
    except (ImportError, ValueError, TypeError, RuntimeError) as error:
        raise ConfigurationError(f"--optim {_value(args.optim)} with these options: {first_line(error)}") from None


def _check_scheduler(args, schedule: TaperSchedule) -> None:
    """Build the scheduler (on a stand-in optimizer) and read its learning rate at the steps that matter; refuse one
    that outlasts the run, one whose rate is not finite, or a warmup still rising when the taper starts."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=args.learning_rate)
    total = schedule.total_steps
    warmup = args.get_warmup_steps(total)
    if warmup > schedule.k_start:
        raise ConfigurationError(
            f"--warmup_steps {args.warmup_steps} is {warmup} steps, past the taper's start (step {schedule.k_start}): "
            "the calibration at g = 1 and the taper would see a learning rate still rising; shorten the warmup or "
            "move --taper_start"
        )
    kwargs = checked_scheduler_kwargs(args)  # keys the scheduler takes and the Trainer does not set itself
    if _value(args.lr_scheduler_type) == "warmup_stable_decay":
        phases = warmup + sum(_steps_of(kwargs, key) for key in ("num_decay_steps", "num_stable_steps"))
        if phases > total:
            raise ConfigurationError(
                f"--lr_scheduler_kwargs {kwargs}: warmup ({warmup}) + stable + decay steps = {phases}, more than "
                f"--max_steps {total}: the schedule would be cut short and start decayed"
            )
    described = f"--lr_scheduler_type {_value(args.lr_scheduler_type)} with --lr_scheduler_kwargs {kwargs}"
    try:
        scheduler = get_scheduler(
            args.lr_scheduler_type,
            optimizer,
            num_warmup_steps=warmup,
            num_training_steps=total,
            scheduler_specific_kwargs=kwargs,
        )
        rates = [  # a LambdaLR: schedules that follow evaluation metrics need an eval strategy, refused first
            base * rate(step)
            for step in _steps_that_matter(total, warmup, schedule)
            for base, rate in zip(scheduler.base_lrs, scheduler.lr_lambdas)
        ]
    except (TypeError, ValueError, ZeroDivisionError, OverflowError) as error:
        raise ConfigurationError(f"{described}: {first_line(error)}") from None
    if not all(math.isfinite(rate) and rate >= 0 for rate in rates):
        raise ConfigurationError(f"--lr_scheduler_kwargs {kwargs}: the learning rate is not finite over the run")


def _steps_of(kwargs: dict, key: str) -> int:
    """A step count of --lr_scheduler_kwargs (absent or a null num_stable_steps: 0), refused unless a whole number."""
    value = kwargs.get(key, 0) if key == "num_decay_steps" else kwargs.get(key) or 0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf or value % 1:
        raise ConfigurationError(
            f"--lr_scheduler_kwargs {kwargs}: {key} must be a whole number of steps, got {value!r}"
        )
    return int(value)


#: Evenly spaced steps read besides the phase boundaries (a schedule's value between them: a cosine's trough).
_GRID = 64


def _steps_that_matter(total: int, warmup: int, schedule: TaperSchedule) -> list[int]:
    """The scheduler's step indices (0: the first optimizer step) where a schedule changes phase, and either side:
    the start, the warmup's end, the taper's start and end, the last step, and an even grid between. Reading
    these, not every step, keeps the check instant whatever --max_steps is."""
    boundaries = (0, warmup, schedule.k_start, schedule.k_end, total)
    steps = {step + offset for step in boundaries for offset in (-1, 0)}
    steps.update(total * index // _GRID for index in range(_GRID))
    return sorted(step for step in steps if 0 <= step < total)


def _value(option: Any) -> str:
    return str(getattr(option, "value", option))


def run_writes(
    model: torch.nn.Module, training_args, config: TaperNormConfig, *, dtype: Optional[str], baseline: bool
) -> dict[str, int]:
    """The bytes a taper run is sure to have on disk at once, at its peak, by what writes them: the one place that
    knows them.

    Read from the model's structure (``model`` may be on the meta device, where its parameters carry the dtype
    its checkpoint loads in): each copy of the weights at their element size (``dtype``'s when one is asked for);
    the optimizer's two moments per trainable weight for an Adam-family ``--optim`` (torch keeps them in the
    weight's dtype; 8-bit and 4-bit variants in 1 and 0.5 bytes; low-rank ones such as GaLore are not counted); the
    distillation teacher's snapshot when a checkpoint holds one; the tapered checkpoint and the folded export; and
    with ``--baseline`` the baseline's checkpoints and its model. A Trainer checkpoint is deleted only after the
    next one is written (``--save_total_limit``), so the checkpoints that coexist then are counted (_checkpoints);
    the peak is the larger of the moments the last checkpoint of a training is written and the run's end. Never
    more than the run writes (no file headers, no tokenizer), so a run refused by it could not have finished.
    """
    parameters = list(model.parameters())
    size = getattr(torch, dtype).itemsize if dtype not in (None, "auto") else None
    weights = sum(p.numel() * (size or p.element_size()) for p in parameters)
    trainable = [p for p in parameters if p.requires_grad]
    moments = int(sum(p.numel() * _moment_bytes(training_args, size or p.element_size()) for p in trainable) * 2)
    final = {"the final checkpoint's weights": weights}
    if moments:
        final["its optimizer state (two moments per weight)"] = moments
    teacher = config.distillation
    teacher_kept = config.experimental.distill_from != "current" and teacher.until != "taper_end"  # else none saved
    if teacher.weight > 0 and teacher_kept:
        final["its distillation teacher"] = weights
    checkpoint = sum(final.values())
    at_peak, kept = _checkpoints(training_args)
    if not at_peak:  # --save_strategy no (or best, which needs evaluations): no checkpoint is sure to be written
        final = {}

    def older(count: int, why: str) -> dict[str, int]:
        return {f"{count} earlier checkpoint(s) {why}": count * checkpoint} if count > 0 else {}

    after = {**final, **older(kept - 1, "that --save_total_limit keeps")}
    moments_of_the_run = [{**final, **older(at_peak - 1, "still on disk while it is written")}]
    if baseline:
        baseline_checkpoint = weights + moments
        moments_of_the_run.append(
            {**after, "the baseline run's checkpoints while its last is written": at_peak * baseline_checkpoint}
        )
        after = {
            **after,
            "the baseline run's checkpoints": kept * baseline_checkpoint,
            "the baseline run's model": weights,
        }
    moments_of_the_run.append({**after, "the tapered checkpoint": weights, "the folded export": weights})
    return max(moments_of_the_run, key=lambda moment: sum(moment.values()))


def _checkpoints(training_args) -> tuple[int, int]:
    """How many checkpoints of one training are on disk at once: while its last is written, and after.

    ``--save_strategy steps`` saves every ``--save_steps`` (a fraction of the run when < 1) and at the last step;
    ``--save_total_limit`` deletes the oldest only once a new one is written, so at that moment one more than the
    limit coexist. ``epoch``: at least the last; ``no`` and ``best`` (which needs evaluations): none for sure."""
    strategy = _value(training_args.save_strategy)
    if strategy != "steps":
        return (1, 1) if strategy == "epoch" else (0, 0)
    total, every = training_args.max_steps, training_args.save_steps
    every = math.ceil(total * every) if every < 1 else int(every)
    saves = -(-total // every) if every > 0 else 1  # 0: at the last step only
    limit = training_args.save_total_limit
    if limit is None or limit <= 0:  # the Trainer deletes none
        return saves, saves
    return min(saves, limit + 1), min(saves, limit)


def _moment_bytes(training_args, element: int) -> float:
    """The bytes of one Adam moment of a weight of ``element`` bytes under ``--optim`` (0: not an Adam state)."""
    optim = _value(training_args.optim).lower()
    if "adam" not in optim or any(low_rank in optim for low_rank in ("galore", "apollo", "lomo")):
        return 0
    return 0.5 if "4bit" in optim else 1 if "8bit" in optim else element


def check_disk_space(
    output_dir: Path,
    model: torch.nn.Module,
    training_args,
    config: TaperNormConfig,
    *,
    dtype: Optional[str],
    baseline: bool,
    reclaimable: int = 0,
) -> int:
    """Refuse a run whose folder's disk cannot hold what the run is sure to write (run_writes); returns that sum.

    A full disk is found when a checkpoint or an export is written: after the whole training, and the
    half-written checkpoint cannot be resumed. ``reclaimable``: bytes the run deletes first (``--overwrite``).
    """
    writes = run_writes(model, training_args, config, dtype=dtype, baseline=baseline)
    return check_free_space(output_dir, writes, "this run", reclaimable=reclaimable)


def check_free_space(output_dir: Path, writes: dict[str, int], who: str, *, reclaimable: int = 0) -> int:
    """Refuse (one line naming ``--output_dir``, and ``writes`` part by part) a command whose folder's disk has less
    free than the sum of ``writes`` (bytes by what writes them; ``who`` writes them: "this run", "this fold");
    returns that sum. The folder need not exist: its nearest existing parent's disk is read."""
    needed = sum(writes.values())
    folder = expand_user(output_dir, f"--output_dir '{output_dir}'").resolve()
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    free = shutil.disk_usage(existing).free + reclaimable
    if free < needed:
        listing = ", ".join(f"{what} {_gigabytes(count)}" for what, count in writes.items())
        raise ConfigurationError(
            f"--output_dir {output_dir}: its disk has {_gigabytes(free)} free, and {who} writes at least "
            f"{_gigabytes(needed)} ({listing}); free space or choose an --output_dir on another disk"
        )
    return needed


def export_writes(model: torch.nn.Module, tied_head: str) -> dict[str, int]:
    """The bytes the folded export of the patched ``model`` is sure to hold, by what: its weight matrices (every
    parameter of two or more dimensions, at its element size: the norms' vectors fold into them, none leaves) and,
    where the fold unties a tied lm_head (``tied_head``), the head's own copy. ``model`` may be weightless (on the
    meta device). Never more than the export writes (no vectors, config, tokenizer or file headers)."""
    writes = {"its weight matrices": sum(p.numel() * p.element_size() for p in model.parameters() if p.dim() >= 2)}
    if unties_head(model, tied_head):
        head = model.get_output_embeddings().weight
        writes["the lm_head the fold unties"] = head.numel() * head.element_size()
    return writes


def check_export_space(output_dir: Path, checkpoint: Path, tied_head: str) -> int:
    """Refuse a fold of the tapered ``checkpoint`` whose ``--output_dir`` disk cannot hold the export
    (export_writes), from the checkpoint's config and its weights' file headers: before the weights load and fold,
    not as a full disk once they are written. Returns the bytes counted (0: a sharded checkpoint, whose
    files say no dtype, is not counted)."""
    dtype = _stored_dtype(checkpoint)
    if dtype is None:
        return 0
    writes = export_writes(weightless_tapered(checkpoint, dtype), tied_head)
    return check_free_space(output_dir, {f"the folded export: {k}": v for k, v in writes.items()}, "this fold")


#: safetensors' dtype names -> the floating dtypes a checkpoint's weights are stored in.
_STORED_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _stored_dtype(checkpoint: Path) -> Optional[torch.dtype]:
    """The dtype a fold loads ``checkpoint`` in (load_tapered's rule: the most common one of its floating matrices),
    read from the safetensors headers alone; None when there are none to read (a sharded or damaged checkpoint:
    loading it names the problem)."""
    found: list[torch.dtype] = []
    for path in sorted(checkpoint.glob("*.safetensors")):
        if path.name.startswith("distillation_"):
            continue
        try:
            with safe_open(str(path), framework="pt") as handle:
                slices = [handle.get_slice(key) for key in handle.keys()]  # noqa: SIM118 - no __iter__
        except (SafetensorError, OSError):
            return None
        found += [
            _STORED_DTYPES[s.get_dtype()] for s in slices if s.get_dtype() in _STORED_DTYPES and len(s.get_shape()) >= 2
        ]
    return max(set(found), key=found.count) if found else None


def _gigabytes(count: int) -> str:
    return f"{count / 1e9:.2f} GB"


__all__ = [
    "check_disk_space",
    "check_export_space",
    "check_free_space",
    "check_trainer_options",
    "check_training_blocks",
    "export_writes",
    "refuse_trainer_evaluation",
    "run_writes",
]
