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

// One decode token of each of B sequences against its own keys and values (their lengths
// differ: a batched decode step). q [B, Hq, D] and gate [B, Hq, D] (nullable) row-major; row b's
// keys k[b] and values v[b] [Hkv, cap[b], D] row-major, its first S[b] positions filled (the new
// token's included); out [B, Hq, D]. Each (row, head) runs the one-row case of causal_attention
// (L = 1, the same kernel and order), so row b's bits are its own single-sequence step's,
// whatever B and the thread count; the B x Hq tasks are spread over the pool.
void decode_attention_rows(const float* q, const float* const* k, const float* const* v,
                           const int64_t* cap, const int64_t* S, const float* gate, float* out,
                           int64_t B, int64_t Hq, int64_t Hkv, int64_t D, float scale);

}  // namespace pqk
