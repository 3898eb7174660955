// Projections on GGUF block-quantized weights (llama.cpp's Q8_0 and Q4_0: blocks of 32 weights along
// the input with one fp16 scale; int8, or 4-bit q with value (q - 8) x scale): out [M, N] = x [M, K]
// W^T (+ bias), W never dequantized as a whole. A decode step only streams its weights: Q8_0 is 34
// bytes per 32 weights, Q4_0 18, against bf16's 64. Each weight is widened in registers (-> int32 ->
// fp32, times its block's scale: exact in fp32, an fp16 times an int8 needs 18 bits) and the sums
// run in fp32 with FMA, k in increasing order, so a row's output does not depend on its batch or the
// thread count and equals x times the dequantized weight up to fp32 rounding.
//
// Layout (`panels` in quant_linear.py): [N/16 panels][K/32 blocks], a block being the 16 columns'
// fp16 scales (32 bytes), then per k the 16 columns' weights: 16 int8 (Q8_0, 544 bytes a block) or 8
// bytes whose low nibbles are columns 0-7 and high nibbles 8-15 (Q4_0, 288 bytes). One panel is
// contiguous, so a thread walks its run of panels front to back, as avx2_linear.c's panels are read.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "kernels.h"

#define PANEL 16
#define QK 32
enum { Q8_0 = 0, Q4_0 = 1 };
#define K_BYTES(QT) ((QT) == Q8_0 ? PANEL : PANEL / 2)  // a k's 16 weights
#define BLOCK_BYTES(QT) (2 * PANEL + QK * K_BYTES(QT))

enum { OUT_F32 = 0, OUT_BF16 = 1, OUT_BF16_AS_F32 = 2 };

static inline float half_to_float(uint16_t h) {  // IEEE fp16 -> fp32, subnormals included
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
    uint32_t bits;
    if (exp == 0x1F) bits = sign | 0x7F800000u | (mant << 13);
    else if (exp) bits = sign | ((exp + 112) << 23) | (mant << 13);
    else if (!mant) bits = sign;
    else {  // subnormal: normalise
        int e = -1;
        uint32_t m = mant;
        do { e++; m <<= 1; } while (!(m & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline void store_out(void *out, int64_t at, float v, int out_kind) {
    if (out_kind == OUT_F32) ((float *)out)[at] = v;
    else if (out_kind == OUT_BF16) store_bf16((uint16_t *)out, at, v);
    else ((float *)out)[at] = round_bf16(v);
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#define MAX_ROWS 4
int quant_linear_vectorised(void) { return 1; }

static inline __m256i bf16_round_bits(__m256 v) {  // fp32 bits rounded to nearest even at bit 16
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    return _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
}

static inline __attribute__((always_inline)) void store8(__m256 v, void *out, int64_t at, const int out_kind) {
    if (out_kind == OUT_F32) {
        _mm256_storeu_ps((float *)out + at, v);
        return;
    }
    const __m256i hi = _mm256_srli_epi32(bf16_round_bits(v), 16);
    if (out_kind == OUT_BF16) {
        const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
        _mm_storeu_si128((__m128i *)((uint16_t *)out + at), packed);
    } else {
        _mm256_storeu_ps((float *)out + at, _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16)));
    }
}

static inline __attribute__((always_inline)) __m256 bias8(const void *bias, int64_t at, const int wide) {
    if (!bias) return _mm256_setzero_ps();
    if (wide) {
        const __m128i v = _mm_loadu_si128((const __m128i *)((const uint16_t *)bias + at));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
    }
    return _mm256_loadu_ps((const float *)bias + at);
}

// A k's 16 weights at q (K_BYTES(qt) bytes) as two fp32 vectors, columns 0-7 and 8-15, times their scales.
static inline __attribute__((always_inline)) void widen16(const uint8_t *q, const int qt, const __m256 s0,
                                                          const __m256 s1, __m256 *w0, __m256 *w1) {
    if (qt == Q8_0) {
        *w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q))), s0);
        *w1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8)))), s1);
    } else {  // q x s - 8 s in one FMA: q s and 8 s are exact, so is their difference, (q - 8) s
        const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
        const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xF)));
        const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
        const __m256 minus8 = _mm256_set1_ps(-8.0f);
        *w0 = _mm256_fmadd_ps(lo, s0, _mm256_mul_ps(minus8, s0));
        *w1 = _mm256_fmadd_ps(hi, s1, _mm256_mul_ps(minus8, s1));
    }
}

