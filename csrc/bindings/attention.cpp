// Causal attention for prefill (core/attention.cpp) as one primitive: q [B, Hq, L, D], k and v
// [B, Hkv, S, D] (strided views such as the KV cache's filled part are read in place; the last
// dim must be contiguous, else it is copied) -> out [B, L, Hq, D], float32 (the layout the output
// projection reads; ops.causal_attention hands it back as a [B, Hq, L, D] view).
#include <memory>
#include <optional>
#include <stdexcept>
#include <vector>

#include "bindings/common.h"
#include "bindings/ops.h"
#include "core/attention.h"

namespace pocket_ext {
namespace {

class PocketCausalAttention : public CpuPrimitive {
 public:
  PocketCausalAttention(mx::Stream s, float scale) : CpuPrimitive(s), scale_(scale) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    mx::array& out = outputs[0];
    alloc(out);
    const float scale = scale_;
    encode(stream(), inputs, outputs, [inputs, out, scale]() mutable {
      const int n = (int)inputs.size();  // 4: with the output gate
      std::vector<uint8_t> tmp[4];
      const float* p[4] = {nullptr, nullptr, nullptr, nullptr};
      int64_t st[4][3] = {};
      for (int i = 0; i < n; i++) {
        const mx::array& a = inputs[i];
        if (a.strides()[3] == 1) {
          p[i] = a.data<float>();
          for (int d = 0; d < 3; d++) st[i][d] = a.strides()[d];
        } else {
          p[i] = static_cast<const float*>(contiguous_bytes(a, tmp[i]));
          st[i][2] = a.shape(3);
          st[i][1] = a.shape(2) * st[i][2];
          st[i][0] = a.shape(1) * st[i][1];
        }
      }
      const mx::array& q = inputs[0];
      const mx::array& k = inputs[1];
      pqk::causal_attention(p[0], st[0], p[1], st[1], p[2], st[2], p[3], st[3], out.data<float>(),
                            q.shape(0), q.shape(1), k.shape(1), q.shape(2), k.shape(2), q.shape(3),
                            scale);
    });
  }

  const char* name() const override { return "PocketCausalAttention"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const PocketCausalAttention*>(&other);
    return o && o->scale_ == scale_;
  }

 private:
  float scale_;
};

}  // namespace

mx::array causal_attention(const mx::array& q, const mx::array& k, const mx::array& v,
                           const std::optional<mx::array>& gate, float scale,
                           mx::StreamOrDevice s) {
  std::vector<mx::array> in = {q, k, v};
  if (gate) {
    if (gate->shape() != mx::Shape{q.shape(0), q.shape(2), q.shape(1), q.shape(3)})
      throw std::invalid_argument("pocket_mlx._qkernels.causal_attention: gate must be [B, L, H, D]");
    in.push_back(*gate);
  }
  for (const auto* a : {&q, &k, &v, gate ? &*gate : &q})
    if (a->dtype() != mx::float32)
      throw std::invalid_argument("pocket_mlx._qkernels.causal_attention: inputs must be float32");
  if (q.ndim() != 4 || k.ndim() != 4 || v.shape() != k.shape() || k.shape(0) != q.shape(0) ||
      k.shape(3) != q.shape(3) || q.shape(1) % k.shape(1) != 0 || k.shape(2) < q.shape(2) ||
      q.shape(3) % 16 != 0)
    throw std::invalid_argument("pocket_mlx._qkernels.causal_attention: shape mismatch");
  return mx::array({q.shape(0), q.shape(2), q.shape(1), q.shape(3)}, mx::float32,
                   std::make_shared<PocketCausalAttention>(cpu_stream(s), scale), in);
}

}  // namespace pocket_ext
