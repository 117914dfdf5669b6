"""Lightning callbacks: progress by optimizer step, throughput and memory, and saving on preemption."""

from __future__ import annotations

import copy
import json
import os
import resource
import signal
import sys
import threading
import time
from pathlib import Path

import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, ProgressBar
from lightning.pytorch.utilities.exceptions import SIGTERMException

from .progress import duration, is_tty

STARTED = time.perf_counter()  # about when the process started: fit imports this module before any work


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
        self.start_step, self.tokens, self.shown = trainer.global_step, 0, None
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
        if step == self.shown:  # accumulating: this step was already reported
            return
        if done == 1 or last or now - self.last >= self.interval:
            self.shown = step
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


NOTHING_SAVED = "interrupted_before_first_step.json"  # in the run folder: `--ckpt_path last` may then start from scratch


class Interrupted(BaseException):
    """SIGTERM or SIGINT while `fit` loads and sets up, before Lightning listens for signals: there is
    no training state to save. A BaseException, like KeyboardInterrupt, so no `except Exception` in
    loading code takes it for an error of its own."""

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
    Used as a context manager; `trainer`, `run_dir` and `resume_from` are filled in as they become known.
    """

    def __init__(self, active: bool = True):
        self.active = active
        self.signum = None  # the first signal received
        self.count = 0  # SIGINTs received while training
        self.trainer = self.run_dir = self.resume_from = None
        self.done = False
        self.old: dict = {}
        self.pid = os.getpid()
        self.handler = self.handle  # one bound method: Lightning's composed handler is told apart from it by identity

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
        lightning_listens = self.trainer is not None and signal.getsignal(signal.SIGTERM) is not self.handler
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
                self.trainer._signal_connector.received_sigterm = True  # stop as SIGTERM stops: at the next step boundary
                if self.trainer.is_global_zero:
                    text = "received SIGINT (Ctrl-C): stopping after this step to save a checkpoint; press Ctrl-C again to stop at once without saving.\n"
                    try:
                        sys.stderr.write(text)
                        sys.stderr.flush()
                    except RuntimeError:  # the signal landed inside another write to stderr ("reentrant call")
                        os.write(2, text.encode())
            return  # SIGTERM: Lightning's own handler, called just before this one, has set its flag
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
        # Interrupted while the model loads, a run resuming is not yet told from a new one: its checkpoints say it.
        earlier = self.run_dir is not None and any((Path(self.run_dir) / "checkpoints").glob("last*.ckpt"))
        if self.resume_from or earlier:
            print(
                f"received {self.name} before this run's first training step: nothing was saved, and the checkpoints it "
                "would continue from are unchanged. Run the same command again.", file=sys.stderr, flush=True,
            )
            return
        if self.run_dir is not None:
            from .outputs import atomic_file

            with atomic_file(Path(self.run_dir) / NOTHING_SAVED) as tmp:
                tmp.write_text(json.dumps({"signal": self.name, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}) + "\n")
        print(
            f"received {self.name} before the first training step: nothing was saved (no step was taken). Run the same "
            "command again; with --ckpt_path last it starts from scratch.", file=sys.stderr, flush=True,
        )


class Preemption(Callback):
    """SIGTERM (what SLURM and Kubernetes send), or SIGINT (Ctrl-C), saves last.ckpt, so a requeued job resumes.

    Lightning turns SIGTERM into a SIGTERMException at the next step boundary, after the optimizer
    step, so what is saved is a consistent state (with gradient accumulation, only once the step's
    last micro-batch is trained: see `hold_sigterm_until_step_end`); `Signals` makes a first SIGINT
    do the same. Lightning then exits 0, which a scheduler reads as "finished": `cli.main` exits 143
    (128 + SIGTERM) or 130 (SIGINT) instead. Before the first step there is nothing to save, and it says so.
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
            self.stepped = True  # a step was taken: "stopped before its first step" is no longer true of this run folder
            if trainer.is_global_zero:
                (Path(trainer.default_root_dir) / NOTHING_SAVED).unlink(missing_ok=True)

    def on_train_end(self, trainer, pl_module) -> None:
        self.signals.done = True

    def on_exception(self, trainer, pl_module, exception) -> None:
        if isinstance(exception, KeyboardInterrupt):  # a second Ctrl-C
            if trainer.is_global_zero:
                last = [cb.last_model_path for cb in trainer.checkpoint_callbacks if getattr(cb, "last_model_path", "")]
                kept = f"the last checkpoint written is {last[0]}" if last else "no checkpoint was written"
                print(f"received SIGINT again: stopped at once at step {trainer.global_step}; nothing was saved at the interrupt ({kept}).", file=sys.stderr, flush=True)
            return
        if not isinstance(exception, SIGTERMException):
            return
        if trainer.global_step == 0:
            self.signals.nothing_saved()
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
            print(f"received {self.signals.name}: saved {path} at step {trainer.global_step}; run the same command with --ckpt_path last to continue.", file=sys.stderr, flush=True)


