"""FSDP2 (fully_shard) on 2 CPU processes (gloo) versus one process on the same global batch: the taper, the
sharded teacher, sharded checkpoints, resume and fold; the Trainer on a 1-process FSDP2 model; the refusals.

tests/fsdp2_taper.py does the work: one torchrun launch runs every 2-rank scenario (module fixture).
"""

from __future__ import annotations

import contextlib
import io
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from hf_tapernorm import ConfigurationError, TaperCallback, TaperController, patch_model
from tests.conftest import build, tiny_llama_config
from tests.fsdp2_taper import (
    INTERRUPT,
    K_END,
    K_START,
    POISON_STEP,
    STEPS,
    divergence_message,
    folded_logits,
    probe,
    setup,
    summary,
    taper_config,
    train,
)

ROOT = Path(__file__).resolve().parent.parent


def _fsdp2_available() -> bool:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return dist.is_available() and dist.is_gloo_available()


pytestmark = pytest.mark.skipif(not _fsdp2_available(), reason="needs torch.distributed with gloo and FSDP2")

STATE_RTOL, LOGITS_RTOL = 1e-4, 1e-5  # targets: relative to each tensor's largest magnitude


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(command: list[str], timeout: int = 240) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    completed = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-5000:]
    return completed.stdout


def state_rel_diff(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """Largest |actual - expected| / max|expected| over the floating tensors (non-floating ones must be equal)."""
    assert actual.keys() == expected.keys()
    worst = 0.0
    for key, value in expected.items():
        if not value.is_floating_point():
            assert torch.equal(actual[key], value), key
            continue
        scale = float(value.double().abs().max()) or 1.0
        worst = max(worst, float((actual[key].double() - value.double()).abs().max()) / scale)
    return worst


def rel_diff(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).abs().max() / expected.double().abs().max())


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp2")
    stdout = _run([
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
        "--master_port", str(_free_port()), str(ROOT / "tests" / "fsdp2_taper.py"), str(out),
    ])  # fmt: skip
    return {"out": out, "stdout": stdout, **torch.load(out / "fsdp2.pt", weights_only=False)}


@pytest.fixture(scope="module")
def one_process():
    """The reference: the same loop, unsharded, on every global batch whole."""
    model, optimizer, controller = setup(sharded=False)
    result = summary(model, controller, train(model, optimizer, controller, 0, STEPS))
    result["folded"] = folded_logits(result["state"])
    return result


def test_two_ranks_taper_like_one_process(two_ranks, one_process):
    assert two_ranks["world_size"] == 2
    sharded = two_ranks["uninterrupted"]
    for rank in two_ranks["per_rank"]:  # all-reduced statistics: bit-identical calibration on every rank
        assert rank["c"] == sharded["c"] and rank["target"] == sharded["target"]
    assert sharded["c"] == pytest.approx(one_process["c"], rel=1e-5)
    assert sharded["target"] == pytest.approx(one_process["target"], rel=1e-5)
    records, expected = sharded["records"], one_process["records"]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [r["taper/gate"] for r in records] == [r["taper/gate"] for r in expected]
    assert records[K_START - 1]["taper/gate"] == 1.0 and records[K_END - 1]["taper/gate"] == 0.0
    for key in ("taper/residual_scale", "taper/scale_loss", "grad_norm"):  # the scale loss and the watch's inputs
        assert [r[key] for r in records] == pytest.approx([r[key] for r in expected], rel=1e-4, abs=1e-12), key
    assert sharded["watch"] == pytest.approx(one_process["watch"], rel=1e-5)  # the losses the watch judged
    assert sharded["grad_watch"] == pytest.approx(one_process["grad_watch"], rel=1e-4)
    difference = state_rel_diff(sharded["state"], one_process["state"])
    print(f"FSDP2 (2 ranks) vs one process: state rel diff {difference:.2e}")
    assert difference <= STATE_RTOL


def test_each_rank_holds_half_of_the_parameters_and_of_the_teacher(two_ranks):
    for rank, measured in enumerate(two_ranks["per_rank"]):
        share, teacher_share = (measured["bytes"][k] / measured["bytes"]["full"] for k in ("model", "teacher"))
        print(
            f"rank {rank}: {measured['bytes']['model']} of {measured['bytes']['full']} parameter bytes ({share:.3f}); "
            f"teacher {measured['bytes']['teacher']} ({teacher_share:.3f})"
        )
        assert 0.45 <= share <= 0.55 and 0.45 <= teacher_share <= 0.55
        assert measured["bytes"]["teacher_sharded"]  # the gate-start snapshot is an FSDP2 module too
    assert "parameter bytes" in two_ranks["stdout"]


