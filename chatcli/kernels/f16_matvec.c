/* One row times an fp16 matrix, fp32 in and out: y[n] = sum_k w[n][k] * x[k].
 *
 * Compiled on the user's machine at first use (chatcli/native_kernels.py) with
 * -O3 -march=native -fopenmp, loaded through ctypes. Written for batch-1 decode of a big
 * model, which is a stream of weights from memory: fbgemm's fp16 GEMM read d20's matrices at
 * 21 GB/s on a 2-core Xeon whose fp32 sgemv streams 31, and this loop at 27-30. What makes
 * the difference is the software prefetch PREFETCH_AHEAD elements ahead in each of the four
 * rows read at once: without it the same loop read at 21.
 *
 * Threads: OpenMP, in the process's one libgomp (torch's, whose soname this library names),
 * so torch.set_num_threads sets how many share the rows.
 * Needs AVX-512F (vcvtph2ps on 16 lanes); elsewhere it does not compile and chatcli keeps
 * fbgemm's kernel. N must be a multiple of ROWS and K of STEP (the loader checks).
 */
#include <immintrin.h>
#include <stdint.h>

#ifndef __AVX512F__
#error "f16_matvec needs AVX-512F"
#endif

#define ROWS 4
#define STEP 32
#define PREFETCH_AHEAD 512

#define WIDEN(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))

int f16_matvec_rows(void) { return ROWS; }
int f16_matvec_step(void) { return STEP; }

void f16_matvec(const float *x, const uint16_t *w, float *y, long n_rows, long k) {
#pragma omp parallel for schedule(static)
    for (long n = 0; n < n_rows; n += ROWS) {
        const uint16_t *r0 = w + n * k, *r1 = r0 + k, *r2 = r1 + k, *r3 = r2 + k;
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
