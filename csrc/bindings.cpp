// MLX extension: custom CPU primitives around the plain core in core/qkernels.h.
//   _qkernels.quantized_matmul(x, w, scales, biases, group_size, bits)        (transpose=True)
//   _qkernels.gather_qmm(x, w, scales, biases, indices, group_size, bits)     (rhs_indices)
//   _qkernels.gated_delta, rms_norm, causal_conv_silu, rope, moe_route        (decode helpers)
// eval_gpu throws: these primitives are for the CPU device only.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/qkernels.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"
#include "mlx/utils.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

pqk::DType to_pqk(mx::Dtype d) {
  if (d == mx::float32) return pqk::F32;
  if (d == mx::float16) return pqk::F16;
  if (d == mx::bfloat16) return pqk::BF16;
  throw std::invalid_argument("pocket_mlx._qkernels: dtype must be float32, float16 or bfloat16");
}

// Row-major contiguous bytes of `a` (its own buffer when already contiguous, else a copy).
const void* contiguous_bytes(const mx::array& a, std::vector<uint8_t>& tmp) {
  if (a.flags().row_contiguous) return a.data<uint8_t>();
  const size_t isz = a.itemsize();
  const int nd = (int)a.ndim();
  tmp.resize(a.size() * isz);
  const uint8_t* src = a.data<uint8_t>();
  std::vector<int64_t> idx(nd, 0);
  for (size_t i = 0; i < a.size(); i++) {
    int64_t off = 0;
    for (int d = 0; d < nd; d++) off += idx[d] * (int64_t)a.strides()[d];
    std::memcpy(tmp.data() + i * isz, src + off * (int64_t)isz, isz);
    for (int d = nd - 1; d >= 0; d--) {
      if (++idx[d] < a.shape(d)) break;
      idx[d] = 0;
    }
  }
  return tmp.data();
}

int64_t index_value(const mx::array& ind, int64_t off) {
  const uint8_t* p = ind.data<uint8_t>() + off * (int64_t)ind.itemsize();
  switch (ind.dtype()) {
    case mx::uint32: return *reinterpret_cast<const uint32_t*>(p);
    case mx::int32: return *reinterpret_cast<const int32_t*>(p);
    case mx::int64: return *reinterpret_cast<const int64_t*>(p);
    case mx::uint64: return (int64_t)*reinterpret_cast<const uint64_t*>(p);
    case mx::int16: return *reinterpret_cast<const int16_t*>(p);
    case mx::uint16: return *reinterpret_cast<const uint16_t*>(p);
    case mx::int8: return *reinterpret_cast<const int8_t*>(p);
    case mx::uint8: return *reinterpret_cast<const uint8_t*>(p);
    default: throw std::invalid_argument("pocket_mlx._qkernels: indices must be integers");
  }
}

// Element offset of the broadcast multi-index `bidx` (over `bshape`) into array `a` whose
// shape is right-aligned against bshape (missing / size-1 dims broadcast). `skip` trailing dims
// of `a` are not part of the batch.
int64_t bcast_offset(const std::vector<int64_t>& bidx, const mx::Shape& bshape,
                     const mx::array& a, int skip) {
  const int nb_ = (int)bshape.size();
  const int na = (int)a.ndim() - skip;
  int64_t off = 0;
  for (int d = 0; d < na; d++) {
    int bd = nb_ - na + d;
    if (a.shape(d) != 1) off += bidx[bd] * (int64_t)a.strides()[d];
  }
  return off;
}

// Registers the arrays with the CPU command encoder and queues `fn` on the stream's thread:
// what every primitive here does in eval_cpu once its outputs have buffers.
template <class F>
void encode(const mx::Stream& s, const std::vector<mx::array>& inputs,
            std::vector<mx::array>& outputs, F&& fn) {
  auto& enc = mx::cpu::get_command_encoder(s);
  for (auto& a : inputs) enc.set_input_array(a);
  for (auto& o : outputs) enc.set_output_array(o);
  enc.dispatch(std::forward<F>(fn));
}

