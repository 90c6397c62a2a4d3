"""Fidelity options of the library: sink positions, distillation, and the experimental options the config keeps
for the research (``calibration_scale``, the teachers and the gate schedule of ``config.experimental``); the
research fits, penalties, diagnostics and the script that runs ``taper`` with experimental options are tested in
conversion_scripts/experiments/tests."""

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from hf_tapernorm import ConfigurationError, TaperNormConfig, patch_model
from hf_tapernorm.architectures import NormStyle
from hf_tapernorm.layers import TaperNorm, set_gate, tapered_norms
from hf_tapernorm.layers.taper_norm import branch_statistics
from hf_tapernorm.training import calibrate
from hf_tapernorm.training.distillation import Distillation, distillation_loss

from .conftest import build, random_batches, tiny_gpt2_config, tiny_llama_config


def _norm(d=8):
    norm = LlamaRMSNorm(d, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(d))
    return norm


def test_sink_positions_stay_normalized_and_the_rest_follows_the_gate():
    torch.manual_seed(0)
    norm = _norm()
    layer = TaperNorm.from_norm(norm, NormStyle.RMS)
    layer.sink_tokens = 1
    h = torch.randn(2, 5, 8)
    h[:, 0] *= 100.0
    assert torch.equal(layer(h), norm(h))  # gate 1: exactly the norm, sink or not
    layer.mark_calibrated(0.5)
    layer.set_gate(0.25)
    out = layer(h)
    linear = 0.5 * h * norm.weight
    assert torch.equal(out[:, :1], norm(h)[:, :1])
    torch.testing.assert_close(out[:, 1:], 0.25 * norm(h)[:, 1:] + 0.75 * linear[:, 1:])
    layer.set_gate(0.0)
    torch.testing.assert_close(layer(h)[:, 1:], linear[:, 1:])
    # A one-token forward (cached decoding after the prompt) is all tapered.
    torch.testing.assert_close(layer(h[:, 3:4]), linear[:, 3:4])


def test_sink_positions_are_left_out_of_the_calibration_statistics():
    torch.manual_seed(0)
    layer = TaperNorm.from_norm(_norm(), NormStyle.RMS).train()
    layer.sink_tokens = 1
    h = torch.randn(2, 5, 8)
    h[:, 0] *= 100.0
    layer(h)
    expected = branch_statistics(h[:, 1:], layer.weight, layer.eps, centred=False)
    torch.testing.assert_close(layer.pending, expected)


def test_distillation_loss_is_the_kl_divergence():
    torch.manual_seed(0)
    s, t = torch.randn(2, 3, 7), torch.randn(2, 3, 7)
    expected = F.kl_div(F.log_softmax(s, -1), F.log_softmax(t, -1), log_target=True, reduction="none").sum(-1).mean()
    torch.testing.assert_close(distillation_loss(s, t), expected)
    assert float(distillation_loss(t, t)) == pytest.approx(0.0, abs=1e-6)
    mask = torch.tensor([[1, 0, 0], [0, 0, 1]])
    kl = F.kl_div(F.log_softmax(s, -1), F.log_softmax(t, -1), log_target=True, reduction="none").sum(-1)
    torch.testing.assert_close(distillation_loss(s, t, mask), (kl[0, 0] + kl[1, 2]) / 2)


