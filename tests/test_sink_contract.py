"""The sink contract is enforced where data enters: a batch that does not start with the sink is refused at once."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from transformers import Trainer, TrainingArguments

from hf_tapernorm import ConfigurationError, TaperCallback, TaperController, TaperNormConfig, patch_model
from hf_tapernorm.evaluation.scores import heldout_loss
from hf_tapernorm.layers.taper_norm import tapered_norms
from tests.conftest import build, tiny_llama_config
from tests.helpers import word_tokenizer

SINK = [1]
FIX = (
    r"does not start with the sink token\(s\) \[1\] \(it starts \[\d+\]\); prepend them .*"
    r"pack_documents\(\.\.\., prefix_ids=\[1\]\).*TaperNormConfig\(sink_token_ids=\[\]\)"
)


def sink_model():
    return patch_model(build(tiny_llama_config()), TaperNormConfig.paper(sink_token_ids=SINK))


def batches(first_token: int, n: int = 16) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 128, (n, 10), generator=generator)
    ids[:, 0] = first_token
    return [{"input_ids": row, "labels": row} for row in ids]


def train(model, data, tmp_path, steps: int = 2):
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=steps,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
    )
    Trainer(model=model, args=args, train_dataset=data, callbacks=[TaperCallback(1, 2)]).train()


def test_trainer_with_taper_callback_refuses_the_first_batch_without_the_sink_and_trains_nothing(tmp_path):
    model = sink_model()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ConfigurationError, match=f"^training LlamaForCausalLM: a batch {FIX}"):
        train(model, batches(first_token=7), tmp_path)
    after = model.state_dict()
    assert all(torch.equal(before[key], after[key]) for key in before)  # no step, no statistic
    assert all(layer.pending is None for _, layer in tapered_norms(model))
    good = sink_model()
    train(good, batches(first_token=SINK[0]), tmp_path)  # the same data with the sink first trains
    assert any(not torch.equal(before[key], value) for key, value in good.state_dict().items())


def test_a_hand_written_loop_with_the_controller_is_refused_at_its_first_batch():
    model = sink_model().train()
    controller = TaperController(model, total_steps=40)
    controller.step_begin(0)
    bad = torch.stack([row["input_ids"] for row in batches(first_token=9, n=2)])
    with pytest.raises(ConfigurationError, match=FIX):
        model(input_ids=bad, labels=bad)
    assert all(layer.pending is None for _, layer in tapered_norms(model))
    good = bad.clone()
    good[:, 0] = SINK[0]
    model(input_ids=good, labels=good).loss.backward()  # sink-first passes
    with torch.no_grad():  # a chunk that continues a cache starts with text, not the sink: allowed
        cache = model(input_ids=good[:, :4], use_cache=True).cache
        model(input_ids=good[:, 4:], past_key_values=cache)
    model.eval()
    with torch.no_grad(), pytest.raises(ConfigurationError, match=FIX):
        model(input_ids=bad)  # eval mode too (test_eval_mode_text_without_the_sink_is_refused_...)


def test_heldout_loss_refuses_blocks_without_the_sink_before_evaluating():
    model = sink_model()
    blocks = torch.stack([row["input_ids"] for row in batches(first_token=4, n=3)])
    with pytest.raises(ConfigurationError, match=f"^heldout_loss: a batch {FIX}"):
        heldout_loss(model, blocks, prefix_length=1)
    blocks[:, 0] = SINK[0]
    assert heldout_loss(model, blocks, prefix_length=1)["tokens"] == 3 * 8


def test_patch_model_warns_once_when_the_tokenizer_does_not_add_the_sink():
    config = TaperNormConfig.paper(sink_token_ids=SINK)
    with pytest.warns(
        UserWarning, match=r"does not start its output with the sink token\(s\) \[1\] \(it starts \[9\]\)"
    ) as seen:
        patch_model(build(tiny_llama_config()), config, tokenizer=word_tokenizer(adds_bos=False))
    assert len([w for w in seen if "sink token" in str(w.message)]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        patch_model(build(tiny_llama_config()), config, tokenizer=word_tokenizer(adds_bos=True))


def test_a_left_padded_batch_is_refused_and_a_right_padded_one_reads_as_its_rows_alone():
    """A left-padded batch (pads, then sink + text) gave logits 0.046 away from the row alone: the first column, a
    pad, was kept normalized as the sink and the real sink tapered. Refused in one line; right padding is exact."""
    from tests.helpers import tapered

    model = tapered("llama", sink_token_ids=SINK).eval()
    generator = torch.Generator().manual_seed(0)
    row = torch.cat([torch.tensor([SINK]), torch.randint(3, 120, (1, 7), generator=generator)], dim=1)
    pads = torch.zeros(1, 3, dtype=torch.long)
    with torch.no_grad():
        alone = model(row).logits[0]
        for ids, mask in [
            (torch.cat([pads, row], 1), torch.tensor([[0] * 3 + [1] * 8])),
            (torch.cat([pads + SINK[0], row], 1), torch.tensor([[0] * 3 + [1] * 8])),  # pad id = the sink id
        ]:
            with pytest.raises(ConfigurationError, match=r"^LlamaForCausalLM: a left-padded batch .*export_folded"):
                model(ids, attention_mask=mask)
            with pytest.raises(ConfigurationError, match="left-padded"):
                model(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
            with pytest.raises(ConfigurationError, match="left-padded"):  # the mask by position, as forward takes it
                model(ids, mask)
        right = model(torch.cat([row, pads], 1), attention_mask=torch.tensor([[1] * 8 + [0] * 3])).logits[0, :8]
        cached = model(row[:, :4], attention_mask=torch.ones(1, 4, dtype=torch.long), use_cache=True)
        step = model(row[:, 4:], attention_mask=torch.ones(1, 8, dtype=torch.long), cache=cached.cache)
    assert (right - alone).abs().max().item() <= 1e-5
    assert (step.logits[0] - alone[4:]).abs().max().item() <= 1e-5  # a cached continuation is no fresh batch


def _row_and_left_padded():
    generator = torch.Generator().manual_seed(0)
    row = torch.cat([torch.tensor([SINK]), torch.randint(3, 120, (1, 7), generator=generator)], dim=1)
    return row, torch.cat([torch.zeros(1, 3, dtype=torch.long), row], 1)


def _masks_4d(allowed: torch.Tensor) -> dict[str, torch.Tensor]:
    """``allowed`` ([batch, 1, q, k] bool) in each form a 4D mask takes: boolean, additive float, integer 0/1."""
    return {
        "bool": allowed,
        "additive min": torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min),
        "additive -inf": torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf")),
        "int": allowed.long(),
    }


def test_a_left_padded_batch_given_as_a_4d_mask_is_refused_as_the_2d_one_is():
    """A 4D mask (boolean or additive float) of pads, then sink + text, gave logits 0.046 away from the row alone
    with no refusal: only 2D masks were read. A column is padding when the row's own query there is masked from it;
    a full causal 4D mask (no pads) reads as the row alone."""
    from tests.helpers import tapered

    model = tapered("llama", sink_token_ids=SINK).eval()
    row, padded = _row_and_left_padded()
    length = padded.shape[1]
    causal = torch.tril(torch.ones(length, length, dtype=torch.bool))
    left = causal & torch.tensor([[False] * 3 + [True] * 8])[:, None, None, :]
    with torch.no_grad():
        alone = model(row).logits[0]
        for form, mask in _masks_4d(left).items():
            with pytest.raises(ConfigurationError) as error:
                model(padded, attention_mask=mask)
            assert str(error.value).startswith(
                "LlamaForCausalLM: a left-padded batch (the 4D attention_mask masks the diagonal in the first 1 "
                "column(s))"
            ), form
            assert "\n" not in str(error.value) and "export_folded" in str(error.value)
        own = torch.tril(torch.ones(8, 8, dtype=torch.bool))[None, None]
        for form, mask in _masks_4d(own).items():
            if form != "int":  # sdpa itself takes no integer mask (bool or float): the refusal above is ours
                assert (model(row, attention_mask=mask).logits[0] - alone).abs().max().item() <= 1e-5, form


def test_a_left_padded_batch_whose_pads_are_the_sink_id_in_an_sdpa_style_4d_mask_is_refused():
    """Pads with the sink's id and a 4D mask in the form transformers' SDPA path makes (fully masked pad rows set
    back to all-attend, so no diagonal is masked) gave logits 0.046 away from the row alone with no refusal. A query
    that attends to a later column is a pad's (no causal real one does): refused as the other left-padded forms."""
    from tests.helpers import tapered

    model = tapered("llama", sink_token_ids=SINK).eval()
    row, padded = _row_and_left_padded()
    padded[:, :3] = SINK[0]
    length = padded.shape[1]
    allowed = torch.tril(torch.ones(length, length, dtype=torch.bool)) & torch.tensor([[False] * 3 + [True] * 8])
    allowed[:3, :] = True  # the pad rows unmasked, as transformers' _unmask_unattended leaves them
    with torch.no_grad():
        for form, mask in _masks_4d(allowed[None, None]).items():
            with pytest.raises(ConfigurationError) as error:
                model(padded, attention_mask=mask)
            message = str(error.value)
            assert message.startswith(
                "LlamaForCausalLM: a left-padded batch (the 4D attention_mask lets a pad row attend to later columns "
                "in the first 1 column(s))"
            ), form
            assert "\n" not in message and "export_folded" in message


