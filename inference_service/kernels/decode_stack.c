// A LLaMA decoder stack's decode step, every layer, in one call from Python (bf16 or fp32 on CPU).
//
// Why: in a decode step the kernels themselves are most of the work, but the Python between them
// (about a dozen calls into C and torch per layer: argument conversion, output allocation, views,
// the residual add) held the main thread for ~5 ms of a ~25 ms batch-32 step on SmolLM2, while the
// other core spun in OpenMP's barrier. This runner calls the same kernels in the same order as
// models/llama.py's layer forward, on the same values, so its results are bit-identical to that
// path; the Python side (models/decode_stack.py) passes their addresses, so each kernel is still
// built and loaded once, by its own module. The kernels are those of the model's dtype (their
// `_bf16` or `_f32` versions); this file only moves their pointers, so it takes activations as
// bytes and the element size from the step.
//
// One layer: norm -> qkv (+LoRA) -> RoPE and the K/V cache write -> paged decode attention ->
// o (+LoRA) -> residual add and norm -> gate_up (+LoRA) -> SiLU x mul -> down (+LoRA). The residual
// add after `down` is the next layer's input norm's add (or, after the last layer, the final
// norm's): the fused add-and-norm rounds the sum exactly as the separate add did.
#include <stdint.h>
#include <string.h>
#include <time.h>

// The kernels' signatures with their element pointers as void: each is called with tensors of its
// own dtype (bf16 as uint16_t, or float).
typedef int (*linear_fn)(const void *x, const void *packed, const void *bias, void *out, int64_t m, int64_t n,
                         int64_t k, int out_f32);
typedef void (*add_rms_norm_fn)(void *residual, const void *delta, const void *weight, void *out, int64_t rows,
                                int64_t cols, float eps);
typedef void (*rope_and_cache_fn)(void *qkv, int64_t rows, int64_t row_stride, int64_t q_heads, int64_t kv_heads,
                                  int64_t head_dim, const void *cos, const void *sin, const int64_t *cache_rows,
                                  void *k_cache, void *v_cache);
typedef void (*silu_mul_fn)(const void *gate_up, void *out, int64_t rows, int64_t inter);
typedef int (*attention_fn)(const void *q, const void *k_cache, const void *v_cache, const int64_t *tables,
                            const int64_t *lens, void *out, int64_t batch, int64_t q_heads, int64_t kv_heads,
                            int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale);
typedef int (*lora_fn)(const void *x, void *out, int64_t out_stride, const void *a, const void *const *bs,
                       const int64_t *cols, int64_t n_modules, int64_t page_rank, int64_t slot_rank, int64_t in,
                       const int64_t *runs, int64_t num_runs, const int64_t *pages, float *y);

typedef struct {
    linear_fn linear;  // amx_linear_bf16, avx2_linear_bf16 or avx2_linear_f32
    add_rms_norm_fn add_rms_norm;
    rope_and_cache_fn rope_and_cache;
    silu_mul_fn silu_mul;
    attention_fn attention;  // the AMX or the portable paged decode attention, same signature
    lora_fn lora;            // lora_apply_bf16, or NULL when no LoRA op is attached
} Kernels;

typedef struct {
    const void *weight;  // packed for `linear`
    const void *bias;    // or NULL
    int64_t out_features, in_features;
    // The LoRA slot buffers of this projection's modules (lora/backend.py's layout); lora_a NULL: none.
    const void *lora_a;
    const void *const *lora_b;
    const int64_t *lora_cols;
    int64_t lora_modules, lora_page_rank;
} Projection;

typedef struct {
    const void *input_norm, *post_attention_norm;
    Projection qkv, o, gate_up, down;
    void *k_cache, *v_cache;
} Layer;

typedef struct {
    int64_t element_size;  // of the model's dtype: 2 (bf16) or 4 (fp32)
    int64_t rows, hidden, q_heads, kv_heads, head_dim, intermediate, block_size, max_blocks;
    float eps, scale;
    const void *cos, *sin, *final_norm;  // cos/sin [rows, head_dim]
    const int64_t *slot_mapping, *block_tables, *context_lens;
    // This step's LoRA runs (lora/ops.py's LoRABatch.runs, run_pages); num_runs 0: base model only.
    const int64_t *lora_runs, *lora_run_pages;
    int64_t lora_num_runs, lora_max_rank;
    float *lora_scratch;  // [rows, modules x lora_max_rank] for the most modules of a projection with LoRA
    // Activations, each [rows, its width]: the normed input of a projection, qkv, q, attention's
    // output, o's and down's output (the residual's next delta), gate_up, SiLU x mul's.
    void *normed, *qkv, *q, *attn, *delta, *gate_up, *act;
    double *op_seconds;  // NULL, or [OPS] seconds added up per op across the layers (a profile)
} Step;

