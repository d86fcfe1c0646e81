/* Products with GGUF's grid i-quants held in their own blocks (no re-quantization): IQ2_XXS, IQ2_XS, IQ2_S,
 * IQ3_XXS, IQ3_S, IQ1_S and IQ1_M, as llama.cpp computes them on CPU (ggml-cpu's vec_dot_<type>_q8_K).
 *
 * The held layout: a tensor's rows, each the file's bytes of that row verbatim, k / 256 super-blocks of
 * ggml-common.h's block_<type> (bytes per 256 values: IQ2_XXS 66, IQ2_XS 74, IQ2_S 82, IQ3_XXS 98, IQ3_S 110,
 * IQ1_S 50, IQ1_M 56), in one array of any dtype, [n, ...], whose bytes are n rows of those.
 *
 * Every type's super-block decodes, 32 values at a time (chunk<TYPE>: 4 grid entries of 8 values, or 8 of 4,
 * looked up as 64-bit words, their signs applied as byte masks), to integers: int8 values w, one odd scale ls per
 * 16 values and the fp16 d (block_d), with a value = C * d * ls * w exactly, C a power of two per type:
 *   IQ2_XXS, IQ2_XS, IQ2_S: w = grid value (8, 25 or 43) times its sign (ksigns_iq2xs or explicit sign bits),
 *                           ls = 2 s + 1 (s 4 bits, per 32 or per 16 values), C = 1/8;
 *   IQ3_XXS: w = grid value (4..62) times its sign, ls = 2 s + 1 per 32, C = 1/4;
 *   IQ3_S:   w = grid value (1..15) times its sign, ls = 2 s + 1 per 32, C = 1;
 *   IQ1_S, IQ1_M: w = 8 g + delta (g in -1, 0, 1 from iq1s_grid, delta = -1 or +1 per 32 (IQ1_S) or per 8
 *                 (IQ1_M) values: ggml's grid + IQ1S_DELTA, 1/8, in eighths), ls = 2 s + 1 (s 3 bits, per 32
 *                 (IQ1_S) or 16 (IQ1_M)), C = 1/8; IQ1_M's d is spread over its 4 scale words' top nibbles.
 * The grids and sign table: iquant_grids.h, generated from the gguf package (make_iquant_grids.py).
 *
 * Two products, each out[m][n] = sum_k x[m][k] * w[n][k]:
 *   float: each weight dequantized to float32, exactly ((C d ls) times w: fp16 d's 11 bits times at most
 *          11 more), 16 lane accumulators fma(w, x, acc) over k in order, one lane-sum tree;
 *   int8 (llama.cpp's): x rounded per 256 values as Q8_K (d8 = max|x| / 127, xq = rint(x / d8)); per
 *          super-block the integer S = sum over 16-value groups of ls times sum(w * xq), exact (|S| < 2^31),
 *          then acc = fma(float(S), d * d8, acc) over the super-blocks in order, out = C * acc (exact: a power
 *          of two). llama.cpp's generic vec_dot computes the same S (IQ1's sumi + IQ1S_DELTA * sumi1 is S / 8,
 *          exact in float32) and adds d * d8 * S unfused; its integer sums are ours.
 * Every output element is that fixed sequence on its row of x and its weight row whatever the number of
 * rows, their order or the threads (batch invariance); the AVX-512 VNNI, AVX2 and generic code give the same
 * bits (the decoding and integer sums are exact integers; the float steps the same fused multiply-adds).
 * The int8 products on AVX-512 VNNI take 16 rows of w at a time (a tile: a vector lane per output column), decode
 * them once over all of k into interleaved quads with gathers across the 16 rows (struct Tile's comment), and then
 * every row of x: vpdpbusd of the quads and 4 activations (xq + 128, the offset's share taken back exactly) per 4
 * values, times the columns' ls, per super-block the same integer S, the same fma(float(S), d * d8, acc) lane by
 * lane, the same C * acc. On AVX2 and in the generic code they decode each super-block per row of w (chunk<TYPE>)
 * and reduce it across vector lanes.
 * -DPIPELINE_IQ_GENERIC builds the generic code on any CPU; -DPIPELINE_IQ_KERNELS_ONLY leaves out the Python
 * module's part (a C++ harness can then include this file and call product() and dequantize() itself).
 */
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"
#include "mlx/types/half_types.h"

#include "iquant_grids.h"
#include "kernels_common.h"

