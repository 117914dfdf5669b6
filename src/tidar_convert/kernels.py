"""Linear layers on CPU with their weights packed once, so that extra query slots are nearly free.

TiDAR rests on one fact about decoding: a forward of a few query slots costs about what a forward of
one slot costs, because reading the weights dominates. PyTorch's stock CPU linear breaks that. Its
MKL path runs 1 to 3 rows as matrix-vector products and 4 or more through a GEMM that is slow on so
few rows. On a 2-core Xeon with AMX, one pass through SmolLM2-135M's 210 linear layers in fp32 takes
19 ms for 1 row, 22 for 3, 30 for 4 and 36 for 8; without AMX, one forward took 59 ms for 1 slot and
96 for 2 (bench/results/masks-greedy-600-fp32-packed.json).

Two packed products, each made from the weight once and kept:
- **panels** (fp32): the weight in panels of 32 outputs by all inputs, streamed once per call by a
  small C kernel (PANEL_SOURCE) that does every row's multiply-adds on each piece while it is in
  cache and prefetches the next. The same pass takes 21 ms for 4 rows and 24 for 8. Each output is
  one dot product summed over the inputs in order, whatever the row count, so a row's result is the
  same bit for bit among 2 rows or among PANEL_ROWS. One row (an AR step) runs the stock
  matrix-vector product, a little faster, and a prefill's many rows the stock GEMM, faster where
  arithmetic bounds the product. Built with the machine's C compiler (`cc`, or $CC; -march=native,
  OpenMP) into $TIDAR_CACHE/kernels on first use, in about a second, once per CPU and compiler;
  where no compiler builds it, fp32 takes oneDNN's product, with a warning saying so.
- **onednn** (bf16, and fp32 without the panel kernel): each weight reordered once into oneDNN's
  blocked layout (what torch.compile's CPU freezing does). On AMX it makes bf16 flat: 17 ms for 1 or
  8 rows against 23 stock. In fp32 on the AMX Xeon it is flat but slow (about 35 ms).

Which product runs is measured, not assumed: `packing_pays(model)` times one pass through the
model's linear layers at 1 row (an AR step) and at 8 rows (a TiDAR step) with the stock product and
the packed one, once per model and dtype: 13 passes that each read every weight once (about 0.5 s
for SmolLM2-135M, in proportion to the weights' size for larger models), holding one more copy of
the weights while it times. `cpu_kernels(model, "auto")`, what generate() enters for every path
(TiDAR, plain AR, prompt lookup), packs only where that pass is faster. One choice per model, so
every decoder on a model runs the same kernels.

The panel product makes a row's linear output independent of how many rows (2 to 64) share the
call; oneDNN's is on the Xeon without AMX (measured bitwise for 1 to 13 rows) but not on the one with
AMX (a 1536-input layer gives other low bits for 1 row than for 2 or more), and the stock product is not on
either. Attention with one query and with several differ in the low bits too. So greedy TiDAR equals
greedy AR where the AR's best token leads by more than that noise, about 1e-4 in fp32 logits on
SmolLM2-135M: on every bench prompt so far, and checked by the greedy identity tests.

`packed_linears(model)` swaps every eligible `nn.Linear.forward` for the packed one while it is
entered. A layer's packed weight is kept while the layer lives (one more copy of its weight) and made
again when the weight changes (another tensor, or an in-place update); a model where packing does not
pay keeps none. Training and anything that needs gradients run the stock product.

`grouped_attention(model)` does the same for attention: under a mask, transformers' SDPA path copies
each layer's grouped key/value heads to every query head first (repeat_kv: the whole cache, every
layer, every step), because CUDA's kernels need it; PyTorch's CPU kernel attends the groups in place
(`enable_gqa`), to the same values. Every TiDAR step and every prompt-lookup step has a mask and
several queries.

Shipped in every export's custom_generate/ folder: imports nothing but torch and the standard library
(transformers, for the attention function, only when it is used).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import time
import warnings
import weakref
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

DTYPES = (torch.float32, torch.bfloat16)
PACK_ROWS = 8  # oneDNN's hint of the rows a call will have: a decoding step's slots
# layer -> (key, packed weight). Beside the layer, not on it: an opaque oneDNN tensor on a module
# would break deepcopy, pickling and state_dict; it goes with the layer.
_PACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
CHOICE_ROWS = (1, 8)  # the rows of an AR step and of a typical TiDAR step, timed with equal weight
_DELTA_PANELS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # layer -> (its adapter's B, B's panels)
_PAYS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (its linear layers' dtype and count, packing pays)
# A layer may carry a mask-slot adapter (adapter.attach): its down-projection A (r, in) and its
# up-projection transposed (r, out) as buffers, and the model's gate, whose `start` is the first mask
# row of a batch-1 forward (None: none, or not one trailing block), and whose `add` adds the delta
# to a product's mask rows. The adapter's forward hook (marked DELTA_HOOK) adds it on the stock
# product; packed_linears sets that hook aside and packed_forward adds it instead, within the panel
# pass where it can (a hook costs ~7 us a layer, about 1 ms a forward on SmolLM2-135M).
LORA_A, LORA_BT, LORA_GATE, DELTA_HOOK = "tidar_lora_A", "tidar_lora_Bt", "_tidar_lora_gate", "_tidar_delta_hook"


def available() -> bool:
    """oneDNN's packed linear ops are in this torch build."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight
        torch.ops.mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return False
    return True


