// Causal softmax attention for prefill on the CPU (csrc/core/attention.cpp).
#pragma once

#include <cstdint>

namespace pqk {

// out = softmax(scale * q k^T + causal mask) v, float32. q [B, Hq, L, D], k and v [B, Hkv, S, D]
// with S >= L: query i sees keys j <= S - L + i (the cache's earlier tokens, then itself).
// Strides in elements for the first three dims (the last dim is contiguous); out [B, L, Hq, D]
// row-major (the layout the output projection reads, so no transpose copy follows). Hq is a multiple of Hkv (grouped-query attention); D a multiple of 16.
// gate (nullable) [B, L, Hq, D] with strides gst (last dim contiguous): out *= sigmoid(gate).
void causal_attention(const float* q, const int64_t* qst, const float* k, const int64_t* kst,
                      const float* v, const int64_t* vst, const float* gate, const int64_t* gst,
                      float* out, int64_t B, int64_t Hq, int64_t Hkv, int64_t L, int64_t S,
                      int64_t D, float scale);

// The dtype a decode step's KV cache is stored in (the keys and values alike): float32 (the
// default; exact), or float16 / bfloat16 (half the bytes a step reads at depth; opt-in).
enum class KvType : int { f32 = 0, f16 = 1, bf16 = 2 };

// One float32 value as float16 / bfloat16 bits, rounded to nearest even (as MLX's astype), and
// back (exact).
uint16_t float_to_half(float x);
float half_to_float(uint16_t h);
uint16_t float_to_bf16(float x);

// One decode token of each of B sequences against its own keys and values (their lengths
// differ: a batched decode step). q [B, Hq, D] and gate [B, Hq, D] (nullable) row-major; row b's
// keys k[b] and values v[b] [Hkv, cap[b], D] row-major of dtype t, its first S[b] positions
// filled (the new token's included); out [B, Hq, D]. Each (row, head) runs the one-row case of
// causal_attention (L = 1, the same kernel and order; with a half cache, as causal_attention on
// the cache cast to float32), so row b's bits are its own single-sequence step's, whatever B and
// the thread count. The heads that share a KV head go together (each key and value row read
// once for them); the B x Hkv tasks are spread over the pool.
void decode_attention_rows(const float* q, const void* const* k, const void* const* v,
                           const int64_t* cap, const int64_t* S, const float* gate, float* out,
                           int64_t B, int64_t Hq, int64_t Hkv, int64_t D, float scale,
                           KvType t = KvType::f32);

}  // namespace pqk
