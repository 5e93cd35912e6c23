/* y[M,N] = x[M,K] @ W[N,K]^T (+ bias) for a few rows M (1..PM_MAX_ROWS), streaming W once.
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
 * Built by draftcert.kernels.packed_matmul (draftcert.native, plus -ffp-contract=fast: the vector
 * acc += w * x below is one fused multiply-add); the vector width follows the target. */
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__)
#define VW 16
#define NREGS 32
#elif defined(__AVX__)
#define VW 8
#define NREGS 16
#else
#define VW 4
#define NREGS 16
#endif
#define NV 2 /* vectors of output columns per block */
/* accumulators allowed past the register file before a block is split by vector: a spill or two
 * (AVX2, 8-9 rows) cost less than reading the block twice (measured with bench_packed_matmul.py built
 * with -mno-avx512f: 9 rows 1.37 vs 1.49 one row) */
#define SPILL 2
#define BW (NV * VW)
#define PM_MAX_ROWS 16
#ifndef PF
#define PF 2048
#endif
typedef float vf __attribute__((vector_size(VW * 4), aligned(4)));

int pm_block_width(void) { return BW; }
int pm_max_rows(void) { return PM_MAX_ROWS; }

/* Columns [v0 * VW, (v0 + nv) * VW) of one block, for M rows: M * nv accumulators in registers. */
static inline __attribute__((always_inline)) void
block(const float *restrict xt, long K, const float *restrict wp, float *restrict y, long N, long n0,
      const float *restrict bias, const int M, const int nv, const int v0)
{
    vf acc[PM_MAX_ROWS][NV];
#pragma GCC unroll 16
    for (int m = 0; m < M; m++)
#pragma GCC unroll 4
        for (int v = 0; v < nv; v++) acc[m][v] = (vf){0};
    for (long k = 0; k < K; k++) {
        const float *w = wp + k * BW;
        if (v0 == 0) {
#pragma GCC unroll 4
            for (int line = 0; line < BW; line += 16) __builtin_prefetch(w + PF + line, 0, 1);
        }
        vf wv[NV];
#pragma GCC unroll 4
        for (int v = 0; v < nv; v++) wv[v] = *(const vf *)(w + (v0 + v) * VW);
#pragma GCC unroll 16
        for (int m = 0; m < M; m++) {
            float xv = xt[k * M + m];
#pragma GCC unroll 4
            for (int v = 0; v < nv; v++) acc[m][v] += xv * wv[v];
        }
    }
    long c0 = n0 + v0 * VW, width = N - c0 < nv * VW ? N - c0 : nv * VW;
    for (int m = 0; m < M; m++) {
        float t[BW];
        memcpy(t, acc[m], nv * VW * sizeof(float));
        if (bias)
            for (long j = 0; j < width; j++) t[j] += bias[c0 + j];
        if (width > 0) memcpy(y + m * N + c0, t, width * sizeof(float));
    }
}

/* A whole block: all NV vectors at once while the M * NV accumulators (about) fit in the registers,
 * else one vector of columns at a time (the block's lines, read from memory by the first, come from
 * this core's cache for the others). */
static inline __attribute__((always_inline)) void
whole_block(const float *restrict xt, long K, const float *restrict wp, float *restrict y, long N, long n0,
            const float *restrict bias, const int M)
{
    if (M * NV <= NREGS + SPILL) {
        block(xt, K, wp, y, N, n0, bias, M, NV, 0);
    } else {
#pragma GCC unroll 4
        for (int v0 = 0; v0 < NV; v0++) block(xt, K, wp, y, N, n0, bias, M, 1, v0);
    }
}

#define ROWS(MM)                                                                                 \
    case MM:                                                                                     \
        _Pragma("omp for schedule(static)")                                                      \
        for (long b = 0; b < nb; b++) whole_block(xt, K, wp + b * K * BW, y, N, b * BW, bias, MM); \
        break;

/* x: [M, K] row-major; wp: W packed as [ceil(N/BW)][K][BW] (zero padded); bias: [N] or NULL;
 * y: [M, N] row-major, written.  Returns 0, -1 when M is out of range, -2 when out of memory. */
int pm_linear(const float *x, long M, long K, const float *wp, long N, const float *bias, float *y, int threads)
{
    long nb = (N + BW - 1) / BW;
    if (M < 1 || M > PM_MAX_ROWS) return -1;
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
