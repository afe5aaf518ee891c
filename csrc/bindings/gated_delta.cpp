// Gated delta rule over a sequence (core/gated_delta.cpp) as one primitive.
#include <memory>
#include <stdexcept>
#include <vector>

#include "bindings/common.h"
#include "bindings/ops.h"

namespace pocket_ext {
namespace {

// Gated delta rule over a sequence (Gated DeltaNet's recurrence), float32 in and out.
// Inputs q, k, v, g, beta, state; outputs y [B, T, Hv, Dv] and the new state [B, Hv, Dv, Dk].
class PocketGatedDelta : public CpuPrimitive {
 public:
  explicit PocketGatedDelta(mx::Stream s) : CpuPrimitive(s) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    mx::array& y = outputs[0];
    mx::array& state = outputs[1];
    alloc(y);
    // Update the state in place when nothing else holds the old one (the usual case: the cache
    // already points at the new state), saving a copy of the whole state per token.
    const mx::array& old = inputs[5];
    const bool in_place = old.is_donatable() && old.flags().row_contiguous;
    if (in_place) {
      state.copy_shared_buffer(old);
    } else {
      alloc(state);
    }
    encode(stream(), inputs, outputs, [inputs, y, state, in_place]() mutable {
      std::vector<std::vector<uint8_t>> tmp(6);
      const float* p[6];
      for (int i = 0; i < 5; i++) {
        p[i] = static_cast<const float*>(contiguous_bytes(inputs[i], tmp[i]));
      }
      const mx::array& q = inputs[0];
      const mx::array& v = inputs[2];
      // Not in place: the kernel reads the old state and writes the new one in one pass.
      const float* old_state = in_place ? state.data<float>()
                                        : static_cast<const float*>(contiguous_bytes(inputs[5], tmp[5]));
      pqk::gated_delta(p[0], p[1], p[2], p[3], p[4], old_state, state.data<float>(), y.data<float>(),
                       q.shape(0), q.shape(1), q.shape(2), v.shape(2), q.shape(3), v.shape(3));
    });
  }

  const char* name() const override { return "PocketGatedDelta"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return dynamic_cast<const PocketGatedDelta*>(&other) != nullptr;
  }
};

}  // namespace

std::vector<mx::array> gated_delta(const mx::array& q, const mx::array& k, const mx::array& v,
                                   const mx::array& g, const mx::array& beta,
                                   const mx::array& state, mx::StreamOrDevice s) {
  for (const auto* a : {&q, &k, &v, &g, &beta, &state}) {
    if (a->dtype() != mx::float32)
      throw std::invalid_argument("pocket_mlx._qkernels.gated_delta: inputs must be float32");
  }
  if (q.ndim() != 4 || k.shape() != q.shape() || v.ndim() != 4 || v.shape(0) != q.shape(0) ||
      v.shape(1) != q.shape(1) || v.shape(2) % q.shape(2) != 0 ||
      g.shape() != mx::Shape{q.shape(0), q.shape(1), v.shape(2)} || beta.shape() != g.shape() ||
      state.shape() != mx::Shape{q.shape(0), v.shape(2), v.shape(3), q.shape(3)})
    throw std::invalid_argument("pocket_mlx._qkernels.gated_delta: shape mismatch");
  return mx::array::make_arrays({v.shape(), state.shape()}, {mx::float32, mx::float32},
                                std::make_shared<PocketGatedDelta>(cpu_stream(s)),
                                {q, k, v, g, beta, state});
}

}  // namespace pocket_ext
