// MLX extension: custom CPU primitives around the plain core in core/qkernels.h.
//   _qkernels.quantized_matmul(x, w, scales, biases, group_size, bits)        (transpose=True)
//   _qkernels.gather_qmm(x, w, scales, biases, indices, group_size, bits)     (rhs_indices)
//   _qkernels.gated_delta, rms_norm, causal_conv_silu, rope, moe_route,
//             log_softmax                                                 (decode helpers)
//   _qkernels.moe_block, moe_block_parts, moe_combine, linear_attn_step, linear_attn_rows       (whole decode blocks)
//   _qkernels.causal_attention                                                (prefill attention)
//   _qkernels.decode_attention              (a decode token of B sequences with their own caches)
// eval_gpu throws (bindings/common.h): these primitives are for the CPU device only. They live
// in csrc/bindings/{qmm,gated_delta,decode_ops,blocks,attention}.cpp on the shared primitive
// base of bindings/common.{h,cpp}; this file only binds them (and the core's thread / mode /
// ISA settings) to Python.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <string>
#include <vector>

#include "bindings/ops.h"
#include "core/qk_gemm.h"
#include "core/qkernels.h"

namespace nb = nanobind;
using namespace pocket_ext;

NB_MODULE(_qkernels, m) {
  m.doc() = "pocket-mlx fast CPU quantized matmul kernels (MLX affine format)";
  m.def("quantized_matmul", &quantized_matmul, nb::arg("x"), nb::arg("w"), nb::arg("scales"),
        nb::arg("biases"), nb::kw_only(), nb::arg("group_size"), nb::arg("bits"),
        nb::arg("stream") = nb::none(),
        "x @ dequantize(w).T, same result as mx.quantized_matmul(..., transpose=True) "
        "(float32 accumulation).");
  m.def("gather_qmm", &gather_qmm, nb::arg("x"), nb::arg("w"), nb::arg("scales"),
        nb::arg("biases"), nb::arg("indices"), nb::kw_only(), nb::arg("group_size"),
        nb::arg("bits"), nb::arg("stream") = nb::none(),
        "mx.gather_qmm(x, w, scales, biases, rhs_indices=indices, transpose=True) on the CPU.");
  m.def("gated_delta", &gated_delta, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("g"),
        nb::arg("beta"), nb::arg("state"), nb::kw_only(), nb::arg("stream") = nb::none(),
        "Gated delta rule over a sequence on the CPU: returns (y, new_state), float32.");
  m.def("rms_norm", &rms_norm, nb::arg("x"), nb::arg("weight").none(), nb::arg("gate").none(),
        nb::kw_only(), nb::arg("eps"), nb::arg("stream") = nb::none(),
        "x / sqrt(mean(x^2, -1) + eps) [* weight] [* silu(gate)] on the CPU, float32.");
  m.def("causal_conv_silu", &causal_conv_silu, nb::arg("x"), nb::arg("w"), nb::kw_only(),
        nb::arg("stream") = nb::none(), "silu(causal depthwise conv1d) on the CPU, float32.");
  m.def("rope", &rope, nb::arg("x"), nb::kw_only(), nb::arg("dims"), nb::arg("base"),
        nb::arg("offset"), nb::arg("stream") = nb::none(),
        "mx.fast.rope(x, dims, traditional=False, base, scale=1, offset) on the CPU, float32.");
  m.def("moe_route", &moe_route, nb::arg("logits"), nb::kw_only(), nb::arg("k"),
        nb::arg("normalize"), nb::arg("stream") = nb::none(),
        "softmax + top-k of router logits on the CPU: (indices uint32, scores float32).");
  m.def("log_softmax", &log_softmax, nb::arg("x"), nb::kw_only(), nb::arg("stream") = nb::none(),
        "x - logsumexp(x, axis=-1) on the CPU (sampling's log-probabilities), float32.");
  m.def("moe_block", &moe_block, nb::arg("x"), nb::arg("mats"), nb::kw_only(), nb::arg("k"),
        nb::arg("normalize"), nb::arg("stream") = nb::none(),
        "A whole Qwen3.5-MoE sparse block on the CPU (router, top-k SwiGLU experts, gated shared "
        "expert), float32; mats: (w, scales, biases, bits, group_size) x 7 (fused shared "
        "gate_up) or 8.");
  m.def("moe_block_parts", &moe_block_parts, nb::arg("x"), nb::arg("mats"), nb::kw_only(),
        nb::arg("k"), nb::arg("normalize"), nb::arg("expert_lo"), nb::arg("with_shared"),
        nb::arg("stream") = nb::none(),
        "Expert parallelism: moe_block's parts (parts [..., k + 1, D]: the gated shared expert "
        "if with_shared, then each routed slot's output when its expert is held here, global "
        "[expert_lo, expert_lo + E_local); zero otherwise) and the router's scores [..., k].");
  m.def("moe_combine", &moe_combine, nb::arg("parts"), nb::arg("scores"), nb::kw_only(),
        nb::arg("stream") = nb::none(),
        "moe_block's output from its parts (summed over ranks) and scores, float32.");
  m.def("linear_attn_step", &linear_attn_step, nb::arg("qkv"), nb::arg("z"), nb::arg("b"),
        nb::arg("a"), nb::arg("conv_state"), nb::arg("conv_w"), nb::arg("A_log"),
        nb::arg("dt_bias"), nb::arg("norm_w"), nb::arg("state"), nb::kw_only(), nb::arg("Hk"),
        nb::arg("Dk"), nb::arg("Hv"), nb::arg("Dv"), nb::arg("eps"),
        nb::arg("stream") = nb::none(),
        "One decode token of a Gated DeltaNet layer after its projections, on the CPU: "
        "(out [B, 1, Hv*Dv], new conv_state, new state), float32.");
  m.def("linear_attn_rows", &linear_attn_rows, nb::arg("qkv"), nb::arg("z"), nb::arg("b"),
        nb::arg("a"), nb::arg("conv_state"), nb::arg("conv_w"), nb::arg("A_log"),
        nb::arg("dt_bias"), nb::arg("norm_w"), nb::arg("state"), nb::kw_only(), nb::arg("Hk"),
        nb::arg("Dk"), nb::arg("Hv"), nb::arg("Dv"), nb::arg("eps"),
        nb::arg("stream") = nb::none(),
        "L decode tokens of a Gated DeltaNet layer in a row (qkv, z, b, a [B, L, n]), each "
        "with linear_attn_step's bits: [out [L, B, Hv*Dv], the conv_state after each of the L "
        "rows, then the state after each], float32.");
  m.def("causal_attention", &causal_attention, nb::arg("q"), nb::arg("k"), nb::arg("v"),
        nb::arg("gate").none() = nb::none(), nb::kw_only(), nb::arg("scale"),
        nb::arg("stream") = nb::none(),
        "mx.fast.scaled_dot_product_attention(q, k, v, scale, mask='causal') on the CPU, "
        "float32, without materialising the scores; written [B, L, H, D], times sigmoid(gate) "
        "([B, L, H, D]) when given.");
  m.def("decode_attention", &decode_attention, nb::arg("q"), nb::arg("k"), nb::arg("v"),
        nb::arg("gate"), nb::arg("keys"), nb::arg("values"), nb::arg("offsets"), nb::kw_only(),
        nb::arg("dims"), nb::arg("base"), nb::arg("scale"), nb::arg("stream") = nb::none(),
        "One decode token of B sequences, each with its own KV cache: RoPE of q, k [B, H, 1, D] "
        "at offsets[b], k and v written into keys[b] / values[b] [1, Hkv, cap, D] there, "
        "attention over offsets[b] + 1 positions times sigmoid(gate [B, 1, Hq, D]): "
        "[out [B, 1, Hq, D], keys[0], values[0], keys[1], ...] as written, float32.");
  m.def("set_gemm_min_rows", [](int64_t n) { pqk::detail::set_gemm_min_rows(n); }, nb::arg("n"),
        "FAST mode: activation rows per matrix/expert from which the GEMM kernels run (0: never; "
        "default 4 or POCKET_MLX_GEMM_MIN_ROWS).");
  m.def("gemm_min_rows", []() { return pqk::detail::gemm_min_rows(); });
  m.def("set_threads", [](int n) { pqk::set_threads(n); }, nb::arg("n"));
  m.def("get_threads", []() { return pqk::get_threads(); });
  m.def("default_threads", []() { return pqk::default_threads(); });
  m.def("set_mode", [](int mode) { pqk::set_mode(mode); }, nb::arg("mode"));
  m.def("get_mode", []() { return pqk::get_mode(); });
  m.def("isa", []() { return std::string(pqk::isa()); });
  m.def("isa_variant", []() { return std::string(pqk::isa_variant()); },
        "The instruction-set variant in use, e.g. avx512-vnni (isa() is its family).");
  m.def("fast_bits", []() {
          std::vector<int> bits;
          const int mask = pqk::fast_bits_mask();
          for (int b = 0; b < 9; b++)
            if (mask & (1 << b)) bits.push_back(b);
          return bits;
        },
        "Bit widths FAST mode runs on the instruction set in use; [] means FAST falls back to "
        "EXACT everywhere (NEON, scalar).");
  m.def("best_isa", []() { return std::string(pqk::best_isa()); });
  m.def("force_isa", [](const std::string& n) { return pqk::force_isa(n.c_str()); },
        nb::arg("name"));
  m.def("set_single_thread_bytes", [](int64_t b) { pqk::set_single_thread_bytes(b); },
        nb::arg("bytes"));
  m.def("supported", [](int bits, int gs, int64_t K) { return pqk::supported(bits, gs, K); },
        nb::arg("bits"), nb::arg("group_size"), nb::arg("K"));
  m.def("panel_pack", &panel_pack, nb::arg("w"), nb::arg("scales"), nb::arg("biases"),
        nb::kw_only(), nb::arg("bits"), nb::arg("group_size"), nb::arg("release") = false,
        "Packs an evaluated, contiguous quantized matrix into the CPU panel layout (the kernels "
        "then read it for calls with this w); release: hand the MLX arrays' pages back to the OS "
        "(they read as zeros or the file's bytes until panel_unpack). Returns the bytes "
        "allocated, 0 when the layout does not hold these bits or this CPU has no panel kernels.");
  m.def("panel_unpack", &panel_unpack, nb::arg("w"),
        "The MLX layout of a packed matrix written back into its own arrays (w, scales, biases), which are returned; frees the panels.");
  m.def("panel_release", &panel_release, nb::arg("w"), "Frees the panels of w; False if none.");
  m.def("panel_packed", &panel_packed, nb::arg("w"),
        "Whether w's memory belongs to a packed matrix (MLX's ops would read zeros there).");
  m.def("panel_variant", &panel_variant,
        "The panel kernels' ISA variant; 'portable' where this CPU has none (no packing).");
  m.def("panel_bytes", []() { return pqk::panel_bytes_total(); }, "Bytes of all panels.");
  m.attr("MODE_EXACT") = (int)pqk::MODE_EXACT;
  m.attr("MODE_FAST") = (int)pqk::MODE_FAST;
}
