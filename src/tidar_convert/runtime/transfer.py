"""Host values onto the device without waiting for it. Shipped in every export's custom_generate/
folder: torch only.

A step builds a few small tensors from Python lists (a draft's tokens and chances, a tree's
siblings, the commit's counts). `torch.tensor(values, device=cuda)` copies them from pageable
memory, and such a copy waits for every kernel queued before it: each one a sync with the device,
where a step should have one (the verdict's read, engine.read_verdict). From pinned memory the copy
is queued behind the kernels instead, and the host goes on."""

from __future__ import annotations

import torch


def on_device(values, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """torch.tensor(values, dtype=dtype) on `device`: made on the host, then on CUDA copied without
    a wait (from pinned memory, whose caching allocator keeps the block until the copy is done);
    other devices copy as torch.tensor would."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return tensor
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
