"""The integrations on tiny random exports: TransformerLens, nnsight and ONNX Runtime give the export's logits.

Two exports: GPT-2 from the paper preset over every norm (``TaperNormConfig.paper(scope="all")``: no norm
left, the final one folded into an untied head), and Llama (a gated MLP) with the internal norms folded and
a sink token stored as its cache prefix. Each test of a tool skips when its extra is absent; the errors
without them are tested by hiding the packages.
"""

from __future__ import annotations

import configparser
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from hf_tapernorm import export_folded, fold_model
from hf_tapernorm.errors import ConfigurationError
from hf_tapernorm.integrations.extras import MissingExtraError
from tests.conftest import char_tokenizer, random_batches
from tests.helpers import sink_tapered, tapered

REPO = Path(__file__).resolve().parent.parent
SINK = [5]
IDS = random_batches(n=1, batch=2, length=10, seed=3)[0]
KINDS = ["gpt2-all", "llama-sink"]


def make_export(kind: str, folder: Path) -> Path:
    """A tiny folded export (see the module docstring), saved with the character tokenizer."""
    if kind == "gpt2-all":
        model = tapered("gpt2", scope="all")
    else:
        model = tapered("llama", sink_token_ids=SINK)
    export_folded(fold_model(model), folder)
    char_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("exports")
    return {kind: make_export(kind, root / kind) for kind in KINDS}


def export_logits(folder: Path, ids: torch.Tensor = IDS) -> torch.Tensor:
    """The export's own logits of ``ids`` (text without the sink), eager attention as the bridge runs it."""
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


# ----------------------------------------------------------------------------- the extras
def test_a_plain_install_pulls_no_integration_and_each_extra_names_its_packages():
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    required = config["options"]["install_requires"]
    extras = config["options.extras_require"]
    for package in ("transformer-lens", "nnsight", "onnx", "onnxruntime", "onnxscript"):
        assert package not in required
    assert {"transformer-lens", "nnsight"} <= {
        line.split(">")[0].split("=")[0] for line in extras["interpretability"].split()
    }
    assert {"onnx", "onnxruntime", "onnxscript"} <= {
        line.split(">")[0].split("=")[0] for line in extras["onnx"].split()
    }


def _call(function: str, folder: Path):
    module, _, name = function.rpartition(".")
    target = getattr(importlib.import_module(module), name)
    return target(folder, folder.parent / "onnx") if name == "export_onnx" else target(folder)


@pytest.mark.parametrize("hidden, function, extra", [
    ("transformer_lens", "hf_tapernorm.integrations.tl_bridge.transformer_bridge", "interpretability"),
    ("nnsight", "hf_tapernorm.integrations.nnsight_tracing.nnsight_model", "interpretability"),
    ("onnx", "hf_tapernorm.integrations.onnx_runtime.export_onnx", "onnx"),
    ("onnxscript", "hf_tapernorm.integrations.onnx_runtime.export_onnx", "onnx"),
    ("onnxruntime", "hf_tapernorm.integrations.onnx_runtime.OnnxCausalLM", "onnx"),
])  # fmt: skip
def test_a_missing_extra_is_one_line_naming_it(monkeypatch, tmp_path, hidden, function, extra):
    for name in [n for n in sys.modules if n == hidden or n.startswith(hidden + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, hidden, None)  # `import hidden` now fails as if it were not installed
    with pytest.raises(MissingExtraError) as error:
        _call(function, tmp_path / "export")
    message = str(error.value)
    assert "\n" not in message and f"needs {hidden}, which is not installed" in message
    assert f"pip install 'hf-tapernorm[{extra}]'" in message
    assert isinstance(error.value, ImportError)


def test_an_ordinary_model_is_refused_as_an_export(tmp_path):
    from hf_tapernorm.integrations.exports import load_export
    from tests.conftest import save_tiny_model

    with pytest.raises(ConfigurationError, match="no config.json"):
        load_export(tmp_path)
    with pytest.raises(ConfigurationError, match="LlamaForCausalLM is not a folded export"):
        load_export(save_tiny_model(tmp_path / "plain"))


# ----------------------------------------------------------------------------- TransformerLens
@pytest.mark.parametrize("kind", KINDS)
def test_transformer_bridge_gives_the_exports_logits_with_its_sink(exports, kind):
    pytest.importorskip("transformer_lens")
    from hf_tapernorm.integrations.tl_bridge import transformer_bridge

    bridge = transformer_bridge(exports[kind], tokenizer=char_tokenizer())
    expected = export_logits(exports[kind])
    with torch.no_grad():
        logits = bridge(IDS)
    assert (logits - expected).abs().max().item() <= 1e-4
    logits, cache = bridge.run_with_cache(IDS)
    assert (logits - expected).abs().max().item() <= 1e-4
    sink = len(SINK) if kind == "llama-sink" else 0
    # Every query attends to the stored sink column(s) and then the text: the sink is in place.
    pattern = cache["blocks.0.attn.hook_pattern"]
    assert pattern.shape[-2:] == (IDS.shape[1], IDS.shape[1] + sink)
    assert torch.allclose(pattern.sum(-1), torch.ones(()), atol=1e-5)
    # A folded norm is the identity: its scale reads 1 and its output is its input.
    assert torch.equal(cache["blocks.1.ln1.hook_scale"], torch.ones_like(cache["blocks.1.ln1.hook_scale"]))
    assert torch.equal(cache["blocks.1.ln1.hook_out"], cache["blocks.1.hook_resid_pre"])


@pytest.mark.parametrize("kind", KINDS)
def test_transformer_lens_dla_and_logit_lens_run_on_the_export_in_compatibility_mode(exports, kind):
    """TransformerLens's own tools need compatibility mode; its weight processing keeps the export's
    log-probabilities and sink, the attributions add up to the logit, and where the final norm is folded
    (gpt2-all) each component's attribution is its direct effect: the readout is affine."""
    pytest.importorskip("transformer_lens")
    from transformer_lens.tools.analysis import direct_logit_attribution
    from transformer_lens.tools.analysis.logit_lens import logit_lens

    from hf_tapernorm.integrations.tl_bridge import transformer_bridge

    bridge = transformer_bridge(exports[kind], tokenizer=char_tokenizer())
    bridge.enable_compatibility_mode(disable_warnings=True)
    ids = IDS[:1]
    expected = export_logits(exports[kind], ids).log_softmax(-1)
    with torch.no_grad():
        logits, cache = bridge.run_with_cache(ids)
        assert (logits.log_softmax(-1) - expected).abs().max().item() <= 1e-5
        answers = torch.cat([ids[:, 1:], ids[:, -1:]], 1)
        attribution = direct_logit_attribution(bridge, answer_tokens=answers, pos=None, cache=cache).attribution
        lens = logit_lens(bridge, ids, positions=None, return_type="logits")  # refuses a lens that misses the output
        assert lens is not None
        logit = logits[0].gather(-1, answers[0, :, None])[:, 0]
        bias = bridge.unembed.b_U[answers[0]]  # the head's bias: no component's (TransformerLens's own note)
        assert (attribution[:, 0].sum(0) + bias - logit).abs().max().item() <= 1e-4
        parts = cache.decompose_resid(layer=None, mode="all")[:, 0]
        stream = cache["ln_final.hook_in"][0]

        def readout(x: torch.Tensor) -> torch.Tensor:
            return bridge.unembed(bridge.ln_final(x[None]))[0].gather(-1, answers[0, :, None])[:, 0]

        effects = torch.stack([readout(stream) - readout(stream - part) for part in parts])
    gap = (effects - attribution[:, 0]).abs().max().item()
    if kind == "gpt2-all":
        assert gap <= 1e-4
    else:  # the final norm kept: the frozen-scale attribution is not what removing a component does
        assert gap > 1e-3


# ----------------------------------------------------------------------------- nnsight
@pytest.mark.parametrize("kind", KINDS)
def test_nnsight_traces_and_intervenes_on_the_export(exports, kind):
    pytest.importorskip("nnsight")
    from hf_tapernorm.integrations.nnsight_tracing import nnsight_model

    wrapped = nnsight_model(exports[kind])
    plain = AutoModelForCausalLM.from_pretrained(exports[kind]).eval()
    blocks = (lambda m: m.transformer.h) if kind.startswith("gpt2") else (lambda m: m.model.layers)
    with torch.no_grad():
        expected = plain(input_ids=IDS).logits
    with wrapped.trace(input_ids=IDS):
        hidden = blocks(wrapped)[0].output.save()
        logits = wrapped.output.logits.save()
    assert (logits - expected).abs().max().item() <= 1e-4
    assert hidden.shape[:2] == IDS.shape  # the text's positions only: the sink is a cache prefix
    # An intervention (block 1's MLP output zeroed) equals the same edit made with a torch hook.
    with wrapped.trace(input_ids=IDS):
        blocks(wrapped)[1].mlp.output[:] = 0
        edited = wrapped.output.logits.save()
    handle = blocks(plain)[1].mlp.register_forward_hook(lambda module, args, output: torch.zeros_like(output))
    with torch.no_grad():
        reference = plain(input_ids=IDS).logits
    handle.remove()
    assert (edited - reference).abs().max().item() <= 1e-5
    assert (edited - expected).abs().max().item() > 1e-3


# ----------------------------------------------------------------------------- ONNX Runtime
@pytest.fixture(scope="module")
def onnx_graphs(exports, tmp_path_factory) -> dict[str, Path]:
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from hf_tapernorm.integrations.onnx_runtime import export_onnx

    root = tmp_path_factory.mktemp("onnx")
    return {kind: export_onnx(folder, root / kind) for kind, folder in exports.items()}


@pytest.mark.parametrize("kind", KINDS)
def test_onnx_runtime_gives_the_exports_logits_and_greedy_tokens(exports, onnx_graphs, kind):
    from hf_tapernorm.integrations.onnx_runtime import OnnxCausalLM, node_counts

    runtime = OnnxCausalLM(onnx_graphs[kind], threads=1)
    model = AutoModelForCausalLM.from_pretrained(exports[kind]).eval()
    with torch.no_grad():
        expected = model(input_ids=IDS).logits
        greedy = model.generate(IDS, max_new_tokens=32, do_sample=False)
    logits, state = runtime.forward(IDS.numpy())
    assert abs(logits - expected.numpy()).max() <= 1e-4
    assert (onnx_graphs[kind] / "sink.npz").is_file() == (kind == "llama-sink")
    # The cache continues: the last 4 tokens fed after the first 6 give the same logits.
    first, state = runtime.forward(IDS[:, :6].numpy())
    rest, _ = runtime.forward(IDS[:, 6:].numpy(), state)
    assert abs(rest - expected[:, 6:].numpy()).max() <= 1e-4
    assert (runtime.generate(IDS.numpy(), 32) == greedy.numpy()).all()
    counts = node_counts(onnx_graphs[kind])
    assert counts["onnx_nodes"] > 0 and counts["ort_nodes"] > 0


def test_onnx_export_refuses_a_used_folder(exports, tmp_path):
    pytest.importorskip("onnxscript")
    from hf_tapernorm.integrations.onnx_runtime import OnnxCausalLM, export_onnx

    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigurationError, match="exists and is not an empty folder"):
        export_onnx(exports["llama-sink"], tmp_path / "taken")
    pytest.importorskip("onnxruntime")
    with pytest.raises(ConfigurationError, match="holds no model.onnx"):
        OnnxCausalLM(tmp_path / "taken")


