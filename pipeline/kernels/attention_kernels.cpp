/* Attention over KV caches for a whole batch in one MLX operation (a custom Primitive), each query
 * rounded the same whatever else shares the call.
 *
 * What it computes. Sequence s has its new tokens' queries q[r] (rows q_begin[s]..q_begin[s+1] of q,
 * [rows, heads, dk]) and a cache of key_len[s] keys and values ([kv heads, positions, dk] and
 * [kv heads, positions, dv]: its new tokens' already appended, so they are the last rows). Query
 * row r is at position p = key_len - (its sequence's new rows) + (its place among them) and sees
 * keys 0..p (causal); head h reads kv head h / (heads / kv heads) (grouped-query attention):
 *     out[r, h] = sum_j softmax_j(scale * q[r, h] . k[j]) v[j]        (j = 0..p)
 * written token-major, [rows, heads * dv], ready for the output projection.
 *
 * Why a kernel. MLX's CPU scaled_dot_product_attention is a chain of small ops, called once per
 * sequence and layer: a 16-sequence decode step of SmolLM2 spent 65 of its 155 ms there, dispatching.
 * Here one op per layer covers every sequence of the step, its caches read where they are.
 *
 * Batch invariance. Each score is one fixed sequence of float operations: 16-lane FMAs over the
 * head dimension in order, then the lanes' one summation tree (kernels_common.h), times the scale.
 * The softmax takes the exact maximum, a 16-lane exponential (exp16 below, the same on every
 * call), sums the exponentials 16 lanes at a time in position order and then over the lanes;
 * each output element accumulates weight * value over the positions in order, then is divided by
 * that sum. None of it depends on the other rows, heads, sequences, tiles or threads, so a query
 * rounds the same alone (decoding), in a prompt's chunk (prefill, a prefix-cache hit's suffix) or
 * in a speculative draft being verified, and batches equal `generate`.
 */
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"

#include "kernels_common.h"

namespace nb = nanobind;

/* exp(x) for x <= 0 in 16 lanes (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-7 polynomial
   for e^r, times 2^n built in the exponent bits): within 2 ulp of expf, and exactly 0 below -87
   (e^-87 is near float's smallest normal), so the padding past a row's last key adds nothing. */
static inline v16 exp16(v16 x) {
    const i32x16 keep = x >= splat(-87.0f);
    x = (v16)(((i32x16)x & keep) | ((i32x16)splat(-87.0f) & ~keep));
    const v16 shifter = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
    const v16 t = fma16(x, splat(1.44269504088896341f), shifter);
    const v16 n = t - shifter;
    v16 r = fma16(n, splat(-0.693359375f), x);
    r = fma16(n, splat(2.12194440e-4f), r);
    v16 p = splat(1.9875691500e-4f);
    p = fma16(p, r, splat(1.3981999507e-3f));
    p = fma16(p, r, splat(8.3334519073e-3f));
    p = fma16(p, r, splat(4.1665795894e-2f));
    p = fma16(p, r, splat(1.6666665459e-1f));
    p = fma16(p, r, splat(5.0000001201e-1f));
    p = fma16(p, r * r, r) + splat(1.0f);
    const i32x16 two_n = ((i32x16)t - (i32x16)shifter + 127) << 23;
    return (v16)((i32x16)(p * (v16)two_n) & keep);
}

/* One sequence's cache: element (kv head g, position j, i) of keys at k + g * k_head + j * k_pos + i. */
struct Cache {
    const float *k, *v;
    int64_t k_head, k_pos, v_head, v_pos, len;
};

constexpr int HEADS_PER_TILE = 4;  // query heads sharing a kv head computed together: each key read once for 4
constexpr int OUT_BLOCK = 64;      // output elements accumulated at a time (4 vectors per head)

/* Query row `q_row` (all heads, head stride q_head) at a position that sees m keys: the `rep` heads
   of kv head g, into out_row. scores: room for HEADS_PER_TILE * padded m floats. */
