// NEON kernels (AArch64: NEON is always present).
#if defined(__aarch64__)
#include <arm_neon.h>

#include <cstdint>
#include <cstring>

#include "qk_internal.h"
#include "qk_shuffle_ctrl.h"

namespace pqk {
namespace isa_neon {
using namespace pqk;
#define QK_W 4

template <int BITS>
static inline __attribute__((always_inline)) auto qk_shuffle_load(const uint8_t* p) {
  typedef uint32_t vu_ __attribute__((vector_size(16)));
  constexpr detail::ShufCtrl<BITS> ctl;
  uint8x16_t a = vld1q_u8(p);
  uint8x16_t c = vld1q_u8(ctl.c);
  return (vu_)vqtbl1q_u8(a, c);
}

#include "qk_simd.inc"
#undef QK_W

}  // namespace isa_neon
}  // namespace pqk

namespace pqk {
namespace detail {
extern const IsaOps neon_ops;
const IsaOps neon_ops = {"neon", 4, &isa_neon::rows_exact, nullptr, {}};
}  // namespace detail
}  // namespace pqk
#endif
