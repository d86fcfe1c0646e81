/* int8 products with GGUF Q5_0 and Q5_1 tensors as llama.cpp computes them on CPU (ggml-cpu's vec_dot_q5_0_q8_0 and
 * vec_dot_q5_1_q8_1), on the layout the loader holds them in at the file's size (checkpoints/quants.py EXACT; the
 * float products of the same arrays stay qmm_kernels.cpp's, as with --no-int8-activations):
 *   codes  uint32 [n, 5 k / 32]: MLX's 5-bit affine codes, a row a little-endian bit stream, value j at bits
 *          [5 j, 5 j + 5): each 32-value block is 20 whole bytes (q 0..31);
 *   scales float16 [n, k / 32]: each block's d;
 *   biases Q5_1 only, float16 [n, k / 32]: each block's m (Q5_0 holds none: kernels/qmm.py hold_symmetric).
 * A weight is w = d (q - 16) (Q5_0) or d q + m (Q5_1): 22 / 24 bytes per 32 values, the file's own.
 *
 * The arithmetic (llama.cpp's). Each row of x is rounded per 32 values as ggml's Q8_0 / Q8_1: d_x = max|x| / 127,
 * xq = rint(x * (1 / d_x)) clamped to +-127 (int8_kernels.cpp's rounding), and for Q5_1 s = float(sum(xq)) * d_x.
 * Per block the integer dot product is exact, in 8 int32 lanes, lane l the 4 products of values 4l..4l+3:
 *   Q5_0: sum((q - 16) xq)  (as c_l + sum(q xq), c_l = -16 sum(xq) of those 4, computed with the rounding),
 *   Q5_1: sum(q xq)
 * (q 0..31 unsigned times xq: vpmaddubsw's pair sums stay below 2^13, or vpdpbusd with AVX-512 VNNI), then
 * acc = fma(float(lanes), d_w * d_x, acc) in two chains of 8 lanes, the even blocks' and the odd ones' (as
 * gguf_kernels.cpp's IQ4_NL: one chain waits on the FMA's latency), added at the end and summed in one tree; Q5_1
 * adds the sum over blocks of m * s, fused multiply-adds in 8 lanes (lane l: blocks 8i + l; a scalar chain of
 * one add per block waited on its latency: Q5_1 products 1.3x Q5_0's time) and its own tree:
 * out = lanes_sum8(even + odd) + lanes_sum8(ms).
 *
 * Every output element is that fixed sequence on its row of x and its weight row whatever the number of rows, their
 * order or the threads (batch invariance); the AVX-512 (a pair of blocks per step, the even one in the low 8 lanes),
 * AVX2 and generic code give the same bits (integer sums are exact; the float steps are the same fused multiply-adds,
 * std::fma in the generic code). Several rows of x (AVX-512, tile_lanes): the pairs' 16 lanes in IQ4_NL's lane order
 * (lane 2 g the even block's lane g, 2 g + 1 the odd one's; x and the codes laid out so, each chunk of 16 weight rows
 * unpacked once for all its tiles of rows), the lanes started at MAGIC_BITS (+ c) and made floats by a subtraction,
 * d_w d_x made 16 blocks at a time: per output the same lanes, the same fused multiply-adds in the same order; an odd
 * last block's fused multiply-adds masked to the even lanes; then each row's 16 columns at once: lanes_sum8(even + odd)
 * by pairwise permutations (the tree's additions, a column per lane at the end) and Q5_1's m s chains as 8 vectors of
 * the 16 columns (transpose_m), added in lanes_sum8's tree.
 * Built with the rest of the extension by build.py (-march=native).
 */
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "mlx/ops.h"
#include "mlx/types/half_types.h"

#include "kernels_common.h"

namespace nb = nanobind;

namespace {

enum Q5Type { Q5_0 = 6, Q5_1 = 7 };  // ggml's type ids (GGMLQuantizationType)

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define Q5_PAIRS 1  // pairs of blocks in 16 lanes (the tile's AVX-512 steps)
#endif

constexpr int BLOCK = 32;       // values per block (and per activation block)
/* 0x4B400000 is 1.5 * 2^23 as a float: an integer lane L (|L| < 2^22) added to these bits is 1.5 * 2^23 + L as a
   float, exactly; minus 1.5 * 2^23 it is float(L), the bits vcvtdq2ps gives (gguf_kernels.cpp's trick: vsubps on
   either vector port rather than vcvtdq2ps on one). A block's lanes stay within +-(4 * 31 * 127 + 16 * 4 * 127). */
constexpr int32_t MAGIC_BITS = 0x4B400000;
constexpr float MAGIC = 12582912.0f;
constexpr int CODE_BYTES = 20;  // a block's 5-bit codes

inline float half_value(const uint16_t *p, int64_t i) {
#if defined(__F16C__)
    return _cvtsh_ss(p[i]);
#else
    mx::float16_t h;
    std::memcpy(&h, p + i, 2);
    return static_cast<float>(h);
#endif
}

/* One held matrix (see the opening comment): row r's codes at codes + r * (k / 32) * 20, its d and m at
   d + r * (k / 32), m + r * (k / 32). */
struct Q5Matrix {
    const uint8_t *codes;
    const uint16_t *d, *m;
    int type;
    int64_t n, k;

