/* rows_step: a model's whole decode step of one or more rows in one call: every layer
 * (lambdas, norms as per-row scales, q/k/v, value embeddings, rotary, qk-norm, the K/V
 * written at `pos`, attention over a shared prompt plus each row's own keys, the MLP),
 * or of independent sequences each at its own position and in its own slot of the cache
 * (rows_step_slots: a server's conversations decoding together),
 * then the vocabulary's products. fp32 matrices (a small model's), or fp16 ones (a big
 * model's compact copies) where the CPU widens them (lanes.h).
 *
 * Why: a small model's ~150 torch ops a step cost ~2-5 us each to dispatch and next to
 * nothing to compute (docs/performance.md); a big model's ~300 ops and their threads'
 * hand-offs took ~15 of d20's 52 ms a token around products that stream at the memory's
 * speed. Same arithmetic as decode_step.DecodeStep._step with its norms folded, fp32 sums
 * in another order (within 1e-6 of torch's).
 *
 * Plain C for any CPU with a C compiler: -O3 and the CPU's flag (-march=native, -mcpu=native)
 * vectorize the loops (no -ffast-math: the order of the sums is the one written here).
 * Compiled at first use by chatcli/kernels/build.py. Returns 0, or -1 (nothing written) for shapes it does not take
 * or when its scratch cannot be allocated.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "lanes.h"
#include "team.h"

/* Built with -DROWS_STEP_PHASES (scripts/rows_step_phases.py, never chatcli), the first
 * thread adds each phase's time, its barrier included, to rows_step_phases()[phase]. */
#ifdef ROWS_STEP_PHASES
#include <omp.h>
static double phase_seconds[16], phase_start;
double *rows_step_phases(void) { return phase_seconds; }
#define PHASE(i)                                                                               \
    do {                                                                                       \
        if (omp_get_thread_num() == 0) {                                                       \
            double now_ = omp_get_wtime();                                                     \
            if ((i) >= 0) phase_seconds[i] += now_ - phase_start;                              \
            phase_start = now_;                                                                \
        }                                                                                      \
    } while (0)
#else
#define PHASE(i) (void)0
#endif

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

/* ---- The products and the attention, for any number of rows. ----
 *
 * Why our own: the 8 sample rows' step of the embedded model spent ~60% of its ~3 ms in
 * MKL's sgemm at 8 rows (~60 GFLOP/s on a Zen 4 core, which this loop beats at ~85) and two
 * flash-attention calls a layer (~75 us each, mostly setup). The step is one team of
 * threads (team.h: OpenMP, or our own pool): each product split over the cores by columns,
 * the attention by rows and heads. Written with GCC's vector extension (lanes.h): 16 lanes
 * where the CPU has AVX-512, 8 with AVX, 4 with NEON or SSE. */

#define BLOCK (2 * VW) /* the columns one pass of a product accumulates */
/* The rows one pass accumulates, two vectors of sums each: with 32 registers (AVX-512,
 * aarch64), 16 of them; with 16 (AVX2, SSE), 12, beside two weights and a broadcast input.
 * 8 rows there spilled two sums to the stack, a store and a load in each input's chain. */
#if LANE_REGISTERS == 32
#define MAX_ROWS 8
#else
#define MAX_ROWS 6
#endif

static vec relu(vec a) { return (vec)((mask)a & (a > (vec){0})); }

/* The lanes of a vector in pairs `width` apart swapped (width a power of 2 below VW). */
#define L4(b, w) (b) ^ (w), ((b) + 1) ^ (w), ((b) + 2) ^ (w), ((b) + 3) ^ (w)
#if VW == 16
#define XOR_LANES(w) L4(0, w), L4(4, w), L4(8, w), L4(12, w)
#elif VW == 8
#define XOR_LANES(w) L4(0, w), L4(4, w)
#else
#define XOR_LANES(w) L4(0, w)
#endif
#ifdef __clang__
#define SWAPPED(v, w) __builtin_shufflevector(v, v, XOR_LANES(w))
#else
#define SWAPPED(v, w) __builtin_shuffle(v, (mask){XOR_LANES(w)})
#endif

/* The sum of v's lanes: halves folded onto each other (log2 VW shuffles and adds, where a
 * lane at a time took VW - 1 dependent adds; the scores spent most of their time there). */
static float lane_sum(vec v) {
#if VW == 16
    v += SWAPPED(v, 8);
#endif
#if VW >= 8
    v += SWAPPED(v, 4);
#endif
    v += SWAPPED(v, 2);
    v += SWAPPED(v, 1);
    return v[0];
}

/* One layer: each product's matrix (in, out) packed in panels (product), and the layer's
 * constants. */
struct rows_layer {
    const void *qkv;      /* (C, (H + 2 Hkv) D): c_q, c_k, c_v stacked */
    const void *proj;     /* (H D, C) */
    const void *fc;       /* (C, F) */
    const void *fc_proj;  /* (F, C) */
    const float *ve_gate; /* (Hkv, ve_channels), or NULL in a layer without value embeddings */
    const void *ve_table; /* (vocabulary, Hkv D) value embeddings (fp32 or bf16), or NULL */
    long window;           /* keys further back than this are not attended */
    float resid_lambda, x0_lambda; /* x = resid_lambda x + x0_lambda x0 before the layer */
};

/* The model: its layers, the vocabulary's matrix and the constants every layer shares. */
struct rows_model {
    const struct rows_layer *layers;
    long n_layers;
    const void *lm_head; /* (C, V), packed */
    long C, F, H, Hkv, D, ve_channels, V;
    float ve_scale, eps, norm_scale, norm_eps, att_scale, softcap;
    long backout_layer; /* x -= backout_lambda * (x after this layer) at the end; -1: none */
    float backout_lambda;
    long half;       /* 0: fp32 panels; every matrix narrow: 1 fp16, 2 int8, 3 int4 */
    long bf16_table; /* 1: the value embeddings bf16 (a checkpoint's, kept so); 0: fp32 */
};

enum epilogue { STORE_SCALED, ADD, RELU_SQUARED, STORE };

/* A matrix in memory: element (i, j) at p[i * ld + j]. */
struct view {
    const float *p;
    long ld;
};

/* The sums of x[n] @ w's columns j..j+BLOCK over the inputs k0..in-1, n < rows: inlined
 * into each caller with `rows` a constant where it can be, so the loop over the rows
 * unrolls into registers without a test per row. The weights' rows PREFETCH_ROWS ahead
 * are asked for early: a step reads ~11 MB of them, more than a core's L2 holds, and a
 * neighbour on a shared host can leave little of them in L3. 128 rows (8 KB, into the
 * next panel) where 24 left 8 rows' passes, 6 cycles an input, waiting on their loads:
 * the embedded model's 8-row step 0.88x the time, one row 0.98x on two Zen 3 cores
 * (scripts/ab_rows_step.py --rounds 24). */
#define PREFETCH_ROWS 128
static inline __attribute__((always_inline)) void sum_rows(struct view x, long rows, long k0,
                                                           long in, struct view w, long j,
                                                           vec *lo, vec *hi) {
    const float *wk = w.p + k0 * w.ld + j;
    for (long k = k0; k < in; k++, wk += w.ld) {
        __builtin_prefetch(wk + PREFETCH_ROWS * w.ld);
        __builtin_prefetch(wk + PREFETCH_ROWS * w.ld + VW);
        vec w0 = *(const vec_u *)wk, w1 = *(const vec_u *)(wk + VW);
        IN_REGISTER(w0);
        IN_REGISTER(w1);
        for (int n = 0; n < rows; n++) {
            float xv = x.p[n * x.ld + k];
            lo[n] += xv * w0;
            hi[n] += xv * w1;
        }
    }
}

/* sum_rows for two rows, whose four sums are half what the FMA's latency (4 cycles on a
 * Zen 3) times its two ports needs: inputs k and k + 1 go into sums of their own, added
 * at the end (192x768: 12.7 against 9.9 us; 8 rows, a pass of 6 then one of 2: 31 against
 * 27). Three rows' twelve sums would leave too few registers for the weights. */
static inline __attribute__((always_inline)) void sum_two_rows(struct view x, long in,
                                                               struct view w, long j, vec *lo,
                                                               vec *hi) {
    vec lo2[2] = {{0}}, hi2[2] = {{0}};
    const float *wk = w.p + j;
    long k = 0;
    for (; k + 2 <= in; k += 2, wk += 2 * w.ld) {
        __builtin_prefetch(wk + PREFETCH_ROWS * w.ld);
        __builtin_prefetch(wk + PREFETCH_ROWS * w.ld + VW);
        __builtin_prefetch(wk + (PREFETCH_ROWS + 1) * w.ld);
        __builtin_prefetch(wk + (PREFETCH_ROWS + 1) * w.ld + VW);
        vec w0 = *(const vec_u *)wk, w1 = *(const vec_u *)(wk + VW);
        vec v0 = *(const vec_u *)(wk + w.ld), v1 = *(const vec_u *)(wk + w.ld + VW);
        IN_REGISTER(w0);
        IN_REGISTER(w1);
        IN_REGISTER(v0);
        IN_REGISTER(v1);
        for (int n = 0; n < 2; n++) {
            float x0 = x.p[n * x.ld + k], x1 = x.p[n * x.ld + k + 1];
            lo[n] += x0 * w0;
            hi[n] += x0 * w1;
            lo2[n] += x1 * v0;
            hi2[n] += x1 * v1;
        }
    }
    for (int n = 0; n < 2; n++) lo[n] += lo2[n], hi[n] += hi2[n];
    sum_rows(x, 2, k, in, w, j, lo, hi);
}

static inline __attribute__((always_inline)) void store_block(long rows, const vec *lo,
                                                              const vec *hi, float *y,
                                                              long ld_y, const float *scale,
                                                              enum epilogue how, int both);

/* Columns j..j+BLOCK of y[n] for n < rows (at most MAX_ROWS): acc = x[n] @ w over `in`
 * inputs; then STORE_SCALED: y = scale[n] * acc; ADD: y += acc;
 * RELU_SQUARED: y = (scale[n] * relu(acc))^2; STORE: y = acc. */
static void product_block(struct view x, long rows, long in, struct view w, long j, float *y,
                          long ld_y, const float *scale, enum epilogue how) {
    vec lo[MAX_ROWS], hi[MAX_ROWS];
    for (int n = 0; n < MAX_ROWS; n++) lo[n] = hi[n] = (vec){0};
    long k = 0;
    if (rows == 1) { /* four inputs at a time into their own sums: one row's two sums would
                        wait on each other's adds (the FMA's latency), not on the weights */
        const float *wk = w.p + j;
        vec l1 = {0}, h1 = {0}, l2 = {0}, h2 = {0}, l3 = {0}, h3 = {0};
        for (; k + 4 <= in; k += 4, wk += 4 * w.ld) {
            const float *xk = x.p + k;
            __builtin_prefetch(wk + PREFETCH_ROWS * w.ld);
            __builtin_prefetch(wk + PREFETCH_ROWS * w.ld + VW);
            __builtin_prefetch(wk + (PREFETCH_ROWS + 2) * w.ld);
            __builtin_prefetch(wk + (PREFETCH_ROWS + 2) * w.ld + VW);
            lo[0] += xk[0] * *(const vec_u *)wk, hi[0] += xk[0] * *(const vec_u *)(wk + VW);
            l1 += xk[1] * *(const vec_u *)(wk + w.ld), h1 += xk[1] * *(const vec_u *)(wk + w.ld + VW);
            l2 += xk[2] * *(const vec_u *)(wk + 2 * w.ld);
            h2 += xk[2] * *(const vec_u *)(wk + 2 * w.ld + VW);
            l3 += xk[3] * *(const vec_u *)(wk + 3 * w.ld);
            h3 += xk[3] * *(const vec_u *)(wk + 3 * w.ld + VW);
        }
        lo[0] += (l1 + l2) + l3, hi[0] += (h1 + h2) + h3;
        sum_rows(x, 1, k, in, w, j, lo, hi);
    } else {
        switch (rows) { /* each count its own unrolled loop, the sums in registers */
        case 2: sum_two_rows(x, in, w, j, lo, hi); break;
        case 3: sum_rows(x, 3, 0, in, w, j, lo, hi); break;
        case 4: sum_rows(x, 4, 0, in, w, j, lo, hi); break;
        case 5: sum_rows(x, 5, 0, in, w, j, lo, hi); break;
        case 6: sum_rows(x, 6, 0, in, w, j, lo, hi); break;
#if MAX_ROWS == 8
        case 7: sum_rows(x, 7, 0, in, w, j, lo, hi); break;
        case 8: sum_rows(x, 8, 0, in, w, j, lo, hi); break;
#endif
        }
    }
    store_block(rows, lo, hi, y + j, ld_y, scale, how, 1);
}

