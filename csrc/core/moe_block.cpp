// A whole sparse-MoE block (Qwen3.5-MoE) for a few tokens, as one call: router, top-k, the routed
// experts' SwiGLU, the shared expert behind its sigmoid gate, and the weighted sum. Decode runs
// one of these per layer; as separate graph nodes the same work was ~19 nodes per layer, each
// with its own scheduling cost and its own pass over small intermediate arrays.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "qkernels.h"
#include "scratch.h"
#include "vec_math.h"

namespace pqk {
namespace {

static inline float silu(float v) { return v / (1.f + std::exp(-v)); }

// out[r, :] = x[off[r] ...] @ dequant(m[expert[r]]).T, as a product for gather_qmm(_many).
// Rows with the same offset share one prepared activation (the k experts of a token).
GatherProblem product(const QMatrix& m, const float* x, const std::vector<int64_t>& off,
                      const int32_t* expert, float* out) {
  GatherProblem p;
  static_cast<QMatrix&>(p) = m;
  p.x = x;
  p.xdt = F32;
  p.nrows = (int64_t)off.size();
  p.xrow_off = off.data();
  p.expert = expert;
  p.out = out;
  p.odt = F32;
  return p;
}

// silu(gate) * up, where gate and up are [rows, n] at the given row strides (also compiled for
// AVX-512 / AVX2: the baseline's 8-float vectors are two SSE halves).
#if defined(__x86_64__) && defined(__linux__) && !defined(__clang__)
__attribute__((target_clones("avx512f", "avx2,fma", "default")))
#endif
void swiglu(const float* gate, const float* up, int64_t rows, int64_t n, int64_t stride,
            float* out) {
  const int64_t n8 = n / 8 * 8;
  for (int64_t r = 0; r < rows; r++) {
    for (int64_t i = 0; i < n8; i += 8)
      vm::store(out + r * n + i,
                vm::silu(vm::load(gate + r * stride + i)) * vm::load(up + r * stride + i));
    for (int64_t i = n8; i < n; i++) out[r * n + i] = silu(gate[r * stride + i]) * up[r * stride + i];
  }
}

}  // namespace

void moe_block_parts(const MoeBlock& b, const float* x, int64_t T, int64_t lo, bool with_shared,
                     float* parts, float* scores) {
  const int64_t D = b.router.K, E = b.router.N, k = b.k;
  const int64_t El = b.expert_gate.E;  // this rank's experts: global [lo, lo + El)
  const int64_t H = b.expert_down.K;  // routed experts' hidden size
  const int64_t P = k + 1;  // parts per token
  std::vector<int64_t> tok(T);
  for (int64_t t = 0; t < T; t++) tok[t] = t * D;
  // Slots this call does not write (experts held by another rank, the shared expert's when it is
  // not ours) must read zero; with every expert here and the shared one, all slots are written.
  if (!with_shared || lo != 0 || El != E) std::fill(parts, parts + T * P * D, 0.f);
  // Three pool jobs (gather_qmm_many): what reads x before routing (router, the shared expert's
  // gate and gate/up), then the routed gate and up with the shared down projection, then the
  // routed down projection. x is quantized once for its five products.
  thread_local Scratch s_logits, s_sgate, s_sgu, s_sh, s_sdown, s_g, s_u, s_h, s_down;
  const ScratchTrim trim{&s_logits, &s_sgate, &s_sgu, &s_sh, &s_sdown, &s_g, &s_u, &s_h, &s_down};
  float* logits = s_logits.floats(T * E);
  const int64_t Hs = with_shared ? b.shared_down.K : 0;
  const bool gu_fused = b.shared_up.w == nullptr;  // shared gate/up as one [2 Hs, D] matrix
  std::vector<int64_t> hid(T);
  for (int64_t t = 0; t < T; t++) hid[t] = t * Hs;
  float* sgate = s_sgate.floats(T);
  float* sgu = s_sgu.floats(T * 2 * Hs);
  float* sh = s_sh.floats(T * Hs);
  float* sdown = s_sdown.floats(T * D);
  std::vector<GatherProblem> job;
  job.push_back(product(b.router, x, tok, nullptr, logits));
  if (with_shared) {
    job.push_back(product(b.shared_gate, x, tok, nullptr, sgate));
    job.push_back(product(b.shared_gate_proj, x, tok, nullptr, sgu));
    if (!gu_fused) job.push_back(product(b.shared_up, x, tok, nullptr, sgu + T * Hs));
  }
  gather_qmm_many(job.data(), (int)job.size());
  job.clear();
  if (with_shared) {
    if (gu_fused)
      swiglu(sgu, sgu + Hs, T, Hs, 2 * Hs, sh);
    else
      swiglu(sgu, sgu + T * Hs, T, Hs, Hs, sh);
    job.push_back(product(b.shared_down, sh, hid, nullptr, sdown));
  }

  std::vector<uint32_t> inds(T * k);
  moe_route(logits, T, E, k, b.norm_topk, inds.data(), scores);
  // Routed experts held here: row r is slot sel[r] (token sel[r] / k through expert
  // inds[sel[r]]); gate and up read the token's activation, down reads the row's hidden one.
  std::vector<int64_t> sel, xrow, hrow;
  std::vector<int32_t> ex;
  for (int64_t i = 0; i < T * k; i++) {
    const int64_t e = (int64_t)inds[i] - lo;
    if (e < 0 || e >= El) continue;
    hrow.push_back((int64_t)sel.size() * H);
    sel.push_back(i);
    xrow.push_back((i / k) * D);
    ex.push_back((int32_t)e);
  }
  const int64_t R = (int64_t)sel.size();
  float* g = s_g.floats(R * H);
  float* u = s_u.floats(R * H);
  float* h = s_h.floats(R * H);
  float* down = s_down.floats(R * D);
  if (R > 0) {
    job.push_back(product(b.expert_gate, x, xrow, ex.data(), g));
    job.push_back(product(b.expert_up, x, xrow, ex.data(), u));
  }
  gather_qmm_many(job.data(), (int)job.size());
  if (with_shared)
    for (int64_t t = 0; t < T; t++) {
      const float sg = 1.f / (1.f + std::exp(-sgate[t]));
      float* o = parts + t * P * D;
      for (int64_t d = 0; d < D; d++) o[d] = sg * sdown[t * D + d];
    }
  if (R == 0) return;
  swiglu(g, u, R, H, H, h);
  const GatherProblem dp = product(b.expert_down, h, hrow, ex.data(), down);
  gather_qmm(dp);
  for (int64_t r = 0; r < R; r++) {
    const int64_t t = sel[r] / k, j = sel[r] % k;
    std::copy(down + r * D, down + (r + 1) * D, parts + (t * P + 1 + j) * D);
  }
}

void moe_combine(const float* parts, const float* scores, int64_t T, int64_t k, int64_t D,
                 float* out) {
  const int64_t P = k + 1;
  // Tokens on the pool from two up (a batched step); each token's sums are the same either way.
  parallel_for(T, T < 2, [&](int64_t t) {
    const float* p = parts + t * P * D;
    float* o = out + t * D;
    for (int64_t d = 0; d < D; d++) o[d] = p[d];
    for (int64_t j = 0; j < k; j++) {
      const float s = scores[t * k + j];
      const float* dr = p + (1 + j) * D;
      for (int64_t d = 0; d < D; d++) o[d] += s * dr[d];
    }
  });
}

// The whole block is its parts (every expert, the shared one included) combined: the one code
// path makes a single process and an expert-parallel group (parts summed across ranks, each
// slot nonzero on exactly one rank, so the sum is exact) compute bit-identical outputs.
void moe_block(const MoeBlock& b, const float* x, int64_t T, float* out) {
  const int64_t D = b.router.K, k = b.k;
  // Not cleared (moe_block_parts writes every slot here): zeroing ~0.6 MB a layer at 8 tokens
  // was a memset the other thread waited on.
  thread_local Scratch s_parts, s_scores;
  const ScratchTrim trim{&s_parts, &s_scores};
  float* parts = s_parts.floats(T * (k + 1) * D);
  float* scores = s_scores.floats(T * k);
  moe_block_parts(b, x, T, 0, true, parts, scores);
  moe_combine(parts, scores, T, k, D, out);
}

}  // namespace pqk
