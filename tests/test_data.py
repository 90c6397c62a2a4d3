"""Data: local formats, streaming, packing, the hash split, the embedded corpus, what a document is (a byte order
mark, CRLF, NUL bytes, hidden copies in a folder), and its errors."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import datasets
import pytest
import torch

from hf_tapernorm.app.data_checks import check_hub_dataset
from hf_tapernorm.data.corpus import blocks_tensor, is_heldout, pack_documents, prepare_data
from hf_tapernorm.data.sources import (
    EMBEDDED_CORPUS,
    DataError,
    embedded_corpus,
    embedded_corpus_files,
    load_text_dataset,
    stdlib_directory,
)
from tests.conftest import char_tokenizer, corpus_documents
from tests.helpers import cached_hub_dataset, error_of, hub_offline, one_model_workspace, run_main, taper_argv


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


def _write(folder: Path, fmt: str, docs: list[str]) -> Path:
    path = folder / f"corpus.{fmt}"
    if fmt == "txt":
        path.write_text("\n\n".join(docs))  # one document per paragraph
    elif fmt == "jsonl":
        path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    elif fmt == "json":
        path.write_text(json.dumps([{"text": d, "id": i} for i, d in enumerate(docs)]))
    elif fmt in ("parquet", "csv"):
        table = datasets.Dataset.from_dict({"id": list(range(len(docs))), "text": docs})
        table.to_parquet(str(path)) if fmt == "parquet" else table.to_csv(str(path), index=False)
    return path


def _prepare(dataset, tokenizer, **kwargs):
    options = dict(block_size=32, train_blocks=None, heldout_blocks=4, heldout_percentage=20.0)
    options.update(kwargs)
    return prepare_data(dataset, tokenizer, **options)


@pytest.mark.parametrize("fmt", ["txt", "json", "jsonl", "parquet", "csv"])
def test_every_local_format_gives_the_same_blocks(tmp_path, tokenizer, fmt):
    docs = corpus_documents(60)
    reference = _prepare(datasets.Dataset.from_dict({"text": docs}), tokenizer)
    dataset = load_text_dataset(str(_write(tmp_path, fmt, docs)), cache_dir=str(tmp_path / "cache"))
    packed = _prepare(dataset, tokenizer)
    assert packed.text_column == "text"
    assert torch.equal(blocks_tensor(packed.train), blocks_tensor(reference.train))
    assert torch.equal(blocks_tensor(packed.heldout), blocks_tensor(reference.heldout))
    assert len(packed.train) > 10 and len(packed.heldout) == 4


def test_folder_and_streaming_match_the_single_file(tmp_path, tokenizer):
    docs = corpus_documents(60)
    (tmp_path / "shards").mkdir()
    _write(tmp_path / "shards", "jsonl", docs)
    reference = _prepare(datasets.Dataset.from_dict({"text": docs}), tokenizer)
    for streaming in (False, True):
        dataset = load_text_dataset(str(tmp_path / "shards"), streaming=streaming, cache_dir=str(tmp_path / "c"))
        assert isinstance(dataset, datasets.IterableDataset) == streaming
        packed = _prepare(dataset, tokenizer)
        assert torch.equal(blocks_tensor(packed.train), blocks_tensor(reference.train))
        assert torch.equal(blocks_tensor(packed.heldout), blocks_tensor(reference.heldout))


def test_packing_concatenates_documents_with_eos_and_drops_the_tail(tokenizer):
    docs = ["abc", "defgh", "ij"]
    blocks = pack_documents(docs, tokenizer, 4)
    eos = tokenizer.eos_token_id
    stream = [ord(ch) for ch in "abc"] + [eos] + [ord(ch) for ch in "defgh"] + [eos] + [ord(ch) for ch in "ij"] + [eos]
    assert blocks == [stream[0:4], stream[4:8], stream[8:12]]
    assert pack_documents(docs + ["klm"], tokenizer, 4, max_blocks=2) == [stream[0:4], stream[4:8]]
    assert pack_documents(["abcdef"], tokenizer, 4) == [[ord(c) for c in "abcd"]]  # 7 ids: a block + a dropped tail
    packed = _prepare(datasets.Dataset.from_dict({"text": corpus_documents(60)}), tokenizer)
    row = packed.train[0]
    assert torch.equal(row["input_ids"], row["labels"]) and row["input_ids"].shape == (32,)


def test_sink_prefix_starts_every_block_and_its_prediction_is_no_target(tokenizer):
    docs = ["abc", "defgh", "ij"]
    eos = tokenizer.eos_token_id
    stream = [ord(ch) for ch in "abc"] + [eos] + [ord(ch) for ch in "defgh"] + [eos] + [ord(ch) for ch in "ij"] + [eos]
    expected = [[1] + stream[0:3], [1] + stream[3:6], [1] + stream[6:9], [1] + stream[9:12]]
    assert pack_documents(docs, tokenizer, 4, prefix_ids=[1]) == expected
    with pytest.raises(DataError, match="block_size must be at least 4 tokens"):
        pack_documents(docs, tokenizer, 3, prefix_ids=[1, 2])
    packed = _prepare(datasets.Dataset.from_dict({"text": corpus_documents(60)}), tokenizer, prefix_ids=[1])
    assert packed.prefix_ids == [1]
    for split in (packed.train, packed.heldout):
        row = split[0]
        assert row["input_ids"][0] == 1 and row["labels"][1] == -100
        assert torch.equal(row["labels"][2:], row["input_ids"][2:]) and row["labels"][0] == 1


def test_split_is_by_document_hash_disjoint_and_order_independent(tokenizer):
    docs = corpus_documents(400)
    held = {d for d in docs if is_heldout(d, 10.0)}
    assert 20 <= len(held) <= 60  # about 10% of 400
    assert held == {d for d in docs if is_heldout(d, 10.0)}  # deterministic
    shuffled = docs[:]
    random.Random(3).shuffle(shuffled)
    assert held == {d for d in shuffled if is_heldout(d, 10.0)}
    packed = _prepare(
        datasets.Dataset.from_dict({"text": docs}), tokenizer, heldout_percentage=10.0, heldout_blocks=1000
    )
    heldout_text = "".join(chr(i) if i != 127 else "\n" for i in blocks_tensor(packed.heldout).flatten().tolist())
    train_text = "".join(chr(i) if i != 127 else "\n" for i in blocks_tensor(packed.train).flatten().tolist())
    inside = [d for d in docs if d[:48] in heldout_text]  # held-out documents may be cut after two blocks
    assert len(inside) >= 10 and all(d in held for d in inside)
    assert not any(d in train_text for d in held if len(d) > 64)


def test_heldout_blocks_are_drawn_from_every_part_of_the_heldout_documents(tokenizer):
    from hf_tapernorm.data.heldout import STREAM_WINDOWS_PER_BLOCK

    rng = random.Random(0)
    docs = ["".join(chr(rng.randrange(33, 123)) for _ in range(300)) for _ in range(200)]  # unique windows
    packed = _prepare(datasets.Dataset.from_dict({"text": docs}), tokenizer, heldout_percentage=20.0, heldout_blocks=16)
    held_indices = [i for i, d in enumerate(docs) if is_heldout(d, 20.0)]
    stream, owners = [], []
    for i in held_indices:  # the stream the draw reads: documents + EOS, up to the reading limit
        stream += [ord(c) for c in docs[i]] + [tokenizer.eos_token_id]
        owners += [i] * 301
        if len(stream) >= STREAM_WINDOWS_PER_BLOCK * 16 * 32:
            break
    blocks = blocks_tensor(packed.heldout)
    assert blocks.shape == (16, 32)
    # Each block is one window of the concatenated held-out stream, at a multiple of the block size.
    windows = {tuple(stream[i : i + 32]): i for i in range(0, len(stream) - 31, 32)}
    starts = [windows[tuple(row)] for row in blocks.tolist()]
    assert starts == sorted(set(starts))
    assert max(starts) > len(stream) // 2  # not only the first documents
    assert len({start % 301 for start in starts}) > 8  # from many positions inside the documents, not their starts
    first_documents = [owners[start] for start in starts]
    assert len(set(first_documents)) == 16  # round-robin: 16 blocks from 16 documents, not a long one's windows
    # The document of every target token is recorded (the report's per-document table reads it).
    evaluation = packed.heldout_set
    assert evaluation.blocks.tolist() == blocks.tolist() and evaluation.target_documents.shape == (16, 31)
    for row, start in enumerate(starts):
        names = [evaluation.documents[int(k)] for k in evaluation.target_documents[row]]
        assert names == [f"document {owners[start + j]}" for j in range(1, 32)]


def test_heldout_draw_is_balanced_over_documents_of_any_length(tokenizer):
    from hf_tapernorm.data.heldout import sample_blocks

    rng = random.Random(1)
    long_document = "".join(chr(rng.randrange(33, 123)) for _ in range(64 * 40))  # 80 windows of 32
    short = ["".join(chr(rng.randrange(33, 123)) for _ in range(64 * 3)) for _ in range(4)]  # 6 windows each
    documents = [("long", long_document)] + [(f"short {i}", text) for i, text in enumerate(short)]
    evaluation = sample_blocks(documents, tokenizer, block_size=32, count=20, seed=0)
    counts = torch.bincount(evaluation.target_documents[:, 0], minlength=5).tolist()
    assert counts[0] <= 5 and sum(counts) == 20  # a uniform draw would give the long document about 16 of 20
    assert min(counts[1:]) >= 3


def test_heldout_draw_depends_on_its_seed_only(tokenizer):
    dataset = datasets.Dataset.from_dict({"text": corpus_documents(120)})
    first = _prepare(dataset, tokenizer, heldout_blocks=6, train_blocks=3)
    again = _prepare(dataset, tokenizer, heldout_blocks=6, train_blocks=9)
    other = _prepare(dataset, tokenizer, heldout_blocks=6, train_blocks=3, heldout_seed=1)
    assert torch.equal(blocks_tensor(first.heldout), blocks_tensor(again.heldout))
    assert not torch.equal(blocks_tensor(first.heldout), blocks_tensor(other.heldout))


def test_out_of_corpus_default_is_the_python_documentation_and_never_in_the_corpus(tokenizer):
    from types import SimpleNamespace

    from hf_tapernorm.data.heldout import PYTHON_DOCS
    from hf_tapernorm.data.out_of_corpus import out_of_corpus_set

    data = SimpleNamespace(
        out_of_corpus_blocks=8,
        out_of_corpus_dataset=PYTHON_DOCS,
        block_size=256,
        heldout_seed=0,
        sample_by="paragraph",
        data_cache_dir=None,
    )
    evaluation = out_of_corpus_set(data, tokenizer, [1])
    assert evaluation.blocks.shape == (8, 256) and bool((evaluation.blocks[:, 0] == 1).all())
    text = "".join(chr(i) for i in evaluation.blocks[:, 1:].flatten().tolist() if i > 1)
    assert sum(text.count(word) for word in (" the ", " is ", " of ")) > 15  # English prose
    assert all(name.startswith("pydoc_data.topics:") for name in evaluation.documents)
    assert not any("pydoc_data" in f.parts for f in embedded_corpus_files())
    assert out_of_corpus_set(SimpleNamespace(**{**vars(data), "out_of_corpus_blocks": 0}), tokenizer, [1]) is None


def test_embedded_corpus_is_the_standard_library_in_a_fixed_shuffled_order(tokenizer):
    files = embedded_corpus_files()
    root = stdlib_directory()
    names = [f.relative_to(root).as_posix() for f in files]
    assert names == sorted(names) and len(names) > 300
    assert "os.py" in names and "json/decoder.py" in names
    assert not any(part in ("site-packages", "test", "tests") for n in names for part in n.split("/")[:-1])
    corpus = embedded_corpus()
    assert sorted(corpus["path"][:]) == names and corpus["path"][:] != names  # every file, not alphabetically
    assert corpus["path"][:] == embedded_corpus()["path"][:]  # the same order every time
    first = corpus["path"][:40]
    assert len({name.split("/")[0][:1].lower() for name in first}) > 8  # spread over the alphabet
    assert corpus[corpus["path"][:].index("os.py")]["text"] == (root / "os.py").read_text(encoding="utf-8")
    assert load_text_dataset(None)["path"][:5] == load_text_dataset(EMBEDDED_CORPUS)["path"][:5]
    first = _prepare(corpus, tokenizer, block_size=64, train_blocks=8, heldout_blocks=4, heldout_percentage=5.0)
    second = _prepare(
        embedded_corpus(), tokenizer, block_size=64, train_blocks=8, heldout_blocks=4, heldout_percentage=5.0
    )
    assert len(first.train) == 8 and len(first.heldout) == 4
    assert torch.equal(blocks_tensor(first.heldout), blocks_tensor(second.heldout))
    assert torch.equal(blocks_tensor(first.train), blocks_tensor(second.train))


def test_text_column_detection(tmp_path, tokenizer):
    docs = corpus_documents(60)
    only = datasets.Dataset.from_dict({"body": docs, "n": list(range(60))})
    assert _prepare(only, tokenizer).text_column == "body"
    two = datasets.Dataset.from_dict({"a": docs, "b": docs})
    with pytest.raises(
        DataError, match=r"cannot tell which column holds the text \(columns: a, b\); pass --text_column"
    ):
        _prepare(two, tokenizer)
    assert _prepare(two, tokenizer, text_column="b").text_column == "b"
    with pytest.raises(DataError, match="--text_column c: the dataset has no column 'c'; its columns: a, b"):
        _prepare(two, tokenizer, text_column="c")


def test_errors_name_the_dataset_and_the_fix(tmp_path, tokenizer):
    with pytest.raises(DataError, match=r"dataset '.*missing\.jsonl' not found: no such file or folder"):
        load_text_dataset(str(tmp_path / "missing.jsonl"))
    (tmp_path / "notes.docx").write_text("x")
    with pytest.raises(DataError, match=r"unsupported file type '\.docx'"):
        load_text_dataset(str(tmp_path / "notes.docx"))
    (tmp_path / "broken.jsonl").write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(DataError, match=r"could not load dataset '.*broken\.jsonl' as a local file or folder"):
        load_text_dataset(str(tmp_path / "broken.jsonl"), cache_dir=str(tmp_path / "c"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"dataset '.*empty' is a folder that holds no .csv/.json/"):
        load_text_dataset(str(tmp_path / "empty"))
    tiny = datasets.Dataset.from_dict({"text": corpus_documents(60)[:3]})
    with pytest.raises(
        DataError, match=r"is too small: its (training|held-out) split .* does not fill one block of 4096 tokens"
    ):
        _prepare(tiny, tokenizer, block_size=4096)


def test_the_early_check_refuses_a_local_path_as_the_loader_does(tmp_path):
    """The check every command makes before it loads a model asked only whether a local path exists; an empty
    folder, a folder of other files (or of hidden copies alone), a file of an unsupported suffix, a folder mixing
    file types were refused by the loader minutes later. Both now ask sources.local_data_files: the same refusals,
    the check's naming the option."""
    from hf_tapernorm.app.data_checks import check_dataset_path
    from hf_tapernorm.data.sources import local_data_files

    for folder, files in {
        "emptydir": [],
        "bindir": ["blob.dat"],
        "hidden": [".ipynb_checkpoints/a.txt"],
        "mixed": ["a.txt", "sub/b.jsonl"],
    }.items():
        for name in files:
            (tmp_path / folder / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / folder / name).write_text('{"text": "some text"}\n')
        (tmp_path / folder).mkdir(exist_ok=True)
    (tmp_path / "corpus.weird").write_text("some text\n")
    for name in ["emptydir", "bindir", "hidden", "mixed", "corpus.weird", "missing.txt"]:
        path = str(tmp_path / name)
        with pytest.raises(DataError) as loaded:
            load_text_dataset(path, cache_dir=str(tmp_path / "cache"))
        with pytest.raises(DataError) as checked:
            check_dataset_path("--out_of_corpus_dataset", path)
        assert str(loaded.value).startswith(f"dataset '{path}'")
        assert str(checked.value) == str(loaded.value).replace("dataset", "--out_of_corpus_dataset", 1)
    (tmp_path / "good" / ".git").mkdir(parents=True)
    (tmp_path / "good" / ".git" / "x.txt").write_text("tool state")
    (tmp_path / "good" / "b.txt").write_text("b")
    (tmp_path / "good" / "a.md").write_text("a")
    check_dataset_path("--dataset_name", str(tmp_path / "good"))
    assert local_data_files(str(tmp_path / "good")) == (
        "text",
        [tmp_path / "good" / "a.md", tmp_path / "good" / "b.txt"],
    )
    assert local_data_files(None) is None and local_data_files("someone/hub-dataset") is None


