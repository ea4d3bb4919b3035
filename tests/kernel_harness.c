/* The kernels' calls replayed from a file: what lets their numeric checks run on a CPU this
 * machine is not (tests/foreign_kernels.py builds it for aarch64 and runs it under qemu).
 *
 * Reads one call from stdin: records, each an 8-byte little-endian length then its bytes;
 * the first names the call, the rest are its arguments in the order below (an integer as
 * an int64 record, a real as a float64, an array as its bytes, an absent pointer as an
 * empty record). Writes the call's results to stdout as records the same way. Compiled as
 * one program with the kernels: this file includes decode_ops.c for its structs; f16_rows.c
 * and f16_matvec.c are linked beside it.
 */
#include <stdint.h>
#include <stdio.h>

#include "decode_ops.c"

struct record {
    void *p; /* NULL for an empty record */
    size_t n;
};

static void fail(const char *why) {
    fprintf(stderr, "kernel_harness: %s\n", why);
    exit(2);
}

#if WIDENS_HALF
void f16_rows(const float *x, long rows, const uint16_t *panels, float *y, long n_out, long k,
              int threads);
int f16_rows_panel(void);
int f16_rows_max(void);
void f16_matvec(const float *x, const uint16_t *w, float *y, long n_rows, long k, int threads);
int f16_matvec_rows(void);
int f16_matvec_step(void);
#else /* a CPU that widens no fp16: f16_rows.c and f16_matvec.c do not build for it */
static void f16_rows(const float *x, long rows, const uint16_t *panels, float *y, long n_out,
                     long k, int threads) {
    (void)x, (void)rows, (void)panels, (void)y, (void)n_out, (void)k, (void)threads;
    fail("no f16_rows on this CPU");
}
static void f16_matvec(const float *x, const uint16_t *w, float *y, long n_rows, long k,
                       int threads) {
    (void)x, (void)w, (void)y, (void)n_rows, (void)k, (void)threads;
    fail("no f16_matvec on this CPU");
}
static int f16_rows_panel(void) { return 0; }
static int f16_rows_max(void) { return 0; }
static int f16_matvec_rows(void) { return 0; }
static int f16_matvec_step(void) { return 0; }
#endif

static struct record next_record(void) {
    uint64_t n;
    struct record r = {NULL, 0};
    if (fread(&n, sizeof n, 1, stdin) != 1) fail("input ends inside a call");
    r.n = n;
    if (n == 0) return r;
    /* 64-byte aligned, and a vector's width of slack past the end for the widest loads */
    if (posix_memalign(&r.p, 64, n + 64)) fail("out of memory");
    if (fread(r.p, 1, n, stdin) != n) fail("input ends inside a record");
    return r;
}

static void *array(void) { return next_record().p; }

static long integer(void) {
    struct record r = next_record();
    if (r.n != 8) fail("an integer record is not 8 bytes");
    return (long)*(int64_t *)r.p;
}

static double real(void) {
    struct record r = next_record();
    if (r.n != 8) fail("a real record is not 8 bytes");
    return *(double *)r.p;
}

static void put(const void *p, size_t n) {
    uint64_t len = n;
    fwrite(&len, sizeof len, 1, stdout);
    if (n) fwrite(p, 1, n, stdout);
}

static void put_integer(long v) {
    int64_t w = v;
    put(&w, sizeof w);
}

/* A model as RowsStep.model holds it: its constants, the vocabulary's matrix, each layer. */
static struct rows_model *read_model(void) {
    struct rows_model *m = calloc(1, sizeof *m);
    m->n_layers = integer();
    m->C = integer(), m->F = integer(), m->H = integer(), m->Hkv = integer();
    m->D = integer(), m->ve_channels = integer(), m->V = integer();
    m->ve_scale = real(), m->eps = real(), m->norm_scale = real(), m->norm_eps = real();
    m->att_scale = real(), m->softcap = real();
    m->backout_layer = integer(), m->backout_lambda = real();
    m->half = integer(), m->bf16_table = integer();
    m->lm_head = array();
    struct rows_layer *layers = calloc(m->n_layers, sizeof *layers);
    for (long i = 0; i < m->n_layers; i++) {
        layers[i].qkv = array(), layers[i].proj = array();
        layers[i].fc = array(), layers[i].fc_proj = array();
        layers[i].ve_gate = array(), layers[i].ve_table = array();
        layers[i].window = integer();
        layers[i].resid_lambda = real(), layers[i].x0_lambda = real();
    }
    m->layers = layers;
    return m;
}

