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
// every thread has work. Threads take tasks in turn as they free up, each holding the one it takes
// next and fetching that one's rows while it computes (NextTask).
//
// q [B, Hq, D], k/v caches [num_blocks, block_size, Hkv, D], tables [B, max_blocks] (int64),
// lens [B] (int64, context length incl. this step's token), out [B, Hq, D]. All contiguous.
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "kernels.h"
#include "vec8.h"

// Rows of the next tokens are fetched ahead: a sequence's blocks lie anywhere in the cache, and
// without this the kernel stalled on memory (1.5x slower with cold caches, where it runs in a step).
#define PREFETCH_TOKENS 4
static inline void prefetch_bytes(const void *p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch((const char *)p + o, 0, 3);
}

// A task's K and V rows are also all asked for into L2 when it starts, up to this many bytes: a decode
// step's cache is far larger than the L3 and its blocks lie anywhere, so rows asked for only
// PREFETCH_TOKENS ahead arrive one latency after another. All at once, the memory system fetches them
// side by side (SmolLM2, 32 sequences of 64 tokens, 30 layers' caches: 237-261 -> 130 us a layer on
// 2 threads; no change with the caches hot).
#define PREFETCH_TASK_BYTES (256 << 10)
static inline void prefetch_task(const char *k_part, const char *v_part, const int64_t *rows, int64_t len,
                                 int64_t row_bytes, int64_t fetch_bytes) {
    const int64_t tokens = PREFETCH_TASK_BYTES / (2 * fetch_bytes);
    for (int64_t t = 0; t < len && t < tokens; t++)
        for (int64_t o = 0; o < fetch_bytes; o += 64) {
            __builtin_prefetch(k_part + rows[t] * row_bytes + o, 0, 2);
            __builtin_prefetch(v_part + rows[t] * row_bytes + o, 0, 2);
        }
}

// The K and V rows of the task a thread takes next, asked for a few lines at a time while it computes
// this one (`next_task_fetch` in the loops below; where a task is a whole sequence). A task's up-front
// prefetch_task is one burst: the core stalls once its misses in flight are full, and then computes
// with the memory idle; spread over the compute, the next task's reads overlap it. SmolLM2, 32
// sequences of 80 tokens, 30 layers' caches, 2 threads of an AMD Zen 4: bf16 117-131 -> 82-91 us a
// layer, the AVX2 build's 163 -> 112, fp32 285 -> 214 (400 tokens: 707 -> 576); 3-5% slower with the
// caches hot, where the fetches find the rows already there.
typedef struct {
    const char *k, *v;     // the caches
    const int64_t *table;  // the next task's block table; NULL: nothing (left) to fetch
    int64_t blocks, block_bytes, last_bytes, block;
    int64_t at, end;  // the byte offset of the next line in both caches, and of its block's end
} NextTask;

// The next block's span of the task's rows (the last block only partly filled), or table NULL.
static inline void next_task_block(NextTask *n) {
    if (n->block == n->blocks) {
        n->table = NULL;
        return;
    }
    n->at = n->table[n->block] * n->block_bytes;
    n->end = n->at + (n->block + 1 < n->blocks ? n->block_bytes : n->last_bytes);
    n->block++;
}

static inline NextTask next_task(const void *k_cache, const void *v_cache, const int64_t *table, int64_t len,
                                 int64_t block_size, int64_t row_bytes) {
    const int64_t blocks = len > 0 ? (len + block_size - 1) / block_size : 0;
    NextTask n = {(const char *)k_cache, (const char *)v_cache, table, blocks, block_size * row_bytes,
                  blocks ? (len - (blocks - 1) * block_size) * row_bytes : 0, 0, 0, 0};
    next_task_block(&n);
    return n;
}

