// The LoRA update of a ragged batch (pallas_kernels/lora.py `lora_delta`), included inside an instruction set's
// namespace after matmul.h, whose tiles it reuses:
//
//   y[t] = (x[t] @ a[s][:r, :]^T) @ b[s][:r, :],   s = slots[t], r = ranks[s];   y[t] = 0 where s < 0, s >= S or r = 0
//
// with a [S, R, K] (A stored transposed: each rank row contiguous along K) and b [S, R, N] row-major in x's dtype.
// The tokens are grouped by slot (counting sort, token order kept), so each adapter's A and B are read once per
// call, and only up to the adapter's own rank: a slot no token uses is not read, and a rank-8 adapter in rank-64
// slots reads its first 8 rows of A and of B, contiguously. Two parallel passes over the caller's threads:
//   1. A: units of slots; dot products of the slot's token rows (float32) with A's first r rows (widened in
//      registers) -> xa[t, :r] (float32);
//   2. B: units of chunks of N's columns (no two threads write one element); each sweeps every used slot's B
//      columns with its tokens' xa rows and writes their rows of y (rounded to bfloat16 once, for bf16).
// B's tiles: 4 rows, then single rows (matmul.h WidenTile: float32 x against float32 or widened bfloat16 weights).

// Below this many multiply-adds a call runs on the calling thread alone: a decode step's rank-8 update (32 tokens:
// 0.7M) costs less than handing it to the pool twice and waiting for the slowest thread on a loaded CPU.
constexpr int64_t kLoraSerialMacs = int64_t{1} << 21;

// The last columns of a row tile: a panel only as wide as they are (a rank-8 B row is one vector wide; a
// full-width panel would load and multiply masked-off vectors for nothing).
template <int RT, int CB, typename WT>
void LoraTail(const float* xt, const WT* w, int64_t ldw, int64_t kb, int64_t width, float* out, int64_t ldo) {
  if constexpr (CB > 1) {
    if (width <= V::kLanes * (CB - 1)) return LoraTail<RT, CB - 1, WT>(xt, w, ldw, kb, width, out, ldo);
  }
  V::M masks[CB];
  for (int c = 0; c < CB; ++c) masks[c] = V::Mask(width - V::kLanes * c);
  WidenTile<RT, CB, WT>(xt, w, ldw, kb, out, ldo, masks, true);
}

template <int RT, typename WT>
void LoraColumns(const float* xt, const WT* w, int64_t ldw, int64_t kb, int64_t width, float* out, int64_t ldo) {
  constexpr int CB = CbFor(RT);
  constexpr int64_t panel = V::kLanes * CB;
  int64_t c0 = 0;
  if (width >= panel) {
    V::M masks[CB];
    for (int c = 0; c < CB; ++c) masks[c] = V::Mask(panel);
    for (; c0 + panel <= width; c0 += panel) WidenTile<RT, CB, WT>(xt, w + c0, ldw, kb, out + c0, ldo, masks, true);
  }
  if (c0 < width) LoraTail<RT, CB, WT>(xt, w + c0, ldw, kb, width - c0, out + c0, ldo);
}

// out[i, :width] (float32, row stride ldo) = rows[i][:kb] @ w[kb, width] (row stride ldw) for i < m.
template <typename WT>
void LoraMatmul(const float* const* rows, int64_t m, int64_t kb, const WT* w, int64_t ldw, int64_t width, float* out,
                int64_t ldo) {
  constexpr int RT = 4;
  thread_local Scratch xt_buf;
  float* xt = xt_buf.Get<float>(static_cast<size_t>(kb * RT));
  int64_t i = 0;
  for (; i + RT <= m; i += RT) {
    for (int64_t k = 0; k < kb; ++k)
      for (int r = 0; r < RT; ++r) xt[k * RT + r] = rows[i + r][k];
    LoraColumns<RT, WT>(xt, w, ldw, kb, width, out + i * ldo, ldo);
  }
  for (; i < m; ++i) LoraColumns<1, WT>(rows[i], w, ldw, kb, width, out + i * ldo, ldo);
}