# ============================================================================= Hub datasets, resolved first
@pytest.fixture
def hub(tmp_path, monkeypatch):
    """Offline, in a workspace (the working folder) with a tiny model, a corpus, a folder ``texts/`` of it, a user's
    notes, and a datasets cache ``hubcache/`` holding the Hub dataset ``me/one`` (the corpus's paragraphs). An eval
    of it loads no model: a refusal must come first."""
    import hf_tapernorm.cli.commands as commands

    ws = one_model_workspace(tmp_path)
    (ws / "texts").mkdir()
    (ws / "texts" / "corpus.txt").write_text((ws / "corpus.txt").read_text())
    (ws / "todo.txt").write_text("a user's notes, no corpus")
    cached_hub_dataset(ws / "hubcache", ws / "corpus.txt")
    monkeypatch.chdir(ws)
    monkeypatch.setattr(commands, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with hub_offline():
        yield ws


def _eval(*flags: str) -> list[str]:
    return ["eval", "--model_name_or_path", "llama", "--scan_windows", "0", "--out_of_corpus_blocks", "0", *flags]


def test_a_hub_name_that_does_not_resolve_is_refused_before_the_model_loads(hub):
    """`eval --dataset_name texts/corpuz` (a mistyped local folder, offline) loaded the model, then failed with
    "could not load dataset ... as a Hub dataset": the name is now resolved first, as the loading resolves it
    (sources.hub_dataset_builder), and the error names the local folder it starts with."""
    with pytest.raises(DataError) as refused:
        check_hub_dataset("--dataset_name", "texts/sub/corpuz", cache_dir="hubcache")
    assert str(refused.value).startswith(
        "--dataset_name: could not load dataset 'texts/sub/corpuz' as a Hub dataset (offline or missing?) ('texts' "
        "is a local folder, but it holds no 'sub/corpuz': a local path is read as one when it exists or starts with "
        "./): "
    )
    with pytest.raises(DataError, match=r"'nobody/no-such-dataset' as a Hub dataset \(offline or missing\?\): \w"):
        check_hub_dataset("--dataset_name", "nobody/no-such-dataset", cache_dir="hubcache")
    assert "'texts' is a local folder, but it holds no 'corpuz'" in error_of(_eval("--dataset_name", "texts/corpuz"))
    check_hub_dataset("--dataset_name", "texts/corpus.txt")  # the local path itself: the loader's to read


@pytest.mark.parametrize("name", ["text", "json", "csv"])
def test_a_file_loader_s_name_is_no_dataset(hub, name):
    """`--dataset_name text` resolved to datasets' own text loader, which, given no files, read every text file under
    the working folder (a user's notes) and trained or scored on them under the name "text"."""
    message = f"dataset '{name}' is the name of a datasets file loader, not of a Hub dataset: with no files named"
    assert message in error_of(_eval("--dataset_name", name))
    with pytest.raises(DataError, match=message):
        load_text_dataset(name)


def test_an_empty_dataset_name_is_refused_not_read_as_the_working_folder(hub, tmp_path):
    """`--dataset_name ''` was the folder `.`: the working folder's text files were read (taper trained on a user's
    notes) while the report and card said python-stdlib."""
    empty = "'': an empty path names no file or folder (it would be the working folder); name one, or leave the option"
    assert f"--dataset_name {empty}" in error_of(_eval("--dataset_name", ""))  # as every path option (test_cli_errors)
    out_of_corpus = _eval("--dataset_name", "corpus.txt", "--out_of_corpus_blocks", "2", "--out_of_corpus_dataset", "")
    assert f"--out_of_corpus_dataset {empty}" in error_of(out_of_corpus)
    options = tmp_path / "run.json"
    values = {"model_name_or_path": "llama", "dataset_name": "", "output_dir": str(tmp_path / "run"), "use_cpu": True}
    options.write_text(json.dumps(values))
    assert f"--dataset_name {empty}" in error_of(["taper", str(options)])
    assert not (tmp_path / "run").exists()
    empty = "an empty name names no file, folder or Hub dataset; leave the option out for the embedded corpus"
    with pytest.raises(DataError, match=empty):
        load_text_dataset("")


def test_a_cached_hub_dataset_reads_its_split_and_a_missing_split_is_refused_first(hub, tmp_path):
    """`eval --dataset_split validation` was refused only after the model loaded, its message blaming an offline or
    missing dataset; a local file, whose one split is train, the same."""
    expected = load_text_dataset("corpus.txt", cache_dir=str(tmp_path / "c"))["text"]
    assert load_text_dataset("me/one", cache_dir="hubcache")["text"] == expected
    assert [row["text"] for row in load_text_dataset("me/one", cache_dir="hubcache", streaming=True)] == expected
    assert load_text_dataset("me/one", split="train[:3]", cache_dir="hubcache")["text"] == expected[:3]
    message = error_of(_eval("--dataset_name", "me/one", "--data_cache_dir", "hubcache", "--dataset_split", "test"))
    assert message.endswith("--dataset_name: dataset 'me/one' has no split 'test': its splits are train")
    message = error_of(_eval("--dataset_name", "corpus.txt", "--dataset_split", "validation"))
    assert message.endswith(
        "--dataset_name 'corpus.txt' is a local file, whose one split is train, not 'validation': name that split's "
        "file as the dataset (slices such as train[:50%] read part of train)"
    )


def test_a_split_the_loading_would_not_read_as_written_is_refused_first(hub):
    """The embedded corpus ignored --dataset_split (validation, train[:1%] and a split no dataset has read the whole
    corpus), and a slice of a streamed dataset was refused only after the model loaded."""
    for split in ("validation", "train[:1%]"):
        assert error_of(_eval("--dataset_split", split)).endswith(
            f"--dataset_split {split}: the embedded corpus is read whole, as one split (train), not '{split}'"
        )
        with pytest.raises(DataError, match="the embedded corpus is read whole"):
            load_text_dataset(None, split=split)
    for name in ("corpus.txt", "me/one"):
        message = error_of(_eval("--dataset_name", name, "--data_cache_dir", "hubcache", "--streaming",
                                 "--dataset_split", "train[:50%]"))  # fmt: skip
        assert message.endswith(
            "--dataset_split train[:50%]: a streamed dataset is read whole, split by split: drop the slice of "
            "'train[:50%]' or --streaming"
        )


def test_what_the_loading_would_ignore_or_refuse_late_is_refused_first(hub):
    """--dataset_split ' train' or 'train[', --text_column nosuch (a text file's, a Hub dataset's), and
    --dataset_config_name for a local file or the embedded corpus: refused after the model loaded, or ignored."""
    for split in (" train", "train[", "train[:10%"):
        assert error_of(_eval("--dataset_name", "corpus.txt", "--dataset_split", split)).endswith(
            f"--dataset_split {split}: '{split}' is no split a dataset can be read by: a split's name (train, "
            "validation), a slice of it (train[:10%], train[100:200]), or several joined by + (no spaces)"
        )
    assert error_of(_eval("--dataset_name", "corpus.txt", "--text_column", "body")).endswith(
        "--text_column body: --dataset_name 'corpus.txt' has no column 'body'; its columns: text"
    )
    assert error_of(
        _eval("--dataset_name", "me/one", "--data_cache_dir", "hubcache", "--text_column", "body")
    ).endswith("--text_column body: --dataset_name 'me/one' has no column 'body'; its columns: text")
    for data in (["--dataset_name", "corpus.txt"], []):
        what = "the local dataset 'corpus.txt'" if data else "the embedded corpus"
        assert error_of(_eval(*data, "--dataset_config_name", "cfg2")).endswith(
            f"--dataset_config_name cfg2: a configuration is one of a Hub dataset's; {what} has none (leave the "
            "option out)"
        )


def test_a_refused_taper_writes_nothing_into_the_cache_it_names(hub, tmp_path):
    """A taper refused for the user's files in its --output_dir had already resolved the Hub name, writing a lock
    file into --data_cache_dir OUT/cache: the resolution now comes after every check that writes nothing."""
    out = tmp_path / "out"
    (out / "cache").mkdir(parents=True)
    (out / "notes.txt").write_text("the user's")
    before = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    argv = taper_argv(hub, out, "--dataset_name", "me/one", "--data_cache_dir", str(out / "cache"))
    assert "holds files hf-tapernorm did not write" in error_of(argv)
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == before


def test_a_slice_that_selects_no_row_is_refused_before_the_model_loads(hub, tmp_path):
    """`--dataset_split 'train[:0%]'` (or train[3:3], train[5:2]) parsed, and eval loaded the model before the loading
    found no row ("corresponds to no data", or none read at all); a slice past a Hub split's recorded rows the same.
    An end of 0 counts from the split's start whatever its start's sign: train[-5:0] and train[:-0] were let through
    on a local file, and eval failed after the model loaded, calling the file too small."""
    splits = ("train[:0%]", "train[3:3]", "train[5:2]", "train[-2:-5]", "train[:0]+train[9:9]", "train[-5:0]")
    for split in (*splits, "train[:-0]", "train[-5%:0%]"):
        assert error_of(_eval("--dataset_name", "corpus.txt", "--dataset_split", split)).endswith(
            f"--dataset_split {split}: '{split}' selects no row: a slice [start:end] reads the rows from start up to "
            "end (a negative one counts from the split's end; an end of 0 is its start), and this one ends where it "
            "starts or before; name one that ends after it starts (train[:10%], train[100:200]) or the split whole"
        )
    rows = len(load_text_dataset("me/one", cache_dir="hubcache"))
    for split in (f"train[{rows}:]", "train[-5:5]"):  # whether these select rows, only the split's size tells
        line = error_of(_eval("--dataset_name", "me/one", "--data_cache_dir", "hubcache", "--dataset_split", split))
        assert line == (
            f"hf-tapernorm eval: error: --dataset_name: dataset 'me/one': '{split}' selects no row of its splits "
            f"(rows: train {rows}); name a slice within them, or the split whole"
        )
    with pytest.raises(DataError, match="'train\\[-3:3\\]' selects no row of its splits"):
        load_text_dataset("me/one", split="train[-3:3]", cache_dir="hubcache")  # the loading asks the same
    whole = load_text_dataset("corpus.txt", cache_dir=str(tmp_path / "c"))["text"]
    for split, rows_read in (("train[-3:]", whole[-3:]), (f"train[-{len(whole)}:3]", whole[:3])):  # rows: read
        assert load_text_dataset("corpus.txt", split=split, cache_dir=str(tmp_path / "c"))["text"] == rows_read
    argv = taper_argv(hub, tmp_path / "out", "--dataset_split", "train[3:3]")  # taper asks the same check
    assert "--dataset_split train[3:3]: 'train[3:3]' selects no row" in error_of(argv)
    assert not (tmp_path / "out").exists()


def _tables(folder: Path, rows: list[dict]) -> list[str]:
    """``rows`` as a jsonl, a json (an array), a csv and a parquet file in ``folder``: their names."""
    import pandas as pd

    frame = pd.DataFrame(rows)
    (folder / "t.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "t.json").write_text(json.dumps(rows, indent=1))
    frame.to_csv(folder / "t.csv", index=False)
    frame.to_parquet(folder / "t.parquet")
    return ["t.jsonl", "t.json", "t.csv", "t.parquet"]


def test_the_text_column_is_chosen_before_the_model_loads_by_the_loading_s_own_rule(hub, tmp_path):
    """A Hub dataset or a local jsonl/json/csv/parquet without a `text` column and of several string columns was
    refused "cannot tell which column holds the text" only after eval loaded the model, and a local one's missing
    --text_column the same. The early check asks the loading's rule (columns.choose_text_column) of the columns known
    before the data is read, so the two agree: refused where the loading refuses, the same column where it reads."""
    from hf_tapernorm.app.data_checks import check_dataset_path, check_text_column
    from hf_tapernorm.data.corpus import text_column_of

    docs = corpus_documents(40)
    names = _tables(hub, [{"id": i, "body": d, "title": d[:12]} for i, d in enumerate(docs)])
    cannot = "cannot tell which column holds the text (columns: id, body, title); pass --text_column"
    cached_hub_dataset(hub / "hubcols", hub / "t.jsonl", repo="me/cols")
    for name in [*names, "me/cols"]:
        cache = ["--data_cache_dir", "hubcols" if name == "me/cols" else str(tmp_path / "c")]
        assert error_of(_eval("--dataset_name", name, *cache)).endswith(f"--dataset_name '{name}': {cannot}")
        with pytest.raises(DataError, match=r"^cannot tell which column holds the text \(columns: id, body, title\)"):
            text_column_of(load_text_dataset(name, cache_dir=cache[1]))  # the loading's words, its rule
        assert error_of(_eval("--dataset_name", name, *cache, "--text_column", "nosuch")).endswith(
            f"--text_column nosuch: --dataset_name '{name}' has no column 'nosuch'; its columns: id, body, title"
        )
    for name in names:  # a column named, or the only string column: accepted first, read so later
        check_text_column("--dataset_name", name, check_dataset_path("--dataset_name", name), "title")
        assert text_column_of(load_text_dataset(name, cache_dir=str(tmp_path / "c")), "title") == "title"
    (tmp_path / "one").mkdir()
    for name in _tables(tmp_path / "one", [{"id": i, "body": d} for i, d in enumerate(docs)]):
        path = str(tmp_path / "one" / name)
        check_text_column("--dataset_name", path, check_dataset_path("--dataset_name", path), None)
        assert text_column_of(load_text_dataset(path, cache_dir=str(tmp_path / "c"))) == "body"


def test_a_text_column_of_the_embedded_corpus_is_refused_before_the_model_loads(hub):
    """`eval --text_column content` on the embedded corpus (no --dataset_name) was refused after the model loaded; its
    text is its one column, so `text` (which fold's scan of a run on it passes, as the run recorded) is accepted."""
    from hf_tapernorm.app.data_checks import check_data_paths
    from hf_tapernorm.cli.arguments import DataArguments

    assert error_of(_eval("--text_column", "content")) == (
        "hf-tapernorm eval: error: --text_column content: the embedded corpus has no column 'content'; its columns: "
        "text"
    )
    check_data_paths(DataArguments(text_column="text", out_of_corpus_blocks=0))


def test_a_cloned_hub_dataset_folder_reads_as_its_tables_and_its_readme_as_the_card(tmp_path):
    """A `git clone` of a Hub dataset (README.md beside data/*.parquet) was refused as "a folder that mixes file types
    (parquet, text)": like datasets, which reads a dataset folder's root README.md as its card, the loading now leaves
    it out beside tables. In a folder of text files it is text as before; a folder of tables and text still mixes."""
    from hf_tapernorm.app.data_checks import check_dataset_path
    from hf_tapernorm.data.sources import local_data_files

    docs = corpus_documents(20)
    clone = tmp_path / "clone"
    (clone / "data").mkdir(parents=True)
    (clone / "README.md").write_text("---\nlicense: mit\n---\n# A dataset\n")
    (clone / ".gitattributes").write_text("*.parquet filter=lfs\n")
    datasets.Dataset.from_dict({"text": docs}).to_parquet(clone / "data" / "train-00000-of-00001.parquet")
    assert check_dataset_path("--dataset_name", str(clone)) == (
        "parquet",
        [clone / "data" / "train-00000-of-00001.parquet"],
    )
    assert load_text_dataset(str(clone), cache_dir=str(tmp_path / "c"))["text"] == docs
    notes = tmp_path / "notes"
    (notes / "sub").mkdir(parents=True)
    for name in ("README.md", "a.md", "sub/README.md"):
        (notes / name).write_text(f"{name}\n")
    assert local_data_files(str(notes)) == ("text", [notes / "README.md", notes / "a.md", notes / "sub" / "README.md"])
    (clone / "notes.txt").write_text("a user's notes\n")
    with pytest.raises(DataError, match=r"is a folder that mixes file types \(parquet, text\); use one type"):
        check_dataset_path("--dataset_name", str(clone))


def test_a_folder_whose_files_form_splits_reads_its_train_split_only(tmp_path, monkeypatch):
    """A git clone of a Hub dataset whose card declares a train and a test split, or whose file names form them
    (data/train-*.parquet beside data/test-*.parquet), read every file as one train split: its test rows went into
    the training and held-out text. The folder's splits are now resolved as datasets resolves a local dataset folder
    (card configs, then file-name patterns), and its train split is read; a folder of one split reads as before."""
    from hf_tapernorm.data.sources import local_data_files

    train, test = corpus_documents(20, seed=1), [f"TESTSPLIT {doc}" for doc in corpus_documents(8, seed=2)]
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")  # nothing may be written there
    card = "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: data/first-*\n"
    card += "  - split: test\n    path: data/second-*\n---\n# A dataset\n"
    for folder, (train_name, test_name), readme in [
        ("named", ("train-00000-of-00001", "test-00000-of-00001"), "---\nlicense: mit\n---\n"),
        ("carded", ("first-00000", "second-00000"), card),  # names no convention knows: the card's configs say
    ]:
        clone = tmp_path / folder
        (clone / "data").mkdir(parents=True)
        (clone / "README.md").write_text(readme)
        datasets.Dataset.from_dict({"text": train}).to_parquet(clone / "data" / f"{train_name}.parquet")
        datasets.Dataset.from_dict({"text": test}).to_parquet(clone / "data" / f"{test_name}.parquet")
        assert local_data_files(str(clone)) == ("parquet", [clone / "data" / f"{train_name}.parquet"])
        assert load_text_dataset(str(clone), cache_dir=str(tmp_path / "c"))["text"] == train
    assert not (tmp_path / "hf_cache").exists()
    tables = tmp_path / "tables"
    tables.mkdir()
    datasets.Dataset.from_dict({"text": train}).to_json(tables / "valid.jsonl")
    datasets.Dataset.from_dict({"text": test}).to_json(tables / "test.jsonl")
    with pytest.raises(DataError, match=r"folder whose file names form the splits validation, test \(as datasets"):
        local_data_files(str(tables))
    (tables / "test.jsonl").unlink()  # one split, validation: read whole, as before
    assert local_data_files(str(tables)) == ("json", [tables / "valid.jsonl"])
    texts = tmp_path / "texts"  # text files named as splits form them, as tables do (a sum reads them all)
    texts.mkdir()
    (texts / "train.md").write_text("\n\n".join(train))
    (texts / "test.md").write_text("\n\n".join(test))
    assert local_data_files(str(texts), split="train+test") == ("text", [texts / "train.md", texts / "test.md"])
    card = (
        "---\nconfigs:\n- config_name: en\n  data_files: data/first-*\n- config_name: fr\n  data_files: data/second-*\n"
    )
    (tmp_path / "carded" / "README.md").write_text(card + "---\n")
    with pytest.raises(DataError, match=r"declares the configurations en, fr and no default: name the data files"):
        local_data_files(str(tmp_path / "carded"))


def test_a_dataset_folder_reads_the_files_datasets_resolves_for_its_train_split(tmp_path):
    """Three folders read files datasets leaves out of the train split: a snapshot_download copy of a clone (its files
    links into blobs/, compared resolved with the unresolved paths datasets lists: nothing matched, every file was
    read, test split included); a card whose default configuration resolves one split (another configuration's
    fr/*.parquet, or undeclared raw/ files, were read too); a clone of a Hub text dataset whose README.md declares
    configs (the card and the test split were read as text). The files are now those datasets resolves for the
    train split (or the only split) of the folder's default configuration, its paths compared unresolved; a text
    folder's README.md is its card when its front matter holds card metadata, and text otherwise."""
    from hf_tapernorm.data.sources import local_data_files

    train, other = corpus_documents(20, seed=1), [f"OTHER {doc}" for doc in corpus_documents(8, seed=2)]
    cache = str(tmp_path / "c")
    snapshot, blobs = tmp_path / "hub" / "snapshots" / "abc", tmp_path / "hub" / "blobs"
    (snapshot / "data").mkdir(parents=True)
    blobs.mkdir()
    for name, docs in (("train-00000-of-00001", train), ("test-00000-of-00001", other)):
        datasets.Dataset.from_dict({"text": docs}).to_parquet(blobs / name)
        (snapshot / "data" / f"{name}.parquet").symlink_to(Path("..", "..", "..", "blobs", name))
    (snapshot / "README.md").symlink_to(Path("..", "..", "blobs", "card"))
    (blobs / "card").write_text("---\nlicense: mit\n---\n")
    assert local_data_files(str(snapshot)) == ("parquet", [snapshot / "data" / "train-00000-of-00001.parquet"])
    assert load_text_dataset(str(snapshot), cache_dir=cache)["text"] == train
    configs = tmp_path / "configs"  # two configurations, en the default: fr's files are another dataset's
    for config, docs in (("en", train), ("fr", other)):
        (configs / config).mkdir(parents=True)
        datasets.Dataset.from_dict({"text": docs}).to_parquet(configs / config / "train-00000-of-00001.parquet")
    card = "---\nconfigs:\n- config_name: en\n  default: true\n  data_files:\n  - split: train\n    path: en/train-*\n"
    (configs / "README.md").write_text(
        card + "- config_name: fr\n  data_files:\n  - split: train\n    path: fr/train-*\n---\n"
    )
    assert local_data_files(str(configs)) == ("parquet", [configs / "en" / "train-00000-of-00001.parquet"])
    assert load_text_dataset(str(configs), cache_dir=cache)["text"] == train
    declared = tmp_path / "declared"  # one configuration of one split: raw/ is not the dataset's
    for folder, docs in (("data", train), ("raw", other)):
        (declared / folder).mkdir(parents=True)
        datasets.Dataset.from_dict({"text": docs}).to_parquet(declared / folder / "part0.parquet")
    (declared / "README.md").write_text("---\nconfigs:\n- config_name: default\n  data_files: data/*.parquet\n---\n")
    assert local_data_files(str(declared)) == ("parquet", [declared / "data" / "part0.parquet"])
    (declared / "README.md").write_text("---\nconfigs:\n- config_name: default\n  data_files: raw/*.arrow\n---\n")
    (declared / "raw" / "part0.arrow").write_bytes(b"")
    with pytest.raises(DataError, match=r"folder whose splits, as datasets reads it \(its card\), hold none of its"):
        local_data_files(str(declared))
    text = tmp_path / "textclone"  # a Hub text dataset's clone: its card declares train.txt and test.txt
    (text / "data").mkdir(parents=True)
    (text / "data" / "train.txt").write_text("\n".join(train))
    (text / "data" / "test.txt").write_text("\n".join(other))
    card = "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: data/train.txt\n"
    (text / "README.md").write_text(card + "  - split: test\n    path: data/test.txt\n---\n# CARD\n")
    assert local_data_files(str(text)) == ("text", [text / "data" / "train.txt"])
    assert load_text_dataset(str(text), sample_by="line", cache_dir=cache)["text"] == train
    (text / "README.md").write_text("---\ndataset_info:\n  features:\n  - name: text\n    dtype: string\n---\n")
    assert local_data_files(str(text)) == ("text", [text / "data" / "train.txt"])  # named train/test: the splits
    (text / "README.md").write_text("---\ntitle: my notes\ntags: [configs]\n---\n# Notes\n")  # a note's front matter
    assert local_data_files(str(text), split="train") == ("text", [text / "data/train.txt"])  # README.md: text
    (text / "data" / "test.txt").unlink()  # one split: the note and train.txt are one corpus
    assert local_data_files(str(text)) == ("text", [text / "README.md", text / "data/train.txt"])
    cardonly = tmp_path / "cardonly"
    cardonly.mkdir()
    (cardonly / "README.md").write_text("---\ndataset_info:\n  dataset_size: 0\n---\n")
    with pytest.raises(DataError, match=r"folder that holds no .* files besides its card \(README.md\)$"):
        local_data_files(str(cardonly))


def test_a_users_own_folder_is_one_corpus_whatever_its_files_are_named(tmp_path):
    """A user's jsonl folder whose file names hold a split word (eval.jsonl beside chat.jsonl, dev.jsonl in a
    subfolder) read only those files, the others dropped without a word; notes (.md) beside the tables made the folder
    "mix file types". Without a dataset card, every file is the corpus, .md notes beside tables are left out as
    datasets leaves them out, and names that form several splits (my_train beside my_test) are refused, naming them."""
    from hf_tapernorm.data.sources import local_data_files

    def folder(name: str, files: list[str]) -> Path:
        root = tmp_path / name
        for index, relative in enumerate(files):
            (root / relative).parent.mkdir(parents=True, exist_ok=True)
            (root / relative).write_text(
                json.dumps({"text": f"document {index}"}) + "\n" if relative.endswith(".jsonl") else "# notes\n"
            )
        return root

    for name, files in [
        ("chats", ["chat.jsonl", "code.jsonl", "eval.jsonl"]),
        ("years", ["2024/dev.jsonl", "2024/notes.jsonl", "misc.jsonl"]),
        ("runs", ["evaluation_runs/a.jsonl", "misc/c.jsonl"]),
    ]:
        root = folder(name, files)
        assert local_data_files(str(root)) == ("json", sorted(root / f for f in files)), name
    root = folder("noted", ["a.jsonl", "b.jsonl", "NOTES.md", "docs/README.md", "README.md"])
    assert local_data_files(str(root)) == ("json", [root / "a.jsonl", root / "b.jsonl"])
    root = folder("split", ["my_train.jsonl", "my_test.jsonl", "my_other.jsonl"])
    with pytest.raises(DataError, match=r"file names form the splits train, test \(as datasets reads them\): read one"):
        local_data_files(str(root))


def test_a_save_to_disk_folder_is_refused_before_the_model_loads(hub, tmp_path):
    """`eval --dataset_name <a Dataset.save_to_disk folder>` loaded the model, then read its state.json and
    dataset_info.json as rows (CastError); a DatasetDict's `--dataset_split test` read test/state.json as a one-row
    split ("too small"). Such a folder, or a folder holding one, is now told as datasets.load_from_disk tells it
    (state.json beside dataset_info.json; dataset_dict.json) and refused before the model loads, saying what to do;
    datasets.load_dataset refuses it too."""
    docs = datasets.Dataset.from_dict({"text": corpus_documents(20)})
    saved, both, holder = tmp_path / "saved", tmp_path / "both", tmp_path / "holder"
    docs.save_to_disk(str(saved))
    datasets.DatasetDict({"train": docs, "test": docs}).save_to_disk(str(both))
    docs.to_json(holder / "notes.jsonl")
    docs.save_to_disk(str(holder / "cache" / "copy"))
    with pytest.raises(ValueError, match="save_to_disk"):
        datasets.load_dataset(str(saved))
    what = (
        "a dataset that datasets' save_to_disk wrote (Arrow files and their state.json), which is read with "
        "datasets.load_from_disk, not as data files: write each split of it as a file (ds.to_json('train.jsonl'), "
        "ds.to_parquet('test.parquet')) and name that file, or a folder of them, as the dataset"
    )
    for folder, split in [(saved, None), (both, "test"), (both, None), (both / "test", None)]:
        flags = ("--dataset_split", split) if split else ()
        assert error_of(_eval("--dataset_name", str(folder), *flags)) == (
            f"hf-tapernorm eval: error: --dataset_name '{folder}' is {what}"
        )
    assert error_of(_eval("--dataset_name", str(holder))) == (
        f"hf-tapernorm eval: error: --dataset_name '{holder}' holds, in '{holder / 'cache' / 'copy'}', {what}"
    )
    with pytest.raises(DataError, match=re.escape(f"dataset '{saved}' is {what}")):
        load_text_dataset(str(saved), cache_dir=str(tmp_path / "c"))


def test_the_files_datasets_ignores_in_a_data_folder_are_never_read(tmp_path):
    """A jsonl folder holding a config.json ({"text": ...}) beside its one data file read the config as a document:
    101 rows where datasets reads 100, and `train[100:]` read the config alone. The names datasets skips in a data
    folder (datasets.data_files.FILES_TO_IGNORE) are now skipped on every path, as datasets skips them; beside text
    files a dataset_infos.json no longer mixes file types."""
    from hf_tapernorm.data.sources import local_data_files

    rows = [f"row {i} " * 4 for i in range(100)]
    tables = tmp_path / "tables"
    tables.mkdir()
    datasets.Dataset.from_dict({"text": rows}).to_json(tables / "mydata.jsonl")
    (tables / "config.json").write_text(json.dumps({"text": "CONFIG"}))
    (tables / "dataset_info.json").write_text(json.dumps({"text": "INFO"}))
    cache = str(tmp_path / "c")
    theirs = datasets.load_dataset(str(tables), split="train", cache_dir=str(tmp_path / "theirs"))["text"]
    assert theirs == rows
    assert local_data_files(str(tables)) == ("json", [tables / "mydata.jsonl"])
    assert load_text_dataset(str(tables), cache_dir=cache)["text"] == rows
    assert load_text_dataset(str(tables), split="train[:10]", cache_dir=cache)["text"] == rows[:10]
    with pytest.raises(DataError, match=r"'train\[100:\]' selects no row of its splits \(rows: train 100\)"):
        load_text_dataset(str(tables), split="train[100:]", cache_dir=cache)
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "notes.txt").write_text("a note\n")
    (texts / "dataset_infos.json").write_text("{}")
    assert local_data_files(str(texts)) == ("text", [texts / "notes.txt"])


def test_a_text_folder_whose_file_names_form_splits_reads_them_as_tables_do(hub, tmp_path):
    """A folder of train.txt and test.txt (no card) was one corpus: both files were trained on without a word,
    `train[:10]` read test.txt's paragraphs (it sorts first) and `--dataset_split test` was refused. Text files now
    form splits by their names as tables do, read as datasets.load_dataset reads them; none named is refused, saying
    how to read one split or all of them (train+test)."""
    from hf_tapernorm.app.data_checks import check_data_paths
    from hf_tapernorm.cli.arguments import DataArguments

    folder = tmp_path / "pair"
    folder.mkdir()
    (folder / "train.txt").write_text("\n\n".join(corpus_documents(30, seed=1)) + "\n")
    (folder / "test.txt").write_text("\n\n".join(f"TEST {doc}" for doc in corpus_documents(12, seed=2)) + "\n")
    for split in ("train[:10]", "train[:33%]", "test", "train+test"):
        theirs = datasets.load_dataset(
            str(folder), split=split, sample_by="paragraph", cache_dir=str(tmp_path / "theirs")
        )["text"]
        assert load_text_dataset(str(folder), split=split, cache_dir=str(tmp_path / "c"))["text"] == theirs, split
        check_data_paths(DataArguments(dataset_name=str(folder), dataset_split=split, out_of_corpus_blocks=0))
    first = load_text_dataset(str(folder), split="train[:10]", cache_dir=str(tmp_path / "c"))["text"]
    assert len(first) == 10 and not any(doc.startswith("TEST") for doc in first)
    assert error_of(_eval("--dataset_name", str(folder))) == (
        f"hf-tapernorm eval: error: --dataset_name '{folder}' is a folder whose file names form the splits train, "
        "test (as datasets reads them): read one with --dataset_split NAME, all of them with --dataset_split "
        "train+test, or name the files of one (a file, or a folder holding only them) as the dataset"
    )


def test_a_folder_whose_names_form_one_split_says_how_datasets_would_read_it(hub, tmp_path, caplog):
    """A folder without a card whose file names form one split at most (train.jsonl beside notes.jsonl; test.txt
    alone) is one corpus, its split train: every file is the user's data. datasets reads it otherwise (train.jsonl
    alone; test.txt as a test split), and that was not said; `--dataset_split test` on test.txt alone was refused
    ("whose one split is train") though datasets reads it so. Now a WARNING says what datasets would read and how to
    read that, and the split the names form reads its files alone, row for row as datasets reads it."""
    from hf_tapernorm.data.sources import local_data_files

    noted, single = tmp_path / "noted", tmp_path / "single"
    for folder, names in ((noted, ("train.jsonl", "notes.jsonl")), (single, ("test.txt",))):
        folder.mkdir()
        for index, file_name in enumerate(names):
            docs = corpus_documents(12, seed=index)
            if file_name.endswith(".jsonl"):
                datasets.Dataset.from_dict({"text": docs}).to_json(folder / file_name)
            else:
                (folder / file_name).write_text("\n\n".join(docs) + "\n")
    with caplog.at_level("WARNING", logger="hf_tapernorm.data.local_folders"):
        assert local_data_files(str(noted)) == ("json", [noted / "notes.jsonl", noted / "train.jsonl"])
    assert (
        f"dataset '{noted}': no dataset card (README.md), so its 2 data file(s) are one corpus, read as its train "
        "split; datasets would read its train split from train.jsonl alone. To read only those, name them as the "
        "dataset"
    ) in caplog.messages
    caplog.clear()
    with caplog.at_level("WARNING", logger="hf_tapernorm.data.local_folders"):
        assert local_data_files(str(single)) == ("text", [single / "test.txt"])
    assert caplog.messages == [
        f"dataset '{single}': no dataset card (README.md), so its 1 data file(s) are one corpus, read as its train "
        "split; datasets would read test.txt as its test split, and no train split. --dataset_split test reads it so"
    ]
    carded = tmp_path / "carded"  # a README.md with YAML that datasets reads nothing from: text, no card
    carded.mkdir()
    (carded / "a.txt").write_text("\n\n".join(corpus_documents(12)) + "\n")
    (carded / "README.md").write_text("---\nlicense: mit\nlanguage: en\n---\n# my notes\n")
    caplog.clear()
    with caplog.at_level("WARNING", logger="hf_tapernorm.data.local_folders"):
        assert local_data_files(str(carded)) == ("text", [carded / "README.md", carded / "a.txt"])
    assert caplog.messages[0].startswith(
        f"dataset '{carded}': its README.md is no dataset card datasets reads (its YAML, if any, names no configs or "
        "splits) but text, so its 2 data file(s) are one corpus"
    ), caplog.messages
    for split in ("test", "test[:50%]"):
        theirs = datasets.load_dataset(str(single), split=split, sample_by="paragraph", cache_dir=str(tmp_path / "t"))
        assert load_text_dataset(str(single), split=split, cache_dir=str(tmp_path / "c"))["text"] == theirs["text"]
    for split, problem in (
        ("train+test", "--dataset_split train+test reads test.txt twice"),
        ("dev", "has no split 'dev'"),
    ):
        with pytest.raises(DataError) as refused:
            local_data_files(str(single), split=split)
        assert str(refused.value) == (
            f"dataset '{single}' {problem}: without a dataset card (README.md) the folder is one corpus, its splits "
            "train (every file) and test (test.txt); name one as --dataset_split"
        )


def test_a_split_read_from_a_folder_of_one_split_says_what_it_leaves_out(tmp_path, caplog):
    """`--dataset_split test` on test.txt beside notes.txt (no card) read test.txt alone, as datasets does, without
    the WARNING a folder of several splits gives for the files a split leaves out; the WARNING came two or three
    times per command (the early check, which names the option, the loading, the row count), and counted the files
    left out without naming them. It now comes, once, naming them."""
    from hf_tapernorm.data.sources import local_data_files

    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "test.txt").write_text("\n\n".join(corpus_documents(6, seed=1)) + "\n")
    (folder / "notes.txt").write_text("\n\n".join(corpus_documents(6, seed=2)) + "\n")
    with caplog.at_level("WARNING", logger="hf_tapernorm.data.local_folders"):
        for name in (f"--dataset_name '{folder}'", None, None):  # the early check names the option, the loading not
            assert local_data_files(str(folder), name, split="test") == ("text", [folder / "test.txt"])
    assert caplog.messages == [
        f"--dataset_name '{folder}': reading 'test' as datasets resolves the folder, 1 of its 2 data file(s) (its "
        "splits: test; left out: notes.txt)"
    ]