static void attend_row(const float *q_row, int64_t q_head, int rep, int64_t g, const Cache &c, int64_t m,
                       int64_t dk, int64_t dv, float scale, float *out_row, float *scores) {
    const int64_t padded = (m + 15) / 16 * 16;
    const float *K = c.k + g * c.k_head, *V = c.v + g * c.v_head;
    for (int h0 = 0; h0 < rep; h0 += HEADS_PER_TILE) {
        const int R = std::min(HEADS_PER_TILE, rep - h0);
        const float *q[HEADS_PER_TILE];
        for (int r = 0; r < R; r++) q[r] = q_row + (g * rep + h0 + r) * q_head;
        // scores: each key read once for the tile's heads
        for (int64_t j = 0; j < m; j++) {
            const float *kj = K + j * c.k_pos;
            v16 acc[HEADS_PER_TILE] = {};
            for (int64_t i = 0; i < dk; i += 16) {
                const v16 kv = load16(kj + i);
                for (int r = 0; r < R; r++) acc[r] = fma16(load16(q[r] + i), kv, acc[r]);
            }
            for (int r = 0; r < R; r++) scores[r * padded + j] = lanes_sum(acc[r]) * scale;
        }
        // softmax weights, unnormalized, and their sums
        float total[HEADS_PER_TILE];
        for (int r = 0; r < R; r++) {
            float *s = scores + r * padded;
            for (int64_t j = m; j < padded; j++) s[j] = -1e30f;  // exp16 makes them exactly 0
            v16 top = splat(-1e30f);
            for (int64_t j = 0; j < padded; j += 16) {
                const v16 x = load16(s + j);
                top = x > top ? x : top;
            }
            float mx_ = -1e30f;
            for (int i = 0; i < 16; i++) mx_ = std::max(mx_, top[i]);
            const v16 shift = splat(mx_);
            v16 sum{};
            for (int64_t j = 0; j < padded; j += 16) {
                const v16 e = exp16(load16(s + j) - shift);
                store16(s + j, e);
                sum += e;
            }
            total[r] = lanes_sum(sum);
        }
        // weighted values, OUT_BLOCK outputs at a time: each value row read once for the tile's heads
        for (int64_t o0 = 0; o0 < dv; o0 += OUT_BLOCK) {
            const int vecs = int(std::min<int64_t>(OUT_BLOCK, dv - o0) / 16);
            v16 acc[HEADS_PER_TILE][OUT_BLOCK / 16] = {};
            for (int64_t j = 0; j < m; j++) {
                const float *vj = V + j * c.v_pos + o0;
                v16 vv[OUT_BLOCK / 16];
                for (int i = 0; i < vecs; i++) vv[i] = load16(vj + 16 * i);
                for (int r = 0; r < R; r++) {
                    const v16 w = splat(scores[r * padded + j]);
                    for (int i = 0; i < vecs; i++) acc[r][i] = fma16(w, vv[i], acc[r][i]);
                }
            }
            for (int r = 0; r < R; r++) {
                const v16 inv = splat(total[r]);
                float *o = out_row + (h0 + r) * dv + o0;
                for (int i = 0; i < vecs; i++) store16(o + 16 * i, acc[r][i] / inv);
            }
        }
    }
}

/* Below this many multiply-adds a call runs on one thread. A decoding step's attention (one query row:
   SmolLM2's 9 heads over a 300-token cache are 0.35 M) stays on one thread: waking the other for ~30 calls
   a step took the core that the Python thread builds the next step's graph on. Measured on the 2-core
   Zen 4, SmolLM2 decode with --int8-activations, 1 rank, 2 threads: 60-80 tok/s at 2^16, 100-110 at 2^22
   (prefill the same, ~900 tok/s); the 1B Llama's decode (32 heads, 1.35 M) 34-37 tok/s either way.
   Prompt chunks and batches of many sequences are far above it. */
