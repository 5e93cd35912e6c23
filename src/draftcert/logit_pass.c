/* The float64 passes over logit rows, fused: the divergence pass behind
 * divergences._logit_pair_pass (lp_pair_pass) and the summary's moments behind
 * summary.summarize (lp_logit_moments, at the end of this file).
 *
 * For each row of target logits x and drafter logits y (float32, [n, V], row stride ldx / ldy),
 * with a = fl(x - max x), b = fl(y - max y), d = fl(a - b), all float64:
 *
 *   out[r*8 + 0] = S_p   = sum e^a          out[r*8 + 4] = TV sum = sum |e^a (S_q / S_p) - e^b|   (full)
 *   out[r*8 + 1] = S_q   = sum e^b          out[r*8 + 5] = max x - min x   (= max |a|, exact)
 *   out[r*8 + 2] = T     = sum e^a d        out[r*8 + 6] = max y - min y
 *   out[r*8 + 3] = T_q   = sum e^b d (full) out[r*8 + 7] = max y
 *
 * the same quantities as the torch pass, each product rounded, then added (no contraction:
 * -ffp-contract=off), in an order that depends on V and the build only, so a row's values do
 * not depend on the other rows or the thread count.  Returns the number of rows with a
 * non-finite logit; those rows get out[r*8 + 0] = NaN and the caller recomputes them.
 *
 * exp is lp_exp below: relative error <= 2 U (U = 2^-53) where e^a >= 2^-1021, and 0 (an
 * absolute error < 2^-1021) below a = -708: within the "2-ulp exp" (4 U) and the absolute
 * 2^-1021 per underflowing term that the pass's error bound charges (docs/theory.md, section 7).
 *   n = nearest integer to a log2(e) (the 1.5 * 2^52 shifter), |n| <= 1022
 *   r = (a - n ln2_hi) - n ln2_lo: the first step is exact (an FMA; a and n ln2_hi are
 *       multiples of 2^-54 and |a - n ln2_hi| < 1/2), the second rounds once: |r| <= 0.3467,
 *       e^r_computed = e^r_exact (1 + delta), |delta| <= 0.35 U
 *   e^r by Horner on the degree-13 Taylor polynomial, one FMA a step (coefficients 1/k!
 *       rounded): truncation <= 0.08 U, the rounding <= 1.51 U relative (each step's error
 *       reaches the result damped by |r h_{k+1}| / h_k <= 0.42)
 *   e^a = 2^n e^r, the scaling exact (2^n and the result are normal for a >= -708)
 * tests/test_logit_pass.py compares it with numpy's extended-precision exp on 1.4 million points
 * (largest error seen 1.20 U).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define LOG2E 0x1.71547652b82fep+0
#define LN2_HI 0x1.62e42fefa39efp-1
#define LN2_LO 0x1.abc9e3b39803fp-56
#define SHIFTER 0x1.8p52
#define CUTOFF (-708.0)

static const double C[14] = {
    1.0, 1.0, 0.5, 1.0 / 6, 1.0 / 24, 1.0 / 120, 1.0 / 720, 1.0 / 5040, 1.0 / 40320, 1.0 / 362880,
    1.0 / 3628800, 1.0 / 39916800, 1.0 / 479001600, 1.0 / 6227020800.0,
};

/* e^a for a <= 0 (a > 0 up to 709 also works); 0 below CUTOFF. */
/* e^r for the reduced r = a - n ln2 (both steps above), n the nearest integer to a log2(e). */
static inline double exp_reduced(double a, double *n_out) {
    double t = a * LOG2E + SHIFTER;
    double n = t - SHIFTER;
    double r = fma(-n, LN2_HI, a);
    r = fma(-n, LN2_LO, r);
    double h = C[13];
    for (int k = 12; k >= 0; k--) h = fma(h, r, C[k]);
    *n_out = n;
    return h;
}

static inline double lp_exp(double a) {
    double n, h = exp_reduced(a, &n);
    int64_t bits = ((int64_t)n + 1023) << 52;
    double s;
    memcpy(&s, &bits, sizeof s);
    return a < CUTOFF ? 0.0 : h * s;
}

int lp_exp_array(const double *a, long n, double *out) {
    for (long i = 0; i < n; i++) out[i] = lp_exp(a[i]);
    return 0;
}

