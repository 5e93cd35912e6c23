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
 * Threads: the linear layers and the attention split their work over OpenMP threads, and so does the
 * per-row work (norms, rotary, the activation, the residual adds) where it is large (DL_PARALLEL_FLOATS:
 * a prefill's, a batch's); below, one row's norm (~1 us) costs less than waking them.  Each row is computed alone, so
 * the bits are the same however the rows are split.  dl_layers allocates its scratch once for every
 * layer: a prefill's [M, 2 inter] floats are tens of MB, which allocated per layer would be fresh pages
 * each time, faulted in and zeroed by the kernel.  Built by draftcert.native with -ffp-contract=off;
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
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; i + 16 <= n; i += 16) {
        const __m512 x = _mm512_loadu_ps(g + i);
        const __m512 a = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)); /* -|g|: exact */
        __m512 ev = _mm512_insertf32x8(_mm512_castps256_ps512(exp8(_mm512_castps512_ps256(a))),
                                       exp8(_mm512_extractf32x8_ps(a, 1)), 1);
        const __mmask16 low = _mm512_cmp_ps_mask(a, _mm512_set1_ps(-104.0f), _CMP_LT_OQ);
        if (low) {
            _mm512_storeu_ps(e, ev);
            for (int l = 0; l < 16; l++) if ((low >> l) & 1) e[l] = expf(a[l]); /* ra_expf outside [-104, 0] */
            ev = _mm512_loadu_ps(e);
        }
        /* the scalar tail's operations lane by lane, each rounded alone: d = 1 + e, s = (g >= 0 ? 1 : e) / d
         * (one correctly rounded division either way; NaN >= 0 is false in both), y = (g s) u */
        const __m512 d = _mm512_add_ps(one, ev);
        const __mmask16 nonneg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ);
        const __m512 sv = _mm512_div_ps(_mm512_mask_blend_ps(nonneg, ev, one), d);
        _mm512_storeu_ps(y + i, _mm512_mul_ps(_mm512_mul_ps(x, sv), _mm512_loadu_ps(u + i)));
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

/* The per-row work over M rows of `width` floats is split over the threads from DL_PARALLEL_FLOATS floats
 * on (~30 us of the activation: a prefill's, a batch's, the pair target's MLP from 4 rows): below, waking
 * the threads costs about what the split saves. */
#define DL_PARALLEL_FLOATS (1L << 15)
#define DL_ROWS_OMP(M, width, threads) \
    num_threads(threads) if ((threads) > 1 && (M) > 1 && (M) * (width) >= DL_PARALLEL_FLOATS) schedule(static)

/* A layer pass's scratch, for M rows of the largest plan (dl_scratch_new); causal: a [T, S] mask or NULL. */
typedef struct {
    float *x, *tmp, *a, *y, *gu, *u;
    uint8_t *causal;
} dl_scratch;

static void dl_scratch_free(dl_scratch *w)
{
    free(w->x), free(w->tmp), free(w->a), free(w->y), free(w->gu), free(w->u), free(w->causal);
    memset(w, 0, sizeof *w);
}

/* Scratch for M rows of every plan in plans[0 .. L): x, y [M, hidden], tmp [M, the widest q/k/v call]
 * (split q/k/v only), a [M, H D], gu [M, 2 inter], u [M, inter]; and where T > 1 the causal [T, S] mask
 * (row i sees keys j <= S - T + i).  Returns 0, or -2 when out of memory (w freed). */
