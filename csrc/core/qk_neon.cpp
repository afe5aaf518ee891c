// NEON kernels (AArch64: NEON is always present). EXACT runs on any AArch64 CPU; FAST (int8
// activations) needs the dot-product instructions and comes in two variants, picked at run time
// by neon_select() from what the CPU reports (cpu_features.cpp):
//   neon-dotprod  FEAT_DotProd (Apple M1 on, Cortex-A76/Neoverse-N1 on): `sdot` (vdotq_s32),
//                 signed x signed, so codes must be < 128: 1/2/4/6-bit codes as they are, 8-bit
//                 codes as two nibbles (two sdots, the high one shifted by 4).
//   neon-i8mm     FEAT_I8MM as well (Apple M2 on, Neoverse-V1/N2 on): `usdot` (vusdotq_s32),
//                 unsigned x signed, one instruction for every bit width, like x86 VNNI's dpbusd;
//                 and `usmmla` 2x2 tiles where two or more activation rows share the weights.
// Both reuse the generic FAST kernel (qk_fast.inc) with W = 4 lanes.
#if defined(__aarch64__)
#include <arm_neon.h>

#include <cstdint>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "cpu_features.h"
#include "qk_internal.h"
#include "qk_panel.h"
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

// What the row-panel builds below (qk_panel.inc: sdot, usdot) share: 4 lanes, a fused
// multiply-add, float16 -> float32.
typedef float pv_f __attribute__((vector_size(16)));
typedef int32_t pv_i __attribute__((vector_size(16)));
typedef uint32_t pv_u __attribute__((vector_size(16)));
static inline pv_f qk_fmadd(pv_f a, pv_f b, pv_f c) {
  return (pv_f)vfmaq_f32((float32x4_t)c, (float32x4_t)a, (float32x4_t)b);
}
static inline pv_f qk_h2f(const uint16_t* p) {
  return (pv_f)vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)));
}

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
#if defined(__ARM_FEATURE_MATMUL_INT8) || !defined(__clang__)
#define QK_USMMLA(acc, a, b) vusmmlaq_s32(acc, a, b)
#else
#define QK_USMMLA(acc, a, b) qk_inst_dot<0x4E82AC20u>(acc, a, b)
#endif

#if defined(__clang__)
// sdot / usdot / usmmla v0.4s, v1.16b, v2.16b by encoding (see above).
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

// Row-panel kernels (qk_panel.inc) with sdot: codes shifted down to < 64 before each dot (the
// signed product needs codes < 128), so not WIDE; 8-bit codes as two nibbles (qk_dot8_bits).
namespace panel {
#define QK_DOT_WIDE 0
#define QK_HAVE_DOT8_BITS
static inline pv_i qk_dot8(pv_i acc, pv_u q, pv_u x) {
  return (pv_i)QK_SDOT((int32x4_t)acc, (int8x16_t)q, (int8x16_t)x);
}
#include "qk_panel.inc"
#undef QK_DOT_WIDE
#undef QK_HAVE_DOT8_BITS
}  // namespace panel
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