#if defined(__AVX512F__)
/* exp_reduced, eight lanes. */
static inline __m512d exp_reduced8(__m512d a, __m512d *n_out) {
    const __m512d shifter = _mm512_set1_pd(SHIFTER);
    __m512d t = _mm512_add_pd(_mm512_mul_pd(a, _mm512_set1_pd(LOG2E)), shifter);
    __m512d n = _mm512_sub_pd(t, shifter);
    __m512d r = _mm512_fnmadd_pd(n, _mm512_set1_pd(LN2_HI), a);
    r = _mm512_fnmadd_pd(n, _mm512_set1_pd(LN2_LO), r);
    __m512d h = _mm512_set1_pd(C[13]);
    for (int k = 12; k >= 0; k--) h = _mm512_fmadd_pd(h, r, _mm512_set1_pd(C[k]));
    *n_out = n;
    return h;
}

static inline __m512d lp_exp8(__m512d a) {
    __m512d n, h = exp_reduced8(a, &n);
    __m512i bits = _mm512_slli_epi64(_mm512_add_epi64(_mm512_cvtpd_epi64(n), _mm512_set1_epi64(1023)), 52);
    __m512d v = _mm512_mul_pd(h, _mm512_castsi512_pd(bits));
    __mmask8 under = _mm512_cmp_pd_mask(a, _mm512_set1_pd(CUTOFF), _CMP_LT_OQ);
    return _mm512_maskz_mov_pd((__mmask8)~under, v);
}
#endif

int lp_vector_width(void) {
#if defined(__AVX512F__)
    return 8;
#else
    return 1;
#endif
}

/* One row: 0 if its logits are all finite, 1 (and out[0] = NaN) otherwise.  scratch: 2 V doubles. */
static int pair_row(const float *x, const float *y, long V, int full, double *out, double *scratch) {
    float mx = x[0], nx = x[0], my = y[0], ny = y[0];
    int nan = 0;  /* an infinity shows in the range below, a NaN only here */
    for (long i = 0; i < V; i++) {
        float xi = x[i], yi = y[i];
        mx = xi > mx ? xi : mx; nx = xi < nx ? xi : nx;
        my = yi > my ? yi : my; ny = yi < ny ? yi : ny;
        nan |= (xi != xi) | (yi != yi);
    }
    if (nan || !(mx - nx < INFINITY) || !(my - ny < INFINITY)) {
        out[0] = NAN;
        return 1;
    }
    const double dmx = mx, dmy = my;
    double sp = 0, sq = 0, t = 0, tq = 0, tv = 0;
    double *ea = scratch, *eb = scratch + V;
    long i = 0;
#if defined(__AVX512F__)
    __m512d vsp = _mm512_setzero_pd(), vsq = vsp, vt = vsp, vtq = vsp;
    const __m512d vmx = _mm512_set1_pd(dmx), vmy = _mm512_set1_pd(dmy);
    for (; i + 8 <= V; i += 8) {
        __m512d a = _mm512_sub_pd(_mm512_cvtps_pd(_mm256_loadu_ps(x + i)), vmx);
        __m512d b = _mm512_sub_pd(_mm512_cvtps_pd(_mm256_loadu_ps(y + i)), vmy);
        __m512d d = _mm512_sub_pd(a, b);
        __m512d e1 = lp_exp8(a), e2 = lp_exp8(b);
        vsp = _mm512_add_pd(vsp, e1);
        vsq = _mm512_add_pd(vsq, e2);
        vt = _mm512_add_pd(vt, _mm512_mul_pd(e1, d));
        if (full) {
            vtq = _mm512_add_pd(vtq, _mm512_mul_pd(e2, d));
            _mm512_storeu_pd(ea + i, e1);
            _mm512_storeu_pd(eb + i, e2);
        }
    }
    sp = _mm512_reduce_add_pd(vsp); sq = _mm512_reduce_add_pd(vsq);
    t = _mm512_reduce_add_pd(vt); tq = _mm512_reduce_add_pd(vtq);
#endif
    for (; i < V; i++) {
        double a = (double)x[i] - dmx, b = (double)y[i] - dmy, d = a - b;
        double e1 = lp_exp(a), e2 = lp_exp(b);
        sp += e1; sq += e2; t += e1 * d;
        if (full) { tq += e2 * d; ea[i] = e1; eb[i] = e2; }
    }
    if (full) {
        const double ratio = sq / sp;
        long j = 0;
#if defined(__AVX512F__)
        __m512d vtv = _mm512_setzero_pd(), vr = _mm512_set1_pd(ratio);
        for (; j + 8 <= V; j += 8)
            vtv = _mm512_add_pd(vtv, _mm512_abs_pd(_mm512_sub_pd(_mm512_mul_pd(_mm512_loadu_pd(ea + j), vr),
                                                                 _mm512_loadu_pd(eb + j))));
        tv = _mm512_reduce_add_pd(vtv);
#endif
        for (; j < V; j++) tv += fabs(ea[j] * ratio - eb[j]);
    }
    out[0] = sp; out[1] = sq; out[2] = t; out[3] = tq; out[4] = tv;
    out[5] = dmx - (double)nx; out[6] = dmy - (double)ny; out[7] = dmy;
    return 0;
}

