"""Reproduce the paper's from-scratch setting (docs/method.md, sections 2, 4, 6) at CPU scale.

Small Llama-style (RMSNorm, SwiGLU, RoPE) and GPT-2-style (LayerNorm) models are trained from
scratch on the standard library's Python sources, read byte by byte (a 256-symbol vocabulary keeps
the models tiny, so the whole grid fits a 2-core CPU), in the paper's four variants and one ablation:

- Baseline: the normalized model, untouched;
- Internal-Taper(+aux): every norm inside the blocks tapers to g = 0, the final norm is kept, and
  the fixed-target scale loss is on;
- All-Taper(+aux): the final norm tapers too (a norm-free model), scale loss on;
- All-Taper (no aux): the same without the scale loss, to expose "logit chasing";
- Baseline(+aux), no taper (not in the paper): every norm kept, the scale loss on from k_start, to
  separate what the scale anchor does to optimization from what tapering does.

Pre-training recipe (docs/method.md, section 2): the learning-rate warmup and the gate's k_start are both 5% of the
steps, the gate reaches exactly 0 at the last step. The report (Markdown + JSON + PNG) gives the
held-out cross-entropy per variant (mean and spread over seeds), the gap to the baseline in %
(paper, TinyStories: Internal-Taper +0.71% to +1.52%, All-Taper +0.78% to +1.82%), and the scale of
the residual stream entering the final norm over training, with and without the anchor.

    python -m conversion_scripts.experiments.from_scratch \
        --out conversion_scripts/experiments/reports/from_scratch

Each finished run is cached as JSON under ``<out>/runs`` (keyed by its settings), so a grid can be
split across processes (``--archs llama`` / ``--archs gpt2`` with ``--no-report``) and a final
call without ``--no-report`` only aggregates. No checkpoints are written.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, PretrainedConfig
from transformers.optimization import get_cosine_schedule_with_warmup

from hf_tapernorm import TaperController, TaperDivergenceError, TaperNormConfig, patch_model
from hf_tapernorm.architectures import architecture_of, norm_sites
from hf_tapernorm.data import embedded_corpus_files, stdlib_directory
from hf_tapernorm.layers import set_gate
from hf_tapernorm.training import TaperSchedule

logger = logging.getLogger("from_scratch")

VOCAB_SIZE = 256  # bytes
PAPER_BANDS = {"internal_taper_aux": (0.71, 1.52), "all_taper_aux": (0.78, 1.82)}


# ---------------------------------------------------------------------------------------- variants
@dataclass(frozen=True)
class Variant:
    key: str
    label: str
    scope: Optional[str]  # None: the unpatched, normalized baseline
    scale_loss_weight: float
    taper: bool = True  # False: the gate is held at 1 (the scale loss alone, an ablation)


VARIANTS: dict[str, Variant] = {
    v.key: v
    for v in (
        Variant("baseline", "Baseline", None, 0.0),
        Variant("internal_taper_aux", "Internal-Taper(+aux)", "internal", 0.1),
        Variant("all_taper_aux", "All-Taper(+aux)", "all", 0.1),
        Variant("all_taper_noaux", "All-Taper (no aux)", "all", 0.0),
        # Not in the paper: every norm kept (g = 1 throughout), the scale loss on from k_start. It
        # separates what the scale anchor does to optimization from what tapering does.
        Variant("baseline_aux", "Baseline(+aux), no taper", "internal", 0.1, taper=False),
    )
}
ARCHS = ("llama", "gpt2")


# -------------------------------------------------------------------------------------------- data
@dataclass
class Corpus:
    """Byte streams of the training and held-out files (disjoint sets of files)."""

    train: torch.Tensor
    valid: torch.Tensor
    files: int


def load_corpus(train_bytes: int, valid_bytes: int, *, valid_every: int = 10, root: Optional[Path] = None) -> Corpus:
    """Deterministic split by file: every ``valid_every``-th sorted file is held out."""
    train, valid = bytearray(), bytearray()
    used = 0
    for index, path in enumerate(embedded_corpus_files(root)):
        if len(train) >= train_bytes and len(valid) >= valid_bytes:
            break
        held_out = index % valid_every == 0
        target, limit = (valid, valid_bytes) if held_out else (train, train_bytes)
        if len(target) >= limit:
            continue
        target += path.read_bytes() + b"\n"
        used += 1
    if len(train) < train_bytes or len(valid) < valid_bytes:
        raise ValueError(
            f"from_scratch: the corpus has only {len(train)} training and {len(valid)} held-out bytes, "
            f"{train_bytes} and {valid_bytes} requested; lower --train-bytes/--valid-bytes"
        )

    def tokens(data: bytearray, n: int) -> torch.Tensor:
        return torch.frombuffer(bytearray(data[:n]), dtype=torch.uint8).long()

    return Corpus(tokens(train, train_bytes), tokens(valid, valid_bytes), used)


def validation_blocks(corpus: Corpus, seq_len: int, count: int) -> torch.Tensor:
    """``count`` consecutive, non-overlapping held-out blocks (the same for every run)."""
    needed = count * seq_len
    if corpus.valid.numel() < needed:
        raise ValueError(f"from_scratch: {count} validation blocks of {seq_len} need {needed} held-out bytes")
    return corpus.valid[:needed].view(count, seq_len)


def training_batches(tokens: torch.Tensor, steps: int, batch_size: int, seq_len: int, seed: int):
    """Random windows of the training stream; the order depends on the seed only."""
    generator = torch.Generator().manual_seed(10_000 + seed)
    span = tokens.numel() - seq_len
    offsets = torch.arange(seq_len)
    for _ in range(steps):
        starts = torch.randint(0, span, (batch_size,), generator=generator)
        yield tokens[starts[:, None] + offsets]


# ------------------------------------------------------------------------------------------ models
def model_config(arch: str, hidden: int, layers: int, heads: int, seq_len: int) -> PretrainedConfig:
    """A small config of each family; the MLP width follows each family's convention."""
    if arch == "llama":
        intermediate = 32 * math.ceil(8 * hidden / 3 / 32)  # SwiGLU's ~8/3 width, rounded to 32
        return LlamaConfig(
            vocab_size=VOCAB_SIZE,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            max_position_embeddings=seq_len,
            bos_token_id=None,
            eos_token_id=None,
        )
    if arch == "gpt2":
        return GPT2Config(
            vocab_size=VOCAB_SIZE,
            n_embd=hidden,
            n_layer=layers,
            n_head=heads,
            n_positions=seq_len,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=None,
            eos_token_id=None,
        )
    raise ValueError(f"from_scratch: unknown architecture {arch!r}; choose from {', '.join(ARCHS)}")


