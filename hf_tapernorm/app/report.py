"""The run report: ``report.json`` (every figure), ``report.md`` (summary + plots) and PNG plots.

The pipeline gathers the run's facts into a typed ``RunRecord`` (record.py; its ``to_dict`` is
report.json, see ``REPORT_KEYS``) with a per-step history (one record per logged optimizer step with
``step`` and any of ``gate``, ``loss``, ``ce``, ``scale_loss``, ``residual_scale``, ``distill``); this
module only renders them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional, Union

from ..evaluation.scan import scan_summary
from .folder_writes import write_file
from .record import READING_KEYS, DataFacts, RunRecord, far_worse_warning, named_data

logger = logging.getLogger(__name__)

REPORT_KEYS = (
    "status", "model", "data", "taper", "training", "heldout", "gap", "fold", "export", "history", "working_folder",
    "home_folder",
)  # fmt: skip
"""Top-level keys of report.json (``baseline_history``, ``diagnostics`` and ``allowed_changes`` appear when
available): ``RunRecord.to_dict()``. ``working_folder`` and ``home_folder``: the taper command's, which the model
and data paths as the user typed them are relative to (record.recorded_path reads them from any folder and home)."""

PLOTS = {
    "gate": "gate_schedule.png",
    "loss": "training_loss.png",
    "scale": "residual_scale.png",
    "heldout": "heldout_loss.png",
}

MODEL_KINDS = ("original", "baseline", "tapered", "folded")


def _series(history: Iterable[Mapping[str, Any]], key: str) -> tuple[list[float], list[float]]:
    steps, values = [], []
    for record in history:
        value = record.get(key)
        if value is not None and "step" in record and isinstance(value, (int, float)) and math.isfinite(value):
            steps.append(record["step"])
            values.append(float(value))
    return steps, values


def _plot_gate(ax, history, taper: Mapping[str, Any]) -> None:
    steps, gates = _series(history, "gate")
    if steps:
        ax.plot(steps, gates, marker=".", label="gate g")
    for key, style in (("taper_start_step", ":"), ("taper_end_step", "--")):
        if taper.get(key) is not None:
            ax.axvline(taper[key], color="grey", linestyle=style, label=key.replace("_step", "").replace("_", " "))
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("gate")
    ax.set_title("Gate schedule")


def _plot_loss(ax, history, baseline_history) -> None:
    steps, loss = _series(history, "ce")
    if not steps:
        steps, loss = _series(history, "loss")
    ax.plot(steps, loss, label="training CE (tapered)")
    if baseline_history:
        b_steps, b_loss = _series(baseline_history, "loss")
        ax.plot(b_steps, b_loss, label="training CE (baseline)", alpha=0.7)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy")
    s_steps, scale_loss = _series(history, "scale_loss")
    if s_steps:
        twin = ax.twinx()
        twin.plot(s_steps, scale_loss, color="tab:red", linestyle="--", label="scale loss")
        twin.set_ylabel("scale loss", color="tab:red")
        handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
        ax.legend(handles=handles, loc="upper right")  # one legend for both axes
    ax.set_title("Training loss")


def _plot_scale(ax, history, target: Optional[float]) -> None:
    steps, scale = _series(history, "residual_scale")
    ax.plot(steps, scale, label="residual scale at the final norm")
    if target is not None:
        ax.axhline(target, color="grey", linestyle="--", label="scale target")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("RMS (or std) of the final norm's input")
    ax.set_title("Residual scale")


def _plot_heldout(ax, heldout: Mapping[str, Mapping[str, float]]) -> None:
    kinds = [k for k in MODEL_KINDS if heldout.get(k)]
    values = [heldout[k]["loss"] for k in kinds]
    bars = ax.bar(kinds, values, color=["tab:grey", "tab:blue", "tab:orange", "tab:green"][: len(kinds)])
    for bar, value in zip(bars, values):
        ax.annotate(f"{value:.4f}", (bar.get_x() + bar.get_width() / 2, value), ha="center", va="bottom")
    if values:
        low, high = min(values), max(values)
        ax.set_ylim(max(0.0, low - 0.25 * (high - low + 0.1)), high + 0.25 * (high - low + 0.1))
    ax.set_ylabel("held-out cross-entropy")
    ax.set_title("Held-out loss")


PLOTS_SKIPPED = "Plots skipped: matplotlib is not installed (pip install 'hf-tapernorm[demo]' to draw them)."


def plotting_available() -> bool:
    """Whether matplotlib can be imported: plots are optional, the ``demo`` extra installs it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_plots(output_dir: str | Path, facts: Mapping[str, Any]) -> dict[str, str]:
    """Render the four PNG plots into ``output_dir``; returns {plot: file name} ({} without matplotlib)."""
    if not plotting_available():
        return {}
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    output_dir = Path(output_dir)
    history = facts.get("history") or []
    drawers = {
        "gate": lambda ax: _plot_gate(ax, history, facts.get("taper") or {}),
        "loss": lambda ax: _plot_loss(ax, history, facts.get("baseline_history")),
        "scale": lambda ax: _plot_scale(ax, history, (facts.get("taper") or {}).get("scale_target")),
        "heldout": lambda ax: _plot_heldout(ax, facts.get("heldout") or {}),
    }
    written = {}
    for key, draw in drawers.items():
        figure, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
        draw(ax)
        if ax.get_legend() is None and ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best")
        figure.tight_layout()
        figure.savefig(output_dir / PLOTS[key])
        plt.close(figure)
        written[key] = PLOTS[key]
    return written


