/* y[M,N] = x[M,K] @ dequant(W)[N,K]^T (+ bias) with W kept as GGUF blocks (Q4_1, Q5_0, Q8_0, Q4_K, Q6_K).
 *
 * Why: a verification pass of M = 2..16 rows at batch 1 is bound by reading the weights; GGUF blocks
 * are 4.5-8.5 bits a weight, 1/4-1/7 of the float32 bytes they decode to.  Here the blocks of R = 8
 * weight rows are decoded ONCE per call, a tile of KT elements at a time, into a float32 buffer in
 * L1, and that buffer feeds every one of the M input rows through register tiles of up to 24
 * accumulators (each vector loaded feeds several multiply-adds), so the block bytes are read and
 * decoded once whatever M is.  Where the time goes (benchmarks/bench_quant.py): decoding (16 lanes on
 * AVX-512, 8 on AVX2; 4-bit codes through a 16-entry table per block), then one multiply-add per
 * weight and input row, which is what grows with M.
 *
 * Numbers (the contract "gguf-exact-f32"):
 *   - the decoded weights are exactly gguf-py's dequantisation (gguf.quants.dequantize, which the
 *     float32 checkpoints hold): the same float32 operations in the same order, each rounded on its
 *     own (built with -ffp-contract=off, so no multiply-add of a decode is fused);
 *   - y[m,n] = sum_k w[n,k] x[m,k] in float32: the K products go into VW lanes, lane j
 *     accumulating k = v * VW + j over v in increasing order by fused multiply-add (one rounding
 *     each, from an accumulator of 0), then the VW lanes are summed by a fixed pairwise tree, then
 *     the bias is added.  Nothing of that depends on M, on which rows share the
 *     call or on the thread count (one thread computes a whole output), so a row's output bits are
 *     the same alone and inside any pass: the kernel is batch invariant.
 *   - error: every product passes through at most n = K / VW + log2(VW) roundings, so
 *     |y_hat - y| <= gamma_n * sum_k |w x|, gamma_n = n u / (1 - n u), u = 2^-24 (+ gamma_{n+1} |b|).
 *
 * Threads: output rows are split over OpenMP threads (torch's own runtime inside a torch process).
 * Built by draftcert.models.quantmm with -O3 -march=native -ffp-contract=off (-fopenmp where it
 * links); the vector width follows the target (AVX-512: 16 lanes, AVX2: 8, else 4). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

/* R weight rows are decoded together (a tile of KT elements each, in L1) and feed every input row;
 * the register tiles that apply them (tile_all) hold MM input rows x RR weight rows of accumulators. */
#if defined(__AVX512F__)
#define VW 16
#define MC 6 /* input rows per register tile: 6 x 4 accumulators + 4 weight vectors + 1 input of 32 registers */
#elif defined(__AVX2__) && defined(__FMA__)
#define VW 8
#define MC 2 /* 2 x 4 accumulators + 4 + 1 of 16 registers */
#else
#define VW 4
#define MC 2
#endif
#define R 8
#define KT 256 /* a multiple of every block size (32, 256): R * KT weights and 16 input rows' tiles fit in L1 */
#ifndef PD
#define PD 2 /* groups of R rows ahead that the block bytes are prefetched (to L2) */
#endif
#define MGROUP 64 /* input rows whose accumulators and inputs stay in cache while the weights are decoded for them */

/* Keep a loaded vector in a register: without it the compiler folds the load into every
 * multiply-add that uses it (one load per use), which made the kernel load bound. */
#if defined(__x86_64__) || defined(__i386__)
#define IN_REGISTER(v) __asm__("" : "+v"(v))
#else
#define IN_REGISTER(v) ((void)0)
#endif

typedef float vf __attribute__((vector_size(VW * 4), aligned(4)));
typedef float vfa __attribute__((vector_size(VW * 4)));

/* acc + w * x with one rounding (a fused multiply-add) where the ISA has one, else two roundings;
 * the same for every M, which is all batch invariance needs. */
