// Batched multi-LoRA on CPU for one fused projection (see lora/ops.py for the math):
// out[r, cols_i] += (x[r] · A_{s,i}ᵀ) · Bt_{s,i} for each module i and each row r of a run on adapter s.
//
// Why not torch's batched matmuls: a decode step multiplies a few rows per adapter, so the work is
// reading the adapters' weights, and torch paid per-call overhead on ~11 small matmuls and adds per
// layer (and a gather of every group's pages first). Here each run reads its adapter's A rows and B
// rows once, where its pages are, only up to the adapter's own rank, and the expand runs along
// output columns. For that, B is kept rank-major in the pages, Bt [R, out]: `transpose_scale_*`
// writes it at load time.
//
// The adapters live in pages of R rank rows (lora/mem_pool.py): an adapter of rank r in
// ceil(r / R) pages anywhere in the pool; each run of rows carries the offset of its adapter's page
// list in `pages`, and rank row j of the adapter is row j % R of page pages[offset + j / R].
// x [T, in], out [T, out_stride] (the fused projection's output), a [pages, n·R, in],
// bs[i] = Bt of module i [pages, R, cols[i+1] - cols[i]], groups: runs of rows on one adapter,
// y: scratch [T, n·max_rank] with max_rank at least every run's rank.
// Products accumulate in fp32; bf16 inputs are widened and the sum rounded once into out.
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "kernels.h"

typedef LoraRun Group;  // kernels.h: rows [first_row, end_row) on one adapter

#define TILE_ROWS 8  // rows of a group per task: enough to reuse each weight row from L1
// How far ahead (elements) the shrink and the expand ask for the weight rows they stream, as they go.
// A decode step's groups each read a different adapter's pages, which the hardware prefetcher
// starts on only after misses. Asking for a whole module's pages up front (before) stalled the
// core on a full miss queue: half the kernel's time in a batch-32 step over 8 adapters sat on
// those prefetch loops; asking a few lines ahead inside the loops took the step's LoRA time from
// 6.5 to 6.0 ms (128-512 measured; 64 adapters of the fixture model: 0.593 -> 0.610 of base).
#define AHEAD 256

// Register-blocked inner kernels (GCC/Clang vector extensions, lowered to whatever SIMD the
// host has): MAX_MR rows x 4 weight rows of dot products in the shrink, MAX_MR rows x 4 vectors of
// output columns in the expand, so each weight vector loaded from memory feeds MAX_MR rows' FMAs
// and the accumulators stay in registers. Sizes that do not divide evenly take the plain loops.
// With AVX-512 (32 registers of 16 floats): 4 rows, 16 accumulators. Elsewhere (AVX2's 16 ymm) 16-float
// vectors took two registers each and 4 rows' accumulators spilled to the stack on every FMA (a
// batch-32 step over 8 adapters spent 52 ms in LoRA on an AMD Zen 1, ~10x its FLOPs' time there):
// 8-float vectors and 2 rows, 8 accumulators.
#ifdef __AVX512F__
#define VL 16
#define MAX_MR 4
#else
#define VL 8
#define MAX_MR 2
#endif
typedef float vf __attribute__((vector_size(VL * 4)));
typedef uint16_t vh __attribute__((vector_size(VL * 2)));
typedef uint32_t vu __attribute__((vector_size(VL * 4)));

static inline vf vload_f32(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline vf vload_bf16(const uint16_t *p) {
#ifdef __AVX512F__
    return (vf)widen16_bf16(p);
#else
    vh h;
    memcpy(&h, p, sizeof h);
    vu wide = __builtin_convertvector(h, vu) << 16;
    return (vf)wide;
#endif
}
static inline vf vbroadcast(const float *p) {
#ifdef __AVX512F__
    return (vf)_mm512_set1_ps(*p);
#else
    return (vf){0} + *p;
#endif
}
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));
static inline float hsum(vf v) {  // a tree of halves, not VL - 1 scalar adds
#if VL == 16
    const vf8 h8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                   __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    const vf8 h8 = v;
#endif
    const vf4 h4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3) + __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
    return (h4[0] + h4[2]) + (h4[1] + h4[3]);
}