static int dl_scratch_new(const dl_plan *const *plans, long L, long M, long T, long S, dl_scratch *w)
{
    long hid = 1, tmp = 0, hd = 1, inter = 1;
    memset(w, 0, sizeof *w);
    for (long l = 0; l < L; l++) {
        const dl_plan *p = plans[l];
        hid = p->hidden > hid ? p->hidden : hid;
        hd = p->heads * p->head_dim > hd ? p->heads * p->head_dim : hd;
        inter = p->inter > inter ? p->inter : inter;
        for (long c = 0; p->n_qkv > 1 && c < p->n_qkv; c++) tmp = p->qkv[c].n > tmp ? p->qkv[c].n : tmp;
    }
    w->x = malloc(sizeof(float) * (size_t)(M * hid)), w->y = malloc(sizeof(float) * (size_t)(M * hid));
    w->a = malloc(sizeof(float) * (size_t)(M * hd)), w->gu = malloc(sizeof(float) * (size_t)(M * 2 * inter));
    w->u = malloc(sizeof(float) * (size_t)(M * inter));
    w->tmp = tmp ? malloc(sizeof(float) * (size_t)(M * tmp)) : NULL;
    w->causal = T > 1 ? malloc((size_t)(T * S)) : NULL;
    if (!w->x || !w->y || !w->a || !w->gu || !w->u || (tmp && !w->tmp) || (T > 1 && !w->causal)) {
        dl_scratch_free(w);
        return -2;
    }
    for (long i = 0; i < T && T > 1; i++)
        for (long j = 0; j < S; j++) w->causal[i * S + j] = j <= S - T + i;
    return 0;
}

/* h [M, hidden]; cos, sin_signed [M, D] (each row's position); qkv [M, (H + 2 Hkv) D] out.  Returns
 * 0, -1 for a plan the kernels refuse, -2 when out of memory.  dl_qkv_ws: on the scratch w; dl_qkv
 * allocates one for the call. */