def test_onnx_export_into_a_symbolic_link_loop_is_refused_naming_the_loop(tmp_path):
    """``export_onnx(export, "lp/loop/x")`` with ``lp/loop`` a link to itself said "OSError: [Errno 40] Too many
    levels of symbolic links ...; free space (or choose another folder)". Refused before anything is read, naming
    the loop as the CLI commands do."""
    from hf_tapernorm.integrations.onnx_runtime import export_onnx

    (tmp_path / "lp").mkdir()
    (tmp_path / "lp" / "loop").symlink_to("loop")
    with pytest.raises(ConfigurationError) as error:
        export_onnx(tmp_path / "no-export", tmp_path / "lp" / "loop" / "x")
    assert str(error.value) == (
        f"cannot export ONNX into '{tmp_path}/lp/loop/x': the symbolic link '{tmp_path}/lp/loop' on the way leads "
        "back into itself (a loop); fix or remove it"
    )
    assert sorted(p.name for p in (tmp_path / "lp").iterdir()) == ["loop"]


def test_onnx_export_into_a_long_but_valid_name_is_written(exports, tmp_path):
    """``export_onnx(export, "t/<250 x c>")``: a valid name whose ``.NAME.partial-PID`` was too long failed after
    loading, blaming free space. Its temporary names are cut to fit: the graph is written."""
    pytest.importorskip("onnxscript")
    from hf_tapernorm.integrations.onnx_runtime import GRAPH_NAME, LAYOUT_NAME, export_onnx

    folder = export_onnx(exports["llama-sink"], tmp_path / ("c" * 250))
    assert {GRAPH_NAME, LAYOUT_NAME, "sink.npz"} <= {p.name for p in folder.iterdir()}
    assert sorted(p.name for p in tmp_path.iterdir()) == [folder.name]


def test_onnx_export_into_a_name_no_file_may_have_is_one_line_before_loading(tmp_path):
    """A name of 256 bytes (over NAME_MAX) was an OSError traceback from the lock check; one line naming the name
    and the limit, before anything is read (the source does not even exist)."""
    from hf_tapernorm.app.folder_writes import name_max
    from hf_tapernorm.integrations.onnx_runtime import export_onnx

    limit = name_max(tmp_path)
    with pytest.raises(ConfigurationError) as error:
        export_onnx(tmp_path / "no-export", tmp_path / ("c" * (limit + 1)))
    assert str(error.value) == (
        f"cannot export ONNX into '{tmp_path / ('c' * (limit + 1))}': the name '{'c' * 40}...' is {limit + 1} bytes "
        f"long, over the {limit} its filesystem takes; choose a shorter name"
    )
    assert list(tmp_path.iterdir()) == []


def test_onnx_export_keeps_a_user_s_folder_named_like_its_leftover(exports, tmp_path):
    """A user's ``.onx.old-N/thesis.tex`` (no process N) beside ``export_onnx(..., "t/onx")`` was deleted as an
    abandoned leftover; only a temporary folder an export made is."""
    pytest.importorskip("onnxscript")
    from hf_tapernorm.integrations.onnx_runtime import GRAPH_NAME, export_onnx

    for name in (f".onx.old-{2**22 + 54321}", f".onx.partial-{2**22 + 54322}"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "thesis.tex").write_text("my thesis")
    assert (export_onnx(exports["llama-sink"], tmp_path / "onx") / GRAPH_NAME).is_file()
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("thesis.tex")) == [
        f".onx.old-{2**22 + 54321}/thesis.tex",
        f".onx.partial-{2**22 + 54322}/thesis.tex",
    ]
    assert (tmp_path / f".onx.old-{2**22 + 54321}" / "thesis.tex").read_text() == "my thesis"


@pytest.mark.slow
def test_smollm2_export_reads_the_same_in_transformer_lens_nnsight_and_onnx_runtime(tmp_path):
    """SmolLM2-135M cut to 4 layers (untrained at g = 0 the full model is not finite), every internal norm patched
    with the BOS sink, the gate set to 0 by hand, folded and exported: the three tools give the export's logits."""
    pytest.importorskip("transformer_lens")
    pytest.importorskip("nnsight")
    pytest.importorskip("onnxruntime")
    from hf_tapernorm.integrations.nnsight_tracing import nnsight_model
    from hf_tapernorm.integrations.onnx_runtime import OnnxCausalLM, export_onnx
    from hf_tapernorm.integrations.tl_bridge import transformer_bridge
    from tests.conftest import smollm2_sink_model

    model, tokenizer, tokens, bos = smollm2_sink_model()
    folder = export_folded(fold_model(model, probe=tokens[None, 800:864]), tmp_path / "export")
    tokenizer.save_pretrained(folder)
    ids = tokens[None, 1000:1032]
    expected = export_logits(folder, ids)
    with torch.no_grad():
        lens = transformer_bridge(folder, tokenizer=tokenizer)(ids)
    wrapped = nnsight_model(folder)
    with wrapped.trace(input_ids=ids):
        traced = wrapped.output.logits.save()
    runtime = OnnxCausalLM(export_onnx(folder, tmp_path / "onnx"))
    onnx_logits, _ = runtime.forward(ids.numpy())
    differences = {
        "transformer_lens": (lens - expected).abs().max().item(),
        "nnsight": (traced - expected).abs().max().item(),
        "onnxruntime": float(abs(onnx_logits - expected.numpy()).max()),
    }
    print(f"\nSmolLM2-135M 4 layers, BOS sink (fp32): max abs logit difference to the export {differences}")
    assert all(value <= 1e-4 for value in differences.values()), differences
    plain = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        greedy = plain.generate(ids, max_new_tokens=32, do_sample=False)
    assert (runtime.generate(ids.numpy(), 32) == greedy.numpy()).all()


