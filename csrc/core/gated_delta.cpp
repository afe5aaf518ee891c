// Gated delta rule recurrence (Gated DeltaNet linear attention) on the CPU.
//
// Per (batch, value head) the state S [Dv, Dk] (float32) is carried over the tokens:
//   kv    = g_t * (S k_t)
//   delta = (v_t - kv) * beta_t
//   S     = g_t * S + delta k_t^T
//   y_t   = S q_t
// One state row is 4*Dk bytes (512 B for Dk = 128): each row is read and written once per token
// while it sits in L1, so the kernel runs at memory speed where MLX's op-by-op form makes five
// passes over the whole state. Heads are independent: they are split over the thread pool.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#if defined(__x86_64__) && defined(__linux__) && !defined(__clang__)
#include <immintrin.h>
#define PQK_DELTA_NT 1
#endif

#include "cpu_features.h"
#include "qkernels.h"

namespace pqk {
namespace {

struct DeltaArgs {
  const float *q, *k, *v, *g, *beta, *state_in;
  float *state, *y;
  int64_t B, T, Hk, Hv, Dk, Dv;
};

typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float* p) {
  v8 r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}

static inline void store8(float* p, v8 x) { std::memcpy(p, &x, sizeof(x)); }

static inline float hsum8(v8 x) {
  return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
}

// Inputs of one (batch, token, value head): q/k rows of its key head, v and y rows, gates.
struct HeadStep {
  const float *q, *k, *v;
  float* y;
  float g, beta;
};

static inline HeadStep head_step(const DeltaArgs& a, int64_t b, int64_t t, int64_t hv) {
  const int64_t bt = b * a.T + t;
  const int64_t hk = hv / (a.Hv / a.Hk);
  return {a.q + (bt * a.Hk + hk) * a.Dk, a.k + (bt * a.Hk + hk) * a.Dk,
          a.v + (bt * a.Hv + hv) * a.Dv, a.y + (bt * a.Hv + hv) * a.Dv,
          a.g[bt * a.Hv + hv], a.beta[bt * a.Hv + hv]};
}

// One (batch, value head) over all tokens. Vector path when Dk is a multiple of 8.
#if defined(__x86_64__) && defined(__linux__) && !defined(__clang__)
__attribute__((target_clones("avx512f", "avx2,fma", "default")))
#endif
void delta_head(const DeltaArgs& a, int64_t b, int64_t hv) {
  const int64_t Dk = a.Dk, Dv = a.Dv, T = a.T;
  float* S = a.state + (b * a.Hv + hv) * Dv * Dk;
  // The first token reads the old state and writes the new one in the same pass (no separate
  // copy of the whole state when the two differ); later tokens update in place.
  const float* S_in = a.state_in + (b * a.Hv + hv) * Dv * Dk;
  const bool vec = Dk % 8 == 0;
  for (int64_t t = 0; t < T; t++) {
    const HeadStep h = head_step(a, b, t, hv);
    const float *kt = h.k, *qt = h.q, *vt = h.v;
    float* yt = h.y;
    const float gt = h.g, betat = h.beta;
    for (int64_t dv = 0; dv < Dv; dv++) {
      float* row = S + dv * Dk;
      const float* src = (t == 0 ? S_in : S) + dv * Dk;
      float kv, out;
      if (vec) {
        v8 acc = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int64_t i = 0; i < Dk; i += 8) acc += load8(src + i) * load8(kt + i);
        kv = gt * hsum8(acc);
        const float delta = (vt[dv] - kv) * betat;
        v8 acc2 = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int64_t i = 0; i < Dk; i += 8) {
          v8 s = load8(src + i) * gt + load8(kt + i) * delta;
          store8(row + i, s);
          acc2 += s * load8(qt + i);
        }
        out = hsum8(acc2);
      } else {
        float acc = 0.f;
        for (int64_t i = 0; i < Dk; i++) acc += src[i] * kt[i];
        kv = gt * acc;
        const float delta = (vt[dv] - kv) * betat;
        float acc2 = 0.f;
        for (int64_t i = 0; i < Dk; i++) {
          const float s = src[i] * gt + kt[i] * delta;
          row[i] = s;
          acc2 += s * qt[i];
        }
        out = acc2;
      }
      yt[dv] = out;
    }
  }
}

