/* Products with GGUF tensors held in their own block layout (no re-quantization): IQ4_NL, IQ4_XS and Q6_K,
 * as llama.cpp computes them on CPU (ggml-cpu's vec_dot_iq4_nl_q8_0, vec_dot_iq4_xs_q8_K, vec_dot_q6_K_q8_K).
 *
 * The held layout (checkpoints/quants.py native_arrays): a tensor's rows, each split in two arrays whose
 * bytes together are the file's bytes of that row, verbatim:
 *   codes  uint8 [n, k / 2]: per 32 values the block's 16 bytes `qs`, byte i holding value i in its low
 *          nibble and value i + 16 in its high nibble (both types; an IQ4_XS super-block is 8 of these);
 *   scales IQ4_NL: uint16 [n, k / 32], each block's d (fp16 bits);
 *          IQ4_XS: int8 [n, k / 32] (raw bytes), per 256 values the block's 8 header bytes (d fp16, scales_h
 *          uint16, scales_l[4]): sub-block j's scale is d * (ls_j - 32), ls_j 6 bits (4 in scales_l,
 *          2 in scales_h).
 * A value is w = scale * KVALUES[code] (KVALUES: ggml's kvalues_iq4nl).
 * Q6_K (210 bytes per 256 values: ql[128], qh[64], int8 scales[16], fp16 d) in three arrays:
 *   codes  uint8 [n, 3 k / 4]: per 256 values ql then qh (192 bytes; q6_values says which bits are whose);
 *   scales int64 [n, k / 128]: per 256 values the 16 int8 scales, one per 16 values (8 bytes an element);
 *   d      uint8 [n, k / 128]: per 256 values d's 2 bytes.
 * A value is w = d * sc_j * (q - 32), q 6 bits.
 *
 * Two products, each out[m][n] = sum_k x[m][k] * w[n][k]:
 *   float: each weight dequantized to float32, exactly (fp16 d x a 6-bit integer x an int8: at most 24
 *          significant bits), 16 lane accumulators fma(w, x, acc) over k in order, one lane-sum tree;
 *   int8 (llama.cpp's): x rounded per block as ggml's q8 types: IQ4_NL pairs with 32-value blocks,
 *          IQ4_XS with 256-value ones (Q8_K): d = max|x| / 127, xq = rint(x / d). Per 32 weights the
 *          integer dot product sum(KVALUES[q] * xq) is exact, in 8 lanes of 4 products each
 *          (|KVALUES| <= 127 times the sign of the weight on xq: vpmaddubsw cannot saturate, or
 *          vpdpbusd with AVX-512 VNNI); IQ4_NL: acc = fma(float(lanes), d_w * d_x, acc) per block, the even
 *          blocks and the odd ones in two accumulators, added at the end;
 *          IQ4_XS: lanes times (ls_j - 32), summed as integers over the super-block, then
 *          acc = fma(float(lanes), d_w * d_x, acc); finally the 8 lanes in one tree;
 *          Q6_K as IQ4_XS (Q8_K activations), the lanes of each 32 weights (q - 32, |q - 32| <= 32) times their
 *          16-value sub-block's sc_j, summed as integers over the super-block (|sum| < 2^31), then the same fma.
 * On AVX-512 VNNI + VBMI the int8 products of IQ4_NL and IQ4_XS run in tiles of weight rows x rows of x (nl_product,
 * xs_product): x rounded with vectors and laid out once per product, each pair of blocks' codes looked up in
 * registers (vpermb), IQ4_NL's weights unsigned (KVALUES + 128) against a lane start of -128 sum(xq), its scales
 * d_w * d_x for 16 blocks in one product: the same integers and the same fused multiply-adds, so the same bits
 * (tests/test_gguf_iq4_tiles.py), 2.5-3x faster than the per-row path (int8_tile) on one row, 1.7-2.5x on many.
 * Q6_K's int8 products of 3 or more rows (q6_product, same builds) take 16 weight rows at a time, a vector lane per
 * output column: each super-block of the 16 decoded once for all rows of x into interleaved quads (values 4t..4t+3 of
 * the 16 columns in one vector, q - 32), x unsigned (xq + 128) against a lane start of -128 sum(sc (q - 32)), each
 * quad's products paired by vpmaddubsw (|pair| <= 2 255 32) and scaled by its sub-block's sc in vpdpwssd: per column
 * int8_tile's 8 integer lanes, exact, then its fused multiply-adds lane by lane and its tree (same bits; 2.3x faster
 * on 32 rows; 1 and 2 rows stay per row). IQ4_XS from 8 rows (xs16_product) and IQ4_NL from 16 (nl16_product) the
 * same way: IQ4_XS as |KVALUES| bytes with the weights' signs put on x (vpmaddubsw) times ls_j - 32 (vpdpwssd), then
 * int8_tile's fused multiply-add per lane and super-block; IQ4_NL per block vpdpbusd of KVALUES + 128 from a lane
 * start MAGIC - 128 sum(xq), less MAGIC, and one fused multiply-add per lane into the chain of the block's parity:
 * 16 float lanes per column (the float chain, 2 of its 3 operations per 4 products, bounds IQ4_NL: 1.1-1.2x).
 * Every output element is that fixed sequence on its row of x and its weight row whatever the number of
 * rows, their order or the threads (batch invariance); the AVX2, AVX-512 and generic code give the same
 * bits (integer sums are exact; the float steps are the same fused multiply-adds, std::fma in the generic
 * code). Built with the rest of the extension by build.py (-march=native): the ISA is this machine's.
 */
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"
#include "mlx/types/half_types.h"

#include "kernels_common.h"

namespace nb = nanobind;

namespace {

enum GGMLType { Q6_K = 14, IQ4_NL = 20, IQ4_XS = 23 };  // ggml's type ids (GGMLQuantizationType)

constexpr int BLOCK = 32;  // values per code block (qs of 16 bytes)
constexpr int SUPER = 256;  // values per IQ4_XS super-block and per Q8_K activation block
constexpr int8_t KVALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

inline float half_at(const uint8_t *p) {
    mx::float16_t h;
    std::memcpy(&h, p, 2);
    return static_cast<float>(h);
}

/* One held matrix: row r's codes at codes + r * code_row_bytes, its scales at scales + r * scale_row_bytes,
   Q6_K's d (fp16) per 256 at ds + r * k / 128. */
struct NativeMatrix {
    const uint8_t *codes, *scales, *ds;
    int type;
    int64_t n, k;

    int64_t code_row_bytes() const { return type == Q6_K ? k / SUPER * 192 : k / 2; }
    int64_t scale_row_bytes() const { return type == IQ4_NL ? k / BLOCK * 2 : type == Q6_K ? k / 16 : k / BLOCK; }
    const uint8_t *codes_of(int64_t r) const { return codes + r * code_row_bytes(); }
    const uint8_t *scales_of(int64_t r) const { return scales + r * scale_row_bytes(); }
    const uint8_t *ds_of(int64_t r) const { return ds + r * (k / SUPER * 2); }
};

/* Q6_K: the 32 values of chunk c (0..3) of a 128-value half of a super-block (ql: its 64 bytes, qh: its 32),
   minus 32, in order (ggml's dequantize_row_q6_K): value l's low 4 bits are the low (c < 2) or high nibble of
   ql[l + 32 (c % 2)], its high 2 bits bits 2c, 2c + 1 of qh[l]; values 0-15 are sub-block 2c of the half,
   16-31 sub-block 2c + 1. */
inline void q6_values(const uint8_t *ql, const uint8_t *qh, int c, int8_t *out) {
    for (int l = 0; l < 32; l++) {
        const int low = (ql[l + 32 * (c % 2)] >> (4 * (c / 2))) & 15, high = (qh[l] >> (2 * c)) & 3;
        out[l] = int8_t((low | (high << 4)) - 32);
    }
}

/* IQ4_XS: the 6-bit scale of sub-block j (0..7) of a super-block's 8 header bytes, minus 32. */
inline int xs_scale(const uint8_t *head, int j) {
    uint16_t high;
    std::memcpy(&high, head + 2, 2);
    const int low = (head[4 + j / 2] >> (4 * (j % 2))) & 15;
    return (low | (((high >> (2 * j)) & 3) << 4)) - 32;
}

/* Block b's scale (float, exact) of a row's scales. */
inline float block_scale(const NativeMatrix &m, const uint8_t *scales, int64_t b) {
    if (m.type == IQ4_NL) return half_at(scales + 2 * b);
    const uint8_t *head = scales + (b / 8) * 8;
    return half_at(head) * float(xs_scale(head, int(b % 8)));
}

#if defined(__AVX2__)
/* q6_values in one vector. */
inline __m256i q6_vector(const uint8_t *ql, const uint8_t *qh, int c) {
    const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(ql + 32 * (c % 2)));
    const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(qh));
    const __m256i three = _mm256_set1_epi8(3), fifteen = _mm256_set1_epi8(15);
    const __m256i nibble = _mm256_and_si256(c < 2 ? low : _mm256_srli_epi16(low, 4), fifteen);
    const __m256i top = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 2 * c), three), 4);
    return _mm256_sub_epi8(_mm256_or_si256(nibble, top), _mm256_set1_epi8(32));
}
#endif

/* ---- float products ------------------------------------------------------------------------------ */

/* The 32 weights of a block, w = scale * KVALUES[q], as two vectors: values 0-15 (low nibbles), 16-31. */
inline void dequantize_block(const uint8_t *qs, float scale, v16 &w0, v16 &w1) {
    alignas(64) float table[16];
    for (int i = 0; i < 16; i++) table[i] = scale * float(KVALUES[i]);  // exact (at most 24 bits)
#if defined(__AVX512F__)
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(qs)));
    const __m512 t = _mm512_load_ps(table);
    w0 = (v16)_mm512_permutexvar_ps(v, t);  // vpermps reads the low 4 bits of each index
    w1 = (v16)_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), t);
#else
    float a[16], b[16];
    for (int i = 0; i < 16; i++) {
        a[i] = table[qs[i] & 15];
        b[i] = table[qs[i] >> 4];
    }
    w0 = load16(a);
    w1 = load16(b);
#endif
}

constexpr int FLOAT_TILE = 8;  // rows sharing each dequantized block

