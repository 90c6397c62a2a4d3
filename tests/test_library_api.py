"""The public library API at its edges: each misuse (a wrong type, an already folded model, a wrapper, a probe out of
range, a schedule run backwards) is one clear error of the right type, and odd but valid input gives the right result.

Tiny models only (hidden 32, 2 layers).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy
import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_tapernorm import (
    CalibrationError,
    ConfigurationError,
    TaperCallback,
    TaperController,
    TaperDivergenceError,
    TaperNormConfig,
    TaperStateError,
    UnsupportedModelError,
    export_folded,
    fold_model,
    load_tapered,
    patch_model,
    save_sharded_checkpoint,
    save_tapered,
)
from hf_tapernorm.config import config_of
from hf_tapernorm.layers import set_gate, tapered_norms
from hf_tapernorm.training import TaperSchedule
from tests.conftest import build, char_tokenizer, random_batches, save_tiny_model, tiny_llama_config
from tests.helpers import IDS, logits, relative_error, snapshot, tapered, tapered_checkpoint


# ============================================================================= misuse: one clear error
def _llama(**overrides):
    return build(tiny_llama_config(**overrides))


def _paper(**overrides):
    return patch_model(_llama(), TaperNormConfig.paper(**overrides))


def _loaded_export(kind: str, tmp: Path):
    folder = export_folded(fold_model(tapered(kind)), tmp / f"{kind}_export")
    return AutoModelForCausalLM.from_pretrained(folder)


def _export_over_a_model(tmp: Path):
    save_tiny_model(tmp / "my_model")
    return export_folded(fold_model(tapered("llama")), tmp / "my_model", overwrite=True)


def _export_under_a_file(tmp: Path):
    (tmp / "afile").write_text("x")
    return export_folded(fold_model(tapered("llama")), tmp / "afile" / "sub")


def _controller_loop(train: bool):
    model = _paper(taper_start=2, taper_end=4).train(train)
    controller = TaperController(model, total_steps=6)
    for step in range(6):
        controller.step_begin(step)
        ids = random_batches(n=1, seed=step)[0]
        model(input_ids=ids, labels=ids).loss.backward()
        controller.step_end(step)


def _afile(tmp: Path) -> Path:
    (tmp / "afile").write_text("x")
    return tmp / "afile"


def _trainer_with_reversed_window(tmp: Path):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp / "t"), max_steps=6, use_cpu=True, report_to=[], save_strategy="no")
    Trainer(model=_paper(), args=args, callbacks=[TaperCallback(taper_start=0.8, taper_end=0.2)])


#: name -> (call (tmp_path), error type, fragment of its message)
LIBRARY_REFUSALS = {
    "fold_model(tolerance=True)": (
        lambda tmp: fold_model(tapered("llama"), tolerance=True),
        ConfigurationError,
        "tolerance must be a positive finite number, got True",
    ),
    "fold_model(tolerance='1e-3')": (
        lambda tmp: fold_model(tapered("llama"), tolerance="1e-3"),
        ConfigurationError,
        "got '1e-3'",
    ),
    "fold_model of a loaded llama export": (
        lambda tmp: fold_model(_loaded_export("llama", tmp)),
        TaperStateError,
        "is already folded (a norm-free export)",
    ),
    "fold_model of a loaded gpt2 export": (
        lambda tmp: fold_model(_loaded_export("gpt2", tmp)),
        TaperStateError,
        "is already folded",
    ),
    "patch_model of a loaded export": (
        lambda tmp: patch_model(_loaded_export("llama", tmp), TaperNormConfig.paper()),
        TaperStateError,
        "is a folded export (tapernorm_llama): its norms are folded away already",
    ),
    "fold_model of torch.compile's wrapper": (
        lambda tmp: fold_model(torch.compile(tapered("llama"))),
        UnsupportedModelError,
        "fold_model(model._orig_mod)",
    ),
    "fold_model of the base LlamaModel": (
        lambda tmp: fold_model(tapered("llama").model),
        UnsupportedModelError,
        "expects a LlamaForCausalLM, got LlamaModel",
    ),
    "fold_model probe beyond the vocabulary": (
        lambda tmp: fold_model(tapered("llama"), probe=torch.randint(200, 300, (1, 5))),
        ConfigurationError,
        "probe must be a (batch, tokens) tensor of token ids in [0, 128)",
    ),
    "fold_model float probe": (
        lambda tmp: fold_model(tapered("llama"), probe=torch.rand(1, 5)),
        ConfigurationError,
        "torch.float32",
    ),
    "fold_model 1-D probe": (
        lambda tmp: fold_model(tapered("llama"), probe=torch.arange(5)),
        ConfigurationError,
        "got (5,)",
    ),
    "export_folded under a file": (_export_under_a_file, ConfigurationError, "afile is a file"),
    "export_folded overwrite=True onto an original model": (
        _export_over_a_model,
        ConfigurationError,
        "refusing overwrite=True",
    ),
    "export_folded facts as a list": (
        lambda tmp: export_folded(fold_model(tapered("llama")), tmp / "e", facts=["x"]),
        ConfigurationError,
        "facts= must be a mapping",
    ),
    "scale_loss_weight inf": (
        lambda tmp: TaperNormConfig(scale_loss_weight=float("inf")),
        ConfigurationError,
        "scale_loss_weight must be a finite number",
    ),
    "distill_weight inf": (
        lambda tmp: TaperNormConfig.paper(distill_weight=float("inf")),
        ConfigurationError,
        "TaperNormConfig.distillation.weight must be a finite number",
    ),
    "calibration_scale inf": (
        lambda tmp: TaperNormConfig(experimental={"calibration_scale": float("inf")}),
        ConfigurationError,
        "TaperNormConfig.experimental.calibration_scale must be a finite number",
    ),
    "distill_weight nan": (
        lambda tmp: TaperNormConfig(distillation={"weight": float("nan")}),
        ConfigurationError,
        "TaperNormConfig.distillation.weight must be >= 0",
    ),
    "sink id -1": (lambda tmp: TaperNormConfig(sink_token_ids=[-1]), ConfigurationError, "must be non-negative"),
    "for_model with a tokenizer name": (
        lambda tmp: TaperNormConfig.for_model(_llama(), tokenizer="gpt2"),
        ConfigurationError,
        "got the name 'gpt2': pass AutoTokenizer.from_pretrained(name)",
    ),
    "patch_model with a tokenizer name": (
        lambda tmp: patch_model(_llama(), tokenizer="gpt2"),
        ConfigurationError,
        "tokenizer= must be a tokenizer",
    ),
    "TaperController total_steps 0": (
        lambda tmp: TaperController(_paper(), total_steps=0),
        ConfigurationError,
        "total_steps must be a positive int, got 0",
    ),
    "TaperController total_steps 2.5": (
        lambda tmp: TaperController(_paper(), total_steps=2.5),
        ConfigurationError,
        "got 2.5",
    ),
    "TaperController total_steps True": (
        lambda tmp: TaperController(_paper(), total_steps=True),
        ConfigurationError,
        "got True",
    ),
    "TaperController total_steps '10'": (
        lambda tmp: TaperController(_paper(), total_steps="10"),
        ConfigurationError,
        "got '10'",
    ),
    "TaperController loop with the model in eval mode": (
        lambda tmp: _controller_loop(train=False),
        CalibrationError,
        "run training-mode forwards (model.train())",
    ),
    "TaperController jumping past k_start untrained": (
        lambda tmp: TaperController(_paper(taper_start=2, taper_end=4), total_steps=6).step_begin(4),
        CalibrationError,
        "has no calibration statistics",
    ),
    "TaperCallback with taper_start after taper_end": (
        _trainer_with_reversed_window,
        ConfigurationError,
        "k_end must be greater than k_start",
    ),
    "patch_model of DataParallel": (
        lambda tmp: patch_model(torch.nn.DataParallel(_llama()), TaperNormConfig.paper()),
        UnsupportedModelError,
        "DataParallel has no config.model_type",
    ),
    "set_gate nan": (lambda tmp: set_gate(tapered("llama"), float("nan")), ConfigurationError, "got nan"),
    "TaperNormConfig.save_pretrained onto a file": (
        lambda tmp: TaperNormConfig.paper().save_pretrained(_afile(tmp)),
        ConfigurationError,
        "TaperNormConfig.save_pretrained: cannot save tapernorm_config.json into {tmp}/afile: it is a file",
    ),
    "TaperNormConfig.save_pretrained under a file": (
        lambda tmp: TaperNormConfig.paper().save_pretrained(_afile(tmp) / "sub"),
        ConfigurationError,
        "cannot save tapernorm_config.json into {tmp}/afile/sub: {tmp}/afile is a file",
    ),
    "TaperController.save_state onto a file": (
        lambda tmp: TaperController(_paper(), total_steps=20).save_state(_afile(tmp)),
        ConfigurationError,
        "TaperController.save_state: cannot save the taper state into {tmp}/afile: it is a file",
    ),
    "TaperController.save_state under a file": (
        lambda tmp: TaperController(_paper(), total_steps=20).save_state(_afile(tmp) / "sub"),
        ConfigurationError,
        "cannot save the taper state into {tmp}/afile/sub: {tmp}/afile is a file",
    ),
    "save_sharded_checkpoint onto a file": (
        lambda tmp: save_sharded_checkpoint(_afile(tmp), tapered("llama")),
        ConfigurationError,
        "save_sharded_checkpoint: cannot save a sharded checkpoint into {tmp}/afile: it is a file",
    ),
    "load_tapered of a folded export": (
        lambda tmp: load_tapered(export_folded(fold_model(tapered("llama")), tmp / "e")),
        ConfigurationError,
        "is not a tapered checkpoint",
    ),
}


@pytest.mark.parametrize("name", list(LIBRARY_REFUSALS))
def test_a_library_misuse_is_refused_with_one_clear_error(tmp_path, name):
    call, error_type, fragment = LIBRARY_REFUSALS[name]
    with pytest.raises(error_type) as caught:
        call(tmp_path)
    assert fragment.format(tmp=tmp_path) in str(caught.value)


def test_export_folded_overwrite_true_onto_a_model_leaves_it_as_it_was(tmp_path):
    with pytest.raises(ConfigurationError):
        _export_over_a_model(tmp_path)
    assert json.loads((tmp_path / "my_model" / "config.json").read_text())["model_type"] == "llama"
    assert not (tmp_path / "my_model" / ".hf_tapernorm_export.json").exists()
    export = export_folded(fold_model(tapered("llama")), tmp_path / "export")
    export_folded(fold_model(tapered("llama")), export, overwrite=True)  # an earlier export is still replaced


@pytest.mark.parametrize("tolerance", [-1.0, float("nan"), float("inf"), "1e-4"])
def test_fold_model_refuses_a_tolerance_that_is_no_positive_number(tmp_path, tolerance):
    """-1 and NaN were reported as a failed fold check ("pass a larger tolerance"); inf passed any fold."""
    from hf_tapernorm import fold_model

    model = load_tapered(tapered_checkpoint(tmp_path / "saved"))
    with pytest.raises(ConfigurationError, match=r"^fold_model: tolerance must be a positive finite number, got "):
        fold_model(model, tolerance=tolerance)


def test_save_tapered_into_a_file_path_is_refused_in_one_line(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigurationError, match="is a file"):
        save_tapered(tapered("llama"), tmp_path / "afile")


def test_save_tapered_refuses_a_folder_holding_another_model(tmp_path):
    folder = save_tiny_model(tmp_path / "my_model")
    before = snapshot(folder)
    with pytest.raises(ConfigurationError, match="holds another model"):
        save_tapered(tapered("llama"), folder)
    assert snapshot(folder) == before


@pytest.mark.parametrize("tokenizer", ["gpt2", Path("gpt2"), 3])
def test_save_tapered_refuses_a_tokenizer_it_cannot_save_before_anything_is_written(tmp_path, tokenizer):
    """save_tapered(model, folder, tokenizer="gpt2") wrote config.json, model.safetensors and tapernorm_config.json,
    then failed with AttributeError ('str' object has no attribute 'save_pretrained'), leaving a checkpoint without
    its tokenizer. Refused first now, in one line, by export_folded's check."""
    with pytest.raises(ConfigurationError) as caught:
        save_tapered(tapered("llama"), tmp_path / "saved", tokenizer)
    got = (
        "an object of type int: pass the model's tokenizer (AutoTokenizer.from_pretrained(name))"
        if tokenizer == 3
        else "the name 'gpt2': pass AutoTokenizer.from_pretrained(name)"
    )
    assert str(caught.value) == f"save_tapered: tokenizer= must be a transformers tokenizer or processor, got {got}"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "who,given", [("save_tapered", "model"), ("save_tapered", "config"), ("save_sharded_checkpoint", "model")]
)
def test_a_save_refuses_a_model_or_a_config_as_its_tokenizer_before_anything_is_written(tmp_path, who, given):
    """save_tapered(model, folder, plain_model) took the plain model as the tokenizer (it has save_pretrained): its
    config.json and model.safetensors overwrote the tapered checkpoint's, and load_tapered then failed ("missing
    ...taper_weight"); save_sharded_checkpoint(..., tokenizer=) wrote one beside the shards. Only a transformers
    tokenizer or processor is taken now; anything else is refused first."""
    plain = build(tiny_llama_config())
    tokenizer = plain if given == "model" else plain.config
    with pytest.raises(ConfigurationError) as caught:
        if who == "save_tapered":
            save_tapered(tapered("llama"), tmp_path / "saved", tokenizer)
        else:
            save_sharded_checkpoint(tmp_path / "saved", tapered("llama"), tokenizer=tokenizer)
    got = (
        "the model LlamaForCausalLM, whose save_pretrained would write its own config.json and weights over the ones "
        "saved"
        if given == "model"
        else "the config LlamaConfig, whose save_pretrained would write over config.json"
    )
    assert str(caught.value) == (
        f"{who}: tokenizer= must be a transformers tokenizer or processor, got {got}: pass the model's "
        "tokenizer (AutoTokenizer.from_pretrained(name))"
    )
    assert list(tmp_path.iterdir()) == []


