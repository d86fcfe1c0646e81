// Feasibility probe for issue 18 (not used by pipeline): 4-bit affine weights (groups of 32, float32
// scale s and bias b: w = s*q + b) times int8-quantized activations with AVX-512 VNNI, as llama.cpp
// multiplies its Q4/Q8 blocks, to size the gain an int8 path would bring over pipeline's float32
// kernels (pipeline/kernels/qmm_kernels.cpp).
//
// How. The weights are repacked at "load" with 16 columns interleaved: per group, 4 x 64 bytes, each
// 32-bit lane one column's 4 consecutive inputs (low nibbles inputs 4j..4j+3, high nibbles 4(j+4)..),
// so one vpdpbusd multiplies 16 columns x 4 inputs by a row's 4 broadcast int8 activations. Each row's
// activations are quantized per group of 32 (d = max|x|/127, round to nearest; row-local, so rows stay
// batch-invariant), and the group's result is
//     y += (s * d) * sum(q * xq)  +  b * sum(x)
// per column: 8 vpdpbusd + 1 convert + 1 multiply + 2 FMAs per group, row and 16 columns, against 32
// float32 FMAs plus the dequantization of every weight. Without the interleave (MLX's row layout) each
// vpdpbusd needs its own scale fix-up and nothing is gained.
//
// Build and run (a CPU with avx512_vnni):
//     g++ -O3 -march=native -fopenmp -o int8_vnni_qmm int8_vnni_qmm.cpp
//     OMP_NUM_THREADS=2 ./int8_vnni_qmm 8192 2048 1 16 64 512      # N K rows...
// It prints ms per product, GOP/s and the largest error against float64 (activation rounding: ~0.5%
// of the outputs' scale, which is the numerics decision an int8 path has to take).
//
// Measured 2026-12-04, AMD EPYC (Zen 4, 2.6 GHz), 2 threads, 8192 x 2048, group 32; pipeline's
// float32 kernel (qmm.quantized_matmul) on the same shape beside it:
//     rows 1:   0.143 ms (pipeline 0.875 ms)     rows 16:  1.14 ms (pipeline 7.4 ms)
//     rows 64:  5.12 ms  (pipeline 28.8 ms)      rows 512: 41.8 ms (OpenBLAS sgemm on float32 weights 101 ms)
#include <immintrin.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <vector>
#include <chrono>
#include <algorithm>

static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

struct Packed {  // per 16-column block, per group: 4 x 64 bytes (lo nibble: k-step j, hi: j+4), 16 s, 16 b
    int N, K;
    std::vector<uint8_t> codes;  // N/16 * K/32 * 256
    std::vector<float> s, b;     // N/16 * K/32 * 16
};

static Packed pack(const std::vector<uint8_t> &q, const std::vector<float> &s, const std::vector<float> &b, int N, int K) {
    Packed p{N, K, std::vector<uint8_t>((size_t)N / 16 * K / 32 * 256), std::vector<float>((size_t)N / 16 * K / 32 * 16),
             std::vector<float>((size_t)N / 16 * K / 32 * 16)};
    int G = K / 32;
    for (int cb = 0; cb < N / 16; cb++)
        for (int g = 0; g < G; g++) {
            uint8_t *dst = &p.codes[((size_t)cb * G + g) * 256];
            for (int j = 0; j < 4; j++)
                for (int c = 0; c < 16; c++)
                    for (int bb = 0; bb < 4; bb++) {
                        int n = cb * 16 + c;
                        uint8_t lo = q[(size_t)n * K + g * 32 + 4 * j + bb];
                        uint8_t hi = q[(size_t)n * K + g * 32 + 4 * (j + 4) + bb];
                        dst[j * 64 + c * 4 + bb] = lo | (hi << 4);
                    }
            for (int c = 0; c < 16; c++) {
                p.s[((size_t)cb * G + g) * 16 + c] = s[(size_t)(cb * 16 + c) * G + g];
                p.b[((size_t)cb * G + g) * 16 + c] = b[(size_t)(cb * 16 + c) * G + g];
            }
        }
    return p;
}

struct QuantX { std::vector<int8_t> q; std::vector<float> d, sum; };

static QuantX quantize_rows(const float *x, int M, int K) {
    int G = K / 32;
    QuantX r{std::vector<int8_t>((size_t)M * K), std::vector<float>((size_t)M * G), std::vector<float>((size_t)M * G)};
    for (int m = 0; m < M; m++)
        for (int g = 0; g < G; g++) {
            const float *v = x + (size_t)m * K + g * 32;
            float amax = 0, sum = 0;
            for (int i = 0; i < 32; i++) { amax = std::max(amax, std::fabs(v[i])); sum += v[i]; }
            float d = amax / 127.0f, inv = d ? 1.0f / d : 0.0f;
            for (int i = 0; i < 32; i++) r.q[(size_t)m * K + g * 32 + i] = (int8_t)std::lrintf(v[i] * inv);
            r.d[(size_t)m * G + g] = d;
            r.sum[(size_t)m * G + g] = sum;
        }
    return r;
}

