"""Small mechanics shared by several layers of the package: torch's, and paths' (of hf_tapernorm, errors.py only)."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import time
from collections.abc import Iterable, Sequence
from contextvars import ContextVar
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from .errors import ConfigurationError


def in_backward_recompute() -> bool:
    """True while autograd re-runs a forward (gradient checkpointing), so it is not counted twice.

    Under torch.compile the answer is False: a compiled region recomputes checkpointed activations
    inside its backward graph without re-running this Python, and the graph-task query (it returns
    a Python int) would otherwise break the graph on every training forward.
    """
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over all ranks in place (a no-op in a single process); returns it.

    Every rank must call it in the same order: per-step statistics and flags are reduced this way.
    """
    if is_distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_max(tensor: torch.Tensor) -> torch.Tensor:
    """Max of ``tensor`` over all ranks in place (a no-op in a single process); returns it."""
    if is_distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


def replace_submodule(root: nn.Module, path: str, module: nn.Module) -> None:
    """Put ``module`` at the dotted ``path`` inside ``root`` (the parent must exist)."""
    parent, _, child = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, module)


def base_model_prefix(model: nn.Module) -> str:
    """``"model."`` for a ``*ForCausalLM`` whose bare transformer is ``model.model``; ``""`` for a bare model."""
    base = getattr(model, "base_model", model)
    return next((name + "." for name, module in model.named_modules() if module is base and name), "")


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def file_in_the_way(folder: Path) -> Optional[str]:
    """What blocks writing into ``folder``: "it" when ``folder`` is a file, the path of a file among its parents,
    or None (checked before anything is written, so the error names the file instead of a NotADirectoryError)."""
    for path in (folder, *folder.parents):
        if path.exists() and not path.is_dir():
            return "it" if path == folder else str(path)
    return None


def some_names(names: Sequence[str], shown: int = 8) -> str:
    """The first ``shown`` of ``names``, comma-separated, and how many more there are: a refusal names what it is
    about without printing a folder's every file."""
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")


def dangling_link(path: Path) -> Optional[str]:
    """The words naming the first symbolic link on ``path`` (a folder above it, or itself) whose target does not
    exist, or None (a link loop or an unreadable folder: the destination checks say so). In a chain of links the last
    one is named, with the target that is missing: that is the folder to create."""
    for place in [*reversed(path.parents), path]:
        try:
            if not place.is_symlink():
                continue
            os.stat(place)
        except FileNotFoundError:
            last = _last_link(place)
            return (
                f"'{last}' is a link to a folder that does not exist ('{os.readlink(last)}'); create that folder, "
                "or choose another"
            )
        except OSError:
            return None
    return None


def _last_link(link: Path) -> Path:
    """The last link of the chain ``link`` starts (a link to a link ...), each seen once."""
    seen = {link}
    while (target := Path(link.parent, os.readlink(link))).is_symlink() and target not in seen:
        seen.add(target)
        link = target
    return link


def dangling_parent_step(path: Path, what: str) -> Optional[str]:
    """The refusal (a line starting with ``what``) of a ``path`` with a ``..`` after a folder that does not exist, or
    None: the kernel takes it for no folder, a lexical reading for the one above, and a write that created the
    missing folder would go into the folder above instead (a user's, not empty) and leave a stray folder behind."""
    parts = path.parts
    for depth, part in enumerate(parts):
        if part != ".." or depth == 0:
            continue
        before = Path(*parts[:depth])
        try:
            os.stat(before)
        except FileNotFoundError:
            return (
                f"{what}: '{before}' does not exist, so the '..' after it names no folder; name the folder without "
                f"'..' ('{os.path.normpath(path)}')"
            )
        except OSError:  # a file on the way, or a folder this user cannot read: the destination checks say so
            return None
    return None