static inline void add_into_f32(float *p, int64_t i, float f) { p[i] += f; }
static inline void add_into_bf16(uint16_t *p, int64_t i, float f) { store_bf16(p, i, load_bf16(p, i) + f); }
// o[0..VL) += s, rounded once to the output's dtype.
static inline void vadd_into_f32(float *o, vf s) {
    const vf sum = vload_f32(o) + s;
    memcpy(o, &sum, sizeof sum);
}
static inline void vadd_into_bf16(uint16_t *o, vf s) {
#ifdef __AVX512BF16__  // the hardware's round-to-nearest-even narrowing, one instruction
    const __m256bh r = _mm512_cvtneps_pbh((__m512)(vload_bf16(o) + s));
    memcpy(o, &r, sizeof r);
#else  // common.h's bf16_bits on all lanes at once
    const vf sum = vload_bf16(o) + s;
    vu bits;
    memcpy(&bits, &sum, sizeof bits);
    bits += 0x7FFF + ((bits >> 16) & 1);
    const vh narrowed = __builtin_convertvector(bits >> 16, vh);
    memcpy(o, &narrowed, sizeof narrowed);
#endif
}

// The group and first row of task `task` (tasks are tiles of TILE_ROWS rows, group after group).
static inline Group tile_of(const Group *groups, const int64_t *first_task, int64_t task, int64_t *row0) {
    int64_t g = 0;
    while (first_task[g + 1] <= task) g++;
    *row0 = groups[g].first_row + (task - first_task[g]) * TILE_ROWS;
    return groups[g];
}

// The register-blocked tiles for MR rows (1-4) of a group: a decode step's group is often one row,
// and padding it to four (zeros) did four times the FMAs, the bulk of a step with many adapters.
// They use the enclosing kernel's variables (rows_of, xs, ys, y_i, m0, j, in, ny, slot_rank, ...).
// Shrink: y[m0 + mm, i·R + j + q] = xs[m0 + mm] · (A row j + q of module i), q < 4.
#define SHRINK_TILE(MR, VLOAD)                                                                          \
    do {                                                                                                \
        vf s[MR][4] = {{{0}}};                                                                          \
        for (int64_t d = 0; d < in; d += VL) {                                                          \
            if (m0 == 0 && (d * (int64_t)sizeof(*rows_of[0])) % 64 == 0) /* once a cache line */          \
                for (int q = 0; q < 4; q++) __builtin_prefetch(rows_of[j + q] + d + AHEAD, 0, 3);       \
            vf w[4];                                                                                    \
            for (int q = 0; q < 4; q++) w[q] = VLOAD(rows_of[j + q] + d);                               \
            _Pragma("GCC unroll 4") for (int mm = 0; mm < MR; mm++) {                                    \
                const vf xv = vload_f32(xs + (m0 + mm) * in + d);                                       \
                for (int q = 0; q < 4; q++) s[mm][q] += xv * w[q];                                      \
            }                                                                                           \
        }                                                                                               \
        for (int mm = 0; mm < MR; mm++)                                                                 \
            for (int q = 0; q < 4; q++) y_i[(m0 + mm) * ny + j + q] = hsum(s[mm][q]);                   \
    } while (0)
// Expand: out[r0 + m0 + mm, cols_i + c0 ..+ 4·VL] += Σ_j ys[m0 + mm, j] · (Bt row j of module i).
#define EXPAND_TILE(MR, T, VLOAD, VADD_INTO)                                                             \
    do {                                                                                                \
        vf s[MR][4] = {{{0}}};                                                                          \
        if (m0 == 0)                                                                                    \
            for (int64_t j = 0; j < rank; j++) /* the tile's columns' lines, AHEAD on */                \
                for (int64_t b = 0; b < 4 * VL * (int64_t)sizeof(*rows_of[0]); b += 64)                 \
                    __builtin_prefetch((const char *)(rows_of[j] + c0 + AHEAD) + b, 0, 3);              \
        for (int64_t j = 0; j < rank; j++) {                                                            \
            vf w[4];                                                                                    \
            for (int q = 0; q < 4; q++) w[q] = VLOAD(rows_of[j] + c0 + q * VL);                         \
            _Pragma("GCC unroll 4") for (int mm = 0; mm < MR; mm++) {                                    \
                const vf yv = vbroadcast(ys + (m0 + mm) * slot_rank + j);                                \
                for (int q = 0; q < 4; q++) s[mm][q] += yv * w[q];                                      \
            }                                                                                           \
        }                                                                                               \
        for (int mm = 0; mm < MR; mm++) {                                                               \
            T *o = out + (r0 + m0 + mm) * out_stride + cols[i] + c0;                                    \
            for (int q = 0; q < 4; q++) VADD_INTO(o + q * VL, s[mm][q]);                                \
        }                                                                                               \
    } while (0)
