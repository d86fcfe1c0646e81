/* What pipeline's CPU kernels (qmm_kernels.cpp, attention_kernels.cpp) share: 16-lane float vectors
 * whose arithmetic rounds the same with AVX-512 (one register) and AVX2 (two), the one summation
 * tree of their lanes, the rank's thread count, and row-contiguous copies of MLX arrays. */
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <stdexcept>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"
#include "mlx/types/half_types.h"

namespace mx = mlx::core;

inline int g_threads = 1;  // the BLAS threads of this rank (pipeline.kernels.blas.num_threads())

/* o[i] = gate[i] * sigmoid(gate[i]) * up[i], i < n (o may be gate): MLX's Sigmoid arithmetic, 16 lanes at once,
   the bits of models/layers.py's swiglu (layer_kernels.cpp). */
void swiglu_span(const float *gate, const float *up, float *out, int64_t n);

/* Whether `a` is its buffer's only holder and MLX's allocator owns that buffer (not a mapped file's pages,
   mapped_files.cpp): a buffer an operation may rewrite in place. */
inline bool sole_owned_buffer(const mx::array &a) {
    return a.data_shared_ptr().use_count() == 1 && a.data_shared_ptr()->is_owned();
}

/* f(begin, end) over [0, n) split into g_threads contiguous parts, on plain threads: for work done on
   the caller's thread (at load), not inside an MLX operation. OpenMP is kept to MLX's CPU worker,
   which runs every operation: libgomp counts the threads of every master's team, and one more team
   (the Python thread's) puts that count over the cores, after which libgomp cuts its workers' spin
   to about a thousand rounds. Then every product's workers sleep between products and each product
   pays a futex wake-up: measured on 2 cores, SmolLM2's 210 one-row int8 products of a token took
   14-16 ms instead of 4.4-5.1 once the int8 repack had run an OpenMP loop on the Python thread. */
template <class F>
void on_threads(int64_t n, F f) {
    const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(g_threads, n));
    std::vector<std::thread> helpers;
    for (int64_t p = 1; p < parts; p++) helpers.emplace_back(f, n * p / parts, n * (p + 1) / parts);
    f(int64_t(0), n / parts);
    for (auto &t : helpers) t.join();
}

/* ---- vectors -------------------------------------------------------------------------------------- */

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));

inline v16 load16(const float *p) {
    v16 v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

inline void store16(float *p, v16 v) { std::memcpy(p, &v, sizeof v); }

/* acc + a*b lane by lane, one rounding where the CPU has FMA (built with -ffp-contract=off, so the
   compiler fuses nothing on its own). */
inline v16 fma16(v16 a, v16 b, v16 acc) {
#if defined(__AVX512F__)
    return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)acc);
#elif defined(__FMA__)
    v8 a2[2], b2[2], c2[2];
    std::memcpy(a2, &a, 64);
    std::memcpy(b2, &b, 64);
    std::memcpy(c2, &acc, 64);
    c2[0] = (v8)_mm256_fmadd_ps((__m256)a2[0], (__m256)b2[0], (__m256)c2[0]);
    c2[1] = (v8)_mm256_fmadd_ps((__m256)a2[1], (__m256)b2[1], (__m256)c2[1]);
    v16 out;
    std::memcpy(&out, c2, 64);
    return out;
#else
    return acc + a * b;
#endif
}

inline v16 splat(float s) {
#if defined(__AVX512F__)
    return (v16)_mm512_set1_ps(s);
#else
    return v16{s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s};
#endif
}