/* The epilogue of a block of sums lo, hi (rows, BLOCK) into y's first BLOCK columns, or
 * of lo alone into its first VW (`both` 0). */
static inline __attribute__((always_inline)) void store_block(long rows, const vec *lo,
                                                              const vec *hi, float *y,
                                                              long ld_y, const float *scale,
                                                              enum epilogue how, int both) {
    for (long n = 0; n < rows; n++) {
        vec_u *a = (vec_u *)(y + n * ld_y), *b = (vec_u *)(y + n * ld_y + VW);
        if (how == ADD) {
            *a += lo[n];
            if (both) *b += hi[n];
        } else if (how == STORE) {
            *a = lo[n];
            if (both) *b = hi[n];
        } else if (how == STORE_SCALED) {
            *a = scale[n] * lo[n];
            if (both) *b = scale[n] * hi[n];
        } else {
            vec l = scale[n] * relu(lo[n]), h = scale[n] * relu(hi[n]);
            *a = l * l;
            if (both) *b = h * h;
        }
    }
}

/* y = the epilogue of acc, one element (product_block's, in scalars). */
static inline void store_one(float *y, float acc, float scale, enum epilogue how) {
    if (how == ADD) {
        *y += acc;
    } else if (how == STORE) {
        *y = acc;
    } else {
        float v = how == STORE_SCALED || acc > 0.0f ? scale * acc : 0.0f;
        *y = how == STORE_SCALED ? v : v * v;
    }
}

/* Columns j..out-1 (fewer than BLOCK) of the same product, a matrix whose width is not
 * whole blocks (a vocabulary's): copied into a block of zeros and summed as a whole block,
 * the epilogue on the columns that exist. Summed a column at a time (one chain of scalar
 * adds each), a shared prompt's last scores, which took this path before they were read
 * from panels, took ~6% of the embedded model's 8-row step, all on one thread while the
 * other waited. A column at a time where the copy cannot be made. */
static void product_tail(struct view x, long rows, long in, struct view w, long j, long out,
                         float *y, long ld_y, const float *scale, enum epilogue how) {
    long width = out - j;
    float *panel = calloc((size_t)in * BLOCK, sizeof(float));
    if (panel) {
        float sums[MAX_ROWS * BLOCK];
        for (long k = 0; k < in; k++)
            memcpy(panel + k * BLOCK, w.p + k * w.ld + j, sizeof(float) * width);
        for (long r = 0; r < rows; r += MAX_ROWS) {
            long n = rows - r < MAX_ROWS ? rows - r : MAX_ROWS;
            memset(sums, 0, sizeof sums);
            product_block((struct view){x.p + r * x.ld, x.ld}, n, in,
                          (struct view){panel, BLOCK}, 0, sums, BLOCK, NULL, ADD);
            for (long i = 0; i < n; i++)
                for (long c = 0; c < width; c++)
                    store_one(y + (r + i) * ld_y + j + c, sums[i * BLOCK + c],
                              scale ? scale[r + i] : 1.0f, how);
        }
        free(panel);
        return;
    }
    for (long n = 0; n < rows; n++) {
        for (long c = j; c < out; c++) {
            float acc = 0.0f;
            for (long k = 0; k < in; k++) acc += x.p[n * x.ld + k] * w.p[k * w.ld + c];
            store_one(y + n * ld_y + c, acc, scale ? scale[n] : 1.0f, how);
        }
    }
}

/* y (rows, width) from x (rows, in) @ w (in, width), w in panels of BLOCK columns,
 * panel_step floats apart (a shared prefix's keys or values, packed once for all its steps:
 * RowsStep.pack_prefix); the last panel's columns past `width` (zeros) are summed, not
 * stored. Called by one thread: an attention unit's product (attend).
 * Why panels: the cache's layout put a block's 16 columns of each input a whole position
 * (Hkv D floats) apart, one cache line per input from all over memory; d20's 8 rows spent
 * ~11 ms a step on a 512-token prefix's K/V that stream in ~4. */
static void panel_rows(struct view x, long rows, long in, const float *w, long panel_step,
                       long width, float *y, long ld_y, const float *scale, enum epilogue how) {
    for (long b = 0; b * BLOCK < width; b++) {
        struct view panel = {w + b * panel_step, BLOCK};
        float *yb = y + b * BLOCK;
        long cols = width - b * BLOCK < BLOCK ? width - b * BLOCK : BLOCK;
        for (long r = 0; r < rows; r += MAX_ROWS) {
            long n = rows - r < MAX_ROWS ? rows - r : MAX_ROWS;
            struct view xr = {x.p + r * x.ld, x.ld};
            if (cols == BLOCK) {
                product_block(xr, n, in, panel, 0, yb + r * ld_y, ld_y, scale ? scale + r : NULL,
                              how);
                continue;
            }
            float sums[MAX_ROWS * BLOCK] = {0}; /* a row's next columns are another's */
            product_block(xr, n, in, panel, 0, sums, BLOCK, NULL, ADD);
            for (long k = 0; k < n; k++)
                for (long c = 0; c < cols; c++)
                    store_one(yb + (r + k) * ld_y + c, sums[k * BLOCK + c],
                              scale ? scale[r + k] : 1.0f, how);
        }
    }
}

int rows_block(void) { return BLOCK; }

/* y (rows, out) from x (rows, in) @ a model's matrix packed in panels (rows_block() columns
 * each, every panel's (in, BLOCK) contiguous, then the last out % BLOCK columns as one
 * (in, out % BLOCK) panel): each pass reads its weights in order, where the (in, out)
 * matrix's columns were read a row apart, a stride the prefetchers and the TLB served
 * worse. The panels are shared by the team's threads (an orphaned `omp for`). */
static void product(const float *x, long rows, long in, const float *panels, long out,
                    float *y, const float *scale, enum epilogue how) {
    long blocks = out / BLOCK, last = blocks + (out % BLOCK != 0), rest = out - blocks * BLOCK;
    struct view xv = {x, in};
    TEAM_FOR(b, last) {
        const float *panel = panels + b * in * BLOCK;
        if (b == blocks) {
            product_tail(xv, rows, in, (struct view){panel, rest}, 0, rest, y + b * BLOCK, out,
                         scale, how);
            continue;
        }
        for (long r = 0; r < rows; r += MAX_ROWS)
            product_block((struct view){x + r * in, in}, rows - r < MAX_ROWS ? rows - r : MAX_ROWS,
                          in, (struct view){panel, BLOCK}, 0, y + r * out + b * BLOCK, out,
                          scale ? scale + r : NULL, how);
    }
}

/* ---- Narrow weights: a big model's compact copies, fp16 (quantize.Fp16Weight) or int8
 * (quantize.Int8Weight). ----
 *
 * Why: a big model's batch-1 step streams its weights, and between torch's ~300 ops a
 * token d20's fp16 products (fbgemm's, at the memory's speed) left ~15 of 52 ms to
 * dispatch, small ops and threads waiting for each other. Here the whole step is one call.
 * Read from f16_rows.c's panels (panels.pack_panels of the (in, out) matrix in VW
 * columns: (out / VW, in, VW), the copy's own, so no memory is added): a block of BLOCK
 * columns is two panels side by side, each input's 2 VW weights widened to fp32 once for
 * every row (F16C's conversion; int8's sign extension and conversion, exact). int8's
 * buffer is its `out` fp32 scales (one an output column) then its panels of codes
 * (panels.Int8Panels): the sums are of x times the codes, each column's scale
 * applied once at the end, so int8 reads a byte a weight where fp16 reads two. Where the
 * CPU cannot widen them (x86 without F16C; without AVX2 for int8: lanes.h) a model of such
 * matrices is refused
 * (rows_half_panel(), rows_int8_panel() 0) and chatcli keeps torch's ops. */
enum narrow { FP16 = 1, INT8 = 2, INT4 = 3 }; /* rows_model.half */
#if WIDENS_HALF
#define HALF_WEIGHTS 1
#define INT8_WEIGHTS WIDENS_INT8
#define HALF_ROWS 8 /* the rows of a pass: 8 where 16 registers take them a panel at a time */

/* Weight vector i (VW weights, i VW elements in) of a narrow panel, widened to fp32. */
static inline __attribute__((always_inline)) vec narrow_at(const void *p, long i,
                                                           enum narrow kind) {
    if (kind == FP16) return widen_half((const unsigned short *)p + i * VW);
    return widen_int8((const signed char *)p + i * VW);
}

/* The panels' bytes ahead asked for early: 24 fp16 rows of a panel, what lets two cores
 * stream d20's matrices at 26-27 GB/s on a Zen 3 whose measured streaming read is 26.7
 * (fp32's 128 rows took 1.08x the time of a d20 row). int8 asks for four times the bytes,
 * 192 of its rows: its loop consumes a row's bytes in fewer cycles, so the same distance
 * in bytes is less time ahead (d20's one-row int8 step 0.79x the time at one thread, 1536
 * bytes 0.90x; docs/performance-notes.md, "int8 and int4 at the roofline"). -D to try another
 * (scripts/ab_kernel_builds.py). */
#define HALF_PREFETCH_BYTES (24 * VW * 2)
#ifndef INT8_PREFETCH_BYTES
#define INT8_PREFETCH_BYTES (4 * HALF_PREFETCH_BYTES)
#endif

/* The sums of x[n] @ a block's columns over its panels p0 and p1 (in, VW) each, n < rows:
 * one row four inputs at a time into their own sums (the FMA's latency, as for fp32),
 * several rows an input at a time (their sums are the independent chains). */
static inline __attribute__((always_inline)) void sum_half(struct view x, long rows, long in,
                                                           const void *p0, const void *p1,
                                                           enum narrow kind, vec *lo,
                                                           vec *hi) {
    const long size = kind == FP16 ? 2 : 1, row = VW * size; /* bytes of a panel's row */
    const long ahead = kind == FP16 ? HALF_PREFETCH_BYTES : INT8_PREFETCH_BYTES;
    const char *a0 = p0, *b0 = p1;
    long k = 0;
    if (rows == 1) {
        vec l1 = {0}, h1 = {0}, l2 = {0}, h2 = {0}, l3 = {0}, h3 = {0};
        for (; k + 4 <= in; k += 4) {
            const float *xk = x.p + k;
            const char *a = a0 + k * row, *b = b0 + k * row;
            __builtin_prefetch(a + ahead);
            __builtin_prefetch(b + ahead);
            if (4 * row > 64) { /* 4 rows of a 16-wide fp16 panel are two cache lines:
                                   asking for one left d20's one-row step 1.45x the time
                                   on a Zen 4 */
                __builtin_prefetch(a + ahead + 64);
                __builtin_prefetch(b + ahead + 64);
            }
            lo[0] += xk[0] * narrow_at(a, 0, kind), hi[0] += xk[0] * narrow_at(b, 0, kind);
            l1 += xk[1] * narrow_at(a, 1, kind), h1 += xk[1] * narrow_at(b, 1, kind);
            l2 += xk[2] * narrow_at(a, 2, kind), h2 += xk[2] * narrow_at(b, 2, kind);
            l3 += xk[3] * narrow_at(a, 3, kind), h3 += xk[3] * narrow_at(b, 3, kind);
        }
        lo[0] += (l1 + l2) + l3, hi[0] += (h1 + h2) + h3;
    }
    for (; k < in; k++) {
        __builtin_prefetch(a0 + k * row + ahead);
        __builtin_prefetch(b0 + k * row + ahead);
        vec w0 = narrow_at(a0, k, kind), w1 = narrow_at(b0, k, kind);
        for (int n = 0; n < rows; n++) {
            float xv = x.p[n * x.ld + k];
            lo[n] += xv * w0;
            hi[n] += xv * w1;
        }
    }
}

