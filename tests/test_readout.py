"""An export's readout: affine (the logits a linear map of the residual stream plus a constant) once the final norm
is folded, not through a kept final norm; what eval and the model card say of it."""

import json

import pytest
import torch

from hf_tapernorm import TaperNormConfig, export_folded, fold_model, patch_model, save_tapered
from hf_tapernorm.cli.main import main
from hf_tapernorm.export import readout_additivity_error, readout_summary
from hf_tapernorm.layers import set_gate
from hf_tapernorm.training import calibrate
from tests.conftest import build, char_tokenizer, corpus_documents, random_batches, tiny_llama_config
from tests.helpers import tapered


def _folded(scope: str):
    torch.manual_seed(0)
    model = patch_model(build(tiny_llama_config()), TaperNormConfig.paper(scope=scope))
    model.train()
    for batch in random_batches(model.config.vocab_size, n=4):
        model(input_ids=batch)
    calibrate(model)
    set_gate(model, 0.0)
    model.eval()
    return model, fold_model(model)


def test_folding_the_final_norm_makes_the_readout_affine_and_keeping_it_does_not():
    ids = torch.randint(0, 128, (2, 16))
    _, with_final = _folded("all")
    _, internal = _folded("internal")
    assert readout_summary(with_final.config)["affine"] is True
    assert readout_summary(with_final.config)["final_norm"] == "folded into lm_head"
    assert readout_summary(internal.config)["affine"] is False
    assert readout_additivity_error(with_final, ids) < 1e-5
    assert readout_additivity_error(internal, ids) > 1e-2  # a real norm: parts do not add up


def test_the_parts_of_the_stream_add_up_to_the_logit_on_an_affine_export():
    """Direct effects of a split of the residual stream plus the readout's constant equal the logit (1e-5)."""
    _, folded = _folded("all")
    ids = torch.randint(0, 128, (1, 12))
    captured = []
    norm = folded.get_submodule(folded.config.final_norm)
    handle = norm.register_forward_pre_hook(lambda module, args: captured.append(args[0]))
    logits = folded(input_ids=ids).logits
    handle.remove()
    stream = captured[0]
    head = folded.get_output_embeddings()
    constant = head(norm(torch.zeros_like(stream)))
    direct = []  # the direct effect of each of four disjoint channel groups of the stream
    for index, chunk in enumerate(torch.chunk(stream, 4, dim=-1)):
        part = torch.zeros_like(stream)
        width = chunk.shape[-1]
        part[..., index * width : (index + 1) * width] = chunk
        direct.append(head(norm(part)) - constant)
    total = torch.stack(direct).sum(0) + constant
    assert torch.allclose(total, logits, atol=1e-5 * logits.abs().max().item())


@pytest.mark.parametrize("scope", ["all", "internal"])
def test_eval_and_the_model_card_say_whether_the_readout_is_affine(tmp_path, capsys, scope):
    _, folded = _folded(scope)
    export_folded(folded, tmp_path / "export", tokenizer=char_tokenizer())
    text_file = tmp_path / "corpus.txt"
    text_file.write_text("\n\n".join(corpus_documents()))
    card = (tmp_path / "export" / "README.md").read_text()
    affine = scope == "all"
    assert ("| Readout | affine" in card) is affine
    code = main(
        ["eval", "--model_name_or_path", str(tmp_path / "export"), "--dataset_name", str(text_file),
         "--block_size", "16", "--heldout_blocks", "2", "--heldout_percentage", "20", "--scan_windows", "0",
         "--out_of_corpus_blocks", "0", "--data_cache_dir", str(tmp_path / "cache")]
    )  # fmt: skip
    assert code == 0
    result = json.loads(capsys.readouterr().out.splitlines()[0])
    assert result["readout"]["affine"] is affine
    assert (result["readout"]["additivity_error"] < 1e-3) is affine
    assert result["readout"]["folded_norms"] == len(folded.config.folded_norms)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_readout_of_a_folded_final_norm_is_affine_in_every_dtype(dtype):
    """bf16/fp16 weights: the readout is measured in float32, so its rounding is not taken for a real norm."""
    _, with_final = _folded("all")
    _, internal = _folded("internal")
    ids = torch.randint(0, 128, (1, 32), generator=torch.Generator().manual_seed(1))
    assert readout_additivity_error(with_final.to(dtype), ids) < 1e-5
    assert readout_additivity_error(internal.to(dtype), ids) > 1e-2
    assert next(with_final.parameters()).dtype == dtype  # the model is left in its dtype


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_tapered_model_with_a_sink_and_its_fold_agree_that_the_readout_is_affine(kind):
    """A sink-first input: the tapered model keeps the sink normalized (the export stores its logits), so the readout
    is measured over the text positions, where both are affine; with the final norm kept, neither is."""
    ids = torch.cat(
        [torch.full((1, 1), 1), torch.randint(3, 120, (1, 24), generator=torch.Generator().manual_seed(2))], 1
    )
    for scope, affine in (("all", True), ("internal", False)):
        model = tapered(kind, scope=scope, sink_token_ids=[1]).eval()
        folded = fold_model(model)
        errors = [readout_additivity_error(m, ids) for m in (model, folded)]
        assert all((error < 1e-5) is affine and (error > 1e-2) is not affine for error in errors), errors


def test_eval_of_a_tapered_sink_checkpoint_in_bf16_says_its_readout_is_affine(tmp_path, capsys):
    """The end to end case: eval --dtype bfloat16 of a --scope all tapered checkpoint with a sink."""
    model = tapered("llama", scope="all", sink_token_ids=[1])
    save_tapered(model, tmp_path / "tapered", char_tokenizer())
    text_file = tmp_path / "corpus.txt"
    text_file.write_text("\n\n".join(corpus_documents()))
    code = main(
        ["eval", "--model_name_or_path", str(tmp_path / "tapered"), "--dataset_name", str(text_file),
         "--block_size", "16", "--heldout_blocks", "2", "--heldout_percentage", "20", "--scan_windows", "0",
         "--out_of_corpus_blocks", "0", "--data_cache_dir", str(tmp_path / "cache"), "--dtype", "bfloat16"]
    )  # fmt: skip
    assert code == 0
    result = json.loads(capsys.readouterr().out.splitlines()[0])
    assert result["sink_token_ids"] == [1]
    assert result["readout"]["affine"] is True
    assert result["readout"]["additivity_error"] < 1e-5


def test_the_readout_check_reads_through_opts_project_out():
    """An OPT whose project_out narrows the last hidden state (facebook/opt-350m's shape) ended eval in a traceback
    (mat1 and mat2 shapes cannot be multiplied): the readout check applied the final norm and the head without the
    projection between them. It reads through it now: a real final norm is not affine, a folded one is."""
    from tests.conftest import tiny_family_config

    ids = torch.randint(0, 128, (2, 16))
    original = build(tiny_family_config("opt-project_out")).eval()
    assert readout_additivity_error(original, ids) > 1e-2
    patched = patch_model(build(tiny_family_config("opt-project_out")), TaperNormConfig.paper(scope="all")).train()
    for batch in random_batches(128, n=4):
        patched(input_ids=batch)
    calibrate(patched)
    set_gate(patched, 0.0)
    assert readout_additivity_error(fold_model(patched.eval()), ids) < 1e-5