// The ops of a layer as a profile names them (models/decode_stack.py's OPS, same order).
enum { NORM, QKV, QKV_LORA, ROPE, ATTENTION, O, O_LORA, ADD_NORM, GATE_UP, GATE_UP_LORA, SILU, DOWN, DOWN_LORA, OPS };

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

// With a profile asked for, the time since the last mark goes to `op`.
static inline void mark(const Step *s, double *last, int op) {
    if (s->op_seconds == NULL) return;
    const double t = now();
    s->op_seconds[op] += t - *last;
    *last = t;
}

// The projection (op), then its LoRA (op + 1).
static int project(const Kernels *k, const Projection *p, const Step *s, const void *x, void *out, double *last,
                   int op) {
    int status = k->linear(x, p->weight, p->bias, out, s->rows, p->out_features, p->in_features, 0);
    mark(s, last, op);
    if (status || p->lora_a == NULL || s->lora_num_runs == 0) return status;
    status = k->lora(x, out, p->out_features, p->lora_a, p->lora_b, p->lora_cols, p->lora_modules, p->lora_page_rank,
                     s->lora_max_rank, p->in_features, s->lora_runs, s->lora_num_runs, s->lora_run_pages,
                     s->lora_scratch);
    mark(s, last, op + 1);
    return status;
}

// residual [rows, hidden] holds the embeddings on entry and the last layer's output on return;
// `out` [rows, hidden] gets its final norm. 0, or a kernel's failure status (its scratch could not be
// allocated), with the step abandoned.
int decode_stack(const Kernels *k, const Layer *layers, int64_t num_layers, const Step *s, void *residual, void *out) {
    const int64_t rows = s->rows, q_size = s->q_heads * s->head_dim, element = s->element_size;
    const int64_t qkv_size = q_size + 2 * s->kv_heads * s->head_dim;
    int status = 0;
    double last = s->op_seconds ? now() : 0.;
    for (int64_t i = 0; i < num_layers && status == 0; i++) {
        const Layer *layer = &layers[i];
        k->add_rms_norm(residual, i ? s->delta : NULL, layer->input_norm, s->normed, rows, s->hidden, s->eps);
        mark(s, &last, NORM);
        if ((status = project(k, &layer->qkv, s, s->normed, s->qkv, &last, QKV))) break;
        k->rope_and_cache(s->qkv, rows, qkv_size, s->q_heads, s->kv_heads, s->head_dim, s->cos, s->sin,
                          s->slot_mapping, layer->k_cache, layer->v_cache);
        for (int64_t r = 0; r < rows; r++)  // attention reads q dense: [rows, q_heads, head_dim]
            memcpy((char *)s->q + r * q_size * element, (const char *)s->qkv + r * qkv_size * element,
                   (size_t)(q_size * element));
        mark(s, &last, ROPE);
        if ((status = k->attention(s->q, layer->k_cache, layer->v_cache, s->block_tables, s->context_lens, s->attn,
                                   rows, s->q_heads, s->kv_heads, s->head_dim, s->block_size, s->max_blocks,
                                   s->scale)))
            break;
        mark(s, &last, ATTENTION);
        if ((status = project(k, &layer->o, s, s->attn, s->delta, &last, O))) break;
        k->add_rms_norm(residual, s->delta, layer->post_attention_norm, s->normed, rows, s->hidden, s->eps);
        mark(s, &last, ADD_NORM);
        if ((status = project(k, &layer->gate_up, s, s->normed, s->gate_up, &last, GATE_UP))) break;
        k->silu_mul(s->gate_up, s->act, rows, s->intermediate);
        mark(s, &last, SILU);
        status = project(k, &layer->down, s, s->act, s->delta, &last, DOWN);
    }
    if (status == 0) {
        k->add_rms_norm(residual, num_layers ? s->delta : NULL, s->final_norm, out, rows, s->hidden, s->eps);
        mark(s, &last, NORM);
    }
    return status;
}
