"""TaperCallback inside a real transformers.Trainer (CPU, tiny Llama, a dozen optimizer steps)."""

from __future__ import annotations

import copy
import json
import logging
import pickle
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainerState, TrainingArguments

import hf_tapernorm.training.controller as controller_module
from hf_tapernorm import (
    ConfigurationError,
    TaperCallback,
    TaperController,
    TaperDivergenceError,
    TaperNormConfig,
    TaperStateError,
    load_tapered,
    patch_model,
)
from hf_tapernorm.layers import TaperNorm, gate_of, tapered_norms
from hf_tapernorm.layers.taper_norm import refuse_replaced_forward
from hf_tapernorm.training import TaperSchedule, place_first
from tests.conftest import build, tiny_llama_config

STEPS, K_START, K_END = 12, 3, 9
SEQ = 12


def _dataset(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (n, SEQ), generator=generator)
    mask = torch.ones_like(ids)
    mask[::3, -3:] = 0  # some right padding, so the scale loss's masking is exercised
    labels = ids.masked_fill(mask == 0, -100)
    return [{"input_ids": i, "attention_mask": m, "labels": lab} for i, m, lab in zip(ids, mask, labels)]


class GateRecorder(TrainerCallback):
    """Records (optimizer step number, gate) while the step's micro-batches have run."""

    def __init__(self) -> None:
        self.trace: list[tuple[int, float]] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.trace.append((state.global_step + 1, gate_of(model)))


class Reporter(TrainerCallback):
    """Stands for a reporting integration (TensorBoard, W&B) listed before TaperCallback."""

    def __init__(self) -> None:
        self.seen: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.seen.append(dict(logs))


def run_trainer(
    output_dir: Path,
    *,
    batch: int = 8,
    accumulation: int = 1,
    checkpointing: bool = False,
    save_steps: int | None = None,
    resume: str | bool | None = None,
    resume_argument: str | None = None,
    patched: bool = True,
    callbacks: tuple = (),
    taper: TaperCallback | None = None,
    first: bool = True,
    config: TaperNormConfig | None = None,
):
    model = build(tiny_llama_config(), seed=0)
    if patched:
        patch_model(model, config or TaperNormConfig.paper(ema_rate=0.1))
    args = TrainingArguments(
        output_dir=str(output_dir),
        max_steps=STEPS,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation,
        activation_checkpointing=checkpointing,
        learning_rate=3e-3,
        report_to=[],
        use_cpu=True,
        logging_steps=1,
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        train_sampling_strategy="sequential",
        disable_tqdm=True,
        seed=0,
        resume_from_checkpoint=resume_argument,
    )
    recorder = GateRecorder()
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=_dataset(STEPS * 8),
        callbacks=[*callbacks, taper or TaperCallback(K_START, K_END), recorder],
    )
    if first:
        place_first(trainer)
    trainer.train(resume_from_checkpoint=resume)
    return trainer, model, recorder.trace


