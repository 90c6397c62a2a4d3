"""The README's quickstart runs as written: its code block, with a tiny model and a short budget swapped in.

The swaps are literal replacements, each asserted to occur, so an edit of the quickstart that changes what
the test can swap fails here instead of silently testing something else.
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import save_tiny_model
from tests.helpers import RESEARCH_MAY_IMPORT, TIERS, api_section

README = Path(__file__).resolve().parent.parent / "README.md"


def quickstart() -> str:
    """The first ```python block under the README's "## Quickstart" heading."""
    text = README.read_text()
    section = text[text.index("\n## Quickstart\n") :]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "README.md: the Quickstart section has no python code block"
    return match.group(1)


def swapped(code: str, model_folder: Path) -> str:
    swaps = {
        '"HuggingFaceTB/SmolLM2-135M"': repr(str(model_folder)),
        "max_steps=600": "max_steps=20, report_to=[], use_cpu=True, disable_tqdm=True, save_strategy='no'",
        "max_blocks=8000": "max_blocks=24",
        "pack_documents(texts, tokenizer, 128,": "pack_documents(texts, tokenizer, 32,",
    }
    for old, new in swaps.items():
        assert old in code, f"README quickstart: expected {old!r} to swap it for the test"
        code = code.replace(old, new)
    return code


def test_the_quickstart_imports_only_documented_names():
    section = api_section()
    for node in ast.walk(ast.parse(quickstart())):
        if isinstance(node, ast.ImportFrom) and node.module.startswith("hf_tapernorm"):
            assert node.module in TIERS or node.module in RESEARCH_MAY_IMPORT, node.module
            assert f"`{node.module}`" in section, f"docs/usage.md's API section does not present {node.module}"
            undocumented = [a.name for a in node.names if f"`{a.name}`" not in section]
            assert not undocumented, f"{node.module}: not in docs/usage.md's API section: {undocumented}"


def test_the_quickstart_runs_as_written_and_its_export_loads_with_its_tokenizer(tmp_path, monkeypatch):
    model_folder = save_tiny_model(tmp_path / "tiny", "llama")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    scope: dict = {}
    exec(compile(swapped(quickstart(), model_folder), str(README) + ":quickstart", "exec"), scope)  # noqa: S102

    folded, blocks = scope["folded"], scope["blocks"]
    sink = scope["sink"]
    assert len(blocks) == 24 and all(len(b["input_ids"]) == 32 and b["input_ids"][: len(sink)] == sink for b in blocks)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(tmp_path / "out"))
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")  # the export is usable as written
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = tokenizer("def main():", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.allclose(reloaded(input_ids=ids).logits, folded.eval()(input_ids=ids).logits, atol=1e-5)