# ----------------------------------------------------------------------------- the export's input contract
EOS = 127  # the character tokenizer's <eos>: GPT-2's sink


@pytest.fixture(scope="module")
def gpt2_sink(tmp_path_factory):
    """A GPT-2 export with its EOS sink stored (a learned position table of 64), and the tapered model it folds."""
    model = tapered("gpt2", sink_token_ids=[EOS]).eval()
    folder = export_folded(fold_model(model), tmp_path_factory.mktemp("gpt2-sink") / "export")
    char_tokenizer().save_pretrained(folder)
    return folder, model


def left_padded(texts: list[str], sink_first: bool = False) -> dict[str, torch.Tensor]:
    tokenizer = char_tokenizer()
    tokenizer.pad_token, tokenizer.padding_side = "<unk>", "left"
    return dict(tokenizer([("<eos>" if sink_first else "") + t for t in texts], padding=True, return_tensors="pt"))


TEXTS = ["hello world", "hi", "a longer line of text"]


def test_nnsight_traces_a_left_padded_batch_of_a_gpt2_sink_export(gpt2_sink):
    pytest.importorskip("nnsight")
    from hf_tapernorm.integrations.nnsight_tracing import nnsight_model

    folder, model = gpt2_sink
    batch = left_padded(TEXTS)
    wrapped = nnsight_model(folder)
    with wrapped.trace(**batch):
        logits = wrapped.output.logits.save()
    for row, text in enumerate(TEXTS):
        with torch.no_grad():  # the tapered model on this row alone, after the sink
            expected = model(input_ids=torch.tensor([[EOS, *map(ord, text)]])).logits[0, 1:]
        assert (logits[row, batch["attention_mask"][row].bool()] - expected).abs().max().item() <= 1e-4


@pytest.fixture(scope="module")
def gpt2_sink_graph(gpt2_sink, tmp_path_factory):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from hf_tapernorm.integrations.onnx_runtime import export_onnx

    return export_onnx(gpt2_sink[0], tmp_path_factory.mktemp("gpt2-sink-onnx") / "graph")


def test_onnx_runtime_reads_a_leading_sink_as_the_torch_export_does(exports, onnx_graphs):
    """``tokenizer(text)`` of Llama starts with the sink: the sink is not fed twice, the logits are the export's."""
    from hf_tapernorm.integrations.onnx_runtime import OnnxCausalLM

    runtime = OnnxCausalLM(onnx_graphs["llama-sink"], threads=1)
    model = AutoModelForCausalLM.from_pretrained(exports["llama-sink"]).eval()
    ids = torch.cat([torch.tensor(SINK).expand(IDS.shape[0], -1), IDS], dim=1)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        greedy = model.generate(ids, max_new_tokens=8, do_sample=False)
    logits, _ = runtime.forward(ids.numpy())
    assert logits.shape == tuple(expected.shape) and abs(logits - expected.numpy()).max() <= 1e-4
    assert abs(logits[:, 1:] - runtime.forward(IDS.numpy())[0]).max() <= 1e-4  # with or without the sink: one text
    assert (runtime.generate(ids.numpy(), 8) == greedy.numpy()).all()


@pytest.mark.parametrize("sink_first", [False, True], ids=["text", "sink-first"])
def test_onnx_runtime_reads_a_left_padded_batch_as_the_torch_export_does(gpt2_sink, gpt2_sink_graph, sink_first):
    from hf_tapernorm.integrations.onnx_runtime import OnnxCausalLM

    runtime = OnnxCausalLM(gpt2_sink_graph, threads=1)
    model = AutoModelForCausalLM.from_pretrained(gpt2_sink[0]).eval()
    batch = left_padded(TEXTS, sink_first=sink_first)
    with torch.no_grad():
        expected = model(**batch).logits
        continued = model(**batch, use_cache=True)
        mask = torch.cat([batch["attention_mask"], torch.ones(3, 1, dtype=torch.long)], dim=1)
        following = model(input_ids=torch.full((3, 1), 104), attention_mask=mask, cache=continued.cache).logits
    logits, state = runtime.forward(batch["input_ids"].numpy(), attention_mask=batch["attention_mask"].numpy())
    attended = batch["attention_mask"].bool()
    assert abs(logits[attended.numpy()] - expected[attended].numpy()).max() <= 1e-4
    following_onnx, _ = runtime.forward([[104]] * 3, state)  # each row's positions continue its own count
    assert abs(following_onnx - following.numpy()).max() <= 1e-4
    with torch.no_grad():
        greedy = model.generate(**batch, max_new_tokens=5, do_sample=False, pad_token_id=0).numpy()
    assert (
        runtime.generate(batch["input_ids"].numpy(), 5, attention_mask=batch["attention_mask"].numpy()) == greedy
    ).all()


def test_onnx_runtime_counts_positions_of_a_left_padded_batch_without_a_sink_as_the_torch_export_does(
    exports, onnx_graphs
):
    """A left-padded batch on a GPT-2 export without a sink: the torch export (transformers' GPT-2) counts positions
    from column 0, and OnnxCausalLM.forward counted each row from its own first token, so the padded rows' logits
    differed by about 0.5 without a word. forward counts as the torch export now, continued states too; generate
    still counts each row from its own first token, as transformers' generate() does."""
    from hf_tapernorm.integrations.onnx_runtime import OnnxCausalLM

    runtime = OnnxCausalLM(onnx_graphs["gpt2-all"], threads=1)
    model = AutoModelForCausalLM.from_pretrained(exports["gpt2-all"]).eval()
    batch = left_padded(TEXTS)
    with torch.no_grad():
        expected = model(**batch).logits
        continued = model(**batch, use_cache=True)
        mask = torch.cat([batch["attention_mask"], torch.ones(3, 1, dtype=torch.long)], dim=1)
        following = model(input_ids=torch.full((3, 1), 104), attention_mask=mask, cache=continued.cache).logits
        greedy = model.generate(**batch, max_new_tokens=5, do_sample=False, pad_token_id=0).numpy()
    logits, state = runtime.forward(batch["input_ids"].numpy(), attention_mask=batch["attention_mask"].numpy())
    attended = batch["attention_mask"].bool()
    assert abs(logits[attended.numpy()] - expected[attended].numpy()).max() <= 1e-4
    following_onnx, _ = runtime.forward([[104]] * 3, state, attention_mask=mask.numpy())
    assert abs(following_onnx - following.numpy()).max() <= 1e-4
    assert (
        runtime.generate(batch["input_ids"].numpy(), 5, attention_mask=batch["attention_mask"].numpy()) == greedy
    ).all()


