// Causal attention for prefill (see attention.h). Why our own: MLX's CPU scaled_dot_product_attention
// materialises the score matrix and multiplies with the wheel's reference BLAS (~4 GFLOP/s here):
// ~1.6 s per full-attention layer for a 512-token prompt of the 35B shape, a third of prefill.
#include "attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "qkernels.h"
#include "vec_math.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace pqk {

// The element type of a cache's keys and values, for attn_rows' loads (attention.inc).
struct KvF32 {
  using E = float;
};
struct KvF16 {
  using E = uint16_t;
};
struct KvBF16 {
  using E = uint16_t;
};

float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);  // inf, nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int e = -1;
    uint32_t m = man;
    do {
      e++;
      m <<= 1;
    } while (!(m & 0x400));
    bits = sign | uint32_t(112 - e) << 23 | ((m & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

uint16_t float_to_half(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  const uint16_t sign = (b >> 16) & 0x8000;
  const uint32_t a = b & 0x7fffffffu;
  if (a >= 0x7f800000u) return sign | 0x7c00 | (a > 0x7f800000u ? 0x200 : 0);  // inf, nan
  if (a >= 0x477ff000u) return sign | 0x7c00;  // rounds past 65504: inf
  if (a < 0x38800000u) {  // a float16 subnormal (or zero): round a * 2^24 to an integer
    float f;
    std::memcpy(&f, &a, sizeof f);
    return sign | (uint16_t)std::nearbyint(f * 16777216.f);  // exact product, ties to even
  }
  const uint32_t r = a + 0xfff + ((a >> 13) & 1);  // round the 13 dropped bits to even
  return sign | (uint16_t)((r - 0x38000000u) >> 13);
}

uint16_t float_to_bf16(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  if ((b & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((b >> 16) | 0x40);  // quiet nan
  return (uint16_t)((b + 0x7fff + ((b >> 16) & 1)) >> 16);
}
// Up to 8 query rows that walk the same keys and values: row r's query q[r], its last key
// last[r], its output out[r] and output gate gate[r] (gate null: no gate). The rows may be
// consecutive queries of one head (prefill) or the heads that share one KV head (grouped-query
// attention: each key and value row loaded then serves them all).
struct AttnRows {
  const float* q[8];
  float* out[8];
  const float* gate[8];
  int64_t last[8];
};

}  // namespace pqk

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
#pragma GCC target("avx2,fma,f16c")
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

using AttnTile = decltype(&attn_base::attn_tile);

// FAST mode's softmax (attention.inc's attn_softmax) where the mode in use is FAST (asked for,
// and the ISA has FAST kernels: info()'s "mode"); EXACT keeps libm's expf, bit for bit.
static bool attn_fast() { return get_mode() == 1 && fast_bits_mask() != 0; }

static AttnTile attn_kernel() {
#if defined(__x86_64__) || defined(_M_X64)
  const std::string is = isa();
  if (is == "avx512") return &attn_avx512::attn_tile;
  if (is == "avx2") return &attn_avx2::attn_tile;
#endif
  return &attn_base::attn_tile;
}

void causal_attention(const float* q, const int64_t* qst, const float* k, const int64_t* kst,
                      const float* v, const int64_t* vst, const float* gate, const int64_t* gst,
                      float* out, int64_t B, int64_t Hq, int64_t Hkv, int64_t L, int64_t S,
                      int64_t D, float scale) {
  const AttnTile fn = attn_kernel();
  const bool fast = attn_fast();
  // Tasks: (batch, KV head, block of 16 queries); later blocks see more keys, the pool's atomic
  // claiming balances them. A task's rows (query i, head h of the KV head's group) go in groups
  // of 8, and all its groups walk the keys together (attn_tile): each key and value row is read
  // from memory once per task, not once per row.
  constexpr int64_t QB = 16;
  const int64_t nqb = (L + QB - 1) / QB;
  const int64_t rep = Hq / Hkv;
  parallel_for(B * Hkv * nqb, L * S < 64 * 64, [&](int64_t t) {
    const int64_t qb = t % nqb, hk = (t / nqb) % Hkv, b = t / (nqb * Hkv);
    std::vector<AttnRows> G(1);
    std::vector<int> n(1, 0);
    // The task's query rows copied together: a group's rows are heads a whole [L, D] plane
    // apart in q (a multiple of 4 KB), so each of their cache lines fell in the same L1 set.
    thread_local std::vector<float> qrows;
    qrows.resize(QB * rep * D);
    int64_t nrow = 0;
    for (int64_t i = qb * QB; i < std::min(L, (qb + 1) * QB); i++) {
      for (int64_t h = hk * rep; h < (hk + 1) * rep; h++) {
        if (n.back() == 8) {
          G.emplace_back();
          n.push_back(0);
        }
        AttnRows& R = G.back();
        const int r = n.back()++;
        float* qr = qrows.data() + nrow++ * D;
        std::memcpy(qr, q + b * qst[0] + h * qst[1] + i * qst[2], sizeof(float) * D);
        R.q[r] = qr;
        R.out[r] = out + ((b * L + i) * Hq + h) * D;  // [B, L, Hq, D]
        R.gate[r] = gate ? gate + b * gst[0] + i * gst[1] + h * gst[2] : nullptr;
        R.last[r] = S - L + i;
      }
    }
    fn(G.data(), n.data(), (int)G.size(), k + b * kst[0] + hk * kst[1], kst[2],
       v + b * vst[0] + hk * vst[1], vst[2], D, scale, gate != nullptr, KvType::f32, fast);
  });
}

void decode_attention_rows(const float* q, const void* const* k, const void* const* v,
                           const int64_t* cap, const int64_t* S, const float* gate, float* out,
                           int64_t B, int64_t Hq, int64_t Hkv, int64_t D, float scale,
                           KvType kv) {
  const AttnTile fn = attn_kernel();
  const bool fast = attn_fast();
  const int64_t rep = Hq / Hkv, ng = (rep + 7) / 8;  // groups of <= 8 heads per KV head
  // One thread below ~1 M multiply-adds (a short context of one sequence: ~50 us of work, a
  // few times the pool's wake-up), the pool above.
  int64_t work = 0;
  for (int64_t b = 0; b < B; b++) work += S[b];
  parallel_for(B * Hkv * ng, work * Hq * D * 2 < (int64_t(1) << 20), [&](int64_t t) {
    const int64_t g = t % ng, hk = (t / ng) % Hkv, b = t / (ng * Hkv);
    // As causal_attention's rows with L = 1: each head's query row 0 sees keys 0 .. S - 1; the
    // heads that share KV head hk read its keys and values together.
    const int64_t h0 = hk * rep + g * 8, h1 = std::min(h0 + 8, (hk + 1) * rep);
    AttnRows R;
    for (int64_t h = h0; h < h1; h++) {
      const int64_t row = b * Hq + h;
      R.q[h - h0] = q + row * D;
      R.out[h - h0] = out + row * D;
      R.gate[h - h0] = gate ? gate + row * D : nullptr;
      R.last[h - h0] = S[b] - 1;
    }
    const int n = (int)(h1 - h0);
    const int64_t at = hk * cap[b] * D * (kv == KvType::f32 ? 4 : 2);  // bytes
    fn(&R, &n, 1, static_cast<const char*>(k[b]) + at, D, static_cast<const char*>(v[b]) + at,
       D, D, scale, gate != nullptr, kv, fast);
  });
}

}  // namespace pqk
