/* Products with GGUF's low-bit K-quants and ternary types held in their own blocks (no re-quantization): Q4_K,
 * Q5_K, Q3_K, Q2_K, TQ2_0 and TQ1_0, as llama.cpp computes them on CPU (ggml-cpu's vec_dot_<type>_q8_K).
 *
 * The held layout (checkpoints/quants.py BLOCKS): a tensor's rows, each the file's bytes of that row verbatim,
 * k / 256 super-blocks of ggml-common.h's block_<type>, in one array of any dtype [n, ...] (uint8 [n, row bytes]
 * as loaded) whose bytes are n rows of those. Bytes per 256 values and what they hold:
 *   Q5_K  176: d, dmin (fp16), scales[12] (eight 6-bit scale/min pairs, get_scale_min_k4's packing), qh[32],
 *              qs[128]; sub-block j (32 values) of chunk c = j / 2: value l's low 4 bits the low (j even) or
 *              high nibble of qs[32 c + l], its fifth bit bit j of qh[l]; w = (d sc_j) q - (dmin m_j), q 0..31;
 *   Q4_K  144: d, dmin (fp16), scales[12] as Q5_K's, qs[128]: Q5_K without the fifth bit (q 0..15);
 *   Q3_K  110: hmask[32], qs[64], scales[12], d; value v = 128 h + 32 s + l (h < 2, s < 4, l < 32):
 *              q = ((qs[32 h + l] >> 2 s) & 3) - (bit 4 h + s of hmask[l] ? 0 : 4); 16 six-bit scales, one
 *              per 16 values (low 4 bits: scales[g] (g < 8) or its high nibble (scales[g - 8]), top 2 bits:
 *              scales[8 + g % 4] >> 2 (g / 4)), minus 32; w = (d (sc_g - 32)) q;
 *   Q2_K   84: scales[16] (low nibble scale, high nibble min, per 16 values), qs[64], d, dmin;
 *              q = (qs[32 h + l] >> 2 s) & 3 as Q3_K's low bits; w = (d sc_g) q - (dmin m_g);
 *   TQ2_0  66: qs[64], d; q as Q2_K's minus 1 (-1, 0, 1); w = d q;
 *   TQ1_0  54: qs[48], qh[4], d; five base-3 digits per qs byte, four per qh byte: digit n of byte b is
 *              ((uint8(b * 3^n) * 3) >> 8); values 0-159 from qs[0..32) (v = 32 n + m), 160-239 from
 *              qs[32..48) (v = 160 + 16 n + m), 240-255 from qh (v = 240 + 4 n + m); q = digit - 1; w = d q.
 * Every super-block unpacks (unpack) to 256 int8 codes q, an integer scale sc_g and min m_g per 16 values
 * (sc 1 and no mins for the ternary types) and the fp16 d, dmin.
 *
 * Two products, each out[m][n] = sum_k x[m][k] * w[n][k]:
 *   float: each weight dequantized to float32 exactly as the gguf package does it ((d sc_g) q exact, minus
 *          (dmin m_g): one rounding), 16 lane accumulators fma(w, x, acc) over k in order, one lane-sum tree;
 *   int8 (llama.cpp's): x rounded per 256 values as Q8_K (d8 = max|x| / 127, xq = rint(x / d8)); per
 *          super-block the integer S = sum_g sc_g sum_{16 values} q xq and, for the types with mins, the
 *          integer M = sum_g m_g sum_{16 values} xq (llama.cpp's bsums), exact (|S| < 2^31); then
 *          acc = fma(float(S), d * d8, acc) and, with mins, acc = fma(float(M), -(dmin * d8), acc), one scalar
 *          chain over the super-blocks in order.
 * On AVX-512 the int8 products of Q2_K, Q3_K, Q4_K and Q5_K decode each super-block in registers (int8_tile_in_registers:
 * unsigned codes, 16-bit scales through vpmaddubsw / vpdpwssd, Q3_K's offset and the mins from the bsums) rather than
 * unpacking it to memory: the same integers S and M, so the same bits, 2.2-2.5x faster on one row.
 * With AVX-512 VNNI, products of several rows (the ternary types: of any number) run on column tiles (tiled_product):
 * 16 output columns and one super-block decoded once, a vector lane per column ("interleaved quads": vector j holds
 * values 4j .. 4j + 3 of the 16 columns, unsigned), then every row of x over them with vpdpbusd (4 activation bytes
 * broadcast), the group scales per column in int32 lanes (vpmulld; Q2_K's codes held times their scale), Q3_K's and
 * the ternary types' offset and the mins from the bsums (vpdpwssd): the same integers S and M per output, then the
 * same float chain a lane per column (acc = fma(float(S), d * d8, acc), acc = fma(float(M), -(dmin * d8), acc)), so
 * the same bits. 576 x 1536, 32 rows, 1 thread: Q4_K 1004 -> 285 us, Q3_K 957 -> 311, Q2_K 935 -> 267, Q5_K
 * 1072 -> 292, TQ1_0 1423 -> 268, TQ2_0 1024 -> 263 (9 us a row; 4 rows Q4_K 126 -> 52).
 * Every output element is that fixed sequence on its row of x and its weight row whatever the number of
 * rows, their order or the threads (batch invariance); the AVX-512 (VNNI), AVX2 and generic code give the
 * same bits (the unpacking and integer sums are exact integers; the float steps the same fused multiply-adds).
 */
#include <nanobind/nanobind.h>

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

#include "kernels_common.h"

namespace nb = nanobind;

namespace {

enum KType { Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, TQ1_0 = 34, TQ2_0 = 35 };  // ggml's type ids

constexpr int SUPER = 256;  // values per super-block and per Q8_K activation block
constexpr int GROUPS = 16;  // 16-value groups per super-block

/* Bytes per super-block, or 0 for a type not here. */
constexpr int64_t block_bytes(int type) {
    switch (type) {
        case Q2_K: return 84;
        case Q3_K: return 110;
        case Q4_K: return 144;
        case Q5_K: return 176;
        case TQ1_0: return 54;
        case TQ2_0: return 66;
        default: return 0;
    }
}

constexpr bool has_mins(int type) { return type == Q2_K || type == Q4_K || type == Q5_K; }

inline float half_at(const uint8_t *p) {
    mx::float16_t h;
    std::memcpy(&h, p, 2);
    return static_cast<float>(h);
}

/* One super-block, unpacked (see the opening comment). */
struct Unpacked {
    alignas(64) int8_t q[SUPER];
    alignas(64) int32_t sc[GROUPS];
    alignas(64) int32_t mn[GROUPS];
    float d, dmin;
};

/* Q3_K / Q2_K / TQ2_0: the 2 low bits of value 128 h + 32 s + l, minus `offset`. */
inline void two_bits(const uint8_t *qs, int8_t *q, int offset = 0) {
#if defined(__AVX2__)
    const __m256i minus = _mm256_set1_epi8(char(offset));
    for (int h = 0; h < 2; h++) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(qs + 32 * h));
        for (int s = 0; s < 4; s++) {
            const __m256i bits = _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(2 * s)), _mm256_set1_epi8(3));
            _mm256_store_si256(reinterpret_cast<__m256i *>(q + 128 * h + 32 * s), _mm256_sub_epi8(bits, minus));
        }
    }
#else
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++)
            for (int l = 0; l < 32; l++) q[128 * h + 32 * s + l] = int8_t(((qs[32 * h + l] >> (2 * s)) & 3) - offset);
#endif
}

#if defined(__AVX2__)
inline __m256i load32(const uint8_t *p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)); }
inline void store32(int8_t *p, __m256i v) { _mm256_store_si256(reinterpret_cast<__m256i *>(p), v); }
/* bit `s` of every byte of v, as 0 or 1 (a 16-bit shift moves the high byte's bits into the low byte's top
   bits only: bit 0 of each byte is its own bit s) */