// MR = min(MAX_MR, rows - m0), as a constant for each tile body.
#define BY_ROWS_LEFT(TILE, ...)                                                                         \
    do {                                                                                                \
        const int64_t left = rows - m0;                                                                 \
        if (left >= 4 && MAX_MR >= 4) TILE(4, __VA_ARGS__);                                             \
        else if (left == 3 && MAX_MR >= 4) TILE(3, __VA_ARGS__);                                        \
        else if (left >= 2) TILE(2, __VA_ARGS__);                                                       \
        else TILE(1, __VA_ARGS__);                                                                      \
    } while (0)

#define DEFINE_LORA(NAME, T, WIDEN, VLOAD, ADD_INTO, VADD_INTO)                                                       \
    int NAME(const T *x, T *out, int64_t out_stride, const T *a, const T *const *bs, const int64_t *cols,   \
             int64_t n_modules, int64_t page_rank, int64_t slot_rank, int64_t in, const Group *groups,      \
             int64_t num_groups, const int64_t *pages, float *y) {                                         \
        const int64_t ny = n_modules * slot_rank;                                                          \
        int64_t *first_task = malloc(sizeof(int64_t) * (size_t)(num_groups + 1));                          \
        if (!first_task) return -2;                                                                        \
        int64_t tasks = 0, max_width = 0;                                                                  \
        for (int64_t g = 0; g < num_groups; g++) {                                                         \
            first_task[g] = tasks;                                                                         \
            tasks += (groups[g].end_row - groups[g].first_row + TILE_ROWS - 1) / TILE_ROWS;                \
        }                                                                                                  \
        first_task[num_groups] = tasks;                                                                    \
        for (int64_t i = 0; i < n_modules; i++)                                                            \
            if (cols[i + 1] - cols[i] > max_width) max_width = cols[i + 1] - cols[i];                      \
        int failed = 0;                                                                                    \
        _Pragma("omp parallel")                                                                            \
        {                                                                                                  \
            float *xs = thread_buffer(0, sizeof(float) * (size_t)(TILE_ROWS * in));                        \
            float *acc = thread_buffer(1, sizeof(float) * (size_t)(TILE_ROWS * max_width));                \
            float *ys = thread_buffer(2, sizeof(float) * (size_t)(TILE_ROWS * slot_rank));                 \
            const T **rows_of = thread_buffer(3, sizeof(T *) * (size_t)(slot_rank + 4)); /* weight row j's address */ \
            const int ok = xs && acc && ys && rows_of;                                                     \
            if (!ok) failed = 1;                                                                           \
            /* One task (a tile of up to TILE_ROWS rows of one group) at a time, shrink then expand:   \
               its expand needs only its own rows' y, so the threads never wait for each other       \
               between the two (a barrier there cost a time slice whenever another process held a    \
               core: 64 one-row groups went from 4 to 30-40 ms a step beside one busy process).     */ \
            /* Guided: each thread starts on a long run of consecutive tasks, whose adapters' pages   \
               mostly follow each other in the pool (one stream the prefetchers keep up with; one     \
               task each in turn left every thread's reads gapped: a batch-32 step over 8 adapters   \
               spent 4.5-4.9 ms in LoRA, now 4.2-4.3), and the tail still balances.                   */ \
            _Pragma("omp for schedule(guided)")                                                            \
            for (int64_t task = 0; task < (ok ? tasks : 0); task++) {                                      \
                int64_t r0;                                                                                \
                const Group gr = tile_of(groups, first_task, task, &r0);                                   \
                const int64_t rows = gr.end_row - r0 < TILE_ROWS ? gr.end_row - r0 : TILE_ROWS;            \
                const int64_t rank = gr.rank < slot_rank ? gr.rank : slot_rank;                            \
                for (int64_t k = 0; k < rows * in; k++) xs[k] = WIDEN(x, r0 * in + k);                     \
                /* Shrink: y[r, i·R + j] = x[r] · (A row j of module i) for j below the adapter's rank. */  \
                for (int64_t i = 0; i < n_modules; i++) {                                                  \
                    for (int64_t j = 0; j < rank; j++)                                                     \
                        rows_of[j] = a + ((pages[gr.pages_at + j / page_rank] * n_modules + i) * page_rank \
                                          + j % page_rank) * in;                                           \
                    float *y_i = y + r0 * ny + i * slot_rank;                                              \
                    int64_t j = 0;                                                                         \
                    for (; in % VL == 0 && j + 4 <= rank; j += 4)                                          \
                        for (int64_t m0 = 0; m0 < rows; m0 += MAX_MR) BY_ROWS_LEFT(SHRINK_TILE, VLOAD);          \
                    for (; j < rank; j++) {                                                                \
                        const T *arow = rows_of[j];                                                        \
                        for (int64_t m = 0; m < rows; m++) {                                               \
                            const float *xm = xs + m * in;                                                 \
                            float s = 0.f;                                                                 \
                            _Pragma("omp simd reduction(+:s)")                                             \
                            for (int64_t d = 0; d < in; d++) s += xm[d] * WIDEN(arow, d);                  \
                            y_i[m * ny + j] = s;                                                           \
                        }                                                                                  \
                    }                                                                                      \
                }                                                                                          \
                /* Expand: out[r, cols_i] += Σ_j y[r, i·R + j] · (Bt row j of module i), each read once. */  \
                for (int64_t i = 0; i < n_modules; i++) {                                                  \
                    const int64_t width = cols[i + 1] - cols[i];                                           \
                    for (int64_t j = 0; j < rank; j++)                                                     \
                        rows_of[j] = bs[i] + (pages[gr.pages_at + j / page_rank] * page_rank + j % page_rank) * width; \
                    for (int64_t m = 0; m < rows; m++) /* this module's y rows */                          \
                        for (int64_t j = 0; j < rank; j++) ys[m * slot_rank + j] = y[(r0 + m) * ny + i * slot_rank + j]; \
                    int64_t c0 = 0;                                                                        \
                    for (; c0 + 4 * VL <= width; c0 += 4 * VL)                                             \
                        for (int64_t m0 = 0; m0 < rows; m0 += MAX_MR) BY_ROWS_LEFT(EXPAND_TILE, T, VLOAD, VADD_INTO); \
                    if (c0 == width) continue;                                                             \
                    const int64_t tail = width - c0;                                                       \
                    memset(acc, 0, sizeof(float) * (size_t)(rows * tail));                                 \
                    for (int64_t j = 0; j < rank; j++)                                                     \
                        for (int64_t m = 0; m < rows; m++) {                                               \
                            const float yj = ys[m * slot_rank + j];                                        \
                            _Pragma("omp simd")                                                            \
                            for (int64_t c = 0; c < tail; c++) acc[m * tail + c] += yj * WIDEN(rows_of[j], c0 + c); \
                        }                                                                                  \
                    for (int64_t m = 0; m < rows; m++) {                                                   \
                        T *o = out + (r0 + m) * out_stride + cols[i] + c0;                                 \
                        _Pragma("omp simd")                                                                \
                        for (int64_t c = 0; c < tail; c++) ADD_INTO(o, c, acc[m * tail + c]);              \
                    }                                                                                      \
                }                                                                                          \
            }                                                                                              \
        }                                                                                                  \
        free(first_task);                                                                                  \
        return failed ? -2 : 0;                                                                            \
    }