def final_norm_path(model: torch.nn.Module) -> str:
    arch = architecture_of(model)
    return next(site.path for site in norm_sites(model, arch) if site.is_final)


def watch_prelogit_scale(model: torch.nn.Module, centred: bool) -> tuple[list[float], Callable[[], None]]:
    """Record, on every training forward, the token-mean scale of the final norm's input.

    The scale is r(h) for RMS models and sigma for LayerNorm models: the quantity the scale loss
    anchors, so the curves of every variant (baseline included) are comparable.
    """
    values: list[float] = []

    def hook(module, args):
        if module.training:
            with torch.no_grad():
                h = args[0].detach().float()
                if centred:
                    h = h - h.mean(-1, keepdim=True)
                values.append(float(h.pow(2).mean(-1).sqrt().mean()))

    handle = model.get_submodule(final_norm_path(model)).register_forward_pre_hook(hook)
    return values, handle.remove


@torch.no_grad()
def validation_loss(model: torch.nn.Module, blocks: torch.Tensor, batch_size: int) -> float:
    """Plain next-byte cross-entropy (nats per byte), token-weighted over all held-out blocks."""
    was_training = model.training
    model.eval()
    total = 0.0
    for start in range(0, blocks.shape[0], batch_size):
        chunk = blocks[start : start + batch_size]
        total += float(model(input_ids=chunk, labels=chunk).loss) * chunk.shape[0]
    model.train(was_training)
    return total / blocks.shape[0]


# ------------------------------------------------------------------------------------------- a run
@dataclass(frozen=True)
class RunSettings:
    """Everything that determines a run's result (the cache key)."""

    arch: str
    variant: str
    seed: int
    steps: int
    batch_size: int
    seq_len: int
    hidden: int
    layers: int
    heads: int
    lr: float
    weight_decay: float
    clip: float
    ema_rate: float
    warmup_fraction: float
    train_bytes: int
    valid_bytes: int
    valid_blocks: int
    eval_every: int

    @property
    def name(self) -> str:
        return f"{self.arch}_{self.variant}_seed{self.seed}"