inline __m256i bit_of(__m256i v, int s) {
    return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(s)), _mm256_set1_epi8(1));
}
/* TQ1_0: base-3 digit `power` (3^n) of every byte b, minus 1: ((uint8(b * 3^n) * 3) >> 8) - 1, in 16-bit lanes */
inline __m256i ternary_digits(__m256i v, int power) {
    const __m256i p = _mm256_set1_epi16(int16_t(power)), three = _mm256_set1_epi16(3), low = _mm256_set1_epi16(0xFF);
    const __m256i even = _mm256_and_si256(_mm256_mullo_epi16(_mm256_and_si256(v, low), p), low);
    const __m256i odd = _mm256_and_si256(_mm256_mullo_epi16(_mm256_srli_epi16(v, 8), p), low);
    const __m256i digits = _mm256_or_si256(_mm256_srli_epi16(_mm256_mullo_epi16(even, three), 8),
                                           _mm256_slli_epi16(_mm256_srli_epi16(_mm256_mullo_epi16(odd, three), 8), 8));
    return _mm256_sub_epi8(digits, _mm256_set1_epi8(1));
}
inline __m256i two_bits_of(__m256i v, int s) {
    return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(2 * s)), _mm256_set1_epi8(3));
}
#endif

inline void unpack(int type, const uint8_t *b, Unpacked &u) {
    switch (type) {
        case Q4_K:
        case Q5_K: {
            u.d = half_at(b);
            u.dmin = half_at(b + 2);
            const uint8_t *s = b + 4;
            for (int j = 0; j < 8; j++) {  // ggml's get_scale_min_k4
                int sc, m;
                if (j < 4) {
                    sc = s[j] & 63;
                    m = s[j + 4] & 63;
                } else {
                    sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
                    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
                }
                u.sc[2 * j] = u.sc[2 * j + 1] = sc;
                u.mn[2 * j] = u.mn[2 * j + 1] = m;
            }
            if (type == Q4_K) {  // value l of sub-blocks 2c, 2c + 1: the low, high nibble of qs[32 c + l]
                const uint8_t *qs = b + 16;
#if defined(__AVX2__)
                const __m256i nibble = _mm256_set1_epi8(15);
                for (int c = 0; c < 4; c++) {
                    const __m256i low = load32(qs + 32 * c);
                    store32(u.q + 64 * c, _mm256_and_si256(low, nibble));
                    store32(u.q + 64 * c + 32, _mm256_and_si256(_mm256_srli_epi16(low, 4), nibble));
                }
#else
                for (int c = 0; c < 4; c++)
                    for (int l = 0; l < 32; l++) {
                        u.q[64 * c + l] = int8_t(qs[32 * c + l] & 15);
                        u.q[64 * c + 32 + l] = int8_t(qs[32 * c + l] >> 4);
                    }
#endif
                return;
            }
            const uint8_t *qh = b + 16, *qs = b + 48;
#if defined(__AVX2__)
            const __m256i high = load32(qh), nibble = _mm256_set1_epi8(15);
            for (int c = 0; c < 4; c++) {
                const __m256i low = load32(qs + 32 * c);
                store32(u.q + 64 * c, _mm256_or_si256(_mm256_and_si256(low, nibble),
                                                      _mm256_slli_epi16(bit_of(high, 2 * c), 4)));
                store32(u.q + 64 * c + 32, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(low, 4), nibble),
                                                           _mm256_slli_epi16(bit_of(high, 2 * c + 1), 4)));
            }
#else
            for (int c = 0; c < 4; c++)
                for (int l = 0; l < 32; l++) {
                    u.q[64 * c + l] = int8_t((qs[32 * c + l] & 15) | (((qh[l] >> (2 * c)) & 1) << 4));
                    u.q[64 * c + 32 + l] = int8_t((qs[32 * c + l] >> 4) | (((qh[l] >> (2 * c + 1)) & 1) << 4));
                }
#endif
            return;
        }
        case Q3_K: {
            const uint8_t *hmask = b, *qs = b + 32, *s = b + 96;
            u.d = half_at(b + 108);
            u.dmin = 0.0f;
#if defined(__AVX2__)
            const __m256i high = load32(hmask), four = _mm256_set1_epi8(4);
            for (int h = 0; h < 2; h++) {
                const __m256i low = load32(qs + 32 * h);
                for (int t = 0; t < 4; t++)  // q = low + 4 bit - 4
                    store32(u.q + 128 * h + 32 * t,
                            _mm256_sub_epi8(_mm256_or_si256(two_bits_of(low, t), _mm256_slli_epi16(bit_of(high, 4 * h + t), 2)),
                                            four));
            }
#else
            two_bits(qs, u.q);
            for (int h = 0; h < 2; h++)
                for (int t = 0; t < 4; t++)
                    for (int l = 0; l < 32; l++)
                        u.q[128 * h + 32 * t + l] -= int8_t((((hmask[l] >> (4 * h + t)) & 1) ^ 1) << 2);
#endif
            for (int g = 0; g < GROUPS; g++) {
                const int low = g < 8 ? s[g] & 15 : s[g - 8] >> 4, high = (s[8 + g % 4] >> (2 * (g / 4))) & 3;
                u.sc[g] = (low | (high << 4)) - 32;
                u.mn[g] = 0;
            }
            return;
        }
        case Q2_K: {
            const uint8_t *s = b, *qs = b + 16;
            u.d = half_at(b + 80);
            u.dmin = half_at(b + 82);
            two_bits(qs, u.q);
            for (int g = 0; g < GROUPS; g++) {
                u.sc[g] = s[g] & 15;
                u.mn[g] = s[g] >> 4;
            }
            return;
        }
        case TQ2_0: {
            u.d = half_at(b + 64);
            u.dmin = 0.0f;
            two_bits(b, u.q, 1);
            for (int g = 0; g < GROUPS; g++) u.sc[g] = 1, u.mn[g] = 0;
            return;
        }
        case TQ1_0: {
            static constexpr uint8_t POW3[5] = {1, 3, 9, 27, 81};
            const uint8_t *qs = b, *qh = b + 48;
            u.d = half_at(b + 52);
            u.dmin = 0.0f;
            auto digit = [](uint8_t byte, uint8_t power) {
                return int8_t(((uint16_t(uint8_t(byte * power)) * 3) >> 8) - 1);
            };
#if defined(__AVX2__)
            const __m256i first = load32(qs), second = _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i *>(qs + 32)));
            for (int n = 0; n < 5; n++) {
                store32(u.q + 32 * n, ternary_digits(first, POW3[n]));
                _mm_storeu_si128(reinterpret_cast<__m128i *>(u.q + 160 + 16 * n),
                                 _mm256_castsi256_si128(ternary_digits(second, POW3[n])));
            }
#else
            for (int n = 0; n < 5; n++)
                for (int m = 0; m < 32; m++) u.q[32 * n + m] = digit(qs[m], POW3[n]);
            for (int n = 0; n < 5; n++)
                for (int m = 0; m < 16; m++) u.q[160 + 16 * n + m] = digit(qs[32 + m], POW3[n]);
#endif
            for (int n = 0; n < 4; n++)
                for (int m = 0; m < 4; m++) u.q[240 + 4 * n + m] = digit(qh[m], POW3[n]);
            for (int g = 0; g < GROUPS; g++) u.sc[g] = 1, u.mn[g] = 0;
            return;
        }
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* The 16 scales and mins of unpack as int32 vectors, computed in registers from the block's bytes (the int8
   products read them so: the arrays' narrow stores would stall a wide load). */
