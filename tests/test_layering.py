"""The package's layers import one way only, with no cycles, and ``import hf_tapernorm`` stays cheap.

Every ``from``/``import`` statement of every module counts, function-level ones included, so a cycle
cannot hide inside a function.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "hf_tapernorm"

#: Layer of each top-level module or subpackage; a module may import its own layer and those below. Every
#: layer above 0 is one subpackage, so "its own layer" is its own subpackage: the benchmark has a layer of its
#: own under the command line (cli/main.py dispatches to it; bench/ imports nothing of cli/), and both parse
#: their options with _parsing.py. The integrations (TransformerLens, nnsight, ONNX Runtime: optional extras)
#: read exports and sit under the benchmark, which runs ONNX Runtime through them.
LAYERS = {
    "errors": 0, "utils": 0, "_import_hooks": 0, "_version": 0, "_lazy": 0, "_parsing": 0,
    "architectures": 1,
    "config": 2,
    "layers": 3,
    "training": 4,
    "export": 5,
    "pipeline": 6,
    "integrations": 7,
    "bench": 8,
    "cli": 9,
}  # fmt: skip


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(name: str, path: Path) -> set[str]:
    """The hf_tapernorm modules ``name`` imports (absolute names)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.startswith("hf_tapernorm"):
                targets.add(module)
                targets.update(f"{module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            targets.update(a.name for a in node.names if a.name.startswith("hf_tapernorm"))
    known = _modules()
    return {t for t in targets if t in known and t != name}


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def test_each_layer_above_the_bottom_is_one_subpackage():
    above = [layer for name, layer in LAYERS.items() if layer > 0]
    assert len(above) == len(set(above)), "two subpackages share a layer: they could import each other"


def test_every_module_belongs_to_a_layer():
    unplaced = sorted(m for m in _modules() if m != "hf_tapernorm" and _layer(m) is None)
    assert not unplaced, f"modules outside the declared layers: {unplaced}"


def test_imports_go_one_way():
    upward = []
    for name, path in _modules().items():
        if name == "hf_tapernorm":
            continue  # the lazy facade
        for target in _imports(name, path):
            if target == "hf_tapernorm":
                upward.append(f"{name} imports the package facade")
            elif _layer(target) > _layer(name):
                upward.append(f"{name} (layer {_layer(name)}) imports {target} (layer {_layer(target)})")
    assert not upward, "\n".join(sorted(upward))


def test_no_import_cycles():
    graph = {
        name: _imports(name, path) - {"hf_tapernorm"} for name, path in _modules().items() if name != "hf_tapernorm"
    }
    done: set[str] = set()

    def cycle_from(node: str, trail: list[str]) -> list[str]:
        for target in sorted(graph.get(node, ())):
            if target in trail:
                return trail[trail.index(target) :] + [target]
            if target not in done:
                found = cycle_from(target, trail + [target])
                if found:
                    return found
        done.add(node)
        return []

    for node in sorted(graph):
        cycle = cycle_from(node, [node]) if node not in done else []
        assert not cycle, " -> ".join(cycle)


def test_the_folded_modeling_file_stands_alone():
    path = PACKAGE / "export" / "modeling_folded.py"
    assert not _imports("hf_tapernorm.export.modeling_folded", path), "modeling_folded.py is copied next to exports"


def test_import_costs_little_over_torch_and_transformers():
    code = (
        "import time, torch, transformers\n"
        "start = time.perf_counter()\n"
        "import hf_tapernorm\n"
        "print(time.perf_counter() - start)\n"
        "assert 'hf_tapernorm.layers.patching' not in __import__('sys').modules\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    seconds = [
        float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout)
        for _ in range(2)
    ]
    assert min(seconds) < 0.5, f"import hf_tapernorm took {min(seconds):.2f} s over torch + transformers"


#: The documented tiers: the facade (the stable API) and the subpackages that hold everything else.
TIERS = [
    "hf_tapernorm",
    "hf_tapernorm.architectures",
    "hf_tapernorm.layers",
    "hf_tapernorm.training",
    "hf_tapernorm.export",
    "hf_tapernorm.config",
]
DOCS = PACKAGE.parent / "docs"