constexpr int64_t THREADED_MIN_WORK = int64_t(1) << 22;
/* ... and this many where a sequence has several query rows (a speculative draft being verified): there
   Python waits for the result rather than building the next step, and the rows are the whole step's
   work. SmolLM2 int8, 1 rank x 2 threads, a 300-token cache, a trip of 9 / 5 positions: 24.3-26.3 ->
   20.2-21.2 ms / 16.1-17.7 -> 14.8-15.6 ms; one position the same. */
constexpr int64_t THREADED_MIN_WORK_DRAFTS = int64_t(1) << 20;

/* Inputs: q [rows, heads, dk] (any strides but the last), then each sequence's keys, then each one's
   values ([..., kv heads, positions, d], positions past key_len unused). Output [rows, heads * dv].
   Appending (attend_and_append): the inputs also hold the step's new keys and values after q
   ([new rows, kv heads, d], sequence s's rows new_begin[s]..new_begin[s+1]), and the outputs after
   the attention are each cache with them written at positions offset[s]..: the cache's buffer itself
   where nothing else holds it (as MLX's slice update donates it), else a copy. One operation then
   does a step's whole KV cache work for every sequence, where the slice updates were 6 nodes per
   sequence and layer. */
class CachedAttention : public mx::Primitive {
   public:
    CachedAttention(mx::Stream stream, std::vector<int64_t> q_begin, std::vector<int64_t> key_len, float scale,
                    std::vector<int64_t> new_begin = {})
        : mx::Primitive(stream), q_begin_(std::move(q_begin)), key_len_(std::move(key_len)), scale_(scale),
          new_begin_(std::move(new_begin)) {}

