// Internal helpers shared by the driver and the per-ISA kernels. Everything here is `static
// inline` (internal linkage) so that copies compiled inside ISA-specific translation units never
// get merged with baseline copies by the linker.
#pragma once

#include <cstdint>
#include <cstring>

#include "qkernels.h"

// Always inlined: these run inside AVX/AVX-512 kernels; an out-of-line copy compiled for the
// baseline (legacy SSE encoding) would pay SSE/AVX transition penalties on every call.
#define QK_INLINE __attribute__((always_inline))

namespace pqk {
namespace detail {

static inline QK_INLINE float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

static inline QK_INLINE float f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t man = h & 0x3ffu;
  uint32_t u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: normalize
      int e = -1;
      do {
        e++;
        man <<= 1;
      } while ((man & 0x400u) == 0);
      man &= 0x3ffu;
      u = sign | ((uint32_t)(127 - 15 - e) << 23) | (man << 13);
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (man << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

static inline QK_INLINE uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return (uint16_t)(u >> 16);
}

static inline QK_INLINE uint16_t f32_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);  // NaN
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  // overflow (rounds to inf)
  if (a < 0x38800000u) {  // subnormal or zero in half precision
    if (a < 0x33000000u) return (uint16_t)sign;  // < half of smallest subnormal
    uint32_t e = a >> 23;
    uint32_t m = (a & 0x7fffffu) | 0x800000u;
    int shift = 126 - (int)e;  // 14..24: value = m * 2^(e-150); half subnormal unit 2^-24
    uint32_t r = m >> shift;
    uint32_t rem = m & ((1u << shift) - 1);
    uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (r & 1u))) r++;
    return (uint16_t)(sign | r);
  }
  uint32_t r = a + 0xfffu + ((a >> 13) & 1u) - 0x38000000u;  // rebias 127 -> 15, round
  return (uint16_t)(sign | (r >> 13));
}

static inline QK_INLINE float load_elem(const void* p, DType dt, int64_t i) {
  switch (dt) {
    case F32:
      return static_cast<const float*>(p)[i];
    case F16:
      return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
    default:
      return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
  }
}

static inline QK_INLINE void store_elem(void* p, DType dt, int64_t i, float v) {
  switch (dt) {
    case F32:
      static_cast<float*>(p)[i] = v;
      break;
    case F16:
      static_cast<uint16_t*>(p)[i] = f32_to_f16(v);
      break;
    default:
      static_cast<uint16_t*>(p)[i] = f32_to_bf16(v);
      break;
  }
}

static inline QK_INLINE void convert_to_f32(const void* p, DType dt, int64_t off, int64_t n, float* dst) {
  if (dt == F32) {
    std::memcpy(dst, static_cast<const float*>(p) + off, n * sizeof(float));
  } else if (dt == BF16) {
    const uint16_t* s = static_cast<const uint16_t*>(p) + off;
    for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(p) + off;
    for (int64_t i = 0; i < n; i++) dst[i] = f16_to_f32(s[i]);
  }
}

// Code q of value k in a row (bit stream). Never reads past the byte holding the last bit.
static inline QK_INLINE uint32_t get_q(const uint8_t* row, int64_t k, int bits) {
  int64_t bit = k * bits;
  const uint8_t* p = row + (bit >> 3);
  int sh = (int)(bit & 7);
  uint32_t v = p[0];
  if (sh + bits > 8) v |= (uint32_t)p[1] << 8;
  return (v >> sh) & ((1u << bits) - 1u);
}

// SIMD layout: a 32-bit lane holds `vals_per_lane` consecutive codes of one group. A block is
// W lanes = W * vals_per_lane values. Activations are permuted so that, inside a block, the
// vector for step t holds values j * T + t for lanes j.
constexpr int vals_per_lane(int bits) {
  return bits == 1 ? 32 : bits == 2 ? 16 : (bits == 3 || bits == 4) ? 8 : 4;
}

// FAST kernels take rows in chunks whose scales fit ~1024 floats; their scratch holds scales,
// biases and, per activation row, the combined factors and bias terms of one chunk.
constexpr int64_t fast_chunk_rows(int64_t G) { return G >= 1024 ? 1 : 1024 / G; }
constexpr int64_t fast_scratch_floats(int64_t G, int mr) {
  return (2 + mr) * (fast_chunk_rows(G) * G + 16) + mr * fast_chunk_rows(G);
}

struct RowsArgs {
  const float* const* xp;  // mr prepared activation rows (ISA layout, float32)
  int mr;
  void* const* out;  // mr output rows (element 0 of N)
  DType odt;
  const uint8_t* w;      // this expert's weights, row 0
  const uint8_t* w_end;  // end of the whole weight buffer (SIMD loads must not pass it)
  const void* scales;    // this expert's scales, row 0
  const void* biases;
  DType sdt;
  int64_t n0, n1, K;
  int bits, gs;
  float* scratch;  // >= 2 * (K / gs + 64) floats, FAST: fast_scratch_floats(K / gs, 8)
  // FAST mode only: int8 activations, per-group activation scales and sums.
  const int8_t* const* xq;
  const float* const* xd;    // [K / gs] per row: activation scale per group
  const float* const* xsum;  // [K / gs] per row: sum of activations per group
};

typedef void (*RowsFn)(const RowsArgs&);

struct IsaOps {
  const char* name;
  int W;               // 32-bit lanes per vector (1 = natural order, no permutation)
  RowsFn rows_exact;   // required
  RowsFn rows_fast;    // may be null (FAST falls back to EXACT)
  bool fast_bits[9];   // bits handled by rows_fast
  const char* variant = nullptr;  // finer name for reports ("avx512-vnni"); nullptr: name
};

#if defined(__aarch64__)
// "neon" (best this CPU runs), "neon-base" (EXACT only), "neon-dotprod", "neon-i8mm"; nullptr
// when the CPU lacks the extension or the name is none of these.
const IsaOps* neon_select(const char* name);
#endif

}  // namespace detail
}  // namespace pqk
