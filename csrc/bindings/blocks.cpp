// Whole decode blocks as one node each: the sparse MoE block (core/moe_block.cpp) and a Gated
// DeltaNet token after its projections (core/linear_attn.cpp).
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "bindings/common.h"
#include "bindings/ops.h"
#include "mlx/ops.h"

namespace pocket_ext {
namespace {

// A whole Qwen3.5-MoE sparse block (core/moe_block.cpp) as one node, for decode. Inputs: x
// [..., D] float32, then (w, scales, biases) of router, shared_expert_gate, shared gate_proj
// (or the fused gate_up), [shared up_proj,] shared down_proj, experts' gate, up, down.
class PocketMoE : public CpuPrimitive {
 public:
  // lo < 0: the whole block (one output); else its parts (moe_block_parts: parts, scores) for
  // the experts held here, global [lo, lo + E_local), with the shared expert when with_shared.
  PocketMoE(mx::Stream s, std::vector<int> bits, std::vector<int> gs, int k, bool norm_topk,
            int64_t lo = -1, bool with_shared = true)
      : CpuPrimitive(s), bits_(std::move(bits)), gs_(std::move(gs)), k_(k), norm_(norm_topk),
        lo_(lo), shared_(with_shared) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    for (auto& o : outputs) alloc(o);
    encode(stream(), inputs, outputs,
           [inputs, outputs, bits = bits_, gs = gs_, k = k_, norm = norm_, lo = lo_,
            with_shared = shared_]() mutable {
             std::vector<uint8_t> tx;
             const mx::array& x = inputs[0];
             const float* xp = static_cast<const float*>(contiguous_bytes(x, tx));
             const bool fused = bits.size() == 7;
             std::vector<std::vector<uint8_t>> tmp(3 * bits.size());
             std::vector<pqk::QMatrix> mats(bits.size());
             for (size_t i = 0; i < bits.size(); i++) {
               const mx::array& w = inputs[1 + 3 * i];
               const mx::array& sc = inputs[2 + 3 * i];
               pqk::QMatrix& q = mats[i];
               q.w = static_cast<const uint32_t*>(contiguous_bytes(w, tmp[3 * i]));
               q.scales = contiguous_bytes(sc, tmp[3 * i + 1]);
               q.biases = contiguous_bytes(inputs[3 + 3 * i], tmp[3 * i + 2]);
               q.sdt = to_pqk(sc.dtype());
               q.E = w.ndim() == 3 ? w.shape(0) : 1;
               q.N = w.shape(-2);
               q.K = (int64_t)w.shape(-1) * 32 / bits[i];
               q.bits = bits[i];
               q.group_size = gs[i];
             }
             pqk::MoeBlock b;
             size_t i = 0;
             b.router = mats[i++];
             b.shared_gate = mats[i++];
             b.shared_gate_proj = mats[i++];
             if (!fused) b.shared_up = mats[i++];
             b.shared_down = mats[i++];
             b.expert_gate = mats[i++];
             b.expert_up = mats[i++];
             b.expert_down = mats[i++];
             b.k = k;
             b.norm_topk = norm;
             const int64_t D = x.shape(-1);
             if (lo < 0)
               pqk::moe_block(b, xp, (int64_t)x.size() / D, outputs[0].data<float>());
             else
               pqk::moe_block_parts(b, xp, (int64_t)x.size() / D, lo, with_shared,
                                    outputs[0].data<float>(), outputs[1].data<float>());
           });
  }

  const char* name() const override { return "PocketMoE"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const PocketMoE*>(&other);
    return o && o->bits_ == bits_ && o->gs_ == gs_ && o->k_ == k_ && o->norm_ == norm_ &&
           o->lo_ == lo_ && o->shared_ == shared_;
  }

