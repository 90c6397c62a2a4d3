"""The research fits, penalties and diagnostics (conversion_scripts/experiments/research) against their
formulas, on tiny random models."""

import math

import pytest
import torch
import torch.nn.functional as F

from conversion_scripts.experiments.research.diagnostics import (
    branch_distance,
    loss_rise_gate,
    residual_scale_by_position,
)
from conversion_scripts.experiments.research.linear_fit import fit_linear_branch, typical_token_sums
from conversion_scripts.experiments.research.penalties import ScaleGrowthPenalty, TokenScalePenalty
from hf_tapernorm import TaperController, TaperNormConfig, patch_model
from hf_tapernorm.layers import set_gate, tapered_norms
from hf_tapernorm.training import TaperSchedule, calibrate, calibration_table
from tests.conftest import build, random_batches, tiny_llama_config


def layer_inputs(model, batch) -> dict[str, torch.Tensor]:
    """The input of every tapered layer in one forward of ``batch``, by layer name."""
    inputs = {}
    handles = [
        layer.register_forward_pre_hook(lambda m, a, name=name: inputs.setdefault(name, a[0].detach()))
        for name, layer in tapered_norms(model)
    ]
    model(batch)
    for handle in handles:
        handle.remove()
    return inputs


def test_typical_token_sums_match_an_independent_loop():
    torch.manual_seed(0)
    h = torch.randn(3, 6, 8)
    h[1, 2] *= 50.0  # one outlier token
    sums = typical_token_sums(h, 1e-6, centred=False, trim=4.0, skip=1)
    rows = [h[b, p] for b in range(3) for p in range(1, 6)]
    r = torch.stack([torch.sqrt(x.pow(2).mean() + 1e-6) for x in rows])
    keep = [x for x, rr in zip(rows, r) if rr <= 4.0 * r.median()]
    assert len(keep) == 14
    num = sum(x.pow(2) / torch.sqrt(x.pow(2).mean() + 1e-6) for x in keep)
    den = sum(x.pow(2) for x in keep)
    torch.testing.assert_close(sums[0], num)
    torch.testing.assert_close(sums[1], den)
    assert torch.all(sums[2] == 14)


def test_fit_without_trim_or_channels_is_the_papers_least_squares_c(tiny_llama):
    torch.manual_seed(0)
    batch = random_batches(n=1)[0]
    reference = patch_model(tiny_llama, TaperNormConfig.paper()).train()
    reference(batch)
    expected = calibrate(reference)

    from tests.conftest import build, tiny_llama_config

    model = patch_model(build(tiny_llama_config()), TaperNormConfig.paper())
    got = fit_linear_branch(model, [batch], trim=None, per_channel=False)
    assert got.keys() == expected.keys()
    for name in got:
        assert math.isclose(got[name], expected[name], rel_tol=1e-5)
    for _, layer in tapered_norms(model):
        torch.testing.assert_close(layer.taper_weight, layer.weight)  # scalar fit: gain copied as is


def test_per_channel_fit_matches_per_channel_least_squares_and_keeps_gate_one_exact(tiny_llama):
    batch = random_batches(n=1)[0]
    original = tiny_llama(batch).logits
    model = patch_model(tiny_llama, TaperNormConfig.paper())
    inputs = layer_inputs(model, batch)
    fit_linear_branch(model, [batch], trim=4.0, per_channel=True)
    assert torch.equal(model(batch).logits, original)  # calibration does not move the gate-1 model
    for name, layer in tapered_norms(model):
        x = inputs[name].reshape(-1, inputs[name].shape[-1])
        r = torch.sqrt(x.pow(2).mean(-1) + layer.eps)
        x = x[r <= 4.0 * r.median()]
        r = r[r <= 4.0 * r.median()]
        a = (x.pow(2) / r[:, None]).sum(0) / x.pow(2).sum(0)
        torch.testing.assert_close(layer.c * layer.taper_weight, a * layer.weight, rtol=1e-4, atol=1e-6)


def test_token_scale_penalty_matches_its_formula_and_is_training_only(tiny_llama):
    model = patch_model(tiny_llama, TaperNormConfig.paper())
    penalty = TokenScalePenalty(model, weight=0.5, ratio=1.1, sink_tokens=1)
    inputs = []
    handles = [layer.register_forward_pre_hook(lambda m, a: inputs.append(a[0])) for _, layer in tapered_norms(model)]
    batch = random_batches(n=1)[0]
    model.eval()
    model(batch)
    assert float(penalty()) == 0.0  # eval forwards are not penalised
    inputs.clear()
    model.train()
    model(batch)
    value = penalty()
    terms = []
    for h in inputs:
        log_r = 0.5 * torch.log(h[:, 1:].pow(2).mean(-1) + 1e-6).reshape(-1)
        terms.append(F.relu(log_r - log_r.median() - math.log(1.1)).pow(2).mean())
    expected = 0.5 * torch.stack(terms).sum() / len(inputs)
    assert float(expected) > 0
    torch.testing.assert_close(value, expected)
    value.backward()
    assert model.model.embed_tokens.weight.grad is not None
    assert float(penalty()) == 0.0  # reset after reading
    for h in handles:
        h.remove()
    penalty.remove()


