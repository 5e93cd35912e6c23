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
 * Built by draftcert.kernels.block_matmul (draftcert.native) with -O3 -march=native -ffp-contract=off (-fopenmp where it
 * links); the vector width follows the target (AVX-512: 16 lanes, AVX2: 8, else 4). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
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
#ifndef Q8NTA
/* "gguf-q8", one input row, 32-weight block types (Q4_1, Q5_0, Q8_0): every line of the packing is
 * prefetched Q8NTA bytes ahead as non-temporal (tiles of 2+ rows: Q8PF ahead, on AVX-512).  The lines go to L1 and are not kept in L2 or L3
 * after use, so a pass's stream of weights (read once) no longer evicts what the code around the
 * pass reads next: the caller's Python, the KV cache, a drafter's few MB of weights (on a 2-core
 * AMD EPYC, Zen 4, the embedded target decoded alone in 0.83-0.87 of the time:
 * benchmarks/bench_weight_stream.py).  The K-quant types keep the one-line prefetch below: a
 * prefetch of every line made the pair's 1.5B target's one-row passes 4-9 % slower. */
#define Q8NTA 256
#endif
/* Whether one-row tiles stream their weights as above: yes for a model's passes, whose weights are
 * read once a pass; no while a feature drafter's step runs (layer_kernel.c's dl_feature_step), whose
 * few MB of weights are read again a step later and should stay cached.  A speed hint only: every
 * prefetch leaves the arithmetic, and so the bits, as they are. */
static volatile int q8_stream_weights = 1;
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

/* ============================================================================================
 * 8-bit activations: the contract "gguf-q8" (this GGUF as llama.cpp computes it).
 *
 * Each input row is quantised per block to 8 bits with llama.cpp's own formulas (its x86 code): for
 * Q4_1 weights as Q8_1, for Q5_0 and Q8_0 as Q8_0 (blocks of 32: d = amax / 127, stored as fp16,
 * q = round-half-even(x * (127 / amax)); Q8_1 also s = fp16(d * sum q)), for Q4_K and Q6_K as Q8_K
 * (blocks of 256: the element of largest |x|, max, gives iscale = -127 / max, q = min(127,
 * round-half-even(iscale * x)), d = 1 / iscale in float32).  A block's dot product with a weight block
 * is then an exact integer (sums of code x q, the sub-block scales applied as integers), and the
 * float32 work per output is, over the blocks b in increasing order from acc = 0 (fma: one rounding):
 *   Q4_1:  acc = fma((float)S_b, dw_b * da_b, acc); acc = fma(mw_b, s_b, acc)    S_b = sum code * q
 *   Q5_0:  acc = fma((float)(S_b - 16 A_b), dw_b * da_b, acc)                  A_b = sum q
 *   Q8_0:  acc = fma((float)(S_b - 128 A_b), dw_b * da_b, acc)   (codes stored + 128, unsigned)
 *   Q4_K:  acc = fma((float)sum_j sc_j S_j, d_b * da_b, acc); acc = fma(-(float)sum_j mn_j A_j, dmin_b * da_b, acc)
 *   Q6_K:  acc = fma((float)sum_j sc_j (S_j - 32 A_j), d_b * da_b, acc)       (16 sub-blocks of 16)
 * then y = acc + bias.  Every product dw * da and every int -> float conversion is rounded once
 * (round to nearest even).  Nothing depends on M, on the other rows of the pass, on the thread
 * count or on the build: the vector codes (AVX-512 VNNI, AVX-VNNI, AVX2; dq8_vectorised says which
 * one a build compiled) and the portable code compute the same integers and the same float32
 * operations, so the bits are the same on every machine.
 *
 * The weights are repacked once at load (dq8_pack) into groups of QG = 16 output rows: per block, a
 * header of the 16 rows' scales, then the codes, 4 consecutive k of each of the 16 rows in 64 bytes
 * (one vpdpbusd operand: 16 int32 lanes = 16 outputs, the 4 activation bytes broadcast), two such
 * chunks per 64 bytes as low and high nibbles for the 4-bit types and for Q5_0's low 4 bits, whose
 * fifth bits follow the scales as a bit plane: eight 64-bit masks, one per 64-byte operand (mask
 * 2u + h, bit 4c + i: the fifth bit of row c's code at k = 8u + 4h + i), added in as 16 by a masked
 * byte add.  Bytes per weight against the GGUF block: Q4_1 0.625 (same), Q4_K 0.578 (0.5625), Q5_0
 * 0.6875 (same), Q8_0 1.0625 (same), Q6_K 1.07 (0.82).
 * ============================================================================================ */
#include <stdio.h>
#define QG 16

static inline int q8_block_hdr(int qtype)
{
    switch (qtype) {
    case Q4_1: return 64;            /* d[16], m[16] fp16 */
    case Q5_0: return 96;            /* d[16] fp16, the fifth bits: 8 x uint64 */
    case Q8_0: return 32;            /* d[16] fp16 */
    case Q4_K: return 320;           /* d[16], dmin[16] fp16, sc[8][16], mn[4][16][2] u8 */
    case Q6_K: return 288;           /* d[16] fp16, sc[8][16][2] int8 */
    }
    return -1;
}

static inline int q8_block_codes(int qtype)
{
    switch (qtype) {
    case Q4_1: case Q5_0: return 256;
    case Q8_0: return 512;
    case Q4_K: return 2048;
    case Q6_K: return 4096;
    }
    return -1;
}

static inline int q8_qk(int qtype) { return qtype == Q4_K || qtype == Q6_K ? 256 : 32; }
static inline int q8_sub(int qtype) { return qtype == Q6_K ? 16 : 32; } /* elements per activation sum */
static inline int q8_four_bit(int qtype) { return qtype == Q4_1 || qtype == Q4_K || qtype == Q5_0; } /* nibble codes */

/* Which code computes dq8_linear in this build (chosen at compile time; every one gives the same bits):
 * 2 AVX-512 VNNI (512-bit vpdpbusd), 3 AVX-VNNI (256-bit vpdpbusd, VEX), 4 AVX2 (vpmaddubsw + vpmaddwd;
 * FMA and F16C too), 0 the portable code (q8_dot_scalar, one output at a time). */
int dq8_vectorised(void)
{
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return 2;
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && defined(__AVXVNNI__)
    return 3;
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    return 4;
#else
    return 0;
#endif
}

long dq8_packed_bytes(int qtype, long N, long K)
{
    int qk = q8_qk(qtype), h = q8_block_hdr(qtype);
    if (h < 0 || K % qk || N < 1) return -1;
    return (N + QG - 1) / QG * (K / qk) * (long)(h + q8_block_codes(qtype));
}