def expand_user(path: Union[str, os.PathLike], what: str = "", *, strict: bool = True) -> Path:
    """``path`` with a leading ``~`` or ``~user`` expanded as ``Path.expanduser`` does. Every path the package
    takes is expanded here, so "~/out" is the home folder's everywhere (never a folder named "~"), and a home
    folder this machine cannot name is one line instead of ``Path.expanduser``'s bare RuntimeError (and not
    ``os.path.expanduser``'s silence, after which a folder named "~user" would be written in the working folder).

    That line is a ConfigurationError that starts with ``what`` (the option and its value as typed, ``--output_dir
    '~x/o'``; default: the path as typed) and says what to write instead. ``strict=False`` keeps such a path as
    typed: a run's record may hold one written on another machine, which names nothing here (a missing path,
    which the record's reader reports as such).
    """
    try:
        return Path(path).expanduser()
    except RuntimeError:
        if not strict:
            return Path(path)
        head, what = Path(path).parts[0], what or f"'{os.fspath(path)}'"
        if head == "~":  # no HOME, and this user is not in the password database
            raise ConfigurationError(
                f"{what}: this machine names no home folder for '~' (HOME is unset); write the path in full"
            ) from None
        raise ConfigurationError(
            f"{what}: there is no user '{head[1:]}' on this machine, so '{head}' names no home folder; write the "
            "path in full, or start it with ~/ for your own home folder"
        ) from None


#: The options file being parsed and the options it gave a bare YAML ``~`` (YAML's null, which leaves an option at
#: its default): _parsing.parse sets it while it builds the command's arguments, so that a path option among them,
#: where the ``~`` was surely meant as the home folder, is refused by expand_user_options, which knows the paths.
BARE_TILDE_OPTIONS: ContextVar[tuple[str, frozenset[str]]] = ContextVar("BARE_TILDE_OPTIONS", default=("", frozenset()))


def expand_user_options(options: Any, *names: str) -> None:
    """Refuse now, by its flag (``--name 'value': ...``), each path option ``names`` of an arguments dataclass of
    cli/ or bench/ that is empty or whose ``~user`` names no user of this machine (expand_user). Their
    ``__post_init__`` calls it: a command then stops at parse time, before the checks deeper down that know the path
    but not the option. An empty path (an unset shell variable, ``--export_dir "$DIR"``) is ``Path("")``, the working
    folder, which a command would read, score, upload or write into in the option's name. A path option an options
    file gave a bare YAML ``~`` (:data:`BARE_TILDE_OPTIONS`) is refused: YAML reads it as null, the default folder,
    where its writer meant the home folder."""
    source, bare = BARE_TILDE_OPTIONS.get()
    for name in names:
        if name in bare:
            raise ConfigurationError(
                f"{source}: {name}: ~ is YAML's null, which leaves --{name} at its default, not the home folder: "
                f"write '~' (quoted) for the home folder, or leave {name} out for the default"
            )
        value = getattr(options, name)
        if value == "":
            declared = next(f for f in fields(options) if f.name == name)
            required = declared.default is MISSING and declared.default_factory is MISSING
            instead = "name one" if required else "name one, or leave the option out for its default"
            raise ConfigurationError(
                f"--{name} '': an empty path names no file or folder (it would be the working folder); {instead}"
            )
        if value:
            expand_user(value, f"--{name} '{value}'")


#: One past the largest seed any option takes: NumPy's range, [0, 2**32 - 1]. The Trainer seeds NumPy with --seed,
#: which refuses any other, and torch's CPU generator keeps a seed's low 32 bits (2**32 draws what 0 draws, -1 what
#: 2**32 - 1 draws) and fails beyond 64 bits: a seed outside it fails once the model is loaded, or repeats another
#: seed's draw without a word.
SEED_LIMIT = 2**32


def check_seeds(options: Any) -> None:
    """Refuse (ConfigurationError naming the flag) a seed of an arguments dataclass (a command's options, a
    TrainingArguments) outside [0, 2**32 - 1] (SEED_LIMIT): every field named ``seed`` or ``*_seed`` (``--seed``,
    ``--data_seed``, ``--heldout_seed``), so a seed option of any command is bounded as it is added; None (no seed,
    ``--data_seed``'s default) passes. The parser of every command (_parsing.parse) calls it."""
    for field in fields(options):
        value = getattr(options, field.name, None)
        seed = field.name == "seed" or field.name.endswith("_seed")
        if seed and isinstance(value, int) and not 0 <= value < SEED_LIMIT:
            raise ConfigurationError(f"--{field.name} must be in [0, 2**32 - 1], got {value}")


