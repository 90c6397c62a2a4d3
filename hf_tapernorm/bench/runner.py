"""Inference and training-step benchmark: what removing the norms buys, measured side by side.

Variants of ONE set of weights, compared in one run:

- ``original``: the unpatched model;
- ``explicit``: patched (Internal-Taper) at g = 0, the per-channel scalings as explicit operations;
- ``folded``: the exported norm-free model (``fold_model``), saved and reloaded through
  ``AutoModelForCausalLM``;
- ``limit``: the original weights with the internal norms replaced by ``nn.Identity``: the ceiling;
- ``all-explicit`` / ``all-folded`` / ``all-limit``: the same with the final norm tapered too (All-Taper).

The patched variants are calibrated on random tokens without training, so their outputs are not
meaningful: only their speed and operation counts are. Timing one model after another on a shared
machine gives false ratios (1.2x where there is 1.03x), so every repeat runs each variant once in a
rotating order and the reported speedup is the median of the per-repeat ratios. The number of aten
operations per forward (per decoding step) is counted with ``torch.profiler``: it does not depend on
machine load, and on a GPU at small batch every operation is a kernel launch.

Modes: ``last`` (logits of the last position only, no cache), ``full`` (all logits, no cache),
``decode`` (KV-cached greedy decoding after an untimed prefill), ``train`` (one optimizer step of
the unpatched model vs the patched one during the taper, 0 < g < 1, and after it, g = 0).
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import logging
import os
import platform
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, DynamicCache, StaticCache

from ..architectures.recipe_rules import norms_feeding_gated_mlps
from ..architectures.sites import architecture_of, model_type_of, norm_sites
from ..config import TaperNormConfig
from ..export.folding import fold_model
from ..layers.patching import kept_norm_names, patch_model, set_gate
from ..pipeline.models import load_model, resolve_model
from ..training.calibration import calibrate, update_statistics
from ..utils import replace_submodule

logger = logging.getLogger(__name__)

INFERENCE_VARIANTS = (
    "original", "explicit", "folded", "limit", "all-explicit", "all-folded", "all-limit",
    "attn-explicit", "attn-folded", "attn-limit",
)
# Variant name prefixes: "" = Internal-Taper, "all-" = every norm, "attn-" = Internal-Taper keeping the norms
# that feed gated MLPs (``--keep_norms auto``, the default of hf-tapernorm taper).
_PREFIXES = ("all-", "attn-", "")
TRAIN_VARIANTS = ("original", "taper", "tapered")
MODES = ("last", "full", "decode", "train")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
QUALITY_NOTE = (
    "explicit/folded variants are calibrated on random tokens without training: their outputs are not "
    "meaningful (a real model may even overflow at g = 0 untrained), their speed and operation counts are"
)
# Taper-phase gates cycled through by the ``train`` mode (a real schedule changes g every step).
_TAPER_GATES = (0.9, 0.7, 0.5, 0.3, 0.1)


@dataclass(frozen=True)
class Case:
    """One point of the benchmark grid."""

    mode: str
    batch: int
    seq_len: int
    new_tokens: int
    dtype: str
    device: str
    threads: int
    compiled: bool

    def label(self) -> str:
        shape = f"b{self.batch} T{self.seq_len}" + (f"+{self.new_tokens}" if self.mode == "decode" else "")
        run = "compiled" if self.compiled else "eager"
        return f"{self.mode} {shape} {self.dtype} {self.device} {self.threads}t {run}"


# ---------------------------------------------------------------------------------------- variants
def _random_ids(vocab: int, batch: int, length: int, seed: int, device: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=generator).to(device)


def calibrated_copy(
    model: nn.Module, scope: str, batches: Sequence[torch.Tensor], keep_norms: Sequence[str] = ()
) -> nn.Module:
    """A patched copy at g = 0, calibrated from training-mode forwards on ``batches`` (no training)."""
    patched = patch_model(copy.deepcopy(model), TaperNormConfig.paper(scope=scope, keep_norms=list(keep_norms)))
    patched.train()
    with torch.no_grad():
        for ids in batches:
            patched(input_ids=ids, use_cache=False)
    calibrate(patched)
    set_gate(patched, 0.0)
    return patched.eval()


def limit_copy(model: nn.Module, scope: str, keep_norms: Sequence[str] = ()) -> nn.Module:
    """A copy with the norms ``scope`` would taper replaced by ``nn.Identity``: same weights, no norm ops."""
    limit = copy.deepcopy(model)
    sites = norm_sites(limit, architecture_of(limit))  # the table entry, else discovery: patch_model's sites
    kept = set(kept_norm_names(limit, keep_norms, sites))  # the same patterns, matched as patch_model matches them
    for site in sites:
        if (site.is_final and scope == "internal") or site.path in kept:
            continue
        replace_submodule(limit, site.path, nn.Identity())
    return limit.eval()


@torch.no_grad()
def _finite_logits(model: nn.Module) -> bool:
    vocab = model.config.get_text_config().vocab_size
    ids = _random_ids(vocab, 1, 16, 0, str(next(model.parameters()).device))
    return bool(torch.isfinite(model(input_ids=ids, use_cache=False).logits).all())


def folded_reload(explicit: nn.Module, folder: Path, dtype: torch.dtype, device: str) -> nn.Module:
    """Fold a g = 0 model, save it, and reload it from disk through ``AutoModelForCausalLM``."""
    check = _finite_logits(explicit)
    if not check:
        logger.warning(
            "%s at g = 0 gives non-finite logits without training (expected: the taper needs training); "
            "folding without the numerical check: speed and operation counts are unaffected",
            type(explicit).__name__,
        )
    fold_model(explicit, check=check).save_pretrained(folder)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()


def build_variants(
    model: nn.Module, names: Sequence[str], *, calibration_batches: Sequence[torch.Tensor], workdir: Path
) -> dict[str, nn.Module]:
    """Every requested inference variant of ``model`` (which is left unchanged), in ``names`` order."""
    dtype, device = next(model.parameters()).dtype, str(next(model.parameters()).device)
    explicit: dict[str, nn.Module] = {}
    built: dict[str, nn.Module] = {}
    for name in names:
        prefix = next(p for p in _PREFIXES if name.startswith(p))
        scope, kind = ("all" if prefix == "all-" else "internal"), name.removeprefix(prefix)
        keep = norms_feeding_gated_mlps(model) if prefix == "attn-" else []
        if kind == "original":
            built[name] = model
        elif kind == "limit":
            built[name] = limit_copy(model, scope, keep)
        elif kind in ("explicit", "folded"):
            if prefix not in explicit:
                explicit[prefix] = calibrated_copy(model, scope, calibration_batches, keep)
            if kind == "explicit":
                built[name] = explicit[prefix]
            else:
                built[name] = folded_reload(explicit[prefix], workdir / name, dtype, device)
        else:
            raise ValueError(f"unknown variant {name!r}; choose from {', '.join(INFERENCE_VARIANTS)}")
    return built


# ---------------------------------------------------------------------------------------- workloads
class Workload:
    """``prepare()`` builds the untimed state (e.g. the prefilled cache), ``run(state)`` is timed.

    ``steps`` is the number of model forwards in one ``run``: operation counts are per forward.
    """

    steps = 1

    def prepare(self) -> Any:
        return None

    def run(self, state: Any) -> torch.Tensor:
        raise NotImplementedError


class _Logits(Workload):
    def __init__(self, model: Callable, ids: torch.Tensor, last_only: bool) -> None:
        self.model, self.ids, self.keep = model, ids, 1 if last_only else 0

    @torch.no_grad()
    def run(self, state: Any) -> torch.Tensor:
        return self.model(input_ids=self.ids, use_cache=False, logits_to_keep=self.keep).logits


class _Decode(Workload):
    """Greedy decoding with a KV cache: a dynamic cache in eager mode, a static one when compiled."""

    def __init__(self, model: nn.Module, call: Callable, ids: torch.Tensor, new_tokens: int, static: bool) -> None:
        self.model, self.call, self.ids, self.steps, self.static = model, call, ids, new_tokens, static
        length = ids.shape[1]
        self.positions = [torch.tensor([[length + i]], device=ids.device) for i in range(new_tokens)]

    @torch.no_grad()
    def prepare(self) -> tuple[Any, torch.Tensor]:
        config = self.model.config
        if self.static:
            cache = StaticCache(config=config, max_cache_len=self.ids.shape[1] + self.steps)
        else:
            cache = DynamicCache(config=config)
        out = self.call(input_ids=self.ids, cache=cache, use_cache=True, logits_to_keep=1)
        return cache, out.logits[:, -1:].argmax(-1)

    @torch.no_grad()
    def run(self, state: tuple[Any, torch.Tensor]) -> torch.Tensor:
        cache, token = state
        tokens = []
        for position in self.positions:
            out = self.call(input_ids=token, position_ids=position, cache=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            tokens.append(token)
        return torch.cat(tokens, 1)


class _TrainStep(Workload):
    """forward + backward + AdamW step; ``gates`` (cycled) are set before each step when given."""

    def __init__(self, model: nn.Module, call: Callable, ids: torch.Tensor, gates: Optional[Sequence[float]]) -> None:
        self.model, self.call, self.ids = model, call, ids
        self.gates = itertools.cycle(gates) if gates is not None else None
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)

    def run(self, state: Any) -> torch.Tensor:
        if self.gates is not None:
            set_gate(self.model, next(self.gates))
        loss = self.call(input_ids=self.ids, labels=self.ids, use_cache=False).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.gates is not None:
            update_statistics(self.model)  # what the controller does once per optimizer step
        return loss.detach()


def _compiled(model: nn.Module, options: Optional[dict[str, Any]]) -> Callable:
    """``torch.compile(model, **options)``, or the model itself (eager) when ``options`` is None."""
    return model if options is None else torch.compile(model, **options)


def inference_workload(
    model: nn.Module, case: Case, ids: torch.Tensor, compile_options: Optional[dict[str, Any]]
) -> Workload:
    call = _compiled(model, compile_options)
    if case.mode == "decode":
        return _Decode(model, call, ids, case.new_tokens, static=case.compiled)
    return _Logits(call, ids, last_only=case.mode == "last")


def train_workloads(
    model: nn.Module,
    ids: torch.Tensor,
    calibration_batches: Sequence[torch.Tensor],
    compile_options: Optional[dict[str, Any]] = None,
) -> dict[str, Workload]:
    """The unpatched model and one patched copy (same weights, its own optimizer) at taper / g = 0."""
    original = copy.deepcopy(model).train()
    patched = calibrated_copy(model, "internal", calibration_batches).train()
    call_o, call_p = _compiled(original, compile_options), _compiled(patched, compile_options)
    return {
        "original": _TrainStep(original, call_o, ids, None),
        "taper": _TrainStep(patched, call_p, ids, _TAPER_GATES),
        "tapered": _TrainStep(patched, call_p, ids, (0.0,)),
    }


# ---------------------------------------------------------------------------------------- measuring
def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def interleaved_times(
    workloads: dict[str, Workload], *, warmup: int, repeats: int, device: str, progress: bool = True
) -> dict[str, list[float]]:
    """Seconds per ``run``: each repeat runs every variant once, the order rotating between repeats."""
    names = list(workloads)
    for _ in range(warmup):
        for name in names:
            workloads[name].run(workloads[name].prepare())
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in tqdm(range(repeats), desc="repeats", leave=False, disable=not progress):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            state = workloads[name].prepare()
            _sync(device)
            start = time.perf_counter()
            workloads[name].run(state)
            _sync(device)
            times[name].append(time.perf_counter() - start)
    return times


def median_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> float:
    """Median over repeats of numerator[r] / denominator[r] (pairs measured next to each other)."""
    return statistics.median(a / b for a, b in zip(numerator, denominator))


def count_ops(workload: Workload) -> dict[str, float]:
    """aten operations per forward, all (nested included) and top level (called from Python)."""
    from torch.profiler import ProfilerActivity, profile

    state = workload.prepare()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        workload.run(state)
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    top = [e for e in events if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    return {"aten_ops": len(events) / workload.steps, "top_level_ops": len(top) / workload.steps}


@torch.no_grad()
def agreement(variants: dict[str, nn.Module], ids: torch.Tensor) -> dict[str, dict[str, float]]:
    """Last-position logits of each folded variant against its explicit (unfolded g = 0) source.

    Differences are taken over the entries finite in both (an untrained g = 0 model may overflow);
    ``same_nonfinite`` says whether both overflow at exactly the same entries.
    """
    result = {}
    for prefix in _PREFIXES:
        if f"{prefix}folded" in variants and f"{prefix}explicit" in variants:
            a = variants[f"{prefix}folded"](input_ids=ids, use_cache=False, logits_to_keep=1).logits.float()
            b = variants[f"{prefix}explicit"](input_ids=ids, use_cache=False, logits_to_keep=1).logits.float()
            finite = torch.isfinite(a) & torch.isfinite(b)
            diff = (a - b)[finite].abs().max().item() if finite.any() else float("nan")
            scale = b[finite].abs().max().item() if finite.any() else float("nan")
            result[f"{prefix}folded_vs_{prefix}explicit"] = {
                "max_abs": diff,
                "max_rel": diff / max(scale, 1e-30),
                "finite_fraction": finite.float().mean().item(),
                "same_nonfinite": torch.equal(torch.isfinite(a), torch.isfinite(b)),
            }
    return result


def summarize(case: Case, times: dict[str, list[float]], ops: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Median times, median pair ratios against ``original`` (speedup) and ``limit``, op counts."""
    steps = case.new_tokens if case.mode == "decode" else 1
    variants = {}
    for name, series in times.items():
        entry: dict[str, Any] = {"median_ms": 1e3 * statistics.median(series), **ops.get(name, {})}
        if case.mode == "decode":
            entry["median_ms_per_token"] = entry["median_ms"] / steps
        if "original" in times:
            entry["speedup_vs_original"] = median_ratio(times["original"], series)
        limit = "all-limit" if name.startswith("all-") else "limit"
        if limit in times and name != limit:
            entry["speed_vs_limit"] = median_ratio(times[limit], series)
        variants[name] = entry
    return {"case": asdict(case), "label": case.label(), "variants": variants, "times_s": times}


