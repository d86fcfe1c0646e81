/* Quantized products with int8 activations (--int8-activations): MLX affine 4- and 8-bit weights times
 * activations rounded to int8 per 32 inputs, the integer dot products done by AVX-512 VNNI (vpdpbusd),
 * or by vpmaddubsw + vpmaddwd without it. llama.cpp multiplies its Q4/Q8 blocks this way; against
 * pipeline's float32 kernels (qmm_kernels.cpp), which dequantize every weight to a float and spend
 * one FMA on it, this is 5-6x faster on a Zen 4 core (benchmarks/probes/int8_vnni_qmm.cpp).
 *
 * The arithmetic. For each row of x and each chunk of 32 inputs: d = max|x| / 127,
 * xq = rint(x / d) (as x * (1 / d), clamped to +-127), and sx = d * sum(xq) (the ROUNDED inputs' sum).
 * A weight is w = s * q + b (s, b: its group's scale and bias), so the chunk's share of an output is
 *     sum(w * x) ~ (s * d) * sum(q * xq) + b * sx = sum(w * d * xq)
 * where sum(q * xq) is an exact integer (|sum| < 2^24, so its float is exact too). Each output takes,
 * chunk after chunk in order over k: acc = fma(float(isum), s * d, acc); acc = fma(b, sx, acc).
 * The only error against float math is xq's rounding (at most d / 2 per input, relative ~1/254 of the
 * chunk's largest input), not the weights': the product is the weights' own times the rounded inputs,
 * its error sum(w * (d * xq - x)). sx must be the rounded inputs' sum, not x's (as llama.cpp's Q8_1 sum
 * is): with x's, the error is sum((w - b) * (d * xq - x)), weighted by the codes q = (w - b) / s from 0
 * to 2^bits - 1 instead of by the weights, ~3x larger RMS for Q4_0 (b = -8 s) and 5x for Q8_0's (b = -128 s):
 * SmolLM2-135M Q4_0's perplexity cost of int8 was +4.4% over float, +0.3% with sx from xq (llama.cpp's +0.3%).
 *
 * Batch invariance. A row's xq, d and sx depend on that row alone; integer sums are exact in any
 * order; the float steps per output are the fixed sequence above, in 16-lane vectors whose lanes are
 * 16 output columns (no lane sums). So every output element has the same bits whatever the row
 * count, the row's place, the threads, the x86 ISA (VNNI, AVX-512 without it, AVX2), or the other
 * rows' experts (the generic code for other CPUs has no fused multiply-add: its own bits): batch jobs and verified drafts equal `generate`, at every row count
 * (prefill chunks too, unlike the float32 path that hands them to the BLAS).
 *
 * The layout (int8_repack, once at load; same shapes as MLX's, other order; float32 scales and biases that
 * are all float16 values become float16, see all_half_exact). Columns
 * (weight rows) in blocks of 16 and inputs in chunks of 32; block cb, chunk c holds 4 * bits * 16
 * bytes in steps of 64 bytes, byte 4 * col + i of step j being
 *     4 bits: q[col][32c + 4j + i] in the low nibble, q[col][32c + 16 + 4j + i] in the high (j < 4);
 *     8 bits: q[col][32c + 4j + i] (j < 8);
 * so one vpdpbusd multiplies 16 columns x 4 inputs by one broadcast group of 4 int8 activations.
 * Scales and biases: block cb, group g: its 16 columns' values side by side. Matrices need n % 16 == 0
 * and k % 32 == 0 (checkpoints/int8_repack.py keeps the others on the float32 path).
 */
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <sys/mman.h>
#include <tuple>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "mlx/backend/cpu/encoder.h"
#include "mlx/backend/cpu/unary_ops.h"
#include "mlx/ops.h"
#include "mlx/transforms.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"
#include "mlx/types/half_types.h"

#include "kernels_common.h"

namespace nb = nanobind;

namespace {

constexpr int BLOCK = 16;  // columns per block: the lanes of a vector
constexpr int CHUNK = 32;  // inputs per activation scale

constexpr int64_t chunk_bytes(int bits) { return int64_t(BLOCK) * CHUNK * bits / 8; }  // 256 or 512

/* A one-row (decode) product's weights stream from memory: block_tile asks for the codes of the chunk PREFETCH_AHEAD
   bytes on (the scales and biases too cost a 4-bit matrix in cache 10% and gained nothing streamed), q8_tile (the
   head) for its column block's bytes as far ahead, spread over its chunks (before: the whole next block at once, at
   the block's start). Measured on one thread, wall time, interleaved with the code before
   (load 1.8-2.4): SmolLM2's 49152 x 576 Q8_0 head 1670-1810 -> 1360-1530 us; 576 x 1536 Q4_1 / Q8_0 one row over 64
   MiB of matrices 47-53 -> 34-37 / 61-63 -> 50-59 us, in cache the same (17-21 us); 2-32 KiB tried: 4 best.
   Hints only: the same bits. */
constexpr int64_t PREFETCH_AHEAD = 4096;

/* ---- activations --------------------------------------------------------------------------------- */

struct QuantizedRows {
    std::vector<int8_t> q;   // [rows, k]
    std::vector<float> d;    // [rows, k / 32]
    std::vector<float> sum;  // [rows, k / 32]
};

/* Row `r` of x (k inputs) into q/d/sum at the same row: per chunk d = max|x| / 127, xq = rint(x * (1/d)). */
inline void quantize_row(const float *x, int64_t k, int8_t *q, float *d, float *sum) {
    for (int64_t c = 0; c < k / CHUNK; c++) {
        const float *v = x + c * CHUNK;
        float amax = 0.0f;
        for (int i = 0; i < CHUNK; i++) amax = std::max(amax, std::fabs(v[i]));
        const float scale = amax / 127.0f;
        float inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
        if (!(inverse < INFINITY)) inverse = 0.0f;  // amax below ~4e-37 (or not finite): the chunk counts as zeros
        d[c] = scale;
        int32_t qsum = 0;
        for (int i = 0; i < CHUNK; i++) {
            const float r = std::nearbyint(v[i] * inverse);
            q[c * CHUNK + i] = r >= 127.0f ? 127 : r <= -127.0f ? -127 : r == r ? int8_t(r) : 0;  // NaN: 0
            qsum += q[c * CHUNK + i];
        }
        sum[c] = float(qsum) * scale;  // the rounded inputs' sum (opening comment), one rounding
    }
}

/* ---- the integer dot products: 16 columns x 4 inputs per step --------------------------------------- */

typedef uint8_t u8x64 __attribute__((vector_size(64)));

inline u8x64 load64(const uint8_t *p) {
    u8x64 v;
    std::memcpy(&v, p, 64);
    return v;
}

/* iacc[col] += sum over i < 4 of v[4 * col + i] * x4[i]: v 64 unsigned bytes, x4 4 signed bytes (from
   -127 to 127). `nibbles`: every byte of v is < 16, so vpmaddubsw's int16 pair sums cannot saturate;
   else a byte is split into its nibbles, 16 * (high sum) + low sum. Integer sums: exact on every path. */
template <bool nibbles>
inline void dot_step(i32x16 &iacc, u8x64 v, int32_t x4) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    iacc = (i32x16)_mm512_dpbusd_epi32((__m512i)iacc, (__m512i)v, _mm512_set1_epi32(x4));
#elif defined(__AVX512BW__)
    const __m512i x = _mm512_set1_epi32(x4), ones = _mm512_set1_epi16(1);
    if constexpr (nibbles) {
        iacc = (i32x16)_mm512_add_epi32((__m512i)iacc, _mm512_madd_epi16(_mm512_maddubs_epi16((__m512i)v, x), ones));
    } else {
        const __m512i lo = _mm512_madd_epi16(_mm512_maddubs_epi16((__m512i)(v & 15), x), ones);
        const __m512i hi = _mm512_madd_epi16(_mm512_maddubs_epi16((__m512i)(v >> 4), x), ones);
        iacc = (i32x16)_mm512_add_epi32((__m512i)iacc, _mm512_add_epi32(lo, _mm512_slli_epi32(hi, 4)));
    }
#elif defined(__AVX2__)
    __m256i acc[2], w[2], w_lo[2], w_hi[2];
    std::memcpy(acc, &iacc, 64);
    std::memcpy(w, &v, 64);
    const u8x64 lo_v = v & 15, hi_v = v >> 4;
    std::memcpy(w_lo, &lo_v, 64);
    std::memcpy(w_hi, &hi_v, 64);
    const __m256i x = _mm256_set1_epi32(x4), ones = _mm256_set1_epi16(1);
    for (int h = 0; h < 2; h++) {
        if constexpr (nibbles) {
            acc[h] = _mm256_add_epi32(acc[h], _mm256_madd_epi16(_mm256_maddubs_epi16(w[h], x), ones));
        } else {
            const __m256i lo = _mm256_madd_epi16(_mm256_maddubs_epi16(w_lo[h], x), ones);
            const __m256i hi = _mm256_madd_epi16(_mm256_maddubs_epi16(w_hi[h], x), ones);
            acc[h] = _mm256_add_epi32(acc[h], _mm256_add_epi32(lo, _mm256_slli_epi32(hi, 4)));
        }
    }
    std::memcpy(&iacc, acc, 64);
#else
    int8_t x[4];
    std::memcpy(x, &x4, 4);
    for (int col = 0; col < BLOCK; col++)
        for (int i = 0; i < 4; i++) iacc[col] += int32_t(v[4 * col + i]) * x[i];
#endif
}

/* ---- the kernel ------------------------------------------------------------------------------------ */

/* 16 consecutive scales (or biases) as floats (each conversion exact). */
inline v16 load_scales(const void *p, int type, int64_t i) {
#if defined(__AVX512F__)
    switch (type) {
        case SCALE_F16:
            return (v16)_mm512_cvtph_ps(_mm256_loadu_si256(static_cast<const __m256i *>(p) + i / 16));
        case SCALE_BF16:
            return (v16)_mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256(static_cast<const __m256i *>(p) + i / 16)), 16));
        default: return load16(static_cast<const float *>(p) + i);
    }
