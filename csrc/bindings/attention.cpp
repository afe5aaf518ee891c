// Causal attention for prefill (core/attention.cpp) as one primitive, and a batched decode step's
// attention (PocketDecodeAttention, below). Prefill: q [B, Hq, L, D], k and v
// [B, Hkv, S, D] (strided views such as the KV cache's filled part are read in place; the last
// dim must be contiguous, else it is copied) -> out [B, L, Hq, D], float32 (the layout the output
// projection reads; ops.causal_attention hands it back as a [B, Hq, L, D] view).
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "bindings/common.h"
#include "bindings/ops.h"
#include "core/attention.h"

namespace pocket_ext {
namespace {

// A new key or value row (float32) written into a cache of type t: rounded to nearest even as
// MLX's astype rounds the rows a prefill writes (KVCache.update_and_fetch).
void store_row(const float* src, char* dst, int64_t n, pqk::KvType t) {
  if (t == pqk::KvType::f32) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  }
  uint16_t* d = reinterpret_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < n; i++)
    d[i] = t == pqk::KvType::f16 ? pqk::float_to_half(src[i]) : pqk::float_to_bf16(src[i]);
}

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

// One decode token of B sequences with their own KV caches (a batched step; B = 1 is a plain
// decode step): RoPE of q and k at each row's position, k and v written into row b's cache
// buffers at that position, then attention over its S = offset + 1 positions, times
// sigmoid(gate). Inputs: q, k, v [B, H, 1, D] (q, k normed), gate [B, 1, Hq, D], then each row's
// keys and values buffers [1, Hkv, cap, D]. Outputs: out [B, 1, Hq, D], then the buffers as
// written. Why one node: per sequence this was ~11 MLX nodes a layer (slices, RoPE twice, two
// slice updates, two fetches, attention), ~900 nodes of a 35B step at B = 8 whose dispatch left
// the pool's other thread idle (~9 ms of a ~180 ms step); the attention of all rows now runs on
// the pool. Bits: the same RoPE and one-row attention kernel as the per-sequence ops.
class PocketDecodeAttention : public CpuPrimitive {
 public:
  PocketDecodeAttention(mx::Stream s, std::vector<int64_t> offsets, int dims, float base,
                        float scale)
      : CpuPrimitive(s), offsets_(std::move(offsets)), dims_(dims), base_(base), scale_(scale) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const int64_t B = (int64_t)offsets_.size();
    // A buffer nobody else holds is written in place (MLX's donation rule, as its slice update
    // does): no copy of each cache a token. Each output of a multi-output node keeps its own
    // copy of the inputs (mx::array::make_arrays), so the siblings' copies of the buffers are
    // dropped first (they are evaluated here, with this node, and detached after it).
    for (auto& o : outputs)
      if (&o.inputs() != &inputs)
        for (size_t j = 4; j < o.inputs().size() && j < inputs.size(); j++)
          if (o.inputs()[j].id() == inputs[j].id()) o.inputs()[j] = o.inputs()[0];
    alloc(outputs[0]);
    std::vector<char> shared(2 * B, 0);
    for (int64_t j = 0; j < 2 * B; j++) {
      const mx::array& in = inputs[4 + j];
      if (in.is_donatable() && in.flags().row_contiguous) {
        outputs[1 + j].copy_shared_buffer(in);
        shared[j] = 1;
      } else {
        alloc(outputs[1 + j]);
      }
    }
    encode(stream(), inputs, outputs,
           [inputs, outputs, shared, off = offsets_, dims = dims_, base = base_,
            scale = scale_]() mutable {
      const int64_t B = (int64_t)off.size();
      const mx::array& q = inputs[0];
      const int64_t Hq = q.shape(1), D = q.shape(3), Hkv = inputs[1].shape(1);
      std::vector<uint8_t> tq, tk, tv, tg, tc;
      const float* qp = static_cast<const float*>(contiguous_bytes(q, tq));
      const float* kp = static_cast<const float*>(contiguous_bytes(inputs[1], tk));
      const float* vp = static_cast<const float*>(contiguous_bytes(inputs[2], tv));
      const float* gp = static_cast<const float*>(contiguous_bytes(inputs[3], tg));
      std::vector<float> qr(B * Hq * D), kr(Hkv * D);
      std::vector<const void*> kb(B), vb(B);
      const mx::Dtype dt = outputs[1].dtype();
      const pqk::KvType kv = dt == mx::float16    ? pqk::KvType::f16
                             : dt == mx::bfloat16 ? pqk::KvType::bf16
                                                  : pqk::KvType::f32;
      std::vector<int64_t> cap(B), S(B);
      for (int64_t b = 0; b < B; b++) {
        pqk::rope(qp + b * Hq * D, qr.data() + b * Hq * D, Hq, 1, D, dims, base, off[b]);
        pqk::rope(kp + b * Hkv * D, kr.data(), Hkv, 1, D, dims, base, off[b]);
        cap[b] = inputs[4 + 2 * b].shape(2);
        S[b] = off[b] + 1;
        for (int w = 0; w < 2; w++) {  // keys, then values
          mx::array& buf = outputs[1 + 2 * b + w];
          char* dst = buf.data<char>();
          if (!shared[2 * b + w])
            std::memcpy(dst, contiguous_bytes(inputs[4 + 2 * b + w], tc), buf.nbytes());
          const float* row = w == 0 ? kr.data() : vp + b * Hkv * D;
          for (int64_t h = 0; h < Hkv; h++)
            store_row(row + h * D, dst + (h * cap[b] + off[b]) * D * buf.itemsize(), D, kv);
          (w == 0 ? kb : vb)[b] = dst;
        }
      }
      pqk::decode_attention_rows(qr.data(), kb.data(), vb.data(), cap.data(), S.data(), gp,
                                 outputs[0].data<float>(), B, Hq, Hkv, D, scale, kv);
    });
  }

  const char* name() const override { return "PocketDecodeAttention"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const PocketDecodeAttention*>(&other);
    return o && o->offsets_ == offsets_ && o->dims_ == dims_ && o->base_ == base_ &&
           o->scale_ == scale_;
  }

 private:
  std::vector<int64_t> offsets_;
  int dims_;
  float base_, scale_;
};

}  // namespace