/* The sums of x[n] @ one panel's VW columns, n < rows, one vector a row: for 7 or 8 rows
 * with 16 vector registers, where a block's two panels at once would spill sums (and a
 * pass of 6 then one of 2 widened each weight twice): 8 rows of d20's matrices 55-61 ms
 * against 59-64 on two Zen 3 cores (our f16_rows' loop). One panel is half a block's bytes
 * an input, so the prefetch reaches twice as many inputs ahead for the same distance. */
static inline __attribute__((always_inline)) void sum_half_panel(struct view x, long rows,
                                                                 long in, const void *p,
                                                                 enum narrow kind, vec *acc) {
    const long row = VW * (kind == FP16 ? 2 : 1);
    for (long k = 0; k < in; k++) {
        __builtin_prefetch((const char *)p + k * row + 2 * HALF_PREFETCH_BYTES);
        vec w = narrow_at(p, k, kind);
        for (int n = 0; n < rows; n++) acc[n] += x.p[n * x.ld + k] * w;
    }
}

/* A block's sums of `n` rows (at most HALF_ROWS), each count its own unrolled loop with
 * the sums in registers. */
static inline __attribute__((always_inline)) void sum_narrow(struct view x, long n, long in,
                                                             const void *p0, const void *p1,
                                                             enum narrow kind, vec *lo,
                                                             vec *hi) {
    switch (n) {
    case 1: sum_half(x, 1, in, p0, p1, kind, lo, hi); break;
    case 2: sum_half(x, 2, in, p0, p1, kind, lo, hi); break;
    case 3: sum_half(x, 3, in, p0, p1, kind, lo, hi); break;
    case 4: sum_half(x, 4, in, p0, p1, kind, lo, hi); break;
    case 5: sum_half(x, 5, in, p0, p1, kind, lo, hi); break;
    case 6: sum_half(x, 6, in, p0, p1, kind, lo, hi); break;
#if MAX_ROWS == 8
    case 7: sum_half(x, 7, in, p0, p1, kind, lo, hi); break;
    case 8: sum_half(x, 8, in, p0, p1, kind, lo, hi); break;
#else
    case 7:
        sum_half_panel(x, 7, in, p0, kind, lo);
        if (p1 != p0) sum_half_panel(x, 7, in, p1, kind, hi);
        break;
    case 8:
        sum_half_panel(x, 8, in, p0, kind, lo);
        if (p1 != p0) sum_half_panel(x, 8, in, p1, kind, hi);
        break;
#endif
    }
}

/* A compact copy's own product outside a whole step (rows_int8_product, rows_int4_product):
 * its arguments, handed to each thread of the team. */
struct product_call {
    const float *x;
    long rows, in;
    const void *w;
    long out;
    float *y;
    enum narrow kind;
};

#if DOT_INT8
/* int8 products as integer dot products (lanes.h's dot_int8), where the CPU has them.
 *
 * Why: per VW weights the widening loop spends a sign extension, a conversion and an FMA,
 * where the memory left little room: d20's one-row int8 step read its weights at 0.83 of
 * the roofline, 0.865 this way (docs/performance-notes.md, "int8 and int4 at the
 * roofline"). Here each row's
 * activations become integers exactly enough to stand in for fp32: v = x / unit rounded,
 * |v| <= DIGIT_LIMIT (23 bits, fp32's mantissa, against the row's largest |x|), written in
 * three signed base-256 digits v = d0 + 256 d1 + 65536 d2. Each digit plane's products
 * with the codes are exact in 32-bit sums (flushed to doubles every DOT_CHUNK inputs, before
 * they could overflow), so a column's sum is exact up to the rounding of x to 23 bits:
 * sum_k v_k code_kj = A0 + 256 A1 + 65536 A2 - DOT_OFFSET sum_k v_k, then times unit and
 * the column's scale. Three instructions cover 4 VW weights where twelve did. */
/* Where a panel's stream asks for bytes ahead (offset `at` in it): past its end, the same
 * offset into its counterpart of the next block. A thread takes consecutive blocks (p0, p1,
 * p0', p1', ...), so read straight on, p0's look-ahead would land in the p1 being read and
 * p1's in p0', leaving p1' unasked for at every block's start: int4's blocks of d20's fc
 * are 22 KB, under a microsecond of streaming, so each start's wait weighed. */
#ifndef NEXT_BLOCK_PREFETCH
#define NEXT_BLOCK_PREFETCH 1
#endif
static inline long ahead_in_block(long at, long panel_bytes) {
    return NEXT_BLOCK_PREFETCH && at >= panel_bytes ? at + panel_bytes : at;
}

#define DIGIT_LIMIT 8323072.0f /* 127 * 65536: the top digit never leaves [-128, 127] */
#define DOT_CHUNK 32768        /* inputs: 4 * 255 * 128 * DOT_CHUNK / 4 < 2^31 */
#if LANE_REGISTERS == 32
#define DOT_ROWS 4 /* rows a pass: 4 rows * 3 digits * 2 panels = 24 sums, 2 weights */
#else
#define DOT_ROWS 2
#endif

/* A thread's scratch for the rows it multiplies (int8's and int4's products alike): their
 * digits, and their sums and units, grown as asked and kept for its next product. */
static __thread signed char *digit_scratch;
static __thread long digit_scratch_bytes;
static __thread double *sum_scratch;
static __thread long sum_scratch_count;

static signed char *digits_for(long bytes) {
    if (bytes > digit_scratch_bytes) {
        free(digit_scratch);
        digit_scratch = malloc(bytes), digit_scratch_bytes = bytes;
    }
    return digit_scratch;
}

static double *sums_for(long count) {
    if (count > sum_scratch_count) {
        free(sum_scratch);
        sum_scratch = malloc(count * sizeof *sum_scratch), sum_scratch_count = count;
    }
    return sum_scratch;
}

/* Row x of `in` inputs as integers v = x / unit rounded, |v| <= limit, in `planes` signed
 * base-256 digits (plane b at d + b n; inputs in..n-1 are 0); sums[g]: the sum of v over
 * inputs g group..(g + 1) group - 1 (n whole groups). Returns the unit. */
static double row_digits(const float *x, long in, long n, int planes, float limit,
                         signed char *d, long group, double *sums) {
    float largest = 0;
    for (long k = 0; k < in; k++) largest = fmaxf(largest, fabsf(x[k]));
    float u = largest > 0 ? largest / limit : 1.0f, inv = 1.0f / u;
    for (long g = 0; g < n / group; g++) {
        long sum = 0;
        for (long k = g * group; k < (g + 1) * group; k++) {
            long v = 0;
            if (k < in) {
                float f = x[k] * inv;
                v = lrintf(f > limit ? limit : f < -limit ? -limit : f);
            }
            sum += v;
            long rest = v;
            for (int b = 0; b < planes; b++) {
                long digit = b + 1 < planes ? ((rest + 128) & 255) - 128 : rest;
                d[b * n + k] = (signed char)digit;
                rest = (rest - digit) / 256;
            }
        }
        sums[g] = (double)sum;
    }
    return u;
}

/* The sums of `rows` rows' digits (row stride 3 n bytes, n = 4 in4) @ a block's panels
 * p0, p1 over groups g0..g1, into the double sums lo, hi (the digits' planes combined). */
static inline __attribute__((always_inline)) void sum_dot(const signed char *d, long rows,
                                                          long n, long g0, long g1,
                                                          const unsigned char *p0,
                                                          const unsigned char *p1, dvec *lo,
                                                          dvec *hi) {
    ivec a[DOT_ROWS][3][2];
    for (int r = 0; r < DOT_ROWS; r++)
        for (int b = 0; b < 3; b++) a[r][b][0] = a[r][b][1] = (ivec){0};
    const long group = 4 * VW, panel_bytes = n * VW;
    for (long g = g0; g < g1; g++) {
        const long ahead = ahead_in_block(g * group + INT8_PREFETCH_BYTES, panel_bytes);
        __builtin_prefetch(p0 + ahead);
        __builtin_prefetch(p1 + ahead);
        if (group > 64) {
            __builtin_prefetch(p0 + ahead + 64);
            __builtin_prefetch(p1 + ahead + 64);
        }
        codes_t c0 = load_codes(p0 + g * group), c1 = load_codes(p1 + g * group);
        for (int r = 0; r < rows; r++)
            for (int b = 0; b < 3; b++) {
                int digits;
                memcpy(&digits, d + r * 3 * n + b * n + 4 * g, sizeof digits);
                a[r][b][0] = dot_int8(a[r][b][0], c0, digits);
                a[r][b][1] = dot_int8(a[r][b][1], c1, digits);
            }
    }
    for (int r = 0; r < rows; r++) {
        for (int h = 0; h < 2; h++) {
            dvec s = __builtin_convertvector(a[r][0][h], dvec);
            s += 256.0 * __builtin_convertvector(a[r][1][h], dvec);
            s += 65536.0 * __builtin_convertvector(a[r][2][h], dvec);
            if (h == 0) lo[r] += s;
            else hi[r] += s;
        }
    }
}

/* sum_dot for each count of rows its own loop, the sums in registers. */
static void sum_dot_rows(const signed char *d, long rows, long n, long g0, long g1,
                         const unsigned char *p0, const unsigned char *p1, dvec *lo, dvec *hi) {
    switch (rows) {
    case 1: sum_dot(d, 1, n, g0, g1, p0, p1, lo, hi); break;
    case 2: sum_dot(d, 2, n, g0, g1, p0, p1, lo, hi); break;
#if DOT_ROWS == 4
    case 3: sum_dot(d, 3, n, g0, g1, p0, p1, lo, hi); break;
    case 4: sum_dot(d, 4, n, g0, g1, p0, p1, lo, hi); break;
#endif
    }
}

/* product_narrow's int8 products over the interleaved panels (Int8Panels, interleave 4):
 * the buffer's `out` column scales, then panels of (in4, VW, 4) codes + 128. Each thread
 * writes its own digits of every row, then takes its blocks (an orphaned `omp for`). */
static void product_int8_dot(const float *x, long rows, long in, const void *w, long out,
                             float *y, const float *scale, enum epilogue how) {
    long in4 = (in + 3) / 4, n = 4 * in4, blocks = out / BLOCK, last = blocks + (out % BLOCK != 0);
    const float *column_scale = w;
    const unsigned char *panels = (const unsigned char *)(column_scale + out);
    long panel_bytes = n * VW;
    signed char *digits = digits_for(rows * 3 * n);
    double *totals = sums_for(2 * rows), *units = totals + rows; /* a row's sum of v, unit */
    for (long r = 0; r < rows; r++)
        units[r] = row_digits(x + r * in, in, n, 3, DIGIT_LIMIT, digits + r * 3 * n, n, totals + r);
    TEAM_FOR(b, last) {
        const unsigned char *p0 = panels + 2 * b * panel_bytes;
        const unsigned char *p1 = b < blocks ? p0 + panel_bytes : p0;
        vec c0 = *(const vec_u *)(column_scale + b * BLOCK);
        vec c1 = b < blocks ? *(const vec_u *)(column_scale + b * BLOCK + VW) : c0;
        for (long r = 0; r < rows; r += DOT_ROWS) {
            long m = rows - r < DOT_ROWS ? rows - r : DOT_ROWS;
            dvec lo_d[DOT_ROWS], hi_d[DOT_ROWS];
            for (int i = 0; i < DOT_ROWS; i++) lo_d[i] = hi_d[i] = (dvec){0};
            for (long g = 0; g < in4; g += DOT_CHUNK / 4) {
                long g1 = g + DOT_CHUNK / 4 < in4 ? g + DOT_CHUNK / 4 : in4;
                sum_dot_rows(digits + r * 3 * n, m, n, g, g1, p0, p1, lo_d, hi_d);
            }
            vec lo[DOT_ROWS], hi[DOT_ROWS];
            for (long i = 0; i < m; i++) {
                double off = DOT_OFFSET * totals[r + i], u = units[r + i];
                lo[i] = __builtin_convertvector((lo_d[i] - off) * u, vec) * c0;
                hi[i] = __builtin_convertvector((hi_d[i] - off) * u, vec) * c1;
            }
            store_block(m, lo, hi, y + r * out + b * BLOCK, out, scale ? scale + r : NULL, how,
                        b < blocks);
        }
    }
}
#endif

