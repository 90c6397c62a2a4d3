"""PEFT: a patched model wrapped with LoRA trains the TaperNorm parameters with the adapters, tapers to
g = 0 under TaperCallback, and after merge_and_unload() folds and exports like any other model."""

from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from hf_tapernorm import (
    ConfigurationError,
    TaperCallback,
    TaperController,
    TaperNormConfig,
    export_folded,
    fold_model,
    patch_model,
    save_tapered,
)
from hf_tapernorm.errors import TaperStateError, UnsupportedModelError
from hf_tapernorm.evaluation.models import ModelSourceError, resolve_model
from hf_tapernorm.layers import gate_of, tapered_norms, train_tapernorm_parameters
from hf_tapernorm.layers.patching import set_gate
from hf_tapernorm.training import calibrate
from tests.conftest import build, random_batches, tiny_llama_config
from tests.helpers import one_model_workspace


def test_lora_round_trip(tmp_path):
    model = patch_model(build(tiny_llama_config()), TaperNormConfig.paper())
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    made = train_tapernorm_parameters(peft_model)
    trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    assert any("lora_A" in n for n in trainable) and any(n.endswith("input_layernorm.taper_weight") for n in trainable)
    assert not any(n.endswith("q_proj.base_layer.weight") for n in trainable)
    expected = {
        f"{name}.{attribute}"
        for name, layer in tapered_norms(peft_model, include_kept=True)
        for attribute in (("weight", "taper_weight") if layer.tapered else ("weight",))  # RMSNorm: no bias
    }
    assert set(made) == expected and expected <= trainable
    start = {name: p.detach().clone() for name, p in peft_model.named_parameters() if p.requires_grad}

    data = [{"input_ids": ids, "labels": ids} for ids in random_batches(n=16, batch=1, length=16, seed=4)]
    data = [{key: value[0] for key, value in row.items()} for row in data]
    args = TrainingArguments(
        output_dir=str(tmp_path / "run"),
        max_steps=8,
        per_device_train_batch_size=2,
        learning_rate=5e-3,
        lr_scheduler_type="constant",
        report_to=[],
        save_strategy="no",
        logging_steps=4,
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    callback = TaperCallback(taper_start=2, taper_end=6)
    trainer = Trainer(model=peft_model, args=args, train_dataset=data, callbacks=[callback])
    trainer.train()

    assert gate_of(peft_model) == 0.0
    assert all(layer.is_calibrated for _, layer in tapered_norms(peft_model))
    moved = {name for name, p in peft_model.named_parameters() if name in start and not torch.equal(p, start[name])}
    assert any("lora_B" in n for n in moved)  # the adapters trained
    assert any(n.endswith("post_attention_layernorm.taper_weight") for n in moved)  # and so did the norms

    merged = peft_model.merge_and_unload()
    assert type(merged).__name__ == "LlamaForCausalLM"
    merged.eval()
    ids = random_batches(n=1, batch=2, length=12, seed=9)[0]
    with torch.no_grad():
        unfolded = merged(ids).logits
    folded = fold_model(merged)
    with torch.no_grad():
        assert float((folded(ids).logits - unfolded).abs().max() / unfolded.abs().max()) <= 1e-5
    folder = export_folded(folded, tmp_path / "export")
    reloaded = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, folded(ids).logits)


def test_lora_that_freezes_the_taper_parameters_is_named_once_at_the_first_step(caplog):
    from hf_tapernorm import TaperController

    def first_steps(model) -> list[str]:
        controller = TaperController(model, total_steps=40)
        caplog.clear()
        with caplog.at_level("WARNING", logger="hf_tapernorm.training.controller"):
            controller.step_begin(0)
            controller.step_begin(1)
        return [r.getMessage() for r in caplog.records if "TaperNorm parameter(s) are frozen" in r.getMessage()]

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    frozen = get_peft_model(patch_model(build(tiny_llama_config()), TaperNormConfig.paper()), lora)
    (message,) = first_steps(frozen)
    count = sum(1 for _ in tapered_norms(frozen)) * 2  # weight and taper_weight (RMSNorm: no bias)
    assert message.startswith(f"{count} TaperNorm parameter(s) are frozen") and "input_layernorm.weight" in message
    assert "train_tapernorm_parameters(model)" in message

    unfrozen = get_peft_model(patch_model(build(tiny_llama_config()), TaperNormConfig.paper()), lora)
    train_tapernorm_parameters(unfrozen)
    assert first_steps(unfrozen) == []


def test_train_tapernorm_parameters_refuses_an_unpatched_model():
    with pytest.raises(ValueError, match="has no TaperNorm; call patch_model before get_peft_model"):
        train_tapernorm_parameters(build(tiny_llama_config()))


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    return one_model_workspace(tmp_path_factory.mktemp("peft"))