def test_save_tapered_of_a_patched_base_model_is_refused_before_anything_is_written(tmp_path):
    """save_tapered of a patched LlamaModel (no LM head) wrote a checkpoint that load_tapered, fold and eval all
    refused with a misleading "missing ['model.embed_tokens.weight', ...]" (its weights were there, unprefixed). It
    is now refused in one line that says what to patch, and neither the folder nor its parent gets a file."""
    from transformers import LlamaModel

    base = patch_model(LlamaModel(tiny_llama_config()), TaperNormConfig.paper())
    with pytest.raises(UnsupportedModelError) as caught:
        save_tapered(base, tmp_path / "saved", char_tokenizer())
    assert str(caught.value) == (
        "save_tapered: LlamaModel has no LM head, and a tapered checkpoint is of a causal LM (what load_tapered, fold "
        "and eval read); patch the model AutoModelForCausalLM loads"
    )
    assert list(tmp_path.iterdir()) == []


def _each_refused_leaving_it_as_it_was(saves: dict, folder: Path, message: str, *, whole: bool = False) -> None:
    """Each of ``saves`` (the start of its refusal -> the save) into ``folder`` refused, its message going on with
    ``message`` after "into FOLDER: " (``whole``: the message entire), and the folder byte for byte as it was."""
    before = snapshot(folder)
    for what, save in saves.items():
        with pytest.raises(ConfigurationError) as caught:
            save(folder)
        expected = f"{what} into {folder}: {message}"
        assert str(caught.value) == expected if whole else str(caught.value).startswith(expected)
        assert snapshot(folder) == before


