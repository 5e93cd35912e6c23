/* One Llama / Qwen2 / Qwen3 decoder layer under the contract "gguf-q8", computed natively in two calls.
 *
 *   dl_qkv:       x = rms(h; w_in)                                             [M, hidden]
 *                 [q | k | v] = x [Wq; Wk; Wv]^T (+ b)                        [M, (H + 2 Hkv) D]
 *                 (Qwen3: q, k = rms(q; w_q), rms(k; w_k) over each head's D values)
 *                 q, k = q cos + roll(q, D/2) sin', k cos + roll(k, D/2) sin'  (sin': sin, first half negated)
 *   (the caller appends k and v to its KV cache)
 *   dl_attn_mlp:  a = attention(q, K, V, mask)                                 [M, H D]  (row_attention.c)
 *                 h = h + a Wo^T (+ b)
 *                 x = rms(h; w_post)
 *                 h = h + (silu(x Wg^T) * (x Wu^T)) Wd^T
 *
 * Why: a one-row decode step of a small quantised model spends as long in the ~120 small torch
 * operations per layer around the linear kernels (norms, rotary, views, the activation, and the
 * Python that dispatches them) as in the kernels (docs/speed.md).  Here a layer is two calls.
 *
 * Numbers.  Each operation is fixed and per row, so a row's bits depend on nothing but that row (and,
 * in the attention, the keys it may see): a token's logits are the same bits in a verification pass of
 * any size, in a batch, and in the one-row decode step (what strict = greedy needs under 8-bit
 * activations).  They are the same bits on every build of this file.  They are not torch's bits:
 *   - rms(h; w)_i = w_i * (h_i * r), r = 1 / sqrt(var + eps) in float32, var = (float)(s / n) where
 *     s = sum h_i^2 in double (exact products; 8 lanes, lane l summing i = 8 v + l in increasing v,
 *     then ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)), then the tail in order);
 *   - the linear layers are dq8_linear (block_matmul.c), the attention ra_attention (row_attention.c);
 *   - rotary and the residual adds: float32 multiplies and adds each rounded on its own, as torch's
 *     elementwise operations (-ffp-contract=off), so the rotary is torch's bits;
 *   - silu(g) = g * s, s = 1 / (1 + e) for g >= 0 and e / (1 + e) below, e = exp(-|g|) by row_attention's
 *     expf (glibc's on [-104, 0], libm's below); then silu(g) * u.
 * Threads: the linear layers and the attention split their work over OpenMP threads; the rest runs on
 * the calling thread (one row's norm is ~1 us).  Built by draftcert.native with -ffp-contract=off;
 * block_matmul.c and row_attention.c are compiled into the same library (their symbols are hidden:
 * only dl_* is exported). */
#include "../kernels/block_matmul.c"
#include "../kernels/row_attention.c"

#define DL_API __attribute__((visibility("default")))

/* One linear layer's packed "gguf-q8" weight (dq8_pack): y[M, n] = x[M, k] W^T (+ bias). */
typedef struct {
    int64_t qtype;
    const uint8_t *packed;
    int64_t n, k;
    const float *bias; /* NULL: none */
} dl_linear;

/* A layer's weights and shapes (draftcert.forward.native_layer builds it once per layer). */
typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, inter;
    const float *norm_in, *norm_post, *q_norm, *k_norm; /* q_norm, k_norm: NULL without Qwen3's per-head norms */
    float eps_in, eps_post, eps_q, eps_k;
    int64_t n_qkv; /* 1..3 calls covering the columns [q | k | v] in order (stacked siblings: one call) */
    dl_linear qkv[3];
    dl_linear o;
    int64_t n_gate_up; /* 1: gate and up stacked in one call ([gate | up]), 2: gate, then up */
    dl_linear gate_up[2];
    dl_linear down;
} dl_plan;