# --------------------------------------------------------------------------------------------
# The panel product: fp32 weights in panels of 32 outputs, streamed once for every row of a step.
# --------------------------------------------------------------------------------------------

PANEL = 32  # outputs per panel: two 16-float vectors, times up to 16 rows (one pass over the panel) of accumulators
PANEL_ROWS = 64  # above this many rows (a prompt's prefill) compute, not reading weights, bounds a product: stock GEMM
# Each output's dot product runs over k in order, one fused multiply-add at a time, whatever the row
# count: a row's result is the same bit for bit among 2 or among 64. The prefetch keeps the weight
# stream ahead of the arithmetic, so 8 rows cost little more than 2 (the weights are read once). One
# row (an AR step) takes the stock product: MKL's matrix-vector product is a little faster there
# (a SmolLM2-135M forward 37.5 ms against 40 on panels; the Python around each call is most of it).
PANEL_SOURCE = r"""
#include <stdlib.h>
#include <string.h>
#define NB 32
#define PF 1024
typedef float v16 __attribute__((vector_size(64), aligned(4)));
#define PANEL(MM) \
static void panel##MM(const float *x, long K, const float *w, const float *u, long R, const float *wb, float *out) { \
  v16 a0[MM], a1[MM]; \
  for (int i = 0; i < MM; i++) { a0[i] = (v16){0}; a1[i] = (v16){0}; } \
  for (long k = 0; k < K; k++) { \
    __builtin_prefetch(w + k * NB + PF, 0, 3); \
    __builtin_prefetch(w + k * NB + PF + 16, 0, 3); \
    v16 w0 = *(const v16 *)(w + k * NB), w1 = *(const v16 *)(w + k * NB + 16); \
    _Pragma("GCC unroll 16") \
    for (int i = 0; i < MM; i++) { float xv = x[i * K + k]; a0[i] += xv * w0; a1[i] += xv * w1; } \
  } \
  for (long r = 0; r < R; r++) { \
    v16 w0 = *(const v16 *)(wb + r * NB), w1 = *(const v16 *)(wb + r * NB + 16); \
    _Pragma("GCC unroll 16") \
    for (int i = 0; i < MM; i++) { float uv = u[i * R + r]; a0[i] += uv * w0; a1[i] += uv * w1; } \
  } \
  for (int i = 0; i < MM; i++) { memcpy(out + i * NB, &a0[i], 64); memcpy(out + i * NB + 16, &a1[i], 64); } \
}
PANEL(1) PANEL(2) PANEL(3) PANEL(4) PANEL(5) PANEL(6) PANEL(7) PANEL(8)
PANEL(9) PANEL(10) PANEL(11) PANEL(12) PANEL(13) PANEL(14) PANEL(15) PANEL(16)
typedef void (*panel_fn)(const float *, long, const float *, const float *, long, const float *, float *);
static const panel_fn PANELS[17] = {0, panel1, panel2, panel3, panel4, panel5, panel6, panel7, panel8,
                                    panel9, panel10, panel11, panel12, panel13, panel14, panel15, panel16};

/* y[M, N] = x[M, K] @ W.T (+ b); W packed as panels P[ceil(N / NB)][K][NB], zero-padded. Where A
   is given, a mask-slot adapter's delta on rows start..M-1 (adapter.py) is in the same pass: B (the
   up-projection, N x R) packed the same way as PB[ceil(N / NB)][R][NB], each row's scores u_i = x_i @ A.T
   (A: R x K) computed first (each core a share of A's rows; zero for the rows before start), and
   each output's sum running on over R more terms after W's K. A row before start so sums the same
   products in the same order, then zeros: its output is the plain product's. */
void tidar_panel_linear(const float *x, long M, long K, const float *p, long N, const float *b, float *y, int threads,
                        const float *A, long R, const float *pb, long start) {
  long panels = (N + NB - 1) / NB;
  float *u = 0;
  if (A && R > 0 && start < M) u = calloc(M * R, sizeof(float));  /* u[i * R + r] = x_i . A_r */
  else R = 0;
  #pragma omp parallel num_threads(threads)
  {
    if (u) {
      #pragma omp for schedule(static)
      for (long r = 0; r < R; r++) {
        const float *a = A + r * K;
        for (long i = start; i < M; i++) {
          const float *xi = x + i * K;
          v16 acc = {0};
          long k = 0;
          for (; k + 16 <= K; k += 16) {
            if (i == start) __builtin_prefetch(a + k + 512, 0, 3);
            acc += *(const v16 *)(xi + k) * *(const v16 *)(a + k);
          }
          float t = 0.f;
          for (int j = 0; j < 16; j++) t += acc[j];
          for (; k < K; k++) t += xi[k] * a[k];
          u[i * R + r] = t;
        }
      }
    }
    #pragma omp for schedule(static)
    for (long q = 0; q < panels; q++) {
      float out[16 * NB];
      for (long m0 = 0; m0 < M; m0 += 16) {
        long mm = M - m0 < 16 ? M - m0 : 16;
        long r = m0 + mm > start ? R : 0;  /* a block of rows before start skips the zero terms */
        PANELS[mm](x + m0 * K, K, p + q * K * NB, u ? u + m0 * R : 0, r, r ? pb + q * R * NB : 0, out);
        for (long i = 0; i < mm; i++)
          for (long j = 0; j < NB && q * NB + j < N; j++)
            y[(m0 + i) * N + q * NB + j] = b ? out[i * NB + j] + b[q * NB + j] : out[i * NB + j];
      }
    }
  }
  free(u);
}

/* bf16 <-> fp32: widening is exact; narrowing rounds to nearest even and keeps NaN a NaN. */
static inline float bf2f(unsigned short h) { union { unsigned u; float f; } v; v.u = (unsigned)h << 16; return v.f; }
static inline unsigned short f2bf(float f) {
  union { float f; unsigned u; } v; v.f = f;
  if ((v.u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((v.u >> 16) | 0x40);  /* NaN stays NaN */
  return (unsigned short)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}
typedef unsigned short v16h __attribute__((vector_size(32), aligned(2)));
typedef unsigned v16u __attribute__((vector_size(64), aligned(4)));
static inline v16 bf16x16(const unsigned short *h) { return (v16)(__builtin_convertvector(*(const v16h *)h, v16u) << 16); }
static void bf16_to_f32(const unsigned short *h, long n, float *f) {
  long i = 0;
  for (; i + 16 <= n; i += 16) *(v16 *)(f + i) = bf16x16(h + i);
  for (; i < n; i++) f[i] = bf2f(h[i]);
}
static void f32_to_bf16(const float *f, long n, unsigned short *h) {
  long i = 0;
  for (; i + 16 <= n; i += 16) {
    v16u u = (v16u)(*(const v16 *)(f + i));
    v16u r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    v16u nan = (v16u)((u & 0x7fffffffu) > 0x7f800000u);
    *(v16h *)(h + i) = __builtin_convertvector((nan & ((u >> 16) | 0x40u)) | (~nan & r), v16h);
  }
  for (; i < n; i++) h[i] = f2bf(f[i]);
}

/* y[M, N] += (x[M, K] @ A[R, K].T) @ Bt[R, N]: a mask-slot adapter's low-rank delta on a step's mask
   rows (adapter.py) where the panel pass does not add it (stock products, a prefill's rows, a bf16
   model), in one call: torch's two products and the slicing around them cost ~35 us a layer, whatever
   the rank. The scores first, then each core adds its half of the outputs, A and Bt read from memory
   once for all rows. A and Bt are fp32, or bf16 (wbf = 1: a model cast to bf16 after its adapter was attached,
   where torch's bf16 products made a forward 1.3x slower), widened as they are read; the sums are fp32
   either way, so bf16 weights give what the same weights widened to fp32 give, bit for bit. */
#define LORA_MAX 4096  /* M * R of the scores kept on the stack; a larger call does blocks of rows */
static inline __attribute__((always_inline)) v16 wvec(const void *w, long i, int wbf) {
  return wbf ? bf16x16((const unsigned short *)w + i) : *(const v16 *)((const float *)w + i);
}
static inline __attribute__((always_inline)) float wone(const void *w, long i, int wbf) {
  return wbf ? bf2f(((const unsigned short *)w)[i]) : ((const float *)w)[i];
}
static void lora_rows(const float *x, long M, long K, const void *A, long R, const void *Bt, long N, float *y, int threads, int wbf) {
  float t[LORA_MAX];  /* t[i * R + r] = x_i . A_r */
  int big = R * (K + N) >= 8192;  /* below it, waking the other core costs more than it saves */
  #pragma omp parallel num_threads(threads) if(big)
  {
    #pragma omp for schedule(static)
    for (long r = 0; r < R; r++) {
      for (long i = 0; i < M; i++) {
        const float *xi = x + i * K;
        v16 acc = {0};
        long k = 0;
        for (; k + 16 <= K; k += 16) {
          if (i == 0) __builtin_prefetch((const char *)A + (r * K + k + 512) * (wbf ? 2 : 4), 0, 3);
          acc += *(const v16 *)(xi + k) * wvec(A, r * K + k, wbf);
        }
        float s = 0.f;
        for (int j = 0; j < 16; j++) s += acc[j];
        for (; k < K; k++) s += xi[k] * wone(A, r * K + k, wbf);
        t[i * R + r] = s;
      }
    }
    #pragma omp for schedule(static)
    for (long part = 0; part < 2; part++) {  /* each core its half of the outputs */
      long n0 = part * (N / 32) * 16, n1 = part ? N : (N / 32) * 16, n = n0;
      /* 16 outputs of up to 8 rows held in registers while every r adds to them, in r's order (the
         sum of each output as before); y is read and written once, not once per r */
      for (; n + 16 <= n1; n += 16)
        for (long i0 = 0; i0 < M; i0 += 8) {
          int m = M - i0 < 8 ? (int)(M - i0) : 8;
          v16 acc[8];
          for (int i = 0; i < m; i++) acc[i] = *(v16 *)(y + (i0 + i) * N + n);
          for (long r = 0; r < R; r++) {
            v16 bv = wvec(Bt, r * N + n, wbf);
            const float *ti = t + i0 * R + r;
            for (int i = 0; i < m; i++) acc[i] += ti[i * R] * bv;
          }
          for (int i = 0; i < m; i++) *(v16 *)(y + (i0 + i) * N + n) = acc[i];
        }
      for (; n < n1; n++)
        for (long i = 0; i < M; i++)
          for (long r = 0; r < R; r++) y[i * N + n] += t[i * R + r] * wone(Bt, r * N + n, wbf);
    }
  }
}
static void lora_blocks(const float *x, long M, long K, const void *A, long R, const void *Bt, long N, float *y, int threads, int wbf) {
  if (M <= 0 || R <= 0) return;
  long mb = LORA_MAX / R < 1 ? 1 : LORA_MAX / R;  /* R alone past LORA_MAX is no adapter this repo saves */
  for (long m0 = 0; m0 < M; m0 += mb) {
    long m = M - m0 < mb ? M - m0 : mb;
    lora_rows(x + m0 * K, m, K, A, R, Bt, N, y + m0 * N, threads, wbf);
  }
}
void tidar_lora_add(const float *x, long M, long K, const float *A, long R, const float *Bt, long N, float *y, int threads) {
  lora_blocks(x, M, K, A, R, Bt, N, y, threads, 0);
}

/* The same on bf16 rows (a bf16 model's mask rows): x and y bf16, the adapter fp32 or bf16 (wbf);
   each output gets its delta summed in fp32 and is rounded to bf16 once. torch's path converts the rows
   to fp32 and back around its two products: ~60 us a layer. */
#define LORA_ROWS_MAX 16384  /* floats of the rows converted on the stack (64 KiB; a step's few mask rows): malloc costs ~2 us */
int tidar_lora_add_bf16(const unsigned short *x, long M, long K, const void *A, long R, const void *Bt, long N, unsigned short *y, int threads, int wbf) {
  if (M <= 0 || R <= 0) return 0;
  float stack[LORA_ROWS_MAX];
  long size = M * (K + N);
  float *xf = size <= LORA_ROWS_MAX ? stack : malloc(sizeof(float) * size), *yf = xf + M * K;
  if (!xf) return -1;
  bf16_to_f32(x, M * K, xf);
  bf16_to_f32(y, M * N, yf);
  lora_blocks(xf, M, K, A, R, Bt, N, yf, threads, wbf);
  f32_to_bf16(yf, M * N, y);
  if (xf != stack) free(xf);
  return 0;
}
"""
PANEL_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")  # no -ffast-math: k stays in order
_PANEL_LIB: list = []  # [the loaded library, or None where it cannot be built]


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
    OpenMP, say: fp32 then runs oneDNN's packed product, with a warning once). Built once per CPU
    and compiler with `cc` (or $CC) into $TIDAR_CACHE/kernels (default ~/.cache/tidar_convert), in
    about a second; TIDAR_PANEL_KERNEL=0 turns it off."""
    if _PANEL_LIB:
        return _PANEL_LIB[0]
    lib = None
    if os.environ.get("TIDAR_PANEL_KERNEL", "1") != "0":
        try:
            lib = _build_panel_library()
        except CacheUnwritable as err:
            warnings.warn(f"TiDAR's fp32 panel kernel could not be built: its cache folder {err.folder} is not writable ({err.__cause__}); "
                          "fp32 linear layers take oneDNN's packed product or the stock one. Set TIDAR_CACHE to a writable folder "
                          "(default ~/.cache/tidar_convert); TIDAR_PANEL_KERNEL=0 silences this.", stacklevel=3)
        except (OSError, subprocess.SubprocessError) as err:
            warnings.warn(f"TiDAR's fp32 panel kernel could not be built ({err}); fp32 linear layers take oneDNN's packed product "
                          "or the stock one. Install a C compiler with OpenMP (gcc) or set CC to one; TIDAR_PANEL_KERNEL=0 silences this.", stacklevel=3)
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
    key = hashlib.sha256("\0".join((PANEL_SOURCE, cc, *PANEL_FLAGS, _cpu_signature())).encode()).hexdigest()[:16]
    folder = Path(os.environ.get("TIDAR_CACHE") or Path.home() / ".cache" / "tidar_convert") / "kernels"
    path = folder / f"panels-{key}.so"
    if not path.exists():
        try:
            folder.mkdir(parents=True, exist_ok=True)
            build = tempfile.TemporaryDirectory(dir=folder)
        except OSError as err:
            raise CacheUnwritable(folder) from err
        with build as tmp:  # built aside, then renamed: a concurrent build or a kill leaves no half file
            src, out = Path(tmp) / "panels.c", Path(tmp) / "panels.so"
            src.write_text(PANEL_SOURCE)
            done = subprocess.run([cc, *PANEL_FLAGS, str(src), "-o", str(out)], capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                raise OSError(f"{cc} exited {done.returncode}: {done.stderr.strip()[-500:]}")
            os.replace(out, path)
    lib = ctypes.CDLL(str(path))
    P, L = ctypes.c_void_p, ctypes.c_long
    lib.tidar_panel_linear.argtypes = [P, L, L, P, L, P, P, ctypes.c_int, P, L, P, L]
    lib.tidar_panel_linear.restype = None
    lib.tidar_lora_add.argtypes = [P, L, L, P, L, P, L, P, ctypes.c_int]
    lib.tidar_lora_add.restype = None
    lib.tidar_lora_add_bf16.argtypes = [P, L, L, P, L, P, L, P, ctypes.c_int, ctypes.c_int]
    lib.tidar_lora_add_bf16.restype = ctypes.c_int
    return lib


def panel_pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> panels [ceil(N / 32), K, 32], the outputs past N zero."""
    n, k = weight.shape
    padded = F.pad(weight.float(), (0, 0, 0, -n % PANEL))
    return padded.view(-1, PANEL, k).transpose(1, 2).contiguous()


