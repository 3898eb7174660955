// fp32 and bf16 projections for CPUs with AVX2 and FMA but no AVX-512 (AMD Zen 1-3, older Intel):
// out [M, N] = x [M, K] W^T (+ bias), for the row counts of a decode step. bf16 weights are widened
// to fp32 as they are read (such CPUs have no bf16 arithmetic; torch's bf16 GEMM runs 1-7 GFLOP/s
// there), so bf16 halves the bytes a memory-bound step reads and computes at fp32's rate.
//
// Why not oneDNN: on such a CPU its packed fp32 GEMM reads a decode step's weights at 5-7 GB/s at one
// to eight rows (a plain read reaches ~22 GB/s), so a batch-1 step took 4x its memory roofline; MKL's
// GEMV is no better on AMD. Here each thread walks one contiguous run of 16-column panels, and per
// panel every row block of x passes while the panel is in L1/L2.
//
// Weight layout (`pack` in avx2_linear.py): [N/16][K][16], a panel of 16 columns holding, per k, the
// 16 weights of that input: two ymm loads a k in fp32, one in bf16. Registers: up to 6 rows x 16
// columns of accumulators (12 ymm), the two weight vectors and one broadcast of x.
// Each output is one fp32 sum over k in increasing order, whatever the thread count and batch.
#include <stdint.h>
#include <stdlib.h>

#include "common.h"
#include "kernels.h"

// Built wherever AVX2 and FMA exist, so every such CPU can run (and test) it; preferred only where
// there is no AVX-512: there oneDNN's kernels use it and are faster.
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#define PANEL 16
#define MAX_ROWS 6

int avx2_linear_init(void) { return 1; }

#if defined(__AVX512F__)
int avx2_linear_preferred(void) { return 0; }
#else
int avx2_linear_preferred(void) { return 1; }
#endif

// The output's element types: fp32, bf16 (rounded to nearest even), or fp32 holding the bf16-rounded
// value (the LM head's logits of a bf16 model: `F.linear(...).float()`).
enum { OUT_F32 = 0, OUT_BF16 = 1, OUT_BF16_AS_F32 = 2 };

// A panel's 16 weights of one k as two fp32 vectors: columns 0-7 and 8-15. bf16 panels hold them
// interleaved (c0 c8 c1 c9 ... c7 c15, `pack`), so one 32-byte load splits with a shift (even
// elements: c0-7) and a mask (odd: c8-15); a bf16 is the top half of its fp32.
static inline __attribute__((always_inline)) void weights_at(const void *panel, int64_t kk, const int wide, __m256 *w0,
                                                             __m256 *w1) {
    if (wide) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)((const uint16_t *)panel + kk * PANEL));
        *w0 = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        *w1 = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u)));
    } else {
        *w0 = _mm256_loadu_ps((const float *)panel + kk * PANEL);
        *w1 = _mm256_loadu_ps((const float *)panel + kk * PANEL + 8);
    }
}

static inline __m256i bf16_round_bits(__m256 v) {  // fp32 bits rounded to nearest even at bit 16
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    return _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
}

// 16 sums (+ bias) of one row and panel into out at element `at`, in the output's type.
static inline __attribute__((always_inline)) void store16(__m256 v0, __m256 v1, void *out, int64_t at,
                                                          const int out_kind) {
    if (out_kind == OUT_F32) {
        _mm256_storeu_ps((float *)out + at, v0);
        _mm256_storeu_ps((float *)out + at + 8, v1);
        return;
    }
    const __m256i hi0 = _mm256_srli_epi32(bf16_round_bits(v0), 16), hi1 = _mm256_srli_epi32(bf16_round_bits(v1), 16);
    if (out_kind == OUT_BF16) {  // packus interleaves 128-bit lanes; the permute puts them back in order
        const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(hi0, hi1), 0xD8);
        _mm256_storeu_si256((__m256i *)((uint16_t *)out + at), packed);
    } else {
        _mm256_storeu_ps((float *)out + at, _mm256_castsi256_ps(_mm256_slli_epi32(hi0, 16)));
        _mm256_storeu_ps((float *)out + at + 8, _mm256_castsi256_ps(_mm256_slli_epi32(hi1, 16)));
    }
}

