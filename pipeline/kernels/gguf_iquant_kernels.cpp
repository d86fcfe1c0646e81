/* Products with GGUF's grid i-quants held in their own blocks (no re-quantization): IQ2_XXS, IQ2_XS, IQ2_S,
 * IQ3_XXS, IQ3_S, IQ1_S and IQ1_M, as llama.cpp computes them on CPU (ggml-cpu's vec_dot_<type>_q8_K).
 *
 * The held layout: a tensor's rows, each the file's bytes of that row verbatim, k / 256 super-blocks of
 * ggml-common.h's block_<type> (bytes per 256 values: IQ2_XXS 66, IQ2_XS 74, IQ2_S 82, IQ3_XXS 98, IQ3_S 110,
 * IQ1_S 50, IQ1_M 56), in one array of any dtype, [n, ...], whose bytes are n rows of those.
 *
 * Every type's super-block decodes (decode_<type>) to integers: 256 int8 values w, one odd scale ls per 16
 * values and the fp16 d, with a value = C * d * ls * w exactly, C a power of two per type:
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

#include "iquant_grids.h"
#include "kernels_common.h"

namespace nb = nanobind;

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

/* byte j of SIGN_MASKS[s]: 0xff where bit j of s is set */
struct SignMasks {
    uint64_t m[256];
    constexpr SignMasks() : m() {
        for (int s = 0; s < 256; s++)
            for (int j = 0; j < 8; j++)
                if (s >> j & 1) m[s] |= uint64_t(0xff) << (8 * j);
    }
};
constexpr SignMasks SIGN_MASKS;

/* 8 grid values (bytes, each 1..127) with the bytes of sign byte s's set bits negated: (g ^ m) + (m & 1s)
   negates a masked byte (~g + 1) without a carry into the next, as no grid value is 0. */
inline uint64_t signed_grid(uint64_t g, unsigned s) {
    const uint64_t m = SIGN_MASKS.m[s & 255];
    return (g ^ m) + (m & 0x0101010101010101ULL);
}

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

/* One decoded super-block: value i = C * d * ls[i / 16] * w[i]. */
struct Decoded {
    alignas(64) int8_t w[SUPER];
    int32_t ls[16];
    float d;
};

inline void put8(int8_t *w, uint64_t v) { std::memcpy(w, &v, 8); }

void decode_iq2_xxs(const uint8_t *b, Decoded &o) {
    o.d = half_bits(u16_at(b));
    for (int ib = 0; ib < 8; ib++) {
        const uint8_t *q = b + 2 + 8 * ib;  // 4 grid indices, then 4 x 7 sign bits and the 4-bit scale
        const uint32_t aux = u32_at(q + 4);
        for (int l = 0; l < 4; l++) put8(o.w + 32 * ib + 8 * l, signed_grid(IQ2XXS_GRID[q[l]], KSIGNS_IQ2XS[(aux >> (7 * l)) & 127]));
        o.ls[2 * ib] = o.ls[2 * ib + 1] = int32_t(2 * (aux >> 28) + 1);
    }
}

void decode_iq2_xs(const uint8_t *b, Decoded &o) {
    o.d = half_bits(u16_at(b));
    const uint8_t *scales = b + 66;
    for (int i = 0; i < 32; i++) {  // uint16: 9-bit grid index, 7-bit sign index
        const uint16_t q = u16_at(b + 2 + 2 * i);
        put8(o.w + 8 * i, signed_grid(IQ2XS_GRID[q & 511], KSIGNS_IQ2XS[q >> 9]));
    }
    for (int j = 0; j < 16; j++) o.ls[j] = 2 * ((scales[j / 2] >> (4 * (j % 2))) & 15) + 1;
}

void decode_iq2_s(const uint8_t *b, Decoded &o) {
    o.d = half_bits(u16_at(b));
    const uint8_t *qs = b + 2, *signs = b + 34, *qh = b + 66, *scales = b + 74;
    for (int i = 0; i < 32; i++) {  // 8 values: grid index qs[i] and 2 bits of qh, its own sign byte
        const int index = qs[i] | (((qh[i / 4] >> (2 * (i % 4))) & 3) << 8);
        put8(o.w + 8 * i, signed_grid(IQ2S_GRID[index], signs[i]));
    }
    for (int j = 0; j < 16; j++) o.ls[j] = 2 * ((scales[j / 2] >> (4 * (j % 2))) & 15) + 1;
}

