// bf16 projections on CPUs with AVX-512 BF16 and no AMX (AMD Zen 4-5, Intel Cooper Lake): out [M, N] =
// x [M, K] W^T (+ bias), x, W and bias bf16, sums in fp32, out bf16 (or fp32 holding the bf16-rounded
// value: the LM head's logits). On such a CPU torch's bf16 path is oneDNN per op: a SmolLM2 batch-1
// decode step took 30-40 ms against ~8 ms of weights to read, and without a projection C can call the
// step could not run as one C call (models/decode_stack.py).
//
// `vdpbf16ps` multiplies 16 lanes of bf16 pairs and adds both products to an fp32 lane: lane c of a
// weight vector holds column c's weights at inputs 2j and 2j + 1, and x's pair (x[2j], x[2j + 1]) is
// broadcast to every lane by the instruction itself (EVEX embedded broadcast). Products of bf16 values
// are exact in fp32; each is added with round-to-nearest-even (denormal inputs and results flushed to
// zero, as the instruction does). Every output is one chain of those adds over j in increasing order,
// whatever the thread count and batch, so a row's output does not depend on its batch.
//
// Layout (`panels` in bf16_linear.py): [N/16][K/2][16 columns][2], a panel of 16 columns holding, per
// input pair, one 64-byte vector. A thread walks a contiguous run of units (UNIT panels side by side,
// the last unit what is left) and runs every row against each while its weights are in L1/L2, asking
// for the next unit's weights on the way.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "kernels.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

#define PANEL 16
#define UNIT 2       // panels a tile covers: 2 x MAX_ROWS accumulators
#define MAX_ROWS 8   // 16 accumulators, the 2 weight vectors, the rest for the compiler
#define NARROW_ROWS 2  // up to here 4 panels a tile: 1-2 rows are too few chains to hide vdpbf16ps's latency
#define WIDE_UNIT 4

int bf16_linear_init(void) { return 1; }

enum { OUT_BF16 = 1, OUT_BF16_AS_F32 = 2 };

// acc + w . (x's two bf16 broadcast to every lane), the broadcast read by the instruction.
static inline __attribute__((always_inline)) __m512 dot_pair(__m512 acc, __m512 w, const uint16_t *x) {
    __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const uint32_t *)x));
    return acc;
}

static inline __attribute__((always_inline)) void store16(__m512 v, void *out, int64_t at, const int out_kind) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i hi = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
    if (out_kind == OUT_BF16) _mm256_storeu_si256((__m256i *)((uint16_t *)out + at), _mm512_cvtepi32_epi16(hi));
    else _mm512_storeu_ps((float *)out + at, _mm512_castsi512_ps(_mm512_slli_epi32(hi, 16)));
}

// Rows m0 .. m0 + mr against panels p .. p + np (each `panel_bytes` long, consecutive at `unit`).
static inline __attribute__((always_inline)) void tile(const uint16_t *x, const char *unit, int64_t panel_bytes,
                                                       const uint16_t *bias, void *out, int64_t m0, int64_t p,
                                                       int64_t n, int64_t k, const int mr, const int np,
                                                       const int out_kind, Upcoming next) {
    __m512 acc[MAX_ROWS][WIDE_UNIT];
    for (int r = 0; r < mr; r++)
        for (int q = 0; q < np; q++) acc[r][q] = _mm512_setzero_ps();
    // The tile's part of the next unit (common.h's Upcoming), spread over its pairs. Checked before any
    // arithmetic: a pair is only 16 `vdpbf16ps`, and per-pair work for a tile with nothing to fetch (or
    // quant_linear's per-block share computed per pair) cost this tile 5-8%.
    const int64_t pairs = k / 2;
    int64_t fetched = 0;
    for (int64_t j = 0; j < pairs; j++) {
        if (next.at) fetch_spread(next, &fetched, j, pairs);
        __m512 w[WIDE_UNIT];
        for (int q = 0; q < np; q++) w[q] = _mm512_loadu_ps((const float *)(unit + q * panel_bytes) + 16 * j);
        for (int r = 0; r < mr; r++) {
            const uint16_t *xr = x + (m0 + r) * k + 2 * j;
            for (int q = 0; q < np; q++) acc[r][q] = dot_pair(acc[r][q], w[q], xr);
        }
    }
    for (int q = 0; q < np; q++) {
        __m512 b = _mm512_setzero_ps();
        if (bias)
            b = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(bias + (p + q) * PANEL))), 16));
        for (int r = 0; r < mr; r++) store16(_mm512_add_ps(acc[r][q], b), out, (m0 + r) * n + (p + q) * PANEL, out_kind);
    }
}

