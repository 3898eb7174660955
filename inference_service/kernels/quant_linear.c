// Projections on GGUF block-quantized weights (llama.cpp's Q8_0 and Q4_0: blocks of 32 weights along
// the input with one fp16 scale; int8, or 4-bit q with value (q - 8) x scale): out [M, N] = x [M, K]
// W^T (+ bias), W never dequantized as a whole. A decode step only streams its weights: Q8_0 is 34
// bytes per 32 weights, Q4_0 18, against bf16's 64.
//
// As llama.cpp computes them: each row of x is quantized per 32-value block to int8 (scale d = the
// block's max |x| / 127, q = x / d rounded to nearest even), each block's dot product with a column's
// weights is summed exactly in int32 (AVX-512 VNNI `vpdpbusd`, or AVX2 `vpmaddubsw` + `vpmaddwd`), and
// the blocks are summed in fp32: acc = fma(int sum, weight scale x d, acc), blocks in increasing order.
// Every build (VNNI, AVX2, portable C) does the same integer sums and the same fp32 operations in the
// same order, so their outputs are equal bit for bit, and a row's output does not depend on its batch
// or the thread count. Against x times the dequantized weight, the only error besides fp32 rounding is
// the activations' rounding: at most d / 2 per value, so |error| <= sum over blocks of d / 2 x the
// block's sum of |w| (tests/test_quantized_weights.py holds that bound); a block whose d is below
// 1 / FLT_MAX is taken as zeros (block_scale), off by its max |x| at most.
//
// Layout (`panels` in quant_linear.py): [N/16 panels][K/32 blocks], a block being the 16 columns'
// fp16 scales (32 bytes), then the weights in groups of 4 k: per group 16 columns x 4 bytes, column c's
// 4 consecutive k in one 32-bit lane (what `vpdpbusd` multiplies by 4 broadcast activations). Q8_0: 8
// groups of 64 bytes, each byte the weight + 128 (unsigned, as `vpdpbusd` takes one operand; the sum
// then carries 128 x the activations' sum, taken off by starting the integer sum at -128 x it). Q4_0:
// 4 vectors of 64 bytes, the low nibbles groups 0-3 (k 0-15), the high ones groups 4-7 (k 16-31),
// q as stored (0-15, the -8 taken off the same way). A panel is contiguous; a thread walks its panels
// front to back, reusing each block's weights across a tile of rows.
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_tiles.h"
#include "common.h"
#include "kernels.h"

#define PANEL 16
#define QK 32
#define GROUPS (QK / 4)  // groups of 4 k in a block
enum { Q8_0 = 0, Q4_0 = 1 };
#define W_BYTES(QT) ((QT) == Q8_0 ? QK * PANEL : QK * PANEL / 2)
#define BLOCK_BYTES(QT) (2 * PANEL + W_BYTES(QT))
#define OFFSET(QT) ((QT) == Q8_0 ? -128 : -8)  // times the activations' block sum: the weights' bias

enum { OUT_F32 = 0, OUT_BF16 = 1, OUT_BF16_AS_F32 = 2 };

// x's rows quantized per block: q [m][k] int8, d [m][k/32] scales, sum [m][k/32] of each block's q.
typedef struct {
    int8_t *q;
    float *d;
    int32_t *sum;
} Activations;

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

static inline float bias_at(const void *bias, int64_t col, int out_kind) {
    if (!bias) return 0.0f;
    return out_kind == OUT_F32 ? ((const float *)bias)[col] : load_bf16((const uint16_t *)bias, col);
}

// A block's scale (max |x| / 127) and whether its values can be rounded by it. A NaN makes the scale
// NaN and an infinity infinite; the block's q and sum are then 0, so every output of the row is NaN
// (0 x a non-finite scale), as x times the weight would be non-finite, in every build alike. The
// inverse is 0 where it is not finite: a zero scale, and a subnormal one below 1 / FLT_MAX (max |x|
// under ~3.7e-37), whose values then round to 0. Left infinite, x times it converted to int32 gave
// the integer indefinite, which each build then narrowed to int8 its own way (AVX2 saturating).
static inline float block_scale(float amax, int has_nan, float *inverse) {
    const float scale = has_nan ? NAN : amax / 127.0f, inv = 1.0f / scale;
    *inverse = isfinite(scale) && isfinite(inv) ? inv : 0.0f;
    return scale;
}

static inline int32_t group_of(const int8_t *q) {  // 4 consecutive int8 as one 32-bit lane
    int32_t v;
    memcpy(&v, q, sizeof v);
    return v;
}

// Block b of a tile's kb asks for its share of the tile's part of the next unit (common.h's Upcoming).
static inline __attribute__((always_inline)) void prefetch_part(Upcoming next, int64_t b, int64_t kb) {
    if (!next.at) return;
    for (int64_t o = (b * next.bytes / kb) & ~(int64_t)63; o < (b + 1) * next.bytes / kb; o += 64)
        __builtin_prefetch(next.at + o, 0, 3);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__F16C__)
#include <immintrin.h>
#define VECTORISED 2
#define MAX_ROWS 8
#define MAX_PAIR_ROWS 6

static inline __m512 load16(const void *x, int wide, int64_t at) {  // 16 values of x as fp32
    return wide ? widen16_bf16((const uint16_t *)x + at) : _mm512_loadu_ps((const float *)x + at);
}

