// Matmuls for serving's shapes: few rows (a step's tokens) against a large weight, accumulated in float32.
// Included inside an instruction set's namespace (kernels.cc); written in V (simd.h).

// ---------------------------------------------------------------------------------------------------------
// Row-major weights w[K, N] (those not packed). Each thread owns a chunk of columns and walks K in blocks of
// kKBlock rows; inside a block it sweeps its columns panel by panel, so the weight is read once, as kKBlock
// sequential row streams the hardware prefetcher follows (a panel walked down all of K would touch a new page per
// row). Partial sums live in the output (float32) or a per-thread float32 buffer, reloaded once per block. A tile
// keeps RT rows x CB vectors of columns of accumulators in registers (CB shrinks as RT grows); larger M is cut
// into tiles of kMaxTileRows rows. Column tails are masked.
constexpr int64_t kKBlock = 16;
constexpr int64_t kPrefetchBytes = 256;  // ahead along each weight row

constexpr int CbFor(int rt) {
  if (V::kLanes == 16) return rt <= 2 ? 8 : rt <= 4 ? 6 : rt <= 6 ? 4 : rt <= 8 ? 3 : rt <= 12 ? 2 : 1;
  return V::kAccRegs / rt < 1 ? 1 : V::kAccRegs / rt > 8 ? 8 : V::kAccRegs / rt;
}
constexpr int64_t kMaxTileRows = V::kAccRegs < 16 ? V::kAccRegs : 16;

// x's block as a tile reads it: float32 (broadcast per row), or for bfloat16 pair dot products the (k, k+1)
// bfloat16 pairs as 32-bit words.
template <typename XT>
using TileX = std::conditional_t<std::is_same_v<XT, uint16_t> && V::kNativePairs, int32_t, float>;

// A tile's accumulators: zero for the first K block, else the partial sums so far.
template <int RT, int CB>
inline void LoadAcc(V::F (&acc)[RT][CB], const float* mem, int64_t lda, const V::M* masks, bool first) {
#pragma GCC unroll 16
  for (int r = 0; r < RT; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < CB; ++c) acc[r][c] = first ? V::Zero() : V::LoadM(mem + r * lda + V::kLanes * c, masks[c]);
}

template <int RT, int CB>
inline void StoreAcc(const V::F (&acc)[RT][CB], float* mem, int64_t lda, const V::M* masks) {
#pragma GCC unroll 16
  for (int r = 0; r < RT; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < CB; ++c) V::StoreM(mem + r * lda + V::kLanes * c, acc[r][c], masks[c]);
}

inline V::F LoadW(const float* p, V::M m) { return V::LoadM(p, m); }
inline V::F LoadW(const uint16_t* p, V::M m) { return V::LoadBf16M(p, m); }
inline V::F LoadW(const int8_t* p, V::M m) { return V::LoadI8M(p, m); }

// acc[RT][CB vectors] (+)= x[RT, k0:k0+kb] @ w[k0:k0+kb, columns], x as float32 and w float32 or bfloat16 (widened
// in registers). `xt` is the x block packed k-major, [kb][RT], so every broadcast is a constant offset from one
// pointer; w is offset to (k0, column).
template <int RT, int CB, typename WT>
inline void WidenTile(const float* __restrict xt, const WT* __restrict w, int64_t ldw, int64_t kb,
                      float* __restrict acc_mem, int64_t lda, const V::M* masks, bool first) {
  V::F acc[RT][CB];
  LoadAcc<RT, CB>(acc, acc_mem, lda, masks, first);
  for (int64_t k = 0; k < kb; ++k) {
    const WT* wk = w + k * ldw;
    PrefetchT0(reinterpret_cast<const char*>(wk) + kPrefetchBytes);
    V::F wv[CB];
#pragma GCC unroll 8
    for (int c = 0; c < CB; ++c) wv[c] = LoadW(wk + V::kLanes * c, masks[c]);
#pragma GCC unroll 16
    for (int r = 0; r < RT; ++r) {
      const V::F xv = V::Set1(xt[k * RT + r]);
#pragma GCC unroll 8
      for (int c = 0; c < CB; ++c) acc[r][c] = V::Fma(xv, wv[c], acc[r][c]);
    }
  }
  StoreAcc<RT, CB>(acc, acc_mem, lda, masks);
}