inline void scale_vectors(int type, const uint8_t *b, __m512i &sc, __m512i &mn) {
    switch (type) {
        case Q4_K:
        case Q5_K: {  // ggml's get_scale_min_k4 on 32-bit words: scales 0-3 / 4-7, mins 0-3 / 4-7
            uint32_t w[3];
            std::memcpy(w, b + 4, 12);
            const uint32_t sc_lo = w[0] & 0x3f3f3f3f, m_lo = w[1] & 0x3f3f3f3f;
            const uint32_t sc_hi = (w[2] & 0x0f0f0f0f) | ((w[0] >> 2) & 0x30303030);
            const uint32_t m_hi = ((w[2] >> 4) & 0x0f0f0f0f) | ((w[1] >> 2) & 0x30303030);
            const __m128i scales = _mm_setr_epi32(int(sc_lo), int(sc_hi), 0, 0), mins = _mm_setr_epi32(int(m_lo), int(m_hi), 0, 0);
            sc = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(scales, scales));  // each for its two 16-value groups
            mn = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(mins, mins));
            return;
        }
        case Q3_K: {
            const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i *>(b + 96)), nibble = _mm_set1_epi8(15);
            const __m128i low = _mm_unpacklo_epi64(_mm_and_si128(v, nibble), _mm_and_si128(_mm_srli_epi16(v, 4), nibble));
            uint32_t x;
            std::memcpy(&x, b + 104, 4);
            const __m128i high = _mm_setr_epi32(int(x & 0x03030303), int((x >> 2) & 0x03030303), int((x >> 4) & 0x03030303),
                                                int((x >> 6) & 0x03030303));
            sc = _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_or_si128(low, _mm_slli_epi16(high, 4))), _mm512_set1_epi32(32));
            mn = _mm512_setzero_si512();
            return;
        }
        case Q2_K: {
            const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i *>(b)), nibble = _mm_set1_epi8(15);
            sc = _mm512_cvtepu8_epi32(_mm_and_si128(v, nibble));
            mn = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), nibble));
            return;
        }
        default:  // the ternary types
            sc = _mm512_set1_epi32(1);
            mn = _mm512_setzero_si512();
    }
}
#endif

/* The super-block's 256 weights in float32, as the gguf package computes them (the opening comment). */
inline void dequantize(int type, const Unpacked &u, float *w) {
    float scale[GROUPS], shift[GROUPS];
    for (int g = 0; g < GROUPS; g++) {
        scale[g] = u.d * float(u.sc[g]);  // exact (fp16 times at most 6 bits)
        shift[g] = u.dmin * float(u.mn[g]);
    }
    if (has_mins(type)) {
        for (int i = 0; i < SUPER; i++) w[i] = scale[i / 16] * float(u.q[i]) - shift[i / 16];
    } else {
        for (int i = 0; i < SUPER; i++) w[i] = scale[i / 16] * float(u.q[i]);
    }
}

/* One held matrix: row r's super-block sb at blocks + (r * k / 256 + sb) * block_bytes(type). */
struct KMatrix {
    const uint8_t *blocks;
    int type;
    int64_t n, k;

    const uint8_t *block(int64_t r, int64_t sb) const { return blocks + (r * (k / SUPER) + sb) * block_bytes(type); }
};

/* ---- float products ------------------------------------------------------------------------------ */

constexpr int FLOAT_TILE = 8;  // rows sharing each dequantized super-block

typedef int8_t i8x16 __attribute__((vector_size(16)));

/* Group g's 16 weights in float32, as dequantize computes them (the same two roundings: an exact product, then
   the min's subtraction), in a vector. */
template <bool MINS>
inline v16 group_weights(const Unpacked &u, int g, float scale, float shift) {
#if defined(__AVX512F__)
    const v16 f = (v16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i *>(u.q + 16 * g))));
#elif defined(__AVX2__)
    const __m256 halves[2] = {
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(u.q + 16 * g)))),
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(u.q + 16 * g + 8))))};
    v16 f;
    std::memcpy(&f, halves, 64);
#else
    i8x16 q;
    std::memcpy(&q, u.q + 16 * g, 16);
    const v16 f = __builtin_convertvector(q, v16);
#endif
    const v16 w = f * splat(scale);  // exact: the same value whatever the path
    if constexpr (MINS) return w - splat(shift);
    return w;
}

template <int R, bool MINS>
void float_tile_of(const KMatrix &m, int64_t col, const float *const *x, float *const *out) {
    v16 acc[R] = {};
    Unpacked u;
    for (int64_t sb = 0; sb < m.k / SUPER; sb++) {
        unpack(m.type, m.block(col, sb), u);
        for (int g = 0; g < GROUPS; g++) {
            const v16 w = group_weights<MINS>(u, g, u.d * float(u.sc[g]), u.dmin * float(u.mn[g]));
            for (int r = 0; r < R; r++) acc[r] = fma16(w, load16(x[r] + SUPER * sb + 16 * g), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r][col] = lanes_sum(acc[r]);
}

template <int R>
void float_tile(const KMatrix &m, int64_t col, const float *const *x, float *const *out) {
    if (has_mins(m.type)) return float_tile_of<R, true>(m, col, x, out);
    float_tile_of<R, false>(m, col, x, out);
}

template <int R = 1>
void float_rows(int64_t count, const KMatrix &m, int64_t col, const float *const *x, float *const *out) {
    if constexpr (R < FLOAT_TILE) {
        if (count != R) return float_rows<R + 1>(count, m, col, x, out);
    }
    float_tile<R>(m, col, x, out);
}

/* ---- int8 products ------------------------------------------------------------------------------- */

/* x's rows rounded as ggml's Q8_K: q [rows, k], d [rows, k / 256], bsums [rows, k / 16] (sums of 16 q: |sum| <=
   16 x 127, int16 as ggml's). */
struct RoundedRows {
    std::vector<int8_t> q;
    std::vector<float> d;
    std::vector<int16_t> bsums;
};

RoundedRows round_rows(const float *x, int64_t rows, int64_t k) {
    RoundedRows out{std::vector<int8_t>(rows * k), std::vector<float>(rows * (k / SUPER)),
                    std::vector<int16_t>(rows * (k / 16))};
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < k / SUPER; c++) {
            const float *v = x + r * k + c * SUPER;
            float amax = 0.0f;
            for (int i = 0; i < SUPER; i++) amax = std::max(amax, std::fabs(v[i]));
            const float d = amax / 127.0f;
            float inverse = d > 0.0f ? 1.0f / d : 0.0f;
            if (!(inverse < INFINITY)) inverse = 0.0f;  // tiny or not finite: the block counts as zeros
            out.d[r * (k / SUPER) + c] = d;
            int8_t *q = out.q.data() + r * k + c * SUPER;
            for (int i = 0; i < SUPER; i++) {
                const float f = std::nearbyint(v[i] * inverse);
                q[i] = f >= 127.0f ? 127 : f <= -127.0f ? -127 : f == f ? int8_t(f) : 0;  // NaN: 0
            }
            int16_t *sums = out.bsums.data() + r * (k / 16) + c * GROUPS;
            for (int g = 0; g < GROUPS; g++) {
                int32_t s = 0;
                for (int i = 0; i < 16; i++) s += q[16 * g + i];
                sums[g] = int16_t(s);
            }
        }
    return out;
}

/* sum_g sc[g] * sum_{i < 16} q[16 g + i] * xq[16 g + i] over a super-block: exact integers on every path
   (|q| <= 31, so vpmaddubsw's pair sums of |q| times x with q's sign cannot saturate). */
#if defined(__AVX512BW__) && defined(__AVX512F__)
inline int32_t scaled_dot(const Unpacked &u, const int8_t *xq, __m512i scale_vector) {
    __m512i total = _mm512_setzero_si512();
    for (int c = 0; c < 4; c++) {  // 64 values a step: 16 lanes of 4 products, lanes 4g'..4g'+3 group 4c + g'
        const __m512i w = _mm512_load_si512(u.q + 64 * c);
        const __m512i x = _mm512_loadu_si512(xq + 64 * c);
        const __m512i magnitude = _mm512_abs_epi8(w);
        const __m512i signed_x = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
#if defined(__AVX512VNNI__)
        const __m512i lanes = _mm512_dpbusd_epi32(_mm512_setzero_si512(), magnitude, signed_x);
#else
        const __m512i lanes = _mm512_madd_epi16(_mm512_maddubs_epi16(magnitude, signed_x), _mm512_set1_epi16(1));
#endif
        const __m512i scales = _mm512_permutexvar_epi32(
            _mm512_add_epi32(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3), _mm512_set1_epi32(4 * c)),
            scale_vector);
        total = _mm512_add_epi32(total, _mm512_mullo_epi32(lanes, scales));
    }
    return _mm512_reduce_add_epi32(total);
}
#else
inline int32_t scaled_dot(const Unpacked &u, const int8_t *xq) {
#if defined(__AVX2__)
    __m256i total = _mm256_setzero_si256();
    for (int c = 0; c < 8; c++) {  // 32 values a step: 8 lanes of 4 products, lanes 0-3 group 2c, 4-7 group 2c + 1
        const __m256i w = _mm256_load_si256(reinterpret_cast<const __m256i *>(u.q + 32 * c));
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(xq + 32 * c));
        const __m256i lanes = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)),
                                                _mm256_set1_epi16(1));
        const __m256i scales = _mm256_setr_epi32(u.sc[2 * c], u.sc[2 * c], u.sc[2 * c], u.sc[2 * c], u.sc[2 * c + 1],
                                                 u.sc[2 * c + 1], u.sc[2 * c + 1], u.sc[2 * c + 1]);
        total = _mm256_add_epi32(total, _mm256_mullo_epi32(lanes, scales));
    }
    const __m128i half = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    const __m128i quarter = _mm_add_epi32(half, _mm_shuffle_epi32(half, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(quarter, _mm_shuffle_epi32(quarter, 0xB1)));
#else
    int32_t total = 0;
    for (int g = 0; g < GROUPS; g++) {
        int32_t s = 0;
        for (int i = 0; i < 16; i++) s += int32_t(u.q[16 * g + i]) * xq[16 * g + i];
        total += u.sc[g] * s;
    }
    return total;
#endif
}
#endif

