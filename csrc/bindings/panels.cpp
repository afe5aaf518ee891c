// The panel layout from Python (core/qk_panel.h): pack a quantized matrix of MLX arrays into the
// CPU row-panel layout (its MLX pages then handed back to the OS: one copy of the weights), and
// unpack it into fresh MLX arrays for another device.
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "bindings/common.h"
#include "bindings/ops.h"
#include "qk_panel.h"

namespace pocket_ext {
namespace {

// The MLX arrays of every packed matrix stay referenced while packed: their buffer address is
// the registry's key, so it must not be freed and reused by another array.
std::mutex g_mu;
std::unordered_map<const void*, std::vector<mx::array>>& held() {
  static auto* m = new std::unordered_map<const void*, std::vector<mx::array>>;
  return *m;
}

void check_ready(const mx::array& a, const char* what) {
  if (!a.is_available()) throw std::invalid_argument(std::string("panel_pack: ") + what + " is not evaluated");
  if (!a.flags().row_contiguous)
    throw std::invalid_argument(std::string("panel_pack: ") + what + " is not contiguous");
}

}  // namespace

int64_t panel_pack(const mx::array& w, const mx::array& scales, const mx::array& biases, int bits,
                   int group_size, bool release) {
  if (w.ndim() != 2 && w.ndim() != 3) throw std::invalid_argument("panel_pack: w must be 2-D or 3-D");
  if (w.dtype() != mx::uint32) throw std::invalid_argument("panel_pack: w must be uint32");
  if (scales.dtype() != biases.dtype() || scales.shape() != biases.shape())
    throw std::invalid_argument("panel_pack: scales and biases differ in dtype or shape");
  check_ready(w, "w");
  check_ready(scales, "scales");
  check_ready(biases, "biases");
  pqk::QMatrix q;
  q.w = w.data<uint32_t>();
  q.scales = scales.data<uint8_t>();
  q.biases = biases.data<uint8_t>();
  q.sdt = to_pqk(scales.dtype());
  q.E = w.ndim() == 3 ? w.shape(0) : 1;
  q.N = w.shape(-2);
  q.K = (int64_t)w.shape(-1) * 32 / bits;
  q.bits = bits;
  q.group_size = group_size;
  if (scales.shape(-1) * group_size != q.K || scales.size() != (size_t)(q.E * q.N * (q.K / group_size)))
    throw std::invalid_argument("panel_pack: scales do not match w");
  const int64_t bytes = pqk::panel_pack(q);
  if (bytes <= 0) return 0;
  {
    std::lock_guard<std::mutex> lk(g_mu);
    held()[q.w] = {w, scales, biases};
  }
  if (release) {
    pqk::release_pages(const_cast<uint32_t*>(q.w), w.nbytes());
    pqk::release_pages(const_cast<void*>(q.scales), scales.nbytes());
    pqk::release_pages(const_cast<void*>(q.biases), biases.nbytes());
  }
  return bytes;
}

// The MLX layout is written back into the packed matrix's own arrays (their released pages fault
// back in), which are returned: a graph built while the matrix was packed and evaluated after
// (e.g. a device switch with a step still lazy) then reads the right bytes through either path,
// and the peak is still one matrix more than the panels.
std::tuple<mx::array, mx::array, mx::array> panel_unpack(const mx::array& w) {
  if (!w.is_available()) throw std::invalid_argument("panel_unpack: w is not packed");
  std::vector<mx::array> arrs;
  {
    std::lock_guard<std::mutex> lk(g_mu);
    auto it = held().find(w.data<uint32_t>());
    if (it == held().end()) throw std::invalid_argument("panel_unpack: w is not packed");
    arrs = it->second;
  }
  const void* key = arrs[0].data<uint32_t>();
  pqk::panel_unpack(key, const_cast<uint32_t*>(arrs[0].data<uint32_t>()),
                    const_cast<uint8_t*>(arrs[1].data<uint8_t>()),
                    const_cast<uint8_t*>(arrs[2].data<uint8_t>()));
  pqk::panel_release(key);
  {
    std::lock_guard<std::mutex> lk(g_mu);
    held().erase(key);
  }
  return {arrs[0], arrs[1], arrs[2]};
}

bool panel_release(const mx::array& w) {
  if (!w.is_available()) return false;
  const void* key = w.data<uint32_t>();
  const bool r = pqk::panel_release(key);
  std::lock_guard<std::mutex> lk(g_mu);
  held().erase(key);
  return r;
}

// Whether w's memory is (part of) a packed matrix: its MLX pages were handed back, so anything
// but the extension's kernels reading it would see zeros (kernels.packed guards MLX's fallbacks).
bool panel_packed(const mx::array& w) {
  if (!w.is_available() || w.nbytes() == 0) return false;
  const void* p = w.data<uint8_t>();
  return pqk::detail::panel_find(p) != nullptr || pqk::detail::panel_covers(p);
}

// The panel kernels' variant ("portable" where this CPU has none: packing is then refused).
std::string panel_variant() { return pqk::detail::panel_kernels().variant; }

}  // namespace pocket_ext
