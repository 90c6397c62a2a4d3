"""Loading an export or a tapered checkpoint: a loaded export computes the tapered model's logits (after a save, in
bf16, padded left or right, sampling and beam search); an export loaded as its plain base class (config.json's
``model_type`` edited, to load without remote code) or whose config lost layers is refused at load, as is a tapered
checkpoint loaded as a plain model (load_tapered reads it): as a plain Llama an export would drop its stored sink and
run its folded norms as norms of ones.

The refusal is raised on transformers' load report, which transformers logs while its warnings are on (its default;
TransformerLens turns them off for the whole process when imported, so the tests that need them set them)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as transformers_logging

from hf_tapernorm import export_folded, fold_model
from hf_tapernorm.errors import ConfigurationError
from tests.conftest import char_tokenizer
from tests.helpers import IDS, REPO, TEXT, error_of, relative_error, sink_tapered, tapered, with_sink

REFUSAL = (
    r"LlamaForCausalLM: '{folder}' is a folded export whose config.json names model_type 'llama' instead of "
    r"'tapernorm_llama'; loaded as a plain model it runs its folded norms as norms of ones and drops its stored "
    r"sink, so its logits are not the export's. Restore \"model_type\": \"tapernorm_llama\" and load it where "
    r"hf_tapernorm is imported, or with trust_remote_code=True"
)


@pytest.fixture
def warnings_on():
    """transformers' warnings at their default level (another test's import of TransformerLens turns them off)."""
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_warning()
    yield
    transformers_logging.set_verbosity(verbosity)


@pytest.fixture(scope="module")
def edited(tmp_path_factory):
    """A Llama sink export whose config.json names ``model_type: llama``."""
    folder = tmp_path_factory.mktemp("edited") / "export"
    export_folded(fold_model(tapered("llama", sink_token_ids=[5])), folder, tokenizer=char_tokenizer())
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "llama"}, indent=2))
    return folder


def test_automodel_refuses_an_export_edited_to_its_base_model_type(edited, warnings_on):
    with pytest.raises(OSError, match=REFUSAL.format(folder=edited)):
        AutoModelForCausalLM.from_pretrained(edited)


def test_the_refusal_needs_only_hf_tapernorm_imported(edited):
    """In a fresh interpreter that has made no export: importing hf_tapernorm is enough."""
    code = (
        "import hf_tapernorm\nfrom transformers import AutoModelForCausalLM\n"
        f"try:\n    AutoModelForCausalLM.from_pretrained({str(edited)!r})\n"
        "except OSError as error:\n    print(error)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert "is a folded export whose config.json names model_type 'llama'" in done.stdout, done.stderr[-2000:]


def test_load_export_refuses_it_when_transformers_reports_nothing(edited):
    """With transformers' warnings off there is no load report to refuse at; the integrations refuse the model."""
    from hf_tapernorm.integrations.exports import load_export

    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    try:
        model = AutoModelForCausalLM.from_pretrained(edited)
    finally:
        transformers_logging.set_verbosity(verbosity)
    with pytest.raises(ConfigurationError, match=REFUSAL.format(folder=edited)):
        load_export(model)


def test_eval_refuses_it_in_one_line(edited, workspace, warnings_on):
    data = ["--dataset_name", str(workspace / "corpus.txt"), "--block_size", "32", "--scan_windows", "0"]
    message = error_of(["eval", "--model_name_or_path", str(edited), *data])
    assert message.startswith("hf-tapernorm eval: error: ") and 'Restore "model_type": "tapernorm_llama"' in message


def test_eval_refuses_it_in_one_line_with_transformers_warnings_off(edited, workspace):
    """The CLI's own model loading names the cause whatever transformers' log level (TransformerLens, once imported,
    sets it to errors only for the whole process)."""
    data = ["--dataset_name", str(workspace / "corpus.txt"), "--block_size", "32", "--scan_windows", "0"]
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    try:
        message = error_of(["eval", "--model_name_or_path", str(edited), *data])
    finally:
        transformers_logging.set_verbosity(verbosity)
    assert message.startswith("hf-tapernorm eval: error: ") and 'Restore "model_type": "tapernorm_llama"' in message


# ============================================================================= what loads an export, and what does not
def test_an_export_whose_config_lost_layers_is_refused_naming_folder_and_field(tmp_path):
    folder = export_folded(fold_model(sink_tapered("llama")), tmp_path / "out")
    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        OSError, match=r"out: .*config.json's folded_norms names model\.layers\.1\..*num_hidden_layers=1"
    ):
        AutoModelForCausalLM.from_pretrained(folder)


