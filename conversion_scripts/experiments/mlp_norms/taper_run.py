"""One continued-pretraining run that tapers a pretrained model's norms (or the normalized baseline).

Works on a testbed checkpoint (``--model swiglu_s``, see ``testbed.py``) or on SmolLM2-135M
(``--model smollm2``). Every internal norm tapers unless ``--keep`` patterns keep it (the final norm
is always kept); position 0 (BOS) is a sink kept normalized. The schedule's gate is 1 up to k_start
(statistics), then per-channel least-squares calibration, then:

- ``cosine``: one global half-cosine to 0 at k_end (the product's schedule);
- ``slow``: a gate that slows where the fixed point k = 1 turns unstable: cosine from 1 to
  ``--slow-at`` (default 0.5) over the first ``--slow-frac`` of the window, then a cosine from
  there to 0 over the rest;
- ``layerwise``: one gate per decoder layer (both of its norms), staggered half-cosines of
  ``--overlap`` layer-slots each, layer 0 first (``--order forward``) or the last layer first
  (``--order backward``), as the LN-free GPT-2 work removed norms one layer at a time.

Methods on top (weights 0 = off): ``--distill`` (KL to a frozen copy of the model at the gate's start),
``--uniform`` (penalty (r_t / median r - 1)^2 on every tapered norm's input, from step 1: uniform
token scales while the norms still protect the model), ``--growth`` (penalty on each MLP's growth with
the scale of its input through the linear branch: relu(G - 1)^2 with
G = ||s h + mlp(s L(h))|| / (s ||h + mlp(L(h))||)), ``--mlp-c-scale`` (shrink the MLP norms' c),
``--hold-at`` (hold the gate at a value for a number of steps).

    python -m conversion_scripts.experiments.mlp_norms.taper_run --model swiglu_s --name plain_300 --steps 300
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from hf_tapernorm import TaperController
from hf_tapernorm.layers import tapered_norms
from hf_tapernorm.training import TaperSchedule

from .patching import patch
from .probe import ChannelStats, kind_of, layer_index, scale_stats
from .source import Source
from .testbed import param_groups

ROOT = Path(os.environ.get("MLPNORMS_ROOT", "/tmp/mlpnorms"))


@dataclass
class RunConfig:
    model: str = "swiglu_s"
    name: str = "run"
    baseline: bool = False
    steps: int = 300
    batch: int = 16
    seq: int = 128
    lr: float = 3e-4
    lr_warmup: int = 20
    weight_decay: float = 0.0
    seed: int = 1
    keep: list = field(default_factory=list)
    k_start: float = 0.05  # fraction of the run (or absolute step when >= 1)
    k_end: float = 0.7
    schedule: str = "cosine"  # cosine | slow | layerwise | staged
    first: str = "attn"  # staged: which kind of norm tapers first (attn | mlp), over the first half
    slow_at: float = 0.5
    slow_frac: float = 0.25
    order: str = "forward"
    overlap: float = 2.0
    hold_at: float = -1.0  # hold the gate at this value ...
    hold_steps: int = 0  # ... for this many steps (schedule time stops)
    calib_steps: int = 4
    per_channel: bool = True
    sink: int = 1
    mlp_c_scale: float = 1.0
    distill: float = 0.0
    uniform: float = 0.0
    uniform_until: float = 1.0  # fraction of the run
    uniform_kinds: str = "all"  # all | mlp
    anchor: float = (
        0.0  # per-layer scale anchors: (r_t / s_l - 1)^2 at each tapered norm's input, s_l frozen at k_start
    )
    growth: float = 0.0
    growth_s: float = 3.0
    growth_tokens: int = 256
    scale_loss_weight: float = 0.1
    stop_ce: float = 0.0  # 0: ln(vocab), i.e. worse than a uniform guess
    max_scale_ratio: float = 100.0
    eval_every: int = 0  # 0: about 10 evaluations
    eval_blocks: int = 64
    fold: bool = False
    device: str = "cpu"
    bf16: bool = False
    threads: int = 1
    tiny: bool = False  # a tiny random Llama (smoke tests)
    model_path: str = ""  # smollm2: a folder / hub id / GGUF (default: the embedded SmolLM2-135M-Instruct)
    data_scope: str = (
        "top"  # smollm2: "top" (top-level stdlib modules), "all" (every stdlib .py), "site" (+ site-packages)
    )


# ------------------------------------------------------------------------------------------- sources
def make_source(cfg: RunConfig) -> Source:
    if cfg.tiny:
        from .smollm2 import tiny_source

        return tiny_source(cfg)
    if cfg.model == "smollm2":
        from .smollm2 import smollm2_source

        return smollm2_source(cfg)
    from .data import corpus_for, held_out_blocks, training_batches
    from .testbed import load_testbed

    model, meta = load_testbed(cfg.model)
    corpus = corpus_for(meta.get("tokenizer", "bytes"))
    return Source(
        model=model,
        sink_ids=[int(held_out_blocks(corpus, meta["seq"], 1)[0, 0])],
        batches=training_batches(corpus, cfg.batch, cfg.seq, seed=1000 + cfg.seed),
        held=held_out_blocks(corpus, cfg.seq, cfg.eval_blocks),
        pretrain_tokens=meta["tokens"],
        params=meta["parameters"],
    )


# -------------------------------------------------------------------------------------------- gates
def half_cosine(t: float) -> float:
    """1 at t <= 0, 0 at t >= 1."""
    if t <= 0:
        return 1.0
    if t >= 1:
        return 0.0
    return 0.5 * (1.0 + math.cos(math.pi * t))


def gate_plan(cfg: RunConfig, names: list[str], k_start: int, k_end: int) -> Callable[[float], dict]:
    """position (schedule time, in steps) -> {norm name: gate}."""
    window = k_end - k_start
    if cfg.schedule == "cosine":
        return lambda k: dict.fromkeys(names, half_cosine((k - k_start) / window))
    if cfg.schedule == "slow":
        a, f = cfg.slow_at, cfg.slow_frac

        def slow(k):
            t = (k - k_start) / window
            if t <= f:
                g = a + (1 - a) * half_cosine(t / f)
            else:
                g = a * half_cosine((t - f) / (1 - f))
            return dict.fromkeys(names, max(0.0, min(1.0, g)))

        return slow
    if cfg.schedule == "layerwise":
        layers = sorted({layer_index(n) for n in names})
        if cfg.order == "backward":
            layers = layers[::-1]
        slot = {layer: i for i, layer in enumerate(layers)}
        n = len(layers)
        width = min(1.0, cfg.overlap / (n + cfg.overlap - 1))  # each layer's share of the window
        step = (1.0 - width) / max(1, n - 1)

        def staggered(k):
            t = (k - k_start) / window
            return {name: half_cosine((t - slot[layer_index(name)] * step) / width) for name in names}

        return staggered
    if cfg.schedule == "staged":

        def staged(k):
            t = (k - k_start) / window
            early, late = half_cosine(2 * t), half_cosine(2 * t - 1)
            return {n: early if kind_of(n) == cfg.first else late for n in names}

        return staged
    raise ValueError(f"unknown schedule {cfg.schedule!r}")


def resolve(step: float, total: int) -> int:
    """A float up to 1.0 is a fraction of the run (1.0: its end); an int is a step."""
    return int(round(step * total)) if isinstance(step, float) and step <= 1.0 else int(step)


# ---------------------------------------------------------------------------------------- penalties
class InputTap:
    """Captures (with gradient) the input of each tapered norm in the current forward."""

    def __init__(self, layers: dict) -> None:
        self.inputs: dict[str, torch.Tensor] = {}
        self.enabled = True
        self.handles = [m.register_forward_pre_hook(self._hook(n)) for n, m in layers.items()]

    def _hook(self, name):
        def hook(module, args):
            if self.enabled and module.training:
                self.inputs[name] = args[0]

        return hook

    def clear(self) -> None:
        self.inputs.clear()


def uniform_penalty(tap: InputTap, sink: int, kinds: str) -> torch.Tensor:
    terms = []
    for name, h in tap.inputs.items():
        if kinds == "mlp" and kind_of(name) != "mlp":
            continue
        r = h[:, sink:].float().pow(2).mean(-1).add(1e-6).sqrt()
        med = r.detach().median()
        terms.append((r / med - 1.0).pow(2).mean())
    return torch.stack(terms).mean()


def growth_penalty(model: nn.Module, tap: InputTap, layers: dict, cfg: RunConfig, gen: torch.Generator) -> torch.Tensor:
    """relu(G - 1)^2 with G the MLP block's output-scale growth when its input token is s x larger (linear branch)."""
    terms = []
    blocks = model.model.layers
    for name, h in tap.inputs.items():
        if kind_of(name) != "mlp":
            continue
        layer = layers[name]
        x = h[:, cfg.sink :].detach().float().reshape(-1, h.shape[-1])
        if x.shape[0] > cfg.growth_tokens:
            idx = torch.randperm(x.shape[0], generator=gen)[: cfg.growth_tokens].to(x.device)
            x = x[idx]
        x = x.to(h.dtype)
        lin = x * (layer.taper_weight * layer.c)
        mlp = blocks[layer_index(name)].mlp
        s = cfg.growth_s
        base = (x + mlp(lin)).float().norm(dim=-1)
        grown = (s * x + mlp(s * lin)).float().norm(dim=-1)
        ratio = grown / (s * base).clamp_min(1e-6)
        terms.append(F.relu(ratio - 1.0).pow(2).mean())
    return torch.stack(terms).mean()


