// Grouped expert MLP for mixture-of-experts layers (included inside an instruction set's namespace, after
// matmul.h, whose small-M tiles it reuses):
//
//   y[t] = sum_k w[t, k] * down_s(silu(x[t] @ gate_s) * (x[t] @ up_s)),   s = slots[t, k]; s < 0 (or >= S): no work
//
// with gate/up [S, E, I] and down [S, I, E] row-major per slot. The (token, k) pairs are grouped by slot (counting
// sort, token order kept), so each selected expert's weights are read once for all the tokens routed to it and an
// expert no token selected is not read at all: a decode step costs the bytes of the experts it routes to.
//
// Two parallel passes over the caller's threads:
//   1. gate|up: units of (selected expert, chunk of I's columns); both weights' columns multiply the expert's
//      gathered token rows in float32 and SwiGLU writes h[pair, I] (float32) for every pair of the expert;
//   2. down + combine: units of chunks of E's columns (so no two threads write one output element); each sweeps
//      every selected expert's down columns with its h rows and adds w[t, k] * out into the tokens' rows, in slot
//      order (float32), then writes the chunk of y (rounded to bfloat16 once, for bf16).
// bfloat16: x @ gate|up take the pair dot products where the CPU has them (else widened in registers, as the
// matmul); h stays float32 and the down weights are widened in registers. int8 weights (quantized serving) come with
// float32 scales per output channel and slot (gate/up [S, I], down [S, E]): widened to float32 in registers against
// x as float32, each expert's sums scaled by its channels' scales (before SwiGLU; before the weighted combine).
//
// Packed experts (float32 / bfloat16 weights packed at load, single-device CPU serving: `pack_weights` of
// pallas_kernels/native): each slot's gate/up as matmul.h's packed panels over E ([S, I/P, Kp/step, P, step]) and
// down over I ([S, E/P, ...]), so a unit streams whole panels front to back (matmul.h PackedPanel) instead of strips
// of row-major rows: at a few tokens per expert the strips read at ~0.3-0.45 of the memory bandwidth (mixtral-tiny's
// experts, E=512, I=1024), the panels as fast as a dense packed matmul. Same two passes; the tokens' rows gathered
// into one buffer in expert order, as the tiles read them; for bfloat16 with pair dot products, h rounded to
// bfloat16 before down (as the model computes it in bfloat16).

// Rows rowp[0..rows) of x, columns [k0, k0 + kb), packed k-major as the tiles read them (matmul.h PackX).
inline void PackRows(const float* const* rowp, int64_t rows, int64_t k0, int64_t kb, float* xt) {
  for (int64_t k = 0; k < kb; ++k)
    for (int64_t r = 0; r < rows; ++r) xt[k * rows + r] = rowp[r][k0 + k];
}
inline void PackRows(const uint16_t* const* rowp, int64_t rows, int64_t k0, int64_t kb, float* xt) {
  for (int64_t k = 0; k < kb; ++k)
    for (int64_t r = 0; r < rows; ++r) {
      const uint32_t b = static_cast<uint32_t>(rowp[r][k0 + k]) << 16;
      std::memcpy(xt + k * rows + r, &b, 4);
    }
}
inline void PackRows(const uint16_t* const* rowp, int64_t rows, int64_t k0, int64_t kb, int32_t* xt) {
  for (int64_t k = 0; k < kb; k += 2)
    for (int64_t r = 0; r < rows; ++r) {
      int32_t v = rowp[r][k0 + k];
      if (k + 1 < kb) v |= static_cast<int32_t>(rowp[r][k0 + k + 1]) << 16;
      xt[(k / 2) * rows + r] = v;
    }
}