# ---------------------------------------------------------------------------------------- output
def format_table(results: Sequence[dict[str, Any]]) -> str:
    header = f"{'case':<44} {'variant':<13} {'median ms':>10} {'vs original':>12} {'vs limit':>9} {'aten ops':>9}"
    lines = [header, "-" * len(header)]
    for result in results:
        for name, entry in result["variants"].items():
            speed = entry.get("speedup_vs_original")
            vs_limit = entry.get("speed_vs_limit")
            lines.append(
                f"{result['label']:<44} {name:<13} {entry['median_ms']:>10.2f} "
                f"{(f'{speed:.3f}x' if speed is not None else '-'):>12} "
                f"{(f'{vs_limit:.3f}x' if vs_limit is not None else '-'):>9} "
                f"{entry.get('aten_ops', float('nan')):>9.0f}"
            )
    return "\n".join(lines)


def plot(results: Sequence[dict[str, Any]], path: Path) -> None:
    """Speedup over the original (median pair ratio) and aten ops per forward, per case and variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(n for r in results for n in r["variants"]))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(6, 2.2 * len(results)), 7), sharex=True)
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        xs = [k + i * width for k, r in enumerate(results) if name in r["variants"]]
        chosen = [r["variants"][name] for r in results if name in r["variants"]]
        top.bar(xs, [v.get("speedup_vs_original", float("nan")) for v in chosen], width, label=name)
        bottom.bar(xs, [v.get("aten_ops", float("nan")) for v in chosen], width, label=name)
    top.axhline(1.0, color="black", linewidth=0.8)
    top.set_ylabel("speedup vs original\n(median of pair ratios)")
    bottom.set_ylabel("aten ops per forward")
    bottom.set_xticks([k + 0.4 - width / 2 for k in range(len(results))])
    bottom.set_xticklabels([r["label"].replace(" ", "\n", 2) for r in results], fontsize=7)
    top.legend(fontsize=7, ncol=min(4, len(names)))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def environment() -> dict[str, Any]:
    import transformers

    env = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "loadavg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        with open("/proc/cpuinfo") as f:
            env["cpu"] = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        env["cpu"] = platform.processor() or None
    return env


# ---------------------------------------------------------------------------------------- driver
def _dynamo_counts() -> dict[str, int]:
    """Graphs compiled and graph breaks met since the case started (every variant together)."""
    counters = torch._dynamo.utils.counters
    return {"unique_graphs": int(counters["stats"]["unique_graphs"]), "graph_breaks": sum(counters["graph_break"].values())}


def run_benchmark(load: Callable[[torch.dtype], nn.Module], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run every case of the grid in ``args``; variants are built once per dtype and device.

    ``load(dtype)`` returns the model loaded in that dtype (as ``from_pretrained(dtype=...)`` does:
    casting a loaded model instead would also cast buffers such as RoPE's ``inv_freq`` that loading
    keeps in fp32, and the limit would then differ from the reloaded folded model by those casts).
    """
    results: list[dict[str, Any]] = []
    previous_threads = torch.get_num_threads()
    try:
        for dtype_name in args.dtypes:
            model = load(DTYPES[dtype_name]).eval()
            for device in args.devices:
                results += _run_group(model.to(device), dtype_name, device, args)
    finally:
        torch.set_num_threads(previous_threads)
    return results


