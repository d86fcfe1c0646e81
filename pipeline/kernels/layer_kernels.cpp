/* A decoder layer's small steps as one MLX operation each (custom Primitives): RMSNorm and the rotary
 * position embedding's rotation.
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
 * other rows of the call.
 */
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
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

void register_layer_kernels(nb::module_ &m) {
    m.def("rms_norm", &rms_norm, nb::arg("x"), nb::arg("weight"), nb::arg("eps"),
          "x [..., n] / sqrt(mean(x^2) + eps) * weight, lazily");
    m.def("rope", &rope, nb::arg("parts"), nb::arg("cos"), nb::arg("sin"), nb::arg("dims"), nb::arg("traditional"),
          nb::arg("factor"), "RoPE's rotation of [tokens, heads_i, d] parts -> [tokens, sum heads_i, d], lazily");
}