/* out[i] = w[i] * (h[i] * r), r = 1 / sqrt(var + eps), var = (float)(sum h^2 / n) (the file's comment). */
static void dl_rms_row(const float *h, const float *w, float eps, long n, float *out)
{
    double l[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    long i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) l[j] += (double)h[i + j] * (double)h[i + j];
    double s = ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
    for (; i < n; i++) s += (double)h[i] * (double)h[i];
    const float var = (float)(s / (double)n), r = 1.0f / sqrtf(var + eps);
    for (i = 0; i < n; i++) out[i] = w[i] * (h[i] * r);
}

/* x[D] <- x cos + roll(x, D/2) sin' (sin' = sin with its first half negated, as the caller passes it). */
static void dl_rotary(float *x, const float *cos, const float *sin_signed, long D)
{
    float t[512];
    const long half = D / 2;
    memcpy(t, x, sizeof(float) * (size_t)D);
    for (long j = 0; j < D; j++) {
        const float a = t[j] * cos[j], b = t[j < half ? j + half : j - half] * sin_signed[j];
        x[j] = a + b;
    }
}

/* y[i] = silu(g[i]) * u[i] (the file's comment). */
static void dl_silu_mul(const float *g, const float *u, long n, float *y)
{
    long i = 0;
#if defined(__AVX512F__)
    float e[16];
    for (; i + 16 <= n; i += 16) {
        const __m512 x = _mm512_loadu_ps(g + i);
        const __m512 a = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)); /* -|g|: exact */
        _mm512_storeu_ps(e, _mm512_insertf32x8(_mm512_castps256_ps512(exp8(_mm512_castps512_ps256(a))),
                                               exp8(_mm512_extractf32x8_ps(a, 1)), 1));
        const __mmask16 low = _mm512_cmp_ps_mask(a, _mm512_set1_ps(-104.0f), _CMP_LT_OQ);
        if (low)
            for (int l = 0; l < 16; l++) if ((low >> l) & 1) e[l] = expf(a[l]); /* ra_expf outside [-104, 0] */
        for (int l = 0; l < 16; l++) {
            const float gi = g[i + l], d = 1.0f + e[l], s = gi >= 0.0f ? 1.0f / d : e[l] / d;
            y[i + l] = (gi * s) * u[i + l];
        }
    }
#endif
    for (; i < n; i++) {
        const float gi = g[i], e = ra_expf(-fabsf(gi)), d = 1.0f + e, s = gi >= 0.0f ? 1.0f / d : e / d;
        y[i] = (gi * s) * u[i];
    }
}

static int dl_lin(const dl_linear *L, const float *x, long M, float *y, int threads)
{
    return dq8_linear((int)L->qtype, L->packed, L->n, L->k, x, M, L->bias, y, threads);
}

/* h [M, hidden]; cos, sin_signed [M, D] (each row's position); qkv [M, (H + 2 Hkv) D] out.  Returns
 * 0, -1 for a plan the kernels refuse, -2 when out of memory. */
DL_API int dl_qkv(const dl_plan *p, const float *h, long M, const float *cos, const float *sin_signed, float *qkv,
                  int threads)
{
    const long hid = p->hidden, D = p->head_dim, H = p->heads, Hkv = p->kv_heads, nt = (H + 2 * Hkv) * D;
    if (D > 512 || D % 2 || p->n_qkv < 1 || p->n_qkv > 3) return -1;
    float *x = malloc(sizeof(float) * (size_t)(M * hid));
    if (!x) return -2;
    for (long m = 0; m < M; m++) dl_rms_row(h + m * hid, p->norm_in, p->eps_in, hid, x + m * hid);
    int rc = 0;
    if (p->n_qkv == 1) {
        rc = p->qkv[0].n == nt ? dl_lin(&p->qkv[0], x, M, qkv, threads) : -1;
    } else {
        long col = 0;
        for (long c = 0; c < p->n_qkv && !rc; c++) {
            const long n = p->qkv[c].n;
            float *y = col + n <= nt ? malloc(sizeof(float) * (size_t)(M * n)) : NULL;
            rc = y ? dl_lin(&p->qkv[c], x, M, y, threads) : (col + n <= nt ? -2 : -1);
            if (!rc)
                for (long m = 0; m < M; m++) memcpy(qkv + m * nt + col, y + m * n, sizeof(float) * (size_t)n);
            free(y);
            col += n;
        }
        if (!rc && col != nt) rc = -1;
    }
    free(x);
    if (rc) return rc;
    for (long m = 0; m < M; m++) {
        float *r = qkv + m * nt;
        for (long hh = 0; hh < H + Hkv; hh++) { /* the query heads, then the key heads */
            float *v = r + hh * D;
            if (p->q_norm) {
                float t[512];
                dl_rms_row(v, hh < H ? p->q_norm : p->k_norm, hh < H ? p->eps_q : p->eps_k, D, t);
                memcpy(v, t, sizeof(float) * (size_t)D);
            }
            dl_rotary(v, cos + m * D, sin_signed + m * D, D);
        }
    }
    return 0;
}

