// x86 builds of the FAST GEMM kernels (qk_gemm.inc): AVX-512 with VNNI (vpdpbusd), AVX-512BW
// and AVX2 (vpmaddubsw + vpmaddwd). Enabled by `#pragma GCC target`, only called after the
// driver's ISA pick from cpu_features() (through pqk::isa_variant()).
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "qk_gemm.h"
#include "qk_internal.h"

// 16 rows of 16 dwords (row i at src + i * stride bytes) -> dst[c * 16 + i] = row i dword c.
// One copy for both AVX-512 builds below: compiled for their common target (the VNNI build's is
// a superset, so it inlines there as it did when each build had its own copy).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi2")
namespace pqk {
namespace gemm_x86 {
static inline void qk_transpose16(const uint8_t* src, int64_t stride, uint32_t* dst) {
  __m512i r[16], t[16], u[16], v[16];
  for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512((const void*)(src + i * stride));
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // u[i + k] lane j: column 4j + k of rows i..i+3
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int h = 0; h < 16; h += 8)
    for (int k = 0; k < 4; k++) {
      v[h + k] = _mm512_shuffle_i32x4(u[h + k], u[h + k + 4], 0x88);
      v[h + k + 4] = _mm512_shuffle_i32x4(u[h + k], u[h + k + 4], 0xdd);
    }
  for (int c = 0; c < 16; c++) {
    const __m512i o = c < 8 ? _mm512_shuffle_i32x4(v[c % 8], v[8 + c % 8], 0x88)
                            : _mm512_shuffle_i32x4(v[c % 8], v[8 + c % 8], 0xdd);
    _mm512_storeu_si512((void*)(dst + c * 16), o);
  }
}
}  // namespace gemm_x86
}  // namespace pqk
#pragma GCC pop_options

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
using gemm_x86::qk_transpose16;
#define QK_GEMM_T16
#include "qk_gemm.inc"
#undef QK_GEMM_T16
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
using gemm_x86::qk_transpose16;
#define QK_GEMM_T16
#include "qk_gemm.inc"
#undef QK_GEMM_T16
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
