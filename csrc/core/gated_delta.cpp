// Gated delta rule recurrence (Gated DeltaNet linear attention) on the CPU.
//
// Per (batch, value head) the state S [Dv, Dk] (float32) is carried over the tokens:
//   kv    = g_t * (S k_t)
//   delta = (v_t - kv) * beta_t
//   S     = g_t * S + delta k_t^T
//   y_t   = S q_t
// One state row is 4*Dk bytes (512 B for Dk = 128): each row is read and written once per token
// while it sits in L1, so the kernel runs at memory speed where MLX's op-by-op form makes five
// passes over the whole state. Heads are independent: they are split over the thread pool.
#include <cstdint>
#include <cstring>

#include "qkernels.h"

namespace pqk {
namespace {

struct DeltaArgs {
  const float *q, *k, *v, *g, *beta, *state_in;
  float *state, *y;
  int64_t B, T, Hk, Hv, Dk, Dv;
};

typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float* p) {
  v8 r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}

static inline void store8(float* p, v8 x) { std::memcpy(p, &x, sizeof(x)); }

static inline float hsum8(v8 x) {
  return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
}

// One (batch, value head) over all tokens. Vector path when Dk is a multiple of 8.
#if defined(__x86_64__) && defined(__linux__) && !defined(__clang__)
__attribute__((target_clones("avx512f", "avx2,fma", "default")))
#endif
void delta_head(const DeltaArgs& a, int64_t b, int64_t hv) {
  const int64_t Dk = a.Dk, Dv = a.Dv, T = a.T;
  const int64_t hk = hv / (a.Hv / a.Hk);
  float* S = a.state + (b * a.Hv + hv) * Dv * Dk;
  // The first token reads the old state and writes the new one in the same pass (no separate
  // copy of the whole state when the two differ); later tokens update in place.
  const float* S_in = a.state_in + (b * a.Hv + hv) * Dv * Dk;
  const bool vec = Dk % 8 == 0;
  for (int64_t t = 0; t < T; t++) {
    const int64_t bt = b * T + t;
    const float* kt = a.k + (bt * a.Hk + hk) * Dk;
    const float* qt = a.q + (bt * a.Hk + hk) * Dk;
    const float* vt = a.v + (bt * a.Hv + hv) * Dv;
    float* yt = a.y + (bt * a.Hv + hv) * Dv;
    const float gt = a.g[bt * a.Hv + hv];
    const float betat = a.beta[bt * a.Hv + hv];
    for (int64_t dv = 0; dv < Dv; dv++) {
      float* row = S + dv * Dk;
      const float* src = (t == 0 ? S_in : S) + dv * Dk;
      float kv, out;
      if (vec) {
        v8 acc = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int64_t i = 0; i < Dk; i += 8) acc += load8(src + i) * load8(kt + i);
        kv = gt * hsum8(acc);
        const float delta = (vt[dv] - kv) * betat;
        v8 acc2 = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int64_t i = 0; i < Dk; i += 8) {
          v8 s = load8(src + i) * gt + load8(kt + i) * delta;
          store8(row + i, s);
          acc2 += s * load8(qt + i);
        }
        out = hsum8(acc2);
      } else {
        float acc = 0.f;
        for (int64_t i = 0; i < Dk; i++) acc += src[i] * kt[i];
        kv = gt * acc;
        const float delta = (vt[dv] - kv) * betat;
        float acc2 = 0.f;
        for (int64_t i = 0; i < Dk; i++) {
          const float s = src[i] * gt + kt[i] * delta;
          row[i] = s;
          acc2 += s * qt[i];
        }
        out = acc2;
      }
      yt[dv] = out;
    }
  }
}

}  // namespace

void gated_delta(const float* q, const float* k, const float* v, const float* g,
                 const float* beta, const float* state_in, float* state, float* y, int64_t B,
                 int64_t T, int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv) {
  const DeltaArgs a{q, k, v, g, beta, state_in, state, y, B, T, Hk, Hv, Dk, Dv};
  const int64_t state_bytes = B * Hv * Dv * Dk * 4;
  // Small states (one layer of a tiny model) are not worth waking the pool for.
  parallel_for(B * Hv, state_bytes * T < (1 << 20),
               [&a](int64_t i) { delta_head(a, i / a.Hv, i % a.Hv); });
}

}  // namespace pqk