    int64_t blocks() const { return k / BLOCK; }
    const uint8_t *codes_of(int64_t r) const { return codes + r * blocks() * CODE_BYTES; }
    const uint16_t *d_of(int64_t r) const { return d + r * blocks(); }
    const uint16_t *m_of(int64_t r) const { return m + r * blocks(); }
};

/* ---- activations ------------------------------------------------------------------------------------- */

/* x's rows rounded as ggml's Q8_0 / Q8_1 blocks: q [rows, k], d [rows, k / 32], and per block the 8 int32 lanes c
   (Q5_0: -16 times the sum of each 4 values' xq) or s (Q5_1: float(sum(xq)) * d); with AVX-512, d per pair of
   blocks as the pair's 16 lanes take it (dpair [rows, k / 64, 16]: 8 x block 2p's, 8 x block 2p + 1's). */
struct RoundedRows {
    std::vector<int8_t> q;
    std::vector<float> d, s, dpair;
    std::vector<int32_t> c;
    std::vector<int8_t> lane_q;      // AVX-512, several rows: [rows, k / 64, 64] each pair's xq in the lane order
    std::vector<int32_t> lane_start; // [rows, k / 64, 16]: MAGIC_BITS (+ c, Q5_0) in the lane order (tile_lanes)
};

RoundedRows round_rows(const float *x, int64_t rows, int64_t k, int type) {
    const int64_t blocks = k / BLOCK;
    RoundedRows out{std::vector<int8_t>(rows * k), std::vector<float>(rows * blocks),
                    std::vector<float>(type == Q5_1 ? rows * blocks : 0), std::vector<float>(),
                    std::vector<int32_t>(type == Q5_0 ? rows * blocks * 8 : 0)};
#if defined(Q5_PAIRS)
    // the same steps in vectors (kernels_common.h's round_q8_block): round_rows' std::max(amax, |v|) passes a NaN by, as
    // vmaxps returns its second operand when either is NaN; the clamp's NaN is 0 by the ordered compare
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < blocks; b++) {
            const float *v = x + r * k + b * BLOCK;
            if (b + 8 < blocks || r + 1 < rows) _mm_prefetch(reinterpret_cast<const char *>(v + 8 * BLOCK), _MM_HINT_T0);
            const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v1), _mm512_max_ps(_mm512_abs_ps(v0), _mm512_setzero_ps())));
            const float d = amax / 127.0f;
            float inverse = d > 0.0f ? 1.0f / d : 0.0f;
            if (!(inverse < INFINITY)) inverse = 0.0f;
            out.d[r * blocks + b] = d;
            const __m512 scale = _mm512_set1_ps(inverse), top = _mm512_set1_ps(127.0f), bottom = _mm512_set1_ps(-127.0f);
            __m128i half[2];
            for (int h = 0; h < 2; h++) {
                const __m512 f = _mm512_roundscale_ps(_mm512_mul_ps(h ? v1 : v0, scale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                const __m512 clamped = _mm512_min_ps(_mm512_max_ps(f, bottom), top);
                half[h] = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_maskz_mov_ps(_mm512_cmp_ps_mask(f, f, _CMP_ORD_Q), clamped)));
            }
            const __m256i q = _mm256_set_m128i(half[1], half[0]);
            _mm256_storeu_si256(reinterpret_cast<__m256i *>(out.q.data() + r * k + b * BLOCK), q);
            if (type == Q5_1) {
                alignas(32) int32_t four[8];
                _mm256_store_si256(reinterpret_cast<__m256i *>(four), _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(1), q));
                const int32_t sum = ((four[0] + four[1]) + (four[2] + four[3])) + ((four[4] + four[5]) + (four[6] + four[7]));
                out.s[r * blocks + b] = float(sum) * d;
            } else {  // -16 times each 4 values' sum: 16 (unsigned) times -q
                _mm256_storeu_si256(reinterpret_cast<__m256i *>(out.c.data() + (r * blocks + b) * 8),
                                    _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(16),
                                                        _mm256_sub_epi8(_mm256_setzero_si256(), q)));
            }
        }
#else
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < blocks; b++) {
            const float *v = x + r * k + b * BLOCK;
            float amax = 0.0f;
            for (int i = 0; i < BLOCK; i++) amax = std::max(amax, std::fabs(v[i]));
            const float d = amax / 127.0f;
            float inverse = d > 0.0f ? 1.0f / d : 0.0f;
            if (!(inverse < INFINITY)) inverse = 0.0f;  // tiny or not finite: the block counts as zeros
            out.d[r * blocks + b] = d;
            int8_t *q = out.q.data() + r * k + b * BLOCK;
            int32_t four[8] = {}, sum = 0;
            for (int i = 0; i < BLOCK; i++) {
                const float f = std::nearbyint(v[i] * inverse);
                q[i] = f >= 127.0f ? 127 : f <= -127.0f ? -127 : f == f ? int8_t(f) : 0;  // NaN: 0
                four[i / 4] += q[i];
                sum += q[i];
            }
            if (type == Q5_1) out.s[r * blocks + b] = float(sum) * d;
            if (type == Q5_0)
                for (int l = 0; l < 8; l++) out.c[(r * blocks + b) * 8 + l] = -16 * four[l];
        }
#endif
#if defined(Q5_PAIRS)
    if (rows == 1) {  // tile<1>'s d_x per pair
        out.dpair.resize(rows * (blocks / 2) * 16);
        for (int64_t r = 0; r < rows; r++)
            for (int64_t p = 0; p < blocks / 2; p++)
                for (int l = 0; l < 16; l++) out.dpair[(r * (blocks / 2) + p) * 16 + l] = out.d[r * blocks + 2 * p + l / 8];
    } else {  // tile_lanes: every pair, and an odd last block as a pair whose odd block is zeros
        const int64_t pairs = (blocks + 1) / 2;
        out.lane_q.resize(rows * pairs * 64);
        out.lane_start.resize(rows * pairs * 16);
        const __m512i order = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
        for (int64_t r = 0; r < rows; r++)
            for (int64_t p = 0; p < pairs; p++) {
                const __mmask16 whole = 2 * p + 1 < blocks ? 0xFFFF : 0x00FF;
                _mm512_storeu_si512(out.lane_q.data() + (r * pairs + p) * 64,
                                    _mm512_permutexvar_epi32(order, _mm512_maskz_loadu_epi32(whole, out.q.data() + r * k + 64 * p)));
                __m512i start = _mm512_set1_epi32(MAGIC_BITS);
                if (type == Q5_0)
                    start = _mm512_add_epi32(start, _mm512_permutexvar_epi32(order, _mm512_maskz_loadu_epi32(whole, out.c.data() + (r * blocks + 2 * p) * 8)));
                _mm512_storeu_si512(out.lane_start.data() + (r * pairs + p) * 16, start);
            }
    }
#endif
    return out;
}

/* ---- a block's codes ----------------------------------------------------------------------------------- */