// One tile: pair dot products where x comes as bfloat16 pairs (XTT int32), else float32 x against float32 or
// bfloat16 (widened) weights.
template <int RT, int CB, typename XTT, typename WT>
inline void GroupTile(const XTT* xt, const WT* w, int64_t ldw, int64_t kb, float* acc, int64_t lda,
                      const V::M* masks, bool first) {
#if MESHSERVE_BF16_PAIRS
  if constexpr (std::is_same_v<XTT, int32_t>)
    PairTile<RT, CB>(xt, w, ldw, kb, acc, lda, masks, first);
  else
#endif
    WidenTile<RT, CB, WT>(xt, w, ldw, kb, acc, lda, masks, first);
}

// acc_j[Mp, width] (row stride lda) = rows[Mp, K] @ w_j[K, width] (row stride ldw) for the NW weights w_j that
// read the same rows (gate and up), float32 accumulation, in tiles of RT rows: Mp = M rounded up to RT, the rows
// past M read as zeros (`zero`: K zeros) and their accumulators are written but meaningless. (Every tile has RT rows:
// a remainder tile per height would multiply the instantiations, and the build time, by ~16.) K is walked in
// blocks of kKBlock rows, each block sweeping the columns panel by panel (matmul.h MatmulRows: the weight is read
// once, as sequential row streams).
template <int RT, typename XS, typename XTT, typename WT, int NW>
void GroupedChunk(const XS* const* rowp, int64_t M, const XS* zero, int64_t K, const WT* const* w, int64_t ldw,
                  int64_t width, float* const* acc, int64_t lda) {
  constexpr int CB = CbFor(RT);
  constexpr int64_t panel = V::kLanes * CB;
  const int64_t tiles = (M + RT - 1) / RT;
  thread_local Scratch xts_buf, rows_buf;
  XTT* xts = xts_buf.Get<XTT>(static_cast<size_t>(tiles * RT * kKBlock));
  const XS** rows = rows_buf.Get<const XS*>(static_cast<size_t>(tiles * RT));
  for (int64_t r = 0; r < tiles * RT; ++r) rows[r] = r < M ? rowp[r] : zero;
  for (int64_t k0 = 0; k0 < K; k0 += kKBlock) {
    const int64_t kb = Min<int64_t>(kKBlock, K - k0);
    for (int64_t t = 0; t < tiles; ++t) PackRows(rows + t * RT, RT, k0, kb, xts + t * RT * kKBlock);
#pragma GCC unroll 2
    for (int j = 0; j < NW; ++j) {
      // The next block's rows into L2 while this one is swept panel by panel (the sweep reads each row a panel at a
      // time, which the hardware prefetchers follow poorly: ~3x the bandwidth at a few rows per expert).
      const int64_t next = k0 + kKBlock, nb = Min<int64_t>(kKBlock, K - next);
      for (int64_t r = 0; r < nb; ++r) {
        const char* row = reinterpret_cast<const char*>(w[j] + (next + r) * ldw);
        for (int64_t l = 0; l < width * static_cast<int64_t>(sizeof(WT)); l += 64) PrefetchT1(row + l);
      }
      for (int64_t n0 = 0; n0 < width; n0 += panel) {
        V::M masks[CB];
        for (int c = 0; c < CB; ++c) masks[c] = V::Mask(width - n0 - V::kLanes * c);
        for (int64_t t = 0; t < tiles; ++t)
          GroupTile<RT, CB, XTT, WT>(xts + t * RT * kKBlock, w[j] + k0 * ldw + n0, ldw, kb,
                                     acc[j] + t * RT * lda + n0, lda, masks, k0 == 0);
      }
    }
  }
}

// Tile height for M rows: the smallest of 1, 2, 3, 4, 6, 8, 12, 16 (up to kMaxTileRows) that holds them, else the
// tallest.
inline int GroupTileRows(int64_t M) {
  constexpr int kHeights[] = {1, 2, 3, 4, 6, 8, 12, 16};
  for (int rt : kHeights)
    if (rt <= kMaxTileRows && (rt >= M || rt == kMaxTileRows)) return rt;
  return static_cast<int>(kMaxTileRows);
}
inline int64_t GroupPaddedRows(int64_t M) {
  const int64_t rt = GroupTileRows(M);
  return (M + rt - 1) / rt * rt;
}