void decode_iq3_xxs(const uint8_t *b, Decoded &o) {
    o.d = half_bits(u16_at(b));
    const uint8_t *qs = b + 2, *sas = b + 66;
    for (int ib = 0; ib < 8; ib++) {
        const uint32_t aux = u32_at(sas + 4 * ib);  // 4 x 7 sign bits, the 4-bit scale
        for (int l = 0; l < 4; l++) {
            const uint64_t g = uint64_t(IQ3XXS_GRID[qs[8 * ib + 2 * l]]) | uint64_t(IQ3XXS_GRID[qs[8 * ib + 2 * l + 1]]) << 32;
            put8(o.w + 32 * ib + 8 * l, signed_grid(g, KSIGNS_IQ2XS[(aux >> (7 * l)) & 127]));
        }
        o.ls[2 * ib] = o.ls[2 * ib + 1] = int32_t(2 * (aux >> 28) + 1);
    }
}

void decode_iq3_s(const uint8_t *b, Decoded &o) {
    o.d = half_bits(u16_at(b));
    const uint8_t *qs = b + 2, *qh = b + 66, *signs = b + 74, *scales = b + 106;
    for (int i = 0; i < 32; i++) {  // 8 values: two grid indices (qs and a bit of qh each), one sign byte
        const int ib = i / 4, l = i % 4;
        const int i0 = qs[2 * i] | (((qh[ib] >> (2 * l)) & 1) << 8), i1 = qs[2 * i + 1] | (((qh[ib] >> (2 * l + 1)) & 1) << 8);
        put8(o.w + 8 * i, signed_grid(uint64_t(IQ3S_GRID[i0]) | uint64_t(IQ3S_GRID[i1]) << 32, signs[i]));
    }
    for (int ib = 0; ib < 8; ib++) o.ls[2 * ib] = o.ls[2 * ib + 1] = 2 * ((scales[ib / 2] >> (4 * (ib % 2))) & 15) + 1;
}

/* 8 iq1s grid values g (-1, 0, 1) as 8 g + delta */
inline void put_iq1(int8_t *w, int index, int delta) {
    int8_t g[8];
    std::memcpy(g, &IQ1S_GRID[index], 8);
    for (int j = 0; j < 8; j++) w[j] = int8_t(8 * g[j] + delta);
}

void decode_iq1_s(const uint8_t *b, Decoded &o) {
    o.d = half_bits(u16_at(b));
    const uint8_t *qs = b + 2, *qh = b + 34;
    for (int ib = 0; ib < 8; ib++) {
        const uint16_t h = u16_at(qh + 2 * ib);  // 4 x 3 index bits, 3-bit scale, the delta's sign
        const int delta = h & 0x8000 ? -1 : 1;
        for (int l = 0; l < 4; l++) put_iq1(o.w + 32 * ib + 8 * l, qs[4 * ib + l] | (((h >> (3 * l)) & 7) << 8), delta);
        o.ls[2 * ib] = o.ls[2 * ib + 1] = 2 * ((h >> 12) & 7) + 1;
    }
}

void decode_iq1_m(const uint8_t *b, Decoded &o) {
    const uint8_t *qs = b, *qh = b + 32, *sc = b + 48;
    uint16_t s[4];
    std::memcpy(s, sc, 8);
    o.d = half_bits(uint16_t((s[0] >> 12) | ((s[1] >> 8) & 0x00f0) | ((s[2] >> 4) & 0x0f00) | (s[3] & 0xf000)));
    for (int i = 0; i < 32; i++) {  // 8 values: qs[i] and a nibble of qh (3 index bits, the delta's sign)
        const int nib = (qh[i / 2] >> (4 * (i % 2))) & 15;
        put_iq1(o.w + 8 * i, qs[i] | ((nib & 7) << 8), nib & 8 ? -1 : 1);
    }
    for (int j = 0; j < 16; j++) o.ls[j] = 2 * ((s[j / 4] >> (3 * (j % 4))) & 7) + 1;
}