// `steps` lines of the next task's K rows and as many of its V rows.
static inline __attribute__((always_inline)) void next_task_fetch(NextTask *n, int steps) {
    for (int i = 0; i < steps && n->table; i++) {
        __builtin_prefetch(n->k + n->at, 0, 3);
        __builtin_prefetch(n->v + n->at, 0, 3);
        if ((n->at += 64) >= n->end) next_task_block(n);
    }
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

// As token_part, from the sequence's cache rows listed once (`rows` [len]): one division and
// remainder by the block size per token, not four (each token and its prefetch, in both passes);
// 64-bit divides take ~40 cycles on some CPUs (AMD Zen 1).
static inline const void *listed_token_part(const void *cache, int64_t element_size, const int64_t *rows,
                                            int64_t t, int64_t len, int64_t row, int64_t first, int64_t fetch_bytes) {
    const char *base = (const char *)cache + first * element_size;
    if (t + PREFETCH_TOKENS < len) prefetch_bytes(base + rows[t + PREFETCH_TOKENS] * row * element_size, fetch_bytes);
    return base + rows[t] * row * element_size;
}

// The vector path, for head_dim a multiple of 8 (GCC/Clang vector extensions: AVX2's ymm, two SSE or
// NEON registers). The scalar path's dot product, one `omp simd` reduction, was one chain of
// dependent FMAs, nine of them per token for SmolLM2's query heads, and its P.V kept the output in
// memory, a load and a store per 8 products: on an AVX2 CPU it ran at 3-6 GB/s of KV. Here the query
// heads of a KV head (up to 4 at a time) share each K and V load, read straight from the cache
// (bf16 widened in registers), and P.V sums each 16 output dims of those heads in registers over
// all the tokens.
static inline float hsum8(vf8 v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

// scores[j * len + t] = qs[j] . k for NB heads (qs [NB, D] fp32; k: the cache's D elements).
static inline __attribute__((always_inline)) void dots8(const float *qs, const char *k, int64_t d_len, float *scores,
                                                        int64_t len, int64_t t, const int nb, const int wide) {
    const int64_t elem = wide ? 2 : 4;
    vf8 acc[4][2];
    for (int j = 0; j < nb; j++) acc[j][0] = acc[j][1] = (vf8){0};
    int64_t d = 0;
    for (; d + 16 <= d_len; d += 16) {
        const vf8 k0 = cache8(k + d * elem, wide), k1 = cache8(k + (d + 8) * elem, wide);
        for (int j = 0; j < nb; j++) {
            acc[j][0] += load8(qs + j * d_len + d) * k0;
            acc[j][1] += load8(qs + j * d_len + d + 8) * k1;
        }
    }
    if (d < d_len) {
        const vf8 k0 = cache8(k + d * elem, wide);
        for (int j = 0; j < nb; j++) acc[j][0] += load8(qs + j * d_len + d) * k0;
    }
    for (int j = 0; j < nb; j++) scores[j * len + t] = hsum8(acc[j][0] + acc[j][1]);
}

// out [NB, D] = sum over tokens t of p[j * len + t] * V_t for NB heads sharing one KV head, whose
// part of token t's cache row starts at v_base + rows[t] * row_bytes.
static inline __attribute__((always_inline)) void pv8(float *out, const float *p, int64_t len, const char *v_base,
                                                      const int64_t *rows, int64_t row_bytes, int64_t d_len,
                                                      const int nb, const int wide, NextTask *next) {
    const int64_t elem = wide ? 2 : 4;
    for (int64_t d = 0; d < d_len; d += 16) {
        const int pair = d + 16 <= d_len;  // else a last 8
        vf8 acc[4][2];
        for (int j = 0; j < nb; j++) acc[j][0] = acc[j][1] = (vf8){0};
        for (int64_t t = 0; t < len; t++) {
            const char *v = v_base + rows[t] * row_bytes + d * elem;
            if (d == 0 && t + PREFETCH_TOKENS < len)  // the first pass reads V from memory
                prefetch_bytes(v_base + rows[t + PREFETCH_TOKENS] * row_bytes, d_len * elem);
            if (d == 0) next_task_fetch(next, wide ? 1 : 2);
            const vf8 v0 = cache8(v, wide), v1 = pair ? cache8(v + 8 * elem, wide) : (vf8){0};
            for (int j = 0; j < nb; j++) {
                const float pj = p[j * len + t];
                acc[j][0] += pj * v0;
                acc[j][1] += pj * v1;
            }
        }
        for (int j = 0; j < nb; j++) {
            store8(out + j * d_len + d, acc[j][0]);
            if (pair) store8(out + j * d_len + d + 8, acc[j][1]);
        }
    }
}

// The `group` heads of one KV head, 4 at a time: NB must be a constant in dots8 and pv8.
#define BY_FOURS(CALL)                                                           \
    do {                                                                         \
        int64_t j = 0;                                                           \
        for (; j + 4 <= group; j += 4) CALL(4);                                  \
        switch (group - j) {                                                     \
            case 3: CALL(3); break;                                              \
            case 2: CALL(2); break;                                              \
            case 1: CALL(1); break;                                              \
            default: break;                                                      \
        }                                                                        \
    } while (0)

// Scores [group, len] and out [group, D] of the query heads qs [group, D] of one KV head, whose part
// of each cache row starts `first` elements in.
static inline __attribute__((always_inline)) void group_scores(const float *qs, const void *k_cache, const int64_t *rows,
                                                               int64_t len, int64_t row, int64_t first, int64_t d_len,
                                                               int64_t group, float *scores, const int wide,
                                                               NextTask *next) {
    const int64_t elem = wide ? 2 : 4;
    for (int64_t t = 0; t < len; t++) {
        const char *k = listed_token_part(k_cache, elem, rows, t, len, row, first, d_len * elem);
        next_task_fetch(next, wide ? 1 : 2);
#define DOTS(NB) dots8(qs + j * d_len, k, d_len, scores + j * len, len, t, NB, wide)
        BY_FOURS(DOTS);
#undef DOTS
    }
}

static inline __attribute__((always_inline)) void group_values(float *out, const float *scores, const void *v_cache,
                                                               const int64_t *rows, int64_t len, int64_t row,
                                                               int64_t first, int64_t d_len, int64_t group,
                                                               const int wide, NextTask *next) {
    const int64_t elem = wide ? 2 : 4;
    const char *v_base = (const char *)v_cache + first * elem;
#define PV(NB) pv8(out + j * d_len, scores + j * len, len, v_base, rows, row * elem, d_len, NB, wide, next)
    BY_FOURS(PV);
#undef PV
}

// bf16 caches on CPUs with AVX-512 BF16 (head_dim a multiple of 32, at most 128): the portable
// path's 8-float vectors spent most of their time in per-token horizontal sums (one per query head and
// token) and in re-widening V for every 16 output dims. Here
//   scores  per query head, 16 tokens at a time: each token's q . k as `vdpbf16ps` products of the
//           bf16 q and K (exact products, summed in fp32) into a vector per token, then the 16 vectors
//           summed across their lanes together (common.h's lanes_reduced16), scaled;
//   P V     per KV head, up to 4 of its query heads' fp32 sums held in registers while each token's V
//           row is widened once.
// SmolLM2, 32 sequences of 64 tokens on 2 threads of an AMD Zen 4: 77-99 -> 56 us a layer, caches hot.
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define BF16_DOTS 1
#define DOTS_MAX_DIM 128
#define DOTS_FIT(WIDE, D) ((WIDE) && (D) % 32 == 0 && (D) <= DOTS_MAX_DIM)

// scores[t] = scale x (q . K_t) for one query head (q: D bf16) over the tokens of `rows`, whose part of
// each cache row starts at k_base.
static inline __attribute__((always_inline)) void head_scores_bf16(const uint16_t *q, const uint16_t *k_base,
                                                                   const int64_t *rows, int64_t len, int64_t row,
                                                                   const int pairs_vectors, float scale,
                                                                   float *scores, NextTask *next) {
    __m512bh qv[DOTS_MAX_DIM / 32];
    for (int i = 0; i < pairs_vectors; i++) qv[i] = (__m512bh)_mm512_loadu_si512(q + 32 * i);
    for (int64_t t0 = 0; t0 < len; t0 += 16) {
        const int64_t count = len - t0 < 16 ? len - t0 : 16;
        next_task_fetch(next, 4);
        __m512 acc[16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) {
            acc[i] = _mm512_setzero_ps();
            if (i < count) {
                const uint16_t *k = k_base + rows[t0 + i] * row;
                for (int j = 0; j < pairs_vectors; j++)
                    acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_loadu_si512(k + 32 * j), qv[j]);
            }
        }
        const __m512 sums = _mm512_mul_ps(lanes_reduced16(acc, LANES_ADD), _mm512_set1_ps(scale));
        _mm512_mask_storeu_ps(scores + t0, (__mmask16)((1u << count) - 1), sums);
    }
}

// out[g] (D fp32) = sum over tokens of p[g * len + t] x V_t, for `heads` (<= 4) query heads of one KV
// head whose part of each cache row starts at v_base; D/16 vectors a head.
static inline __attribute__((always_inline)) void heads_values_bf16(float *out, const float *p, int64_t len,
                                                                    const uint16_t *v_base, const int64_t *rows,
                                                                    int64_t row, const int vectors,
                                                                    const int heads, NextTask *next) {
    __m512 acc[4][DOTS_MAX_DIM / 16];
    for (int g = 0; g < heads; g++)
        for (int d = 0; d < vectors; d++) acc[g][d] = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; t++) {
        const uint16_t *v = v_base + rows[t] * row;
        if (t + PREFETCH_TOKENS < len) prefetch_bytes(v_base + rows[t + PREFETCH_TOKENS] * row, 2 * 16 * vectors);
        next_task_fetch(next, 1);
        __m512 vv[DOTS_MAX_DIM / 16];
        for (int d = 0; d < vectors; d++) vv[d] = widen16_bf16(v + 16 * d);
        for (int g = 0; g < heads; g++) {
            const __m512 pg = _mm512_set1_ps(p[g * len + t]);
            for (int d = 0; d < vectors; d++) acc[g][d] = _mm512_fmadd_ps(pg, vv[d], acc[g][d]);
        }
    }
    for (int g = 0; g < heads; g++)
        for (int d = 0; d < vectors; d++) _mm512_storeu_ps(out + g * 16 * vectors + 16 * d, acc[g][d]);
}

