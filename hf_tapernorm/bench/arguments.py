"""The benchmark's options and its grid of cases, checked before any model is loaded.

``hf-tapernorm bench`` parses like every other subcommand (``hf_tapernorm/_parsing.py``: transformers'
``HfArgumentParser``, one-line usage errors, or a single JSON/YAML file of options). Lists are
``list[...]`` fields, whose choices argparse cannot check, so ``__post_init__`` checks them: a typo
fails in a second, not after the minutes it takes to load a model and build its variants.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import torch

from .._parsing import parse
from ..app.data_checks import (
    check_data_paths,
    check_hub_dataset,
    check_output_outside,
    check_output_outside_models,
)
from ..app.run_folder_hints import bench_hint, refuse_run_folder
from ..app.run_lock import check_destination
from ..app.validation import check_within_positions
from ..data.sources import DEFAULT_SAMPLE_BY
from ..errors import ConfigurationError
from ..utils import SHORT_DTYPE_NAMES, check_compile_options, expand_user, expand_user_options, read_dtype
from .variants import OF_THE_ORIGINAL

PROG = "hf-tapernorm bench"
NORMS = ("recipe", "internal", "all")
KINDS = ("original", "flashnorm", "explicit", "folded", "limit")
MODES = ("last", "full", "decode", "train")
TRAIN_WORKLOADS = ("normalized", "warmup", "taper", "tapered-distilled", "tapered")
EXECUTIONS = ("eager", "compile")
RUNTIMES = ("torch", "onnxruntime")
TRAIN_PRECISIONS = ("fp32", "bf16")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
INFERENCE_MODES = tuple(mode for mode in MODES if mode != "train")
#: The variants that remove norms, so read --norms (variants.OF_THE_ORIGINAL are one each, whatever it says).
NORMED_KINDS = tuple(kind for kind in KINDS if kind not in OF_THE_ORIGINAL)
#: The options only some runs read: option -> its rules, each (the list option that selects those runs, the values
#: that do); an option is read only where every rule holds. The train mode reads its text and optimizer steps; the
#: inference modes their variants and random tokens, and the variants that remove norms --norms; decode its new
#: tokens; a compiled execution the compile options. Every other option is read by every run (--runtimes too:
#: _check_onnxruntime refuses onnxruntime, its one other value, without an inference mode or eager execution).
READ_BY = {
    **{name: (("modes", ("train",)),) for name in ("dataset_name", "dataset_config_name", "text_column")},
    **{name: (("modes", ("train",)),) for name in ("learning_rate", "train_workloads", "train_precisions")},
    "norms": (("modes", INFERENCE_MODES), ("variants", NORMED_KINDS)),
    **{name: (("modes", INFERENCE_MODES),) for name in ("variants", "seed")},
    "new_tokens": (("modes", ("decode",)),),
    **{name: (("execution", ("compile",)),) for name in ("compile_backend", "compile_mode")},
}


def check_device(name: str) -> None:
    """A device torch can name and this machine has: cpu, or the accelerator torch finds (cuda, xpu, mps, ...). A cpu
    index past 0 is refused before, with the names of one device (check_distinct_devices)."""
    try:
        device = torch.device(name)
    except RuntimeError:
        message = f"--devices {name!r} is not a device torch knows (cpu, cuda, cuda:1, mps, ...)"
        raise ConfigurationError(message) from None
    if device.type == "cpu":
        return
    if device.type == "cuda":
        available, count = torch.cuda.is_available(), torch.cuda.device_count()
    else:
        accelerator = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
        available = accelerator is not None and accelerator.type == device.type
        count = torch.accelerator.device_count() if available else 0
    if not available:
        raise ConfigurationError(f"device {name!r} requested but {device.type.upper()} is not available here")
    if device.index is not None and device.index >= count:
        raise ConfigurationError(f"device {name!r} requested but this machine has {count} {device.type} device(s)")


def check_cpu_index(name: str, device: torch.device) -> None:
    """Refuse a cpu name with an index past 0 (``cpu:1``): torch has one CPU device, whatever its cores, and runs
    ``cpu:1`` on it, so the timing would be the CPU's recorded under a device this machine does not have."""
    if device.type == "cpu" and device.index:
        raise ConfigurationError(f"--devices {name!r}: the CPU is one device: name it cpu")


