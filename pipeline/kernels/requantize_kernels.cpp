/* Re-quantization at load in one pass: a float matrix (float32, bfloat16, float16) or a DeepSeek FP8
 * matrix (e4m3 bytes, one float32 scale per 128x128 block) to MLX's affine quantization, bit for bit
 * what `mx.quantize` gives for the same values.
 *
 * Why. `--quantize` on an FP8 or bf16 checkpoint (DeepSeek V3 and Kimi K2 as published) ran MLX's
 * graph: from_fp8 (3.2 ns a value on this CPU), the block scale (1.7 ns), then mx.quantize (3.6 ns):
 * about 8.5 ns of one core per weight, 38x the time to read a Llama-1B's FP8 bytes from the page
 * cache. Here each value is decoded, scaled and quantized while it is in a register: one read of the
 * source, one write of the result.
 *
 * Exactness. The value quantized is the one MLX's graph makes: e4m3 decoded exactly (the table
 * below), times its block's scale in float32 (one rounding), rounded to the held dtype (bfloat16:
 * to nearest even); then MLX's affine rule per group of `group_size` values of a row:
 *   scale = max((max - min) / (2^bits - 1), 1e-7), negated unless |min| > |max|;
 *   edge = min or max (the larger magnitude); q0 = rint(edge / scale);
 *   if q0 != 0: scale = edge / q0, bias = edge, else bias = 0;
 *   q = clamp(rint((w - bias) / scale), 0, 2^bits - 1), packed little-endian as MLX packs them;
 * scales and biases stored in the held dtype. Every step is an IEEE operation on floats (a division,
 * not a multiplication by a reciprocal; no fused multiply-adds: built with -ffp-contract=off), so
 * the lanes give the same bits as MLX's scalar loop. tests/test_requantize_kernel.py checks this to
 * the bit against mx.quantize for every bit width, group size and dtype.
 *
 * Each call runs on one thread: the loader (loading.py) already spreads tensors over one CPU stream
 * per core.
 */
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include <cmath>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"

#include "kernels_common.h"

#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace nb = nanobind;

static constexpr int FP8_BLOCK = 128;

/* float32 -> bfloat16 bits, to nearest even (as MLX's bfloat16 conversion). */
static inline uint16_t bf16_bits(float x) {
    if (std::isnan(x)) return 0x7FC0;
    uint32_t u;
    std::memcpy(&u, &x, 4);
    u += ((u >> 16) & 1) + 0x7FFFu;
    return uint16_t(u >> 16);
}

static inline float bf16_value(uint16_t bits) {
    const uint32_t u = uint32_t(bits) << 16;
    float x;
    std::memcpy(&x, &u, 4);
    return x;
}

/* One group's codes, packed: the common widths with the loop bounds known, so that they vectorize. */
template <int BITS>
static inline void quantize_group(const float *v, int group, float bias, float scale, uint8_t *out) {
    constexpr float n_bins = float((1 << BITS) - 1);
    for (int j0 = 0; j0 < group; j0 += 32) {
        int32_t c[32];
        for (int j = 0; j < 32; j++) {
            float x = std::rint((v[j0 + j] - bias) / scale);
            x = x < 0.0f ? 0.0f : x;
            c[j] = int32_t(x > n_bins ? n_bins : x);
        }
        if constexpr (BITS == 8) {
            for (int j = 0; j < 32; j++) out[j0 + j] = uint8_t(c[j]);
        } else {
            uint32_t words[4];
            for (int w = 0; w < 4; w++) {
                uint32_t word = 0;
                for (int k = 0; k < 8; k++) word |= uint32_t(c[8 * w + k]) << (4 * k);
                words[w] = word;
            }
            std::memcpy(out + j0 / 2, words, 16);
        }
    }
}

/* 16 e4m3 bytes to float32 times `scale`, without a table: the byte's exponent and mantissa bits
   become a float32's top bits with the exponent rebiased (e4m3's bias is 7, float32's 127), exact
   for normal values; a subnormal (exponent 0, value m 2^-9) comes out as 2^-7 (1 + m/8) and is
   mended exactly as 2 (x - 2^-7). (0x7f and 0xff, e4m3's NaNs, come out as +-480: real weights are
   never NaN.) */
static inline void decode_fp8(const uint8_t *in, float scale, float *out) {
    typedef uint8_t u8x16 __attribute__((vector_size(16)));
    typedef uint32_t u32x16 __attribute__((vector_size(64)));
#if defined(__AVX512F__)
    const u32x16 b = (u32x16)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(in)));
#else
    u8x16 raw;
    std::memcpy(&raw, in, 16);
    const u32x16 b = __builtin_convertvector(raw, u32x16);