#if MESHSERVE_BF16_PAIRS
// bfloat16 with pair dot products: weight rows k and k+1 are interleaved on the fly into the pair layout,
// accumulating in float32. `xt` holds x's (k, k+1) pairs packed pair-major, [kb/2][RT] 32-bit words.
template <int RT, int CB>
inline void PairTile(const int32_t* __restrict xt, const uint16_t* __restrict w, int64_t ldw, int64_t kb,
                     float* __restrict acc_mem, int64_t lda, const V::M* masks, bool first) {
  V::F acc[RT][CB];
  LoadAcc<RT, CB>(acc, acc_mem, lda, masks, first);
  for (int64_t k = 0; k < kb; k += 2) {
    const uint16_t* w0 = w + k * ldw;
    const bool pair = k + 1 < kb;  // odd K: the last row pairs with zeros
    PrefetchT0(reinterpret_cast<const char*>(w0) + kPrefetchBytes);
    PrefetchT0(reinterpret_cast<const char*>(w0 + ldw) + kPrefetchBytes);
    V::WPair wv[CB];
#pragma GCC unroll 8
    for (int c = 0; c < CB; ++c)
      wv[c] = V::PairRows(w0 + V::kLanes * c, pair ? w0 + ldw + V::kLanes * c : nullptr, masks[c]);
#pragma GCC unroll 16
    for (int r = 0; r < RT; ++r) {
      const V::XPair xv = V::PairSet1(reinterpret_cast<const uint16_t*>(xt + (k / 2) * RT + r));
#pragma GCC unroll 8
      for (int c = 0; c < CB; ++c) acc[r][c] = V::PairDot(acc[r][c], xv, wv[c]);
    }
  }
  StoreAcc<RT, CB>(acc, acc_mem, lda, masks);
}
#endif

// Packs rows [m, m + rows) x columns [k0, k0 + kb) of x k-major: [kb][rows] (pairs: [kb/2][rows] words).
inline void PackX(const float* x, int64_t K, int64_t m, int64_t rows, int64_t k0, int64_t kb, float* xt) {
  for (int64_t k = 0; k < kb; ++k)
    for (int64_t r = 0; r < rows; ++r) xt[k * rows + r] = x[(m + r) * K + k0 + k];
}
inline void PackX(const uint16_t* x, int64_t K, int64_t m, int64_t rows, int64_t k0, int64_t kb, float* xt) {
  for (int64_t k = 0; k < kb; ++k)
    for (int64_t r = 0; r < rows; ++r) {
      const uint32_t b = static_cast<uint32_t>(x[(m + r) * K + k0 + k]) << 16;
      std::memcpy(xt + k * rows + r, &b, 4);
    }
}
inline void PackX(const uint16_t* x, int64_t K, int64_t m, int64_t rows, int64_t k0, int64_t kb, int32_t* xt) {
  for (int64_t k = 0; k < kb; k += 2)
    for (int64_t r = 0; r < rows; ++r) {
      int32_t v = x[(m + r) * K + k0 + k];
      if (k + 1 < kb) v |= static_cast<int32_t>(x[(m + r) * K + k0 + k + 1]) << 16;
      xt[(k / 2) * rows + r] = v;
    }
}

template <int RT, int CB, typename XT>
inline void Tile(const TileX<XT>* xt, const XT* w, int64_t ldw, int64_t kb, float* acc, int64_t lda,
                 const V::M* masks, bool first) {
#if MESHSERVE_BF16_PAIRS
  if constexpr (std::is_same_v<XT, uint16_t>)
    PairTile<RT, CB>(xt, w, ldw, kb, acc, lda, masks, first);
  else
#endif
    WidenTile<RT, CB, XT>(xt, w, ldw, kb, acc, lda, masks, first);
}

// A tile of `rows` <= RT rows in a panel of CbFor(RT) vectors (a remainder tile keeps the panel's width).
template <int RT, typename XT>
inline void TileRows(int64_t rows, const TileX<XT>* xt, const XT* w, int64_t ldw, int64_t kb, float* acc,
                     int64_t lda, const V::M* masks, bool first) {
  constexpr int CB = CbFor(RT);
  if (rows == RT) return Tile<RT, CB, XT>(xt, w, ldw, kb, acc, lda, masks, first);
  switch (rows) {
#define MESHSERVE_REM(n) \
  case n:                \
    if constexpr (n < RT) return Tile<n, CB, XT>(xt, w, ldw, kb, acc, lda, masks, first); \
    break;
    MESHSERVE_REM(1) MESHSERVE_REM(2) MESHSERVE_REM(3) MESHSERVE_REM(4) MESHSERVE_REM(5) MESHSERVE_REM(6)
    MESHSERVE_REM(7) MESHSERVE_REM(8) MESHSERVE_REM(9) MESHSERVE_REM(10) MESHSERVE_REM(11) MESHSERVE_REM(12)
    MESHSERVE_REM(13) MESHSERVE_REM(14) MESHSERVE_REM(15)
#undef MESHSERVE_REM
    default: break;
  }
}