namespace {

// ggml's type ids (GGMLQuantizationType)
enum IQType { IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18, IQ1_S = 19, IQ3_S = 21, IQ2_S = 22, IQ1_M = 29 };

constexpr int SUPER = 256;  // values per super-block and per Q8_K activation block

/* Bytes per super-block, or 0 for a type not here. */
constexpr int64_t block_bytes(int type) {
    switch (type) {
        case IQ2_XXS: return 66;
        case IQ2_XS: return 74;
        case IQ2_S: return 82;
        case IQ3_XXS: return 98;
        case IQ3_S: return 110;
        case IQ1_S: return 50;
        case IQ1_M: return 56;
        default: return 0;
    }
}

/* C of the opening comment. */
constexpr float type_factor(int type) {
    return type == IQ3_XXS ? 0.25f : type == IQ3_S ? 1.0f : 0.125f;
}

/* byte j of SIGN_MASKS.m[s]: 0xff where bit j of s is set; KSIGN_MASKS.m[i]: the same of ksigns_iq2xs[i] */
struct SignMasks {
    uint64_t m[256];
    constexpr SignMasks(bool ksigns) : m() {
        for (int i = 0; i < (ksigns ? 128 : 256); i++) {
            const int s = ksigns ? KSIGNS_IQ2XS[i] : i;
            for (int j = 0; j < 8; j++)
                if (s >> j & 1) m[i] |= uint64_t(0xff) << (8 * j);
        }
    }
};
constexpr SignMasks SIGN_MASKS(false), KSIGN_MASKS(true);

inline uint64_t delta_bytes(bool negative) { return negative ? ~uint64_t(0) : 0x0101010101010101ULL; }  // -1 / +1

inline float half_bits(uint16_t bits) {
    mx::float16_t h;
    std::memcpy(&h, &bits, 2);
    return static_cast<float>(h);
}

inline uint16_t u16_at(const uint8_t *p) {
    uint16_t v;
    std::memcpy(&v, p, 2);
    return v;
}

inline uint32_t u32_at(const uint8_t *p) {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

/* 32 int8 values: a vector on AVX2 (pipeline's -DPIPELINE_IQ_GENERIC builds take the generic code). */
#if defined(__AVX2__) && !defined(PIPELINE_IQ_GENERIC)
#define IQ_AVX2 1
typedef __m256i bytes32;
inline bytes32 from4(uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
    return _mm256_set_epi64x(int64_t(d), int64_t(c), int64_t(b), int64_t(a));
}
inline bytes32 with_signs(bytes32 g, bytes32 m) { return _mm256_sub_epi8(_mm256_xor_si256(g, m), m); }  // m: 0 or -1
inline bytes32 eighths(bytes32 g, bytes32 delta) {  // 8 g + delta, bytewise (the 16-bit shift's spill masked off)
    return _mm256_add_epi8(_mm256_and_si256(_mm256_slli_epi16(g, 3), _mm256_set1_epi8(int8_t(0xf8))), delta);
}
inline void store32(int8_t *p, bytes32 v) { _mm256_storeu_si256(reinterpret_cast<__m256i *>(p), v); }
inline bytes32 sign_bytes(const uint8_t *s) {  // SIGN_MASKS of s[0..3]: byte 8 i + j 0xff where bit j of s[i] is set
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(int32_t(u32_at(s))),
                                               _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    const __m256i bits = _mm256_set1_epi64x(int64_t(0x8040201008040201ULL));
    return _mm256_cmpeq_epi8(_mm256_and_si256(spread, bits), bits);
}
#else
struct bytes32 {
    int8_t b[32];
};
inline bytes32 from4(uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
    bytes32 v;
    const uint64_t all[4] = {a, b, c, d};
    std::memcpy(v.b, all, 32);
    return v;
}
inline bytes32 with_signs(bytes32 g, bytes32 m) {
    for (int i = 0; i < 32; i++) g.b[i] = int8_t((g.b[i] ^ m.b[i]) - m.b[i]);
    return g;
}
inline bytes32 eighths(bytes32 g, bytes32 delta) {
    for (int i = 0; i < 32; i++) g.b[i] = int8_t(8 * g.b[i] + delta.b[i]);
    return g;
}
inline void store32(int8_t *p, bytes32 v) { std::memcpy(p, v.b, 32); }
inline bytes32 sign_bytes(const uint8_t *s) {
    return from4(SIGN_MASKS.m[s[0]], SIGN_MASKS.m[s[1]], SIGN_MASKS.m[s[2]], SIGN_MASKS.m[s[3]]);
}
#endif

/* Chunk c (values 32c..32c+31) of a super-block: its int8 values w and the scales of its two 16-value halves. */
struct Chunk {
    bytes32 w;
    int ls0, ls1;
};

template <int TYPE>
inline float block_d(const uint8_t *b) {
    if constexpr (TYPE == IQ1_M) {
        uint16_t s[4];
        std::memcpy(s, b + 48, 8);
        return half_bits(uint16_t((s[0] >> 12) | ((s[1] >> 8) & 0x00f0) | ((s[2] >> 4) & 0x0f00) | (s[3] & 0xf000)));
    } else {
        return half_bits(u16_at(b));
    }
}

template <int TYPE>
inline Chunk chunk(const uint8_t *b, int c) {
    Chunk o;
    if constexpr (TYPE == IQ2_XXS) {  // per 32: 4 grid index bytes, then 4 x 7 sign bits and the 4-bit scale
        const uint8_t *q = b + 2 + 8 * c;
        const uint32_t aux = u32_at(q + 4);
        o.w = with_signs(from4(IQ2XXS_GRID[q[0]], IQ2XXS_GRID[q[1]], IQ2XXS_GRID[q[2]], IQ2XXS_GRID[q[3]]),
                         from4(KSIGN_MASKS.m[aux & 127], KSIGN_MASKS.m[(aux >> 7) & 127], KSIGN_MASKS.m[(aux >> 14) & 127],
                               KSIGN_MASKS.m[(aux >> 21) & 127]));
        o.ls0 = o.ls1 = int(2 * (aux >> 28) + 1);
    } else if constexpr (TYPE == IQ2_XS) {  // per 8 values a uint16: 9-bit grid index, 7-bit sign index
        uint16_t q[4];
        std::memcpy(q, b + 2 + 8 * c, 8);
        o.w = with_signs(from4(IQ2XS_GRID[q[0] & 511], IQ2XS_GRID[q[1] & 511], IQ2XS_GRID[q[2] & 511], IQ2XS_GRID[q[3] & 511]),
                         from4(KSIGN_MASKS.m[q[0] >> 9], KSIGN_MASKS.m[q[1] >> 9], KSIGN_MASKS.m[q[2] >> 9], KSIGN_MASKS.m[q[3] >> 9]));
        o.ls0 = 2 * (b[66 + c] & 15) + 1;
        o.ls1 = 2 * (b[66 + c] >> 4) + 1;
    } else if constexpr (TYPE == IQ2_S) {  // per 8 values: qs and 2 bits of qh, its own sign byte
        const uint8_t *qs = b + 2 + 4 * c, *signs = b + 34 + 4 * c;
        const int h = b[66 + c];
        o.w = with_signs(from4(IQ2S_GRID[qs[0] | ((h << 8) & 0x300)], IQ2S_GRID[qs[1] | ((h << 6) & 0x300)],
                               IQ2S_GRID[qs[2] | ((h << 4) & 0x300)], IQ2S_GRID[qs[3] | ((h << 2) & 0x300)]),
                         sign_bytes(signs));
        o.ls0 = 2 * (b[74 + c] & 15) + 1;
        o.ls1 = 2 * (b[74 + c] >> 4) + 1;
    } else if constexpr (TYPE == IQ3_XXS) {  // per 4 values a grid index byte; per 32 a uint32 of signs and scale
        const uint8_t *q = b + 2 + 8 * c;
        const uint32_t aux = u32_at(b + 66 + 4 * c);
        auto pair = [&](int l) { return uint64_t(IQ3XXS_GRID[q[2 * l]]) | uint64_t(IQ3XXS_GRID[q[2 * l + 1]]) << 32; };
        o.w = with_signs(from4(pair(0), pair(1), pair(2), pair(3)),
                         from4(KSIGN_MASKS.m[aux & 127], KSIGN_MASKS.m[(aux >> 7) & 127], KSIGN_MASKS.m[(aux >> 14) & 127],
                               KSIGN_MASKS.m[(aux >> 21) & 127]));
        o.ls0 = o.ls1 = int(2 * (aux >> 28) + 1);
    } else if constexpr (TYPE == IQ3_S) {  // per 4 values qs and a bit of qh; per 8 a sign byte; per 32 a nibble
        const uint8_t *q = b + 2 + 8 * c, *signs = b + 74 + 4 * c;
        const int h = b[66 + c];
        auto pair = [&](int l) {
            return uint64_t(IQ3S_GRID[q[2 * l] | ((h << (8 - 2 * l)) & 256)]) |
                   uint64_t(IQ3S_GRID[q[2 * l + 1] | ((h << (7 - 2 * l)) & 256)]) << 32;
        };
        o.w = with_signs(from4(pair(0), pair(1), pair(2), pair(3)),
                         sign_bytes(signs));
        o.ls0 = o.ls1 = 2 * ((b[106 + c / 2] >> (4 * (c % 2))) & 15) + 1;
    } else if constexpr (TYPE == IQ1_S) {  // per 8 values qs and 3 bits of a uint16 per 32 (scale, delta's sign)
        const uint8_t *q = b + 2 + 4 * c;
        const int h = u16_at(b + 34 + 2 * c);
        const uint64_t delta = delta_bytes(h & 0x8000);
        o.w = eighths(from4(IQ1S_GRID[q[0] | ((h << 8) & 0x700)], IQ1S_GRID[q[1] | ((h << 5) & 0x700)],
                            IQ1S_GRID[q[2] | ((h << 2) & 0x700)], IQ1S_GRID[q[3] | ((h >> 1) & 0x700)]),
                      from4(delta, delta, delta, delta));
        o.ls0 = o.ls1 = 2 * ((h >> 12) & 7) + 1;
    } else {  // IQ1_M: per 8 values qs and a nibble of qh (3 index bits, the delta's sign); 3-bit scales per 16
        const uint8_t *q = b + 4 * c, *qh = b + 32 + 2 * c;
        o.w = eighths(from4(IQ1S_GRID[q[0] | ((qh[0] << 8) & 0x700)], IQ1S_GRID[q[1] | ((qh[0] << 4) & 0x700)],
                            IQ1S_GRID[q[2] | ((qh[1] << 8) & 0x700)], IQ1S_GRID[q[3] | ((qh[1] << 4) & 0x700)]),
                      from4(delta_bytes(qh[0] & 0x08), delta_bytes(qh[0] & 0x80), delta_bytes(qh[1] & 0x08),
                            delta_bytes(qh[1] & 0x80)));
        const int s = u16_at(b + 48 + 2 * (c / 2)) >> (6 * (c % 2));
        o.ls0 = 2 * (s & 7) + 1;
        o.ls1 = 2 * ((s >> 3) & 7) + 1;
    }
    return o;
}

/* One held matrix: row r's super-blocks at blocks + r * row_bytes(). */
struct IQMatrix {
    const uint8_t *blocks;
    int type;
    int64_t n, k;

    int64_t row_bytes() const { return k / SUPER * block_bytes(type); }
    const uint8_t *block(int64_t r, int64_t sb) const { return blocks + r * row_bytes() + sb * block_bytes(type); }
};

/* ---- float products ------------------------------------------------------------------------------ */

constexpr int FLOAT_TILE = 8;  // rows sharing each decoded chunk

/* Chunk c's 32 weights as float32, exactly: (C d ls) * w, values 0-15 in w0, 16-31 in w1. */
template <int TYPE>
inline void dequantize_chunk(const uint8_t *b, float d, int c, v16 &w0, v16 &w1) {
    const Chunk o = chunk<TYPE>(b, c);
    const float s0 = type_factor(TYPE) * d * float(o.ls0), s1 = type_factor(TYPE) * d * float(o.ls1);  // exact
#if IQ_AVX2 && defined(__AVX512F__)
    w0 = (v16)_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(o.w))), _mm512_set1_ps(s0));
    w1 = (v16)_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(o.w, 1))), _mm512_set1_ps(s1));
