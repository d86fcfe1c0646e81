/* --tensor-parallel's group sum as an MLX operation (a custom Primitive), so that a token's whole graph,
 * every layer's two sums included, is built lazily and evaluated once (kernels/group_sum.py).
 *
 * Why. The sum in Python (cluster/tensor_group.py GroupSum) evaluates each partial output (the graph
 * cut into 60 pieces a token on a 30-layer model, each a scheduling round trip of MLX's CPU stream),
 * copies it to numpy, polls an mpi4py request from Python and adds in numpy: ~115 us a sum where the
 * exchange itself takes ~14 us. Here the stream's worker exchanges and adds in place of the node.
 *
 * What it computes is what the Python sum computes: every member's float32 partial sent to every other
 * (non-blocking point-to-point on a communicator of the sums' own), then out = p0 + p1 + ... + p(T-1),
 * in member order, element by element in float32 (no fused operations, no library reduce): the same
 * bits on every member, whatever the message length. `first` gives every member the first member's
 * array (a router's top-k choices, as raw bytes).
 *
 * MPI without linking it: the library mpi4py loaded is opened again (RTLD_NOLOAD) and its functions
 * found by name; the handles (communicator, MPI_BYTE) come from mpi4py as integers. MPICH's handles are
 * ints, Open MPI's pointers: the calls are instantiated for both (`Calls<H>`). The job's MPI must give
 * MPI_THREAD_MULTIPLE (the stream's worker calls MPI while Python may too): group_sum.py checks.
 *
 * Waiting is transport.py's MpiTransport.wait_for: a member with a core of its own spins (the members
 * finish a layer within microseconds), then yields, then sleeps up to 0.5 ms; every second it checks
 * that a peer on this host still exists; past the watchdog it prints the silence message Python
 * gave (naming the first member not heard from) and aborts the job, as MlxTransport's deadline does.
 * A process that was stopped itself (a gap of over 1 s between polls) does not count that time.
 */
#include <nanobind/nanobind.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <dlfcn.h>
#include <sched.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"

#include "kernels_common.h"

namespace nb = nanobind;

namespace {

mx::Stream cpu() { return mx::default_stream(mx::Device(mx::Device::cpu)); }

double now_s() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

/* MPI's functions of one handle type H (int: MPICH; void*: Open MPI, whose handles are pointers). */
template <class H>
struct Calls {
    using Isend = int (*)(const void *, int, H, int, int, H, H *);
    using Irecv = int (*)(void *, int, H, int, int, H, H *);
    using Test = int (*)(H *, int *, void *);
    using Abort = int (*)(H, int);
    Isend isend = nullptr;
    Irecv irecv = nullptr;
    Test test = nullptr;
    Abort abort = nullptr;
};

constexpr int TAG = 7;
constexpr size_t STATUS_BYTES = 128;  // more than any MPI's MPI_Status (MPICH 20, Open MPI 24, MPI ABI 32)

}  // namespace

/* One member's link to its group: the MPI calls, handles, waiting policy, failure messages, counters. */
class GroupLink : public std::enable_shared_from_this<GroupLink> {
   public:
    GroupLink(const std::string &library, bool pointer_handles, uint64_t comm, uint64_t byte_type, int member, int size,
              double watchdog_s, double spin_s, double yield_s, std::vector<std::string> silent_recv,
              std::vector<std::string> silent_send, std::vector<int64_t> pids, std::vector<std::string> gone)
        : pointer_(pointer_handles), comm_(comm), byte_(byte_type), member_(member), size_(size),
          watchdog_s_(watchdog_s), spin_s_(spin_s), yield_s_(yield_s), silent_recv_(std::move(silent_recv)),
          silent_send_(std::move(silent_send)), pids_(std::move(pids)), gone_(std::move(gone)) {
        if (size_ < 1 || member_ < 0 || member_ >= size_ || int(silent_recv_.size()) != size_ ||
            int(silent_send_.size()) != size_ || int(pids_.size()) != size_ || int(gone_.size()) != size_)
            throw std::invalid_argument("pipeline group link: one message and pid per member");
        handle_ = dlopen(library.c_str(), RTLD_NOLOAD | RTLD_LAZY);
        if (!handle_) throw std::runtime_error(library + " is not loaded in this process");
        auto find = [&](const char *name) {
            void *f = dlsym(handle_, name);
            if (!f) throw std::runtime_error(std::string("no ") + name + " in " + library);
            return f;
        };
        void *isend = find("MPI_Isend"), *irecv = find("MPI_Irecv"), *test = find("MPI_Test"),
             *abort = find("MPI_Abort");
        if (pointer_) {
            p_.isend = reinterpret_cast<Calls<void *>::Isend>(isend);
            p_.irecv = reinterpret_cast<Calls<void *>::Irecv>(irecv);
            p_.test = reinterpret_cast<Calls<void *>::Test>(test);
            p_.abort = reinterpret_cast<Calls<void *>::Abort>(abort);
        } else {
            i_.isend = reinterpret_cast<Calls<int>::Isend>(isend);
            i_.irecv = reinterpret_cast<Calls<int>::Irecv>(irecv);
            i_.test = reinterpret_cast<Calls<int>::Test>(test);
            i_.abort = reinterpret_cast<Calls<int>::Abort>(abort);
        }
    }