 private:
  std::vector<int> bits_, gs_;
  int k_;
  bool norm_;
  int64_t lo_;
  bool shared_;
};

// moe_combine: parts [..., k + 1, D] and scores [..., k] -> the block's output [..., D].
class PocketMoECombine : public CpuPrimitive {
 public:
  using CpuPrimitive::CpuPrimitive;

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    alloc(outputs[0]);
    encode(stream(), inputs, outputs, [inputs, out = outputs[0]]() mutable {
      std::vector<uint8_t> tp, ts;
      const mx::array& parts = inputs[0];
      const int64_t D = parts.shape(-1), k = parts.shape(-2) - 1;
      const auto* pp = static_cast<const float*>(contiguous_bytes(parts, tp));
      const auto* sp = static_cast<const float*>(contiguous_bytes(inputs[1], ts));
      pqk::moe_combine(pp, sp, (int64_t)out.size() / D, k, D, out.data<float>());
    });
  }

  const char* name() const override { return "PocketMoECombine"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return dynamic_cast<const PocketMoECombine*>(&other) != nullptr;
  }
};

// Decode tokens of a Gated DeltaNet layer after its projections (core/linear_attn.cpp).
// Inputs: qkv, z, b, a ([B, L, n] each, last axis contiguous: views of one fused projection
// are fine), conv_state, conv weight, A_log, dt_bias, norm weight, state. rows == false (L = 1,
// decode): outputs out [B, 1, Hv * Dv], new conv_state, new state. rows == true (the verify
// pass, linear_attn_rows): out [L, B, Hv * Dv], then the caches after each row as 2L arrays
// (L conv states, L states: separate buffers, so keeping one does not pin the others).
class PocketLinearAttn : public CpuPrimitive {
 public:
  PocketLinearAttn(mx::Stream s, int Hk, int Dk, int Hv, int Dv, float eps, bool rows = false)
      : CpuPrimitive(s), Hk_(Hk), Dk_(Dk), Hv_(Hv), Dv_(Dv), eps_(eps), rows_(rows) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    // Decode writes the new state over the old one when nothing else holds it (MLX's donation
    // rule, as its own element-wise ops use): no fresh 2 MiB buffer a layer (B of them in a
    // batched step) to fault in, and the update reads and writes the same lines. Held states
    // (a prompt-cache snapshot, the verify pass's tape) get a new buffer. gated_delta's one-token
    // kernels give the same bits in place.
    const mx::array& old_state = inputs[9];
    // Each array of a multi-output node keeps its own copy of the node's inputs
    // (mx::array::make_arrays), so the old state is held once per output and is_donatable()
    // never holds. The siblings' copies are dropped first (they are evaluated here, with this
    // node, and detached after it): what holds the state then is this node and, if any, the
    // caller.
    if (!rows_)
      for (auto& o : outputs)
        if (&o.inputs() != &inputs && o.inputs().size() > 9 && o.inputs()[9].id() == old_state.id())
          o.inputs()[9] = o.inputs()[8];
    const bool donate = !rows_ && old_state.is_donatable() && old_state.flags().row_contiguous &&
                        old_state.dtype() == mx::float32 && old_state.size() == outputs[2].size();
    for (size_t i = 0; i < outputs.size(); i++) {
      if (donate && i == 2)
        outputs[i].copy_shared_buffer(old_state);
      else
        alloc(outputs[i]);
    }
    encode(stream(), inputs, outputs,
           [inputs, outputs, Hk = Hk_, Dk = Dk_, Hv = Hv_, Dv = Dv_, eps = eps_,
            multi = rows_]() mutable {
             std::vector<std::vector<uint8_t>> tmp(inputs.size());
             // Rows of [B, L, n] arrays: pointer, batch stride and row stride in elements.
             auto rows = [&](int i, int64_t& stride, int64_t& row) {
               const mx::array& x = inputs[i];
               if (x.strides()[2] == 1) {  // any view with contiguous features: read in place
                 stride = x.strides()[0];
                 row = x.strides()[1];
                 return x.data<float>();
               }
               row = x.shape(2);
               stride = x.shape(1) * row;
               return static_cast<const float*>(contiguous_bytes(x, tmp[i]));
             };
             auto flat = [&](int i) {
               return static_cast<const float*>(contiguous_bytes(inputs[i], tmp[i]));
             };
             pqk::LinearAttnStep st;
             const mx::array& conv_state = inputs[4];
             st.B = conv_state.shape(0);
             st.kernel = conv_state.shape(1) + 1;
             st.conv_dim = conv_state.shape(2);
             st.Hk = Hk;
             st.Hv = Hv;
             st.Dk = Dk;
             st.Dv = Dv;
             int64_t ab2, qkv_row, z_row, ab_row, ab_row2;
             st.qkv = rows(0, st.qkv_stride, qkv_row);
             st.z = rows(1, st.z_stride, z_row);
             st.b = rows(2, st.ab_stride, ab_row);
             st.a = rows(3, ab2, ab_row2);
             if (ab2 != st.ab_stride || ab_row2 != ab_row) {  // b and a must share strides
               const int64_t L = inputs[2].shape(1);
               st.a = static_cast<const float*>(contiguous_bytes(inputs[3], tmp[3]));
               st.b = static_cast<const float*>(contiguous_bytes(inputs[2], tmp[2]));
               st.ab_stride = L * Hv;
               ab_row = Hv;
             }
             st.conv_state = flat(4);
             st.conv_w = flat(5);
             st.A_log = flat(6);
             st.dt_bias = flat(7);
             st.norm_w = flat(8);
             st.state_in = flat(9);
             st.norm_eps = eps;
             st.out = outputs[0].data<float>();
             if (multi) {  // outputs: out, L conv slots, L state slots
               const int64_t L = inputs[0].shape(1);
               std::vector<float*> conv(L), state(L);
               for (int64_t i = 0; i < L; i++) {
                 conv[i] = outputs[1 + i].data<float>();
                 state[i] = outputs[1 + L + i].data<float>();
               }
               pqk::linear_attn_rows(st, L, qkv_row, z_row, ab_row, conv.data(), state.data());
             } else {
               st.new_conv_state = outputs[1].data<float>();
               st.state = outputs[2].data<float>();
               pqk::linear_attn_step(st);
             }
           });
  }

  const char* name() const override { return "PocketLinearAttn"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const PocketLinearAttn*>(&other);
    return o && o->Hk_ == Hk_ && o->Dk_ == Dk_ && o->Hv_ == Hv_ && o->Dv_ == Dv_ &&
           o->eps_ == eps_ && o->rows_ == rows_;
  }

 private:
  int Hk_, Dk_, Hv_, Dv_;
  float eps_;
  bool rows_;
};

}  // namespace