def test_a_dataset_no_option_gives_a_split_is_told_to_name_its_files(hub, tmp_path, caplog):
    """`eval --out_of_corpus_dataset` (and bench's --dataset_name) on a folder whose names form splits was refused
    with "read one with --dataset_split NAME", an option that reads --dataset_name's split only: following it
    refused the corpus or changed its split. The WARNING on test.txt alone said "--dataset_split test reads it so"
    for the out-of-corpus text too. Where no option names the dataset's split, both now say to name its files."""
    from hf_tapernorm.data.sources import local_data_files

    pair, single = tmp_path / "pair", tmp_path / "single"
    for folder, names in ((pair, ("train.txt", "test.txt")), (single, ("test.txt",))):
        folder.mkdir()
        for index, file_name in enumerate(names):
            (folder / file_name).write_text("\n\n".join(corpus_documents(8, seed=index)) + "\n")
    splits = "is a folder whose file names form the splits train, test (as datasets reads them): "
    advice = "no option names a split of this dataset: name the files of one (a file, or a folder holding only them) "
    argv = _eval("--out_of_corpus_blocks", "2", "--out_of_corpus_dataset", str(pair))
    assert (
        error_of(argv) == f"hf-tapernorm eval: error: --out_of_corpus_dataset '{pair}' {splits}{advice}as the dataset"
    )
    bench = ["bench", "--model_name_or_path", "llama", "--modes", "train", "--dataset_name", str(pair)]
    assert error_of([*bench, "--output_dir", str(tmp_path / "b")]) == (
        f"hf-tapernorm bench: error: --dataset_name '{pair}' {splits}{advice}as the dataset"
    )
    with caplog.at_level("WARNING", logger="hf_tapernorm.data.local_folders"):
        assert local_data_files(str(single), split_option=None) == ("text", [single / "test.txt"])
    assert caplog.messages == [
        f"dataset '{single}': no dataset card (README.md), so its 1 data file(s) are one corpus, read as its train "
        "split; datasets would read test.txt as its test split, and no train split"
    ]


def _split_folders(root: Path) -> dict[str, Path]:
    """A train.jsonl + test.jsonl folder, and a clone of a Hub dataset (data/train-* beside data/test-*) with its
    README.md card and without: 20 train rows, 8 test rows (each starting TESTSPLIT)."""
    train, test = corpus_documents(20, seed=1), [f"TESTSPLIT {doc}" for doc in corpus_documents(8, seed=2)]
    folders = {"pair": root / "pair", "carded": root / "carded", "clone": root / "clone"}
    folders["pair"].mkdir(parents=True)
    for split, docs in (("train", train), ("test", test)):
        datasets.Dataset.from_dict({"text": docs}).to_json(folders["pair"] / f"{split}.jsonl")
        for name in ("carded", "clone"):
            (folders[name] / "data").mkdir(parents=True, exist_ok=True)
            datasets.Dataset.from_dict({"text": docs}).to_parquet(folders[name] / "data" / f"{split}-00000.parquet")
    (folders["carded"] / "README.md").write_text("---\nlicense: mit\n---\n# A dataset\n")
    return folders


