"""Which files ``push`` uploads: exactly the export's manifest (by a symbolic link or a trailing slash too), files the
export did not write only when ``--include`` names them (a pattern or a literal name), nothing from an export without
a manifest.

The Hub is never reached: ``HfApi`` is replaced by a stand-in that applies the same ``allow_patterns`` filter as
``upload_folder``. test_publishing.py checks the weights pushed are the ones the export wrote.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from hf_tapernorm._temporaries import process_command
from hf_tapernorm.errors import ConfigurationError
from hf_tapernorm.export.hub import files_to_push
from tests.helpers import copy_run as copy_of
from tests.helpers import error_of, finished_run, one_model_workspace, run_main
from tests.helpers import short_taper_argv as taper


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    return one_model_workspace(tmp_path_factory.mktemp("push_files"))


@pytest.fixture(scope="module")
def run(ws) -> Path:
    """A finished 6-step run; the cases push its folded/ export, or a copy they edit."""
    return finished_run(taper(ws, ws / "run"))


@pytest.fixture(scope="module")
def reference(run) -> Path:
    """The finished run, as the cases that copy its export call it."""
    return run


def _push(folder, repo: str, *extra: str) -> int:
    return run_main(["push", "--export_dir", str(folder), "--repo_id", repo, *extra])[0]


def test_push_uploads_exactly_the_manifest_by_a_symlink_or_a_trailing_slash(run, tmp_path, hub):
    manifest = json.loads((run / "folded" / ".hf_tapernorm_export.json").read_text())["files"]
    (tmp_path / "link").symlink_to(run / "folded", target_is_directory=True)
    assert _push(run / "folded", "me/plain") == 0
    assert _push(tmp_path / "link", "me/link") == 0
    assert _push(str(run / "folded") + "/", "me/slash") == 0
    assert hub.sent["me/plain"] == hub.sent["me/link"] == hub.sent["me/slash"] == sorted(manifest)


def test_push_export_reads_a_home_path_as_the_home_folder(run, tmp_path, hub, monkeypatch):
    """push_export('~/exp', ...) refused an export that was there ("has no export manifest"): '~' was a folder
    name."""
    from hf_tapernorm.export.hub import push_export

    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copytree(run / "folded", tmp_path / "exp")
    push_export("~/exp", "me/home")
    assert hub.sent["me/home"] == sorted(
        json.loads((tmp_path / "exp" / ".hf_tapernorm_export.json").read_text())["files"]
    )


def test_push_export_takes_private_and_create_pr_as_true_or_false(run, hub):
    """push_export(..., private="no") passed the text to create_repo unchecked ("no" is true to Python, and what the
    Hub makes of a text is not ours to guess), then uploaded. A flag that is no bool is refused before anything is
    created, as export_folded's overwrite= is; a numpy or one-element torch bool is its value. Without private=,
    the repository was left to the Hub's default (public for a user) where `hf-tapernorm push` makes it private; it
    is private."""
    import numpy
    import torch

    from hf_tapernorm.export.hub import push_export

    for flag, value in (("private", "no"), ("private", 0), ("create_pr", "false")):
        with pytest.raises(ConfigurationError) as refused:
            push_export(run / "folded", "me/flags", **{flag: value})
        assert str(refused.value) == f"push_export: {flag}= must be True or False, got {type(value).__name__}"
    assert hub.created == [] and hub.uploads == []
    push_export(run / "folded", "me/flags", private=numpy.bool_(False), create_pr=torch.tensor(True))
    assert hub.created == [("me/flags", {"private": False, "exist_ok": True, "repo_type": "model"})]
    assert hub.uploads[0]["create_pr"] is True
    push_export(run / "folded", "me/default")
    assert hub.created[-1] == ("me/default", {"private": True, "exist_ok": True, "repo_type": "model"})


def test_push_include_names_a_file_literally_and_star_means_everything(run, tmp_path, hub):
    folder = copy_of(run, tmp_path)
    (folder / "folded" / "[tokenizer].json").write_text("{}")
    (folder / "folded" / "samples").mkdir()
    (folder / "folded" / "samples" / "a.txt").write_text("sample")
    assert _push(folder / "folded", "me/literal", "--include", "[tokenizer].json", "samples/*") == 0
    assert {"[tokenizer].json", "samples/a.txt"} <= set(hub.sent["me/literal"])
    assert _push(folder / "folded", "me/all", "--include", "*") == 0
    assert set(hub.sent["me/all"]) == set(hub.sent["me/literal"])


def test_push_include_names_a_path_in_the_export_never_a_file_name_in_a_subfolder(run, tmp_path, hub, caplog):
    """``--include extra.json`` uploaded ``private/extra.json`` too (a pattern was also compared with each file's base
    name), and ``--include ./extra.json`` named nothing. A pattern is an fnmatch pattern of the path inside the
    export; a leading ``./`` is dropped, ``..`` and absolute patterns are refused; the log lists the files, the
    included ones named apart, before the repository is created."""
    import huggingface_hub

    folder = copy_of(run, tmp_path) / "folded"
    (folder / "extra.json").write_text('{"eval": "public numbers"}')
    (folder / "private").mkdir()
    (folder / "private" / "extra.json").write_text('{"api_key": "SECRET"}')
    push = ["push", "--export_dir", str(folder), "--repo_id", "me/x"]
    for pattern in ("extra.json", "./extra.json", "././extra.json"):
        assert error_of([*push, "--include", pattern]) == (
            f"hf-tapernorm push: error: '{folder}' holds files the export did not write (private/extra.json); they "
            "are not uploaded: move them away, or name the ones to publish with --include PATTERN"
        )
    for pattern in ("../folded/extra.json", "private/../extra.json", str(folder / "extra.json")):
        assert error_of([*push, "--include", pattern]) == (
            f"hf-tapernorm push: error: --include {pattern!r}: a pattern is a path inside the export folder, relative "
            "to it (e.g. 'samples/*.txt'); '..' and absolute paths name nothing there"
        )
    for pattern in ("", "./"):  # `--include=`: a pattern given by mistake, which named nothing without a word
        assert error_of([*push, f"--include={pattern}"]) == (
            f"hf-tapernorm push: error: --include {pattern!r}: an empty pattern names no file; name the files to add "
            "(e.g. 'samples/*.txt')"
        )
    assert hub.created == hub.uploads == []
    (folder / "private" / "extra.json").unlink()
    said_before_upload = []
    create_repo = huggingface_hub.HfApi.create_repo
    caplog.set_level("INFO", logger="hf_tapernorm.export.hub")

    def create_after_the_log(api, repo_id, **options):
        said_before_upload.extend(caplog.messages)
        return create_repo(repo_id, **options)

    caplog.clear()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(huggingface_hub.HfApi, "create_repo", create_after_the_log)
        code, _, stderr = run_main([*push, "--include", "./extra.json"])
    assert code == 0, stderr
    manifest = json.loads((folder / ".hf_tapernorm_export.json").read_text())["files"]
    assert hub.sent["me/x"] == sorted([*manifest, "extra.json"])
    assert any(
        line.startswith(f"uploading {len(manifest) + 1} files of {folder} to me/x: ")
        and line.endswith("; not written by the export, named by --include: extra.json")
        for line in said_before_upload
    ), said_before_upload


def test_files_to_push_reads_one_include_string_as_one_pattern(run, tmp_path):
    folder = copy_of(run, tmp_path)
    (folder / "folded" / "secret.env").write_text("HF_TOKEN=x")
    with pytest.raises(ConfigurationError, match=r"did not write \(secret\.env\)"):
        files_to_push(folder / "folded", include="README*")  # its letters were patterns, "*" among them
    assert "secret.env" in files_to_push(folder / "folded", include="secret.env")


def test_push_of_an_export_whose_model_card_was_emptied_uploads_it_as_is(run, tmp_path, hub):
    folder = copy_of(run, tmp_path)
    (folder / "folded" / "README.md").write_text("")
    assert _push(folder / "folded", "me/empty_card") == 0 and "README.md" in hub.sent["me/empty_card"]


def test_push_uploads_an_edited_generation_config_and_says_so(run, tmp_path, hub, caplog):
    """An export whose generation_config.json its owner edited (do_sample, temperature, max_new_tokens) was refused
    as "changed after the export wrote it ..., so the upload would not be the model its README.md and robustness scan
    describe", though generation defaults change no weight or logit. Now it is uploaded as the edited file, with an
    INFO line naming the edit; an edited tokenizer_config.json (it can change tokenization) is still refused."""
    folder = copy_of(run, tmp_path) / "folded"
    generation = folder / "generation_config.json"
    edited = {**json.loads(generation.read_text()), "do_sample": True, "temperature": 0.7, "max_new_tokens": 64}
    generation.write_text(json.dumps(edited))
    caplog.set_level("INFO", logger="hf_tapernorm.export.manifest")
    assert _push(folder, "me/generation") == 0 and "generation_config.json" in hub.sent["me/generation"]
    assert json.loads(generation.read_text()) == edited  # the upload reads the folder: the edit is what is sent
    assert caplog.messages == [
        f"{folder}: generation_config.json edited after the export wrote it (the sha256 .hf_tapernorm_export.json "
        "recorded differs); uploading the edit, which changes no weight the card and the robustness scan describe"
    ]
    tokenizer_config = folder / "tokenizer_config.json"
    tokenizer_config.write_text(json.dumps({**json.loads(tokenizer_config.read_text()), "add_bos_token": False}))
    assert "tokenizer_config.json changed after the export wrote it" in error_of(
        ["push", "--export_dir", str(folder), "--repo_id", "me/tokenizer"]
    )


@pytest.mark.parametrize(
    "edit, reason",
    [
        ('{"temperature": 0.3,', "It looks like the config file at"),
        ("[1, 2]", "'list' object is not a mapping"),
        ('{"max_new_tokens": -5}', "`max_new_tokens` must be greater than 0, but is -5."),
    ],
)
def test_push_refuses_an_edited_generation_config_transformers_cannot_read(run, tmp_path, hub, edit, reason):
    """An edited generation_config.json that is broken JSON, a list, or holds a value transformers refuses was
    uploaded with the INFO line "changes no weight": the published model then failed to load (or dropped the edit).
    push reads it as transformers will, and refuses it in one line naming the file, nothing sent."""
    folder = copy_of(run, tmp_path) / "folded"
    (folder / "generation_config.json").write_text(edit)
    line = error_of(["push", "--export_dir", str(folder), "--repo_id", "me/generation"])
    assert line.startswith(
        f"hf-tapernorm push: error: {folder}: its generation_config.json was edited after the export wrote it, and "
        f"transformers cannot read it ("
    ), line
    assert reason in line and line.endswith(
        "so the pushed model would not load, or would drop the edit; fix the edit, or move the file out and write a "
        "fresh export (hf-tapernorm fold --overwrite)"
    ), line
    assert "me/generation" not in hub.sent


def test_push_uploads_only_the_files_of_the_export(reference, tmp_path, hub):
    from huggingface_hub.utils import filter_repo_objects

    export = tmp_path / "folded"
    shutil.copytree(reference / "folded", export)
    written = sorted(p.relative_to(export).as_posix() for p in export.rglob("*") if p.is_file())
    manifest = json.loads((export / ".hf_tapernorm_export.json").read_text())["files"]
    assert {"model.safetensors", "config.json", "README.md", "tokenizer.json"} <= set(manifest)
    assert set(manifest) == set(written) - {".hf_tapernorm_export.json"}
    (export / ".env").write_text("HF_TOKEN=hf_secret")
    (export / "notes").mkdir()
    (export / "notes" / "private.txt").write_text("private")
    push = ["push", "--export_dir", str(export), "--repo_id", "me/tiny-normfree"]
    message = error_of(push)
    assert message == (
        f"hf-tapernorm push: error: '{export}' holds files the export did not write (.env, notes/private.txt); they "
        "are not uploaded: move them away, or name the ones to publish with --include PATTERN"
    )
    assert "HF_TOKEN" not in message and hub.created == hub.uploads == []
    assert error_of([*push, "--include", "notes/*"]).endswith("did not write (.env); they are not uploaded: "
                                                               "move them away, or name the ones to publish with "
                                                               "--include PATTERN")  # fmt: skip
    (export / ".env").unlink()
    code, _, stderr = run_main([*push, "--include", "notes/*"])
    assert code == 0, stderr
    assert hub.created == [("me/tiny-normfree", {"private": True, "exist_ok": True, "repo_type": "model"})]
    uploaded = set(
        filter_repo_objects(written + ["notes/private.txt"], allow_patterns=hub.uploads[0]["allow_patterns"])
    )
    assert uploaded == set(manifest) | {"notes/private.txt"}
    hub.created.clear()
    hub.uploads.clear()
    assert run_main([*push, "--no_private"])[0] == 2  # notes/ is refused again without --include
    shutil.rmtree(export / "notes")
    assert run_main([*push, "--no_private"])[0] == 0 and hub.created[0][1]["private"] is False
    assert set(filter_repo_objects(written, allow_patterns=hub.uploads[0]["allow_patterns"])) == set(manifest)


def test_push_refuses_an_export_without_a_manifest(reference, tmp_path):
    export = tmp_path / "folded"
    shutil.copytree(reference / "folded", export)
    (export / ".hf_tapernorm_export.json").unlink()
    message = error_of(["push", "--export_dir", str(export), "--repo_id", "me/x"])
    assert message.startswith(f"hf-tapernorm push: error: '{export}' has no export manifest")


def test_push_of_an_unscanned_export_names_the_command_that_writes_a_scan_into_it(run, tmp_path, hub):
    """push said "not scanned (hf-tapernorm eval --scan_reference <the base model> scans it)", but
    eval's scan only prints its result and push kept saying "not scanned"; the hint now names fold's command, which
    writes robustness_scan.json into the export, and following it (the run's folder for <run>) gets push a scan."""
    folder = copy_of(run, tmp_path) / "folded"
    code, stdout, stderr = run_main(["push", "--export_dir", str(folder), "--repo_id", "me/x"])
    hint = f"hf-tapernorm fold --checkpoint <run>/tapered --output_dir {folder} --overwrite --scan_windows 16"
    assert code == 0, stderr
    assert f"{folder}: not scanned (fold writes a scan into an export: {hint}; eval's scan only prints its result)" in (
        stdout.splitlines()
    )
    code, _, stderr = run_main(hint.replace("<run>", str(folder.parent)).split()[1:])
    assert code == 0 and (folder / "robustness_scan.json").is_file(), stderr
    code, stdout, stderr = run_main(["push", "--export_dir", str(folder), "--repo_id", "me/y"])
    assert code == 0 and f"{folder}: robustness scan: " in stdout and "not scanned" not in stdout, stderr


def _with_write_inside(export: Path, pid: int, *, marked: bool = True) -> Path:
    """``export`` holding a write's ``.hf_tapernorm_writing-PID`` as export_folded(overwrite=True) leaves it when
    killed mid-write (its mark, a half-written model), or an unmarked look-alike (``marked=False``)."""
    from hf_tapernorm._temporaries import WRITE_MARK

    container = export / f".hf_tapernorm_writing-{pid}"
    container.mkdir()
    if marked:
        (container / WRITE_MARK).write_text("")
    (container / "config.json").write_text("{}")
    (container / "model.safetensors").write_bytes(b"half written")
    return container


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    """An export of a tiny folded model (export_folded), without a run: the cases copy it."""
    from hf_tapernorm import export_folded, fold_model
    from tests.helpers import tapered

    return export_folded(fold_model(tapered("gpt2", "all")), tmp_path_factory.mktemp("exported") / "export")


def test_push_refuses_an_export_a_killed_or_running_write_left_its_folder_in(exported, tmp_path):
    """A killed export_folded(overwrite=True) left its marked ``.hf_tapernorm_writing-PID/`` in the export, and push
    refused its files as "files the export did not write ... --include", whose advice uploaded them. Now push names it
    as a killed write's leftover and says to export again with overwrite=True (which deletes it); a live write's is
    named as a write in progress."""
    import os

    export = Path(shutil.copytree(exported, tmp_path / "export"))
    dead = 2**22 + 54321  # no such process
    _with_write_inside(export, dead)
    with pytest.raises(ConfigurationError) as refused:
        files_to_push(export, ["*"])
    assert str(refused.value) == (
        f"'{export}' holds '.hf_tapernorm_writing-{dead}', the leftover of a killed write of the export (its "
        "half-written files are never uploaded, and the export beside it may be incomplete); export again with "
        "overwrite=True (hf-tapernorm fold --overwrite), which deletes it, then push"
    )
    shutil.rmtree(export / f".hf_tapernorm_writing-{dead}")
    _with_write_inside(export, os.getppid())  # a running process: a write in progress
    with pytest.raises(ConfigurationError) as refused:
        files_to_push(export)
    assert str(refused.value) == (
        f"'{export}': another write of {export} is in progress (pid {os.getppid()}: {process_command(os.getppid())}, "
        f"through '.hf_tapernorm_writing-{os.getppid()}'; delete '{export / f'.hf_tapernorm_writing-{os.getppid()}'}' "
        f"only if process {os.getppid()} is not writing this export, its pid reused after a restart); wait for it to "
        "finish, then push"
    )


@pytest.mark.parametrize("include", ["*", ".hf_tapernorm_writing-*/*", ".hf_tapernorm_writing-7/model.safetensors"])
def test_nothing_under_a_bookkeeping_folder_is_uploaded_whatever_include_names(exported, tmp_path, include):
    """``push --include '*'`` (or a pattern naming it) uploaded the files under a ``.hf_tapernorm_writing-PID/``
    folder (a half-written model, the write's mark): bookkeeping was recognised by its top-level name only. Now no
    file under a ``.hf_tapernorm_*`` name, a folder's too, is ever uploaded."""
    from hf_tapernorm.export.manifest import export_manifest

    export = Path(shutil.copytree(exported, tmp_path / "export"))
    _with_write_inside(export, 7, marked=False)  # a look-alike: not a write's, and still bookkeeping
    (export / "sub").mkdir()
    (export / "sub" / ".hf_tapernorm_run.lock").write_text("pid 7")
    assert files_to_push(export, [include]) == sorted(export_manifest(export))


def test_push_names_an_include_pattern_that_matches_only_bookkeeping_files(run, tmp_path, hub, caplog):
    """``push --include .hf_tapernorm_notes`` (a user's file under a bookkeeping name) exited 0 without uploading it,
    and nothing said so. It is still not uploaded (bookkeeping never is), and a WARNING names the pattern whose every
    match is a bookkeeping name; a pattern that also matches a user's other file ('*') says nothing."""
    folder = copy_of(run, tmp_path)
    (folder / "folded" / ".hf_tapernorm_notes").write_text("mine")
    caplog.set_level("WARNING", logger="hf_tapernorm.export.hub")
    assert _push(folder / "folded", "me/notes", "--include", ".hf_tapernorm_notes") == 0
    assert ".hf_tapernorm_notes" not in hub.sent["me/notes"]
    assert caplog.messages == [
        "--include '.hf_tapernorm_notes' names only hf-tapernorm's bookkeeping files (.hf_tapernorm_notes), which are "
        "never uploaded: rename a file of yours out of the .hf_tapernorm_* names to publish it"
    ]
    caplog.clear()
    assert _push(folder / "folded", "me/all", "--include", "*") == 0
    assert caplog.messages == []


def test_push_refuses_an_export_a_live_write_is_replacing_beside_it(exported, tmp_path, monkeypatch):
    """push of E while a fold or export_folded replaced it through a marked ``.E.partial-PID`` / ``.E.export-PID``
    beside it went ahead, uploading while E was about to be swapped for the new export, and so did push through a
    link to E or as '.' from inside it. It is refused as a write in progress, as one inside E is."""
    import os

    from hf_tapernorm._temporaries import WRITE_MARK, process_command

    export, alive = Path(shutil.copytree(exported, tmp_path / "export")), os.getppid()  # a live process
    live = tmp_path / f".export.partial-{alive}"
    live.mkdir()
    (live / WRITE_MARK).write_text("")
    with pytest.raises(ConfigurationError) as refused:
        files_to_push(export)
    assert str(refused.value) == (
        f"'{export}': another write of {export} is in progress (pid {alive}: {process_command(alive)}, through "
        f"'{live.name}'; delete '{live}' only if process {alive} is not writing this export, its pid reused after a "
        "restart); wait for it to finish, then push"
    )
    (tmp_path / "link").symlink_to(export, target_is_directory=True)  # beside a link, the write is beside its target
    with pytest.raises(ConfigurationError, match=rf"another write of {export} is in progress"):
        files_to_push(tmp_path / "link")
    monkeypatch.chdir(export)  # '.', whose name is none
    with pytest.raises(ConfigurationError, match=rf"another write of {export} is in progress"):
        files_to_push(".")


def test_a_users_look_alike_of_the_packages_files_deeper_in_an_export_is_named(exported, tmp_path, caplog):
    """A user's ``sub/.hf_tapernorm_export.json`` or ``sub/.hf_tapernorm_run.lock`` named by --include was taken for
    the package's own (the manifest's and the lock's names, at any depth) and left behind without a word; the
    package keeps those at the export's top only, so deeper ones are named in the WARNING."""
    export = Path(shutil.copytree(exported, tmp_path / "export"))
    (export / "sub").mkdir()
    for name in (".hf_tapernorm_export.json", ".hf_tapernorm_run.lock"):
        (export / "sub" / name).write_text("mine")
    caplog.set_level("WARNING", logger="hf_tapernorm.export.hub")
    files_to_push(export, ["sub/*"])
    assert caplog.messages == [
        "--include 'sub/*' names only hf-tapernorm's bookkeeping files (sub/.hf_tapernorm_export.json, "
        "sub/.hf_tapernorm_run.lock), which are never uploaded: rename a file of yours out of the .hf_tapernorm_* "
        "names to publish it"
    ]


@pytest.mark.parametrize("pattern", [".*", ".hf_tapernorm_export.json", ".hf_tapernorm_*"])
def test_an_include_pattern_matching_only_the_packages_own_files_warns_of_nothing(exported, tmp_path, caplog, pattern):
    """``push --include '.*'`` (or one naming the manifest) of an untouched export: a WARNING advised to "rename a
    file of yours out of the .hf_tapernorm_* names", where the only match was the export's own manifest, which
    renaming would unmake. The package's own files (the manifest, a lock) are no user's: the WARNING names only the
    bookkeeping-named files that are not, and says nothing where there are none."""
    from hf_tapernorm.app.run_folder import LOCK_NAME
    from hf_tapernorm.export.manifest import export_manifest

    export = Path(shutil.copytree(exported, tmp_path / "export"))
    (export / LOCK_NAME).write_text("pid 7")
    caplog.set_level("WARNING", logger="hf_tapernorm.export.hub")
    assert files_to_push(export, [pattern]) == sorted(export_manifest(export))
    assert caplog.messages == []
    (export / ".hf_tapernorm_notes").write_text("mine")  # a user's file under a bookkeeping name: named alone
    assert files_to_push(export, [pattern]) == sorted(export_manifest(export))
    assert caplog.messages == (
        []
        if pattern == ".hf_tapernorm_export.json"
        else [
            f"--include '{pattern}' names only hf-tapernorm's bookkeeping files (.hf_tapernorm_notes), which are never "
            "uploaded: rename a file of yours out of the .hf_tapernorm_* names to publish it"
        ]
    )


def test_push_holds_the_export_it_uploads_against_fold_and_export_folded(run, tmp_path, hub, monkeypatch):
    """push held no lock on the export it uploaded: a fold --overwrite (or export_folded(overwrite=True)) of the same
    folder during the upload went ahead and replaced the export under it, so upload_folder, which reads the files as
    it sends them, could publish a mix of two exports. Now push holds the folder's run lock from before its checks to
    the end of the upload: both are refused in one line naming the push's process, the upload sends exactly the
    manifest (never the lock file), and the lock is gone after the push."""
    import os
    import socket

    from hf_tapernorm import export_folded, fold_model
    from hf_tapernorm.app.run_folder import LOCK_NAME
    from hf_tapernorm.export.manifest import export_manifest
    from tests.helpers import tapered

    export = Path(shutil.copytree(run / "folded", tmp_path / "export"))
    before = {name: (export / name).read_bytes() for name in export_manifest(export)}
    fold = ["fold", "--checkpoint", str(run / "tapered"), "--output_dir", str(export), "--overwrite"]
    seen = {}

    def upload_racing_a_fold(api, **options):
        seen["fold"] = error_of(fold)
        with pytest.raises(ConfigurationError) as refused:
            export_folded(fold_model(tapered("gpt2", "all")), export, overwrite=True)
        seen["export_folded"] = str(refused.value)
        seen["lock"] = (export / LOCK_NAME).is_file()
        return hub.upload_folder(**options)

    monkeypatch.setattr(__import__("huggingface_hub").HfApi, "upload_folder", upload_racing_a_fold)
    code, _, stderr = run_main(["push", "--export_dir", str(export), "--repo_id", "me/raced"])
    assert code == 0, stderr
    assert seen["lock"] and not (export / LOCK_NAME).exists()
    pid, host = os.getpid(), socket.gethostname()
    said = (
        f"hf-tapernorm fold: error: output folder '{export}' is in use: a running hf-tapernorm command owns it (pid "
        f"{pid} on host {host} since @; if no hf-tapernorm command runs as pid {pid} on {host} (it was killed, its "
        f"container or pod restarted, or the folder was copied), the lock is stale: delete {export / LOCK_NAME}); @"
    )
    assert re.fullmatch(r"[^;]+".join(re.escape(part) for part in said.split("@")[:2]) + ".+", seen["fold"])
    assert seen["export_folded"] == (
        f"cannot export into {export}: a running hf-tapernorm command holds it (pid {pid}: {process_command(pid)}); "
        "wait for it to finish, or choose a new folder"
    )
    assert hub.sent["me/raced"] == sorted(export_manifest(export))
    assert {name: (export / name).read_bytes() for name in export_manifest(export)} == before


def test_a_failed_push_leaves_no_lock_and_a_killed_ones_is_taken_over(run, tmp_path, hub, monkeypatch):
    """The lock push holds goes with it however the push ends: an upload that fails leaves no lock file behind, and
    a killed push's lock (its process gone) is stale, so the next push takes it over and uploads."""
    import huggingface_hub

    from hf_tapernorm.app.run_folder import LOCK_NAME

    export = Path(shutil.copytree(run / "folded", tmp_path / "export"))

    def failing(api, **options):
        assert (export / LOCK_NAME).is_file()
        raise OSError("connection reset")

    with monkeypatch.context() as patch:
        patch.setattr(huggingface_hub.HfApi, "upload_folder", failing)
        message = error_of(["push", "--export_dir", str(export), "--repo_id", "me/failed"])
    assert message.startswith(f"hf-tapernorm push: error: cannot push '{export}' to me/failed: OSError: connection")
    assert not (export / LOCK_NAME).exists()
    (export / LOCK_NAME).write_text(json.dumps({"pid": 2147483646, "host": __import__("socket").gethostname()}))
    assert _push(export, "me/after") == 0
    assert not (export / LOCK_NAME).exists() and "me/after" in hub.sent


def test_a_taper_overwrite_of_the_run_whose_export_push_uploads_is_refused(ws, run, tmp_path, hub, monkeypatch):
    """A taper --overwrite of the run whose folded/ push was uploading went ahead; now the push's lock in folded/
    refuses it in one line naming that folder and the push's process, and the export is uploaded as it was."""
    import os

    import huggingface_hub

    from hf_tapernorm.export.manifest import export_manifest

    copy = copy_of(run, tmp_path)
    seen = {}

    def upload_racing_a_taper(api, **options):
        seen["taper"] = error_of(taper(ws, copy, "--overwrite"))
        return hub.upload_folder(**options)

    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_racing_a_taper)
    assert _push(copy / "folded", "me/run") == 0
    assert seen["taper"].startswith(
        f"hf-tapernorm taper: error: output folder '{copy}' holds 'folded', which a running hf-tapernorm command owns "
        f"(pid {os.getpid()} on host "
    ), seen["taper"]
    assert hub.sent["me/run"] == sorted(export_manifest(copy / "folded"))