#ifdef PQK_DELTA_NT
constexpr int64_t kMaxDk = 512;
constexpr int64_t kMaxRows = 16;  // verify rows streamed line by line (more: row by row)

// One state row of one decode token (AVX-512): the new row into nr (64-byte aligned, computed
// in a fixed order: the sums must not depend on where MLX placed the buffers, a different
// rounding can flip a later top-k expert choice), its read-out returned. Shared by the decode
// kernel and the verify pass's row kernel below, so both give a row the same bits.
__attribute__((target("avx512f,avx512bw"), always_inline)) inline float delta_row(
    const float* src, const float* kt, const float* qt, float vt, float gt, float betat,
    int64_t Dk, float* nr) {
  const __m512 g = _mm512_set1_ps(gt);
  __m512 acc = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= Dk; j += 16)
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(src + j), _mm512_loadu_ps(kt + j), acc);
  if (j < Dk) {
    const __mmask16 m = (__mmask16)((1u << (Dk - j)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, src + j), _mm512_maskz_loadu_ps(m, kt + j), acc);
  }
  const float kv = gt * _mm512_reduce_add_ps(acc);
  const __m512 delta = _mm512_set1_ps((vt - kv) * betat);
  __m512 acc2 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= Dk; i += 16) {
    const __m512 st = _mm512_fmadd_ps(_mm512_loadu_ps(kt + i), delta,
                                      _mm512_mul_ps(_mm512_loadu_ps(src + i), g));
    _mm512_store_ps(nr + i, st);
    acc2 = _mm512_fmadd_ps(st, _mm512_loadu_ps(qt + i), acc2);
  }
  if (i < Dk) {
    const __mmask16 m = (__mmask16)((1u << (Dk - i)) - 1);
    const __m512 st = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, kt + i), delta,
                                      _mm512_mul_ps(_mm512_maskz_loadu_ps(m, src + i), g));
    _mm512_mask_storeu_ps(nr + i, m, st);
    acc2 = _mm512_fmadd_ps(st, _mm512_maskz_loadu_ps(m, qt + i), acc2);
  }
  return _mm512_reduce_add_ps(acc2);
}

