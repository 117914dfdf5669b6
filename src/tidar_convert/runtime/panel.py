"""The panel product: a small C kernel (csrc/panel.c), built on first use, that streams each weight
once per call for every row of a decoding step, in fp32 or bf16.

Each weight is packed once in panels of 32 outputs by all inputs (`panel_pack`); `panel_linear`
runs up to 16 rows' multiply-adds on each piece while it is in cache and prefetches the next, so 8
rows cost little more than 2. Each output is one dot product summed over the inputs in order,
whatever the row count, so a row's result is the same bit for bit alone or among any number of rows
(bf16 rows and panels are summed in fp32 and each output rounded once: the same property). The same
library adds a mask-slot adapter's low-rank delta to a step's mask rows (`lora_add`), computes
attention the same way for every query (`attention`), and each row's argmax (`argmax`) and k
likeliest tokens with their probabilities (`top_choices`).

Built with the machine's C compiler (`cc`, or $CC; -march=native, OpenMP) into $TIDAR_CACHE/kernels
on first use (`panel_library`), once per CPU and compiler; TIDAR_PANEL_KERNEL=0 turns it off, and
where no compiler builds it a warning says so once and fp32 and bf16 take another product
(kernels.py).

Shipped in every export's custom_generate/ folder: imports nothing but torch and the standard
library. The C source is csrc/panel.c beside this file in the package; an export carries it as
panel_source.py (written by exports/folder.py from csrc/panel.c), because transformers' module
cache copies only the .py files a module imports.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

# outputs per panel: two 16-float vectors, times up to 16 rows (one pass over the panel) of
# accumulators
PANEL = 32
# Each output's dot product runs over k in order, one fused multiply-add at a time, whatever the row
# count: a row's result is the same bit for bit alone or among any number (a prefill's rows are
# taken 16 at a time). The prefetch keeps the weight stream ahead of the arithmetic, so 8 rows cost
# little more than 2 (the weights are read once).
# No -ffast-math: k stays in order.
PANEL_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
_PANEL_LIB: list = []  # [the loaded library, or None where it cannot be built]
# in the package; an export has panel_source.py instead
SOURCE_FILE = Path(__file__).parent / "csrc" / "panel.c"


def panel_source() -> str:
    """The kernel's C source: csrc/panel.c beside this file, else the copy an export ships."""
    if SOURCE_FILE.is_file():
        return SOURCE_FILE.read_text()
    try:
        from .panel_source import SOURCE
    except ImportError as err:
        raise OSError(
            f"no kernel source: neither {SOURCE_FILE} "
            f"nor panel_source.py beside {Path(__file__).name}"
        ) from err
    return SOURCE


def panel_built() -> bool:
    """The kernel was asked for and is loaded (checked without building it: a test on every AR
    step)."""
    return bool(_PANEL_LIB) and _PANEL_LIB[0] is not None


