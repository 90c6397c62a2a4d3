"""The fixed-target scale anchor: target, loss term, masking, normalisation, and logit chasing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_tapernorm import TaperController, TaperNormConfig, patch_model
from hf_tapernorm.layers import ScaleAnchor
from hf_tapernorm.training import TaperSchedule
from tests.conftest import build, tiny_gpt2_config, tiny_llama_config

LAMBDA = 0.3


def _batch(seed: int, batch: int = 3, length: int = 10, pad: int = 3):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (batch, length), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, -pad:] = 0  # right padding on the first row
    mask[2, -1:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _final_norm(model):
    return model.model.norm if hasattr(model, "model") else model.transformer.ln_f


def _capture_final_norm_input(model):
    captured = []
    handle = _final_norm(model).register_forward_pre_hook(lambda module, args: captured.append(args[0].detach()))
    return captured, handle


def _scale(h, eps, centred):
    x = h.double()
    if centred:
        x = x - x.mean(-1, keepdim=True)
    return torch.sqrt(x.pow(2).mean(-1) + eps)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_target_is_the_bias_corrected_ema_of_the_masked_batch_mean_scale(family):
    config = tiny_llama_config() if family == "llama" else tiny_gpt2_config()
    model = patch_model(build(config), TaperNormConfig.paper(ema_rate=0.1, scale_loss_weight=LAMBDA)).train()
    anchor = _final_norm(model).anchor
    assert isinstance(anchor, ScaleAnchor) and float(anchor.scale_loss_weight) == pytest.approx(LAMBDA)
    centred = family == "gpt2"
    controller = TaperController(model, TaperSchedule(3, 5), total_steps=5)
    captured, handle = _capture_final_norm_input(model)
    ema = 0.0
    for step in range(3):  # three optimizer steps at g = 1, two micro-batches each
        controller.step_begin(step)
        batches = [_batch(10 * step + i) for i in range(2)]
        captured.clear()
        for batch in batches:
            model(**batch)
        controller.step_end(step)
        s = torch.cat([_scale(h, anchor.eps, centred)[b["attention_mask"].bool()] for h, b in zip(captured, batches)])
        ema = 0.9 * ema + 0.1 * s.mean().item()
    handle.remove()
    assert not anchor.is_frozen
    controller.step_begin(3)  # k_start reached: calibration freezes the target
    assert anchor.is_frozen and bool(anchor.frozen)
    assert float(anchor.target) == pytest.approx(ema / (1 - 0.9**3), rel=1e-5)


def test_scale_loss_is_added_in_training_only_masked_and_normalised_like_the_trainer_ce():
    model = patch_model(
        build(tiny_llama_config()), TaperNormConfig.paper(ema_rate=0.1, scale_loss_weight=LAMBDA)
    ).train()
    anchor = model.model.norm.anchor
    controller = TaperController(model, TaperSchedule(1, 3), total_steps=3)
    controller.step_begin(0)
    model(**_batch(0))
    controller.step_end(0)
    controller.step_begin(1)  # calibrates and freezes the target; gate 0.5 for this step
    assert anchor.active
    batch = _batch(7)
    mask = batch["attention_mask"].bool()
    captured, handle = _capture_final_norm_input(model)

    plain = model.eval()(**batch).loss  # evaluation: plain cross-entropy
    logits = model(**batch).logits
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, 128), batch["labels"][:, 1:].reshape(-1), ignore_index=-100)
    torch.testing.assert_close(plain, ce)

    trained = model.train()(**batch).loss
    handle.remove()
    deviation = (_scale(captured[-1], anchor.eps, centred=False) - float(anchor.target)).pow(2)[mask]
    assert deviation.sum() > 0
    expected = plain.double() + LAMBDA * deviation.mean()
    assert trained.item() == pytest.approx(expected.item(), rel=1e-6)

    # With num_items_in_batch (Trainer with gradient accumulation), CE is sum / N: so is the scale term.
    items = torch.tensor(50)
    summed = model(**batch, num_items_in_batch=items).loss
    plain_summed = model.eval()(**batch, num_items_in_batch=items).loss
    assert summed.item() == pytest.approx((plain_summed.double() + LAMBDA * deviation.sum() / 50).item(), rel=1e-6)


def test_the_relative_scale_loss_divides_the_deviation_by_the_target():
    model = patch_model(
        build(tiny_llama_config()),
        TaperNormConfig.paper(ema_rate=0.1, scale_loss_weight=LAMBDA, relative_scale_loss=True),
    )
    model.train()
    anchor = model.model.norm.anchor
    controller = TaperController(model, TaperSchedule(1, 3), total_steps=3)
    controller.step_begin(0)
    model(**_batch(0))
    controller.step_end(0)
    controller.step_begin(1)
    batch = _batch(7)
    mask = batch["attention_mask"].bool()
    captured, handle = _capture_final_norm_input(model)
    plain = model.eval()(**batch).loss
    trained = model.train()(**batch).loss
    handle.remove()
    target = float(anchor.target)
    relative = (_scale(captured[-1], anchor.eps, centred=False) / target - 1.0).pow(2)[mask]
    assert relative.sum() > 0 and abs(target - 1.0) > 0.1  # the two forms differ on this model
    assert trained.item() == pytest.approx((plain.double() + LAMBDA * relative.mean()).item(), rel=1e-6)


def _calibrated(scale_loss_weight: float):
    """A tiny Llama after one optimizer step at g = 1 and calibration (k_start = 1)."""
    model = patch_model(
        build(tiny_llama_config()), TaperNormConfig.paper(ema_rate=0.1, scale_loss_weight=scale_loss_weight)
    ).train()
    controller = TaperController(model, TaperSchedule(1, 3), total_steps=3)
    controller.step_begin(0)
    model(**_batch(0))
    controller.step_end(0)
    controller.step_begin(1)
    return model, controller


def test_a_zero_weight_only_measures():
    model, controller = _calibrated(0.0)
    anchor = model.model.norm.anchor
    assert anchor.is_frozen and not anchor.active
    batch = _batch(3)
    assert model(**batch).loss.item() == model.eval()(**batch).loss.item()
    controller.step_end(1)
    metrics = controller.log_metrics()
    assert metrics["taper/scale_loss"] == 0.0 and metrics["taper/residual_scale"] > 0


def test_the_scale_loss_pulls_the_residual_stream_towards_the_target():
    model, _ = _calibrated(1.0)
    anchor = model.model.norm.anchor
    batch = _batch(3)
    captured, handle = _capture_final_norm_input(model)
    model.eval()(**batch)
    handle.remove()
    current = _scale(captured[0], anchor.eps, centred=False)[batch["attention_mask"].bool()].mean().item()
    anchor.target.fill_(2.0 * current)  # a target above the current scale: descent must grow ||h||
    model.zero_grad()
    model.train()(**batch).loss.backward()
    with_target = model.model.embed_tokens.weight.grad.clone()
    model.zero_grad()
    model.eval()(**batch).loss.backward()
    ce_only = model.model.embed_tokens.weight.grad
    extra = with_target - ce_only  # the scale term's gradient on the embeddings
    rows = batch["input_ids"][batch["attention_mask"].bool()].unique()
    weights = model.model.embed_tokens.weight.detach()[rows]
    # Radial component: a gradient step (-extra) increases the norms of the used embedding rows.
    assert (extra[rows] * weights).sum() < 0


def _train_all_taper(scale_loss_weight: float, steps: int = 24) -> tuple[float, list[float]]:
    """Tiny Llama, every norm tapered (final too), a trivially learnable task: returns target, scale/step."""
    model = build(tiny_llama_config(), seed=0)
    with torch.no_grad():  # unit-scale embeddings: a residual stream of realistic scale (HF init is 0.02)
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
    patch_model(model, TaperNormConfig.paper(scope="all", ema_rate=0.1, scale_loss_weight=scale_loss_weight)).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    controller = TaperController(model, TaperSchedule(3, 12), total_steps=steps)
    generator = torch.Generator().manual_seed(1)
    scales = []
    for step in range(steps):
        controller.step_begin(step)
        ids = (torch.randint(0, 128, (8, 1), generator=generator) + torch.arange(16)) % 128  # counting task
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        controller.step_end(step)
        scales.append(controller.log_metrics()["taper/residual_scale"])
    return float(model.model.norm.anchor.target), scales


def test_logit_chasing_without_the_scale_loss_and_anchoring_with_it():
    target, free = _train_all_taper(0.0)
    anchored_target, anchored = _train_all_taper(1.0)
    assert anchored_target == target  # same warmup at g = 1: same frozen target
    # Without the anchor, the fully norm-free model grows its pre-logit scale to raise its margins.
    assert max(free[-5:]) > 3.0 * target
    # With it, the scale stays near the target (lambda = 1: this toy task pulls much harder than real text).
    assert all(abs(s / target - 1.0) < 0.6 for s in anchored)
    assert anchored[-1] < 0.5 * free[-1]
