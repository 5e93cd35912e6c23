/* Attention one query row at a time, in an order that depends on nothing but that row's query and
 * the keys and values it may see: out[b, i, h] = sum_j p_j v_j / sum_j p_j over the visible keys j
 * (mask[b, i, j] != 0) in increasing order, p_j = exp(s_j - max s), s_j = scale * (q . k_j).
 *
 * Why: torch's scaled_dot_product_attention gives a query row different last bits in a pass of 1
 * row and in a pass of 16 (its blocking and its GEMMs follow the shapes), so a model whose linear
 * layers are batch invariant (block_matmul.c) still scored a token differently when verified among k
 * drafts than when decoded alone.  Under 8-bit activations those bits can move a rounding of the
 * next layer's quantised input, and strict decoding left greedy.  Here each (batch, row, head) is
 * computed whole by one thread with the same operations whatever the other rows are:
 *   - the dot q . k_j: VW lanes, lane l summing d = v * VW + l in increasing v (multiply-add), then a
 *     fixed pairwise tree over the lanes, then the tail d >= D / VW * VW in order;
 *   - max, then p_j = ra_expf(s_j - max), l = sum p_j in increasing j;
 *   - acc = sum_j p_j v_j per element in increasing j; out = acc / l.
 * Keys that are masked are skipped (not added as zeros), so a row sees exactly its visible keys, in
 * cache order: a verification row and the decode step of the same token compute the same bits. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* exp(x) for x in [-104, 0] as glibc's expf computes it (the ARM optimized-routines algorithm: 2^(k/32)
 * from a table times a cubic in the remainder, in double), every product-and-add fused as glibc's
 * x86-64 FMA build does; equal to glibc 2.36's expf on all 1.1e9 floats of that range (checked
 * exhaustively), 16 lanes at a time where the build has AVX-512.  Outside that range (NaN, below
 * -104, above 0), libm's expf. */
static const uint64_t EXP_T[32] = {
    0x3ff0000000000000, 0x3fefd9b0d3158574, 0x3fefb5586cf9890f, 0x3fef9301d0125b51, 0x3fef72b83c7d517b, 0x3fef54873168b9aa,
    0x3fef387a6e756238, 0x3fef1e9df51fdee1, 0x3fef06fe0a31b715, 0x3feef1a7373aa9cb, 0x3feedea64c123422, 0x3feece086061892d,
    0x3feebfdad5362a27, 0x3feeb42b569d4f82, 0x3feeab07dd485429, 0x3feea47eb03a5585, 0x3feea09e667f3bcd, 0x3fee9f75e8ec5f74,
    0x3feea11473eb0187, 0x3feea589994cce13, 0x3feeace5422aa0db, 0x3feeb737b0cdc5e5, 0x3feec49182a3f090, 0x3feed503b23e255d,
    0x3feee89f995ad3ad, 0x3feeff76f2fb5e47, 0x3fef199bdd85529c, 0x3fef3720dcef9069, 0x3fef5818dcfba487, 0x3fef7c97337b9b5f,
    0x3fefa4afa2a490da, 0x3fefd0765b6e4540}; /* bits of 2^(i/32) - (i << 47) */
#define EXP_INV (0x1.71547652b82fep+0 * 32)
#define EXP_SHIFT 0x1.8p+52
#define EXP_C0 (0x1.c6af84b912394p-5 / 32 / 32 / 32)
#define EXP_C1 (0x1.ebfce50fac4f3p-3 / 32 / 32)
#define EXP_C2 (0x1.62e42ff0c52d6p-1 / 32)

static inline float ra_expf(float x)
{
    if (!(x >= -104.0f && x <= 0.0f)) return expf(x);
    const double xd = x, kd = fma(EXP_INV, xd, EXP_SHIFT), r = fma(EXP_INV, xd, -(kd - EXP_SHIFT));
    uint64_t ki, t;
    double s;
    memcpy(&ki, &kd, 8);
    t = EXP_T[ki % 32] + (ki << 47);
    memcpy(&s, &t, 8);
    return (float)(fma(fma(EXP_C0, r, EXP_C1), r * r, fma(EXP_C2, r, 1.0)) * s);
}