def check_distinct_devices(names: Sequence[str]) -> None:
    """Refuse two names of one device in ``--devices`` (cpu and cpu:0; cuda and cuda:0, the device torch uses for
    ``cuda``): it would be timed twice, as two rows, where a value listed twice is refused (_check_list). A name
    torch cannot read is left to check_device, which says so."""
    seen: dict[tuple[str, int], str] = {}
    for name in names:
        try:
            device = torch.device(name)
        except RuntimeError:
            continue
        check_cpu_index(name, device)  # cpu:1 is no second name of the CPU, but a device torch does not have
        key = (device.type, _device_index(device))
        if key in seen:
            raise ConfigurationError(
                f"--devices lists one device twice: {seen[key]!r} and {name!r} name the same {device.type} device "
                "(it would be timed twice, as two rows); keep one"
            )
        seen[key] = name


def _device_index(device: torch.device) -> int:
    """The index of the device ``device`` names: every cpu name is the one CPU (0); an accelerator's name without an
    index is its current device (0 in a fresh process, and where no accelerator can be asked, as on this one)."""
    if device.type == "cpu":
        return 0
    if device.index is not None:
        return device.index
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.current_device()
    return 0


def usable_cpus() -> int:
    """The logical CPUs this process may run on (its affinity where the system has one: a container or ``taskset``
    may allow fewer than the machine has)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def check_threads(threads: Sequence[int]) -> None:
    """Refuse a ``--threads`` value above usable_cpus(): beyond the CPUs the threads only take turns on them (the
    timing would be of that), and a count far beyond crashes the thread pool (SIGSEGV) once a case runs, after the
    model was loaded and calibrated."""
    cpus = usable_cpus()
    over = [n for n in threads if n > cpus]
    if over:
        raise ConfigurationError(
            f"--threads {' '.join(map(str, over))}: more than the {cpus} CPU(s) this process may run on, where threads "
            f"only take turns and the timing would measure that; pass at most {cpus}"
        )


def _help(text: str) -> dict:
    return {"help": text}


def short_dtypes(name: str, values: Sequence, shorts: Sequence[str]) -> list:
    """``values`` of the dtype list option ``name`` in the benchmark's spelling (``shorts``, keys of DTYPES: fp32),
    each read by utils.read_dtype, so that ``float32`` is fp32 here as ``fp32`` is float32 to eval's --dtype;
    bench.json keeps the short names. A value that is no text is left as it is (argparse gives each item its type)."""
    accepted = tuple(DTYPES[short] for short in shorts)
    read = [
        SHORT_DTYPE_NAMES[str(read_dtype(v, accepted, f"--{name}: {v!r} is none of its dtypes")).removeprefix("torch.")]
        if isinstance(v, str)
        else v
        for v in values
    ]
    typed: dict[object, object] = {}
    for value, short in zip(values, read):  # a dtype twice: named as typed, not as read
        if short in typed and typed[short] != value:
            raise ConfigurationError(f"--{name} lists one dtype twice: {typed[short]} and {value} are both {short}")
        if short in typed:
            raise ConfigurationError(f"--{name} lists a value twice: {' '.join(map(str, values))}")
        typed[short] = value
    return read


def _check_list(name: str, values: Sequence, choices: Optional[Sequence] = None) -> None:
    """A list option: not empty, no value twice (it would be timed twice), each among ``choices`` when given."""
    if not values:
        raise ConfigurationError(f"--{name} needs at least one value")
    wrong = [v for v in values if choices is not None and v not in choices]
    if wrong:
        raise ConfigurationError(f"--{name}: {', '.join(map(repr, wrong))} not among {', '.join(choices)}")
    if len(set(values)) != len(values):
        raise ConfigurationError(f"--{name} lists a value twice: {' '.join(map(str, values))}")


@dataclass
class BenchArguments:
    """Every option of ``hf-tapernorm bench``; see ``--help`` for each."""

    model_name_or_path: Optional[str] = field(
        default=None, metadata=_help("Hub id, local folder or .gguf file (default: the embedded SmolLM2-135M).")
    )
    gguf_file: Optional[str] = field(default=None, metadata=_help("GGUF file name inside --model_name_or_path."))
    norms: list[str] = field(
        default_factory=lambda: ["recipe"],
        metadata=_help(
            "Which norms the inference variants remove: recipe (those the model's default recipe, "
            "TaperNormConfig.for_model, tapers), internal (every internal norm: Internal-Taper), all (the "
            "final norm too). Several values prefix the variant names (internal-folded, ...)."
        ),
    )
    variants: list[str] = field(
        default_factory=lambda: list(KINDS),
        metadata=_help(
            "Inference variants: original (unpatched), flashnorm (the original with every pre-norm's weight "
            "folded into the modules it reads, weightless norms left: the exact peer without training, "
            "reloaded), explicit (patched at g = 0, the per-channel maps as operations), folded (the exported "
            "norm-free model, its kept RMS pre-norms weightless as in flashnorm, reloaded), limit (the original "
            "with the removed norms replaced by identity)."
        ),
    )
    modes: list[str] = field(
        default_factory=lambda: ["last", "decode"],
        metadata=_help(
            "last (last-position logits, no cache), full (all logits), decode (KV-cached greedy "
            "decoding), train (optimizer steps of the default recipe's phases against the unpatched "
            "model)."
        ),
    )
    train_workloads: list[str] = field(
        default_factory=lambda: list(TRAIN_WORKLOADS),
        metadata=_help(
            "The train mode's workloads, each an optimizer step: normalized (the unpatched model, the "
            "reference), warmup (g = 1, statistics gathered), taper (0 < g < 1, teacher on), "
            "tapered-distilled (g = 0, teacher on), tapered (g = 0, teacher released). Each holds a copy "
            "of the model and its AdamW state: list fewer where memory is short."
        ),
    )
    train_precisions: list[str] = field(
        default_factory=lambda: ["fp32"],
        metadata=_help(
            "The train mode's arithmetic: fp32 (float32), and bf16 (bfloat16: autocast over fp32 master weights, as "
            "taper --bf16 trains). Each value beyond fp32 adds every workload again (named workload+bf16), "
            "interleaved with the fp32 ones; its ratio to the same workload in fp32 is printed."
        ),
    )
    runtimes: list[str] = field(
        default_factory=lambda: ["torch"],
        metadata=_help(
            "Where the inference variants run: torch, and onnxruntime (the original and folded variants "
            "exported to ONNX with their KV cache, run in ONNX Runtime on the CPU; named ort-<variant>, with "
            "their graph node counts; needs the onnx extra)."
        ),
    )
    batch_sizes: list[int] = field(default_factory=lambda: [1], metadata=_help("Sequences per batch."))
    seq_lens: list[int] = field(default_factory=lambda: [128], metadata=_help("Sequence (decode: prompt) length."))
    new_tokens: int = field(default=32, metadata=_help("Decoded tokens per decode run."))
    dtypes: list[str] = field(
        default_factory=lambda: ["fp32"],
        metadata=_help("Weight dtypes: fp32, bf16, fp16 (or float32, bfloat16, float16)."),
    )
    devices: list[str] = field(default_factory=lambda: ["cpu"], metadata=_help("cpu, cuda, cuda:1, ..."))
    threads: list[int] = field(
        default_factory=lambda: [min(2, usable_cpus())],
        metadata=_help(
            "torch.set_num_threads values (ONNX Runtime's too), each at most the CPUs this process may run on: more "
            "threads than CPUs only take turns on them, so a timing would measure the contention, not the variant."
        ),
    )
    execution: list[str] = field(default_factory=lambda: ["eager"], metadata=_help("eager and/or compile."))
    compile_backend: Optional[str] = field(default=None, metadata=_help("torch.compile backend (default: inductor)."))
    compile_mode: Optional[str] = field(
        default=None, metadata=_help("torch.compile mode, e.g. reduce-overhead (CUDA graphs on GPU).")
    )
    warmup: int = field(
        default=2,
        metadata=_help(
            "Untimed runs of every variant before timing; a compiled case (--execution compile) runs each at least "
            "once, untimed, whatever this says: its first run compiles."
        ),
    )
    repeats: int = field(default=10, metadata=_help("Timed rounds; each runs every variant once, in rotating order."))
    calibration_batches: int = field(
        default=4,
        metadata=_help(
            "Batches that calibrate c: random tokens for the inference variants; for train, real text "
            "batches run as optimizer steps at g = 1 before the taper workloads are timed."
        ),
    )
    op_counts: bool = field(default=True, metadata=_help("Count aten operations with torch.profiler."))
    dataset_name: Optional[str] = field(
        default=None,
        metadata=_help(
            "Text of the train mode: a Hub dataset or a local txt/json/jsonl/parquet/csv file or folder "
            "(default: the embedded corpus, the Python standard library's sources)."
        ),
    )
    dataset_config_name: Optional[str] = field(default=None, metadata=_help("Hub dataset configuration."))
    text_column: Optional[str] = field(default=None, metadata=_help("Column holding the text (default: text)."))
    learning_rate: float = field(default=1e-4, metadata=_help("AdamW learning rate of the train mode's steps."))
    seed: int = field(default=0, metadata=_help("Seed of the random tokens of the inference modes."))
    output_dir: str = field(default="runs/bench", metadata=_help("Where bench.json and bench.png are written."))

    def __post_init__(self) -> None:
        expand_user_options(self, "model_name_or_path", "dataset_name", "output_dir")
        refuse_run_folder(self.model_name_or_path, "--model_name_or_path", bench_hint)
        self.dtypes = short_dtypes("dtypes", self.dtypes, tuple(DTYPES))
        self.train_precisions = short_dtypes("train_precisions", self.train_precisions, TRAIN_PRECISIONS)
        _check_list("norms", self.norms, NORMS)
        _check_list("variants", self.variants, KINDS)
        _check_list("modes", self.modes, MODES)
        _check_list("train_workloads", self.train_workloads, TRAIN_WORKLOADS)
        if "normalized" not in self.train_workloads:
            raise ConfigurationError("--train_workloads must include normalized: every train ratio is taken against it")
        _check_list("train_precisions", self.train_precisions, TRAIN_PRECISIONS)
        if "fp32" not in self.train_precisions:
            raise ConfigurationError("--train_precisions must include fp32: every train ratio is taken against it")
        _check_list("runtimes", self.runtimes, RUNTIMES)
        if "onnxruntime" in self.runtimes:
            self._check_onnxruntime()
        _check_list("dtypes", self.dtypes, tuple(DTYPES))
        _check_list("execution", self.execution, EXECUTIONS)
        check_compile_options(self.compile_backend, self.compile_mode, ("--compile_backend", "--compile_mode"))
        for name in ("batch_sizes", "seq_lens", "threads", "devices"):
            _check_list(name, getattr(self, name))
        check_distinct_devices(self.devices)
        for name in ("batch_sizes", "seq_lens", "threads"):
            if any(v < 1 for v in getattr(self, name)):
                raise ConfigurationError(f"--{name} must be positive, got {' '.join(map(str, getattr(self, name)))}")
        check_threads(self.threads)
        for name, least in (("new_tokens", 1), ("repeats", 1), ("calibration_batches", 1), ("warmup", 0)):
            if getattr(self, name) < least:
                raise ConfigurationError(f"--{name} must be at least {least}, got {getattr(self, name)}")
        if not self.learning_rate > 0:
            raise ConfigurationError(f"--learning_rate must be positive, got {self.learning_rate}")
        self._check_unread_options()
        if "train" in self.modes and any(s < 4 for s in self.seq_lens):
            raise ConfigurationError("--modes train packs text blocks of --seq_lens tokens: each must be at least 4")
        check_output_outside_models(  # as taper refuses its --output_dir in its model folder
            "--output_dir",
            self.output_dir,
            {"--model_name_or_path": self.model_name_or_path},
            reader="bench",
            written="bench.json and bench.png",
        )
        if "train" in self.modes:  # read once the tokenizer is loaded: a mistyped path is refused now
            check_data_paths(self._train_data())  # as taper and eval check theirs (the text column too)
            check_output_outside(  # as taper, eval and fold check theirs
                "--output_dir",
                self.output_dir,
                {"--dataset_name": self.dataset_name},
                reader="bench's train mode",
                written="bench.json and bench.png",
            )
            check_hub_dataset(
                "--dataset_name", self.dataset_name, self.dataset_config_name, text_column=self.text_column
            )
        for device in self.devices:
            check_device(device)
        self.output_dir = str(expand_user(self.output_dir))  # `~/b` is $HOME/b, as every command reads it
        output = Path(self.output_dir)
        advice = "wait for it to finish, or choose another --output_dir"
        check_destination(output, f"--output_dir '{output}'", advice=advice)  # as taper and fold check theirs
        check_earlier_results(output)

    def _check_unread_options(self) -> None:
        """Refuse an option given (other than its default) that nothing in this run reads (READ_BY: --new_tokens
        without decode, --compile_mode without --execution compile, --dataset_name without train, ...): the
        benchmark would run without a word about it, and bench.json would record it in its settings as if used."""
        defaults = {f.name: f.default if f.default_factory is MISSING else f.default_factory() for f in fields(self)}
        unread: dict[tuple[str, tuple[str, ...]], list[str]] = {}
        for name, rules in READ_BY.items():
            broken = [(selector, values) for selector, values in rules if not {*values} & {*getattr(self, selector)}]
            if getattr(self, name) != defaults[name] and broken:  # named under the first rule it breaks
                unread.setdefault(broken[0], []).append(f"--{name}")
        if unread:  # the first group: one line
            (selector, values), given = next(iter(unread.items()))
            readers = " or ".join([", ".join(values[:-1]), values[-1]] if len(values) > 1 else values)
            raise ConfigurationError(
                f"{', '.join(given)}: read by --{selector} {readers} only, and --{selector} "
                f"{' '.join(getattr(self, selector))} has no {readers}; add {readers} to --{selector}, or leave "
                f"{'it' if len(given) == 1 else 'them'} out"
            )

    def _train_data(self) -> SimpleNamespace:
        """The train mode's text as the data arguments of taper and eval (app.data_checks.check_data_paths reads
        them): --dataset_name's default split (train), read whole into the datasets library's own cache, and no
        out-of-corpus text."""
        return SimpleNamespace(
            dataset_name=self.dataset_name,
            dataset_config_name=self.dataset_config_name,
            text_column=self.text_column,
            dataset_split=None,  # as the runner's load_text_dataset reads it
            split_option=None,  # bench has no --dataset_split: a folder of splits is refused, advising its files
            streaming=False,
            sample_by=DEFAULT_SAMPLE_BY,  # as the runner's load_text_dataset reads text files
            data_cache_dir=None,
            out_of_corpus_blocks=0,
            out_of_corpus_dataset=None,
            out_of_corpus_text_column=None,
        )

    def _check_onnxruntime(self) -> None:
        """ONNX Runtime runs fp32 graphs of the original and folded variants on the CPU, in the inference modes."""
        if not {"original", "folded"} & set(self.variants):
            raise ConfigurationError("--runtimes onnxruntime runs the original and folded variants: list one of them")
        if self.dtypes != ["fp32"] or self.devices != ["cpu"]:
            raise ConfigurationError(
                "--runtimes onnxruntime runs fp32 graphs on the CPU: use --dtypes fp32 --devices cpu"
            )
        if self.modes == ["train"]:
            raise ConfigurationError("--runtimes onnxruntime times inference: add --modes last, full or decode")
        if "eager" not in self.execution:  # a compiled case times torch only: its graphs would be exported unread
            raise ConfigurationError(
                f"--runtimes onnxruntime runs its graphs as exported, not compiled, and --execution "
                f"{' '.join(self.execution)} has no eager; add eager to --execution, or leave onnxruntime out"
            )
        from ..integrations.extras import require

        require("onnxruntime", "hf-tapernorm bench --runtimes onnxruntime")
        require("onnxscript", "hf-tapernorm bench --runtimes onnxruntime")

    def check_positions(self, hf_config) -> None:
        """Refuse a case longer than the model's positions (decode: prompt plus new tokens), before any loading."""
        extra = self.new_tokens if "decode" in self.modes else 0
        what = f"--seq_lens {max(self.seq_lens)}" + (f" + --new_tokens {extra} (decode)" if extra else "")
        check_within_positions(what, max(self.seq_lens) + extra, hf_config)

    @property
    def compile_options(self) -> dict[str, str]:
        """Keyword arguments of ``torch.compile`` (backend and mode, where given)."""
        return {k: v for k, v in (("backend", self.compile_backend), ("mode", self.compile_mode)) if v}