constexpr int INT8_TILE = 4;  // rows sharing each unpacked super-block

/* A one-row (decode) product's weights stream from memory (a model's matrices leave the caches between tokens): each
   super-block asks for the bytes PREFETCH_AHEAD on (the rows are consecutive: 2-3 rows of a 1536-wide matrix ahead).
   Hints only: the same bits; no cost in cache. Measured one row of 576 x 1536 over 64-256 MiB of matrices, one thread,
   interleaved with the code before (benchmarks/gguf_vec_dot.py --streamed): at load 1.6-3 no change (Q4_K 55-67 us
   both, Q5_K 66-79, Q3_K 57-62, Q2_K 48-53; in cache 45-57: bound by the decoding, the hardware prefetcher keeping up
   with the one stream of row bytes); at load 4-4.8 (other processes taking memory bandwidth) Q4_K 100-207 -> 56-152,
   Q5_K 116-233 -> 103-161, Q3_K 88-175 -> 67-121, Q2_K 100-155 -> 48-103 (3-4 runs each, noisy). 1-3 KiB ahead was
   the best of 0-16 KiB. */
constexpr int64_t PREFETCH_AHEAD = 2048;

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* Q2_K, Q3_K, Q4_K, Q5_K's int8 products with each super-block decoded in registers (as llama.cpp's AVX-512 / AVX2
   vec_dot do), the same integers S and M as scaled_dot's: codes as unsigned u = q + offset (Q3_K's offset 4, else
   0) in value order, 64 a vector; vpmaddubsw pairs u x (|.| <= 2 x 31 x 127: no saturation), vpmaddwd (vpdpwssd)
   times each pair's group scale in 16 bits, summed over the super-block in 16 int32 lanes; the offset's part
   (offset sum_g sc_g bsum_g) and the mins' M = sum_g m_g bsum_g from the int16 bsums by vpmaddwd; then one
   reduction of both. Exact integers, so S and M, and the float chain after them, are bit for bit unpack's. */
struct Decoded {
    __m512i u[4];      // values 64 c .. 64 c + 63, unsigned
    __m512i scale[4];  // int16 lane i of vector c: the scale of group 4 c + i / 8 (the pair u[2i], u[2i + 1] of u[c])
    __m256i shift;     // int16 per group: offset sc_g (subtracted with the bsums), 0 without an offset
    __m256i mins;      // int16 per group: m_g
    float d, dmin;
};

inline __m256i load256(const uint8_t *p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)); }

/* bit `bit_low` (values of the low 256 bits) or `bit_high` (the high 256) of every byte of v, as a byte mask */
inline __mmask64 bits_of(__m512i v, int bit_low, int bit_high) {
    const __m512i select = _mm512_inserti64x4(_mm512_set1_epi8(char(1 << bit_low)), _mm256_set1_epi8(char(1 << bit_high)), 1);
    return _mm512_test_epi8_mask(v, select);
}

/* Q2_K / Q3_K's 2 low bits of values 64 c .. 64 c + 63 (128 h + 32 s + l, h = c / 2, s = 2 (c % 2) and the next):
   (qs[32 h + l] >> 2 s) & 3 */
inline __m512i two_low_bits(const uint8_t *qs, int c) {
    const __m512i v = _mm512_broadcast_i64x4(load256(qs + 32 * (c / 2)));
    const int s = 2 * (c % 2);
    const __m512i shifts = _mm512_inserti64x4(_mm512_set1_epi16(int16_t(2 * s)), _mm256_set1_epi16(int16_t(2 * s + 2)), 1);
    return _mm512_and_si512(_mm512_srlv_epi16(v, shifts), _mm512_set1_epi8(3));
}

inline void decode(int type, const uint8_t *b, Decoded &out) {
    __m512i sc, mn;
    scale_vectors(type, b, sc, mn);
    static const int16_t GROUP_OF_PAIR[32] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                              2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3};
    const __m512i scales = _mm512_castsi256_si512(_mm512_cvtepi32_epi16(sc)), pair_group = _mm512_loadu_si512(GROUP_OF_PAIR);
    for (int c = 0; c < 4; c++)
        out.scale[c] = _mm512_permutexvar_epi16(_mm512_add_epi16(pair_group, _mm512_set1_epi16(int16_t(4 * c))), scales);
    out.mins = _mm512_cvtepi32_epi16(mn);
    out.shift = _mm256_setzero_si256();
    switch (type) {
        case Q4_K:
        case Q5_K: {
            out.d = half_at(b);
            out.dmin = half_at(b + 2);
            const uint8_t *qs = b + (type == Q4_K ? 16 : 48);
            const __m512i nibble = _mm512_set1_epi8(15);
            for (int half = 0; half < 2; half++) {  // qs[64 half .. +64): chunks 2 half and 2 half + 1
                const __m512i v = _mm512_loadu_si512(qs + 64 * half);
                const __m512i low = _mm512_and_si512(v, nibble), high = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
                out.u[2 * half] = _mm512_shuffle_i64x2(low, high, 0x44);      // sub-blocks 4 half, 4 half + 1
                out.u[2 * half + 1] = _mm512_shuffle_i64x2(low, high, 0xEE);  // sub-blocks 4 half + 2, 4 half + 3
            }
            if (type == Q5_K) {  // value l of sub-block j: fifth bit bit j of qh[l]
                const __m512i qh = _mm512_broadcast_i64x4(load256(b + 16));
                for (int c = 0; c < 4; c++)
                    out.u[c] = _mm512_mask_add_epi8(out.u[c], bits_of(qh, 2 * c, 2 * c + 1), out.u[c], _mm512_set1_epi8(16));
            }
            return;
        }
        case Q3_K: {
            out.d = half_at(b + 108);
            out.dmin = 0.0f;
            const __m512i hmask = _mm512_broadcast_i64x4(load256(b));
            for (int c = 0; c < 4; c++) {  // u = low bits + 4 (the hmask bit): q + 4
                const int h = c / 2, s = 2 * (c % 2);
                out.u[c] = _mm512_mask_add_epi8(two_low_bits(b + 32, c), bits_of(hmask, 4 * h + s, 4 * h + s + 1),
                                                two_low_bits(b + 32, c), _mm512_set1_epi8(4));
            }
            out.shift = _mm256_slli_epi16(_mm512_cvtepi32_epi16(sc), 2);  // 4 sc_g
            return;
        }
        default: {  // Q2_K
            out.d = half_at(b + 80);
            out.dmin = half_at(b + 82);
            for (int c = 0; c < 4; c++) out.u[c] = two_low_bits(b + 16, c);
            return;
        }
    }
}