// Blocks first .. first + count (at most 16) of x (consecutive: k is a multiple of 32), together:
// their max |x| reduced as one (common.h's lanes_reduced16), their scales and inverses side by side
// (one vector division each, rounded as block_scale's scalar ones are), then the values, and their
// sums reduced as one. Block by block, each block waited on two reductions and two scalar divisions:
// 32 rows of 1536 took 12.5 us on one AMD Zen 4 core, 8.2 so.
#define QUANTIZE_BLOCKS 1
static void quantize_blocks(const void *x, int wide, int64_t first, int64_t count, const Activations *a) {
    const __mmask16 lanes = (__mmask16)((1u << count) - 1);
    __m512 parts[16];
    __mmask16 nan = 0;
    for (int j = 0; j < 16; j++) {
        if (j >= count) {
            parts[j] = _mm512_setzero_ps();
            continue;
        }
        const int64_t at = (first + j) * QK;
        const __m512 lo = load16(x, wide, at), hi = load16(x, wide, at + 16);
        parts[j] = _mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi));
        if (_mm512_cmp_ps_mask(lo, lo, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(hi, hi, _CMP_UNORD_Q))
            nan |= (__mmask16)(1u << j);
    }
    // block_scale for every block: NaN where a value is NaN; the inverse 0 where it is not finite, and
    // where the scale is not finite q and sum are 0.
    __m512 scale = _mm512_div_ps(lanes_reduced16(parts, LANES_MAX), _mm512_set1_ps(127.0f));
    scale = _mm512_mask_mov_ps(scale, nan, _mm512_set1_ps(NAN));
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), scale);
    const __mmask16 finite = _mm512_cmp_ps_mask(_mm512_abs_ps(scale), _mm512_set1_ps(INFINITY), _CMP_LT_OQ);
    const __mmask16 invertible = finite & _mm512_cmp_ps_mask(_mm512_abs_ps(inv), _mm512_set1_ps(INFINITY), _CMP_LT_OQ);
    _mm512_mask_storeu_ps(a->d + first, lanes, scale);
    float inverse[16];
    _mm512_storeu_ps(inverse, _mm512_maskz_mov_ps(invertible, inv));
    for (int j = 0; j < 16; j++) {
        const int64_t at = (first + j) * QK;
        if (j >= count || !(finite >> j & 1)) {
            if (j < count) memset(a->q + at, 0, QK);
            parts[j] = _mm512_setzero_ps();
            continue;
        }
        const __m512 iv = _mm512_set1_ps(inverse[j]);
        const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(load16(x, wide, at), iv));
        const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(load16(x, wide, at + 16), iv));
        _mm_storeu_si128((__m128i *)(a->q + at), _mm512_cvtepi32_epi8(qa));
        _mm_storeu_si128((__m128i *)(a->q + at + 16), _mm512_cvtepi32_epi8(qb));
        parts[j] = _mm512_castsi512_ps(_mm512_add_epi32(qa, qb));
    }
    _mm512_mask_storeu_epi32(a->sum + first, lanes, _mm512_castps_si512(lanes_reduced16(parts, LANES_ADD_INT32)));
}


// sum + w . (x's 4 int8 broadcast to every lane), the broadcast read from memory by `vpdpbusd` itself
// (EVEX embedded broadcast; GCC emits a separate `vpbroadcastd`, which on AMD Zen 4 takes a vector pipe
// slot beside every `vpdpbusd`: the 32-row Q4_0 tile ran 12% faster this way).
static inline __attribute__((always_inline)) __m512i dpbusd_broadcast(__m512i sum, __m512i w, const int8_t *x) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(sum) : "v"(w), "m"(*(const int32_t *)x));
    return sum;
}

static inline __attribute__((always_inline)) void store16(__m512 v, void *out, int64_t at, const int out_kind) {
    if (out_kind == OUT_F32) {
        _mm512_storeu_ps((float *)out + at, v);
        return;
    }
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i hi = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
    if (out_kind == OUT_BF16) _mm256_storeu_si256((__m256i *)((uint16_t *)out + at), _mm512_cvtepi32_epi16(hi));
    else _mm512_storeu_ps((float *)out + at, _mm512_castsi512_ps(_mm512_slli_epi32(hi, 16)));
}

// Rows m0 .. m0 + mr against one panel (16 columns: one zmm): a block's 8 weight vectors are loaded
// (and for Q4_0 unpacked) once and used by every row of the tile. The rows' integer sums advance a
// group at a time, so the tile runs mr independent `vpdpbusd` chains side by side (one row's 8 in a
// chain, then the next row's, ran 12% slower).
static inline __attribute__((always_inline)) void tile(const Activations *a, const uint8_t *panel, const void *bias,
                                                       void *out, int64_t m0, int64_t col, int64_t n, int64_t k,
                                                       const int mr, const int qt, const int out_kind, Upcoming next) {
    const int64_t kb = k / QK;
    __m512 acc[8];  // 8: the largest tile any build runs (the remainder switch names them all)
    for (int r = 0; r < mr; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < kb; b++) {
        const uint8_t *block = panel + b * BLOCK_BYTES(qt);
        prefetch_part(next, b, kb);
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)block));
        __m512i w[GROUPS];
        if (qt == Q8_0) {
            for (int g = 0; g < GROUPS; g++) w[g] = _mm512_loadu_si512(block + 2 * PANEL + 64 * g);
        } else {
            const __m512i low = _mm512_set1_epi8(0xF);
            for (int h = 0; h < GROUPS / 2; h++) {
                const __m512i v = _mm512_loadu_si512(block + 2 * PANEL + 64 * h);
                w[h] = _mm512_and_si512(v, low);
                w[h + GROUPS / 2] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
        }
        __m512i sum[8];
        for (int r = 0; r < mr; r++) sum[r] = _mm512_set1_epi32(OFFSET(qt) * a->sum[(m0 + r) * kb + b]);
        for (int g = 0; g < GROUPS; g++)
            for (int r = 0; r < mr; r++) sum[r] = dpbusd_broadcast(sum[r], w[g], a->q + (m0 + r) * k + b * QK + 4 * g);
        for (int r = 0; r < mr; r++) {
            const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(a->d[(m0 + r) * kb + b]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r]), scale, acc[r]);
        }
    }
    __m512 bv = _mm512_setzero_ps();
    if (bias && out_kind == OUT_F32) bv = _mm512_loadu_ps((const float *)bias + col);
    else if (bias)
        bv = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)bias + col))), 16));
    for (int r = 0; r < mr; r++) store16(_mm512_add_ps(acc[r], bv), out, (m0 + r) * n + col, out_kind);
}

