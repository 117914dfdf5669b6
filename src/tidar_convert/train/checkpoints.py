"""Checkpoints written whole or not at all, single-file and sharded: a full disk or a kill leaves
the previous one loadable, and a full disk ends the run in one line."""

from __future__ import annotations

from pathlib import Path

import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback, ModelCheckpoint


def checkpoint_fix(dest) -> str:
    """What to do after a full disk: continue from the checkpoint there is, or, where none was saved
    yet, start again (a --ckpt_path last would find nothing to continue)."""
    move = (
        "move the run folder to a disk with room (pass its new place as --trainer.default_root_dir)"
    )
    if any(Path(dest).parent.glob("last*.ckpt")):  # what --ckpt_path last finds
        return f"{move}; then run the same command with --ckpt_path last to continue."
    return (
        f"{move}; then run the same command again (no last checkpoint was saved yet, "
        "so it starts from step 0)."
    )


class AtomicCheckpointIO(TorchCheckpointIO):
    """Checkpoints written whole or not at all: torch.save into a temporary file beside the
    checkpoint, flushed to disk, then renamed over it (disk.save_file_atomically). A full disk or a
    kill leaves the previous last.ckpt loadable. Lightning's own writes a temporary in the system's
    temp folder and moves it: across filesystems that is a copy into the checkpoint itself, which a
    full disk cuts short. A full disk ends the run with one line (disk.DiskFull). Remote paths
    (s3://...) go through Lightning's."""

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        if storage_options is not None or "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        from tidar_convert.exports.disk import save_file_atomically, tensor_bytes

        save_file_atomically(
            path,
            lambda f: torch.save(checkpoint, f),
            tensor_bytes(checkpoint),
            "the checkpoint",
            checkpoint_fix(path),
        )


def atomic_checkpoints(strategy) -> None:
    """Make the strategy write checkpoints atomically: single files through AtomicCheckpointIO
    (unless the user configured a CheckpointIO of their own); a sharded checkpoint (a folder of one
    file per rank, ModelParallelStrategy) is written under a temporary name and swapped in whole."""
    if type(strategy.checkpoint_io) is TorchCheckpointIO:
        strategy.checkpoint_io = AtomicCheckpointIO()
    if hasattr(strategy, "_save_distributed_checkpoint"):
        strategy.save_checkpoint = _atomic_sharded_save(strategy, strategy.save_checkpoint)


def _atomic_sharded_save(strategy, save):
    """`save` (ModelParallelStrategy.save_checkpoint) into a fresh folder beside the checkpoint,
    which rank 0 swaps in (outputs: renameat2 exchange where available) once every rank wrote its
    shard."""
    from tidar_convert.exports.disk import disk_full, no_space, tensor_bytes
    from tidar_convert.exports.outputs import _swap_in, recover

    def atomic_save(checkpoint, filepath, storage_options=None):
        if not strategy._save_distributed_checkpoint or storage_options is not None:
            return save(checkpoint, filepath, storage_options)
        import secrets

        dest = Path(strategy.broadcast(str(Path(filepath).absolute())))
        # one name, chosen by rank 0
        tmp = dest.parent / strategy.broadcast(f".{dest.name}.tmp-{secrets.token_hex(4)}")
        if strategy.is_global_zero:
            recover(dest)
        strategy.barrier("checkpoint-tmp")
        # about: every rank holds a shard of the same size
        needed = tensor_bytes(checkpoint) * strategy.world_size
        failed = None
        try:
            save(checkpoint, tmp)
        except Exception as e:
            # still reach the barrier below, so no rank waits there for one that failed
            failed = e
        failures = (
            strategy.all_gather(
                torch.tensor([int(failed is not None)], device=strategy.root_device)
            )
            .sum()
            .item()
        )
        if failures:
            if strategy.is_global_zero:
                from tidar_convert.exports.outputs import _rmtree

                _rmtree(tmp)
            if failed is not None and no_space(failed):
                raise disk_full(
                    dest, needed, "the sharded checkpoint", checkpoint_fix(dest)
                ) from failed
            raise failed or RuntimeError(
                f"another rank failed to write its shard of {dest}; its error says why"
            )
        if strategy.is_global_zero:
            # over a folder of shards, or a single-file checkpoint of the same name
            _swap_in(tmp, dest)
        strategy.barrier("checkpoint-swap")

    return atomic_save


class FinalCheckpoint(Callback):
    """The last checkpoint holds the final step. Lightning's ModelCheckpoint saves `last` at train
    end only if it never saved before: with every_n_train_steps 10 and max_steps 47, last.ckpt kept
    step 40 while fit said it trained 47. Lightning moves checkpoint callbacks last, so this runs
    first at train end."""

    def on_train_end(self, trainer, pl_module) -> None:
        for cb in trainer.checkpoint_callbacks:
            if isinstance(cb, ModelCheckpoint) and cb.save_last and cb.dirpath:
                if cb._last_global_step_saved != trainer.global_step and trainer.global_step > 0:
                    cb._save_last_checkpoint(trainer, cb._monitor_candidates(trainer))


# --------------------------------------------------------------------------------------------
# A LoRA run's checkpoints keep what it trains (adapters, the mask token's row) and the optimizer:
# the frozen base is most of the bytes (all but a few % at rank 64), and loading the base model
# gives it back bit for bit (load_base is seeded where it adds rows). TiDARModule's state_dict
# leaves it out and its load_state_dict puts the module's own frozen tensors back, so single-file
# and sharded checkpoints, resume and export all go through the one pair.
# --------------------------------------------------------------------------------------------

FROZEN_BASE = "frozen_base"  # the checkpoint's record of the base's weight files


def frozen_names(module: torch.nn.Module) -> set[str]:
    """State-dict keys of the parameters that do not train, tied aliases included."""
    return {n for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}


def trained_only(module: torch.nn.Module, state: dict) -> dict:
    frozen = frozen_names(module)
    return type(state)((k, v) for k, v in state.items() if k not in frozen)


def with_frozen(module: torch.nn.Module, state: dict, full: dict) -> dict:
    """`state` with the frozen tensors it lacks taken from `full` (the module's own state): a
    trained weight missing from it is still refused by the strict load."""
    frozen = frozen_names(module)
    return {**{k: v for k, v in full.items() if k in frozen and k not in state}, **state}


def base_fingerprint(model: str | None) -> dict[str, str]:
    from tidar_convert.models.loading import embedded_default
    from tidar_convert.models.model_files import weights_fingerprint

    default = model in (None, "", "default", "embedded")
    return weights_fingerprint(str(embedded_default()) if default else model)


def check_frozen_base(checkpoint: dict, model: str | None, where: str) -> None:
    """Refuse a checkpoint without its frozen weights whose base model's weight files are not the
    ones it was trained on: the adapters would load onto other weights without a word."""
    saved = checkpoint.get(FROZEN_BASE)
    if not saved:
        return  # a full checkpoint, or its base could not be fingerprinted
    ours = base_fingerprint(model)
    if not ours:
        return
    changed = sorted(n for n in saved.keys() | ours.keys() if saved.get(n) != ours.get(n))
    if changed:
        name = changed[0]
        was, now = saved.get(name, "absent"), ours.get(name, "absent")
        raise ValueError(
            f"{where} holds only the weights its LoRA run trained; the frozen ones come from its "
            f"base model {model or 'default'!r}, whose {name} is not the one it was trained on "
            f"(sha256 {was[:12]}, now {now[:12]}). Put back the base model it was trained from at "
            "that path, or name a folder that holds it (export: --model DIR)."
        )