// usmmla: a 2x2 tile (2 weight rows x 2 activation rows) of 8-byte dot products per instruction,
// twice the multiply-adds of usdot; worth it when several activation rows share the weights
// (prefill, a batch, an expert picked by several tokens). Rows of W go in pairs; per block step,
// the two rows' code vectors are interleaved by 8-byte halves (zip), and so are each pair of
// activation rows, so tile lane i*2+j holds weight row i x activation row j over half the lanes.
// Each half (2 lanes = 2T codes) must lie in one group: 2T <= group size (not 1-bit at g32).
template <int BITS, int MP>
static void rows_mmla_t(const detail::RowsArgs& a) {
  constexpr int T = detail::vals_per_lane(BITS);
  constexpr int S = T / 4;
  constexpr int BV = QK_W * T;
  constexpr int BB = BV * BITS / 8;
  constexpr uint32_t BM = BITS == 1 ? 0x01010101u : BITS == 2 ? 0x03030303u
                        : BITS == 4 ? 0x0F0F0F0Fu : 0xFFFFFFFFu;
  constexpr int MR = 2 * MP;
  const int64_t K = a.K;
  const int gsh = __builtin_ctz((unsigned)a.gs);
  const int64_t G = K >> gsh;
  const int64_t nblk = K / BV;
  const int64_t kt = nblk * BV;
  const int64_t row_bytes = K * BITS / 8;
  const int64_t RC = detail::fast_chunk_rows(G) & ~(int64_t)1;  // pairs of rows (caller: >= 2)
  const int64_t stride = detail::fast_chunk_rows(G) * G + 16;
  float* sf = a.scratch;
  float* bf = sf + stride;
  float* sd[MR];
  float* bt[MR];
  for (int m = 0; m < MR; m++) {
    sd[m] = bf + stride * (1 + m);
    bt[m] = bf + stride * (1 + 8) + m * detail::fast_chunk_rows(G);
  }
  for (int64_t c0 = a.n0; c0 < a.n1; c0 += RC) {
    const int64_t rc = std::min<int64_t>(RC, a.n1 - c0);  // even: the caller passes pairs
    detail::convert_to_f32(a.scales, a.sdt, c0 * G, rc * G, sf);
    detail::convert_to_f32(a.biases, a.sdt, c0 * G, rc * G, bf);
    for (int m = 0; m < MR; m++) {
      const float* xd = a.xd[m];
      for (int64_t r = 0; r < rc; r++) {
        for (int64_t g = 0; g < G; g++) sd[m][r * G + g] = sf[r * G + g] * xd[g];
        bt[m][r] = dot_f32(bf + r * G, a.xsum[m], G);
      }
    }
    for (int64_t r = 0; r < rc; r += 2) {
      const uint8_t* w0 = a.w + (c0 + r) * row_bytes;
      const uint8_t* w1 = w0 + row_bytes;
      float32x4_t facc[MP];
      for (int p = 0; p < MP; p++) facc[p] = vdupq_n_f32(0.f);
      for (int64_t b = 0; b < nblk; b++) {
        __builtin_prefetch(w0 + b * BB + QK_PF);
        __builtin_prefetch(w1 + b * BB + QK_PF);
        const vu L0 = BITS == 6 ? qk_unpack6(w0 + b * BB, a.w_end) : vloadu(w0 + b * BB);
        const vu L1 = BITS == 6 ? qk_unpack6(w1 + b * BB, a.w_end) : vloadu(w1 + b * BB);
        int32x4_t lo[MP], hi[MP];
        for (int p = 0; p < MP; p++) lo[p] = hi[p] = vdupq_n_s32(0);
#pragma GCC unroll 8
        for (int s = 0; s < S; s++) {
          const uint64x2_t q0 = (uint64x2_t)(BITS == 6 ? L0 : (L0 >> (s * BITS)) & BM);
          const uint64x2_t q1 = (uint64x2_t)(BITS == 6 ? L1 : (L1 >> (s * BITS)) & BM);
          const uint8x16_t alo = vreinterpretq_u8_u64(vzip1q_u64(q0, q1));
          const uint8x16_t ahi = vreinterpretq_u8_u64(vzip2q_u64(q0, q1));
          for (int p = 0; p < MP; p++) {
            const int64x2_t x0 = vreinterpretq_s64_s8(vld1q_s8(a.xq[2 * p] + b * BV + s * 16));
            const int64x2_t x1 = vreinterpretq_s64_s8(vld1q_s8(a.xq[2 * p + 1] + b * BV + s * 16));
            lo[p] = QK_USMMLA(lo[p], alo, vreinterpretq_s8_s64(vzip1q_s64(x0, x1)));
            hi[p] = QK_USMMLA(hi[p], ahi, vreinterpretq_s8_s64(vzip2q_s64(x0, x1)));
          }
        }
        const int64_t glo = r * G + ((b * BV) >> gsh);
        const int64_t ghi = r * G + ((b * BV + 2 * T) >> gsh);
        for (int p = 0; p < MP; p++) {
          const float* s0 = sd[2 * p];
          const float* s1 = sd[2 * p + 1];
          const float32x4_t slo = {s0[glo], s1[glo], s0[glo + G], s1[glo + G]};
          const float32x4_t shi = {s0[ghi], s1[ghi], s0[ghi + G], s1[ghi + G]};
          facc[p] = vfmaq_f32(facc[p], vcvtq_f32_s32(lo[p]), slo);
          facc[p] = vfmaq_f32(facc[p], vcvtq_f32_s32(hi[p]), shi);
        }
      }
      for (int p = 0; p < MP; p++)
        for (int i = 0; i < 2; i++)
          for (int j = 0; j < 2; j++) {
            const int m = 2 * p + j;
            const int64_t rr = r + i;
            const uint8_t* wr = i ? w1 : w0;
            float res = facc[p][i * 2 + j] + bt[m][rr];
            for (int64_t k = kt; k < K; k++)
              res += sd[m][rr * G + (k >> gsh)] * (float)detail::get_q(wr, k, BITS) *
                     (float)a.xq[m][k];
            detail::store_elem(a.out[m], a.odt, c0 + rr, res);
          }
    }
  }
}

