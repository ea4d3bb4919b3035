/* One row times an fp16 matrix, fp32 in and out: y[n] = sum_k w[n][k] * x[k].
 *
 * Compiled on the user's machine at first use (build.py), loaded through ctypes. Written for
 * batch-1 decode of a big model, which is a stream of weights from memory: fbgemm's fp16 GEMM read d20's matrices at
 * 21 GB/s on a 2-core Xeon whose fp32 sgemv streams 31, and this loop at 27-30. What makes
 * the difference is the software prefetch PREFETCH_AHEAD elements ahead in each of the four
 * rows read at once: without it the same loop read at 21.
 *
 * Threads: team.h's (OpenMP in torch's libgomp, or our own pool), `threads` of them (the
 * caller passes torch.get_num_threads()). AVX-512F's loop below is the one measured; where
 * the CPU has no AVX-512 but widens fp16 in hardware (lanes.h: aarch64's NEON; x86 with
 * F16C, which chatcli leaves to fbgemm) the same loop in lanes.h's vectors. N must be a
 * multiple of ROWS and K of STEP (the loader checks).
 */
#include <stdint.h>

#include "lanes.h"
#include "team.h"

#if !WIDENS_HALF
#error "f16_matvec needs a CPU that widens fp16 in hardware (AVX-512F, F16C or aarch64)"
#endif

#define ROWS 4
#define PREFETCH_AHEAD 512

struct matvec_call {
    const float *x;
    const uint16_t *w;
    float *y;
    long n_rows, k;
};

#if VW == 16
#define STEP 32
#define WIDEN(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))

static void matvec_team(void *arg) {
    const struct matvec_call *a = arg;
    const float *x = a->x;
    long k = a->k;
    float *y = a->y;
    TEAM_FOR(b, a->n_rows / ROWS) {
        long n = b * ROWS;
        const uint16_t *r0 = a->w + n * k, *r1 = r0 + k, *r2 = r1 + k, *r3 = r2 + k;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (long i = 0; i < k; i += STEP) {
            _mm_prefetch((const char *)(r0 + i + PREFETCH_AHEAD), _MM_HINT_T0);
            _mm_prefetch((const char *)(r1 + i + PREFETCH_AHEAD), _MM_HINT_T0);
            _mm_prefetch((const char *)(r2 + i + PREFETCH_AHEAD), _MM_HINT_T0);
            _mm_prefetch((const char *)(r3 + i + PREFETCH_AHEAD), _MM_HINT_T0);
            __m512 x0 = _mm512_loadu_ps(x + i), x1 = _mm512_loadu_ps(x + i + 16);
            a0 = _mm512_fmadd_ps(WIDEN(r0 + i), x0, a0);
            a1 = _mm512_fmadd_ps(WIDEN(r1 + i), x0, a1);
            a2 = _mm512_fmadd_ps(WIDEN(r2 + i), x0, a2);
            a3 = _mm512_fmadd_ps(WIDEN(r3 + i), x0, a3);
            a0 = _mm512_fmadd_ps(WIDEN(r0 + i + 16), x1, a0);
            a1 = _mm512_fmadd_ps(WIDEN(r1 + i + 16), x1, a1);
            a2 = _mm512_fmadd_ps(WIDEN(r2 + i + 16), x1, a2);
            a3 = _mm512_fmadd_ps(WIDEN(r3 + i + 16), x1, a3);
        }
        y[n] = _mm512_reduce_add_ps(a0);
        y[n + 1] = _mm512_reduce_add_ps(a1);
        y[n + 2] = _mm512_reduce_add_ps(a2);
        y[n + 3] = _mm512_reduce_add_ps(a3);
    }
}
#else
#define STEP (2 * VW)

static float lanes_total(vec v) {
    float s = 0.0f;
    for (int l = 0; l < VW; l++) s += v[l];
    return s;
}

static void matvec_team(void *arg) {
    const struct matvec_call *a = arg;
    const float *x = a->x;
    long k = a->k;
    TEAM_FOR(b, a->n_rows / ROWS) {
        long n = b * ROWS;
        const uint16_t *r[ROWS] = {a->w + n * k, a->w + (n + 1) * k, a->w + (n + 2) * k,
                                   a->w + (n + 3) * k};
        vec acc[ROWS] = {{0}};
        for (long i = 0; i < k; i += STEP) {
            vec x0 = *(const vec_u *)(x + i), x1 = *(const vec_u *)(x + i + VW);
            for (int j = 0; j < ROWS; j++) {
                __builtin_prefetch(r[j] + i + PREFETCH_AHEAD);
                acc[j] += widen_half(r[j] + i) * x0 + widen_half(r[j] + i + VW) * x1;
            }
        }
        for (int j = 0; j < ROWS; j++) a->y[n + j] = lanes_total(acc[j]);
    }
}
#endif

int f16_matvec_rows(void) { return ROWS; }
int f16_matvec_step(void) { return STEP; }

void f16_matvec(const float *x, const uint16_t *w, float *y, long n_rows, long k, int threads) {
    struct matvec_call call = {x, w, y, n_rows, k};
    team_run(threads, matvec_team, &call);
}
