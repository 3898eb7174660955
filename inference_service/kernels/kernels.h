// Every function the kernel libraries export, and the structs they exchange with Python: the one
// place a kernel's signature is written in C. Each `<name>.c` includes it, so the compiler checks
// every definition against its prototype (a kernel that is not declared here fails the header test,
// which builds with -Wmissing-prototypes -Werror); decode_stack.c calls the kernels through the
// `*_fn` types below. The ctypes side of each signature is kernels/bindings.py, checked against this
// file by tests/test_kernel_build.py.
//
// Element types: T is an activation's (float for fp32, uint16_t for bf16), W a packed weight's, O an
// output's where it may be either. A family's argument list is written once as a macro; instantiated
// with void it is the form decode_stack.c calls, which moves pointers and never reads elements.
#ifndef LORAPLEX_KERNELS_H
#define LORAPLEX_KERNELS_H

#include <stdint.h>

// Projections (amx_linear.c, avx2_linear.c, bf16_linear.c, quant_linear.c): out [m, n] = x [m, k] W^T (+ bias),
// out in the activations' dtype or, with out_f32, fp32 holding the values rounded to it. 0, or
// non-zero when a per-thread buffer could not be allocated.
#define LORAPLEX_LINEAR_ARGS(T, W, O)                                                                       \
    (const T *x, const W *packed, const T *bias, O *out, int64_t m, int64_t n, int64_t k, int out_f32)
typedef int linear_fn LORAPLEX_LINEAR_ARGS(void, void, void);

// amx_linear.c: 1 where the kernel runs (built with AMX, tile state granted).
int amx_linear_init(void);
int amx_linear_bf16 LORAPLEX_LINEAR_ARGS(uint16_t, uint16_t, void);
// The first argmax of each row of x @ W^T (+ bias) and whether its maximum is finite.
int amx_argmax_bf16(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, int64_t m, int64_t n,
                    int64_t k, int64_t *idx, uint8_t *finite);

// avx2_linear.c: init 1 where built with AVX2 and FMA; preferred 1 where there is no AVX-512 too.
int avx2_linear_init(void);
int avx2_linear_preferred(void);
int avx2_linear_f32 LORAPLEX_LINEAR_ARGS(float, float, float);
int avx2_linear_bf16 LORAPLEX_LINEAR_ARGS(uint16_t, uint16_t, void);

// bf16_linear.c: init 1 where built with AVX-512 BF16 (and BW).
int bf16_linear_init(void);
int bf16_linear_bf16 LORAPLEX_LINEAR_ARGS(uint16_t, uint16_t, void);

// quant_linear.c: vectorised 3 where calls of 16 rows or more run on AMX-INT8 tiles (built with them, or with
// their C model; the kernel lets this process use them; allowed), 2 where built with AVX-512 VNNI (+ BW, F16C),
// 1 with AVX2, FMA and F16C, 0 portable C. allow_amx turns the tiles on or off (returns vectorised);
// amx_faults counts the tile model's faults (what the hardware would trap on), 0 elsewhere.
int quant_linear_vectorised(void);
int quant_linear_allow_amx(int allow);
int quant_linear_amx_faults(void);
int quant_linear_q8_0_f32 LORAPLEX_LINEAR_ARGS(float, uint8_t, float);
int quant_linear_q8_0_bf16 LORAPLEX_LINEAR_ARGS(uint16_t, uint8_t, void);
int quant_linear_q4_0_f32 LORAPLEX_LINEAR_ARGS(float, uint8_t, float);
int quant_linear_q4_0_bf16 LORAPLEX_LINEAR_ARGS(uint16_t, uint8_t, void);

// fused.c: per-token ops of a decoder layer.
#define LORAPLEX_ADD_RMS_NORM_ARGS(T)                                                                       \
    (T *residual, const T *delta, const T *weight, T *out, int64_t rows, int64_t cols, float eps)