#else
    alignas(32) int8_t w[32];
    store32(w, o.w);
    alignas(64) float f[32];
    for (int i = 0; i < 16; i++) {
        f[i] = s0 * float(w[i]);
        f[16 + i] = s1 * float(w[16 + i]);
    }
    w0 = load16(f);
    w1 = load16(f + 16);
#endif
}

template <int TYPE, int R>
void float_tile(const IQMatrix &m, int64_t col, const float *const *x, float *const *out) {
    v16 acc[R] = {};
    for (int64_t sb = 0; sb < m.k / SUPER; sb++) {
        const uint8_t *b = m.block(col, sb);
        const float d = block_d<TYPE>(b);
        for (int c = 0; c < 8; c++) {
            v16 w0, w1;
            dequantize_chunk<TYPE>(b, d, c, w0, w1);
            for (int r = 0; r < R; r++) {
                acc[r] = fma16(w0, load16(x[r] + SUPER * sb + 32 * c), acc[r]);
                acc[r] = fma16(w1, load16(x[r] + SUPER * sb + 32 * c + 16), acc[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) out[r][col] = lanes_sum(acc[r]);
}

template <int TYPE, int R = 1>
void float_rows(int64_t count, const IQMatrix &m, int64_t col, const float *const *x, float *const *out) {
    if constexpr (R < FLOAT_TILE) {
        if (count != R) return float_rows<TYPE, R + 1>(count, m, col, x, out);
    }
    float_tile<TYPE, R>(m, col, x, out);
}

/* ---- int8 products ------------------------------------------------------------------------------- */

typedef int32_t i32x8 __attribute__((vector_size(32)));

/* x's rows rounded as Q8_K: q [rows, k], d [rows, k / 256] (gguf_kernels.cpp's round_rows, the same bits). */
struct RoundedRows {
    std::vector<int8_t> q;
    std::vector<float> d;
};

/* The rounding of one 256-value block (round_rows' steps on 16 lanes: the same bits), q as is or plus 128 (biased). */
#if IQ_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__)
inline float round_block(const float *v, int8_t *q, bool biased) {
    return round_q8_block<SUPER>(v, q, biased ? 0x80 : 0);
}
#else
inline float round_block(const float *v, int8_t *q, bool biased) {
    float amax = 0.0f;
    for (int64_t i = 0; i < SUPER; i++) amax = std::max(amax, std::fabs(v[i]));
    const float d = amax / 127.0f;
    float inverse = d > 0.0f ? 1.0f / d : 0.0f;
    if (!(inverse < INFINITY)) inverse = 0.0f;  // tiny or not finite: the block counts as zeros
    for (int64_t i = 0; i < SUPER; i++) {
        const float f = std::nearbyint(v[i] * inverse);
        q[i] = f >= 127.0f ? 127 : f <= -127.0f ? -127 : f == f ? int8_t(f) : 0;  // NaN: 0
        if (biased) q[i] = int8_t(uint8_t(q[i]) ^ 0x80);
    }
    return d;
}
#endif

/* biased: q + 128 as unsigned bytes (the tiles' vpdpbusd takes them so) */
RoundedRows round_rows(const float *x, int64_t rows, int64_t k, bool biased = false) {
    RoundedRows out{std::vector<int8_t>(rows * k), std::vector<float>(rows * (k / SUPER))};
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < k / SUPER; c++)
            out.d[r * (k / SUPER) + c] = round_block(x + r * k + c * SUPER, out.q.data() + r * k + c * SUPER, biased);
    return out;
}

/* A chunk ready for its dot products with rows of 32 rounded activations: 8 int32 lanes, lane l the ls of its
   half times 4 products w * xq. Exact on every path: |w| <= 62, so vpmaddubsw's pair sums (|w| times xq signed
   as w) fit 16 bits and vpmaddwd's by ls (<= 31) 32 bits. */
struct Ready {
#if IQ_AVX2
    __m256i magnitude, sign, scale;
#else
    Chunk o;
#endif
};

inline Ready ready(const Chunk &o) {
#if IQ_AVX2
    return Ready{_mm256_sign_epi8(o.w, o.w), o.w, _mm256_set_m128i(_mm_set1_epi16(int16_t(o.ls1)), _mm_set1_epi16(int16_t(o.ls0)))};
#else
    return Ready{o};
#endif
}

inline i32x8 chunk_dot(const Ready &p, const int8_t *xq) {
#if IQ_AVX2
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(xq));
    return (i32x8)_mm256_madd_epi16(_mm256_maddubs_epi16(p.magnitude, _mm256_sign_epi8(x, p.sign)), p.scale);
#else
    i32x8 lanes{};
    for (int i = 0; i < 32; i++) lanes[i / 4] += int32_t(p.o.w.b[i]) * xq[i] * (i < 16 ? p.o.ls0 : p.o.ls1);
    return lanes;
#endif
}

inline int32_t lanes_total(i32x8 v) {
    return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));  // integers: any order, exact
}

