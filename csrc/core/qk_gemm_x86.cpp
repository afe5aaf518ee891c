// x86 builds of the FAST GEMM kernels (qk_gemm.inc): AVX-512 with VNNI (vpdpbusd), AVX-512BW
// and AVX2 (vpmaddubsw + vpmaddwd). Enabled by `#pragma GCC target`, only called after the
// driver's __builtin_cpu_supports() checks (through pqk::isa_variant()).
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "qk_gemm.h"
#include "qk_internal.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi2,avx512vnni")
namespace pqk {
namespace gemm_avx512vnni {
#define QK_W 16
#define QK_GEMM_MR 8
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
static inline vi qk_dot8(vi acc, vu q, vu x) {
  return (vi)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)q, (__m512i)x);
}
#include "qk_gemm.inc"
#undef QK_W
#undef QK_GEMM_MR
}  // namespace gemm_avx512vnni
}  // namespace pqk
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi2")
namespace pqk {
namespace gemm_avx512 {
#define QK_W 16
#define QK_GEMM_MR 8
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
// No saturation for codes of up to 6 bits (63 * 127 * 2 < 32767).
static inline vi qk_dot8(vi acc, vu q, vu x) {
  __m512i p = _mm512_maddubs_epi16((__m512i)q, (__m512i)x);
  return acc + (vi)_mm512_madd_epi16(p, _mm512_set1_epi16(1));
}
#include "qk_gemm.inc"
#undef QK_W
#undef QK_GEMM_MR
}  // namespace gemm_avx512
}  // namespace pqk
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi2")
namespace pqk {
namespace gemm_avx2 {
#define QK_W 8
#define QK_GEMM_MR 4  // 16 ymm registers: 4 rows x (int + float accumulator) + weights, scales
typedef int32_t vi __attribute__((vector_size(32)));
typedef uint32_t vu __attribute__((vector_size(32)));
static inline vi qk_dot8(vi acc, vu q, vu x) {
  __m256i p = _mm256_maddubs_epi16((__m256i)q, (__m256i)x);
  return acc + (vi)_mm256_madd_epi16(p, _mm256_set1_epi16(1));
}
#include "qk_gemm.inc"
#undef QK_W
#undef QK_GEMM_MR
}  // namespace gemm_avx2
}  // namespace pqk
#pragma GCC pop_options

namespace pqk {
namespace detail {
extern const GemmKernels gemm_avx512vnni_kernels, gemm_avx512_kernels, gemm_avx2_kernels;
const GemmKernels gemm_avx512vnni_kernels = {
    16, 8, {false, false, true, false, true, false, true, false, true},
    &gemm_avx512vnni::gemm_prep_row, &gemm_avx512vnni::gemm_pack, &gemm_avx512vnni::gemm_panel};
const GemmKernels gemm_avx512_kernels = {
    16, 8, {false, false, true, false, true, false, true, false, false},
    &gemm_avx512::gemm_prep_row, &gemm_avx512::gemm_pack, &gemm_avx512::gemm_panel};
const GemmKernels gemm_avx2_kernels = {
    8, 4, {false, false, true, false, true, false, true, false, false},
    &gemm_avx2::gemm_prep_row, &gemm_avx2::gemm_pack, &gemm_avx2::gemm_panel};
}  // namespace detail
}  // namespace pqk
#endif
