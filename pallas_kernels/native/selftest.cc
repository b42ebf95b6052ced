// Standalone check of every instruction-set path this CPU runs (no jaxlib, no FFI): each path's kernels (api.h)
// against straightforward double-precision references, on pseudo-random inputs from fixed seeds, serially and
// with helper threads. Built by pallas_kernels/native.py `build_selftest`, also for aarch64 with a cross compiler,
// so the NEON paths run under qemu on an x86-64 machine (tests/test_native_selftest.py).
//
//   selftest [--every=N] [isa ...]   only those paths; --every=N: every Nth case of each kernel (an emulated run that
//                                    only shows which paths a CPU runs); exit 0 iff at least one path ran and every
//                                    check on every path passed
#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "api.h"

namespace meshserve {
namespace {

// splitmix64: the same inputs on every machine and compiler.
struct Rng {
  uint64_t s;
  uint64_t Next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  float Uniform(float lo, float hi) { return lo + (hi - lo) * static_cast<float>(Next() >> 40) * 0x1p-24f; }
};

uint16_t ToBf16(float f) {  // round to nearest even (inputs are finite)
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return static_cast<uint16_t>((b + 0x7FFF + ((b >> 16) & 1)) >> 16);
}
float FromBf16(uint16_t h) {
  const uint32_t b = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// A tensor as the kernels take it: float32, or bfloat16 as bits. Outputs start as NaN, so an element a kernel
// never writes fails its check.
struct Buf {
  Dt dt;
  std::vector<float> f;
  std::vector<uint16_t> h;
  Buf(Dt t, size_t n) : dt(t) {
    if (t == Dt::kF32) f.assign(n, NAN);
    else h.assign(n, 0x7FC0);
  }
  void* data() { return dt == Dt::kF32 ? static_cast<void*>(f.data()) : static_cast<void*>(h.data()); }
  const void* data() const { return const_cast<Buf*>(this)->data(); }
  double At(size_t i) const { return dt == Dt::kF32 ? f[i] : FromBf16(h[i]); }
  void Set(size_t i, float v) {
    if (dt == Dt::kF32) f[i] = v;
    else h[i] = ToBf16(v);
  }
  void CopyFrom(size_t dst, const Buf& src, size_t i) {  // exact: same dtype
    if (dt == Dt::kF32) f[dst] = src.f[i];
    else h[dst] = src.h[i];
  }
};

Buf Random(Dt dt, size_t n, Rng& rng, float scale = 1) {
  Buf b(dt, n);
  for (size_t i = 0; i < n; ++i) b.Set(i, rng.Uniform(-scale, scale));
  return b;
}

const char* DtName(Dt dt) { return dt == Dt::kF32 ? "f32" : "bf16"; }

// A kernel's worst error over its checks, in units of the tolerance (above 1 fails), and where it was.
struct Worst {
  double ratio = 0;
  std::string where;
  void Near(double got, double want, double rtol, double atol, const std::string& ctx, size_t i) {
    const double err = std::fabs(got - want), r = err <= INFINITY ? err / (atol + rtol * std::fabs(want)) : INFINITY;
    if (!(r <= ratio)) {  // NaN counts as the worst
      char s[160];
      std::snprintf(s, sizeof s, " element %zu: got %.9g, want %.9g (|err| %.3g = %.3g x tolerance)", i, got, want,
                    err, r);
      ratio = r;
      where = ctx + s;
    }
  }
  void Fail(const std::string& why) {  // the first failure is reported
    if (ratio == INFINITY) return;
    ratio = INFINITY;
    where = why;
  }
  bool ok() const { return ratio <= 1; }
};

// float32 out: accumulation error only; bfloat16 out: one rounding (2^-8 relative) of the float32 result.
// Products of bfloat16 are exact in float32, so bfloat16 in with float32 out is as tight as float32.
void Compare(Worst& worst, const Buf& got, const std::vector<double>& want, const std::string& ctx) {
  const double rtol = got.dt == Dt::kF32 ? 1e-5 : 0x1p-8, atol = got.dt == Dt::kF32 ? 1e-4 : 1e-3;
  for (size_t i = 0; i < want.size(); ++i) worst.Near(got.At(i), want[i], rtol, atol, ctx, i);
}

// A runner whose helpers are fresh threads, joined after the call: the kernels' work sharing under real
// concurrency (threads = 1 is the serial runner).
struct Threads {
  std::vector<std::thread> started;
  static void Schedule(void* pool, void (*task)(void*), void* arg) {
    static_cast<Threads*>(pool)->started.emplace_back(task, arg);  // only the calling thread schedules
  }
};
constexpr int kThreadCounts[] = {1, 3};

// --every=N: each kernel checks its cases 0, N, 2N, ... (1: all of them).
int g_every = 1;
bool Sampled(int64_t& n) { return n++ % g_every == 0; }

// A reference computed once per case and reused by every path (the inputs are a function of the case): under qemu the
// double-precision references cost as much as the kernels. One map per call site (`compute` is its own lambda type).
template <typename T, typename F>
const T& Memo(const std::string& key, F&& compute) {
  static std::map<std::string, T> done;
  auto it = done.find(key);
  if (it == done.end()) it = done.emplace(key, compute()).first;
  return it->second;
}

template <typename F>
void Call(int threads, F&& kernel) {
  Threads pool;
  kernel(threads > 1 ? Runner{&pool, threads, Threads::Schedule} : Runner{nullptr, 1, nullptr});
  for (auto& t : pool.started) t.join();
}

std::string Case(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string Case(const char* fmt, ...) {
  char s[200];
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(s, sizeof s, fmt, args);
  va_end(args);
  return s;
}

std::vector<double> RefMatmul(const Buf& x, const Buf& w, int64_t M, int64_t K, int64_t N) {
  std::vector<double> o(M * N, 0.0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k)
      for (int64_t n = 0; n < N; ++n) o[m * N + n] += x.At(m * K + k) * w.At(k * N + n);
  return o;
}

// The combinations the kernels take: f32 -> f32, bf16 -> bf16, bf16 -> f32.
constexpr Dt kDtypes[3][2] = {{Dt::kF32, Dt::kF32}, {Dt::kBf16, Dt::kBf16}, {Dt::kBf16, Dt::kF32}};

Worst CheckMatmul(const Kernels& k) {
  Worst worst;
  int64_t n = 0;
  const int64_t kKN[][2] = {{1, 20}, {33, 130}, {64, 48}, {127, 200}};  // odd K, N not a multiple of 16
  for (const auto& dts : kDtypes)
    for (const auto& kn : kKN)
      for (int64_t M : {1, 3, 8, 13, 17}) {
        if (!Sampled(n)) continue;
        const int64_t K = kn[0], N = kn[1];
        Rng rng{static_cast<uint64_t>(M * 100003 + K * 1009 + N)};
        const Buf x = Random(dts[0], M * K, rng), w = Random(dts[0], K * N, rng);
        const std::vector<double>& want = Memo<std::vector<double>>(
            Case("%s %lld %lld %lld", DtName(dts[0]), (long long)M, (long long)K, (long long)N),
            [&] { return RefMatmul(x, w, M, K, N); });
        for (int threads : kThreadCounts) {
          Buf o(dts[1], M * N);
          Call(threads, [&](const Runner& run) {
            k.matmul(run, dts[0], dts[1], x.data(), M, K, w.data(), N, o.data());
          });
          Compare(worst, o, want,
                  Case("%s->%s M=%lld K=%lld N=%lld threads=%d", DtName(dts[0]), DtName(dts[1]), (long long)M,
                       (long long)K, (long long)N, threads));
        }
      }
  return worst;
}

// pallas_kernels/native.py `_panels` of w[K, N]: f32 [N/32, K, 32, 1]; bf16 [N/64, Kp/2, 64, 2] with K zero-padded
// to Kp (a multiple of 32) and rows k, k+1 of a column side by side. `kw`: K rows held.
Buf Pack(const Buf& w, int64_t K, int64_t N, int64_t* kw) {
  if (w.dt == Dt::kF32) {
    Buf p(Dt::kF32, K * N);
    for (int64_t k = 0; k < K; ++k)
      for (int64_t n = 0; n < N; ++n) p.CopyFrom((n / 32 * K + k) * 32 + n % 32, w, k * N + n);
    *kw = K;
    return p;
  }
  const int64_t kp = (K + 31) / 32 * 32;
  Buf p(Dt::kBf16, kp * N);
  std::fill(p.h.begin(), p.h.end(), 0);
  for (int64_t k = 0; k < K; ++k)
    for (int64_t n = 0; n < N; ++n) p.CopyFrom(((n / 64 * (kp / 2) + k / 2) * 64 + n % 64) * 2 + k % 2, w, k * N + n);
  *kw = kp;
  return p;
}

Worst CheckPacked(const Kernels& k) {
  Worst worst;
  int64_t n = 0;
  for (const auto& dts : kDtypes)
    for (int64_t K : {1, 33, 64, 100})
      for (int64_t N : {64, 192})  // whole panels (64: one bf16 panel, two f32 ones)
        for (int64_t M : {1, 2, 3, 5, 7, 16, 30, 40}) {  // from 24 rows the widened-panel path (no bf16 pairs)
          if (!Sampled(n)) continue;
          Rng rng{static_cast<uint64_t>(7 + M * 100003 + K * 1009 + N)};
          Buf x = Random(dts[0], M * K, rng), w = Random(dts[0], K * N, rng);
          int64_t kw;
          Buf p = Pack(w, K, N, &kw);
          const int64_t panels = N / (dts[0] == Dt::kF32 ? 32 : 64);
          const std::vector<double>& want = Memo<std::vector<double>>(
              Case("%s %lld %lld %lld", DtName(dts[0]), (long long)M, (long long)K, (long long)N),
              [&] { return RefMatmul(x, w, M, K, N); });
          for (int threads : kThreadCounts) {
            Buf o(dts[1], M * N);
            Call(threads, [&](const Runner& run) {
              k.matmul_packed(run, dts[0], dts[1], x.data(), M, K, p.data(), panels, kw, o.data());
            });
            Compare(worst, o, want,
                    Case("%s->%s M=%lld K=%lld N=%lld threads=%d", DtName(dts[0]), DtName(dts[1]), (long long)M,
                         (long long)K, (long long)N, threads));
          }
        }
  return worst;
}

// pallas_kernels/native.py `_panels` of int8 w[K, N]: [N/64, Kp/4, 64, 4], K zero-padded to Kp (a multiple of 4) and
// rows k..k+3 of a column side by side.
std::vector<int8_t> PackInt8(const std::vector<int8_t>& w, int64_t K, int64_t N) {
  const int64_t kp = (K + 3) / 4 * 4;
  std::vector<int8_t> p(kp * N, 0);
  for (int64_t k = 0; k < K; ++k)
    for (int64_t n = 0; n < N; ++n) p[((n / 64 * (kp / 4) + k / 4) * 64 + n % 64) * 4 + k % 4] = w[k * N + n];
  return p;
}

// x @ (w * scale), scale [G, N] per group of K/G rows: float32 accumulation error (1e-5 of sum |x| |w| s), plus for
// the dot method x's two-digit rounding, |x - x~| <= max|x_row| / 127 / 508 per element, times sum |w| s; bfloat16
// out: one rounding more.
Worst CheckInt8(const Kernels& k) {
  Worst worst;
  int64_t n = 0;
  struct Shape {
    int64_t K, N, G;
    bool packed;
  };
  // Odd K (padded to quads when packed), N not whole vectors (row-major), groups of 64, 32 and 10 rows.
  const Shape shapes[] = {{33, 64, 1, true}, {256, 128, 4, true}, {96, 192, 3, true}, {1, 64, 1, true},
                          {33, 130, 1, false}, {30, 70, 3, false}, {128, 48, 2, false}};
  for (const auto& dts : kDtypes)
    for (const Shape& sh : shapes)
      for (int64_t M : {1, 3, 8, 13, 17, 40, 230}) {  // (many rows: widened panels; 230: two blocks of rows)
        if (!Sampled(n)) continue;
        const int64_t K = sh.K, N = sh.N, G = sh.G;
        Rng rng{static_cast<uint64_t>(11 + M * 100003 + K * 1009 + N * 7 + G)};
        const Buf x = Random(dts[0], M * K, rng);
        std::vector<int8_t> w(K * N);
        for (auto& v : w) v = static_cast<int8_t>(static_cast<int>(rng.Next() % 255) - 127);
        std::vector<float> scale(G * N);
        for (auto& v : scale) v = rng.Uniform(0.5f, 1.5f) / 127;
        struct Ref {
          std::vector<double> want, mag, digits;
        };
        const Ref& ref = Memo<Ref>(
            Case("%s %lld %lld %lld %lld", DtName(dts[0]), (long long)M, (long long)K, (long long)N, (long long)G),
            [&] {
              Ref r{std::vector<double>(M * N, 0.0), std::vector<double>(M * N, 0.0), std::vector<double>(M * N, 0.0)};
              for (int64_t m = 0; m < M; ++m) {
                double amax = 0;
                for (int64_t i = 0; i < K; ++i) amax = std::max(amax, std::fabs(x.At(m * K + i)));
                for (int64_t i = 0; i < K; ++i)
                  for (int64_t j = 0; j < N; ++j) {
                    const double s = scale[i / (K / G) * N + j], ws = w[i * N + j] * s, xv = x.At(m * K + i);
                    r.want[m * N + j] += xv * ws;
                    r.mag[m * N + j] += std::fabs(xv * ws);
                    r.digits[m * N + j] += amax / 127 / 508 * std::fabs(ws);
                  }
              }
              return r;
            });
        const std::vector<double>& want = ref.want;
        const std::vector<double>& mag = ref.mag;
        const std::vector<double>& digits = ref.digits;
        const std::vector<int8_t> wk = sh.packed ? PackInt8(w, K, N) : w;
        for (int32_t method : {kInt8Widen, kInt8Dot}) {
          if (method == kInt8Dot && !(sh.packed && k.int8_dot())) continue;
          for (int threads : kThreadCounts) {
            Buf o(dts[1], M * N);
            Call(threads, [&](const Runner& run) {
              k.matmul_int8(run, dts[0], dts[1], x.data(), M, K, wk.data(), N, sh.packed, scale.data(), G, method,
                            o.data());
            });
            const std::string ctx =
                Case("%s->%s %s M=%lld K=%lld N=%lld G=%lld %s threads=%d", DtName(dts[0]), DtName(dts[1]),
                     sh.packed ? "packed" : "row-major", (long long)M, (long long)K, (long long)N, (long long)G,
                     method == kInt8Dot ? "dot" : "widen", threads);
            for (int64_t i = 0; i < M * N; ++i) {
              double tol = 1e-5 * mag[i] + 1e-6 + (method == kInt8Dot ? digits[i] : 0);
              if (dts[1] == Dt::kBf16) tol += 0x1p-8 * std::fabs(want[i]);
              worst.Near(o.At(i), want[i], 0, tol, ctx, i);
            }
          }
        }
      }
  return worst;
}

// pallas_kernels/reference.py: token i of sequence s sits at kv_lens[s] - q_len + i and sees the keys at or before
// it (and after it minus the window); kv pages [P, page_size, 2 Hkv, D], K of head h at 2h, V at 2h + 1; rows of
// tokens past cu[num_seqs] are zero.
struct AttnCase {
  AttnShape a;
  int64_t t, num_seqs;
  std::vector<int32_t> kv_lens, pages, cu;
};

std::vector<double> RefAttention(const AttnCase& c, const Buf& q, const Buf& kv) {
  const AttnShape& a = c.a;
  const int64_t g = a.hq / a.hkv;
  std::vector<double> out(c.t * a.hq * a.d, 0.0), s;
  for (int64_t tok = 0; tok < c.cu[c.num_seqs]; ++tok) {
    int64_t seq = 0;
    while (c.cu[seq + 1] <= tok) ++seq;
    const int64_t kv_len = c.kv_lens[seq], pos = kv_len - (c.cu[seq + 1] - c.cu[seq]) + (tok - c.cu[seq]);
    for (int64_t h = 0; h < a.hq; ++h) {
      auto key = [&](int64_t p, int half, int64_t e) {  // half 0: K, 1: V
        const int64_t page = c.pages[seq * a.max_pages + p / a.page_size];
        return kv.At((((page * a.page_size + p % a.page_size) * 2 * a.hkv) + 2 * (h / g) + half) * a.d + e);
      };
      double m = -INFINITY;
      s.assign(kv_len, -INFINITY);
      for (int64_t p = 0; p < kv_len; ++p) {
        if (p > pos || (a.window > 0 && p <= pos - a.window)) continue;
        double dot = 0;
        for (int64_t e = 0; e < a.d; ++e) dot += q.At((tok * a.hq + h) * a.d + e) * key(p, 0, e);
        s[p] = dot * a.sm_scale;
        if (a.soft_cap > 0) s[p] = a.soft_cap * std::tanh(s[p] / a.soft_cap);
        m = std::max(m, s[p]);
      }
      double sum = 0;
      double* o = &out[(tok * a.hq + h) * a.d];
      for (int64_t p = 0; p < kv_len; ++p) {
        if (s[p] == -INFINITY) continue;
        const double wgt = std::exp(s[p] - m);
        sum += wgt;
        for (int64_t e = 0; e < a.d; ++e) o[e] += wgt * key(p, 1, e);
      }
      if (a.sinks) sum += std::exp(a.sinks[h] - m);  // the sink: in the denominator only (no keys: 0 / inf)
      for (int64_t e = 0; e < a.d; ++e) o[e] = sum > 0 ? o[e] / sum : 0;
    }
  }
  return out;
}

Worst CheckAttention(const Kernels& k) {
  Worst worst;
  int64_t n = 0;
  // A decode token, a first prefill chunk of 70 tokens (two query blocks, two key chunks), and 5 tokens after 78
  // cached ones; 4 padding tokens; a fourth sequence slot past num_seqs.
  AttnCase c;
  c.a = AttnShape{4, 2, 32, 4, 21, static_cast<float>(1 / std::sqrt(32.0)), 0, 0};
  c.t = 80;
  c.num_seqs = 3;
  c.kv_lens = {9, 70, 83, 0};
  c.cu = {0, 1, 71, 76, 76};
  const int64_t num_pages = 72;
  std::vector<int32_t> perm(num_pages);
  Rng rng{42};
  for (int64_t i = 0; i < num_pages; ++i) perm[i] = static_cast<int32_t>(i);
  for (int64_t i = num_pages - 1; i > 0; --i) std::swap(perm[i], perm[rng.Next() % (i + 1)]);  // scattered pages
  c.pages.assign(4 * c.a.max_pages, 0);
  for (int64_t i = 0, used = 0; i < 4; ++i)
    for (int64_t p = 0; p < (c.kv_lens[i] + 3) / 4; ++p) c.pages[i * c.a.max_pages + p] = perm[used++];
  for (Dt dt : {Dt::kF32, Dt::kBf16}) {
    const Buf q = Random(dt, c.t * c.a.hq * c.a.d, rng, 2), kv = Random(dt, num_pages * 4 * 4 * c.a.d, rng, 2);
    // GPT-OSS's sinks (a logit per query head, from far below the scores to far above), with the window
    const float sink_logits[] = {-30.0f, 0.5f, 2.0f, 30.0f};
    for (int64_t window : {0, 16})
      for (float cap : {0.0f, 2.0f, -1.0f}) {  // -1: no cap, with sinks
        if (!Sampled(n)) continue;
        c.a.window = window;
        c.a.soft_cap = cap < 0 ? 0.0f : cap;
        c.a.sinks = cap < 0 ? sink_logits : nullptr;
        const std::vector<double>& want = Memo<std::vector<double>>(
            Case("%s %lld %g", DtName(dt), (long long)window, cap), [&] { return RefAttention(c, q, kv); });
        for (int threads : kThreadCounts) {
          Buf o(dt, c.t * c.a.hq * c.a.d);
          Call(threads, [&](const Runner& run) {
            k.attention(run, dt, KvFormat::kAsQuery, c.a, c.t, q.data(), kv.data(), nullptr,
                        c.kv_lens.data(), c.pages.data(), c.cu.data(), c.num_seqs, o.data());
          });
          Compare(worst, o, want,
                  Case("%s window=%lld soft_cap=%g sinks=%d threads=%d", DtName(dt), (long long)window,
                       c.a.soft_cap, c.a.sinks != nullptr, threads));
        }
      }
  }
  return worst;
}

// Latent (multi-head latent attention) cache (mla.h; pallas_kernels/mla.py): one row of D values per token that every
// head reads, scores over the whole row, values its first Dv; token i of sequence s at kv_lens[s] - q_len + i sees
// the rows at or before it. The cache in q's dtype, or quantized: int8 or float8_e4m3 bits with a scale per row
// (the reference reads the dequantized values). Heads past kLatentRows (80) make units of head blocks.
Worst CheckLatentAttention(const Kernels& k) {
  Worst worst;
  int64_t n = 0;
  struct Shape {
    int64_t h, d, dv;
  };
  const int64_t t = 80, num_seqs = 3, page_size = 4, max_pages = 21, num_pages = 72;
  const std::vector<int32_t> kv_lens = {9, 70, 83, 0}, cu = {0, 1, 71, 76, 76};
  std::vector<int32_t> perm(num_pages), pages(4 * max_pages, 0);
  Rng rng{43};
  for (int64_t i = 0; i < num_pages; ++i) perm[i] = static_cast<int32_t>(i);
  for (int64_t i = num_pages - 1; i > 0; --i) std::swap(perm[i], perm[rng.Next() % (i + 1)]);
  for (int64_t i = 0, used = 0; i < 4; ++i)
    for (int64_t p = 0; p < (kv_lens[i] + page_size - 1) / page_size; ++p) pages[i * max_pages + p] = perm[used++];
  const int64_t rows = num_pages * page_size;
  for (const Shape sh : {Shape{4, 48, 32}, Shape{80, 32, 16}})
    for (Dt dt : {Dt::kF32, Dt::kBf16})
      for (KvFormat format : {KvFormat::kAsQuery, KvFormat::kInt8, KvFormat::kE4m3}) {
        if (!Sampled(n)) continue;
        const LatentShape a{sh.h, sh.d, sh.dv, page_size, max_pages, static_cast<float>(1 / std::sqrt(48.0))};
        const Buf q = Random(dt, t * a.h * a.d, rng, 2);
        Buf cache = Random(dt, rows * a.d, rng, 2);
        std::vector<int8_t> bytes(rows * a.d);
        std::vector<float> scales(rows);
        std::vector<double> value(rows * a.d);  // what the kernel must read
        for (int64_t r = 0; r < rows; ++r) {
          scales[r] = rng.Uniform(0.5f, 2.0f) / 64;
          for (int64_t e = 0; e < a.d; ++e) {
            const int64_t i = r * a.d + e;
            if (format == KvFormat::kInt8) {
              bytes[i] = static_cast<int8_t>(static_cast<int>(rng.Next() % 255) - 127);
              value[i] = bytes[i] * double{scales[r]};
            } else if (format == KvFormat::kE4m3) {
              uint8_t b = static_cast<uint8_t>(rng.Next());
              if ((b & 0x7F) == 0x7F) b ^= 1;  // never a NaN encoding (quantisation saturates at 448)
              bytes[i] = static_cast<int8_t>(b);
              const int mag = b & 0x7F, ex = mag >> 3, man = mag & 7;
              const double x = ex ? std::ldexp(1 + man / 8.0, ex - 7) : std::ldexp(man / 8.0, -6);
              value[i] = (b & 0x80 ? -x : x) * scales[r];
            } else {
              value[i] = cache.At(i);
            }
          }
        }
        const std::vector<double>& want = Memo<std::vector<double>>(
            Case("%s %d %lld %lld %lld", DtName(dt), static_cast<int>(format), (long long)a.h, (long long)a.d,
                 (long long)a.dv),
            [&] {
              std::vector<double> want(t * a.h * a.dv, 0.0), s;
              for (int64_t tok = 0; tok < cu[num_seqs]; ++tok) {
                int64_t seq = 0;
                while (cu[seq + 1] <= tok) ++seq;
                const int64_t kv_len = kv_lens[seq], pos = kv_len - (cu[seq + 1] - cu[seq]) + (tok - cu[seq]);
                auto row = [&](int64_t p) {
                  return (pages[seq * max_pages + p / page_size] * page_size + p % page_size) * a.d;
                };
                for (int64_t h = 0; h < a.h; ++h) {
                  double m = -INFINITY, sum = 0;
                  s.assign(pos + 1, 0.0);
                  for (int64_t p = 0; p <= pos; ++p) {
                    double dot = 0;
                    for (int64_t e = 0; e < a.d; ++e) dot += q.At((tok * a.h + h) * a.d + e) * value[row(p) + e];
                    s[p] = dot * a.sm_scale;
                    m = std::max(m, s[p]);
                  }
                  double* o = &want[(tok * a.h + h) * a.dv];
                  for (int64_t p = 0; p <= pos; ++p) {
                    const double w = std::exp(s[p] - m);
                    sum += w;
                    for (int64_t e = 0; e < a.dv; ++e) o[e] += w * value[row(p) + e];
                  }
                  for (int64_t e = 0; e < a.dv; ++e) o[e] /= sum;
                }
              }
              return want;
            });
        const void* data = format == KvFormat::kAsQuery ? cache.data() : static_cast<const void*>(bytes.data());
        const float* sc = format == KvFormat::kAsQuery ? nullptr : scales.data();
        for (int threads : kThreadCounts) {
          Buf o(dt, t * a.h * a.dv);
          Call(threads, [&](const Runner& run) {
            k.latent_attention(run, dt, format, a, t, q.data(), data, sc, kv_lens.data(), pages.data(), cu.data(),
                               num_seqs, o.data());
          });
          Compare(worst, o, want,
                  Case("%s cache=%d H=%lld D=%lld Dv=%lld threads=%d", DtName(dt), static_cast<int>(format),
                       (long long)a.h, (long long)a.d, (long long)a.dv, threads));
        }
      }
  return worst;
}

// pallas_kernels/native.py `greedy_head_screen` of the head as [N, K]: q [N, Kq] (Kq: K rounded up to 64), each
// row's scale s_j and bound c_j = (||w_j - s_j q_j|| + gamma ||s_j q_j||)(1 + 1e-6), rounded up to float32.
struct Screen {
  int64_t kq;
  std::vector<int8_t> q;
  std::vector<float> scale, bound;
};

Screen MakeScreen(const Buf& head_nk, int64_t N, int64_t K) {
  Screen s{(K + 63) / 64 * 64, {}, std::vector<float>(N), std::vector<float>(N)};
  s.q.assign(N * s.kq, 0);
  const double u = 0x1p-24, gamma = (s.kq + 2) * u / (1 - (s.kq + 2) * u);
  for (int64_t j = 0; j < N; ++j) {
    double amax = 0;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(head_nk.At(j * K + k)));
    float scale = static_cast<float>(amax / 127);
    if (!(scale > 0)) scale = 1;
    double err2 = 0, approx2 = 0;
    for (int64_t k = 0; k < K; ++k) {
      const double w = head_nk.At(j * K + k);
      const double qi = std::min(127.0, std::max(-127.0, std::nearbyint(w / scale)));  // half to even, as np.rint
      const double approx = qi * scale;
      err2 += (w - approx) * (w - approx);
      approx2 += approx * approx;
      s.q[j * s.kq + k] = static_cast<int8_t>(qi);
    }
    const double c = (std::sqrt(err2) + gamma * std::sqrt(approx2)) * (1 + 1e-6);
    float c32 = static_cast<float>(c);
    if (static_cast<double>(c32) < c) c32 = std::nextafter(c32, INFINITY);
    s.scale[j] = scale;
    s.bound[j] = c32;
  }
  return s;
}

Worst CheckGreedyHead(const Kernels& k) {
  Worst worst;
  int64_t n = 0;
  const int64_t N = 704;  // whole f32 and bf16 panels
  for (Dt dt : {Dt::kF32, Dt::kBf16})
    for (int64_t K : {64, 100}) {
      if (!Sampled(n)) continue;
      const int64_t max_rows = 6;  // 1..4 in one screening pass, 6 in two
      Rng rng{static_cast<uint64_t>(K * 31 + (dt == Dt::kBf16))};
      Buf x = Random(dt, max_rows * K, rng), head = Random(dt, N * K, rng);
      auto logits = [&](int64_t r) {
        std::vector<double> l(N, 0.0);
        for (int64_t j = 0; j < N; ++j)
          for (int64_t e = 0; e < K; ++e) l[j] += x.At(r * K + e) * head.At(j * K + e);
        return l;
      };
      // A tie: row 0's winner copied to a lower id, which must then win.
      const std::vector<double> l0 = logits(0);
      const int64_t best = std::max_element(l0.begin(), l0.end()) - l0.begin();
      for (int64_t e = 0; e < K; ++e) head.CopyFrom(best / 2 * K + e, head, best * K + e);
      std::vector<int32_t> want(max_rows);
      for (int64_t r = 0; r < max_rows; ++r) {
        const std::vector<double> l = logits(r);
        want[r] = static_cast<int32_t>(std::max_element(l.begin(), l.end()) - l.begin());  // the first maximum
      }
      const Screen s = MakeScreen(head, N, K);
      Buf kn(dt, K * N);  // [K, N]
      for (int64_t j = 0; j < N; ++j)
        for (int64_t e = 0; e < K; ++e) kn.CopyFrom(e * N + j, head, j * K + e);
      int64_t kw;
      Buf packed = Pack(kn, K, N, &kw);
      const int64_t panel = dt == Dt::kF32 ? 32 : 64;
      for (int32_t layout : {0, 1, 2}) {
        Buf& w = layout == 0 ? packed : layout == 1 ? kn : head;
        const HeadWeight hw{w.data(), dt == Dt::kBf16, layout, K, N, layout == 0 ? kw * panel : 0};
        for (int64_t rows : {1, 2, 3, 4, 6})
          for (int threads : kThreadCounts) {
            std::vector<int32_t> tokens(rows, -1), cands(rows, -1);
            Call(threads, [&](const Runner& run) {
              k.greedy_head(run, dt, x.data(), rows, K, s.kq, s.q.data(), s.scale.data(), s.bound.data(), hw,
                            tokens.data(), cands.data());
            });
            for (int64_t r = 0; r < rows; ++r)
              if (tokens[r] != want[r] || cands[r] < 1 || cands[r] > N)
                worst.Fail(Case("%s layout=%d K=%lld rows=%lld threads=%d row %lld: token %d (%d candidates), want %d",
                                DtName(dt), layout, (long long)K, (long long)rows, threads, (long long)r, tokens[r],
                                cands[r], want[r]));
          }
      }
    }
  return worst;
}

// One stack of experts' weights, [S, K, N]: float in the check's dtype (`f`) or int8 (`q`) with a scale per slot
// and output column, and the values the reference reads (double).
struct ExpertStack {
  Buf f{Dt::kF32, 0};
  std::vector<int8_t> q;
  std::vector<float> scale;  // int8: [S, N]
  std::vector<double> v;
  const void* data() const { return q.empty() ? f.data() : static_cast<const void*>(q.data()); }
  const float* scales() const { return scale.empty() ? nullptr : scale.data(); }
};

ExpertStack RandomExperts(Dt dt, bool int8, int64_t S, int64_t K, int64_t N, Rng& rng) {
  ExpertStack w;
  w.v.resize(S * K * N);
  if (!int8) {
    w.f = Random(dt, S * K * N, rng, 2 / std::sqrt(static_cast<float>(K)));
    for (int64_t i = 0; i < S * K * N; ++i) w.v[i] = w.f.At(i);
    return w;
  }
  w.q.resize(S * K * N);
  w.scale.resize(S * N);
  for (auto& e : w.q) e = static_cast<int8_t>(static_cast<int>(rng.Next() % 255) - 127);
  for (auto& e : w.scale) e = rng.Uniform(0.5f, 1.5f) / 127 / std::sqrt(static_cast<float>(K));
  for (int64_t i = 0; i < S * K * N; ++i) w.v[i] = w.q[i] * double{w.scale[i / (K * N) * N + i % N]};
  return w;
}

// The stack packed slot by slot in the packed matmuls' layouts (`Pack` / `PackInt8`); kp: K as the layout pads it.
ExpertStack PackSlots(const ExpertStack& w, int64_t S, int64_t K, int64_t N, int64_t* kp) {
  ExpertStack out;
  out.f = Buf(w.f.dt, 0);
  out.scale = w.scale;
  for (int64_t s = 0; s < S; ++s) {
    if (!w.q.empty()) {
      const std::vector<int8_t> p = PackInt8({w.q.begin() + s * K * N, w.q.begin() + (s + 1) * K * N}, K, N);
      out.q.insert(out.q.end(), p.begin(), p.end());
      *kp = (K + 3) / 4 * 4;
    } else {
      Buf one(w.f.dt, K * N);
      for (int64_t i = 0; i < K * N; ++i) one.CopyFrom(i, w.f, s * K * N + i);
      const Buf p = Pack(one, K, N, kp);
      out.f.f.insert(out.f.f.end(), p.f.begin(), p.f.end());
      out.f.h.insert(out.f.h.end(), p.h.begin(), p.h.end());
    }
  }
  return out;
}

// Expert MLP (moe.h): y[t] = sum_k w[t, k] * down_s(silu(x[t] @ gate_s) * (x[t] @ up_s)), s = slots[t, k] (none
// where s < 0 or >= S), experts row-major (gate/up [S, E, I], down [S, I, E]) or packed slot by slot
// (`PackSlots`), float in x's dtype or int8 with a scale per slot and output channel. Tolerance: float32
// accumulation (1e-4 of the magnitudes along the chain); bfloat16 adds h rounded to bfloat16 before down (the pair
// dot products' path) and the output's one rounding.
Worst CheckExpertMlp(const Kernels& k) {
  Worst worst;
  int64_t n = 0;
  const int64_t S = 4, topk = 2;
  struct Shape {
    int64_t E, I;
    bool packed;
  };
  const Shape shapes[] = {{64, 128, true}, {128, 64, true}, {40, 72, false}, {64, 128, false}};
  for (Dt dt : {Dt::kF32, Dt::kBf16})
    for (bool int8 : {false, true})
      for (const Shape& sh : shapes)
        for (int64_t T : {1, 3, 9}) {
          if (!Sampled(n)) continue;
          const int64_t E = sh.E, I = sh.I;
          Rng rng{static_cast<uint64_t>(E * 7919 + I * 31 + T * 3 + int8 * 2 + (dt == Dt::kBf16))};
          const Buf x = Random(dt, T * E, rng);
          std::vector<int32_t> slots(T * topk);
          std::vector<float> wts(T * topk);
          for (int64_t i = 0; i < T * topk; ++i) {
            slots[i] = static_cast<int32_t>(rng.Next() % (S + 2)) - 1;  // -1 and S: no expert
            wts[i] = rng.Uniform(0.1f, 1);
          }
          ExpertStack gate = RandomExperts(dt, int8, S, E, I, rng), up = RandomExperts(dt, int8, S, E, I, rng),
                      down = RandomExperts(dt, int8, S, I, E, rng);
          struct Ref {
            std::vector<double> want, mag;
          };
          const Ref& ref = Memo<Ref>(
              Case("%s %d %lld %lld %lld %d", DtName(dt), int8, (long long)E, (long long)I, (long long)T, sh.packed),
              [&] {
                std::vector<double> want(T * E, 0.0), mag(T * E, 0.0);
                for (int64_t t = 0; t < T; ++t)
                  for (int64_t j = 0; j < topk; ++j) {
                    const int64_t s = slots[t * topk + j];
                    if (s < 0 || s >= S) continue;
                    std::vector<double> h(I);
                    for (int64_t i = 0; i < I; ++i) {
                      double g = 0, u = 0;
                      for (int64_t e = 0; e < E; ++e) {
                        g += x.At(t * E + e) * gate.v[(s * E + e) * I + i];
                        u += x.At(t * E + e) * up.v[(s * E + e) * I + i];
                      }
                      h[i] = g / (1 + std::exp(-g)) * u;
                    }
                    for (int64_t e = 0; e < E; ++e)
                      for (int64_t i = 0; i < I; ++i) {
                        want[t * E + e] += wts[t * topk + j] * h[i] * down.v[(s * I + i) * E + e];
                        mag[t * E + e] += wts[t * topk + j] * std::fabs(h[i] * down.v[(s * I + i) * E + e]);
                      }
                  }
                return Ref{want, mag};
              });
          const std::vector<double>& want = ref.want;
          const std::vector<double>& mag = ref.mag;
          int64_t kpe = 0, kpi = 0;  // 0: row-major
          if (sh.packed) {
            gate = PackSlots(gate, S, E, I, &kpe);
            up = PackSlots(up, S, E, I, &kpe);
            down = PackSlots(down, S, I, E, &kpi);
          }
          for (int threads : kThreadCounts) {
            Buf o(dt, T * E);
            Call(threads, [&](const Runner& run) {
              k.expert_mlp(run, dt, x.data(), T, E, slots.data(), wts.data(), topk, gate.data(), up.data(),
                           down.data(), gate.scales(), up.scales(), down.scales(), S, I, kpe, kpi, o.data());
            });
            const std::string ctx =
                Case("%s %s %s E=%lld I=%lld T=%lld threads=%d", DtName(dt), int8 ? "int8" : "float",
                     sh.packed ? "packed" : "row-major", (long long)E, (long long)I, (long long)T, threads);
            for (int64_t i = 0; i < T * E; ++i) {
              double tol = 1e-4 * mag[i] + 1e-6;
              if (dt == Dt::kBf16) tol += 0x1p-7 * mag[i] + 0x1p-8 * std::fabs(want[i]);
              worst.Near(o.At(i), want[i], 0, tol, ctx, i);
            }
          }
        }
  return worst;
}

// LoRA update (lora.h): y[t] = (x[t] @ a[s][:r, :]^T) @ b[s][:r, :], s = slots[t], r = ranks[s] (none where s < 0,
// s >= S or r = 0), a [S, R, K] and b [S, R, N] in x's dtype, each slot as a_layout and b_layout say (api.h
// LoraLayout: A in pairs or blocks, B in strips, bfloat16); the rows past a slot's rank hold values the kernel must not
// read (an odd rank's pair reads the row past it, weighted by zero: finite values then change nothing; a block's rows
// past the rank are read and their sums dropped). Tolerance: float32 accumulation; bfloat16 adds the output's one
// rounding, and B in strips on a path with pair dot products x @ A^T's rounding to bfloat16 (2^-9 of each term of the
// sum over the rank: within 2^-8 of `mag`).
void CheckLoraCase(const Kernels& k, Worst& worst, Dt dt, int64_t K, int64_t N, const std::vector<int32_t>& slots,
                   const std::vector<int32_t>& ranks, int64_t R, const char* layout, int32_t a_layout = kLoraRows,
                   int32_t b_layout = kLoraRows) {
  const int64_t T = static_cast<int64_t>(slots.size()), S = static_cast<int64_t>(ranks.size());
  Rng rng{static_cast<uint64_t>(K * 7919 + N * 31 + T * 3 + (dt == Dt::kBf16))};
  const Buf x = Random(dt, T * K, rng), a = Random(dt, S * K * R, rng), b = Random(dt, S * R * N, rng);
  // Element (r, n) of a slot's [R, cols] in each form (pallas_kernels/lora.py to_layout).
  auto in_form = [&](const Buf& w, int64_t cols, int32_t form) {
    Buf out = w;
    for (int64_t s = 0; form != kLoraRows && s < S; ++s)
      for (int64_t r = 0; r < R; ++r)
        for (int64_t n = 0; n < cols; ++n) {
          const int64_t n0 = n / 64 * 64, w0 = std::min<int64_t>(64, cols - n0);
          const int64_t at = form == kLoraPairs    ? (r / 2) * 2 * cols + 2 * n + r % 2
                             : form == kLoraBlocks ? (r / 4) * 4 * cols + (n / 32) * 128 + (r % 4) * 32 + n % 32
                                                   : n0 * R + (r / 2) * 2 * w0 + 2 * (n - n0) + r % 2;
          out.CopyFrom(s * R * cols + at, w, (s * R + r) * cols + n);
        }
    return out;
  };
  const Buf a_in = in_form(a, K, a_layout), b_in = in_form(b, N, b_layout);
  std::vector<double> want(T * N, 0.0), mag(T * N, 0.0);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t s = slots[t];
    if (s < 0 || s >= S) continue;
    for (int64_t r = 0; r < ranks[s]; ++r) {
      double xa = 0, xa_mag = 0;
      for (int64_t kk = 0; kk < K; ++kk) {
        xa += x.At(t * K + kk) * a.At((s * R + r) * K + kk);
        xa_mag += std::fabs(x.At(t * K + kk) * a.At((s * R + r) * K + kk));
      }
      for (int64_t n = 0; n < N; ++n) {
        want[t * N + n] += xa * b.At((s * R + r) * N + n);
        mag[t * N + n] += xa_mag * std::fabs(b.At((s * R + r) * N + n));
      }
    }
  }
  for (int threads : kThreadCounts) {
    Buf o(dt, T * N);
    Call(threads, [&](const Runner& run) {
      const LoraPart part{a_in.data(), b_in.data(), ranks.data(), N, o.data()};
      k.lora(run, dt, x.data(), T, K, slots.data(), &part, 1, a_layout, b_layout, S, R);
    });
    static const char* const kForms[] = {"rows", "pairs", "blocks", "strips"};
    const std::string ctx = Case("%s %s A %s B %s K=%lld N=%lld T=%lld threads=%d", DtName(dt), layout,
                                 kForms[a_layout], kForms[b_layout], (long long)K, (long long)N, (long long)T, threads);
    for (int64_t i = 0; i < T * N; ++i) {
      double tol = 1e-5 * mag[i] + 1e-6;
      if (dt == Dt::kBf16) tol += 0x1p-8 * std::fabs(want[i]);
      if (b_layout == kLoraStrips && k.pair_dot) tol += 0x1p-8 * mag[i];
      worst.Near(o.At(i), want[i], 0, tol, ctx, i);
    }
  }
}

void CheckLoraParts(const Kernels& k, Worst& worst);

Worst CheckLora(const Kernels& k) {
  Worst worst;
  int64_t n = 0;
  // Small calls (under lora.h's kLoraSerialMacs: on the calling thread): tails of K and N, tokens of no slot.
  const std::vector<int32_t> ranks = {24, 5, 0, 17};
  for (Dt dt : {Dt::kF32, Dt::kBf16})
    for (int64_t K : {37, 64})  // 37: a tail of K on every path
      for (int64_t N : {72, 130})
        for (int64_t T : {1, 6, 11}) {
          if (!Sampled(n)) continue;
          Rng rng{static_cast<uint64_t>(T * 977 + K)};
          std::vector<int32_t> slots(T);
          for (int64_t t = 0; t < T; ++t) slots[t] = static_cast<int32_t>(rng.Next() % 6) - 1;  // -1, 4: none
          CheckLoraCase(k, worst, dt, K, N, slots, ranks, 24, "small");
          // The forms: N (B in strips: a whole strip and a narrow one) and K (A in pairs) multiples of 16, K (A in
          // blocks) of 32; ranks 5 and 17 odd and inside a block. B alone: A row-major with K = 37 (its A pass's
          // tail).
          if (dt != Dt::kBf16) continue;
          const int64_t Ns = N + 16 - N % 16;
          if (K % 16 == 0) CheckLoraCase(k, worst, dt, K, Ns, slots, ranks, 24, "small", kLoraPairs, kLoraStrips);
          if (K % 32 == 0 && k.pair_dot)
            CheckLoraCase(k, worst, dt, K, Ns, slots, ranks, 24, "small", kLoraBlocks, kLoraStrips);
          CheckLoraCase(k, worst, dt, K, Ns, slots, ranks, 24, "small", kLoraRows, kLoraStrips);
        }
  // Calls over the threads (past kLoraSerialMacs), both of lora.h's parallel forms at 3 threads: "even", 8 rank-64
  // adapters' tokens (a decode step's mix: one pass, a unit per slot); "skewed", most tokens on one adapter (two
  // passes: A by blocks of rank, B by columns). The layouts are checked to fall on each side of lora.h's rule.
  const int64_t K = 517, N = 530, R = 64;
  const std::vector<int32_t> many(8, R);
  for (const char* layout : {"even", "skewed"}) {
    std::vector<int32_t> slots(48);
    for (int64_t t = 0; t < 48; ++t)
      slots[t] = layout[0] == 'e' || t % 3 == 0 ? static_cast<int32_t>(t % 9) - 1 : 2;
    std::vector<int64_t> macs(8, 0);
    int64_t total = 0;
    for (int32_t s : slots)
      if (s >= 0) macs[s] += R * (K + N), total += R * (K + N);
    const bool one_pass = *std::max_element(macs.begin(), macs.end()) * 2 * 3 <= total;
    if (total < (int64_t{1} << 17) || one_pass != (layout[0] == 'e')) {
      std::fprintf(stderr, "selftest: the LoRA %s layout no longer exercises its parallel form\n", layout);
      std::abort();
    }
    for (Dt dt : {Dt::kF32, Dt::kBf16})
      if (Sampled(n)) CheckLoraCase(k, worst, dt, K, N, slots, many, R, layout);
    const int64_t Ns = N + 16 - N % 16;  // 544: 8 whole strips and a narrow one
    if (Sampled(n))
      CheckLoraCase(k, worst, Dt::kBf16, K + 16 - K % 16, Ns, slots, many, R, layout, kLoraPairs, kLoraStrips);
    if (k.pair_dot && Sampled(n))
      CheckLoraCase(k, worst, Dt::kBf16, K + 32 - K % 32, Ns, slots, many, R, layout, kLoraBlocks, kLoraStrips);
    if (Sampled(n)) CheckLoraCase(k, worst, Dt::kBf16, K, Ns, slots, many, R, layout, kLoraRows, kLoraStrips);
  }
  CheckLoraParts(k, worst);
  return worst;
}

// LoRA of three projections of one x in one call (api.h LoraPart: the engine's q|k|v), each with its own N and
// ranks (a slot one part leaves alone, rank 0, whose rows must come back zero from the NaN the outputs start as):
// each part's output must be bit for bit its own one-part call's, in each form this path reads, on 1 and 3 threads,
// in both of lora.h's parallel forms ("even": one pass; "skewed": two).
void CheckLoraParts(const Kernels& k, Worst& worst) {
  constexpr int64_t K = 128, R = 24, S = 8, G = 3;
  const int64_t Ns[G] = {80, 48, 16};
  const std::vector<int32_t> ranks[G] = {
      {24, 5, 0, 17, 24, 8, 20, 24}, {0, 16, 9, 4, 8, 24, 4, 0}, {8, 17, 17, 0, 8, 0, 8, 17}};
  struct Form {
    Dt dt;
    int32_t a, b;
  };
  std::vector<Form> forms = {{Dt::kF32, kLoraRows, kLoraRows}, {Dt::kBf16, kLoraRows, kLoraRows},
                             {Dt::kBf16, kLoraPairs, kLoraStrips}};
  if (k.pair_dot) forms.push_back({Dt::kBf16, kLoraBlocks, kLoraStrips});
  for (const char* layout : {"even", "skewed"}) {
    std::vector<int32_t> slots(48);
    for (int64_t t = 0; t < 48; ++t) slots[t] = layout[0] == 'e' || t % 4 == 0 ? static_cast<int32_t>(t % 9) - 1 : 3;
    const int64_t T = static_cast<int64_t>(slots.size());
    std::vector<int64_t> macs(S, 0);  // lora.h's rule at 3 threads, as CheckLora checks it
    int64_t total = 0;
    for (int32_t sl : slots)
      for (int64_t p = 0; sl >= 0 && p < G; ++p) macs[sl] += ranks[p][sl] * (K + Ns[p]);
    for (int64_t m : macs) total += m;
    const bool one_pass = *std::max_element(macs.begin(), macs.end()) * 2 * 3 <= total;
    if (total < (int64_t{1} << 17) || one_pass != (layout[0] == 'e')) {
      std::fprintf(stderr, "selftest: the LoRA parts' %s layout no longer exercises its parallel form\n", layout);
      std::abort();
    }
    for (const Form& f : forms) {
      Rng rng{static_cast<uint64_t>(T * 31 + f.a * 7 + f.b + (f.dt == Dt::kBf16))};
      // (the stacks' values are placed in each form as they come: the parts' calls read them the same way)
      const Buf x = Random(f.dt, T * K, rng);
      std::vector<Buf> a, b;
      for (int64_t p = 0; p < G; ++p) {
        a.push_back(Random(f.dt, S * R * K, rng));
        b.push_back(Random(f.dt, S * R * Ns[p], rng));
      }
      for (int threads : kThreadCounts) {
        std::vector<Buf> got, want;
        std::vector<LoraPart> parts;
        for (int64_t p = 0; p < G; ++p) {
          got.emplace_back(f.dt, T * Ns[p]);
          want.emplace_back(f.dt, T * Ns[p]);
        }
        for (int64_t p = 0; p < G; ++p)
          parts.push_back({a[p].data(), b[p].data(), ranks[p].data(), Ns[p], got[p].data()});
        Call(threads, [&](const Runner& run) {
          k.lora(run, f.dt, x.data(), T, K, slots.data(), parts.data(), G, f.a, f.b, S, R);
          for (int64_t p = 0; p < G; ++p) {
            const LoraPart one{a[p].data(), b[p].data(), ranks[p].data(), Ns[p], want[p].data()};
            k.lora(run, f.dt, x.data(), T, K, slots.data(), &one, 1, f.a, f.b, S, R);
          }
        });
        for (int64_t p = 0; p < G; ++p) {
          const std::string ctx = Case("%s %s parts A form %d B form %d part %lld threads=%d", DtName(f.dt), layout,
                                       f.a, f.b, (long long)p, threads);
          for (int64_t i = 0; i < T * Ns[p]; ++i) worst.Near(got[p].At(i), want[p].At(i), 0, 1e-30, ctx, i);  // exact
        }
      }
    }
  }
}

// LoRA on int8 stacks (lora.h "int8 adapter stacks"): a [S, R/32, Kq, 32, 4], b [S, R * N] in strips, scale [S, R];
// the rows past a slot's rank hold values the kernel must not use (A's to the end of their panel are read; B's to
// the end of their quad, weighted by zero). Reference: the int8 values times the scales in double. Tolerance:
// float32 accumulation, the output's bfloat16 rounding, and where the path has int8 dot products the per-token
// quantization of x (two digits: half a step of 1/254 of the high digit's) and of x @ A^T * scale (one digit), each
// through the rest of the sum.
// One projection of a case: its output columns and its slots' ranks.
struct LoraInt8CasePart {
  int64_t N;
  std::vector<int32_t> ranks;
};

void CheckLoraInt8Case(const Kernels& k, Worst& worst, Dt dt, int64_t K, const std::vector<LoraInt8CasePart>& cparts,
                       const std::vector<int32_t>& slots, int64_t R, const char* layout) {
  const int64_t T = static_cast<int64_t>(slots.size()), S = static_cast<int64_t>(cparts[0].ranks.size());
  const int64_t kq = (K + 3) / 4, G = static_cast<int64_t>(cparts.size());
  Rng rng{static_cast<uint64_t>(K * 104729 + cparts[0].N * 37 + T * 5 + G * 7 + (dt == Dt::kBf16))};
  const Buf x = Random(dt, T * K, rng);
  std::vector<std::vector<int8_t>> aqs, bqs;
  std::vector<std::vector<float>> scales, wants, tols;
  for (const LoraInt8CasePart& cp : cparts) {
    const int64_t N = cp.N;
    std::vector<int8_t> aq(S * R * kq * 4, 0), bq(S * R * N);
    std::vector<float> scale(S * R);
    auto a_at = [&](int64_t s, int64_t r, int64_t kk) {
      return ((s * (R / 32) + r / 32) * kq + kk / 4) * 128 + r % 32 * 4 + kk % 4;
    };
    auto b_at = [&](int64_t s, int64_t r, int64_t n) {  // strips of 64 columns, the last one narrower
      const int64_t n0 = n / 64 * 64, w = std::min<int64_t>(64, N - n0);
      return s * R * N + n0 * R + (r / 4 * w + n - n0) * 4 + r % 4;
    };
    for (int64_t s = 0; s < S; ++s)
      for (int64_t r = 0; r < R; ++r) {
        auto digit = [&] { return static_cast<int8_t>(static_cast<int>(rng.Next() % 255) - 127); };
        for (int64_t kk = 0; kk < K; ++kk) aq[a_at(s, r, kk)] = digit();
        for (int64_t n = 0; n < N; ++n) bq[b_at(s, r, n)] = digit();
        scale[s * R + r] = 1e-4f * static_cast<float>(1 + rng.Next() % 100);
      }
    std::vector<float> want(T * N, 0.0f), tol(T * N, 1e-6f);
    for (int64_t t = 0; t < T; ++t) {
      const int64_t s = slots[t];
      if (s < 0 || s >= S || !cp.ranks[s]) continue;
      const int64_t rank = std::min<int64_t>(cp.ranks[s], R);
      double xmax = 0;
      for (int64_t kk = 0; kk < K; ++kk) xmax = std::max(xmax, std::fabs(x.At(t * K + kk)));
      std::vector<double> u(rank), ue(rank), umag(rank);
      double umax = 0;
      for (int64_t r = 0; r < rank; ++r) {
        double dot = 0, mag = 0, l1 = 0;
        for (int64_t kk = 0; kk < K; ++kk) {
          const double w = aq[a_at(s, r, kk)];
          dot += x.At(t * K + kk) * w, mag += std::fabs(x.At(t * K + kk) * w), l1 += std::fabs(w);
        }
        u[r] = dot * scale[s * R + r];
        umag[r] = mag * scale[s * R + r];
        ue[r] = k.int8_dot() ? 0.5 * xmax / 127 / 254 * l1 * scale[s * R + r] * 1.01 : 0;
        umax = std::max(umax, std::fabs(u[r]) + ue[r]);
      }
      for (int64_t n = 0; n < N; ++n) {
        double y = 0, mag = 0, err = 0;
        for (int64_t r = 0; r < rank; ++r) {
          const double w = bq[b_at(s, r, n)];
          y += u[r] * w, mag += umag[r] * std::fabs(w);
          err += (ue[r] + (k.int8_dot() ? 0.5 * umax / 127 * 1.01 : 0)) * std::fabs(w);
        }
        want[t * N + n] = static_cast<float>(y);
        tol[t * N + n] += static_cast<float>(1e-5 * mag + err + (dt == Dt::kBf16 ? 0x1p-8 * (std::fabs(y) + err) : 0));
      }
    }
    aqs.push_back(std::move(aq)), bqs.push_back(std::move(bq)), scales.push_back(std::move(scale));
    wants.push_back(std::move(want)), tols.push_back(std::move(tol));
  }
  for (int threads : kThreadCounts) {
    std::vector<Buf> outs;
    std::vector<LoraInt8Part> parts;
    for (int64_t p = 0; p < G; ++p) {
      outs.emplace_back(dt, T * cparts[p].N);
      // Rows the kernel leaves alone must come back zero: start from garbage.
      for (int64_t i = 0; i < T * cparts[p].N; ++i) outs.back().Set(i, 1e6);
    }
    for (int64_t p = 0; p < G; ++p)
      parts.push_back({aqs[p].data(), bqs[p].data(), scales[p].data(), cparts[p].ranks.data(), cparts[p].N,
                       outs[p].data()});
    Call(threads,
         [&](const Runner& run) { k.lora_int8(run, dt, x.data(), T, K, slots.data(), parts.data(), G, S, R); });
    for (int64_t p = 0; p < G; ++p) {
      const int64_t N = cparts[p].N;
      const std::string ctx = Case("int8 lora %s %s K=%lld N=%lld T=%lld part %lld/%lld threads=%d", DtName(dt),
                                   layout, (long long)K, (long long)N, (long long)T, (long long)p, (long long)G,
                                   threads);
      for (int64_t i = 0; i < T * N; ++i) worst.Near(outs[p].At(i), wants[p][i], 0, tols[p][i], ctx, i);
    }
  }
}

Worst CheckLoraInt8(const Kernels& k) {
  Worst worst;
  int64_t n = 0;
  // Small calls (one thread): tails of K (37: not whole quads) and N (48: not whole tiles), tokens of no slot,
  // ranks inside a panel and a quad.
  const std::vector<int32_t> ranks = {32, 5, 0, 17};
  for (Dt dt : {Dt::kF32, Dt::kBf16})
    for (int64_t K : {37, 64})
      for (int64_t N : {48, 144})
        for (int64_t T : {1, 6, 11}) {
          if (!Sampled(n)) continue;
          Rng rng{static_cast<uint64_t>(T * 131 + K)};
          std::vector<int32_t> slots(T);
          for (int64_t t = 0; t < T; ++t) slots[t] = static_cast<int32_t>(rng.Next() % 6) - 1;
          CheckLoraInt8Case(k, worst, dt, K, {{N, ranks}}, slots, 32, "small");
        }
  // Over the threads: 8 rank-64 adapters' tokens, and most tokens on one adapter.
  const std::vector<int32_t> many = {64, 64, 64, 64, 64, 64, 64, 48};
  for (const char* layout : {"even", "skewed"}) {
    std::vector<int32_t> slots(48);
    for (int64_t t = 0; t < 48; ++t)
      slots[t] = layout[0] == 'e' || t % 3 == 0 ? static_cast<int32_t>(t % 9) - 1 : 2;
    for (Dt dt : {Dt::kF32, Dt::kBf16})
      if (Sampled(n)) CheckLoraInt8Case(k, worst, dt, 517, {{528, many}}, slots, 64, layout);
  }
  // Three projections of one x (q|k|v), each its own ranks (one slot left alone by the second), alone on one thread
  // and evenly or skewed over the threads.
  const std::vector<LoraInt8CasePart> qkv = {{160, {64, 16, 48, 64, 32, 64, 64, 64}},
                                             {48, {64, 0, 48, 16, 32, 64, 64, 64}},
                                             {64, {16, 16, 64, 64, 32, 64, 48, 64}}};
  for (const char* layout : {"small", "even", "skewed"}) {
    const int64_t T = layout[0] == 's' ? 5 : 40;
    std::vector<int32_t> slots(T);
    for (int64_t t = 0; t < T; ++t)
      slots[t] = std::string(layout) != "skewed" || t % 4 == 0 ? static_cast<int32_t>(t % 9) - 1 : 1;
    for (Dt dt : {Dt::kF32, Dt::kBf16})
      if (Sampled(n)) CheckLoraInt8Case(k, worst, dt, 70, qkv, slots, 64, layout);
  }
  return worst;
}

// api.h's tables by Isa id: null where this build has no copy for it (another architecture's).
const Kernels* (*const kTables[kNumIsas])() = {KernelsGeneric, KernelsAvx2, KernelsAvx512, KernelsAvx512Bf16,
                                               KernelsAmx,     KernelsNeon, KernelsNeonBf16};

}  // namespace
}  // namespace meshserve