def test_the_taper_state_is_never_saved_into_an_ordinary_models_folder(tmp_path):
    """TaperController.save_state (and TaperNormConfig.save_pretrained, save_sharded_checkpoint) into an original
    model's folder wrote tapernorm_config.json beside it: eval then called the folder a tapered checkpoint that "does
    not match", taper "already a tapered model", until the file was found and deleted. Where a tapered model is
    saved (a patched model's save, as the Trainer's checkpoint-N; save_tapered's folder) the state still goes."""
    folder = save_tiny_model(tmp_path / "llama")
    model = tapered("llama")
    saves = {
        "TaperController.save_state: cannot save the taper state": TaperController(model, total_steps=20).save_state,
        "TaperNormConfig.save_pretrained: cannot save tapernorm_config.json": config_of(model).save_pretrained,
        "save_sharded_checkpoint: cannot save a sharded checkpoint": lambda f: save_sharded_checkpoint(f, model),
    }
    _each_refused_leaving_it_as_it_was(
        saves,
        folder,
        "it holds a model that is not a tapered checkpoint (config.json of type 'llama' and its weights), which "
        "tapernorm_config.json would mark as one",
    )
    model.save_pretrained(tmp_path / "checkpoint-2")  # what the Trainer writes before TaperCallback.on_save
    for where in (tmp_path / "checkpoint-2", save_tapered(model, tmp_path / "saved")):
        TaperController(model, total_steps=20).save_state(where)
        assert TaperNormConfig.from_pretrained(where) == config_of(model)


def _recipe_saves(other) -> dict:
    """The saves that keep a folder's weights, by the start of their refusal."""
    return {
        "TaperController.save_state: cannot save the taper state": TaperController(other, total_steps=20).save_state,
        "TaperNormConfig.save_pretrained: cannot save tapernorm_config.json": config_of(other).save_pretrained,
    }


def test_the_taper_state_never_replaces_another_recipe_beside_its_weights(tmp_path):
    """TaperController.save_state and TaperNormConfig.save_pretrained into another run's tapered checkpoint replaced
    its tapernorm_config.json (keep_norms and sink gone): load_tapered then asked to "restore the file the run
    wrote", which was gone. A config of another recipe beside the weights is now kept, naming what differs; saves
    of the same recipe, and saves of a whole checkpoint (weights and recipe together: a patched model's
    save_pretrained, save_tapered, save_sharded_checkpoint over a checkpoint of its own format), still write."""
    model = tapered("llama", sink_token_ids=[5], keep_norms=["model.norm"])
    other = tapered("llama")
    checkpoint = save_tapered(model, tmp_path / "checkpoint-6")
    before = snapshot(checkpoint)
    _each_refused_leaving_it_as_it_was(
        _recipe_saves(other),
        checkpoint,
        f"{checkpoint / 'tapernorm_config.json'} records another recipe (keep_norms: ['model.norm'] there, [] here; "
        "sink_token_ids: [5] there, [] here), the one its weights were trained with, which the save would replace; "
        "save into this recipe's checkpoint or a new folder",
        whole=True,
    )
    TaperController(model, total_steps=20).save_state(checkpoint)  # the same recipe
    assert snapshot(checkpoint) == before
    other.save_pretrained(checkpoint)  # a whole checkpoint: its weights and its recipe together
    assert TaperNormConfig.from_pretrained(checkpoint) == config_of(other)
    assert save_tapered(model, checkpoint) and TaperNormConfig.from_pretrained(checkpoint) == config_of(model)
    sharded = save_sharded_checkpoint(tmp_path / "sharded", model)
    assert save_sharded_checkpoint(sharded, other) and TaperNormConfig.from_pretrained(sharded) == config_of(other)