    ~GroupLink() {
        if (handle_) dlclose(handle_);  // only drops the reference RTLD_NOLOAD took: mpi4py keeps it loaded
    }

    int member() const { return member_; }
    int size() const { return size_; }
    double seconds() const { return nanos_.load() * 1e-9; }
    int64_t calls() const { return calls_.load(); }
    void reset() {
        nanos_ = 0;
        calls_ = 0;
    }

    /* Every member's `bytes` bytes at `mine` into parts[m] (parts[member] is not written: it is `mine`).
       Each part is `bytes` long. Blocks under the watchdog. */
    void all_gather(const void *mine, uint8_t *parts, int64_t bytes) {
        if (pointer_)
            exchange(p_, mine, parts, bytes, -1);
        else
            exchange(i_, mine, parts, bytes, -1);
    }

    /* The first member's `bytes` bytes at `buf` into every member's `buf`. */
    void from_first(uint8_t *buf, int64_t bytes) {
        if (pointer_)
            exchange(p_, buf, buf, bytes, 0);
        else
            exchange(i_, buf, buf, bytes, 0);
    }

    void count(double seconds) {
        nanos_ += int64_t(seconds * 1e9);
        calls_ += 1;
    }

   private:
    /* root < 0: all to all (parts: size_ x bytes, slot `member_` untouched); root >= 0: root's buffer to all. */
    template <class H>
    void exchange(const Calls<H> &mpi, const void *mine, uint8_t *parts, int64_t bytes, int root) {
        if (bytes > int64_t(INT32_MAX)) fail("a group sum's message over 2 GiB", -1, false);
        const H comm = handle<H>(comm_), byte = handle<H>(byte_);
        std::vector<H> requests;
        std::vector<int> peer_of;   // the member each request is with
        std::vector<bool> sending;  // and whether it sends to it
        requests.reserve(2 * size_);
        auto post = [&](int rc, int peer, bool send) {
            if (rc != 0) fail("MPI call failed (error " + std::to_string(rc) + ")", peer, send);
            peer_of.push_back(peer);
            sending.push_back(send);
        };
        for (int m = 0; m < size_; m++) {  // receives first, so that each send finds its receive posted
            if (m == member_ || (root >= 0 && (member_ == root || m != root))) continue;
            requests.emplace_back();
            uint8_t *into = root >= 0 ? parts : parts + m * bytes;
            post(mpi.irecv(into, int(bytes), byte, m, TAG, comm, &requests.back()), m, false);
        }
        for (int m = 0; m < size_; m++) {
            if (m == member_ || (root >= 0 && member_ != root)) continue;
            requests.emplace_back();
            post(mpi.isend(mine, int(bytes), byte, m, TAG, comm, &requests.back()), m, true);
        }
        if (requests.empty()) return;
        std::vector<uint8_t> statuses(requests.size() * STATUS_BYTES);
        wait(mpi, requests, statuses, peer_of, sending);
    }

    template <class H>
    static H handle(uint64_t v) {
        if constexpr (std::is_pointer_v<H>)
            return reinterpret_cast<H>(static_cast<uintptr_t>(v));
        else
            return static_cast<H>(static_cast<uint32_t>(v));
    }

