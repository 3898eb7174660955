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
#include <stdint.h>
#include <string.h>

#include "common.h"

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

// One 32 x 32 output block: rows m0 .. m0 + mr of x against the column block at `blocks`.
// `out` holds bf16, or with `out_f32` fp32 (the bf16-rounded values widened: what `.float()` of the
// bf16 product gives, in the one pass).
static void block(const uint16_t *x, const uint16_t *blocks, const uint16_t *bias, void *out, int out_f32,
                  int64_t m0, int64_t mr, int64_t n0, int64_t n, int64_t k, int prefetch) {
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
    float c[32][32] __attribute__((aligned(64)));
    _tile_stored(0, &c[0][0], 128);
    _tile_stored(1, &c[0][16], 128);
    if (two) {
        _tile_stored(2, &c[16][0], 128);
        _tile_stored(3, &c[16][16], 128);
    }
    __m512 bias_lo = _mm512_setzero_ps(), bias_hi = _mm512_setzero_ps();
    if (bias) {
        bias_lo = widen16_bf16(bias + n0);
        bias_hi = widen16_bf16(bias + n0 + 16);
    }
    for (int64_t r = 0; r < mr; r++) {
        const __m512 lo = _mm512_add_ps(_mm512_load_ps(&c[r][0]), bias_lo);
        const __m512 hi = _mm512_add_ps(_mm512_load_ps(&c[r][16]), bias_hi);
        const __m512bh rounded = _mm512_cvtne2ps_pbh(hi, lo);
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
// 32, x and out dense.
void amx_linear_bf16(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, void *out, int64_t m,
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
        return;
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
}

#else
int amx_linear_init(void) { return 0; }  // built without AMX: the caller keeps oneDNN

void amx_linear_bf16(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, void *out, int64_t m,
                     int64_t n, int64_t k, int out_f32) {
    (void)x, (void)packed, (void)bias, (void)out, (void)m, (void)n, (void)k, (void)out_f32;
}
#endif
