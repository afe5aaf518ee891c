// Panel layout (qk_panel.h): packing from the MLX layout, unpacking back, the registry the driver
// looks matrices up in, and the kernel pick per ISA variant.
#include "qk_panel.h"

#include <sys/mman.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>

#include "qk_internal.h"

namespace pqk {
namespace detail {

extern const PanelKernels panel_kernels_avx512vnni, panel_kernels_avx512, panel_kernels_avx2,
    panel_kernels_portable;
#if defined(__aarch64__)
extern const PanelKernels panel_kernels_neon_dotprod, panel_kernels_neon_i8mm;  // qk_neon.cpp
#endif

int64_t panel_prefetch() {
  static const int64_t pf = [] {
    const char* e = std::getenv("POCKET_MLX_PANEL_PF");
    return (int64_t)(e ? std::atoll(e) : 1024);
  }();
  return pf;
}

const PanelKernels& panel_kernels() {
#if defined(__x86_64__) || defined(_M_X64)
  const std::string v = isa_variant();
  if (v == "avx512-vnni" || v == "avx512-vbmi") return panel_kernels_avx512vnni;
  if (v == "avx512") return panel_kernels_avx512;
  if (v == "avx2") return panel_kernels_avx2;
#elif defined(__aarch64__)
  // Plain NEON (no sdot) keeps the MLX layout: its row kernels run EXACT only.
  const std::string v = isa_variant();
  if (v == "neon-i8mm") return panel_kernels_neon_i8mm;
  if (v == "neon-dotprod") return panel_kernels_neon_dotprod;
#endif
  return panel_kernels_portable;
}

namespace {

// Spreads the 4 2-bit fields of a byte to bits 0, 8, 16, 24.
struct Spread2 {
  uint32_t t[256];
  constexpr Spread2() : t{} {
    for (int b = 0; b < 256; b++)
      for (int i = 0; i < 4; i++) t[b] |= (uint32_t)((b >> (2 * i)) & 3) << (8 * i);
  }
};
constexpr Spread2 kSpread2{};

// Nibbles 0..3 of v -> the low nibbles of bytes 0..3.
inline uint32_t spread4(uint32_t v) {
  v &= 0xFFFFu;
  v = (v | (v << 8)) & 0x00FF00FFu;
  return (v | (v << 4)) & 0x0F0F0F0Fu;
}

// MLX dword (code t at bits t * bits) -> panel dword (code 4s + i at byte i, bits s * bits).
inline uint32_t to_panel2(uint32_t v) {
  return kSpread2.t[v & 255] | kSpread2.t[(v >> 8) & 255] << 2 |
         kSpread2.t[(v >> 16) & 255] << 4 | kSpread2.t[v >> 24] << 6;
}
// The inverse of spread4: the low nibbles of bytes 0..3 -> nibbles 0..3.
inline uint32_t compress4(uint32_t v) {
  v = (v | (v >> 4)) & 0x00FF00FFu;
  return (v | (v >> 8)) & 0xFFFFu;
}
inline uint32_t to_panel4(uint32_t v) { return spread4(v) | spread4(v >> 16) << 4; }

// Code c (0..4S-1) of a panel dword.
inline uint32_t panel_code(uint32_t d, int bits, int c) {
  return (d >> (8 * (c & 3) + (c >> 2) * bits)) & ((1u << bits) - 1u);
}

struct Registry {
  std::shared_mutex mu;
  std::unordered_map<const void*, PanelMatrix> m;
  std::map<uintptr_t, uintptr_t> ranges;  // MLX weight bytes [start, end) of each matrix
};
Registry& registry() {
  static Registry* r = new Registry;  // never destroyed: kernels may run during exit
  return *r;
}

constexpr int64_t kHuge = 2 << 20;

// Matrices of 2 MiB and more: 2 MiB aligned with transparent huge pages asked for; the size is
// not rounded up to huge pages (that cost a small model's ~50 matrices 2 MiB each in RSS: the
// kernel backs only the whole 2 MiB chunks with huge pages). Smaller ones: cache-line aligned.
uint8_t* alloc_huge(int64_t bytes) {
  void* p = nullptr;
  if (bytes < kHuge) {
    if (posix_memalign(&p, 64, (bytes + 63) / 64 * 64) != 0) return nullptr;
    return static_cast<uint8_t*>(p);
  }
  const int64_t sz = (bytes + 4095) / 4096 * 4096;
  if (posix_memalign(&p, kHuge, sz) != 0) return nullptr;
#ifdef MADV_HUGEPAGE
  madvise(p, sz, MADV_HUGEPAGE);
#endif
  return static_cast<uint8_t*>(p);
}

// Packs rows [16p, 16p + 16) of expert e into its records.
void pack_panel(const QMatrix& q, const PanelMatrix& pm, int64_t e, int64_t p) {
  const int64_t N = q.N, K = q.K, gs = q.group_size, G = K / gs;
  const int bits = q.bits;
  const int64_t row_bytes = K * bits / 8;
  const int ssz = q.sdt == F32 ? 4 : 2;
  const uint8_t* wb = reinterpret_cast<const uint8_t*>(q.w) + e * N * row_bytes;
  const uint8_t* sb = static_cast<const uint8_t*>(q.scales) + e * N * G * ssz;
  const uint8_t* bb = static_cast<const uint8_t*>(q.biases) + e * N * G * ssz;
  uint8_t* rec0 = const_cast<uint8_t*>(pm.panel(e, p));
  // A full panel writes every byte below; only a last, partial one has rows to zero.
  if ((p + 1) * PANEL_W > N) std::memset(rec0, 0, G * pm.rec_bytes);
  for (int r = 0; r < PANEL_W; r++) {
    const int64_t n = p * PANEL_W + r;
    if (n >= N) break;
    const uint8_t* wr = wb + n * row_bytes;
    for (int64_t g = 0; g < G; g++) {
      uint8_t* rec = rec0 + g * pm.rec_bytes;
      uint32_t* cw = reinterpret_cast<uint32_t*>(rec);
      const uint8_t* src = wr + g * gs * bits / 8;
      if (bits == 6) {
        for (int64_t u = 0; u < gs / 16; u++) {
          uint32_t c[16];
          for (int t = 0; t < 16; t++) c[t] = get_q(src, 16 * u + t, 6);
          uint32_t lo0 = 0, lo1 = 0, hi = 0;
          for (int t = 0; t < 16; t++) {
            const int tt = t & 7;
            (t < 8 ? lo0 : lo1) |= (c[t] & 15u) << (8 * (tt & 3) + 4 * (tt >> 2));
            hi |= (c[t] >> 4) << (8 * (t & 3) + 2 * (t >> 2));
          }
          cw[(3 * u) * PANEL_W + r] = lo0;
          cw[(3 * u + 1) * PANEL_W + r] = lo1;
          cw[(3 * u + 2) * PANEL_W + r] = hi;
        }
      } else {
        const int64_t nu = gs * bits / 32;
        for (int64_t u = 0; u < nu; u++) {
          uint32_t v;
          std::memcpy(&v, src + 4 * u, 4);
          cw[u * PANEL_W + r] = bits == 2 ? to_panel2(v) : bits == 4 ? to_panel4(v) : v;
        }
      }
      std::memcpy(rec + pm.code_bytes + r * ssz, sb + (n * G + g) * ssz, ssz);
      std::memcpy(rec + pm.code_bytes + (PANEL_W + r) * ssz, bb + (n * G + g) * ssz, ssz);
    }
  }
}

// The inverse of pack_panel: rows of panel p of expert e back into the MLX arrays.
void unpack_panel(const PanelMatrix& pm, int64_t e, int64_t p, uint32_t* w, void* scales,
                  void* biases) {
  const int64_t N = pm.N, K = pm.K, gs = pm.gs, G = K / gs;
  const int bits = pm.bits;
  const int64_t row_bytes = K * bits / 8;
  const int ssz = pm.sdt == F32 ? 4 : 2;
  uint8_t* wb = reinterpret_cast<uint8_t*>(w) + e * N * row_bytes;
  uint8_t* sb = static_cast<uint8_t*>(scales) + e * N * G * ssz;
  uint8_t* bb = static_cast<uint8_t*>(biases) + e * N * G * ssz;
  const uint8_t* rec0 = pm.panel(e, p);
  for (int r = 0; r < PANEL_W; r++) {
    const int64_t n = p * PANEL_W + r;
    if (n >= N) break;
    uint8_t* wr = wb + n * row_bytes;
    for (int64_t g = 0; g < G; g++) {
      const uint8_t* rec = rec0 + g * pm.rec_bytes;
      const uint32_t* cw = reinterpret_cast<const uint32_t*>(rec);
      uint8_t* dst = wr + g * gs * bits / 8;
      if (bits == 6) {
        for (int64_t u = 0; u < gs / 16; u++) {
          const uint32_t lo0 = cw[(3 * u) * PANEL_W + r], lo1 = cw[(3 * u + 1) * PANEL_W + r];
          const uint32_t hi = cw[(3 * u + 2) * PANEL_W + r];
          for (int j = 0; j < 4; j++) {  // codes 4j..4j+3 -> 3 bytes
            uint32_t v = 0;
            for (int i = 0; i < 4; i++) {
              const int t = 4 * j + i;
              const uint32_t c = panel_code(t < 8 ? lo0 : lo1, 4, t & 7) | panel_code(hi, 2, t) << 4;
              v |= c << (6 * i);
            }
            uint8_t* d = dst + 12 * u + 3 * j;
            d[0] = (uint8_t)v;
            d[1] = (uint8_t)(v >> 8);
            d[2] = (uint8_t)(v >> 16);
          }
        }
      } else {
        for (int64_t u = 0; u < gs * bits / 32; u++) {
          const uint32_t d = cw[u * PANEL_W + r];
          const uint32_t v = bits == 2 ? to_panel2(d)  // a 4x4 transpose: its own inverse
                             : bits == 4 ? compress4(d & 0x0F0F0F0Fu) | compress4((d >> 4) & 0x0F0F0F0Fu) << 16
                                         : d;
          std::memcpy(dst + 4 * u, &v, 4);
        }
      }
      std::memcpy(sb + (n * G + g) * ssz, rec + pm.code_bytes + r * ssz, ssz);
      std::memcpy(bb + (n * G + g) * ssz, rec + pm.code_bytes + (PANEL_W + r) * ssz, ssz);
    }
  }
}

}  // namespace

const PanelMatrix* panel_find(const void* w) {
  Registry& R = registry();
  std::shared_lock<std::shared_mutex> lk(R.mu);
  if (R.m.empty()) return nullptr;
  auto it = R.m.find(w);
  return it == R.m.end() ? nullptr : &it->second;
}

bool panel_covers(const void* p) {
  Registry& R = registry();
  std::shared_lock<std::shared_mutex> lk(R.mu);
  if (R.ranges.empty()) return false;
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  auto it = R.ranges.upper_bound(a);
  if (it == R.ranges.begin()) return false;
  --it;
  return a < it->second;
}

}  // namespace detail

using namespace detail;

int64_t panel_pack(const QMatrix& q) {
  if (!panel_bits_ok(q.bits) || !supported(q.bits, q.group_size, q.K) || q.N <= 0 || q.E <= 0)
    return 0;
  if (panel_find(q.w) || std::string(panel_kernels().variant) == "portable") return 0;
  PanelMatrix pm;
  pm.E = q.E;
  pm.N = q.N;
  pm.K = q.K;
  pm.bits = q.bits;
  pm.gs = q.group_size;
  pm.sdt = q.sdt;
  pm.scales_src = q.scales;
  pm.biases_src = q.biases;
  pm.npan = (q.N + PANEL_W - 1) / PANEL_W;
  pm.code_bytes = (int64_t)PANEL_W * q.group_size * q.bits / 8;
  pm.rec_bytes = pm.code_bytes + 2 * PANEL_W * (q.sdt == F32 ? 4 : 2);
  pm.bytes = pm.E * pm.npan * (q.K / q.group_size) * pm.rec_bytes;
  uint8_t* data = alloc_huge(pm.bytes);
  if (!data) return 0;
  pm.data = data;
  parallel_for(pm.E * pm.npan, false,
               [&](int64_t i) { pack_panel(q, pm, i / pm.npan, i % pm.npan); });
  Registry& R = registry();
  std::unique_lock<std::shared_mutex> lk(R.mu);
  R.m[q.w] = pm;
  const uintptr_t a = reinterpret_cast<uintptr_t>(q.w);
  R.ranges[a] = a + (uintptr_t)(q.E * q.N * q.K * q.bits / 8);
  return pm.bytes;
}

bool panel_unpack(const void* key, uint32_t* w, void* scales, void* biases) {
  const PanelMatrix* pm = panel_find(key);
  if (!pm) return false;
  parallel_for(pm->E * pm->npan, false, [&](int64_t i) {
    unpack_panel(*pm, i / pm->npan, i % pm->npan, w, scales, biases);
  });
  return true;
}

bool panel_release(const void* key) {
  Registry& R = registry();
  std::unique_lock<std::shared_mutex> lk(R.mu);
  auto it = R.m.find(key);
  if (it == R.m.end()) return false;
  std::free(const_cast<uint8_t*>(it->second.data));
  R.m.erase(it);
  R.ranges.erase(reinterpret_cast<uintptr_t>(key));
  return true;
}

int64_t panel_bytes_total() {
  Registry& R = registry();
  std::shared_lock<std::shared_mutex> lk(R.mu);
  int64_t t = 0;
  for (const auto& kv : R.m) t += kv.second.bytes;
  return t;
}

int64_t release_pages(void* p, int64_t bytes) {
  const int64_t pg = 4096;
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  const uintptr_t lo = (a + pg - 1) / pg * pg, hi = (a + bytes) / pg * pg;
  if (hi <= lo) return 0;
  if (madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED) != 0) return 0;
  return (int64_t)(hi - lo);
}

}  // namespace pqk
