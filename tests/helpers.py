"""Helpers shared by several test modules (fixtures live in conftest.py): the CLI runs on the tiny workspace,
a signal sent at a known optimizer step, a spy callback on each training of a run, tapered tiny models for the
folding tests, an offline tokenizer, short runs on a one-model workspace (and the run the interruption tests kill),
sink models of every gated family, and a taper run under torchrun."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn
from transformers import PreTrainedTokenizerFast, TrainerCallback

import hf_tapernorm.app.training_run as training_run
from hf_tapernorm import TaperNormConfig, patch_model, save_tapered
from hf_tapernorm.cli import main
from hf_tapernorm.layers import TaperNorm, set_gate
from hf_tapernorm.training import calibrate
from tests.conftest import (
    build,
    char_tokenizer,
    corpus_documents,
    random_batches,
    save_tiny_model,
    tiny_family_config,
    tiny_gpt2_config,
    tiny_llama_config,
)

REPO = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------- the CLI on the tiny workspace
def taper_argv(ws: Path, out: Path, *extra: str, model: str = "llama", steps: int = 10) -> list[str]:
    """``taper`` on the ``workspace`` fixture's tiny model and corpus (conftest.py)."""
    return [
        "taper", "--model_name_or_path", str(ws / model), "--dataset_name", str(ws / "corpus.txt"),
        "--block_size", "32", "--heldout_blocks", "4", "--heldout_percentage", "10",
        "--max_steps", str(steps), "--per_device_train_batch_size", "2", "--taper_start", "2",
        "--taper_end", str(int(steps * 0.6)), "--output_dir", str(out), "--use_cpu", "--disable_tqdm", "true",
        "--data_cache_dir", str(ws / "datasets_cache"), "--out_of_corpus_blocks", "16", *extra,
    ]  # fmt: skip


def run_main(argv: list[str]) -> tuple[int, str, str]:
    """The CLI in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def error_of(argv: list[str], code: int = 2) -> str:
    """The CLI's one-line error (asserting the exit status ``code``)."""
    status, _, stderr = run_main(argv)
    assert status == code, stderr[-2000:]
    lines = [line for line in stderr.strip().splitlines() if line.startswith("hf-tapernorm")]
    assert lines, stderr[-2000:]
    return lines[-1]


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file of ``folder`` with its bytes (to show that nothing changed)."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


#: Runs the CLI with one hook: at the end of optimizer step STEP, before the run's interrupt flag is polled,
#: the process sends itself SIGNUM and waits until the run's handler has taken it. The signal then stops the
#: run at exactly that step, however busy the machine is.
SIGNALLER = """
import os, sys, time
import hf_tapernorm.app.training_run as training_run
STEP, SIGNUM = int(sys.argv[1]), int(sys.argv[2])
original = training_run.InterruptCallback.on_step_end

def on_step_end(self, args, state, control, **kwargs):
    if state.global_step == STEP and not self.requested:
        os.kill(os.getpid(), SIGNUM)
        for _ in range(10000):
            if self.requested:
                break
            time.sleep(0.001)
    return original(self, args, state, control, **kwargs)

training_run.InterruptCallback.on_step_end = on_step_end
from {entry} import main
sys.exit(main(sys.argv[3:]))
"""


def signal_at_step(
    argv: list[str], env: dict[str, str], *, step: int, signum: int, entry: str = "hf_tapernorm.cli"
) -> tuple[int, str]:
    """The CLI (or another ``main(argv)`` of module ``entry``) in a subprocess that receives ``signum`` at the end of
    optimizer step ``step``: (exit status, stdout and stderr)."""
    done = subprocess.run(
        [sys.executable, "-c", SIGNALLER.format(entry=entry), str(step), str(int(signum)), *argv],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )
    return done.returncode, done.stdout


def spy_on_trainings(monkeypatch, new_spy: Callable[[], TrainerCallback]) -> list[TrainerCallback]:
    """Give every training a ``taper`` run starts (the tapered one, then the baseline) a fresh ``new_spy()`` callback;
    the spies, in that order, fill the list returned."""
    spies: list[TrainerCallback] = []
    original = training_run.train

    def recording(model, training_args, train_dataset, output_dir, callbacks, **kwargs):
        spies.append(new_spy())
        return original(model, training_args, train_dataset, output_dir, [*callbacks, spies[-1]], **kwargs)

    monkeypatch.setattr("hf_tapernorm.app.taper.train", recording)
    return spies


