"""The full round trip for every family in the table (and the config variants whose norm layout differs),
and for families absent from the table, which go through automatic discovery alone.

patch (exact at g = 1) -> calibrate -> perturb gammat -> g = 0 -> fold (within 1e-5 relative of the
unfolded g = 0 model in fp32) -> export -> reload with the package (Auto classes) and, in one shared
subprocess, without it (trust_remote_code). Each case is built once per module and shared by the tests.
"""

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_tapernorm import TaperNormConfig, export_folded, fold_model, patch_model
from hf_tapernorm.architectures.discovery import is_norm_module
from hf_tapernorm.architectures.table import ARCHITECTURES
from hf_tapernorm.layers import set_gate, tapered_norms
from hf_tapernorm.training import calibrate
from tests.conftest import (
    DISCOVERED_CASES,
    FAMILY_CASES,
    build,
    random_batches,
    run_without_hf_tapernorm,
    tiny_family_config,
)

# Every case folds everything (scope "all": internal norms and the final norm into the head); a few
# also keep the final norm (scope "internal"), so its own norm class is exported as a real norm.
TRIPS = [(case, "all") for case in sorted(FAMILY_CASES) + sorted(DISCOVERED_CASES)] + [
    (case, "internal") for case in ("gemma", "opt", "phi", "qwen3", "olmo2")
]
IDS = random_batches(n=1, batch=2, length=12, seed=7)[0]


@dataclass
class RoundTrip:
    original: torch.Tensor  # logits before patching
    at_gate_one: torch.Tensor  # patched, g = 1
    unfolded: torch.Tensor  # patched, calibrated, perturbed gammat, g = 0
    folded: torch.Tensor
    reloaded: torch.Tensor  # through AutoModelForCausalLM with hf_tapernorm imported
    norms_left: int  # norm modules in the folded model
    folder: str


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits.float()


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _round_trip(case: str, scope: str, root: Path) -> RoundTrip:
    model = build(tiny_family_config(case))
    original = _logits(model)
    patch_model(model, TaperNormConfig.paper(scope=scope))
    at_gate_one = _logits(model)
    model.train()
    with torch.no_grad():
        model(random_batches(n=1)[0])
    calibrate(model)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():  # a trained gammat differs from the norm's gain: fold must use gammat
        for _, layer in tapered_norms(model):
            noise = torch.randn(layer.taper_weight.shape, generator=generator)
            layer.taper_weight.mul_(1.0 + 0.2 * noise)
    set_gate(model, 0.0)
    model.eval()
    unfolded = _logits(model)
    folded = fold_model(model, check=False)  # compared below, on the same ids
    folder = export_folded(folded, root / f"{case}-{scope}")
    reloaded = AutoModelForCausalLM.from_pretrained(folder)
    return RoundTrip(
        original,
        at_gate_one,
        unfolded,
        _logits(folded),
        _logits(reloaded),
        sum(is_norm_module(m) for m in folded.modules()),
        str(folder),
    )


@pytest.fixture(scope="module")
def round_trip(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    done: dict[tuple[str, str], RoundTrip] = {}

    def get(case: str, scope: str) -> RoundTrip:
        if (case, scope) not in done:
            done[case, scope] = _round_trip(case, scope, root)
        return done[case, scope]

    return get


def test_discovered_cases_are_absent_from_the_table():
    assert {tiny_family_config(case).model_type for case in DISCOVERED_CASES}.isdisjoint(ARCHITECTURES)


def test_every_table_entry_has_a_test_case():
    covered = {tiny_family_config(case).model_type for case in FAMILY_CASES}
    assert covered == set(ARCHITECTURES), f"table entries without a FAMILY_CASES case: {set(ARCHITECTURES) - covered}"


def test_register_architecture_makes_a_family_a_table_family(caplog):
    import logging

    from hf_tapernorm.architectures import register_architecture
    from hf_tapernorm.architectures.styles import NormStyle
    from hf_tapernorm.architectures.table import Architecture, NormSite

    olmo = Architecture(
        "olmo", NormStyle.LAYER, "layers",
        (NormSite("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), role="attention"),
         NormSite("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), role="mlp")),
        "norm", gated_mlp=True,
    )  # fmt: skip
    with pytest.raises(ValueError, match="already has an architecture entry"):
        register_architecture("llama", olmo)
    with pytest.raises(ValueError, match="site 'x' has role 'ffn'"):
        register_architecture(
            "olmo", Architecture("olmo", NormStyle.LAYER, "layers", (NormSite("x", ("y",), role="ffn"),), "norm")
        )
    register_architecture("olmo", olmo)
    try:
        model = build(tiny_family_config("olmo"))
        with caplog.at_level(logging.INFO, logger="hf_tapernorm"):
            patch_model(model, TaperNormConfig.paper())
        assert "discovered its norms" not in caplog.text  # the entry, not discovery
        assert len(list(tapered_norms(model))) == 4
    finally:
        del ARCHITECTURES["olmo"]


@pytest.mark.parametrize("case,scope", TRIPS)
def test_round_trip(round_trip, case, scope):
    result = round_trip(case, scope)
    assert torch.equal(result.at_gate_one, result.original)  # exact at g = 1
    assert _relative(result.folded, result.unfolded) <= 1e-5
    assert torch.equal(result.reloaded, result.folded)
    assert result.norms_left == (1 if scope == "internal" else 0)  # only a kept final norm remains
    assert _relative(result.unfolded, result.original) > 1e-3  # g = 0 really changed the model


def test_reload_without_the_package(round_trip, tmp_path):
    trips = [round_trip(case, scope) for case, scope in TRIPS]
    folders = [trip.folder for trip in trips]
    results = run_without_hf_tapernorm(tmp_path, folders, IDS)
    for trip in trips:
        loaded = results[trip.folder]
        assert loaded["class"].startswith("transformers_modules."), (trip.folder, loaded["class"])
        assert torch.equal(loaded["logits"], trip.folded), trip.folder