// The `group` heads of one KV head against V, in fours (8 vectors of sums, or 16 for 128 dims, stay in
// registers: 128 dims take two heads at a time).
static void group_values_bf16(float *out, const float *p, int64_t len, const uint16_t *v_base, const int64_t *rows,
                              int64_t row, int64_t head_dim, int64_t group, NextTask *next) {
    const int vectors = (int)(head_dim / 16), step = head_dim <= 64 ? 4 : 2;
    for (int64_t g = 0; g < group; g += step) {
        const int heads = (int)(group - g < step ? group - g : step);
        float *o = out + g * head_dim;
        const float *pg = p + g * len;
#define VALUES(V, H) heads_values_bf16(o, pg, len, v_base, rows, row, V, H, next)
        if (vectors == 2) { if (heads >= 4) VALUES(2, 4); else if (heads == 3) VALUES(2, 3); else if (heads == 2) VALUES(2, 2); else VALUES(2, 1); }
        else if (vectors == 4) { if (heads >= 4) VALUES(4, 4); else if (heads == 3) VALUES(4, 3); else if (heads == 2) VALUES(4, 2); else VALUES(4, 1); }
        else if (vectors == 6) { if (heads >= 2) VALUES(6, 2); else VALUES(6, 1); }
        else { if (heads >= 2) VALUES(8, 2); else VALUES(8, 1); }
#undef VALUES
    }
}