/* out[r][col] for rows [0, R) of x: one weight row, every block dequantized once for the R rows. */
template <int R>
void float_tile(const NativeMatrix &m, int64_t col, const float *const *x, float *const *out) {
    const uint8_t *codes = m.codes_of(col), *scales = m.scales_of(col);
    v16 acc[R] = {};
    if (m.type == Q6_K) {  // sub-block by sub-block of 16: w = (d sc_j) (q - 32), exact (at most 24 bits)
        const int8_t *sc = reinterpret_cast<const int8_t *>(scales);
        for (int64_t sb = 0; sb < m.k / SUPER; sb++) {
            const float d = half_at(m.ds_of(col) + 2 * sb);
            for (int h = 0; h < 2; h++)
                for (int c = 0; c < 4; c++) {
                    const uint8_t *ql = codes + 192 * sb + 64 * h, *qh = codes + 192 * sb + 128 + 32 * h;
                    const int j = 16 * int(sb) + 8 * h + 2 * c;  // the first sub-block's scale
                    const float s0 = d * float(sc[j]), s1 = d * float(sc[j + 1]);
#if defined(__AVX512F__) && defined(__AVX2__)
                    const __m256i q = q6_vector(ql, qh, c);  // the products below are exact: the same bits
                    const v16 w0 = (v16)_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))),
                                                      _mm512_set1_ps(s0));
                    const v16 w1 = (v16)_mm512_mul_ps(
                        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))), _mm512_set1_ps(s1));
#else
                    int8_t q[32];
                    q6_values(ql, qh, c, q);
                    float a[16], b[16];
                    for (int i = 0; i < 16; i++) {
                        a[i] = s0 * float(q[i]);
                        b[i] = s1 * float(q[i + 16]);
                    }
                    const v16 w0 = load16(a), w1 = load16(b);
#endif
                    const int64_t at = SUPER * sb + 128 * h + 32 * c;
                    for (int r = 0; r < R; r++) {
                        acc[r] = fma16(w0, load16(x[r] + at), acc[r]);
                        acc[r] = fma16(w1, load16(x[r] + at + 16), acc[r]);
                    }
                }
        }
        for (int r = 0; r < R; r++) out[r][col] = lanes_sum(acc[r]);
        return;
    }
    for (int64_t b = 0; b < m.k / BLOCK; b++) {
        v16 w0, w1;
        dequantize_block(codes + 16 * b, block_scale(m, scales, b), w0, w1);
        for (int r = 0; r < R; r++) {
            acc[r] = fma16(w0, load16(x[r] + BLOCK * b), acc[r]);
            acc[r] = fma16(w1, load16(x[r] + BLOCK * b + 16), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r][col] = lanes_sum(acc[r]);
}

template <int R = 1>
void float_rows(int64_t count, const NativeMatrix &m, int64_t col, const float *const *x, float *const *out) {
    if constexpr (R < FLOAT_TILE) {
        if (count != R) return float_rows<R + 1>(count, m, col, x, out);
    }
    float_tile<R>(m, col, x, out);
}

/* ---- int8 products ------------------------------------------------------------------------------- */

typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef float f32x8 __attribute__((vector_size(32)));

/* x's rows rounded as ggml's q8 blocks of `block` values: q [rows, k], d [rows, k / block]. */
struct RoundedRows {
    std::vector<int8_t> q;
    std::vector<float> d;
};

RoundedRows round_rows(const float *x, int64_t rows, int64_t k, int64_t block) {
    RoundedRows out{std::vector<int8_t>(rows * k), std::vector<float>(rows * (k / block))};
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < k / block; c++) {
            const float *v = x + r * k + c * block;
            float amax = 0.0f;
            for (int64_t i = 0; i < block; i++) amax = std::max(amax, std::fabs(v[i]));
            const float d = amax / 127.0f;
            float inverse = d > 0.0f ? 1.0f / d : 0.0f;
            if (!(inverse < INFINITY)) inverse = 0.0f;  // tiny or not finite: the block counts as zeros
            out.d[r * (k / block) + c] = d;
            int8_t *q = out.q.data() + r * k + c * block;
            for (int64_t i = 0; i < block; i++) {
                const float f = std::nearbyint(v[i] * inverse);
                q[i] = f >= 127.0f ? 127 : f <= -127.0f ? -127 : f == f ? int8_t(f) : 0;  // NaN: 0
            }
        }
    return out;
}

/* A block's 32 weights as int8 values (KVALUES[code], in order), and their magnitudes. */
struct BlockWeights {
#if defined(__AVX2__)
    __m256i w, magnitude;
#else
    int8_t w[32];
#endif
};

inline BlockWeights block_weights(const uint8_t *qs) {
    BlockWeights out;
#if defined(__AVX2__)
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i *>(qs));
    const __m128i nibble = _mm_set1_epi8(15);
    const __m256i idx = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), nibble), _mm_and_si128(packed, nibble));
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i *>(KVALUES)));
    out.w = _mm256_shuffle_epi8(table, idx);  // the weights' int8 values, in order
    out.magnitude = _mm256_sign_epi8(out.w, out.w);
#else
    for (int i = 0; i < 32; i++) out.w[i] = KVALUES[i < 16 ? qs[i] & 15 : qs[i - 16] >> 4];
#endif
    return out;
}

/* Q6_K chunk c of a half (q6_values) as int8 weights q - 32 (|w| <= 32), and their magnitudes. */
inline BlockWeights q6_weights(const uint8_t *ql, const uint8_t *qh, int c) {
    BlockWeights out;
#if defined(__AVX2__)
    out.w = q6_vector(ql, qh, c);
    out.magnitude = _mm256_sign_epi8(out.w, out.w);
#else
    q6_values(ql, qh, c, out.w);
#endif
    return out;
}

/* 8 int32 lanes, lane l = sum over i < 4 of w[4l + i] * xq[4l + i], for one block of 32 weights and 32
   activations. Exact integers on every path: |w| <= 127 times the sign of w on xq (so vpmaddubsw's pair sums
   cannot saturate), or vpdpbusd with AVX-512 VNNI. */
inline i32x8 block_dot(const BlockWeights &b, const int8_t *xq) {
#if defined(__AVX2__)
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(xq));
    const __m256i signed_x = _mm256_sign_epi8(x, b.w);  // |w| * (x sign w) = w * x
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return (i32x8)_mm256_dpbusd_epi32(_mm256_setzero_si256(), b.magnitude, signed_x);
#else
    return (i32x8)_mm256_madd_epi16(_mm256_maddubs_epi16(b.magnitude, signed_x), _mm256_set1_epi16(1));
#endif
#else
    i32x8 lanes{};
    for (int i = 0; i < 32; i++) lanes[i / 4] += int32_t(b.w[i]) * xq[i];
    return lanes;
#endif
}

inline f32x8 fma8(f32x8 a, f32x8 b, f32x8 acc) {
#if defined(__FMA__) || defined(__AVX512F__)
    return (f32x8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)acc);
#else
    for (int i = 0; i < 8; i++) acc[i] = std::fma(a[i], b[i], acc[i]);
    return acc;
#endif
}

inline f32x8 splat8(float s) { return f32x8{s, s, s, s, s, s, s, s}; }

inline float lanes_sum8(f32x8 v) { return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7])); }

constexpr int INT8_TILE = 4;  // rows sharing each block's looked-up weights

/* out[r][col] for R rounded rows of x (q, block scales d): weight row `col`, each block looked up once for the
   R rows; every row's arithmetic the same whatever R. */
template <int R>
void int8_tile(const NativeMatrix &m, int64_t col, const int8_t *const *xq, const float *const *xd, float *const *out) {
    const uint8_t *codes = m.codes_of(col), *scales = m.scales_of(col);
    f32x8 acc[R] = {};
    if (m.type == IQ4_NL) {
        // two chains of fused multiply-adds, the even blocks' and the odd ones': one row's products wait on the
        // FMA's latency otherwise (decode 1.6x slower)
        f32x8 odd[R] = {};
        int64_t b = 0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
        // AVX-512: a pair of blocks per step, the even one in the low 8 lanes, the odd one in the high 8: the
        // same integer lanes and the same fused multiply-adds into the same two chains as the steps below
        __m512 pair[R];
        for (int r = 0; r < R; r++) pair[r] = _mm512_setzero_ps();
        const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i *>(KVALUES)));
        for (; b + 2 <= m.k / BLOCK; b += 2) {
            const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(codes + 16 * b));
            const __m256i nibble = _mm256_set1_epi8(15);
            const __m256i lo = _mm256_and_si256(packed, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
            const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_permute2x128_si256(lo, hi, 0x20)),
                                                   _mm256_permute2x128_si256(lo, hi, 0x31), 1);
            const __m512i w = _mm512_shuffle_epi8(table, idx), magnitude = _mm512_abs_epi8(w);
            const __mmask64 negative = _mm512_movepi8_mask(w);
            const float d0 = half_at(scales + 2 * b), d1 = half_at(scales + 2 * b + 2);
            for (int r = 0; r < R; r++) {
                const __m512i x = _mm512_loadu_si512(xq[r] + BLOCK * b);
                const __m512i signed_x = _mm512_mask_sub_epi8(x, negative, _mm512_setzero_si512(), x);
                const __m512 lanes = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), magnitude, signed_x));
                const __m512 s = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(d0 * xd[r][b]), _mm512_set1_ps(d1 * xd[r][b + 1]));
                pair[r] = _mm512_fmadd_ps(lanes, s, pair[r]);
            }
        }
        for (int r = 0; r < R; r++) {
            acc[r] = (f32x8)_mm512_castps512_ps256(pair[r]);
            odd[r] = (f32x8)_mm512_extractf32x8_ps(pair[r], 1);
        }