/* h [B * T, hidden] in place; qkv from dl_qkv (rows b * T + i); k, v: the cache after the append,
 * [B, Hkv, S, D] with strides (kb, kh, ks) / (vb, vh, vs), the T new rows its last; mask [B, T, S]
 * bytes with strides (mb, mm), nonzero = may attend; NULL: causal (row i sees keys j <= S - T + i).
 * Returns 0, -1 for a plan the kernels refuse, -2 when out of memory. */
DL_API int dl_attn_mlp(const dl_plan *p, float *h, long B, long T, const float *qkv, const float *k, long kb, long kh,
                       long ks, const float *v, long vb, long vh, long vs, long S, const uint8_t *mask, long mb,
                       long mm, float scale, int threads)
{
    const long hid = p->hidden, D = p->head_dim, H = p->heads, Hkv = p->kv_heads, I = p->inter, M = B * T;
    const long nt = (H + 2 * Hkv) * D;
    if (S < T || p->o.n != hid || p->o.k != H * D || p->down.n != hid || p->down.k != I) return -1;
    uint8_t *causal = NULL;
    if (!mask && T > 1) { /* one [T, S] causal mask shared by the batch */
        causal = malloc((size_t)(T * S));
        if (!causal) return -2;
        for (long i = 0; i < T; i++)
            for (long j = 0; j < S; j++) causal[i * S + j] = j <= S - T + i;
        mask = causal, mb = 0, mm = S;
    }
    float *a = malloc(sizeof(float) * (size_t)(M * H * D)), *y = malloc(sizeof(float) * (size_t)(M * hid));
    float *x = malloc(sizeof(float) * (size_t)(M * hid)), *gu = malloc(sizeof(float) * (size_t)(M * 2 * I));
    float *u = malloc(sizeof(float) * (size_t)(M * I));
    int rc = (a && y && x && gu && u) ? 0 : -2;
    if (!rc) /* q[b, head, i] at qkv + (b T + i) nt + head D */
        rc = ra_attention(qkv, T * nt, D, nt, k, kb, kh, ks, v, vb, vh, vs, mask, mb, mm, B, H, Hkv, T, S, D, scale, a,
                          threads, 0);
    if (!rc) rc = dl_lin(&p->o, a, M, y, threads);
    if (!rc) {
        for (long i = 0; i < M * hid; i++) h[i] = h[i] + y[i];
        for (long m = 0; m < M; m++) dl_rms_row(h + m * hid, p->norm_post, p->eps_post, hid, x + m * hid);
        if (p->n_gate_up == 1) {
            rc = p->gate_up[0].n == 2 * I ? dl_lin(&p->gate_up[0], x, M, gu, threads) : -1;
            for (long m = 0; m < M && !rc; m++) dl_silu_mul(gu + m * 2 * I, gu + m * 2 * I + I, I, u + m * I);
        } else if (p->n_gate_up == 2 && p->gate_up[0].n == I && p->gate_up[1].n == I) {
            rc = dl_lin(&p->gate_up[0], x, M, gu, threads);
            if (!rc) rc = dl_lin(&p->gate_up[1], x, M, gu + M * I, threads);
            for (long m = 0; m < M && !rc; m++) dl_silu_mul(gu + m * I, gu + M * I + m * I, I, u + m * I);
        } else {
            rc = -1;
        }
    }
    if (!rc) rc = dl_lin(&p->down, u, M, y, threads);
    if (!rc)
        for (long i = 0; i < M * hid; i++) h[i] = h[i] + y[i];
    free(causal), free(a), free(y), free(x), free(gu), free(u);
    return rc;
}