def test_fold_of_the_gathered_model_matches_one_process(two_ranks, one_process):
    difference = rel_diff(two_ranks["folded"], one_process["folded"])
    print(f"folded logits (gathered full state dict) rel diff {difference:.2e}")
    assert difference <= LOGITS_RTOL


def test_resume_from_the_sharded_checkpoint_equals_the_uninterrupted_run(two_ranks):
    resumed, uninterrupted = two_ranks["resumed"], two_ranks["uninterrupted"]
    assert resumed["start"] == INTERRUPT and resumed["teacher"].startswith("FSDP")  # the sharded snapshot, restored
    assert resumed["records"] == uninterrupted["records"][INTERRUPT:]
    assert resumed["watch"] == uninterrupted["watch"] and resumed["c"] == uninterrupted["c"]
    assert state_rel_diff(resumed["state"], uninterrupted["state"]) <= 1e-6


def test_a_two_rank_checkpoint_resumes_in_one_process(two_ranks, one_process):
    from hf_tapernorm.training.sharded import load_sharded_checkpoint

    model, optimizer, controller = setup(sharded=False)
    start = load_sharded_checkpoint(
        two_ranks["out"] / "interrupted", model, optimizer, controller, trust_sharded_checkpoint=True
    )  # DCP reshards
    assert start == INTERRUPT and controller.distillation.has_snapshot
    resumed = summary(model, controller, train(model, optimizer, controller, start, STEPS))
    assert resumed["watch"] == pytest.approx(one_process["watch"], rel=1e-5)
    assert state_rel_diff(resumed["state"], one_process["state"]) <= STATE_RTOL


def test_fold_command_exports_the_sharded_checkpoint_like_one_process(two_ranks, one_process, tmp_path):
    from transformers import AutoModelForCausalLM

    from hf_tapernorm.cli.main import main
    from hf_tapernorm.training.checkpoints import load_tapered

    final = two_ranks["out"] / "final"
    assert {"tapernorm_config.json", "config.json", ".metadata", "distillation_teacher"} <= {
        p.name for p in final.iterdir()
    }
    assert (
        state_rel_diff(load_tapered(final, trust_sharded_checkpoint=True).state_dict(), one_process["state"])
        <= STATE_RTOL
    )
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = main(
            ["fold", "--checkpoint", str(final), "--output_dir", str(tmp_path / "export"), "--trust_sharded_checkpoint"]
        )
    assert code == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    with torch.no_grad():
        logits = exported(input_ids=probe()).logits
    difference = rel_diff(logits, one_process["folded"])
    print(f"hf-tapernorm fold of the sharded checkpoint vs one process: logits rel diff {difference:.2e}")
    assert difference <= LOGITS_RTOL


def test_divergence_stops_two_ranks_and_one_process_alike(two_ranks):
    expected = divergence_message(two_ranks["out"] / "interrupted", sharded=False)
    assert expected.startswith(f"training diverged at optimizer step {POISON_STEP + 1} (gate 0.1464)")
    assert "First layer with non-finite parameters: model.layers.0.input_layernorm" in expected
    assert two_ranks["divergence"] == expected


def test_fsdp2_refuses_what_it_cannot_run(two_ranks):
    refused = two_ranks["refusals"]
    assert "linear_fit='per_channel' is not supported under FSDP2" in refused["per_channel"]
    assert "was patched after fully_shard" in refused["patched_after_fully_shard"]


