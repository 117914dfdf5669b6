"""Issue 7: a killed run resumes the data stream where it stopped, not from its beginning."""

import errno
import hashlib
import json
import os
import re
import shutil
import signal
from pathlib import Path

import pytest
import torch

from tidar_convert.data import PackedDocuments, ResumableLoader


def fingerprint(ids: torch.Tensor) -> str:
    return hashlib.sha1(ids.numpy().tobytes()).hexdigest()[:16]


@pytest.fixture(autouse=True)
def python_sigint():
    """Each test starts from Python's own Ctrl-C (KeyboardInterrupt), what `tidar-convert fit`
    starts from in a shell: in CI's full run an earlier test left SIGINT handled otherwise, and
    these tests check what fit does relative to Python's default."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


@pytest.fixture(scope="module")
def uneven_rows(tmp_path_factory):
    """Documents of uneven lengths, one .txt file each (read without `datasets`: these tests start
    DataLoader workers dozens of times). The long ones all go to the same reader, so with 2 or 3
    workers the readers end their epoch at different batches, with partial batches in between."""
    path = tmp_path_factory.mktemp("uneven")
    for i in range(20):
        (path / f"{i:03d}.txt").write_text(
            f"doc {i:03d} " + "word " * (i % 11) + "long " * (15 * (i % 4 == 1)) + "x" * (i % 5)
        )
    return path


@pytest.mark.parametrize(
    "workers", [0, *(pytest.param(w, marks=pytest.mark.slow) for w in (1, 2, 3))]
)  # worker processes: make test
def test_a_resumed_loader_yields_exactly_the_batches_that_were_still_to_come(
    tokenizer, uneven_rows, workers
):
    """The skip arithmetic, checked at every position of an epoch: consume c batches, save, load
    into a new loader: it yields batches c, c+1, ... of the uninterrupted epoch, in order, and
    nothing else."""

    def loader():
        ds = PackedDocuments(
            tokenizer,
            [str(uneven_rows)],
            16,
            "train",
            10,
            "text",
            None,
            "train",
            0,
            shuffle_buffer=4,
        )
        return ResumableLoader(ds, batch_size=3, num_workers=workers)

    whole = loader()
    states, reference = [whole.state_dict()], []
    for batch in whole:
        batch = whole.count(batch)
        reference.append(batch["input_ids"])
        states.append(whole.state_dict())
    sizes = [len(b) for b in reference]
    # a reader ends before the others
    assert len(reference) >= 12 and (workers < 2 or min(sizes[:-1]) < 3), sizes
    for c, state in enumerate(states):
        resumed = loader()
        resumed.load_state_dict(state)
        rest = [resumed.count(b)["input_ids"] for b in resumed]
        assert [fingerprint(b) for b in rest] == [fingerprint(b) for b in reference[c:]], (
            f"resumed after {c} batches"
        )
        # and the count goes on from the loaded position: it ends where the uninterrupted one did
        assert resumed.state_dict() == states[-1]
    again = [whole.count(b)["input_ids"] for b in whole]  # the next epoch starts from its beginning
    assert [fingerprint(b) for b in again] == [fingerprint(b) for b in reference]


def test_a_position_is_refused_for_other_workers_or_data(tokenizer, uneven_rows):
    def loader(workers=0, seed=0):
        ds = PackedDocuments(
            tokenizer, [str(uneven_rows)], 16, "train", 10, "text", None, "train", seed
        )
        return ResumableLoader(ds, batch_size=3, num_workers=workers)

    state = loader(workers=2).state_dict()
    with pytest.raises(
        ValueError,
        match=(
            "saved with --data.num_workers 2 and this run has 0.*resume with --data.num_workers 2"
        ),
    ):
        loader().load_state_dict(state)
    with pytest.raises(ValueError, match="other data settings"):
        loader(workers=2, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match=r"persistent_workers=True\) is not supported"):
        ResumableLoader(loader().dataset, batch_size=3, num_workers=2, persistent_workers=True)


# --------------------------------------------------------------------------------------------
# End to end: `tidar-convert fit` stopped, then resumed with --ckpt_path last, sees exactly the
# chunks of an uninterrupted run, step for step.
# --------------------------------------------------------------------------------------------

RECIPE = str(Path(__file__).parents[1] / "recipes" / "tiny.yaml")


class Killed(Exception):
    """Stands for SIGKILL: the run ends at once, nothing is saved beyond the last checkpoint."""


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    """A jsonl of unique documents, a few training steps per epoch: every run below crosses
    epochs."""
    path = tmp_path_factory.mktemp("small") / "code.jsonl"
    rows = [
        {"text": f"def f_{i}(x, y):\n    z = x + {i * 7 % 100}\n    return z * y - {i}\n"}
        for i in range(36)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def steps(monkeypatch):
    """Records what each optimizer step trained on: {global_step: [(epoch, chunk fingerprints, loss)
    per micro-batch]}. `steps.kill_at = n` ends the run (Killed) when step n is about to train;
    `steps.sigterm_at = (n, m)` delivers a SIGTERM, as Lightning's handler records it, while
    micro-batch m of step n trains; `steps.signal_at = (n, signum, times)` sends the process a real
    signal, `times` times, as step n starts."""
    from tidar_convert.train.module import TiDARModule

    original = TiDARModule.training_step

    class Steps(dict):
        kill_at = sigterm_at = signal_at = None

    seen = Steps()

    def recording(module, batch, batch_idx):
        step = module.global_step
        if step == seen.kill_at:
            raise Killed(f"killed before step {step}")
        if (step, len(seen.get(step, []))) == seen.sigterm_at:
            module.trainer._signal_connector.received_sigterm = True
        if seen.signal_at and seen.signal_at[0] == step and step not in seen:
            for _ in range(seen.signal_at[2]):
                os.kill(os.getpid(), seen.signal_at[1])
        loss = original(module, batch, batch_idx)
        seen.setdefault(step, []).append(
            (module.current_epoch, [fingerprint(row) for row in batch["input_ids"]], loss.item())
        )
        return loss

    monkeypatch.setattr(TiDARModule, "training_step", recording)
    return seen


def assert_same_steps(name, got, expected, steps):
    """The same chunks in the same epochs, micro-batch by micro-batch, and the same losses."""
    for s in steps:
        assert [r[:2] for r in got[s]] == [r[:2] for r in expected[s]], (
            f"{name}: step {s} saw other chunks than the uninterrupted run"
        )
        assert [r[2] for r in got[s]] == pytest.approx(
            [r[2] for r in expected[s]], rel=1e-4, abs=1e-5
        ), f"{name}: losses at step {s}"


def check_reference(whole, total):
    """The uninterrupted run: `total` steps, each chunk once per epoch; its epoch of each step."""
    assert sorted(whole) == list(range(total))
    epochs = [whole[s][-1][0] for s in range(total)]
    for epoch in set(epochs):
        chunks = [c for s in range(total) for e, fps, _ in whole[s] if e == epoch for c in fps]
        assert len(chunks) == len(set(chunks)), f"epoch {epoch} repeats chunks"
    return epochs


def saved_step(run, workers) -> int:
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
    # where Lightning keeps ResumableLoader.state_dict()
    [position] = ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert position["readers"] == max(1, workers)
    return ckpt["global_step"]


def fit(run, model_dir, corpus, workers, max_steps, *extra):
    from tidar_convert.cli import main

    main([
        "fit", "--config", RECIPE, "--model.model", str(model_dir),
        "--data.source", str(corpus), "--data.num_workers", str(workers),
        "--trainer.default_root_dir", str(run), "--trainer.logger", "false",
        "--trainer.max_steps", str(max_steps), "--data.val_every", "4",
        "--trainer.num_sanity_val_steps", "0", *extra,
    ])  # fmt: skip


@pytest.mark.fit
@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_fit_sees_exactly_the_chunks_of_an_uninterrupted_one(
    tmp_path, tiny_dirs, small_corpus, steps, workers, capsys
):
    total = 20
    model = tiny_dirs["qwen2"]
    fit(tmp_path / "whole", model, small_corpus, workers, total)
    whole = dict(steps)
    epochs = check_reference(whole, total)
    epoch_end = epochs.index(1)  # steps in the first epoch
    # the runs below cross epoch ends before and after the checkpoint
    assert 3 <= epoch_end < 10 and epochs[-1] >= 2, epochs

    def interrupted(name, stop, kill, every=10):
        """Stop a run at step `stop` (killed, or by max_steps) with checkpoints every `every` steps,
        resume it with --ckpt_path last up to `total` steps: (the step of the checkpoint it resumed
        from, steps trained before, steps after)."""
        run = tmp_path / name
        # replaces tiny.yaml's callbacks (one ModelCheckpoint, every 10 steps)
        checkpoints = tmp_path / f"{name}.yaml"
        checkpoints.write_text(
            "trainer:\n  callbacks:\n"
            "    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n"
            f"      init_args: {{save_last: true, save_top_k: 0, every_n_train_steps: {every}}}\n"
        )
        steps.clear()
        steps.kill_at = stop if kill else None
        try:
            fit(
                run,
                model,
                small_corpus,
                workers,
                total if kill else stop,
                "--config",
                str(checkpoints),
            )
        except Killed:
            pass
        before = dict(steps)
        saved = saved_step(run, workers)
        steps.clear()
        steps.kill_at = None
        capsys.readouterr()
        fit(
            run,
            model,
            small_corpus,
            workers,
            total,
            "--config",
            str(checkpoints),
            "--ckpt_path",
            "last",
        )
        # resumed inside an epoch: says why its first step takes longer
        if epochs[saved] == epochs[saved - 1]:
            assert "resuming the training data after the" in capsys.readouterr().err
        after = dict(steps)
        assert sorted(after) == list(range(saved, total)), (
            f"{name}: the resumed run trained steps {sorted(after)} after a checkpoint at {saved}"
        )
        return saved, before, after

    scenarios = (
        ("killed between checkpoints", 13, True, 10, 10),  # steps 10-12 are lost and trained again
        (
            "killed after a checkpoint at the end of an epoch",
            epoch_end + 1,
            True,
            epoch_end,
            epoch_end,
        ),
        ("stopped by max_steps at the end of an epoch", epoch_end, False, 10, epoch_end),
    )
    # With workers, the unit test above already resumes at every position of an epoch: here only the
    # first scenario, which crosses the epoch end where one worker's reader runs out before
    # the other.
    for name, stop, kill, every, expected in scenarios if workers == 0 else scenarios[:1]:
        saved, before, after = interrupted(name.replace(" ", "_"), stop, kill, every)
        assert saved == expected, name
        assert_same_steps(name + ", before the stop", before, whole, range(saved))
        assert_same_steps(name + ", resumed", after, whole, range(saved, total))


@pytest.mark.fit
def test_sigterm_during_gradient_accumulation_resumes_on_the_same_chunks(
    tmp_path, tiny_dirs, small_corpus, steps
):
    """The paper recipes accumulate gradients: a SIGTERM while a micro-batch trains saves at the end
    of that optimizer step, and the resumed run goes on from the next one."""
    total, accumulate = 10, ["--trainer.accumulate_grad_batches", "2"]
    model = tiny_dirs["qwen2"]
    fit(tmp_path / "whole", model, small_corpus, 0, total, *accumulate)
    whole = dict(steps)
    check_reference(whole, total)
    assert all(
        len(whole[s]) == 2
        for s in range(total)
        if s + 1 < total and whole[s + 1][0][0] == whole[s][0][0]
    )
    steps.clear()
    steps.sigterm_at = (5, 0)  # while the first of step 5's two micro-batches trains
    with pytest.raises(SystemExit) as exit:
        fit(tmp_path / "run", model, small_corpus, 0, total, *accumulate)
    assert exit.value.code == 143
    before = dict(steps)
    assert saved_step(tmp_path / "run", 0) == 6 and sorted(before) == list(range(6))
    assert_same_steps("before SIGTERM", before, whole, range(6))
    steps.clear()
    steps.sigterm_at = None
    fit(tmp_path / "run", model, small_corpus, 0, total, *accumulate, "--ckpt_path", "last")
    after = dict(steps)
    assert sorted(after) == list(range(6, total))
    assert_same_steps("resumed after SIGTERM", after, whole, range(6, total))


# --------------------------------------------------------------------------------------------
# Issue 31: a checkpoint is written whole or not at all, and a resumed run writes the last.ckpt
# that `export` and the next `--ckpt_path last` take.
# --------------------------------------------------------------------------------------------


def every(tmp_path, n: int) -> list[str]:
    """A --config replacing tiny.yaml's checkpoints with one ModelCheckpoint saving last.ckpt every
    n steps."""
    path = tmp_path / f"every{n}.yaml"
    path.write_text(
        "trainer:\n  callbacks:\n    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n"
        f"      init_args: {{save_last: true, save_top_k: 0, every_n_train_steps: {n}}}\n"
    )
    return ["--config", str(path)]


def last_step(run: Path) -> int:
    return torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["global_step"]


class FillsUp:
    """A file that takes `room` bytes, writes them, then fails as a full disk does (ENOSPC)."""

    def __init__(self, f, room: int):
        self.f, self.room, self.written = f, room, 0

    def write(self, data) -> int:
        n = len(memoryview(data).cast("B"))
        if self.written + n > self.room:
            self.f.write(bytes(memoryview(data).cast("B")[: self.room - self.written]))
            self.written = self.room
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.written += n
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


@pytest.mark.fit
def test_a_full_disk_while_saving_leaves_the_previous_last_ckpt_whole_and_ends_in_one_line(
    tmp_path, tiny_dirs, small_corpus, monkeypatch, capsys
):
    """Probe (issue 31): a full disk during fit left a truncated last.ckpt, and resume and export
    then failed."""
    from tidar_convert.exports import disk

    run, model = tmp_path / "run", tiny_dirs["qwen2"]
    fit(run, model, small_corpus, 0, 2, *every(tmp_path, 2))
    before = (run / "checkpoints" / "last.ckpt").read_bytes()
    files = []

    # every checkpoint write finds room for half the checkpoint
    def full_disk(path, mode="r", *args, **kwargs):
        f = open(path, mode, *args, **kwargs)
        if "w" in mode and str(path).endswith(".ckpt"):
            files.append(FillsUp(f, len(before) // 2))
            return files[-1]
        return f

    monkeypatch.setattr(disk, "open", full_disk, raising=False)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit:
        fit(run, model, small_corpus, 0, 4, *every(tmp_path, 2), "--ckpt_path", "last")
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert files and files[0].written == len(before) // 2  # the write got partway
    assert (
        "Traceback" not in err and sum(line.startswith("error: ") for line in err.splitlines()) == 1
    ), err
    folder = re.escape(str(run.resolve() / "checkpoints"))
    assert re.search(
        rf"error: no space left in {folder} for the checkpoint last.ckpt: it needs about \d.*"
        r"(and the disk has \d.* free|shows free now\)) "
        r"\(last.ckpt there is the earlier one, whole\)\. "
        r".*--trainer.default_root_dir.*--ckpt_path last",
        err,
    ), err
    assert (run / "checkpoints" / "last.ckpt").read_bytes() == before
    # no partial file left
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["last.ckpt"]
    monkeypatch.undo()
    assert last_step(run) == 2
    fit(run, model, small_corpus, 0, 4, *every(tmp_path, 2), "--ckpt_path", "last")
    assert last_step(run) == 4


@pytest.mark.fit
def test_resuming_in_a_copied_run_folder_writes_its_last_ckpt(tmp_path, tiny_dirs, small_corpus):
    """Probe (issue 31): `--ckpt_path last` in a copied run folder wrote last-v1.ckpt, and
    `export .../last.ckpt` then took the old one."""
    model = tiny_dirs["qwen2"]
    fit(tmp_path / "a", model, small_corpus, 0, 2, *every(tmp_path, 2))
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    fit(tmp_path / "b", model, small_corpus, 0, 4, *every(tmp_path, 2), "--ckpt_path", "last")
    assert sorted(p.name for p in (tmp_path / "b" / "checkpoints").iterdir()) == ["last.ckpt"]
    assert last_step(tmp_path / "b") == 4 and last_step(tmp_path / "a") == 2


@pytest.mark.fit
def test_a_resumed_fit_logs_to_the_same_wandb_run(tmp_path, tiny_dirs, small_corpus, monkeypatch):
    """Issue 48: `--ckpt_path last` continued the checkpoint but opened a new W&B run; the
    checkpoint records the run's id and the resume logs into it (W&B offline here)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    logger = json.dumps(
        {"class_path": "lightning.pytorch.loggers.WandbLogger", "init_args": {"project": "t"}}
    )
    run, model = tmp_path / "run", tiny_dirs["llama"]
    fit(run, model, small_corpus, 0, 2, *every(tmp_path, 2), "--trainer.logger", logger)
    first = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["wandb_run_id"]
    fit(run, model, small_corpus, 0, 4, *every(tmp_path, 2), "--trainer.logger", logger,
        "--ckpt_path", "last")  # fmt: skip
    runs = sorted(p.name for p in run.rglob("offline-run-*") if p.is_dir())
    # W&B names a run's folder by its start second and id, and adds "-1" when two runs of one id
    # start within the same second
    folder = re.compile(rf"offline-run-\d{{8}}_\d{{6}}-{first}(-\d+)?")
    assert len(runs) == 2 and all(folder.fullmatch(name) for name in runs), (first, runs)
    assert last_step(run) == 4


