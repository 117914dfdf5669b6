"""A sweep arm's learning curve, read from its CSV metrics: `val/*` by optimizer step, the run's
clock (callbacks.RunClock), training tokens per step from its saved config; one arm's summary, and
the plot."""

from __future__ import annotations

import csv
import math
from pathlib import Path


def tokens_per_step(config_path: Path) -> tuple[int | None, dict]:
    """Clean training tokens per optimizer step from an arm's saved config.yaml, and the values
    used."""
    import yaml

    try:
        cfg = yaml.safe_load(config_path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return None, {}
    data, trainer, model = cfg.get("data") or {}, cfg.get("trainer") or {}, cfg.get("model") or {}
    devices, notes = trainer.get("devices", 1), []
    if isinstance(devices, list):
        devices = len(devices)
    elif isinstance(devices, str) and devices.strip().isdigit():
        devices = int(devices)
    if not isinstance(devices, int) or devices < 1:
        notes.append(f"trainer.devices={trainer.get('devices')!r} counted as 1 device")
        devices = 1
    used = {
        "batch_size": int(data.get("batch_size") or 1),
        "seq_len": int(data.get("seq_len") or 0),
        "accumulate_grad_batches": int(trainer.get("accumulate_grad_batches") or 1),
        "devices": devices,
        "num_nodes": int(trainer.get("num_nodes") or 1),
        "max_steps": trainer.get("max_steps"),
        "draft_length": model.get("draft_length"),
        "decode_draft_length": model.get("val_decode_draft_length") or model.get("draft_length"),
    }
    if notes:
        used["notes"] = notes
    n = (
        used["batch_size"]
        * used["seq_len"]
        * used["accumulate_grad_batches"]
        * used["devices"]
        * used["num_nodes"]
    )
    return n or None, used


def _finite(value: str | None) -> float | None:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _version(path: Path) -> int:
    """N of csv/version_N/metrics.csv: the attempts of an arm in the order they ran."""
    n = path.parent.name.rsplit("_", 1)[-1]
    return int(n) if n.isdigit() else -1


def metric_files(arm_dir: Path) -> list[Path]:
    return sorted(arm_dir.glob("csv/version_*/metrics.csv"), key=_version)


def read_curve(arm_dir: Path) -> dict[int, dict]:
    """{optimizer steps done: {metric: value}} of every `val/*` metric in the arm's CSV logs.

    Lightning logs a validation with step = steps done - 1. Several csv/version_* folders are the
    attempts of a resumed arm, read in order so the latest attempt's value for a step wins.
    """
    points: dict[int, dict] = {}
    for path in metric_files(arm_dir):
        with path.open(newline="") as f:
            for row in csv.DictReader(f):
                values = {
                    k[4:]: _finite(v)
                    for k, v in row.items()
                    if k and k.startswith("val/") and v not in (None, "")
                }
                if not values or not (row.get("step") or "").isdigit():
                    continue
                points.setdefault(int(row["step"]) + 1, {}).update(values)
    return dict(sorted(points.items()))


def read_clock(path: Path) -> tuple[dict[int, float], int | None]:
    """One attempt's clock from its CSV metrics (callbacks.RunClock): {steps done: seconds since its
    process started} at each validation, and the steps it trained (None: it did not finish)."""
    times: dict[int, float] = {}
    trained = None
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            step = row.get("step") or ""
            if not step.isdigit():
                continue
            if (seconds := _finite(row.get("time/val_s"))) is not None:
                times[int(step) + 1] = seconds
            if (steps := _finite(row.get("time/steps_done"))) is not None:
                trained = int(steps)
    return times, trained


def collect(name: str, flags: list[str], arm_dir: Path, state: dict | None) -> dict:
    """Everything the sweep knows about one arm: status, settings, curve."""
    state = state or {}
    per_step, used = tokens_per_step(arm_dir / "config.yaml")
    times = {int(k): v for k, v in (state.get("val_times") or {}).items()}
    curve = []
    for step, point in read_curve(arm_dir).items():
        first = {
            "step": step,
            "tokens": step * per_step if per_step else None,
            "wall_s": round(times[step], 1) if step in times else None,
        }
        curve.append({**first, "tokens_per_nfe": point.pop("tokens_per_nfe", None), **point})
    result = {
        "arm": name,
        "status": state.get("status", "not run"),
        "flags": flags,
        "run_dir": str(arm_dir),
        "log": str(arm_dir / "fit.log"),
        "wall_s": round(state["wall_s"], 1) if state.get("wall_s") is not None else None,
        "steps": state.get("trained_steps"),
        "tokens_per_step": per_step,
        "config": used,
        "curve": curve,
    }
    if state.get("error"):
        result["error"] = state["error"]
    return result


def plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    axes = axes.ravel()
    panels = [
        (
            axes[0],
            "tokens",
            "tokens_per_nfe",
            "training tokens",
            "val T/NFE (TiDAR decoding of held-out prompts)",
        ),
        (
            axes[1],
            "wall_s",
            "tokens_per_nfe",
            "wall-clock minutes since the arm started",
            "val T/NFE",
        ),
        (axes[2], "tokens", "loss_ar", "training tokens", "val AR loss (held-out documents)"),
        (axes[3], "tokens", "loss_diff", "training tokens", "val diffusion loss, hard labels"),
    ]
    for ax, xkey, ykey, xlabel, ylabel in panels:
        for r in results:
            pts = [
                (p[xkey], p[ykey])
                for p in r["curve"]
                if p.get(xkey) is not None and p.get(ykey) is not None
            ]
            if not pts:
                continue
            xs, ys = zip(*pts)
            if xkey == "wall_s":
                xs = [x / 60 for x in xs]
            done = r["status"] == "done"
            ax.plot(
                xs,
                ys,
                "o-" if done else "o--",
                label=r["arm"] + ("" if done else f" ({r['status']})"),
            )
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
