// FAST quantized GEMM (many activation rows per weight matrix): internal interface between the
// driver (qkernels.cpp's gather_qmm), qk_gemm.cpp and the per-ISA kernels (qk_gemm_x86.cpp).
#pragma once

#include <cstdint>
#include <vector>

#include "qkernels.h"

namespace pqk {
namespace detail {

// Per-ISA GEMM kernels (qk_gemm.inc compiled for one ISA).
struct GemmKernels {
  int W;   // output rows per panel (32-bit lanes per vector)
  int MR;  // activation rows per kernel call (most)
  bool bits[9];  // bit widths handled
  void (*prep_row)(const float* x, int64_t K, int gs, int bits, int8_t* q, float* xd, float* xs);
  void (*pack)(const uint8_t* w, const uint8_t* w_end, const void* scales, const void* biases,
               DType sdt, int64_t N, int64_t K, int bits, int gs, int64_t n0, uint32_t* P,
               float* sc, float* bs);
  void (*panel)(int bits, int mr, const uint32_t* P, const float* sc, const float* bs, int64_t G,
                int gs, const int8_t* const* xq, const float* const* xd, const float* const* xs,
                float* const* out);
};

// The GEMM kernels for the ISA variant in use (pqk::isa_variant()) and these bits, or nullptr.
const GemmKernels* gemm_kernels(int bits);

// Activation rows per expert from which gather_qmm takes the GEMM path in FAST mode
// (POCKET_MLX_GEMM_MIN_ROWS; 0 turns the GEMM path off).
int64_t gemm_min_rows();
void set_gemm_min_rows(int64_t n);

// The rows of one expert that go through the GEMM.
struct GemmSeg {
  int64_t e;
  const int64_t* rows;  // output rows (indices into the problem's rows)
  int64_t n;
};

// out rows of every segment = x rows . dequant(W[e])^T, FAST (int8 activations per group).
void gemm_segments(const GatherProblem& p, const GemmKernels& k, const std::vector<GemmSeg>& segs);

}  // namespace detail
}  // namespace pqk