def _c_values(model) -> dict[str, float]:
    return {name: float(layer.c) for name, layer in tapered_norms(model)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted run (8 x 1), with a checkpoint in the middle of the taper and calibration spied on."""
    calls: list[int] = []
    original = controller_module.calibrate

    def spy(model):
        calls.append(min(int(layer.ema_steps) for _, layer in tapered_norms(model)))  # steps of statistics
        return original(model)

    controller_module.calibrate = spy
    reporter = Reporter()
    try:
        out = tmp_path_factory.mktemp("reference")
        trainer, model, trace = run_trainer(out, save_steps=6, callbacks=(reporter,))
    finally:
        controller_module.calibrate = original
    return {"trainer": trainer, "model": model, "trace": trace, "calls": calls, "reporter": reporter, "out": out}


def test_gate_trace_follows_the_schedule_and_calibration_happens_once(reference):
    schedule = TaperSchedule(K_START, K_END, total_steps=STEPS)
    trace = reference["trace"]
    assert [step for step, _ in trace] == list(range(1, STEPS + 1))
    assert [gate for _, gate in trace] == pytest.approx([schedule.gate(k) for k in range(1, STEPS + 1)], abs=1e-7)
    assert [gate for _, gate in trace[:K_START]] == [1.0] * K_START
    assert [gate for _, gate in trace[K_END - 1 :]] == [0.0] * (STEPS - K_END + 1)
    model = reference["model"]
    assert gate_of(model) == 0.0
    assert reference["calls"] == [K_START]  # calibrated exactly once, after exactly k_start steps at g = 1...
    for _, layer in tapered_norms(model):  # ...and no statistics were gathered after it
        assert layer.is_calibrated and int(layer.ema_steps) == K_START
    anchor = model.model.norm.anchor
    assert anchor.is_frozen and int(anchor.ema_steps) == K_START


def test_taper_metrics_reach_reporters_listed_before_the_callback(reference):
    trainer, reporter = reference["trainer"], reference["reporter"]
    assert isinstance(trainer.callback_handler.callbacks[0], TaperCallback)
    training_logs = [logs for logs in reporter.seen if "loss" in logs]
    assert len(training_logs) == STEPS
    gates = [logs["taper/gate"] for logs in training_logs]
    assert gates[0] == 1.0 and gates[-1] == 0.0
    assert all(logs["taper/residual_scale"] > 0 for logs in training_logs)
    assert [logs["taper/scale_loss"] for logs in training_logs[:K_START]] == [0.0] * K_START
    assert all(logs["taper/scale_loss"] > 0 for logs in training_logs[K_START:])
    history = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["taper/gate"] for h in history] == gates


def _assert_same_run(reference, resumed, trace) -> None:
    assert trace == reference["trace"][6:]
    expected = reference["model"].state_dict()
    actual = resumed.state_dict()
    assert expected.keys() == actual.keys()
    assert any(k.endswith("anchor.target") for k in actual)
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=1e-6, atol=1e-7, msg=key)


def test_trainer_checkpoints_are_tapered_checkpoints_automodel_refuses(reference):
    """The Trainer saves through the patched model's save_pretrained: checkpoint-N names the tapered type, so
    AutoModelForCausalLM refuses it instead of loading the base model with its norms back; load_tapered reads it."""
    checkpoint = reference["out"] / "checkpoint-6"
    assert json.loads((checkpoint / "config.json").read_text())["model_type"] == "hf_tapernorm_tapered_llama"
    with pytest.raises(ValueError, match="hf_tapernorm_tapered_llama"):
        AutoModelForCausalLM.from_pretrained(checkpoint)
    assert gate_of(load_tapered(checkpoint)) < 1.0


def _copy_checkpoint(reference, folder: Path) -> Path:
    folder.parent.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copytree(reference["out"] / "checkpoint-6", folder))


@pytest.mark.parametrize("how", ["path", "true", "callbacks_first"])
def test_resume_mid_taper_equals_the_uninterrupted_run(reference, tmp_path, how):
    """``train(resume_from_checkpoint=<path>)`` and ``=True`` into the run's output_dir; and with another
    callback listed before TaperCallback and no place_first (the resume does not depend on the order)."""
    checkpoint = _copy_checkpoint(reference, tmp_path / "checkpoint-6")
    if how == "true":
        _, resumed, trace = run_trainer(tmp_path, resume=True)
    elif how == "path":
        _, resumed, trace = run_trainer(tmp_path, resume=str(checkpoint))
    else:
        reporter = Reporter()
        _, resumed, trace = run_trainer(tmp_path, resume=str(checkpoint), callbacks=(reporter,), first=False)
        assert [logs["taper/gate"] for logs in reporter.seen if "taper/gate" in logs] == []  # listed before it
    _assert_same_run(reference, resumed, trace)


def test_resume_from_a_checkpoint_outside_the_output_dir_needs_it_named_in_the_arguments(reference, tmp_path):
    checkpoint = _copy_checkpoint(reference, tmp_path / "elsewhere" / "checkpoint-6")
    expected = (
        r"TaperCallback: resuming at step 6, but no checkpoint with that state is in .*run[/\\]checkpoint-6; "
        r"a checkpoint outside output_dir must also be named in TrainingArguments\(resume_from_checkpoint=\.\.\.\)"
    )
    with pytest.raises(TaperStateError, match=expected):
        run_trainer(tmp_path / "run", resume=str(checkpoint))
    _, resumed, trace = run_trainer(tmp_path / "run2", resume=str(checkpoint), resume_argument=str(checkpoint))
    _assert_same_run(reference, resumed, trace)


def test_a_checkpoint_folder_of_another_state_is_not_taken(reference, tmp_path):
    """output_dir/checkpoint-6 exists but is not what the Trainer restored (another run's log history)."""
    checkpoint = _copy_checkpoint(reference, tmp_path / "elsewhere" / "checkpoint-6")
    other = _copy_checkpoint(reference, tmp_path / "run" / "checkpoint-6")
    state = json.loads((other / "trainer_state.json").read_text())
    state["log_history"][0]["loss"] += 1.0
    (other / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(TaperStateError, match=r"resuming at step 6, but no checkpoint with that state"):
        run_trainer(tmp_path / "run", resume=str(checkpoint))


@pytest.mark.parametrize("how", ["path", "true"])
def test_a_checkpoint_of_another_recipe_is_refused_before_the_trainer_loads_its_optimizer(reference, tmp_path, how):
    """A model patched with other keep_norms trains other parameters: the Trainer's optimizer load, which comes
    before TaperCallback's first event of train(), failed in torch's words ("loaded state dict contains a parameter
    group that doesn't match"). The documented refusal naming the fields that differ now comes first, from the
    Trainer's load of the checkpoint's weights into the model."""
    checkpoint = _copy_checkpoint(reference, tmp_path / "checkpoint-6")
    other = TaperNormConfig.paper(ema_rate=0.1, keep_norms=["model.layers.0.input_layernorm"])
    with pytest.raises(TaperStateError) as caught:
        run_trainer(tmp_path, resume=True if how == "true" else str(checkpoint), config=other)
    assert str(caught.value) == (
        f"TaperCallback: the checkpoint {checkpoint} was written with another TaperNormConfig (keep_norms: [] in the "
        "checkpoint, ['model.layers.0.input_layernorm'] now); patch the model with the checkpoint's config to resume it"
    )


OTHER_NORMS = TaperNormConfig.paper(ema_rate=0.1, keep_norms=["model.layers.0.input_layernorm"])


def _fields_refusal(checkpoint: Path) -> str:
    return (
        f"TaperCallback: the checkpoint {checkpoint} was written with another TaperNormConfig (keep_norms: [] in the "
        "checkpoint, ['model.layers.0.input_layernorm'] now); patch the model with the checkpoint's config to resume it"
    )


def test_a_checkpoint_of_another_recipe_outside_the_output_dir_is_refused_before_the_optimizer_load(
    reference, tmp_path
):
    """train(resume_from_checkpoint=<folder outside output_dir>), not named in the arguments, is no checkpoint the
    watch could find: another recipe's reached the Trainer's optimizer load and torch's "parameter group" ValueError.
    What is being loaded tells now: its statistics show that it tapered a norm this model keeps, and the refusal says
    how to have its fields named. Named in the arguments, the fields are named."""
    checkpoint = _copy_checkpoint(reference, tmp_path / "elsewhere" / "checkpoint-6")
    with pytest.raises(TaperStateError) as caught:
        run_trainer(tmp_path / "run", resume=str(checkpoint), config=OTHER_NORMS)
    assert str(caught.value) == (
        "TaperCallback: the checkpoint being loaded tapered other norms than the model's TaperNormConfig tapers "
        "(tapered in it, kept now: model.layers.0.input_layernorm), so it was written with another TaperNormConfig; "
        "patch the model with the checkpoint's config to resume it (a checkpoint outside output_dir must also be "
        "named in TrainingArguments(resume_from_checkpoint=...), where TaperCallback reads its recipe and names the "
        "fields that differ)"
    )
    with pytest.raises(TaperStateError) as caught:
        run_trainer(tmp_path / "run", resume=str(checkpoint), resume_argument=str(checkpoint), config=OTHER_NORMS)
    assert str(caught.value) == _fields_refusal(checkpoint)


def test_a_second_train_of_the_same_trainer_is_watched_too(reference, tmp_path):
    """The load watch was removed at the first on_train_begin: after a finished train(), the same Trainer's
    train(resume_from_checkpoint=<another recipe's checkpoint in output_dir>) failed in torch's words. It watches
    every train() of the Trainer now; the model is left as it was (the watch refuses before anything is loaded)."""
    trainer, model, _ = run_trainer(tmp_path, config=OTHER_NORMS)
    checkpoint = _copy_checkpoint(reference, tmp_path / "checkpoint-6")
    before = {key: value.clone() for key, value in model.state_dict().items()}
    with pytest.raises(TaperStateError) as caught:
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert str(caught.value) == _fields_refusal(checkpoint)
    assert all(torch.equal(before[key], value) for key, value in model.state_dict().items())
    # Copies of the watched model (a distillation teacher is a deep copy; a pickled model) keep patch_model's layout
    # check, in the model's words, not the callback's, which watches the model it was given.
    for duplicate in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        with pytest.raises(TaperStateError, match=r"^LlamaForCausalLM\.load_state_dict: the state being loaded"):
            duplicate.load_state_dict(load_file(checkpoint / "model.safetensors"))


def _trainer_with_added_callback(tmp_path: Path, model) -> Trainer:
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=8, report_to=[],
                             use_cpu=True, save_strategy="no", disable_tqdm=True)  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=_dataset(STEPS * 8))
    trainer.add_callback(TaperCallback(K_START, K_END))
    return trainer


def test_a_callback_added_with_add_callback_watches_the_trainers_later_loads(reference, tmp_path):
    """trainer.add_callback(TaperCallback()) never gets on_init_end, so the load watch never started and another
    recipe's checkpoint reached torch's optimizer error. The Trainer sends such a callback no event before the loads
    of its first train() (on_train_begin comes after them); it watches from there, so the next train() is refused in
    one line naming the fields."""
    trainer = _trainer_with_added_callback(tmp_path, patch_model(build(tiny_llama_config(), seed=0), OTHER_NORMS))
    trainer.train()
    checkpoint = _copy_checkpoint(reference, tmp_path / "checkpoint-6")
    with pytest.raises(TaperStateError) as caught:
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert str(caught.value) == _fields_refusal(checkpoint)


def test_the_first_train_of_a_callback_added_with_add_callback_refuses_another_recipes_checkpoint(reference, tmp_path):
    """The first train() of a Trainer given TaperCallback by add_callback, resumed from a checkpoint that tapered
    other norms, loaded its weights and failed in torch's words on the optimizer's parameter groups: no callback
    event comes before those loads. The model's own load watch (patch_model's) refuses it now, before anything
    is loaded, in one line that says how to load it."""
    model = patch_model(build(tiny_llama_config(), seed=0), OTHER_NORMS)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    trainer = _trainer_with_added_callback(tmp_path, model)
    checkpoint = _copy_checkpoint(reference, tmp_path / "checkpoint-6")
    with pytest.raises(TaperStateError) as caught:
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert str(caught.value) == (
        "LlamaForCausalLM.load_state_dict: the state being loaded tapered other norms than the model's "
        "TaperNormConfig tapers (tapered in it, kept now: model.layers.0.input_layernorm), so it was written with "
        "another TaperNormConfig; patch the model with that config (the tapernorm_config.json saved with it) to load it"
    )
    assert all(torch.equal(before[key], value) for key, value in model.state_dict().items())


def test_a_checkpoint_of_an_unpatched_model_is_refused_before_the_trainer_loads_its_optimizer(tmp_path):
    """A patched model's Trainer resumed from a plain Trainer's checkpoint (the model unpatched) loaded its weights
    and failed in torch's words on the optimizer's parameter groups: the checkpoint holds no TaperNorm state, no
    recipe, and the callback's own message for it came after the optimizer's load. It is refused before anything
    loads now, with the callback given to Trainer(...) and with add_callback alike."""
    plain = build(tiny_llama_config(), seed=0)
    args = TrainingArguments(output_dir=str(tmp_path / "plain"), max_steps=4, per_device_train_batch_size=8,
                             report_to=[], use_cpu=True, save_strategy="steps", save_steps=2)  # fmt: skip
    Trainer(model=plain, args=args, train_dataset=_dataset(32)).train()
    checkpoint = tmp_path / "plain" / "checkpoint-4"
    with pytest.raises(TaperStateError) as caught:
        run_trainer(tmp_path / "run", resume=str(checkpoint), resume_argument=str(checkpoint))
    assert str(caught.value) == (
        "TaperCallback: the checkpoint being loaded holds the norms' weights but no TaperNorm state (gate, c, "
        "statistics), so a model that patch_model had not patched wrote it; resume a checkpoint of a tapered run, or "
        "start this run without resume_from_checkpoint (patch_model the checkpoint's model to taper it from there)"
    )
    model = patch_model(build(tiny_llama_config(), seed=0), TaperNormConfig.paper(ema_rate=0.1))
    before = {key: value.clone() for key, value in model.state_dict().items()}
    with pytest.raises(TaperStateError) as caught:
        _trainer_with_added_callback(tmp_path / "added", model).train(resume_from_checkpoint=str(checkpoint))
    assert str(caught.value) == (
        "LlamaForCausalLM.load_state_dict: the state being loaded holds the norms' weights but none of their "
        "TaperNorm state (gate, c, statistics), as an unpatched model's does; load an unpatched model's weights "
        "before patch_model, a tapered checkpoint with hf_tapernorm.load_tapered, or the norms' weights with their "
        "TaperNorm state"
    )
    assert all(torch.equal(before[key], value) for key, value in model.state_dict().items())


def test_a_second_train_from_step_0_of_a_tapered_model_is_refused(tmp_path):
    """trainer.train() again (no resume) after a run that ended at gate 0 started a new schedule at gate 1 over the
    tapered model without a word: the Trainer's second train() is a new run from step 0. It is refused at train
    begin now, before any step, and the model keeps its gate; resuming that run's checkpoint is the way on."""
    trainer, model, _ = run_trainer(tmp_path)
    assert gate_of(model) == 0.0
    with pytest.raises(TaperStateError) as caught:
        trainer.train()
    assert str(caught.value) == (
        "TaperCallback: the model holds gate 0.000000, so an earlier train() or run tapered it, and this train() "
        "starts at step 0, whose gate 1.000000 would set it back up over a model trained at the lower one; resume "
        "that run's checkpoint (train(resume_from_checkpoint=...)), or patch a fresh model for a new run"
    )
    assert gate_of(model) == 0.0 and trainer.state.global_step == 0


def test_reporting_integrations_without_place_first_are_warned_about(caplog):
    model = patch_model(build(tiny_llama_config()), TaperNormConfig.paper())
    state = TrainerState(max_steps=STEPS)
    args = SimpleNamespace(report_to=["wandb"], output_dir="unused")
    with caplog.at_level(logging.WARNING, logger="hf_tapernorm.training.callback"):
        TaperCallback(K_START, K_END).on_train_begin(args, state, None, model=model)
    assert "report_to=['wandb'] run before it and miss the taper/* log keys" in caplog.text
    assert "hf_tapernorm.training.place_first(trainer)" in caplog.text
    caplog.clear()
    placed = TaperCallback(K_START, K_END)
    placed.placed_first = True
    with caplog.at_level(logging.WARNING, logger="hf_tapernorm.training.callback"):  # another Trainer's state
        placed.on_train_begin(args, TrainerState(max_steps=STEPS), None, model=model)
    assert "miss the taper/* log keys" not in caplog.text


def test_place_first_needs_exactly_one_taper_callback(tmp_path):
    model = patch_model(build(tiny_llama_config()), TaperNormConfig.paper())
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=STEPS, report_to=[], use_cpu=True)
    trainer = Trainer(model=model, args=args, train_dataset=_dataset(8), callbacks=[Reporter()])
    with pytest.raises(ConfigurationError, match=r"place_first: the Trainer holds 0 TaperCallback\(s\)"):
        place_first(trainer)