// A head's new state rows, in order, to its contiguous region with non-temporal stores of whole
// 64-byte lines. MLX's CPU buffers start 24 bytes past a line (malloc's 16 plus its 8-byte size
// header), so each 512-byte row began and ended inside a line: with those two partial lines
// stored normally per row, the streaming stores ran at a third of their speed (one thread, 30
// states of 2 MiB: 303 us a layer, against 105 us where the buffer was aligned). Here each line
// is put together from the end of one 16-float piece and the start of the next (one vpermt2ps),
// so only the region's first and last lines are partial.
struct LineStreamer {
  __attribute__((target("avx512f,avx512bw"))) LineStreamer() {}
  __attribute__((target("avx512f,avx512bw"))) explicit LineStreamer(float* dst) : dst(dst) {
    A = (int)((reinterpret_cast<uintptr_t>(dst) % 64) / 4);
    idx = _mm512_add_epi32(_mm512_set1_epi32(16 - A),
                           _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  }
  // The next 16 floats of the region.
  __attribute__((target("avx512f,avx512bw"), always_inline)) inline void push(__m512 x) {
    if (A == 0)
      _mm512_stream_ps(dst + 16 * n, x);
    else if (n == 0)
      _mm512_mask_storeu_ps(dst, (__mmask16)((1u << (16 - A)) - 1), x);
    else
      _mm512_stream_ps(dst + 16 * n - A, _mm512_permutex2var_ps(prev, idx, x));
    prev = x;
    n++;
  }
  // The region's last A floats (the high end of the last piece).
  __attribute__((target("avx512f,avx512bw"))) void finish() {
    if (A && n) _mm512_mask_storeu_ps(dst + 16 * n - 16, (__mmask16)(0xFFFFu << (16 - A)), prev);
  }
  float* dst = nullptr;
  int A = 0;
  int64_t n = 0;
  __m512i idx = _mm512_setzero_si512();
  __m512 prev = _mm512_setzero_ps();
};

// nr (Dk floats) to row: the floats before the first 64-byte boundary and after the last one
// are stored normally (masked), the lines between streamed (Dk not a multiple of 16).
__attribute__((target("avx512f,avx512bw"), always_inline)) inline void stream_row(
    const float* nr, float* row, int64_t Dk) {
  const int64_t lead = std::min<int64_t>(Dk, ((64 - reinterpret_cast<uintptr_t>(row) % 64) % 64) / 4);
  if (lead)
    _mm512_mask_storeu_ps(row, (__mmask16)((1u << lead) - 1), _mm512_loadu_ps(nr));
  int64_t i = lead;
  for (; i + 16 <= Dk; i += 16) _mm512_stream_ps(row + i, _mm512_loadu_ps(nr + i));
  if (i < Dk)
    _mm512_mask_storeu_ps(row + i, (__mmask16)((1u << (Dk - i)) - 1), _mm512_loadu_ps(nr + i));
}

// Decode (one token) with AVX-512: the new state goes to memory with non-temporal stores. A
// layer's state (2 MiB on the 35B shape) has left the caches by the next token (the weights of
// all other layers stream through in between), so writing it normally costs a read of every
// line of the fresh output buffer first (read-for-ownership): 3 state-sized transfers per token
// where 2 suffice. In place (the binding hands decode the old state's buffer when nothing else
// holds it) the lines are in cache from the read, and ordinary stores serve.
__attribute__((target("avx512f,avx512bw"))) void delta_head_nt(const DeltaArgs& a, int64_t b, int64_t hv) {
  const int64_t Dk = a.Dk, Dv = a.Dv;
  float* S = a.state + (b * a.Hv + hv) * Dv * Dk;
  const float* S_in = a.state_in + (b * a.Hv + hv) * Dv * Dk;
  const HeadStep h = head_step(a, b, 0, hv);
  if (S == S_in) {  // in place: the lines are in cache from the read; ordinary stores (one
                    // thread, 30 states of 2 MiB: 105 us a layer, 124 us streamed)
    for (int64_t dv = 0; dv < Dv; dv++) {
      alignas(64) float nr[kMaxDk + 16];
      h.y[dv] = delta_row(S_in + dv * Dk, h.k, h.q, h.v[dv], h.g, h.beta, Dk, nr);
      // Inline unaligned stores: a 512-byte std::memcpy was a call into libc per row (1.2% of
      // a batched step of 8 on the 35B shape).
      if (Dk % 16 == 0)
        for (int64_t i = 0; i < Dk; i += 16)
          _mm512_storeu_ps(S + dv * Dk + i, _mm512_load_ps(nr + i));
      else
        std::memcpy(S + dv * Dk, nr, Dk * sizeof(float));
    }
    return;
  }
  const bool lines = Dk % 16 == 0;
  LineStreamer out(S);
  for (int64_t dv = 0; dv < Dv; dv++) {
    alignas(64) float nr[kMaxDk + 16];
    h.y[dv] = delta_row(S_in + dv * Dk, h.k, h.q, h.v[dv], h.g, h.beta, Dk, nr);
    if (lines)
      for (int64_t i = 0; i < Dk; i += 16) out.push(_mm512_load_ps(nr + i));
    else
      stream_row(nr, S + dv * Dk, Dk);
  }
  out.finish();
  _mm_sfence();  // streaming stores are weakly ordered: visible before the task counts as done
}

// The verify pass's T decode tokens of one (batch, value head), each with delta_head_nt's
// arithmetic: per state row, token t starts from token t - 1's new row while it is still in L1
// (instead of reading back the state just streamed out), and token t's row goes to slot t of
// slots[t] ([B, Hv, Dv, Dk]).
__attribute__((target("avx512f,avx512bw"))) void delta_head_rows_nt(const DeltaArgs& a,
                                                                    float* const* slots,
                                                                    int64_t b, int64_t hv) {
  const int64_t Dk = a.Dk, Dv = a.Dv, T = a.T;
  const int64_t off = (b * a.Hv + hv) * Dv * Dk;
  const float* S_in = a.state_in + off;
  alignas(64) float nr[2][kMaxDk + 16];
  const bool lines = Dk % 16 == 0 && T <= kMaxRows;
  LineStreamer out[kMaxRows];
  if (lines)
    for (int64_t t = 0; t < T; t++) out[t] = LineStreamer(slots[t] + off);
  for (int64_t dv = 0; dv < Dv; dv++) {
    const float* src = S_in + dv * Dk;
    for (int64_t t = 0; t < T; t++) {
      const HeadStep h = head_step(a, b, t, hv);
      float* cur = nr[t & 1];
      h.y[dv] = delta_row(src, h.k, h.q, h.v[dv], h.g, h.beta, Dk, cur);
      if (lines)
        for (int64_t i = 0; i < Dk; i += 16) out[t].push(_mm512_load_ps(cur + i));
      else
        stream_row(cur, slots[t] + off + dv * Dk, Dk);
      src = cur;
    }
  }
  if (lines)
    for (int64_t t = 0; t < T; t++) out[t].finish();
  _mm_sfence();
}

bool use_nt(const DeltaArgs& a) {
  // (kMaxDk: the row buffer on the stack; Qwen3.5 uses Dk = 128.)
  static const bool avx512 = detail::cpu_features().avx512f && detail::cpu_features().avx512bw;
  // state may be state_in (the binding hands decode the old state's buffer when nothing else
  // holds it): each line goes out after the rows it covers were read, so in place is safe, and
  // the kernel, hence the bits, must not depend on it.
  return avx512 && a.T == 1 && a.Dk >= 16 && a.Dk <= kMaxDk &&
         reinterpret_cast<uintptr_t>(a.state) % 4 == 0;
}
#endif

}  // namespace

