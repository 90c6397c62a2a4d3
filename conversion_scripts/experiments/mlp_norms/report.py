"""Tables for the report from the run summaries under /tmp/mlpnorms/summaries.

python -m conversion_scripts.experiments.mlp_norms.report table --baseline base_3000 --runs plain_100 plain_300
python -m conversion_scripts.experiments.mlp_norms.report collect   # -> reports/mlp_norms/results.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Optional

ROOT = Path(os.environ.get("MLPNORMS_ROOT", "/tmp/mlpnorms"))
SUMMARIES = ROOT / "summaries"
REPORT_DIR = Path(__file__).resolve().parents[1] / "reports" / "mlp_norms"


def load(name: str) -> dict:
    return json.loads((SUMMARIES / f"{name}.json").read_text())


def ce_at(summary: dict, step: int) -> Optional[float]:
    """Held-out CE at ``step`` (linear interpolation between evaluations)."""
    points = [(e["step"], e["eval_ce"]) for e in summary["evals"] if e.get("eval_ce") is not None]
    for (s0, c0), (s1, c1) in zip(points, points[1:]):
        if s0 <= step <= s1:
            return c0 + (c1 - c0) * (step - s0) / max(1, s1 - s0)
    return points[-1][1] if points and points[-1][0] == step else None


def gap(run: dict, base: dict) -> Optional[float]:
    if run.get("final_eval_ce") is None:
        return None
    ref = ce_at(base, run["config"]["steps"])
    return None if ref is None else 100.0 * (run["final_eval_ce"] / ref - 1.0)


def outcome(run: dict) -> str:
    b = run.get("broke")
    if b:
        extra = f", {b['norms_at_0']} norms at 0" if run["config"]["schedule"] == "layerwise" else ""
        return f"broke at step {b['step']}, g = {b['gate']:.2f}{extra}"
    g = run.get("final_gates") or {}
    if g and g.get("gate", 1.0) > 0:
        return f"completed at g = {g['gate']:.2f}"
    return "completed, g = 0"


def row(name: str, base_name: str, what: str = "") -> str:
    run, base = load(name), load(base_name)
    steps = run["config"]["steps"]
    g = gap(run, base)
    ref = ce_at(base, steps)
    final = run.get("final_eval_ce")
    return (
        f"| {name} | {what} | {steps} | {run['tokens'] / 1e6:.2f}M | {outcome(run)} | "
        f"{'-' if final is None else f'{final:.4f}'} | {'-' if ref is None else f'{ref:.4f}'} | "
        f"{'-' if g is None else f'{g:+.2f}%'} |"
    )


HEADER = (
    "| run | what | steps | taper tokens | outcome | held-out CE | baseline CE | gap |\n"
    "|---|---|---|---|---|---|---|---|"
)


def compact(summary: dict) -> dict:
    keep = (
        "name",
        "status",
        "broke",
        "final_eval_ce",
        "final_gates",
        "tokens",
        "tokens_trained",
        "pretrain_tokens",
        "params",
        "k_start",
        "k_end",
        "seconds",
        "sec_per_step",
        "max_token_ratio_end",
        "fold",
    )
    out = {k: summary.get(k) for k in keep}
    defaults = None
    try:
        from .taper_run import RunConfig

        defaults = RunConfig().__dict__
    except Exception:  # noqa: BLE001
        pass
    cfg = summary["config"]
    out["config"] = {
        k: v for k, v in cfg.items() if defaults is None or defaults.get(k) != v or k in ("model", "steps")
    }
    out["evals"] = [[e["step"], e.get("eval_ce"), round(e.get("gate", 1.0), 4)] for e in summary["evals"]]
    return out


def collect(out: Path) -> None:
    runs = {}
    for path in sorted(SUMMARIES.glob("*.json")):
        try:
            runs[path.stem] = compact(json.loads(path.read_text()))
        except Exception as error:  # noqa: BLE001
            runs[path.stem] = {"error": str(error)}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(runs, indent=0, default=lambda v: None if isinstance(v, float) and math.isnan(v) else v))
    print(f"{len(runs)} runs -> {out}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("table")
    t.add_argument("--baseline", required=True)
    t.add_argument("--runs", nargs="+", required=True)
    c = sub.add_parser("collect")
    c.add_argument("--out", type=Path, default=REPORT_DIR / "results.json")
    args = p.parse_args(argv)
    if args.command == "table":
        print(HEADER)
        for name in args.runs:
            print(row(name, args.baseline))
    else:
        collect(args.out)


if __name__ == "__main__":
    main()


def plot(out: Path, ladders: dict, fragility_files: dict) -> None:
    """Left: held-out CE gap vs taper tokens per ladder (x: broke). Right: training-free CE vs MLP-norm gate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ax = axes[0]
    for label, (base_name, names) in ladders.items():
        base = load(base_name)
        xs, ys, bx = [], [], []
        for name in names:
            try:
                run = load(name)
            except FileNotFoundError:
                continue
            g = gap(run, base)
            if g is None:
                bx.append(run["tokens"])
            else:
                xs.append(run["tokens"])
                ys.append(g)
        line = ax.plot(xs, ys, marker="o", label=label)[0]
        if bx:
            ax.scatter(
                bx,
                [max(ys or [1]) * 1.3] * len(bx),
                marker="x",
                s=80,
                color=line.get_color(),
                label=f"{label}: runaway (no final CE)",
            )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("taper tokens (continued pretraining)")
    ax.set_ylabel("held-out CE gap to the normalized baseline (%)")
    ax.set_title("all-norm taper: gap vs budget (testbed)")
    ax.legend(fontsize=7)
    ax = axes[1]
    for label, path in fragility_files.items():
        data = json.loads(Path(path).read_text())["fragility"]
        ref = data["curve"][0][1]
        gs = [g for g, c in data["curve"] if c is not None]
        cs = [100 * (c / ref - 1) for g, c in data["curve"] if c is not None]
        line = ax.plot(gs, cs, marker=".", label=label)[0]
        if data["break_gate"] is not None:
            ax.axvline(data["break_gate"], color=line.get_color(), ls=":", lw=1)
    ax.set_yscale("symlog", linthresh=1)
    ax.invert_xaxis()
    ax.set_xlabel("gate of the MLP norms (attention norms at 1), no training")
    ax.set_ylabel("held-out CE change (%); dotted: first NaN")
    ax.set_title("training-free fragility")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
