// Causal attention for prefill (see attention.h). Why our own: MLX's CPU scaled_dot_product_attention
// materialises the score matrix and multiplies with the wheel's reference BLAS (~4 GFLOP/s here):
// ~1.6 s per full-attention layer for a 512-token prompt of the 35B shape, a third of prefill.
#include "attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "qkernels.h"
#include "vec_math.h"

#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")
namespace pqk {
namespace attn_avx512 {
#define QK_W 16
#include "attention.inc"
#undef QK_W
}  // namespace attn_avx512
}  // namespace pqk
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace pqk {
namespace attn_avx2 {
#define QK_W 8
#include "attention.inc"
#undef QK_W
}  // namespace attn_avx2
}  // namespace pqk
#pragma GCC pop_options
#endif

namespace pqk {
namespace attn_base {
#define QK_W 4
#include "attention.inc"
#undef QK_W
}  // namespace attn_base

using AttnBlock = decltype(&attn_base::attn_block);

static AttnBlock attn_kernel() {
#if defined(__x86_64__) || defined(_M_X64)
  const std::string is = isa();
  if (is == "avx512") return &attn_avx512::attn_block;
  if (is == "avx2") return &attn_avx2::attn_block;
#endif
  return &attn_base::attn_block;
}

void causal_attention(const float* q, const int64_t* qst, const float* k, const int64_t* kst,
                      const float* v, const int64_t* vst, const float* gate, const int64_t* gst,
                      float* out, int64_t B, int64_t Hq, int64_t Hkv, int64_t L, int64_t S,
                      int64_t D, float scale) {
  const AttnBlock fn = attn_kernel();
  // Tasks: (batch, head, block of 16 queries); later blocks see more keys, the pool's atomic
  // claiming balances them.
  constexpr int64_t QB = 16;
  const int64_t nqb = (L + QB - 1) / QB;
  const int64_t rep = Hq / Hkv;
  parallel_for(B * Hq * nqb, L * S < 64 * 64, [&](int64_t t) {
    const int64_t qb = t % nqb, h = (t / nqb) % Hq, b = t / (nqb * Hq);
    const int64_t hk = h / rep;
    const float* qh = q + b * qst[0] + h * qst[1];
    const float* kh = k + b * kst[0] + hk * kst[1];
    const float* vh = v + b * vst[0] + hk * vst[1];
    float* oh = out + (b * L * Hq + h) * D;  // [B, L, Hq, D]: row i at oh + i * Hq * D
    const float* gh = gate ? gate + b * gst[0] + h * gst[2] : nullptr;  // gate [B, L, Hq, D]
    fn(qh, qst[2], kh, kst[2], vh, vst[2], D, qb * QB, std::min(L, (qb + 1) * QB), S - L, scale,
       oh, Hq * D, gh, gate ? gst[1] : 0);
  });
}

void decode_attention_rows(const float* q, const float* const* k, const float* const* v,
                           const int64_t* cap, const int64_t* S, const float* gate, float* out,
                           int64_t B, int64_t Hq, int64_t Hkv, int64_t D, float scale) {
  const AttnBlock fn = attn_kernel();
  const int64_t rep = Hq / Hkv;
  // One thread below ~1 M multiply-adds (a short context of one sequence: ~50 us of work, a
  // few times the pool's wake-up), the pool above.
  int64_t work = 0;
  for (int64_t b = 0; b < B; b++) work += S[b];
  parallel_for(B * Hq, work * Hq * D * 2 < (int64_t(1) << 20), [&](int64_t t) {
    const int64_t b = t / Hq, h = t % Hq, hk = h / rep;
    // As causal_attention's task for (b, h) with L = 1: query row 0, keys 0 .. S - 1.
    fn(q + t * D, D, k[b] + hk * cap[b] * D, D, v[b] + hk * cap[b] * D, D, D, 0, 1, S[b] - 1,
       scale, out + t * D, Hq * D, gate ? gate + t * D : nullptr, Hq * D);
  });
}

}  // namespace pqk