static inline vf fmadd(vf w, vf x, vf acc)
{
#if defined(__AVX512F__)
    return (vf)_mm512_fmadd_ps((__m512)w, (__m512)x, (__m512)acc);
#elif defined(__AVX2__) && defined(__FMA__)
    return (vf)_mm256_fmadd_ps((__m256)w, (__m256)x, (__m256)acc);
#else
    return acc + w * x;
#endif
}

enum { Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q6_K = 14 }; /* GGMLQuantizationType values */

int dq_vector_width(void) { return VW; }
int dq_rows_per_set(void) { return MC; }

int dq_block(int qtype, int *elements, int *bytes)
{
    switch (qtype) {
    case Q4_1: *elements = 32; *bytes = 20; return 0;
    case Q5_0: *elements = 32; *bytes = 22; return 0;
    case Q8_0: *elements = 32; *bytes = 34; return 0;
    case Q4_K: *elements = 256; *bytes = 144; return 0;
    case Q6_K: *elements = 256; *bytes = 210; return 0;
    }
    return -1;
}

/* IEEE half to float, exact (subnormals, infinities and NaNs included). */
static inline float h2f(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man) { /* subnormal: normalise */
        int e = -1;
        do { man <<= 1; e++; } while (!(man & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3FF) << 13);
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* Sub-block i's 6-bit scale and min of a Q4_K block (its 12 packed bytes s), as gguf-py unpacks them. */
static inline void q4k_scale_min(const uint8_t *s, int i, int *sc, int *mn)
{
    if (i < 4) {
        *sc = s[i] & 0x3F;
        *mn = s[i + 4] & 0x3F;
    } else {
        *sc = (s[i + 4] & 0x0F) | ((s[i - 4] >> 2) & 0x30);
        *mn = (s[i + 4] >> 4) | ((s[i] >> 2) & 0x30);
    }
}

#if defined(__AVX512F__)
/* The same decodes 16 lanes at a time: each element's float32 operations are the scalar code's
 * (an exact int->float conversion, then a rounded multiply and a rounded add or subtract; no fused
 * multiply-add under -ffp-contract=off), so the values are bit for bit the scalar ones. */
#define V16(p) _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(p))
/* The 16 values a 4-bit code can take in a block, computed with the scalar code's operations, then
 * looked up per element (vpermps): the same values, 2 vector operations per 16 elements fewer. */
static inline __m512 iota16(void) { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
#define NIB16(p) _mm512_cvtepu8_epi32(p)
static inline void dec_q4_1(const uint8_t *b, float *restrict o)
{
    const __m512 lut = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(h2f(b)), iota16()), _mm512_set1_ps(h2f(b + 2)));
    const __m128i q = _mm_loadu_si128((const __m128i *)(b + 4));
    _mm512_storeu_ps(o, _mm512_permutexvar_ps(NIB16(q), lut)); /* vpermps reads the index's low 4 bits */
    _mm512_storeu_ps(o + 16, _mm512_permutexvar_ps(NIB16(_mm_srli_epi16(q, 4)), lut));
}

static inline void dec_q5_0(const uint8_t *b, float *restrict o)
{
    const __m512 d = _mm512_set1_ps(h2f(b));
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    const __m128i q = _mm_loadu_si128((const __m128i *)(b + 6)), lo4 = _mm_set1_epi8(0x0F);
    const __m512i s16 = _mm512_set1_epi32(16);
    __m512i lo = _mm512_cvtepu8_epi32(_mm_and_si128(q, lo4));
    __m512i hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), lo4));
    lo = _mm512_sub_epi32(_mm512_mask_or_epi32(lo, (__mmask16)(qh & 0xFFFF), lo, s16), s16);
    hi = _mm512_sub_epi32(_mm512_mask_or_epi32(hi, (__mmask16)(qh >> 16), hi, s16), s16);
    _mm512_storeu_ps(o, _mm512_mul_ps(d, _mm512_cvtepi32_ps(lo)));
    _mm512_storeu_ps(o + 16, _mm512_mul_ps(d, _mm512_cvtepi32_ps(hi)));
}