#define TILE(MR, NP) \
    tile(x, unit, panel_bytes, bias, out, m0, p, n, k, MR, NP, out_kind, upcoming_part(next, m0 / MAX_ROWS, tiles))

// Every row against the np panels at `unit` (np <= UNIT, or <= WIDE_UNIT for up to NARROW_ROWS rows).
static inline __attribute__((always_inline)) void unit_rows(const uint16_t *x, const char *unit, int64_t panel_bytes,
                                                            const uint16_t *bias, void *out, int64_t p, const int np,
                                                            int64_t m, int64_t n, int64_t k, const int out_kind,
                                                            Upcoming next) {
    const int64_t tiles = (m + MAX_ROWS - 1) / MAX_ROWS;
    int64_t m0 = 0;
    for (; m0 + MAX_ROWS <= m; m0 += MAX_ROWS) TILE(MAX_ROWS, np);
    switch (m - m0) {
        case 7: TILE(7, np); break;
        case 6: TILE(6, np); break;
        case 5: TILE(5, np); break;
        case 4: TILE(4, np); break;
        case 3: TILE(3, np); break;
        case 2: TILE(2, np); break;
        case 1: TILE(1, np); break;
        default: break;
    }
}

// The unit's panel count a constant at each call (the accumulators stay in registers).
static inline __attribute__((always_inline)) void any_unit(const uint16_t *x, const char *unit, int64_t panel_bytes,
                                                           const uint16_t *bias, void *out, int64_t p, int np,
                                                           int64_t m, int64_t n, int64_t k, const int out_kind,
                                                           Upcoming next) {
    switch (np) {
        case 4: unit_rows(x, unit, panel_bytes, bias, out, p, 4, m, n, k, out_kind, next); break;
        case 3: unit_rows(x, unit, panel_bytes, bias, out, p, 3, m, n, k, out_kind, next); break;
        case 2: unit_rows(x, unit, panel_bytes, bias, out, p, 2, m, n, k, out_kind, next); break;
        default: unit_rows(x, unit, panel_bytes, bias, out, p, 1, m, n, k, out_kind, next); break;
    }
}

// One function per output kind: OpenMP outlines the loop's body, and only literal constants inside it
// let the compiler drop the branches from the inner loops.
#define DEFINE_LINEAR(NAME, OUT_KIND)                                                                         \
    static void NAME(const uint16_t *x, const char *packed, const uint16_t *bias, void *out, int64_t m,        \
                     int64_t n, int64_t k) {                                                                  \
        const int64_t panels = n / PANEL, width = m <= NARROW_ROWS ? WIDE_UNIT : UNIT;                        \
        const int64_t panel_bytes = k * PANEL * 2, units = (panels + width - 1) / width;                      \
        _Pragma("omp parallel for schedule(static)")                                                          \
        for (int64_t u = 0; u < units; u++) {                                                                 \
            const int64_t p = u * width, np = panels - p < width ? panels - p : width;                        \
            const int64_t after = panels - p - np, next_np = after < width ? after : width;                   \
            const Upcoming next = {m >= PREFETCH_ROWS && next_np > 0 ? packed + (p + np) * panel_bytes : NULL, \
                                   next_np * panel_bytes};                                                    \
            any_unit(x, packed + p * panel_bytes, panel_bytes, bias, out, p, (int)np, m, n, k, OUT_KIND, next); \
        }                                                                                                     \
    }

DEFINE_LINEAR(linear_bf16, OUT_BF16)
DEFINE_LINEAR(linear_bf16_float_output, OUT_BF16_AS_F32)

// out [m, n] = x [m, k] @ W^T (+ bias [n] unless NULL): n a multiple of 16, k of 2, x and out dense,
// W in the panel layout. out bf16, or with `float_output` fp32 holding the bf16-rounded values. The
// signature the other projections share (kernels/decode_stack.c calls any of them). Returns 0.
int bf16_linear_bf16(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, void *out, int64_t m, int64_t n,
                     int64_t k, int float_output) {
    if (float_output) linear_bf16_float_output(x, (const char *)packed, bias, out, m, n, k);
    else linear_bf16(x, (const char *)packed, bias, out, m, n, k);
    return 0;
}

#else
int bf16_linear_init(void) { return 0; }  // no AVX-512 BF16 in this build: the caller keeps another path

int bf16_linear_bf16(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, void *out, int64_t m, int64_t n,
                     int64_t k, int float_output) {
    (void)x, (void)packed, (void)bias, (void)out, (void)m, (void)n, (void)k, (void)float_output;
    return -1;
}
#endif