def test_an_older_versions_checkpoint_keeps_its_recipe_too(tmp_path):
    """The recipe guard read only folder/tapernorm_config.json. A checkpoint of an older version (its recipe in the
    legacy tapernorm.json, or an old run's checkpoint-N with the recipe at the run folder) took another recipe's
    file, which load_tapered then read in its place without a word. The guard reads the file loading reads."""
    model = tapered("llama", keep_norms=["model.norm"])
    other = tapered("llama")
    legacy = save_tapered(model, tmp_path / "legacy")
    (legacy / "tapernorm_config.json").rename(legacy / "tapernorm.json")
    old_run = tmp_path / "old_run"
    old_layout = save_tapered(model, old_run / "checkpoint-4")
    (old_layout / "tapernorm_config.json").rename(old_run / "tapernorm_config.json")
    for folder, recorded in ((legacy, legacy / "tapernorm.json"), (old_layout, old_run / "tapernorm_config.json")):
        message = f"{recorded} records another recipe (keep_norms: ['model.norm'] there, [] here)"
        _each_refused_leaving_it_as_it_was(_recipe_saves(other), folder, message)
        assert load_tapered(folder).tapernorm_config == config_of(model)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_trainer_checkpoint_whose_weights_are_in_its_engines_folder_keeps_its_recipe(tmp_path):
    """The recipe guard looked for weights at the folder's top level only. A Trainer checkpoint of an FSDP run
    (sharded state dict: pytorch_model_fsdp_0/*.distcp) or of a DeepSpeed run (global_step6/*model_states.pt)
    "held no weights", so another recipe's file replaced the one its weights were trained with. Those engine
    folders count as weights too; the same recipe still writes."""
    import torch.distributed.checkpoint as dcp

    model = tapered("llama", keep_norms=[])
    other = tapered("llama", keep_norms=["model.norm"])
    fsdp, deepspeed = tmp_path / "fsdp" / "checkpoint-4", tmp_path / "deepspeed" / "checkpoint-6"
    dcp.save({"model": model.state_dict()}, checkpoint_id=fsdp / "pytorch_model_fsdp_0")  # as accelerate saves it
    (deepspeed / "global_step6").mkdir(parents=True)
    torch.save({"module": model.state_dict()}, deepspeed / "global_step6" / "mp_rank_00_model_states.pt")
    for checkpoint in (fsdp, deepspeed):
        config_of(model).save_pretrained(checkpoint)
        _each_refused_leaving_it_as_it_was(
            _recipe_saves(other),
            checkpoint,
            f"{checkpoint / 'tapernorm_config.json'} records another recipe (keep_norms: [] there, ['model.norm'] "
            "here), the one its weights were trained with",
        )
        TaperController(model, total_steps=20).save_state(checkpoint)  # the same recipe
        assert TaperNormConfig.from_pretrained(checkpoint) == config_of(model)


def test_a_recipe_without_weights_beside_it_is_written_over(tmp_path):
    """A folder of a config alone (saved again after an edit), of a damaged config, or of a taper state alone was
    refused as "the one its weights were trained with": there are no weights to keep a recipe for, so the save
    writes over the file, as PretrainedConfig.save_pretrained does."""
    first, edited = TaperNormConfig(keep_norms=["model.norm"]), TaperNormConfig(keep_norms=[])
    first.save_pretrained(tmp_path / "recipe")
    assert edited.save_pretrained(tmp_path / "recipe").read_text() == edited.to_json_string()
    (tmp_path / "recipe" / "tapernorm_config.json").write_text("{")
    assert first.save_pretrained(tmp_path / "recipe").read_text() == first.to_json_string()
    TaperController(tapered("llama", keep_norms=["model.norm"]), total_steps=20).save_state(tmp_path / "state")
    other = tapered("llama")
    TaperController(other, total_steps=20).save_state(tmp_path / "state")
    assert TaperNormConfig.from_pretrained(tmp_path / "state") == config_of(other)
    damaged = save_tapered(tapered("llama", keep_norms=["model.norm"]), tmp_path / "damaged")
    (damaged / "tapernorm_config.json").write_text("[1, 2]")  # no recipe to keep: a save may repair it
    config_of(other).save_pretrained(damaged)
    assert load_tapered(damaged).tapernorm_config == config_of(other)


def test_load_tapered_of_a_missing_folder_says_not_found(tmp_path):
    with pytest.raises(ConfigurationError, match="not found|does not exist|no such folder"):
        load_tapered(tmp_path / "nothing")


# ============================================================================= odd but valid input
def test_fold_model_leaves_the_tapered_model_as_it_was():
    model = tapered("llama")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    expected = logits(model, IDS)
    folded = fold_model(model)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert torch.equal(logits(model, IDS), expected) and relative_error(logits(folded, IDS), expected) <= 1e-5


def test_fold_model_of_a_gpt2_left_in_train_mode_checks_without_dropout():
    model = tapered("gpt2").train()  # GPT-2's dropout is 0.1: a check in train mode would fail at random
    folded = fold_model(model)
    assert model.training and not folded.training and folded.fold_report.max_rel_diff <= 1e-5


def test_fold_model_in_float16_uses_its_own_tolerance():
    folded = fold_model(tapered("llama", dtype=torch.float16))
    assert folded.dtype == torch.float16
    assert folded.fold_report.dtype == "float16" and folded.fold_report.max_rel_diff <= folded.fold_report.tolerance


def test_a_probe_longer_than_the_models_positions_is_fine_for_rotary():
    assert fold_model(tapered("llama"), probe=torch.randint(0, 128, (1, 200))).fold_report.probe_shape == (1, 200)


NO_TOKENIZER = " (a tokenizer has bos_token_id, eos_token_id, is called on text)"