static inline void dec_q8_0(const uint8_t *b, float *restrict o)
{
    const __m512 d = _mm512_set1_ps(h2f(b));
    const __m128i q0 = _mm_loadu_si128((const __m128i *)(b + 2)), q1 = _mm_loadu_si128((const __m128i *)(b + 18));
    _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)), d));
    _mm512_storeu_ps(o + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)), d));
}

static inline void dec_q4_k(const uint8_t *b, float *restrict o)
{
    const float d = h2f(b), dmin = h2f(b + 2);
    const uint8_t *s = b + 4, *qs = b + 16;
    const __m128i lo4 = _mm_set1_epi8(0x0F);
    for (int i = 0; i < 8; i++) {
        int sc, mn;
        q4k_scale_min(s, i, &sc, &mn);
        const __m512 lut = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(d * (float)sc), iota16()),
                                         _mm512_set1_ps(dmin * (float)mn));
        const uint8_t *q = qs + 32 * (i >> 1);
        __m128i a = _mm_loadu_si128((const __m128i *)q), c = _mm_loadu_si128((const __m128i *)(q + 16));
        if (i & 1) {
            a = _mm_srli_epi16(a, 4);
            c = _mm_srli_epi16(c, 4);
        }
        _mm512_storeu_ps(o + 32 * i, _mm512_permutexvar_ps(NIB16(a), lut));
        _mm512_storeu_ps(o + 32 * i + 16, _mm512_permutexvar_ps(NIB16(c), lut));
    }
}

static inline void dec_q6_k(const uint8_t *b, float *restrict o)
{
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = h2f(b + 208);
    float ds[16];
    for (int i = 0; i < 16; i++) ds[i] = d * (float)sc[i];
    const __m512i m4 = _mm512_set1_epi32(0x0F), m3 = _mm512_set1_epi32(3), s32 = _mm512_set1_epi32(32);
    for (int h = 0; h < 2; h++) {
        const uint8_t *l = ql + 64 * h, *q = qh + 32 * h;
        float *oo = o + 128 * h;
        const float *dh = ds + 8 * h;
        for (int j0 = 0; j0 < 32; j0 += 16) {
            const __m512i L0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(l + j0)));
            const __m512i L1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(l + j0 + 32)));
            const __m512i Q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + j0)));
            __m512i q1 = _mm512_or_si512(_mm512_and_si512(L0, m4), _mm512_slli_epi32(_mm512_and_si512(Q, m3), 4));
            __m512i q2 = _mm512_or_si512(_mm512_and_si512(L1, m4),
                                         _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(Q, 2), m3), 4));
            __m512i q3 = _mm512_or_si512(_mm512_srli_epi32(L0, 4),
                                         _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(Q, 4), m3), 4));
            __m512i q4 = _mm512_or_si512(_mm512_srli_epi32(L1, 4), _mm512_slli_epi32(_mm512_srli_epi32(Q, 6), 4));
            const int si = j0 / 16;
            _mm512_storeu_ps(oo + j0, _mm512_mul_ps(_mm512_set1_ps(dh[0 + si]), _mm512_cvtepi32_ps(_mm512_sub_epi32(q1, s32))));
            _mm512_storeu_ps(oo + j0 + 32, _mm512_mul_ps(_mm512_set1_ps(dh[2 + si]), _mm512_cvtepi32_ps(_mm512_sub_epi32(q2, s32))));
            _mm512_storeu_ps(oo + j0 + 64, _mm512_mul_ps(_mm512_set1_ps(dh[4 + si]), _mm512_cvtepi32_ps(_mm512_sub_epi32(q3, s32))));
            _mm512_storeu_ps(oo + j0 + 96, _mm512_mul_ps(_mm512_set1_ps(dh[6 + si]), _mm512_cvtepi32_ps(_mm512_sub_epi32(q4, s32))));
        }
    }
}
#undef V16
#elif defined(__AVX2__) && defined(__FMA__)
/* AVX2: the same decodes 8 lanes at a time (the scalar code's operations per element, bit for bit). */
static inline __m256 u8x8(__m128i q) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)); } /* bytes 0..7 */
static inline __m128i hi8(__m128i q) { return _mm_unpackhi_epi64(q, q); }
static inline void dec_q4_1(const uint8_t *b, float *restrict o)
{
    const __m256 d = _mm256_set1_ps(h2f(b)), m = _mm256_set1_ps(h2f(b + 2));
    const __m128i q = _mm_loadu_si128((const __m128i *)(b + 4)), lo4 = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(q, lo4), hi = _mm_and_si128(_mm_srli_epi16(q, 4), lo4);
    _mm256_storeu_ps(o, _mm256_add_ps(_mm256_mul_ps(d, u8x8(lo)), m));
    _mm256_storeu_ps(o + 8, _mm256_add_ps(_mm256_mul_ps(d, u8x8(hi8(lo))), m));
    _mm256_storeu_ps(o + 16, _mm256_add_ps(_mm256_mul_ps(d, u8x8(hi)), m));
    _mm256_storeu_ps(o + 24, _mm256_add_ps(_mm256_mul_ps(d, u8x8(hi8(hi))), m));
}

