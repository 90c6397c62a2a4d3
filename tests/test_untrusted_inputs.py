"""Untrusted inputs: no code runs from a checkpoint (pickles in sharded checkpoints, a distillation teacher or the
Trainer's state are refused unless trusted), and models or tapered checkpoints that are not what their files say
(a config that lost layers, NaN weights, edited gates or kept norms) are refused in one line.

Each case checks the exit code, the first line of the error, and the files on disk.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_tapernorm import TaperNormConfig, TaperStateError, load_tapered, patch_model
from hf_tapernorm.errors import ConfigurationError
from hf_tapernorm.training.sharded import load_sharded_checkpoint, read_sharded_model_state
from tests.conftest import build, char_tokenizer, tiny_llama_config
from tests.helpers import (
    Payload,
    error_of,
    finished_run,
    one_model_workspace,
    refused,
    taper_argv,
    tapered_checkpoint,
    uninterrupted_run,
)
from tests.helpers import short_taper_argv as taper


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    return one_model_workspace(tmp_path_factory.mktemp("untrusted"))


@pytest.fixture(scope="module")
def baseline_run(ws) -> Path:
    """A finished 6-step run with --baseline: the cases plant files in copies of its checkpoint-6."""
    return finished_run(taper(ws, ws / "baseline_run", "--baseline"))


@pytest.fixture(scope="module")
def reference(workspace, tmp_path_factory) -> Path:
    """A finished 10-step run with checkpoints (helpers.killable_argv)."""
    return uninterrupted_run(workspace, tmp_path_factory.mktemp("untrusted") / "reference")


# ============================================================================= no pickle from a checkpoint
def test_a_crafted_sharded_checkpoint_runs_no_code(tmp_path):
    crafted = tapered_checkpoint(tmp_path / "downloaded")
    marker = tmp_path / "PAYLOAD_RAN"
    (crafted / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    for argv in (
        ["fold", "--checkpoint", str(crafted), "--output_dir", str(tmp_path / "export")],
        ["eval", "--model_name_or_path", str(crafted), "--heldout_blocks", "2", "--block_size", "32"],
    ):
        message = error_of(argv)
        assert message.startswith(f"hf-tapernorm {argv[0]}: error: '{crafted}' is a sharded"), message
        assert "pass --trust_sharded_checkpoint (trust_sharded_checkpoint=True)" in message
        assert not marker.exists() and not (tmp_path / "export").exists()
    model = patch_model(build(tiny_llama_config()), TaperNormConfig.paper())
    for load in (
        lambda: load_tapered(crafted),
        lambda: read_sharded_model_state(crafted),
        lambda: load_sharded_checkpoint(crafted, model),
    ):
        with pytest.raises(TaperStateError, match="trust_sharded_checkpoint=True"):
            load()
        assert not marker.exists()
    # The control: opting in reads the pickle, so the refusal above is what kept the payload from running.
    with pytest.raises(Exception):  # noqa: B017 - what the payload returns is no Metadata
        load_tapered(crafted, trust_sharded_checkpoint=True)
    assert marker.exists()


def test_resume_refuses_a_sharded_folder_planted_in_a_checkpoint(reference, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    marker = tmp_path / "PAYLOAD_RAN"
    planted = run / "checkpoint-10" / "distillation_teacher"
    planted.mkdir()
    (planted / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    from hf_tapernorm.app.resume_check import check_resumable

    with pytest.raises(TaperStateError, match=r"distillation_teacher' is a sharded .*--trust_sharded_checkpoint"):
        check_resumable(run)
    assert not marker.exists()


def test_a_sharded_teacher_planted_in_a_trainer_checkpoint_is_not_unpickled(tmp_path):
    from hf_tapernorm import TaperController

    model = patch_model(build(tiny_llama_config()), TaperNormConfig.paper().replace(distill_weight=0.5))
    controller = TaperController(model, total_steps=20)
    assert controller.distillation is not None
    marker = tmp_path / "PAYLOAD_RAN"
    (tmp_path / "checkpoint-4" / "distillation_teacher").mkdir(parents=True)
    (tmp_path / "checkpoint-4" / "distillation_teacher" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(TaperStateError, match="distillation_teacher' is a sharded .*--trust_sharded_checkpoint"):
        controller.load_state(tmp_path / "checkpoint-4")  # what TaperCallback calls on a Trainer resume
    assert not marker.exists()


@pytest.mark.parametrize("state", ["rng_state.pth", "optimizer.pt", "scheduler.pt"])
def test_a_pickle_in_the_trainer_state_stops_resume_early(ws, baseline_run, tmp_path, state):
    copy = tmp_path / "run"
    shutil.copytree(baseline_run, copy)
    checkpoint = next(copy.glob("checkpoint-*"))
    torch.save({"payload": _Payload()}, checkpoint / state)
    line = refused(taper(ws, copy, "--resume", "--baseline"), f"cannot read {checkpoint / state}", "pickled")
    assert "--overwrite" in line


class _Payload:
    """A pickle that would run code (torch's weights_only load refuses to)."""

    def __reduce__(self):
        return (print, ("this pickle ran",))


# ============================================================================= models that are not what they say
def test_models_that_are_not_what_their_config_says_are_refused(workspace, tmp_path):
    from safetensors.torch import save_file
    from transformers import T5Config, T5ForConditionalGeneration

    three_layers = tmp_path / "three_layers"
    shutil.copytree(workspace / "llama", three_layers)
    config = json.loads((three_layers / "config.json").read_text())
    (three_layers / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    argv = taper_argv(workspace, tmp_path / "o1")
    argv[argv.index("--model_name_or_path") + 1] = str(three_layers)
    message = error_of(argv)
    assert message.startswith(
        f"hf-tapernorm taper: error: model '{three_layers}' lacks 9 weight(s) its config declares"
    )
    assert "model.layers.2." in message and not (tmp_path / "o1").exists()

    poisoned = tmp_path / "poisoned"
    shutil.copytree(workspace / "llama", poisoned)
    state = load_file(poisoned / "model.safetensors")
    state["model.layers.1.mlp.up_proj.weight"][0, 0] = float("nan")
    save_file(state, poisoned / "model.safetensors", metadata={"format": "pt"})
    evaluate = ["eval", "--dataset_name", str(workspace / "corpus.txt"), "--block_size", "32", "--heldout_blocks", "2"]
    message = error_of([*evaluate, "--model_name_or_path", str(poisoned)])
    assert "non-finite values (NaN or inf) in model.layers.1.mlp.up_proj.weight" in message

    listed = tmp_path / "listed"
    shutil.copytree(workspace / "llama", listed)
    (listed / "config.json").write_text("[1, 2]")
    assert error_of([*evaluate, "--model_name_or_path", str(listed)]).endswith("holds a JSON list, not a model config")

    t5 = tmp_path / "t5"
    T5ForConditionalGeneration(
        T5Config(vocab_size=128, d_model=16, d_ff=32, num_layers=1, num_heads=2)
    ).save_pretrained(t5)
    char_tokenizer().save_pretrained(t5)
    argv = taper_argv(workspace, tmp_path / "o2")
    argv[argv.index("--model_name_or_path") + 1] = str(t5)
    assert "is a t5 model without a causal-LM class" in error_of(argv)

    assert error_of([*evaluate, "--model_name_or_path", str(workspace / "llama"), "--block_size", "100"]).endswith(
        "--block_size 100 exceeds the model's 64 positions"
    )
    options = tmp_path / "options.json"
    options.write_text("[1, 2]")
    assert error_of(["taper", str(options)]).endswith("an options file holds one object of option names and values")


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "tapernorm_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_a_tapered_checkpoint_whose_config_or_weights_were_edited_is_refused(tmp_path):
    from safetensors.torch import save_file

    saved = tapered_checkpoint(tmp_path / "saved")
    assert load_tapered(saved) is not None
    kept = tmp_path / "kept"  # a trained (tapered, g = 0) norm declared kept: evaluated as a real norm, silently
    shutil.copytree(saved, kept)
    _edit_config(kept, keep_norms=["model.layers.0.input_layernorm"])
    with pytest.raises(TaperStateError, match=r"model.layers.0.input_layernorm is kept as a norm by its tapernorm_"):
        load_tapered(kept)
    gates = tmp_path / "gates"
    shutil.copytree(saved, gates)
    state = load_file(str(gates / "model.safetensors"))
    state["model.layers.1.input_layernorm.gate"].fill_(0.5)
    save_file(state, str(gates / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(TaperStateError, match=r"tapered norms were saved at different gates \(0, 0.5\)"):
        load_tapered(gates)
    damaged = tmp_path / "nan"  # was folded, then "the fold check failed: pass a larger tolerance"
    shutil.copytree(saved, damaged)
    state = load_file(str(damaged / "model.safetensors"))
    state["model.layers.0.mlp.up_proj.weight"][0, 0] = float("nan")
    save_file(state, str(damaged / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(TaperStateError, match=r"non-finite values \(NaN or inf\) in model.layers.0.mlp.up_proj"):
        load_tapered(damaged)
    sink = tmp_path / "sink"  # was an IndexError traceback from the embedding
    shutil.copytree(saved, sink)
    _edit_config(sink, sink_token_ids=[100000])
    with pytest.raises(ConfigurationError, match=r"sink_token_ids \[100000\] are not token ids of LlamaForCausalLM"):
        load_tapered(sink)
    listed = tmp_path / "listed"  # was a ValueError traceback from dict()
    shutil.copytree(saved, listed)
    (listed / "tapernorm_config.json").write_text("[1, 2]")
    with pytest.raises(ConfigurationError, match=r"holds a JSON list, not a TaperNormConfig"):
        load_tapered(listed)
    message = error_of(["fold", "--checkpoint", str(kept), "--output_dir", str(tmp_path / "export")])
    assert message.startswith(f"hf-tapernorm fold: error: tapered checkpoint '{kept}': model.layers.0.input_layernorm")
    assert not (tmp_path / "export").exists()