def test_a_left_padded_prompt_fed_in_two_calls_reads_as_in_one_where_a_row_starts_in_the_second(
    gpt2_sink, gpt2_sink_graph
):
    """A left-padded batch on a sink export, fed in two calls where the first holds only padding of a row: that row
    was counted from column 0 of the first call (its first token came later), and its logits were 0.49 off one call
    of the whole batch, in the torch export and ONNX Runtime alike. A continued call counts a row's padding on the
    whole mask now, 2D or 4D. With the sink written in the input, such a first call is refused in one line (the row's
    sink would come after the cache began), where it was refused as rows that mix the sink and no sink."""
    from hf_tapernorm.integrations.onnx_runtime import OnnxCausalLM

    folder, _ = gpt2_sink
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    runtime = OnnxCausalLM(gpt2_sink_graph, threads=1)
    batch = left_padded(TEXTS)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    split = 12  # "hi" has 19 pads: its first call holds none of its text
    assert not mask[1, :split].any() and mask[0, :split].any()
    with torch.no_grad():
        whole = model(input_ids=ids, attention_mask=mask).logits
        first = model(input_ids=ids[:, :split], attention_mask=mask[:, :split], use_cache=True)
        rest = model(input_ids=ids[:, split:], attention_mask=mask, cache=first.cache).logits
    attended = mask[:, split:].bool()
    assert (rest[attended] - whole[:, split:][attended]).abs().max().item() <= 1e-4
    length = ids.shape[1]  # the same with an additive 4D mask (causal and padding), cut for each call
    allowed = torch.ones(length, length).tril().bool()[None, None] & mask[:, None, None, :].bool()
    full = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    with torch.no_grad():
        first = model(input_ids=ids[:, :split], attention_mask=full[:, :, :split, :split], use_cache=True)
        rest = model(input_ids=ids[:, split:], attention_mask=full[:, :, split:, :], cache=first.cache).logits
    assert (rest[attended] - whole[:, split:][attended]).abs().max().item() <= 1e-4
    _, state = runtime.forward(ids[:, :split].numpy(), attention_mask=mask[:, :split].numpy())
    rest_onnx, _ = runtime.forward(ids[:, split:].numpy(), state, attention_mask=mask.numpy())
    assert abs(rest_onnx[attended.numpy()] - whole[:, split:][attended].numpy()).max() <= 1e-4
    sink_first = left_padded(TEXTS, sink_first=True)
    said = (
        "row(s) [1] of this call are all padding while the others start with the sink token(s) [127], so their sink "
        "would come in a later call, after the cache began; give every row's first tokens in the first call (the "
        "whole prompt in one call), or leave the sink out of the input"
    )
    head = {key: value[:, :split] for key, value in sink_first.items()}
    with pytest.raises(ValueError, match=re.escape(said)):
        model(**head, use_cache=True)
    with pytest.raises(ConfigurationError, match=re.escape(said)):
        runtime.forward(head["input_ids"].numpy(), attention_mask=head["attention_mask"].numpy())


def test_onnx_runtime_refuses_past_the_position_table_as_the_torch_export_does(gpt2_sink, gpt2_sink_graph):
    from hf_tapernorm.integrations.onnx_runtime import OnnxCausalLM

    runtime = OnnxCausalLM(gpt2_sink_graph, threads=1)
    model = AutoModelForCausalLM.from_pretrained(gpt2_sink[0]).eval()
    ids = torch.randint(1, 120, (1, 64))
    with pytest.raises(ValueError) as torch_error, torch.no_grad():
        model(input_ids=ids)
    with pytest.raises(ValueError) as onnx_error:
        runtime.forward(ids.numpy())
    said = str(torch_error.value).split(": ", 1)[1]
    assert "0..0 of this model's 64 learned positions" in said and str(onnx_error.value).endswith(": " + said)
    _, state = runtime.forward(ids[:, :60].numpy())
    with pytest.raises(ValueError, match="this call reaches 65: shorten the input or crop the cache"):
        runtime.forward(ids[:, 60:].numpy(), state)


def test_onnx_runtime_counts_the_positions_a_left_padded_generate_uses_as_the_torch_export_does(
    gpt2_sink, gpt2_sink_graph, exports, onnx_graphs
):
    """OnnxCausalLM read_input's count of the cache and the padded input: a left-padded generate whose positions fit
    the 64-row table was refused, with a sink and without, and a left-padded forward of a sink graph too. Now it counts
    the positions it feeds, as the torch export does: what fits runs with the export's tokens, one more is refused in
    the export's words, and a forward without a sink, fed at its columns, is still refused past the table."""
    from hf_tapernorm.integrations.onnx_runtime import OnnxCausalLM

    ids = torch.randint(3, 100, (2, 66), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[:, :5] = 0
    for folder, graph, length in (
        (gpt2_sink[0], gpt2_sink_graph, 61),
        (exports["gpt2-all"], onnx_graphs["gpt2-all"], 62),
    ):
        runtime = OnnxCausalLM(graph, threads=1)
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        prompt, attended = ids[:, :length], mask[:, :length]
        with torch.no_grad():
            greedy = model.generate(prompt, attention_mask=attended, max_new_tokens=8, do_sample=False, pad_token_id=0)
            with pytest.raises(ValueError) as torch_error:
                model.generate(prompt, attention_mask=attended, max_new_tokens=9, do_sample=False, pad_token_id=0)
        assert (runtime.generate(prompt.numpy(), 8, attention_mask=attended.numpy()) == greedy.numpy()).all()
        with pytest.raises(ConfigurationError) as onnx_error:
            runtime.generate(prompt.numpy(), 9, attention_mask=attended.numpy())
        said = str(torch_error.value).split(": ", 1)[1]
        assert "this call reaches 65" in said and str(onnx_error.value).endswith(": " + said)
    logits, _ = OnnxCausalLM(gpt2_sink_graph, threads=1).forward(ids[:, 1:].numpy(), attention_mask=mask[:, 1:].numpy())
    assert logits.shape == (2, 65, 128)  # the sink and 60 tokens of text after 5 pads: positions 0..60
    with pytest.raises(ConfigurationError, match="64 learned positions; this call reaches 66: shorten the input"):
        OnnxCausalLM(onnx_graphs["gpt2-all"], threads=1).forward(ids.numpy(), attention_mask=mask.numpy())


def test_onnx_runtime_continues_gemma2_s_sliding_and_full_layers_past_the_window(tmp_path):
    """Gemma 2 mixes sliding-window layers (window 8 here) with full ones. The graph used to carry each sliding
    layer's own cache, cut to the window with its mask offset fixed when traced, so a state continued past the
    window (token by token, a second chunk, generate) was an ONNX Runtime traceback ("GatherND ... invalid
    index"). Now every layer's state keeps its positions and the window is the mask's: each continuation gives the
    torch export's logits and greedy tokens, sink, left padding and all."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from hf_tapernorm.integrations.onnx_runtime import OnnxCausalLM, export_onnx

    folder = export_folded(fold_model(sink_tapered("gemma2")), tmp_path / "export")
    runtime = OnnxCausalLM(export_onnx(folder, tmp_path / "graph"), threads=1)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = random_batches(vocab=120, n=1, batch=2, length=16, seed=9)[0] + 3  # never the sink, pad or eos id
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        unwindowed = AutoModelForCausalLM.from_pretrained(folder, sliding_window=64).eval()(input_ids=ids).logits
    assert (unwindowed - expected).abs().max().item() > 1e-2  # 16 tokens and the sink: the window matters
    logits, state = runtime.forward(ids[:, :3].numpy())
    steps = [logits]
    for column in range(3, ids.shape[1]):  # token by token, well past the window
        logits, state = runtime.forward(ids[:, column : column + 1].numpy(), state)
        steps.append(logits)
    assert abs(np.concatenate(steps, axis=1) - expected.numpy()).max() <= 1e-4
    _, state = runtime.forward(ids[:, :5].numpy())
    assert abs(runtime.forward(ids[:, 5:].numpy(), state)[0] - expected[:, 5:].numpy()).max() <= 1e-4
    mask = torch.ones_like(ids[:, :6])
    mask[0, :3] = 0  # one left-padded row
    with torch.no_grad():
        greedy = model.generate(ids[:, :6], attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert (runtime.generate(ids[:, :6].numpy(), 12, attention_mask=mask.numpy()) == greedy.numpy()).all()


def test_export_onnx_of_a_bf16_model_traces_an_fp32_graph_that_runs(exports, tmp_path):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from hf_tapernorm.integrations.onnx_runtime import OnnxCausalLM, export_onnx

    model = AutoModelForCausalLM.from_pretrained(exports["llama-sink"], dtype=torch.bfloat16).eval()
    runtime = OnnxCausalLM(export_onnx(model, tmp_path / "graph"), threads=1)
    assert next(model.parameters()).dtype == torch.bfloat16  # the caller's model is left as it was
    with torch.no_grad():  # the same weights (bf16 values) in fp32
        expected = AutoModelForCausalLM.from_pretrained(exports["llama-sink"], dtype=torch.bfloat16).float()(IDS)
    assert abs(runtime.forward(IDS.numpy())[0] - expected.logits.numpy()).max() <= 1e-4


def test_export_onnx_takes_a_plain_model_folder(tmp_path):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from hf_tapernorm.integrations.onnx_runtime import OnnxCausalLM, export_onnx
    from tests.conftest import save_tiny_model

    folder = save_tiny_model(tmp_path / "plain")
    runtime = OnnxCausalLM(export_onnx(folder, tmp_path / "graph"), threads=1)
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(folder).eval()(IDS).logits
    assert abs(runtime.forward(IDS.numpy())[0] - expected.numpy()).max() <= 1e-4


def test_a_half_installed_onnx_extra_names_the_missing_package(tmp_path):
    """onnxscript installed without onnx (its dependency): the error names onnx and the extra, in one line."""
    code = (
        "import sys\n"
        "sys.modules['onnx'] = None\n"
        "from hf_tapernorm.integrations.extras import MissingExtraError, require\n"
        "try:\n"
        "    require('onnxscript', 'feature')\n"
        "except MissingExtraError as error:\n"
        "    print(error)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert done.stdout.strip() == "feature needs onnx, which is not installed: pip install 'hf-tapernorm[onnx]'", (
        done.stderr[-2000:]
    )


# ----------------------------------------------------------------------------- TransformerLens: the tokenizer
def test_transformer_bridge_takes_the_tokenizer_saved_with_the_export_or_asks_for_one(exports, tmp_path):
    pytest.importorskip("transformer_lens")
    from hf_tapernorm.integrations.tl_bridge import transformer_bridge

    loaded = AutoModelForCausalLM.from_pretrained(exports["llama-sink"])
    bridge = transformer_bridge(loaded)  # loaded from the export's folder: its tokenizer is there
    assert bridge.to_tokens("ab", prepend_bos=False).tolist() == [[97, 98]]
    with pytest.raises(ConfigurationError, match=r"names no tokenizer; pass tokenizer= \(the tokenizer of the model"):
        transformer_bridge(fold_model(tapered("llama", sink_token_ids=SINK)))
    bare = export_folded(fold_model(tapered("llama", sink_token_ids=SINK)), tmp_path / "bare")
    with pytest.raises(
        ConfigurationError, match=rf"no tokenizer could be loaded from '{bare}' \(.*\); pass tokenizer="
    ):
        transformer_bridge(bare)


def test_two_bridges_from_one_tokenizer_both_work_and_leave_it_as_it_was(exports):
    """TransformerLens edits the tokenizer it is given (a tokenizer without a BOS gets its EOS as pad and BOS
    tokens), so a second bridge from the same tokenizer object was TransformerLens's own traceback (KeyError:
    'name_or_path'). Each bridge now gets a copy: both work, and the caller's tokenizer is unchanged."""
    pytest.importorskip("transformer_lens")
    from hf_tapernorm.integrations.tl_bridge import transformer_bridge

    tokenizer = char_tokenizer()
    before = (dict(tokenizer.init_kwargs), tokenizer.pad_token, tokenizer.bos_token, len(tokenizer))
    for kind in ["llama-sink", *KINDS]:
        bridge = transformer_bridge(exports[kind], tokenizer=tokenizer)
        assert bridge.tokenizer is not tokenizer
        assert bridge.to_tokens("ab", prepend_bos=False).tolist() == [[97, 98]]
        with torch.no_grad():
            assert (bridge(IDS) - export_logits(exports[kind])).abs().max().item() <= 1e-4
    assert (dict(tokenizer.init_kwargs), tokenizer.pad_token, tokenizer.bos_token, len(tokenizer)) == before
    assert tokenizer.pad_token is None and tokenizer.bos_token is None