// Rows m0 .. m0 + MR against panels p .. p + NP (MR x NP at most 4: 8 accumulators, plus the scales
// and weights of NP panels, in 16 ymm). MR and NP are constants at each call (always_inline).
static inline __attribute__((always_inline)) void tile(const float *x, const uint8_t *panels, size_t panel_bytes,
                                                       const void *bias, void *out, int64_t m0, int64_t p,
                                                       int64_t n, int64_t k, const int mr, const int np,
                                                       const int qt, const int out_kind) {
    __m256 acc[MAX_ROWS][4];
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < 2 * np; j++) acc[r][j] = _mm256_setzero_ps();
    const float *xr = x + m0 * k;
    for (int64_t b = 0; b < k / QK; b++) {
        __m256 scale[4];
        const uint8_t *block[2];
        for (int q = 0; q < np; q++) {
            block[q] = panels + q * panel_bytes + b * BLOCK_BYTES(qt);
            scale[2 * q] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)block[q]));
            scale[2 * q + 1] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)block[q] + 1));
        }
        for (int kk = 0; kk < QK; kk++) {
            __m256 w[4];
            for (int q = 0; q < np; q++)
                widen16(block[q] + 2 * PANEL + kk * K_BYTES(qt), qt, scale[2 * q], scale[2 * q + 1], &w[2 * q],
                        &w[2 * q + 1]);
            for (int r = 0; r < mr; r++) {
                const __m256 xv = _mm256_broadcast_ss(xr + r * k + b * QK + kk);
                for (int j = 0; j < 2 * np; j++) acc[r][j] = _mm256_fmadd_ps(xv, w[j], acc[r][j]);
            }
        }
    }
    for (int q = 0; q < np; q++)
        for (int h = 0; h < 2; h++) {
            const int64_t col = (p + q) * PANEL + 8 * h;
            const __m256 b = bias8(bias, col, out_kind != OUT_F32);
            for (int r = 0; r < mr; r++) store8(_mm256_add_ps(acc[r][2 * q + h], b), out, (m0 + r) * n + col, out_kind);
        }
}

#define TILE(MR, NP) \
    tile(x, pair + (p - p0) * panel_bytes, panel_bytes, bias, out, m0, p, n, k, MR, NP, qt, out_kind)

// Rows 0 .. m against panels p0 .. p0 + np (1 or 2) at `pair`: 4-row tiles panel by panel, then the
// remainder (one row over both panels at once: two panels' FMA chains keep the loads busy).
static inline __attribute__((always_inline)) void rows_against(const float *x, const uint8_t *pair, const void *bias,
                                                               void *out, int64_t p0, const int np, int64_t m,
                                                               int64_t n, int64_t k, const int qt,
                                                               const int out_kind) {
    const size_t panel_bytes = (size_t)(k / QK) * BLOCK_BYTES(qt);
    const int64_t full = m - m % MAX_ROWS;
    for (int64_t p = p0; p < p0 + np; p++)
        for (int64_t m0 = 0; m0 < full; m0 += MAX_ROWS) TILE(MAX_ROWS, 1);
    const int64_t m0 = full;
    if (m - full == 1 && np == 2) {
        const int64_t p = p0;
        TILE(1, 2);
        return;
    }
    for (int64_t p = p0; p < p0 + np; p++) switch (m - full) {
            case 3: TILE(3, 1); break;
            case 2: TILE(2, 1); break;
            case 1: TILE(1, 1); break;
            default: break;
        }
}

#define DEFINE_LINEAR(NAME, QT, OUT_KIND)                                                                   \
    static int NAME(const float *x, const uint8_t *packed, const void *bias, void *out, int64_t m, int64_t n,  \
                    int64_t k) {                                                                            \
        const int64_t panels = n / PANEL, pairs = (panels + 1) / 2;                                         \
        const size_t pair_bytes = 2 * (size_t)(k / QK) * BLOCK_BYTES(QT);                                   \
        _Pragma("omp parallel for schedule(static)")                                                        \
        for (int64_t i = 0; i < pairs; i++) {                                                               \
            const uint8_t *pair = packed + i * pair_bytes;                                                  \
            if (2 * i + 1 < panels) rows_against(x, pair, bias, out, 2 * i, 2, m, n, k, QT, OUT_KIND);      \
            else rows_against(x, pair, bias, out, 2 * i, 1, m, n, k, QT, OUT_KIND);                         \
        }                                                                                                   \
        return 0;                                                                                           \
    }

#else
// Portable C: the same layout and the same order of sums (k increasing, one fp32 sum per output).
int quant_linear_vectorised(void) { return 0; }

static inline float weight_at(const uint8_t *q, int kk, int c, int qt) {  // q: a block's weights
    if (qt == Q8_0) return (float)((const int8_t *)q)[kk * PANEL + c];
    const uint8_t byte = q[kk * PANEL / 2 + (c & 7)];
    return (float)((c < 8 ? byte & 0xF : byte >> 4) - 8);
}