def _cpu_signature() -> str:
    """What a build with -march=native depends on: the machine's architecture and CPU flags."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()} {flags}"


def panel_library():
    """The panel kernel built for this CPU, loaded; None where it cannot be (no C compiler with
    OpenMP, say: fp32 and bf16 then run oneDNN's packed product or the stock one, with a warning
    once). Built once per CPU and compiler with `cc` (or $CC) into $TIDAR_CACHE/kernels (default
    ~/.cache/tidar_convert); TIDAR_PANEL_KERNEL=0 turns it off."""
    if _PANEL_LIB:
        return _PANEL_LIB[0]
    lib = None
    if os.environ.get("TIDAR_PANEL_KERNEL", "1") != "0":
        try:
            lib = _build_panel_library()
        except CacheUnwritable as err:
            warnings.warn(
                "TiDAR's panel kernel could not be built: its cache folder "
                f"{err.folder} is not writable ({err.__cause__}); "
                "fp32 and bf16 linear layers take oneDNN's packed product or the stock one. "
                "Set TIDAR_CACHE to a writable folder "
                "(default ~/.cache/tidar_convert); TIDAR_PANEL_KERNEL=0 silences this.",
                stacklevel=3,
            )
        except (OSError, subprocess.SubprocessError) as err:
            warnings.warn(
                f"TiDAR's panel kernel could not be built ({err}); "
                "fp32 and bf16 linear layers take oneDNN's packed product or the stock one. "
                "Install a C compiler with OpenMP (gcc) or set CC to one; "
                "TIDAR_PANEL_KERNEL=0 silences this.",
                stacklevel=3,
            )
    _PANEL_LIB.append(lib)
    return lib


class CacheUnwritable(OSError):
    """The kernel cache folder cannot be written: the fix is TIDAR_CACHE, not a compiler."""

    def __init__(self, folder: Path):
        super().__init__(f"{folder} is not writable")
        self.folder = folder


def _build_panel_library():
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise OSError("no C compiler on PATH")
    source = panel_source()
    key = hashlib.sha256(
        "\0".join((source, cc, *PANEL_FLAGS, _cpu_signature())).encode()
    ).hexdigest()[:16]
    folder = (
        Path(os.environ.get("TIDAR_CACHE") or Path.home() / ".cache" / "tidar_convert") / "kernels"
    )
    path = folder / f"panels-{key}.so"
    if not path.exists():
        try:
            folder.mkdir(parents=True, exist_ok=True)
            build = tempfile.TemporaryDirectory(dir=folder)
        except OSError as err:
            raise CacheUnwritable(folder) from err
        # built aside, then renamed: a concurrent build or a kill leaves no half file
        with build as tmp:
            src, out = Path(tmp) / "panels.c", Path(tmp) / "panels.so"
            src.write_text(source)
            done = subprocess.run(
                [cc, *PANEL_FLAGS, str(src), "-o", str(out)],
                capture_output=True,
                text=True,
                timeout=300,
            )
            if done.returncode != 0:
                raise OSError(f"{cc} exited {done.returncode}: {done.stderr.strip()[-500:]}")
            os.replace(out, path)
    lib = ctypes.CDLL(str(path))
    P, L = ctypes.c_void_p, ctypes.c_long
    lib.tidar_panel_linear.argtypes = [P, L, L, P, L, P, P, ctypes.c_int, P, L, P, L]
    lib.tidar_panel_linear.restype = None
    lib.tidar_panel_linear_bf16.argtypes = [P, L, L, P, L, P, P, ctypes.c_int]
    lib.tidar_panel_linear_bf16.restype = ctypes.c_int
    lib.tidar_lora_add.argtypes = [P, L, L, P, L, P, L, P, ctypes.c_int]
    lib.tidar_lora_add.restype = None
    lib.tidar_lora_add_bf16.argtypes = [P, L, L, P, L, P, L, P, ctypes.c_int, ctypes.c_int]
    lib.tidar_lora_add_bf16.restype = ctypes.c_int
    lib.tidar_attention.argtypes = [
        P,
        P,
        P,
        P,
        L,
        L,
        L,
        ctypes.c_int,
        L,
        L,
        L,
        L,
        L,
        L,
        L,
        L,
        ctypes.c_float,
        P,
        ctypes.c_int,
    ]
    lib.tidar_attention.restype = None
    lib.tidar_argmax.argtypes = [P, L, L, L, ctypes.c_int, P]
    lib.tidar_argmax.restype = None
    lib.tidar_top_choices.argtypes = [P, L, L, L, ctypes.c_int, ctypes.c_int, P, P]
    lib.tidar_top_choices.restype = ctypes.c_int
    return lib


def panel_pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> panels [ceil(N / 32), K, 32], the outputs past N zero; bf16 stays bf16, anything
    else is fp32."""
    n, k = weight.shape
    padded = F.pad(
        weight if weight.dtype == torch.bfloat16 else weight.float(), (0, 0, 0, -n % PANEL)
    )
    return padded.view(-1, PANEL, k).transpose(1, 2).contiguous()