def test_unmerged_peft_models_are_refused_with_merge_and_unload(ws, tmp_path):
    peft = pytest.importorskip("peft")
    model = AutoModelForCausalLM.from_pretrained(ws / "llama")
    wrapped = peft.get_peft_model(model, peft.LoraConfig(target_modules=["q_proj"], r=2))
    with pytest.raises(UnsupportedModelError, match=r"merge_and_unload\(\)"):
        patch_model(wrapped, TaperNormConfig(sink_token_ids=[]))
    # without a config the recipe was derived first, and the refusal blamed the architecture ("no decoder-layer list")
    with pytest.raises(UnsupportedModelError, match=r"^PeftModel wraps the model in PEFT adapters: patch the base"):
        patch_model(wrapped)
    wrapped.save_pretrained(tmp_path / "adapter")
    with pytest.raises(ModelSourceError, match="PEFT adapters.*merge_and_unload"):
        resolve_model(str(tmp_path / "adapter"))
    patched = patch_model(AutoModelForCausalLM.from_pretrained(ws / "llama"), TaperNormConfig(sink_token_ids=[]))
    patched.train()
    patched(torch.randint(1, 127, (2, 16)))
    calibrate(patched)
    set_gate(patched, 0.0)
    lora = peft.get_peft_model(patched, peft.LoraConfig(target_modules=["q_proj"], r=2))
    with pytest.raises(UnsupportedModelError, match=r"fold_model\(model.merge_and_unload\(\)\)"):
        fold_model(lora)
    # save_tapered let PEFT write its adapters, then failed on the missing config.json, leaving them in the folder
    with pytest.raises(UnsupportedModelError) as refused:
        save_tapered(lora, tmp_path / "tapered")
    assert str(refused.value) == (
        "save_tapered: PeftModel wraps the model in PEFT adapters, and a tapered checkpoint holds the whole "
        "model: merge them first, save_tapered(model.merge_and_unload(), ...), or save the adapters alone with "
        "model.save_pretrained(...)"
    )
    assert not (tmp_path / "tapered").exists()
    with pytest.raises(ConfigurationError, match=r"^save_tapered: an empty path names no folder"):
        save_tapered(patched, "")  # the working folder, among whatever it holds


def test_a_tapernorm_in_modules_to_save_is_refused_before_the_first_step(tmp_path):
    """LoRA with a norm in modules_to_save (against the docs): PEFT runs a copy of the TaperNorm and the original
    never runs, so the taper's calibration failed after the whole warmup, blaming the forwards ("no calibration
    statistics: run training-mode forwards"). TaperController, and TaperCallback before the first step, name
    modules_to_save."""
    model = patch_model(build(tiny_llama_config()), TaperNormConfig.paper())
    model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["model.norm"]))
    train_tapernorm_parameters(model)
    expected = (
        "base_model.model.model.norm is in PEFT's modules_to_save: PEFT trains a copy of its TaperNorm while the "
        "original, which the taper calibrates, never runs; leave the norms out of modules_to_save and call "
        "train_tapernorm_parameters(model) after get_peft_model (docs/usage.md, LoRA / PEFT)"
    )
    with pytest.raises(ConfigurationError) as refused:
        TaperController(model, total_steps=10)
    assert str(refused.value) == expected
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=10, use_cpu=True, report_to=[], save_strategy="no")
    batches = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 128, (8, 12))]
    trainer = Trainer(model=model, args=args, train_dataset=batches, callbacks=[TaperCallback(2, 6)])
    with pytest.raises(ConfigurationError) as refused:
        trainer.train()
    assert str(refused.value) == expected and trainer.state.global_step == 0