static void scores_bf16(const uint16_t *q, const uint16_t *k_base, const int64_t *rows, int64_t len, int64_t row,
                        int64_t head_dim, int64_t heads, float scale, float *scores, NextTask *next) {
    for (int64_t h = 0; h < heads; h++) {
        const uint16_t *qh = q + h * head_dim;
        float *sh = scores + h * len;
        switch (head_dim / 32) {  // each a constant, so the vectors stay in registers
            case 1: head_scores_bf16(qh, k_base, rows, len, row, 1, scale, sh, next); break;
            case 2: head_scores_bf16(qh, k_base, rows, len, row, 2, scale, sh, next); break;
            case 3: head_scores_bf16(qh, k_base, rows, len, row, 3, scale, sh, next); break;
            default: head_scores_bf16(qh, k_base, rows, len, row, 4, scale, sh, next); break;
        }
    }
}
#else
#define DOTS_FIT(WIDE, D) 0
static void group_values_bf16(float *out, const float *p, int64_t len, const uint16_t *v_base, const int64_t *rows,
                              int64_t row, int64_t head_dim, int64_t group, NextTask *next) {
    (void)out, (void)p, (void)len, (void)v_base, (void)rows, (void)row, (void)head_dim, (void)group, (void)next;
}
static void scores_bf16(const uint16_t *q, const uint16_t *k_base, const int64_t *rows, int64_t len, int64_t row,
                        int64_t head_dim, int64_t heads, float scale, float *scores, NextTask *next) {
    (void)q, (void)k_base, (void)rows, (void)len, (void)row, (void)head_dim, (void)heads, (void)scale, (void)scores;
    (void)next;
}
#endif