#define LORAPLEX_ROPE_AND_CACHE_ARGS(T)                                                                     \
    (T *qkv, int64_t rows, int64_t row_stride, int64_t q_heads, int64_t kv_heads, int64_t head_dim,          \
     const T *cos, const T *sin, const int64_t *cache_rows, T *k_cache, T *v_cache)
#define LORAPLEX_SILU_MUL_ARGS(T) (const T *gate_up, T *out, int64_t rows, int64_t inter)
typedef void add_rms_norm_fn LORAPLEX_ADD_RMS_NORM_ARGS(void);
typedef void rope_and_cache_fn LORAPLEX_ROPE_AND_CACHE_ARGS(void);
typedef void silu_mul_fn LORAPLEX_SILU_MUL_ARGS(void);
void add_rms_norm_f32 LORAPLEX_ADD_RMS_NORM_ARGS(float);
void add_rms_norm_bf16 LORAPLEX_ADD_RMS_NORM_ARGS(uint16_t);
void rope_and_cache_f32 LORAPLEX_ROPE_AND_CACHE_ARGS(float);
void rope_and_cache_bf16 LORAPLEX_ROPE_AND_CACHE_ARGS(uint16_t);
void silu_mul_f32 LORAPLEX_SILU_MUL_ARGS(float);
void silu_mul_bf16 LORAPLEX_SILU_MUL_ARGS(uint16_t);

// greedy.c: idx[r] = first argmax of row r, finite[r] = 1 if its maximum is finite.
void argmax_rows_f32(const float *logits, int64_t rows, int64_t cols, int64_t *idx, uint8_t *finite);

// paged_decode_attention.c: decode attention over a paged KV cache. 0, -2 out of memory, -3 the AMX
// kernel in a build without AMX.
#define LORAPLEX_DECODE_ATTENTION_ARGS(T)                                                                   \
    (const T *q, const T *k_cache, const T *v_cache, const int64_t *tables, const int64_t *lens, T *out,     \
     int64_t batch, int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,                 \
     int64_t max_blocks, float scale)
typedef int attention_fn LORAPLEX_DECODE_ATTENTION_ARGS(void);
int paged_decode_attention_f32 LORAPLEX_DECODE_ATTENTION_ARGS(float);
int paged_decode_attention_bf16 LORAPLEX_DECODE_ATTENTION_ARGS(uint16_t);
int paged_decode_attention_bf16_amx LORAPLEX_DECODE_ATTENTION_ARGS(uint16_t);
int paged_decode_attention_bf16_amx_fits(int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t block_size);

// paged_prefill_attention.c: causal attention of one prefill chunk. 0, -1 a shape it does not take,
// -2 out of memory; preferred 1 where built without AVX-512.
#define LORAPLEX_PREFILL_ATTENTION_ARGS(T)                                                                  \
    (const T *q, const T *k_cache, const T *v_cache, const int64_t *table, T *out, int64_t count,            \
     int64_t start, int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale)
int paged_prefill_attention_f32 LORAPLEX_PREFILL_ATTENTION_ARGS(float);
int paged_prefill_attention_bf16 LORAPLEX_PREFILL_ATTENTION_ARGS(uint16_t);
int paged_prefill_attention_preferred(void);

// lora.c: batched multi-LoRA for one fused projection. A run is rows [first_row, end_row) on one
// adapter of `rank`, its page list at pages[pages_at] (lora/ops.py's LoRABatch.runs).
typedef struct {
    int64_t first_row, end_row, pages_at, rank;
} LoraRun;
#define LORAPLEX_LORA_ARGS(T)                                                                               \
    (const T *x, T *out, int64_t out_stride, const T *a, const T *const *bs, const int64_t *cols,            \
     int64_t n_modules, int64_t page_rank, int64_t slot_rank, int64_t in, const LoraRun *runs,               \
     int64_t num_runs, const int64_t *pages, float *y)
