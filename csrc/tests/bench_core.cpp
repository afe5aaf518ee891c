// Decode-shape throughput of the core's quantized matvecs, weights streamed from DRAM (several
// copies rotated so nothing stays in cache), the way one decode step reads them. Dev tool:
//   cmake -S csrc -B build/core -DQK_BUILD_EXTENSION=OFF -DQK_BUILD_TESTS=ON
//   cmake --build build/core --target bench_core && build/core/bench_core [threads]
// HOT=1 keeps one copy (in cache: the kernels' compute speed); ONLY=<substring> picks shapes;
// PANEL=1 runs each shape in the MLX layout, then packed in the panel layout (qk_panel.h);
// ROWS=B gives each shape B activation rows of their own (B sequences decoded together, or a
// B-row verify pass; experts: B tokens, each through its own expert). PEAK=1 prints one core's
// `vpdpbusd` (zmm) rate and its clock instead: the ceiling of the FAST kernels on AVX-512 VNNI.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "qkernels.h"

#if defined(__x86_64__)
#include <immintrin.h>

static bool have_vnni() { return __builtin_cpu_supports("avx512vnni"); }

// One core: 16 independent `vpdpbusd` zmm accumulators (its throughput, not latency), then a
// chain of dependent adds (one a cycle: the clock). Only called after have_vnni(): the check
// sits outside this function, whose own code may use AVX-512 anywhere.
__attribute__((target("avx512f,avx512bw,avx512vnni"))) static void vnni_peak() {
  using clk = std::chrono::steady_clock;
  __m512i a[16];
  for (int i = 0; i < 16; i++) a[i] = _mm512_set1_epi32(i);
  __m512i q = _mm512_set1_epi32(0x01020304), x = _mm512_set1_epi32(0x05060708);
  const long n = 100000000;
  auto t0 = clk::now();
  for (long k = 0; k < n; k++) {
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++) a[i] = _mm512_dpbusd_epi32(a[i], q, x);
    __asm__ volatile("" : "+v"(q));  // keeps the loop from being folded
  }
  const double dt = std::chrono::duration<double>(clk::now() - t0).count();
  __m512i s = a[0];
  for (int i = 1; i < 16; i++) s = _mm512_add_epi32(s, a[i]);
  uint64_t v = (uint64_t)_mm512_reduce_add_epi32(s);
  const long m = 1000000000;
  t0 = clk::now();
  for (long k = 0; k < m; k++) __asm__ volatile("add $1, %0" : "+r"(v));
  const double dc = std::chrono::duration<double>(clk::now() - t0).count();
  std::printf("vpdpbusd zmm, one core: %.2f G/s (%.0f G int8 multiply-adds/s); dependent adds: "
              "%.2f GHz (checksum %llu)\n",
              16.0 * n / dt / 1e9, 64 * 16.0 * n / dt / 1e9, m / dc / 1e9, (unsigned long long)v);
}
#else
static bool have_vnni() { return false; }
static void vnni_peak() {}
#endif

struct Shape {
  const char* name;
  int bits, gs;
  int64_t E, N, K, rows;  // rows: tokens (gathered: one expert each, distinct experts)
  bool shared_x;          // gathered rows read the same activation (gate/up) or their own (down)
};