// out[i, j] (float32, row stride ldo) = x[i, :K] . a[j, :K] for i < RT, j < RC: RT token rows (float32, row stride
// K) against RC rows of A (float32 or bfloat16 widened in registers), each product summed along K in vector lanes
// and reduced once at the end.
template <int RT, int RC, typename WT>
inline void LoraDotTile(const float* __restrict x, const WT* __restrict a, int64_t K, float* __restrict out,
                        int64_t ldo) {
  V::F acc[RT][RC];
#pragma GCC unroll 8
  for (int i = 0; i < RT; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < RC; ++j) acc[i][j] = V::Zero();
  const V::M full = V::Mask(V::kLanes);
  int64_t k = 0;
  for (; k + V::kLanes <= K; k += V::kLanes) {
    V::F av[RC];
#pragma GCC unroll 8
    for (int j = 0; j < RC; ++j) av[j] = LoadW(a + j * K + k, full);
#pragma GCC unroll 8
    for (int i = 0; i < RT; ++i) {
      const V::F xv = V::Load(x + i * K + k);
#pragma GCC unroll 8
      for (int j = 0; j < RC; ++j) acc[i][j] = V::Fma(xv, av[j], acc[i][j]);
    }
  }
  if (k < K) {
    const V::M tail = V::Mask(K - k);
    V::F av[RC];
    for (int j = 0; j < RC; ++j) av[j] = LoadW(a + j * K + k, tail);
    for (int i = 0; i < RT; ++i) {
      const V::F xv = V::LoadM(x + i * K + k, tail);
      for (int j = 0; j < RC; ++j) acc[i][j] = V::Fma(xv, av[j], acc[i][j]);
    }
  }
  for (int i = 0; i < RT; ++i)
    for (int j = 0; j < RC; ++j) out[i * ldo + j] = V::ReduceAdd(acc[i][j]);
}

// RT token rows against A's first r rows: tiles of RC rows of A, then single ones.
template <int RT, int RC, typename WT>
void LoraDotRows(const float* x, const WT* a, int64_t K, int64_t r, float* out, int64_t ldo) {
  int64_t j = 0;
  for (; j + RC <= r; j += RC) LoraDotTile<RT, RC, WT>(x, a + j * K, K, out + j, ldo);
  for (; j < r; ++j) LoraDotTile<RT, 1, WT>(x, a + j * K, K, out + j, ldo);
}

// out[i, :r] (float32, row stride ldo) = x[i, :K] @ a[:r, :K]^T for i < m (x float32, row stride K): tiles of 4
// token rows x 2 rows of A (12 of AVX2's 16 registers), then 2 x 4, then single token rows x 8 rows of A.
template <typename WT>
void LoraDot(const float* x, int64_t m, int64_t K, const WT* a, int64_t r, float* out, int64_t ldo) {
  int64_t i = 0;
  for (; i + 4 <= m; i += 4) LoraDotRows<4, 2, WT>(x + i * K, a, K, r, out + i * ldo, ldo);
  for (; i + 2 <= m; i += 2) LoraDotRows<2, 4, WT>(x + i * K, a, K, r, out + i * ldo, ldo);
  for (; i < m; ++i) LoraDotRows<1, 8, WT>(x + i * K, a, K, r, out + i * ldo, ldo);
}

inline void FromF32(const float* src, int64_t n, float* dst) { std::memcpy(dst, src, n * sizeof(float)); }
inline void FromF32(const float* src, int64_t n, uint16_t* dst) {
  for (int64_t i = 0; i < n; i += V::kLanes) {
    const V::M m = V::Mask(n - i);
    V::StoreBf16M(dst + i, V::LoadM(src + i, m), m);
  }
}