def test_the_split_named_of_a_folder_whose_files_form_splits_is_read(hub, tmp_path):
    """`eval --dataset_split test` (validation, train+test, test[:50%]) on a train.jsonl + test.jsonl folder, or on a
    clone of a Hub dataset (data/train-* beside data/test-*, with its README.md card or without), was refused at parse
    ("whose one split is train"), though datasets.load_dataset(folder, split="test") reads it. The split named is now
    read from the splits datasets resolves for the folder, row for row as datasets reads them; train is the default
    only when no split is named (the card's train split), and a folder of the user's own files whose names form
    several splits, none named, is refused saying how to name one: on the command line and in an options file."""
    from hf_tapernorm.app.data_checks import check_data_paths
    from hf_tapernorm.cli.arguments import DataArguments

    folders = _split_folders(tmp_path)
    for folder in folders.values():
        for split in ("test", "test[:50%]", "train+test", "train[2:5]+test[-3:]"):
            theirs = datasets.load_dataset(str(folder), split=split, cache_dir=str(tmp_path / "theirs"))["text"]
            assert load_text_dataset(str(folder), split=split, cache_dir=str(tmp_path / "c"))["text"] == theirs
            check_data_paths(DataArguments(dataset_name=str(folder), dataset_split=split, out_of_corpus_blocks=0))
        assert error_of(_eval("--dataset_name", str(folder), "--dataset_split", "validation")) == (
            f"hf-tapernorm eval: error: --dataset_name '{folder}' has no split 'validation': its splits, as datasets "
            "reads the folder, are train, test; name one of them as --dataset_split"
        )
    theirs = datasets.load_dataset(str(folders["carded"]), split="train", cache_dir=str(tmp_path / "theirs"))
    assert load_text_dataset(str(folders["carded"]), cache_dir=str(tmp_path / "c"))["text"] == theirs["text"]
    for name in ("pair", "clone"):
        refusal = (
            f"--dataset_name '{folders[name]}' is a folder whose file names form the splits train, test (as datasets "
            "reads them): read one with --dataset_split NAME, all of them with --dataset_split train+test, or name the "
            "files of one (a file, or a folder holding only them) as the dataset"
        )
        assert error_of(_eval("--dataset_name", str(folders[name]))) == f"hf-tapernorm eval: error: {refusal}"
        options = tmp_path / f"{name}.yaml"
        flags = _eval("--dataset_name", str(folders[name]))[1:]
        values = {flag[2:]: value for flag, value in zip(flags[::2], flags[1::2])}
        options.write_text(json.dumps({**values, "dataset_split": None}))  # null: the default, as left out
        assert error_of(["eval", str(options)]) == f"hf-tapernorm eval: error: {refusal}"
        named = {"dataset_split": "train", "block_size": 32, "heldout_percentage": 50}  # 50: 20 rows hold blocks out
        options.write_text(json.dumps({**values, **named}))  # named: read (the texts before the model)
        with pytest.raises(pytest.fail.Exception, match="the model was loaded"):
            run_main(["eval", str(options)])
    assert error_of(_eval("--dataset_name", "corpus.txt", "--dataset_split", "test")) == (
        "hf-tapernorm eval: error: --dataset_name 'corpus.txt' is a local file, whose one split is train, not 'test': "
        "name that split's file as the dataset (slices such as train[:50%] read part of train)"
    )


def test_a_slice_past_a_local_datasets_rows_is_refused_before_the_model_loads(hub, tmp_path):
    """`--dataset_name rows.jsonl --dataset_split 'train[100:]'` on a 50-row file (or a test split's slice past its
    rows) was found only after the model loaded: the early check now reads the local split as the loading reads it
    (the datasets cache then serves the loading) and counts its rows, as a Hub split's recorded rows are counted."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": f"document {i} " * 8}) + "\n" for i in range(50)))
    pair = _split_folders(tmp_path)["pair"]
    cache = str(tmp_path / "c")
    for name, split, sizes in [(rows, "train[100:]", "train 50"), (rows, "train[-5:5]", "train 50"),
                               (pair, "train[20:]+test[8:]", "train 20, test 8")]:  # fmt: skip
        refusal = (
            f"dataset '{name}': '{split}' selects no row of its splits (rows: {sizes}); name a slice within them, "
        )
        line = error_of(_eval("--dataset_name", str(name), "--dataset_split", split, "--data_cache_dir", cache,
                              "--block_size", "32"))  # fmt: skip
        assert line == f"hf-tapernorm eval: error: --dataset_name: {refusal}or the split whole"
        with pytest.raises(DataError, match=re.escape(refusal)):
            load_text_dataset(str(name), split=split, cache_dir=cache)
    assert len(load_text_dataset(str(rows), split="train[40:]", cache_dir=cache)) == 10
    with pytest.raises(pytest.fail.Exception, match="the model was loaded"):  # a slice within its rows: accepted
        run_main(_eval("--dataset_name", str(rows), "--dataset_split", "train[40:]", "--data_cache_dir", cache,
                       "--block_size", "32", "--heldout_percentage", "50"))  # fmt: skip


def test_the_out_of_corpus_text_is_read_from_the_column_its_option_names(hub, tmp_path, tokenizer):
    """An --out_of_corpus_dataset without a `text` column and of several string columns (a Hub dataset or a jsonl)
    could not be used: the refusal said "pass --text_column", which the out-of-corpus reader did not read, and came
    after the model loaded. --out_of_corpus_text_column names its column; it is checked before the model loads, as
    --text_column is."""
    from hf_tapernorm.cli.arguments import DataArguments
    from hf_tapernorm.data.out_of_corpus import out_of_corpus_set

    docs = corpus_documents(40)
    _tables(hub, [{"id": i, "body": d, "title": "~" * 12} for i, d in enumerate(docs)])
    cached_hub_dataset(hub / "hubcols", hub / "t.jsonl", repo="me/cols")
    ooc = ["--out_of_corpus_blocks", "2", "--data_cache_dir", "hubcols", "--dataset_name", "corpus.txt"]
    for name in ("t.jsonl", "me/cols"):
        assert error_of(_eval(*ooc, "--out_of_corpus_dataset", name)).endswith(
            f"--out_of_corpus_dataset '{name}': cannot tell which column holds the text (columns: id, body, title); "
            "pass --out_of_corpus_text_column"
        )
        assert error_of(_eval(*ooc, "--out_of_corpus_dataset", name, "--out_of_corpus_text_column", "text")).endswith(
            f"--out_of_corpus_text_column text: --out_of_corpus_dataset '{name}' has no column 'text'; its columns: "
            "id, body, title"
        )
        for column in ("body", "title"):
            data = DataArguments(out_of_corpus_dataset=name, out_of_corpus_text_column=column, out_of_corpus_blocks=2,
                                 block_size=32, data_cache_dir="hubcols")  # fmt: skip
            blocks = out_of_corpus_set(data, tokenizer, []).blocks.flatten().tolist()
            text = {chr(i) for i in blocks if i != tokenizer.eos_token_id}
            assert text == {"~"} if column == "title" else ("~" not in text and len(text) > 10)
    assert error_of(_eval("--out_of_corpus_blocks", "2", "--out_of_corpus_text_column", "body")).endswith(
        "--out_of_corpus_text_column body: the out-of-corpus text python-docs is the Python documentation, which has "
        "no columns (leave the option out, or name an --out_of_corpus_dataset)"
    )


# ============================================================================= what a document is
@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    return one_model_workspace(tmp_path_factory.mktemp("data"))


def _documents(path: Path, tmp: Path) -> list[str]:
    return load_text_dataset(str(path), cache_dir=str(tmp / "cache"))["text"]


def test_a_byte_order_mark_is_not_text_of_the_first_document(ws, tmp_path):
    plain = _documents(ws / "corpus.txt", tmp_path)
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbf" + (ws / "corpus.txt").read_bytes())
    assert _documents(tmp_path / "bom.txt", tmp_path) == plain


def test_crlf_nul_bytes_and_an_upper_case_suffix_read_as_the_same_documents(ws, tmp_path):
    text = (ws / "corpus.txt").read_text()
    plain = _documents(ws / "corpus.txt", tmp_path)
    (tmp_path / "crlf.txt").write_bytes(text.replace("\n", "\r\n").encode())
    (tmp_path / "UPPER.TXT").write_text(text)
    (tmp_path / "nul.txt").write_text(text[:3000] + "\0" + text[3000:])
    assert _documents(tmp_path / "crlf.txt", tmp_path) == plain
    assert _documents(tmp_path / "UPPER.TXT", tmp_path) == plain
    with_nul = _documents(tmp_path / "nul.txt", tmp_path)
    assert len(with_nul) == len(plain) and sum("\0" in d for d in with_nul) == 1


def test_a_data_folder_skips_hidden_copies_and_accepts_a_trailing_slash(ws, tmp_path):
    folder = tmp_path / "data"
    (folder / ".ipynb_checkpoints").mkdir(parents=True)
    (folder / "a.txt").write_text((ws / "corpus.txt").read_text())
    (folder / ".ipynb_checkpoints" / "a-checkpoint.txt").write_text((ws / "corpus.txt").read_text())
    (folder / ".notes.txt").write_text("a private note\n\nnot corpus")
    expected = _documents(ws / "corpus.txt", tmp_path)
    assert _documents(folder, tmp_path) == expected
    assert _documents(Path(str(folder) + "/"), tmp_path) == expected


@pytest.mark.parametrize("suffix", ["jsonl", "csv"])
def test_a_byte_order_mark_in_jsonl_or_csv_leaves_the_text_column(tmp_path, suffix):
    docs = corpus_documents(20)
    if suffix == "jsonl":
        body = "".join(json.dumps({"text": d}) + "\n" for d in docs)
    else:
        body = "text\n" + "".join(f'"{d}"\n' for d in docs)
    (tmp_path / f"bom.{suffix}").write_bytes(b"\xef\xbb\xbf" + body.encode())
    dataset = load_text_dataset(str(tmp_path / f"bom.{suffix}"), cache_dir=str(tmp_path / "cache"))
    assert dataset.column_names == ["text"] and dataset["text"] == docs


def test_corpus_that_is_not_utf8_or_one_long_line_is_explained(workspace, tmp_path, monkeypatch):
    import hf_tapernorm.app.taper as taper_pipeline

    monkeypatch.setattr(taper_pipeline, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes(("caf\xe9 na\xefve r\xe9sum\xe9 " * 200).encode("latin-1"))
    argv = taper_argv(workspace, tmp_path / "run", "--data_cache_dir", str(tmp_path / "cache"))
    argv[argv.index("--dataset_name") + 1] = str(latin1)
    message = error_of(argv)  # was "DatasetGenerationError: An error occurred while generating the dataset"
    assert message.startswith(f"hf-tapernorm taper: error: --dataset_name '{latin1}' is not UTF-8 text (invalid cont")
    assert message.endswith("convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8), or pass a text file")
    one_line = tmp_path / "one_line.txt"
    one_line.write_text(" ".join(["the quick brown fox"] * 3000))
    argv[argv.index("--dataset_name") + 1] = str(one_line)
    message = error_of(argv)  # was only "too small", of a file of 12,000 words
    assert (
        "held-out split (10% of documents held out) does not fill one block of 32 tokens; it holds only 1 " in message
    )
    # not "or --sample_by line": a file of one line has no more lines to cut
    assert message.endswith("split the text into more lines or paragraphs (each of its documents is one line already)")
    argv += ["--sample_by", "line"]
    message = error_of(argv)
    assert message.endswith("split the text into more lines or paragraphs (each of its documents is one line already)")
    lines = tmp_path / "paragraph.txt"
    lines.write_text("\n".join(["the quick brown fox jumps"] * 600))  # one paragraph of many lines
    argv[argv.index("--dataset_name") + 1] = str(lines)
    argv = argv[:-2]
    assert error_of(argv).endswith("split the text into more (blank lines between paragraphs, or --sample_by line)")
    paragraphs = tmp_path / "paragraphs.txt"  # paragraphs between blank lines, read as one document
    paragraphs.write_text("\n\n".join(f"paragraph {i} of the quick brown fox" for i in range(150)))
    argv[argv.index("--dataset_name") + 1] = str(paragraphs)
    assert error_of([*argv, "--sample_by", "document"]).endswith(
        ": read each of its paragraphs as a document (--sample_by paragraph, the default), or split it into more"
    )
    assert not (tmp_path / "run").exists()


# ============================================================================= rows that are not text
def _jsonl(path: Path, values: list) -> Path:
    path.write_text("".join(json.dumps({"text": value, "id": i}) + "\n" for i, value in enumerate(values)))
    return path


@pytest.mark.parametrize("value, kind", [(["a list"], "a list"), (7, "a number"), ({"body": "an object"}, "an object")])
@pytest.mark.parametrize("train_blocks", [None, 0], ids=["taper", "eval"])
def test_a_row_whose_text_is_not_a_string_is_named_not_skipped(tmp_path, tokenizer, value, kind, train_blocks):
    """A JSONL whose `text` is a list, a number or an object in some rows (`datasets` reads the column as JSON) had
    those rows skipped without a word (corpus._named_texts kept str values only): taper trained and eval scored on
    part of the corpus, rc 0. Each such row is now refused as a null row is, naming the row, the column and the type;
    train_blocks=0 is eval's reading (held-out blocks only)."""
    docs: list = corpus_documents(60)
    docs[2] = value
    dataset = load_text_dataset(str(_jsonl(tmp_path / "some.jsonl", docs)), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataError) as refused:
        _prepare(dataset, tokenizer, train_blocks=train_blocks)
    assert str(refused.value) == (
        f"row 2 of 'text' is {kind}, not text: every row needs its text in 'text' as a string; fix the data, or pass "
        "--text_column"
    )


@pytest.mark.parametrize("value, kind", [(7, "a number"), (["a list"], "a list"), (None, None)])
@pytest.mark.parametrize("train_blocks", [None, 0], ids=["taper", "eval"])
def test_a_column_of_no_text_is_named_not_called_too_small(tmp_path, tokenizer, value, kind, train_blocks):
    """A JSONL whose every `text` is a number, a list or null (150 documents) was refused as "too small: its
    held-out split ... does not fill one block", and eval said so of null rows that taper named: the held-out draw
    (corpus._heldout_set) caught every ConfigurationError, the row's refusal too, as "fills no block". It catches the
    too-little-text error only now, so taper and eval refuse such rows in the same words, naming the first."""
    dataset = load_text_dataset(str(_jsonl(tmp_path / "all.jsonl", [value] * 150)), cache_dir=str(tmp_path / "c"))
    with pytest.raises(DataError) as refused:
        _prepare(dataset, tokenizer, train_blocks=train_blocks)
    if kind is None:
        assert str(refused.value) == (
            "row 0 of dataset 'python-stdlib' has no 'text' value: every row needs its text in 'text'; fix the data"
        )
    else:
        assert str(refused.value).startswith(f"row 0 of 'text' is {kind}, not text: ")


@pytest.mark.parametrize("cells, kind", [(["1000", "2000"], "a number"), (["True", "False"], "a boolean")])
def test_a_csv_column_the_loader_typed_as_numbers_says_why_quoting_does_not_help(tmp_path, tokenizer, cells, kind):
    """A CSV text column whose cells all read as numbers or true/false is typed so by the csv loader, quoted or not:
    "fix the data" left the user nowhere. The refusal says why, and what to write instead."""
    (tmp_path / "cells.csv").write_text("text\n" + "".join(f'"{cells[i % 2]}"\n' for i in range(150)))
    dataset = load_text_dataset(str(tmp_path / "cells.csv"), cache_dir=str(tmp_path / "c"))
    with pytest.raises(DataError) as refused:
        _prepare(dataset, tokenizer, train_blocks=None)
    assert str(refused.value) == (
        f"row 0 of 'text' is {kind}, not text: the csv loader types a column whose cells all read as numbers or "
        "true/false so, quoted or not; write the texts as JSON Lines strings, or pass --text_column"
    )


def test_an_out_of_corpus_row_that_is_not_text_is_named_not_skipped(tmp_path, tokenizer):
    """The out-of-corpus reader skipped rows whose text was null or not a string, as the corpus did: it refuses them
    now by the corpus's own check (corpus.row_text), naming its own column option."""
    from hf_tapernorm.cli.arguments import DataArguments
    from hf_tapernorm.data.out_of_corpus import out_of_corpus_set

    docs: list = corpus_documents(40)
    docs[1] = None
    name = str(_jsonl(tmp_path / "ooc.jsonl", docs))
    data = DataArguments(
        out_of_corpus_dataset=name, out_of_corpus_blocks=2, block_size=32, data_cache_dir=str(tmp_path / "c")
    )
    with pytest.raises(DataError) as refused:
        out_of_corpus_set(data, tokenizer, [])
    assert str(refused.value) == (
        f"row 1 of --out_of_corpus_dataset '{name}' has no 'text' value: every row needs its text in 'text'; fix the "
        "data"
    )


@pytest.mark.parametrize("streaming", [False, True], ids=["loaded", "streaming"])
def test_an_empty_csv_cell_is_an_empty_document_as_a_jsonl_empty_string_is(tmp_path, tokenizer, streaming):
    """`eval --dataset_name emptycell.csv` refused a row whose text cell is empty as "has no 'text' value" (pandas
    reads the cell as NaN, `datasets` gives None), while a JSONL row's "" is an empty document. In a CSV an empty
    cell and a missing value are one thing: the csv builder's None is read as "" (corpus.empty_cells_read_as_none),
    for the corpus (taper's and eval's reading) and the out-of-corpus text alike, so the CSV gives the JSONL's
    blocks; a JSON/JSONL or parquet row's null is still refused, naming the row."""
    import pandas as pd

    from hf_tapernorm.cli.arguments import DataArguments
    from hf_tapernorm.data.out_of_corpus import out_of_corpus_set

    docs: list = corpus_documents(60)
    docs[2] = ""
    pd.DataFrame({"id": range(len(docs)), "text": docs}).to_csv(tmp_path / "empty.csv", index=False)
    assert (tmp_path / "empty.csv").read_text().splitlines()[3] == "2,"  # row 2's text cell is empty
    _jsonl(tmp_path / "empty.jsonl", docs)

    def load(name: str):
        return load_text_dataset(str(tmp_path / name), cache_dir=str(tmp_path / "c"), streaming=streaming)

    for train_blocks in (None, 0):  # taper's reading, then eval's
        csv, jsonl = (
            _prepare(load(name), tokenizer, train_blocks=train_blocks) for name in ("empty.csv", "empty.jsonl")
        )
        assert torch.equal(blocks_tensor(csv.heldout), blocks_tensor(jsonl.heldout))
        assert len(csv.train) == len(jsonl.train) and (train_blocks == 0 or len(csv.train) > 10)
        if train_blocks is None:
            assert torch.equal(blocks_tensor(csv.train), blocks_tensor(jsonl.train))
    sets = [
        out_of_corpus_set(
            DataArguments(
                out_of_corpus_dataset=str(tmp_path / name),
                out_of_corpus_blocks=2,
                block_size=32,
                data_cache_dir=str(tmp_path / "c"),
            ),
            tokenizer,
            [],
        )
        for name in ("empty.csv", "empty.jsonl")
    ]
    assert torch.equal(sets[0].blocks, sets[1].blocks)
    docs[2] = None
    pd.DataFrame({"text": docs}).to_parquet(tmp_path / "null.parquet")
    for name in (_jsonl(tmp_path / "null.jsonl", docs).name, "null.parquet"):
        with pytest.raises(DataError) as refused:
            _prepare(load(name), tokenizer)
        assert str(refused.value) == (
            "row 2 of dataset 'python-stdlib' has no 'text' value: every row needs its text in 'text'; fix the data"
        )