def _run_group(base: nn.Module, dtype_name: str, device: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every case of one dtype and device, on variants built once from ``base``."""
    vocab = base.config.get_text_config().vocab_size
    compile_options = {k: v for k, v in (("backend", args.compile_backend), ("mode", args.compile_mode)) if v}
    calib = [_random_ids(vocab, 2, 64, args.seed + i, device) for i in range(args.calibration_batches)]
    results = []
    with tempfile.TemporaryDirectory(prefix="hf_tapernorm_bench_") as workdir:
        variants = {}
        if any(mode != "train" for mode in args.modes):
            variants = build_variants(base, args.variants, calibration_batches=calib, workdir=Path(workdir))
        finite = {name: _finite_logits(variant) for name, variant in variants.items()}
        for threads, compiled, mode, batch, seq_len in itertools.product(
            args.threads, args.compile, args.modes, args.batch_sizes, args.seq_lens
        ):
            torch.set_num_threads(threads)
            case = Case(mode, batch, seq_len, args.new_tokens, dtype_name, device, threads, compiled)
            logger.info("benchmark case: %s", case.label())
            if compiled:
                torch._dynamo.reset()
                torch._dynamo.utils.counters.clear()
            ids = _random_ids(vocab, batch, seq_len, args.seed, device)
            options = compile_options if compiled else None
            if mode == "train":
                workloads = train_workloads(base, ids, calib, options)
            else:
                workloads = {name: inference_workload(m, case, ids, options) for name, m in variants.items()}
            times = interleaved_times(workloads, warmup=args.warmup, repeats=args.repeats, device=device)
            ops = {name: count_ops(w) for name, w in workloads.items()} if args.count_ops else {}
            result = summarize(case, times, ops)
            if compiled:
                result["dynamo"] = _dynamo_counts()
            if mode != "train":
                result["agreement"] = agreement(variants, ids)
                result["finite_logits"] = finite
            results.append(result)
    return results


def build_parser() -> argparse.ArgumentParser:
    """Arguments of the benchmark (also used by ``hf-tapernorm bench``)."""
    parser = argparse.ArgumentParser(prog="hf-tapernorm bench", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model_name_or_path", default=None, help="Hub id, local folder or .gguf file (default: embedded SmolLM2-135M)"
    )
    parser.add_argument("--gguf_file", default=None, help="GGUF file name inside --model_name_or_path")
    parser.add_argument(
        "--variants", nargs="+", default=["original", "explicit", "folded", "limit"], choices=INFERENCE_VARIANTS,
        metavar="VARIANT", help=f"inference variants, from: {', '.join(INFERENCE_VARIANTS)} (all-*: All-Taper)",
    )
    parser.add_argument(
        "--modes", nargs="+", default=["last", "decode"], choices=MODES, metavar="MODE",
        help="last (last-position logits, no cache), full (all logits), decode (KV-cached greedy decoding), "
        "train (optimizer step: unpatched vs taper phase vs g = 0)",
    )
    parser.add_argument("--batch_sizes", nargs="+", type=int, default=[1])
    parser.add_argument("--seq_lens", nargs="+", type=int, default=[128], help="sequence (decode: prompt) length")
    parser.add_argument("--new_tokens", type=int, default=32, help="decoded tokens per decode run")
    parser.add_argument("--dtypes", nargs="+", default=["fp32"], choices=sorted(DTYPES))
    parser.add_argument("--devices", nargs="+", default=["cpu"])
    parser.add_argument("--threads", nargs="+", type=int, default=[min(2, os.cpu_count() or 1)])
    parser.add_argument("--execution", nargs="+", default=["eager"], choices=["eager", "compile"])
    parser.add_argument("--compile_backend", default=None, help="torch.compile backend (default: inductor)")
    parser.add_argument(
        "--compile_mode", default=None, help="torch.compile mode, e.g. reduce-overhead (CUDA graphs on GPU)"
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs of every variant before timing")
    parser.add_argument("--repeats", type=int, default=10, help="timed rounds (each runs every variant once)")
    parser.add_argument("--calibration_batches", type=int, default=4, help="random-token batches used to calibrate c")
    parser.add_argument("--no_op_counts", dest="count_ops", action="store_false", help="skip the profiler op counts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output_dir", default="runs/bench", help="where bench.json and bench.png are written")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the benchmark, print the table, write ``bench.json`` and ``bench.png`` (exit status 0)."""
    args = build_parser().parse_args(argv)
    args.compile = [value == "compile" for value in args.execution]
    for device in args.devices:
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise SystemExit(f"hf-tapernorm bench: device {device!r} requested but CUDA is not available here")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    source = resolve_model(args.model_name_or_path, args.gguf_file)
    model_types = set()

    def load(dtype: torch.dtype) -> nn.Module:
        model = load_model(source, dtype=str(dtype).removeprefix("torch."))
        model_types.add(model_type_of(model))
        return model

    started = time.time()
    results = run_benchmark(load, args)
    report = {
        "model": source.describe(),
        "model_type": model_types.pop(),
        "argv": list(argv) if argv is not None else None,
        "settings": {k: v for k, v in vars(args).items() if k != "compile"},
        "environment": environment(),
        "note": QUALITY_NOTE,
        "seconds": time.time() - started,
        "results": results,
    }
    output = Path(args.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    (output / "bench.json").write_text(json.dumps(report, indent=2))
    plot(results, output / "bench.png")
    print(format_table(results))
    print(f"note: {QUALITY_NOTE}")
    print(f"wrote {output / 'bench.json'} and {output / 'bench.png'}")
    return 0


__all__ = [
    "Case",
    "INFERENCE_VARIANTS",
    "build_parser",
    "build_variants",
    "count_ops",
    "interleaved_times",
    "main",
    "median_ratio",
    "run_benchmark",
]


if __name__ == "__main__":
    raise SystemExit(main())