static inline void dec_q5_0(const uint8_t *b, float *restrict o)
{
    const __m256 d = _mm256_set1_ps(h2f(b));
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    const __m128i q = _mm_loadu_si128((const __m128i *)(b + 6)), lo4 = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(q, lo4), hi = _mm_and_si128(_mm_srli_epi16(q, 4), lo4);
    const __m256i qv = _mm256_set1_epi32((int)qh), one = _mm256_set1_epi32(1), s16 = _mm256_set1_epi32(16);
    const __m256i j8 = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m128i parts[4] = {lo, hi8(lo), hi, hi8(hi)};
    for (int p = 0; p < 4; p++) { /* elements 8p..8p+7: bit (8p + j) of qh (parts 0,1: j; 2,3: j + 16) */
        const __m256i bit = _mm256_and_si256(_mm256_srlv_epi32(qv, _mm256_add_epi32(j8, _mm256_set1_epi32(8 * p))), one);
        const __m256i v = _mm256_sub_epi32(_mm256_or_si256(_mm256_cvtepu8_epi32(parts[p]), _mm256_slli_epi32(bit, 4)), s16);
        _mm256_storeu_ps(o + 8 * p, _mm256_mul_ps(d, _mm256_cvtepi32_ps(v)));
    }
}

static inline void dec_q8_0(const uint8_t *b, float *restrict o)
{
    const __m256 d = _mm256_set1_ps(h2f(b));
    for (int p = 0; p < 4; p++) {
        const __m128i q = _mm_loadl_epi64((const __m128i *)(b + 2 + 8 * p));
        _mm256_storeu_ps(o + 8 * p, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d));
    }
}

static inline void dec_q4_k(const uint8_t *b, float *restrict o)
{
    const float d = h2f(b), dmin = h2f(b + 2);
    const uint8_t *s = b + 4, *qs = b + 16;
    const __m128i lo4 = _mm_set1_epi8(0x0F);
    for (int i = 0; i < 8; i++) {
        int sc, mn;
        q4k_scale_min(s, i, &sc, &mn);
        const __m256 dd = _mm256_set1_ps(d * (float)sc), dm = _mm256_set1_ps(dmin * (float)mn);
        const uint8_t *q = qs + 32 * (i >> 1);
        __m128i a = _mm_loadu_si128((const __m128i *)q), c = _mm_loadu_si128((const __m128i *)(q + 16));
        if (i & 1) {
            a = _mm_srli_epi16(a, 4);
            c = _mm_srli_epi16(c, 4);
        }
        a = _mm_and_si128(a, lo4);
        c = _mm_and_si128(c, lo4);
        float *oo = o + 32 * i;
        _mm256_storeu_ps(oo, _mm256_sub_ps(_mm256_mul_ps(dd, u8x8(a)), dm));
        _mm256_storeu_ps(oo + 8, _mm256_sub_ps(_mm256_mul_ps(dd, u8x8(hi8(a))), dm));
        _mm256_storeu_ps(oo + 16, _mm256_sub_ps(_mm256_mul_ps(dd, u8x8(c)), dm));
        _mm256_storeu_ps(oo + 24, _mm256_sub_ps(_mm256_mul_ps(dd, u8x8(hi8(c))), dm));
    }
}