#endif
        for (; b < m.k / BLOCK; b++) {
            const BlockWeights w = block_weights(codes + 16 * b);
            const float d = half_at(scales + 2 * b);
            f32x8 *chain = b % 2 ? odd : acc;
            for (int r = 0; r < R; r++)
                chain[r] = fma8(__builtin_convertvector(block_dot(w, xq[r] + BLOCK * b), f32x8), splat8(d * xd[r][b]),
                                chain[r]);
        }
        for (int r = 0; r < R; r++) acc[r] += odd[r];
    } else if (m.type == Q6_K) {
        // llama.cpp's vec_dot_q6_K_q8_K: per super-block the integer sum over its 16 sub-blocks of sc_j times
        // sum((q - 32) * xq), exact (|value| < 2^31), then acc = fma(float(sum), d_w * d_x, acc)
        const int8_t *sc = reinterpret_cast<const int8_t *>(scales);
        for (int64_t sb = 0; sb < m.k / SUPER; sb++) {
            i32x8 sum[R] = {};
#if defined(__AVX512BW__) && defined(__AVX512DQ__)
            // AVX-512: chunks 2p and 2p + 1 of a half in one step, the even one in the low 8 lanes: the same integer
            // lanes, added together at the end of the super-block (exact). The scales multiply pairs of products
            // (vpmaddubsw: |w| <= 32, so a pair's sum fits 16 bits; vpmaddwd with each 16-value sub-block's scale
            // then gives each lane sc_j times its 4 products, as the steps below)
            __m512i wide[R];
            for (int r = 0; r < R; r++) wide[r] = _mm512_setzero_si512();
            const __m128i first = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
            const __m128i second = _mm_setr_epi8(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
            for (int h = 0; h < 2; h++) {
                const uint8_t *ql = codes + 192 * sb + 64 * h, *qh = codes + 192 * sb + 128 + 32 * h;
                const __m512i low = _mm512_loadu_si512(ql);  // chunk 0's bytes, then chunk 1's
                const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(qh));
                for (int p = 0; p < 2; p++) {
                    const __m512i nibble = _mm512_and_si512(p ? _mm512_srli_epi16(low, 4) : low, _mm512_set1_epi8(15));
                    const __m512i two = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_srli_epi16(high, 4 * p)),
                                                           _mm256_srli_epi16(high, 4 * p + 2), 1);
                    const __m512i top = _mm512_slli_epi16(_mm512_and_si512(two, _mm512_set1_epi8(3)), 4);
                    const __m512i w = _mm512_sub_epi8(_mm512_or_si512(nibble, top), _mm512_set1_epi8(32));
                    const __m512i magnitude = _mm512_abs_epi8(w);
                    const __mmask64 negative = _mm512_movepi8_mask(w);
                    const int j = 16 * int(sb) + 8 * h + 4 * p;  // 16-bit lanes 8i..8i+7: sub-block j + i
                    int32_t four;
                    std::memcpy(&four, sc + j, 4);
                    const __m128i bytes = _mm_cvtsi32_si128(four);
                    const __m512i s = _mm512_cvtepi8_epi16(
                        _mm256_set_m128i(_mm_shuffle_epi8(bytes, second), _mm_shuffle_epi8(bytes, first)));
                    for (int r = 0; r < R; r++) {
                        const __m512i x = _mm512_loadu_si512(xq[r] + SUPER * sb + 128 * h + 64 * p);
                        const __m512i signed_x = _mm512_mask_sub_epi8(x, negative, _mm512_setzero_si512(), x);
                        wide[r] = _mm512_add_epi32(wide[r], _mm512_madd_epi16(_mm512_maddubs_epi16(magnitude, signed_x), s));
                    }
                }
            }
            for (int r = 0; r < R; r++)
                sum[r] = (i32x8)_mm256_add_epi32(_mm512_castsi512_si256(wide[r]), _mm512_extracti64x4_epi64(wide[r], 1));
#else
            for (int h = 0; h < 2; h++)
                for (int c = 0; c < 4; c++) {
                    const BlockWeights w = q6_weights(codes + 192 * sb + 64 * h, codes + 192 * sb + 128 + 32 * h, c);
                    const int j = 16 * int(sb) + 8 * h + 2 * c;  // lanes 0-3: sub-block j, 4-7: j + 1
                    const i32x8 s = {sc[j], sc[j], sc[j], sc[j], sc[j + 1], sc[j + 1], sc[j + 1], sc[j + 1]};
                    const int64_t at = SUPER * sb + 128 * h + 32 * c;
                    for (int r = 0; r < R; r++) sum[r] += block_dot(w, xq[r] + at) * s;
                }
#endif
            const float d = half_at(m.ds_of(col) + 2 * sb);
            for (int r = 0; r < R; r++)
                acc[r] = fma8(__builtin_convertvector(sum[r], f32x8), splat8(d * xd[r][sb]), acc[r]);
        }
    } else {
        for (int64_t sb = 0; sb < m.k / SUPER; sb++) {
            const uint8_t *head = scales + 8 * sb;
            i32x8 sum[R] = {};
            for (int j = 0; j < 8; j++) {
                const int64_t b = sb * 8 + j;
                const BlockWeights w = block_weights(codes + 16 * b);
                const int ls = xs_scale(head, j);
                for (int r = 0; r < R; r++) sum[r] += block_dot(w, xq[r] + BLOCK * b) * ls;
            }
            const float d = half_at(head);
            for (int r = 0; r < R; r++)
                acc[r] = fma8(__builtin_convertvector(sum[r], f32x8), splat8(d * xd[r][sb]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r][col] = lanes_sum8(acc[r]);
}

template <int R = 1>
void int8_rows(int64_t count, const NativeMatrix &m, int64_t col, const int8_t *const *xq, const float *const *xd,
               float *const *out) {
    if constexpr (R < INT8_TILE) {
        if (count != R) return int8_rows<R + 1>(count, m, col, xq, xd, out);
    }
    int8_tile<R>(m, col, xq, xd, out);
}

/* ---- IQ4_NL's int8 product on AVX-512 VNNI + VBMI: columns and rows in tiles, x prepared once -------- */

/* Whether product() takes nl_product, xs_product and q6_product for IQ4_NL's, IQ4_XS's and Q6_K's int8 products where
   they are built (gguf_iq4_tiled(False): the per-row tiles above, kept for the tests to compare bits with). */
bool g_iq4_tiled = true;

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__) && defined(__F16C__)
#define PIPELINE_IQ4_TILED 1

/* The same integer lanes and fused multiply-adds as int8_tile's AVX-512 steps, in another lane order and with less
   work per block:
   - a pair of blocks (2p, 2p + 1) is its 32 code bytes read into both halves of a register, the upper half shifted
     right 4 bits: 64 indices whose low 4 bits are, in order, block 2p's values 0-15, block 2p + 1's values 0-15,
     block 2p's 16-31, block 2p + 1's 16-31 (vpermb reads the low 6 bits of an index: TABLE64 is KVALUES 4 times,
     so the shifted-in bits above the nibble need no mask);
   - the weights enter vpdpbusd unsigned, KVALUES + 128 (1..241), times xq signed: each 4-product lane is
     sum(w xq) + 128 sum(xq), and the lane starts at -128 sum(xq) (x's part alone, once per row of x): the same
     exact integers without the sign and magnitude of every weight;
   - x is prepared once per product in that order (NlRows): per pair 64 xq bytes, 16 int32 lane starts and 16
     copies of the blocks' d_x laid out as the lanes (2p: lanes 0-3 and 8-11, 2p + 1: lanes 4-7 and 12-15), so that
     each lane's scale is d_w * d_x as before (one float product) and each lane's fused multiply-add chain is the
     one of its block parity: lanes 0-3 and 8-11 are the even blocks' chain, lanes 4-7 and 12-15 the odd ones';
   - NL_COLUMNS weight rows share each row of x's loads and up to NL_ROWS rows of x each weight pair's decoding. */
/* The weights a tile reads stream from memory (a model's matrices do not stay in the caches between tokens): each
   tile asks for the bytes of the tile AHEAD tiles on (measured on 240 one-row products of SmolLM2's IQ4_NL shapes,
   75 MB, one thread: 12.5-13.4 ms without, 6.4-9 ms with; the codes alone 7.8-9.1). A prefetch past the matrix's
   end is a hint that never faults. */
constexpr int AHEAD = 2;

inline void prefetch(const void *p) { _mm_prefetch(reinterpret_cast<const char *>(p), _MM_HINT_T0); }

alignas(64) constexpr uint8_t TABLE64[64] = {
    1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241, 1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166,
    181, 197, 217, 241, 1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241, 1, 24, 45, 63, 79, 93, 106, 118,
    129, 141, 153, 166, 181, 197, 217, 241};  // KVALUES[i % 16] + 128
static_assert(KVALUES[0] + 128 == 1 && KVALUES[15] + 128 == 241);

/* Where byte t of a pair's weights comes from among its 32 code bytes (block 2p's 16, then 2p + 1's): lane l = t / 4
   is block 2p + l % 2's values v = 4 (l / 2) + t % 4, the low nibbles of code byte v % 16 (lanes 0-7) or the high
   ones (lanes 8-15: v >= 16, shifted down before the look-up). */
constexpr std::array<uint8_t, 64> order64() {
    std::array<uint8_t, 64> out{};
    for (int t = 0; t < 64; t++) out[t] = uint8_t(16 * ((t / 4) % 2) + (4 * (t / 8) + t % 4) % 16);
    return out;
}
alignas(64) constexpr std::array<uint8_t, 64> ORDER64 = order64();

struct NlRows {
    int64_t pairs;
    std::vector<int8_t> q;        // [rows, pairs * 64]
    std::vector<int32_t> start;   // [rows, pairs * 16]
    std::vector<float> d;         // [rows, pairs * 2]: each block's d_x
    std::vector<int8_t> tail_q;   // [rows, 32]: an odd number of blocks' last one, as round_rows rounds it
    std::vector<float> tail_d;    // [rows]
};

/* 0x4B400000 is 1.5 * 2^23 as a float: an integer lane L (|L| < 2^22) added to these bits is 1.5 * 2^23 + L as a
   float, exactly; minus 1.5 * 2^23 it is float(L) (vsubps on either vector port rather than vcvtdq2ps on one). */
constexpr int32_t MAGIC_BITS = 0x4B400000;
constexpr float MAGIC = 12582912.0f;

/* A pair of blocks' 64 values (block 2p's 32, then 2p + 1's) in the lane order: lane l is block 2p + l % 2's values
   4 (l / 2) .. 4 (l / 2) + 3. */
inline __m512i lane_order(const int8_t *natural) {
    return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15),
                                    _mm512_loadu_si512(natural));
}

NlRows nl_rows(const float *x, int64_t rows, int64_t k) {
    const int64_t blocks = k / BLOCK, pairs = blocks / 2;
    NlRows out{pairs, std::vector<int8_t>(rows * pairs * 64), std::vector<int32_t>(rows * pairs * 16),
               std::vector<float>(rows * pairs * 2), std::vector<int8_t>(blocks % 2 ? rows * 32 : 0),
               std::vector<float>(blocks % 2 ? rows : 0)};
    const __m512i bias = _mm512_set1_epi8(int8_t(-128)), magic = _mm512_set1_epi32(MAGIC_BITS);
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t p = 0; p < pairs; p++) {
            alignas(64) int8_t natural[64];
            const float d0 = round_q8_block<32>(x + r * k + 64 * p, natural), d1 = round_q8_block<32>(x + r * k + 64 * p + 32, natural + 32);
            const __m512i q = lane_order(natural);
            _mm512_storeu_si512(out.q.data() + (r * pairs + p) * 64, q);
            // magic - 128 sum(q) per lane: vpdpbusd of 128 (unsigned) and -q
            _mm512_storeu_si512(out.start.data() + (r * pairs + p) * 16,
                                _mm512_dpbusd_epi32(magic, bias, _mm512_sub_epi8(_mm512_setzero_si512(), q)));
            out.d[r * pairs * 2 + 2 * p] = d0;
            out.d[r * pairs * 2 + 2 * p + 1] = d1;
        }
        if (blocks % 2) out.tail_d[r] = round_q8_block<32>(x + r * k + 64 * pairs, out.tail_q.data() + 32 * r);
    }
    return out;
}