# --------------------------------------------------------------------------------------------
# Issue 31: interruptions say what they did. Ctrl-C saves as SIGTERM does; before the first step
# there is nothing to save, and a requeue with --ckpt_path last then starts from scratch.
# --------------------------------------------------------------------------------------------


@pytest.mark.fit
def test_ctrl_c_saves_a_checkpoint_says_so_and_resumes(
    tmp_path, tiny_dirs, small_corpus, steps, capsys
):
    """Probe (issue 31): SIGINT at step 23 exited 1, without a word, and saved nothing."""
    run, model = tmp_path / "run", tiny_dirs["qwen2"]
    steps.signal_at = (3, signal.SIGINT, 1)
    with pytest.raises(SystemExit) as exit:
        fit(run, model, small_corpus, 0, 10)
    assert exit.value.code == 130
    err = capsys.readouterr().err
    last = (run / "checkpoints" / "last.ckpt").resolve()
    assert (
        "received SIGINT (Ctrl-C): stopping after this step to save a "
        "checkpoint; press Ctrl-C again to stop at once without saving." in err
    )
    assert (
        f"received SIGINT: saved {last} at step 4; run the "
        "same command with --ckpt_path last to continue." in err
    ), err
    assert saved_step(run, 0) == 4 and sorted(steps) == [0, 1, 2, 3]
    steps.clear()
    steps.signal_at = None
    fit(run, model, small_corpus, 0, 6, "--ckpt_path", "last")
    assert sorted(steps) == [4, 5] and saved_step(run, 0) == 6