/* (S, M) of one row's 256 rounded values xq and their int16 bsums against a decoded super-block */
inline void sums_in_registers(const Decoded &w, const int8_t *xq, const int16_t *bsums, int32_t &s, int32_t &m) {
    __m512i total = _mm512_setzero_si512();
    for (int c = 0; c < 4; c++) {
        const __m512i pairs = _mm512_maddubs_epi16(w.u[c], _mm512_loadu_si512(xq + 64 * c));
#if defined(__AVX512VNNI__)
        total = _mm512_dpwssd_epi32(total, pairs, w.scale[c]);
#else
        total = _mm512_add_epi32(total, _mm512_madd_epi16(pairs, w.scale[c]));
#endif
    }
    const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(bsums));
    const __m256i scaled = _mm256_sub_epi32(_mm256_add_epi32(_mm512_castsi512_si256(total), _mm512_extracti64x4_epi64(total, 1)),
                                            _mm256_madd_epi16(w.shift, sums));
    const __m256i both = _mm256_hadd_epi32(scaled, _mm256_madd_epi16(w.mins, sums));  // s s m m | s s m m
    const __m128i four = _mm_add_epi32(_mm256_castsi256_si128(both), _mm256_extracti128_si256(both, 1));  // s s m m
    const __m128i two = _mm_hadd_epi32(four, four);  // s m s m
    s = _mm_cvtsi128_si32(two);
    m = _mm_extract_epi32(two, 1);
}

template <int R>
void int8_tile_in_registers(const KMatrix &m, int64_t col, const int8_t *const *xq, const float *const *xd,
                            const int16_t *const *bsums, float *const *out) {
    float acc[R] = {};
    Decoded w;
    const bool mins = has_mins(m.type);
    const int64_t bytes = block_bytes(m.type);
    for (int64_t sb = 0; sb < m.k / SUPER; sb++) {
        prefetch_span(m.block(col, sb) + PREFETCH_AHEAD, bytes);
        decode(m.type, m.block(col, sb), w);
        for (int r = 0; r < R; r++) {
            int32_t s, total;
            sums_in_registers(w, xq[r] + SUPER * sb, bsums[r] + GROUPS * sb, s, total);
            acc[r] = std::fma(float(s), w.d * xd[r][sb], acc[r]);
            if (mins) acc[r] = std::fma(float(total), -(w.dmin * xd[r][sb]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r][col] = acc[r];
}
#endif

template <int R>
void int8_tile(const KMatrix &m, int64_t col, const int8_t *const *xq, const float *const *xd,
               const int16_t *const *bsums, float *const *out) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (m.type == Q2_K || m.type == Q3_K || m.type == Q4_K || m.type == Q5_K)
        return int8_tile_in_registers<R>(m, col, xq, xd, bsums, out);
#endif
    float acc[R] = {};
    Unpacked u;
    const bool mins = has_mins(m.type);
    for (int64_t sb = 0; sb < m.k / SUPER; sb++) {
        prefetch_span(m.block(col, sb) + PREFETCH_AHEAD, block_bytes(m.type));
        unpack(m.type, m.block(col, sb), u);
#if defined(__AVX512F__) && defined(__AVX512BW__)
        __m512i scale_vector, min_vector;
        scale_vectors(m.type, m.block(col, sb), scale_vector, min_vector);
#endif
        for (int r = 0; r < R; r++) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
            const int32_t s = scaled_dot(u, xq[r] + SUPER * sb, scale_vector);
#else
            const int32_t s = scaled_dot(u, xq[r] + SUPER * sb);
#endif
            acc[r] = std::fma(float(s), u.d * xd[r][sb], acc[r]);
            if (mins) {
                const int16_t *sums = bsums[r] + GROUPS * sb;
#if defined(__AVX512F__) && defined(__AVX512BW__)
                const __m512i wide = _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(sums)));
                const int32_t total = _mm512_reduce_add_epi32(_mm512_mullo_epi32(min_vector, wide));
#else
                int32_t total = 0;
                for (int g = 0; g < GROUPS; g++) total += u.mn[g] * sums[g];
#endif
                acc[r] = std::fma(float(total), -(u.dmin * xd[r][sb]), acc[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) out[r][col] = acc[r];
}

template <int R = 1>
void int8_rows(int64_t count, const KMatrix &m, int64_t col, const int8_t *const *xq, const float *const *xd,
               const int16_t *const *bsums, float *const *out) {
    if constexpr (R < INT8_TILE) {
        if (count != R) return int8_rows<R + 1>(count, m, col, xq, xd, bsums, out);
    }
    int8_tile<R>(m, col, xq, xd, bsums, out);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* ---- int8 products of many rows: a lane per output column ----------------------------------------------------

   16 output columns (weight rows) and one super-block are decoded once into a ColumnTile, then every row of x runs
   over it: lane c of every vector is column c. The codes as unsigned u (q plus an offset: Q3_K 4, the ternary types
   1, else 0) in "interleaved quads": vector j holds values 4j .. 4j + 3 of the 16 columns (column c's at bytes
   4c .. 4c + 3), so vpdpbusd with 4 bytes of the row broadcast gives lane c column c's 4-product sum. Per scale unit
   (16 values, Q4_K / Q5_K 32) those sums times the unit's scale (vpmulld, int32 lanes) make S; Q2_K's scales (4
   bits) times its codes (2 bits) fit a byte, so its codes are held multiplied by their group's scale and S is a
   plain vpdpbusd sum. The offset's part (offset sum_g sc_g bsum_g) and the mins' M = sum_g m_g bsum_g come from the
   row's int16 bsums by vpdpwssd against per-column int16 pairs (-offset sc_2i, -offset sc_2i+1) / (m_2i, m_2i+1).
   All exact integers: the S and M of the one-row path. Then per row the float chain of the one-row path, a lane per
   column: acc = fma(float(S), d * d8, acc), acc = fma(float(M), -(dmin * d8), acc) (vcvtdq2ps, vmulps, vfmadd round
   as their scalar forms): the same bits. The block bytes are read with gathers (one 32-bit word of each of the 16
   columns' super-blocks a gather), decoded in those words as the one-row path decodes the bytes. */

constexpr int COLUMNS = 16;        // output columns a tile
constexpr int QUADS = SUPER / 4;   // quad vectors a super-block
/* From this many rows a product runs on the column tiles: the ternary types from one (one row of 576 x 1536, in cache,
   1 thread, us: TQ1_0 140 -> 56, TQ2_0 89 -> 33; read from memory (--streamed) 150-172 -> 75-147, 97-99 -> 56-79), the
   others from two (one row: Q4_K 45 -> 30 in cache but 65-70 -> 83-161 from memory, where the one-row path's prefetch
   keeps up and 16 columns' streams do not; Q2_K 41 -> 44; two rows: Q2_K 80 -> 50, Q4_K 89 -> 38, Q5_K 110 -> 51). */
constexpr int many_rows(int type) { return type == TQ1_0 || type == TQ2_0 ? 1 : 2; }
constexpr int ROW_STEP = 8;        // rows sharing each loaded quad vector (accumulators in registers)

struct ColumnTile {
    __m512i u[QUADS];           // quad j, lane c: column c's u of values 4j .. 4j + 3 (Q2_K: times the group's scale)
    __m512i scale[GROUPS];      // lane c: column c's scale of 16-value group g (Q4_K / Q5_K: of 32-value sub-block g < 8)
    __m512i pairs[GROUPS / 2];  // lane c: int16 (m_2i, m_2i+1), or the offset's (-o sc_2i, -o sc_2i+1)
    __m512 d, dmin;
};

/* the 32-bit word at byte `offset` of each column's super-block (lane c at b + index[c]) */
inline __m512i words(const uint8_t *b, __m512i index, int offset) {
    return _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), __mmask16(0xFFFF), index, b + offset, 1);
}
inline __m512i shr32(__m512i v, int n) { return _mm512_srl_epi32(v, _mm_cvtsi32_si128(n)); }
inline __m512i bytes_of(__m512i v, uint32_t mask) { return _mm512_and_si512(v, _mm512_set1_epi32(int(mask))); }
inline __m512 low_halves(__m512i w) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(w)); }  // fp16 in bits 0-15
inline __m512 high_halves(__m512i w) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(w, 16))); }
inline __m512i int16_pair(__m512i low, __m512i high) {
    return _mm512_or_si512(bytes_of(low, 0xFFFF), _mm512_slli_epi32(high, 16));
}

