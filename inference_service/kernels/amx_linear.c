// bf16 projections on Intel AMX for the batch sizes a decode step has: out [M, N] = x [M, K] W^T
// (+ bias), fp32 accumulation, rounded once to bf16 on store.
//
// Why not oneDNN (which also uses AMX here): at M <= 64 a projection only streams its weights, and
// oneDNN's kernels read them at about half the rate a plain sequential read reaches on this kind of
// host (they rely on the hardware prefetcher, which AMX's 1 KiB tile loads outrun). This kernel walks
// a layout where each thread's weights are one contiguous run and prefetches a few tiles ahead.
//
// Weight layout (`pack` in amx_linear.py): [N/32][K/32] blocks of 2 KiB, each [16 k-pairs][32 n][2]
// (the VNNI pairs AMX's B operand wants), so a block holds the two B tiles of 16 columns each.
// Tiles: tmm0-3 accumulate a 32 x 32 output block (rows 0-15 / 16-31 x columns 0-15 / 16-31),
// tmm4-5 hold x's two 16-row tiles, tmm6-7 the block's two B tiles.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "kernels.h"

#ifdef LORAPLEX_AMX
#include <omp.h>

#define PREFETCH_BLOCKS 2  // how far ahead a thread prefetches its weights (measured best of 1-8)
#define CHUNK_BLOCKS 8     // 32-row blocks of x kept hot in L2 while a thread walks its columns

// 1 where the kernel can run: built with AMX and the kernel lets this process use the tile state.
int amx_linear_init(void) { return amx_permitted(); }