// Rows m0 .. m0 + mr against np neighbouring panels (2: 32 columns; 4 for a single row), for Q8_0
// (whose weights need no unpacking, so reading them a group at a time per tile costs only loads): each
// activation group feeds every panel's `vpdpbusd`, and the tile's stores cover 64 np contiguous bytes
// a row. The 49152-column LM head ran 10% faster in pairs than in single panels; Q4_0 did not gain
// (its nibbles would be unpacked again for every tile). One row reads four panels' weight streams at
// once, as the bf16 kernel does: from memory, gate_up and the LM head 10-12% faster than in pairs.
static inline __attribute__((always_inline)) void panels_tile(const Activations *a, const uint8_t *panel,
                                                              int64_t panel_bytes, const void *bias, void *out, int64_t m0,
                                                              int64_t col, int64_t n, int64_t k, const int mr,
                                                              const int np, const int out_kind, Upcoming next) {
    const int64_t kb = k / QK;
    __m512 acc[MAX_PAIR_ROWS][4];
    for (int r = 0; r < mr; r++)
        for (int h = 0; h < np; h++) acc[r][h] = _mm512_setzero_ps();
    for (int64_t b = 0; b < kb; b++) {
        const uint8_t *block[4];
        for (int h = 0; h < np; h++) block[h] = panel + h * panel_bytes + b * BLOCK_BYTES(Q8_0);
        prefetch_part(next, b, kb);
        __m512i sum[MAX_PAIR_ROWS][4];
        for (int r = 0; r < mr; r++)
            for (int h = 0; h < np; h++) sum[r][h] = _mm512_set1_epi32(OFFSET(Q8_0) * a->sum[(m0 + r) * kb + b]);
        for (int g = 0; g < GROUPS; g++) {
            __m512i w[4];
            for (int h = 0; h < np; h++) w[h] = _mm512_loadu_si512(block[h] + 2 * PANEL + 64 * g);
            for (int r = 0; r < mr; r++) {
                const int8_t *xg = a->q + (m0 + r) * k + b * QK + 4 * g;
                for (int h = 0; h < np; h++) sum[r][h] = dpbusd_broadcast(sum[r][h], w[h], xg);
            }
        }
        __m512 dw[4];
        for (int h = 0; h < np; h++) dw[h] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)block[h]));
        for (int r = 0; r < mr; r++) {
            const __m512 d = _mm512_set1_ps(a->d[(m0 + r) * kb + b]);
            for (int h = 0; h < np; h++)
                acc[r][h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r][h]), _mm512_mul_ps(dw[h], d), acc[r][h]);
        }
    }
    for (int h = 0; h < np; h++) {
        const int64_t c = col + PANEL * h;
        __m512 bv = _mm512_setzero_ps();
        if (bias && out_kind == OUT_F32) bv = _mm512_loadu_ps((const float *)bias + c);
        else if (bias)
            bv = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)bias + c))), 16));
        for (int r = 0; r < mr; r++) store16(_mm512_add_ps(acc[r][h], bv), out, (m0 + r) * n + c, out_kind);
    }
}


#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define VECTORISED 1
#define MAX_ROWS 4

// One block of a row: scale (max |x| / 127), int8 values (x * (1 / scale), nearest even), their sum.
static inline void quantize_block(const float *x, int8_t *q, float *d, int32_t *sum) {
    __m256 v[4];
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        m = _mm256_max_ps(m, _mm256_and_ps(v[i], magnitude));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h);
    int has_nan = 0;
    for (int j = 0; j < 4; j++) has_nan |= _mm256_movemask_ps(_mm256_cmp_ps(v[j], v[j], _CMP_UNORD_Q));
    float inverse;
    const float scale = block_scale(amax, has_nan != 0, &inverse);
    *d = scale;
    if (!isfinite(scale)) {
        memset(q, 0, QK);
        *sum = 0;
        return;
    }
    const __m256 iv = _mm256_set1_ps(inverse);
    __m256i i[4];
    for (int j = 0; j < 4; j++) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], iv));
    __m256i total = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    // packs work within 128-bit lanes: 0-3 8-11 16-19 24-27 | 4-7 12-15 20-23 28-31, then put in order
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    *sum = _mm_cvtsi128_si32(t);
}


static inline __attribute__((always_inline)) void store8(__m256 v, void *out, int64_t at, const int out_kind) {
    if (out_kind == OUT_F32) {
        _mm256_storeu_ps((float *)out + at, v);
        return;
    }
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i hi = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
    if (out_kind == OUT_BF16) {
        const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
        _mm_storeu_si128((__m128i *)((uint16_t *)out + at), packed);
    } else {
        _mm256_storeu_ps((float *)out + at, _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16)));
    }
}