template <int BITS>
static void rows_mmla_bits(const detail::RowsArgs& a) {
  switch (a.mr / 2) {
    case 1: return rows_mmla_t<BITS, 1>(a);
    case 2: return rows_mmla_t<BITS, 2>(a);
    case 3: return rows_mmla_t<BITS, 3>(a);
    default: return rows_mmla_t<BITS, 4>(a);
  }
}

// One weight row x each activation row with the arithmetic of an usmmla tile (rows_mmla_t), for
// the odd last weight row of a range: usdot lanes summed by 8-byte halves (integer sums, exact,
// so equal to the tile's), then the same two fused multiply-adds per block in the same order.
template <int BITS>
static void row_mmla_order(const detail::RowsArgs& a, int64_t n) {
  constexpr int T = detail::vals_per_lane(BITS);
  constexpr int S = T / 4;
  constexpr int BV = QK_W * T;
  constexpr int BB = BV * BITS / 8;
  constexpr uint32_t BM = BITS == 1 ? 0x01010101u : BITS == 2 ? 0x03030303u
                        : BITS == 4 ? 0x0F0F0F0Fu : 0xFFFFFFFFu;
  const int64_t K = a.K;
  const int gsh = __builtin_ctz((unsigned)a.gs);
  const int64_t G = K >> gsh;
  const int64_t nblk = K / BV;
  const int64_t kt = nblk * BV;
  const int64_t row_bytes = K * BITS / 8;
  std::vector<float> sf(G), bf(G), sd(G);
  detail::convert_to_f32(a.scales, a.sdt, n * G, G, sf.data());
  detail::convert_to_f32(a.biases, a.sdt, n * G, G, bf.data());
  const uint8_t* wr = a.w + n * row_bytes;
  for (int m = 0; m < a.mr; m++) {
    for (int64_t g = 0; g < G; g++) sd[g] = sf[g] * a.xd[m][g];
    const float bt = dot_f32(bf.data(), a.xsum[m], G);
    float acc = 0.f;
    for (int64_t b = 0; b < nblk; b++) {
      const vu L = BITS == 6 ? qk_unpack6(wr + b * BB, a.w_end) : vloadu(wr + b * BB);
      vi iacc = vi{};
      for (int s = 0; s < S; s++) {
        const vu qb = BITS == 6 ? L : (L >> (s * BITS)) & BM;
        iacc = qk_dot8_bits<BITS>(iacc, qb, vloadu(a.xq[m] + b * BV + s * QK_W * 4));
      }
      const int32_t lo = iacc[0] + iacc[1], hi = iacc[2] + iacc[3];
      acc = std::fma((float)lo, sd[(b * BV) >> gsh], acc);
      acc = std::fma((float)hi, sd[(b * BV + 2 * T) >> gsh], acc);
    }
    float res = acc + bt;
    for (int64_t k = kt; k < K; k++)
      res += sd[k >> gsh] * (float)detail::get_q(wr, k, BITS) * (float)a.xq[m][k];
    detail::store_elem(a.out[m], a.odt, n, res);
  }
}