def train_run(settings: RunSettings, corpus: Corpus) -> dict:
    """Train one model from scratch and return its curves and final held-out loss."""
    variant = VARIANTS[settings.variant]
    torch.manual_seed(settings.seed)
    config = model_config(settings.arch, settings.hidden, settings.layers, settings.heads, settings.seq_len)
    model = AutoModelForCausalLM.from_config(config)
    model.train()
    warmup = max(1, round(settings.warmup_fraction * settings.steps))
    controller = None
    if variant.scope is not None:
        patch_model(
            model,
            TaperNormConfig.paper(
                scope=variant.scope, ema_rate=settings.ema_rate, scale_loss_weight=variant.scale_loss_weight
            ),
        )
        # docs/method.md, section 2, pre-training recipe: k_start = LR warmup, k_end = the last step. The scale watch
        # is off (an infinite ratio): without the anchor the pre-logit scale is meant to run away here,
        # and that growth is what the experiment measures; a non-finite loss still stops the run.
        schedule = TaperSchedule(k_start=warmup, k_end=settings.steps, total_steps=settings.steps)
        controller = TaperController(model, schedule, max_scale_ratio=math.inf)
    scales, unwatch = watch_prelogit_scale(model, centred=settings.arch == "gpt2")
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=settings.lr, betas=(0.9, 0.95), weight_decay=settings.weight_decay
    )
    lr_schedule = get_cosine_schedule_with_warmup(optimizer, warmup, settings.steps)
    blocks = validation_blocks(corpus, settings.seq_len, settings.valid_blocks)

    curve = {"step": [], "ce": [], "aux": [], "gate": [], "grad_norm": []}
    evals = {"step": [], "valid_loss": [], "gate": []}
    started = time.perf_counter()
    batches = training_batches(corpus.train, settings.steps, settings.batch_size, settings.seq_len, settings.seed)
    progress = tqdm(batches, total=settings.steps, desc=settings.name, mininterval=20, leave=False)
    diverged = None
    try:
        for step, batch in enumerate(progress):
            gate = controller.step_begin(step) if controller is not None else 1.0
            if controller is not None and not variant.taper:
                set_gate(model, 1.0)  # calibration and the scale target still happen at k_start
                gate = 1.0
            outputs = model(input_ids=batch, labels=batch)
            loss = float(outputs.loss.detach())  # cross-entropy plus, when active, the scale loss
            outputs.loss.backward()
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), settings.clip))
            optimizer.step()
            lr_schedule.step()
            optimizer.zero_grad(set_to_none=True)
            aux = 0.0
            if controller is not None:
                controller.step_end(step)
                aux = controller.log_metrics().get("taper/scale_loss", 0.0)
            if not math.isfinite(loss):
                raise TaperDivergenceError(f"{settings.name}: the loss is not finite at step {step + 1} (gate {gate})")
            for key, value in zip(curve, (step + 1, loss - aux, aux, gate, grad_norm)):
                curve[key].append(value)
            if (step + 1) % settings.eval_every == 0 and step + 1 < settings.steps:
                evals["step"].append(step + 1)
                evals["valid_loss"].append(validation_loss(model, blocks, settings.batch_size))
                evals["gate"].append(gate)
            progress.set_postfix(ce=f"{loss - aux:.3f}", g=f"{gate:.3f}", refresh=False)
    except TaperDivergenceError as error:  # a result of the experiment, not a crash of the grid
        diverged = str(error)
        logger.warning("%s diverged: %s", settings.name, error)
    final_gate = controller.gate if controller is not None and variant.taper else 1.0
    final = validation_loss(model, blocks, settings.batch_size) if diverged is None else math.nan
    evals["step"].append(len(curve["step"]))
    evals["valid_loss"].append(final)
    evals["gate"].append(final_gate)
    unwatch()
    seconds = time.perf_counter() - started
    logger.info("%s: held-out CE %.4f at g=%g (%.0f s)", settings.name, final, final_gate, seconds)
    return {
        "settings": asdict(settings),
        "parameters": sum(p.numel() for p in model.parameters()),
        "valid_loss": final,
        "final_gate": final_gate,
        "diverged": diverged,
        "seconds": seconds,
        "curve": curve,
        "prelogit_scale": scales,
        "evals": evals,
    }


