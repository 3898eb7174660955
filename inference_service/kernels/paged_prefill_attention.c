// Causal attention of one prefill chunk over its sequence's paged KV cache, read in place.
//
// torch's path gathers the context's blocks (for a chunk after the first) and runs SDPA; on a CPU
// without AVX-512 (AMD Zen 1) its flash kernel ran at 9-15 GFLOP/s at 512 tokens and 20-28 at 2048:
// ~1 s of a ~5 s 512-token prefill in bf16.
// Here a task is one KV head and QB consecutive positions: the R = QB x group query rows of that
// head's group, kept transposed (Q^T [D][R], pre-scaled), so that for each tile of KT keys
//   S^T [KT][R] = K Q^T    in register tiles of 4 keys x 16 rows (a key element broadcast, Q^T loaded),
//   online softmax          down each row's column, the rows side by side in vectors (flash-style:
//                           running max and sum, the output rescaled when the max grows),
//   O [R][D] += P V         in register tiles of 4 rows x 16 dims over the tile's keys.
// K and V of a tile are widened to fp32 once per task (contiguous rows). fp32 arithmetic; bf16 is
// rounded once on store. Keys past a row's own position are masked (probability exactly 0).
//
// q [T, Hq, D] for positions start .. start + T - 1 (the chunk's K/V already written to the cache);
// caches [num_blocks, block_size, Hkv, D]; table [>= ceil((start + T) / block_size)] int64;
// out [T, Hq, D]. head_dim a multiple of 8. All contiguous.
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "kernels.h"
#include "vec8.h"

#define KT 64        // keys per tile
#define ROWS_MAX 64  // query rows per task (QB positions x group heads)

// S^T[t][r .. r + 8 nv) for the tile's keys t0 .. t0 + NT (NT <= 4) over D dims.
static inline __attribute__((always_inline)) void scores_tile(const float *kf, const float *qt, float *st, int64_t d_len,
                                                              int64_t rp, int64_t r, const int nt, const int nv) {
    vf8 acc[4][2];
    for (int i = 0; i < nt; i++) acc[i][0] = acc[i][1] = (vf8){0};
    for (int64_t d = 0; d < d_len; d++) {
        const vf8 q0 = load8(qt + d * rp + r), q1 = nv == 2 ? load8(qt + d * rp + r + 8) : (vf8){0};
        for (int i = 0; i < nt; i++) {
            const float k = kf[i * d_len + d];
            acc[i][0] += k * q0;
            if (nv == 2) acc[i][1] += k * q1;
        }
    }
    for (int i = 0; i < nt; i++) {
        store8(st + i * rp + r, acc[i][0]);
        if (nv == 2) store8(st + i * rp + r + 8, acc[i][1]);
    }
}

// O[r .. r + 4)[d .. d + 8 nv) += sum over the tile's keys t of P^T[t][r + i] V[t][d ..].
static inline __attribute__((always_inline)) void values_tile(float *o, const float *pt, const float *vf, int64_t keys,
                                                              int64_t d_len, int64_t rp, int64_t r, int64_t d,
                                                              const int nv) {
    const int nr = 4;
    vf8 acc[4][2];
    for (int i = 0; i < nr; i++) {
        acc[i][0] = load8(o + (r + i) * d_len + d);
        acc[i][1] = nv == 2 ? load8(o + (r + i) * d_len + d + 8) : (vf8){0};
    }
    for (int64_t t = 0; t < keys; t++) {
        const vf8 v0 = load8(vf + t * d_len + d), v1 = nv == 2 ? load8(vf + t * d_len + d + 8) : (vf8){0};
        for (int i = 0; i < nr; i++) {
            const float p = pt[t * rp + r + i];
            acc[i][0] += p * v0;
            if (nv == 2) acc[i][1] += p * v1;
        }
    }
    for (int i = 0; i < nr; i++) {
        store8(o + (r + i) * d_len + d, acc[i][0]);
        if (nv == 2) store8(o + (r + i) * d_len + d + 8, acc[i][1]);
    }
}

// One key tile's rows t0 .. t0 + keys widened to fp32 [keys][D] (`first`: the head's offset in a row;
// `rows`: each token's row in the cache).
static inline __attribute__((always_inline)) void widen_tile(float *dst, const void *cache, const int64_t *rows,
                                                             int64_t row, int64_t first, int64_t t0, int64_t keys,
                                                             int64_t d_len, const int wide) {
    const int64_t elem = wide ? 2 : 4;
    for (int64_t t = 0; t < keys; t++) {
        const char *src = (const char *)cache + (rows[t0 + t] * row + first) * elem;
        for (int64_t d = 0; d < d_len; d += 8) store8(dst + t * d_len + d, cache8(src + d * elem, wide));
    }
}