# ============================================================================= --sample_by where nothing reads it
def test_sample_by_is_refused_where_no_text_file_is_read(hub, tmp_path):
    """`--sample_by line|document` on a JSONL/CSV/parquet dataset, a Hub dataset or the embedded corpus was ignored
    (each row, or file, is one document) yet recorded in eval's result and the run's report. It is refused before
    the model loads, as --dataset_config_name on a local file is (data_checks.check_sample_by). It was accepted where
    one dataset read was text files (`--dataset_name plain.jsonl --out_of_corpus_dataset corpus.txt --sample_by
    line`), and recorded beside the JSONL it did not cut: it applies to every dataset read, so it is refused where
    any of them is not text files, naming that one, and used where all are (an out-of-corpus dataset not read, at
    --out_of_corpus_blocks 0, does not count)."""
    from hf_tapernorm.app.data_checks import check_data_paths
    from hf_tapernorm.cli.arguments import DataArguments

    names = _tables(hub, [{"text": d} for d in corpus_documents(20)])
    for name in [*names, "me/one", None]:
        shown = name or EMBEDDED_CORPUS
        per = "file" if name is None else "row"
        flags = ["--dataset_name", name] if name else []
        assert error_of(_eval(*flags, "--sample_by", "line", "--data_cache_dir", "hubcache")) == (
            "hf-tapernorm eval: error: --sample_by line: only local text files (.txt, .md) are cut into documents by "
            f"line, paragraph or file, and --dataset_name '{shown}' is one document per {per}; leave the option out"
        )
    both = ["--out_of_corpus_blocks", "2", "--out_of_corpus_dataset", "t.csv", "--dataset_name", "t.jsonl"]
    assert error_of(_eval(*both, "--sample_by", "document")).endswith(
        "and --dataset_name 't.jsonl' is one document per row and --out_of_corpus_dataset 't.csv' is one document per "
        "row; leave the option out"
    )
    applies = "(the option applies to every dataset the command reads); leave the option out"
    for dataset, ooc, uncut in (("t.jsonl", "corpus.txt", "--dataset_name 't.jsonl'"), ("texts", "t.csv", None)):
        uncut = uncut or "--out_of_corpus_dataset 't.csv'"
        mixed = ["--out_of_corpus_blocks", "2", "--out_of_corpus_dataset", ooc, "--dataset_name", dataset]
        assert error_of(_eval(*mixed, "--sample_by", "line")) == (
            "hf-tapernorm eval: error: --sample_by line: only local text files (.txt, .md) are cut into documents by "
            f"line, paragraph or file, and {uncut} is one document per row {applies}"
        )
    # texts/ holds a copy of corpus.txt, refused as out-of-corpus text (check_out_of_corpus_differs): todo.txt instead
    for dataset, ooc in (("corpus.txt", "python-docs"), ("corpus.txt", "todo.txt"), ("texts", "python-docs")):
        check_data_paths(DataArguments(dataset_name=dataset, out_of_corpus_dataset=ooc, sample_by="line"))
    check_data_paths(  # the out-of-corpus dataset is not read
        DataArguments(
            dataset_name="corpus.txt", out_of_corpus_dataset="t.csv", out_of_corpus_blocks=0, sample_by="line"
        )
    )
    mixed_report = DataArguments(dataset_name="t.jsonl", out_of_corpus_dataset="corpus.txt", sample_by="line")
    check_data_paths(mixed_report, recorded=True)  # fold's, of an earlier version's report
    check_data_paths(DataArguments(dataset_name="t.jsonl", sample_by="paragraph"))  # the default, as left out
    check_data_paths(DataArguments(dataset_name="t.jsonl", sample_by="line"), recorded=True)  # fold's, of a report


