// Greedy LM head by screening, written in V. In a step where every sequence that samples takes the plain argmax,
// the head's full-precision read (the largest single weight) is replaced by the read of an int8 copy, q[N, Kq]
// (Kq = K rounded up to 64, zero-padded), one scale s_j per vocabulary row (w_j ~ s_j q_j), and a per-row bound
// c_j (`greedy_head_screen` in pallas_kernels/native.py) such that |x.w_j - approx_j| <= ||x|| c_j, where
// approx_j is s_j (x.q_j) accumulated in float32 here: c_j = ||w_j - s_j q_j|| + gamma ||s_j q_j|| (Cauchy-Schwarz,
// gamma covering float32 rounding). Every row whose upper bound reaches the best lower bound is a candidate; the
// candidates' logits are recomputed from the full-precision weight in double precision and the largest wins
// (the lowest id on ties): the argmax of the exact logits, for a quarter (bf16) or an eighth (f32) of the read.
// The exact weight is the head as the model holds it: packed panels (f32 or bf16), [K, N] or [N, K] (a tied
// embedding table).
constexpr int kScreenRows = 4;          // x rows per pass over q
constexpr int64_t kScreenAhead = 2048;  // bytes ahead in each of a group's row streams, prefetched into L2

inline double HeadAt(const HeadWeight& w, int64_t k, int64_t j) {
  int64_t i;
  if (w.layout == 1) {
    i = k * w.N + j;
  } else if (w.layout == 2) {
    i = j * w.K + k;
  } else if (!w.bf16) {
    i = j / kF32Panel * w.panel_len + k * kF32Panel + j % kF32Panel;
  } else {
    i = j / kBf16Panel * w.panel_len + (k / 2) * (2 * kBf16Panel) + (j % kBf16Panel) * 2 + k % 2;
  }
  if (!w.bf16) return static_cast<const float*>(w.data)[i];
  const uint32_t b = static_cast<uint32_t>(static_cast<const uint16_t*>(w.data)[i]) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// approx[r][j] for RT rows of xf and the G vocabulary rows js (G streams read side by side).
template <int RT, int G>
inline void ScreenDots(const float* __restrict xf, int64_t Kq, const int8_t* __restrict q, const float* scale,
                       const int64_t* js, int64_t N, float* approx) {
  V::F acc[RT][G];
#pragma GCC unroll 4
  for (int r = 0; r < RT; ++r)
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) acc[r][g] = V::Zero();
  const int8_t* rows[G];
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g) rows[g] = q + js[g] * Kq;
  for (int64_t k = 0; k < Kq; k += 64) {
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) PrefetchT1(reinterpret_cast<const char*>(rows[g] + k) + kScreenAhead);
#pragma GCC unroll 16
    for (int64_t kk = k; kk < k + 64; kk += V::kLanes) {
      V::F xv[RT];
#pragma GCC unroll 4
      for (int r = 0; r < RT; ++r) xv[r] = V::Load(xf + r * Kq + kk);
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) {
        const V::F wv = V::LoadI8(rows[g] + kk);
#pragma GCC unroll 4
        for (int r = 0; r < RT; ++r) acc[r][g] = V::Fma(xv[r], wv, acc[r][g]);
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < RT; ++r)
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) approx[r * N + js[g]] = V::ReduceAdd(acc[r][g]) * scale[js[g]];
}

// Vocabulary rows [j0, j1) as G streams (the range cut in G), then the leftover rows one by one.
template <int RT>
void ScreenRange(const float* xf, int64_t Kq, const int8_t* q, const float* scale, int64_t j0, int64_t j1,
                 int64_t N, float* approx) {
  constexpr int G = V::kScreenStreams;
  const int64_t L = (j1 - j0) / G;
  for (int64_t i = 0; i < L; ++i) {
    int64_t js[G];
    for (int g = 0; g < G; ++g) js[g] = j0 + g * L + i;
    ScreenDots<RT, G>(xf, Kq, q, scale, js, N, approx);
  }
  for (int64_t j = j0 + G * L; j < j1; ++j) ScreenDots<RT, 1>(xf, Kq, q, scale, &j, N, approx);
}