// FAST with i8mm: usmmla tiles for pairs of activation rows and pairs of weight rows. Every row
// goes through the tile arithmetic, so a row's result does not depend on how many rows share
// the product (batched decode must give each sequence the bits it gets alone): a lone or odd
// activation row is paired with itself (the tile's two results are equal; usmmla does twice
// usdot's multiply-adds, so a lone row costs what usdot would), the odd last weight row goes
// through row_mmla_order. 1-bit at group size 32 (a tile half would span two groups) uses usdot
// (rows_fast) for every row count.
static void rows_fast_mm(const detail::RowsArgs& a) {
  const int T = detail::vals_per_lane(a.bits);
  const int64_t G = a.K / a.gs;
  if (2 * T > a.gs || detail::fast_chunk_rows(G) < 2) return rows_fast(a);
  constexpr int MMAX = 8;  // rows_mmla_bits: up to 4 pairs
  for (int m0 = 0; m0 < a.mr; m0 += MMAX) {
    const int mr = std::min(MMAX, a.mr - m0);
    const int mr2 = (mr + 1) & ~1;
    const int8_t* xq[MMAX];
    const float* xd[MMAX];
    const float* xs[MMAX];
    void* out[MMAX];
    for (int m = 0; m < mr2; m++) {
      const int src = m0 + std::min(m, mr - 1);
      xq[m] = a.xq[src];
      xd[m] = a.xd[src];
      xs[m] = a.xsum[src];
      out[m] = a.out[src];
    }
    detail::RowsArgs p = a;
    p.xq = xq;
    p.xd = xd;
    p.xsum = xs;
    p.out = out;
    p.mr = mr2;
    const int64_t n1e = a.n0 + ((a.n1 - a.n0) & ~(int64_t)1);
    if (n1e > a.n0) {
      p.n1 = n1e;
      switch (a.bits) {
        case 1: rows_mmla_bits<1>(p); break;
        case 2: rows_mmla_bits<2>(p); break;
        case 4: rows_mmla_bits<4>(p); break;
        case 6: rows_mmla_bits<6>(p); break;
        default: rows_mmla_bits<8>(p); break;
      }
    }
    if (n1e < a.n1) {  // the last weight row of an odd range
      p.mr = mr;
      switch (a.bits) {
        case 1: row_mmla_order<1>(p, n1e); break;
        case 2: row_mmla_order<2>(p, n1e); break;
        case 4: row_mmla_order<4>(p, n1e); break;
        case 6: row_mmla_order<6>(p, n1e); break;
        default: row_mmla_order<8>(p, n1e); break;
      }
    }
  }
}

// Row-panel kernels (qk_panel.inc) with usdot: unsigned codes x signed activations in int32, as
// x86 VNNI's vpdpbusd, so codes are masked in place (WIDE) and 8-bit codes go as they are. (The
// usmmla tiles of rows_fast_mm would need two weight rows per lane pair: the panel layout has one
// row per 32-bit lane, so the panels use usdot for every B, as the x86 builds use vpdpbusd.)
namespace panel {
#define QK_DOT_WIDE 1
static inline pv_i qk_dot8(pv_i acc, pv_u q, pv_u x) {
  return (pv_i)QK_USDOT((int32x4_t)acc, (uint8x16_t)q, (int8x16_t)x);
}
#include "qk_panel.inc"
#undef QK_DOT_WIDE
}  // namespace panel
}  // namespace i8mm
#undef QK_W
}  // namespace isa_neon
}  // namespace pqk
#ifdef QK_USDOT_PRAGMA
#pragma GCC pop_options
#endif

namespace pqk {
namespace detail {

extern const IsaOps neon_ops;
extern const IsaOps neon_dotprod_ops;
extern const IsaOps neon_i8mm_ops;
const IsaOps neon_ops = {"neon", 4, &isa_neon::rows_exact, nullptr, {}};
const IsaOps neon_dotprod_ops = {"neon", 4, &isa_neon::rows_exact, &isa_neon::dotprod::rows_fast,
                                 {false, true, true, false, true, false, true, false, true},
                                 "neon-dotprod"};
const IsaOps neon_i8mm_ops = {"neon", 4, &isa_neon::rows_exact, &isa_neon::i8mm::rows_fast_mm,
                              {false, true, true, false, true, false, true, false, true},
                              "neon-i8mm"};

extern const PanelKernels panel_kernels_neon_dotprod, panel_kernels_neon_i8mm;
const PanelKernels panel_kernels_neon_dotprod = {
    "neon-dotprod", &isa_neon::dotprod::panel::panel_fast, &isa_neon::dotprod::panel::panel_exact,
    {false, false, true, false, true, false, true, false, true}};
const PanelKernels panel_kernels_neon_i8mm = {
    "neon-i8mm", &isa_neon::i8mm::panel::panel_fast, &isa_neon::i8mm::panel::panel_exact,
    {false, false, true, false, true, false, true, false, true}};

const IsaOps* neon_select(const char* name) {
  const CpuFeatures& f = cpu_features();
  const std::string n = name;
  if (n == "neon")
    return f.neon_i8mm ? &neon_i8mm_ops : f.neon_dotprod ? &neon_dotprod_ops : &neon_ops;
  if (n == "neon-base") return &neon_ops;
  if (n == "neon-dotprod") return f.neon_dotprod ? &neon_dotprod_ops : nullptr;
  if (n == "neon-i8mm") return f.neon_i8mm ? &neon_i8mm_ops : nullptr;
  return nullptr;
}

}  // namespace detail
}  // namespace pqk
#endif
