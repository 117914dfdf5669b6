"""Self-distillation as its own step (issue 7 item 4): `tidar-convert distill`, the corpus inside
`fit` (made once, by rank 0), and a corpus from `distill` passed to `fit`; never a validation
document."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tidar_convert.cli import main
from tidar_convert.data import TiDARData, is_validation
from tidar_convert.data.greedy import CorpusSpec
from tidar_convert.train.distill import MADE_BY, corpus_for_data

TINY = str(Path(__file__).parents[1] / "recipes" / "tiny.yaml")


def code_docs(path: Path, n: int = 12) -> list[str]:
    docs = [f"# doc {i}\ndef function_{i}(x):\n    return x * {i} + {i}\n" * 3 for i in range(n)]
    path.write_text("\n".join(json.dumps({"text": d}) for d in docs))
    return docs


def distill_args(model, src, out, *extra):
    return [
        "distill",
        "--model",
        str(model),
        "--sources",
        str(src),
        "--out",
        str(out),
        "--n_docs",
        "3",
        "--prompt_tokens",
        "8",
        "--new_tokens",
        "6",
        "--batch_size",
        "2",
        "--val_every",
        "4",
        *extra,
    ]


def test_distill_writes_the_models_greedy_continuations_of_training_prompts(tiny_dirs, tmp_path):
    from tidar_convert.models.loading import load_base

    docs = code_docs(tmp_path / "docs.jsonl")
    out = tmp_path / "corpus.jsonl"
    main(distill_args(tiny_dirs["llama"], tmp_path / "docs.jsonl", out))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    train = [d for d in docs if not is_validation(d, 4)]
    assert len(train) < len(docs), "the test needs a validation document among the first ones"
    model, tok = load_base(str(tiny_dirs["llama"]))
    model.eval()
    assert len(rows) == 3
    # the first training documents, in stream order; no validation one
    for row, doc in zip(rows, train):
        prompt = tok(doc, add_special_tokens=False)["input_ids"][:8]
        with torch.no_grad():
            expected = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=6,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
            )
        assert row["text"] == tok.decode(expected[0], skip_special_tokens=True)
        assert (
            row["made_by"] == MADE_BY
            and row["val_every"] == 4
            and row["model"] == str(tiny_dirs["llama"])
        )
    assert not list(tmp_path.glob(".corpus.jsonl.*")), "temporary files left behind"


def test_distill_generates_on_the_kernels_generate_decodes_with(tiny_dirs, tmp_path, monkeypatch):
    """On CPU the corpus is written under the packed linears and grouped attention (more tokens/s
    than on the stock products: bench/LOG.md, "self-distillation on the decoding kernels")."""
    from contextlib import contextmanager

    from tidar_convert.runtime import kernels

    real, seen = kernels.cpu_kernels, []

    @contextmanager
    def spy(model, enabled=True):
        with real(model, enabled) as swapped:
            packed = [
                m
                for m in model.modules()
                if getattr(m.__dict__.get("forward"), "_tidar_packed", False)
            ]
            seen.append(
                (
                    next(model.parameters()).device.type,
                    len(packed) > 0,
                    model.config._attn_implementation,
                )
            )
            yield swapped

    monkeypatch.setattr(kernels, "cpu_kernels", spy)
    code_docs(tmp_path / "docs.jsonl")
    main(distill_args(tiny_dirs["llama"], tmp_path / "docs.jsonl", tmp_path / "corpus.jsonl"))
    # on panels (every layer), attention per query: the same product generate() runs
    exact = kernels.available() and kernels.panel_library() is not None
    assert seen == [
        ("cpu", kernels.available(), kernels.EXACT_ATTENTION if exact else kernels.GQA_ATTENTION)
    ]


def test_distill_never_replaces_a_file_it_did_not_write(tiny_dirs, tmp_path, capsys):
    code_docs(tmp_path / "docs.jsonl")
    theirs = tmp_path / "theirs.jsonl"
    theirs.write_text('{"text": "my own data"}\n')
    with pytest.raises(SystemExit):
        main(distill_args(tiny_dirs["llama"], tmp_path / "docs.jsonl", theirs, "--overwrite"))
    assert (
        "is not a corpus written by `tidar-convert distill`; nothing was written"
        in capsys.readouterr().err
    )
    assert theirs.read_text() == '{"text": "my own data"}\n'
    ours = tmp_path / "ours.jsonl"
    main(distill_args(tiny_dirs["llama"], tmp_path / "docs.jsonl", ours))
    first = ours.read_text()
    with pytest.raises(SystemExit):
        main(distill_args(tiny_dirs["llama"], tmp_path / "docs.jsonl", ours, "--new_tokens", "3"))
    assert (
        "holds an earlier corpus of `tidar-convert distill`; pass --overwrite"
        in capsys.readouterr().err
    )
    main(
        distill_args(
            tiny_dirs["llama"], tmp_path / "docs.jsonl", ours, "--new_tokens", "3", "--overwrite"
        )
    )
    assert ours.read_text() != first and len(ours.read_text().splitlines()) == 3


def test_distill_overwrite_never_replaces_a_corpus_changed_since_it_was_written(
    tiny_dirs, tmp_path, capsys
):
    """Probe (issue 31): a row appended to a corpus was lost to `distill --overwrite`."""
    code_docs(tmp_path / "docs.jsonl")
    ours = tmp_path / "ours.jsonl"
    main(distill_args(tiny_dirs["llama"], tmp_path / "docs.jsonl", ours))
    assert (tmp_path / "ours.jsonl.sha256").read_text().endswith("  ours.jsonl\n")
    written = ours.read_text()
    with ours.open("a") as f:
        f.write(
            json.dumps({"text": "a row I added", "made_by": MADE_BY, "val_every": 4, "model": "m"})
            + "\n"
        )
    changed = ours.read_text()
    with pytest.raises(SystemExit):
        main(distill_args(tiny_dirs["llama"], tmp_path / "docs.jsonl", ours, "--overwrite"))
    err = capsys.readouterr().err
    assert (
        "was changed after `tidar-convert distill` wrote it (its "
        "sha256 differs from ours.jsonl.sha256); nothing was written" in err
    ), err
    assert ours.read_text() == changed
    ours.write_text(written)  # as written again: replaceable
    main(
        distill_args(
            tiny_dirs["llama"], tmp_path / "docs.jsonl", ours, "--new_tokens", "3", "--overwrite"
        )
    )
    assert ours.read_text() != written
    (tmp_path / "ours.jsonl.sha256").unlink()  # as a corpus from before checksums were kept
    kept = ours.read_text()
    with pytest.raises(SystemExit):
        main(distill_args(tiny_dirs["llama"], tmp_path / "docs.jsonl", ours, "--overwrite"))
    assert (
        "without its checksum file ours.jsonl.sha256" in capsys.readouterr().err
        and ours.read_text() == kept
    )


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--dtype", "float8"], "--dtype 'float8': use one of float32, bfloat16, float16"),
        (["--n_docs", "0"], "--n_docs 0: must be >= 1"),
        (["--val_every", "1"], "--val_every 1: must be >= 2"),
        (
            ["--n_docs", "50"],
            "give 9 prompts of more than 8 tokens, fewer than the 50 greedy documents asked for",
        ),
    ],
)
def test_distill_bad_input(tiny_dirs, tmp_path, capsys, extra, message):
    code_docs(tmp_path / "docs.jsonl")
    with pytest.raises(SystemExit):
        main(
            distill_args(tiny_dirs["llama"], tmp_path / "docs.jsonl", tmp_path / "c.jsonl", *extra)
        )
    err = capsys.readouterr().err
    assert message in err, err
    assert not (tmp_path / "c.jsonl").exists()


def corpus_file(path: Path, texts: list[str], val_every: int) -> Path:
    """A corpus as `distill` writes it (its rows' format), with chosen texts."""
    path.write_text(
        "".join(
            json.dumps({"text": t, "made_by": MADE_BY, "val_every": val_every, "model": "m"}) + "\n"
            for t in texts
        )
    )
    return path


def test_fit_data_takes_a_corpus_from_distill_and_checks_it(tokenizer, tmp_path):
    code_docs(tmp_path / "docs.jsonl", 40)
    greedy = corpus_file(
        tmp_path / "greedy.jsonl", [f"greedy text {i} " * 4 for i in range(6)], val_every=4
    )
    dm = TiDARData(
        source=str(tmp_path / "docs.jsonl"),
        seq_len=8,
        val_every=4,
        greedy_docs=4,
        greedy_corpus=str(greedy),
        shuffle_buffer=0,
    )
    dm.tokenizer = tokenizer
    train = list(dm._dataset("train").documents())
    assert [d for d in train if d.startswith("greedy")] == [
        f"greedy text {i} " * 4 for i in range(4)
    ]  # the first greedy_docs rows
    for kwargs, message in [
        (
            dict(val_every=5),
            "took its prompts from a split with val_every=4, "
            "and this run holds out documents with val_every=5",
        ),
        (
            dict(greedy_docs=7),
            "holds 6 documents and --data.greedy_docs asks for 7; lower --data.greedy_docs to 6",
        ),
        (
            dict(greedy_corpus=str(tmp_path / "docs.jsonl")),
            "was not written by `tidar-convert distill`",
        ),
        (
            dict(greedy_corpus=str(tmp_path / "none.jsonl")),
            "does not exist; make one with `tidar-convert distill",
        ),
    ]:
        dm = TiDARData(
            **{
                **dict(
                    source=str(tmp_path / "docs.jsonl"),
                    seq_len=8,
                    val_every=4,
                    greedy_docs=4,
                    greedy_corpus=str(greedy),
                ),
                **kwargs,
            }
        )
        dm.tokenizer = tokenizer
        with pytest.raises((ValueError, FileNotFoundError)) as e:
            dm._dataset("train")
        assert message in str(e.value) and "\n" not in str(e.value)


def test_no_validation_document_reaches_training_with_greedy_docs(tiny_dirs, tmp_path, monkeypatch):
    """fit's own corpus (greedy_docs > 0): its prompts are training documents, its documents go to
    training only, and validation holds exactly the documents it holds without greedy documents."""
    from tidar_convert.models.loading import load_base

    monkeypatch.setenv("TIDAR_CACHE", str(tmp_path / "cache"))
    docs = code_docs(tmp_path / "docs.jsonl", 30)
    _, tok = load_base(str(tiny_dirs["llama"]))

    def data(**kw):
        dm = TiDARData(source=str(tmp_path / "docs.jsonl"), seq_len=8, val_every=4, **kw)
        dm.tokenizer, dm.base_model = tok, str(tiny_dirs["llama"])
        # what the module's setup does in fit, before the DataModule reads anything
        corpus_for_data(None, dm)
        return dm

    dm = data(greedy_docs=6, greedy_new_tokens=4)
    train = list(dm._dataset("train").documents())
    val = list(dm._dataset("val").documents())
    assert val == list(data()._dataset("val").documents()) and val
    assert not set(val) & set(train) and all(is_validation(d, 4) for d in val)
    greedy = [d for d in train if d not in docs]
    assert len(greedy) == 6
    # prompt_tokens = 32 in fit
    prompts = {tok.decode(tok(d, add_special_tokens=False)["input_ids"][:32]) for d in docs}
    starts = {p for p in prompts if any(g.startswith(p) for g in greedy)}
    assert len(starts) == 6 and not any(
        is_validation(d, 4)
        for d in docs
        if tok.decode(tok(d, add_special_tokens=False)["input_ids"][:32]) in starts
    )
    path = next((tmp_path / "cache" / "greedy").glob("*.jsonl"))
    assert json.loads(path.read_text().splitlines()[0])["made_by"] == MADE_BY  # made once, cached
    mtime = path.stat().st_mtime_ns
    assert [
        d
        for d in data(greedy_docs=6, greedy_new_tokens=4)._dataset("train").documents()
        if d not in docs
    ] == greedy
    assert path.stat().st_mtime_ns == mtime


def test_the_datamodule_reads_a_ready_greedy_corpus_and_never_loads_a_model(
    tiny_dirs, tmp_path, monkeypatch
):
    """greedy_docs > 0 without a made corpus: the DataModule names the missing file and how it is
    made, and loads no model to make it (fit's module makes it in setup, see
    distill.corpus_for_data)."""
    from tidar_convert.models import loading

    monkeypatch.setenv("TIDAR_CACHE", str(tmp_path / "cache"))
    code_docs(tmp_path / "docs.jsonl", 30)
    _, tok = loading.load_base(str(tiny_dirs["llama"]))
    monkeypatch.setattr(
        loading, "load_base", lambda *a, **kw: pytest.fail("the DataModule loaded a model")
    )
    dm = TiDARData(
        source=str(tmp_path / "docs.jsonl"),
        seq_len=8,
        val_every=4,
        greedy_docs=6,
        greedy_new_tokens=4,
    )
    dm.tokenizer, dm.base_model = tok, str(tiny_dirs["llama"])
    with pytest.raises(
        FileNotFoundError,
        match=(
            r"--data.greedy_docs 6: the greedy corpus .*cache/greedy/\w+\.jsonl "
            r"has not been made; .*pass --data.greedy_corpus"
        ),
    ):
        dm._dataset("train")
    # validation never reads greedy text
    assert not (tmp_path / "cache" / "greedy").exists() and list(dm._dataset("val").documents())


@pytest.mark.fit
@pytest.mark.subprocess
def test_two_process_fit_generates_the_corpus_once_and_both_ranks_read_it(tmp_path, tiny_dirs):
    """2 processes (gloo DDP under torchrun): rank 0 generates, rank 1 waits at the barrier and
    reads the same file."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).parents[1] / "src"), os.environ.get("PYTHONPATH", "")]
        ),
        "WANDB_MODE": "offline",
        "TIDAR_CACHE": str(tmp_path / "cache"),
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            "-m",
            "tidar_convert.cli",
            "fit",
            "--config",
            TINY,
            "--model.model",
            str(tiny_dirs["llama"]),
            "--trainer.devices",
            "2",
            "--trainer.strategy",
            "ddp",
            "--trainer.max_steps",
            "2",
            "--trainer.num_sanity_val_steps",
            "0",
            "--trainer.logger",
            "false",
            "--data.greedy_docs",
            "4",
            "--data.greedy_new_tokens",
            "8",
            "--model.val_decode_prompts",
            "0",
            "--trainer.default_root_dir",
            str(tmp_path / "run"),
        ],
        env=env,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    made = [
        line
        for line in lines
        if line.startswith("self-distillation: generating 4 greedy documents")
    ]
    assert len(made) == 1, proc.stderr[-3000:]
    files = list((tmp_path / "cache" / "greedy").glob("*.jsonl"))
    assert len(files) == 1 and len(files[0].read_text().splitlines()) == 4
    read = sorted(
        line for line in lines if line.startswith("rank ") and "greedy documents from" in line
    )
    assert read == [
        f"rank 0: greedy documents from {files[0]}",
        f"rank 1: greedy documents from {files[0]}",
    ], proc.stderr[-3000:]


@pytest.mark.fit
def test_fit_trains_on_a_distill_corpus_with_every_greedy_lever(tiny_dirs, tmp_path, capsys):
    """The recipe surface of issue 9's levers, end to end: a corpus from `distill`, a greedy share,
    greedy text in the diffusion loss only, per-offset diffusion weights."""
    from tidar_convert.train.fit import _lightning_cli

    corpus = tmp_path / "greedy.jsonl"
    main(
        [
            "distill",
            "--model",
            str(tiny_dirs["llama"]),
            "--sources",
            "stdlib",
            "--out",
            str(corpus),
            "--n_docs",
            "8",
            "--prompt_tokens",
            "8",
            "--new_tokens",
            "24",
            "--val_every",
            "20",
        ]
    )  # tiny.yaml's val_every
    cli = _lightning_cli(
        [
            "fit",
            "--config",
            TINY,
            "--model.model",
            str(tiny_dirs["llama"]),
            "--trainer.max_steps",
            "3",
            "--trainer.val_check_interval",
            "3",
            "--trainer.logger",
            "false",
            "--trainer.default_root_dir",
            str(tmp_path / "run"),
            "--model.val_decode_prompts",
            "0",
            "--data.greedy_corpus",
            str(corpus),
            "--data.greedy_docs",
            "8",
            "--data.greedy_share",
            "0.5",
            "--data.greedy_ar_loss",
            "false",
            "--model.diff_offset_weights",
            "[2.0, 1.5, 1.0, 0.5]",
        ]
    )
    assert cli.trainer.global_step == 3 and cli.model.diff_offset_weights == [2.0, 1.5, 1.0, 0.5]
    metrics = cli.trainer.callback_metrics
    assert all(torch.isfinite(metrics[k]) for k in ("train/loss", "train/loss_ar", "val/loss"))
    # the given corpus, nothing generated
    assert "self-distillation: generating" not in capsys.readouterr().err
    ds = cli.datamodule._train_loader.dataset
    assert (
        ds.sources[-1] == str(corpus)
        and ds.no_ar == {1}
        and ds.weights == (0.5, 0.5)
        and ds.max_docs == {1: 8}
    )


def test_a_failing_rank_0_still_releases_the_other_ranks(tiny_dirs, tmp_path, monkeypatch):
    """If rank 0 cannot make the corpus, it reaches the barrier before raising (the other ranks
    would otherwise wait there until the process-group timeout), and the others fail with a
    message."""
    from types import SimpleNamespace

    from tidar_convert.train.distill import corpus_for_fit

    monkeypatch.setenv("TIDAR_CACHE", str(tmp_path / "cache"))
    code_docs(tmp_path / "docs.jsonl")
    barriers = []

    def trainer(rank):
        return SimpleNamespace(
            world_size=2,
            global_rank=rank,
            strategy=SimpleNamespace(
                root_device="cpu", barrier=lambda name: barriers.append((rank, name))
            ),
        )

    spec = CorpusSpec(
        str(tiny_dirs["llama"]),
        (str(tmp_path / "docs.jsonl"),),
        50,  # 50 > the 9 prompts
        4,
        8,
        4,
        "text",
        None,
        "train",
        0,
        "float32",
    )
    with pytest.raises(ValueError, match="fewer than the 50 greedy documents"):
        corpus_for_fit(trainer(0), spec, 2)
    with pytest.raises(
        FileNotFoundError,
        match="rank 1: the greedy corpus .* is not here after rank 0's turn: either rank 0 failed",
    ):
        corpus_for_fit(trainer(1), spec, 2)
    assert barriers == [(0, "greedy_corpus"), (1, "greedy_corpus")]


def test_a_corpus_records_its_model_so_that_fit_can_tell_it_from_another(
    tiny_dirs, tmp_path, monkeypatch
):
    """distill records a local model folder absolute; fit takes the corpus with that folder however
    it is spelt, and refuses it with another base model."""
    from tidar_convert.train.distill import check_corpus

    code_docs(tmp_path / "docs.jsonl")
    folder = tiny_dirs["llama"]
    monkeypatch.chdir(folder.parent)
    main(distill_args(f"./{folder.name}", tmp_path / "docs.jsonl", tmp_path / "c.jsonl"))
    assert json.loads((tmp_path / "c.jsonl").read_text().splitlines()[0])["model"] == str(folder)
    assert check_corpus(str(tmp_path / "c.jsonl"), 4, 3, f"./{folder.name}") == 3
    with pytest.raises(
        ValueError,
        match=(
            rf"holds the greedy text of the base model '{folder}', "
            rf"and this run trains '{tiny_dirs['qwen2']}'"
        ),
    ):
        check_corpus(str(tmp_path / "c.jsonl"), 4, 3, str(tiny_dirs["qwen2"]))


def test_a_corpus_spec_keys_the_cache_as_before_and_as_the_data_module_reads_it(
    tmp_path, monkeypatch
):
    """CorpusSpec.path is where every reader looks (the data module, fit, the lease plan), and
    its key is the one earlier versions wrote under, so a corpus made before is found again."""
    import hashlib

    monkeypatch.setenv("TIDAR_CACHE", str(tmp_path))
    dm = TiDARData(
        source="stdlib",
        greedy_docs=12,
        greedy_new_tokens=40,
        val_every=7,
        seed=3,
        greedy_dtype="bfloat16",
    )
    spec = CorpusSpec.of(dm)
    key = json.dumps(["default", ["stdlib"], 12, 7, 32, 40, "text", None, "train", 3, "bfloat16"])
    expected = tmp_path / "greedy" / f"{hashlib.sha1(key.encode()).hexdigest()[:16]}.jsonl"
    assert spec.path == expected
    with pytest.raises(FileNotFoundError, match=str(expected)):
        dm._greedy_path()
    expected.parent.mkdir(parents=True)
    expected.write_text("{}\n")
    assert dm._greedy_path() == str(expected)
    # any setting the documents depend on moves the key
    for changed in (
        CorpusSpec(**{**spec.__dict__, "model": "other"}),
        CorpusSpec(**{**spec.__dict__, "n_docs": 13}),
        CorpusSpec(**{**spec.__dict__, "dtype": "float32"}),
    ):
        assert changed.path != spec.path