int main(int argc, char** argv) {
  if (std::getenv("PEAK")) {
    if (have_vnni()) {
      vnni_peak();
      return 0;
    }
    std::fprintf(stderr, "PEAK=1: this CPU has no AVX-512 VNNI\n");
    return 1;
  }
  int threads = argc > 1 ? std::atoi(argv[1]) : 0;
  pqk::set_threads(threads);
  pqk::set_mode(pqk::MODE_FAST);
  const Shape shapes[] = {
      {"4b 2048->8192 (in_proj_qkv)", 4, 64, 1, 8192, 2048, 1, true},
      {"4b 4096->2048 (out_proj)", 4, 64, 1, 2048, 4096, 1, true},
      {"4b 2048->32 (in_proj_b)", 4, 64, 1, 32, 2048, 1, true},
      {"2b gate 8x(2048->512)", 2, 64, 128, 512, 2048, 8, true},
      {"2b down 8x(512->2048)", 2, 64, 128, 2048, 512, 8, false},
      {"4b 2048->512 (shared gate)", 4, 64, 1, 512, 2048, 1, true},
      {"8b 2048->128 (router)", 8, 64, 1, 128, 2048, 1, true},
      {"6b 2048->248320 (lm_head)", 6, 64, 1, 248320, 2048, 1, true},
      {"6b 2048->16384 (lm_head slice: fits HOT)", 6, 64, 1, 16384, 2048, 1, true},
      {"6b 2048->2048 (lm_head slice in L2/L3)", 6, 64, 1, 2048, 2048, 1, true},
      {"4b 2048->2048 x64 rows (prefill)", 4, 64, 1, 2048, 2048, 64, false},
      {"2b 4x(2048->512) x32 rows (prefill)", 2, 64, 4, 512, 2048, 128, true},
  };
  if (!std::getenv("HOT")) {  // plain streaming read with the same pool, for reference
    const int64_t n = (int64_t)1 << 27;  // 1 GiB of uint64
    std::vector<uint64_t> buf(n, 1);
    for (int rep = 0; rep < 3; rep++) {
      const int64_t tasks = 256, per = n / tasks;
      std::vector<uint64_t> part(tasks);
      auto t0 = std::chrono::steady_clock::now();
      pqk::parallel_for(tasks, false, [&](int64_t t) {
        typedef uint64_t v8u __attribute__((vector_size(64)));
        v8u acc = {};
        const uint64_t* p = buf.data() + t * per;
        for (int64_t i = 0; i < per; i += 8) {
          v8u v;
          std::memcpy(&v, p + i, 64);
          acc ^= v;
        }
        part[t] = acc[0] ^ acc[7];
      });
      double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::printf("%-30s %8.1f ms       %6.1f GB/s\n", "read 1 GiB", dt * 1e3, n * 8 / dt / 1e9);
    }
  }
  std::mt19937 rng(1);
  for (Shape s : shapes) {
    if (const char* only = std::getenv("ONLY"))
      if (!std::strstr(s.name, only)) continue;
    if (const char* rows = std::getenv("ROWS")) {
      s.rows = std::max(1, std::atoi(rows));
      s.shared_x = false;
    }
    const int64_t row_bytes = s.K * s.bits / 8;
    const int64_t wbytes = s.E * s.N * row_bytes;
    const int64_t G = s.K / s.gs;
    // Copies so that one pass over all of them is > 1 GiB (out of any cache).
    int copies = (int)std::max<int64_t>(2, ((int64_t)1 << 30) / std::max<int64_t>(1, wbytes));
    if (s.E > 1) copies = std::max(2, (int)(((int64_t)1 << 30) / (wbytes)));
    if (std::getenv("HOT")) copies = 1;  // weights stay in cache: the kernel's compute speed
    if (copies == 1 && s.N * row_bytes > (64 << 20)) continue;
    std::vector<std::vector<uint8_t>> w(copies, std::vector<uint8_t>(wbytes + 64));
    std::vector<std::vector<uint16_t>> sc(copies, std::vector<uint16_t>(s.E * s.N * G)),
        bi(copies, std::vector<uint16_t>(s.E * s.N * G));
    for (int c = 0; c < copies; c++) {
      for (auto& b : w[c]) b = (uint8_t)rng();
      for (auto& v : sc[c]) v = 0x3c00 + (rng() & 0xff);  // bf16 ~ 0.0078..
      for (auto& v : bi[c]) v = 0xbc00 + (rng() & 0xff);
    }
    std::vector<float> x(s.rows * s.K);
    for (auto& v : x) v = (float)((int)(rng() % 2001) - 1000) / 1000.f;
    std::vector<float> out(s.rows * s.N);
    std::vector<int64_t> off(s.rows);
    std::vector<int32_t> ex(s.rows);
    for (int64_t r = 0; r < s.rows; r++) {
      off[r] = s.shared_x ? 0 : r * s.K;
      ex[r] = (int32_t)((r * 37 + 5) % s.E);
    }
    // Bytes actually read per call: the experts used.
    const int64_t used = (s.E > 1 ? s.rows : 1) * s.N * (row_bytes + 4 * G);
    const bool panel = std::getenv("PANEL") != nullptr;
    for (int layout = 0; layout < (panel ? 2 : 1); layout++) {
    if (layout == 1) {  // pack every copy, then drop the MLX copy (one copy in memory)
      for (int c = 0; c < copies; c++) {
        pqk::QMatrix q;
        q.w = reinterpret_cast<const uint32_t*>(w[c].data());
        q.scales = sc[c].data();
        q.biases = bi[c].data();
        q.sdt = pqk::BF16;
        q.E = s.E;
        q.N = s.N;
        q.K = s.K;
        q.bits = s.bits;
        q.group_size = s.gs;
        pqk::panel_pack(q);
        pqk::release_pages(w[c].data(), wbytes);
      }
    }
    double best = 1e9, total = 0;
    int calls = 0;
    const int inner = copies == 1 ? 200 : 1;
    for (int rep = 0; rep < 3; rep++) {
      auto t0 = std::chrono::steady_clock::now();
      for (int c = 0; c < copies * inner; c++) {
        pqk::GatherProblem p;
        p.x = x.data();
        p.xdt = pqk::F32;
        p.nrows = s.rows;
        p.xrow_off = off.data();
        p.expert = s.E > 1 ? ex.data() : nullptr;
        p.w = reinterpret_cast<const uint32_t*>(w[c % copies].data());
        p.scales = sc[c % copies].data();
        p.biases = bi[c % copies].data();
        p.sdt = pqk::BF16;
        p.E = s.E;
        p.N = s.N;
        p.K = s.K;
        p.bits = s.bits;
        p.group_size = s.gs;
        p.out = out.data();
        p.odt = pqk::F32;
        pqk::gather_qmm(p);
      }
      double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      best = std::min(best, dt / (copies * inner));
      total += dt;
      calls += copies;
    }
    std::printf("%-30s %8.1f us/call  %6.1f GB/s  (%d copies)%s\n", s.name, best * 1e6,
                used / best / 1e9, copies, layout ? " panel" : "");
    }
    for (int c = 0; c < copies; c++) pqk::panel_release(w[c].data());
  }
  return 0;
}