/* The 32 codes (0..31, in order) of a block's 20 bytes, generic code. Value j is bits [5j, 5j + 5) of the bytes. */
inline void codes_generic(const uint8_t *p, uint8_t *q) {
    for (int j = 0; j < BLOCK; j++) {
        const int bit = 5 * j, at = bit >> 3, shift = bit & 7;
        const int word = p[at] | (shift > 3 ? p[at + 1] << 8 : 0);  // within the block's 20 bytes
        q[j] = uint8_t((word >> shift) & 31);
    }
}

#if defined(__AVX2__)
/* codes_generic in one vector. Lane 0 holds bytes 0-15, lane 1 bytes 4-19; 16-bit words gather each value's one or
   two bytes (values 0-7 and 16-23 in `a`, 8-15 and 24-31 in `b`), a multiply by 2^(11 - shift) puts its 5 bits at
   the top of the word and a shift right by 11 brings them down; vpackuswb interleaves a and b back in order. */
inline __m256i codes_avx2(const uint8_t *p) {
#if defined(__AVX512VBMI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
    // AVX-512 VBMI: qword i gathers bytes 5i..5i+4 (values 8i..8i+7, 40 bits), vpmultishiftqb takes each value's
    // byte at bit 5v of its qword, the AND keeps its 5 bits
    const __m256i bytes = _mm256_maskz_loadu_epi8(0xFFFFF, p);  // the block's 20 bytes, nothing past them
    const __m256i spread = _mm256_setr_epi8(0, 1, 2, 3, 4, 4, 4, 4, 5, 6, 7, 8, 9, 9, 9, 9,
                                            10, 11, 12, 13, 14, 14, 14, 14, 15, 16, 17, 18, 19, 19, 19, 19);
    const __m256i at = _mm256_set1_epi64x(0x231E19140F0A0500LL);  // bit offsets 0, 5, ..., 35
    return _mm256_and_si256(_mm256_multishift_epi64_epi8(at, _mm256_permutexvar_epi8(spread, bytes)),
                            _mm256_set1_epi8(31));
#else
    const __m256i bytes = _mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p + 4)),
                                           _mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
    // value j (j % 8 = w) starts at bit 5w of its 5-byte group: byte o_w = 0 0 1 1 2 3 3 4, shift 0 5 2 7 4 1 6 3
    const __m256i pick_a = _mm256_setr_epi8(0, 1, 0, 1, 1, 2, 1, 2, 2, 3, 3, 4, 3, 4, 4, -1,  // values 0-7 (bytes o)
                                            6, 7, 6, 7, 7, 8, 7, 8, 8, 9, 9, 10, 9, 10, 10, -1);  // 16-23 (10 + o - 4)
    const __m256i pick_b = _mm256_setr_epi8(5, 6, 5, 6, 6, 7, 6, 7, 7, 8, 8, 9, 8, 9, 9, -1,  // values 8-15 (5 + o)
                                            11, 12, 11, 12, 12, 13, 12, 13, 13, 14, 14, 15, 14, 15, 15, -1);  // 24-31
    const __m256i up = _mm256_setr_epi16(2048, 64, 512, 16, 128, 1024, 32, 256, 2048, 64, 512, 16, 128, 1024, 32, 256);
    const __m256i a = _mm256_srli_epi16(_mm256_mullo_epi16(_mm256_shuffle_epi8(bytes, pick_a), up), 11);
    const __m256i b = _mm256_srli_epi16(_mm256_mullo_epi16(_mm256_shuffle_epi8(bytes, pick_b), up), 11);
    return _mm256_packus_epi16(a, b);
#endif
}
#endif

#if defined(Q5_PAIRS)
/* Blocks b and b + 1 (40 bytes at p): codes_avx2 of each, the first in the low 32 bytes. */
inline __m512i codes_pair(const uint8_t *p) {
#if defined(__AVX512VBMI__)
    const __m512i bytes = _mm512_maskz_loadu_epi8((uint64_t(1) << 40) - 1, p);
    alignas(64) static constexpr uint8_t spread[64] = {
        0,  1,  2,  3,  4,  4,  4,  4,  5,  6,  7,  8,  9,  9,  9,  9,  10, 11, 12, 13, 14, 14,
        14, 14, 15, 16, 17, 18, 19, 19, 19, 19, 20, 21, 22, 23, 24, 24, 24, 24, 25, 26, 27, 28,
        29, 29, 29, 29, 30, 31, 32, 33, 34, 34, 34, 34, 35, 36, 37, 38, 39, 39, 39, 39};
    const __m512i at = _mm512_set1_epi64(0x231E19140F0A0500LL);
    return _mm512_and_si512(_mm512_multishift_epi64_epi8(at, _mm512_permutexvar_epi8(_mm512_load_si512(spread), bytes)),
                            _mm512_set1_epi8(31));
#else
    return _mm512_inserti64x4(_mm512_castsi256_si512(codes_avx2(p)), codes_avx2(p + CODE_BYTES), 1);
#endif
}
#endif

/* A hint that p's cache line will be read soon (decode's weights stream from memory: each matrix is read once a token
   and the model does not fit the caches). */
inline void prefetch(const void *p) {
#if defined(__SSE__) || defined(__AVX2__)
    _mm_prefetch(reinterpret_cast<const char *>(p), _MM_HINT_T0);
#else
    __builtin_prefetch(p);
#endif
}

constexpr int64_t COLUMNS = 16;  // weight rows a tile of rows runs over before the next tile (product; 16: even shares)

constexpr int64_t PREFETCH = 4096;  // bytes of codes ahead (one row over 64 MiB of Q5_0 576 x 1536: 158 us without, 55 at 2048, 48-51 at 4096 and 8192)

/* ---- the products ---------------------------------------------------------------------------------------- */

typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef float f32x8 __attribute__((vector_size(32)));

inline f32x8 fma8(f32x8 a, f32x8 b, f32x8 acc) {
#if defined(__FMA__) || defined(__AVX512F__)
    return (f32x8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)acc);
#else
    for (int i = 0; i < 8; i++) acc[i] = std::fma(a[i], b[i], acc[i]);
    return acc;
#endif
}

inline f32x8 splat8(float s) { return f32x8{s, s, s, s, s, s, s, s}; }

