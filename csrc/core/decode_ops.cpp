// Small per-layer ops of Qwen3.5-MoE that MLX runs on the CPU as many composed graph nodes:
// the causal depthwise conv of Gated DeltaNet, partial rotary embedding (RoPE) and the MoE
// router's softmax + top-k. A decode step pays ~10 us per graph node on the CPU, so each of
// these (10-30 nodes per call, 40-60 calls per token) is one node here. All float32.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "qkernels.h"
#include "vec_math.h"

namespace pqk {

// One output row, channels [0, C8) (a multiple of 8), compiled for AVX-512 / AVX2 as well (the
// baseline's 8-float vectors are two SSE halves).
#if defined(__x86_64__) && defined(__linux__) && !defined(__clang__)
__attribute__((target_clones("avx512f", "avx2,fma", "default")))
#endif
static void conv_silu_row8(const float* xb, const float* wt, float* o, int64_t C8, int64_t C,
                           int64_t K) {
  for (int64_t c = 0; c < C8; c += 8) {
    vm::f8 acc = vm::f8{};
    for (int64_t j = 0; j < K; j++) acc += vm::load(xb + j * C + c) * vm::load(wt + j * C + c);
    vm::store(o + c, vm::silu(acc));
  }
}

void causal_conv_silu(const float* x, const float* w, float* out, int64_t B, int64_t T,
                      int64_t C, int64_t K) {
  const int64_t rows = B * T;
  const bool single = rows * C * K < (1 << 20);
  const int64_t per = single ? rows : std::max<int64_t>(1, rows / 64);
  // w transposed to [K, C] once, so 8 channels go in one vector (vm::silu instead of expf).
  std::vector<float> wt(K * C);
  for (int64_t c = 0; c < C; c++)
    for (int64_t j = 0; j < K; j++) wt[j * C + c] = w[c * K + j];
  const int64_t C8 = C / 8 * 8;
  parallel_for((rows + per - 1) / per, single, [&](int64_t task) {
    const int64_t r1 = std::min(rows, (task + 1) * per);
    for (int64_t r = task * per; r < r1; r++) {
      const int64_t b = r / T, t = r % T;
      const float* xb = x + (b * (T + K - 1) + t) * C;  // window rows t .. t+K-1
      float* o = out + r * C;
      conv_silu_row8(xb, wt.data(), o, C8, C, K);
      for (int64_t c = C8; c < C; c++) {
        float acc = 0.f;
        for (int64_t j = 0; j < K; j++) acc += xb[j * C + c] * wt[j * C + c];
        o[c] = acc / (1.f + std::exp(-acc));
      }
    }
  });
}

void rope(const float* x, float* out, int64_t rows_per_pos, int64_t L, int64_t D, int64_t dims,
          float base, int64_t offset) {
  // x [N, L, D] viewed as rows_per_pos groups of L positions (row (n, l) at position offset+l).
  const int64_t half = dims / 2;
  std::vector<float> cs(L * half), sn(L * half);
  for (int64_t i = 0; i < half; i++) {
    const float inv_freq = std::exp(-(float)(2 * i) / (float)dims * std::log(base));
    for (int64_t l = 0; l < L; l++) {
      const float a = (float)(offset + l) * inv_freq;
      cs[l * half + i] = std::cos(a);
      sn[l * half + i] = std::sin(a);
    }
  }
  const int64_t rows = rows_per_pos * L;
  for (int64_t r = 0; r < rows; r++) {
    const int64_t l = r % L;
    const float* xr = x + r * D;
    float* o = out + r * D;
    const float* c = cs.data() + l * half;
    const float* s = sn.data() + l * half;
    for (int64_t i = 0; i < half; i++) {
      const float x1 = xr[i], x2 = xr[i + half];
      o[i] = x1 * c[i] - x2 * s[i];
      o[i + half] = x1 * s[i] + x2 * c[i];
    }
    for (int64_t i = dims; i < D; i++) o[i] = xr[i];
  }
}

void moe_route(const float* logits, int64_t rows, int64_t E, int64_t k, bool norm_topk,
               uint32_t* inds, float* scores) {
  std::vector<float> p(E);
  std::vector<int64_t> order(E);
  for (int64_t r = 0; r < rows; r++) {
    const float* lg = logits + r * E;
    const float mx = *std::max_element(lg, lg + E);
    float sum = 0.f;
    for (int64_t e = 0; e < E; e++) sum += (p[e] = std::exp(lg[e] - mx));
    for (int64_t e = 0; e < E; e++) p[e] /= sum;
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [&](int64_t a, int64_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
    float tot = 0.f;
    for (int64_t j = 0; j < k; j++) tot += p[order[j]];
    for (int64_t j = 0; j < k; j++) {
      inds[r * k + j] = (uint32_t)order[j];
      scores[r * k + j] = norm_topk ? p[order[j]] / tot : p[order[j]];
    }
  }
}

// log_softmax over the last axis: x - logsumexp(x), logsumexp as MLX's CPU backend defines it
// (max, then log(sum(exp(x - max))) + max, the max itself when it is infinite), for sampling
// over a vocabulary (248,320 logits a token on Qwen3.5): MLX runs it on one thread with one
// scalar exp per value (~3.2 ms a token on a Zen 4, 5% of a 35B decode step), here 8 lanes at a
// time on the pool. Each row is summed in fixed chunks whatever the thread count, so a row's bits
// never depend on the other rows (a verify pass's rows equal one-token decode's) nor on threads.
namespace {
constexpr int64_t kLsmChunk = 8192;

#if defined(__x86_64__) && defined(__linux__) && !defined(__clang__)
__attribute__((target_clones("avx512f", "avx2,fma", "default")))
#endif
float chunk_max(const float* x, int64_t n) {
  const int64_t n8 = n / 8 * 8;
  vm::f8 m = vm::f8{} - INFINITY;
  for (int64_t i = 0; i < n8; i += 8) {
    const vm::f8 v = vm::load(x + i);
    m = v > m ? v : m;
  }
  float r = -INFINITY;
  for (int j = 0; j < 8; j++) r = std::max(r, m[j]);
  for (int64_t i = n8; i < n; i++) r = std::max(r, x[i]);
  return r;
}

#if defined(__x86_64__) && defined(__linux__) && !defined(__clang__)
__attribute__((target_clones("avx512f", "avx2,fma", "default")))
#endif
float chunk_expsum(const float* x, int64_t n, float mx) {
  const int64_t n8 = n / 8 * 8;
  vm::f8 acc = vm::f8{};
  for (int64_t i = 0; i < n8; i += 8) acc += vm::exp(vm::load(x + i) - mx);
  float r = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
  for (int64_t i = n8; i < n; i++) r += std::exp(x[i] - mx);
  return r;
}
}  // namespace

void log_softmax(const float* x, float* out, int64_t rows, int64_t n) {
  const int64_t nch = (n + kLsmChunk - 1) / kLsmChunk;
  std::vector<float> part(rows * nch), lse(rows);
  const bool single = rows * n < (1 << 16);
  auto chunks = [&](auto&& fn) {
    parallel_for(rows * nch, single, [&](int64_t t) {
      const int64_t r = t / nch, c = t % nch;
      const int64_t i0 = c * kLsmChunk, len = std::min(kLsmChunk, n - i0);
      fn(r, c, x + r * n + i0, out + r * n + i0, len);
    });
  };
  chunks([&](int64_t r, int64_t c, const float* xc, float*, int64_t len) {
    part[r * nch + c] = chunk_max(xc, len);
  });
  for (int64_t r = 0; r < rows; r++)
    lse[r] = *std::max_element(part.data() + r * nch, part.data() + (r + 1) * nch);
  chunks([&](int64_t r, int64_t c, const float* xc, float*, int64_t len) {
    part[r * nch + c] = std::isinf(lse[r]) ? 0.f : chunk_expsum(xc, len, lse[r]);
  });
  for (int64_t r = 0; r < rows; r++) {
    if (std::isinf(lse[r])) continue;  // an infinite max is the lse itself, as in MLX
    float sum = 0.f;
    for (int64_t c = 0; c < nch; c++) sum += part[r * nch + c];
    lse[r] = std::log(sum) + lse[r];
  }
  chunks([&](int64_t r, int64_t, const float* xc, float* oc, int64_t len) {
    const float l = lse[r];
    for (int64_t i = 0; i < len; i++) oc[i] = xc[i] - l;
  });
}

}  // namespace pqk