/* out[r][col + c] for R rows of x and C weight rows from col. */
template <int R, int C>
void nl_tile(const NativeMatrix &m, int64_t col, const NlRows &x, int64_t r0, float *out) {
    const int64_t pairs = x.pairs, blocks = m.k / BLOCK;
    const uint8_t *codes[C];
    const uint16_t *scales[C];
    for (int c = 0; c < C; c++) {
        codes[c] = m.codes_of(col + c);
        scales[c] = reinterpret_cast<const uint16_t *>(m.scales_of(col + c));
    }
    const int8_t *xq[R];
    const int32_t *xs[R];
    const float *xd[R];
    for (int r = 0; r < R; r++) {
        xq[r] = x.q.data() + (r0 + r) * pairs * 64;
        xs[r] = x.start.data() + (r0 + r) * pairs * 16;
        xd[r] = x.d.data() + (r0 + r) * pairs * 2;
    }
    __m512 acc[R][C];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    const __m512i table = _mm512_load_si512(TABLE64), order = _mm512_load_si512(ORDER64.data());
    alignas(64) float scale[R][C][16];  // d_w * d_x of 16 blocks: a pair's two read as one 64-bit broadcast
    for (int64_t g = 0; g < pairs; g += 8) {
        const int count = int(std::min<int64_t>(8, pairs - g));
        const __mmask16 valid = __mmask16((1u << (2 * count)) - 1);
        for (int c = 0; c < C; c++) {
            const __m512 dw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid, scales[c] + 2 * g));
            prefetch(scales[c] + AHEAD * C * (m.k / BLOCK) + 2 * g);
            for (int r = 0; r < R; r++) _mm512_store_ps(scale[r][c], _mm512_mul_ps(dw, _mm512_maskz_loadu_ps(valid, xd[r] + 2 * g)));
        }
        for (int j = 0; j < count; j++) {
            const int64_t p = g + j;
            for (int c = 0; c < C; c++) {
                const __m512i packed = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(codes[c] + 32 * p)));
                if (p % 2 == 0) prefetch(codes[c] + AHEAD * C * (m.k / 2) + 32 * p);
                const __m512i placed = _mm512_permutexvar_epi8(order, packed);
                const __m512i w = _mm512_permutexvar_epi8(_mm512_mask_srli_epi16(placed, 0xFFFF0000u, placed, 4), table);
                for (int r = 0; r < R; r++) {
                    const __m512i lanes = _mm512_dpbusd_epi32(_mm512_loadu_si512(xs[r] + 16 * p), w,
                                                              _mm512_loadu_si512(xq[r] + 64 * p));
                    const __m512 value = _mm512_sub_ps(_mm512_castsi512_ps(lanes), _mm512_set1_ps(MAGIC));
                    double two;
                    std::memcpy(&two, &scale[r][c][2 * j], 8);
                    acc[r][c] = _mm512_fmadd_ps(value, _mm512_castpd_ps(_mm512_set1_pd(two)), acc[r][c]);
                }
            }
        }
    }
    const __m512i split = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            const __m512 both = _mm512_permutexvar_ps(split, acc[r][c]);
            f32x8 even = (f32x8)_mm512_castps512_ps256(both), odd = (f32x8)_mm512_extractf32x8_ps(both, 1);
            if (blocks % 2) {  // the last block alone, an even one: int8_tile's step
                const int64_t b = blocks - 1;
                const BlockWeights w = block_weights(codes[c] + 16 * b);
                const float dwb = half_at(m.scales_of(col + c) + 2 * b);
                even = fma8(__builtin_convertvector(block_dot(w, x.tail_q.data() + 32 * (r0 + r)), f32x8),
                            splat8(dwb * x.tail_d[r0 + r]), even);
            }
            even += odd;
            out[(r0 + r) * m.n + col + c] = lanes_sum8(even);
        }
}

template <int NR, int NC, int R = 1>
void nl_rows_tile(int64_t count, const NativeMatrix &m, int64_t col, int64_t columns, const NlRows &x,
                  int64_t r0, float *out) {
    if constexpr (R < NR) {
        if (count != R) return nl_rows_tile<NR, NC, R + 1>(count, m, col, columns, x, r0, out);
    }
    if (columns == NC) return nl_tile<R, NC>(m, col, x, r0, out);
    for (int64_t c = 0; c < columns; c++) nl_tile<R, 1>(m, col + c, x, r0, out);
}

template <int NR, int NC>
void nl_loop(const NativeMatrix &m, int64_t rows, float *out, bool threaded, const NlRows &prepared) {
    const int64_t tiles = (m.n + NC - 1) / NC;
#pragma omp parallel for schedule(static) num_threads(g_threads) if (threaded)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t col = t * NC, columns = std::min<int64_t>(NC, m.n - col);
        for (int64_t r0 = 0; r0 < rows; r0 += NR)
            nl_rows_tile<NR, NC>(std::min<int64_t>(NR, rows - r0), m, col, columns, prepared, r0, out);
    }
}

void nl_product(const NativeMatrix &m, const float *x, int64_t rows, float *out, bool threaded) {
    const NlRows prepared = nl_rows(x, rows, m.k);
    // one row (decode): 8 weight rows a tile (measured 5% faster than 4); more: 4 x 4 (2, 3, 6 or 8 rows x 2 or 4
    // columns measured up to 30% slower)
    if (rows == 1) return nl_loop<1, 8>(m, rows, out, threaded, prepared);
    nl_loop<4, 4>(m, rows, out, threaded, prepared);
}

/* IQ4_XS: the same lane order, pair by pair of each super-block's 8 blocks; per lane sum over the super-block of
   (ls_j - 32) times its 4 products, as int8_tile's integers (exact, |sum| < 2^31): |KVALUES[q]| (MAG64) and x with
   the weight's sign (codes 0-7 are the negative ones) through vpmaddubsw (pairs of products, at most 2 127^2 < 2^15),
   then vpdpwssd with each block's 16-bit scale; the lane pairs (2i, 2i + 1) of a super-block are int8_tile's lane i
   (blocks 2j and 2j + 1), added before the fused multiply-add acc = fma(float(sum), d_w * d_x, acc) in lane 2i. */
/* SPREAD_WORDS[2 q + h]: word i is scale 4 h + i / 8 of the super-block in 128-bit quarter q (8 words each). */
constexpr std::array<std::array<int16_t, 32>, 8> spread_words() {
    std::array<std::array<int16_t, 32>, 8> out{};
    for (int q = 0; q < 4; q++)
        for (int h = 0; h < 2; h++)
            for (int i = 0; i < 32; i++) out[2 * q + h][i] = int16_t(8 * q + 4 * h + i / 8);
    return out;
}
alignas(64) constexpr std::array<std::array<int16_t, 32>, 8> SPREAD_WORDS = spread_words();
alignas(64) constexpr uint8_t MAG64[64] = {
    127, 104, 83, 65, 49, 35, 22, 10, 1, 13, 25, 38, 53, 69, 89, 113, 127, 104, 83, 65, 49, 35, 22, 10, 1, 13, 25, 38, 53, 69, 89, 113,
    127, 104, 83, 65, 49, 35, 22, 10, 1, 13, 25, 38, 53, 69, 89, 113, 127, 104, 83, 65, 49, 35, 22, 10, 1, 13, 25, 38, 53, 69, 89, 113};

struct XsRows {
    std::vector<int8_t> q;  // [rows, k]: each pair of blocks' 16-byte quarters in the order 0, 2, 1, 3
    std::vector<float> d;   // [rows, k / 256]
};

XsRows xs_rows(const float *x, int64_t rows, int64_t k) {
    XsRows out{std::vector<int8_t>(rows * k), std::vector<float>(rows * (k / SUPER))};
    alignas(64) int8_t natural[SUPER];
    for (int64_t r = 0; r < rows; r++)
        for (int64_t sb = 0; sb < k / SUPER; sb++) {
            out.d[r * (k / SUPER) + sb] = round_q8_block<SUPER>(x + r * k + SUPER * sb, natural);
            for (int p = 0; p < 4; p++) {
                const __m512i v = _mm512_load_si512(natural + 64 * p);
                _mm512_storeu_si512(out.q.data() + r * k + SUPER * sb + 64 * p, _mm512_shuffle_i64x2(v, v, _MM_SHUFFLE(3, 1, 2, 0)));
            }
        }
    return out;
}