/* TQ1_0's base-3 digit `power` (3^n) of every byte: ((uint8(b * 3^n) * 3) >> 8), in 16-bit lanes (0, 1 or 2: q + 1) */
inline __m512i ternary_digits512(__m512i v, int power) {
    const __m512i p = _mm512_set1_epi16(int16_t(power)), three = _mm512_set1_epi16(3), low = _mm512_set1_epi16(0xFF);
    const __m512i even = _mm512_and_si512(_mm512_mullo_epi16(_mm512_and_si512(v, low), p), low);
    const __m512i odd = _mm512_and_si512(_mm512_mullo_epi16(_mm512_srli_epi16(v, 8), p), low);
    return _mm512_or_si512(_mm512_srli_epi16(_mm512_mullo_epi16(even, three), 8),
                           _mm512_slli_epi16(_mm512_srli_epi16(_mm512_mullo_epi16(odd, three), 8), 8));
}

/* The tile of the 16 columns' super-blocks at b + index[c] (the opening comment's layouts, as unpack reads them). */
template <int T>
__attribute__((noinline)) void decode_tile(const uint8_t *b, __m512i index, ColumnTile &t) {
    if constexpr (T == Q4_K || T == Q5_K) {
        const __m512i dd = words(b, index, 0), w0 = words(b, index, 4), w1 = words(b, index, 8), w2 = words(b, index, 12);
        t.d = low_halves(dd);
        t.dmin = high_halves(dd);
        // get_scale_min_k4 on 32-bit words (scale_vectors): byte j of sc[0] / sc[1] the scale of sub-block j / 4 + j
        const __m512i sc[2] = {bytes_of(w0, 0x3f3f3f3f), _mm512_or_si512(bytes_of(w2, 0x0f0f0f0f), bytes_of(shr32(w0, 2), 0x30303030))};
        const __m512i mn[2] = {bytes_of(w1, 0x3f3f3f3f),
                               _mm512_or_si512(bytes_of(shr32(w2, 4), 0x0f0f0f0f), bytes_of(shr32(w1, 2), 0x30303030))};
        for (int j = 0; j < 8; j++) {
            t.scale[j] = bytes_of(shr32(sc[j / 4], 8 * (j % 4)), 0xFF);
            const __m512i m = bytes_of(shr32(mn[j / 4], 8 * (j % 4)), 0xFF);
            t.pairs[j] = int16_pair(m, m);  // groups 2j, 2j + 1: sub-block j
        }
        const int qs = T == Q4_K ? 16 : 48;
        for (int w = 0; w < 32; w++) {  // qs word w: values 64 (w / 8) + 4 (w % 8) (low nibbles) and 32 on (high)
            const __m512i v = words(b, index, qs + 4 * w);
            t.u[16 * (w / 8) + w % 8] = bytes_of(v, 0x0f0f0f0f);
            t.u[16 * (w / 8) + 8 + w % 8] = bytes_of(_mm512_srli_epi32(v, 4), 0x0f0f0f0f);
        }
        if constexpr (T == Q5_K) {
            for (int w = 0; w < 8; w++) {  // qh word w: bit j of qh[l] (l = 4 w ..) the fifth bit of value 32 j + l
                const __m512i h = words(b, index, 16 + 4 * w);
                for (int j = 0; j < 8; j++)
                    t.u[8 * j + w] = _mm512_or_si512(t.u[8 * j + w], _mm512_slli_epi32(bytes_of(shr32(h, j), 0x01010101), 4));
            }
        }
    } else if constexpr (T == Q3_K) {
        t.d = high_halves(words(b, index, 106));
        t.dmin = _mm512_setzero_ps();
        const __m512i w0 = words(b, index, 96), w1 = words(b, index, 100), w2 = words(b, index, 104);
        const __m512i low[4] = {bytes_of(w0, 0x0f0f0f0f), bytes_of(w1, 0x0f0f0f0f), bytes_of(_mm512_srli_epi32(w0, 4), 0x0f0f0f0f),
                                bytes_of(_mm512_srli_epi32(w1, 4), 0x0f0f0f0f)};
        for (int q = 0; q < 4; q++) {  // byte i of `six`: the 6-bit scale of group 4 q + i
            const __m512i six = _mm512_or_si512(low[q], _mm512_slli_epi32(bytes_of(shr32(w2, 2 * q), 0x03030303), 4));
            for (int i = 0; i < 4; i++)
                t.scale[4 * q + i] = _mm512_sub_epi32(bytes_of(shr32(six, 8 * i), 0xFF), _mm512_set1_epi32(32));
        }
        for (int i = 0; i < 8; i++)  // the offset 4: -4 sc_g
            t.pairs[i] = int16_pair(_mm512_slli_epi32(_mm512_sub_epi32(_mm512_setzero_si512(), t.scale[2 * i]), 2),
                                    _mm512_slli_epi32(_mm512_sub_epi32(_mm512_setzero_si512(), t.scale[2 * i + 1]), 2));
        __m512i hmask[8];
        for (int w = 0; w < 8; w++) hmask[w] = words(b, index, 4 * w);
        for (int w = 0; w < 16; w++) {  // qs word w (h = w / 8, l = 4 (w % 8) ..): value 128 h + 32 s + l
            const __m512i v = words(b, index, 32 + 4 * w);
            const int h = w / 8;
            for (int s = 0; s < 4; s++)
                t.u[32 * h + 8 * s + w % 8] = _mm512_or_si512(
                    bytes_of(shr32(v, 2 * s), 0x03030303), _mm512_slli_epi32(bytes_of(shr32(hmask[w % 8], 4 * h + s), 0x01010101), 2));
        }
    } else if constexpr (T == Q2_K) {
        const __m512i dd = words(b, index, 80);
        t.d = low_halves(dd);
        t.dmin = high_halves(dd);
        __m512i scale_bytes[GROUPS], mins[GROUPS];
        for (int w = 0; w < 4; w++) {
            const __m512i v = words(b, index, 4 * w);
            for (int i = 0; i < 4; i++) {
                const __m512i byte = bytes_of(shr32(v, 8 * i), 0xFF);
                t.scale[4 * w + i] = bytes_of(byte, 15);
                mins[4 * w + i] = _mm512_srli_epi32(byte, 4);
                scale_bytes[4 * w + i] = _mm512_mullo_epi32(t.scale[4 * w + i], _mm512_set1_epi32(0x01010101));
            }
        }
        for (int i = 0; i < 8; i++) t.pairs[i] = int16_pair(mins[2 * i], mins[2 * i + 1]);
        for (int w = 0; w < 16; w++) {  // as Q3_K's low bits; each code times its group's scale (at most 3 x 15)
            const __m512i v = words(b, index, 16 + 4 * w);
            const int h = w / 8;
            for (int s = 0; s < 4; s++) {
                const int quad = 32 * h + 8 * s + w % 8;
                const __m512i sc = scale_bytes[quad / 4];
                const __m512i one = _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(v, _mm512_set1_epi8(char(1 << (2 * s)))), sc);
                t.u[quad] = _mm512_mask_add_epi8(one, _mm512_test_epi8_mask(v, _mm512_set1_epi8(char(2 << (2 * s)))), one,
                                                 _mm512_add_epi8(sc, sc));
            }
        }
    } else if constexpr (T == TQ2_0) {
        t.d = high_halves(words(b, index, 62));
        t.dmin = _mm512_setzero_ps();
        for (int i = 0; i < 8; i++) t.pairs[i] = _mm512_set1_epi32(-1);  // the offset 1: -bsum_g
        for (int w = 0; w < 16; w++) {
            const __m512i v = words(b, index, 4 * w);
            for (int s = 0; s < 4; s++) t.u[32 * (w / 8) + 8 * s + w % 8] = bytes_of(shr32(v, 2 * s), 0x03030303);
        }
    } else {  // TQ1_0
        static constexpr int POW3[5] = {1, 3, 9, 27, 81};
        t.d = high_halves(words(b, index, 50));
        t.dmin = _mm512_setzero_ps();
        for (int i = 0; i < 8; i++) t.pairs[i] = _mm512_set1_epi32(-1);
        for (int w = 0; w < 12; w++) {  // qs word w < 8: values 32 n + 4 w ..; w >= 8: values 160 + 16 n + 4 (w - 8) ..
            const __m512i v = words(b, index, 4 * w);
            for (int n = 0; n < 5; n++) t.u[w < 8 ? 8 * n + w : 40 + 4 * n + (w - 8)] = ternary_digits512(v, POW3[n]);
        }
        const __m512i qh = words(b, index, 48);  // values 240 + 4 n + m
        for (int n = 0; n < 4; n++) t.u[60 + n] = ternary_digits512(qh, POW3[n]);
    }
}