static inline void dec_q6_k(const uint8_t *b, float *restrict o)
{
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = h2f(b + 208);
    float ds[16];
    for (int i = 0; i < 16; i++) ds[i] = d * (float)sc[i];
    const __m256i m4 = _mm256_set1_epi32(0x0F), m3 = _mm256_set1_epi32(3), s32 = _mm256_set1_epi32(32);
    for (int h = 0; h < 2; h++) {
        const uint8_t *l = ql + 64 * h, *q = qh + 32 * h;
        float *oo = o + 128 * h;
        const float *dh = ds + 8 * h;
        for (int j0 = 0; j0 < 32; j0 += 8) {
            const __m256i L0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(l + j0)));
            const __m256i L1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(l + j0 + 32)));
            const __m256i Q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + j0)));
            const __m256i q1 = _mm256_or_si256(_mm256_and_si256(L0, m4), _mm256_slli_epi32(_mm256_and_si256(Q, m3), 4));
            const __m256i q2 = _mm256_or_si256(_mm256_and_si256(L1, m4),
                                               _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(Q, 2), m3), 4));
            const __m256i q3 = _mm256_or_si256(_mm256_srli_epi32(L0, 4),
                                               _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(Q, 4), m3), 4));
            const __m256i q4 = _mm256_or_si256(_mm256_srli_epi32(L1, 4), _mm256_slli_epi32(_mm256_srli_epi32(Q, 6), 4));
            const int si = j0 / 16;
            _mm256_storeu_ps(oo + j0, _mm256_mul_ps(_mm256_set1_ps(dh[0 + si]), _mm256_cvtepi32_ps(_mm256_sub_epi32(q1, s32))));
            _mm256_storeu_ps(oo + j0 + 32, _mm256_mul_ps(_mm256_set1_ps(dh[2 + si]), _mm256_cvtepi32_ps(_mm256_sub_epi32(q2, s32))));
            _mm256_storeu_ps(oo + j0 + 64, _mm256_mul_ps(_mm256_set1_ps(dh[4 + si]), _mm256_cvtepi32_ps(_mm256_sub_epi32(q3, s32))));
            _mm256_storeu_ps(oo + j0 + 96, _mm256_mul_ps(_mm256_set1_ps(dh[6 + si]), _mm256_cvtepi32_ps(_mm256_sub_epi32(q4, s32))));
        }
    }
}
#else
/* One block to float32, in gguf-py's order of operations (see gguf/quants.py). */
static inline void dec_q4_1(const uint8_t *b, float *restrict o)
{
    const float d = h2f(b), m = h2f(b + 2);
    const uint8_t *qs = b + 4;
    for (int j = 0; j < 16; j++) {
        o[j] = d * (float)(qs[j] & 0x0F) + m;
        o[j + 16] = d * (float)(qs[j] >> 4) + m;
    }
}

static inline void dec_q5_0(const uint8_t *b, float *restrict o)
{
    const float d = h2f(b);
    uint32_t qh;
    memcpy(&qh, b + 2, 4); /* little endian, as gguf-py's view(np.uint32) on x86 */
    const uint8_t *qs = b + 6;
    for (int j = 0; j < 16; j++) {
        int lo = (qs[j] & 0x0F) | (((qh >> j) & 1) << 4);
        int hi = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
        o[j] = d * (float)(lo - 16);
        o[j + 16] = d * (float)(hi - 16);
    }
}

