#!/usr/bin/env python
"""The fidelity harness: recipe arms x seeds through ``hf-tapernorm taper``, one table of gaps.

Every arm runs the CLI with the demo's budget (or ``--steps``) plus its own flags. One normalized
baseline per seed is trained once, by the ``default`` arm's ``--baseline`` run, saved in its
``baseline/model``, and reused by every arm whose learning-rate schedule is the same
(``--baseline_from``); an arm that changes the schedule (another LR policy, another taper window, which
moves the WSD decay) trains its own. Runs go into ``<root>/steps<N>/<arm>/seed<S>``; a finished run is
skipped, an interrupted one continues with ``--resume``, so the harness can be stopped and started again.
Up to ``--jobs`` runs at a time, each with one thread (``OMP_NUM_THREADS=1``). A run that finishes
loses its ``checkpoint-*`` folders (its baseline's too), which hold the optimizer's state and are only
needed to resume it; its scores, models and baseline stay (``--keep_checkpoints`` keeps them all).

Every model is scored on the same held-out and out-of-corpus blocks by the CLI's own evaluation (the
run's report) and the table goes to
``<root>/steps<N>/table.md`` and ``table.json``: per arm, the gap of the tapered and the folded model to
the baseline on each seed, their mean and spread, the out-of-corpus gap and the KL to the original,
and the command of every run::

    python -m conversion_scripts.experiments.fidelity_matrix --steps 150 --seeds 42 7 \\
        --arms default no_distill kl_0.1 --jobs 2
    python -m conversion_scripts.experiments.fidelity_matrix --root runs/fidelity --steps 150 --table_only

The ``cpu`` preset trains in fp32 whatever the CPU (every CPU figure before bf16 was measured so), ``cpu_bf16``
the same budget under bf16 autocast (what ``taper`` trains by default on a CPU with fast bf16); each preset
but ``cpu`` keeps its runs under ``runs/fidelity_<preset>``, so two presets never share a run folder.
``--preset gpu`` sizes the same matrix for one large accelerator (bf16, sequences of 512, at least 25M
tokens per arm, shortened to fit ``--time_budget_s``); the test suite runs it at toy size on a tiny local
model (``--steps`` and the model's flags override the preset's).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

logger = logging.getLogger("fidelity_matrix")


@dataclass(frozen=True)
class Arm:
    """One recipe variant: CLI flags on top of the defaults; ``own_baseline`` when it changes the LR schedule."""

    flags: tuple[str, ...] = ()
    own_baseline: bool = False
    about: str = ""
    script: Optional[str] = None  # a module that takes the taper options, run instead of hf-tapernorm taper
    baseline_of: str = "default"  # the arm whose baseline this one reads when it has none of its own


#: The script of the arms that train on other lengths or positions (options the product does not offer).
LENGTH_ARMS = "conversion_scripts.experiments.length_arms"

#: The script of the arms that set the recipe's experimental options (the taper command has no flag for them).
EXPERIMENTAL_TAPER = "conversion_scripts.experiments.experimental_taper"

#: The gated-MLP norms alone: the default's keep_norms before the runaway layers' attention norms joined it.
GATED_MLP_NORMS = ("--keep_norms", "model.layers.*.post_attention_layernorm")

#: The default before the final norm joined it (the final norm kept, so the term at weight 1): the recipe every
#: arm below but the final-norm ones varies, pinned so that their recorded commands still run what they measured.
INTERNAL = ("--scope", "internal")

ARMS: dict[str, Arm] = {
    "default": Arm(
        (),
        True,
        "every option at its default: the final norm tapered and folded too, the runaway layers' attention norms "
        "kept, the sink-attention term at weight 3 (trains the seed's baseline)",
    ),
    "internal": Arm(
        INTERNAL,
        False,
        "the default before the final norm joined it: the final norm kept, the sink-attention term at weight 1",
    ),
    "no_runaway_remedy": Arm(
        (*INTERNAL, *GATED_MLP_NORMS, "--sink_attention_weight", "0"),
        False,
        "the default before the remedy: only the gated-MLP norms kept, no sink-attention term",
    ),
    "keep_attn_4_13": Arm(
        (*INTERNAL, "--sink_attention_weight", "0"),
        False,
        "the default without the sink-attention term (layers 4-13 kept)",
    ),
    "keep_attn_0_13": Arm(
        (
            *INTERNAL,
            "--keep_norms",
            "model.layers.*.post_attention_layernorm,model.layers.[0-9].input_layernorm,"
            "model.layers.1[0-3].input_layernorm",
        ),
        False,
        "the default with the attention input norms of layers 0-3 kept too (layers 0-13; the term at weight 1); "
        "worse at 600 steps on both seeds (docs/fidelity.md)",
    ),
    "block_256": Arm(
        (
            *INTERNAL,
            "--block_size",
            "256",
            "--per_device_train_batch_size",
            "1",
            "--heldout_blocks",
            "128",
            "--out_of_corpus_blocks",
            "128",
        ),
        True,
        "the default on 256-token blocks, one per step (the same tokens per step as 2 x 128), against its own "
        "baseline trained the same way; 128 blocks of each evaluation set (the same tokens as 256 x 128)",
    ),
    "long_512_every_8": Arm(
        (*INTERNAL, "--long_block_size", "512", "--long_block_every", "8"),
        True,
        "the default with every 8th step on blocks of 512 tokens (2 per step, 37.5% more tokens in all), against "
        "its own baseline trained the same way: the taper sees the positions of 4x the block length",
        script=LENGTH_ARMS,
    ),
    "long_1024_every_16": Arm(
        (*INTERNAL, "--long_block_size", "1024", "--long_block_every", "16"),
        True,
        "the default with every 16th step on blocks of 1024 tokens (2 per step, 42% more tokens in all), against "
        "its own baseline trained the same way: the taper sees the positions of 8x the block length",
        script=LENGTH_ARMS,
    ),
    "position_span_1024": Arm(
        (*INTERNAL, "--position_span", "1024"),
        True,
        "the default with each training block's positions spread over 1024 (PoSE: two random skips, the tokens "
        "unchanged), against its own baseline trained on the same positions: the distances of 8x the block length "
        "at no extra tokens",
        script=LENGTH_ARMS,
    ),
    "final_norm": Arm(
        ("--scope", "all", "--sink_attention_weight", "1"),
        True,
        "the default with the final norm tapered and folded too (the relative scale anchor; a tied head is untied), "
        "against its own baseline trained the same way",
    ),
    "final_norm_fixed_anchor": Arm(
        ("--scope", "all", "--sink_attention_weight", "1", "--relative_scale_loss", "false"),
        False,
        "final_norm with the paper's fixed-target scale loss instead of the relative one (the scale loss is no "
        "part of a baseline, so it reads final_norm's)",
        baseline_of="final_norm",
    ),
    "final_norm_sink_3": Arm(
        ("--scope", "all", "--sink_attention_weight", "3"),
        False,
        "final_norm with the sink-attention term at weight 3: seed 42's break is the sink losing its share of "
        "attention past the band, which the term at weight 1 did not hold (the term is no part of a baseline, so "
        "it reads final_norm's)",
        baseline_of="final_norm",
    ),
    "sink_attention": Arm(
        (*INTERNAL, *GATED_MLP_NORMS),
        False,
        "the default without the runaway layers' attention norms (the term at weight 1)",
    ),
    "all_attention": Arm(
        GATED_MLP_NORMS,
        False,
        "the default without the runaway layers' attention norms: every attention input norm and the final norm "
        "tapered and folded (31 of 61 on SmolLM2), the sink-attention term at weight 3; misses the length target "
        "and breaks unseen windows at 600 steps on seed 42 (docs/fidelity.md)",
    ),
    "sink_attention_0.3": Arm(
        (*INTERNAL, *GATED_MLP_NORMS, "--sink_attention_weight", "0.3"),
        False,
        "the sink_attention arm with the term at weight 0.3",
    ),
    "no_distill": Arm((*INTERNAL, "--distill_weight", "0"), False, "no distillation term (so no sink-attention term)"),
    "kl_0.1": Arm((*INTERNAL, "--distill_weight", "0.1"), False, "KL weight 0.1"),
    "kl_0.3": Arm((*INTERNAL, "--distill_weight", "0.3"), False, "KL weight 0.3"),
    "kl_3": Arm((*INTERNAL, "--distill_weight", "3"), False, "KL weight 3"),
    "kl_until_taper_end": Arm(
        (*INTERNAL, "--distill_until", "taper_end"), False, "the KL term only while the gate falls"
    ),
    "kl_fades_with_gate": Arm(
        (*INTERNAL, "--distill_schedule", "gate"),
        False,
        "KL weight times the gate (0 at g = 0; an experimental option)",
        script=EXPERIMENTAL_TAPER,
    ),
    "no_scale_loss": Arm((*INTERNAL, "--scale_loss_weight", "0"), False, "scale loss off"),
    "constant_lr": Arm((*INTERNAL, "--lr_scheduler_type", "constant_with_warmup"), True, "constant LR after warmup"),
    "half_lr": Arm(
        (*INTERNAL, "--learning_rate", "5e-5"),
        True,
        "the default at half the peak LR, against its own baseline trained the same way: at 600 steps the gate "
        "falls over twice the steps of a 300-step run while the weights move about as far",
    ),
    "long_taper": Arm(
        (*INTERNAL, "--taper_start", "0.05", "--taper_end", "0.9"), True, "taper from 5% to 90% of the run"
    ),
    "short_taper": Arm(
        (*INTERNAL, "--taper_end", "0.5"),
        True,
        "the gate reaches 0 at 50% of the run instead of 70%: half the run repairs at g = 0 with a decaying LR "
        "(against its own baseline, whose LR decays from the same step)",
    ),
    "kl_control": Arm(
        INTERNAL,
        False,
        "no taper: the default recipe with the gate held at 1 (its model in the tapered and folded columns)",
        script="conversion_scripts.experiments.kl_control",
    ),
}


@dataclass
class Preset:
    """The budget of every run: the arguments the CLI gets besides the arm's flags."""

    steps: int
    flags: tuple[str, ...]
    about: str
    extra_env: dict[str, str] = field(default_factory=dict)