@pytest.mark.fit
def test_a_second_ctrl_c_stops_at_once_and_says_nothing_was_saved(
    tmp_path, tiny_dirs, small_corpus, steps, capsys
):
    run = tmp_path / "run"
    steps.signal_at = (3, signal.SIGINT, 2)
    with pytest.raises(SystemExit) as exit:
        fit(run, tiny_dirs["qwen2"], small_corpus, 0, 10)
    assert exit.value.code == 130
    assert (
        "received SIGINT again: stopped at once at step 3; nothing "
        "was saved at the interrupt (no checkpoint was written)." in capsys.readouterr().err
    )
    assert not (run / "checkpoints" / "last.ckpt").exists()


@pytest.mark.fit
@pytest.mark.parametrize(
    "when, signum",
    [("loading", signal.SIGTERM), ("loading", signal.SIGINT), ("sanity check", signal.SIGTERM)],
)
def test_a_signal_before_the_first_step_says_nothing_was_saved_and_the_requeue_starts_cleanly(
    tmp_path, tiny_dirs, small_corpus, steps, monkeypatch, capsys, when, signum
):
    """Probe (issue 31): SIGTERM before step 1 exited 143 without a word, and the documented requeue
    with --ckpt_path last then failed on the missing checkpoint."""
    from tidar_convert.train.module import TiDARModule
    from tidar_convert.train.preemption import NOTHING_SAVED

    run, model = tmp_path / "run", tiny_dirs["qwen2"]
    # before Lightning listens for SIGTERM, and after
    hook = "configure_model" if when == "loading" else "validation_step"
    original = getattr(TiDARModule, hook)

    def interrupted(module, *args):
        os.kill(os.getpid(), signum)
        return original(module, *args)

    monkeypatch.setattr(TiDARModule, hook, interrupted)
    with pytest.raises(SystemExit) as exit:
        fit(run, model, small_corpus, 0, 3, "--trainer.num_sanity_val_steps", "2")
    assert exit.value.code == 128 + signum
    name = signal.Signals(signum).name
    err = capsys.readouterr().err
    assert (
        f"received {name} before the first training step: nothing was saved (no step was taken). "
        "Run the same command again; with --ckpt_path last it starts from scratch." in err
    ), err
    assert (
        not steps and not list(run.glob("checkpoints/*.ckpt")) and (run / NOTHING_SAVED).is_file()
    )
    monkeypatch.setattr(TiDARModule, hook, original)
    fit(run, model, small_corpus, 0, 3, "--ckpt_path", "last")
    assert (
        f"--ckpt_path last: the run in {run} was stopped by {name} "
        "before its first step and saved nothing: starting from scratch." in capsys.readouterr().err
    )
    assert sorted(steps) == [0, 1, 2] and saved_step(run, 0) == 3
    # it took a step: a later --ckpt_path last without a checkpoint is refused again
    assert not (run / NOTHING_SAVED).exists()