def _fmt(value: Any, spec: str = ".4f") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def _pct(value: Optional[float]) -> str:
    return "-" if value is None else f"{100 * value:+.2f}%"


#: The keys of the report's ``data`` section that the pipeline itself records (record.DataFacts).
DATA_KEYS = frozenset(f.name for f in dataclasses.fields(DataFacts)) - {"reading", "extension"} | set(READING_KEYS)


def _other_facts(data: Mapping[str, Any]) -> str:
    """The ``data`` section's other facts, " (key value, ...)": an extension's (extension.py), or the options of
    older versions' runs."""
    other = [f"{key} {_fmt(value)}" for key, value in data.items() if key not in DATA_KEYS and value is not None]
    return f" ({', '.join(other)})" if other else ""


def summary_lines(facts: Mapping[str, Any]) -> list[str]:
    """The short summary printed on the terminal and placed at the top of report.md / the model card."""
    model = facts.get("model") or {}
    data = facts.get("data") or {}
    training = facts.get("training") or {}
    heldout = facts.get("heldout") or {}
    gap = facts.get("gap") or {}
    fold = facts.get("fold") or {}
    export = facts.get("export") or {}
    warning = far_worse_warning(dict(facts))
    lines = [
        *([warning] if warning else []),
        f"model: {model.get('source', '-')} ({model.get('model_type', '-')}, "
        f"{_fmt(model.get('parameters'))} parameters)",
        f"data: {named_data(data)}, blocks of {_fmt(data.get('block_size'))} tokens{_other_facts(data)}"
        + f", held-out {_fmt(data.get('heldout_tokens'))} tokens",
        f"training: {_fmt(training.get('steps'))} steps, {_fmt(training.get('tokens'))} tokens, "
        f"{_fmt(training.get('seconds'), '.0f')} s, final gate {_fmt(training.get('final_gate'), 'g')}"
        + (f", {training['mixed_precision']} autocast" if training.get("mixed_precision") else ""),
    ]
    for kind in MODEL_KINDS:
        if heldout.get(kind):
            lines.append(
                f"held-out {kind:<8} loss {heldout[kind]['loss']:.4f}  perplexity {heldout[kind]['perplexity']:.3f}"
            )
    lines.append(
        f"gap: tapered vs baseline {_pct(gap.get('tapered_vs_baseline'))}, vs original "
        f"{_pct(gap.get('tapered_vs_original'))}; folded vs tapered {_pct(gap.get('folded_vs_tapered'))}"
    )
    outside = facts.get("out_of_corpus") or {}
    if outside.get("folded"):
        lines.append(
            f"out of corpus: folded {outside['folded']['loss']:.4f} (KL to the original "
            f"{_fmt(outside['folded'].get('kl'))}), vs baseline {_pct(gap.get('out_of_corpus_folded_vs_baseline'))}, "
            f"vs original {_pct(gap.get('out_of_corpus_folded_vs_original'))}"
        )
    scan = facts.get("robustness_scan") or {}
    if scan:
        lines.append(f"robustness scan: {scan_summary(scan)}")
    if fold:
        lines.append(
            f"fold check: max |logit diff| {_fmt(fold.get('max_abs_diff'), '.3g')}, "
            f"max relative {_fmt(fold.get('max_rel_diff'), '.3g')}"
        )
    ops = facts.get("ops_per_token") or {}
    if ops.get("original") and ops.get("folded"):
        before, after = ops["original"]["aten_ops"], ops["folded"]["aten_ops"]
        lines.append(
            f"aten ops per generated token: original {before:.0f}, folded {after:.0f} ({after / before - 1:+.1%})"
        )
    if export.get("path"):
        lines.append(f"export: {export['path']} (reloaded: {export.get('reloaded', False)})")
    if facts.get("status") and facts["status"] != "finished":
        lines.append(f"status: {facts['status']}")
    return lines