#: The CPU presets' budget: 2 x 128 tokens per step, the embedded SmolLM2 and corpus.
CPU_BUDGET = ("--per_device_train_batch_size", "2", "--block_size", "128")

PRESETS: dict[str, Preset] = {
    # The demo's budget on a 2-core CPU, in fp32 whatever the CPU: every CPU figure before bf16 was measured so.
    "cpu": Preset(150, (*CPU_BUDGET, "--bf16", "false"), "embedded SmolLM2, CPU, fp32"),
    # The same under bf16 autocast: what taper trains by default on a CPU with fast bf16 (AMX, AVX-512 BF16).
    "cpu_bf16": Preset(150, (*CPU_BUDGET, "--bf16", "true"), "embedded SmolLM2, CPU, bf16 autocast"),
    # One H200: sequences of 512, 64 per step (32k tokens), bf16; 800 steps are 26M tokens per arm.
    "gpu": Preset(
        800,
        ("--per_device_train_batch_size", "64", "--block_size", "512", "--bf16", "--eval_batch_size", "32"),
        "embedded SmolLM2, one large GPU, bf16",
    ),
}


def run_folder(root: Path, steps: int, arm: str, seed: int) -> Path:
    return root / f"steps{steps}" / arm / f"seed{seed}"


def is_finished(folder: Path) -> bool:
    """Trained to its last step with its tapered checkpoint written (the scores need nothing else: see scores_of)."""
    report = folder / "report.json"
    if not report.is_file():
        return False
    facts = json.loads(report.read_text())
    if facts.get("status") == "finished":
        return True
    training = facts.get("training") or {}
    return (folder / "tapered").is_dir() and training.get("steps") == training.get("max_steps")


