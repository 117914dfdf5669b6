"""Broken input ends in one line that names the file or variable and the fix, never a traceback.

Each case is checked from the Python API (the exception and its message) and, where a command
reaches it, through the CLI (`error: ...` on stderr, exit status 2).
"""

from pathlib import Path

import pytest

from tidar_convert.cli import main
from tidar_convert.runtime.spec import TiDARSpec

RECIPE = str(Path(__file__).parents[1] / "recipes" / "tiny.yaml")


def cli_error(capsys, *args) -> str:
    """Run the CLI, expect the one-line refusal, return it."""
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    # (pytest closes each test's captured stderr; a log handler Lightning bound to an earlier one
    # may print "--- Logging error ---" noise here: what matters is that the refusal ends
    # the output)
    last = err.splitlines()[-1]
    assert (
        last.startswith("error: ")
        and sum(line.startswith("error: ") for line in err.splitlines()) == 1
    ), err
    return last


def fit_args(tmp_path, model, *extra) -> list[str]:
    return [
        "fit",
        "--config",
        RECIPE,
        "--model.model",
        str(model),
        "--trainer.default_root_dir",
        str(tmp_path / "run"),
        "--trainer.logger",
        "false",
        *extra,
    ]


# --------------------------------------------------------------------------------------------
# TIDAR_CACHE pointing somewhere unwritable.
# --------------------------------------------------------------------------------------------


@pytest.mark.fit
def test_tidar_cache_that_cannot_be_made_is_named(tmp_path, monkeypatch, capsys):
    from tidar_convert.models.loading import cache_dir

    (tmp_path / "file.txt").write_text("a file, not a folder")
    bad = tmp_path / "file.txt" / "cache"
    monkeypatch.setenv("TIDAR_CACHE", str(bad))
    with pytest.raises(
        ValueError,
        match=(
            r"TIDAR_CACHE='.*file.txt/cache' cannot be made a "
            r"folder .*point TIDAR_CACHE to a writable folder"
        ),
    ):
        cache_dir()
    line = cli_error(capsys, "eval-ppl", "--model", "default", "--data", "stdlib")
    assert f"TIDAR_CACHE={str(bad)!r}" in line and "point TIDAR_CACHE to a writable folder" in line
    # fit loads the default model in TiDARModule.__init__, inside LightningCLI: same line
    line = cli_error(capsys, *fit_args(tmp_path, "default"))
    assert f"TIDAR_CACHE={str(bad)!r}" in line


def test_tidar_cache_that_is_not_writable_is_named(tmp_path, monkeypatch, capsys):
    from tidar_convert.models.loading import cache_dir

    monkeypatch.setenv("TIDAR_CACHE", str(tmp_path / "cache"))
    assert cache_dir() == tmp_path / "cache"
    # tests run as root: chmod would not stop writes
    monkeypatch.setattr("tidar_convert.models.loading.os.access", lambda *a, **k: False)
    with pytest.raises(
        ValueError,
        match=r"TIDAR_CACHE='.*cache' is not writable; point TIDAR_CACHE to a writable folder",
    ):
        cache_dir()
    monkeypatch.delenv("TIDAR_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    with pytest.raises(
        ValueError,
        match=(
            r"the cache folder '.*home/.cache/tidar_convert' "
            r"\(TIDAR_CACHE is unset\) is not writable"
        ),
    ):
        cache_dir()
    monkeypatch.setenv("TIDAR_CACHE", str(tmp_path / "cache"))
    assert "is not writable" in cli_error(
        capsys, "eval-ppl", "--model", "default", "--data", "stdlib"
    )


# --------------------------------------------------------------------------------------------
# A corrupt config.json or a truncated model.safetensors, in an export or in a base model.
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def export_dir(tiny_dirs, tmp_path_factory):
    from tidar_convert.exports.folder import export
    from tidar_convert.models.loading import load_base

    model, tok = load_base(str(tiny_dirs["llama"]))
    return export(model, tok, tmp_path_factory.mktemp("errors") / "tidar", TiDARSpec(4))


def damaged_copy(src, dest, what: str) -> Path:
    """A copy of a model folder with config.json cut mid-object, or model.safetensors cut in half
    (`data`) or inside its header (`header`)."""
    import shutil

    shutil.copytree(src, dest)
    if what == "config":
        (dest / "config.json").write_text('{"model_type": "llama",')
    else:
        weights = dest / "model.safetensors"
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2] if what == "data" else data[:100])
    return dest


