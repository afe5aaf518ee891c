// Shared by the extension's primitives (csrc/bindings/*.cpp): the CPU-only primitive base class,
// the CPU command-encoder helper, dtype mapping, strided-input copies and argument checks.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "core/qkernels.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"
#include "mlx/utils.h"

namespace mx = mlx::core;

namespace pocket_ext {

pqk::DType to_pqk(mx::Dtype d);

// Row-major contiguous bytes of `a` (its own buffer when already contiguous, else a copy).
const void* contiguous_bytes(const mx::array& a, std::vector<uint8_t>& tmp);

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

inline void alloc(mx::array& a) { a.set_data(mx::allocator::malloc(a.nbytes())); }

// The primitives of this extension run on the CPU only; the GPU keeps MLX's own ops.
class CpuPrimitive : public mx::Primitive {
 public:
  using mx::Primitive::Primitive;
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error(std::string("pocket_mlx._qkernels: ") + name() +
                             " runs on the CPU only (the GPU uses MLX's own ops)");
  }
};

// Checks x, w, scales, biases of a quantized matmul (w with w_ndim dims); throws
// std::invalid_argument (ValueError in Python) naming the problem.
void check_common(const mx::array& x, const mx::array& w, const mx::array& sc,
                  const mx::array& bi, int group_size, int bits, int w_ndim);

// Throws std::invalid_argument unless `a` is float32 (`what`: the op's name).
void require_f32(const mx::array& a, const char* what);

inline mx::Stream cpu_stream(const mx::StreamOrDevice& s) {
  return mx::to_stream(s, mx::Device::cpu);
}

}  // namespace pocket_ext
