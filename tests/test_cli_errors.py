"""Arguments the CLI refuses before it loads a model, trains or writes anything: one line on stderr, exit status 2.

Each row is a command (a function of the workspace, and of the fixtures the row names) with its exit status and
fragments of its one-line error; a new early refusal is a new row. Every row also checks that the workspace (and
every folder fixture it names) is left as it was, byte for byte, and that ``taper`` did not load the model.
conversion_scripts/experiments/reports/probe.md lists where the rows came from, with the outcome before and after.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

import pytest
import yaml
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from hf_tapernorm._temporaries import process_command
from hf_tapernorm.app.fingerprints import fingerprint
from tests.conftest import build, char_tokenizer, corpus_documents, tiny_llama_config
from tests.helpers import copy_run as copy_of
from tests.helpers import edit_json, error_of, finished_run, one_model_workspace, run_main, taper_argv, truncate
from tests.helpers import short_eval_argv as evaluate
from tests.helpers import short_fold_argv as fold
from tests.helpers import short_taper_argv as taper


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
    root = one_model_workspace(tmp_path_factory.mktemp("cli_errors"))
    (root / "texts").mkdir()
    for index in range(3):
        (root / "texts" / f"part{index}.txt").write_text("\n\n".join(corpus_documents(60, seed=index)))
    build(tiny_llama_config(), seed=1).save_pretrained(root / "other_tokenizer")
    _reordered_tokenizer().save_pretrained(root / "other_tokenizer")
    build(tiny_llama_config(vocab_size=100)).save_pretrained(root / "small_vocab")
    char_tokenizer().save_pretrained(root / "small_vocab")  # 128 tokens
    (root / "empty.txt").write_text("")
    (root / "binary.txt").write_bytes(bytes(range(128, 256)) * 20)
    (root / "emptydir").mkdir()
    (root / "nocol.csv").write_text("a,b\n1,2\n")
    (root / "tiny.txt").write_text("short\n\nx\n")
    (root / "nulls.jsonl").write_text(
        "".join(json.dumps({"text": None if i % 2 else f"document {i} " * 8}) + "\n" for i in range(200))
    )
    mixed = [{"text" if i % 2 else "content": text} for i, text in enumerate(corpus_documents(60))]
    (root / "mixed.jsonl").write_text("".join(json.dumps(row) + "\n" for row in mixed))
    lists = [{"text": [text] if i % 3 == 1 else text} for i, text in enumerate(corpus_documents(60))]
    (root / "lists.jsonl").write_text("".join(json.dumps(row) + "\n" for row in lists))
    (root / "digits.csv").write_text("text\n" + "".join(f"{10**80 + i}\n" for i in range(40)))
    (root / "list.yaml").write_text("- a\n- b\n")
    (root / "empty.yaml").write_text("")
    (root / "unknown.yaml").write_text("max_steps: 4\nbogus_option: 3\n")
    (root / "badjson").mkdir()
    (root / "badjson" / "config.json").write_text("{bad")
    return root


@pytest.fixture(scope="module")
def short_run(ws) -> Path:
    """A finished 6-step run (checkpoint-6, tapered/, folded/, report.json); the rows that name it edit copies."""
    return finished_run(taper(ws, ws / "run"))


def _eval(ws: Path, *extra: str) -> list[str]:
    return [
        "eval", "--model_name_or_path", str(ws / "llama"), "--dataset_name", str(ws / "corpus.txt"),
        "--block_size", "32", "--heldout_blocks", "4", "--heldout_percentage", "10", "--out_of_corpus_blocks", "0",
        "--scan_windows", "2", *extra,
    ]  # fmt: skip


def _bench(ws: Path, *extra: str, modes: str = "last") -> list[str]:
    """``bench`` on the workspace's model; ``modes``: the --modes (a later --modes in ``extra`` adds to them)."""
    return [
        "bench", "--model_name_or_path", str(ws / "llama"), "--modes", modes, "--seq_lens", "16", "--repeats", "1",
        "--warmup", "0", "--calibration_batches", "1", "--op_counts", "false",
        "--output_dir", str(ws / "bench"), *extra,
    ]  # fmt: skip


def _trainer(flags: list[str]):
    """``taper`` with Trainer ``flags`` on the workspace (10 steps, the taper over steps 2..6)."""
    return lambda ws: taper_argv(ws, ws / "out", *flags)


def _taper(ws: Path, *extra: str, model: str = "llama", data: str = "corpus.txt") -> list[str]:
    return [
        "taper", "--model_name_or_path", str(ws / model), "--dataset_name", str(ws / data), "--block_size", "32",
        "--heldout_blocks", "4", "--heldout_percentage", "10", "--max_steps", "4", "--per_device_train_batch_size", "2",
        "--output_dir", str(ws / "out"), "--use_cpu", "--disable_tqdm", "true", "--out_of_corpus_blocks", "0",
        "--scan_windows", "0", *extra,
    ]  # fmt: skip


def _options_with_a_flag(ws, run, tmp):
    (tmp / "run.yaml").write_text(yaml.safe_dump({"max_steps": 6, "output_dir": str(tmp / "out")}))
    return ["taper", str(tmp / "run.yaml"), "--max_steps", "4"]


def _taper_options_file(**options):
    """``taper run.json``: _taper's run as an options file, with ``options`` besides."""

    def make(ws, tmp):
        values = {
            "model_name_or_path": str(ws / "llama"), "dataset_name": str(ws / "corpus.txt"), "block_size": 32,
            "heldout_blocks": 4, "heldout_percentage": 10, "max_steps": 4, "per_device_train_batch_size": 2,
            "output_dir": str(tmp / "out"), "use_cpu": True, "out_of_corpus_blocks": 0, "scan_windows": 0,
        }  # fmt: skip
        (tmp / "run.json").write_text(json.dumps({**values, **options}))
        return ["taper", str(tmp / "run.json")]

    return make


def _options_folder(ws, tmp):
    (tmp / "run.json").mkdir()
    return ["taper", str(tmp / "run.json")]


def _overwrite_damaged_manifest(ws, run, tmp):
    folder = copy_of(run, tmp)
    truncate(folder / ".hf_tapernorm_run.json", 50)
    return taper(ws, folder, "--overwrite")


def _eval_folded_config_float(ws, run, tmp):
    folder = copy_of(run, tmp)
    edit_json(folder / "folded" / "config.json", hidden_size=32.0)
    return evaluate(folder / "folded", data=ws / "corpus.txt")


def _edited_tapered(command, edit):
    """eval or fold of a copy of the run whose tapered/ folder ``edit`` changed."""

    def make(ws, run, tmp):
        folder = copy_of(run, tmp)
        edit(folder / "tapered")
        if command == "eval":
            return evaluate(folder / "tapered", data=ws / "corpus.txt")
        return fold(folder / "tapered", tmp / "export")

    return make


def _tapered_config_string(command):
    return _edited_tapered(command, lambda tapered: edit_json(tapered / "config.json", num_hidden_layers="2"))


def _truncated_tapernorm_config(command):
    return _edited_tapered(command, lambda tapered: truncate(tapered / "tapernorm_config.json"))


def _without_file(command, name):
    """eval or fold of a copy of the run whose tapered/ folder lacks ``name``."""
    return _edited_tapered(command, lambda tapered: (tapered / name).unlink())


def _weightless_model(command, name="model.safetensors", files: dict[str, str] | None = None):
    """``bench``, ``taper`` or ``eval`` of a copy of the workspace's model without its file ``name``, holding
    ``files`` (name -> text) instead."""

    def make(ws, run, tmp):
        model = shutil.copytree(ws / "llama", tmp / "llama")
        (model / name).unlink()
        for file, text in (files or {}).items():
            (model / file).write_text(text)
        argv = {"bench": _bench, "taper": _taper, "eval": _eval}[command](ws)
        return [*argv[:2], str(model), *argv[3:]]

    return make


def _baseline_from_tapered_without_its_recipe(ws, run, tmp):
    """taper --baseline_from a copy of the run's tapered/ without its tapernorm_config.json."""
    tapered = copy_of(run, tmp) / "tapered"
    (tapered / "tapernorm_config.json").unlink()
    return _taper(ws, "--baseline_from", str(tapered))


def _fold_of_a_plain_folder_without_config(ws, run, tmp):
    """fold --checkpoint of a copy of the workspace's model without its config.json."""
    model = shutil.copytree(ws / "llama", tmp / "llama")
    (model / "config.json").unlink()
    return ["fold", "--checkpoint", str(model), "--output_dir", str(tmp / "out")]


def _edited_manifest(entry):
    def make(ws, run, tmp):
        folder = copy_of(run, tmp)
        manifest = folder / "folded" / ".hf_tapernorm_export.json"
        files = json.loads(manifest.read_text())["files"]
        manifest.write_text(json.dumps({"tool": "hf-tapernorm", "files": [*files, entry]}))
        return ["push", "--export_dir", str(folder / "folded"), "--repo_id", "me/x"]

    return make


def _dangling_link(ws: Path, command: str, target: str) -> str:
    """``ws/links/COMMAND``, a symbolic link to ``ws/links/TARGET``, which does not exist."""
    link = ws / "links" / command
    link.parent.mkdir(exist_ok=True)
    if link.is_symlink():
        link.unlink()
    link.symlink_to(ws / "links" / target)
    return str(link)


def _incomplete_export(ws, run, tmp):
    """``eval`` of a copy of the run's export that a write killed while moving its files into place left without
    its tokenizer's files (its manifest lists them)."""
    folder = copy_of(run, tmp)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / "folded" / name).unlink()
    return evaluate(folder / "folded", data=ws / "corpus.txt")


def _incomplete_reference(ws, run, tmp):
    """``eval --scan_reference`` of a copy of the run's export that lacks its tokenizer.json."""
    folder = copy_of(run, tmp)
    (folder / "folded" / "tokenizer.json").unlink()
    return evaluate(run / "folded", "--scan_windows", "2", "--scan_reference", str(folder / "folded"))


def _push_without_a_card(ws, run, tmp):
    """``push --export_dir`` of a copy of the run's export whose README.md was deleted."""
    folder = copy_of(run, tmp)
    (folder / "folded" / "README.md").unlink()
    return ["push", "--export_dir", str(folder / "folded"), "--repo_id", "me/x"]


def _fold_beside_a_live_write(*extra: str):
    """``fold`` into an empty folder an export_folded is writing into (its marked ``.hf_tapernorm_writing-PID``, of
    a running process)."""

    def make(ws, run, tmp):
        from hf_tapernorm._temporaries import WRITE_MARK

        container = tmp / "D" / f".hf_tapernorm_writing-{os.getppid()}"
        container.mkdir(parents=True)
        (container / WRITE_MARK).write_text("")
        return fold(run / "tapered", tmp / "D", *extra)

    return make


def _push_with(relative: str):
    def make(ws, run, tmp):
        folder = copy_of(run, tmp)
        (folder / "folded" / relative).parent.mkdir(parents=True, exist_ok=True)
        (folder / "folded" / relative).write_text("hf_not_a_real_token")
        return ["push", "--export_dir", str(folder / "folded"), "--repo_id", "me/x"]

    return make


def _resume_with_edited_checkpoint_config(ws, run, tmp):
    folder = copy_of(run, tmp)
    edit_json(folder / "checkpoint-6" / "tapernorm_config.json", ema_rate=0.5)
    return taper(ws, folder, "--resume")


def _data(name: str, text: str):
    def make(ws, run, tmp):
        (tmp / name).write_text(text)
        return taper(ws, tmp / "out", data=str(tmp / name))

    return make


def _copy(source: Path, target: Path) -> Path:
    """``target``, a copy of the file ``source``."""
    target.write_bytes(source.read_bytes())
    return target


def _written(target: Path, text: str, encoding: str = "utf-8") -> Path:
    """``target``, written with ``text`` (in ``encoding``)."""
    target.write_text(text, encoding=encoding)
    return target


def _with_hard_link(ws: Path, folder: Path) -> Path:
    """``folder``, holding a hard link of the workspace's corpus.txt and another text file."""
    folder.mkdir()
    os.link(ws / "corpus.txt", folder / "corpus.txt")
    (folder / "other.txt").write_text("\n\n".join(corpus_documents(40, seed=7)))
    return folder


def _without_tapered(run: Path) -> Path:
    """The copy ``run`` as a run that stopped before it wrote tapered/ (and folded/): its checkpoint-N only."""
    for name in ("tapered", "folded", "report.json"):
        path = run / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return run


def _without(run: Path, *names: str) -> Path:
    """The copy ``run`` without the folders ``names``."""
    for name in names:
        shutil.rmtree(run / name)
    return run


def _without_checkpoints(run: Path) -> Path:
    """The copy ``run`` without its checkpoint-N folders: a run that stopped before it saved one."""
    return _without(run, *(p.name for p in run.glob("checkpoint-*")))


def _stopped_mid_taper(run: Path) -> Path:
    """The copy ``run`` as a run that stopped before its taper ended: its checkpoint-N saved at gate 0.5."""
    from safetensors.torch import load_file, save_file

    for weights in run.glob("checkpoint-*/model.safetensors"):
        tensors = load_file(weights)
        save_file({k: v.fill_(0.5) if k.endswith(".gate") else v for k, v in tensors.items()}, weights)
    return run


def _without_records(run: Path) -> Path:
    """The copy ``run`` with no record of its model: no identity in its manifest, no checkpoint's tapernorm_run.json."""
    edit_json(run / ".hf_tapernorm_run.json", identity={})
    for record in run.glob("checkpoint-*/tapernorm_run.json"):
        record.unlink()
    return run


def _with_relative_model(run: Path, ws: Path) -> Path:
    """The copy ``run`` as a run started with a relative model path, 'llama' from the run's parent folder (where
    ``llama`` is, a link to the workspace's model), killed before its report: its records name 'llama'."""
    (run.parent / "llama").symlink_to(ws / "llama")
    edit_json(run / ".hf_tapernorm_run.json", identity={"model": "llama", "model_contents": "0" * 64})
    for record in run.glob("checkpoint-*/tapernorm_run.json"):
        record.unlink()
    return run


def _held(folder: Path) -> Path:
    """``folder`` with the lock of a running hf-tapernorm command (this test's parent process, alive) in it."""
    folder.mkdir()
    (folder / ".hf_tapernorm_run.lock").write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname()}))
    return folder


