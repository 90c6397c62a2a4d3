"""The benchmark's plumbing on tiny random models: every variant runs, outputs agree, op counts hold.

Speed targets are checked by running the benchmark on the real model, never by timed tests.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from hf_tapernorm import gate_of, is_patched, taper_norms
from hf_tapernorm.bench import runner as bench
from hf_tapernorm.architectures.table import architecture_for
from hf_tapernorm.architectures.sites import norm_sites

from .conftest import build, random_batches, tiny_gpt2_config, tiny_llama_config

CONFIGS = {"llama": tiny_llama_config, "gpt2": tiny_gpt2_config}


def _saved_tiny(tmp_path, arch: str) -> str:
    folder = tmp_path / f"tiny_{arch}"
    build(CONFIGS[arch]()).save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_benchmark_end_to_end_writes_json_plot_and_table(tmp_path, capsys, arch):
    variants = ["original", "explicit", "folded", "limit", "all-explicit", "all-folded", "all-limit"]
    output = tmp_path / "out"
    status = bench.main(
        ["--model_name_or_path", _saved_tiny(tmp_path, arch), "--variants", *variants,
         "--modes", "last", "full", "decode", "train", "--seq_lens", "8", "--new_tokens", "3",
         "--warmup", "1", "--repeats", "2", "--calibration_batches", "2", "--threads", "1",
         "--output_dir", str(output)]
    )  # fmt: skip
    assert status == 0
    report = json.loads((output / "bench.json").read_text())
    assert (output / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["model_type"] == arch and "not meaningful" in report["note"]
    assert [r["case"]["mode"] for r in report["results"]] == ["last", "full", "decode", "train"]

    n_internal = 2 * CONFIGS[arch]().num_hidden_layers
    for result in report["results"]:
        entries = result["variants"]
        expected = bench.TRAIN_VARIANTS if result["case"]["mode"] == "train" else variants
        assert sorted(entries) == sorted(expected)
        for name, entry in entries.items():
            assert len(result["times_s"][name]) == 2 and entry["median_ms"] > 0
            assert entry["speedup_vs_original"] > 0 and entry["aten_ops"] > 0
        if result["case"]["mode"] == "train":
            continue
        ops = {name: entry["aten_ops"] for name, entry in entries.items()}
        assert ops["limit"] < ops["original"] and ops["all-limit"] < ops["limit"]
        if arch == "llama":  # RMS form at g = 0: two multiplications per tapered norm, nothing else
            assert ops["explicit"] <= ops["limit"] + 2 * n_internal
            assert ops["all-explicit"] <= ops["all-limit"] + 2 * (n_internal + 1)
        assert ops["folded"] == ops["limit"]
        # A folded final LayerNorm leaves its beta as a bias of lm_head: the one addition it needs.
        assert ops["all-folded"] == ops["all-limit"] + (1 if arch == "gpt2" else 0)
        assert sorted(result["agreement"]) == ["all-folded_vs_all-explicit", "folded_vs_explicit"]
        for key, value in result["agreement"].items():
            assert value["max_rel"] <= 1e-5 and value["finite_fraction"] == 1.0, (key, value)
        assert "speed_vs_limit" in entries["folded"]

    table = capsys.readouterr().out
    for name in variants + list(bench.TRAIN_VARIANTS):
        assert name in table
    assert "wrote" in table and "bench.json" in table


def test_limit_copy_replaces_exactly_the_norms_the_scope_tapers(tiny_llama):
    arch = architecture_for("llama")
    sites = list(norm_sites(tiny_llama, arch))
    internal = bench.limit_copy(tiny_llama, "internal")
    everything = bench.limit_copy(tiny_llama, "all")
    for site in sites:
        path, is_final = site.path, site.is_final
        assert isinstance(internal.get_submodule(path), nn.Identity) != is_final
        assert isinstance(everything.get_submodule(path), nn.Identity)
        assert not isinstance(tiny_llama.get_submodule(path), nn.Identity)  # the source is untouched
    assert internal.lm_head.weight.data_ptr() != tiny_llama.lm_head.weight.data_ptr()
    torch.testing.assert_close(internal.lm_head.weight, tiny_llama.lm_head.weight, rtol=0, atol=0)


def test_attn_variants_keep_the_norms_that_feed_gated_mlps(tiny_llama, tmp_path):
    names = ["attn-explicit", "attn-folded", "attn-limit"]
    variants = bench.build_variants(tiny_llama, names, calibration_batches=random_batches(n=2), workdir=tmp_path)
    kept = {f"model.layers.{i}.post_attention_layernorm" for i in range(2)} | {"model.norm"}
    for path in (site.path for site in norm_sites(tiny_llama, architecture_for("llama"))):
        assert isinstance(variants["attn-limit"].get_submodule(path), nn.Identity) != (path in kept)
        assert isinstance(variants["attn-folded"].get_submodule(path), nn.Identity) != (path in kept)
    assert variants["attn-folded"].config.kept_norms == sorted(kept - {"model.norm"}) + ["model.norm"]
    ids = random_batches(n=1, batch=1)[0]
    assert bench.agreement(variants, ids)["attn-folded_vs_attn-explicit"]["max_rel"] <= 1e-5


def test_calibrated_copy_is_at_gate_zero_and_leaves_the_source_alone(tiny_llama):
    explicit = bench.calibrated_copy(tiny_llama, "internal", random_batches(n=2))
    assert gate_of(explicit) == 0.0 and not explicit.training
    assert all(layer.is_calibrated for _, layer in taper_norms(explicit) if layer.tapered)
    assert not is_patched(tiny_llama)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_decode_workload_is_greedy_generation(arch):
    model = build(CONFIGS[arch]())
    ids = random_batches(batch=2, length=6, n=1)[0]
    expected = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6, do_sample=False
    )[:, ids.shape[1]:]
    for static in (False, True):
        workload = bench._Decode(model, model, ids, 5, static=static)
        cache, first = workload.prepare()  # the prefill's token, then 5 cached decoding steps
        tokens = torch.cat([first, workload.run((cache, first))], 1)
        assert torch.equal(tokens, expected), f"static cache: {static}"


class _Recorder(bench.Workload):
    def __init__(self, name, log):
        self.name, self.log = name, log

    def prepare(self):
        self.log.append(("prepare", self.name))

    def run(self, state):
        self.log.append(("run", self.name))


def test_interleaving_rotates_the_order_and_prepares_untimed():
    log: list = []
    workloads = {name: _Recorder(name, log) for name in "abc"}
    times = bench.interleaved_times(workloads, warmup=1, repeats=3, device="cpu", progress=False)
    assert {name: len(series) for name, series in times.items()} == {"a": 3, "b": 3, "c": 3}
    runs = [name for kind, name in log if kind == "run"]
    assert runs == list("abc" "abc" "bca" "cab")  # warm-up, then each repeat starts one later
    assert all(log[i] == ("prepare", log[i + 1][1]) for i in range(0, len(log), 2))


def test_median_of_pair_ratios():
    assert bench.median_ratio([2.0, 3.0, 10.0], [1.0, 2.0, 2.0]) == 2.0
    # A load spike that hits both members of a pair cancels out; the medians of times would not.
    assert bench.median_ratio([1.0, 5.0, 1.0], [0.5, 2.5, 0.5]) == 2.0


def test_train_workloads_drive_the_gate_of_a_patched_copy(tiny_llama):
    ids = random_batches(n=1)[0]
    workloads = bench.train_workloads(tiny_llama, ids, random_batches(n=2))
    assert not is_patched(workloads["original"].model)
    patched = workloads["taper"].model
    assert patched is workloads["tapered"].model and patched.training
    before = [p.detach().clone() for p in patched.parameters()]
    loss = workloads["taper"].run(None)
    assert torch.isfinite(loss) and 0.0 < gate_of(patched) < 1.0
    assert any(not torch.equal(a, b) for a, b in zip(before, patched.parameters()))  # the optimizer stepped
    workloads["tapered"].run(None)
    assert gate_of(patched) == 0.0
    workloads["original"].run(None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given when CUDA is absent")
def test_cuda_requested_without_cuda_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="device 'cuda' requested but CUDA is not available"):
        bench.main(["--devices", "cuda", "--output_dir", str(tmp_path)])


def test_parser_defaults_are_the_documented_benchmark():
    args = bench.build_parser().parse_args([])
    assert args.variants == ["original", "explicit", "folded", "limit"]
    assert args.modes == ["last", "decode"] and args.dtypes == ["fp32"] and args.execution == ["eager"]
    assert args.model_name_or_path is None  # the embedded SmolLM2-135M


def test_compiled_execution_goes_through_dynamo(tmp_path):
    output = tmp_path / "out"
    bench.main(
        ["--model_name_or_path", _saved_tiny(tmp_path, "llama"), "--variants", "original", "limit",
         "--modes", "last", "decode", "--execution", "compile", "--compile_backend", "eager", "--seq_lens", "8",
         "--new_tokens", "3", "--warmup", "1", "--repeats", "1", "--threads", "1", "--no_op_counts",
         "--output_dir", str(output)]
    )  # fmt: skip
    results = json.loads((output / "bench.json").read_text())["results"]
    assert [r["case"]["compiled"] for r in results] == [True, True]
    for result in results:
        # Two variants: at least one graph each, and no graph break anywhere (static-cache decoding).
        assert result["dynamo"]["unique_graphs"] >= 2 and result["dynamo"]["graph_breaks"] == 0


def test_an_overflowing_untrained_model_still_folds_and_is_compared_where_finite(tiny_llama, tmp_path, caplog):
    explicit = bench.calibrated_copy(tiny_llama, "internal", random_batches(n=2))
    with torch.no_grad():
        for _, layer in taper_norms(explicit):
            if layer.tapered:
                layer.taper_weight.mul_(1e20)  # the residual stream overflows, as SmolLM2 does untrained
    folded = bench.folded_reload(explicit, tmp_path / "folded", torch.float32, "cpu")
    assert "non-finite logits" in caplog.text
    ids = random_batches(n=1, batch=1)[0]
    result = bench.agreement({"explicit": explicit, "folded": folded}, ids)["folded_vs_explicit"]
    assert result["finite_fraction"] < 1.0 and result["same_nonfinite"]


def test_bf16_variants_are_loaded_not_cast_so_folded_matches_the_limit(tmp_path):
    output = tmp_path / "out"
    bench.main(
        ["--model_name_or_path", _saved_tiny(tmp_path, "llama"), "--variants", "original", "explicit", "folded",
         "limit", "--modes", "last", "--dtypes", "bf16", "--seq_lens", "8", "--warmup", "0", "--repeats", "1",
         "--threads", "1", "--output_dir", str(output)]
    )  # fmt: skip
    (result,) = json.loads((output / "bench.json").read_text())["results"]
    ops = {name: entry["aten_ops"] for name, entry in result["variants"].items()}
    assert ops["folded"] == ops["limit"] < ops["original"]
    # c is kept in the weight dtype, so no cast: two multiplications per tapered norm, as in fp32.
    assert ops["explicit"] == ops["limit"] + 2 * 2 * tiny_llama_config().num_hidden_layers