def one_last_checkpoint(trainer) -> None:
    """A run resumed from its own checkpoint folder writes its last checkpoint over last.ckpt, the one
    `export .../last.ckpt` and the next `--ckpt_path last` take.

    Lightning writes last-v1.ckpt beside a last.ckpt that its callback did not write itself, and it
    tells "itself" by the folder path saved in the checkpoint: in a copied or moved run folder, the
    resumed run then wrote last-v1.ckpt and exports kept taking the old last.ckpt. Called once the
    checkpoint's state is restored (it would set the path back)."""
    resumed = trainer.ckpt_path
    if not resumed or "://" in str(resumed):
        return
    for cb in trainer.checkpoint_callbacks:
        if isinstance(cb, ModelCheckpoint) and cb.save_last and cb.dirpath and Path(resumed).resolve().parent == Path(cb.dirpath).resolve():
            cb.last_model_path = cb.format_checkpoint_name({}, cb.CHECKPOINT_NAME_LAST)


class RunClock(Callback):
    """What a sweep reads back from the loggers' metrics rather than from log text: seconds since the
    process started at each validation (`time/val_s`), and the optimizer steps trained once fit
    succeeded (`time/steps_done`; also when a resumed run had no step left, where no training hook
    runs). Both go in the row of the step they follow, as Lightning logs a step."""

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self._log(trainer, {"time/val_s": time.perf_counter() - STARTED})

    def on_fit_end(self, trainer, pl_module) -> None:
        self._log(trainer, {"time/steps_done": trainer.global_step})

    @staticmethod
    def _log(trainer, metrics: dict) -> None:
        for logger in trainer.loggers:  # they write on rank 0 only
            logger.log_metrics(metrics, step=max(trainer.global_step - 1, 0))


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


CHECKPOINT_FIX = "move the run folder to a disk with room (pass its new place as --trainer.default_root_dir); then run the same command with --ckpt_path last to continue."


class AtomicCheckpointIO(TorchCheckpointIO):
    """Checkpoints written whole or not at all: torch.save into a temporary file beside the checkpoint,
    flushed to disk, then renamed over it (outputs.save_file_atomically). A full disk or a kill leaves
    the previous last.ckpt loadable. Lightning's own writes a temporary in the system's temp folder and
    moves it: across filesystems that is a copy into the checkpoint itself, which a full disk cuts
    short. A full disk ends the run with one line (outputs.DiskFull). Remote paths (s3://...) go
    through Lightning's."""

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        if storage_options is not None or "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        from .outputs import save_file_atomically, tensor_bytes

        save_file_atomically(path, lambda f: torch.save(checkpoint, f), tensor_bytes(checkpoint), "the checkpoint", CHECKPOINT_FIX)


def atomic_checkpoints(strategy) -> None:
    """Make the strategy write checkpoints atomically: single files through AtomicCheckpointIO (unless
    the user configured a CheckpointIO of their own); a sharded checkpoint (a folder of one file per
    rank, ModelParallelStrategy) is written under a temporary name and swapped in whole."""
    if type(strategy.checkpoint_io) is TorchCheckpointIO:
        strategy.checkpoint_io = AtomicCheckpointIO()
    if hasattr(strategy, "_save_distributed_checkpoint"):
        strategy.save_checkpoint = _atomic_sharded_save(strategy, strategy.save_checkpoint)


def _atomic_sharded_save(strategy, save):
    """`save` (ModelParallelStrategy.save_checkpoint) into a fresh folder beside the checkpoint, which
    rank 0 swaps in (outputs: renameat2 exchange where available) once every rank wrote its shard."""
    from .outputs import _swap_in, disk_full, no_space, recover, tensor_bytes

    def atomic_save(checkpoint, filepath, storage_options=None):
        if not strategy._save_distributed_checkpoint or storage_options is not None:
            return save(checkpoint, filepath, storage_options)
        import secrets

        dest = Path(strategy.broadcast(str(Path(filepath).absolute())))
        tmp = dest.parent / strategy.broadcast(f".{dest.name}.tmp-{secrets.token_hex(4)}")  # one name, chosen by rank 0
        if strategy.is_global_zero:
            recover(dest)
        strategy.barrier("checkpoint-tmp")
        needed = tensor_bytes(checkpoint) * strategy.world_size  # about: every rank holds a shard of the same size
        failed = None
        try:
            save(checkpoint, tmp)
        except Exception as e:  # still reach the barrier below, so no rank waits there for one that failed
            failed = e
        failures = strategy.all_gather(torch.tensor([int(failed is not None)], device=strategy.root_device)).sum().item()
        if failures:
            if strategy.is_global_zero:
                from .outputs import _rmtree

                _rmtree(tmp)
            if failed is not None and no_space(failed):
                raise disk_full(dest, needed, "the sharded checkpoint", CHECKPOINT_FIX) from failed
            raise failed or RuntimeError(f"another rank failed to write its shard of {dest}; its error says why")
        if strategy.is_global_zero:
            _swap_in(tmp, dest)  # over a folder of shards, or a single-file checkpoint of the same name
        strategy.barrier("checkpoint-swap")

    return atomic_save