@pytest.mark.fit
def test_ctrl_c_once_training_ended_is_a_keyboard_interrupt_as_ever(
    tmp_path, tiny_dirs, small_corpus, monkeypatch, capsys
):
    """While `fit --out` exports, training is over: Ctrl-C is Python's own KeyboardInterrupt, not a
    "stopped before the first step" (the export is atomic, and last.ckpt is already written)."""
    import sys

    from tidar_convert.train.preemption import NOTHING_SAVED

    def interrupted(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)

    # the package's `export` is the function
    monkeypatch.setattr(sys.modules["tidar_convert.exports.folder"], "export", interrupted)
    run = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        fit(
            run,
            tiny_dirs["qwen2"],
            small_corpus,
            0,
            2,
            *every(tmp_path, 2),
            "--out",
            str(tmp_path / "out"),
        )
    assert "before the first training step" not in capsys.readouterr().err
    assert saved_step(run, 0) == 2 and not (run / NOTHING_SAVED).exists()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back as it was


# --------------------------------------------------------------------------------------------
# Issue 48: the schedule is transformers' get_cosine_with_min_lr_schedule_with_warmup, drawn as
# docs/convert.md says (warmup from 0, cosine to lr x min_lr_ratio), and it resumes exactly.
# --------------------------------------------------------------------------------------------