#define DEFINE_KERNEL(NAME, T, LOAD, STORE, WIDE)                                                              \
    int NAME(const T *q, const T *k_cache, const T *v_cache, const int64_t *tables, const int64_t *lens,  \
             T *out, int64_t batch, int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t block_size, \
             int64_t max_blocks, float scale) {                                                         \
        const int64_t group = q_heads / kv_heads, row = kv_heads * head_dim;                            \
        const int64_t chunks = batch >= omp_get_max_threads() ? 1 : kv_heads;                           \
        const int64_t per_chunk = kv_heads / chunks;                                                    \
        int failed = 0;                                                                                 \
        /* Tasks taken one at a time as threads free up (sequences differ in length). Where a task is  \
           a sequence, a thread also holds the one it takes next, whose rows it fetches meanwhile       \
           (NextTask), while more are left than threads to share them: 2 sequences on 2 threads each    \
           take one. */                                                                                 \
        const int64_t tasks = batch * chunks;                                                           \
        int64_t taken = 0;                                                                              \
        _Pragma("omp parallel")                                                                         \
        for (int64_t task = __atomic_fetch_add(&taken, 1, __ATOMIC_RELAXED), ahead = tasks; task < tasks; \
             task = ahead < tasks ? ahead : __atomic_fetch_add(&taken, 1, __ATOMIC_RELAXED), ahead = tasks) { \
            if (chunks == 1 && __atomic_load_n(&taken, __ATOMIC_RELAXED) + omp_get_num_threads() <= tasks) \
                ahead = __atomic_fetch_add(&taken, 1, __ATOMIC_RELAXED);                                \
            {                                                                                           \
                const int64_t b = task / chunks, c = task % chunks;                                     \
                NextTask next = {0};                                                                    \
                if (ahead < tasks) /* a task per sequence: its whole rows */                           \
                    next = next_task(k_cache, v_cache, tables + ahead * max_blocks, lens[ahead], block_size, \
                                     row * (int64_t)sizeof(T));                                         \
                const int64_t len = lens[b], h0 = c * per_chunk * group, nh = per_chunk * group;        \
                const int64_t first = c * per_chunk * head_dim;                                         \
                const int64_t fetch_bytes = per_chunk * head_dim * (int64_t)sizeof(T);                  \
                const int64_t *table = tables + b * max_blocks;                                         \
                float *scores = malloc(sizeof(float) * (size_t)(nh * (len > 0 ? len : 1)));             \
                /* The vector path writes every output sum and widens K in registers: no zeroing, no kf. */ \
                const int vector = head_dim % 8 == 0;                                                   \
                float *acc = vector ? malloc(sizeof(float) * (size_t)(nh * head_dim))                   \
                                    : calloc((size_t)(nh * head_dim), sizeof(float));                   \
                float *qs = malloc(sizeof(float) * (size_t)(nh * head_dim));                            \
                float *kf = malloc(sizeof(float) * (size_t)(vector ? 1 : per_chunk * head_dim));        \
                int64_t *rows = malloc(sizeof(int64_t) * (size_t)(len > 0 ? len : 1));                  \
                if (!scores || !acc || !qs || !kf || !rows) {                                           \
                    free(scores); free(acc); free(qs); free(kf); free(rows);                            \
                    failed = 1;                                                                         \
                    continue;                                                                           \
                }                                                                                       \
                for (int64_t t = 0; t < len; t++) rows[t] = cache_row(table, t, block_size);            \
                prefetch_task((const char *)(k_cache + first), (const char *)(v_cache + first), rows, len, \
                              row * (int64_t)sizeof(T), fetch_bytes);                                   \
                for (int64_t i = 0; i < (DOTS_FIT(WIDE, head_dim) ? 0 : nh * head_dim); i++) /* q as is */ \
                    qs[i] = LOAD(q, (b * q_heads + h0) * head_dim + i) * scale;                         \
                if (DOTS_FIT(WIDE, head_dim)) {                                                         \
                    for (int64_t g = 0; g < per_chunk; g++)                                             \
                        scores_bf16((const uint16_t *)q + (b * q_heads + h0 + g * group) * head_dim,    \
                                    (const uint16_t *)k_cache + first + g * head_dim, rows, len, row,   \
                                    head_dim, group, scale, scores + g * group * len, &next);           \
                } else if (vector) {                                                                    \
                    for (int64_t g = 0; g < per_chunk; g++)                                             \
                        group_scores(qs + g * group * head_dim, k_cache, rows, len, row, first + g * head_dim, \
                                     head_dim, group, scores + g * group * len, WIDE, &next);           \
                } else                                                                                  \
                for (int64_t t = 0; t < len; t++) {                                                     \
                    const T *k = listed_token_part(k_cache, sizeof(T), rows, t, len, row, first,       \
                                                   fetch_bytes);                                        \
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
                    next_task_fetch(&next, 4);                                                          \
                    float *sh = scores + h * len, mx = -INFINITY, sum = 0.f;                            \
                    _Pragma("omp simd reduction(max:mx)")                                               \
                    for (int64_t t = 0; t < len; t++) mx = sh[t] > mx ? sh[t] : mx;                     \
                    _Pragma("omp simd reduction(+:sum)")                                                \
                    for (int64_t t = 0; t < len; t++) { sh[t] = vec_expf(sh[t] - mx); sum += sh[t]; }       \
                    const float inv = sum > 0.f ? 1.f / sum : 0.f;                                      \
                    _Pragma("omp simd")                                                                 \
                    for (int64_t t = 0; t < len; t++) sh[t] *= inv;                                     \
                }                                                                                       \
                if (DOTS_FIT(WIDE, head_dim)) {                                                         \
                    for (int64_t g = 0; g < per_chunk; g++)                                             \
                        group_values_bf16(acc + g * group * head_dim, scores + g * group * len, len,     \
                                          (const uint16_t *)v_cache + first + g * head_dim, rows, row,  \
                                          head_dim, group, &next);                                       \
                } else if (vector) {                                                                    \
                    for (int64_t g = 0; g < per_chunk; g++)                                             \
                        group_values(acc + g * group * head_dim, scores + g * group * len, v_cache, rows, len, \
                                     row, first + g * head_dim, head_dim, group, WIDE, &next);          \
                } else                                                                                  \
                for (int64_t t = 0; t < len; t++) {                                                     \
                    const T *v = listed_token_part(v_cache, sizeof(T), rows, t, len, row, first,       \
                                                   fetch_bytes);                                        \
                    for (int64_t h = 0; h < nh; h++) {                                                  \
                        const T *vh = v + (h / group) * head_dim;                                       \
                        float *ah = acc + h * head_dim;                                                 \
                        const float p = scores[h * len + t];                                            \
                        _Pragma("omp simd")                                                             \
                        for (int64_t d = 0; d < head_dim; d++) ah[d] += p * LOAD(vh, d);                \
                    }                                                                                   \
                }                                                                                       \
                for (int64_t i = 0; i < nh * head_dim; i++) STORE(out, (b * q_heads + h0) * head_dim + i, acc[i]); \
                free(scores); free(acc); free(qs); free(kf); free(rows);                                \
            }                                                                                           \
        }                                                                                               \
        return failed ? -2 : 0;                                                                         \
    }

