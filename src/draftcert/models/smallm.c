/* y[M,N] = x[M,K] @ W[N,K]^T (+ bias) for a few rows M (1..SMALLM_MAX_ROWS), streaming W once.
 *
 * Why: at batch 1 a verification pass of M = 2..9 rows is bound by reading the weights, yet BLAS
 * kernels for a small M re-pack or re-read W once M passes 3 or 4 (2-3x the cost of one row on
 * some CPUs).  Here W is packed once as [ceil(N/BW)][K][BW] (BW = NV vector widths of output
 * columns), so a block of BW outputs is one contiguous stream: for every k, NV vector loads of W
 * feed M * NV fused multiply-adds into register accumulators (x[m, k] broadcast), and nothing is
 * written until the block ends.  A software prefetch PF floats ahead (to L2) keeps the stream ahead
 * of the arithmetic, which the hardware prefetcher alone did not on the CPUs measured.
 * Blocks are split over OpenMP threads (torch's own runtime when loaded into a torch process).
 *
 * Built by draftcert.models.smallm with -O3 -march=native; the vector width follows the target. */
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__)
#define VW 16
#define NV 2
#elif defined(__AVX__)
#define VW 8
#define NV 1
#else
#define VW 4
#define NV 1
#endif
#define BW (NV * VW)
#define SMALLM_MAX_ROWS 16
#ifndef PF
#define PF 2048
#endif
typedef float vf __attribute__((vector_size(VW * 4), aligned(4)));

int dc_block_width(void) { return BW; }
int dc_max_rows(void) { return SMALLM_MAX_ROWS; }

static inline __attribute__((always_inline)) void
block(const float *restrict xt, long K, const float *restrict wp, float *restrict y, long N, long n0,
      const float *restrict bias, const int M)
{
    vf acc[SMALLM_MAX_ROWS][NV];
#pragma GCC unroll 16
    for (int m = 0; m < M; m++)
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) acc[m][v] = (vf){0};
    for (long k = 0; k < K; k++) {
        const float *w = wp + k * BW;
#pragma GCC unroll 4
        for (int line = 0; line < BW; line += 16) __builtin_prefetch(w + PF + line, 0, 1);
        vf wv[NV];
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) wv[v] = *(const vf *)(w + v * VW);
#pragma GCC unroll 16
        for (int m = 0; m < M; m++) {
            float xv = xt[k * M + m];
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++) acc[m][v] += xv * wv[v];
        }
    }
    long width = N - n0 < BW ? N - n0 : BW;
    for (int m = 0; m < M; m++) {
        float t[BW];
        memcpy(t, acc[m], sizeof t);
        if (bias)
            for (long j = 0; j < width; j++) t[j] += bias[n0 + j];
        memcpy(y + m * N + n0, t, width * sizeof(float));
    }
}

#define ROWS(MM)                                                                                 \
    case MM:                                                                                     \
        _Pragma("omp for schedule(static)")                                                      \
        for (long b = 0; b < nb; b++) block(xt, K, wp + b * K * BW, y, N, b * BW, bias, MM);      \
        break;

/* x: [M, K] row-major; wp: W packed as [ceil(N/BW)][K][BW] (zero padded); bias: [N] or NULL;
 * y: [M, N] row-major, written.  Returns 0, -1 when M is out of range, -2 when out of memory. */
int dc_linear(const float *x, long M, long K, const float *wp, long N, const float *bias, float *y, int threads)
{
    long nb = (N + BW - 1) / BW;
    if (M < 1 || M > SMALLM_MAX_ROWS) return -1;
    if (threads < 1 || nb < 2) threads = 1;
    /* one copy of x transposed to [K][M] per thread: the M values broadcast at step k share one or
     * two cache lines, read in order from the thread's own cache */
    size_t each = (size_t)K * M;
    float stack[16384];
    float *all = each * threads <= sizeof stack / sizeof *stack ? stack : malloc(each * threads * sizeof(float));
    if (!all) return -2;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#ifdef _OPENMP
        float *xt = all + each * omp_get_thread_num();
#else
        float *xt = all;
#endif
        for (long m = 0; m < M; m++)
            for (long k = 0; k < K; k++) xt[k * M + m] = x[m * K + k];
        switch (M) {
            ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
            ROWS(9) ROWS(10) ROWS(11) ROWS(12) ROWS(13) ROWS(14) ROWS(15) ROWS(16)
        }
    }
    if (all != stack) free(all);
    return 0;
}
