// fp32 projections on CPUs with AVX2 and FMA but no AVX-512 (AMD Zen 1-3, older Intel): out [M, N] =
// x [M, K] W^T (+ bias), for the row counts of a decode step.
//
// Why not oneDNN: on such a CPU its packed fp32 GEMM reads a decode step's weights at 5-7 GB/s at one
// to eight rows (a plain read reaches ~22 GB/s), so a batch-1 step took 4x its memory roofline; MKL's
// GEMV is no better on AMD. Here each thread walks one contiguous run of 16-column panels, and per
// panel every row block of x passes while the panel is in L1/L2.
//
// Weight layout (`pack` in avx2_linear.py): [N/16][K][16], a panel of 16 columns holding, per k, the
// 16 weights of that input: two ymm loads a k. Registers: up to 6 rows x 16 columns of accumulators
// (12 ymm), the two weight vectors and one broadcast of x.
// Each output is one fp32 sum over k in increasing order, whatever the thread count.
#include <stdint.h>

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>

#define PANEL 16
#define MAX_ROWS 6

int avx2_linear_init(void) { return 1; }

// Rows m0 .. m0 + MR of x against one panel: MR is a constant at each call, so the accumulators
// stay in registers.
static inline __attribute__((always_inline)) void panel_rows(const float *x, const float *panel, const float *bias,
                                                             float *out, int64_t m0, int64_t n0, int64_t n, int64_t k,
                                                             const int mr) {
    __m256 acc[MAX_ROWS][2];
    for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const float *xr = x + m0 * k;
    for (int64_t kk = 0; kk < k; kk++) {
        const __m256 w0 = _mm256_loadu_ps(panel + kk * PANEL), w1 = _mm256_loadu_ps(panel + kk * PANEL + 8);
        for (int r = 0; r < mr; r++) {
            const __m256 xv = _mm256_broadcast_ss(xr + r * k + kk);
            acc[r][0] = _mm256_fmadd_ps(xv, w0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(xv, w1, acc[r][1]);
        }
    }
    const __m256 b0 = bias ? _mm256_loadu_ps(bias + n0) : _mm256_setzero_ps();
    const __m256 b1 = bias ? _mm256_loadu_ps(bias + n0 + 8) : _mm256_setzero_ps();
    for (int r = 0; r < mr; r++) {
        float *o = out + (m0 + r) * n + n0;
        _mm256_storeu_ps(o, _mm256_add_ps(acc[r][0], b0));
        _mm256_storeu_ps(o + 8, _mm256_add_ps(acc[r][1], b1));
    }
}

// out [m, n] = x [m, k] @ W^T (+ bias [n] unless NULL); n a multiple of 16, x and out dense, packed
// in the panel layout.
void avx2_linear_f32(const float *x, const float *packed, const float *bias, float *out, int64_t m, int64_t n,
                     int64_t k) {
    const int64_t panels = n / PANEL;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        const float *panel = packed + p * k * PANEL;
        int64_t m0 = 0;
        for (; m0 + MAX_ROWS <= m; m0 += MAX_ROWS) panel_rows(x, panel, bias, out, m0, p * PANEL, n, k, MAX_ROWS);
        switch (m - m0) {
            case 5: panel_rows(x, panel, bias, out, m0, p * PANEL, n, k, 5); break;
            case 4: panel_rows(x, panel, bias, out, m0, p * PANEL, n, k, 4); break;
            case 3: panel_rows(x, panel, bias, out, m0, p * PANEL, n, k, 3); break;
            case 2: panel_rows(x, panel, bias, out, m0, p * PANEL, n, k, 2); break;
            case 1: panel_rows(x, panel, bias, out, m0, p * PANEL, n, k, 1); break;
            default: break;
        }
    }
}

#else
int avx2_linear_init(void) { return 0; }  // AVX-512 CPUs keep oneDNN (whose kernels use it); no AVX2: too

void avx2_linear_f32(const float *x, const float *packed, const float *bias, float *out, int64_t m, int64_t n,
                     int64_t k) {
    (void)x, (void)packed, (void)bias, (void)out, (void)m, (void)n, (void)k;
}
#endif