// Tiles for a row block of `mr` rows (1-32): rows0 = the first 16-row tile's, rows1 the second's.
static void configure(int64_t mr) {
    const int rows0 = mr < 16 ? (int)mr : 16, rows1 = mr > 16 ? (int)(mr - 16) : 1;
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    const int rows[8] = {rows0, rows0, rows1, rows1, rows0, rows1, 16, 16};
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = (uint8_t)rows[t];
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

// The fp32 products of one 32 x 32 output block into c: rows m0 .. m0 + mr of x against the column
// block at `blocks` (rows past mr are left as they were).
static inline void accumulate(const uint16_t *x, const uint16_t *blocks, float c[32][32], int64_t m0, int64_t mr,
                              int64_t k, int prefetch) {
    const int64_t kblocks = k / 32;
    const int two = mr > 16;
    const uint16_t *xa = x + m0 * k;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kb = 0; kb < kblocks; kb++) {
        const uint16_t *b = blocks + kb * 1024;
        if (prefetch) {
            const char *ahead = (const char *)(b + PREFETCH_BLOCKS * 1024);
            for (int i = 0; i < 2048; i += 64) _mm_prefetch(ahead + i, _MM_HINT_T0);
        }
        _tile_loadd(4, xa + kb * 32, k * 2);
        _tile_loadd(6, b, 128);
        _tile_loadd(7, b + 32, 128);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
            _tile_loadd(5, xa + 16 * k + kb * 32, k * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, &c[0][0], 128);
    _tile_stored(1, &c[0][16], 128);
    if (two) {
        _tile_stored(2, &c[16][0], 128);
        _tile_stored(3, &c[16][16], 128);
    }
}

// Row r of a block's products plus bias, rounded to bf16 once (columns 0-15 low, 16-31 high).
static inline __m512bh rounded_row(float c[32][32], int64_t r, __m512 bias_lo, __m512 bias_hi) {
    return _mm512_cvtne2ps_pbh(_mm512_add_ps(_mm512_load_ps(&c[r][16]), bias_hi),
                               _mm512_add_ps(_mm512_load_ps(&c[r][0]), bias_lo));
}

static inline void load_bias(const uint16_t *bias, int64_t n0, __m512 *lo, __m512 *hi) {
    *lo = *hi = _mm512_setzero_ps();
    if (bias) {
        *lo = widen16_bf16(bias + n0);
        *hi = widen16_bf16(bias + n0 + 16);
    }
}

// One 32 x 32 output block: rows m0 .. m0 + mr of x against the column block at `blocks`.
// `out` holds bf16, or with `out_f32` fp32 (the bf16-rounded values widened: what `.float()` of the
// bf16 product gives, in the one pass).
static void block(const uint16_t *x, const uint16_t *blocks, const uint16_t *bias, void *out, int out_f32,
                  int64_t m0, int64_t mr, int64_t n0, int64_t n, int64_t k, int prefetch) {
    float c[32][32] __attribute__((aligned(64)));
    accumulate(x, blocks, c, m0, mr, k, prefetch);
    __m512 bias_lo, bias_hi;
    load_bias(bias, n0, &bias_lo, &bias_hi);
    for (int64_t r = 0; r < mr; r++) {
        const __m512bh rounded = rounded_row(c, r, bias_lo, bias_hi);
        if (out_f32) {
            float *o = (float *)out + (m0 + r) * n + n0;
            _mm512_storeu_ps(o, _mm512_cvtpbh_ps((__m256bh)_mm512_castsi512_si256((__m512i)rounded)));
            _mm512_storeu_ps(o + 16, _mm512_cvtpbh_ps((__m256bh)_mm512_extracti64x4_epi64((__m512i)rounded, 1)));
        } else {
            _mm512_storeu_si512((void *)((uint16_t *)out + (m0 + r) * n + n0), (__m512i)rounded);
        }
    }
}

// out [m, n] = x [m, k] @ W^T (+ bias [n] unless NULL), in bf16 or (out_f32) fp32; n and k multiples of
// 32, x and out dense. Returns 0.
int amx_linear_bf16(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, void *out, int64_t m,
                    int64_t n, int64_t k, int out_f32) {
    const int64_t nblocks = n / 32, mblocks = (m + 31) / 32, kblocks = k / 32;
    if (mblocks >= 16 && mblocks >= 2 * omp_get_max_threads()) {
        // Many rows (a prefill step): threads take row blocks, and walk the columns in groups whose
        // weights (~512 KiB) stay in L2 while all their rows pass; a row block's x stays in L1 across
        // a group. Splitting the columns instead re-read every row of x from L3 for each column
        // block: at 2048 rows 2.1 TFLOP/s, this way 2.3-2.6 (oneDNN 2.7-3.0); level at 512 rows.
        const int64_t group = (1 << 19) / (k * 64) > 0 ? (1 << 19) / (k * 64) : 1;
#pragma omp parallel
        {
            int64_t configured = -1;
            for (int64_t g0 = 0; g0 < nblocks; g0 += group) {
                const int64_t g1 = g0 + group < nblocks ? g0 + group : nblocks;
#pragma omp for schedule(static) nowait
                for (int64_t mb = 0; mb < mblocks; mb++) {
                    const int64_t m0 = mb * 32, mr = m - m0 < 32 ? m - m0 : 32;
                    if (configured != mr) configure(configured = mr);
                    for (int64_t nb = g0; nb < g1; nb++)
                        block(x, packed + nb * kblocks * 1024, bias, out, out_f32, m0, mr, nb * 32, n, k, 0);
                }
            }
            if (configured >= 0) _tile_release();
        }
        return 0;
    }
#pragma omp parallel
    {
        int64_t configured = -1;
        for (int64_t chunk = 0; chunk < mblocks; chunk += CHUNK_BLOCKS) {
            const int64_t chunk_end = chunk + CHUNK_BLOCKS < mblocks ? chunk + CHUNK_BLOCKS : mblocks;
#pragma omp for schedule(static)
            for (int64_t nb = 0; nb < nblocks; nb++) {
                for (int64_t mb = chunk; mb < chunk_end; mb++) {
                    const int64_t m0 = mb * 32, mr = m - m0 < 32 ? m - m0 : 32;
                    if (configured != mr) configure(configured = mr);
                    // Weights come from memory on a column block's first row block only.
                    block(x, packed + nb * kblocks * 1024, bias, out, out_f32, m0, mr, nb * 32, n, k, mb == chunk);
                }
            }
        }
        if (configured >= 0) _tile_release();
    }
    return 0;  // an int like the other projection kernels' (kernels/decode_stack.c checks it)
}

// The greedy pick from x [m, k] @ W^T (+ bias) without writing the logits: per row the first index
// of the maximum of the bf16-rounded products (what torch's argmax of `.float()` of the bf16 logits
// gives) and whether that maximum is finite with no NaN in the row (greedy.c's rule). The LM head of
// a step whose rows all sample greedily: its [m, vocab] fp32 logits were ~12% more bytes to write
// than the weights it reads, and a second pass to read back.
int amx_argmax_bf16(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, int64_t m, int64_t n,
                    int64_t k, int64_t *idx, uint8_t *finite) {
    const int64_t nblocks = n / 32, mblocks = (m + 31) / 32, kblocks = k / 32;
    const int threads = omp_get_max_threads();
    // Per thread and row: its best value, that value's first column, and whether it saw a NaN.
    float *thread_best = malloc(sizeof(float) * threads * m);
    int64_t *thread_at = malloc(sizeof(int64_t) * threads * m);
    uint8_t *thread_nan = malloc(threads * m);
    int failed = !thread_best || !thread_at || !thread_nan;
    if (failed) {
        free(thread_best), free(thread_at), free(thread_nan);
        return -2;
    }
#pragma omp parallel
    {
        const int t = omp_get_thread_num();
        // 16 lanes per row: lane l sees columns l, l + 16, l + 32, ... in increasing order, so a
        // strict `>` keeps the first column of each lane's maximum. Each thread's own (allocated
        // here: state one thread allocated for both ran the pick 15-30% slower at 64 rows).
        __m512 *best = aligned_alloc(64, sizeof(__m512) * m);
        __m512i *at = aligned_alloc(64, sizeof(__m512i) * m);
        __mmask16 *nan = calloc(m, sizeof(__mmask16));
        const int ok = best && at && nan;
        if (!ok) failed = 1;  // the thread still takes its share of the loop below, doing nothing
        for (int64_t r = 0; r < (ok ? m : 0); r++) {
            best[r] = _mm512_set1_ps(-INFINITY);
            at[r] = _mm512_setzero_si512();
        }
        const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        float c[32][32] __attribute__((aligned(64)));
        int64_t configured = -1;
        for (int64_t chunk = 0; chunk < mblocks; chunk += CHUNK_BLOCKS) {
            const int64_t chunk_end = chunk + CHUNK_BLOCKS < mblocks ? chunk + CHUNK_BLOCKS : mblocks;
#pragma omp for schedule(static)
            for (int64_t nb = 0; nb < nblocks; nb++) {
                if (!ok) continue;
                __m512 bias_lo, bias_hi;
                load_bias(bias, nb * 32, &bias_lo, &bias_hi);
                const __m512i cols_lo = _mm512_add_epi32(iota, _mm512_set1_epi32((int)(nb * 32)));
                const __m512i cols_hi = _mm512_add_epi32(cols_lo, _mm512_set1_epi32(16));
                for (int64_t mb = chunk; mb < chunk_end; mb++) {
                    const int64_t m0 = mb * 32, mr = m - m0 < 32 ? m - m0 : 32;
                    if (configured != mr) configure(configured = mr);
                    accumulate(x, packed + nb * kblocks * 1024, c, m0, mr, k, mb == chunk);
                    for (int64_t r = 0; r < mr; r++) {
                        const __m512i rounded = (__m512i)rounded_row(c, r, bias_lo, bias_hi);
                        const __m512 lo = _mm512_cvtpbh_ps((__m256bh)_mm512_castsi512_si256(rounded));
                        const __m512 hi = _mm512_cvtpbh_ps((__m256bh)_mm512_extracti64x4_epi64(rounded, 1));
                        __m512 b = best[m0 + r];
                        __m512i a = at[m0 + r];
                        __mmask16 g = _mm512_cmp_ps_mask(lo, b, _CMP_GT_OQ);
                        b = _mm512_mask_mov_ps(b, g, lo);
                        a = _mm512_mask_mov_epi32(a, g, cols_lo);
                        g = _mm512_cmp_ps_mask(hi, b, _CMP_GT_OQ);
                        best[m0 + r] = _mm512_mask_mov_ps(b, g, hi);
                        at[m0 + r] = _mm512_mask_mov_epi32(a, g, cols_hi);
                        nan[m0 + r] |= _mm512_cmp_ps_mask(lo, lo, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(hi, hi, _CMP_UNORD_Q);
                    }
                }
            }
        }
        if (configured >= 0) _tile_release();
        for (int64_t r = 0; r < (ok ? m : 0); r++) {
            float lanes[16] __attribute__((aligned(64)));
            int32_t lane_at[16] __attribute__((aligned(64)));
            _mm512_store_ps(lanes, best[r]);
            _mm512_store_si512((__m512i *)lane_at, at[r]);
            float v = lanes[0];
            int64_t a = lane_at[0];
            for (int l = 1; l < 16; l++)
                if (lanes[l] > v || (lanes[l] == v && lane_at[l] < a)) v = lanes[l], a = lane_at[l];
            thread_best[t * m + r] = v;
            thread_at[t * m + r] = a;
            thread_nan[t * m + r] = nan[r] != 0;
        }
        free(best);
        free(at);
        free(nan);
    }
    for (int64_t r = 0; r < (failed ? 0 : m); r++) {  // threads that ran no column block hold -inf at column 0
        float v = thread_best[r];
        int64_t a = thread_at[r];
        int any_nan = thread_nan[r];
        for (int t = 1; t < threads; t++) {
            const float w = thread_best[t * m + r];
            const int64_t wa = thread_at[t * m + r];
            any_nan |= thread_nan[t * m + r];
            if (w > v || (w == v && wa < a)) v = w, a = wa;
        }
        idx[r] = a;
        finite[r] = !any_nan && isfinite(v);
    }
    free(thread_best);
    free(thread_at);
    free(thread_nan);
    return failed ? -2 : 0;
}

#else
int amx_linear_init(void) { return 0; }  // built without AMX: the caller keeps oneDNN

int amx_linear_bf16(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, void *out, int64_t m,
                    int64_t n, int64_t k, int out_f32) {
    (void)x, (void)packed, (void)bias, (void)out, (void)m, (void)n, (void)k, (void)out_f32;
    return -3;
}

int amx_argmax_bf16(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, int64_t m, int64_t n,
                    int64_t k, int64_t *idx, uint8_t *finite) {
    (void)x, (void)packed, (void)bias, (void)m, (void)n, (void)k, (void)idx, (void)finite;
    return -3;
}
#endif
