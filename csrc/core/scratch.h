// Per-thread float buffers that keep their memory from one call to the next.
#pragma once

#include <cstddef>
#include <memory>

namespace pqk {

// A buffer of at least n floats, left as the last call left it (callers write before they
// read). Why: a decode step's per-layer intermediates (~1 MB a MoE layer at 8 tokens) were
// std::vectors, zero-filled on every call and, past malloc's mmap threshold, faulted in fresh:
// memset and page faults were ~1.5% of a B=8 step, serial while the pool's other thread waited.
// Declare one `thread_local` per buffer of a call site: a thread's calls run one at a time.
// Only decode-sized buffers stay: one over kKeepFloats (a prefill chunk's, up to ~75 MB) is
// replaced by a small one at the next call that fits under it, so it lives until then.
class Scratch {
 public:
  static constexpr size_t kKeepFloats = size_t(1) << 20;  // 4 MB

  float* floats(size_t n) {
    if (n > cap_ || (cap_ > kKeepFloats && n <= kKeepFloats)) {
      buf_.reset();
      buf_.reset(new float[n]);
      cap_ = n;
    }
    return buf_.get();
  }

 private:
  std::unique_ptr<float[]> buf_;
  size_t cap_ = 0;
};

}  // namespace pqk
