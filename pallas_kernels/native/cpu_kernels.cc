// meshserve CPU kernels, called from XLA:CPU programs through the XLA FFI (see pallas_kernels/native.py).
//
// packed matmul: out[M, N] = x[M, K] @ W for weights packed at load into column panels contiguous down K (what a
// single-device CPU engine runs for every step size): AVX-512 FMAs for float32; vdpbf16ps or AMX tiles for
// bfloat16, accumulating in float32. matmul: the same on a row-major w[K, N] for small M (weight pairs
// interleaved on the fly for bfloat16), for weights that are not packed. attention: the ragged paged attention
// of pallas_kernels/reference.py with an online softmax. greedy head: the argmax of the exact logits of a few rows
// from an int8 screen of the LM head plus a recheck of the rows its error bounds leave open.
// Work is split between the XLA intra-op thread pool's threads and the calling thread.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <cmath>
#include <memory>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// ---------------------------------------------------------------------------------------------------------
// Parallel-for over [0, n) in chunks, on the calling thread plus the pool's threads. The caller works too and
// waits only for chunks that were started, so it finishes even if no pool thread ever picks a task up.
struct ForState {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

template <typename Pool, typename F>
void ParallelFor(Pool& pool, int64_t n, F&& body) {
  int64_t threads = std::max<int64_t>(1, pool.num_threads());
  if (n <= 1 || threads <= 1) {
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  auto state = std::make_shared<ForState>();
  // A task that starts after every chunk is taken returns at once and never touches `body`, which may be
  // gone by then; the caller waits for every chunk that was handed out.
  auto worker = [state, n, &body]() {
    for (;;) {
      int64_t i = state->next.fetch_add(1, std::memory_order_relaxed);
      if (i >= n) return;
      body(i);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  int64_t helpers = std::min<int64_t>(threads, n) - 1;
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([worker]() { worker(); });
  worker();
  while (state->done.load(std::memory_order_acquire) < n) _mm_pause();
}

// ---------------------------------------------------------------------------------------------------------
// Matmul. Serving's matmuls have few rows (M = a step's tokens) against a large row-major weight [K, N]. Each
// thread owns a chunk of columns and walks K in blocks of kKBlock rows; inside a block it sweeps its columns
// panel by panel, so the weight is read once, as kKBlock sequential row streams the hardware prefetcher
// follows (a panel walked down all of K would touch a new page per row). Partial sums live in the output
// (float32) or a per-thread float32 buffer, reloaded once per block. A tile keeps RT rows x 16*CB columns of
// accumulators in registers (CB shrinks as RT grows); larger M is cut into tiles of 16 rows. Column tails are
// masked.
constexpr int CbFor(int rt) { return rt <= 2 ? 8 : rt <= 4 ? 6 : rt <= 6 ? 4 : rt <= 8 ? 3 : rt <= 12 ? 2 : 1; }
constexpr int64_t kMaxTileRows = 16;
constexpr int64_t kKBlock = 16;
constexpr int64_t kChunkCols = 4096;
constexpr int64_t kPrefetchBytes = 256;  // ahead along each weight row

template <typename Out>
inline void StoreVec(Out* dst, __m512 v, __mmask16 mask);
template <>
inline void StoreVec<float>(float* dst, __m512 v, __mmask16 mask) { _mm512_mask_storeu_ps(dst, mask, v); }
template <>
inline void StoreVec<uint16_t>(uint16_t* dst, __m512 v, __mmask16 mask) {
  _mm256_mask_storeu_epi16(dst, mask, (__m256i)_mm512_cvtneps_pbh(v));
}

// Lanes of a 16-wide vector that hold real columns when `left` columns remain.
inline __mmask16 TailMask(int64_t left) {
  return left >= 16 ? 0xFFFF : left <= 0 ? 0 : static_cast<__mmask16>((1u << left) - 1);
}

// Columns per chunk of work, in whole units of `unit` columns: about kChunkCols, at least two chunks per thread
// when N allows.
inline int64_t ChunkUnits(int64_t N, int64_t unit, int64_t threads) {
  const int64_t units = (N + unit - 1) / unit;
  return std::clamp<int64_t>(units / (2 * std::max<int64_t>(1, threads)), 1, std::max<int64_t>(1, kChunkCols / unit));
}

template <typename Out>
inline void StoreRow(const float* src, Out* dst, int64_t width) {
  int64_t i = 0;
  for (; i + 16 <= width; i += 16) StoreVec<Out>(dst + i, _mm512_loadu_ps(src + i), 0xFFFF);
  if (i < width) {
    __mmask16 m = TailMask(width - i);
    StoreVec<Out>(dst + i, _mm512_maskz_loadu_ps(m, src + i), m);
  }
}

// A tile's accumulators: zero for the first K block, else the partial sums so far.
template <int RT, int CB>
inline void LoadAcc(__m512 (&acc)[RT][CB], const float* mem, int64_t lda, const __mmask16* masks, bool first) {
#pragma GCC unroll 16
  for (int r = 0; r < RT; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < CB; ++c)
      acc[r][c] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(masks[c], mem + r * lda + 16 * c);
}

template <int RT, int CB>
inline void StoreAcc(const __m512 (&acc)[RT][CB], float* mem, int64_t lda, const __mmask16* masks) {
#pragma GCC unroll 16
  for (int r = 0; r < RT; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < CB; ++c) _mm512_mask_storeu_ps(mem + r * lda + 16 * c, masks[c], acc[r][c]);
}

// Two weight rows of 16 bf16 -> their 16 (row k, row k+1) pairs: the layout vdpbf16ps and AMX B tiles take.
inline __m512i InterleaveRows(__m256i a, __m256i b) {
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                       6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(idx, _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1));
}

// acc[RT][16*CB] (+)= x[RT, k0:k0+kb] @ w[k0:k0+kb, 16*CB]. `xt` is the x block packed k-major, [kb][RT], so
// every broadcast is a constant offset from one pointer; w is offset to (k0, column).
template <int RT, int CB>
inline void F32Tile(const float* __restrict xt, const float* __restrict w, int64_t ldw, int64_t kb,
                    float* __restrict acc_mem, int64_t lda, const __mmask16* masks, bool first) {
  __m512 acc[RT][CB];
  LoadAcc<RT, CB>(acc, acc_mem, lda, masks, first);
  for (int64_t k = 0; k < kb; ++k) {
    const float* wk = w + k * ldw;
    _mm_prefetch(reinterpret_cast<const char*>(wk) + kPrefetchBytes, _MM_HINT_T0);
    __m512 wv[CB];
#pragma GCC unroll 8
    for (int c = 0; c < CB; ++c) wv[c] = _mm512_maskz_loadu_ps(masks[c], wk + 16 * c);
#pragma GCC unroll 16
    for (int r = 0; r < RT; ++r) {
      __m512 xv = _mm512_set1_ps(xt[k * RT + r]);
#pragma GCC unroll 8
      for (int c = 0; c < CB; ++c) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  StoreAcc<RT, CB>(acc, acc_mem, lda, masks);
}

// bfloat16: weight rows k and k+1 (16 columns each) are interleaved on the fly into the pair layout vdpbf16ps
// wants, accumulating in float32. `xt` holds x's (k, k+1) pairs packed pair-major, [kb/2][RT] 32-bit words.
template <int RT, int CB>
inline void Bf16Tile(const int32_t* __restrict xt, const uint16_t* __restrict w, int64_t ldw, int64_t kb,
                     float* __restrict acc_mem, int64_t lda, const __mmask16* masks, bool first) {
  __m512 acc[RT][CB];
  LoadAcc<RT, CB>(acc, acc_mem, lda, masks, first);
  for (int64_t k = 0; k < kb; k += 2) {
    const uint16_t* w0 = w + k * ldw;
    const bool pair = k + 1 < kb;  // odd K: the last row pairs with zeros
    _mm_prefetch(reinterpret_cast<const char*>(w0) + kPrefetchBytes, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w0 + ldw) + kPrefetchBytes, _MM_HINT_T0);
    __m512bh wv[CB];
#pragma GCC unroll 8
    for (int c = 0; c < CB; ++c) {
      __m256i a = _mm256_maskz_loadu_epi16(masks[c], w0 + 16 * c);
      __m256i b = pair ? _mm256_maskz_loadu_epi16(masks[c], w0 + ldw + 16 * c) : _mm256_setzero_si256();
      wv[c] = (__m512bh)InterleaveRows(a, b);
    }
#pragma GCC unroll 16
    for (int r = 0; r < RT; ++r) {
      __m512bh xv = (__m512bh)_mm512_set1_epi32(xt[(k / 2) * RT + r]);
#pragma GCC unroll 8
      for (int c = 0; c < CB; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
    }
  }
  StoreAcc<RT, CB>(acc, acc_mem, lda, masks);
}

// Packs rows [m, m + rows) x columns [k0, k0 + kb) of x k-major: [kb][rows] (bf16: [kb/2][rows] pairs).
inline void PackX(const float* x, int64_t K, int64_t m, int64_t rows, int64_t k0, int64_t kb, float* xt) {
  for (int64_t k = 0; k < kb; ++k)
    for (int64_t r = 0; r < rows; ++r) xt[k * rows + r] = x[(m + r) * K + k0 + k];
}
inline void PackX(const uint16_t* x, int64_t K, int64_t m, int64_t rows, int64_t k0, int64_t kb, int32_t* xt) {
  for (int64_t k = 0; k < kb; k += 2)
    for (int64_t r = 0; r < rows; ++r) {
      int32_t v = x[(m + r) * K + k0 + k];
      if (k + 1 < kb) v |= static_cast<int32_t>(x[(m + r) * K + k0 + k + 1]) << 16;
      xt[(k / 2) * rows + r] = v;
    }
}

template <typename XT>
using Packed = std::conditional_t<std::is_same_v<XT, float>, float, int32_t>;

template <int RT, int CB, typename XT>
inline void Tile(const Packed<XT>* xt, const XT* w, int64_t ldw, int64_t kb, float* acc, int64_t lda,
                 const __mmask16* masks, bool first) {
  if constexpr (std::is_same_v<XT, float>)
    F32Tile<RT, CB>(xt, w, ldw, kb, acc, lda, masks, first);
  else
    Bf16Tile<RT, CB>(xt, w, ldw, kb, acc, lda, masks, first);
}

// A tile of `rows` <= RT rows in a panel of 16*CbFor(RT) columns (a remainder tile keeps the panel's width).
template <int RT, typename XT>
inline void TileRows(int64_t rows, const Packed<XT>* xt, const XT* w, int64_t ldw, int64_t kb, float* acc,
                     int64_t lda, const __mmask16* masks, bool first) {
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

template <int RT, typename XT, typename Out, typename Pool>
void MatmulRows(Pool& pool, const XT* x, int64_t M, int64_t K, const XT* w, int64_t N, Out* out) {
  constexpr int CB = CbFor(RT);
  constexpr int64_t panel = 16 * CB;
  const int64_t per_chunk = ChunkUnits(N, panel, pool.num_threads());
  const int64_t chunks = ((N + panel - 1) / panel + per_chunk - 1) / per_chunk;
  ParallelFor(pool, chunks, [&](int64_t ci) {
    const int64_t c0 = ci * per_chunk * panel, c1 = std::min<int64_t>(N, c0 + per_chunk * panel);
    const int64_t width = c1 - c0;
    float* acc;
    int64_t lda;
    thread_local std::vector<float> scratch;
    if constexpr (std::is_same_v<Out, float>) {
      acc = out + c0;
      lda = N;
    } else {
      scratch.resize(static_cast<size_t>(M * width));
      acc = scratch.data();
      lda = width;
    }
    const int64_t tiles = (M + RT - 1) / RT;
    thread_local std::vector<Packed<XT>> xts;
    xts.resize(static_cast<size_t>(tiles * RT * kKBlock));
    for (int64_t k0 = 0; k0 < K; k0 += kKBlock) {
      const int64_t kb = std::min<int64_t>(kKBlock, K - k0);
      for (int64_t t = 0; t < tiles; ++t)
        PackX(x, K, t * RT, std::min<int64_t>(RT, M - t * RT), k0, kb, xts.data() + t * RT * kKBlock);
      for (int64_t n0 = 0; n0 < width; n0 += panel) {
        __mmask16 masks[CB];
        for (int c = 0; c < CB; ++c) masks[c] = TailMask(width - n0 - 16 * c);
        for (int64_t t = 0; t < tiles; ++t)
          TileRows<RT, XT>(std::min<int64_t>(RT, M - t * RT), xts.data() + t * RT * kKBlock, w + k0 * N + c0 + n0,
                           N, kb, acc + t * RT * lda + n0, lda, masks, k0 == 0);
      }
    }
    if constexpr (!std::is_same_v<Out, float>)
      for (int64_t m = 0; m < M; ++m) StoreRow<Out>(acc + m * lda, out + m * N + c0, width);
  });
}

// K rows one AMX tile step covers (32 bf16 = 64 bytes per A-tile row); packed bf16 panels pad K to it.
constexpr int64_t kAmxKStep = 32;

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// ---------------------------------------------------------------------------------------------------------
// bfloat16 on AMX, for 8..16 rows (where the pair-dot-product tiles above run out of FMA throughput): x is the
// A tile (rows x 32 bf16), the weight is interleaved into the pair (VNNI) layout 16 columns x 32 rows at a
// time and multiplied into four 16 x 16 float32 C tiles (64 columns). C tiles stay in registers for
// kAmxKBlock rows of K, then go back to a float32 buffer. Linux must grant the process AMX state first.
constexpr int64_t kAmxKBlock = 128;
constexpr int64_t kAmxMinRows = 8;

bool AmxReady() {
  static const bool ok = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// B tile (VNNI): row p holds columns n..n+15 of weight rows k+2p and k+2p+1, interleaved; missing rows or
// columns are zero.
inline void PackB(const uint16_t* w, int64_t ldw, int64_t krows, __mmask16 mask, uint16_t* b) {
  for (int64_t p = 0; p < kAmxKStep / 2; ++p) {
    __m256i a = 2 * p < krows ? _mm256_maskz_loadu_epi16(mask, w + 2 * p * ldw) : _mm256_setzero_si256();
    __m256i c = 2 * p + 1 < krows ? _mm256_maskz_loadu_epi16(mask, w + (2 * p + 1) * ldw) : _mm256_setzero_si256();
    _mm_prefetch(reinterpret_cast<const char*>(w + 2 * p * ldw) + kPrefetchBytes, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + (2 * p + 1) * ldw) + kPrefetchBytes, _MM_HINT_T0);
    _mm512_store_si512(b + 32 * p, InterleaveRows(a, c));
  }
}

template <typename Out, typename Pool>
void AmxMatmul(Pool& pool, const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, Out* out) {
  constexpr int64_t group = 64;  // columns per pass: four C tiles
  const int64_t per_chunk = ChunkUnits(N, group, pool.num_threads());
  const int64_t chunks = ((N + group - 1) / group + per_chunk - 1) / per_chunk;
  const int64_t ksteps = (K + kAmxKStep - 1) / kAmxKStep;
  // x padded to whole K steps: the A tiles read [M, ksteps*32] with zeros past K.
  std::vector<uint16_t> xpad;
  const uint16_t* xa = x;
  int64_t ldx = K;
  if (K % kAmxKStep) {
    ldx = ksteps * kAmxKStep;
    xpad.assign(static_cast<size_t>(M * ldx), 0);
    for (int64_t m = 0; m < M; ++m) std::memcpy(xpad.data() + m * ldx, x + m * K, K * 2);
    xa = xpad.data();
  }
  ParallelFor(pool, chunks, [&](int64_t ci) {
    const int64_t c0 = ci * per_chunk * group, c1 = std::min<int64_t>(N, c0 + per_chunk * group);
    const int64_t width = c1 - c0, padded = (width + group - 1) / group * group;
    thread_local std::vector<float> acc_buf;
    acc_buf.resize(static_cast<size_t>(M * padded));
    float* acc = acc_buf.data();
    alignas(64) uint16_t b[4][kAmxKStep * 16];
    TileConfig cfg;
    for (int t = 0; t < 4; ++t) cfg.rows[t] = static_cast<uint8_t>(M), cfg.colsb[t] = 64;  // C
    cfg.rows[4] = static_cast<uint8_t>(M), cfg.colsb[4] = 64;                            // A
    for (int t = 5; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;                     // B
    _tile_loadconfig(&cfg);
    for (int64_t k0 = 0; k0 < K; k0 += kAmxKBlock) {
      const int64_t k1 = std::min<int64_t>(K, k0 + kAmxKBlock);
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
          const int64_t krows = std::min<int64_t>(kAmxKStep, K - k);
          __mmask16 masks[4];
          for (int j = 0; j < 4; ++j) {
            masks[j] = TailMask(width - n0 - 16 * j);
            PackB(w + k * N + c0 + n0 + 16 * j, N, krows, masks[j], b[j]);
          }
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
#endif  // AMX

template <typename XT, typename Out, typename Pool>
void Matmul(Pool& pool, const XT* x, int64_t M, int64_t K, const XT* w, int64_t N, Out* out) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)  // CPUs without AMX (e.g. Zen 4) build without this path
  if constexpr (std::is_same_v<XT, uint16_t>)
    if (M >= kAmxMinRows && M <= kMaxTileRows && AmxReady()) return AmxMatmul<Out, Pool>(pool, x, M, K, w, N, out);
#endif
  switch (std::min<int64_t>(M, kMaxTileRows)) {
#define MESHSERVE_ROWS(n) \
  case n:                 \
    return MatmulRows<n, XT, Out, Pool>(pool, x, M, K, w, N, out);
    MESHSERVE_ROWS(1) MESHSERVE_ROWS(2) MESHSERVE_ROWS(3) MESHSERVE_ROWS(4) MESHSERVE_ROWS(5) MESHSERVE_ROWS(6)
    MESHSERVE_ROWS(7) MESHSERVE_ROWS(8) MESHSERVE_ROWS(9) MESHSERVE_ROWS(10) MESHSERVE_ROWS(11)
    MESHSERVE_ROWS(12) MESHSERVE_ROWS(13) MESHSERVE_ROWS(14) MESHSERVE_ROWS(15) MESHSERVE_ROWS(16)
#undef MESHSERVE_ROWS
    default: return;
  }
}

ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> out) {
  auto wd = w.dimensions();
  if (wd.size() != 2) return ffi::Error::InvalidArgument("matmul: w must be 2-D [K, N]");
  int64_t K = wd[0], N = wd[1];
  auto xd = x.dimensions();
  if (xd.size() < 1 || xd.back() != K) return ffi::Error::InvalidArgument("matmul: x's last dimension must be K");
  int64_t M = K ? static_cast<int64_t>(x.element_count()) / K : 0;
  if (static_cast<int64_t>(out->element_count()) != M * N)
    return ffi::Error::InvalidArgument("matmul: output must hold M x N elements");
  if (M == 0 || N == 0) return ffi::Error::Success();
  if (K == 0) {
    std::memset(out->untyped_data(), 0, out->size_bytes());
    return ffi::Error::Success();
  }
  auto xt = x.element_type(), wt = w.element_type(), ot = out->element_type();
  if (xt == ffi::DataType::F32 && wt == ffi::DataType::F32 && ot == ffi::DataType::F32) {
    Matmul<float, float>(pool, static_cast<const float*>(x.untyped_data()), M, K,
                         static_cast<const float*>(w.untyped_data()), N, static_cast<float*>(out->untyped_data()));
    return ffi::Error::Success();
  }
  if (xt == ffi::DataType::BF16 && wt == ffi::DataType::BF16) {
    auto xp = static_cast<const uint16_t*>(x.untyped_data());
    auto wp = static_cast<const uint16_t*>(w.untyped_data());
    if (ot == ffi::DataType::BF16) {
      Matmul<uint16_t, uint16_t>(pool, xp, M, K, wp, N, static_cast<uint16_t*>(out->untyped_data()));
      return ffi::Error::Success();
    }
    if (ot == ffi::DataType::F32) {
      Matmul<uint16_t, float>(pool, xp, M, K, wp, N, static_cast<float*>(out->untyped_data()));
      return ffi::Error::Success();
    }
  }
  return ffi::Error::InvalidArgument("matmul: supported dtypes are f32 x f32 -> f32 and bf16 x bf16 -> bf16/f32");
}

// ---------------------------------------------------------------------------------------------------------
// Packed matmul: out[M, N] = x[M, K] @ W, with W packed once at load into panels of PW columns that are
// contiguous down K (`pack_weight` in pallas_kernels/native.py): float32 [N/32, K, 32, 1] (element (k, n) at
// [n/32, k, n%32, 0]); bfloat16 [N/64, Kp/2, 64, 2] with K zero-padded to Kp = a multiple of 32 and the rows
// k, k+1 of a column side by side (the pair layout of vdpbf16ps and AMX B tiles). A thread streams whole panels
// front to back, one sequential stream per panel, and a tile's accumulators stay in registers (or AMX tiles)
// for all of K. Rows go in tiles of up to PackedTraits::kRows (AMX: 16) over the same panel; the first tile
// reads it from memory with its compute hidden under the reads, later tiles from L2. float32 panels are 32
// columns wide so that one tile holds 14 rows (28 accumulators): a 16-row decode step is nearly one pass.
constexpr int64_t kPackedMBlock = 224;  // rows per unit of work (x's block stays in L2 across the panels)
constexpr int64_t kPackedAhead = 4096;  // bytes ahead in the panel's stream, prefetched into L2
constexpr int kMaxStreams = 4;  // streams per panel for tiles of few rows (PackedTile)
// bfloat16 below this many rows: vdpbf16ps over several streams reads faster than AMX (7.7-9.4 vs 10-10.9 ms for
// the 125M model's weights at 1-4 rows); from it, AMX's compute wins.
constexpr int64_t kAmxPackedMinRows = 5;

template <typename XT>
struct PackedTraits;
template <>
struct PackedTraits<float> {
  static constexpr int64_t kPanel = 32, kStep = 1;  // columns per panel, K rows per packed row
  static constexpr int kRows = 14;
};
template <>
struct PackedTraits<uint16_t> {
  static constexpr int64_t kPanel = 64, kStep = 2;
  static constexpr int kRows = 6;
};

// One packed row q (PW columns x kStep K rows) into a tile's accumulators. float32: x[r, q] broadcast;
// bfloat16: the pair x[r, 2q:2q+2] (odd K: the last column alone, paired with the panel's zero padding) as one
// 32-bit word.
template <int RT, typename XT>
inline void PackedStep(__m512 (&acc)[RT][PackedTraits<XT>::kPanel / 16], const XT* __restrict x, int64_t ldx,
                       const XT* __restrict wp, int64_t q, int64_t K) {
  using T = PackedTraits<XT>;
  constexpr int CB = T::kPanel / 16;
  constexpr int64_t row_elems = T::kPanel * T::kStep;
  const XT* wq = wp + q * row_elems;
  const char* ahead = reinterpret_cast<const char*>(wq) + kPackedAhead;
#pragma GCC unroll 4
  for (int64_t l = 0; l < row_elems * static_cast<int64_t>(sizeof(XT)); l += 64) _mm_prefetch(ahead + l, _MM_HINT_T1);
  if constexpr (std::is_same_v<XT, float>) {
    __m512 wv[CB];
#pragma GCC unroll 4
    for (int c = 0; c < CB; ++c) wv[c] = _mm512_loadu_ps(wq + 16 * c);
#pragma GCC unroll 16
    for (int r = 0; r < RT; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * ldx + q]);
#pragma GCC unroll 4
      for (int c = 0; c < CB; ++c) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  } else {
    const bool tail = 2 * q + 1 == K;
    __m512bh wv[CB];
#pragma GCC unroll 4
    for (int c = 0; c < CB; ++c) wv[c] = (__m512bh)_mm512_loadu_si512(wq + 32 * c);
#pragma GCC unroll 16
    for (int r = 0; r < RT; ++r) {
      int32_t pair;
      if (tail)
        pair = x[r * ldx + 2 * q];
      else
        std::memcpy(&pair, x + r * ldx + 2 * q, 4);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
      for (int c = 0; c < CB; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
    }
  }
}

// RT rows x one panel over all of K. S > 1 reads the panel as S streams (K cut in S parts, each with its own
// accumulators, summed at the end): a core keeps more reads in flight over several streams than over one
// (~15 vs ~11 GB/s per core here), which matters when few rows leave the loop waiting on memory.
template <int RT, int S, typename XT, typename Out>
inline void PackedTile(const XT* __restrict x, int64_t ldx, const XT* __restrict wp, int64_t K, Out* out,
                       int64_t ldo) {
  using T = PackedTraits<XT>;
  constexpr int CB = T::kPanel / 16;
  __m512 acc[S][RT][CB];
#pragma GCC unroll 4
  for (int s = 0; s < S; ++s)
#pragma GCC unroll 16
    for (int r = 0; r < RT; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < CB; ++c) acc[s][r][c] = _mm512_setzero_ps();
  const int64_t steps = (K + T::kStep - 1) / T::kStep, part = steps / S;
  for (int64_t q = 0; q < part; ++q)
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s) PackedStep<RT, XT>(acc[s], x, ldx, wp, s * part + q, K);
  for (int64_t q = S * part; q < steps; ++q) PackedStep<RT, XT>(acc[0], x, ldx, wp, q, K);
#pragma GCC unroll 16
  for (int r = 0; r < RT; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < CB; ++c) {
      __m512 v = acc[0][r][c];
#pragma GCC unroll 4
      for (int s = 1; s < S; ++s) v = _mm512_add_ps(v, acc[s][r][c]);
      StoreVec<Out>(out + r * ldo + 16 * c, v, 0xFFFF);
    }
}

// Streams per panel for a tile of RT rows: as many as the 28 accumulator registers allow, up to kMaxStreams.
template <int RT, typename XT>
constexpr int PackedStreams() {
  constexpr int per_stream = RT * static_cast<int>(PackedTraits<XT>::kPanel / 16);
  constexpr int fit = 28 / per_stream;
  return fit >= kMaxStreams ? kMaxStreams : fit < 1 ? 1 : fit;
}

template <typename XT, typename Out, int RT = PackedTraits<XT>::kRows>
inline void PackedRows(int64_t rows, const XT* x, int64_t ldx, const XT* wp, int64_t K, Out* out, int64_t ldo) {
  if constexpr (RT > 1)
    if (rows < RT) return PackedRows<XT, Out, RT - 1>(rows, x, ldx, wp, K, out, ldo);
  PackedTile<RT, PackedStreams<RT, XT>(), XT, Out>(x, ldx, wp, K, out, ldo);
}

constexpr int64_t kF32Panel = PackedTraits<float>::kPanel, kBf16Panel = PackedTraits<uint16_t>::kPanel;

// `panel_len`: elements per panel (f32: K*32; bf16: Kp*64).
template <typename XT, typename Out, typename Pool>
void PackedMatmul(Pool& pool, const XT* x, int64_t M, int64_t K, const XT* w, int64_t panels, int64_t panel_len,
                  Out* out) {
  using T = PackedTraits<XT>;
  const int64_t N = panels * T::kPanel;
  const int64_t per_chunk = ChunkUnits(N, T::kPanel, pool.num_threads());
  const int64_t chunks = (panels + per_chunk - 1) / per_chunk, mblocks = (M + kPackedMBlock - 1) / kPackedMBlock;
  ParallelFor(pool, chunks * mblocks, [&](int64_t unit) {
    const int64_t ci = unit % chunks, m0 = unit / chunks * kPackedMBlock;
    const int64_t j1 = std::min<int64_t>(panels, (ci + 1) * per_chunk), m1 = std::min<int64_t>(M, m0 + kPackedMBlock);
    for (int64_t j = ci * per_chunk; j < j1; ++j)
      for (int64_t m = m0; m < m1; m += T::kRows)
        PackedRows<XT, Out>(std::min<int64_t>(T::kRows, m1 - m), x + m * K, K, w + j * panel_len, K,
                            out + m * N + j * T::kPanel, N);
  });
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// bfloat16 on AMX from the packed layout: B tiles (16 pair rows x 16 columns) load straight from the panel
// (row stride 256 bytes); A tiles are x's rows (K padded to Kp with zeros when K is not a multiple of 32). Four
// C tiles hold a 16-row x 64-column block for all of K.
template <typename Out, typename Pool>
void AmxPackedMatmul(Pool& pool, const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t panels,
                     int64_t kp, Out* out) {
  const int64_t N = panels * kBf16Panel;
  std::vector<uint16_t> xpad;
  const uint16_t* xa = x;
  int64_t ldx = K;
  if (K != kp) {
    ldx = kp;
    xpad.assign(static_cast<size_t>(M * kp), 0);
    for (int64_t m = 0; m < M; ++m) std::memcpy(xpad.data() + m * kp, x + m * K, K * 2);
    xa = xpad.data();
  }
  const int64_t per_chunk = ChunkUnits(N, kBf16Panel, pool.num_threads());
  const int64_t chunks = (panels + per_chunk - 1) / per_chunk, mblocks = (M + kPackedMBlock - 1) / kPackedMBlock;
  const int64_t panel_len = kp * kBf16Panel, ksteps = kp / kAmxKStep;
  ParallelFor(pool, chunks * mblocks, [&](int64_t unit) {
    alignas(64) float cbuf[16 * kBf16Panel];
    int configured = 0;
    const int64_t ci = unit % chunks, mb = unit / chunks * kPackedMBlock;
    const int64_t j1 = std::min<int64_t>(panels, (ci + 1) * per_chunk), me = std::min<int64_t>(M, mb + kPackedMBlock);
    for (int64_t j = ci * per_chunk; j < j1; ++j) {
      const uint16_t* wp = w + j * panel_len;
      for (int64_t m0 = mb; m0 < me; m0 += 16) {
        const int rows = static_cast<int>(std::min<int64_t>(16, me - m0));
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
          for (int l = 0; l < 64; l += 2) _mm_prefetch(ahead + 64 * l, _MM_HINT_T0);
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
#endif  // AMX

ffi::Error MatmulPackedImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                            ffi::Result<ffi::AnyBuffer> out, int32_t amx) {
  auto wd = w.dimensions();
  const bool f32 = w.element_type() == ffi::DataType::F32;
  const int64_t pw = f32 ? kF32Panel : kBf16Panel;
  if (wd.size() != 4 || wd[2] != pw || wd[3] != (f32 ? 1 : 2))
    return ffi::Error::InvalidArgument("packed matmul: w must be [N/32, K, 32, 1] (f32) or [N/64, Kp/2, 64, 2] (bf16)");
  const int64_t panels = wd[0], kw = wd[1] * wd[3], N = panels * pw;
  auto xd = x.dimensions();
  if (xd.size() < 1) return ffi::Error::InvalidArgument("packed matmul: x must have a last dimension K");
  const int64_t K = xd.back();
  const int64_t M = K ? static_cast<int64_t>(x.element_count()) / K : 0;
  if (static_cast<int64_t>(out->element_count()) != M * N)
    return ffi::Error::InvalidArgument("packed matmul: output must hold M x N elements");
  auto xt = x.element_type(), wt = w.element_type(), ot = out->element_type();
  if (xt == ffi::DataType::F32 && wt == ffi::DataType::F32 && ot == ffi::DataType::F32) {
    if (kw != K) return ffi::Error::InvalidArgument("packed matmul: f32 w must hold K rows");
    if (M && N && K)
      PackedMatmul<float, float>(pool, static_cast<const float*>(x.untyped_data()), M, K,
                                 static_cast<const float*>(w.untyped_data()), panels, K * kF32Panel,
                                 static_cast<float*>(out->untyped_data()));
    else if (M && N)
      std::memset(out->untyped_data(), 0, out->size_bytes());
    return ffi::Error::Success();
  }
  if (xt == ffi::DataType::BF16 && wt == ffi::DataType::BF16 &&
      (ot == ffi::DataType::BF16 || ot == ffi::DataType::F32)) {
    if (kw != (K + kAmxKStep - 1) / kAmxKStep * kAmxKStep)
      return ffi::Error::InvalidArgument("packed matmul: bf16 w must hold K rows padded to a multiple of 32");
    if (!M || !N) return ffi::Error::Success();
    auto xp = static_cast<const uint16_t*>(x.untyped_data());
    auto wp = static_cast<const uint16_t*>(w.untyped_data());
    const bool to_f32 = ot == ffi::DataType::F32;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (amx && M >= kAmxPackedMinRows && AmxReady()) {
      if (to_f32)
        AmxPackedMatmul<float>(pool, xp, M, K, wp, panels, kw, static_cast<float*>(out->untyped_data()));
      else
        AmxPackedMatmul<uint16_t>(pool, xp, M, K, wp, panels, kw, static_cast<uint16_t*>(out->untyped_data()));
      return ffi::Error::Success();
    }
#endif
    if (to_f32)
      PackedMatmul<uint16_t, float>(pool, xp, M, K, wp, panels, kw * kBf16Panel, static_cast<float*>(out->untyped_data()));
    else
      PackedMatmul<uint16_t, uint16_t>(pool, xp, M, K, wp, panels, kw * kBf16Panel,
                                       static_cast<uint16_t*>(out->untyped_data()));
    return ffi::Error::Success();
  }
  return ffi::Error::InvalidArgument("packed matmul: supported are f32 x f32 -> f32 and bf16 x bf16 -> bf16/f32");
}

// ---------------------------------------------------------------------------------------------------------
// Ragged paged attention (same contract as pallas_kernels/reference.py). A unit of work is one sequence's
// block of up to kQueryBlock query tokens against one KV head: rows = tokens x the q heads sharing that KV
// head. Keys stream in chunks of 16 through an online softmax; memory per unit is O(rows x head_dim).
constexpr int64_t kQueryBlock = 64;
constexpr int kKeys = 64;

inline __m512 Exp512(__m512 x) {
  // exp(x) = 2^n * 2^f, n = round(x*log2e), |f| <= 1/2; 2^f = e^(f ln2) by its Taylor series to degree 7.
  x = _mm512_max_ps(x, _mm512_set1_ps(-150.0f));
  __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 g = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

inline void ToF32(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void ToF32(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
  }
  for (; i < n; ++i) {
    uint32_t b = static_cast<uint32_t>(src[i]) << 16;
    std::memcpy(dst + i, &b, 4);
  }
}
inline void FromF32(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void FromF32(const float* src, uint16_t* dst, int64_t n) { StoreRow<uint16_t>(src, dst, n); }

struct AttnShape {
  int64_t hq, hkv, d, page_size, max_pages;
  float sm_scale, soft_cap;
  int64_t window;  // 0: none
};

struct Unit {
  int32_t seq, head, t0, nt;
};

template <typename QT, typename KT>
void AttendUnit(const AttnShape& a, const Unit& u, const QT* q, const KT* kv, const int32_t* kv_lens,
                const int32_t* pages, const int32_t* cu, QT* out) {
  constexpr int kVecs = kKeys / 16;
  const int64_t g = a.hq / a.hkv, d = a.d, dv = d / 16, rows = u.nt * g;
  thread_local std::vector<float> scratch;
  scratch.resize(static_cast<size_t>(2 * rows * d + 2 * rows + 3 * kKeys * d + 16));
  float* qs = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t{63});
  float* acc = qs + rows * d;       // [rows, d]
  float* kc = acc + rows * d;       // [kKeys, d]
  float* vc = kc + kKeys * d;       // [kKeys, d]
  float* kt = vc + kKeys * d;       // [d, kKeys]
  float* m = kt + kKeys * d;        // [rows]
  float* l = m + rows;              // [rows]
  for (int64_t r = 0; r < rows; ++r) {
    int64_t tok = u.t0 + r / g, head = u.head * g + r % g;
    ToF32(q + (tok * a.hq + head) * d, qs + r * d, d);
    m[r] = -1e30f;
    l[r] = 0.0f;
  }
  std::memset(acc, 0, rows * d * sizeof(float));
  const int64_t kv_len = kv_lens[u.seq];
  const int64_t q_len = cu[u.seq + 1] - cu[u.seq];
  const int64_t first_pos = kv_len - q_len + (u.t0 - cu[u.seq]);
  const int64_t hi = std::min<int64_t>(first_pos + u.nt, kv_len);
  const int64_t lo = a.window > 0 ? std::max<int64_t>(first_pos - a.window + 1, 0) : 0;
  const int32_t* seq_pages = pages + u.seq * a.max_pages;
  const int64_t h2 = 2 * a.hkv;
  // Many rows share each key chunk (prefill): scores as broadcast-FMAs against K transposed. Few (decode):
  // one dot product per key.
  const bool transposed = rows >= 8;
  alignas(64) float sc[kKeys];
  for (int64_t j0 = lo; j0 < hi; j0 += kKeys) {
    const int n = static_cast<int>(std::min<int64_t>(kKeys, hi - j0));
    for (int c = 0; c < n; ++c) {
      int64_t pos = j0 + c;
      const KT* base = kv + ((static_cast<int64_t>(seq_pages[pos / a.page_size]) * a.page_size + pos % a.page_size) * h2 +
                             2 * u.head) * d;
      ToF32(base, kc + c * d, d);
      ToF32(base + d, vc + c * d, d);
    }
    if (n < kKeys) std::memset(kc + n * d, 0, (kKeys - n) * d * sizeof(float));
    if (transposed)
      for (int c = 0; c < kKeys; ++c)
        for (int64_t e = 0; e < d; ++e) kt[e * kKeys + c] = kc[c * d + e];
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pos_r = first_pos + r / g;
      // Keys this row may see: first <= c <= last (causal, inside the chunk, inside the window).
      const int last = static_cast<int>(std::min<int64_t>(n - 1, pos_r - j0));
      if (last < 0) continue;
      const int first = a.window > 0 ? static_cast<int>(std::max<int64_t>(0, pos_r - a.window + 1 - j0)) : 0;
      if (first > last) continue;
      const int nv = last / 16 + 1;  // score vectors holding a visible key
      const float* qr = qs + r * d;
      __m512 s[kVecs];
      if (transposed) {
        for (int v = 0; v < kVecs; ++v) s[v] = _mm512_setzero_ps();
        for (int64_t e = 0; e < d; ++e) {
          const __m512 qe = _mm512_set1_ps(qr[e]);
          for (int v = 0; v < kVecs; ++v)
            if (v < nv) s[v] = _mm512_fmadd_ps(qe, _mm512_load_ps(kt + e * kKeys + 16 * v), s[v]);
        }
      } else {
        for (int c = first; c <= last; ++c) {
          __m512 t = _mm512_mul_ps(_mm512_loadu_ps(qr), _mm512_loadu_ps(kc + c * d));
          for (int64_t w = 1; w < dv; ++w)
            t = _mm512_fmadd_ps(_mm512_loadu_ps(qr + 16 * w), _mm512_loadu_ps(kc + c * d + 16 * w), t);
          sc[c] = _mm512_reduce_add_ps(t);
        }
        for (int v = 0; v < nv; ++v) s[v] = _mm512_load_ps(sc + 16 * v);
      }
      __mmask16 mask[kVecs];
      __m512 mx = _mm512_set1_ps(-1e30f);
      for (int v = 0; v < nv; ++v) {
        const int lo_c = std::max(first - 16 * v, 0), hi_c = std::min(last - 16 * v, 15);
        mask[v] = lo_c > hi_c ? 0 : static_cast<__mmask16>(((1u << (hi_c + 1)) - 1) & ~((1u << lo_c) - 1));
        s[v] = _mm512_mul_ps(s[v], _mm512_set1_ps(a.sm_scale));
        if (a.soft_cap > 0) {
          _mm512_store_ps(sc, s[v]);
          for (int c = 0; c < 16; ++c) sc[c] = a.soft_cap * std::tanh(sc[c] / a.soft_cap);
          s[v] = _mm512_load_ps(sc);
        }
        mx = _mm512_mask_max_ps(mx, mask[v], mx, s[v]);
      }
      const float m_new = std::max(m[r], _mm512_reduce_max_ps(mx));
      const __m512 mv = _mm512_set1_ps(m_new);
      __m512 sum = _mm512_setzero_ps();
      for (int v = 0; v < nv; ++v) {
        s[v] = _mm512_maskz_mov_ps(mask[v], Exp512(_mm512_sub_ps(s[v], mv)));
        sum = _mm512_add_ps(sum, s[v]);
        _mm512_store_ps(sc + 16 * v, s[v]);
      }
      const float alpha = std::exp(m[r] - m_new);
      l[r] = alpha * l[r] + _mm512_reduce_add_ps(sum);
      m[r] = m_new;
      float* ar = acc + r * d;
      for (int64_t w = 0; w < dv; ++w) {
        __m512 o = _mm512_mul_ps(_mm512_loadu_ps(ar + 16 * w), _mm512_set1_ps(alpha));
        for (int c = first; c <= last; ++c)
          o = _mm512_fmadd_ps(_mm512_set1_ps(sc[c]), _mm512_loadu_ps(vc + c * d + 16 * w), o);
        _mm512_storeu_ps(ar + 16 * w, o);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float inv = l[r] > 0 ? 1.0f / l[r] : 0.0f;
    float* ar = acc + r * d;
    for (int64_t e = 0; e < d; ++e) ar[e] *= inv;
    int64_t tok = u.t0 + r / g, head = u.head * g + r % g;
    FromF32(ar, out + (tok * a.hq + head) * d, d);
  }
}

template <typename QT, typename KT>
void RaggedPagedAttention(ffi::ThreadPool& pool, const AttnShape& a, int64_t t, const QT* q, const KT* kv,
                          const int32_t* kv_lens, const int32_t* pages, const int32_t* cu, int64_t num_seqs,
                          QT* out) {
  std::vector<Unit> units;
  for (int64_t s = 0; s < num_seqs; ++s) {
    int32_t start = cu[s], end = std::min<int32_t>(cu[s + 1], static_cast<int32_t>(t));
    for (int32_t t0 = start; t0 < end; t0 += kQueryBlock)
      for (int64_t h = 0; h < a.hkv; ++h)
        units.push_back({static_cast<int32_t>(s), static_cast<int32_t>(h), t0,
                         static_cast<int32_t>(std::min<int64_t>(kQueryBlock, end - t0))});
  }
  // Rows of padding tokens are zero.
  const int64_t used = num_seqs > 0 ? std::min<int64_t>(std::max<int32_t>(cu[num_seqs], 0), t) : 0;
  std::memset(out + used * a.hq * a.d, 0, (t - used) * a.hq * a.d * sizeof(QT));
  ParallelFor(pool, static_cast<int64_t>(units.size()),
              [&](int64_t i) { AttendUnit<QT, KT>(a, units[i], q, kv, kv_lens, pages, cu, out); });
}

ffi::Error AttentionImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer kv, ffi::Buffer<ffi::S32> kv_lens,
                         ffi::Buffer<ffi::S32> page_indices, ffi::Buffer<ffi::S32> cu_q_lens,
                         ffi::Buffer<ffi::S32> num_seqs, ffi::Result<ffi::AnyBuffer> out, float sm_scale,
                         float soft_cap, int64_t window) {
  auto qd = q.dimensions(), kd = kv.dimensions(), pd = page_indices.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || pd.size() != 2)
    return ffi::Error::InvalidArgument("attention: expected q[T,Hq,D], kv_pages[P,page,2Hkv,D], page_indices[S,M]");
  AttnShape a{qd[1], kd[2] / 2, qd[2], kd[1], pd[1], sm_scale, soft_cap, window};
  const int64_t t = qd[0], seqs = pd[0];
  if (kd[3] != a.d || a.d % 16 || a.hkv == 0 || a.hq % a.hkv)
    return ffi::Error::InvalidArgument("attention: head_dim must match and be a multiple of 16; Hq % Hkv == 0");
  if (static_cast<int64_t>(kv_lens.element_count()) != seqs || static_cast<int64_t>(cu_q_lens.element_count()) != seqs + 1)
    return ffi::Error::InvalidArgument("attention: kv_lens[S] and cu_q_lens[S+1] must match page_indices[S, M]");
  const int64_t n = std::clamp<int64_t>(num_seqs.typed_data()[0], 0, seqs);
  auto lens = kv_lens.typed_data();
  auto pages = page_indices.typed_data();
  auto cu = cu_q_lens.typed_data();
  auto qt = q.element_type(), kt = kv.element_type();
  if (qt == ffi::DataType::F32 && kt == ffi::DataType::F32) {
    RaggedPagedAttention<float, float>(pool, a, t, static_cast<const float*>(q.untyped_data()),
                                       static_cast<const float*>(kv.untyped_data()), lens, pages, cu, n,
                                       static_cast<float*>(out->untyped_data()));
    return ffi::Error::Success();
  }
  if (qt == ffi::DataType::BF16 && (kt == ffi::DataType::BF16 || kt == ffi::DataType::U16)) {
    RaggedPagedAttention<uint16_t, uint16_t>(pool, a, t, static_cast<const uint16_t*>(q.untyped_data()),
                                             static_cast<const uint16_t*>(kv.untyped_data()), lens, pages, cu, n,
                                             static_cast<uint16_t*>(out->untyped_data()));
    return ffi::Error::Success();
  }
  return ffi::Error::InvalidArgument("attention: supported are f32 q with an f32 cache, bf16 q with a bf16 (or uint16-bits) cache");
}

// ---------------------------------------------------------------------------------------------------------
// Greedy LM head by screening. In a step where every sequence that samples takes the plain argmax, the head's
// full-precision read (the largest single weight) is replaced by the read of an int8 copy, q[N, Kq] (Kq = K
// rounded up to 64, zero-padded), one scale s_j per vocabulary row (w_j ~ s_j q_j), and a per-row bound c_j
// (`greedy_head_screen` in pallas_kernels/native.py) such that |x.w_j - approx_j| <= ||x|| c_j, where approx_j is
// s_j (x.q_j) accumulated in float32 here: c_j = ||w_j - s_j q_j|| + gamma ||s_j q_j|| (Cauchy-Schwarz, gamma
// covering float32 rounding). Every row whose upper bound reaches the best lower bound is a candidate; the
// candidates' logits are recomputed from the full-precision weight in double precision and the largest wins
// (the lowest id on ties): the argmax of the exact logits, for a quarter (bf16) or an eighth (f32) of the read.
// The exact weight is the head as the model holds it: packed panels (f32 or bf16), [K, N] or [N, K] (a tied
// embedding table).
constexpr int kScreenRows = 4;  // x rows per pass over q
constexpr int64_t kScreenAhead = 2048;  // bytes ahead in each of a group's row streams, prefetched into L2

struct HeadWeight {
  const void* data;
  bool bf16;
  int layout;  // 0: packed panels, 1: [K, N], 2: [N, K]
  int64_t K, N, panel_len;
  double At(int64_t k, int64_t j) const {
    int64_t i;
    if (layout == 1) {
      i = k * N + j;
    } else if (layout == 2) {
      i = j * K + k;
    } else if (!bf16) {
      i = j / kF32Panel * panel_len + k * kF32Panel + j % kF32Panel;
    } else {
      i = j / kBf16Panel * panel_len + (k / 2) * (2 * kBf16Panel) + (j % kBf16Panel) * 2 + k % 2;
    }
    if (!bf16) return static_cast<const float*>(data)[i];
    uint32_t b = static_cast<uint32_t>(static_cast<const uint16_t*>(data)[i]) << 16;
    float f;
    std::memcpy(&f, &b, 4);
    return f;
  }
};

// approx[r][j] for RT rows of xf and the G vocabulary rows js (G streams read side by side).
template <int RT, int G>
inline void ScreenDots(const float* __restrict xf, int64_t Kq, const int8_t* __restrict q, const float* scale,
                       const int64_t* js, int64_t N, float* approx) {
  __m512 acc[RT][G];
#pragma GCC unroll 4
  for (int r = 0; r < RT; ++r)
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) acc[r][g] = _mm512_setzero_ps();
  const int8_t* rows[G];
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g) rows[g] = q + js[g] * Kq;
  for (int64_t k = 0; k < Kq; k += 64) {
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) _mm_prefetch(reinterpret_cast<const char*>(rows[g] + k) + kScreenAhead, _MM_HINT_T1);
#pragma GCC unroll 4
    for (int64_t kk = k; kk < k + 64; kk += 16) {
      __m512 xv[RT];
#pragma GCC unroll 4
      for (int r = 0; r < RT; ++r) xv[r] = _mm512_loadu_ps(xf + r * Kq + kk);
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) {
        const __m512 wv = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[g] + kk))));
#pragma GCC unroll 4
        for (int r = 0; r < RT; ++r) acc[r][g] = _mm512_fmadd_ps(xv[r], wv, acc[r][g]);
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < RT; ++r)
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) approx[r * N + js[g]] = _mm512_reduce_add_ps(acc[r][g]) * scale[js[g]];
}

// Vocabulary rows [j0, j1) as four streams (the range cut in four), then the leftover rows one by one.
template <int RT>
void ScreenRange(const float* xf, int64_t Kq, const int8_t* q, const float* scale, int64_t j0, int64_t j1,
                 int64_t N, float* approx) {
  const int64_t L = (j1 - j0) / 4;
  for (int64_t i = 0; i < L; ++i) {
    const int64_t js[4] = {j0 + i, j0 + L + i, j0 + 2 * L + i, j0 + 3 * L + i};
    ScreenDots<RT, 4>(xf, Kq, q, scale, js, N, approx);
  }
  for (int64_t j = j0 + 4 * L; j < j1; ++j) ScreenDots<RT, 1>(xf, Kq, q, scale, &j, N, approx);
}

template <typename Pool>
void ScreenedArgmax(Pool& pool, const float* xf, int64_t rows, int64_t Kq, const int8_t* q, const float* scale,
                    const float* bound, const HeadWeight& w, int32_t* tokens, int32_t* candidates) {
  const int64_t N = w.N, K = w.K;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t chunk = std::max<int64_t>(256, (N + 4 * threads - 1) / (4 * threads));
  const int64_t chunks = (N + chunk - 1) / chunk;
  std::vector<float> approx(static_cast<size_t>(kScreenRows * N));
  // Per row and chunk: the best lower bound and the best upper bound of its vocabulary rows.
  std::vector<double> lower(static_cast<size_t>(kScreenRows * chunks)), upper(lower.size());
  std::vector<int64_t> cands;
  std::vector<double> exact;
  for (int64_t m0 = 0; m0 < rows; m0 += kScreenRows) {
    const int rt = static_cast<int>(std::min<int64_t>(kScreenRows, rows - m0));
    const float* x = xf + m0 * Kq;
    double norm[kScreenRows];
    for (int r = 0; r < rt; ++r) {
      double ss = 0;
      for (int64_t k = 0; k < K; ++k) ss += static_cast<double>(x[r * Kq + k]) * x[r * Kq + k];
      // Rounding in the bound arithmetic below (doubles) is covered by a relative margin.
      norm[r] = std::sqrt(ss) * (1 + 1e-9);
    }
    // Pass 1: approximate logits, and each chunk's bounds per row.
    ParallelFor(pool, chunks, [&](int64_t c) {
      const int64_t j0 = c * chunk, j1 = std::min(N, j0 + chunk);
      switch (rt) {
        case 1: ScreenRange<1>(x, Kq, q, scale, j0, j1, N, approx.data()); break;
        case 2: ScreenRange<2>(x, Kq, q, scale, j0, j1, N, approx.data()); break;
        case 3: ScreenRange<3>(x, Kq, q, scale, j0, j1, N, approx.data()); break;
        default: ScreenRange<4>(x, Kq, q, scale, j0, j1, N, approx.data()); break;
      }
      for (int r = 0; r < rt; ++r) {
        double lo = -INFINITY, hi = -INFINITY;
        const float* a = approx.data() + r * N;
        for (int64_t j = j0; j < j1; ++j) {
          const double b = norm[r] * bound[j];
          lo = std::max(lo, a[j] - b);
          hi = std::max(hi, a[j] + b);
        }
        lower[r * chunks + c] = lo;
        upper[r * chunks + c] = hi;
      }
    });
    // Pass 2, per row: the candidates (upper bound at least the best lower bound; a chunk whose best upper bound
    // falls short has none), their exact logits, the winner.
    for (int r = 0; r < rt; ++r) {
      double floor = -INFINITY;
      for (int64_t c = 0; c < chunks; ++c) floor = std::max(floor, lower[r * chunks + c]);
      const float* a = approx.data() + r * N;
      const float* xr = x + r * Kq;
      cands.clear();
      for (int64_t c = 0; c < chunks; ++c) {
        if (!(upper[r * chunks + c] >= floor)) continue;
        for (int64_t j = c * chunk, j1 = std::min(N, j + chunk); j < j1; ++j)
          if (a[j] + norm[r] * bound[j] >= floor) cands.push_back(j);
      }
      if (cands.empty()) {  // NaN in x or the approximations: no bound holds; read every row exactly
        for (int64_t j = 0; j < N; ++j) cands.push_back(j);
      }
      exact.resize(cands.size());
      const int64_t n = static_cast<int64_t>(cands.size()), per = 64;
      auto dots = [&](int64_t i0) {
        for (int64_t i = i0, i1 = std::min(n, i0 + per); i < i1; ++i) {
          double logit = 0;
          for (int64_t k = 0; k < K; ++k) logit += static_cast<double>(xr[k]) * w.At(k, cands[i]);
          exact[i] = logit;
        }
      };
      ParallelFor(pool, (n + per - 1) / per, [&](int64_t b) { dots(b * per); });
      int64_t best = 0;
      for (int64_t i = 1; i < n; ++i)
        if (exact[i] > exact[best]) best = i;  // strictly greater: the lowest id on ties
      tokens[m0 + r] = static_cast<int32_t>(cands[best]);
      candidates[m0 + r] = static_cast<int32_t>(n);
    }
  }
}

ffi::Error GreedyHeadImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S8> q,
                          ffi::Buffer<ffi::F32> bounds, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> num_rows,
                          ffi::Result<ffi::Buffer<ffi::S32>> tokens, ffi::Result<ffi::Buffer<ffi::S32>> candidates,
                          int32_t layout) {
  auto xd = x.dimensions(), qd = q.dimensions(), bd = bounds.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || qd.size() != 2 || bd.size() != 2 || bd[0] != 2)
    return ffi::Error::InvalidArgument("greedy head: expected x[M, K], q[N, Kq], bounds[2, N]");
  const int64_t M = xd[0], K = xd[1], N = qd[0], Kq = qd[1];
  if (bd[1] != N || Kq % 64 || Kq < K)
    return ffi::Error::InvalidArgument("greedy head: q must be [N, K rounded up to 64] and bounds [2, N]");
  const bool bf16 = w.element_type() == ffi::DataType::BF16;
  if (x.element_type() != w.element_type() || !(bf16 || w.element_type() == ffi::DataType::F32))
    return ffi::Error::InvalidArgument("greedy head: x and w must both be f32 or both bf16");
  HeadWeight hw{w.untyped_data(), bf16, layout, K, N, 0};
  if (layout == 0) {
    const int64_t pw = bf16 ? kBf16Panel : kF32Panel;
    if (wd.size() != 4 || wd[2] != pw || wd[0] * pw != N || wd[1] * wd[3] < K)
      return ffi::Error::InvalidArgument("greedy head: packed w does not match x and q");
    hw.panel_len = wd[1] * wd[2] * wd[3];
  } else if (wd.size() != 2 || (layout == 1 ? (wd[0] != K || wd[1] != N) : (wd[0] != N || wd[1] != K))) {
    return ffi::Error::InvalidArgument("greedy head: w must be [K, N] (layout 1) or [N, K] (layout 2)");
  }
  if (static_cast<int64_t>(tokens->element_count()) != M || static_cast<int64_t>(candidates->element_count()) != M)
    return ffi::Error::InvalidArgument("greedy head: tokens and candidates must be [M]");
  const int64_t rows = std::clamp<int64_t>(num_rows.typed_data()[0], 0, M);
  std::memset(tokens->untyped_data(), 0, M * sizeof(int32_t));
  std::memset(candidates->untyped_data(), 0, M * sizeof(int32_t));
  if (!rows || !N) return ffi::Error::Success();
  std::vector<float> xf(static_cast<size_t>(rows * Kq), 0.0f);
  for (int64_t m = 0; m < rows; ++m) {
    if (bf16)
      ToF32(static_cast<const uint16_t*>(x.untyped_data()) + m * K, xf.data() + m * Kq, K);
    else
      ToF32(static_cast<const float*>(x.untyped_data()) + m * K, xf.data() + m * Kq, K);
  }
  ScreenedArgmax(pool, xf.data(), rows, Kq, q.typed_data(), bounds.typed_data(), bounds.typed_data() + N, hw,
                 tokens->typed_data(), candidates->typed_data());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshserveMatmul, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshserveRaggedPagedAttention, AttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("window"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshserveMatmulPacked, MatmulPackedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("amx"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshserveGreedyHead, GreedyHeadImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int32_t>("layout"));