// One task: KV head j, positions p0 .. p0 + np of the chunk.
static inline __attribute__((always_inline)) void attend_task(
    const void *q, const void *k_cache, const void *v_cache, const int64_t *rows_of, void *out, int64_t start,
    int64_t q_heads, int64_t kv_heads, int64_t head_dim, float scale, int64_t j, int64_t p0,
    int64_t np, float *buffer, const int wide) {
    const int64_t group = q_heads / kv_heads, rows = np * group, rp = (rows + 7) / 8 * 8, row = kv_heads * head_dim;
    float *qt = buffer;                 // [D][rp]
    float *kf = qt + head_dim * rp;     // [KT][D]
    float *vf = kf + KT * head_dim;     // [KT][D]
    float *st = vf + KT * head_dim;     // [KT][rp]
    float *o = st + KT * rp;            // [rp][D]
    float *mx = o + rp * head_dim;      // [rp] running max
    float *sum = mx + rp;               // [rp] running sum
    float *corr = sum + rp;             // [rp] this tile's rescale
    int64_t *pos = (int64_t *)(corr + rp);  // [rp] each row's position (pads: the last, so finite)
    for (int64_t r = 0; r < rp; r++) {
        const int64_t p = r < rows ? r / group : np - 1, h = j * group + (r < rows ? r % group : 0);
        pos[r] = start + p0 + p;
        mx[r] = -INFINITY, sum[r] = 0.f;
        for (int64_t d = 0; d < head_dim; d++) {
            const int64_t i = ((p0 + p) * q_heads + h) * head_dim + d;
            qt[d * rp + r] = (r < rows ? (wide ? load_bf16(q, i) : load_f32(q, i)) : 0.f) * scale;
        }
    }
    memset(o, 0, sizeof(float) * (size_t)(rp * head_dim));
    const int64_t last = start + p0 + np - 1;  // the task's last position: keys 0 .. last
    for (int64_t t0 = 0; t0 <= last; t0 += KT) {
        const int64_t keys = last + 1 - t0 < KT ? last + 1 - t0 : KT;
        widen_tile(kf, k_cache, rows_of, row, j * head_dim, t0, keys, head_dim, wide);
        widen_tile(vf, v_cache, rows_of, row, j * head_dim, t0, keys, head_dim, wide);
        for (int64_t t = 0; t < keys; t += 4) {
            const int nt = keys - t < 4 ? (int)(keys - t) : 4;
            for (int64_t r = 0; r < rp; r += 16) {
                const float *k = kf + t * head_dim;
                float *s = st + t * rp;
#define SCORES(NT)                                                                         \
    if (r + 16 <= rp) scores_tile(k, qt, s, head_dim, rp, r, NT, 2);                      \
    else scores_tile(k, qt, s, head_dim, rp, r, NT, 1);
                switch (nt) {
                    case 4: SCORES(4) break;
                    case 3: SCORES(3) break;
                    case 2: SCORES(2) break;
                    default: SCORES(1) break;
                }
#undef SCORES
            }
        }
        // Online softmax down each row's column; key t0 + t is past row r's position where t > limit[r].
        int32_t limit[ROWS_MAX + 8];
        float tile_max[ROWS_MAX + 8];
        int32_t least = INT32_MAX;
        for (int64_t r = 0; r < rp; r++) {
            limit[r] = (int32_t)(pos[r] - t0);
            least = limit[r] < least ? limit[r] : least;
            tile_max[r] = mx[r];
        }
        const int masked = least < keys - 1;  // else every key of the tile is visible to every row
        for (int64_t t = 0; t < keys; t++) {
            const float *s = st + t * rp;
            if (masked) {
#pragma omp simd
                for (int64_t r = 0; r < rp; r++) tile_max[r] = t <= limit[r] && s[r] > tile_max[r] ? s[r] : tile_max[r];
            } else {
#pragma omp simd
                for (int64_t r = 0; r < rp; r++) tile_max[r] = s[r] > tile_max[r] ? s[r] : tile_max[r];
            }
        }
        // Key 0 is in every row's first tile, so the max is finite from then on (exp(-inf) = 0 at the
        // first tile, where the output and sum are still 0).
#pragma omp simd
        for (int64_t r = 0; r < rp; r++) {
            corr[r] = mx[r] == -INFINITY ? 0.f : vec_expf(mx[r] - tile_max[r]);
            mx[r] = tile_max[r];
            sum[r] *= corr[r];
        }
        for (int64_t t = 0; t < keys; t++) {
            float *s = st + t * rp;
            if (masked) {
#pragma omp simd
                for (int64_t r = 0; r < rp; r++) {
                    const float p = t <= limit[r] ? vec_expf(s[r] - mx[r]) : 0.f;
                    s[r] = p;
                    sum[r] += p;
                }
            } else {
#pragma omp simd
                for (int64_t r = 0; r < rp; r++) {
                    const float p = vec_expf(s[r] - mx[r]);
                    s[r] = p;
                    sum[r] += p;
                }
            }
        }
        if (t0 > 0)
            for (int64_t r = 0; r < rp; r++)
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) o[r * head_dim + d] *= corr[r];
        for (int64_t r = 0; r < rp; r += 4)  // rp is a multiple of 8
            for (int64_t d = 0; d < head_dim; d += 16) {
                if (d + 16 <= head_dim) values_tile(o, st, vf, keys, head_dim, rp, r, d, 2);
                else values_tile(o, st, vf, keys, head_dim, rp, r, d, 1);
            }
    }
    for (int64_t r = 0; r < rows; r++) {
        const float inv = 1.f / sum[r];
        const int64_t at = ((p0 + r / group) * q_heads + j * group + r % group) * head_dim;
        for (int64_t d = 0; d < head_dim; d++) {
            if (wide) store_bf16(out, at + d, o[r * head_dim + d] * inv);
            else store_f32(out, at + d, o[r * head_dim + d] * inv);
        }
    }
}

