/* TiDAR's CPU kernel library (panel.py builds and loads it; docs/kernels.md).

   tidar_panel_linear: y = x @ W.T (+ b) on W packed in panels of 32 outputs, streamed once per call
   for up to 16 rows at a time; each output summed over the inputs in order, whatever the row count.
   tidar_panel_linear_bf16: the same on bf16 rows and panels, summed in fp32, rounded once.
   tidar_attention: softmax attention whose output for a query depends only on it and the keys it sees.
   tidar_lora_add, tidar_lora_add_bf16: a mask-slot adapter's low-rank delta on a step's mask rows.
   tidar_argmax: each row's first index of its largest value, as torch's argmax (a step's verdict).
   tidar_top_choices: each row's k largest values and their softmax probabilities (a draft's).

   Built as: cc -O3 -march=native -fopenmp -shared -fPIC panel.c -o panels.so (panel.PANEL_FLAGS;
   no -ffast-math). The source of truth: exports carry it as custom_generate/panel_source.py. */
#include <stdlib.h>
#include <string.h>
#define NB 32
#define PF 1024
typedef float v16 __attribute__((vector_size(64), aligned(4)));
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

/* One pass of MM rows (up to 16) over one panel of 32 outputs: each output summed over the inputs in
   order, then over an adapter's R terms (fp32 panels; R = 0 has none). The weights fp32, or bf16
   widened as they are read (NAME panel and panelh); NAME_by_rows[MM] is the pass for MM rows. */
#define PANEL_PASS(NAME, MM, WT, LOADW, PREFETCHW) \
static void NAME##MM(const float *x, long K, const WT *w, const float *u, long R, const float *wb, float *out) { \
  v16 a0[MM], a1[MM]; \
  for (int i = 0; i < MM; i++) { a0[i] = (v16){0}; a1[i] = (v16){0}; } \
  for (long k = 0; k < K; k++) { \
    PREFETCHW(w + k * NB); \
    v16 w0 = LOADW(w + k * NB), w1 = LOADW(w + k * NB + 16); \
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
#define PANEL_PASSES(NAME, WT, LOADW, PREFETCHW) \
  PANEL_PASS(NAME, 1, WT, LOADW, PREFETCHW) PANEL_PASS(NAME, 2, WT, LOADW, PREFETCHW) PANEL_PASS(NAME, 3, WT, LOADW, PREFETCHW) \
  PANEL_PASS(NAME, 4, WT, LOADW, PREFETCHW) PANEL_PASS(NAME, 5, WT, LOADW, PREFETCHW) PANEL_PASS(NAME, 6, WT, LOADW, PREFETCHW) \
  PANEL_PASS(NAME, 7, WT, LOADW, PREFETCHW) PANEL_PASS(NAME, 8, WT, LOADW, PREFETCHW) PANEL_PASS(NAME, 9, WT, LOADW, PREFETCHW) \
  PANEL_PASS(NAME, 10, WT, LOADW, PREFETCHW) PANEL_PASS(NAME, 11, WT, LOADW, PREFETCHW) PANEL_PASS(NAME, 12, WT, LOADW, PREFETCHW) \
  PANEL_PASS(NAME, 13, WT, LOADW, PREFETCHW) PANEL_PASS(NAME, 14, WT, LOADW, PREFETCHW) PANEL_PASS(NAME, 15, WT, LOADW, PREFETCHW) \
  PANEL_PASS(NAME, 16, WT, LOADW, PREFETCHW) \
  static void (*const NAME##_by_rows[17])(const float *, long, const WT *, const float *, long, const float *, float *) = { \
    0, NAME##1, NAME##2, NAME##3, NAME##4, NAME##5, NAME##6, NAME##7, NAME##8, \
    NAME##9, NAME##10, NAME##11, NAME##12, NAME##13, NAME##14, NAME##15, NAME##16};
/* fp32: a row of a panel is 128 bytes, two cache lines ahead; bf16: 64 bytes, one (the same bytes ahead).
   Each weight is read once a call, so none is prefetched to stay: L1 keeps the rows x, which every panel
   reads again, and the caches keep the decoding loop's own data and code, which a forward streaming the
   whole model through them evicted (host work between forwards ran slower than in a loop). fp32 weights
   are prefetched non-temporal (locality 0), bf16 into L2 (locality 2; non-temporal not measured).
   bench/LOG.md, 2026-12-07: "the panel kernel's prefetch", and the twelfth session. */
#define LOAD_F32(p) (*(const v16 *)(p))
#define PREFETCH_F32(p) (__builtin_prefetch((p) + PF, 0, 0), __builtin_prefetch((p) + PF + 16, 0, 0))
#define PREFETCH_BF16(p) __builtin_prefetch((p) + 2 * PF, 0, 2)
PANEL_PASSES(panel, float, LOAD_F32, PREFETCH_F32)
PANEL_PASSES(panelh, unsigned short, bf16x16, PREFETCH_BF16)

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
        panel_by_rows[mm](x + m0 * K, K, p + q * K * NB, u ? u + m0 * R : 0, r, r ? pb + q * R * NB : 0, out);
        for (long i = 0; i < mm; i++)
          for (long j = 0; j < NB && q * NB + j < N; j++)
            y[(m0 + i) * N + q * NB + j] = b ? out[i * NB + j] + b[q * NB + j] : out[i * NB + j];
      }
    }
  }
  free(u);
}