// The bias of panel p's 16 columns as two fp32 vectors (zero without a bias).
static inline __attribute__((always_inline)) void bias_at(const void *bias, int64_t p, const int wide, __m256 b[2]) {
    b[0] = b[1] = _mm256_setzero_ps();
    if (!bias) return;
    if (wide) {  // bias is plain bf16 (not interleaved)
        const __m128i *src = (const __m128i *)((const uint16_t *)bias + p * PANEL);
        b[0] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(src)), 16));
        b[1] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(src + 1)), 16));
    } else {
        b[0] = _mm256_loadu_ps((const float *)bias + p * PANEL);
        b[1] = _mm256_loadu_ps((const float *)bias + p * PANEL + 8);
    }
}

// out rows m0 .. m0 + MR, panels p .. p + NP (1, or 2 for MR <= 2) = x's rows (fp32) against the
// panels, fp32 (`wide` 0) or bf16 (`wide` 1), + bias. MR, NP and wide are constants at each call, so
// the accumulators stay in registers (acc[r][2q + h]: row m0 + r, columns 8h .. 8h + 7 of panel
// p + q). Two panels at one or two rows: each FMA chain waits on its previous FMA, and 2 chains a row
// were too few to keep the loads busy (a 1-row bf16 projection read its weights at 60% of a plain
// read's rate). Each sum runs over k in increasing order whatever MR and NP are, so a row's output
// does not depend on its batch.
static inline __attribute__((always_inline)) void tile(const float *x, const char *panels, const void *bias,
                                                       void *out, int64_t m0, int64_t p, int64_t n, int64_t k,
                                                       const int mr, const int np, const int wide,
                                                       const int out_kind, Upcoming next) {
    const size_t panel_bytes = (size_t)k * PANEL * (wide ? 2 : 4);
    __m256 acc[MAX_ROWS][4];
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < 2 * np; j++) acc[r][j] = _mm256_setzero_ps();
    const float *xr = x + m0 * k;
    // The tile's part of the next pair's weights (common.h's Upcoming), spread over its k steps.
    int64_t fetched = 0;
    for (int64_t kk = 0; kk < k; kk++) {
        if (next.at) fetch_spread(next, &fetched, kk, k);
        __m256 w[4];
        for (int q = 0; q < np; q++) weights_at(panels + q * panel_bytes, kk, wide, &w[2 * q], &w[2 * q + 1]);
        for (int r = 0; r < mr; r++) {
            const __m256 xv = _mm256_broadcast_ss(xr + r * k + kk);
            for (int j = 0; j < 2 * np; j++) acc[r][j] = _mm256_fmadd_ps(xv, w[j], acc[r][j]);
        }
    }
    for (int q = 0; q < np; q++) {
        __m256 b[2];
        bias_at(bias, p + q, out_kind != OUT_F32, b);  // bf16 output: a bf16 bias
        for (int r = 0; r < mr; r++)
            store16(_mm256_add_ps(acc[r][2 * q], b[0]), _mm256_add_ps(acc[r][2 * q + 1], b[1]), out,
                    (m0 + r) * n + (p + q) * PANEL, out_kind);
    }
}

#define TILE(MR, NP) \
    tile(x, pair + (p - p0) * panel_bytes, bias, out, m0, p, n, k, MR, NP, wide, out_kind, upcoming_part(next, t++, tiles))

