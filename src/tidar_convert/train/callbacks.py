"""Lightning callbacks that report: progress by optimizer step, the run's clock for sweeps,
throughput and memory.

Saving on preemption is in preemption.py, checkpoints written whole in checkpoints.py."""

from __future__ import annotations

import copy
import resource
import sys
import time

import torch
from lightning.pytorch.callbacks import Callback, ProgressBar

from tidar_convert.train.progress import duration, is_tty

# about when the process started: fit imports this module before any work
STARTED = time.perf_counter()


class TrainProgress(ProgressBar):
    """Training progress by optimizer step, not by epoch:
    `step 40/100 (40%), loss 2.31, 812 tok/s, ETA 3m10s`.

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

            self.bar = tqdm(
                total=self.total,
                initial=trainer.global_step,
                desc="train",
                unit="step",
                dynamic_ncols=True,
            )

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
        # this run's steps only: a resumed run must not look instantly fast
        done = step - self.start_step
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
            text = f"validation at step {trainer.global_step}: " + ", ".join(
                f"{k} {v:.3f}" for k, v in shown.items()
            )
            (
                self.bar.write
                if self.bar is not None
                else lambda s: print(s, file=sys.stderr, flush=True)
            )(text)


class RunClock(Callback):
    """What a sweep reads back from the loggers' metrics rather than from log text: seconds since
    the process started at each validation (`time/val_s`), and the optimizer steps trained once fit
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


def matmul_params(model) -> int:
    """N, the parameters a token multiplies: all but the input embedding (a lookup), unless it is
    tied to the output layer. Counted on a meta-device copy built from the config: under FSDP the
    live parameters are shards, and with LoRA they include the adapters."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        # from_config mutates its config
        base = AutoModelForCausalLM.from_config(copy.deepcopy(model.config))
    n = sum(p.numel() for p in base.parameters())  # tied weights are counted once
    inp, out = base.get_input_embeddings(), base.get_output_embeddings()
    return n if out is not None and out.weight is inp.weight else n - inp.weight.numel()


def peak_flops(device: torch.device, precision: str) -> float | None:
    """The device's dense peak FLOP/s at the training precision; None where unknown (CPUs): no MFU
    then."""
    from lightning.fabric.utilities.throughput import get_available_flops

    dtype = (
        torch.bfloat16
        if "bf16" in precision
        else torch.float16
        if precision.startswith("16")
        else torch.float32
    )
    if (
        device.type == "cuda"
        and "h200" in torch.cuda.get_device_name(device).lower()
        and dtype != torch.float32
    ):
        # Lightning knows H200s only by variant names, at the 2:4-sparse figure; dense = H100 SXM
        return 989e12
    return get_available_flops(device, dtype)


def flops_per_token(module) -> int:
    """Model FLOPs a training token costs a TiDARModule: Throughput's docstring says how."""
    full = all(p.requires_grad for p in module.model.parameters())
    per_position = 6 if full else 4
    clean = 2 if getattr(module, "split_halves", False) else per_position  # forward only
    return (clean + per_position) * matmul_params(module.model)


class Throughput(Callback):
    """Tokens/s and MFU per device, and peak memory of every rank, to the loggers every
    log_every_n_steps.

    Tokens are training tokens, S per sequence: the unit of the global batch. TiDAR's forward runs
    2S positions for them (the clean half and the mask half), so with the usual 6N FLOPs per
    position (forward 2N, backward 4N) a training token costs 12N; with LoRA the frozen weights get
    no weight gradient, so 8N; with the halves split (lora_scope='masks': the clean half runs
    without autograd) 2N + 4N = 6N. Attention's own FLOPs and activation-checkpointing recompute are
    left out, as in the MFU convention (model FLOPs, not hardware FLOPs). Time is training time:
    validation is excluded. Memory: peak allocated GPU memory on CUDA, and the process's peak RSS
    (host memory) always.
    """

    def setup(self, trainer, pl_module, stage) -> None:
        self.peak = (
            peak_flops(trainer.strategy.root_device, str(trainer.precision))
            if stage == "fit"
            else None
        )

    def on_train_start(self, trainer, pl_module) -> None:
        self.flops_per_token = flops_per_token(pl_module)
        self.step, self.tokens, self.seconds, self.last = (
            trainer.global_step,
            0,
            0.0,
            self._now(trainer),
        )

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
            # Lightning logs a step's loss under its 0-based index: put these figures in the same
            # row.
            logger.log_metrics(metrics, step=trainer.global_step - 1)

    def metrics(self, trainer, pl_module) -> dict[str, float]:
        cuda = trainer.strategy.root_device.type == "cuda"
        # KiB on Linux
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (
            1 if sys.platform == "darwin" else 1024
        )
        gpu = torch.cuda.max_memory_allocated(trainer.strategy.root_device) if cuda else 0
        # float32: MPS has no float64
        mine = torch.tensor(
            [self.tokens / self.seconds, rss / 2**30, gpu / 2**30],
            dtype=torch.float32,
            device=pl_module.device,
        )
        ranks = trainer.strategy.all_gather(mine).reshape(-1, 3).tolist()  # one row per rank
        per_device = sum(r[0] for r in ranks) / len(ranks)
        metrics = {
            "perf/tokens_per_sec": per_device * len(ranks),
            "perf/tokens_per_sec_per_device": per_device,
        }
        metrics["perf/tflops_per_device"] = per_device * self.flops_per_token / 1e12
        if self.peak:
            metrics["perf/mfu_per_device"] = per_device * self.flops_per_token / self.peak
        for i, (_, rss_gib, gpu_gib) in enumerate(ranks):
            metrics[f"perf/peak_rss_gib/rank{i}"] = rss_gib
            if cuda:
                metrics[f"perf/peak_gpu_mem_gib/rank{i}"] = gpu_gib
        return metrics