#if DOT_INT8
/* int4 products (panels.Int4Panels), on the integer dot products int8's use.
 *
 * Why: torch's int4 kernel (bf16 activations, one op a matrix) read d20's int4 copies at a
 * third of their roofline, and a step of torch's ops is not one call. The copy: groups of
 * INT4_GROUP inputs, each column's codes q (0-15) with an fp16 scale s and low end l per
 * group, weight = l + q s. sum_k x_k w_kj = unit (sum_g s_gj G_gj + l_gj S_g), where G_gj =
 * sum_{k in g} v_k q_kj over the row's activations as integers v (two signed base-256
 * digits: 15 bits against the row's largest |x|, a rounding far below the codes' own,
 * 1/15 of a group's range) and S_g = sum_{k in g} v_k. G is exact in 32 bits; each group
 * adds its fp32 terms. A panel's group: VW fp16 scales, VW fp16 lows, then 16 quads' pairs
 * of VW * 4 bytes, quad t's codes in the low nibbles and quad t + 16's in the high. */
#define INT4_WEIGHTS 1
#define INT4_GROUP 128
/* Two digits (15 bits) by default; -DINT4_DIGITS=3 counts int4's activations in 23 bits as
 * int8's: d20's int4 figures of scripts/quantized_quality.py were the same to every digit
 * shown, and its step 2-5% slower for one row, 15% for 8 (scripts/ab_kernel_builds.py). */
#ifndef INT4_DIGITS
#define INT4_DIGITS 2
#endif
#if INT4_DIGITS == 2
#define INT4_DIGIT_LIMIT 32512.0f /* 127 * 256: the top digit stays in [-128, 127] */
#else
#define INT4_DIGIT_LIMIT DIGIT_LIMIT
#endif
#define INT4_GROUP_BYTES (4 * VW + 64 * VW) /* scales, lows, 32 quads of VW * 4 nibbles */

/* A group's sums of the digit planes' products (lane h: the block's panel), combined: exact
 * in 32 bits for two digits (|G| < 2^26); for three each plane's is exact in fp32 and the
 * combination rounds once more. */
static inline __attribute__((always_inline)) vec group_sum(const ivec *d0, const ivec *d1,
                                                           const ivec *d2, int h) {
    if (INT4_DIGITS == 2) return __builtin_convertvector(d0[h] + d1[h] * 256, vec);
    return __builtin_convertvector(d0[h], vec) + 256.0f * __builtin_convertvector(d1[h], vec) +
           65536.0f * __builtin_convertvector(d2[h], vec);
}

/* The sums of `rows` rows (digits row stride INT4_DIGITS in, group sums row stride in / INT4_GROUP)
 * @ a block's int4 panels p0, p1, every group, into lo, hi (fp32, before the unit). */
static inline __attribute__((always_inline)) void sum_int4(const signed char *d,
                                                           const double *sums, long rows,
                                                           long in, const unsigned char *p0,
                                                           const unsigned char *p1, vec *lo,
                                                           vec *hi) {
    const long groups = in / INT4_GROUP, quad = 4 * VW, panel_bytes = groups * INT4_GROUP_BYTES;
    for (long g = 0; g < groups; g++) {
        const unsigned char *q0 = p0 + g * INT4_GROUP_BYTES, *q1 = p1 + g * INT4_GROUP_BYTES;
        /* The high nibbles' sums apart for one or two rows: each sum then waits on one
           dot product a quad, not two (the instruction's latency, not its throughput). */
        ivec a[DOT_ROWS][INT4_DIGITS][2], ah[2][INT4_DIGITS][2];
        for (int r = 0; r < DOT_ROWS; r++)
            for (int b = 0; b < INT4_DIGITS; b++) a[r][b][0] = a[r][b][1] = (ivec){0};
        for (int r = 0; r < 2; r++)
            for (int b = 0; b < INT4_DIGITS; b++) ah[r][b][0] = ah[r][b][1] = (ivec){0};
        const unsigned char *c0 = q0 + 4 * VW, *c1 = q1 + 4 * VW;
        for (long t = 0; t < 16; t++) {
            const long at = g * INT4_GROUP_BYTES + 4 * VW + t * quad + INT8_PREFETCH_BYTES;
            const long ahead = ahead_in_block(at, panel_bytes);
            __builtin_prefetch(p0 + ahead);
            __builtin_prefetch(p1 + ahead);
            codes_t l0, h0, l1, h1;
            load_nibbles(c0 + t * quad, &l0, &h0);
            load_nibbles(c1 + t * quad, &l1, &h1);
            for (int r = 0; r < rows; r++)
                for (int b = 0; b < INT4_DIGITS; b++) {
                    const signed char *at =
                        d + (r * INT4_DIGITS + b) * in + g * INT4_GROUP + 4 * t;
                    int low, high;
                    memcpy(&low, at, sizeof low);
                    memcpy(&high, at + 64, sizeof high);
                    if (rows <= 2) {
                        a[r][b][0] = dot_int8(a[r][b][0], l0, low);
                        ah[r][b][0] = dot_int8(ah[r][b][0], h0, high);
                        a[r][b][1] = dot_int8(a[r][b][1], l1, low);
                        ah[r][b][1] = dot_int8(ah[r][b][1], h1, high);
                    } else {
                        a[r][b][0] = dot_int8(dot_int8(a[r][b][0], l0, low), h0, high);
                        a[r][b][1] = dot_int8(dot_int8(a[r][b][1], l1, low), h1, high);
                    }
                }
        }
        if (rows <= 2)
            for (int r = 0; r < rows; r++)
                for (int b = 0; b < INT4_DIGITS; b++)
                    a[r][b][0] += ah[r][b][0], a[r][b][1] += ah[r][b][1];
        vec s0 = widen_half((const unsigned short *)q0);
        vec m0 = widen_half((const unsigned short *)q0 + VW);
        vec s1 = widen_half((const unsigned short *)q1);
        vec m1 = widen_half((const unsigned short *)q1 + VW);
        for (int r = 0; r < rows; r++) {
            float sg = (float)sums[r * groups + g];
            vec G0 = group_sum(a[r][0], a[r][1], a[r][2 % INT4_DIGITS], 0);
            vec G1 = group_sum(a[r][0], a[r][1], a[r][2 % INT4_DIGITS], 1);
            lo[r] += s0 * G0 + m0 * sg;
            hi[r] += s1 * G1 + m1 * sg;
        }
    }
}

/* sum_int4 for each count of rows its own loop. */
static void sum_int4_rows(const signed char *d, const double *sums, long rows, long in,
                          const unsigned char *p0, const unsigned char *p1, vec *lo, vec *hi) {
    switch (rows) {
    case 1: sum_int4(d, sums, 1, in, p0, p1, lo, hi); break;
    case 2: sum_int4(d, sums, 2, in, p0, p1, lo, hi); break;
#if DOT_ROWS == 4
    case 3: sum_int4(d, sums, 3, in, p0, p1, lo, hi); break;
    case 4: sum_int4(d, sums, 4, in, p0, p1, lo, hi); break;
#endif
    }
}

/* y (rows, out) from x (rows, in) @ an int4 matrix (Int4Panels), in a multiple of
 * INT4_GROUP (the caller checks); as product_narrow, an orphaned `omp for` over the
 * blocks, each thread writing its own digits of every row first. */
static void product_int4(const float *x, long rows, long in, const void *w, long out, float *y,
                         const float *scale, enum epilogue how) {
    long groups = in / INT4_GROUP, blocks = out / BLOCK, last = blocks + (out % BLOCK != 0);
    long panel_bytes = groups * INT4_GROUP_BYTES, planes = INT4_DIGITS;
    signed char *digits = digits_for(rows * planes * in);
    double *sums = sums_for(rows * (groups + 1)), *units = sums + rows * groups;
    for (long r = 0; r < rows; r++)
        units[r] = row_digits(x + r * in, in, in, planes, INT4_DIGIT_LIMIT, digits + r * planes * in,
                              INT4_GROUP, sums + r * groups);
    TEAM_FOR(b, last) {
        const unsigned char *p0 = (const unsigned char *)w + 2 * b * panel_bytes;
        const unsigned char *p1 = b < blocks ? p0 + panel_bytes : p0;
        for (long r = 0; r < rows; r += DOT_ROWS) {
            long m = rows - r < DOT_ROWS ? rows - r : DOT_ROWS;
            vec lo[DOT_ROWS], hi[DOT_ROWS];
            for (int i = 0; i < DOT_ROWS; i++) lo[i] = hi[i] = (vec){0};
            sum_int4_rows(digits + r * planes * in, sums + r * groups, m, in, p0, p1, lo, hi);
            for (long i = 0; i < m; i++) lo[i] *= (float)units[r + i], hi[i] *= (float)units[r + i];
            store_block(m, lo, hi, y + r * out + b * BLOCK, out, scale ? scale + r : NULL, how,
                        b < blocks);
        }
    }
}

#endif
#ifndef INT4_WEIGHTS
#define INT4_WEIGHTS 0 /* no integer dot products: torch's int4 kernel */
#define INT4_GROUP 128
#endif

/* y (rows, out) from x (rows, in) @ a narrow matrix (fp16 half panels, int8's scales
 * then panels, int4's Int4Panels), out a multiple of VW (the caller checks): a last panel without a pair
 * (out % BLOCK == VW, a vocabulary of 200 with 8 lanes) is summed twice and stored once.
 * An orphaned `omp for` over the blocks, as product(). */
static void product_narrow(const float *x, long rows, long in, const void *w, enum narrow kind,
                           long out, float *y, const float *scale, enum epilogue how) {
#if DOT_INT8
    if (kind == INT8) {
        product_int8_dot(x, rows, in, w, out, y, scale, how);
        return;
    }
#endif
#if INT4_WEIGHTS
    if (kind == INT4) {
        product_int4(x, rows, in, w, out, y, scale, how);
        return;
    }
#endif
    long blocks = out / BLOCK, last = blocks + (out % BLOCK != 0);
    const float *column_scale = kind == INT8 ? w : NULL;
    const char *panels = kind == INT8 ? (const char *)(column_scale + out) : w;
    long panel_bytes = in * VW * (kind == FP16 ? 2 : 1);
    TEAM_FOR(b, last) {
        const char *p0 = panels + 2 * b * panel_bytes;
        const char *p1 = b < blocks ? p0 + panel_bytes : p0;
        for (long r = 0; r < rows; r += HALF_ROWS) {
            long n = rows - r < HALF_ROWS ? rows - r : HALF_ROWS;
            struct view xr = {x + r * in, in};
            vec lo[HALF_ROWS], hi[HALF_ROWS];
            for (int i = 0; i < HALF_ROWS; i++) lo[i] = hi[i] = (vec){0};
            if (kind == FP16) {
                sum_narrow(xr, n, in, p0, p1, FP16, lo, hi);
            } else {
                sum_narrow(xr, n, in, p0, p1, INT8, lo, hi);
                vec c0 = *(const vec_u *)(column_scale + b * BLOCK);
                vec c1 = b < blocks ? *(const vec_u *)(column_scale + b * BLOCK + VW) : c0;
                for (long i = 0; i < n; i++) lo[i] *= c0, hi[i] *= c1;
            }
            store_block(n, lo, hi, y + r * out + b * BLOCK, out, scale ? scale + r : NULL, how,
                        b < blocks);
        }
    }
}