def test_transformer_bridge_refuses_falcon_s_grouped_kv_layout_in_one_line_before_loading(tmp_path, monkeypatch):
    """Falcon's new_decoder_architecture with num_kv_heads=2 groups each key/value head with its queries in
    query_key_value; TransformerLens's Falcon adapter splits it as all queries, keys, values (with one key/value
    head under the default multi_query), which was its own traceback (RuntimeError: split_with_sizes ...), and
    with multi_query=False other logits than the model's. It is refused in one line naming TransformerLens, the
    layout and what to use instead, before the folder's model is loaded; an in-memory model likewise."""
    pytest.importorskip("transformer_lens")
    from hf_tapernorm.integrations import tl_bridge

    folded = fold_model(sink_tapered("falcon-two_norms"))
    folder = export_folded(folded, tmp_path / "export")
    char_tokenizer().save_pretrained(folder)
    said = (
        "transformer_bridge: TransformerLens cannot read Falcon's new_decoder_architecture with num_kv_heads=2 (its "
        "Falcon adapter splits query_key_value as if queries, keys and values were not grouped per key/value head); "
        "trace this export with hf_tapernorm.integrations.nnsight_model instead"
    )
    with pytest.raises(ConfigurationError) as error:
        tl_bridge.transformer_bridge(folded, tokenizer=char_tokenizer())
    assert str(error.value) == said
    monkeypatch.setattr(tl_bridge, "load_export", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(ConfigurationError) as error:
        tl_bridge.transformer_bridge(folder)
    assert str(error.value) == said


def _folded_export(config, folder: Path):
    """A tapered (calibrated, g = 0), folded model of ``config`` and its export, saved with the character tokenizer."""
    from hf_tapernorm import TaperNormConfig, patch_model
    from hf_tapernorm.layers import set_gate
    from hf_tapernorm.training import calibrate
    from tests.conftest import build

    model = patch_model(build(config), TaperNormConfig.paper()).train()
    with torch.no_grad():
        for ids in random_batches(vocab=120, n=3):
            model(ids + 3)
    calibrate(model)
    set_gate(model, 0.0)
    folded = fold_model(model.eval())
    export_folded(folded, folder)
    char_tokenizer().save_pretrained(folder)
    return folded, folder


_TINY = dict(vocab_size=128, bos_token_id=1, eos_token_id=2, pad_token_id=0)
_FALCON_RW = dict(_TINY, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)
_FALCON_RW.update(multi_query=False, parallel_attn=False, bias=True)  # Falcon-RW's layout
_MISREAD = {
    "falcon alibi": (
        ("falcon", dict(_FALCON_RW, alibi=True)),
        "transformer_bridge: TransformerLens cannot give Falcon with alibi=True the export's logits (its ALiBi "
        "attention computes as transformers' eager Falcon attention, which adds the ALiBi bias twice, in the mask "
        "and to the scores, where the export's sdpa attention adds it once); trace this export with "
        "hf_tapernorm.integrations.nnsight_model instead",
    ),
    "codegen": (
        ("codegen", dict(_TINY, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=64, n_ctx=64)),
        "transformer_bridge: TransformerLens cannot run CodeGen (its CodeGen attention reads the rotary table as "
        "CodeGenAttention.embed_positions, which transformers' CodeGen keeps in its CodeGenRotaryEmbedding); trace "
        "this export with hf_tapernorm.integrations.nnsight_model instead",
    ),
}


@pytest.mark.parametrize("case", sorted(_MISREAD))
def test_transformer_bridge_refuses_layouts_transformer_lens_misreads_in_one_line_before_loading(
    case, tmp_path, monkeypatch
):
    """Two more layouts TransformerLens does not read as the export runs. Falcon with ALiBi (Falcon-RW's) was
    accepted, and the bridge's logits were not the export's: its ALiBi attention follows transformers' eager Falcon
    attention, which adds the bias twice, where the export (sdpa) adds it once. CodeGen was TransformerLens's own
    traceback (AttributeError: 'CodeGenAttention' object has no attribute 'embed_positions'). Both are now refused
    in one line naming TransformerLens, the layout and nnsight instead, before the folder's model is loaded; an
    in-memory model likewise. nnsight, the way out, gives the export's logits."""
    pytest.importorskip("transformer_lens")
    from hf_tapernorm.integrations import tl_bridge

    (model_type, values), said = _MISREAD[case]
    folded, folder = _folded_export(AutoConfig.for_model(model_type, **values), tmp_path / "export")
    with pytest.raises(ConfigurationError) as error:
        tl_bridge.transformer_bridge(folded, tokenizer=char_tokenizer())
    assert str(error.value) == said
    with monkeypatch.context() as patched:
        patched.setattr(tl_bridge, "load_export", lambda *a, **k: pytest.fail("the model was loaded"))
        with pytest.raises(ConfigurationError) as error:
            tl_bridge.transformer_bridge(folder)
    assert str(error.value) == said
    if importlib.util.find_spec("nnsight") is not None:
        from hf_tapernorm.integrations.nnsight_tracing import nnsight_model

        traced = nnsight_model(folder)
        with traced.trace(input_ids=IDS):
            logits = traced.output.logits.save()
        expected = AutoModelForCausalLM.from_pretrained(folder).eval()(input_ids=IDS).logits
        assert (logits - expected).abs().max().item() <= 1e-5


def test_transformer_bridge_still_reads_falcon_rw_s_layout_without_alibi(tmp_path):
    """The ALiBi refusal is the layout's alone: the same Falcon layout with rotary positions bridges, and its
    logits are the export's."""
    pytest.importorskip("transformer_lens")
    from hf_tapernorm.integrations.tl_bridge import transformer_bridge

    _, folder = _folded_export(AutoConfig.for_model("falcon", **_FALCON_RW), tmp_path / "export")
    with torch.no_grad():
        difference = transformer_bridge(folder)(IDS) - export_logits(folder)
    assert difference.abs().max().item() <= 1e-4


# ----------------------------------------------------------------------------- outputs line up with a sink-first input
def test_nnsight_returns_hidden_states_at_every_column_of_a_sink_first_input(exports):
    """The model's outputs (logits and hidden states) have one column per input id, the sink's included (its hidden
    states are stored constants); the modules' own outputs are the columns the export computes (the text's)."""
    pytest.importorskip("nnsight")
    from hf_tapernorm.integrations.nnsight_tracing import nnsight_model

    ids = torch.cat([torch.tensor(SINK).expand(IDS.shape[0], -1), IDS], dim=1)
    plain = AutoModelForCausalLM.from_pretrained(exports["llama-sink"]).eval()
    with torch.no_grad():
        expected = plain(input_ids=ids, output_hidden_states=True)
    wrapped = nnsight_model(exports["llama-sink"])
    with wrapped.trace(input_ids=ids, output_hidden_states=True):
        output = wrapped.output.save()
    assert output.logits.shape[:2] == ids.shape
    assert [tuple(h.shape[:2]) for h in output.hidden_states] == [tuple(ids.shape)] * len(expected.hidden_states)
    for hidden, reference in zip(output.hidden_states, expected.hidden_states, strict=True):
        assert (hidden - reference).abs().max().item() <= 1e-5


# ----------------------------------------------------------------------------- ONNX Runtime: what it cannot take
def test_export_onnx_refuses_a_file_on_the_way_before_loading_the_model(exports, tmp_path, monkeypatch):
    import hf_tapernorm.integrations.onnx_runtime as onnx_runtime

    monkeypatch.setattr(onnx_runtime, "load_export", lambda *a, **k: pytest.fail("the model was loaded"))
    (tmp_path / "afile").write_text("notes")
    for target, blocking in ((tmp_path / "afile" / "sub", tmp_path / "afile"), (tmp_path / "afile", "it")):
        with pytest.raises(ConfigurationError) as error:
            onnx_runtime.export_onnx(exports["llama-sink"], target)
        assert str(error.value) == f"cannot export ONNX into '{target}': {blocking} is a file; choose a folder"
    assert (tmp_path / "afile").read_text() == "notes"


@pytest.mark.parametrize("call, said", [
    (lambda r: r.forward([5, 6, 7]), r"input_ids must be \[batch, seq\] integers with a column in each row, got "
                                     r"int64 of shape \[3\]; pass one sequence as a batch of one: \[ids\]$"),
    (lambda r: r.generate([5, 6, 7], 2), r"of shape \[3\]; pass one sequence as a batch of one"),
    (lambda r: r.forward([[5, 6], [7]]), r"input_ids must be \[batch, seq\] integers \(ValueError: "),
    (lambda r: r.forward([[5.0, 6.0]]), r"got float64 of shape \[1, 2\]$"),
    (lambda r: r.forward([[5, 128]]), r"token ids of the model's vocabulary \(0\.\.127\), got ids from 5 to 128$"),
    (lambda r: r.forward(r.np.array([[5], [6]]), r.forward(r.np.array([[5, 6, 7]]))[1]),
     r"the state continues 1 row\(s\) and input_ids has 2: continue a state with as many rows as the call that made"),
    (lambda r: r.forward([[5, 6]], attention_mask=[[1, 1], [1, 1]]), r"attention_mask has 2 row\(s\) and input_ids 1"),
    (lambda r: r.forward([[5, 6]], attention_mask=[[1, 1, 1, 1]]),
     r"attention_mask has 4 columns; it must cover the tokens the state holds and these input_ids: 2 columns$"),
    (lambda r: r.forward([[5]], r.forward([[6, 7, 8]])[1], attention_mask=[[1, 1]]),
     r"attention_mask has 2 columns; .*: 4 columns \(5 counting the stored sink\)$"),
    (lambda r: r.forward([[5, 6], [7, 8]]), r"some rows of input_ids start with the sink token\(s\) \[5\] and others"),
], ids=["1d", "generate-1d", "ragged", "float", "vocab", "state-batch", "mask-rows", "mask-columns",
        "continued-mask", "mixed-sink"])  # fmt: skip
def test_onnx_runtime_refuses_what_its_graph_cannot_take_in_one_line(onnx_graphs, call, said):
    from hf_tapernorm.errors import TaperNormError
    from hf_tapernorm.integrations.onnx_runtime import OnnxCausalLM

    runtime = OnnxCausalLM(onnx_graphs["llama-sink"], threads=1)
    with pytest.raises(TaperNormError, match=said) as error:
        call(runtime)
    assert "\n" not in str(error.value) and str(error.value).startswith("OnnxCausalLM(")


def test_onnx_runtime_generate_refuses_what_forward_refuses_and_a_negative_count(onnx_graphs):
    """generate cast the ids to int64 before forward's check: float ids (72.9) were truncated and generated from,
    and ragged rows raised numpy's own error; a negative max_new_tokens returned the ids without a word."""
    from hf_tapernorm.errors import TaperNormError
    from hf_tapernorm.integrations.onnx_runtime import OnnxCausalLM

    runtime = OnnxCausalLM(onnx_graphs["llama-sink"], threads=1)
    for ids in ([[5, 72.9, 101.2]], [[5, 6], [7]], [[5, 128]]):
        with pytest.raises(TaperNormError) as by_forward:
            runtime.forward(ids)
        with pytest.raises(TaperNormError) as by_generate:
            runtime.generate(ids, 2)
        assert str(by_generate.value) == str(by_forward.value)
    for count in (-3, 2.0, True):
        with pytest.raises(TaperNormError) as error:
            runtime.generate([[5, 6]], count)
        assert str(error.value) == (
            f"OnnxCausalLM('{onnx_graphs['llama-sink']}'): max_new_tokens must be a whole number of tokens, 0 or "
            f"more, got {count!r}"
        )
    assert runtime.generate([[5, 6]], 0).tolist() == [[5, 6]]


# ----------------------------------------------------------------------------- paths and dtypes
def test_every_integration_reads_and_writes_a_home_relative_path(exports, tmp_path, monkeypatch):
    """ "~/exp" is the home folder's, as the CLI and export_folded read it: never refused, never a folder named "~"."""
    import shutil

    from hf_tapernorm.integrations.exports import load_export

    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir()
    shutil.copytree(exports["llama-sink"], home / "exp")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    expected = export_logits(exports["llama-sink"])
    with torch.no_grad():
        assert (load_export("~/exp")(IDS).logits - expected).abs().max().item() <= 1e-5
    if importlib.util.find_spec("nnsight") is not None:
        from hf_tapernorm.integrations.nnsight_tracing import nnsight_model

        assert nnsight_model("~/exp").config.name_or_path == str(home / "exp")
    if importlib.util.find_spec("transformer_lens") is not None:
        from hf_tapernorm.integrations.tl_bridge import transformer_bridge

        with torch.no_grad():  # the tokenizer saved in the export, found through the expanded path
            assert (transformer_bridge("~/exp")(IDS) - expected).abs().max().item() <= 1e-4
    if importlib.util.find_spec("onnxruntime") is not None and importlib.util.find_spec("onnxscript") is not None:
        from hf_tapernorm.integrations.onnx_runtime import OnnxCausalLM, export_onnx

        assert export_onnx("~/exp", "~/onnx") == home / "onnx"
        assert abs(OnnxCausalLM("~/onnx").forward(IDS.numpy())[0] - expected.numpy()).max() <= 1e-4
    assert list(work.iterdir()) == []  # nothing named "~" in the working folder


def test_an_in_memory_model_keeps_its_dtype_and_another_dtype_is_refused(exports):
    """dtype= loads a folder in it (float32 by default); a model in memory keeps its own dtype, and another one is
    refused naming the conversion, the caller's model left as it was."""
    from hf_tapernorm.integrations.exports import load_export

    folder = exports["llama-sink"]
    assert load_export(folder).dtype == torch.float32
    assert load_export(folder, dtype=torch.bfloat16).dtype == torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert load_export(model, dtype=torch.float32) is model
    with pytest.raises(
        ConfigurationError, match=r"given is torch.float32: convert it first \(model.to\(torch.bfloat16\)"
    ):
        load_export(model, dtype=torch.bfloat16)
    assert model.dtype == torch.float32
    half = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    assert load_export(half).dtype == torch.bfloat16
    if importlib.util.find_spec("nnsight") is not None:
        from hf_tapernorm.integrations.nnsight_tracing import nnsight_model

        with pytest.raises(ConfigurationError, match="convert it first"):
            nnsight_model(model, dtype=torch.bfloat16)
    if importlib.util.find_spec("transformer_lens") is not None:
        from hf_tapernorm.integrations.tl_bridge import transformer_bridge

        with pytest.raises(ConfigurationError, match="convert it first"):
            transformer_bridge(model, dtype=torch.bfloat16, tokenizer=char_tokenizer())
        bridge = transformer_bridge(half, tokenizer=char_tokenizer())  # the model's own dtype, not float32
        with torch.no_grad():
            logits = bridge(IDS)
        assert next(bridge.parameters()).dtype == torch.bfloat16 and logits.dtype == torch.bfloat16


def test_dtype_given_as_text_is_the_torch_dtype_it_names_and_a_bad_name_is_one_line(exports):
    """load_export(model, dtype="float32") was refused though dtype=torch.float32 is accepted ("convert it first"
    to the dtype it already had), and dtype="bogus" was an AttributeError."""
    from hf_tapernorm.integrations.exports import load_export

    folder = exports["llama-sink"]
    model = AutoModelForCausalLM.from_pretrained(folder)
    for dtype in ("float32", "torch.float32", "auto"):
        assert load_export(model, dtype=dtype) is model
    assert load_export(folder, dtype="auto").dtype == torch.float32  # the dtype its config.json records
    assert load_export(folder, dtype="bfloat16").dtype == torch.bfloat16
    assert load_export(folder, dtype="bf16").dtype == torch.bfloat16  # bench's spelling too (it was refused)
    with pytest.raises(ConfigurationError, match=r"convert it first \(model.to\(torch.bfloat16\)"):
        load_export(model, dtype="bfloat16")
    for bogus in ("bogus", "int8", 3):
        with pytest.raises(ConfigurationError, match=rf"^dtype={bogus!r} is no dtype an export loads in: .*bfloat16"):
            load_export(folder, dtype=bogus)


def test_load_tapered_reads_a_home_relative_folder(tmp_path, monkeypatch):
    """load_tapered("~/tap") said "not found" while save_tapered(m, "~/st") writes $HOME/st."""
    from hf_tapernorm import load_tapered, save_tapered
    from tests.helpers import tapered_checkpoint

    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir()
    tapered_checkpoint(home / "tap")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    model = load_tapered("~/tap").eval()
    save_tapered(model, "~/st")
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, load_tapered(home / "st").eval()(IDS).logits)
    assert list(work.iterdir()) == []  # nothing named "~" in the working folder