template <int R, int C>
void xs_tile(const NativeMatrix &m, int64_t col, const XsRows &x, int64_t r0, float *out) {
    const int64_t supers = m.k / SUPER;
    const uint8_t *codes[C], *heads[C];
    for (int c = 0; c < C; c++) {
        codes[c] = m.codes_of(col + c);
        heads[c] = m.scales_of(col + c);
    }
    const int8_t *xq[R];
    const float *xd[R];
    for (int r = 0; r < R; r++) {
        xq[r] = x.q.data() + (r0 + r) * m.k;
        xd[r] = x.d.data() + (r0 + r) * supers;
    }
    __m512 acc[R][C];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    const __m512i magnitudes = _mm512_load_si512(MAG64), eight = _mm512_set1_epi8(8);
    // per super-block its 8 blocks' ls_j - 32, each as 8 16-bit words (the 4 lanes of its half of a pair): a pair's
    // 32 bytes; worked out for 4 super-blocks at once, one per 128-bit quarter
    alignas(64) int16_t ls[C][4][64];
    const __m512i low_bytes = _mm512_broadcast_i32x4(_mm_setr_epi8(4, -1, 4, -1, 5, -1, 5, -1, 6, -1, 6, -1, 7, -1, 7, -1));
    const __m512i high_bytes = _mm512_broadcast_i32x4(_mm_setr_epi8(2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3));
    const __m512i low_shift = _mm512_broadcast_i32x4(_mm_setr_epi16(0, 4, 0, 4, 0, 4, 0, 4));
    const __m512i high_shift = _mm512_broadcast_i32x4(_mm_setr_epi16(0, 2, 4, 6, 8, 10, 12, 14));
    for (int64_t sb = 0; sb < supers; sb++) {
        if (sb % 4 == 0) {
            const int count = int(std::min<int64_t>(4, supers - sb));
            for (int c = 0; c < C; c++) {
                prefetch(heads[c] + AHEAD * C * (m.k / BLOCK) + 8 * sb);
                const __m512i four = _mm512_permutexvar_epi64(  // super-block sb + i's 8 header bytes in quarter i
                    _mm512_setr_epi64(0, 0, 1, 1, 2, 2, 3, 3),
                    _mm512_castsi256_si512(_mm256_maskz_loadu_epi64(__mmask8((1u << count) - 1), heads[c] + 8 * sb)));
                const __m512i low = _mm512_and_si512(_mm512_srlv_epi16(_mm512_shuffle_epi8(four, low_bytes), low_shift),
                                                     _mm512_set1_epi16(15));
                const __m512i high = _mm512_and_si512(_mm512_srlv_epi16(_mm512_shuffle_epi8(four, high_bytes), high_shift),
                                                      _mm512_set1_epi16(3));
                const __m512i scales = _mm512_sub_epi16(_mm512_or_si512(low, _mm512_slli_epi16(high, 4)), _mm512_set1_epi16(32));
                for (int i = 0; i < count; i++)
                    for (int h = 0; h < 2; h++)
                        _mm512_store_si512(ls[c][i] + 32 * h,
                                           _mm512_permutexvar_epi16(_mm512_load_si512(SPREAD_WORDS[2 * i + h].data()), scales));
            }
        }
        __m512i sum[R][C];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) sum[r][c] = _mm512_setzero_si512();
        for (int j = 0; j < 4; j++)
            for (int c = 0; c < C; c++) {
                const __m512i packed =
                    _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(codes[c] + 128 * sb + 32 * j)));
                if (j % 2 == 0) prefetch(codes[c] + AHEAD * C * (m.k / 2) + 128 * sb + 32 * j);
                const __m512i index = _mm512_mask_srli_epi16(packed, 0xFFFF0000u, packed, 4);
                const __m512i magnitude = _mm512_permutexvar_epi8(index, magnitudes);
                const __mmask64 negative = _mm512_testn_epi8_mask(index, eight);
                const __m512i scale = _mm512_broadcast_i64x4(_mm256_load_si256(reinterpret_cast<const __m256i *>(ls[c][sb % 4] + 16 * j)));
                for (int r = 0; r < R; r++) {
                    const __m512i v = _mm512_loadu_si512(xq[r] + SUPER * sb + 64 * j);
                    const __m512i signed_x = _mm512_mask_sub_epi8(v, negative, _mm512_setzero_si512(), v);
                    sum[r][c] = _mm512_dpwssd_epi32(sum[r][c], _mm512_maddubs_epi16(magnitude, signed_x), scale);
                }
            }
        for (int c = 0; c < C; c++) {
            uint16_t bits;
            std::memcpy(&bits, heads[c] + 8 * sb, 2);
            const float dw = _cvtsh_ss(bits);  // F16C: half_at's value, without mx::float16_t's software conversion
            for (int r = 0; r < R; r++) {
                // int8_tile's lanes 0-3 in 128-bit quarter 0, 4-7 in quarter 2: the two blocks' halves added
                const __m512i lanes = _mm512_add_epi32(sum[r][c], _mm512_shuffle_i64x2(sum[r][c], sum[r][c], _MM_SHUFFLE(2, 3, 0, 1)));
                acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lanes), _mm512_set1_ps(dw * xd[r][sb]), acc[r][c]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)  // quarters 0 and 2
            out[(r0 + r) * m.n + col + c] =
                lanes_sum8((f32x8)_mm512_castps512_ps256(_mm512_shuffle_f32x4(acc[r][c], acc[r][c], _MM_SHUFFLE(2, 0, 2, 0))));
}

template <int NR, int NC, int R = 1>
void xs_rows_tile(int64_t count, const NativeMatrix &m, int64_t col, int64_t columns, const XsRows &x, int64_t r0,
                  float *out) {
    if constexpr (R < NR) {
        if (count != R) return xs_rows_tile<NR, NC, R + 1>(count, m, col, columns, x, r0, out);
    }
    if (columns == NC) return xs_tile<R, NC>(m, col, x, r0, out);
    for (int64_t c = 0; c < columns; c++) xs_tile<R, 1>(m, col + c, x, r0, out);
}

template <int NR, int NC>
void xs_loop(const NativeMatrix &m, int64_t rows, float *out, bool threaded, const XsRows &prepared) {
    const int64_t tiles = (m.n + NC - 1) / NC;
#pragma omp parallel for schedule(static) num_threads(g_threads) if (threaded)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t col = t * NC, columns = std::min<int64_t>(NC, m.n - col);
        for (int64_t r0 = 0; r0 < rows; r0 += NR)
            xs_rows_tile<NR, NC>(std::min<int64_t>(NR, rows - r0), m, col, columns, prepared, r0, out);
    }
}

void xs_product(const NativeMatrix &m, const float *x, int64_t rows, float *out, bool threaded) {
    const XsRows prepared = xs_rows(x, rows, m.k);
    // one row (decode): 8 weight rows a tile (measured 5-15% faster than 2 or 4); more: 4 x 2 (2 x 4, 3 x 2 measured
    // 10-30% slower; 4 x 4 would not fit the registers: a sum and an accumulator per row and column)
    if (rows == 1) return xs_loop<1, 8>(m, rows, out, threaded, prepared);
    xs_loop<4, 2>(m, rows, out, threaded, prepared);
}

/* ---- Q6_K's int8 product in tiles of 16 weight rows (a vector lane per output column) ------------------ */

/* r[i] lane j <- r[j] lane i (a 16 x 16 matrix of 32-bit elements, rows in the registers). */
inline void transpose16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {  // u[4i + j] quarter q: rows 4i..4i + 3 of column 4q + j
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int j = 0; j < 4; j++) {
        const __m512i a = _mm512_shuffle_i32x4(u[j], u[4 + j], _MM_SHUFFLE(2, 0, 2, 0));
        const __m512i b = _mm512_shuffle_i32x4(u[j], u[4 + j], _MM_SHUFFLE(3, 1, 3, 1));
        const __m512i c = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], _MM_SHUFFLE(2, 0, 2, 0));
        const __m512i d = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], _MM_SHUFFLE(3, 1, 3, 1));
        r[j] = _mm512_shuffle_i32x4(a, c, _MM_SHUFFLE(2, 0, 2, 0));
        r[8 + j] = _mm512_shuffle_i32x4(a, c, _MM_SHUFFLE(3, 1, 3, 1));
        r[4 + j] = _mm512_shuffle_i32x4(b, d, _MM_SHUFFLE(2, 0, 2, 0));
        r[12 + j] = _mm512_shuffle_i32x4(b, d, _MM_SHUFFLE(3, 1, 3, 1));
    }
}

/* One super-block of 16 weight rows, decoded for the rows of x (q6_decode): W[t] the 64 bytes of values 4t..4t+3
   (t < 64), column c's q - 32 at bytes 4c..4c + 3; S[j] sub-block j's scale per column as two equal 16-bit words
   of a lane; start[l] per column -128 times the sum over the super-block's 8 chunks of sc times the 4 weights of
   lane l (x enters unsigned, xq + 128: the product of 4 is the same integer plus 128 times the weights' sum);
   dw the columns' d. */
struct Q6Decoded {
    alignas(64) int8_t W[64][64];
    alignas(64) int32_t S[16][16];
    alignas(64) int32_t start[8][16];
    alignas(64) float dw[16];
};

inline __m512i load512(const void *p) { return _mm512_loadu_si512(p); }

/* Columns col..col + columns - 1 (the rest as zeros), super-block sb. */
inline void q6_decode(const NativeMatrix &m, int64_t col, int columns, int64_t sb, Q6Decoded &out) {
    alignas(64) static const uint8_t zeros[192] = {};
    const uint8_t *codes[16];
    for (int c = 0; c < 16; c++) codes[c] = c < columns ? m.codes_of(col + c) + 192 * sb : zeros;
    __m512i ql[2][16], qh[16], sc[16];
    for (int c = 0; c < 16; c++) {
        ql[0][c] = load512(codes[c]);
        ql[1][c] = load512(codes[c] + 64);
        qh[c] = load512(codes[c] + 128);
        sc[c] = c < columns ? _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(m.scales_of(col + c) + 16 * sb)))
                            : _mm512_setzero_si512();
    }
    transpose16(ql[0]);  // ql[h][d] lane c: column c's ql dword d of half h
    transpose16(ql[1]);
    transpose16(qh);  // qh[8 h + e] lane c: column c's qh dword e of half h
    transpose16(sc);  // sc[j] lane c: column c's scale j
    const __m512i words = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13));
    for (int j = 0; j < 16; j++) _mm512_store_si512(out.S[j], _mm512_shuffle_epi8(sc[j], words));
    const __m512i fifteen = _mm512_set1_epi8(15), bits45 = _mm512_set1_epi8(0x30), offset = _mm512_set1_epi8(32);
    for (int h = 0; h < 2; h++)
        for (int c = 0; c < 4; c++)
            for (int e = 0; e < 8; e++) {  // values 128 h + 32 c + 4 e ..: chunk c of half h (q6_values), lane e
                const __m512i src = ql[h][e + 8 * (c % 2)];
                const __m512i low = _mm512_and_si512(c < 2 ? src : _mm512_srli_epi16(src, 4), fifteen);
                const __m512i hs = qh[8 * h + e];
                const __m512i high = c == 0 ? _mm512_slli_epi16(hs, 4) : c == 1 ? _mm512_slli_epi16(hs, 2) : c == 2 ? hs : _mm512_srli_epi16(hs, 2);
                const __m512i q = _mm512_ternarylogic_epi32(low, high, bits45, 0xF8);  // low | (high & 0x30)
                _mm512_store_si512(out.W[32 * h + 8 * c + e], _mm512_sub_epi8(q, offset));
            }
    const __m512i bias = _mm512_set1_epi8(int8_t(-128));  // 128 as vpmaddubsw's unsigned bytes
    for (int l = 0; l < 8; l++) {
        __m512i s = _mm512_setzero_si512();
        for (int ch = 0; ch < 8; ch++)
            s = _mm512_dpwssd_epi32(s, _mm512_maddubs_epi16(bias, _mm512_load_si512(out.W[8 * ch + l])),
                                    _mm512_load_si512(out.S[2 * ch + l / 4]));
        _mm512_store_si512(out.start[l], _mm512_sub_epi32(_mm512_setzero_si512(), s));
    }
    alignas(64) uint16_t d[16] = {};
    for (int c = 0; c < columns; c++) std::memcpy(&d[c], m.ds_of(col + c) + 2 * sb, 2);
    _mm512_store_ps(out.dw, _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i *>(d))));
}

