"""``hf-tapernorm bench``: load the model once per dtype, time every case of the grid, write and print the results.

The pieces, one job each: arguments.py (the options and the grid of cases), variants.py (the inference
variants of one set of weights), workloads.py and train_workloads.py (what is timed), measure.py
(interleaved timing, op counts, summaries) and report.py (tables, figure, environment); with
``--runtimes onnxruntime``, hf_tapernorm.integrations.onnx_runtime exports the original and folded
variants to ONNX and runs them. This module only wires them together, so a reader sees the whole run in
``run_benchmark`` and ``main``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from ..app.full_disk import full_disk_refused
from ..app.run_lock import RunLock
from ..app.run_tokenizer import tokenizer_of
from ..app.validation import weightless_model
from ..architectures.sites import model_type_of, norm_sites
from ..config import TaperNormConfig
from ..data.sources import EMBEDDED_CORPUS, AnyDataset, load_text_dataset
from ..errors import ConfigurationError
from ..evaluation.models import ModelSource, load_model, model_config, resolve_model
from ..utils import cpu_has_fast_bf16
from .arguments import DTYPES, BenchArguments, Case, cases, parse_arguments
from .measure import interleaved_times, median_ratio, op_counts, summarize
from .report import environment, format_table, plot
from .train_workloads import fp32_counterpart, text_batches, train_workloads
from .variants import (
    QUALITY_NOTE,
    agreement,
    build_variants,
    finite_logits,
    limit_labels,
    removal_config,
    removed_norms,
    variant_specs,
)
from .workloads import inference_workload, onnx_workload

logger = logging.getLogger(__name__)

Result = dict[str, Any]


@dataclass
class TrainText:
    """Where the train mode's batches come from: the model's own tokenizer and a corpus."""

    tokenizer: Any
    dataset: AnyDataset
    name: str
    text_column: Optional[str] = None


def _random_ids(vocab: int, case: Case, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (case.batch, case.seq_len), generator=generator).to(case.device)


def _dynamo_counts() -> dict[str, int]:
    """Graphs compiled and graph breaks met since the case started (every variant together)."""
    counters = torch._dynamo.utils.counters
    breaks = sum(counters["graph_break"].values())
    return {"unique_graphs": int(counters["stats"]["unique_graphs"]), "graph_breaks": breaks}


ORT_PREFIX = "ort-"  # the name of a variant run in ONNX Runtime: ort-original, ort-folded, ...


def warmup_runs(case: Case, arguments: BenchArguments) -> int:
    """The untimed runs of every workload before its timing: ``--warmup``, and at least one in a compiled case, whose
    first call compiles: timed, it would measure the compilation (and a ratio of two compilations), not the run."""
    return max(arguments.warmup, 1) if case.compiled else arguments.warmup


def _time(workloads: dict, case: Case, arguments: BenchArguments) -> tuple[dict, dict]:
    warmup = warmup_runs(case, arguments)
    times = interleaved_times(workloads, warmup=warmup, repeats=arguments.repeats, device=case.device)
    counted = {name: w for name, w in workloads.items() if not name.startswith(ORT_PREFIX)}  # aten: torch's only
    ops = {name: op_counts(w) for name, w in counted.items()} if arguments.op_counts else {}
    return times, ops


def _onnx_graphs(variants: dict[str, nn.Module], specs: list, workdir: Path) -> dict[str, tuple[Path, dict]]:
    """The original and folded variants exported to ONNX: ``{label: (folder, node counts)}``."""
    from ..integrations.onnx_runtime import export_onnx, node_counts

    graphs = {}
    for spec in specs:
        if spec.kind in ("original", "folded"):
            logger.info("exporting %s to ONNX", spec.label)
            folder = export_onnx(variants[spec.label], workdir / f"onnx-{spec.label}")
            graphs[spec.label] = (folder, node_counts(folder))
    return graphs


def _add_onnx_runtime(
    case: Case, graphs: dict[str, tuple[Path, dict]], variants: dict[str, nn.Module], ids: torch.Tensor
) -> tuple[dict, dict]:
    """ONNX Runtime workloads of the exported variants, and each one's logits against torch's on ``ids``."""
    from ..integrations.onnx_runtime import OnnxCausalLM

    workloads, agreement_ = {}, {}
    for label, (folder, _) in graphs.items():
        runtime = OnnxCausalLM(folder, threads=case.threads)
        workloads[ORT_PREFIX + label] = onnx_workload(runtime, case, ids)
        with torch.no_grad():
            expected = variants[label](input_ids=ids, use_cache=False).logits.float().cpu()
        difference = (torch.from_numpy(runtime.forward(ids.cpu().numpy())[0]) - expected).abs()
        agreement_[f"{ORT_PREFIX}{label}_vs_{label}"] = {"max_abs": difference.max().item()}
    return workloads, agreement_


def _inference_case(
    case: Case,
    variants: dict[str, nn.Module],
    specs: list,
    arguments: BenchArguments,
    graphs: Optional[dict[str, tuple[Path, dict]]] = None,
) -> Result:
    vocab = next(iter(variants.values())).config.get_text_config().vocab_size
    ids = _random_ids(vocab, case, arguments.seed)
    options = arguments.compile_options if case.compiled else None
    workloads = {label: inference_workload(model, case, ids, options) for label, model in variants.items()}
    runtime_agreement = {}
    if graphs and not case.compiled:
        runtime_workloads, runtime_agreement = _add_onnx_runtime(case, graphs, variants, ids)
        workloads.update(runtime_workloads)
    times, ops = _time(workloads, case, arguments)
    result = summarize(case, times, ops, baseline="original", limits=limit_labels(specs), peer="flashnorm")
    result["agreement"] = {**agreement(variants, specs, ids), **runtime_agreement}
    baseline = ORT_PREFIX + "original"
    for label, (_, counts) in (graphs or {}).items():
        entry = result["variants"].get(ORT_PREFIX + label)
        if entry is not None:
            entry.update(counts, runtime="onnxruntime")
            if baseline in times:
                entry[f"speedup_vs_{baseline}"] = median_ratio(times[baseline], times[ORT_PREFIX + label])
    return result


def _train_case(case: Case, base: nn.Module, text: TrainText, arguments: BenchArguments) -> Result:
    recipe = TaperNormConfig.for_model(base, text.tokenizer)
    batches = text_batches(
        text.dataset,
        text.tokenizer,
        batch=case.batch,
        seq_len=case.seq_len,
        count=1 + arguments.calibration_batches,
        prefix_ids=recipe.sink_token_ids,
        source=text.name,
        text_column=text.text_column,
    )
    batches = [{key: value.to(case.device) for key, value in batch.items()} for batch in batches]
    options = arguments.compile_options if case.compiled else None
    workloads = train_workloads(
        base,
        batches,
        recipe,
        learning_rate=arguments.learning_rate,
        names=arguments.train_workloads,
        compile_options=options,
        precisions=arguments.train_precisions,
    )
    times, ops = _time(workloads, case, arguments)
    result = summarize(case, times, ops, baseline="normalized")
    for name, workload in workloads.items():
        result["variants"][name].update(workload.facts())
        fp32 = fp32_counterpart(name)
        if fp32 in times:  # above 1: the autocast step is faster than the same workload's fp32 step
            result["variants"][name]["speedup_vs_fp32"] = median_ratio(times[fp32], times[name])
    result["recipe"] = recipe.to_dict()
    if "bf16" in arguments.train_precisions and case.device == "cpu":
        result["cpu_has_fast_bf16"] = cpu_has_fast_bf16()
    return result


def _inference_variants(base: nn.Module, arguments: BenchArguments, workdir: Path) -> tuple[list, dict, dict]:
    """The variant specs and models, and what the results record about them: how many norms each
    ``--norms`` value removes and keeps, and which variants give finite logits untrained."""
    specs = variant_specs(arguments.variants, arguments.norms)
    device = next(base.parameters()).device
    vocab = base.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(arguments.seed)
    calibration = [
        torch.randint(0, vocab, (2, 64), generator=generator).to(device) for _ in range(arguments.calibration_batches)
    ]
    variants = build_variants(base, specs, calibration_batches=calibration, workdir=workdir)
    facts: dict[str, Any] = {"norms": {}, "finite_logits": {name: finite_logits(m) for name, m in variants.items()}}
    for choice in arguments.norms:
        removed = len(removed_norms(base, removal_config(base, choice)))
        facts["norms"][choice] = {"removed": removed, "kept": len(norm_sites(base)) - removed}
    return specs, variants, facts


def _run_group(
    base: nn.Module, dtype: str, device: str, arguments: BenchArguments, text: Optional[TrainText]
) -> list[Result]:
    """Every case of one dtype and device; the inference variants are built once, from ``base``."""
    results = []
    with tempfile.TemporaryDirectory(prefix="hf_tapernorm_bench_") as workdir, _temporary_disk(Path(workdir).parent):
        graphs = None
        if any(mode != "train" for mode in arguments.modes):
            specs, variants, facts = _inference_variants(base, arguments, Path(workdir))
            if "onnxruntime" in arguments.runtimes:
                graphs = _onnx_graphs(variants, specs, Path(workdir))
        for case in cases(arguments, dtype, device):
            torch.set_num_threads(case.threads)
            logger.info("benchmark case: %s", case.label())
            if case.compiled:
                torch._dynamo.reset()
                torch._dynamo.utils.counters.clear()
            if case.mode == "train":
                result = _train_case(case, base, text, arguments)
            else:
                result = {**_inference_case(case, variants, specs, arguments, graphs), **facts}
            if case.compiled:
                result["dynamo"] = _dynamo_counts()
            results.append(result)
    return results


def _temporary_disk(folder: Path) -> contextlib.AbstractContextManager[None]:
    """A disk that fills up while the variants are saved and reloaded (or their ONNX graphs written) in a folder of
    the system's temporary ``folder``, as one line naming it (the folder of the variants is gone by then) and saying
    where to point it instead."""
    return full_disk_refused(
        folder,
        "the benchmark's saved models",
        lambda: "free space there (or lift the file-size limit), or set TMPDIR to a folder on another disk",
        named="the temporary folder",
    )


def run_benchmark(
    load: Callable[[torch.dtype], nn.Module], arguments: BenchArguments, text: Optional[TrainText] = None
) -> list[Result]:
    """Run every case of the grid; ``text`` feeds the train mode.

    ``load(dtype)`` returns the model loaded in that dtype (as ``from_pretrained(dtype=...)`` does:
    casting a loaded model instead would also cast buffers such as RoPE's ``inv_freq`` that loading
    keeps in fp32, and the limit would then differ from the reloaded folded model by those casts).
    """
    if "train" in arguments.modes and text is None:
        raise ConfigurationError("--modes train needs text: a tokenizer and a corpus (TrainText)")
    results: list[Result] = []
    previous_threads = torch.get_num_threads()
    try:
        for dtype in arguments.dtypes:
            model = load(DTYPES[dtype]).eval()
            for device in arguments.devices:
                results += _run_group(model.to(device), dtype, device, arguments, text)
    finally:
        torch.set_num_threads(previous_threads)
    return results


def _train_text(arguments: BenchArguments, source: ModelSource) -> TrainText:
    """The train mode's text: the model's tokenizer (a Trainer checkpoint-N's is its run's, as eval and fold find
    it) and the corpus."""
    tokenizer = tokenizer_of(source)
    name = f"--dataset_name '{arguments.dataset_name}'" if arguments.dataset_name is not None else None
    dataset = load_text_dataset(
        arguments.dataset_name, config_name=arguments.dataset_config_name, split_option=None, name=name
    )
    return TrainText(tokenizer, dataset, arguments.dataset_name or EMBEDDED_CORPUS, arguments.text_column)


def _check_train_text(arguments: BenchArguments, source: ModelSource, text: TrainText) -> None:
    """Refuse (DataError, one line) a text that cannot fill the train mode's batches of every --seq_lens, before the
    model loads: packed as _train_case packs it, behind the recipe's sink prefix, read from the model's structure
    alone (its config on the meta device)."""
    recipe = TaperNormConfig.for_model(weightless_model(source, trust_remote_code=False), text.tokenizer)
    for seq_len in arguments.seq_lens:  # the largest batch of each length: a smaller one takes its first blocks
        text_batches(
            text.dataset,
            text.tokenizer,
            batch=max(arguments.batch_sizes),
            seq_len=seq_len,
            count=1 + arguments.calibration_batches,
            prefix_ids=recipe.sink_token_ids,
            source=text.name,
            text_column=text.text_column,
        )


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the benchmark, print the tables, write ``bench.json`` and ``bench.png``.

    Returns 0, or 1 when a train workload saw a non-finite loss: its timing is of NaN arithmetic, not
    of the recipe, and the results say which one. ``--output_dir`` is locked (app/run_lock.py) from before the
    model loads until the results are written: taking the lock is the proof that the folder can be written, and
    while the benchmark runs no other hf-tapernorm command writes into that folder (nor another benchmark).
    """
    arguments = parse_arguments(list(sys.argv[1:] if argv is None else argv))
    lock = RunLock(Path(arguments.output_dir))
    lock.acquire()
    try:
        return _benchmark(arguments, argv)
    finally:
        lock.release()