static int dl_qkv_ws(const dl_plan *p, const float *h, long M, const float *cos, const float *sin_signed, float *qkv,
                     int threads, dl_scratch *w)
{
    const long hid = p->hidden, D = p->head_dim, H = p->heads, Hkv = p->kv_heads, nt = (H + 2 * Hkv) * D;
    if (D > 512 || D % 2 || p->n_qkv < 1 || p->n_qkv > 3) return -1;
    float *x = w->x;
#pragma omp parallel for DL_ROWS_OMP(M, hid, threads)
    for (long m = 0; m < M; m++) dl_rms_row(h + m * hid, p->norm_in, p->eps_in, hid, x + m * hid);
    int rc = 0;
    if (p->n_qkv == 1) {
        rc = p->qkv[0].n == nt ? dl_lin(&p->qkv[0], x, M, qkv, threads) : -1;
    } else {
        long col = 0;
        for (long c = 0; c < p->n_qkv && !rc; c++) {
            const long n = p->qkv[c].n;
            rc = col + n <= nt ? dl_lin(&p->qkv[c], x, M, w->tmp, threads) : -1;
            if (!rc)
                for (long m = 0; m < M; m++) memcpy(qkv + m * nt + col, w->tmp + m * n, sizeof(float) * (size_t)n);
            col += n;
        }
        if (!rc && col != nt) rc = -1;
    }
    if (rc) return rc;
#pragma omp parallel for DL_ROWS_OMP(M, nt, threads)
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

DL_API int dl_qkv(const dl_plan *p, const float *h, long M, const float *cos, const float *sin_signed, float *qkv,
                  int threads)
{
    dl_scratch w;
    if (dl_scratch_new(&p, 1, M, 1, 1, &w)) return -2;
    const int rc = dl_qkv_ws(p, h, M, cos, sin_signed, qkv, threads, &w);
    dl_scratch_free(&w);
    return rc;
}

/* h [B * T, hidden] in place; qkv from dl_qkv (rows b * T + i); k, v: the cache after the append,
 * [B, Hkv, S, D] with strides (kb, kh, ks) / (vb, vh, vs), the T new rows its last; mask [B, T, S]
 * bytes with strides (mb, mm), nonzero = may attend; NULL: causal (row i sees keys j <= S - T + i).
 * Returns 0, -1 for a plan the kernels refuse, -2 when out of memory.  dl_attn_mlp_ws: the same on the
 * scratch w (mask NULL and T > 1: w's causal mask); dl_attn_mlp allocates one for the call. */
static int dl_attn_mlp_ws(const dl_plan *p, float *h, long B, long T, const float *qkv, const float *k, long kb,
                          long kh, long ks, const float *v, long vb, long vh, long vs, long S, const uint8_t *mask,
                          long mb, long mm, float scale, int threads, dl_scratch *w)
{
    const long hid = p->hidden, D = p->head_dim, H = p->heads, Hkv = p->kv_heads, I = p->inter, M = B * T;
    const long nt = (H + 2 * Hkv) * D;
    if (S < T || p->o.n != hid || p->o.k != H * D || p->down.n != hid || p->down.k != I) return -1;
    if (!mask && T > 1) /* one [T, S] causal mask shared by the batch */
        mask = w->causal, mb = 0, mm = S;
    float *a = w->a, *y = w->y, *x = w->x, *gu = w->gu, *u = w->u;
    /* q[b, head, i] at qkv + (b T + i) nt + head D */
    int rc = ra_attention(qkv, T * nt, D, nt, k, kb, kh, ks, v, vb, vh, vs, mask, mb, mm, B, H, Hkv, T, S, D, scale, a,
                          threads, 0);
    if (!rc) rc = dl_lin(&p->o, a, M, y, threads);
    if (!rc) {
#pragma omp parallel for DL_ROWS_OMP(M, hid, threads)
        for (long m = 0; m < M; m++) {
            float *hr = h + m * hid;
            const float *yr = y + m * hid;
            for (long i = 0; i < hid; i++) hr[i] = hr[i] + yr[i];
            dl_rms_row(hr, p->norm_post, p->eps_post, hid, x + m * hid);
        }
        const float *g0 = gu, *u0 = gu + I; /* [gate | up] stacked: row m's at gu + m 2I; else gate rows, then up rows */
        long gs = 2 * I;
        if (p->n_gate_up == 1) {
            rc = p->gate_up[0].n == 2 * I ? dl_lin(&p->gate_up[0], x, M, gu, threads) : -1;
        } else if (p->n_gate_up == 2 && p->gate_up[0].n == I && p->gate_up[1].n == I) {
            rc = dl_lin(&p->gate_up[0], x, M, gu, threads);
            if (!rc) rc = dl_lin(&p->gate_up[1], x, M, gu + M * I, threads);
            u0 = gu + M * I, gs = I;
        } else {
            rc = -1;
        }
        if (!rc) {
#pragma omp parallel for DL_ROWS_OMP(M, I, threads)
            for (long m = 0; m < M; m++) dl_silu_mul(g0 + m * gs, u0 + m * gs, I, u + m * I);
        }
    }
    if (!rc) rc = dl_lin(&p->down, u, M, y, threads);
    if (!rc) {
#pragma omp parallel for DL_ROWS_OMP(M, hid, threads)
        for (long m = 0; m < M; m++)
            for (long i = 0; i < hid; i++) h[m * hid + i] = h[m * hid + i] + y[m * hid + i];
    }
    return rc;
}

DL_API int dl_attn_mlp(const dl_plan *p, float *h, long B, long T, const float *qkv, const float *k, long kb, long kh,
                       long ks, const float *v, long vb, long vh, long vs, long S, const uint8_t *mask, long mb,
                       long mm, float scale, int threads)
{
    dl_scratch w;
    if (dl_scratch_new(&p, 1, B * T, mask ? 1 : T, S, &w)) return -2;
    const int rc = dl_attn_mlp_ws(p, h, B, T, qkv, k, kb, kh, ks, v, vb, vh, vs, S, mask, mb, mm, scale, threads, &w);
    dl_scratch_free(&w);
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
    const dl_plan **plans = malloc(sizeof(*plans) * (size_t)(L > 0 ? L : 1));
    if (!plans) return -2;
    for (long l = 0; l < L; l++) {
        const dl_plan *p = plans[l] = (const dl_plan *)(intptr_t)io[l * 10];
        const long nt = (p->heads + 2 * p->kv_heads) * p->head_dim;
        nt_max = nt > nt_max ? nt : nt_max;
    }
    dl_scratch w; /* one for every layer (the file's comment); every layer's n the same, so one causal mask */
    const long S = L > 0 ? io[9] + T : T;
    float *qkv = malloc(sizeof(float) * (size_t)(B * T * (nt_max > 0 ? nt_max : 1)));
    int rc = qkv && !dl_scratch_new(plans, L, B * T, mask ? 1 : T, S, &w) ? 0 : -2;
    free(plans);
    if (rc) {
        free(qkv);
        return rc;
    }
    for (long l = 0; l < L && !rc; l++) {
        const int64_t *r = io + l * 10;
        const dl_plan *p = (const dl_plan *)(intptr_t)r[0];
        float *k = (float *)(intptr_t)r[1], *v = (float *)(intptr_t)r[2];
        const long kb = r[3], kh = r[4], ks = r[5], vb = r[6], vh = r[7], vs = r[8], n = r[9];
        const long D = p->head_dim, H = p->heads, Hkv = p->kv_heads, nt = (H + 2 * Hkv) * D;
        rc = dl_qkv_ws(p, h, B * T, cos, sin_signed, qkv, threads, &w);
        for (long b = 0; b < B && !rc; b++)
            for (long t = 0; t < T; t++)
                for (long g = 0; g < Hkv; g++) {
                    const float *src = qkv + (b * T + t) * nt + (H + g) * D;
                    memcpy(k + b * kb + g * kh + (n + t) * ks, src, sizeof(float) * (size_t)D);
                    memcpy(v + b * vb + g * vh + (n + t) * vs, src + Hkv * D, sizeof(float) * (size_t)D);
                }
        if (!rc && !mask && T > 1 && n + T != S) rc = -1; /* the shared causal mask: every layer's n the same */
        if (!rc)
            rc = dl_attn_mlp_ws(p, h, B, T, qkv, k, kb, kh, ks, v, vb, vh, vs, n + T, mask, mb, mm, (float)scale[l],
                                threads, &w);
    }
    free(qkv);
    dl_scratch_free(&w);
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
 *   q[vocab[j]] = z[j], q[i] = t - spread elsewhere    [nr, V]  (q non-NULL, V_d < V: EagleDrafter.full_logits)
 * e, f [B T, hidden] with row strides se, sf (floats).  The tail's dot product sums w_t[i] g[i] in double,
 * i increasing, then rounds to float and adds b_t; the cap is evaluated in float32, operation by operation,
 * as the torch expression of EagleDrafter.capped_tail (spread: float32 log(V - V_d), eps: float32's, 2^-23).
 * Returns 0, -1 for a plan the kernels refuse, -2 when out of memory. */
DL_API int dl_feature_step(const dl_linear *fc, const int64_t *io, double scale, const float *e, long se,
                           const float *f, long sf, long B, long T, const float *cos, const float *sin_signed,
                           const uint8_t *mask, long mb, long mm, long last, const float *w_norm, float eps,
                           const dl_linear *head, const float *w_tail, const float *b_tail, long width, float spread,
                           float *g, float *z, float *t, const int64_t *vocab, long V, float *q, int threads)
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
    q8_stream_weights = 0; /* the drafter's weights are read again next step: keep them cached (block_matmul.c) */
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
    for (long r = 0; r < nr && !rc && q && width > 0; r++) { /* every token outside the draft vocabulary: t - spread */
        float *qr = q + r * V;
        const float fill = t[r] - spread, *zr = z + r * Vd;
        for (long i = 0; i < V; i++) qr[i] = fill;
        for (long j = 0; j < Vd; j++) qr[vocab[j]] = zr[j];
    }
    q8_stream_weights = 1;
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
