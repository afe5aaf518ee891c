// CPU feature detection for x86-64 and AArch64 (see cpu_features.h).
#include "cpu_features.h"

#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#endif
#if defined(__aarch64__) && defined(__APPLE__)
#include <sys/sysctl.h>
#include <sys/types.h>
#endif

namespace pqk {
namespace detail {
namespace {

CpuFeatures detect() {
  CpuFeatures f;
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  f.avx2 = __builtin_cpu_supports("avx2");
  f.fma = __builtin_cpu_supports("fma");
  f.avx512f = __builtin_cpu_supports("avx512f");
  f.avx512bw = __builtin_cpu_supports("avx512bw");
  f.avx512vl = __builtin_cpu_supports("avx512vl");
  f.avx512dq = __builtin_cpu_supports("avx512dq");
  f.avx512vnni = __builtin_cpu_supports("avx512vnni");
  f.avx512vbmi = __builtin_cpu_supports("avx512vbmi");
#endif
#if defined(__aarch64__)
#if defined(__linux__)
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#ifndef HWCAP2_I8MM
#define HWCAP2_I8MM (1 << 13)
#endif
  const unsigned long hw = getauxval(AT_HWCAP), hw2 = getauxval(AT_HWCAP2);
  f.neon_dotprod = (hw & HWCAP_ASIMDDP) != 0;
  f.neon_i8mm = (hw2 & HWCAP2_I8MM) != 0;
#elif defined(__APPLE__)
  auto has = [](const char* name) {
    int v = 0;
    size_t len = sizeof v;
    return sysctlbyname(name, &v, &len, nullptr, 0) == 0 && v != 0;
  };
  f.neon_dotprod = has("hw.optional.arm.FEAT_DotProd");
  f.neon_i8mm = has("hw.optional.arm.FEAT_I8MM");
#endif
  // usdot is only used together with the dot-product path.
  if (!f.neon_dotprod) f.neon_i8mm = false;
#endif
  return f;
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures f = detect();
  return f;
}

}  // namespace detail
}  // namespace pqk
