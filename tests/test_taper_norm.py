import pytest
import torch
from torch import nn
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from hf_tapernorm import TaperStateError
from hf_tapernorm.architectures import NormStyle
from hf_tapernorm.layers import TaperNorm
from hf_tapernorm.training import calibrate
from hf_tapernorm.training.calibration import update_statistics


def _llama_norm(d=16, dtype=torch.float32):
    norm = LlamaRMSNorm(d, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(d))
    return norm


def _layer_norm(d=16):
    norm = nn.LayerNorm(d, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(d))
        norm.bias.copy_(0.2 * torch.randn(d))
    return norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "make,style",
    [
        (lambda: _llama_norm(), NormStyle.RMS),
        (lambda: _layer_norm(), NormStyle.LAYER),
        (lambda: GemmaRMSNorm(16, eps=1e-6), NormStyle.RMS_OFFSET),
    ],
)
def test_gate_one_is_exactly_the_replaced_norm(make, style, dtype):
    torch.manual_seed(0)
    norm = make().to(dtype)
    if style is NormStyle.RMS_OFFSET:
        with torch.no_grad():
            norm.weight.copy_(0.3 * torch.randn(16))
    taper = TaperNorm.from_norm(norm, style)
    h = (3 * torch.randn(2, 5, 16)).to(dtype)
    assert taper.weight is norm.weight  # the same Parameter: tied/shared parameters stay shared
    out = taper(h)
    assert out.dtype == norm(h).dtype
    assert torch.equal(out, norm(h))


def test_gate_zero_rms_is_c_h_gammat_and_skips_statistics(monkeypatch):
    torch.manual_seed(0)
    taper = TaperNorm.from_norm(_llama_norm(), NormStyle.RMS)
    with torch.no_grad():
        taper.taper_weight.copy_(torch.randn(16))
    taper.mark_calibrated(0.37)
    taper.set_gate(0.0)
    h = torch.randn(2, 5, 16)

    def forbidden(*args, **kwargs):
        raise AssertionError("a per-token statistic was computed at g = 0")

    monkeypatch.setattr(torch, "rsqrt", forbidden)
    out = taper(h)
    torch.testing.assert_close(out, 0.37 * h * taper.taper_weight, rtol=1e-6, atol=1e-6)


def test_gate_zero_layernorm_and_gradients():
    torch.manual_seed(0)
    taper = TaperNorm.from_norm(_layer_norm(), NormStyle.LAYER)
    taper.mark_calibrated(0.5)
    with torch.no_grad():
        taper.taper_weight.mul_(torch.rand(16) + 0.5)
    taper.set_gate(0.0)
    taper.train()
    h = torch.randn(3, 4, 16)
    out = taper(h)
    expected = taper.bias + 0.5 * (h - h.mean(-1, keepdim=True)) * taper.taper_weight
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    c_before = taper.c.clone()
    out.pow(2).sum().backward()
    assert taper.taper_weight.grad is not None and taper.taper_weight.grad.abs().sum() > 0
    assert not taper.c.requires_grad
    assert torch.equal(taper.c, c_before)