// mats: 7 or 8 (w, scales, biases, bits, group_size) in PocketMoE's order.
namespace {

using Mats = std::vector<std::tuple<mx::array, mx::array, mx::array, int, int>>;

// Checks moe_block's arguments (router over E_router experts, expert matrices of E experts,
// E_router >= lo + E); returns the node's inputs and fills bits / group sizes.
std::vector<mx::array> moe_inputs(const mx::array& x, const Mats& mats, int k, int64_t lo,
                                  std::vector<int>& bits, std::vector<int>& gs) {
  const char* err = "pocket_mlx._qkernels.moe_block: ";
  require_f32(x, "moe_block");
  if (mats.size() != 7 && mats.size() != 8)
    throw std::invalid_argument(std::string(err) + "7 or 8 matrices");
  const bool fused = mats.size() == 7;
  const int64_t D = x.ndim() ? x.shape(-1) : 0;
  const mx::array& ew = std::get<0>(mats[mats.size() - 3]);  // experts' gate: [E, H, ...]
  const int64_t E = ew.ndim() == 3 ? ew.shape(0) : 0;
  const auto& sd = mats[fused ? 3 : 4];
  const int64_t Hs = (int64_t)std::get<0>(sd).shape(-1) * 32 / std::get<3>(sd);
  const auto& ed = mats[mats.size() - 1];
  const int64_t H = (int64_t)std::get<0>(ed).shape(-1) * 32 / std::get<3>(ed);
  const int64_t E_router = std::get<0>(mats[0]).shape(-2);
  if (lo < 0 ? E_router != E : lo + E > E_router)
    throw std::invalid_argument(std::string(err) + "router and experts disagree on the experts");
  std::vector<mx::array> inputs{x};
  for (size_t i = 0; i < mats.size(); i++) {
    const auto& [w, sc, bi, b, g] = mats[i];
    const bool expert = i + 3 >= mats.size();
    const bool down = i + 1 == mats.size() || i == (fused ? 3u : 4u);
    const int64_t K = down ? (expert ? H : Hs) : D;
    mx::array probe = mx::zeros({(int)K}, mx::float32);
    check_common(probe, w, sc, bi, g, b, expert ? 3 : 2);
    int64_t want = 0;
    if (i == 0) want = E_router;
    else if (i == 1) want = 1;
    else if (i == 2) want = fused ? 2 * Hs : Hs;
    else if (!fused && i == 3) want = Hs;
    else if (down) want = D;
    else want = H;  // experts' gate / up
    if (w.shape(-2) != want || (expert && w.shape(0) != E))
      throw std::invalid_argument(std::string(err) + "matrix " + std::to_string(i) + " has the wrong shape");
    bits.push_back(b);
    gs.push_back(g);
    inputs.insert(inputs.end(), {w, sc, bi});
  }
  if (k <= 0 || k > E_router || D == 0 || E == 0)
    throw std::invalid_argument(std::string(err) + "bad k or x");
  return inputs;
}

}  // namespace

