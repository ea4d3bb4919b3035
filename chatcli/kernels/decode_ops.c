/* The middle of a small model's one-row decode step, per layer, in one call: rotary
 * embedding and RMS norm of every q and k head, k and v written into the layer's cache at
 * `pos`, and softmax attention of each q head over positions start..pos.
 *
 * Why: for a model of a few million weights each of these ~20 torch ops costs ~2-3 us to
 * dispatch and next to nothing to compute (docs/performance.md); on a 2-core Xeon the
 * embedded model's step spent more in them than in its products. Same arithmetic as
 * decode_step.DecodeStep._one_row, fp32, in another order of the sums (within 1e-6).
 *
 * Plain C for any CPU with a C compiler: -O3 -march=native vectorizes the loops written
 * with eight partial sums (no -ffast-math: the order of the sums is the one written here).
 * Compiled at first use by chatcli/native_kernels.py. Returns 0, or -1 (nothing written)
 * for shapes it does not take or when its scratch cannot be allocated.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define LANES 8

static float dot(const float *a, const float *b, long n) {
    float acc[LANES] = {0};
    long j = 0;
    for (; j + LANES <= n; j += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[j + l] * b[j + l];
    float s = 0.0f;
    for (int l = 0; l < LANES; l++) s += acc[l];
    for (; j < n; j++) s += a[j] * b[j];
    return s;
}

/* qk: (n_q + n_kv, d) heads before rotary; v: (n_kv, d); cos_, sin_: (d,) this position's.
 * k_layer, v_layer: this layer's cache of the row, (positions, n_kv, d), written at pos.
 * y: (n_q, d) the attention's output. norm_scale, norm_eps: each head is multiplied by
 * 1 / sqrt(norm_eps + norm_scale * sum(head^2)). att_scale: the scores' factor. */
int attend_one_row(const float *qk, const float *v, const float *cos_, const float *sin_,
                   float *k_layer, float *v_layer, float *y, long n_q, long n_kv, long d,
                   long pos, long start, float norm_scale, float norm_eps, float att_scale) {
    long half = d / 2, row = n_kv * d, group = n_q / n_kv, n = pos - start + 1;
    if (d % 2 || n < 1 || start < 0 || n_kv < 1 || n_q % n_kv) return -1;
    /* On the heap: a long window on a server's worker thread must not meet its stack. */
    float *q = malloc(sizeof(float) * (n_q * d + n));
    if (!q) return -1;
    float *p = q + n_q * d;
    float *k_out = k_layer + pos * row;
    for (long h = 0; h < n_q + n_kv; h++) {
        const float *x = qk + h * d;
        float *o = h < n_q ? q + h * d : k_out + (h - n_q) * d;
        for (long j = 0; j < half; j++) {
            o[j] = x[j] * cos_[j] + x[j + half] * sin_[j];
            o[j + half] = x[j + half] * cos_[j + half] - x[j] * sin_[j + half];
        }
        float s = 1.0f / sqrtf(norm_eps + norm_scale * dot(o, o, d));
        for (long j = 0; j < d; j++) o[j] *= s;
    }
    memcpy(v_layer + pos * row, v, sizeof(float) * row);
    for (long h = 0; h < n_q; h++) {
        const float *qh = q + h * d;
        long g = h / group;
        float top = -INFINITY, total = 0.0f;
        for (long t = 0; t < n; t++) {
            p[t] = att_scale * dot(qh, k_layer + (start + t) * row + g * d, d);
            top = p[t] > top ? p[t] : top;
        }
        for (long t = 0; t < n; t++) total += p[t] = expf(p[t] - top);
        float *out = y + h * d;
        memset(out, 0, sizeof(float) * d);
        for (long t = 0; t < n; t++) {
            const float *vt = v_layer + (start + t) * row + g * d;
            for (long j = 0; j < d; j++) out[j] += p[t] * vt[j];
        }
        for (long j = 0; j < d; j++) out[j] /= total;
    }
    free(q);
    return 0;
}