/* One GGUF block -> its unsigned codes in k order, and its scales (raw fp16 bytes kept). */
static void q8_codes_of(int qtype, const uint8_t *b, uint8_t *code, uint8_t *d16, uint8_t *m16, uint8_t *sc, uint8_t *mn)
{
    switch (qtype) {
    case Q4_1:
        memcpy(d16, b, 2); memcpy(m16, b + 2, 2);
        for (int j = 0; j < 16; j++) { code[j] = b[4 + j] & 0x0F; code[j + 16] = b[4 + j] >> 4; }
        break;
    case Q5_0: {
        uint32_t qh;
        memcpy(d16, b, 2);
        memcpy(&qh, b + 2, 4);
        for (int j = 0; j < 16; j++) {
            code[j] = (uint8_t)((b[6 + j] & 0x0F) | (((qh >> j) & 1) << 4));
            code[j + 16] = (uint8_t)((b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
        }
        break;
    }
    case Q8_0:
        memcpy(d16, b, 2);
        for (int j = 0; j < 32; j++) code[j] = (uint8_t)((int)(int8_t)b[2 + j] + 128);
        break;
    case Q4_K:
        memcpy(d16, b, 2); memcpy(m16, b + 2, 2);
        for (int i = 0; i < 8; i++) {
            int s, m;
            q4k_scale_min(b + 4, i, &s, &m);
            sc[i] = (uint8_t)s; mn[i] = (uint8_t)m;
            const uint8_t *q = b + 16 + 32 * (i >> 1);
            for (int j = 0; j < 32; j++) code[32 * i + j] = (q[j] >> (4 * (i & 1))) & 0x0F;
        }
        break;
    case Q6_K: {
        const uint8_t *ql = b, *qh = b + 128;
        memcpy(d16, b + 208, 2);
        memcpy(sc, b + 192, 16);
        for (int h = 0; h < 2; h++) {
            const uint8_t *l = ql + 64 * h, *q = qh + 32 * h;
            uint8_t *o = code + 128 * h;
            for (int j = 0; j < 32; j++) {
                o[j] = (uint8_t)((l[j] & 0x0F) | (((q[j] >> 0) & 3) << 4));
                o[j + 32] = (uint8_t)((l[j + 32] & 0x0F) | (((q[j] >> 2) & 3) << 4));
                o[j + 64] = (uint8_t)((l[j] >> 4) | (((q[j] >> 4) & 3) << 4));
                o[j + 96] = (uint8_t)((l[j + 32] >> 4) | (((q[j] >> 6) & 3) << 4));
            }
        }
        break;
    }
    }
}

/* w: N GGUF rows of row_bytes; out: dq8_packed_bytes(qtype, N, K) bytes (rows past N are zeros). */
int dq8_pack(int qtype, const uint8_t *w, long row_bytes, long N, long K, uint8_t *out, int threads)
{
    int qk, qb;
    if (dq_block(qtype, &qk, &qb) || K % qk || row_bytes != K / qk * qb || q8_qk(qtype) != qk) return -1;
    const long nb = K / qk, hdr = q8_block_hdr(qtype), blk = hdr + q8_block_codes(qtype), ng = (N + QG - 1) / QG;
    const int four = q8_four_bit(qtype), nsc = qtype == Q6_K ? 16 : 8;
    if (threads < 1 || ng < 8) threads = 1;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (long g = 0; g < ng; g++) {
        uint8_t code[QG][256], d16[QG][2], m16[QG][2], sc[QG][16], mn[QG][16];
        for (long b = 0; b < nb; b++) {
            memset(code, 0, sizeof code); memset(d16, 0, sizeof d16); memset(m16, 0, sizeof m16);
            memset(sc, 0, sizeof sc); memset(mn, 0, sizeof mn);
            for (int c = 0; c < QG; c++)
                if (g * QG + c < N)
                    q8_codes_of(qtype, w + (g * QG + c) * row_bytes + b * qb, code[c], d16[c], m16[c], sc[c], mn[c]);
            uint8_t *o = out + (g * nb + b) * blk, *cd = o + hdr;
            for (int c = 0; c < QG; c++) {
                memcpy(o + 2 * c, d16[c], 2);
                if (qtype == Q4_1 || qtype == Q4_K) memcpy(o + 32 + 2 * c, m16[c], 2);
                if (qtype == Q4_K) /* sc[j][c]; mn in pairs of sub-blocks: [j / 2][c][j % 2] */
                    for (int j = 0; j < 8; j++) { o[64 + 16 * j + c] = sc[c][j]; o[192 + 32 * (j >> 1) + 2 * c + (j & 1)] = mn[c][j]; }
                if (qtype == Q6_K) /* sc in pairs of sub-blocks: [j / 2][c][j % 2] */
                    for (int j = 0; j < nsc; j++) o[32 + 32 * (j >> 1) + 2 * c + (j & 1)] = sc[c][j];
            }
            if (qtype == Q5_0) { /* the fifth bits, then the low 4 bits as nibbles below */
                for (int u = 0; u < 4; u++)
                    for (int hh = 0; hh < 2; hh++) {
                        uint64_t plane = 0;
                        for (int c = 0; c < QG; c++)
                            for (int i = 0; i < 4; i++)
                                plane |= (uint64_t)(code[c][8 * u + 4 * hh + i] >> 4) << (4 * c + i);
                        memcpy(o + 32 + 8 * (2 * u + hh), &plane, 8);
                    }
            }
            if (four) {
                for (int u = 0; u < qk / 8; u++)
                    for (int c = 0; c < QG; c++)
                        for (int i = 0; i < 4; i++)
                            cd[u * 64 + c * 4 + i] = (uint8_t)((code[c][8 * u + i] & 0x0F) | ((code[c][8 * u + 4 + i] & 0x0F) << 4));
            } else {
                for (int u = 0; u < qk / 4; u++)
                    for (int c = 0; c < QG; c++)
                        for (int i = 0; i < 4; i++) cd[u * 64 + c * 4 + i] = code[c][4 * u + i];
            }
        }
    }
    return 0;
}

/* float32 -> IEEE half, round to nearest even (F16C's vcvtps2ph with imm 0, or the same in software). */
static inline uint16_t f2h(float f)
{
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(f, 0);
#else
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000, ax = x & 0x7FFFFFFF;
    if (ax >= 0x7F800000) return (uint16_t)(sign | 0x7C00 | (ax > 0x7F800000 ? 0x200 | ((ax >> 13) & 0x3FF) : 0));
    if (ax >= 0x477FF000) return (uint16_t)(sign | 0x7C00); /* rounds to >= 65520: infinity */
    if (ax < 0x38800000) { /* below the smallest normal half: a subnormal (or zero), rounded once */
        if (ax < 0x33000000) return (uint16_t)sign; /* < 2^-25: rounds to 0 */
        int e = (int)(ax >> 23);
        uint32_t man = (ax & 0x7FFFFF) | 0x800000;
        int shift = 126 - e; /* value = man * 2^(e-150); half subnormal unit 2^-24 */
        uint32_t q = man >> (shift), rem = man & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (q & 1))) q++;
        return (uint16_t)(sign | q);
    }
    uint32_t h = ((ax >> 13) - (112u << 10)), rem = ax & 0x1FFF;
    if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) h++;
    return (uint16_t)(sign | h);
#endif
}

/* round half to even for |v| <= 2^22, llama.cpp's nearest_int (the rounding of _mm256_round_ps too) */
static inline int rne(float v)
{
    float t = v + 12582912.f;
    int32_t i;
    memcpy(&i, &t, 4);
    return (i & 0x007FFFFF) - 0x00400000;
}

#if defined(__AVX512F__)
/* One block of q8_quantize_row 16 lanes at a time, the same results: the max of |x| and the products
 * are the scalar code's, vcvtps2dq rounds to nearest even as rne does for |v| <= 128, the sums are
 * integers.  Returns 1 (nothing written) for a block holding a NaN: the scalar code's max depends on
 * where it stands. */