mx::array moe_block(const mx::array& x, const Mats& mats, int k, bool normalize,
                    mx::StreamOrDevice s) {
  std::vector<int> bits, gs;
  auto inputs = moe_inputs(x, mats, k, -1, bits, gs);
  return mx::array(x.shape(), mx::float32,
                   std::make_shared<PocketMoE>(cpu_stream(s), bits, gs, k, normalize), inputs);
}

std::vector<mx::array> moe_block_parts(const mx::array& x, const Mats& mats, int k,
                                       bool normalize, int64_t expert_lo, bool with_shared,
                                       mx::StreamOrDevice s) {
  if (expert_lo < 0)
    throw std::invalid_argument("pocket_mlx._qkernels.moe_block_parts: expert_lo < 0");
  std::vector<int> bits, gs;
  auto inputs = moe_inputs(x, mats, k, expert_lo, bits, gs);
  mx::Shape parts = x.shape(), scores = x.shape();
  parts.insert(parts.end() - 1, k + 1);
  scores.back() = k;
  return mx::array::make_arrays(
      {parts, scores}, {mx::float32, mx::float32},
      std::make_shared<PocketMoE>(cpu_stream(s), bits, gs, k, normalize, expert_lo, with_shared),
      inputs);
}

mx::array moe_combine(const mx::array& parts, const mx::array& scores, mx::StreamOrDevice s) {
  const char* err = "pocket_mlx._qkernels.moe_combine: ";
  require_f32(parts, "moe_combine");
  require_f32(scores, "moe_combine");
  if (parts.ndim() < 2 || scores.ndim() != parts.ndim() - 1 ||
      scores.shape(-1) != parts.shape(-2) - 1 || scores.shape(-1) < 1)
    throw std::invalid_argument(std::string(err) + "parts [..., k + 1, D] and scores [..., k]");
  for (size_t i = 0; i + 1 < scores.ndim(); i++)
    if (scores.shape(i) != parts.shape(i))
      throw std::invalid_argument(std::string(err) + "parts and scores disagree on the tokens");
  mx::Shape out = scores.shape();
  out.back() = parts.shape(-1);
  return mx::array(out, mx::float32, std::make_shared<PocketMoECombine>(cpu_stream(s)),
                   {parts, scores});
}