/* x rounded as Q8_K (round_rows' bits) and stored unsigned, xq + 128; d per 256 values. */
struct Q6Rows {
    std::vector<uint8_t> q;  // [rows, k]
    std::vector<float> d;    // [rows, k / 256]
};

Q6Rows q6_rows(const float *x, int64_t rows, int64_t k) {
    Q6Rows out{std::vector<uint8_t>(rows * k), std::vector<float>(rows * (k / SUPER))};
    alignas(64) int8_t natural[SUPER];
    const __m512i flip = _mm512_set1_epi8(int8_t(-128));
    for (int64_t r = 0; r < rows; r++)
        for (int64_t sb = 0; sb < k / SUPER; sb++) {
            out.d[r * (k / SUPER) + sb] = round_q8_block<SUPER>(x + r * k + SUPER * sb, natural);
            for (int p = 0; p < 4; p++)
                _mm512_storeu_si512(out.q.data() + r * k + SUPER * sb + 64 * p, _mm512_xor_si512(_mm512_load_si512(natural + 64 * p), flip));
        }
    return out;
}

constexpr int Q6_ROW_BLOCK = 32;  // rows of x per pass over a tile: their float lanes (32 x 8 x 64 bytes) stay in L1

/* Rows r0..r0 + R - 1 of x, one super-block, lanes l0, l0 + 1: int8_tile's integer lanes (exact) and its fused
   multiply-add per lane into acc (per row 8 lanes x 16 columns). */
template <int R>
inline void q6_rows_step(const Q6Decoded &w, const uint8_t *const *xq, const float *scale, int l0, float (*const *acc)[16]) {
    __m512i sum[R][2];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < 2; i++) sum[r][i] = _mm512_load_si512(w.start[l0 + i]);
    for (int ch = 0; ch < 8; ch++)
        for (int i = 0; i < 2; i++) {
            const int t = 8 * ch + l0 + i;
            const __m512i weights = _mm512_load_si512(w.W[t]), s = _mm512_load_si512(w.S[2 * ch + (l0 + i) / 4]);
            for (int r = 0; r < R; r++) {
                int32_t four;
                std::memcpy(&four, xq[r] + 4 * t, 4);
                sum[r][i] = _mm512_dpwssd_epi32(sum[r][i], _mm512_maddubs_epi16(_mm512_set1_epi32(four), weights), s);
            }
        }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < 2; i++) {
            const __m512 s = _mm512_load_ps(scale + 16 * r);
            _mm512_store_ps(acc[r][l0 + i], _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r][i]), s, _mm512_load_ps(acc[r][l0 + i])));
        }
}

template <int R>
void q6_rows_tile(const Q6Decoded &w, const Q6Rows &x, int64_t k, int64_t r0, int64_t sb, float (*acc)[8][16]) {
    const uint8_t *xq[R];
    float (*accs[R])[16];
    alignas(64) float scale[R][16];  // d_w * d_x per column, as int8_tile's (one float product)
    const __m512 dw = _mm512_load_ps(w.dw);
    for (int r = 0; r < R; r++) {
        xq[r] = x.q.data() + (r0 + r) * k + SUPER * sb;
        accs[r] = acc[r];
        _mm512_store_ps(scale[r], _mm512_mul_ps(dw, _mm512_set1_ps(x.d[(r0 + r) * (k / SUPER) + sb])));
    }
    for (int l0 = 0; l0 < 8; l0 += 2) q6_rows_step<R>(w, xq, &scale[0][0], l0, accs);
}

constexpr int Q6_TILE_ROWS = 4;

template <int R = 1>
void q6_rows_of(int64_t count, const Q6Decoded &w, const Q6Rows &x, int64_t k, int64_t r0, int64_t sb, float (*acc)[8][16]) {
    if constexpr (R < Q6_TILE_ROWS) {
        if (count != R) return q6_rows_of<R + 1>(count, w, x, k, r0, sb, acc);
    }
    q6_rows_tile<R>(w, x, k, r0, sb, acc);
}

/* ---- IQ4_NL's int8 product in tiles of 16 weight rows (a vector lane per output column) ----------------- */

/* x for nl16_product: q as round_rows rounds it (natural order), per 4 values the lane start MAGIC - 128 times their
   sum (as NlRows' starts), per block d. */
struct Nl16Rows {
    std::vector<int8_t> q;       // [rows, k]
    std::vector<int32_t> start;  // [rows, k / 4]
    std::vector<float> d;        // [rows, k / 32]
};

Nl16Rows nl16_rows(const float *x, int64_t rows, int64_t k) {
    const int64_t blocks = k / BLOCK;
    Nl16Rows out{std::vector<int8_t>(rows * k), std::vector<int32_t>(rows * (k / 4)), std::vector<float>(rows * blocks)};
    const __m512i bias = _mm512_set1_epi8(int8_t(-128)), magic = _mm512_set1_epi32(MAGIC_BITS);
    for (int64_t r = 0; r < rows; r++) {
        int8_t *q = out.q.data() + r * k;
        for (int64_t b = 0; b < blocks; b++) out.d[r * blocks + b] = round_q8_block<32>(x + r * k + BLOCK * b, q + BLOCK * b);
        for (int64_t i = 0; i < k; i += 64) {
            const int64_t left = std::min<int64_t>(64, k - i);  // 64 or 32
            const __mmask64 bytes = left == 64 ? ~__mmask64(0) : (__mmask64(1) << left) - 1;
            const __m512i v = _mm512_maskz_loadu_epi8(bytes, q + i);
            _mm512_mask_storeu_epi32(out.start.data() + r * (k / 4) + i / 4, __mmask16(left == 64 ? 0xFFFF : 0xFF),
                                     _mm512_dpbusd_epi32(magic, bias, _mm512_sub_epi8(_mm512_setzero_si512(), v)));
        }
    }
    return out;
}

constexpr int NL16_GROUP = 16;      // blocks decoded at a time (W: 8 KiB)
constexpr int NL16_ROW_BLOCK = 32;  // rows of x per pass over a tile: their 16 float lanes each (32 KiB) stay in L1

/* NL16_GROUP blocks of 16 weight rows: W[b][l] lane c column c's KVALUES + 128 of values 4l..4l + 3 of block b,
   dw[b] lane c its d. */
struct Nl16Decoded {
    alignas(64) uint8_t W[NL16_GROUP][8][64];
    alignas(64) float dw[NL16_GROUP][16];
};

/* Blocks b0..b0 + count - 1 of columns col..col + columns - 1 (the rest as zeros). */
inline void nl16_decode(const NativeMatrix &m, int64_t col, int columns, int64_t b0, int count, Nl16Decoded &out) {
    const __m512i table = _mm512_load_si512(TABLE64);
    for (int s = 0; 4 * s < count; s++) {
        const int blocks = std::min(4, count - 4 * s);
        const __mmask64 bytes = blocks == 4 ? ~__mmask64(0) : (__mmask64(1) << (16 * blocks)) - 1;
        __m512i v[16];
        for (int c = 0; c < 16; c++)
            v[c] = c < columns ? _mm512_maskz_loadu_epi8(bytes, m.codes_of(col + c) + 16 * (b0 + 4 * s)) : _mm512_setzero_si512();
        transpose16(v);  // v[4 i + e] lane c: column c's code dword e of block 4 s + i
        for (int i = 0; i < blocks; i++)
            for (int e = 0; e < 4; e++) {
                const __m512i codes = v[4 * i + e];  // vpermb reads the low 6 bits: TABLE64 repeats every 16
                _mm512_store_si512(out.W[4 * s + i][e], _mm512_permutexvar_epi8(codes, table));
                _mm512_store_si512(out.W[4 * s + i][4 + e], _mm512_permutexvar_epi8(_mm512_srli_epi16(codes, 4), table));
            }
    }
    __m512i v[16];
    for (int c = 0; c < 16; c++)
        v[c] = c < columns ? _mm512_maskz_loadu_epi16(__mmask32((uint64_t(1) << count) - 1), m.scales_of(col + c) + 2 * b0)
                           : _mm512_setzero_si512();
    transpose16(v);  // v[d] lane c: column c's d of blocks 2d (low half) and 2d + 1
    for (int d = 0; 2 * d < count; d++) {
        _mm512_store_ps(out.dw[2 * d], _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v[d])));
        if (2 * d + 1 < count) _mm512_store_ps(out.dw[2 * d + 1], _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(v[d], 16))));
    }
}

/* One row of x over blocks b0..b0 + count - 1: int8_tile's integer lanes of each block and its fused multiply-add
   into the chain of the block's parity (acc[0..7] the even blocks' lanes, acc[8..15] the odd ones'). */
inline void nl16_row(const Nl16Decoded &w, const Nl16Rows &x, int64_t k, int64_t r, int64_t b0, int count, float (*acc)[16]) {
    __m512 f[16];
    for (int i = 0; i < 16; i++) f[i] = _mm512_load_ps(acc[i]);
    const int8_t *q = x.q.data() + r * k;
    const int32_t *start = x.start.data() + r * (k / 4);
    const float *xd = x.d.data() + r * (k / BLOCK);
    const __m512 magic = _mm512_set1_ps(MAGIC);
    // b0 is even (a multiple of NL16_GROUP): block b0 + b's parity is b's; the chains' registers are named at compile
    // time (the even and the odd block of each pair as two steps)
    auto step = [&](int b, auto chain) {
        const int64_t block = b0 + b;
        const __m512 s = _mm512_mul_ps(_mm512_load_ps(w.dw[b]), _mm512_set1_ps(xd[block]));  // d_w * d_x, as int8_tile's
        for (int l = 0; l < 8; l++) {
            int32_t four;
            std::memcpy(&four, q + BLOCK * block + 4 * l, 4);
            const __m512i lanes = _mm512_dpbusd_epi32(_mm512_set1_epi32(start[8 * block + l]), _mm512_load_si512(w.W[b][l]),
                                                      _mm512_set1_epi32(four));
            f[decltype(chain)::value + l] = _mm512_fmadd_ps(_mm512_sub_ps(_mm512_castsi512_ps(lanes), magic), s, f[decltype(chain)::value + l]);
        }
    };
    int b = 0;
    for (; b + 2 <= count; b += 2) {
        step(b, std::integral_constant<int, 0>());
        step(b + 1, std::integral_constant<int, 8>());
    }
    if (b < count) step(b, std::integral_constant<int, 0>());
    for (int i = 0; i < 16; i++) _mm512_store_ps(acc[i], f[i]);
}