def test_attached_token_scale_penalty_is_added_to_the_loss_and_weighted_under_accumulation():
    batch = random_batches(n=1, batch=4)[0]

    def losses(attach: bool, **kwargs):
        model = patch_model(build(tiny_llama_config()), TaperNormConfig.paper()).train()
        penalty = TokenScalePenalty(model, weight=0.5, ratio=1.0, sink_tokens=1)
        if attach:
            penalty.attach(model)
        out = model(input_ids=batch, labels=batch, **kwargs)
        return out.loss, (penalty if not attach else None)

    plain, penalty = losses(False)
    expected = plain + penalty()
    with_penalty, _ = losses(True)
    torch.testing.assert_close(with_penalty, expected)
    assert float(with_penalty - plain) > 0
    # Trainer-style accumulation: CE is a sum over all the step's labels / num_items; the penalty takes this
    # micro-batch's share of the labels (here half of them).
    items = 2 * batch[:, 1:].numel()
    summed, penalty = losses(False, num_items_in_batch=items)
    accumulated, _ = losses(True, num_items_in_batch=items)
    torch.testing.assert_close(accumulated, summed + penalty() * 0.5)
    model = patch_model(build(tiny_llama_config()), TaperNormConfig.paper()).eval()
    TokenScalePenalty(model, weight=0.5, ratio=1.0).attach(model)
    reference = build(tiny_llama_config()).eval()
    torch.testing.assert_close(model(input_ids=batch, labels=batch).loss, reference(input_ids=batch, labels=batch).loss)


def test_scale_growth_penalty_matches_its_formula_per_forward():
    model = patch_model(build(tiny_llama_config()), TaperNormConfig.paper()).train()
    penalty = ScaleGrowthPenalty(model, weight=2.0, ratio=1.0, sink_tokens=1)
    inputs = []
    handles = [layer.register_forward_pre_hook(lambda m, a: inputs.append(a[0])) for _, layer in tapered_norms(model)]
    batch = random_batches(n=1)[0]
    model(batch)
    value = penalty()
    deviations = []
    for h in inputs:
        log_r = 0.5 * torch.log(h[:, 1:].pow(2).mean(-1) + 1e-6).reshape(-1)
        deviations.append(log_r - log_r.median())
    pairs = [F.relu(b - a).pow(2)[a > 0].sum() / a.numel() for a, b in zip(deviations, deviations[1:])]
    expected = 2.0 * torch.stack(pairs).sum() / (len(inputs) - 1)
    assert float(expected) > 0
    torch.testing.assert_close(value, expected)
    value.backward()
    assert model.model.embed_tokens.weight.grad is not None
    # Two forwards before reading: two separate chains (no pair across the forwards' boundary), summed.
    model(batch)
    model(batch)
    torch.testing.assert_close(penalty().detach(), 2 * expected.detach())
    model.eval()
    model(batch)
    assert float(penalty()) == 0.0
    for h in handles:
        h.remove()


def test_diagnostics_describe_the_linear_branch_and_the_sink(tiny_llama):
    batch = random_batches(n=1)[0]
    model = patch_model(tiny_llama, TaperNormConfig.paper())
    fit_linear_branch(model, [batch], trim=None, per_channel=False)
    distance = branch_distance(model, [batch], sink_tokens=1)
    assert len(distance) == 4 and all(0 < d < 1 for d in distance.values())
    # A norm whose tokens all share one RMS is reproduced exactly by its linear branch.
    layer = dict(tapered_norms(model))["model.layers.0.input_layernorm"]
    h = torch.randn(1, 4, 32)
    h = h / h.pow(2).mean(-1, keepdim=True).sqrt()
    layer.c.fill_(1.0 / math.sqrt(1.0 + layer.eps))
    torch.testing.assert_close(layer._linear(h), layer._normalized(h))
    table = calibration_table(model)
    assert all(row["calibrated"] for row in table.values())
    scale = residual_scale_by_position(model, [batch], sink_tokens=1)
    first = scale["model.layers.0.input_layernorm"]
    x = model.model.embed_tokens(batch)
    r = x.pow(2).mean(-1).add(1e-6).sqrt()
    assert first["sink_ratio"] == pytest.approx(float(r[:, 0].mean() / r[:, 1:].median()), rel=1e-4)


