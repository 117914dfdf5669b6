"""What a resumed fit may change. A run continues the model it resumes: the settings that decide
what its checkpoint means (the base model, the layout, the adapter, the loss, the data) must be
those it was trained with, and a difference is refused before anything loads. The optimizer's
numbers, the schedule's shape and validation settings may change: they are applied from the
resumed step on (TiDARModule.on_load_checkpoint writes them into the restored optimizer) and
said."""

from __future__ import annotations

from pathlib import Path

# Model settings a resumed run may change: they steer the optimizer, the schedule or validation,
# not what the weights are. The optimizer's class stays (its state is of that class).
MODEL_FREE = {
    "optimizer",
    "warmup_ratio",
    "min_lr_ratio",
    "val_decode_prompts",
    "val_decode_draft_length",
    "gradient_checkpointing",
    "attn_implementation",
}
DATA_FREE = {"val_batches"}
# Hyper-parameters renamed since checkpoints were first written: old name -> new.
RENAMED = {"block_size": "draft_length", "val_decode_block_size": "val_decode_draft_length"}


def migrate(hparams: dict) -> dict:
    """A checkpoint's hyper-parameters under today's names (a checkpoint from before 2026-12-06
    says block_size). Lightning drops names TiDARModule does not take without a word, so a k = 8
    checkpoint would load as the default k = 4: every reader of hyper-parameters goes through
    here."""
    out = dict(hparams)
    for old, new in RENAMED.items():
        if old in out:
            value = out.pop(old)
            out.setdefault(new, value)
    return out


def resolve(cfg) -> Path | None:
    """The checkpoint --ckpt_path names: for `last`, the one of last.ckpt, last-v1.ckpt... with the
    highest step; None where there is none (train.check_resume then says what to do)."""
    from tidar_convert.train.run_folder import checkpoint_dirs, last_checkpoints, newest_checkpoint

    given = str(cfg.ckpt_path)
    if given == "last":
        newest = newest_checkpoint(last_checkpoints(checkpoint_dirs(cfg)))
        return newest[0] if newest else None
    path = Path(given).expanduser()
    return path if path.exists() else None


def check_settings(path: Path, cfg) -> list[str]:
    """Refuse settings that differ from the checkpoint's where they must not; say (and return) the
    ones that changed where they may."""
    from tidar_convert.train.run_folder import _say, read_checkpoint

    saved = read_checkpoint(path)
    changed, refused = [], []
    model = cfg.get("model")
    if model is not None:
        _compare(
            "model",
            _plain(model),
            migrate(saved.get("hyper_parameters") or {}),
            MODEL_FREE,
            changed,
            refused,
        )
    data = cfg.get("data")
    if data is not None and saved.get("datamodule_hyper_parameters"):
        _compare(
            "data", _plain(data), saved["datamodule_hyper_parameters"], DATA_FREE, changed, refused
        )
    if refused:
        asked = ", ".join(f"{flag} {new!r} (trained with {old!r})" for flag, old, new in refused)
        raise ValueError(
            f"--ckpt_path {cfg.ckpt_path} ({path}) was trained with other settings than this run "
            f"asks for: {asked}. A resumed run keeps the settings that decide what its checkpoint "
            "is; set them back (the run folder's config.yaml has them), or start a new run from "
            f"its export (`tidar-convert export --checkpoint {path} --out DIR`, then --model.model "
            "DIR without --ckpt_path)."
        )
    if changed:
        said = ", ".join(f"{flag} {old!r} -> {new!r}" for flag, old, new in changed)
        _say(f"resuming {path} with changed settings, applied from its step on: {said}")
    return [flag for flag, _, _ in changed]


def _compare(group, given: dict, saved: dict, free: set, changed: list, refused: list) -> None:
    from tidar_convert.models.loading import same_model

    for key in sorted(given.keys() & saved.keys()):
        if key.startswith("_"):
            continue
        old, new = saved[key], given[key]
        if group == "model" and key == "model":
            if not same_model(new, old):
                refused.append(("--model.model", old, new))
            continue
        if group == "model" and key == "optimizer":
            _compare_optimizer(old, new, changed, refused)
            continue
        for name, a, b in _differences(f"--{group}.{key}", old, new):
            (changed if key in free else refused).append((name, a, b))


def _compare_optimizer(old, new, changed: list, refused: list) -> None:
    """The optimizer's class is fixed (its state is of that class); its arguments may change."""
    old, new = (x if isinstance(x, dict) else {"class_path": x} for x in (old, new))
    if old.get("class_path") != new.get("class_path"):
        refused.append(("--model.optimizer", old.get("class_path"), new.get("class_path")))
        return
    old_args, new_args = old.get("init_args") or {}, new.get("init_args") or {}
    for key in sorted(old_args.keys() & new_args.keys()):
        changed += _differences(f"--model.optimizer.init_args.{key}", old_args[key], new_args[key])


def _differences(flag: str, old, new) -> list[tuple]:
    """(flag, old, new) for each leaf that differs, on keys both have: a newer torch or tool adds
    arguments an older checkpoint lacks."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [
            d
            for k in sorted(old.keys() & new.keys())
            for d in _differences(f"{flag}.{k}", old[k], new[k])
        ]
    if isinstance(old, (list, tuple)) and isinstance(new, (list, tuple)) and len(old) == len(new):
        return [(flag, old, new)] if any(_differences(flag, a, b) for a, b in zip(old, new)) else []
    return [] if old == new else [(flag, old, new)]


def _plain(section) -> dict:
    return section.as_dict() if hasattr(section, "as_dict") else dict(section)
