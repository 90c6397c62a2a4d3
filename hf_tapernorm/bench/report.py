"""The benchmark's outputs for people: the terminal tables, the figure, and the machine it ran on.

Inference and training results answer different questions (how much faster is a norm-free model;
what does a taper step cost), so they get separate tables and panels, each with its own ratio:
a speedup over ``original``, a cost relative to ``normalized``. The environment is recorded because
every timing depends on it, the machine's load most of all.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import torch

Result = dict[str, Any]


def _ratio(value: Optional[float]) -> str:
    return f"{value:.3f}x" if value is not None else "-"


def _count(value: Optional[float]) -> str:
    """An op count, or ``-`` where none was counted (``--no_op_counts``), as every other empty column prints."""
    return f"{value:.0f}" if value is not None else "-"


def _inference_table(results: Sequence[Result]) -> list[str]:
    header = (
        f"{'case':<44} {'variant':<18} {'median ms':>10} {'vs original':>12} {'vs flashnorm':>13} {'vs limit':>9} "
        f"{'aten ops':>9}"
    )
    lines = [
        "inference: speedup = original time / variant time (vs flashnorm, vs limit: their time / variant time; "
        "median of paired repeats); aten ops per forward (decode: per generated token)",
        header,
        "-" * len(header),
    ]
    for result in results:
        for name, entry in result["variants"].items():
            if entry.get("runtime") == "onnxruntime":
                continue  # in the runtime table
            lines.append(
                f"{result['label']:<44} {name:<18} {entry['median_ms']:>10.2f} "
                f"{_ratio(entry.get('speedup_vs_original')):>12} {_ratio(entry.get('speedup_vs_flashnorm')):>13} "
                f"{_ratio(entry.get('speed_vs_limit')):>9} "
                f"{_count(entry.get('aten_ops')):>9}"
            )
    return lines


def _runtime_table(results: Sequence[Result]) -> list[str]:
    """The variants run in ONNX Runtime: time, speedup over ort-original and over torch's original, graph nodes."""
    header = (
        f"{'case':<44} {'variant':<18} {'median ms':>10} {'vs ort-orig':>12} {'vs original':>12} "
        f"{'onnx nodes':>11} {'ort nodes':>10}"
    )
    lines = [
        "onnxruntime: speedup = ort-original (or torch original) time / variant time; nodes of the exported "
        "graph and of the graph ONNX Runtime runs after its optimizations",
        header,
        "-" * len(header),
    ]
    for result in results:
        for name, entry in result["variants"].items():
            if entry.get("runtime") != "onnxruntime":
                continue
            lines.append(
                f"{result['label']:<44} {name:<18} {entry['median_ms']:>10.2f} "
                f"{_ratio(entry.get('speedup_vs_ort-original')):>12} {_ratio(entry.get('speedup_vs_original')):>12} "
                f"{entry['onnx_nodes']:>11} {entry['ort_nodes']:>10}"
            )
    return lines


def _train_table(results: Sequence[Result]) -> list[str]:
    header = (
        f"{'case':<36} {'workload':<23} {'median ms':>10} {'vs normalized':>14} {'vs fp32':>8} {'aten ops':>9} "
        f"{'gates':<26} {'teacher':<7} {'losses'}"
    )
    lines = [
        "train: cost = workload step time / normalized step time (median of paired repeats); vs fp32 = the same "
        "workload's fp32 step time / its autocast step time",
        header,
        "-" * len(header),
    ]
    for result in results:
        for name, entry in result["variants"].items():
            gates = ",".join(f"{g:.2f}" for g in entry["gates"]) if entry.get("gates") else "-"
            finite = "finite" if entry["losses_finite"] else "NON-FINITE"
            if entry.get("divergence"):
                finite += " (the divergence watch would stop this run)"
            lines.append(
                f"{result['label']:<36} {name:<23} {entry['median_ms']:>10.2f} "
                f"{_ratio(entry.get('cost_vs_normalized')):>14} {_ratio(entry.get('speedup_vs_fp32')):>8} "
                f"{_count(entry.get('aten_ops')):>9} "
                f"{gates:<26} {('yes' if entry['teacher'] else 'no'):<7} {finite}"
            )
    return lines


def format_table(results: Sequence[Result]) -> str:
    """The inference table, the ONNX Runtime table, then the train table (each only when the run has such cases)."""
    inference = [r for r in results if r["case"]["mode"] != "train"]
    train = [r for r in results if r["case"]["mode"] == "train"]
    runtime = [r for r in inference if any(e.get("runtime") == "onnxruntime" for e in r["variants"].values())]
    blocks = ([_inference_table(inference)] if inference else []) + ([_runtime_table(runtime)] if runtime else [])
    blocks += [_train_table(train)] if train else []
    notes = [r for r in train if r.get("cpu_has_fast_bf16") is False]
    if notes:
        blocks.append(["note: this CPU has no fast bf16 matrix products (utils.cpu_has_fast_bf16): bf16 is slower"])
    return "\n\n".join("\n".join(block) for block in blocks)


def _bars(axis: Any, results: Sequence[Result], metric: str, label: str, reference: Optional[float]) -> None:
    names = list(dict.fromkeys(n for r in results for n in r["variants"]))
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        xs = [k + i * width for k, r in enumerate(results) if name in r["variants"]]
        values = [r["variants"][name].get(metric, float("nan")) for r in results if name in r["variants"]]
        axis.bar(xs, values, width, label=name)
    if reference is not None:
        axis.axhline(reference, color="black", linewidth=0.8)
    axis.set_ylabel(label, fontsize=8)
    axis.set_xticks([k + 0.4 - width / 2 for k in range(len(results))])
    axis.set_xticklabels([r["label"].replace(" ", "\n", 2) for r in results], fontsize=7)
    axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, never over them


def plot(results: Sequence[Result], path: Path) -> None:
    """Speedup and aten ops per forward of the inference cases; step cost and ops of the train cases."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    inference = [r for r in results if r["case"]["mode"] != "train"]
    train = [r for r in results if r["case"]["mode"] == "train"]
    panels = []
    if inference:
        panels += [
            (inference, "speedup_vs_original", "speedup vs original\n(median of pair ratios)", 1.0),
            (inference, "aten_ops", "aten ops per forward", None),
        ]
    if train:
        panels += [
            (train, "cost_vs_normalized", "step cost vs normalized\n(median of pair ratios)", 1.0),
            (train, "aten_ops", "aten ops per train step", None),
        ]
    width = max(7, 2.4 * max(len(inference), len(train)) + 2)
    fig, axes = plt.subplots(len(panels), 1, figsize=(width, 3.2 * len(panels)), squeeze=False)
    for axis, (chosen, metric, label, reference) in zip(axes[:, 0], panels):
        _bars(axis, chosen, metric, label, reference)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def environment() -> dict[str, Any]:
    """Versions, CPU/GPU and the 1-minute load average at the time of the call."""
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


__all__ = ["environment", "format_table", "plot"]