#: torch.compile's backends that torch (or a release of torch this package supports) may list while the packages they
#: compile with are optional: backend -> the modules it imports at its first compiled forward, each with the package
#: that installs it (onnxrt: those torch.onnx.is_onnxrt_backend_supported checks).
_BACKEND_PACKAGES = {
    "tvm": {"tvm": "apache-tvm"},
    "onnxrt": {"onnxruntime": "onnxruntime", "onnx": "onnx", "onnxscript": "onnxscript"},
    "openxla": {"torch_xla": "torch_xla"},
    "openxla_eval": {"torch_xla": "torch_xla"},
    "tensorrt": {"torch_tensorrt": "torch-tensorrt"},
    "torch_tensorrt": {"torch_tensorrt": "torch-tensorrt"},
    "ipex": {"intel_extension_for_pytorch": "intel-extension-for-pytorch"},
}


#: torch.compile's debug backends users compile with (torch lists them only with ``exclude_tags=()``): the graph
#: run as captured, and through AOTAutograd. The other debug and experimental ones are torch's own test tools (ts,
#: aot_ts, the minifiers: a traceback at the first compiled forward).
_DEBUG_BACKENDS = ("eager", "aot_eager")


def compile_backends() -> list[str]:
    """The ``torch.compile`` backends a model is compiled with here: those torch lists by default (its own and
    installed plugins', without the debug and experimental ones) and the debug ones users run (eager, aot_eager)."""
    return sorted({*torch.compiler.list_backends(), *_DEBUG_BACKENDS})