#else
    float f[16];
    for (int l = 0; l < 16; l++) f[l] = scale_at(p, type, i + l);
    return load16(f);
#endif
}

/* The bias of every group of a symmetric matrix, in units of its scale: codes q from 0 to 2^bits - 1 stand
   for q - 2^(bits - 1) (GGUF's Q4_0 and Q8_0: w = d (q - 8), w = d (q - 128)). */
constexpr float symmetric_offset(int bits) { return -float(1 << (bits - 1)); }

/* One repacked matrix (or one expert's). */
struct PackedMatrix {
    const uint8_t *codes;
    const void *scales, *biases;  // biases nullptr: a symmetric matrix, each bias symmetric_offset(bits) x its scale
    int scale_type;
    int64_t n, k, groups;  // groups per row
    int bits, group_size;
};

/* Matrix e (0 if not stacked) of row-contiguous repacked w [(experts,) n, k * bits / 32], scales and biases. */
PackedMatrix packed_matrix(const mx::array &w, const mx::array &s, const mx::array &b, int64_t k, int bits,
                           int group_size, int64_t e = 0) {
    const int64_t n = w.shape(-2), groups = s.shape(-1);
    const bool symmetric = b.shape(-1) == 0;
    return PackedMatrix{w.data<uint8_t>() + e * n * w.shape(-1) * 4,
                        static_cast<const uint8_t *>(s.data<void>()) + e * n * groups * s.itemsize(),
                        symmetric ? nullptr : static_cast<const uint8_t *>(b.data<void>()) + e * n * groups * b.itemsize(),
                        scale_type_of(s.dtype()), n, k, groups, bits, group_size};
}

#if defined(__AVX512F__)  // 8 (up to 9) int32 + float accumulators fit AVX-512's 32 registers
constexpr int TILE = 8, MAX_TILE = 9;
#else  // AVX2's 16: 4 rows a tile
constexpr int TILE = 4, MAX_TILE = 4;
#endif

/* Output columns [16 * cb, 16 * cb + 16) of R rows: the arithmetic of the file's opening comment. */
template <int bits, int R>
void block_tile(const PackedMatrix &m, int64_t cb, const QuantizedRows &xq, const int64_t *rows, float *const *out) {
    const int64_t chunks = m.k / CHUNK, per_group = m.group_size / CHUNK;
    v16 acc[R] = {};
    const uint8_t *codes = m.codes + cb * chunks * chunk_bytes(bits);
    v16 s{}, b{};
    for (int64_t c = 0; c < chunks; c++) {
        if (c % per_group == 0) {
            const int64_t at = (cb * m.groups + c / per_group) * BLOCK;
            s = load_scales(m.scales, m.scale_type, at);
            b = m.biases ? load_scales(m.biases, m.scale_type, at) : s * splat(symmetric_offset(bits));  // exact: a power of two
        }
        const uint8_t *w = codes + c * chunk_bytes(bits);
#if defined(__SSE__)
        for (int j = 0; j < chunk_bytes(bits); j += 64) _mm_prefetch(reinterpret_cast<const char *>(w + PREFETCH_AHEAD + j), _MM_HINT_T0);
#endif
        i32x16 iacc[R] = {};
        if constexpr (bits == 4) {
            for (int j = 0; j < 4; j++) {
                const u8x64 v = load64(w + 64 * j), lo = v & 15, hi = v >> 4;
                for (int r = 0; r < R; r++) {
                    const int8_t *x = xq.q.data() + rows[r] * m.k + c * CHUNK;
                    int32_t x_lo, x_hi;
                    std::memcpy(&x_lo, x + 4 * j, 4);
                    std::memcpy(&x_hi, x + 16 + 4 * j, 4);
                    dot_step<true>(iacc[r], lo, x_lo);
                    dot_step<true>(iacc[r], hi, x_hi);
                }
            }
        } else {
            for (int j = 0; j < 8; j++)
                for (int r = 0; r < R; r++) {
                    int32_t x4;
                    std::memcpy(&x4, xq.q.data() + rows[r] * m.k + c * CHUNK + 4 * j, 4);
                    dot_step<false>(iacc[r], load64(w + 64 * j), x4);
                }
        }
        for (int r = 0; r < R; r++) {
            const int64_t at = rows[r] * chunks + c;
            const v16 sd = s * splat(xq.d[at]);
            acc[r] = fma16(__builtin_convertvector(iacc[r], v16), sd, acc[r]);
            acc[r] = fma16(b, splat(xq.sum[at]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) store16(out[r] + cb * BLOCK, acc[r]);
}

/* One tile of R rows, 1 <= R <= MAX_TILE. */
template <int bits, int R = 1>
void tile_of(int64_t count, const PackedMatrix &m, int64_t cb, const QuantizedRows &xq, const int64_t *rows,
             float *const *out) {
    if constexpr (R < MAX_TILE) {
        if (count != R) return tile_of<bits, R + 1>(count, m, cb, xq, rows, out);
    }
    block_tile<bits, R>(m, cb, xq, rows, out);
}

/* The rows in as few tiles as registers allow: each tile reads the block's weights once, so a 9-position
   speculative trip (K = 8) or a 7-sequence decode step reads them once, not as 8 + 1 or 4 + 2 + 1 rows (the
   1B Llama's weights come from memory each time). Every row's arithmetic is the same whatever its tile. */
template <int bits>
void column_block(const PackedMatrix &m, int64_t cb, const QuantizedRows &xq, const int64_t *rows, float *const *out,
                  int64_t nrows) {
    int64_t r = 0;
    for (; nrows - r > MAX_TILE; r += TILE) block_tile<bits, TILE>(m, cb, xq, rows + r, out + r);
    if (r < nrows) tile_of<bits>(nrows - r, m, cb, xq, rows + r, out + r);
}

constexpr int64_t ROW_BLOCK = 64;
/* Below this many multiply-adds a product runs on one thread. An int8 product costs ~5x less per weight
   than the float32 kernels' (whose threshold is 2^16), so waking the second thread pays off only later.
   Measured on the 2-core AMD EPYC (Zen 4), decode tok/s with --int8-activations, 1 rank, 2 threads:
   SmolLM2 (products of 0.3-0.9 M multiply-adds, the head 28 M) 41-49 at 2^16, 56-78 at 2^20, 59-80 at
   2^22, 67-74 at 2^24; the 1B Llama (1-16 M) 26-29 at 2^20-2^24 and 23 at 2^26 (its 16 M products on
   one thread: memory needs both cores). Those figures predate on_threads (kernels_common.h): the repack's
   OpenMP team on the Python thread had cut libgomp's spin-wait, so every threaded product paid a wake-up.
   Re-measured without it (decode ms a token, the fastest of 8 blocks of 32, 3 interleaved runs): SmolLM2 12.3-12.9 at 2^16 and 11.9-12.9
   at 2^22, the 1B Llama 26.0-29.4 and 27.6-28.5: the same within this VM's noise. Alone, SmolLM2's 211
   products of a token take 4.6-4.8 ms at 2^16 against 6.6-7.0 at 2^22, but not in a decode step, where the
   Python thread building the next step's graph has the second core. */
constexpr int64_t THREADED_MIN_WORK = int64_t(1) << 22;

struct Task {
    int64_t part, expert, r0, r1, cb;
};

QuantizedRows quantized_rows(const float *x, int64_t rows, int64_t k) {
    QuantizedRows xq{std::vector<int8_t>(rows * k), std::vector<float>(rows * (k / CHUNK)),
                     std::vector<float>(rows * (k / CHUNK))};
    for (int64_t r = 0; r < rows; r++)
        quantize_row(x + r * k, k, xq.q.data() + r * k, xq.d.data() + r * (k / CHUNK), xq.sum.data() + r * (k / CHUNK));
    return xq;
}

/* The tasks of one call over the threads. Part p's expert e is parts[p][e]; its output rows are
   out_rows[p][i] for the rows order[i] (rows grouped by expert). */
void run_tasks(const std::vector<Task> &tasks, const std::vector<const PackedMatrix *> &parts, const QuantizedRows &xq,
               const std::vector<int64_t> &order, const std::vector<std::vector<float *>> &out_rows, int64_t work) {
    const int64_t ntasks = int64_t(tasks.size());
    const bool threaded = g_threads > 1 && ntasks > 1 && work >= THREADED_MIN_WORK;
#pragma omp parallel for schedule(static) num_threads(g_threads) if (threaded)
    for (int64_t t = 0; t < ntasks; t++) {
        const Task &task = tasks[t];
        const PackedMatrix &m = parts[task.part][task.expert];
        float *const *out = out_rows[task.part].data() + task.r0;
        if (m.bits == 4)
            column_block<4>(m, task.cb, xq, order.data() + task.r0, out, task.r1 - task.r0);
        else
            column_block<8>(m, task.cb, xq, order.data() + task.r0, out, task.r1 - task.r0);
    }
}

/* out[row] = x[row] @ expert(row)'s matrix.T for rows [0, rows): rows grouped by expert (a counting
   sort, in order within a group), then column blocks x row blocks spread over the threads. Given x_of
   (a gather's lhs indices), output row p is x[x_of[p]] (x_rows rows) times its expert: each row of x is
   rounded once however many experts it meets, and each output has the bits of that row's product alone
   (block_tile's arithmetic per row does not depend on the tile's other rows). gathered_products does it for
   several stacks of one expert count and the same inputs (an MoE layer's gate and up): x rounded once, every
   stack's tasks in one pass, each output the bits `product` gives it alone; on the threads where each stack's
   own product would be (--tensor-parallel 2's slices of 128 x 2048 x 8 pairs are 2^21 multiply-adds a stack:
   their sum at the threshold woke the second thread, 130 -> 400 us a call on the loaded 2-core host). */
void gathered_products(const std::vector<const std::vector<PackedMatrix> *> &stacks, const std::vector<int64_t> &expert_of,
                       const float *x, int64_t rows, const std::vector<float *> &outs,
                       const std::vector<int64_t> *x_of = nullptr, int64_t x_rows = -1) {
    const int64_t k = (*stacks[0])[0].k, experts = int64_t(stacks[0]->size());
    const QuantizedRows xq = quantized_rows(x, x_of ? x_rows : rows, k);
    const RowsByExpert by_expert = rows_by_expert(expert_of, experts);
    const std::vector<int64_t> &start = by_expert.start, &order = by_expert.order;
    std::vector<int64_t> xq_rows(rows);  // the rounded row of each position of `order`
    for (int64_t i = 0; i < rows; i++) xq_rows[i] = x_of ? (*x_of)[order[i]] : order[i];
    std::vector<const PackedMatrix *> parts;
    std::vector<std::vector<float *>> out_rows;
    std::vector<Task> tasks;
    int64_t work = 0;
    for (size_t p = 0; p < stacks.size(); p++) {
        const int64_t n = (*stacks[p])[0].n;
        parts.push_back(stacks[p]->data());
        out_rows.emplace_back(rows);
        for (int64_t i = 0; i < rows; i++) out_rows[p][i] = outs[p] + order[i] * n;
        for (int64_t e = 0; e < experts; e++)
            for (int64_t r0 = start[e]; r0 < start[e + 1]; r0 += ROW_BLOCK)
                for (int64_t cb = 0; cb < n / BLOCK; cb++)
                    tasks.push_back(Task{int64_t(p), e, r0, std::min(start[e + 1], r0 + ROW_BLOCK), cb});
        work = std::max(work, rows * n * k);  // threaded where a stack's own product would be (not their sum)
    }
    run_tasks(tasks, parts, xq, xq_rows, out_rows, work);
}

void product(const std::vector<PackedMatrix> &mats, const std::vector<int64_t> &expert_of, const float *x,
             int64_t rows, float *out, const std::vector<int64_t> *x_of = nullptr, int64_t x_rows = -1) {
    gathered_products({&mats}, expert_of, x, rows, {out}, x_of, x_rows);
}

/* outs[p] = x @ mats[p].T for several matrices of the same inputs (a layer's q, k and v; its gate and up):
   x rounded once, every matrix's tasks in one pass over the threads. Each output element is computed as
   `product` computes it alone (block_tile's steps do not depend on the other matrices): the same bits. */
void products(const std::vector<PackedMatrix> &mats, const float *x, int64_t rows, const std::vector<float *> &outs) {
    const int64_t k = mats[0].k;
    const QuantizedRows xq = quantized_rows(x, rows, k);
    std::vector<int64_t> order(rows);
    for (int64_t i = 0; i < rows; i++) order[i] = i;
    std::vector<const PackedMatrix *> parts;
    std::vector<std::vector<float *>> out_rows;
    std::vector<Task> tasks;
    int64_t work = 0;
    for (size_t p = 0; p < mats.size(); p++) {
        const int64_t n = mats[p].n;
        parts.push_back(&mats[p]);
        out_rows.emplace_back(rows);
        for (int64_t i = 0; i < rows; i++) out_rows[p][i] = outs[p] + i * n;
        for (int64_t r0 = 0; r0 < rows; r0 += ROW_BLOCK)
            for (int64_t cb = 0; cb < n / BLOCK; cb++)
                tasks.push_back(Task{int64_t(p), 0, r0, std::min(rows, r0 + ROW_BLOCK), cb});
        work += rows * n * k;
    }
    run_tasks(tasks, parts, xq, order, out_rows, work);
}

/* ---- the MLX operation ------------------------------------------------------------------------------ */

/* Inputs: x [..., k] float32 ([rows, k] when gathered), the repacked w [(experts,) n, k * bits / 32] uint32,
   scales and biases [(experts,) n, k / group_size], and when gathered an expert index per row; or, after the
   experts [pairs], an lhs index per pair (x [x rows, k]: pair p is row lhs[p] of x times expert experts[p],
   out [pairs, n]). */
class Int8Product : public mx::UnaryPrimitive {
   public:
    Int8Product(mx::Stream stream, int group_size, int bits, bool gathered)
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
            const mx::array x = contiguous(inputs[0], keep), w = contiguous(inputs[1], keep),
                            s = contiguous(inputs[2], keep), b = contiguous(inputs[3], keep);
            const int64_t k = x.shape(-1), x_rows = k ? int64_t(x.size()) / k : 0;
            const bool lhs = gathered && inputs.size() > 5;
            const int64_t rows = lhs ? int64_t(inputs[4].size()) : x_rows;
            const int64_t n = w.shape(-2), experts = gathered ? w.shape(0) : 1;
            if (rows == 0 || n == 0 || x_rows == 0) return;
            const std::vector<int64_t> expert_of = experts_of_rows(gathered ? &inputs[4] : nullptr, rows, experts, keep);
            std::vector<PackedMatrix> mats;
            for (int64_t e = 0; e < experts; e++) mats.push_back(packed_matrix(w, s, b, k, bits, group_size, e));
            if (lhs) {
                const std::vector<int64_t> x_of = experts_of_rows(&inputs[5], rows, x_rows, keep);  // clamped as experts
                product(mats, expert_of, x.data<float>(), rows, out.data<float>(), &x_of, x_rows);
            } else {
                product(mats, expert_of, x.data<float>(), rows, out.data<float>());
            }
        });
    }

    void eval_gpu(const std::vector<mx::array> &, mx::array &) override {
        throw std::runtime_error("pipeline's int8 products run on the CPU only");
    }

    const char *name() const override { return gathered_ ? "PipelineInt8GatherQMM" : "PipelineInt8QMM"; }

    bool is_equivalent(const mx::Primitive &other) const override {
        auto *o = dynamic_cast<const Int8Product *>(&other);
        return o && o->group_size_ == group_size_ && o->bits_ == bits_ && o->gathered_ == gathered_;
    }

    std::vector<mx::Shape> output_shapes(const std::vector<mx::array> &inputs) override {
        if (gathered_) return {mx::Shape{inputs[4].shape(0), inputs[1].shape(-2)}};
        mx::Shape shape = inputs[0].shape();
        shape.back() = inputs[1].shape(-2);
        return {shape};
    }

   private:
    int group_size_, bits_;
    bool gathered_;
};

