"""The benchmark's plumbing on tiny random models: options, variants, train phases, op counts, outputs.

No assertion reads a timing (a shared machine is too noisy for that); speed is measured by running
the benchmark on the real model. What is checked here is what each variant and workload *is*.
"""

from __future__ import annotations

import json
import math
import os
import runpy
import socket
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from hf_tapernorm import TaperNormConfig
from hf_tapernorm._parsing import UsageError
from hf_tapernorm.app.run_lock import LOCK_NAME
from hf_tapernorm.architectures.sites import norm_sites
from hf_tapernorm.bench import measure, runner, workloads
from hf_tapernorm.bench import train_workloads as train
from hf_tapernorm.bench import variants as var
from hf_tapernorm.bench.arguments import BenchArguments, Case, cases, parse_arguments
from hf_tapernorm.cli.main import main as cli_main
from hf_tapernorm.data.sources import load_text_dataset
from hf_tapernorm.errors import ConfigurationError
from hf_tapernorm.layers import TaperNorm, gate_of, tapered_norms

from .conftest import (
    build,
    char_tokenizer,
    corpus_documents,
    random_batches,
    save_tiny_model,
    tiny_gpt2_config,
    tiny_llama_config,
)

CONFIGS = {"llama": tiny_llama_config, "gpt2": tiny_gpt2_config}
REPO = Path(__file__).resolve().parent.parent
LAYERS = tiny_llama_config().num_hidden_layers
INPUT_NORMS = {f"model.layers.{i}.input_layernorm" for i in range(LAYERS)}
MLP_NORMS = {f"model.layers.{i}.post_attention_layernorm" for i in range(LAYERS)}


@pytest.fixture
def corpus(tmp_path) -> str:
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(corpus_documents(150)))
    return str(path)


# ----------------------------------------------------------------------------- arguments
def test_defaults_compare_what_the_default_recipe_exports():
    args = parse_arguments([])
    assert args.norms == ["recipe"] and args.variants == ["original", "flashnorm", "explicit", "folded", "limit"]
    assert args.modes == ["last", "decode"] and args.dtypes == ["fp32"] and args.execution == ["eager"]
    assert args.model_name_or_path is None and args.dataset_name is None  # the embedded model and corpus
    several = parse_arguments(["--norms", "recipe", "internal", "all", "--modes", "last", "train", "--threads", "1"])
    assert several.norms == ["recipe", "internal", "all"] and several.modes == ["last", "train"]
    assert several.threads == [1]


@pytest.mark.parametrize("argv, message", [
    (["--norms", "attn"], "--norms: 'attn' not among recipe, internal, all"),
    (["--variants", "all-folded"], "--variants: 'all-folded' not among"),
    (["--modes", "last", "last"], "--modes lists a value twice"),
    (["--dtypes", "fp8"], "--dtypes: 'fp8'"),
    (["--dtypes", "fp32", "float32"], "^--dtypes lists one dtype twice: fp32 and float32 are both fp32$"),
    (["--dtypes", "bf16", "fp32", "bf16"], "^--dtypes lists a value twice: bf16 fp32 bf16$"),
    (["--dtypes", "float32", "float32"], "^--dtypes lists a value twice: float32 float32$"),
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["--batch_sizes", "0"], "--batch_sizes must be positive"),
    (["--modes", "train", "--seq_lens", "3"], "at least 4"),
    (["--train_workloads", "taper", "tapered"], "must include normalized"),
    (["--train_workloads", "normalized", "taper-distilled"], "'taper-distilled' not among"),
])  # fmt: skip
def test_bad_choices_fail_before_anything_loads(argv, message):
    with pytest.raises(ConfigurationError, match=message):
        parse_arguments(argv)


