"""FSDP2 taper runs for tests/test_fsdp2.py; the same functions, unsharded, are the one-process reference.

Usage:
  python -m torch.distributed.run --nproc_per_node 2 tests/fsdp2_taper.py OUT_DIR
      A custom loop (TaperController, distillation from the gate-start snapshot) on a tiny Llama sharded with
      fully_shard on 2 CPU ranks (gloo), each rank seeing half of every global batch: the uninterrupted run
      with a sharded checkpoint mid-taper (OUT_DIR/interrupted) and at the end (OUT_DIR/final); a run resumed
      from the first; the refusals; and what accelerate's FSDP2 plugin does on CPU. Rank 0 writes
      OUT_DIR/fsdp2.pt (records, gathered full state dicts, bytes per rank, folded logits).
  python tests/fsdp2_taper.py OUT_DIR trainer
      transformers.Trainer + TaperCallback on a model sharded with fully_shard in a 1-process gloo group
      (the Trainer refuses fsdp=... without several processes), and the same run unsharded: OUT_DIR/trainer.pt.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import torch

STEPS, K_START, K_END, INTERRUPT = 8, 2, 6, 4  # INTERRUPT: optimizer steps done when the run is "interrupted"
GLOBAL_BATCH, SEQ, PAD = 4, 12, 3
# Rounding differences between 2 x 2 rows and 4 rows grow with the step size: at 1e-3 the folded logits stay
# ~3e-7 (relative) from one process's, at 3e-3 ~3e-6, against the 1e-5 target.
LR = 1e-3
POISON_STEP = 4  # the divergence check poisons a weight before update number POISON_STEP + 1 (gate < 1)


def taper_config():
    from hf_tapernorm import TaperNormConfig

    # distillation from the gate-start snapshot (the gated-MLP default), absolute scale loss, fast EMA
    return TaperNormConfig.paper(ema_rate=0.1, distill_weight=1.0, taper_start=K_START, taper_end=K_END)


def global_batch(step: int) -> dict[str, torch.Tensor]:
    """The global batch of update ``step + 1``; rows 1 and 3 are right-padded, so both halves hold as many tokens
    (per-rank means then average to the global mean, as one process computes it)."""
    ids = torch.randint(0, 128, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(100 + step))
    mask = torch.ones_like(ids)
    mask[1::2, -PAD:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def build_model(sharded: bool, config=None):
    """The tiny Llama of tests/conftest.py, patched; with ``sharded``, fully_shard on each decoder layer and the
    model (patch first: fully_shard must see the TaperNorm parameters)."""
    from hf_tapernorm import patch_model
    from tests.conftest import build, tiny_llama_config

    model = patch_model(build(tiny_llama_config(), seed=0), config or taper_config()).train()
    if sharded:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    return model


def setup(sharded: bool):
    from hf_tapernorm import TaperController

    model = build_model(sharded)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    return model, optimizer, TaperController(model, total_steps=STEPS)


def train(model, optimizer, controller, start: int, stop: int, checkpoint: Optional[Path] = None) -> list[dict]:
    """Updates ``start + 1`` .. ``stop``; a sharded checkpoint after INTERRUPT updates when ``checkpoint`` is given."""
    from hf_tapernorm.training.sharded import save_sharded_checkpoint

    rank, world = rank_and_world()
    records = []
    for step in range(start, stop):
        controller.step_begin(step)
        rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
        outputs = model(**{k: v[rows] for k, v in global_batch(step).items()})
        outputs.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        optimizer.step()
        optimizer.zero_grad()
        controller.step_end(step, grad_norm=float(grad_norm))
        metrics = controller.log_metrics()
        metrics.pop("taper/distill", None)  # this rank's own mean, not reduced over ranks
        records.append({"step": step + 1, "grad_norm": float(grad_norm), **metrics})
        if checkpoint is not None and step + 1 == INTERRUPT:
            save_sharded_checkpoint(checkpoint, model, optimizer, step + 1, controller)
    return records


def full_state(model) -> dict[str, torch.Tensor]:
    """The whole state dict, gathered to rank 0 (other ranks get an empty dict), as fold_model needs it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {k: v.clone() for k, v in get_model_state_dict(model, options=options).items()}