@pytest.mark.parametrize(
    "tokenizer, what",
    [
        (1, "an object of type int" + NO_TOKENIZER),
        (object(), "an object of type object" + NO_TOKENIZER),
        ({"bos_token_id": 1}, "an object of type dict" + NO_TOKENIZER),
        ([1], "an object of type list" + NO_TOKENIZER),
        (type(char_tokenizer()), f"the class {type(char_tokenizer()).__name__}"),
    ],
    ids=["int", "object", "dict", "list", "class"],
)
def test_a_tokenizer_that_is_no_tokenizer_is_refused_as_a_name_is(tokenizer, what):
    """patch_model(model, tokenizer=X) and TaperNormConfig.for_model(model, X) with X no tokenizer (a number, a dict
    of ids, the tokenizer class) gave a recipe without a sink, with a WARNING that the model's config had no BOS
    (config.bos_token_id is 1). Anything without bos_token_id, eos_token_id and a call on text is now refused in one
    line, as a name is; the patched model is left as it was."""
    expected = (
        f"tokenizer= must be a tokenizer, got {what}: pass AutoTokenizer.from_pretrained(name), or leave it out to "
        "take the model config's bos_token_id as the sink"
    )
    model = _llama()
    for call in (lambda: TaperNormConfig.for_model(model, tokenizer), lambda: patch_model(model, tokenizer=tokenizer)):
        with pytest.raises(ConfigurationError) as caught:
            call()
        assert str(caught.value) == expected
    assert not hasattr(model, "tapernorm_config") and TaperNormConfig.for_model(model).sink_token_ids == [1]


def test_a_tokenizer_without_bos_gives_the_eos_as_the_sink():
    """The warning names the line that called patch_model (it named a line inside patching.py)."""
    with pytest.warns(UserWarning, match=r"does not start its output with the sink token\(s\) \[127\]") as caught:
        model = patch_model(_llama(), tokenizer=char_tokenizer())
    assert model.tapernorm_config.sink_token_ids == [127]
    assert [Path(w.filename).name for w in caught] == [Path(__file__).name]


def test_callback_allow_changes_given_as_one_string_is_one_field():
    assert TaperCallback(allow_changes="scope").allow_changes == {"scope"}


def test_a_controller_step_that_goes_back_is_refused():
    """A loop whose step counter restarts (the batch index of each epoch) set the gate back up (0.905 after 0.3)
    over a model trained at the lower gate, without a word. Refused in one line now; the same step again before its
    step_end (a retried update) is fine, and replay=True (a benchmark timing the same steps over) runs an earlier
    step on purpose."""
    model = _paper(taper_start=2, taper_end=6).train()
    controller = TaperController(model, total_steps=8)
    for step in range(5):
        controller.step_begin(step)
        ids = random_batches(n=1, seed=step)[0]
        model(input_ids=ids, labels=ids).loss.backward()
        controller.step_end(step)
    gate = controller.step_begin(5)
    assert controller.step_begin(5) == gate
    with pytest.raises(TaperStateError) as caught:
        controller.step_begin(1)
    assert str(caught.value) == (
        "TaperController.step_begin(1) after step_begin(5): steps count the optimizer updates of the whole run and "
        "must not go back (the gate follows them, and would rise again over a model trained at a lower one); count "
        "steps across epochs (a global step, not the batch index of an epoch), or build a new TaperController for a "
        "new run"
    )
    assert controller.gate == gate and all(float(layer.gate) == gate for _, layer in tapered_norms(model))
    assert controller.step_begin(2, replay=True) > gate


@pytest.mark.parametrize("step", [0.5, 1.5, True, False, float("nan"), torch.tensor(0.5), torch.tensor(True), "1"])
def test_a_controller_step_that_is_no_whole_number_is_refused(step):
    """step_begin(i / 2) (a loop passing its micro-batch over the accumulation) set a new gate for every micro-batch
    (1, 0.983, 0.933, ...), each with its own statistics update, and step_begin(True/False) read as steps 1 and 0,
    without a word, where total_steps=2.5 or True is refused. Refused in one line now, as total_steps is."""
    controller = TaperController(_paper(taper_start=2, taper_end=6).train(), total_steps=8)
    with pytest.raises(ConfigurationError) as caught:
        controller.step_begin(step)
    assert str(caught.value) == (
        f"TaperController.step_begin: step must be a whole number of optimizer steps completed (an int), got "
        f"{step!r}; count optimizer updates, not micro-batches (the gate is constant over one update's)"
    )
    assert controller.gate == 1.0 and controller._last_step is None  # nothing was set


def _controller_after_one_backward() -> TaperController:
    """A controller whose first step began and whose backward ran: the state each refused call must leave as it is."""
    model = _paper(taper_start=2, taper_end=6).train()
    controller = TaperController(model, total_steps=8)
    controller.step_begin(0)
    ids = random_batches(n=1, seed=0)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    return controller


@pytest.mark.parametrize("call", ["check_resume", "step_end", "check"])
@pytest.mark.parametrize("step", [2.5, True, "3", None])
def test_every_controller_call_taking_a_step_refuses_one_that_is_no_whole_number(call, step):
    """step_begin refused fractions and bools, but check_resume(2.5) or check_resume(True) set the loop's step to
    2.5 or True and checked the gate of that step ("optimizer step True"), step_end(2.5) was taken, and "3" or None
    gave a raw TypeError. Every call taking a step refuses them in one line now, before changing anything."""
    controller = _controller_after_one_backward()
    with pytest.raises(ConfigurationError) as caught:
        getattr(controller, call)(step)
    assert str(caught.value) == (
        f"TaperController.{call}: step must be a whole number of optimizer steps completed (an int), got "
        f"{step!r}; count optimizer updates, not micro-batches (the gate is constant over one update's)"
    )
    assert controller._last_step == 0 and controller._last_call == "step_begin(0)"


def test_a_controller_takes_whole_steps_of_any_number_type():
    """Whole numbers that are no int (3.0, a tensor, a numpy integer: a loop's own counters) stay accepted, read as
    the int they hold (a tensor step gave a float32 tensor gate, off the schedule's by its rounding)."""
    model = _paper(taper_start=2, taper_end=6).train()
    controller = TaperController(model, total_steps=8)
    steps = [0, 1.0, torch.tensor(2), numpy.int64(3)]
    gates = []
    for step in steps:
        gates.append(controller.step_begin(step))
        ids = random_batches(n=1, seed=int(step))[0]
        model(input_ids=ids, labels=ids).loss.backward()
        controller.step_end(int(step))
    assert gates == pytest.approx([TaperSchedule(2, 6, total_steps=8).gate(k) for k in (1, 2, 3, 4)], abs=1e-12)
    assert controller._last_step == 3 and type(controller._last_step) is int


