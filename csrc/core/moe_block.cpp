// A whole sparse-MoE block (Qwen3.5-MoE) for a few tokens, as one call: router, top-k, the routed
// experts' SwiGLU, the shared expert behind its sigmoid gate, and the weighted sum. Decode runs
// one of these per layer; as separate graph nodes the same work was ~19 nodes per layer, each
// with its own scheduling cost and its own pass over small intermediate arrays.
#include <cmath>
#include <cstdint>
#include <vector>

#include "qkernels.h"
#include "vec_math.h"

namespace pqk {
namespace {

static inline float silu(float v) { return v / (1.f + std::exp(-v)); }

// out[r, :] = x[off[r] ...] @ dequant(m[expert[r]]).T. Rows with the same offset share one
// prepared activation (the k experts of a token).
void matmul(const QMatrix& m, const float* x, const std::vector<int64_t>& off,
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
  gather_qmm(p);
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

void moe_block(const MoeBlock& b, const float* x, int64_t T, float* out) {
  const int64_t D = b.router.K, E = b.router.N, k = b.k;
  const int64_t H = b.expert_down.K;  // routed experts' hidden size
  const int64_t Hs = b.shared_down.K;
  const bool gu_fused = b.shared_up.w == nullptr;  // shared gate/up as one [2 Hs, D] matrix
  std::vector<int64_t> tok(T), hid(T);
  for (int64_t t = 0; t < T; t++) {
    tok[t] = t * D;
    hid[t] = t * Hs;
  }
  std::vector<float> logits(T * E), sgate(T), sgu(T * 2 * Hs), sh(T * Hs), sdown(T * D);
  matmul(b.router, x, tok, nullptr, logits.data());
  matmul(b.shared_gate, x, tok, nullptr, sgate.data());
  if (gu_fused) {
    matmul(b.shared_gate_proj, x, tok, nullptr, sgu.data());
    swiglu(sgu.data(), sgu.data() + Hs, T, Hs, 2 * Hs, sh.data());
  } else {
    matmul(b.shared_gate_proj, x, tok, nullptr, sgu.data());
    matmul(b.shared_up, x, tok, nullptr, sgu.data() + T * Hs);
    swiglu(sgu.data(), sgu.data() + T * Hs, T, Hs, Hs, sh.data());
  }
  matmul(b.shared_down, sh.data(), hid, nullptr, sdown.data());

  std::vector<uint32_t> inds(T * k);
  std::vector<float> scores(T * k);
  moe_route(logits.data(), T, E, k, b.norm_topk, inds.data(), scores.data());
  std::vector<int32_t> ex(T * k);
  for (int64_t i = 0; i < T * k; i++) ex[i] = (int32_t)inds[i];

  // Routed experts: row t*k + j is token t through expert inds[t, j]; gate and up read the
  // token's activation, down reads that row's hidden activation.
  std::vector<int64_t> xrow(T * k), hrow(T * k);
  for (int64_t i = 0; i < T * k; i++) {
    xrow[i] = (i / k) * D;
    hrow[i] = i * H;
  }
  std::vector<float> g(T * k * H), u(T * k * H), h(T * k * H), down(T * k * D);
  matmul(b.expert_gate, x, xrow, ex.data(), g.data());
  matmul(b.expert_up, x, xrow, ex.data(), u.data());
  swiglu(g.data(), u.data(), T * k, H, H, h.data());
  matmul(b.expert_down, h.data(), hrow, ex.data(), down.data());

  for (int64_t t = 0; t < T; t++) {
    const float sg = 1.f / (1.f + std::exp(-sgate[t]));
    float* o = out + t * D;
    for (int64_t d = 0; d < D; d++) o[d] = sg * sdown[t * D + d];
    for (int64_t j = 0; j < k; j++) {
      const float s = scores[t * k + j];
      const float* dr = down.data() + (t * k + j) * D;
      for (int64_t d = 0; d < D; d++) o[d] += s * dr[d];
    }
  }
}

}  // namespace pqk
