// The LoRA update of a ragged batch (pallas_kernels/lora.py `lora_delta`), included inside an instruction set's
// namespace after matmul.h:
//
//   y[t] = (x[t] @ a[s][:r, :]^T) @ b[s][:r, :],   s = slots[t], r = ranks[s];   y[t] = 0 where s < 0, s >= S or r = 0
//
// with a [S, R, K] (A stored transposed: each rank row contiguous along K) and b [S, R, N] row-major in x's dtype.
// The tokens are grouped by slot (counting sort, token order kept), so each adapter's A and B are read once per
// call, and only up to the adapter's own rank: a slot no token uses is not read, and a rank-8 adapter in rank-64
// slots reads its first 8 rows of A and of B, contiguously. x's used rows are gathered once, in slot order
// (widened to float32, or kept in bfloat16 for pair dot products: below). Where the used slots share the work out
// evenly enough (no slot more than 1 / (2 x threads) of the call's multiply-adds: 8 adapters of one rank over 2 or 3
// threads), one parallel pass, a unit per slot: its tokens' x @ A^T, then @ B into their rows of y (a slot's tokens
// are its own, so no two units write one row). Otherwise two parallel passes over the caller's threads:
//   1. A: units of (slot, block of kLoraRankBlock rows of A), so one adapter's tokens keep every thread busy too;
//      dot products of the slot's token rows with those rows of A (widened in registers, or pair dot products; the
//      next tile's rows prefetched) -> xa[t, :r] (float32);
//   2. B: units of chunks of N's columns (no two threads write one element); each sweeps every used slot's B
//      columns with its tokens' xa rows, kLoraKBlock rows of B at a time, and writes their rows of y (rounded to
//      bfloat16 once, for bf16).
// The one-pass form hands work to the pool once per call, not twice, and no thread waits for the others between
// the passes: measured on Zen 3 (2 threads, the 84 calls of a ~125M Llama's decode step, 32 tokens over 8 rank-64
// adapters): 12.2 -> 9.9 ms of wall time per step, 21.5 -> 18.1 ms of CPU, bit-identical (the same sums in the same
// order).
// B's tiles: 4 rows, then single rows, of CbFor(rows) vectors of columns (LoraTile: float32 x against float32 or
// widened bfloat16 weights). At a decode step (a few tokens per adapter) both passes are mostly waiting on memory:
// every byte of A and B is used by only m tokens, hence the prefetches.
//
// bfloat16 stacks may come in other forms (api.h LoraLayout; the engine stores them so on the native path:
// pallas_kernels/lora.py `to_layout`, `stack_layouts`), in each of which an adapter's first r rows come first (in
// strips, first in each strip), so a rank-r adapter reads no further:
//  - B in strips (every path): each slot's B as strips of kLoraStrip columns (the last as narrow as N leaves it, a
//    multiple of 16), each strip's R / 2 pair rows contiguous, rows 2j and 2j + 1 of a column side by side. A tile of
//    a strip's columns (on AVX-512 the whole strip) reads one stream down the adapter's rows instead of 16 rows of
//    all N columns at a time. Where the CPU has no bfloat16 pair dot product, 2 x kLanes values widen with one load,
//    a shift and an and (SplitPairs) instead of two loads, two zero-extensions and two shifts: the same sums in the
//    same order as the row-major form, so bit-identical to it. Where it has one (avx512_bf16, amx, neon_bf16:
//    V::kNativePairs) the B pass rounds x @ A^T to bfloat16 (as PEFT's bfloat16 lora_A output is) and multiplies it
//    by B's pairs, one instruction per vector of columns and two rows.
//  - A in pairs (paths that widen bfloat16): rows 2j and 2j + 1 side by side along K, widened as B's pairs are.
//    Measured on Zen 3 (the step's 84 calls, 32 tokens over 8 rank-64 adapters; docs/lora.md): B in pairs with
//    KeepInRegister below, ~11% less CPU per step on one thread and ~6% less wall time on two; A in pairs too,
//    another ~5% and ~2%.
//  - A in blocks (paths with pair dot products): blocks of 4 rank rows, 32 columns of each side by side
//    (LoraBf16BlockDot): the A pass takes x's bfloat16 rows as they are against a block's 4 rows as one stream.
//    A row-major (K not a multiple of 32) is read a row at a time (LoraBf16Dot).
//  Measured on Zen 4 (avx512_bf16; the step's 84 calls chained, 32 tokens over 8 rank-64 adapters, alternated with
//  B in pairs of all N columns and A row-major): A alone ~15% less time, B alone ~28%, both ~15% (docs/lora.md).

// Below this many multiply-adds a call runs on the calling thread alone (one token's rank-8 update, 22K per call):
// handing it to the pool costs more than it saves. Measured in the engine on Zen 4 (2 cores, the step's calls run
// one after another): with 2M here a decode step's rank-8 update (32 tokens: 0.7M per call) ran serially and 8
// mixed rank-8 adapters cost +17% to +28% TPOT; at 128K, +7% to +14%, and batch 1 no slower.
constexpr int64_t kLoraSerialMacs = int64_t{1} << 17;
// Rows of A per unit of the A pass: a multiple of every LoraDot tile's rows of A (8), so no unit ends in single
// rows; 4 units per rank-64 adapter.
constexpr int64_t kLoraRankBlock = 16;
// Rows of B per sweep of a chunk's panels: as matmul.h's kKBlock, B is then read as 16 sequential row streams
// rather than a panel walked down all r rows (a row per 2N bytes). Measured on Zen 3 (8 rank-64 adapters, 32
// tokens): 16 and 32 rows alike, ~5% less CPU than one sweep of all 64 rows, 8 rows ~5% more.
constexpr int64_t kLoraKBlock = 16;

// A vector of weights, widened in registers where bfloat16: unmasked, for the panels' full vectors.
inline V::F LoadFull(const float* p) { return V::Load(p); }
inline V::F LoadFull(const uint16_t* p) { return V::LoadBf16(p); }