static void compact_product_team(void *arg) {
    const struct product_call *c = arg;
    product_narrow(c->x, c->rows, c->in, c->w, c->kind, c->out, c->y, NULL, STORE);
}

static int compact_product(enum narrow kind, const float *x, long rows, long in, const void *w,
                           long out, float *y, int threads) {
    struct product_call call = {x, rows, in, w, out, y, kind};
    team_run(threads, compact_product_team, &call);
    return 0;
}

/* y (rows, out) = x (rows, in) @ an int8 matrix (its scales then panels, as rows_step
 * reads it), on `threads` cores: an int8 copy's own products outside a whole step (a chat
 * turn's few tokens). Returns 0, or -1 (nothing written) where this CPU reads no int8 or
 * out is not whole panels. */
int rows_int8_product(const float *x, long rows, long in, const void *w, long out, float *y,
                      int threads) {
    if (!INT8_WEIGHTS || out % VW || rows < 1) return -1;
    return compact_product(INT8, x, rows, in, w, out, y, threads);
}

/* The same for an int4 matrix (Int4Panels): -1 where this CPU reads no int4 or the shape is
 * not whole panels and groups. */
int rows_int4_product(const float *x, long rows, long in, const void *w, long out, float *y,
                      int threads) {
    if (!INT4_WEIGHTS || out % VW || in % INT4_GROUP || rows < 1) return -1;
    return compact_product(INT4, x, rows, in, w, out, y, threads);
}
#else
#define HALF_WEIGHTS 0
#define INT8_WEIGHTS 0
#define INT4_WEIGHTS 0
#define INT4_GROUP 128
int rows_int8_product(const float *x, long rows, long in, const void *w, long out, float *y,
                      int threads) {
    (void)x, (void)rows, (void)in, (void)w, (void)out, (void)y, (void)threads;
    return -1;
}

int rows_int4_product(const float *x, long rows, long in, const void *w, long out, float *y,
                      int threads) {
    return rows_int8_product(x, rows, in, w, out, y, threads); /* -1: no compact products */
}
#endif

int rows_half_panel(void) { return HALF_WEIGHTS ? VW : 0; }
/* int4 matrices' panel width (Int4Panels), 0 where the CPU has no integer dot products. */
int rows_int4_panel(void) { return INT4_WEIGHTS ? VW : 0; }
int rows_int8_panel(void) { return INT8_WEIGHTS ? VW : 0; }
/* How many inputs an int8 panel's codes interleave (Int8Panels.interleave): 4 where the
 * products are integer dot products (DOT_INT8), else 1 (a row of VW codes an input). */
int rows_int8_interleave(void) { return INT8_WEIGHTS && DOT_INT8 ? 4 : 1; }

/* A model's matrix times x: its fp32 panels (product) or its compact ones (product_narrow). */
static void matrix(const struct rows_model *m, const float *x, long rows, long in,
                   const void *w, long out, float *y, const float *scale, enum epilogue how) {
#if HALF_WEIGHTS
    if (m->half) {
        product_narrow(x, rows, in, w, m->half, out, y, scale, how);
        return;
    }
#endif
    product(x, rows, in, w, out, y, scale, how);
}

/* 1 / sqrt(mean(x^2) + eps) of each row of x (rows, C), as F.rms_norm computes it. */
static void row_scales(const float *x, long rows, long C, float eps, float *s) {
    TEAM_FOR(n, rows) s[n] = 1.0f / sqrtf(dot(x + n * C, x + n * C, C) / C + eps);
}

/* Rotary embedding then the qk-norm of one head, from `in` into `out` (may not alias). */
static void rope_norm(const float *in, float *out, const float *cos_, const float *sin_, long d,
                      float norm_scale, float norm_eps) {
    long half = d / 2;
    for (long j = 0; j < half; j++) {
        out[j] = in[j] * cos_[j] + in[j + half] * sin_[j];
        out[j + half] = in[j + half] * cos_[j + half] - in[j] * sin_[j + half];
    }
    float s = 1.0f / sqrtf(norm_eps + norm_scale * dot(out, out, d));
    for (long j = 0; j < d; j++) out[j] *= s;
}

static vec pick(mask m, vec a, vec b) { return (vec)(((mask)a & m) | ((mask)b & ~m)); }

/* e^x on VW lanes for x <= 0 (scores less their maximum), where scalar expf cost more than
 * the rest of the attention: x = n ln2 + r, e^r by Cephes' degree-6 polynomial (within
 * ~2 ulp of expf), 2^n into the exponent bits. Below -87 it gives e^-87, not 0 or a
 * denormal: ~1e-38 against a softmax whose largest term is 1. */
static vec exp_nonpositive(vec x) {
    /* (vec){0} + c, not x - x + c: the latter is NaN for x = -inf (a forbidden token) */
    const vec lowest = (vec){0} - 87.0f, magic = (vec){0} + 12582912.0f; /* 1.5 * 2^23 rounds */
    x = pick(x < lowest, lowest, x);
    vec n = (x * 1.44269504088896341f + magic) - magic; /* round(x / ln 2) */
    vec r = x - n * 0.693359375f + n * 2.12194440e-4f;  /* ln 2 in two parts, exactly */
    vec p = 1.9875691500e-4f * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    mask e = (__builtin_convertvector(n, mask) + 127) << 23;
    return p * (vec)e;
}

/* cap * tanh(z) on VW lanes: the softcap of nanochat's logits, where torch's tanh over
 * d20's 8 x 65536 logits took ~1.5-2 ms a step on one thread, outside our parallel region.
 * Below |z| = 0.25 tanh's odd series to z^9 (the next term is under 1e-8 of z); above,
 * (1 - e) / (1 + e) with e = e^-2|z| (exp_nonpositive), where 1 - e >= 0.39 costs e's
 * rounding at most ~3 ulp. Large |z| gives +-cap exactly, as do infinities; NaN stays. */
static vec softcap_lanes(vec z, float cap) {
    const mask sign = (mask){0} + (-2147483647 - 1); /* the sign bit of every lane */
    vec a = (vec)((mask)z & ~sign), z2 = z * z;
    vec series = z + z * z2 * (-1.0f / 3 + z2 * (2.0f / 15 + z2 * (-17.0f / 315 +
                                                                    z2 * (62.0f / 2835))));
    /* tanh is 1.0f from |z| = 9 on; the clamp keeps infinities out of exp (NaN stays) */
    vec e = exp_nonpositive(-2.0f * pick(a > 9.0f, (vec){0} + 9.0f, a));
    vec far = (vec)(((mask)((1.0f - e) / (1.0f + e))) | ((mask)z & sign));
    return cap * pick(a < 0.25f, series, far);
}

#define SOFTCAP_CHUNK 4096

/* x[i] = cap * tanh(x[i]) for i < n (the exported form: the tests hold it to torch's). */
void rows_softcap(float *x, long n, float cap) {
    long i = 0;
    for (; i + VW <= n; i += VW) *(vec_u *)(x + i) = softcap_lanes(*(vec_u *)(x + i), cap);
    if (i < n) {
        vec tail = {0};
        for (long j = i; j < n; j++) tail[j - i] = x[j];
        tail = softcap_lanes(tail, cap);
        for (long j = i; j < n; j++) x[j] = tail[j - i];
    }
}

/* The largest of p[0..n) (NaNs passed over), VW lanes at a time: as a chain of scalar
 * comparisons it took ~900 cycles of a 300-position row, most of the 8 rows' softmax. */
static float largest(const float *p, long n) {
    vec top = {0};
    top -= INFINITY;
    long t = 0;
    for (; t + VW <= n; t += VW) {
        vec v = *(const vec_u *)(p + t);
        top = pick(v > top, v, top);
    }
    float m = -INFINITY;
    for (int l = 0; l < VW; l++) m = top[l] > m ? top[l] : m;
    for (; t < n; t++) m = p[t] > m ? p[t] : m;
    return m;
}

/* p[t] = e^(p[t] - m) for t < n; returns their sum. */
static float exp_scores(float *p, long n, float m) {
    vec sum = {0};
    long t = 0;
    for (; t + VW <= n; t += VW) {
        vec e = exp_nonpositive(*(vec_u *)(p + t) - m);
        *(vec_u *)(p + t) = e;
        sum += e;
    }
    float total = lane_sum(sum);
    if (t < n) { /* the tail through a padded vector, its padding's lanes not kept */
        vec tail = {0};
        for (long j = t; j < n; j++) tail[j - t] = p[j] - m;
        tail = exp_nonpositive(tail);
        for (long j = t; j < n; j++) total += p[j] = tail[j - t];
    }
    return total;
}

#ifdef __clang__
#define MERGED(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define MERGED(a, b, ...) __builtin_shuffle(a, b, (mask){__VA_ARGS__})
#endif
#if VW >= 8
#define FOUR_AT_ONCE 1
/* The keys' vectors of partial sums: a[i] for k + i * stride, i < keys (4 or 8: eight
 * chains of FMAs where the two ports and their 4-cycle latency want eight, not four). */
