// Fused per-token ops of a decoder layer on CPU: RMSNorm (with the residual add before it), RoPE
// with the K/V cache write, and SiLU-and-multiply. Each replaces 5-12 small torch calls per layer,
// whose dispatch and extra passes over memory cost more than their arithmetic in a decode step.
// Arithmetic in fp32; bf16 tensors are widened on load and rounded once on store. The rounding
// points follow Hugging Face's: the residual sum and the normalised value are rounded to the
// model's dtype before the norm weight is applied.
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "common.h"
#include "kernels.h"

// Threads only for work big enough to repay waking them: a 32-row decode step's SiLU x mul (49 K
// elements on SmolLM2) runs in 0.6 of its one-thread time on two.
#define PARALLEL_ROWS(rows, cols)                                                                          \
    const int64_t work = (rows) * (cols);                                                                  \
    _Pragma("omp parallel for if (work >= 16384) schedule(static)")

#define DEFINE_FUSED(SUFFIX, T, LOAD, STORE, ROUND)                                                       \
    /* out = weight * round(x / rms(x)); with `delta`, first residual += delta (x is the new residual). */ \
    void add_rms_norm_##SUFFIX(T *residual, const T *delta, const T *weight, T *out, int64_t rows,         \
                               int64_t cols, float eps) {                                                  \
        PARALLEL_ROWS(rows, cols)                                                                          \
        for (int64_t r = 0; r < rows; r++) {                                                               \
            T *x = residual + r * cols;                                                                    \
            float squares = 0.f;                                                                           \
            if (delta) {                                                                                   \
                const T *d = delta + r * cols;                                                             \
                _Pragma("omp simd reduction(+:squares)")                                                   \
                for (int64_t c = 0; c < cols; c++) {                                                       \
                    const float v = ROUND(LOAD(x, c) + LOAD(d, c));                                        \
                    STORE(x, c, v);                                                                        \
                    squares += v * v;                                                                      \
                }                                                                                          \
            } else {                                                                                       \
                _Pragma("omp simd reduction(+:squares)")                                                   \
                for (int64_t c = 0; c < cols; c++) squares += LOAD(x, c) * LOAD(x, c);                     \
            }                                                                                              \
            const float inv = 1.f / sqrtf(squares / (float)cols + eps);                                    \
            T *o = out + r * cols;                                                                         \
            _Pragma("omp simd")                                                                            \
            for (int64_t c = 0; c < cols; c++) STORE(o, c, LOAD(weight, c) * ROUND(LOAD(x, c) * inv));     \
        }                                                                                                  \
    }                                                                                                      \
                                                                                                           \
    /* Rotate-half RoPE in place on the first `rotated_heads` heads of each row (q's, then k's), then  \
       copy each row's K and V (already rotated) to its cache position. cos/sin [rows, head_dim]. */    \
    void rope_and_cache_##SUFFIX(T *qkv, int64_t rows, int64_t row_stride, int64_t q_heads,             \
                                 int64_t kv_heads, int64_t head_dim, const T *cos, const T *sin,           \
                                 const int64_t *cache_rows, T *k_cache, T *v_cache) {                     \
        const int64_t half = head_dim / 2, kv_size = kv_heads * head_dim;                                \
        PARALLEL_ROWS(rows, row_stride)                                                                    \
        for (int64_t r = 0; r < rows; r++) {                                                               \
            T *row = qkv + r * row_stride;                                                                 \
            const T *cr = cos + r * head_dim, *sr = sin + r * head_dim;                                    \
            for (int64_t h = 0; h < q_heads + kv_heads; h++) {                                             \
                T *x = row + h * head_dim;                                                                 \
                _Pragma("omp simd")                                                                        \
                for (int64_t d = 0; d < half; d++) {                                                       \
                    const float lo = LOAD(x, d), hi = LOAD(x, d + half);                                   \
                    /* HF: x * cos + rotate_half(x) * sin, rotate_half(x) = (-hi, lo) */                   \
                    STORE(x, d, ROUND(lo * LOAD(cr, d)) - ROUND(hi * LOAD(sr, d)));                        \
                    STORE(x, d + half, ROUND(hi * LOAD(cr, d + half)) + ROUND(lo * LOAD(sr, d + half)));   \
                }                                                                                          \
            }                                                                                              \
            memcpy(k_cache + cache_rows[r] * kv_size, row + q_heads * head_dim, sizeof(T) * (size_t)kv_size); \
            memcpy(v_cache + cache_rows[r] * kv_size, row + q_heads * head_dim + kv_size,                  \
                   sizeof(T) * (size_t)kv_size);                                                           \
        }                                                                                                  \
    }                                                                                                      \
                                                                                                           \
    /* out [rows, inter] = silu(gate) * up, gate_up [rows, 2 * inter] (HF rounds silu's result). */      \
    void silu_mul_##SUFFIX(const T *gate_up, T *out, int64_t rows, int64_t inter) {                       \
        PARALLEL_ROWS(rows, inter)                                                                         \
        for (int64_t r = 0; r < rows; r++) {                                                               \
            const T *g = gate_up + r * 2 * inter, *u = g + inter;                                          \
            T *o = out + r * inter;                                                                        \
            _Pragma("omp simd")                                                                            \
            for (int64_t c = 0; c < inter; c++) {                                                          \
                const float x = LOAD(g, c);                                                                \
                STORE(o, c, ROUND(x / (1.f + vec_expf(-x))) * LOAD(u, c));                                     \
            }                                                                                              \
        }                                                                                                  \
    }

DEFINE_FUSED(f32, float, load_f32, store_f32, round_f32)
DEFINE_FUSED(bf16, uint16_t, load_bf16, store_bf16, round_bf16)