def test_a_home_folder_of_a_user_this_machine_does_not_have_is_one_line_where_the_api_takes_a_path(
    tmp_path, monkeypatch
):
    """save_tapered, load_tapered and load_export of "~nosuchuser/x" raised Path.expanduser's bare RuntimeError."""
    from hf_tapernorm import load_tapered, save_tapered
    from hf_tapernorm.integrations.exports import load_export

    monkeypatch.chdir(tmp_path)
    model = tapered("llama")
    calls = {
        "save_tapered: folder ": lambda: save_tapered(model, "~nosuchuser/x"),
        "load_tapered: folder ": lambda: load_tapered("~nosuchuser/x"),
        "": lambda: load_export("~nosuchuser/x"),
    }
    for what, call in calls.items():
        with pytest.raises(ConfigurationError) as refused:
            call()
        assert str(refused.value).startswith(f"{what}'~nosuchuser/x': there is no user 'nosuchuser' on this machine")
    assert list(tmp_path.iterdir()) == []


def test_the_api_reads_a_home_path_as_the_home_folder_wherever_it_takes_a_folder(tmp_path, monkeypatch):
    """TaperNormConfig.save_pretrained and save_sharded_checkpoint wrote '~/x' as a folder named '~' in the working
    folder (and '~nosuchuser/x' as one named '~nosuchuser'), and from_pretrained / load_sharded_checkpoint refused
    '~/x' although it was there."""
    from hf_tapernorm import TaperNormConfig
    from hf_tapernorm.training.sharded import load_sharded_checkpoint, save_sharded_checkpoint

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    config = TaperNormConfig(ema_rate=0.05)
    assert config.save_pretrained("~/cfg") == tmp_path / "home" / "cfg" / "tapernorm_config.json"
    assert TaperNormConfig.from_pretrained("~/cfg") == config
    model = tapered("llama")
    assert save_sharded_checkpoint("~/sharded", model) == tmp_path / "home" / "sharded"
    assert load_sharded_checkpoint("~/sharded", model, trust_sharded_checkpoint=True) == 0
    for call in (
        lambda: config.save_pretrained("~nosuchuser/c"),
        lambda: save_sharded_checkpoint("~nosuchuser/s", model),
    ):
        with pytest.raises(ConfigurationError, match="there is no user 'nosuchuser' on this machine"):
            call()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home"]