/* The one summation tree of the 16 lanes. */
inline float lanes_sum(v16 acc) {
    float t[16];
    std::memcpy(t, &acc, sizeof t);
    float a[8], b[4];
    for (int i = 0; i < 8; i++) a[i] = t[i] + t[i + 8];
    for (int i = 0; i < 4; i++) b[i] = a[i] + a[i + 4];
    return (b[0] + b[2]) + (b[1] + b[3]);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* The int8 products' rounding of N values (a multiple of 16) as ggml's Q8 types (d = max|x| / 127, q = rint(x / d)
   clamped to +-127, a NaN 0; d 0 or not finite: zeros), in 16 lanes with the bits of the scalar steps (std::max(amax,
   |v|) passes a NaN by as vmaxps returns its second operand when either is NaN; the clamp's NaN is 0 by the ordered
   compare); each q byte xored with `bias` (0x80: q + 128 as unsigned). Returns d. */
template <int N>
inline float round_q8_block(const float *v, int8_t *q, uint8_t bias = 0) {
    __m512 magnitude = _mm512_setzero_ps();
    for (int i = 0; i < N; i += 16) magnitude = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(v + i)), magnitude);
    const float amax = _mm512_reduce_max_ps(magnitude);
    const float d = amax / 127.0f;
    float inverse = d > 0.0f ? 1.0f / d : 0.0f;
    if (!(inverse < INFINITY)) inverse = 0.0f;
    const __m512 scale = _mm512_set1_ps(inverse), top = _mm512_set1_ps(127.0f), bottom = _mm512_set1_ps(-127.0f);
    const __m128i flip = _mm_set1_epi8(char(bias));
    for (int i = 0; i < N; i += 16) {
        const __m512 f = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(v + i), scale),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512 clamped = _mm512_min_ps(_mm512_max_ps(f, bottom), top);
        const __m512 zeroed = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(f, f, _CMP_ORD_Q), clamped);  // NaN: 0
        _mm_storeu_si128(reinterpret_cast<__m128i *>(q + i), _mm_xor_si128(_mm512_cvtepi32_epi8(_mm512_cvtps_epi32(zeroed)), flip));
    }
    return d;
}
#endif

/* A hint that the cache lines starting in [p, p + bytes) will be read soon (a one-row product's weights stream from
   memory: prefetched some kilobytes ahead, across the 4 KiB pages the hardware prefetcher stops at). Called for
   consecutive spans of a region, it asks for every line once. A hint: never faults, past an array's end too. */
inline void prefetch_span(const void *p, int64_t bytes) {
#if defined(__AVX2__) || defined(__AVX512F__)
    const uintptr_t start = (reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63), end = reinterpret_cast<uintptr_t>(p) + bytes;
    for (uintptr_t a = start; a < end; a += 64) _mm_prefetch(reinterpret_cast<const char *>(a), _MM_HINT_T0);
#else
    (void)p;
    (void)bytes;
#endif
}

/* A row-contiguous copy of `a` (its strides may be anything, broadcasts included), or `a` itself. */
inline mx::array contiguous(const mx::array &a, std::vector<mx::array> &keep) {
    if (a.flags().row_contiguous) return a;
    mx::array out(mx::allocator::malloc(a.nbytes()), a.shape(), a.dtype());
    const size_t item = a.itemsize();
    const int nd = a.ndim();
    const uint8_t *src = a.data<uint8_t>();
    uint8_t *dst = out.data<uint8_t>();
    std::vector<int64_t> idx(nd, 0);
    for (size_t i = 0; i < a.size(); i++) {
        int64_t offset = 0;
        for (int d = 0; d < nd; d++) offset += idx[d] * a.strides()[d];
        std::memcpy(dst + i * item, src + offset * item, item);
        for (int d = nd - 1; d >= 0; d--) {
            if (++idx[d] < a.shape(d)) break;
            idx[d] = 0;
        }
    }
    keep.push_back(out);
    return out;
}

/* ---- quantized weights' scales and biases ----------------------------------------------------------- */

enum ScaleType { SCALE_F32 = 0, SCALE_F16 = 1, SCALE_BF16 = 2 };

inline int scale_type_of(mx::Dtype t) {
    if (t == mx::float16) return SCALE_F16;
    if (t == mx::bfloat16) return SCALE_BF16;
    if (t == mx::float32) return SCALE_F32;
    throw std::invalid_argument("pipeline_qmm: scales must be float32, float16 or bfloat16");
}

/* Scale (or bias) i of an array of `type`, as a float (every conversion exact). */
inline float scale_at(const void *p, int type, int64_t i) {
    switch (type) {
        case SCALE_F16: return static_cast<float>(static_cast<const mx::float16_t *>(p)[i]);
        case SCALE_BF16: {
            const uint32_t bits = uint32_t(static_cast<const uint16_t *>(p)[i]) << 16;
            float f;
            std::memcpy(&f, &bits, 4);
            return f;
        }
        default: return static_cast<const float *>(p)[i];
    }
}

/* ---- gathered products (mixture-of-experts) -------------------------------------------------------- */

