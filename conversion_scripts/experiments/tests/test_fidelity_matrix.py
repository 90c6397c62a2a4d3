"""The fidelity harness (conversion_scripts/fidelity_matrix.py) on a tiny model: arms x seeds, reuse, table."""

from __future__ import annotations

import json

import pytest

import hf_tapernorm
from conversion_scripts.experiments import fidelity_matrix
from tests.conftest import corpus_documents, save_tiny_model


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("matrix")
    save_tiny_model(root / "llama", "llama")
    (root / "corpus.txt").write_text("\n\n".join(corpus_documents(150)))
    return root


def tiny_flags(ws) -> list[str]:
    return [
        "--model_name_or_path", str(ws / "llama"), "--dataset_name", str(ws / "corpus.txt"),
        "--block_size", "32", "--per_device_train_batch_size", "2", "--heldout_blocks", "8",
        "--out_of_corpus_blocks", "8", "--heldout_percentage", "10", "--use_cpu", "--disable_tqdm", "true",
        "--data_cache_dir", str(ws / "cache"), "--taper_start", "2", "--taper_end", "4",
    ]  # fmt: skip


def test_matrix_runs_each_arm_and_seed_once_reuses_the_baseline_and_writes_the_table(workspace, capsys):
    root = workspace / "runs"
    argv = ["--root", str(root), "--preset", "gpu", "--steps", "6", "--seeds", "1", "2", "--jobs", "2"]
    argv += ["--arms", "default", "no_distill", *tiny_flags(workspace)]
    assert fidelity_matrix.main(argv) == 0
    for arm in ("default", "no_distill"):
        for seed in (1, 2):
            folder = root / "steps6" / arm / f"seed{seed}"
            report = json.loads((folder / "report.json").read_text())
            assert report["status"] == "finished" and report["training"]["steps"] == 6
            assert (folder / "folded" / "config.json").is_file()
            assert (folder / "baseline").exists() == (arm == "default")  # trained once per seed
            assert not list(folder.glob("checkpoint-*")) and not list(folder.glob("baseline/checkpoint-*"))
    assert (root / "steps6" / "default" / "seed1" / "baseline" / "model" / "config.json").is_file()  # read later
    # The reused baseline is the default arm's, seed by seed: the same baseline loss in both arms.
    for seed in (1, 2):
        default = json.loads((root / "steps6" / "default" / f"seed{seed}" / "report.json").read_text())
        plain = json.loads((root / "steps6" / "no_distill" / f"seed{seed}" / "report.json").read_text())
        assert plain["heldout"]["baseline"]["loss"] == pytest.approx(default["heldout"]["baseline"]["loss"], rel=1e-6)
        assert plain["taper"]["distill_weight"] == 0.0
    assert {json.loads((root / "steps6" / "default" / f"seed{s}" / "report.json").read_text())["heldout"]["baseline"][
        "loss"] for s in (1, 2)} .__len__() == 2  # fmt: skip  # two seeds, two baselines
    rows = {row["arm"]: row for row in json.loads((root / "steps6" / "table.json").read_text())}
    gaps = [rows["default"]["seeds"][str(s)]["tapered_vs_baseline"] for s in (1, 2)]
    assert rows["default"]["tapered_vs_baseline"]["mean"] == pytest.approx(sum(gaps) / 2)
    assert rows["default"]["tapered_vs_baseline"]["spread"] == pytest.approx(abs(gaps[0] - gaps[1]) / 2)
    for seed in ("1", "2"):  # both sets' broken blocks counted, from the reports
        assert all(
            isinstance(rows["default"]["seeds"][seed][key], int) for key in ("broken_blocks", "ooc_broken_blocks")
        )
    assert "--bf16" in rows["no_distill"]["commands"][0] and "--baseline_from" in rows["no_distill"]["commands"][0]
    table = (root / "steps6" / "table.md").read_text()
    assert "| no_distill | no distillation term (so no sink-attention term) | 2 |" in table and "## Commands" in table
    # Resumable: a second call finds every run finished and only writes the table again.
    before = {p: p.stat().st_mtime_ns for p in root.glob("steps6/*/seed*/report.json")}
    assert fidelity_matrix.main(argv) == 0
    assert before == {p: p.stat().st_mtime_ns for p in root.glob("steps6/*/seed*/report.json")}


