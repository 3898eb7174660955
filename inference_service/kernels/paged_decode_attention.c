// Decode attention over a paged KV cache, reading each sequence's blocks where they lie.
//
// The torch path gathers every sequence's blocks into one contiguous tensor per layer and step
// and then runs SDPA over it: the K/V bytes are read twice and written once. Here the keys are
// read once for the scores and the values once for the output. Two passes with the scores kept
// (softmax from the true max, like SDPA), in fp32.
//
// A task is one sequence and a range of its KV heads: all of them when there are at least as many
// sequences as threads, so each token's [Hkv, D] row is read as one contiguous run (~1.5x faster
// than a task per head, which strides through the rows); one head each for small batches, so
// every thread has work.
//
// q [B, Hq, D], k/v caches [num_blocks, block_size, Hkv, D], tables [B, max_blocks] (int64),
// lens [B] (int64, context length incl. this step's token), out [B, Hq, D]. All contiguous.
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

// Rows of the next tokens are fetched ahead: a sequence's blocks lie anywhere in the cache, and
// without this the kernel stalled on memory (1.5x slower with cold caches, where it runs in a step).
#define PREFETCH_TOKENS 4
static inline void prefetch_bytes(const void *p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch((const char *)p + o, 0, 3);
}

// Index of token t's row in the cache: its block's index times the block size, plus its offset.
static inline int64_t cache_row(const int64_t *table, int64_t t, int64_t block_size) {
    return table[t / block_size] * block_size + t % block_size;
}

// Token t's part of its cache row (`first` elements in, `fetch_bytes` long), as a byte address;
// the same part of the row PREFETCH_TOKENS ahead is fetched on the way.
static inline const void *token_part(const void *cache, int64_t element_size, const int64_t *table, int64_t t,
                                     int64_t len, int64_t block_size, int64_t row, int64_t first,
                                     int64_t fetch_bytes) {
    const char *base = (const char *)cache + first * element_size;
    if (t + PREFETCH_TOKENS < len)
        prefetch_bytes(base + cache_row(table, t + PREFETCH_TOKENS, block_size) * row * element_size, fetch_bytes);
    return base + cache_row(table, t, block_size) * row * element_size;
}

#define DEFINE_KERNEL(NAME, T, LOAD, STORE)                                                              \
    int NAME(const T *q, const T *k_cache, const T *v_cache, const int64_t *tables, const int64_t *lens,  \
             T *out, int64_t batch, int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t block_size, \
             int64_t max_blocks, float scale) {                                                         \
        const int64_t group = q_heads / kv_heads, row = kv_heads * head_dim;                            \
        const int64_t chunks = batch >= omp_get_max_threads() ? 1 : kv_heads;                           \
        const int64_t per_chunk = kv_heads / chunks;                                                    \
        int failed = 0;                                                                                 \
        _Pragma("omp parallel for collapse(2) schedule(dynamic, 1)")                                    \
        for (int64_t b = 0; b < batch; b++) {                                                           \
            for (int64_t c = 0; c < chunks; c++) {                                                      \
                const int64_t len = lens[b], h0 = c * per_chunk * group, nh = per_chunk * group;        \
                const int64_t first = c * per_chunk * head_dim;                                         \
                const int64_t fetch_bytes = per_chunk * head_dim * (int64_t)sizeof(T);                  \
                const int64_t *table = tables + b * max_blocks;                                         \
                float *scores = malloc(sizeof(float) * (size_t)(nh * (len > 0 ? len : 1)));             \
                float *acc = calloc((size_t)(nh * head_dim), sizeof(float));                            \
                float *qs = malloc(sizeof(float) * (size_t)(nh * head_dim));                            \
                float *kf = malloc(sizeof(float) * (size_t)(per_chunk * head_dim));                     \
                if (!scores || !acc || !qs || !kf) {                                                    \
                    free(scores); free(acc); free(qs); free(kf);                                        \
                    failed = 1;                                                                         \
                    continue;                                                                           \
                }                                                                                       \
                for (int64_t i = 0; i < nh * head_dim; i++)                                             \
                    qs[i] = LOAD(q, (b * q_heads + h0) * head_dim + i) * scale;                         \
                for (int64_t t = 0; t < len; t++) {                                                     \
                    const T *k = token_part(k_cache, sizeof(T), table, t, len, block_size, row, first,  \
                                            fetch_bytes);                                               \
                    /* The token's K part widened once, not once per query head of its group. */        \
                    _Pragma("omp simd")                                                                 \
                    for (int64_t i = 0; i < per_chunk * head_dim; i++) kf[i] = LOAD(k, i);              \
                    for (int64_t h = 0; h < nh; h++) {                                                  \
                        const float *kh = kf + (h / group) * head_dim;                                  \
                        const float *qh = qs + h * head_dim;                                            \
                        float s = 0.f;                                                                  \
                        _Pragma("omp simd reduction(+:s)")                                              \
                        for (int64_t d = 0; d < head_dim; d++) s += qh[d] * kh[d];                      \
                        scores[h * len + t] = s;                                                        \
                    }                                                                                   \
                }                                                                                       \
                for (int64_t h = 0; h < nh; h++) {                                                      \
                    float *sh = scores + h * len, mx = -INFINITY, sum = 0.f;                            \
                    _Pragma("omp simd reduction(max:mx)")                                               \
                    for (int64_t t = 0; t < len; t++) mx = sh[t] > mx ? sh[t] : mx;                     \
                    _Pragma("omp simd reduction(+:sum)")                                                \
                    for (int64_t t = 0; t < len; t++) { sh[t] = vec_expf(sh[t] - mx); sum += sh[t]; }       \
                    const float inv = sum > 0.f ? 1.f / sum : 0.f;                                      \
                    _Pragma("omp simd")                                                                 \
                    for (int64_t t = 0; t < len; t++) sh[t] *= inv;                                     \
                }                                                                                       \
                for (int64_t t = 0; t < len; t++) {                                                     \
                    const T *v = token_part(v_cache, sizeof(T), table, t, len, block_size, row, first,  \
                                            fetch_bytes);                                               \
                    for (int64_t h = 0; h < nh; h++) {                                                  \
                        const T *vh = v + (h / group) * head_dim;                                       \
                        float *ah = acc + h * head_dim;                                                 \
                        const float p = scores[h * len + t];                                            \
                        _Pragma("omp simd")                                                             \
                        for (int64_t d = 0; d < head_dim; d++) ah[d] += p * LOAD(vh, d);                \
                    }                                                                                   \
                }                                                                                       \
                for (int64_t i = 0; i < nh * head_dim; i++) STORE(out, (b * q_heads + h0) * head_dim + i, acc[i]); \
                free(scores); free(acc); free(qs); free(kf);                                            \
            }                                                                                           \
        }                                                                                               \
        return failed ? -2 : 0;                                                                         \
    }

DEFINE_KERNEL(paged_decode_attention_f32, float, load_f32, store_f32)
DEFINE_KERNEL(paged_decode_attention_bf16, uint16_t, load_bf16, store_bf16)
