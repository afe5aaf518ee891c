// Small per-layer float32 decode ops: rms_norm (plain and gated), causal_conv_silu, rope, the
// MoE router and sampling's log_softmax, one primitive class for the five.
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "bindings/common.h"
#include "bindings/ops.h"

namespace pocket_ext {
namespace {

// Small per-layer ops (core/norms.cpp, core/decode_ops.cpp), float32: one node each where MLX's
// CPU backend runs a graph of composed ops (mx.fast.rms_norm alone is ~10 nodes on the CPU).
class PocketSmallOp : public CpuPrimitive {
 public:
  enum Kind { RMS_NORM, CONV_SILU, ROPE, ROUTE, LOG_SOFTMAX };
  PocketSmallOp(mx::Stream s, Kind kind, int64_t a = 0, int64_t b = 0, float f = 0.f)
      : CpuPrimitive(s), kind_(kind), a_(a), b_(b), f_(f) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    for (auto& o : outputs) alloc(o);
    encode(stream(), inputs, outputs, [inputs, outputs, kind = kind_, a = a_, b = b_, f = f_]() mutable {
      std::vector<std::vector<uint8_t>> tmp(inputs.size());
      std::vector<const float*> in;
      for (size_t i = 0; i < inputs.size(); i++)
        in.push_back(static_cast<const float*>(contiguous_bytes(inputs[i], tmp[i])));
      const mx::array& x = inputs[0];
      if (kind == RMS_NORM) {  // x [..., D] [, weight [D]] [, gate like x]; a, b = has weight, gate
        const int64_t D = x.shape(-1);
        pqk::rms_norm(in[0], a ? in[1] : nullptr, b ? in[a ? 2 : 1] : nullptr,
                      outputs[0].data<float>(), (int64_t)x.size() / D, D, f);
      } else if (kind == CONV_SILU) {  // x [B, T+K-1, C], w [C, K(, 1)]
        const int64_t K = inputs[1].shape(1);
        pqk::causal_conv_silu(in[0], in[1], outputs[0].data<float>(), x.shape(0),
                              x.shape(1) - K + 1, x.shape(2), K);
      } else if (kind == ROPE) {  // x [..., L, D]; a = dims, b = offset, f = base
        const int64_t D = x.shape(-1), L = x.shape(-2);
        pqk::rope(in[0], outputs[0].data<float>(), (int64_t)x.size() / (L * D), L, D, a, f, b);
      } else if (kind == LOG_SOFTMAX) {  // x [..., V]
        const int64_t V = x.shape(-1);
        pqk::log_softmax(in[0], outputs[0].data<float>(), (int64_t)x.size() / V, V);
      } else {  // logits [..., E]; a = k, b = normalize
        const int64_t E = x.shape(-1);
        pqk::moe_route(in[0], (int64_t)x.size() / E, E, a, b != 0,
                       outputs[0].data<uint32_t>(), outputs[1].data<float>());
      }
    });
  }

  const char* name() const override {
    switch (kind_) {
      case RMS_NORM: return "PocketRMSNorm";
      case CONV_SILU: return "PocketConvSilu";
      case ROPE: return "PocketRope";
      case LOG_SOFTMAX: return "PocketLogSoftmax";
      default: return "PocketRoute";
    }
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const PocketSmallOp*>(&other);
    return o && o->kind_ == kind_ && o->a_ == a_ && o->b_ == b_ && o->f_ == f_;
  }

 private:
  Kind kind_;
  int64_t a_, b_;
  float f_;
};

}  // namespace

mx::array rms_norm(const mx::array& x, const std::optional<mx::array>& weight,
                   const std::optional<mx::array>& gate, float eps, mx::StreamOrDevice s) {
  const char* err = "pocket_mlx._qkernels.rms_norm: ";
  if (x.dtype() != mx::float32 || (weight && weight->dtype() != mx::float32) ||
      (gate && gate->dtype() != mx::float32))
    throw std::invalid_argument(std::string(err) + "inputs must be float32");
  if (x.ndim() < 1 || x.size() == 0 || (weight && (weight->ndim() != 1 ||
                                                   weight->shape(0) != x.shape(-1))) ||
      (gate && gate->shape() != x.shape()))
    throw std::invalid_argument(std::string(err) + "shape mismatch");
  std::vector<mx::array> inputs{x};
  if (weight) inputs.push_back(*weight);
  if (gate) inputs.push_back(*gate);
  return mx::array(x.shape(), mx::float32,
                   std::make_shared<PocketSmallOp>(cpu_stream(s), PocketSmallOp::RMS_NORM,
                                                   (bool)weight, (bool)gate, eps),
                   inputs);
}

mx::array causal_conv_silu(const mx::array& x, const mx::array& w, mx::StreamOrDevice s) {
  require_f32(x, "causal_conv_silu");
  require_f32(w, "causal_conv_silu");
  if (x.ndim() != 3 || w.ndim() < 2 || w.shape(0) != x.shape(2) || w.size() != (size_t)(w.shape(0) * w.shape(1)) ||
      x.shape(1) < w.shape(1))
    throw std::invalid_argument("pocket_mlx._qkernels.causal_conv_silu: shape mismatch");
  mx::Shape out{x.shape(0), x.shape(1) - w.shape(1) + 1, x.shape(2)};
  return mx::array(out, mx::float32,
                   std::make_shared<PocketSmallOp>(cpu_stream(s), PocketSmallOp::CONV_SILU),
                   {x, w});
}

mx::array rope(const mx::array& x, int dims, float base, int64_t offset, mx::StreamOrDevice s) {
  require_f32(x, "rope");
  if (x.ndim() < 2 || dims <= 0 || dims % 2 || dims > x.shape(-1) || offset < 0)
    throw std::invalid_argument("pocket_mlx._qkernels.rope: bad shape or dims");
  return mx::array(x.shape(), mx::float32,
                   std::make_shared<PocketSmallOp>(cpu_stream(s), PocketSmallOp::ROPE, dims,
                                                   offset, base),
                   {x});
}

mx::array log_softmax(const mx::array& x, mx::StreamOrDevice s) {
  require_f32(x, "log_softmax");
  if (x.ndim() < 1 || x.size() == 0)
    throw std::invalid_argument("pocket_mlx._qkernels.log_softmax: empty input");
  return mx::array(x.shape(), mx::float32,
                   std::make_shared<PocketSmallOp>(cpu_stream(s), PocketSmallOp::LOG_SOFTMAX),
                   {x});
}

std::vector<mx::array> moe_route(const mx::array& logits, int k, bool normalize,
                                 mx::StreamOrDevice s) {
  require_f32(logits, "moe_route");
  if (logits.ndim() < 1 || k <= 0 || k > logits.shape(-1))
    throw std::invalid_argument("pocket_mlx._qkernels.moe_route: bad k");
  mx::Shape out(logits.shape().begin(), logits.shape().end() - 1);
  out.push_back(k);
  return mx::array::make_arrays({out, out}, {mx::uint32, mx::float32},
                                std::make_shared<PocketSmallOp>(cpu_stream(s), PocketSmallOp::ROUTE,
                                                                k, normalize ? 1 : 0),
                                {logits});
}

}  // namespace pocket_ext
