"""torch.compile: our layers add no graph breaks, no host syncs, and a moving gate does not recompile.

``fullgraph=True`` turns any graph break into an error, and a host sync such as ``.item()`` in a
forward is a graph break, so compiling the whole model with it is the check. A counting backend
(it runs the captured graph eagerly, no C++ compiler needed) counts compilations.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from hf_tapernorm import TaperController, TaperNormConfig, fold_model, patch_model
from hf_tapernorm.layers import set_gate
from hf_tapernorm.training import TaperSchedule, calibrate

from .conftest import build, random_batches, tiny_gpt2_config, tiny_llama_config

# No dropout, so training-mode forwards of the compiled and the eager model can be compared exactly.
CONFIGS = {
    "llama": tiny_llama_config,
    "gpt2": lambda: tiny_gpt2_config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
}
PACKAGE = str(Path(__file__).resolve().parents[1] / "hf_tapernorm")


def _compile_works() -> bool:
    try:
        return bool(torch.compile(lambda x: x + 1, backend="eager", fullgraph=True)(torch.ones(1)).eq(2).all())
    except Exception:  # noqa: BLE001 - any failure means this platform cannot compile
        return False


pytestmark = pytest.mark.skipif(not _compile_works(), reason="torch.compile is not available on this platform")


class CountingBackend:
    """A dynamo backend that counts the graphs it is given and runs them as captured."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, graph_module, example_inputs):
        self.graphs += 1
        return graph_module.forward


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _calibrated(arch: str, scope: str = "internal"):
    model = patch_model(build(CONFIGS[arch]()), TaperNormConfig.paper(scope=scope)).train()
    with torch.no_grad():
        for ids in random_batches(n=2):
            model(input_ids=ids)
    calibrate(model)
    return model


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("variant", ["explicit", "folded"])
def test_gate_zero_models_compile_to_one_graph(arch, variant, tmp_path):
    model = _calibrated(arch)
    set_gate(model, 0.0)
    model.eval()
    if variant == "folded":
        fold_model(model).save_pretrained(tmp_path)
        model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = random_batches(n=1)[0]
    backend = CountingBackend()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with torch.no_grad():
        expected = model(input_ids=ids, use_cache=False).logits
        for _ in range(3):
            torch.testing.assert_close(compiled(input_ids=ids, use_cache=False).logits, expected, rtol=1e-5, atol=1e-6)
    assert backend.graphs == 1


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_cached_decoding_step_has_no_graph_break_from_our_code(arch):
    model = _calibrated(arch)
    set_gate(model, 0.0)
    model.eval()
    ids = random_batches(n=1)[0]
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        token = model(input_ids=ids, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        explanation = torch._dynamo.explain(model)(input_ids=token, cache=cache, use_cache=True)
    ours = [
        reason.reason
        for reason in explanation.break_reasons
        if any(frame.filename.startswith(PACKAGE) for frame in reason.user_stack)
    ]
    assert ours == []
    assert explanation.graph_break_count == 0  # transformers' own decoding step does not break either


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_moving_gate_in_training_does_not_recompile(arch):
    model = _calibrated(arch)
    reference = _calibrated(arch)  # same seed and batches: identical weights, run eagerly
    # The per-step bookkeeping of a real loop (statistics, scale anchor sums, divergence watch).
    controller = TaperController(model, TaperSchedule(k_start=1, k_end=10, total_steps=10))
    # GPT-2 has no loss_type, and transformers' warning about it is itself a graph break: name it.
    model.loss_type = reference.loss_type = "ForCausalLM"
    ids = random_batches(n=1)[0]
    backend = CountingBackend()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    graphs = []
    for step, gate in enumerate((0.9, 0.8, 0.7), start=2):
        controller.step_begin(step)
        set_gate(model, gate)  # gates of its own, on the buffer the schedule's go to
        set_gate(reference, gate)
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        controller.step_end(step)
        expected = reference(input_ids=ids, labels=ids).loss
        # The gate is read from its buffer, not baked into the graph as a constant.
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
        graphs.append(backend.graphs)
    # One graph for the model, one for the scale anchor's loss hook on the top-level module.
    assert graphs == [2, 2, 2]
    grads = [p.grad for name, p in model.named_parameters() if name.endswith("taper_weight") and p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    set_gate(model, 0.0)  # leaving the taper is a new phase: exactly one more graph, then none
    for step in (5, 6):
        controller.step_begin(step)
        set_gate(model, 0.0)
        compiled(input_ids=ids, labels=ids).loss.backward()
        controller.step_end(step)
    assert backend.graphs == 3
