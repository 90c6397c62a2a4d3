"""TaperNormConfig: one object for every choice, its presets, its round trips, and the recipe of every family."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import typing

import pytest
import torch

import hf_tapernorm
from hf_tapernorm import (
    ConfigurationError,
    TaperController,
    TaperNormConfig,
    TaperStateError,
    export_folded,
    fold_model,
    load_tapered,
    patch_model,
    save_tapered,
)
from hf_tapernorm.layers import gate_of, tapered_norms
from tests.conftest import (
    DISCOVERED_CASES,
    FAMILY_CASES,
    build,
    char_tokenizer,
    random_batches,
    tiny_family_config,
    tiny_llama_config,
)

# What the recipe keeps, per family: every layer's norms of these names stay real norms.
KEPT = {
    "llama": {"post_attention_layernorm"}, "mistral": {"post_attention_layernorm"},
    "qwen2": {"post_attention_layernorm"}, "gemma": {"post_attention_layernorm"}, "phi3": {"post_attention_layernorm"},
    "qwen3": {"post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"},
    "gemma2": {"pre_feedforward_layernorm"},
    "gemma3_text": {"pre_feedforward_layernorm", "self_attn.q_norm", "self_attn.k_norm"},
    "phi": set(), "phi-qk_layernorm": {"self_attn.q_layernorm", "self_attn.k_layernorm"},
    "gpt_neox": set(), "gpt_neox-sequential": set(), "opt": set(), "opt-project_out": set(), "falcon": set(),
    "falcon-sequential": set(), "falcon-two_norms": set(), "gpt2": set(),
    "olmo2": {"post_feedforward_layernorm", "self_attn.q_norm", "self_attn.k_norm"},  # no input norms: the output one
    "starcoder2": set(), "olmo": {"post_attention_layernorm"},
}  # fmt: skip
GATED = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2", "olmo"}


def test_every_family_has_a_recipe_case():
    assert set(KEPT) == set(FAMILY_CASES) | set(DISCOVERED_CASES)


@pytest.mark.parametrize("case", sorted(KEPT))
def test_for_model_derives_the_recipe_from_the_structure(case):
    model = build(tiny_family_config(case))
    config = TaperNormConfig.for_model(model)
    layers_kept: dict[str, set[int]] = {}
    for name in config.keep_norms:
        _, _, layer, norm = name.split(".", 3)
        layers_kept.setdefault(norm, set()).add(int(layer))
    family = tiny_family_config(case).model_type
    expected = {norm: {0, 1} for norm in KEPT[case]}  # every layer of the two
    if family in GATED and family != "olmo2":  # the attention input norm of the runaway band: layer 0 of 2
        expected["input_layernorm"] = {0}
    assert layers_kept == expected
    if family in GATED:
        assert config.recipe == "gated-mlp" and config.distill_weight == 1.0 and config.relative_scale_loss
        assert config.sink_attention_weight == 1.0
        assert config.sink_token_ids == [model.config.bos_token_id]  # the config's BOS without a tokenizer
    else:
        assert config.recipe.startswith("paper") and config.distill_weight == 0.0 and config.sink_token_ids == []
        assert config == TaperNormConfig.paper(keep_norms=config.keep_norms, recipe=config.recipe)


def test_the_sink_comes_from_the_tokenizer_and_is_absent_without_bos(caplog):
    model = build(tiny_llama_config(bos_token_id=None))
    assert TaperNormConfig.for_model(model, char_tokenizer()).sink_token_ids == [127]  # no BOS: its EOS
    with caplog.at_level(logging.WARNING, logger="hf_tapernorm"):
        assert TaperNormConfig.for_model(model).sink_token_ids == []
    assert "no BOS token id" in caplog.text and "keeps no attention sink normalized" in caplog.text
    overridden = TaperNormConfig.for_model(model, char_tokenizer(), sink_token_ids=[], scope="all")
    assert overridden.sink_token_ids == [] and overridden.scope == "all"


@pytest.mark.parametrize("case", sorted(KEPT))
def test_the_default_recipe_of_every_family_reaches_gate_zero_and_folds(case):
    torch.manual_seed(0)
    model = build(tiny_family_config(case)).train()
    config = TaperNormConfig.for_model(model, taper_start=2, taper_end=8)
    patch_model(model, config)
    controller = TaperController(model, total_steps=10)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sink = torch.tensor(config.sink_token_ids, dtype=torch.long)
    for step, ids in enumerate(random_batches(n=10, batch=2, length=15, seed=3)):
        ids = torch.cat([sink.expand(2, -1), ids], 1)
        controller.step_begin(step)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        controller.step_end(step)  # raises TaperDivergenceError if the watch fires
    assert gate_of(model) == 0.0
    assert (controller.distillation is not None) == (config.distill_weight > 0)
    folded = fold_model(model)
    assert folded.fold_report.max_rel_diff <= 1e-4
    assert set(folded.config.kept_norms) == set(config.keep_norms) | {folded.config.final_norm}


def test_validation_names_the_field():
    for kwargs, message in (
        ({"scope": "inner"}, "TaperNormConfig.scope must be one of internal, final, all, got 'inner'"),
        ({"ema_rate": 0}, "TaperNormConfig.ema_rate must be in (0, 1], got 0"),
        ({"calibration_scale": 0}, "TaperNormConfig.calibration_scale must be positive"),
        ({"scale_loss_weight": -1}, "TaperNormConfig.scale_loss_weight must be >= 0"),
        ({"linear_fit": "mean"}, "TaperNormConfig.linear_fit must be one of paper, per_channel"),
        ({"distill_until": "never"}, "TaperNormConfig.distill_until must be one of end, taper_end"),
        ({"taper_start": 0.5, "taper_end": 0.4}, "taper_end (0.4) must come after taper_start (0.5)"),
        ({"taper_end": 1.5}, "a float is a fraction of the run and must be in (0, 1]"),
        ({"keep_norms": [""]}, "keep_norms holds an empty pattern"),
    ):
        with pytest.raises(ConfigurationError, match=message.replace("(", r"\(").replace(")", r"\)")):
            TaperNormConfig(**kwargs)
    with pytest.raises(ConfigurationError, match=r"TaperNormConfig.ema_rate must be in \(0, 1\], got 2"):
        TaperNormConfig.check_values(ema_rate=2)
    assert TaperNormConfig.check_values(keep_norms="a.*", taper_end=3) == {"keep_norms": ["a.*"], "taper_end": 3}


def test_choices_come_from_the_literal_types():
    assert TaperNormConfig.choices("scope") == ("internal", "final", "all")
    assert TaperNormConfig.choices("distill_from") == ("gate_start", "original", "current")
    assert TaperNormConfig.choices("distill_until") == ("end", "taper_end")
    assert TaperNormConfig.choices("linear_fit") == ("paper", "per_channel")
    assert TaperNormConfig.choices("ema_rate") is None
    for field in dataclasses.fields(TaperNormConfig):
        assert field.metadata["help"].strip(), f"{field.name} has no help text"


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
        linear_fit="per_channel",
        distill_weight=0.5,
        distill_until="taper_end",
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
    assert written == {**config.to_dict(), "hf_tapernorm_version": hf_tapernorm.__version__, "config_version": 2}
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


def test_patch_model_takes_a_config_object_only():
    with pytest.raises(ConfigurationError, match="patch_model expects a TaperNormConfig, got str"):
        patch_model(build(tiny_llama_config()), "all")
    with pytest.raises(TypeError, match="unexpected keyword argument 'scope'"):
        patch_model(build(tiny_llama_config()), scope="all")


def test_resuming_under_another_config_is_refused(tmp_path):
    from transformers import Trainer, TrainingArguments

    from hf_tapernorm import TaperCallback

    ids = torch.randint(0, 128, (16, 12), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]

    def trainer(config, steps=6):
        args = TrainingArguments(
            output_dir=str(tmp_path),
            max_steps=steps,
            per_device_train_batch_size=2,
            save_steps=3,
            report_to=[],
            use_cpu=True,
            disable_tqdm=True,
            logging_steps=1,
        )
        model = patch_model(build(tiny_llama_config()), config)
        return Trainer(model=model, args=args, train_dataset=data, callbacks=[TaperCallback()])

    trainer(TaperNormConfig.paper(taper_start=1, taper_end=5)).train()
    assert (tmp_path / "checkpoint-3" / "tapernorm_config.json").is_file()
    with pytest.raises(
        TaperStateError, match=r"another TaperNormConfig \(ema_rate: 0\.01 in the checkpoint, 0\.1 now\)"
    ):
        trainer(TaperNormConfig.paper(taper_start=1, taper_end=5, ema_rate=0.1)).train(
            resume_from_checkpoint=str(tmp_path / "checkpoint-3")
        )


def test_a_warmup_stable_decay_schedule_decays_only_after_the_gate_reaches_zero(tmp_path):
    from transformers import Trainer, TrainingArguments

    from hf_tapernorm import TaperCallback

    ids = torch.randint(0, 128, (24, 12), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=12, per_device_train_batch_size=2, learning_rate=1e-3,
                             warmup_steps=2, lr_scheduler_type="warmup_stable_decay", save_strategy="no",
                             logging_steps=1, report_to=[], use_cpu=True, disable_tqdm=True)  # fmt: skip
    model = patch_model(build(tiny_llama_config()), TaperNormConfig.paper(taper_start=3, taper_end=8))
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[TaperCallback()])
    assert trainer.args.lr_scheduler_kwargs == {"num_decay_steps": 4}  # the steps after g = 0 (8 -> 12)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "taper/gate" in entry]
    rates = [entry["learning_rate"] for entry in logs]
    gates = [entry["taper/gate"] for entry in logs]
    assert rates[2:8] == [1e-3] * 6  # constant while the gate falls
    assert gates[7] == 0.0 and all(a > b for a, b in zip(rates[8:], rates[9:]))  # decaying only at g = 0


# ----------------------------------------------------------------------------- one declaration per field
def test_the_cli_declares_each_config_field_once():
    """The taper command's recipe options are the config's fields (generated from them, help and choices
    included) plus the options it spells its own way; nothing else."""
    from hf_tapernorm.cli.arguments import SET_BY_OTHER_OPTIONS, TaperArguments, TaperRunOptions

    config_fields = {f.name: f for f in dataclasses.fields(TaperNormConfig)}
    flags = {f.name: f for f in dataclasses.fields(TaperArguments)}
    run_options = {f.name for f in dataclasses.fields(TaperRunOptions)}
    assert run_options == {"preset", "recipe", "sink", "tied_head"}  # recipe: the old name of preset
    assert set(flags) == (set(config_fields) - set(SET_BY_OTHER_OPTIONS)) | run_options
    assert set(SET_BY_OTHER_OPTIONS.values()) <= run_options  # recipe and sink_token_ids: --preset, --sink
    for name in set(config_fields) - set(SET_BY_OTHER_OPTIONS):
        assert flags[name].default is None, name  # unset: the recipe's value
        assert flags[name].metadata["help"].startswith(config_fields[name].metadata["help"]), name
        choices = TaperNormConfig.choices(name)
        if choices is not None:
            flag_type = typing.get_type_hints(TaperArguments)[name]  # HfArgumentParser rewrites Field.type
            assert typing.get_args(typing.get_args(flag_type)[0]) == choices, name


@pytest.mark.parametrize("name", ["linear_fit", "calibration_scale", "distill_from", "distill_schedule"])
def test_research_options_are_marked_experimental(name):
    field = next(f for f in dataclasses.fields(TaperNormConfig) if f.name == name)
    assert "[experimental]" in field.metadata["help"]


def test_cli_values_are_checked_by_the_config_and_named_by_their_flag():
    from hf_tapernorm._parsing import parse
    from hf_tapernorm.cli.arguments import TaperArguments

    def taper(*argv):
        return parse([TaperArguments], list(argv), "hf-tapernorm taper")[0]

    flags = taper("--keep_norms", "a.*, b.*", "--taper_start", "3", "--taper_end", "0.5", "--distill_from", "original")
    assert (flags.keep_norms, flags.taper_start, flags.taper_end) == (["a.*", "b.*"], 3, 0.5)
    assert taper("--keep_norms", "none").keep_norms == [] and taper("--keep_norms", "auto").keep_norms is None
    for argv, message in (
        (["--ema_rate", "2"], "--ema_rate must be in (0, 1], got 2.0"),
        (["--distill_weight", "-1"], "--distill_weight must be >= 0, got -1.0"),
        (["--calibration_scale", "0"], "--calibration_scale must be positive, got 0.0"),
        (["--taper_end", "1.5"], "--taper_end=1.5: a float is a fraction of the run and must be in (0, 1]"),
        (["--taper_start", "x"], "--taper_start must be an optimizer step (int) or a fraction of the run (float)"),
        (["--keep_norms", ","], "--keep_norms must be auto, none or a comma-separated list"),
    ):
        with pytest.raises(ConfigurationError) as error:
            taper(*argv)
        assert str(error.value).startswith(message), str(error.value)
        assert "TaperNormConfig." not in str(error.value)


def test_recipe_config_takes_every_set_field(tmp_path):
    from types import SimpleNamespace

    from hf_tapernorm._parsing import parse
    from hf_tapernorm.app.validation import recipe_config
    from hf_tapernorm.cli.arguments import TaperArguments

    model, tokenizer = build(tiny_llama_config()), char_tokenizer()
    argv = ["--preset", "paper", "--sink", "bos", "--linear_fit", "per_channel", "--calibration_scale", "0.9",
            "--distill_weight", "0.5", "--distill_from", "original", "--distill_until", "taper_end",
            "--scale_loss_weight", "0.2", "--relative_scale_loss", "true", "--ema_rate", "0.05",
            "--keep_norms", "model.layers.0.*", "--scope", "all",
            "--taper_start", "2", "--taper_end", "0.5"]  # fmt: skip
    (flags,) = parse([TaperArguments], argv, "hf-tapernorm taper")
    config = recipe_config(SimpleNamespace(taper=flags), model, tokenizer)
    assert config == TaperNormConfig.paper(
        sink_token_ids=[tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id],
        linear_fit="per_channel",
        calibration_scale=0.9,
        distill_weight=0.5,
        distill_from="original",
        distill_until="taper_end",
        scale_loss_weight=0.2,
        relative_scale_loss=True,
        ema_rate=0.05,
        keep_norms=["model.layers.0.*"],
        scope="all",
        taper_start=2,
        taper_end=0.5,
    )
    (unset,) = parse([TaperArguments], [], "hf-tapernorm taper")
    assert recipe_config(SimpleNamespace(taper=unset), model, tokenizer) == TaperNormConfig.for_model(model, tokenizer)


def test_below_the_cli_errors_name_fields_and_the_cli_writes_flags():
    from hf_tapernorm._parsing import as_flags
    from hf_tapernorm.app.validation import check_schedule
    from hf_tapernorm.cli.arguments import TaperArguments, TaperTrainingArguments

    with pytest.raises(ConfigurationError) as error:
        check_schedule(TaperNormConfig.paper(taper_start=2, taper_end=20), 10)
    assert str(error.value).startswith(
        "TaperNormConfig.taper_end 20 is step 20, after the last step 10 (TrainingArguments.max_steps)"
    )
    translated = as_flags(error.value, [TaperArguments, TaperTrainingArguments])
    assert type(translated) is ConfigurationError
    assert str(translated).startswith("--taper_end 20 is step 20, after the last step 10 (--max_steps)")
    assert str(translated).endswith("lower --taper_end or raise --max_steps")
    # Only the options of the command are translated: a field the command has no flag for keeps its name.
    assert str(as_flags(error.value, [TaperTrainingArguments])).startswith("TaperNormConfig.taper_end 20")
    untouched = ConfigurationError("nothing to translate")
    assert as_flags(untouched, [TaperArguments]) is untouched


# ----------------------------------------------------------------------------- versions, vocabulary, docs
def test_an_old_config_file_loads_migrated_and_says_so(tmp_path, caplog):
    """A version-1 tapernorm_config.json (no config_version; before distill_until and distill_schedule)."""
    from hf_tapernorm.config import CONFIG_NAME, CONFIG_VERSION, CONFIG_VERSION_KEY

    current = TaperNormConfig.paper(distill_weight=0.5, distill_from="gate_start").to_dict()
    old = {k: v for k, v in current.items() if k not in ("distill_until", "distill_schedule")}
    (tmp_path / CONFIG_NAME).write_text(json.dumps({**old, "hf_tapernorm_version": "0.1.0"}))
    with caplog.at_level(logging.WARNING, logger="hf_tapernorm.config"):
        config = TaperNormConfig.from_pretrained(tmp_path)
    assert config.distill_until == "end" and config.distill_schedule == "constant" and config.distill_weight == 0.5
    assert (
        "migrated a config_version 1 config to 2: distill_schedule='constant', distill_until='end' "
        "(what version 1 meant); save it again to keep it" in caplog.text
    )
    saved = json.loads(config.save_pretrained(tmp_path / "again").read_text())
    assert saved[CONFIG_VERSION_KEY] == CONFIG_VERSION == 2
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_tapernorm.config"):
        assert TaperNormConfig.from_pretrained(tmp_path / "again") == config
    assert "migrated" not in caplog.text  # a current file is read as written
    with pytest.raises(ConfigurationError, match=r"config_version must be a positive integer, got 'two'"):
        TaperNormConfig.from_dict({**current, CONFIG_VERSION_KEY: "two"})
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_tapernorm.config"):
        TaperNormConfig.from_dict({**current, CONFIG_VERSION_KEY: 3})
    assert "written with config_version 3, newer than this version's 2" in caplog.text


def test_the_old_recipe_flag_still_chooses_the_preset_and_warns(caplog):
    from hf_tapernorm._parsing import parse
    from hf_tapernorm.cli.arguments import TaperArguments

    with caplog.at_level(logging.WARNING, logger="hf_tapernorm.cli.arguments"):
        (flags,) = parse([TaperArguments], ["--recipe", "paper"], "hf-tapernorm taper")
    assert flags.preset == "paper" and flags.recipe is None
    assert "--recipe is deprecated and will be removed: use --preset paper" in caplog.text
    with pytest.raises(ConfigurationError, match=r"--recipe auto and --preset paper: pass --preset alone"):
        parse([TaperArguments], ["--recipe", "auto", "--preset", "paper"], "hf-tapernorm taper")


def test_patch_model_without_a_config_says_which_recipe_it_derived(caplog):
    with caplog.at_level(logging.INFO, logger="hf_tapernorm.layers.patching"):
        model = patch_model(build(tiny_llama_config()))
    assert model.tapernorm_config.recipe == "gated-mlp"
    assert "no config given, so the recipe derived for LlamaForCausalLM (TaperNormConfig.for_model: gated-mlp)" in (
        caplog.text
    )
    assert TaperNormConfig() == TaperNormConfig.paper(recipe="custom")  # a bare config: the paper's values


def test_distillation_speaks_the_config_s_vocabulary():
    from hf_tapernorm.training import Distillation

    config = TaperNormConfig.paper(distill_weight=0.3, distill_from="gate_start", distill_until="taper_end",
                                   distill_schedule="gate")  # fmt: skip
    term = Distillation.from_config(config)
    assert (term.weight, term.distill_from, term.distill_until, term.distill_schedule) == (
        0.3, "gate_start", "taper_end", "gate"
    )  # fmt: skip
    with pytest.raises(ConfigurationError, match=r"Distillation: distill_until must be one of end, taper_end, got 'x'"):
        Distillation(distill_from="gate_start", distill_until="x")
    with pytest.raises(ConfigurationError, match=r'distill_from="current"\) uses the model itself: pass no teacher'):
        Distillation(build(tiny_llama_config()), distill_from="current")
    with pytest.raises(ConfigurationError, match=r"needs a teacher unless distill_from is \"gate_start\""):
        Distillation()


def _field_table() -> dict[str, tuple[str, str]]:
    """docs/usage.md's TaperNormConfig table: field name -> (default cell, meaning cell)."""
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "usage.md").read_text()
    start = text.index("| field | default | meaning |")
    rows = {}
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        names, defaults, meaning = (cell.strip() for cell in line.strip("|").split(" | ", 2))
        names = [n.strip().strip("`") for n in names.split(",")]
        defaults = [d.strip().strip("`") for d in defaults.split(",")] if len(names) > 1 else [defaults.strip("`")]
        assert len(names) == len(defaults), line
        for name, default in zip(names, defaults):
            rows[name] = (default, meaning)
    return rows


def test_the_usage_field_table_matches_the_fields():
    """Every field has a row (no stale rows), with its default, and experimental fields say so."""
    import ast

    rows = _field_table()
    fields = {f.name: f for f in dataclasses.fields(TaperNormConfig)}
    assert set(rows) == set(fields), f"undocumented: {set(fields) - set(rows)}; stale: {set(rows) - set(fields)}"
    defaults = TaperNormConfig()
    for name, (default, meaning) in rows.items():
        assert ast.literal_eval(default) == getattr(defaults, name), name
        if "[experimental]" in fields[name].metadata["help"]:
            assert "experimental" in meaning, f"{name}: its help says [experimental], its row does not"