    template <class H>
    void wait(const Calls<H> &mpi, std::vector<H> &requests, std::vector<uint8_t> &statuses,
              const std::vector<int> &peer_of, const std::vector<bool> &sending) {
        const size_t count = requests.size();
        std::vector<char> done(count, 0);
        size_t left = count;
        auto test = [&]() {  // each request alone: which member is missing must be known
            for (size_t i = 0; i < count; i++) {
                if (done[i]) continue;
                int flag = 0;
                const int rc = mpi.test(&requests[i], &flag, statuses.data() + i * STATUS_BYTES);
                if (rc != 0) fail("MPI_Test failed (error " + std::to_string(rc) + ")", peer_of[i], sending[i]);
                if (flag) {
                    done[i] = 1;
                    left--;
                }
            }
            return left == 0;
        };
        auto pending = [&]() {  // a receive not yet complete first: the member this one has not heard from
            for (size_t i = 0; i < count; i++)
                if (!done[i] && !sending[i]) return i;
            for (size_t i = 0; i < count; i++)
                if (!done[i]) return i;
            return size_t(0);
        };
        if (test()) return;
        const double start_at = now_s();
        double start = start_at, last = start_at, check_at = start_at + 1.0, sleep_s = 0.0;
        for (;;) {
            if (test()) return;
            const double waited = now_s() - start_at;
            if (waited < spin_s_) continue;  // a core of its own: spin
            if (waited < yield_s_) {
                sched_yield();
                continue;
            }
            if (sleep_s > 0) {
                timespec ts{0, long(sleep_s * 1e9)};
                nanosleep(&ts, nullptr);
            }
            sleep_s = std::min(0.0005, sleep_s > 0 ? sleep_s * 2 : 0.00002);
            const double t = now_s();
            if (t > check_at) {
                check_at = t + 1.0;
                for (size_t i = 0; i < count; i++) {
                    const int peer = peer_of[i];
                    if (!done[i] && pids_[peer] > 0 && kill(pid_t(pids_[peer]), 0) != 0 && errno == ESRCH)
                        abort_job(gone_[peer]);
                }
            }
            if (watchdog_s_ > 0) {
                if (t - last > 1.0) start += t - last;  // this process was stopped: not the peer's fault
                last = t;
                if (t - start > watchdog_s_) {
                    const size_t i = pending();
                    abort_job(sending[i] ? silent_send_[peer_of[i]] : silent_recv_[peer_of[i]]);
                }
            }
        }
    }

    void fail(const std::string &what, int peer, bool send) {
        std::string line = "group sum of member " + std::to_string(member_) + ": " + what;
        if (peer >= 0) line += std::string(send ? " sending to" : " receiving from") + " member " + std::to_string(peer);
        abort_job(line + "; aborting the job");
    }

    /* As cluster/mpi.py abort(): the line on stderr, a moment for it to get out, then MPI_Abort. */
    [[noreturn]] void abort_job(const std::string &message) {
        const std::string line = "error: " + message + "\n";
        ssize_t left = ssize_t(line.size());
        const char *p = line.data();
        while (left > 0) {
            const ssize_t n = ::write(2, p, size_t(left));
            if (n <= 0) break;
            p += n;
            left -= n;
        }
        timespec ts{0, 200000000};  // LAST_WORDS_S
        nanosleep(&ts, nullptr);
        if (pointer_)
            p_.abort(handle<void *>(comm_), 1);
        else
            i_.abort(handle<int>(comm_), 1);
        _exit(1);
    }

    bool pointer_;
    uint64_t comm_, byte_;  // as mpi4py gives them: an int handle's bits in the low 32
    int member_, size_;
    double watchdog_s_, spin_s_, yield_s_;
    std::vector<std::string> silent_recv_, silent_send_;
    std::vector<int64_t> pids_;
    std::vector<std::string> gone_;
    void *handle_ = nullptr;
    Calls<int> i_;
    Calls<void *> p_;
    std::atomic<int64_t> nanos_{0}, calls_{0};
};

/* What both primitives' eval_cpu do: `out` allocated, then on the stream's worker (in the graph's order)
   work(x row-contiguous, out), where the exchange and the adds happen. */
template <class Work>
void on_the_stream(const mx::Stream &stream, const mx::array &x, mx::array &out, Work work) {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto &encoder = mx::cpu::get_command_encoder(stream);
    encoder.set_input_array(x);
    encoder.set_output_array(out);
    encoder.dispatch([x, out, work = std::move(work)]() mutable {
        std::vector<mx::array> keep;
        work(contiguous(x, keep), out);
    });
}

/* The group's sum of float32 partials [...]: every member's, added in member order. */
class GroupSumPrimitive : public mx::UnaryPrimitive {
   public:
    GroupSumPrimitive(mx::Stream stream, std::shared_ptr<GroupLink> link)
        : mx::UnaryPrimitive(stream), link_(std::move(link)) {}