// Rows m0 .. m of x against panels p0 .. p0 + np (np 1 or 2, their weights at `pair`): 6-row tiles
// panel by panel, then the remainder (1-2 rows over both panels at once, 3-5 panel by panel); each
// tile asks for its share of `next`.
static inline __attribute__((always_inline)) void rows_against(const float *x, const char *pair, const void *bias,
                                                               void *out, int64_t p0, const int np, int64_t m,
                                                               int64_t n, int64_t k, const int wide,
                                                               const int out_kind, Upcoming next) {
    const size_t panel_bytes = (size_t)k * PANEL * (wide ? 2 : 4);
    int64_t full = m - m % MAX_ROWS;
    const int64_t rest = m - full, tiles = np * (full / MAX_ROWS) + (rest == 0 ? 0 : rest <= 2 && np == 2 ? 1 : np);
    int64_t t = 0;
    for (int64_t p = p0; p < p0 + np; p++)
        for (int64_t m0 = 0; m0 < full; m0 += MAX_ROWS) TILE(MAX_ROWS, 1);
    int64_t m0 = full;
    if (m - full <= 2 && np == 2) {
        const int64_t p = p0;
        if (m - full == 2) TILE(2, 2);
        else if (m - full == 1) TILE(1, 2);
        return;
    }
    for (int64_t p = p0; p < p0 + np; p++) switch (m - full) {
            case 5: TILE(5, 1); break;
            case 4: TILE(4, 1); break;
            case 3: TILE(3, 1); break;
            case 2: TILE(2, 1); break;
            case 1: TILE(1, 1); break;
            default: break;
        }
}

// bf16 weights from this many rows up are widened once per panel pair into a thread's buffer (k x 32
// floats: 72-192 KiB, in L2) and every row tile runs on fp32 weights: widening inline costs a shift
// and a mask per k in each 6-row tile, ~10-15% of a 128- or 512-row call's time. Below, the widening
// pass (reading the pair from memory, writing it to L2, reading it again) cost more than it saved:
// 30 layers' projections at 32 rows ran 5-11% faster (16 rows 14-20%) with the tiles widening inline
// and the next pair fetched during them, level at 48-64 rows.
#define WIDEN_ROWS 64

// The panel pair at `pair` (np panels of bf16, interleaved) as plain fp32 panels into `to`.
static void widen_pair(const uint16_t *pair, int np, int64_t k, float *to) {
    for (int64_t i = 0; i < np * k; i++) {
        __m256 w0, w1;
        weights_at(pair, i, 1, &w0, &w1);
        _mm256_store_ps(to + i * PANEL, w0);
        _mm256_store_ps(to + i * PANEL + 8, w1);
    }
}