def test_a_time_budget_shortens_the_matrix_from_a_timed_probe(workspace, caplog):
    root = workspace / "budget"
    argv = ["--root", str(root), "--preset", "gpu", "--steps", "60", "--seeds", "1", "--time_budget_s", "1"]
    argv += ["--arms", "default", "--keep_checkpoints", *tiny_flags(workspace)]
    with caplog.at_level("INFO", logger="fidelity_matrix"):
        assert fidelity_matrix.main(argv) == 0
    # The probe (a tenth of the asked steps, with its baseline) already spends the budget: the runs take its length.
    probe = json.loads((root / "probe" / "steps6" / "default" / "seed1" / "report.json").read_text())
    assert probe["status"] == "finished" and probe["training"]["steps"] == 6
    assert any("steps fit the budget (asked 60)" in r.getMessage() for r in caplog.records)
    report = json.loads((root / "steps6" / "default" / "seed1" / "report.json").read_text())
    assert report["status"] == "finished" and report["training"]["steps"] == 6
    assert not (root / "steps60").exists()
    folder = root / "steps6" / "default" / "seed1"
    assert (folder / "checkpoint-6").is_dir() and (folder / "baseline" / "checkpoint-6").is_dir()  # kept
    assert [row["arm"] for row in json.loads((root / "steps6" / "table.json").read_text())] == ["default"]


def test_the_control_holds_the_gate_at_1_and_without_the_loss_terms_is_the_baseline(workspace):
    root = workspace / "control"
    argv = ["--root", str(root), "--preset", "gpu", "--steps", "6", "--seeds", "1", "--jobs", "1"]
    assert fidelity_matrix.main([*argv, "--arms", "default", "kl_control", *tiny_flags(workspace)]) == 0
    default = json.loads((root / "steps6" / "default" / "seed1" / "report.json").read_text())
    folder = root / "steps6" / "kl_control" / "seed1"
    control = json.loads((folder / "report.json").read_text())
    assert control["status"] == "finished" and control["training"]["steps"] == 6
    assert not list(folder.glob("checkpoint-*"))  # scored once, its checkpoints removed
    for key in ("heldout", "out_of_corpus"):  # the same blocks and the same baseline as the run it controls
        for name in ("original", "baseline"):
            assert control[key][name]["loss"] == pytest.approx(default[key][name]["loss"], rel=1e-6)
    assert control["taper"]["distill_weight"] == default["taper"]["distill_weight"] > 0
    rows = {row["arm"]: row for row in json.loads((root / "steps6" / "table.json").read_text())}
    held = control["heldout"]
    assert rows["kl_control"]["tapered_vs_baseline"]["mean"] == pytest.approx(
        held["control"]["loss"] / held["baseline"]["loss"] - 1
    )
    assert rows["kl_control"]["folded_vs_tapered"]["mean"] is None
    assert "python -m conversion_scripts.experiments.kl_control" in rows["kl_control"]["commands"][0]

    # Without the distillation and the scale loss, the control trains what the baseline trains: gate 1 is the norm.
    from conversion_scripts.experiments import kl_control

    plain = workspace / "control_plain"
    flags = ["--output_dir", str(plain), "--max_steps", "6", "--seed", "1", *tiny_flags(workspace)]
    flags += [
        "--distill_weight",
        "0",
        "--scale_loss_weight",
        "0",
        "--baseline_from",
        str(folder.parent.parent / "default" / "seed1"),
    ]
    assert kl_control.main(flags) == 0
    plain_held = json.loads((plain / "report.json").read_text())["heldout"]
    assert plain_held["control"]["loss"] == pytest.approx(plain_held["baseline"]["loss"], rel=1e-4)
    assert control["scheduled_gates"][0] == 1.0 and control["scheduled_gates"][-1] == 0.0
    assert any(step.get("distill", 0.0) > 0 for step in control["history"])  # the term acted on the control
    with pytest.raises(hf_tapernorm.ConfigurationError, match="already holds a report: pass --overwrite"):
        kl_control.main(flags)


