// Gated delta rule over many tokens (prefill) with AVX-512: rows of the state outer, tokens
// inner. Each row of S [Dv, Dk] evolves on its own (kv_t = g_t S k_t, delta = (v_t - kv) beta_t,
// S = g_t S + delta k_t^T, y_t = S q_t, all per row), so a pair of rows stays in registers for
// the whole sequence while q_t and k_t (shared by all rows of the head) come from L1/L2. The
// token-outer loop of delta_head instead streams the whole 64 KiB state of a head through L2
// for every token. Same operations per element as delta_head, in a fixed order.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu_features.h"
#include "qkernels.h"

namespace pqk {
namespace detail {

#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,fma")
namespace {
typedef float v16 __attribute__((vector_size(64)));

inline v16 ld(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline float hsum16(v16 v) {
  typedef float h8 __attribute__((vector_size(32)));
  typedef float h4 __attribute__((vector_size(16)));
  h8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  h4 c = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (c[0] + c[2]) + (c[1] + c[3]);
}

// R rows [r0, r0 + R) of one head's state, Dk = 16 NV, over T tokens.
template <int NV, int R>
void rows_t(const float* q, const float* k, int64_t qk_stride, const float* v, float* y,
            int64_t vy_stride, const float* g, const float* beta, int64_t gb_stride,
            const float* S_in, float* S, int64_t T, int64_t Dk) {
  v16 s[R][NV];
  for (int r = 0; r < R; r++)
    for (int i = 0; i < NV; i++) s[r][i] = ld(S_in + r * Dk + 16 * i);
  for (int64_t t = 0; t < T; t++) {
    const float* kt = k + t * qk_stride;
    const float* qt = q + t * qk_stride;
    const float gt = g[t * gb_stride], bt = beta[t * gb_stride];
    v16 kv[NV];
    for (int i = 0; i < NV; i++) kv[i] = ld(kt + 16 * i);
    for (int r = 0; r < R; r++) {
      v16 acc = v16{};
      for (int i = 0; i < NV; i++) acc += s[r][i] * kv[i];
      const float delta = (v[t * vy_stride + r] - gt * hsum16(acc)) * bt;
      v16 acc2 = v16{};
      for (int i = 0; i < NV; i++) {
        s[r][i] = s[r][i] * gt + kv[i] * delta;
        acc2 += s[r][i] * ld(qt + 16 * i);
      }
      y[t * vy_stride + r] = hsum16(acc2);
    }
  }
  for (int r = 0; r < R; r++)
    for (int i = 0; i < NV; i++) std::memcpy(S + r * Dk + 16 * i, &s[r][i], 64);
}
}  // namespace

bool gated_delta_prefill_ok(int64_t T, int64_t Dk, int64_t Dv) {
  static const bool avx512 = cpu_features().avx512f && cpu_features().avx512dq;
  return avx512 && T >= 2 && (Dk == 64 || Dk == 128 || Dk == 256) && Dv % 2 == 0;
}

void gated_delta_prefill(const float* q, const float* k, const float* v, const float* g,
                         const float* beta, const float* state_in, float* state, float* y,
                         int64_t B, int64_t T, int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv) {
  // Tasks: (batch, value head, block of 16 rows).
  const int64_t RB = 16;
  const int64_t nrb = (Dv + RB - 1) / RB;
  parallel_for(B * Hv * nrb, B * Hv * Dv * Dk * T < (1 << 18), [&](int64_t task) {
    const int64_t rb = task % nrb, hv = (task / nrb) % Hv, b = task / (nrb * Hv);
    const int64_t hk = hv / (Hv / Hk);
    const float* qh = q + (b * T * Hk + hk) * Dk;
    const float* kh = k + (b * T * Hk + hk) * Dk;
    const int64_t off = (b * Hv + hv) * Dv * Dk;
    for (int64_t r0 = rb * RB; r0 < std::min<int64_t>(Dv, (rb + 1) * RB); r0 += 2) {
      const float* vh = v + (b * T * Hv + hv) * Dv + r0;
      float* yh = y + (b * T * Hv + hv) * Dv + r0;
      const float* gh = g + b * T * Hv + hv;
      const float* bh = beta + b * T * Hv + hv;
      const float* si = state_in + off + r0 * Dk;
      float* so = state + off + r0 * Dk;
      if (Dk == 128)
        rows_t<8, 2>(qh, kh, Hk * Dk, vh, yh, Hv * Dv, gh, bh, Hv, si, so, T, Dk);
      else if (Dk == 64)
        rows_t<4, 2>(qh, kh, Hk * Dk, vh, yh, Hv * Dv, gh, bh, Hv, si, so, T, Dk);
      else {
        rows_t<16, 1>(qh, kh, Hk * Dk, vh, yh, Hv * Dv, gh, bh, Hv, si, so, T, Dk);
        rows_t<16, 1>(qh, kh, Hk * Dk, vh + 1, yh + 1, Hv * Dv, gh, bh, Hv, si + Dk, so + Dk, T,
                      Dk);
      }
    }
  });
}
#pragma GCC pop_options
#else
bool gated_delta_prefill_ok(int64_t, int64_t, int64_t) { return false; }
void gated_delta_prefill(const float*, const float*, const float*, const float*, const float*,
                         const float*, float*, float*, int64_t, int64_t, int64_t, int64_t,
                         int64_t, int64_t) {}
#endif

}  // namespace detail
}  // namespace pqk