static inline void dec_q8_0(const uint8_t *b, float *restrict o)
{
    const float d = h2f(b);
    const int8_t *qs = (const int8_t *)(b + 2);
    for (int j = 0; j < 32; j++) o[j] = (float)qs[j] * d;
}

static inline void dec_q4_k(const uint8_t *b, float *restrict o)
{
    const float d = h2f(b), dmin = h2f(b + 2);
    const uint8_t *s = b + 4, *qs = b + 16;
    for (int i = 0; i < 8; i++) {
        int sc, mn;
        q4k_scale_min(s, i, &sc, &mn);
        const float dd = d * (float)sc, dm = dmin * (float)mn;
        const uint8_t *q = qs + 32 * (i >> 1);
        const int shift = 4 * (i & 1);
        float *oo = o + 32 * i;
        for (int j = 0; j < 32; j++) oo[j] = dd * (float)((q[j] >> shift) & 0x0F) - dm;
    }
}

static inline void dec_q6_k(const uint8_t *b, float *restrict o)
{
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = h2f(b + 208);
    float ds[16];
    for (int i = 0; i < 16; i++) ds[i] = d * (float)sc[i];
    for (int h = 0; h < 2; h++) {
        const uint8_t *l = ql + 64 * h, *q = qh + 32 * h;
        float *oo = o + 128 * h;
        const float *dh = ds + 8 * h;
        for (int j0 = 0; j0 < 32; j0 += 16) { /* 16 elements share a scale */
            const float s1 = dh[0 + j0 / 16], s2 = dh[2 + j0 / 16], s3 = dh[4 + j0 / 16], s4 = dh[6 + j0 / 16];
            for (int j = j0; j < j0 + 16; j++) {
                int q1 = ((l[j] & 0x0F) | (((q[j] >> 0) & 3) << 4)) - 32;
                int q2 = ((l[j + 32] & 0x0F) | (((q[j] >> 2) & 3) << 4)) - 32;
                int q3 = ((l[j] >> 4) | (((q[j] >> 4) & 3) << 4)) - 32;
                int q4 = ((l[j + 32] >> 4) | (((q[j] >> 6) & 3) << 4)) - 32;
                oo[j] = s1 * (float)q1;
                oo[j + 32] = s2 * (float)q2;
                oo[j + 64] = s3 * (float)q3;
                oo[j + 96] = s4 * (float)q4;
            }
        }
    }
}

#endif

/* Elements [k0, k0 + kt) of a weight row (whole blocks, contiguous) to float32. */
static void decode_span(int qtype, const uint8_t *restrict row, long k0, long kt, float *restrict o)
{
    switch (qtype) {
    case Q4_1: row += k0 / 32 * 20; for (long k = 0; k < kt; k += 32, row += 20) dec_q4_1(row, o + k); break;
    case Q5_0: row += k0 / 32 * 22; for (long k = 0; k < kt; k += 32, row += 22) dec_q5_0(row, o + k); break;
    case Q8_0: row += k0 / 32 * 34; for (long k = 0; k < kt; k += 32, row += 34) dec_q8_0(row, o + k); break;
    case Q4_K: row += k0 / 256 * 144; for (long k = 0; k < kt; k += 256, row += 144) dec_q4_k(row, o + k); break;
    case Q6_K: row += k0 / 256 * 210; for (long k = 0; k < kt; k += 256, row += 210) dec_q6_k(row, o + k); break;
    }
}

/* The fixed horizontal sum of one output's VW lanes: a pairwise tree, t[i] += t[i + w] for
 * w = VW/2, ..., 1 (the same additions whichever code computes them: a vector add of the two
 * halves is exactly those adds). */