def without_options(flags: Sequence[str], overridden: Sequence[str]) -> list[str]:
    """``flags`` less the options ``overridden`` sets (each with its values, if any), so a command states each once."""
    taken = {flag for flag in overridden if flag.startswith("--")}
    kept: list[str] = []
    dropping = False
    for word in flags:
        if word.startswith("--"):
            dropping = word in taken
        if not dropping:
            kept.append(word)
    return kept


def command_for(
    root: Path, steps: int, arm_name: str, seed: int, preset_flags: tuple[str, ...], extra: list[str]
) -> list[str]:
    """The command line of one run (without ``--resume``): ``hf-tapernorm taper``, or the arm's script."""
    arm = ARMS[arm_name]
    folder = run_folder(root, steps, arm_name, seed)
    program = ["python", "-m", arm.script] if arm.script else ["hf-tapernorm", "taper"]
    command = [*program, "--output_dir", str(folder), "--max_steps", str(steps), "--seed", str(seed)]
    # Later layers win (preset < the caller's extra flags < the arm's); each option is written once.
    command += [*without_options(preset_flags, (*extra, *arm.flags)), *without_options(extra, arm.flags), *arm.flags]
    if arm.own_baseline:
        command.append("--baseline")
    else:
        command += ["--baseline_from", str(run_folder(root, steps, arm.baseline_of, seed))]
    return command


