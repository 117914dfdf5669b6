"""`tidar-convert sweep`: one recipe, several arms (lists of `fit` flags), a learning curve per arm.

Each arm is its own `tidar-convert fit` process, run one after another, in its own folder
`<out>/arms/<arm>/` (run folder, CSV metrics, checkpoints, `fit.log`). A crash of one arm is
recorded and the next arm runs. What is measured is `val/tokens_per_nfe` (real TiDAR decoding of
held-out validation prompts, never training text; see `TiDARModule.validation_step`) and `val/loss`,
against training tokens (clean tokens: steps x batch_size x seq_len x accumulate_grad_batches x
devices x num_nodes, read from the arm's own saved config.yaml) and against wall-clock seconds.

Nothing is lost on interruption: every arm writes `<out>/arms/<arm>/arm.json` when its process ends,
and `<out>/sweep.json` + `sweep.png` are rewritten after every arm. A rerun skips arms that
finished, resumes an interrupted arm from its last checkpoint (saved after each validation), and
retries a failed one; an arm whose settings changed since it ran is refused rather than silently
mixed.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import signal
import sys
from pathlib import Path

from tidar_convert.bench.sweep_arm import Forward, arm_command, error_line, run_arm
from tidar_convert.bench.sweep_curves import collect, plot, tokens_per_step

# Flags the sweep sets for every arm: an arm or --fit_args setting them would break the arm's
# isolation (its folder, its metrics, resuming), so they are refused.
MANAGED = (
    "--trainer.default_root_dir",
    "--trainer.logger",
    "--trainer.callbacks",
    "--out",
    "--overwrite",
    "--ckpt_path",
)
ARM_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")
EXAMPLE = "recipes/sweeps/smollm2-cpu-levers.yaml"


def _flag_name(arg: str) -> str:
    return arg.split("=", 1)[0]


def _as_flag(value, arm: str, spec: Path) -> str:
    """YAML scalars as the command line spells them: 1.0 -> '1.0', true -> 'true',
    null -> 'null'."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (str, int, float)):
        return str(value)
    raise ValueError(
        f"arm {arm!r} in {spec}: item {value!r} is a {type(value).__name__}; each item is one "
        "command-line word, e.g. [--data.source, '[prose-train, stdlib]'] (quote a list or mapping "
        "value as one string)."
    )


def check_flags(flags: list[str], where: str) -> None:
    for arg in flags:
        if _flag_name(arg) in MANAGED:
            raise ValueError(
                f"{where} sets {_flag_name(arg)}: the sweep sets it for every arm (each arm's own "
                "folder under --out); remove it from the arm."
            )


