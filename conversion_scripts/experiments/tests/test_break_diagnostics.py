"""restore_norms.py (which norms it switches back), sink_takeover.py and length_profile.py (what they read), on tiny
models."""

import copy

import pytest
import torch

from conversion_scripts.experiments.restore_norms import broken_of, layer_range, set_norms
from conversion_scripts.experiments.scan_runs import IDLE, idle_documents, texts
from conversion_scripts.experiments.sink_takeover import trace
from hf_tapernorm.layers import set_gate
from tests.conftest import char_tokenizer, random_batches
from tests.helpers import tapered as tapered_tiny_model

pytestmark = pytest.mark.experiments

MLP_NORMS = ["model.layers.*.post_attention_layernorm"]


def test_layer_ranges_read_as_the_docstring_says():
    assert layer_range("0-3") == [0, 1, 2, 3] and layer_range("2") == [2] and layer_range("14-15") == [14, 15]


def test_restoring_every_tapered_attention_norm_gives_the_normalized_model_back():
    model = tapered_tiny_model("llama", keep_norms=MLP_NORMS)
    ids = random_batches(n=1)[0]
    with torch.no_grad():
        tapered = model(ids).logits
        normalized = copy.deepcopy(model)
        set_gate(normalized, 1.0)  # every tapered norm computes its norm again
        expected = normalized(ids).logits
        assert set_norms(model, [0], 1.0) == 1  # one layer's attention input norm, nothing else
        one = model(ids).logits
        assert set_norms(model, [1], 1.0) == 1
        torch.testing.assert_close(model(ids).logits, expected)
        assert not torch.allclose(one, expected) and not torch.allclose(tapered, expected)
        assert set_norms(model, [0, 1], 0.0) == 2
        torch.testing.assert_close(model(ids).logits, tapered)  # back at the run's gate
    assert set_norms(model, [5], 1.0) == 0  # no such layer: the script refuses the group


def test_broken_blocks_are_read_from_both_sets_of_the_report():
    report = {
        "heldout_documents": {"broken_blocks": {"blocks": [3]}},
        "out_of_corpus_blocks": {"broken_blocks": {"threshold_nats": 2.0, "blocks": [207, 9]}},
    }
    assert broken_of(report) == {"held-out": [3], "out-of-corpus": [207, 9]}
    assert broken_of({}) == {"held-out": [], "out-of-corpus": []}


def test_the_takeover_trace_reads_each_layer_s_output_and_follows_the_most_grown_token():
    model = tapered_tiny_model("llama", keep_norms=MLP_NORMS, sink_token_ids=[0], num_hidden_layers=4)
    reference = copy.deepcopy(model)
    set_gate(reference, 1.0)
    ids = torch.cat([torch.zeros(1, 1, dtype=torch.long), random_batches(n=1, batch=1)[0]], dim=1)
    result = trace(model, reference, ids, position=None)
    with torch.no_grad():
        mine = model(ids, output_hidden_states=True).hidden_states
        theirs = reference(ids, output_hidden_states=True).hidden_states
    rms = [h[0].double().pow(2).mean(-1).sqrt() for h in mine[1:-1]]
    ref = [h[0].double().pow(2).mean(-1).sqrt() for h in theirs[1:-1]]
    assert [row["layer"] for row in result["layers"]] == list(range(len(model.model.layers) - 1))
    ratio = torch.stack([a[1:] / b[1:] for a, b in zip(rms, ref)]).max(0).values
    assert result["position"] == int(ratio.argmax()) + 1
    for row, a, b in zip(result["layers"], rms, ref):
        assert row["sink"] == pytest.approx([float(a[0]), float(b[0])])
        assert row["token"] == pytest.approx([float(a[result["position"]]), float(b[result["position"]])])
        assert 0.0 <= row["sink_share"][0] <= 1.0 and row["mlp_update"][0] > 0
    for model_, loss in zip((model, reference), result["cross_entropy"]):  # the report's reading: targets 2..n-1
        with torch.no_grad():
            logits = model_(ids).logits[0, 1:-1]
        assert loss == pytest.approx(float(torch.nn.functional.cross_entropy(logits.double(), ids[0, 2:])), rel=1e-6)


def test_the_scan_reads_only_the_texts_asked_for():

    report = {"data": {"source": "python-stdlib", "block_size": 32, "heldout_percentage": 5.0}}
    (unseen,) = texts(report, char_tokenizer(), [], 4, names=[IDLE])
    assert unseen.name == IDLE and tuple(unseen.blocks.shape) == (4, 32)
    assert unseen.documents[0] == idle_documents()[0][0]  # IDLE's first paragraph, and no other text read


def test_the_length_profile_bins_positions_and_reads_each_layer_s_sink_share_and_residual():
    from conversion_scripts.experiments.length_profile import attention_and_residuals, position_bins

    assert position_bins(1024, 128) == [(1, 128), (128, 256), (256, 512), (512, 1024)]
    assert position_bins(300, 128) == [(1, 128), (128, 256), (256, 300)]
    model = tapered_tiny_model("llama", keep_norms=MLP_NORMS, sink_token_ids=[0], num_hidden_layers=4)
    ids = torch.cat([torch.zeros(1, 1, dtype=torch.long), random_batches(n=1, batch=1)[0]], dim=1)
    before = model.config._attn_implementation
    shares, residual = attention_and_residuals(model, ids)
    assert model.config._attn_implementation == before  # eager only for the trace
    layers, positions = 4, ids.shape[1]
    assert shares.shape == (layers, positions) and residual.shape == (layers - 1, positions)
    assert torch.allclose(shares[:, 0], torch.ones(layers, dtype=shares.dtype))  # the sink sees only itself
    assert bool(((shares >= 0) & (shares <= 1 + 1e-6)).all())
    model.set_attn_implementation("eager")
    with torch.no_grad():
        output = model(ids, output_attentions=True, output_hidden_states=True)
    assert torch.allclose(shares[2], output.attentions[2][0, :, :, 0].double().mean(0), atol=1e-6)
    assert torch.allclose(residual[1], output.hidden_states[2][0].double().pow(2).mean(-1).sqrt(), atol=1e-6)