std::vector<mx::array> decode_attention(const mx::array& q, const mx::array& k,
                                        const mx::array& v, const mx::array& gate,
                                        const std::vector<mx::array>& keys,
                                        const std::vector<mx::array>& values,
                                        const std::vector<int64_t>& offsets, int dims, float base,
                                        float scale, mx::StreamOrDevice s) {
  const char* err = "pocket_mlx._qkernels.decode_attention: ";
  const int64_t B = (int64_t)offsets.size();
  for (const auto* a : {&q, &k, &v, &gate})
    if (a->dtype() != mx::float32) throw std::invalid_argument(std::string(err) + "float32 only");
  if (q.ndim() != 4 || k.ndim() != 4 || v.shape() != k.shape() || q.shape(0) != B ||
      k.shape(0) != B || q.shape(2) != 1 || k.shape(2) != 1 || k.shape(3) != q.shape(3) ||
      q.shape(1) % k.shape(1) != 0 || q.shape(3) % 16 != 0 ||
      gate.shape() != mx::Shape{B, 1, q.shape(1), q.shape(3)} ||
      (int64_t)keys.size() != B || (int64_t)values.size() != B || dims <= 0 || dims % 2 ||
      dims > q.shape(3))
    throw std::invalid_argument(std::string(err) + "shape mismatch");
  std::vector<mx::array> in = {q, k, v, gate};
  std::vector<mx::Shape> shapes = {{B, 1, q.shape(1), q.shape(3)}};
  const mx::Dtype kv = B ? keys[0].dtype() : mx::float32;
  if (kv != mx::float32 && kv != mx::float16 && kv != mx::bfloat16)
    throw std::invalid_argument(std::string(err) + "cache buffers must be float32, float16 or "
                                "bfloat16");
  for (int64_t b = 0; b < B; b++) {
    for (const auto* a : {&keys[b], &values[b]}) {
      if (a->dtype() != kv || a->ndim() != 4 || a->shape(0) != 1 ||
          a->shape(1) != k.shape(1) || a->shape(3) != k.shape(3) || offsets[b] < 0 ||
          offsets[b] >= a->shape(2))
        throw std::invalid_argument(std::string(err) + "cache buffer shape or offset mismatch");
      in.push_back(*a);
      shapes.push_back(a->shape());
    }
  }
  std::vector<mx::Dtype> dtypes(2 * B + 1, kv);
  dtypes[0] = mx::float32;
  return mx::array::make_arrays(
      std::move(shapes), std::move(dtypes),
      std::make_shared<PocketDecodeAttention>(cpu_stream(s), offsets, dims, base, scale), in);
}

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