TWO_CALLBACKS = (
    "TaperCallback: the Trainer holds 2 or more TaperCallback(s); keep one: each sets the gate at every step, and the "
    "last one's window would win (pass one in Trainer(callbacks=[...]), or add one with trainer.add_callback, not both)"
)


def _small_args(output_dir: Path, **overrides) -> TrainingArguments:
    """Arguments of an 8-step run (16 rows of batch 2 per epoch), no checkpoints."""
    options = dict(
        output_dir=str(output_dir),
        max_steps=8,
        per_device_train_batch_size=2,
        learning_rate=3e-3,
        report_to=[],
        use_cpu=True,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    return TrainingArguments(**{**options, **overrides})


def _patched() -> torch.nn.Module:
    return patch_model(build(tiny_llama_config(), seed=0), TaperNormConfig.paper(ema_rate=0.1))


@pytest.mark.parametrize("same", [False, True], ids=["two windows", "the same callback twice"])
def test_two_taper_callbacks_in_one_trainer_are_refused_when_it_is_built(tmp_path, same):
    """Trainer(callbacks=[TaperCallback(2, 5), TaperCallback(2, 6)]) trained to the end without a word, the gate
    following the last one's window (place_first alone knew that two are an error). Refused inside Trainer(...) now,
    two identical ones as well (each would calibrate and set the gate)."""
    first = TaperCallback(2, 5)
    with pytest.raises(ConfigurationError) as caught:
        Trainer(model=_patched(), args=_small_args(tmp_path), train_dataset=_dataset(16),
                callbacks=[first, first if same else TaperCallback(2, 6)])  # fmt: skip
    assert str(caught.value) == TWO_CALLBACKS


def test_a_second_taper_callback_added_later_is_refused_before_the_first_step(tmp_path):
    """trainer.add_callback(TaperCallback(3, 5)) beside Trainer(callbacks=[TaperCallback(2, 6)]) trained with the
    3-5 window, without a word. The Trainer sends the added one no event before train(): refused at its
    on_train_begin, before any step; the model keeps gate 1."""
    model = _patched()
    trainer = Trainer(model=model, args=_small_args(tmp_path), train_dataset=_dataset(16),
                      callbacks=[TaperCallback(2, 6)])  # fmt: skip
    trainer.add_callback(TaperCallback(3, 5))
    with pytest.raises(ConfigurationError) as caught:
        trainer.train()
    assert str(caught.value) == TWO_CALLBACKS
    assert trainer.state.global_step == 0 and gate_of(model) == 1.0


def test_one_taper_callback_passes_the_check_in_every_train(tmp_path):
    """The check counts the callbacks of one Trainer state: a second train() (a new state) of one callback is no
    second callback."""
    trainer = Trainer(model=_patched(), args=_small_args(tmp_path), train_dataset=_dataset(16),
                      callbacks=[TaperCallback(2, 6)])  # fmt: skip
    trainer.train()
    with pytest.raises(TaperStateError, match="an earlier train\\(\\) or run tapered it"):
        trainer.train()  # refused for the model it tapered, not for a second callback


def _decay_rates(trainer: Trainer) -> list[float]:
    return [entry["learning_rate"] for entry in trainer.state.log_history if "taper/gate" in entry]


def test_two_trainers_sharing_arguments_each_decay_after_their_own_taper(tmp_path):
    """One TrainingArguments(max_steps=8, lr_scheduler_type="warmup_stable_decay") for two Trainers: the first one's
    TaperCallback(2, 6) wrote num_decay_steps=2 into the shared arguments, and the second (window 2-4) read it as the
    user's: its learning rate stayed up until step 7, three steps after its gate reached 0. Each gets its own now
    (2, then 4), and the user's kwargs dict is never changed in place."""
    given: dict = {}
    args = _small_args(tmp_path, lr_scheduler_type="warmup_stable_decay", lr_scheduler_kwargs=given)
    first = Trainer(model=_patched(), args=args, train_dataset=_dataset(16), callbacks=[TaperCallback(2, 6)])
    assert args.lr_scheduler_kwargs == {"num_decay_steps": 2}
    first.train()
    second = Trainer(model=_patched(), args=args, train_dataset=_dataset(16), callbacks=[TaperCallback(2, 4)])
    assert args.lr_scheduler_kwargs == {"num_decay_steps": 4} and given == {}
    second.train()
    # Cosine decays from the gate's 0: step 4 of the second (num_decay_steps 4), step 6 of the first (2).
    assert _decay_rates(second) == pytest.approx([3e-3] * 5 + [2.561e-3, 1.5e-3, 0.439e-3], abs=1e-6)
    assert _decay_rates(first) == pytest.approx([3e-3] * 7 + [1.5e-3], abs=1e-6)


@pytest.mark.parametrize("copied", ["replace", "deepcopy", "pickle", "asdict"])
def test_a_copy_of_the_arguments_gets_its_own_written_decay_steps(tmp_path, copied):
    """Trainer(args, callbacks=[TaperCallback(2, 5)]) wrote num_decay_steps=3 (for 8 steps) into args, then
    ``dataclasses.replace(args, max_steps=12)`` (or a deepcopy) carried the dict without the mark kept on the
    arguments, and a second Trainer took 3 as the user's: its learning rate stayed up until step 9, four steps after
    its gate reached 0. The mark travels with the dict now: the copy's Trainer writes its own (7), and trains as on
    arguments of its own; the written dict still reads as a plain dict (to_dict, json)."""
    import dataclasses

    args = _small_args(tmp_path / "a", lr_scheduler_type="warmup_stable_decay")
    Trainer(model=_patched(), args=args, train_dataset=_dataset(16), callbacks=[TaperCallback(2, 5)])
    assert json.loads(args.to_json_string())["lr_scheduler_kwargs"] == {"num_decay_steps": 3}
    if copied == "replace":
        copy_of_args = dataclasses.replace(args, max_steps=12, output_dir=str(tmp_path / "b"))
    elif copied == "asdict":  # arguments rebuilt from their dict: asdict rebuilds each dict value from its pairs
        values = dataclasses.asdict(args)
        init = {f.name: values[f.name] for f in dataclasses.fields(args) if f.init}
        copy_of_args = TrainingArguments(**{**init, "max_steps": 12, "output_dir": str(tmp_path / "b")})
    else:
        copy_of_args = copy.deepcopy(args) if copied == "deepcopy" else pickle.loads(pickle.dumps(args))
        copy_of_args.max_steps, copy_of_args.output_dir = 12, str(tmp_path / "b")
    copied_run = Trainer(
        model=_patched(), args=copy_of_args, train_dataset=_dataset(16), callbacks=[TaperCallback(2, 5)]
    )
    assert copy_of_args.lr_scheduler_kwargs == {"num_decay_steps": 7} and args.lr_scheduler_kwargs == {
        "num_decay_steps": 3
    }
    copied_run.train()
    own_args = _small_args(tmp_path / "c", max_steps=12, lr_scheduler_type="warmup_stable_decay")
    own = Trainer(model=_patched(), args=own_args, train_dataset=_dataset(16), callbacks=[TaperCallback(2, 5)])
    own.train()
    assert _decay_rates(copied_run)[:7] == pytest.approx([3e-3] * 6 + [2.85145e-3], abs=1e-6)
    assert _decay_rates(copied_run) == pytest.approx(_decay_rates(own), abs=1e-12)


def test_the_arguments_print_and_convert_after_the_callback_wrote_the_decay_steps(tmp_path):
    """Once TaperCallback wrote num_decay_steps, ``print(args)`` (TrainingArguments' str and repr call
    dataclasses.asdict), ``dataclasses.asdict`` and ``astuple`` raised TypeError: they rebuild a dict value from its
    pairs, which the written dict's constructor did not take. They read it as the dict it is now."""
    import dataclasses

    args = _small_args(tmp_path, lr_scheduler_type="warmup_stable_decay")
    Trainer(model=_patched(), args=args, train_dataset=_dataset(16), callbacks=[TaperCallback(2, 5)])
    assert "lr_scheduler_kwargs={'num_decay_steps': 3}," in str(args) and repr(args) == str(args)
    assert dataclasses.asdict(args)["lr_scheduler_kwargs"] == {"num_decay_steps": 3}
    assert {"num_decay_steps": 3} in dataclasses.astuple(args)
    assert type(args.lr_scheduler_kwargs)(args.lr_scheduler_kwargs).run_length == 8


def test_a_users_num_decay_steps_is_kept_by_every_trainer(tmp_path):
    """A num_decay_steps the user set (also after a Trainer had written its own) is the user's: never recomputed."""
    args = _small_args(tmp_path, lr_scheduler_type="warmup_stable_decay", lr_scheduler_kwargs={"num_decay_steps": 5})
    Trainer(model=_patched(), args=args, train_dataset=_dataset(16), callbacks=[TaperCallback(2, 4)])
    assert args.lr_scheduler_kwargs == {"num_decay_steps": 5}
    args.lr_scheduler_kwargs = {}
    Trainer(model=_patched(), args=args, train_dataset=_dataset(16), callbacks=[TaperCallback(2, 6)])
    args.lr_scheduler_kwargs["num_decay_steps"] = 3  # the user's change of the written dict
    Trainer(model=_patched(), args=args, train_dataset=_dataset(16), callbacks=[TaperCallback(2, 4)])
    assert args.lr_scheduler_kwargs == {"num_decay_steps": 3}


def test_an_added_callback_refuses_another_trainers_decay_steps(tmp_path):
    """A callback added with trainer.add_callback gets no event before the Trainer builds its scheduler, which would
    then decay after another Trainer's taper end (num_decay_steps written for that one's window): refused before the
    first step, naming both values."""
    args = _small_args(tmp_path, lr_scheduler_type="warmup_stable_decay")
    Trainer(model=_patched(), args=args, train_dataset=_dataset(16), callbacks=[TaperCallback(2, 6)])
    trainer = Trainer(model=_patched(), args=args, train_dataset=_dataset(16))
    trainer.add_callback(TaperCallback(2, 4))
    with pytest.raises(ConfigurationError) as caught:
        trainer.train()
    assert str(caught.value) == (
        "TaperCallback: lr_scheduler_kwargs holds num_decay_steps=2, which another Trainer's TaperCallback set for "
        "its window on these TrainingArguments (this run's is 4), and the Trainer built the scheduler with it before "
        "this callback, added with trainer.add_callback, saw a step; pass the callback in Trainer(callbacks=[...]) "
        "(it sets the value when the Trainer is built), or set num_decay_steps in lr_scheduler_kwargs"
    )


def test_a_trainer_built_before_another_on_shared_arguments_refuses_its_decay_steps(tmp_path):
    """Trainer A (TaperCallback(2, 6)) and then Trainer B (TaperCallback(2, 4)) built on one TrainingArguments, then
    A.train(): A trained with B's num_decay_steps=4 (its learning rate decayed from step 5, while its gate still
    fell), without a word. A's train() is refused now before the first step, naming both values; B trains."""
    args = _small_args(tmp_path, lr_scheduler_type="warmup_stable_decay")
    model = _patched()
    first = Trainer(model=model, args=args, train_dataset=_dataset(16), callbacks=[TaperCallback(2, 6)])
    second = Trainer(model=_patched(), args=args, train_dataset=_dataset(16), callbacks=[TaperCallback(2, 4)])
    with pytest.raises(ConfigurationError) as caught:
        first.train()
    assert str(caught.value) == (
        "TaperCallback: lr_scheduler_kwargs holds num_decay_steps=4, which another Trainer's TaperCallback set for "
        "its window on these shared TrainingArguments (this run's is 2), and the Trainer built the scheduler with it; "
        "give each Trainer its own TrainingArguments and change none after building it, or set num_decay_steps in "
        "lr_scheduler_kwargs"
    )
    assert first.state.global_step == 0 and gate_of(model) == 1.0
    second.train()
    assert _decay_rates(second) == pytest.approx([3e-3] * 5 + [2.561e-3, 1.5e-3, 0.439e-3], abs=1e-6)


def test_max_steps_changed_after_the_trainer_was_built_refuses_the_written_decay_steps(tmp_path):
    """args.max_steps changed from 8 to 10 after Trainer(callbacks=[TaperCallback(2, 5)]) was built: it trained 10
    steps with num_decay_steps=3 (computed for 8), so the learning rate stayed up until step 8 although the gate
    reached 0 at step 5. Refused at the start of train() now, naming both lengths."""
    args = _small_args(tmp_path, lr_scheduler_type="warmup_stable_decay")
    trainer = Trainer(model=_patched(), args=args, train_dataset=_dataset(16), callbacks=[TaperCallback(2, 5)])
    args.max_steps = 10
    with pytest.raises(ConfigurationError) as caught:
        trainer.train()
    assert str(caught.value) == (
        "TaperCallback: lr_scheduler_kwargs holds num_decay_steps=3, set for max_steps=8 when the Trainer was built, "
        "but this run has max_steps=10 (this run's is 5), and the Trainer built the scheduler with it; give each "
        "Trainer its own TrainingArguments and change none after building it, or set num_decay_steps in "
        "lr_scheduler_kwargs"
    )
    assert trainer.state.global_step == 0


def test_num_stable_steps_without_num_decay_steps_is_refused_when_the_trainer_is_built(tmp_path):
    """lr_scheduler_kwargs={"num_stable_steps": 3} with warmup_stable_decay and no num_decay_steps failed in train()
    with transformers' TypeError (get_wsd_schedule() missing num_decay_steps): the callback leaves a user's
    num_stable_steps alone and set nothing. Refused in one line inside Trainer(...) now, naming num_decay_steps."""
    args = _small_args(tmp_path, lr_scheduler_type="warmup_stable_decay", lr_scheduler_kwargs={"num_stable_steps": 3})
    with pytest.raises(ConfigurationError) as caught:
        Trainer(model=_patched(), args=args, train_dataset=_dataset(16), callbacks=[TaperCallback(2, 5)])
    assert str(caught.value) == (
        "TaperCallback: lr_scheduler_type='warmup_stable_decay' with num_stable_steps needs num_decay_steps in "
        "lr_scheduler_kwargs too (the scheduler fails in train() without it); add num_decay_steps, or leave "
        "num_stable_steps out and TaperCallback sets num_decay_steps to the steps after the gate reaches 0"
    )


def test_warmup_stable_decay_by_epochs_without_decay_steps_is_refused_when_the_trainer_is_built(tmp_path):
    """The README's recipe (warmup_stable_decay, no num_decay_steps) with num_train_epochs instead of max_steps
    failed in trainer.train() with transformers' TypeError (get_wsd_schedule() missing num_decay_steps): the Trainer
    builds the scheduler before any event that knows an epoch run's length. Refused in one line inside Trainer(...)
    now, naming both ways out; with num_decay_steps given, the run by epochs trains."""
    args = _small_args(tmp_path, max_steps=-1, num_train_epochs=2, lr_scheduler_type="warmup_stable_decay")
    with pytest.raises(ConfigurationError) as caught:
        Trainer(model=_patched(), args=args, train_dataset=_dataset(16), callbacks=[TaperCallback(2, 5)])
    assert str(caught.value) == (
        "TaperCallback: lr_scheduler_type='warmup_stable_decay' without num_decay_steps decays the learning rate after "
        "the gate reaches 0, a step known only from max_steps, and this run is set by num_train_epochs; set max_steps "
        "in TrainingArguments, or lr_scheduler_kwargs={'num_decay_steps': N}"
    )
    args.lr_scheduler_kwargs = {"num_decay_steps": 11}
    trainer = Trainer(model=_patched(), args=args, train_dataset=_dataset(16), callbacks=[TaperCallback(2, 5)])
    trainer.train()
    assert trainer.state.global_step == 16 and args.lr_scheduler_kwargs == {"num_decay_steps": 11}


def test_resume_without_patching_fails_clearly(reference, tmp_path):
    expected = r"TaperCallback: LlamaForCausalLM has no TaperNorm layers: call hf_tapernorm\.patch_model"
    with pytest.raises(TaperStateError, match=expected):
        run_trainer(tmp_path, resume=str(reference["out"] / "checkpoint-6"), patched=False)


def test_schedule_longer_than_the_run_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"k_start=3, k_end=20, total_steps=12.*after the run's last step 12"):
        run_trainer(tmp_path, taper=TaperCallback(3, 20))