static inline __attribute__((always_inline)) void dot_sums(const float *q, const float *k,
                                                           long stride, long n, vec *a,
                                                           int keys) {
    for (int i = 0; i < keys; i++) a[i] = (vec){0};
    for (long j = 0; j < n; j += VW) {
        vec qv = *(const vec_u *)(q + j);
        for (int i = 0; i < keys; i++) a[i] += qv * *(const vec_u *)(k + i * stride + j);
    }
}
#endif
#if VW == 16
/* Four keys' vectors of partial sums a[0..3] reduced to their four dot products. */
static inline __attribute__((always_inline)) void fold4(const vec *a, float *out) {
    vec a0 = a[0], a1 = a[1], a2 = a[2], a3 = a[3];
    /* halves of a0 | a1, of a2 | a3: lanes 0-7 one key's partial sums, 8-15 the next's */
    vec t0 = MERGED(a0, a1, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
             MERGED(a0, a1, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    vec t1 = MERGED(a2, a3, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
             MERGED(a2, a3, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    /* then four lanes a key, in order */
    vec u = MERGED(t0, t1, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
            MERGED(t0, t1, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    u += SWAPPED(u, 2);
    u += SWAPPED(u, 1);
    out[0] = u[0], out[1] = u[4], out[2] = u[8], out[3] = u[12];
}
#elif VW == 8
static inline __attribute__((always_inline)) void fold4(const vec *a, float *out) {
    vec a0 = a[0], a1 = a[1], a2 = a[2], a3 = a[3];
    vec t0 = MERGED(a0, a1, 0, 1, 2, 3, 8, 9, 10, 11) + MERGED(a0, a1, 4, 5, 6, 7, 12, 13, 14, 15);
    vec t1 = MERGED(a2, a3, 0, 1, 2, 3, 8, 9, 10, 11) + MERGED(a2, a3, 4, 5, 6, 7, 12, 13, 14, 15);
    vec u = MERGED(t0, t1, 0, 1, 4, 5, 8, 9, 12, 13) + MERGED(t0, t1, 2, 3, 6, 7, 10, 11, 14, 15);
    u += SWAPPED(u, 1);
    out[0] = u[0], out[1] = u[2], out[2] = u[4], out[3] = u[6];
}
#endif
#if VW >= 8
/* q . k[i * stride] for i < 4 (dot4) or 8 (dot8) into out, n a multiple of VW: the vectors
 * of partial sums folded into one another's lanes (a 4-way transposition), where one key at
 * a time paid a whole lane_sum each. Where the vector has 8 or 16 lanes; elsewhere one key
 * at a time. */
static void dot4(const float *q, const float *k, long stride, long n, float *out) {
    vec a[4];
    dot_sums(q, k, stride, n, a, 4);
    fold4(a, out);
}

static void dot8(const float *q, const float *k, long stride, long n, float *out) {
    vec a[8];
    dot_sums(q, k, stride, n, a, 8);
    fold4(a, out);
    fold4(a + 4, out + 4);
}
#else
#define FOUR_AT_ONCE 0
static void dot4(const float *q, const float *k, long stride, long n, float *out) {
    for (int i = 0; i < 4; i++) out[i] = dot(q, k + i * stride, n);
}

static void dot8(const float *q, const float *k, long stride, long n, float *out) {
    dot4(q, k, stride, n, out);
    dot4(q, k + 4 * stride, stride, n, out + 4);
}
#endif

/* a . b for n a multiple of VW: one vector of partial sums. */
static float dot_lanes(const float *a, const float *b, long n) {
    vec acc = {0};
    for (long j = 0; j < n; j += VW) acc += *(const vec_u *)(a + j) * *(const vec_u *)(b + j);
    return lane_sum(acc);
}

/* out += scale * sum_t p[t] * values[t * stride], t < n, over d columns. */
static void add_values(const float *p, long n, const float *values, long stride, long d,
                       float scale, float *out) {
    if (d % (4 * VW)) {
        for (long t = 0; t < n; t++)
            for (long j = 0; j < d; j++) out[j] += scale * p[t] * values[t * stride + j];
        return;
    }
    /* Eight vectors of out at a time where the width has them (a head of 64 with 8 lanes),
     * else four, kept in registers over every t: through memory, each t's update waited on
     * the store of the one before; with four, on the FMA's latency (four chains where two
     * ports and 4 cycles want eight: the 8 sample rows' own values took ~6 us a layer). */
    long j = 0;
    for (; j + 8 * VW <= d; j += 8 * VW) {
        vec a[8] = {{0}};
        for (long t = 0; t < n; t++) {
            const float *vt = values + t * stride + j;
            for (int i = 0; i < 8; i++) a[i] += p[t] * *(const vec_u *)(vt + i * VW);
        }
        for (int i = 0; i < 8; i++) *(vec_u *)(out + j + i * VW) += scale * a[i];
    }
    for (; j < d; j += 4 * VW) {
        vec a[4] = {{0}};
        for (long t = 0; t < n; t++) {
            const float *vt = values + t * stride + j;
            for (int i = 0; i < 4; i++) a[i] += p[t] * *(const vec_u *)(vt + i * VW);
        }
        for (int i = 0; i < 4; i++) *(vec_u *)(out + j + i * VW) += scale * a[i];
    }
}

/* Where a step's keys and values are. The shared prefix (a prompt every row attends), its
 * first `prefix` positions, packed in panels of BLOCK columns (RowsStep.pack_prefix):
 * pk the keys, layer 0 of (layers, Hkv, P / BLOCK, D, BLOCK) for P the prefix rounded up
 * to whole panels (zeros past it), so that the rows' scores over it are one product per
 * K/V head; pv the values, layer 0 of (layers, Hkv, Dp / BLOCK, prefix, BLOCK) for Dp the
 * head's width rounded up (zeros past it); NULL when prefix is 0. Then each row's own (sk,
 * sv: layer 0 of a (layers, rows, Ts, Hkv, D) cache, this step's k and v written at
 * pos - prefix). Strides in floats. */
struct rows_cache {
    const float *pk, *pv;
    long prefix;
    float *sk, *sv;
    long s_layer, s_row, pos;
};

/* Where each row of a step is in the rows' own caches, beyond struct rows_cache: its slot
 * (the row of the cache tensors it reads and writes) and its position, and the stride of
 * the rotary tables between rows. rows_step's rows are slot n at c->pos, one table for all
 * (NULL, NULL, 0); rows_step_slots' are independent sequences (a server's conversations),
 * each in its own slot at its own position, with its own tables (D floats apart). */
struct rows_at {
    const long *slot; /* NULL: row n is slot n */
    const long *pos;  /* NULL: every row at c->pos */
    long cs_stride;   /* floats from one row's cos/sin to the next's: 0 or D */
    long chained;     /* rows may share a slot (a prompt's tokens): every row's K/V is
                       * written before any row attends (attend's two phases) */
};

static inline long slot_of(const struct rows_at *at, long n) { return at->slot ? at->slot[n] : n; }
static inline long pos_of(const struct rows_at *at, const struct rows_cache *c, long n) {
    return at->pos ? at->pos[n] : c->pos;
}

static long whole_blocks(long n) { return (n + BLOCK - 1) / BLOCK * BLOCK; }

/* A shared prefix's first `length` positions of keys k and values v (layer 0 of
 * (layers, 1, T, Hkv, D) caches, k_layer and v_layer floats a layer) packed as struct
 * rows_cache reads them, into pk (whole_blocks(length) Hkv D floats a layer) and pv
 * (length Hkv whole_blocks(D)), on `threads` cores. Once a generation of sample rows, in C
 * because torch's strided copies of the same layout took 4.4 ms for the embedded model's
 * 256-token prompt and 167 for d20's 512 (0.7 and 59 here): more, over a 48-step
 * generation of d20, than the panels save. */
struct pack_call {
    const float *k, *v;
    long layers, k_layer, v_layer, Hkv, D, length;
    float *pk, *pv;
};

static void pack_team(void *arg) {
    const struct pack_call *a = arg;
    const float *k = a->k, *v = a->v;
    long k_layer = a->k_layer, v_layer = a->v_layer, Hkv = a->Hkv, D = a->D;
    long length = a->length, P = whole_blocks(length), Dp = whole_blocks(D), kv = Hkv * D;
    float *pk = a->pk, *pv = a->pv;
    TEAM_FOR(u, a->layers * Hkv) { /* each layer's each K/V head */
        long l = u / Hkv, h = u % Hkv;
        {
            const float *kh = k + l * k_layer + h * D, *vh = v + l * v_layer + h * D;
            float *keys = pk + (l * Hkv + h) * P * D, *values = pv + (l * Hkv + h) * Dp * length;
            for (long t = 0; t < P; t++) { /* panel t / BLOCK: (D, BLOCK), column t % BLOCK */
                float *col = keys + (t / BLOCK) * D * BLOCK + t % BLOCK;
                for (long d = 0; d < D; d++) col[d * BLOCK] = t < length ? kh[t * kv + d] : 0.0f;
            }
            for (long t = 0; t < length; t++) /* panel d / BLOCK: (length, BLOCK), row t */
                for (long d = 0; d < Dp; d++)
                    values[(d / BLOCK) * length * BLOCK + t * BLOCK + d % BLOCK] =
                        d < D ? vh[t * kv + d] : 0.0f;
        }
    }
}

void rows_pack_prefix(const float *k, const float *v, long layers, long k_layer, long v_layer,
                      long Hkv, long D, long length, float *pk, float *pv, int threads) {
    struct pack_call call = {k, v, layers, k_layer, v_layer, Hkv, D, length, pk, pv};
    team_run(threads, pack_team, &call);
}

/* Scratch of one step, on the heap: a long window on a server's worker thread must not meet
 * its stack. q and the scores are head-major, (H, rows, ...): a K/V head's queries are then
 * one block of rows for the products over the prefix. */
struct scratch {
    float *x0, *s, *qkv, *y, *q, *scores, *u, *saved, *xo, *inv_total, *att_scale;
};

/* Element i of a table of fp32, or of bf16 (its bits the top half of an fp32's). */
static inline float table_at(const void *table, long i, long bf16) {
    if (!bf16) return ((const float *)table)[i];
    unsigned int bits = (unsigned int)((const unsigned short *)table)[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* The positions a layer's queries attend, in the caches' terms (window_of). */
struct window {
    long p_at;     /* the prefix's first position read: a panel's first column */
    long skip;     /* of those, the ones before the window's start (left out of the softmax) */
    long n_cols;   /* the prefix's columns of a row's scores (prefix - p_at) */
    long s_at;     /* this step's position in the rows' own caches */
    long s_from;   /* the first of the rows' own positions in the window */
    long n_suffix; /* the rows' own positions attended, this step's included */
};

static struct window window_of(const struct rows_cache *c, long pos, long window) {
    long start = pos - window > 0 ? pos - window : 0;
    long p_from = start < c->prefix ? start : c->prefix, n_prefix = c->prefix - p_from;
    /* The prefix's scores start at a panel's first column: the `skip` before the window's
     * start are computed, then left out of the softmax (zeros, which the values' product
     * then adds). */
    long p_at = n_prefix > 0 ? p_from - p_from % BLOCK : c->prefix;
    long s_at = pos - c->prefix, s_from = start > c->prefix ? start - c->prefix : 0;
    return (struct window){p_at, p_from - p_at, c->prefix - p_at, s_at, s_from, s_at - s_from + 1};
}

/* Row n's K/V head g and its queries from the row's q/k/v: v (plus the value embedding's
 * gated share) and the rotated, normalised k written to the row's own cache at this
 * step's position, the group's queries rotated and normalised into q. */
static void head_inputs(const struct rows_model *m, const struct rows_layer *w, const float *x,
                        long N, long n, long g, long id, const float *cos_, const float *sin_,
                        float *sk, float *sv, const struct rows_cache *c, long slot, long s_at,
                        const struct scratch *t) {
    long H = m->H, Hkv = m->Hkv, D = m->D, C = m->C, kv = Hkv * D, group = H / Hkv;
    const float *r = t->qkv + n * (H + 2 * Hkv) * D;
    float *k_at = sk + slot * c->s_row + s_at * kv + g * D;
    float *v_at = sv + slot * c->s_row + s_at * kv + g * D;
    memcpy(v_at, r + (H + Hkv + g) * D, sizeof(float) * D);
    if (w->ve_table) { /* v += ve_scale * sigmoid(s * ve_gate @ x[:ve_channels]) * ve */
        float z = t->s[n] * dot(w->ve_gate + g * m->ve_channels, x + n * C, m->ve_channels);
        float gate = m->ve_scale / (1.0f + expf(-z));
        long row = id * kv + g * D;
        if (m->bf16_table)
            for (long j = 0; j < D; j++) v_at[j] += gate * table_at(w->ve_table, row + j, 1);
        else
            for (long j = 0; j < D; j++) v_at[j] += gate * ((const float *)w->ve_table)[row + j];
    }
    for (long h = g * group; h < (g + 1) * group; h++)
        rope_norm(r + h * D, t->q + (h * N + n) * D, cos_, sin_, D, m->norm_scale, m->norm_eps);
    rope_norm(r + (H + g) * D, k_at, cos_, sin_, D, m->norm_scale, m->norm_eps);
}

/* What a call of attend does: all of a unit's attention, or (rows sharing a slot) only
 * its inputs, or only the rest, once every row's inputs are written. */
enum attend_part { ATTEND_ALL, ATTEND_INPUTS, ATTEND_SCORES };

/* Query head h of row n: its scores over the row's own keys (after the prefix's, which
 * are in place), then the softmax over both, its 1 / total kept for the values. */
static void own_scores(const struct rows_model *m, long N, long n, long h, const float *sk,
                       const struct rows_cache *c, long slot, const struct window *a, long span,
                       const struct scratch *t) {
    long D = m->D, kv = m->Hkv * D, group = m->H / m->Hkv, n_cols = a->n_cols;
    const float *qh = t->q + (h * N + n) * D;
    const float *keys = sk + slot * c->s_row + a->s_from * kv + (h / group) * D;
    float *p = t->scores + (h * N + n) * span;
    long i = 0;
    if (FOUR_AT_ONCE && D % VW == 0) {
        for (; i + 8 <= a->n_suffix; i += 8) {
            float eight[8];
            dot8(qh, keys + i * kv, kv, D, eight);
            for (int j = 0; j < 8; j++) p[n_cols + i + j] = m->att_scale * eight[j];
        }
        for (; i + 4 <= a->n_suffix; i += 4) {
            float four[4];
            dot4(qh, keys + i * kv, kv, D, four);
            for (int j = 0; j < 4; j++) p[n_cols + i + j] = m->att_scale * four[j];
        }
    }
    for (; i < a->n_suffix; i++) {
        const float *k = keys + i * kv;
        p[n_cols + i] = m->att_scale * (D % VW ? dot(qh, k, D) : dot_lanes(qh, k, D));
    }
    long n_scores = n_cols - a->skip + a->n_suffix;
    float top = largest(p + a->skip, n_scores);
    t->inv_total[h * N + n] = 1.0f / exp_scores(p + a->skip, n_scores, top);
    memset(p, 0, sizeof(float) * a->skip);
}

/* The attention of K/V head g for rows r0..r0+nr: their inputs (head_inputs), then for
 * each of the group's query heads the scores over the prefix (one product of the rows'
 * queries and the head's key panels), each row's own scores and softmax, the values over
 * the prefix (a product, which stores y) and each row's own. One thread does a unit from
 * the K/V written to the scores' last use: where the attention's five parts were each
 * split over the cores on its own, a part read what the other core had just written (the
 * embedded model's 8 rows: a scores row's second half, or a row's keys), with a barrier
 * between parts; the 8 rows' attention took ~110 us of a ~380 us step. */
static void attend(const struct rows_model *m, const struct rows_layer *w, const float *x,
                   long N, long r0, long nr, long g, const long *ids, const float *cos_,
                   const float *sin_, const float *pk, const float *pv, float *sk, float *sv,
                   const struct rows_cache *c, const struct rows_at *at, long span,
                   const struct scratch *t, enum attend_part part) {
    long H = m->H, D = m->D, group = H / m->Hkv, Dp = whole_blocks(D);
    /* The prefix's part is the same for every row (rows at their own positions have none),
     * each row's own part its own. */
    struct window rows_window[MAX_ROWS], *a = rows_window; /* nr <= MAX_ROWS: unit_rows */
    for (long n = r0; n < r0 + nr; n++) {
        rows_window[n - r0] = window_of(c, pos_of(at, c, n), w->window);
        if (part != ATTEND_SCORES)
            head_inputs(m, w, x, N, n, g, ids[n], cos_ + n * at->cs_stride,
                        sin_ + n * at->cs_stride, sk, sv, c, slot_of(at, n),
                        rows_window[n - r0].s_at, t);
    }
    if (part == ATTEND_INPUTS) return;
    long n_cols = a->n_cols;
    for (long h = g * group; h < (g + 1) * group; h++) {
        float *p = t->scores + (h * N + r0) * span, *inv_total = t->inv_total + h * N + r0;
        if (n_cols > 0)
            panel_rows((struct view){t->q + (h * N + r0) * D, D}, nr, D,
                       pk + g * whole_blocks(c->prefix) * D + a->p_at / BLOCK * D * BLOCK,
                       D * BLOCK, n_cols, p, span, t->att_scale, STORE_SCALED);
        for (long n = r0; n < r0 + nr; n++)
            own_scores(m, N, n, h, sk, c, slot_of(at, n), rows_window + (n - r0), span, t);
        if (n_cols > 0)
            panel_rows((struct view){p, span}, nr, n_cols, pv + g * Dp * c->prefix + a->p_at * BLOCK,
                       c->prefix * BLOCK, D, t->y + r0 * H * D + h * D, H * D, inv_total,
                       STORE_SCALED);
        for (long n = r0; n < r0 + nr; n++) {
            float *out = t->y + n * H * D + h * D;
            if (n_cols == 0) memset(out, 0, sizeof(float) * D);
            const struct window *an = rows_window + (n - r0);
            add_values(t->scores + (h * N + n) * span + n_cols, an->n_suffix,
                       sv + slot_of(at, n) * c->s_row + an->s_from * m->Hkv * D + g * D,
                       m->Hkv * D, D, t->inv_total[h * N + n], out);
        }
    }
}

/* The thread count the attention's units are planned for (unit_rows): the machine's, not
 * the team's. A unit's rows share its products' passes, and a pass of one row sums in
 * another order than a pass of four, so units planned for the team made 4 sample rows'
 * logits differ (by ~5e-6) between one thread and two, and ThreadChoice moves between the
 * two by measured time: the same seed could draw other samples. */
static long planned_threads(void) { return team_procs(); }

/* The rows of one attention unit (attend): as many as leave the threads' shares of the
 * Hkv * ceil(N / rows) units most even, counting a unit as its rows plus one for its own
 * work (the embedded model's 8 rows on two cores: 4, six units of 3 K/V heads; d20's 10
 * heads: 8). At most MAX_ROWS, the most one product's pass takes. */
static long unit_rows(long N, long Hkv, long threads) {
    long best = 1, best_cost = -1;
    for (long rows = N < MAX_ROWS ? N : MAX_ROWS; rows >= 1; rows--) {
        long units = Hkv * ((N + rows - 1) / rows);
        long cost = (units + threads - 1) / threads * (rows + 1);
        if (best_cost < 0 || cost < best_cost) best = rows, best_cost = cost;
    }
    return best;
}

/* One layer of the step (inside the step's parallel region: every loop an orphaned omp for).
 * unit: the rows of an attention unit (unit_rows). */
static void layer(const struct rows_model *m, const struct rows_layer *w, float *x, long rows,
                  const long *ids, const float *cos_, const float *sin_, const float *pk,
                  const float *pv, float *sk, float *sv, const struct rows_cache *c,
                  const struct rows_at *at, const struct scratch *t, long span, long unit) {
    long C = m->C, F = m->F, H = m->H, Hkv = m->Hkv, D = m->D, N = rows;
    long width = (H + 2 * Hkv) * D, blocks = (N + unit - 1) / unit;
    TEAM_FOR(n, N) {
        for (long j = 0; j < C; j++)
            x[n * C + j] = w->resid_lambda * x[n * C + j] + w->x0_lambda * t->x0[n * C + j];
        t->s[n] = 1.0f / sqrtf(dot(x + n * C, x + n * C, C) / C + m->eps);
    }
    PHASE(0);
    matrix(m, x, N, C, w->qkv, width, t->qkv, t->s, STORE_SCALED);
    PHASE(1);
    /* Rows that share a slot read one another's keys: all written (the for's barrier), then
     * read. Else one thread takes a unit from its keys written to its scores' last use. */
    for (int part = at->chained ? ATTEND_INPUTS : ATTEND_ALL;
         part <= (at->chained ? ATTEND_SCORES : ATTEND_ALL); part++) {
        TEAM_FOR(u, Hkv * blocks) {
            long r0 = u % blocks * unit;
            attend(m, w, x, N, r0, N - r0 < unit ? N - r0 : unit, u / blocks, ids, cos_, sin_, pk,
                   pv, sk, sv, c, at, span, t, (enum attend_part)part);
        }
    }
    PHASE(2);
    matrix(m, t->y, N, H * D, w->proj, C, x, NULL, ADD);
    PHASE(3);
    row_scales(x, N, C, m->eps, t->s);
    PHASE(4);
    matrix(m, x, N, C, w->fc, F, t->u, t->s, RELU_SQUARED);
    PHASE(5);
    matrix(m, t->u, N, F, w->fc_proj, C, x, NULL, ADD);
    PHASE(6);
}

/* A step's arguments, as each of its team's threads reads them (step_team). */
struct step_call {
    const struct rows_model *m;
    float *x;
    long rows;
    const long *ids;
    const float *cos_, *sin_;
    const struct rows_cache *c;
    const struct rows_at *at;
    long span;
    const long *out;
    long n_out;
    float *logits;
    const struct scratch *t;
    long unit;
};

static void step_team(void *arg);

/* The step of rows_step and rows_step_slots: `at` says where each row is (struct rows_at),
 * span is the most positions a row attends, its own included (the widest score row). */
static int step(const struct rows_model *m, float *x, long rows, const long *ids,
                const float *cos_, const float *sin_, const struct rows_cache *c,
                const struct rows_at *at, long span, const long *out, long n_out, float *logits,
                int threads) {
    long C = m->C, F = m->F, H = m->H, Hkv = m->Hkv, D = m->D;
    long width = (H + 2 * Hkv) * D;
    long unit = unit_rows(rows, Hkv, planned_threads());
    /* fp16 widths in whole panels (VW a power of two: one test for all four) */
    if (m->half && (!HALF_WEIGHTS || (width | C | F | m->V) % VW)) return -1;
    if (m->half == INT4 && (!INT4_WEIGHTS || (C | F | H * D) % INT4_GROUP)) return -1;
    if (m->half < 0 || m->half > INT4 || (m->half == INT8 && !INT8_WEIGHTS)) return -1;
    if (rows < 1 || D % 2 || Hkv < 1 || H % Hkv || c->prefix < 0 ||
        (c->prefix > 0 && (!c->pk || !c->pv)))
        return -1;
    for (long n = 0; n < rows; n++)
        if (pos_of(at, c, n) < c->prefix || pos_of(at, c, n) >= span || slot_of(at, n) < 0)
            return -1;
    /* n_out 0: a prompt's chunk that does not reach its last token wants no logits */
    if (n_out < 0 || n_out > rows) return -1;
    for (long i = 0; out && i < n_out; i++)
        if (out[i] < 0 || out[i] >= rows) return -1;
    struct scratch t;
    long size = rows * (3 * C + 1 + width + 2 * H * D + H * span + F + 2 * H);
    t.x0 = malloc(sizeof(float) * size);
    if (!t.x0) return -1;
    t.saved = t.x0 + rows * C, t.xo = t.saved + rows * C, t.s = t.xo + rows * C;
    t.qkv = t.s + rows;
    t.y = t.qkv + rows * width, t.q = t.y + rows * H * D, t.scores = t.q + rows * H * D;
    t.u = t.scores + rows * H * span, t.inv_total = t.u + rows * F;
    t.att_scale = t.inv_total + rows * H;
    for (long i = 0; i < rows * H; i++) t.att_scale[i] = m->att_scale;
    memcpy(t.x0, x, sizeof(float) * rows * C);
    struct step_call call = {m, x, rows, ids, cos_, sin_, c, at, span, out, n_out, logits, &t, unit};
    team_run(threads, step_team, &call);
    free(t.x0);
    return 0;
}

/* The step's work on each of the team's threads (team_run). */
static void step_team(void *arg) {
    const struct step_call *a = arg;
    const struct rows_model *m = a->m;
    const struct rows_cache *c = a->c;
    const long *out = a->out, n_out = a->n_out, rows = a->rows;
    const struct scratch t = *a->t;
    float *x = a->x, *logits = a->logits;
    long C = m->C, Hkv = m->Hkv, D = m->D;
    {
        PHASE(-1);
        for (long i = 0; i < m->n_layers; i++) {
            layer(m, m->layers + i, x, rows, a->ids, a->cos_, a->sin_,
                  c->pk ? c->pk + i * Hkv * whole_blocks(c->prefix) * D : NULL,
                  c->pv ? c->pv + i * Hkv * whole_blocks(D) * c->prefix : NULL,
                  c->sk + i * c->s_layer, c->sv + i * c->s_layer, c, a->at, &t, a->span, a->unit);
            if (i == m->backout_layer) {
                TEAM_FOR(j, rows * C) t.saved[j] = x[j];
            }
        }
        /* The rows whose logits are asked for (all, or those `out` names, gathered into
         * xo: a prompt's tokens but its last need none, and d20's vocabulary is ~40% of a
         * row's products). */
        float *xo = out ? t.xo : x;
        TEAM_FOR(i, n_out) {
            long n = out ? out[i] : i;
            float *xi = xo + i * C;
            if (out) memcpy(xi, x + n * C, sizeof(float) * C);
            if (m->backout_layer >= 0)
                for (long j = 0; j < C; j++) xi[j] -= m->backout_lambda * t.saved[n * C + j];
            /* the last norm and the softcap's division: one scale a row */
            t.s[i] = 1.0f / (m->softcap * sqrtf(dot(xi, xi, C) / C + m->eps));
        }
        PHASE(7);
        if (n_out > 0) { /* the same on every thread: the team meets at the same barriers */
            matrix(m, xo, n_out, C, m->lm_head, m->V, logits, t.s, STORE_SCALED);
            /* the softcap on both cores, in chunks: a row of a 65536 vocabulary is ~65 us */
            long total = n_out * m->V, chunks = (total + SOFTCAP_CHUNK - 1) / SOFTCAP_CHUNK;
            TEAM_FOR(i, chunks) {
                long from = i * SOFTCAP_CHUNK;
                rows_softcap(logits + from,
                             total - from < SOFTCAP_CHUNK ? total - from : SOFTCAP_CHUNK,
                             m->softcap);
            }
        }
        PHASE(8);
    }
}

/* Every layer of one decode step of `rows` rows, then the vocabulary's products.
 * x (rows, C): the normalised embeddings of the rows' tokens (after the smear), the
 * residual stream, in place. ids (rows,): the tokens (for the value embeddings).
 * cos_, sin_: (D,) this position's rotary tables. logits (rows, V): the model's logits,
 * softcap * tanh(the last norm's x @ lm_head / softcap).
 * threads: the team's size (team.h). Returns 0, or -1 (nothing written) for shapes it does
 * not take or without memory. */
int rows_step(const struct rows_model *m, float *x, long rows, const long *ids,
              const float *cos_, const float *sin_, const struct rows_cache *c, float *logits,
              int threads) {
    struct rows_at at = {NULL, NULL, 0, 0};
    return step(m, x, rows, ids, cos_, sin_, c, &at, c->pos + 1, NULL, rows, logits, threads);
}

/* rows_step for rows that are independent sequences: row n in slot slot[n] of the rows' own
 * caches (c->sk, c->sv: layer 0 of a (layers, slots, T, Hkv, D) cache; no shared prefix,
 * c->prefix 0), at position pos[n], where its k and v are written and up to which it
 * attends (within each layer's window); cos_, sin_ (rows, D) each row's rotary tables.
 * Several rows may share a slot (chained 1): a prompt's next tokens, at consecutive
 * positions, each attending the ones before it. No two rows at one slot and position,
 * slots inside the cache: the caller's to see to (RowsStep.run_slots), as the kernel writes
 * where it is told. logits (n_out, V): the rows out[0..n_out) (NULL: every row, n_out
 * rows). Why: a server's conversations decode together, one step for all, each where its
 * own reply is, and a new prompt runs in the same step as a chunk of rows. */
int rows_step_slots(const struct rows_model *m, float *x, long rows, const long *ids,
                    const float *cos_, const float *sin_, const long *slot, const long *pos,
                    long chained, const struct rows_cache *c, const long *out, long n_out,
                    float *logits, int threads) {
    if (c->prefix != 0 || rows < 1) return -1;
    long span = 0;
    for (long n = 0; n < rows; n++) span = pos[n] + 1 > span ? pos[n] + 1 : span;
    struct rows_at at = {slot, pos, m->D, chained != 0};
    return step(m, x, rows, ids, cos_, sin_, c, &at, span, out, n_out, logits, threads);
}

/* The residual streams a step starts from, x (rows, C): each row's token's embedding (a
 * table of V fp32 or bf16 rows of C) times its RMSNorm scale; where prev is given (era E's
 * smear: the previous token of each row, -1 for a row that starts its sequence), plus
 * lambda * sigmoid(gate . x[:channels]) times the previous token's normalised embedding.
 * Returns 1, x unfinished, where an id is not in [0, V) (nor a previous -1): torch's
 * look-up raised there, and a read past the table must not happen.
 * Why here: as torch's ~10 ops (the look-ups, norms, a product, sigmoid, addcmul) it took
 * ~150 us of the embedded model's ~600 us token on a Zen 3, for ~2 us of arithmetic. */
int rows_embed(const void *table, long bf16, long V, long C, const long *ids, const long *prev,
               long rows, const float *gate, long channels, float lambda, float eps, float *x) {
    for (long n = 0; n < rows; n++)
        if (ids[n] < 0 || ids[n] >= V || (prev && (prev[n] < -1 || prev[n] >= V))) return 1;
    for (long n = 0; n < rows; n++) {
        float *xn = x + n * C, s;
        for (long j = 0; j < C; j++) xn[j] = table_at(table, ids[n] * C + j, bf16);
        row_scales(xn, 1, C, eps, &s);
        for (long j = 0; j < C; j++) xn[j] *= s;
        if (!prev || prev[n] < 0) continue; /* -1: a sequence's first token, no smear */
        float g = lambda / (1.0f + expf(-dot(gate, xn, channels))), squares = 0.0f;
        for (long j = 0; j < C; j++) {
            float v = table_at(table, prev[n] * C + j, bf16);
            squares += v * v;
        }
        float sp = g / sqrtf(squares / C + eps);
        for (long j = 0; j < C; j++) xn[j] += sp * table_at(table, prev[n] * C + j, bf16);
    }
    return 0;
}

/* ---- Sampling: each row's next token from the step's logits. ----
 *
 * sampling.sample_next_token's arithmetic in one call, given each row's uniform draw u:
 * softmax(logits / temperature), kept to the top_k strongest where 0 < top_k < V, inside
 * those to the shortest prefix whose mass reaches top_p where 0 < top_p < 1; the token is
 * the first candidate (top-k's strongest first, else the vocabulary's order) whose running
 * sum exceeds u times the total. Why: that is ~10 torch ops of a few microseconds each to
 * dispatch; with chat's defaults (temperature 0.6, top-k 50) they took 84-114 us of the
 * embedded model's ~550 us token here (27-28 in this loop), and ~1 ms a step of d20's 8
 * rows of 65536 (0.33-0.57).
 * The same draw picks torch's token except where it falls within rounding of a boundary
 * between two (exp and the sums round differently); the draws stay torch's seeded ones. */

/* One candidate: a logit and its token. */
struct candidate {
    float logit;
    long token;
};

/* Whether a ranks below b: the smaller logit, then (equal logits) the later token. */
static int below(struct candidate a, struct candidate b) {
    return a.logit < b.logit || (a.logit == b.logit && a.token > b.token);
}

/* Restores the min-heap h[0..n) (its weakest candidate at h[0]) below position i. */
static void sift_down(struct candidate *h, long n, long i) {
    for (;;) {
        long low = i, l = 2 * i + 1, r = l + 1;
        if (l < n && below(h[l], h[low])) low = l;
        if (r < n && below(h[r], h[low])) low = r;
        if (low == i) return;
        struct candidate t = h[i];
        h[i] = h[low], h[low] = t;
        i = low;
    }
}

/* The largest lane of v. */
static float lane_max(vec v) {
#if VW == 16
    v = pick(v > SWAPPED(v, 8), v, SWAPPED(v, 8));
#endif
#if VW >= 8
    v = pick(v > SWAPPED(v, 4), v, SWAPPED(v, 4));
#endif
    v = pick(v > SWAPPED(v, 2), v, SWAPPED(v, 2));
    v = pick(v > SWAPPED(v, 1), v, SWAPPED(v, 1));
    return v[0];
}

/* The k strongest of x[0..V) (no NaN) into out, strongest first: a min-heap of the best k
 * so far, which most of a vocabulary fails to enter: 4 VW logits at a time are passed over
 * when their largest does not beat the heap's weakest (a later token never displaces an
 * equal logit: ties keep the earlier token, as below() ranks them). */
static void strongest(const float *x, long V, long k, struct candidate *out) {
    for (long i = 0; i < k; i++) out[i] = (struct candidate){x[i], i};
    for (long i = k / 2 - 1; i >= 0; i--) sift_down(out, k, i);
    long i = k;
    while (i < V) {
        if (i % VW == 0 && i + 4 * VW <= V) {
            const float *c = x + i;
            vec a = *(const vec_u *)c, b = *(const vec_u *)(c + VW);
            vec d = *(const vec_u *)(c + 2 * VW), e = *(const vec_u *)(c + 3 * VW);
            a = pick(a > b, a, b), d = pick(d > e, d, e);
            if (!(lane_max(pick(a > d, a, d)) > out[0].logit)) {
                i += 4 * VW;
                continue;
            }
        }
        long end = i % VW ? i + VW - i % VW : i + 4 * VW; /* up to the next vector's start */
        for (end = end < V ? end : V; i < end; i++) {
            if (x[i] > out[0].logit) {
                out[0] = (struct candidate){x[i], i};
                sift_down(out, k, 0);
            }
        }
    }
    for (long n = k - 1; n > 0; n--) { /* heap sort: the weakest to the back */
        struct candidate t = out[0];
        out[0] = out[n], out[n] = t;
        sift_down(out, n, 0);
    }
}

/* Index of the first of p[0..n) whose running sum exceeds target (the last if the draw
 * rounded up to the total), in chunks of 4 VW summed at once until the one it falls in; the
 * first largest p where that token's p is 0. */
static long invert(const float *p, long n, double target) {
    double running = 0.0;
    long i = 0;
    for (; i + 4 * VW <= n; i += 4 * VW) {
        const float *c = p + i;
        vec s = (*(const vec_u *)c + *(const vec_u *)(c + VW)) +
                (*(const vec_u *)(c + 2 * VW) + *(const vec_u *)(c + 3 * VW));
        double chunk = lane_sum(s);
        if (running + chunk > target) break;
        running += chunk;
    }
    for (; i < n - 1; i++) {
        running += p[i];
        if (running > target) break;
    }
    if (i >= n) i = n - 1;
    if (p[i] > 0.0f) return i;
    long best = 0;
    for (long j = 1; j < n; j++)
        if (p[j] > p[best]) best = j;
    return best;
}

/* Whether x[0..n) holds a NaN. */
static int has_nan(const float *x, long n) {
    mask seen = {0};
    long i = 0;
    for (; i + VW <= n; i += VW) {
        vec v = *(const vec_u *)(x + i);
        seen |= v != v;
    }
    int any = 0;
    for (int l = 0; l < VW; l++) any |= seen[l];
    for (; i < n; i++) any |= x[i] != x[i];
    return any;
}

/* For each row r < rows of logits (rows, V): out[r] = the token u[r] in [0, 1) draws, as
 * above (temperature > 0; top_p only with a top_k: unsorted, the caller leaves it to
 * torch). Returns 0, or -1 (nothing decided) where a row's logits hold a NaN or no finite
 * maximum, which torch's ops decide, or without memory. */
int sample_rows(const float *logits, long rows, long V, float temperature, long top_k,
                float top_p, const float *u, long *out) {
    long k = top_k > 0 && top_k < V ? top_k : V;
    int nucleus = top_p > 0.0f && top_p < 1.0f;
    if (rows < 1 || V < 1 || !(temperature > 0.0f) || (nucleus && k == V)) return -1;
    struct candidate *kept = k < V ? malloc(sizeof(struct candidate) * k) : NULL;
    float *p = malloc(sizeof(float) * k);
    int status = (k < V && !kept) || !p ? -1 : 0;
    for (long r = 0; r < rows && status == 0; r++) {
        const float *x = logits + r * V;
        if (has_nan(x, V)) {
            status = -1;
            break;
        }
        if (kept) {
            strongest(x, V, k, kept);
            for (long i = 0; i < k; i++) p[i] = kept[i].logit;
        } else {
            memcpy(p, x, sizeof(float) * V);
        }
        if (temperature != 1.0f) /* as torch: x / 1.0 is x, else the same division */
            for (long i = 0; i < k; i++) p[i] /= temperature;
        float top = kept ? p[0] : largest(p, k);
        if (!isfinite(top)) { /* every logit -inf, or one +inf: torch decides */
            status = -1;
            break;
        }
        double total = exp_scores(p, k, top);
        /* exp_nonpositive gives e^-87, not 0, below -87: a forbidden (-inf) token's 0 kept */
        for (long i = 0; i < k; i++)
            if ((kept ? kept[i].logit : x[i]) == -INFINITY) p[i] = 0.0f;
        if (nucleus) { /* zero each candidate whose mass before it reaches top_p */
            double before = 0.0, kept_mass = 0.0;
            for (long i = 0; i < k; i++) {
                float q = p[i];
                if (before / total >= top_p) p[i] = 0.0f;
                before += q;
                kept_mass += p[i];
            }
            total = kept_mass;
        }
        long i = invert(p, k, (double)u[r] * total);
        out[r] = kept ? kept[i].token : i;
    }
    free(kept);
    free(p);
    return status;
}
