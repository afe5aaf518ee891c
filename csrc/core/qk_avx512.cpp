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

// u8 x s8 dot products without VNNI (AVX512BW): no saturation for 2/4-bit codes.
static inline vi qk_dot8(vi acc, vu q, vu x) {
  __m512i p = _mm512_maddubs_epi16((__m512i)q, (__m512i)x);
  return acc + (vi)_mm512_madd_epi16(p, _mm512_set1_epi16(1));
}
#include "qk_fast.inc"

}  // namespace isa_avx512
}  // namespace pqk

#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi2,avx512vnni")
namespace pqk {
namespace isa_avx512 {
namespace vnni {
static inline vi qk_dot8(vi acc, vu q, vu x) {
  return (vi)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)q, (__m512i)x);
}
#include "qk_fast.inc"
}  // namespace vnni
}  // namespace isa_avx512
}  // namespace pqk
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi2,avx512vnni,avx512vbmi")
namespace pqk {
namespace isa_avx512 {
namespace vbmi {
struct Perm6 {
  alignas(64) uint8_t c[64];
  constexpr Perm6() : c{} {
    for (int j = 0; j < 16; j++)
      for (int i = 0; i < 4; i++) c[4 * j + i] = (uint8_t)(3 * j + i);
  }
};
static constexpr Perm6 kPerm6{};
// 6-bit block (48 bytes, 64 codes) -> lane j byte i = code 4j+i: vpermb gathers each lane's 3
// bytes, vpmultishiftqb extracts the 6-bit fields, one AND clears the extra bits.
#define QK_HAVE_UNPACK6
static inline vu qk_unpack6(const uint8_t* p, const uint8_t* end) {
  alignas(64) uint8_t tmp[64];
  if (__builtin_expect(p + 64 > end, 0)) {
    std::memcpy(tmp, p, 48);
    std::memset(tmp + 48, 0, 16);
    p = tmp;
  }
  __m512i v = _mm512_loadu_si512((const void*)p);
  v = _mm512_permutexvar_epi8(_mm512_load_si512((const void*)kPerm6.c), v);
  const long long ctl = (long long)(0ull | (6ull << 8) | (12ull << 16) | (18ull << 24) |
                                    (32ull << 32) | (38ull << 40) | (44ull << 48) | (50ull << 56));
  v = _mm512_multishift_epi64_epi8(_mm512_set1_epi64(ctl), v);
  return (vu)_mm512_and_si512(v, _mm512_set1_epi8(0x3F));
}
static inline vi qk_dot8(vi acc, vu q, vu x) {
  return (vi)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)q, (__m512i)x);
}
#include "qk_fast.inc"
#undef QK_HAVE_UNPACK6
}  // namespace vbmi
#undef QK_W
}  // namespace isa_avx512
}  // namespace pqk
#pragma GCC pop_options

namespace pqk {
namespace detail {
extern const IsaOps avx512_ops;
extern const IsaOps avx512vnni_ops;
extern const IsaOps avx512vbmi_ops;
// maddubs would saturate for 8-bit codes: FAST handles 1/2/4/6 bits without VNNI, 1/2/4/6/8 with it
// (6-bit: 63 * 127 * 2 < 32767).
const IsaOps avx512_ops = {"avx512", 16, &isa_avx512::rows_exact, &isa_avx512::rows_fast,
                           {false, true, true, false, true, false, true, false, false}, "avx512"};
const IsaOps avx512vnni_ops = {"avx512", 16, &isa_avx512::rows_exact, &isa_avx512::vnni::rows_fast,
                               {false, true, true, false, true, false, true, false, true},
                               "avx512-vnni"};
const IsaOps avx512vbmi_ops = {"avx512", 16, &isa_avx512::rows_exact, &isa_avx512::vbmi::rows_fast,
                               {false, true, true, false, true, false, true, false, true},
                               "avx512-vbmi"};
}  // namespace detail
}  // namespace pqk
#endif
