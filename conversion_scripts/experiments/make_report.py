"""Collect the fidelity runs (reports/runs/*.jsonl) into reports/smollm2_fidelity.{md,json,png}.

For every run: status, held-out CE at start/end, the gap to the normalized baseline at equal steps,
the gate at which held-out CE first rises 2% above its gate-1 value, and its per-layer diagnostics.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from conversion_scripts.experiments.research.diagnostics import loss_rise_gate  # noqa: E402  (training-free curves)

HERE = Path(__file__).resolve().parent
RUNS = HERE / "reports" / "runs"  # the raw run logs, kept compressed in reports/runs.tar.xz


def unpack_runs() -> None:
    """Extract reports/runs.tar.xz next to it once (the raw logs stay out of the tree uncompressed)."""
    archive = RUNS.with_suffix(".tar.xz")
    if not RUNS.is_dir() and archive.is_file():
        import tarfile

        with tarfile.open(archive) as tar:
            tar.extractall(RUNS.parent, filter="data")


def load(path: Path) -> dict:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    config = rows[0]["config"]
    steps = [r for r in rows if "step" in r and "ce" in r or r.get("step") == 0]
    # Staged runs: the gate of the group that is tapering (the lower one), not the logged mean.
    for r in rows:
        if "gate_late" in r:
            r["gate"] = min(r["gate_late"], r["gate_early"])
    evals = [(r["step"], r["gate"], r["eval_ce"]) for r in rows if "eval_ce" in r and "step" in r]
    final = next((r for r in rows if r.get("final")), None)
    return {"name": path.stem, "config": config, "steps": steps, "evals": evals, "final": final}


def main() -> None:
    unpack_runs()
    runs = {p.stem: load(p) for p in sorted(RUNS.glob("*.jsonl")) if p.stem != "smoke"}
    baselines = {n: r for n, r in runs.items() if r["config"]["baseline"]}
    summary = {}
    for name, run in runs.items():
        cfg = run["config"]
        base = max(
            (
                b
                for b in baselines.values()
                if b["config"]["batch"] == cfg["batch"]
                and b["config"]["seq"] == cfg["seq"]
                and b["config"]["lr"] == cfg["lr"]
                and b["config"].get("shuffle", False) == cfg.get("shuffle", False)
            ),
            key=lambda b: b["config"]["steps"],
            default=None,
        )
        last = run["evals"][-1] if run["evals"] else None
        row = {
            "config": cfg,
            "status": run["final"]["status"] if run["final"] else "running or killed",
            "ce_start": run["evals"][0][2] if run["evals"] else None,
            "last_eval": {"step": last[0], "gate": last[1], "ce": last[2]} if last else None,
            "rise_gate_2pct": None,
            "last_step_gate": run["steps"][-1].get("gate") if run["steps"] else None,
        }
        if base is not None and last is not None and not cfg["baseline"]:
            # Baseline CE at the same step, linearly interpolated between its evaluations.
            pts = sorted((s, c) for s, _, c in base["evals"])
            for (s0, c0), (s1, c1) in zip(pts, pts[1:]):
                if s0 <= last[0] <= s1:
                    row["baseline_ce_same_step"] = c0 + (c1 - c0) * (last[0] - s0) / (s1 - s0)
                    row["gap_pct"] = 100.0 * (last[2] / row["baseline_ce_same_step"] - 1.0)
        if base is not None and not cfg["baseline"]:
            pts = sorted((s, c) for s, _, c in base["evals"])

            def base_at(step, pts=pts):
                for (s0, c0), (s1, c1) in zip(pts, pts[1:]):
                    if s0 <= step <= s1:
                        return c0 + (c1 - c0) * (step - s0) / (s1 - s0)
                return None

            # The gate at which held-out CE first exceeds the baseline's at the same step by 2%.
            curve = [(g, c / base_at(s)) for s, g, c in run["evals"] if base_at(s)]
            row["gap_by_eval"] = [
                (s, round(g, 4), round(100 * (c / base_at(s) - 1), 2)) for s, g, c in run["evals"] if base_at(s)
            ]
            row["rise_gate_2pct"] = next((g for g, ratio in curve if ratio > 1.02), None)
        if run["final"] and "diagnostics" in run["final"]:
            row["diagnostics"] = run["final"]["diagnostics"]
        summary[name] = row
    sweep = HERE / "reports" / "calibration_sweep.json"
    out = {"runs": summary, "calibration_sweep": json.loads(sweep.read_text()) if sweep.exists() else None}
    (HERE / "reports" / "smollm2_fidelity.json").write_text(json.dumps(out, indent=1))

    plot(
        runs,
        HERE / "reports" / "smollm2_fidelity.png",
        "SmolLM2-135M-Instruct, Internal-Taper: held-out CE and gate vs step",
    )
    plot(
        {n: r for n, r in runs.items() if n.startswith("s300_")},
        HERE / "reports" / "smollm2_fidelity_300.png",
        "SmolLM2-135M-Instruct, 300-step runs (BOS sink): held-out CE and gate vs step",
    )
    plot(
        {n: r for n, r in runs.items() if n.startswith("sh300_")},
        HERE / "reports" / "smollm2_fidelity_shuffled.png",
        "SmolLM2-135M-Instruct, 300-step runs on shuffled data: held-out CE and gate vs step",
    )
    session4 = [
        "sh300_baseline",
        "sh300_plain",
        "sh300_all_kds1_h1",
        "sh300_attn_e200",
        "sh300_attn_e200_kd1",
        "sh300_attn_e200_kds1",
    ]
    plot(
        {n: runs[n] for n in session4 if n in runs},
        HERE / "reports" / "smollm2_fidelity_distillation.png",
        "SmolLM2-135M-Instruct: distillation from the gate-start snapshot (session 4)",
    )

    lines = [
        "| run | status | CE start | last eval (step, gate, CE) | baseline CE same step (interpolated) | gap "
        "| gap > 2% at gate |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in summary.items():
        le = row["last_eval"]
        lines.append(
            f"| {name} | {row['status']} | {row['ce_start'] and round(row['ce_start'], 4)} | "
            f"{le and (le['step'], round(le['gate'], 3), round(le['ce'], 4))} | "
            f"{row.get('baseline_ce_same_step') and round(row['baseline_ce_same_step'], 4)} | "
            f"{format(row['gap_pct'], '+.2f') + '%' if 'gap_pct' in row else '-'} | {row['rise_gate_2pct']} |"
        )
    (HERE / "reports" / "runs_table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    (HERE / "reports" / "layers_table.md").write_text(layers_table(out["calibration_sweep"], summary))


def plot(runs: dict, path: Path, title: str) -> None:
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for i, (name, run) in enumerate(runs.items()):
        color = "black" if run["config"]["baseline"] else f"C{i % 10}"
        if run["evals"]:
            ax1.plot(
                [s for s, _, _ in run["evals"]], [c for _, _, c in run["evals"]], marker="o", label=name, color=color
            )
        if not run["config"]["baseline"] and run["steps"]:
            ax2.plot([r["step"] for r in run["steps"]], [r["gate"] for r in run["steps"]], label=name, color=color)
    ax1.set_ylabel("held-out CE")
    ax1.set_ylim(top=min(8.0, ax1.get_ylim()[1]))
    ax1.legend(fontsize=7)
    ax2.set_ylabel("gate (staged runs: the tapering group)")
    ax2.set_xlabel("optimizer step")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def layers_table(sweep: dict | None, summary: dict) -> str:
    """Per-layer markdown: residual scale by position (gate 1), c and branch distance per calibration fit."""
    if not sweep:
        return ""
    extra = HERE / "reports" / "calibration_sweep2.json"
    sweep2 = json.loads(extra.read_text()) if extra.exists() else {}
    fits = {k: v for k, v in {**sweep, **sweep2}.items() if isinstance(v, dict) and "c" in v}
    gates = sorted({k for v in fits.values() for k in v if k.startswith("ce@")}, key=lambda k: -float(k[3:]))
    lines = [
        "## Training-free: held-out CE when the gate is lowered without training",
        f"CE at gate 1: {sweep['ce_gate1']:.4f}",
        "",
        "| fit | " + " | ".join(gates) + " | CE +2% at gate |",
        "|---|" + "---|" * (len(gates) + 1),
    ]
    for name, row in fits.items():
        rise = loss_rise_gate([(1.0, sweep["ce_gate1"])] + [(float(g[3:]), row[g]) for g in gates if g in row])
        lines.append(f"| {name} | " + " | ".join(f"{row[g]:.4f}" if g in row else "-" for g in gates) + f" | {rise} |")
    names = list(fits)
    lines += [
        "",
        "## Per layer (original model, gate 1): residual scale and each fit's c and branch distance",
        "sink_ratio: RMS of position 0 (BOS) / median RMS of the other tokens; max_ratio and frac_above_4x: "
        "the other tokens. dist: ||linear - norm|| / ||norm|| on held-out non-sink tokens.",
        "",
        "| layer | median RMS | sink_ratio | max_ratio | frac>4x | "
        + " | ".join(f"c {n} / dist" for n in names)
        + " |",
        "|---|---|---|---|---|" + "---|" * len(names),
    ]
    for layer, rs in sweep["residual_scale"].items():
        short = layer.replace("model.layers.", "L").replace("_layernorm", "")
        cells = [
            f"{fits[n]['c'][layer]:.4g} / {fits[n]['branch_distance'][layer]:.3f}" if layer in fits[n]["c"] else "-"
            for n in names
        ]
        lines.append(
            f"| {short} | {rs['median_rms']:.3g} | {rs['sink_ratio']:.1f} | {rs['max_ratio']:.1f} | "
            f"{rs['frac_above_4x']:.4f} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