def kl_to(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    log_p = F.log_softmax(teacher_logits.float(), dim=-1)
    log_q = F.log_softmax(student_logits.float(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).mean()


# ------------------------------------------------------------------------------------------ helpers
@torch.no_grad()
def held_out_ce(model: nn.Module, blocks: torch.Tensor, batch: int, device, bf16: bool) -> float:
    was = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(blocks), batch):
        x = blocks[i : i + batch].to(device)
        with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=x).logits
        logits = logits[:, :-1].float()
        total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum"))
        count += x[:, 1:].numel()
    model.train(was)
    return total / count


def summarize_gates(gates: dict) -> dict:
    values = list(gates.values())
    out = {
        "gate": sum(values) / len(values),
        "gate_min": min(values),
        "gate_max": max(values),
        "norms_at_0": sum(v == 0.0 for v in values),
    }
    for kind in ("attn", "mlp"):
        part = [v for n, v in gates.items() if kind_of(n) == kind]
        if part:
            out[f"gate_{kind}"] = sum(part) / len(part)
    return out


# ------------------------------------------------------------------------------------------- a run
def run(cfg: RunConfig, log_dir: Optional[Path] = None, quiet: bool = False) -> dict:
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    src = make_source(cfg)
    device = torch.device(cfg.device)
    model = src.model.to(device)
    model.train()
    log_dir = Path(log_dir) if log_dir is not None else ROOT / "runs"
    log_dir.mkdir(parents=True, exist_ok=True)
    log = (log_dir / f"{cfg.name}.jsonl").open("w")
    log.write(json.dumps({"config": asdict(cfg)}) + "\n")
    k_start = max(1, resolve(cfg.k_start, cfg.steps))
    k_end = min(cfg.steps, max(k_start + 1, resolve(cfg.k_end, cfg.steps)))
    eval_every = cfg.eval_every or max(1, cfg.steps // 10)
    stop_ce = cfg.stop_ce if cfg.stop_ce > 0 else math.log(model.config.vocab_size)

    controller, layers, plan, chstats, tap = None, {}, None, None, None
    if not cfg.baseline:
        patch(
            model,
            scope="internal",
            keep_norms=cfg.keep,
            sink_token_ids=src.sink_ids[: cfg.sink] if cfg.sink else None,
            scale_loss_weight=cfg.scale_loss_weight,
            relative_scale_loss=True,
            ema_rate=0.1,
        )
        layers = dict(tapered_norms(model))
        schedule = TaperSchedule(k_start, k_end, total_steps=cfg.steps, allow_incomplete=True)
        controller = TaperController(model, schedule, max_scale_ratio=cfg.max_scale_ratio)
        plan = gate_plan(cfg, list(layers), k_start, k_end)
        chstats = ChannelStats(model, cfg.sink) if cfg.per_channel else None
        if chstats is not None:
            chstats.active = False
        if cfg.uniform > 0 or cfg.growth > 0 or cfg.anchor > 0:
            tap = InputTap(layers)
    opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / max(1, cfg.lr_warmup)))
    teacher = None
    anchors: dict[str, float] = {}
    gen = torch.Generator().manual_seed(cfg.seed)

    def evaluate(step: int, gates: dict) -> dict:
        ce = held_out_ce(model, src.held, 16, device, cfg.bf16)
        row = {"step": step, "eval_ce": ce if math.isfinite(ce) else None}
        if gates:
            row.update(summarize_gates(gates))
        return row

    evals = [evaluate(0, {n: 1.0 for n in layers})]
    log.write(json.dumps(evals[-1]) + "\n")
    status, broke_at, gates = "completed", None, {n: 1.0 for n in layers}
    position, held = 0.0, 0
    started = time.time()
    for step in range(1, cfg.steps + 1):
        if controller is not None:
            # hold: schedule time stands still while the gate is at hold_at
            if cfg.hold_steps and held < cfg.hold_steps and gates and summarize_gates(gates)["gate"] <= cfg.hold_at:
                held += 1
            else:
                position += 1.0
            if chstats is not None:
                chstats.active = k_start - cfg.calib_steps < step <= k_start
            controller.step_begin(step - 1)  # calibrates before the first update past k_start
            if step == k_start + 1:
                if chstats is not None:
                    chstats.apply()
                    chstats.remove()
                if cfg.mlp_c_scale != 1.0:
                    with torch.no_grad():
                        for name, layer in layers.items():
                            if kind_of(name) == "mlp":
                                layer.c.mul_(cfg.mlp_c_scale)
                if cfg.distill > 0:
                    teacher = copy.deepcopy(model).eval().requires_grad_(False)
                    for _, layer in tapered_norms(teacher):
                        layer.set_gate(1.0)
            gates = plan(position) if step > k_start else dict.fromkeys(layers, 1.0)
            for name, layer in layers.items():
                layer.set_gate(gates[name])
        t0 = time.time()
        x = next(src.batches).to(device)
        if tap is not None:
            tap.clear()
            tap.enabled = True
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
            out = model(input_ids=x, labels=x)
        logits = out.logits
        ce = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        loss = out.loss.float()  # CE + the final norm's scale loss once anchored
        row = {"step": step, "ce": float(ce), "aux": float(loss - ce), "lr": sched.get_last_lr()[0]}
        if gates:
            row.update(summarize_gates(gates))
        if tap is not None:
            if cfg.uniform > 0 and step <= resolve(cfg.uniform_until, cfg.steps):
                pen = uniform_penalty(tap, cfg.sink, cfg.uniform_kinds)
                loss = loss + cfg.uniform * pen
                row["uniform"] = float(pen)
            if cfg.anchor > 0:
                if step <= k_start:  # running mean of each layer's median token scale, frozen at k_start
                    with torch.no_grad():
                        for name, h in tap.inputs.items():
                            med = float(h[:, cfg.sink :].float().pow(2).mean(-1).sqrt().median())
                            anchors[name] = anchors.get(name, 0.0) + (med - anchors.get(name, 0.0)) / step
                else:
                    terms = [
                        ((h[:, cfg.sink :].float().pow(2).mean(-1).add(1e-6).sqrt() / anchors[n]) - 1.0).pow(2).mean()
                        for n, h in tap.inputs.items()
                    ]
                    pen = torch.stack(terms).mean()
                    loss = loss + cfg.anchor * pen
                    row["anchor"] = float(pen)
            if cfg.growth > 0:
                tap.enabled = False
                with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
                    pen = growth_penalty(model, tap, layers, cfg, gen)
                loss = loss + cfg.growth * pen
                row["growth"] = float(pen)
            tap.clear()
        if teacher is not None:
            with torch.no_grad(), torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
                t_logits = teacher(input_ids=x).logits
            kl = kl_to(logits, t_logits)
            loss = loss + cfg.distill * kl
            row["kl"] = float(kl)
        if not torch.isfinite(loss) or float(ce) > stop_ce:
            status = f"broke at step {step}"
            broke_at = {"step": step, "ce": row["ce"], **(summarize_gates(gates) if gates else {})}
            if not cfg.baseline:
                broke_at["trace"] = runaway_trace(model, x, cfg.sink)
            row["stopped"] = True
            log.write(json.dumps(row) + "\n")
            break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        row["grad_norm"] = float(
            torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 1.0)
        )
        opt.step()
        sched.step()
        if controller is not None:
            try:
                controller.step_end(step - 1)
            except Exception as error:  # TaperDivergenceError: the run's result, not a crash
                status = f"broke at step {step}: {str(error)[:160]}"
                broke_at = {"step": step, "ce": row["ce"], **summarize_gates(gates)}
                log.write(json.dumps(row) + "\n")
                break
        row["sec"] = round(time.time() - t0, 3)
        if step % eval_every == 0 or step == cfg.steps:
            ev = evaluate(step, gates)
            row["eval_ce"] = ev["eval_ce"]
            evals.append(ev)
            if not quiet:
                print(
                    json.dumps(
                        {k: row[k] for k in row if k in ("step", "ce", "eval_ce", "gate", "kl", "uniform", "growth")}
                    ),
                    flush=True,
                )
        log.write(json.dumps(row) + "\n")
        log.flush()
    seconds = time.time() - started
    final_ce = None
    if broke_at is None:
        final_ce = (
            evals[-1]["eval_ce"]
            if evals[-1]["step"] == cfg.steps
            else held_out_ce(model, src.held, 16, device, cfg.bf16)
        )
    result = {
        "name": cfg.name,
        "config": asdict(cfg),
        "status": status,
        "broke": broke_at,
        "final_eval_ce": final_ce,
        "final_gates": summarize_gates(gates) if gates else None,
        "tokens": cfg.steps * cfg.batch * cfg.seq,
        "tokens_trained": (broke_at["step"] if broke_at else cfg.steps) * cfg.batch * cfg.seq,
        "pretrain_tokens": src.pretrain_tokens,
        "params": src.params,
        "k_start": k_start,
        "k_end": k_end,
        "evals": evals,
        "seconds": round(seconds, 1),
        "sec_per_step": round(seconds / max(1, (broke_at or {"step": cfg.steps})["step"]), 3),
    }
    if broke_at is None and not cfg.baseline:
        try:
            stats = scale_stats(model, src.held[:16].to(device), sink=cfg.sink)
            result["max_token_ratio_end"] = max(v["max_ratio"] for v in stats.values())
        except Exception as error:  # noqa: BLE001 - a diagnostic only
            result["max_token_ratio_end"] = f"error: {error}"
    if cfg.fold and broke_at is None and not cfg.baseline:
        result["fold"] = fold_check(model, src, cfg, device)
    result["model"] = model if cfg.fold else None
    log.write(json.dumps({"final": True, **{k: v for k, v in result.items() if k != "model"}}) + "\n")
    log.close()
    return result


