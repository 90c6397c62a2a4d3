"""A tiny Trainer run with TaperCallback, launched by tests/test_distributed.py under torchrun (2 CPU ranks).

Usage: python -m torch.distributed.run --nproc_per_node 2 tests/distributed_taper.py OUT_DIR PER_DEVICE_BATCH
Each rank writes OUT_DIR/rank<R>.json with its gate trace, every c, the scale target and a weight checksum.
The same function runs in a single process (the reference that sees the same global batch).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from hf_tapernorm import TaperNormConfig

STEPS, K_START, K_END = 8, 2, 6


def run(out_dir: Path, per_device_batch: int) -> dict:
    from transformers import Trainer, TrainerCallback, TrainingArguments, set_seed

    from hf_tapernorm import TaperCallback, patch_model
    from hf_tapernorm.layers import gate_of, tapered_norms
    from tests.conftest import build, tiny_llama_config

    set_seed(0)
    model = patch_model(build(tiny_llama_config(), seed=0), TaperNormConfig.paper(ema_rate=0.1))
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (STEPS * 4, 12), generator=generator)
    mask = torch.ones_like(ids)
    mask[1::3, -4:] = 0
    data = [{"input_ids": i, "attention_mask": m, "labels": i.masked_fill(m == 0, -100)} for i, m in zip(ids, mask)]
    trace: list[list[float]] = []

    class Recorder(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            trace.append([state.global_step + 1, gate_of(model)])

    args = TrainingArguments(
        output_dir=str(out_dir),
        max_steps=STEPS,
        per_device_train_batch_size=per_device_batch,
        learning_rate=3e-3,
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo" if "WORLD_SIZE" in os.environ else None,  # set by torchrun
        logging_steps=1,
        save_strategy="no",
        train_sampling_strategy="sequential",
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[TaperCallback(K_START, K_END), Recorder()])
    trainer.train()
    anchor = model.model.norm.anchor
    return {
        "rank": trainer.args.process_index,
        "world_size": trainer.args.world_size,
        "gates": trace,
        "c": {name: float(layer.c) for name, layer in tapered_norms(model)},
        "ema_steps": {name: int(layer.ema_steps) for name, layer in tapered_norms(model)},
        "target": float(anchor.target),
        "checksum": float(sum(p.detach().double().abs().sum() for p in model.parameters())),
    }


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    out = Path(sys.argv[1])
    result = run(out, int(sys.argv[2]))
    (out / f"rank{result['rank']}.json").write_text(json.dumps(result))
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        # Left to interpreter exit, gloo's threads are sometimes torn down mid-flight ("terminate called
        # without an active exception", SIGABRT after the work is done: seen once in CI).
        dist.barrier()
        dist.destroy_process_group()
    print(f"rank {result['rank']} of {result['world_size']} (pid {os.getpid()}) done", flush=True)
    # Even after destroy_process_group, gloo's threads can abort the interpreter's teardown ("terminate
    # called without an active exception", seen in CI after "done"): the results are on disk, skip it.
    sys.stderr.flush()
    os._exit(0)
