/* A few fp32 rows times an fp16 matrix: y[n][j] = sum_k x[n][k] * w[j][k], n < rows <= 8.
 *
 * Why: a big model's sample rows (8 over one prompt) multiply every matrix by 8 rows a
 * step. That is no longer a stream of weights but arithmetic: d20's matrices are 477M
 * weights, 3.8G multiply-adds for 8 rows, which two Zen 3 cores do in ~37 ms at their FMA
 * peak. fbgemm's fp16 GEMM took 75-82 ms for them; this loop takes 52-54 (one-off ABBA
 * rounds, two threads; quantize.Fp16Weight's docstring has the numbers).
 *
 * How: the matrix is packed once (native_kernels.F16Rows.pack) in panels of PANEL columns,
 * each panel (K, PANEL) contiguous, so a pass reads its weights in order. For each input k
 * the panel's PANEL weights are widened to fp32 once (vcvtph2ps) and multiplied into every
 * row's own sums with x[n][k] broadcast: one load and one conversion serve `rows` FMAs, and
 * the rows' 8 sums are the independent chains that keep both FMA pipes busy.
 *
 * Compiled on the user's machine at first use (chatcli/native_kernels.py), -O3
 * -march=native -fopenmp. Needs AVX-512F (16 lanes), or AVX2 with F16C and FMA (8 lanes);
 * elsewhere it does not compile and chatcli keeps fbgemm's kernel. OpenMP in torch's
 * libgomp: torch.set_num_threads sets how many threads share the panels.
 */
#include <immintrin.h>
#include <stdint.h>

#if defined(__AVX512F__)
#define PANEL 16
#define WIDEN(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define PANEL 8
#define WIDEN(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#else
#error "f16_rows needs AVX-512F, or AVX2 with F16C and FMA"
#endif
#define MAX_ROWS 8
/* The panel's weights asked for this many elements ahead (1 KB): without it the loop read
 * d20's matrices for 8 rows in 66 ms, with it in 53-54 (2048 ahead: the same). */
#define PREFETCH_AHEAD 512

typedef float vec __attribute__((vector_size(PANEL * sizeof(float))));
typedef float vec_u __attribute__((vector_size(PANEL * sizeof(float)), aligned(sizeof(float))));

int f16_rows_panel(void) { return PANEL; }
int f16_rows_max(void) { return MAX_ROWS; }

/* One panel's columns j..j+PANEL of y for every row; inlined with `rows` a constant where
 * it can be, so the loop over the rows unrolls into registers. */
static inline __attribute__((always_inline)) void panel(const float *x, long rows,
                                                        const uint16_t *p, long k, float *y,
                                                        long ld_y) {
    vec acc[MAX_ROWS];
    for (int n = 0; n < MAX_ROWS; n++) acc[n] = (vec){0};
    for (long i = 0; i < k; i++, p += PANEL) {
        _mm_prefetch((const char *)(p + PREFETCH_AHEAD), _MM_HINT_T0);
        vec w = (vec)WIDEN(p);
        for (int n = 0; n < rows; n++) acc[n] += x[n * k + i] * w;
    }
    for (int n = 0; n < rows; n++) *(vec_u *)(y + n * ld_y) = acc[n];
}

/* x (rows, k) fp32, panels (n_out / PANEL, k, PANEL) fp16, y (rows, n_out) fp32; rows in
 * 1..MAX_ROWS and n_out a multiple of PANEL (the caller checks). */
void f16_rows(const float *x, long rows, const uint16_t *panels, float *y, long n_out, long k) {
#pragma omp parallel for schedule(static)
    for (long b = 0; b < n_out / PANEL; b++) {
        const uint16_t *p = panels + b * k * PANEL;
        float *yb = y + b * PANEL;
        switch (rows) { /* each count its own unrolled loop, the sums in registers */
        case 1: panel(x, 1, p, k, yb, n_out); break;
        case 2: panel(x, 2, p, k, yb, n_out); break;
        case 3: panel(x, 3, p, k, yb, n_out); break;
        case 4: panel(x, 4, p, k, yb, n_out); break;
        case 5: panel(x, 5, p, k, yb, n_out); break;
        case 6: panel(x, 6, p, k, yb, n_out); break;
        case 7: panel(x, 7, p, k, yb, n_out); break;
        default: panel(x, MAX_ROWS, p, k, yb, n_out);
        }
    }
}