template <int RT, typename XT, typename Out>
void MatmulRows(const Runner& run, const XT* x, int64_t M, int64_t K, const XT* w, int64_t N, Out* out) {
  constexpr int CB = CbFor(RT);
  constexpr int64_t panel = V::kLanes * CB;
  const int64_t per_chunk = ChunkUnits(N, panel, run.threads);
  const int64_t chunks = ((N + panel - 1) / panel + per_chunk - 1) / per_chunk;
  ParallelFor(run, chunks, [&](int64_t ci) {
    const int64_t c0 = ci * per_chunk * panel, c1 = Min<int64_t>(N, c0 + per_chunk * panel);
    const int64_t width = c1 - c0;
    float* acc;
    int64_t lda;
    thread_local Scratch scratch;
    if constexpr (std::is_same_v<Out, float>) {
      acc = out + c0;
      lda = N;
    } else {
      acc = scratch.Get<float>(static_cast<size_t>(M * width));
      lda = width;
    }
    const int64_t tiles = (M + RT - 1) / RT;
    thread_local Scratch xts_buf;
    TileX<XT>* xts = xts_buf.Get<TileX<XT>>(static_cast<size_t>(tiles * RT * kKBlock));
    for (int64_t k0 = 0; k0 < K; k0 += kKBlock) {
      const int64_t kb = Min<int64_t>(kKBlock, K - k0);
      for (int64_t t = 0; t < tiles; ++t)
        PackX(x, K, t * RT, Min<int64_t>(RT, M - t * RT), k0, kb, xts + t * RT * kKBlock);
      for (int64_t n0 = 0; n0 < width; n0 += panel) {
        V::M masks[CB];
        for (int c = 0; c < CB; ++c) masks[c] = V::Mask(width - n0 - V::kLanes * c);
        for (int64_t t = 0; t < tiles; ++t)
          TileRows<RT, XT>(Min<int64_t>(RT, M - t * RT), xts + t * RT * kKBlock, w + k0 * N + c0 + n0, N, kb,
                           acc + t * RT * lda + n0, lda, masks, k0 == 0);
      }
    }
    if constexpr (!std::is_same_v<Out, float>)
      for (int64_t m = 0; m < M; ++m) StoreRow<Out>(acc + m * lda, out + m * N + c0, width);
  });
}

// K rows one AMX tile step covers (32 bf16 = 64 bytes per A-tile row); packed bf16 panels pad K to it.
constexpr int64_t kAmxKStep = 32;

#if MESHSERVE_AMX
// ---------------------------------------------------------------------------------------------------------
// bfloat16 on AMX, for 8..16 rows (where the pair-dot-product tiles above run out of FMA throughput): x is the
// A tile (rows x 32 bf16), the weight is interleaved into the pair (VNNI) layout 16 columns x 32 rows at a
// time and multiplied into four 16 x 16 float32 C tiles (64 columns). C tiles stay in registers for
// kAmxKBlock rows of K, then go back to a float32 buffer. This table is handed out only once Linux has granted
// the process AMX state (cpu.cc).
constexpr int64_t kAmxKBlock = 128;
constexpr int64_t kAmxMinRows = 8;

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// B tile (VNNI): row p holds columns n..n+15 of weight rows k+2p and k+2p+1, interleaved; missing rows or
// columns are zero.
inline void PackB(const uint16_t* w, int64_t ldw, int64_t krows, V::M mask, uint16_t* b) {
  for (int64_t p = 0; p < kAmxKStep / 2; ++p) {
    const uint16_t* r0 = w + 2 * p * ldw;
    __m512i v = _mm512_setzero_si512();
    if (2 * p < krows) v = (__m512i)V::PairRows(r0, 2 * p + 1 < krows ? r0 + ldw : nullptr, mask);
    PrefetchT0(reinterpret_cast<const char*>(r0) + kPrefetchBytes);
    PrefetchT0(reinterpret_cast<const char*>(r0 + ldw) + kPrefetchBytes);
    _mm512_store_si512(b + 32 * p, v);
  }
}