constexpr int INT8_TILE = 4;  // rows sharing each decoded chunk

template <int TYPE, int R>
void int8_tile(const IQMatrix &m, int64_t col, const int8_t *const *xq, const float *const *xd, float *const *out) {
    float acc[R] = {};
    for (int64_t sb = 0; sb < m.k / SUPER; sb++) {
        const uint8_t *b = m.block(col, sb);
        i32x8 sum[R] = {};
        for (int c = 0; c < 8; c++) {
            const Ready p = ready(chunk<TYPE>(b, c));
            for (int r = 0; r < R; r++) sum[r] += chunk_dot(p, xq[r] + SUPER * sb + 32 * c);
        }
        const float d = block_d<TYPE>(b);
        for (int r = 0; r < R; r++) acc[r] = std::fma(float(lanes_total(sum[r])), d * xd[r][sb], acc[r]);
    }
    for (int r = 0; r < R; r++) out[r][col] = type_factor(TYPE) * acc[r];
}

template <int TYPE, int R = 1>
void int8_rows(int64_t count, const IQMatrix &m, int64_t col, const int8_t *const *xq, const float *const *xd,
               float *const *out) {
    if constexpr (R < INT8_TILE) {
        if (count != R) return int8_rows<TYPE, R + 1>(count, m, col, xq, xd, out);
    }
    int8_tile<TYPE, R>(m, col, xq, xd, out);
}

/* ---- int8 products of many rows: a lane per output column ------------------------------------------------- */

#if IQ_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define IQ_TILE 1

constexpr int TILE_COLS = 16;     // weight rows (output columns) decoded together: a lane each
constexpr int TILE_ROWS = 8;      // rows of x sharing each loaded weight vector

/* 16-value groups per scale: 16-value scales (IQ2_XS, IQ2_S, IQ1_M) 16 per super-block, else 8 of 32 values */
constexpr int tile_groups(int type) { return type == IQ2_XS || type == IQ2_S || type == IQ1_M ? 16 : 8; }

/* 16 weight rows (columns of out) decoded over all of k, held per super-block as
     quads[64 sb + q]: values 4q..4q+3 of column c at bytes 4c..4c+3 (int8 w, signed as decoded),
     scales[G sb + g]: ls of group g per column (int32), offsets[sb]: 128 * sum_g ls_g * (sum of group g's w),
     d[sb]: d per column;
   columns past the matrix's end are zeros (w, ls and d 0). With activations u = xq + 128 (unsigned, as vpdpbusd
   takes them), sum_g ls_g * sum(u * w) - offsets = sum_g ls_g * sum(xq * w) = S exactly (int32, |S| < 2^31). */
struct alignas(64) Lanes {  // one vector's bytes (a std::vector of __m512i would drop its alignment)
    uint8_t b[64];
};
struct Tile {
    std::vector<Lanes> quads, scales, offsets, d;
};

/* The super-block at base (column 0's; column c's rows[c] bytes on) of the 16 columns decoded at once with gathers,
   (the same integers as chunk<TYPE>): quads, ls per group and d per column as decode_tile's;
   lanes outside valid read nothing (their outputs are not stored). */
