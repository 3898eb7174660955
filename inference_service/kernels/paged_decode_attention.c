// Decode attention over a paged KV cache, reading each sequence's blocks where they lie.
//
// The torch path gathers every sequence's blocks into one contiguous tensor per layer and step
// and then runs SDPA over it: the K/V bytes are read twice and written once. Here each
// (sequence, KV head) reads its keys once for the scores and its values once for the output.
// Two passes with the scores kept per query head (softmax from the true max, like SDPA), in fp32.
//
// q [B, Hq, D], k/v caches [num_blocks, block_size, Hkv, D], tables [B, max_blocks] (int64),
// lens [B] (int64, context length incl. this step's token), out [B, Hq, D]. All contiguous.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUP 16  // query heads per KV head (GQA); checked by the caller

static inline float load_f32(const float *p, int64_t i) { return p[i]; }
static inline float load_bf16(const uint16_t *p, int64_t i) {
    uint32_t bits = (uint32_t)p[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
static inline void store_bf16(uint16_t *p, int64_t i, float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits += 0x7FFF + ((bits >> 16) & 1);  // round to nearest even
    p[i] = (uint16_t)(bits >> 16);
}

#define DEFINE_KERNEL(NAME, T, LOAD, STORE_OUT)                                                         \
    int NAME(const T *q, const T *k_cache, const T *v_cache, const int64_t *tables, const int64_t *lens,  \
             T *out, int64_t batch, int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t block_size, \
             int64_t max_blocks, float scale) {                                                         \
        const int64_t group = q_heads / kv_heads;                                                       \
        if (group > MAX_GROUP || head_dim > 256) return -1;                                             \
        int failed = 0;                                                                                 \
        _Pragma("omp parallel for collapse(2) schedule(dynamic, 4)")                                    \
        for (int64_t b = 0; b < batch; b++) {                                                           \
            for (int64_t kvh = 0; kvh < kv_heads; kvh++) {                                              \
                const int64_t len = lens[b];                                                            \
                float *scores = malloc(sizeof(float) * (size_t)(group * (len > 0 ? len : 1)));          \
                if (!scores) { failed = 1; continue; }                                                  \
                float qv[MAX_GROUP][256], acc[MAX_GROUP][256], mx[MAX_GROUP], sum[MAX_GROUP];           \
                for (int64_t g = 0; g < group; g++) {                                                   \
                    const int64_t row = (b * q_heads + kvh * group + g) * head_dim;                     \
                    for (int64_t d = 0; d < head_dim; d++) qv[g][d] = LOAD(q, row + d) * scale;         \
                    mx[g] = -INFINITY; sum[g] = 0.f;                                                    \
                    memset(acc[g], 0, sizeof(float) * (size_t)head_dim);                                \
                }                                                                                       \
                for (int64_t t = 0; t < len; t++) {                                                     \
                    const int64_t block = tables[b * max_blocks + t / block_size];                      \
                    const T *k = k_cache + ((block * block_size + t % block_size) * kv_heads + kvh) * head_dim; \
                    for (int64_t g = 0; g < group; g++) {                                               \
                        float s = 0.f;                                                                  \
                        _Pragma("omp simd reduction(+:s)")                                              \
                        for (int64_t d = 0; d < head_dim; d++) s += qv[g][d] * LOAD(k, d);              \
                        scores[g * len + t] = s;                                                        \
                        if (s > mx[g]) mx[g] = s;                                                       \
                    }                                                                                   \
                }                                                                                       \
                for (int64_t g = 0; g < group; g++)                                                     \
                    for (int64_t t = 0; t < len; t++) {                                                 \
                        const float p = expf(scores[g * len + t] - mx[g]);                              \
                        scores[g * len + t] = p;                                                        \
                        sum[g] += p;                                                                    \
                    }                                                                                   \
                for (int64_t t = 0; t < len; t++) {                                                     \
                    const int64_t block = tables[b * max_blocks + t / block_size];                      \
                    const T *v = v_cache + ((block * block_size + t % block_size) * kv_heads + kvh) * head_dim; \
                    for (int64_t g = 0; g < group; g++) {                                               \
                        const float p = scores[g * len + t];                                            \
                        _Pragma("omp simd")                                                             \
                        for (int64_t d = 0; d < head_dim; d++) acc[g][d] += p * LOAD(v, d);             \
                    }                                                                                   \
                }                                                                                       \
                for (int64_t g = 0; g < group; g++) {                                                   \
                    const int64_t row = (b * q_heads + kvh * group + g) * head_dim;                     \
                    const float inv = sum[g] > 0.f ? 1.f / sum[g] : 0.f;                                \
                    for (int64_t d = 0; d < head_dim; d++) STORE_OUT(out, row + d, acc[g][d] * inv);    \
                }                                                                                       \
                free(scores);                                                                           \
            }                                                                                           \
        }                                                                                               \
        return failed ? -2 : 0;                                                                         \
    }

#define STORE_F32(p, i, f) ((p)[i] = (f))
DEFINE_KERNEL(paged_decode_attention_f32, float, load_f32, STORE_F32)
DEFINE_KERNEL(paged_decode_attention_bf16, uint16_t, load_bf16, store_bf16)