/* `count` (<= 8) floats at p, the rest zeros. */
inline f32x8 load8(const float *p, int count) {
    f32x8 v{};
    if (count == 8) {
        std::memcpy(&v, p, sizeof v);
    } else {
        for (int i = 0; i < count; i++) v[i] = p[i];
    }
    return v;
}

/* `count` (<= 8) fp16 values at p as floats (exact), the rest zeros. */
inline f32x8 half8(const uint16_t *p, int count) {
    uint16_t h[8] = {};
    if (count == 8) {
        std::memcpy(h, p, sizeof h);
    } else {
        for (int i = 0; i < count; i++) h[i] = p[i];
    }
#if defined(__F16C__)
    return (f32x8)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(h)));
#else
    f32x8 v;
    for (int i = 0; i < 8; i++) v[i] = half_value(h, i);
    return v;
#endif
}

inline float lanes_sum8(f32x8 v) {
#if defined(__AVX2__)
    // the same tree in vectors: t_i = v_i + v_(i+4), u_0 = t_0 + t_2, u_1 = t_1 + t_3, u_0 + u_1
    const __m128 t = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
    const __m128 u = _mm_add_ps(t, _mm_movehl_ps(t, t));
    return _mm_cvtss_f32(_mm_add_ss(u, _mm_movehdup_ps(u)));
#else
    return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
#endif
}

/* The block's 8 lanes (opening comment) for codes q and one row's xq, starting from c (Q5_0) or zeros. */
#if defined(__AVX2__)
inline i32x8 block_lanes(__m256i q, const int8_t *xq, __m256i c) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(xq));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return (i32x8)_mm256_dpbusd_epi32(c, q, x);
#else
    return (i32x8)_mm256_add_epi32(c, _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), _mm256_set1_epi16(1)));
#endif
}
#else
inline i32x8 block_lanes(const uint8_t *q, const int8_t *xq, const int32_t *c) {
    i32x8 lanes{};
    for (int l = 0; l < 8; l++) lanes[l] = c ? c[l] : 0;
    for (int i = 0; i < BLOCK; i++) lanes[i / 4] += int32_t(q[i]) * xq[i];
    return lanes;
}
#endif

#if defined(Q5_PAIRS)
constexpr int TILE = 8;  // rows sharing each block's unpacked codes (and its d)
#else
constexpr int TILE = 4;
#endif

/* After the pairs (AVX-512) from block b on, column `col`'s remaining block (one block a step: AVX2, generic) into the
   chains even and odd, then out[r][col] (and Q5_1's m s). */
template <int R>
void finish(const Q5Matrix &m, int64_t col, int64_t b, f32x8 *even, f32x8 *odd, const int8_t *const *xq,
            const float *const *xd, const int32_t *const *xc, const float *const *xs, float *const *out) {
    const uint8_t *codes = m.codes_of(col);
    const uint16_t *dw = m.d_of(col);
    const bool q5_0 = m.type == Q5_0;
    const int64_t blocks = m.blocks();
    const uint8_t *ahead = codes + PREFETCH, *end = m.codes_of(m.n);
    for (; b < blocks; b++) {
        if (ahead + CODE_BYTES * b < end) prefetch(ahead + CODE_BYTES * b);
#if defined(__AVX2__)
        const __m256i q = codes_avx2(codes + CODE_BYTES * b);
#else
        uint8_t q[BLOCK];
        codes_generic(codes + CODE_BYTES * b, q);
#endif
        const float d = half_value(dw, b);
        f32x8 *chain = b % 2 ? odd : even;
        for (int r = 0; r < R; r++) {
#if defined(__AVX2__)
            const __m256i c = q5_0 ? _mm256_loadu_si256(reinterpret_cast<const __m256i *>(xc[r] + 8 * b))
                                   : _mm256_setzero_si256();
            const i32x8 lanes = block_lanes(q, xq[r] + BLOCK * b, c);
#else
            const i32x8 lanes = block_lanes(q, xq[r] + BLOCK * b, q5_0 ? xc[r] + 8 * b : nullptr);
#endif
            chain[r] = fma8(__builtin_convertvector(lanes, f32x8), splat8(d * xd[r][b]), chain[r]);
        }
    }
    if (q5_0) {
        for (int r = 0; r < R; r++) out[r][col] = lanes_sum8(even[r] + odd[r]);
        return;
    }
    // Q5_1: sum over blocks of m * s, in 8 lanes (lane l: blocks 8i + l, fused multiply-adds in order of i; a last
    // group of fewer than 8 blocks padded with zeros), one lane-sum tree
    const uint16_t *mw = m.m_of(col);
    const int64_t whole = blocks / 8 * 8;
    for (int r = 0; r < R; r++) {  // a row at a time: its chain in a register
        f32x8 ms{};
        for (int64_t b0 = 0; b0 < whole; b0 += 8) {
#if defined(__F16C__) && defined(__AVX2__)
            ms = fma8((f32x8)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(mw + b0))),
                      (f32x8)_mm256_loadu_ps(xs[r] + b0), ms);
#else
            ms = fma8(half8(mw + b0, 8), load8(xs[r] + b0, 8), ms);
#endif
        }
        if (whole < blocks) ms = fma8(half8(mw + whole, int(blocks - whole)), load8(xs[r] + whole, int(blocks - whole)), ms);
        out[r][col] = lanes_sum8(even[r] + odd[r]) + lanes_sum8(ms);
    }
}

/* Prefetches for weight row `col` (codes PREFETCH bytes ahead: rows are consecutive; scales of the row as far ahead). */
inline void prefetch_scales(const Q5Matrix &m, int64_t col) {
    const int64_t ahead_rows = PREFETCH / (m.blocks() * CODE_BYTES) + 1;
    if (col + ahead_rows < m.n) {
        for (int64_t at = 0; at < m.blocks() * 2; at += 64) {
            prefetch(reinterpret_cast<const uint8_t *>(m.d_of(col + ahead_rows)) + at);
            if (m.type != Q5_0) prefetch(reinterpret_cast<const uint8_t *>(m.m_of(col + ahead_rows)) + at);
        }
    }
}

/* out[r][col] for R rounded rows (xq, d_x, c or s per row): weight row `col`, each block unpacked once for the R
   rows; every row's arithmetic the same whatever R. */