#define LORAPLEX_TRANSPOSE_SCALE_ARGS(T)                                                                    \
    (T *dst, int64_t dst_stride, const T *src, int64_t src_stride, int64_t rows, int64_t cols, float scale)
typedef int lora_fn LORAPLEX_LORA_ARGS(void);
int lora_apply_f32 LORAPLEX_LORA_ARGS(float);
int lora_apply_bf16 LORAPLEX_LORA_ARGS(uint16_t);
void transpose_scale_f32 LORAPLEX_TRANSPOSE_SCALE_ARGS(float);
void transpose_scale_bf16 LORAPLEX_TRANSPOSE_SCALE_ARGS(uint16_t);

// copy.c: slot loads as copy programs, and the pass gate the copy thread waits on (kernels/copy.py
// mirrors both structs).
typedef struct {
    void *dst;
    const void *src;  // NULL: a zero fill
    int64_t nbytes;
} CopyOp;
// `hold` is 1 while a forward pass runs; `scheduler_cpu` the core the scheduler ended its last pass on.
typedef struct {
    int32_t hold;
    int32_t scheduler_cpu;
} PassGate;
void run_copy_program(const CopyOp *ops, int64_t n);
void run_copy_program_gated(const CopyOp *ops, int64_t n, PassGate *gate, int64_t piece_interval_ns);
void pass_gate_open(PassGate *gate);

// decode_stack.c: a LLaMA stack's decode step in one call (models/decode_stack.py mirrors these).
typedef struct {
    linear_fn *linear;  // amx_linear_bf16, avx2_linear_*, quant_linear_*: one for every projection
    add_rms_norm_fn *add_rms_norm;
    rope_and_cache_fn *rope_and_cache;
    silu_mul_fn *silu_mul;
    attention_fn *attention;  // the AMX or the portable paged decode attention
    lora_fn *lora;            // lora_apply_*, or NULL when no LoRA op is attached
} DecodeKernels;

typedef struct {
    const void *weight;  // packed for `linear`
    const void *bias;    // or NULL
    int64_t out_features, in_features;
    // The LoRA slot buffers of this projection's modules (lora/backend.py's layout); lora_a NULL: none.
    const void *lora_a;
    const void *const *lora_b;
    const int64_t *lora_cols;
    int64_t lora_modules, lora_page_rank;
} DecodeProjection;

typedef struct {
    const void *input_norm, *post_attention_norm;
    DecodeProjection qkv, o, gate_up, down;
    void *k_cache, *v_cache;
} DecodeLayer;

typedef struct {
    int64_t element_size;  // of the model's dtype: 2 (bf16) or 4 (fp32)
    int64_t rows, hidden, q_heads, kv_heads, head_dim, intermediate, block_size, max_blocks;
    float eps, scale;
    const void *cos, *sin, *final_norm;  // cos/sin [rows, head_dim]
    const int64_t *slot_mapping, *block_tables, *context_lens;
    // This step's LoRA runs and their pages (LoRABatch.runs, run_pages); num_runs 0: base model only.
    const LoraRun *lora_runs;
    const int64_t *lora_run_pages;
    int64_t lora_num_runs, lora_max_rank;
    float *lora_scratch;  // [rows, modules x lora_max_rank] for the most modules of a projection with LoRA
    // Activations, each [rows, its width]: the normed input of a projection, qkv, q, attention's
    // output, o's and down's output (the residual's next delta), gate_up, SiLU x mul's.
    void *normed, *qkv, *q, *attn, *delta, *gate_up, *act;
    double *op_seconds;  // NULL, or [OPS] seconds added up per op across the layers (a profile)
} DecodeStep;

// residual holds the embeddings on entry and the last layer's output on return; out gets the final
// norm. 0, or the failing kernel's status.
int decode_stack(const DecodeKernels *k, const DecodeLayer *layers, int64_t num_layers, const DecodeStep *s,
                 void *residual, void *out);

#endif