def test_the_controller_s_state_and_onnx_s_optimized_graph_go_to_the_home_folder(onnx_graphs, tmp_path, monkeypatch):
    """TaperController.save_state('~/cs') wrote its config to $HOME/cs and then failed on the teacher, at a folder
    named '~' (half a state written); load_state('~/cs') and load_state of a mistyped folder restored nothing
    without a word; OnnxCausalLM(..., optimized_path='~/opt.onnx') failed in ONNX Runtime."""
    from hf_tapernorm import TaperController, TaperNormConfig, patch_model
    from hf_tapernorm.errors import TaperStateError
    from hf_tapernorm.integrations.onnx_runtime import OnnxCausalLM
    from tests.conftest import build, tiny_llama_config

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    model = patch_model(build(tiny_llama_config()), TaperNormConfig.paper().replace(distill_weight=0.5))
    controller = TaperController(model, total_steps=20)
    controller.save_state("~/cs")
    assert (tmp_path / "home" / "cs" / "tapernorm_config.json").is_file()
    controller.load_state("~/cs")
    with pytest.raises(TaperStateError, match=r"TaperController.load_state: no folder '.*/no_such_checkpoint'"):
        controller.load_state(tmp_path / "no_such_checkpoint")
    OnnxCausalLM(onnx_graphs["llama-sink"], threads=1, optimized_path="~/opt.onnx")
    assert (tmp_path / "home" / "opt.onnx").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home"]


def test_a_dtype_an_export_cannot_load_in_is_one_line_naming_the_accepted_ones(exports):
    """load_export / transformer_bridge with dtype=torch.int64, torch.complex64 or torch.float8_e4m3fn gave
    transformers' ValueError ("cannot be instantiated under dtype") or a TypeError (no Float8 storage)."""
    from hf_tapernorm.integrations.exports import load_export

    calls = [load_export]
    if importlib.util.find_spec("transformer_lens") is not None:
        from hf_tapernorm.integrations.tl_bridge import transformer_bridge

        calls.append(transformer_bridge)
    for dtype in (torch.int64, torch.complex64, torch.float8_e4m3fn, torch.bool):
        for call in calls:
            with pytest.raises(ConfigurationError) as error:
                call(exports["llama-sink"], dtype=dtype)
            assert str(error.value) == (
                f"dtype={dtype} is no dtype an export loads in: give one of float32/fp32, float16/fp16, bfloat16/bf16, "
                "float64/fp64 (as text or a torch dtype: torch.bfloat16), or auto"
            )
    assert load_export(exports["llama-sink"], dtype=torch.float64).dtype == torch.float64