def render_markdown(facts: Mapping[str, Any], plots: Mapping[str, str]) -> str:
    taper = facts.get("taper") or {}
    precision = (facts.get("training") or {}).get("precision")  # what the run trained in, first
    parts = ["# hf_tapernorm run report", "", *([f"**{precision.capitalize()}**", ""] if precision else [])]
    parts += ["```", *summary_lines(facts), "```", ""]
    changes = facts.get("allowed_changes") or {}
    if changes:  # --resume --allow_changes: the run is not one run with one set of options
        parts += [
            "## Options changed on --resume (--allow_changes)",
            "",
            "| option | in the run | now |",
            "|---|---|---|",
        ]
        parts += [
            f"| {key} | {_cell(repr(c.get('run')))} | {_cell(repr(c.get('now')))} |" for key, c in changes.items()
        ]
        parts += [""]
    parts += _evaluation_sections(facts)
    parts += _scan_section(facts.get("robustness_scan") or {})
    parts += ["## Tapering", "", "| setting | value |", "|---|---|"]
    parts += [f"| {key} | {_fmt(value, 'g')} |" for key, value in sorted(taper.items())]
    calibration = (facts.get("diagnostics") or {}).get("calibration") or {}
    if calibration:
        parts += [
            "",
            "## Per-layer calibration",
            "",
            "| tapered norm | c | median gain c*gammat | max gain |",
            "|---|---|---|---|",
        ]
        parts += [
            f"| {name} | {row['c']:.4g} | {row['gain_median']:.4g} | {row['gain_max']:.4g} |"
            for name, row in calibration.items()
        ]
    samples = facts.get("samples") or []
    if samples:
        names = [k for k in samples[0] if k != "prompt"]
        parts += [
            "",
            "## Greedy continuations of held-out prompts",
            "",
            "| prompt | " + " | ".join(names) + " |",
            "|---" * (len(names) + 1) + "|",
        ]
        parts += ["| " + " | ".join(_cell(row[k]) for k in ["prompt", *names]) + " |" for row in samples]
    parts += ["", "## Plots", ""]
    if not plots:
        parts += [PLOTS_SKIPPED, ""]
    titles = {"gate": "Gate schedule", "loss": "Training loss", "scale": "Residual scale", "heldout": "Held-out loss"}
    for key, name in plots.items():
        parts += [f"### {titles[key]}", "", f"![{titles[key]}]({name})", ""]
    parts += ["All figures: report.json.", ""]
    return "\n".join(parts)


def _evaluation_sections(facts: Mapping[str, Any]) -> list[str]:
    """Held-out and out-of-corpus tables (CE, KL to the original), and the documents that lose most."""
    sets = facts.get("evaluation_sets") or {}
    parts: list[str] = []
    documents = facts.get("heldout_documents") or {}
    broken_of = {"heldout": documents, "out_of_corpus": facts.get("out_of_corpus_blocks") or {}}
    for title, key, set_name in (
        ("Held-out loss", "heldout", "held-out"),
        ("Out-of-corpus loss", "out_of_corpus", "out-of-corpus"),
    ):
        scores = facts.get(key) or {}
        if not scores:
            continue
        parts += [f"## {title}", ""]
        if set_name in sets:
            about = sets[set_name]
            parts += [f"{about['blocks']} blocks, {about['tokens']} predicted tokens: {about['description']}.", ""]
        parts += ["| model | loss | perplexity | KL to the original | tokens |", "|---|---|---|---|---|"]
        for kind in MODEL_KINDS:
            if scores.get(kind):
                r = scores[kind]
                parts.append(
                    f"| {kind} | {r['loss']:.4f} | {r['perplexity']:.3f} | {_fmt(r.get('kl'))} | "
                    f"{r.get('tokens', '-')} |"
                )
        parts.append("")
        found = broken_of[key]
        broken = found.get("broken_blocks")
        if broken:
            parts += [
                f"{set_name.capitalize()} blocks where the tapered model loses more than {broken['threshold_nats']:g} "
                f"nats per token against the {found['against']} (it breaks past some token): {len(broken['blocks'])}"
                + (f" (blocks {', '.join(map(str, broken['blocks'][:10]))})" if broken["blocks"] else "")
                + f"; the gap without them: {_pct(broken['gap_without'])}.",
                "",
            ]
    if documents.get("rows"):
        against = documents["against"]
        parts += [
            f"## Held-out documents where the tapered model loses most (against the {against})",
            "",
            f"| document | tokens | {against} | tapered | gap | share of the excess loss |",
            "|---|---|---|---|---|---|",
        ]
        parts += [
            f"| {row['document']} | {row['tokens']} | {row['reference_loss']:.4f} | {row['loss']:.4f} | "
            f"{_pct(row['gap'])} | {100 * row['share_of_excess']:.1f}% |"
            for row in documents["rows"]
        ]
        parts.append("")
    return parts


