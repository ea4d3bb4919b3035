/* A few fp32 rows times an fp16 matrix: y[n][j] = sum_k x[n][k] * w[j][k], n < rows <= 8.
 *
 * Why: a big model's sample rows (8 over one prompt) multiply every matrix by 8 rows a
 * step. That is no longer a stream of weights but arithmetic: d20's matrices are 477M
 * weights, 3.8G multiply-adds for 8 rows, which two Zen 3 cores do in ~37 ms at their FMA
 * peak. fbgemm's fp16 GEMM took 75-82 ms for them; this loop takes 52-54 (one-off ABBA
 * rounds, two threads; quantize.Fp16Weight's docstring has the numbers).
 *
 * How: the matrix is packed once (f16_rows.py: F16Rows.pack) in panels of PANEL columns,
 * each panel (K, PANEL) contiguous, so a pass reads its weights in order. For each input k
 * the panel's PANEL weights are widened to fp32 once (vcvtph2ps) and multiplied into every
 * row's own sums with x[n][k] broadcast: one load and one conversion serve `rows` FMAs, and
 * the rows' 8 sums are the independent chains that keep both FMA pipes busy.
 *
 * Compiled on the user's machine at first use (build.py) for its CPU: PANEL is lanes.h's
 * VW (16 with AVX-512F, 8 with AVX2 + F16C + FMA, 4 with aarch64's NEON), where the CPU
 * widens fp16 in hardware (lanes.h's WIDENS_HALF); elsewhere it does not compile and
 * chatcli keeps torch's kernel. Threads: team.h's (OpenMP in torch's libgomp, or our own
 * pool), `threads` of them (the caller passes torch.get_num_threads()).
 */
#include <stdint.h>

#include "lanes.h"
#include "team.h"

#if !WIDENS_HALF
#error "f16_rows needs a CPU that widens fp16 in hardware: x86 with AVX2, F16C and FMA, or AVX-512F, or aarch64"
#endif
#define PANEL VW
#define WIDEN(p) widen_half((const unsigned short *)(p))
#define MAX_ROWS 8
/* The panel's weights asked for this many elements ahead (1 KB): without it the loop read
 * d20's matrices for 8 rows in 66 ms, with it in 53-54 (2048 ahead: the same). */
#define PREFETCH_AHEAD 512

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
        __builtin_prefetch(p + PREFETCH_AHEAD);
        vec w = (vec)WIDEN(p);
        for (int n = 0; n < rows; n++) acc[n] += x[n * k + i] * w;
    }
    for (int n = 0; n < rows; n++) *(vec_u *)(y + n * ld_y) = acc[n];
}

struct rows_call {
    const float *x;
    long rows;
    const uint16_t *panels;
    float *y;
    long n_out, k;
};

static void rows_team(void *arg) {
    const struct rows_call *a = arg;
    const float *x = a->x;
    long rows = a->rows, n_out = a->n_out, k = a->k;
    TEAM_FOR(b, n_out / PANEL) {
        const uint16_t *p = a->panels + b * k * PANEL;
        float *yb = a->y + b * PANEL;
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

/* x (rows, k) fp32, panels (n_out / PANEL, k, PANEL) fp16, y (rows, n_out) fp32; rows in
 * 1..MAX_ROWS and n_out a multiple of PANEL (the caller checks); on `threads` threads. */
void f16_rows(const float *x, long rows, const uint16_t *panels, float *y, long n_out, long k,
              int threads) {
    struct rows_call call = {x, rows, panels, y, n_out, k};
    team_run(threads, rows_team, &call);
}