# ----------------------------------------------------------------------------- a tapered checkpoint is no export
def test_every_integration_refuses_a_tapered_checkpoint_naming_how_to_fold_it(tmp_path):
    """load_export, nnsight_model, transformer_bridge and export_onnx of a run's tapered/ or checkpoint-N gave
    transformers' "does not recognize this architecture ... pip install --upgrade transformers". One check in
    load_export says what it is and what to do; a checkpoint of an older version (base model_type, its
    tapernorm_config.json beside it) would have loaded as the plain model with its norms back. A patched model in
    memory is refused too."""
    import json

    from hf_tapernorm.integrations.exports import load_export
    from tests.helpers import tapered_checkpoint

    saved = tapered_checkpoint(tmp_path / "run" / "tapered")
    trainer = tmp_path / "run" / "checkpoint-6"
    model = tapered("llama", sink_token_ids=SINK)
    model.save_pretrained(trainer)
    older = tmp_path / "older"
    model.save_pretrained(older)
    config = json.loads((older / "config.json").read_text())
    (older / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    calls = [load_export]
    if importlib.util.find_spec("nnsight") is not None:
        from hf_tapernorm.integrations.nnsight_tracing import nnsight_model

        calls.append(nnsight_model)
    if importlib.util.find_spec("transformer_lens") is not None:
        from hf_tapernorm.integrations.tl_bridge import transformer_bridge

        calls.append(transformer_bridge)
    if importlib.util.find_spec("onnxscript") is not None:
        from hf_tapernorm.integrations.onnx_runtime import export_onnx

        calls.append(lambda source: export_onnx(source, tmp_path / "onnx"))
    for folder in (saved, trainer, older):
        for call in calls:
            with pytest.raises(ConfigurationError) as error:
                call(folder)
            assert str(error.value) == (
                f"'{folder}' is a tapered checkpoint (its norms are TaperNorm layers), not an export: fold it first "
                f"(hf-tapernorm fold --checkpoint {folder} --output_dir FOLDER, or hf_tapernorm.fold_model / "
                "export_folded) and pass the folded folder, or load it with hf_tapernorm.load_tapered"
            )
        with pytest.raises(ConfigurationError, match=r"^LlamaForCausalLM is a tapered model \(patch_model\), not an"):
            calls[-1](model)
    assert not (tmp_path / "onnx").exists()


# ----------------------------------------------------------------------------- ONNX Runtime: masks and disks
def test_onnx_runtime_reads_a_0_1_mask_of_any_real_dtype_as_the_torch_export_does(exports, onnx_graphs):
    """OnnxCausalLM.forward(ids, attention_mask=mask.float()) was refused ("must be [batch, seq] integers") while
    the torch export reads it as the integer mask. A float or bool mask of 0 and 1 is read as those integers;
    another value in a float mask is refused in one line, not rounded."""
    from hf_tapernorm.integrations.onnx_runtime import OnnxCausalLM

    runtime = OnnxCausalLM(onnx_graphs["llama-sink"], threads=1)
    ids = IDS.clone()
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids[1, :3] = 0
    expected, _ = runtime.forward(ids.numpy(), attention_mask=mask.numpy())
    model = AutoModelForCausalLM.from_pretrained(exports["llama-sink"]).eval()
    with torch.no_grad():
        torch_logits = model(ids, attention_mask=mask.float()).logits.numpy()
    for given in (mask.float(), mask.double(), mask.bool(), mask.half()):
        logits, state = runtime.forward(ids.numpy(), attention_mask=given.numpy())
        assert abs(logits - expected).max() == 0.0, given.dtype
        assert abs(logits[:, 3:] - torch_logits[:, 3:]).max() <= 1e-4
    for wrong, said in ((0.5, "0.5"), (float("nan"), "nan"), (2.0, "2.0")):
        given = mask.float().numpy()
        given[0, 4] = wrong
        with pytest.raises(ConfigurationError) as error:
            runtime.forward(ids.numpy(), attention_mask=given)
        assert str(error.value) == (
            f"OnnxCausalLM('{onnx_graphs['llama-sink']}'): attention_mask must hold 1 (a token) and 0 (padding), got "
            f"float32 holding {said}"
        )


def test_an_onnx_export_that_fails_writing_leaves_no_folder_and_is_one_line(exports, tmp_path, monkeypatch):
    """export_onnx onto a full disk left a truncated model.onnx and model.onnx.data in the folder (and the next
    export there was refused: "not an empty folder"), and the OSError came out as it was. The files are written into
    a hidden sibling renamed into place when whole: the failure leaves nothing, in one line naming the folder, and
    the next export there works."""
    import errno

    pytest.importorskip("onnxscript")
    pytest.importorskip("onnxruntime")
    from hf_tapernorm.integrations.onnx_runtime import OnnxCausalLM, export_onnx

    real = torch.onnx.export

    def full_disk(module, args, path, **options):
        Path(path).write_bytes(b"\0" * 1000)  # what the writer got onto the disk before it filled up
        Path(f"{path}.data").write_bytes(b"\0" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    target = tmp_path / "out" / "onnx"
    monkeypatch.setattr(torch.onnx, "export", full_disk)
    with pytest.raises(ConfigurationError) as error:
        export_onnx(exports["llama-sink"], target)
    assert str(error.value) == (
        f"cannot export ONNX into '{target}': OSError: [Errno 28] No space left on device; nothing was written "
        "there: free space (or choose another folder) and export again"
    )
    assert list((tmp_path / "out").iterdir()) == []  # no onnx/, no hidden partial folder
    monkeypatch.setattr(torch.onnx, "export", real)
    runtime = OnnxCausalLM(export_onnx(exports["llama-sink"], target), threads=1)
    assert abs(runtime.forward(IDS.numpy())[0] - export_logits(exports["llama-sink"]).numpy()).max() <= 1e-4
    assert sorted(p.name for p in target.iterdir()) == ["model.onnx", "model.onnx.data", "onnx_layout.json", "sink.npz"]


def test_onnx_export_into_a_folder_a_running_command_holds_is_refused(tmp_path):
    """``export_onnx`` into a live run's ``folded/`` wrote its graph there, where the run then put its own export:
    the folder held a mix of two models."""
    from hf_tapernorm.app.run_lock import RunLock
    from hf_tapernorm.integrations.onnx_runtime import export_onnx

    lock = RunLock(tmp_path / "run")
    lock.acquire()  # as a running taper holds its folder
    try:
        with pytest.raises(ConfigurationError, match="which a running hf-tapernorm command owns"):
            export_onnx(tmp_path / "no-export", tmp_path / "run" / "folded")
    finally:
        lock.release()
    assert not (tmp_path / "run").exists()


def test_onnx_export_into_a_mount_point_or_a_missing_folder_s_dotdot_is_one_line_before_loading(tmp_path, monkeypatch):
    """``export_onnx(export, "t/onx")`` with ``onx`` an empty mount point failed (EBUSY) only after the whole
    export, leaving ``.onx.partial-PID/`` and ``.onx.old-PID/``; ``t/nope/..`` is no folder. Both are refused
    before anything is read (the source does not even exist), nothing written."""
    from hf_tapernorm.integrations.onnx_runtime import export_onnx

    mount = tmp_path / "onx"
    mount.mkdir()
    real = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda path: Path(path) == mount or real(path))
    with pytest.raises(ConfigurationError) as error:
        export_onnx(tmp_path / "no-export", mount)
    assert str(error.value) == (
        f"cannot export ONNX into '{mount}': the folder is a mount point, which a write cannot replace by a rename; "
        f"name a folder inside it ('{mount / 'export'}')"
    )
    with pytest.raises(ConfigurationError) as error:
        export_onnx(tmp_path / "no-export", tmp_path / "nope" / "..")
    said = f"cannot export ONNX into '{tmp_path}/nope/..': '{tmp_path}/nope' does not exist"
    assert str(error.value).startswith(said)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["onx"] and list(mount.iterdir()) == []