def _flag_before_options_file(command: str, *flags: str):
    """``command FLAGS run.json``: the options file (which exists) after a flag instead of first and alone."""

    def make(ws, tmp):
        values = {
            "taper": {"model_name_or_path": str(ws / "llama"), "output_dir": str(tmp / "out")},
            "eval": {"model_name_or_path": str(ws / "llama")},
            "fold": {"checkpoint": str(ws / "llama"), "output_dir": str(tmp / "out")},
            "push": {"export_dir": str(ws / "llama"), "repo_id": "me/x"},
        }[command]
        (tmp / "run.json").write_text(json.dumps(values))
        return [command, *(flag.format(tmp=tmp) for flag in flags), str(tmp / "run.json")]

    return make


#: a path under the home folder of a user this machine does not have: Path.expanduser raised a bare RuntimeError
NO_USER = "~nosuchuser/x"
#: the one line that refuses it, after the option and the path as typed
NO_USER_LINE = (
    "'~nosuchuser/x': there is no user 'nosuchuser' on this machine, so '~nosuchuser' names no home folder; write "
    "the path in full, or start it with ~/ for your own home folder"
)
#: command -> its arguments on the workspace, an option and its value given last (it wins over the same option
#: before it)
WITH_OPTION = {
    "taper": lambda ws, option, value: [*_taper(ws), option, value],
    "eval": lambda ws, option, value: _eval(ws, option, value),
    "fold": lambda ws, option, value: fold(ws / "llama", ws / "f", option, value),
    "push": lambda ws, option, value: ["push", "--export_dir", str(ws / "llama"), "--repo_id", "me/x", option, value],
    "bench": lambda ws, option, value: _bench(ws, "--modes", "train", option, value),
}
#: command -> its path options
PATH_OPTIONS = {
    "taper": ["--output_dir", "--dataset_name", "--out_of_corpus_dataset", "--data_cache_dir", "--model_name_or_path",
              "--baseline_from"],
    "eval": ["--model_name_or_path", "--dataset_name", "--out_of_corpus_dataset", "--data_cache_dir", "--output_json",
             "--scan_reference"],
    "fold": ["--checkpoint", "--output_dir"],
    "push": ["--export_dir"],
    "bench": ["--model_name_or_path", "--dataset_name", "--output_dir"],
}  # fmt: skip


def _no_user_in_options_file(ws, tmp):
    (tmp / "run.yaml").write_text(yaml.safe_dump({"model_name_or_path": str(ws / "llama"), "output_dir": NO_USER}))
    return ["taper", str(tmp / "run.yaml")]


def _earlier_result(ws: Path, name: str) -> Path:
    """``ws / name``, an earlier result of eval there when ``name`` ends in .json (a file --output_json may replace)."""
    if name.endswith(".json"):
        (ws / name).write_text(json.dumps({"written_by": "hf-tapernorm eval"}))
    return ws / name


#: the fixtures a row of a finished run needs (besides the workspace): the run, and a folder to copy it into
NEEDS_RUN = ("short_run", "tmp_path")