def test_the_default_arm_trains_with_the_sink_attention_term_and_the_unremedied_arm_without(workspace):
    root = workspace / "sink"
    argv = ["--root", str(root), "--preset", "gpu", "--steps", "6", "--seeds", "1", "--jobs", "1"]
    assert fidelity_matrix.main([*argv, "--arms", "default", "no_runaway_remedy", *tiny_flags(workspace)]) == 0
    default = json.loads((root / "steps6" / "default" / "seed1" / "report.json").read_text())
    logged = [entry["sink_attention"] for entry in default["history"] if "sink_attention" in entry]
    assert logged and max(logged) > 0  # the term acted once the teacher existed
    last = default["history"][-1]  # its ce is the cross-entropy alone, every term taken out
    terms = sum(last.get(key, 0.0) for key in ("scale_loss", "distill", "sink_attention"))
    assert last["ce"] == pytest.approx(last["loss"] - terms, rel=1e-6)
    plain = json.loads((root / "steps6" / "no_runaway_remedy" / "seed1" / "report.json").read_text())
    assert not any("sink_attention" in entry for entry in plain["history"])
    assert plain["taper"]["keep_norms"] == ["model.layers.*.post_attention_layernorm"]
    rows = {row["arm"]: row for row in json.loads((root / "steps6" / "table.json").read_text())}
    assert "--sink_attention_weight 0" in rows["no_runaway_remedy"]["commands"][0]
    assert rows["default"]["folded_vs_tapered"]["mean"] == pytest.approx(0.0, abs=1e-4)


def test_removing_checkpoints_deletes_only_the_run_s_own_checkpoint_folders(tmp_path):
    run = tmp_path / "run"
    for checkpoint in (run / "checkpoint-3", run / "baseline" / "checkpoint-3"):
        checkpoint.mkdir(parents=True)
        (checkpoint / "optimizer.pt").write_bytes(b"x" * 100)
    (run / "tapered").mkdir()
    (run / "tapered" / "model.safetensors").write_bytes(b"y")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "optimizer.pt").write_bytes(b"z")
    (run / "checkpoint-9").symlink_to(elsewhere, target_is_directory=True)
    assert fidelity_matrix.remove_checkpoints(run) == 200
    assert not (run / "checkpoint-3").exists() and not (run / "baseline" / "checkpoint-3").exists()
    assert (run / "tapered" / "model.safetensors").is_file() and (elsewhere / "optimizer.pt").is_file()
    assert (run / "checkpoint-9").is_symlink()  # a link is never followed nor removed


def test_an_arm_s_flags_replace_the_preset_s_so_each_option_appears_once(tmp_path):
    preset = fidelity_matrix.PRESETS["cpu"].flags
    command = fidelity_matrix.command_for(tmp_path, 300, "block_256", 42, preset, ["--eval_batch_size", "4"])
    options = [word for word in command if word.startswith("--")]
    assert len(options) == len(set(options))
    value = {option: command[command.index(option) + 1] for option in ("--block_size", "--per_device_train_batch_size")}
    assert value == {"--block_size": "256", "--per_device_train_batch_size": "1"}
    assert command[-1] == "--baseline" and "--eval_batch_size" in command  # own baseline; extra flags kept
    plain = fidelity_matrix.command_for(tmp_path, 300, "default", 42, preset, [])
    assert plain[plain.index("--block_size") + 1] == "128"  # an arm that sets nothing keeps the preset
    mine = fidelity_matrix.command_for(tmp_path, 300, "default", 42, preset, ["--block_size", "64"])
    assert mine.count("--block_size") == 1 and mine[mine.index("--block_size") + 1] == "64"  # extra over preset


def test_an_arm_that_overrides_one_option_keeps_the_preset_s_value_less_flags():
    preset = fidelity_matrix.PRESETS["gpu"].flags  # "--bf16" takes no value
    kept = fidelity_matrix.without_options(preset, ("--block_size", "256"))
    assert kept == ["--per_device_train_batch_size", "64", "--bf16", "--eval_batch_size", "32"]


def test_an_arm_reads_the_baseline_of_the_arm_it_names_and_the_matrix_refuses_a_missing_one(tmp_path, monkeypatch):
    command = fidelity_matrix.command_for(tmp_path, 600, "final_norm_fixed_anchor", 7, (), [])
    assert command[command.index("--baseline_from") + 1] == str(tmp_path / "steps600" / "final_norm" / "seed7")
    monkeypatch.setitem(fidelity_matrix.ARMS, "sink_attention", fidelity_matrix.ARMS["sink_attention"])
    launched = []
    monkeypatch.setattr(fidelity_matrix, "launch", lambda *a, **k: launched.append(a) or 0)
    with pytest.raises(SystemExit, match=r"\['sink_attention'\] read the final_norm arm's baseline \(seeds \[42\]\)"):
        fidelity_matrix.main(
            ["--root", str(tmp_path), "--steps", "600", "--seeds", "42", "--arms", "sink_attention"]
            + ["--baseline_of", "final_norm"]
        )
    assert launched == []