def test_attached_distillation_adds_the_kl_to_the_frozen_original_on_labelled_positions():
    batch = random_batches(n=1, batch=2)[0]
    labels = batch.clone()
    labels[:, :3] = -100  # e.g. the sink's first-token prediction: no target, no KL either
    teacher = build(tiny_llama_config()).eval()
    student = patch_model(build(tiny_llama_config()), TaperNormConfig.paper()).train()
    with torch.no_grad():
        student.model.layers[0].mlp.down_proj.weight.mul_(1.5)  # now it computes something else
    plain = student(input_ids=batch, labels=labels)
    distillation = Distillation(teacher, weight=0.7, distill_from="original").attach(student)
    out = student(input_ids=batch, labels=labels)
    with torch.no_grad():
        reference = teacher(input_ids=batch).logits
    kl = distillation_loss(plain.logits[:, :-1], reference[:, :-1], labels[:, 1:] != -100)
    assert float(kl) > 0
    torch.testing.assert_close(out.loss, plain.loss + 0.7 * kl)
    out.loss.backward()
    assert student.model.layers[0].mlp.down_proj.weight.grad is not None
    assert all(p.grad is None for p in teacher.parameters())  # frozen
    # Trainer-style accumulation: weighted by the micro-batch's share of the step's labels.
    items = 2 * int((labels[:, 1:] != -100).sum())
    accumulated = student(input_ids=batch, labels=labels, num_items_in_batch=items).loss
    ce = (
        F.cross_entropy(
            plain.logits[:, :-1].reshape(-1, 128).float(), labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum"
        )
        / items
    )
    torch.testing.assert_close(accumulated, ce + 0.5 * 0.7 * kl, rtol=1e-5, atol=1e-6)
    student.eval()
    torch.testing.assert_close(
        student(input_ids=batch, labels=labels).loss,
        F.cross_entropy(plain.logits[:, :-1].reshape(-1, 128).float(), labels[:, 1:].reshape(-1), ignore_index=-100),
    )
    student.train()
    distillation.remove()
    torch.testing.assert_close(student(input_ids=batch, labels=labels).loss, plain.loss)


def test_the_teacher_reads_the_positions_the_student_reads():
    """A batch that carries ``position_ids`` (training data whose positions are not 0..n-1: TaperExtension's
    training_data may build such): the teacher's logits are taken at the same positions, in a direct call and in
    the term a training forward adds, so the KL compares the two models where the student reads."""
    batch = random_batches(n=1, batch=2, length=24)[0]
    positions = torch.stack([torch.arange(24) * 5, torch.arange(24) + 200])
    teacher = build(tiny_llama_config(max_position_embeddings=512)).eval()
    with torch.no_grad():  # a random tiny model attends almost uniformly, so positions barely show: sharpen it
        for layer in teacher.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    student = patch_model(copy.deepcopy(teacher), TaperNormConfig.paper()).train()  # at g = 1: the teacher
    plain = student(input_ids=batch, labels=batch, position_ids=positions)
    distillation = Distillation(teacher, weight=1.0, distill_from="original").attach(student)
    with torch.no_grad():
        at_positions = teacher(input_ids=batch, position_ids=positions).logits
        contiguous = teacher(input_ids=batch).logits
        against_contiguous = float(distillation_loss(at_positions[:, :-1], contiguous[:, :-1]))
        assert against_contiguous > 1e-6
        assert float(distillation(at_positions, batch, position_ids=positions)) == pytest.approx(0.0, abs=1e-9)
        assert float(distillation(at_positions, batch)) == pytest.approx(against_contiguous, rel=1e-4)
        trained = student(input_ids=batch, labels=batch, position_ids=positions)
    torch.testing.assert_close(trained.loss, plain.loss, rtol=0, atol=1e-6)  # no KL at the student's positions
    distillation.remove()