@pytest.mark.parametrize("call", ["step_begin", "check_resume", "step_end", "check"])
@pytest.mark.parametrize("step", [-1, numpy.int64(-2), torch.tensor(-3), -1.0])
def test_a_negative_controller_step_is_refused(call, step):
    """step_begin(-1) returned gate 1.0 and recorded step -1, check_resume(-3) and step_end(-1) were taken, and
    check(-1) named "optimizer step 0": a negative step counts no updates completed (the Trainer's global_step starts
    at 0). Every call taking a step refuses it in one line now, before changing anything."""
    controller = _controller_after_one_backward()
    with pytest.raises(ConfigurationError) as caught:
        getattr(controller, call)(step)
    assert str(caught.value) == (
        f"TaperController.{call}: step must be the number of optimizer steps completed, 0 or more, got {step!r}; "
        "the first update is step_begin(0) (the Trainer's state.global_step, which starts at 0)"
    )
    assert controller._last_step == 0 and controller._last_call == "step_begin(0)"


@pytest.mark.parametrize(
    ("calls", "refused", "began", "last"),
    [
        ([], 0, "no step begun", "none"),
        (["begin 0"], 5, "the step step_begin(0) began", "step_begin(0)"),
        (["begin 0", "end 0"], 0, "no step begun", "step_end(0): step 0 has ended already"),
        (["begin 0", "end 0"], 5, "no step begun", "step_end(0)"),
    ],
)
def test_a_step_end_that_ends_no_begun_step_is_refused(calls, refused, began, last):
    """step_end(0) with no step_begin, step_end(5) after step_begin(0), or a second step_end(0) were taken: each folded
    the micro-batches' statistics into the EMA again (or at a gate never set) and logged the watch under another
    update. step_end ends the step step_begin began, with its number, once; a refused call changes nothing. The
    refusal of a second step_end(0) said "the last call was step_begin(0)" beside "no step begun", contradicting
    itself: it names step_end(0) as the last call now, and says that step 0 has ended already."""
    model = _paper(taper_start=2, taper_end=6).train()
    controller = TaperController(model, total_steps=8)
    ids = random_batches(n=1, seed=0)[0]
    for call in calls:
        kind, step = call.split()
        getattr(controller, f"step_{kind}")(int(step))
        model(input_ids=ids, labels=ids).loss.backward()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    with pytest.raises(TaperStateError) as caught:
        controller.step_end(refused)
    assert str(caught.value) == (
        f"TaperController.step_end({refused}) with {began} (the last call was {last}): each optimizer update is "
        "step_begin(step) before its forward passes, then step_end(step) with the same step after optimizer.step()"
    )
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())


@pytest.mark.parametrize("call", ["step_end", "check"])
@pytest.mark.parametrize("name", ["loss", "grad_norm"])
@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("2.0", "'2.0'"),
        ("x", "'x'"),
        ([1.0], "[1.0]"),
        (True, "True"),
        (1 + 2j, "(1+2j)"),
        (torch.tensor([1.0, 2.0]), "a Tensor of shape (2,)"),
        (numpy.array([1.0, 2.0]), "a ndarray of shape (2,)"),
    ],
)
def test_a_loss_or_grad_norm_that_is_no_number_is_refused_changing_nothing(call, name, value, shown):
    """check(0, loss="2.0"), step_end(0, loss="x"), step_end(0, grad_norm=[1.0]) and check(0,
    loss=torch.tensor([1.0, 2.0])) raised a raw TypeError or ValueError from the divergence watch, step_end's after it
    had folded the step into the EMA statistics and ended it. Refused in one line now, naming the argument and what
    it takes, before anything changes."""
    controller = _controller_after_one_backward()
    model = controller.model
    before = {key: tensor.clone() for key, tensor in model.state_dict().items()}
    with pytest.raises(ConfigurationError) as caught:
        getattr(controller, call)(0, **{name: value})
    advice = {
        "loss": "the step's loss (outputs.loss, or loss.item())",
        "grad_norm": "the step's gradient norm (what clip_grad_norm_ returns)",
    }[name]
    assert str(caught.value) == (
        f"TaperController.{call}: {name} must be a number or a one-element tensor, got {shown}; pass {advice}"
    )
    assert all(torch.equal(tensor, before[key]) for key, tensor in model.state_dict().items())
    assert controller._open_step == 0 and controller._ended_step is None and controller._last_call == "step_begin(0)"
    assert not controller.watch.loss.values and not controller.watch.grad_norm.values


def _data_frame() -> object:
    return pytest.importorskip("pandas").DataFrame([[2.0]])


@pytest.mark.parametrize("call", ["step_end", "check"])
@pytest.mark.parametrize("name", ["loss", "grad_norm"])
@pytest.mark.parametrize(
    ("make", "shown"),
    [
        (lambda: torch.empty((), device="meta"), "a Tensor on the meta device (it holds no value)"),
        (lambda: torch.empty((1,), device="meta"), "a Tensor on the meta device (it holds no value)"),
        (_data_frame, "a DataFrame of shape (1, 1)"),
    ],
)
def test_a_loss_or_grad_norm_without_an_item_is_refused_in_one_line(call, name, make, shown):
    """check(0, loss=torch.empty((), device="meta")) raised "RuntimeError: Tensor.item() cannot be called on meta
    tensors", and loss=pd.DataFrame([[2.0]]) "AttributeError: 'DataFrame' object has no attribute 'item'": the
    one-element value's .item() ran outside the checks. Both are refused now in the one line every other non-number
    gets, before anything changes."""
    value = make()
    controller = _controller_after_one_backward()
    with pytest.raises(ConfigurationError) as caught:
        getattr(controller, call)(0, **{name: value})
    assert str(caught.value).startswith(f"TaperController.{call}: {name} must be a number or a one-element tensor, ")
    assert f", got {shown}; pass " in str(caught.value) and "\n" not in str(caught.value)
    assert controller._open_step == 0 and controller._ended_step is None
    assert not controller.watch.loss.values and not controller.watch.grad_norm.values