#endif
    const u32x16 bits = ((b & 0x7Fu) << 20) + (120u << 23);
    v16 x;
    std::memcpy(&x, &bits, 64);
    const v16 mended = 2.0f * (x - 0x1p-7f);
    x = (b & 0x78u) == 0 ? mended : x;
    u32x16 signed_bits;
    std::memcpy(&signed_bits, &x, 64);
    signed_bits |= (b & 0x80u) << 24;
    std::memcpy(&x, &signed_bits, 64);
    store16(out, x * scale);
}

enum Source { FROM_FP8, FROM_F32, FROM_BF16, FROM_F16 };

class Requantize : public mx::Primitive {
   public:
    Requantize(mx::Stream stream, int bits, int group_size, Source source)
        : mx::Primitive(stream), bits_(bits), group_size_(group_size), source_(source) {}

    void eval_cpu(const std::vector<mx::array> &inputs, std::vector<mx::array> &outputs) override {
        for (auto &o : outputs) o.set_data(mx::allocator::malloc(o.nbytes()));
        auto &encoder = mx::cpu::get_command_encoder(stream());
        for (auto &a : inputs) encoder.set_input_array(a);
        for (auto &a : outputs) encoder.set_output_array(a);
        encoder.dispatch([inputs, outputs, bits = bits_, group = group_size_, source = source_]() mutable {
            std::vector<mx::array> keep;
            const mx::array w = contiguous(inputs[0], keep);
            const int64_t cols = w.shape(-1), rows = cols ? int64_t(w.size()) / cols : 0;
            const float *block_scales = nullptr;
            int64_t scale_cols = 0;
            if (source == FROM_FP8) {
                const mx::array s = contiguous(inputs[1], keep);
                block_scales = s.data<float>();
                scale_cols = s.shape(-1);
            }
            const bool to_bf16 = outputs[1].dtype() == mx::bfloat16;
            const float n_bins = float((1 << bits) - 1);
            const int per_pack = (bits == 3 || bits == 5) ? 8 : bits == 6 ? 4 : 32 / bits;  // values per pack
            const int pack_bytes = (bits == 3 || bits == 6) ? 3 : bits == 5 ? 5 : 4;
            const int64_t groups = cols / group, row_bytes = cols * bits / 8;
            uint8_t *q_out = outputs[0].data<uint8_t>();
            const uint8_t *in_bytes = source == FROM_FP8 ? w.data<uint8_t>() : nullptr;
            const float *in_f32 = source == FROM_F32 ? w.data<float>() : nullptr;
            const uint16_t *in_16 = (source == FROM_BF16 || source == FROM_F16) ? w.data<uint16_t>() : nullptr;
            void *scales_out = outputs[1].data<void>(), *biases_out = outputs[2].data<void>();
            std::vector<float> v(group);
            std::vector<int32_t> q(group);
            for (int64_t r = 0; r < rows; r++) {
                for (int64_t g = 0; g < groups; g++) {
                    const int64_t at = r * cols + g * group;
                    switch (source) {  // the values MLX's graph would quantize
                        case FROM_FP8: {
                            const uint8_t *in = in_bytes + at;
                            const float s = block_scales[(r / FP8_BLOCK) * scale_cols + (g * group) / FP8_BLOCK];
                            for (int j = 0; j < group; j += 16) decode_fp8(in + j, s, v.data() + j);
                            break;
                        }
                        case FROM_F32: std::memcpy(v.data(), in_f32 + at, group * 4); break;
                        case FROM_BF16: {
                            const uint16_t *in = in_16 + at;
                            for (int j = 0; j < group; j++) v[j] = bf16_value(in[j]);
                            break;
                        }
                        case FROM_F16: {
                            const mx::float16_t *in = reinterpret_cast<const mx::float16_t *>(in_16) + at;
                            for (int j = 0; j < group; j++) v[j] = static_cast<float>(in[j]);
                            break;
                        }
                    }
                    if (to_bf16 && source != FROM_BF16)
                        for (int j = 0; j < group; j++) v[j] = bf16_value(bf16_bits(v[j]));
                    // min and max in 16 lanes (exact, so in any order; only a zero's sign may differ,
                    // which changes nothing below)
                    v16 hi = load16(v.data()), lo = hi;
                    for (int j = 16; j < group; j += 16) {
                        const v16 x = load16(v.data() + j);
                        hi = hi > x ? hi : x;
                        lo = lo < x ? lo : x;
                    }
                    for (int width = 8; width >= 1; width /= 2)
                        for (int l = 0; l < width; l++) {
                            hi[l] = hi[l] > hi[l + width] ? hi[l] : hi[l + width];
                            lo[l] = lo[l] < lo[l + width] ? lo[l] : lo[l + width];
                        }
                    const float w_max = hi[0], w_min = lo[0];
                    const bool mask = std::abs(w_min) > std::abs(w_max);
                    float scale = std::max((w_max - w_min) / n_bins, 1e-7f);
                    scale = mask ? scale : -scale;
                    const float edge = mask ? w_min : w_max;
                    const float q0 = std::rint(edge / scale);
                    float bias = 0;
                    if (q0 != 0) {
                        scale = edge / q0;
                        bias = edge;
                    }
                    uint8_t *out = q_out + r * row_bytes + g * group * bits / 8;
                    if (bits == 4)
                        quantize_group<4>(v.data(), group, bias, scale, out);
                    else if (bits == 8)
                        quantize_group<8>(v.data(), group, bias, scale, out);
                    else {
                        for (int j = 0; j < group; j++) {
                            const float x = std::rint((v[j] - bias) / scale);
                            q[j] = int32_t(std::min(std::max(x, 0.0f), n_bins));
                        }
                        for (int j = 0; j < group; j += per_pack) {
                            uint64_t word = 0;
                            for (int k = 0; k < per_pack; k++) word |= uint64_t(q[j + k]) << (k * bits);
                            for (int b = 0; b < pack_bytes; b++) *out++ = uint8_t(word >> (8 * b));
                        }
                    }
                    const int64_t i = r * groups + g;
                    if (to_bf16) {
                        static_cast<uint16_t *>(scales_out)[i] = bf16_bits(scale);
                        static_cast<uint16_t *>(biases_out)[i] = bf16_bits(bias);
                    } else {
                        static_cast<float *>(scales_out)[i] = scale;
                        static_cast<float *>(biases_out)[i] = bias;
                    }
                }
            }
        });
    }

