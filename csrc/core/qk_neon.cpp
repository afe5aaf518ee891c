// NEON kernels (AArch64: NEON is always present). EXACT runs on any AArch64 CPU; FAST (int8
// activations) needs the dot-product instructions and comes in two variants, picked at run time
// by neon_select() from what the CPU reports (neon_cpu_features()):
//   neon-dotprod  FEAT_DotProd (Apple M1 on, Cortex-A76/Neoverse-N1 on): `sdot` (vdotq_s32),
//                 signed x signed, so codes must be < 128: 1/2/4/6-bit codes as they are, 8-bit
//                 codes as two nibbles (two sdots, the high one shifted by 4).
//   neon-i8mm     FEAT_I8MM as well (Apple M2 on, Neoverse-V1/N2 on): `usdot` (vusdotq_s32),
//                 unsigned x signed, one instruction for every bit width, like x86 VNNI's dpbusd.
// Both reuse the generic FAST kernel (qk_fast.inc) with W = 4 lanes.
#if defined(__aarch64__)
#include <arm_neon.h>

#include <cstdint>
#include <cstring>
#include <string>

#if defined(__linux__)
#include <sys/auxv.h>
#endif
#if defined(__APPLE__)
#include <sys/sysctl.h>
#include <sys/types.h>
#endif

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

// How the dot-product instructions are emitted, so that the baseline build stays armv8-a (these
// functions only run after neon_select() saw the feature):
//  - the compiler already targets the extension (__ARM_FEATURE_DOTPROD / __ARM_FEATURE_MATMUL_INT8,
//    e.g. Apple Clang's default arm64 CPU has dotprod): the intrinsic as it is;
//  - GCC: the intrinsic inside a `#pragma GCC target` region;
//  - Clang otherwise: its arm_neon.h (<= 15) does not declare the intrinsic and its assembler
//    (<= 16) takes no `.arch_extension dotprod`, so the instruction goes in as its encoding
//    (`.inst`) on fixed registers v0 (accumulator), v1 (codes), v2 (activations).
#if defined(__ARM_FEATURE_DOTPROD)
#define QK_SDOT(acc, a, b) vdotq_s32(acc, a, b)
#elif !defined(__clang__)
#define QK_SDOT(acc, a, b) vdotq_s32(acc, a, b)
#define QK_SDOT_PRAGMA
#else
#define QK_SDOT(acc, a, b) qk_inst_dot<0x4E829420u>(acc, (uint8x16_t)(a), (int8x16_t)(b))
#endif
#if defined(__ARM_FEATURE_MATMUL_INT8)
#define QK_USDOT(acc, a, b) vusdotq_s32(acc, a, b)
#elif !defined(__clang__)
#define QK_USDOT(acc, a, b) vusdotq_s32(acc, a, b)
#define QK_USDOT_PRAGMA
#else
#define QK_USDOT(acc, a, b) qk_inst_dot<0x4E829C20u>(acc, a, b)
#endif

#if defined(__clang__)
// sdot / usdot v0.4s, v1.16b, v2.16b by encoding (see above).
template <uint32_t INST>
static inline __attribute__((always_inline)) int32x4_t qk_inst_dot(int32x4_t acc, uint8x16_t a,
                                                                  int8x16_t b) {
  register int32x4_t r __asm__("v0") = acc;
  register uint8x16_t ra __asm__("v1") = a;
  register int8x16_t rb __asm__("v2") = b;
  __asm__(".inst %c3" : "+w"(r) : "w"(ra), "w"(rb), "i"(INST));
  return r;
}
#endif
}  // namespace isa_neon
}  // namespace pqk