@pytest.mark.fit
def test_corrupt_config_json_of_a_base_model_is_named(tiny_dirs, tmp_path, capsys):
    from tidar_convert.models.loading import load_base

    bad = damaged_copy(tiny_dirs["llama"], tmp_path / "base", "config")
    message = (
        rf"'{bad}/config.json' is not valid JSON \(.*line 1 column 24.*\): "
        r"the file is damaged; download or save the model again"
    )
    with pytest.raises(ValueError, match=message):
        load_base(str(bad))
    assert f"{bad}/config.json' is not valid JSON" in cli_error(
        capsys, "eval-ppl", "--model", str(bad), "--data", "stdlib"
    )
    assert f"{bad}/config.json' is not valid JSON" in cli_error(capsys, *fit_args(tmp_path, bad))


def test_corrupt_config_json_of_an_export_is_named(export_dir, tmp_path, capsys):
    from tidar_convert.exports.folder import check_export, load

    bad = damaged_copy(export_dir, tmp_path / "tidar", "config")
    message = (
        rf"'{bad}/config.json' is not valid JSON \(.*line 1 column 24.*\): "
        r"the file is damaged; export it again"
    )
    for fn in (check_export, load):
        with pytest.raises(ValueError, match=message):
            fn(bad)
    line = cli_error(capsys, "generate", "--model", str(bad), "--prompt", "x")
    assert f"{bad}/config.json' is not valid JSON" in line and "export it again" in line


@pytest.mark.parametrize("cut", ["data", "header"])
def test_truncated_safetensors_of_a_base_model_is_named(tiny_dirs, tmp_path, capsys, cut):
    from tidar_convert.models.loading import load_base

    bad = damaged_copy(tiny_dirs["llama"], tmp_path / "base", cut)
    with pytest.raises(
        ValueError,
        match=(
            rf"'{bad}/model.safetensors' is truncated or "
            r"corrupt \(.*\); download or save the model again"
        ),
    ):
        load_base(str(bad))
    assert f"{bad}/model.safetensors' is truncated" in cli_error(
        capsys, "eval-ppl", "--model", str(bad), "--data", "stdlib"
    )


def test_truncated_safetensors_of_an_export_is_named(export_dir, tmp_path, capsys):
    from tidar_convert.exports.folder import load

    bad = damaged_copy(export_dir, tmp_path / "tidar", "data")
    with pytest.raises(
        ValueError,
        match=(
            rf"'{bad}/model.safetensors' is truncated or corrupt \(cut short: "
            r"\d+ bytes of the \d+ its header describes\); export it again"
        ),
    ):
        load(bad)
    line = cli_error(capsys, "generate", "--model", str(bad), "--prompt", "x")
    assert f"{bad}/model.safetensors' is truncated" in line and "export it again" in line


def test_damaged_embedded_default_is_rebuilt(tiny_dirs, tmp_path, monkeypatch, caplog):
    """The embedded default lives in the cache: a damaged copy is made again, not reported."""
    import shutil

    from tidar_convert.models import loading, model_files

    cached = tmp_path / "SmolLM2"
    damaged_copy(tiny_dirs["llama"], cached, "data")

    # stands in for the real one (PyPI, 93 MB): rebuilds when the folder is gone
    def embedded_default():
        if not cached.exists():
            shutil.copytree(tiny_dirs["llama"], cached)
        return cached

    monkeypatch.setattr(loading, "embedded_default", embedded_default)
    assert loading.resolve("default") == str(cached)
    assert model_files._safetensors_problem(cached / "model.safetensors") is None
    assert (
        "model.safetensors' is truncated or corrupt" in caplog.text and "Rebuilding" in caplog.text
    )


# --------------------------------------------------------------------------------------------
# A hub id with no network: fail in a moment, say it is a hub id and how to pass a folder.
# --------------------------------------------------------------------------------------------


