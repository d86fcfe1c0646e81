/* A decoder layer's small steps as one MLX operation each (custom Primitives): RMSNorm, the rotary
 * position embedding's rotation, and the SwiGLU's silu(gate) * up.
 *
 * Why. On CPU, MLX dispatches each node of a graph alone at ~2-6 us, and these steps were several
 * nodes each: a compiled RMSNorm is a square, a sum and a fused elementwise kernel (24 us a call,
 * 61 calls per SmolLM2 decode step), a RoPE of q and k a concatenation, slices, two fused
 * kernels, another concatenation and the reshapes around them. One node each.
 *
 * Batch invariance. Every row (a token, or a token's head) is computed alone, in one fixed order:
 * RMSNorm sums x*x in 16 lanes (fma, in order over the features) and then over the lanes in the
 * one tree of kernels_common.h; the rotation is two products and a difference or sum per pair, no
 * fused multiply-adds (built with -ffp-contract=off). So a token's result does not depend on the
 * other rows of the call. The SwiGLU is elementwise, and has MLX's own bits (see SwiGLU).
 */
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/backend/common/utils.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/backend/cpu/unary_ops.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"

#include "kernels_common.h"

namespace nb = nanobind;

static mx::Stream cpu() { return mx::default_stream(mx::Device(mx::Device::cpu)); }

/* out = x / sqrt(mean(x^2) + eps) * weight, row by row over the last axis. */
class RmsNorm : public mx::UnaryPrimitive {
   public:
    RmsNorm(mx::Stream stream, float eps) : mx::UnaryPrimitive(stream), eps_(eps) {}

    void eval_cpu(const std::vector<mx::array> &inputs, mx::array &out) override {
        out.set_data(mx::allocator::malloc(out.nbytes()));
        auto &encoder = mx::cpu::get_command_encoder(stream());
        for (auto &a : inputs) encoder.set_input_array(a);
        encoder.set_output_array(out);
        encoder.dispatch([inputs, out, eps = eps_]() mutable {
            std::vector<mx::array> keep;
            const mx::array x = contiguous(inputs[0], keep), w = contiguous(inputs[1], keep);
            const int64_t n = x.shape(-1), rows = n ? int64_t(x.size()) / n : 0;
            const float *xd = x.data<float>(), *wd = w.data<float>();
            float *od = out.data<float>();
            const int64_t body = n / 16 * 16;
            for (int64_t r = 0; r < rows; r++) {
                const float *xr = xd + r * n;
                float *o = od + r * n;
                v16 acc{};
                for (int64_t i = 0; i < body; i += 16) {
                    const v16 v = load16(xr + i);
                    acc = fma16(v, v, acc);
                }
                float squares = lanes_sum(acc);
                for (int64_t i = body; i < n; i++) squares += xr[i] * xr[i];
                const float scale = 1.0f / std::sqrt(squares / float(n) + eps);
                const v16 s = splat(scale);
                for (int64_t i = 0; i < body; i += 16) store16(o + i, (load16(xr + i) * s) * load16(wd + i));
                for (int64_t i = body; i < n; i++) o[i] = (xr[i] * scale) * wd[i];
            }
        });
    }

    void eval_gpu(const std::vector<mx::array> &, mx::array &) override {
        throw std::runtime_error("pipeline's RMSNorm kernel runs on the CPU only");
    }

    const char *name() const override { return "PipelineRmsNorm"; }

    bool is_equivalent(const mx::Primitive &other) const override {
        auto *o = dynamic_cast<const RmsNorm *>(&other);
        return o && o->eps_ == eps_;
    }

    std::vector<mx::Shape> output_shapes(const std::vector<mx::array> &inputs) override { return {inputs[0].shape()}; }

   private:
    float eps_;
};

/* The rotation of RoPE for several [tokens, heads_i, d] arrays at once, written side by side as
   [tokens, sum(heads_i), d]: token t's first `dims` features turn by its own angles (cos and sin
   [tokens, dims / 2]), as rotate-half pairs (i, i + dims/2) or interleaved pairs (2i, 2i + 1)
   (`traditional`); features past `dims` pass through; all times `factor` unless it is 1. */
class RopeRotation : public mx::UnaryPrimitive {
   public:
    RopeRotation(mx::Stream stream, int dims, bool traditional, float factor)
        : mx::UnaryPrimitive(stream), dims_(dims), traditional_(traditional), factor_(factor) {}