#if defined(__AVX512F__)
static inline __m256 exp8(__m256 x) /* ra_expf of 8 lanes in [-104, 0] */
{
    const __m512d xd = _mm512_cvtps_pd(x), kd = _mm512_fmadd_pd(_mm512_set1_pd(EXP_INV), xd, _mm512_set1_pd(EXP_SHIFT));
    const __m512d r = _mm512_fmsub_pd(_mm512_set1_pd(EXP_INV), xd, _mm512_sub_pd(kd, _mm512_set1_pd(EXP_SHIFT)));
    const __m512i ki = _mm512_castpd_si512(kd);
    const __m512i t = _mm512_add_epi64(_mm512_i64gather_epi64(_mm512_and_si512(ki, _mm512_set1_epi64(31)), (const void *)EXP_T, 8),
                                       _mm512_slli_epi64(ki, 47));
    const __m512d p = _mm512_fmadd_pd(_mm512_fmadd_pd(_mm512_set1_pd(EXP_C0), r, _mm512_set1_pd(EXP_C1)), _mm512_mul_pd(r, r),
                                      _mm512_fmadd_pd(_mm512_set1_pd(EXP_C2), r, _mm512_set1_pd(1.0)));
    return _mm512_cvtpd_ps(_mm512_mul_pd(p, _mm512_castsi512_pd(t)));
}

static void exp_minus(float *v, long n, float mx) /* v[j] = ra_expf(v[j] - mx) */
{
    long j = 0;
    for (; j + 16 <= n; j += 16) {
        const __m512 x = _mm512_sub_ps(_mm512_loadu_ps(v + j), _mm512_set1_ps(mx));
        const __mmask16 in = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-104.0f), _CMP_GE_OQ) & _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LE_OQ);
        _mm512_storeu_ps(v + j, _mm512_insertf32x8(_mm512_castps256_ps512(exp8(_mm512_castps512_ps256(x))), exp8(_mm512_extractf32x8_ps(x, 1)), 1));
        if (in != 0xFFFF)
            for (int l = 0; l < 16; l++) if (!((in >> l) & 1)) v[j + l] = expf(x[l]); /* ra_expf outside [-104, 0] */
    }
    for (; j < n; j++) v[j] = ra_expf(v[j] - mx);
}

static inline float hsum16(__m512 acc) /* the lanes' fixed pairwise tree */
{
    const __m256 v8 = _mm256_add_ps(_mm512_castps512_ps256(acc), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1)));
    const __m128 v4 = _mm_add_ps(_mm256_castps256_ps128(v8), _mm256_extractf128_ps(v8, 1));
    const __m128 v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
    return _mm_cvtss_f32(_mm_add_ss(v2, _mm_shuffle_ps(v2, v2, 1)));
}
#endif

