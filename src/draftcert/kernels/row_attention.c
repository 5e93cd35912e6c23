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
 *   - max, then p_j = expf(s_j - max) (libm), l = sum p_j in increasing j;
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

#if defined(__AVX512F__)
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
        if (mk && !mk[j]) continue;
        for (int x = 0; x < HC; x++) {
            __m512 a = _mm512_setzero_ps();
            for (int d = 0; d < ND; d++) a = _mm512_fmadd_ps(qr[x * ND + d], _mm512_loadu_ps(kk + j * ks + 16 * d), a);
            const float s = hsum16(a) * scale;
            sc[x * S + j] = s;
            mx[x] = s > mx[x] ? s : mx[x];
        }
        seen++;
    }
    for (long j = 0; j < S && seen; j++) {
        if (mk && !mk[j]) continue;
        for (int x = 0; x < HC; x++) {
            const float p = expf(sc[x * S + j] - mx[x]);
            l[x] += p;
            for (int d = 0; d < ND; d++) acc[x * ND + d] = _mm512_fmadd_ps(_mm512_set1_ps(p), _mm512_loadu_ps(vv + j * vs + 16 * d), acc[x * ND + d]);
        }
    }
    for (int x = 0; x < HC; x++) /* no visible key: zeros */
        for (int d = 0; d < ND; d++) _mm512_storeu_ps(o[x] + 16 * d, seen ? _mm512_div_ps(acc[x * ND + d], _mm512_set1_ps(l[x])) : _mm512_setzero_ps());
}
#endif

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
            const long b = t / (M * Hkv * per), i = (t / (Hkv * per)) % M, g = (t / per) % Hkv, h0 = g * groups + t % per * hc;
            const long nh = groups - t % per * hc < hc ? groups - t % per * hc : hc;
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
                const float p = expf(sc[j] - mx);
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