# ============================================================================= files that hold nothing, or no character
def _no_rows(folder: Path) -> dict[str, Path]:
    """A CSV file of its header alone, a JSONL file of blank lines, a parquet file of a schema and no row, and a
    folder of two header-only CSV files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "header.csv").write_text("text\n")
    (folder / "blank.jsonl").write_text("\n\n  \n")
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), folder / "none.parquet")
    (folder / "csvs").mkdir(exist_ok=True)
    for name in ("a.csv", "b.csv"):
        (folder / "csvs" / name).write_text("id,text\n")
    return {name: folder / name for name in ("header.csv", "blank.jsonl", "none.parquet", "csvs")}


@pytest.mark.parametrize("streaming", [False, True])
def test_a_table_of_no_rows_is_refused_as_empty_as_a_file_of_no_bytes_is(tmp_path, streaming):
    """A CSV file of its header alone and a JSONL file of blank lines were refused in datasets' words ('ValueError:
    Instruction "train" corresponds to no data!'), a parquet file of no row in pyarrow's ('ArrowInvalid: BatchSize
    must be greater than 0, got 0'). They are refused as a 0-byte file is: the dataset is empty, it holds no rows."""
    for name, path in _no_rows(tmp_path / "data").items():
        with pytest.raises(DataError) as refused:
            load_text_dataset(str(path), streaming=streaming, cache_dir=str(tmp_path / "cache"))
        what = "its files hold" if name == "csvs" else "the file holds"
        assert str(refused.value) == f"dataset '{path}' is empty: {what} no rows"


def test_a_json_array_of_no_item_is_refused_as_empty(tmp_path):
    """A JSON file holding an empty array ('[]', '  [ ]' over lines, after a byte-order mark) was refused in datasets'
    words ('ValueError: Instruction "train" corresponds to no data!'); it holds no rows, and is told so. An array of
    one row, or an object, is no empty file."""
    from hf_tapernorm.data.file_contents import holds_no_rows

    texts = {"empty.json": b"[]", "spaced.json": b"  [\n\t ]\n", "bom.json": b"\xef\xbb\xbf [ ]"}
    for name, content in texts.items():
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(DataError) as refused:
            load_text_dataset(str(path), cache_dir=str(tmp_path / "cache"))
        assert str(refused.value) == f"dataset '{path}' is empty: the file holds no rows"
    for content in (b'[{"text": "a"}]', b"[[]]", b"{}", b"[ ] x"):
        (tmp_path / "rows.json").write_bytes(content)
        assert not holds_no_rows("json", [tmp_path / "rows.json"]), content


def test_a_lone_surrogate_escape_is_named_with_its_line_not_pandas_trailing_data(tmp_path):
    """A JSONL file whose row 5 held the escape \\ud800 (half of a UTF-16 surrogate pair) was refused as "ValueError:
    Trailing data at position ..." (the failure of the json builder's pandas fallback); pyarrow's reason was only in
    a log line. The error names the line, its row and the escape. A pair (\\ud83d\\ude00) and an escaped backslash
    before "ud800" are no lone surrogate."""
    lines = [json.dumps({"text": d}) for d in corpus_documents(8)]
    lines[1] = '{"text": "a smile \\ud83d\\ude00 here"}'
    lines[2] = '{"text": "a path C:\\\\ud800 here"}'
    lines[5] = '{"text": "abc \\ud800 def"}'
    path = tmp_path / "surrogate.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError) as refused:
        load_text_dataset(str(path), cache_dir=str(tmp_path / "cache"))
    assert str(refused.value) == (
        f"dataset '{path}': line 6 of surrogate.jsonl (row 5) holds \\ud800, half of a UTF-16 surrogate pair, which "
        "is no character and which pyarrow's JSON reader refuses; fix or remove that escape"
    )


@pytest.mark.parametrize("distinct", [1, 3])
def test_copies_of_few_documents_are_told_as_few_distinct_documents(tokenizer, distinct):
    """150 copies of one document (or of 3) were "too small: its held-out split ... does not fill one block; use
    more text": the split holds documents out by a hash of their text, so every copy falls on the side of its first,
    and more copies never fill the other. The error says how many distinct documents the corpus holds."""
    kept = [d for d in corpus_documents(60) if not is_heldout(d, 20.0)][:distinct]
    copies = datasets.Dataset.from_dict({"text": kept * (150 // distinct)})
    with pytest.raises(DataError) as refused:
        _prepare(copies, tokenizer, source="copies.txt")
    assert str(refused.value) == (
        "dataset 'copies.txt' is too small: its held-out split (20% of documents held out) does not fill one block "
        f"of 32 tokens; it holds only {distinct} distinct document(s) among its 150, and the split takes whole "
        "documents by a hash of their text, so every copy of one falls on the same side: more copies never fill "
        "it; use more distinct text"
    )


def test_a_compressed_data_file_is_refused_naming_how_to_decompress_it(hub):
    """`--dataset_name data.jsonl.gz` was refused as "unsupported file type '.gz'", without a word of what to do.
    datasets would read it, but the checks made before the model loads (its columns, whether it is empty) read a
    file's bytes as its data: it is refused before the model loads, naming the command that decompresses it. A
    compressed file of a suffix no builder reads stays an unsupported file type."""
    import gzip

    (hub / "data.jsonl.gz").write_bytes(gzip.compress(b'{"text": "x"}\n'))
    (hub / "notes.docx.bz2").write_bytes(b"x")
    assert error_of(_eval("--dataset_name", "data.jsonl.gz")) == (
        "hf-tapernorm eval: error: --dataset_name 'data.jsonl.gz': a compressed file (.gz) is not read; decompress "
        "it (gzip -dc 'data.jsonl.gz' > 'data.jsonl') and name the .jsonl file it writes ('data.jsonl')"
    )
    assert "unsupported file type '.bz2'; supported: .csv, .json" in error_of(_eval("--dataset_name", "notes.docx.bz2"))


@pytest.mark.parametrize(
    "name, tool",
    [
        ("DATA.TXT.BZ2", "bzip2"),
        ("DATA.TXT.XZ", "xz"),
        ("data.txt.gzip", "gzip"),
        ("DATA.TXT.GZ", "gzip"),
        ("data.txt.lz4", "lz4"),
        ("data.txt.zst", "zstd"),
        ("DATA.TXT.ZSTD", "zstd"),
    ],
)
@pytest.mark.parametrize("option", ["--dataset_name", "--out_of_corpus_dataset"])
def test_a_printed_decompress_command_writes_the_file_it_names(tmp_path, name, tool, option):
    """`DATA.TXT.BZ2`, `DATA.TXT.XZ` and `data.txt.gzip` are refused as compressed files (their suffix matched in any
    case, .gzip too), but the printed `bunzip2 -k` wrote `DATA.TXT.BZ2.out`, not the 'DATA.TXT' the message named,
    and `unxz -k` and `gunzip -k` refused the suffix and wrote nothing (`lz4 -d` writes to a pipe when not in a
    terminal). The printed command decompresses to standard output into the file the message names, and it runs as
    printed, writing that file's text."""
    import shutil
    import subprocess

    from hf_tapernorm.data.sources import local_splits

    if shutil.which(tool) is None:
        pytest.skip(f"{tool} is not installed")
    folder = tmp_path / "it's"
    folder.mkdir()
    path = folder / name
    text = "compressed text\n\nand more of it\n"
    path.write_bytes(subprocess.run([tool, "-c"], input=text.encode(), capture_output=True, check=True).stdout)
    plain = name[: name.rindex(".")]
    subject = f"{option} '{path}'"
    with pytest.raises(DataError) as refused:
        local_splits(str(path), subject)
    quoted = str(folder).replace("'", "'\"'\"'")
    command = f"{tool} -dc '{quoted}/{name}' > '{quoted}/{plain}'"
    assert str(refused.value) == (
        f"{subject}: a compressed file ({Path(name.lower()).suffix}) is not read; decompress it ({command}) and name "
        f"the .txt file it writes ('{plain}')"
    )
    subprocess.run(command, shell=True, check=True, capture_output=True)
    assert (folder / plain).read_text() == text


def test_a_printed_command_never_writes_onto_a_file_that_exists(tmp_path):
    """`data.txt.gz` beside the user's own `data.txt` was refused printing `gzip -dc '.../data.txt.gz' >
    '.../data.txt'`, which, run as printed, replaced that file with the decompressed text; an iconv command so wrote
    onto an existing `b.utf8.txt`. The printed command writes a name no file has (data.unpacked.txt, then
    data.unpacked-2.txt), which the message names, and the user's files stay as they were."""
    import gzip
    import subprocess

    from hf_tapernorm.data.sources import local_splits

    (tmp_path / "data.txt").write_text("MY OWN NOTES")
    (tmp_path / "data.unpacked.txt").write_text("MORE NOTES")
    path = tmp_path / "data.txt.gz"
    path.write_bytes(gzip.compress(b"compressed text\n\nand more of it\n"))
    with pytest.raises(DataError) as refused:
        local_splits(str(path), "--dataset_name 'd'")
    command = f"gzip -dc '{path}' > '{tmp_path / 'data.unpacked-2.txt'}'"
    assert str(refused.value) == (
        f"--dataset_name 'd': a compressed file (.gz) is not read; decompress it ({command}) and name the .txt file it "
        "writes ('data.unpacked-2.txt')"
    )
    subprocess.run(command, shell=True, check=True)
    assert (tmp_path / "data.txt").read_text() == "MY OWN NOTES"
    assert (tmp_path / "data.unpacked.txt").read_text() == "MORE NOTES"
    assert (tmp_path / "data.unpacked-2.txt").read_text() == "compressed text\n\nand more of it\n"
    wide = tmp_path / "b.txt"
    wide.write_bytes("wide text\n\nand more\n".encode("utf-16"))
    (tmp_path / "b.utf8.txt").write_text("MINE")
    with pytest.raises(DataError) as refused:
        load_text_dataset(str(wide), cache_dir=str(tmp_path / "c"), name="t")
    assert f"> '{tmp_path / 'b.utf8-2.txt'}')" in str(refused.value)
    (tmp_path / "notes").write_text("MINE")  # a file of no type's suffix: the new name's '.unpacked' is no type
    (tmp_path / "notes.gz").write_bytes(gzip.compress(b"compressed text\n"))
    with pytest.raises(DataError) as refused:
        local_splits(str(tmp_path / "notes.gz"), "--dataset_name 'n'")
    assert str(refused.value).endswith(
        f"> '{tmp_path / 'notes.unpacked'}') and name the file it writes ('notes.unpacked') with the suffix of its "
        "type (.csv, .json, .jsonl, .md, .parquet, .text, .txt)"
    )


def _link_a_folder(tmp_path: Path) -> None:
    (tmp_path / "external").mkdir()
    (tmp_path / "external" / "more.txt").write_text("text the link points to\n\nand more of it")
    (tmp_path / "mixed" / "more").symlink_to(tmp_path / "external", target_is_directory=True)


def _compress_a_file(tmp_path: Path) -> None:
    import gzip

    (tmp_path / "mixed" / "more.txt.gz").write_bytes(gzip.compress(b"compressed text\n\nand more of it"))


@pytest.mark.parametrize(
    "add, warned",
    [
        (
            _link_a_folder,
            "its 1 linked folder(s) (more) are not read, as datasets does not follow a link to a folder; name the "
            "folder a link points to as the dataset, or copy its files in",
        ),
        (
            _compress_a_file,
            "its 1 compressed file(s) (more.txt.gz) are not read, as the checks before loading cannot read them; "
            "decompress them in the folder (gunzip -k FILE, unzip FILE, tar -xzf FILE, ...) to read their text",
        ),
    ],
    ids=["a linked folder", "a compressed file"],
)
def test_what_a_data_folder_s_read_skips_is_named_in_a_warning(ws, tmp_path, caplog, add, warned):
    """A data folder holding a link to a folder of text, or a compressed data file (more.txt.gz), beside its text
    read the text alone, without a word (datasets follows no link to a folder either; it would read the compressed
    file). The files read are the same; one WARNING names what is skipped, and what to do."""
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.txt").write_text((ws / "corpus.txt").read_text())
    add(tmp_path)
    with caplog.at_level("WARNING"):
        documents = _documents(tmp_path / "mixed", tmp_path)
    assert documents == _documents(ws / "corpus.txt", tmp_path)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "are not read" in r.getMessage()]
    assert warnings == [f"dataset '{tmp_path / 'mixed'}': {warned}"]


@pytest.mark.parametrize(
    ("corpus", "split", "config", "other", "refused"),
    [
        ("texts", None, None, "texts/a.txt", "names part of the training corpus"),
        ("texts/a.txt", None, None, "link.txt", "names the training corpus"),  # a link to the corpus
        ("texts/a.txt", None, None, "texts/b.txt", None),
        ("texts/a.txt", None, None, "hard.txt", "names the training corpus"),  # a hard link: the same file
        ("texts", None, None, "hard.txt", "names part of the training corpus"),
        ("sup/corpus.txt", None, None, "sup", "names text of the training corpus: its file 'corpus.txt'"),  # superset
        ("texts/a.txt", None, None, "copy.txt", "is a copy of the training corpus"),  # the same bytes
        ("texts", None, None, "copy.txt", "is a copy of part of the training corpus"),
        ("texts/a.txt", None, None, "mix", None),  # a copy among other text: a WARNING (below)
        ("texts/a.txt", None, None, "withempty", "is a copy of the training corpus"),  # a copy and an empty file
        ("splits", "train", None, "splits/test.txt", None),  # the corpus reads the train split alone
        ("splits", "test", None, "splits/test.txt", "names the training corpus"),
        ("me/one", "test", None, "me/one", None),  # the out-of-corpus text reads the train split
        ("me/one", None, "cfg", "me/one", None),  # another configuration may hold other text
        ("me/one", "train[:10%]+test", None, "me/one", "names part of the training corpus"),
        ("me/one", None, None, "me/other", None),
    ],
)
def test_the_out_of_corpus_text_is_refused_only_where_it_is_the_training_corpus(
    corpus, split, config, other, refused, tmp_path, monkeypatch
):
    """`--out_of_corpus_dataset` naming the training corpus gave an "out of corpus" loss that was the corpus's own,
    without a word; it is refused where its text is the corpus's (the same files however spelled, some of them, the
    same Hub dataset's train split), and text beside it (another file or split, another configuration) is not.
    A hard link of the corpus, a folder holding the corpus's file and more, and a byte-identical copy were taken;
    they are refused now (a copy among other files gets a WARNING). A copy beside an empty file got only that
    WARNING (the empty file counted as other text); a file with no text is not counted now, so it is refused."""
    import os
    import shutil

    from hf_tapernorm.app.data_checks import check_dataset_path, check_out_of_corpus_differs
    from hf_tapernorm.cli.arguments import DataArguments

    monkeypatch.chdir(tmp_path)
    for name in ("texts/a.txt", "texts/b.txt", "splits/train.txt", "splits/test.txt", "sup/more.txt", "mix/m.txt"):
        Path(name).parent.mkdir(exist_ok=True)
        Path(name).write_text("\n\n".join(corpus_documents(20, seed=sum(map(ord, name)))))
    Path("link.txt").symlink_to(tmp_path / "texts" / "a.txt")
    os.link("texts/a.txt", "hard.txt")
    os.link("texts/b.txt", "sup/corpus.txt")
    shutil.copy("texts/a.txt", "copy.txt")
    shutil.copy("texts/a.txt", "mix/copy.txt")
    Path("withempty").mkdir()
    shutil.copy("texts/a.txt", "withempty/copy.txt")
    Path("withempty/empty.txt").write_text("")
    data = DataArguments(
        dataset_name=corpus, dataset_split=split, dataset_config_name=config, out_of_corpus_dataset=other,
        out_of_corpus_blocks=2,
    )  # fmt: skip
    local = {
        "--dataset_name": check_dataset_path("--dataset_name", corpus, split, "--dataset_split"),
        "--out_of_corpus_dataset": check_dataset_path("--out_of_corpus_dataset", other),
    }
    if refused is None:
        check_out_of_corpus_differs(data, local)
        return
    with pytest.raises(DataError, match=re.escape(f"--out_of_corpus_dataset '{other}' {refused} (--dataset_name")):
        check_out_of_corpus_differs(data, local)


@pytest.mark.parametrize("form", ["jsonl", "json array", "trailing newline", "crlf", "first half"])
def test_out_of_corpus_text_of_the_corpus_documents_in_another_form_is_refused(form, tmp_path, tokenizer):
    """The corpus's documents in another form than its bytes (JSON Lines or a JSON array of its texts, one trailing
    newline, CRLF line ends, its first half) were read as out-of-corpus text without a word: only a byte copy was
    refused. The documents are compared now (line ends and surrounding white space aside): every one a corpus
    document, the out-of-corpus set is refused in one line."""
    from hf_tapernorm.cli.arguments import DataArguments
    from hf_tapernorm.data.out_of_corpus import out_of_corpus_set

    docs = corpus_documents(40, seed=3)
    (tmp_path / "corpus.txt").write_text("\n\n".join(docs))
    texts = docs[:20] if form == "first half" else docs
    name, body = {
        "jsonl": ("o.jsonl", "".join(json.dumps({"text": d}) + "\n" for d in docs)),
        "json array": ("o.json", json.dumps([{"text": d} for d in docs])),
        "trailing newline": ("o.txt", "\n\n".join(docs) + "\n"),
        "crlf": ("o.txt", "\r\n\r\n".join(d.replace("\n", "\r\n") for d in docs)),
        "first half": ("o.txt", "\n\n".join(texts)),
    }[form]
    (tmp_path / name).write_bytes(body.encode())
    data = DataArguments(dataset_name=str(tmp_path / "corpus.txt"), out_of_corpus_dataset=str(tmp_path / name),
                         out_of_corpus_blocks=2, block_size=32, data_cache_dir=str(tmp_path / "cache"))  # fmt: skip
    with pytest.raises(DataError) as refusal:
        out_of_corpus_set(data, tokenizer, [])
    assert str(refusal.value) == (
        f"--out_of_corpus_dataset '{tmp_path / name}': every one of its {len(texts)} documents is a document of the "
        f"training corpus (--dataset_name '{tmp_path / 'corpus.txt'}'), so its loss would be the corpus's own; name "
        "text the model was not trained on, or leave it out"
    )


def test_out_of_corpus_text_holding_some_corpus_documents_is_named_in_a_warning(tmp_path, tokenizer, caplog):
    """Some of the corpus's documents among other out-of-corpus text (not a byte copy of a file) were read without a
    word; a WARNING names how many of its documents are the corpus's, and the set is still built."""
    from hf_tapernorm.cli.arguments import DataArguments
    from hf_tapernorm.data.out_of_corpus import out_of_corpus_set

    docs, others = corpus_documents(40, seed=3), corpus_documents(30, seed=4)
    (tmp_path / "corpus.txt").write_text("\n\n".join(docs))
    (tmp_path / "o.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in others + docs[:10]))
    corpus, other = str(tmp_path / "corpus.txt"), str(tmp_path / "o.jsonl")
    data = DataArguments(dataset_name=corpus, out_of_corpus_dataset=other, out_of_corpus_blocks=2, block_size=32,
                         data_cache_dir=str(tmp_path / "cache"))  # fmt: skip
    with caplog.at_level("WARNING"):
        assert out_of_corpus_set(data, tokenizer, []).blocks.shape == (2, 32)
    shared, total = (sum(len(d) >= 80 for d in texts) for texts in (docs[:10], others + docs[:10]))
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        f"--out_of_corpus_dataset '{other}': {shared} of its {total} documents of 80 or more characters are documents "
        f"of the training corpus (--dataset_name '{corpus}'), so the out-of-corpus loss is partly the corpus's own; "
        "name text the model was not trained on"
    ]


def test_short_documents_shared_with_the_corpus_are_no_warning_but_all_shared_is_refused(tmp_path, tokenizer, caplog):
    """Line-cut code (argparse against optparse, --sample_by line) got "156 of 1403 documents are documents of the
    training corpus": the shared ones were `\"\"\"`, `else:` and `#`, which texts written apart share. A WARNING
    counts documents of 80 or more characters only, as paragraphs are compared. A text whose every document is the
    corpus's is still refused, however short they are: texts written apart do not share every one of theirs."""
    from hf_tapernorm.data.out_of_corpus import out_of_corpus_set

    short = ['"""', "else:", "#", "Output::", "return None"]
    docs, others = corpus_documents(40, seed=3), corpus_documents(30, seed=4)
    (tmp_path / "corpus.txt").write_text("\n\n".join(docs + short))
    (tmp_path / "o.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in others + short * 10))
    (tmp_path / "s.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in short * 10))
    corpus, other, same = (str(tmp_path / name) for name in ("corpus.txt", "o.jsonl", "s.jsonl"))
    with caplog.at_level("WARNING"):
        assert out_of_corpus_set(_ooc_data(tmp_path, corpus, other), tokenizer, []).blocks.shape == (2, 32)
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == []
    with pytest.raises(DataError) as refusal:
        out_of_corpus_set(_ooc_data(tmp_path, corpus, same), tokenizer, [])
    assert str(refusal.value) == (
        f"--out_of_corpus_dataset '{same}': every one of its 50 documents is a document of the training corpus "
        f"(--dataset_name '{corpus}'), so its loss would be the corpus's own; name text the model was not trained on, "
        "or leave it out"
    )


def test_a_line_cut_copy_of_the_corpus_is_refused_by_its_paragraphs_joined_back(tmp_path, tokenizer, caplog):
    """With --sample_by line, the corpus re-wrapped at 40 columns with CRLF line ends was evaluated as out-of-corpus
    text: every line is under 80 characters, so nothing was compared. The lines of a line-cut text (a blank line is
    an empty document) are joined back in file order, on both sides, and their paragraphs compared; another text
    cut so is read without a WARNING."""
    import textwrap

    from hf_tapernorm.data.out_of_corpus import out_of_corpus_set

    docs = corpus_documents(40, seed=3)
    (tmp_path / "corpus.txt").write_text("\n\n".join(docs))
    wrapped = "\r\n\r\n".join("\r\n".join(textwrap.wrap(d, 40)) for d in docs)
    (tmp_path / "wrapped.txt").write_bytes(wrapped.encode())
    (tmp_path / "other.txt").write_text("\n\n".join("\n".join(textwrap.wrap(d, 40)) for d in corpus_documents(40, 4)))
    corpus, other = str(tmp_path / "corpus.txt"), str(tmp_path / "wrapped.txt")
    long = [" ".join(d.split()) for d in docs if len(" ".join(d.split())) >= 80]
    with pytest.raises(DataError) as refusal:
        out_of_corpus_set(_ooc_data(tmp_path, corpus, other, sample_by="line"), tokenizer, [])
    assert str(refusal.value) == (
        f"--out_of_corpus_dataset '{other}': {len(long)} of its {len(long)} paragraphs of 80 or more characters "
        f"(100% of their text) are paragraphs of the training corpus (--dataset_name '{corpus}'), such as "
        f"{_shown(long[0])}, {_shown(long[1])}, so its loss would be the corpus's own; name text the model was not "
        "trained on, or leave it out"
    )
    with caplog.at_level("WARNING"):
        data = _ooc_data(tmp_path, corpus, str(tmp_path / "other.txt"), sample_by="line")
        assert out_of_corpus_set(data, tokenizer, []) is not None
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == []


@pytest.mark.parametrize("cap", [None, 300], ids=["joined", "past the cap"])
@pytest.mark.parametrize(
    "layout, sample_by",
    [
        ("one per line vs wrapped", "line"),
        ("wrapped vs one per line", "line"),
        ("wrapped vs one per line", "paragraph"),
    ],
)
def test_a_copy_of_the_corpus_with_one_document_per_line_is_refused_by_its_lines(
    tmp_path, tokenizer, monkeypatch, layout, sample_by, cap
):
    """A corpus of one document per line (no blank line) against its documents re-wrapped with blank lines between
    them (and the reverse) was evaluated as out-of-corpus text without a word: joined back, the lines of a file
    without blank lines are one paragraph, which matches nothing. A long line of a paragraph is compared alone too,
    on both sides, and the refusal counts a paragraph's found lines as its text; past MAX_JOINED_CHARS the lines are
    not joined (nor kept) any longer, and each is compared alone."""
    import textwrap

    from hf_tapernorm.data import out_of_corpus

    if cap is not None:
        monkeypatch.setattr(out_of_corpus, "MAX_JOINED_CHARS", cap)
    docs = [" ".join(d.split()) for d in corpus_documents(40, seed=3)]
    (tmp_path / "oneline.txt").write_text("\n".join(docs) + "\n")
    (tmp_path / "wrapped.txt").write_text("\n\n".join(textwrap.fill(d, 60) for d in docs))
    corpus, other = (str(tmp_path / n) for n in (("oneline.txt", "wrapped.txt") if layout[0] == "o" else
                                                 ("wrapped.txt", "oneline.txt")))  # fmt: skip
    long = [d for d in docs if len(d) >= 80]
    if layout[0] == "o" or cap is not None and sample_by == "line":
        count, percent, shared_as = len(long), 100, "are paragraphs of"
    else:  # one paragraph of all the lines, found by its long lines
        count, percent, shared_as = 1, 100 * sum(map(len, long)) // len(" ".join(docs)), "hold text of"
    with pytest.raises(DataError) as refusal:
        out_of_corpus.out_of_corpus_set(_ooc_data(tmp_path, corpus, other, sample_by=sample_by), tokenizer, [])
    assert str(refusal.value) == (
        f"--out_of_corpus_dataset '{other}': {count} of its {count} paragraphs of 80 or more characters "
        f"({percent}% of their text) {shared_as} the training corpus (--dataset_name '{corpus}'), such as "
        f"{_shown(long[0])}, {_shown(long[1])}, so its loss would be the corpus's own; name text the model was not "
        "trained on, or leave it out"
    )


def test_a_line_cut_text_past_the_join_cap_names_what_it_could_not_compare(tmp_path, tokenizer, monkeypatch, caplog):
    """With --sample_by line, a text with no blank line longer than MAX_JOINED_CHARS, wrapped at 60 columns, against
    the corpus's same text wrapped at 70 was evaluated without a word: past the cap its lines are compared alone, and
    all are under 80 characters. A WARNING now names the characters that could not be compared."""
    import textwrap

    from hf_tapernorm.data import out_of_corpus

    monkeypatch.setattr(out_of_corpus, "MAX_JOINED_CHARS", 2000)
    text = " ".join(" ".join(d.split()) for d in corpus_documents(40, seed=3))
    (tmp_path / "corpus.txt").write_text(textwrap.fill(text, 70) + "\n")
    (tmp_path / "rewrapped.txt").write_text(textwrap.fill(text, 60) + "\n")
    corpus, other = str(tmp_path / "corpus.txt"), str(tmp_path / "rewrapped.txt")
    with caplog.at_level("WARNING"):
        assert out_of_corpus.out_of_corpus_set(_ooc_data(tmp_path, corpus, other, sample_by="line"), tokenizer, [])
    characters = sum(len(line) for line in textwrap.wrap(text, 60))
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        _uncompared(other, corpus, characters)
    ]


def _uncompared(other: str, corpus: str, characters: int) -> str:
    return (
        f"--out_of_corpus_dataset '{other}': {characters} characters of its text were not compared with the training "
        f"corpus (--dataset_name '{corpus}'): they are lines under 80 characters in a run of more than 2000 characters "
        "with no blank line (--sample_by line), too long to join back into paragraphs and each too short to compare "
        "alone; make sure it is not the corpus's text in another form (re-wrapped), or put blank lines between its "
        "paragraphs"
    )


def test_a_line_cut_text_of_long_lines_past_the_join_cap_is_warned_of_only_for_its_short_lines(
    tmp_path, tokenizer, monkeypatch, caplog
):
    """With --sample_by line, a text of one document per line and no blank line past MAX_JOINED_CHARS, its lines of
    80 or more characters (the input --sample_by line is for), got a WARNING that all of it was "compared line by
    line only, and not found", though each line was compared. Only lines too short to compare alone are counted: here
    the last line of the text; the one long line shared with the corpus is named as a shared document."""
    import textwrap

    from hf_tapernorm.data import out_of_corpus

    monkeypatch.setattr(out_of_corpus, "MAX_JOINED_CHARS", 2000)
    text = " ".join(" ".join(d.split()) for d in corpus_documents(40, seed=3))
    shared = " ".join(" ".join(d.split()) for d in corpus_documents(2, seed=5))[:120]
    (tmp_path / "corpus.txt").write_text(textwrap.fill(text, 70) + "\n\n" + shared + "\n")
    lines = textwrap.wrap(text, 100)
    (tmp_path / "lines.txt").write_text("\n".join(lines) + "\n" + shared + "\n")
    corpus, other = str(tmp_path / "corpus.txt"), str(tmp_path / "lines.txt")
    short = [line for line in lines if len(line) < 80]
    assert len(short) == 1
    with caplog.at_level("WARNING"):
        assert out_of_corpus.out_of_corpus_set(_ooc_data(tmp_path, corpus, other, sample_by="line"), tokenizer, [])
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    long = len(lines) - len(short) + 1
    assert warnings[0].startswith(f"--out_of_corpus_dataset '{other}': 1 of its {long} documents of 80 or more ")
    assert warnings[1:] == [_uncompared(other, corpus, len(short[0]))]


def test_a_paragraph_found_by_some_of_its_lines_is_named_as_holding_corpus_text_with_its_share(
    tmp_path, tokenizer, caplog
):
    """With --sample_by paragraph, a text of one paragraph sharing two of its lines with the corpus got "1 of its 1
    paragraphs of 80 or more characters are paragraphs of the training corpus", which reads as all of it. The
    WARNING names the share of the compared text found, as the refusal does, and says the paragraph holds text of
    the corpus, not that it is one of its paragraphs."""
    from hf_tapernorm.data.out_of_corpus import out_of_corpus_set

    lines = [" ".join(d.split()) for d in corpus_documents(60, seed=3) if len(" ".join(d.split())) >= 80]
    (tmp_path / "corpus.txt").write_text("\n\n".join(lines[:20]))
    mine = [" ".join(d.split()) for d in corpus_documents(60, seed=4) if len(" ".join(d.split())) >= 80][:8]
    (tmp_path / "mine.txt").write_text("\n".join(mine[:4] + lines[3:5] + mine[4:]) + "\n")
    corpus, other = str(tmp_path / "corpus.txt"), str(tmp_path / "mine.txt")
    with caplog.at_level("WARNING"):
        assert out_of_corpus_set(_ooc_data(tmp_path, corpus, other, sample_by="paragraph"), tokenizer, [])
    percent = 100 * len(lines[3] + lines[4]) // len(" ".join(mine[:4] + lines[3:5] + mine[4:]))
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        f"--out_of_corpus_dataset '{other}': 1 of its 1 paragraphs of 80 or more characters ({percent}% of their "
        f"text) hold text of the training corpus (--dataset_name '{corpus}'), such as {_shown(lines[3])}, "
        f"{_shown(lines[4])}, so the out-of-corpus loss is partly the corpus's own; name text the model was not "
        "trained on"
    ]


def test_an_out_of_corpus_folder_holding_a_copy_of_a_corpus_file_is_named_in_a_warning(tmp_path, caplog):
    """A byte-identical copy of a corpus file among other out-of-corpus text was read as out-of-corpus text without a
    word; it is named in a WARNING (the whole out-of-corpus text a copy: refused, above)."""
    import shutil

    from hf_tapernorm.app.data_checks import check_dataset_path, check_out_of_corpus_differs
    from hf_tapernorm.cli.arguments import DataArguments

    (tmp_path / "mix").mkdir()
    (tmp_path / "corpus.txt").write_text("\n\n".join(corpus_documents(20, seed=1)))
    (tmp_path / "mix" / "other.txt").write_text("\n\n".join(corpus_documents(20, seed=2)))
    shutil.copy(tmp_path / "corpus.txt", tmp_path / "mix" / "copy.txt")
    corpus, other = str(tmp_path / "corpus.txt"), str(tmp_path / "mix")
    data = DataArguments(dataset_name=corpus, out_of_corpus_dataset=other, out_of_corpus_blocks=2)
    local = {"--dataset_name": check_dataset_path("--dataset_name", corpus)}
    local["--out_of_corpus_dataset"] = check_dataset_path("--out_of_corpus_dataset", other)
    with caplog.at_level("WARNING"):
        check_out_of_corpus_differs(data, local)
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        f"--out_of_corpus_dataset '{other}': 'copy.txt' holds the same bytes as a file of the training corpus "
        f"(--dataset_name '{corpus}'), so the out-of-corpus loss is partly the corpus's own; name text the model was "
        "not trained on"
    ]


def _ooc_data(tmp_path: Path, corpus: str, other: str, **kwargs):
    from hf_tapernorm.cli.arguments import DataArguments

    return DataArguments(dataset_name=corpus, out_of_corpus_dataset=other, out_of_corpus_blocks=2, block_size=32,
                         data_cache_dir=str(tmp_path / "cache"), **kwargs)  # fmt: skip


def _shown(paragraph: str) -> str:
    return repr(paragraph if len(paragraph) <= 40 else paragraph[:40] + "...")


@pytest.mark.parametrize("form", ["one row", "rows of three", "re-wrapped"])
def test_the_corpus_text_cut_at_other_document_boundaries_is_refused_by_its_paragraphs(form, tmp_path, tokenizer):
    """The corpus's text as one JSON Lines row (its documents joined by blank lines), as rows of three documents, or
    re-wrapped (doubled spaces, a line break inside each paragraph) was evaluated as out-of-corpus text: documents were
    compared whole only. Paragraphs of 80 or more characters are compared too (white space runs as one space), and
    a text nearly all of whose paragraphs are the corpus's is refused in one line naming two of them."""
    from hf_tapernorm.data.out_of_corpus import out_of_corpus_set

    docs = corpus_documents(40, seed=3)
    (tmp_path / "corpus.txt").write_text("\n\n".join(docs))
    rows = {
        "one row": ["\n\n".join(docs)],
        "rows of three": ["\n\n".join(docs[i : i + 3]) for i in range(0, len(docs), 3)],
        "re-wrapped": ["  ".join(d.split(" ", 4)[:4]) + " \n " + d.split(" ", 4)[4] for d in docs],
    }[form]
    (tmp_path / "o.jsonl").write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
    corpus, other = str(tmp_path / "corpus.txt"), str(tmp_path / "o.jsonl")
    long = [d for d in docs if len(d) >= 80]
    assert 0 < len(long) < len(docs)  # short ones are left out of the count
    with pytest.raises(DataError) as refusal:
        out_of_corpus_set(_ooc_data(tmp_path, corpus, other), tokenizer, [])
    assert str(refusal.value) == (
        f"--out_of_corpus_dataset '{other}': {len(long)} of its {len(long)} paragraphs of 80 or more characters "
        f"(100% of their text) are paragraphs of the training corpus (--dataset_name '{corpus}'), such as "
        f"{_shown(long[0])}, {_shown(long[1])}, so its loss would be the corpus's own; name text the model was not "
        "trained on, or leave it out"
    )


def test_only_long_shared_paragraphs_are_named_in_a_warning_not_short_common_ones(tmp_path, tokenizer, caplog):
    """Paragraphs are compared with the corpus's, but short common ones (`}`, `Returns:`, a short heading), which
    texts written apart share, are not: a text sharing only those with the corpus is read without a WARNING and not
    refused, however many of its paragraphs they are. One long corpus paragraph inside another document (which the
    whole-document comparison did not see) is named in a WARNING, and the set is still built."""
    from hf_tapernorm.data.out_of_corpus import out_of_corpus_set, paragraphs_compared

    def code(prose: list[str]) -> list[str]:
        return [f"Returns:\n\n{p}\n\n}}\n\n}}\n\nExample usage" for p in prose]

    docs, others = corpus_documents(40, seed=3), corpus_documents(30, seed=4)
    long = [d for d in docs if len(d) >= 80]
    (tmp_path / "corpus.txt").write_text("\n\n".join(code(docs)))
    (tmp_path / "o.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in code(others)))
    (tmp_path / "p.jsonl").write_text(
        "".join(json.dumps({"text": d}) + "\n" for d in code(others[:-1]) + [others[-1] + "\n\n" + long[5]])
    )
    corpus = str(tmp_path / "corpus.txt")
    counted = sum(len(d) >= 80 for d in others) + 1
    compared = sum(len(p) for d in others for p in paragraphs_compared(d)) + len(" ".join(long[5].split()))
    percent = 100 * len(" ".join(long[5].split())) // compared
    with caplog.at_level("WARNING"):
        assert out_of_corpus_set(_ooc_data(tmp_path, corpus, str(tmp_path / "o.jsonl")), tokenizer, []) is not None
        assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == []
        assert out_of_corpus_set(_ooc_data(tmp_path, corpus, str(tmp_path / "p.jsonl")), tokenizer, []) is not None
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        f"--out_of_corpus_dataset '{tmp_path / 'p.jsonl'}': 1 of its {counted} paragraphs of 80 or more characters "
        f"({percent}% of their text) are paragraphs of the training corpus (--dataset_name '{corpus}'), such as "
        f"{_shown(long[5])}, so the out-of-corpus loss is partly the corpus's own; name text the model was not trained "
        "on"
    ]


@pytest.mark.parametrize("sample_by", ["paragraph", "line"])
@pytest.mark.parametrize("layout", ["rules under headings", "rules between documents", "drawn table borders"])
def test_rule_lines_shared_with_the_corpus_are_no_text_to_compare(layout, sample_by, tmp_path, tokenizer, caplog):
    """An unrelated out-of-corpus text sharing only rule lines of 80 `-` or `=` with the corpus got a WARNING: "80 of
    its 80 paragraphs ... hold text of the training corpus ..., such as '-----...'" (a rule under every heading), or
    "79 of its 159 documents ... are documents of the training corpus" (one rule between documents, counted 79
    times). A line, paragraph or document without a letter or a digit (a rule, a drawn table's border) is layout,
    no text to compare: the set is built without a WARNING."""
    from hf_tapernorm.data.out_of_corpus import out_of_corpus_set

    def laid_out(docs: list[str], heading: str) -> str:
        if layout == "rules under headings":
            return "\n\n".join(f"{heading} {i}\n{'-' * 80}\n{d}" for i, d in enumerate(docs))
        if layout == "rules between documents":
            return f"\n\n{'=' * 80}\n\n".join(docs)
        border = "+" + "-" * 30 + "+" + "-" * 48 + "+"
        return "\n\n".join(
            f"{heading} {i}\n{'╔' + '═' * 80 + '╗'}\n{border}\n{d}\n{border}" for i, d in enumerate(docs)
        )

    (tmp_path / "corpus.txt").write_text(laid_out(corpus_documents(40, seed=3), "Part"))
    (tmp_path / "other.txt").write_text(laid_out(corpus_documents(40, seed=4), "Chapter"))
    corpus, other = str(tmp_path / "corpus.txt"), str(tmp_path / "other.txt")
    with caplog.at_level("WARNING"):
        assert out_of_corpus_set(_ooc_data(tmp_path, corpus, other, sample_by=sample_by), tokenizer, []) is not None
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == []


LICENCE_LINE = "This chapter is licensed under the Creative Commons Attribution-ShareAlike 4.0 International License."


def test_a_licence_line_repeated_in_both_texts_is_counted_at_each_repeat_and_is_no_refusal(tmp_path, tokenizer, caplog):
    """A licence line under every heading of the corpus and of an unrelated out-of-corpus text: the loss is taken
    over every repeat, so each paragraph holding it counts, with the share of the text it is (every repeat's
    characters), and that share, under NEARLY_ALL, is a WARNING, not a refusal. Counting a repeated text once would
    understate how much of the loss is the corpus's own."""
    from hf_tapernorm.data.out_of_corpus import out_of_corpus_set

    def laid_out(docs: list[str], heading: str) -> str:
        return "Table of Contents\n\n" + "\n\n".join(f"{heading} {i}\n{LICENCE_LINE}\n{d}" for i, d in enumerate(docs))

    docs, others = corpus_documents(40, seed=3), corpus_documents(40, seed=4)
    (tmp_path / "corpus.txt").write_text(laid_out(docs, "Part"))
    (tmp_path / "other.txt").write_text(laid_out(others, "Chapter"))
    corpus, other = str(tmp_path / "corpus.txt"), str(tmp_path / "other.txt")
    with caplog.at_level("WARNING"):
        assert out_of_corpus_set(_ooc_data(tmp_path, corpus, other), tokenizer, []) is not None
    paragraphs = [f"Chapter {i} {LICENCE_LINE} {d}" for i, d in enumerate(others)]
    percent = 100 * len(LICENCE_LINE) * len(paragraphs) // sum(map(len, paragraphs))
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        f"--out_of_corpus_dataset '{other}': {len(paragraphs)} of its {len(paragraphs)} paragraphs of 80 or more "
        f"characters ({percent}% of their text) hold text of the training corpus (--dataset_name '{corpus}'), such as "
        f"{_shown(LICENCE_LINE)}, so the out-of-corpus loss is partly the corpus's own; name text the model was not "
        "trained on"
    ]


def test_a_streamed_corpus_says_the_out_of_corpus_text_was_compared_by_file_only(tmp_path, tokenizer, caplog):
    """With --streaming the corpus's documents were not compared with the out-of-corpus text, without a word: the
    corpus's documents as JSON Lines were evaluated as out-of-corpus text, where without --streaming they are refused.
    A stream is not read twice, so the set is still built, and a WARNING says the text was compared by file only."""
    from hf_tapernorm.data.out_of_corpus import out_of_corpus_set

    docs = corpus_documents(40, seed=3)
    (tmp_path / "corpus.txt").write_text("\n\n".join(docs))
    (tmp_path / "o.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    corpus, other = str(tmp_path / "corpus.txt"), str(tmp_path / "o.jsonl")
    with caplog.at_level("WARNING"):
        assert out_of_corpus_set(_ooc_data(tmp_path, corpus, other, streaming=True), tokenizer, []) is not None
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        f"--out_of_corpus_dataset '{other}': compared with the training corpus (--dataset_name '{corpus}') by file "
        "only, not by its text: a streamed corpus (--streaming) is not read twice; make sure it is not the corpus's "
        "text in another form, or leave --streaming out to have its text compared"
    ]


# ======================================================================== what a data file holds, told by its option
@pytest.mark.parametrize(
    "name, content",
    [
        ("bom.txt", b"\xef\xbb\xbf"),
        ("blank.txt", b"\n\n  \n\t\n"),
        ("bom.md", b"\xef\xbb\xbf\n"),
        ("blank.csv", b"\n\n\n"),
        ("bomblank.csv", b"\xef\xbb\xbf\n\n"),
        ("nbsp.txt", "\u00a0\u2003\n\u3000\n\n\u00a0".encode() * 5000),  # Unicode's, over several chunks
        ("zw.txt", "\u200b\ufeff\u200d \n\u2060\n\n".encode() * 10),  # zero-width spaces, joiners, marks
        ("vs.txt", "\ufe0e\ufe0f\u034f\n\u180b\u17b4\n".encode() * 10),  # variation selectors, U+034F
        ("hangul.txt", "\u3164\u115f\u1160\uffa0\n".encode() * 10),  # Hangul fillers
        ("tags.txt", "".join(map(chr, range(0xE0020, 0xE0080))).encode() + "\U000e0001\U000e01ef".encode()),
    ],
)
def test_a_file_of_white_space_alone_is_refused_as_empty(tmp_path, name, content):
    """A .txt of a UTF-8 byte-order mark alone was refused in datasets' words (SchemaInferenceError: Please pass
    `features`), a .csv of blank lines in pandas' (EmptyDataError: No columns to parse from file), and a .txt or .md
    of white space as "too small ... split the text into more", advice that cannot help, and a .txt of Unicode white
    space alone (no-break, em and ideographic spaces) so still, and one of zero-width spaces and marks (which show
    nothing) too, or read as out-of-corpus text of invisible characters, and one of other default-ignorable
    characters (variation selectors, Hangul fillers, tag characters, U+034F) still so. Each is empty, told as a
    0-byte file, a header-only CSV or `[]` is, before any builder reads it."""
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DataError) as refused:
        load_text_dataset(str(path), cache_dir=str(tmp_path / "c"), name=f"--dataset_name '{path}'")
    what = "no text" if name.endswith((".txt", ".md")) else "no rows"
    assert str(refused.value) == f"--dataset_name '{path}' is empty: the file holds {what}"


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16-be"])
@pytest.mark.parametrize("in_folder", [False, True], ids=["a file", "in a folder"])
def test_a_utf16_file_is_named_with_the_command_that_converts_it(tmp_path, encoding, in_folder):
    """A UTF-16 file (its byte-order mark first) was refused as "dataset 'X' is not UTF-8 text (invalid start byte
    at byte 0 of a file); ... iconv -f latin1", advice that mangles it, and in a folder without naming the file. It
    is named now, told UTF-16 by its mark, with the iconv command that converts it, under the option's name."""
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("plain text\n\nand more")
    path = folder / "b.txt"
    path.write_bytes("\ufeffwide text\n\nand more".encode(encoding))
    source = folder if in_folder else path
    subject = f"--out_of_corpus_dataset '{source}'"
    with pytest.raises(DataError) as refused:
        load_text_dataset(str(source), cache_dir=str(tmp_path / "c"), name=subject, split_option=None)
    command = f"iconv -f utf-16 -t utf-8 '{path}' > '{folder / 'b.utf8.txt'}'"
    told = "UTF-16 text (told by its byte-order mark), not UTF-8"
    assert str(refused.value) == (
        f"{subject}: its file 'b.txt' is {told}: convert it ({command}) and move the UTF-16 file out of the folder"
        if in_folder
        else f"{subject} is {told}: convert it ({command}) and name the file it writes"
    )