static int q8_quantize_block16(int qtype, const float *xb, int8_t *qb, float *da, int32_t *as, float *s1)
{
    const int nv = q8_qk(qtype) / 16;
    __m512 mx = _mm512_setzero_ps(), x[16];
    __mmask16 nan = 0;
    for (int v = 0; v < nv; v++) {
        x[v] = _mm512_loadu_ps(xb + 16 * v);
        nan |= _mm512_cmp_ps_mask(x[v], x[v], _CMP_UNORD_Q);
        mx = _mm512_max_ps(mx, _mm512_abs_ps(x[v]));
    }
    if (nan) return 1;
    const float amax = _mm512_reduce_max_ps(mx);
    float scale = amax != 0.0f ? 127.f / amax : 0.0f; /* the Q8_0 / Q8_1 id */
    if (nv == 16 && amax != 0.0f) /* Q8_K: -127 / the first x of the largest |x| */
        for (int v = 0; v < 16; v++) {
            const __mmask16 at = _mm512_cmp_ps_mask(_mm512_abs_ps(x[v]), _mm512_set1_ps(amax), _CMP_EQ_OQ);
            if (at) { scale = -127.f / xb[16 * v + __builtin_ctz(at)]; break; }
        }
    int sum = 0;
    for (int v = 0; v < nv; v++) {
        const __m512 p = _mm512_mul_ps(x[v], _mm512_set1_ps(scale));
        const __mmask16 ok = _mm512_cmp_ps_mask(_mm512_abs_ps(p), _mm512_set1_ps(128.f), _CMP_LE_OQ);
        const __m512i r = _mm512_min_epi32(_mm512_maskz_cvt_roundps_epi32(ok, p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                                           _mm512_set1_epi32(127));
        _mm_storeu_si128((__m128i *)(qb + 16 * v), _mm512_cvtepi32_epi8(r));
        const int s = _mm512_reduce_add_epi32(r);
        if (nv == 2) sum += s;
        else if (qtype == Q6_K) as[v] = s;
        else if (v & 1) as[v / 2] += s;
        else as[v / 2] = s;
    }
    if (nv == 2) {
        const float d = amax / 127.f;
        da[0] = h2f((const uint8_t *)&(uint16_t){f2h(d)});
        as[0] = sum;
        if (s1) s1[0] = h2f((const uint8_t *)&(uint16_t){f2h(d * (float)sum)});
    } else
        da[0] = amax != 0.0f ? 1.0f / scale : 0.0f;
    return 0;
}
#endif

/* One input row quantised for qtype's weights: q[K] int8, da[K / qk] (the float32 scale the dot
 * product uses), as[K / sub] int32 sums of q per sub-block, s1[K / 32] (Q8_1's s, Q4_1 only); the
 * scalar code where portable (or the build has no AVX-512), else q8_quantize_block16. */
static void q8_quantize_row(int qtype, const float *x, long K, int8_t *q, float *da, int32_t *as, float *s1, int portable)
{
    const int qk = q8_qk(qtype), sub = q8_sub(qtype);
    for (long b = 0; b < K / qk; b++) {
        const float *xb = x + b * qk;
        int8_t *qb = q + b * qk;
#if defined(__AVX512F__)
        if (!portable && !q8_quantize_block16(qtype, xb, qb, da + b, as + b * (qk / sub), s1 ? s1 + b : NULL)) continue;
#endif
        (void)portable;
        if (qk == 32) {
            float amax = 0.0f;
            for (int j = 0; j < 32; j++) { float a = fabsf(xb[j]); amax = amax > a ? amax : a; }
            const float d = amax / 127.f, id = amax != 0.0f ? 127.f / amax : 0.0f;
            int sum = 0;
            for (int j = 0; j < 32; j++) {
                float v = xb[j] * id;
                int r = v == v && fabsf(v) <= 128.f ? rne(v) : 0;
                qb[j] = (int8_t)(r > 127 ? 127 : r < -128 ? -128 : r);
                sum += qb[j];
            }
            da[b] = h2f((const uint8_t *)&(uint16_t){f2h(d)});
            as[b] = sum;
            if (s1) s1[b] = h2f((const uint8_t *)&(uint16_t){f2h(d * (float)sum)});
        } else {
            float max = 0.0f, amax = 0.0f;
            for (int j = 0; j < 256; j++) { float a = fabsf(xb[j]); if (a > amax) { amax = a; max = xb[j]; } }
            if (amax == 0.0f || amax != amax) {
                memset(qb, 0, 256);
                da[b] = 0.0f;
            } else {
                const float iscale = -127.f / max;
                for (int j = 0; j < 256; j++) {
                    float v = iscale * xb[j];
                    int r = v == v && fabsf(v) <= 128.f ? rne(v) : 0;
                    qb[j] = (int8_t)(r > 127 ? 127 : r);
                }
                da[b] = 1.0f / iscale;
            }
            for (int j = 0; j < 256 / sub; j++) {
                int s = 0;
                for (int i = 0; i < sub; i++) s += qb[j * sub + i];
                as[b * (256 / sub) + j] = s;
            }
        }
    }
}

/* For tests: the quantised rows (q: [M, K] int8, da: [M, K/qk], as: [M, K/sub] int32, s1: [M, K/32]),
 * by the scalar code where portable. */
int dq8_quantize(int qtype, const float *x, long M, long K, int8_t *q, float *da, int32_t *as, float *s1, int portable)
{
    if (q8_block_hdr(qtype) < 0 || K % q8_qk(qtype)) return -1;
    const int qk = q8_qk(qtype), sub = q8_sub(qtype);
    for (long m = 0; m < M; m++)
        q8_quantize_row(qtype, x + m * K, K, q + m * K, da + m * (K / qk), as + m * (K / sub),
                        qtype == Q4_1 ? s1 + m * (K / 32) : NULL, portable);
    return 0;
}

typedef struct {
    const int8_t *q;
    const float *da, *s1;
    const int32_t *as;
    const int32_t *ap; /* Q4_K, Q6_K: as in pairs, (int16) as[2i] | as[2i + 1] << 16 (|as| <= 4064): one vpdpwssd operand */
    long K, nda, nas;
} q8act;

/* The portable code: one output (column c of group grp) for input row m, the contract's operations. */
static float q8_dot_scalar(int qtype, const uint8_t *grp, long nb, int c, const q8act *A, long m)
{
    const long hdr = q8_block_hdr(qtype), blk = hdr + q8_block_codes(qtype);
    const int qk = q8_qk(qtype), four = q8_four_bit(qtype);
    const int8_t *q = A->q + m * A->K;
    const float *da = A->da + m * A->nda;
    const int32_t *as = A->as + m * A->nas;
    float acc = 0.0f;
    for (long b = 0; b < nb; b++) {
        const uint8_t *h = grp + b * blk, *cd = h + hdr;
        const int8_t *qb = q + b * qk;
        int32_t S[16] = {0}; /* per sub-block of 32 (16 for Q6_K) */
        const int sub = qtype == Q6_K ? 16 : 32;
        for (int k = 0; k < qk; k++) {
            int code = four ? (cd[(k / 8) * 64 + c * 4 + (k & 3)] >> (k & 4)) & 0x0F : cd[(k / 4) * 64 + c * 4 + (k & 3)];
            if (qtype == Q5_0) { /* k = 8u + 4h + i: mask 2u + h, bit 4c + i */
                uint64_t plane;
                memcpy(&plane, h + 32 + 8 * ((k / 8) * 2 + ((k >> 2) & 1)), 8);
                code |= (int)((plane >> (4 * c + (k & 3))) & 1) << 4;
            }
            S[k / sub] += code * qb[k];
        }
        const float dw = h2f(h + 2 * c);
        switch (qtype) {
        case Q4_1: acc = __builtin_fmaf((float)S[0], dw * da[b], acc); acc = __builtin_fmaf(h2f(h + 32 + 2 * c), A->s1[m * (A->K / 32) + b], acc); break;
        case Q5_0: acc = __builtin_fmaf((float)(S[0] - 16 * as[b]), dw * da[b], acc); break;
        case Q8_0: acc = __builtin_fmaf((float)(S[0] - 128 * as[b]), dw * da[b], acc); break;
        case Q4_K: {
            int32_t I = 0, Im = 0;
            for (int j = 0; j < 8; j++) { I += (int32_t)h[64 + 16 * j + c] * S[j]; Im += (int32_t)h[192 + 32 * (j >> 1) + 2 * c + (j & 1)] * as[b * 8 + j]; }
            acc = __builtin_fmaf((float)I, dw * da[b], acc);
            acc = __builtin_fmaf(-(float)Im, h2f(h + 32 + 2 * c) * da[b], acc);
            break;
        }
        case Q6_K: {
            int32_t I = 0;
            for (int j = 0; j < 16; j++) I += (int32_t)(int8_t)h[32 + 32 * (j >> 1) + 2 * c + (j & 1)] * (S[j] - 32 * as[b * 16 + j]);
            acc = __builtin_fmaf((float)I, dw * da[b], acc);
            break;
        }
        }
    }
    return acc;
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define Q8_VECTOR 1
#define Q8MT 8 /* the most input rows per register tile (q8_rows_per_tile: 6 for Q4_K, else 8) */
static inline int q8_rows_per_tile(int qtype) { return qtype == Q4_K ? 6 : 8; }
static inline __m512i bc4(const int8_t *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}
/* acc + the 16 lanes' 4-byte dot products of w (unsigned) with the 4 signed bytes at p, broadcast.
 * Written as the instruction's memory-broadcast form: compilers emit a separate vpbroadcastd for
 * _mm512_set1_epi32 here, one more instruction for every multiply-add.  DP takes it for Q4_K, and for
 * Q6_K tiles of 2+ rows; a one-row Q6_K tile is faster with the separate broadcast on an AMD EPYC
 * (Zen 4): 0.93-0.96 of the time streaming a 190-220 MB weight, both builds in one process in turns
 * on one buffer (benchmarks/bench_kernel_ab.py; Q4_K, unchanged, 0.99-1.00 in the same runs). */
static inline __attribute__((always_inline)) __m512i dp_bcast(__m512i acc, __m512i w, const int8_t *p)
{
#if defined(__GNUC__)
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)p));
    return acc;
