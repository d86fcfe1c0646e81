/* pipeline's quantized matrix products on CPU, as an MLX operation (a custom Primitive).
 *
 * The layout is MLX's affine quantization (mx.quantize): each weight row is a little-endian bit stream
 * of `bits`-bit integers q packed in uint32 words, and each group of `group_size` consecutive inputs
 * has a scale s and a bias b (float32, float16 or bfloat16): w = s * q + b. The product is
 * out[m][n] = sum_k x[m][k] * w[n][k] (`x @ w.T`), x float32.
 *
 * Batch invariance. Every output element is one fixed sequence of float operations on its row of x
 * and its weight row, whatever the number of rows in the call, the row's place among them, the
 * threads, or the other rows' experts:
 *   - inputs are taken in chunks of 32 (a group is 1, 2 or 4 chunks); a chunk's q values are widened
 *     to float (exact) and dequantized as w = fma(s, q, b) (one rounding), in two 16-lane vectors;
 *   - 16 lane accumulators take acc = fma(w, x, acc) chunk after chunk, in order over k;
 *   - the lanes are summed in one fixed tree (lane i + lane i+8, then +4, +2, +1).
 * Within a chunk of 4-bit weights the lanes hold the even inputs then the odd ones (the low and
 * high nibbles of 16 bytes), and x is permuted the same way once per call; any bit width keeps the
 * same lane order whatever the row count. A machine with AVX-512 runs a 16-lane vector as one
 * register, one with AVX2 as two: the same roundings, so both give the same bits.
 *
 * Speed. Weights are read once per block of columns and rows. Up to 12 rows (a decode step, verified
 * drafts, a small batch), each 32-input chunk of 4 columns is dequantized in registers and multiplied
 * by 4 rows at once (then the rest), so a few rows cost little more than one; more rows: a 4-column
 * panel of 512 inputs is dequantized into a buffer that stays in L1, then every row of the block
 * multiplies it (register tiles of 4 rows x 4 columns), bound by FMAs. Columns are spread over the threads (OpenMP); no split changes any element's
 * arithmetic. The gathered product (mixture-of-experts) groups rows by expert and runs each group
 * the same way.
 *
 * Built once per machine, CPU (-march=native), MLX and nanobind version by pipeline/kernels/build.py;
 * pipeline/kernels/qmm.py runs it and holds the fallback to MLX's own kernels.
 */
#include <dlfcn.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"
#include "mlx/types/half_types.h"
#include "mlx/version.h"

#include "kernels_common.h"

namespace nb = nanobind;

#define STR2(x) #x
#define STR(x) STR2(x)
static const char *BUILT_FOR_MLX = STR(MLX_VERSION_MAJOR) "." STR(MLX_VERSION_MINOR) "." STR(MLX_VERSION_PATCH);

/* 16 bytes widened to 16 int32 lanes (vpmovzxbd; the generic vector code would go byte by byte). */
static inline i32x16 widen_bytes(const uint8_t *p) {
#if defined(__AVX512F__)
    return (i32x16)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
#elif defined(__AVX2__)
    __m256i halves[2] = {_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(p))),
                         _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(p + 8)))};
    i32x16 v;
    std::memcpy(&v, halves, 64);
    return v;
#else
    i32x16 v;
    for (int i = 0; i < 16; i++) v[i] = p[i];
    return v;
#endif
}

/* ---- the layout ------------------------------------------------------------------------------------ */

/* One matrix (or one expert's): row n's packed bytes start at w + n * row_bytes. */
struct QMatrix {
    const uint8_t *w;
    const void *scales, *biases;
    int scale_type;
    int64_t n, k, row_bytes, groups;  // groups per row = k / group_size
    int bits, group_size;
};

/* One group's scale and bias, splat, and for 4 bits on AVX-512 its 16 dequantized values. */
struct Group {
    v16 s, b;
#if defined(__AVX512F__)
    v16 table;  // table[q] = fma(s, q, b): a lookup gives the very value the arithmetic would
#endif
};

