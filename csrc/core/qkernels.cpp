// Driver: ISA dispatch, activation preparation, expert grouping, work splitting. The thread
// pool is thread_pool.cpp; what the CPU supports comes from cpu_features.cpp.
#include "qkernels.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "cpu_features.h"
#include "qk_gemm.h"
#include "qk_internal.h"
#include "qk_panel.h"

namespace pqk {
namespace detail {
#if defined(__x86_64__) || defined(_M_X64)
extern const IsaOps avx512_ops;
extern const IsaOps avx512vnni_ops;
extern const IsaOps avx512vbmi_ops;
extern const IsaOps avx2_ops;
#endif

// ---------------------------------------------------------------- scalar kernels (any CPU)
template <int MR>
static void rows_exact_scalar_t(const RowsArgs& a) {
  const int64_t K = a.K;
  const int gs = a.gs;
  const int64_t G = K / gs;
  const int64_t row_bytes = K * a.bits / 8;
  float* sf = a.scratch;
  float* bf = a.scratch + G + 64;
  for (int64_t n = a.n0; n < a.n1; n++) {
    const uint8_t* wr = a.w + n * row_bytes;
    convert_to_f32(a.scales, a.sdt, n * G, G, sf);
    convert_to_f32(a.biases, a.sdt, n * G, G, bf);
    float acc[MR] = {};
    for (int64_t g = 0; g < G; g++) {
      const float s = sf[g], b = bf[g];
      for (int64_t k = g * gs; k < (g + 1) * gs; k++) {
        const float wv = s * (float)get_q(wr, k, a.bits) + b;
        for (int m = 0; m < MR; m++) acc[m] += a.xp[m][k] * wv;
      }
    }
    for (int m = 0; m < MR; m++) store_elem(a.out[m], a.odt, n, acc[m]);
  }
}

static void rows_exact_scalar(const RowsArgs& a) {
  switch (a.mr) {
    case 1: return rows_exact_scalar_t<1>(a);
    case 2: return rows_exact_scalar_t<2>(a);
    case 3: return rows_exact_scalar_t<3>(a);
    case 4: return rows_exact_scalar_t<4>(a);
    case 5: return rows_exact_scalar_t<5>(a);
    case 6: return rows_exact_scalar_t<6>(a);
    case 7: return rows_exact_scalar_t<7>(a);
    default: return rows_exact_scalar_t<8>(a);
  }
}

static const IsaOps scalar_ops = {"scalar", 1, &rows_exact_scalar, nullptr, {}};

// ---------------------------------------------------------------- ISA selection
static const IsaOps* isa_by_name(const std::string& name) {
#if defined(__x86_64__) || defined(_M_X64)
  const CpuFeatures& f = cpu_features();
  if (name == "avx512") {
    if (f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq) {
      if (!f.avx512vnni) return &avx512_ops;
      return f.avx512vbmi ? &avx512vbmi_ops : &avx512vnni_ops;
    }
    return nullptr;
  }
  if (name == "avx512-novnni") {  // testing: AVX-512BW kernels on a CPU with VNNI
    if (f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq) return &avx512_ops;
    return nullptr;
  }
  if (name == "avx512-novbmi") {  // testing: the VNNI kernels a CPU without VBMI (Cascade Lake) runs
    if (f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq && f.avx512vnni) return &avx512vnni_ops;
    return nullptr;
  }
  if (name == "avx2") {
    if (f.avx2 && f.fma) return &avx2_ops;
    return nullptr;
  }
#endif
#if defined(__aarch64__)
  if (name.rfind("neon", 0) == 0) return neon_select(name.c_str());
#endif
  if (name == "scalar") return &scalar_ops;
  return nullptr;
}

static const IsaOps* detect_best() {
  for (const char* n : {"avx512", "avx2", "neon"}) {
    if (const IsaOps* o = isa_by_name(n)) return o;
  }
  return &scalar_ops;
}

static std::atomic<const IsaOps*> g_isa{nullptr};
static std::atomic<int> g_mode{MODE_EXACT};
static std::atomic<int64_t> g_single_bytes{256 * 1024};

static const IsaOps* current_isa() {
  const IsaOps* o = g_isa.load(std::memory_order_acquire);
  if (!o) {
    o = detect_best();
    if (const char* env = std::getenv("POCKET_MLX_ISA")) {
      if (const IsaOps* f = isa_by_name(env)) o = f;
    }
    g_isa.store(o, std::memory_order_release);
  }
  return o;
}

// ---------------------------------------------------------------- activation preparation
// x row (any dtype) -> float32 in the ISA layout, plus exact float sums per group (bias term).
static void prep_row(const void* x, DType xdt, int64_t off, int64_t K, int W, int bits, int gs,
                     float* tmp, float* dst, float* xsum) {
  convert_to_f32(x, xdt, off, K, tmp);
  for (int64_t g = 0; g < K / gs; g++) {
    float sum = 0.f;
    for (int i = 0; i < gs; i++) sum += tmp[g * gs + i];
    xsum[g] = sum;
  }
  if (W <= 1) {
    std::memcpy(dst, tmp, K * sizeof(float));
    return;
  }
  const int T = vals_per_lane(bits);
  const int64_t BV = (int64_t)W * T;
  const int64_t nblk = K / BV;
  for (int64_t b = 0; b < nblk; b++) {
    const float* s = tmp + b * BV;
    float* d = dst + b * BV;
    for (int t = 0; t < T; t++)
      for (int j = 0; j < W; j++) d[t * W + j] = s[j * T + t];
  }
  std::memcpy(dst + nblk * BV, tmp + nblk * BV, (K - nblk * BV) * sizeof(float));
}

// FAST mode: x row -> int8 codes per group (ISA layout for 2/4/8-bit lanes), group scales and
// exact float group sums. Each group's sum is added in index order from 0 (the bits every build
// and every earlier version give), 16 groups side by side so the adds do not wait on each other;
// the codes are one flat loop the compiler vectorizes (round to nearest even, as nearbyint).
// Decode prepared ~15,000 values a MoE block at ~2.3 ns each in the one-group-at-a-time form.
#if defined(__x86_64__) && defined(__linux__) && !defined(__clang__)
__attribute__((target_clones("avx512f", "avx2,fma", "default")))
#endif
static void prep_row_fast(const float* src, int64_t K, int gs, int W, int bits, int8_t* tmpq,
                          int8_t* dstq, float* xd, float* xsum) {
  const int64_t G = K / gs;
  constexpr int L = 16;
  for (int64_t g0 = 0; g0 < G; g0 += L) {
    const int n = (int)std::min<int64_t>(L, G - g0);
    float amax[L] = {}, sum[L] = {};
    const float* s = src + g0 * gs;
    if (n == L) {
      for (int i = 0; i < gs; i++)
        for (int l = 0; l < L; l++) {
          const float v = s[l * gs + i];
          amax[l] = std::max(amax[l], std::fabs(v));
          sum[l] += v;
        }
    } else {
      for (int i = 0; i < gs; i++)
        for (int l = 0; l < n; l++) {
          const float v = s[l * gs + i];
          amax[l] = std::max(amax[l], std::fabs(v));
          sum[l] += v;
        }
    }
    for (int l = 0; l < n; l++) {
      xd[g0 + l] = amax[l] / 127.f;
      xsum[g0 + l] = sum[l];
    }
  }
  int8_t* q = W > 1 ? tmpq : dstq;
  for (int64_t g = 0; g < G; g++) {
    const float d = xd[g];
    const float id = d > 0.f ? 1.f / d : 0.f;
    const float* s = src + g * gs;
    int8_t* o = q + g * gs;
    for (int i = 0; i < gs; i++) {
      float v = std::nearbyint(s[i] * id);
      v = std::min(127.f, std::max(-127.f, v));
      o[i] = (int8_t)v;
    }
  }
  if (W <= 1) return;
  const int T = vals_per_lane(bits);
  const int S = T / 4;
  const int64_t BV = (int64_t)W * T;
  const int64_t nblk = K / BV;
  for (int64_t b = 0; b < nblk; b++) {
    const int8_t* s = tmpq + b * BV;
    int8_t* d = dstq + b * BV;
    for (int st = 0; st < S; st++)
      for (int j = 0; j < W; j++)
        for (int i = 0; i < 4; i++) d[st * W * 4 + j * 4 + i] = s[j * T + S * i + st];
  }
  std::memcpy(dstq + nblk * BV, tmpq + nblk * BV, K - nblk * BV);
}

}  // namespace detail

using namespace detail;

// ---------------------------------------------------------------- public API
void set_mode(int mode) { g_mode.store(mode == MODE_FAST ? MODE_FAST : MODE_EXACT); }
int get_mode() { return g_mode.load(); }

const char* isa() { return current_isa()->name; }
const char* best_isa() { return detect_best()->name; }

const char* isa_variant() {
  const IsaOps* o = current_isa();
  return o->variant ? o->variant : o->name;
}

int fast_bits_mask() {
  const IsaOps* o = current_isa();
  int mask = 0;
  if (o->rows_fast)
    for (int b = 0; b < 9; b++)
      if (o->fast_bits[b]) mask |= 1 << b;
  return mask;
}

bool force_isa(const char* name) {
  std::string n = name ? name : "auto";
  const IsaOps* o = (n == "auto") ? detect_best() : isa_by_name(n);
  if (!o) return false;
  g_isa.store(o);
  return true;
}

void set_single_thread_bytes(int64_t bytes) { g_single_bytes.store(bytes); }

bool supported(int bits, int group_size, int64_t K) {
  bool b = bits == 1 || bits == 2 || bits == 3 || bits == 4 || bits == 5 || bits == 6 || bits == 8;
  bool g = group_size == 32 || group_size == 64 || group_size == 128;
  return b && g && K > 0 && K % group_size == 0;
}

// FAST mode asked and this ISA's row kernels have it for `bits`.
static bool fast_rows(const IsaOps* ops, int bits) {
  return g_mode.load() == MODE_FAST && ops->rows_fast && ops->fast_bits[bits];
}

// pm (the panel copy registered under p.w) holds p's matrix: the same shape and scale dtype, at
// least p.E experts (expert parallelism passes a view of the first ones).
static bool panel_matches(const PanelMatrix& pm, const GatherProblem& p) {
  return pm.E >= p.E && pm.N == p.N && pm.K == p.K && pm.bits == p.bits &&
         pm.gs == p.group_size && pm.sdt == p.sdt;
}

// ---------------------------------------------------------------- gather_qmm, step by step
// 1. group the output rows by expert; then, per chunk of rows, 2. prepare their activations,
// 3. cut the work into tasks (a segment of rows x a range of W rows), 4. run the tasks on the pool.

static constexpr int MRMAX = 8;  // activation rows per row-kernel call

// The valid output rows in expert order: segment s is expert segs[s].first, rows
// order[segs[s].second .. seg_end[s]).
struct ExpertRows {
  std::vector<int64_t> order;
  std::vector<std::pair<int64_t, int64_t>> segs;  // (expert, start in order)
  std::vector<int64_t> seg_end;
};

// Stable counting sort of the rows by expert; rows with an invalid expert are written as zeros
// here and left out. Without p.expert, every row is expert 0.
static ExpertRows group_rows_by_expert(const GatherProblem& p) {
  const int64_t R = p.nrows, N = p.N;
  ExpertRows g;
  if (!p.expert) {
    g.order.resize(R);
    for (int64_t r = 0; r < R; r++) g.order[r] = r;
    g.segs.push_back({0, 0});
    g.seg_end.push_back(R);
    return g;
  }
  std::vector<int64_t> cnt(p.E + 1, 0);
  for (int64_t r = 0; r < R; r++) {
    int64_t e = p.expert[r];
    if (e < 0 || e >= p.E) {
      for (int64_t n = 0; n < N; n++) store_elem(p.out, p.odt, r * N + n, 0.f);
      continue;
    }
    cnt[e + 1]++;
  }
  for (int64_t e = 0; e < p.E; e++) cnt[e + 1] += cnt[e];
  g.order.resize(cnt[p.E]);
  std::vector<int64_t> pos(cnt.begin(), cnt.end() - 1);
  for (int64_t r = 0; r < R; r++) {
    int64_t e = p.expert[r];
    if (e < 0 || e >= p.E) continue;
    g.order[pos[e]++] = r;
  }
  for (int64_t e = 0; e < p.E; e++)
    if (cnt[e + 1] > cnt[e]) {
      g.segs.push_back({e, cnt[e]});
      g.seg_end.push_back(cnt[e + 1]);
    }
  return g;
}

// Activations of one chunk of rows as the row kernels read them: float32 in the ISA layout
// (EXACT) or int8 codes with group scales (FAST), plus group sums (both), one slot per distinct
// activation row. reset() sizes the buffers for a chunk; they only grow, so a thread's decode
// calls reuse them (fresh zeroed vectors were ~1 us of a call).
struct PreparedX {
  void reset(int64_t rows, int64_t K_, int64_t G_, bool fast_) {
    fast = fast_;
    K = K_;
    G = G_;
    grow(x, fast ? 0 : rows * K_);
    grow(xq, fast ? rows * K_ : 0);
    grow(tmpq, fast ? K_ : 0);
    grow(xd, fast ? rows * (G + 64) : 0);
    grow(xsum, rows * G);
    grow(tmp, K_);
    xi_runs.clear();
    if (fast)  // the kernels may load past a row's last group scale: zeros there, as before
      for (int64_t r = 0; r < rows; r++) std::fill_n(xd.data() + r * (G + 64) + G, 64, 0.f);
  }
  // Bytes a reset(rows, K, G, fast) needs: thread-local reuse only below a few MiB.
  static int64_t bytes(int64_t rows, int64_t K, int64_t G, bool fast) {
    return fast ? 2 * rows * K + 8 * rows * G + K + rows * (G + 64) * 4 + rows * G * 4 + K * 4
                : rows * K * 4 + rows * G * 4 + K * 4;
  }
  // PanelArgs::xi for the panel kernels (FAST, natural order: W = 1). A pass over rows of a
  // product (MRMAX rows at a time from r0) whose mr >= 2 slots are consecutive gets its run
  // (first slot, mr) marked; `interleave` then builds the marked runs once their slots are all
  // prepared (the dense products of a batched step: one run of the B rows; routed experts' rows,
  // of scattered slots, mostly none). One row reads one place already. (bench_core, one thread,
  // from DRAM: 2, 4 and 8 rows of 4-bit 2048x8192 13-26% faster, 8 of 6-bit lm_head 5-12%.)
  void mark_xi(const int64_t* slots, int64_t r0, int64_t r1, int64_t off) {
    if (!fast) return;
    for (int64_t r = r0; r < r1; r += MRMAX) {
      const int mr = (int)std::min<int64_t>(MRMAX, r1 - r);
      const int64_t* sl = slots + (r - off);
      if (mr < 2 || !consecutive(sl, mr) || find_run(sl[0], mr)) continue;
      xi_runs.push_back({sl[0], mr, 0});
    }
  }
  void interleave() {
    const int64_t gs = K / G;
    int64_t at = 0;
    for (XiRun& run : xi_runs) {
      run.at = at;
      at += G * panel_xi_record(gs, run.mr);
    }
    grow(xi, at);
    for (XiRun& run : xi_runs) {
      const int R = run.mr;
      const int64_t rec = panel_xi_record(gs, R);
      uint8_t* base = reinterpret_cast<uint8_t*>(xi.data() + run.at);
      for (int m = 0; m < R; m++) {
        const uint8_t* q = reinterpret_cast<const uint8_t*>(xq_of(run.s0 + m));
        const float* d = xd_of(run.s0 + m);
        const float* sm = xsum_of(run.s0 + m);
        for (int64_t g = 0; g < G; g++) {
          uint8_t* dst = base + g * rec;
          for (int64_t t = 0; t < gs / 4; t++)
            std::memcpy(dst + (t * R + m) * 4, q + g * gs + 4 * t, 4);
          std::memcpy(dst + gs * R + 4 * m, d + g, 4);
          std::memcpy(dst + gs * R + 4 * (R + m), sm + g, 4);
        }
      }
    }
  }
  // PanelArgs::xi of a pass of `mr` rows reading slots slots[0..mr) (after `interleave`), or
  // nullptr.
  const int8_t* xi_of(const int64_t* slots, int mr) const {
    const XiRun* run = find_run(slots[0], mr);
    return run && consecutive(slots, mr) ? xi.data() + run->at : nullptr;
  }
  // Slot sl's rows: FAST codes and group scales (G + 64: the kernels may read past the last),
  // EXACT floats, and the group sums both keep.
  int8_t* xq_of(int64_t sl) { return xq.data() + sl * K; }
  float* xd_of(int64_t sl) { return xd.data() + sl * (G + 64); }
  float* x_of(int64_t sl) { return x.data() + sl * K; }
  float* xsum_of(int64_t sl) { return xsum.data() + sl * G; }
  const int8_t* xq_of(int64_t sl) const { return xq.data() + sl * K; }
  const float* xd_of(int64_t sl) const { return xd.data() + sl * (G + 64); }
  const float* x_of(int64_t sl) const { return x.data() + sl * K; }
  const float* xsum_of(int64_t sl) const { return xsum.data() + sl * G; }
  bool fast = false;
  int64_t K = 0, G = 0;
  std::vector<float> x;
  std::vector<int8_t> xq, tmpq, xi;
  struct XiRun {
    int64_t s0;
    int mr;
    int64_t at;  // offset in xi
  };
  std::vector<XiRun> xi_runs;
  std::vector<float> xd, xsum, tmp;
  std::vector<int64_t> slot;  // slot of each row of the chunk

