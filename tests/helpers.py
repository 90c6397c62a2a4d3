"""Helpers shared by several test modules (fixtures live in conftest.py): the CLI runs on the tiny workspace,
a signal sent at a known optimizer step, a spy callback on each training of a run, tapered tiny models for the
folding tests, an offline tokenizer."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedTokenizerFast, TrainerCallback

import hf_tapernorm.app.training_run as training_run
from hf_tapernorm import TaperNormConfig, patch_model
from hf_tapernorm.cli import main
from hf_tapernorm.layers import TaperNorm, set_gate
from hf_tapernorm.training import calibrate
from tests.conftest import build, random_batches, tiny_gpt2_config, tiny_llama_config

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
from hf_tapernorm.cli import main
sys.exit(main(sys.argv[3:]))
"""


def signal_at_step(argv: list[str], env: dict[str, str], *, step: int, signum: int) -> tuple[int, str]:
    """The CLI in a subprocess that receives ``signum`` at the end of optimizer step ``step``: (exit status,
    stdout and stderr)."""
    done = subprocess.run(
        [sys.executable, "-c", SIGNALLER, str(step), str(int(signum)), *argv],
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