// Rows m0 .. m0 + mr against one panel, as two halves of 8 columns. Q8_0's weights are signed again
// (byte ^ 0x80) and multiplied as llama.cpp's AVX2 path does: |w| (unsigned) by x with w's sign, so
// that `vpmaddubsw`'s pairs stay within int16 (2 x 128 x 127); Q4_0's q (0-15) by x directly.
static inline __attribute__((always_inline)) void tile(const Activations *a, const uint8_t *panel, const void *bias,
                                                       void *out, int64_t m0, int64_t col, int64_t n, int64_t k,
                                                       const int mr, const int qt, const int out_kind, Upcoming next) {
    const int64_t kb = k / QK;
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0xF), flip = _mm256_set1_epi8((char)0x80);
    __m256 acc[8][2];
    for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < kb; b++) {
        const uint8_t *block = panel + b * BLOCK_BYTES(qt);
        prefetch_part(next, b, kb);
        // Q8_0 widens each group's int16 pairs to int32 at once; Q4_0's pairs (|q x| <= 2 x 15 x 127) add up
        // over the block's 8 groups within int16 (30480), widened once a block.
        __m256i sum[8][2], pairs16[8][2];
        for (int r = 0; r < mr; r++) {
            sum[r][0] = sum[r][1] = _mm256_set1_epi32(qt == Q8_0 ? 0 : OFFSET(qt) * a->sum[(m0 + r) * kb + b]);
            pairs16[r][0] = pairs16[r][1] = _mm256_setzero_si256();
        }
        for (int g = 0; g < GROUPS; g++) {
            __m256i w[2], magnitude[2];
            for (int h = 0; h < 2; h++) {
                if (qt == Q8_0) {
                    w[h] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(block + 2 * PANEL + 64 * g + 32 * h)),
                                            flip);
                    magnitude[h] = _mm256_abs_epi8(w[h]);
                } else {
                    const __m256i v =
                        _mm256_loadu_si256((const __m256i *)(block + 2 * PANEL + 64 * (g % (GROUPS / 2)) + 32 * h));
                    w[h] = _mm256_and_si256(g < GROUPS / 2 ? v : _mm256_srli_epi16(v, 4), low);
                }
            }
            for (int r = 0; r < mr; r++) {
                const __m256i xv = _mm256_set1_epi32(group_of(a->q + (m0 + r) * k + b * QK + 4 * g));
                for (int h = 0; h < 2; h++) {
                    if (qt == Q8_0) {
                        const __m256i pairs = _mm256_maddubs_epi16(magnitude[h], _mm256_sign_epi8(xv, w[h]));
                        sum[r][h] = _mm256_add_epi32(sum[r][h], _mm256_madd_epi16(pairs, ones));
                    } else {
                        pairs16[r][h] = _mm256_add_epi16(pairs16[r][h], _mm256_maddubs_epi16(w[h], xv));
                    }
                }
            }
        }
        if (qt == Q4_0)
            for (int r = 0; r < mr; r++)
                for (int h = 0; h < 2; h++) sum[r][h] = _mm256_add_epi32(sum[r][h], _mm256_madd_epi16(pairs16[r][h], ones));
        const __m256 dw[2] = {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)block)),
                              _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)block + 1))};
        for (int r = 0; r < mr; r++) {
            const __m256 d = _mm256_set1_ps(a->d[(m0 + r) * kb + b]);
            for (int h = 0; h < 2; h++)
                acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r][h]), _mm256_mul_ps(dw[h], d), acc[r][h]);
        }
    }
    for (int h = 0; h < 2; h++) {
        __m256 bv = _mm256_setzero_ps();
        if (bias && out_kind == OUT_F32) bv = _mm256_loadu_ps((const float *)bias + col + 8 * h);
        else if (bias)
            bv = _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)bias + col + 8 * h))), 16));
        for (int r = 0; r < mr; r++) store8(_mm256_add_ps(acc[r][h], bv), out, (m0 + r) * n + col + 8 * h, out_kind);
    }
}

#else
// Portable C: the same integer sums and the same fp32 operations, in the same order.
#define VECTORISED 0
#define MAX_ROWS 1

// One block of a row: scale, int8 values, their sum, in the operations every build runs (max is exact in
// any order; x * (1 / d) rounded to nearest even, as lrintf and the vector conversions round).
static inline void quantize_block(const float *x, int8_t *q, float *d, int32_t *sum) {
    float amax = 0.0f, inverse;
    int has_nan = 0;
    for (int i = 0; i < QK; i++) {
        amax = fmaxf(amax, fabsf(x[i]));
        has_nan |= isnan(x[i]);
    }
    const float scale = block_scale(amax, has_nan, &inverse);
    const int finite = isfinite(scale);
    int32_t s = 0;
    for (int i = 0; i < QK; i++) {
        const int32_t v = finite ? (int32_t)lrintf(x[i] * inverse) : 0;
        q[i] = (int8_t)v;
        s += v;
    }
    *d = scale;
    *sum = s;
}

static inline int weight_at(const uint8_t *w, int kk, int c, int qt) {  // w: a block's weight bytes
    const int g = kk / 4, lane = c * 4 + kk % 4;
    if (qt == Q8_0) return w[64 * g + lane];
    const uint8_t byte = w[64 * (g % (GROUPS / 2)) + lane];
    return g < GROUPS / 2 ? byte & 0xF : byte >> 4;
}

static inline void tile(const Activations *a, const uint8_t *panel, const void *bias, void *out, int64_t m0,
                        int64_t col, int64_t n, int64_t k, const int mr, const int qt, const int out_kind,
                        Upcoming next) {
    const int64_t kb = k / QK;
    (void)next;  // one row a tile: nothing computes long enough to hide a read behind
    for (int64_t row = m0; row < m0 + mr; row++) {
        float acc[PANEL] = {0};
        for (int64_t b = 0; b < kb; b++) {
            const uint8_t *block = panel + b * BLOCK_BYTES(qt);
            const int8_t *xq = a->q + row * k + b * QK;
            for (int c = 0; c < PANEL; c++) {
                uint16_t h;
                memcpy(&h, block + 2 * c, 2);
                int32_t sum = OFFSET(qt) * a->sum[row * kb + b];
                for (int kk = 0; kk < QK; kk++) sum += weight_at(block + 2 * PANEL, kk, c, qt) * xq[kk];
                acc[c] = fmaf((float)sum, half_to_float(h) * a->d[row * kb + b], acc[c]);
            }
        }
        for (int c = 0; c < PANEL; c++) store_out(out, row * n + col + c, acc[c] + bias_at(bias, col + c, out_kind), out_kind);
    }
}
#endif