DEFINE_LORA(lora_apply_f32, float, load_f32, vload_f32, add_into_f32, vadd_into_f32)
DEFINE_LORA(lora_apply_bf16, uint16_t, load_bf16, vload_bf16, add_into_bf16, vadd_into_bf16)

// dst[c, r] = scale * src[r, c] for src [rows, cols] (row stride src_stride) and dst [cols, rows]
// (row stride dst_stride): an adapter load writing B rank-major with the adapter's scaling folded in.
// In tiles, so both sides are read and written in cache lines (torch's strided copy of a transposed
// view ran ~4x slower than a plain copy, and scaling afterwards took another pass).
#define TRANSPOSE_TILE 16
#define DEFINE_TRANSPOSE(NAME, T, WIDEN, STORE)                                                            \
    void NAME(T *dst, int64_t dst_stride, const T *src, int64_t src_stride, int64_t rows, int64_t cols,     \
              float scale) {                                                                               \
        for (int64_t r0 = 0; r0 < rows; r0 += TRANSPOSE_TILE)                                              \
            for (int64_t c0 = 0; c0 < cols; c0 += TRANSPOSE_TILE) {                                        \
                const int64_t r1 = r0 + TRANSPOSE_TILE < rows ? r0 + TRANSPOSE_TILE : rows;                \
                const int64_t c1 = c0 + TRANSPOSE_TILE < cols ? c0 + TRANSPOSE_TILE : cols;                \
                for (int64_t c = c0; c < c1; c++)                                                          \
                    for (int64_t r = r0; r < r1; r++)                                                      \
                        STORE(dst, c * dst_stride + r, scale * WIDEN(src, r * src_stride + c));            \
            }                                                                                              \
    }

DEFINE_TRANSPOSE(transpose_scale_f32, float, load_f32, store_f32)
DEFINE_TRANSPOSE(transpose_scale_bf16, uint16_t, load_bf16, store_bf16)