def test_mixed_gate_interpolates_the_two_branches():
    torch.manual_seed(0)
    norm = _llama_norm()
    taper = TaperNorm.from_norm(norm, NormStyle.RMS)
    taper.mark_calibrated(0.2)
    h = torch.randn(2, 3, 16)
    taper.set_gate(0.25)
    expected = 0.25 * norm(h) + 0.75 * 0.2 * h * taper.taper_weight
    torch.testing.assert_close(taper(h), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("style", [NormStyle.RMS, NormStyle.LAYER])
def test_statistics_and_c_match_an_independent_computation(style):
    torch.manual_seed(0)
    norm = _llama_norm() if style is NormStyle.RMS else _layer_norm()
    taper = TaperNorm.from_norm(norm, style, ema_rate=0.1)
    taper.train()
    model = nn.Sequential(taper)
    steps = [[torch.randn(2, 4, 16) * (1 + i) for i in range(2)] for _ in range(3)]  # 3 steps x 2 micro
    for micro_batches in steps:
        for h in micro_batches:
            model(h)
        update_statistics(model)

    # Independent computation of docs/method.md, section 3.
    gamma = norm.weight.detach().double()
    a = b = 0.0
    for micro_batches in steps:
        x = torch.cat([h.reshape(-1, 16) for h in micro_batches]).double()
        if style is NormStyle.LAYER:
            x = x - x.mean(-1, keepdim=True)
        r = torch.sqrt(x.pow(2).mean(-1) + 1e-5)
        energy = (x * gamma).pow(2).sum(-1)
        a = 0.9 * a + 0.1 * (energy / r).mean().item()
        b = 0.9 * b + 0.1 * energy.mean().item()
    correction = 1 - 0.9**3
    expected_c = (a / correction) / (b / correction + 1e-12)

    assert int(taper.ema_steps) == 3
    assert float(taper.ema_num) == pytest.approx(a, rel=1e-5)
    assert float(taper.ema_den) == pytest.approx(b, rel=1e-5)
    values = calibrate(model)
    assert values[""] == pytest.approx(expected_c, rel=1e-5)
    assert float(taper.c) == pytest.approx(expected_c, rel=1e-5)
    assert torch.equal(taper.taper_weight, norm.weight)
    assert bool(taper.calibrated)


def test_eval_mode_forwards_do_not_count():
    taper = TaperNorm.from_norm(_llama_norm(), NormStyle.RMS).eval()
    taper(torch.randn(2, 3, 16))
    assert taper.pending is None


def test_calibrate_refuses_missing_and_non_finite_statistics():
    taper = TaperNorm.from_norm(_llama_norm(), NormStyle.RMS)
    taper.site_name = "model.layers.0.input_layernorm"
    model = nn.Sequential(taper)
    with pytest.raises(RuntimeError, match=r"model\.layers\.0\.input_layernorm has no calibration statistics"):
        calibrate(model)
    taper.train()
    taper(torch.full((1, 2, 16), float("nan")))
    with pytest.raises(RuntimeError, match=r"model\.layers\.0\.input_layernorm are not usable"):
        calibrate(model)
    assert not taper.is_calibrated


def test_bad_gate_and_kept_norm_errors():
    taper = TaperNorm.from_norm(_llama_norm(), NormStyle.RMS)
    taper.site_name = "model.layers.1.input_layernorm"
    with pytest.raises(ValueError, match=r"gate must be in \[0, 1\], got 1.5 for model\.layers\.1"):
        taper.set_gate(1.5)
    kept = TaperNorm.from_norm(_llama_norm(), NormStyle.RMS, tapered=False)
    with pytest.raises(TaperStateError, match="kept as a norm"):
        kept.set_gate(0.5)


def test_state_dict_round_trip_keeps_every_buffer_and_the_phase():
    torch.manual_seed(0)
    source = nn.Sequential(TaperNorm.from_norm(_llama_norm(), NormStyle.RMS, ema_rate=0.1)).train()
    source(torch.randn(2, 3, 16))
    update_statistics(source)
    calibrate(source)
    source[0].set_gate(0.0)
    target = nn.Sequential(TaperNorm.from_norm(_llama_norm(), NormStyle.RMS, ema_rate=0.1))
    target.load_state_dict(source.state_dict())
    for key in ("gate", "c", "ema_num", "ema_den", "ema_steps", "calibrated", "weight", "taper_weight"):
        assert torch.equal(source.state_dict()[f"0.{key}"], target.state_dict()[f"0.{key}"]), key
    assert target[0].is_calibrated
    h = torch.randn(2, 3, 16)
    torch.testing.assert_close(target.eval()(h), source.eval()(h), rtol=0, atol=0)