static inline float hsum(vf s)
{
#if defined(__AVX512F__)
    const __m512 v = (__m512)s;
    const __m256 v8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    const __m128 v4 = _mm_add_ps(_mm256_castps256_ps128(v8), _mm256_extractf128_ps(v8, 1));
    const __m128 v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
    return _mm_cvtss_f32(_mm_add_ss(v2, _mm_shuffle_ps(v2, v2, 1)));
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256 v = (__m256)s;
    const __m128 v4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
    return _mm_cvtss_f32(_mm_add_ss(v2, _mm_shuffle_ps(v2, v2, 1)));
#else
    float t[VW];
    memcpy(t, &s, sizeof t);
    for (int w = VW / 2; w >= 1; w /= 2)
        for (int i = 0; i < w; i++) t[i] += t[i + w];
    return t[0];
#endif
}

/* For MM input rows (x: their k-tile, row stride K) and RR decoded weight rows of a tile (buf: their
 * [RR][KT] rows, kt used): acc[m * R + r] += lanes of w_r * x_m over the tile, k in increasing
 * order, one fused multiply-add each.  acc lives in memory between tiles; its lane values follow
 * the same sequence of roundings whatever MM, RR or the loop order (xstat: inputs held in
 * registers, weights streamed; else the reverse) are: only the registers holding them change. */