template <int TYPE>
inline void gather_superblock(const uint8_t *base, __m512i rows, __mmask16 valid, __m512i *quads,
                              int32_t (*ls)[TILE_COLS], float *d) {
    const __m512i zero = _mm512_setzero_si512(), byte = _mm512_set1_epi32(0xff), nibble = _mm512_set1_epi32(15);
    const __m512i one = _mm512_set1_epi32(1), spread = _mm512_set1_epi32(0x01010101), bits = _mm512_set1_epi32(0x08040201);
    auto at = [&](int offset) { return _mm512_mask_i32gather_epi32(zero, valid, rows, base + offset, 1); };  // 4 bytes
    auto with_nibble_signs = [&](__m512i g, __m512i signs) {  // g's byte j negated where bit j of signs (< 16) is set
        return _mm512_mask_sub_epi8(g, _mm512_test_epi8_mask(_mm512_mullo_epi32(signs, spread), bits), zero, g);
    };
    auto ksigns = [&](__m512i k) {  // ksigns_iq2xs[k] (k < 128): k, bit 7 its parity
        __m512i parity = _mm512_xor_si512(k, _mm512_srli_epi32(k, 4));
        parity = _mm512_xor_si512(parity, _mm512_srli_epi32(parity, 2));
        parity = _mm512_and_si512(_mm512_xor_si512(parity, _mm512_srli_epi32(parity, 1)), one);
        return _mm512_or_si512(k, _mm512_slli_epi32(parity, 7));
    };
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, one);
    auto grid8 = [&](__m512i index, const uint64_t *grid, __m512i *out) {  // 8 values a column: 2 quads
        const __m512i lo = _mm512_i32gather_epi64(_mm512_castsi512_si256(index), grid, 8);  // columns 0-7
        const __m512i hi = _mm512_i32gather_epi64(_mm512_extracti64x4_epi64(index, 1), grid, 8);
        out[0] = _mm512_permutex2var_epi32(lo, even, hi);  // values 0-3 of the 8
        out[1] = _mm512_permutex2var_epi32(lo, odd, hi);
    };
    auto odd_scale = [&](__m512i s) { return _mm512_add_epi32(_mm512_slli_epi32(s, 1), one); };  // 2 s + 1
    if constexpr (TYPE != IQ1_S && TYPE != IQ1_M) _mm512_store_ps(d, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(at(0))));
    if constexpr (TYPE == IQ3_S) {  // quad e: grid entry qs[e] | (bit e % 8 of qh[e / 8]) << 8, signs bits 4 (e % 2).. of signs[e / 2]
        const __m512i h0 = at(66), h1 = at(70);
        for (int t = 0; t < 16; t++) {  // quads 4 t .. 4 t + 3
            const __m512i q = at(2 + 4 * t), signs = at(74 + 2 * t);
            const __m512i h = _mm512_srli_epi32(t < 8 ? h0 : h1, 8 * (t / 2 % 4) + 4 * (t % 2));  // bit i: quad 4 t + i's
            for (int i = 0; i < 4; i++) {
                const __m512i index = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(q, 8 * i), byte),
                                                      _mm512_and_si512(_mm512_slli_epi32(h, 8 - i), _mm512_set1_epi32(256)));
                quads[4 * t + i] = with_nibble_signs(_mm512_i32gather_epi32(index, IQ3S_GRID, 4),
                                                     _mm512_and_si512(_mm512_srli_epi32(signs, 4 * i), nibble));
            }
        }
        const __m512i scales = at(106);
        for (int c = 0; c < 8; c++)
            _mm512_store_si512(ls[c], _mm512_add_epi32(_mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(scales, 4 * c), nibble), 1), one));
    } else if constexpr (TYPE == IQ2_XXS || TYPE == IQ2_XS) {
        // IQ2_XXS: per 32 values 4 grid index bytes (8 values each) and a uint32 of 4 x 7 sign bits and the scale;
        // IQ2_XS: per 8 values a uint16 of a 9-bit grid index and 7 sign bits, per 16 a scale nibble at 66
        for (int c = 0; c < 8; c++) {
            const __m512i q = at(2 + 8 * c), aux = at(6 + 8 * c);
            for (int p = 0; p < 4; p++) {  // values 8 p .. 8 p + 7 of the chunk: quads 8 c + 2 p, 8 c + 2 p + 1
                __m512i index, k;
                if constexpr (TYPE == IQ2_XXS) {
                    index = _mm512_and_si512(_mm512_srli_epi32(q, 8 * p), byte);
                    k = _mm512_and_si512(_mm512_srli_epi32(aux, 7 * p), _mm512_set1_epi32(127));
                } else {
                    const __m512i v = _mm512_and_si512(_mm512_srli_epi32(p < 2 ? q : aux, 16 * (p % 2)), _mm512_set1_epi32(0xffff));
                    index = _mm512_and_si512(v, _mm512_set1_epi32(511));
                    k = _mm512_srli_epi32(v, 9);
                }
                grid8(index, TYPE == IQ2_XXS ? IQ2XXS_GRID : IQ2XS_GRID, quads + 8 * c + 2 * p);
                const __m512i signs = ksigns(k);
                quads[8 * c + 2 * p] = with_nibble_signs(quads[8 * c + 2 * p], _mm512_and_si512(signs, nibble));
                quads[8 * c + 2 * p + 1] = with_nibble_signs(quads[8 * c + 2 * p + 1], _mm512_srli_epi32(signs, 4));
            }
            if constexpr (TYPE == IQ2_XXS) _mm512_store_si512(ls[c], odd_scale(_mm512_srli_epi32(aux, 28)));
        }
        if constexpr (TYPE == IQ2_XS)
            for (int h = 0; h < 2; h++) {
                const __m512i scales = at(66 + 4 * h);
                for (int c = 4 * h; c < 4 * h + 4; c++) {
                    const __m512i s = _mm512_srli_epi32(scales, 8 * (c % 4));
                    _mm512_store_si512(ls[2 * c], odd_scale(_mm512_and_si512(s, nibble)));
                    _mm512_store_si512(ls[2 * c + 1], odd_scale(_mm512_and_si512(_mm512_srli_epi32(s, 4), nibble)));
                }
            }
    } else if constexpr (TYPE == IQ3_XXS) {  // quad e: grid entry qs[e]; per 32 values a uint32 at 66 as IQ2_XXS's
        for (int c = 0; c < 8; c++) {
            const __m512i aux = at(66 + 4 * c);
            __m512i signs[4];
            for (int p = 0; p < 4; p++) signs[p] = ksigns(_mm512_and_si512(_mm512_srli_epi32(aux, 7 * p), _mm512_set1_epi32(127)));
            for (int t = 0; t < 2; t++) {
                const __m512i q = at(2 + 8 * c + 4 * t);
                for (int i = 0; i < 4; i++) {  // quad 8 c + 4 t + i: values 8 p + 4 (i % 2).. of the chunk, p = 2 t + i / 2
                    const __m512i index = _mm512_and_si512(_mm512_srli_epi32(q, 8 * i), byte);
                    quads[8 * c + 4 * t + i] = with_nibble_signs(
                        _mm512_i32gather_epi32(index, IQ3XXS_GRID, 4),
                        _mm512_and_si512(_mm512_srli_epi32(signs[2 * t + i / 2], 4 * (i % 2)), nibble));
                }
            }
            _mm512_store_si512(ls[c], odd_scale(_mm512_srli_epi32(aux, 28)));
        }
    } else if constexpr (TYPE == IQ2_S) {  // per 8 values: qs, 2 bits of qh (at 66), a sign byte (at 34); scales at 74
        for (int c = 0; c < 8; c++) {
            const __m512i q = at(2 + 4 * c), signs = at(34 + 4 * c);
            const __m512i h = _mm512_srli_epi32(at(66 + 4 * (c / 4)), 8 * (c % 4));
            for (int l = 0; l < 4; l++) {
                const __m512i index = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(q, 8 * l), byte),
                                                      _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h, 2 * l), _mm512_set1_epi32(3)), 8));
                __m512i *out = quads + 8 * c + 2 * l;
                grid8(index, IQ2S_GRID, out);
                const __m512i s = _mm512_srli_epi32(signs, 8 * l);
                out[0] = with_nibble_signs(out[0], _mm512_and_si512(s, nibble));
                out[1] = with_nibble_signs(out[1], _mm512_and_si512(_mm512_srli_epi32(s, 4), nibble));
            }
        }
        for (int h = 0; h < 2; h++) {
            const __m512i scales = at(74 + 4 * h);
            for (int c = 4 * h; c < 4 * h + 4; c++) {
                const __m512i s = _mm512_srli_epi32(scales, 8 * (c % 4));
                _mm512_store_si512(ls[2 * c], odd_scale(_mm512_and_si512(s, nibble)));
                _mm512_store_si512(ls[2 * c + 1], odd_scale(_mm512_and_si512(_mm512_srli_epi32(s, 4), nibble)));
            }
        }
    } else if constexpr (TYPE == IQ1_M) {  // per 8 values qs and a nibble of qh (at 32: 3 index bits, the delta's sign)
        const __m512i eighths_mask = _mm512_set1_epi8(int8_t(0xf8)), word = _mm512_set1_epi32(0xffff);
        const __m512i s01 = at(48), s23 = at(52);  // 4 uint16 of 3-bit scales, d's nibbles on top
        const __m512i w[4] = {_mm512_and_si512(s01, word), _mm512_srli_epi32(s01, 16), _mm512_and_si512(s23, word),
                              _mm512_srli_epi32(s23, 16)};
        const __m512i bits = _mm512_or_si512(
            _mm512_or_si512(_mm512_srli_epi32(w[0], 12), _mm512_and_si512(_mm512_srli_epi32(w[1], 8), _mm512_set1_epi32(0x00f0))),
            _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(w[2], 4), _mm512_set1_epi32(0x0f00)),
                            _mm512_and_si512(w[3], _mm512_set1_epi32(0xf000))));
        _mm512_store_ps(d, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(bits)));
        for (int c = 0; c < 8; c++) {
            const __m512i q = at(4 * c), h = at(32 + 2 * c);
            for (int l = 0; l < 4; l++) {
                const __m512i n = _mm512_srli_epi32(h, 4 * l);  // bits 0-2: the index's top, 3: the delta's sign
                const __m512i index = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(q, 8 * l), byte),
                                                      _mm512_slli_epi32(_mm512_and_si512(n, _mm512_set1_epi32(7)), 8));
                const __m512i delta = _mm512_mask_blend_epi32(_mm512_test_epi32_mask(n, _mm512_set1_epi32(8)),
                                                              _mm512_set1_epi8(1), _mm512_set1_epi8(-1));
                __m512i *out = quads + 8 * c + 2 * l;
                grid8(index, IQ1S_GRID, out);
                for (int j = 0; j < 2; j++)
                    out[j] = _mm512_add_epi8(_mm512_and_si512(_mm512_slli_epi16(out[j], 3), eighths_mask), delta);
            }
            const __m512i s = _mm512_srli_epi32(w[c / 2], 6 * (c % 2));
            _mm512_store_si512(ls[2 * c], odd_scale(_mm512_and_si512(s, _mm512_set1_epi32(7))));
            _mm512_store_si512(ls[2 * c + 1], odd_scale(_mm512_and_si512(_mm512_srli_epi32(s, 3), _mm512_set1_epi32(7))));
        }
    } else {  // IQ1_S: per 8 values qs and 3 bits of a uint16 qh per 32 (at 34; its bits 12-14 the scale, 15 the delta's sign)
        static_assert(TYPE == IQ1_S);
        _mm512_store_ps(d, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(at(0))));
        const __m512i mask = _mm512_set1_epi8(int8_t(0xf8));
        for (int c = 0; c < 8; c++) {
            const __m512i q = at(2 + 4 * c), h = _mm512_srli_epi32(at(32 + 2 * c), 16);  // (34 + 2 c's 4 bytes: past 50)
            const __m512i delta = _mm512_mask_blend_epi32(_mm512_test_epi32_mask(h, _mm512_set1_epi32(0x8000)),
                                                          _mm512_set1_epi8(1), _mm512_set1_epi8(-1));
            for (int l = 0; l < 4; l++) {
                const __m512i index = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(q, 8 * l), byte),
                                                      _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h, 3 * l), _mm512_set1_epi32(7)), 8));
                __m512i *out = quads + 8 * c + 2 * l;
                grid8(index, IQ1S_GRID, out);
                for (int j = 0; j < 2; j++)  // 8 g + delta bytewise (the 16-bit shift's spill masked off)
                    out[j] = _mm512_add_epi8(_mm512_and_si512(_mm512_slli_epi16(out[j], 3), mask), delta);
            }
            _mm512_store_si512(ls[c], odd_scale(_mm512_and_si512(_mm512_srli_epi32(h, 12), _mm512_set1_epi32(7))));
        }
    }
}