template <typename XS, typename XTT, typename WT, int NW>
void GroupedRows(const XS* const* rowp, int64_t M, const XS* zero, int64_t K, const WT* const* w, int64_t ldw,
                 int64_t width, float* const* acc, int64_t lda) {
  switch (GroupTileRows(M)) {
#define MESHSERVE_ROWS(n) \
  case n:                 \
    if constexpr (n <= kMaxTileRows) return GroupedChunk<n, XS, XTT, WT, NW>(rowp, M, zero, K, w, ldw, width, acc, lda); \
    return;
    MESHSERVE_ROWS(1) MESHSERVE_ROWS(2) MESHSERVE_ROWS(3) MESHSERVE_ROWS(4) MESHSERVE_ROWS(6) MESHSERVE_ROWS(8)
    MESHSERVE_ROWS(12) MESHSERVE_ROWS(16)
#undef MESHSERVE_ROWS
    default: return;
  }
}

// h[i] = silu(h[i]) * u[i] = h u / (1 + e^-h), n elements.
inline void SwiGlu(float* h, const float* u, int64_t n) {
  const V::F one = V::Set1(1.0f), zero = V::Zero();
  int64_t i = 0;
  for (; i + V::kLanes <= n; i += V::kLanes) {
    const V::F g = V::Load(h + i);
    V::Store(h + i, V::Div(V::Mul(g, V::Load(u + i)), V::Add(one, V::Exp(V::Sub(zero, g)))));
  }
  if (i < n) {
    const V::M m = V::Mask(n - i);
    const V::F g = V::LoadM(h + i, m);
    V::StoreM(h + i, V::Div(V::Mul(g, V::LoadM(u + i, m)), V::Add(one, V::Exp(V::Sub(zero, g)))), m);
  }
}

// Rows [rows, n] (row stride n) times scale[n], in place.
inline void ScaleColumns(float* a, int64_t rows, int64_t n, const float* scale) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < n; i += V::kLanes) {
      const V::M m = V::Mask(n - i);
      V::StoreM(a + r * n + i, V::Mul(V::LoadM(a + r * n + i, m), V::LoadM(scale + i, m)), m);
    }
}

// y[i] += a * v[i], n elements.
inline void AddScaled(float* y, const float* v, float a, int64_t n) {
  const V::F av = V::Set1(a);
  int64_t i = 0;
  for (; i + V::kLanes <= n; i += V::kLanes) V::Store(y + i, V::Fma(av, V::Load(v + i), V::Load(y + i)));
  if (i < n) {
    const V::M m = V::Mask(n - i);
    V::StoreM(y + i, V::Fma(av, V::LoadM(v + i, m), V::LoadM(y + i, m)), m);
  }
}

// Columns per unit of work when N's columns are cut into `parts`: whole multiples of 64 (wide units: each weight row
// is read as one long sequential run).
inline int64_t GroupChunkCols(int64_t N, int64_t parts) {
  const int64_t per = (N + Max<int64_t>(1, parts) - 1) / Max<int64_t>(1, parts);
  return Max<int64_t>(64, (per + 63) / 64 * 64);
}

// Per-channel scales of int8 expert weights (all null: weights in x's dtype).
struct ExpertScales {
  const float *gate, *up, *down;  // [S, I], [S, I], [S, E]
};

// The (token, k) pairs grouped by slot (counting sort; token order within a slot): slot s's pairs are
// [start[s], start[s + 1]), pair q from token tok[q] with combine weight wt[q]; active: the na slots with pairs.
struct PairGroups {
  const int64_t* start;
  const int32_t* tok;
  const float* wt;
  const int32_t* active;
  int64_t pairs, na;
};