DEFINE_KERNEL(paged_decode_attention_f32, float, load_f32, store_f32, 0)
DEFINE_KERNEL(paged_decode_attention_bf16, uint16_t, load_bf16, store_bf16, 1)

// bf16 on CPUs with AMX (head_dim 64 or 128, at most 64 query heads, blocks of a divisor of 16 tokens
// or a multiple of 16: `paged_decode_attention_bf16_amx_fits`). A task is one sequence, as above.
//   scores  S [tokens, heads]: per KV head, 16 cached tokens against its query group in one tile
//           product, S^T = K Q^T, K's tile loaded from the cache rows in place (a block's tokens are
//           consecutive rows; a tile never crosses a block) and Q^T packed once into AMX's pairs;
//   softmax down each head's column, 16 heads a vector;
//   P V     per KV head, its group's sums held in registers while its tokens' V rows stream by.
// The portable kernel spent ~60% of a batch-32 step's attention on per-token dot products and
// their horizontal sums, and the rest re-reading and re-widening V per query head.
#ifdef LORAPLEX_AMX

int paged_decode_attention_bf16_amx_fits(int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t block_size) {
    const int64_t group = q_heads / kv_heads;
    return (head_dim == 64 || head_dim == 128) && q_heads <= 64 && group >= 1 && group <= 16 &&
           (16 % block_size == 0 || block_size % 16 == 0) && amx_permitted();
}

