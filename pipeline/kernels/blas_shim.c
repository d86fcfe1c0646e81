/* pipeline's BLAS shim: loaded ahead of OpenBLAS, so MLX's calls to cblas_sgemm land here first.
 *
 * 1. Batch-invariant products. For up to INVARIANT_MAX_ROWS rows of A times a row-major weight
 *    matrix W taken transposed (MLX's `x @ w.T`, every Linear layer and the LM head), each output
 *    element c[i][j] is one fixed sequence of float operations on row i of A and row j of W: eight
 *    lanes of FMAs over k, then the same pairwise sum of the lanes, then the same tail. It does not
 *    depend on how many rows share the call, nor on where row i sits in it. OpenBLAS picks different
 *    kernels, and so different roundings, by row count (1, 4 and 16 rows of the same input round
 *    differently), which would make a sequence's greedy text depend on what else is in its batch.
 *    Column blocks are spread over the BLAS's own thread count (OpenMP); the split does not change
 *    any element's arithmetic either. With AVX-512 a 16-lane register carries two elements' 8 lanes
 *    (twice the FMAs per instruction, the very same roundings: a node with AVX-512 and one without
 *    give the same bits), and the next block of W is prefetched while one is computed.
 * 2. One-row products in other layouts go to sgemv (OpenBLAS before 0.3.27 runs them as a full
 *    GEMM that packs the whole weight matrix: 2x slower).
 * 3. Everything else (prompt chunks of more rows, other layouts) goes on to the BLAS's sgemm.
 *
 * Compiled once per machine and CPU (-march=native) into $PIPELINE_CACHE/blas/ by pipeline/kernels/build.py;
 * pipeline/kernels/blas.py loads it.
 */
#include <dlfcn.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define INVARIANT_MAX_ROWS 64
#define COLUMN_BLOCK 48 /* columns of W per task: a multiple of every tile width below (8, 6, 4, 3) */

typedef void (*sgemm_t)(int, int, int, int, int, int, float, const float *, int, const float *, int, float,
                        float *, int);
typedef void (*sgemv_t)(int, int, int, int, float, const float *, int, const float *, int, float, float *, int);
static sgemm_t real_sgemm;
static sgemv_t real_sgemv;
static int (*blas_threads)(void);

int pipeline_invariant_max_rows(void) { return INVARIANT_MAX_ROWS; }

int pipeline_shim_init(void *handle) {
    real_sgemm = (sgemm_t)dlsym(handle, "cblas_sgemm");
    real_sgemv = (sgemv_t)dlsym(handle, "cblas_sgemv");
    blas_threads = (int (*)(void))dlsym(handle, "openblas_get_num_threads");
    return real_sgemm && real_sgemv;
}

/* ---- the batch-invariant kernel ------------------------------------------------------------------ */

typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Keeps a loaded vector in a register: otherwise the compiler folds the load into each FMA that
   uses it, and loads, not FMAs, bound the tile. Changes no arithmetic. */
static inline v8 in_register(v8 v) {
#if defined(__GNUC__) && defined(__AVX__)
    __asm__("" : "+x"(v));
#endif
    return v;
}

/* acc + a*b, lane by lane: one rounding with FMA hardware, else two (built with -ffp-contract=off, so
   the compiler never fuses some of these and not others). */
#if defined(__FMA__) && defined(__AVX__)
#include <immintrin.h>
static inline v8 fma8(v8 a, v8 b, v8 acc) { return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)acc); }
#else
static inline v8 fma8(v8 a, v8 b, v8 acc) { return acc + a * b; }
#endif

/* The end of every element's dot product: lanes summed pairwise, then the k % 8 tail in order. */
static inline float finish(v8 acc, const float *a, const float *w, int k8, int k) {
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (int t = k8; t < k; t++) s = s + a[t] * w[t];
    return s;
}

static inline void store(float *c, float s, float alpha, float beta) {
    *c = beta == 0.0f ? alpha * s : alpha * s + beta * *c;
}

/* While `lines` is left: the next cache line of each of `rows` rows of W from `next` on (a block
   ahead, see invariant_gemm), into L2, one line a k step. */
static inline void fetch_ahead(const float **next, int *lines, int rows, int ldw) {
    if (*lines > 0) {
        for (int q = 0; q < rows; q++) __builtin_prefetch(*next + (long)q * ldw, 0, 2);
        *next += 16, (*lines)--;
    }
}