inline PairGroups GroupPairs(const int32_t* slots, const float* weights, int64_t T, int64_t topk, int64_t S) {
  thread_local Scratch count_buf, pos_buf, tok_buf, wt_buf, active_buf;
  int64_t* start = count_buf.Get<int64_t>(static_cast<size_t>(S + 1));
  std::memset(start, 0, (S + 1) * sizeof(int64_t));
  const int64_t n = T * topk;
  for (int64_t p = 0; p < n; ++p)
    if (slots[p] >= 0 && slots[p] < S) ++start[slots[p] + 1];
  for (int64_t s = 0; s < S; ++s) start[s + 1] += start[s];
  const int64_t pairs = start[S];
  int64_t* fill = pos_buf.Get<int64_t>(static_cast<size_t>(S));
  std::memcpy(fill, start, S * sizeof(int64_t));
  int32_t* tok = tok_buf.Get<int32_t>(static_cast<size_t>(pairs));
  float* wt = wt_buf.Get<float>(static_cast<size_t>(pairs));
  for (int64_t p = 0; p < n; ++p)
    if (slots[p] >= 0 && slots[p] < S) {
      const int64_t q = fill[slots[p]]++;
      tok[q] = static_cast<int32_t>(p / topk);
      wt[q] = weights[p];
    }
  int32_t* active = active_buf.Get<int32_t>(static_cast<size_t>(S));
  int64_t na = 0;
  for (int64_t s = 0; s < S; ++s)
    if (start[s + 1] > start[s]) active[na++] = static_cast<int32_t>(s);
  return PairGroups{start, tok, wt, active, pairs, na};
}

template <typename XT, typename WT>
void RowMajorExpertMlp(const Runner& run, const XT* x, int64_t T, int64_t E, const int32_t* slots,
                       const float* weights, int64_t topk, const WT* gate, const WT* up, const WT* down,
                       const ExpertScales& scales, int64_t S, int64_t I, XT* out) {
  // x as the gate|up tiles read it: bfloat16 pairs against bfloat16 weights where the CPU has pair dot products,
  // else float32.
  using XTT = std::conditional_t<std::is_same_v<XT, uint16_t> && std::is_same_v<WT, uint16_t> && V::kNativePairs,
                                 int32_t, float>;
  const PairGroups pg = GroupPairs(slots, weights, T, topk, S);
  const int64_t *start = pg.start, pairs = pg.pairs, na = pg.na;
  const int32_t *tok = pg.tok, *active = pg.active;
  const float* wt = pg.wt;
  thread_local Scratch xrow_buf, hrow_buf, h_buf, xzero_buf, hzero_buf;  // (zero: the rows that pad a tile)
  const XT** xrow = xrow_buf.Get<const XT*>(static_cast<size_t>(pairs));
  const float** hrow = hrow_buf.Get<const float*>(static_cast<size_t>(pairs));
  float* h = h_buf.Get<float>(static_cast<size_t>(pairs * I));
  for (int64_t q = 0; q < pairs; ++q) {
    xrow[q] = x + tok[q] * E;
    hrow[q] = h + q * I;
  }
  XT* xzero = xzero_buf.Get<XT>(static_cast<size_t>(E + 1));
  float* hzero = hzero_buf.Get<float>(static_cast<size_t>(I + 1));
  std::memset(xzero, 0, E * sizeof(XT));
  std::memset(hzero, 0, I * sizeof(float));

  // 1. gate|up and SwiGLU into h.
  if (na) {
    // About two units per thread over all the selected experts (their costs differ with their token counts).
    const int64_t threads = Max<int64_t>(1, run.threads);
    const int64_t cw = GroupChunkCols(I, (2 * threads + na - 1) / na), chunks = (I + cw - 1) / cw;
    ParallelFor(run, na * chunks, [&](int64_t unit) {
      const int64_t s = active[unit / chunks], c0 = unit % chunks * cw, width = Min<int64_t>(cw, I - c0);
      const int64_t q0 = start[s], m = start[s + 1] - q0;
      thread_local Scratch gu_buf;
      float* g = gu_buf.Get<float>(static_cast<size_t>(2 * GroupPaddedRows(m) * width));
      float* u = g + GroupPaddedRows(m) * width;
      const WT* w[2] = {gate + s * E * I + c0, up + s * E * I + c0};
      float* acc[2] = {g, u};
      GroupedRows<XT, XTT, WT, 2>(xrow + q0, m, xzero, E, w, I, width, acc, width);
      if (scales.gate) {
        ScaleColumns(g, m, width, scales.gate + s * I + c0);
        ScaleColumns(u, m, width, scales.up + s * I + c0);
      }
      for (int64_t r = 0; r < m; ++r) {
        SwiGlu(g + r * width, u + r * width, width);
        std::memcpy(h + (q0 + r) * I + c0, g + r * width, width * sizeof(float));
      }
    });
  }

  // 2. down and the weighted combine, by chunks of E's columns: one per thread (every chunk does the same work).
  const int64_t cw = GroupChunkCols(E, run.threads), chunks = (E + cw - 1) / cw;
  ParallelFor(run, chunks, [&](int64_t ci) {
    const int64_t c0 = ci * cw, width = Min<int64_t>(cw, E - c0);
    thread_local Scratch y_buf, o_buf;
    float* y = y_buf.Get<float>(static_cast<size_t>(T * width));
    std::memset(y, 0, T * width * sizeof(float));
    for (int64_t a = 0; a < na; ++a) {
      const int64_t s = active[a], q0 = start[s], m = start[s + 1] - q0;
      float* o = o_buf.Get<float>(static_cast<size_t>(GroupPaddedRows(m) * width));
      const WT* w[1] = {down + s * I * E + c0};
      float* acc[1] = {o};
      GroupedRows<float, float, WT, 1>(hrow + q0, m, hzero, I, w, E, width, acc, width);
      if (scales.down) ScaleColumns(o, m, width, scales.down + s * E + c0);
      for (int64_t r = 0; r < m; ++r) AddScaled(y + tok[q0 + r] * width, o + r * width, wt[q0 + r], width);
    }
    for (int64_t t = 0; t < T; ++t) StoreRow<XT>(y + t * width, out + t * E + c0, width);
  });
}