@pytest.mark.parametrize(
    "encoding, told",
    [
        ("utf-16-le", "UTF-16LE text without a byte-order mark (NUL every other byte)"),
        ("utf-16-be", "UTF-16BE text without a byte-order mark (NUL every other byte)"),
        ("utf-32-le", "UTF-32LE text without a byte-order mark (NUL three bytes of every four)"),
    ],
)
@pytest.mark.parametrize("in_folder", [False, True], ids=["a file", "in a folder"])
def test_a_file_of_nul_bytes_is_refused_before_it_is_read(tmp_path, encoding, told, in_folder):
    """A UTF-16 file without a byte-order mark (a NUL every other byte, which is valid UTF-8) was evaluated as text
    of NULs with --sample_by line, or refused as "too small". A file whose first chunk is largely NUL is refused
    before any builder reads it, naming it and the iconv command its NULs' places tell (a path with a quote quoted
    for the shell); binary data of NULs is refused as not UTF-8 text; a stray NUL in real text is read."""
    import shlex
    import subprocess

    folder = tmp_path / "it's"
    folder.mkdir()
    (folder / "a.txt").write_text("plain text\n\nand more")
    path = folder / "b.txt"
    path.write_bytes("wide text, café\n\nand more\n".encode(encoding) * 50)
    source = folder if in_folder else path
    subject = f"--dataset_name '{source}'"
    with pytest.raises(DataError) as refused:
        load_text_dataset(str(source), cache_dir=str(tmp_path / "c"), name=subject, sample_by="line")
    iconv = encoding.replace("-", "").replace("utf", "utf-")
    command = f"iconv -f {iconv} -t utf-8 {shlex.quote(str(path))} > {shlex.quote(str(folder / 'b.utf8.txt'))}"
    assert str(refused.value) == (
        f"{subject}: its file 'b.txt' is {told}, not UTF-8: convert it ({command}) and move the "
        f"{iconv.upper()[:6]} file out of the folder"
        if in_folder
        else f"{subject} is {told}, not UTF-8: convert it ({command}) and name the file it writes"
    )
    subprocess.run(command, shell=True, check=True)
    assert (folder / "b.utf8.txt").read_text() == "wide text, café\n\nand more\n" * 50
    (tmp_path / "bin.txt").write_bytes(b"\x00\x00\x07\x00\x01" * 100)
    with pytest.raises(DataError) as refused:
        load_text_dataset(str(tmp_path / "bin.txt"), cache_dir=str(tmp_path / "c"), name="--dataset_name 'bin.txt'")
    assert str(refused.value) == (
        "--dataset_name 'bin.txt': it holds NUL bytes, so it is not UTF-8 text (binary data, or text in another "
        "encoding): name a UTF-8 text file"
    )
    (tmp_path / "stray.txt").write_text("plain text\x00 with one stray NUL\n\nand more")
    assert len(load_text_dataset(str(tmp_path / "stray.txt"), cache_dir=str(tmp_path / "c"))) == 2


@pytest.mark.parametrize("utf8_bytes", [3001, 78001], ids=["within the first chunk", "past it"])
@pytest.mark.parametrize("in_folder", [False, True], ids=["a file", "in a folder"])
def test_utf8_text_followed_by_utf16_is_refused_naming_where_its_nuls_begin(tmp_path, utf8_bytes, in_folder):
    """UTF-8 text followed by UTF-16LE text (`cat a.txt b16.txt`, the UTF-16 part at an odd offset) was refused as
    "UTF-16BE text without a byte-order mark" with an iconv command that fails; with 78 KB of UTF-8 first, only the
    first 64 KB was looked at, and the file was read as text with a NUL between characters, without a word. Its last
    chunk is read too, and both are refused as UTF-8 text up to the byte where NULs begin, with no iconv of the whole
    file. A UTF-8 file past the first chunk, without a NUL, is read; a UTF-16LE file of that size is told as before."""
    import subprocess

    words = ["plain", "text", "words", "café", "more"]
    utf8 = "\n\n".join(" ".join(random.Random(i).choice(words) for _ in range(12)) for i in range(20000)).encode()
    utf8 = utf8[: utf8_bytes - 2].decode("utf-8", "ignore").encode() + b"\n\n"
    assert len(utf8) % 2 == 1  # the UTF-16 part starts at an odd offset: its NULs lie at even ones
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("plain text\n\nand more")
    path = folder / "half.txt"
    path.write_bytes(utf8 + "wide text, café\n\nand more\n".encode("utf-16-le") * 3000)
    source = folder if in_folder else path
    subject = f"--dataset_name '{source}'"
    with pytest.raises(DataError) as refused:
        load_text_dataset(str(source), cache_dir=str(tmp_path / "c"), name=subject)
    what = "its file 'half.txt'" if in_folder else "it"
    todo = ", or move the file out of the folder" if in_folder else ", and name the UTF-8 text"
    assert str(refused.value) == (
        f"{subject}: {what} is UTF-8 text in its first {len(utf8) + 1} bytes, then holds NUL bytes from byte "
        f"{len(utf8) + 1} (text in another encoding, or binary data): split that part off or convert it alone to "
        f"UTF-8{todo}"
    )
    path.write_bytes(utf8 * 2)
    assert len(load_text_dataset(str(path), cache_dir=str(tmp_path / "c"), sample_by="paragraph")) > 0
    path.write_bytes("wide text, café\n\nand more\n".encode("utf-16-le") * 3000)
    with pytest.raises(DataError) as refused:
        load_text_dataset(str(path), cache_dir=str(tmp_path / "c"), name="t")
    command = f"iconv -f utf-16le -t utf-8 '{path}' > '{folder / 'half.utf8.txt'}'"
    assert str(refused.value).endswith(
        f"(NUL every other byte), not UTF-8: convert it ({command}) and name the file it writes"
    )
    subprocess.run(command, shell=True, check=True)