/* Several products of one x (see `products`), inputs x [rows, k] float32 then (w, scales, biases) per matrix,
   all in the int8 layout with one group size and bit width: one output per matrix, or with `swiglu` (two
   matrices, gate and up) the one output silu(gate) * up, computed as MLX computes it (its Sigmoid, then
   two multiplies: models/layers.py's swiglu, by layer_kernels.cpp's swiglu_span), so the same bits as the
   three operations it replaces. */
class Int8Products : public mx::Primitive {
   public:
    Int8Products(mx::Stream stream, int group_size, int bits, bool swiglu)
        : mx::Primitive(stream), group_size_(group_size), bits_(bits), swiglu_(swiglu) {}

    void eval_cpu(const std::vector<mx::array> &inputs, std::vector<mx::array> &outputs) override {
        for (auto &out : outputs) out.set_data(mx::allocator::malloc(out.nbytes()));
        auto &encoder = mx::cpu::get_command_encoder(stream());
        const int group_size = group_size_, bits = bits_;
        const bool swiglu = swiglu_;
        encoder.dispatch([inputs, outputs, group_size, bits, swiglu]() mutable {
            std::vector<mx::array> keep;
            const mx::array x = contiguous(inputs[0], keep);
            const int64_t k = x.shape(-1), rows = x.shape(0);
            std::vector<PackedMatrix> mats;
            for (size_t i = 1; i + 2 < inputs.size(); i += 3) {
                const mx::array w = contiguous(inputs[i], keep), s = contiguous(inputs[i + 1], keep),
                                b = contiguous(inputs[i + 2], keep);
                mats.push_back(packed_matrix(w, s, b, k, bits, group_size));
            }
            if (rows == 0) return;
            if (!swiglu) {
                std::vector<float *> outs;
                for (auto &out : outputs) outs.push_back(out.data<float>());
                products(mats, x.data<float>(), rows, outs);
                return;
            }
            const int64_t size = rows * mats[0].n;
            std::vector<float> up(size);
            float *gate = outputs[0].data<float>();
            products(mats, x.data<float>(), rows, {gate, up.data()});
            swiglu_span(gate, up.data(), gate, size);
        });
    }

    void eval_gpu(const std::vector<mx::array> &, std::vector<mx::array> &) override {
        throw std::runtime_error("pipeline's int8 products run on the CPU only");
    }

    const char *name() const override { return swiglu_ ? "PipelineInt8SwiGLU" : "PipelineInt8Products"; }

    bool is_equivalent(const mx::Primitive &other) const override {
        auto *o = dynamic_cast<const Int8Products *>(&other);
        return o && o->group_size_ == group_size_ && o->bits_ == bits_ && o->swiglu_ == swiglu_;
    }

    std::vector<mx::Shape> output_shapes(const std::vector<mx::array> &inputs) override {
        std::vector<mx::Shape> shapes;
        for (size_t i = 1; i < inputs.size(); i += 3) shapes.push_back(mx::Shape{inputs[0].shape(0), inputs[i].shape(0)});
        if (swiglu_) shapes.resize(1);
        return shapes;
    }

   private:
    int group_size_, bits_;
    bool swiglu_;
};

/* An MoE layer's gathered gate and up with the SwiGLU, one operation: inputs x [x rows, k] float32, (w, scales,
   biases) of the gate's stack then the up's (int8 layout, [experts, n, ...]), the experts uint32/int32 [pairs],
   and optionally an lhs index per pair (pair p is row lhs[p] of x; without: row p). Output [pairs, n]:
   silu(gate) * up as models/experts.py's SwitchGLU.activate computes it (MLX's Sigmoid, then two multiplies:
   swiglu_span),
   the same bits as the two gathered products and the activation it replaces. */
class Int8GatherSwiGLU : public mx::UnaryPrimitive {
   public:
    Int8GatherSwiGLU(mx::Stream stream, int group_size, int bits)
        : mx::UnaryPrimitive(stream), group_size_(group_size), bits_(bits) {}