def test_gradient_accumulation_gives_the_same_gates_and_c(reference, tmp_path):
    _, accumulated, trace = run_trainer(tmp_path, batch=4, accumulation=2)
    assert trace == reference["trace"]
    expected = _c_values(reference["model"])
    assert _c_values(accumulated) == pytest.approx(expected, rel=1e-5)
    for key, value in reference["model"].state_dict().items():
        torch.testing.assert_close(accumulated.state_dict()[key], value, rtol=1e-4, atol=1e-5, msg=key)


def test_gradient_checkpointing_does_not_double_count_statistics(reference, tmp_path):
    _, checkpointed, trace = run_trainer(tmp_path, checkpointing=True)
    assert checkpointed.is_activation_checkpointing
    assert trace == reference["trace"]
    for _, layer in tapered_norms(checkpointed):
        assert int(layer.ema_steps) == K_START
    assert _c_values(checkpointed) == pytest.approx(_c_values(reference["model"]), rel=1e-5)


class Poison(TrainerCallback):
    """Sends one weight to NaN before optimizer step 6 runs."""

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step == 5:
            with torch.no_grad():
                model.model.layers[1].mlp.down_proj.weight.fill_(float("nan"))


def test_divergence_stops_before_a_broken_checkpoint_is_written(tmp_path):
    with pytest.raises(TaperDivergenceError, match=r"optimizer step 6 \(gate 0\.5000\).*loss is not finite") as error:
        run_trainer(tmp_path, save_steps=3, callbacks=(Poison(),))
    assert "First layer with non-finite parameters: model.layers.0.input_layernorm" in str(error.value)
    saved = sorted(p.name for p in tmp_path.glob("checkpoint-*"))
    assert saved == ["checkpoint-3"]  # step 6 diverged: no checkpoint-6