#else
    return _mm512_dpbusd_epi32(acc, w, bc4(p));
#endif
}
#define DP(acc, w, p) (qtype == Q4_K || (qtype == Q6_K && MT > 1) ? dp_bcast((acc), (w), (p)) : _mm512_dpbusd_epi32((acc), (w), bc4(p)))
#ifndef Q8PF /* the packing is read in order: a tile of 2+ rows prefetches each block's size Q8PF bytes ahead, */
#define Q8PF 3072 /* so the loads run ahead of the rows' integer work (what a pass of several rows adds) */
#endif

/* MT input rows (m0 ..) against the 16 outputs of one group: out[r] = the 16 accumulators. */
static inline __attribute__((always_inline)) void
q8_tile(int qtype, const uint8_t *restrict grp, long nb, const q8act *A, long m0, const int MT, __m512 *out)
{
    const long hdr = q8_block_hdr(qtype), blk = hdr + q8_block_codes(qtype);
    const int stream = Q8NTA > 0 && q8_stream_weights && (qtype == Q4_1 || qtype == Q5_0 || qtype == Q8_0);
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    const int8_t *q[Q8MT];
    const float *da[Q8MT];
    const int32_t *as[Q8MT], *ap[Q8MT];
    __m512 facc[Q8MT];
    for (int r = 0; r < MT; r++) {
        q[r] = A->q + (m0 + r) * A->K; da[r] = A->da + (m0 + r) * A->nda; as[r] = A->as + (m0 + r) * A->nas;
        ap[r] = A->ap ? A->ap + (m0 + r) * (A->nas / 2) : NULL;
        facc[r] = _mm512_setzero_ps();
    }
    for (long b = 0; b < nb; b++) {
        const uint8_t *h = grp + b * blk, *cd = h + hdr;
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h));
        if (MT == 1) { /* one row: non-temporal lines (Q8NTA), or a line of the next block (the hardware prefetcher streams the rest) */
            if (stream)
                for (long l = 0; l < blk; l += 64) _mm_prefetch((const char *)(h + Q8NTA + l), _MM_HINT_NTA);
            else if (b + 1 < nb)
                _mm_prefetch((const char *)(h + blk), _MM_HINT_T0);
        } else if (stream) /* 2+ rows: the same lines Q8PF ahead, streamed too */
            for (long l = 0; l < blk; l += 64) _mm_prefetch((const char *)(h + Q8PF + l), _MM_HINT_NTA);
        else
            for (long l = 0; l < blk; l += 64) _mm_prefetch((const char *)(h + Q8PF + l), _MM_HINT_T0);
        if (qtype == Q4_1 || qtype == Q5_0 || qtype == Q8_0) {
            const long k0 = b * 32;
            __m512i s0[Q8MT], s1[Q8MT];
            for (int r = 0; r < MT; r++) s0[r] = s1[r] = _mm512_setzero_si512();
            if (qtype == Q4_1 || qtype == Q5_0) {
                for (int u = 0; u < 4; u++) {
                    const __m512i v = _mm512_loadu_si512(cd + 64 * u);
                    __m512i lo = _mm512_and_si512(v, lo4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
                    if (qtype == Q5_0) { /* the fifth bits: + 16 where the plane's bit is set */
                        uint64_t m0, m1;
                        memcpy(&m0, h + 32 + 16 * u, 8);
                        memcpy(&m1, h + 40 + 16 * u, 8);
                        lo = _mm512_mask_add_epi8(lo, _cvtu64_mask64(m0), lo, _mm512_set1_epi8(16));
                        hi = _mm512_mask_add_epi8(hi, _cvtu64_mask64(m1), hi, _mm512_set1_epi8(16));
                    }
                    for (int r = 0; r < MT; r++) {
                        s0[r] = DP(s0[r], lo, q[r] + k0 + 8 * u);
                        s1[r] = DP(s1[r], hi, q[r] + k0 + 8 * u + 4);
                    }
                }
            } else {
                for (int u = 0; u < 8; u += 2) {
                    const __m512i v0 = _mm512_loadu_si512(cd + 64 * u), v1 = _mm512_loadu_si512(cd + 64 * u + 64);
                    for (int r = 0; r < MT; r++) {
                        s0[r] = DP(s0[r], v0, q[r] + k0 + 4 * u);
                        s1[r] = DP(s1[r], v1, q[r] + k0 + 4 * u + 4);
                    }
                }
            }
            for (int r = 0; r < MT; r++) {
                __m512i S = _mm512_add_epi32(s0[r], s1[r]);
                if (qtype == Q5_0) S = _mm512_sub_epi32(S, _mm512_set1_epi32(16 * as[r][b]));
                if (qtype == Q8_0) S = _mm512_sub_epi32(S, _mm512_set1_epi32(128 * as[r][b]));
                facc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(S), _mm512_mul_ps(dw, _mm512_set1_ps(da[r][b])), facc[r]);
                if (qtype == Q4_1)
                    facc[r] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + 32))),
                                              _mm512_set1_ps(A->s1[(m0 + r) * (A->K / 32) + b]), facc[r]);
            }
        } else if (qtype == Q4_K) {
            const long k0 = b * 256;
            __m512i I[Q8MT];
            for (int r = 0; r < MT; r++) I[r] = _mm512_setzero_si512();
            for (int j = 0; j < 8; j++) {
                const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(h + 64 + 16 * j)));
                __m512i s0[Q8MT], s1[Q8MT];
                for (int r = 0; r < MT; r++) s0[r] = s1[r] = _mm512_setzero_si512();
                for (int u = 0; u < 4; u++) {
                    const __m512i v = _mm512_loadu_si512(cd + 64 * (4 * j + u));
                    const __m512i lo = _mm512_and_si512(v, lo4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
                    for (int r = 0; r < MT; r++) { /* 2 chains a row where few rows hide the latency */
                        s0[r] = DP(s0[r], lo, q[r] + k0 + 32 * j + 8 * u);
                        if (MT <= 2) s1[r] = DP(s1[r], hi, q[r] + k0 + 32 * j + 8 * u + 4);
                        else s0[r] = DP(s0[r], hi, q[r] + k0 + 32 * j + 8 * u + 4);
                    }
                }
                for (int r = 0; r < MT; r++) {
                    const __m512i S = MT <= 2 ? _mm512_add_epi32(s0[r], s1[r]) : s0[r];
                    I[r] = _mm512_add_epi32(I[r], _mm512_mullo_epi32(S, sc));
                }
            }
            const __m512 dm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + 32)));
            const __m512i mn0 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(h + 192)));
            const __m512i mn1 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(h + 224)));
            const __m512i mn2 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(h + 256)));
            const __m512i mn3 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(h + 288)));
            for (int r = 0; r < MT; r++) { /* sum_j mn_j A_j: pairs of sub-blocks, one vpdpwssd each */
                const int32_t *a2 = ap[r] + b * 4;
                __m512i Im = _mm512_dpwssd_epi32(_mm512_setzero_si512(), mn0, _mm512_set1_epi32(a2[0]));
                Im = _mm512_dpwssd_epi32(Im, mn1, _mm512_set1_epi32(a2[1]));
                Im = _mm512_dpwssd_epi32(Im, mn2, _mm512_set1_epi32(a2[2]));
                Im = _mm512_dpwssd_epi32(Im, mn3, _mm512_set1_epi32(a2[3]));
                const __m512 a = _mm512_set1_ps(da[r][b]);
                facc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I[r]), _mm512_mul_ps(dw, a), facc[r]);
                facc[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(Im), _mm512_mul_ps(dm, a), facc[r]);
            }
        } else { /* Q6_K: sum_j sc_j (S_j - 32 A_j) = sum_j sc_j S_j - 32 sum_j sc_j A_j, the same integer */
            const long k0 = b * 256;
            __m512i I[Q8MT], C[Q8MT];
            for (int r = 0; r < MT; r++) I[r] = C[r] = _mm512_setzero_si512();
            for (int p = 0; p < 8; p++) {
                const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(h + 32 + 32 * p)));
                const __m512i sce = _mm512_srai_epi32(_mm512_slli_epi32(w, 16), 16), sco = _mm512_srai_epi32(w, 16);
                for (int r = 0; r < MT; r++) C[r] = _mm512_dpwssd_epi32(C[r], w, _mm512_set1_epi32(ap[r][b * 8 + p]));
                for (int t = 0; t < 2; t++) {
                    const int j = 2 * p + t;
                    const __m512i sc = t ? sco : sce;
                    const __m512i v0 = _mm512_loadu_si512(cd + 256 * j), v1 = _mm512_loadu_si512(cd + 256 * j + 64);
                    const __m512i v2 = _mm512_loadu_si512(cd + 256 * j + 128), v3 = _mm512_loadu_si512(cd + 256 * j + 192);
                    for (int r = 0; r < MT; r++) {
                        const int8_t *pq = q[r] + k0 + 16 * j;
                        __m512i S;
                        if (MT <= 2) { /* 2 chains a row where few rows hide the latency */
                            __m512i s0 = DP(_mm512_setzero_si512(), v0, pq), s1 = DP(_mm512_setzero_si512(), v1, pq + 4);
                            s0 = DP(s0, v2, pq + 8);
                            s1 = DP(s1, v3, pq + 12);
                            S = _mm512_add_epi32(s0, s1);
                        } else
                            S = DP(DP(DP(DP(_mm512_setzero_si512(), v0, pq), v1, pq + 4), v2, pq + 8), v3, pq + 12);
                        I[r] = _mm512_add_epi32(I[r], _mm512_mullo_epi32(S, sc));
                    }
                }
            }
            for (int r = 0; r < MT; r++) {
                const __m512i T = _mm512_sub_epi32(I[r], _mm512_slli_epi32(C[r], 5));
                facc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(T), _mm512_mul_ps(dw, _mm512_set1_ps(da[r][b])), facc[r]);
            }
        }
    }
    for (int r = 0; r < MT; r++) out[r] = facc[r];
}