    void eval_cpu(const std::vector<mx::array> &inputs, std::vector<mx::array> &outputs) override {
        const size_t nseq = key_len_.size();
        const bool appends = !new_begin_.empty();
        const size_t first_cache = appends ? 3 : 1;
        outputs[0].set_data(mx::allocator::malloc(outputs[0].nbytes()));
        std::vector<char> copy(appends ? 2 * nseq : 0, 0);
        for (size_t i = 0; i < copy.size(); i++) {
            const mx::array &in = inputs[first_cache + i];
            mx::array &out = outputs[1 + i];
            // The buffer is updated in place when no other array shares it (a view, such as a prefix-cache
            // fork's, shares it). MLX's own test, is_donatable(), also wants this node to hold the input's
            // only reference, never true with several outputs (each holds the inputs). Whoever else holds
            // this very array sees its positions below the offset unchanged: only positions past it,
            // unused until now, are written.
            if (sole_owned_buffer(in) && in.flags().row_contiguous && in.buffer_size() == out.nbytes()) {
                out.copy_shared_buffer(in);
            } else {
                out.set_data(mx::allocator::malloc(out.nbytes()));
                copy[i] = 1;
            }
        }
        auto &encoder = mx::cpu::get_command_encoder(stream());
        for (auto &a : inputs) encoder.set_input_array(a);
        for (auto &a : outputs) encoder.set_output_array(a);
        encoder.dispatch([inputs, outputs, copy, q_begin = q_begin_, key_len = key_len_, scale = scale_,
                          new_begin = new_begin_, first_cache, appends]() mutable {
            std::vector<mx::array> keep;
            const size_t nseq = key_len.size();
            mx::array q = inputs[0];
            if (q.strides().back() != 1) q = contiguous(q, keep);
            const int64_t heads = q.shape(1), dk = q.shape(2);
            if (appends) write_new_positions(inputs, outputs, copy, new_begin, key_len, first_cache, keep);
            std::vector<Cache> caches(nseq);
            int64_t kv_heads = 0, dv = 0, work = 0, longest = 0, most_rows = 0;
            for (size_t s = 0; s < nseq; s++) {
                mx::array k = appends ? outputs[1 + s] : inputs[1 + s];
                mx::array v = appends ? outputs[1 + nseq + s] : inputs[1 + nseq + s];
                if (k.strides().back() != 1) k = contiguous(k, keep);
                if (v.strides().back() != 1) v = contiguous(v, keep);
                const int nd = k.ndim();
                kv_heads = k.shape(nd - 3);
                dv = v.shape(-1);
                caches[s] = Cache{k.data<float>(), v.data<float>(), int64_t(k.strides()[nd - 3]),
                                  int64_t(k.strides()[nd - 2]), int64_t(v.strides()[v.ndim() - 3]),
                                  int64_t(v.strides()[v.ndim() - 2]), key_len[s]};
                const int64_t rows = q_begin[s + 1] - q_begin[s];
                work += rows * key_len[s] * heads * (dk + dv);
                most_rows = std::max(most_rows, rows);
                longest = std::max(longest, key_len[s]);
            }
            const int rep = int(heads / kv_heads);
            struct Task {
                int64_t seq, row, g;
            };
            std::vector<Task> tasks;
            for (size_t s = 0; s < nseq; s++)
                for (int64_t r = q_begin[s]; r < q_begin[s + 1]; r++)
                    for (int64_t g = 0; g < kv_heads; g++) tasks.push_back(Task{int64_t(s), r, g});
            const float *qd = q.data<float>();
            const int64_t q_row = q.strides()[0], q_head = q.strides()[1];
            float *o = outputs[0].data<float>();
            const int64_t ntasks = int64_t(tasks.size());
            const bool threaded = g_threads > 1 && ntasks > 1 &&
                                  work >= (most_rows > 1 ? THREADED_MIN_WORK_DRAFTS : THREADED_MIN_WORK);
#pragma omp parallel num_threads(g_threads) if (threaded)
            {
                std::vector<float> scores(HEADS_PER_TILE * ((longest + 15) / 16 * 16));
#pragma omp for schedule(dynamic, 1)
                for (int64_t t = 0; t < ntasks; t++) {
                    const Task &task = tasks[t];
                    const Cache &c = caches[task.seq];
                    const int64_t rows = q_begin[task.seq + 1] - q_begin[task.seq];
                    const int64_t m = c.len - rows + (task.row - q_begin[task.seq]) + 1;  // keys this query sees
                    attend_row(qd + task.row * q_row, q_head, rep, task.g, c, m, dk, dv, scale,
                               o + task.row * heads * dv + task.g * rep * dv, scores.data());
                }
            }
        });
    }

    void eval_gpu(const std::vector<mx::array> &, std::vector<mx::array> &) override {
        throw std::runtime_error("pipeline's attention kernel runs on the CPU only");
    }

    const char *name() const override { return new_begin_.empty() ? "PipelineCachedAttention" : "PipelineAttendAppend"; }

    bool is_equivalent(const mx::Primitive &other) const override {
        auto *o = dynamic_cast<const CachedAttention *>(&other);
        return o && o->q_begin_ == q_begin_ && o->key_len_ == key_len_ && o->scale_ == scale_ &&
               o->new_begin_ == new_begin_;
    }

    std::vector<mx::Shape> output_shapes(const std::vector<mx::array> &inputs) override {
        const size_t nseq = key_len_.size(), first_cache = new_begin_.empty() ? 1 : 3;
        std::vector<mx::Shape> shapes{
            mx::Shape{inputs[0].shape(0), inputs[0].shape(1) * inputs[first_cache + nseq].shape(-1)}};
        if (!new_begin_.empty())
            for (size_t i = 0; i < 2 * nseq; i++) shapes.push_back(inputs[first_cache + i].shape());
        return shapes;
    }