void alloc(mx::array& a) { a.set_data(mx::allocator::malloc(a.nbytes())); }

// The primitives of this extension run on the CPU only; the GPU keeps MLX's own ops.
class CpuPrimitive : public mx::Primitive {
 public:
  using mx::Primitive::Primitive;
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error(std::string("pocket_mlx._qkernels: ") + name() +
                             " runs on the CPU only (the GPU uses MLX's own ops)");
  }
};

class PocketQMM : public CpuPrimitive {
 public:
  PocketQMM(mx::Stream s, int group_size, int bits, bool gathered)
      : CpuPrimitive(s), group_size_(group_size), bits_(bits), gathered_(gathered) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    mx::array& out = outputs[0];
    alloc(out);
    encode(stream(), inputs, outputs,
           [inputs, out, gs = group_size_, bits = bits_, gathered = gathered_]() mutable {
             run(inputs, out, gs, bits, gathered);
           });
  }

  const char* name() const override { return gathered_ ? "PocketGatherQMM" : "PocketQMM"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const PocketQMM*>(&other);
    return o && o->group_size_ == group_size_ && o->bits_ == bits_ && o->gathered_ == gathered_;
  }

 private:
  static void run(const std::vector<mx::array>& inputs, mx::array& out, int gs, int bits,
                  bool gathered) {
    const mx::array& x = inputs[0];
    const mx::array& w = inputs[1];
    const mx::array& sc = inputs[2];
    const mx::array& bi = inputs[3];
    const int64_t K = x.shape(-1);
    const int64_t N = w.shape(-2);
    const int64_t E = gathered ? w.shape(0) : 1;

    std::vector<uint8_t> tw, ts, tb, tx;
    const void* wp = contiguous_bytes(w, tw);
    const void* sp = contiguous_bytes(sc, ts);
    const void* bp = contiguous_bytes(bi, tb);

    // Activations: K must be contiguous; otherwise copy the whole array.
    const void* xp;
    mx::array xv = x;
    bool x_copied = false;
    if (K > 1 && x.strides().back() != 1) {
      xp = contiguous_bytes(x, tx);
      x_copied = true;
    } else {
      xp = x.data<uint8_t>();
    }
    auto x_off = [&](const std::vector<int64_t>& bidx, const mx::Shape& bshape, int64_t m) {
      // bidx over bshape (batch dims only); m = row within x's second-to-last dim.
      if (x_copied) {
        // Row-major copy: compute offsets from x's own shape.
        int64_t off = 0, stride = K * x.shape(-2);
        const int na = (int)x.ndim() - 2;
        std::vector<int64_t> rs(na);
        for (int d = na - 1; d >= 0; d--) {
          rs[d] = stride;
          stride *= x.shape(d);
        }
        for (int d = 0; d < na; d++) {
          int bd = (int)bshape.size() - na + d;
          if (x.shape(d) != 1) off += bidx[bd] * rs[d];
        }
        return off + m * K;
      }
      return bcast_offset(bidx, bshape, x, 2) + m * (int64_t)x.strides()[x.ndim() - 2];
    };

    pqk::GatherProblem p;
    p.x = xp;
    p.xdt = to_pqk(x.dtype());
    p.w = static_cast<const uint32_t*>(wp);
    p.scales = sp;
    p.biases = bp;
    p.sdt = to_pqk(sc.dtype());
    p.E = E;
    p.N = N;
    p.K = K;
    p.bits = bits;
    p.group_size = gs;
    p.out = out.data<uint8_t>();
    p.odt = to_pqk(out.dtype());

    std::vector<int64_t> offs;
    std::vector<int32_t> experts;
    if (!gathered) {
      // x [..., K] treated as rows; x may be 1-D.
      const int64_t R = out.size() / N;
      offs.resize(R);
      if (x.ndim() == 1) {
        offs[0] = 0;
      } else {
        mx::Shape bshape(x.shape().begin(), x.shape().end() - 2);
        std::vector<int64_t> bidx(bshape.size(), 0);
        const int64_t M = x.shape(-2);
        int64_t r = 0;
        for (int64_t b = 0; b < R / M; b++) {
          for (int64_t m = 0; m < M; m++) offs[r++] = x_off(bidx, bshape, m);
          for (int d = (int)bshape.size() - 1; d >= 0; d--) {
            if (++bidx[d] < bshape[d]) break;
            bidx[d] = 0;
          }
        }
      }
      p.nrows = R;
      p.xrow_off = offs.data();
      p.expert = nullptr;
    } else {
      const mx::array& ind = inputs[4];
      // out: batch + [M, N]
      mx::Shape bshape(out.shape().begin(), out.shape().end() - 2);
      const int64_t M = out.shape(-2);
      int64_t B = 1;
      for (auto s : bshape) B *= s;
      offs.resize(B * M);
      experts.resize(B * M);
      std::vector<int64_t> bidx(bshape.size(), 0);
      for (int64_t b = 0; b < B; b++) {
        int64_t e = index_value(ind, bcast_offset(bidx, bshape, ind, 0));
        int32_t ei = (e < 0 || e >= E) ? -1 : (int32_t)e;
        for (int64_t m = 0; m < M; m++) {
          offs[b * M + m] = x_off(bidx, bshape, m);
          experts[b * M + m] = ei;
        }
        for (int d = (int)bshape.size() - 1; d >= 0; d--) {
          if (++bidx[d] < bshape[d]) break;
          bidx[d] = 0;
        }
      }
      p.nrows = B * M;
      p.xrow_off = offs.data();
      p.expert = experts.data();
    }
    pqk::gather_qmm(p);
  }

  int group_size_, bits_;
  bool gathered_;
};