// x's row as the packed tiles read it (PackedTraits::X), zero-padded to ld.
inline void TileRow(const float* src, float* dst, int64_t n, int64_t ld) {
  std::memcpy(dst, src, n * sizeof(float));
  for (int64_t i = n; i < ld; ++i) dst[i] = 0;
}
inline void TileRow(const uint16_t* src, uint16_t* dst, int64_t n, int64_t ld) {
  std::memcpy(dst, src, n * sizeof(uint16_t));
  for (int64_t i = n; i < ld; ++i) dst[i] = 0;
}
inline void TileRow(const uint16_t* src, float* dst, int64_t n, int64_t ld) {
  ToF32(src, dst, n);
  for (int64_t i = n; i < ld; ++i) dst[i] = 0;
}

// Rows [0, m) of float32 x ([m, ldx], zero-padded to kp) times panels [j0, j1) of a packed int8 weight (kp rows of
// K) with per-column scales, into out [m, (j1 - j0) * 64] (row stride ldo): the int8 matmul's widened products
// (matmul_int8.h; exact, as for float32 x), each panel widened once for many rows.
inline void I8ExpertPanels(const float* x, int64_t ldx, int64_t m, const int8_t* w, int64_t K, int64_t kp,
                           const float* scale, int64_t j0, int64_t j1, float* out, int64_t ldo) {
  const I8Problem p{K, kp, ldo, 1, kp / 4, scale + j0 * kI8Panel, x, ldx, nullptr, nullptr, nullptr};
  const int8_t* wj = w + j0 * kp * kI8Panel;
  if (m >= V::kI8F32PanelMinRows) return I8PanelPanels<float, float>(p, x, ldx, 0, m, 0, j1 - j0, wj, out);
  for (int64_t j = 0; j < j1 - j0; ++j)
    for (int64_t r = 0; r < m; r += V::kI8Rows)
      I8WidenRows<float>(Min<int64_t>(V::kI8Rows, m - r), p, x + r * ldx, wj + j * kp * kI8Panel,
                         p.scale + j * kI8Panel, out + r * ldo + j * kI8Panel);
}