template <int R>
void tile(const Q5Matrix &m, int64_t col, const int8_t *const *xq, const float *const *xd, const int32_t *const *xc,
          const float *const *xs, const float *const *xdp, float *const *out) {
    f32x8 even[R] = {}, odd[R] = {};
    int64_t b = 0;
    prefetch_scales(m, col);
#if defined(Q5_PAIRS)
    const uint8_t *codes = m.codes_of(col), *ahead = codes + PREFETCH, *end = m.codes_of(m.n);
    const uint16_t *dw = m.d_of(col);
    const bool q5_0 = m.type == Q5_0;
    const int64_t blocks = m.blocks();
    // a pair of blocks per step, the even one in the low 8 lanes, the odd one in the high 8: the same integer lanes
    // and the same fused multiply-adds into the same two chains as finish's steps
    __m512 pair[R];
    for (int r = 0; r < R; r++) pair[r] = _mm512_setzero_ps();
    for (; b + 2 <= blocks; b += 2) {
        if (ahead + CODE_BYTES * b < end) prefetch(ahead + CODE_BYTES * b);
        const __m512i q = codes_pair(codes + CODE_BYTES * b);
        const __m512 dwp = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(half_value(dw, b)), _mm512_set1_ps(half_value(dw, b + 1)));
        for (int r = 0; r < R; r++) {
            const __m512i x = _mm512_loadu_si512(xq[r] + BLOCK * b);
            const __m512i c = q5_0 ? _mm512_loadu_si512(xc[r] + 8 * b) : _mm512_setzero_si512();
            const __m512 lanes = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(c, q, x));
            const __m512 s = _mm512_mul_ps(dwp, _mm512_loadu_ps(xdp[r] + 8 * b));  // d_w d_x, lane by lane
            pair[r] = _mm512_fmadd_ps(lanes, s, pair[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        even[r] = (f32x8)_mm512_castps512_ps256(pair[r]);
        odd[r] = (f32x8)_mm512_extractf32x8_ps(pair[r], 1);
    }
#endif
    finish<R>(m, col, b, even, odd, xq, xd, xc, xs, out);
}

#if defined(Q5_PAIRS)
/* Blocks b and b + 1 (40 bytes at p) in the lane order: lane l (4 bytes) is block b + l % 2's codes 4 (l / 2) ..
   4 (l / 2) + 3, as lane_q's x. Qword g gathers bytes s .. s + 2 of each block (s = 20 g / 8; values 4 g .. 4 g + 3
   are their 20 bits from bit 0, g even, or 4), vpmultishiftqb takes each value's byte at its bit, the AND its 5. */
inline __m512i codes_pair_lanes(const uint8_t *p) {
    const __m512i bytes = _mm512_maskz_loadu_epi8((uint64_t(1) << 40) - 1, p);
    alignas(64) static constexpr uint8_t spread[64] = {
        0,  1,  2,  20, 21, 22, 22, 22, 2,  3,  4,  22, 23, 24, 24, 24, 5,  6,  7,  25, 26, 27,
        27, 27, 7,  8,  9,  27, 28, 29, 29, 29, 10, 11, 12, 30, 31, 32, 32, 32, 12, 13, 14, 32,
        33, 34, 34, 34, 15, 16, 17, 35, 36, 37, 37, 37, 17, 18, 19, 37, 38, 39, 39, 39};
    const __m512i at = _mm512_set_epi64(0x2B26211C130E0904LL, 0x27221D180F0A0500LL, 0x2B26211C130E0904LL,
                                        0x27221D180F0A0500LL, 0x2B26211C130E0904LL, 0x27221D180F0A0500LL,
                                        0x2B26211C130E0904LL, 0x27221D180F0A0500LL);
    return _mm512_and_si512(_mm512_multishift_epi64_epi8(at, _mm512_permutexvar_epi8(_mm512_load_si512(spread), bytes)),
                            _mm512_set1_epi8(31));
}

/* The 16 lanes' sums of R rows of x and C weight rows from col (several rows of x): pairs of blocks in the lane order
   (lane 2 g: the even block's lane g, 2 g + 1: the odd one's), so that a pair's two d_w d_x are one 64-bit broadcast
   of products made 16 blocks at a time; lanes from MAGIC_BITS (+ c) made floats by a subtraction; per lane the same
   fused multiply-adds in the same order as tile's (an odd last block into the even lanes alone). Each pair's codes
   unpacked once for the R rows (unpack_lanes), each row's bytes loaded once for the C weight rows. The sums go to
   sums[r * COLUMNS * 16 + c * 16 + lane], for reduce_columns. */
template <int R, int C>
void tile_lanes(const Q5Matrix &m, int64_t col, const RoundedRows &xr, int64_t r0, const float *const *xd,
                const uint8_t *unpacked, float *sums, float *scale) {
    const int64_t blocks = m.blocks(), pairs = blocks / 2, stored = (blocks + 1) / 2;
    const uint8_t *codes[C];
    const uint16_t *dw[C];
    for (int c = 0; c < C; c++) {
        codes[c] = unpacked + c * stored * 64;
        dw[c] = m.d_of(col + c);
    }
    const int8_t *lq[R];
    const int32_t *ls[R];
    for (int r = 0; r < R; r++) {
        lq[r] = xr.lane_q.data() + (r0 + r) * stored * 64;
        ls[r] = xr.lane_start.data() + (r0 + r) * stored * 16;
    }
    const __m512 magic = _mm512_set1_ps(MAGIC);
    __m512 acc[R][C];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    // d_w * d_x of every block made first, 16 at a time (scale [k / 512 rounded up][R][C][16]); a pair's two then
    // read as one 64-bit broadcast at a fixed offset from its group's
    for (int64_t b = 0; b < blocks; b += 16) {
        const __mmask16 valid = __mmask16((1u << std::min<int64_t>(16, blocks - b)) - 1);
        float *group = scale + b * R * C;
        for (int c = 0; c < C; c++) {
            const __m512 d = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid, dw[c] + b));
            for (int r = 0; r < R; r++)
                _mm512_store_ps(group + (r * C + c) * 16, _mm512_mul_ps(d, _mm512_maskz_loadu_ps(valid, xd[r] + b)));
        }
    }
    for (int64_t g = 0; g < pairs; g += 8) {
        const float *group = scale + 2 * g * R * C;
        const int count = int(std::min<int64_t>(8, pairs - g));
        for (int j = 0; j < count; j++) {
            const int64_t p = g + j;
            __m512i q[C];
            for (int c = 0; c < C; c++) q[c] = _mm512_load_si512(codes[c] + 64 * p);
            for (int r = 0; r < R; r++) {
                const __m512i x = _mm512_loadu_si512(lq[r] + 64 * p);
                for (int c = 0; c < C; c++) {
                    const __m512i lanes = _mm512_dpbusd_epi32(_mm512_loadu_si512(ls[r] + 16 * p), q[c], x);
                    double two;
                    std::memcpy(&two, group + (r * C + c) * 16 + 2 * j, 8);
                    acc[r][c] = _mm512_fmadd_ps(_mm512_sub_ps(_mm512_castsi512_ps(lanes), magic),
                                                _mm512_castpd_ps(_mm512_set1_pd(two)), acc[r][c]);
                }
            }
        }
    }
    if (pairs < stored) {  // the odd last block: the even chain's lanes alone
        const int64_t p = pairs;
        for (int r = 0; r < R; r++) {
            const __m512i x = _mm512_loadu_si512(lq[r] + 64 * p);
            for (int c = 0; c < C; c++) {
                const __m512i lanes = _mm512_dpbusd_epi32(_mm512_loadu_si512(ls[r] + 16 * p), _mm512_load_si512(codes[c] + 64 * p), x);
                double two;  // the odd lane's half: the zero of a masked load
                std::memcpy(&two, scale + (p / 8 * 16 * R * C) + (r * C + c) * 16 + 2 * (p % 8), 8);
                acc[r][c] = _mm512_mask3_fmadd_ps(_mm512_sub_ps(_mm512_castsi512_ps(lanes), magic),
                                                  _mm512_castpd_ps(_mm512_set1_pd(two)), acc[r][c], 0x5555);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) _mm512_store_ps(sums + (r * COLUMNS + c) * 16, acc[r][c]);
}

/* tile_lanes for count (<= NR) rows of x and `columns` (<= NC) weight rows. */
template <int NR, int NC, int R = 1>
void rows_lanes(int64_t count, int64_t columns, const Q5Matrix &m, int64_t col, const RoundedRows &xr, int64_t r0,
                const float *const *xd, const uint8_t *unpacked, float *sums, float *scale) {
    if constexpr (R < NR) {
        if (count != R) return rows_lanes<NR, NC, R + 1>(count, columns, m, col, xr, r0, xd, unpacked, sums, scale);
    }
    if (columns == NC) return tile_lanes<R, NC>(m, col, xr, r0, xd, unpacked, sums, scale);
    const int64_t stride = (m.blocks() + 1) / 2 * 64;
    for (int64_t c = 0; c < columns; c++) tile_lanes<R, 1>(m, col + c, xr, r0, xd, unpacked + c * stride, sums + c * 16, scale);
}

/* Weight rows col .. col + count - 1's pairs of blocks unpacked in the lane order (codes_pair_lanes) to `to`
   ([count, (k / 32 + 1) / 2, 64], an odd last block's pair with zeros for its odd block): once per chunk of columns,
   for all the tiles of rows of x over it. */
void unpack_lanes(const Q5Matrix &m, int64_t col, int64_t count, uint8_t *to) {
    const int64_t blocks = m.blocks(), pairs = blocks / 2, stored = (blocks + 1) / 2;
    const uint8_t *end = m.codes_of(m.n);
    for (int64_t c = 0; c < count; c++) {
        const uint8_t *codes = m.codes_of(col + c);
        prefetch_scales(m, col + c);
        for (int64_t p = 0; p < pairs; p++) {
            const uint8_t *at = codes + PREFETCH + 2 * CODE_BYTES * p;
            if (at < end) prefetch(at);
            _mm512_store_si512(to + (c * stored + p) * 64, codes_pair_lanes(codes + 2 * CODE_BYTES * p));
        }
        if (pairs < stored) {  // the odd last block: its 20 bytes, nothing past them
            alignas(64) uint8_t last[2 * CODE_BYTES] = {};
            std::memcpy(last, codes + 2 * CODE_BYTES * pairs, CODE_BYTES);
            _mm512_store_si512(to + (c * stored + pairs) * 64, codes_pair_lanes(last));
        }
    }
}

/* Q5_1's m of weight rows col .. col + count - 1 as floats, one vector of the 16 columns per block (mt [k / 32, 16],
   zeros past count): once per chunk, for ms_lanes. */
void transpose_m(const Q5Matrix &m, int64_t col, int64_t count, float *mt) {
    const int64_t blocks = m.blocks();
    const uint16_t *base = m.m_of(col);
    if (blocks < 2) {
        for (int64_t b = 0; b < blocks; b++)
            for (int c = 0; c < 16; c++) mt[b * 16 + c] = c < count ? half_value(base, c * blocks + b) : 0.0f;
        return;
    }
    const __mmask16 valid = __mmask16((1u << count) - 1);
    const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(int32_t(blocks)));
    for (int64_t b = 0; b < blocks; b++) {
        // 4 bytes a column: m[b] and m[b + 1] (low half m[b]); the last block as the high half of m[b - 1], m[b] (so
        // that nothing past the array is read)
        const bool last = b + 1 == blocks;
        const __m512i two = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, rows, base + (last ? b - 1 : b), 2);
        const __m256i halves = _mm512_cvtepi32_epi16(last ? _mm512_srli_epi32(two, 16) : two);
        _mm512_store_ps(mt + b * 16, _mm512_cvtph_ps(halves));
    }
}