# ---------------------------------------------------------------------- the controller without a Trainer
def test_controller_refuses_a_checkpoint_without_taper_state():
    model = patch_model(
        build(tiny_llama_config()), TaperNormConfig.paper()
    )  # freshly patched: no statistics, not calibrated
    controller = TaperController(model, TaperSchedule(K_START, K_END), total_steps=STEPS)
    controller.check_resume(0)  # a fresh run is fine
    expected = r"resuming at optimizer step 5 \(k_start=3\) but 4 TaperNorm layer\(s\) lack their calibration state"
    with pytest.raises(RuntimeError, match=expected + r" \(first: model\.layers\.0\.input_layernorm\)"):
        controller.check_resume(5)


def test_controller_load_state_refuses_the_state_of_another_recipe(tmp_path):
    """load_state of another run's save_state folder (a gated-mlp recipe, another model) was taken without a word,
    and the run distilled towards that run's teacher. The folder's tapernorm_config.json is compared with the
    model's config now, as TaperCallback compares a checkpoint's on resume; allow_changes lets named fields differ."""
    other = _for_model()
    TaperController(other, total_steps=8).save_state(tmp_path / "state")
    model = patch_model(build(tiny_llama_config(bos_token_id=1), seed=1), TaperNormConfig.paper(sink_token_ids=[1]))
    controller = TaperController(model, total_steps=8)
    with pytest.raises(TaperStateError) as caught:
        controller.load_state(tmp_path / "state")
    assert str(caught.value) == (
        f"TaperController.load_state: the checkpoint {tmp_path / 'state'} was written with another TaperNormConfig "
        "(scope: 'all' in the checkpoint, 'internal' now; keep_norms: ['model.layers.0.input_layernorm', "
        "'model.layers.0.post_attention_layernorm', 'model.layers.1.post_attention_layernorm'] in the checkpoint, [] "
        "now; relative_scale_loss: True in the checkpoint, False now; distill_weight: 1.0 in the checkpoint, 0.0 now; "
        "sink_attention_weight: 3.0 in the checkpoint, 0.0 now; recipe: 'gated-mlp' in the checkpoint, 'paper' now); "
        "patch the model with the checkpoint's config to resume it"
    )
    ema = TaperNormConfig.paper(sink_token_ids=[1], ema_rate=0.1)
    TaperController(patch_model(build(tiny_llama_config(bos_token_id=1)), ema), total_steps=8).save_state(
        tmp_path / "e"
    )
    controller.load_state(tmp_path / "e", allow_changes=["ema_rate"])
    with pytest.raises(
        TaperStateError, match=r"another TaperNormConfig \(ema_rate: 0\.1 in the checkpoint, 0\.01 now\)"
    ):
        controller.load_state(tmp_path / "e")


