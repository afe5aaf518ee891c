// Panel layout: the CPU weight layout the row-panel kernels (qk_panel.inc) read, built once from
// the MLX layout (qk_panel.cpp). Internal interface between the driver (qkernels.cpp), the
// packer and the per-ISA kernels.
//
// Why: MLX stores codes, scales and biases as three arrays; a decode matvec over MoE rows only
// 128-256 bytes long then pays a fixed per-row epilogue (horizontal sum, scale set-up) and reads
// three streams. A panel puts W = 16 weight rows in the 16 lanes of a vector (no horizontal sum)
// and one record per (panel, group) holds the 16 rows' codes, then their 16 scales, then their 16
// biases: one sequential stream per task.
//
// Record of panel p, group g (rows 16p..16p+15, values g*gs..g*gs+gs-1), bytes:
//   codes  16 * gs * bits / 8, as dwords [u][16 lanes] (lane r = row 16p + r):
//          2/4/8 bits: dword u of a row holds the 4*S codes u*4S + 4s + i (S = 8 / bits steps)
//          at byte i, bits s*bits..s*bits+bits-1, so `(d >> s*bits) & mask` gives 4 codes in
//          natural order and the activations are read in natural order, 4 bytes per step.
//          6 bits: per 16 codes, three dwords [lo0, lo1, hi]: the low 4 bits of the codes as a
//          4-bit pair of dwords, the high 2 bits as one 2-bit dword.
//   scales 16 values of the matrix's scale dtype (2 or 4 bytes), then biases, the same.
// Records go panel-major (all groups of panel 0, then panel 1, ...), experts one after another;
// rows past N are zero (their outputs are not stored).
#pragma once

#include <cstdint>

#include "qkernels.h"

namespace pqk {
namespace detail {

constexpr int PANEL_W = 16;

struct PanelMatrix {
  const uint8_t* data = nullptr;  // the records (2 MiB aligned)
  int64_t bytes = 0;              // allocation size
  int64_t E = 1, N = 0, K = 0, npan = 0;
  int bits = 2, gs = 64;
  DType sdt = F32;
  const void* scales_src = nullptr;  // the MLX scales and biases it was packed from: a call
  const void* biases_src = nullptr;  // with others means they were replaced after packing
  int64_t rec_bytes = 0;  // one record
  int64_t code_bytes = 0;  // codes part of a record
  const uint8_t* panel(int64_t e, int64_t p) const {
    return data + ((e * npan + p) * (K / gs)) * rec_bytes;
  }
};

// Bits the panel layout holds (others stay in the MLX layout).
inline bool panel_bits_ok(int bits) { return bits == 2 || bits == 4 || bits == 6 || bits == 8; }

// The registered panel copy of the matrix whose MLX weights start at `w`, or nullptr.
const PanelMatrix* panel_find(const void* w);
// True when `p` points into the MLX weights of a registered matrix (whose pages may have been
// released): a view of packed weights that no kernel can read.
bool panel_covers(const void* p);

// Arguments of one panel kernel call: rows [p0 * 16, ...) of one expert, panels [p0, p1), mr
// activation rows (FAST: int8 codes in natural order, scales and sums per group; EXACT: float32
// in natural order and sums per group), outputs written for rows < N.
struct PanelArgs {
  const PanelMatrix* m;
  int64_t e, p0, p1;
  int mr;
  const int8_t* const* xq;
  const float* const* xd;
  const float* const* xf;
  const float* const* xs;
  void* const* out;
  DType odt;
  int64_t pf;  // software prefetch distance in bytes (panel_prefetch())
  // FAST, mr >= 2: the pass's mr rows' activations interleaved in one record per group, or
  // nullptr (the kernels read xq, xd, xs). Record g (panel_xi_record(gs, mr) bytes): the codes,
  // 4 bytes a row a step (row m's codes g*gs + 4t.. at 4 * (t * mr + m)), then the rows' xd[g],
  // then their xs[g] (floats). Why: the rows' codes, scales and sums read from 3 * mr places
  // took the hardware prefetcher off the weight stream (bench_core, one thread, an 8-row 4-bit
  // 2048x8192 product from DRAM: 982 us, 825 us interleaved, 735 us with the weights in cache).
  const int8_t* xi = nullptr;
};

// Bytes of one group's record of `rows` interleaved activation rows (PanelArgs::xi).
constexpr int64_t panel_xi_record(int64_t gs, int64_t rows) { return (gs + 8) * rows; }

typedef void (*PanelFn)(const PanelArgs&);

struct PanelKernels {
  const char* variant;
  PanelFn fast;   // nullptr: FAST runs the exact kernel
  PanelFn exact;
  bool fast_bits[9];
};

// Prefetch distance of the panel kernels: POCKET_MLX_PANEL_PF bytes (read once), default measured
// with bench_core PANEL=1 (csrc/tests/bench_core.cpp).
int64_t panel_prefetch();

// The panel kernels for the ISA variant in use (isa_variant()).
const PanelKernels& panel_kernels();

}  // namespace detail
}  // namespace pqk