/* Every layer of a decoder in one call: per layer l, in order, dl_qkv, the append of its T new k and v
 * rows to its cache buffers, dl_attn_mlp: the same operations as the per-layer calls, so the same bits.
 * io [L, 10] int64 per layer: the plan, the key and the value buffer, their strides in floats (batch,
 * head, position: kb, kh, ks, vb, vh, vs), and n, the positions the buffers hold before this pass (the
 * caller reserved n .. n + T - 1, which this call writes); scale [L] the attention's scale; mask as
 * dl_attn_mlp's, for S = n + T (every layer's n the same).  h [B * T, hidden] in place.  Returns 0,
 * -1 for a plan the kernels refuse, -2 when out of memory. */
DL_API int dl_layers(const int64_t *io, long L, const double *scale, float *h, long B, long T, const float *cos,
                     const float *sin_signed, const uint8_t *mask, long mb, long mm, int threads)
{
    long nt_max = 0;
    for (long l = 0; l < L; l++) {
        const dl_plan *p = (const dl_plan *)(intptr_t)io[l * 10];
        const long nt = (p->heads + 2 * p->kv_heads) * p->head_dim;
        nt_max = nt > nt_max ? nt : nt_max;
    }
    float *qkv = malloc(sizeof(float) * (size_t)(B * T * (nt_max > 0 ? nt_max : 1)));
    if (!qkv) return -2;
    int rc = 0;
    for (long l = 0; l < L && !rc; l++) {
        const int64_t *r = io + l * 10;
        const dl_plan *p = (const dl_plan *)(intptr_t)r[0];
        float *k = (float *)(intptr_t)r[1], *v = (float *)(intptr_t)r[2];
        const long kb = r[3], kh = r[4], ks = r[5], vb = r[6], vh = r[7], vs = r[8], n = r[9];
        const long D = p->head_dim, H = p->heads, Hkv = p->kv_heads, nt = (H + 2 * Hkv) * D;
        rc = dl_qkv(p, h, B * T, cos, sin_signed, qkv, threads);
        for (long b = 0; b < B && !rc; b++)
            for (long t = 0; t < T; t++)
                for (long g = 0; g < Hkv; g++) {
                    const float *src = qkv + (b * T + t) * nt + (H + g) * D;
                    memcpy(k + b * kb + g * kh + (n + t) * ks, src, sizeof(float) * (size_t)D);
                    memcpy(v + b * vb + g * vh + (n + t) * vs, src + Hkv * D, sizeof(float) * (size_t)D);
                }
        if (!rc)
            rc = dl_attn_mlp(p, h, B, T, qkv, k, kb, kh, ks, v, vb, vh, vs, n + T, mask, mb, mm, (float)scale[l], threads);
    }
    free(qkv);
    return rc;
}

/* min(tail, (z_(w) + spread) - 8 eps (1 + |z_(w)| + spread)) in float32, operation by operation as the torch
 * expression of EagleDrafter.capped_tail; z_(w): the w-th largest of z[0 .. n) (duplicates counted, as
 * topk's values), 1 <= w <= min(n, 64). */
static float dl_cap(const float *z, long n, float tail, long w, float spread)
{
    float top[64]; /* the w largest so far, descending */
    long have = 0;
    for (long j = 0; j < n; j++) {
        const float v = z[j];
        if (have == w && !(v > top[w - 1])) continue;
        long i = have < w ? have++ : w - 1;
        for (; i > 0 && top[i - 1] < v; i--) top[i] = top[i - 1];
        top[i] = v;
    }
    const float floor = top[w - 1];
    const float margin = (8.0f * 1.1920928955078125e-07f) * ((1.0f + fabsf(floor)) + spread);
    const float cap = (floor + spread) - margin;
    return tail < cap ? tail : cap; /* torch.minimum (finite logits) */
}

