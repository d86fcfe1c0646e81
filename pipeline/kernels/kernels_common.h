/* What pipeline's CPU kernels (qmm_kernels.cpp, attention_kernels.cpp) share: 16-lane float vectors
 * whose arithmetic rounds the same with AVX-512 (one register) and AVX2 (two), the one summation
 * tree of their lanes, the rank's thread count, and row-contiguous copies of MLX arrays. */
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <stdexcept>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/types/half_types.h"

namespace mx = mlx::core;

inline int g_threads = 1;  // the BLAS threads of this rank (pipeline.kernels.blas.num_threads())

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
