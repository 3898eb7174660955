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

#include "kernels.h"

// The kernels' signatures (kernels.h's `*_fn`, their element pointers as void: each is called with
// tensors of its own dtype) and the step's structs (DecodeKernels, DecodeLayer, DecodeStep) are in
// kernels.h.

// The ops of a layer as a profile names them (models/decode_stack.py's OPS, same order).
enum { NORM, QKV, QKV_LORA, ROPE, ATTENTION, O, O_LORA, ADD_NORM, GATE_UP, GATE_UP_LORA, SILU, DOWN, DOWN_LORA, OPS };

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

// With a profile asked for, the time since the last mark goes to `op`.
static inline void mark(const DecodeStep *s, double *last, int op) {
    if (s->op_seconds == NULL) return;
    const double t = now();
    s->op_seconds[op] += t - *last;
    *last = t;
}

// The projection (op), then its LoRA (op + 1).
static int project(const DecodeKernels *k, const DecodeProjection *p, const DecodeStep *s, const void *x, void *out, double *last,
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
int decode_stack(const DecodeKernels *k, const DecodeLayer *layers, int64_t num_layers, const DecodeStep *s, void *residual, void *out) {
    const int64_t rows = s->rows, q_size = s->q_heads * s->head_dim, element = s->element_size;
    const int64_t qkv_size = q_size + 2 * s->kv_heads * s->head_dim;
    int status = 0;
    double last = s->op_seconds ? now() : 0.;
    for (int64_t i = 0; i < num_layers && status == 0; i++) {
        const DecodeLayer *layer = &layers[i];
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
