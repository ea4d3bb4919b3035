/* The vector lanes the kernels compute in, for the CPU they are built for.
 *
 * Owns: VW (fp32 lanes a vector: 16 with AVX-512F, 8 with AVX, 4 with aarch64's NEON or
 * x86-64's SSE, 4 of plain C elsewhere), the GCC vector types over them (vec, vec_u, mask),
 * how a compact weight widens to fp32 lanes (widen_half, widen_int8; WIDENS_HALF and
 * WIDENS_INT8 say whether this CPU can), int8's integer dot products where the CPU has
 * them (load_codes, dot_int8; DOT_INT8) and IN_REGISTER. Knows nothing about what a kernel
 * computes. The arithmetic itself is GCC's vector extension (GCC and clang both take it),
 * so one loop is AVX-512, AVX2, NEON or scalar code by what the compiler was told the CPU is
 * (-march / -mcpu). Intrinsics appear only where a widening has no portable spelling.
 *
 * fp16 and int8 weights are widened to fp32 and summed in fp32 on every CPU, NEON's with
 * fp16 arithmetic (__ARM_FEATURE_FP16_VECTOR_ARITHMETIC) too: a sum kept in fp16 rounds
 * to 11 bits at every add, far outside the 1e-4 the kernels' load checks hold them to
 * against torch, and the weights' bytes, not the adds, set a decode step's pace.
 */
#ifndef CHATCLI_LANES_H
#define CHATCLI_LANES_H

#if defined(__AVX512F__)
#define VW 16
#elif defined(__AVX__)
#define VW 8
#else
#define VW 4
#endif

/* Vector registers the loops may plan for: AVX-512 and aarch64 have 32, AVX2/SSE 16. */
#if VW == 16 || defined(__aarch64__)
#define LANE_REGISTERS 32
#else
#define LANE_REGISTERS 16
#endif

typedef float vec __attribute__((vector_size(VW * sizeof(float))));
typedef float vec_u __attribute__((vector_size(VW * sizeof(float)), aligned(sizeof(float))));
typedef int mask __attribute__((vector_size(VW * sizeof(float))));

/* A vector the compiler must hold in a register: without it GCC folded a weight's load
 * into every FMA that reads it, one load per FMA where one served them all, and the load
 * ports, not the FMAs, set the pace (192x768 on a Zen 3 core, AVX2: 4 rows 20 us against
 * 13.6 held, 3 rows 16.8 against 13.3; 6 rows the same). */
#if defined(__x86_64__) || defined(__i386__)
#define IN_REGISTER(v) __asm__("" : "+x"(v))
#elif defined(__aarch64__) && defined(__ARM_NEON)
#define IN_REGISTER(v) __asm__("" : "+w"(v))
#else
#define IN_REGISTER(v) (void)0
#endif

/* widen_half: VW fp16 weights at p as fp32 lanes (F16C's vcvtph2ps; NEON's fcvtl, in
 * every aarch64 CPU). widen_int8: VW int8 weights at p (AVX2's or NEON's sign extension,
 * then an exact conversion). Where the CPU has neither, WIDENS_* is 0 and the kernels
 * refuse such matrices (torch's ops take them). */