def _scan_section(scan: Mapping[str, Any]) -> list[str]:
    """The robustness scan: broken windows per text and length, and the worst windows with where they break."""
    if not scan:
        return []
    parts = [
        "## Robustness scan",
        "",
        f"The folded model against the {scan['reference']} on windows drawn at any token offset of each text, the "
        f"sink first, at the block size and longer (seed {scan['seed']}). A window is broken when a stretch of "
        f"{scan['stretch_tokens']} tokens loses more than {scan['threshold_nats']:g} nats per token. "
        f"{scan['broken']} of {scan['windows']} windows are broken.",
        "",
        "The gap's interval covers 90% of resamples of the windows: a gap read on few windows is rough.",
        "",
        f"| text | window tokens | windows | {scan['reference']} loss | folded loss | gap | 90% interval | broken | "
        "gap without them |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    parts += [
        f"| {row['text']} | {row['length']} | {row['windows']} | {row['reference_loss']:.4f} | "
        f"{row['model_loss']:.4f} | {_pct(row['gap'])} | {_interval(row.get('gap_interval'))} | {row['broken']} | "
        f"{_pct(row['gap_without_broken'])} |"
        for row in scan["rows"]
    ]
    if scan.get("worst"):
        parts += [
            "",
            "The worst windows (excess: nats per token over the reference on the window's worst stretch; for a "
            "broken window, the layer where the folded model's share of attention on the sink falls below half the "
            "reference's, 'none' when no layer's does; the others are not traced):",
            "",
            "| text | tokens | offset | excess | folded / reference loss | sink share falls at layer | first tokens |",
            "|---|---|---|---|---|---|---|",
        ]
        for window in scan["worst"]:
            parts.append(
                f"| {window['text']} | {window['length']} | {window['offset']} | {window['worst_excess']:+.2f} | "
                f"{window['model_loss']:.3f} / {window['reference_loss']:.3f} | {_sink_share_fall(window)} | "
                f"{_cell(window['first_tokens'], 60)} |"
            )
    return [*parts, ""]


def _interval(interval: Optional[Sequence[float]]) -> str:
    """A gap interval as ``-1.2% to +3.4%`` ('-' where there is none: one window, or a scan that predates it)."""
    return "-" if not interval else f"{_pct(interval[0])} to {_pct(interval[1])}"


def _sink_share_fall(window: Mapping[str, Any]) -> str:
    """The layer where a window's sink share falls.

    The scan traces only broken windows: each trace is an eager-attention forward of both models.
    """
    traced = window.get("sink_share") or {}
    if not traced:
        return "not traced"
    fall = traced.get("falls_at_layer")
    return "none" if fall is None else str(fall)


def _cell(text: str, limit: int = 160) -> str:
    """One Markdown table cell: newlines and pipes escaped, long text cut."""
    text = text if len(text) <= limit else text[: limit - 1] + "…"
    return "`" + text.replace("`", "'").replace("|", "\\|").replace("\n", "⏎") + "`"


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def write_report(output_dir: str | Path, facts: Union[Mapping[str, Any], RunRecord]) -> dict[str, Path]:
    """Write report.json, the PNG plots and report.md into ``output_dir`` (each file atomically)."""
    if isinstance(facts, RunRecord):
        facts = facts.to_dict()
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    plots = write_plots(output_dir, facts)
    data = dict(_json_safe(dict(facts)))
    data["plots"] = plots
    if not plots:
        data["plots_skipped"] = PLOTS_SKIPPED
        logger.warning(PLOTS_SKIPPED)
    paths = {"json": output_dir / "report.json", "markdown": output_dir / "report.md"}
    for path, text in (
        (paths["json"], json.dumps(data, indent=2) + "\n"),
        (paths["markdown"], render_markdown(facts, plots)),
    ):
        write_file(path, text)  # a kill leaves the old file or the new one, and a leftover the run folder knows
    paths.update({key: output_dir / name for key, name in plots.items()})
    return paths


def history_from_log(log_history: Sequence[Mapping[str, Any]], keys: Mapping[str, str]) -> list[dict[str, Any]]:
    """Per-step records from a Trainer's ``state.log_history``, renaming logged keys via ``keys``.

    ``keys`` maps a logged key to a report key (e.g. ``{"loss": "loss", "taper/gate": "gate"}``);
    entries without any of them (the final train summary, eval records) are skipped.
    """
    records = []
    for entry in log_history:
        record = {report_key: entry[logged] for logged, report_key in keys.items() if logged in entry}
        if record and "step" in entry:
            record["step"] = entry["step"]
            records.append(record)
    return records