/* A feature drafter's step (models/eagle.py) on rows [B, T] in one call:
 *   x = fc([e | f])                      [B T, hidden]   (dq8_linear on each row's concatenation)
 *   x = the drafter's decoder layer (x)  (dl_layers' operations, its one layer: io [10], scale)
 *   g = rms(x; w_norm)                   [nr, hidden]    nr = B T rows, or each sequence's last row (last)
 *   z = g W_d^T                          [nr, V_d]       (dq8_linear: the draft vocabulary's head rows)
 *   t = min(w_t . g + b_t, cap)          [nr]            (V_d < V only; else no cap)
 *   cap = (z_(w) + spread) - 8 eps (1 + |z_(w)| + spread)   z_(w): the w-th largest of the row of z
 * e, f [B T, hidden] with row strides se, sf (floats).  The tail's dot product sums w_t[i] g[i] in double,
 * i increasing, then rounds to float and adds b_t; the cap is evaluated in float32, operation by operation,
 * as the torch expression of EagleDrafter.capped_tail (spread: float32 log(V - V_d), eps: float32's, 2^-23).
 * Returns 0, -1 for a plan the kernels refuse, -2 when out of memory. */
DL_API int dl_feature_step(const dl_linear *fc, const int64_t *io, double scale, const float *e, long se,
                           const float *f, long sf, long B, long T, const float *cos, const float *sin_signed,
                           const uint8_t *mask, long mb, long mm, long last, const float *w_norm, float eps,
                           const dl_linear *head, const float *w_tail, const float *b_tail, long width, float spread,
                           float *g, float *z, float *t, int threads)
{
    const dl_plan *p = (const dl_plan *)(intptr_t)io[0];
    const long hid = p->hidden, M = B * T, nr = last ? B : M, Vd = head->n;
    if (fc->k != 2 * hid || fc->n != hid || head->k != hid || width < 0 || width > 64 || width > Vd) return -1;
    float *ef = malloc(sizeof(float) * (size_t)(M * 2 * hid)), *x = malloc(sizeof(float) * (size_t)(M * hid));
    int rc = (ef && x) ? 0 : -2;
    for (long m = 0; m < M && !rc; m++) {
        memcpy(ef + m * 2 * hid, e + m * se, sizeof(float) * (size_t)hid);
        memcpy(ef + m * 2 * hid + hid, f + m * sf, sizeof(float) * (size_t)hid);
    }
    if (!rc) rc = dl_lin(fc, ef, M, x, threads);
    if (!rc) rc = dl_layers(io, 1, &scale, x, B, T, cos, sin_signed, mask, mb, mm, threads);
    for (long r = 0; r < nr && !rc; r++) /* row r: x's row r, or sequence r's last */
        dl_rms_row(x + (last ? r * T + T - 1 : r) * hid, w_norm, eps, hid, g + r * hid);
    if (!rc) rc = dl_lin(head, g, nr, z, threads);
    for (long r = 0; r < nr && !rc; r++) {
        const float *gr = g + r * hid, *zr = z + r * Vd;
        double s = 0.0;
        for (long i = 0; i < hid; i++) s += (double)w_tail[i] * (double)gr[i];
        float tail = (float)s + *b_tail;
        t[r] = width > 0 ? dl_cap(zr, Vd, tail, width, spread) : tail;
    }
    free(ef), free(x);
    return rc;
}

/* For tests: out[M, n] = rms of each row of h[M, n] with weight w; y[n] = silu(g) * u; out[r] = dl_cap of row r of
 * z[rows, n] and tail[r]. */
DL_API int dl_capped_tail(const float *z, long rows, long n, const float *tail, long w, float spread, float *out)
{
    if (w < 1 || w > 64 || w > n) return -1;
    for (long r = 0; r < rows; r++) out[r] = dl_cap(z + r * n, n, tail[r], w, spread);
    return 0;
}

DL_API int dl_rms(const float *h, const float *w, float eps, long M, long n, float *out)
{
    for (long m = 0; m < M; m++) dl_rms_row(h + m * n, w, eps, n, out + m * n);
    return 0;
}

DL_API int dl_silu(const float *g, const float *u, long n, float *y)
{
    dl_silu_mul(g, u, n, y);
    return 0;
}