static int linear_any(const float *x, const uint8_t *packed, const void *bias, void *out, int64_t m, int64_t n,
                      int64_t k, int qt, int out_kind) {
    const size_t panel_bytes = (size_t)(k / QK) * BLOCK_BYTES(qt);
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < n / PANEL; p++) {
        const uint8_t *panel = packed + p * panel_bytes;
        for (int64_t r = 0; r < m; r++) {
            float acc[PANEL] = {0};
            for (int64_t b = 0; b < k / QK; b++) {
                const uint8_t *block = panel + b * BLOCK_BYTES(qt);
                float scale[PANEL];
                for (int c = 0; c < PANEL; c++) {
                    uint16_t h;
                    memcpy(&h, block + 2 * c, 2);
                    scale[c] = half_to_float(h);
                }
                for (int kk = 0; kk < QK; kk++) {
                    const float xv = x[r * k + b * QK + kk];
                    for (int c = 0; c < PANEL; c++)
                        acc[c] = fmaf(xv, weight_at(block + 2 * PANEL, kk, c, qt) * scale[c], acc[c]);
                }
            }
            for (int c = 0; c < PANEL; c++) {
                const int64_t col = p * PANEL + c;
                float b = 0.0f;
                if (bias) b = out_kind == OUT_F32 ? ((const float *)bias)[col] : load_bf16((const uint16_t *)bias, col);
                store_out(out, r * n + col, acc[c] + b, out_kind);
            }
        }
    }
    return 0;
}

#define DEFINE_LINEAR(NAME, QT, OUT_KIND)                                                                   \
    static int NAME(const float *x, const uint8_t *packed, const void *bias, void *out, int64_t m, int64_t n,  \
                    int64_t k) {                                                                            \
        return linear_any(x, packed, bias, out, m, n, k, QT, OUT_KIND);                                     \
    }
#endif

DEFINE_LINEAR(q8_0_f32, Q8_0, OUT_F32)
DEFINE_LINEAR(q8_0_bf16, Q8_0, OUT_BF16)
DEFINE_LINEAR(q8_0_bf16_float_output, Q8_0, OUT_BF16_AS_F32)
DEFINE_LINEAR(q4_0_f32, Q4_0, OUT_F32)
DEFINE_LINEAR(q4_0_bf16, Q4_0, OUT_BF16)
DEFINE_LINEAR(q4_0_bf16_float_output, Q4_0, OUT_BF16_AS_F32)

// bf16 x widened once into the calling thread's buffer, then `fn` (out bf16, or with `float_output`
// fp32 holding the bf16-rounded values). -1 when the buffer could not be allocated.
typedef int (*rows_fn)(const float *, const uint8_t *, const void *, void *, int64_t, int64_t, int64_t);
static int from_bf16(const uint16_t *x, const uint8_t *packed, const uint16_t *bias, void *out, int64_t m,
                     int64_t n, int64_t k, rows_fn fn) {
    float *xf = thread_buffer(0, sizeof(float) * (size_t)(m * k));
    if (!xf) return -1;
    for (int64_t i = 0; i < m * k; i++) xf[i] = load_bf16(x, i);
    return fn(xf, packed, bias, out, m, n, k);
}

// Every entry point has avx2_linear's signature (kernels/decode_stack.c calls any of them): n a
// multiple of 16, k of 32, x and out dense; fp32 x, bias and out, or bf16 x and bias with bf16 out
// (fp32 holding bf16-rounded values with `float_output`). Returns 0, or -1 when a buffer could not be
// allocated.
int quant_linear_q8_0_f32(const float *x, const uint8_t *packed, const float *bias, float *out, int64_t m,
                          int64_t n, int64_t k, int float_output) {
    (void)float_output;
    return q8_0_f32(x, packed, bias, out, m, n, k);
}

int quant_linear_q8_0_bf16(const uint16_t *x, const uint8_t *packed, const uint16_t *bias, void *out, int64_t m,
                           int64_t n, int64_t k, int float_output) {
    return from_bf16(x, packed, bias, out, m, n, k, float_output ? q8_0_bf16_float_output : q8_0_bf16);
}

int quant_linear_q4_0_f32(const float *x, const uint8_t *packed, const float *bias, float *out, int64_t m,
                          int64_t n, int64_t k, int float_output) {
    (void)float_output;
    return q4_0_f32(x, packed, bias, out, m, n, k);
}

int quant_linear_q4_0_bf16(const uint16_t *x, const uint8_t *packed, const uint16_t *bias, void *out, int64_t m,
                           int64_t n, int64_t k, int float_output) {
    return from_bf16(x, packed, bias, out, m, n, k, float_output ? q4_0_bf16_float_output : q4_0_bf16);
}
