"""tapernorm_config.json: round trips (dict, JSON, checkpoint, export, the Hub), the layouts of earlier versions
migrated on load (and the runs that recorded them), files of a newer version, of the wrong types, unreadable."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

import hf_tapernorm
from hf_tapernorm import (
    ConfigurationError,
    TaperController,
    TaperNormConfig,
    export_folded,
    fold_model,
    load_tapered,
    patch_model,
    save_tapered,
)
from hf_tapernorm.config import DistillationConfig, ExperimentalOptions
from hf_tapernorm.layers import tapered_norms
from tests.conftest import build, random_batches, tiny_llama_config


def test_a_file_from_a_newer_version_loads_with_one_warning(tmp_path, caplog):
    config = TaperNormConfig.paper(keep_norms=["model.layers.1.*"], taper_start=2)
    path = config.save_pretrained(tmp_path)
    values = json.loads(path.read_text())
    assert values.pop("hf_tapernorm_version") == hf_tapernorm.__version__
    path.write_text(json.dumps({**values, "hf_tapernorm_version": "99.0", "future_knob": 3, "another": "x"}))
    with caplog.at_level(logging.WARNING, logger="hf_tapernorm.config"):
        loaded = TaperNormConfig.from_pretrained(tmp_path)
    assert loaded == config
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1, [r.getMessage() for r in warned]
    assert "another, future_knob" in warned[0].getMessage() and "99.0" in warned[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_tapernorm.config"):
        assert TaperNormConfig.from_pretrained(config.save_pretrained(tmp_path / "same").parent) == config
    assert not caplog.records  # a file of this version: no warning


def test_from_pretrained_reads_a_hub_repository(tmp_path, monkeypatch):
    import huggingface_hub

    config = TaperNormConfig.paper(sink_token_ids=[1])
    config.save_pretrained(tmp_path / "cache")
    calls = []

    def download(repo_id, filename, **kwargs):
        calls.append((repo_id, filename, kwargs.get("revision")))
        return str(tmp_path / "cache" / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    assert TaperNormConfig.from_pretrained("me/tapered-model", revision="v1") == config
    assert calls == [("me/tapered-model", "tapernorm_config.json", "v1")]

    def offline(repo_id, filename, **kwargs):
        raise huggingface_hub.errors.OfflineModeIsEnabled("Cannot reach https://huggingface.co: offline mode is on.")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    with pytest.raises(ConfigurationError) as error:
        TaperNormConfig.from_pretrained("me/tapered-model")
    assert "\n" not in str(error.value)
    assert str(error.value).startswith("TaperNormConfig.from_pretrained('me/tapered-model'): not a local folder")
    assert "OfflineModeIsEnabled" in str(error.value)
    with pytest.raises(ConfigurationError, match="no folder 'runs/missing/tapered'"):
        TaperNormConfig.from_pretrained("runs/missing/tapered")  # a path, not a repository id: no download
    with pytest.raises(ConfigurationError, match="no tapernorm_config.json in"):
        TaperNormConfig.from_pretrained(tmp_path)


def test_from_pretrained_offline_is_a_one_line_error(tmp_path):
    """With HF_HUB_OFFLINE=1 (read when huggingface_hub is imported: a fresh interpreter) and an empty cache."""
    code = (
        "from hf_tapernorm import TaperNormConfig, ConfigurationError\n"
        "try:\n"
        "    TaperNormConfig.from_pretrained('someone/not-cached')\n"
        "except ConfigurationError as error:\n"
        "    print(error)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("TaperNormConfig.from_pretrained('someone/not-cached'): not a local")


def test_round_trips_dict_json_checkpoint_and_export(tmp_path):
    config = TaperNormConfig.paper(
        keep_norms=["model.layers.1.*"],
        sink_token_ids=[5],
        taper_start=2,
        taper_end=0.5,
        distill_weight=0.5,
        distill_until="taper_end",
        experimental={"linear_fit": "per_channel"},
    )
    assert TaperNormConfig.from_dict(config.to_dict()) == config
    assert TaperNormConfig.from_dict(json.loads(config.to_json_string())) == config
    assert TaperNormConfig.from_pretrained(config.save_pretrained(tmp_path / "json").parent) == config
    model = patch_model(build(tiny_llama_config()), config).train()
    for ids in random_batches():
        model(input_ids=torch.cat([torch.full((2, 1), 5), ids], 1))
    TaperController(model, total_steps=10, distillation=False).step_begin(2)  # calibrates
    save_tapered(model, tmp_path / "ckpt")
    written = json.loads((tmp_path / "ckpt" / "tapernorm_config.json").read_text())
    assert written == {**config.to_dict(), "hf_tapernorm_version": hf_tapernorm.__version__}
    assert written["config_version"] == 3 and written["distillation"]["until"] == "taper_end"
    reloaded = load_tapered(tmp_path / "ckpt")
    assert reloaded.tapernorm_config == config
    for (name, layer), (_, original) in zip(
        tapered_norms(reloaded, include_kept=True), tapered_norms(model, include_kept=True)
    ):
        assert layer.per_channel == original.per_channel and layer.tapered == original.tapered, name
    from hf_tapernorm.layers import set_gate

    set_gate(reloaded, 0.0)
    export = export_folded(fold_model(reloaded), tmp_path / "export")
    exported = json.loads((export / "config.json").read_text())
    assert exported["tapernorm_config"] == config.to_dict()
    assert exported["hf_tapernorm_version"] == hf_tapernorm.__version__
    assert TaperNormConfig.from_pretrained(export) == config  # an export's recipe is in its config.json


def test_from_pretrained_reads_an_exports_recipe_from_its_config(tmp_path, monkeypatch):
    """TaperNormConfig.from_pretrained of a folded export said "no tapernorm_config.json ...: not a tapered
    checkpoint written by hf_tapernorm", though the export's config.json holds the recipe (its tapernorm_config) and
    the README says every export keeps it. It reads it, locally and from the Hub; a FlashNorm export, folded without
    a taper, has none, and says so."""
    import huggingface_hub

    from hf_tapernorm.export.folding import flashnorm_model
    from tests.helpers import tapered

    model = tapered("llama")
    export = export_folded(fold_model(model), tmp_path / "export")
    config = model.tapernorm_config
    assert TaperNormConfig.from_pretrained(export) == config

    def download(repo_id, filename, **kwargs):  # an export on the Hub: no tapernorm_config.json
        if filename != "config.json":
            raise huggingface_hub.errors.EntryNotFoundError(f"{filename} not found in {repo_id}")
        return str(export / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    assert TaperNormConfig.from_pretrained("me/export") == config
    plain = export_folded(flashnorm_model(build(tiny_llama_config())), tmp_path / "flashnorm")
    with pytest.raises(ConfigurationError) as refused:
        TaperNormConfig.from_pretrained(plain)
    assert str(refused.value) == (
        f"'{plain}' is a FlashNorm export (its norm weights folded without a taper): it was made with no "
        "TaperNormConfig"
    )


# ----------------------------------------------------------------------------- versions and migrations
def test_an_old_config_file_loads_migrated_and_says_so(tmp_path, caplog):
    """A version-1 tapernorm_config.json (no config_version; before distill_until and distill_schedule)."""
    from hf_tapernorm.config import CONFIG_NAME, CONFIG_VERSION, CONFIG_VERSION_KEY

    old = {"scope": "internal", "keep_norms": [], "sink_token_ids": [], "linear_fit": "paper", "calibration_scale": 1.0,
           "ema_rate": 0.01, "scale_loss_weight": 0.1, "relative_scale_loss": False, "distill_weight": 0.5,
           "distill_from": "gate_start", "sink_attention_weight": 0.0, "taper_start": 0.05, "taper_end": 0.7,
           "recipe": "paper"}  # fmt: skip
    (tmp_path / CONFIG_NAME).write_text(json.dumps({**old, "hf_tapernorm_version": "0.1.0"}))
    with caplog.at_level(logging.WARNING, logger="hf_tapernorm"):
        config = TaperNormConfig.from_pretrained(tmp_path)
    assert config == TaperNormConfig.paper(distill_weight=0.5)  # distill_until "end", distill_schedule "constant"
    assert "migrated a config_version 1 config to 3: distillation={'weight': 0.5, 'until': 'end'," in caplog.text
    assert "(what version 1 meant); save it again to keep it" in caplog.text
    saved = json.loads(config.save_pretrained(tmp_path / "again").read_text())
    assert saved[CONFIG_VERSION_KEY] == CONFIG_VERSION == 3
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_tapernorm"):
        assert TaperNormConfig.from_pretrained(tmp_path / "again") == config
    assert "migrated" not in caplog.text  # a current file is read as written
    current = config.to_dict()
    with pytest.raises(ConfigurationError, match=r"config_version must be a positive integer, got 'two'"):
        TaperNormConfig.from_dict({**current, CONFIG_VERSION_KEY: "two"})
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_tapernorm"):
        TaperNormConfig.from_dict({**current, CONFIG_VERSION_KEY: 4})
    assert "written with config_version 4, newer than this version's 3" in caplog.text


def test_a_version_2_file_loads_grouped_with_the_research_options_apart(tmp_path, caplog):
    """The flat layout of version 2 (every option a top-level field, the recipe free text), as a checkpoint or an
    export of that version recorded it: the teacher's settings become ``distillation``, the research options
    ``experimental``, and a recipe name no preset wrote ``custom``."""
    from hf_tapernorm.config import CONFIG_NAME

    written = {
        "scope": "internal", "keep_norms": ["model.layers.*.post_attention_layernorm"], "sink_token_ids": [1],
        "linear_fit": "per_channel", "calibration_scale": 1.0, "ema_rate": 0.01, "scale_loss_weight": 0.1,
        "relative_scale_loss": True, "distill_weight": 1.0, "distill_from": "original", "distill_until": "taper_end",
        "distill_schedule": "constant", "sink_attention_weight": 1.0, "taper_start": 0.05, "taper_end": 0.7,
        "recipe": "my tuned recipe", "config_version": 2, "hf_tapernorm_version": "0.9.0",
    }  # fmt: skip
    (tmp_path / CONFIG_NAME).write_text(json.dumps(written, indent=2))
    with caplog.at_level(logging.WARNING, logger="hf_tapernorm"):
        config = TaperNormConfig.from_pretrained(tmp_path)
    assert config.distillation == DistillationConfig(weight=1.0, until="taper_end", sink_attention_weight=1.0)
    assert config.experimental == ExperimentalOptions(linear_fit="per_channel", distill_from="original")
    assert config.recipe == "custom" and config.keep_norms == written["keep_norms"] and config.sink_token_ids == [1]
    assert "migrated a config_version 2 config to 3:" in caplog.text and "recipe='custom'" in caplog.text
    options = config.options()  # the report's and the run identity's view keeps the flags' names
    assert (options["distill_weight"], options["distill_until"], options["sink_attention_weight"]) == (
        1.0,
        "taper_end",
        1.0,
    )
    assert options["experimental"] == {"linear_fit": "per_channel", "distill_from": "original"}
    model = patch_model(build(tiny_llama_config()), config)  # it still drives a model: per-channel fit, teacher
    assert all(layer.per_channel for _, layer in tapered_norms(model))
    controller = TaperController(model, total_steps=100)
    assert controller.distillation.distill_from == "original" and controller.distillation.teacher is not None
    for name in ("gated-mlp", "paper+keep_qk_norms (final norm)"):  # a preset's name stays
        assert TaperNormConfig.from_dict({**written, "recipe": name}).recipe == name


def test_a_run_recorded_by_version_2_still_resumes_under_its_recipe():
    """A run identity records the recipe by option names; a run of version 2 recorded its flat fields. Both read
    as the same recipe, so such a run resumes, and an option changed since is still named by its flag."""
    from types import SimpleNamespace

    from hf_tapernorm.app.validation import check_resume_identity

    config = TaperNormConfig.paper(sink_token_ids=[1], distill_weight=1.0, sink_attention_weight=1.0)
    recorded = {
        "scope": "internal", "keep_norms": [], "sink_token_ids": [1], "linear_fit": "paper", "calibration_scale": 1.0,
        "ema_rate": 0.01, "scale_loss_weight": 0.1, "relative_scale_loss": False, "distill_weight": 1.0,
        "distill_from": "gate_start", "distill_until": "end", "distill_schedule": "constant",
        "sink_attention_weight": 1.0, "taper_start": 0.05, "taper_end": 0.7, "recipe": "paper",
    }  # fmt: skip
    assert TaperNormConfig.from_recorded(recorded) == config == TaperNormConfig.from_recorded(config.options())
    folder = SimpleNamespace(path="run", manifest=lambda: {"identity": {"taper": recorded}})
    assert check_resume_identity(folder, {"taper": config.options()}, set()) == {}
    changed = {"taper": config.replace(distill_weight=0.5).options()}
    with pytest.raises(ConfigurationError, match=r"taper.distill_weight: 1.0 in the run, 0.5 now"):
        check_resume_identity(folder, changed, set())
    assert check_resume_identity(folder, changed, {"distill_weight"}) == {
        "taper.distill_weight": {"run": 1.0, "now": 0.5}
    }


# ============================================================================= a config file of the wrong types
@pytest.mark.parametrize(
    "values, expected",
    [
        ({"relative_scale_loss": "no"}, "relative_scale_loss must be true or false, got 'no'"),  # was True
        (
            {"sink_token_ids": [1.7]},
            "sink_token_ids must be a list of integer token ids, got [1.7]: write a list of ids such as [1, 2]",
        ),  # was cut to 1
        ({"sink_token_ids": "127"}, "sink_token_ids must be a list of integer token ids, got '127': write [127]"),
        ({"ema_rate": "0.5"}, "ema_rate must be a number, got '0.5'"),  # the next three were TypeErrors
        ({"calibration_scale": None}, "experimental.calibration_scale must be a number, got None"),  # version 2
        ({"scale_loss_weight": [1]}, "scale_loss_weight must be a number, got [1]"),
        ({"keep_norms": [1, 2]}, "keep_norms must be a list of fnmatch patterns (strings), got [1, 2]"),
        (
            {"recipe": 3},
            "recipe must be one of paper, paper+keep_qk_norms, gated-mlp, paper (final norm), "
            "paper+keep_qk_norms (final norm), gated-mlp (final norm), custom, got 3",
        ),
    ],
)
def test_a_tapernorm_config_of_the_wrong_types_is_refused(tmp_path, values, expected):
    (tmp_path / "tapernorm_config.json").write_text(json.dumps(values))
    with pytest.raises(ConfigurationError) as caught:
        TaperNormConfig.from_pretrained(tmp_path)
    assert str(caught.value) == f"TaperNormConfig.{expected}"


def test_an_unreadable_tapernorm_config_is_one_configuration_error(tmp_path):
    import numpy as np

    (tmp_path / "tapernorm_config.json").write_bytes(b"\xff\xfe not utf-8")
    with pytest.raises(ConfigurationError, match="is not valid JSON: 'utf-8' codec can't decode"):
        TaperNormConfig.from_pretrained(tmp_path)
    (tmp_path / "tapernorm_config.json").write_text("null")
    with pytest.raises(
        ConfigurationError, match="from_dict expects a mapping of field names to values, got a NoneType"
    ):
        TaperNormConfig.from_pretrained(tmp_path)
    assert TaperNormConfig(sink_token_ids=[np.int64(5), torch.tensor(6), "7"]).sink_token_ids == [5, 6, 7]