#if defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#include <string.h>
#define WIDENS_HALF 1
#define WIDENS_INT8 1
static inline vec widen_half(const unsigned short *p) {
    return (vec)vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)));
}
static inline vec widen_int8(const signed char *p) {
    int word; /* 4 bytes, not vld1_s8's 8: the last weights of a buffer end at p + 4 */
    memcpy(&word, p, sizeof word);
    int16x8_t wide = vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(word)));
    return (vec)vcvtq_f32_s32(vmovl_s16(vget_low_s16(wide)));
}
#elif (defined(__x86_64__) || defined(__i386__)) && defined(__F16C__) && VW >= 8
#include <immintrin.h>
#define WIDENS_HALF 1
#if defined(__AVX2__)
#define WIDENS_INT8 1
#else
#define WIDENS_INT8 0
#endif
static inline vec widen_half(const unsigned short *p) {
#if VW == 16
    return (vec)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#else
    return (vec)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#endif
}
static inline vec widen_int8(const signed char *p) {
#if WIDENS_INT8 && VW == 16
    return (vec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif WIDENS_INT8
    return (vec)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    (void)p;
    return (vec){0};
#endif
}
#else
#define WIDENS_HALF 0
#define WIDENS_INT8 0
#endif

/* Integer dot products of int8 weights (DOT_INT8): each 32-bit lane sums four products of
 * a weight byte and an activation byte, 4 VW products an instruction where widening takes
 * three instructions for VW (AVX-512 VNNI's vpdpbusd, AVX-VNNI's on 8 lanes, aarch64's
 * sdot). The layout they read (panels.Int8Panels, interleave 4): a panel's VW columns'
 * four codes of one group of four inputs side by side, each code stored + 128 (x86's
 * instruction takes unsigned weights times signed activations; NEON flips the bit back and
 * multiplies signed by signed). load_codes reads a group's VW * 4 bytes; dot_int8 adds the
 * products with four activation bytes (one int, every lane the same) into acc;
 * load_nibbles reads VW * 4 bytes of int4 codes (0-15) as two such groups, the low
 * nibbles and the high ones, each code a byte. DOT_OFFSET:
 * what each weight carries beyond its code in those products (the caller takes 128 times
 * the activations' sum back off). */
typedef int ivec __attribute__((vector_size(VW * sizeof(int))));
typedef double dvec __attribute__((vector_size(VW * sizeof(double))));
#if defined(__AVX512VNNI__) && VW == 16
#define DOT_INT8 1
#define DOT_OFFSET 128
typedef __m512i codes_t;
static inline codes_t load_codes(const unsigned char *p) { return _mm512_loadu_si512(p); }
static inline ivec dot_int8(ivec acc, codes_t w, int a) {
    return (ivec)_mm512_dpbusd_epi32((__m512i)acc, w, _mm512_set1_epi32(a));
}
static inline void load_nibbles(const unsigned char *p, codes_t *low, codes_t *high) {
    __m512i v = _mm512_loadu_si512(p), m = _mm512_set1_epi8(15);
    *low = _mm512_and_si512(v, m), *high = _mm512_and_si512(_mm512_srli_epi16(v, 4), m);
}
#elif defined(__AVXVNNI__) && VW == 8
#define DOT_INT8 1
#define DOT_OFFSET 128
typedef __m256i codes_t;
static inline codes_t load_codes(const unsigned char *p) {
    return _mm256_loadu_si256((const __m256i *)p);
}
static inline ivec dot_int8(ivec acc, codes_t w, int a) {
    return (ivec)_mm256_dpbusd_avx_epi32((__m256i)acc, w, _mm256_set1_epi32(a));
}
static inline void load_nibbles(const unsigned char *p, codes_t *low, codes_t *high) {
    __m256i v = _mm256_loadu_si256((const __m256i *)p), m = _mm256_set1_epi8(15);
    *low = _mm256_and_si256(v, m), *high = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
}
#elif defined(__aarch64__) && defined(__ARM_NEON) && defined(__ARM_FEATURE_DOTPROD)
#define DOT_INT8 1
#define DOT_OFFSET 0
typedef int8x16_t codes_t;
static inline codes_t load_codes(const unsigned char *p) {
    return veorq_s8(vreinterpretq_s8_u8(vld1q_u8(p)), vdupq_n_s8(-128));
}
static inline ivec dot_int8(ivec acc, codes_t w, int a) {
    return (ivec)vdotq_s32((int32x4_t)acc, w, vreinterpretq_s8_s32(vdupq_n_s32(a)));
}
static inline void load_nibbles(const unsigned char *p, codes_t *low, codes_t *high) {
    uint8x16_t v = vld1q_u8(p);
    *low = vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(15)));
    *high = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));
}
#else
#define DOT_INT8 0
#endif

#endif