template <typename Out>
void AmxMatmul(const Runner& run, const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, Out* out) {
  constexpr int64_t group = 64;  // columns per pass: four C tiles
  const int64_t per_chunk = ChunkUnits(N, group, run.threads);
  const int64_t chunks = ((N + group - 1) / group + per_chunk - 1) / per_chunk;
  const int64_t ksteps = (K + kAmxKStep - 1) / kAmxKStep;
  // x padded to whole K steps: the A tiles read [M, ksteps*32] with zeros past K.
  // (zeros unless K is whole steps)
  const int64_t ldx = K % kAmxKStep ? ksteps * kAmxKStep : K;
  Zeros<uint16_t> xpad(K % kAmxKStep ? static_cast<size_t>(M * ldx) : 0);
  const uint16_t* xa = x;
  if (K % kAmxKStep) {
    for (int64_t m = 0; m < M; ++m) std::memcpy(xpad.get() + m * ldx, x + m * K, K * 2);
    xa = xpad.get();
  }
  ParallelFor(run, chunks, [&](int64_t ci) {
    const int64_t c0 = ci * per_chunk * group, c1 = Min<int64_t>(N, c0 + per_chunk * group);
    const int64_t width = c1 - c0, padded = (width + group - 1) / group * group;
    thread_local Scratch acc_buf;
    float* acc = acc_buf.Get<float>(static_cast<size_t>(M * padded));
    alignas(64) uint16_t b[4][kAmxKStep * 16];
    TileConfig cfg;
    for (int t = 0; t < 4; ++t) cfg.rows[t] = static_cast<uint8_t>(M), cfg.colsb[t] = 64;  // C
    cfg.rows[4] = static_cast<uint8_t>(M), cfg.colsb[4] = 64;                            // A
    for (int t = 5; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;                     // B
    _tile_loadconfig(&cfg);
    for (int64_t k0 = 0; k0 < K; k0 += kAmxKBlock) {
      const int64_t k1 = Min<int64_t>(K, k0 + kAmxKBlock);
      for (int64_t n0 = 0; n0 < width; n0 += group) {
        float* cg = acc + n0;
        const int64_t stride = padded * 4;
        if (k0 == 0) {
          _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        } else {
          _tile_loadd(0, cg, stride); _tile_loadd(1, cg + 16, stride);
          _tile_loadd(2, cg + 32, stride); _tile_loadd(3, cg + 48, stride);
        }
        for (int64_t k = k0; k < k1; k += kAmxKStep) {
          const int64_t krows = Min<int64_t>(kAmxKStep, K - k);
          for (int j = 0; j < 4; ++j) PackB(w + k * N + c0 + n0 + 16 * j, N, krows, V::Mask(width - n0 - 16 * j), b[j]);
          _tile_loadd(4, xa + k, ldx * 2);
          _tile_loadd(5, b[0], 64); _tile_dpbf16ps(0, 4, 5);
          _tile_loadd(6, b[1], 64); _tile_dpbf16ps(1, 4, 6);
          _tile_loadd(7, b[2], 64); _tile_dpbf16ps(2, 4, 7);
          _tile_loadd(5, b[3], 64); _tile_dpbf16ps(3, 4, 5);
        }
        _tile_stored(0, cg, stride); _tile_stored(1, cg + 16, stride);
        _tile_stored(2, cg + 32, stride); _tile_stored(3, cg + 48, stride);
      }
    }
    _tile_release();
    for (int64_t m = 0; m < M; ++m) StoreRow<Out>(acc + m * padded, out + m * N + c0, width);
  });
}
#endif  // MESHSERVE_AMX

template <typename XT, typename Out>
void Matmul(const Runner& run, const XT* x, int64_t M, int64_t K, const XT* w, int64_t N, Out* out) {
#if MESHSERVE_AMX
  if constexpr (std::is_same_v<XT, uint16_t>)
    if (M >= kAmxMinRows && M <= kMaxTileRows) return AmxMatmul<Out>(run, x, M, K, w, N, out);
#endif
  switch (Min<int64_t>(M, kMaxTileRows)) {
#define MESHSERVE_ROWS(n) \
  case n:                 \
    if constexpr (n <= kMaxTileRows) return MatmulRows<n, XT, Out>(run, x, M, K, w, N, out); \
    return;
    MESHSERVE_ROWS(1) MESHSERVE_ROWS(2) MESHSERVE_ROWS(3) MESHSERVE_ROWS(4) MESHSERVE_ROWS(5) MESHSERVE_ROWS(6)
    MESHSERVE_ROWS(7) MESHSERVE_ROWS(8) MESHSERVE_ROWS(9) MESHSERVE_ROWS(10) MESHSERVE_ROWS(11)
    MESHSERVE_ROWS(12) MESHSERVE_ROWS(13) MESHSERVE_ROWS(14) MESHSERVE_ROWS(15) MESHSERVE_ROWS(16)
#undef MESHSERVE_ROWS
    default: return;
  }
}

void MatmulEntry(const Runner& run, Dt in, Dt out, const void* x, int64_t M, int64_t K, const void* w, int64_t N,
                 void* o) {
  if (in == Dt::kF32)
    return Matmul<float, float>(run, static_cast<const float*>(x), M, K, static_cast<const float*>(w), N,
                                static_cast<float*>(o));
  auto xp = static_cast<const uint16_t*>(x);
  auto wp = static_cast<const uint16_t*>(w);
  if (out == Dt::kBf16) return Matmul<uint16_t, uint16_t>(run, xp, M, K, wp, N, static_cast<uint16_t*>(o));
  Matmul<uint16_t, float>(run, xp, M, K, wp, N, static_cast<float*>(o));
}

// ---------------------------------------------------------------------------------------------------------
// Packed matmul: out[M, N] = x[M, K] @ W, with W packed once at load into panels of PW columns that are
// contiguous down K (`pack_weight` in pallas_kernels/native.py): float32 [N/32, K, 32, 1] (element (k, n) at
// [n/32, k, n%32, 0]); bfloat16 [N/64, Kp/2, 64, 2] with K zero-padded to Kp = a multiple of 32 and the rows
// k, k+1 of a column side by side (the pair layout of bfloat16 dot products and AMX B tiles). A thread streams
// whole panels front to back, one sequential stream per panel, and a tile's accumulators stay in registers (or
// AMX tiles) for all of K. Rows go in tiles of up to PackedTraits::kRows over the same panel; the first tile
// reads it from memory with its compute hidden under the reads, later tiles from L2. float32 panels are 32
// columns wide so that an AVX-512 tile holds 14 rows (28 accumulators): a 16-row decode step is nearly one pass.
constexpr int64_t kPackedMBlock = 224;  // rows per unit of work (x's block stays in L2 across the panels)
constexpr int64_t kPackedAhead = 4096;  // bytes ahead in each of a panel's streams, prefetched into L2
constexpr int kMaxStreams = 4;          // streams per panel for tiles of few rows (PackedTile)
// Where the CPU streams best from one sequential stream per panel (CpuOneStream: AMD), this far ahead in it.
constexpr int64_t kOneStreamAhead = 8192;
// bfloat16 below this many rows: vdpbf16ps over several streams reads faster than AMX (7.7-9.4 vs 10-10.9 ms for
// the 125M model's weights at 1-4 rows); from it, AMX's compute wins.
constexpr int64_t kAmxPackedMinRows = 5;

template <typename XT>
struct PackedTraits;
template <>
struct PackedTraits<float> {
  static constexpr int64_t kPanel = 32, kStep = 1;  // columns per panel, K rows per packed row
  static constexpr int kRows = V::kF32Rows;
  static constexpr int kSubCols = kPanel / V::kLanes;  // vectors of columns per tile of more than one row
  using X = float;                                     // x as the tile reads it
};
template <>
struct PackedTraits<uint16_t> {
  static constexpr int64_t kPanel = 64, kStep = 2;
  static constexpr int kRows = V::kBf16Rows;
  static constexpr int kSubCols = V::kBf16SubCols;
  using X = V::PairX;
};
constexpr int64_t kF32Panel = PackedTraits<float>::kPanel, kBf16Panel = PackedTraits<uint16_t>::kPanel;

// Vectors of columns a tile of RT rows covers: the whole panel for one row (one sequential stream), else kSubCols
// (a tile's accumulators must fit the registers; the panel is then read once per block of columns, from L2 after
// the first tile of rows).
template <typename XT, int RT>
constexpr int TileCols() {
  return RT == 1 ? static_cast<int>(PackedTraits<XT>::kPanel / V::kLanes) : PackedTraits<XT>::kSubCols;
}

// One packed row q (CB vectors of columns from the panel's vector c0, x kStep K rows) into a tile's accumulators.
// float32: x[r, q] broadcast; bfloat16: the pair x[r, 2q:2q+2] (x padded to even K). kStream: the panel comes from
// memory (the first column vector's pass prefetches ahead); a panel already in cache (matmul_int8.h's widened
// panels) needs no prefetch.
template <int RT, int CB, typename XT, bool kStream = true, int64_t kAhead = kPackedAhead>
inline void PackedStep(V::F (&acc)[RT][CB], const typename PackedTraits<XT>::X* __restrict x, int64_t ldx,
                       const XT* __restrict wp, int64_t q, int c0) {
  using T = PackedTraits<XT>;
  constexpr int64_t row_elems = T::kPanel * T::kStep;
  const XT* wq = wp + q * row_elems;
  if (kStream && c0 == 0) {
    const char* ahead = reinterpret_cast<const char*>(wq) + kAhead;
#pragma GCC unroll 4
    for (int64_t l = 0; l < row_elems * static_cast<int64_t>(sizeof(XT)); l += 64) PrefetchT1(ahead + l);
  }
  if constexpr (std::is_same_v<XT, float>) {
    const float* wc = wq + V::kLanes * c0;
    if constexpr (V::kLanes == 16) {  // 32 registers hold the panel row and every row's accumulators
      V::F wv[CB];
#pragma GCC unroll 4
      for (int c = 0; c < CB; ++c) wv[c] = V::Load(wc + V::kLanes * c);
#pragma GCC unroll 16
      for (int r = 0; r < RT; ++r) {
        const V::F xv = V::Set1(x[r * ldx + q]);
#pragma GCC unroll 4
        for (int c = 0; c < CB; ++c) acc[r][c] = V::Fma(xv, wv[c], acc[r][c]);
      }
    } else {  // fewer registers: the rows' broadcasts held, the panel row read a vector at a time
      V::F xv[RT];
#pragma GCC unroll 16
      for (int r = 0; r < RT; ++r) xv[r] = V::Set1(x[r * ldx + q]);
#pragma GCC unroll 16
      for (int c = 0; c < CB; ++c) {
        const V::F wv = V::Load(wc + V::kLanes * c);
#pragma GCC unroll 16
        for (int r = 0; r < RT; ++r) acc[r][c] = V::Fma(xv[r], wv, acc[r][c]);
      }
    }
  } else {
    const uint16_t* wc = wq + 2 * V::kLanes * c0;
    if constexpr (V::kLanes == 16 && V::kNativePairs) {
      V::WPair wv[CB];
#pragma GCC unroll 4
      for (int c = 0; c < CB; ++c) wv[c] = V::PairLoad(wc + 2 * V::kLanes * c);
#pragma GCC unroll 16
      for (int r = 0; r < RT; ++r) {
        const V::XPair xv = V::PairSet1(x + r * ldx + 2 * q);
#pragma GCC unroll 4
        for (int c = 0; c < CB; ++c) acc[r][c] = V::PairDot(acc[r][c], xv, wv[c]);
      }
    } else {
      V::XPair xv[RT];
#pragma GCC unroll 16
      for (int r = 0; r < RT; ++r) xv[r] = V::PairSet1(x + r * ldx + 2 * q);
#pragma GCC unroll 16
      for (int c = 0; c < CB; ++c) {
        const V::WPair wv = V::PairLoad(wc + 2 * V::kLanes * c);
#pragma GCC unroll 16
        for (int r = 0; r < RT; ++r) acc[r][c] = V::PairDot(acc[r][c], xv[r], wv);
      }
    }
  }
}

// RT rows x CB vectors of columns (from the panel's vector c0) over all of K. S > 1 reads the panel as S streams
// (K cut in S parts, each with its own accumulators, summed at the end): a core keeps more reads in flight over
// several streams than over one (~15 vs ~11 GB/s per core on the Xeon), which matters when few rows leave the
// loop waiting on memory. The AMD EPYC (Zen 5) streamed faster from one stream prefetched kOneStreamAhead ahead
// (mixtral-tiny's float32 batch-1 step 4.57 -> 4.33 ms, medians of three A/B runs; the int8 kernel's single stream
// was chosen there too), so there S is 1 (OneStream).
template <int RT, int CB, int S, typename XT, typename Out>
inline void PackedTile(const typename PackedTraits<XT>::X* __restrict x, int64_t ldx, const XT* __restrict wp,
                       int64_t K, Out* out, int64_t ldo, int c0) {
  using T = PackedTraits<XT>;
  V::F acc[S][RT][CB];
#pragma GCC unroll 4
  for (int s = 0; s < S; ++s)
#pragma GCC unroll 16
    for (int r = 0; r < RT; ++r)
#pragma GCC unroll 16
      for (int c = 0; c < CB; ++c) acc[s][r][c] = V::Zero();
  const int64_t steps = (K + T::kStep - 1) / T::kStep, part = steps / S;
  constexpr int64_t ahead = S == 1 ? kOneStreamAhead : kPackedAhead;
  for (int64_t q = 0; q < part; ++q)
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s) PackedStep<RT, CB, XT, true, ahead>(acc[s], x, ldx, wp, s * part + q, c0);
  for (int64_t q = S * part; q < steps; ++q) PackedStep<RT, CB, XT, true, ahead>(acc[0], x, ldx, wp, q, c0);
#pragma GCC unroll 16
  for (int r = 0; r < RT; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < CB; ++c) {
      V::F v = acc[0][r][c];
#pragma GCC unroll 4
      for (int s = 1; s < S; ++s) v = V::Add(v, acc[s][r][c]);
      StoreF32(out + r * ldo + V::kLanes * (c0 + c), v, V::Mask(V::kLanes));
    }
}