/* The float steps after tile_lanes for one row of x and the chunk's 16 columns from sums [16 columns, 16 lanes]: per
   column lanes_sum8(even + odd) (lane 2 g + lane 2 g + 1, then the tree), 16 columns at a time by pairwise
   permutations (each step the same additions as lanes_sum8's, a column per lane at the end). */
inline __m512 reduce_columns(const float *sums) {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    const __m512i low4 = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
    const __m512i high4 = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    const __m512i low2 = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29);
    const __m512i high2 = _mm512_setr_epi32(2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    __m512 v[8], t[4], u[2];
    for (int i = 0; i < 8; i++) {  // v_g = even_g + odd_g: columns 2 i, 2 i + 1 (8 lanes each)
        const __m512 a = _mm512_load_ps(sums + 32 * i), b = _mm512_load_ps(sums + 32 * i + 16);
        v[i] = _mm512_add_ps(_mm512_permutex2var_ps(a, even, b), _mm512_permutex2var_ps(a, odd, b));
    }
    for (int i = 0; i < 4; i++)  // t_i = v_i + v_(i+4): columns 4 i .. 4 i + 3 (4 lanes each)
        t[i] = _mm512_add_ps(_mm512_permutex2var_ps(v[2 * i], low4, v[2 * i + 1]), _mm512_permutex2var_ps(v[2 * i], high4, v[2 * i + 1]));
    for (int i = 0; i < 2; i++)  // u_0 = t_0 + t_2, u_1 = t_1 + t_3: columns 8 i .. 8 i + 7
        u[i] = _mm512_add_ps(_mm512_permutex2var_ps(t[2 * i], low2, t[2 * i + 1]), _mm512_permutex2var_ps(t[2 * i], high2, t[2 * i + 1]));
    return _mm512_add_ps(_mm512_permutex2var_ps(u[0], even, u[1]), _mm512_permutex2var_ps(u[0], odd, u[1]));  // u_0 + u_1
}

