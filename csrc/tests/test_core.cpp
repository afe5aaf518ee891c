// Parity test for the plain C++ core against a scalar reference written here (independent of the
// library's own code paths). Runs every bits x group size x dtype x layout for every instruction
// set this CPU supports, with 1 and several threads. Exit status 0 = all passed.
//   test_core [--quick] [--only=ISA,ISA...] [--expect=VARIANT] [seed]
// --only: the instruction sets to force (default: avx512, avx2, and on arm64 neon (the best NEON
// variant), neon-dotprod, neon-base, then scalar); --expect: the variant "neon"/"auto" must pick
// on this CPU (e.g. neon-i8mm under `qemu-aarch64 -cpu max`, neon under `-cpu cortex-a53`).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "attention.h"
#include "qkernels.h"

using namespace pqk;

static float bf16f(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static uint16_t to_bf16(float f) {  // truncation is fine for generating inputs
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return (uint16_t)(u >> 16);
}
static float halff(uint16_t h) {  // finite halves, subnormals included
  int e = (h >> 10) & 31, m = h & 0x3ff;
  float v = e == 0 ? std::ldexp((float)m, -24) : std::ldexp((float)(m | 0x400), e - 25);
  return (h & 0x8000) ? -v : v;
}
static uint16_t to_half(float f) {  // truncating, normal range only
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t s = (u >> 16) & 0x8000;
  int e = (int)((u >> 23) & 255) - 112;
  if (e <= 0) return (uint16_t)s;
  return (uint16_t)(s | (e << 10) | ((u >> 13) & 0x3ff));
}

struct Buf {
  DType dt;
  std::vector<float> f;
  std::vector<uint16_t> h;
  void fill(size_t n, DType d, std::mt19937& rng, float lo, float hi) {
    dt = d;
    std::uniform_real_distribution<float> U(lo, hi);
    f.resize(n);
    h.resize(n);
    for (size_t i = 0; i < n; i++) {
      float v = U(rng);
      if (d == BF16) {
        h[i] = to_bf16(v);
        f[i] = bf16f(h[i]);
      } else if (d == F16) {
        h[i] = to_half(v);
        f[i] = halff(h[i]);
      } else {
        f[i] = v;
      }
    }
  }
  const void* ptr() const { return dt == F32 ? (const void*)f.data() : (const void*)h.data(); }
};

static float out_val(const std::vector<uint8_t>& o, DType dt, size_t i) {
  if (dt == F32) {
    float f;
    std::memcpy(&f, o.data() + 4 * i, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, o.data() + 2 * i, 2);
  return dt == BF16 ? bf16f(h) : halff(h);
}

static int failures = 0, checks = 0;
// Second pass: the weights are packed in the panel layout (panel_pack) before each product.
static bool g_panel = false;

// Packs the matrix when g_panel (bits the layout holds); released by the returned guard.
struct PanelGuard {
  const void* w = nullptr;
  PanelGuard(const QMatrix& q) {
    if (g_panel && panel_pack(q) > 0) w = q.w;
  }
  ~PanelGuard() {
    if (w) panel_release(w);
  }
};

static void run_case(std::mt19937& rng, int bits, int gs, DType xdt, DType sdt, int64_t E,
                     int64_t N, int64_t K, int64_t R, bool gathered, const char* isa_name,
                     int threads, bool fast = false, bool extreme = false) {
  set_threads(threads);
  set_mode(fast ? MODE_FAST : MODE_EXACT);
  const int64_t words = K * bits / 32;
  std::vector<uint32_t> w(E * N * words);
  for (auto& v : w) v = extreme ? 0xFFFFFFFFu : rng();
  Buf s, b, x;
  s.fill(E * N * (K / gs), sdt, rng, 0.001f, 0.02f);
  b.fill(E * N * (K / gs), sdt, rng, -0.1f, 0.1f);
  // extreme: every code at its largest and every activation of a row +-1 (int8 +-127 in FAST):
  // the largest integer sums the kernels can meet (the AVX2 / AVX-512BW int16 partial sums).
  x.fill(R * K, xdt, rng, extreme ? 1.f : -1.f, 1.f);
  if (extreme)
    for (int64_t r = 1; r < R; r += 2)
      for (int64_t k = 0; k < K; k++) x.f[r * K + k] = -1.f, x.h[r * K + k] ^= 0x8000;
  std::vector<int32_t> ex(R);
  std::vector<int64_t> off(R);
  for (int64_t r = 0; r < R; r++) {
    ex[r] = gathered ? (int32_t)(rng() % E) : 0;
    off[r] = r * K;
  }
  if (gathered && R > 2) off[1] = off[0];  // shared activation row (broadcast)
  DType odt = (xdt == sdt) ? xdt : F32;
  size_t osz = odt == F32 ? 4 : 2;
  std::vector<uint8_t> out(R * N * osz, 0xff);
  GatherProblem p;
  p.x = x.ptr();
  p.xdt = xdt;
  p.nrows = R;
  p.xrow_off = off.data();
  p.expert = gathered ? ex.data() : nullptr;
  p.w = w.data();
  p.scales = s.ptr();
  p.biases = b.ptr();
  p.sdt = sdt;
  p.E = E;
  p.N = N;
  p.K = K;
  p.bits = bits;
  p.group_size = gs;
  p.out = out.data();
  p.odt = odt;
  {
    PanelGuard pg(p);
    gather_qmm(p);
  }
  // Reference: plain bit extraction, double accumulation. FAST requested for bits the ISA has no
  // FAST kernel for (fast_bits_mask(), what kernels.info() reports) must give EXACT's result;
  // where the mask says FAST runs, a float32 output must show int8 rounding somewhere.
  const bool fast_here = fast && ((fast_bits_mask() >> bits) & 1);
  // FAST's own exact result: activations as int8 codes per group (scale max|x| / 127, round to
  // nearest, the documented scheme), products with the codes, the bias term with float sums.
  std::vector<float> xq8;
  if (fast_here) {
    xq8.resize(x.f.size());
    for (int64_t r = 0; r < R; r++)
      for (int64_t g = 0; g < K / gs; g++) {
        const float* src = x.f.data() + off[r] + g * gs;
        float amax = 0.f;
        for (int i = 0; i < gs; i++) amax = std::max(amax, std::fabs(src[i]));
        const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
        for (int i = 0; i < gs; i++) {
          float v = std::min(127.f, std::max(-127.f, std::nearbyint(src[i] * id)));
          xq8[off[r] + g * gs + i] = v * d;
        }
      }
  }
  double max_err = 0, max_ref = 0, max_mag = 0;
  bool bad = false;
  const uint8_t* wb = reinterpret_cast<const uint8_t*>(w.data());
  for (int64_t r = 0; r < R; r++) {
    int64_t e = ex[r];
    for (int64_t n = 0; n < N; n++) {
      const uint8_t* row = wb + (e * N + n) * words * 4;
      double acc = 0, mag = 0, acc8 = 0, magf = 0;
      for (int64_t k = 0; k < K; k++) {
        uint32_t q = 0;
        for (int i = 0; i < bits; i++) {
          int64_t bit = k * bits + i;
          q |= (uint32_t)((row[bit >> 3] >> (bit & 7)) & 1) << i;
        }
        int64_t gi = (e * N + n) * (K / gs) + k / gs;
        float wv = s.f[gi] * (float)q + b.f[gi];
        acc += (double)x.f[off[r] + k] * wv;
        mag += std::fabs((double)x.f[off[r] + k] * wv);
        magf += std::fabs((double)s.f[gi] * q * x.f[off[r] + k]) +
                std::fabs((double)b.f[gi] * x.f[off[r] + k]);
        if (fast_here)
          acc8 += (double)s.f[gi] * q * xq8[off[r] + k] + (double)b.f[gi] * x.f[off[r] + k];
      }
      double got = out_val(out, odt, r * N + n);
      double tol = (odt == F32 ? 1e-5 : odt == BF16 ? 8e-3 : 1e-3) * (std::fabs(acc) + 1e-3 * mag) +
                   2e-6 * mag;
      double err = std::fabs(got - acc);
      // FAST: within float rounding of its int8-activation result (tight), as well as close to
      // the float result (the loose bound below).
      const double want = fast_here ? acc8 : acc;
      // (Extreme inputs: one weight per group, so the scale and bias terms can cancel to a tiny
      // output, and float32 sums of one magnitude round more with K: bound by the terms' own
      // magnitude, magf. An int16 overflow is off by 65536 codes' worth, ~0.5 here.)
      const double tol_here = (fast_here ? tol + 1e-5 * mag : tol) + (extreme ? 1e-5 * magf : 0.0);
      if (!(std::fabs(got - want) <= tol_here)) {
        if (!bad && std::getenv("QK_VERBOSE"))
          std::printf("  r=%lld n=%lld got=%.8g ref=%.8g mag=%.6g\n", (long long)r, (long long)n,
                      got, want, mag);
        bad = true;
      }
      max_err = std::max(max_err, err);
      max_ref = std::max(max_ref, std::fabs(acc));
      max_mag = std::max(max_mag, mag);
    }
  }
  // FAST (int8 activations) is approximate: bound the error relative to the output scale, or
  // to the products' magnitude where the outputs cancel (a lone 1-bit output of a few groups:
  // its int8 result, checked tightly above, was 3.2% of a cancelled |output| of 0.027).
  if (fast_here && !(max_err <= 3e-2 * max_ref + 1e-2 * max_mag)) bad = true;
  // The mask claims FAST: the float32 outputs must not be EXACT's bits. (Not "some output is
  // beyond EXACT's tolerance": with one output, int8 rounding can land inside it, 1 seed in ~130.)
  // (Extreme inputs quantize exactly, +-1 to +-127: FAST may give EXACT's bits there.)
  if (fast_here && odt == F32 && !extreme) {
    std::vector<uint8_t> out_exact(out.size(), 0xff);
    p.out = out_exact.data();
    set_mode(MODE_EXACT);
    {
      PanelGuard pg(p);
      gather_qmm(p);
    }
    if (out_exact == out) bad = true;
  }
  set_mode(MODE_EXACT);
  checks++;
  if (bad) {
    failures++;
    std::printf("FAIL isa=%s bits=%d gs=%d xdt=%d sdt=%d E=%lld N=%lld K=%lld R=%lld gathered=%d "
                "threads=%d fast=%d max_err=%g max_ref=%g\n",
                isa_name, bits, gs, (int)xdt, (int)sdt, (long long)E, (long long)N, (long long)K,
                (long long)R, (int)gathered, threads, (int)fast, max_err, max_ref);
  }
}

// Row independence: each row of an M-row product must be the same bits as that row alone (the
// server decodes several sequences as rows of one product and promises each the reply it gets
// alone). Bit-exact comparison, float32 output.
static void run_rows_case(std::mt19937& rng, int bits, int gs, int64_t N, int64_t K, int64_t M,
                          const char* isa_name, bool fast) {
  set_threads(2);
  set_mode(fast ? MODE_FAST : MODE_EXACT);
  const int64_t words = K * bits / 32;
  std::vector<uint32_t> w(N * words);
  for (auto& v : w) v = rng();
  Buf s, b, x;
  s.fill(N * (K / gs), BF16, rng, 0.001f, 0.02f);
  b.fill(N * (K / gs), BF16, rng, -0.1f, 0.1f);
  x.fill(M * K, F32, rng, -1.f, 1.f);
  std::vector<float> all(M * N), one(N);
  QMatrix q;
  q.w = w.data();
  q.scales = s.ptr();
  q.biases = b.ptr();
  q.sdt = BF16;
  q.N = N;
  q.K = K;
  q.bits = bits;
  q.group_size = gs;
  PanelGuard pg(q);
  qmm(x.ptr(), F32, M, w.data(), s.ptr(), b.ptr(), BF16, N, K, bits, gs, all.data(), F32);
  bool bad = false;
  for (int64_t r = 0; r < M && !bad; r++) {
    qmm(x.f.data() + r * K, F32, 1, w.data(), s.ptr(), b.ptr(), BF16, N, K, bits, gs, one.data(),
        F32);
    bad = std::memcmp(one.data(), all.data() + r * N, N * sizeof(float)) != 0;
  }
  set_mode(MODE_EXACT);
  checks++;
  if (bad) {
    failures++;
    std::printf("FAIL rows isa=%s bits=%d gs=%d N=%lld K=%lld M=%lld fast=%d: a row of the "
                "M-row product differs from that row alone\n",
                isa_name, bits, gs, (long long)N, (long long)K, (long long)M, (int)fast);
  }
}

// Panel layout: unpacking gives back the MLX bytes; FAST rows of a B-row product (B = 1..20, so
// past the 8 rows of one kernel pass and the GEMM's threshold) equal that row alone, bit for bit.
static void run_panel_case(std::mt19937& rng, int bits, int gs, int64_t E, int64_t N, int64_t K,
                           DType sdt, const char* isa_name) {
  const int64_t G = K / gs, words = K * bits / 32;
  std::vector<uint32_t> w(E * N * words);
  for (auto& v : w) v = rng();
  Buf s, b;
  s.fill(E * N * G, sdt, rng, 0.001f, 0.02f);
  b.fill(E * N * G, sdt, rng, -0.1f, 0.1f);
  QMatrix q;
  q.w = w.data();
  q.scales = s.ptr();
  q.biases = b.ptr();
  q.sdt = sdt;
  q.E = E;
  q.N = N;
  q.K = K;
  q.bits = bits;
  q.group_size = gs;
  if (panel_pack(q) <= 0) {  // x86 SIMD and NEON sdot / usdot builds; "scalar" and plain NEON
                            // keep the MLX layout
    const std::string v = isa_variant();
    if (v != "scalar" && v != "neon") {
      failures++;
      std::printf("FAIL panel isa=%s bits=%d: not packed\n", isa_name, bits);
    }
    checks++;
    return;
  }
  checks++;
  const size_t ssz = sdt == F32 ? 4 : 2;
  std::vector<uint32_t> w2(w.size(), 0);
  std::vector<uint8_t> s2(E * N * G * ssz), b2(E * N * G * ssz);
  bool bad = !panel_unpack(w.data(), w2.data(), s2.data(), b2.data()) || w2 != w ||
             std::memcmp(s2.data(), s.ptr(), s2.size()) || std::memcmp(b2.data(), b.ptr(), b2.size());
  if (bad) std::printf("FAIL panel unpack isa=%s bits=%d gs=%d\n", isa_name, bits, gs);
  set_mode(MODE_FAST);
  const int64_t M = 20;
  Buf x;
  x.fill(M * K, F32, rng, -1.f, 1.f);
  std::vector<int32_t> ex(M);
  std::vector<int64_t> off(M);
  for (int64_t r = 0; r < M; r++) {
    ex[r] = (int32_t)(rng() % 2);  // two experts: up to ~20 rows each
    off[r] = r * K;
  }
  GatherProblem p;
  static_cast<QMatrix&>(p) = q;
  p.x = x.ptr();
  p.xdt = F32;
  p.xrow_off = off.data();
  p.expert = ex.data();
  p.odt = F32;
  std::vector<float> all(M * N), one(N);
  for (int64_t B : {M, (int64_t)8, (int64_t)3}) {
    p.nrows = B;
    p.out = all.data();
    gather_qmm(p);
    for (int64_t r = 0; r < B && !bad; r++) {
      GatherProblem p1 = p;
      p1.nrows = 1;
      p1.xrow_off = off.data() + r;
      p1.expert = ex.data() + r;
      p1.out = one.data();
      gather_qmm(p1);
      if (std::memcmp(one.data(), all.data() + r * N, N * sizeof(float))) {
        bad = true;
        std::printf("FAIL panel rows isa=%s bits=%d gs=%d B=%lld row %lld differs from alone\n",
                    isa_name, bits, gs, (long long)B, (long long)r);
      }
    }
  }
  set_mode(MODE_EXACT);
  panel_release(w.data());
  if (bad) failures++;
}

// gather_qmm_many (decode's MoE block: several products in one pool job, activations prepared
// once per distinct row): each product's output equals its own gather_qmm call, bit for bit, in
// FAST and EXACT mode, with products sharing x, an expert matrix with an out-of-range expert, and
// (when `mlx_layout`) one matrix left in the MLX layout, which sends every product down the
// one-by-one path.
static void run_many_case(std::mt19937& rng, int gs, DType sdt, const char* isa_name,
                          bool mlx_layout) {
  const int64_t K = gs * (1 + rng() % 6), G = K / gs;
  struct Mat {
    int bits;
    int64_t E, N;
    std::vector<uint32_t> w;
    Buf s, b;
    QMatrix q;
  };
  std::vector<Mat> mats(4);
  const int bits_of[4] = {8, 4, 2, 6};
  const int64_t E_of[4] = {1, 1, 3, 1};
  for (int i = 0; i < 4; i++) {
    Mat& m = mats[i];
    m.bits = bits_of[i];
    m.E = E_of[i];
    m.N = 1 + rng() % 50;
    m.w.resize(m.E * m.N * (K * m.bits / 32));
    for (auto& v : m.w) v = rng();
    m.s.fill(m.E * m.N * G, sdt, rng, 0.001f, 0.02f);
    m.b.fill(m.E * m.N * G, sdt, rng, -0.1f, 0.1f);
    m.q.w = m.w.data();
    m.q.scales = m.s.ptr();
    m.q.biases = m.b.ptr();
    m.q.sdt = sdt;
    m.q.E = m.E;
    m.q.N = m.N;
    m.q.K = K;
    m.q.bits = m.bits;
    m.q.group_size = gs;
    if (!(mlx_layout && i == 3)) panel_pack(m.q);
  }
  const int64_t T = 1 + rng() % 3, k = 3;
  Buf x, x2;
  x.fill(T * K, F32, rng, -1.f, 1.f);
  x2.fill(T * K, F32, rng, -1.f, 1.f);
  std::vector<int64_t> tok(T), xrow(T * k);
  std::vector<int32_t> ex(T * k);
  for (int64_t t = 0; t < T; t++) tok[t] = t * K;
  for (int64_t i = 0; i < T * k; i++) {
    xrow[i] = (i / k) * K;
    ex[i] = i == 1 ? -1 : (int32_t)(rng() % 3);  // row 1: an expert another rank holds
  }
  bool bad = false;
  for (int mode : {MODE_FAST, MODE_EXACT}) {
    set_mode(mode);
    std::vector<GatherProblem> ps(4);
    std::vector<std::vector<float>> many(4), one(4);
    for (int i = 0; i < 4; i++) {
      GatherProblem& p = ps[i];
      static_cast<QMatrix&>(p) = mats[i].q;
      const bool experts = mats[i].E > 1;
      p.x = i == 1 ? x2.ptr() : x.ptr();
      p.xdt = F32;
      p.nrows = experts ? T * k : T;
      p.xrow_off = experts ? xrow.data() : tok.data();
      p.expert = experts ? ex.data() : nullptr;
      p.odt = F32;
      many[i].assign(p.nrows * p.N, 7.f);
      one[i].assign(p.nrows * p.N, 7.f);
    }
    for (int i = 0; i < 4; i++) ps[i].out = many[i].data();
    gather_qmm_many(ps.data(), 4);
    for (int i = 0; i < 4; i++) {
      GatherProblem p1 = ps[i];
      p1.out = one[i].data();
      gather_qmm(p1);
      if (std::memcmp(one[i].data(), many[i].data(), one[i].size() * sizeof(float))) {
        bad = true;
        std::printf("FAIL many isa=%s gs=%d mode=%d product %d (bits %d%s) differs from alone\n",
                    isa_name, gs, mode, i, mats[i].bits, mlx_layout ? ", one MLX layout" : "");
      }
    }
  }
  set_mode(MODE_EXACT);
  for (Mat& m : mats) panel_release(m.w.data());
  checks++;
  if (bad) failures++;
}

// The verify pass's multi-row Gated DeltaNet (linear_attn_rows): row i's output and the caches
// after row i (tape slot i) must be the bits of i + 1 one-token steps (linear_attn_step),
// whichever kernel the delta rule takes on this CPU.
// Random inputs of a Gated DeltaNet layer's decode step: `rows` rows of qkv / z / b / a, `batch`
// conv windows and states; `st` has the shapes, weights and the rows' strides (one row apart).
struct LinearInputs {
  std::vector<float> qkv, z, b, a, conv, conv_w, A_log, dt_bias, norm_w, state;
  LinearAttnStep st;
  int64_t C = 0, SZ = 0;
};

static LinearInputs linear_inputs(std::mt19937& rng, int64_t rows, int64_t batch, int64_t Hk,
                                  int64_t Dk, int64_t Hv, int64_t Dv) {
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  auto fill = [&](std::vector<float>& v, size_t n, float sc) {
    v.resize(n);
    for (auto& x : v) x = u(rng) * sc;
  };
  LinearInputs in;
  const int64_t K = 4, C = 2 * Hk * Dk + Hv * Dv;
  in.C = C;
  in.SZ = Hv * Dv * Dk;
  fill(in.qkv, rows * C, 1.f);
  fill(in.z, rows * Hv * Dv, 1.f);
  fill(in.b, rows * Hv, 1.f);
  fill(in.a, rows * Hv, 1.f);
  fill(in.conv, batch * (K - 1) * C, 1.f);
  fill(in.conv_w, C * K, 0.5f);
  fill(in.A_log, Hv, 1.f);
  fill(in.dt_bias, Hv, 1.f);
  fill(in.norm_w, Dv, 1.f);
  fill(in.state, batch * in.SZ, 0.1f);
  LinearAttnStep& st = in.st;
  st.conv_dim = C;
  st.kernel = K;
  st.Hk = Hk;
  st.Hv = Hv;
  st.Dk = Dk;
  st.Dv = Dv;
  st.qkv = in.qkv.data();  // (vector buffers survive the return's move)
  st.z = in.z.data();
  st.b = in.b.data();
  st.a = in.a.data();
  st.qkv_stride = C;
  st.z_stride = Hv * Dv;
  st.ab_stride = Hv;
  st.conv_w = in.conv_w.data();
  st.A_log = in.A_log.data();
  st.dt_bias = in.dt_bias.data();
  st.norm_w = in.norm_w.data();
  return in;
}

// Row i of a step's inputs as a one-row step: the caches it reads and the buffers it writes.
static LinearAttnStep one_row(const LinearAttnStep& st, int64_t i, const float* conv_in,
                              const float* state_in, float* out, float* new_conv, float* new_state) {
  LinearAttnStep one = st;
  one.qkv = st.qkv + i * st.qkv_stride;
  one.z = st.z + i * st.z_stride;
  one.b = st.b + i * st.ab_stride;
  one.a = st.a + i * st.ab_stride;
  one.conv_state = conv_in;
  one.state_in = state_in;
  one.out = out;
  one.new_conv_state = new_conv;
  one.state = new_state;
  return one;
}

static void run_linear_rows_case(std::mt19937& rng, int64_t Hk, int64_t Dk, int64_t Hv,
                                 int64_t Dv, int64_t L) {
  LinearInputs in = linear_inputs(rng, L, 1, Hk, Dk, Hv, Dv);
  const int64_t K = in.st.kernel, C = in.C;
  const LinearAttnStep st = in.st;
  std::vector<float>&conv = in.conv, &state = in.state;
  std::vector<float> out(L * Hv * Dv), conv_tape(L * (K - 1) * C), state_tape(L * Hv * Dv * Dk);
  std::vector<float*> conv_slots, state_slots;
  for (int64_t i = 0; i < L; i++) {
    conv_slots.push_back(conv_tape.data() + i * (K - 1) * C);
    state_slots.push_back(state_tape.data() + i * Hv * Dv * Dk);
  }
  LinearAttnStep rows = st;
  rows.conv_state = conv.data();
  rows.state_in = state.data();
  rows.out = out.data();
  linear_attn_rows(rows, L, C, Hv * Dv, Hv, conv_slots.data(), state_slots.data());
  std::vector<float> o(Hv * Dv), c_in = conv, s_in = state, c_out(conv.size()), s_out(state.size());
  bool bad = false;
  for (int64_t i = 0; i < L && !bad; i++) {
    linear_attn_step(one_row(st, i, c_in.data(), s_in.data(), o.data(), c_out.data(), s_out.data()));
    bad = std::memcmp(o.data(), out.data() + i * Hv * Dv, o.size() * 4) != 0 ||
          std::memcmp(c_out.data(), conv_tape.data() + i * c_out.size(), c_out.size() * 4) != 0 ||
          std::memcmp(s_out.data(), state_tape.data() + i * s_out.size(), s_out.size() * 4) != 0;
    c_in = c_out;
    s_in = s_out;
  }
  checks++;
  if (bad) {
    failures++;
    std::printf("FAIL linear_attn_rows Hk=%lld Dk=%lld Hv=%lld Dv=%lld L=%lld: a row differs "
                "from the one-token step\n", (long long)Hk, (long long)Dk, (long long)Hv,
                (long long)Dv, (long long)L);
  }
}

// A batched decode step's attention (decode_attention_rows: B rows, each with its own keys and
// values of its own length, the B x Hkv tasks on the pool) against causal_attention of each row
// alone with L = 1 (the one-sequence step): the same bits, 1 and 2 threads. With a half cache
// (kv f16 / bf16): the same bits as causal_attention over the cache's values cast to float32.
static void run_decode_attention_case(std::mt19937& rng, int64_t B, int64_t Hq, int64_t Hkv,
                                      int64_t D, int threads, const char* isa_name,
                                      KvType kv = KvType::f32) {
  set_threads(threads);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<int64_t> cap(B), S(B);
  std::vector<std::vector<float>> kb(B), vb(B);
  std::vector<std::vector<uint16_t>> kh(B), vh(B);
  std::vector<const float*> kp(B), vp(B);
  std::vector<const void*> kx(B), vx(B);
  auto half = [kv](float x) { return kv == KvType::f16 ? float_to_half(x) : float_to_bf16(x); };
  auto back = [kv](uint16_t h) {
    if (kv == KvType::f16) return half_to_float(h);
    const uint32_t u = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  };
  for (int64_t b = 0; b < B; b++) {
    S[b] = 1 + rng() % 300;
    cap[b] = S[b] + rng() % 40;  // room past the filled positions, as a cache has
    for (auto* pair : {&kb, &vb}) {
      auto& f = (*pair)[b];
      auto& h = (pair == &kb ? kh : vh)[b];
      f.resize(Hkv * cap[b] * D);
      h.resize(f.size());
      for (size_t i = 0; i < f.size(); i++) {
        f[i] = u(rng);
        if (kv != KvType::f32) f[i] = back(h[i] = half(f[i]));
      }
    }
    kp[b] = kb[b].data();
    vp[b] = vb[b].data();
    kx[b] = kv == KvType::f32 ? (const void*)kp[b] : (const void*)kh[b].data();
    vx[b] = kv == KvType::f32 ? (const void*)vp[b] : (const void*)vh[b].data();
  }
  std::vector<float> q(B * Hq * D), gate(B * Hq * D), out(B * Hq * D), one(Hq * D);
  for (auto& x : q) x = u(rng);
  for (auto& x : gate) x = u(rng);
  const float scale = 1.f / std::sqrt((float)D);
  decode_attention_rows(q.data(), kx.data(), vx.data(), cap.data(), S.data(), gate.data(),
                        out.data(), B, Hq, Hkv, D, scale, kv);
  bool bad = false;
  for (int64_t b = 0; b < B && !bad; b++) {
    const int64_t qst[3] = {Hq * D, D, D}, kst[3] = {Hkv * cap[b] * D, cap[b] * D, D},
                  gst[3] = {Hq * D, Hq * D, D};
    causal_attention(q.data() + b * Hq * D, qst, kp[b], kst, vp[b], kst,
                     gate.data() + b * Hq * D, gst, one.data(), 1, Hq, Hkv, 1, S[b], D, scale);
    bad = std::memcmp(one.data(), out.data() + b * Hq * D, one.size() * 4) != 0;
  }
  checks++;
  if (bad) {
    failures++;
    std::printf("FAIL decode_attention_rows isa=%s B=%lld Hq=%lld Hkv=%lld D=%lld threads=%d "
                "kv=%d: a row differs from its one-row causal_attention\n", isa_name,
                (long long)B, (long long)Hq, (long long)Hkv, (long long)D, threads, (int)kv);
  }
}

// float16 conversions: every half value round-trips through float32, and float32 values round
// to the nearest half (ties to even), as MLX's astype does.
static void run_half_conversion_case(std::mt19937& rng) {
  bool bad = false;
  for (uint32_t h = 0; h < 65536 && !bad; h++) {
    const bool nan = (h & 0x7c00) == 0x7c00 && (h & 0x3ff);
    if (!nan) bad = float_to_half(half_to_float((uint16_t)h)) != h;
  }
  std::uniform_real_distribution<float> u(-70000.f, 70000.f);
  for (int i = 0; i < 100000 && !bad; i++) {
    const float x = i % 2 ? u(rng) : u(rng) * 1e-7f;  // normals, and subnormal halves
    const uint16_t h = float_to_half(x);
    const float y = half_to_float(h);
    const float up = half_to_float((uint16_t)(h + 1)), dn = half_to_float((uint16_t)(h - 1));
    const bool inf = (h & 0x7fff) == 0x7c00;
    if (!inf && (h & 0x7fff) && (std::fabs(x - y) > std::fabs(x - up) ||
                                 std::fabs(x - y) > std::fabs(x - dn)))
      bad = true;
  }
  checks++;
  if (bad) {
    failures++;
    std::printf("FAIL float16 conversion\n");
  }
}

// A batched linear-attention step (B rows, its per-row work on the pool) against each row's
// one-row step: the same bits for the output and both caches.
static void run_linear_batch_case(std::mt19937& rng, int64_t B, int64_t Hk, int64_t Dk,
                                  int64_t Hv, int64_t Dv) {
  set_threads(2);
  LinearInputs in = linear_inputs(rng, B, B, Hk, Dk, Hv, Dv);
  const int64_t K = in.st.kernel, C = in.C, SZ = in.SZ;
  const LinearAttnStep st = in.st;
  std::vector<float>&conv = in.conv, &state = in.state;
  std::vector<float> out(B * Hv * Dv), new_conv(B * (K - 1) * C), new_state(B * SZ);
  LinearAttnStep all = one_row(st, 0, conv.data(), state.data(), out.data(), new_conv.data(),
                               new_state.data());
  all.B = B;
  linear_attn_step(all);
  std::vector<float> o(Hv * Dv), c_out((K - 1) * C), s_out(SZ);
  bool bad = false;
  for (int64_t r = 0; r < B && !bad; r++) {
    linear_attn_step(one_row(st, r, conv.data() + r * (K - 1) * C, state.data() + r * SZ,
                             o.data(), c_out.data(), s_out.data()));
    bad = std::memcmp(o.data(), out.data() + r * Hv * Dv, o.size() * 4) != 0 ||
          std::memcmp(c_out.data(), new_conv.data() + r * c_out.size(), c_out.size() * 4) != 0 ||
          std::memcmp(s_out.data(), new_state.data() + r * SZ, SZ * 4) != 0;
  }
  checks++;
  if (bad) {
    failures++;
    std::printf("FAIL linear_attn_step B=%lld Hk=%lld Dk=%lld Hv=%lld Dv=%lld: a row differs from "
                "its one-row step\n", (long long)B, (long long)Hk, (long long)Dk, (long long)Hv,
                (long long)Dv);
  }
}

int main(int argc, char** argv) {
  bool quick = false;
  std::vector<std::string> isas = {"avx512", "avx512-novbmi", "avx512-novnni", "avx2", "neon", "neon-dotprod", "neon-base", "scalar"};
  std::string expect;
  std::random_device rd;
  unsigned seed = rd();
  for (int i = 1; i < argc; i++) {
    const std::string a = argv[i];
    if (a == "--quick") {
      quick = true;
    } else if (a.rfind("--only=", 0) == 0) {
      isas.clear();
      std::string rest = a.substr(7);
      for (size_t p = 0; p != std::string::npos;) {
        size_t q = rest.find(',', p);
        isas.push_back(rest.substr(p, q == std::string::npos ? q : q - p));
        p = q == std::string::npos ? q : q + 1;
      }
    } else if (a.rfind("--expect=", 0) == 0) {
      expect = a.substr(9);
    } else {
      seed = (unsigned)std::stoul(a);
    }
  }
  std::mt19937 rng(seed);
  force_isa("auto");
  std::printf("seed %u, best isa %s (variant %s), default threads %d\n", seed, best_isa(),
              isa_variant(), default_threads());
  if (!expect.empty() && expect != isa_variant()) {
    std::printf("FAIL: expected the variant %s on this CPU, got %s\n", expect.c_str(),
                isa_variant());
    return 1;
  }
  // A NEON variant the CPU lacks must be refused, not run (it would be an illegal instruction).
  if (expect == "neon" && (force_isa("neon-dotprod") || force_isa("neon-i8mm"))) {
    std::printf("FAIL: a dot-product NEON variant was accepted on a CPU without it\n");
    return 1;
  }
  if (expect == "neon-dotprod" && force_isa("neon-i8mm")) {
    std::printf("FAIL: neon-i8mm was accepted on a CPU without i8mm\n");
    return 1;
  }
  set_single_thread_bytes(0);  // exercise the pool even on small shapes
  const DType dts[] = {F32, F16, BF16};
  std::vector<std::string> seen;
  for (const std::string& isa_s : isas) {
    const char* isa_name = isa_s.c_str();
    if (!force_isa(isa_name)) continue;
    bool dup = false;
    for (const auto& v : seen) dup = dup || v == isa_variant();
    if (dup) continue;  // "neon" forced to the variant another name already ran
    seen.push_back(isa_variant());
    std::printf("isa %s (variant %s, FAST bits mask 0x%x)\n", isa_name, isa_variant(),
                fast_bits_mask());
    for (int bits : {1, 2, 3, 4, 5, 6, 8}) {
      for (int gs : {32, 64, 128}) {
        for (DType xdt : dts) {
          DType sdt = dts[rng() % 3];
          // Odd shapes: K a multiple of gs but not of the SIMD block, N not a multiple of lanes.
          int64_t K = gs * (1 + rng() % (quick ? 5 : 9));
          int64_t N = 1 + rng() % 37;
          int threads = 1 + (int)(rng() % 3);
          run_case(rng, bits, gs, xdt, sdt, 1, N, K, 1 + rng() % 3, false, isa_name, threads);
          run_case(rng, bits, gs, xdt, sdt, 1, N, K, 9 + rng() % 12, false, isa_name, threads);
          run_case(rng, bits, gs, xdt, sdt, 5, N, K, 1 + rng() % 20, true, isa_name, threads);
        }
      }
    }
    // FAST mode (bits without a fast kernel run EXACT).
    for (int bits : {1, 2, 3, 4, 5, 6, 8})
      for (int gs : {32, 64, 128}) {
        int64_t K = gs * (1 + rng() % 9);
        run_case(rng, bits, gs, F32, BF16, 1, 1 + rng() % 40, K, 1 + rng() % 12, false, isa_name,
                 2, true);
        run_case(rng, bits, gs, BF16, BF16, 4, 1 + rng() % 40, K, 1 + rng() % 12, true, isa_name,
                 1, true);
      }
    // A larger, block-aligned case per bits.
    for (int bits : {1, 2, 3, 4, 5, 6, 8}) {
      run_case(rng, bits, 64, F32, BF16, 3, 67, 512, 19, true, isa_name, 2);
      // FAST with many rows per expert (NEON i8mm: usmmla pairs, odd rows left over).
      run_case(rng, bits, 64, F32, BF16, 3, 67, 512, 19, true, isa_name, 2, true);
      run_case(rng, bits, 128, BF16, F16, 1, 30, 1024, 7, false, isa_name, 1, true);
    }
    // Rows of a multi-row product equal single rows, EXACT and FAST.
    for (int bits : {1, 2, 3, 4, 5, 6, 8})
      for (bool fast : {false, true})
        run_rows_case(rng, bits, 64, 1 + rng() % 70, 64 * (1 + rng() % 9), 2 + rng() % 12,
                      isa_name, fast);
  }
  // The same cases again with the weights in the panel layout (x86 SIMD and NEON sdot / usdot
  // builds pack; elsewhere panel_pack declines and the MLX layout serves), then the panel-only
  // checks.
  g_panel = true;
  force_isa("auto");
  {
    for (const std::string& isa_s : isas) {
      const char* isa_name = isa_s.c_str();
      if (!force_isa(isa_name)) continue;
      std::printf("panel layout, isa %s (variant %s)\n", isa_name, isa_variant());
      for (int bits : {2, 4, 6, 8})
        for (int gs : {32, 64, 128}) {
          const DType sdt = dts[rng() % 3];
          const int64_t K = gs * (1 + rng() % (quick ? 5 : 9));
          run_case(rng, bits, gs, F32, sdt, 1, 1 + rng() % 40, K, 1 + rng() % 12, false, isa_name, 2);
          run_case(rng, bits, gs, BF16, sdt, 5, 1 + rng() % 40, K, 1 + rng() % 20, true, isa_name, 2);
          run_case(rng, bits, gs, F32, sdt, 1, 1 + rng() % 40, K, 1 + rng() % 12, false, isa_name, 2, true);
          run_case(rng, bits, gs, BF16, sdt, 4, 1 + rng() % 40, K, 1 + rng() % 20, true, isa_name, 1, true);
          run_rows_case(rng, bits, gs, 1 + rng() % 70, K, 2 + rng() % 12, isa_name, true);
          run_panel_case(rng, bits, gs, 2, 1 + rng() % 50, K, sdt, isa_name);
          run_case(rng, bits, gs, F32, sdt, 1, 1 + rng() % 40, K, 1 + rng() % 12, false, isa_name,
                   2, true, true);
          run_case(rng, bits, gs, BF16, sdt, 3, 1 + rng() % 40, K, 1 + rng() % 12, true, isa_name,
                   1, true, true);
        }
      for (int gs : {32, 64, 128}) {
        run_many_case(rng, gs, dts[rng() % 3], isa_name, false);
        run_many_case(rng, gs, dts[rng() % 3], isa_name, true);
      }
    }
  }
  g_panel = false;
  force_isa("auto");
  run_linear_rows_case(rng, 2, 32, 4, 32, 4);
  run_linear_rows_case(rng, 2, 24, 4, 8, 5);    // Dk not a multiple of 16: the masked tail
  run_linear_rows_case(rng, 4, 128, 8, 128, 3);
  run_linear_rows_case(rng, 1, 8, 2, 8, 2);     // Dk < 16: the generic kernel, row by row
  run_linear_batch_case(rng, 5, 2, 32, 4, 32);
  run_linear_batch_case(rng, 3, 4, 128, 8, 128);
  run_half_conversion_case(rng);
  // Both modes: FAST's softmax (vectorised exp and sums) keeps a row's bits its own too.
  for (const std::string& isa_s : isas) {
    if (!force_isa(isa_s.c_str())) continue;
    for (int threads : {1, 2})
    for (int mode : {MODE_EXACT, MODE_FAST}) {
      set_mode(mode);
      run_decode_attention_case(rng, 1 + rng() % 8, 16, 2, 256, threads, isa_s.c_str());
      run_decode_attention_case(rng, 1 + rng() % 8, 4, 4, 32, threads, isa_s.c_str());
      run_decode_attention_case(rng, 8, 8, 1, 64, threads, isa_s.c_str());
      run_decode_attention_case(rng, 1 + rng() % 4, 16, 2, 256, threads, isa_s.c_str(),
                                KvType::f16);
      run_decode_attention_case(rng, 1 + rng() % 4, 12, 1, 64, threads, isa_s.c_str(),
                                KvType::bf16);
    }
  }
  set_mode(MODE_EXACT);
  force_isa("auto");
  std::printf("%d/%d cases passed\n", checks - failures, checks);
  return failures ? 1 : 0;
}