@pytest.fixture(scope="module")
def sink_export(tmp_path_factory):
    """A Llama sink export, as export_folded writes it."""
    return export_folded(fold_model(sink_tapered("llama")), tmp_path_factory.mktemp("sink") / "out")


@pytest.mark.parametrize("edit", ["127", 127, "[127]", [127.0], None], ids=repr)
def test_an_export_whose_sink_token_ids_were_edited_is_refused_at_load(sink_export, tmp_path, edit):
    """A config.json whose sink_token_ids is no list of integer ids used to load, then fail at the first forward
    with a traceback from folded_input.py; the config now refuses it when it is read, in one line naming the field."""
    folder = tmp_path / "edited"
    shutil.copytree(sink_export, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "sink_token_ids": edit}))
    with pytest.raises(ValueError) as caught:
        AutoModelForCausalLM.from_pretrained(folder)
    assert str(caught.value) == (
        f"TaperNormLlamaConfig: config.json's sink_token_ids is {edit!r}, not a list of integer token ids; write them "
        "as a list such as [1], or restore the config.json the export wrote"
    )


#: Edits of a one-position sink export's sink_token_ids (vocabulary 128), each a list of ids, and the refusal's words.
SINK_EDITS = [
    ([1, 1], "name 2 token(s), but the stored sink (sink_cache_shape [2, 2, 1, 8]) holds 1 position(s)"),
    ([1, 5], "name 2 token(s), but the stored sink (sink_cache_shape [2, 2, 1, 8]) holds 1 position(s)"),
    ([128], "name 128, past the vocabulary of 128 tokens"),
    ([99999999999], "name 99999999999, past the vocabulary of 128 tokens"),
    ([5], "are not the sink [1] the stored sink was computed for (its tapernorm_config)"),  # fits count and vocab
]


@pytest.mark.parametrize("edit, words", SINK_EDITS, ids=repr)
def test_an_export_whose_sink_ids_do_not_fit_its_stored_sink_is_refused_at_load(sink_export, tmp_path, edit, words):
    """An export's config.json sink_token_ids edited from [1] to [1, 1] or [1, 5] loaded, then failed while
    scoring with a shape mismatch (the stored sink holds one position); [128] or [99999999999] (vocabulary 128)
    loaded and scored an id no token has as the sink. The config now refuses them when it is read."""
    folder = tmp_path / "edited"
    shutil.copytree(sink_export, folder)
    config = json.loads((folder / "config.json").read_text())
    assert config["sink_token_ids"] == [1] and config["vocab_size"] == 128
    (folder / "config.json").write_text(json.dumps({**config, "sink_token_ids": edit}))
    with pytest.raises(ValueError) as caught:
        AutoModelForCausalLM.from_pretrained(folder)
    assert str(caught.value) == (
        f"TaperNormLlamaConfig: config.json's sink_token_ids {edit} {words}; restore the config.json the export wrote"
    )


@pytest.mark.parametrize("edit", ["empty", "deleted"])
def test_an_export_whose_config_names_no_sink_ids_is_refused_for_its_config(sink_export, tmp_path, edit):
    """An export's config.json sink_token_ids edited to [] (or the key deleted) was refused for its weights
    ("unexpected_keys: sink_attentions ... re-export it"), though only config.json was edited. The config now
    refuses it when it is read, as the other sink edits are: the stored sink holds a position no id names."""
    folder = tmp_path / "edited"
    shutil.copytree(sink_export, folder)
    config = json.loads((folder / "config.json").read_text())
    if edit == "empty":
        config["sink_token_ids"] = []
    else:
        del config["sink_token_ids"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as caught:
        AutoModelForCausalLM.from_pretrained(folder)
    assert str(caught.value) == (
        "TaperNormLlamaConfig: config.json names no sink_token_ids, but the stored sink (sink_cache_shape "
        "[2, 2, 1, 8]) holds 1 position(s); restore the config.json the export wrote"
    )


def test_a_tapered_folder_cannot_be_loaded_as_a_plain_model_and_load_tapered_reads_it(tmp_path):
    from hf_tapernorm import load_tapered, save_tapered
    from hf_tapernorm.evaluation.models import read_model_config, resolve_model
    from tests.conftest import char_tokenizer

    model = sink_tapered("llama")
    folder = save_tapered(model, tmp_path / "tapered", char_tokenizer())
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "hf_tapernorm_tapered_llama" and "load_tapered" in config["hf_tapernorm_note"]
    with pytest.raises(ValueError, match="hf_tapernorm_tapered_llama"):  # not silently a LlamaForCausalLM
        AutoModelForCausalLM.from_pretrained(folder)
    reloaded = load_tapered(folder)
    assert type(reloaded).__name__ == "LlamaForCausalLM" and reloaded.config.model_type == "llama"
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=with_sink(TEXT)).logits, model(input_ids=with_sink(TEXT)).logits)
    source = resolve_model(str(folder))
    assert source.kind == "tapered" and read_model_config(source).num_hidden_layers == model.config.num_hidden_layers
    assert AutoTokenizer.from_pretrained(folder)("ab")["input_ids"] == [97, 98]