// out[RT rows, CB vectors of columns] (float32, row stride ldo) (+)= xt[kb][RT] @ w[kb, CB vectors] (row stride
// ldw): `first` starts from zero, else from out. Only the last vector may be partial (kTail: its first `tail`
// lanes). Not matmul.h's WidenTile: that one takes a run-time mask per vector, and GCC keeps the masked bfloat16
// load's copy through a buffer (a call to memcpy) inside the loop, so it spilled all 12 accumulators to the stack
// and reloaded them on every row of B (the B pass ran at about half the A pass's rate per multiply-add).
template <int RT, int CB, bool kTail, typename WT>
inline void LoraTile(const float* __restrict xt, const WT* __restrict w, int64_t ldw, int64_t kb,
                     float* __restrict out, int64_t ldo, V::M tail, bool first) {
  V::F acc[RT][CB];
#pragma GCC unroll 16
  for (int r = 0; r < RT; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < CB; ++c)
      acc[r][c] = first                  ? V::Zero()
                  : kTail && c == CB - 1 ? V::LoadM(out + r * ldo + V::kLanes * c, tail)
                                         : V::Load(out + r * ldo + V::kLanes * c);
  for (int64_t k = 0; k < kb; ++k) {
    const WT* wk = w + k * ldw;
    PrefetchT0(reinterpret_cast<const char*>(wk) + kPrefetchBytes);
    V::F wv[CB];
#pragma GCC unroll 8
    for (int c = 0; c < CB; ++c)
      wv[c] = kTail && c == CB - 1 ? LoadW(wk + V::kLanes * c, tail) : LoadFull(wk + V::kLanes * c);
#pragma GCC unroll 16
    for (int r = 0; r < RT; ++r) {
      const V::F xv = V::Set1(xt[k * RT + r]);
#pragma GCC unroll 8
      for (int c = 0; c < CB; ++c) acc[r][c] = V::Fma(xv, wv[c], acc[r][c]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < RT; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < CB; ++c) {
      if (kTail && c == CB - 1)
        V::StoreM(out + r * ldo + V::kLanes * c, acc[r][c], tail);
      else
        V::Store(out + r * ldo + V::kLanes * c, acc[r][c]);
    }
}

// The last columns of a row tile: a panel only as wide as they are (a rank-8 B row is one vector wide; a
// full-width panel would load and multiply masked-off vectors for nothing).
template <int RT, int CB, typename WT>
void LoraTail(const float* xt, const WT* w, int64_t ldw, int64_t kb, int64_t width, float* out, int64_t ldo,
              bool first) {
  if constexpr (CB > 1) {
    if (width <= V::kLanes * (CB - 1)) return LoraTail<RT, CB - 1, WT>(xt, w, ldw, kb, width, out, ldo, first);
  }
  const int64_t last = width - V::kLanes * (CB - 1);
  if (last == V::kLanes) return LoraTile<RT, CB, false, WT>(xt, w, ldw, kb, out, ldo, V::Mask(last), first);
  LoraTile<RT, CB, true, WT>(xt, w, ldw, kb, out, ldo, V::Mask(last), first);
}

template <int RT, typename WT>
void LoraColumns(const float* xt, const WT* w, int64_t ldw, int64_t kb, int64_t width, float* out, int64_t ldo,
                 bool first) {
  constexpr int CB = CbFor(RT);
  constexpr int64_t panel = V::kLanes * CB;
  int64_t c0 = 0;
  for (; c0 + panel <= width; c0 += panel)
    LoraTile<RT, CB, false, WT>(xt, w + c0, ldw, kb, out + c0, ldo, V::Mask(V::kLanes), first);
  if (c0 < width) LoraTail<RT, CB, WT>(xt, w + c0, ldw, kb, width - c0, out + c0, ldo, first);
}

// Columns per strip of B (kLoraStrips: LoraStripsB).
constexpr int64_t kLoraStrip = 64;
// Column vectors per tile of B's strips: AVX-512 a whole strip (16 accumulators), AVX2 and NEON 8 accumulators and 4
// widened vectors of B of their 16 registers (a quarter or an eighth of a strip).
constexpr int PairCb(int rt) { return V::kLanes == 16 ? 4 : rt >= 4 ? 2 : 4; }

// out[RT rows, CB vectors of columns] (float32, row stride ldo) (+)= x[:, :kb] @ w[kb, CB vectors], w a strip's rows
// in pairs (pair rows ldw apart: 2w; kb even) and x in pair form (PackLoraX: xt[(k / 2) * 2RT + 2r + k % 2] = x[r, k],
// as V::PairX: bfloat16 with pair dot products, else float32 and two FMAs): `first` starts from zero, else from out.
template <int RT, int CB>
inline void LoraPairTile(const V::PairX* __restrict xt, const uint16_t* __restrict w, int64_t ldw, int64_t kb,
                         int64_t ahead, float* __restrict out, int64_t ldo, bool first) {
  V::F acc[RT][CB];
#pragma GCC unroll 16
  for (int r = 0; r < RT; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < CB; ++c) acc[r][c] = first ? V::Zero() : V::Load(out + r * ldo + V::kLanes * c);
  for (int64_t k = 0; k < kb; k += 2) {
    const uint16_t* wk = w + (k / 2) * ldw;
    PrefetchT0(reinterpret_cast<const char*>(wk) + ahead);
    V::WPair wv[CB];
#pragma GCC unroll 8
    for (int c = 0; c < CB; ++c) wv[c] = V::PairLoad(wk + 2 * V::kLanes * c);
#pragma GCC unroll 16
    for (int r = 0; r < RT; ++r) {
      const V::XPair xv = V::PairSet1(xt + k * RT + 2 * r);
#pragma GCC unroll 8
      for (int c = 0; c < CB; ++c) acc[r][c] = V::PairDot(acc[r][c], xv, wv[c]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < RT; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < CB; ++c) V::Store(out + r * ldo + V::kLanes * c, acc[r][c]);
}

// Columns [0, width) of a row tile in a strip of B (width a multiple of kLanes): tiles of PairCb vectors, then single
// ones.
template <int RT>
void LoraPairColumns(const V::PairX* xt, const uint16_t* w, int64_t ldw, int64_t kb, int64_t ahead, int64_t width,
                     float* out,
                     int64_t ldo, bool first) {
  constexpr int CB = PairCb(RT);
  constexpr int64_t panel = V::kLanes * CB;
  int64_t c0 = 0;
  for (; c0 + panel <= width; c0 += panel) LoraPairTile<RT, CB>(xt, w + 2 * c0, ldw, kb, ahead, out + c0, ldo, first);
  for (; c0 < width; c0 += V::kLanes) LoraPairTile<RT, 1>(xt, w + 2 * c0, ldw, kb, ahead, out + c0, ldo, first);
}

// A row tile's x as B's pass reads it: row-major B takes xt[k * RT + r] = rows[r][k] (float32); B in pairs takes
// (k / 2) * 2RT + 2r + k % 2 in V::PairX (PackLoraX). A single row is read in place where its form is the row itself.
template <bool kPairs>
using LoraX = std::conditional_t<kPairs, V::PairX, float>;

template <int RT, bool kPairs>
const LoraX<kPairs>* PackLoraX(const float* const* rows, int64_t kb, LoraX<kPairs>* xt, Scratch& tmp) {
  if constexpr (!kPairs || std::is_same_v<V::PairX, float>) {
    if (RT == 1) return rows[0];
    for (int64_t k = 0; k < kb; ++k)
      for (int r = 0; r < RT; ++r) xt[kPairs ? (k / 2) * 2 * RT + 2 * r + k % 2 : k * RT + r] = rows[r][k];
    return xt;
  } else {  // pair dot products: x rounded to bfloat16 (as PEFT's bfloat16 lora_A output is), then paired
    uint16_t* xb = tmp.Get<uint16_t>(static_cast<size_t>(RT * kb));
    for (int r = 0; r < RT; ++r) StoreRow(rows[r], xb + r * kb, kb);
    if (RT == 1) return xb;
    for (int64_t q = 0; q < kb / 2; ++q)
      for (int r = 0; r < RT; ++r) std::memcpy(xt + q * 2 * RT + 2 * r, xb + r * kb + 2 * q, 2 * sizeof(uint16_t));
    return xt;
  }
}

// Calls f(rt, xp, i) for the rows' tiles: 4 token rows from row i (rt = integral_constant 4), then single rows (1), xp
// the tile's first kb values of each row in B's form (PackLoraX).
template <bool kPairs, typename F>
void LoraRowTiles(const float* const* rows, int64_t m, int64_t kb, F&& f) {
  constexpr int RT = 4;
  thread_local Scratch xt_buf, tmp_buf;
  auto* xt = xt_buf.Get<LoraX<kPairs>>(static_cast<size_t>(kb * RT));
  int64_t i = 0;
  for (; i + RT <= m; i += RT)
    f(std::integral_constant<int, RT>{}, PackLoraX<RT, kPairs>(rows + i, kb, xt, tmp_buf), i);
  for (; i < m; ++i) f(std::integral_constant<int, 1>{}, PackLoraX<1, kPairs>(rows + i, kb, xt, tmp_buf), i);
}

// out[i, :width] (float32, row stride ldo) = rows[i][:kb] @ w[:kb, :width] for i < m, w row-major (row stride ldw),
// kLoraKBlock rows of w at a time.
template <typename WT>
void LoraMatmul(const float* const* rows, int64_t m, int64_t kb, const WT* w, int64_t ldw, int64_t width, float* out,
                int64_t ldo) {
  LoraRowTiles<false>(rows, m, kb, [&](auto rt, const float* xp, int64_t i) {
    constexpr int kRt = decltype(rt)::value;
    for (int64_t k0 = 0; k0 < kb; k0 += kLoraKBlock)
      LoraColumns<kRt, WT>(xp + k0 * kRt, w + k0 * ldw, ldw, Min(kLoraKBlock, kb - k0), width, out + i * ldo, ldo,
                           k0 == 0);
  });
}

// B in strips (kLoraStrips): out[i, :width] (float32, row stride width) = rows[i][:r] @ b[:r, n0:n0 + width] for
// i < m, b one slot's B: strips of kLoraStrip columns (the last one as narrow as N leaves it), each strip's rows in
// pairs (rows 2j and 2j + 1 of a column side by side: element (k, n) at n0' R + (k / 2) 2w + 2 (n - n0') + k % 2 for
// the strip [n0', n0' + w) holding n), so a tile of a strip's columns reads one stream down all r rows (r rounded
// up to even: the row past an odd rank weighted by the zero its xa row holds there). n0, width: whole strips.
inline void LoraStripsB(const float* const* rows, int64_t m, int64_t r, const uint16_t* b, int64_t R, int64_t N,
                        int64_t n0, int64_t width, float* out) {
  const int64_t kb = r + (r & 1);
  LoraRowTiles<true>(rows, m, kb, [&](auto rt, const V::PairX* xp, int64_t i) {
    constexpr int kRt = decltype(rt)::value;
    // A tile as wide as a strip (AVX-512) walks down all r rows, prefetching the next pair row where the adapter
    // fills its slots (the strips are then one stream), else the same row of the next strip (a rank-8 adapter in
    // rank-64 slots reads 1 KB of each 8 KB strip: prefetching the next pair row, the step's calls for 8 such
    // adapters took 1.3x the time of B in pairs of all N columns; so, level with it; Zen 4). A narrower tile (AVX2,
    // NEON) takes kLoraKBlock rows at a time across the strip's columns, so the strip is still read in stream order,
    // and prefetches the next block's rows of its columns (a tile down all r rows, then the next, prefetching one row
    // ahead: the B pass ~55% slower than B in pairs of all N columns on Zen 4's avx2 path; so, ~15% faster).
    const bool whole = PairCb(kRt) * V::kLanes >= kLoraStrip;
    const int64_t kblock = whole ? kb : kLoraKBlock;
    for (int64_t n = n0; n < n0 + width; n += kLoraStrip) {
      const int64_t w = Min(kLoraStrip, N - n), ahead = whole ? (kb >= R ? 4 * w : 2 * R * w) : kLoraKBlock * 2 * w;
      for (int64_t k0 = 0; k0 < kb; k0 += kblock)
        LoraPairColumns<kRt>(xp + k0 * kRt, b + n * R + k0 * w, 2 * w, Min(kblock, kb - k0), ahead, w,
                             out + i * width + (n - n0), width, k0 == 0);
    }
  });
}

// Pins a loaded vector to a register: in LoraDotTile GCC otherwise folds each load of x into both of the tile's
// FMAs (10 loads per 8 FMAs, so the load ports bind before the FMA pipes). Measured on Zen 3 with the adapters in
// cache: 3-5% less time in the A pass.
template <typename Vec>
inline void KeepInRegister(Vec& v) {
#if defined(__x86_64__) && defined(__AVX__)
  __asm__("" : "+v"(v));
#else
  (void)v;
#endif
}

// A dot tile's step: acc[i][j] += x[i, k:k + kLanes] * av[j] for its RT token rows (x's vector kept in a register).
template <int RT, int RC>
inline void LoraDotStep(const float* __restrict x, int64_t K, int64_t k, const V::F* av, V::F (&acc)[RT][RC]) {
#pragma GCC unroll 8
  for (int i = 0; i < RT; ++i) {
    V::F xv = V::Load(x + i * K + k);
    if constexpr (RC > 1) KeepInRegister(xv);
#pragma GCC unroll 8
    for (int j = 0; j < RC; ++j) acc[i][j] = V::Fma(xv, av[j], acc[i][j]);
  }
}

// A dot tile's accumulators, zeroed.
template <int RT, int RC>
inline void LoraDotZero(V::F (&acc)[RT][RC]) {
#pragma GCC unroll 8
  for (int i = 0; i < RT; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < RC; ++j) acc[i][j] = V::Zero();
}

// The next dot tile's RC rows of A (row stride K) at column k, prefetched.
template <int RC, typename WT>
inline void LoraPrefetchNext(const WT* a, int64_t K, int64_t k) {
#pragma GCC unroll 8
  for (int j = 0; j < RC; ++j) PrefetchT0(a + (RC + j) * K + k);
}

// A dot tile's end: each accumulator's lanes summed into out[i, j].
template <int RT, int RC>
inline void LoraDotStore(const V::F (&acc)[RT][RC], float* out, int64_t ldo) {
  for (int i = 0; i < RT; ++i)
    for (int j = 0; j < RC; ++j) out[i * ldo + j] = V::ReduceAdd(acc[i][j]);
}

// out[i, j] (float32, row stride ldo) = x[i, :K] . a[j, :K] for i < RT, j < RC: RT token rows (float32, row stride
// K) against RC rows of A (float32 or bfloat16 widened in registers), each product summed along K in vector lanes
// and reduced once at the end. The RC rows after these (the next tile's, contiguous in A) are prefetched as the
// tile goes: a tile's 4 tokens leave the FMA pipes idle while a cold row of A streams in, and one slot's rows are
// too short a stream for the hardware prefetcher to get ahead of (measured on Zen 3, 8 rank-64 adapters, 32
// tokens: ~18% less CPU per step; two tiles ahead no better).
template <int RT, int RC, typename WT>
inline void LoraDotTile(const float* __restrict x, const WT* __restrict a, int64_t K, float* __restrict out,
                        int64_t ldo) {
  V::F acc[RT][RC];
  LoraDotZero<RT, RC>(acc);
  int64_t k = 0;
  for (; k + V::kLanes <= K; k += V::kLanes) {
    LoraPrefetchNext<RC>(a, K, k);
    V::F av[RC];
#pragma GCC unroll 8
    for (int j = 0; j < RC; ++j) av[j] = LoadFull(a + j * K + k);
    LoraDotStep<RT, RC>(x, K, k, av, acc);
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
  LoraDotStore<RT, RC>(acc, out, ldo);
}

// RT token rows against r rows of A: tiles of RC rows of A, then single ones.
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

// The same with A in pairs too (rows 2p and 2p + 1 side by side along K: row stride 2K per pair; K a multiple of
// 16): RC rows from an even row (RC even: RC / 2 pairs, each widened by SplitPairs from one load; RC = 1: a pair's
// even row).
template <int RT, int RC>
inline void LoraDotPairTile(const float* __restrict x, const uint16_t* __restrict a, int64_t K, float* __restrict out,
                            int64_t ldo) {
  constexpr int RP = (RC + 1) / 2;
  V::F acc[RT][RC];
  LoraDotZero<RT, RC>(acc);
  for (int64_t k = 0; k < K; k += V::kLanes) {
#pragma GCC unroll 4
    for (int p = 0; p < RP; ++p) PrefetchT0(a + (RP + p) * 2 * K + 2 * k);
    V::F av[2 * RP];
#pragma GCC unroll 4
    for (int p = 0; p < RP; ++p) VOps::SplitPairs(a + p * 2 * K + 2 * k, &av[2 * p], &av[2 * p + 1]);
    LoraDotStep<RT, RC>(x, K, k, av, acc);
  }
  LoraDotStore<RT, RC>(acc, out, ldo);
}

template <int RT, int RC>
void LoraDotPairRows(const float* x, const uint16_t* a, int64_t K, int64_t r, float* out, int64_t ldo) {
  int64_t j = 0;
  for (; j + RC <= r; j += RC) LoraDotPairTile<RT, RC>(x, a + j * K, K, out + j, ldo);
  for (; j + 2 <= r; j += 2) LoraDotPairTile<RT, 2>(x, a + j * K, K, out + j, ldo);
  if (j < r) LoraDotPairTile<RT, 1>(x, a + j * K, K, out + j, ldo);
}

// LoraDot on A in pairs (a: its first pair; r rows from there).
inline void LoraDotPairs(const float* x, int64_t m, int64_t K, const uint16_t* a, int64_t r, float* out,
                         int64_t ldo) {
  int64_t i = 0;
  for (; i + 4 <= m; i += 4) LoraDotPairRows<4, 2>(x + i * K, a, K, r, out + i * ldo, ldo);
  for (; i + 2 <= m; i += 2) LoraDotPairRows<2, 4>(x + i * K, a, K, r, out + i * ldo, ldo);
  for (; i < m; ++i) LoraDotPairRows<1, 8>(x + i * K, a, K, r, out + i * ldo, ldo);
}

#if MESHSERVE_BF16_PAIRS
inline float Bf16Value(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// out[i, j] (float32, row stride ldo) = x[i, :K] . a[j, :K] for i < RT, j < RC, x and A both bfloat16 and
// row-major, by the CPU's pair dot product over 2 x kLanes columns a step (nothing widened), each accumulator's
// lanes summed at the end and K's last columns (fewer than a step) in scalar. The next tile's rows of A prefetched.
template <int RT, int RC>
inline void LoraBf16DotTile(const uint16_t* __restrict x, const uint16_t* __restrict a, int64_t K,
                            float* __restrict out, int64_t ldo) {
  constexpr int64_t kStep = 2 * V::kLanes;
  V::F acc[RT][RC];
  LoraDotZero<RT, RC>(acc);
  int64_t k = 0;
  for (; k + kStep <= K; k += kStep) {
    LoraPrefetchNext<RC>(a, K, k);
    V::WPair av[RC];
#pragma GCC unroll 8
    for (int j = 0; j < RC; ++j) av[j] = V::PairLoad(a + j * K + k);
#pragma GCC unroll 8
    for (int i = 0; i < RT; ++i) {
      V::WPair xv = V::PairLoad(x + i * K + k);
      if constexpr (RC > 1) KeepInRegister(xv);
#pragma GCC unroll 8
      for (int j = 0; j < RC; ++j) acc[i][j] = V::PairDot(acc[i][j], xv, av[j]);
    }
  }
  LoraDotStore<RT, RC>(acc, out, ldo);
  for (; k < K; ++k)
    for (int i = 0; i < RT; ++i)
      for (int j = 0; j < RC; ++j) out[i * ldo + j] += Bf16Value(x[i * K + k]) * Bf16Value(a[j * K + k]);
}

template <int RT, int RC>
void LoraBf16DotRows(const uint16_t* x, const uint16_t* a, int64_t K, int64_t r, float* out, int64_t ldo) {
  int64_t j = 0;
  for (; j + RC <= r; j += RC) LoraBf16DotTile<RT, RC>(x, a + j * K, K, out + j, ldo);
  for (; j < r; ++j) LoraBf16DotTile<RT, 1>(x, a + j * K, K, out + j, ldo);
}

// LoraDot with x in bfloat16 and A row-major, by pair dot products. Up to 4 tokens (a decode step's share of one
// adapter: each row of A is used by these tokens only, so it streams in from memory) a tile reads one row of A at a
// time: a tile of 4 rows read them as 4 short streams (a rank-64 adapter's rows of a 768-wide projection are 1.5 KB
// each) and ran the A pass of 8 such adapters ~25% slower (Zen 4, the step's 84 calls). More tokens: blocks of 4
// rows of A, each block used by every group of 4 tokens while it is in L1 (compute then binds: 4 x 4 tiles).
inline void LoraBf16Dot(const uint16_t* x, int64_t m, int64_t K, const uint16_t* a, int64_t r, float* out,
                        int64_t ldo) {
  if (m <= 4) {
    if (m == 4) return LoraBf16DotRows<4, 1>(x, a, K, r, out, ldo);
    for (int64_t i = 0; i < m; ++i) LoraBf16DotRows<1, 1>(x + i * K, a, K, r, out + i * ldo, ldo);
    return;
  }
  for (int64_t j = 0; j < r; j += 4) {
    const int64_t rows = Min<int64_t>(4, r - j);
    int64_t i = 0;
    for (; i + 4 <= m; i += 4) LoraBf16DotRows<4, 4>(x + i * K, a + j * K, K, rows, out + i * ldo + j, ldo);
    for (; i < m; ++i) LoraBf16DotRows<1, 4>(x + i * K, a + j * K, K, rows, out + i * ldo + j, ldo);
  }
}

// A in blocks (kLoraBlocks), for the paths with pair dot products: each slot's A [R, K] as R / 4 blocks of 4 rank rows,
// a block as K / 32 chunks of its 4 rows' 32 columns side by side (element (j, k) at (j / 4) 4K + (k / 32) 128 +
// (j % 4) 32 + k % 32; 64 bytes of each row, a chunk 4 cache lines), so a tile of a block's 4 rows reads one stream and
// a rank-r adapter's first ceil(r / 4) blocks are one stream too. The rows-layout tile (LoraBf16Dot) reads one row at
// a time at a decode step, 4 accumulators each waiting on the pair dot product's latency, or 4 rows as 4 short
// streams. Measured on Zen 4 (the step's 84 calls, A alone, 32 tokens over 8 rank-64 adapters): ~15% less time.
constexpr int64_t kLoraABlock = 4, kLoraAChunk = 32;
// Bytes ahead along a block's stream, prefetched: two chunks (1 to 8 measured alike on Zen 4).
constexpr int64_t kLoraAAhead = 512;

// out[i, j] (float32, row stride ldo) = x[i, :K] . a[j, :K] for i < RT and j < rc (at most 4: a block's rows up to
// the rank; the rest of out left alone), x bfloat16 rows (row stride K), blk one block of A.
template <int RT>
inline void LoraBf16BlockTile(const uint16_t* __restrict x, const uint16_t* __restrict blk, int64_t K, int64_t rc,
                              float* __restrict out, int64_t ldo) {
  constexpr int64_t kStep = 2 * V::kLanes;
  V::F acc[RT][kLoraABlock];
  LoraDotZero<RT, kLoraABlock>(acc);
  for (int64_t c = 0; c < K; c += kLoraAChunk) {
    const uint16_t* ch = blk + c * kLoraABlock;
#pragma GCC unroll 4
    for (int l = 0; l < 4; ++l) PrefetchT0(reinterpret_cast<const char*>(ch) + kLoraAAhead + 64 * l);
#pragma GCC unroll 4
    for (int64_t k = 0; k < kLoraAChunk; k += kStep) {
      V::WPair av[kLoraABlock];
#pragma GCC unroll 4
      for (int j = 0; j < kLoraABlock; ++j) av[j] = V::PairLoad(ch + j * kLoraAChunk + k);
#pragma GCC unroll 4
      for (int i = 0; i < RT; ++i) {
        V::WPair xv = V::PairLoad(x + i * K + c + k);
        KeepInRegister(xv);
#pragma GCC unroll 4
        for (int j = 0; j < kLoraABlock; ++j) acc[i][j] = V::PairDot(acc[i][j], xv, av[j]);
      }
    }
  }
  for (int i = 0; i < RT; ++i)
    for (int64_t j = 0; j < rc; ++j) out[i * ldo + j] = V::ReduceAdd(acc[i][j]);
}

// LoraBf16Dot on A in blocks (a: its first block; r rows from there): a block at a time, used by every group of 4
// tokens while it is in L1.
inline void LoraBf16BlockDot(const uint16_t* x, int64_t m, int64_t K, const uint16_t* a, int64_t r, float* out,
                             int64_t ldo) {
  for (int64_t j = 0; j < r; j += kLoraABlock) {
    const uint16_t* blk = a + j * K;
    const int64_t rc = Min(kLoraABlock, r - j);
    int64_t i = 0;
    for (; i + 4 <= m; i += 4) LoraBf16BlockTile<4>(x + i * K, blk, K, rc, out + i * ldo + j, ldo);
    switch (m - i) {
      case 3: LoraBf16BlockTile<3>(x + i * K, blk, K, rc, out + i * ldo + j, ldo); break;
      case 2: LoraBf16BlockTile<2>(x + i * K, blk, K, rc, out + i * ldo + j, ldo); break;
      case 1: LoraBf16BlockTile<1>(x + i * K, blk, K, rc, out + i * ldo + j, ldo); break;
      default: break;
    }
  }
}
#endif

// Whether the A pass takes x in bfloat16 by pair dot products: a path that has them, bfloat16, A row-major.
template <typename T>
constexpr bool LoraBf16A(int32_t a_layout) {
  return V::kNativePairs && std::is_same_v<T, uint16_t> && a_layout != kLoraPairs;
}

// The A pass on x's rows in its form (LoraBf16A: bfloat16, else float32): A row-major, or (a_pairs: bfloat16 only)
// in pairs.
template <typename WT>
void LoraDotA(int32_t a_layout, const void* x, int64_t m, int64_t K, const WT* a, int64_t r, float* out, int64_t ldo) {
#if MESHSERVE_BF16_PAIRS
  if constexpr (std::is_same_v<WT, uint16_t>)
    if (LoraBf16A<WT>(a_layout)) {
      const auto* xb = static_cast<const uint16_t*>(x);
      if (a_layout == kLoraBlocks) return LoraBf16BlockDot(xb, m, K, a, r, out, ldo);
      return LoraBf16Dot(xb, m, K, a, r, out, ldo);
    }
#endif
  const float* xf = static_cast<const float*>(x);
  if constexpr (std::is_same_v<WT, uint16_t>)
    if (a_layout == kLoraPairs) return LoraDotPairs(xf, m, K, a, r, out, ldo);
  LoraDot(xf, m, K, a, r, out, ldo);
}

// x's rows order[0, m) in the A pass's form, into buf.
template <typename T>
const void* LoraXRows(int32_t a_layout, const T* x, int64_t K, const int64_t* order, int64_t m, Scratch& buf) {
  if constexpr (std::is_same_v<T, uint16_t>) {
    if (LoraBf16A<T>(a_layout)) {
      uint16_t* d = buf.Get<uint16_t>(static_cast<size_t>(m * K));
      for (int64_t i = 0; i < m; ++i) std::memcpy(d + i * K, x + order[i] * K, static_cast<size_t>(K) * sizeof(T));
      return d;
    }
  }
  float* d = buf.Get<float>(static_cast<size_t>(m * K));
  for (int64_t i = 0; i < m; ++i) ToF32(x + order[i] * K, d + i * K, K);
  return d;
}

// LoraMatmul on B's columns [n0, n0 + width) of slot s: row-major, or (b_strips: bfloat16 only) in strips.
template <typename WT>
void LoraMatmulB(bool b_strips, const float* const* rows, int64_t m, int64_t r, const WT* b_slot, int64_t R, int64_t N,
                 int64_t n0, int64_t width, float* out) {
  if constexpr (std::is_same_v<WT, uint16_t>)
    if (b_strips) return LoraStripsB(rows, m, r, b_slot, R, N, n0, width, out);
  LoraMatmul(rows, m, r, b_slot + n0, N, width, out, width);
}

// One part of a call: a projection's ranks [S] and its output columns (the int8 kernel takes several projections
// of one x at once: q|k|v, gate|up).
struct LoraRanks {
  const int32_t* ranks;
  int64_t N;
};

constexpr int64_t kLoraMaxParts = 4;  // projections of one x per call (api.h LoraPart, LoraInt8Part)

// The call's tokens grouped by slot (counting sort, token order kept; those of no slot, or of rank 0 in every part,
// left out): slot s's tokens are order[start[s], start[s + 1]), the slots any token uses used[0, num_used).
struct LoraGroups {
  Zeros<int64_t> start_buf, order_buf;
  Zeros<int32_t> used_buf;
  const int32_t* slots;
  LoraRanks parts[kLoraMaxParts];
  int64_t G, T, S, R, K;
  int64_t *start, *order;
  int32_t* used;
  int64_t used_tokens = 0, num_used = 0, macs = 0;  // macs: the update's multiply-adds

  // parts_: G (at most kLoraMaxParts: ffi.cc refuses more) of api.h's LoraPart or LoraInt8Part.
  template <typename Part>
  LoraGroups(const int32_t* slots_, int64_t T_, const Part* parts_, int64_t G_, int64_t S_, int64_t R_, int64_t K_)
      : start_buf(static_cast<size_t>(S_ + 1)), order_buf(static_cast<size_t>(T_)), used_buf(static_cast<size_t>(S_)),
        slots(slots_), G(G_), T(T_), S(S_), R(R_), K(K_), start(start_buf.get()), order(order_buf.get()),
        used(used_buf.get()) {
    for (int64_t g = 0; g < G; ++g) parts[g] = {parts_[g].ranks, parts_[g].N};
    for (int64_t t = 0; t < T_; ++t)
      if (rank(slots[t])) ++start[slots[t] + 1], macs += slot_macs(slots[t]);
    for (int64_t s = 0; s < S; ++s) start[s + 1] += start[s];
    used_tokens = start[S];
    Zeros<int64_t> fill_buf(static_cast<size_t>(S));
    int64_t* fill = fill_buf.get();
    for (int64_t t = 0; t < T_; ++t)
      if (rank(slots[t])) order[start[slots[t]] + fill[slots[t]]++] = t;
    for (int64_t s = 0; s < S; ++s)
      if (start[s + 1] > start[s]) used[num_used++] = static_cast<int32_t>(s);
  }
  // Part g's rank of slot s (0: none), and the largest over the parts.
  int64_t rank(int64_t g, int32_t s) const { return s >= 0 && s < S ? Clamp<int64_t>(parts[g].ranks[s], 0, R) : 0; }
  int64_t rank(int32_t s) const {
    int64_t r = 0;
    for (int64_t g = 0; g < G; ++g) r = Max(r, rank(g, s));
    return r;
  }
  // A token of slot s's multiply-adds over the parts.
  int64_t slot_macs(int32_t s) const {
    int64_t n = 0;
    for (int64_t g = 0; g < G; ++g) n += rank(g, s) * (K + parts[g].N);
    return n;
  }
  int64_t tokens(int32_t s) const { return start[s + 1] - start[s]; }
  int64_t most_tokens() const {
    int64_t most = 0;
    for (int64_t u = 0; u < num_used; ++u) most = Max<int64_t>(most, tokens(used[u]));
    return most;
  }
  // Zeroes part g's y [T, N] rows of the tokens it leaves alone: the kernels write every column of the others'.
  template <typename T_>
  void zero_unused_rows(int64_t g, T_* y) const {
    const int64_t N = parts[g].N;
    for (int64_t t = 0; t < T; ++t)
      if (!rank(g, slots[t])) std::memset(y + t * N, 0, static_cast<size_t>(N) * sizeof(T_));
  }
  // The B pass's units in the two-pass form: each part's columns in chunks of whole `unit`s spread over `threads`
  // (ChunkUnits), as (part, first column, width) at units[3 c] (units null: only counted); returns their count.
  int64_t column_chunks(int64_t unit, int64_t threads, int64_t* units) const {
    int64_t c = 0;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t N = parts[g].N, chunk = unit * ChunkUnits(N, unit, threads);
      for (int64_t n0 = 0; n0 < N; n0 += chunk, ++c)
        if (units) units[3 * c] = g, units[3 * c + 1] = n0, units[3 * c + 2] = Min(chunk, N - n0);
    }
    return c;
  }
  // The call's runner: the caller's thread alone below kLoraSerialMacs.
  const Runner& runner(const Runner& run) const {
    static const Runner serial{nullptr, 1, nullptr};
    return macs < kLoraSerialMacs ? serial : run;
  }
  // Whether the kernels take one parallel pass, a unit per used slot: no slot holds more than 1 / (2 x threads) of
  // the multiply-adds (the file's header).
  bool one_pass(const Runner& par) const {
    int64_t most = 0;
    for (int64_t u = 0; u < num_used; ++u) most = Max<int64_t>(most, tokens(used[u]) * slot_macs(used[u]));
    return par.threads > 1 && most * 2 * par.threads <= macs;
  }
};

template <typename T>
void LoraImpl(const Runner& run, const T* x, int64_t T_, int64_t K, const int32_t* slots, const LoraPart* parts,
              int64_t G, int32_t a_layout, int32_t b_layout, int64_t S, int64_t R) {
  const bool b_strips = b_layout == kLoraStrips;
  const LoraGroups g(slots, T_, parts, G, S, R, K);
  for (int64_t p = 0; p < G; ++p) g.zero_unused_rows(p, static_cast<T*>(parts[p].y));
  if (!g.used_tokens) return;
  const int64_t used = g.used_tokens, *start = g.start, *order = g.order;
  const Runner& par = g.runner(run);
  Zeros<float> xa(static_cast<size_t>(used * G * R));  // part p's row i: sorted token i's x @ A_p^T
  auto xa_of = [&](int64_t p, int64_t i) { return xa.get() + (p * used + i) * R; };
  auto a_of = [&](int64_t p, int64_t s) { return static_cast<const T*>(parts[p].a) + s * R * K; };

  // Part p's slot s's B: y's rows of its tokens, columns [n0, n0 + width) = their xa rows @ b[s][:r, n0:n0 + width]
  // (out and rows: the caller's scratch, m x width floats and m pointers).
  auto apply_b = [&](int64_t p, int32_t s, int64_t n0, int64_t width, float* out, const float** rows) {
    const int64_t m = g.tokens(s), N = parts[p].N;
    for (int64_t i = 0; i < m; ++i) rows[i] = xa_of(p, start[s] + i);
    LoraMatmulB(b_strips, rows, m, g.rank(p, s), static_cast<const T*>(parts[p].b) + s * R * N, R, N, n0, width, out);
    T* y = static_cast<T*>(parts[p].y);
    for (int64_t i = 0; i < m; ++i) StoreRow(out + i * width, y + order[start[s] + i] * N + n0, width);
  };

  // One pass, a unit per used slot, where no slot holds more than 1 / (2 x threads) of the multiply-adds: its x rows,
  // then each part that updates it.
  if (g.one_pass(par)) {
    ParallelFor(par, g.num_used, [&](int64_t u) {
      const int32_t s = g.used[u];
      const int64_t m = g.tokens(s);
      thread_local Scratch xs_buf, out_buf, ptr_buf;
      const void* xs = LoraXRows(a_layout, x, K, order + start[s], m, xs_buf);
      for (int64_t p = 0; p < G; ++p) {
        const int64_t r = g.rank(p, s), N = parts[p].N;
        if (!r) continue;
        LoraDotA(a_layout, xs, m, K, a_of(p, s), r, xa_of(p, start[s]), R);
        apply_b(p, s, 0, N, out_buf.Get<float>(static_cast<size_t>(m * N)),
                ptr_buf.Get<const float*>(static_cast<size_t>(m)));
      }
    });
    return;
  }

  // x's used rows in slot order, in the A pass's form: once per call, not once per unit of the A pass.
  thread_local Scratch x_buf;
  const char* xg = static_cast<const char*>(LoraXRows(a_layout, x, K, order, used, x_buf));
  const int64_t x_row = K * (LoraBf16A<T>(a_layout) ? sizeof(uint16_t) : sizeof(float));

  // 1. A: units of (part, used slot, block of kLoraRankBlock rows of A); a unit reads its slot's token rows (in cache
  // after the slot's first unit) and its own rows of A.
  int64_t num_units = 0;
  for (int64_t p = 0; p < G; ++p)
    for (int64_t u = 0; u < g.num_used; ++u) num_units += (g.rank(p, g.used[u]) + kLoraRankBlock - 1) / kLoraRankBlock;
  // 2. B: per part, chunks of its N's columns (whole strips), every used slot.
  const int64_t unit = b_strips ? kLoraStrip : V::kLanes * CbFor(4);
  const int64_t num_chunks = g.column_chunks(unit, par.threads, nullptr);
  Zeros<int64_t> unit_buf(static_cast<size_t>(3 * Max(num_units, num_chunks)));  // per unit: 3 numbers
  int64_t* units = unit_buf.get();
  int64_t n = 0;
  for (int64_t p = 0; p < G; ++p)
    for (int64_t u = 0; u < g.num_used; ++u)
      for (int64_t j = 0; j < g.rank(p, g.used[u]); j += kLoraRankBlock, ++n)
        units[3 * n] = p, units[3 * n + 1] = g.used[u], units[3 * n + 2] = j;
  ParallelFor(par, num_units, [&](int64_t c) {
    const int64_t p = units[3 * c], s = units[3 * c + 1], j0 = units[3 * c + 2];
    const int64_t rows = Min<int64_t>(kLoraRankBlock, g.rank(p, static_cast<int32_t>(s)) - j0);
    LoraDotA(a_layout, xg + start[s] * x_row, g.tokens(static_cast<int32_t>(s)), K, a_of(p, s) + j0 * K, rows,
             xa_of(p, start[s]) + j0, R);
  });
  g.column_chunks(unit, par.threads, units);
  const int64_t most = g.most_tokens();
  ParallelFor(par, num_chunks, [&](int64_t c) {
    const int64_t p = units[3 * c], n0 = units[3 * c + 1], width = units[3 * c + 2];
    thread_local Scratch out_buf, ptr_buf;
    float* out = out_buf.Get<float>(static_cast<size_t>(most * width));
    const float** rows = ptr_buf.Get<const float*>(static_cast<size_t>(most));
    for (int64_t u = 0; u < g.num_used; ++u)
      if (g.rank(p, g.used[u])) apply_b(p, g.used[u], n0, width, out, rows);
  });
}

void LoraEntry(const Runner& run, Dt dt, const void* x, int64_t T_, int64_t K, const int32_t* slots,
               const LoraPart* parts, int64_t G, int32_t a_layout, int32_t b_layout, int64_t S, int64_t R) {
  if (dt == Dt::kF32)
    LoraImpl(run, static_cast<const float*>(x), T_, K, slots, parts, G, kLoraRows, kLoraRows, S, R);
  else
    LoraImpl(run, static_cast<const uint16_t*>(x), T_, K, slots, parts, G, a_layout, b_layout, S, R);
}

// ---------------------------------------------------------------------------------------------------------
// int8 adapter stacks (EngineConfig.lora_dtype = "int8"; pallas_kernels/lora.py `quantize_adapter`): each slot's A
// and B quantized per rank row r, symmetric int8, their two scales multiplied into one, scale[s][r] (B's already
// carries lora_alpha / r). Half the bytes of bfloat16: a decode step of many adapters is bound by reading them.
//   a [S, R/32, Kq, 32, 4]: blocks of 32 rank rows, rows k..k+3 of each rank side by side (a "quad": the operand of
//     vpdpbusd and sdot; K zero-padded to Kq quads), a block's quad rows 128 bytes (two panels of 16 rank rows, 64
//     bytes each), so a rank-r adapter reads its first ceil(r/32) blocks, each one stream;
//   b [S, R * N]: each slot's B in strips of kLoraI8Strip columns (the last one as narrow as N leaves it, a multiple of
//     16), a strip's R/4 quad rows contiguous (rank rows r..r+3 of each column side by side), so a tile of a strip's
//     columns reads one stream down its rows and a rank-r adapter its first ceil(r/4) quad rows of each strip;
//   y[t] = ((x[t] @ Aq^T) * scale) @ Bq.
// Where the CPU has int8 dot products (I8Dot: AVX512_VNNI, aarch64 dotprod) x's rows are quantized per token to two
// int8 digits (I8QuantizeRows: ~15 bits) and x @ A^T * scale to one (kLoraDA, kLoraDB); elsewhere the quads are
// widened to float32 against x in float32.
// One call takes up to kLoraMaxParts projections of one x (the engine's q|k|v and gate|up: api.h LoraInt8Part), each
// with its own stacks, ranks and output: x's rows are gathered and quantized once, and a slot's parts are one unit of
// the one-pass form. Measured on Zen 4 (the ~125M Llama's engine loop, 8 rank-64 adapters at batch 32; 84 -> 48
// calls a step, with the tokens' rows of x prepared inside their slot's unit and only rows of no adapter zeroed):
// ~29.1 -> ~28.0 ms TPOT (docs/lora.md). A's blocks and B's strips: the step's calls chained (32 tokens, 8 rank-64
// adapters) 4.29-4.39 -> 3.76-4.01 ms, against ~20 GB/s of reads before (two threads stream 45 GB/s here); 8 rank-8
// adapters 2.04 -> 2.28 ms (a rank-16-or-less adapter reads half of each 128-byte quad row of its block).
constexpr int64_t kLoraI8Panel = 16;  // rank rows per panel of A (64 bytes a quad row)
constexpr int64_t kLoraI8Block = 32;  // rank rows per block of A: two panels side by side (128 bytes a quad row)
constexpr int64_t kLoraI8Strip = 64;  // columns per strip of B
// Digits of x (the A pass) and of x @ A^T * scale (the B pass) on the int8 dot products: two (~15 bits) or one.
// Measured on Zen 4 (the ~125M Llama's step, 8 rank-64 adapters x 4 tokens: the 84 calls chained, against bfloat16
// stacks; a mixed step of the test's strong adapters: the logits' largest error against HF + PEFT, as a share of
// their range): one and one 0.58x, 6.7%; two and two 0.65x, 2.8% (= the widened products: the weights' rounding
// alone); one and two 0.60x, 6.4%; two and one 0.59x, 4.2%.
constexpr int kLoraDA = 2, kLoraDB = 1;

// How far ahead the tiles prefetch (the lines of their columns of a quad row): A kLoraI8Ahead quad rows down its block;
// B the same quad row of the next strip (a rank-8 adapter reads 2 of a strip's 16 quad rows: rows further down are
// not its own).
constexpr int64_t kLoraI8Ahead = 8;
template <int CV>
inline void LoraI8Prefetch(const int8_t* ahead) {
  constexpr int lines = static_cast<int>((V::kLanes * CV * 4 + 63) / 64);
#pragma GCC unroll 4
  for (int p = 0; p < lines; ++p) PrefetchT0(ahead + 64 * p);
}

// out[RT][CV vectors] (float32, row stride ldo) = sum over nq quads of x's rows (quads of 4 values, row stride ldx)
// times w's quads (a quad row: 4 bytes per column, A's rank rows or B's columns side by side; quad rows qstride
// apart): vector c's columns at w + 4 kLanes c.
template <int RT, int CV>
inline void LoraI8WidenTile(const float* x, int64_t ldx, const int8_t* w, int64_t qstride, int64_t nq,
                            int64_t ahead, float* out, int64_t ldo) {
  V::F acc[RT][CV];
#pragma GCC unroll 4
  for (int r = 0; r < RT; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < CV; ++c) acc[r][c] = V::Zero();
  for (int64_t q = 0; q < nq; ++q) {
    const int8_t* wq = w + q * qstride;
    LoraI8Prefetch<CV>(wq + ahead);
#pragma GCC unroll 8
    for (int c = 0; c < CV; ++c) {
      V::F wv[4];
      V::I8Quads(wq + 4 * V::kLanes * c, wv);
#pragma GCC unroll 4
      for (int r = 0; r < RT; ++r)
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) acc[r][c] = V::Fma(V::Set1(x[r * ldx + 4 * q + j]), wv[j], acc[r][c]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < RT; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < CV; ++c) V::Store(out + r * ldo + V::kLanes * c, acc[r][c]);
}

#if MESHSERVE_I8DOT
// LoraI8WidenTile by int8 dot products on x's rows as two int8 digits (I8QuantizeRows with one group: row r's high
// digits at x + r * 2 * ld, its low ones ld further, ~15 bits), minus[2r + d]: what the weights' offset added to
// digit d's sums of row r.
template <int RT, int CV, int D>
MESHSERVE_I8DOT_TARGET inline void LoraI8DotTile(const int8_t* x, int64_t ld, const int32_t* minus, const int8_t* w,
                                                 int64_t qstride, int64_t nq, int64_t ahead, float* out,
                                                 int64_t ldo) {
  I8Dot::I hi[RT][CV], lo[RT][CV];
#pragma GCC unroll 4
  for (int r = 0; r < RT; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < CV; ++c) hi[r][c] = lo[r][c] = I8Dot::Zero();
  for (int64_t q = 0; q < nq; ++q) {
    const int8_t* wq = w + q * qstride;
    LoraI8Prefetch<CV>(wq + ahead);
    I8Dot::I wv[CV];
#pragma GCC unroll 8
    for (int c = 0; c < CV; ++c) wv[c] = I8Dot::Weights(wq + 4 * V::kLanes * c);
#pragma GCC unroll 4
    for (int r = 0; r < RT; ++r)
#pragma GCC unroll 8
      for (int c = 0; c < CV; ++c) {
        hi[r][c] = I8Dot::Dot(hi[r][c], wv[c], x + r * 2 * ld + 4 * q);
        if constexpr (D == 2) lo[r][c] = I8Dot::Dot(lo[r][c], wv[c], x + r * 2 * ld + ld + 4 * q);
      }
  }
#pragma GCC unroll 4
  for (int r = 0; r < RT; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < CV; ++c)
      V::Store(out + r * ldo + V::kLanes * c,
               D == 2 ? V::Fma(I8Dot::ToF(lo[r][c], minus[2 * r + 1]), V::Set1(1 / kI8LowDigit),
                               I8Dot::ToF(hi[r][c], minus[2 * r]))
                      : I8Dot::ToF(hi[r][c], minus[2 * r]));
}
#endif

// One slot's m tokens against w's nq quad rows (as the tiles read them), its first `cols` columns (a multiple of
// kLanes), into out [m, cols] (float32, row stride ldo), CV vectors of columns at a time: by int8 dot products on D
// digits of x (xq non-null: I8QuantizeRows's rows, their scales sx and offsets minus) or widened (xf: float32 rows);
// both with row stride ldx. Each quad row prefetches the one `ahead` bytes on.
template <int CV, int D = 2>
void LoraI8Rows(const float* xf, const int8_t* xq, const float* sx, const int32_t* minus, int64_t ldx, int64_t m,
                const int8_t* w, int64_t qstride, int64_t nq, int64_t ahead, int64_t cols, float* out, int64_t ldo) {
  for (int64_t i = 0; i < m; i += 4) {
    const int64_t rt = Min<int64_t>(4, m - i);
    for (int64_t c0 = 0; c0 < cols; c0 += V::kLanes * CV) {
      const int8_t* wc = w + 4 * c0;
      float* o = out + i * ldo + c0;
      if (cols - c0 < V::kLanes * CV) {  // the last vectors one at a time
        for (int64_t c = c0; c < cols; c += V::kLanes)
          LoraI8Rows<1, D>(xf ? xf + i * ldx : nullptr, xq ? xq + i * 2 * ldx : nullptr, sx ? sx + i : nullptr,
                           minus ? minus + 2 * i : nullptr, ldx, rt, w + 4 * c, qstride, nq, ahead, V::kLanes,
                           out + i * ldo + c, ldo);
        break;
      }
#if MESHSERVE_I8DOT
      if (xq) {
        const int8_t* xr = xq + i * 2 * ldx;
        switch (rt) {
          case 4: LoraI8DotTile<4, CV, D>(xr, ldx, minus + 2 * i, wc, qstride, nq, ahead, o, ldo); break;
          case 3: LoraI8DotTile<3, CV, D>(xr, ldx, minus + 2 * i, wc, qstride, nq, ahead, o, ldo); break;
          case 2: LoraI8DotTile<2, CV, D>(xr, ldx, minus + 2 * i, wc, qstride, nq, ahead, o, ldo); break;
          default: LoraI8DotTile<1, CV, D>(xr, ldx, minus + 2 * i, wc, qstride, nq, ahead, o, ldo);
        }
        for (int64_t r = 0; r < rt; ++r)
          for (int64_t c = 0; c < CV; ++c) {
            float* p = o + r * ldo + V::kLanes * c;
            V::Store(p, V::Mul(V::Load(p), V::Set1(sx[i + r])));
          }
        continue;
      }
#endif
      const float* xr = xf + i * ldx;
      switch (rt) {
        case 4: LoraI8WidenTile<4, CV>(xr, ldx, wc, qstride, nq, ahead, o, ldo); break;
        case 3: LoraI8WidenTile<3, CV>(xr, ldx, wc, qstride, nq, ahead, o, ldo); break;
        case 2: LoraI8WidenTile<2, CV>(xr, ldx, wc, qstride, nq, ahead, o, ldo); break;
        default: LoraI8WidenTile<1, CV>(xr, ldx, wc, qstride, nq, ahead, o, ldo);
      }
    }
  }
}

template <typename T>
void LoraInt8Impl(const Runner& run, const T* x, int64_t T_, int64_t K, const int32_t* slots,
                  const LoraInt8Part* parts, int64_t G, int64_t S, int64_t R) {
  const LoraGroups g(slots, T_, parts, G, S, R, K);
  for (int64_t p = 0; p < G; ++p) g.zero_unused_rows(p, static_cast<T*>(parts[p].y));
  if (!g.used_tokens) return;
  const Runner& par = g.runner(run);
  const int64_t kq = (K + 3) / 4, kp = 4 * kq;  // x's rows padded to whole quads; R: a multiple of 16
#if MESHSERVE_I8DOT
  const bool dot = Int8Dot() && kp <= kI8MaxDotGroup;  // (int32 sums: kI8MaxDotGroup)
#else
  const bool dot = false;
#endif
  // x's used rows in slot order, float32 [used, kp] (zero-padded), and (dot) as int8, shared by the parts; per part
  // p, u_p = x @ Aq_p^T * scale_p [used, R] likewise (u + p * used * R).
  // (The caller's thread's scratch: the units read them on the pool's threads while the call waits.)
  const int64_t used = g.used_tokens;
  const size_t nu = static_cast<size_t>(used);
  thread_local Scratch xf_buf, u_buf, scale_buf, xq_buf, uq_buf, minus_buf;
  float* const xf = xf_buf.Get<float>(nu * kp);
  float* const u = u_buf.Get<float>(nu * G * R);
  float* const sx = scale_buf.Get<float>(nu * (1 + G));  // x's row scales, then each part's u's
  int8_t* const xq = dot ? xq_buf.Get<int8_t>(2 * nu * kp) : nullptr;  // two digits per row (I8QuantizeRows)
  int8_t* const uq = dot ? uq_buf.Get<int8_t>(2 * nu * G * R) : nullptr;
  int32_t* const mx = minus_buf.Get<int32_t>(2 * nu * (1 + G));  // per row, each digit's offset: x's, then u's
  // x's sorted rows [i0, i0 + m) in those forms (one slot's in its unit of the one-pass form, all before two passes).
  auto x_rows = [&](int64_t i0, int64_t m) {
    for (int64_t i = i0; i < i0 + m; ++i) {
      ToF32(x + g.order[i] * K, xf + i * kp, K);
      for (int64_t k = K; k < kp; ++k) xf[i * kp + k] = 0;
    }
#if MESHSERVE_I8DOT
    if (dot) I8QuantizeRows(xf + i0 * kp, m, kp, 1, kq, xq + i0 * 2 * kp, sx + i0, mx + 2 * i0);
#endif
  };
  // Part p's u (float32, int8 digits, their scales and offsets) from sorted row i.
  auto u_of = [&](int64_t p, int64_t i) { return u + (p * used + i) * R; };
  auto uq_of = [&](int64_t p, int64_t i) { return dot ? uq + (p * used + i) * 2 * R : nullptr; };
  auto su_of = [&](int64_t p, int64_t i) { return sx + (1 + p) * used + i; };
  auto mu_of = [&](int64_t p, int64_t i) { return mx + 2 * ((1 + p) * used + i); };

  // A: part p's slot s's panels from rank row j0 (rows [j0, j1), whole panels): u_p's rows of its tokens.
  constexpr int kPanelVecs = static_cast<int>(kLoraI8Panel / V::kLanes);
  auto a_rows = [&](int64_t p, int32_t s, int64_t j0, int64_t j1) {
    const int64_t i0 = g.start[s], m = g.tokens(s);
    const int8_t* ax = dot ? xq + i0 * 2 * kp : nullptr;
    const float* scale = parts[p].scale + s * R;
    float* const up = u_of(p, i0);
    for (int64_t j = j0; j < j1;) {
      // block j / 32 (32 rank rows x kq quads x 128 bytes), its panel j % 32 / 16 (64 bytes into each quad row)
      const int8_t* panel = parts[p].a + (s * R + j / kLoraI8Block * kLoraI8Block) * kp + j % kLoraI8Block * 4;
      const bool two = V::kLanes == 16 && j % kLoraI8Block == 0 && j1 - j >= kLoraI8Block;  // AVX-512: the block
      if (two)
        LoraI8Rows<2 * kPanelVecs, kLoraDA>(xf + i0 * kp, ax, sx + i0, mx + 2 * i0, kp, m, panel, 128, kq,
                                            kLoraI8Ahead * 128, kLoraI8Block, up + j, R);
      else
        LoraI8Rows<kPanelVecs, kLoraDA>(xf + i0 * kp, ax, sx + i0, mx + 2 * i0, kp, m, panel, 128, kq,
                                        kLoraI8Ahead * 128, kLoraI8Panel, up + j, R);
      j += two ? kLoraI8Block : kLoraI8Panel;
    }
    for (int64_t i = 0; i < m; ++i)
      for (int64_t c = j0; c < j1; c += V::kLanes) {
        float* q = up + i * R + c;
        V::Store(q, V::Mul(V::Load(q), V::Load(scale + c)));
      }
  };
  // u_p past slot s's rank is zero (its last panel's rows past the rank are not the adapter's: the B pass reads
  // quads up to the rank rounded up to 4, and the dot products' offsets sum whole rows); then (dot) u_p as int8.
  auto finish_u = [&](int64_t p, int32_t s) {
    const int64_t r = g.rank(p, s), i0 = g.start[s], m = g.tokens(s);
    for (int64_t i = i0; i < i0 + m; ++i) std::memset(u_of(p, i) + r, 0, static_cast<size_t>(R - r) * sizeof(float));
#if MESHSERVE_I8DOT
    if (dot) I8QuantizeRows(u_of(p, i0), m, R, 1, R / 4, uq_of(p, i0), su_of(p, i0), mu_of(p, i0));
#endif
  };
  // B: part p's slot s's columns [n0, n0 + width) into its y's rows of the slot's tokens (out: m x width floats of
  // scratch).
  constexpr int kBVecs = V::kLanes == 16 && kLoraDB == 1 ? 4 : 2;  // tiles of 4 tokens: at most 16 accumulators
  auto b_cols = [&](int64_t p, int32_t s, int64_t n0, int64_t width, float* out) {
    const int64_t i0 = g.start[s], m = g.tokens(s), nq = (g.rank(p, s) + 3) / 4, N = parts[p].N;
    for (int64_t n = n0; n < n0 + width; n += kLoraI8Strip) {  // n0: a strip's first column
      const int64_t w = Min(kLoraI8Strip, N - n);  // this strip's columns: its quad rows are 4w bytes
      LoraI8Rows<kBVecs, kLoraDB>(u_of(p, i0), uq_of(p, i0), su_of(p, i0), mu_of(p, i0), R, m,
                                  parts[p].b + s * R * N + n * R, 4 * w, nq, kLoraI8Strip * R, w, out + (n - n0),
                                  width);
    }
    T* y = static_cast<T*>(parts[p].y);
    for (int64_t i = 0; i < m; ++i) StoreRow(out + i * width, y + g.order[i0 + i] * N + n0, width);
  };
  auto panels_of = [&](int64_t p, int32_t s) {  // A's rank rows a slot reads: whole panels
    return (g.rank(p, s) + kLoraI8Panel - 1) / kLoraI8Panel * kLoraI8Panel;
  };

  // One pass, a unit per used slot, where the slots share the work evenly (LoraImpl's rule): its x rows, then each
  // part that updates it.
  if (g.one_pass(par)) {
    ParallelFor(par, g.num_used, [&](int64_t n) {
      const int32_t s = g.used[n];
      thread_local Scratch out_buf;
      x_rows(g.start[s], g.tokens(s));
      for (int64_t p = 0; p < G; ++p) {
        if (!g.rank(p, s)) continue;
        a_rows(p, s, 0, panels_of(p, s));
        finish_u(p, s);
        b_cols(p, s, 0, parts[p].N, out_buf.Get<float>(static_cast<size_t>(g.tokens(s) * parts[p].N)));
      }
    });
    return;
  }
  // Else two passes: A by units of (part, used slot, block of 32 rank rows), then B by (part, chunk of its N's
  // columns: whole strips) over every used slot.
  x_rows(0, used);
  int64_t num_units = 0;
  for (int64_t p = 0; p < G; ++p)
    for (int64_t n = 0; n < g.num_used; ++n)
      num_units += (panels_of(p, g.used[n]) + kLoraI8Block - 1) / kLoraI8Block;
  const int64_t most = g.most_tokens(), num_chunks = g.column_chunks(kLoraI8Strip, par.threads, nullptr);  // strips
  Zeros<int64_t> unit_buf(static_cast<size_t>(3 * Max(num_units, num_chunks)));
  int64_t* units = unit_buf.get();
  int64_t k = 0;
  for (int64_t p = 0; p < G; ++p)
    for (int64_t n = 0; n < g.num_used; ++n)
      for (int64_t j = 0; j < panels_of(p, g.used[n]); j += kLoraI8Block, ++k)
        units[3 * k] = p, units[3 * k + 1] = g.used[n], units[3 * k + 2] = j;
  ParallelFor(par, num_units, [&](int64_t n) {
    const int64_t p = units[3 * n], j = units[3 * n + 2];
    const int32_t s = static_cast<int32_t>(units[3 * n + 1]);
    a_rows(p, s, j, Min<int64_t>(j + kLoraI8Block, panels_of(p, s)));
  });
  for (int64_t p = 0; p < G; ++p)
    for (int64_t n = 0; n < g.num_used; ++n)
      if (g.rank(p, g.used[n])) finish_u(p, g.used[n]);
  g.column_chunks(kLoraI8Strip, par.threads, units);
  ParallelFor(par, num_chunks, [&](int64_t c) {
    const int64_t p = units[3 * c], n0 = units[3 * c + 1], width = units[3 * c + 2];
    thread_local Scratch out_buf;
    float* out = out_buf.Get<float>(static_cast<size_t>(most * width));
    for (int64_t n = 0; n < g.num_used; ++n)
      if (g.rank(p, g.used[n])) b_cols(p, g.used[n], n0, width, out);
  });
}

void LoraInt8Entry(const Runner& run, Dt dt, const void* x, int64_t T_, int64_t K, const int32_t* slots,
                   const LoraInt8Part* parts, int64_t G, int64_t S, int64_t R) {
  if (dt == Dt::kF32)
    LoraInt8Impl(run, static_cast<const float*>(x), T_, K, slots, parts, G, S, R);
  else
    LoraInt8Impl(run, static_cast<const uint16_t*>(x), T_, K, slots, parts, G, S, R);
}