    void eval_cpu(const std::vector<mx::array> &inputs, mx::array &out) override {
        out.set_data(mx::allocator::malloc(out.nbytes()));
        auto &encoder = mx::cpu::get_command_encoder(stream());
        for (auto &a : inputs) encoder.set_input_array(a);
        encoder.set_output_array(out);
        const int group_size = group_size_, bits = bits_;
        encoder.dispatch([inputs, out, group_size, bits]() mutable {
            std::vector<mx::array> keep;
            const mx::array x = contiguous(inputs[0], keep);
            const int64_t k = x.shape(-1), x_rows = k ? int64_t(x.size()) / k : 0;
            const bool lhs = inputs.size() > 8;
            const int64_t rows = int64_t(inputs[7].size());
            std::vector<PackedMatrix> stacks[2];
            for (int p = 0; p < 2; p++) {
                const mx::array w = contiguous(inputs[1 + 3 * p], keep), s = contiguous(inputs[2 + 3 * p], keep),
                                b = contiguous(inputs[3 + 3 * p], keep);
                for (int64_t e = 0; e < w.shape(0); e++) stacks[p].push_back(packed_matrix(w, s, b, k, bits, group_size, e));
            }
            const int64_t n = out.shape(-1), experts = int64_t(stacks[0].size());
            if (rows == 0 || n == 0 || x_rows == 0 || experts == 0) return;
            const std::vector<int64_t> expert_of = experts_of_rows(&inputs[7], rows, experts, keep);
            std::vector<int64_t> x_of;
            if (lhs) x_of = experts_of_rows(&inputs[8], rows, x_rows, keep);  // clamped as the experts are
            const int64_t size = rows * n;
            std::vector<float> up(size);
            float *gate = out.data<float>();
            gathered_products({&stacks[0], &stacks[1]}, expert_of, x.data<float>(), rows, {gate, up.data()},
                              lhs ? &x_of : nullptr, x_rows);
            swiglu_span(gate, up.data(), gate, size);
        });
    }

    void eval_gpu(const std::vector<mx::array> &, mx::array &) override {
        throw std::runtime_error("pipeline's int8 products run on the CPU only");
    }

    const char *name() const override { return "PipelineInt8GatherSwiGLU"; }

    bool is_equivalent(const mx::Primitive &other) const override {
        auto *o = dynamic_cast<const Int8GatherSwiGLU *>(&other);
        return o && o->group_size_ == group_size_ && o->bits_ == bits_;
    }

    std::vector<mx::Shape> output_shapes(const std::vector<mx::array> &inputs) override {
        return {mx::Shape{inputs[7].shape(0), inputs[1].shape(1)}};
    }

   private:
    int group_size_, bits_;
};

void check(const mx::array &w, const mx::array &s, const mx::array &b, int group_size, int bits) {
    auto fail = [](const std::string &why) { throw std::invalid_argument("pipeline int8: " + why); };
    if (bits != 4 && bits != 8) fail("only 4- and 8-bit weights");
    if (group_size != 32 && group_size != 64 && group_size != 128) fail("group size must be 32, 64 or 128");
    if (w.dtype() != mx::uint32 || w.ndim() < 2 || w.ndim() > 3) fail("w must be packed uint32 [(experts,) n, ...]");
    mx::Shape no_offsets = s.shape();
    no_offsets.back() = 0;  // a symmetric matrix's biases (see int8_repack)
    if ((s.shape() != b.shape() && b.shape() != no_offsets) || s.dtype() != b.dtype() || s.ndim() != w.ndim() ||
        (w.ndim() == 3 && s.shape(0) != w.shape(0)))
        fail("scales and biases must match the weights");
    scale_type_of(s.dtype());
    const int64_t n = w.shape(-2), k = w.shape(-1) * 32 / bits;
    if (n % BLOCK || k % group_size || s.shape(-1) * group_size != k || s.shape(-2) != n)
        fail("shapes do not fit (n must be a multiple of 16, k of the group size)");
}

static size_t shape_size(const mx::Shape &shape) {
    size_t size = 1;
    for (auto d : shape) size *= size_t(d);
    return size;
}

/* An uninitialized row-contiguous array whose bytes start on a 2 MiB boundary, those of its whole 2 MiB
   pages in transparent huge pages where the kernel allows them (madvise, before the first touch). The
   int8 products stream every weight once per token: with 4 KiB pages each product walks a new page
   every 4 KiB and misses the TLB. Measured on the 2-core Zen 4, a 1B Llama's 112 one-row layer products
   (608 MB) back to back: 22.8-24.9 ms in small pages, 19.1-19.8 ms in huge ones. The buffer is
   2 MiB longer than the array; the bytes before its start are never touched, so they cost address
   space, not memory, and the tail after the last whole page stays in small pages (no waste). */
static mx::array huge_page_array(const mx::Shape &shape, mx::Dtype dtype) {
    constexpr size_t HUGE_PAGE = size_t(2) << 20;
    const size_t size = shape_size(shape);
    const size_t nbytes = size * mx::size_of(dtype);
    if (nbytes < HUGE_PAGE) return mx::array(mx::allocator::malloc(nbytes), shape, dtype);
    mx::allocator::Data buffer = mx::allocator::malloc(nbytes + HUGE_PAGE);
    const uintptr_t raw = uintptr_t(buffer.buffer().raw_ptr()), start = (raw + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1);
    madvise(reinterpret_cast<void *>(start), nbytes / HUGE_PAGE * HUGE_PAGE, MADV_HUGEPAGE);
    mx::Strides strides(shape.size(), 1);
    for (int i = int(shape.size()) - 2; i >= 0; i--) strides[i] = strides[i + 1] * shape[i + 1];
    mx::array out(shape, dtype, nullptr, {});
    out.set_data(std::move(buffer), size, strides, mx::array::Flags{true, true, size <= 1}, int64_t(start - raw));
    out.set_status(mx::array::Status::available);
    if (uintptr_t(out.data<uint8_t>()) != start) throw std::runtime_error("pipeline int8: huge_page_array's offset");
    return out;
}

/* Whether every value of a float32 array is a float16 value. GGUF's Q4_0/Q4_1/Q8_0 scales and offsets are
   (times a power of two) float16 in the file and reach us as float32 under --dtype float32; held as
   float16 again they are the same numbers in half the bytes, and a one-row product reads every scale
   once a token: for a 4-bit group-32 matrix, 6 bits a weight become 5. */
static bool all_half_exact(const mx::array &a) {
    const float *p = a.data<float>();
    for (size_t i = 0; i < a.size(); i++)
        if (static_cast<float>(static_cast<mx::float16_t>(p[i])) != p[i]) return false;
    return true;
}

/* Whether every bias is symmetric_offset(bits) times its group's scale, exactly. */
static bool all_symmetric(const mx::array &s, const mx::array &b, int bits) {
    const int type = scale_type_of(s.dtype());
    const void *sp = s.data<void>(), *bp = b.data<void>();
    const float offset = symmetric_offset(bits);
    for (size_t i = 0; i < s.size(); i++)
        if (scale_at(bp, type, int64_t(i)) != scale_at(sp, type, int64_t(i)) * offset) return false;
    return true;
}

/* The four low nibbles of x (bits 0-15) as the low nibbles of four bytes. */
static inline uint32_t spread_nibbles(uint32_t x) {
    return (x & 0xFu) | ((x & 0xF0u) << 4) | ((x & 0xF00u) << 8) | ((x & 0xF000u) << 12);
}

#if defined(__SSE2__)
/* A 4-bit row's 16 bytes of a chunk -> its 4 words in the new order (see int8_repack): byte i < 8 holds
   inputs 2i, 2i+1, byte 8 + i inputs 16 + 2i, 17 + 2i; new byte 2i is the low nibbles of bytes i and 8 + i,
   new byte 2i + 1 their high nibbles: word j is inputs 4j..4j+3 in low nibbles beside 16+4j.. in high ones. */
static inline __m128i block_words(const uint8_t *r) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i *>(r)), high = _mm_srli_si128(x, 8);
    const __m128i low_nibbles = _mm_set1_epi8(0x0F), high_nibbles = _mm_set1_epi8(char(0xF0));
    const __m128i lows = _mm_or_si128(_mm_and_si128(x, low_nibbles), _mm_and_si128(_mm_slli_epi16(high, 4), high_nibbles));
    const __m128i highs = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(x, 4), low_nibbles), _mm_and_si128(high, high_nibbles));
    return _mm_unpacklo_epi8(lows, highs);
}

/* Four rows' words j..j+3 (one row a register) -> line j + q holds word j + q of each, at columns col..col+3. */
static inline void store_transposed(__m128i a, __m128i b, __m128i c, __m128i d, uint32_t *lines, int col) {
    const __m128i ab_low = _mm_unpacklo_epi32(a, b), cd_low = _mm_unpacklo_epi32(c, d);
    const __m128i ab_high = _mm_unpackhi_epi32(a, b), cd_high = _mm_unpackhi_epi32(c, d);
    _mm_storeu_si128(reinterpret_cast<__m128i *>(lines + 0 * BLOCK + col), _mm_unpacklo_epi64(ab_low, cd_low));
    _mm_storeu_si128(reinterpret_cast<__m128i *>(lines + 1 * BLOCK + col), _mm_unpackhi_epi64(ab_low, cd_low));
    _mm_storeu_si128(reinterpret_cast<__m128i *>(lines + 2 * BLOCK + col), _mm_unpacklo_epi64(ab_high, cd_high));
    _mm_storeu_si128(reinterpret_cast<__m128i *>(lines + 3 * BLOCK + col), _mm_unpackhi_epi64(ab_high, cd_high));
}
#endif