template <int R>
static void tile(const Packed &p, const QuantX &xq, int m0, int cb, float *out, int N) {
    int K = p.K, G = K / 32;
    __m512 facc[R];
    for (int r = 0; r < R; r++) facc[r] = _mm512_setzero_ps();
    const __m512i mask = _mm512_set1_epi8(0x0F);
    for (int g = 0; g < G; g++) {
        const uint8_t *w = &p.codes[((size_t)cb * G + g) * 256];
        __m512i iacc[R];
        for (int r = 0; r < R; r++) iacc[r] = _mm512_setzero_si512();
        for (int j = 0; j < 4; j++) {
            __m512i v = _mm512_loadu_si512(w + j * 64);
            __m512i lo = _mm512_and_si512(v, mask), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
            for (int r = 0; r < R; r++) {
                const int8_t *xr = &xq.q[(size_t)(m0 + r) * K + g * 32];
                iacc[r] = _mm512_dpbusd_epi32(iacc[r], lo, _mm512_set1_epi32(*(const int32_t *)(xr + 4 * j)));
                iacc[r] = _mm512_dpbusd_epi32(iacc[r], hi, _mm512_set1_epi32(*(const int32_t *)(xr + 4 * (j + 4))));
            }
        }
        __m512 s = _mm512_loadu_ps(&p.s[((size_t)cb * G + g) * 16]), b = _mm512_loadu_ps(&p.b[((size_t)cb * G + g) * 16]);
        for (int r = 0; r < R; r++) {
            __m512 sd = _mm512_mul_ps(s, _mm512_set1_ps(xq.d[(size_t)(m0 + r) * G + g]));
            facc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[r]), sd, facc[r]);
            facc[r] = _mm512_fmadd_ps(b, _mm512_set1_ps(xq.sum[(size_t)(m0 + r) * G + g]), facc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + (size_t)(m0 + r) * N + cb * 16, facc[r]);
}

static void product(const Packed &p, const float *x, int M, float *out) {
    QuantX xq = quantize_rows(x, M, p.K);
    int N = p.N;
#pragma omp parallel for schedule(static)
    for (int cb = 0; cb < N / 16; cb++) {
        int m = 0;
        for (; m + 8 <= M; m += 8) tile<8>(p, xq, m, cb, out, N);
        for (; m + 4 <= M; m += 4) tile<4>(p, xq, m, cb, out, N);
        for (; m < M; m++) tile<1>(p, xq, m, cb, out, N);
    }
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s N K rows... (N a multiple of 16, K of 32)\n", argv[0]);
        return 2;
    }
    int N = atoi(argv[1]), K = atoi(argv[2]);
    if (N <= 0 || K <= 0 || N % 16 || K % 32) {
        fprintf(stderr, "error: N must be a multiple of 16 and K of 32, got %d and %d\n", N, K);
        return 2;
    }
    std::vector<int> Ms;
    for (int i = 3; i < argc; i++) Ms.push_back(atoi(argv[i]));
    int G = K / 32;
    srand(1);
    std::vector<uint8_t> q((size_t)N * K);
    std::vector<float> s((size_t)N * G), b((size_t)N * G);
    for (auto &v : q) v = rand() & 15;
    for (auto &v : s) v = 0.01f * (1 + (rand() % 100) / 100.0f);
    for (auto &v : b) v = -0.08f * (1 + (rand() % 100) / 100.0f);
    Packed p = pack(q, s, b, N, K);
    for (int M : Ms) {
        std::vector<float> x((size_t)M * K), out((size_t)M * N);
        for (auto &v : x) v = (rand() / (float)RAND_MAX - 0.5f) * 2;
        product(p, x.data(), M, out.data());
        // float64 reference on a few outputs
        double err = 0, mag = 0;
        for (int t = 0; t < 64; t++) {
            int m = rand() % M, n = rand() % N;
            double ref = 0;
            for (int k = 0; k < K; k++) ref += (double)x[(size_t)m * K + k] * (s[(size_t)n * G + k / 32] * q[(size_t)n * K + k] + b[(size_t)n * G + k / 32]);
            err = std::max(err, std::fabs(ref - out[(size_t)m * N + n]));
            mag = std::max(mag, std::fabs(ref));
        }
        int reps = std::max(3, (int)(2e10 / (2.0 * M * N * K)));
        double best = 1e9;
        for (int r = 0; r < reps; r++) {
            double t0 = now();
            product(p, x.data(), M, out.data());
            best = std::min(best, now() - t0);
        }
        printf("M=%d N=%d K=%d: %.3f ms, %.1f GOP/s, max abs err %.3g of max |y| %.3g\n", M, N, K, best * 1e3,
               2.0 * M * N * K / best / 1e9, err, mag);
    }
}