void ScreenedArgmax(const Runner& run, const float* xf, int64_t rows, int64_t Kq, const int8_t* q,
                    const float* scale, const float* bound, const HeadWeight& w, int32_t* tokens,
                    int32_t* candidates) {
  const int64_t N = w.N, K = w.K;
  const int64_t threads = Max<int64_t>(1, run.threads);
  const int64_t chunk = Max<int64_t>(256, (N + 4 * threads - 1) / (4 * threads));
  const int64_t chunks = (N + chunk - 1) / chunk;
  // The calling thread's buffers, reused from call to call (every entry read is written first).
  thread_local Scratch approx_buf, lower_buf, upper_buf, cands_buf, exact_buf;
  float* approx = approx_buf.Get<float>(static_cast<size_t>(kScreenRows * N));
  // Per row and chunk: the best lower bound and the best upper bound of its vocabulary rows.
  double* lower = lower_buf.Get<double>(static_cast<size_t>(kScreenRows * chunks));
  double* upper = upper_buf.Get<double>(static_cast<size_t>(kScreenRows * chunks));
  int64_t* cands = cands_buf.Get<int64_t>(static_cast<size_t>(N));
  double* exact = exact_buf.Get<double>(static_cast<size_t>(N));
  for (int64_t m0 = 0; m0 < rows; m0 += kScreenRows) {
    const int rt = static_cast<int>(Min<int64_t>(kScreenRows, rows - m0));
    const float* x = xf + m0 * Kq;
    double norm[kScreenRows];
    for (int r = 0; r < rt; ++r) {
      double ss = 0;
      for (int64_t k = 0; k < K; ++k) ss += static_cast<double>(x[r * Kq + k]) * x[r * Kq + k];
      // Rounding in the bound arithmetic below (doubles) is covered by a relative margin.
      norm[r] = std::sqrt(ss) * (1 + 1e-9);
    }
    // Pass 1: approximate logits, and each chunk's bounds per row.
    ParallelFor(run, chunks, [&](int64_t c) {
      const int64_t j0 = c * chunk, j1 = Min(N, j0 + chunk);
      switch (rt) {
        case 1: ScreenRange<1>(x, Kq, q, scale, j0, j1, N, approx); break;
        case 2: ScreenRange<2>(x, Kq, q, scale, j0, j1, N, approx); break;
        case 3: ScreenRange<3>(x, Kq, q, scale, j0, j1, N, approx); break;
        default: ScreenRange<4>(x, Kq, q, scale, j0, j1, N, approx); break;
      }
      for (int r = 0; r < rt; ++r) {
        double lo = -INFINITY, hi = -INFINITY;
        const float* a = approx + r * N;
        for (int64_t j = j0; j < j1; ++j) {
          const double b = norm[r] * bound[j];
          lo = Max<double>(lo, a[j] - b);
          hi = Max<double>(hi, a[j] + b);
        }
        lower[r * chunks + c] = lo;
        upper[r * chunks + c] = hi;
      }
    });
    // Pass 2, per row: the candidates (upper bound at least the best lower bound; a chunk whose best upper bound
    // falls short has none), their exact logits, the winner.
    for (int r = 0; r < rt; ++r) {
      double floor = -INFINITY;
      for (int64_t c = 0; c < chunks; ++c) floor = Max(floor, lower[r * chunks + c]);
      const float* a = approx + r * N;
      const float* xr = x + r * Kq;
      int64_t n = 0;
      for (int64_t c = 0; c < chunks; ++c) {
        if (!(upper[r * chunks + c] >= floor)) continue;
        for (int64_t j = c * chunk, j1 = Min(N, j + chunk); j < j1; ++j)
          if (a[j] + norm[r] * bound[j] >= floor) cands[n++] = j;
      }
      if (n == 0) {  // NaN in x or the approximations: no bound holds; read every row exactly
        for (int64_t j = 0; j < N; ++j) cands[j] = j;
        n = N;
      }
      const int64_t per = 64;
      ParallelFor(run, (n + per - 1) / per, [&](int64_t b) {
        for (int64_t i = b * per, i1 = Min(n, b * per + per); i < i1; ++i) {
          double logit = 0;
          for (int64_t k = 0; k < K; ++k) logit += static_cast<double>(xr[k]) * HeadAt(w, k, cands[i]);
          exact[i] = logit;
        }
      });
      int64_t best = 0;
      for (int64_t i = 1; i < n; ++i)
        if (exact[i] > exact[best]) best = i;  // strictly greater: the lowest id on ties
      tokens[m0 + r] = static_cast<int32_t>(cands[best]);
      candidates[m0 + r] = static_cast<int32_t>(n);
    }
  }
}

void GreedyHeadEntry(const Runner& run, Dt dt, const void* x, int64_t rows, int64_t K, int64_t Kq, const int8_t* q,
                     const float* scale, const float* bound, const HeadWeight& w, int32_t* tokens,
                     int32_t* candidates) {
  Zeros<float> xf(static_cast<size_t>(rows * Kq));
  for (int64_t m = 0; m < rows; ++m) {
    if (dt == Dt::kBf16)
      ToF32(static_cast<const uint16_t*>(x) + m * K, xf.get() + m * Kq, K);
    else
      ToF32(static_cast<const float*>(x) + m * K, xf.get() + m * Kq, K);
  }
  ScreenedArgmax(run, xf.get(), rows, Kq, q, scale, bound, w, tokens, candidates);
}
