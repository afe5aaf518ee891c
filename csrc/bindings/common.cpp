// Definitions of the shared helpers declared in common.h.
#include "bindings/common.h"

#include <cstring>
#include <sstream>

namespace pocket_ext {

pqk::DType to_pqk(mx::Dtype d) {
  if (d == mx::float32) return pqk::F32;
  if (d == mx::float16) return pqk::F16;
  if (d == mx::bfloat16) return pqk::BF16;
  throw std::invalid_argument("pocket_mlx._qkernels: dtype must be float32, float16 or bfloat16");
}

const void* contiguous_bytes(const mx::array& a, std::vector<uint8_t>& tmp) {
  if (a.flags().row_contiguous) return a.data<uint8_t>();
  const size_t isz = a.itemsize();
  const int nd = (int)a.ndim();
  tmp.resize(a.size() * isz);
  const uint8_t* src = a.data<uint8_t>();
  std::vector<int64_t> idx(nd, 0);
  if (nd >= 1 && a.strides()[nd - 1] == 1 && a.size() > 0) {
    // Contiguous last axis (e.g. a slice of the features): one memcpy per row.
    const int64_t inner = a.shape(nd - 1);
    const size_t rows = a.size() / inner;
    for (size_t r = 0; r < rows; r++) {
      int64_t off = 0;
      for (int d = 0; d < nd - 1; d++) off += idx[d] * (int64_t)a.strides()[d];
      std::memcpy(tmp.data() + r * inner * isz, src + off * (int64_t)isz, inner * isz);
      for (int d = nd - 2; d >= 0; d--) {
        if (++idx[d] < a.shape(d)) break;
        idx[d] = 0;
      }
    }
    return tmp.data();
  }
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

void require_f32(const mx::array& a, const char* what) {
  if (a.dtype() != mx::float32)
    throw std::invalid_argument(std::string("pocket_mlx._qkernels.") + what + ": float32 only");
}

}  // namespace pocket_ext
