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

void causal_attention(const float* q, const int64_t* qst, const float* k, const int64_t* kst,
                      const float* v, const int64_t* vst, const float* gate, const int64_t* gst,
                      float* out, int64_t B, int64_t Hq, int64_t Hkv, int64_t L, int64_t S,
                      int64_t D, float scale) {
  auto fn = &attn_base::attn_block;
#if defined(__x86_64__) || defined(_M_X64)
  const std::string is = isa();
  if (is == "avx512")
    fn = &attn_avx512::attn_block;
  else if (is == "avx2")
    fn = &attn_avx2::attn_block;
#endif
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

}  // namespace pqk