inline void decode(int type, const uint8_t *b, Decoded &o) {
    switch (type) {
        case IQ2_XXS: return decode_iq2_xxs(b, o);
        case IQ2_XS: return decode_iq2_xs(b, o);
        case IQ2_S: return decode_iq2_s(b, o);
        case IQ3_XXS: return decode_iq3_xxs(b, o);
        case IQ3_S: return decode_iq3_s(b, o);
        case IQ1_S: return decode_iq1_s(b, o);
        default: return decode_iq1_m(b, o);
    }
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

constexpr int FLOAT_TILE = 8;  // rows sharing each decoded super-block

/* A decoded super-block's 256 weights as float32, exactly: (C d ls) * w. */
inline void dequantize(const Decoded &s, float factor, float *out) {
    for (int j = 0; j < 16; j++) {
        const float scale = factor * s.d * float(s.ls[j]);  // exact: a power of two, 11 bits, 4 bits
        for (int i = 0; i < 16; i++) out[16 * j + i] = scale * float(s.w[16 * j + i]);
    }
}

template <int R>
void float_tile(const IQMatrix &m, int64_t col, const float *const *x, float *const *out) {
    v16 acc[R] = {};
    Decoded s;
    alignas(64) float w[SUPER];
    const float factor = type_factor(m.type);
    for (int64_t sb = 0; sb < m.k / SUPER; sb++) {
        decode(m.type, m.block(col, sb), s);
        dequantize(s, factor, w);
        for (int c = 0; c < 16; c++) {
            const v16 wc = load16(w + 16 * c);
            for (int r = 0; r < R; r++) acc[r] = fma16(wc, load16(x[r] + SUPER * sb + 16 * c), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r][col] = lanes_sum(acc[r]);
}

template <int R = 1>
void float_rows(int64_t count, const IQMatrix &m, int64_t col, const float *const *x, float *const *out) {
    if constexpr (R < FLOAT_TILE) {
        if (count != R) return float_rows<R + 1>(count, m, col, x, out);
    }
    float_tile<R>(m, col, x, out);
}

/* ---- int8 products ------------------------------------------------------------------------------- */

typedef int32_t i32x8 __attribute__((vector_size(32)));

/* x's rows rounded as Q8_K: q [rows, k], d [rows, k / 256] (gguf_kernels.cpp's round_rows, the same bits). */
struct RoundedRows {
    std::vector<int8_t> q;
    std::vector<float> d;
};

RoundedRows round_rows(const float *x, int64_t rows, int64_t k) {
    RoundedRows out{std::vector<int8_t>(rows * k), std::vector<float>(rows * (k / SUPER))};
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < k / SUPER; c++) {
            const float *v = x + r * k + c * SUPER;
            float amax = 0.0f;
            for (int64_t i = 0; i < SUPER; i++) amax = std::max(amax, std::fabs(v[i]));
            const float d = amax / 127.0f;
            float inverse = d > 0.0f ? 1.0f / d : 0.0f;
            if (!(inverse < INFINITY)) inverse = 0.0f;  // tiny or not finite: the block counts as zeros
            out.d[r * (k / SUPER) + c] = d;
            int8_t *q = out.q.data() + r * k + c * SUPER;
            for (int64_t i = 0; i < SUPER; i++) {
                const float f = std::nearbyint(v[i] * inverse);
                q[i] = f >= 127.0f ? 127 : f <= -127.0f ? -127 : f == f ? int8_t(f) : 0;  // NaN: 0
            }
        }
    return out;
}

/* S of the opening comment for one decoded super-block and one row's 256 rounded activations: 8 int32 lanes
   (their sum is S), lane l of 32-value chunk c holding ls times 4 products. Exact on every path: |w| <= 62, so
   vpmaddubsw's pair sums (|w| times x signed as w) fit 16 bits and vpmaddwd's by ls (<= 31) 32 bits. */
struct Weights {
#if defined(__AVX2__)
    __m256i magnitude[8], sign[8], scale[8];  // per 32 values: |w|, w (its signs), the 16-bit ls of each pair
#endif
};

inline void prepare(const Decoded &s, Weights &p) {
#if defined(__AVX2__)
    for (int c = 0; c < 8; c++) {
        const __m256i w = _mm256_load_si256(reinterpret_cast<const __m256i *>(s.w + 32 * c));
        p.sign[c] = w;
        p.magnitude[c] = _mm256_sign_epi8(w, w);
        p.scale[c] = _mm256_set_m128i(_mm_set1_epi16(int16_t(s.ls[2 * c + 1])), _mm_set1_epi16(int16_t(s.ls[2 * c])));
    }
#else
    (void)s;
    (void)p;
#endif
}

inline i32x8 super_dot(const Decoded &s, const Weights &p, const int8_t *xq) {
#if defined(__AVX2__)
    __m256i sum = _mm256_setzero_si256();
    for (int c = 0; c < 8; c++) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(xq + 32 * c));
        const __m256i pairs = _mm256_maddubs_epi16(p.magnitude[c], _mm256_sign_epi8(x, p.sign[c]));
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(pairs, p.scale[c]));
    }
    return (i32x8)sum;
