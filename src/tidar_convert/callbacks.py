"""Lightning callbacks: progress by optimizer step, and saving on preemption."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from lightning.pytorch.callbacks import Callback, ModelCheckpoint, ProgressBar
from lightning.pytorch.utilities.exceptions import SIGTERMException

from .progress import duration, is_tty


class TrainProgress(ProgressBar):
    """Training progress by optimizer step, not by epoch: `step 40/100 (40%), loss 2.31, 812 tok/s, ETA 3m10s`.

    Replaces Lightning's bar, whose main line reads "Epoch 0/-2" when a run is bounded by max_steps
    and which prints nothing at all when output is redirected. Tokens are the clean tokens of the
    global batch (every rank, every accumulated micro-batch).
    """

    def __init__(self, interval: float = 30.0):
        super().__init__()
        self.interval = interval
        self._enabled = True
        self.bar = None
        self.tokens = 0
        self.loss = float("nan")

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    @property
    def total(self) -> int | None:
        steps = self.trainer.max_steps
        return steps if steps and steps > 0 else None

    def on_train_start(self, trainer, pl_module) -> None:
        if not (self._enabled and trainer.is_global_zero):
            return
        self.start_step, self.tokens = trainer.global_step, 0
        self.start = self.last = time.perf_counter()
        if is_tty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.total, initial=trainer.global_step, desc="train", unit="step", dynamic_ncols=True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not (self._enabled and trainer.is_global_zero):
            return
        self.tokens += batch["input_ids"].numel() * trainer.world_size
        if isinstance(outputs, dict) and "loss" in outputs:
            self.loss = float(outputs["loss"])
        step, now = trainer.global_step, time.perf_counter()
        tok_s = self.tokens / (now - self.start) if now > self.start else 0.0
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix(loss=f"{self.loss:.3f}", tok_s=f"{tok_s:.0f}", refresh=False)
            self.bar.refresh()
            return
        done = step - self.start_step  # this run's steps only: a resumed run must not look instantly fast
        last = self.total is not None and step >= self.total
        if done == 1 or last or now - self.last >= self.interval:
            self.last = now
            rate = done / (now - self.start)
            text = f"train step {step}/{self.total or '?'}"
            if self.total:
                text += f" ({100 * step / self.total:.0f}%)"
            text += f", loss {self.loss:.3f}, {tok_s:.0f} tok/s, {rate:.2f} steps/s"
            if self.total and not last and rate > 0:
                text += f", ETA {duration((self.total - step) / rate)}"
            print(text, file=sys.stderr, flush=True)

    def on_train_end(self, trainer, pl_module) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def on_validation_end(self, trainer, pl_module) -> None:
        if not (self._enabled and trainer.is_global_zero) or trainer.sanity_checking:
            return
        metrics = trainer.callback_metrics
        shown = {k: float(metrics[k]) for k in ("val/loss", "val/tokens_per_nfe") if k in metrics}
        if shown:
            text = f"validation at step {trainer.global_step}: " + ", ".join(f"{k} {v:.3f}" for k, v in shown.items())
            (self.bar.write if self.bar is not None else lambda s: print(s, file=sys.stderr, flush=True))(text)


class Preemption(Callback):
    """SIGTERM (what SLURM and Kubernetes send) saves last.ckpt, so a requeued job resumes.

    Lightning turns SIGTERM into a SIGTERMException at the next step boundary, after the optimizer
    step, so what is saved is a consistent state (with gradient accumulation, only once the step's
    last micro-batch is trained: see `hold_sigterm_until_step_end`). Lightning then exits 0, which a
    scheduler reads as "finished": `cli.main` exits 143 (128 + SIGTERM) instead.
    """

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.accumulate_grad_batches > 1:
            hold_sigterm_until_step_end(trainer)

    def on_exception(self, trainer, pl_module, exception) -> None:
        if not isinstance(exception, SIGTERMException):
            return
        savers = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint) and cb.dirpath]
        if savers:
            # Named and recorded as the ModelCheckpoint's own last checkpoint, so the resumed run
            # overwrites it instead of writing last-v1.ckpt beside it.
            path = savers[0].format_checkpoint_name({}, savers[0].CHECKPOINT_NAME_LAST)
            savers[0].last_model_path = path
        else:
            path = str(Path(trainer.default_root_dir) / "checkpoints" / "last.ckpt")
        trainer.save_checkpoint(path)  # every rank: sharded strategies save collectively
        if trainer.is_global_zero:
            print(f"received SIGTERM: saved {path} at step {trainer.global_step}; run the same command with --ckpt_path last to continue.", file=sys.stderr, flush=True)


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
    connector.__class__ = type("HeldSigterm" + type(connector).__name__, (_HeldSigterm, type(connector)), {})
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
