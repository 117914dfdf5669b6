"""What SIGTERM and SIGINT do during `fit`: stop at once before training (nothing to save), save
last.ckpt at a step boundary while training (`Signals`, `Preemption`)."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

# in the run folder: `--ckpt_path last` may then start from scratch
NOTHING_SAVED = "interrupted_before_first_step.json"


class Interrupted(BaseException):
    """SIGTERM or SIGINT while `fit` loads and sets up, before Lightning listens for signals: there
    is no training state to save. A BaseException, like KeyboardInterrupt, so no `except Exception`
    in loading code takes it for an error of its own."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Signals:
    """What SIGTERM and SIGINT (Ctrl-C) do during `tidar-convert fit`, from its start to its end.

    - before training runs (loading the model, building data, setting up): stop at once, say that
      nothing was saved, and leave NOTHING_SAVED in the run folder, so a requeue with
      `--ckpt_path last` starts from scratch instead of failing on the missing checkpoint
      (`train.check_resume`); a run folder that never ran has no such file and is still refused;
    - while training: SIGTERM is Lightning's (it stops at the next step boundary, and `Preemption`
      saves last.ckpt); a first SIGINT does the same, a second stops at once without saving;
    - once training ended (exporting, say), and in any other process (DataLoader workers inherit the
      handler: they leave the decision to the main process), as without this.
    Used as a context manager; `trainer`, `run_dir` and `resume_from` are filled in as they become
    known.
    """

    def __init__(self, active: bool = True):
        self.active = active
        self.signum = None  # the first signal received
        self.count = 0  # SIGINTs received while training
        self.trainer = self.run_dir = self.resume_from = None
        # the run folder did not exist before this fit: a failed fit removes it
        self.new_run_dir = False
        self.done = False
        self.old: dict = {}
        self.pid = os.getpid()
        # one bound method: Lightning's composed handler is told apart from it by identity
        self.handler = self.handle

    def __enter__(self):
        if self.active and threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                self.old[signum] = signal.signal(signum, self.handler)
        return self

    def __exit__(self, *exc) -> None:
        for signum, old in self.old.items():
            signal.signal(signum, old)
        self.old = {}

    def handle(self, signum, frame) -> None:
        if os.getpid() != self.pid:
            return
        lightning_listens = (
            self.trainer is not None and signal.getsignal(signal.SIGTERM) is not self.handler
        )
        if self.done:  # as if this handler had never been installed
            old = self.old.get(signum, signal.SIG_DFL)
            if callable(old):
                return old(signum, frame)  # Python's own for SIGINT: KeyboardInterrupt
            if old != signal.SIG_IGN:
                signal.signal(signum, signal.SIG_DFL)
                signal.raise_signal(signum)
            return
        if lightning_listens:
            self.signum = self.signum or signum
            if signum == signal.SIGINT:
                self.count += 1
                if self.count > 1:
                    raise KeyboardInterrupt
                # stop as SIGTERM stops: at the next step boundary
                self.trainer._signal_connector.received_sigterm = True
                if self.trainer.is_global_zero:
                    text = (
                        "received SIGINT (Ctrl-C): stopping after this step to save a checkpoint; "
                        "press Ctrl-C again to stop at once without saving.\n"
                    )
                    try:
                        sys.stderr.write(text)
                        sys.stderr.flush()
                    except RuntimeError:
                        # the signal landed inside another write to stderr ("reentrant call")
                        os.write(2, text.encode())
            # SIGTERM: Lightning's own handler, called just before this one, has set its flag
            return
        self.signum = signum
        raise Interrupted(signum)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum or signal.SIGTERM).name

    def nothing_saved(self) -> None:
        """Say that the run stopped before its first step with nothing to save; without a checkpoint
        to continue from, leave NOTHING_SAVED for `--ckpt_path last`."""
        from lightning.fabric.utilities.rank_zero import rank_zero_only

        if rank_zero_only.rank != 0:
            return
        # Interrupted while the model loads, a run resuming is not yet told from a new one: its
        # checkpoints say it.
        earlier = self.run_dir is not None and any(
            (Path(self.run_dir) / "checkpoints").glob("last*.ckpt")
        )
        if self.resume_from or earlier:
            print(
                f"received {self.name} before this run's first training step: nothing was saved, "
                "and the checkpoints it would continue from are unchanged. "
                "Run the same command again.",
                file=sys.stderr,
                flush=True,
            )
            return
        if self.run_dir is not None:
            from tidar_convert.exports.outputs import atomic_file

            with atomic_file(Path(self.run_dir) / NOTHING_SAVED) as tmp:
                tmp.write_text(
                    json.dumps({"signal": self.name, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
                    + "\n"
                )
        print(
            f"received {self.name} before the first training step: nothing was saved "
            "(no step was taken). Run the same command again; "
            "with --ckpt_path last it starts from scratch.",
            file=sys.stderr,
            flush=True,
        )


class Preemption(Callback):
    """SIGTERM (what SLURM and Kubernetes send), or SIGINT (Ctrl-C), saves last.ckpt, so a requeued
    job resumes.

    Lightning turns SIGTERM into a SIGTERMException at the next step boundary, after the optimizer
    step, so what is saved is a consistent state (with gradient accumulation, only once the step's
    last micro-batch is trained: see `hold_sigterm_until_step_end`); `Signals` makes a first SIGINT
    do the same. Lightning then exits 0, which a scheduler reads as "finished": `cli.main` exits 143
    (128 + SIGTERM) or 130 (SIGINT) instead. Before the first step there is nothing to save, and it
    says so.
    """

    def __init__(self, signals: Signals | None = None):
        self.signals = signals if signals is not None else Signals(active=False)
        self.stepped = False

    def setup(self, trainer, pl_module, stage) -> None:
        self.signals.trainer = trainer

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.accumulate_grad_batches > 1:
            hold_sigterm_until_step_end(trainer)
        one_last_checkpoint(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.stepped and trainer.global_step >= 1:
            # a step was taken: "stopped before its first step" is no longer true of this run
            # folder
            self.stepped = True
            if trainer.is_global_zero:
                (Path(trainer.default_root_dir) / NOTHING_SAVED).unlink(missing_ok=True)

    def on_train_end(self, trainer, pl_module) -> None:
        self.signals.done = True

    def on_exception(self, trainer, pl_module, exception) -> None:
        if isinstance(exception, KeyboardInterrupt):  # a second Ctrl-C
            if trainer.is_global_zero:
                last = [
                    cb.last_model_path
                    for cb in trainer.checkpoint_callbacks
                    if getattr(cb, "last_model_path", "")
                ]
                kept = (
                    f"the last checkpoint written is {last[0]}"
                    if last
                    else "no checkpoint was written"
                )
                print(
                    f"received SIGINT again: stopped at once at step {trainer.global_step}; "
                    f"nothing was saved at the interrupt ({kept}).",
                    file=sys.stderr,
                    flush=True,
                )
            return
        if not isinstance(exception, SIGTERMException):
            return
        if trainer.global_step == 0:
            self.signals.nothing_saved()
            return
        savers = [
            cb
            for cb in trainer.checkpoint_callbacks
            if isinstance(cb, ModelCheckpoint) and cb.dirpath
        ]
        if savers:
            # Named and recorded as the ModelCheckpoint's own last checkpoint, so the resumed run
            # overwrites it instead of writing last-v1.ckpt beside it.
            path = savers[0].format_checkpoint_name({}, savers[0].CHECKPOINT_NAME_LAST)
            savers[0].last_model_path = path
        else:
            path = str(Path(trainer.default_root_dir) / "checkpoints" / "last.ckpt")
        trainer.save_checkpoint(path)  # every rank: sharded strategies save collectively
        if trainer.is_global_zero:
            print(
                f"received {self.signals.name}: saved {path} at step {trainer.global_step}; "
                "run the same command with --ckpt_path last to continue.",
                file=sys.stderr,
                flush=True,
            )


def one_last_checkpoint(trainer) -> None:
    """A run resumed from its own checkpoint folder writes its last checkpoint over last.ckpt, the
    one `export .../last.ckpt` and the next `--ckpt_path last` take.

    Lightning writes last-v1.ckpt beside a last.ckpt that its callback did not write itself, and it
    tells "itself" by the folder path saved in the checkpoint: in a copied or moved run folder, the
    resumed run then wrote last-v1.ckpt and exports kept taking the old last.ckpt. Called once the
    checkpoint's state is restored (it would set the path back)."""
    resumed = trainer.ckpt_path
    if not resumed or "://" in str(resumed):
        return
    for cb in trainer.checkpoint_callbacks:
        if (
            isinstance(cb, ModelCheckpoint)
            and cb.save_last
            and cb.dirpath
            and Path(resumed).resolve().parent == Path(cb.dirpath).resolve()
        ):
            cb.last_model_path = cb.format_checkpoint_name({}, cb.CHECKPOINT_NAME_LAST)


def hold_sigterm_until_step_end(trainer) -> None:
    """Make Lightning act on a SIGTERM only between optimizer steps, not between micro-batches.

    Lightning checks for SIGTERM after every batch (and, with several ranks, before the next one),
    also between the micro-batches of an accumulated step. Stopping there saves a checkpoint that
    holds neither the gradients of the micro-batches already trained nor the data they came from
    (the data position has moved past them): the resumed run would make that step from the rest of
    its micro-batches alone. Lightning reads the signal through `trainer._signal_connector
    .received_sigterm` everywhere, so that flag reads False while a step is half accumulated.
    """
    connector = trainer._signal_connector
    if isinstance(connector, _HeldSigterm):
        return
    received = connector.__dict__.pop("received_sigterm", False)
    connector.__class__ = type(
        "HeldSigterm" + type(connector).__name__, (_HeldSigterm, type(connector)), {}
    )
    connector.received_sigterm = received


class _HeldSigterm:
    """Mixed into Lightning's signal connector by `hold_sigterm_until_step_end`."""

    @property
    def received_sigterm(self) -> bool:
        trainer = self.trainer
        mid_step = trainer.training and trainer.fit_loop.epoch_loop._should_accumulate()
        return self._sigterm and not mid_step

    @received_sigterm.setter
    def received_sigterm(self, value: bool) -> None:
        self._sigterm = value
