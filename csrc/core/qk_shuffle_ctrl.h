// Byte-shuffle control for the 3/5/6-bit SIMD layout: within each 16-byte source chunk, 4 lanes;
// lane i takes bytes (i*T*BITS)/8 + 0..2 and a zero byte (index 0x80: pshufb and tbl give 0).
#pragma once
#include <cstdint>

#include "qk_internal.h"

namespace pqk {
namespace detail {

template <int BITS>
struct ShufCtrl {
  alignas(16) uint8_t c[16];
  constexpr ShufCtrl() : c{} {
    constexpr int T = vals_per_lane(BITS);
    for (int i = 0; i < 4; i++) {
      int bo = (i * T * BITS) / 8;
      c[4 * i + 0] = (uint8_t)bo;
      c[4 * i + 1] = (uint8_t)(bo + 1);
      c[4 * i + 2] = (uint8_t)(bo + 2);
      c[4 * i + 3] = 0x80;
    }
  }
  // Source bytes per 4 lanes.
  static constexpr int S = 4 * vals_per_lane(BITS) * BITS / 8;
};

}  // namespace detail
}  // namespace pqk