def test_load_tapered_takes_dtype_as_load_export_does(tmp_path):
    """load_tapered(dtype="bogus") and dtype="auto" were AttributeErrors (getattr(torch, ...)), dtype=torch.int64
    transformers' ValueError. It reads dtype through load_export's one check: a name or torch dtype, or "auto" (as
    stored, its default), anything else one ConfigurationError."""
    from hf_tapernorm import load_tapered, save_tapered

    folder = save_tapered(tapered("llama", dtype=torch.bfloat16), tmp_path / "tapered")
    for dtype, loaded in [("auto", torch.bfloat16), (None, torch.bfloat16), ("float32", torch.float32),
                          ("torch.float16", torch.float16), (torch.float32, torch.float32)]:  # fmt: skip
        assert load_tapered(folder, dtype=dtype).dtype == loaded, dtype
    for dtype in ("bogus", torch.int64, "int64"):
        with pytest.raises(ConfigurationError) as caught:
            load_tapered(folder, dtype=dtype)
        assert str(caught.value) == (
            f"dtype={dtype!r} is no dtype a tapered checkpoint loads in: give one of float32/fp32, float16/fp16, "
            "bfloat16/bf16, float64/fp64 (as text or a torch dtype: torch.bfloat16), or auto"
        )


@pytest.mark.parametrize("how", ["save_pretrained", "deepcopy", "pickle"])
def test_a_patched_models_own_save_pretrained_writes_a_tapered_checkpoint(tmp_path, how):
    """A plain ``model.save_pretrained`` of a patched model (not only save_tapered) is refused by AutoModel and read
    exactly by load_tapered; a deep copy (the distillation teacher is one) and a whole-module ``torch.save`` round
    trip save themselves, not the original."""
    import copy
    import io

    from hf_tapernorm import load_tapered

    original = sink_tapered("llama")
    model = original
    if how == "deepcopy":
        model = copy.deepcopy(original)
    elif how == "pickle":
        buffer = io.BytesIO()
        torch.save(original, buffer)
        model = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)  # our own object, in this test
    if how != "save_pretrained":
        with torch.no_grad():
            model.lm_head.weight.mul_(2.0)  # the copy computes another function than the original
    model.save_pretrained(tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["model_type"] == "hf_tapernorm_tapered_llama" and "load_tapered" in config["hf_tapernorm_note"]
    assert (tmp_path / "saved" / "tapernorm_config.json").is_file()
    with pytest.raises(ValueError, match="hf_tapernorm_tapered_llama"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    reloaded = load_tapered(tmp_path / "saved")
    with torch.no_grad():
        expected = model(input_ids=with_sink(TEXT)).logits
        assert torch.equal(reloaded(input_ids=with_sink(TEXT)).logits, expected)
        if how != "save_pretrained":
            assert not torch.allclose(expected, original(input_ids=with_sink(TEXT)).logits)
    model.save_pretrained(tmp_path / "saved")  # saved twice into one folder: marked once
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["model_type"] == "hf_tapernorm_tapered_llama"


# ============================================================================= a loaded export
@pytest.fixture(scope="module", params=["llama", "gpt2", "llama-sink"])
def export(request, tmp_path_factory):
    kind = request.param.split("-")[0]
    model = tapered(kind, sink_token_ids=[1] if request.param.endswith("sink") else None)
    folder = export_folded(fold_model(model), tmp_path_factory.mktemp("export") / "out", tokenizer=char_tokenizer())
    return model, folder, AutoModelForCausalLM.from_pretrained(folder).eval()


def _reference(model, ids: torch.Tensor) -> torch.Tensor:
    sink = list(model.tapernorm_config.sink_token_ids)
    with torch.no_grad():
        if not sink:
            return model(input_ids=ids).logits
        return model(input_ids=torch.cat([torch.tensor([sink] * len(ids)), ids], 1)).logits[:, len(sink) :]


def test_a_loaded_export_matches_the_tapered_model_and_survives_a_save(export, tmp_path):
    model, folder, folded = export
    with torch.no_grad():
        assert relative_error(folded(input_ids=IDS).logits, _reference(model, IDS)) <= 1e-5
        folded.save_pretrained(tmp_path / "again")
        again = AutoModelForCausalLM.from_pretrained(tmp_path / "again")
        assert torch.equal(again(input_ids=IDS).logits, folded(input_ids=IDS).logits)
    remote = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)  # with hf_tapernorm imported
    assert type(remote).__name__ == type(folded).__name__
    assert (
        AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)(input_ids=IDS).logits.dtype == torch.bfloat16
    )
    assert (export_folded(AutoModelForCausalLM.from_pretrained(folder), tmp_path / "re") / "config.json").is_file()