template <int TYPE>
void decode_tile(const IQMatrix &m, int64_t col0, int cols, Tile &t) {
    constexpr int G = tile_groups(TYPE), QPG = 64 / G;
    const int64_t sbs = m.k / SUPER;
    t.quads.resize(sbs * 64);
    t.scales.resize(sbs * G);
    t.offsets.resize(sbs);
    t.d.resize(sbs);
    const __m512i ones = _mm512_set1_epi8(1);
    const __mmask16 valid = __mmask16((1u << cols) - 1);
    const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(int32_t(m.row_bytes())));  // < 2^31: 16 rows' bytes
    for (int64_t sb = 0; sb < sbs; sb++) {
        alignas(64) int32_t ls[G][TILE_COLS] = {};
        alignas(64) float d[TILE_COLS] = {};
        __m512i *quads = reinterpret_cast<__m512i *>(t.quads.data() + 64 * sb);
        gather_superblock<TYPE>(m.block(col0, sb), rows, valid, quads, ls, d);
        __m512i offset = _mm512_setzero_si512();
        for (int g = 0; g < G; g++) {
            __m512i sum = _mm512_setzero_si512();
            for (int i = 0; i < QPG; i++) sum = _mm512_dpbusd_epi32(sum, ones, quads[QPG * g + i]);
            const __m512i scale = _mm512_load_si512(ls[g]);
            _mm512_store_si512(t.scales.data() + G * sb + g, scale);
            offset = _mm512_add_epi32(offset, _mm512_mullo_epi32(sum, scale));
        }
        _mm512_store_si512(t.offsets.data() + sb, _mm512_slli_epi32(offset, 7));
        _mm512_store_ps(t.d.data() + sb, _mm512_load_ps(d));
    }
}

