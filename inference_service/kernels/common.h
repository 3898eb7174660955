// What the CPU kernels share: fp32/bf16 element access (arithmetic is fp32; bf16 is widened on
// load and rounded to nearest even on store), an exp their vectorised loops can inline, per-thread
// scratch buffers, and on CPUs with AMX the tile set-up its kernels need.
#ifndef LORAPLEX_KERNELS_COMMON_H
#define LORAPLEX_KERNELS_COMMON_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float load_f32(const float *p, int64_t i) { return p[i]; }
static inline void store_f32(float *p, int64_t i, float f) { p[i] = f; }
static inline float round_f32(float f) { return f; }
static inline float load_bf16(const uint16_t *p, int64_t i) {
    uint32_t bits = (uint32_t)p[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
static inline uint16_t bf16_bits(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits += 0x7FFF + ((bits >> 16) & 1);  // round to nearest even
    return (uint16_t)(bits >> 16);
}
static inline void store_bf16(uint16_t *p, int64_t i, float f) { p[i] = bf16_bits(f); }
static inline float round_bf16(float f) {  // the value a bf16 store of f would hold
    uint32_t bits = (uint32_t)bf16_bits(f) << 16;
    float r;
    memcpy(&r, &bits, sizeof r);
    return r;
}

// Index of token t's row in a paged KV cache (the attention kernels): its block's index (from the
// sequence's block table) times the block size, plus its offset in the block.
static inline int64_t cache_row(const int64_t *table, int64_t t, int64_t block_size) {
    return table[t / block_size] * block_size + t % block_size;
}

// A thread's scratch buffer `which` (0-3; each kernel library has its own set), 64-byte aligned, kept
// between calls and grown when a call needs more: a fresh malloc + free per call of the ~100 KiB
// ones went back to the kernel and faulted its pages in again every call (page faults showed in a
// step's profile). Its contents do not outlive a call. NULL when out of memory.
static inline void *thread_buffer(int which, size_t bytes) {
    static __thread void *buffers[4];
    static __thread size_t sizes[4];
    if (sizes[which] < bytes) {
        free(buffers[which]);
        buffers[which] = aligned_alloc(64, (bytes + 63) / 64 * 64);
        sizes[which] = buffers[which] ? bytes : 0;
    }
    return buffers[which];
}

// The weights a projection's thread reads next (its next unit of panels), asked into the cache while a
// tile of at least PREFETCH_ROWS rows computes on the current ones (quant_linear.c, bf16_linear.c): a
// decode step's weights are far larger than the L3, and the hardware prefetcher alone left 32-row
// projections ~20% slower than with their weights in cache (the 32-row Q4_0 gate_up; the bf16 one at
// 342 GFLOP/s streamed against 424 so and 449 in cache). Each tile of the unit asks for its share
// (`upcoming_part`), spread over its steps by each kernel's own loop: the first tile asking for all of
// it left the LM head 20% slower. Fewer rows leave no compute to hide the reads behind (one row read 10%
// slower with it).
#define PREFETCH_ROWS 8
typedef struct {
    const char *at;  // NULL: nothing to fetch
    int64_t bytes;
} Upcoming;

// Tile i of `tiles`'s part of the next unit's weights.
static inline Upcoming upcoming_part(Upcoming next, int64_t i, int64_t tiles) {
    if (!next.at) return next;
    const int64_t from = (i * next.bytes / tiles) & ~(int64_t)63, to = (i + 1) * next.bytes / tiles;
    return (Upcoming){next.at + from, to - from};
}

// A tile's loop asking for its part line by line: at step `step` of `steps`, the lines up to
// (step + 1) x lines / steps (`*fetched` counts those asked for). Callers test `next.at` first: a tile
// with nothing to fetch then does no per-step arithmetic (that cost the bf16 tile 5-8%).
static inline __attribute__((always_inline)) void fetch_spread(Upcoming next, int64_t *fetched, int64_t step,
                                                               int64_t steps) {
    const int64_t lines = (next.bytes + 63) / 64;
    for (const int64_t upto = (step + 1) * lines / steps; *fetched < upto; ++*fetched)
        __builtin_prefetch(next.at + 64 * *fetched, 0, 3);
}

// exp for the kernels' vectorised loops. libm's expf is a call per element (and its vector
// versions are only declared under -ffast-math, whose other assumptions the kernels cannot
// take: -INFINITY starts the softmax max). This is Cephes' single-precision exp: a Cody-Waite
// range reduction to [-ln2/2, ln2/2], a degree-6 polynomial, 2^n put in by the exponent bits.
// Within ~2 ulp of expf; it inlines, so loops calling it vectorise.
static inline float vec_expf(float x) {
    x = x < -87.33654f ? -87.33654f : (x > 88.72283f ? 88.72283f : x);  // exp stays a normal float
    const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round(x / ln2)
    const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#ifdef __AVX512F__
#include <immintrin.h>
// 16 bf16 values widened to fp32 in one move (GCC splits the generic conversion in two halves).
static inline __m512 widen16_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

// Sixteen vectors reduced across their lanes, as one vector (lane i: v[i]'s lanes reduced) through a tree
// of shuffles, 4 steps of two shuffles and one operation, not 16 reductions each waiting on its own:
// fp32 sums (always added in the same order), fp32 maxima, or int32 sums (vectors of int32 bits).
enum { LANES_ADD = 0, LANES_MAX = 1, LANES_ADD_INT32 = 2 };
static inline __attribute__((always_inline)) __m512 lanes_op(__m512 x, __m512 y, const int op) {
    if (op == LANES_MAX) return _mm512_max_ps(x, y);
    if (op == LANES_ADD_INT32)
        return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(x), _mm512_castps_si512(y)));
    return _mm512_add_ps(x, y);
}
static inline __attribute__((always_inline)) __m512 lanes_reduced16(const __m512 v[16], const int op) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)  // 128-bit lanes: [v0 0+2, v1 0+2, v0 1+3, v1 1+3] for the pair's vectors
        a[i] = lanes_op(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]), op);
    for (int i = 0; i < 4; i++) {  // each 128-bit lane: the 4 vectors' reductions over that lane
        const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = lanes_op(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)), op);
    }
    for (int i = 0; i < 2; i++)  // 128-bit lanes 0+1 and 2+3 of two groups of 4 vectors
        c[i] = lanes_op(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                        _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD), op);
    // c[i]'s 128-bit lanes: vectors 8i..8i+3 reduced over their lanes 0-7, then 8-15, then 8i+4..8i+7 alike
    const __m512 lo = _mm512_shuffle_f32x4(c[0], c[1], 0x88), hi = _mm512_shuffle_f32x4(c[0], c[1], 0xDD);
    return lanes_op(lo, hi, op);
}
#endif

// The tile configuration `_tile_loadconfig` takes (palette 1): rows and bytes per row of tmm0-7 (also what
// amx_tiles.h's C model of the tiles reads, in builds without AMX).
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define LORAPLEX_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

// 1 where Linux lets this process use AMX's tile state (asked once per process is enough; asking
// again is harmless). Without it the first tile instruction faults.
static inline int amx_permitted(void) {
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
}

#endif

#endif