#ifdef LORAPLEX_AMX_INT8
// From AMX_ROWS rows (a batched decode step, a prefill chunk) the integer products run on AMX tiles
// (`tdpbsud`: activations signed, the panels' weights unsigned, as `vpdpbusd` takes them), on the same
// panels: one tile product is a 16-row x 16-column block of the int32 sums a block (32 k) gives, which
// the AVX-512 code then turns into fp32 exactly as the VNNI tiles do (the -128 / -8 offset added to the
// integer sum, then acc = fma(sum, weight scale x d, acc), blocks in increasing order): equal bits.
// Tiles are one block deep (32 bytes of activations a row) because every block has its own scales.
// Below AMX_ROWS a tile of activations would be mostly empty and the weights' reads bound the call
// anyway: the VNNI tiles run those.
#define AMX_ROWS 16
static int amx_allowed = 1;  // quant_linear_allow_amx
static int amx_permission = -1;  // asked of the kernel once: -1 not yet

static int amx_runs(void) {
    int permitted = __atomic_load_n(&amx_permission, __ATOMIC_ACQUIRE);
    if (permitted < 0) {
        permitted = amx_int8_permitted();
        __atomic_store_n(&amx_permission, permitted, __ATOMIC_RELEASE);
    }
    return permitted && __atomic_load_n(&amx_allowed, __ATOMIC_RELAXED);
}

// Tiles for a row block of `mr` rows (1-32): tmm0/tmm1 the sums of rows 0-15 against panels 0/1, tmm2/tmm3
// those of rows 16-31, tmm4/tmm5 the two 16-row tiles of activations (one block: 32 bytes a row),
// tmm6/tmm7 the two panels' weights of that block (8 groups of 16 columns x 4 bytes).
static void amx_configure_rows(int64_t mr) {
    const int rows0 = mr < 16 ? (int)mr : 16, rows1 = mr > 16 ? (int)(mr - 16) : 1;
    const int rows[8] = {rows0, rows0, rows1, rows1, rows0, rows1, GROUPS, GROUPS};
    const int colsb[8] = {64, 64, 64, 64, QK, QK, 64, 64};
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = (uint8_t)rows[t];
        cfg.colsb[t] = (uint16_t)colsb[t];
    }
    AMX_CONFIGURE(&cfg);
}

// A Q4_0 block's weights one byte each (AMX reads bytes, not nibbles), in Q8_0's group layout: 512 bytes.
static inline void unpack_q4_0(const uint8_t *block, uint8_t *to) {
    const __m512i low = _mm512_set1_epi8(0xF);
    for (int h = 0; h < GROUPS / 2; h++) {
        const __m512i v = _mm512_loadu_si512(block + 2 * PANEL + 64 * h);
        _mm512_storeu_si512(to + 64 * h, _mm512_and_si512(v, low));
        _mm512_storeu_si512(to + 64 * (h + GROUPS / 2), _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
    }
}

// Rows m0 .. m0 + mr (at most 32, tiles configured for mr) against `width` (1 or 2) neighbouring panels.
// `weights[b * 2 + h]` is block b's 512 weight bytes of panel h.
static void amx_tile(const Activations *a, const uint8_t *panel, int64_t panel_bytes, const uint8_t *const *weights,
                     int width, const void *bias, void *out, int64_t m0, int64_t mr, int64_t col, int64_t n, int64_t k,
                     const int qt, const int out_kind, Upcoming next) {
    const int64_t kb = k / QK;
    const int two = mr > 16;
    float acc[32][2 * PANEL] __attribute__((aligned(64)));
    int32_t sums[32][2 * PANEL] __attribute__((aligned(64)));
    memset(acc, 0, sizeof acc);
    for (int64_t b = 0; b < kb; b++) {
        prefetch_part(next, b, kb);
        AMX_LOAD(4, a->q + m0 * k + b * QK, k);
        if (two) AMX_LOAD(5, a->q + (m0 + 16) * k + b * QK, k);
        AMX_LOAD(6, weights[2 * b], 64);
        AMX_ZERO(0);
        AMX_DPBSUD(0, 4, 6);
        if (two) {
            AMX_ZERO(2);
            AMX_DPBSUD(2, 5, 6);
        }
        if (width == 2) {
            AMX_LOAD(7, weights[2 * b + 1], 64);
            AMX_ZERO(1);
            AMX_DPBSUD(1, 4, 7);
            if (two) {
                AMX_ZERO(3);
                AMX_DPBSUD(3, 5, 7);
            }
        }
        AMX_STORE(0, &sums[0][0], sizeof sums[0]);
        if (two) AMX_STORE(2, &sums[16][0], sizeof sums[0]);
        if (width == 2) {
            AMX_STORE(1, &sums[0][PANEL], sizeof sums[0]);
            if (two) AMX_STORE(3, &sums[16][PANEL], sizeof sums[0]);
        }
        for (int h = 0; h < width; h++) {
            const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(panel + h * panel_bytes +
                                                                                     b * BLOCK_BYTES(qt))));
            for (int64_t r = 0; r < mr; r++) {
                const int64_t at = (m0 + r) * kb + b;
                const __m512i sum = _mm512_add_epi32(_mm512_load_si512(&sums[r][PANEL * h]),
                                                     _mm512_set1_epi32(OFFSET(qt) * a->sum[at]));
                const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(a->d[at]));
                _mm512_store_ps(&acc[r][PANEL * h],
                                _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, _mm512_load_ps(&acc[r][PANEL * h])));
            }
        }
    }
    for (int h = 0; h < width; h++) {
        const int64_t c = col + PANEL * h;
        __m512 bv = _mm512_setzero_ps();
        if (bias && out_kind == OUT_F32) bv = _mm512_loadu_ps((const float *)bias + c);
        else if (bias) bv = widen16_bf16((const uint16_t *)bias + c);
        for (int64_t r = 0; r < mr; r++)
            store16(_mm512_add_ps(_mm512_load_ps(&acc[r][PANEL * h]), bv), out, (m0 + r) * n + c, out_kind);
    }
}

