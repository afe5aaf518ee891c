// RMSNorm over the last axis, optionally times a weight and gated by silu(gate), in float32.
//
// Why here: on the CPU, mx.fast.rms_norm is MLX's composed fallback (square, mean, rsqrt, two
// multiplies, broadcasts): about ten graph nodes and ~65 us per call for one 2048-wide row,
// and a decode step of Qwen3.5-MoE makes ~190 of them. One pass per row here.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "qkernels.h"

namespace pqk {

static void norm_row(const float* x, const float* w, const float* gate, float* out, int64_t D,
                     float eps) {
  float ss = 0.f;
  for (int64_t i = 0; i < D; i++) ss += x[i] * x[i];
  const float inv = 1.f / std::sqrt(ss / (float)D + eps);
  for (int64_t i = 0; i < D; i++) {
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