#: The files a benchmark writes into --output_dir; bench.json is the one that says who wrote them.
RESULT_FILES = ("bench.json", "bench.png")


def check_earlier_results(output: Path) -> None:
    """bench.json and bench.png are replaced only when they are an earlier benchmark's (checked before any model
    loads): a user's file of the same name, or a symbolic link, is never written over."""
    present = [output / name for name in RESULT_FILES if (output / name).exists() or (output / name).is_symlink()]
    if not present:
        return
    links = [p for p in present if p.is_symlink() or not p.is_file()]
    if links:
        raise ConfigurationError(f"--output_dir: '{links[0]}' is a symbolic link or a folder; choose another folder")
    try:
        earlier = json.loads((output / "bench.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        earlier = None
    if not (isinstance(earlier, dict) and {"settings", "results", "environment"} <= set(earlier)):
        names = ", ".join(p.name for p in present)
        raise ConfigurationError(
            f"--output_dir '{output}' holds {names} that no earlier hf-tapernorm bench wrote; they are left as they "
            "are: choose another --output_dir"
        )


def parse_arguments(argv: Sequence[str]) -> BenchArguments:
    """``argv`` as BenchArguments; a bad option raises ``UsageError``/``ConfigurationError`` (exit 2 via the CLI)."""
    (arguments,) = parse([BenchArguments], argv, PROG)
    return arguments


@dataclass(frozen=True)
class Case:
    """One point of the benchmark grid: every variant (or train workload) is timed on it, interleaved."""

    mode: str
    batch: int
    seq_len: int
    new_tokens: Optional[int]  # decode's only: None in the modes that decode nothing (bench.json records null)
    dtype: str
    device: str
    threads: int
    compiled: bool

    @property
    def steps(self) -> int:
        """Model forwards per timed run (decode: one per new token), so op counts are per forward."""
        return self.new_tokens if self.mode == "decode" else 1

    def label(self) -> str:
        shape = f"b{self.batch} T{self.seq_len}" + (f"+{self.new_tokens}" if self.mode == "decode" else "")
        run = "compiled" if self.compiled else "eager"
        return f"{self.mode} {shape} {self.dtype} {self.device} {self.threads}t {run}"


def cases(arguments: BenchArguments, dtype: str, device: str) -> Iterator[Case]:
    """The grid of one dtype and device, in the order the options list them."""
    for threads, execution, mode, batch, seq_len in itertools.product(
        arguments.threads, arguments.execution, arguments.modes, arguments.batch_sizes, arguments.seq_lens
    ):
        new_tokens = arguments.new_tokens if mode == "decode" else None
        yield Case(mode, batch, seq_len, new_tokens, dtype, device, threads, execution == "compile")


__all__ = [
    "DTYPES",
    "KINDS",
    "MODES",
    "NORMS",
    "RUNTIMES",
    "TRAIN_PRECISIONS",
    "TRAIN_WORKLOADS",
    "BenchArguments",
    "Case",
    "cases",
    "parse_arguments",
]