// Packed experts (see the top): gate/up [S, I/P, kpe/step, P, step], down [S, E/P, kpi/step, P, step], kpe / kpi
// their padded K (E / I rounded up to the layout's alignment); I and E whole panels. Float weights in x's dtype, or
// int8 ones (the int8 matmul's packed layout, P x step = 64 x 4) with their per-channel scales.
template <typename XT, typename WT>
void PackedExpertMlp(const Runner& run, const XT* x, int64_t T, int64_t E, const int32_t* slots, const float* weights,
                     int64_t topk, const WT* gate, const WT* up, const WT* down, const ExpertScales& scales, int64_t S,
                     int64_t I, int64_t kpe, int64_t kpi, XT* out) {
  constexpr bool int8 = std::is_same_v<WT, int8_t>;
  using X = std::conditional_t<int8, float, typename PackedTraits<XT>::X>;  // x's rows as the tiles read them
  constexpr int64_t P = int8 ? kI8Panel : PackedTraits<XT>::kPanel;
  // out[m, (j1 - j0) P] (row stride ldo) = rows [m, ldx] @ panels [j0, j1) of packed w (kp rows of K)
  auto panels = [](const X* xr, int64_t ldx, int64_t m, const WT* w, int64_t K, int64_t kp, const float* scale,
                   int64_t j0, int64_t j1, float* o, int64_t ldo) {
    if constexpr (int8) {
      I8ExpertPanels(xr, ldx, m, w, K, kp, scale, j0, j1, o, ldo);
    } else {
      for (int64_t j = j0; j < j1; ++j) PackedPanel<XT, float>(xr, ldx, 0, m, w + j * kp * P, K, o + (j - j0) * P, ldo);
    }
  };
  const PairGroups g = GroupPairs(slots, weights, T, topk, S);
  const int64_t threads = Max<int64_t>(1, run.threads);
  // x's rows padded to whole K steps (int8: to kpe, which the widened tiles read whole)
  constexpr int64_t step = PackedTraits<XT>::kStep;
  const int64_t ldx = int8 ? kpe : (E + step - 1) / step * step;
  thread_local Scratch xg_buf, h_buf, hb_buf;
  X* xg = xg_buf.Get<X>(static_cast<size_t>(g.pairs * ldx));  // the pairs' x rows, in slot order
  for (int64_t q = 0; q < g.pairs; ++q) TileRow(x + g.tok[q] * E, xg + q * ldx, E, ldx);
  const int64_t ldh = int8 ? kpi : I;
  float* h = h_buf.Get<float>(static_cast<size_t>(g.pairs * ldh));
  if (ldh != I)
    for (int64_t q = 0; q < g.pairs; ++q) std::memset(h + q * ldh + I, 0, (ldh - I) * sizeof(float));

  // 1. gate|up and SwiGLU into h: units of (selected expert, run of I's panels), about two per thread.
  const int64_t panels_i = I / P, gate_len = kpe * P;
  if (g.na) {
    const int64_t want = Min<int64_t>(panels_i, (2 * threads + g.na - 1) / g.na);
    const int64_t per = (panels_i + want - 1) / want, chunks = (panels_i + per - 1) / per;
    ParallelFor(run, g.na * chunks, [&](int64_t unit) {
      const int64_t s = g.active[unit / chunks], j0 = unit % chunks * per, j1 = Min<int64_t>(panels_i, j0 + per);
      const int64_t q0 = g.start[s], m = g.start[s + 1] - q0, width = (j1 - j0) * P;
      thread_local Scratch gu_buf;
      float* gs = gu_buf.Get<float>(static_cast<size_t>(2 * m * width));
      float* us = gs + m * width;
      const WT* gw = gate + s * panels_i * gate_len;
      const WT* uw = up + s * panels_i * gate_len;
      panels(xg + q0 * ldx, ldx, m, gw, E, kpe, int8 ? scales.gate + s * I : nullptr, j0, j1, gs, width);
      panels(xg + q0 * ldx, ldx, m, uw, E, kpe, int8 ? scales.up + s * I : nullptr, j0, j1, us, width);
      for (int64_t r = 0; r < m; ++r) {
        SwiGlu(gs + r * width, us + r * width, width);
        std::memcpy(h + (q0 + r) * ldh + j0 * P, gs + r * width, width * sizeof(float));
      }
    });
  }

  // h as the down tiles read it: float32, or bfloat16 pairs where the CPU has pair dot products (I is whole
  // panels: even).
  const X* hx;
  if constexpr (std::is_same_v<X, float>) {
    hx = h;
  } else {
    X* hb = hb_buf.Get<X>(static_cast<size_t>(g.pairs * I));
    for (int64_t q = 0; q < g.pairs; ++q) StoreRow<X>(h + q * I, hb + q * I, I);
    hx = hb;
  }

  // 2. down and the weighted combine, by runs of E's panels (one per thread: no two write one output element).
  const int64_t panels_e = E / P, down_len = kpi * P;
  const int64_t per = (panels_e + threads - 1) / threads, chunks = (panels_e + per - 1) / per;
  ParallelFor(run, chunks, [&](int64_t ci) {
    const int64_t j0 = ci * per, j1 = Min<int64_t>(panels_e, j0 + per), width = (j1 - j0) * P, c0 = j0 * P;
    thread_local Scratch y_buf, o_buf;
    float* y = y_buf.Get<float>(static_cast<size_t>(T * width));
    std::memset(y, 0, T * width * sizeof(float));
    for (int64_t a = 0; a < g.na; ++a) {
      const int64_t s = g.active[a], q0 = g.start[s], m = g.start[s + 1] - q0;
      float* o = o_buf.Get<float>(static_cast<size_t>(m * width));
      panels(hx + q0 * ldh, ldh, m, down + s * panels_e * down_len, I, kpi, int8 ? scales.down + s * E : nullptr,
             j0, j1, o, width);
      for (int64_t r = 0; r < m; ++r) AddScaled(y + g.tok[q0 + r] * width, o + r * width, g.wt[q0 + r], width);
    }
    for (int64_t t = 0; t < T; ++t) StoreRow<XT>(y + t * width, out + t * E + c0, width);
  });
}