#: name -> (the command's arguments, a function of the workspace and of the fixtures named last; its exit status;
#: a fragment, or fragments, of its error line; the fixtures, if any)
CASES = {
    "bench: a compile backend torch does not know": (
        lambda ws: _bench(ws, "--execution", "compile", "--compile_backend", "bogus"),
        2,
        "--compile_backend 'bogus' is not a torch.compile backend that compiles a model here: give one of ",
    ),
    # torch lists its own test backends with the debug ones: each passed the check, then failed with a traceback at
    # the first compiled forward, after the model loaded (torchscript's with a mode: "unexpected keyword argument")
    **{
        f"bench: --compile_backend {backend} (a torch test backend)": (
            lambda ws, backend=backend: _bench(ws, "--execution", "compile", "--compile_backend", backend),
            2,
            f"error: --compile_backend {backend!r} is not a torch.compile backend that compiles a model here: give "
            "one of aot_eager, ",
        )
        for backend in ("ts", "aot_ts", "dynamo_minifier_backend")
    },
    "bench: a compile mode with a backend other than inductor": (
        lambda ws: _bench(ws, "--execution", "compile", "--compile_backend", "eager", "--compile_mode", "max-autotune"),
        2,
        "error: --compile_mode max-autotune: a mode is inductor's (torch.compile's default backend), and "
        "--compile_backend eager takes none; drop --compile_mode, or compile with inductor",
    ),
    "taper: a compile mode with a backend other than inductor": (
        _trainer(["--torch_compile_backend", "cudagraphs", "--torch_compile_mode", "max-autotune"]),
        2,
        "error: --torch_compile_mode max-autotune: a mode is inductor's (torch.compile's default backend), and "
        "--torch_compile_backend cudagraphs takes none",
    ),
    # options no case of the run reads were ignored without a word, and recorded in bench.json as if used (exit 0)
    "bench: inference options with --modes train only": (
        lambda ws: _bench(ws, "--variants", "flashnorm", "--norms", "all", "--new_tokens", "64", modes="train"),
        2,
        "error: --norms, --variants: read by --modes last, full or decode only, and --modes train has no last, full "
        "or decode; add last, full or decode to --modes, or leave them out",
    ),
    # the original and flashnorm are one each whatever --norms says: it was recorded in settings, read by none
    **{
        f"bench: --norms with --variants {' '.join(variants)}": (
            lambda ws, variants=variants: _bench(ws, "--variants", *variants, "--norms", "all"),
            2,
            f"error: --norms: read by --variants explicit, folded or limit only, and --variants {' '.join(variants)} "
            "has no explicit, folded or limit; add explicit, folded or limit to --variants, or leave it out",
        )
        for variants in (("original", "flashnorm"), ("original",))
    },
    # compiled cases time torch only: the ONNX graphs were exported, no ort-* variant timed, onnxruntime recorded
    "bench: --runtimes onnxruntime with --execution compile only": (
        lambda ws: _bench(ws, "--runtimes", "torch", "onnxruntime", "--execution", "compile"),
        2,
        "error: --runtimes onnxruntime runs its graphs as exported, not compiled, and --execution compile has no "
        "eager; add eager to --execution, or leave onnxruntime out",
    ),
    "bench: --new_tokens without decode": (
        lambda ws: _bench(ws, "--new_tokens", "64"),
        2,
        "error: --new_tokens: read by --modes decode only, and --modes last has no decode; add decode to --modes, or "
        "leave it out",
    ),
    "bench: --seed with --modes train only": (
        lambda ws: _bench(ws, "--seed", "3", modes="train"),
        2,
        "error: --seed: read by --modes last, full or decode only",
    ),
    **{
        f"bench: {option} without --execution compile": (
            lambda ws, option=option, value=value: _bench(ws, option, value),
            2,
            f"error: {option}: read by --execution compile only, and --execution eager has no compile; add compile "
            "to --execution, or leave it out",
        )
        for option, value in (("--compile_mode", "max-autotune"), ("--compile_backend", "aot_eager"))
    },
    # measured and rejected: research arms (conversion_scripts/experiments/length_arms.py), not product options
    "taper: long steps are no option": (
        lambda ws: taper_argv(ws, ws / "out", "--long_block_size", "64", "--long_block_every", "4"),
        2,
        ["unrecognized arguments", "--long_block_size"],
    ),
    "bench --threads beyond any machine's CPUs": (
        lambda ws: _bench(ws, "--threads", "1", "99999"),
        2,
        ["error: --threads 99999: more than the ", "pass at most "],
    ),
    "bench --modes train with a missing --dataset_name": (
        lambda ws: _bench(ws, "--modes", "train", "--dataset_name", str(ws / "nope.txt")),
        2,
        "error: --dataset_name '{ws}/nope.txt' not found: no such file or folder",
    ),
    # the train mode's options were ignored without a word when --modes has no train (exit 0)
    "bench: dataset options without --modes train": (
        lambda ws: _bench(ws, "--dataset_name", str(ws / "corpus.txt"), "--text_column", "nosuch"),
        2,
        "error: --dataset_name, --text_column: read by --modes train only, and --modes last has no train; add train "
        "to --modes, or leave them out",
    ),
    "bench: a train option without --modes train": (
        lambda ws: _bench(ws, "--modes", "decode", "--learning_rate", "0.01"),  # after _bench's --modes last
        2,
        "error: --learning_rate: read by --modes train only, and --modes last decode has no train; add train to "
        "--modes, or leave it out",
    ),
    "eval --data_cache_dir that is a file": (
        lambda ws: _eval(ws, "--data_cache_dir", str(ws / "corpus.txt")),
        2,
        "error: --data_cache_dir '{ws}/corpus.txt' is a file",
    ),
    "eval: position spans are no option": (
        lambda ws: ["eval", "--model_name_or_path", str(ws / "llama"), "--position_span", "256"],
        2,
        ["unrecognized arguments", "--position_span"],
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
    # a '..' after a missing folder in an output option: bench --output_dir missing/.. replaced the user's
    # bench.json in the folder above and left a stray missing/; taper accepted missing/../run (a stray missing/ left
    # even when refused later), eval said "not writable", fold "the working folder". Every output option now refuses
    # it in utils.dangling_parent_step's words (app/data_checks.output_target), before anything is created
    **{
        f"{command}: a '..' after a missing folder in {option} {tail}": (
            lambda ws, run, tmp, make=make, tail=tail: make(ws, run, str(ws / "missing" / ".." / tail).rstrip("/")),
            2,
            f"error: {option} '{{ws}}/missing/..{'/' + tail if tail else ''}': '{{ws}}/missing' does not exist, so "
            f"the '..' after it names no folder; name the folder without '..' ('{{ws}}{'/' + tail if tail else ''}')",
            NEEDS_RUN,
        )
        for command, option, make in (
            ("taper", "--output_dir", lambda ws, run, out: [*taper_argv(ws, ws / "x"), "--output_dir", out]),
            ("bench", "--output_dir", lambda ws, run, out: _bench(ws, "--output_dir", out)),
            ("eval", "--output_json", lambda ws, run, out: _eval(ws, "--output_json", out)),
            (
                "fold",
                "--output_dir",
                lambda ws, run, out: ["fold", "--checkpoint", str(run / "tapered"), "--output_dir", out],
            ),
        )
        for tail in ("", "out.json" if option == "--output_json" else "out")
    },
    # a symbolic link to a folder that does not exist as an output (or on the way to --output_json's file): bench
    # and taper said "cannot write into output folder 'dl': File exists EEXIST", eval "the folder 'dl' does not
    # exist; create it first" (mkdir dl fails). Every output option now refuses it in export_folded's words
    # (app/data_checks.refuse_dangling_output), before anything is created
    **{
        f"{command}: {option} through a link to a missing folder ({target})": (
            lambda ws, run, tmp, make=make, name=command, target=target: make(
                ws, run, _dangling_link(ws, name, target)
            ),
            2,
            f"error: {option} '{{ws}}/links/{command}{'/r.json' if option == '--output_json' else ''}': "
            f"'{{ws}}/links/{command}' is a link to a folder that does not exist ('{{ws}}/links/{target}'); create "
            "that folder, or choose another",
            NEEDS_RUN,
        )
        for command, option, make in (
            ("taper", "--output_dir", lambda ws, run, out: [*taper_argv(ws, ws / "x"), "--output_dir", out]),
            ("bench", "--output_dir", lambda ws, run, out: _bench(ws, "--output_dir", out)),
            ("eval", "--output_json", lambda ws, run, out: _eval(ws, "--output_json", out + "/r.json")),
            (
                "fold",
                "--output_dir",
                lambda ws, run, out: ["fold", "--checkpoint", str(run / "tapered"), "--output_dir", out],
            ),
        )
        for target in ("gone", "nowhere/gone")
    },
    # an output inside a dataset folder the command reads was written there, and every later command on
    # that folder refused it ("mixes file types (json, text)"); each is now refused as taper's --output_dir is
    "eval: the result file inside the dataset folder": (
        lambda ws: [*_eval(ws, "--output_json", str(ws / "texts" / "res.json")), "--dataset_name", str(ws / "texts")],
        2,
        "error: --output_json '{ws}/texts/res.json' lies inside --dataset_name '{ws}/texts', which eval reads: the "
        "result would become part of that input (every later command would read it changed); choose an "
        "--output_json outside it",
    ),
    "eval: the result file inside the out-of-corpus dataset folder": (
        lambda ws: _eval(
            ws,
            "--out_of_corpus_blocks",
            "4",
            "--out_of_corpus_dataset",
            str(ws / "texts"),
            "--output_json",
            str(ws / "texts" / "res.json"),
        ),
        2,
        "error: --output_json '{ws}/texts/res.json' lies inside --out_of_corpus_dataset '{ws}/texts', which eval reads",
    ),
    "bench: the output folder inside the train mode's dataset folder": (
        lambda ws: _bench(
            ws, "--modes", "train", "--dataset_name", str(ws / "texts"), "--output_dir", str(ws / "texts" / "b")
        ),
        2,
        "error: --output_dir '{ws}/texts/b' lies inside --dataset_name '{ws}/texts', which bench's train mode reads: "
        "bench.json and bench.png would become part of that input (every later command would read it changed); "
        "choose an --output_dir outside it",
    ),
    # bench's and eval's outputs inside the model they read, or an export, joined that model folder (exit 0; a push
    # then refused the export until they were moved)
    "bench: the output folder is the model it reads": (
        lambda ws: _bench(ws, "--output_dir", str(ws / "llama")),
        2,
        "error: --output_dir '{ws}/llama' is --model_name_or_path '{ws}/llama', which bench reads: bench.json and "
        "bench.png would become part of that input (every later command would read it changed); choose an "
        "--output_dir outside it",
    ),
    "bench: the output folder inside an export": (
        lambda ws, run, tmp: _bench(ws, "--output_dir", str(run / "folded" / "b")),
        2,
        [
            "error: --output_dir '",
            "/folded/b' lies in '",
            "/folded', a saved model's folder: bench.json and bench.png "
            "would join the model (a push would upload them); choose an --output_dir outside it",
        ],
        NEEDS_RUN,
    ),
    "eval: the result file inside the model it evaluates": (
        lambda ws: _eval(ws, "--output_json", str(ws / "llama" / "eval.json")),
        2,
        "error: --output_json '{ws}/llama/eval.json' lies inside --model_name_or_path '{ws}/llama', which eval reads: "
        "the result would become part of that input",
    ),
    "eval: the result file inside the scan's reference": (
        lambda ws: _eval(
            ws, "--scan_reference", str(ws / "other_tokenizer"), "--output_json", str(ws / "other_tokenizer" / "r.json")
        ),
        2,
        "error: --output_json '{ws}/other_tokenizer/r.json' lies inside --scan_reference '{ws}/other_tokenizer', "
        "which eval reads",
    ),
    "eval: the result file inside an export it does not read": (
        lambda ws, run, tmp: _eval(ws, "--output_json", str(run / "folded" / "eval.json")),
        2,
        [
            "error: --output_json '",
            "/folded/eval.json' lies in '",
            "/folded', a saved model's folder: the result "
            "would join the model (a push would upload them); choose an --output_json outside it",
        ],
        NEEDS_RUN,
    ),
    # bench's and eval's outputs inside a taper run's folder, fold's export inside another saved model or
    # a run (but as its own folded/): written, then the run refused --overwrite and the outer export push
    "bench: the output folder inside a taper run's folder": (
        lambda ws, run, tmp: _bench(ws, "--output_dir", str(run / "bench")),
        2,
        [
            "error: --output_dir '",
            "/run/bench' lies in '",
            "/run', a taper run's folder: bench.json and bench.png would mix with the run's files, which its "
            "--overwrite and --resume then refuse; choose an --output_dir outside it",
        ],
        NEEDS_RUN,
    ),
    "eval: the result file inside a taper run's folder": (
        lambda ws, run, tmp: _eval(ws, "--output_json", str(run / "eval.json")),
        2,
        [
            "error: --output_json '",
            "/run/eval.json' lies in '",
            "/run', a taper run's folder: the result would mix with the run's files, which its --overwrite and "
            "--resume then refuse; choose an --output_json outside it",
        ],
        NEEDS_RUN,
    ),
    "fold: the export inside an earlier export": (
        lambda ws, run, tmp: fold(run / "tapered", run / "folded" / "inner"),
        2,
        [
            "error: --output_dir '",
            "/run/folded/inner' lies in '",
            "/run/folded', a saved model's folder: the export would join the model (a push would upload them); "
            "choose an --output_dir outside it",
        ],
        NEEDS_RUN,
    ),
    "fold: the export inside a base model's folder": (
        lambda ws, run, tmp: fold(run / "tapered", ws / "llama" / "export"),
        2,
        "error: --output_dir '{ws}/llama/export' lies in '{ws}/llama', a saved model's folder: the export would join "
        "the model (a push would upload them); choose an --output_dir outside it",
        NEEDS_RUN,
    ),
    "fold: the export inside a taper run's folder, not its folded/": (
        lambda ws, run, tmp: fold(run / "tapered", run / "export"),
        2,
        [
            "error: --output_dir '",
            "/run/export' lies in '",
            "/run', a taper run's folder: the export would mix with the run's files, which its --overwrite and "
            "--resume then refuse; choose an --output_dir outside it (or the run's own export, ",
            "/run/folded)",
        ],
        NEEDS_RUN,
    ),
    "fold: the export inside the dataset folder that its run read and the scan reads": (
        lambda ws, tmp: fold(
            finished_run(taper(ws, tmp / "run", data="texts")) / "tapered", ws / "texts" / "exp", "--scan_windows", "2"
        ),
        2,
        "error: --output_dir '{ws}/texts/exp' lies inside the run's --dataset_name '{ws}/texts', which fold's "
        "robustness scan (--scan_windows 2) reads: the export would become part of that input (every later command "
        "would read it changed); choose an --output_dir outside it",
        ("tmp_path",),
    ),
    # --scan_reference with --scan_windows 0 was never read, without a word
    "eval: --scan_reference with --scan_windows 0": (
        lambda ws: _eval(ws, "--scan_windows", "0", "--scan_reference", str(ws / "other_tokenizer")),
        2,
        "error: --scan_reference '{ws}/other_tokenizer' is read only by the robustness scan, and --scan_windows 0 "
        "runs none: give --scan_windows N (N > 0) to scan against it, or leave --scan_reference out",
    ),
    "eval: a scan reference with another tokenizer of the same size": (
        lambda ws: _eval(ws, "--scan_reference", str(ws / "other_tokenizer")),
        2,
        "has another tokenizer than '{ws}/llama' (126 of 128 token ids are other text)",
    ),
    # Trainer options: refused before the model loads
    "taper: --adam_beta2 2": (
        _trainer(["--adam_beta2", "2"]),
        2,
        "with these options: ValueError: Invalid beta parameter at index 1: 2.0",
    ),
    "taper: --learning_rate nan": (
        _trainer(["--learning_rate", "nan"]),
        2,
        "argument --learning_rate/--learning-rate: must be a finite number, got nan",
    ),
    "taper: --learning_rate -1": (_trainer(["--learning_rate", "-1"]), 2, "ValueError: Invalid learning rate: -1.0"),
    "taper: --max_grad_norm inf": (
        _trainer(["--max_grad_norm", "inf"]),
        2,
        "argument --max_grad_norm/--max-grad-norm: must be a finite number, got inf",
    ),
    # a reporter whose package is absent (wandb comes with the interpretability extra's TransformerLens)
    "taper: --report_to clearml": (
        _trainer(["--report_to", "clearml"]),
        2,
        "--report_to ['clearml']: RuntimeError: ClearMLCallback requires 'clearml'",
    ),
    # two reporters were one, "clearml,wandb is not supported": each is checked now
    "taper: --report_to clearml,wandb": (
        _trainer(["--report_to", "clearml,wandb"]),
        2,
        "--report_to ['clearml', 'wandb']: RuntimeError: ClearMLCallback requires 'clearml'",
    ),
    "taper: --report_to tensorboard,none": (
        _trainer(["--report_to", "tensorboard,none"]),
        2,
        "--report_to tensorboard,none: none stands alone (none: no reporter; all: every installed one); name the "
        "reporters without it",
    ),
    # each got its own callback: every log reported twice, only transformers' own warning said so
    "taper: --report_to wandb,wandb": (
        lambda ws: _taper(ws, "--report_to", "wandb,wandb"),
        2,
        ["--report_to wandb,wandb: a reporter named twice; name each once"],
    ),
    # Trainer options the Trainer (or torch) reads only once the model is loaded: it ended with a traceback and a
    # failed run's folder
    "taper: --torch_compile_mode bogus": (
        _trainer(["--torch_compile_mode", "bogus"]),
        2,
        "error: --torch_compile_mode 'bogus' is not a torch.compile mode: default, ",
    ),
    "taper: --torch_compile_backend bogus": (
        _trainer(["--torch_compile_backend", "bogus"]),
        2,
        "error: --torch_compile_backend 'bogus' is not a torch.compile backend that compiles a model here: give one "
        "of aot_eager, ",
    ),
    # torch lists tvm whether or not its package is installed (not in this environment): the first compiled forward
    # raised ImportError as a traceback, after the model loaded
    "taper: --torch_compile_backend tvm without its package": (
        _trainer(["--torch_compile_backend", "tvm"]),
        2,
        "error: --torch_compile_backend tvm: the backend compiles with tvm, not installed here: pip install "
        "apache-tvm, or choose another backend (inductor is the default)",
    ),
    "bench: --compile_backend tvm without its package": (
        lambda ws: _bench(ws, "--execution", "compile", "--compile_backend", "tvm"),
        2,
        "error: --compile_backend tvm: the backend compiles with tvm, not installed here: pip install apache-tvm, or "
        "choose another backend",
    ),
    "taper: a torch.compile debug backend other than eager and aot_eager": (
        _trainer(["--torch_compile_backend", "aot_eager_decomp_partition"]),
        2,
        "error: --torch_compile_backend 'aot_eager_decomp_partition' is not a torch.compile backend that compiles a "
        "model here: give one of aot_eager, ",
    ),
    "taper: --neftune_noise_alpha -5": (
        _trainer(["--neftune_noise_alpha", "-5"]),
        2,
        "error: --neftune_noise_alpha must be >= 0 (the scale of the noise NEFTune adds to the embeddings), got -5.0",
    ),
    "taper: --fsdp full_shard in one process": (
        _trainer(["--fsdp", "full_shard"]),
        2,
        "error: --fsdp: FSDP shards the model over the processes of a distributed launch, and this run is one "
        "process; launch it with torchrun",
    ),
    "bench: a compile mode torch does not know": (
        lambda ws: _bench(ws, "--execution", "compile", "--compile_mode", "bogus"),
        2,
        "error: --compile_mode 'bogus' is not a torch.compile mode: default, ",
    ),
    # every seed in --seed's range: torch's generator kept the low 32 bits (2**32 drew seed 0's held-out blocks, -1
    # those of 2**32 - 1) and failed beyond 64 bits, in eval after the model loaded
    **{
        f"{command} {option} {value}": (
            lambda ws, make=WITH_OPTION[command], option=option, value=value: make(ws, option, value),
            2,
            f"error: {option} must be in [0, 2**32 - 1], got {value}",
        )
        for command, option, value in [
            ("eval", "--heldout_seed", str(2**64)),
            ("eval", "--heldout_seed", str(2**32)),
            ("eval", "--heldout_seed", "-1"),
            ("taper", "--heldout_seed", str(2**64)),
            ("taper", "--data_seed", str(2**32)),
            ("taper", "--data_seed", "-1"),
            ("bench", "--seed", "-1"),
        ]
    },
    # bench's train text, checked as taper's and eval's: a configuration was recorded in bench.json, and ignored
    "bench --modes train: a configuration of a local file": (
        lambda ws: _bench(
            ws, "--modes", "train", "--dataset_name", str(ws / "corpus.txt"), "--dataset_config_name", "c"
        ),
        2,
        "error: --dataset_config_name c: a configuration is one of a Hub dataset's; the local dataset "
        "'{ws}/corpus.txt' has none",
    ),
    "bench --modes train: a configuration of the embedded corpus": (
        lambda ws: _bench(ws, "--modes", "train", "--dataset_config_name", "c"),
        2,
        "error: --dataset_config_name c: a configuration is one of a Hub dataset's; the embedded corpus has none",
    ),
    # TaperTrainingArguments redeclares lr_scheduler_type as text: "COSINE is not a valid SchedulerType", naming no
    # option, where every other bad choice names its option (and the options file it came from)
    "taper: --lr_scheduler_type COSINE": (
        _trainer(["--lr_scheduler_type", "COSINE"]),
        2,
        "error: argument --lr_scheduler_type/--lr-scheduler-type: invalid choice: 'COSINE' (choose from 'linear', ",
    ),
    "taper: lr_scheduler_type: COSINE in an options file": (
        _taper_options_file(lr_scheduler_type="COSINE"),
        2,
        "run.json: argument --lr_scheduler_type/--lr-scheduler-type: invalid choice: 'COSINE' (choose from ",
        ("tmp_path",),
    ),
    "taper: --optim adamw_bnb_8bit": (
        _trainer(["--optim", "adamw_bnb_8bit"]),
        2,
        "--optim adamw_bnb_8bit with these options:",
    ),
    "taper: --eval_strategy steps": (
        _trainer(["--eval_strategy", "steps"]),
        2,
        "--eval_strategy steps: taper gives the Trainer no evaluation set",
    ),
    # the Trainer options that evaluate or pick a "best" checkpoint: --eval_on_start and --save_strategy best failed
    # with a traceback once the model was loaded; with a metric, best trained and never wrote a checkpoint; the
    # others were ignored without a word, or refused in TrainingArguments' lines that pointed to --save_strategy best
    **{
        f"taper: {' '.join(flags)}": (
            _trainer(flags),
            2,
            f"error: {refused}: taper gives the Trainer no evaluation set (it evaluates the held-out blocks itself, "
            f"before and after training): {instead}",
        )
        for flags, refused, instead in [
            (["--eval_on_start", "true"], "--eval_on_start", "leave it off"),
            (["--save_strategy", "best"], "--save_strategy best", "no step is ever best, so no checkpoint would be"),
            (
                ["--save_strategy", "best", "--metric_for_best_model", "loss", "--save_steps", "2"],
                "--save_strategy best",
                "no step is ever best",
            ),
            (["--load_best_model_at_end", "true"], "--load_best_model_at_end", "there is no best checkpoint to load"),
            (["--load_best_model_at_end", "true", "--save_strategy", "no"], "--load_best_model_at_end", "there is"),
            (["--metric_for_best_model", "loss"], "--metric_for_best_model loss", "no checkpoint is compared by a"),
            (["--greater_is_better", "false"], "--greater_is_better", "no checkpoint is compared by a metric"),
        ]
    },
    # accepted: the report's history was empty, its loss figure blank, and the gradient-norm watch never fed
    "taper: --logging_steps past --max_steps (no log would be written)": (
        _trainer(["--logging_steps", "100"]),
        2,
        "error: --logging_steps 100: the first log would come after the run's last step (--max_steps 10), so the "
        "report's training history and the divergence watch would read nothing; log at most every 10 steps",
    ),
    "taper: --logging_strategy no": (
        _trainer(["--logging_strategy", "no"]),
        2,
        "error: --logging_strategy no: the report's training history and loss figure, and the divergence watch's "
        "gradient norm, are read from the Trainer's logs",
    ),
    # it was accepted, and the checkpoint a Ctrl-C saved "to continue with --resume" could not be resumed
    "taper: --save_only_model true": (
        _trainer(["--save_only_model", "true"]),
        2,
        [
            "--save_only_model: taper's checkpoints are what --resume continues from",
            "without the optimizer, scheduler and random state cannot be resumed; leave it off",
        ],
    ),
    "taper: --push_to_hub": (
        _trainer(["--push_to_hub"]),
        2,
        "--push_to_hub would upload the run folder from inside training",
    ),
    "taper: --gradient_accumulation_steps 0": (
        _trainer(["--gradient_accumulation_steps", "0"]),
        2,
        "--gradient_accumulation_steps must be a positive integer, got 0",
    ),
    # rc 0: the Trainer ends a step at the epoch's end, so every step trained on one epoch (the weights of GA equal
    # to the epoch's batches), yet the report claimed 200000 blocks a step and hundreds of times the tokens
    "taper: --gradient_accumulation_steps past one epoch's batches": (
        _trainer(["--gradient_accumulation_steps", "100000"]),
        2,
        "error: --gradient_accumulation_steps 100000 is more than the 380 batches of one epoch of the training "
        "data (760 blocks): the Trainer ends each step at the epoch's end, so every step would train on one "
        "epoch; use --gradient_accumulation_steps 380 or fewer, or more training text",
    ),
    "taper: --per_device_train_batch_size 0": (
        _trainer(["--per_device_train_batch_size", "0"]),
        2,
        "--per_device_train_batch_size must be a positive integer, got 0",
    ),
    "taper: --sink_attention_weight inf": (
        _trainer(["--sink_attention_weight", "inf"]),
        2,
        "argument --sink_attention_weight/--sink-attention-weight: must be a finite number, got inf",
    ),
    "taper: --scale_loss_weight inf": (_trainer(["--scale_loss_weight", "inf"]), 2, ["scale_loss_weight", "inf"]),
    "taper: --distill_weight inf": (_trainer(["--distill_weight", "inf"]), 2, ["distill_weight", "inf"]),
    "taper: --resume_from_checkpoint x": (
        _trainer(["--resume_from_checkpoint", "x"]),
        2,
        "--resume_from_checkpoint is the Trainer's flag and taper does not read it",
    ),
    "taper: --label_smoothing_factor 0.1": (
        _trainer(["--label_smoothing_factor", "0.1"]),
        2,
        "--label_smoothing_factor 0.1: the Trainer would compute its own loss",
    ),
    "taper: --num_train_epochs 3 (a run's length is --max_steps)": (
        _trainer(["--num_train_epochs", "3"]),
        2,
        "--num_train_epochs is not read by taper: a run's length is --max_steps optimizer steps",
    ),
    "taper: --per_device_eval_batch_size 1 (taper evaluates with --eval_batch_size)": (
        _trainer(["--per_device_eval_batch_size", "1"]),
        2,
        "--per_device_eval_batch_size is not read by taper: taper evaluates the held-out blocks itself, "
        "--eval_batch_size per forward; leave it out",
    ),
    # --hub_*: accepted although taper never pushes; the token was pickled into each checkpoint's training_args.bin
    "taper: --hub_token (taper never pushes; the token was pickled into the checkpoints)": (
        _trainer(["--hub_token", "hf_SECRET"]),
        2,
        "--hub_token is not read by taper: taper never pushes (--push_to_hub is refused); publish the folded export "
        "with hf-tapernorm push --token; leave it out",
    ),
    "taper: --hub_model_id me/x": (
        _trainer(["--hub_model_id", "me/x"]),
        2,
        "--hub_model_id is not read by taper: taper never pushes (--push_to_hub is refused); publish the folded "
        "export with hf-tapernorm push --repo_id; leave it out",
    ),
    "taper: --hub_private_repo false": (
        _trainer(["--hub_private_repo", "false"]),
        2,
        "--hub_private_repo is not read by taper: taper never pushes (--push_to_hub is refused); publish the folded "
        "export with hf-tapernorm push (private unless --no_private); leave it out",
    ),
    "taper: --hub_strategy end": (_trainer(["--hub_strategy", "end"]), 2, "--hub_strategy is not read by taper"),
    "taper: --hub_always_push false (the Trainer's default, given)": (
        _trainer(["--hub_always_push", "false"]),
        2,
        "--hub_always_push is not read by taper",
    ),
    "taper: --hub_revision main": (_trainer(["--hub_revision", "main"]), 2, "--hub_revision is not read by taper"),
    "taper: --seed -1": (
        _trainer(["--seed", "-1"]),
        2,
        "--seed must be in [0, 2**32 - 1], got -1",
    ),  # was NumPy's traceback, after the load
    "taper: --max_grad_norm -1": (
        _trainer(["--max_grad_norm", "-1"]),
        2,
        "--max_grad_norm must be >= 0, got -1.0",
    ),  # was clipping silently off
    "taper: --weight_decay -1": (
        _trainer(["--weight_decay", "-1"]),
        2,
        "--weight_decay must be >= 0, got -1.0",
    ),  # was accepted: weights pushed to grow
    "taper: --lr_scheduler_kwargs num_decay_steps 500": (
        _trainer(["--lr_scheduler_kwargs", '{"num_decay_steps": 500}']),
        2,
        "more than --max_steps 10",
    ),
    "taper: --warmup_steps 5": (
        _trainer(["--warmup_steps", "5"]),
        2,
        "--warmup_steps 5.0 is 5 steps, past the taper's start (step 2)",
    ),
    "taper: --per_device_train_batch_size 5000": (
        _trainer(
            ["--per_device_train_batch_size", "5000", "--max_steps", "2", "--taper_start", "1", "--taper_end", "2"]
        ),
        2,
        "fewer than one batch (5000: --per_device_train_batch_size x processes): training would run 0 steps",
    ),
    # a first user's mistakes (issue 34's probe)
    "taper: a jsonl whose rows name their text differently": (
        lambda ws: [*taper(ws, ws / "out"), "--dataset_name", str(ws / "mixed.jsonl")],
        2,
        ["has no 'text' value", "content", "--text_column"],
    ),
    "taper: --sample_by line on a jsonl": (  # ignored (a row is a document), yet recorded in the run's report
        lambda ws: [*taper(ws, ws / "out"), "--dataset_name", str(ws / "lists.jsonl"), "--sample_by", "line"],
        2,
        "--sample_by line: only local text files (.txt, .md) are cut into documents by line, paragraph or file, and "
        "--dataset_name '{ws}/lists.jsonl' is one document per row; leave the option out",
    ),
    "taper: a jsonl whose text is a list in some rows": (  # those rows were skipped without a word
        lambda ws: [*taper(ws, ws / "out"), "--dataset_name", str(ws / "lists.jsonl")],
        2,
        "row 1 of 'text' is a list, not text: every row needs its text in 'text' as a string; fix the data, or pass "
        "--text_column",
    ),
    "eval: a csv column of long digit strings": (  # pandas typed it as a number: a traceback from pyarrow's overflow
        lambda ws: [*_eval(ws), "--dataset_name", str(ws / "digits.csv")],
        2,
        "--dataset_name '{ws}/digits.csv' has a CSV column of digits too long for a number, which is how the csv "
        "loader types a column whose cells are all digits; write the texts as JSON Lines strings "
        '({{"text": "..."}} per line) instead',
    ),
    "taper: a tokenizer larger than the vocabulary": (
        lambda ws: taper(ws, ws / "out", "--sink", "none", model=str(ws / "small_vocab")),
        2,
        ["128 tokens", "vocab_size 100", "resize_token_embeddings"],
    ),
    "eval: a tokenizer larger than the vocabulary": (
        lambda ws: [
            "eval",
            "--model_name_or_path",
            str(ws / "small_vocab"),
            "--dataset_name",
            str(ws / "corpus.txt"),
            "--sink",
            "none",
            "--block_size",
            "32",
            "--out_of_corpus_blocks",
            "0",
        ],  # fmt: skip
        2,
        ["vocab_size 100"],
    ),
    "taper: --use_liger_kernel": (
        lambda ws: taper(ws, ws / "out", "--use_liger_kernel", "true"),
        2,
        ["--use_liger_kernel", "bypassed"],
    ),
    # the hostile probe: what a new user hands the CLI
    "empty data file": (lambda ws: _taper(ws, data="empty.txt"), 2, ["empty.txt", "is empty"]),
    "binary data file": (lambda ws: _taper(ws, data="binary.txt"), 2, ["not UTF-8", "convert it"]),
    # a JSON array of no item: it was datasets' 'Instruction "train" corresponds to no data!'
    "eval on a json file of an empty array": (
        lambda ws, tmp: _eval(ws, "--dataset_name", str(_written(tmp / "empty_arr.json", "  [ ]\n"))),
        2,
        ["error: --dataset_name '", "/empty_arr.json' is empty: the file holds no rows"],
        ("tmp_path",),
    ),
    # the out-of-corpus text's refusals said "dataset 'PATH'", not which of the command's two datasets was meant
    **{
        f"eval --out_of_corpus_dataset {what}": (
            lambda ws, tmp, file=file, content=content: _eval(
                ws, "--out_of_corpus_blocks", "2", "--out_of_corpus_dataset", str(_written(tmp / file, content))
            ),
            2,
            [f"error: {option}'", f"/{file}'{said}"],
            ("tmp_path",),
        )
        for what, file, content, option, said in [
            (
                "a header-only csv",
                "h.csv",
                "\ufefftext\n",
                "--out_of_corpus_dataset ",
                " is empty: the file holds no rows",
            ),
            (
                "a json array of no item",
                "e.json",
                "[]",
                "--out_of_corpus_dataset ",
                " is empty: the file holds no rows",
            ),
            (
                "a file of a byte-order mark",
                "bom.txt",
                "\ufeff",
                "--out_of_corpus_dataset ",
                " is empty: the file holds no text",
            ),
            (
                "a csv of blank lines",
                "blank.csv",
                "\n\n\n",
                "--out_of_corpus_dataset ",
                " is empty: the file holds no rows",
            ),
            (
                "rows of null text",
                "nulls.jsonl",
                '{"text": null}\n' * 2,
                "row 0 of --out_of_corpus_dataset ",
                " has no 'text' value: every row needs its text in 'text'; fix the data",
            ),
        ]
    },  # fmt: skip
    "eval --out_of_corpus_dataset a UTF-16 file": (
        lambda ws, tmp: _eval(
            ws,
            "--out_of_corpus_blocks",
            "2",
            "--out_of_corpus_dataset",
            str(_written(tmp / "w.txt", "wide text\n", "utf-16")),
        ),
        2,
        [
            "error: --out_of_corpus_dataset '",
            "/w.txt' is UTF-16 text (told by its byte-order mark), not UTF-8: convert it (iconv -f utf-16 -t utf-8 '",
            "/w.utf8.txt') and name the file it writes",
        ],
        ("tmp_path",),
    ),
    # a corpus's null text row was "row 1 of dataset 'PATH'", where the out-of-corpus one names its option
    **{
        f"{command} --dataset_name of null text rows": (
            make,
            2,
            "error: row 1 of --dataset_name '{ws}/nulls.jsonl' has no 'text' value: every row needs its text in "
            "'text'; fix the data",
        )
        for command, make in [
            ("eval", lambda ws: _eval(ws, "--dataset_name", str(ws / "nulls.jsonl"))),
            ("taper", lambda ws: _taper(ws, data="nulls.jsonl")),
            (
                "bench --modes train",
                lambda ws: _bench(ws, "--modes", "train", "--dataset_name", str(ws / "nulls.jsonl")),
            ),
        ]
    },
    # a file of Unicode white space alone (no-break, em and ideographic spaces) was "too small" or "does not fill
    # one block": it holds no text
    **{
        f"{command} on a file of Unicode white space": (
            lambda ws, tmp, make=make: make(ws, str(_written(tmp / "nbsp.txt", "\u00a0\u2003\n\u3000\n\n"))),
            2,
            [f"error: {option} '", "/nbsp.txt' is empty: the file holds no text"],
            ("tmp_path",),
        )
        for command, option, make in [
            ("eval", "--dataset_name", lambda ws, path: _eval(ws, "--dataset_name", path)),
            (
                "eval --out_of_corpus_dataset",
                "--out_of_corpus_dataset",
                lambda ws, path: _eval(ws, "--out_of_corpus_blocks", "2", "--out_of_corpus_dataset", path),
            ),
            (
                "bench --modes train",
                "--dataset_name",
                lambda ws, path: _bench(ws, "--modes", "train", "--dataset_name", path),
            ),
        ]
    },
    # UTF-16 without a byte-order mark (a NUL every other byte) was evaluated as text of NULs with --sample_by line
    "eval --sample_by line on UTF-16LE without a byte-order mark": (
        lambda ws, tmp: _eval(
            ws,
            "--sample_by",
            "line",
            "--dataset_name",
            str(_written(tmp / "u16.txt", "wide text\n" * 300, "utf-16-le")),
        ),
        2,
        [
            "error: --dataset_name '",
            "/u16.txt' is UTF-16LE text without a byte-order mark (NUL every other byte), not UTF-8: convert it (iconv "
            "-f utf-16le -t utf-8 '",
            "/u16.utf8.txt') and name the file it writes",
        ],
        ("tmp_path",),
    ),
    # a JSON object and an array of empty objects: "cannot tell which column holds the text (columns:
    # none); pass --text_column", which could not help; the dataset is empty
    **{
        f"eval on a json file of {what} as {option}": (
            lambda ws, tmp, option=option, text=text: _eval(
                ws, "--out_of_corpus_blocks", "2", option, str(_written(tmp / "rows.json", text))
            ),
            2,
            [
                f"error: {option} '",
                "/rows.json' is empty: its rows hold no columns, so no text; name a dataset of text",
            ],
            ("tmp_path",),
        )
        for what, text in (("an empty object", "{}\n"), ("an array of empty objects", "[{}]\n"))
        for option in ("--dataset_name", "--out_of_corpus_dataset")
    },
    "data folder without text files": (lambda ws: _taper(ws, data="emptydir"), 2, ["holds no", ".txt"]),
    # refused before loading by the loader's own rule (sources.local_data_files), for every data option and command
    "taper --out_of_corpus_dataset folder without data files": (
        lambda ws: _taper(ws, "--out_of_corpus_dataset", str(ws / "emptydir"), "--out_of_corpus_blocks", "2"),
        2,
        "error: --out_of_corpus_dataset '{ws}/emptydir' is a folder that holds no .csv/.json/",
    ),
    # the training corpus as the out-of-corpus text: its "out of corpus" loss was the corpus's own, printed and
    # recorded without a word (however the path was spelled, for eval too, and for a Hub name or the embedded corpus)
    **{
        f"{command} --out_of_corpus_dataset {what}": (
            lambda ws, command=command, name=name, corpus=corpus: [
                *(_taper if command == "taper" else _eval)(ws, "--out_of_corpus_blocks", "2"),
                *(["--dataset_name", corpus.format(ws=ws)] if corpus else []),
                "--out_of_corpus_dataset",
                name.format(ws=ws),
            ],
            2,
            f"error: --out_of_corpus_dataset '{name}' names {part}the training corpus (--dataset_name "
            f"'{corpus or '{ws}/corpus.txt'}'); name text the model was not trained on, or leave it out",
        )
        for command, what, name, corpus, part in [
            ("taper", "the corpus file", "{ws}/corpus.txt", None, ""),
            ("eval", "the corpus file", "{ws}/corpus.txt", None, ""),
            ("taper", "the corpus file spelled otherwise", "{ws}/texts/../corpus.txt", None, ""),
            ("taper", "the corpus folder with a slash", "{ws}/texts/", "{ws}/texts", ""),
            ("taper", "a file of the corpus folder", "{ws}/texts/part1.txt", "{ws}/texts", "part of "),
            ("taper", "the corpus's Hub name", "Me/One", "me/one", ""),
            ("eval", "the embedded corpus", "python-stdlib", "python-stdlib", ""),
        ]
    },  # fmt: skip
    # a hard link of the corpus inside a folder of more text: it was evaluated, partly the corpus's own text
    "eval --out_of_corpus_dataset a folder holding a hard link of the corpus": (
        lambda ws, tmp: [
            *_eval(ws, "--out_of_corpus_blocks", "2"),
            "--out_of_corpus_dataset",
            str(_with_hard_link(ws, tmp / "sup")),
        ],
        2,
        [
            "error: --out_of_corpus_dataset '",
            "/sup' names text of the training corpus: its file 'corpus.txt' (--dataset_name '",
            "/corpus.txt'); name text the model was not trained on, or leave it out",
        ],
        ("tmp_path",),
    ),  # fmt: skip
    "bench --modes train with a --dataset_name folder without data files": (
        lambda ws: _bench(ws, "--modes", "train", "--dataset_name", str(ws / "emptydir")),
        2,
        "error: --dataset_name '{ws}/emptydir' is a folder that holds no .csv/.json/",
    ),
    # the text column, chosen before loading by the loading's own rule (columns.choose_text_column; issue 51)
    "bench --modes train on a csv without a string column": (
        lambda ws: _bench(ws, "--modes", "train", "--dataset_name", str(ws / "nocol.csv")),
        2,
        "error: --dataset_name '{ws}/nocol.csv': cannot tell which column holds the text (columns: a, b); pass "
        "--text_column",
    ),
    "eval on a csv without a string column": (
        lambda ws: _eval(ws, "--dataset_name", str(ws / "nocol.csv")),
        2,
        "error: --dataset_name '{ws}/nocol.csv': cannot tell which column holds the text (columns: a, b); pass "
        "--text_column",
    ),
    "eval --dataset_name a file of an unsupported type": (
        lambda ws, tmp: _eval(ws, "--dataset_name", str(_copy(ws / "corpus.txt", tmp / "corpus.weird"))),
        2,
        ["error: --dataset_name '", "/corpus.weird': unsupported file type '.weird'; supported: .csv, .json"],
        ("tmp_path",),
    ),
    "taper --data_cache_dir in the --dataset_name folder": (
        lambda ws: _taper(ws, "--data_cache_dir", str(ws / "texts" / "cache"), data="texts"),
        2,
        "error: --data_cache_dir '{ws}/texts/cache' lies in the --dataset_name folder '{ws}/texts': the cache's files",
    ),
    "eval --data_cache_dir the --dataset_name folder": (
        lambda ws: _eval(ws, "--dataset_name", str(ws / "texts"), "--data_cache_dir", str(ws / "texts")),
        2,
        "error: --data_cache_dir '{ws}/texts' lies in the --dataset_name folder '{ws}/texts': the cache's files",
    ),
    "csv without a text column": (lambda ws: _taper(ws, data="nocol.csv"), 2, ["--text_column"]),
    "jsonl rows without text": (lambda ws: _taper(ws, data="nulls.jsonl"), 2, ["row 1", "no 'text' value"]),
    "data smaller than a block": (lambda ws: _taper(ws, data="tiny.txt"), 2, ["too small", "--block_size"]),
    "options file holding a list": (lambda ws: ["taper", str(ws / "list.yaml")], 2, ["one object"]),
    "empty options file": (lambda ws: ["taper", str(ws / "empty.yaml")], 2, ["one object"]),
    "unknown option in a file": (
        lambda ws: ["taper", str(ws / "unknown.yaml")],
        2,
        ["unknown options", "bogus_option"],
    ),
    "model is a text file": (lambda ws: _taper(ws, model="corpus.txt"), 2, ["is a file, not a model", "config.json"]),
    "model config not JSON": (lambda ws: _taper(ws, model="badjson"), 2, ["cannot read the config", "badjson"]),
    "block size beyond positions": (lambda ws: _taper(ws, "--block_size", "100000"), 2, ["64 positions"]),
    # a taper refused after it locked its run folder removed the folder, but not the ones above it that the
    # lock created (--output_dir new/deeper/run left a stray new/deeper/): every folder it created is removed again
    "block size beyond positions, into a run folder under missing folders": (
        lambda ws: [*taper_argv(ws, ws / "new" / "deeper" / "run"), "--block_size", "100000"],
        2,
        "error: --block_size 100000 exceeds the model's 64 positions",
    ),
    "batch size 0": (lambda ws: _taper(ws, "--per_device_train_batch_size", "0"), 2, ["--per_device_train_batch_size"]),
    "held out 100%": (lambda ws: _taper(ws, "--heldout_percentage", "100"), 2, ["--heldout_percentage"]),
    "taper end before start": (lambda ws: _taper(ws, "--taper_start", "0.9", "--taper_end", "0.5"), 2, ["--taper_end"]),
    "keep_norms matching nothing": (lambda ws: _taper(ws, "--keep_norms", "nope.*"), 2, ["match no norm"]),
    # "none" among patterns is a pattern: the message did not say that the word stands alone
    "keep_norms none among patterns": (
        lambda ws: _taper(ws, "--keep_norms", "none,model.norm"),
        2,
        [
            "keep_norms pattern(s) ['none'] match no norm of LlamaForCausalLM (llama); norms are named like "
            "'model.layers.0.input_layernorm' and 'model.norm'; 'none' keeps no norm only when it stands alone "
            "(--keep_norms none): drop it, or give it alone"
        ],
    ),
    "negative seed": (lambda ws: _taper(ws, "--seed", "-1"), 2, ["--seed"]),
    "gradient accumulation 0": (lambda ws: _taper(ws, "--gradient_accumulation_steps", "0"), 2, ["accumulation"]),
    "scheduler kwargs not JSON": (
        lambda ws: _taper(ws, "--lr_scheduler_kwargs", "{nope"),
        2,
        ["--lr_scheduler_kwargs", "not a JSON object"],
    ),
    # a text that is no JSON object was dropped without a word (the run trained with the default decay)
    **{
        f"scheduler kwargs {text} (no JSON object)": (
            lambda ws, text=text: _taper(ws, "--lr_scheduler_kwargs", text),
            2,
            [f"--lr_scheduler_kwargs {text}: not a JSON object"],
        )
        for text in ("notjson", "[1]", '"x"')
    },
    # a traceback from int() before the model loaded
    **{
        f"scheduler kwargs num_decay_steps {value}": (
            lambda ws, value=value: _taper(ws, "--lr_scheduler_kwargs", f'{{"num_decay_steps": {value}}}'),
            2,
            [f"num_decay_steps must be a whole number of steps, got {shown}"],
        )
        for value, shown in (('"two"', "'two'"), ("null", "None"), ("[2]", "[2]"), ("2.5", "2.5"))
    },
    "scheduler kwargs of the wrong type": (
        lambda ws: _taper(
            ws, "--lr_scheduler_type", "cosine_with_restarts", "--lr_scheduler_kwargs", '{"num_cycles": "x"}'
        ),
        2,
        ["--lr_scheduler_type cosine_with_restarts"],
    ),
    # torch's KeyError ("initial_lr is not specified") from a fresh scheduler asked to start past step 0, before
    # the model loaded: the step count is the Trainer's (on the command line and in an options file)
    **{
        f"scheduler kwargs last_epoch {value}": (
            lambda ws, value=value: _taper(
                ws, "--lr_scheduler_kwargs", f'{{"num_decay_steps": 2, "last_epoch": {value}}}'
            ),
            2,
            [
                f"--lr_scheduler_kwargs {{{{'num_decay_steps': 2, 'last_epoch': {shown}}}}}: last_epoch is not a key a "
                "run takes: the Trainer sets it itself (the scheduler's step count, which a fresh run starts at 0 "
                "and --resume restores); leave it out"
            ],
        )
        for value, shown in (("3", "3"), ('"x"', "'x'"))
    },
    "scheduler kwargs last_epoch in an options file": (
        _taper_options_file(lr_scheduler_kwargs={"num_decay_steps": 2, "last_epoch": 1}),
        2,
        ["--lr_scheduler_kwargs {{'num_decay_steps': 2, 'last_epoch': 1}}: last_epoch is not a key a run takes"],
        ("tmp_path",),
    ),
    # transformers hands the constant schedules none of the keys: the run went on without them
    "scheduler kwargs of a constant schedule": (
        lambda ws: _taper(ws, "--lr_scheduler_type", "constant", "--lr_scheduler_kwargs", '{"num_decay_steps": 2}'),
        2,
        [
            "--lr_scheduler_kwargs {{'num_decay_steps': 2}}: num_decay_steps is not a key of --lr_scheduler_type "
            "constant (it takes none); leave it out"
        ],
    ),
    "resume of a new folder": (lambda ws: _taper(ws, "--resume"), 2, ["--resume", "holds no run to continue"]),
    "output_dir is a file": (
        lambda ws: [*_taper(ws), "--output_dir", str(ws / "tiny.txt")],
        2,
        ["tiny.txt' is a file"],
    ),
    "text column not in the data": (lambda ws: _taper(ws, "--text_column", "body", data="nulls.jsonl"), 2, ["'body'"]),
    "eval batch size 0": (lambda ws: _taper(ws, "--eval_batch_size", "0"), 2, ["--eval_batch_size"]),
    "out-of-corpus data missing": (
        lambda ws: _taper(ws, "--out_of_corpus_dataset", str(ws / "nope.txt"), "--out_of_corpus_blocks", "4"),
        2,
        ["nope.txt", "not found"],
    ),
    "allow_changes without resume": (lambda ws: _taper(ws, "--allow_changes", "seed"), 2, ["--resume only"]),
    "gguf_file without a model": (
        lambda ws: ["taper", "--gguf_file", "x.gguf", "--output_dir", str(ws / "out")],
        2,
        ["--model_name_or_path"],
    ),
    "batch larger than the data": (
        lambda ws: _taper(ws, "--per_device_train_batch_size", "100000"),
        2,
        ["fewer than one batch"],
    ),
    "negative learning rate": (lambda ws: _taper(ws, "--learning_rate", "-1"), 2, ["learning rate"]),
    "NaN learning rate": (
        lambda ws: _taper(ws, "--learning_rate", "nan"),
        2,
        ["--learning-rate: must be a finite number, got nan"],
    ),
    "explicit warmup past the taper start": (lambda ws: _taper(ws, "--warmup_steps", "2.5"), 2, ["--warmup_steps 2.5"]),
    "logging_steps 0": (lambda ws: _taper(ws, "--logging_steps", "0"), 2, ["--logging_steps"]),
    "negative distillation weight": (lambda ws: _taper(ws, "--distill_weight", "-1"), 2, ["--distill_weight"]),
    "max_steps 1": (lambda ws: [*_taper(ws), "--max_steps", "1"], 2, ["--max_steps must be at least 2"]),
    "negative data loader workers": (
        lambda ws: [*_taper(ws), "--dataloader_num_workers", "-1"],
        2,
        ["--dataloader_num_workers must be >= 0"],
    ),
    "unknown flag": (lambda ws: _taper(ws, "--bogus", "1"), 2, ["unrecognized arguments", "--bogus"]),
    "eval result in a missing folder": (
        lambda ws: ["eval", "--model_name_or_path", str(ws / "llama"), "--output_json", str(ws / "no" / "r.json")],
        2,
        ["does not exist"],
    ),
    "eval result over a model's config": (
        lambda ws: ["eval", "--model_name_or_path", str(ws / "llama"), "--output_json", str(ws / "llama/config.json")],
        2,
        ["not an earlier result"],
    ),
    # a path with no file name in it stopped with a traceback ("PosixPath('.') has an empty name"), rc 1
    **{
        f"eval --output_json {given}": (
            lambda ws, given=given: _eval(ws, "--output_json", given),
            2,
            f"error: --output_json {given} is a symbolic link or a folder; name a new file",
        )
        for given in (".", "/", "./")
    },
    # a trailing '/' (a folder that does not exist, or a new file's name) wrote the result to a file of that name
    **{
        f"eval --output_json {name}/ (a trailing slash)": (
            lambda ws, name=name: _eval(ws, "--output_json", f"{ws / name}/"),
            2,
            f"error: --output_json {{ws}}/{name}/ ends with '/', which names a folder; name a file",
        )
        for name in ("nodir", "result.json")
    },
    # a trailing '/.' (a folder that does not exist, or an earlier result) wrote the result to a file 'nodir', or
    # replaced the earlier result 'earlier.json': Path dropped the '/.' before the check saw it
    **{
        f"eval --output_json {name}/. (a trailing '/.')": (
            lambda ws, name=name: _eval(ws, "--output_json", f"{_earlier_result(ws, name)}/."),
            2,
            f"error: --output_json {{ws}}/{name}/. ends with '/.', which names a folder; name a file",
        )
        for name in ("nodir", "earlier.json")
    },
    "eval of a missing model": (lambda ws: ["eval", "--model_name_or_path", str(ws / "nothing")], 2, ["not found"]),
    "fold of an original model": (
        lambda ws: ["fold", "--checkpoint", str(ws / "llama"), "--output_dir", str(ws / "x")],
        2,
        ["not a tapered checkpoint"],
    ),
    # the hostile probe, round 4: a number that is no number (inf, nan) is refused by the parse, for every command
    "fold tolerance inf": (
        lambda ws: ["fold", "--checkpoint", str(ws / "llama"), "--output_dir", str(ws / "x"), "--tolerance", "inf"],
        2,
        ["argument --tolerance: must be a finite number, got inf"],
    ),  # was refused by fold_model, once the checkpoint had loaded
    "bench: --learning_rate inf": (
        lambda ws: _bench(ws, "--learning_rate", "inf"),
        2,
        "argument --learning_rate/--learning-rate: must be a finite number, got inf",
    ),  # was accepted, then trained on nonsense
    "eval: --heldout_percentage nan": (
        lambda ws: _eval(ws, "--heldout_percentage", "nan"),
        2,
        "argument --heldout_percentage/--heldout-percentage: must be a finite number, got nan",
    ),
    "fold tolerance 0": (
        lambda ws: ["fold", "--checkpoint", str(ws / "llama"), "--output_dir", str(ws / "x"), "--tolerance", "0"],
        2,
        ["--tolerance must be positive"],
    ),
    "push of a missing export": (
        lambda ws: ["push", "--export_dir", str(ws / "nothing"), "--repo_id", "me/x"],
        2,
        "error: --export_dir '{ws}/nothing' not found: no such folder; name the folded export taper or fold wrote",
    ),
    # a relative one was "'no_such_export' is not a folded export (its config's model_type is not tapernorm_*)"
    "push of a missing export named relatively": (
        lambda ws: ["push", "--export_dir", "no_such_export", "--repo_id", "me/x"],
        2,
        "error: --export_dir 'no_such_export' not found: no such folder; name the folded export taper or fold wrote",
    ),
    "push to a malformed repo id": (
        lambda ws: ["push", "--export_dir", str(ws / "llama"), "--repo_id", "me/x/y"],
        2,
        ["--repo_id 'me/x/y' is not a valid Hub repository name", "'namespace/repo_name'"],
    ),
    "an options file that is a folder": (
        _options_folder,
        2,
        ["options file '", "run.json' is a folder; name a JSON or YAML file"],
        ("tmp_path",),
    ),
    # the hostile probe, round 6: an options file after a flag; argv bytes that are not UTF-8
    "taper --resume run.json": (
        _flag_before_options_file("taper", "--resume"),
        2,
        ["run.json is read alone, as the first and only argument: put --resume into it", "taper --help"],
        ("tmp_path",),
    ),
    "taper --output_dir DIR run.json": (
        _flag_before_options_file("taper", "--output_dir", "{tmp}/o4"),
        2,
        ["run.json is read alone, as the first and only argument: put --output_dir into it"],
        ("tmp_path",),
    ),
    "eval --trust_remote_code run.json": (
        _flag_before_options_file("eval", "--trust_remote_code"),
        2,
        ["run.json is read alone, as the first and only argument: put --trust_remote_code into it"],
        ("tmp_path",),
    ),
    "fold --overwrite run.json": (
        _flag_before_options_file("fold", "--overwrite"),
        2,
        ["run.json is read alone, as the first and only argument: put --overwrite into it"],
        ("tmp_path",),
    ),
    "push --no_private run.json": (
        _flag_before_options_file("push", "--no_private"),
        2,
        ["run.json is read alone, as the first and only argument: put --no_private into it"],
        ("tmp_path",),
    ),
    # the hostile probe, round 7: an abbreviated flag, an unknown one, before an existing JSON file
    "eval --output_js r.json (an abbreviation)": (
        _flag_before_options_file("eval", "--model_name_or_path", "{tmp}/model", "--output_js"),
        2,
        ["unrecognized arguments: ['--output_js', '", "run.json'] (see hf-tapernorm eval --help)"],
        ("tmp_path",),
    ),
    "eval --resume data.json (an unknown flag)": (
        _flag_before_options_file("eval", "--resume"),
        2,
        ["unrecognized arguments: ['--resume', '"],
        ("tmp_path",),
    ),
    "taper --output_dir with a byte that is not UTF-8": (
        lambda ws, tmp: taper(ws, tmp / "caf\udce9"),
        2,
        ["argument --output_dir/--output-dir: ", "caf\\udce9' holds '\\udce9', which is no character"],
        ("tmp_path",),
    ),
    "fold --output_dir with a byte that is not UTF-8": (
        lambda ws, tmp: ["fold", "--checkpoint", str(ws / "llama"), "--output_dir", str(tmp / "caf\udce9")],
        2,
        ["argument --output_dir/--output-dir: ", "holds '\\udce9', which is no character (a byte that is not UTF-8"],
        ("tmp_path",),
    ),
    # the hostile probe, round 2: odd paths, edited run and export folders
    "options file followed by a flag": (
        _options_with_a_flag,
        2,
        ["run.yaml is read alone", "put --max_steps"],
        NEEDS_RUN,
    ),
    "repo id with a space": (
        lambda ws, run, tmp: ["push", "--export_dir", str(run / "folded"), "--repo_id", "me/has space"],
        2,
        ["--repo_id 'me/has space' is not a valid Hub repository name"],
        NEEDS_RUN,
    ),
    "repo id with '..'": (
        lambda ws, run, tmp: ["push", "--export_dir", str(run / "folded"), "--repo_id", "me/a..b"],
        2,
        ["not a valid Hub repository name"],
        NEEDS_RUN,
    ),
    "fold into a folder inside the checkpoint": (
        lambda ws, run, tmp: fold(copy_of(run, tmp) / "tapered", tmp / "run" / "tapered" / "sub"),
        2,
        ["lies inside --checkpoint", "choose a folder outside the checkpoint"],
        NEEDS_RUN,
    ),
    "overwrite of a run whose manifest is damaged": (
        _overwrite_damaged_manifest,
        2,
        ["manifest .hf_tapernorm_run.json is unreadable", "--resume rebuilds it"],
        NEEDS_RUN,
    ),
    "eval of an export whose config has hidden_size 32.0": (
        _eval_folded_config_float,
        2,
        ["cannot read the config of", "hidden_size"],
        NEEDS_RUN,
    ),
    "eval of a tapered checkpoint whose config has a string layer count": (
        _tapered_config_string("eval"),
        2,
        ["cannot read the config of tapered checkpoint", "num_hidden_layers"],
        NEEDS_RUN,
    ),
    "fold of a tapered checkpoint whose config has a string layer count": (
        _tapered_config_string("fold"),
        2,
        ["cannot read the config of tapered checkpoint", "num_hidden_layers"],
        NEEDS_RUN,
    ),
    # tapered checkpoints lacking a file: the refusals named no option ("tapered checkpoint '...' has no
    # .safetensors weights", "'...' is a folder without config.json"), and eval of one lacking tapernorm_config.json
    # said transformers' "does not recognize this architecture ... out of date"
    "fold of a tapered checkpoint without its weights": (
        _without_file("fold", "model.safetensors"),
        2,
        [
            "error: --checkpoint '",
            "/tapered' is a tapered checkpoint that has no .safetensors weights: restore them from its run, or pass a "
            "complete checkpoint (a run's tapered/ or a checkpoint-N)",
        ],
        NEEDS_RUN,
    ),
    "fold of a tapered checkpoint without its config.json": (
        _without_file("fold", "config.json"),
        2,
        [
            "error: --checkpoint '",
            "/tapered' is a tapered checkpoint without its config.json: restore the file from its run, or pass a "
            "complete checkpoint (a run's tapered/ or a checkpoint-N)",
        ],
        NEEDS_RUN,
    ),
    "fold of a tapered checkpoint without its tapernorm_config.json": (
        _without_file("fold", "tapernorm_config.json"),
        2,
        [
            "error: --checkpoint '",
            "/tapered' is a tapered checkpoint without its tapernorm_config.json (its config.json names the model "
            "type 'hf_tapernorm_tapered_llama', which only that file makes loadable): restore the file from its run, "
            "or pass a complete checkpoint (a run's tapered/ or a checkpoint-N)",
        ],
        NEEDS_RUN,
    ),
    "eval of a tapered checkpoint without its weights": (
        _without_file("eval", "model.safetensors"),
        2,
        [
            "error: --model_name_or_path '",
            "/tapered' is a tapered checkpoint that has no .safetensors weights: restore them from its run, or pass a "
            "complete checkpoint (a run's tapered/ or a checkpoint-N)",
        ],
        NEEDS_RUN,
    ),
    "eval of a tapered checkpoint without its config.json": (
        _without_file("eval", "config.json"),
        2,
        [
            "error: --model_name_or_path '",
            "/tapered' is a tapered checkpoint without its config.json: restore the file from its run, or pass a "
            "complete checkpoint (a run's tapered/ or a checkpoint-N)",
        ],
        NEEDS_RUN,
    ),
    "eval of a tapered checkpoint without its tapernorm_config.json": (
        _without_file("eval", "tapernorm_config.json"),
        2,
        [
            "error: --model_name_or_path '",
            "/tapered' is a tapered checkpoint without its tapernorm_config.json (its config.json names the model "
            "type 'hf_tapernorm_tapered_llama', which only that file makes loadable): restore the file from its run, "
            "or pass a complete checkpoint (a run's tapered/ or a checkpoint-N)",
        ],
        NEEDS_RUN,
    ),
    # a model folder without its weights: transformers' "cannot load model '...': OSError: Error no file named
    # model.safetensors" as the model loaded, naming no option; without config.json, no option either
    "bench of a model folder without its weights": (
        _weightless_model("bench"),
        2,
        [
            "error: --model_name_or_path '",
            "/llama' has no weights: none of model.safetensors, model.safetensors.index.json, pytorch_model.bin, "
            "pytorch_model.bin.index.json is in it; copy the model's weights into it, or pass the folder of a "
            "complete saved model",
        ],
        NEEDS_RUN,
    ),
    "bench of a model folder without config.json": (
        _weightless_model("bench", "config.json"),
        2,
        [
            "error: --model_name_or_path '",
            "/llama' is a folder without config.json: not a saved Hugging Face model (for a GGUF file pass its "
            "path or --gguf_file)",
        ],
        NEEDS_RUN,
    ),
    "taper of a model folder without its weights": (
        _weightless_model("taper"),
        2,
        [
            "error: --model_name_or_path '",
            "/llama' has no weights: none of model.safetensors, model.safetensors.index.json, pytorch_model.bin, "
            "pytorch_model.bin.index.json is in it; copy the model's weights into it, or pass the folder of a "
            "complete saved model",
        ],
        NEEDS_RUN,
    ),
    # fold --checkpoint reads no GGUF file, but was told to pass one with --gguf_file, an option fold does not have
    "fold of a model folder without config.json": (
        _fold_of_a_plain_folder_without_config,
        2,
        [
            "error: --checkpoint '",
            "/llama' is a folder without config.json: not a saved Hugging Face model",
        ],
        NEEDS_RUN,
    ),
    "taper of a model folder without config.json": (
        _weightless_model("taper", "config.json"),
        2,
        [
            "error: --model_name_or_path '",
            "/llama' is a folder without config.json: not a saved Hugging Face model (for a GGUF file pass its "
            "path or --gguf_file)",
        ],
        NEEDS_RUN,
    ),
    # a weightless model folder holding something else: "copy the model's weights into it" for PEFT adapters beside
    # a copied config.json, or a GGUF file; a sharded model's missing shards failed as it loaded, naming no option
    "eval of a model folder of PEFT adapters with a copied config.json": (
        _weightless_model("eval", files={"adapter_config.json": "{}", "adapter_model.safetensors": ""}),
        2,
        [
            "error: --model_name_or_path '",
            "/llama' holds PEFT adapters (adapter_config.json), not a whole model: merge them into their base model "
            "(PeftModel.from_pretrained(base, folder).merge_and_unload().save_pretrained(...)) and pass the merged "
            "folder",
        ],
        NEEDS_RUN,
    ),
    "eval of a model folder holding a GGUF file and config.json": (
        _weightless_model("eval", files={"model.gguf": "GGUF"}),
        2,
        [
            "error: --model_name_or_path '",
            "/llama' has no weights but the GGUF file model.gguf: pass --gguf_file model.gguf to read it",
        ],
        NEEDS_RUN,
    ),
    "eval of a sharded model without its shards": (
        _weightless_model(
            "eval",
            files={
                "model.safetensors.index.json": json.dumps(
                    {
                        "metadata": {},
                        "weight_map": {
                            "a": "model-00001-of-00002.safetensors",
                            "b": "model-00002-of-00002.safetensors",
                        },
                    }
                )
            },
        ),
        2,
        [
            "error: --model_name_or_path '",
            "/llama' lacks 2 of the 2 shard file(s) its model.safetensors.index.json names "
            "(model-00001-of-00002.safetensors, model-00002-of-00002.safetensors): copy them into it, or pass the "
            "folder of a complete saved model",
        ],
        NEEDS_RUN,
    ),
    "bench of a sharded model with a damaged index": (
        _weightless_model("bench", files={"model.safetensors.index.json": '{"weight_map": '}),
        2,
        [
            "error: --model_name_or_path '",
            "/llama' has a damaged model.safetensors.index.json (JSONDecodeError: Expecting value: line 1 column 16 "
            "(char 15)): restore it, or pass the folder of a complete saved model",
        ],
        NEEDS_RUN,
    ),
    # --baseline_from was told to "pass a complete checkpoint (a run's tapered/ or a checkpoint-N)", which it refuses
    "taper --baseline_from a tapered checkpoint without its tapernorm_config.json": (
        _baseline_from_tapered_without_its_recipe,
        2,
        [
            "error: --baseline_from '",
            "/tapered' is a tapered checkpoint without its tapernorm_config.json (its config.json names the model "
            "type 'hf_tapernorm_tapered_llama', which only that file makes loadable): --baseline_from takes no "
            "tapered checkpoint; name an earlier --baseline run (or its baseline/model folder)",
        ],
        NEEDS_RUN,
    ),
    "eval of a truncated tapernorm_config.json": (
        _truncated_tapernorm_config("eval"),
        2,
        ["cannot read", "tapernorm_config.json"],
        NEEDS_RUN,
    ),
    "fold of a truncated tapernorm_config.json": (
        _truncated_tapernorm_config("fold"),
        2,
        ["cannot read", "tapernorm_config.json"],
        NEEDS_RUN,
    ),
    # a run folder was "not a saved Hugging Face model", naming neither tapered/ nor folded/
    "eval of the run folder itself": (
        lambda ws, run, tmp: evaluate(run, data=ws / "corpus.txt"),
        2,
        "error: --model_name_or_path '{ws}/run' is a taper run's folder, not a saved model: evaluate its folded "
        "export, --model_name_or_path '{ws}/run/folded' (or '{ws}/run/tapered', the tapered checkpoint at g = 0)",
        NEEDS_RUN,
    ),
    "fold of the run folder itself": (
        lambda ws, run, tmp: fold(run, tmp / "x"),
        2,
        "error: --checkpoint '{ws}/run' is a taper run's folder, not a saved model: fold its tapered checkpoint, "
        "--checkpoint '{ws}/run/tapered'",
        NEEDS_RUN,
    ),
    "fold of the folder of a run that wrote no tapered/": (
        lambda ws, run, tmp: fold(_without_tapered(copy_of(run, tmp)), tmp / "x"),
        2,
        [
            "error: --checkpoint '",
            "/run' is a taper run's folder, not a saved model: it holds no tapered/ (the run "
            "did not finish): fold one of its checkpoint-N folders, '",
            "/run/checkpoint-6'",
        ],
        NEEDS_RUN,
    ),
    # a finished run (its report.json says so) whose tapered/ and folded/ were moved away was said to
    # hold "no tapered/ (the run did not finish)"; now its outputs are named missing, the run finished
    "eval of a finished run whose tapered/ and folded/ were moved away": (
        lambda ws, run, tmp: _eval(ws, "--model_name_or_path", str(_without(copy_of(run, tmp), "tapered", "folded"))),
        2,
        [
            "/run' is a taper run's folder, not a saved model: its tapered/ and folded/ are missing (moved or "
            "deleted: its report.json says the run finished): evaluate one of its checkpoint-N folders, '",
            "/run/checkpoint-6'",
        ],
        NEEDS_RUN,
    ),
    "eval of a finished run whose tapered/, folded/ and checkpoints were moved away": (
        lambda ws, run, tmp: _eval(
            ws, "--model_name_or_path", str(_without_checkpoints(_without(copy_of(run, tmp), "tapered", "folded")))
        ),
        2,
        [
            "/run' is a taper run's folder, not a saved model: its tapered/ and folded/ are missing (moved or "
            "deleted: its report.json says the run finished), and it holds no checkpoint-N folder: move them back "
            "into '",
            "/run', or taper again into it (--output_dir '",
        ],
        NEEDS_RUN,
    ),
    # "pass one of its checkpoint-N folders" to a run that saved none
    "fold of the folder of a run that saved no checkpoint": (
        lambda ws, run, tmp: fold(_without_checkpoints(_without_tapered(copy_of(run, tmp))), tmp / "x"),
        2,
        [
            "error: --checkpoint '",
            "/run' is a taper run's folder, not a saved model: it holds no tapered/ and no checkpoint-N folder (the "
            "run stopped before it saved one), so nothing in it can be used; taper again into it (--output_dir '",
            "/run' --overwrite)",
        ],
        NEEDS_RUN,
    ),
    # push, bench, eval --scan_reference and taper said "a folder without config.json" of a run folder
    "bench of the run folder": (
        lambda ws, run, tmp: [*_bench(ws)[:2], str(run), *_bench(ws)[3:]],
        2,
        "error: --model_name_or_path '{ws}/run' is a taper run's folder, not a saved model: bench builds its variants "
        "from an ordinary model, which the run's outputs are not: pass the model the run started from, '{ws}/llama'",
        NEEDS_RUN,
    ),
    "eval --scan_reference of the run folder": (
        lambda ws, run, tmp: (
            [*evaluate(run / "folded", data=ws / "corpus.txt")[:-2], "--scan_windows", "4"]
            + ["--scan_reference", str(run)]
        ),
        2,
        "error: --scan_reference '{ws}/run' is a taper run's folder, not a saved model: the scan compares with an "
        "ordinary model: the run's original, --scan_reference '{ws}/llama' (a scan of '{ws}/run/folded' compares "
        "with it without --scan_reference)",
        NEEDS_RUN,
    ),
    "taper from the run folder": (
        lambda ws, run, tmp: _taper(ws, model="run"),
        2,
        "error: --model_name_or_path '{ws}/run' is a taper run's folder, not a saved model: to continue this run, "
        "--output_dir '{ws}/run' --resume (with its options); to taper again from the start, pass the model the run "
        "started from, '{ws}/llama' (its tapered/ and folded/ are no starting point: taper refuses them)",
        NEEDS_RUN,
    ),
    "push of the folder of a run that wrote no folded/": (
        lambda ws, run, tmp: ["push", "--export_dir", str(_without(copy_of(run, tmp), "folded")), "--repo_id", "me/x"],
        2,
        [
            "error: --export_dir '",
            "/run' is a taper run's folder, not a saved model: it holds no folded/ export: fold its tapered "
            "checkpoint (hf-tapernorm fold --checkpoint '",
            "/run/tapered' --output_dir EXPORT) and push that export",
        ],
        NEEDS_RUN,
    ),
    # a finished run without folded/ (folded elsewhere, or its export moved away): eval named '<run>/folded',
    # which is not there; it names the tapered/ checkpoint the run holds, or folding into '<run>/folded' first
    "eval of the folder of a run that wrote no folded/": (
        lambda ws, run, tmp: evaluate(_without(copy_of(run, tmp), "folded"), data=ws / "corpus.txt"),
        2,
        [
            "error: --model_name_or_path '",
            "/run' is a taper run's folder, not a saved model: it holds no folded/ export: evaluate its tapered "
            "checkpoint (at g = 0), --model_name_or_path '",
            "/run/tapered', or fold it first (hf-tapernorm fold --checkpoint '",
            "/run/tapered' --output_dir '",
            "/run/folded') and evaluate that export",
        ],
        NEEDS_RUN,
    ),
    "fold --overwrite onto the run folder": (
        lambda ws, run, tmp: fold(copy_of(run, tmp) / "tapered", tmp / "run", "--overwrite"),
        2,
        ["/run' is '", "/run', a taper run's folder: the export would mix with the run's files", "/run/folded)"],
        NEEDS_RUN,
    ),
    # a run killed before report.json: "its report.json records none that is there" (there was
    # none, and its manifest records the model), and fold/push pointed at a checkpoint saved at gate 0.5
    "bench of a run killed before its report": (
        lambda ws, run, tmp: [*_bench(ws)[:2], str(_without_tapered(copy_of(run, tmp))), *_bench(ws)[3:]],
        2,
        "bench builds its variants from an ordinary model, which the run's outputs are not: pass the model the run "
        "started from, '{ws}/llama'",
        NEEDS_RUN,
    ),
    # a killed run started with a relative model path: "which is not there", though it was (beside
    # the run, where it was started from); the path is looked for there (and from the working folder) now
    "bench of a killed run whose records name a relative model path": (
        lambda ws, run, tmp: [
            *_bench(ws)[:2],
            str(_with_relative_model(_without_tapered(copy_of(run, tmp)), ws)),
            *_bench(ws)[3:],
        ],  # fmt: skip
        2,
        ["pass the model the run started from, '", "/llama'"],
        NEEDS_RUN,
    ),
    "eval --scan_reference of a run killed before its report, with no record of its model": (
        lambda ws, run, tmp: (
            [*evaluate(run / "folded", data=ws / "corpus.txt")[:-2], "--scan_windows", "4"]
            + ["--scan_reference", str(_without_records(_without_tapered(copy_of(run, tmp))))]
        ),
        2,
        "the scan compares with an ordinary model: pass the model the run started from (the run wrote no "
        "report.json, and nothing in it records the model)",
        NEEDS_RUN,
    ),
    "fold of a run that stopped before its taper ended": (
        lambda ws, run, tmp: fold(_stopped_mid_taper(_without_tapered(copy_of(run, tmp))), tmp / "x"),
        2,
        [
            "/run' is a taper run's folder, not a saved model: it holds no tapered/ and no checkpoint-N folder saved "
            "at gate 0 (the run stopped before its taper ended): continue it, hf-tapernorm taper --output_dir '",
            "/run' --resume (with its options), then fold its tapered/",
        ],
        NEEDS_RUN,
    ),
    "push of a run that stopped before its taper ended": (
        lambda ws, run, tmp: [
            *["push", "--export_dir", str(_stopped_mid_taper(_without_tapered(copy_of(run, tmp))))],
            *["--repo_id", "me/x"],
        ],
        2,
        ["--resume (with its options), then fold its tapered/, and push that export"],
        NEEDS_RUN,
    ),
    # taper's --output_dir inside another run, its export or checkpoint, or a killed run trained and
    # wrote a whole run there; now refused as bench's, eval's and fold's outputs are
    "taper: the output folder inside a run's export": (
        lambda ws, run, tmp: _taper(ws, "--output_dir", str(copy_of(run, tmp) / "folded" / "sub")),
        2,
        [
            "error: --output_dir '",
            "/run/folded/sub' lies in '",
            "/run/folded', a saved model's folder: its checkpoints and reports would join the model (a push would "
            "upload them); choose an --output_dir outside it",
        ],
        NEEDS_RUN,
    ),
    "taper: the output folder inside a run's tapered checkpoint": (
        lambda ws, run, tmp: _taper(ws, "--output_dir", str(copy_of(run, tmp) / "tapered" / "sub")),
        2,
        ["/run/tapered/sub' lies in '", "/run/tapered', a saved model's folder"],
        NEEDS_RUN,
    ),
    "taper: the output folder inside a finished run": (
        lambda ws, run, tmp: _taper(ws, "--output_dir", str(copy_of(run, tmp) / "sub")),
        2,
        [
            "error: --output_dir '",
            "/run/sub' lies in '",
            "/run', a taper run's folder: its checkpoints and reports would mix with the run's files, which its "
            "--overwrite and --resume then refuse; choose an --output_dir outside it",
        ],
        NEEDS_RUN,
    ),
    "taper: the output folder inside a killed run": (
        lambda ws, run, tmp: _taper(ws, "--output_dir", str(_without_tapered(copy_of(run, tmp)) / "sub")),
        2,
        ["/run/sub' lies in '", "/run', a taper run's folder"],
        NEEDS_RUN,
    ),
    # another run's tapered/ folded into a run's folded/ was taken as that run's own export
    "fold of another run's checkpoint into a run's folded/": (
        lambda ws, run, tmp: fold(run / "tapered", copy_of(run, tmp, "runB") / "folded", "--overwrite"),
        2,
        [
            "error: --output_dir '",
            "/runB/folded' is the export of the taper run in '",
            "/runB', and --checkpoint '{ws}/run/tapered' is not that run's (its tapered/ or a checkpoint-N), while the "
            "run's report describes its own fold: fold '",
            "/runB/tapered' into it, or write this export to a folder outside the run",
        ],
        NEEDS_RUN,
    ),
    "eval --output_json naming a folder": (
        lambda ws, run, tmp: evaluate(run / "folded", "--output_json", str(tmp), data=ws / "corpus.txt"),
        2,
        ["is a symbolic link or a folder; name a new file"],
        NEEDS_RUN,
    ),
    "eval --scan_reference missing": (
        lambda ws, run, tmp: (
            [*evaluate(run / "folded", data=ws / "corpus.txt")[:-2], "--scan_windows", "4"]
            + ["--scan_reference", str(tmp / "nope")]
        ),
        2,
        ["nope' not found"],
        NEEDS_RUN,
    ),
    "eval --data_cache_dir in a folder a running command holds": (
        lambda ws, run, tmp: evaluate(
            run / "folded", "--data_cache_dir", str(_held(tmp / "live") / "cache"), data=ws / "corpus.txt"
        ),
        2,
        ["error: --data_cache_dir '", "/live/cache' lies in '", "/live', which a running hf-tapernorm command owns"],
        NEEDS_RUN,
    ),
    "taper --data_cache_dir in a folder a running command holds": (
        lambda ws, run, tmp: taper(ws, tmp / "out", "--data_cache_dir", str(_held(tmp / "live") / "cache")),
        2,
        ["error: --data_cache_dir '", "/live/cache' lies in '", "/live', which a running hf-tapernorm command owns"],
        NEEDS_RUN,
    ),
    "eval --data_cache_dir in a run's export": (
        lambda ws, run, tmp: evaluate(
            run / "folded", "--data_cache_dir", str(copy_of(run, tmp) / "folded"), data=ws / "corpus.txt"
        ),
        2,
        ["error: --data_cache_dir '", "/run/folded' lies in '", "/run/folded', a saved model's folder", "push"],
        NEEDS_RUN,
    ),
    "taper --data_cache_dir in a run's tapered checkpoint": (
        lambda ws, run, tmp: taper(ws, tmp / "out", "--data_cache_dir", str(copy_of(run, tmp) / "tapered" / "c")),
        2,
        ["error: --data_cache_dir '", "/run/tapered/c' lies in '", "/run/tapered', a saved model's folder"],
        NEEDS_RUN,
    ),
    "eval --data_cache_dir the run folder": (
        lambda ws, run, tmp: evaluate(
            run / "folded", "--data_cache_dir", str(copy_of(run, tmp)), data=ws / "corpus.txt"
        ),
        2,
        ["error: --data_cache_dir '", "/run' is the run folder '", "/run/cache')"],
        NEEDS_RUN,
    ),
    "eval --sink none of a sink-trained export": (
        lambda ws, run, tmp: evaluate(run / "folded", "--sink", "none", data=ws / "corpus.txt"),
        2,
        ["was trained with the sink [127]", "--sink auto"],
        NEEDS_RUN,
    ),
    "push of tapered/": (
        lambda ws, run, tmp: ["push", "--export_dir", str(run / "tapered"), "--repo_id", "me/x"],
        2,
        ["is not a folded export"],
        NEEDS_RUN,
    ),
    "push of the run folder": (
        lambda ws, run, tmp: ["push", "--export_dir", str(run), "--repo_id", "me/x"],
        2,
        "error: --export_dir '{ws}/run' is a taper run's folder, not a saved model: push its folded export, "
        "--export_dir '{ws}/run/folded'",
        NEEDS_RUN,
    ),
    "push of a manifest edited to name ../report.json": (
        _edited_manifest("../report.json"),
        2,
        ["is damaged or was edited"],
        NEEDS_RUN,
    ),
    "push of a manifest edited to name '*'": (_edited_manifest("*"), 2, ["lacks files of its export (*)"], NEEDS_RUN),
    # a kill mid-move left the export without its tokenizer: eval failed in the tokenizer's loader (a ValueError)
    "eval of an export a killed write left incomplete": (
        _incomplete_export,
        2,
        [
            "error: --model_name_or_path '",
            "/folded' is an incomplete export: it lacks files of its export (tokenizer.json, tokenizer_config.json), "
            "which its manifest lists",
            "export it again with overwrite=True (hf-tapernorm fold --overwrite)",
        ],
        NEEDS_RUN,
    ),
    # both said "model '...' is an incomplete export", as if --model_name_or_path were meant
    "eval --scan_reference of an incomplete export": (
        _incomplete_reference,
        2,
        [
            "error: --scan_reference '",
            "/folded' is an incomplete export: it lacks files of its export (tokenizer.json)",
        ],
        NEEDS_RUN,
    ),
    "push of an export without its README.md": (
        _push_without_a_card,
        2,
        [
            "error: --export_dir '",
            "/folded' lacks README.md, which its export wrote and push publishes with its weights (a copy an earlier "
            "push left on the Hub would stay beside these); write your own in its place (push uploads its owner's "
            "edits), or export it again with overwrite=True (hf-tapernorm fold --overwrite)",
        ],
        NEEDS_RUN,
    ),
    # a live export_folded writing into D was not named: "not empty", then "not an earlier export"
    **{
        " ".join(["fold", *extra, "into a folder an export_folded is writing"]): (
            _fold_beside_a_live_write(*extra),
            2,
            [
                "/D': another write of ",
                f"is in progress (pid {os.getppid()}: {process_command(os.getppid())}, through '.hf_tapernorm_writing-",
                f"' only if process {os.getppid()} is not writing this export, its pid reused after a restart)",
            ],
            NEEDS_RUN,
        )
        for extra in ((), ("--overwrite",))
    },
    "push with a hidden .cache/token": (
        _push_with(".cache/token"),
        2,
        ["did not write (.cache/token)", "--include"],
        NEEDS_RUN,
    ),
    "push with a file named like a pattern": (
        _push_with("[tokenizer].json"),
        2,
        ["did not write ([tokenizer].json)"],
        NEEDS_RUN,
    ),
    "resume after editing the checkpoint's tapernorm_config.json": (
        _resume_with_edited_checkpoint_config,
        2,
        ["tapernorm_config.json was edited after the run wrote it", "ema_rate: 0.5 in the file, 0.01 recorded"],
        NEEDS_RUN,
    ),
    # it was "too small ... holds only 1 document(s) ...: split the text into more", advice that cannot help
    "data of blank lines only": (
        _data("blank.txt", "\n\n   \n\t\n\n"),
        2,
        ["--dataset_name '", "blank.txt' is empty: the file holds no text"],
        NEEDS_RUN,
    ),
    "data of one huge line": (
        _data("line.txt", " ".join(corpus_documents(150))),
        2,
        ["holds only 1 document(s)", "split the text into more lines or paragraphs (each of its documents is one line"],
        NEEDS_RUN,
    ),
    "scan_windows -1": (
        lambda ws, run, tmp: taper(ws, tmp / "o", "--scan_windows", "-1"),
        2,
        ["--scan_windows"],
        NEEDS_RUN,
    ),
    "out_of_corpus_blocks -1": (
        lambda ws, run, tmp: taper(ws, tmp / "o", "--out_of_corpus_blocks", "-1"),
        2,
        ["--out_of_corpus_blocks must be >= 0"],
        NEEDS_RUN,
    ),
    "heldout_percentage 0": (
        lambda ws, run, tmp: taper(ws, tmp / "o", "--heldout_percentage", "0"),
        2,
        ["--heldout_percentage must be in (0, 100)"],
        NEEDS_RUN,
    ),
    # a ~user this machine does not have, in any path option of any command: one line naming the option
    **{
        f"{command} {option} '{NO_USER}'": (
            lambda ws, make=WITH_OPTION[command], option=option: make(ws, option, NO_USER),
            2,
            f"error: {option} {NO_USER_LINE}",
        )
        for command, options in PATH_OPTIONS.items()
        for option in options
    },
    # an empty path (an unset shell variable) in any path option of any command: it was the working folder (eval
    # scored the model there, push went on to upload it); one line naming the option
    **{
        f"{command} {option} ''": (
            lambda ws, make=WITH_OPTION[command], option=option: make(ws, option, ""),
            2,
            f"error: {option} '': an empty path names no file or folder (it would be the working folder); name one",
        )
        for command, options in PATH_OPTIONS.items()
        for option in options
    },
    # the CLI's traceback switch took every --debug, so the Trainer's --debug (in taper --help) left its value over,
    # and the refusal of that value came as a traceback (the switch re-raises): a --debug before a debug feature is
    # the Trainer's option now, and a command without one refuses it in one line
    "taper: the Trainer's --debug with a feature, then a refused option": (
        lambda ws: _taper(ws, "--debug", "underflow_overflow", "--ema_rate", "0"),
        2,
        "error: --ema_rate must be in",
    ),
    "fold: the Trainer's --debug with a feature, which fold has not": (
        lambda ws: [
            "fold",
            "--checkpoint",
            str(ws / "llama"),
            "--output_dir",
            str(ws / "f"),
            "--debug",
            "underflow_overflow",
        ],
        2,
        "error: unrecognized arguments: ['--debug', 'underflow_overflow'] (see hf-tapernorm fold --help)",
    ),
    # a --debug before a value that is no debug feature (misspelt, a comma list) was the traceback switch, and the
    # value left over was refused as a traceback: after the command word it is the Trainer's option, refused in one line
    "taper: the Trainer's --debug with a misspelt feature": (
        lambda ws: _taper(ws, "--debug", "underflw_overflow"),
        2,
        "error: argument --debug: invalid DebugOption value: 'underflw_overflow' (see hf-tapernorm taper --help)",
    ),
    "taper: the Trainer's --debug with a comma list": (
        lambda ws: _taper(ws, "--debug", "underflow_overflow,tpu_metrics_debug"),
        2,
        "error: argument --debug: invalid DebugOption value: 'underflow_overflow,tpu_metrics_debug' (see ",
    ),
    "taper: an options file's output_dir under a ~user this machine does not have": (
        _no_user_in_options_file,
        2,
        f"error: --output_dir {NO_USER_LINE}",
        ("tmp_path",),
    ),
}


#: the data caches of the workspace's commands: a refusal made after reading the data may fill them (a read cache,
#: not an output)
DATA_CACHES = ("cache", "datasets_cache")


def _state(folder: Path) -> dict[str, bytes | None]:
    """Every file of ``folder`` with its bytes, and every folder (``None``), the data caches left out."""
    paths = (p for p in folder.rglob("*") if p.relative_to(folder).parts[0] not in DATA_CACHES)
    return {p.relative_to(folder).as_posix(): p.read_bytes() if p.is_file() else None for p in paths}


@pytest.mark.parametrize("name", list(CASES))
def test_a_refused_command_stops_with_one_line_and_writes_nothing(ws, name, request, monkeypatch):
    make_argv, code, fragments, *needs = CASES[name]
    fixtures = [request.getfixturevalue(fixture) for fixture in (needs[0] if needs else ())]
    argv = make_argv(ws, *fixtures)
    folders = [ws, *(f for f in fixtures if isinstance(f, Path))]
    before = [_state(folder) for folder in folders]
    monkeypatch.setattr("hf_tapernorm.app.taper.load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    status, _, stderr = run_main(argv)
    first = next((line for line in stderr.splitlines() if line.startswith("hf-tapernorm ")), stderr[-2000:])
    assert status == code, stderr[-2000:]
    assert first.startswith(f"hf-tapernorm {argv[0]}: error: "), first
    for fragment in [fragments] if isinstance(fragments, str) else fragments:
        assert fragment.format(ws=ws) in first, first
    assert [_state(folder) for folder in folders] == before


def test_a_mistyped_model_path_is_named_as_such(workspace, tmp_path):
    message = error_of(["fold", "--checkpoint", "no_such/folder", "--output_dir", str(tmp_path / "export")])
    assert (
        message == "hf-tapernorm fold: error: --checkpoint 'no_such/folder': no such folder; fold reads a local "
        "tapered checkpoint"
    )
    corpus = str(workspace / "corpus.txt")
    status, _, stderr = run_main(["eval", "--model_name_or_path", "no_such/folder", "--dataset_name", corpus])
    lines = stderr.strip().splitlines()
    assert status == 2 and len(lines) == 1, stderr  # transformers' message runs over two lines
    assert "'no_such/folder' (no local folder of that name, so it was taken as a Hub id: check the path" in lines[0]


def test_a_killed_run_s_relative_model_path_is_named_only_where_it_holds_the_recorded_model(
    ws, short_run, tmp_path, monkeypatch
):
    """A run started with a relative --model_name_or_path (its records name 'llama', with the model's digests) and
    killed, then named to bench from another working folder holding another model under 'llama': the hint said
    "pass the model the run started from, 'llama'", the other model. A path found from here or beside the run is
    named only where its files are the ones the run recorded (the one beside the run, here), else the hint says the
    model there is not the one the run started from."""
    run = _without_tapered(copy_of(short_run, tmp_path / "started"))
    contents = fingerprint(str(ws / "llama"), weights_by_size=True)
    edit_json(run / ".hf_tapernorm_run.json", identity={"model": "llama", "model_contents": contents})
    for record in run.glob("checkpoint-*/tapernorm_run.json"):
        record.unlink()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "llama").symlink_to(ws / "other_tokenizer")  # another tiny Llama, other weights
    monkeypatch.chdir(elsewhere)
    argv = [*_bench(ws)[:2], str(run), *_bench(ws)[3:]]
    head = f"hf-tapernorm bench: error: --model_name_or_path '{run}' is a taper run's folder, not a saved model: "
    head += "bench builds its variants from an ordinary model, which the run's outputs are not: "
    assert error_of(argv) == (
        f"{head}pass the model the run started from (the run wrote no report.json; its records name 'llama', and "
        f"the model at '{elsewhere / 'llama'}' is not the one the run started from: its files differ from the ones "
        "the run recorded)"
    )
    (run.parent / "llama").symlink_to(ws / "llama")  # where the run was started from
    assert error_of(argv) == f"{head}pass the model the run started from, '{run.parent / 'llama'}'"


def test_a_killed_legacy_run_s_relative_model_path_is_named_beside_the_run_and_said_unchecked(
    ws, short_run, tmp_path, monkeypatch
):
    """A run started with a relative --model_name_or_path whose records hold no digests of it (a legacy record),
    killed, then named to bench from another working folder holding another model under 'llama': the hint named
    'llama', the other model, without a word. With no digests the place beside the run comes first, and the hint
    says that the path could not be checked."""
    run = _without_tapered(copy_of(short_run, tmp_path / "started"))
    edit_json(run / ".hf_tapernorm_run.json", identity={"model": "llama"})
    for record in run.glob("checkpoint-*/tapernorm_run.json"):
        record.unlink()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "llama").symlink_to(ws / "other_tokenizer")
    monkeypatch.chdir(elsewhere)
    argv = [*_bench(ws)[:2], str(run), *_bench(ws)[3:]]
    head = f"hf-tapernorm bench: error: --model_name_or_path '{run}' is a taper run's folder, not a saved model: "
    head += "bench builds its variants from an ordinary model, which the run's outputs are not: "
    unchecked = " (its records name 'llama', which could not be checked: the run recorded no digests of it)"
    assert error_of(argv) == f"{head}pass the model the run started from, 'llama'{unchecked}"
    (run.parent / "llama").symlink_to(ws / "llama")  # where the run was started from
    assert error_of(argv) == f"{head}pass the model the run started from, '{run.parent / 'llama'}'{unchecked}"


