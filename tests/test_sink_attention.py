"""The runaway remedy of the gated-MLP recipe: the attention norms of the runaway layers kept, and the
sink-attention term (the teacher's share of attention on the sink, per layer, head and position)."""

import copy

import pytest
import torch
from transformers import Trainer, TrainingArguments

from hf_tapernorm import ConfigurationError, TaperCallback, TaperNormConfig, patch_model
from hf_tapernorm.architectures.recipe_rules import RUNAWAY_LAYER, in_runaway_band, norms_to_keep
from hf_tapernorm.layers import remove_training_loss_term, set_gate
from hf_tapernorm.training import TaperController
from hf_tapernorm.training.distillation import Distillation
from hf_tapernorm.training.sink_attention import (
    bernoulli_kl,
    sink_share_attention,
    sink_shares,
    use_sink_share_attention,
)

from .conftest import build, random_batches, tiny_family_config, tiny_gpt2_config, tiny_llama_config

SINK_SHARE = sink_share_attention(1)  # the training forwards' attention with one sink token

BOS = tiny_llama_config().bos_token_id


def sink_first_batches(n: int = 1) -> list[torch.Tensor]:
    """Random batches whose sequences start with the BOS, as the recipe's sink requires."""
    batches = random_batches(n=n, batch=2)
    for batch in batches:
        batch[:, 0] = BOS
    return batches


def test_sink_shares_are_the_attention_on_the_sink_tokens_and_the_kl_is_bernoulli():
    torch.manual_seed(0)
    attentions = [torch.softmax(torch.randn(2, 3, 5, 5), dim=-1) for _ in range(4)]
    assert sink_shares(attentions).shape == (4, 2, 3, 4)  # layers, batch, heads, the queries after the sink
    assert torch.equal(sink_shares(attentions)[1, 0, 2], attentions[1][0, 2, 1:, 0])
    two = sink_shares(attentions, sink_length=2)  # two sink tokens: their shares add up, queries from position 2
    torch.testing.assert_close(two[3, 1, 0], attentions[3][1, 0, 2:, :2].sum(-1))
    assert bernoulli_kl(sink_shares(attentions), sink_shares(attentions)).abs().max() < 1e-6
    p, q = torch.tensor([0.7]), torch.tensor([0.2])
    expected = 0.7 * torch.log(torch.tensor(0.7 / 0.2)) + 0.3 * torch.log(torch.tensor(0.3 / 0.8))
    assert float(bernoulli_kl(p, q)) == pytest.approx(float(expected), rel=1e-5)


def test_the_runaway_band_is_layers_4_to_13_of_30_and_never_empty():
    assert [i for i in range(30) if in_runaway_band(i, 30)] == list(range(4, 14))  # where it was measured
    for depth in range(2, 65):
        band = [i for i in range(depth) if in_runaway_band(i, depth)]
        assert band and band == list(range(band[0], band[-1] + 1)) and band[-1] < depth // 2 + 1


def test_a_gated_model_s_recipe_keeps_the_runaway_layers_attention_norms_and_adds_the_term():
    model = build(tiny_llama_config(num_hidden_layers=30, hidden_size=32, intermediate_size=32))
    keep = norms_to_keep(model)
    runaway = sorted(int(path.split(".")[2]) for path, reason in keep.items() if reason == RUNAWAY_LAYER)
    assert runaway == list(range(4, 14))
    assert all(path.endswith("input_layernorm") for path, reason in keep.items() if reason == RUNAWAY_LAYER)
    config = TaperNormConfig.for_model(model)  # the measured arm: every MLP norm, and layers 4-13's attention norms
    measured = {f"model.layers.{i}.post_attention_layernorm" for i in range(30)}
    measured |= {f"model.layers.{i}.input_layernorm" for i in range(4, 14)}
    assert set(config.keep_norms) == measured
    assert config.distillation.sink_attention_weight == 3.0 and config.sink_token_ids == [model.config.bos_token_id]
    gpt2 = TaperNormConfig.for_model(build(tiny_gpt2_config()))  # the paper's recipe: nothing of the remedy
    assert gpt2.distillation.sink_attention_weight == 0.0 and gpt2.keep_norms == []