/* w, scales, biases in MLX's layout -> the same arrays in the layout of the opening comment. Word at a time:
   in a row's 16 bytes of a chunk, byte m holds inputs 2m (low nibble) and 2m + 1, so inputs 4j..4j+3 are
   its bytes 2j, 2j+1 and inputs 16+4j.. its bytes 8+2j, 9+2j. A block's 16 rows are first copied whole (one
   sequential read, 16 consecutive rows) into a per-thread buffer that stays in L2, then rearranged from there
   into the bytes the block came from, either in a new array or, with `in_place`, in w's own buffer: the
   caller's word that nothing else reads w (a module's weight, replaced by the result). In place, loading
   pays for no second copy of the weights in new memory: fresh pages cost more than the rearranging (page
   faults, and on a VM the host's own first touch). Measured on the 2-core Zen 4, an 8192 x 8192 4-bit
   matrix: 91 ms a byte at a time reading the 16 rows in place, 40 ms a word at a time with the rows
   prefetched, 8-10 ms through the block buffer (SSE2 shuffles), copying or in place. */
std::tuple<mx::array, mx::array, mx::array> int8_repack(mx::array w, mx::array s, mx::array b, int group_size,
                                                        int bits, bool in_place) {
    check(w, s, b, group_size, bits);
    mx::eval({w, s, b});
    std::vector<mx::array> keep;
    // only a buffer no other array shares (a view of it, the embedding a tied head is a copy of) and MLX's
    // allocator owns is rewritten
    in_place = in_place && w.flags().row_contiguous && sole_owned_buffer(w);
    w = contiguous(w, keep);
    s = contiguous(s, keep);
    b = contiguous(b, keep);
    // float32 scales and biases that are all float16 values are held as float16 (converted while copied)
    const bool to_half = s.dtype() == mx::float32 && all_half_exact(s) && all_half_exact(b);
    const mx::Dtype held = to_half ? mx::float16 : s.dtype();
    // biases that are all -2^(bits - 1) times their scales (GGUF's Q4_0, Q8_0) are not kept: the kernel
    // makes each from its scale, the same float (a power of two times it), and a token reads 1/10 fewer bytes
    const bool symmetric = all_symmetric(s, b, bits);
    mx::Shape bias_shape = b.shape();
    if (symmetric) bias_shape.back() = 0;
    const int64_t n = w.shape(-2), k = w.shape(-1) * 32 / bits, experts = w.ndim() == 3 ? w.shape(0) : 1;
    const int64_t row_bytes = k * bits / 8, groups = k / group_size, chunks = k / CHUNK, item = s.itemsize();
    // in place, scales and biases that keep their dtype are rearranged in their own buffers too; new arrays
    // are in huge pages either way (in place does not say the rank's malloc is: a GGUF's weights decoded into
    // huge pages of their own are rearranged in place, their float32 scales become new float16 ones)
    const auto own_or_new = [&](const mx::array &a, const mx::Shape &shape, mx::Dtype dtype) {
        if (in_place && a.dtype() == dtype && a.shape() == shape && a.flags().row_contiguous && sole_owned_buffer(a))
            return a;
        return huge_page_array(shape, dtype);
    };
    mx::array w2 = in_place ? w : huge_page_array(w.shape(), w.dtype());
    mx::array s2 = own_or_new(s, s.shape(), held), b2 = own_or_new(b, bias_shape, held);
    const uint8_t *src = w.data<uint8_t>();
    uint8_t *dst = w2.data<uint8_t>();
    const int64_t blocks = experts * (n / BLOCK);
    on_threads(blocks, [&](int64_t first, int64_t last) {
        std::vector<uint8_t> block_rows(BLOCK * row_bytes), block_scales(BLOCK * groups * item);
        for (int64_t blk = first; blk < last; blk++) {
            const int64_t e = blk / (n / BLOCK), cb = blk % (n / BLOCK);
            const int64_t at = (e * n + cb * BLOCK) * row_bytes;  // a block's bytes stay where its rows were
            std::memcpy(block_rows.data(), src + at, BLOCK * row_bytes);
            const uint8_t *rows = block_rows.data();  // the block's 16 rows, MLX's layout
            uint8_t *out = dst + at;
            for (int64_t c = 0; c < chunks; c++) {
                const uint8_t *chunk_rows = rows + c * CHUNK * bits / 8;  // row col's chunk at col * row_bytes
                uint32_t *lines = reinterpret_cast<uint32_t *>(out + c * chunk_bytes(bits));
#if defined(__SSE2__)
                for (int col = 0; col < BLOCK; col += 4) {  // four rows at a time: their words, transposed
                    const uint8_t *r = chunk_rows + col * row_bytes;
                    if (bits == 4) {
                        store_transposed(block_words(r), block_words(r + row_bytes), block_words(r + 2 * row_bytes),
                                         block_words(r + 3 * row_bytes), lines, col);
                        continue;
                    }
                    for (int half = 0; half < 2; half++) {  // 8-bit: words 0-3, then 4-7, as stored
                        auto load = [&](int q) { return _mm_loadu_si128(reinterpret_cast<const __m128i *>(r + q * row_bytes + 16 * half)); };
                        store_transposed(load(0), load(1), load(2), load(3), lines + 4 * BLOCK * half, col);
                    }
                }
#else
                for (int j = 0; j < bits; j++)
                    for (int col = 0; col < BLOCK; col++) {
                        const uint8_t *r = chunk_rows + col * row_bytes;
                        uint32_t word;
                        if (bits == 8) {
                            std::memcpy(&word, r + 4 * j, 4);
                        } else {
                            uint16_t low, high;
                            std::memcpy(&low, r + 2 * j, 2);
                            std::memcpy(&high, r + 8 + 2 * j, 2);
                            word = spread_nibbles(low) | (spread_nibbles(high) << 4);
                        }
                        lines[j * BLOCK + col] = word;
                    }
#endif
            }
            for (const auto &[from, to] : {std::pair{&s, &s2}, std::pair{&b, &b2}}) {
                if (to->size() == 0) continue;  // a symmetric matrix's biases
                // copied first: `to` may be `from` (in place)
                std::memcpy(block_scales.data(), from->data<uint8_t>() + (e * n + cb * BLOCK) * groups * item,
                            BLOCK * groups * item);
                const uint8_t *in = block_scales.data();
                uint8_t *o = to->data<uint8_t>() + (e * n + cb * BLOCK) * groups * to->itemsize();
                for (int64_t g = 0; g < groups; g++)
                    for (int col = 0; col < BLOCK; col++) {
                        const uint8_t *value = in + (col * groups + g) * item;
                        if (to_half) {
                            float f;
                            std::memcpy(&f, value, 4);
                            const mx::float16_t h = static_cast<mx::float16_t>(f);
                            std::memcpy(o + (g * BLOCK + col) * 2, &h, 2);
                        } else {
                            std::memcpy(o + (g * BLOCK + col) * item, value, item);
                        }
                    }
            }
        }
    });
    return {w2, s2, b2};
}

/* ---- a tied 8-bit embedding's LM head, from the embedding's own bytes ---------------------------------- */

/* An 8-bit matrix held row by row, as a tied embedding is for its lookups, multiplied with the bits the int8
   repack's copy of it gives (block_tile above, 8 bits), so the head needs no copy:
     GGUF Q8_0 as the file's row bytes (checkpoints/quants.py TIED_BLOCKS): per 32 values a block of 34 bytes, d
       (fp16) then q[32] (int8), w = d q: scale d, bias -128 d, codes u = q + 128;
     MLX's affine 8-bit (a converted GGUF's Q8_0, an MLX checkpoint's 8 bits): codes u [n, k] uint8 (w packed as
       uint32), scales and biases [n, k / group_size] (float32, float16 or bfloat16; biases may be absent: a
       symmetric matrix, each bias -128 times its scale).
   Per chunk of 32 inputs isum = sum(u xq), an exact integer, then acc = fma(isum, s dx, acc); acc = fma(b, sx, acc),
   in order over k, for every output. isum is computed as sum(q xq) + 128 sum(xq) (q = u - 128) where that is the
   cheaper form (AVX2, generic): the same integer. Sixteen columns at a time: their integer sums land in the 16
   lanes, as block_tile's do; their scales and biases are gathered into a table per 16 columns first. */
constexpr int64_t Q8_BYTES = 34;

struct RowMajor8 {
    const uint8_t *codes;  // GGUF: the blocks; MLX: the codes
    const void *scales, *biases;  // MLX only (biases nullptr: symmetric)
    int scale_type;
    bool gguf;
    int64_t n, k, per_group;  // per_group: chunks per scale (MLX)

    int64_t row_bytes() const { return gguf ? k / CHUNK * Q8_BYTES : k; }
    int64_t chunk_at(int64_t c) const { return gguf ? c * Q8_BYTES + 2 : c * CHUNK; }
};

