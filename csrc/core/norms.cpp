// RMSNorm over the last axis, optionally times a weight and gated by silu(gate), in float32.
//
// Why here: on the CPU, mx.fast.rms_norm is MLX's composed fallback (square, mean, rsqrt, two
// multiplies, broadcasts): about ten graph nodes and ~65 us per call for one 2048-wide row,
// and a decode step of Qwen3.5-MoE makes ~190 of them. One pass per row here.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "qkernels.h"
#include "vec_math.h"

namespace pqk {

// 8 floats per vector when D allows (vm::silu for the gate instead of one expf per value),
// compiled for AVX-512 / AVX2 as well; a fixed summation order either way.
#if defined(__x86_64__) && defined(__linux__) && !defined(__clang__)
__attribute__((target_clones("avx512f", "avx2,fma", "default")))
#endif
static void norm_row(const float* x, const float* w, const float* gate, float* out, int64_t D,
                     float eps) {
  const int64_t D8 = D % 8 == 0 ? D : 0;
  vm::f8 acc = vm::f8{};
  for (int64_t i = 0; i < D8; i += 8) {
    const vm::f8 v = vm::load(x + i);
    acc += v * v;
  }
  float ss = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
  for (int64_t i = D8; i < D; i++) ss += x[i] * x[i];
  const float inv = 1.f / std::sqrt(ss / (float)D + eps);
  for (int64_t i = 0; i < D8; i += 8) {
    vm::f8 y = vm::load(x + i) * inv;
    if (w) y *= vm::load(w + i);
    if (gate) {
      const vm::f8 g = vm::load(gate + i);
      y *= vm::silu(g);
    }
    vm::store(out + i, y);
  }
  for (int64_t i = D8; i < D; i++) {
    float y = x[i] * inv;
    if (w) y *= w[i];
    if (gate) {
      const float g = gate[i];
      y *= g / (1.f + std::exp(-g));
    }
    out[i] = y;
  }
}

void rms_norm(const float* x, const float* w, const float* gate, float* out, int64_t rows,
              int64_t D, float eps) {
  // Decode rows are tiny: run inline; split long prefill batches over the pool.
  const bool single = rows * D < (1 << 18);
  const int64_t per = single ? rows : (rows + 63) / 64;
  parallel_for((rows + per - 1) / per, single, [&](int64_t t) {
    const int64_t r1 = std::min(rows, (t + 1) * per);
    for (int64_t r = t * per; r < r1; r++)
      norm_row(x + r * D, w, gate ? gate + r * D : nullptr, out + r * D, D, eps);
  });
}

}  // namespace pqk
