// One decode token of a Gated DeltaNet layer (Qwen3.5's linear attention) after its input
// projections, as one call: causal conv + silu over the window, q/k L2 normalisation, the
// decay and beta gates, the gated delta rule and the gated RMSNorm of the output. As graph
// nodes the same work was ~20 nodes per layer (30 layers per token on the 35B shape).
#include <cmath>
#include <cstdint>
#include <vector>

#include "qkernels.h"
#include "scratch.h"
#include "vec_math.h"

namespace pqk {

namespace {

inline float silu(float v) { return v / (1.f + std::exp(-v)); }

inline float softplus(float v) {
  // As MLX's nn.softplus = logaddexp(v, 0), without overflow for large v.
  return v > 0.f ? v + std::log1p(std::exp(-v)) : std::log1p(std::exp(v));
}

// silu in place, 8 floats at a time (vm::silu; the rest with expf). One expf call per channel
// was most of a decode token's `prepare` (8192 channels per layer on the 35B shape, ~90 us of
// serial time per layer while the other threads wait).
#if defined(__x86_64__) && defined(__linux__) && !defined(__clang__)
__attribute__((target_clones("avx512f", "avx2,fma", "default")))
#endif
void silu_inplace(float* x, int64_t n) {
  const int64_t n8 = n / 8 * 8;
  for (int64_t i = 0; i < n8; i += 8) vm::store(x + i, vm::silu(vm::load(x + i)));
  for (int64_t i = n8; i < n; i++) x[i] = silu(x[i]);
}

// x / sqrt(mean(x^2) + eps) * scale in place, as ops.rms_norm followed by a multiply.
void rms_scale(float* x, int64_t D, float eps, float scale) {
  rms_norm(x, nullptr, nullptr, x, 1, D, eps);
  for (int64_t i = 0; i < D; i++) x[i] *= scale;
}


// Everything of one token before the delta rule, per batch row: the conv window (history from
// a.conv_state, the new window to a.new_conv_state), q / k / v packed for gated_delta at
// q + b * key_dim, ..., the gates g and beta at b * Hv.
void prepare(const LinearAttnStep& a, float* q, float* k, float* v, float* g, float* beta) {
  const int64_t B = a.B, C = a.conv_dim, K = a.kernel;
  const int64_t Hk = a.Hk, Hv = a.Hv, Dk = a.Dk, Dv = a.Dv;
  const int64_t key_dim = Hk * Dk;
  thread_local Scratch s_conv;
  const ScratchTrim trim{&s_conv};
  float* conv = s_conv.floats(B * C);
  const float inv = 1.f / std::sqrt((float)Dk);
  const float l2_eps = 1e-6f * inv * inv;
  // Rows on the pool from two up (a batched step: ~110 us a layer at B = 8 on the 35B shape,
  // serial while the other thread waited); each row's arithmetic is the same either way.
  parallel_for(B, B < 2, [&](int64_t b) {
    // Window: K-1 rows of history then this token's qkv; the new history drops the oldest row.
    const float* hist = a.conv_state + b * (K - 1) * C;
    const float* cur = a.qkv + b * a.qkv_stride;
    float* nh = a.new_conv_state + b * (K - 1) * C;
    float* co = conv + b * C;
    for (int64_t c = 0; c < C; c++) {
      float acc = 0.f;
      for (int64_t j = 0; j < K - 1; j++) acc += hist[j * C + c] * a.conv_w[c * K + j];
      acc += cur[c] * a.conv_w[c * K + K - 1];
      co[c] = acc;
    }
    silu_inplace(co, C);
    for (int64_t j = 0; j + 1 < K - 1; j++)
      for (int64_t c = 0; c < C; c++) nh[j * C + c] = hist[(j + 1) * C + c];
    for (int64_t c = 0; c < C; c++) nh[(K - 2) * C + c] = cur[c];
    for (int64_t h = 0; h < Hk; h++) {
      rms_scale(co + h * Dk, Dk, l2_eps, inv * inv);            // q
      rms_scale(co + key_dim + h * Dk, Dk, l2_eps, inv);        // k
    }
    for (int64_t h = 0; h < Hv; h++) {
      const float bb = a.b[b * a.ab_stride + h], aa = a.a[b * a.ab_stride + h];
      beta[b * Hv + h] = 1.f / (1.f + std::exp(-bb));
      g[b * Hv + h] = std::exp(-std::exp(a.A_log[h]) * softplus(aa + a.dt_bias[h]));
    }
    // q [B, 1, Hk, Dk], k likewise, v [B, 1, Hv, Dv] are rows of `conv` (row stride C): the
    // kernel wants them packed, so gather them (a few KiB).
    for (int64_t i = 0; i < key_dim; i++) {
      q[b * key_dim + i] = co[i];
      k[b * key_dim + i] = co[key_dim + i];
    }
    for (int64_t i = 0; i < Hv * Dv; i++) v[b * Hv * Dv + i] = co[2 * key_dim + i];
  });
}

// Gated RMSNorm per value head of the delta rule's output y [B, Hv * Dv]: norm(y) * w * silu(z).
void finish(const LinearAttnStep& a, const float* y, float* out) {
  const int64_t HvDv = a.Hv * a.Dv;
  parallel_for(a.B, a.B < 2, [&](int64_t b) {
    rms_norm(y + b * HvDv, a.norm_w, a.z + b * a.z_stride, out + b * HvDv, a.Hv, a.Dv, a.norm_eps);
  });
}

}  // namespace

void linear_attn_step(const LinearAttnStep& a) {
  const int64_t B = a.B, key_dim = a.Hk * a.Dk, HvDv = a.Hv * a.Dv;
  thread_local Scratch s_q, s_k, s_v, s_g, s_beta, s_y;
  const ScratchTrim trim{&s_q, &s_k, &s_v, &s_g, &s_beta, &s_y};
  float* q = s_q.floats(B * key_dim);
  float* k = s_k.floats(B * key_dim);
  float* v = s_v.floats(B * HvDv);
  float* g = s_g.floats(B * a.Hv);
  float* beta = s_beta.floats(B * a.Hv);
  float* y = s_y.floats(B * HvDv);
  prepare(a, q, k, v, g, beta);
  gated_delta(q, k, v, g, beta, a.state_in, a.state, y, B, 1, a.Hk, a.Hv, a.Dk, a.Dv);
  finish(a, y, a.out);
}

void linear_attn_rows(const LinearAttnStep& a, int64_t L, int64_t qkv_row, int64_t z_row,
                      int64_t ab_row, float* const* conv_slots, float* const* state_slots) {
  const int64_t B = a.B, key_dim = a.Hk * a.Dk, HvDv = a.Hv * a.Dv;
  // Row i: linear_attn_step of row i, from the caches after row i - 1 (slot i - 1).
  auto row = [&](int64_t i) {
    LinearAttnStep r = a;
    r.qkv = a.qkv + i * qkv_row;
    r.z = a.z + i * z_row;
    r.b = a.b + i * ab_row;
    r.a = a.a + i * ab_row;
    r.conv_state = i ? conv_slots[i - 1] : a.conv_state;
    r.state_in = i ? state_slots[i - 1] : a.state_in;
    r.new_conv_state = conv_slots[i];
    r.state = state_slots[i];
    r.out = a.out + i * B * HvDv;
    return r;
  };
  // q, k, v, g, beta of all rows first (the conv window chains through the tape), [L, B, ...];
  // with B = 1 that is gated_delta's [B = 1, T = L, ...] layout, and the delta rule of all rows
  // runs in one head-major pass (each state row stays in L1 from one token to the next).
  std::vector<float> q(L * B * key_dim), k(L * B * key_dim), v(L * B * HvDv), g(L * B * a.Hv),
      beta(L * B * a.Hv), y(L * B * HvDv);
  for (int64_t i = 0; i < L; i++)
    prepare(row(i), q.data() + i * B * key_dim, k.data() + i * B * key_dim,
            v.data() + i * B * HvDv, g.data() + i * B * a.Hv, beta.data() + i * B * a.Hv);
  bool fused = false;
  if (B == 1)  // [L, 1, ...] is [1, T = L, ...]: the layout gated_delta_rows reads
    fused = gated_delta_rows(q.data(), k.data(), v.data(), g.data(), beta.data(), a.state_in,
                             state_slots, y.data(), 1, L, a.Hk, a.Hv, a.Dk, a.Dv);
  for (int64_t i = 0; i < L; i++) {
    const LinearAttnStep r = row(i);
    if (!fused)
      gated_delta(q.data() + i * B * key_dim, k.data() + i * B * key_dim,
                  v.data() + i * B * HvDv, g.data() + i * B * a.Hv, beta.data() + i * B * a.Hv,
                  r.state_in, r.state, y.data() + i * B * HvDv, B, 1, a.Hk, a.Hv, a.Dk, a.Dv);
    finish(r, y.data() + i * B * HvDv, r.out);
  }
}

}  // namespace pqk