void check_common(const mx::array& x, const mx::array& w, const mx::array& sc,
                  const mx::array& bi, int group_size, int bits, int w_ndim) {
  std::ostringstream msg;
  if (!pqk::supported(bits, group_size, x.ndim() ? x.shape(-1) : 0)) {
    msg << "unsupported bits=" << bits << " group_size=" << group_size;
  } else if (w.dtype() != mx::uint32 || (int)w.ndim() != w_ndim) {
    msg << "w must be uint32 with " << w_ndim << " dims";
  } else if (sc.shape() != bi.shape() || sc.dtype() != bi.dtype() || (int)sc.ndim() != w_ndim) {
    msg << "scales and biases must have the same shape and dtype";
  } else if ((int64_t)w.shape(-1) * 32 / bits != x.shape(-1) ||
             (int64_t)sc.shape(-1) * group_size != x.shape(-1) || sc.shape(-2) != w.shape(-2) ||
             (w_ndim == 3 && sc.shape(0) != w.shape(0))) {
    msg << "shape mismatch: x " << x.shape(-1) << ", w " << w.shape(-1) << " words, scales "
        << sc.shape(-1) << " groups";
  } else {
    to_pqk(x.dtype());
    to_pqk(sc.dtype());
    return;
  }
  throw std::invalid_argument("pocket_mlx._qkernels: " + msg.str());
}

mx::Stream cpu_stream(const mx::StreamOrDevice& s) {
  return mx::to_stream(s, mx::Device::cpu);
}

mx::array quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales,
                           const mx::array& biases, int group_size, int bits,
                           mx::StreamOrDevice s) {
  if (x.ndim() < 1) throw std::invalid_argument("pocket_mlx._qkernels: x must have a K axis");
  check_common(x, w, scales, biases, group_size, bits, 2);
  mx::Shape oshape = x.shape();
  oshape.back() = w.shape(0);
  mx::Dtype odt = mx::promote_types(x.dtype(), scales.dtype());
  return mx::array(oshape, odt,
                   std::make_shared<PocketQMM>(cpu_stream(s), group_size, bits, false),
                   {x, w, scales, biases});
}