static inline __attribute__((always_inline)) void
tile_rows(const float *restrict buf, const float *restrict x, long K, long kt, vf *restrict acc, const int MM,
          const int RR, const int xstat)
{
    vf a[MC > 3 ? MC : 3][R];
#pragma GCC unroll 8
    for (int m = 0; m < MM; m++)
#pragma GCC unroll 8
        for (int r = 0; r < RR; r++) a[m][r] = acc[m * R + r];
    for (long k = 0; k < kt; k += VW) {
        if (xstat) {
            vf xv[MC > 3 ? MC : 3];
#pragma GCC unroll 8
            for (int m = 0; m < MM; m++) {
                xv[m] = *(const vf *)(x + m * K + k);
                IN_REGISTER(xv[m]); /* one load per vector, not one per use */
            }
#pragma GCC unroll 8
            for (int r = 0; r < RR; r++) {
                vf w = *(const vf *)(buf + r * KT + k);
                IN_REGISTER(w);
#pragma GCC unroll 8
                for (int m = 0; m < MM; m++) a[m][r] = fmadd(w, xv[m], a[m][r]);
            }
        } else {
            vf w[R];
#pragma GCC unroll 8
            for (int r = 0; r < RR; r++) w[r] = *(const vf *)(buf + r * KT + k);
#pragma GCC unroll 8
            for (int m = 0; m < MM; m++) {
                vf xv = *(const vf *)(x + m * K + k);
                IN_REGISTER(xv);
#pragma GCC unroll 8
                for (int r = 0; r < RR; r++) a[m][r] = fmadd(w[r], xv, a[m][r]);
            }
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < MM; m++)
#pragma GCC unroll 8
        for (int r = 0; r < RR; r++) acc[m * R + r] = a[m][r];
}

/* All M input rows against the R decoded rows of buf, in register tiles of at most 24 (AVX-512) or
 * 8 accumulators: enough independent chains to cover the multiply-add latency at every M, each
 * input vector loaded once per tile. */
static void tile_all(const float *restrict buf, const float *restrict x, long M, long K, long kt, vf *restrict acc)
{
    const float *b4 = buf + 4 * KT;
    long m0 = 0;
#if defined(__AVX512F__)
    for (; m0 + MC <= M; m0 += MC) {
        tile_rows(buf, x + m0 * K, K, kt, acc + m0 * R, MC, 4, 0);
        tile_rows(b4, x + m0 * K, K, kt, acc + m0 * R + 4, MC, 4, 0);
    }
    const float *xm = x + m0 * K;
    vf *am = acc + m0 * R;
    switch (M - m0) {
    case 1: tile_rows(buf, xm, K, kt, am, 1, 8, 0); break;
    case 2: tile_rows(buf, xm, K, kt, am, 2, 8, 0); break;
    case 3: tile_rows(buf, xm, K, kt, am, 3, 8, 1); break;
    case 4: tile_rows(buf, xm, K, kt, am, 4, 4, 1); tile_rows(b4, xm, K, kt, am + 4, 4, 4, 1); break;
    case 5: tile_rows(buf, xm, K, kt, am, 5, 4, 0); tile_rows(b4, xm, K, kt, am + 4, 5, 4, 0); break;
    }
#else
    for (; m0 + MC <= M; m0 += MC) {
        tile_rows(buf, x + m0 * K, K, kt, acc + m0 * R, MC, 4, 0);
        tile_rows(b4, x + m0 * K, K, kt, acc + m0 * R + 4, MC, 4, 0);
    }
    if (M > m0) {
        tile_rows(buf, x + m0 * K, K, kt, acc + m0 * R, 1, 4, 0);
        tile_rows(b4, x + m0 * K, K, kt, acc + m0 * R + 4, 1, 4, 0);
    }
#endif
}

/* w: N rows of row_bytes block bytes each (GGUF layout); x: [M, K] row-major float32; bias: [N] or
 * NULL; y: [M, N] row-major, written.  Returns 0; -1 for an unknown type or a K the type cannot
 * hold; -2 when out of memory. */
int dq_linear(int qtype, const uint8_t *w, long row_bytes, long N, long K, const float *x, long M,
              const float *bias, float *y, int threads)
{
    int qk, qb;
    if (dq_block(qtype, &qk, &qb) || K % qk || K % VW || row_bytes != K / qk * qb || M < 1) return -1;
    long ng = (N + R - 1) / R; /* groups of R weight rows */
    if (threads < 1 || ng < 8) threads = 1;
    int oom = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float buf[R * KT] __attribute__((aligned(64)));
        long gmax = M < MGROUP ? M : MGROUP;
        vf *acc = aligned_alloc(64, ((gmax * R * sizeof(vf) + 63) / 64) * 64);
        if (!acc) {
#pragma omp atomic write
            oom = 1;
        }
        for (long g = 0; g < M; g += MGROUP) {
            long gm = M - g < MGROUP ? M - g : MGROUP;
            const float *xg = x + g * K;
#pragma omp for schedule(static)
            for (long gi = 0; gi < ng; gi++) {
                if (!acc) continue;
                long n0 = gi * R;
                for (long i = 0; i < gm * R; i++) acc[i] = (vf){0};
                for (long k0 = 0; k0 < K; k0 += KT) {
                    long kt = K - k0 < KT ? K - k0 : KT;
                    for (int r = 0; r < R; r++) { /* a short last group repeats its last row */
                        decode_span(qtype, w + (n0 + r < N ? n0 + r : N - 1) * row_bytes, k0, kt, buf + r * KT);
                        /* the same span PD groups ahead, to L2: the hardware prefetcher alone leaves
                         * short rows (K = 576: 360 bytes) waiting on memory */
                        long pn = n0 + r + PD * R;
                        if (pn < N) {
                            const char *p = (const char *)w + pn * row_bytes + k0 / qk * qb;
                            for (long off = 0; off < kt / qk * qb; off += 64) __builtin_prefetch(p + off, 0, 1);
                        }
                    }
                    tile_all(buf, xg + k0, gm, K, kt, acc);
                }
                for (long m = 0; m < gm; m++)
                    for (int r = 0; r < R && n0 + r < N; r++) {
                        float v = hsum(acc[m * R + r]);
                        y[(g + m) * N + n0 + r] = bias ? v + bias[n0 + r] : v;
                    }
            }
        }
        free(acc);
    }
    return oom ? -2 : 0;
}

/* The decoded weights: out[N, K] float32 (the same values the kernel multiplies with). */
int dq_dequantize(int qtype, const uint8_t *w, long row_bytes, long N, long K, float *out, int threads)
{
    int qk, qb;
    if (dq_block(qtype, &qk, &qb) || K % qk || row_bytes != K / qk * qb) return -1;
    if (threads < 1 || N < 64) threads = 1;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (long n = 0; n < N; n++) decode_span(qtype, w + n * row_bytes, 0, K, out + n * K);
    return 0;
}