// Every row against the panels in units of two (the last alone where they are odd); each thread takes
// its units and runs every 32-row block against each, the next unit's weights fetched during the first.
// Returns 0, or -1 when a thread's buffer for unpacked Q4_0 weights could not be allocated.
static int amx_rows(const Activations *a, const uint8_t *packed, int64_t panel_bytes, const void *bias, void *out,
                    int64_t m, int64_t n, int64_t k, const int qt, const int out_kind) {
    const int64_t kb = k / QK, panels = n / PANEL, units = (panels + 1) / 2;
    int failed = 0;
#pragma omp parallel
    {
        const uint8_t **weights = thread_buffer(1, sizeof(uint8_t *) * 2 * kb);
        uint8_t *unpacked = qt == Q4_0 ? thread_buffer(2, (size_t)kb * 2 * 512) : NULL;
        const int ok = weights && (qt != Q4_0 || unpacked);
        if (!ok) failed = 1;
        int64_t configured = -1;
#pragma omp for schedule(static)
        for (int64_t u = 0; u < units; u++) {
            if (!ok) continue;
            const int64_t p = 2 * u;
            const int width = p + 1 < panels ? 2 : 1;
            const uint8_t *panel = packed + p * panel_bytes;
            for (int64_t b = 0; b < kb; b++) {
                for (int h = 0; h < width; h++) {
                    const uint8_t *block = panel + h * panel_bytes + b * BLOCK_BYTES(qt);
                    if (qt == Q8_0) {
                        weights[2 * b + h] = block + 2 * PANEL;
                    } else {
                        unpack_q4_0(block, unpacked + (2 * b + h) * 512);
                        weights[2 * b + h] = unpacked + (2 * b + h) * 512;
                    }
                }
            }
            const int64_t next_width = panels - (p + 2) < 2 ? panels - (p + 2) : 2;
            const Upcoming next = {next_width > 0 ? (const char *)packed + (p + 2) * panel_bytes : NULL,
                                   next_width * panel_bytes};
            for (int64_t m0 = 0; m0 < m; m0 += 32) {
                const int64_t mr = m - m0 < 32 ? m - m0 : 32;
                if (configured != mr) amx_configure_rows(configured = mr);
                amx_tile(a, panel, panel_bytes, weights, width, bias, out, m0, mr, p * PANEL, n, k, qt, out_kind,
                         m0 == 0 ? next : (Upcoming){NULL, 0});
            }
        }
        if (configured >= 0) AMX_RELEASE();
    }
    return failed ? -1 : 0;
}

#define AMX_TAKES(M) ((M) >= AMX_ROWS && amx_runs())
int quant_linear_allow_amx(int allow) {
    __atomic_store_n(&amx_allowed, allow != 0, __ATOMIC_RELAXED);
    return quant_linear_vectorised();
}
int quant_linear_vectorised(void) { return amx_runs() ? 3 : VECTORISED; }
int quant_linear_amx_faults(void) { return AMX_FAULTS(); }
#else
#define AMX_TAKES(M) 0
static inline int amx_rows(const Activations *a, const uint8_t *packed, int64_t panel_bytes, const void *bias,
                           void *out, int64_t m, int64_t n, int64_t k, const int qt, const int out_kind) {
    (void)a, (void)packed, (void)panel_bytes, (void)bias, (void)out, (void)m, (void)n, (void)k, (void)qt;
    (void)out_kind;  // never called: AMX_TAKES is 0
    return -3;
}
int quant_linear_allow_amx(int allow) {
    (void)allow;  // built without AMX-INT8: nothing to allow
    return VECTORISED;
}
int quant_linear_vectorised(void) { return VECTORISED; }
int quant_linear_amx_faults(void) { return 0; }
#endif

#ifndef QUANTIZE_BLOCKS  // the AVX2 and portable builds: a block at a time
static void quantize_blocks(const void *x, int wide, int64_t first, int64_t count, const Activations *a) {
    float block[QK];
    for (int64_t b = first; b < first + count; b++) {
        if (wide) for (int i = 0; i < QK; i++) block[i] = load_bf16((const uint16_t *)x, b * QK + i);
        else memcpy(block, (const float *)x + b * QK, sizeof block);
        quantize_block(block, a->q + b * QK, a->d + b, a->sum + b);
    }
}
#endif


#define TILE(MR) tile(a, panel, bias, out, m0, col, n, k, MR, qt, out_kind, \
                      upcoming_part(next, m0 / MAX_ROWS, (m + MAX_ROWS - 1) / MAX_ROWS))