def test_eval_mode_text_without_the_sink_is_refused_and_the_export_reads_it():
    """In eval mode, text without the sink (``tapered(text)``) gave logits 0.149 away from its own export's on the
    same text: the patched model kept the first text token normalized as the sink, while the export puts its
    stored sink in front. A fresh forward is refused in one line naming the fix; sink + text, a cached
    continuation and generation from a sink-first prompt run as before."""
    from hf_tapernorm import fold_model
    from tests.helpers import tapered

    model = tapered("llama", sink_token_ids=SINK).eval()
    row, _ = _row_and_left_padded()
    text = row[:, 1:]
    with torch.no_grad():
        for call in (
            lambda: model(text),
            lambda: model(input_ids=text),
            lambda: model.generate(text, max_new_tokens=2),
        ):
            with pytest.raises(ConfigurationError) as error:
                call()
            message = str(error.value)
            assert message.startswith(f"LlamaForCausalLM: a batch does not start with the sink token(s) {SINK}")
            assert "\n" not in message and message.endswith(
                "; the folded export (export_folded) reads text without the sink"
            )
        alone = model(row).logits[0]
        cached = model(row[:, :4], use_cache=True).cache
        step = model(row[:, 4:], cache=cached).logits[0]  # a continuation starts with text: allowed
        greedy = model.generate(row, max_new_tokens=4, do_sample=False)
        folded = fold_model(model)
        exported = folded(text).logits[0]
    assert (step - alone[4:]).abs().max().item() <= 1e-5
    assert (exported - alone[1:]).abs().max().item() <= 1e-4
    assert greedy.shape == (1, row.shape[1] + 4)