def test_distillation_that_fades_with_the_gate_weighs_the_kl_by_the_gate():
    batch = random_batches(n=1, batch=2)[0]
    teacher = build(tiny_llama_config()).eval()
    student = patch_model(build(tiny_llama_config()), TaperNormConfig.paper()).train()
    student(input_ids=batch)  # the statistics the calibration reads
    calibrate(student)
    plain = student(input_ids=batch, labels=batch)
    with torch.no_grad():
        kl = distillation_loss(plain.logits[:, :-1], teacher(input_ids=batch).logits[:, :-1])
    distillation = Distillation(teacher, weight=0.8, distill_from="original", distill_schedule="gate").attach(student)
    for gate in (1.0, 0.25, 0.0):
        set_gate(student, gate)
        base = student(input_ids=batch, labels=batch)
        distillation.remove()
        without = student(input_ids=batch, labels=batch)
        distillation.attach(student)
        if gate == 1.0:
            torch.testing.assert_close(base.loss, plain.loss + 0.8 * kl)
        else:
            reference = teacher(input_ids=batch).logits.detach()
            expected = distillation_loss(without.logits[:, :-1], reference[:, :-1])
            torch.testing.assert_close(base.loss, without.loss + 0.8 * gate * expected)
    # The config's experimental option drives it: distill_schedule="gate" builds a fading term.
    from hf_tapernorm import TaperController

    experimental = {"distill_from": "original", "distill_schedule": "gate"}
    config = TaperNormConfig.paper(distill_weight=0.5, experimental=experimental)
    controller = TaperController(patch_model(build(tiny_llama_config()), config), total_steps=100)
    assert controller.distillation.distill_schedule == "gate" and controller.distillation.weight == 0.5
    with pytest.raises(ConfigurationError, match="TaperNormConfig.experimental.distill_schedule must be one of"):
        TaperNormConfig(experimental={"distill_schedule": "linear"})


def test_distillation_from_the_gate_start_snapshots_the_model_when_the_gate_first_drops(caplog):
    batch = random_batches(n=1, batch=2)[0]
    original = build(tiny_llama_config()).eval()
    student = patch_model(build(tiny_llama_config()), TaperNormConfig.paper()).train()
    with torch.no_grad():
        student.model.layers[0].mlp.down_proj.weight.mul_(1.5)  # trained during the warmup at g = 1
    plain_at_one = student(input_ids=batch, labels=batch).loss  # also the calibration statistics
    distillation = Distillation(copy.deepcopy(original), weight=0.7, distill_from="gate_start").attach(student)
    torch.testing.assert_close(student(input_ids=batch, labels=batch).loss, plain_at_one)  # no teacher yet
    calibrate(student)
    with torch.no_grad():
        normalized = student.eval()(input_ids=batch).logits  # g = 1: what the norms compute with these weights
    set_gate(student, 0.5)
    with torch.no_grad():
        tapered = student(input_ids=batch, labels=batch)
    out = student.train()(input_ids=batch, labels=batch)  # the first training forward below g = 1
    weights = student.state_dict()
    for name, param in distillation.teacher.named_parameters():
        torch.testing.assert_close(param, weights[name], rtol=0, atol=0)
    kl = distillation_loss(tapered.logits[:, :-1], normalized[:, :-1])
    assert float(kl) > 0
    torch.testing.assert_close(out.loss, tapered.loss + 0.7 * kl)
    # Logged: the mean term over the two training forwards with labels (0 at g = 1, then 0.7 KL).
    assert distillation.log_metrics()["taper/distill"] == pytest.approx(0.7 * float(kl) / 2, rel=1e-5)
    assert distillation.log_metrics() == {}
    distillation.remove()

    # A run resumed below g = 1 never saw the gate-start weights: it keeps the given teacher, and says so.
    resumed = Distillation(copy.deepcopy(original), weight=0.7, distill_from="gate_start").attach(student)
    with caplog.at_level(logging.WARNING, logger="hf_tapernorm"):
        student(input_ids=batch, labels=batch)
    assert "the snapshot taken at the start of the taper is not in the checkpoint" in caplog.text
    for param, reference in zip(resumed.teacher.parameters(), original.parameters()):
        torch.testing.assert_close(param, reference, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"LlamaForCausalLM has no weights for the teacher's \['transformer"):
        Distillation(build(tiny_gpt2_config())).load_teacher_from(student)


def test_calibration_scale_multiplies_the_linear_branch_of_every_fit():
    batches = random_batches(n=2)
    plain = patch_model(build(tiny_llama_config()), TaperNormConfig.paper()).train()
    scaled = patch_model(
        build(tiny_llama_config()), TaperNormConfig.paper(experimental={"calibration_scale": 0.5})
    ).train()
    with torch.no_grad():
        for ids in batches:
            plain(ids)
            scaled(ids)
    values = calibrate(plain)
    assert calibrate(scaled) == pytest.approx(values)  # the returned fit is the least-squares c itself
    for (name, a), (_, b) in zip(tapered_norms(plain), tapered_norms(scaled)):
        assert float(b.c) == pytest.approx(0.5 * values[name], rel=1e-6)
        torch.testing.assert_close(b.taper_weight, a.taper_weight)
    with pytest.raises(
        ConfigurationError, match="TaperNormConfig.experimental.calibration_scale must be positive, got 0"
    ):
        patch_model(build(tiny_llama_config()), TaperNormConfig.paper(experimental={"calibration_scale": 0}))


