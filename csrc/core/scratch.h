// Per-thread float buffers that keep their memory from one call to the next.
#pragma once

#include <cstddef>
#include <memory>

namespace pqk {

// A buffer of at least n floats, left as the last call left it (callers write before they
// read). Why: a decode step's per-layer intermediates (~1 MB a MoE layer at 8 tokens) were
// std::vectors, zero-filled on every call and, past malloc's mmap threshold, faulted in fresh:
// the memset alone was 0.7% of a B=8 step's CPU samples, on the graph's thread while the pool's
// other thread waited. Declare one `thread_local` per buffer of a call site (a thread's calls
// run one at a time) and a ScratchTrim beside them.
class Scratch {
 public:
  static constexpr size_t kKeepFloats = size_t(1) << 20;  // 4 MB: decode-sized buffers stay

  float* floats(size_t n) {
    if (n > cap_) {
      buf_.reset();
      buf_.reset(new float[n]);
      cap_ = n;
    }
    return buf_.get();
  }

  // Frees a buffer over kKeepFloats (a prefill chunk's: up to ~75 MB a MoE layer).
  void trim() {
    if (cap_ > kKeepFloats) {
      buf_.reset();
      cap_ = 0;
    }
  }

 private:
  std::unique_ptr<float[]> buf_;
  size_t cap_ = 0;
};

// Trims its buffers when the call ends, so a long prompt does not leave ~200 MB held.
template <int N>
class ScratchTrim {
 public:
  template <class... S>
  explicit ScratchTrim(S*... s) : s_{s...} {}
  ~ScratchTrim() {
    for (Scratch* x : s_) x->trim();
  }
  ScratchTrim(const ScratchTrim&) = delete;
  ScratchTrim& operator=(const ScratchTrim&) = delete;

 private:
  Scratch* s_[N];
};
template <class... S>
ScratchTrim(S*...) -> ScratchTrim<sizeof...(S)>;

}  // namespace pqk
