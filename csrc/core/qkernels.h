// pocket-mlx quantized CPU kernels: plain C++ core, no MLX dependency.
//
// Weight format: MLX "affine" quantization. W has logical shape [E, N, K]; every row of K values is
// a little-endian bit stream of `bits`-bit codes stored in uint32 words (3/5/6-bit codes straddle
// words), K * bits / 32 words per row. Per group of `group_size` consecutive values along K:
//   w = scale * q + bias, with scales/biases of shape [E, N, K / group_size].
// Supported: bits 1,2,3,4,5,6,8 (1-bit: 32 codes per word); group sizes 32,64,128; x/scales/out in float32/float16/bfloat16;
// accumulation in float32.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

namespace pqk {

enum DType : int { F32 = 0, F16 = 1, BF16 = 2 };

// EXACT: dequantize each weight to float32 (scale * q + bias) and FMA with float32 activations.
//        Equals MLX's quantized_matmul computed in float32 up to summation order.
// FAST:  activations quantized to int8 per group (like llama.cpp's Q8 blocks), integer dot
//        products, for the bit widths fast_bits_mask() names on the ISA in use (AVX2 and AVX-512:
//        1/2/4/6, plus 8 with VNNI; NEON with dotprod: 1/2/4/6/8 with sdot, or usdot/usmmla with i8mm);
//        every other case (3/5 bits, NEON without dotprod, scalar) runs EXACT.
//        The core starts in EXACT; pocket_mlx.kernels switches to FAST when it loads.
enum Mode : int { MODE_EXACT = 0, MODE_FAST = 1 };

// One quantized matrix [E, N, K] (E = 1 for a plain linear layer), MLX affine format.
struct QMatrix {
  const uint32_t* w = nullptr;
  const void* scales = nullptr;
  const void* biases = nullptr;
  DType sdt = F32;
  int64_t E = 1, N = 0, K = 0;
  int bits = 4, group_size = 64;
};

// A quantized matrix (the QMatrix part: weights [E, N, K*bits/32] uint32, scales / biases
// [E, N, K/group_size]) applied to rows of activations.
struct GatherProblem : QMatrix {
  // Activations: row r of the output uses x row starting at element offset xrow_off[r]
  // (K contiguous elements of dtype xdt).
  const void* x = nullptr;
  DType xdt = F32;
  int64_t nrows = 0;
  const int64_t* xrow_off = nullptr;
  // Expert of each output row (nullptr: all rows use expert 0). Out-of-range experts give zeros.
  const int32_t* expert = nullptr;
  // Output [nrows, N] (row r at out + r * N elements), dtype odt.
  void* out = nullptr;
  DType odt = F32;
};

// True if (bits, group_size, K) is supported.
bool supported(int bits, int group_size, int64_t K);

// out[r, :] = x[r, :] . dequant(W[expert[r]])^T. Thread-safe (concurrent calls run serially on
// the pool or inline).
void gather_qmm(const GatherProblem& p);

// Products 0..n-1 as one pool job, activations shared between them where they are the same rows
// (decode's MoE block); bit-identical to n gather_qmm calls, which is what runs unless every
// matrix is in the panel layout and the rows are few.
void gather_qmm_many(const GatherProblem* ps, int n);

// Plain quantized matmul: x [M, K] (row stride K) times W[N, K]^T -> out [M, N].
void qmm(const void* x, DType xdt, int64_t M, const uint32_t* w, const void* scales,
         const void* biases, DType sdt, int64_t N, int64_t K, int bits, int group_size, void* out,
         DType odt);

// Panel layout (qk_panel.h): the CPU layout of the row-panel kernels, one record per 16 rows x
// one group (codes, then scales, then biases), built once from the MLX layout into a 2 MiB
// aligned buffer (transparent huge pages requested) and registered under m.w: every gather_qmm /
// qmm / moe_block call with these weights then reads the panels, for any number of rows, in
// EXACT and FAST mode. Returns the bytes allocated, 0 when not packed (bits 1/3/5, already
// packed, bad shape): the MLX layout then serves.
int64_t panel_pack(const QMatrix& m);
// Writes the MLX layout of the registered matrix `w` back into w / scales / biases (buffers of
// the MLX shapes; may be the original ones after release_pages). False if `w` is not registered.
bool panel_unpack(const void* w, uint32_t* w_out, void* scales, void* biases);
// Frees the panels registered under `w`; false if none.
bool panel_release(const void* w);
// Bytes of all registered panels.
int64_t panel_bytes_total();
// Returns the whole 4 KiB pages inside [p, p + bytes) to the OS (madvise MADV_DONTNEED: they
// read as zeros, or the file's bytes, afterwards): the MLX copy of a packed matrix gives its
// memory back, so one copy of the weights stays. Returns the bytes released.
int64_t release_pages(void* p, int64_t bytes);

// Thread pool: n <= 0 means the default (physical cores).
void set_threads(int n);
int get_threads();
int default_threads();

void set_mode(int mode);
int get_mode();

// Instruction set in use: "avx512", "avx2", "neon" or "scalar".
const char* isa();
// The variant of isa() in use, for reports: "avx512-vbmi", "avx512-vnni", "avx512", "avx2",
// "neon-i8mm", "neon-dotprod", "neon" (no dot products: EXACT only) or "scalar".
const char* isa_variant();
// Bit widths that FAST mode runs with the ISA in use: bit b set for b-bit weights. 0 (NEON
// without dotprod, scalar): FAST falls back to EXACT for every matrix.
int fast_bits_mask();
// Best instruction set this CPU supports (what isa() is unless forced).
const char* best_isa();
// Force an instruction set ("avx512", "avx512-novnni" (AVX-512BW kernels even with VNNI), "avx2", "neon" = the best NEON variant, "neon-i8mm",
// "neon-dotprod", "neon-base" = NEON EXACT only, "scalar", or "auto"). Returns false if the
// CPU cannot run it (the setting is then unchanged).
bool force_isa(const char* name);

// Runs fn(0..n-1) on the thread pool (inline when `single` or the pool is busy).
void parallel_for(int64_t n, bool single, const std::function<void(int64_t)>& fn);

// Gated delta rule (Gated DeltaNet) over T tokens, all float32 and row-major contiguous:
// q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g (decay, not its log), beta [B, T, Hv];
// state_in [B, Hv, Dv, Dk] read, the new state written to `state` (may equal state_in: in
// place); y [B, T, Hv, Dv] written. Hv is a multiple of Hk.
void gated_delta(const float* q, const float* k, const float* v, const float* g,
                 const float* beta, const float* state_in, float* state, float* y, int64_t B,
                 int64_t T, int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv);

// T decode tokens in a row (the verify pass), q/k/v/g/beta laid out as for gated_delta: token t
// with the bits gated_delta gives it alone (T = 1) from the state after token t - 1; the state
// after token t goes to slots[t] ([B, Hv, Dv, Dk] each). False (nothing done) where gated_delta's
// one-token path is not the one this kernel reproduces: call gated_delta per token instead.
bool gated_delta_rows(const float* q, const float* k, const float* v, const float* g,
                      const float* beta, const float* state_in, float* const* slots, float* y,
                      int64_t B, int64_t T, int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv);

// RMSNorm of `rows` rows of D float32 values: out = x / sqrt(mean(x^2) + eps) [* w] [* silu(gate)]
// (w: D values or nullptr; gate: rows x D values or nullptr).
void rms_norm(const float* x, const float* w, const float* gate, float* out, int64_t rows,
              int64_t D, float eps);

// silu(causal depthwise conv): x [B, T+K-1, C] (the K-1 previous rows, then T new ones),
// w [C, K] -> out [B, T, C].
void causal_conv_silu(const float* x, const float* w, float* out, int64_t B, int64_t T,
                      int64_t C, int64_t K);

// Non-interleaved RoPE on the first `dims` of D features: x, out [N, L, D], position offset + l.
void rope(const float* x, float* out, int64_t N, int64_t L, int64_t D, int64_t dims, float base,
          int64_t offset);

// x - logsumexp(x) over rows of n values (sampling's log-probabilities), float32.
void log_softmax(const float* x, float* out, int64_t rows, int64_t n);

// Router: softmax over E logits per row, the k most probable experts (descending) and their
// probabilities (renormalized to sum 1 when norm_topk).
void moe_route(const float* logits, int64_t rows, int64_t E, int64_t k, bool norm_topk,
               uint32_t* inds, float* scores);

// Calls whose weights are smaller than this run on the calling thread only.
void set_single_thread_bytes(int64_t bytes);


// A Qwen3.5-MoE sparse block: softmax router + top-k routed SwiGLU experts, plus a shared SwiGLU
// expert scaled by sigmoid(shared_gate(x)). shared_up.w == nullptr: shared_gate_proj holds gate
// and up stacked ([2 Hs, D], gate rows first).
struct MoeBlock {
  QMatrix router, shared_gate, shared_gate_proj, shared_up, shared_down;
  QMatrix expert_gate, expert_up, expert_down;
  int64_t k = 8;
  bool norm_topk = true;
};

// out [T, D] = the block applied to x [T, D] (float32).
void moe_block(const MoeBlock& b, const float* x, int64_t T, float* out);

// Expert parallelism: the block's parts for x [T, D]: parts [T, k + 1, D] (part 0 the gated
// shared expert, zero unless with_shared; part 1 + j the token's j-th routed expert's output,
// unscaled, zero unless that expert is one of this rank's, global [lo, lo + expert_gate.E)) and
// scores [T, k] (router over all router.N experts). moe_combine(parts, scores) is the block's
// output; parts summed over ranks first give exactly the one-process result.
void moe_block_parts(const MoeBlock& b, const float* x, int64_t T, int64_t lo, bool with_shared,
                     float* parts, float* scores);
void moe_combine(const float* parts, const float* scores, int64_t T, int64_t k, int64_t D,
                 float* out);

// One decode token of a Gated DeltaNet layer after its input projections (float32). Per batch
// row b: qkv at qkv + b * qkv_stride ([conv_dim] = q | k | v), z at z + b * z_stride ([Hv * Dv]),
// b / a gates at b + b * ab_stride ([Hv]); conv_state [B, kernel - 1, conv_dim], conv_w
// [conv_dim, kernel]; state [B, Hv, Dv, Dk]. Writes out [B, Hv * Dv] (gated RMSNorm of the delta
// rule's output), new_conv_state and state (may not alias state_in).
struct LinearAttnStep {
  int64_t B = 1, conv_dim = 0, kernel = 4, Hk = 0, Hv = 0, Dk = 0, Dv = 0;
  const float *qkv = nullptr, *z = nullptr, *b = nullptr, *a = nullptr;
  int64_t qkv_stride = 0, z_stride = 0, ab_stride = 0;
  const float *conv_state = nullptr, *conv_w = nullptr, *A_log = nullptr, *dt_bias = nullptr;
  const float *norm_w = nullptr, *state_in = nullptr;
  float norm_eps = 1e-6f;
  float *out = nullptr, *new_conv_state = nullptr, *state = nullptr;
};

void linear_attn_step(const LinearAttnStep& a);

// L decode tokens in a row (speculative decoding's verify pass): row i is linear_attn_step on
// row i's qkv / z / b / a (at qkv + i * qkv_row, ...) with the caches after row i - 1, so every
// row has the one-token step's bits. a.out is [L, B, Hv * Dv]; the caches after row i go to
// conv_slots[i] ([B, kernel - 1, conv_dim]) and state_slots[i] ([B, Hv, Dv, Dk]), separate
// buffers, so keeping the first n rows is taking slot n - 1 and dropping the others.
// (a.new_conv_state and a.state are not used.)
void linear_attn_rows(const LinearAttnStep& a, int64_t L, int64_t qkv_row, int64_t z_row,
                      int64_t ab_row, float* const* conv_slots, float* const* state_slots);

}  // namespace pqk