def test_report_to_wandb_without_a_login_is_refused_before_the_model_loads(ws, tmp_path, monkeypatch):
    """`taper --report_to wandb` with wandb installed but not logged in failed once the model was loaded (wandb's init
    in the Trainer). wandb's own `wandb.login` is asked first: where it cannot log in, the run is refused in one line;
    where it can, or where WANDB_MODE needs no account, the run goes on; without wandb at all, the integration's own
    refusal stays one line. A fake wandb module stands in for the package."""
    import importlib.util
    import sys

    (tmp_path / "wandb.py").write_text(
        "run = None\n"  # what transformers' is_wandb_available looks for
        "logged_in = False\n"
        "calls = []\n"
        "class UsageError(Exception):\n    pass\n"
        "def login(**kwargs):\n"
        "    calls.append(kwargs)\n"
        "    if not logged_in:\n"
        "        raise UsageError('api_key not configured (no-tty). call wandb.login(key=[your_api_key])')\n"
        "    return True\n"
    )
    spec = importlib.util.spec_from_file_location("wandb", tmp_path / "wandb.py")
    fake = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fake)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setattr("hf_tapernorm.app.taper.load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    argv = taper_argv(ws, tmp_path / "out", "--report_to", "wandb")
    assert error_of(argv) == (
        "hf-tapernorm taper: error: --report_to ['wandb']: wandb cannot log in here (UsageError: api_key not "
        "configured (no-tty). call wandb.login(key=[your_api_key])), so its start in the Trainer would fail once the "
        "model is loaded: run `wandb login`, set WANDB_API_KEY, or set WANDB_MODE=offline to log to local files"
    )
    assert fake.calls == [{"anonymous": "never", "verify": False}]  # never verified over the network here

    def accepted() -> None:
        with pytest.raises(pytest.fail.Exception, match="the model was loaded"):
            run_main(argv)

    for mode in ("offline", "disabled", "dryrun"):
        monkeypatch.setenv("WANDB_MODE", mode)
        accepted()
    assert len(fake.calls) == 1  # a mode without an account is not asked to log in
    monkeypatch.delenv("WANDB_MODE")
    fake.logged_in = True
    accepted()
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    assert error_of(argv) == (
        "hf-tapernorm taper: error: --report_to ['wandb']: RuntimeError: WandbCallback requires wandb to be "
        "installed. Run `pip install wandb`."
    )
    assert not (tmp_path / "out").exists()


def test_deepspeed_without_its_package_is_one_line_before_anything_loads(ws, tmp_path, monkeypatch):
    """`taper --deepspeed ds.json` without deepspeed installed was a PackageNotFoundError traceback (transformers
    checks the package while it parses the arguments)."""
    monkeypatch.setattr("hf_tapernorm.cli.arguments.is_deepspeed_available", lambda: False)
    (tmp_path / "ds.json").write_text("{}")
    argv = taper_argv(ws, tmp_path / "out", "--deepspeed", str(tmp_path / "ds.json"))
    assert error_of(argv) == (
        f"hf-tapernorm taper: error: --deepspeed {tmp_path / 'ds.json'}: the deepspeed package is not installed (pip "
        "install deepspeed), or leave --deepspeed out"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds.json"]


def test_every_compile_backend_accepted_compiles_a_module_on_the_cpu():
    """The backends the compile options accept (utils.compile_backends) each compile and run a tiny module here,
    but those whose package is missing, which the same check refuses: torch's own test backends (ts, aot_ts, the
    minifiers), once accepted, failed at the first compiled forward."""
    import torch

    from hf_tapernorm.errors import ConfigurationError
    from hf_tapernorm.utils import check_compile_options, compile_backends

    module, x = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU()), torch.randn(2, 4)
    ran = []
    for backend in compile_backends():
        try:
            check_compile_options(backend, None, ("--compile_backend", "--compile_mode"))
        except ConfigurationError as error:
            assert "not installed here" in str(error)
            continue
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(module, backend=backend)(x), module(x))
        ran.append(backend)
    assert {"eager", "aot_eager", "inductor"} <= set(ran)


def test_a_compile_backend_the_trainers_accelerate_does_not_take_is_refused(ws, monkeypatch):
    """A backend torch lists (an installed plugin's) that accelerate, which compiles the Trainer's model, does not
    take: refused before the model loads, naming accelerate's backends."""
    import hf_tapernorm.utils

    listed = hf_tapernorm.utils.compile_backends()
    monkeypatch.setattr(hf_tapernorm.utils, "compile_backends", lambda: [*listed, "a_plugin"])
    monkeypatch.setattr("hf_tapernorm.app.taper.load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    message = error_of(taper_argv(ws, ws / "out", "--torch_compile_backend", "a_plugin"))
    assert message.startswith(
        "hf-tapernorm taper: error: --torch_compile_backend a_plugin: not a backend accelerate compiles the Trainer's "
        "model with: no, eager, "
    ), message