# ---------------------------------------------------------------------------------------- the grid
def run_grid(grid: Sequence[RunSettings], corpus: Corpus, cache: Path) -> list[dict]:
    """Run every setting not already cached with identical settings; return all results."""
    cache.mkdir(parents=True, exist_ok=True)
    results = []
    for settings in tqdm(grid, desc="from-scratch grid"):
        path = cache / f"{settings.name}.json"
        if path.exists():
            cached = json.loads(path.read_text())
            if cached.get("settings") == asdict(settings):
                results.append(cached)
                continue
        result = train_run(settings, corpus)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        tmp.replace(path)
        results.append(result)
    return results


def summarize(results: Sequence[dict]) -> dict:
    """Per architecture and variant: held-out CE mean/spread and the gap to the baseline in %."""
    summary: dict[str, dict] = {}
    for arch in dict.fromkeys(r["settings"]["arch"] for r in results):
        runs = [r for r in results if r["settings"]["arch"] == arch]
        by_variant = {
            key: {r["settings"]["seed"]: r["valid_loss"] for r in runs if r["settings"]["variant"] == key}
            for key in VARIANTS
        }
        base = by_variant["baseline"]
        arch_summary = {}
        for key, losses in by_variant.items():
            if not losses:
                continue
            values = [losses[s] for s in sorted(losses)]
            entry = {
                "label": VARIANTS[key].label,
                "seeds": sorted(losses),
                "valid_loss": values,
                "mean": statistics.fmean(values),
                "std": statistics.stdev(values) if len(values) > 1 else 0.0,
                "min": min(values),
                "max": max(values),
            }
            if key != "baseline" and base:
                paired = [100.0 * (losses[s] / base[s] - 1.0) for s in sorted(losses) if s in base]
                entry["gap_pct_of_means"] = 100.0 * (entry["mean"] / statistics.fmean(base.values()) - 1.0)
                entry["gap_pct_paired"] = paired
                entry["gap_pct_paired_mean"] = statistics.fmean(paired) if paired else None
                entry["gap_pct_paired_std"] = statistics.stdev(paired) if len(paired) > 1 else 0.0
                if key in PAPER_BANDS:
                    low, high = PAPER_BANDS[key]
                    gap = entry["gap_pct_of_means"]
                    entry["paper_band_pct"] = [low, high]
                    entry["vs_paper_band"] = "below" if gap < low else "above" if gap > high else "within"
            entry["diverged"] = sum(
                1 for r in runs if r["settings"]["variant"] == key and r.get("diverged") is not None
            )
            entry.update(_scale_growth([r for r in runs if r["settings"]["variant"] == key]))
            arch_summary[key] = entry
        summary[arch] = arch_summary
    return summary


def _scale_growth(runs: Sequence[dict]) -> dict:
    """Pre-logit scale at k_start (when the scale target freezes) and at the last step, seed means.

    Their ratio is the logit-chasing measure: how far the final norm's input drifted once the
    anchor (if any) took over.
    """
    pairs = []
    for r in runs:
        scales = r["prelogit_scale"]
        k_start = max(1, round(r["settings"]["warmup_fraction"] * r["settings"]["steps"]))
        if len(scales) >= k_start:
            pairs.append((scales[k_start - 1], scales[-1]))
    if not pairs:
        return {}
    at_start = statistics.fmean(p[0] for p in pairs)
    last = statistics.fmean(p[1] for p in pairs)
    return {
        "prelogit_scale_at_k_start": at_start,
        "prelogit_scale_last": last,
        "prelogit_scale_growth": statistics.fmean(p[1] / p[0] for p in pairs),
    }


# -------------------------------------------------------------------------------------------- report
def _mean_curve(series: Sequence[Sequence[float]]) -> tuple[list[float], list[float], list[float]]:
    length = min(len(s) for s in series)
    columns = [[s[i] for s in series] for i in range(length)]
    return [statistics.fmean(c) for c in columns], [min(c) for c in columns], [max(c) for c in columns]


