"""Registration of the folded types goes through transformers' public API only."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "hf_tapernorm"
CHECKED = sorted((PACKAGE / "export").glob("*.py")) + [PACKAGE / "_import_hooks.py"]


# The attention switch transformers documents as ``config._attn_implementation`` (no public getter in 5.x):
# folding passes the unfolded model's choice on to the folded one.
ALLOWED_PRIVATE_ATTRIBUTES = {"_attn_implementation"}


def private_transformers_imports(path: Path) -> list[str]:
    """Every ``import``/``from ... import`` of ``path`` that names a transformers module or name starting with '_'."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "transformers":
            names = [*node.module.split("."), *(alias.name for alias in node.names)]
        elif isinstance(node, ast.Import):
            names = [
                part
                for alias in node.names
                if alias.name.split(".")[0] == "transformers"
                for part in alias.name.split(".")
            ]
        else:
            continue
        found += [f"{path.name}:{node.lineno}: {name}" for name in names if name.startswith("_")]
    return found


def foreign_private_attributes(paths: list[Path]) -> list[str]:
    """Reads or writes of ``x._name`` where ``_name`` is not defined by these files themselves (a function, a
    class, a variable, or an attribute they set on ``self``/``model``/``cls``): someone else's private name."""
    trees = {path: ast.parse(path.read_text(), filename=str(path)) for path in paths}
    own = set(ALLOWED_PRIVATE_ATTRIBUTES)
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "model", "cls")
            ):
                own.add(node.attr)
    return [
        f"{path.name}:{node.lineno}: {node.attr}"
        for path, tree in trees.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and node.attr not in own
    ]


def test_export_and_import_hooks_import_no_private_transformers_name():
    assert len(CHECKED) >= 7  # the export modules and the import hook are all read
    assert [found for path in CHECKED for found in private_transformers_imports(path)] == []
    assert foreign_private_attributes(CHECKED) == []


def test_the_check_catches_a_private_import(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from transformers.models.auto.configuration_auto import _LazyConfigMapping\n"
        "import transformers._private.thing\n"
        "from transformers import CONFIG_MAPPING\n"
        "extra = CONFIG_MAPPING._extra_content\n"
    )
    assert private_transformers_imports(sample) == [
        "sample.py:1: _LazyConfigMapping",
        "sample.py:2: _private",
    ]
    assert foreign_private_attributes([sample]) == ["sample.py:4: _extra_content"]


def test_folded_types_are_registered_with_loaders_that_hand_over_to_the_real_classes():
    """In a fresh process: the types are known once AutoConfig is, building a config builds and registers
    the real class (and its model class), and no family's class is built before that."""
    code = (
        "import hf_tapernorm, sys\n"
        "from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM\n"
        "from hf_tapernorm.export import modeling_folded\n"
        "assert 'tapernorm_llama' in CONFIG_MAPPING and 'tapernorm_gemma2' in CONFIG_MAPPING\n"
        "assert modeling_folded._CONFIG_CLASSES == {}, modeling_folded._CONFIG_CLASSES\n"
        "assert 'transformers.models.gemma2.configuration_gemma2' not in sys.modules\n"
        "config = AutoConfig.for_model('tapernorm_llama', vocab_size=16, hidden_size=8, intermediate_size=16,\n"
        "    num_hidden_layers=1, num_attention_heads=2)\n"
        "print(type(config).__name__, CONFIG_MAPPING['tapernorm_llama'].__name__)\n"
        "model = AutoModelForCausalLM.from_config(config)\n"
        "print(type(model).__name__)\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["TaperNormLlamaConfig", "TaperNormLlamaConfig", "TaperNormLlamaForCausalLM"]


def test_a_discovered_familys_export_loads_in_a_fresh_process_with_hf_tapernorm_imported(tmp_path):
    """An export of a family outside the architecture table (olmo2, folded through automatic discovery) names the
    type ``tapernorm_olmo2``, which only the table's families were registered for: in a fresh process transformers
    asked to run the folder's modeling_folded.py ("contains custom code which must be executed"). Now every type
    transformers knows is registered lazily, so it loads as a table family's export does, running nothing from the
    folder (a marker line appended to the folder's code never runs), with the tapered model's logits; AutoModel
    refuses it in one line as it does a table family's export."""
    import torch

    from hf_tapernorm import TaperNormConfig, export_folded, fold_model, patch_model
    from hf_tapernorm.layers import set_gate
    from hf_tapernorm.training import calibrate
    from tests.conftest import build, random_batches, tiny_family_config

    model = patch_model(build(tiny_family_config("olmo2")), TaperNormConfig.paper(scope="all")).train()
    with torch.no_grad():
        for ids in random_batches():
            model(ids)
    calibrate(model)
    set_gate(model, 0.0)
    folder = export_folded(fold_model(model.eval()), tmp_path / "export")
    marker = tmp_path / "folder_code_ran"
    with open(folder / "modeling_folded.py", "a", encoding="utf-8") as handle:
        handle.write(f"\nopen({str(marker)!r}, 'w').close()\n")
    ids = random_batches(n=1, seed=4)[0]
    with torch.no_grad():
        torch.save({"ids": ids, "logits": model(ids).logits}, tmp_path / "expected.pt")
    code = (
        "import sys, torch, hf_tapernorm\n"
        "from transformers import AutoModel, AutoModelForCausalLM\n"
        "from hf_tapernorm.integrations import load_export\n"
        f"expected = torch.load({str(tmp_path / 'expected.pt')!r})\n"
        f"for model in (AutoModelForCausalLM.from_pretrained({str(folder)!r}), load_export({str(folder)!r})):\n"
        "    with torch.no_grad():\n"
        "        error = (model(expected['ids']).logits - expected['logits']).abs().max().item()\n"
        "    print(type(model).__name__, error < 1e-5)\n"
        "try:\n"
        f"    AutoModel.from_pretrained({str(folder)!r})\n"
        "except hf_tapernorm.errors.UnsupportedModelError as error:\n"
        "    print(str(error).split(':')[0], 'refused')\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["TaperNormOlmo2ForCausalLM", "True"] * 2 + ["AutoModel", "refused"]
    assert not marker.exists()
