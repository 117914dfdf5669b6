"""One sweep arm: its `tidar-convert fit` command, the process run with its output logged, SIGTERM
and Ctrl-C passed on to it."""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from tidar_convert.bench.sweep_curves import metric_files, read_clock


def arm_command(
    recipe: str,
    flags: list[str],
    arm_dir: Path,
    name: str,
    sweep_name: str,
    keep_loggers: bool,
    recipe_cfg: dict,
    resume: bool,
) -> list[str]:
    """`python -m tidar_convert.cli fit --config RECIPE <flags> <this arm's folders>`: the folder
    flags come last, so they win over anything the recipe sets."""
    csv_logger = {
        "class_path": "lightning.pytorch.loggers.CSVLogger",
        "init_args": {"save_dir": str(arm_dir), "name": "csv", "flush_logs_every_n_steps": 1},
    }
    loggers = [csv_logger]
    trainer = recipe_cfg.get("trainer") or {}
    if keep_loggers:
        recipe_loggers = trainer.get("logger")
        recipe_loggers = (
            recipe_loggers
            if isinstance(recipe_loggers, list)
            else [recipe_loggers]
            if isinstance(recipe_loggers, dict)
            else []
        )
        for lg in recipe_loggers:
            path = str(lg.get("class_path", ""))
            if path.endswith("CSVLogger"):
                continue
            args = dict(lg.get("init_args") or {})
            # W&B, TensorBoard...: into the arm's folder, named after the arm
            args["save_dir"] = str(arm_dir)
            if path.endswith("WandbLogger"):
                args["name"] = f"{sweep_name}-{name}"
            loggers.append({"class_path": path, "init_args": args})
    # The recipe's callbacks stay, except checkpoints: one last.ckpt in the arm's folder, saved
    # right after each validation (so a resumed arm never skips the measurement of the step it
    # resumes from).
    callbacks = trainer.get("callbacks") or []
    callbacks = [
        c
        for c in (callbacks if isinstance(callbacks, list) else [callbacks])
        if isinstance(c, dict) and not str(c.get("class_path", "")).endswith("ModelCheckpoint")
    ]
    callbacks.append(
        {
            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
            "init_args": {
                "dirpath": str(arm_dir / "checkpoints"),
                "save_last": True,
                "save_top_k": 0,
                "save_on_train_epoch_end": False,
            },
        }
    )
    cmd = [sys.executable, "-m", "tidar_convert.cli", "fit", "--config", recipe, *flags]
    cmd += [
        "--trainer.default_root_dir",
        str(arm_dir),
        "--trainer.logger",
        json.dumps(loggers),
        "--trainer.callbacks",
        json.dumps(callbacks),
    ]
    if resume:
        cmd += ["--ckpt_path", "last"]
    return cmd


class Forward:
    """While an arm runs, SIGTERM to the sweep goes to the arm too (it saves last.ckpt and
    exits 143)."""

    def __init__(self):
        self.proc, self.received = None, None

    def __enter__(self):
        self.old = signal.getsignal(signal.SIGTERM)
        try:
            signal.signal(signal.SIGTERM, self._handle)
        except ValueError:  # not the main thread: leave signals alone
            self.old = None
        return self

    def _handle(self, signum, frame):
        self.received = signum
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signum)

    def __exit__(self, *exc):
        if self.old is not None:
            signal.signal(signal.SIGTERM, self.old)


def run_arm(name: str, cmd: list[str], arm_dir: Path, wall_before: float, forward: Forward) -> dict:
    """Run one arm, its output to `fit.log` and, prefixed with the arm's name, to stderr."""
    start = time.perf_counter()
    earlier = set(metric_files(arm_dir))
    with (arm_dir / "fit.log").open("a") as log:
        log.write(f"$ {shlex.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
        forward.proc = proc
        try:
            for line in proc.stdout:
                log.write(line)
                log.flush()
                print(f"[{name}] {line.rstrip()}", file=sys.stderr, flush=True)
            rc = proc.wait()
        # Ctrl-C on a terminal reaches the arm too (same process group): let it stop
        except KeyboardInterrupt:
            try:
                try:
                    rc = proc.wait(timeout=5)
                except subprocess.TimeoutExpired:  # only the sweep got it (kill -INT): pass it on
                    proc.send_signal(signal.SIGINT)
                    rc = proc.wait(timeout=120)
            except (subprocess.TimeoutExpired, KeyboardInterrupt):
                proc.kill()
                rc = proc.wait()
            forward.received = signal.SIGINT
        finally:
            forward.proc = None
    times, trained = {}, None
    # this attempt's own metrics, if it got that far
    if new := [p for p in metric_files(arm_dir) if p not in earlier]:
        clock, trained = read_clock(new[-1])
        times = {step: wall_before + seconds for step, seconds in clock.items()}
    return {
        "rc": rc,
        "wall_s": wall_before + time.perf_counter() - start,
        "val_times": times,
        "trained_steps": trained,
        "last_lines": _tail(arm_dir / "fit.log"),
    }


def _tail(path: Path, n: int = 5) -> list[str]:
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return []
    return lines[-n:]


def error_line(lines: list[str]) -> str | None:
    for line in reversed(lines):
        if line.startswith("error:") or "Error" in line or "error" in line:
            return line.strip()
    return lines[-1].strip() if lines else None