    void eval_cpu(const std::vector<mx::array> &inputs, mx::array &out) override {
        on_the_stream(stream(), inputs[0], out, [link = link_](const mx::array &mine, mx::array &out) {
            const double start = now_s();
            const int64_t n = int64_t(mine.size()), size = link->size(), member = link->member();
            const float *own = mine.data<float>();
            std::vector<float> parts(size_t(size * n));
            link->all_gather(own, reinterpret_cast<uint8_t *>(parts.data()), n * int64_t(sizeof(float)));
            float *o = out.data<float>();
            const float *first = member == 0 ? own : parts.data();
            for (int64_t i = 0; i < n; i++) o[i] = first[i];
            for (int64_t m = 1; m < size; m++) {  // member order, float32, one add per element
                const float *p = m == member ? own : parts.data() + m * n;
                for (int64_t i = 0; i < n; i++) o[i] = o[i] + p[i];
            }
            link->count(now_s() - start);
        });
    }

    void eval_gpu(const std::vector<mx::array> &, mx::array &) override {
        throw std::runtime_error("pipeline's group sum runs on the CPU only");
    }

    const char *name() const override { return "PipelineGroupSum"; }

    // never merged with another sum: each is an exchange of its own
    bool is_equivalent(const mx::Primitive &) const override { return false; }

    std::vector<mx::Shape> output_shapes(const std::vector<mx::array> &inputs) override { return {inputs[0].shape()}; }

   private:
    std::shared_ptr<GroupLink> link_;
};

/* The first member's array (any dtype) on every member. */
class FromFirstPrimitive : public mx::UnaryPrimitive {
   public:
    FromFirstPrimitive(mx::Stream stream, std::shared_ptr<GroupLink> link)
        : mx::UnaryPrimitive(stream), link_(std::move(link)) {}

    void eval_cpu(const std::vector<mx::array> &inputs, mx::array &out) override {
        on_the_stream(stream(), inputs[0], out, [link = link_](const mx::array &mine, mx::array &out) {
            uint8_t *o = out.data<uint8_t>();
            std::memcpy(o, mine.data<uint8_t>(), mine.nbytes());
            link->from_first(o, int64_t(out.nbytes()));
        });
    }

    void eval_gpu(const std::vector<mx::array> &, mx::array &) override {
        throw std::runtime_error("pipeline's group broadcast runs on the CPU only");
    }

    const char *name() const override { return "PipelineFromFirst"; }

    bool is_equivalent(const mx::Primitive &) const override { return false; }

    std::vector<mx::Shape> output_shapes(const std::vector<mx::array> &inputs) override { return {inputs[0].shape()}; }

   private:
    std::shared_ptr<GroupLink> link_;
};

void register_group_sum(nb::module_ &m) {
    nb::class_<GroupLink>(m, "PipelineGroupLink")
        .def(nb::new_([](const std::string &library, bool pointer_handles, uint64_t comm, uint64_t byte_type, int member,
                         int size, double watchdog_s, double spin_s, double yield_s,
                         std::vector<std::string> silent_recv, std::vector<std::string> silent_send,
                         std::vector<int64_t> pids, std::vector<std::string> gone) {
                 return std::make_shared<GroupLink>(library, pointer_handles, comm, byte_type, member, size, watchdog_s,
                                                    spin_s, yield_s, std::move(silent_recv), std::move(silent_send),
                                                    std::move(pids), std::move(gone));
             }),
             nb::arg("library"), nb::arg("pointer_handles"), nb::arg("comm"), nb::arg("byte_type"), nb::arg("member"),
             nb::arg("size"), nb::arg("watchdog_s"), nb::arg("spin_s"), nb::arg("yield_s"), nb::arg("silent_recv"),
             nb::arg("silent_send"), nb::arg("pids"), nb::arg("gone"))
        .def_prop_ro("seconds", &GroupLink::seconds)
        .def_prop_ro("calls", &GroupLink::calls)
        .def("reset", &GroupLink::reset)
        .def(
            "sum",
            [](std::shared_ptr<GroupLink> link, const mx::array &x) {
                if (x.dtype() != mx::float32) throw std::invalid_argument("pipeline group sum: float32 partials");
                return mx::array(x.shape(), mx::float32, std::make_shared<GroupSumPrimitive>(cpu(), link), {x});
            },
            nb::arg("x"), "the group's sum of every member's float32 x, in member order, lazily")
        .def(
            "first",
            [](std::shared_ptr<GroupLink> link, const mx::array &x) {
                return mx::array(x.shape(), x.dtype(), std::make_shared<FromFirstPrimitive>(cpu(), link), {x});
            },
            nb::arg("x"), "the group's first member's x on every member, lazily");
}