@pytest.fixture
def no_hub(tmp_path, monkeypatch):
    """The hub at a closed loopback port (nothing leaves the machine) and an empty HF cache."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    return tmp_path / "hf-cache"


def hub_cache_entry(hub_cache: Path, repo_id: str, folder) -> Path:
    """Put a model folder in an HF hub cache as a download would (refs/main ->
    snapshots/<commit>)."""
    import shutil

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = hub_cache / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return repo / "snapshots" / commit


@pytest.mark.fit
def test_hub_id_without_network_fails_fast_and_says_pass_a_folder(no_hub, tmp_path, capsys):
    import time

    from tidar_convert.models.loading import HubUnreachableError, load_base

    t0 = time.perf_counter()
    with pytest.raises(HubUnreachableError) as info:
        load_base("tidar-test/no-such-model")
    assert time.perf_counter() - t0 < 15  # transformers alone retries for about 34 s
    message = str(info.value)
    # what transformers' own OSError was: catchable the same way
    assert isinstance(info.value, ConnectionError)
    assert (
        "model='tidar-test/no-such-model' is not a local "
        "path, so it was taken as a Hugging Face hub id" in message
    )
    assert (
        "the hub was not reachable (http://127.0.0.1:9: " in message
        and "not in the local Hugging Face cache" in message
    )
    assert (
        "hf download tidar-test/no-such-model --local-dir DIR" in message
        and "--model.model DIR" in message
    )
    assert "taken as a Hugging Face hub id" in cli_error(
        capsys, "eval-ppl", "--model", "tidar-test/no-such-model", "--data", "stdlib"
    )
    assert "taken as a Hugging Face hub id" in cli_error(
        capsys, *fit_args(tmp_path, "tidar-test/no-such-model")
    )


def test_hub_id_without_network_uses_the_cached_copy(no_hub, tiny_dirs, caplog):
    """A model downloaded before loads from the HF cache at once, instead of after the retries."""
    from tidar_convert.models.loading import load_base, resolve

    snapshot = hub_cache_entry(no_hub, "tidar-test/tiny", tiny_dirs["llama"])
    assert resolve("tidar-test/tiny") == str(snapshot)
    assert (
        "hub is not reachable" in caplog.text
        and "using the cached copy of tidar-test/tiny" in caplog.text
    )
    model, tok = load_base("tidar-test/tiny")
    assert model.config.mask_token_id == tok.mask_token_id


def test_hub_id_in_offline_mode(no_hub, tiny_dirs, monkeypatch):
    """HF_HUB_OFFLINE=1: a cached model keeps loading by id (transformers reads its cache); one that
    is not cached is refused with the reason."""
    from huggingface_hub import constants

    from tidar_convert.models.loading import HubUnreachableError, resolve

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub_cache_entry(no_hub, "tidar-test/tiny", tiny_dirs["llama"])
    assert resolve("tidar-test/tiny") == "tidar-test/tiny"
    with pytest.raises(
        HubUnreachableError,
        match=(
            r"hub was not reachable \(HF_HUB_OFFLINE is set\) "
            r"and the model is not in the local Hugging Face cache"
        ),
    ):
        resolve("tidar-test/other")


# --------------------------------------------------------------------------------------------
# Data files: not UTF-8, binary, the wrong text field, a hub dataset with no hub.
# --------------------------------------------------------------------------------------------


def test_undecodable_text_files_in_a_folder_are_skipped_with_a_warning_naming_each(
    tmp_path, tiny_dirs, caplog, capsys
):
    """A folder of one-document files reads what it can: each bad file is named once, the rest
    is read."""
    from tidar_convert.data import iter_documents

    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text("def good():\n    return 'plain UTF-8 text'\n" * 20)
    (folder / "b.txt").write_bytes("caf\xe9 au lait, written in Latin-1".encode("latin-1"))
    # a binary saved with a text suffix
    (folder / "c.py").write_bytes(b"\x7fELF\x02\x01\x01\x00\x00\x00")
    for _ in range(2):  # a second pass (validation, the next epoch) does not repeat the warnings
        assert list(iter_documents(str(folder))) == [(folder / "a.txt").read_text()]
    skipped = [
        r.getMessage() for r in caplog.records if r.getMessage().startswith("Skipping data file")
    ]
    assert skipped == [
        f"Skipping data file '{folder}/b.txt': it is not UTF-8 text (byte 0xe9 "
        "at offset 3). Convert it to UTF-8 text, or remove it, to silence this.",
        f"Skipping data file '{folder}/c.py': it is binary, not text (a NUL byte "
        "at offset 7). Convert it to UTF-8 text, or remove it, to silence this.",
    ]
    main(
        [
            "eval-ppl",
            "--model",
            str(tiny_dirs["llama"]),
            "--data",
            str(folder),
            "--seq_len",
            "16",
            "--max_tokens",
            "64",
        ]
    )
    assert "perplexity" in capsys.readouterr().out


@pytest.mark.fit
def test_undecodable_single_data_files_are_refused_by_name(tmp_path, tiny_dirs, capsys):
    from tidar_convert.data import iter_documents

    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("na\xefve".encode("latin-1"))
    rows = tmp_path / "rows.jsonl"
    rows.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    parquet = tmp_path / "image.parquet"
    parquet.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(100))
    folder = tmp_path / "all-bad"
    folder.mkdir()
    for i in range(2):
        (folder / f"{i}.txt").write_bytes(b"\xff\xfe" + bytes(10))
    cases = [
        (
            latin1,
            rf"data file '{latin1}' is not UTF-8 text \(byte 0xef at offset 2\); "
            r"convert it to UTF-8 text, or pass another data source.",
        ),
        (
            rows,
            rf"data file '{rows}' is not UTF-8 text \(byte 0xe9 at offset 30, line 2\); "
            r"convert it to UTF-8, or remove it from the data.",
        ),
        (
            parquet,
            rf"data file '{parquet}' is not a parquet file \(no PAR1 "
            r"marks at its start and end\); write it again, or remove it",
        ),
        (
            folder,
            r"none of the 2 text files of the data source is UTF-8 "
            rf"text \(the last, '{folder}/1.txt', is not UTF-8 text",
        ),
    ]
    for source, message in cases:
        with pytest.raises(ValueError, match=message):
            list(iter_documents(str(source)))
    assert f"data file '{latin1}' is not UTF-8 text" in cli_error(
        capsys, "eval-ppl", "--model", str(tiny_dirs["llama"]), "--data", str(latin1)
    )
    assert f"data file '{rows}' is not UTF-8 text" in cli_error(
        capsys, *fit_args(tmp_path, tiny_dirs["llama"], "--data.source", str(rows))
    )


@pytest.mark.fit
def test_jsonl_without_the_text_field_names_the_field_and_the_flag(tmp_path, tiny_dirs, capsys):
    import json

    from tidar_convert.data import iter_documents

    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        "\n".join(
            json.dumps({"id": i, "body": f"def f_{i}(x):\n    return x + {i}\n" * 8})
            for i in range(40)
        )
    )
    message = (
        f"data source '{rows}' has no field 'text' holding the text in any "
        "of its 40 rows (its rows have: id, body); set the one that does: "
        "--data.text_field body (TiDARData(text_field='body') in Python)."
    )
    with pytest.raises(ValueError) as info:
        list(iter_documents(str(rows)))
    assert str(info.value) == message
    assert (
        cli_error(capsys, *fit_args(tmp_path, tiny_dirs["llama"], "--data.source", str(rows)))
        == f"error: {message}"
    )
    assert (
        cli_error(capsys, "eval-ppl", "--model", str(tiny_dirs["llama"]), "--data", str(rows))
        == f"error: {message}"
    )


def test_hub_dataset_without_network_fails_fast_and_says_pass_a_file(no_hub, tiny_dirs, capsys):
    import time

    from tidar_convert.data import iter_documents
    from tidar_convert.models.loading import HubUnreachableError

    t0 = time.perf_counter()
    with pytest.raises(
        HubUnreachableError,
        match=(
            r"data source 'tidar-test/no-such-data' is not a local file or folder, "
            r"so it was taken as a Hugging Face hub dataset, but the hub was not "
            r"reachable \(http://127.0.0.1:9: .*\); .*--data.source data/train.jsonl"
        ),
    ):
        list(iter_documents("tidar-test/no-such-data"))
    assert time.perf_counter() - t0 < 15
    assert "taken as a Hugging Face hub dataset" in cli_error(
        capsys, "eval-ppl", "--model", str(tiny_dirs["llama"]), "--data", "tidar-test/no-such-data"
    )


# --------------------------------------------------------------------------------------------
# Sampling settings out of range.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--top-p", "2"], "error: top_p=2.0: must be in (0, 1] (1 = off)"),
        (["--top-p", "0"], "error: top_p=0.0: must be in (0, 1]"),
        (["--top_p", "-0.5"], "error: top_p=-0.5: must be in (0, 1]"),
        (["--top-k", "-1"], "error: top_k=-1: must be >= 0 (0 = off)."),
    ],
)
def test_generate_refuses_top_p_outside_0_1_and_negative_top_k(export_dir, capsys, flags, message):
    line = cli_error(
        capsys,
        "generate",
        "--model",
        str(export_dir),
        "--prompt",
        "x",
        "--temperature",
        "0.8",
        *flags,
    )
    assert line.startswith(message)