#else
    (void)p;
    i32x8 lanes{};
    for (int i = 0; i < SUPER; i++) lanes[(i % 32) / 4] += int32_t(s.w[i]) * xq[i] * s.ls[i / 16];
    return lanes;
#endif
}

inline int32_t lanes_total(i32x8 v) {
    return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));  // integers: any order, exact
}

constexpr int INT8_TILE = 4;  // rows sharing each decoded super-block

template <int R>
void int8_tile(const IQMatrix &m, int64_t col, const int8_t *const *xq, const float *const *xd, float *const *out) {
    float acc[R] = {};
    Decoded s;
    Weights p;
    for (int64_t sb = 0; sb < m.k / SUPER; sb++) {
        decode(m.type, m.block(col, sb), s);
        prepare(s, p);
        for (int r = 0; r < R; r++) {
            const int32_t total = lanes_total(super_dot(s, p, xq[r] + SUPER * sb));
            acc[r] = std::fma(float(total), s.d * xd[r][sb], acc[r]);
        }
    }
    const float factor = type_factor(m.type);
    for (int r = 0; r < R; r++) out[r][col] = factor * acc[r];
}

template <int R = 1>
void int8_rows(int64_t count, const IQMatrix &m, int64_t col, const int8_t *const *xq, const float *const *xd,
               float *const *out) {
    if constexpr (R < INT8_TILE) {
        if (count != R) return int8_rows<R + 1>(count, m, col, xq, xd, out);
    }
    int8_tile<R>(m, col, xq, xd, out);
}

/* ---- one product over the threads ---------------------------------------------------------------- */

/* Below this many multiply-adds a product runs on one thread (gguf_kernels.cpp's threshold). */
constexpr int64_t THREADED_MIN_WORK = int64_t(1) << 22;