/* The 16 integer sums sum(u xq) of chunk c of columns cols[0..15] (pointers to their rows) against xq's 32 values. */
template <bool gguf>
inline i32x16 q8_column_sums(const uint8_t *const *cols, int64_t at, const int8_t *xq) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    const __m512i x = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(xq)));
    const __m512i flip = _mm512_set1_epi8(char(0x80));
    __m512i pair[8];
    for (int p = 0; p < 8; p++) {  // columns 2p (lanes 0-7) and 2p + 1 (lanes 8-15), 8 partial sums each
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(cols[2 * p] + at));
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(cols[2 * p + 1] + at));
        __m512i u = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
        if constexpr (gguf) u = _mm512_xor_si512(u, flip);  // q + 128
        pair[p] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, x);
    }
    __m512i quad[4];  // 128-bit quarter j of quad[i]: column 4i + j's 4 partial sums
    for (int i = 0; i < 4; i++)
        quad[i] = _mm512_add_epi32(_mm512_shuffle_i64x2(pair[2 * i], pair[2 * i + 1], 0x88),
                                   _mm512_shuffle_i64x2(pair[2 * i], pair[2 * i + 1], 0xDD));
    const __m512i a = _mm512_add_epi32(_mm512_unpacklo_epi32(quad[0], quad[1]), _mm512_unpackhi_epi32(quad[0], quad[1]));
    const __m512i b = _mm512_add_epi32(_mm512_unpacklo_epi32(quad[2], quad[3]), _mm512_unpackhi_epi32(quad[2], quad[3]));
    const __m512i total = _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));  // lane 4j + i: column 4i + j
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return (i32x16)_mm512_permutexvar_epi32(order, total);
#elif defined(__AVX2__)
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(xq)), ones = _mm256_set1_epi16(1);
    // 128 sum(xq), once for all columns
    const __m256i xs = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), x), ones);
    __m128i xs4 = _mm_add_epi32(_mm256_castsi256_si128(xs), _mm256_extracti128_si256(xs, 1));
    xs4 = _mm_add_epi32(xs4, _mm_shuffle_epi32(xs4, 0x4E));
    xs4 = _mm_add_epi32(xs4, _mm_shuffle_epi32(xs4, 0xB1));
    const __m256i offset = _mm256_slli_epi32(_mm256_broadcastd_epi32(xs4), 7);
    i32x16 out;
    for (int half = 0; half < 2; half++) {
        __m256i d[8];
        for (int i = 0; i < 8; i++) {  // sum(q xq) in 8 lanes: |q| <= 128 times xq signed as q, pairs within int16
            __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(cols[8 * half + i] + at));
            if constexpr (!gguf) q = _mm256_xor_si256(q, _mm256_set1_epi8(char(0x80)));  // u - 128
            d[i] = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(x, q)), ones);
        }
        const __m256i h0 = _mm256_hadd_epi32(_mm256_hadd_epi32(d[0], d[1]), _mm256_hadd_epi32(d[2], d[3]));
        const __m256i h1 = _mm256_hadd_epi32(_mm256_hadd_epi32(d[4], d[5]), _mm256_hadd_epi32(d[6], d[7]));
        const __m256i sums = _mm256_add_epi32(_mm256_permute2x128_si256(h0, h1, 0x20), _mm256_permute2x128_si256(h0, h1, 0x31));
        const __m256i with = _mm256_add_epi32(sums, offset);
        std::memcpy(reinterpret_cast<int32_t *>(&out) + 8 * half, &with, 32);
    }
    return out;
#else
    int32_t xsum = 0;
    for (int i = 0; i < CHUNK; i++) xsum += xq[i];
    i32x16 out;
    for (int col = 0; col < BLOCK; col++) {
        int32_t s = 0;
        for (int i = 0; i < CHUNK; i++) s += int32_t(int8_t(cols[col][at + i] ^ (gguf ? 0 : 0x80))) * xq[i];  // q xq
        out[col] = s + 128 * xsum;
    }
    return out;
#endif
}

/* Columns [16 cb, 16 cb + 16) of rows [r0, r0 + R) of x: block_tile's arithmetic, R rows sharing the columns' bytes.
   s, b: the columns' scales and biases, 16 a chunk. */
template <bool gguf, int R>
void q8_tile(const RowMajor8 &m, const uint8_t *const *cols, const float *s, const float *b, const QuantizedRows &xq,
             int64_t r0, v16 *acc) {
    const int64_t chunks = m.k / CHUNK, ahead = BLOCK * m.row_bytes() / chunks;
    for (int r = 0; r < R; r++) acc[r] = v16{};
    for (int64_t c = 0; c < chunks; c++) {
        if (r0 == 0) prefetch_span(cols[0] + PREFETCH_AHEAD + c * ahead, ahead);
        const v16 sc = load16(s + BLOCK * c), bc = load16(b + BLOCK * c);
        const int64_t at = m.chunk_at(c);
        for (int r = 0; r < R; r++) {
            const int64_t i = (r0 + r) * chunks + c;
            const i32x16 isum = q8_column_sums<gguf>(cols, at, xq.q.data() + (r0 + r) * m.k + c * CHUNK);
            acc[r] = fma16(__builtin_convertvector(isum, v16), sc * splat(xq.d[i]), acc[r]);
            acc[r] = fma16(bc, splat(xq.sum[i]), acc[r]);
        }
    }
}

template <bool gguf, int R = 1>
void q8_tile_of(int64_t count, const RowMajor8 &m, const uint8_t *const *cols, const float *s, const float *b,
                const QuantizedRows &xq, int64_t r0, v16 *acc) {
    if constexpr (R < TILE) {
        if (count != R) return q8_tile_of<gguf, R + 1>(count, m, cols, s, b, xq, r0, acc);
    }
    q8_tile<gguf, R>(m, cols, s, b, xq, r0, acc);
}

/* The float products of Q8_0 blocks (where int8 ones are not asked for): w = d q exactly, a chunk's 32 inputs in
   two 16-lane fused multiply-adds per output (lane l: inputs l and l + 16), one lane tree at the end. */
float q8_float_dot(const uint8_t *row, int64_t k, const float *x) {
    v16 acc{};
    for (int64_t c = 0; c < k / CHUNK; c++) {
        mx::float16_t h;
        std::memcpy(&h, row + c * Q8_BYTES, 2);
        const float d = static_cast<float>(h);
        const int8_t *q = reinterpret_cast<const int8_t *>(row + c * Q8_BYTES + 2);
        float w[32];
        for (int i = 0; i < CHUNK; i++) w[i] = d * float(q[i]);  // exact
        acc = fma16(load16(w), load16(x + c * CHUNK), acc);
        acc = fma16(load16(w + 16), load16(x + c * CHUNK + 16), acc);
    }
    return lanes_sum(acc);
}

/* Chunk `at` of 16 columns in the int8 layout (8 bits): byte 4 i + b of step j (64 bytes) is column i's byte 4 j + b. */
template <bool gguf>
inline void q8_repack_chunk(const uint8_t *const *cols, int64_t at, uint8_t *dst) {
#if defined(__AVX512F__)
    // a 16 x 8 transpose of 4-byte words: z[p] holds columns p (low half) and p + 8; three exchanges of a register
    // index bit with a lane index bit (column bits 2, 1, 0 with word bits 2, 1, 0) leave word j of column i in lane
    // i of register j
    __m512i z[8];
    for (int p = 0; p < 8; p++)
        z[p] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(cols[p] + at))),
                                  _mm256_loadu_si256(reinterpret_cast<const __m256i *>(cols[p + 8] + at)), 1);
    // per exchange r = 4, 2, 1: lane x of the low register from A's x or B's x ^ r, of the high one A's x | r or B's x
    alignas(64) static constexpr int32_t index[3][2][16] = {
        {{0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27}, {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31}},
        {{0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29}, {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31}},
        {{0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}, {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31}},
    };
    for (int bit = 2; bit >= 0; bit--) {
        const int r = 1 << bit;
        const __m512i ilo = _mm512_load_si512(index[2 - bit][0]), ihi = _mm512_load_si512(index[2 - bit][1]);
        for (int a = 0; a < 8; a++)
            if (!(a & r)) {
                const __m512i A = z[a], B = z[a | r];
                z[a] = _mm512_permutex2var_epi32(A, ilo, B);
                z[a | r] = _mm512_permutex2var_epi32(A, ihi, B);
            }
    }
    for (int j = 0; j < 8; j++) {
        if constexpr (gguf) z[j] = _mm512_xor_si512(z[j], _mm512_set1_epi8(char(0x80)));  // q + 128
        _mm512_storeu_si512(dst + 64 * j, z[j]);
    }
#else
    for (int j = 0; j < 8; j++)
        for (int i = 0; i < BLOCK; i++)
            for (int b = 0; b < 4; b++) dst[64 * j + 4 * i + b] = cols[i][at + 4 * j + b] ^ (gguf ? 0x80 : 0);
#endif
}

/* n 16-bit floats (fp16, or bf16's top halves) as float32, exactly. */
inline void halves_to_floats(const uint16_t *h, float *f, int64_t n, bool bf16) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(h + i));
        _mm512_storeu_ps(f + i, bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)) : _mm512_cvtph_ps(v));
    }
#elif defined(__F16C__) && defined(__AVX2__)
    for (; i + 8 <= n; i += 8) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i *>(h + i));
        _mm256_storeu_ps(f + i, bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16)) : _mm256_cvtph_ps(v));
    }
#endif
    for (; i < n; i++) f[i] = scale_at(h + i, bf16 ? SCALE_BF16 : SCALE_F16, 0);
}

/* The scales and biases of column block cb, 16 a chunk (s, b [chunks * 16]), as floats (exact); bits16: room for
   2 chunks * 16 16-bit values. */
template <bool gguf>
void q8_tables(const RowMajor8 &m, int64_t cb, int64_t valid, const uint8_t *const *cols, float *s, float *b,
               uint16_t *bits16) {
    const int64_t chunks = m.k / CHUNK, groups = chunks / m.per_group;
    if constexpr (gguf) {
        for (int i = 0; i < BLOCK; i++)
            for (int64_t c = 0; c < chunks; c++) std::memcpy(bits16 + c * BLOCK + i, cols[i] + c * Q8_BYTES, 2);
        halves_to_floats(bits16, s, chunks * BLOCK, false);
        for (int64_t j = 0; j < chunks * BLOCK; j++) b[j] = s[j] * symmetric_offset(8);  // exact: a power of two
        return;
    }
    for (int half = 0; half < 2; half++) {
        const void *from = half ? m.biases : m.scales;
        float *to = half ? b : s;
        if (from == nullptr) {  // symmetric
            for (int64_t j = 0; j < chunks * BLOCK; j++) b[j] = s[j] * symmetric_offset(8);  // exact: a power of two
            continue;
        }
        auto fill = [&](auto *dst, const auto *src) {  // dst[c * 16 + i] = column i's value for chunk c
            for (int i = 0; i < BLOCK; i++) {
                const auto *row = src + (cb * BLOCK + std::min<int64_t>(i, valid - 1)) * groups;
                if (m.per_group == 1) {
                    for (int64_t c = 0; c < chunks; c++) dst[c * BLOCK + i] = row[c];
                } else {
                    for (int64_t g = 0, c = 0; g < groups; g++)
                        for (int64_t j = 0; j < m.per_group; j++, c++) dst[c * BLOCK + i] = row[g];
                }
            }
        };
        if (m.scale_type == SCALE_F32) {
            fill(to, static_cast<const float *>(from));
        } else {
            fill(bits16, static_cast<const uint16_t *>(from));
            halves_to_floats(bits16, to, chunks * BLOCK, m.scale_type == SCALE_BF16);
        }
    }
}