static void q8_group(int qtype, const uint8_t *grp, long nb, const q8act *A, long M, long N, long n0,
                     const float *bias, float *y)
{
    const long nv = N - n0 < QG ? N - n0 : QG;
    const __mmask16 mask = (__mmask16)((1u << nv) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
    __m512 out[Q8MT];
    const long tile = q8_rows_per_tile(qtype);
    for (long m0 = 0; m0 < M;) {
        /* tiles as even as the rows allow (16 rows of Q4_K: 6, 5, 5), none taller than tile */
        const long left = M - m0, ntiles = (left + tile - 1) / tile, mt = (left + ntiles - 1) / ntiles;
        switch (qtype * 16 + (int)mt) { /* each type and tile height compiled on its own */
#define T(QT) \
        case QT * 16 + 1: q8_tile(QT, grp, nb, A, m0, 1, out); break; \
        case QT * 16 + 2: q8_tile(QT, grp, nb, A, m0, 2, out); break; \
        case QT * 16 + 3: q8_tile(QT, grp, nb, A, m0, 3, out); break; \
        case QT * 16 + 4: q8_tile(QT, grp, nb, A, m0, 4, out); break; \
        case QT * 16 + 5: q8_tile(QT, grp, nb, A, m0, 5, out); break; \
        case QT * 16 + 6: q8_tile(QT, grp, nb, A, m0, 6, out); break; \
        case QT * 16 + 7: if (QT != Q4_K) q8_tile(QT, grp, nb, A, m0, 7, out); break; \
        case QT * 16 + 8: if (QT != Q4_K) q8_tile(QT, grp, nb, A, m0, 8, out); break;
        T(Q4_1) T(Q5_0) T(Q8_0) T(Q4_K) T(Q6_K)
#undef T
        }
        for (long r = 0; r < mt; r++) {
            const __m512 v = bias ? _mm512_add_ps(out[r], bv) : out[r];
            _mm512_mask_storeu_ps(y + (m0 + r) * N + n0, mask, v);
        }
        m0 += mt;
    }
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* ---- "gguf-q8" on 256-bit vectors: AVX-VNNI (vpdpbusd, VEX-encoded) or plain AVX2 (vpmaddubsw, vpmaddwd).
 * The same packing (dq8_pack): a 64-byte code chunk is two 32-byte halves, x = 0 for the group's rows
 * 0-7 and x = 1 for rows 8-15, each int32 lane one row's 4 consecutive k; both halves are computed in one
 * pass over the blocks, each output in 8 lanes of its half.  The block integers are exact (any instruction
 * sequence that does not overflow gives the contract's int32) and the float32 operations per output are
 * the contract's, in its order (the list above): the same bits as the AVX-512 and the portable code.
 *
 * AVX-VNNI's vpdpbusd adds its four u8 x s8 products into int32 lanes without saturation: nothing to bound.
 * AVX2's vpmaddubsw multiplies an unsigned code byte by a signed activation byte and adds adjacent
 * pairs into int16 WITH saturation at +-32767; here such int16 pair sums are also added in int16 before
 * vpmaddwd widens them.  Every one of those sums stays in range, so nothing saturates or wraps
 * (|q| <= 128 for any int8 activation, a pair is at most 2 * cmax * 128):
 *   Q4_1, Q4_K (codes 0..15): a pair <= 3840; 8 added (Q4_1: a block, Q4_K: a sub-block of 32) <= 30720;
 *   Q5_0 (codes 0..31):       a pair <= 7936; 4 added (two chunks of a block) <= 31744;
 *   Q6_K (codes 0..63):       a pair <= 16128; 2 added (half a sub-block of 16) <= 32256;
 *   Q8_0: the codes as stored (w + 128, 0..255) could saturate (2 * 255 * 127 > 32767).  The signed
 *     weight w = code - 128 goes in as |w| (unsigned, <= 128) against sign(w) q (vpsignb), |w| sign(w) q
 *     = w q, and each pair is widened alone: a pair is at most 2 * 128 * 127 = 32512, since the
 *     activations of a Q8_0 weight are never -128: q8_quantize_row's q = rne(x * id), id = fl(127 / amax),
 *     |x| <= amax, so |fl(x * id)| <= 127 (1 + u)^2 < 127.5 and |q| <= 127 (a non-finite product gives 0);
 *     that is also why vpsignb never has to negate -128.  The block's integer is sum w q = sum code q -
 *     128 sum q, the one the contract names.
 * Products of the sub-block scales (Q4_K 0..63, Q6_K -128..127) with these sums go through vpmaddwd with
 * the scale in both int16 halves of a lane (AVX2) or vpmulld (AVX-VNNI), into int32 as the AVX-512 code. */
#define Q8_VECTOR 1
#if defined(__AVXVNNI__)
#define Q8_VNNI256 1
#else
#define Q8_VNNI256 0
#endif
#define Q8MT 4 /* the most input rows per register tile (16 vector registers) */
static inline int q8_rows_per_tile(int qtype) { (void)qtype; return Q8MT; }
static inline __m256i bc4(const int8_t *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}
static inline __m256i ld32(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline __m256 h8(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
#if Q8_VNNI256
static inline __m256i dot4(__m256i acc, __m256i w, __m256i a) { return _mm256_dpbusd_avx_epi32(acc, w, a); }
#else
/* The int16 pair sums of codes w (unsigned) and activations a (signed): in range by the bounds above. */
static inline __m256i mad16(__m256i w, __m256i a) { return _mm256_maddubs_epi16(w, a); }
#endif
/* Q5_0's fifth bits: planes (the 16 bytes of masks 2u and 2u + 1, in both 128-bit lanes), the 32 bits
 * at byte 4s of them (s = 2 hh + x) to 32 bytes, 16 where byte j's bit j is set, else 0. */
static inline __m256i fifth_bits(__m256i planes, int s)
{
    const __m256i sel = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i x = _mm256_shuffle_epi8(planes, _mm256_add_epi8(_mm256_set1_epi8((char)(4 * s)),
                      _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL)));
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(x, sel), sel), _mm256_set1_epi8(16));
}

/* MT input rows (m0 ..) against the 16 outputs of one group: out[r][x] = rows 8x .. 8x + 7's accumulators. */
static inline __attribute__((always_inline)) void
q8_tile(int qtype, const uint8_t *restrict grp, long nb, const q8act *A, long m0, const int MT, __m256 (*out)[2])
{
    const long hdr = q8_block_hdr(qtype), blk = hdr + q8_block_codes(qtype);
    const int stream = Q8NTA > 0 && q8_stream_weights && (qtype == Q4_1 || qtype == Q5_0 || qtype == Q8_0);
    const __m256i lo4 = _mm256_set1_epi8(0x0F);
#if !Q8_VNNI256
    const __m256i one16 = _mm256_set1_epi16(1);
#endif
    const int8_t *q[Q8MT];
    const float *da[Q8MT];
    const int32_t *as[Q8MT], *ap[Q8MT];
    __m256 facc[Q8MT][2];
    for (int r = 0; r < MT; r++) {
        q[r] = A->q + (m0 + r) * A->K; da[r] = A->da + (m0 + r) * A->nda; as[r] = A->as + (m0 + r) * A->nas;
        ap[r] = A->ap ? A->ap + (m0 + r) * (A->nas / 2) : NULL;
        facc[r][0] = facc[r][1] = _mm256_setzero_ps();
    }
    for (long b = 0; b < nb; b++) {
        const uint8_t *h = grp + b * blk, *cd = h + hdr;
        if (MT == 1 && stream) /* as in the 512-bit tile */
            for (long l = 0; l < blk; l += 64) _mm_prefetch((const char *)(h + Q8NTA + l), _MM_HINT_NTA);
        else if (b + 1 < nb)
            _mm_prefetch((const char *)(h + blk), _MM_HINT_T0);
        const __m256 dw[2] = {h8(h), h8(h + 16)};
        __m256i T[Q8MT][2]; /* the block's integer per output: sum code q (sub-block scales applied) */
        for (int r = 0; r < MT; r++) T[r][0] = T[r][1] = _mm256_setzero_si256();
        if (qtype == Q4_1 || qtype == Q5_0) {
            const long k0 = b * 32;
#if Q8_VNNI256
            __m256i s1[Q8MT][2];
            for (int r = 0; r < MT; r++) s1[r][0] = s1[r][1] = _mm256_setzero_si256();
#else
            __m256i s16[Q8MT][2];
            for (int r = 0; r < MT; r++) s16[r][0] = s16[r][1] = _mm256_setzero_si256();
#endif
            for (int u = 0; u < 4; u++) {
                __m256i lo[2], hi[2];
                const __m256i planes = qtype == Q5_0 ? _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(h + 32 + 16 * u)))
                                                     : _mm256_setzero_si256();
                for (int x = 0; x < 2; x++) {
                    const __m256i v = ld32(cd + 64 * u + 32 * x);
                    lo[x] = _mm256_and_si256(v, lo4);
                    hi[x] = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
                    if (qtype == Q5_0) { /* the fifth bits: masks 2u (low nibbles) and 2u + 1, 32 bits a half */
                        lo[x] = _mm256_or_si256(lo[x], fifth_bits(planes, x));
                        hi[x] = _mm256_or_si256(hi[x], fifth_bits(planes, 2 + x));
                    }
                }
                for (int r = 0; r < MT; r++) {
                    const __m256i al = bc4(q[r] + k0 + 8 * u), ah = bc4(q[r] + k0 + 8 * u + 4);
                    for (int x = 0; x < 2; x++) {
#if Q8_VNNI256
                        T[r][x] = dot4(T[r][x], lo[x], al);
                        s1[r][x] = dot4(s1[r][x], hi[x], ah);
#else
                        s16[r][x] = _mm256_add_epi16(s16[r][x], _mm256_add_epi16(mad16(lo[x], al), mad16(hi[x], ah)));
                        if (qtype == Q5_0 && (u & 1)) { /* 4 pair sums of codes <= 31: widen */
                            T[r][x] = _mm256_add_epi32(T[r][x], _mm256_madd_epi16(s16[r][x], one16));
                            s16[r][x] = _mm256_setzero_si256();
                        }
#endif
                    }
                }
            }
            for (int r = 0; r < MT; r++)
                for (int x = 0; x < 2; x++) {
#if Q8_VNNI256
                    T[r][x] = _mm256_add_epi32(T[r][x], s1[r][x]);
#else
                    if (qtype == Q4_1) T[r][x] = _mm256_madd_epi16(s16[r][x], one16);
#endif
                    if (qtype == Q5_0) T[r][x] = _mm256_sub_epi32(T[r][x], _mm256_set1_epi32(16 * as[r][b]));
                }
        } else if (qtype == Q8_0) {
            const long k0 = b * 32;
#if Q8_VNNI256
            __m256i s1[Q8MT][2];
            for (int r = 0; r < MT; r++) s1[r][0] = s1[r][1] = _mm256_setzero_si256();
            for (int u = 0; u < 8; u += 2) {
                const __m256i v0[2] = {ld32(cd + 64 * u), ld32(cd + 64 * u + 32)};
                const __m256i v1[2] = {ld32(cd + 64 * u + 64), ld32(cd + 64 * u + 96)};
                for (int r = 0; r < MT; r++) {
                    const __m256i a0 = bc4(q[r] + k0 + 4 * u), a1 = bc4(q[r] + k0 + 4 * u + 4);
                    for (int x = 0; x < 2; x++) {
                        T[r][x] = dot4(T[r][x], v0[x], a0);
                        s1[r][x] = dot4(s1[r][x], v1[x], a1);
                    }
                }
            }
            for (int r = 0; r < MT; r++)
                for (int x = 0; x < 2; x++)
                    T[r][x] = _mm256_sub_epi32(_mm256_add_epi32(T[r][x], s1[r][x]), _mm256_set1_epi32(128 * as[r][b]));
#else
            const __m256i flip = _mm256_set1_epi8((char)0x80);
            for (int u = 0; u < 8; u++) {
                __m256i w[2], aw[2];
                for (int x = 0; x < 2; x++) {
                    w[x] = _mm256_xor_si256(ld32(cd + 64 * u + 32 * x), flip); /* code - 128 */
                    aw[x] = _mm256_abs_epi8(w[x]);                            /* |w| <= 128, read unsigned */
                }
                for (int r = 0; r < MT; r++) {
                    const __m256i a = bc4(q[r] + k0 + 4 * u);
                    for (int x = 0; x < 2; x++)
                        T[r][x] = _mm256_add_epi32(T[r][x], _mm256_madd_epi16(mad16(aw[x], _mm256_sign_epi8(a, w[x])), one16));
                }
            }
#endif
        } else if (qtype == Q4_K) {
            const long k0 = b * 256;
            for (int j = 0; j < 8; j++) {
                __m256i sc[2];
                for (int x = 0; x < 2; x++) {
                    const __m256i s = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(h + 64 + 16 * j + 8 * x)));
#if Q8_VNNI256
                    sc[x] = s;
#else
                    sc[x] = _mm256_or_si256(s, _mm256_slli_epi32(s, 16)); /* the scale in both int16 halves */
#endif
                }
                __m256i s0[Q8MT][2], s1[Q8MT][2];
                for (int r = 0; r < MT; r++) s0[r][0] = s0[r][1] = s1[r][0] = s1[r][1] = _mm256_setzero_si256();
                for (int u = 0; u < 4; u++) {
                    __m256i lo[2], hi[2];
                    for (int x = 0; x < 2; x++) {
                        const __m256i v = ld32(cd + 64 * (4 * j + u) + 32 * x);
                        lo[x] = _mm256_and_si256(v, lo4);
                        hi[x] = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
                    }
                    for (int r = 0; r < MT; r++) {
                        const __m256i al = bc4(q[r] + k0 + 32 * j + 8 * u), ah = bc4(q[r] + k0 + 32 * j + 8 * u + 4);
                        for (int x = 0; x < 2; x++) {
#if Q8_VNNI256
                            s0[r][x] = dot4(s0[r][x], lo[x], al);
                            if (MT <= 2) s1[r][x] = dot4(s1[r][x], hi[x], ah); /* 2 chains where few rows hide the latency */
                            else s0[r][x] = dot4(s0[r][x], hi[x], ah);
#else
                            s0[r][x] = _mm256_add_epi16(s0[r][x], _mm256_add_epi16(mad16(lo[x], al), mad16(hi[x], ah)));
#endif
                        }
                    }
                }
                for (int r = 0; r < MT; r++)
                    for (int x = 0; x < 2; x++) {
#if Q8_VNNI256
                        const __m256i S = MT <= 2 ? _mm256_add_epi32(s0[r][x], s1[r][x]) : s0[r][x];
                        T[r][x] = _mm256_add_epi32(T[r][x], _mm256_mullo_epi32(S, sc[x]));
#else
                        T[r][x] = _mm256_add_epi32(T[r][x], _mm256_madd_epi16(s0[r][x], sc[x]));
#endif
                    }
            }
            for (int x = 0; x < 2; x++) {
                __m256i mn[4];
                for (int p = 0; p < 4; p++) mn[p] = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(h + 192 + 32 * p + 16 * x)));
                const __m256 dm = h8(h + 32 + 16 * x);
                for (int r = 0; r < MT; r++) { /* sum_j mn_j A_j: pairs of sub-blocks, one int16 pair product each */
                    const int32_t *a2 = ap[r] + b * 4;
                    __m256i Im = _mm256_setzero_si256();
                    for (int p = 0; p < 4; p++) {
#if Q8_VNNI256
                        Im = _mm256_dpwssd_avx_epi32(Im, mn[p], _mm256_set1_epi32(a2[p]));
#else
                        Im = _mm256_add_epi32(Im, _mm256_madd_epi16(mn[p], _mm256_set1_epi32(a2[p])));
#endif
                    }
                    const __m256 a = _mm256_set1_ps(da[r][b]);
                    facc[r][x] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(T[r][x]), _mm256_mul_ps(dw[x], a), facc[r][x]);
                    facc[r][x] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(Im), _mm256_mul_ps(dm, a), facc[r][x]);
                }
            }
            continue; /* Q4_K's two terms are added above */
        } else { /* Q6_K: sum_j sc_j (S_j - 32 A_j) = sum_j sc_j S_j - 32 sum_j sc_j A_j, the same integer */
            const long k0 = b * 256;
#if !Q8_VNNI256
            /* byte indices (within each 128-bit lane) that copy a dword's even / odd int16 to both its halves */
            const __m256i even = _mm256_setr_epi32(0x01000100, 0x05040504, 0x09080908, 0x0D0C0D0C,
                                                   0x01000100, 0x05040504, 0x09080908, 0x0D0C0D0C);
            const __m256i odd = _mm256_setr_epi32(0x03020302, 0x07060706, 0x0B0A0B0A, 0x0F0E0F0E,
                                                  0x03020302, 0x07060706, 0x0B0A0B0A, 0x0F0E0F0E);
#endif
            __m256i C[Q8MT][2];
            for (int r = 0; r < MT; r++) C[r][0] = C[r][1] = _mm256_setzero_si256();
            for (int p = 0; p < 8; p++) {
                __m256i wsc[2];
                for (int x = 0; x < 2; x++) {
                    wsc[x] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(h + 32 + 32 * p + 16 * x)));
                    for (int r = 0; r < MT; r++) {
#if Q8_VNNI256
                        C[r][x] = _mm256_dpwssd_avx_epi32(C[r][x], wsc[x], _mm256_set1_epi32(ap[r][b * 8 + p]));
#else
                        C[r][x] = _mm256_add_epi32(C[r][x], _mm256_madd_epi16(wsc[x], _mm256_set1_epi32(ap[r][b * 8 + p])));
#endif
                    }
                }
                for (int t = 0; t < 2; t++) {
                    const int j = 2 * p + t;
                    for (int x = 0; x < 2; x++) {
#if Q8_VNNI256
                        const __m256i sc = t ? _mm256_srai_epi32(wsc[x], 16) : _mm256_srai_epi32(_mm256_slli_epi32(wsc[x], 16), 16);
#else
                        const __m256i sc = _mm256_shuffle_epi8(wsc[x], t ? odd : even); /* sc_j in both int16 halves */
#endif
                        const __m256i v0 = ld32(cd + 256 * j + 32 * x), v1 = ld32(cd + 256 * j + 64 + 32 * x);
                        const __m256i v2 = ld32(cd + 256 * j + 128 + 32 * x), v3 = ld32(cd + 256 * j + 192 + 32 * x);
                        for (int r = 0; r < MT; r++) {
                            const int8_t *pq = q[r] + k0 + 16 * j;
                            const __m256i a0 = bc4(pq), a1 = bc4(pq + 4), a2 = bc4(pq + 8), a3 = bc4(pq + 12);
#if Q8_VNNI256
                            __m256i S;
                            if (MT <= 2) { /* 2 chains where few rows hide the latency */
                                const __m256i e = dot4(dot4(_mm256_setzero_si256(), v0, a0), v2, a2);
                                const __m256i o = dot4(dot4(_mm256_setzero_si256(), v1, a1), v3, a3);
                                S = _mm256_add_epi32(e, o);
                            } else
                                S = dot4(dot4(dot4(dot4(_mm256_setzero_si256(), v0, a0), v1, a1), v2, a2), v3, a3);
                            T[r][x] = _mm256_add_epi32(T[r][x], _mm256_mullo_epi32(S, sc));
#else
                            const __m256i e = _mm256_madd_epi16(_mm256_add_epi16(mad16(v0, a0), mad16(v1, a1)), sc);
                            const __m256i o = _mm256_madd_epi16(_mm256_add_epi16(mad16(v2, a2), mad16(v3, a3)), sc);
                            T[r][x] = _mm256_add_epi32(T[r][x], _mm256_add_epi32(e, o));
#endif
                        }
                    }
                }
            }
            for (int r = 0; r < MT; r++)
                for (int x = 0; x < 2; x++) T[r][x] = _mm256_sub_epi32(T[r][x], _mm256_slli_epi32(C[r][x], 5));
        }
        for (int r = 0; r < MT; r++)
            for (int x = 0; x < 2; x++) {
                facc[r][x] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(T[r][x]), _mm256_mul_ps(dw[x], _mm256_set1_ps(da[r][b])), facc[r][x]);
                if (qtype == Q4_1)
                    facc[r][x] = _mm256_fmadd_ps(h8(h + 32 + 16 * x), _mm256_set1_ps(A->s1[(m0 + r) * (A->K / 32) + b]), facc[r][x]);
            }
    }
    for (int r = 0; r < MT; r++) { out[r][0] = facc[r][0]; out[r][1] = facc[r][1]; }
}