   private:
    /* Each cache output: the input's positions (copied where the buffer was not donated), then the
       sequence's new keys or values at positions key_len - new rows, ... */
    static void write_new_positions(const std::vector<mx::array> &inputs, std::vector<mx::array> &outputs,
                                    const std::vector<char> &copy, const std::vector<int64_t> &new_begin,
                                    const std::vector<int64_t> &key_len, size_t first_cache,
                                    std::vector<mx::array> &keep) {
        const size_t nseq = key_len.size();
        for (size_t i = 0; i < 2 * nseq; i++) {
            const size_t s = i % nseq;
            mx::array &out = outputs[1 + i];
            if (copy[i]) {
                const mx::array whole = contiguous(inputs[first_cache + i], keep);
                std::memcpy(out.data<float>(), whole.data<float>(), out.nbytes());
            }
            mx::array fresh = inputs[i < nseq ? 1 : 2];  // [new rows, kv heads, d]
            if (fresh.strides().back() != 1) fresh = contiguous(fresh, keep);
            const int nd = out.ndim();
            const int64_t kv_heads = out.shape(nd - 3), d = out.shape(nd - 1);
            const int64_t head_stride = out.shape(nd - 2) * d;  // out is row-contiguous
            const int64_t rows = new_begin[s + 1] - new_begin[s], first = key_len[s] - rows;
            float *od = out.data<float>();
            const float *fd = fresh.data<float>();
            for (int64_t r = 0; r < rows; r++)
                for (int64_t g = 0; g < kv_heads; g++)
                    std::memcpy(od + g * head_stride + (first + r) * d,
                                fd + (new_begin[s] + r) * fresh.strides()[0] + g * fresh.strides()[1], d * sizeof(float));
        }
    }

    std::vector<int64_t> q_begin_, key_len_;
    float scale_;
    std::vector<int64_t> new_begin_;
};

/* Refuses calls the kernel would read out of bounds for (one line, as a ValueError in Python). */
static void check(const mx::array &q, const std::vector<mx::array> &keys, const std::vector<mx::array> &values,
                  const std::vector<int64_t> &q_begin, const std::vector<int64_t> &key_len) {
    auto fail = [](const std::string &why) { throw std::invalid_argument("pipeline attention: " + why); };
    const size_t nseq = keys.size();
    if (nseq == 0 || values.size() != nseq || key_len.size() != nseq || q_begin.size() != nseq + 1)
        fail("one keys, values and key length per sequence, and q_begin of one more");
    if (q.ndim() != 3 || q.dtype() != mx::float32) fail("q must be float32 [rows, heads, dk]");
    const int64_t heads = q.shape(1), dk = q.shape(2), dv = values[0].shape(-1);
    if (dk % 16 || dv % 16) fail("head dimensions must be multiples of 16");
    if (q_begin[0] != 0 || q_begin[nseq] != q.shape(0)) fail("q_begin must span q's rows");
    const int64_t kv_heads = keys[0].ndim() >= 3 ? keys[0].shape(-3) : 0;
    if (kv_heads <= 0 || heads % kv_heads) fail("heads must be a multiple of the kv heads");
    std::vector<mx::array> inputs{q};
    for (size_t s = 0; s < nseq; s++) {
        const mx::array &k = keys[s], &v = values[s];
        const int64_t rows = q_begin[s + 1] - q_begin[s];
        if (k.dtype() != mx::float32 || v.dtype() != mx::float32 || k.ndim() < 3 || v.ndim() < 3)
            fail("keys and values must be float32 [..., kv heads, positions, d]");
        if (k.shape(-3) != kv_heads || v.shape(-3) != kv_heads || k.shape(-1) != dk || v.shape(-1) != dv)
            fail("every sequence's keys and values must have the same heads and dimensions");
        if (k.size() / (k.shape(-3) * k.shape(-2) * dk) != 1 || v.size() / (v.shape(-3) * v.shape(-2) * dv) != 1)
            fail("one sequence per keys/values array");
        if (rows < 0 || key_len[s] < rows || key_len[s] > k.shape(-2) || key_len[s] > v.shape(-2))
            fail("key_len must cover the sequence's new rows and fit its cache");
    }
}