/* A ROWS x COLS tile of C: rows of A times rows of W, ROWS*COLS independent accumulators. */
#define TILE(ROWS, COLS)                                                                                       \
    static void tile_##ROWS##x##COLS(int k, const float *a, int lda, const float *w, int ldw, float *c, int ldc, \
                                 float alpha, float beta, const float *next, int lines) {                  \
        v8 acc[ROWS][COLS];                                                                                    \
        memset(acc, 0, sizeof acc);                                                                        \
        const int k8 = k & ~7;                                                                             \
        for (int t = 0; t < k8; t += 8) {                                                                  \
            fetch_ahead(&next, &lines, COLS, ldw);                                                         \
            v8 wt[COLS];                                                                                   \
            for (int q = 0; q < COLS; q++) wt[q] = in_register(load8(w + (long)q * ldw + t));               \
            for (int r = 0; r < ROWS; r++) {                                                                 \
                v8 at = load8(a + (long)r * lda + t);                                                      \
                for (int q = 0; q < COLS; q++) acc[r][q] = fma8(at, wt[q], acc[r][q]);                       \
            }                                                                                              \
        }                                                                                                  \
        for (int r = 0; r < ROWS; r++)                                                                       \
            for (int q = 0; q < COLS; q++)                                                                   \
                store(c + (long)r * ldc + q, finish(acc[r][q], a + (long)r * lda, w + (long)q * ldw, k8, k), \
                      alpha, beta);                                                                        \
    }
/* Tiles by the number of rows left: as tall and wide as the vector registers allow (32 on arm64,
   16 with AVX2; AVX-512 below), one row 8 columns wide (a matrix-vector product streaming 8 rows of
   W). `next`/`lines`: W lines to prefetch meanwhile (see invariant_gemm). COLUMN_BLOCK must be a
   multiple of every width. */
typedef void (*tile_fn)(int, const float *, int, const float *, int, float *, int, float, float, const float *, int);
TILE(1, 8)
TILE(1, 1)
TILE(2, 4)
TILE(2, 1)
TILE(3, 1)
TILE(4, 1)
#if defined(__AVX512F__)
/* With AVX-512: one 16-lane register holds the 8 lanes of two columns' dot products, so each FMA
   instruction does the work of two while every element keeps exactly the 8-lane arithmetic above
   (results are bit-identical to the 8-lane tiles, on this machine and on one without AVX-512).
   A row's 8 values are broadcast to both halves; W's two rows are loaded into the halves. */
typedef float v16 __attribute__((vector_size(64)));
static inline v16 pair_rows(const float *w0, const float *w1) {
    return (v16)_mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(w0)), _mm256_loadu_ps(w1), 1);
}
static inline v16 both_halves(const float *a) { return (v16)_mm512_broadcast_f32x8(_mm256_loadu_ps(a)); }
static inline v16 fma16(v16 a, v16 b, v16 acc) { return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)acc); }
static inline v8 low_half(v16 v) { return (v8)_mm512_castps512_ps256((__m512)v); }
static inline v8 high_half(v16 v) { return (v8)_mm512_extractf32x8_ps((__m512)v, 1); }

#define PAIR_TILE(ROWS, PAIRS)                                                                                 \
    static void tile_##ROWS##x##PAIRS##p(int k, const float *a, int lda, const float *w, int ldw, float *c,     \
                                         int ldc, float alpha, float beta, const float *next, int lines) {    \
        v16 acc[ROWS][PAIRS];                                                                                  \
        memset(acc, 0, sizeof acc);                                                                        \
        const int k8 = k & ~7;                                                                             \
        for (int t = 0; t < k8; t += 8) {                                                                  \
            fetch_ahead(&next, &lines, 2 * PAIRS, ldw);                                                    \
            v16 wt[PAIRS];                                                                                 \
            for (int p = 0; p < PAIRS; p++)                                                                  \
                wt[p] = pair_rows(w + (long)(2 * p) * ldw + t, w + (long)(2 * p + 1) * ldw + t);           \
            for (int r = 0; r < ROWS; r++) {                                                                 \
                v16 at = both_halves(a + (long)r * lda + t);                                               \
                for (int p = 0; p < PAIRS; p++) acc[r][p] = fma16(at, wt[p], acc[r][p]);                     \
            }                                                                                              \
        }                                                                                                  \
        for (int r = 0; r < ROWS; r++)                                                                       \
            for (int p = 0; p < PAIRS; p++) {                                                                \
                const float *ar = a + (long)r * lda, *w0 = w + (long)(2 * p) * ldw;                          \
                store(c + (long)r * ldc + 2 * p, finish(low_half(acc[r][p]), ar, w0, k8, k), alpha, beta);   \
                store(c + (long)r * ldc + 2 * p + 1, finish(high_half(acc[r][p]), ar, w0 + ldw, k8, k), alpha,    \
                      beta);                                                                               \
            }                                                                                              \
    }
#define MR 8
PAIR_TILE(2, 3)
PAIR_TILE(3, 3)
PAIR_TILE(4, 3)
PAIR_TILE(5, 3)
PAIR_TILE(6, 3)
PAIR_TILE(7, 3)
PAIR_TILE(8, 3)
TILE(5, 1)
TILE(6, 1)
TILE(7, 1)
TILE(8, 1)
static const tile_fn wide[MR + 1] = {0,         tile_1x8,  tile_2x3p, tile_3x3p, tile_4x3p,
                                     tile_5x3p, tile_6x3p, tile_7x3p, tile_8x3p};