def launch(command: list[str], folder: Path, env: dict[str, str]) -> int:
    """Run one command (``--resume`` when an earlier attempt left its folder), logging to ``<folder>.log``."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    argv = (
        [sys.executable, *command[1:]]
        if command[0] == "python"
        else [sys.executable, "-m", "hf_tapernorm.cli", *command[1:]]
    )
    if folder.exists() and (folder / ".hf_tapernorm_run.json").exists():
        argv.append("--resume")
    log = folder.with_name(folder.name + ".log")
    started = time.time()
    with open(log, "a") as stream:
        stream.write(f"\n$ {' '.join(command)}\n")
        stream.flush()
        code = subprocess.call(argv, stdout=stream, stderr=subprocess.STDOUT, env=env)
    logger.info("%s: exit %d after %.0f s (log: %s)", folder, code, time.time() - started, log)
    return code


def remove_checkpoints(folder: Path) -> int:
    """Delete the finished run's ``checkpoint-*`` folders and its baseline's; the bytes freed.

    Only real folders whose resolved parent is the run folder (or its ``baseline/``) go: never a link.
    """
    freed = 0
    for parent in (folder, folder / "baseline"):
        if not parent.is_dir() or parent.is_symlink():
            continue
        for checkpoint in sorted(parent.glob("checkpoint-*")):
            if checkpoint.is_symlink() or not checkpoint.is_dir() or checkpoint.resolve().parent != parent.resolve():
                continue
            freed += sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file() and not f.is_symlink())
            shutil.rmtree(checkpoint)
    return freed


def run_matrix(
    root: Path,
    steps: int,
    arms: list[str],
    seeds: list[int],
    jobs: int,
    preset_flags,
    extra: list[str],
    keep_checkpoints: bool = False,
) -> None:
    """Every (arm, seed) not yet finished, the baselines first (the other arms of a seed read them)."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    todo = [(arm, seed) for arm in arms for seed in seeds if not is_finished(run_folder(root, steps, arm, seed))]
    first = [(arm, seed) for arm, seed in todo if ARMS[arm].own_baseline]
    later = [(arm, seed) for arm, seed in todo if not ARMS[arm].own_baseline]
    for source in sorted({ARMS[arm].baseline_of for arm, _ in later} - set(arms)):
        missing = [s for s in seeds if not is_finished(run_folder(root, steps, source, s))]
        if missing:
            readers = sorted({a for a, _ in later if ARMS[a].baseline_of == source})
            raise SystemExit(f"the arms {readers} read the {source} arm's baseline (seeds {missing}): run it first")

    def one(job):
        arm, seed = job
        folder = run_folder(root, steps, arm, seed)
        code = launch(command_for(root, steps, arm, seed, preset_flags, extra), folder, env)
        if code == 0 and is_finished(folder) and not keep_checkpoints:
            logger.info("%s: finished, %.1f GB of checkpoints removed", folder, remove_checkpoints(folder) / 1e9)
        return code

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        codes = list(pool.map(one, first))
        codes += list(pool.map(one, later))
    failed = [job for job, code in zip(first + later, codes) if code != 0]
    if failed:
        logger.warning("failed runs (see their logs): %s", failed)