void nl16_product(const NativeMatrix &m, const float *x, int64_t rows, float *out, bool threaded) {
    const Nl16Rows prepared = nl16_rows(x, rows, m.k);
    const int64_t tiles = (m.n + 15) / 16, blocks = m.k / BLOCK;
#pragma omp parallel for schedule(static) num_threads(g_threads) if (threaded)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t col = 16 * t;
        const int columns = int(std::min<int64_t>(16, m.n - col));
        Nl16Decoded w;
        alignas(64) float acc[NL16_ROW_BLOCK][16][16];
        for (int64_t r0 = 0; r0 < rows; r0 += NL16_ROW_BLOCK) {
            const int64_t block = std::min<int64_t>(NL16_ROW_BLOCK, rows - r0);
            std::memset(acc, 0, sizeof(float) * 16 * 16 * block);
            for (int64_t b0 = 0; b0 < blocks; b0 += NL16_GROUP) {
                const int count = int(std::min<int64_t>(NL16_GROUP, blocks - b0));
                nl16_decode(m, col, columns, b0, count, w);
                for (int64_t r = 0; r < block; r++) nl16_row(w, prepared, m.k, r0 + r, b0, count, acc[r]);
            }
            for (int64_t r = 0; r < block; r++) {  // int8_tile's even + odd, then lanes_sum8, lane by lane of the columns
                auto at = [&](int l) { return _mm512_add_ps(_mm512_load_ps(acc[r][l]), _mm512_load_ps(acc[r][8 + l])); };
                const __m512 sum = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(at(0), at(4)), _mm512_add_ps(at(2), at(6))),
                                                 _mm512_add_ps(_mm512_add_ps(at(1), at(5)), _mm512_add_ps(at(3), at(7))));
                _mm512_mask_storeu_ps(out + (r0 + r) * m.n + col, __mmask16((1u << columns) - 1), sum);
            }
        }
    }
}

/* From this many rows nl16_product (measured, 576 x 1536, 1 thread: 4 rows 1.3x slower than nl_product, 8 the same,
   32 and 128 1.1-1.2x faster). */
constexpr int64_t NL16_MIN_ROWS = 16;

/* ---- IQ4_XS's int8 product in tiles of 16 weight rows (a vector lane per output column) ----------------- */

/* x for xs16_product: round_rows' q (Q8_K), d per 256 values. */
struct Xs16Rows {
    std::vector<int8_t> q;  // [rows, k]
    std::vector<float> d;   // [rows, k / 256]
};

Xs16Rows xs16_rows(const float *x, int64_t rows, int64_t k) {
    Xs16Rows out{std::vector<int8_t>(rows * k), std::vector<float>(rows * (k / SUPER))};
    for (int64_t r = 0; r < rows; r++)
        for (int64_t sb = 0; sb < k / SUPER; sb++)
            out.d[r * (k / SUPER) + sb] = round_q8_block<SUPER>(x + r * k + SUPER * sb, out.q.data() + r * k + SUPER * sb);
    return out;
}

/* One super-block of 16 weight rows: W[t] lane c column c's |KVALUES[q]| of values 4t..4t + 3, negative[t] the bits of
   the negative ones (x's sign flipped there: |w| (x sign w) = w x, and vpmaddubsw's pairs at most 2 127^2 < 2^15),
   S[j] block j's ls_j - 32 per column in both 16-bit words of a lane; dw the columns' d. */
struct Xs16Decoded {
    alignas(64) uint8_t W[64][64];
    __mmask64 negative[64];
    alignas(64) int32_t S[8][16];
    alignas(64) float dw[16];
};


/* Columns col..col + columns - 1 (the rest as zeros), super-block sb. */
inline void xs16_decode(const NativeMatrix &m, int64_t col, int columns, int64_t sb, Xs16Decoded &out) {
    alignas(64) static const uint8_t zeros[128] = {};
    alignas(64) uint32_t head[2][16] = {};  // per column its 8 header bytes: d and scales_h, then scales_l
    __m512i v[2][16];
    for (int c = 0; c < 16; c++) {
        const uint8_t *codes = c < columns ? m.codes_of(col + c) + 128 * sb : zeros;
        v[0][c] = load512(codes);
        v[1][c] = load512(codes + 64);
        if (c < columns) {
            std::memcpy(&head[0][c], m.scales_of(col + c) + 8 * sb, 4);
            std::memcpy(&head[1][c], m.scales_of(col + c) + 8 * sb + 4, 4);
        }
    }
    transpose16(v[0]);  // v[j / 4][4 (j % 4) + e] lane c: column c's code dword e of block j
    transpose16(v[1]);
    const __m512i high_words = _mm512_load_si512(head[0]), low_nibbles = _mm512_load_si512(head[1]);
    _mm512_store_ps(out.dw, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(high_words)));
    const __m512i table = _mm512_load_si512(MAG64), eight = _mm512_set1_epi8(8);
    for (int j = 0; j < 8; j++) {  // xs_scale's ls_j - 32, in both 16-bit words of each lane
        const __m512i low = _mm512_and_si512(_mm512_srli_epi32(low_nibbles, 4 * j), _mm512_set1_epi32(15));
        const __m512i high = _mm512_and_si512(_mm512_srli_epi32(high_words, 16 + 2 * j), _mm512_set1_epi32(3));
        const __m512i ls = _mm512_sub_epi32(_mm512_or_si512(low, _mm512_slli_epi32(high, 4)), _mm512_set1_epi32(32));
        _mm512_store_si512(out.S[j], _mm512_or_si512(_mm512_and_si512(ls, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(ls, 16)));
        for (int e = 0; e < 4; e++) {
            const __m512i codes = v[j / 4][4 * (j % 4) + e];
            for (int half = 0; half < 2; half++) {  // values 4 e + 16 half ..: nibble `half` of code bytes 4 e ..
                const __m512i index = half ? _mm512_srli_epi16(codes, 4) : codes;  // vpermb reads 6 bits: MAG64 repeats
                const int t = 8 * j + 4 * half + e;
                _mm512_store_si512(out.W[t], _mm512_permutexvar_epi8(index, table));
                out.negative[t] = _mm512_testn_epi8_mask(index, eight);  // codes 0-7: KVALUES < 0
            }
        }
    }
}

constexpr int XS16_ROW_BLOCK = 32;  // rows of x per pass over a tile: their float lanes (32 x 8 x 64 bytes) stay in L1
constexpr int XS16_TILE_ROWS = 4;

/* Rows r0..r0 + R - 1 of x, one super-block, lanes l0, l0 + 1: int8_tile's integer lanes (exact) and its fused
   multiply-add per lane into acc. */
template <int R>
inline void xs16_step(const Xs16Decoded &w, const int8_t *const *xq, const float *scale, int l0, float (*const *acc)[16]) {
    __m512i sum[R][2];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < 2; i++) sum[r][i] = _mm512_setzero_si512();
    for (int j = 0; j < 8; j++)
        for (int i = 0; i < 2; i++) {
            const int t = 8 * j + l0 + i;
            const __m512i magnitude = _mm512_load_si512(w.W[t]), s = _mm512_load_si512(w.S[j]);
            const __mmask64 negative = w.negative[t];
            for (int r = 0; r < R; r++) {
                int32_t four;
                std::memcpy(&four, xq[r] + 4 * t, 4);
                const __m512i x4 = _mm512_set1_epi32(four);
                const __m512i signed_x = _mm512_mask_sub_epi8(x4, negative, _mm512_setzero_si512(), x4);
                sum[r][i] = _mm512_dpwssd_epi32(sum[r][i], _mm512_maddubs_epi16(magnitude, signed_x), s);
            }
        }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < 2; i++) {
            const __m512 s = _mm512_load_ps(scale + 16 * r);
            _mm512_store_ps(acc[r][l0 + i], _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r][i]), s, _mm512_load_ps(acc[r][l0 + i])));
        }
}

template <int R>
void xs16_tile(const Xs16Decoded &w, const Xs16Rows &x, int64_t k, int64_t r0, int64_t sb, float (*acc)[8][16]) {
    const int8_t *xq[R];
    float (*accs[R])[16];
    alignas(64) float scale[R][16];  // d_w * d_x per column, as int8_tile's (one float product)
    const __m512 dw = _mm512_load_ps(w.dw);
    for (int r = 0; r < R; r++) {
        xq[r] = x.q.data() + (r0 + r) * k + SUPER * sb;
        accs[r] = acc[r];
        _mm512_store_ps(scale[r], _mm512_mul_ps(dw, _mm512_set1_ps(x.d[(r0 + r) * (k / SUPER) + sb])));
    }
    for (int l0 = 0; l0 < 8; l0 += 2) xs16_step<R>(w, xq, &scale[0][0], l0, accs);
}

template <int R = 1>
void xs16_rows_of(int64_t count, const Xs16Decoded &w, const Xs16Rows &x, int64_t k, int64_t r0, int64_t sb, float (*acc)[8][16]) {
    if constexpr (R < XS16_TILE_ROWS) {
        if (count != R) return xs16_rows_of<R + 1>(count, w, x, k, r0, sb, acc);
    }
    xs16_tile<R>(w, x, k, r0, sb, acc);
}

/* The 8-lane tiles' product (Q6_K's and IQ4_XS's: their x prepared once, each 16-column tile decoded per super-block
   for a pass of ROW_BLOCK rows, their 8 float lanes per (row, column) summed at the end in int8_tile's lanes_sum8
   tree, lane by lane of the columns). */
template <class Rows, class Decoded, int ROW_BLOCK, int TILE_ROWS, Rows (*prepare)(const float *, int64_t, int64_t),
          void (*decode)(const NativeMatrix &, int64_t, int, int64_t, Decoded &),
          void (*rows_of)(int64_t, const Decoded &, const Rows &, int64_t, int64_t, int64_t, float (*)[8][16])>