static inline Group group_at(const QMatrix &m, int64_t g) {
    Group out;
    const float s = scale_at(m.scales, m.scale_type, g);
    out.s = splat(s);
    // biases nullptr: a symmetric matrix (qmm.hold_symmetric: a GGUF's Q5_0) whose every bias is -2^(bits - 1)
    // times its scale, exactly (checked at load): the value the held bias had, in float32
    out.b = splat(m.biases ? scale_at(m.biases, m.scale_type, g) : s * -float(1 << (m.bits - 1)));
#if defined(__AVX512F__)
    if (m.bits == 4) out.table = fma16(out.s, v16{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, out.b);
#endif
    return out;
}

/* The 32 dequantized weights of one chunk (4 * bits bytes) as two vectors, w = fma(s, q, b), in the
   chunk's lane order: 4 bits: the low nibbles of its 16 bytes (inputs 0, 2, ..., 30), then the high
   ones (1, 3, ..., 31); other widths: inputs in order. */
template <int bits>
static inline void dequantize_chunk(const uint8_t *p, const Group &g, v16 &w0, v16 &w1) {
    v16 q0, q1;
    if constexpr (bits == 4) {
        const i32x16 v = widen_bytes(p);
#if defined(__AVX512F__)
        // vpermps reads the low 4 bits of each index: the nibble picks its value from the table
        w0 = (v16)_mm512_permutexvar_ps((__m512i)v, (__m512)g.table);
        w1 = (v16)_mm512_permutexvar_ps((__m512i)(v >> 4), (__m512)g.table);
        return;
#else
        q0 = __builtin_convertvector(v & 15, v16);
        q1 = __builtin_convertvector(v >> 4, v16);
#endif
    } else if constexpr (bits == 8) {
        q0 = __builtin_convertvector(widen_bytes(p), v16);
        q1 = __builtin_convertvector(widen_bytes(p + 16), v16);
    } else {
        uint8_t buf[40] = {0};  // a chunk is 4 * bits <= 32 bytes; the pad lets every read take 2 bytes
        std::memcpy(buf, p, 4 * bits);
        int32_t q[32];
        const unsigned mask = (1u << bits) - 1;
        for (int i = 0; i < 32; i++) {
            int bit = i * bits;
            unsigned two = buf[bit >> 3] | (unsigned(buf[(bit >> 3) + 1]) << 8);
            q[i] = int32_t((two >> (bit & 7)) & mask);
        }
        i32x16 a, b;
        std::memcpy(&a, q, 64);
        std::memcpy(&b, q + 16, 64);
        q0 = __builtin_convertvector(a, v16);
        q1 = __builtin_convertvector(b, v16);
    }
    w0 = fma16(g.s, q0, g.b);
    w1 = fma16(g.s, q1, g.b);
}

/* x's inputs in the lane order of dequantize_chunk (a copy only for 4 bits). */
static void permute_row(const float *x, float *out, int64_t k, int bits) {
    if (bits != 4) {
        std::memcpy(out, x, k * sizeof(float));
        return;
    }
    for (int64_t c = 0; c < k; c += 32)
        for (int j = 0; j < 16; j++) {
            out[c + j] = x[c + 2 * j];
            out[c + 16 + j] = x[c + 2 * j + 1];
        }
}

/* ---- the kernel ------------------------------------------------------------------------------------- */

constexpr int COLS = 4;     // columns per panel (weight rows dequantized together)
constexpr int PANEL = 512;  // inputs per panel: a multiple of every group size; 4 x 512 floats = 8 KB
constexpr int ROW_BLOCK = 64;
constexpr int64_t INVARIANT_MAX_ROWS = 64;  // as the BLAS shim's: more rows (one prompt's chunk) go to the BLAS
constexpr int64_t BLAS_PANEL = 256;         // weight rows dequantized at a time for the BLAS

/* Dequantize columns [col, col + COLS) x inputs [k0, k0 + len) into buf[c * PANEL + i] (zeros past
   the last column). */
template <int bits>
static void dequantize_panel(const QMatrix &m, int64_t col, int64_t k0, int64_t len, float *buf) {
    const int64_t chunk_bytes = 4 * bits;
    for (int c = 0; c < COLS; c++) {
        float *out = buf + c * PANEL;
        if (col + c >= m.n) {
            std::memset(out, 0, len * sizeof(float));
            continue;
        }
        const int64_t n = col + c;
        const uint8_t *row = m.w + n * m.row_bytes;
        for (int64_t k = k0; k < k0 + len; k += m.group_size) {
            const Group g = group_at(m, n * m.groups + k / m.group_size);
            for (int64_t c32 = k; c32 < k + m.group_size; c32 += 32) {
                v16 w0, w1;
                dequantize_chunk<bits>(row + (c32 / 32) * chunk_bytes, g, w0, w1);
                store16(out + (c32 - k0), w0);
                store16(out + (c32 - k0) + 16, w1);
            }
        }
    }
}

/* One row (decode): the same arithmetic as dequantize_panel + panel_tile<1>, the weights dequantized in
   registers and never stored. */
template <int bits>
static void column_block_one_row(const QMatrix &m, int64_t col, const float *x, float *out) {
    const int64_t chunk_bytes = 4 * bits;
    if (col + COLS > m.n) {  // the last, partial block: a column at a time
        for (int64_t n = col; n < m.n; n++) {
            v16 acc{};
            for (int64_t k = 0; k < m.k; k += m.group_size) {
                const Group g = group_at(m, n * m.groups + k / m.group_size);
                for (int64_t c32 = k; c32 < k + m.group_size; c32 += 32) {
                    v16 w0, w1;
                    dequantize_chunk<bits>(m.w + n * m.row_bytes + (c32 / 32) * chunk_bytes, g, w0, w1);
                    acc = fma16(w0, load16(x + c32), acc);
                    acc = fma16(w1, load16(x + c32 + 16), acc);
                }
            }
            out[n] = lanes_sum(acc);
        }
        return;
    }
    // four columns side by side: four independent chains of FMAs
    v16 acc[COLS] = {};
    for (int64_t k = 0; k < m.k; k += m.group_size) {
        Group g[COLS];
        for (int c = 0; c < COLS; c++) g[c] = group_at(m, (col + c) * m.groups + k / m.group_size);
        for (int64_t c32 = k; c32 < k + m.group_size; c32 += 32) {
            const v16 x0 = load16(x + c32), x1 = load16(x + c32 + 16);
            for (int c = 0; c < COLS; c++) {
                v16 w0, w1;
                dequantize_chunk<bits>(m.w + (col + c) * m.row_bytes + (c32 / 32) * chunk_bytes, g[c], w0, w1);
                acc[c] = fma16(w0, x0, acc[c]);
                acc[c] = fma16(w1, x1, acc[c]);
            }
        }
    }
    for (int c = 0; c < COLS; c++) out[col + c] = lanes_sum(acc[c]);
}

/* acc[r][c] = fma(panel column c, row r, acc[r][c]), 16 inputs at a time, in order. */
template <int R>
static inline void panel_tile(const float *const *rows, int64_t k0, int64_t len, const float *buf, v16 *acc) {
    v16 a[R][COLS];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < COLS; c++) a[r][c] = acc[r * COLS + c];
    for (int64_t i = 0; i < len; i += 16) {
        v16 w[COLS];
        for (int c = 0; c < COLS; c++) w[c] = load16(buf + c * PANEL + i);
        for (int r = 0; r < R; r++) {
            const v16 x = load16(rows[r] + k0 + i);
            for (int c = 0; c < COLS; c++) a[r][c] = fma16(w[c], x, a[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < COLS; c++) acc[r * COLS + c] = a[r][c];
}

/* R rows (2-4) x a whole block of COLS columns, the weights dequantized in registers chunk by chunk and
   used by every row at once: the arithmetic of panel_tile (per row and column, fma over k in order),
   without the panel's store and reloads. A few rows (verified drafts, a small batch) cost then
   little more than one: their products are bound by reading and unpacking the weights. */
template <int bits, int R>
static void column_block_rows(const QMatrix &m, int64_t col, const float *const *rows, float *const *out_rows) {
    const int64_t chunk_bytes = 4 * bits;
    v16 acc[R][COLS] = {};
    for (int64_t k = 0; k < m.k; k += m.group_size) {
        Group g[COLS];
        for (int c = 0; c < COLS; c++) g[c] = group_at(m, (col + c) * m.groups + k / m.group_size);
        for (int64_t c32 = k; c32 < k + m.group_size; c32 += 32) {
            v16 w0[COLS], w1[COLS];
            for (int c = 0; c < COLS; c++)
                dequantize_chunk<bits>(m.w + (col + c) * m.row_bytes + (c32 / 32) * chunk_bytes, g[c], w0[c], w1[c]);
            for (int r = 0; r < R; r++) {
                const v16 x0 = load16(rows[r] + c32);
                for (int c = 0; c < COLS; c++) acc[r][c] = fma16(w0[c], x0, acc[r][c]);
            }
            for (int r = 0; r < R; r++) {
                const v16 x1 = load16(rows[r] + c32 + 16);
                for (int c = 0; c < COLS; c++) acc[r][c] = fma16(w1[c], x1, acc[r][c]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < COLS; c++) out_rows[r][col + c] = lanes_sum(acc[r][c]);
}

constexpr int64_t FUSED_MAX_ROWS = 12;  // up to this many rows: passes of column_block_rows (a block's weights stay in L1);
                                        // more: the panel, dequantized once (measured: even at 9-16 rows, faster from 32)

/* out_rows[r][col..col+COLS) for `nrows` rows (already permuted, see permute_row) of one matrix. */
template <int bits>
static void column_block(const QMatrix &m, int64_t col, const float *const *rows, float *const *out_rows,
                         int64_t nrows, float *buf, v16 *acc) {
    if (nrows == 1) {
        column_block_one_row<bits>(m, col, rows[0], out_rows[0]);
        return;
    }
    if (nrows <= FUSED_MAX_ROWS && col + COLS <= m.n) {
        int64_t r = 0;
        for (; r + 4 <= nrows; r += 4) column_block_rows<bits, 4>(m, col, rows + r, out_rows + r);
        if (nrows - r == 3) column_block_rows<bits, 3>(m, col, rows + r, out_rows + r);
        if (nrows - r == 2) column_block_rows<bits, 2>(m, col, rows + r, out_rows + r);
        if (nrows - r == 1) column_block_one_row<bits>(m, col, rows[r], out_rows[r]);
        return;
    }
    std::fill(acc, acc + nrows * COLS, v16{});
    for (int64_t k0 = 0; k0 < m.k; k0 += PANEL) {
        const int64_t len = std::min<int64_t>(PANEL, m.k - k0);
        dequantize_panel<bits>(m, col, k0, len, buf);
        int64_t r = 0;
        // Rows in sixes (AVX-512's 32 registers hold 24 accumulators: fewer weight loads per FMA, 10-15%
        // faster at 16-64 rows), fours, then a pair, then one: a tile of R rows keeps 4R chains of FMAs in flight, and
        // one row's 4 chains wait on the FMA latency (2 rows took longer than 3, or 4, before the pair
        // tile: a draft of one token verifies 2). Each row's chain is the same whatever the tile.
#if defined(__AVX512F__)
        for (; r + 6 <= nrows; r += 6) panel_tile<6>(rows + r, k0, len, buf, acc + r * COLS);
#endif
        for (; r + 4 <= nrows; r += 4) panel_tile<4>(rows + r, k0, len, buf, acc + r * COLS);
        for (; r + 2 <= nrows; r += 2) panel_tile<2>(rows + r, k0, len, buf, acc + r * COLS);
        for (; r < nrows; r++) panel_tile<1>(rows + r, k0, len, buf, acc + r * COLS);
    }
    for (int64_t r = 0; r < nrows; r++)
        for (int c = 0; c < COLS && col + c < m.n; c++) out_rows[r][col + c] = lanes_sum(acc[r * COLS + c]);
}

/* A unit of work: rows [r0, r1) of `order` (row indices of one expert's group) times columns
   [block * COLS, ...) of that expert's matrix. */
struct Task {
    int64_t expert, r0, r1, block;
};

/* Below this many multiply-adds a product runs on one thread: waking the others costs more than
   they save. Measured on 2 cores (SmolLM2's 576-wide 4-bit matrices, one row: 0.3-0.9 M multiply-adds,
   100-200 us on one core, unpack-bound): a threshold of 2^21 kept decode's products on one thread
   (30 tok/s); 2^16 spreads them (44-46 tok/s), 2^18 in between (43). On a host loaded by other
   work a descheduled thread stalls a product for a time slice; our own ranks' share of the cores
   (g_threads) already leaves one thread per core. */
constexpr int64_t THREADED_MIN_WORK = int64_t(1) << 16;

static void run_tasks(const std::vector<Task> &tasks, const std::vector<QMatrix> &mats,
                      const std::vector<int64_t> &order, const std::vector<const float *> &xrows,
                      const std::vector<float *> &orows, int64_t work) {
    const int64_t ntasks = int64_t(tasks.size());
    const bool threaded = g_threads > 1 && ntasks > 1 && work >= THREADED_MIN_WORK;
#pragma omp parallel num_threads(g_threads) if (threaded)
    {
        std::vector<float> buf(COLS * PANEL);
        std::vector<v16> acc(ROW_BLOCK * COLS);
        std::vector<const float *> rows(ROW_BLOCK);
        std::vector<float *> outs(ROW_BLOCK);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < ntasks; t++) {
            const Task &task = tasks[t];
            const int64_t nrows = task.r1 - task.r0;
            for (int64_t i = 0; i < nrows; i++) {
                rows[i] = xrows[order[task.r0 + i]];
                outs[i] = orows[order[task.r0 + i]];
            }
            const QMatrix &m = mats[task.expert];
            auto run = [&](auto block) { block(m, task.block * COLS, rows.data(), outs.data(), nrows, buf.data(), acc.data()); };
            switch (m.bits) {
                case 2: run(column_block<2>); break;
                case 3: run(column_block<3>); break;
                case 4: run(column_block<4>); break;
                case 5: run(column_block<5>); break;
                case 6: run(column_block<6>); break;
                default: run(column_block<8>); break;
            }
        }
    }
}

/* ---- products of many rows: the BLAS on dequantized panels ------------------------------------------ */

/* The products of more rows than batch jobs pack together (a prompt's chunk) are bound by FMAs, where
   the BLAS's sgemm (OpenBLAS, loaded by blas.py) beats the tiles above: weight rows are dequantized
   256 at a time into floats (in the chunks' lane order, as x is permuted: the same sums) and
   multiplied there. Like the BLAS shim's, such products round by the BLAS's rules, not the fixed
   ones above. */
typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int, float, float *,
                         int);

static sgemm_fn blas_sgemm() {
    static const sgemm_fn found = reinterpret_cast<sgemm_fn>(dlsym(RTLD_DEFAULT, "cblas_sgemm"));
    return found;
}

template <int bits>
static void dequantize_rows(const QMatrix &m, int64_t n0, int64_t n1, float *out) {
    const int64_t chunk_bytes = 4 * bits;
    // One thread: it costs a fraction of the sgemm's time (which has 64+ FMAs per weight), and OpenMP's
    // workers, spinning after a region, would take the cores from the BLAS's threads (prefill 3x slower).
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = m.w + n * m.row_bytes;
        float *dst = out + (n - n0) * m.k;
        for (int64_t k = 0; k < m.k; k += m.group_size) {
            const Group g = group_at(m, n * m.groups + k / m.group_size);
            for (int64_t c32 = k; c32 < k + m.group_size; c32 += 32) {
                v16 w0, w1;
                dequantize_chunk<bits>(row + (c32 / 32) * chunk_bytes, g, w0, w1);
                store16(dst + c32, w0);
                store16(dst + c32 + 16, w1);
            }
        }
    }
}

static void blas_product(const QMatrix &m, const float *x, int64_t rows, float *out) {
    std::vector<float> panel(std::min(BLAS_PANEL, m.n) * m.k);
    for (int64_t n0 = 0; n0 < m.n; n0 += BLAS_PANEL) {
        const int64_t n1 = std::min(m.n, n0 + BLAS_PANEL);
        switch (m.bits) {
            case 2: dequantize_rows<2>(m, n0, n1, panel.data()); break;
            case 3: dequantize_rows<3>(m, n0, n1, panel.data()); break;
            case 4: dequantize_rows<4>(m, n0, n1, panel.data()); break;
            case 5: dequantize_rows<5>(m, n0, n1, panel.data()); break;
            case 6: dequantize_rows<6>(m, n0, n1, panel.data()); break;
            default: dequantize_rows<8>(m, n0, n1, panel.data()); break;
        }
        const int CblasRowMajor = 101, CblasNoTrans = 111, CblasTrans = 112;
        blas_sgemm()(CblasRowMajor, CblasNoTrans, CblasTrans, int(rows), int(n1 - n0), int(m.k), 1.0f, x, int(m.k),
                     panel.data(), int(m.k), 0.0f, out + n0, int(m.n));
    }
}

/* ---- the MLX operation --------------------------------------------------------------------------- */

/* x [..., k] times n weight rows: [..., n]. */
static mx::Shape product_shape(const mx::array &x, const mx::array &w) {
    mx::Shape shape = x.shape();
    shape.back() = w.shape(-2);
    return shape;
}

/* Inputs: x [..., k] float32 ([rows, k] when gathered), w [(experts,) n, k * bits / 32] uint32, scales and biases
   [(experts,) n, k / group_size], and when gathered an expert index per row. Output [rows, n] float32. Or, after
   the experts [pairs], an lhs index per pair: pair p is row lhs[p] of x [x rows, k] (permuted once for all its
   pairs) times expert experts[p], output [pairs, n], each row the bits of that row alone. */
class QuantizedProduct : public mx::UnaryPrimitive {
   public:
    QuantizedProduct(mx::Stream stream, int group_size, int bits, bool gathered)
        : mx::UnaryPrimitive(stream), group_size_(group_size), bits_(bits), gathered_(gathered) {}

    void eval_cpu(const std::vector<mx::array> &inputs, mx::array &out) override {
        out.set_data(mx::allocator::malloc(out.nbytes()));
        auto &encoder = mx::cpu::get_command_encoder(stream());
        for (auto &a : inputs) encoder.set_input_array(a);
        encoder.set_output_array(out);
        const int group_size = group_size_, bits = bits_;
        const bool gathered = gathered_;
        encoder.dispatch([inputs, out, group_size, bits, gathered]() mutable {
            std::vector<mx::array> keep;
            const mx::array x = contiguous(inputs[0], keep);
            const mx::array w = contiguous(inputs[1], keep), s = contiguous(inputs[2], keep),
                            b = contiguous(inputs[3], keep);
            const int64_t k = x.shape(-1), x_rows = k ? int64_t(x.size()) / k : 0;
            const bool lhs = gathered && inputs.size() > 5;
            const int64_t rows = lhs ? int64_t(inputs[4].size()) : x_rows;
            const int64_t n = w.shape(-2), experts = gathered ? w.shape(0) : 1;
            if (rows == 0 || n == 0 || x_rows == 0) return;
            const std::vector<int64_t> expert_of = experts_of_rows(gathered ? &inputs[4] : nullptr, rows, experts, keep);
            std::vector<int64_t> x_of;  // clamped as the experts are
            if (lhs) x_of = experts_of_rows(&inputs[5], rows, x_rows, keep);
            std::vector<QMatrix> mats(experts);
            const int64_t row_bytes = w.shape(-1) * 4, groups = s.shape(-1);
            for (int64_t e = 0; e < experts; e++)
                mats[e] = QMatrix{w.data<uint8_t>() + e * n * row_bytes,
                                  static_cast<const uint8_t *>(s.data<void>()) + e * n * groups * s.itemsize(),
                                  b.size() ? static_cast<const uint8_t *>(b.data<void>()) + e * n * groups * b.itemsize()
                                           : nullptr,
                                  scale_type_of(s.dtype()), n, k, row_bytes, groups, bits, group_size};
            // x in the chunks' lane order, one row at a time
            std::vector<float> permuted(x_rows * k);
            std::vector<const float *> xrows(rows);
            std::vector<float *> orows(rows);
            float *o = out.data<float>();
            for (int64_t r = 0; r < x_rows; r++) permute_row(x.data<float>() + r * k, permuted.data() + r * k, k, bits);
            for (int64_t r = 0; r < rows; r++) {
                xrows[r] = permuted.data() + (lhs ? x_of[r] : r) * k;
                orows[r] = o + r * n;
            }
            const RowsByExpert by_expert = rows_by_expert(expert_of, experts);
            const std::vector<int64_t> &start = by_expert.start, &order = by_expert.order;
            std::vector<Task> tasks;
            const int64_t blocks = (n + COLS - 1) / COLS;
            for (int64_t e = 0; e < experts; e++)
                for (int64_t r0 = start[e]; r0 < start[e + 1]; r0 += ROW_BLOCK)
                    for (int64_t blk = 0; blk < blocks; blk++)
                        tasks.push_back(Task{e, r0, std::min(start[e + 1], r0 + ROW_BLOCK), blk});
            if (!gathered && rows > INVARIANT_MAX_ROWS && blas_sgemm()) {
                blas_product(mats[0], permuted.data(), rows, o);
                return;
            }
            run_tasks(tasks, mats, order, xrows, orows, rows * n * k);
        });
    }

    void eval_gpu(const std::vector<mx::array> &, mx::array &) override {
        throw std::runtime_error("pipeline_qmm runs on the CPU only");
    }

    const char *name() const override { return gathered_ ? "PipelineGatherQMM" : "PipelineQMM"; }

    bool is_equivalent(const mx::Primitive &other) const override {
        auto *o = dynamic_cast<const QuantizedProduct *>(&other);
        return o && o->group_size_ == group_size_ && o->bits_ == bits_ && o->gathered_ == gathered_;
    }

    std::vector<mx::Shape> output_shapes(const std::vector<mx::array> &inputs) override {
        if (gathered_) return {mx::Shape{inputs[4].shape(0), inputs[1].shape(1)}};
        return {product_shape(inputs[0], inputs[1])};
    }

   private:
    int group_size_, bits_;
    bool gathered_;
};

static void check(const mx::array &x, const mx::array &w, const mx::array &s, const mx::array &b, int group_size,
                  int bits, bool gathered) {
    auto fail = [](const std::string &why) { throw std::invalid_argument("pipeline_qmm: " + why); };
    if (x.ndim() < 1 || (gathered && x.ndim() != 2) || x.dtype() != mx::float32)
        fail(gathered ? "x must be float32 [rows, inputs]" : "x must be float32 [..., inputs]");
    if (w.dtype() != mx::uint32 || int(w.ndim()) != (gathered ? 3 : 2)) fail("w must be packed uint32");
    if (b.size() && (s.shape() != b.shape() || s.dtype() != b.dtype()))  // none: a symmetric matrix
        fail("scales and biases must match");
    scale_type_of(s.dtype());
    if (bits < 2 || bits > 8 || bits == 7 || (group_size != 32 && group_size != 64 && group_size != 128))
        fail("unsupported bits or group size");
    const int64_t k = x.shape(-1);
    if (k % group_size || w.shape(-1) * 32 != k * bits || s.shape(-1) * group_size != k ||
        s.shape(-2) != w.shape(-2) || (gathered && s.shape(0) != w.shape(0)))
        fail("shapes do not fit one affine quantization");
}

void register_attention(nb::module_ &m);      // attention_kernels.cpp
void register_layer_kernels(nb::module_ &m);  // layer_kernels.cpp
void register_requantize(nb::module_ &m);     // requantize_kernels.cpp
void register_int8(nb::module_ &m);           // int8_kernels.cpp
void register_mapped(nb::module_ &m);         // mapped_files.cpp
void register_gguf_kquants(nb::module_ &m);   // gguf_kquant_kernels.cpp
void register_gguf(nb::module_ &m);           // gguf_kernels.cpp
void register_gguf_iquants(nb::module_ &m);   // gguf_iquant_kernels.cpp
void register_gguf_q5(nb::module_ &m);        // gguf_q5_kernels.cpp
void register_group_sum(nb::module_ &m);      // group_sum_kernels.cpp

static mx::Stream cpu_stream() { return mx::default_stream(mx::Device(mx::Device::cpu)); }

NB_MODULE(pipeline_qmm, m) {
    if (std::string(mx::version()) != BUILT_FOR_MLX)
        throw std::runtime_error(std::string("pipeline_qmm was built for MLX ") + BUILT_FOR_MLX + ", this is MLX " +
                                 mx::version());
    m.def("built_for_mlx", []() { return std::string(BUILT_FOR_MLX); });
    m.def("set_threads", [](int n) { g_threads = std::max(1, n); });
    m.def("threads", []() { return g_threads; });
    m.def("invariant_max_rows", []() { return INVARIANT_MAX_ROWS; });
    m.def("isa", []() {
#if defined(__AVX512F__)
        return std::string("AVX-512");
#elif defined(__AVX2__) && defined(__FMA__)
        return std::string("AVX2");
#elif defined(__ARM_NEON)
        return std::string("NEON");
#else
        return std::string("generic");
#endif
    });
    m.def("probe", [](const mx::array &a) { return int64_t(a.size()); });
    m.def(
        "quantized_matmul",
        [](const mx::array &x, const mx::array &w, const mx::array &scales, const mx::array &biases, int group_size,
           int bits) {
            check(x, w, scales, biases, group_size, bits, false);
            return mx::array(product_shape(x, w), mx::float32,
                             std::make_shared<QuantizedProduct>(cpu_stream(), group_size, bits, false),
                             {x, w, scales, biases});
        },
        "x [..., k] float32 @ dequantize(w, scales, biases).T -> [..., n], lazily");
    m.def(
        "gather_qmm",
        [](const mx::array &x, const mx::array &w, const mx::array &scales, const mx::array &biases,
           const mx::array &experts, int group_size, int bits) {
            check(x, w, scales, biases, group_size, bits, true);
            if (experts.ndim() != 1 || experts.shape(0) != x.shape(0) ||
                (experts.dtype() != mx::uint32 && experts.dtype() != mx::int32))
                throw std::invalid_argument("pipeline_qmm: one int32/uint32 expert index per row");
            return mx::array(mx::Shape{x.shape(0), w.shape(1)}, mx::float32,
                             std::make_shared<QuantizedProduct>(cpu_stream(), group_size, bits, true),
                             {x, w, scales, biases, experts});
        },
        "row r of x [rows, k] times expert experts[r] of w [experts, n, ...] -> [rows, n], lazily");
    m.def(
        "gather_qmm",
        [](const mx::array &x, const mx::array &w, const mx::array &scales, const mx::array &biases,
           const mx::array &experts, int group_size, int bits, const mx::array &lhs) {
            check(x, w, scales, biases, group_size, bits, true);
            if (experts.ndim() != 1 || lhs.ndim() != 1 || lhs.shape(0) != experts.shape(0) ||
                (experts.dtype() != mx::uint32 && experts.dtype() != mx::int32) ||
                (lhs.dtype() != mx::uint32 && lhs.dtype() != mx::int32))
                throw std::invalid_argument("pipeline_qmm: one int32/uint32 expert index and row index (lhs) per pair");
            return mx::array(mx::Shape{experts.shape(0), w.shape(1)}, mx::float32,
                             std::make_shared<QuantizedProduct>(cpu_stream(), group_size, bits, true),
                             {x, w, scales, biases, experts, lhs});
        },
        "pair p: row lhs[p] of x [rows, k] times expert experts[p] of w [experts, n, ...] -> [pairs, n], lazily");
    register_attention(m);
    register_layer_kernels(m);
    register_requantize(m);
    register_int8(m);
    register_mapped(m);
    register_gguf_kquants(m);
    register_gguf(m);
    register_gguf_iquants(m);
    register_gguf_q5(m);
    register_group_sum(m);
}