@pytest.mark.parametrize("training", [False, True])
def test_inputs_embeds_without_the_sinks_embedding_first_are_refused_as_input_ids_are(training):
    """``tapered(inputs_embeds=embed(text))`` on text without the sink gave logits 0.149 away from the export's on
    the same text, with no refusal: only ``input_ids`` were checked. A fresh forward given embeddings is refused in one
    line unless they start with the sink's embeddings; sink + text embedded reads exactly as its ids."""
    from tests.helpers import tapered

    model = tapered("llama", sink_token_ids=SINK).train(training)
    row, _ = _row_and_left_padded()
    embed = model.get_input_embeddings()
    with torch.no_grad():
        for embeds in (embed(row[:, 1:]), embed(row[:, 1:])[:, :0], torch.randn(1, 8, embed.embedding_dim)):
            with pytest.raises(ConfigurationError) as error:
                model(inputs_embeds=embeds)
            message = str(error.value)
            where = "training LlamaForCausalLM" if training else "LlamaForCausalLM"
            assert message.startswith(
                f"{where}: a batch does not start with the sink token(s) {SINK} (inputs_embeds do not start with "
                "their embeddings); prepend them"
            )
            assert "\n" not in message
        model.eval()
        assert torch.equal(model(inputs_embeds=embed(row)).logits, model(row).logits)