/* The same product on bf16 (panelh): rows and panels bf16, each output summed in fp32 over the inputs
   in order (each product of two bf16 values exact in fp32), plus the bias, rounded to bf16 once. So,
   as in fp32, a row's result does not depend on how many rows share the call; and it is what the
   same weights widened to fp32 give, rounded. The panels are half the bytes of fp32's. */
/* y[M, N] = x[M, K] @ W.T (+ b), all bf16, W packed as bf16 panels P[ceil(N / NB)][K][NB]. The rows are
   widened once (exact), then each core streams its share of the panels as in fp32. Returns -1 where
   the widened rows find no memory. */
int tidar_panel_linear_bf16(const unsigned short *x, long M, long K, const unsigned short *p, long N, const unsigned short *b,
                            unsigned short *y, int threads) {
  long panels = (N + NB - 1) / NB;
  float *xf = malloc(sizeof(float) * (M * K > 0 ? M * K : 1));
  if (!xf) return -1;
  bf16_to_f32(x, M * K, xf);
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (long q = 0; q < panels; q++) {
    float out[16 * NB];
    for (long m0 = 0; m0 < M; m0 += 16) {
      long mm = M - m0 < 16 ? M - m0 : 16;
      panelh_by_rows[mm](xf + m0 * K, K, p + q * K * NB, 0, 0, 0, out);
      for (long i = 0; i < mm; i++)
        for (long j = 0; j < NB && q * NB + j < N; j++)
          y[(m0 + i) * N + q * NB + j] = f2bf(b ? out[i * NB + j] + bf2f(b[q * NB + j]) : out[i * NB + j]);
    }
  }
  free(xf);
  return 0;
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

/* Attention whose every output depends only on its query and the keys it sees, in their order: not on
   how many queries share the call, how many keys are masked, or where they sit in the cache. So an
   AR step's one query, a TiDAR step's verify rows among its drafts and mask slots, a tree's sibling
   (its own key after the chain), and a batch row with holes in its cache compute the same bits for
   the same visible keys (kernels.exact_attention; docs/kernels.md). Each score is one fused
   multiply-add per dimension in order (lanes run over queries, never over a sum); softmax's sum and
   each output dimension's weighted sum run over the visible keys in key order, a masked key adding an
   exact zero or skipped; exp is one polynomial on every lane.

   q (B, Hq, Q, D), k and v (B, Hkv, L, D), all contiguous; out (B, Q, Hq, D). mask: bytes, nonzero =
   attend, mask[b * mb + h * mh + i * mq + j] (strides in elements, 0 to broadcast), or NULL: every key
   (causal = 0) or keys j <= i (causal = 1, top-left as torch's is_causal). D a multiple of 16. A query
   that sees no key gets zeros. */
typedef int vi16 __attribute__((vector_size(64)));
static inline v16 vexp(v16 x) {  /* e^x for x <= 0 (Cephes' expf); exactly 0 below -87.3 and for -inf */
  vi16 under = x < -87.3365448f;
  v16 n = x * 1.44269504088896341f + 12582912.0f;
  n = n - 12582912.0f;  /* x / ln 2 rounded to the nearest integer */
  v16 r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  v16 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  vi16 e = (__builtin_convertvector(n, vi16) + 127) << 23;
  return (v16)((vi16)(p * (v16)e) & ~under);
}
/* Scores of CB vectors of pairs against KJ keys at a time (KJ * CB independent sums in flight: one
   sum alone waits on each multiply-add), each sum over d in order, as the default case does. */
#define SCORES(CB, KJ) \
static void scores##CB(const v16 *qt, const float *kb, long keys, long D, float scale, v16 *s) { \
  long j = 0; \
  for (; j + KJ <= keys; j += KJ) { \
    v16 acc[KJ * CB]; \
    for (int t = 0; t < KJ * CB; t++) acc[t] = (v16){0}; \
    for (long d = 0; d < D; d++) { \
      _Pragma("GCC unroll 8") \
      for (int t = 0; t < KJ * CB; t++) acc[t] += qt[d * CB + t % CB] * kb[(j + t / CB) * D + d]; \
    } \
    for (int t = 0; t < KJ * CB; t++) s[(j + t / CB) * CB + t % CB] = acc[t] * scale; \
  } \
  for (; j < keys; j++) \
    for (long cb = 0; cb < CB; cb++) { \
      v16 a = {0}; \
      for (long d = 0; d < D; d++) a += qt[d * CB + cb] * kb[j * D + d]; \
      s[j * CB + cb] = a * scale; \
    } \
}
SCORES(1, 8) SCORES(2, 4) SCORES(3, 2) SCORES(4, 2)
#define QC 64  /* (query, head) pairs of one kv head worked on together: 4 vectors of 16 lanes */
void tidar_attention(const float *q, const float *k, const float *v, const unsigned char *mask, long mb, long mh, long mq, int causal,
                     long B, long Hq, long Hkv, long Q, long L, long D, long KS, long VS, float scale, float *out,
                     int threads) {
  /* KS, VS: entries between one (batch, kv head)'s keys (values) and the next's, L where packed; more
     where they are the filled part of a cache's buffers (runtime/cache.py) */
  long G = Hq / Hkv, per = G >= QC ? 1 : QC / G;  /* queries a block: per * G pairs, at most QC (or G) */
  long blocks = (Q + per - 1) / per, CBmax = (per * G + 15) / 16;  /* vectors of pairs, at most */
  #pragma omp parallel num_threads(threads)
  {
    v16 *qt = aligned_alloc(64, sizeof(v16) * D * CBmax), *s = aligned_alloc(64, sizeof(v16) * (L > 0 ? L : 1) * CBmax);
    #pragma omp for schedule(dynamic) collapse(2)
    for (long bh = 0; bh < B * Hkv; bh++)
      for (long blk = 0; blk < blocks; blk++) {
        long b = bh / Hkv, hk = bh % Hkv, q0 = blk * per, nq = Q - q0 < per ? Q - q0 : per, C = nq * G, CB = (C + 15) / 16;
        const float *kb = k + bh * KS * D, *vb = v + bh * VS * D;
        float *qf = (float *)qt, *sf = (float *)s;
        /* qt[d][c]: pair c = query i * G + head g, lanes past C zero */
        memset(qt, 0, sizeof(v16) * D * CB);
        for (long c = 0; c < C; c++) {
          const float *qc = q + ((b * Hq + hk * G + c % G) * Q + q0 + c / G) * D;
          for (long d = 0; d < D; d++) qf[d * CB * 16 + c] = qc[d];
        }
        long keys = causal ? (q0 + nq < L ? q0 + nq : L) : L;
        /* scores s[j][c] = sum_d q_c[d] k_j[d], d in order */
        switch (CB) {
          case 1: scores1(qt, kb, keys, D, scale, s); break;
          case 2: scores2(qt, kb, keys, D, scale, s); break;
          case 3: scores3(qt, kb, keys, D, scale, s); break;
          case 4: scores4(qt, kb, keys, D, scale, s); break;
          default:
            for (long j = 0; j < keys; j++)
              for (long cb = 0; cb < CB; cb++) {
                v16 a = {0};
                for (long d = 0; d < D; d++) a += qt[d * CB + cb] * kb[j * D + d];
                s[j * CB + cb] = a * scale;
              }
        }
        /* the mask: -inf where a pair does not see a key */
        for (long c = 0; c < C; c++) {
          long i = q0 + c / G, h = hk * G + c % G;
          const unsigned char *row = mask ? mask + b * mb + h * mh + i * mq : 0;
          for (long j = 0; j < keys; j++)
            if ((row && !row[j]) || (causal && j > i)) sf[j * CB * 16 + c] = -__builtin_inff();
        }
        /* softmax: max, then e^(s - max) and its sum over keys in order */
        for (long cb = 0; cb < CB; cb++) {
          v16 m = {0}; m -= __builtin_inff();
          for (long j = 0; j < keys; j++) { v16 x = s[j * CB + cb]; m = (v16)((vi16)x & (x > m)) + (v16)((vi16)m & ~(x > m)); }
          /* a pair that sees nothing: max 0, so its -inf scores give e^x = 0 and its sum stays 0 */
          vi16 none = m == -__builtin_inff();
          m = (v16)((vi16)m & ~none);
          v16 l = {0};
          for (long j = 0; j < keys; j++) { v16 p = vexp(s[j * CB + cb] - m); s[j * CB + cb] = p; l += p; }
          /* each pair's output, four pairs at a time: sum_j p_j v_j over the keys in order, then / l */
          float ls[16];
          memcpy(ls, &l, 64);
          for (int lane0 = 0; lane0 < 16 && cb * 16 + lane0 < C; lane0 += 4) {
            long c0 = cb * 16 + lane0, n = C - c0 < 4 ? C - c0 : 4;
            for (long d0 = 0; d0 < D; d0 += 64) {
              long dn = D - d0 < 64 ? (D - d0) / 16 : 4;
              v16 acc[4][4];
              for (int t = 0; t < 4; t++) for (int u = 0; u < 4; u++) acc[t][u] = (v16){0};
              for (long j = 0; j < keys; j++) {
                float p[4];
                for (int t = 0; t < 4; t++) p[t] = t < n ? sf[j * CB * 16 + c0 + t] : 0.f;
                /* a key no pair here sees adds nothing; one some see adds p * v = +-0 to the others
                   (finite v), which leaves their sums as they are */
                if (p[0] == 0.f && p[1] == 0.f && p[2] == 0.f && p[3] == 0.f) continue;
                const float *vj = vb + j * D + d0;
                _Pragma("GCC unroll 4")
                for (int u = 0; u < 4; u++) {
                  if (u >= dn) break;
                  v16 vv = *(const v16 *)(vj + 16 * u);
                  _Pragma("GCC unroll 4")
                  for (int t = 0; t < 4; t++) acc[t][u] += p[t] * vv;
                }
              }
              for (long t = 0; t < n; t++) {
                float sum = ls[lane0 + t];
                long c = c0 + t;
                float *o = out + ((b * Q + q0 + c / G) * Hq + hk * G + c % G) * D + d0;
                for (long u = 0; u < dn; u++) {
                  v16 r = sum > 0.f ? acc[t][u] / sum : acc[t][u];
                  memcpy(o + 16 * u, &r, 64);
                }
              }
            }
          }
        }
      }
    free(qt);
    free(s);
  }
}

