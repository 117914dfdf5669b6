"""FSDP2: a model sharded per decoder layer from its first byte, and sharded checkpoints read back.

Used through Lightning's ModelParallelStrategy, whose `configure_model()` hook hands the module a
device mesh; the module calls `build_sharded` there. Every rank builds the model on the meta device
(no memory), shards each decoder layer and the root with `fully_shard`, and receives only its shard
of the weights, broadcast from rank 0. Rank 0 alone reads the checkpoint, in the checkpoint's own
dtype (bf16 for the Qwen models: half of float32); the other ranks only ever hold their shard.
So configure_model adds to rank 0's peak RSS about the checkpoint (in its own dtype) and rank 0's
shard, and to the other ranks' only their shard, against the checkpoint and the whole model for one
process loading it whole.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Callable

import torch
from torch import nn


def decoder_layer_class(model: nn.Module) -> type[nn.Module]:
    """The class of the model's decoder layers, the FSDP unit: whatever the family calls it.

    transformers lists it in `_no_split_modules` (the module that must stay on one device); the
    class actually present in the model is taken, so a LoRA-wrapped or renamed model works too.
    """
    names = set(getattr(model, "_no_split_modules", None) or [])
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names |= set(getattr(base, "_no_split_modules", None) or [])
    found = {type(m) for m in model.modules() if type(m).__name__ in names}
    if len(found) != 1:
        what = ", ".join(sorted(c.__name__ for c in found)) or "none of them is in the model"
        raise ValueError(
            f"{type(base).__name__}: cannot tell its decoder layer class for sharding "
            f"(its _no_split_modules are {sorted(names) or 'empty'}; {what}); "
            "this family cannot be sharded per layer, train it with --trainer.strategy ddp."
        )
    return found.pop()


def shard(model: nn.Module, mesh) -> nn.Module:
    """fully_shard each decoder layer (one all-gather per layer in forward and backward), then the
    root, which keeps the embeddings, final norm and head (tied weights stay one parameter)."""
    from torch.distributed.fsdp import fully_shard

    layer_cls = decoder_layer_class(model)
    for module in model.modules():
        if isinstance(module, layer_cls):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def build_sharded(
    make_full: Callable[[], nn.Module], make_empty: Callable[[], nn.Module], mesh
) -> nn.Module:
    """A model sharded over `mesh`, with rank 0's weights.

    make_full: the real model, with its weights (called on rank 0 only).
    make_empty: the same model on the meta device (called on every rank, in the training dtype).
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    rank = dist.get_rank()
    full = make_full() if rank == 0 else None
    model = shard(make_empty(), mesh)
    # On the mesh's device ("cuda": this rank's GPU, which Lightning has set): NCCL broadcasts only
    # GPU tensors.
    model.to_empty(device=torch.device(mesh.device_type))
    # Buffers outside the state dict (rotary inv_freq) are not broadcast by set_model_state_dict,
    # and to_empty left them uninitialised: rank 0 sends its own (a few KB).
    buffers = [
        {name: b for name, b in full.named_buffers() if name not in full.state_dict()}
        if full is not None
        else None
    ]
    dist.broadcast_object_list(buffers, src=0)
    for name, value in buffers[0].items():
        model.get_buffer(name).copy_(value)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True)
    set_model_state_dict(model, full.state_dict() if full is not None else {}, options=options)
    del full
    return model


def is_sharded_checkpoint(path: str | Path) -> bool:
    """A folder written by a sharded strategy (torch.distributed.checkpoint), not a single .ckpt
    file."""
    return Path(path).is_dir() and (Path(path) / ".metadata").is_file()


def load_sharded_module(cls, path: str | Path, **overrides):
    """(module, global_step) from a sharded checkpoint folder, in one process and without a process
    group.

    The module is made from the checkpoint's hyper_parameters the way `load_from_checkpoint` makes
    it (Lightning's own `_load_state`, which also calls configure_model), then only its own weights
    are read from the shards, in place (not the optimizer's): the memory of the model once, whatever
    the number of ranks that wrote it. `overrides`: hyper_parameters to replace, as
    load_from_checkpoint takes them.
    """
    import torch.distributed.checkpoint as dcp
    from lightning.fabric.utilities.load import _METADATA_FILENAME
    from lightning.pytorch.core.saving import _load_state

    path = Path(path)
    meta = torch.load(path / _METADATA_FILENAME, map_location="cpu", weights_only=False)
    with warnings.catch_warnings():
        # Lightning: "keys in the model but not in the checkpoint" (all of them: they are read
        # next); torch: "torch.distributed is ... uninitialized, assuming ... a single process"
        # (it is).
        warnings.filterwarnings(
            "ignore",
            message=r".*(not in the checkpoint"
            r"|assuming the intent is to load in a single process).*",
        )
        module = _load_state(cls, {**meta, "state_dict": {}}, strict=False, **overrides)
        state = {"state_dict": module.state_dict()}
        dcp.load(state, checkpoint_id=path)  # fills the module's own tensors
    module.load_state_dict(state["state_dict"])
    return module, meta.get("global_step")


def gather_full(model: nn.Module, make_empty: Callable[[], nn.Module]) -> nn.Module | None:
    """The sharded model gathered into one plain module on rank 0 (None elsewhere): a collective.

    make_empty: the same model on the meta device; its parameters take the gathered tensors as they
    are (no second copy), its non-persistent buffers (rotary inv_freq) come from this rank's own.
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if dist.get_rank() != 0:
        return None
    plain = make_empty()
    plain.load_state_dict(state, assign=True, strict=True)
    persistent = set(state)
    for name, buffer in model.named_buffers():
        if name not in persistent:
            parent, _, leaf = name.rpartition(".")
            plain.get_submodule(parent)._buffers[leaf] = buffer.detach().to("cpu", copy=True)
    if hasattr(plain, "tie_weights"):
        plain.tie_weights()  # assign=True gives a tied head its own tensor: one parameter again
    return plain