def test_a_loaded_export_pads_left_and_right_like_single_rows(export):
    _, _, folded = export
    ids = torch.randint(3, 100, (2, 8), generator=torch.Generator().manual_seed(5))
    left = ids.clone()
    left[0, :3] = 0
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    options = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    batched = folded.generate(input_ids=left, attention_mask=mask, **options)
    assert torch.equal(batched[0, -4:], folded.generate(input_ids=ids[:1, 3:], **options)[0, -4:])
    right = torch.ones_like(ids)
    right[1, 5:] = 0
    with torch.no_grad():
        padded = folded(input_ids=ids, attention_mask=right).logits[1, :5]
        assert relative_error(padded, folded(input_ids=ids[1:, :5]).logits[0]) <= 1e-5


def test_a_loaded_export_samples_and_beam_searches(export):
    _, _, folded = export
    prompt = torch.randint(3, 100, (1, 5), generator=torch.Generator().manual_seed(2))
    torch.manual_seed(0)
    sampled = folded.generate(prompt, do_sample=True, temperature=0.7, top_k=5, max_new_tokens=3)
    beams = folded.generate(prompt, num_beams=2, max_new_tokens=3, do_sample=False)
    assert sampled.shape == beams.shape == (1, 8) and torch.equal(sampled[:, :5], prompt)


def test_a_loaded_export_beam_searches_without_a_cache_as_the_tapered_model_does(export):
    """With a stored sink, ``generate(num_beams=2, use_cache=False)`` raised transformers' "cannot use beam search
    with a cache currently, as the cache cannot be reordered": the export's forward returned its output with a
    ``cache`` entry of None, which generate handed on to the next step and beam search tried to reorder. A forward
    without a cache now returns no cache entry at all, as the base model's does, and beam search without a cache
    picks the tapered model's tokens (the sink in front of its input)."""
    model, _, folded = export
    prompt = torch.randint(3, 100, (1, 7), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        assert "cache" not in folded(input_ids=prompt, use_cache=False)
    options = dict(min_new_tokens=4, max_new_tokens=4, num_beams=2, do_sample=False, use_cache=False)
    beams = folded.generate(prompt, **options)
    sink = torch.tensor([list(model.tapernorm_config.sink_token_ids)], dtype=torch.long)
    expected = model.generate(torch.cat([sink, prompt], 1), **options)[:, sink.shape[1] :]
    assert beams.shape == (1, 11) and torch.equal(beams, expected)


@pytest.mark.parametrize("head", ["AutoModel", "AutoModelForSequenceClassification"])
def test_other_auto_classes_refuse_an_export_in_one_line(export, head):
    """``AutoModel`` / ``AutoModelForSequenceClassification.from_pretrained(export)`` gave transformers'
    "Unrecognized configuration class ... for this kind of AutoModel" and a list of every type it knows. An export
    has no other head nor a bare base model (its folded norms and stored sink live in the causal LM), so each now
    refuses in one line naming the way that works; from_config too."""
    import transformers

    from hf_tapernorm.errors import UnsupportedModelError

    _, folder, folded = export
    auto = getattr(transformers, head)
    model_type = folded.config.model_type
    expected = (
        f"{head}: '{folder}' is a folded export ({model_type}), which loads as a causal LM only: use "
        f"AutoModelForCausalLM.from_pretrained('{folder}'), and for its hidden states call it with "
        "output_hidden_states=True"
    )
    with pytest.raises(UnsupportedModelError) as refused:
        auto.from_pretrained(folder)
    assert str(refused.value) == expected
    with pytest.raises(UnsupportedModelError, match=f"^{head}: '.*' is a folded export \\({model_type}\\), which"):
        auto.from_config(folded.config)


_PAST_THE_TABLE = """
import sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
try:
    model(input_ids=torch.ones(1, 65, dtype=torch.long))
except ValueError as error:
    print(type(model).__module__, "hf_tapernorm" in sys.modules, error)
"""


def test_an_export_without_a_sink_refuses_a_call_past_its_learned_positions_in_one_line(tmp_path):
    """A sinkless GPT-2 export (64 learned positions here) failed past its table with torch.embedding's bare
    "IndexError: index out of range in self", on a long input, a continued cache and generate; a sink export and
    OnnxCausalLM said it in one line. Now it refuses alike, and the copy of the code in the export says so too."""
    folder = export_folded(fold_model(tapered("gpt2")), tmp_path / "out", tokenizer=char_tokenizer())
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    said = "TaperNormGPT2LMHeadModel: this model has 64 learned positions; this call reaches {}: shorten the input or "
    said += "crop the cache"
    ids = torch.randint(3, 100, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert model(input_ids=ids).logits.shape == (1, 64, 128)  # the whole table is still read
        with pytest.raises(ValueError) as error:
            model(input_ids=torch.cat([ids, ids[:, :1]], 1))
        assert str(error.value) == said.format(65)
        cache = model(input_ids=ids[:, :40], use_cache=True).past_key_values
        with pytest.raises(ValueError) as error:
            model(input_ids=ids[:, :30], past_key_values=cache)
        assert str(error.value) == said.format(70)
        with pytest.raises(ValueError) as error:
            model.generate(ids[:, :60], max_new_tokens=8, do_sample=False)
        assert str(error.value) == said.format(65)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "HF_"))}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-I", "-c", _PAST_THE_TABLE, str(folder)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.stdout.strip().endswith("False " + said.format(65)), done.stdout + done.stderr[-2000:]
    assert done.stdout.startswith("transformers_modules."), done.stdout  # the export's own copy of the code
    assert fold_model(tapered("llama")).position_table_size == 0  # RoPE: no table, nothing checked