def write_plots(results: Sequence[dict], summary: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    archs = list(summary)
    colours = dict(zip(VARIANTS, ("black", "tab:blue", "tab:green", "tab:red", "tab:purple")))
    written = []

    fig, axes = plt.subplots(1, len(archs), figsize=(6 * len(archs), 4.2), squeeze=False)
    for ax, arch in zip(axes[0], archs):
        ax2 = ax.twinx()
        for key in VARIANTS:
            runs = [r for r in results if r["settings"]["arch"] == arch and r["settings"]["variant"] == key]
            if not runs:
                continue
            mean, low, high = _mean_curve([r["prelogit_scale"] for r in runs])
            steps = range(1, len(mean) + 1)
            ax.plot(steps, mean, color=colours[key], label=VARIANTS[key].label)
            ax.fill_between(steps, low, high, color=colours[key], alpha=0.15)
            if key == "all_taper_noaux":
                ax2.plot(steps, runs[0]["curve"]["gate"][: len(mean)], color="grey", ls=":", label="gate g")
        ax.set_yscale("log")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("scale of the final norm's input (r or sigma)")
        ax2.set_ylabel("gate g")
        ax2.set_ylim(0, 1.05)
        ax.set_title(f"{arch}: pre-logit scale (mean, min-max over seeds)")
        lines = ax.get_legend_handles_labels()
        lines2 = ax2.get_legend_handles_labels()
        ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=8, loc="lower center")
    fig.tight_layout()
    fig.savefig(out / "prelogit_scale.png", dpi=110)
    plt.close(fig)
    written.append("prelogit_scale.png")

    fig, axes = plt.subplots(1, len(archs), figsize=(6 * len(archs), 4.2), squeeze=False)
    for ax, arch in zip(axes[0], archs):
        for key in VARIANTS:
            runs = [r for r in results if r["settings"]["arch"] == arch and r["settings"]["variant"] == key]
            if not runs:
                continue
            mean, low, high = _mean_curve([r["evals"]["valid_loss"] for r in runs])
            steps = runs[0]["evals"]["step"][: len(mean)]
            ax.plot(steps, mean, marker="o", ms=3, color=colours[key], label=VARIANTS[key].label)
            ax.fill_between(steps, low, high, color=colours[key], alpha=0.15)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("held-out CE (nats/byte)")
        ax.set_title(f"{arch}: held-out loss (mean, min-max over seeds)")
        ax.legend(fontsize=8)
        finals = [v for e in summary[arch].values() for v in e["valid_loss"] if math.isfinite(v)]
        if finals:  # zoom on the final losses; early evaluations above the frame are cut
            ax.set_ylim(min(finals) * 0.97, max(finals) * 1.25)
    fig.tight_layout()
    fig.savefig(out / "validation_loss.png", dpi=110)
    plt.close(fig)
    written.append("validation_loss.png")
    return written


def write_report(
    results: Sequence[dict], out: Path, command: str, corpus_note: str, notes: Optional[str] = None
) -> dict:
    summary = summarize(results)
    plots = write_plots(results, summary, out)
    settings = results[0]["settings"]
    shared = {k: v for k, v in settings.items() if k not in ("arch", "variant", "seed")}
    report = {
        "command": command,
        "corpus": corpus_note,
        "settings": shared,
        "parameters": {a: next(r["parameters"] for r in results if r["settings"]["arch"] == a) for a in summary},
        "seconds_total": sum(r["seconds"] for r in results),
        "summary": summary,
        "plots": plots,
        "runs": [
            {k: r[k] for k in ("settings", "valid_loss", "final_gate", "diverged", "seconds", "evals")}
            | {"prelogit_scale_every_10": r["prelogit_scale"][::10]}
            for r in results
        ],
    }
    (out / "report.json").write_text(json.dumps(report, indent=1))
    markdown = _markdown(report)
    if notes:
        markdown += "\n## Reading\n\n" + notes.strip() + "\n"
    (out / "report.md").write_text(markdown)
    return report