constexpr int64_t Q8_REPACK_ROWS = 4;  // from this many rows, a column block is rearranged for block_tile first

template <bool gguf>
void q8_int8_product(const RowMajor8 &m, const QuantizedRows &xq, int64_t rows, float *out, bool threaded) {
    const int64_t n = m.n, row_bytes = m.row_bytes(), column_blocks = (n + BLOCK - 1) / BLOCK, chunks = m.k / CHUNK;
#pragma omp parallel num_threads(g_threads) if (threaded)
    {
    std::vector<float> s(chunks * BLOCK), b(chunks * BLOCK);  // the 16 columns' scales and biases, chunk by chunk
    std::vector<uint16_t> bits16(2 * chunks * BLOCK);
    std::vector<uint8_t> packed(rows >= Q8_REPACK_ROWS ? chunks * chunk_bytes(8) : 0);
    std::vector<int64_t> order(rows >= Q8_REPACK_ROWS ? rows : 0);
    std::vector<float *> outs(order.size());
    for (size_t r = 0; r < order.size(); r++) order[r] = int64_t(r);
#pragma omp for schedule(static)
    for (int64_t cb = 0; cb < column_blocks; cb++) {
        const uint8_t *cols[BLOCK];
        const int64_t valid = std::min<int64_t>(BLOCK, n - cb * BLOCK);
        for (int i = 0; i < BLOCK; i++) {
            const int64_t col = cb * BLOCK + std::min<int64_t>(i, valid - 1);  // past n: the last column again
            cols[i] = m.codes + col * row_bytes;
        }
        if (!gguf) {  // MLX's scales and biases of the column block as far ahead as q8_tile's codes
            const int64_t item = m.scale_type == SCALE_F32 ? 4 : 2, groups = chunks / m.per_group;
            const int64_t ahead = std::max<int64_t>(1, PREFETCH_AHEAD / (BLOCK * row_bytes));
            for (const void *table : {m.scales, m.biases})
                if (table) prefetch_span(static_cast<const uint8_t *>(table) + (cb + ahead) * BLOCK * groups * item, BLOCK * groups * item);
        }
        q8_tables<gguf>(m, cb, valid, cols, s.data(), b.data(), bits16.data());
        if (rows >= Q8_REPACK_ROWS && cb + 1 < column_blocks)  // q8_tile does not run: the next block's bytes at once
            prefetch_span(m.codes + (cb + 1) * BLOCK * row_bytes, std::min<int64_t>(BLOCK, n - (cb + 1) * BLOCK) * row_bytes);
        if (rows >= Q8_REPACK_ROWS && valid == BLOCK) {
            // many rows: the 16 columns rearranged into the int8 layout first (block_tile's, one column block whose
            // scales and biases are the tables above, one group a chunk), then block_tile's own steps
            for (int64_t c = 0; c < chunks; c++) q8_repack_chunk<gguf>(cols, m.chunk_at(c), packed.data() + c * chunk_bytes(8));
            const PackedMatrix block{packed.data(), s.data(), b.data(), SCALE_F32, BLOCK, m.k, chunks, 8, CHUNK};
            for (int64_t r = 0; r < rows; r++) outs[r] = out + r * n + cb * BLOCK;
            column_block<8>(block, 0, xq, order.data(), outs.data(), rows);
            continue;
        }
        v16 acc[TILE];
        for (int64_t r0 = 0; r0 < rows; r0 += TILE) {
            const int64_t count = std::min<int64_t>(TILE, rows - r0);
            q8_tile_of<gguf>(count, m, cols, s.data(), b.data(), xq, r0, acc);
            for (int64_t r = 0; r < count; r++) {
                float lanes[BLOCK];
                store16(lanes, acc[r]);
                std::memcpy(out + (r0 + r) * n + cb * BLOCK, lanes, valid * sizeof(float));
            }
        }
    }
    }
}

void q8_product(const RowMajor8 &m, const float *x, int64_t rows, float *out, bool int8) {
    const int64_t n = m.n, k = m.k;
    const bool threaded = g_threads > 1 && n > BLOCK && rows * n * k >= THREADED_MIN_WORK;
    if (!int8) {  // GGUF's blocks only (an MLX layout's float products are qmm_kernels.cpp's)
#pragma omp parallel for schedule(static) num_threads(g_threads) if (threaded)
        for (int64_t col = 0; col < n; col++)
            for (int64_t r = 0; r < rows; r++) out[r * n + col] = q8_float_dot(m.codes + col * m.row_bytes(), k, x + r * k);
        return;
    }
    const QuantizedRows xq = quantized_rows(x, rows, k);
    if (m.gguf)
        q8_int8_product<true>(m, xq, rows, out, threaded);
    else
        q8_int8_product<false>(m, xq, rows, out, threaded);
}

/* Inputs: x [..., k] float32, then GGUF: blocks [n, k / 32 * 34] (any dtype: its bytes); MLX: w [n, k / 4] uint32,
   scales and biases [n, k / group_size] (biases [n, 0]: symmetric). */
class RowMajor8Product : public mx::UnaryPrimitive {
   public:
    RowMajor8Product(mx::Stream stream, bool gguf, bool int8, int group_size)
        : mx::UnaryPrimitive(stream), gguf_(gguf), int8_(int8), group_size_(group_size) {}

    void eval_cpu(const std::vector<mx::array> &inputs, mx::array &out) override {
        out.set_data(mx::allocator::malloc(out.nbytes()));
        auto &encoder = mx::cpu::get_command_encoder(stream());
        for (auto &a : inputs) encoder.set_input_array(a);
        encoder.set_output_array(out);
        const bool gguf = gguf_, int8 = int8_;
        const int group_size = group_size_;
        encoder.dispatch([inputs, out, gguf, int8, group_size]() mutable {
            std::vector<mx::array> keep;
            const mx::array x = contiguous(inputs[0], keep), w = contiguous(inputs[1], keep);
            const int64_t k = x.shape(-1), rows = k ? int64_t(x.size()) / k : 0, n = w.shape(0);
            if (rows == 0 || n == 0) return;
            RowMajor8 m{w.data<uint8_t>(), nullptr, nullptr, SCALE_F32, gguf, n, k, group_size / CHUNK};
            if (!gguf) {
                const mx::array s = contiguous(inputs[2], keep), b = contiguous(inputs[3], keep);
                m.scales = s.data<void>();
                m.biases = b.shape(-1) ? b.data<void>() : nullptr;
                m.scale_type = scale_type_of(s.dtype());
            }
            q8_product(m, x.data<float>(), rows, out.data<float>(), int8);
        });
    }

    void eval_gpu(const std::vector<mx::array> &, mx::array &) override {
        throw std::runtime_error("pipeline's int8 products run on the CPU only");
    }

    const char *name() const override { return "PipelineRowMajor8Product"; }

    bool is_equivalent(const mx::Primitive &other) const override {
        auto *o = dynamic_cast<const RowMajor8Product *>(&other);
        return o && o->gguf_ == gguf_ && o->int8_ == int8_ && o->group_size_ == group_size_;
    }

    std::vector<mx::Shape> output_shapes(const std::vector<mx::array> &inputs) override {
        mx::Shape shape = inputs[0].shape();
        shape.back() = inputs[1].shape(0);
        return {shape};
    }

   private:
    bool gguf_, int8_;
    int group_size_;
};

mx::Stream cpu_stream() { return mx::default_stream(mx::Device(mx::Device::cpu)); }

}  // namespace