static void q8_group(int qtype, const uint8_t *grp, long nb, const q8act *A, long M, long N, long n0,
                     const float *bias, float *y)
{
    const long nv = N - n0 < QG ? N - n0 : QG;
    float bb[QG] = {0};
    if (bias) memcpy(bb, bias + n0, sizeof(float) * (size_t)nv);
    __m256 out[Q8MT][2];
    const long tile = q8_rows_per_tile(qtype);
    for (long m0 = 0; m0 < M;) {
        /* tiles as even as the rows allow (6 rows: 3, 3), none taller than tile */
        const long left = M - m0, ntiles = (left + tile - 1) / tile, mt = (left + ntiles - 1) / ntiles;
        switch (qtype * 16 + (int)mt) { /* each type and tile height compiled on its own */
#define T(QT) \
        case QT * 16 + 1: q8_tile(QT, grp, nb, A, m0, 1, out); break; \
        case QT * 16 + 2: q8_tile(QT, grp, nb, A, m0, 2, out); break; \
        case QT * 16 + 3: q8_tile(QT, grp, nb, A, m0, 3, out); break; \
        case QT * 16 + 4: q8_tile(QT, grp, nb, A, m0, 4, out); break;
        T(Q4_1) T(Q5_0) T(Q8_0) T(Q4_K) T(Q6_K)
#undef T
        }
        for (long r = 0; r < mt; r++) {
            float v[QG];
            for (int x = 0; x < 2; x++)
                _mm256_storeu_ps(v + 8 * x, bias ? _mm256_add_ps(out[r][x], _mm256_loadu_ps(bb + 8 * x)) : out[r][x]);
            memcpy(y + (m0 + r) * N + n0, v, sizeof(float) * (size_t)nv);
        }
        m0 += mt;
    }
}
#endif