/* Q5_1's lanes_sum8(ms) of one row of x (s per block) for the chunk's 16 columns (mt): lane l of finish's ms is
   here vector l, a column per lane, the same fused multiply-adds (a last group of fewer than 8 blocks: zeros). */
inline __m512 ms_lanes(const float *mt, const float *s, int64_t blocks) {
    __m512 ms[8];
    for (int l = 0; l < 8; l++) ms[l] = _mm512_setzero_ps();
    const int64_t whole = blocks / 8 * 8;
    for (int64_t b0 = 0; b0 < whole; b0 += 8)
        for (int l = 0; l < 8; l++) ms[l] = _mm512_fmadd_ps(_mm512_load_ps(mt + (b0 + l) * 16), _mm512_set1_ps(s[b0 + l]), ms[l]);
    if (whole < blocks)
        for (int l = 0; l < 8; l++)
            ms[l] = whole + l < blocks ? _mm512_fmadd_ps(_mm512_load_ps(mt + (whole + l) * 16), _mm512_set1_ps(s[whole + l]), ms[l])
                                       : _mm512_fmadd_ps(_mm512_setzero_ps(), _mm512_setzero_ps(), ms[l]);
    return _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(ms[0], ms[4]), _mm512_add_ps(ms[2], ms[6])),
                         _mm512_add_ps(_mm512_add_ps(ms[1], ms[5]), _mm512_add_ps(ms[3], ms[7])));
}
#endif

template <int R = 1>
void rows_tile(int64_t count, const Q5Matrix &m, int64_t col, const int8_t *const *xq, const float *const *xd,
               const int32_t *const *xc, const float *const *xs, const float *const *xdp, float *const *out) {
    if constexpr (R < TILE) {
        if (count != R) return rows_tile<R + 1>(count, m, col, xq, xd, xc, xs, xdp, out);
    }
    tile<R>(m, col, xq, xd, xc, xs, xdp, out);
}

/* Below this many multiply-adds a product runs on one thread (gguf_kernels.cpp's threshold, for its reason). */
constexpr int64_t THREADED_MIN_WORK = int64_t(1) << 22;
#if defined(Q5_PAIRS)
#ifndef Q5_LANES_ROWS
#define Q5_LANES_ROWS 4
#define Q5_LANES_COLS 4
#endif
constexpr int LANES_ROWS = Q5_LANES_ROWS, LANES_COLS = Q5_LANES_COLS;  // tile_lanes' tile
constexpr int MAX_ROWS = std::max(TILE, LANES_ROWS);
#else
constexpr int MAX_ROWS = TILE;
#endif
void product(const Q5Matrix &m, const float *x, int64_t rows, float *out) {
    const int64_t k = m.k, n = m.n, blocks = m.blocks();
    const bool threaded = g_threads > 1 && n > 1 && rows * n * k >= THREADED_MIN_WORK;
    const RoundedRows xr = round_rows(x, rows, k, m.type);
    // columns in chunks of COLUMNS, and in a chunk each tile of rows over all its columns: a tile's rounded rows stay
    // in L1 while the chunk's weight rows come from L2 (each column over every tile instead read all the rows'
    // activations from L2 for every column: 32 rows of 576 x 1536 1000 -> 770 us, 1536 x 576 940 -> 690)
    const int64_t chunks = (n + COLUMNS - 1) / COLUMNS;
#if defined(Q5_PAIRS)
    const bool wide = rows > 1;  // several rows of x: tiles of LANES_COLS weight rows x LANES_ROWS rows (tile_lanes)
    const int64_t step = wide ? LANES_ROWS : TILE;
#else
    const int64_t step = TILE;
#endif
#pragma omp parallel for schedule(static) num_threads(g_threads) if (threaded)
    for (int64_t chunk = 0; chunk < chunks; chunk++) {
        const int8_t *qs[MAX_ROWS];
        const float *ds[MAX_ROWS], *ss[MAX_ROWS], *dps[MAX_ROWS];
        const int32_t *cs[MAX_ROWS];
        float *outs[MAX_ROWS];
#if defined(Q5_PAIRS)
        if (wide) {
            // several rows of x: the chunk's weight rows unpacked once (COLUMNS x k bytes, in L1 for every tile of
            // rows) and Q5_1's m made a vector of the 16 columns per block; each tile of rows' lane sums to `sums`,
            // then per row its 16 outputs at once (reduce_columns, ms_lanes)
            const int64_t first = chunk * COLUMNS, columns = std::min(n, first + COLUMNS) - first;
            std::unique_ptr<__m512i[]> unpacked(new __m512i[COLUMNS * ((blocks + 1) / 2)]), mt(new __m512i[m.type == Q5_1 ? blocks : 0]),
                scale(new __m512i[LANES_ROWS * LANES_COLS * ((blocks + 15) / 16)]);  // tile_lanes' d_w d_x
            alignas(64) float sums[LANES_ROWS * COLUMNS * 16] = {};
            unpack_lanes(m, first, columns, reinterpret_cast<uint8_t *>(unpacked.get()));
            if (m.type == Q5_1) transpose_m(m, first, columns, reinterpret_cast<float *>(mt.get()));
            const __mmask16 valid = __mmask16((1u << columns) - 1);
            for (int64_t r0 = 0; r0 < rows; r0 += LANES_ROWS) {
                const int64_t count = std::min<int64_t>(LANES_ROWS, rows - r0);
                for (int64_t i = 0; i < count; i++) ds[i] = xr.d.data() + (r0 + i) * blocks;
                for (int64_t c = 0; c < columns; c += LANES_COLS)
                    rows_lanes<LANES_ROWS, LANES_COLS>(count, std::min<int64_t>(LANES_COLS, columns - c), m, first + c, xr, r0,
                                                       ds, reinterpret_cast<const uint8_t *>(unpacked.get()) + c * ((blocks + 1) / 2) * 64,
                                                       sums + c * 16, reinterpret_cast<float *>(scale.get()));
                for (int64_t i = 0; i < count; i++) {
                    __m512 o = reduce_columns(sums + i * COLUMNS * 16);
                    if (m.type == Q5_1)
                        o = _mm512_add_ps(o, ms_lanes(reinterpret_cast<const float *>(mt.get()), xr.s.data() + (r0 + i) * blocks, blocks));
                    _mm512_mask_storeu_ps(out + (r0 + i) * n + first, valid, o);
                }
            }
            continue;
        }
#endif
        for (int64_t r0 = 0; r0 < rows; r0 += step) {
            const int64_t count = std::min<int64_t>(step, rows - r0);
            for (int64_t i = 0; i < count; i++) {
                const int64_t r = r0 + i;
                qs[i] = xr.q.data() + r * k;
                ds[i] = xr.d.data() + r * blocks;
                ss[i] = m.type == Q5_1 ? xr.s.data() + r * blocks : nullptr;
                cs[i] = m.type == Q5_0 ? xr.c.data() + r * blocks * 8 : nullptr;
                dps[i] = xr.dpair.empty() ? nullptr : xr.dpair.data() + r * (blocks / 2) * 16;
                outs[i] = out + r * n;
            }
            int64_t col = chunk * COLUMNS;
            const int64_t last = std::min(n, (chunk + 1) * COLUMNS);
            for (; col < last; col++) rows_tile(count, m, col, qs, ds, cs, ss, dps, outs);
        }
    }
}