def matmul_params(model) -> int:
    """N, the parameters a token multiplies: all but the input embedding (a lookup), unless it is tied to
    the output layer. Counted on a meta-device copy built from the config: under FSDP the live
    parameters are shards, and with LoRA they include the adapters."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(copy.deepcopy(model.config))  # from_config mutates its config
    n = sum(p.numel() for p in base.parameters())  # tied weights are counted once
    inp, out = base.get_input_embeddings(), base.get_output_embeddings()
    return n if out is not None and out.weight is inp.weight else n - inp.weight.numel()


def peak_flops(device: torch.device, precision: str) -> float | None:
    """The device's dense peak FLOP/s at the training precision; None where unknown (CPUs): no MFU then."""
    from lightning.fabric.utilities.throughput import get_available_flops

    dtype = torch.bfloat16 if "bf16" in precision else torch.float16 if precision.startswith("16") else torch.float32
    if device.type == "cuda" and "h200" in torch.cuda.get_device_name(device).lower() and dtype != torch.float32:
        return 989e12  # Lightning knows H200s only by variant names, at the 2:4-sparse figure; dense = H100 SXM
    return get_available_flops(device, dtype)


class Throughput(Callback):
    """Tokens/s and MFU per device, and peak memory of every rank, to the loggers every log_every_n_steps.

    Tokens are training tokens, S per sequence: the unit of the global batch. TiDAR's forward runs 2S
    positions for them (the clean half and the mask half), so with the usual 6N FLOPs per position
    (forward 2N, backward 4N) a training token costs 12N; with LoRA the frozen weights get no weight
    gradient, so 8N; with the halves split (lora_scope='masks': the clean half runs without autograd)
    2N + 4N = 6N. Attention's own FLOPs and activation-checkpointing recompute are left out, as in
    the MFU convention (model FLOPs, not hardware FLOPs). Time is training time: validation is excluded.
    Memory: peak allocated GPU memory on CUDA, and the process's peak RSS (host memory) always.
    """

    def setup(self, trainer, pl_module, stage) -> None:
        self.peak = peak_flops(trainer.strategy.root_device, str(trainer.precision)) if stage == "fit" else None

    def on_train_start(self, trainer, pl_module) -> None:
        full = all(p.requires_grad for p in pl_module.model.parameters())
        per_position = 6 if full else 4
        clean = 2 if getattr(pl_module, "split_halves", False) else per_position  # forward only
        self.flops_per_token = (clean + per_position) * matmul_params(pl_module.model)
        self.step, self.tokens, self.seconds, self.last = trainer.global_step, 0, 0.0, self._now(trainer)

    def _now(self, trainer) -> float:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()  # kernels run asynchronously: the clock must wait for them
        return time.perf_counter()

    def on_validation_end(self, trainer, pl_module) -> None:
        if hasattr(self, "last"):  # not the sanity check before training
            self.last = self._now(trainer)  # the next interval starts after validation

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = self._now(trainer)
        self.seconds, self.last = self.seconds + now - self.last, now
        self.tokens += batch["input_ids"].numel()
        if trainer.global_step == self.step:  # still accumulating: log after optimizer steps only
            return
        self.step = trainer.global_step
        # Same decision on every rank (same step, same loggers), so all join the gather below.
        if self.step % trainer.log_every_n_steps or not trainer.loggers:
            return
        metrics = self.metrics(trainer, pl_module)
        self.tokens, self.seconds = 0, 0.0
        for logger in trainer.loggers:  # the loggers write on rank 0 only
            # Lightning logs a step's loss under its 0-based index: put these figures in the same row.
            logger.log_metrics(metrics, step=trainer.global_step - 1)

    def metrics(self, trainer, pl_module) -> dict[str, float]:
        cuda = trainer.strategy.root_device.type == "cuda"
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)  # KiB on Linux
        gpu = torch.cuda.max_memory_allocated(trainer.strategy.root_device) if cuda else 0
        mine = torch.tensor([self.tokens / self.seconds, rss / 2**30, gpu / 2**30], dtype=torch.float32, device=pl_module.device)  # float32: MPS has no float64
        ranks = trainer.strategy.all_gather(mine).reshape(-1, 3).tolist()  # one row per rank
        per_device = sum(r[0] for r in ranks) / len(ranks)
        metrics = {"perf/tokens_per_sec": per_device * len(ranks), "perf/tokens_per_sec_per_device": per_device}
        metrics["perf/tflops_per_device"] = per_device * self.flops_per_token / 1e12
        if self.peak:
            metrics["perf/mfu_per_device"] = per_device * self.flops_per_token / self.peak
        for i, (_, rss_gib, gpu_gib) in enumerate(ranks):
            metrics[f"perf/peak_rss_gib/rank{i}"] = rss_gib
            if cuda:
                metrics[f"perf/peak_gpu_mem_gib/rank{i}"] = gpu_gib
        return metrics