// Streams per panel for a tile of RT rows x CB vectors: as many as the accumulator registers allow, up to
// kMaxStreams.
template <int RT, int CB>
constexpr int PackedStreams() {
  constexpr int fit = V::kAccRegs / (RT * CB);
  return fit >= kMaxStreams ? kMaxStreams : fit < 1 ? 1 : fit;
}

template <typename XT, typename Out, int RT = PackedTraits<XT>::kRows>
inline void PackedRows(int64_t rows, const typename PackedTraits<XT>::X* x, int64_t ldx, const XT* wp, int64_t K,
                       Out* out, int64_t ldo) {
  if constexpr (RT > 1)
    if (rows < RT) return PackedRows<XT, Out, RT - 1>(rows, x, ldx, wp, K, out, ldo);
  constexpr int CB = TileCols<XT, RT>(), panel = PackedTraits<XT>::kPanel / V::kLanes;
  static_assert(panel % CB == 0, "a tile's columns must divide the panel");
  static const bool one_stream = CpuOneStream();
  for (int c0 = 0; c0 < panel; c0 += CB)
    if (one_stream)
      PackedTile<RT, CB, 1, XT, Out>(x, ldx, wp, K, out, ldo, c0);
    else
      PackedTile<RT, CB, PackedStreams<RT, CB>(), XT, Out>(x, ldx, wp, K, out, ldo, c0);
}