mx::array gather_qmm(const mx::array& x, const mx::array& w, const mx::array& scales,
                     const mx::array& biases, const mx::array& indices, int group_size,
                     int bits, mx::StreamOrDevice s) {
  if (x.ndim() < 2) throw std::invalid_argument("pocket_mlx._qkernels: x must be [..., M, K]");
  check_common(x, w, scales, biases, group_size, bits, 3);
  if (!mx::issubdtype(indices.dtype(), mx::integer))
    throw std::invalid_argument("pocket_mlx._qkernels: indices must be integers");
  mx::Shape xb(x.shape().begin(), x.shape().end() - 2);
  mx::Shape bshape = mx::broadcast_shapes(xb, indices.shape());
  mx::Shape oshape = bshape;
  oshape.push_back(x.shape(-2));
  oshape.push_back(w.shape(1));
  mx::Dtype odt = mx::promote_types(x.dtype(), scales.dtype());
  return mx::array(oshape, odt,
                   std::make_shared<PocketQMM>(cpu_stream(s), group_size, bits, true),
                   {x, w, scales, biases, indices});
}

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

// Small per-layer ops (core/norms.cpp, core/decode_ops.cpp), float32: one node each where MLX's
// CPU backend runs a graph of composed ops (mx.fast.rms_norm alone is ~10 nodes on the CPU).
class PocketSmallOp : public CpuPrimitive {
 public:
  enum Kind { RMS_NORM, CONV_SILU, ROPE, ROUTE };
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

void require_f32(const mx::array& a, const char* what) {
  if (a.dtype() != mx::float32)
    throw std::invalid_argument(std::string("pocket_mlx._qkernels.") + what + ": float32 only");
}

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

// A whole Qwen3.5-MoE sparse block (core/moe_block.cpp) as one node, for decode. Inputs: x
// [..., D] float32, then (w, scales, biases) of router, shared_expert_gate, shared gate_proj
// (or the fused gate_up), [shared up_proj,] shared down_proj, experts' gate, up, down.
class PocketMoE : public CpuPrimitive {
 public:
  PocketMoE(mx::Stream s, std::vector<int> bits, std::vector<int> gs, int k, bool norm_topk)
      : CpuPrimitive(s), bits_(std::move(bits)), gs_(std::move(gs)), k_(k), norm_(norm_topk) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    alloc(outputs[0]);
    encode(stream(), inputs, outputs,
           [inputs, out = outputs[0], bits = bits_, gs = gs_, k = k_, norm = norm_]() mutable {
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
             pqk::moe_block(b, xp, (int64_t)x.size() / D, out.data<float>());
           });
  }

  const char* name() const override { return "PocketMoE"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const PocketMoE*>(&other);
    return o && o->bits_ == bits_ && o->gs_ == gs_ && o->k_ == k_ && o->norm_ == norm_;
  }

 private:
  std::vector<int> bits_, gs_;
  int k_;
  bool norm_;
};