    void eval_gpu(const std::vector<mx::array> &, std::vector<mx::array> &) override {
        throw std::runtime_error("pipeline's re-quantization kernel runs on the CPU only");
    }

    const char *name() const override { return "PipelineRequantize"; }

    bool is_equivalent(const mx::Primitive &other) const override {
        auto *o = dynamic_cast<const Requantize *>(&other);
        return o && o->bits_ == bits_ && o->group_size_ == group_size_ && o->source_ == source_;
    }

    std::vector<mx::Shape> output_shapes(const std::vector<mx::array> &inputs) override {
        return quantized_shapes(inputs[0].shape(), bits_, group_size_);
    }

    static std::vector<mx::Shape> quantized_shapes(mx::Shape shape, int bits, int group_size) {
        mx::Shape q = shape, s = shape;
        q.back() = shape.back() * bits / 32;
        s.back() = shape.back() / group_size;
        return {q, s, s};
    }

   private:
    int bits_, group_size_;
    Source source_;
};

/* [q uint32, scales, biases] of `w` as `dtype` (float32 or bfloat16): w [..., cols] float32,
   bfloat16 or float16, or (given block_scales [ceil(rows/128), ceil(cols/128)] float32) FP8 e4m3
   bytes [rows, cols]. */
static std::vector<mx::array> requantize(const mx::array &w, const std::optional<mx::array> &block_scales, int bits,
                                         int group_size, mx::Dtype dtype) {
    auto fail = [](const std::string &why) { throw std::invalid_argument("pipeline requantize: " + why); };
    if (bits < 2 || bits > 8 || bits == 7) fail("bits must be 2, 3, 4, 5, 6 or 8");
    if (group_size != 32 && group_size != 64 && group_size != 128) fail("group size must be 32, 64 or 128");
    if (dtype != mx::float32 && dtype != mx::bfloat16) fail("scales are held as float32 or bfloat16");
    if (w.ndim() < 1 || w.shape(-1) % group_size) fail("rows must be whole groups");
    Source source;
    std::vector<mx::array> inputs{w};
    if (block_scales) {
        if (w.dtype() != mx::uint8 || w.ndim() != 2) fail("FP8 weights are uint8 [rows, cols]");
        const int64_t br = (w.shape(0) + FP8_BLOCK - 1) / FP8_BLOCK, bc = (w.shape(1) + FP8_BLOCK - 1) / FP8_BLOCK;
        if (block_scales->dtype() != mx::float32 || block_scales->ndim() != 2 || block_scales->shape(0) != br ||
            block_scales->shape(1) != bc)
            fail("one float32 scale per 128x128 block");
        source = FROM_FP8;
        inputs.push_back(*block_scales);
    } else if (w.dtype() == mx::float32) {
        source = FROM_F32;
    } else if (w.dtype() == mx::bfloat16) {
        source = FROM_BF16;
    } else if (w.dtype() == mx::float16) {
        source = FROM_F16;
    } else {
        fail("w must be float32, bfloat16 or float16");
    }
    const auto stream = mx::default_stream(mx::Device(mx::Device::cpu));
    return mx::array::make_arrays(Requantize::quantized_shapes(w.shape(), bits, group_size),
                                  {mx::uint32, dtype, dtype},
                                  std::make_shared<Requantize>(stream, bits, group_size, source), inputs);
}