// Where bfloat16 pairs are two FMAs on halves widened in registers, a tile of several rows widens each weight
// vector once per tile; from V::kWidenPanelMinRows rows a panel is widened once, half at a time, into a float32
// [K, 32] panel in L2, and the float32 tiles run on it.

#if !MESHSERVE_BF16_PAIRS
// Columns [32h, 32h + 32) of bfloat16 panel `wp` (pair layout) as a float32 panel [K rounded up to even, 32].
inline void WidenHalfPanel(const uint16_t* wp, int64_t K, int h, float* dst) {
  constexpr int per = static_cast<int>(kF32Panel / V::kLanes);  // vectors per K row of the half
  for (int64_t q = 0; 2 * q < K; ++q) {
    const uint16_t* src = wp + q * 2 * kBf16Panel + 2 * kF32Panel * h;
    float* even = dst + 2 * q * kF32Panel;
#pragma GCC unroll 8
    for (int c = 0; c < per; ++c) {
      const V::WPair p = V::PairLoad(src + 2 * V::kLanes * c);
      V::Store(even + V::kLanes * c, p.even);
      V::Store(even + kF32Panel + V::kLanes * c, p.odd);
    }
  }
}
#endif

// Rows [m0, m1) of x (as the tiles read it, [., ldx]) times one packed panel `wp` (K rows) into out's columns
// [0, panel) (row stride ldo), on the calling thread.
template <typename XT, typename Out>
inline void PackedPanel(const typename PackedTraits<XT>::X* x, int64_t ldx, int64_t m0, int64_t m1, const XT* wp,
                        int64_t K, Out* out, int64_t ldo) {
  using T = PackedTraits<XT>;
#if !MESHSERVE_BF16_PAIRS
  if constexpr (std::is_same_v<XT, uint16_t>) {
    if (m1 - m0 >= V::kWidenPanelMinRows) {
      thread_local Scratch widened;
      float* f = widened.Get<float>(static_cast<size_t>((K + 1) * kF32Panel));
      for (int h = 0; h < 2; ++h) {
        WidenHalfPanel(wp, K, h, f);
        for (int64_t m = m0; m < m1; m += V::kF32Rows)
          PackedRows<float, Out>(Min<int64_t>(V::kF32Rows, m1 - m), x + m * ldx, ldx, f, K,
                                 out + m * ldo + h * kF32Panel, ldo);
      }
      return;
    }
  }
#endif
  for (int64_t m = m0; m < m1; m += T::kRows)
    PackedRows<XT, Out>(Min<int64_t>(T::kRows, m1 - m), x + m * ldx, ldx, wp, K, out + m * ldo, ldo);
}