@pytest.mark.parametrize("pad", [100, 4096], ids=["100 NULs", "4 KiB of NULs"])
@pytest.mark.parametrize("lines", [600, 3000], ids=["a small file", "past the first chunk"])
def test_utf8_text_padded_with_a_run_of_nuls_is_refused_naming_where_they_begin(tmp_path, pad, lines):
    """UTF-8 text followed by a run of NULs (a NUL-padded or truncated file) under an eighth of the chunk that holds
    them was read with the NULs in its text, without a word (refused only from an eighth on). A run of 16 NULs or
    more, which no text holds, is refused naming the byte where they begin; UTF-32 text (runs of two or three NULs)
    is told as UTF-32 as before."""
    text = b"".join(b"plain english text line number %d for probing\n" % i for i in range(lines))
    path = tmp_path / "pad.txt"
    path.write_bytes(text + bytes(pad))
    with pytest.raises(DataError) as refused:
        load_text_dataset(str(path), cache_dir=str(tmp_path / "c"), name="--dataset_name 'pad.txt'")
    assert str(refused.value) == (
        f"--dataset_name 'pad.txt': it is UTF-8 text in its first {len(text)} bytes, then holds NUL bytes from byte "
        f"{len(text)} (text in another encoding, or binary data): split that part off or convert it alone to UTF-8, "
        "and name the UTF-8 text"
    )
    path.write_bytes(text.decode().encode("utf-32-le"))
    with pytest.raises(DataError) as refused:
        load_text_dataset(str(path), cache_dir=str(tmp_path / "c"), name="t")
    assert "t is UTF-32LE text without a byte-order mark (NUL three bytes of every four)" in str(refused.value)


def test_a_run_of_nuls_across_the_last_chunks_start_or_after_a_terminal_log_is_told(tmp_path):
    """Sixteen NULs across the start of the last 64 KiB read (8 on each side of it) were read without a word, and a
    UTF-8 log holding ANSI colours (ESC), a title sequence's BEL or a progress bar's backspace before its NUL padding
    was told "not UTF-8 text ... name a UTF-8 text file", where the same log without them is told UTF-8 up to the
    NULs. The last chunk is read from MIN_NUL_RUN bytes earlier, and those count as text's."""
    from hf_tapernorm.data.file_contents import _CHUNK, MIN_NUL_RUN

    size = 200_000
    offset = (size - _CHUNK) // 4 * 4  # where the last chunk was read from
    text = b"".join(b"plain english text line number %d for probing\n" % i for i in range(10_000))
    path = tmp_path / "straddle.txt"
    path.write_bytes(text[: offset - 8] + bytes(MIN_NUL_RUN) + text[offset + 8 : size])
    with pytest.raises(DataError) as refused:
        load_text_dataset(str(path), cache_dir=str(tmp_path / "c"), name="s")
    assert f"then holds NUL bytes from byte {offset - 8} " in str(refused.value)
    log = b"\x1b]0;title\x07" + b"".join(b"\x1b[31mERROR\x1b[0m request %d failed 9\x08%%\n" % i for i in range(50))
    path.write_bytes(log + bytes(32))
    with pytest.raises(DataError) as refused:
        load_text_dataset(str(path), cache_dir=str(tmp_path / "c"), name="s")
    assert str(refused.value).startswith(f"s: it is UTF-8 text in its first {len(log)} bytes, then holds NUL bytes")


@pytest.mark.parametrize("size", [70_000, 100_000], ids=["under two chunks", "past two chunks"])
def test_nuls_after_the_first_chunk_of_a_small_file_are_named_at_their_start(tmp_path, size):
    """A file of 64 to 128 KiB whose NULs lie past its first 64 KiB (UTF-8 then UTF-16, or NUL padding) was
    refused in a Python error's words ("read length must be non-negative"): the last chunk's read start fell below
    the first chunk's end. It is told as before, naming where the NULs begin, and a run across byte 65536 is named
    from its true start."""
    text = b"".join(b"plain english text line number %d for probing\n" % i for i in range(5000))[:size]
    path = tmp_path / "cat16.txt"
    path.write_bytes(text + "abc def\n".encode("utf-16-le") * 5000)
    with pytest.raises(DataError) as refused:
        load_text_dataset(str(path), cache_dir=str(tmp_path / "c"), name="s")
    assert str(refused.value).startswith(f"s: it is UTF-8 text in its first {size + 1} bytes, then holds NUL bytes ")
    path.write_bytes(text[: 65536 - 8] + bytes(16) + text[65536 + 8 :])
    with pytest.raises(DataError) as refused:
        load_text_dataset(str(path), cache_dir=str(tmp_path / "c"), name="s")
    assert str(refused.value).startswith(f"s: it is UTF-8 text in its first {65536 - 8} bytes, then holds NUL bytes ")


def test_nuls_past_the_scanned_chunks_are_named_at_the_latest_not_at_a_false_byte(tmp_path, monkeypatch):
    """17 MiB of UTF-8 then UTF-16 was refused naming "NUL bytes from byte 18240257", the start of the last chunk:
    the scan for the first NUL stops after _SCANNED_CHUNKS chunks, and the NULs began at byte 17825793. Where the scan
    stops short, the byte is named as the latest where they begin (here with the scan cut to one chunk)."""
    from hf_tapernorm.data import file_contents

    monkeypatch.setattr(file_contents, "_SCANNED_CHUNKS", 1)
    text = b"".join(b"plain english text line number %d for probing\n" % i for i in range(5000))
    path = tmp_path / "half.txt"
    path.write_bytes(text + "abc def ghi\n".encode("utf-16-le") * 20000)
    end = (path.stat().st_size - (1 << 16)) // 4 * 4 - file_contents.MIN_NUL_RUN  # where the last chunk is read
    with pytest.raises(DataError) as refused:
        load_text_dataset(str(path), cache_dir=str(tmp_path / "c"), name="--dataset_name 'half.txt'")
    assert str(refused.value) == (
        f"--dataset_name 'half.txt': it is UTF-8 text at its start, then holds NUL bytes by byte {end + 1} at the "
        "latest (text in another encoding, or binary data): split that part off or convert it alone to UTF-8, and "
        "name the UTF-8 text"
    )
    monkeypatch.setattr(file_contents, "_SCANNED_CHUNKS", 256)
    with pytest.raises(DataError) as refused:
        load_text_dataset(str(path), cache_dir=str(tmp_path / "c"), name="t")
    assert f"in its first {len(text) + 1} bytes, then holds NUL bytes from byte {len(text) + 1} " in str(refused.value)


@pytest.mark.parametrize(
    "encoding, words, told",
    [
        ("utf-16-le", ["привет", "мир", "это", "текст", "большой", "книга"], "NUL at odd offsets only"),
        ("utf-16-be", ["καλημέρα", "κόσμε", "αυτό", "είναι", "κείμενο", "βιβλίο"], "NUL at even offsets only"),
    ],
)
def test_utf16_without_a_mark_whose_letters_are_not_ascii_is_refused(tmp_path, encoding, words, told):
    """Cyrillic UTF-16LE without a byte-order mark (a NUL only after its spaces and line ends, below an eighth of its
    bytes, the rest valid UTF-8) was read as text of control characters, or refused as "too small"; Greek UTF-16BE
    was refused as "invalid start byte ... iconv -f latin1", which gives mojibake. Both are told UTF-16 by where
    their NULs lie (one parity only, and `0A 00` / `00 0A` line ends), with the iconv command that converts them. A
    UTF-8 text with a NUL every 200 bytes, at one parity too, is read."""
    import subprocess

    text = "\n\n".join(" ".join(random.Random(i).choice(words) for _ in range(40)) for i in range(30)) + "\n"
    path = tmp_path / "t.txt"
    path.write_bytes(text.encode(encoding))
    assert text.encode(encoding).count(0) * 8 < len(text.encode(encoding))  # below nul_bytes' share of ASCII text
    with pytest.raises(DataError) as refused:
        load_text_dataset(str(path), cache_dir=str(tmp_path / "c"), name="--dataset_name 't.txt'", sample_by="line")
    iconv = encoding.replace("-", "").replace("utf", "utf-")
    command = f"iconv -f {iconv} -t utf-8 '{path}' > '{tmp_path / 't.utf8.txt'}'"
    assert str(refused.value) == (
        f"--dataset_name 't.txt' is {iconv.upper()} text without a byte-order mark ({told}), not UTF-8: convert it "
        f"({command}) and name the file it writes"
    )
    subprocess.run(command, shell=True, check=True)
    assert (tmp_path / "t.utf8.txt").read_text() == text
    (tmp_path / "every200.txt").write_bytes((("x" * 59 + "\n") * 3 + "y" * 19 + "\0").encode() * 200)
    every200 = load_text_dataset(str(tmp_path / "every200.txt"), cache_dir=str(tmp_path / "c"), sample_by="line")
    assert len(every200) == 601 and sum("\0" in line for line in every200["text"]) == 200


@pytest.mark.parametrize(
    "encoding, words, told",
    [
        ("utf-16-le", ["достопримечательность", "непредсказуемость", "высокопревосходительство"], "odd"),
        ("utf-16-be", ["ηλεκτρομαγνητισμός", "αλληλοσυμπληρωματικός", "αντιπροσωπευτικότητα"], "even"),
    ],
)
def test_utf16_without_a_mark_of_one_line_is_told_by_its_alphabet(tmp_path, encoding, words, told):
    """Cyrillic UTF-16LE without a byte-order mark, one line of long words (its NULs, after its spaces only, under a
    thirty-second of its bytes, no UTF-16 line end) was read as control characters and refused as "too small". Its
    high bytes are NUL or 04 (one alphabet): told UTF-16LE. UTF-8 Cyrillic records each ending in a NUL at an odd
    offset, fewer than a thirty-second of its bytes, are read."""
    rng = random.Random(1)
    text = " ".join(rng.choice(words) for _ in range(300))
    path = tmp_path / "t.txt"
    path.write_bytes(text.encode(encoding))
    assert text.encode(encoding).count(0) >= 8 and text.encode(encoding).count(0) * 32 < len(text.encode(encoding))
    with pytest.raises(DataError) as refused:
        load_text_dataset(str(path), cache_dir=str(tmp_path / "c"), name="--dataset_name 't.txt'")
    iconv = encoding.replace("-", "").replace("utf", "utf-")
    assert str(refused.value).startswith(
        f"--dataset_name 't.txt' is {iconv.upper()} text without a byte-order mark (NUL at {told} offsets only)"
    )
    records = tmp_path / "records.txt"
    records.write_bytes("привет мир, как дела сегодня\0".encode() * 200)
    assert {i % 2 for i, byte in enumerate(records.read_bytes()) if byte == 0} == {1}
    assert len(load_text_dataset(str(records), cache_dir=str(tmp_path / "c"))) == 1


def test_a_printed_command_of_a_relative_path_starting_with_a_dash_runs(tmp_path, monkeypatch):
    """`--dataset_name=-x16.txt` (UTF-16LE without a mark, named relative) printed `iconv ... '-x16.txt' > ...`,
    which iconv refused ("invalid option -- 'x'"): quoting does not stop a leading '-' from being read as an option.
    A relative path starting with '-' is printed as './-x16.txt' in every printed command, and the command runs."""
    import subprocess

    monkeypatch.chdir(tmp_path)
    Path("-x16.txt").write_bytes("wide text\n\nand more\n".encode("utf-16-le") * 20)
    with pytest.raises(DataError) as refused:
        load_text_dataset("-x16.txt", cache_dir=str(tmp_path / "c"), name="--dataset_name '-x16.txt'")
    command = "iconv -f utf-16le -t utf-8 './-x16.txt' > './-x16.utf8.txt'"
    assert str(refused.value) == (
        f"--dataset_name '-x16.txt' is UTF-16LE text without a byte-order mark (NUL every other byte), not UTF-8: "
        f"convert it ({command}) and name the file it writes"
    )
    subprocess.run(command, shell=True, check=True)
    assert Path("-x16.utf8.txt").read_text() == "wide text\n\nand more\n" * 20
    Path("-x.tar.gz").write_bytes(b"")
    with pytest.raises(DataError) as refused:
        load_text_dataset("-x.tar.gz", cache_dir=str(tmp_path / "c"))
    assert "extract it (tar -xzf './-x.tar.gz')" in str(refused.value)


def test_a_printed_command_quotes_a_path_holding_a_quote_for_the_shell(tmp_path):
    """The iconv command of a UTF-16 file under `it's/` was printed as `iconv ... '/x/it's/u.txt'`, broken shell.
    Every printed command of the data refusals (iconv, gunzip, tar, ...) quotes its paths as shlex.quote does, and
    the printed iconv command runs."""
    import subprocess

    folder = tmp_path / "it's"
    folder.mkdir()
    (folder / "u.txt").write_text("wide text\n\nand more", encoding="utf-16")
    with pytest.raises(DataError) as refused:
        load_text_dataset(str(folder / "u.txt"), cache_dir=str(tmp_path / "c"))
    quoted = str(folder).replace("'", "'\"'\"'")
    command = f"iconv -f utf-16 -t utf-8 '{quoted}/u.txt' > '{quoted}/u.utf8.txt'"
    assert str(refused.value) == (
        f"dataset '{folder}/u.txt' is UTF-16 text (told by its byte-order mark), not UTF-8: convert it ({command}) "
        "and name the file it writes"
    )
    subprocess.run(command, shell=True, check=True)
    assert (folder / "u.utf8.txt").read_text() == "wide text\n\nand more"
    (folder / "x.tar.gz").write_bytes(b"")
    with pytest.raises(DataError) as refused:
        load_text_dataset(str(folder / "x.tar.gz"), cache_dir=str(tmp_path / "c"))
    assert f"extract it (tar -xzf '{quoted}/x.tar.gz')" in str(refused.value)


def test_a_folder_s_file_that_is_not_utf8_is_named(tmp_path):
    """In a folder, a file that is not UTF-8 was told as "not UTF-8 text (... at byte 9 of a file)": which file, the
    user had to find. The file is named, and the byte in it."""
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("plain text\n\nand more")
    (folder / "b.txt").write_bytes("a b c\n\nd \xff f".encode("latin-1"))
    with pytest.raises(DataError) as refused:
        load_text_dataset(str(folder), cache_dir=str(tmp_path / "c"), name=f"--dataset_name '{folder}'")
    assert str(refused.value) == (
        f"--dataset_name '{folder}': its file 'b.txt' is not UTF-8 text (invalid start byte at byte 9); convert it to "
        "UTF-8 (e.g. iconv -f latin1 -t utf-8), or pass a text file"
    )


def test_rows_of_null_text_name_the_dataset_and_no_column_option_where_no_other_column_holds_text(tmp_path, tokenizer):
    """JSONL rows `{"text": null}` were refused as "row 0 of the dataset has no 'text' value ...; fix the data, or pass
    --text_column": no file named, and the column option cannot help where `text` is the only column. The dataset is
    named; the option is advised only where the row holds text in another column."""
    name = str(_jsonl(tmp_path / "nulls.jsonl", [None] * 150))
    with pytest.raises(DataError) as refused:
        _prepare(load_text_dataset(name, cache_dir=str(tmp_path / "c")), tokenizer, source=name)
    assert str(refused.value) == (
        f"row 0 of dataset '{name}' has no 'text' value: every row needs its text in 'text'; fix the data"
    )
    (tmp_path / "other.jsonl").write_text('{"text": null, "body": "words"}\n' * 150)
    with pytest.raises(DataError) as refused:
        _prepare(load_text_dataset(str(tmp_path / "other.jsonl"), cache_dir=str(tmp_path / "c")), tokenizer)
    assert str(refused.value).endswith(
        "(it has body): every row needs its text in 'text'; fix the data, or pass --text_column"
    )


def _zip(path: Path) -> None:
    import zipfile

    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("inner.txt", "zipped text\n\nand more")


def _tar(path: Path) -> None:
    import io
    import tarfile

    mode = "w:gz" if path.name.endswith(("gz", "tgz")) else "w:xz"
    with tarfile.open(path, mode) as archive:
        data = b"packed text"
        info = tarfile.TarInfo("inner.txt")
        info.size = len(data)
        archive.addfile(info, io.BytesIO(data))


def _compressed(path: Path) -> None:
    import gzip
    import lzma

    data = b"compressed text"
    path.write_bytes(lzma.compress(data) if path.suffix == ".xz" else gzip.compress(data))


@pytest.mark.parametrize(
    "name, write, refusal",
    [
        ("o.zip", _zip, "an archive (.zip) is not read; extract it (unzip '{path}') and name the data file it writes, "
         "or a folder of them"),
        ("x.tar.gz", _tar, "an archive (.tar.gz) is not read; extract it (tar -xzf '{path}') and name the data file "
         "it writes, or a folder of them"),
        ("x.tgz", _tar, "an archive (.tgz) is not read; extract it (tar -xzf '{path}') and name the data file it "
         "writes, or a folder of them"),
        ("x.tar.xz", _tar, "an archive (.tar.xz) is not read; extract it (tar -xJf '{path}') and name the data file "
         "it writes, or a folder of them"),
        ("x.gz", _compressed, "a compressed file (.gz) is not read; decompress it (gzip -dc '{path}' > "
         "'{path.parent}/x') and name the file it writes ('x') with the suffix of its type (.csv, .json, .jsonl, .md, "
         ".parquet, .text, .txt)"),
        ("x.xz", _compressed, "a compressed file (.xz) is not read; decompress it (xz -dc '{path}' > "
         "'{path.parent}/x') and name the file it writes ('x') with the suffix of its type (.csv, .json, .jsonl, .md, "
         ".parquet, .text, .txt)"),
    ],
)  # fmt: skip
def test_an_archive_is_refused_alone_and_named_in_a_folder(tmp_path, caplog, name, write, refusal):
    """A .zip was refused as an unsupported file type, and x.tar.gz, x.tgz or x.gz too, without a word of what to
    do; in a folder beside text files they were skipped without a WARNING, where a .txt.gz is named in one. (datasets
    itself extracts a .zip in a folder of text files, which the checks before loading cannot read.) Named alone, each
    is refused with the command that unpacks it; in a folder, named in the WARNING of the files not read."""
    from hf_tapernorm.data.sources import local_splits

    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("plain text\n\nand more")
    path = folder / name
    write(path)
    with pytest.raises(DataError) as refused:
        local_splits(str(path), f"--out_of_corpus_dataset '{path}'")
    assert str(refused.value) == f"--out_of_corpus_dataset '{path}': " + refusal.format(path=path)
    with caplog.at_level("WARNING"):
        assert local_splits(str(folder), f"--out_of_corpus_dataset '{folder}'") == (
            "text",
            {"train": [folder / "a.txt"]},
        )
    assert [r.getMessage() for r in caplog.records] == [
        f"--out_of_corpus_dataset '{folder}': its 1 compressed file(s) ({name}) are not read, as the checks before "
        "loading cannot read them; decompress them in the folder (gunzip -k FILE, unzip FILE, tar -xzf FILE, ...) to "
        "read their text"
    ]