/* Each row's expert from uint32 or int32 `indices` (nullptr: one matrix, all 0), clamped to
   [0, experts) as MLX's gather clamps. */
inline std::vector<int64_t> experts_of_rows(const mx::array *indices, int64_t rows, int64_t experts,
                                            std::vector<mx::array> &keep) {
    std::vector<int64_t> expert_of(rows, 0);
    if (indices == nullptr) return expert_of;
    const mx::array idx = contiguous(*indices, keep);
    for (int64_t r = 0; r < rows; r++) {
        const int64_t e = idx.dtype() == mx::uint32 ? int64_t(idx.data<uint32_t>()[r]) : int64_t(idx.data<int32_t>()[r]);
        expert_of[r] = std::clamp<int64_t>(e, 0, experts - 1);
    }
    return expert_of;
}

/* The rows grouped by expert, in order within a group (a counting sort): expert e's rows are
   order[start[e]] .. order[start[e + 1] - 1]. */
struct RowsByExpert {
    std::vector<int64_t> start, order;
};

inline RowsByExpert rows_by_expert(const std::vector<int64_t> &expert_of, int64_t experts) {
    const int64_t rows = int64_t(expert_of.size());
    RowsByExpert out{std::vector<int64_t>(experts + 1, 0), std::vector<int64_t>(rows)};
    for (int64_t r = 0; r < rows; r++) out.start[expert_of[r] + 1]++;
    for (int64_t e = 0; e < experts; e++) out.start[e + 1] += out.start[e];
    std::vector<int64_t> fill(out.start.begin(), out.start.end() - 1);
    for (int64_t r = 0; r < rows; r++) out.order[fill[expert_of[r]]++] = r;
    return out;
}

/* ---- GGUF tensors in their own blocks: the one MLX operation of every kernel file's products ------------- */

/* A kernel file's product (gguf_kernels.cpp, gguf_kquant_kernels.cpp, gguf_iquant_kernels.cpp): out [rows, n] =
   x [rows, k] @ w.T for one matrix w of ggml type `type`, given by its arrays' row-contiguous data in their
   inputs' order (gguf_kernels.cpp: codes, scales and Q6_K's d; the others: the file's row bytes). */
using BlockProductFn = void (*)(const std::vector<const uint8_t *> &w, int64_t n, int64_t k, const float *x,
                                int64_t rows, float *out, int type, bool int8);

/* Below this many multiply-adds a gathered product's experts run one after another on MLX's thread (the kernel
   files' threshold for spreading one product's columns, for the same reason). */
constexpr int64_t GATHER_SPREAD_MIN_WORK = int64_t(1) << 22;

/* out[p] = x[p] @ w[chosen[p]].T over a stack of experts (w: each array's first expert, and its bytes per
   expert): each expert's rows gathered in order of p and multiplied as one product, so every output row has
   the bits of that row alone times its expert's matrix (the products are batch-invariant); an index past the
   stack (a router's bug) gives NaN rows, not a throw on MLX's thread. With several experts at work and enough
   work, the experts are spread over the threads (one product each) rather than each product's columns. */
template <BlockProductFn F>
void gathered_product(const std::vector<const uint8_t *> &w, const std::vector<size_t> &expert_bytes, int64_t stack,
                      int64_t n, int64_t k, const float *x, const uint32_t *chosen, int64_t rows, float *out, int type,
                      bool int8) {
    std::vector<std::vector<int64_t>> groups(stack);
    for (int64_t p = 0; p < rows; p++) {
        if (chosen[p] < uint64_t(stack)) {
            groups[chosen[p]].push_back(p);
        } else {
            std::fill(out + p * n, out + (p + 1) * n, std::nanf(""));
        }
    }
    std::vector<int64_t> used;
    for (int64_t e = 0; e < stack; e++)
        if (!groups[e].empty()) used.push_back(e);
    const bool spread = g_threads > 1 && used.size() > 1 && rows * n * k >= GATHER_SPREAD_MIN_WORK;
#pragma omp parallel for schedule(dynamic) num_threads(g_threads) if (spread)
    for (size_t u = 0; u < used.size(); u++) {
        const int64_t e = used[u];
        const std::vector<int64_t> &group = groups[e];
        const int64_t count = int64_t(group.size());
        std::vector<float> xg(count * k), og(count * n);
        for (int64_t i = 0; i < count; i++) std::memcpy(xg.data() + i * k, x + group[i] * k, k * sizeof(float));
        std::vector<const uint8_t *> expert(w.size());
        for (size_t i = 0; i < w.size(); i++) expert[i] = w[i] + e * expert_bytes[i];
        F(expert, n, k, xg.data(), count, og.data(), type, int8);
        for (int64_t i = 0; i < count; i++) std::memcpy(out + group[i] * n, og.data() + i * n, n * sizeof(float));
    }
}