void product(const IQMatrix &m, const float *x, int64_t rows, float *out, bool int8) {
    const int64_t k = m.k, n = m.n;
    const bool threaded = g_threads > 1 && n > 1 && rows * n * k >= THREADED_MIN_WORK;
    if (int8) {
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

/* ---- the MLX operations ---------------------------------------------------------------------------- */

/* Inputs: x [..., k] float32, blocks [n, ...] (any dtype) whose bytes are n rows of k / 256 super-blocks. */
class IQProduct : public mx::UnaryPrimitive {
   public:
    IQProduct(mx::Stream stream, int type, bool int8) : mx::UnaryPrimitive(stream), type_(type), int8_(int8) {}

    void eval_cpu(const std::vector<mx::array> &inputs, mx::array &out) override {
        out.set_data(mx::allocator::malloc(out.nbytes()));
        auto &encoder = mx::cpu::get_command_encoder(stream());
        for (auto &a : inputs) encoder.set_input_array(a);
        encoder.set_output_array(out);
        const int type = type_;
        const bool int8 = int8_;
        encoder.dispatch([inputs, out, type, int8]() mutable {
            std::vector<mx::array> keep;
            const mx::array x = contiguous(inputs[0], keep), blocks = contiguous(inputs[1], keep);
            const int64_t k = x.shape(-1), rows = k ? int64_t(x.size()) / k : 0, n = blocks.shape(0);
            if (rows == 0 || n == 0) return;
            const IQMatrix m{blocks.data<uint8_t>(), type, n, k};
            product(m, x.data<float>(), rows, out.data<float>(), int8);
        });
    }

    void eval_gpu(const std::vector<mx::array> &, mx::array &) override {
        throw std::runtime_error("pipeline's GGUF i-quant products run on the CPU only");
    }

    const char *name() const override { return "PipelineGGUFIQuantProduct"; }

    bool is_equivalent(const mx::Primitive &other) const override {
        auto *o = dynamic_cast<const IQProduct *>(&other);
        return o && o->type_ == type_ && o->int8_ == int8_;
    }

    std::vector<mx::Shape> output_shapes(const std::vector<mx::array> &inputs) override {
        mx::Shape shape = inputs[0].shape();
        shape.back() = inputs[1].shape(0);
        return {shape};
    }

   private:
    int type_;
    bool int8_;
};

/* Output: float32 [n, k], every weight as the float path uses it. */
class IQDequantize : public mx::UnaryPrimitive {
   public:
    IQDequantize(mx::Stream stream, int type) : mx::UnaryPrimitive(stream), type_(type) {}

    void eval_cpu(const std::vector<mx::array> &inputs, mx::array &out) override {
        out.set_data(mx::allocator::malloc(out.nbytes()));
        auto &encoder = mx::cpu::get_command_encoder(stream());
        encoder.set_input_array(inputs[0]);
        encoder.set_output_array(out);
        const int type = type_;
        encoder.dispatch([inputs, out, type]() mutable {
            std::vector<mx::array> keep;
            const mx::array blocks = contiguous(inputs[0], keep);
            const int64_t n = out.shape(0), k = out.shape(1);
            const IQMatrix m{blocks.data<uint8_t>(), type, n, k};
            Decoded s;
            for (int64_t r = 0; r < n; r++)
                for (int64_t sb = 0; sb < k / SUPER; sb++) {
                    decode(type, m.block(r, sb), s);
                    dequantize(s, type_factor(type), out.data<float>() + r * k + sb * SUPER);
                }
        });
    }

    void eval_gpu(const std::vector<mx::array> &, mx::array &) override {
        throw std::runtime_error("pipeline's GGUF i-quant products run on the CPU only");
    }

    const char *name() const override { return "PipelineGGUFIQuantDequantize"; }

    bool is_equivalent(const mx::Primitive &other) const override {
        auto *o = dynamic_cast<const IQDequantize *>(&other);
        return o && o->type_ == type_;
    }

    std::vector<mx::Shape> output_shapes(const std::vector<mx::array> &inputs) override {
        return {mx::Shape{inputs[0].shape(0), int(inputs[0].nbytes() / inputs[0].shape(0) / block_bytes(type_) * SUPER)}};
    }

   private:
    int type_;
};

void check(const mx::array &blocks, int type, int64_t k) {
    auto fail = [](const std::string &why) { throw std::invalid_argument("pipeline GGUF i-quant product: " + why); };
    if (!block_bytes(type))
        fail("type must be IQ2_XXS (16), IQ2_XS (17), IQ3_XXS (18), IQ1_S (19), IQ3_S (21), IQ2_S (22) or IQ1_M (29)");
    if (k % SUPER) fail("k must be a multiple of 256");
    if (blocks.ndim() < 1 || blocks.nbytes() != size_t(blocks.shape(0) * (k / SUPER * block_bytes(type))))
        fail("blocks must be [n, ...] holding n rows of k / 256 super-blocks");
}

mx::Stream cpu_stream() { return mx::default_stream(mx::Device(mx::Device::cpu)); }

}  // namespace

void register_gguf_iquants(nb::module_ &m) {
    m.def(
        "gguf_iquant_matmul",
        [](const mx::array &x, const mx::array &blocks, int type, bool int8) {
            if (x.ndim() < 1 || x.dtype() != mx::float32)
                throw std::invalid_argument("pipeline GGUF i-quant product: x must be float32 [..., k]");
            check(blocks, type, x.shape(-1));
            mx::Shape shape = x.shape();
            shape.back() = blocks.shape(0);
            return mx::array(shape, mx::float32, std::make_shared<IQProduct>(cpu_stream(), type, int8), {x, blocks});
        },
        nb::arg("x"), nb::arg("blocks"), nb::arg("type"), nb::arg("int8"),
        "x [..., k] float32 @ w.T for a GGUF grid i-quant tensor (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, "
        "IQ1_M) held as the file's blocks ([n, ...], any dtype), lazily; int8: x rounded per 256 as Q8_K "
        "(llama.cpp's vec_dot), else float products");
    m.def(
        "gguf_iquant_dequantize",
        [](const mx::array &blocks, int type) {
            if (!block_bytes(type) || blocks.ndim() < 1 || blocks.shape(0) == 0 ||
                blocks.nbytes() % size_t(blocks.shape(0) * block_bytes(type)))
                throw std::invalid_argument("pipeline GGUF i-quant dequantize: blocks must be [n, ...] of whole "
                                            "super-blocks of a grid i-quant type");
            const int k = int(blocks.nbytes() / blocks.shape(0) / block_bytes(type) * SUPER);
            return mx::array(mx::Shape{blocks.shape(0), k}, mx::float32, std::make_shared<IQDequantize>(cpu_stream(), type),
                             {blocks});
        },
        nb::arg("blocks"), nb::arg("type"),
        "float32 [n, k]: the weights of a grid i-quant tensor's blocks as the float products use them (exact)");
}
