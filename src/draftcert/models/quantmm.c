/* y[M,N] = x[M,K] @ dequant(W)[N,K]^T (+ bias) with W kept as GGUF blocks (Q4_1, Q5_0, Q8_0, Q4_K, Q6_K).
 *
 * Why: a verification pass of M = 2..16 rows at batch 1 is bound by reading the weights; GGUF blocks
 * are 4.5-8.5 bits a weight, 1/4-1/7 of the float32 bytes they decode to.  Here the blocks of R
 * weight rows are decoded ONCE per call, a tile of KT elements at a time, into a float32 buffer in
 * L1, and that buffer feeds every one of the M input rows (each input vector loaded feeds R
 * weight rows), so the block bytes are read and decoded once whatever M is.
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

/* R weight rows are decoded together (a tile of KT elements each, in L1) and every input vector
 * loaded feeds R of them; MC input rows share one set of MC * R register accumulators. */
#if defined(__AVX512F__)
#define VW 16
#define MC 6 /* 24 accumulators + 4 weight vectors + 1 input vector of 32 registers */
#elif defined(__AVX2__) && defined(__FMA__)
#define VW 8
#define MC 2 /* 8 accumulators + 4 + 1 of 16 registers */
#else
#define VW 4
#define MC 2
#endif
#define R 4
#define KT 512 /* a multiple of every block size (32, 256) */
#define MGROUP 64 /* input rows whose accumulators and inputs stay in cache while the weights are decoded for them */

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
        if (i < 4) {
            sc = s[i] & 0x3F;
            mn = s[i + 4] & 0x3F;
        } else {
            sc = (s[i + 4] & 0x0F) | ((s[i - 4] >> 2) & 0x30);
            mn = (s[i + 4] >> 4) | ((s[i] >> 2) & 0x30);
        }
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

/* The fixed horizontal sum of one output's VW lanes (a pairwise tree). */
static inline float hsum(vf s)
{
    float t[VW];
    memcpy(t, &s, sizeof t);
    for (int w = VW / 2; w >= 1; w /= 2)
        for (int i = 0; i < w; i++) t[i] += t[i + w];
    return t[0];
}

/* For MM input rows (x: their k-tile, row stride K) and the R decoded weight rows of a tile
 * (buf: [R][KT], kt used): acc[m * R + r] += lanes of w_r * x_m over the tile, k in increasing order.
 * acc lives in memory between tiles; its lane values follow the same sequence of roundings
 * whether M is 1 or 64 (only the registers holding them change). */
static inline __attribute__((always_inline)) void
tile_rows(const float *restrict buf, const float *restrict x, long K, long kt, vf *restrict acc, const int MM)
{
    vf a[MC][R];
#pragma GCC unroll 8
    for (int m = 0; m < MM; m++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) a[m][r] = acc[m * R + r];
    for (long k = 0; k < kt; k += VW) {
        vf w[R];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) w[r] = *(const vf *)(buf + r * KT + k);
#pragma GCC unroll 8
        for (int m = 0; m < MM; m++) {
            vf xv = *(const vf *)(x + m * K + k);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) a[m][r] = fmadd(w[r], xv, a[m][r]);
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < MM; m++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) acc[m * R + r] = a[m][r];
}

static void tile_all(const float *restrict buf, const float *restrict x, long M, long K, long kt, vf *restrict acc)
{
    long m0 = 0;
    for (; m0 + MC <= M; m0 += MC) tile_rows(buf, x + m0 * K, K, kt, acc + m0 * R, MC);
    switch (M - m0) {
#define TAIL(T) case T: tile_rows(buf, x + m0 * K, K, kt, acc + m0 * R, T); break;
        TAIL(1)
#if MC > 2
        TAIL(2) TAIL(3)
#endif
#if MC > 4
        TAIL(4) TAIL(5)
#endif
#if MC > 6
        TAIL(6) TAIL(7)
#endif
#undef TAIL
    }
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
    if (threads < 1 || ng < 16) threads = 1;
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
                    for (int r = 0; r < R; r++) /* a short last group repeats its last row */
                        decode_span(qtype, w + (n0 + r < N ? n0 + r : N - 1) * row_bytes, k0, kt, buf + r * KT);
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