def schedule_of(warmup_ratio, min_lr_ratio, max_steps, lr=1e-3):
    """TiDARModule.configure_optimizers on a one-layer model: (optimizer, scheduler)."""
    from types import SimpleNamespace

    from tidar_convert.train.module import TiDARModule

    module = SimpleNamespace(
        model=torch.nn.Linear(2, 2),
        optimizer_factory=lambda params: torch.optim.AdamW(params, lr=lr),
        trainer=SimpleNamespace(max_steps=max_steps, estimated_stepping_batches=None),
        warmup_ratio=warmup_ratio,
        min_lr_ratio=min_lr_ratio,
    )
    out = TiDARModule.configure_optimizers(module)
    assert out["lr_scheduler"]["interval"] == "step"
    return out["optimizer"], out["lr_scheduler"]["scheduler"]


def documented_lr(step, lr, warmup_ratio, min_lr_ratio, total):
    import math

    warmup = int(warmup_ratio * total)
    if step < warmup:
        return lr * step / warmup
    progress = (step - warmup) / (total - warmup)
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def lrs(optimizer, scheduler, steps):
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


@pytest.mark.parametrize("warmup_ratio, min_lr_ratio", [(0.1, 0.3), (0.0, 0.1), (0.03, 1.0)])
def test_the_schedule_is_the_documented_warmup_then_cosine(warmup_ratio, min_lr_ratio):
    total = 100
    optimizer, scheduler = schedule_of(warmup_ratio, min_lr_ratio, total)
    got = lrs(optimizer, scheduler, total + 1)
    expected = [documented_lr(s, 1e-3, warmup_ratio, min_lr_ratio, total) for s in range(total + 1)]
    assert got == pytest.approx(expected, rel=1e-9, abs=1e-15)
    assert got[-1] == pytest.approx(1e-3 * min_lr_ratio)