# ----------------------------------------------------------------------------- tapered tiny models
CONFIGS = {"llama": tiny_llama_config, "gpt2": tiny_gpt2_config}
IDS = random_batches(n=1, batch=2, length=12, seed=3)[0]


def tapered(
    kind: str,
    scope: str = "internal",
    dtype: torch.dtype = torch.float32,
    sink_token_ids=None,
    keep_norms=(),
    **overrides,
) -> nn.Module:
    """A patched tiny model at g = 0 with non-trivial gammat, beta and c (perturbed after calibration).

    With ``sink_token_ids`` those positions stay normalized and every calibration batch starts with them.
    """
    model = patch_model(
        build(CONFIGS[kind](**overrides), dtype=dtype),
        TaperNormConfig.paper(scope=scope, sink_token_ids=sink_token_ids, keep_norms=keep_norms),
    )
    sink = torch.tensor(list(sink_token_ids or []), dtype=torch.long)
    model.train()
    with torch.no_grad():
        for ids in random_batches():
            model(torch.cat([sink.expand(ids.shape[0], -1), ids], dim=1))
    calibrate(model)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in (m for m in model.modules() if isinstance(m, TaperNorm) and m.tapered):
            noise = torch.randn(layer.taper_weight.shape, generator=generator)
            layer.taper_weight.mul_((1 + 0.3 * noise).to(dtype))
            layer.c.mul_(1.0 + 0.5 * torch.rand((), generator=generator))
            if layer.bias is not None:
                layer.bias.add_((0.2 * torch.randn(layer.bias.shape, generator=generator)).to(dtype))
    set_gate(model, 0.0)
    return model.eval()


def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).abs().max() / expected.double().abs().max())


# ----------------------------------------------------------------------------- an offline tokenizer
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog"]