/* R rows of x (u = xq + 128 as bytes, d8 per super-block) times a decoded tile: out[r][col0 + c] for the columns
   of mask, each output the chain of int8_tile (S, then fma(float(S), d * d8, acc) in order, then C * acc). */
template <int TYPE, int R>
void tile_rows(const Tile &t, int64_t sbs, const uint8_t *const *xu, const float *const *xd, float *const *out,
               int64_t col0, __mmask16 mask) {
    constexpr int G = tile_groups(TYPE), QPG = 64 / G;
    __m512 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < sbs; sb++) {
        const Lanes *quads = t.quads.data() + 64 * sb;
        __m512i s[R];
        for (int r = 0; r < R; r++) s[r] = _mm512_setzero_si512();
        for (int g = 0; g < G; g++) {
            __m512i p[R];
            for (int r = 0; r < R; r++) p[r] = _mm512_setzero_si512();
            for (int i = 0; i < QPG; i++) {
                const __m512i w = _mm512_load_si512(quads + QPG * g + i);
                const int64_t at = SUPER * sb + 4 * (QPG * g + i);
                for (int r = 0; r < R; r++)
                    p[r] = _mm512_dpbusd_epi32(p[r], _mm512_set1_epi32(int32_t(u32_at(xu[r] + at))), w);
            }
            const __m512i scale = _mm512_load_si512(t.scales.data() + G * sb + g);
            for (int r = 0; r < R; r++) s[r] = _mm512_add_epi32(s[r], _mm512_mullo_epi32(p[r], scale));
        }
        const __m512i offset = _mm512_load_si512(t.offsets.data() + sb);
        const __m512 d = _mm512_load_ps(t.d.data() + sb);
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(s[r], offset)),
                                     _mm512_mul_ps(d, _mm512_set1_ps(xd[r][sb])), acc[r]);
    }
    for (int r = 0; r < R; r++)
        _mm512_mask_storeu_ps(out[r] + col0, mask, _mm512_mul_ps(_mm512_set1_ps(type_factor(TYPE)), acc[r]));
}

template <int TYPE, int R = 1>
void tile_row_block(int64_t count, const Tile &t, int64_t sbs, const uint8_t *const *xu, const float *const *xd,
                    float *const *out, int64_t col0, __mmask16 mask) {
    if constexpr (R < TILE_ROWS) {
        if (count != R) return tile_row_block<TYPE, R + 1>(count, t, sbs, xu, xd, out, col0, mask);
    }
    tile_rows<TYPE, R>(t, sbs, xu, xd, out, col0, mask);
}

/* The int8 product of the rows of x, rounded with biased q, over 16-column tiles, in parallel
   over the tiles. */
template <int TYPE>
void tiled_product(const IQMatrix &m, const RoundedRows &xq, int64_t rows, float *out, bool threaded) {
    const int64_t k = m.k, n = m.n, sbs = k / SUPER, tiles = (n + TILE_COLS - 1) / TILE_COLS;
    const uint8_t *xu = reinterpret_cast<const uint8_t *>(xq.q.data());  // xq + 128
#pragma omp parallel for schedule(static) num_threads(g_threads) if (threaded)
    for (int64_t tile = 0; tile < tiles; tile++) {
        thread_local Tile t;
        const int64_t col0 = tile * TILE_COLS;
        const int cols = int(std::min<int64_t>(TILE_COLS, n - col0));
        decode_tile<TYPE>(m, col0, cols, t);
        const __mmask16 mask = __mmask16((1u << cols) - 1);
        const uint8_t *us[TILE_ROWS];
        const float *ds[TILE_ROWS];
        float *outs[TILE_ROWS];
        for (int64_t r0 = 0; r0 < rows; r0 += TILE_ROWS) {
            const int64_t count = std::min<int64_t>(TILE_ROWS, rows - r0);
            for (int64_t i = 0; i < count; i++) {
                us[i] = xu + (r0 + i) * k;
                ds[i] = xq.d.data() + (r0 + i) * sbs;
                outs[i] = out + (r0 + i) * n;
            }
            tile_row_block<TYPE>(count, t, sbs, us, ds, outs, col0, mask);
        }
    }
}
#endif

/* ---- one product over the threads ---------------------------------------------------------------- */

/* Below this many multiply-adds a product runs on one thread (gguf_kernels.cpp's threshold). */
constexpr int64_t THREADED_MIN_WORK = int64_t(1) << 22;