/* The MLX operation of a BlockProductFn, lazy like any MLX op, on the CPU. Inputs: x [..., k] float32, then the
   weight arrays [n, ...]; gathered: x [rows, k], the experts uint32 [rows], then the weight stacks
   [experts, n, ...] (out[p] = x[p] @ w[experts[p]].T, gathered_product). */
template <BlockProductFn F>
class BlockProduct : public mx::UnaryPrimitive {
   public:
    BlockProduct(mx::Stream stream, int type, bool int8, bool gathered)
        : mx::UnaryPrimitive(stream), type_(type), int8_(int8), gathered_(gathered) {}

    void eval_cpu(const std::vector<mx::array> &inputs, mx::array &out) override {
        out.set_data(mx::allocator::malloc(out.nbytes()));
        auto &encoder = mx::cpu::get_command_encoder(stream());
        for (auto &a : inputs) encoder.set_input_array(a);
        encoder.set_output_array(out);
        const int type = type_;
        const bool int8 = int8_, gathered = gathered_;
        encoder.dispatch([inputs, out, type, int8, gathered]() mutable {
            std::vector<mx::array> keep, in;
            for (const auto &a : inputs) in.push_back(contiguous(a, keep));
            const size_t first = gathered ? 2 : 1;  // the first weight array
            const int64_t k = in[0].shape(-1), rows = k ? int64_t(in[0].size()) / k : 0;
            const int64_t stack = gathered ? in[first].shape(0) : 1, n = in[first].shape(gathered ? 1 : 0);
            if (rows == 0 || n == 0 || stack == 0) return;
            std::vector<const uint8_t *> w;
            std::vector<size_t> expert_bytes;
            for (size_t i = first; i < in.size(); i++) {
                w.push_back(in[i].data<uint8_t>());
                expert_bytes.push_back(in[i].nbytes() / stack);
            }
            if (gathered) {
                gathered_product<F>(w, expert_bytes, stack, n, k, in[0].data<float>(), in[1].data<uint32_t>(), rows,
                                    out.data<float>(), type, int8);
            } else {
                F(w, n, k, in[0].data<float>(), rows, out.data<float>(), type, int8);
            }
        });
    }

    void eval_gpu(const std::vector<mx::array> &, mx::array &) override {
        throw std::runtime_error("pipeline's GGUF products run on the CPU only");
    }

    const char *name() const override { return gathered_ ? "PipelineGGUFGatherProduct" : "PipelineGGUFProduct"; }

    bool is_equivalent(const mx::Primitive &other) const override {
        auto *o = dynamic_cast<const BlockProduct *>(&other);
        return o && o->type_ == type_ && o->int8_ == int8_ && o->gathered_ == gathered_;
    }

    std::vector<mx::Shape> output_shapes(const std::vector<mx::array> &inputs) override {
        if (gathered_) return {mx::Shape{inputs[0].shape(0), inputs[2].shape(1)}};
        mx::Shape shape = inputs[0].shape();
        shape.back() = inputs[1].shape(0);
        return {shape};
    }

   private:
    int type_;
    bool int8_, gathered_;
};

/* A kernel file's Python wrapper's body: the lazy x [..., k] float32 @ w.T of BlockProduct<F>, or, given
   `experts` (uint32 [rows]), x [rows, k] with each row times its expert's matrix of the weight stacks
   [experts, n, ...]; after the checks every product makes (`what` begins their one-line errors) and the
   kernel's own, check(weights) on the weight arrays as matrices [n, ...] (a stack's experts one after another). */