void ExpertMlpEntry(const Runner& run, Dt dt, const void* x, int64_t T, int64_t E, const int32_t* slots,
                    const float* weights, int64_t topk, const void* gate, const void* up, const void* down,
                    const float* gate_scale, const float* up_scale, const float* down_scale, int64_t S, int64_t I,
                    int64_t kpe, int64_t kpi, void* out) {
  const ExpertScales sc{gate_scale, up_scale, down_scale};
  auto call = [&](auto x_type, auto w_type) {  // (values of the element types)
    using XT = decltype(x_type);
    using WT = decltype(w_type);
    auto xs = static_cast<const XT*>(x);
    auto g = static_cast<const WT*>(gate);
    auto u = static_cast<const WT*>(up);
    auto d = static_cast<const WT*>(down);
    if (kpe) return PackedExpertMlp<XT, WT>(run, xs, T, E, slots, weights, topk, g, u, d, sc, S, I, kpe, kpi,
                                            static_cast<XT*>(out));
    RowMajorExpertMlp<XT, WT>(run, xs, T, E, slots, weights, topk, g, u, d, sc, S, I, static_cast<XT*>(out));
  };
  if (dt == Dt::kF32) return gate_scale ? call(float{}, int8_t{}) : call(float{}, float{});
  gate_scale ? call(uint16_t{}, int8_t{}) : call(uint16_t{}, uint16_t{});
}
