// The extension's ops as module.cpp binds them: each checks its arguments (std::invalid_argument,
// ValueError in Python) and returns the output array(s) of one CPU primitive node.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "mlx/array.h"
#include "mlx/utils.h"

namespace mx = mlx::core;

namespace pocket_ext {

// qmm.cpp
mx::array quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales,
                           const mx::array& biases, int group_size, int bits,
                           mx::StreamOrDevice s);
mx::array gather_qmm(const mx::array& x, const mx::array& w, const mx::array& scales,
                     const mx::array& biases, const mx::array& indices, int group_size,
                     int bits, mx::StreamOrDevice s);

// gated_delta.cpp
std::vector<mx::array> gated_delta(const mx::array& q, const mx::array& k, const mx::array& v,
                                   const mx::array& g, const mx::array& beta,
                                   const mx::array& state, mx::StreamOrDevice s);

// decode_ops.cpp
mx::array rms_norm(const mx::array& x, const std::optional<mx::array>& weight,
                   const std::optional<mx::array>& gate, float eps, mx::StreamOrDevice s);
mx::array causal_conv_silu(const mx::array& x, const mx::array& w, mx::StreamOrDevice s);
mx::array rope(const mx::array& x, int dims, float base, int64_t offset, mx::StreamOrDevice s);
std::vector<mx::array> moe_route(const mx::array& logits, int k, bool normalize,
                                 mx::StreamOrDevice s);
mx::array log_softmax(const mx::array& x, mx::StreamOrDevice s);

// blocks.cpp
mx::array moe_block(const mx::array& x,
                    const std::vector<std::tuple<mx::array, mx::array, mx::array, int, int>>& mats,
                    int k, bool normalize, mx::StreamOrDevice s);
std::vector<mx::array> moe_block_parts(
    const mx::array& x,
    const std::vector<std::tuple<mx::array, mx::array, mx::array, int, int>>& mats, int k,
    bool normalize, int64_t expert_lo, bool with_shared, mx::StreamOrDevice s);
mx::array moe_combine(const mx::array& parts, const mx::array& scores, mx::StreamOrDevice s);
std::vector<mx::array> linear_attn_step(const mx::array& qkv, const mx::array& z,
                                        const mx::array& b, const mx::array& a,
                                        const mx::array& conv_state, const mx::array& conv_w,
                                        const mx::array& A_log, const mx::array& dt_bias,
                                        const mx::array& norm_w, const mx::array& state, int Hk,
                                        int Dk, int Hv, int Dv, float eps, mx::StreamOrDevice s);

std::vector<mx::array> linear_attn_rows(const mx::array& qkv, const mx::array& z,
                                        const mx::array& b, const mx::array& a,
                                        const mx::array& conv_state, const mx::array& conv_w,
                                        const mx::array& A_log, const mx::array& dt_bias,
                                        const mx::array& norm_w, const mx::array& state, int Hk,
                                        int Dk, int Hv, int Dv, float eps, mx::StreamOrDevice s);

// attention.cpp
mx::array causal_attention(const mx::array& q, const mx::array& k, const mx::array& v,
                           const std::optional<mx::array>& gate, float scale,
                           mx::StreamOrDevice s);
std::vector<mx::array> decode_attention(const mx::array& q, const mx::array& k,
                                        const mx::array& v, const mx::array& gate,
                                        const std::vector<mx::array>& keys,
                                        const std::vector<mx::array>& values,
                                        const std::vector<int64_t>& offsets, int dims, float base,
                                        float scale, mx::StreamOrDevice s);

// Panel layout (bindings/panels.cpp).
int64_t panel_pack(const mx::array& w, const mx::array& scales, const mx::array& biases, int bits,
                   int group_size, bool release);
std::tuple<mx::array, mx::array, mx::array> panel_unpack(const mx::array& w);
bool panel_release(const mx::array& w);
bool panel_packed(const mx::array& w);
std::string panel_variant();

}  // namespace pocket_ext