# ----------------------------------------------------------------------------- scores
def scores_of(folder: Path) -> Optional[dict[str, Any]]:
    """The run's held-out and out-of-corpus scores, from its report (the CLI's own evaluation).

    A run whose report predates the out-of-corpus measure has no such scores, unless an earlier version of
    this harness scored it into ``evaluation.json``; without either it is left out of the table (rerun it).
    """
    report = json.loads((folder / "report.json").read_text())
    if report.get("out_of_corpus") and "baseline" in (report.get("heldout") or {}):
        return report
    cached = folder / "evaluation.json"
    if cached.is_file():
        return json.loads(cached.read_text())
    logger.warning("%s: its report has no baseline or out-of-corpus scores; rerun it to put it in the table", folder)
    return None


def _stats(values: list[float]) -> dict[str, Optional[float]]:
    if not values:
        return {"mean": None, "spread": None}
    return {"mean": statistics.fmean(values), "spread": (max(values) - min(values)) / 2 if len(values) > 1 else 0.0}


def _gap(value: Optional[float], reference: Optional[float]) -> Optional[float]:
    return None if value is None or not reference else value / reference - 1.0


def arm_rows(root: Path, steps: int, arms: list[str], seeds: list[int], preset_flags, extra) -> list[dict[str, Any]]:
    rows = []
    for arm in arms:
        per_seed = {}
        for seed in seeds:
            folder = run_folder(root, steps, arm, seed)
            if not is_finished(folder):
                continue
            report = scores_of(folder)
            if report is None:
                continue
            held, outside = report.get("heldout") or {}, report.get("out_of_corpus") or {}
            broken = (report.get("heldout_documents") or {}).get("broken_blocks")
            outside_broken = (report.get("out_of_corpus_blocks") or {}).get("broken_blocks")
            loss = {k: v.get("loss") for k, v in held.items()}
            ooc = {k: v.get("loss") for k, v in outside.items()}
            kl = {k: v.get("kl") for k, v in outside.items()}
            control = "control" in loss  # a control (kl_control.py) has one model where a run has two
            for scores in (loss, ooc, kl) if control else ():
                scores["tapered"] = scores["folded"] = scores.pop("control")
            per_seed[seed] = {
                "heldout": loss,
                "out_of_corpus": ooc,
                "out_of_corpus_kl": kl,
                "tapered_vs_baseline": _gap(loss.get("tapered"), loss.get("baseline")),
                "folded_vs_baseline": _gap(loss.get("folded"), loss.get("baseline")),
                "folded_vs_tapered": None if control else _gap(loss.get("folded"), loss.get("tapered")),
                "ooc_folded_vs_baseline": _gap(ooc.get("folded"), ooc.get("baseline")),
                "ooc_folded_vs_original": _gap(ooc.get("folded"), ooc.get("original")),
                "final_gate": (report.get("training") or {}).get("final_gate"),
                "broken_blocks": len(broken["blocks"]) if broken else None,  # None: a report without the count
                "gap_without_broken": broken.get("gap_without") if broken else None,
                "ooc_broken_blocks": len(outside_broken["blocks"]) if outside_broken else None,
            }
        keys = (
            "tapered_vs_baseline",
            "folded_vs_baseline",
            "folded_vs_tapered",
            "ooc_folded_vs_baseline",
            "gap_without_broken",
        )
        rows.append(
            {
                "arm": arm,
                "about": ARMS[arm].about,
                "seeds": per_seed,
                **{key: _stats([r[key] for r in per_seed.values() if r[key] is not None]) for key in keys},
                "commands": [" ".join(command_for(root, steps, arm, s, preset_flags, extra)) for s in seeds],
            }
        )
    return rows