// `panel_len`: elements per panel (f32: K*32; bf16: Kp*64). x comes as the tile reads it, [M, ldx].
template <typename XT, typename Out>
void PackedMatmul(const Runner& run, const typename PackedTraits<XT>::X* x, int64_t ldx, int64_t M, int64_t K,
                  const XT* w, int64_t panels, int64_t panel_len, Out* out) {
  using T = PackedTraits<XT>;
  const int64_t N = panels * T::kPanel;
  const int64_t per_chunk = ChunkUnits(N, T::kPanel, run.threads);
  const int64_t chunks = (panels + per_chunk - 1) / per_chunk, mblocks = (M + kPackedMBlock - 1) / kPackedMBlock;
  ParallelFor(run, chunks * mblocks, [&](int64_t unit) {
    const int64_t ci = unit % chunks, m0 = unit / chunks * kPackedMBlock;
    const int64_t j1 = Min<int64_t>(panels, (ci + 1) * per_chunk), m1 = Min<int64_t>(M, m0 + kPackedMBlock);
    for (int64_t j = ci * per_chunk; j < j1; ++j)
      PackedPanel<XT, Out>(x, ldx, m0, m1, w + j * panel_len, K, out + j * T::kPanel, N);
  });
}

#if MESHSERVE_AMX
// bfloat16 on AMX from the packed layout: B tiles (16 pair rows x 16 columns) load straight from the panel
// (row stride 256 bytes); A tiles are x's rows (K padded to Kp with zeros when K is not a multiple of 32). Four
// C tiles hold a 16-row x 64-column block for all of K.
template <typename Out>
void AmxPackedMatmul(const Runner& run, const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t panels,
                     int64_t kp, Out* out) {
  const int64_t N = panels * kBf16Panel;
  const int64_t ldx = K != kp ? kp : K;
  Zeros<uint16_t> xpad(K != kp ? static_cast<size_t>(M * kp) : 0);
  const uint16_t* xa = x;
  if (K != kp) {
    for (int64_t m = 0; m < M; ++m) std::memcpy(xpad.get() + m * kp, x + m * K, K * 2);
    xa = xpad.get();
  }
  const int64_t per_chunk = ChunkUnits(N, kBf16Panel, run.threads);
  const int64_t chunks = (panels + per_chunk - 1) / per_chunk, mblocks = (M + kPackedMBlock - 1) / kPackedMBlock;
  const int64_t panel_len = kp * kBf16Panel, ksteps = kp / kAmxKStep;
  ParallelFor(run, chunks * mblocks, [&](int64_t unit) {
    alignas(64) float cbuf[16 * kBf16Panel];
    int configured = 0;
    const int64_t ci = unit % chunks, mb = unit / chunks * kPackedMBlock;
    const int64_t j1 = Min<int64_t>(panels, (ci + 1) * per_chunk), me = Min<int64_t>(M, mb + kPackedMBlock);
    for (int64_t j = ci * per_chunk; j < j1; ++j) {
      const uint16_t* wp = w + j * panel_len;
      for (int64_t m0 = mb; m0 < me; m0 += 16) {
        const int rows = static_cast<int>(Min<int64_t>(16, me - m0));
        if (rows != configured) {
          TileConfig cfg;
          for (int t = 0; t < 4; ++t) cfg.rows[t] = static_cast<uint8_t>(rows), cfg.colsb[t] = 64;  // C
          cfg.rows[4] = static_cast<uint8_t>(rows), cfg.colsb[4] = 64;                            // A
          for (int t = 5; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;                        // B
          _tile_loadconfig(&cfg);
          configured = rows;
        }
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        const uint16_t* xr = xa + m0 * ldx;
        for (int64_t s = 0; s < ksteps; ++s) {
          const uint16_t* b = wp + s * kAmxKStep * kBf16Panel;  // 16 pair rows x 64 columns x 2
          const char* ahead = reinterpret_cast<const char*>(b) + 2 * kAmxKStep * kBf16Panel * 2;
          for (int l = 0; l < 64; l += 2) PrefetchT0(ahead + 64 * l);
          _tile_loadd(4, xr + s * kAmxKStep, ldx * 2);
          _tile_loadd(5, b, 256); _tile_dpbf16ps(0, 4, 5);
          _tile_loadd(6, b + 32, 256); _tile_dpbf16ps(1, 4, 6);
          _tile_loadd(7, b + 64, 256); _tile_dpbf16ps(2, 4, 7);
          _tile_loadd(5, b + 96, 256); _tile_dpbf16ps(3, 4, 5);
        }
        if constexpr (std::is_same_v<Out, float>) {
          float* o = out + m0 * N + j * kBf16Panel;
          _tile_stored(0, o, N * 4); _tile_stored(1, o + 16, N * 4);
          _tile_stored(2, o + 32, N * 4); _tile_stored(3, o + 48, N * 4);
        } else {
          _tile_stored(0, cbuf, kBf16Panel * 4); _tile_stored(1, cbuf + 16, kBf16Panel * 4);
          _tile_stored(2, cbuf + 32, kBf16Panel * 4); _tile_stored(3, cbuf + 48, kBf16Panel * 4);
          for (int r = 0; r < rows; ++r) StoreRow<Out>(cbuf + r * kBf16Panel, out + (m0 + r) * N + j * kBf16Panel, kBf16Panel);
        }
      }
    }
    if (configured) _tile_release();
  });
}
#endif  // MESHSERVE_AMX

// bfloat16 x as the packed tiles read it, [M, ke] with ke = K rounded up to even: pair words straight from x where
// K is even (else a copy padded by one zero column), or widened to float32 where the pairs are two FMAs.
inline const uint16_t* PairRowsOfX(const uint16_t* x, int64_t M, int64_t K, int64_t ke, Zeros<uint16_t>& copy) {
  if (ke == K) return x;
  for (int64_t m = 0; m < M; ++m) std::memcpy(copy.get() + m * ke, x + m * K, K * sizeof(uint16_t));
  return copy.get();
}
inline const float* PairRowsOfX(const uint16_t* x, int64_t M, int64_t K, int64_t ke, Zeros<float>& copy) {
  for (int64_t m = 0; m < M; ++m) ToF32(x + m * K, copy.get() + m * ke, K);
  return copy.get();
}

template <typename Out>
void PackedMatmulBf16(const Runner& run, const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t panels,
                      int64_t kw, Out* out) {
#if MESHSERVE_AMX
  if (M >= kAmxPackedMinRows) return AmxPackedMatmul<Out>(run, x, M, K, w, panels, kw, out);
#endif
  const int64_t ke = (K + 1) / 2 * 2;
  using X = V::PairX;
  Zeros<X> copy(std::is_same_v<X, uint16_t> && ke == K ? 0 : static_cast<size_t>(M * ke));
  PackedMatmul<uint16_t, Out>(run, PairRowsOfX(x, M, K, ke, copy), ke, M, K, w, panels, kw * kBf16Panel, out);
}

void MatmulPackedEntry(const Runner& run, Dt in, Dt out, const void* x, int64_t M, int64_t K, const void* w,
                       int64_t panels, int64_t kw, void* o) {
  if (in == Dt::kF32)
    return PackedMatmul<float, float>(run, static_cast<const float*>(x), K, M, K, static_cast<const float*>(w),
                                      panels, K * kF32Panel, static_cast<float*>(o));
  auto xp = static_cast<const uint16_t*>(x);
  auto wp = static_cast<const uint16_t*>(w);
  if (out == Dt::kF32) return PackedMatmulBf16<float>(run, xp, M, K, wp, panels, kw, static_cast<float*>(o));
  PackedMatmulBf16<uint16_t>(run, xp, M, K, wp, panels, kw, static_cast<uint16_t*>(o));
}