void register_int8(nb::module_ &m) {
    m.def("int8_isa", []() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
        return std::string("AVX-512 VNNI");
#elif defined(__AVX512BW__)
        return std::string("AVX-512BW");
#elif defined(__AVX2__)
        return std::string("AVX2");
#else
        return std::string("generic");
#endif
    });
    m.def("int8_repack", &int8_repack, nb::arg("w"), nb::arg("scales"), nb::arg("biases"), nb::arg("group_size"),
          nb::arg("bits"), nb::arg("in_place") = false,
          "MLX affine 4/8-bit (w, scales, biases) -> the int8 products' layout (same shapes), now; in_place: "
          "the weights rearranged in w's own buffer (nothing else may read w afterwards)");
    m.def(
        "huge_page_array", [](const std::vector<int> &shape, mx::Dtype dtype) {
            return huge_page_array(mx::Shape(shape.begin(), shape.end()), dtype);
        },
        nb::arg("shape"), nb::arg("dtype"),
        "an uninitialized array in transparent huge pages where the kernel allows (a decoder fills it; the int8 "
        "repack may then rearrange it in place)");
    m.def(
        "int8_matmul",
        [](const mx::array &x, const mx::array &w, const mx::array &s, const mx::array &b, int group_size, int bits) {
            check(w, s, b, group_size, bits);
            if (w.ndim() != 2 || x.ndim() < 1 || x.dtype() != mx::float32 || x.shape(-1) != w.shape(-1) * 32 / bits)
                throw std::invalid_argument("pipeline int8: x must be float32 [..., k] against w [n, k * bits / 32]");
            mx::Shape shape = x.shape();
            shape.back() = w.shape(0);
            return mx::array(shape, mx::float32, std::make_shared<Int8Product>(cpu_stream(), group_size, bits, false),
                             {x, w, s, b});
        },
        "x [..., k] float32 @ (repacked w).T with x rounded to int8 per 32 inputs -> [..., n], lazily");
    m.def(
        "int8_gather_qmm",
        [](const mx::array &x, const mx::array &w, const mx::array &s, const mx::array &b, const mx::array &experts,
           int group_size, int bits) {
            check(w, s, b, group_size, bits);
            if (w.ndim() != 3 || x.ndim() != 2 || x.dtype() != mx::float32 || x.shape(-1) != w.shape(-1) * 32 / bits)
                throw std::invalid_argument("pipeline int8: x must be float32 [rows, k] against w [experts, n, ...]");
            if (experts.ndim() != 1 || experts.shape(0) != x.shape(0) ||
                (experts.dtype() != mx::uint32 && experts.dtype() != mx::int32))
                throw std::invalid_argument("pipeline int8: one int32/uint32 expert index per row");
            return mx::array(mx::Shape{x.shape(0), w.shape(1)}, mx::float32,
                             std::make_shared<Int8Product>(cpu_stream(), group_size, bits, true),
                             {x, w, s, b, experts});
        },
        "row r of x [rows, k] times expert experts[r] of the repacked w -> [rows, n], lazily");
    m.def(
        "int8_gather_qmm",
        [](const mx::array &x, const mx::array &w, const mx::array &s, const mx::array &b, const mx::array &experts,
           int group_size, int bits, const mx::array &lhs) {
            check(w, s, b, group_size, bits);
            if (w.ndim() != 3 || x.ndim() != 2 || x.dtype() != mx::float32 || x.shape(-1) != w.shape(-1) * 32 / bits)
                throw std::invalid_argument("pipeline int8: x must be float32 [rows, k] against w [experts, n, ...]");
            if (experts.ndim() != 1 || lhs.ndim() != 1 || lhs.shape(0) != experts.shape(0) ||
                (experts.dtype() != mx::uint32 && experts.dtype() != mx::int32) ||
                (lhs.dtype() != mx::uint32 && lhs.dtype() != mx::int32))
                throw std::invalid_argument("pipeline int8: one int32/uint32 expert index and row index (lhs) per pair");
            return mx::array(mx::Shape{experts.shape(0), w.shape(1)}, mx::float32,
                             std::make_shared<Int8Product>(cpu_stream(), group_size, bits, true),
                             {x, w, s, b, experts, lhs});
        },
        "pair p: row lhs[p] of x [rows, k] (rounded once for all its pairs) times expert experts[p] of the repacked "
        "w -> [pairs, n], lazily");
    auto gather_swiglu = [](const mx::array &x, const std::vector<mx::array> &ws, const std::vector<mx::array> &ss,
                            const std::vector<mx::array> &bs, const mx::array &experts, int group_size, int bits,
                            const mx::array *lhs) {
        if (ws.size() != 2 || ss.size() != 2 || bs.size() != 2)
            throw std::invalid_argument("pipeline int8: (w, scales, biases) of gate and up");
        if (x.ndim() != 2 || x.dtype() != mx::float32)
            throw std::invalid_argument("pipeline int8: x must be float32 [rows, k]");
        std::vector<mx::array> inputs{x};
        for (size_t i = 0; i < 2; i++) {
            check(ws[i], ss[i], bs[i], group_size, bits);
            if (ws[i].ndim() != 3 || x.shape(-1) != ws[i].shape(-1) * 32 / bits || ws[i].shape(0) != ws[0].shape(0) ||
                ws[i].shape(1) != ws[0].shape(1))
                throw std::invalid_argument("pipeline int8: gate and up must be stacks [experts, n, k * bits / 32] alike");
            inputs.insert(inputs.end(), {ws[i], ss[i], bs[i]});
        }
        const int64_t pairs = experts.ndim() == 1 ? experts.shape(0) : -1;
        if (pairs < 0 || (experts.dtype() != mx::uint32 && experts.dtype() != mx::int32) ||
            (lhs && (lhs->ndim() != 1 || lhs->shape(0) != pairs || (lhs->dtype() != mx::uint32 && lhs->dtype() != mx::int32))) ||
            (!lhs && x.shape(0) != pairs))
            throw std::invalid_argument("pipeline int8: one int32/uint32 expert index (and row index, lhs) per pair");
        inputs.push_back(experts);
        if (lhs) inputs.push_back(*lhs);
        return mx::array(mx::Shape{int(pairs), ws[0].shape(1)}, mx::float32,
                         std::make_shared<Int8GatherSwiGLU>(cpu_stream(), group_size, bits), inputs);
    };
    m.def(
        "int8_gather_swiglu",
        [gather_swiglu](const mx::array &x, const std::vector<mx::array> &ws, const std::vector<mx::array> &ss,
                        const std::vector<mx::array> &bs, const mx::array &experts, int group_size, int bits) {
            return gather_swiglu(x, ws, ss, bs, experts, group_size, bits, nullptr);
        },
        "silu(x[p] @ gate[experts[p]].T) * (x[p] @ up[experts[p]].T) for each row p, (gate, up) repacked stacks, as one "
        "operation (x rounded once), lazily");
    m.def(
        "int8_gather_swiglu",
        [gather_swiglu](const mx::array &x, const std::vector<mx::array> &ws, const std::vector<mx::array> &ss,
                        const std::vector<mx::array> &bs, const mx::array &experts, int group_size, int bits,
                        const mx::array &lhs) {
            return gather_swiglu(x, ws, ss, bs, experts, group_size, bits, &lhs);
        },
        "the same for pair p: row lhs[p] of x (each row rounded once), expert experts[p], lazily");
    auto fused = [](const mx::array &x, const std::vector<mx::array> &ws, const std::vector<mx::array> &ss,
                    const std::vector<mx::array> &bs, int group_size, int bits, bool swiglu) {
        if (ws.empty() || ws.size() != ss.size() || ws.size() != bs.size() || (swiglu && ws.size() != 2))
            throw std::invalid_argument("pipeline int8: one (w, scales, biases) per matrix (gate and up for swiglu)");
        if (x.ndim() != 2 || x.dtype() != mx::float32)
            throw std::invalid_argument("pipeline int8: x must be float32 [rows, k]");
        std::vector<mx::array> inputs{x};
        for (size_t i = 0; i < ws.size(); i++) {
            check(ws[i], ss[i], bs[i], group_size, bits);
            if (ws[i].ndim() != 2 || x.shape(-1) != ws[i].shape(-1) * 32 / bits ||
                (swiglu && ws[i].shape(0) != ws[0].shape(0)))
                throw std::invalid_argument("pipeline int8: every w must be [n, k * bits / 32] for x's k");
            inputs.insert(inputs.end(), {ws[i], ss[i], bs[i]});
        }
        std::vector<mx::Shape> shapes;
        for (auto &w : ws) shapes.push_back(mx::Shape{x.shape(0), w.shape(0)});
        if (swiglu) shapes.resize(1);
        const std::vector<mx::Dtype> dtypes(shapes.size(), mx::float32);
        return mx::array::make_arrays(shapes, dtypes, std::make_shared<Int8Products>(cpu_stream(), group_size, bits, swiglu),
                                      inputs);
    };
    m.def(
        "int8_products",
        [fused](const mx::array &x, const std::vector<mx::array> &ws, const std::vector<mx::array> &ss,
                const std::vector<mx::array> &bs, int group_size, int bits) {
            return fused(x, ws, ss, bs, group_size, bits, false);
        },
        "[x @ w.T for each repacked (w, scales, biases)], x [rows, k] rounded to int8 once, as one operation, lazily");
    m.def(
        "int8_swiglu",
        [fused](const mx::array &x, const std::vector<mx::array> &ws, const std::vector<mx::array> &ss,
                const std::vector<mx::array> &bs, int group_size, int bits) {
            return fused(x, ws, ss, bs, group_size, bits, true)[0];
        },
        "silu(x @ gate.T) * (x @ up.T) for (gate, up) repacked, as models/layers.py's swiglu rounds it, lazily");
    m.def(
        "gguf_q8_0_matmul",
        [](const mx::array &x, const mx::array &blocks, int type, bool int8) {
            const int64_t k = x.ndim() ? x.shape(-1) : 0;
            if (type != 8 || x.ndim() < 1 || x.dtype() != mx::float32 || k % CHUNK || blocks.ndim() != 2 ||
                blocks.nbytes() != size_t(blocks.shape(0) * (k / CHUNK * Q8_BYTES)))
                throw std::invalid_argument("pipeline GGUF Q8_0 product: x must be float32 [..., k] (k a multiple of 32) "
                                            "and blocks [n, k / 32 * 34] (the file's Q8_0 row bytes), type 8");
            mx::Shape shape = x.shape();
            shape.back() = blocks.shape(0);
            return mx::array(shape, mx::float32, std::make_shared<RowMajor8Product>(cpu_stream(), true, int8, 32), {x, blocks});
        },
        nb::arg("x"), nb::arg("blocks"), nb::arg("type"), nb::arg("int8"),
        "x [..., k] float32 @ w.T for a GGUF Q8_0 tensor held as the file's row bytes, lazily; int8: x rounded per 32 "
        "as the int8 products round it (the bits of the int8 repack's copy), else float products");
    m.def(
        "int8_rows_matmul",
        [](const mx::array &x, const mx::array &w, const mx::array &s, const mx::array &b, int group_size) {
            const int64_t k = x.ndim() ? x.shape(-1) : 0;
            if (x.ndim() < 1 || x.dtype() != mx::float32 || k % CHUNK || w.ndim() != 2 || w.dtype() != mx::uint32 ||
                w.shape(1) * 4 != k || (group_size != 32 && group_size != 64 && group_size != 128) || k % group_size ||
                s.ndim() != 2 || s.shape(0) != w.shape(0) || s.shape(1) != k / group_size || b.ndim() != 2 ||
                b.shape(0) != w.shape(0) || (b.shape(1) != k / group_size && b.shape(1) != 0) ||
                (b.shape(1) && b.dtype() != s.dtype()))
                throw std::invalid_argument("pipeline int8 rows product: x float32 [..., k] against MLX's 8-bit w [n, k / 4] "
                                            "uint32, scales and biases [n, k / group_size] (biases [n, 0]: symmetric)");
            scale_type_of(s.dtype());
            mx::Shape shape = x.shape();
            shape.back() = w.shape(0);
            return mx::array(shape, mx::float32, std::make_shared<RowMajor8Product>(cpu_stream(), false, true, group_size),
                             {x, w, s, b});
        },
        nb::arg("x"), nb::arg("w"), nb::arg("scales"), nb::arg("biases"), nb::arg("group_size"),
        "x [..., k] float32 @ w.T for MLX's affine 8-bit layout as loaded (a tied embedding's, read in place), with "
        "int8 activations: the bits int8_matmul gives on its int8_repack, lazily");
}