/* ---- GGUF blocks that MLX holds exactly (quants.py's table), repacked -------------------------------------
 * One pass from a GGUF tensor's raw rows to MLX's packed codes and float32 scales and biases
 * (quants.py turns the latter into fp16 where that is exact). numpy did it in 6-10 passes over
 * temporaries: a Llama-1B's Q4_0 file took 2.6 s of CPU to load against 0.07 s to read. Runs on the
 * loader's decoding threads, without the GIL. */

static inline float half_at(const uint8_t *p) {
#if defined(__F16C__)
    uint16_t bits;
    std::memcpy(&bits, p, 2);
    return _cvtsh_ss(bits);
#else
    mx::float16_t h;
    std::memcpy(&h, p, 2);
    return static_cast<float>(h);
#endif
}

/* The 16 bytes of MLX 4-bit codes for 32 values, value v from GGML's nibble block: byte i holds
   value i (low nibble) and value i + 16 (high). MLX byte j holds values 2j (low) and 2j + 1 (high), so
   MLX byte j < 8 is the low nibbles of GGML bytes 2j, 2j + 1 and byte 8 + j their high nibbles: in each
   16-bit word w of the block, (w & 0xF) | (w >> 4 & 0xF0) and (w >> 4 & 0xF) | (w >> 8 & 0xF0). */
static inline void repack_nibbles(const uint8_t *qs, uint8_t *out) {
#if defined(__SSE2__)
    const __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i *>(qs)), low = _mm_set1_epi16(0x0F),
                  high = _mm_set1_epi16(0xF0);
    const __m128i lows = _mm_or_si128(_mm_and_si128(w, low), _mm_and_si128(_mm_srli_epi16(w, 4), high));
    const __m128i highs = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(w, 4), low), _mm_and_si128(_mm_srli_epi16(w, 8), high));
    _mm_storeu_si128(reinterpret_cast<__m128i *>(out), _mm_packus_epi16(lows, highs));
#else
    uint8_t v[32];
    for (int i = 0; i < 16; i++) v[i] = qs[i] & 15, v[i + 16] = qs[i] >> 4;
    for (int j = 0; j < 16; j++) out[j] = uint8_t(v[2 * j] | (v[2 * j + 1] << 4));
#endif
}

enum GgufType { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12 };  // GGML's type numbers

/* Scales and biases out as float32, or as float16 (Q4_0, Q4_1, Q8_0, whose values are the file's fp16
   numbers or one times a power of two: exact unless it overflows): half the bytes, no conversion pass
   after. The rule is quants.decode_exact's: float16 unless a bias overflows it. */
struct ScaleOut {
    void *data;
    bool half;
    bool finite = true;  // half: every value stored is finite
    inline void put(int64_t i, float value) {
        if (!half) {
            static_cast<float *>(data)[i] = value;
            return;
        }
#if defined(__F16C__)
        const uint16_t h = _cvtss_sh(value, _MM_FROUND_TO_NEAREST_INT);  // one instruction: 3x the pass's speed
#else
        uint16_t h;
        const mx::float16_t converted = static_cast<mx::float16_t>(value);
        std::memcpy(&h, &converted, 2);
#endif
        finite = finite && (h & 0x7C00) != 0x7C00;  // not inf or NaN
        static_cast<uint16_t *>(data)[i] = h;
    }
};

static ScaleOut scale_out(nb::ndarray<nb::ndim<2>, nb::c_contig> &a, const char *name) {
    const bool is_float = a.dtype().code == uint8_t(nb::dlpack::dtype_code::Float) && a.dtype().lanes == 1;
    if (is_float && a.dtype().bits == 32) return {a.data(), false};
    if (is_float && a.dtype().bits == 16) return {a.data(), true};
    throw std::invalid_argument(std::string("pipeline gguf_repack: ") + name + " must be float32 or float16");
}

/* Returns false where float16 biases were asked for and one overflows it (a Q8_0 scale over 511 makes a
   bias past float16's range): the caller decodes those rows again into float32. */
