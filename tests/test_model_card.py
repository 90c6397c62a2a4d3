"""Model cards of folded models: Hub metadata, run facts, what was folded, how to load."""

from __future__ import annotations

import decimal
import enum

import numpy
import pytest
import torch
from huggingface_hub import ModelCard

from hf_tapernorm import fold_model
from hf_tapernorm.export import render_model_card
from tests.helpers import tapered

FACTS = {
    "base_model": "HuggingFaceTB/SmolLM2-135M",
    "license": "apache-2.0",
    "repo_id": "me/smollm2-135m-normfree",
    "dataset": "Python standard library source",
    "tokens": 1234567,
    "schedule": {"total steps": 300, "taper start (step)": 25, "taper end (step)": 100},
    "eval_loss": {"base": 3.0126, "tapered (g = 0)": 3.0584, "folded": 3.0585},
    "speed": {"last-token logits, bf16, batch 1": "1.12x"},
    "tags": ["smollm2"],
}


@pytest.fixture(scope="module")
def internal():
    return fold_model(tapered("llama", "internal"))


def test_card_metadata_is_what_the_hub_reads(internal):
    card = ModelCard(render_model_card(internal, FACTS))
    data = card.data.to_dict()
    assert data == {
        "base_model": "HuggingFaceTB/SmolLM2-135M",
        "library_name": "transformers",
        "license": "apache-2.0",
        "pipeline_tag": "text-generation",
        "tags": ["hf_tapernorm", "tapernorm", "norm-free", "llama", "smollm2"],
    }
    assert card.text.startswith("\n# smollm2-135m-normfree\n")


def test_card_body_carries_the_run_facts_and_both_ways_to_load(internal):
    text = render_model_card(internal, FACTS)
    for line in (
        "| Base architecture | `llama` (exported as `tapernorm_llama`) |",
        "| Norms folded away | 4 (e.g. `model.layers.0.input_layernorm`) |",
        "| Norms kept | 1 (e.g. `model.norm`) |",
        "| Final norm | kept as a real norm (Internal-Taper), its weight folded into `lm_head` (the head was untied "
        "from the embeddings) |",
        "| Readout | through the final norm: each token's logits depend on its scale (attributions need that scale "
        "frozen) |",
        "| Projections that gained a bias | none |",
        "| Training data | Python standard library source |",
        "| Training tokens | 1,234,567 |",
        "| taper start (step) | 25 |",
        "| base | 3.0126 |",
        "| tapered (g = 0) | 3.0584 |",
        "| folded | 3.0585 |",
        "| last-token logits, bf16, batch 1 | 1.12x |",
        'model = AutoModelForCausalLM.from_pretrained("me/smollm2-135m-normfree")',
        'model = AutoModelForCausalLM.from_pretrained("me/smollm2-135m-normfree", trust_remote_code=True)',
        'The tokenizer is the base model\'s: `AutoTokenizer.from_pretrained("HuggingFaceTB/SmolLM2-135M")`.',
    ):
        assert line in text, line
    report = internal.fold_report
    assert f"by at most {report.max_abs_diff:.3g} (absolute)" in text
    assert "\n\n\n" not in text


def test_card_without_facts_omits_unknown_sections(internal):
    text = render_model_card(internal)
    assert "## Evaluation" not in text and "## Speed" not in text and "## Tapering run" not in text
    assert "## Fold check" in text and "## How to load" in text
    assert "base_model:" not in text and "license:" not in text  # unknown: not guessed
    assert internal.model_card == text  # fold_model attaches the default card


def test_card_describes_a_folded_final_norm_and_the_tied_head_choice():
    untied = fold_model(tapered("gpt2", "all"))
    text = render_model_card(untied, {"base_model": "openai-community/gpt2", "license": "mit"})
    assert (
        "| Final norm | tapered and folded into `lm_head` (the head was untied from the embeddings: "
        "`tie_word_embeddings=False`) |" in text
    )
    assert "| Projections that gained a bias | `lm_head` |" in text
    scaled = fold_model(tapered("gpt2", "all"), tied_head="scale")
    assert (
        "| Final norm | tapered; kept as one explicit per-channel scale so the tied embeddings survive |"
        in render_model_card(scaled)
    )


def test_local_base_model_is_not_claimed_as_a_hub_id(internal, tmp_path):
    text = render_model_card(internal, {"base_model": str(tmp_path)})
    assert "base_model:" not in text
    assert "A **norm-free** version of a `llama` model" in text