def _markdown(report: dict) -> str:
    s = report["settings"]
    lines = [
        "# From-scratch reproduction at CPU scale (issue 8, part 3)",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Data: {report['corpus']}. Models: {s['layers']} layers, hidden {s['hidden']}, {s['heads']} heads, "
        f"context {s['seq_len']}, vocabulary 256 (bytes); parameters "
        + ", ".join(f"{a} {n:,}" for a, n in report["parameters"].items())
        + ".",
        f"Training: {s['steps']} steps x {s['batch_size']} x {s['seq_len']} tokens, AdamW lr {s['lr']} "
        f"(betas 0.9/0.95, weight decay {s['weight_decay']}), clip {s['clip']}, linear warmup "
        f"{s['warmup_fraction']:.0%} then cosine to 0. Gate: k_start = warmup, k_end = last step "
        f"(docs/method.md, section 2), mu_ema = {s['ema_rate']}, scale loss lambda = 0.1 where on. Held-out CE on "
        f"{s['valid_blocks']} blocks, at g = 0 for the tapered variants. Summed wall-clock time of the "
        f"runs {report['seconds_total'] / 60:.1f} min (one thread each, on a shared CPU).",
        "",
        "| arch | variant | held-out CE mean | std | min-max | gap vs baseline (of means) | paired gap mean +/- std "
        "| paper band | pre-logit scale at k_start -> last step (growth) | diverged |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arch, variants in report["summary"].items():
        for e in variants.values():
            gap = f"{e['gap_pct_of_means']:+.2f}%" if "gap_pct_of_means" in e else "-"
            paired = (
                f"{e['gap_pct_paired_mean']:+.2f}% +/- {e['gap_pct_paired_std']:.2f}"
                if e.get("gap_pct_paired_mean") is not None
                else "-"
            )
            band = (
                f"+{e['paper_band_pct'][0]}..+{e['paper_band_pct'][1]}% ({e['vs_paper_band']})"
                if "paper_band_pct" in e
                else "-"
            )
            scale = (
                f"{e['prelogit_scale_at_k_start']:.3g} -> {e['prelogit_scale_last']:.3g} "
                f"({e['prelogit_scale_growth']:.2f}x)"
                if "prelogit_scale_growth" in e
                else "-"
            )
            lines.append(
                f"| {arch} | {e['label']} | {e['mean']:.4f} | {e['std']:.4f} | {e['min']:.4f}-{e['max']:.4f} "
                f"| {gap} | {paired} | {band} | {scale} | {e['diverged']}/{len(e['seeds'])} |"
            )
    lines += [
        "",
        "![pre-logit scale](prelogit_scale.png)",
        "",
        "![held-out loss](validation_loss.png)",
        "",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--out", type=Path, default=Path("conversion_scripts/experiments/reports/from_scratch"))
    p.add_argument("--archs", nargs="+", choices=ARCHS, default=list(ARCHS))
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=12)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--ema-rate", type=float, default=0.1, help="mu_ema; 0.1 because the warmup is short")
    p.add_argument("--warmup-fraction", type=float, default=0.05, help="LR warmup = gate k_start")
    p.add_argument("--train-bytes", type=int, default=4_000_000)
    p.add_argument("--valid-bytes", type=int, default=200_000)
    p.add_argument("--valid-blocks", type=int, default=64)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--corpus-root", type=Path, default=None, help="a folder of .py files (default: the stdlib)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-report", action="store_true", help="only run (and cache) the requested runs")
    p.add_argument("--notes", type=Path, default=None, help="a Markdown file appended to report.md as 'Reading'")
    return p


def main(argv: Optional[Sequence[str]] = None) -> Optional[dict]:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(args.threads)
    corpus = load_corpus(args.train_bytes, args.valid_bytes, root=args.corpus_root)
    root = args.corpus_root or stdlib_directory()
    corpus_note = (
        f"Python standard library sources under `{root.name}` (sorted .py files, site-packages excluded, "
        f"every 10th file held out; {args.train_bytes:,} training bytes and {args.valid_bytes:,} held-out "
        f"bytes from the first {corpus.files} files), byte-level tokens"
    )
    grid = [
        RunSettings(
            arch=arch,
            variant=variant,
            seed=seed,
            steps=args.steps,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            hidden=args.hidden,
            layers=args.layers,
            heads=args.heads,
            lr=args.lr,
            weight_decay=args.weight_decay,
            clip=args.clip,
            ema_rate=args.ema_rate,
            warmup_fraction=args.warmup_fraction,
            train_bytes=args.train_bytes,
            valid_bytes=args.valid_bytes,
            valid_blocks=args.valid_blocks,
            eval_every=args.eval_every,
        )
        for arch in args.archs
        for seed in args.seeds
        for variant in args.variants
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    results = run_grid(grid, corpus, args.out / "runs")
    if args.no_report:
        return None
    command = "python -m conversion_scripts.experiments.from_scratch " + " ".join(
        argv if argv is not None else __import__("sys").argv[1:]
    )
    notes = args.notes.read_text() if args.notes is not None else None
    report = write_report(results, args.out, command.strip(), corpus_note, notes)
    logger.info("report written to %s", args.out / "report.md")
    return report


if __name__ == "__main__":
    main()