def test_controller_needs_the_run_length_and_refuses_unpatched_or_zero3_models():
    with pytest.raises(ValueError, match="TaperController needs total_steps"):
        TaperController(patch_model(build(tiny_llama_config()), TaperNormConfig.paper()), TaperSchedule(0.1, 0.5))
    with pytest.raises(TaperStateError, match=r"LlamaForCausalLM has no TaperNorm layers"):
        TaperController(build(tiny_llama_config()), total_steps=10)
    zero3 = patch_model(build(tiny_llama_config()), TaperNormConfig.paper())
    next(zero3.parameters()).ds_id = 0  # what DeepSpeed ZeRO-3 puts on every partitioned parameter
    with pytest.raises(
        ConfigurationError, match=r"does not support DeepSpeed ZeRO-3 parameter sharding.*Shard with FSDP2"
    ):
        TaperController(zero3, total_steps=10)


def test_residual_scale_runaway_names_step_gate_and_site():
    model = patch_model(build(tiny_llama_config()), TaperNormConfig.paper(ema_rate=0.1)).train()
    controller = TaperController(model, TaperSchedule(1, 4), total_steps=4, max_scale_ratio=10.0)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    controller.step_begin(0)
    model(input_ids=ids, labels=ids)
    controller.step_end(0)
    controller.step_begin(1)  # calibrated; the target is the warmup scale
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(1000.0)  # the residual stream explodes
    model(input_ids=ids, labels=ids)
    expected = r"optimizer step 2 \(gate 0\.7500\): the residual scale entering model\.norm is .*x its target"
    with pytest.raises(TaperDivergenceError, match=expected + r".*\(limit 10x\)\. Lower the learning rate"):
        controller.step_end(1)


def test_a_loss_reported_by_the_loop_is_watched_too():
    model = patch_model(build(tiny_llama_config()), TaperNormConfig.paper(ema_rate=0.1)).train()
    controller = TaperController(model, TaperSchedule(1, 4), total_steps=4)
    controller.step_begin(0)
    model(input_ids=torch.zeros(1, 4, dtype=torch.long))  # no labels: the loop computes its own loss
    with pytest.raises(
        TaperDivergenceError, match=r"optimizer step 1 \(gate 1\.0000\): the training loss is not finite"
    ):
        controller.step_end(0, loss=float("inf"))