// P V for `heads` (<= GB) query heads of one KV head, HD-wide: sums in registers over the tokens.
#define PV_HEADS(HD, GB)                                                                                  \
    static void pv_##HD##_##GB(const uint16_t *v_cache, const int64_t *table, int64_t len, int64_t block_size, \
                               int64_t row, int64_t j, const float *probs, int64_t lanes, int64_t h0,      \
                               int heads, float *acc) {                                                    \
        __m512 s[GB][HD / 16];                                                                             \
        for (int g = 0; g < GB; g++)                                                                       \
            for (int d = 0; d < HD / 16; d++) s[g][d] = _mm512_setzero_ps();                               \
        for (int64_t t = 0; t < len; t++) {                                                                \
            const uint16_t *v = token_part(v_cache, 2, table, t, len, block_size, row, j * HD, HD * 2);    \
            __m512 vv[HD / 16];                                                                            \
            for (int d = 0; d < HD / 16; d++) vv[d] = widen16_bf16(v + 16 * d);                                 \
            for (int g = 0; g < GB; g++) {                                                                 \
                if (g >= heads) break;                                                                     \
                const __m512 p = _mm512_set1_ps(probs[t * lanes + h0 + g]);                                \
                for (int d = 0; d < HD / 16; d++) s[g][d] = _mm512_fmadd_ps(p, vv[d], s[g][d]);            \
            }                                                                                              \
        }                                                                                                  \
        for (int g = 0; g < heads; g++)                                                                    \
            for (int d = 0; d < HD / 16; d++) _mm512_storeu_ps(acc + g * HD + 16 * d, s[g][d]);            \
    }
PV_HEADS(64, 4)
PV_HEADS(128, 2)