    void eval_cpu(const std::vector<mx::array> &inputs, mx::array &out) override {
        out.set_data(mx::allocator::malloc(out.nbytes()));
        auto &encoder = mx::cpu::get_command_encoder(stream());
        for (auto &a : inputs) encoder.set_input_array(a);
        encoder.set_output_array(out);
        encoder.dispatch([inputs, out, dims = dims_, traditional = traditional_, factor = factor_]() mutable {
            std::vector<mx::array> keep;
            const size_t parts = inputs.size() - 2;
            const mx::array cos = contiguous(inputs[parts], keep), sin = contiguous(inputs[parts + 1], keep);
            const int64_t tokens = out.shape(0), heads = out.shape(1), d = out.shape(2), half = dims / 2;
            float *od = out.data<float>();
            int64_t head0 = 0;
            for (size_t p = 0; p < parts; p++) {
                const mx::array &x = inputs[p];  // any strides; the last is 1 (checked at the call)
                const int64_t hp = x.shape(1), st = x.strides()[0], sh = x.strides()[1];
                const float *xd = x.data<float>();
                for (int64_t t = 0; t < tokens; t++) {
                    const float *c = cos.data<float>() + t * half, *s = sin.data<float>() + t * half;
                    for (int64_t h = 0; h < hp; h++) {
                        const float *xr = xd + t * st + h * sh;
                        float *o = od + (t * heads + head0 + h) * d;
                        for (int64_t i = 0; i < half; i++) {
                            const int64_t a = traditional ? 2 * i : i, b = traditional ? 2 * i + 1 : i + half;
                            const float x1 = xr[a], x2 = xr[b];
                            const float r1 = x1 * c[i] - x2 * s[i], r2 = x1 * s[i] + x2 * c[i];
                            o[a] = factor != 1.0f ? r1 * factor : r1;
                            o[b] = factor != 1.0f ? r2 * factor : r2;
                        }
                        for (int64_t i = dims; i < d; i++) o[i] = factor != 1.0f ? xr[i] * factor : xr[i];
                    }
                }
                head0 += hp;
            }
        });
    }

    void eval_gpu(const std::vector<mx::array> &, mx::array &) override {
        throw std::runtime_error("pipeline's RoPE kernel runs on the CPU only");
    }

    const char *name() const override { return "PipelineRope"; }

    bool is_equivalent(const mx::Primitive &other) const override {
        auto *o = dynamic_cast<const RopeRotation *>(&other);
        return o && o->dims_ == dims_ && o->traditional_ == traditional_ && o->factor_ == factor_;
    }

    std::vector<mx::Shape> output_shapes(const std::vector<mx::array> &inputs) override {
        int heads = 0;
        for (size_t p = 0; p + 2 < inputs.size(); p++) heads += inputs[p].shape(1);
        return {mx::Shape{inputs[0].shape(0), heads, inputs[0].shape(2)}};
    }

   private:
    int dims_;
    bool traditional_;
    float factor_;
};

/* ---- SwiGLU -------------------------------------------------------------------------------------------
   out = gate * sigmoid(gate) * up with MLX's bits: nn.silu(gate) * up is x * mx.sigmoid(x), then times up, and
   MLX's CPU Sigmoid (mlx/backend/cpu/unary_ops.h) is 1 / (1 + exp(|x|)), or 1 minus it for x >= 0, with its
   own exp (simd/math.h: a degree-6 polynomial in fma of the fraction, times 2^ipart made from the exponent's
   bits, inf past 88). Where MLX's Simd is one lane wide (x86), MLX computes that one element at a time
   (mx.compile's kernel of it too, with a call to exp and to fmaf per element: ~16 ns an element, 8% of a
   Q4_K_M SmolLM2's `pipeline batch`); sigmoid16 is the same arithmetic 16 lanes at once, step for step:
     - exp's ipart is floor(x + 0.5) summed in double (x + 0.5 with x a Simd<float, 1> is a double): here
       floor(x) (x >= 0: truncation) plus one where x - floor(x) >= 0.5 (exact), the same integer for every
       x up to 88 * log2(e) (a float sum would differ at x = 0.5 - 2^-25 alone, which |g| * log2(e) never is);
     - the lanes past 88 and the NaNs, which MLX replaces by inf and by the NaN, are replaced the same (their
       truncation is of a stand-in 0, not undefined);
     - fma is one rounding in both (fma16), the division is IEEE's in both, the rest plain float operations in
       MLX's order.
   Checked equal, bit for bit, to mx::detail::Sigmoid for every one of the 2^32 float32 values of the gate
   (AVX-512 and AVX2), and to MLX's own results (tests/test_layer_kernels.py). Elsewhere (MLX's Simd wider
   than one lane, as with NEON, or no FMA) every element goes through mx::detail::Sigmoid itself, as the tail
   past the last 16 does here. */
