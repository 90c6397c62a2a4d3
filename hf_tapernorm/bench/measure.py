"""Timing and counting: interleaved repeats, ratios of paired runs, aten operations, per-case summaries.

Timing one model after another on a shared machine gives false ratios (a load spike lands on one
variant only), so every repeat runs each workload once in a rotating order and ratios are medians of
the per-repeat ratios: a spike that hits both members of a pair cancels. Operation counts
(``torch.profiler``) do not depend on the load at all, and on a GPU at small batch each operation is a
kernel launch; they are counted with the same helper the run reports use (``app.showcase``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any, Optional

import torch
from tqdm.auto import tqdm

from ..app.showcase import count_aten_ops
from .arguments import Case
from .workloads import Workload


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def interleaved_times(
    workloads: Mapping[str, Workload], *, warmup: int, repeats: int, device: str, progress: bool = True
) -> dict[str, list[float]]:
    """Seconds per ``run``: each repeat runs every workload once, the order rotating between repeats."""
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


def op_counts(workload: Workload) -> dict[str, float]:
    """aten operations per model forward of one ``run`` (all, nested included, and top level)."""
    state = workload.prepare()
    return count_aten_ops(lambda: workload.run(state), calls=workload.steps)


def summarize(
    case: Case,
    times: Mapping[str, list[float]],
    ops: Mapping[str, dict[str, float]],
    *,
    baseline: str,
    limits: Optional[Mapping[str, str]] = None,
    peer: Optional[str] = None,
) -> dict[str, Any]:
    """Median times, the paired ratio to ``baseline``, to ``peer``, to each variant's limit, and op counts.

    Inference modes report ``speedup_vs_<baseline>`` (baseline time / variant time: above 1 is faster) and,
    when the peer ran, ``speedup_vs_<peer>`` the same way; the train mode reports ``cost_vs_<baseline>``
    (workload time / baseline time: the price of a step).
    """
    limits = limits or {}
    entries = {}
    for name, series in times.items():
        entry: dict[str, Any] = {"median_ms": 1e3 * statistics.median(series), **ops.get(name, {})}
        if case.mode == "decode":
            entry["median_ms_per_token"] = entry["median_ms"] / case.steps
        if baseline in times:
            if case.mode == "train":
                entry[f"cost_vs_{baseline}"] = median_ratio(series, times[baseline])
            else:
                entry[f"speedup_vs_{baseline}"] = median_ratio(times[baseline], series)
        if peer in times and case.mode != "train":
            entry[f"speedup_vs_{peer}"] = median_ratio(times[peer], series)
        if limits.get(name) in times:
            entry["speed_vs_limit"] = median_ratio(times[limits[name]], series)
        entries[name] = entry
    return {"case": asdict(case), "label": case.label(), "variants": entries, "times_s": dict(times)}


__all__ = ["interleaved_times", "median_ratio", "op_counts", "summarize"]