def test_a_step_end_refused_for_its_loss_can_be_retried():
    """step_begin(0), a forward, step_end(0, loss="2.0") (refused), then step_end(0, loss=2.0): the refused call had
    folded the step into the EMA and ended it, so the retry was refused ("no step begun") and the step's divergence
    check never ran. The arguments are checked first now: the retry ends the step as if the refused call never
    happened."""
    controller = _controller_after_one_backward()
    with pytest.raises(ConfigurationError):
        controller.step_end(0, loss="2.0")
    controller.step_end(0, loss=2.0)
    clean = _controller_after_one_backward()
    clean.step_end(0, loss=2.0)
    got, want = controller.model.state_dict(), clean.model.state_dict()
    assert all(torch.allclose(got[key], want[key], rtol=0, atol=1e-12) for key in want if want[key].is_floating_point())
    assert list(controller.watch.loss.values) == list(clean.watch.loss.values) == [2.0]
    assert controller._ended_step == 0 and controller._open_step is None


@pytest.mark.parametrize(
    "value", [2, 2.0, numpy.float32(2.0), numpy.array(2.0), torch.tensor(2.0), torch.tensor([2.0]), numpy.array([2.0])]
)
def test_a_loss_and_grad_norm_of_one_number_of_any_kind_are_watched(value):
    """Numbers of any kind (a numpy scalar, a one-element tensor or array) stay accepted, watched as the float they
    hold; nan and inf still stop the run at the divergence watch."""
    controller = _controller_after_one_backward()
    controller.check(0, loss=value, grad_norm=value)
    assert list(controller.watch.loss.values) == list(controller.watch.grad_norm.values) == [2.0]
    assert all(type(v) is float for v in controller.watch.loss.values)
    with pytest.raises(TaperDivergenceError, match="the training loss is not finite"):
        controller.step_end(0, loss=torch.tensor([float("nan")]))


def test_a_step_begun_again_after_its_step_end_is_refused():
    """step_begin(0), step_end(0), step_begin(0), step_end(0) was taken: update 0 was begun and ended twice, its
    statistics counted twice under one step number (ema_steps 2). step_begin of the step step_end ended is refused in
    one line now, changing nothing; replay=True (a benchmark repeating steps) still takes it."""
    model = _paper(taper_start=2, taper_end=6).train()
    controller = TaperController(model, total_steps=8)
    ids = random_batches(n=1, seed=0)[0]
    controller.step_begin(0)
    model(input_ids=ids, labels=ids).loss.backward()
    controller.step_end(0)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    with pytest.raises(TaperStateError) as caught:
        controller.step_begin(0)
    assert str(caught.value) == (
        "TaperController.step_begin(0) after step_end(0): that update was ended and its statistics counted; the next "
        "update is step_begin(1) (a retried update calls step_begin(0) again before step_end, and replay=True "
        "repeats steps on purpose)"
    )
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())
    assert controller.step_begin(0, replay=True) == 1.0 and controller.step_begin(1) == 1.0


def _first_layer_after(calls: list[str]) -> dict[str, torch.Tensor]:
    """The first tapered norm's float state after ``calls`` ("begin N", "end N", "fwd A"/"fwd B": a forward and
    backward of batch A or B) on a fresh paper-recipe model and controller."""
    torch.manual_seed(0)
    model = _paper(taper_start=2, taper_end=6).train()
    controller = TaperController(model, total_steps=8)
    batches = dict(zip("AB", random_batches(n=2, seed=3)))
    for call in calls:
        kind, arg = call.split()
        if kind == "fwd":
            model(input_ids=batches[arg], labels=batches[arg]).loss.backward()
        else:
            getattr(controller, f"step_{kind}")(int(arg))
    _, layer = next(iter(tapered_norms(model)))
    return {
        k: v.detach().clone() for k, v in layer.state_dict().items() if v.dtype.is_floating_point or k == "ema_steps"
    }


@pytest.mark.parametrize(
    ("calls", "clean"),
    [
        (["begin 0", "fwd B", "begin 0", "fwd A", "end 0"], ["begin 0", "fwd A", "end 0"]),
        (["begin 0", "fwd B", "begin 1", "fwd A", "end 1"], ["begin 1", "fwd A", "end 1"]),
    ],
    ids=["retried step", "step never ended"],
)
def test_a_step_begin_drops_the_statistics_of_no_completed_update(calls, clean):
    """A retried update (step_begin(0), a forward given up, step_begin(0), forward, step_end(0)) folded the given-up
    attempt's micro-batch statistics into step 0, and step_begin(1) after step_begin(0) without step_end(0) folded
    step 0's micro-batches into update 1. A step_begin starts its update's statistics afresh now: the state is that
    of the completed update alone."""
    got, want = _first_layer_after(calls), _first_layer_after(clean)
    assert int(got["ema_steps"]) == int(want["ema_steps"]) == 1
    assert all(torch.allclose(got[name], want[name], rtol=0, atol=1e-12) for name in want)


@pytest.mark.parametrize("call", ["step_begin", "check_resume", "step_end", "check"])
def test_a_controller_step_too_large_for_a_float_is_no_overflow_error(call):
    """step_begin(10**400) (and check_resume, step_end) raised OverflowError ("int too large to convert to float")
    from the step check, which read every step through float(). An int is read as one now: 10**400 is a whole step,
    and a float that overflows (10.0**400 is inf) is refused in one line."""
    from hf_tapernorm.training.controller import whole_step

    assert whole_step(10**400, call) == 10**400 and whole_step(numpy.uint64(2**64 - 1), call) == 2**64 - 1
    assert whole_step(torch.tensor(2**62), call) == 2**62 and type(whole_step(numpy.int64(7), call)) is int
    with pytest.raises(ConfigurationError) as caught:
        whole_step(float("1e400"), call)
    assert str(caught.value) == (
        f"TaperController.{call}: step must be a whole number of optimizer steps completed (an int), got inf; count "
        "optimizer updates, not micro-batches (the gate is constant over one update's)"
    )