@pytest.mark.parametrize(
    "find_unused,checkpointing,fails",
    [(None, False, False), (None, True, True), (True, True, False), (False, False, True)],
)
def test_ddp_without_unused_parameter_detection_is_refused_early(find_unused, checkpointing, fails):
    # Measured with tests/distributed_taper.py and activation checkpointing on 2 ranks: DDP then fails at the
    # second step ("Expected to have finished reduction in the prior iteration"); with True it trains.
    args = SimpleNamespace(
        world_size=2,
        deepspeed=None,
        fsdp=None,
        activation_checkpointing=checkpointing,
        ddp_find_unused_parameters=find_unused,
    )
    model = patch_model(build(tiny_llama_config()), TaperNormConfig.paper())
    callback = TaperCallback()
    if fails:
        with pytest.raises(ValueError, match=r"needs ddp_find_unused_parameters=True in TrainingArguments"):
            callback.on_init_end(args, None, None, model=model)
    else:
        callback.on_init_end(args, None, None, model=model)


def _trainer(tmp_path: Path, model, **options) -> Trainer:
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=8, report_to=[], use_cpu=True,
        disable_tqdm=True, **{"save_strategy": "no", **options},
    )  # fmt: skip
    return Trainer(model=model, args=args, train_dataset=_dataset(STEPS * 8), eval_dataset=_dataset(8),
                   callbacks=[TaperCallback(K_START, K_END)])  # fmt: skip


def test_load_best_model_at_end_is_refused_when_the_trainer_is_built(tmp_path):
    """The Trainer would load its best checkpoint (one of gate 1, whose loss is lower) over the tapered model."""
    model = patch_model(build(tiny_llama_config()), TaperNormConfig.paper())
    options = dict(eval_strategy="steps", eval_steps=4, save_strategy="steps", save_steps=4)
    with pytest.raises(
        ConfigurationError, match=r"^TaperCallback: load_best_model_at_end=True .*set load_best_model_at_end=False"
    ):
        _trainer(tmp_path, model, **options, load_best_model_at_end=True)


LOST_TERMS = (
    "so outputs.loss is None and the recipe's terms added to it (scale_loss_weight=0.1, distill_weight=1, "
    "sink_attention_weight=3) would all be dropped; {advice} (the model's own loss carries them), or set those "
    "weights to 0 in the TaperNormConfig"
)
NO_TERMS = dict(scale_loss_weight=0.0, distill_weight=0.0, sink_attention_weight=0.0)


def _for_model(**options):
    """A gated-mlp recipe with a sink (token 1, which _sink_first puts first): every loss term on."""
    model = build(tiny_llama_config(bos_token_id=1))
    return patch_model(model, TaperNormConfig.for_model(model, **options))


def _sink_first(n: int) -> list[dict[str, torch.Tensor]]:
    rows = _dataset(n)
    for row in rows:
        row["input_ids"][0] = row["labels"][0] = 1
    return rows


def test_label_smoothing_is_refused_when_the_trainer_is_built_where_the_recipe_adds_loss_terms(tmp_path):
    """The Trainer's label smoother takes the labels from the model's inputs: outputs.loss was None, and a gated-mlp
    recipe ran to g = 0 without its scale loss, distillation and sink-attention terms (one WARNING blamed missing
    labels). Refused now as load_best_model_at_end is; a recipe that adds no term to the loss trains."""
    with pytest.raises(ConfigurationError) as caught:
        _trainer(tmp_path, _for_model(), label_smoothing_factor=0.1)
    assert str(caught.value) == "TaperCallback: label_smoothing_factor=0.1 makes the Trainer compute the loss " + (
        "itself from the logits, taking the labels from the model's inputs, "
        + LOST_TERMS.format(advice="set label_smoothing_factor=0")
    )
    model = _for_model(**NO_TERMS)
    trainer = _trainer(tmp_path, model, label_smoothing_factor=0.1)
    trainer.train_dataset = _sink_first(STEPS * 8)
    trainer.train()
    assert gate_of(model) == 0.0


def _added_later(tmp_path: Path, model, **options) -> Trainer:
    """A Trainer built without callbacks, then given TaperCallback with trainer.add_callback (standard Trainer API)."""
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=8, report_to=[],
                             use_cpu=True, disable_tqdm=True, **{"save_strategy": "no", **options})  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=_sink_first(STEPS * 8), eval_dataset=_sink_first(8))
    trainer.add_callback(TaperCallback(K_START, K_END))
    return trainer


@pytest.mark.parametrize("option", ["label_smoothing_factor", "load_best_model_at_end"])
def test_the_trainer_build_checks_run_at_train_begin_for_a_callback_added_with_add_callback(tmp_path, option):
    """on_init_end never reaches a callback added after the Trainer was built, so none of its refusals ran: label
    smoothing trained a step and was then blamed on compute_loss_func; load_best_model_at_end was taken, and the
    Trainer put a checkpoint of gate 0.905 back over the tapered model. They run at on_train_begin now, before any
    step, with the same messages as when the Trainer is built."""
    if option == "label_smoothing_factor":
        trainer = _added_later(tmp_path, _for_model(), label_smoothing_factor=0.1)
        expected = "TaperCallback: label_smoothing_factor=0.1 makes the Trainer compute the loss " + (
            "itself from the logits, taking the labels from the model's inputs, "
            + LOST_TERMS.format(advice="set label_smoothing_factor=0")
        )
    else:
        trainer = _added_later(tmp_path, _for_model(), eval_strategy="steps", eval_steps=4, save_strategy="steps",
                               save_steps=4, load_best_model_at_end=True)  # fmt: skip
        expected = (
            "TaperCallback: load_best_model_at_end=True makes the Trainer load its best checkpoint over the tapered "
            "model at the end, which can be one saved before the gate reached 0 (a normalized model, which "
            "fold_model refuses); set load_best_model_at_end=False (the last step's model is the tapered one)"
        )
    with pytest.raises(ConfigurationError) as caught:
        trainer.train()
    assert str(caught.value) == expected
    assert trainer.state.global_step == 0 and gate_of(trainer.model) == 1.0


def _own_loss(outputs, labels, num_items_in_batch=None):
    logits, targets = outputs.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()
    return torch.nn.functional.cross_entropy(logits, targets, ignore_index=-100)