def panel_linear(
    x: torch.Tensor,
    panels: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None = None,
    lora: tuple[torch.Tensor, torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """x @ W.T (+ bias) on W's panels (panel_pack), on this CPU's panel kernel: fp32, or bf16 rows
    on bf16 panels (summed in fp32, rounded once). Lean: it runs for every linear layer of every
    decoding step, so a microsecond's overhead a call adds up over a forward. lora (fp32 only; a
    bf16 product takes the delta from lora_add after): (A (R, K), B's panels (panel_pack of B,
    N x R), start): rows start.. of x (its rows taken as one (M, K) matrix) also get x @ A.T @ B.T,
    in the same pass."""
    k = x.shape[-1]
    lib = panel_library()
    if (
        lib is None
        or x.dtype != panels.dtype
        or x.dtype not in (torch.float32, torch.bfloat16)
        or panels.shape[1] != k
    ):
        raise ValueError(
            f"panel_linear: input of {panels.shape[1]} features in the panels' dtype "
            f"({panels.dtype}) and a built kernel needed, "
            f"got {x.dtype} x {k}"
        )
    if not x.is_contiguous():
        x = x.contiguous()
    if bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()):
        bias = bias.to(x.dtype).contiguous()
    y = torch.empty(*x.shape[:-1], out_features, dtype=x.dtype)
    if x.dtype == torch.bfloat16:
        if lora is not None:
            raise ValueError(
                "panel_linear: a bf16 product takes no adapter in its pass (lora_add adds it after)"
            )
        if lib.tidar_panel_linear_bf16(
            x.data_ptr(),
            x.numel() // k,
            k,
            panels.data_ptr(),
            out_features,
            None if bias is None else bias.data_ptr(),
            y.data_ptr(),
            torch.get_num_threads(),
        ):
            raise MemoryError(f"panel_linear: no memory for {x.numel()} widened input values")
        return y
    A, pb, start = (None, None, 0) if lora is None else lora
    if A is not None and not (
        A.dtype == torch.float32
        and A.is_contiguous()
        and A.shape == (pb.shape[1], k)
        and pb.shape[0] == panels.shape[0]
    ):
        raise ValueError(
            f"panel_linear: an adapter's A (R, {k}) in fp32, contiguous, "
            f"and B's panels ({panels.shape[0]}, R, {PANEL}) needed, "
            f"got {A.dtype} {tuple(A.shape)} and {tuple(pb.shape)}"
        )
    lib.tidar_panel_linear(
        x.data_ptr(),
        x.numel() // k,
        k,
        panels.data_ptr(),
        out_features,
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        torch.get_num_threads(),
        None if A is None else A.data_ptr(),
        0 if A is None else A.shape[0],
        None if pb is None else pb.data_ptr(),
        start,
    )
    return y


def lora_add(
    out: torch.Tensor, x: torch.Tensor, start: int, A: torch.Tensor, Bt: torch.Tensor
) -> bool:
    """out[0, start:] += x[0, start:] @ A.T @ Bt in place, in one C call: a batch-1 step's trailing
    mask rows (adapter.Gate). out and x fp32 with A and Bt fp32; or out and x bf16 with A and Bt
    fp32 or bf16 (the delta summed in fp32, each output rounded once); all contiguous. False
    (nothing done) where that does not hold or the kernel library is not built, and the caller runs
    torch's products."""
    lib = _PANEL_LIB[0] if _PANEL_LIB else panel_library()
    if lib is None or out.shape[0] != 1 or out.dtype != x.dtype or A.dtype != Bt.dtype:
        return False
    if not (out.is_contiguous() and x.is_contiguous() and A.is_contiguous() and Bt.is_contiguous()):
        return False
    k, n, size = x.shape[-1], out.shape[-1], out.element_size()
    rows = out.numel() // n - start
    args = (
        x.data_ptr() + size * start * k,
        rows,
        k,
        A.data_ptr(),
        A.shape[0],
        Bt.data_ptr(),
        n,
        out.data_ptr() + size * start * n,
        torch.get_num_threads(),
    )
    if out.dtype == torch.float32 and A.dtype == torch.float32:
        lib.tidar_lora_add(*args)
    elif out.dtype == torch.bfloat16 and A.dtype in (torch.float32, torch.bfloat16):
        if lib.tidar_lora_add_bf16(*args, A.dtype == torch.bfloat16):
            raise MemoryError(f"lora_add: no memory for {rows} rows of {k} + {n} floats")
    else:
        return False
    return True


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float,
) -> torch.Tensor:
    """Softmax attention on the kernel library's `tidar_attention`: each output a function of its
    query and the keys it sees alone, bit for bit (csrc/panel.c). query (B, Hq, Q, D), key and value
    (B, Hkv, L, D), fp32 (kernels.sdpa_exact widens bf16 to it, exactly); mask: bool, broadcastable
    to (B, Hq, Q, L), True = attend; or None: every key, or keys j <= i where `causal` (torch's
    is_causal). Returns (B, Q, Hq, D) in fp32, as transformers' attention functions do."""
    lib = panel_library()
    B, Hq, Q, D = query.shape
    Hkv, L = key.shape[1], key.shape[2]
    query, (key, ks), (value, vs) = query.contiguous(), rows_apart(key), rows_apart(value)
    strides = (0, 0, 0)
    if mask is not None:
        mask = mask.expand(B, Hq, Q, L)
        if mask.stride(-1) != 1:
            mask = mask.contiguous()
        strides = tuple(0 if mask.shape[i] == 1 else mask.stride(i) for i in range(3))
    out = torch.empty(B, Q, Hq, D, dtype=torch.float32)
    lib.tidar_attention(
        query.data_ptr(),
        key.data_ptr(),
        value.data_ptr(),
        None if mask is None else mask.data_ptr(),
        *strides,
        int(causal),
        B,
        Hq,
        Hkv,
        Q,
        L,
        D,
        ks,
        vs,
        scale,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out


def rows_apart(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x (B, H, L, D) as the kernel reads it, and the rows from one (batch, head)'s first entry to
    the next's: a cache's filled part (cache.GrowingLayer, rows of a larger buffer) is read where
    it is, anything else is made contiguous."""
    B, H, L, D = x.shape
    s = x.stride()
    if s[3] == 1 and s[2] == D and s[1] % D == 0 and s[1] >= L * D and s[0] == H * s[1]:
        return x, s[1] // D
    return x.contiguous(), L


def argmax(scores: torch.Tensor) -> torch.Tensor | None:
    """scores.argmax(-1) on the kernel library's `tidar_argmax`, the same index (the first of a tie,
    a NaN counting as the largest), where the library is already loaded (a CPU step under
    kernels.cpu_kernels; an argmax never builds it) and scores are fp32 or bf16 on the CPU, each
    row's values contiguous and the rows evenly apart; else None, and the caller runs torch's.
    torch's CPU argmax walks a row one score at a time: on a vocabulary's row this is several
    times faster (bench/LOG.md, 2026-12-07, tenth session)."""
    n = scores.shape[-1] if scores.dim() else 0
    if n == 0 or not _kernel_reads(scores):
        return None
    rows, step = _even_rows(scores)
    if step is None:
        return None
    out = torch.empty(scores.shape[:-1], dtype=torch.long)
    _PANEL_LIB[0].tidar_argmax(
        scores.data_ptr(), rows, n, step, int(scores.dtype == torch.bfloat16), out.data_ptr()
    )
    return out


def top_choices(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each row's k largest scores' indices (..., k), largest first and the earlier index first
    among equals, and their softmax probabilities (..., k) in fp32, on the kernel library's
    `tidar_top_choices`, under argmax's conditions (rows not evenly apart are copied first) and with
    1 <= k <= 16 scores of a row; None where they do not hold or a row has a NaN or nothing above
    -inf (the caller runs torch's). The probabilities are those of torch's softmax to fp32
    rounding, not bit for bit (the exponential is the attention kernel's polynomial): a draft's
    chances, which plan a step."""
    n = scores.shape[-1] if scores.dim() else 0
    if not _kernel_reads(scores) or not 1 <= k <= min(16, n):
        return None
    rows, step = _even_rows(scores)
    if step is None:  # copied rather than left to torch: the same rows, the same chances
        scores = scores.contiguous()
        rows, step = _even_rows(scores)
    idx = torch.empty(*scores.shape[:-1], k, dtype=torch.long)
    chance = torch.empty(*scores.shape[:-1], k, dtype=torch.float32)
    bf = int(scores.dtype == torch.bfloat16)
    if _PANEL_LIB[0].tidar_top_choices(
        scores.data_ptr(), rows, n, step, bf, k, idx.data_ptr(), chance.data_ptr()
    ):
        return None
    return idx, chance


def _kernel_reads(scores: torch.Tensor) -> bool:
    """The library is loaded (never built here) and scores are what argmax and top_choices read:
    fp32 or bf16, on the CPU."""
    return (
        panel_built()
        and scores.device.type == "cpu"
        and scores.dtype in (torch.float32, torch.bfloat16)
    )


def _even_rows(x: torch.Tensor) -> tuple[int, int | None]:
    """x's rows (every index but the last) and the elements from one row's first value to the
    next's, where each row is contiguous and the rows are that many apart in order; None as the
    step where they are not (a row of one dim-1 tensor: 1 row, step 0)."""
    if x.stride(-1) != 1 and x.shape[-1] > 1:
        return 0, None
    rows, step = 1, 0
    for size, stride in reversed(list(zip(x.shape[:-1], x.stride()[:-1]))):
        if size == 1:
            continue
        if rows == 1:
            step = stride
        elif stride != step * rows:
            return 0, None
        rows *= size
    return rows, step