def runaway_trace(model: nn.Module, x: torch.Tensor, sink: int) -> list:
    """Per internal norm (model order), the largest non-sink token's RMS over the median, on batch ``x``."""
    try:
        with torch.no_grad():
            stats = scale_stats(model, x, batch=len(x), sink=sink)
        return [
            [
                f"{layer_index(p)}.{kind_of(p)}",
                round(v["max_ratio"], 2) if math.isfinite(v["max_ratio"]) else str(v["max_ratio"]),
            ]
            for p, v in stats.items()
        ]
    except Exception as error:  # noqa: BLE001 - a diagnostic only
        return [f"error: {error}"]


def fold_check(model: nn.Module, src: Source, cfg: RunConfig, device) -> dict:
    """Fold at g = 0 (hf_tapernorm.fold_model) and compare with the tapered model on held-out text."""
    from hf_tapernorm import fold_model

    gates = [float(layer.gate) for _, layer in tapered_norms(model)]
    if any(g != 0.0 for g in gates):
        return {"ok": False, "reason": f"gate not 0 (max {max(gates)})"}
    model.eval()
    try:
        probe = src.held[:2, : min(64, src.held.shape[1])].to(device)
        folded = fold_model(model, probe=probe, tolerance=1e-3 if not cfg.bf16 else 5e-2)
        report = getattr(folded, "fold_report", None)
        out = {"ok": True, "folded_norms": None}
        if report is not None:
            for key in ("max_abs_diff", "max_rel_diff", "float64_max_rel_diff", "folded", "kept"):
                if hasattr(report, key):
                    value = getattr(report, key)
                    out[key] = value if isinstance(value, (int, float, str)) or value is None else str(value)[:200]
        return out
    except Exception as error:  # noqa: BLE001 - reported, not raised
        return {"ok": False, "reason": f"{type(error).__name__}: {str(error)[:300]}"}
    finally:
        model.train()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = RunConfig()
    for f in RunConfig.__dataclass_fields__.values():
        flag = "--" + f.name.replace("_", "-")
        value = getattr(defaults, f.name)
        if isinstance(value, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=value)
        elif isinstance(value, list):
            p.add_argument(flag, nargs="*", default=value)
        else:
            p.add_argument(flag, type=type(value), default=value)
    p.add_argument("--summary-dir", default=str(ROOT / "summaries"))
    return p


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    summary_dir = Path(args.summary_dir)
    del args.summary_dir
    cfg = RunConfig(**vars(args))
    result = run(cfg)
    result.pop("model", None)
    summary_dir.mkdir(parents=True, exist_ok=True)
    (summary_dir / f"{cfg.name}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("name", "status", "broke", "final_eval_ce", "final_gates", "seconds")}))
    return result


if __name__ == "__main__":
    main()