template <typename T>
void LoraImpl(const Runner& run, const T* x, int64_t T_, int64_t K, const int32_t* slots, const T* a, const T* b,
              const int32_t* ranks, int64_t S, int64_t R, int64_t N, T* y) {
  std::memset(y, 0, static_cast<size_t>(T_ * N) * sizeof(T));
  // Counting sort of the tokens by slot (those of no slot or rank 0 left out).
  Zeros<int64_t> start_buf(static_cast<size_t>(S + 1));
  int64_t* start = start_buf.get();
  auto rank_of = [&](int32_t s) { return s >= 0 && s < S ? Clamp<int64_t>(ranks[s], 0, R) : 0; };
  for (int64_t t = 0; t < T_; ++t)
    if (rank_of(slots[t])) ++start[slots[t] + 1];
  for (int64_t s = 0; s < S; ++s) start[s + 1] += start[s];
  const int64_t used_tokens = start[S];
  if (!used_tokens) return;
  int64_t macs = 0;
  for (int64_t t = 0; t < T_; ++t) macs += rank_of(slots[t]) * (K + N);
  const Runner serial{nullptr, 1, nullptr};
  const Runner& par = macs < kLoraSerialMacs ? serial : run;
  Zeros<int64_t> order_buf(static_cast<size_t>(used_tokens)), fill_buf(static_cast<size_t>(S));
  int64_t *order = order_buf.get(), *fill = fill_buf.get();
  for (int64_t t = 0; t < T_; ++t)
    if (rank_of(slots[t])) order[start[slots[t]] + fill[slots[t]]++] = t;
  Zeros<int32_t> used_buf(static_cast<size_t>(S));
  int32_t* used = used_buf.get();
  int64_t num_used = 0;
  for (int64_t s = 0; s < S; ++s)
    if (start[s + 1] > start[s]) used[num_used++] = static_cast<int32_t>(s);
  Zeros<float> xa(static_cast<size_t>(used_tokens * R));  // row i: sorted token i's x @ A^T

  // 1. A: per used slot.
  ParallelFor(par, num_used, [&](int64_t u) {
    const int32_t s = used[u];
    const int64_t m = start[s + 1] - start[s], r = rank_of(s);
    thread_local Scratch rows_buf;
    float* xg = rows_buf.Get<float>(static_cast<size_t>(m * K));
    for (int64_t i = 0; i < m; ++i) ToF32(x + order[start[s] + i] * K, xg + i * K, K);
    LoraDot(xg, m, K, a + s * R * K, r, xa.get() + start[s] * R, R);
  });

  // 2. B: per chunk of N's columns, every used slot.
  const int64_t unit = V::kLanes * CbFor(4);
  const int64_t chunk = unit * ChunkUnits(N, unit, par.threads);
  ParallelFor(par, (N + chunk - 1) / chunk, [&](int64_t c) {
    const int64_t n0 = c * chunk, width = Min<int64_t>(chunk, N - n0);
    thread_local Scratch out_buf, ptr_buf;
    int64_t most = 0;
    for (int64_t u = 0; u < num_used; ++u) most = Max<int64_t>(most, start[used[u] + 1] - start[used[u]]);
    float* out = out_buf.Get<float>(static_cast<size_t>(most * width));
    const float** rows = ptr_buf.Get<const float*>(static_cast<size_t>(most));
    for (int64_t u = 0; u < num_used; ++u) {
      const int32_t s = used[u];
      const int64_t m = start[s + 1] - start[s], r = rank_of(s);
      for (int64_t i = 0; i < m; ++i) rows[i] = xa.get() + (start[s] + i) * R;
      LoraMatmul(rows, m, r, b + s * R * N + n0, N, width, out, width);
      for (int64_t i = 0; i < m; ++i) FromF32(out + i * width, width, y + order[start[s] + i] * N + n0);
    }
  });
}

void LoraEntry(const Runner& run, Dt dt, const void* x, int64_t T_, int64_t K, const int32_t* slots, const void* a,
               const void* b, const int32_t* ranks, int64_t S, int64_t R, int64_t N, void* y) {
  if (dt == Dt::kF32)
    LoraImpl(run, static_cast<const float*>(x), T_, K, slots, static_cast<const float*>(a),
             static_cast<const float*>(b), ranks, S, R, N, static_cast<float*>(y));
  else
    LoraImpl(run, static_cast<const uint16_t*>(x), T_, K, slots, static_cast<const uint16_t*>(a),
             static_cast<const uint16_t*>(b), ranks, S, R, N, static_cast<uint16_t*>(y));
}