namespace detail {
// gated_delta_prefill.cpp (AVX-512, many tokens).
bool gated_delta_prefill_ok(int64_t T, int64_t Dk, int64_t Dv);
void gated_delta_prefill(const float* q, const float* k, const float* v, const float* g,
                         const float* beta, const float* state_in, float* state, float* y,
                         int64_t B, int64_t T, int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv);
}  // namespace detail

void gated_delta(const float* q, const float* k, const float* v, const float* g,
                 const float* beta, const float* state_in, float* state, float* y, int64_t B,
                 int64_t T, int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv) {
  const DeltaArgs a{q, k, v, g, beta, state_in, state, y, B, T, Hk, Hv, Dk, Dv};
  const int64_t state_bytes = B * Hv * Dv * Dk * 4;
  if (detail::gated_delta_prefill_ok(T, Dk, Dv) && std::string(isa()) == "avx512") {
    detail::gated_delta_prefill(q, k, v, g, beta, state_in, state, y, B, T, Hk, Hv, Dk, Dv);
    return;
  }
  // Small states (one layer of a tiny model) are not worth waking the pool for.
#ifdef PQK_DELTA_NT
  if (use_nt(a)) {
    parallel_for(B * Hv, state_bytes < (1 << 20),
                 [&a](int64_t i) { delta_head_nt(a, i / a.Hv, i % a.Hv); });
    return;
  }
#endif
  parallel_for(B * Hv, state_bytes * T < (1 << 20),
               [&a](int64_t i) { delta_head(a, i / a.Hv, i % a.Hv); });
}

bool gated_delta_rows(const float* q, const float* k, const float* v, const float* g,
                      const float* beta, const float* state_in, float* const* slots, float* y,
                      int64_t B, int64_t T, int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv) {
#ifdef PQK_DELTA_NT
  // Decode's path for each token must be the NT kernel (as gated_delta with T = 1 picks it).
  for (int64_t t = 0; t < T; t++) {
    const DeltaArgs one{q, k, v, g, beta, state_in, slots[t], y, B, 1, Hk, Hv, Dk, Dv};
    if (!use_nt(one)) return false;
  }
  if (detail::gated_delta_prefill_ok(1, Dk, Dv) && std::string(isa()) == "avx512") return false;
  const DeltaArgs a{q, k, v, g, beta, state_in, nullptr, y, B, T, Hk, Hv, Dk, Dv};
  const int64_t state_bytes = B * Hv * Dv * Dk * 4;
  parallel_for(B * Hv, state_bytes < (1 << 20),
               [&a, slots](int64_t i) { delta_head_rows_nt(a, slots, i / a.Hv, i % a.Hv); });
  return true;
#else
  (void)q, (void)k, (void)v, (void)g, (void)beta, (void)state_in, (void)slots, (void)y, (void)B;
  (void)T, (void)Hk, (void)Hv, (void)Dk, (void)Dv;
  return false;
#endif
}

}  // namespace pqk
