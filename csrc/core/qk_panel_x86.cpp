// Builds of the row-panel kernels (qk_panel.inc): AVX-512 with VNNI (vpdpbusd, broadcast
// activations), AVX-512BW without VNNI and AVX2 (vpmaddubsw + vpmaddwd: exact for codes of up to
// 6 bits, 63 * 127 * 2 < 32767), and a portable build (scalar lanes) for every other CPU. The x86
// builds are enabled by `#pragma GCC target` and only called after the driver's ISA pick.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "qk_internal.h"
#include "qk_panel.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi2,avx512vnni")
namespace pqk {
namespace panel_avx512vnni {
#define QK_W 16
#define QK_DOT_WIDE 1
typedef float pv_f __attribute__((vector_size(64)));
typedef int32_t pv_i __attribute__((vector_size(64)));
typedef uint32_t pv_u __attribute__((vector_size(64)));
static inline pv_i qk_dot8(pv_i acc, pv_u q, pv_u x) {
  return (pv_i)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)q, (__m512i)x);
}
static inline pv_f qk_fmadd(pv_f a, pv_f b, pv_f c) {
  return (pv_f)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
}
static inline pv_f qk_h2f(const uint16_t* p) {
  return (pv_f)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
}
#include "qk_panel.inc"
#undef QK_W
#undef QK_DOT_WIDE
}  // namespace panel_avx512vnni
}  // namespace pqk
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi2")
namespace pqk {
namespace panel_avx512 {
#define QK_DOT_WIDE 0
#define QK_W 16
typedef float pv_f __attribute__((vector_size(64)));
typedef int32_t pv_i __attribute__((vector_size(64)));
typedef uint32_t pv_u __attribute__((vector_size(64)));
static inline pv_i qk_dot8(pv_i acc, pv_u q, pv_u x) {
  const __m512i p = _mm512_maddubs_epi16((__m512i)q, (__m512i)x);
  return acc + (pv_i)_mm512_madd_epi16(p, _mm512_set1_epi16(1));
}
#define QK_HAVE_DOT16
static inline pv_i qk_dot16(pv_i acc, pv_u q, pv_u x) {
  return (pv_i)_mm512_add_epi16((__m512i)acc, _mm512_maddubs_epi16((__m512i)q, (__m512i)x));
}
static inline pv_i qk_widen16(pv_i acc, pv_i s) {
  return acc + (pv_i)_mm512_madd_epi16((__m512i)s, _mm512_set1_epi16(1));
}
static inline pv_f qk_fmadd(pv_f a, pv_f b, pv_f c) {
  return (pv_f)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
}
static inline pv_f qk_h2f(const uint16_t* p) {
  return (pv_f)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
}
#include "qk_panel.inc"
#undef QK_W
#undef QK_DOT_WIDE
#undef QK_HAVE_DOT16
}  // namespace panel_avx512
}  // namespace pqk
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi2")
namespace pqk {
namespace panel_avx2 {
#define QK_DOT_WIDE 0
#define QK_W 8
typedef float pv_f __attribute__((vector_size(32)));
typedef int32_t pv_i __attribute__((vector_size(32)));
typedef uint32_t pv_u __attribute__((vector_size(32)));
static inline pv_i qk_dot8(pv_i acc, pv_u q, pv_u x) {
  const __m256i p = _mm256_maddubs_epi16((__m256i)q, (__m256i)x);
  return acc + (pv_i)_mm256_madd_epi16(p, _mm256_set1_epi16(1));
}
#define QK_HAVE_DOT16
static inline pv_i qk_dot16(pv_i acc, pv_u q, pv_u x) {
  return (pv_i)_mm256_add_epi16((__m256i)acc, _mm256_maddubs_epi16((__m256i)q, (__m256i)x));
}
static inline pv_i qk_widen16(pv_i acc, pv_i s) {
  return acc + (pv_i)_mm256_madd_epi16((__m256i)s, _mm256_set1_epi16(1));
}
static inline pv_f qk_fmadd(pv_f a, pv_f b, pv_f c) {
  return (pv_f)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
}
static inline pv_f qk_h2f(const uint16_t* p) {
  return (pv_f)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
}
#include "qk_panel.inc"
#undef QK_W
#undef QK_DOT_WIDE
#undef QK_HAVE_DOT16
}  // namespace panel_avx2
}  // namespace pqk
#pragma GCC pop_options
#endif

// Portable build: 4 lanes of plain C++ (the compiler vectorizes what it can); fmaf is fused, so
// FAST results equal the SIMD builds' bit for bit.
namespace pqk {
namespace panel_portable {
#define QK_W 4
#define QK_DOT_WIDE 1
typedef float pv_f __attribute__((vector_size(16)));
typedef int32_t pv_i __attribute__((vector_size(16)));
typedef uint32_t pv_u __attribute__((vector_size(16)));
static inline pv_i qk_dot8(pv_i acc, pv_u q, pv_u x) {
  for (int j = 0; j < QK_W; j++)
    for (int i = 0; i < 4; i++)
      acc[j] += (int32_t)((q[j] >> (8 * i)) & 0xFFu) * (int32_t)(int8_t)((x[j] >> (8 * i)) & 0xFFu);
  return acc;
}
static inline pv_f qk_fmadd(pv_f a, pv_f b, pv_f c) {
  pv_f r;
  for (int j = 0; j < QK_W; j++) r[j] = std::fmaf(a[j], b[j], c[j]);
  return r;
}
static inline pv_f qk_h2f(const uint16_t* p) {
  pv_f r;
  for (int j = 0; j < QK_W; j++) r[j] = pqk::detail::f16_to_f32(p[j]);
  return r;
}
#include "qk_panel.inc"
#undef QK_W
#undef QK_DOT_WIDE
}  // namespace panel_portable
}  // namespace pqk

namespace pqk {
namespace detail {
extern const PanelKernels panel_kernels_avx512vnni, panel_kernels_avx512, panel_kernels_avx2,
    panel_kernels_portable;
#if defined(__x86_64__) || defined(_M_X64)
const PanelKernels panel_kernels_avx512vnni = {
    "avx512-vnni", &panel_avx512vnni::panel_fast, &panel_avx512vnni::panel_exact,
    {false, false, true, false, true, false, true, false, true}};
const PanelKernels panel_kernels_avx512 = {
    "avx512", &panel_avx512::panel_fast, &panel_avx512::panel_exact,
    {false, false, true, false, true, false, true, false, false}};
const PanelKernels panel_kernels_avx2 = {
    "avx2", &panel_avx2::panel_fast, &panel_avx2::panel_exact,
    {false, false, true, false, true, false, true, false, false}};
#endif
const PanelKernels panel_kernels_portable = {
    "portable", &panel_portable::panel_fast, &panel_portable::panel_exact,
    {false, false, true, false, true, false, true, false, true}};
}  // namespace detail
}  // namespace pqk