// mats: 7 or 8 (w, scales, biases, bits, group_size) in PocketMoE's order.
mx::array moe_block(const mx::array& x,
                    const std::vector<std::tuple<mx::array, mx::array, mx::array, int, int>>& mats,
                    int k, bool normalize, mx::StreamOrDevice s) {
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
  std::vector<int> bits, gs;
  std::vector<mx::array> inputs{x};
  for (size_t i = 0; i < mats.size(); i++) {
    const auto& [w, sc, bi, b, g] = mats[i];
    const bool expert = i + 3 >= mats.size();
    const bool down = i + 1 == mats.size() || i == (fused ? 3u : 4u);
    const int64_t K = down ? (expert ? H : Hs) : D;
    mx::array probe = mx::zeros({(int)K}, mx::float32);
    check_common(probe, w, sc, bi, g, b, expert ? 3 : 2);
    int64_t want = 0;
    if (i == 0) want = E;
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
  if (k <= 0 || k > E || D == 0)
    throw std::invalid_argument(std::string(err) + "bad k or x");
  return mx::array(x.shape(), mx::float32,
                   std::make_shared<PocketMoE>(cpu_stream(s), bits, gs, k, normalize), inputs);
}

// One decode token of a Gated DeltaNet layer after its projections (core/linear_attn.cpp).
// Inputs: qkv, z, b, a ([B, 1, n] each, last axis contiguous: views of one fused projection
// are fine), conv_state, conv weight, A_log, dt_bias, norm weight, state. Outputs: out
// [B, 1, Hv * Dv], new conv_state, new state.
class PocketLinearAttn : public CpuPrimitive {
 public:
  PocketLinearAttn(mx::Stream s, int Hk, int Dk, int Hv, int Dv, float eps)
      : CpuPrimitive(s), Hk_(Hk), Dk_(Dk), Hv_(Hv), Dv_(Dv), eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    for (auto& o : outputs) alloc(o);
    encode(stream(), inputs, outputs,
           [inputs, outputs, Hk = Hk_, Dk = Dk_, Hv = Hv_, Dv = Dv_, eps = eps_]() mutable {
             std::vector<std::vector<uint8_t>> tmp(inputs.size());
             // Rows of [B, 1, n] arrays: (pointer, batch stride in elements).
             auto rows = [&](int i, int64_t& stride) {
               const mx::array& x = inputs[i];
               if (x.strides().back() == 1 && (x.shape(0) == 1 || x.strides()[1] == x.strides()[0])) {
                 stride = x.strides()[0];
                 return x.data<float>();
               }
               stride = x.shape(-1);
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
             int64_t ab2;
             st.qkv = rows(0, st.qkv_stride);
             st.z = rows(1, st.z_stride);
             st.b = rows(2, st.ab_stride);
             st.a = rows(3, ab2);
             if (ab2 != st.ab_stride) {  // b and a must share one stride: pack a like b
               st.a = static_cast<const float*>(contiguous_bytes(inputs[3], tmp[3]));
               st.b = static_cast<const float*>(contiguous_bytes(inputs[2], tmp[2]));
               st.ab_stride = Hv;
             }
             st.conv_state = flat(4);
             st.conv_w = flat(5);
             st.A_log = flat(6);
             st.dt_bias = flat(7);
             st.norm_w = flat(8);
             st.state_in = flat(9);
             st.norm_eps = eps;
             st.out = outputs[0].data<float>();
             st.new_conv_state = outputs[1].data<float>();
             st.state = outputs[2].data<float>();
             pqk::linear_attn_step(st);
           });
  }

  const char* name() const override { return "PocketLinearAttn"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const PocketLinearAttn*>(&other);
    return o && o->Hk_ == Hk_ && o->Dk_ == Dk_ && o->Hv_ == Hv_ && o->Dv_ == Dv_ && o->eps_ == eps_;
  }

 private:
  int Hk_, Dk_, Hv_, Dv_;
  float eps_;
};

std::vector<mx::array> linear_attn_step(const mx::array& qkv, const mx::array& z,
                                        const mx::array& b, const mx::array& a,
                                        const mx::array& conv_state, const mx::array& conv_w,
                                        const mx::array& A_log, const mx::array& dt_bias,
                                        const mx::array& norm_w, const mx::array& state, int Hk,
                                        int Dk, int Hv, int Dv, float eps, mx::StreamOrDevice s) {
  const char* err = "pocket_mlx._qkernels.linear_attn_step: ";
  for (const auto* x : {&qkv, &z, &b, &a, &conv_state, &conv_w, &A_log, &dt_bias, &norm_w, &state})
    if (x->dtype() != mx::float32) throw std::invalid_argument(std::string(err) + "float32 only");
  const int64_t B = conv_state.ndim() == 3 ? conv_state.shape(0) : 0;
  const int64_t C = conv_state.ndim() == 3 ? conv_state.shape(2) : 0;
  const int64_t K = conv_state.ndim() == 3 ? conv_state.shape(1) + 1 : 0;
  auto row = [&](const mx::array& x, int64_t n) {
    return x.ndim() == 3 && x.shape(0) == B && x.shape(1) == 1 && x.shape(2) == n;
  };
  if (B == 0 || K < 2 || C != 2 * (int64_t)Hk * Dk + (int64_t)Hv * Dv || Hv % Hk != 0 ||
      !row(qkv, C) || !row(z, (int64_t)Hv * Dv) || !row(b, Hv) || !row(a, Hv) ||
      conv_w.size() != (size_t)(C * K) || conv_w.shape(0) != C || A_log.size() != (size_t)Hv ||
      dt_bias.size() != (size_t)Hv || norm_w.size() != (size_t)Dv ||
      state.shape() != mx::Shape{(int)B, Hv, Dv, Dk})
    throw std::invalid_argument(std::string(err) + "shape mismatch");
  return mx::array::make_arrays(
      {mx::Shape{(int)B, 1, Hv * Dv}, conv_state.shape(), state.shape()},
      {mx::float32, mx::float32, mx::float32},
      std::make_shared<PocketLinearAttn>(cpu_stream(s), Hk, Dk, Hv, Dv, eps),
      {qkv, z, b, a, conv_state, conv_w, A_log, dt_bias, norm_w, state});
}

}  // namespace

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
  m.def("moe_block", &moe_block, nb::arg("x"), nb::arg("mats"), nb::kw_only(), nb::arg("k"),
        nb::arg("normalize"), nb::arg("stream") = nb::none(),
        "A whole Qwen3.5-MoE sparse block on the CPU (router, top-k SwiGLU experts, gated shared "
        "expert), float32; mats: (w, scales, biases, bits, group_size) x 7 (fused shared "
        "gate_up) or 8.");
  m.def("linear_attn_step", &linear_attn_step, nb::arg("qkv"), nb::arg("z"), nb::arg("b"),
        nb::arg("a"), nb::arg("conv_state"), nb::arg("conv_w"), nb::arg("A_log"),
        nb::arg("dt_bias"), nb::arg("norm_w"), nb::arg("state"), nb::kw_only(), nb::arg("Hk"),
        nb::arg("Dk"), nb::arg("Hv"), nb::arg("Dv"), nb::arg("eps"),
        nb::arg("stream") = nb::none(),
        "One decode token of a Gated DeltaNet layer after its projections, on the CPU: "
        "(out [B, 1, Hv*Dv], new conv_state, new state), float32.");
  m.def("set_threads", [](int n) { pqk::set_threads(n); }, nb::arg("n"));
  m.def("get_threads", []() { return pqk::get_threads(); });
  m.def("default_threads", []() { return pqk::default_threads(); });
  m.def("set_mode", [](int mode) { pqk::set_mode(mode); }, nb::arg("mode"));
  m.def("get_mode", []() { return pqk::get_mode(); });
  m.def("isa", []() { return std::string(pqk::isa()); });
  m.def("best_isa", []() { return std::string(pqk::best_isa()); });
  m.def("force_isa", [](const std::string& n) { return pqk::force_isa(n.c_str()); },
        nb::arg("name"));
  m.def("set_single_thread_bytes", [](int64_t b) { pqk::set_single_thread_bytes(b); },
        nb::arg("bytes"));
  m.def("supported", [](int bits, int gs, int64_t K) { return pqk::supported(bits, gs, K); },
        nb::arg("bits"), nb::arg("group_size"), nb::arg("K"));
  m.attr("MODE_EXACT") = (int)pqk::MODE_EXACT;
  m.attr("MODE_FAST") = (int)pqk::MODE_FAST;
}