#define DEFINE_KERNEL(NAME, T, WIDE)                                                                        \
    int NAME(const T *q, const T *k_cache, const T *v_cache, const int64_t *table, T *out, int64_t count,     \
             int64_t start, int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale) { \
        const int64_t group = q_heads / kv_heads;                                                            \
        const int64_t qb = ROWS_MAX / group > 0 ? ROWS_MAX / group : 1;                                      \
        if (head_dim % 8 || group > ROWS_MAX || q_heads % kv_heads) return -1;                                \
        const int64_t blocks = (count + qb - 1) / qb, tasks = blocks * kv_heads;                             \
        const int64_t rp = (qb * group + 7) / 8 * 8;                                                         \
        const size_t floats = (size_t)(head_dim * rp + 2 * KT * head_dim + KT * rp + rp * head_dim + 5 * rp); \
        /* Each token's cache row, listed once (a 64-bit division per token costs ~40 cycles on some CPUs). */ \
        int64_t *rows_of = malloc(sizeof(int64_t) * (size_t)(start + count));                                 \
        if (!rows_of) return -2;                                                                              \
        for (int64_t t = 0; t < start + count; t++)                                                           \
            rows_of[t] = cache_row(table, t, block_size);                                                     \
        int failed = 0;                                                                                       \
        /* The last positions' tasks first: they have the most keys (causal), so threads end together. */  \
        _Pragma("omp parallel for schedule(dynamic, 1)")                                                      \
        for (int64_t i = 0; i < tasks; i++) {                                                                 \
            const int64_t block = blocks - 1 - i / kv_heads, j = i % kv_heads, p0 = block * qb;               \
            float *buffer = thread_buffer(0, sizeof(float) * floats);                                         \
            if (!buffer) {                                                                                    \
                failed = 1;                                                                                   \
                continue;                                                                                     \
            }                                                                                                 \
            attend_task(q, k_cache, v_cache, rows_of, out, start, q_heads, kv_heads, head_dim, scale, j, p0,    \
                        count - p0 < qb ? count - p0 : qb, buffer, WIDE);                                     \
        }                                                                                                     \
        free(rows_of);                                                                                        \
        return failed ? -2 : 0;                                                                               \
    }

DEFINE_KERNEL(paged_prefill_attention_f32, float, 0)
DEFINE_KERNEL(paged_prefill_attention_bf16, uint16_t, 1)

// 1 where this kernel is the better choice than torch's SDPA: CPUs without AVX-512, where torch's
// flash kernel is slow (measured on an AVX2 host); with AVX-512 or AMX torch's is kept (unmeasured).
int paged_prefill_attention_preferred(void) {
#ifdef __AVX512F__
    return 0;
#else
    return 1;
#endif
}