/* One super-block of R rows of x against a tile: x R rows of 256 rounded values (stride 256), bsums R rows of 16
   (stride 16), d8 their R scales; acc R rows of the 16 columns' float accumulators (stride 16). */
template <int T, int R>
__attribute__((noinline)) void tile_rows(const ColumnTile &t, const int8_t *x, const int16_t *bsums, const float *d8, float *acc) {
    auto x4 = [&](int r, int quad) {
        int32_t v;
        std::memcpy(&v, x + SUPER * r + 4 * quad, 4);
        return _mm512_set1_epi32(v);
    };
    __m512i s[R];
    for (int r = 0; r < R; r++) s[r] = _mm512_setzero_si512();
    if constexpr (T == Q4_K || T == Q5_K || T == Q3_K) {
        constexpr int UNIT = T == Q3_K ? 4 : 8;  // quads per scale
#pragma GCC unroll 16
        for (int j = 0; j < QUADS / UNIT; j++) {
            __m512i g[R];
            for (int r = 0; r < R; r++) g[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int i = 0; i < UNIT; i++) {
                const __m512i w = t.u[UNIT * j + i];
                for (int r = 0; r < R; r++) g[r] = _mm512_dpbusd_epi32(g[r], w, x4(r, UNIT * j + i));
            }
            for (int r = 0; r < R; r++) s[r] = _mm512_add_epi32(s[r], _mm512_mullo_epi32(g[r], t.scale[j]));
        }
    } else {
#pragma GCC unroll 64
        for (int q = 0; q < QUADS; q++) {
            const __m512i w = t.u[q];
            for (int r = 0; r < R; r++) s[r] = _mm512_dpbusd_epi32(s[r], w, x4(r, q));
        }
    }
    auto pair = [&](int r, int i) {
        int32_t v;
        std::memcpy(&v, bsums + GROUPS * r + 2 * i, 4);
        return _mm512_set1_epi32(v);
    };
    constexpr bool mins = has_mins(T);
    __m512i m[R];
    for (int r = 0; r < R; r++) m[r] = _mm512_setzero_si512();
    for (int i = 0; i < GROUPS / 2; i++)
        for (int r = 0; r < R; r++) {
            if constexpr (mins) {
                m[r] = _mm512_dpwssd_epi32(m[r], t.pairs[i], pair(r, i));
            } else {
                s[r] = _mm512_dpwssd_epi32(s[r], t.pairs[i], pair(r, i));
            }
        }
    const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(int(0x80000000u)));
    for (int r = 0; r < R; r++) {
        const __m512 d8r = _mm512_set1_ps(d8[r]);
        __m512 a = _mm512_loadu_ps(acc + COLUMNS * r);
        a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r]), _mm512_mul_ps(t.d, d8r), a);
        if constexpr (mins) a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(m[r]), _mm512_xor_ps(_mm512_mul_ps(t.dmin, d8r), sign), a);
        _mm512_storeu_ps(acc + COLUMNS * r, a);
    }
}

template <int T, int R = 1>
void tile_rows_of(int64_t count, const ColumnTile &t, const int8_t *x, const int16_t *bsums, const float *d8, float *acc) {
    if constexpr (R < ROW_STEP) {
        if (count != R) return tile_rows_of<T, R + 1>(count, t, x, bsums, d8, acc);
    }
    tile_rows<T, R>(t, x, bsums, d8, acc);
}

/* x's rounded rows laid out super-block by super-block: q [k / 256][rows][256], bsums [k / 256][rows][16],
   d [k / 256][rows] (a super-block's rows at fixed strides). */
struct BlockMajorRows {
    std::vector<int8_t> q;
    std::vector<int16_t> bsums;
    std::vector<float> d;
};

BlockMajorRows block_major(const RoundedRows &xq, int64_t rows, int64_t k) {
    const int64_t blocks = k / SUPER;
    BlockMajorRows out{std::vector<int8_t>(rows * k), std::vector<int16_t>(rows * (k / 16)), std::vector<float>(rows * blocks)};
    for (int64_t sb = 0; sb < blocks; sb++)
        for (int64_t r = 0; r < rows; r++) {
            std::memcpy(out.q.data() + (sb * rows + r) * SUPER, xq.q.data() + r * k + sb * SUPER, SUPER);
            std::memcpy(out.bsums.data() + (sb * rows + r) * GROUPS, xq.bsums.data() + r * (k / 16) + sb * GROUPS, 2 * GROUPS);
            out.d[sb * rows + r] = xq.d[r * blocks + sb];
        }
    return out;
}

/* Columns [16 tile, 16 tile + 16) of every row (those under n; the others repeat column n - 1, unstored). acc: room
   for rows x 16 floats. */