def _pct(stats: dict[str, Optional[float]]) -> str:
    if stats["mean"] is None:
        return "-"
    return f"{100 * stats['mean']:+.2f}% ± {100 * stats['spread']:.2f}"


def write_table(root: Path, steps: int, rows: list[dict[str, Any]], seeds: list[int], about: str) -> Path:
    folder = root / f"steps{steps}"
    folder.mkdir(parents=True, exist_ok=True)
    lines = [
        f"# Fidelity matrix: {steps} steps, seeds {', '.join(map(str, seeds))} ({about})",
        "",
        "Gaps are relative cross-entropy against the normalized baseline of the same seed (mean ± half the "
        "range over seeds); held-out: random blocks of the held-out documents; out of corpus: the Python "
        "documentation's English topics. KL: to the original model, nats per token, out of corpus.",
        "",
        "| arm | what | seeds | tapered vs baseline | folded vs baseline | folded vs tapered | out of corpus, "
        "folded vs baseline | KL to original (folded, ooc) | broken blocks | broken out of corpus | gap without them |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        kls = [r["out_of_corpus_kl"].get("folded") for r in row["seeds"].values()]
        kls = [k for k in kls if k is not None]
        kl = f"{statistics.fmean(kls):.4f}" if kls else "-"
        broken, ooc_broken = (
            "/".join("-" if r[key] is None else str(r[key]) for r in row["seeds"].values()) or "-"
            for key in ("broken_blocks", "ooc_broken_blocks")
        )
        lines.append(
            f"| {row['arm']} | {row['about']} | {len(row['seeds'])} | {_pct(row['tapered_vs_baseline'])} | "
            f"{_pct(row['folded_vs_baseline'])} | {_pct(row['folded_vs_tapered'])} | "
            f"{_pct(row['ooc_folded_vs_baseline'])} | {kl} | "
            f"{broken} | {ooc_broken} | "
            f"{_pct(row['gap_without_broken'])} |"
        )
    lines += [
        "",
        "## Per seed",
        "",
        "| arm | seed | original | baseline | tapered | folded | ooc original | "
        "ooc baseline | ooc folded | final gate |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        for seed, r in row["seeds"].items():
            h, o = r["heldout"], r["out_of_corpus"]

            def f(x):
                return "-" if x is None else f"{x:.4f}"

            lines.append(
                f"| {row['arm']} | {seed} | {f(h.get('original'))} | {f(h.get('baseline'))} | {f(h.get('tapered'))} | "
                f"{f(h.get('folded'))} | {f(o.get('original'))} | {f(o.get('baseline'))} | {f(o.get('folded'))} | "
                f"{r['final_gate']} |"
            )
    lines += ["", "## Commands", "", "```"]
    lines += [command for row in rows for command in row["commands"]]
    lines += ["```", ""]
    (folder / "table.md").write_text("\n".join(lines))
    (folder / "table.json").write_text(json.dumps(rows, indent=2) + "\n")
    return folder / "table.md"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--root",
        default=None,
        help="Folder of the matrix's runs (default: runs/fidelity for the cpu preset, runs/fidelity_<preset> for the "
        "others, so runs of two presets never share a folder).",
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu", help="Budget and hardware of every run.")
    parser.add_argument("--steps", type=int, default=None, help="Optimizer steps per run (default: the preset's).")
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 7])
    parser.add_argument("--arms", nargs="+", default=["default", "no_distill"], choices=sorted(ARMS))
    parser.add_argument("--jobs", type=int, default=2, help="Runs at a time.")
    parser.add_argument(
        "--baseline_of",
        default=None,
        choices=sorted(name for name, arm in ARMS.items() if arm.own_baseline),
        help="The arm whose finished baselines the arms without their own read (default: each arm's choice, "
        "mostly the default arm's). Any arm trained with the default's schedule will do: a baseline never tapers.",
    )
    parser.add_argument("--table_only", action="store_true", help="Only write the table of the finished runs.")
    parser.add_argument(
        "--keep_checkpoints",
        action="store_true",
        help="Keep a finished run's checkpoint-* folders (by default removed: they only serve --resume).",
    )
    parser.add_argument(
        "--time_budget_s",
        type=float,
        default=None,
        help="Shorten every run so the whole matrix fits this many seconds (measured on a first short run).",
    )
    args, extra = parser.parse_known_args(argv)
    if args.baseline_of:
        for name in args.arms:
            if not ARMS[name].own_baseline:
                ARMS[name] = dataclasses.replace(ARMS[name], baseline_of=args.baseline_of)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    preset = PRESETS[args.preset]
    steps = args.steps or preset.steps
    root = Path(args.root or ("runs/fidelity" if args.preset == "cpu" else f"runs/fidelity_{args.preset}"))
    if args.time_budget_s and not args.table_only:
        steps = fit_steps(root, steps, args, preset, extra)
    if not args.table_only:
        run_matrix(root, steps, args.arms, args.seeds, args.jobs, preset.flags, extra, args.keep_checkpoints)
    rows = arm_rows(root, steps, args.arms, args.seeds, preset.flags, extra)
    print(write_table(root, steps, rows, args.seeds, preset.about).read_text())
    return 0


