// AVX-512 kernels (F, BW, VL, DQ; VNNI used by FAST mode when present). Compiled at the baseline
// -march; the code below is enabled by `#pragma GCC target` (same as __attribute__((target)))
// and only ever called after __builtin_cpu_supports() checks.
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "qk_internal.h"
#include "qk_shuffle_ctrl.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi2")

namespace pqk {
namespace isa_avx512 {
using namespace pqk;
#define QK_W 16

template <int BITS>
static inline __attribute__((always_inline)) auto qk_shuffle_load(const uint8_t* p) {
  typedef uint32_t vu_ __attribute__((vector_size(64)));
  constexpr detail::ShufCtrl<BITS> ctl;
  constexpr int S = detail::ShufCtrl<BITS>::S;
  __m512i a = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)p));
  a = _mm512_inserti32x4(a, _mm_loadu_si128((const __m128i*)(p + S)), 1);
  a = _mm512_inserti32x4(a, _mm_loadu_si128((const __m128i*)(p + 2 * S)), 2);
  a = _mm512_inserti32x4(a, _mm_loadu_si128((const __m128i*)(p + 3 * S)), 3);
  const __m512i c = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)ctl.c));
  return (vu_)_mm512_shuffle_epi8(a, c);
}

#include "qk_simd.inc"
#undef QK_W

}  // namespace isa_avx512
}  // namespace pqk

#pragma GCC pop_options

namespace pqk {
namespace detail {
extern const IsaOps avx512_ops;
const IsaOps avx512_ops = {"avx512", 16, &isa_avx512::rows_exact, nullptr, {}};
}  // namespace detail
}  // namespace pqk
#endif