def test_unknown_fact_is_an_error(internal):
    with pytest.raises(ValueError, match=r"unknown model card facts: eval_losses; expected some of base_model, "):
        render_model_card(internal, {"eval_losses": {}})


class _License(str, enum.Enum):
    MIT = "mit"


def test_text_facts_of_a_str_subclass_are_written_as_the_text_they_hold(internal):
    """``facts={"license": np.str_("mit")}``, a ``str, Enum`` member as the license, or tags of np.str_ passed the
    facts' check (each is a str), but the card's YAML wrote them as ``!!python/object/apply`` tags, and its re-parse
    raised yaml's ConstructorError. Each text fact and tag is read as the plain str it holds now (base_model already
    was), so the card reads back as that text."""
    facts = {
        "base_model": _License.MIT,
        "license": numpy.str_("mit"),
        "tags": [numpy.str_("smollm2"), _License.MIT],
        "dataset": numpy.str_("org/data"),
        "model_name": _License.MIT,
    }
    text = render_model_card(internal, facts)
    assert "!!python" not in text
    data = ModelCard(text).data.to_dict()
    assert data["license"] == "mit" and type(data["license"]) is str
    assert data["tags"] == ["hf_tapernorm", "tapernorm", "norm-free", "llama", "smollm2", "mit"]
    assert text.startswith("---\n") and "\n# mit\n" in text and "| Training data | org/data |" in text
    assert render_model_card(internal, {"license": _License.MIT}) == render_model_card(internal, {"license": "mit"})


def test_eval_loss_and_speed_show_numbers_of_any_kind_as_numbers(internal):
    """``facts={"eval_loss": {"heldout": torch.tensor(2.5)}}`` showed ``| heldout | tensor(2.5000) |`` in the card.
    A one-element tensor or array and a numpy number are shown as the number they hold now (a float32 as the shortest
    text of its own precision; a float8 one, which numpy lacks, and a Decimal too); texts ("1.12x") stay as they
    are."""
    facts = {
        "eval_loss": {
            "tensor": torch.tensor(2.5),
            "float32 tensor": torch.tensor([3.0584]),
            "bf16 tensor": torch.tensor(3.0625, dtype=torch.bfloat16),
            "float32": numpy.float32(3.0584),
            "array": numpy.array([[2.25]]),
            "int64": numpy.int64(3),
            "float8 tensor": torch.tensor(2.5).to(torch.float8_e4m3fn),  # no numpy dtype: a TypeError at render
            "decimal": decimal.Decimal("2.75"),  # a number numbers.Real does not count
        },
        "speed": {"folded / base": "1.12x", "numpy text": numpy.str_("2x"), "ratio": 1.5},
        "tokens": numpy.int64(1234567),
    }
    text = render_model_card(internal, facts)
    for line in (
        "| tensor | 2.5 |",
        "| float32 tensor | 3.0584 |",
        "| bf16 tensor | 3.0625 |",
        "| float32 | 3.0584 |",
        "| array | 2.25 |",
        "| int64 | 3 |",
        "| float8 tensor | 2.5 |",
        "| decimal | 2.75 |",
        "| folded / base | 1.12x |",
        "| numpy text | 2x |",
        "| ratio | 1.5 |",
        "| Training tokens | 1,234,567 |",
    ):
        assert line in text, line
    assert "tensor(" not in text and "array(" not in text


def test_the_cards_no_import_example_loads_model_and_tokenizer_without_a_prompt(tmp_path):
    """The card's "Without it" example loaded the model only with trust_remote_code=True; AutoTokenizer of the
    export in such a process (it reads config.json's auto_map) asked transformers' "run the custom code?" prompt.
    The example now passes it to the tokenizer too, and runs as written in a fresh process, stdin closed."""
    import os
    import subprocess
    import sys

    from hf_tapernorm import export_folded
    from tests.helpers import word_tokenizer

    folder, folded = tmp_path / "out", fold_model(tapered("llama"))
    export_folded(folded, folder, tokenizer=word_tokenizer(True), facts={"repo_id": str(folder)})
    card = (folder / "README.md").read_text()
    example = card.split("Without it, ", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert "AutoTokenizer.from_pretrained" in example
    code = f"{example}print(type(model).__name__, type(tokenizer).__name__)\n"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                          stdin=subprocess.DEVNULL, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "custom code" not in done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1] == f"{type(folded).__name__} TokenizersBackend"