// Every thread takes one contiguous run of panel pairs (an odd last panel alone). One function per
// (wide, out_kind): OpenMP outlines the loop's body, and only literal constants inside it let the
// compiler drop the dtype branches from the inner loops. Returns 0, or -1 when a thread's buffer for
// widened weights could not be allocated.
#define DEFINE_LINEAR(NAME, WIDE, OUT_KIND)                                                                   \
    static int NAME(const float *x, const void *packed, const void *bias, void *out, int64_t m, int64_t n,    \
                    int64_t k) {                                                                              \
        const int64_t panels = n / PANEL, pairs = (panels + 1) / 2;                                           \
        const size_t pair_bytes = 2 * (size_t)k * PANEL * (WIDE ? 2 : 4);                                     \
        int failed = 0;                                                                                       \
        _Pragma("omp parallel reduction(| : failed)")                                                         \
        {                                                                                                     \
            const size_t pair_floats = WIDE && m >= WIDEN_ROWS ? 2 * (size_t)k * PANEL : 0;                   \
            float *wide_pair = pair_floats ? thread_buffer(1, sizeof(float) * pair_floats) : NULL;            \
            failed = pair_floats && !wide_pair;                                                               \
            _Pragma("omp for schedule(static)")                                                               \
            for (int64_t i = 0; i < pairs; i++) {                                                             \
                const int np = 2 * i + 1 < panels ? 2 : 1;                                                    \
                const char *pair = (const char *)packed + i * pair_bytes;                                     \
                const int64_t next_np = panels - 2 * (i + 1) < 2 ? panels - 2 * (i + 1) : 2;                  \
                /* the widening pass reads its pair in one sweep: fetching ahead there cost 7-16% */          \
                const Upcoming next = {m >= PREFETCH_ROWS && !wide_pair && next_np > 0 ? pair + pair_bytes : NULL, \
                                       next_np * (int64_t)pair_bytes / 2};                                    \
                if (failed) continue;                                                                         \
                if (wide_pair) {                                                                              \
                    widen_pair((const uint16_t *)pair, np, k, wide_pair);                                     \
                    if (np == 2) rows_against(x, (const char *)wide_pair, bias, out, 2 * i, 2, m, n, k, 0, OUT_KIND, next); \
                    else rows_against(x, (const char *)wide_pair, bias, out, 2 * i, 1, m, n, k, 0, OUT_KIND, next); \
                } else if (np == 2) {                                                                         \
                    rows_against(x, pair, bias, out, 2 * i, 2, m, n, k, WIDE, OUT_KIND, next);                \
                } else {                                                                                      \
                    rows_against(x, pair, bias, out, 2 * i, 1, m, n, k, WIDE, OUT_KIND, next);                \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
        return failed ? -1 : 0;                                                                               \
    }

DEFINE_LINEAR(linear_f32, 0, OUT_F32)
DEFINE_LINEAR(linear_bf16, 1, OUT_BF16)
DEFINE_LINEAR(linear_bf16_float_output, 1, OUT_BF16_AS_F32)

// out [m, n] = x [m, k] @ W^T (+ bias [n] unless NULL); n a multiple of 16, x and out dense, packed
// in the panel layout. `float_output` (fp32 already) is there for the signature the bf16 kernel and
// the AMX one share (kernels/decode_stack.c calls any of them). Returns 0.
int avx2_linear_f32(const float *x, const float *packed, const float *bias, float *out, int64_t m, int64_t n,
                    int64_t k, int float_output) {
    (void)float_output;
    return linear_f32(x, packed, bias, out, m, n, k);
}

// bf16 weights (interleaved panels, 2 bytes an element), bf16 x and bias: half the bytes of fp32 to
// read, the arithmetic in fp32 (this CPU has no bf16 instructions). x is widened once into the
// calling thread's buffer. out: bf16, or with `float_output` fp32 holding the bf16-rounded values.
// Returns 0, or -1 when a buffer could not be allocated (out is then incomplete).
int avx2_linear_bf16(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, void *out, int64_t m, int64_t n,
                     int64_t k, int float_output) {
    float *xf = thread_buffer(0, sizeof(float) * (size_t)(m * k));  // buffer 1: each thread's widened pair
    if (!xf) return -1;
#pragma omp parallel for if (m * k >= 65536) schedule(static)
    for (int64_t i = 0; i < m * k; i++) xf[i] = load_bf16(x, i);
    return float_output ? linear_bf16_float_output(xf, packed, bias, out, m, n, k)
                        : linear_bf16(xf, packed, bias, out, m, n, k);
}

#else
int avx2_linear_init(void) { return 0; }  // no AVX2 or FMA: the caller keeps oneDNN
int avx2_linear_preferred(void) { return 0; }

int avx2_linear_f32(const float *x, const float *packed, const float *bias, float *out, int64_t m, int64_t n,
                    int64_t k, int float_output) {
    (void)x, (void)packed, (void)bias, (void)out, (void)m, (void)n, (void)k, (void)float_output;
    return -1;
}

int avx2_linear_bf16(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, void *out, int64_t m, int64_t n,
                     int64_t k, int float_output) {
    (void)x, (void)packed, (void)bias, (void)out, (void)m, (void)n, (void)k, (void)float_output;
    return -1;
}
#endif
