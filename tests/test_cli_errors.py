"""Arguments the CLI refuses before it loads, trains or writes anything: one line on stderr, exit status 2.

Each row is a command (a function of the workspace) with its exit status and a fragment of its one-line error;
a new early refusal is a new row. Every row also checks that the workspace is left as it was.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tests.conftest import build, corpus_documents, save_tiny_model, tiny_llama_config
from tests.helpers import run_main, taper_argv


def _reordered_tokenizer() -> PreTrainedTokenizerFast:
    """The character tokenizer of conftest.py (128 tokens) with its ids in the reverse order: the same size, other
    text for every id."""
    vocab = {chr(i): 127 - i for i in range(1, 127)}
    vocab.update({"<unk>": 0, "<eos>": 127})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="<unk>")


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cli_errors")
    save_tiny_model(root / "llama", "llama")
    (root / "corpus.txt").write_text("\n\n".join(corpus_documents(150)))
    (root / "texts").mkdir()
    for index in range(3):
        (root / "texts" / f"part{index}.txt").write_text("\n\n".join(corpus_documents(60, seed=index)))
    build(tiny_llama_config(), seed=1).save_pretrained(root / "other_tokenizer")
    _reordered_tokenizer().save_pretrained(root / "other_tokenizer")
    return root


def _eval(ws: Path, *extra: str) -> list[str]:
    return [
        "eval", "--model_name_or_path", str(ws / "llama"), "--dataset_name", str(ws / "corpus.txt"),
        "--block_size", "32", "--heldout_blocks", "4", "--heldout_percentage", "10", "--out_of_corpus_blocks", "0",
        "--scan_windows", "2", *extra,
    ]  # fmt: skip


def _bench(ws: Path, *extra: str) -> list[str]:
    return [
        "bench", "--model_name_or_path", str(ws / "llama"), "--modes", "last", "--variants", "original",
        "--seq_lens", "16", "--repeats", "1", "--warmup", "0", "--calibration_batches", "1", "--op_counts", "false",
        "--output_dir", str(ws / "bench"), *extra,
    ]  # fmt: skip


#: name -> (the command's arguments, a function of the workspace; its exit status; a fragment of its error line)
CASES = {
    "bench: a compile backend torch does not know": (
        lambda ws: _bench(ws, "--execution", "compile", "--compile_backend", "bogus"),
        2,
        "--compile_backend 'bogus' is not a torch.compile backend torch knows: ",
    ),
    "taper: long steps that come after the last step": (
        lambda ws: taper_argv(ws, ws / "out", "--long_block_size", "64", "--long_block_every", "100"),
        2,
        "the first long step is step 100, and this run has 10 (--max_steps), so no step would read long blocks; "
        "a long step needs --max_steps 100 or more",
    ),
    "taper: the output folder inside the dataset folder": (
        lambda ws: [*taper_argv(ws, ws / "texts" / "run"), "--dataset_name", str(ws / "texts")],
        2,
        "lies inside --dataset_name '{ws}/texts', which the run reads",
    ),
    "taper: the output folder inside the model folder": (
        lambda ws: taper_argv(ws, ws / "llama" / "run"),
        2,
        "--output_dir '{ws}/llama/run' lies inside --model_name_or_path '{ws}/llama'",
    ),
    "eval: a scan reference with another tokenizer of the same size": (
        lambda ws: _eval(ws, "--scan_reference", str(ws / "other_tokenizer")),
        2,
        "has another tokenizer than '{ws}/llama' (126 of 128 token ids are other text)",
    ),
}


def _files(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*")}


@pytest.mark.parametrize("name", list(CASES))
def test_a_refused_command_stops_with_one_line_and_writes_nothing(ws, name):
    make_argv, code, fragment = CASES[name]
    before = _files(ws)
    status, _, stderr = run_main(make_argv(ws))
    first = next((line for line in stderr.splitlines() if line.startswith("hf-tapernorm ")), stderr[-2000:])
    assert status == code, stderr[-2000:]
    assert first.startswith(f"hf-tapernorm {make_argv(ws)[0]}: error: "), first
    assert fragment.format(ws=ws) in first, first
    assert _files(ws) == before