template <int TYPE>
void product_of(const IQMatrix &m, const float *x, int64_t rows, float *out, bool int8) {
    const int64_t k = m.k, n = m.n;
    const bool threaded = g_threads > 1 && n > 1 && rows * n * k >= THREADED_MIN_WORK;
    if (int8) {
#if IQ_TILE
        return tiled_product<TYPE>(m, round_rows(x, rows, k, true), rows, out, threaded && n > TILE_COLS);
#endif
        const RoundedRows xq = round_rows(x, rows, k);
#pragma omp parallel for schedule(static) num_threads(g_threads) if (threaded)
        for (int64_t col = 0; col < n; col++) {
            const int8_t *qs[INT8_TILE];
            const float *ds[INT8_TILE];
            float *outs[INT8_TILE];
            for (int64_t r0 = 0; r0 < rows; r0 += INT8_TILE) {
                const int64_t count = std::min<int64_t>(INT8_TILE, rows - r0);
                for (int64_t i = 0; i < count; i++) {
                    qs[i] = xq.q.data() + (r0 + i) * k;
                    ds[i] = xq.d.data() + (r0 + i) * (k / SUPER);
                    outs[i] = out + (r0 + i) * n;
                }
                int8_rows<TYPE>(count, m, col, qs, ds, outs);
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
            float_rows<TYPE>(count, m, col, xs, outs);
        }
    }
}

template <int TYPE>
void dequantize_of(const IQMatrix &m, float *out) {
    for (int64_t r = 0; r < m.n; r++)
        for (int64_t sb = 0; sb < m.k / SUPER; sb++) {
            const uint8_t *b = m.block(r, sb);
            for (int c = 0; c < 8; c++) {
                v16 w0, w1;
                dequantize_chunk<TYPE>(b, block_d<TYPE>(b), c, w0, w1);
                store16(out + r * m.k + sb * SUPER + 32 * c, w0);
                store16(out + r * m.k + sb * SUPER + 32 * c + 16, w1);
            }
        }
}

/* f<TYPE>(args...) for the matrix's type */
#define IQ_DISPATCH(type, f, ...)                              \
    switch (type) {                                           \
        case IQ2_XXS: return f<IQ2_XXS>(__VA_ARGS__);         \
        case IQ2_XS: return f<IQ2_XS>(__VA_ARGS__);           \
        case IQ2_S: return f<IQ2_S>(__VA_ARGS__);             \
        case IQ3_XXS: return f<IQ3_XXS>(__VA_ARGS__);         \
        case IQ3_S: return f<IQ3_S>(__VA_ARGS__);             \
        case IQ1_S: return f<IQ1_S>(__VA_ARGS__);             \
        default: return f<IQ1_M>(__VA_ARGS__);                \
    }

void product(const IQMatrix &m, const float *x, int64_t rows, float *out, bool int8) {
    IQ_DISPATCH(m.type, product_of, m, x, rows, out, int8)
}

void dequantize(const IQMatrix &m, float *out) { IQ_DISPATCH(m.type, dequantize_of, m, out) }

/* ---- the MLX operations ---------------------------------------------------------------------------- */

/* product() and dequantize() as kernels_common.h's BlockProduct and BlockDequantize call them: w[0] the row bytes
   of one matrix, or of one expert of a stack (gguf_iquant_gather_matmul). */
void iq_product(const std::vector<const uint8_t *> &w, int64_t n, int64_t k, const float *x, int64_t rows, float *out,
                int type, bool int8) {
    product(IQMatrix{w[0], type, n, k}, x, rows, out, int8);
}

void iq_dequantize(const uint8_t *blocks, int64_t n, int64_t k, float *out, int type) {
    dequantize(IQMatrix{blocks, type, n, k}, out);
}

void check(const mx::array &blocks, int type, int64_t k) {
    auto fail = [](const std::string &why) { throw std::invalid_argument("pipeline GGUF i-quant product: " + why); };
    if (!block_bytes(type))
        fail("type must be IQ2_XXS (16), IQ2_XS (17), IQ3_XXS (18), IQ1_S (19), IQ3_S (21), IQ2_S (22) or IQ1_M (29)");
    if (k % SUPER) fail("k must be a multiple of 256");
    if (blocks.ndim() < 1 || blocks.nbytes() != size_t(blocks.shape(0) * (k / SUPER * block_bytes(type))))
        fail("blocks must be [n, ...] holding n rows of k / 256 super-blocks");
}

/* The lazy product (experts given: gathered) of the blocks, after check()'s checks. */
mx::array iq_array(const mx::array &x, const mx::array &blocks, int type, bool int8, const std::optional<mx::array> &experts) {
    return block_product<iq_product>("pipeline GGUF i-quant product", type, int8, x, {blocks}, experts,
                                     [&](const std::vector<mx::array> &w) { check(w[0], type, x.shape(-1)); });
}

}  // namespace

#ifndef PIPELINE_IQ_KERNELS_ONLY  // (defined: the kernels alone, for a C++ test harness without Python)
#include <nanobind/nanobind.h>

namespace nb = nanobind;

void register_gguf_iquants(nb::module_ &m) {
    m.def(
        "gguf_iquant_matmul",
        [](const mx::array &x, const mx::array &blocks, int type, bool int8) {
            return iq_array(x, blocks, type, int8, std::nullopt);
        },
        nb::arg("x"), nb::arg("blocks"), nb::arg("type"), nb::arg("int8"),
        "x [..., k] float32 @ w.T for a GGUF grid i-quant tensor (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, "
        "IQ1_M) held as the file's blocks ([n, ...], any dtype), lazily; int8: x rounded per 256 as Q8_K "
        "(llama.cpp's vec_dot), else float products");
    m.def(
        "gguf_iquant_gather_matmul",
        [](const mx::array &x, const mx::array &blocks, int type, bool int8, const mx::array &experts) {
            return iq_array(x, blocks, type, int8, experts);
        },
        nb::arg("x"), nb::arg("blocks"), nb::arg("type"), nb::arg("int8"), nb::arg("experts"),
        "x [rows, k] float32: row p times expert experts[p]'s matrix of a stack held as the file's blocks "
        "([experts, n, row bytes]), lazily: each row the bits of gguf_iquant_matmul on that row alone");
    m.def(
        "gguf_iquant_dequantize",
        [](const mx::array &blocks, int type) {
            return block_dequantize<iq_dequantize>("pipeline GGUF i-quant dequantize: blocks must be [n, ...] of whole "
                                                   "super-blocks of a grid i-quant type",
                                                   blocks, type, block_bytes(type));
        },
        nb::arg("blocks"), nb::arg("type"),
        "float32 [n, k]: the weights of a grid i-quant tensor's blocks as the float products use them (exact)");
}
#endif