def summary(model, controller, records: list[dict]) -> dict:
    from hf_tapernorm.layers import tapered_norms

    return {
        "records": records,
        "c": {name: float(layer.c) for name, layer in tapered_norms(model)},
        "target": float(model.model.norm.anchor.target),
        "watch": list(controller.watch.loss.values),
        "grad_watch": list(controller.watch.grad_norm.values),
        "state": full_state(model),
    }


def probe() -> torch.Tensor:
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(7))


def folded_logits(state: dict[str, torch.Tensor]) -> torch.Tensor:
    """fold_model on a gathered model: a fresh patched model (one process) loaded with the full state dict."""
    from hf_tapernorm import fold_model

    model = build_model(sharded=False)
    model.load_state_dict(state)
    folded = fold_model(model.eval())
    with torch.no_grad():
        return folded(input_ids=probe()).logits


def divergence_message(checkpoint: Path, sharded: bool) -> str:
    """Resume from ``checkpoint``, poison one weight, run one update: the watch's message."""
    from hf_tapernorm import TaperDivergenceError
    from hf_tapernorm.training.sharded import load_sharded_checkpoint

    model, optimizer, controller = setup(sharded)
    start = load_sharded_checkpoint(checkpoint, model, optimizer, controller, trust_sharded_checkpoint=True)
    assert start == POISON_STEP == INTERRUPT
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.fill_(float("nan"))
    try:
        train(model, optimizer, controller, start, start + 1)
    except TaperDivergenceError as error:
        return str(error)
    return "no divergence"


def refusals() -> dict[str, str]:
    """The ConfigurationError messages of what FSDP2 cannot run."""
    from torch.distributed.fsdp import fully_shard

    from hf_tapernorm import ConfigurationError, TaperController, patch_model
    from tests.conftest import build, tiny_llama_config

    patched_late = build(tiny_llama_config(), seed=0)
    for layer in patched_late.model.layers:
        fully_shard(layer)
    patch_model(fully_shard(patched_late), taper_config())
    found = {}
    for name, model in (
        ("per_channel", build_model(True, taper_config().replace(experimental={"linear_fit": "per_channel"}))),
        ("patched_after_fully_shard", patched_late),
    ):
        try:
            TaperController(model, total_steps=STEPS)
        except ConfigurationError as error:
            found[name] = str(error)
    return found


def accelerate_plugin_on_cpu() -> dict[str, str]:
    """What accelerate makes of FullyShardedDataParallelPlugin(fsdp_version=2) with 2 CPU processes."""
    from accelerate import Accelerator, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["LlamaDecoderLayer"]
    )
    accelerator = Accelerator(fsdp_plugin=plugin, cpu=True)
    prepared = accelerator.prepare(build_model(sharded=False))
    return {"distributed_type": str(accelerator.distributed_type), "prepared": type(prepared).__name__}


