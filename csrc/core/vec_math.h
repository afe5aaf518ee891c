// exp and silu on 8 floats at a time (GCC/Clang vector extensions, any ISA): the elementwise
// tails of prefill (the conv's silu over 512 x 8192 values per layer, the MoE block's SwiGLU
// over 512 x 8 x 512) were bound by one libm expf call per value.
#pragma once

#include <cstdint>
#include <cstring>

namespace pqk {
namespace vm {

typedef float f8 __attribute__((vector_size(32)));
typedef int32_t i8v __attribute__((vector_size(32)));

static inline f8 load(const float* p) {
  f8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

static inline void store(float* p, f8 v) { std::memcpy(p, &v, sizeof v); }

// expf within ~2 ulp (Cephes' polynomial after reduction by ln 2); inputs clamped to the range
// where the result is a normal float or 0 / large.
static inline f8 exp(f8 x) {
  x = x < -87.3f ? f8{} - 87.3f : x;
  x = x > 88.7f ? f8{} + 88.7f : x;
  const f8 n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round(x / ln 2)
  f8 r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  f8 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.f;
  const i8v e = (__builtin_convertvector(n, i8v) + 127) << 23;
  f8 s;
  std::memcpy(&s, &e, sizeof s);
  return p * s;
}

static inline f8 silu(f8 x) { return x / (1.f + exp(-x)); }

}  // namespace vm
}  // namespace pqk
