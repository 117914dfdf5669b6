/* TiDAR's CPU kernel library (panel.py builds and loads it; docs/kernels.md).

   tidar_panel_linear: y = x @ W.T (+ b) on W packed in panels of 32 outputs, streamed once per call
   for up to 16 rows at a time; each output summed over the inputs in order, whatever the row count.
   tidar_lora_add, tidar_lora_add_bf16: a mask-slot adapter's low-rank delta on a step's mask rows.

   Built as: cc -O3 -march=native -fopenmp -shared -fPIC panel.c -o panels.so (panel.PANEL_FLAGS;
   no -ffast-math). The source of truth: exports carry it as custom_generate/panel_source.py. */
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