def main_distributed(out: Path) -> None:
    from hf_tapernorm.training.distributed import local_parameter_bytes
    from hf_tapernorm.training.sharded import load_sharded_checkpoint, save_sharded_checkpoint

    rank, world = rank_and_world()
    model, optimizer, controller = setup(sharded=True)
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # DTensor numel: the whole tensor
    model_bytes = local_parameter_bytes(model)
    records = train(model, optimizer, controller, 0, STEPS, checkpoint=out / "interrupted")
    teacher = controller.distillation.teacher
    teacher_bytes = local_parameter_bytes(teacher)
    teacher_sharded = type(teacher).__name__.startswith("FSDP")
    save_sharded_checkpoint(out / "final", model, optimizer, STEPS, controller)
    uninterrupted = summary(model, controller, records)
    del model, optimizer, controller, teacher

    model, optimizer, controller = setup(sharded=True)
    start = load_sharded_checkpoint(out / "interrupted", model, optimizer, controller, trust_sharded_checkpoint=True)
    teacher_restored = controller.distillation.has_snapshot and type(controller.distillation.teacher).__name__
    resumed = summary(model, controller, train(model, optimizer, controller, start, STEPS))
    del model, optimizer, controller

    result = {
        "world_size": world,
        "bytes": {
            "full": full_bytes,
            "model": model_bytes,
            "teacher": teacher_bytes,
            "teacher_sharded": teacher_sharded,
        },
        "uninterrupted": uninterrupted,
        "resumed": {**resumed, "start": start, "teacher": teacher_restored},
        "divergence": divergence_message(out / "interrupted", sharded=True),
        "refusals": refusals(),
        "accelerate": accelerate_plugin_on_cpu(),
    }
    print(
        f"rank {rank}: parameter bytes {model_bytes} of {full_bytes} ({model_bytes / full_bytes:.3f}), "
        f"teacher {teacher_bytes} ({teacher_bytes / full_bytes:.3f})",
        flush=True,
    )
    per_rank = [None] * world
    own = {"bytes": result["bytes"], "c": uninterrupted["c"], "target": uninterrupted["target"]}
    torch.distributed.all_gather_object(per_rank, own)
    if rank == 0:
        result["per_rank"] = per_rank
        result["folded"] = folded_logits(uninterrupted["state"])
        torch.save(result, out / "fsdp2.pt")


# ---------------------------------------------------------------------------------------------- Trainer
def trainer_run(out: Path, sharded: bool) -> dict:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from hf_tapernorm import TaperCallback
    from hf_tapernorm.layers import gate_of, tapered_norms

    model = build_model(sharded)
    trace: list[list[float]] = []
    teacher: list[str] = []

    class Recorder(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            trace.append([state.global_step + 1, gate_of(model)])

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == STEPS:  # the teacher is released at the end of training: look at it before
                teacher.append(type(callback.controller.distillation.teacher).__name__)
                callback.on_save(args, state, control)  # the teacher snapshot, as at a checkpoint

    rows = [global_batch(step) for step in range(STEPS)]
    data = [{k: v[i] for k, v in batch.items()} for batch in rows for i in range(GLOBAL_BATCH)]
    args = TrainingArguments(
        output_dir=str(out / ("sharded" if sharded else "plain")),
        max_steps=STEPS,
        per_device_train_batch_size=GLOBAL_BATCH,
        learning_rate=LR,
        report_to=[],
        use_cpu=True,
        logging_steps=1,
        # The Trainer saves an FSDP2 model only through accelerate's FSDP plugin (GPUs): safetensors cannot
        # write DTensors. The teacher's collective save is checked below through on_save.
        save_strategy="no",
        train_sampling_strategy="sequential",
        disable_tqdm=True,
        seed=0,
    )
    callback = TaperCallback()
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback, Recorder()])
    trainer.train()
    folder = Path(args.output_dir) / f"checkpoint-{STEPS}"
    assert callback.controller.distillation is None  # released by on_train_end
    return {
        "gates": trace,
        "c": {name: float(layer.c) for name, layer in tapered_norms(model)},
        "state": full_state(model),
        "teacher": teacher[0],
        "saved": sorted(p.name for p in folder.iterdir()) if folder.is_dir() else [],
    }


def main_trainer(out: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{out / 'process_group'}", rank=0, world_size=1)
    result = {"plain": trainer_run(out, sharded=False), "sharded": trainer_run(out, sharded=True)}
    torch.save(result, out / "trainer.pt")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import torch.distributed as dist

    out_dir = Path(sys.argv[1])
    if sys.argv[2:] == ["trainer"]:
        main_trainer(out_dir)
    else:
        dist.init_process_group("gloo")
        main_distributed(out_dir)
    # Left to interpreter exit, gloo's threads are sometimes torn down mid-flight (SIGABRT after the work).
    dist.barrier()
    dist.destroy_process_group()
    print(f"pid {os.getpid()} done", flush=True)
    # Even after destroy_process_group, gloo's threads can abort the interpreter's teardown ("terminate
    # called without an active exception", seen in CI after "done"): the results are on disk, skip it.
    sys.stderr.flush()
    os._exit(0)