def test_a_resumed_schedule_continues_exactly_and_takes_a_changed_shape():
    """Lightning restores the scheduler's state into the one configure_optimizers builds: the same
    lr at every later step; a changed min_lr_ratio (resume.MODEL_FREE) applies from the step after
    the resumed one, as resume.py says."""
    import io

    total, stop = 50, 17
    optimizer, scheduler = schedule_of(0.1, 0.3, total)
    whole = lrs(optimizer, scheduler, total)
    optimizer, scheduler = schedule_of(0.1, 0.3, total)
    lrs(optimizer, scheduler, stop)
    buffer = io.BytesIO()
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    for min_lr_ratio in (0.3, 0.5):
        optimizer, scheduler = schedule_of(0.1, min_lr_ratio, total)
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        after = lrs(optimizer, scheduler, total - stop)
        if min_lr_ratio == 0.3:
            assert after == whole[stop:]
        expected = [documented_lr(s, 1e-3, 0.1, min_lr_ratio, total) for s in range(stop, total)]
        assert after[0] == whole[stop] and after[1:] == pytest.approx(expected[1:], rel=1e-9)


# --------------------------------------------------------------------------------------------
# Issue 48: a LoRA run's checkpoint holds what it trains and the optimizer, not the frozen base;
# the base model it names refills the rest, and a resume is exact.
# --------------------------------------------------------------------------------------------