int main(int argc, char** argv) {
  using namespace meshserve;
  std::vector<std::string> only;
  for (int i = 1; i < argc; ++i) {
    if (!std::strncmp(argv[i], "--every=", 8)) {
      g_every = std::atoi(argv[i] + 8);
      if (g_every < 1) {
        std::fprintf(stderr, "selftest: %s: expected --every=N with N >= 1\n", argv[i]);
        return 2;
      }
    } else {
      only.push_back(argv[i]);
    }
  }
  for (const std::string& name : only) {
    int32_t id = 0;
    while (id < kNumIsas && name != IsaName(id)) ++id;
    if (id == kNumIsas) {
      std::fprintf(stderr, "selftest: unknown path %s\n", name.c_str());
      return 2;
    }
  }
  int ran = 0, passed = 0;
  for (int32_t id = 0; id < kNumIsas; ++id) {
    const char* name = IsaName(id);
    if (!only.empty() && std::find(only.begin(), only.end(), name) == only.end()) continue;
    if (!kTables[id]) {
      if (!only.empty()) std::printf("%s: not in this build\n", name);
      continue;
    }
    const Kernels* k = KernelsFor(id);
    if (!k) {
      std::printf("%s: not run (this CPU lacks it)\n", name);
      continue;
    }
    ++ran;
    std::fflush(stdout);  // a crash in a kernel still shows which paths ran
    if (std::strcmp(k->name, name) != 0) {
      std::printf("%s: FAIL (table is %s's)\n", name, k->name);
      continue;
    }
    const char* kernels[] = {"matmul",      "matmul_packed", "attention",        "greedy_head",
                             "matmul_int8", "expert_mlp",    "latent_attention", "lora",
                             "lora_int8"};
    const Worst results[] = {CheckMatmul(*k), CheckPacked(*k),    CheckAttention(*k),         CheckGreedyHead(*k),
                             CheckInt8(*k),   CheckExpertMlp(*k), CheckLatentAttention(*k),   CheckLora(*k),
                             CheckLoraInt8(*k)};
    std::string line = std::string(name) + ":";
    bool ok = true;
    for (int i = 0; i < static_cast<int>(sizeof(kernels) / sizeof(kernels[0])); ++i) {
      line += std::string(i ? ", " : " ") + kernels[i] + (results[i].ok() ? " ok" : " FAIL (" + results[i].where + ")");
      ok = ok && results[i].ok();
    }
    if (k->int8_dot()) line += " (int8 dot products)";
    std::printf("%s\n", line.c_str());
    passed += ok;
  }
  if (passed == ran)
    std::printf("selftest: %d paths passed\n", passed);
  else
    std::printf("selftest: %d paths passed, %d failed\n", passed, ran - passed);
  return ran > 0 && passed == ran ? 0 : 1;
}