def test_a_sharded_checkpoint_refuses_another_recipe_and_a_missing_optimizer(two_ranks, tmp_path):
    from hf_tapernorm import TaperStateError
    from hf_tapernorm.training.sharded import load_sharded_checkpoint, save_sharded_checkpoint

    other = patch_model(build(tiny_llama_config()), taper_config().replace(ema_rate=0.05))
    with pytest.raises(
        TaperStateError, match=r"another TaperNormConfig \(ema_rate: 0\.1 in the checkpoint, 0\.05 now\)"
    ):
        load_sharded_checkpoint(two_ranks["out"] / "interrupted", other, trust_sharded_checkpoint=True)
    model, optimizer, _ = setup(sharded=False)
    save_sharded_checkpoint(tmp_path / "weights_only", model)  # one process, no process group
    with pytest.raises(TaperStateError, match="holds no optimizer state"):
        load_sharded_checkpoint(tmp_path / "weights_only", model, optimizer, trust_sharded_checkpoint=True)
    assert load_sharded_checkpoint(tmp_path / "weights_only", model, trust_sharded_checkpoint=True) == 0


def test_accelerate_ignores_its_fsdp2_plugin_on_cpu(two_ranks):
    # docs/distributed.md states this: on CPU accelerate keeps MULTI_CPU and wraps the model in DDP, silently.
    # If this fails, accelerate runs FSDP2 on CPU now: test the plugin here and update the docs.
    assert two_ranks["accelerate"] == {
        "distributed_type": "DistributedType.MULTI_CPU",
        "prepared": "DistributedDataParallel",
    }


def test_trainer_and_taper_callback_on_a_one_process_fsdp2_model(tmp_path):
    _run([sys.executable, str(ROOT / "tests" / "fsdp2_taper.py"), str(tmp_path), "trainer"])
    result = torch.load(tmp_path / "trainer.pt", weights_only=False)
    plain, sharded = result["plain"], result["sharded"]
    assert sharded["gates"] == plain["gates"] and len(plain["gates"]) == STEPS
    assert sharded["c"] == pytest.approx(plain["c"], rel=1e-5)
    difference = state_rel_diff(sharded["state"], plain["state"])
    print(f"Trainer + TaperCallback, 1-process FSDP2 vs unsharded: state rel diff {difference:.2e}")
    assert difference <= STATE_RTOL
    assert sharded["teacher"].startswith("FSDP") and not plain["teacher"].startswith("FSDP")
    assert sharded["saved"] == ["distillation_teacher", "tapernorm_config.json"]  # on_save: the sharded snapshot


# ---------------------------------------------------------------------- refusals that need no process group
def _zero3_model():
    model = patch_model(build(tiny_llama_config()), taper_config())
    next(model.parameters()).ds_id = 0  # what DeepSpeed ZeRO-3 puts on every partitioned parameter
    return model


def _args(**overrides):
    values = dict(
        world_size=1,
        deepspeed=None,
        fsdp=None,
        fsdp_config={},
        activation_checkpointing=False,
        ddp_find_unused_parameters=None,
        max_steps=STEPS,
        lr_scheduler_type="linear",
        lr_scheduler_kwargs={},
    )
    return SimpleNamespace(**{**values, **overrides})


REFUSAL = r"does not support {} parameter sharding.*Shard with FSDP2 instead.*docs/distributed\.md"


def test_zero3_is_refused_by_the_controller_and_by_the_callback():
    zero3 = REFUSAL.format("DeepSpeed ZeRO-3")
    with pytest.raises(ConfigurationError, match=zero3):
        TaperController(_zero3_model(), total_steps=STEPS)
    with pytest.raises(ConfigurationError, match=zero3):  # the Trainer is being built: the model is partitioned
        TaperCallback().on_init_end(_args(), None, None, model=_zero3_model())
    deepspeed = SimpleNamespace(is_zero3=lambda: True)  # TrainingArguments(deepspeed=<a ZeRO-3 config>)
    model = patch_model(build(tiny_llama_config()), taper_config())
    with pytest.raises(ConfigurationError, match=zero3):
        TaperCallback().on_init_end(_args(deepspeed="ds.json", hf_deepspeed_config=deepspeed), None, None, model=model)


def test_trainer_fsdp_v1_is_refused_and_fsdp2_accepted():
    model = patch_model(build(tiny_llama_config()), taper_config())
    with pytest.raises(ConfigurationError, match=REFUSAL.format(r"FSDP \(v1\)")):
        TaperCallback().on_init_end(_args(fsdp=True, fsdp_config={"version": 1}), None, None, model=model)
    TaperCallback().on_init_end(_args(fsdp=True, fsdp_config={"version": 2}), None, None, model=model)
    TaperCallback().on_init_end(_args(fsdp=True, fsdp_config={}), None, None, model=model)  # 2: the default