 private:
  template <class V>
  static void grow(V& v, int64_t n) {
    if ((int64_t)v.size() < n) v.resize(n);
  }
  static bool consecutive(const int64_t* slots, int mr) {
    for (int m = 1; m < mr; m++)
      if (slots[m] != slots[0] + m) return false;
    return true;
  }
  const XiRun* find_run(int64_t s0, int mr) const {
    for (const XiRun& run : xi_runs)
      if (run.s0 == s0 && run.mr == mr) return &run;
    return nullptr;
  }
};

// This thread's reusable PreparedX number `i` for a chunk needing `need` bytes, or `local` when
// the chunk is large (prefill: its buffers are freed after the call).
static PreparedX& prepared_buffers(int i, int64_t need, PreparedX& local) {
  thread_local std::vector<std::unique_ptr<PreparedX>> tl;
  if (need > ((int64_t)4 << 20)) return local;
  while ((int64_t)tl.size() <= i) tl.push_back(std::make_unique<PreparedX>());
  return *tl[i];
}

// The activation row at element offset `off` of p.x into slot `sl` of px (FAST or EXACT as px
// was reset, in the layout of W-lane row kernels; W = 1 for the panel kernels).
static void prepare_slot(const GatherProblem& p, int64_t off, int W, PreparedX& px, int64_t sl) {
  const int64_t K = p.K;
  if (px.fast) {
    convert_to_f32(p.x, p.xdt, off, K, px.tmp.data());
    prep_row_fast(px.tmp.data(), K, p.group_size, W, p.bits, px.tmpq.data(), px.xq_of(sl),
                  px.xd_of(sl), px.xsum_of(sl));
  } else {
    prep_row(p.x, p.xdt, off, K, W, p.bits, p.group_size, px.tmp.data(), px.x_of(sl),
             px.xsum_of(sl));
  }
}

// Prepares rows order[c0, c1). Rows reading the same activations (the gate/up projections of a
// token's k experts) share one slot: a row looks for its activation offset among the 16 rows
// before it.
static void prepare_chunk(const GatherProblem& p, const std::vector<int64_t>& order, int64_t c0,
                          int64_t c1, int W, PreparedX& px) {
  px.slot.assign(c1 - c0, 0);
  int64_t nslots = 0;
  for (int64_t i = c0; i < c1; i++) {
    const int64_t off = p.xrow_off[order[i]];
    int64_t sl = -1;
    for (int64_t j = i - 1; j >= c0 && j >= i - 16; j--)
      if (p.xrow_off[order[j]] == off) {
        sl = px.slot[j - c0];
        break;
      }
    if (sl < 0) prepare_slot(p, off, W, px, sl = nslots++);
    px.slot[i - c0] = sl;
  }
}

// Rows [r0, r1) of the chunk (all of expert e) against rows [n0, n1) of W.
struct Task {
  int64_t e, r0, r1, n0, n1;
};

// Weights per task: POCKET_MLX_TASK_KB KiB (default 128), read once.
static int64_t task_kb_bytes() {
  static const int64_t v = [] {
    const char* e = std::getenv("POCKET_MLX_TASK_KB");
    return (int64_t)(e ? std::atoi(e) : 128) * 1024;
  }();
  return v;
}

// Rows of W per task: ~128 KiB of weights (POCKET_MLX_TASK_KB), but at least 4 tasks per
// thread when possible. Each task is one sequential stream; with 32 KiB tasks the two
// threads' streams interleaved so finely that decode-shaped matvecs from DRAM ran ~10-15%
// slower (csrc/tests/bench_core.cpp).
static int64_t rows_per_task(int64_t N, int64_t row_bytes, int64_t nseg, int nth) {
  const int64_t task_bytes = task_kb_bytes();
  int64_t nc = std::max<int64_t>(1, task_bytes / std::max<int64_t>(1, row_bytes));
  const int64_t want = 4 * (int64_t)nth;
  if (nseg * ((N + nc - 1) / nc) < want) {
    int64_t per_seg = (want + nseg - 1) / nseg;
    nc = std::max<int64_t>(1, (N + per_seg - 1) / per_seg);
  }
  if (nc < N && nc >= 4) nc = (nc + 3) / 4 * 4;
  return nc;
}

// The tasks of chunk order[c0, c1); `wbytes` gets the bytes of weights they read.
static std::vector<Task> chunk_tasks(const ExpertRows& g, int64_t c0, int64_t c1, int64_t N,
                                     int64_t row_bytes, int nth, int64_t& wbytes) {
  int64_t nseg = 0;
  for (size_t s = 0; s < g.segs.size(); s++)
    if (g.segs[s].second < c1 && g.seg_end[s] > c0) nseg++;
  const int64_t nc = rows_per_task(N, row_bytes, nseg, nth);
  std::vector<Task> tasks;
  wbytes = 0;
  for (size_t s = 0; s < g.segs.size(); s++) {
    int64_t r0 = std::max(g.segs[s].second, c0), r1 = std::min(g.seg_end[s], c1);
    if (r0 >= r1) continue;
    wbytes += N * row_bytes;
    for (int64_t n0 = 0; n0 < N; n0 += nc)
      tasks.push_back({g.segs[s].first, r0, r1, n0, std::min(N, n0 + nc)});
  }
  return tasks;
}

// One task on the calling thread: the ISA's row kernel over MRMAX activation rows at a time.
static void run_task(const Task& t, const GatherProblem& p, const std::vector<int64_t>& order,
                     int64_t c0, const PreparedX& px, const IsaOps* ops) {
  const int64_t N = p.N, K = p.K, G = px.G;
  const int64_t row_bytes = K * p.bits / 8;
  const size_t ssz = p.sdt == F32 ? 4 : 2;
  const size_t osz = p.odt == F32 ? 4 : 2;
  const uint8_t* wbase = reinterpret_cast<const uint8_t*>(p.w);
  thread_local std::vector<float> scratch;
  const int64_t need = std::max<int64_t>(2 * (G + 64), fast_scratch_floats(G, MRMAX));
  if ((int64_t)scratch.size() < need) scratch.resize(need);
  RowsArgs a{};
  a.odt = p.odt;
  a.w = wbase + t.e * N * row_bytes;
  a.w_end = wbase + p.E * N * row_bytes;
  a.scales = static_cast<const uint8_t*>(p.scales) + (size_t)(t.e * N * G) * ssz;
  a.biases = static_cast<const uint8_t*>(p.biases) + (size_t)(t.e * N * G) * ssz;
  a.sdt = p.sdt;
  a.n0 = t.n0;
  a.n1 = t.n1;
  a.K = K;
  a.bits = p.bits;
  a.gs = p.group_size;
  a.scratch = scratch.data();
  const float* xps[MRMAX];
  const int8_t* xqs[MRMAX];
  const float* xds[MRMAX];
  const float* xss[MRMAX];
  void* outs[MRMAX];
  for (int64_t r = t.r0; r < t.r1; r += MRMAX) {
    int mr = (int)std::min<int64_t>(MRMAX, t.r1 - r);
    for (int m = 0; m < mr; m++) {
      const int64_t li = px.slot[r + m - c0];
      xss[m] = px.xsum_of(li);
      if (px.fast) {
        xqs[m] = px.xq_of(li);
        xds[m] = px.xd_of(li);
      } else {
        xps[m] = px.x_of(li);
      }
      outs[m] = static_cast<uint8_t*>(p.out) + (size_t)order[r + m] * N * osz;
    }
    a.xp = xps;
    a.xq = xqs;
    a.xd = xds;
    a.xsum = xss;
    a.out = outs;
    a.mr = mr;
    if (px.fast)
      ops->rows_fast(a);
    else
      ops->rows_exact(a);
  }
}

// Rows [r0, r1) of expert e's panels [p0, p1) through the panel kernel `fn`, MRMAX activation
// rows a pass: row r reads prepared slot slot[r - slot_off] of px and writes output row order[r].
static void run_panel_rows(const PanelMatrix& pm, int64_t e, int64_t p0, int64_t p1, int64_t r0,
                           int64_t r1, const int64_t* slot, int64_t slot_off,
                           const std::vector<int64_t>& order, const PreparedX& px, PanelFn fn,
                           void* out, DType odt, int64_t N) {
  const size_t osz = odt == F32 ? 4 : 2;
  const int8_t* xqs[MRMAX];
  const float *xds[MRMAX], *xfs[MRMAX], *xss[MRMAX];
  void* outs[MRMAX];
  PanelArgs a{&pm, e, p0, p1, 0, xqs, xds, xfs, xss, outs, odt, panel_prefetch()};
  for (int64_t r = r0; r < r1; r += MRMAX) {
    a.mr = (int)std::min<int64_t>(MRMAX, r1 - r);
    for (int m = 0; m < a.mr; m++) {
      const int64_t li = slot[r + m - slot_off];
      xss[m] = px.xsum_of(li);
      if (px.fast) {
        xqs[m] = px.xq_of(li);
        xds[m] = px.xd_of(li);
      } else {
        xfs[m] = px.x_of(li);
      }
      outs[m] = static_cast<uint8_t*>(out) + (size_t)order[r + m] * N * osz;
    }
    a.xi = px.fast ? px.xi_of(slot + (r - slot_off), a.mr) : nullptr;
    fn(a);
  }
}

// A matrix packed in the panel layout (qk_panel.h): every row goes through the row-panel kernels,
// MRMAX activation rows per pass over a task's panels (FAST: the same arithmetic for any number
// of rows, so batched, speculative-verify and single decode give identical bits). Activations
// are prepared in natural order (W = 1).
static void gather_panels(const GatherProblem& p, const PanelMatrix& pm, const ExpertRows& g,
                          bool fast) {
  const PanelKernels& pk = panel_kernels();
  fast = fast && pk.fast && pk.fast_bits[p.bits];
  const PanelFn fn = fast ? pk.fast : pk.exact;
  const int64_t total = (int64_t)g.order.size();
  if (total == 0) return;
  const int64_t K = p.K, G = K / p.group_size;
  const int nth = get_threads();
  const int64_t chunk_rows = std::max<int64_t>(MRMAX, ((int64_t)8 << 20) / K / MRMAX * MRMAX);
  const int64_t prows = std::min(total, chunk_rows);
  PreparedX local;
  PreparedX& px = prepared_buffers(0, PreparedX::bytes(prows, K, G, fast), local);
  px.reset(prows, K, G, fast);
  const int64_t pan_bytes = G * pm.rec_bytes;
  const int64_t task_bytes = task_kb_bytes();
  struct PTask {
    int64_t e, r0, r1, p0, p1;
  };
  for (int64_t c0 = 0; c0 < total; c0 += chunk_rows) {
    const int64_t c1 = std::min(total, c0 + chunk_rows);
    prepare_chunk(p, g.order, c0, c1, 1, px);
    px.xi_runs.clear();
    for (size_t s = 0; s < g.segs.size(); s++)
      px.mark_xi(px.slot.data(), std::max(g.segs[s].second, c0), std::min(g.seg_end[s], c1), c0);
    px.interleave();
    int64_t nseg = 0;
    for (size_t s = 0; s < g.segs.size(); s++)
      if (g.segs[s].second < c1 && g.seg_end[s] > c0) nseg++;
    int64_t np = std::max<int64_t>(1, task_bytes / pan_bytes);
    if (nseg * ((pm.npan + np - 1) / np) < 4 * nth)
      np = std::max<int64_t>(1, pm.npan * nseg / (4 * nth));
    std::vector<PTask> tasks;
    int64_t wbytes = 0;
    for (size_t s = 0; s < g.segs.size(); s++) {
      const int64_t r0 = std::max(g.segs[s].second, c0), r1 = std::min(g.seg_end[s], c1);
      if (r0 >= r1) continue;
      wbytes += pm.npan * pan_bytes;
      for (int64_t q0 = 0; q0 < pm.npan; q0 += np)
        tasks.push_back({g.segs[s].first, r0, r1, q0, std::min(pm.npan, q0 + np)});
    }
    parallel_for((int64_t)tasks.size(), wbytes < g_single_bytes.load(), [&](int64_t ti) {
      const PTask& t = tasks[ti];
      run_panel_rows(pm, t.e, t.p0, t.p1, t.r0, t.r1, px.slot.data(), c0, g.order, px, fn, p.out,
                     p.odt, p.N);
    });
  }
}

// Several products in one pool job (decode's MoE block: the router and the shared expert of
// one input; the routed experts' gate and up, and the shared down projection). Every matrix must
// be in the panel layout and the rows few (one chunk); otherwise the products run one by one.
// Rows of any product that read the same activations (x, offset, K, group size, FAST or EXACT)
// share one prepared slot: one token's activations are quantized once for all its consumers.
// Each output row is the kernel's sum over its whole row of W, as in gather_qmm: the bits do
// not depend on which products share the job.
void gather_qmm_many(const GatherProblem* ps, int n) {
  struct Prod {
    const GatherProblem* p;
    const PanelMatrix* pm;
    ExpertRows g;
    bool fast;
    int prep;                  // index into preps
    std::vector<int64_t> slot;  // slot of each row of g.order
  };
  struct Prep {
    const void* x;
    DType xdt;
    int64_t K;
    int gs;
    bool fast;
    int64_t rows = 0;
    std::vector<int64_t> offs;  // the activation offset of each slot
  };
  const IsaOps* ops = current_isa();
  const PanelKernels& pk = panel_kernels();
  const int64_t max_rows = 64;
  std::vector<Prod> prods;
  std::vector<Prep> preps;
  bool ok = true;
  for (int i = 0; i < n && ok; i++) {
    const GatherProblem& p = ps[i];
    if (p.nrows <= 0 || p.N <= 0) continue;
    const PanelMatrix* pm = panel_find(p.w);
    ok = pm && panel_matches(*pm, p) && pm->scales_src == p.scales &&
         pm->biases_src == p.biases && p.nrows <= max_rows;
    if (!ok) break;
    const bool fast_isa = fast_rows(ops, p.bits);
    Prod d{&p, pm, group_rows_by_expert(p), fast_isa && pk.fast && pk.fast_bits[p.bits], -1, {}};
    for (size_t j = 0; j < preps.size() && d.prep < 0; j++) {
      const Prep& q = preps[j];
      if (q.x == p.x && q.xdt == p.xdt && q.K == p.K && q.gs == p.group_size && q.fast == d.fast)
        d.prep = (int)j;
    }
    if (d.prep < 0) {
      d.prep = (int)preps.size();
      preps.push_back({p.x, p.xdt, p.K, p.group_size, d.fast});
    }
    preps[d.prep].rows += (int64_t)d.g.order.size();
    prods.push_back(std::move(d));
  }
  if (!ok || preps.size() > 8) {
    for (int i = 0; i < n; i++) gather_qmm(ps[i]);
    return;
  }
  // Prepare each distinct activation row once.
  std::vector<PreparedX*> pxs(preps.size());
  std::vector<PreparedX> locals(preps.size());
  for (size_t j = 0; j < preps.size(); j++) {
    const Prep& q = preps[j];
    const int64_t G = q.K / q.gs;
    pxs[j] = &prepared_buffers((int)j + 1, PreparedX::bytes(q.rows, q.K, G, q.fast), locals[j]);
    pxs[j]->reset(q.rows, q.K, G, q.fast);
  }
  for (Prod& d : prods) {
    Prep& q = preps[d.prep];
    PreparedX& px = *pxs[d.prep];
    const GatherProblem& p = *d.p;
    d.slot.resize(d.g.order.size());
    for (size_t i = 0; i < d.g.order.size(); i++) {
      const int64_t off = p.xrow_off[d.g.order[i]];
      int64_t sl = -1;
      for (int64_t j = (int64_t)q.offs.size() - 1; j >= 0 && sl < 0; j--)
        if (q.offs[j] == off) sl = j;
      if (sl < 0) {
        sl = (int64_t)q.offs.size();
        q.offs.push_back(off);
        prepare_slot(p, off, 1, px, sl);
      }
      d.slot[i] = sl;
    }
  }
  for (const Prod& d : prods)
    for (size_t s = 0; s < d.g.segs.size(); s++)
      pxs[d.prep]->mark_xi(d.slot.data(), d.g.segs[s].second, d.g.seg_end[s], 0);
  for (PreparedX* px : pxs) px->interleave();
  // Tasks: whole panels of ~task_bytes, at least 4 a thread over all the products together.
  const int64_t task_bytes = task_kb_bytes();
  const int nth = get_threads();
  int64_t wbytes = 0;
  for (const Prod& d : prods)
    wbytes += (int64_t)d.g.segs.size() * d.pm->npan * (d.p->K / d.p->group_size) * d.pm->rec_bytes;
  const int64_t tb = std::max<int64_t>(1, std::min(task_bytes, wbytes / (4 * nth)));
  struct PTask {
    int d;
    int64_t e, r0, r1, p0, p1;
  };
  std::vector<PTask> tasks;
  for (size_t di = 0; di < prods.size(); di++) {
    const Prod& d = prods[di];
    const int64_t pan_bytes = (d.p->K / d.p->group_size) * d.pm->rec_bytes;
    const int64_t np = std::max<int64_t>(1, tb / pan_bytes);
    for (size_t s = 0; s < d.g.segs.size(); s++)
      for (int64_t q0 = 0; q0 < d.pm->npan; q0 += np)
        tasks.push_back({(int)di, d.g.segs[s].first, d.g.segs[s].second, d.g.seg_end[s], q0,
                         std::min(d.pm->npan, q0 + np)});
  }
  parallel_for((int64_t)tasks.size(), wbytes < g_single_bytes.load(), [&](int64_t ti) {
    const PTask& t = tasks[ti];
    const Prod& d = prods[t.d];
    run_panel_rows(*d.pm, t.e, t.p0, t.p1, t.r0, t.r1, d.slot.data(), 0, d.g.order, *pxs[d.prep],
                   d.fast ? pk.fast : pk.exact, d.p->out, d.p->odt, d.p->N);
  });
}

void gather_qmm(const GatherProblem& p) {
  if (p.nrows <= 0 || p.N <= 0) return;
  const IsaOps* ops = current_isa();
  ExpertRows g = group_rows_by_expert(p);
  const bool fast = fast_rows(ops, p.bits);
  if (const PanelMatrix* pm = panel_find(p.w)) {
    // p.E < pm->E: a view of the first experts (expert parallelism leaves out its zero expert)
    if (panel_matches(*pm, p)) {
      if (pm->scales_src != p.scales || pm->biases_src != p.biases)
        throw std::runtime_error(
            "pocket_mlx: scales or biases of weights packed in the panel layout were replaced "
            "after packing (unpack the model first: engine.panels.unpack_model)");
      return gather_panels(p, *pm, g, fast);
    }
    throw std::runtime_error("pocket_mlx: weights packed in the panel layout read with another shape");
  }
  if (panel_covers(p.w))  // a view into packed weights: their MLX bytes may be gone
    throw std::runtime_error("pocket_mlx: a view into weights packed in the panel layout");
  // FAST mode: experts (or a plain matrix) with many activation rows go through the GEMM
  // kernels (qk_gemm.cpp: each weight panel unpacked once for all of them); the rest below.
  if (const GemmKernels* gk = fast ? gemm_kernels(p.bits) : nullptr) {
    const int64_t min_rows = gemm_min_rows();
    std::vector<GemmSeg> big;
    ExpertRows small;
    for (size_t s = 0; s < g.segs.size(); s++) {
      const int64_t a = g.segs[s].second, b = g.seg_end[s];
      if (min_rows > 0 && b - a >= min_rows) {
        big.push_back({g.segs[s].first, g.order.data() + a, b - a});
      } else {
        small.segs.push_back({g.segs[s].first, (int64_t)small.order.size()});
        small.order.insert(small.order.end(), g.order.begin() + a, g.order.begin() + b);
        small.seg_end.push_back((int64_t)small.order.size());
      }
    }
    if (!big.empty()) {
      gemm_segments(p, *gk, big);
      g = std::move(small);
    }
  }
  const int64_t total = (int64_t)g.order.size();
  if (total == 0) return;

  const int64_t K = p.K, G = K / p.group_size;
  const int64_t row_bytes = K * p.bits / 8;
  const int nth = get_threads();
  // Activation rows prepared per pass (bounds the float32 buffer to ~32 MB).
  const int64_t chunk_rows = std::max<int64_t>(MRMAX, ((int64_t)8 << 20) / K / MRMAX * MRMAX);
  const int64_t prows = std::min(total, chunk_rows);
  PreparedX local;
  PreparedX& px = prepared_buffers(0, PreparedX::bytes(prows, K, G, fast), local);
  px.reset(prows, K, G, fast);

  for (int64_t c0 = 0; c0 < total; c0 += chunk_rows) {
    const int64_t c1 = std::min(total, c0 + chunk_rows);
    prepare_chunk(p, g.order, c0, c1, ops->W, px);
    int64_t wbytes = 0;
    const std::vector<Task> tasks = chunk_tasks(g, c0, c1, p.N, row_bytes, nth, wbytes);
    parallel_for((int64_t)tasks.size(), wbytes < g_single_bytes.load(),
                 [&](int64_t ti) { run_task(tasks[ti], p, g.order, c0, px, ops); });
  }
}

void qmm(const void* x, DType xdt, int64_t M, const uint32_t* w, const void* scales,
         const void* biases, DType sdt, int64_t N, int64_t K, int bits, int group_size, void* out,
         DType odt) {
  std::vector<int64_t> off(M);
  for (int64_t m = 0; m < M; m++) off[m] = m * K;
  GatherProblem p;
  p.x = x;
  p.xdt = xdt;
  p.nrows = M;
  p.xrow_off = off.data();
  p.w = w;
  p.scales = scales;
  p.biases = biases;
  p.sdt = sdt;
  p.E = 1;
  p.N = N;
  p.K = K;
  p.bits = bits;
  p.group_size = group_size;
  p.out = out;
  p.odt = odt;
  gather_qmm(p);
}

}  // namespace pqk