def check_compile_options(backend: Optional[str], mode: Optional[str], flags: tuple[str, str]) -> None:
    """Refuse (ConfigurationError naming the option, ``flags``: the backend's and the mode's) a ``torch.compile``
    backend not in :func:`compile_backends`, one whose package is not installed (torch lists tvm and openxla
    whatever is installed, and they import their package only at the first compiled forward), a mode inductor (the
    default backend) does not have, and a mode with another backend (torch passes it on as a keyword, which
    torchscript refuses and the others ignore): all fail, or are ignored, only at the first compiled forward,
    after the model was loaded."""
    accepted = compile_backends()
    if backend is not None and backend not in accepted:
        raise ConfigurationError(
            f"{flags[0]} {backend!r} is not a torch.compile backend that compiles a model here: give one of "
            f"{', '.join(accepted)} (inductor is the default)"
        )
    # found, not imported: tvm's import is slow
    missing = [(m, p) for m, p in _BACKEND_PACKAGES.get(backend, {}).items() if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigurationError(
            f"{flags[0]} {backend}: the backend compiles with {', '.join(m for m, _ in missing)}, not installed here: "
            f"pip install {' '.join(p for _, p in missing)}, or choose another backend (inductor is the default)"
        )
    if mode is None:
        return
    if backend not in (None, "inductor"):
        raise ConfigurationError(
            f"{flags[1]} {mode}: a mode is inductor's (torch.compile's default backend), and {flags[0]} {backend} "
            f"takes none; drop {flags[1]}, or compile with inductor"
        )
    from torch._inductor import list_mode_options  # where torch.compile's documentation lists its modes

    modes = list_mode_options()
    if mode not in modes:
        raise ConfigurationError(f"{flags[1]} {mode!r} is not a torch.compile mode: {', '.join(modes)}")


#: The dtypes a model loads in (an export, a tapered checkpoint), by torch's name of each.
LOAD_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
#: The short name of each dtype of LOAD_DTYPES (bench --dtypes and its reports spell fp32): every option and
#: parameter that takes a dtype by name takes either spelling, so that one options file holds a name every command
#: reads (a bench file's ``fp32`` and an eval file's ``float32`` are the same dtype).
SHORT_DTYPE_NAMES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64"}


def dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    """The names a refusal lists for ``dtypes``: both spellings of each (``float32/fp32, bfloat16/bf16``)."""
    names = (str(dtype).removeprefix("torch.") for dtype in dtypes)
    return ", ".join(f"{name}/{SHORT_DTYPE_NAMES[name]}" for name in names)


def read_dtype(
    value: Union[torch.dtype, str], accepted: Sequence[torch.dtype], refusal: str, suffix: str = ""
) -> torch.dtype:
    """The torch dtype among ``accepted`` that ``value`` names: the dtype itself, torch's name of it (``"float32"``,
    ``"torch.float32"``) or its short name (``"fp32"``). The one reader of a dtype's name, so that every command and
    loader takes the same spellings; anything else is refused as ``{refusal}: give one of <accepted, both
    spellings>{suffix}``."""
    if isinstance(value, torch.dtype) and value in accepted:
        return value
    name = value.removeprefix("torch.") if isinstance(value, str) else None
    long_name = {short: long for long, short in SHORT_DTYPE_NAMES.items()}.get(name, name)
    dtype = LOAD_DTYPES.get(long_name) if long_name is not None else None
    if dtype is None or dtype not in accepted:
        raise ConfigurationError(f"{refusal}: give one of {dtype_names(accepted)}{suffix}")
    return dtype


def dtype_name(value: str, refusal: str) -> str:
    """Torch's name (``"bfloat16"``) of the dtype a model loads in that ``value`` names (``"bf16"`` too): read_dtype,
    for an option kept as text (a run's identity, a report)."""
    return str(read_dtype(value, tuple(LOAD_DTYPES.values()), refusal)).removeprefix("torch.")


def load_dtype(dtype: Union[torch.dtype, str, None], what: str) -> Union[torch.dtype, str, None]:
    """``dtype`` as a torch dtype, ``"auto"`` or None, for the loaders' ``dtype=`` (``load_export``,
    ``load_tapered``): a name (``"float32"``, ``"torch.bfloat16"``, ``"bf16"``: read_dtype) is the torch dtype it
    names, so that text and ``torch.float32`` are the same request; anything else, a torch dtype a model cannot load
    in (``torch.int64``, ``torch.complex64``, ``torch.float8_e4m3fn``: transformers' ValueError or a TypeError deep in
    the load) or an unknown name (``getattr(torch, name)``'s AttributeError) included, is refused naming ``dtype``,
    ``what`` loads (``"an export"``) and the accepted ones."""
    if dtype is None or dtype == "auto":
        return dtype
    refusal = f"dtype={dtype!r} is no dtype {what} loads in"
    return read_dtype(
        dtype, tuple(LOAD_DTYPES.values()), refusal, " (as text or a torch dtype: torch.bfloat16), or auto"
    )


def true_or_false(value: object, what: str) -> bool:
    """``value`` as the bool it is or holds (a numpy bool, a one-element bool tensor or array: ``a > b``), refused in
    one line naming ``what`` (``export_folded: overwrite=``) otherwise: ``"no"`` is true, and would replace the export
    it was meant to keep, or publish the repository it was meant to keep private. The refusal names a type by its
    module too: numpy 2 calls its bool ``bool``, and "must be True or False, got bool" would contradict itself."""
    if isinstance(value, bool):
        return value
    dtype, size = getattr(value, "dtype", None), getattr(value, "size", None)
    numel = getattr(value, "numel", None)
    one = numel() == 1 if callable(numel) else size == 1
    boolean = str(dtype) in ("torch.bool", "bool") and not getattr(value, "is_meta", False)
    if one and boolean:  # np.bool_, a bool array or tensor of one element
        return bool(value.item())
    kind = type(value)
    name = kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    raise ConfigurationError(f"{what} must be True or False, got {name}")


def json_object(path: Path) -> dict[str, Any]:
    """The JSON object the file ``path`` holds; {} when it is missing, unreadable, no JSON or no object: for what a
    record may tell (a hint, a type), where a missing or damaged record tells nothing."""
    try:
        values = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    return values if isinstance(values, dict) else {}


def saved_model_type(config_file: Path) -> str:
    """The ``model_type`` a saved ``config.json`` names; "" when the file is missing, unreadable or names none."""
    model_type = json_object(config_file).get("model_type")
    return model_type if isinstance(model_type, str) else ""


#: The weights of a whole saved model (save_tapered's, transformers' safetensors and pickles, whole or in shards),
#: and of a sharded checkpoint (save_sharded_checkpoint's torch.distributed.checkpoint shards): one folder holds one
#: or the other.
WHOLE_WEIGHTS, SHARDED_WEIGHTS = ("model*.safetensors", "pytorch_model*.bin"), ("*.distcp",)
#: The weight files of a saved model (WHOLE_WEIGHTS, SHARDED_WEIGHTS; a PEFT adapter's; GGUF), not a Trainer's
#: training_args.bin or a distillation teacher's snapshot; and those a Trainer checkpoint keeps in its engine's
#: subfolder instead: FSDP's sharded state dict (``pytorch_model_fsdp_0/*.distcp``) and DeepSpeed's
#: (``global_step6/mp_rank_00_model_states.pt``).
WEIGHT_FILES = (
    *WHOLE_WEIGHTS,
    "adapter_model.*",
    "*.gguf",
    *SHARDED_WEIGHTS,
    "pytorch_model_fsdp_*/*.distcp",
    "global_step*/*model_states.pt",
)


def _first_file(folder: Path, patterns: Sequence[str]) -> Optional[Path]:
    """The first file of ``folder`` that one of ``patterns`` matches (in their order), None if none does."""
    return next((found for pattern in patterns for found in folder.glob(pattern)), None)


def refuse_weights_of_another_format(folder: Path, sharded: bool, what: str) -> None:
    """Refuse (ConfigurationError starting with ``what``, the save and what it writes) a ``folder`` holding weights
    of the other format than the save about to write (``sharded``: shards; else a whole model). The save would leave
    them beside its own: one folder holding two checkpoints, whose stale one a reader of its format takes for the new
    one (a whole model's config.json and a sharded checkpoint's are both the base model's, so nothing else tells)."""
    stale = _first_file(folder, WHOLE_WEIGHTS if sharded else SHARDED_WEIGHTS)
    if stale is not None:
        held, own = ("a whole model's weights", "shards") if sharded else ("a sharded checkpoint", "whole model")
        raise ConfigurationError(
            f"{what} into {folder}: it holds {held} ({stale.name}), which would stay beside the {own}: one folder "
            "would hold two checkpoints; choose a new folder"
        )


def holds_model_weights(folder: Path) -> bool:
    """Whether ``folder`` holds a saved model's weights (WEIGHT_FILES), which a recipe written beside them would
    describe: the saves' guard (config.check_save_destination) refuses to mark them with another recipe."""
    return _first_file(folder, WEIGHT_FILES) is not None


__all__ = [
    "json_object",
    "true_or_false",
    "SEED_LIMIT",
    "check_compile_options",
    "compile_backends",
    "check_seeds",
    "expand_user",
    "BARE_TILDE_OPTIONS",
    "expand_user_options",
    "dangling_link",
    "some_names",
    "file_in_the_way",
    "holds_model_weights",
    "refuse_weights_of_another_format",
    "dtype_name",
    "dtype_names",
    "load_dtype",
    "read_dtype",
    "saved_model_type",
    "all_reduce_max",
    "all_reduce_sum",
    "base_model_prefix",
    "in_backward_recompute",
    "is_distributed",
    "parameter_count",
    "replace_submodule",
]


def accelerator_available() -> bool:
    """Whether torch sees an accelerator (CUDA, XPU, MPS, ...) that the Trainer would train on."""
    if torch.cuda.is_available():
        return True
    current = getattr(torch, "accelerator", None)
    return current is not None and current.current_accelerator() is not None


#: x86 instruction sets with which oneDNN runs bf16 matrix products faster than fp32 ones (/proc/cpuinfo's names).
FAST_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> Optional[frozenset[str]]:
    """The instruction-set flags an x86 Linux kernel lists for this CPU; None where there is no such list (another
    operating system or architecture)."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return None


@functools.cache
def cpu_has_fast_bf16() -> bool:
    """Whether bf16 matrix products on this CPU are at least as fast as fp32 ones.

    CPUs with AVX-512 BF16 or AMX run bf16 autocast faster than fp32; on others (AVX2 only) oneDNN converts every
    operand and a bf16 training step can be many times slower. Where the kernel lists the CPU's instruction sets
    (x86 Linux) they decide, so the answer, and with it ``taper``'s default precision, is the same on every run
    however loaded the machine is. Elsewhere one small product of each kind is timed (a few milliseconds).
    """
    flags = cpu_flags()
    if flags is not None:
        return bool(flags & FAST_BF16_FLAGS)
    return _bf16_products_timed_faster()


def _bf16_products_timed_faster() -> bool:
    a, b = torch.randn(512, 512), torch.randn(512, 512)  # small products take other kernels: too small says nothing

    def timed(x: torch.Tensor, y: torch.Tensor) -> float:
        start = time.perf_counter()
        torch.mm(x, y)
        return time.perf_counter() - start

    x, y = a.bfloat16(), b.bfloat16()
    timed(a, b), timed(x, y)  # warm-up: kernels are chosen on the first call
    fp32 = bf16 = float("inf")
    for _ in range(5):  # interleaved, the fastest of each: a burst of load hits both alike
        fp32, bf16 = min(fp32, timed(a, b)), min(bf16, timed(x, y))
        if bf16 > 3 * fp32:  # far slower: no need to look again
            break
    return bf16 <= fp32