/* product() as kernels_common.h's BlockProduct calls it: w the codes, d and (Q5_1) m of one matrix, or of one
   expert of a stack. */
void q5_product(const std::vector<const uint8_t *> &w, int64_t n, int64_t k, const float *x, int64_t rows, float *out,
                int type, bool) {
    const uint16_t *d = reinterpret_cast<const uint16_t *>(w[1]);
    product(Q5Matrix{w[0], d, w.size() > 2 ? reinterpret_cast<const uint16_t *>(w[2]) : d, type, n, k}, x, rows, out);
}

void check(const mx::array &x, const std::vector<mx::array> &w, int type) {
    auto fail = [](const std::string &why) { throw std::invalid_argument("pipeline GGUF Q5 product: " + why); };
    if (type != Q5_0 && type != Q5_1) fail("type must be Q5_0 (6) or Q5_1 (7)");
    const int64_t k = x.shape(-1);
    if (k % BLOCK) fail("k must be a multiple of 32");
    const mx::array &codes = w[0], &d = w[1];
    if (codes.ndim() != 2 || codes.dtype() != mx::uint32 || codes.shape(1) != k * 5 / 32)
        fail("codes must be uint32 [n, 5 k / 32] (MLX's 5-bit codes)");
    if (d.ndim() != 2 || d.dtype() != mx::float16 || d.shape(0) != codes.shape(0) || d.shape(1) != k / BLOCK)
        fail("scales must be float16 [n, k / 32]");
    if (type == Q5_1 && (w.size() < 3 || w[2].dtype() != mx::float16 || w[2].shape() != d.shape()))
        fail("Q5_1's biases must be float16 [n, k / 32]");
}

mx::array q5_array(const mx::array &x, const mx::array &codes, const mx::array &scales,
                   const std::optional<mx::array> &biases, int type, const std::optional<mx::array> &experts) {
    std::vector<mx::array> weights{codes, scales};
    if (type == Q5_1 && biases) weights.push_back(*biases);
    return block_product<q5_product>("pipeline GGUF Q5 product", type, true, x, weights, experts,
                                     [&](const std::vector<mx::array> &w) { check(x, w, type); });
}

}  // namespace

void register_gguf_q5(nb::module_ &m) {
    m.def(
        "gguf_q5_matmul",
        [](const mx::array &x, const mx::array &codes, const mx::array &scales, const std::optional<mx::array> &biases,
           int type) { return q5_array(x, codes, scales, biases, type, std::nullopt); },
        nb::arg("x"), nb::arg("codes"), nb::arg("scales"), nb::arg("biases").none(), nb::arg("type"),
        "x [..., k] float32 @ w.T for a GGUF Q5_0 (type 6: codes, float16 d) or Q5_1 (7: and float16 m as biases) "
        "matrix held as MLX's 5-bit codes, lazily, as llama.cpp computes it: x rounded per 32 as Q8_0 / Q8_1, int8 "
        "dot products");
    m.def(
        "gguf_q5_gather_matmul",
        [](const mx::array &x, const mx::array &codes, const mx::array &scales, const std::optional<mx::array> &biases,
           int type, const mx::array &experts) { return q5_array(x, codes, scales, biases, type, experts); },
        nb::arg("x"), nb::arg("codes"), nb::arg("scales"), nb::arg("biases").none(), nb::arg("type"),
        nb::arg("experts"),
        "x [rows, k] float32: row p times expert experts[p]'s matrix of a Q5_0 / Q5_1 stack (codes, scales, biases "
        "[experts, n, ...]), lazily: each row the bits of gguf_q5_matmul on that row alone");
}
