// Driver of the FAST quantized GEMM (qk_gemm.inc): prepares the activation rows once, cuts the
// work into (expert, block of output rows) tasks for the thread pool; each task packs its weight
// panels once and runs every activation row of its expert against them.
#include "qk_gemm.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "qk_internal.h"

namespace pqk {
namespace detail {

#if defined(__x86_64__) || defined(_M_X64)
extern const GemmKernels gemm_avx512vnni_kernels, gemm_avx512_kernels, gemm_avx2_kernels;
#endif

const GemmKernels* gemm_kernels(int bits) {
  if (bits < 0 || bits > 8) return nullptr;
  const GemmKernels* k = nullptr;
#if defined(__x86_64__) || defined(_M_X64)
  const std::string v = isa_variant();
  if (v == "avx512-vnni" || v == "avx512-vbmi")
    k = &gemm_avx512vnni_kernels;
  else if (v == "avx512")
    k = &gemm_avx512_kernels;
  else if (v == "avx2")
    k = &gemm_avx2_kernels;
#endif
  return k && k->bits[bits] ? k : nullptr;
}

// 16, not 4 (where the GEMM starts to pay): the GEMM sums in another order than the row kernels,
// so a row's result depends on whether its matrix (or expert) had this many rows. Batched decode
// (the server, M = active sequences <= --max-concurrency) must give each sequence the bits it gets
// alone, and prefill uses the GEMM for the experts that matter (~32 rows each at 512 tokens).
static std::atomic<int64_t> g_min_rows{[] {
  const char* e = std::getenv("POCKET_MLX_GEMM_MIN_ROWS");
  return (int64_t)(e ? std::atoi(e) : 16);
}()};

int64_t gemm_min_rows() { return g_min_rows.load(std::memory_order_relaxed); }

void set_gemm_min_rows(int64_t n) { g_min_rows.store(n); }

namespace {

struct GemmTask {
  size_t seg;
  int64_t n0, n1;
};

// Activation rows per pass over a task's panels (their int8 codes stay in L2).
constexpr int64_t kTokenBlock = 64;

}  // namespace

void gemm_segments(const GatherProblem& p, const GemmKernels& k, const std::vector<GemmSeg>& segs) {
  const int64_t K = p.K, N = p.N, gs = p.group_size, G = K / gs;
  const int W = k.W;
  // POCKET_MLX_GEMM_TRACE=1: one line per call on stderr (preparation and run times; dev aid).
  static const bool trace = std::getenv("POCKET_MLX_GEMM_TRACE") != nullptr;
  const auto t0 = std::chrono::steady_clock::now();
  // 1. One prepared activation per distinct x offset (the k experts of a token share one).
  std::vector<std::pair<int64_t, int64_t>> offs;  // (x offset, row)
  for (const GemmSeg& s : segs)
    for (int64_t i = 0; i < s.n; i++) offs.push_back({p.xrow_off[s.rows[i]], s.rows[i]});
  std::sort(offs.begin(), offs.end());
  std::vector<int64_t> uoff;
  std::vector<int64_t> slot_of_row(p.nrows, -1);
  for (const auto& o : offs) {
    if (uoff.empty() || uoff.back() != o.first) uoff.push_back(o.first);
    slot_of_row[o.second] = (int64_t)uoff.size() - 1;
  }
  const int64_t ns = (int64_t)uoff.size();
  std::vector<int8_t> xq((size_t)ns * K);
  std::vector<float> xd((size_t)ns * G), xs((size_t)ns * G);
  const int64_t prep_block = 16;
  parallel_for((ns + prep_block - 1) / prep_block, ns * K < (1 << 16), [&](int64_t b) {
    thread_local std::vector<float> tmp;
    if ((int64_t)tmp.size() < K) tmp.resize(K);
    for (int64_t s = b * prep_block; s < std::min(ns, (b + 1) * prep_block); s++) {
      convert_to_f32(p.x, p.xdt, uoff[s], K, tmp.data());
      k.prep_row(tmp.data(), K, (int)gs, p.bits, xq.data() + s * K, xd.data() + s * G,
                 xs.data() + s * G);
    }
  });

  const auto t1 = std::chrono::steady_clock::now();
  // 2. Tasks: blocks of output rows (whole panels of W rows) whose packed weights are ~64 KiB,
  // smaller when that leaves fewer than 4 tasks per thread.
  const int64_t row_bytes = K * p.bits / 8;
  const int nth = get_threads();
  int64_t nc = std::max<int64_t>(W, (64 * 1024 / std::max<int64_t>(1, row_bytes)) / W * W);
  nc = std::min(nc, (N + W - 1) / W * W);
  while (nc > W && (int64_t)segs.size() * ((N + nc - 1) / nc) < 4 * nth) nc -= W;
  std::vector<GemmTask> tasks;
  for (size_t s = 0; s < segs.size(); s++)
    for (int64_t n0 = 0; n0 < N; n0 += nc) tasks.push_back({s, n0, std::min(N, n0 + nc)});

  const int64_t nq = p.bits == 6 ? K / 4 : K * p.bits / 32;
  const size_t ssz = p.sdt == F32 ? 4 : 2;
  const uint8_t* wbase = reinterpret_cast<const uint8_t*>(p.w);
  const uint8_t* w_end = wbase + p.E * N * row_bytes;
  const size_t osz = p.odt == F32 ? 4 : 2;

  // 3. Each task: pack its panels, then every activation row of its expert, kTokenBlock rows
  // at a time, against all of them.
  parallel_for((int64_t)tasks.size(), tasks.size() == 1, [&](int64_t ti) {
    const GemmTask& t = tasks[ti];
    const GemmSeg& sg = segs[t.seg];
    const int64_t npan = (t.n1 - t.n0 + W - 1) / W;
    thread_local std::vector<uint32_t> P;
    thread_local std::vector<float> sb;
    if ((int64_t)P.size() < npan * nq * W) P.resize(npan * nq * W);
    if ((int64_t)sb.size() < 2 * npan * G * W) sb.resize(2 * npan * G * W);
    const uint8_t* we = wbase + sg.e * N * row_bytes;
    const void* se = static_cast<const uint8_t*>(p.scales) + (size_t)(sg.e * N * G) * ssz;
    const void* be = static_cast<const uint8_t*>(p.biases) + (size_t)(sg.e * N * G) * ssz;
    for (int64_t pi = 0; pi < npan; pi++)
      k.pack(we, w_end, se, be, p.sdt, N, K, p.bits, (int)gs, t.n0 + pi * W,
             P.data() + pi * nq * W, sb.data() + pi * G * W, sb.data() + (npan + pi) * G * W);
    alignas(64) float obuf[8][64];
    float* outs[8];
    const int8_t* xqs[8];
    const float* xds[8];
    const float* xss[8];
    for (int m = 0; m < 8; m++) outs[m] = obuf[m];
    for (int64_t r0 = 0; r0 < sg.n; r0 += kTokenBlock) {
      const int64_t r1 = std::min(sg.n, r0 + kTokenBlock);
      for (int64_t pi = 0; pi < npan; pi++) {
        const int64_t n0 = t.n0 + pi * W;
        const int nv = (int)std::min<int64_t>(W, t.n1 - n0);
        for (int64_t r = r0; r < r1; r += k.MR) {
          const int mr = (int)std::min<int64_t>(k.MR, r1 - r);
          for (int m = 0; m < mr; m++) {
            const int64_t sl = slot_of_row[sg.rows[r + m]];
            xqs[m] = xq.data() + sl * K;
            xds[m] = xd.data() + sl * G;
            xss[m] = xs.data() + sl * G;
          }
          k.panel(p.bits, mr, P.data() + pi * nq * W, sb.data() + pi * G * W,
                  sb.data() + (npan + pi) * G * W, G, (int)gs, xqs, xds, xss, outs);
          for (int m = 0; m < mr; m++) {
            uint8_t* orow = static_cast<uint8_t*>(p.out) + (size_t)sg.rows[r + m] * N * osz;
            if (p.odt == F32)
              std::memcpy(reinterpret_cast<float*>(orow) + n0, obuf[m], nv * sizeof(float));
            else
              for (int j = 0; j < nv; j++) store_elem(orow, p.odt, n0 + j, obuf[m][j]);
          }
        }
      }
    }
  });
  if (trace) {
    const auto t2 = std::chrono::steady_clock::now();
    std::fprintf(stderr, "gemm: %zu segs %lld slots N=%lld K=%lld bits=%d: prep %.3f ms, run %.3f ms\n",
                 segs.size(), (long long)ns, (long long)N, (long long)K, p.bits,
                 std::chrono::duration<double, std::milli>(t1 - t0).count(),
                 std::chrono::duration<double, std::milli>(t2 - t1).count());
  }
}

}  // namespace detail
}  // namespace pqk