@pytest.mark.fit
def test_a_lora_checkpoint_holds_only_what_trains_and_resumes_exactly(
    tmp_path, tiny_dirs, small_corpus, steps
):
    from safetensors.torch import load_file, save_file

    from tidar_convert.cli import export_cmd
    from tidar_convert.exports.disk import tensor_bytes

    base = tmp_path / "base"
    shutil.copytree(tiny_dirs["llama"], base)
    lora = ["--model.lora_r", "4", *every(tmp_path, 4)]
    fit(tmp_path / "whole", base, small_corpus, 0, 8, *lora)
    whole = dict(steps)
    steps.clear()
    steps.kill_at = 6  # the checkpoint of step 4 survives
    with pytest.raises(Killed):
        fit(tmp_path / "run", base, small_corpus, 0, 8, *lora)
    steps.clear()
    steps.kill_at = None
    fit(tmp_path / "run", base, small_corpus, 0, 8, *lora, "--ckpt_path", "last")
    assert sorted(steps) == [4, 5, 6, 7]
    assert_same_steps("resumed LoRA run", dict(steps), whole, range(4, 8))

    def checkpoint(run):
        return torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)

    a, b = checkpoint(tmp_path / "whole"), checkpoint(tmp_path / "run")
    assert a["state_dict"].keys() == b["state_dict"].keys()
    assert all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"])
    # nothing frozen: the adapters and the mask token's row, which the optimizer holds
    trained = tensor_bytes(a["state_dict"])
    assert all("lora_" in k or "trainable_tokens" in k for k in a["state_dict"]), a["state_dict"]
    optimizer = tensor_bytes(a["optimizer_states"])
    assert optimizer == 2 * trained + 4 * len(a["state_dict"])  # AdamW's two moments and its steps
    size = (tmp_path / "whole" / "checkpoints" / "last.ckpt").stat().st_size
    base_bytes = (base / "model.safetensors").stat().st_size
    assert size < trained + optimizer + 64 * 1024 and size < base_bytes / 2, (size, trained)

    # export refills the frozen weights from the base, and refuses a base that changed since
    ckpt = str(tmp_path / "whole" / "checkpoints" / "last.ckpt")
    export_cmd(ckpt, str(tmp_path / "out"))
    weights = load_file(base / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] + 1
    save_file(weights, base / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError) as refused:
        export_cmd(ckpt, str(tmp_path / "out2"))
    assert (
        f"the checkpoint holds only the weights its LoRA run trained; the frozen ones come from "
        f"its base model {str(base)!r}, whose model.safetensors is not the one it was trained on"
        in str(refused.value)
    ) and "Put back the base model it was trained from" in str(refused.value)
    assert not (tmp_path / "out2").exists()
