"""Broken input ends in one line that names the file or variable and the fix, never a traceback.

Each case is checked from the Python API (the exception and its message) and, where a command
reaches it, through the CLI (`error: ...` on stderr, exit status 2).
"""

from pathlib import Path

import pytest

from tidar_convert.cli import main

RECIPE = str(Path(__file__).parents[1] / "recipes" / "tiny.yaml")


def cli_error(capsys, *args) -> str:
    """Run the CLI, expect the one-line refusal, return it."""
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def fit_args(tmp_path, model, *extra) -> list[str]:
    return ["fit", "--config", RECIPE, "--model.model", str(model), "--trainer.default_root_dir", str(tmp_path / "run"), "--trainer.logger", "false", *extra]


# --------------------------------------------------------------------------------------------
# TIDAR_CACHE pointing somewhere unwritable.
# --------------------------------------------------------------------------------------------


def test_tidar_cache_that_cannot_be_made_is_named(tmp_path, monkeypatch, capsys):
    from tidar_convert.loading import cache_dir

    (tmp_path / "file.txt").write_text("a file, not a folder")
    bad = tmp_path / "file.txt" / "cache"
    monkeypatch.setenv("TIDAR_CACHE", str(bad))
    with pytest.raises(ValueError, match=r"TIDAR_CACHE='.*file.txt/cache' cannot be made a folder .*point TIDAR_CACHE to a writable folder"):
        cache_dir()
    line = cli_error(capsys, "eval-ppl", "--model", "default", "--data", "stdlib")
    assert f"TIDAR_CACHE={str(bad)!r}" in line and "point TIDAR_CACHE to a writable folder" in line
    # fit loads the default model in TiDARModule.__init__, inside LightningCLI: same line
    line = cli_error(capsys, *fit_args(tmp_path, "default"))
    assert f"TIDAR_CACHE={str(bad)!r}" in line


def test_tidar_cache_that_is_not_writable_is_named(tmp_path, monkeypatch, capsys):
    from tidar_convert.loading import cache_dir

    monkeypatch.setenv("TIDAR_CACHE", str(tmp_path / "cache"))
    assert cache_dir() == tmp_path / "cache"
    monkeypatch.setattr("tidar_convert.loading.os.access", lambda *a, **k: False)  # tests run as root: chmod would not stop writes
    with pytest.raises(ValueError, match=r"TIDAR_CACHE='.*cache' is not writable; point TIDAR_CACHE to a writable folder"):
        cache_dir()
    monkeypatch.delenv("TIDAR_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    with pytest.raises(ValueError, match=r"the cache folder '.*home/.cache/tidar_convert' \(TIDAR_CACHE is unset\) is not writable"):
        cache_dir()
    monkeypatch.setenv("TIDAR_CACHE", str(tmp_path / "cache"))
    assert "is not writable" in cli_error(capsys, "eval-ppl", "--model", "default", "--data", "stdlib")
