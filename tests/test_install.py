"""A plain install works end to end: the wheel, in a fresh virtual environment without the extras, runs the CLI.

The environment: ``python -m venv`` (no system site-packages), the wheel installed into it with pip's
``--python`` and ``--no-deps``. Its dependencies (torch, transformers, ...) cannot be downloaded here, so one
``.pth`` line appends this interpreter's site-packages to the venv's path, after the venv's own (the wheel
wins; that folder's own ``.pth`` files, e.g. an editable hf_tapernorm, are not processed), and marks the
extras' packages (matplotlib, gguf) as absent: ``sys.modules[name] = None`` makes every ``import`` of
them fail as if they were not installed. The test checks both before running ``taper``, ``eval``, ``fold``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from hf_tapernorm.app.report import PLOTS, PLOTS_SKIPPED
from tests.conftest import corpus_documents, save_tiny_model

REPO = Path(__file__).resolve().parent.parent
EXTRAS = ("matplotlib", "gguf")


def _run(command: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{command[:3]}: {done.stderr[-3000:]}"
    return done


@pytest.mark.install
def test_the_wheel_without_extras_runs_taper_eval_and_fold_in_a_fresh_venv(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "HF_"))}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    # Build from a copy of what the package is made of, so the checkout gets no build/ or egg-info.
    source = tmp_path / "source"
    source.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for name in ("hf_tapernorm", "model_cards"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    _run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "wheels"), str(source)], tmp_path, env
    )
    (wheel,) = (tmp_path / "wheels").glob("hf_tapernorm-*.whl")

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path, env)
    python = venv / "bin" / "python"
    site = Path(
        _run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], tmp_path, env
        ).stdout.strip()
    )
    blocked = ", ".join(f"{name!r}: None" for name in EXTRAS)
    (site / "zz_dependencies.pth").write_text(
        f"{sysconfig.get_path('purelib')}\nimport sys; sys.modules.update({{{blocked}}})\n"
    )
    _run([*pip, "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)], tmp_path, env)
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import importlib.util, hf_tapernorm\n"
        f"for name in {EXTRAS!r}:\n"
        "    assert importlib.util.find_spec(name) is None, name\n"
        "    try:\n"
        "        __import__(name)\n"
        "    except ImportError:\n"
        "        continue\n"
        "    raise SystemExit(name + ' is importable')\n"
        "print(hf_tapernorm.__file__)\n"
    )
    installed = _run([str(python), str(probe)], tmp_path, env).stdout.strip()
    assert installed.startswith(str(site)), installed  # the wheel's copy, not the checkout
    template = Path(installed).parent / "model_cards" / "folded_model.md"  # model_cards/, mapped into the package
    assert template.read_text() == (REPO / "model_cards" / "folded_model.md").read_text()

    work = tmp_path / "work"
    save_tiny_model(work / "llama", "llama")
    (work / "corpus.txt").write_text("\n\n".join(corpus_documents(60)))
    cli = str(venv / "bin" / "hf-tapernorm")
    data = ["--dataset_name", str(work / "corpus.txt"), "--block_size", "32", "--heldout_blocks", "2",
            "--heldout_percentage", "10", "--data_cache_dir", str(work / "datasets_cache")]  # fmt: skip
    run = work / "run"
    _run([cli, "taper", "--model_name_or_path", str(work / "llama"), *data, "--max_steps", "4",
          "--per_device_train_batch_size", "2", "--taper_start", "1", "--taper_end", "2", "--output_dir", str(run),
          "--use_cpu", "--disable_tqdm", "true"], work, env)  # fmt: skip
    report = json.loads((run / "report.json").read_text())
    assert report["status"] == "finished" and report["plots"] == {} and report["plots_skipped"] == PLOTS_SKIPPED
    assert PLOTS_SKIPPED in (run / "report.md").read_text()
    assert not [name for name in PLOTS.values() if (run / name).exists()]
    card = (run / "folded" / "README.md").read_text()  # the template, package data of the wheel
    assert "**The attention sink" in card and "tapernorm_llama" in card

    evaluated = _run([cli, "eval", "--model_name_or_path", str(run / "folded"), *data], work, env)
    result = json.loads(evaluated.stdout.strip().splitlines()[-1])
    assert result["kind"] == "folded" and result["loss"] == pytest.approx(report["heldout"]["folded"]["loss"], rel=1e-6)
    folded = _run([cli, "fold", "--checkpoint", str(run / "tapered"), "--output_dir", str(work / "export")], work, env)
    assert json.loads(folded.stdout.strip().splitlines()[-1])["fold"]["max_rel_diff"] <= 1e-4
    assert (work / "export" / "README.md").is_file() and (work / "export" / "model.safetensors").is_file()


def test_setup_cfg_lists_every_subpackage_and_maps_model_cards_into_the_package():
    """setup.cfg names the packages (find: cannot see the mapped model_cards/): a new subpackage must be listed."""
    import configparser

    setup = configparser.ConfigParser()
    setup.read(REPO / "setup.cfg")
    listed = set(setup["options"]["packages"].split())
    on_disk = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "hf_tapernorm").rglob("__init__.py")}
    assert listed == on_disk | {"hf_tapernorm.model_cards"}
    mapping = dict(line.split(" = ") for line in setup["options"]["package_dir"].strip().splitlines())
    assert mapping == {"hf_tapernorm.model_cards": "model_cards"}
    assert (REPO / "model_cards" / "folded_model.md").is_file() and not (REPO / "hf_tapernorm" / "model_cards").exists()
    assert setup["options.package_data"]["hf_tapernorm.model_cards"].strip() == "*.md"


def test_the_report_without_matplotlib_writes_everything_else_and_says_so_in_one_line(tmp_path, monkeypatch):
    from hf_tapernorm.app.report import write_report

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    facts = {"status": "finished", "history": [{"step": 1, "gate": 1.0, "loss": 2.0}], "heldout": {}}
    paths = write_report(tmp_path, facts)
    assert set(paths) == {"json", "markdown"}
    data = json.loads(paths["json"].read_text())
    assert data["plots"] == {} and data["plots_skipped"] == PLOTS_SKIPPED and data["history"] == facts["history"]
    markdown = paths["markdown"].read_text()
    assert markdown.count(PLOTS_SKIPPED) == 1 and "![" not in markdown
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json", "report.md"]