static bool gguf_repack(nb::ndarray<const uint8_t, nb::ndim<2>, nb::c_contig> raw, int type,
                        nb::ndarray<uint8_t, nb::ndim<2>, nb::c_contig> weight,
                        nb::ndarray<nb::ndim<2>, nb::c_contig> scales,
                        nb::ndarray<nb::ndim<2>, nb::c_contig> biases) {
    const int block = type == Q4_0 ? 18 : type == Q4_1 ? 20 : type == Q8_0 ? 34 : type == Q4_K ? 144 : 0;
    const int values = type == Q4_K ? 256 : 32, bits = type == Q8_0 ? 8 : 4;
    if (!block) throw std::invalid_argument("pipeline gguf_repack: Q4_0, Q4_1, Q8_0 or Q4_K only");
    const int64_t rows = raw.shape(0), blocks = raw.shape(1) / block, groups = blocks * values / 32;
    if (raw.shape(1) % block || weight.shape(0) != rows || int64_t(weight.shape(1)) != blocks * values * bits / 8 ||
        scales.shape(0) != rows || biases.shape(0) != rows || int64_t(scales.shape(1)) != groups ||
        int64_t(biases.shape(1)) != groups)
        throw std::invalid_argument("pipeline gguf_repack: output shapes do not fit the rows");
    ScaleOut s = scale_out(scales, "scales"), b = scale_out(biases, "biases");
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *in = raw.data() + r * raw.shape(1);
        uint8_t *w = weight.data() + r * weight.shape(1);
        const int64_t at = r * groups;
        for (int64_t k = 0; k < blocks; k++, in += block) {
            switch (type) {
                case Q4_0: {  // w = d (q - 8)
                    const float d = half_at(in);
                    repack_nibbles(in + 2, w + 16 * k);
                    s.put(at + k, d), b.put(at + k, d * -8.0f);
                    break;
                }
                case Q4_1: {  // w = d q + m
                    repack_nibbles(in + 4, w + 16 * k);
                    s.put(at + k, half_at(in)), b.put(at + k, half_at(in + 2));
                    break;
                }
                case Q8_0: {  // w = d q, q int8: MLX's code is q + 128 (the top bit flipped), bias -128 d
                    const float d = half_at(in);
                    for (int i = 0; i < 32; i++) w[32 * k + i] = in[2 + i] ^ 0x80;
                    s.put(at + k, d), b.put(at + k, d * -128.0f);
                    break;
                }
                case Q4_K: {  // w = (d sc_j) q - dmin m_j per 32-value sub-block j
                    const float d = half_at(in), dmin = half_at(in + 2);
                    const uint8_t *sc = in + 4, *qs = in + 16;
                    for (int j = 0; j < 8; j++) {
                        // ggml's get_scale_min_k4: 6-bit scale and min of sub-block j
                        const int scale = j < 4 ? (sc[j] & 63) : ((sc[j + 4] & 15) | ((sc[j - 4] >> 6) << 4));
                        const int min = j < 4 ? (sc[j + 4] & 63) : ((sc[j + 4] >> 4) | ((sc[j] >> 6) << 4));
                        // chunk j/2 of 32 bytes: sub-block 2c in its low nibbles, 2c + 1 in its high ones
                        const uint8_t *chunk = qs + 32 * (j / 2);
                        const int shift = 4 * (j & 1);
                        uint8_t *out = w + 16 * (8 * k + j);
                        for (int i = 0; i < 16; i++)
                            out[i] = uint8_t(((chunk[2 * i] >> shift) & 15) | (((chunk[2 * i + 1] >> shift) & 15) << 4));
                        s.put(at + 8 * k + j, d * float(scale));
                        b.put(at + 8 * k + j, -(dmin * float(min)));
                    }
                    break;
                }
            }
        }
    }
    return b.finite;
}

void register_requantize(nb::module_ &m) {
    m.def("requantize", &requantize, nb::arg("w"), nb::arg("block_scales").none(), nb::arg("bits"),
          nb::arg("group_size"), nb::arg("dtype"),
          "mx.quantize(w as dtype) (w float, or FP8 bytes times their 128x128 block scales), lazily");
    // outputs .noconvert(): a converted (copied) output would be written and lost
    m.def("gguf_repack", &gguf_repack, nb::arg("raw"), nb::arg("type"), nb::arg("weight").noconvert(),
          nb::arg("scales").noconvert(), nb::arg("biases").noconvert(), nb::call_guard<nb::gil_scoped_release>(),
          "GGUF rows (uint8 [rows, bytes]) of GGML type number `type` -> MLX codes (bytes), scales and biases (float32, "
          "or float16: False if a bias overflowed it)");
}