def test_the_term_follows_what_it_needs_and_a_contradiction_is_refused():
    model = build(tiny_llama_config())

    def term(**options):
        return TaperNormConfig.for_model(model, **options).distillation.sink_attention_weight

    assert term(distill_weight=0.0) == 0.0  # derived, not refused
    assert term(sink_token_ids=[]) == 0.0 and term(scope="final") == 0.0 and term(sink_attention_weight=0.3) == 0.3
    with pytest.raises(
        ConfigurationError, match=r"sink_attention_weight=1 needs TaperNormConfig.distillation.weight > 0"
    ):
        TaperNormConfig.for_model(model, distill_weight=0.0, sink_attention_weight=1.0)
    with pytest.raises(ConfigurationError, match=r"sink_attention_weight=0.5 needs sink_token_ids"):
        TaperNormConfig(distillation={"weight": 1.0, "sink_attention_weight": 0.5})
    with pytest.raises(ConfigurationError, match=r"TaperNormConfig.distillation.sink_attention_weight must be >= 0"):
        TaperNormConfig.paper(sink_attention_weight=-1.0)
    with pytest.raises(ConfigurationError, match=r"sink_attention_weight must be a finite number"):
        TaperNormConfig(distillation={"sink_attention_weight": float("inf")})


def _eager_attentions(model, batch):
    """``model``'s full attention weights on ``batch`` from an eager copy (the term's own attention is not used)."""
    copied = copy.deepcopy(model).eval()
    copied.__dict__.pop("_tapernorm_loss_terms", None)
    copied._forward_pre_hooks.clear()
    copied._forward_hooks.clear()
    copied.set_attn_implementation("eager")
    with torch.no_grad():
        return copied(input_ids=batch, output_attentions=True).attentions


def _expected_term(student, teacher, batch, sink_length=1):
    """The term computed apart: both models' eager attentions on ``batch``, the Bernoulli KL of the sink shares."""
    s, t = _eager_attentions(student, batch), _eager_attentions(teacher, batch)
    kl = bernoulli_kl(sink_shares(t, sink_length), sink_shares(s, sink_length)).mean(dim=(0, 2))
    return float(kl.mean())


@pytest.mark.parametrize("distill_from", ["gate_start", "original", "current"])
def test_the_term_adds_the_sink_share_kl_to_the_training_loss(distill_from):
    torch.manual_seed(0)
    batch = sink_first_batches()[0]
    model = build(tiny_llama_config(num_hidden_layers=4))
    assert model.config._attn_implementation == "sdpa"
    model = patch_model(
        model,
        TaperNormConfig.for_model(
            model, sink_attention_weight=5.0, experimental={"distill_from": distill_from}, taper_start=1, taper_end=5
        ),
    )
    controller = TaperController(model, total_steps=10)  # the gate starts to fall after step 1
    distillation = controller.distillation
    assert model.config._attn_implementation == SINK_SHARE and distillation.sink_attention.weight == 5.0
    model.train()
    controller.step_begin(0)
    model(input_ids=batch, labels=batch)  # gate 1: the statistics for calibration; no teacher yet
    controller.step_end(0)
    controller.step_begin(1)  # below 1: the teacher exists from here
    assert controller.gate < 1.0
    model(input_ids=batch, labels=batch)  # the first forward below 1 takes the snapshot (gate_start)
    controller.log_metrics()
    with torch.no_grad():  # the student moves away from its teacher: its heads attend elsewhere
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(10.0)
    set_gate(model, 0.3)
    teacher = model if distill_from == "current" else distillation.teacher
    if distill_from == "current":
        teacher = copy.deepcopy(model).eval()
        set_gate(teacher, 1.0)
    else:
        assert teacher.config._attn_implementation == SINK_SHARE or distill_from == "original"
    expected = _expected_term(model, teacher, batch)
    assert expected > (1e-5 if distill_from == "current" else 5e-4)
    with_term = model(input_ids=batch, labels=batch).loss
    assert controller.log_metrics()["taper/sink_attention"] == pytest.approx(5.0 * expected, rel=1e-4)
    remove_training_loss_term(model, "sink_attention")
    without = model(input_ids=batch, labels=batch).loss
    assert float((with_term - without).detach()) == pytest.approx(5.0 * expected, rel=1e-3, abs=2e-6)
    controller.end()  # the model has its own attention implementation back, and no term
    assert model.config._attn_implementation == "sdpa"
    assert controller.distillation is None and "taper/sink_attention" not in controller.log_metrics()
    assert torch.equal(model(input_ids=batch, labels=batch).loss, model(input_ids=batch, labels=batch).loss)


def test_the_term_is_off_while_the_distillation_is_idle():
    batch = sink_first_batches()[0]
    model = build(tiny_llama_config())
    model = patch_model(model, TaperNormConfig.for_model(model))
    distillation = Distillation.from_config(model.tapernorm_config).attach(model)
    model.train()(input_ids=batch, labels=batch)  # gate 1: no teacher, no term
    assert distillation.log_metrics() == {"taper/distill": 0.0}
    distillation.remove()
    assert model.config._attn_implementation == "sdpa"