template <BlockProductFn F, class Check>
mx::array block_product(const char *what, int type, bool int8, const mx::array &x, const std::vector<mx::array> &weights,
                        const std::optional<mx::array> &experts, Check check) {
    auto fail = [what](const std::string &why) { throw std::invalid_argument(std::string(what) + ": " + why); };
    if (x.ndim() < 1 || x.dtype() != mx::float32) fail("x must be float32 [..., k]");
    const mx::Stream cpu = mx::default_stream(mx::Device(mx::Device::cpu));
    std::vector<mx::array> inputs{x};
    if (!experts) {
        check(weights);
        inputs.insert(inputs.end(), weights.begin(), weights.end());
        mx::Shape shape = x.shape();
        shape.back() = weights[0].shape(0);
        return mx::array(shape, mx::float32, std::make_shared<BlockProduct<F>>(cpu, type, int8, false), inputs);
    }
    if (x.ndim() != 2) fail("x must be [rows, k] with experts");
    if (experts->dtype() != mx::uint32 || experts->ndim() != 1 || experts->shape(0) != x.shape(0))
        fail("experts must be uint32 [rows]");
    inputs.push_back(*experts);
    std::vector<mx::array> matrices;
    for (const auto &w : weights) {
        if (w.ndim() != 3 || w.shape(0) != weights[0].shape(0) || w.shape(1) != weights[0].shape(1))
            fail("the weights must be stacks [experts, n, ...] of one shape");
        matrices.push_back(mx::reshape(w, {w.shape(0) * w.shape(1), w.shape(2)}));
        inputs.push_back(w);
    }
    check(matrices);
    return mx::array(mx::Shape{x.shape(0), weights[0].shape(1)}, mx::float32,
                     std::make_shared<BlockProduct<F>>(cpu, type, int8, true), inputs);
}

/* A kernel file's dequantization of whole super-blocks (256 values, `bytes` each) of ggml type `type`:
   out [n, k] float32, every weight as its float products use it. */
using BlockDequantizeFn = void (*)(const uint8_t *blocks, int64_t n, int64_t k, float *out, int type);

/* Its MLX operation: input blocks [n, ...] (any dtype) whose bytes are n rows of super-blocks, output [n, k]. */
template <BlockDequantizeFn F>
class BlockDequantize : public mx::UnaryPrimitive {
   public:
    BlockDequantize(mx::Stream stream, int type, int64_t bytes) : mx::UnaryPrimitive(stream), type_(type), bytes_(bytes) {}

    void eval_cpu(const std::vector<mx::array> &inputs, mx::array &out) override {
        out.set_data(mx::allocator::malloc(out.nbytes()));
        auto &encoder = mx::cpu::get_command_encoder(stream());
        encoder.set_input_array(inputs[0]);
        encoder.set_output_array(out);
        const int type = type_;
        encoder.dispatch([inputs, out, type]() mutable {
            std::vector<mx::array> keep;
            const mx::array blocks = contiguous(inputs[0], keep);
            F(blocks.data<uint8_t>(), out.shape(0), out.shape(1), out.data<float>(), type);
        });
    }

    void eval_gpu(const std::vector<mx::array> &, mx::array &) override {
        throw std::runtime_error("pipeline's GGUF products run on the CPU only");
    }

    const char *name() const override { return "PipelineGGUFDequantize"; }

    bool is_equivalent(const mx::Primitive &other) const override {
        auto *o = dynamic_cast<const BlockDequantize *>(&other);
        return o && o->type_ == type_;
    }

    std::vector<mx::Shape> output_shapes(const std::vector<mx::array> &inputs) override {
        return {mx::Shape{inputs[0].shape(0), int(inputs[0].nbytes() / inputs[0].shape(0) / bytes_ * 256)}};
    }

   private:
    int type_;
    int64_t bytes_;
};

/* Its Python wrapper's body: float32 [n, k] of blocks [n, ...] of whole super-blocks of `bytes` (0: a type the
   file has not; `what` is the one-line error). */
template <BlockDequantizeFn F>
mx::array block_dequantize(const char *what, const mx::array &blocks, int type, int64_t bytes) {
    if (!bytes || blocks.ndim() < 1 || blocks.shape(0) == 0 || blocks.nbytes() % size_t(blocks.shape(0) * bytes))
        throw std::invalid_argument(what);
    const int k = int(blocks.nbytes() / blocks.shape(0) / bytes * 256);
    return mx::array(mx::Shape{blocks.shape(0), k}, mx::float32,
                     std::make_shared<BlockDequantize<F>>(mx::default_stream(mx::Device(mx::Device::cpu)), type, bytes),
                     {blocks});
}