static inline float dot(const float *restrict a, const float *restrict b, long D)
{
    long d = 0;
    float s = 0.0f;
#if defined(__AVX512F__)
    if (D >= 16) {
        __m512 acc = _mm512_setzero_ps();
        for (; d + 16 <= D; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
        s = hsum16(acc);
    }
#else
    if (D >= 8) {
        float l[8] = {0};
        for (; d + 8 <= D; d += 8)
            for (int i = 0; i < 8; i++) l[i] = __builtin_fmaf(a[d + i], b[d + i], l[i]);
        for (int w = 4; w >= 1; w /= 2)
            for (int i = 0; i < w; i++) l[i] += l[i + w];
        s = l[0];
    }
#endif
    for (; d < D; d++) s = __builtin_fmaf(a[d], b[d], s);
    return s;
}

#if defined(__AVX512F__)
/* The heads h .. h + HC - 1 of one KV group for one query row (q[x]: head h + x's query, o[x] its
 * output), D = 16 ND: for each head the operations of the loop in ra_attention below, in its order,
 * with each key and value loaded once for all HC heads and the HC x ND sums held in registers. */
static inline __attribute__((always_inline)) void
heads16(const int ND, const int HC, const float *const *q, const float *kk, long ks, const float *vv, long vs,
        const uint8_t *mk, long S, float scale, float *sc, float *const *o)
{
    __m512 qr[16], acc[16];
    float mx[16], l[16];
    long seen = 0;
    for (int x = 0; x < HC; x++) {
        mx[x] = -INFINITY, l[x] = 0.0f;
        for (int d = 0; d < ND; d++) qr[x * ND + d] = _mm512_loadu_ps(q[x] + 16 * d), acc[x * ND + d] = _mm512_setzero_ps();
    }
    for (long j = 0; j < S; j++) {
        if (mk && !mk[j]) {
            for (int x = 0; x < HC; x++) sc[x * S + j] = 0.0f; /* not read: a value the exp takes fast */
            continue;
        }
        for (int x = 0; x < HC; x++) {
            __m512 a = _mm512_setzero_ps();
            for (int d = 0; d < ND; d++) a = _mm512_fmadd_ps(qr[x * ND + d], _mm512_loadu_ps(kk + j * ks + 16 * d), a);
            const float s = hsum16(a) * scale;
            sc[x * S + j] = s;
            mx[x] = s > mx[x] ? s : mx[x];
        }
        seen++;
    }
    for (int x = 0; x < HC && seen; x++) exp_minus(sc + x * S, S, mx[x]);
    for (long j = 0; j < S && seen; j++) {
        if (mk && !mk[j]) continue;
        for (int x = 0; x < HC; x++) {
            const float p = sc[x * S + j];
            l[x] += p;
            for (int d = 0; d < ND; d++) acc[x * ND + d] = _mm512_fmadd_ps(_mm512_set1_ps(p), _mm512_loadu_ps(vv + j * vs + 16 * d), acc[x * ND + d]);
        }
    }
    for (int x = 0; x < HC; x++) /* no visible key: zeros */
        for (int d = 0; d < ND; d++) _mm512_storeu_ps(o[x] + 16 * d, seen ? _mm512_div_ps(acc[x * ND + d], _mm512_set1_ps(l[x])) : _mm512_setzero_ps());
}
#endif

/* For tests: y = ra_expf(x), by the 16-lane code where vector (and the build has AVX-512). */
int ra_exp(const float *x, float *y, long n, int vector)
{
    memcpy(y, x, sizeof(float) * (size_t)n);
#if defined(__AVX512F__)
    if (vector) { exp_minus(y, n, 0.0f); return 0; }
#endif
    for (long j = 0; j < n; j++) y[j] = ra_expf(x[j]);
    return 0;
}

/* q: [B, H, M, D] with strides (qb, qh, qm) (floats, D contiguous); k, v: [B, Hkv, S, D] with
 * strides (kb, kh, ks) and (vb, vh, vs); mask: [B, M, S] bytes with strides (mb, mm), NULL = all
 * visible; out: [B, M, H, D] contiguous.  A row with no visible key gets zeros.  Returns 0, -2 when
 * out of memory.  With AVX-512 and D = 64 or 128 (generic = 0) the heads of a KV group are computed
 * together (heads16): the same operations per head, so the same bits. */
int ra_attention(const float *q, long qb, long qh, long qm, const float *k, long kb, long kh, long ks,
                 const float *v, long vb, long vh, long vs, const uint8_t *mask, long mb, long mm, long B, long H,
                 long Hkv, long M, long S, long D, float scale, float *out, int threads, int generic)
{
    const long groups = H / Hkv;
    long hc = 1; /* heads per task: as many as 16 registers of sums hold, fewer where threads lack tasks */
#if defined(__AVX512F__)
    if (!generic && (D == 64 || D == 128))
        for (hc = groups < 256 / D ? groups : 256 / D; hc > 1 && B * M * Hkv * ((groups + hc - 1) / hc) < 4L * threads;) hc = (hc + 1) / 2;
#endif
    const long per = (groups + hc - 1) / hc, n = B * M * Hkv * per;
    if (threads < 1 || n < 2) threads = 1;
    int oom = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float *sc = malloc(sizeof(float) * (size_t)(S > 0 ? S : 1) * (size_t)hc), *acc = malloc(sizeof(float) * (size_t)D);
        if (!sc || !acc) {
#pragma omp atomic write
            oom = 1;
        }
#pragma omp for schedule(static)
        for (long t = 0; t < n; t++) {
            if (!sc || !acc) continue;
            /* the rows of one head chunk are consecutive tasks, so a thread reads that KV group's keys and
             * values from memory once and again from its cache for the next rows (a pass of several rows) */
            const long b = t / (Hkv * per * M), g = (t / (per * M)) % Hkv, c = (t / M) % per, i = t % M;
            const long h0 = g * groups + c * hc, nh = groups - c * hc < hc ? groups - c * hc : hc;
#if defined(__AVX512F__)
            if (!generic && (D == 64 || D == 128)) {
                const float *qs[16];
                float *os[16];
                for (long x = 0; x < nh; x++) qs[x] = q + b * qb + (h0 + x) * qh + i * qm, os[x] = out + ((b * M + i) * H + h0 + x) * D;
                const float *kk = k + b * kb + g * kh, *vv = v + b * vb + g * vh;
                const uint8_t *mk = mask ? mask + b * mb + i * mm : NULL;
                switch (D / 16 * 8 + nh) { /* each shape compiled on its own: the sums stay in registers */
                case 33: heads16(4, 1, qs, kk, ks, vv, vs, mk, S, scale, sc, os); break;
                case 34: heads16(4, 2, qs, kk, ks, vv, vs, mk, S, scale, sc, os); break;
                case 35: heads16(4, 3, qs, kk, ks, vv, vs, mk, S, scale, sc, os); break;
                case 36: heads16(4, 4, qs, kk, ks, vv, vs, mk, S, scale, sc, os); break;
                case 65: heads16(8, 1, qs, kk, ks, vv, vs, mk, S, scale, sc, os); break;
                case 66: heads16(8, 2, qs, kk, ks, vv, vs, mk, S, scale, sc, os); break;
                }
                continue;
            }
#endif
            const float *qv = q + b * qb + h0 * qh + i * qm, *kk = k + b * kb + g * kh, *vv = v + b * vb + g * vh;
            const uint8_t *mk = mask ? mask + b * mb + i * mm : NULL;
            float *o = out + ((b * M + i) * H + h0) * D;
            float mx = -INFINITY;
            long seen = 0;
            for (long j = 0; j < S; j++) {
                if (mk && !mk[j]) continue;
                const float s = dot(qv, kk + j * ks, D) * scale;
                sc[j] = s;
                mx = s > mx ? s : mx;
                seen++;
            }
            memset(acc, 0, sizeof(float) * (size_t)D);
            if (!seen) {
                memset(o, 0, sizeof(float) * (size_t)D);
                continue;
            }
            float l = 0.0f;
            for (long j = 0; j < S; j++) {
                if (mk && !mk[j]) continue;
                const float p = ra_expf(sc[j] - mx);
                l += p;
                const float *vj = vv + j * vs;
                long d = 0;
#if defined(__AVX512F__)
                const __m512 pv = _mm512_set1_ps(p);
                for (; d + 16 <= D; d += 16)
                    _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(pv, _mm512_loadu_ps(vj + d), _mm512_loadu_ps(acc + d)));
#endif
                for (; d < D; d++) acc[d] = __builtin_fmaf(p, vj[d], acc[d]);
            }
            for (long d = 0; d < D; d++) o[d] = acc[d] / l;
        }
        free(sc);
        free(acc);
    }
    return oom ? -2 : 0;
}