def test_loss_rise_gate():
    curve = [(1.0, 2.30), (1.0, 2.20), (0.9, 2.21), (0.7, 2.26), (0.5, 3.0)]
    assert loss_rise_gate(curve, tolerance=0.02) == 0.7
    assert loss_rise_gate(curve, tolerance=0.5) is None
    assert loss_rise_gate([(0.5, 2.0)]) is None
    assert loss_rise_gate([(1.0, 2.0), (0.8, float("nan"))]) == 0.8


def test_sequential_fit_matches_each_layers_input_with_earlier_layers_linear(tiny_llama):
    batch = random_batches(n=1)[0]
    original = tiny_llama(batch).logits
    model = patch_model(tiny_llama, TaperNormConfig.paper())
    for _, layer in tapered_norms(model):
        layer.sink_tokens = 1
    values = fit_linear_branch(model, [batch], trim=4.0, per_channel=True, sequential=True)
    assert all(float(layer.gate) == 1.0 for _, layer in tapered_norms(model))
    assert torch.equal(model(batch).logits, original)
    set_gate(model, 0.0)  # now every layer sees what it saw during its own fit
    inputs = layer_inputs(model, batch)
    for name, layer in tapered_norms(model):
        num, den, _ = typical_token_sums(inputs[name], layer.eps, centred=False, trim=4.0, skip=1)
        c = float((num * layer.weight.pow(2)).sum() / (den * layer.weight.pow(2)).sum())
        assert values[name] == pytest.approx(c, rel=1e-5)
        torch.testing.assert_close(layer.c * layer.taper_weight, num / den * layer.weight, rtol=1e-4, atol=1e-6)


def test_calibration_scale_multiplies_the_per_channel_fit():
    """The per-channel fit scales the whole linear map (c * taper_weight) by calibration_scale."""
    batches = random_batches(n=2)
    plain, scaled = (
        patch_model(build(tiny_llama_config()), TaperNormConfig.paper()),
        patch_model(build(tiny_llama_config()), TaperNormConfig.paper(experimental={"calibration_scale": 0.5})),
    )
    fit_linear_branch(plain, batches, per_channel=True)
    fit_linear_branch(scaled, batches, per_channel=True)
    for (_, a), (_, b) in zip(tapered_norms(plain), tapered_norms(scaled)):
        torch.testing.assert_close(b.c * b.taper_weight, 0.5 * a.c * a.taper_weight)


def test_the_product_per_channel_fit_is_these_least_squares_over_the_warmup():
    """linear_fit="per_channel" (TaperController at taper_start) agrees with the research fit on the same batches."""
    batches = random_batches(n=2, batch=2, length=16)
    model = patch_model(
        build(tiny_llama_config()), TaperNormConfig.paper(experimental={"linear_fit": "per_channel"})
    ).train()
    reference = patch_model(build(tiny_llama_config()), TaperNormConfig.paper())
    controller = TaperController(model, TaperSchedule(1, 3), total_steps=3, distillation=False)
    controller.step_begin(0)
    for ids in batches:  # one optimizer step of two micro-batches (no update: the weights stay those of reference)
        model(input_ids=ids)
    controller.step_end(0)
    controller.step_begin(1)  # calibrates from the EMA of that step
    fit_linear_branch(reference, batches, trim=None, per_channel=True)  # the same least squares, from the batches
    fitted = dict(tapered_norms(reference, include_kept=True))
    for name, layer in tapered_norms(model, include_kept=True):
        if layer.tapered:
            torch.testing.assert_close(
                layer.c * layer.taper_weight, fitted[name].c * fitted[name].taper_weight, rtol=1e-5, atol=1e-6, msg=name
            )


def test_the_research_corpora_read_the_products_listing(tmp_path):
    """Both byte-level corpora list files as the product's embedded corpus does: tests and pydoc_data left out."""
    from conversion_scripts.experiments import from_scratch
    from conversion_scripts.experiments.mlp_norms import data as mlp_data

    for index in range(10):
        (tmp_path / f"module{index}.py").write_text(f"x = {index}\n" * 20)
    for excluded in ("tests", "pydoc_data"):
        (tmp_path / excluded).mkdir()
        (tmp_path / excluded / "topics.py").write_text("EXCLUDED\n" * 200)
    total = sum(len(f"x = {i}\n" * 20) + 1 for i in range(10))
    for corpus in (
        from_scratch.load_corpus(total - 121, 121, root=tmp_path),
        mlp_data.load_corpus(total - 121, 121, root=tmp_path),
    ):
        assert corpus.files == 10
        assert b"EXCLUDED" not in bytes(corpus.train.tolist()) + bytes(corpus.valid.tolist())