// Every row against one panel: tiles of MAX_ROWS rows, then the remainder (each tile size a constant).
static inline __attribute__((always_inline)) void panel_rows(const Activations *a, const uint8_t *panel,
                                                             const void *bias, void *out, int64_t col, int64_t m,
                                                             int64_t n, int64_t k, const int qt, const int out_kind,
                                                             Upcoming next) {
    int64_t m0 = 0;
    for (; m0 + MAX_ROWS <= m; m0 += MAX_ROWS) TILE(MAX_ROWS);
    switch (m - m0) {
        case 7: if (MAX_ROWS > 7) TILE(7); break;
        case 6: if (MAX_ROWS > 6) TILE(6); break;
        case 5: if (MAX_ROWS > 5) TILE(5); break;
        case 4: if (MAX_ROWS > 4) TILE(4); break;
        case 3: if (MAX_ROWS > 3) TILE(3); break;
        case 2: if (MAX_ROWS > 2) TILE(2); break;
        case 1: if (MAX_ROWS > 1) TILE(1); break;
        default: break;
    }
}

#ifdef MAX_PAIR_ROWS
#define PAIRED(QT) ((QT) == Q8_0)  // units of two panels (panels_tile), four for a single row
#define PAIR_TILE(MR)                                                              \
    panels_tile(a, panel, panel_bytes, bias, out, m0, col, n, k, MR, 2, out_kind, \
              upcoming_part(next, m0 / MAX_PAIR_ROWS, (m + MAX_PAIR_ROWS - 1) / MAX_PAIR_ROWS))

// Every row against two neighbouring panels (Q8_0): tiles of MAX_PAIR_ROWS rows, then the remainder.
static inline __attribute__((always_inline)) void pair_rows(const Activations *a, const uint8_t *panel,
                                                            int64_t panel_bytes, const void *bias, void *out,
                                                            int64_t col, int64_t m, int64_t n, int64_t k,
                                                            const int out_kind, Upcoming next) {
    int64_t m0 = 0;
    for (; m0 + MAX_PAIR_ROWS <= m; m0 += MAX_PAIR_ROWS) PAIR_TILE(MAX_PAIR_ROWS);
    switch (m - m0) {
        case 5: if (MAX_PAIR_ROWS > 5) PAIR_TILE(5); break;
        case 4: if (MAX_PAIR_ROWS > 4) PAIR_TILE(4); break;
        case 3: if (MAX_PAIR_ROWS > 3) PAIR_TILE(3); break;
        case 2: if (MAX_PAIR_ROWS > 2) PAIR_TILE(2); break;
        case 1: if (MAX_PAIR_ROWS > 1) PAIR_TILE(1); break;
        default: break;
    }
}
// One row against the `left` (1-4) panels at `panel`: four in one tile, what is left in pairs and singles.
static inline __attribute__((always_inline)) void one_row_quad(const Activations *a, const uint8_t *panel,
                                                               int64_t panel_bytes, int64_t left, const void *bias,
                                                               void *out, int64_t col, int64_t n, int64_t k,
                                                               const int out_kind) {
    const Upcoming none = {NULL, 0};  // one row: no compute to hide fetches behind (PREFETCH_ROWS)
    if (left >= 4) {
        panels_tile(a, panel, panel_bytes, bias, out, 0, col, n, k, 1, 4, out_kind, none);
        return;
    }
    if (left >= 2) panels_tile(a, panel, panel_bytes, bias, out, 0, col, n, k, 1, 2, out_kind, none);
    if (left != 2) {
        const int64_t at = left == 3 ? 2 : 0;
        tile(a, panel + at * panel_bytes, bias, out, 0, col + at * PANEL, n, k, 1, Q8_0, out_kind, none);
    }
}
#else
#define PAIRED(QT) 0
static inline void one_row_quad(const Activations *a, const uint8_t *panel, int64_t panel_bytes, int64_t left,
                                const void *bias, void *out, int64_t col, int64_t n, int64_t k, const int out_kind) {
    (void)a, (void)panel, (void)panel_bytes, (void)left, (void)bias, (void)out, (void)col, (void)n, (void)k;
    (void)out_kind;  // no build without panels_tile calls it (PAIRED is 0)
}
static inline void pair_rows(const Activations *a, const uint8_t *panel, int64_t panel_bytes, const void *bias,
                             void *out, int64_t col, int64_t m, int64_t n, int64_t k, const int out_kind,
                             Upcoming next) {
    (void)a, (void)panel, (void)panel_bytes, (void)bias, (void)out, (void)col, (void)m, (void)n, (void)k;
    (void)out_kind, (void)next;  // no build without panels_tile calls it (PAIRED is 0)
}
#endif

// One row of a PAIRED type: thread t of `threads` takes its own contiguous share of the panels and reads
// them four at a time (four weight streams, as the bf16 kernel's one-row tiles read), what is left in a
// pair or single. Shares rather than units of four: SmolLM2's 36-panel down and o projections and
// 60-panel qkv would split into units of four unevenly (9 or 15 units on 2 threads: down ran 3%
// slower), and in pairs each thread keeps only two streams in flight (from memory, o and qkv read
// their weights at 28-32 GB/s in pairs, gate_up at 38 in fours; in shares, o and qkv 2-5% faster).
static inline __attribute__((always_inline)) void one_row_range(const Activations *a, const uint8_t *packed,
                                                                int64_t panel_bytes, int t, int threads,
                                                                const void *bias, void *out, int64_t n, int64_t k,
                                                                const int out_kind) {
    const int64_t panels = n / PANEL, first = panels * t / threads, end = panels * (t + 1) / threads;
    for (int64_t p = first; p < end; p += 4)
        one_row_quad(a, packed + p * panel_bytes, panel_bytes, end - p < 4 ? end - p : 4, bias, out, p * PANEL, n, k,
                     out_kind);
}