int paged_decode_attention_bf16_amx(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                                    const int64_t *tables, const int64_t *lens, uint16_t *out, int64_t batch,
                                    int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                                    int64_t max_blocks, float scale) {
    const int64_t group = q_heads / kv_heads, row = kv_heads * head_dim, slices = head_dim / 32;
    const int64_t tile_rows = block_size < 16 ? block_size : 16, lanes = (q_heads + 15) / 16 * 16;
    int64_t max_len = 1;
    for (int64_t b = 0; b < batch; b++) max_len = lens[b] > max_len ? lens[b] : max_len;
    const int64_t padded = (max_len + 15) / 16 * 16;
    int failed = 0;
#pragma omp parallel
    {
        tile_config cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        cfg.rows[0] = (uint8_t)tile_rows, cfg.colsb[0] = (uint16_t)(group * 4);  // S^T [tokens, group]
        cfg.rows[1] = (uint8_t)tile_rows, cfg.colsb[1] = 64;                     // K [tokens, 32 of D]
        cfg.rows[2] = 16, cfg.colsb[2] = (uint16_t)(group * 4);                 // Q^T [16 pairs, group x 2]
        _tile_loadconfig(&cfg);
        uint32_t *qt = aligned_alloc(64, sizeof(uint32_t) * (size_t)(slices * 16 * q_heads + 16));
        float *probs = aligned_alloc(64, sizeof(float) * (size_t)(padded * lanes));
        float *acc = aligned_alloc(64, sizeof(float) * (size_t)(q_heads * head_dim));
        const int ok = qt && probs && acc;
        if (!ok) failed = 1;
        // Guided, not one sequence each in turn: a thread's run of consecutive sequences reads blocks
        // that were mostly allocated together (30 layers at batch 32: 2.31-2.37 -> 2.14-2.19 ms).
#pragma omp for schedule(guided)
        for (int64_t b = 0; b < (ok ? batch : 0); b++) {
            const int64_t len = lens[b];
            const int64_t *table = tables + b * max_blocks;
            if (len <= 0) {
                memset(out + b * q_heads * head_dim, 0, sizeof(uint16_t) * (size_t)(q_heads * head_dim));
                continue;
            }
            // Q^T pairs per KV head: word (j, s, p, g) = query head j·group + g's dims 32 s + 2 p, +1.
            const uint32_t *qw = (const uint32_t *)(q + b * q_heads * head_dim);
            for (int64_t j = 0; j < kv_heads; j++)
                for (int64_t s = 0; s < slices; s++)
                    for (int64_t p = 0; p < 16; p++)
                        for (int64_t g = 0; g < group; g++)
                            qt[((j * slices + s) * 16 + p) * group + g] = qw[(j * group + g) * head_dim / 2 + s * 16 + p];
            // V's rows asked into L2 now, to arrive while the scores run: P V's own prefetch runs only
            // PREFETCH_TOKENS rows ahead of a loop that does a few FMAs a row (30 layers at batch 32:
            // 2.27-2.30 -> 1.99-2.20 ms; K's rows asked for the same way gained nothing).
            for (int64_t t = 0; t < len; t += block_size) {
                const char *vb = (const char *)(v_cache + table[t / block_size] * block_size * row);
                const int64_t n = (len - t < block_size ? len - t : block_size) * row * 2;
                for (int64_t o = 0; o < n; o += 64) _mm_prefetch(vb + o, _MM_HINT_T1);
            }
            for (int64_t t0 = 0; t0 < len; t0 += tile_rows) {
                const int64_t first_row = table[t0 / block_size] * block_size + t0 % block_size;
                if (t0 + tile_rows < len) {  // the next tile's K rows
                    const int64_t next = table[(t0 + tile_rows) / block_size] * block_size + (t0 + tile_rows) % block_size;
                    prefetch_bytes(k_cache + next * row, tile_rows * row * 2);
                }
                for (int64_t j = 0; j < kv_heads; j++) {
                    const uint16_t *k = k_cache + first_row * row + j * head_dim;
                    _tile_zero(0);
                    for (int64_t s = 0; s < slices; s++) {
                        _tile_loadd(1, k + s * 32, row * 2);
                        _tile_loadd(2, qt + (j * slices + s) * 16 * group, group * 4);
                        _tile_dpbf16ps(0, 1, 2);
                    }
                    _tile_stored(0, probs + t0 * lanes + j * group, lanes * 4);
                }
            }
            // Softmax down each head's column, the heads side by side in a vector (lanes past
            // q_heads are unused).
            for (int64_t l = 0; l < lanes; l += 16) {
                float mx[16], sum[16] = {0};
#pragma omp simd
                for (int h = 0; h < 16; h++) mx[h] = -INFINITY;
                for (int64_t t = 0; t < len; t++) {
                    float *st = probs + t * lanes + l;
#pragma omp simd
                    for (int h = 0; h < 16; h++) mx[h] = st[h] * scale > mx[h] ? st[h] * scale : mx[h];
                }
                for (int64_t t = 0; t < len; t++) {
                    float *st = probs + t * lanes + l;
#pragma omp simd
                    for (int h = 0; h < 16; h++) {
                        st[h] = vec_expf(st[h] * scale - mx[h]);
                        sum[h] += st[h];
                    }
                }
#pragma omp simd
                for (int h = 0; h < 16; h++) sum[h] = 1.f / sum[h];
                for (int64_t t = 0; t < len; t++) {
                    float *st = probs + t * lanes + l;
#pragma omp simd
                    for (int h = 0; h < 16; h++) st[h] *= sum[h];
                }
            }
            for (int64_t j = 0; j < kv_heads; j++) {
                const int gb = head_dim == 64 ? 4 : 2;
                for (int64_t g0 = 0; g0 < group; g0 += gb) {
                    const int heads = (int)(group - g0 < gb ? group - g0 : gb);
                    float *a = acc + (j * group + g0) * head_dim;
                    if (head_dim == 64)
                        pv_64_4(v_cache, table, len, block_size, row, j, probs, lanes, j * group + g0, heads, a);
                    else
                        pv_128_2(v_cache, table, len, block_size, row, j, probs, lanes, j * group + g0, heads, a);
                }
            }
            for (int64_t i = 0; i < q_heads * head_dim; i += 16) {
                const __m256bh r = _mm512_cvtneps_pbh(_mm512_load_ps(acc + i));
                memcpy(out + b * q_heads * head_dim + i, &r, sizeof r);
            }
        }
        _tile_release();
        free(qt), free(probs), free(acc);
    }
    return failed ? -2 : 0;
}
#else
int paged_decode_attention_bf16_amx_fits(int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t block_size) {
    (void)q_heads, (void)kv_heads, (void)head_dim, (void)block_size;
    return 0;
}
int paged_decode_attention_bf16_amx(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                                    const int64_t *tables, const int64_t *lens, uint16_t *out, int64_t batch,
                                    int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                                    int64_t max_blocks, float scale) {
    (void)q, (void)k_cache, (void)v_cache, (void)tables, (void)lens, (void)out, (void)batch, (void)q_heads;
    (void)kv_heads, (void)head_dim, (void)block_size, (void)max_blocks, (void)scale;
    return -3;
}
#endif