/* scratch: threads x 2 V doubles (used when full). */
long lp_pair_pass(const float *x, long ldx, const float *y, long ldy, long n, long V, int full,
                  double *out, double *scratch, int threads) {
    long broken = 0;
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1) reduction(+ : broken)
    for (long r = 0; r < n; r++) {
#ifdef _OPENMP
        double *mine = scratch + (size_t)omp_get_thread_num() * 2 * (size_t)V;
#else
        double *mine = scratch;
#endif
        broken += pair_row(x + r * ldx, y + r * ldy, V, full, out + r * 8, mine);
    }
    return broken;
}

/* ---------------------------------------------------------------- the summary's moments
 *
 * For each row of logits x (float32, [n, V], row stride ldx) and its reference m (float64, the
 * row maximum as float32 gives it), with z = fl(x - m) in float64:
 *
 *   out[r*3 + 0] = s  = sum e^z
 *   out[r*3 + 1] = d  = sum e^z z   (a term with e^z = 0 counts 0: x = -inf, or deep underflow)
 *   out[r*3 + 2] = lo = min x
 *
 * the quantities of summary._logit_moments, each product rounded and then added, summed over
 * fixed chunks of CHUNK columns (each chunk's eight lanes, then the chunks in order), so a row's
 * values depend on V and the build only, never on the other rows or the threads; a row is split
 * across threads by its chunks.  Returns the number of rows holding a NaN or +inf (or with a
 * non-finite m): those get out[r*3 + 0] = NaN and the caller recomputes them.
 *
 * exp is lp_exp_gradual: lp_exp's reduction and polynomial (relative error <= 1.94 U where
 * e^z >= 2^-1022), scaled by 2^n1 2^n2 with n1 = floor(n / 2), n2 = n - n1: both factors and
 * e^r 2^n1 are normal, so the first product is exact and the second rounds once -- exact
 * scaling above 2^-1022, one rounding into the subnormals below it (an absolute error
 * < 2^-1073 with the polynomial's), 0 for z < -760 (e^z < 2^-1096 rounds to 0).  That is
 * inside what docs/theory.md, section 7, charges the summary: the "(|z| + 4) U" of each term
 * of s (a 2-ulp exp) and the absolute 2^-1060 of each underflowing term e^z z of d.
 */
#define GRAD_LO (-760.0)
#define GRAD_HI 709.0
#define CHUNK 8192

static inline double lp_exp_gradual(double a) {
    a = a < GRAD_LO ? GRAD_LO : (a > GRAD_HI ? GRAD_HI : a);
    double n, h = exp_reduced(a, &n);
    int64_t ni = (int64_t)n, n1 = ni >> 1, n2 = ni - n1;
    int64_t b1 = (n1 + 1023) << 52, b2 = (n2 + 1023) << 52;
    double s1, s2;
    memcpy(&s1, &b1, sizeof s1);
    memcpy(&s2, &b2, sizeof s2);
    return (h * s1) * s2;
}

int lp_exp_gradual_array(const double *a, long n, double *out) {
    for (long i = 0; i < n; i++) out[i] = lp_exp_gradual(a[i]);
    return 0;
}

