// Quantized matmul primitives: quantized_matmul (transpose=True) and gather_qmm (rhs_indices),
// one primitive class for both (core/qkernels.cpp does the work).
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <vector>

#include "bindings/common.h"
#include "bindings/ops.h"
#include "mlx/ops.h"

namespace pocket_ext {
namespace {

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

}  // namespace

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

}  // namespace pocket_ext