namespace {

// Checks linear_attn_step / linear_attn_rows' arguments (qkv, z, b, a with L rows each).
void check_linear_attn(const char* err, const std::vector<const mx::array*>& xs, int64_t L,
                       int Hk, int Dk, int Hv, int Dv) {
  for (const auto* x : xs)
    if (x->dtype() != mx::float32) throw std::invalid_argument(std::string(err) + "float32 only");
  const mx::array &qkv = *xs[0], &z = *xs[1], &b = *xs[2], &a = *xs[3];
  const mx::array &conv_state = *xs[4], &conv_w = *xs[5], &A_log = *xs[6], &dt_bias = *xs[7];
  const mx::array &norm_w = *xs[8], &state = *xs[9];
  const int64_t B = conv_state.ndim() == 3 ? conv_state.shape(0) : 0;
  const int64_t C = conv_state.ndim() == 3 ? conv_state.shape(2) : 0;
  const int64_t K = conv_state.ndim() == 3 ? conv_state.shape(1) + 1 : 0;
  auto row = [&](const mx::array& x, int64_t n) {
    return x.ndim() == 3 && x.shape(0) == B && x.shape(1) == L && x.shape(2) == n;
  };
  if (B == 0 || K < 2 || L < 1 || C != 2 * (int64_t)Hk * Dk + (int64_t)Hv * Dv ||
      Hk <= 0 || Hv % Hk != 0 || !row(qkv, C) || !row(z, (int64_t)Hv * Dv) || !row(b, Hv) ||
      !row(a, Hv) || conv_w.size() != (size_t)(C * K) || conv_w.shape(0) != C ||
      A_log.size() != (size_t)Hv || dt_bias.size() != (size_t)Hv ||
      norm_w.size() != (size_t)Dv || state.shape() != mx::Shape{(int)B, Hv, Dv, Dk})
    throw std::invalid_argument(std::string(err) + "shape mismatch");
}

}  // namespace

std::vector<mx::array> linear_attn_step(const mx::array& qkv, const mx::array& z,
                                        const mx::array& b, const mx::array& a,
                                        const mx::array& conv_state, const mx::array& conv_w,
                                        const mx::array& A_log, const mx::array& dt_bias,
                                        const mx::array& norm_w, const mx::array& state, int Hk,
                                        int Dk, int Hv, int Dv, float eps, mx::StreamOrDevice s) {
  check_linear_attn("pocket_mlx._qkernels.linear_attn_step: ",
                    {&qkv, &z, &b, &a, &conv_state, &conv_w, &A_log, &dt_bias, &norm_w, &state},
                    1, Hk, Dk, Hv, Dv);
  const int B = conv_state.shape(0);
  return mx::array::make_arrays(
      {mx::Shape{B, 1, Hv * Dv}, conv_state.shape(), state.shape()},
      {mx::float32, mx::float32, mx::float32},
      std::make_shared<PocketLinearAttn>(cpu_stream(s), Hk, Dk, Hv, Dv, eps),
      {qkv, z, b, a, conv_state, conv_w, A_log, dt_bias, norm_w, state});
}

std::vector<mx::array> linear_attn_rows(const mx::array& qkv, const mx::array& z,
                                        const mx::array& b, const mx::array& a,
                                        const mx::array& conv_state, const mx::array& conv_w,
                                        const mx::array& A_log, const mx::array& dt_bias,
                                        const mx::array& norm_w, const mx::array& state, int Hk,
                                        int Dk, int Hv, int Dv, float eps, mx::StreamOrDevice s) {
  const int L = qkv.ndim() == 3 ? qkv.shape(1) : 0;
  check_linear_attn("pocket_mlx._qkernels.linear_attn_rows: ",
                    {&qkv, &z, &b, &a, &conv_state, &conv_w, &A_log, &dt_bias, &norm_w, &state},
                    L, Hk, Dk, Hv, Dv);
  const int B = conv_state.shape(0);
  std::vector<mx::Shape> shapes{mx::Shape{L, B, Hv * Dv}};
  for (int i = 0; i < L; i++) shapes.push_back(conv_state.shape());
  for (int i = 0; i < L; i++) shapes.push_back(state.shape());
  return mx::array::make_arrays(
      shapes, std::vector<mx::Dtype>(shapes.size(), mx::float32),
      std::make_shared<PocketLinearAttn>(cpu_stream(s), Hk, Dk, Hv, Dv, eps, true),
      {qkv, z, b, a, conv_state, conv_w, A_log, dt_bias, norm_w, state});
}

}  // namespace pocket_ext
