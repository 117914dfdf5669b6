"""A fit's run folder (trainer.default_root_dir): whose it is, what a new run may do with one that
holds another run's checkpoints, and which checkpoint holds the newest step.

The rules, checked before anything is instantiated:
  - a run folder holding checkpoints belongs to the run that wrote them: a new fit there is refused,
    unless it resumes (--ckpt_path last) or says what to do (--existing_run new: the first free
    <folder>-v2, -v3...; --existing_run replace: that run's checkpoints and config are removed);
  - a config.yaml that this tool did not write is never overwritten, whatever the flags;
  - `--ckpt_path last` takes the checkpoint with the highest step, not the newest file name or time.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

CONFIG = "config.yaml"
# The first line of every config.yaml fit writes: a file without it is the user's, never replaced.
CONFIG_MARK = "# tidar-convert fit: this run's resolved config (the tool rewrites this file)"
# Before the mark existed, fit wrote LightningCLI's own dump, which starts with this header.
LEGACY_MARK = "# lightning.pytorch=="
EXISTING_RUN = ("refuse", "new", "replace")
# the folder --existing_run new chose, for the rank processes started later
CHOSEN = "TIDAR_RUN_FOLDER"


def written_by_fit(path: Path) -> bool:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            first = f.readline()
    except OSError:
        return False
    return first.startswith(CONFIG_MARK) or first.startswith(LEGACY_MARK)


def checkpoint_dirs(cfg) -> list[Path]:
    """Where this fit's checkpoints go: each ModelCheckpoint's dirpath, and <root>/checkpoints
    (where fit puts those without one, and Lightning's default callback)."""
    root = Path(cfg.trainer.get("default_root_dir") or ".").expanduser()
    dirs = [root / "checkpoints"]
    for cb in _as_list(cfg.trainer.get("callbacks")):
        if str(_get(cb, "class_path") or "").endswith("ModelCheckpoint"):
            dirpath = _get(_get(cb, "init_args") or {}, "dirpath")
            if dirpath and "://" not in str(dirpath):
                dirs.append(Path(str(dirpath)).expanduser())
    return list(dict.fromkeys(d.absolute() for d in dirs))


def saved_checkpoints(dirs: list[Path]) -> list[Path]:
    """The checkpoints in `dirs`: .ckpt files, and the folders sharded strategies write under that
    name."""
    found = []
    for d in dirs:
        if d.is_dir():
            found += sorted(
                p for p in d.iterdir() if p.suffix == ".ckpt" and not p.name.startswith(".")
            )
    return found


def read_checkpoint(path: Path) -> dict:
    """A checkpoint's contents, its tensors memory-mapped, not read (a sharded one: its
    metadata)."""
    import torch

    from tidar_convert.train.sharding import is_sharded_checkpoint

    if path.is_dir() and not is_sharded_checkpoint(path):
        raise ValueError(
            f"checkpoint '{path}' is a folder but not a sharded checkpoint (no .metadata in it); "
            "pass a checkpoint file or folder from <default_root_dir>/checkpoints/, e.g. last.ckpt."
        )
    try:
        if is_sharded_checkpoint(path):
            from lightning.fabric.utilities.load import _METADATA_FILENAME

            return torch.load(path / _METADATA_FILENAME, map_location="cpu", weights_only=False)
        return torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except Exception as e:  # a cut-short zip, a pickle of something else
        raise ValueError(
            f"checkpoint '{path}' does not load "
            f"({type(e).__name__}: {str(e).splitlines()[0][:160]}): "
            "it is cut short or damaged; remove it (or pass another one as --ckpt_path) "
            "and run the same command again."
        ) from e


def checkpoint_step(path: Path) -> int:
    """The optimizer step a checkpoint holds."""
    step = read_checkpoint(path).get("global_step")
    if not isinstance(step, int):
        raise ValueError(
            f"checkpoint '{path}' holds no global_step: it is not a checkpoint that fit wrote; "
            "remove it from the run's checkpoint folder, or pass another one as --ckpt_path."
        )
    return step


def newest_checkpoint(paths: list[Path]) -> tuple[Path, int] | None:
    """The checkpoint with the highest step (ties: the later file), and that step."""
    if not paths:
        return None
    steps = {p: checkpoint_step(p) for p in paths}
    best = max(paths, key=lambda p: (steps[p], p.stat().st_mtime))
    return best, steps[best]


def last_checkpoints(dirs: list[Path]) -> list[Path]:
    """What `--ckpt_path last` chooses from: last.ckpt and its versions (last-v1.ckpt...)."""
    return [p for p in saved_checkpoints(dirs) if p.stem == "last" or p.stem.startswith("last-v")]


def check_run_folder(cfg, existing_run: str, resuming: bool) -> Path | None:
    """Refuse a run folder this fit would clobber; for --existing_run new, the folder to use
    instead (None: use the one given). Called before anything is instantiated or written."""
    if existing_run not in EXISTING_RUN:
        raise ValueError(
            f"--existing_run={existing_run!r}: choose refuse (the default), new or replace."
        )
    root = Path(cfg.trainer.get("default_root_dir") or ".").expanduser()
    if root.exists() and not root.is_dir():
        raise ValueError(
            f"--trainer.default_root_dir '{root}' is a file, not a folder; pass the folder for "
            "this run's config, checkpoints and logs (say runs/NAME)."
        )
    if resuming and existing_run != "refuse":
        raise ValueError(
            f"--existing_run {existing_run} with --ckpt_path {cfg.ckpt_path}: a resumed run "
            "continues in its own folder; drop one of them."
        )
    config = root / CONFIG
    if config.exists() and not written_by_fit(config):
        raise ValueError(
            f"'{config}' was not written by tidar-convert fit (its first line is not "
            f"{CONFIG_MARK!r}), and fit saves this run's config there: it is never overwritten; "
            f"pass another --trainer.default_root_dir (say runs/NAME) for this run's files."
        )
    if _launched_child():  # the processes Lightning starts for ranks > 0 follow rank 0's choice
        chosen = os.environ.get(CHOSEN)
        return Path(chosen) if chosen and chosen != str(root) else None
    saved = saved_checkpoints(checkpoint_dirs(cfg))
    if resuming or not saved:
        return None
    if existing_run == "refuse":
        newest = newest_checkpoint(saved)
        held = f"{newest[0]} at step {newest[1]}" if newest else ""
        raise ValueError(
            f"run folder '{root}' holds another run's checkpoints ({len(saved)}, the newest "
            f"{held}): a new run there would mix with it. Pass --ckpt_path last to continue "
            "that run, --existing_run new to start this one in a new folder beside it, or "
            "--existing_run replace to discard it."
        )
    if existing_run == "replace":
        for path in saved:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        config.unlink(missing_ok=True)
        _say(
            f"--existing_run replace: removed the {len(saved)} checkpoint(s) and config of the "
            f"earlier run in '{root}'."
        )
        return None
    for n in range(2, 10_000):
        candidate = root.with_name(f"{root.name}-v{n}")
        if not candidate.exists():
            _say(
                f"--existing_run new: '{root}' holds another run's checkpoints; this run goes to "
                f"'{candidate}'."
            )
            os.environ[CHOSEN] = str(candidate)  # inherited by the rank processes Lightning starts
            return candidate
    raise ValueError(f"--existing_run new: no free name beside '{root}' (-v2 to -v9999 exist).")


def place_outputs(cfg, old_root: Path | None = None) -> None:
    """Loggers without a save_dir write into the run folder; with --existing_run new, the folders
    a recipe put under the old run folder move with it."""
    root = Path(cfg.trainer.default_root_dir)
    for logger in _as_list(cfg.trainer.get("logger")):
        args = _get(logger, "init_args")
        if args is None or not hasattr(args, "get"):
            continue
        save_dir = args.get("save_dir")
        if save_dir in (None, "", "."):
            args["save_dir"] = str(root)
        elif old_root is not None:
            args["save_dir"] = str(_rebase(Path(save_dir), old_root, root))
    if old_root is None:
        return
    for cb in _as_list(cfg.trainer.get("callbacks")):
        args = _get(cb, "init_args")
        if args is not None and hasattr(args, "get") and args.get("dirpath"):
            args["dirpath"] = str(_rebase(Path(args["dirpath"]), old_root, root))


def _rebase(path: Path, old: Path, new: Path) -> Path:
    try:
        return new / path.expanduser().absolute().relative_to(old.expanduser().absolute())
    except ValueError:
        raise ValueError(
            f"--existing_run new: '{path}' (a logger's save_dir or a checkpoint dirpath) is "
            f"outside the run folder '{old}', so it cannot move with the run; pass "
            "--trainer.default_root_dir with a new folder instead."
        ) from None


def discard_if_unused(root: Path) -> None:
    """Remove a run folder this fit made, when it failed before it saved anything worth keeping."""
    from tidar_convert.train.preemption import NOTHING_SAVED

    if not root.is_dir() or (root / NOTHING_SAVED).exists():
        return
    if any(p.suffix == ".ckpt" for p in root.rglob("*")):
        return
    shutil.rmtree(root, ignore_errors=True)


def _launched_child() -> bool:
    return int(os.environ.get("LOCAL_RANK", "0") or 0) > 0


def _as_list(x) -> list:
    if x is None or isinstance(x, bool):
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _get(obj, key):
    return obj.get(key) if hasattr(obj, "get") else getattr(obj, key, None)


def _say(message: str) -> None:
    if os.environ.get("RANK", "0") == "0" and os.environ.get("LOCAL_RANK", "0") == "0":
        print(message, file=sys.stderr, flush=True)