def _benchmark(arguments: BenchArguments, argv: Optional[Sequence[str]]) -> int:
    """``main`` once its output folder is locked."""
    source = resolve_model(arguments.model_name_or_path, arguments.gguf_file, option="--model_name_or_path")
    if source.kind in ("tapered", "folded"):
        raise ConfigurationError(
            f"'{source.path}' is a {source.kind} model; the benchmark builds its variants "
            "from an ordinary (normalized) model"
        )
    arguments.check_positions(model_config(source))
    text = _train_text(arguments, source) if "train" in arguments.modes else None
    if text is not None:
        _check_train_text(arguments, source, text)
    model_types = set()

    def load(dtype: torch.dtype) -> nn.Module:
        model = load_model(source, dtype=str(dtype).removeprefix("torch."))
        model_types.add(model_type_of(model))
        return model

    started, env = time.time(), environment()
    results = run_benchmark(load, arguments, text)
    inference = any(r["case"]["mode"] != "train" for r in results)
    report = {
        "model": source.describe(),
        "model_type": model_types.pop(),
        "argv": list(argv) if argv is not None else sys.argv[1:],
        "settings": asdict(arguments),
        "environment": env,
        "loadavg_1m_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "note": QUALITY_NOTE if inference else None,
        "seconds": time.time() - started,
        "results": results,
    }
    output = Path(arguments.output_dir)  # created with its lock
    (output / "bench.json").write_text(json.dumps(report, indent=2))
    plot(results, output / "bench.png")
    print(format_table(results))
    if inference:
        print(f"note: {QUALITY_NOTE}")
    print(f"wrote {output / 'bench.json'} and {output / 'bench.png'}")
    nonfinite = [
        f"{r['label']}: {name}"
        for r in results
        if r["case"]["mode"] == "train"
        for name, entry in r["variants"].items()
        if not entry["losses_finite"]
    ]
    if nonfinite:
        print(
            f"hf-tapernorm bench: warning: non-finite training losses in {'; '.join(nonfinite)}: those "
            "timings are of NaN arithmetic, not of the recipe",
            file=sys.stderr,
        )
        return 1
    return 0


__all__ = ["TrainText", "main", "run_benchmark"]


if __name__ == "__main__":
    raise SystemExit(main())
