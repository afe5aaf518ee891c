// AVX2 + FMA kernels. Compiled at the baseline -march; enabled by `#pragma GCC target` (same as
// __attribute__((target))) and only called after __builtin_cpu_supports("avx2"/"fma") checks.
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "qk_internal.h"
#include "qk_shuffle_ctrl.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi2")

namespace pqk {
namespace isa_avx2 {
using namespace pqk;
#define QK_W 8

template <int BITS>
static inline __attribute__((always_inline)) auto qk_shuffle_load(const uint8_t* p) {
  typedef uint32_t vu_ __attribute__((vector_size(32)));
  constexpr detail::ShufCtrl<BITS> ctl;
  constexpr int S = detail::ShufCtrl<BITS>::S;
  __m256i a = _mm256_loadu2_m128i((const __m128i*)(p + S), (const __m128i*)p);
  const __m256i c = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)ctl.c));
  return (vu_)_mm256_shuffle_epi8(a, c);
}

#include "qk_simd.inc"

static inline vi qk_dot8(vi acc, vu q, vu x) {
  __m256i p = _mm256_maddubs_epi16((__m256i)q, (__m256i)x);
  return acc + (vi)_mm256_madd_epi16(p, _mm256_set1_epi16(1));
}
#include "qk_fast.inc"
#undef QK_W

}  // namespace isa_avx2
}  // namespace pqk

#pragma GCC pop_options

namespace pqk {
namespace detail {
extern const IsaOps avx2_ops;
const IsaOps avx2_ops = {"avx2", 8, &isa_avx2::rows_exact, &isa_avx2::rows_fast,
                         {false, true, true, false, true, false, true, false, false}};
}  // namespace detail
}  // namespace pqk
#endif