def load_spec(path: str) -> dict[str, list[str]]:
    """The sweep spec: a YAML mapping arm name -> list of `fit` flags ([] = the recipe as it is)."""
    import yaml

    spec = Path(path)
    fix = f"write one `name: [--flag, value, ...]` per arm (see {EXAMPLE})"
    if not spec.is_file():
        raise FileNotFoundError(
            f"sweep spec {path!r} does not exist{' (it is a folder)' if spec.is_dir() else ''}; "
            f"pass --spec a YAML file: {fix}."
        )
    try:
        raw = yaml.safe_load(spec.read_text())
    except yaml.YAMLError as e:
        raise ValueError(
            f"sweep spec {path}: not valid YAML ({' '.join(str(e).split())}); {fix}."
        ) from None
    if not raw:
        raise ValueError(
            f"sweep spec {path} holds no arms; {fix}, e.g. `baseline: []` runs the recipe as it is."
        )
    if not isinstance(raw, dict):
        raise ValueError(
            f"sweep spec {path} is a {type(raw).__name__}, not a mapping of arm name -> list of "
            f"flags; {fix}."
        )
    arms = {}
    for name, flags in raw.items():
        name = str(name)
        if not ARM_NAME.match(name):
            raise ValueError(
                f"arm name {name!r} in {path}: use letters, digits and . _ + - (it names the arm's "
                "folder), e.g. 'lora-16'."
            )
        if flags is None:
            flags = []
        if not isinstance(flags, list):
            words = (
                str(flags).split()
                if isinstance(flags, str) and flags.strip()
                else ["--model.alpha", "'0.5'"]
            )
            raise ValueError(
                f"arm {name!r} in {path} is a {type(flags).__name__} ({flags!r}), not a list of "
                f"flags; write it as {name}: [{', '.join(words)}] (one item per word), or {name}: "
                "[] for the recipe as it is."
            )
        arms[name] = [_as_flag(v, name, spec) for v in flags]
        check_flags(arms[name], f"arm {name!r} in {path}")
    return arms


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write_json(path: Path, data) -> None:
    """Atomic: an interrupted write leaves the earlier file, never half of one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


def _sweep_record(path: Path) -> bool:
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, OSError):
        return False
    return isinstance(record, dict) and "spec" in record and "arms" in record


def sweep_cmd(
    spec: str,
    recipe: str = "recipes/smollm2-135m-cpu-lora.yaml",
    out: str | None = None,
    max_steps: int | None = None,
    val_check_interval: int | None = None,
    fit_args: list[str] | None = None,
    arms: list[str] | None = None,
    keep_loggers: bool = False,
    keep_checkpoints: bool = True,
    dry_run: bool = False,
) -> str:
    """Train one `tidar-convert fit` per arm of a sweep spec and write learning curves of T/NFE.

    Args:
        spec: YAML mapping arm name -> list of `fit` flags, e.g.
            `soft: [--model.distill_weight, '1.0']` (`baseline: []` = the recipe as it is); see
            recipes/sweeps/.
        recipe: the base recipe every arm starts from.
        out: sweep folder (default runs/sweeps/<spec name>): arms/<arm>/ per arm, sweep.json,
            sweep.png. Running again with the same folder skips finished arms and resumes
            interrupted ones.
        max_steps: optimizer steps per arm (default: the recipe's); an arm may still set its own.
        val_check_interval: steps between validations, i.e. between points of the curve (default:
            the recipe's).
        fit_args: flags added to every arm, before the arm's own
            (e.g. '[--model.model, ./my-model]').
        arms: run only these arms of the spec (default: all); sweep.json still lists every arm.
        keep_loggers: also keep the recipe's other loggers (W&B...), each writing into its arm's
            folder (default: only the CSV metrics the sweep reads).
        keep_checkpoints: keep each finished arm's last.ckpt (false: delete it once the arm is done;
            an interrupted arm always keeps it to resume).
        dry_run: print each arm's command and write nothing.
    """
    import yaml

    arm_flags = load_spec(spec)
    recipe_path = Path(recipe)
    if not recipe_path.is_file():
        raise FileNotFoundError(
            f"recipe {recipe!r} does not exist; pass --recipe a fit recipe such as "
            "recipes/smollm2-135m-cpu-lora.yaml."
        )
    for value, flag in ((max_steps, "--max_steps"), (val_check_interval, "--val_check_interval")):
        if value is not None and value < 1:
            raise ValueError(f"{flag} {value}: must be >= 1 (leave it out to use the recipe's).")
    common = [str(a) for a in (fit_args or [])]
    check_flags(common, "--fit_args")
    selected = list(arm_flags) if not arms else list(arms)
    unknown = [a for a in selected if a not in arm_flags]
    if unknown:
        raise ValueError(
            f"--arms {', '.join(unknown)}: not in {spec} (its arms: {', '.join(arm_flags)})."
        )
    out_dir = Path(out) if out else Path("runs") / "sweeps" / Path(spec).stem
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(
            f"--out {out_dir} is a file; pass a new folder, or an earlier sweep's folder to "
            "continue it."
        )
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / "sweep.json").is_file():
        raise ValueError(
            f"--out {out_dir} is a folder with other files and no sweep.json: not an earlier "
            "sweep; pass a new or empty folder."
        )
    if (out_dir / "sweep.json").is_file() and not _sweep_record(out_dir / "sweep.json"):
        raise ValueError(
            f"--out {out_dir} holds a sweep.json that no sweep wrote (not JSON with its spec and "
            "arms): it is never replaced; pass a new or empty folder."
        )
    recipe_cfg = yaml.safe_load(recipe_path.read_text()) or {}
    sweep_name = out_dir.name
    shared = []
    if max_steps is not None:
        shared += ["--trainer.max_steps", str(max_steps)]
    if val_check_interval is not None:
        shared += ["--trainer.val_check_interval", str(val_check_interval)]
    shared += common
    steps = max_steps or (recipe_cfg.get("trainer") or {}).get("max_steps")
    every = val_check_interval or (recipe_cfg.get("trainer") or {}).get("val_check_interval")
    if isinstance(steps, int) and isinstance(every, int) and steps % every:
        print(
            f"note: max_steps {steps} is not a multiple of val_check_interval {every}: the last "
            f"{steps % every} steps of each arm are never measured.",
            file=sys.stderr,
        )

    settings = {
        name: {
            "recipe": str(recipe),
            "recipe_sha256": _sha256(recipe_path),
            "flags": shared + flags,
        }
        for name, flags in arm_flags.items()
    }
    if dry_run:
        for name in selected:
            arm_dir = (out_dir / "arms" / name).resolve()
            print(
                shlex.join(
                    arm_command(
                        recipe,
                        settings[name]["flags"],
                        arm_dir,
                        name,
                        sweep_name,
                        keep_loggers,
                        recipe_cfg,
                        resume=False,
                    )
                )
            )
        return str(out_dir)

    # Settings of finished or resumable arms must match this run's: refuse before training anything.
    for name in selected:
        arm_dir = out_dir / "arms" / name
        state = _read_json(arm_dir / "arm.json")
        resumable = (arm_dir / "checkpoints" / "last.ckpt").is_file()
        was = (state or {}).get("settings") or {}
        now = settings[name]
        # the recipe's path may be spelled differently
        same = was.get("flags") == now["flags"] and was.get("recipe_sha256") == now["recipe_sha256"]
        if state and (state.get("status") == "done" or resumable) and not same:
            what = (
                f"flags {was.get('flags')}, now {now['flags']}"
                if was.get("flags") != now["flags"]
                else f"recipe {was.get('recipe')} had other contents than {now['recipe']} has now"
            )
            raise ValueError(
                f"arm {name!r} in {arm_dir} was run with other settings ({what}); "
                "pass another --out, or remove that arm's folder to run it again."
            )

    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out_dir / "sweep.json", out_dir / "sweep.png"
    title = f"{Path(spec).name} on {recipe_path.name}"

    def write_summary() -> list[dict]:
        results = [
            collect(
                name,
                settings[name]["flags"],
                out_dir / "arms" / name,
                _read_json(out_dir / "arms" / name / "arm.json"),
            )
            for name in arm_flags
        ]
        _write_json(
            json_path,
            {
                "spec": str(spec),
                "recipe": str(recipe),
                "max_steps": max_steps,
                "val_check_interval": val_check_interval,
                "fit_args": common,
                "metric": (
                    "val/tokens_per_nfe: greedy TiDAR decoding of held-out validation prompts"
                ),
                "tokens": (
                    "clean training tokens = steps x batch_size x seq_len x "
                    "accumulate_grad_batches x devices x num_nodes"
                ),
                "curve_fields": (
                    "step: optimizer steps; tokens: training tokens at that step; wall_s: seconds "
                    "since the arm started (all its attempts); tokens_per_nfe and every other "
                    "val/* metric, e.g. loss_ar (AR cross-entropy), loss_diff (hard-label "
                    "diffusion loss), loss (the arm's own objective: not comparable across "
                    "distill_weight or alpha)"
                ),
                "arms": results,
            },
        )
        plot(results, png_path, title)
        return results

    if not json_path.exists():
        write_summary()  # marks the folder as a sweep's from the start
    print(f"sweep {spec}: {len(selected)} arm(s) of {recipe} -> {out_dir}", file=sys.stderr)
    interrupted = None
    with Forward() as forward:
        for i, name in enumerate(selected, 1):
            arm_dir = out_dir / "arms" / name
            state = _read_json(arm_dir / "arm.json") or {}
            if state.get("status") == "done":
                print(
                    f"[{i}/{len(selected)}] {name}: done earlier ({arm_dir}), skipped",
                    file=sys.stderr,
                )
                continue
            arm_dir.mkdir(parents=True, exist_ok=True)
            resume = (arm_dir / "checkpoints" / "last.ckpt").is_file()
            wall_before = float(state.get("wall_s") or 0.0) if resume else 0.0
            times = state.get("val_times", {}) if resume else {}
            # a fresh start: what an earlier attempt that saved no checkpoint left is stale
            if not resume:
                for old in [*arm_dir.glob("csv/version_*/metrics.csv"), arm_dir / "config.yaml"]:
                    old.unlink(missing_ok=True)
            cmd = arm_command(
                recipe,
                settings[name]["flags"],
                arm_dir.resolve(),
                name,
                sweep_name,
                keep_loggers,
                recipe_cfg,
                resume,
            )
            how = f"resuming from {arm_dir / 'checkpoints' / 'last.ckpt'}" if resume else "starting"
            print(
                f"[{i}/{len(selected)}] {name}: {how}, log {arm_dir / 'fit.log'}", file=sys.stderr
            )
            ran = run_arm(name, cmd, arm_dir, wall_before, forward)
            _, used = tokens_per_step(arm_dir / "config.yaml")
            target = used.get("max_steps")
            finished = (
                ran["rc"] == 0
                and ran["trained_steps"] is not None
                and (not isinstance(target, int) or target < 0 or ran["trained_steps"] >= target)
            )
            # 143: SIGTERM, 130: Ctrl-C; each saved last.ckpt
            status = (
                "done"
                if finished
                else "interrupted"
                if forward.received or ran["rc"] in (130, 143)
                else "failed"
            )
            new_state = {
                "status": status,
                "settings": settings[name],
                "command": cmd,
                "rc": ran["rc"],
                "wall_s": ran["wall_s"],
                "trained_steps": ran["trained_steps"],
                "val_times": {**times, **{str(k): v for k, v in ran["val_times"].items()}},
            }
            if status != "done":
                new_state["error"] = error_line(ran["last_lines"]) or f"exit status {ran['rc']}"
            _write_json(arm_dir / "arm.json", new_state)
            if status == "done" and not keep_checkpoints:
                for ckpt in (arm_dir / "checkpoints").glob("*.ckpt"):
                    ckpt.unlink()
            results = write_summary()
            r = next(r for r in results if r["arm"] == name)
            last = r["curve"][-1] if r["curve"] else {}
            print(
                f"[{i}/{len(selected)}] {name}: {status} in {r['wall_s']:.0f} s, {len(r['curve'])} "
                "curve points"
                + (
                    f", last T/NFE {last['tokens_per_nfe']:.3f} at {last['tokens']} tokens"
                    if last.get("tokens_per_nfe") is not None
                    else ""
                )
                + (f"; {new_state['error']}" if status != "done" else ""),
                file=sys.stderr,
            )
            if forward.received:
                interrupted = forward.received
                break

    results = write_summary()
    print(
        "\narm            status       steps   tokens      T/NFE    AR loss   wall", file=sys.stderr
    )
    for r in results:
        last = r["curve"][-1] if r["curve"] else {}
        fmt = lambda v, f: format(v, f) if v is not None else "-"  # noqa: E731
        print(
            f"{r['arm']:<14} {r['status']:<12} {fmt(last.get('step'), 'd'):>5} "
            f"{fmt(last.get('tokens'), 'd'):>8}   {fmt(last.get('tokens_per_nfe'), '.3f'):>6}   "
            f"{fmt(last.get('loss_ar'), '.3f'):>8}   {fmt(r['wall_s'], '.0f'):>5} s",
            file=sys.stderr,
        )
    print(f"wrote {json_path}\nwrote {png_path}", file=sys.stderr)
    for r in results:
        if r["status"] != "not run":
            print(f"arm {r['arm']}: {r['run_dir']} (log {r['log']})", file=sys.stderr)
    if interrupted:
        print(
            "interrupted: run the same command again to resume (finished arms are skipped).",
            file=sys.stderr,
        )
        sys.exit(143 if interrupted == signal.SIGTERM else 130)
    failed = [r["arm"] for r in results if r["arm"] in selected and r["status"] != "done"]
    if failed:
        print(
            f"{len(failed)} arm(s) did not finish: {', '.join(failed)}; see their fit.log. Running "
            "the same command again retries them and skips the rest.",
            file=sys.stderr,
        )
        sys.exit(1)
    return str(json_path)