def test_usage_errors_are_one_line_with_exit_status_2(capsys):
    with pytest.raises(UsageError, match="unrecognized arguments: .*--bogus"):
        parse_arguments(["--bogus", "limit"])
    assert cli_main(["bench", "--norms", "attn"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hf-tapernorm bench: error: --norms") and "\n" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given when CUDA is absent")
def test_cuda_requested_without_cuda_is_a_clear_error():
    with pytest.raises(ConfigurationError, match="device 'cuda' requested but CUDA is not available"):
        BenchArguments(devices=["cuda"])


@pytest.mark.parametrize(
    "device, message",
    [
        ("npu", "--devices 'npu' is not a device torch knows"),
        ("bogus:0", "--devices 'bogus:0' is not a device torch knows"),
        ("xpu", "device 'xpu' requested but XPU is not available here"),
    ],
)
def test_a_device_this_machine_lacks_is_refused_before_loading(device, message, capsys):
    with pytest.raises(ConfigurationError, match=message):
        BenchArguments(devices=[device])
    assert cli_main(["bench", "--devices", "cpu", device]) == 2
    assert capsys.readouterr().err.startswith("hf-tapernorm bench: error:")


@pytest.mark.parametrize(
    "devices, first, second, kind",
    [
        (["cpu", "cpu:0"], "cpu", "cpu:0", "cpu"),
        (["cpu:0", "cuda", "cpu"], "cpu:0", "cpu", "cpu"),
        (["cuda", "cuda:0"], "cuda", "cuda:0", "cuda"),
        (["cuda:0", "cpu", "cuda"], "cuda:0", "cuda", "cuda"),
    ],
)
def test_two_names_of_one_device_are_refused_as_a_value_listed_twice(devices, first, second, kind, capsys):
    """`bench --devices cpu cpu:0` timed the one CPU twice, as two rows, while a value listed twice in --modes,
    --seq_lens, --execution or --threads is refused. Two names of one device (every cpu name; cuda and cuda:0, the
    device torch uses for `cuda` in a fresh process) are refused now, before the availability check and any loading."""
    with pytest.raises(ConfigurationError) as refused:
        BenchArguments(devices=devices)
    assert str(refused.value) == (
        f"--devices lists one device twice: {first!r} and {second!r} name the same {kind} device (it would be timed "
        "twice, as two rows); keep one"
    )
    assert cli_main(["bench", "--devices", *devices]) == 2
    assert capsys.readouterr().err.startswith("hf-tapernorm bench: error: --devices lists one device twice: ")


@pytest.mark.parametrize("devices", [["cpu:1"], ["cpu:0", "cpu:1"], ["cpu", "cpu:3"]])
def test_a_cpu_index_past_0_is_refused_as_a_device_torch_lacks(devices, capsys):
    """`bench --devices cpu:1` ran on the one CPU and recorded its rows as "cpu:1", a device torch does not have,
    while `cpu:0 cpu:1` was refused as one device twice. A cpu index past 0 is refused in one line now, before
    loading, in either place; cpu:0 stays a name of the CPU."""
    with pytest.raises(ConfigurationError) as refused:
        BenchArguments(devices=devices)
    assert str(refused.value) == f"--devices {devices[-1]!r}: the CPU is one device: name it cpu"
    assert cli_main(["bench", "--devices", *devices]) == 2
    assert capsys.readouterr().err == f"hf-tapernorm bench: error: {refused.value}\n"
    assert BenchArguments(devices=["cpu:0"]).devices == ["cpu:0"]


def test_an_output_dir_that_is_a_file_is_refused_before_the_benchmark(tmp_path, monkeypatch):
    target = tmp_path / "results.txt"
    target.write_text("keep me\n")
    monkeypatch.setattr(runner, "run_benchmark", lambda *a, **k: pytest.fail("the benchmark ran"))
    with pytest.raises(ConfigurationError, match=f"--output_dir '{target}' is a file"):
        runner.main(["--model_name_or_path", str(save_tiny_model(tmp_path / "tiny")), "--output_dir", str(target)])
    assert target.read_text() == "keep me\n"


@pytest.mark.parametrize(
    "options, message",
    [
        (["--modes", "last", "--seq_lens", "8", "65"], "--seq_lens 65 exceeds the model's 64 positions"),
        (
            ["--modes", "decode", "--seq_lens", "60", "--new_tokens", "5"],
            r"--seq_lens 60 \+ --new_tokens 5 \(decode\) exceeds the model's 64 positions",
        ),
    ],
)
def test_cases_longer_than_the_models_positions_are_refused_before_loading(tmp_path, monkeypatch, options, message):
    folder = save_tiny_model(tmp_path / "tiny")  # 64 positions
    monkeypatch.setattr(runner, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(ConfigurationError, match=message):
        runner.main(["--model_name_or_path", str(folder), "--output_dir", str(tmp_path / "out"), *options])


def test_the_conversion_script_is_a_front_end_of_the_cli(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["benchmark.py", "--help"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(REPO / "conversion_scripts" / "benchmark.py"), run_name="__main__")
    assert exit_info.value.code == 0 and "--norms" in capsys.readouterr().out


# ----------------------------------------------------------------------------- inference variants
def test_variant_labels_carry_the_norms_only_when_several_are_compared():
    kinds = ["original", "flashnorm", "explicit", "folded", "limit"]
    assert [s.label for s in var.variant_specs(kinds, ["recipe"])] == kinds
    labels = [s.label for s in var.variant_specs(kinds, ["recipe", "all"])]
    assert labels == [  # the original and its FlashNorm fold once: they remove no norm
        "original",
        "flashnorm",
        "recipe-explicit",
        "recipe-folded",
        "recipe-limit",
        "all-explicit",
        "all-folded",
        "all-limit",
    ]
    specs = var.variant_specs(kinds, ["recipe", "all"])
    assert var.limit_labels(specs) == {
        "recipe-explicit": "recipe-limit",
        "recipe-folded": "recipe-limit",
        "all-explicit": "all-limit",
        "all-folded": "all-limit",
    }


@pytest.mark.parametrize("norms, removed", [
    # SwiGLU: the norms feeding the gated MLPs stay, and the runaway band's attention norm (layer 0 of 2); the
    # final norm goes
    ("recipe", INPUT_NORMS - {"model.layers.0.input_layernorm"} | {"model.norm"}),
    ("internal", INPUT_NORMS | MLP_NORMS),
    ("all", INPUT_NORMS | MLP_NORMS | {"model.norm"}),
])  # fmt: skip
def test_each_norms_choice_removes_its_norms_in_every_variant(tiny_llama, tmp_path, norms, removed):
    assert set(var.removed_norms(tiny_llama, var.removal_config(tiny_llama, norms))) == removed
    specs = var.variant_specs(["original", "explicit", "folded", "limit"], [norms])
    built = var.build_variants(tiny_llama, specs, calibration_batches=random_batches(n=2), workdir=tmp_path)
    assert built["original"] is tiny_llama and not any(tapered_norms(tiny_llama, include_kept=True))
    explicit = built["explicit"]
    assert gate_of(explicit) == 0.0 and explicit.tapernorm_config.sink_token_ids == []
    for site in norm_sites(tiny_llama):
        gone = site.path in removed
        layer = explicit.get_submodule(site.path)
        assert isinstance(layer, TaperNorm) and layer.tapered == gone
        assert isinstance(built["limit"].get_submodule(site.path), nn.Identity) == gone
        assert isinstance(built["folded"].get_submodule(site.path), nn.Identity) == gone
    assert built["folded"].config.kept_norms == sorted({s.path for s in norm_sites(tiny_llama)} - removed)
    ids = random_batches(n=1, batch=1)[0]
    (check,) = var.agreement(built, specs, ids).values()
    assert check["max_rel"] <= 1e-5 and check["finite_fraction"] == 1.0


def test_a_gelu_models_recipe_removes_every_internal_norm(tiny_gpt2):
    recipe = var.removed_norms(tiny_gpt2, var.removal_config(tiny_gpt2, "recipe"))
    assert recipe == var.removed_norms(tiny_gpt2, var.removal_config(tiny_gpt2, "internal"))
    assert len(recipe) == 2 * tiny_gpt2_config().n_layer


def test_limit_copy_leaves_the_source_alone(tiny_llama):
    limit = var.limit_copy(tiny_llama, var.removal_config(tiny_llama, "all"))
    assert not any(isinstance(m, nn.Identity) for m in tiny_llama.modules())
    assert limit.lm_head.weight.data_ptr() != tiny_llama.lm_head.weight.data_ptr()
    torch.testing.assert_close(limit.lm_head.weight, tiny_llama.lm_head.weight, rtol=0, atol=0)


def test_an_overflowing_untrained_model_still_folds_and_is_compared_where_finite(tiny_llama, tmp_path, caplog):
    config = var.removal_config(tiny_llama, "internal")
    explicit = var.calibrated_copy(tiny_llama, config, random_batches(n=2))
    with torch.no_grad():
        for _, layer in tapered_norms(explicit, include_kept=True):
            if layer.tapered:
                layer.taper_weight.mul_(1e20)  # the residual stream overflows, as SmolLM2 does untrained
    folded = var.folded_reload(explicit, tmp_path / "folded", torch.float32, "cpu")
    assert "non-finite logits" in caplog.text
    specs = var.variant_specs(["explicit", "folded"], ["internal"])
    result = var.agreement({"explicit": explicit, "folded": folded}, specs, random_batches(n=1, batch=1)[0])
    assert result["folded_vs_explicit"]["finite_fraction"] < 1.0 and result["folded_vs_explicit"]["same_nonfinite"]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_decode_workload_is_greedy_generation(arch):
    model = build(CONFIGS[arch]())
    ids = random_batches(batch=2, length=6, n=1)[0]
    expected = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6, do_sample=False
    )[:, ids.shape[1] :]
    for static in (False, True):
        workload = workloads.Decode(model, model, ids, 5, static=static)
        cache, first = workload.prepare()  # the prefill's token, then 5 cached decoding steps
        tokens = torch.cat([first, workload.run((cache, first))], 1)
        assert torch.equal(tokens, expected), f"static cache: {static}"


# ----------------------------------------------------------------------------- measuring
class _Recorder(workloads.Workload):
    def __init__(self, name, log):
        self.name, self.log = name, log

    def prepare(self):
        self.log.append(("prepare", self.name))

    def run(self, state):
        self.log.append(("run", self.name))


def test_interleaving_rotates_the_order_and_prepares_untimed():
    log: list = []
    recorders = {name: _Recorder(name, log) for name in "abc"}
    times = measure.interleaved_times(recorders, warmup=1, repeats=3, device="cpu", progress=False)
    assert {name: len(series) for name, series in times.items()} == {"a": 3, "b": 3, "c": 3}
    runs = [name for kind, name in log if kind == "run"]
    assert runs == list("abcabcbcacab")  # warm-up, then each repeat starts one later
    assert all(log[i] == ("prepare", log[i + 1][1]) for i in range(0, len(log), 2))


@pytest.mark.parametrize("compiled, warmup, expected", [
    (True, 0, list("abab")),  # compiled: one untimed run each (the compilation) before the timed repeat
    (True, 2, list("ababab")),  # --warmup above 1 is kept
    (False, 0, list("ab")),  # eager: --warmup 0 is taken as it is
])  # fmt: skip
def test_a_compiled_case_runs_each_variant_untimed_before_timing_it(compiled, warmup, expected):
    """`--execution compile --warmup 0` timed each variant's first call, its compilation (1305 ms against 1.7 ms
    warm, and a folded/original ratio of two compilations); a compiled case now runs every workload at least once,
    untimed, whatever --warmup says."""
    log: list = []
    recorders = {name: _Recorder(name, log) for name in "ab"}
    case = Case("last", 1, 8, None, "fp32", "cpu", 1, compiled=compiled)
    arguments = SimpleNamespace(warmup=warmup, repeats=1, op_counts=False)
    times, ops = runner._time(recorders, case, arguments)
    assert [name for kind, name in log if kind == "run"] == expected
    assert {name: len(series) for name, series in times.items()} == {"a": 1, "b": 1} and ops == {}


def test_median_of_pair_ratios():
    assert measure.median_ratio([2.0, 3.0, 10.0], [1.0, 2.0, 2.0]) == 2.0
    # A load spike that hits both members of a pair cancels out; the medians of times would not.
    assert measure.median_ratio([1.0, 5.0, 1.0], [0.5, 2.5, 0.5]) == 2.0


# ----------------------------------------------------------------------------- train mode
def _text_batches(corpus: str, prefix: list[int], count: int = 3, batch: int = 2, seq_len: int = 16):
    return train.text_batches(
        load_text_dataset(corpus),
        char_tokenizer(),
        batch=batch,
        seq_len=seq_len,
        count=count,
        prefix_ids=prefix,
        source=corpus,
    )


def test_text_batches_are_packed_real_text_starting_with_the_sink(corpus):
    batches = _text_batches(corpus, [127])
    assert len(batches) == 3 and all(b["input_ids"].shape == (2, 16) for b in batches)
    first = batches[0]
    assert (first["input_ids"][:, 0] == 127).all() and (first["labels"][:, 1] == -100).all()
    text = char_tokenizer().decode(first["input_ids"][0, 1:]).replace("<eos>", " ")
    assert set(text) <= set("abcdefghijklmnopqrstuvwxyz \n")  # the corpus's words, packed
    assert not torch.equal(batches[0]["input_ids"], batches[1]["input_ids"])


def test_train_workloads_run_the_recipes_phases_through_the_controller(tiny_llama, corpus):
    recipe = TaperNormConfig.for_model(tiny_llama, char_tokenizer())
    assert recipe.distillation.weight > 0 and recipe.sink_token_ids == [127]
    batches = _text_batches(corpus, recipe.sink_token_ids)
    built = train.train_workloads(tiny_llama, batches, recipe, learning_rate=1e-4)
    assert list(built) == list(train.TRAIN_WORKLOADS)
    assert not any(tapered_norms(built["normalized"].model, include_kept=True)) and not any(
        tapered_norms(tiny_llama, include_kept=True)
    )
    before = {name: [p.detach().clone() for p in w.model.parameters()] for name, w in built.items()}
    for _ in range(train.TAPER_STEPS):
        for workload in built.values():
            workload.run(workload.prepare())
    facts = {name: w.facts() for name, w in built.items()}
    assert facts["normalized"]["gates"] is None and facts["warmup"]["gates"] == [1.0]
    assert len(facts["taper"]["gates"]) == train.TAPER_STEPS and all(0 < g < 1 for g in facts["taper"]["gates"])
    assert facts["tapered-distilled"]["gates"] == [0.0] == facts["tapered"]["gates"]
    teachers = {name: f["teacher"] for name, f in facts.items()}
    assert teachers == {
        "normalized": False,
        "warmup": False,
        "taper": True,
        "tapered-distilled": True,
        "tapered": False,
    }
    assert all(f["losses_finite"] and len(built[n].losses) == train.TAPER_STEPS for n, f in facts.items())
    for name, workload in built.items():  # every workload took real optimizer steps
        assert any(not torch.equal(a, b) for a, b in zip(before[name], workload.model.parameters())), name
    # The warm-up gathers statistics and never calibrates; the others were calibrated on real steps.
    assert not any(layer.is_calibrated for _, layer in tapered_norms(built["warmup"].model))
    assert all(layer.is_calibrated for _, layer in tapered_norms(built["tapered"].model))


def test_a_recipe_without_distillation_has_no_distilled_phase(tiny_gpt2, corpus):
    recipe = TaperNormConfig.for_model(tiny_gpt2, char_tokenizer())
    built = train.train_workloads(
        tiny_gpt2, _text_batches(corpus, recipe.sink_token_ids, count=2), recipe, learning_rate=1e-4
    )
    assert list(built) == ["normalized", "warmup", "taper", "tapered"]
    assert not any(w.has_teacher for w in built.values())


def test_only_the_listed_workloads_are_built(tiny_llama, corpus):
    recipe = TaperNormConfig.for_model(tiny_llama, char_tokenizer())
    built = train.train_workloads(
        tiny_llama,
        _text_batches(corpus, recipe.sink_token_ids, count=2),
        recipe,
        learning_rate=1e-4,
        names=["tapered", "normalized"],
    )
    assert list(built) == ["normalized", "tapered"]  # in the phases' order
    assert gate_of(built["tapered"].model) == 0.0 and not built["tapered"].has_teacher


def test_the_taper_workload_replays_its_steps_round_after_round(tiny_llama, corpus):
    """The taper workload's timed steps cycle over the taper's steps, going back to the first one each round:
    TaperController refuses a step that goes back (a loop's counter restarting), so the workload replays it on
    purpose (step_begin(replay=True)) and its gates repeat round after round."""
    recipe = TaperNormConfig.for_model(tiny_llama, char_tokenizer())
    batches = _text_batches(corpus, recipe.sink_token_ids, count=2)
    taper = train.train_workloads(tiny_llama, batches, recipe, learning_rate=1e-4, names=["taper"])["taper"]
    for _ in range(2 * train.TAPER_STEPS):
        taper.run(taper.prepare())
    assert taper.gates[: train.TAPER_STEPS] == taper.gates[train.TAPER_STEPS :]
    assert len(set(taper.gates)) == train.TAPER_STEPS


def test_non_finite_losses_are_flagged(tiny_llama, corpus):
    recipe = TaperNormConfig.for_model(tiny_llama, char_tokenizer())
    built = train.train_workloads(
        tiny_llama, _text_batches(corpus, recipe.sink_token_ids, count=2), recipe, learning_rate=1e-4
    )
    for name in ("normalized", "tapered"):
        with torch.no_grad():
            built[name].model.lm_head.weight.fill_(float("nan"))
        built[name].run(None)  # the controller's divergence watch stops nothing: the step is flagged
        facts = built[name].facts()
        assert not facts["losses_finite"] and math.isnan(facts["loss_median"])
    assert "not finite" in built["tapered"].facts()["divergence"]


# ----------------------------------------------------------------------------- the driver
def test_benchmark_end_to_end_writes_json_plot_and_tables(tmp_path, capsys, corpus):
    folder = save_tiny_model(tmp_path / "tiny")
    output = tmp_path / "out"
    status = runner.main(
        ["--model_name_or_path", str(folder), "--norms", "recipe", "all", "--modes", "last", "full", "decode", "train",
         "--seq_lens", "16", "--new_tokens", "3", "--warmup", "1", "--repeats", "2", "--calibration_batches", "2",
         "--threads", "1", "--dataset_name", corpus, "--output_dir", str(output)]
    )  # fmt: skip
    assert status == 0
    report = json.loads((output / "bench.json").read_text())
    assert (output / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["model_type"] == "llama" and "not meaningful" in report["note"]
    assert report["settings"]["norms"] == ["recipe", "all"] and report["environment"]["loadavg_1m"] is not None
    assert [r["case"]["mode"] for r in report["results"]] == ["last", "full", "decode", "train"]
    labels = [
        s.label for s in var.variant_specs(["original", "flashnorm", "explicit", "folded", "limit"], ["recipe", "all"])
    ]
    for result in report["results"][:3]:
        entries = result["variants"]
        assert list(entries) == labels and all(len(result["times_s"][n]) == 2 for n in labels)
        assert result["norms"] == {
            "recipe": {"removed": LAYERS, "kept": LAYERS + 1},  # the final norm removed too
            "all": {"removed": 2 * LAYERS + 1, "kept": 0},
        }
        ops = {name: entry["aten_ops"] for name, entry in entries.items()}
        # The export's LAYERS + 1 kept RMS norms are weightless: one product fewer each than in the limit.
        assert ops["recipe-folded"] == ops["recipe-limit"] - (LAYERS + 1) < ops["flashnorm"] < ops["original"]
        assert ops["all-folded"] == ops["all-limit"] < ops["recipe-folded"]
        assert ops["recipe-explicit"] <= ops["recipe-limit"] + 2 * LAYERS  # RMS at g = 0: two products per norm
        assert sorted(result["agreement"]) == [
            "all-folded_vs_all-explicit",
            "flashnorm_vs_original",
            "recipe-folded_vs_recipe-explicit",
        ]
        assert all(v["max_rel"] <= 1e-5 for v in result["agreement"].values())
        assert entries["recipe-folded"]["speedup_vs_original"] > 0 and "speed_vs_limit" in entries["all-folded"]
        assert entries["recipe-folded"]["speedup_vs_flashnorm"] > 0 and "speedup_vs_flashnorm" in entries["original"]
    train_result = report["results"][3]
    assert list(train_result["variants"]) == list(train.TRAIN_WORKLOADS)
    assert train_result["recipe"]["recipe"] == "gated-mlp" and train_result["recipe"]["sink_token_ids"] == [127]
    for name, entry in train_result["variants"].items():
        assert entry["cost_vs_normalized"] > 0 and entry["losses_finite"] and entry["aten_ops"] > 0, name
    ops = {name: entry["aten_ops"] for name, entry in train_result["variants"].items()}
    assert ops["tapered-distilled"] > ops["tapered"] and ops["taper"] > ops["warmup"]
    out = capsys.readouterr().out
    assert "speedup = original time" in out and "cost = workload step time" in out and "tapered-distilled" in out
    assert "vs flashnorm" in out and " flashnorm " in out


def _result(mode: str, entry: dict, new_tokens) -> dict:
    case = {"mode": mode, "batch": 1, "seq_len": 8, "new_tokens": new_tokens, "compiled": False}
    return {"case": case, "label": f"{mode} b1 T8", "variants": {"original": entry}, "times_s": {}}


def test_without_op_counts_the_aten_ops_column_prints_a_dash():
    """With --no_op_counts the inference and train tables printed `nan` in the aten ops column (bench.json holds no
    count); they print `-`, as every other empty column does, and a count where there is one."""
    inference = {"median_ms": 1.0, "speedup_vs_original": 1.0}
    train_entry = {"median_ms": 2.0, "cost_vs_normalized": 1.0, "gates": [], "teacher": False, "losses_finite": True}
    table = runner.format_table([_result("last", inference, None), _result("train", train_entry, None)])
    assert "nan" not in table
    rows = [line for line in table.splitlines() if line.startswith(("last b1 T8", "train b1 T8"))]
    assert len(rows) == 2 and rows[0].endswith(" -") and " - " in rows[1]
    counted = runner.format_table([_result("last", {**inference, "aten_ops": 123.0}, None)])
    assert counted.splitlines()[-1].endswith(" 123")


def test_only_decode_cases_record_new_tokens_and_older_files_still_read():
    """bench.json recorded `new_tokens: 32` (the decode default) for last, full and train cases, which decode
    nothing; they record null now, decode its --new_tokens. An older file's results (32 everywhere) still read."""
    arguments = parse_arguments(["--modes", "last", "full", "decode", "train", "--new_tokens", "5", "--threads", "1"])
    recorded = {case.mode: case.new_tokens for case in cases(arguments, "fp32", "cpu")}
    assert recorded == {"last": None, "full": None, "decode": 5, "train": None}
    decode = next(case for case in cases(arguments, "fp32", "cpu") if case.mode == "decode")
    assert decode.label() == "decode b1 T128+5 fp32 cpu 1t eager" and decode.steps == 5
    older = [_result("last", {"median_ms": 1.0, "aten_ops": 7.0}, 32)]
    assert "last b1 T8" in runner.format_table(older)


def test_non_finite_training_losses_make_the_run_fail(tmp_path, monkeypatch, capsys):
    folder = save_tiny_model(tmp_path / "tiny")
    case = {"mode": "train"}
    entry = {"median_ms": 1.0, "cost_vs_normalized": 1.0, "gates": [0.0], "teacher": False, "losses_finite": False}
    fake = [{"case": case, "label": "train b1", "variants": {"tapered": entry}, "times_s": {}}]
    monkeypatch.setattr(runner, "run_benchmark", lambda load, arguments, text: (load(torch.float32), fake)[1])
    monkeypatch.setattr(runner, "_train_text", lambda arguments, source: None)
    argv = ["--model_name_or_path", str(folder), "--modes", "train", "--seq_lens", "32", "--output_dir", str(tmp_path)]
    assert runner.main(argv) == 1  # --seq_lens within the tiny model's 64 positions (the default 128 is refused)
    assert "non-finite training losses in train b1: tapered" in capsys.readouterr().err


def test_compiled_execution_goes_through_dynamo(tmp_path):
    folder = save_tiny_model(tmp_path / "tiny")
    output = tmp_path / "out"
    runner.main(
        ["--model_name_or_path", str(folder), "--variants", "original", "limit", "--modes", "last", "decode",
         "--execution", "compile", "--compile_backend", "eager", "--seq_lens", "8", "--new_tokens", "3",
         "--warmup", "1", "--repeats", "1", "--threads", "1", "--no_op_counts", "--output_dir", str(output)]
    )  # fmt: skip
    results = json.loads((output / "bench.json").read_text())["results"]
    assert [r["case"]["compiled"] for r in results] == [True, True]
    for result in results:
        # Two variants: at least one graph each, and no graph break anywhere (static-cache decoding).
        assert result["dynamo"]["unique_graphs"] >= 2 and result["dynamo"]["graph_breaks"] == 0


def test_bf16_variants_are_loaded_not_cast_so_folded_adds_no_cast(tmp_path):
    folder = save_tiny_model(tmp_path / "tiny")
    output = tmp_path / "out"
    runner.main(
        ["--model_name_or_path", str(folder), "--norms", "internal", "--modes", "last", "--dtypes", "bf16",
         "--seq_lens", "8", "--warmup", "0", "--repeats", "1", "--threads", "1", "--output_dir", str(output)]
    )  # fmt: skip
    (result,) = json.loads((output / "bench.json").read_text())["results"]
    ops = {name: entry["aten_ops"] for name, entry in result["variants"].items()}
    assert ops["folded"] == ops["limit"] - 1 < ops["original"]  # the kept final norm is weightless in the export
    # c is kept in the weight dtype, so no cast: two multiplications per tapered norm, as in fp32.
    assert ops["explicit"] == ops["limit"] + 2 * 2 * LAYERS


# ----------------------------------------------------------------------------- bf16 autocast and ONNX Runtime
@pytest.mark.parametrize("argv, message", [
    (["--train_precisions", "bf16"], "--train_precisions must include fp32"),
    (["--train_precisions", "fp32", "fp16"], "'fp16' is none of its dtypes: give one of float32/fp32, bfloat16/bf16$"),
    (["--runtimes", "tensorrt"], "--runtimes: 'tensorrt' not among torch, onnxruntime"),
    (["--runtimes", "onnxruntime", "--variants", "explicit", "limit"], "runs the original and folded variants"),
    (["--runtimes", "onnxruntime", "--dtypes", "bf16"], "use --dtypes fp32 --devices cpu"),
    (["--runtimes", "onnxruntime", "--modes", "train"], "times inference"),
])  # fmt: skip
def test_bad_precisions_and_runtimes_fail_before_anything_loads(argv, message):
    with pytest.raises(ConfigurationError, match=message):
        parse_arguments(argv)


def test_onnxruntime_without_its_extra_is_one_line_naming_it(monkeypatch, capsys):
    from hf_tapernorm.integrations.extras import MissingExtraError

    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    with pytest.raises(
        MissingExtraError, match=r"needs onnxruntime, which is not installed: pip install 'hf-tapernorm\[onnx\]'"
    ):
        parse_arguments(["--runtimes", "onnxruntime"])
    assert cli_main(["bench", "--runtimes", "torch", "onnxruntime"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "hf-tapernorm[onnx]" in err


def test_bf16_workloads_repeat_each_phase_under_autocast(tiny_llama, corpus):
    recipe = TaperNormConfig.for_model(tiny_llama, char_tokenizer())
    built = train.train_workloads(
        tiny_llama,
        _text_batches(corpus, recipe.sink_token_ids, count=2),
        recipe,
        learning_rate=1e-4,
        names=["normalized", "tapered"],
        precisions=["fp32", "bf16"],
    )
    assert list(built) == ["normalized", "tapered", "normalized+bf16", "tapered+bf16"]
    assert train.fp32_counterpart("tapered+bf16") == "tapered" and train.fp32_counterpart("tapered") is None
    for name, workload in built.items():
        seen: list[torch.dtype] = []
        handle = workload.model.lm_head.register_forward_hook(
            lambda module, args, output, seen=seen: seen.append(output.dtype)
        )
        workload.run(workload.prepare())
        handle.remove()
        # Autocast computes in bf16; the master weights stay fp32.
        assert seen == [torch.bfloat16 if name.endswith("+bf16") else torch.float32], name
        assert all(p.dtype == torch.float32 for p in workload.model.parameters())
        assert workload.facts()["losses_finite"], name


def test_benchmark_in_onnx_runtime_and_bf16_side_by_side(tmp_path, capsys, corpus):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    folder = save_tiny_model(tmp_path / "tiny")
    output = tmp_path / "out"
    status = runner.main(
        ["--model_name_or_path", str(folder), "--modes", "last", "decode", "train", "--runtimes", "torch",
         "onnxruntime", "--train_precisions", "fp32", "bf16", "--train_workloads", "normalized", "tapered",
         "--seq_lens", "16", "--new_tokens", "3", "--warmup", "1", "--repeats", "2", "--calibration_batches", "1",
         "--threads", "1", "--dataset_name", corpus, "--output_dir", str(output)]
    )  # fmt: skip
    assert status == 0
    report = json.loads((output / "bench.json").read_text())
    for result in report["results"][:2]:
        entries = result["variants"]
        assert {"ort-original", "ort-folded"} <= set(entries)
        for name in ("ort-original", "ort-folded"):
            assert entries[name]["runtime"] == "onnxruntime" and len(result["times_s"][name]) == 2
            assert entries[name]["speedup_vs_ort-original"] > 0 and entries[name]["speedup_vs_original"] > 0
            assert result["agreement"][f"{name}_vs_{name[4:]}"]["max_abs"] <= 1e-4
        # The folded graph has fewer nodes than the original's: the recipe's norms are gone.
        assert 0 < entries["ort-folded"]["onnx_nodes"] < entries["ort-original"]["onnx_nodes"]
        assert 0 < entries["ort-folded"]["ort_nodes"] <= entries["ort-original"]["ort_nodes"]
        assert "aten_ops" not in entries["ort-folded"] and entries["folded"]["aten_ops"] > 0
    train_result = report["results"][2]
    assert list(train_result["variants"]) == ["normalized", "tapered", "normalized+bf16", "tapered+bf16"]
    assert train_result["variants"]["tapered+bf16"]["speedup_vs_fp32"] > 0
    assert isinstance(train_result["cpu_has_fast_bf16"], bool)
    out = capsys.readouterr().out
    assert "onnxruntime: speedup = ort-original" in out and "ort-folded" in out and "vs fp32" in out


def test_bench_never_writes_over_result_files_it_did_not_write(tmp_path):
    from hf_tapernorm.bench.arguments import parse_arguments

    (tmp_path / "bench.json").write_text('{"mine": 1}')
    (tmp_path / "bench.png").write_text("my picture")
    with pytest.raises(ConfigurationError, match=r"holds bench.json, bench.png that no earlier hf-tapernorm bench"):
        parse_arguments(["--output_dir", str(tmp_path)])
    (tmp_path / "bench.json").unlink()
    with pytest.raises(ConfigurationError, match=r"holds bench.png that no earlier"):
        parse_arguments(["--output_dir", str(tmp_path)])
    earlier = {"settings": {}, "results": [], "environment": {}}
    (tmp_path / "bench.json").write_text(json.dumps(earlier))  # an earlier benchmark's pair is replaced
    assert parse_arguments(["--output_dir", str(tmp_path)]).output_dir == str(tmp_path)
    assert (tmp_path / "bench.png").read_text() == "my picture" and json.loads((tmp_path / "bench.json").read_text())


# ----------------------------------------------------------------------------- where the results go
def _live_lock(folder: Path) -> None:
    """A lock of a live command (this test's parent process) in ``folder``: a taper run or a fold at work."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / LOCK_NAME).write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname()}))


def test_results_are_never_written_into_a_folder_a_running_command_holds(tmp_path, monkeypatch):
    """bench.json and bench.png were written into a running run's folder (directly, or through a link into it);
    that run's next --overwrite or --resume then refused on them."""
    model = str(save_tiny_model(tmp_path / "tiny"))
    live = tmp_path / "live"
    _live_lock(live)
    (tmp_path / "lnk").symlink_to(live / "folded", target_is_directory=True)
    (live / "folded").mkdir()
    monkeypatch.setattr(runner, "resolve_model", lambda *a, **k: pytest.fail("the model was looked up"))
    for output, where in (
        (live, "is in use: a running hf-tapernorm command owns it"),
        (live / "folded", f"lies in '{live}', which a running hf-tapernorm command owns"),
        (tmp_path / "lnk" / "sub", f"lies in '{live}', which a running hf-tapernorm command owns"),
    ):
        with pytest.raises(ConfigurationError, match=f"--output_dir '{output}' {where}") as refusal:
            runner.main(["--model_name_or_path", model, "--output_dir", str(output)])
        assert str(refusal.value).endswith("wait for it to finish, or choose another --output_dir")
    assert sorted(p.relative_to(live).as_posix() for p in live.rglob("*")) == [LOCK_NAME, "folded"]
    assert cli_main(["bench", "--model_name_or_path", model, "--output_dir", str(live)]) == 2


def test_an_output_dir_that_cannot_be_written_is_refused_before_loading(tmp_path, monkeypatch, capsys):
    """A file on the way to --output_dir, or a folder that cannot be created there: a traceback after every case
    had been timed."""
    model = str(save_tiny_model(tmp_path / "tiny"))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("text\n")
    monkeypatch.setattr(runner, "resolve_model", lambda *a, **k: pytest.fail("the model was looked up"))
    capsys.readouterr()
    assert cli_main(["bench", "--model_name_or_path", model, "--output_dir", str(corpus / "sub")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"hf-tapernorm bench: error: --output_dir '{corpus / 'sub'}': '{corpus}' is a file"
    )
    if not Path("/sys/kernel").is_dir():
        pytest.skip("no sysfs here: no folder that even root cannot create a folder in")
    assert cli_main(["bench", "--model_name_or_path", model, "--output_dir", "/sys/benchx"]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("hf-tapernorm bench: error: cannot write into output folder '/sys/benchx': "), line
    assert line.endswith("; choose a writable --output_dir") and "\n" not in line


def test_bench_reads_a_tilde_output_dir_as_home_and_an_unreadable_one_in_one_line(tmp_path, monkeypatch):
    """``bench --output_dir '~/b'`` wrote into a folder literally named ``~``; under a folder this user cannot read
    (``/root`` as another user) it ended in a PermissionError traceback."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "home").mkdir()
    assert parse_arguments(["--output_dir", "~/b"]).output_dir == str(tmp_path / "home" / "b")
    closed = tmp_path / "closed"
    exists = Path.exists

    def denied(self, *args, **kwargs):
        if self.is_relative_to(closed) and self != closed:
            raise PermissionError(13, "Permission denied", str(self))
        return exists(self, *args, **kwargs)

    monkeypatch.setattr(Path, "exists", denied)
    with pytest.raises(ConfigurationError) as refused:
        parse_arguments(["--output_dir", str(closed / "b")])
    assert str(refused.value) == (
        f"--output_dir '{closed / 'b'}': cannot read the folder '{closed / 'b'}' (Permission denied); choose a "
        "folder you can read and write"
    )
    assert not (tmp_path / "~").exists()


def test_the_train_mode_trains_on_a_text_too_small_to_hold_out(tmp_path):
    """bench --modes train on one long paragraph (or a few documents) was refused after the model loaded: "its
    held-out split does not fill one block ... use a smaller --block_size or --sample_by line", options bench does not
    have, for a held-out split it never reads. Its batches now come from every document, with no held-out split."""
    import datasets

    one_paragraph = datasets.Dataset.from_dict({"text": ["a long paragraph of text " * 40]})
    batches = train.text_batches(
        one_paragraph, char_tokenizer(), batch=2, seq_len=32, count=2, prefix_ids=[1], source="onedoc.txt"
    )
    assert [tuple(b["input_ids"].shape) for b in batches] == [(2, 32), (2, 32)]
    assert all((b["input_ids"][:, 0] == 1).all() and b["labels"].shape == (2, 32) for b in batches)


def test_a_text_too_short_for_the_train_mode_is_refused_before_loading(tmp_path, monkeypatch, capsys, caplog):
    """bench --modes train on a 19-character text loaded the model, logged a WARNING that the blocks "will repeat",
    then refused the text for holding too few blocks. The blocks are now counted with the tokenizer, behind the
    recipe's sink prefix, before the model loads, and the refusal is the only word."""
    folder = save_tiny_model(tmp_path / "tiny")
    short = tmp_path / "short.txt"
    short.write_text("a short text here.\n")
    monkeypatch.setattr(runner, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    argv = ["bench", "--model_name_or_path", str(folder), "--modes", "train", "--dataset_name", str(short)]
    argv += ["--seq_lens", "16", "--batch_sizes", "1", "--output_dir", str(tmp_path / "out")]
    assert cli_main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"hf-tapernorm bench: error: dataset '{short}' holds 1 blocks of 16 tokens; the train mode needs 5 "
        "(--batch_sizes x (1 + --calibration_batches))"
    )
    assert not [record for record in caplog.records if "will repeat" in record.getMessage()]
    assert not (tmp_path / "out" / "bench.json").exists()


def test_a_text_filling_no_block_for_the_train_mode_is_refused_in_benchs_words(tmp_path, monkeypatch, capsys):
    """bench --modes train on a text that fills not one block of --seq_lens was refused in taper's words ("its
    training split (0% of documents held out) ... use more text or a smaller --block_size"): bench has neither a
    held-out split nor --block_size. The refusal now names --seq_lens and the blocks the train mode needs."""
    folder = save_tiny_model(tmp_path / "tiny")
    short = tmp_path / "short.txt"
    short.write_text("a short text here.\n")
    monkeypatch.setattr(runner, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    argv = ["bench", "--model_name_or_path", str(folder), "--modes", "train", "--dataset_name", str(short)]
    argv += ["--seq_lens", "32", "--batch_sizes", "1", "--output_dir", str(tmp_path / "out")]
    assert cli_main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"hf-tapernorm bench: error: dataset '{short}' does not fill one block of --seq_lens 32 tokens; the train "
        "mode needs 5 (--batch_sizes x (1 + --calibration_batches)): use more text or a smaller --seq_lens"
    )
    assert not (tmp_path / "out" / "bench.json").exists()


def test_the_train_mode_of_a_trainer_checkpoint_reads_its_runs_tokenizer(tmp_path, monkeypatch, capsys):
    """bench --modes train of a --baseline run's baseline/checkpoint-N (no tokenizer files, as the Trainer saves it)
    was refused "cannot load a tokenizer ...: it holds no tokenizer files", where eval and fold of the same folder
    find the run's. bench takes the run's tokenizer as they do: here the text is counted with it, before loading."""
    from hf_tapernorm.app.run_folder import MANIFEST_NAME

    model = save_tiny_model(tmp_path / "tiny")
    checkpoint = tmp_path / "run" / "baseline" / "checkpoint-6"
    checkpoint.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        (checkpoint / name).write_bytes((model / name).read_bytes())
    manifest = {"tool": "hf-tapernorm", "identity": {"model": str(model)}, "files": []}
    (tmp_path / "run" / MANIFEST_NAME).write_text(json.dumps(manifest))
    short = tmp_path / "short.txt"
    short.write_text("a short text here.\n")
    monkeypatch.setattr(runner, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    argv = ["bench", "--model_name_or_path", str(checkpoint), "--modes", "train", "--dataset_name", str(short)]
    argv += ["--seq_lens", "16", "--batch_sizes", "1", "--output_dir", str(tmp_path / "out")]
    assert cli_main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"hf-tapernorm bench: error: dataset '{short}' holds 1 blocks of 16 tokens; the train mode needs 5 "
        "(--batch_sizes x (1 + --calibration_batches))"
    )


def test_a_full_disk_while_the_variants_are_saved_is_one_line_naming_the_temporary_folder(
    tmp_path, monkeypatch, capsys
):
    """bench saves each variant and loads it back from the system's temporary folder; a full disk there (or a
    file-size limit) ended in a traceback naming a file of a folder already gone, where fold and taper say so in one
    line. It is one line naming the temporary folder and how to point it elsewhere (TMPDIR)."""
    import errno
    import tempfile

    model = str(save_tiny_model(tmp_path / "tiny"))
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))

    def full(model, folder, *args):
        raise OSError(errno.EFBIG, "File too large", str(folder / "model.safetensors"))

    monkeypatch.setattr(var, "_reloaded", full)
    argv = ["bench", "--model_name_or_path", model, "--modes", "last", "--batch_sizes", "1", "--seq_lens", "16"]
    capsys.readouterr()
    assert cli_main([*argv, "--warmup", "1", "--repeats", "1", "--calibration_batches", "1"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"hf-tapernorm bench: error: the temporary folder {temporary}: its disk could not take the benchmark's saved "
        "models (OSError: [Errno 27] File too large); free space there (or lift the file-size limit), or set TMPDIR "
        "to a folder on another disk"
    )
    assert not any(temporary.iterdir())


def test_bench_folds_a_tied_model_without_fold_s_advice_as_a_warning(tmp_path, caplog):
    """bench of a model with tied embeddings warned twice that "the head is untied ... (pass tied_head='scale' to
    keep the tie)": advice for fold_model's callers, which no bench option follows (bench keeps no export). While
    bench folds it is INFO; fold_model called by a user still warns."""
    import logging

    from hf_tapernorm.export.folding import flashnorm_model

    def tied():
        return build(tiny_llama_config(tie_word_embeddings=True), seed=0)

    with caplog.at_level(logging.INFO, logger="hf_tapernorm"):
        var.flashnorm_reload(tied(), tmp_path / "flashnorm", torch.float32, "cpu")
    untied = [record for record in caplog.records if "folds into a tied lm_head" in record.getMessage()]
    assert untied and all(record.levelno == logging.INFO for record in untied)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hf_tapernorm"):
        flashnorm_model(tied())
    assert any(r.levelno == logging.WARNING and "folds into a tied lm_head" in r.getMessage() for r in caplog.records)
