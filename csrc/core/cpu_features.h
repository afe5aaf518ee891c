// What this CPU can run, asked of the CPU (x86) or the OS (AArch64) in one place: the ISA pick
// (qkernels.cpp's isa_by_name, qk_neon.cpp's neon_select) and the kernels with their own AVX-512
// paths (gated_delta.cpp, gated_delta_prefill.cpp) read these flags instead of asking again.
#pragma once

namespace pqk {
namespace detail {

struct CpuFeatures {
  // x86-64 (cpuid, through __builtin_cpu_supports); all false on other CPUs.
  bool avx2 = false, fma = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false;
  bool avx512vnni = false, avx512vbmi = false;
  // AArch64 (NEON itself is always there): the dot-product extensions, from Linux's hwcaps or
  // macOS's sysctls; all false on other CPUs.
  bool neon_dotprod = false;  // FEAT_DotProd: sdot
  bool neon_i8mm = false;     // FEAT_I8MM: usdot / usmmla; only reported together with dotprod
};

// Read once, on first use (thread-safe).
const CpuFeatures& cpu_features();

}  // namespace detail
}  // namespace pqk