def word_tokenizer(adds_bos: bool) -> PreTrainedTokenizerFast:
    """An offline word-level tokenizer (ids 3..), with or without a post-processor that prepends <s> (id 1)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{word: 3 + index for index, word in enumerate(WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    if adds_bos:
        backend.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="</s>"
    )


# ----------------------------------------------------------------------------- a short run on a one-model workspace
def one_model_workspace(root: Path) -> Path:
    """``root`` with a tiny saved Llama (``llama/``) and a 150-document corpus (``corpus.txt``)."""
    save_tiny_model(root / "llama", "llama")
    (root / "corpus.txt").write_text("\n\n".join(corpus_documents(150)))
    return root


def short_taper_argv(
    ws: Path, out, *extra: str, steps: int = 6, data: str = "corpus.txt", model: str | None = None
) -> list[str]:
    """``taper`` for ``steps`` steps (the gate falls over steps 2..4) on ``one_model_workspace``, without the
    out-of-corpus set and the robustness scan."""
    return [
        "taper", "--model_name_or_path", model or str(ws / "llama"), "--dataset_name", str(ws / data),
        "--block_size", "32", "--heldout_blocks", "4", "--heldout_percentage", "10", "--max_steps", str(steps),
        "--per_device_train_batch_size", "2", "--taper_start", "2", "--taper_end", "4", "--output_dir", str(out),
        "--use_cpu", "--disable_tqdm", "true", "--data_cache_dir", str(ws / "cache"), "--out_of_corpus_blocks", "0",
        "--scan_windows", "0", *extra,
    ]  # fmt: skip


def short_eval_argv(model: Path, *extra: str, data: Path | None = None) -> list[str]:
    """``eval`` of ``model`` (by default on the corpus of the workspace two folders up), without the scan."""
    return [
        "eval", "--model_name_or_path", str(model), "--dataset_name", str(data or model.parent.parent / "corpus.txt"),
        "--block_size", "32", "--heldout_blocks", "4", "--out_of_corpus_blocks", "0", "--scan_windows", "0", *extra,
    ]  # fmt: skip


def short_fold_argv(checkpoint: Path, output_dir, *extra: str) -> list[str]:
    return ["fold", "--checkpoint", str(checkpoint), "--output_dir", str(output_dir), "--scan_windows", "0", *extra]


def finished_run(argv: list[str]) -> Path:
    """Run ``argv`` (a ``taper`` command) to its end and return its output folder."""
    code, _, stderr = run_main(argv)
    assert code == 0, stderr
    return Path(argv[argv.index("--output_dir") + 1])


def copy_run(run: Path, tmp_path: Path, name: str = "run") -> Path:
    """A copy of the finished ``run`` (symbolic links kept) for a case to edit."""
    target = tmp_path / name
    shutil.copytree(run, target, symlinks=True)
    return target


def edit_json(path: Path, **values) -> None:
    data = json.loads(path.read_text())
    data.update(values)
    path.write_text(json.dumps(data))


def truncate(path: Path, keep: int = 30) -> None:
    path.write_text(path.read_text()[:keep])


def error_line(argv: list[str]) -> str:
    """The last ``hf-tapernorm`` line of a command that must stop with exit 2 and ``: error: ``."""
    code, _, stderr = run_main(argv)
    lines = [line for line in stderr.strip().splitlines() if line.startswith("hf-tapernorm")]
    assert code == 2 and lines and ": error: " in lines[-1], stderr[-2000:]
    return lines[-1]


def refused(arguments: list[str], *expected: str) -> str:
    """Run a command that must stop with one line (exit 2) holding every ``expected`` fragment."""
    code, _, stderr = run_main(arguments)
    line = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    assert code == 2 and line.startswith("hf-tapernorm "), stderr
    for fragment in expected:
        assert fragment in line, line
    return line


# ----------------------------------------------------------------------------- a run to interrupt, and its reference
#: The environment of a CLI run in a subprocess (unbuffered, one thread, this checkout importable).
SUBPROCESS_ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def killable_argv(workspace, out: Path) -> list[str]:
    """A 10-step run with checkpoints every 3 steps (the last two kept)."""
    extra = ("--distill_weight", "0", "--save_steps", "3", "--save_total_limit", "2")
    return taper_argv(workspace, out, *extra, steps=10)


def uninterrupted_run(workspace: Path, out: Path) -> Path:
    """An uninterrupted run of the command the interruption tests kill (no distillation: faster, same paths)."""
    return finished_run(killable_argv(workspace, out))


def assert_same_weights(run: Path, reference: Path) -> None:
    for folder in ("tapered", "folded"):
        got, expected = (
            load_file(str(run / folder / "model.safetensors")),
            load_file(str(reference / folder / "model.safetensors")),
        )
        assert got.keys() == expected.keys()
        for key in got:
            assert torch.equal(got[key], expected[key]), (folder, key)


def tapered_checkpoint(folder: Path) -> Path:
    """A tapered checkpoint (calibrated, g = 0) of a tiny Llama with the character tokenizer, saved to ``folder``."""
    model = patch_model(build(tiny_llama_config()), TaperNormConfig.paper()).train()
    for ids in random_batches():
        model(input_ids=ids)
    calibrate(model)
    set_gate(model, 0.0)
    save_tapered(model, folder, char_tokenizer())
    return folder


class Payload:
    """Unpickling this creates the marker file: proof that code from the checkpoint ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


# ----------------------------------------------------------------------------- sink models of every family
SINK = 1  # the tiny configs' bos_token_id
TEXT = random_batches(vocab=120, n=1, batch=2, length=12, seed=5)[0] + 3  # never the sink, pad or eos id


def with_sink(ids: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.full((ids.shape[0], 1), SINK), ids], dim=1)


# Qwen 3's q/k norms stay real norms, as in the default recipe (tapered with a sink they fold too:
# test_export_state.py).
KEEP = {"qwen3": ["*.q_norm", "*.k_norm"]}


def sink_tapered(case: str, keep_norms=None) -> torch.nn.Module:
    """A tiny patched model at g = 0 with the BOS sink, calibrated on sink-first batches, then perturbed."""
    keep = KEEP.get(case, []) if keep_norms is None else keep_norms
    config = TaperNormConfig.paper(sink_token_ids=[SINK], keep_norms=keep)
    model = patch_model(build(tiny_family_config(case)), config)
    model.train()
    with torch.no_grad():
        for ids in random_batches(vocab=120, n=3):
            model(with_sink(ids + 3))
    calibrate(model)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in (m for m in model.modules() if isinstance(m, TaperNorm) and m.tapered):
            layer.taper_weight.mul_(1 + 0.3 * torch.randn(layer.taper_weight.shape, generator=generator))
            layer.c.mul_(1.0 + 0.5 * torch.rand((), generator=generator))
    set_gate(model, 0.0)
    return model.eval()


def relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    return float((actual.double() - expected.double()).abs().max() / expected.double().abs().max())


# ----------------------------------------------------------------------------- the documented API
#: The documented tiers: the facade (the stable API) and the subpackages that hold everything else.
TIERS = [
    "hf_tapernorm",
    "hf_tapernorm.architectures",
    "hf_tapernorm.layers",
    "hf_tapernorm.training",
    "hf_tapernorm.export",
    "hf_tapernorm.config",
    "hf_tapernorm.data",
    "hf_tapernorm.evaluation",
    "hf_tapernorm.integrations",
]


def api_section() -> str:
    """The API section of docs/usage.md: what it presents is the documented API."""
    text = (REPO / "docs" / "usage.md").read_text()
    start = text.index("\n## API")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


#: What the research code (every script under conversion_scripts/) may import beyond the tiers: four modules of
#: the application, the taper command's helpers it reuses and its extension point (documented in docs/usage.md's
#: API section); from a module with an ``__all__``, only those names.
RESEARCH_MAY_IMPORT = {
    "hf_tapernorm.app.taper",
    "hf_tapernorm.app.training_run",
    "hf_tapernorm.cli.arguments",
    "hf_tapernorm.cli.main",
}


# ----------------------------------------------------------------------------- torchrun
def torchrun_taper(tmp_path: Path, entry: list[str], *extra: str) -> tuple[subprocess.CompletedProcess, Path]:
    """A short taper run (8 steps, 2 blocks of 32 tokens per process) of a tiny Llama under torchrun with two CPU
    processes (gloo); ``entry``: the module and its first arguments (``["-m", "hf_tapernorm.cli", "taper"]``, or a
    research script taking the taper options). Returns the finished process and the run folder."""
    save_tiny_model(tmp_path / "llama")
    (tmp_path / "corpus.txt").write_text("\n\n".join(corpus_documents(150)))
    out = tmp_path / "run"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
        "--master_port", str(port), *entry, *extra,
        "--model_name_or_path", str(tmp_path / "llama"), "--dataset_name", str(tmp_path / "corpus.txt"),
        "--block_size", "32", "--heldout_blocks", "4", "--heldout_percentage", "10", "--max_steps", "8",
        "--per_device_train_batch_size", "2", "--taper_start", "2", "--taper_end", "5", "--output_dir", str(out),
        "--use_cpu", "--disable_tqdm", "true", "--data_cache_dir", str(tmp_path / "cache"),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("hf-tapernorm taper: summary") == 1  # only the main process reports
    return result, out


def cached_hub_dataset(cache: Path, text_file: Path, repo: str = "me/one", config: str = "default") -> Path:
    """A datasets cache folder holding the Hub dataset ``repo`` (its ``config``, one train split of ``text_file``'s
    paragraphs, or of its rows for a ``.jsonl`` file) as ``datasets`` caches a download, so that it loads offline from
    ``cache`` (with HF_HUB_OFFLINE)."""
    import datasets

    scratch = cache.parent / f".{cache.name}-build"
    builder, kwargs = ("json", {}) if text_file.suffix == ".jsonl" else ("text", {"sample_by": "paragraph"})
    datasets.load_dataset(builder, data_files=str(text_file), cache_dir=str(scratch), **kwargs)
    built = next(scratch.rglob("dataset_info.json")).parent
    namespace, name = repo.split("/")
    target = cache / f"{namespace}___{name}" / config / "0.0.0" / "abc123"
    shutil.copytree(built, target)
    for arrow in target.glob("*.arrow"):
        arrow.rename(target / arrow.name.replace(f"{builder}-", f"{name}-"))
    info = json.loads((target / "dataset_info.json").read_text())
    (target / "dataset_info.json").write_text(json.dumps({**info, "config_name": config, "dataset_name": name}))
    shutil.rmtree(scratch)
    return cache


@contextlib.contextmanager
def hub_offline():
    """The Hub offline for this process (datasets and huggingface_hub read their flag once, at import)."""
    import datasets
    import huggingface_hub

    saved = datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE = saved