def _taper_steps(controller, optimizer, steps) -> dict:
    """Optimizer steps ``steps`` of a controller's loop (SGD, so a resume carries no optimizer state); returns the
    teacher's weights as the step at the taper's start set them (empty when no step in ``steps`` took them)."""
    teacher = {}
    for step in steps:
        controller.step_begin(step)
        if step == controller.schedule.k_start and controller.distillation.teacher is not None:
            teacher = {k: v.clone() for k, v in controller.distillation.teacher.state_dict().items()}
        ids = random_batches(n=1, seed=step)[0]
        controller.model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        controller.step_end(step)
    return teacher


def _resumed(folder, step: int, caplog) -> tuple[dict, dict, str]:
    """Resume the 8-step taper (window 2 -> 6) from ``folder`` at ``step``, to its end: (the teacher its step at the
    taper's start took, the final weights, the warnings it logged)."""
    from hf_tapernorm import TaperController, load_tapered

    model = load_tapered(folder).train()
    controller = TaperController(model, total_steps=8)
    controller.load_state(folder)
    controller.check_resume(step)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_tapernorm"):
        teacher = _taper_steps(controller, torch.optim.SGD(model.parameters(), lr=0.05), range(step, 8))
    warnings = "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    return teacher, model.state_dict(), warnings


def test_a_run_resumed_at_the_taper_s_first_step_takes_the_gate_start_snapshot_without_a_warning(tmp_path, caplog):
    """A taper stopped right after step k_start (its checkpoint written at g = 1, before any snapshot was due) and
    resumed there warned that the gate-start snapshot was not in the checkpoint and that the run "distils from the
    model as resumed", though the model as resumed IS the gate-start model and the result equalled the
    uninterrupted run's. The previous update's gate (the schedule's, 1 there) now tells the distillation so: no
    warning, the same teacher and the same final weights. A checkpoint one step later without its snapshot still
    warns."""
    from hf_tapernorm import TaperController, save_tapered

    model = patch_model(
        build(tiny_llama_config()), TaperNormConfig.paper(taper_start=2, taper_end=6, distill_weight=1.0)
    ).train()
    controller = TaperController(model, total_steps=8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    teacher = {}
    for step in range(8):
        teacher = _taper_steps(controller, optimizer, [step]) or teacher
        if step + 1 in (2, 3):  # checkpoints after 2 and 3 optimizer steps; the later one without its snapshot
            save_tapered(model, tmp_path / f"checkpoint-{step + 1}")
            if step + 1 == 2:
                controller.save_state(tmp_path / "checkpoint-2")
    assert not (tmp_path / "checkpoint-2" / "distillation_teacher.safetensors").exists()  # none was due at g = 1
    final = model.state_dict()

    resumed_teacher, resumed_final, warnings = _resumed(tmp_path / "checkpoint-2", 2, caplog)
    assert warnings == ""
    assert resumed_teacher.keys() == teacher.keys() and teacher
    for name, value in teacher.items():
        torch.testing.assert_close(resumed_teacher[name], value, rtol=0, atol=1e-6)
    for name, value in final.items():
        torch.testing.assert_close(resumed_final[name], value, rtol=0, atol=1e-6)

    _, _, warnings = _resumed(tmp_path / "checkpoint-3", 3, caplog)
    assert (
        'Distillation(distill_from="gate_start"): training started with the gate already below 1 (a resumed run?) '
        "and the snapshot taken at the start of the taper is not in the checkpoint; this run distils from the model "
        "as resumed" in warnings
    )