#if defined(__AVX512F__)
static inline __m512d lp_exp_gradual8(__m512d a) {
    a = _mm512_min_pd(_mm512_max_pd(a, _mm512_set1_pd(GRAD_LO)), _mm512_set1_pd(GRAD_HI));
    __m512d n, h = exp_reduced8(a, &n);
    __m512i ni = _mm512_cvtpd_epi64(n), n1 = _mm512_srai_epi64(ni, 1), n2 = _mm512_sub_epi64(ni, n1);
    const __m512i bias = _mm512_set1_epi64(1023);
    __m512d s1 = _mm512_castsi512_pd(_mm512_slli_epi64(_mm512_add_epi64(n1, bias), 52));
    __m512d s2 = _mm512_castsi512_pd(_mm512_slli_epi64(_mm512_add_epi64(n2, bias), 52));
    return _mm512_mul_pd(_mm512_mul_pd(h, s1), s2);
}
#endif

/* Columns [i0, i1) of one row: (s, d) of the chunk, its minimum; returns 1 on a NaN or +inf. */
static int moments_chunk(const float *x, long i0, long i1, double m, int want_d, double *s_out, double *d_out,
                         float *lo_out) {
    double s = 0, d = 0;
    float lo = x[i0];
    int bad = 0;
    long i = i0;
#if defined(__AVX512F__)
    __m512d vs = _mm512_setzero_pd(), vd = vs;
    __m256 vlo = _mm256_set1_ps(lo);
    const __m256 pinf = _mm256_set1_ps(INFINITY);
    const __m512d vm = _mm512_set1_pd(m), zero = _mm512_setzero_pd();
    __mmask8 vbad = 0;
    for (; i + 8 <= i1; i += 8) {
        __m256 xf = _mm256_loadu_ps(x + i);
        vbad |= _mm256_cmp_ps_mask(xf, pinf, _CMP_NLT_UQ);  /* NaN or +inf */
        vlo = _mm256_min_ps(vlo, xf);
        __m512d z = _mm512_sub_pd(_mm512_cvtps_pd(xf), vm);
        __m512d e = lp_exp_gradual8(z);
        vs = _mm512_add_pd(vs, e);
        if (want_d)
            vd = _mm512_add_pd(vd, _mm512_maskz_mul_pd(_mm512_cmp_pd_mask(e, zero, _CMP_GT_OQ), e, z));
    }
    s = _mm512_reduce_add_pd(vs);
    d = _mm512_reduce_add_pd(vd);
    bad = vbad != 0;
    float lanes[8];
    _mm256_storeu_ps(lanes, vlo);
    for (int k = 0; k < 8; k++) lo = lanes[k] < lo ? lanes[k] : lo;
#endif
    for (; i < i1; i++) {
        float xi = x[i];
        bad |= !(xi < INFINITY);
        lo = xi < lo ? xi : lo;
        double z = (double)xi - m, e = lp_exp_gradual(z);
        s += e;
        if (want_d && e > 0) d += e * z;
    }
    *s_out = s; *d_out = d; *lo_out = lo;
    return bad;
}

/* part: n * ceil(V / CHUNK) * 4 doubles, each chunk's (s, d, min, NaN or +inf seen). */
long lp_logit_moments(const float *x, long ldx, long n, long V, const double *m, int want_d, double *out,
                      double *part, int threads) {
    const long nc = (V + CHUNK - 1) / CHUNK, total = n * nc;
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (long w = 0; w < total; w++) {
        long r = w / nc, c = w % nc, i0 = c * CHUNK, i1 = i0 + CHUNK < V ? i0 + CHUNK : V;
        float lo;
        double *p = part + 4 * w;
        p[3] = moments_chunk(x + r * ldx, i0, i1, m[r], want_d, p, p + 1, &lo);
        p[2] = lo;
    }
    long broken = 0;
    for (long r = 0; r < n; r++) {
        const double *p = part + 4 * r * nc;
        double s = 0, d = 0, lo = p[2];
        int b = !(m[r] > -INFINITY && m[r] < INFINITY);
        for (long c = 0; c < nc; c++, p += 4) {
            s += p[0]; d += p[1];
            lo = p[2] < lo ? p[2] : lo;
            b |= p[3] != 0;
        }
        out[3 * r] = b ? NAN : s; out[3 * r + 1] = d; out[3 * r + 2] = lo;
        broken += b;
    }
    return broken;
}