/* The 8-bit rows of x[M, K] for qtype's weights, quantised (threads over rows); 0, or -2 when out of memory. */
static int q8_act_new(int qtype, const float *x, long M, long K, int threads, q8act *A)
{
    const int qk = q8_qk(qtype), sub = q8_sub(qtype);
    memset(A, 0, sizeof *A);
    A->K = K; A->nda = K / qk; A->nas = K / sub;
    int8_t *q = malloc((size_t)(M * K));
    float *da = malloc(sizeof(float) * (size_t)(M * A->nda)), *s1 = malloc(sizeof(float) * (size_t)(M * (K / 32)));
    int32_t *as = malloc(sizeof(int32_t) * (size_t)(M * A->nas));
    A->q = q; A->da = da; A->as = as; A->s1 = s1;
    if (!q || !da || !s1 || !as) return -2;
    int32_t *ap = NULL;
    if (qtype == Q4_K || qtype == Q6_K) {
        A->ap = ap = malloc(sizeof(int32_t) * (size_t)(M * (A->nas / 2)));
        if (!ap) return -2;
    }
    const int qthreads = threads > 1 && M >= 8 ? threads : 1;
#pragma omp parallel for num_threads(qthreads) if (qthreads > 1) schedule(static)
    for (long m = 0; m < M; m++)
    {
        q8_quantize_row(qtype, x + m * K, K, q + m * K, da + m * A->nda, as + m * A->nas, qtype == Q4_1 ? s1 + m * (K / 32) : NULL,
                        0);
        if (ap)
            for (long i = 0; i < A->nas / 2; i++)
                ap[m * (A->nas / 2) + i] = (int32_t)((uint32_t)(uint16_t)(int16_t)as[m * A->nas + 2 * i]
                                                     | (uint32_t)(uint16_t)(int16_t)as[m * A->nas + 2 * i + 1] << 16);
    }
    return 0;
}