static const int width[MR + 1] = {0, 8, 6, 6, 6, 6, 6, 6, 6};
static const tile_fn narrow[MR + 1] = {0,        tile_1x1, tile_2x1, tile_3x1, tile_4x1,
                                       tile_5x1, tile_6x1, tile_7x1, tile_8x1};
#elif defined(__aarch64__)
#define MR 6
TILE(3, 4)
TILE(4, 4)
TILE(5, 4)
TILE(6, 4)
TILE(5, 1)
TILE(6, 1)
static const tile_fn wide[MR + 1] = {0, tile_1x8, tile_2x4, tile_3x4, tile_4x4, tile_5x4, tile_6x4};
static const int width[MR + 1] = {0, 8, 4, 4, 4, 4, 4};
static const tile_fn narrow[MR + 1] = {0, tile_1x1, tile_2x1, tile_3x1, tile_4x1, tile_5x1, tile_6x1};
#else
#define MR 4
TILE(3, 3)
TILE(4, 3)
static const tile_fn wide[MR + 1] = {0, tile_1x8, tile_2x4, tile_3x3, tile_4x3};
static const int width[MR + 1] = {0, 8, 4, 3, 3};
static const tile_fn narrow[MR + 1] = {0, tile_1x1, tile_2x1, tile_3x1, tile_4x1};
#endif

/* c[m][n] = alpha * a[m][k] . w[n][k]^T + beta * c, rows of A and W contiguous. */
static void invariant_gemm(int m, int n, int k, float alpha, const float *a, int lda, const float *w, int ldw,
                           float beta, float *c, int ldc) {
    const int blocks = (n + COLUMN_BLOCK - 1) / COLUMN_BLOCK;
    int threads = blas_threads ? blas_threads() : 1;
    if ((long)m * n * k < (1L << 18)) threads = 1; /* too small to be worth waking threads */
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int b = 0; b < blocks; b++) {
        const int j0 = b * COLUMN_BLOCK, j1 = j0 + COLUMN_BLOCK < n ? j0 + COLUMN_BLOCK : n;
        const int groups = (m + MR - 1) / MR;
        for (int i = 0; i < m;) {
            const int rows = m - i < MR ? m - i : MR, cols = width[rows], g = i / MR;
            const float *ai = a + (long)i * lda;
            float *ci = c + (long)i * ldc;
            /* While it computes this block, each row group fetches its share of the next block's W
               (1/groups of each row) into cache, so that no pass over a block waits for memory. One
               row (a matrix-vector product) is memory-bound: the hardware prefetcher does as well. */
            const int lo = (int)((long)g * k / groups) & ~15;
            const int hi = g == groups - 1 ? k : (int)((long)(g + 1) * k / groups) & ~15;
            int j = j0;
            for (; j + cols <= j1; j += cols) {
                const int ahead = m > 1 && j + COLUMN_BLOCK + cols <= n;
                wide[rows](k, ai, lda, w + (long)j * ldw, ldw, ci + j, ldc, alpha, beta,
                           ahead ? w + (long)(j + COLUMN_BLOCK) * ldw + lo : 0, ahead ? (hi - lo + 15) / 16 : 0);
            }
            for (; j < j1; j++) narrow[rows](k, ai, lda, w + (long)j * ldw, ldw, ci + j, ldc, alpha, beta, 0, 0);
            i += rows;
        }
    }
}

/* ---- the entry point MLX calls ------------------------------------------------------------------- */

enum { RowMajor = 101, NoTrans = 111, Trans = 112 };

void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, const float *a, int lda,
                 const float *b, int ldb, float beta, float *c, int ldc) {
    if (order == RowMajor && ta == NoTrans && tb != NoTrans && m <= INVARIANT_MAX_ROWS && n > 1 && k > 0) {
        invariant_gemm(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc); /* x @ w.T */
        return;
    }
    if (order == RowMajor && m == 1 && n > 1) { /* c[1,n] = a[1,k] op(b)[k,n]: a row times b */
        /* op(b) = b (k x n): c = b^T a; op(b) = b^T (b is n x k): c = b a. a's k values lie 1 apart, or lda (ta). */
        real_sgemv(RowMajor, tb == NoTrans ? Trans : NoTrans, tb == NoTrans ? k : n, tb == NoTrans ? n : k, alpha, b,
                   ldb, a, ta == NoTrans ? 1 : lda, beta, c, 1);
        return;
    }
    if (order == RowMajor && n == 1 && m > 1) { /* c[m,1] = op(a)[m,k] b[k,1] */
        real_sgemv(RowMajor, ta == NoTrans ? NoTrans : Trans, ta == NoTrans ? m : k, ta == NoTrans ? k : m, alpha, a,
                   lda, b, tb == NoTrans ? ldb : 1, beta, c, ldc);
        return;
    }
    real_sgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