def panel_linear(x: torch.Tensor, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None = None,
                 lora: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> torch.Tensor:
    """x @ W.T (+ bias) on W's panels (panel_pack), fp32, on this CPU's panel kernel. Lean: it runs
    for every linear layer of every decoding step, where a microsecond a call is 1 % of a forward.
    lora: (A (R, K), B's panels (panel_pack of B, N x R), start): rows start.. of x (its rows taken
    as one (M, K) matrix) also get x @ A.T @ B.T, in the same pass."""
    k = x.shape[-1]
    lib = panel_library()
    if lib is None or x.dtype != torch.float32 or panels.shape[1] != k:
        raise ValueError(f"panel_linear: fp32 input of {panels.shape[1]} features and a built kernel needed, got {x.dtype} x {k}")
    if not x.is_contiguous():
        x = x.contiguous()
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        bias = bias.float().contiguous()
    A, pb, start = (None, None, 0) if lora is None else lora
    if A is not None and not (A.dtype == torch.float32 and A.is_contiguous() and A.shape == (pb.shape[1], k) and pb.shape[0] == panels.shape[0]):
        raise ValueError(f"panel_linear: an adapter's A (R, {k}) in fp32, contiguous, and B's panels ({panels.shape[0]}, R, {PANEL}) needed, "
                         f"got {A.dtype} {tuple(A.shape)} and {tuple(pb.shape)}")
    y = torch.empty(*x.shape[:-1], out_features, dtype=torch.float32)
    lib.tidar_panel_linear(x.data_ptr(), x.numel() // k, k, panels.data_ptr(), out_features, None if bias is None else bias.data_ptr(),
                           y.data_ptr(), torch.get_num_threads(), None if A is None else A.data_ptr(), 0 if A is None else A.shape[0],
                           None if pb is None else pb.data_ptr(), start)
    return y


def lora_add(out: torch.Tensor, x: torch.Tensor, start: int, A: torch.Tensor, Bt: torch.Tensor) -> bool:
    """out[0, start:] += x[0, start:] @ A.T @ Bt in place, in one C call: a batch-1 step's trailing
    mask rows (adapter.Gate). out and x fp32 with A and Bt fp32; or out and x bf16 with A and Bt fp32
    or bf16 (the delta summed in fp32, each output rounded once); all contiguous. False (nothing done)
    where that does not hold or the kernel library is not built, and the caller runs torch's products."""
    lib = _PANEL_LIB[0] if _PANEL_LIB else panel_library()
    if lib is None or out.shape[0] != 1 or out.dtype != x.dtype or A.dtype != Bt.dtype:
        return False
    if not (out.is_contiguous() and x.is_contiguous() and A.is_contiguous() and Bt.is_contiguous()):
        return False
    k, n, size = x.shape[-1], out.shape[-1], out.element_size()
    rows = out.numel() // n - start
    args = (x.data_ptr() + size * start * k, rows, k, A.data_ptr(), A.shape[0], Bt.data_ptr(), n, out.data_ptr() + size * start * n, torch.get_num_threads())
    if out.dtype == torch.float32 and A.dtype == torch.float32:
        lib.tidar_lora_add(*args)
    elif out.dtype == torch.bfloat16 and A.dtype in (torch.float32, torch.bfloat16):
        if lib.tidar_lora_add_bf16(*args, A.dtype == torch.bfloat16):
            raise MemoryError(f"lora_add: no memory for {rows} rows of {k} + {n} floats")
    else:
        return False
    return True


def can_pack() -> bool:
    """Some packed product is here: oneDNN's, or the panel kernel (built on this first call)."""
    return available() or panel_library() is not None


def eligible(layer) -> bool:
    w = getattr(layer, "weight", None)
    return isinstance(layer, torch.nn.Linear) and w is not None and w.ndim == 2 and w.device.type == "cpu" and w.dtype in DTYPES


def _reorder(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)


def _pack(weight: torch.Tensor) -> tuple[str, torch.Tensor]:
    """fp32: panels where the panel kernel builds; otherwise oneDNN's blocked layout."""
    if weight.dtype == torch.float32 and panel_library() is not None:
        return "panels", panel_pack(weight)
    if not available():
        raise RuntimeError("this torch build has no oneDNN packed linear")
    return "onednn", _reorder(weight)


def packed_weight(layer) -> tuple[str, torch.Tensor] | None:
    """The layer's weight packed ("panels" or "onednn", and the packed tensor), or None where this
    machine's oneDNN refuses it (the layer then keeps the stock product)."""
    w = layer.weight
    key = (w.data_ptr(), w._version, w.dtype, tuple(w.shape))
    cached = _PACKED.get(layer)
    if cached is None or cached[0] != key:
        try:
            packed = _pack(w.detach())
        except RuntimeError:
            packed = None
        cached = _PACKED[layer] = (key, packed)
    return cached[1]


def delta_panels(layer) -> torch.Tensor:
    """The panels of the layer's adapter up-projection B (from its LORA_BT buffer), kept like its weight's."""
    bt = layer._buffers[LORA_BT]
    key = (bt.data_ptr(), bt._version)
    cached = _DELTA_PANELS.get(layer)
    if cached is None or cached[0] != key:
        cached = _DELTA_PANELS[layer] = (key, panel_pack(bt.t()))
    return cached[1]


def packed_product(layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The layer's packed product on x (the stock one where its weight has none, or for a prefill's
    many rows on panels)."""
    packed = packed_weight(layer)
    if packed is None:
        return F.linear(x, layer.weight, bias)
    kind, w = packed
    if kind == "panels":
        if not 1 < x.numel() // x.shape[-1] <= PANEL_ROWS:
            return F.linear(x, layer.weight, bias)
        return panel_linear(x, w, layer.out_features, bias)
    return torch.ops.mkldnn._linear_pointwise(x, w, None if bias is None else bias.detach(), "none", [], "")


def packed_forward(layer):
    """The layer's forward on its packed product. With a mask-slot adapter (LORA_GATE), the forward
    adds the delta itself (packed_linears sets the adapter's hook aside): in the panel pass for a
    batch-1 step's trailing mask rows, else with the gate's own `add` after the product."""
    gate = layer.__dict__.get(LORA_GATE)

    def product(x):
        w = layer.weight
        if x.dtype != w.dtype or x.device != w.device or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)):
            return F.linear(x, w, layer.bias)  # the packed products have no backward and one dtype
        if x.numel() == x.shape[-1] and w.dtype == torch.float32 and _PANEL_LIB and _PANEL_LIB[0] is not None:
            return F.linear(x, w, layer.bias)  # one row, an AR step: stock on panels (packed_product), said first as it is most steps
        return packed_product(layer, x, layer.bias)

    if gate is None:
        product._tidar_packed = True
        return product

    def forward(x):
        if gate.start is not None and x.ndim == 3 and x.shape[0] == 1 and 1 < x.shape[1] <= PANEL_ROWS and x.dtype == torch.float32 and not torch.is_grad_enabled():
            packed = packed_weight(layer)
            if packed is not None and packed[0] == "panels":
                return panel_linear(x, packed[1], layer.out_features, layer.bias, (layer._buffers[LORA_A], delta_panels(layer), gate.start))
        y = product(x)
        return gate.add(y, x, layer._buffers[LORA_A], layer._buffers[LORA_BT]) if gate.open else y

    forward._tidar_packed = True
    return forward


def pass_seconds(layers, rows: int, packed: bool) -> float:
    """One pass of `rows` random rows through each layer, one product at a time, as a forward runs them."""
    g = torch.Generator().manual_seed(0)  # not torch's global one: a seeded generate() after this timing must sample as one without
    inputs = {(n, dtype): torch.randn(rows, n, dtype=dtype, generator=g) for n, dtype in {(layer.in_features, layer.weight.dtype) for layer in layers}}
    start = time.perf_counter()
    for layer in layers:
        x = inputs[layer.in_features, layer.weight.dtype]
        if packed:
            packed_product(layer, x, None)
        else:
            F.linear(x, layer.weight)
    return time.perf_counter() - start


def packing_pays(model, repeats: int = 3) -> bool:
    """Whether the packed product beats PyTorch's stock one on this model's CPU linear layers and this
    machine: one pass through them at each of CHOICE_ROWS, the best of `repeats` runs of each product,
    interleaved so the machine's load falls on both. Timed once per model and dtype (again after a
    cast); a model where packing does not pay drops its packed copies. A sharded model (FSDP) is not
    timed: stock."""
    # Plain tensors only: a sharded weight (FSDP's DTensor) is whole only inside its forward.
    layers = [layer for layer in model.modules() if eligible(layer) and type(layer.weight.data) is torch.Tensor]
    if not layers or not can_pack():
        return False
    key = (layers[0].weight.dtype, len(layers))
    cached = _PAYS.get(model)
    if cached is not None and cached[0] == key:
        return cached[1]
    best = {False: [float("inf")] * len(CHOICE_ROWS), True: [float("inf")] * len(CHOICE_ROWS)}
    with torch.no_grad():
        pass_seconds(layers, 1, True)  # packs every weight (or learns that oneDNN refuses it), untimed
        for _ in range(repeats):
            for i, rows in enumerate(CHOICE_ROWS):
                for packed in (False, True):
                    best[packed][i] = min(best[packed][i], pass_seconds(layers, rows, packed))
    pays = sum(best[True]) < sum(best[False])
    if not pays:
        release(model)
    _PAYS[model] = (key, pays)
    return pays


def linear_product(model) -> str:
    """What generate()'s default runs on the model's CPU linear layers: "stock", or the packed kinds
    ("panels", "onednn", or both joined by "+")."""
    if not packing_pays(model):
        return "stock"
    kinds = {packed[0] for layer in model.modules() if eligible(layer) and (packed := packed_weight(layer)) is not None}
    return "+".join(sorted(kinds)) or "stock"


def resolve(model, enabled: bool | str) -> bool:
    """True/False as given; "auto": packing_pays(model)."""
    if enabled == "auto":
        return packing_pays(model)
    if not isinstance(enabled, bool):
        raise ValueError(f"pack_weights={enabled!r}: use True, False or 'auto' (pack where it is measured faster).")
    return enabled


@contextmanager
def packed_linears(model, enabled: bool = True):
    """Within it, the model's CPU linear layers (fp32 or bf16) run their packed product. Nested
    or concurrent entries leave layers another entry swapped to it; what this one swapped it restores."""
    swapped, aside = [], {}
    if enabled and can_pack():
        for layer in model.modules():
            if not eligible(layer):
                _PACKED.pop(layer, None)  # moved to a GPU or another dtype: its CPU copies are dead weight
                _DELTA_PANELS.pop(layer, None)
            elif not getattr(layer.__dict__.get("forward"), "_tidar_packed", False):
                layer.forward = packed_forward(layer)
                swapped.append(layer)
                if LORA_GATE in layer.__dict__:  # the packed forward adds the adapter's delta: its hook waits outside
                    aside[layer] = {key: hook for key, hook in layer._forward_hooks.items() if getattr(hook, DELTA_HOOK, False)}
                    for key in aside[layer]:
                        del layer._forward_hooks[key]
    try:
        yield swapped
    finally:
        for layer in swapped:
            del layer.forward
        for layer, hooks in aside.items():  # back in registration order (a hook's key is its handle's rising id)
            merged = sorted({**layer._forward_hooks, **hooks}.items())
            layer._forward_hooks.clear()
            layer._forward_hooks.update(merged)


def release(model) -> None:
    """Drop the packed copies kept on the model's layers (they are made again when next needed)."""
    for layer in model.modules():
        _PACKED.pop(layer, None)
        _DELTA_PANELS.pop(layer, None)


# --------------------------------------------------------------------------------------------
# Attention over grouped key/value heads without copying them.
# --------------------------------------------------------------------------------------------

GQA_ATTENTION = "tidar_sdpa_gqa"


def sdpa_gqa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' `sdpa` attention function, except that on CPU, under a mask, with several
    queries and grouped key/value heads, the groups are attended in place. Anything else (no mask,
    one query, a position bias, softcapping, another device) goes to transformers' own function."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    grouped = key.shape[1] != query.shape[1]
    if attention_mask is None or not grouped or query.shape[2] == 1 or query.device.type != "cpu" or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GQA_ATTENTION, sdpa_gqa)
    AttentionMaskInterface.register(GQA_ATTENTION, sdpa_mask)  # transformers' own masks stay sdpa's


@contextmanager
def grouped_attention(model, enabled: bool = True):
    """Within it, a CPU model on transformers' `sdpa` attention runs `sdpa_gqa` instead; restored on exit."""
    config = model.config
    parameter = next(model.parameters(), None)
    if not enabled or getattr(config, "_attn_implementation", None) != "sdpa" or parameter is None or parameter.device.type != "cpu":
        yield
        return
    _register()
    config._attn_implementation = GQA_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"


@contextmanager
def cpu_kernels(model, enabled: bool | str = "auto"):
    """The kernels every decoder on an export runs: in-place grouped attention, and packed linear
    layers where enabled (True, or "auto" where packing_pays). False: neither, PyTorch's and
    transformers' own paths."""
    with packed_linears(model, resolve(model, enabled)), grouped_attention(model, enabled is not False):
        yield