def fit_steps(root: Path, steps: int, args, preset: Preset, extra: list[str]) -> int:
    """The largest step count (at most ``steps``) whose matrix fits ``--time_budget_s``, from a timed probe.

    The probe is a short default run (with its baseline) in ``<root>/probe``; its seconds per optimizer step,
    counted for every arm (twice for arms that train a baseline) and every seed, divided over ``--jobs``,
    give the budget's step count. Startup and evaluation are paid once per run and counted from the probe.
    """
    probe_steps = max(4, min(20, steps // 10))
    probe_root = root / "probe"
    started = time.time()
    launch(
        command_for(probe_root, probe_steps, "default", args.seeds[0], preset.flags, extra),
        run_folder(probe_root, probe_steps, "default", args.seeds[0]),
        dict(os.environ),
    )
    report = run_folder(probe_root, probe_steps, "default", args.seeds[0]) / "report.json"
    total = time.time() - started
    seconds = (json.loads(report.read_text()).get("training") or {}).get("seconds") if report.exists() else None
    per_step = (seconds or total) / probe_steps
    fixed = max(0.0, total - 2 * per_step * probe_steps)
    weight = sum(2 if ARMS[a].own_baseline else 1 for a in args.arms) * len(args.seeds) / max(1, args.jobs)
    budget = args.time_budget_s - total
    fitted = int((budget - fixed * len(args.arms) * len(args.seeds) / max(1, args.jobs)) / (weight * per_step))
    chosen = max(probe_steps, min(steps, fitted))
    logger.info(
        "probe: %.2f s per step, %.0f s fixed per run: %d steps fit the budget (asked %d)",
        per_step,
        fixed,
        chosen,
        steps,
    )
    return chosen


if __name__ == "__main__":
    sys.exit(main())