def test_a_lora_rerun_into_the_same_output_dir_saves_its_own_recipe(tmp_path):
    """The documented LoRA flow (patch_model, get_peft_model, Trainer with TaperCallback) run again into the same
    output_dir with another recipe crashed at its first save ("records another recipe"), after the Trainer had
    rewritten checkpoint-2 with the new run's adapters, leaving the old run's tapernorm_config.json beside them.
    TaperCallback saves into the checkpoint the Trainer has just written: the recipe written is the new run's."""
    data = [{"input_ids": ids[0], "labels": ids[0]} for ids in random_batches(n=4, batch=1, length=8, seed=4)]

    def run(config: TaperNormConfig) -> Path:
        model = get_peft_model(
            patch_model(build(tiny_llama_config()), config), LoraConfig(r=2, target_modules=["q_proj"])
        )
        train_tapernorm_parameters(model)
        args = TrainingArguments(
            output_dir=str(tmp_path / "run"), max_steps=2, save_steps=2, per_device_train_batch_size=2,
            report_to=[], use_cpu=True, disable_tqdm=True, seed=0,
        )  # fmt: skip
        Trainer(model=model, args=args, train_dataset=data, callbacks=[TaperCallback()]).train()
        return tmp_path / "run" / "checkpoint-2"

    first, second = TaperNormConfig.paper(keep_norms=["model.norm"]), TaperNormConfig.paper()
    assert TaperNormConfig.from_pretrained(run(first)) == first
    checkpoint = run(second)
    assert TaperNormConfig.from_pretrained(checkpoint) == second
    assert (checkpoint / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("resumed_with", ["the same recipe", "another recipe"])
def test_resuming_a_lora_taper_from_its_peft_checkpoint_says_that_is_not_supported(tmp_path, resumed_with):
    """The Trainer's checkpoint of a PeftModel holds only the adapters, so a resume found no TaperNorm state and
    said "Patch the model with patch_model(...) before the run that wrote the checkpoint", though the model was
    patched both times. It says now what docs/usage.md says: a LoRA taper does not resume from a PEFT checkpoint.
    A model patched with another recipe (other norms trained) failed first at the Trainer's optimizer load, in
    torch's words; the same line comes first now, from the Trainer's load of the checkpoint's adapters."""
    data = [{"input_ids": ids[0], "labels": ids[0]} for ids in random_batches(n=8, batch=1, length=8, seed=4)]

    def trainer(config: TaperNormConfig | None = None) -> Trainer:
        model = get_peft_model(
            patch_model(build(tiny_llama_config()), config or TaperNormConfig.paper()),
            LoraConfig(r=2, target_modules=["q_proj"]),
        )
        train_tapernorm_parameters(model)
        args = TrainingArguments(
            output_dir=str(tmp_path / "run"), max_steps=4, save_steps=2, per_device_train_batch_size=2,
            report_to=[], use_cpu=True, disable_tqdm=True, seed=0,
        )  # fmt: skip
        return Trainer(model=model, args=args, train_dataset=data, callbacks=[TaperCallback()])

    trainer().train()
    checkpoint = tmp_path / "run" / "checkpoint-2"
    assert (checkpoint / "adapter_model.safetensors").is_file() and not (checkpoint / "model.safetensors").exists()
    other = TaperNormConfig.paper(keep_norms=["model.layers.0.input_layernorm"])
    resumed = trainer() if resumed_with == "the same recipe" else trainer(other)
    with pytest.raises(TaperStateError) as caught:
        resumed.train(resume_from_checkpoint=str(checkpoint))
    assert str(caught.value) == (
        f"TaperCallback: {checkpoint} is a PEFT checkpoint, which holds only the adapters and none of the model's "
        "TaperNorm state (statistics, c, scale target, the norms' own weights): resuming a LoRA taper from it is not "
        "supported; run the LoRA taper again from step 0 without resume_from_checkpoint, or taper without PEFT, whose "
        "Trainer checkpoints hold the whole model"
    )


def test_a_checkpoints_adapters_load_after_the_lora_taper_has_trained(tmp_path):
    """After a LoRA taper's train() had ended, loading a checkpoint's adapters to evaluate them
    (set_peft_model_state_dict, load_adapter) was refused as a resume from a PEFT checkpoint: the callback's watch
    took every load of them for the Trainer's. Once training has ended they load; a resume is refused as before."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    data = [{"input_ids": ids[0], "labels": ids[0]} for ids in random_batches(n=8, batch=1, length=8, seed=4)]
    model = get_peft_model(
        patch_model(build(tiny_llama_config()), TaperNormConfig.paper()), LoraConfig(r=2, target_modules=["q_proj"])
    )
    train_tapernorm_parameters(model)
    args = TrainingArguments(
        output_dir=str(tmp_path / "run"), max_steps=4, save_steps=2, per_device_train_batch_size=2,
        report_to=[], use_cpu=True, disable_tqdm=True, seed=0,
    )  # fmt: skip
    Trainer(model=model, args=args, train_dataset=data, callbacks=[TaperCallback()]).train()
    checkpoint = tmp_path / "run" / "checkpoint-2"
    adapters = load_file(checkpoint / "adapter_model.safetensors")
    set_peft_model_state_dict(model, adapters)
    loaded = {name: value for name, value in model.state_dict().items() if "lora_A" in name}
    assert loaded and all(torch.equal(value, adapters[name.replace(".default", "")]) for name, value in loaded.items())
    model.load_adapter(str(checkpoint), adapter_name="at_step_2")
    assert "at_step_2" in model.peft_config