def test_compute_loss_func_is_refused_at_the_first_step_where_the_recipe_adds_loss_terms(tmp_path):
    """Trainer(compute_loss_func=...) also takes the labels from the model's inputs, and a callback is not shown it:
    the first step's training forwards returning no loss is what tells. The run stops there, before any checkpoint
    (it trained to g = 0 with every term dropped); a recipe that adds no term to the loss trains."""

    def trainer(model) -> Trainer:
        args = TrainingArguments(output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=8,
                                 save_steps=1, report_to=[], use_cpu=True, disable_tqdm=True)  # fmt: skip
        return Trainer(model=model, args=args, train_dataset=_sink_first(STEPS * 8), callbacks=[TaperCallback()],
                       compute_loss_func=_own_loss)  # fmt: skip

    refused = trainer(_for_model())
    with pytest.raises(ConfigurationError) as caught:
        refused.train()
    assert str(caught.value) == (
        "TaperCallback: the model's training forwards returned no loss: the Trainer computes it outside the model "
        "(Trainer(compute_loss_func=...), or a compute_loss that takes the labels from the model's inputs), "
        + LOST_TERMS.format(advice="leave compute_loss_func out")
    )
    assert refused.state.global_step == 1 and not list(tmp_path.glob("checkpoint-*"))
    model = _for_model(**NO_TERMS)
    trainer(model).train()
    assert gate_of(model) == 0.0


class LigerRMSNorm(torch.nn.Module):
    """Stands for liger-kernel's RMSNorm, whose forward liger binds to every norm module it patches."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        variance = hidden_states.float().pow(2).mean(-1, keepdim=True)
        return (hidden_states * torch.rsqrt(variance + 1e-6)).to(hidden_states.dtype) * self.weight


def liger_rebinds_every_norm(model) -> None:
    """What liger's ``_patch_rms_norm_module`` does to each norm of the model: bind its forward to the instance."""
    for _, layer in tapered_norms(model, include_kept=True):
        layer.__dict__["forward"] = LigerRMSNorm.forward.__get__(layer, type(layer))


LIGER = (
    r"^TaperCallback: TaperNorm model\.\S+ runs tests\.test_callback\.LigerRMSNorm\.forward instead of its own.*liger"
)


@pytest.mark.parametrize("when", ["before the Trainer", "after the Trainer", "on the class"])
def test_a_kernel_patch_that_replaces_the_norms_forward_is_refused_before_training(tmp_path, monkeypatch, when):
    model = patch_model(build(tiny_llama_config()), TaperNormConfig.paper())
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    if when == "before the Trainer":
        liger_rebinds_every_norm(model)
        with pytest.raises(TaperStateError, match=LIGER):
            _trainer(tmp_path, model)
    else:
        trainer = _trainer(tmp_path, model)
        if when == "after the Trainer":  # as TrainingArguments(use_liger_kernel=True) does inside train()
            liger_rebinds_every_norm(model)
        else:
            monkeypatch.setattr(TaperNorm, "forward", LigerRMSNorm.forward)
        with pytest.raises(TaperStateError, match=LIGER):
            trainer.train()
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())  # not one step


def test_a_wrapper_that_calls_the_norms_own_forward_is_not_a_replacement(tmp_path):
    """accelerate's device hooks wrap a module's forward (functools.wraps) and call it: the taper still runs."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    model = patch_model(build(tiny_llama_config()), TaperNormConfig.paper())
    for _, layer in tapered_norms(model, include_kept=True):
        add_hook_to_module(layer, ModelHook())
    refuse_replaced_forward(model, "test")
    _trainer(tmp_path, model)


def test_thresholds_that_are_no_divergence_thresholds_are_refused_when_built():
    """``TaperCallback(thresholds={"max_scale_ratio": 10})`` was taken as given and failed at the first watched step
    with "AttributeError: 'dict' object has no attribute 'spike_ratio'", naming no option; so did TaperController."""
    model = patch_model(build(tiny_llama_config(), seed=0), TaperNormConfig.paper())
    for build_it, who in (
        (lambda thresholds: TaperCallback(thresholds=thresholds), "TaperCallback"),
        (lambda thresholds: TaperController(model, total_steps=6, thresholds=thresholds), "TaperController"),
    ):
        with pytest.raises(ConfigurationError) as refused:
            build_it({"max_scale_ratio": 10})
        assert str(refused.value) == (
            f"{who}: thresholds must be a DivergenceThresholds, got a dict: write "
            "DivergenceThresholds(**{'max_scale_ratio': 10})"
        )
        with pytest.raises(ConfigurationError, match=f"^{who}: thresholds must be a DivergenceThresholds, got a int$"):
            build_it(3)


def test_a_trainer_of_one_step_is_refused_naming_its_steps(tmp_path):
    """A plain Trainer with max_steps=1 and TaperCallback() at its defaults was refused as
    "TaperSchedule(k_start=1, k_end=1, total_steps=1): k_end must be greater than k_start", a window the user never
    set; so was TaperController(model, total_steps=1)."""
    model = patch_model(build(tiny_llama_config(), seed=0), TaperNormConfig.paper())
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, use_cpu=True, report_to=[], save_strategy="no")
    with pytest.raises(ConfigurationError) as refused:
        Trainer(model=model, args=args, train_dataset=_dataset(8), callbacks=[TaperCallback()])
    assert str(refused.value) == (
        "TaperCallback: the Trainer runs 1 optimizer step (max_steps, or the steps of its epochs): a taper needs at "
        "least 2, one at g = 1 to calibrate and one at g = 0"
    )
    with pytest.raises(ConfigurationError) as refused:
        TaperController(model, total_steps=1)
    assert str(refused.value) == (
        "a taper needs a run of at least 2 optimizer steps (one at g = 1 to calibrate, one at g = 0), got total_steps=1"
    )


def test_controller_and_callback_arguments_of_the_wrong_kind_are_one_line():
    """TaperController(model, {"k_start": 2, "k_end": 4}) failed with "'dict' object has no attribute 'resolve'" and
    TaperController(None) with an AttributeError of its own; distillation="no" or 0 built a teacher and trained with
    it; max_scale_ratio=0 became the default 100; allow_incomplete="no" allowed an incomplete taper. Each is refused
    in one line naming the argument."""
    model = patch_model(build(tiny_llama_config(), seed=0), TaperNormConfig.paper())
    cases = [
        (lambda: TaperController(model, {"k_start": 2, "k_end": 4}, total_steps=20),
         "TaperController: schedule must be a TaperSchedule, got a dict: write TaperSchedule(**{'k_start': 2, "
         "'k_end': 4})"),
        (lambda: TaperController(model, (2, 4), total_steps=20),
         "TaperController: schedule must be a TaperSchedule, got a tuple: write TaperSchedule(*(2, 4))"),
        (lambda: TaperController(None, total_steps=20),
         "TaperController: model must be a model patched with patch_model, got None"),
        (lambda: TaperController(model, total_steps=20, distillation="no"),
         "TaperController: distillation must be True or False (the config's teacher, or none) or a Distillation, "
         "got 'no'"),
        (lambda: TaperController(model, total_steps=20, max_scale_ratio=0),
         "DivergenceThresholds.max_scale_ratio must be > 1, got 0"),
        (lambda: TaperCallback(max_scale_ratio=0), "DivergenceThresholds.max_scale_ratio must be > 1, got 0"),
        (lambda: TaperCallback(1, 7, allow_incomplete="no"),
         "TaperCallback: allow_incomplete= must be True or False, got str"),
        (lambda: TaperSchedule(2, 7, total_steps=6, allow_incomplete="no"),
         "TaperSchedule.allow_incomplete must be True or False, got str"),
    ]  # fmt: skip
    for build_it, message in cases:
        with pytest.raises(ConfigurationError) as refused:
            build_it()
        assert str(refused.value) == message
    assert TaperController(model, total_steps=20, distillation=False).distillation is None
