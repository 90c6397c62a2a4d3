"""TaperNormConfig: one object for every choice, its groups and options, its presets, the CLI generated from it, and
the recipe of every family (its file, versions and migrations: test_config_files.py)."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import re
import typing

import pytest
import torch

from hf_tapernorm import (
    ConfigurationError,
    TaperController,
    TaperNormConfig,
    TaperStateError,
    fold_model,
    patch_model,
)
from hf_tapernorm.config import DistillationConfig, ExperimentalOptions
from hf_tapernorm.layers import gate_of
from hf_tapernorm.training.distillation import Distillation
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
        assert config.recipe == "gated-mlp" and config.distillation.weight == 1.0 and config.relative_scale_loss
        assert config.scope == "all" and config.distillation.sink_attention_weight == 3.0  # the final norm goes too
        kept_final = TaperNormConfig.for_model(model, scope="internal")  # the final norm kept: the term at weight 1
        assert kept_final.scope == "internal" and kept_final.distillation.sink_attention_weight == 1.0
        assert config.sink_token_ids == [model.config.bos_token_id]  # the config's BOS without a tokenizer
    else:
        assert config.recipe.startswith("paper") and config.distillation.weight == 0.0 and config.sink_token_ids == []
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
    assert (controller.distillation is not None) == (config.distillation.weight > 0)
    folded = fold_model(model)
    assert folded.fold_report.max_rel_diff <= 1e-4
    kept_final = set() if config.scope == "all" else {folded.config.final_norm}  # gated families fold it too
    assert set(folded.config.kept_norms) == set(config.keep_norms) | kept_final


def test_validation_names_the_field():
    for kwargs, message in (
        ({"scope": "inner"}, "TaperNormConfig.scope must be one of internal, final, all, got 'inner'"),
        ({"ema_rate": 0}, "TaperNormConfig.ema_rate must be in (0, 1], got 0"),
        ({"experimental": {"calibration_scale": 0}}, "TaperNormConfig.experimental.calibration_scale must be positive"),
        ({"scale_loss_weight": -1}, "TaperNormConfig.scale_loss_weight must be >= 0"),
        ({"experimental": {"linear_fit": "mean"}}, "TaperNormConfig.experimental.linear_fit must be one of paper, per"),
        ({"distillation": {"until": "never"}}, "TaperNormConfig.distillation.until must be one of end, taper_end"),
        ({"distillation": {"weigth": 1}}, "TaperNormConfig.distillation has no field 'weigth'; known: weight, until"),
        ({"distillation": 1.0}, "TaperNormConfig.distillation must be a DistillationConfig or a mapping of its fields"),
        ({"recipe": "mine"}, "TaperNormConfig.recipe must be one of paper, paper+keep_qk_norms, gated-mlp, paper ("),
        ({"taper_start": 0.5, "taper_end": 0.4}, "taper_end (0.4) must come after taper_start (0.5)"),
        ({"taper_end": 1.5}, "a float is a fraction of the run and must be in (0, 1]"),
        ({"keep_norms": [""]}, "keep_norms holds an empty pattern"),
    ):
        with pytest.raises(ConfigurationError, match=re.escape(message)):
            TaperNormConfig(**kwargs)
    with pytest.raises(ConfigurationError, match=r"TaperNormConfig.ema_rate must be in \(0, 1\], got 2"):
        TaperNormConfig.check_options(ema_rate=2)
    with pytest.raises(ConfigurationError, match=r"TaperNormConfig.distillation.weight must be >= 0, got -1.0"):
        TaperNormConfig.check_options(distill_weight=-1)
    with pytest.raises(ConfigurationError, match=r"TaperNormConfig has no option 'linear_fit'; options: scope, "):
        TaperNormConfig.check_options(linear_fit="paper")  # experimental: no option of the stable recipe
    assert TaperNormConfig.check_options(keep_norms="a.*", taper_end=3) == {"keep_norms": ["a.*"], "taper_end": 3}


@pytest.mark.parametrize(
    "value, write",
    [("12", "[12]"), ("127", "[127]"), ("", "[] (no sink)"), ("1,2", "[1, 2]"), ({"12"}, "[12]")],
)
def test_a_string_of_sink_ids_is_refused_not_read_character_by_character(value, write):
    """sink_token_ids="12" was iterated as characters and became [1, 2] ("127", as a hand-edited
    tapernorm_config.json may hold it, [1, 2, 7]; "" no sink), three valid ids and no error. A string, and an
    iterable other than a list that holds anything but integers, is now refused in one line that says what to
    write; lists, tuples, sets and tensors of ids are read as before."""
    expected = f"TaperNormConfig.sink_token_ids must be a list of integer token ids, got {value!r}: write {write}"
    for make in (
        lambda: TaperNormConfig.paper(sink_token_ids=value),
        lambda: TaperNormConfig(sink_token_ids=value),
        lambda: TaperNormConfig.from_dict({**TaperNormConfig.paper().to_dict(), "sink_token_ids": value}),
    ):
        with pytest.raises(ConfigurationError) as caught:
            make()
        assert str(caught.value) == expected
    for ids in ([12], (12,), {12}, torch.tensor([12]), 12, ["12"]):
        assert TaperNormConfig.paper(sink_token_ids=ids).sink_token_ids == [12]


def test_one_numpy_or_torch_integer_is_one_sink_id_as_an_int_is():
    """sink_token_ids=np.int64(5), np.array(5) or torch.tensor(5) was refused ("must be a list of integer token
    ids") while 5 was taken; a 0-d integer is now one id, stored as a Python int. A 0-d boolean or float is still
    refused."""
    import numpy as np

    for value in (np.int64(5), np.array(5), torch.tensor(5), np.uint8(5)):
        ids = TaperNormConfig.paper(sink_token_ids=value).sink_token_ids
        assert ids == [5] and type(ids[0]) is int
    for value in (np.bool_(True), torch.tensor(True), torch.tensor(5.0), np.float64(5)):
        with pytest.raises(ConfigurationError) as caught:
            TaperNormConfig.paper(sink_token_ids=value)
        assert str(caught.value) == (
            f"TaperNormConfig.sink_token_ids must be a list of integer token ids, got {value!r}: write a list of "
            "ids such as [1, 2]"
        )


def test_the_teacher_s_settings_are_one_group_and_the_options_name_them_by_their_flags():
    config = TaperNormConfig(distillation={"weight": 0.5, "until": "taper_end"})
    assert config.distillation == DistillationConfig(weight=0.5, until="taper_end", sink_attention_weight=0.0)
    assert config == TaperNormConfig.from_options({"distill_weight": 0.5, "distill_until": "taper_end"})
    assert config.replace(distill_weight=1.0).distillation.weight == 1.0 and config.distillation.weight == 0.5
    options = config.options()
    assert [name for name in options if "distill" in name] == ["distill_weight", "distill_until"]
    assert options["sink_attention_weight"] == 0.0 and options["experimental"] == {}
    assert TaperNormConfig.from_options(options) == config
    with pytest.raises(ConfigurationError, match=r"TaperNormConfig has no option 'distillation'; options: "):
        TaperNormConfig.paper(distillation={"weight": 1.0})  # the presets speak options
    with pytest.raises(AttributeError, match=r"TaperNormConfig has no field 'distill_weight'; fields: scope, "):
        config.distill_weight = 1.0  # the old flat field: an error, not an attribute nothing reads
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.distillation.weight = 1.0  # a group changes through replace (it may be shared by several configs)


def test_experimental_options_are_apart_and_change_nothing_by_default():
    assert TaperNormConfig().experimental == ExperimentalOptions()
    assert ExperimentalOptions().to_dict() == {} and TaperNormConfig().options()["experimental"] == {}
    config = TaperNormConfig.paper(experimental={"distill_schedule": "gate", "calibration_scale": 0.5})
    assert config.experimental == ExperimentalOptions(calibration_scale=0.5, distill_schedule="gate")
    assert config.to_dict()["experimental"] == {"calibration_scale": 0.5, "distill_schedule": "gate"}
    assert config.replace(experimental={}).experimental == ExperimentalOptions()
    assert not set(ExperimentalOptions.__dataclass_fields__) & set(TaperNormConfig.option_fields())
    # Distillation's defaults are the config's: one default wherever the teacher's settings are read.
    defaults = inspect.signature(Distillation).parameters
    assert defaults["distill_from"].default == ExperimentalOptions().distill_from == "gate_start"
    assert defaults["distill_schedule"].default == ExperimentalOptions().distill_schedule
    assert defaults["distill_until"].default == DistillationConfig().until
    assert defaults["sink_attention_weight"].default == DistillationConfig().sink_attention_weight


def test_the_recipe_is_one_of_the_presets_names():
    names = set(TaperNormConfig.choices("recipe"))
    model = build(tiny_llama_config())
    gpt2 = build(tiny_family_config("gpt2"))
    written = {TaperNormConfig.paper().recipe, TaperNormConfig().recipe}
    for preset in (lambda **o: TaperNormConfig.for_model(model, **o), lambda **o: TaperNormConfig.for_model(gpt2, **o)):
        written |= {preset().recipe, preset(scope="final").recipe}
    assert written <= names and {"gated-mlp", "paper", "custom", "gated-mlp (final norm)"} <= written


def test_choices_come_from_the_literal_types():
    assert TaperNormConfig.choices("scope") == ("internal", "final", "all")
    assert ExperimentalOptions.choices("distill_from") == ("gate_start", "original", "current")
    assert DistillationConfig.choices("until") == ("end", "taper_end")
    assert ExperimentalOptions.choices("linear_fit") == ("paper", "per_channel")
    assert TaperNormConfig.choices("ema_rate") is None
    for cls in (TaperNormConfig, DistillationConfig, ExperimentalOptions):
        for field in dataclasses.fields(cls):
            assert field.metadata["help"].strip(), f"{cls.__name__}.{field.name} has no help text"


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
def test_the_cli_declares_each_stable_option_once():
    """The taper command's recipe options are the config's stable options (generated from its fields, help and
    choices included; the distillation group's by their flags) plus the options it spells its own way; nothing
    else: no experimental option is a flag."""
    from hf_tapernorm.cli.arguments import SET_BY_OTHER_OPTIONS, TaperArguments, TaperRunOptions

    options = TaperNormConfig.option_fields()
    flags = {f.name: f for f in dataclasses.fields(TaperArguments)}
    run_options = {f.name for f in dataclasses.fields(TaperRunOptions)}
    assert run_options == {"preset", "recipe", "sink", "tied_head"}  # recipe: the old name of preset
    assert set(flags) == (set(options) - set(SET_BY_OTHER_OPTIONS)) | run_options
    assert set(SET_BY_OTHER_OPTIONS.values()) <= run_options  # recipe and sink_token_ids: --preset, --sink
    assert {"distill_weight", "distill_until", "sink_attention_weight"} <= set(flags)
    assert not {f.name for f in dataclasses.fields(ExperimentalOptions)} & set(flags)
    assert TaperArguments.FLAGS_OF_FIELDS["distillation.weight"] == "distill_weight"  # errors name the flag
    for name in set(options) - set(SET_BY_OTHER_OPTIONS):
        assert flags[name].default is None, name  # unset: the recipe's value
        assert flags[name].metadata["help"].startswith(options[name].field.metadata["help"]), name
        choices = options[name].owner.choices(options[name].field.name)
        if choices is not None:
            flag_type = typing.get_type_hints(TaperArguments)[name]  # HfArgumentParser rewrites Field.type
            assert typing.get_args(typing.get_args(flag_type)[0]) == choices, name


def test_taper_help_offers_no_experimental_option(capsys):
    """What the project measured and rejected is no product option: no flag for it, no [experimental] in --help."""
    from hf_tapernorm.cli.main import main

    with pytest.raises(SystemExit) as done:
        main(["taper", "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert "--distill_weight" in text and "--sink_attention_weight" in text and "--distill_until" in text
    assert "experimental" not in text.lower()
    for name in (f.name for f in dataclasses.fields(ExperimentalOptions)):
        assert f"--{name}" not in text, name


def test_cli_values_are_checked_by_the_config_and_named_by_their_flag():
    from hf_tapernorm._parsing import parse
    from hf_tapernorm.cli.arguments import TaperArguments

    def taper(*argv):
        return parse([TaperArguments], list(argv), "hf-tapernorm taper")[0]

    flags = taper(
        "--keep_norms", "a.*, b.*", "--taper_start", "3", "--taper_end", "0.5", "--distill_until", "taper_end"
    )
    assert (flags.keep_norms, flags.taper_start, flags.taper_end) == (["a.*", "b.*"], 3, 0.5)
    assert flags.distill_until == "taper_end"
    assert taper("--keep_norms", "none").keep_norms == [] and taper("--keep_norms", "auto").keep_norms is None
    for argv, message in (
        (["--ema_rate", "2"], "--ema_rate must be in (0, 1], got 2.0"),
        (["--distill_weight", "-1"], "--distill_weight must be >= 0, got -1.0"),
        (
            ["--sink_attention_weight", "nan"],
            "argument --sink_attention_weight/--sink-attention-weight: must be a finite",
        ),
        (["--taper_end", "1.5"], "--taper_end=1.5: a float is a fraction of the run and must be in (0, 1]"),
        (["--taper_start", "x"], "--taper_start must be an optimizer step (int) or a fraction of the run (float)"),
        (["--keep_norms", ","], "--keep_norms must be auto, none or a comma-separated list"),
        (["--distill_from", "original"], "unrecognized arguments: ['--distill_from', 'original']"),
        (["--calibration_scale", "0.5"], "unrecognized arguments: ['--calibration_scale', '0.5']"),
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
    argv = ["--preset", "paper", "--sink", "bos", "--sink_attention_weight", "0.3",
            "--distill_weight", "0.5", "--distill_until", "taper_end",
            "--scale_loss_weight", "0.2", "--relative_scale_loss", "true", "--ema_rate", "0.05",
            "--keep_norms", "model.layers.0.*", "--scope", "all",
            "--taper_start", "2", "--taper_end", "0.5"]  # fmt: skip
    (flags,) = parse([TaperArguments], argv, "hf-tapernorm taper")
    config = recipe_config(SimpleNamespace(taper=flags), model, tokenizer)
    assert config == TaperNormConfig.paper(
        sink_token_ids=[tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id],
        sink_attention_weight=0.3,
        distill_weight=0.5,
        distill_until="taper_end",
        scale_loss_weight=0.2,
        relative_scale_loss=True,
        ema_rate=0.05,
        keep_norms=["model.layers.0.*"],
        scope="all",
        taper_start=2,
        taper_end=0.5,
    )
    assert config.distillation == DistillationConfig(weight=0.5, until="taper_end", sink_attention_weight=0.3)
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


# ----------------------------------------------------------------------------- vocabulary, docs
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

    config = TaperNormConfig.paper(distill_weight=0.3, distill_until="taper_end",
                                   experimental={"distill_schedule": "gate"})  # fmt: skip
    term = Distillation.from_config(config)
    assert (term.weight, term.distill_from, term.distill_until, term.distill_schedule) == (
        0.3, "gate_start", "taper_end", "gate"
    )  # fmt: skip
    with pytest.raises(ConfigurationError, match=r"Distillation: distill_until must be one of end, taper_end, got 'x'"):
        Distillation(distill_until="x")
    with pytest.raises(ConfigurationError, match=r'distill_from="current"\) uses the model itself: pass no teacher'):
        Distillation(build(tiny_llama_config()), distill_from="current")
    with pytest.raises(ConfigurationError, match=r"needs a teacher unless distill_from is \"gate_start\""):
        Distillation(distill_from="original")
    assert Distillation().teacher is None  # the default teacher, the gate-start snapshot: taken when due


def _usage_table(header: str) -> dict[str, tuple[str, str]]:
    """A table of docs/usage.md under ``header``: name -> (default cell, meaning cell)."""
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "usage.md").read_text()
    start = text.index(header)
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


def test_the_usage_tables_match_the_options():
    """Every option has a row (no stale rows), with its default; so has every experimental option, in its own
    table."""
    import ast

    rows = _usage_table("| option | default | meaning |")
    defaults = TaperNormConfig().options()
    assert set(rows) == set(defaults), f"undocumented: {set(defaults) - set(rows)}; stale: {set(rows) - set(defaults)}"
    for name, (default, _) in rows.items():
        assert ast.literal_eval(default) == defaults[name], name
    rows = _usage_table("| experimental option | default | meaning |")
    research = {f.name: f.default for f in dataclasses.fields(ExperimentalOptions)}
    assert set(rows) == set(research)
    for name, (default, _) in rows.items():
        assert ast.literal_eval(default) == research[name], name