def _api_section() -> str:
    text = (DOCS / "usage.md").read_text()
    start = text.index("\n## API")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def test_the_stable_api_is_small():
    import hf_tapernorm

    assert len(hf_tapernorm.__all__) <= 20, hf_tapernorm.__all__
    assert len(set(hf_tapernorm.__all__)) == len(hf_tapernorm.__all__)


@pytest.mark.parametrize("tier", TIERS)
def test_every_public_name_resolves_and_is_documented(tier):
    """Each name of each tier's ``__all__`` resolves (to an object that says it is that name) and appears in
    the API section of docs/usage.md; ``dir()`` lists it."""
    import importlib

    package = importlib.import_module(tier)
    section = _api_section()
    assert f"`{tier}`" in section, f"docs/usage.md's API section does not present {tier}"
    undocumented = []
    for name in package.__all__:
        value = getattr(package, name)
        if name != "__version__" and hasattr(value, "__name__"):
            assert value.__name__ == name, f"{tier}.{name} resolves to {value.__name__}"
        assert name in dir(package)
        if f"`{name}`" not in section:
            undocumented.append(name)
    assert not undocumented, f"{tier}: not in docs/usage.md's API section: {undocumented}"


def test_an_unknown_name_is_an_attribute_error():
    import hf_tapernorm
    import hf_tapernorm.layers

    with pytest.raises(AttributeError, match="module 'hf_tapernorm' has no attribute 'taper_norms'"):
        hf_tapernorm.taper_norms  # noqa: B018 - a removed synonym
    with pytest.raises(AttributeError, match="'hf_tapernorm.layers' has no attribute 'is_patched'"):
        hf_tapernorm.layers.is_patched  # noqa: B018


#: What the research code may import beyond the tiers: the taper command's helpers it reuses (documented in
#: docs/usage.md's API section).
RESEARCH_MAY_IMPORT = {
    "hf_tapernorm.pipeline.data",
    "hf_tapernorm.pipeline.models",
    "hf_tapernorm.pipeline.evaluation",
    "hf_tapernorm.pipeline.heldout",
    "hf_tapernorm.pipeline.scan",
    "hf_tapernorm.cli.arguments",
}
EXPERIMENTS = PACKAGE.parent / "conversion_scripts" / "experiments"


def _imported(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every absolute ``from``/``import`` statement of a file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found.extend((a.name, []) for a in node.names)
    return found


def test_the_product_suite_imports_no_research_code():
    offending = [
        f"{path.name}: {module}"
        for path in sorted((PACKAGE.parent / "tests").rglob("*.py"))
        for module, _ in _imported(path)
        if module.startswith("conversion_scripts.experiments")
    ]
    assert not offending, offending


def test_the_experiments_use_only_the_documented_api():
    import importlib

    section = _api_section()
    assert all(f"`{module}`" in section for module in RESEARCH_MAY_IMPORT)
    offending = []
    for path in sorted(EXPERIMENTS.rglob("*.py")):
        for module, names in _imported(path):
            if not module.startswith("hf_tapernorm"):
                continue
            if module in RESEARCH_MAY_IMPORT:
                continue
            if module not in TIERS:
                offending.append(f"{path.relative_to(EXPERIMENTS)}: {module}")
                continue
            public = set(importlib.import_module(module).__all__)
            offending += [f"{path.relative_to(EXPERIMENTS)}: {module}.{n}" for n in names if n not in public]
    assert not offending, "\n".join(offending)


#: The modules that print a command's result for the user; everything else logs (cli/commands.py says so).
PRINTING = {
    "hf_tapernorm.cli.commands",
    "hf_tapernorm.cli.main",
    "hf_tapernorm.pipeline.taper",
    "hf_tapernorm.bench.runner",
}


def test_only_the_commands_print():
    printing = {
        name
        for name, path in _modules().items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print"
    }
    assert printing <= PRINTING, sorted(printing - PRINTING)