/* tidar_argmax: out[r] = the first index of row r's largest value, a NaN counting as the largest (the
   first NaN then), as torch's argmax: rows of n values (fp32, or bf16 where bf), row r at x + r * stride
   elements. One vector pass keeps each lane's maximum and the first index it was met at (a later equal
   value does not replace it), and whether a NaN was seen; the row's answer is the smallest index among
   the lanes holding the maximum. A row with a NaN is read again for its first NaN. torch's CPU argmax
   walks a row one value at a time, several times slower than this for a vocabulary's row
   (verify.argmax). n >= 1 and n < 2^31. */
static inline v16 load16(const void *x, long i, int bf) {
  return bf ? bf16x16((const unsigned short *)x + i) : *(const v16 *)((const float *)x + i);
}
static inline float load1(const void *x, long i, int bf) {
  return bf ? bf2f(((const unsigned short *)x)[i]) : ((const float *)x)[i];
}
static inline const void *row_at(const void *x, long r, long stride, int bf) {
  return bf ? (const void *)((const unsigned short *)x + r * stride) : (const void *)((const float *)x + r * stride);
}
static long argmax_row(const void *x, long n, int bf) {
  long i = 0, best = 0;
  float top = load1(x, 0, bf);
  int nan = top != top;
  if (n >= 16) {
    const vi16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    v16 m = load16(x, 0, bf);
    vi16 at = lane, seen = (vi16)(m != m);
    for (i = 16; i + 16 <= n; i += 16) {
      v16 v = load16(x, i, bf);
      vi16 up = v > m;
      m = (v16)(((vi16)v & up) | ((vi16)m & ~up));
      at = ((lane + (int)i) & up) | (at & ~up);
      seen |= (vi16)(v != v);
    }
    top = m[0];
    for (int j = 1; j < 16; j++)
      if (m[j] > top) top = m[j];
    best = n;
    for (int j = 0; j < 16; j++) {
      nan |= seen[j] != 0;
      if (m[j] == top && at[j] < best) best = at[j];
    }
  }
  for (; i < n; i++) {  /* after every lane's values: only a larger one replaces the best */
    float v = load1(x, i, bf);
    nan |= v != v;
    if (v > top) top = v, best = i;
  }
  if (!nan) return best;
  for (i = 0; i + 16 <= n; i += 16) {  /* the first NaN: a block of 16 looked into only where it has one */
    vi16 hit = (vi16)(load16(x, i, bf) != load16(x, i, bf));
    int any = 0;
    for (int j = 0; j < 16; j++) any |= hit[j];
    if (any)
      for (int j = 0; j < 16; j++)
        if (hit[j]) return i + j;
  }
  for (; i < n; i++) {
    float v = load1(x, i, bf);
    if (v != v) return i;
  }
  return 0;
}
void tidar_argmax(const void *x, long rows, long n, long stride, int bf, long *out) {
  for (long r = 0; r < rows; r++)
    out[r] = argmax_row(row_at(x, r, stride, bf), n, bf);
}