static mx::array cached_attention(const mx::array &q, const std::vector<mx::array> &keys,
                                  const std::vector<mx::array> &values, const std::vector<int64_t> &q_begin,
                                  const std::vector<int64_t> &key_len, float scale) {
    check(q, keys, values, q_begin, key_len);
    std::vector<mx::array> inputs{q};
    for (const auto &k : keys) inputs.push_back(k);
    for (const auto &v : values) inputs.push_back(v);
    return mx::array::make_arrays({mx::Shape{q.shape(0), q.shape(1) * values[0].shape(-1)}}, {mx::float32},
                                  std::make_shared<CachedAttention>(mx::default_stream(mx::Device(mx::Device::cpu)),
                                                                    q_begin, key_len, scale),
                                  inputs)[0];
}

/* The step's new keys and values written into each sequence's cache (which must have room past
   offsets[s] for them) and the queries attended over the result: [attention output, each cache's keys
   after, each one's values after]. */
static std::vector<mx::array> attend_and_append(const mx::array &q, const mx::array &new_keys,
                                                const mx::array &new_values, const std::vector<mx::array> &keys,
                                                const std::vector<mx::array> &values,
                                                const std::vector<int64_t> &q_begin,
                                                const std::vector<int64_t> &new_begin,
                                                const std::vector<int64_t> &offsets, float scale) {
    auto fail = [](const std::string &why) { throw std::invalid_argument("pipeline attention: " + why); };
    const size_t nseq = keys.size();
    if (new_begin.size() != nseq + 1 || offsets.size() != nseq) fail("new_begin of one more than the sequences, one offset each");
    if (new_keys.ndim() != 3 || new_values.ndim() != 3 || new_keys.dtype() != mx::float32 ||
        new_values.dtype() != mx::float32 || new_keys.shape(0) != new_values.shape(0) ||
        new_begin[0] != 0 || new_begin[nseq] != new_keys.shape(0))
        fail("new keys and values float32 [new rows, kv heads, d], spanned by new_begin");
    std::vector<int64_t> key_len(nseq);
    for (size_t s = 0; s < nseq; s++) {
        key_len[s] = offsets[s] + new_begin[s + 1] - new_begin[s];
        if (keys[s].ndim() < 3 || new_keys.shape(1) != keys[s].shape(-3) || new_keys.shape(2) != keys[s].shape(-1) ||
            new_values.shape(1) != values[s].shape(-3) || new_values.shape(2) != values[s].shape(-1))
            fail("new keys and values must fit the caches' heads and sizes");
    }
    check(q, keys, values, q_begin, key_len);
    std::vector<mx::array> inputs{q, new_keys, new_values};
    std::vector<mx::Shape> shapes{mx::Shape{q.shape(0), q.shape(1) * values[0].shape(-1)}};
    for (const auto &k : keys) inputs.push_back(k), shapes.push_back(k.shape());
    for (const auto &v : values) inputs.push_back(v), shapes.push_back(v.shape());
    return mx::array::make_arrays(shapes, std::vector<mx::Dtype>(shapes.size(), mx::float32),
                                  std::make_shared<CachedAttention>(mx::default_stream(mx::Device(mx::Device::cpu)),
                                                                    q_begin, key_len, scale, new_begin),
                                  inputs);
}

void register_attention(nb::module_ &m) {
    m.def("cached_attention", &cached_attention, nb::arg("q"), nb::arg("keys"), nb::arg("values"),
          nb::arg("q_begin"), nb::arg("key_len"), nb::arg("scale"),
          "q [rows, heads, dk] of several sequences' new tokens over their caches -> [rows, heads * dv], lazily");
    m.def("attend_and_append", &attend_and_append, nb::arg("q"), nb::arg("new_keys"), nb::arg("new_values"),
          nb::arg("keys"), nb::arg("values"), nb::arg("q_begin"), nb::arg("new_begin"), nb::arg("offsets"),
          nb::arg("scale"),
          "the step's new keys and values into each cache, then the attention: [out, keys after..., values after...]");
}
