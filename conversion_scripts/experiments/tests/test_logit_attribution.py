"""conversion_scripts/logit_attribution.py on tiny random exports: on an affine readout (the final norm folded)
the attributions are the direct effects and the logit lens is the running sum of them; through a real final
norm neither holds. Plain transformers and TransformerLens read the same differences."""

from __future__ import annotations

import pytest

from conversion_scripts.logit_attribution import figures, lens_decomposition, transformers_decomposition
from hf_tapernorm import fold_model
from tests.conftest import build, random_batches
from tests.helpers import CONFIGS, tapered

IDS = random_batches(n=1, batch=1, length=24, seed=5)[0]


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_an_affine_readout_makes_attribution_direct_effect_and_lens_one_story(kind):
    export = fold_model(tapered(kind, scope="all")).eval()
    normalized = build(CONFIGS[kind]()).eval()
    folded, plain = (
        figures(transformers_decomposition(export, IDS, 0)),
        figures(transformers_decomposition(normalized, IDS, 0)),
    )
    for result in (folded, plain):  # the decomposition itself is exact on both
        assert result["summed"]["parts add up to the stream (max abs)"] <= 1e-5
        assert result["summed"]["attributions + constant vs logit (max abs)"] <= 1e-5
    assert folded["summed"]["direct effect vs attribution (max abs)"] <= 1e-5
    assert folded["summed"]["direct effects + constant vs logit (max abs)"] <= 1e-5
    assert plain["summed"]["direct effect vs attribution (max abs)"] > 1e-3
    lens = "lens vs constant + attributions so far (mean abs)"
    assert max(row[lens] for row in folded["lens"].values()) <= 1e-5
    assert plain["lens"]["layer 0"][lens] > 1e-3  # the lens reads a layer with its own scale
    assert plain["lens"]["layer 1"]["top-1 as the output's"] == 1.0  # the last layer's lens is the output


def test_a_sink_export_read_without_its_sink_and_transformer_lens_agree_with_transformers():
    pytest.importorskip("transformer_lens")
    from hf_tapernorm.integrations import transformer_bridge
    from tests.conftest import char_tokenizer

    export = fold_model(tapered("llama", scope="all", sink_token_ids=[5])).eval()
    plain = figures(transformers_decomposition(export, IDS, 0))
    bridge = transformer_bridge(export, tokenizer=char_tokenizer())
    bridge.enable_compatibility_mode(disable_warnings=True)
    lens = figures(lens_decomposition(bridge, IDS, 0))
    assert lens["summed"]["direct effect vs attribution (max abs)"] <= 1e-5
    assert lens["summed"]["attributions + constant vs logit (max abs)"] <= 1e-5
    for layer, row in plain["lens"].items():
        assert row["top-1 as the output's"] == pytest.approx(lens["lens"][layer]["top-1 as the output's"])