int main(void) {
    struct record name = next_record();
    char call[32] = {0};
    memcpy(call, name.p, name.n < sizeof call - 1 ? name.n : sizeof call - 1);
    if (!strcmp(call, "layout")) {
        long layout[] = {rows_block(), rows_half_panel(), rows_int8_panel(), f16_rows_panel(),
                         f16_rows_max(), f16_matvec_rows(), f16_matvec_step(),
                         rows_int8_interleave(), rows_int4_panel()};
        for (size_t i = 0; i < sizeof layout / sizeof *layout; i++) put_integer(layout[i]);
    } else if (!strcmp(call, "f16_matvec")) {
        float *x = array();
        uint16_t *w = array();
        long n = integer(), k = integer(), threads = integer();
        float *y = malloc(sizeof(float) * n);
        f16_matvec(x, w, y, n, k, (int)threads);
        put(y, sizeof(float) * n);
    } else if (!strcmp(call, "f16_rows")) {
        float *x = array();
        long rows = integer();
        uint16_t *panels = array();
        long out = integer(), k = integer(), threads = integer();
        float *y = malloc(sizeof(float) * rows * out);
        f16_rows(x, rows, panels, y, out, k, (int)threads);
        put(y, sizeof(float) * rows * out);
    } else if (!strcmp(call, "int8_product")) {
        float *x = array();
        long rows = integer(), in = integer();
        void *w = array();
        long out = integer(), threads = integer();
        float *y = malloc(sizeof(float) * rows * out);
        put_integer(rows_int8_product(x, rows, in, w, out, y, (int)threads));
        put(y, sizeof(float) * rows * out);
    } else if (!strcmp(call, "sample_rows")) {
        float *logits = array();
        long rows = integer(), V = integer();
        float temperature = real();
        long top_k = integer();
        float top_p = real();
        float *u = array();
        long *out = calloc(rows, sizeof(long));
        put_integer(sample_rows(logits, rows, V, temperature, top_k, top_p, u, out));
        put(out, sizeof(long) * rows);
    } else if (!strcmp(call, "embed")) {
        void *table = array();
        long bf16 = integer(), V = integer(), C = integer();
        long *ids = array(), *prev = array();
        long rows = integer();
        float *gate = array();
        long channels = integer();
        float lambda = real(), eps = real();
        float *x = calloc(rows * C, sizeof(float));
        put_integer(rows_embed(table, bf16, V, C, ids, prev, rows, gate, channels, lambda, eps, x));
        put(x, sizeof(float) * rows * C);
    } else if (!strcmp(call, "rows_step")) {
        /* the prefix packed here from its (layers, 1, T, Hkv, D) caches, as RowsStep does */
        struct rows_model *m = read_model();
        float *x = array();
        long rows = integer();
        long *ids = array();
        float *cos_ = array(), *sin_ = array();
        float *k = array(), *v = array();
        long prefix_len = integer(), prefix_layer = integer();
        struct rows_cache c = {0};
        c.sk = array(), c.sv = array();
        c.s_layer = integer(), c.s_row = integer(), c.pos = integer();
        long threads = integer();
        c.prefix = k ? prefix_len : 0;
        if (k) {
            long P = whole_blocks(prefix_len), Dp = whole_blocks(m->D);
            float *pk = malloc(sizeof(float) * m->n_layers * m->Hkv * P * m->D);
            float *pv = malloc(sizeof(float) * m->n_layers * m->Hkv * Dp * prefix_len);
            rows_pack_prefix(k, v, m->n_layers, prefix_layer, prefix_layer, m->Hkv, m->D,
                             prefix_len, pk, pv, (int)threads);
            c.pk = pk, c.pv = pv;
        }
        float *logits = malloc(sizeof(float) * rows * m->V);
        put_integer(rows_step(m, x, rows, ids, cos_, sin_, &c, logits, (int)threads));
        put(logits, sizeof(float) * rows * m->V);
        put(x, sizeof(float) * rows * m->C);
        size_t cache = sizeof(float) * m->n_layers * c.s_layer;
        put(c.sk, cache);
        put(c.sv, cache);
    } else if (!strcmp(call, "rows_step_slots")) {
        struct rows_model *m = read_model();
        float *x = array();
        long rows = integer();
        long *ids = array();
        float *cos_ = array(), *sin_ = array();
        long *slot = array(), *pos = array();
        long chained = integer();
        struct rows_cache c = {0};
        c.sk = array(), c.sv = array();
        c.s_layer = integer(), c.s_row = integer();
        long *out = array();
        long n_out = integer(), threads = integer();
        float *logits = malloc(sizeof(float) * (n_out ? n_out : 1) * m->V);
        put_integer(rows_step_slots(m, x, rows, ids, cos_, sin_, slot, pos, chained, &c, out,
                                    n_out, logits, (int)threads));
        put(logits, sizeof(float) * n_out * m->V);
        size_t cache = sizeof(float) * m->n_layers * c.s_layer;
        put(c.sk, cache);
        put(c.sv, cache);
    } else {
        fail("no such call");
    }
    return 0;
}