#if (defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__)))
#define PIPELINE_SWIGLU_VECTORS 1
static inline v16 select16(i32x16 mask, v16 a, v16 b) {  // a where mask (all ones), else b
    return (v16)((mask & (i32x16)a) | (~mask & (i32x16)b));
}

static inline v16 sigmoid16(v16 g) {
    const v16 a = (v16)((i32x16)g & 0x7fffffff);   // abs(x)
    const v16 x = a * 1.442695f;                     // exp(a): a * log2(e) ...
    const v16 xc = select16(x < 128.0f, x, splat(0.0f));  // (the lanes past 88 and the NaNs: replaced below)
    const i32x16 t = __builtin_convertvector(xc, i32x16);
    const i32x16 half_up = (xc - __builtin_convertvector(t, v16)) >= 0.5f;  // -1 where the fraction >= 0.5
    const i32x16 ipart = t - half_up;                // floor(x + 0.5)
    const v16 fpart = x - __builtin_convertvector(ipart, v16);
    v16 p = splat(1.535336188319500e-4f);
    p = fma16(p, fpart, splat(1.339887440266574e-3f));
    p = fma16(p, fpart, splat(9.618437357674640e-3f));
    p = fma16(p, fpart, splat(5.550332471162809e-2f));
    p = fma16(p, fpart, splat(2.402264791363012e-1f));
    p = fma16(p, fpart, splat(6.931472028550421e-1f));
    p = fma16(p, fpart, splat(1.000000000000000f));
    v16 e = (v16)((ipart + 127) << 23) * p;         // 2^ipart * p
    e = select16(a != a, a, e);                      // NaN: the NaN
    e = select16(a > 88.0f, splat(__builtin_inff()), e);
    const v16 y = 1.0f / (1.0f + e);
    return select16(g < 0.0f, y, 1.0f - y);
}
#else
#define PIPELINE_SWIGLU_VECTORS 0
#endif

/* o[i] = g[i] * sigmoid(g[i]) * u[i] for i < n (o may be g); kernels_common.h declares it for the fused int8
   SwiGLUs (int8_kernels.cpp). */
void swiglu_span(const float *g, const float *u, float *o, int64_t n) {
    int64_t i = 0;
#if PIPELINE_SWIGLU_VECTORS
    if constexpr (mx::simd::max_size<float> == 1) {  // MLX's Sigmoid one element at a time: the arithmetic above
        for (; i + 16 <= n; i += 16) {
            const v16 gv = load16(g + i);
            store16(o + i, (gv * sigmoid16(gv)) * load16(u + i));
        }
    }
#endif
    mx::detail::Sigmoid sigmoid;
    for (; i < n; i++) o[i] = g[i] * sigmoid(g[i]) * u[i];
}

constexpr int64_t SWIGLU_THREADED_MIN = int64_t(1) << 16;  // elements (~40 us alone): fewer, one thread
constexpr int64_t SWIGLU_CHUNK = 4096;