// A thread's unit of work `u`: one panel, or two for PAIRED types (the last alone where the panels are
// odd; a single row of a PAIRED type takes one_row_range instead); all rows against it, the next
// unit's weights fetched on the way.
static inline __attribute__((always_inline)) void unit_rows(const Activations *a, const uint8_t *packed,
                                                            int64_t panel_bytes, int64_t u, const void *bias, void *out,
                                                            int64_t m, int64_t n, int64_t k, const int qt,
                                                            const int out_kind) {
    const int64_t panels = n / PANEL, width = PAIRED(qt) ? 2 : 1, p = u * width;
    const int64_t next_panels = panels - (p + width) < width ? panels - (p + width) : width;
    const Upcoming next = {m >= PREFETCH_ROWS && next_panels > 0 ? (const char *)packed + (p + width) * panel_bytes
                                                                  : NULL,
                           next_panels * panel_bytes};
    if (width == 2 && p + 1 < panels)
        pair_rows(a, packed + p * panel_bytes, panel_bytes, bias, out, p * PANEL, m, n, k, out_kind, next);
    else
        panel_rows(a, packed + p * panel_bytes, bias, out, p * PANEL, m, n, k, qt, out_kind, next);
}

// Group g of x's blocks: 16 of them (fewer at the end), the most one quantize_blocks call takes.
static inline void quantize_group(const void *x, int wide, int64_t g, int64_t blocks, const Activations *a) {
    quantize_blocks(x, wide, 16 * g, blocks - 16 * g < 16 ? blocks - 16 * g : 16, a);
}

// x's rows quantized (buffer 0 of the calling thread, shared by the team), then each thread takes its
// panels and runs every row against each. Below SHARED_ROWS rows (a small decode step) the calling
// thread quantizes alone: a barrier costs more than the work. From SHARED_ROWS the team quantizes in
// the region that then runs the panels: the previous call's team read the buffer, so every line the
// quantization writes is first taken back from the other cores' caches, and one thread alone waited
// on those transfers (32 rows of 1536: 8 us of work took 16 with the team's copies to take back).
#define SHARED_ROWS 4
#define DEFINE_LINEAR(NAME, QT, OUT_KIND, WIDE)                                                            \
    static int NAME(const void *x, const uint8_t *packed, const void *bias, void *out, int64_t m, int64_t n,  \
                    int64_t k) {                                                                           \
        const int64_t kb = k / QK, blocks = m * kb, groups = (blocks + 15) / 16;                           \
        const size_t q_bytes = (size_t)(m * k + 63) / 64 * 64, scale_bytes = sizeof(float) * (size_t)blocks; \
        uint8_t *buffer = thread_buffer(0, q_bytes + 2 * scale_bytes);                                     \
        if (!buffer) return -1;                                                                            \
        const Activations a = {(int8_t *)buffer, (float *)(buffer + q_bytes),                              \
                               (int32_t *)(buffer + q_bytes + scale_bytes)};                               \
        const int64_t panel_bytes = kb * BLOCK_BYTES(QT), width = PAIRED(QT) ? 2 : 1;                      \
        const int shared = m >= SHARED_ROWS;                                                               \
        if (AMX_TAKES(m)) {                                                                                \
            _Pragma("omp parallel for schedule(static)")                                                   \
            for (int64_t g = 0; g < groups; g++) quantize_group(x, WIDE, g, blocks, &a);                   \
            return amx_rows(&a, packed, panel_bytes, bias, out, m, n, k, QT, OUT_KIND);                    \
        }                                                                                                  \
        if (!shared)                                                                                       \
            for (int64_t g = 0; g < groups; g++) quantize_group(x, WIDE, g, blocks, &a);                   \
        _Pragma("omp parallel")                                                                            \
        {                                                                                                  \
            if (shared) {                                                                                  \
                _Pragma("omp for schedule(static)")                                                        \
                for (int64_t g = 0; g < groups; g++) quantize_group(x, WIDE, g, blocks, &a);               \
            }                                                                                              \
            if (PAIRED(QT) && m == 1)                                                                      \
                one_row_range(&a, packed, panel_bytes, omp_get_thread_num(), omp_get_num_threads(), bias,  \
                              out, n, k, OUT_KIND);                                                        \
            else {                                                                                         \
                _Pragma("omp for schedule(static) nowait") /* the region's end is the barrier */           \
                for (int64_t u = 0; u < (n / PANEL + width - 1) / width; u++)                              \
                    unit_rows(&a, packed, panel_bytes, u, bias, out, m, n, k, QT, OUT_KIND);               \
            }                                                                                              \
        }                                                                                                  \
        return 0;                                                                                          \
    }

DEFINE_LINEAR(q8_0_f32, Q8_0, OUT_F32, 0)
DEFINE_LINEAR(q8_0_bf16, Q8_0, OUT_BF16, 1)
DEFINE_LINEAR(q8_0_bf16_float_output, Q8_0, OUT_BF16_AS_F32, 1)
DEFINE_LINEAR(q4_0_f32, Q4_0, OUT_F32, 0)
DEFINE_LINEAR(q4_0_bf16, Q4_0, OUT_BF16, 1)
DEFINE_LINEAR(q4_0_bf16_float_output, Q4_0, OUT_BF16_AS_F32, 1)

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
    return (float_output ? q8_0_bf16_float_output : q8_0_bf16)(x, packed, bias, out, m, n, k);
}

int quant_linear_q4_0_f32(const float *x, const uint8_t *packed, const float *bias, float *out, int64_t m,
                          int64_t n, int64_t k, int float_output) {
    (void)float_output;
    return q4_0_f32(x, packed, bias, out, m, n, k);
}

int quant_linear_q4_0_bf16(const uint16_t *x, const uint8_t *packed, const uint16_t *bias, void *out, int64_t m,
                           int64_t n, int64_t k, int float_output) {
    return (float_output ? q4_0_bf16_float_output : q4_0_bf16)(x, packed, bias, out, m, n, k);
}