void lane_tiles_product(const NativeMatrix &m, const float *x, int64_t rows, float *out, bool threaded) {
    const Rows prepared = prepare(x, rows, m.k);
    const int64_t tiles = (m.n + 15) / 16, supers = m.k / SUPER;
#pragma omp parallel for schedule(static) num_threads(g_threads) if (threaded)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t col = 16 * t;
        const int columns = int(std::min<int64_t>(16, m.n - col));
        Decoded w;
        alignas(64) float acc[ROW_BLOCK][8][16];
        for (int64_t b0 = 0; b0 < rows; b0 += ROW_BLOCK) {
            const int64_t block = std::min<int64_t>(ROW_BLOCK, rows - b0);
            std::memset(acc, 0, sizeof(float) * 8 * 16 * block);
            for (int64_t sb = 0; sb < supers; sb++) {
                decode(m, col, columns, sb, w);
                for (int64_t r = 0; r < block; r += TILE_ROWS)
                    rows_of(std::min<int64_t>(TILE_ROWS, block - r), w, prepared, m.k, b0 + r, sb, acc + r);
            }
            for (int64_t r = 0; r < block; r++) {  // int8_tile's lanes_sum8, lane by lane of the columns
                const float(*a)[16] = acc[r];
                auto at = [&](int l) { return _mm512_load_ps(a[l]); };
                const __m512 sum = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(at(0), at(4)), _mm512_add_ps(at(2), at(6))),
                                                 _mm512_add_ps(_mm512_add_ps(at(1), at(5)), _mm512_add_ps(at(3), at(7))));
                _mm512_mask_storeu_ps(out + (b0 + r) * m.n + col, __mmask16((1u << columns) - 1), sum);
            }
        }
    }
}

void xs16_product(const NativeMatrix &m, const float *x, int64_t rows, float *out, bool threaded) {
    lane_tiles_product<Xs16Rows, Xs16Decoded, XS16_ROW_BLOCK, XS16_TILE_ROWS, xs16_rows, xs16_decode, xs16_rows_of<>>(
        m, x, rows, out, threaded);
}

/* From this many rows xs16_product (measured, 576 x 1536, 1 thread: 4 rows 1.0-1.07x slower than xs_product, 8 rows
   1.2x faster, 32 1.45x, 128 1.4x). */
constexpr int64_t XS16_MIN_ROWS = 8;

constexpr int64_t Q6_TILED_MIN_ROWS = 3;  // 1 and 2 rows: int8_tile (2 rows measured the same, 1 faster)

void q6_product(const NativeMatrix &m, const float *x, int64_t rows, float *out, bool threaded) {
    lane_tiles_product<Q6Rows, Q6Decoded, Q6_ROW_BLOCK, Q6_TILE_ROWS, q6_rows, q6_decode, q6_rows_of<>>(m, x, rows, out,
                                                                                                    threaded);
}
#endif

/* ---- one product over the threads ---------------------------------------------------------------- */

/* Below this many multiply-adds a product runs on one thread: int8_kernels.cpp's threshold, for the same
   reason (waking the other threads for a decode step's small products costs more than they save). */
constexpr int64_t THREADED_MIN_WORK = int64_t(1) << 22;

void product(const NativeMatrix &m, const float *x, int64_t rows, float *out, bool int8) {
    const int64_t k = m.k, n = m.n;
    const bool threaded = g_threads > 1 && n > 1 && rows * n * k >= THREADED_MIN_WORK;
    if (int8) {
#ifdef PIPELINE_IQ4_TILED
        if (m.type == IQ4_NL && g_iq4_tiled && rows >= NL16_MIN_ROWS) return nl16_product(m, x, rows, out, threaded);
        if (m.type == IQ4_NL && g_iq4_tiled) return nl_product(m, x, rows, out, threaded);
        if (m.type == IQ4_XS && g_iq4_tiled && rows >= XS16_MIN_ROWS) return xs16_product(m, x, rows, out, threaded);
        if (m.type == IQ4_XS && g_iq4_tiled) return xs_product(m, x, rows, out, threaded);
        if (m.type == Q6_K && g_iq4_tiled && rows >= Q6_TILED_MIN_ROWS) return q6_product(m, x, rows, out, threaded);
#endif
        const int64_t block = m.type == IQ4_NL ? BLOCK : SUPER;
        const RoundedRows xq = round_rows(x, rows, k, block);
#pragma omp parallel for schedule(static) num_threads(g_threads) if (threaded)
        for (int64_t col = 0; col < n; col++) {
            const int8_t *qs[INT8_TILE];
            const float *ds[INT8_TILE];
            float *outs[INT8_TILE];
            for (int64_t r0 = 0; r0 < rows; r0 += INT8_TILE) {
                const int64_t count = std::min<int64_t>(INT8_TILE, rows - r0);
                for (int64_t i = 0; i < count; i++) {
                    qs[i] = xq.q.data() + (r0 + i) * k;
                    ds[i] = xq.d.data() + (r0 + i) * (k / block);
                    outs[i] = out + (r0 + i) * n;
                }
                int8_rows(count, m, col, qs, ds, outs);
            }
        }
        return;
    }
#pragma omp parallel for schedule(static) num_threads(g_threads) if (threaded)
    for (int64_t col = 0; col < n; col++) {
        const float *xs[FLOAT_TILE];
        float *outs[FLOAT_TILE];
        for (int64_t r0 = 0; r0 < rows; r0 += FLOAT_TILE) {
            const int64_t count = std::min<int64_t>(FLOAT_TILE, rows - r0);
            for (int64_t i = 0; i < count; i++) {
                xs[i] = x + (r0 + i) * k;
                outs[i] = out + (r0 + i) * n;
            }
            float_rows(count, m, col, xs, outs);
        }
    }
}

/* ---- the MLX operation ---------------------------------------------------------------------------- */

/* product() as kernels_common.h's BlockProduct calls it: w the codes, scales and (Q6_K) d of one matrix, or of one
   expert of a stack (gguf_gather_matmul: a stack's experts spread over the threads, each output row the bits of
   that row alone times its expert's matrix). */
void native_product(const std::vector<const uint8_t *> &w, int64_t n, int64_t k, const float *x, int64_t rows,
                    float *out, int type, bool int8) {
    product(NativeMatrix{w[0], w[1], w.size() > 2 ? w[2] : w[1], type, n, k}, x, rows, out, int8);
}

void check_q6_k(const mx::array &x, const mx::array &codes, const mx::array &scales, const std::optional<mx::array> &ds) {
    auto fail = [](const std::string &why) { throw std::invalid_argument("pipeline GGUF product (Q6_K): " + why); };
    const int64_t k = x.shape(-1);
    if (k % SUPER) fail("k must be a multiple of 256");
    if (codes.ndim() != 2 || (codes.dtype() != mx::uint8 && codes.dtype() != mx::uint32) ||
        codes.nbytes() != size_t(codes.shape(0) * (k / SUPER * 192)))
        fail("codes must be uint8 [n, 3 k / 4] (or uint32 [n, 3 k / 16])");
    if (scales.ndim() != 2 || scales.shape(0) != codes.shape(0) || scales.shape(1) != k / 128 || scales.dtype() != mx::int64)
        fail("scales must be int64 [n, k / 128] (the blocks' 16 int8 scales)");
    if (!ds || ds->ndim() != 2 || ds->shape(0) != codes.shape(0) || ds->shape(1) != k / 128 || ds->dtype() != mx::uint8)
        fail("d must be uint8 [n, k / 128] (the blocks' fp16 d)");
}

void check(const mx::array &x, const mx::array &codes, const mx::array &scales, const std::optional<mx::array> &ds,
           int type) {
    auto fail = [](const std::string &why) { throw std::invalid_argument("pipeline GGUF product: " + why); };
    if (type != IQ4_NL && type != IQ4_XS && type != Q6_K) fail("type must be Q6_K (14), IQ4_NL (20) or IQ4_XS (23)");
    if (x.ndim() < 1 || x.dtype() != mx::float32) fail("x must be float32 [..., k]");
    if (type == Q6_K) return check_q6_k(x, codes, scales, ds);
    const int64_t k = x.shape(-1);
    if (codes.ndim() != 2 || (codes.dtype() != mx::uint8 && codes.dtype() != mx::uint32) ||
        codes.nbytes() != size_t(codes.shape(0) * (k / 2)))
        fail("codes must be uint8 [n, k / 2] (or uint32 [n, k / 8])");
    const bool nl = type == IQ4_NL;
    if (k % (nl ? BLOCK : SUPER)) fail(nl ? "k must be a multiple of 32" : "k must be a multiple of 256");
    if (scales.ndim() != 2 || scales.shape(0) != codes.shape(0) || scales.shape(1) != k / BLOCK ||
        scales.dtype() != (nl ? mx::uint16 : mx::int8))
        fail(nl ? "scales must be uint16 (fp16 bits) [n, k / 32]" : "scales must be int8 [n, k / 32]");
}

/* The lazy product (experts given: gathered) of codes, scales and Q6_K's d, after check()'s checks. */
mx::array native_array(const mx::array &x, const mx::array &codes, const mx::array &scales, int type, bool int8,
                       const std::optional<mx::array> &ds, const std::optional<mx::array> &experts) {
    std::vector<mx::array> weights{codes, scales};
    if (type == Q6_K && ds) weights.push_back(*ds);
    return block_product<native_product>("pipeline GGUF product", type, int8, x, weights, experts,
                                         [&](const std::vector<mx::array> &w) {
                                             check(x, w[0], w[1], w.size() > 2 ? std::optional(w[2]) : std::nullopt, type);
                                         });
}

}  // namespace

void register_gguf(nb::module_ &m) {
    m.def(
        "gguf_iq4_tiled", [](bool on) { g_iq4_tiled = on; }, nb::arg("on"),
        "IQ4_NL's, IQ4_XS's and Q6_K's int8 products in column and row tiles (the default where built: AVX-512 VNNI and "
        "VBMI), or per row (False: the path the tiles must equal, for tests)");
    m.def(
        "gguf_matmul",
        [](const mx::array &x, const mx::array &codes, const mx::array &scales, int type, bool int8,
           const std::optional<mx::array> &ds) { return native_array(x, codes, scales, type, int8, ds, std::nullopt); },
        nb::arg("x"), nb::arg("codes"), nb::arg("scales"), nb::arg("type"), nb::arg("int8"), nb::arg("d") = nb::none(),
        "x [..., k] float32 @ w.T for a GGUF tensor held in its own blocks (Q6_K, IQ4_NL, IQ4_XS), lazily; d: Q6_K's fp16 d bytes; int8: x "
        "rounded per block as llama.cpp's q8 pairs (else float products)");
    m.def(
        "gguf_gather_matmul",
        [](const mx::array &x, const mx::array &codes, const mx::array &scales, int type, bool int8,
           const mx::array &experts, const std::optional<mx::array> &ds) {
            return native_array(x, codes, scales, type, int8, ds, experts);
        },
        nb::arg("x"), nb::arg("codes"), nb::arg("scales"), nb::arg("type"), nb::arg("int8"), nb::arg("experts"),
        nb::arg("d") = nb::none(),
        "x [rows, k] float32: row p times expert experts[p]'s matrix of a stack held in its own blocks "
        "(codes, scales, d [experts, n, ...]), lazily: each row the bits of gguf_matmul on that row alone");
}