template <int T>
void column_tile(const KMatrix &m, int64_t tile, const BlockMajorRows &x, int64_t rows, float *out, float *acc) {
    const int64_t col = COLUMNS * tile, valid = std::min<int64_t>(COLUMNS, m.n - col);
    const int32_t stride = int32_t((m.k / SUPER) * block_bytes(T));
    const __m512i index = _mm512_mullo_epi32(
        _mm512_min_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(int(valid - 1))),
        _mm512_set1_epi32(stride));
    std::fill(acc, acc + rows * COLUMNS, 0.0f);
    ColumnTile t;
    for (int64_t sb = 0; sb < m.k / SUPER; sb++) {
        decode_tile<T>(m.block(col, sb), index, t);
        const int8_t *q = x.q.data() + sb * rows * SUPER;
        const int16_t *sums = x.bsums.data() + sb * rows * GROUPS;
        const float *d8 = x.d.data() + sb * rows;
        int64_t r = 0;
        for (; r + ROW_STEP <= rows; r += ROW_STEP)
            tile_rows<T, ROW_STEP>(t, q + r * SUPER, sums + r * GROUPS, d8 + r, acc + r * COLUMNS);
        if (r < rows) tile_rows_of<T>(rows - r, t, q + r * SUPER, sums + r * GROUPS, d8 + r, acc + r * COLUMNS);
    }
    const __mmask16 keep = __mmask16((1u << valid) - 1);
    for (int64_t r = 0; r < rows; r++) _mm512_mask_storeu_ps(out + r * m.n + col, keep, _mm512_loadu_ps(acc + r * COLUMNS));
}

template <int T>
void tiled_product(const KMatrix &m, const RoundedRows &xq, int64_t rows, float *out, bool threaded) {
    const BlockMajorRows x = block_major(xq, rows, m.k);
    const int64_t tiles = (m.n + COLUMNS - 1) / COLUMNS;
#pragma omp parallel num_threads(g_threads) if (threaded)
    {
        std::vector<float> acc(rows * COLUMNS);
#pragma omp for schedule(static)
        for (int64_t tile = 0; tile < tiles; tile++) column_tile<T>(m, tile, x, rows, out, acc.data());
    }
}

/* The product of rows >= many_rows(type) rounded rows on the column tiles. */
void tiled_product(const KMatrix &m, const RoundedRows &xq, int64_t rows, float *out, bool threaded) {
    switch (m.type) {
        case Q2_K: return tiled_product<Q2_K>(m, xq, rows, out, threaded);
        case Q3_K: return tiled_product<Q3_K>(m, xq, rows, out, threaded);
        case Q4_K: return tiled_product<Q4_K>(m, xq, rows, out, threaded);
        case Q5_K: return tiled_product<Q5_K>(m, xq, rows, out, threaded);
        case TQ1_0: return tiled_product<TQ1_0>(m, xq, rows, out, threaded);
        default: return tiled_product<TQ2_0>(m, xq, rows, out, threaded);
    }
}
#endif

/* ---- one product over the threads ---------------------------------------------------------------- */

/* Below this many multiply-adds a product runs on one thread (gguf_kernels.cpp's threshold, for the same reason). */
constexpr int64_t THREADED_MIN_WORK = int64_t(1) << 22;

void product(const KMatrix &m, const float *x, int64_t rows, float *out, bool int8) {
    const int64_t k = m.k, n = m.n;
    const bool threaded = g_threads > 1 && n > 1 && rows * n * k >= THREADED_MIN_WORK;
    if (int8) {
        const RoundedRows xq = round_rows(x, rows, k);
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
        if (rows >= many_rows(m.type)) return tiled_product(m, xq, rows, out, threaded);
#endif
#pragma omp parallel for schedule(static) num_threads(g_threads) if (threaded)
        for (int64_t col = 0; col < n; col++) {
            const int8_t *qs[INT8_TILE];
            const float *ds[INT8_TILE];
            const int16_t *sums[INT8_TILE];
            float *outs[INT8_TILE];
            for (int64_t r0 = 0; r0 < rows; r0 += INT8_TILE) {
                const int64_t count = std::min<int64_t>(INT8_TILE, rows - r0);
                for (int64_t i = 0; i < count; i++) {
                    qs[i] = xq.q.data() + (r0 + i) * k;
                    ds[i] = xq.d.data() + (r0 + i) * (k / SUPER);
                    sums[i] = xq.bsums.data() + (r0 + i) * (k / 16);
                    outs[i] = out + (r0 + i) * n;
                }
                int8_rows(count, m, col, qs, ds, sums, outs);
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

/* ---- the MLX operations ---------------------------------------------------------------------------- */

/* product() and the float weights as kernels_common.h's BlockProduct and BlockDequantize call them: w[0] the row
   bytes of one matrix, or of one expert of a stack (gguf_kquant_gather_matmul). */
void k_product(const std::vector<const uint8_t *> &w, int64_t n, int64_t k, const float *x, int64_t rows, float *out,
               int type, bool int8) {
    product(KMatrix{w[0], type, n, k}, x, rows, out, int8);
}

void k_dequantize(const uint8_t *blocks, int64_t n, int64_t k, float *out, int type) {
    const KMatrix m{blocks, type, n, k};
    Unpacked u;
    for (int64_t r = 0; r < n; r++)
        for (int64_t sb = 0; sb < k / SUPER; sb++) {
            unpack(type, m.block(r, sb), u);
            dequantize(type, u, out + r * k + sb * SUPER);
        }
}

void check(const mx::array &blocks, int type, int64_t k) {
    auto fail = [](const std::string &why) { throw std::invalid_argument("pipeline GGUF K-quant product: " + why); };
    if (!block_bytes(type)) fail("type must be Q2_K (10), Q3_K (11), Q4_K (12), Q5_K (13), TQ1_0 (34) or TQ2_0 (35)");
    if (k % SUPER) fail("k must be a multiple of 256");
    if (blocks.ndim() < 1 || blocks.nbytes() != size_t(blocks.shape(0) * (k / SUPER * block_bytes(type))))
        fail("blocks must be [n, ...] holding n rows of k / 256 super-blocks");
}

/* The lazy product (experts given: gathered) of the blocks, after check()'s checks. */
mx::array k_array(const mx::array &x, const mx::array &blocks, int type, bool int8, const std::optional<mx::array> &experts) {
    return block_product<k_product>("pipeline GGUF K-quant product", type, int8, x, {blocks}, experts,
                                    [&](const std::vector<mx::array> &w) { check(w[0], type, x.shape(-1)); });
}

}  // namespace

void register_gguf_kquants(nb::module_ &m) {
    m.def(
        "gguf_kquant_matmul",
        [](const mx::array &x, const mx::array &blocks, int type, bool int8) {
            return k_array(x, blocks, type, int8, std::nullopt);
        },
        nb::arg("x"), nb::arg("blocks"), nb::arg("type"), nb::arg("int8"),
        "x [..., k] float32 @ w.T for a GGUF tensor (Q2_K, Q3_K, Q4_K, Q5_K, TQ1_0, TQ2_0) held as the file's blocks "
        "([n, ...], any dtype), lazily; int8: x rounded per 256 as Q8_K (llama.cpp's vec_dot), else float products");
    m.def(
        "gguf_kquant_gather_matmul",
        [](const mx::array &x, const mx::array &blocks, int type, bool int8, const mx::array &experts) {
            return k_array(x, blocks, type, int8, experts);
        },
        nb::arg("x"), nb::arg("blocks"), nb::arg("type"), nb::arg("int8"), nb::arg("experts"),
        "x [rows, k] float32: row p times expert experts[p]'s matrix of a stack held as the file's blocks "
        "([experts, n, row bytes]), lazily: each row the bits of gguf_kquant_matmul on that row alone");
    m.def(
        "gguf_kquant_dequantize",
        [](const mx::array &blocks, int type) {
            return block_dequantize<k_dequantize>("pipeline GGUF K-quant dequantize: blocks must be [n, ...] of whole "
                                                  "super-blocks of Q2_K, Q3_K, Q4_K, Q5_K, TQ1_0 or TQ2_0",
                                                  blocks, type, block_bytes(type));
        },
        nb::arg("blocks"), nb::arg("type"), "float32 [n, k]: every weight of the blocks as the float products use it");
}
