"""A full disk: one line naming the folder, the space needed and free, and what was left as it was;
and a file written whole or not at all. Nothing but the standard library."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from tidar_convert.exports.outputs import atomic_file


class DiskFull(OSError):
    """No space left where an output was being written; the message names the folder, the space
    needed and free, and what was left as it was."""

    def __init__(self, message: str):
        super().__init__(message)
        self.errno = errno.ENOSPC


def no_space(exc: BaseException) -> bool:
    """Whether exc, or an exception it was raised from or during, is a full disk (or quota): torch
    and safetensors report it as their own errors around the OSError, or in their message only."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        # safetensors: "... No space left on device (os error 28)"
        if os.strerror(errno.ENOSPC) in str(exc) or "os error 28" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def size_text(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def disk_full(dest: str | os.PathLike, needed: int, what: str, fix: str) -> DiskFull:
    """The one-line error for `what` (e.g. "the checkpoint") at dest not fitting on its disk. Call
    it once the partial write is removed, so the free space it states is what there is to work
    with."""
    dest = Path(dest)
    folder = dest.parent
    free = shutil.disk_usage(folder).free
    kept = (
        f"{dest.name} there is the earlier one, whole"
        if os.path.lexists(dest)
        else f"nothing was left at {dest.name}"
    )
    if needed > free:
        size, room = (
            f"it needs about {size_text(needed)} and the disk has {size_text(free)} free",
            f"Free {size_text(needed - free)} or more there",
        )
    else:
        # the disk filled while writing (another writer, a quota, reserved blocks): no amount to
        # name
        size, room = (
            f"it needs about {size_text(needed)}, more than there was room for while writing it "
            "(a quota or another writer can leave less than the "
            f"{size_text(free)} the disk shows free now)",
            "Free space there (or raise the quota)",
        )
    return DiskFull(
        f"no space left in {folder} for {what} {dest.name}: {size} ({kept}). {room}, or {fix}"
    )


def tensor_bytes(obj) -> int:
    """Bytes of the tensors in a nested dict/list (a state dict, a checkpoint), each storage counted
    once (tied weights, views): about what torch.save or safetensors writes. Duck-typed: no torch
    import."""
    seen: set[int] = set()
    total = 0
    todo = [obj]
    while todo:
        x = todo.pop()
        if isinstance(x, dict):
            todo.extend(x.values())
        elif isinstance(x, (list, tuple)):
            todo.extend(x)
        elif hasattr(x, "untyped_storage"):
            try:
                storage = x.untyped_storage()
                key, n = storage.data_ptr(), storage.nbytes()
            except (RuntimeError, NotImplementedError, TypeError):  # meta or distributed tensors
                key, n = id(x), x.numel() * x.element_size()
            if key not in seen or key == 0:
                seen.add(key)
                total += n
    return total


def save_file_atomically(dest: str | os.PathLike, write, needed: int, what: str, fix: str) -> Path:
    """`write(f)` into a temporary file beside dest, flushed to disk, then renamed over dest: a full
    disk, a kill or a crash leaves dest as it was. A full disk is then DiskFull (see
    `disk_full`)."""
    dest = Path(dest).expanduser().absolute()
    try:
        with atomic_file(dest) as tmp, open(tmp, "wb") as f:
            write(f)
            f.flush()
            # on disk before the rename: some filesystems report a full disk only here
            os.fsync(f.fileno())
    except Exception as e:
        if no_space(e):
            raise disk_full(dest, needed, what, fix) from e
        raise
    return dest