/* tidar_top_choices: each row's k largest values (k <= 16, k <= n), largest first, an earlier index
   first among equals, and their probabilities under the row's softmax: idx[r * k + j] and
   chance[r * k + j]. Rows as tidar_argmax's. One pass for the k best (a block of 16 is looked into
   only where a value beats the k-th best so far) and the maximum; a second for the softmax's sum,
   exp(x - max) 16 lanes at a time (vexp), summed lane by lane, then the lanes in order. Returns
   nonzero, with nothing written for that row and the rows after it, where a row holds a NaN or
   nothing above -inf (the caller then runs torch's). A draft's next tokens and their chances
   (verify.top_chances): torch's topk and logsumexp each read a vocabulary's row more slowly. */
static inline void top_insert(float *tv, long *ti, int k, float v, long i) {
  /* into the list of the k best so far (largest first; ti < 0: an empty place, below anything) */
  int p = k - 1;
  if (ti[p] >= 0 && !(v > tv[p])) return;
  while (p > 0 && (ti[p - 1] < 0 || v > tv[p - 1])) {
    tv[p] = tv[p - 1], ti[p] = ti[p - 1];
    p--;
  }
  tv[p] = v, ti[p] = i;
}
static int top_row(const void *x, long n, int bf, int k, long *idx, float *chance) {
  float tv[16];
  long ti[16], i = 0;
  int nan = 0;
  for (int j = 0; j < k; j++) ti[j] = -1;
  for (; i < k; i++) {  /* the first k fill the list whatever they are (-inf included) */
    float v = load1(x, i, bf);
    nan |= v != v;
    top_insert(tv, ti, k, v, i);
  }
  vi16 seen = {0};
  for (; i + 16 <= n; i += 16) {
    v16 v = load16(x, i, bf);
    vi16 over = v > tv[k - 1];
    seen |= (vi16)(v != v);
    int any = 0;
    for (int j = 0; j < 16; j++) any |= over[j];
    if (any)
      for (int j = 0; j < 16; j++) top_insert(tv, ti, k, v[j], i + j);
  }
  for (int j = 0; j < 16; j++) nan |= seen[j] != 0;
  for (; i < n; i++) {
    float v = load1(x, i, bf);
    nan |= v != v;
    top_insert(tv, ti, k, v, i);
  }
  float top = tv[0];
  if (nan || !(top > -__builtin_inff())) return 1;
  v16 sum = {0};
  for (i = 0; i + 16 <= n; i += 16) sum += vexp(load16(x, i, bf) - top);
  float total = 0.0f;
  for (int j = 0; j < 16; j++) total += sum[j];
  v16 tail = {0}, best = {0};
  int t = 0;
  for (; i < n; i++) tail[t++] = load1(x, i, bf) - top;
  for (int j = t; j < 16; j++) tail[j] = -__builtin_inff();
  tail = vexp(tail);
  for (int j = 0; j < t; j++) total += tail[j];
  for (int j = 0; j < 16; j++) best[j] = j < k ? tv[j] - top : -__builtin_inff();
  best = vexp(best);
  for (int j = 0; j < k; j++) idx[j] = ti[j], chance[j] = best[j] / total;
  return 0;
}
int tidar_top_choices(const void *x, long rows, long n, long stride, int bf, int k, long *idx,
                      float *chance) {
  for (long r = 0; r < rows; r++)
    if (top_row(row_at(x, r, stride, bf), n, bf, k, idx + r * k, chance + r * k))
      return 1;
  return 0;
}