_BY_POSITIONS = """
import sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
ids = torch.randint(3, 100, (2, 66), generator=torch.Generator().manual_seed(0))
mask = torch.ones_like(ids)
mask[:, :5] = 0
def run(name, call):
    try:
        print(name, "ran", list(call().shape))
    except Exception as error:
        print(name, type(error).__name__, error)
def generate(new):
    return model.generate(ids[:, :62], attention_mask=mask[:, :62], max_new_tokens=new, do_sample=False, pad_token_id=0)
with torch.no_grad():
    run("generate", lambda: generate(8))
    run("generate+1", lambda: generate(9))
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    run("padded", lambda: model(input_ids=ids, attention_mask=mask, position_ids=positions).logits)
    run("past", lambda: model(input_ids=ids[:, :10], position_ids=torch.arange(60, 70)[None]).logits)
print(type(model).__module__, "hf_tapernorm" in sys.modules)
"""


def test_an_export_without_a_sink_counts_the_positions_a_call_uses_against_its_table(tmp_path):
    """The sinkless export's check counted the cache and the padded input, not the positions the call uses: a
    left-padded generate whose positions fit its 64 (transformers passes position_ids from the mask) and a 66-column
    left-padded forward with position_ids up to 60 were refused, and position_ids 60..69 on 10 tokens passed the check
    and failed with IndexError. Now a call reaches one past its largest position_id (cache + input without them):
    what fits runs, as stock GPT-2 runs it, and what does not is refused in one line, in the export's own copy too."""
    folder = export_folded(fold_model(tapered("gpt2")), tmp_path / "out", tokenizer=char_tokenizer())
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    ids = torch.randint(3, 100, (2, 62), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[:, :5] = 0
    with torch.no_grad():
        padded = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
        alone = model.generate(ids[:, 5:], max_new_tokens=8, do_sample=False)
    assert torch.equal(padded[:, 62:], alone[:, 57:])  # each row reads positions 0..63, as without its pads
    said = "TaperNormGPT2LMHeadModel: this model has 64 learned positions; this call reaches {}: shorten the input or "
    said += "crop the cache"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "HF_"))}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-I", "-c", _BY_POSITIONS, str(folder)], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    lines = done.stdout.strip().splitlines()
    assert lines[:-1] == [
        "generate ran [2, 70]",
        "generate+1 ValueError " + said.format(65),
        "padded ran [2, 66, 128]",
        "past ValueError " + said.format(70),
    ], done.stdout + done.stderr[-2000:]
    assert lines[-1].startswith("transformers_modules.") and lines[-1].endswith(" False")  # the export's own code