def test_a_trainer_run_logs_the_term_and_ends_with_the_model_s_own_attention(tmp_path):
    model = build(tiny_llama_config(num_hidden_layers=4))
    model = patch_model(model, TaperNormConfig.for_model(model))
    data = [{"input_ids": row, "labels": row} for row in torch.cat(sink_first_batches(4))]
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=6,
        per_device_train_batch_size=2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[TaperCallback(taper_start=1, taper_end=4)])
    trainer.train()
    logged = [entry["taper/sink_attention"] for entry in trainer.state.log_history if "taper/sink_attention" in entry]
    assert logged and all(value >= 0 for value in logged) and max(logged) > 0
    assert model.config._attn_implementation == "sdpa" and not model.config.output_attentions
    assert model.eval()(input_ids=data[0]["input_ids"][None]).attentions is None


def test_the_term_leaves_with_the_teacher_when_the_distillation_ends_at_the_taper_end():
    """distill_until="taper_end": once the gate reaches 0 the sink-attention term has no teacher, so the training
    forwards go back to the model's own attention implementation instead of one returning the sink's share."""
    batch = sink_first_batches()[0]
    model = build(tiny_llama_config(num_hidden_layers=4))
    model = patch_model(model, TaperNormConfig.for_model(model, distill_until="taper_end", taper_start=1, taper_end=3))
    controller = TaperController(model, total_steps=6)
    model.train()
    step = 0
    while controller.gate > 0.0 or step < 2:
        controller.step_begin(step)
        assert model.config._attn_implementation == (SINK_SHARE if controller.gate > 0.0 else "sdpa")
        output = model(input_ids=batch, labels=batch)
        assert (output.attentions is not None) == (controller.gate > 0.0)
        controller.step_end(step)
        step += 1
    controller.log_metrics()  # the window of the steps that still had the term
    controller.step_begin(step)
    model(input_ids=batch, labels=batch)
    controller.step_end(step)
    assert controller.gate == 0.0 and "taper/sink_attention" not in controller.log_metrics()


@pytest.mark.parametrize("sink_length", [1, 2])
def test_the_sink_share_attention_is_eager_attention_s_sink_columns_in_linear_memory(sink_length):
    """The training forwards' attention (sdpa, and sdpa on values marking the sink) gives the logits, the attention
    on each sink token and their gradients that eager attention gives, with GQA and a padded row."""
    torch.manual_seed(0)
    batch = random_batches(batch=2, length=12)[0]
    mask = torch.ones_like(batch)
    mask[1, -3:] = 0  # a row padded on the right, as the collator pads
    results = {}
    for implementation in ("eager", sink_share_attention(sink_length)):
        model = build(tiny_llama_config(num_hidden_layers=3)).train()  # GQA: 4 query heads, 2 key/value heads
        model.set_attn_implementation(implementation)
        output = model(input_ids=batch, attention_mask=mask, output_attentions=True)
        shares = sink_shares(output.attentions, sink_length)
        per_token = torch.stack([layer[..., :sink_length] for layer in output.attentions])
        (shares * mask[None, :, None, sink_length:]).sum().backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        results[implementation] = output.logits.detach(), per_token.detach(), grads
    (logits, per_token, grads), (logits_s, per_token_s, grads_s) = results.values()
    assert per_token_s.shape == per_token.shape == (3, 2, 4, 12, sink_length)
    torch.testing.assert_close(logits_s, logits, atol=1e-5, rtol=1e-5)
    valid = mask[None, :, None, :, None].bool().expand_as(per_token)  # padded queries attend to nothing real
    torch.testing.assert_close(per_token_s[valid], per_token[valid], atol=1e-6, rtol=1e-5)
    assert grads.keys() == grads_s.keys() and max(float(g.abs().max()) for n, g in grads.items() if "q_proj" in n) > 0
    for name in grads:
        torch.testing.assert_close(grads_s[name], grads[name], atol=1e-6, rtol=1e-4, msg=name)


@pytest.mark.parametrize(
    "case, overrides",
    [("gemma2", {}), ("gemma3_text", {"attn_logit_softcapping": 50.0})],  # no sdpa support; a soft-cap sdpa lacks
)
def test_models_sdpa_cannot_serve_report_their_sink_share_through_eager_attention(case, overrides):
    llama = build(tiny_llama_config())
    assert use_sink_share_attention(llama, 1) == "sdpa" and llama.config._attn_implementation == SINK_SHARE
    model = build(tiny_family_config(case, **overrides))
    before = model.config._attn_implementation
    assert use_sink_share_attention(model, 1) == before and model.config._attn_implementation == "eager"
    batch = sink_first_batches()[0]
    attentions = model.train()(input_ids=batch, output_attentions=True).attentions
    assert attentions[0].shape[-1] == batch.shape[1]  # eager's full weights, which sink_shares reads the same way