static void q8_act_free(q8act *A)
{
    free((void *)A->q); free((void *)A->da); free((void *)A->as); free((void *)A->s1); free((void *)A->ap);
}

/* y[M, N] = the contract "gguf-q8" of x[M, K] against the packed weights (dq8_pack), + bias. */
int dq8_linear(int qtype, const uint8_t *packed, long N, long K, const float *x, long M, const float *bias, float *y,
               int threads)
{
    if (q8_block_hdr(qtype) < 0 || K % q8_qk(qtype) || M < 1 || N < 1) return -1;
    const long nb = K / q8_qk(qtype), blk = q8_block_hdr(qtype) + q8_block_codes(qtype), ng = (N + QG - 1) / QG;
    q8act A;
    if (q8_act_new(qtype, x, M, K, threads, &A)) { q8_act_free(&A); return -2; }
    if (threads < 1 || ng < 8) threads = 1;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (long g = 0; g < ng; g++) {
        const uint8_t *grp = packed + g * nb * blk;
#if defined(Q8_VECTOR)
        q8_group(qtype, grp, nb, &A, M, N, g * QG, bias, y);
#else
        for (int c = 0; c < QG && g * QG + c < N; c++)
            for (long m = 0; m < M; m++) {
                float v = q8_dot_scalar(qtype, grp, nb, c, &A, m);
                y[m * N + g * QG + c] = bias ? v + bias[g * QG + c] : v;
            }
#endif
    }
    q8_act_free(&A);
    return 0;
}

/* For tests: the portable code's outputs on any build (the vector build's must equal them bit for bit). */
int dq8_linear_portable(int qtype, const uint8_t *packed, long N, long K, const float *x, long M, const float *bias,
                        float *y)
{
    if (q8_block_hdr(qtype) < 0 || K % q8_qk(qtype) || M < 1 || N < 1) return -1;
    const long nb = K / q8_qk(qtype), blk = q8_block_hdr(qtype) + q8_block_codes(qtype);
    q8act A;
    if (q8_act_new(qtype, x, M, K, 1, &A)) { q8_act_free(&A); return -2; }
    for (long n = 0; n < N; n++)
        for (long m = 0; m < M; m++) {
            float v = q8_dot_scalar(qtype, packed + (n / QG) * nb * blk, nb, (int)(n % QG), &A, m);
            y[m * N + n] = bias ? v + bias[n] : v;
        }
    q8_act_free(&A);
    return 0;
}