def _saved_at_step_5(folder: Path) -> Path:
    """A paper taper of 8 steps (window 2 -> 6), its model and controller state saved after 5 steps."""
    model = _paper(taper_start=2, taper_end=6).train()
    controller = TaperController(model, total_steps=8)
    for step in range(5):
        controller.step_begin(step)
        ids = random_batches(n=1, seed=step)[0]
        model(input_ids=ids, labels=ids).loss.backward()
        controller.step_end(step)
    save_tapered(model, folder)
    controller.save_state(folder)
    return folder


def test_a_resumed_controller_refuses_a_loop_that_starts_again_at_0(tmp_path):
    """TaperController resumed with load_state + check_resume(5), then driven from step_begin(0) (a loop that forgot
    its start step), set gate 1 over a model tapered to gate 0.095, without a word: "steps never go back" counted
    only the controller's own step_begin calls. check_resume(5) now starts the count at 5; with load_state alone,
    the first step may not raise the model's gate. Resuming at the right step still works."""
    folder = _saved_at_step_5(tmp_path / "s5")

    def resumed(check: bool) -> TaperController:
        controller = TaperController(load_tapered(folder).train(), total_steps=8)
        controller.load_state(folder)
        if check:
            controller.check_resume(5)
        return controller

    controller = resumed(check=True)
    held = float(next(tapered_norms(controller.model))[1].gate)
    assert held < 0.5
    with pytest.raises(TaperStateError) as caught:
        controller.step_begin(0)
    assert str(caught.value) == (
        "TaperController.step_begin(0) after check_resume(5): steps count the optimizer updates of the whole run and "
        "must not go back (the gate follows them, and would rise again over a model trained at a lower one); start "
        "the resumed loop at the step given to check_resume (for step in range(start_step, total_steps))"
    )
    assert all(float(layer.gate) == held for _, layer in tapered_norms(controller.model))  # left as it was
    controller = resumed(check=False)
    with pytest.raises(TaperStateError) as caught:
        controller.step_begin(0)
    assert str(caught.value) == (
        f"TaperController.step_begin(0) after load_state: the model holds gate {held:.6f} and step 0 would set it "
        "back up to 1.000000 over a model trained at the lower one; start the resumed loop at its step (for step in "
        "range(start_step, total_steps)) and call check_resume(start_step) after load_state"
    )
    for check in (True, False):
        controller = resumed(check)
        gate = controller.step_begin(5)
        assert gate == controller.schedule.gate(6) < held


def test_a_new_controller_on_a_model_tapered_before_refuses_to_raise_its_gate(tmp_path):
    """A new TaperController (no load_state, no check_resume) on a model an earlier run tapered to gate 0.095 set
    gate 1 at its step_begin(0) over a model trained at the lower gate, without a word. Its first step refuses now,
    and leaves the gate as it was; a model at gate 1 starts as before."""
    model = load_tapered(_saved_at_step_5(tmp_path / "s5")).train()
    held = float(next(tapered_norms(model))[1].gate)
    assert held < 0.5
    controller = TaperController(model, total_steps=8)
    with pytest.raises(TaperStateError) as caught:
        controller.step_begin(0)
    assert str(caught.value) == (
        f"TaperController.step_begin(0): the model holds gate {held:.6f}, so an earlier run tapered it, and this "
        "controller's step 0 would set it back up to 1.000000 over a model trained at the lower one; to go on with "
        "that run, load_state(its checkpoint) and check_resume(its step) first; for a new run, patch a fresh model"
    )
    assert all(float(layer.gate) == held for _, layer in tapered_norms(model))
    # A resume at step 0 is a fresh start, and a replayed step (a benchmark's) starts no run: both were let through.
    resumed_at_0 = TaperController(model, total_steps=8)
    resumed_at_0.check_resume(0)
    replayed = TaperController(model, total_steps=8)
    replayed.step_begin(0, replay=True)  # on purpose: it sets its step's gate; the gate met is the model's before
    for controller, step in ((resumed_at_0, 0), (replayed, 1)):
        with pytest.raises(TaperStateError, match=rf"^TaperController\.step_begin\({step}\): the model holds gate"):
            controller.step_begin(step)
    assert TaperController(_paper(taper_start=2, taper_end=6), total_steps=8).step_begin(0) == 1.0


def test_controller_load_state_reads_one_string_of_allow_changes_as_one_name(tmp_path):
    """load_state(folder, allow_changes="distill_weight") read the string letter by letter and refused the one field
    the user allowed; TaperCallback(allow_changes=...) took it as one name. Both read it the same way now."""
    folder = _saved_at_step_5(tmp_path / "s5")
    controller = TaperController(_paper(taper_start=2, taper_end=6, distill_weight=0.5), total_steps=8)
    controller.load_state(folder, allow_changes="distill_weight")
    with pytest.raises(TaperStateError, match=r"\(distill_weight: 0\.0 in the checkpoint, 0\.5 now\)"):
        controller.load_state(folder, allow_changes="scope")


def test_an_empty_input_fails_in_the_export_as_in_the_original(tmp_path):
    empty = torch.zeros((1, 0), dtype=torch.long)
    folded = _loaded_export("llama", tmp_path)
    with pytest.raises(RuntimeError) as original:
        _llama()(input_ids=empty)
    with pytest.raises(RuntimeError) as export:
        folded(input_ids=empty)
    assert str(export.value) == str(original.value)  # transformers' own error, not one of the fold's


def test_a_whole_and_a_sharded_tapered_checkpoint_never_share_a_folder(tmp_path):
    """save_sharded_checkpoint into save_tapered's folder left its model.safetensors beside the new shards and
    recipe (a safetensors reader took the stale weights for the new checkpoint); save_tapered into a sharded
    checkpoint's folder was refused as "another model" (its config.json is the base model's). Each is refused by
    what the folder holds, before anything is written."""
    model = tapered("llama", keep_norms=[])
    whole = save_tapered(model, tmp_path / "whole")
    sharded = save_sharded_checkpoint(tmp_path / "sharded", model)
    _each_refused_leaving_it_as_it_was(
        {"save_sharded_checkpoint: cannot save a sharded checkpoint": lambda f: save_sharded_checkpoint(f, model)},
        whole,
        "it holds a whole model's weights (model.safetensors)",
    )
    _each_refused_leaving_it_as_it_was(
        {"save_tapered: cannot save a tapered checkpoint": lambda f: save_tapered(model, f)},
        sharded,
        "it holds a sharded checkpoint (",
    )