#ifdef QK_SDOT_PRAGMA
#pragma GCC push_options
#pragma GCC target("arch=armv8.2-a+dotprod")
#endif
namespace pqk {
namespace isa_neon {
namespace dotprod {
static inline vi qk_dot8(vi acc, vu q, vu x) {
  return (vi)QK_SDOT((int32x4_t)acc, (int8x16_t)q, (int8x16_t)x);
}
// sdot is signed x signed: 8-bit codes (0..255) go as two nibbles.
#define QK_HAVE_DOT8_BITS
template <int BITS>
static inline vi qk_dot8_bits(vi acc, vu q, vu x) {
  if constexpr (BITS == 8) {
    const vi lo = qk_dot8(acc, q & 0x0F0F0F0Fu, x);
    const vi hi = qk_dot8(vi{}, (q >> 4) & 0x0F0F0F0Fu, x);
    return lo + (hi << 4);
  } else {
    return qk_dot8(acc, q, x);
  }
}
#include "qk_fast.inc"
#undef QK_HAVE_DOT8_BITS
}  // namespace dotprod
}  // namespace isa_neon
}  // namespace pqk
#ifdef QK_SDOT_PRAGMA
#pragma GCC pop_options
#endif

#ifdef QK_USDOT_PRAGMA
#pragma GCC push_options
#pragma GCC target("arch=armv8.2-a+dotprod+i8mm")
#endif
namespace pqk {
namespace isa_neon {
namespace i8mm {
// usdot (FEAT_I8MM): unsigned codes x signed activations, any code width in one instruction.
static inline vi qk_dot8(vi acc, vu q, vu x) {
  return (vi)QK_USDOT((int32x4_t)acc, (uint8x16_t)q, (int8x16_t)x);
}
#include "qk_fast.inc"
}  // namespace i8mm
#undef QK_W
}  // namespace isa_neon
}  // namespace pqk
#ifdef QK_USDOT_PRAGMA
#pragma GCC pop_options
#endif

namespace pqk {
namespace detail {

int neon_cpu_features() {
  int f = 0;
#if defined(__linux__)
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#ifndef HWCAP2_I8MM
#define HWCAP2_I8MM (1 << 13)
#endif
  const unsigned long hw = getauxval(AT_HWCAP), hw2 = getauxval(AT_HWCAP2);
  if (hw & HWCAP_ASIMDDP) f |= NEON_DOTPROD;
  if (hw2 & HWCAP2_I8MM) f |= NEON_I8MM;
#elif defined(__APPLE__)
  auto has = [](const char* name) {
    int v = 0;
    size_t len = sizeof v;
    return sysctlbyname(name, &v, &len, nullptr, 0) == 0 && v != 0;
  };
  if (has("hw.optional.arm.FEAT_DotProd")) f |= NEON_DOTPROD;
  if (has("hw.optional.arm.FEAT_I8MM")) f |= NEON_I8MM;
#endif
  // usdot is only used together with the dot-product path.
  if (!(f & NEON_DOTPROD)) f &= ~NEON_I8MM;
  return f;
}

extern const IsaOps neon_ops;
extern const IsaOps neon_dotprod_ops;
extern const IsaOps neon_i8mm_ops;
const IsaOps neon_ops = {"neon", 4, &isa_neon::rows_exact, nullptr, {}};
const IsaOps neon_dotprod_ops = {"neon", 4, &isa_neon::rows_exact, &isa_neon::dotprod::rows_fast,
                                 {false, true, true, false, true, false, true, false, true},
                                 "neon-dotprod"};
const IsaOps neon_i8mm_ops = {"neon", 4, &isa_neon::rows_exact, &isa_neon::i8mm::rows_fast,
                              {false, true, true, false, true, false, true, false, true},
                              "neon-i8mm"};

const IsaOps* neon_select(const char* name) {
  const int f = neon_cpu_features();
  const std::string n = name;
  if (n == "neon")
    return (f & NEON_I8MM) ? &neon_i8mm_ops : (f & NEON_DOTPROD) ? &neon_dotprod_ops : &neon_ops;
  if (n == "neon-base") return &neon_ops;
  if (n == "neon-dotprod") return (f & NEON_DOTPROD) ? &neon_dotprod_ops : nullptr;
  if (n == "neon-i8mm") return (f & NEON_I8MM) ? &neon_i8mm_ops : nullptr;
  return nullptr;
}

}  // namespace detail
}  // namespace pqk
#endif