class SwiGLU : public mx::UnaryPrimitive {
   public:
    explicit SwiGLU(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

    void eval_cpu(const std::vector<mx::array> &inputs, mx::array &out) override {
        const mx::array &gate = inputs[0];
        // the gate's buffer where MLX's elementwise ops would take it (no other holder, not much larger)
        if (gate.flags().row_contiguous && mx::is_donatable(gate, out))
            out.copy_shared_buffer(gate);
        else
            out.set_data(mx::allocator::malloc(out.nbytes()));
        auto &encoder = mx::cpu::get_command_encoder(stream());
        for (auto &a : inputs) encoder.set_input_array(a);
        encoder.set_output_array(out);
        encoder.dispatch([inputs, out]() mutable {
            std::vector<mx::array> keep;
            const mx::array g = contiguous(inputs[0], keep), u = contiguous(inputs[1], keep);
            const float *gd = g.data<float>(), *ud = u.data<float>();
            float *od = out.data<float>();
            const int64_t n = int64_t(out.size()), chunks = (n + SWIGLU_CHUNK - 1) / SWIGLU_CHUNK;
            const bool threaded = g_threads > 1 && n >= SWIGLU_THREADED_MIN;
#pragma omp parallel for schedule(static) num_threads(g_threads) if (threaded)
            for (int64_t c = 0; c < chunks; c++) {
                const int64_t b = c * SWIGLU_CHUNK;
                swiglu_span(gd + b, ud + b, od + b, std::min(SWIGLU_CHUNK, n - b));
            }
        });
    }

    void eval_gpu(const std::vector<mx::array> &, mx::array &) override {
        throw std::runtime_error("pipeline's SwiGLU kernel runs on the CPU only");
    }

    const char *name() const override { return "PipelineSwiGLU"; }

    bool is_equivalent(const mx::Primitive &other) const override { return dynamic_cast<const SwiGLU *>(&other); }

    std::vector<mx::Shape> output_shapes(const std::vector<mx::array> &inputs) override { return {inputs[0].shape()}; }
};

static mx::array rms_norm(const mx::array &x, const mx::array &weight, float eps) {
    if (x.dtype() != mx::float32 || weight.dtype() != mx::float32 || x.ndim() < 1 || weight.ndim() != 1 ||
        weight.shape(0) != x.shape(-1))
        throw std::invalid_argument("pipeline rms_norm: float32 x [..., n] and weight [n]");
    return mx::array(x.shape(), mx::float32, std::make_shared<RmsNorm>(cpu(), eps), {x, weight});
}

static mx::array rope(const std::vector<mx::array> &parts, const mx::array &cos, const mx::array &sin, int dims,
                      bool traditional, float factor) {
    auto fail = [](const std::string &why) { throw std::invalid_argument("pipeline rope: " + why); };
    if (parts.empty()) fail("nothing to rotate");
    const int64_t tokens = parts[0].shape(0), d = parts[0].ndim() == 3 ? parts[0].shape(2) : 0;
    int heads = 0;
    for (const auto &x : parts) {
        if (x.ndim() != 3 || x.dtype() != mx::float32 || x.shape(0) != tokens || x.shape(2) != d ||
            x.strides().back() != 1)
            fail("each part float32 [tokens, heads, d], the features contiguous");
        heads += x.shape(1);
    }
    if (dims <= 0 || dims % 2 || dims > d) fail("dims must be even and at most the head size");
    if (cos.dtype() != mx::float32 || sin.dtype() != mx::float32 || int64_t(cos.size()) != tokens * (dims / 2) ||
        sin.size() != cos.size())
        fail("cos and sin float32 with dims / 2 angles per token");
    std::vector<mx::array> inputs(parts.begin(), parts.end());
    inputs.push_back(cos);
    inputs.push_back(sin);
    return mx::array(mx::Shape{int(tokens), heads, int(d)}, mx::float32,
                     std::make_shared<RopeRotation>(cpu(), dims, traditional, factor), inputs);
}

static mx::array swiglu(const mx::array &gate, const mx::array &up) {
    if (gate.dtype() != mx::float32 || up.dtype() != mx::float32 || gate.shape() != up.shape())
        throw std::invalid_argument("pipeline swiglu: float32 gate and up of one shape");
    return mx::array(gate.shape(), mx::float32, std::make_shared<SwiGLU>(cpu()), {gate, up});
}

void register_layer_kernels(nb::module_ &m) {
    m.def("rms_norm", &rms_norm, nb::arg("x"), nb::arg("weight"), nb::arg("eps"),
          "x [..., n] / sqrt(mean(x^2) + eps) * weight, lazily");
    m.def("rope", &rope, nb::arg("parts"), nb::arg("cos"), nb::arg("sin"), nb::arg("dims"), nb::arg("traditional"),
          nb::arg("factor"), "RoPE's rotation of [tokens, heads_i, d] parts -> [tokens, sum heads_i, d], lazily");
    m.def("swiglu", &swiglu, nb::arg("gate"), nb::arg("up"),
          "gate * sigmoid(gate) * up with MLX's bits (nn.silu(gate) * up), lazily");
}
