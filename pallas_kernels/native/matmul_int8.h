// int8 weights with float32 scales (quantized serving): out[M, N] = (x[M, K] @ w) * scale, accumulated in float32,
// x float32 or bfloat16 (cast to float32). scale is [G, N]: G groups of K/G rows, each column its own scale per group
// (G = 1: one per column), applied to each group's sum. Included inside an instruction set's namespace (kernels.cc);
// written in V (simd.h), and in I8Dot where the CPU has int8 dot products.
//
// Packed weights (pallas_kernels/native `pack_weight` of int8): [N/64, Kp/4, 64, 4], K zero-padded to Kp (a multiple
// of 4) and rows k..k+3 of each column side by side (a "quad": the operand layout of vpdpbusd and sdot). Each
// thread streams whole panels, as the float kernels do (matmul.h), by one of two methods:
//   widen  each quad widened to four float32 (shifts and a convert), FMAs against x: exact products, the float32
//          kernels' accumulation;
//   dot    x quantised per row to two int8 digits, x ~ sx (h + l / 254) with sx = max|x| / 127, h = round(x / sx),
//          l = round((x / sx - h) 254): |x - sx (h + l / 254)| <= sx / 508 (+ float32 rounding of x / sx), ~15 bits
//          against the row's largest element, the order of bfloat16 x's own rounding. Each digit's int32 dot
//          products with the quads (4 multiply-adds per lane and instruction), the sums combined in float32. vpdpbusd
//          multiplies unsigned by signed bytes: the weights are read as w + 128 (a xor) and x as the signed
//          operand, and 128 sum(h), 128 sum(l) per row and group are taken off.
// Row-major weights [K, N] (those not packed, few rows): matmul.h's widening tiles (MatmulRows), a group at a time.
constexpr int64_t kI8Panel = 64;          // columns per packed panel
constexpr int64_t kI8MaxDotGroup = 65536;  // most K rows per int32 sum of the dot method (65536 * 255 * 127 < 2^31)
constexpr float kI8LowDigit = 254;         // the low digit's unit: l / 254

// Vectors of columns per packed tile of RT rows (a divisor of the panel's): the widest whose registers fit, with D
// accumulators per (row, vector) (widen 1, dot 2) plus the tile's other values: widen the four widened rows of a
// quad; dot each row's two broadcast digits, where several column vectors share them. Measured on the AMD EPYC
// (weights in L2): widened 4 rows x the whole panel ran ~1.8x as fast as 8 rows x 1 vector; dot products 2 rows x
// the whole panel (one pass over it) as fast as 4 rows x 2 vectors (two) and ~1.5x 8 rows x 1.
template <int RT, int D>
constexpr int I8Footprint(int cb) {
  return D == 1 ? RT * cb + 4 : D * RT * cb + (cb > 1 ? 2 * RT : 0);
}

template <int RT, int D>
constexpr int I8Cols() {
  for (int cb = kI8Panel / V::kLanes; cb > 1; cb /= 2)
    if (I8Footprint<RT, D>(cb) <= V::kAccRegs) return cb;
  return 1;
}

// Streams per panel (K cut in S parts, each with its own accumulators and digits, the widened quad shared: more
// reads in flight per core).
template <int RT, int CB, int D>
constexpr int I8Streams() {
  constexpr int fit = D == 1 ? (V::kAccRegs - 4) / (RT * CB) : V::kAccRegs / I8Footprint<RT, D>(CB);
  return fit >= kMaxStreams ? kMaxStreams : fit < 1 ? 1 : fit;
}

// The operands of one call, as the tiles read them.
struct I8Problem {
  int64_t K, kp, N, groups, group_quads;  // quads (4 K rows) per group
  const float* scale;                     // [groups, N]
  const float* xf;                        // widen: x as float32 [M, ldx], zero-padded to kp
  int64_t ldx;
  const int8_t* xq;        // dot: x's digits [M][2][kp] (h, then l; zero-padded)
  const float* row_scale;  // dot: sx [M]
  const int32_t* corr;     // dot: [M][groups][2] what the weights' offset added to the h and l sums
};

// Prefetches packed row q + kPackedAhead / 256 into L2 (the first column vector's pass over the panel does it).
inline void I8Prefetch(const int8_t* wq) {
  const char* ahead = reinterpret_cast<const char*>(wq) + kPackedAhead;
#pragma GCC unroll 4
  for (int64_t l = 0; l < 4 * kI8Panel; l += 64) PrefetchT1(ahead + l);
}

// tot[r][c] (+)= sum[r][c] * scale[columns of vector c0 + c]; the first group sets it.
template <int RT, int CB>
inline void I8AddGroup(V::F (&tot)[RT][CB], const V::F (&sum)[RT][CB], const float* scale, int c0, bool first) {
#pragma GCC unroll 8
  for (int c = 0; c < CB; ++c) {
    const V::F s = V::Load(scale + V::kLanes * (c0 + c));
#pragma GCC unroll 16
    for (int r = 0; r < RT; ++r) tot[r][c] = first ? V::Mul(sum[r][c], s) : V::Fma(sum[r][c], s, tot[r][c]);
  }
}

template <int RT, int CB, typename Out>
inline void I8Store(const V::F (&tot)[RT][CB], const float* row_scale, Out* out, int64_t ldo, int c0) {
#pragma GCC unroll 16
  for (int r = 0; r < RT; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < CB; ++c) {
      const V::F v = row_scale ? V::Mul(tot[r][c], V::Set1(row_scale[r])) : tot[r][c];
      StoreF32(out + r * ldo + V::kLanes * (c0 + c), v, V::Mask(V::kLanes));
    }
}

// ---------------------------------------------------------------------------------------------------------
// widen

template <int RT, int CB>
inline void I8WidenStep(V::F (&acc)[RT][CB], const float* __restrict x, int64_t ldx, const int8_t* __restrict wp,
                        int64_t q, int c0) {
  const int8_t* wq = wp + q * 4 * kI8Panel;
  if (c0 == 0) I8Prefetch(wq);
#pragma GCC unroll 8
  for (int c = 0; c < CB; ++c) {
    V::F w[4];
    V::I8Quads(wq + 4 * V::kLanes * (c0 + c), w);
#pragma GCC unroll 16
    for (int r = 0; r < RT; ++r) {
      const float* xr = x + r * ldx + 4 * q;
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) acc[r][c] = V::Fma(V::Set1(xr[j]), w[j], acc[r][c]);
    }
  }
}

// RT rows x the panel's columns, CB vectors at a time, over every group.
template <int RT, typename Out>
inline void I8WidenTile(const I8Problem& p, const float* x, const int8_t* wp, const float* scale, Out* out) {
  constexpr int CB = I8Cols<RT, 1>(), S = I8Streams<RT, CB, 1>(), panel = kI8Panel / V::kLanes;
  static_assert(panel % CB == 0, "a tile's columns must divide the panel");
  const int64_t quads = p.kp / 4;
  for (int c0 = 0; c0 < panel; c0 += CB) {
    V::F tot[RT][CB];
    for (int64_t g = 0; g < p.groups; ++g) {
      const int64_t q0 = g * p.group_quads, q1 = Min(quads, q0 + p.group_quads), part = (q1 - q0) / S;
      V::F acc[S][RT][CB];
#pragma GCC unroll 4
      for (int s = 0; s < S; ++s)
#pragma GCC unroll 16
        for (int r = 0; r < RT; ++r)
#pragma GCC unroll 8
          for (int c = 0; c < CB; ++c) acc[s][r][c] = V::Zero();
      for (int64_t i = 0; i < part; ++i)
#pragma GCC unroll 4
        for (int s = 0; s < S; ++s) I8WidenStep<RT, CB>(acc[s], x, p.ldx, wp, q0 + s * part + i, c0);
      for (int64_t q = q0 + S * part; q < q1; ++q) I8WidenStep<RT, CB>(acc[0], x, p.ldx, wp, q, c0);
#pragma GCC unroll 4
      for (int s = 1; s < S; ++s)
#pragma GCC unroll 16
        for (int r = 0; r < RT; ++r)
#pragma GCC unroll 8
          for (int c = 0; c < CB; ++c) acc[0][r][c] = V::Add(acc[0][r][c], acc[s][r][c]);
      I8AddGroup<RT, CB>(tot, acc[0], scale + g * p.N, c0, g == 0);
    }
    I8Store<RT, CB, Out>(tot, nullptr, out, p.N, c0);
  }
}

template <typename Out, int RT = V::kI8Rows>
inline void I8WidenRows(int64_t rows, const I8Problem& p, const float* x, const int8_t* wp, const float* scale,
                        Out* out) {
  if constexpr (RT > 1)
    if (rows < RT) return I8WidenRows<Out, RT - 1>(rows, p, x, wp, scale, out);
  I8WidenTile<RT, Out>(p, x, wp, scale, out);
}

// ---------------------------------------------------------------------------------------------------------
// dot: I8Dot, the int8 dot products of this instruction set (MESHSERVE_I8DOT), in functions built for them
// (MESHSERVE_I8DOT_TARGET: the rest of this copy of the kernels runs on CPUs without them).
#if MESHSERVE_X86_AVX512
#define MESHSERVE_I8DOT 1
#define MESHSERVE_I8DOT_TARGET __attribute__((target("avx512vnni")))
struct I8Dot {
  using I = __m512i;
  static constexpr int32_t kOffset = 128;  // vpdpbusd's unsigned operand: the weights, as w + 128
  static constexpr int kRows = 2;
  MESHSERVE_I8DOT_TARGET static I Zero() { return _mm512_setzero_si512(); }
  MESHSERVE_I8DOT_TARGET static I Weights(const int8_t* p) {
    return _mm512_xor_si512(_mm512_loadu_si512(p), _mm512_set1_epi8(static_cast<char>(0x80)));
  }
  // acc + the dot products of each lane's 4 weight bytes with the 4 bytes at x (broadcast). In assembly: GCC 12
  // moved every accumulator between two registers around each _mm512_dpbusd_epi32 (3x the instructions).
  MESHSERVE_I8DOT_TARGET static I Dot(I acc, I w, const int8_t* x) {
    __asm__("vpdpbusd %[x]%{1to16%}, %[w], %[acc]"
            : [acc] "+v"(acc)
            : [w] "v"(w), [x] "m"(*reinterpret_cast<const int32_t*>(x)));
    return acc;
  }
  MESHSERVE_I8DOT_TARGET static I Add(I a, I b) { return _mm512_add_epi32(a, b); }
  MESHSERVE_I8DOT_TARGET static V::F ToF(I a, int32_t minus) {
    return _mm512_cvtepi32_ps(_mm512_sub_epi32(a, _mm512_set1_epi32(minus)));
  }
  static V::F Round(V::F v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // The first m lanes of v (integers in [-127, 127]) as int8.
  static void StoreI8(int8_t* p, V::F v, V::M m) { _mm512_mask_cvtepi32_storeu_epi8(p, m, _mm512_cvtps_epi32(v)); }
};
#elif MESHSERVE_NEON
#define MESHSERVE_I8DOT 1
#if MESHSERVE_BF16_PAIRS
#define MESHSERVE_I8DOT_TARGET __attribute__((target("arch=armv8.2-a+dotprod+bf16")))
#else
#define MESHSERVE_I8DOT_TARGET __attribute__((target("arch=armv8.2-a+dotprod")))
#endif
struct I8Dot {
  using I = int32x4_t;
  static constexpr int32_t kOffset = 0;  // sdot multiplies signed by signed
  static constexpr int kRows = 4;
  MESHSERVE_I8DOT_TARGET static I Zero() { return vdupq_n_s32(0); }
  MESHSERVE_I8DOT_TARGET static I Weights(const int8_t* p) { return vreinterpretq_s32_s8(vld1q_s8(p)); }
  MESHSERVE_I8DOT_TARGET static I Dot(I acc, I w, const int8_t* x) {
    int32_t v;
    std::memcpy(&v, x, 4);
    return vdotq_s32(acc, vreinterpretq_s8_s32(w), vreinterpretq_s8_s32(vdupq_n_s32(v)));
  }
  MESHSERVE_I8DOT_TARGET static I Add(I a, I b) { return vaddq_s32(a, b); }
  MESHSERVE_I8DOT_TARGET static V::F ToF(I a, int32_t minus) { return vcvtq_f32_s32(vsubq_s32(a, vdupq_n_s32(minus))); }
  static V::F Round(V::F v) { return vrndnq_f32(v); }
  static void StoreI8(int8_t* p, V::F v, V::M n) {  // the first n lanes (integers in [-127, 127]) as int8
    int8_t b[8];
    vst1_s8(b, vmovn_s16(vcombine_s16(vmovn_s32(vcvtnq_s32_f32(v)), vdup_n_s16(0))));
    std::memcpy(p, b, n);
  }
};
#endif

#if MESHSERVE_I8DOT
template <int RT, typename Out>
MESHSERVE_I8DOT_TARGET inline void I8DotTile(const I8Problem& p, int64_t m, const int8_t* wp, const float* scale,
                                             Out* out) {
  constexpr int CB = I8Cols<RT, 2>(), S = I8Streams<RT, CB, 2>(), panel = kI8Panel / V::kLanes;
  static_assert(panel % CB == 0, "a tile's columns must divide the panel");
  const int64_t quads = p.kp / 4, ldx = 2 * p.kp;
  const int8_t* x = p.xq + m * ldx;
  const int32_t* corr = p.corr + m * p.groups * 2;
  for (int c0 = 0; c0 < panel; c0 += CB) {
    V::F tot[RT][CB];
    for (int64_t g = 0; g < p.groups; ++g) {
      const int64_t q0 = g * p.group_quads, q1 = Min(quads, q0 + p.group_quads), part = (q1 - q0) / S;
      I8Dot::I hi[S][RT][CB], lo[S][RT][CB];
#pragma GCC unroll 4
      for (int s = 0; s < S; ++s)
#pragma GCC unroll 16
        for (int r = 0; r < RT; ++r)
#pragma GCC unroll 8
          for (int c = 0; c < CB; ++c) hi[s][r][c] = lo[s][r][c] = I8Dot::Zero();
      // (written out here: with the accumulators passed to a step function GCC copied them every step)
      for (int64_t i = 0, tail = q1 - q0 - S * part; i < part + tail; ++i) {
        const int streams = i < part ? S : 1;
#pragma GCC unroll 4
        for (int s = 0; s < S; ++s) {
          if (s >= streams) break;
          const int64_t q = i < part ? q0 + s * part + i : q0 + S * part + i - part;
          const int8_t* wq = wp + q * 4 * kI8Panel;
          if (c0 == 0) I8Prefetch(wq);
#pragma GCC unroll 8
          for (int c = 0; c < CB; ++c) {
            const I8Dot::I w = I8Dot::Weights(wq + 4 * V::kLanes * (c0 + c));
#pragma GCC unroll 16
            for (int r = 0; r < RT; ++r) {
              hi[s][r][c] = I8Dot::Dot(hi[s][r][c], w, x + r * ldx + 4 * q);
              lo[s][r][c] = I8Dot::Dot(lo[s][r][c], w, x + r * ldx + p.kp + 4 * q);
            }
          }
        }
      }
      V::F sum[RT][CB];
#pragma GCC unroll 16
      for (int r = 0; r < RT; ++r) {
        const int32_t* cr = corr + (r * p.groups + g) * 2;
#pragma GCC unroll 8
        for (int c = 0; c < CB; ++c) {
#pragma GCC unroll 4
          for (int s = 1; s < S; ++s) {
            hi[0][r][c] = I8Dot::Add(hi[0][r][c], hi[s][r][c]);
            lo[0][r][c] = I8Dot::Add(lo[0][r][c], lo[s][r][c]);
          }
          sum[r][c] = V::Fma(I8Dot::ToF(lo[0][r][c], cr[1]), V::Set1(1 / kI8LowDigit), I8Dot::ToF(hi[0][r][c], cr[0]));
        }
      }
      I8AddGroup<RT, CB>(tot, sum, scale + g * p.N, c0, g == 0);
    }
    I8Store<RT, CB, Out>(tot, p.row_scale + m, out, p.N, c0);
  }
}

template <typename Out, int RT = I8Dot::kRows>
MESHSERVE_I8DOT_TARGET inline void I8DotRows(int64_t rows, const I8Problem& p, int64_t m, const int8_t* wp,
                                             const float* scale, Out* out) {
  if constexpr (RT > 1)
    if (rows < RT) return I8DotRows<Out, RT - 1>(rows, p, m, wp, scale, out);
  I8DotTile<RT, Out>(p, m, wp, scale, out);
}

// Rows [m0, m1) of panels [j0, j1).
template <typename Out>
MESHSERVE_I8DOT_TARGET void I8DotPanels(const I8Problem& p, int64_t m0, int64_t m1, int64_t j0, int64_t j1,
                                        const int8_t* w, Out* out) {
  for (int64_t j = j0; j < j1; ++j)
    for (int64_t m = m0; m < m1; m += I8Dot::kRows)
      I8DotRows<Out>(Min<int64_t>(I8Dot::kRows, m1 - m), p, m, w + j * p.kp * kI8Panel, p.scale + j * kI8Panel,
                     out + m * p.N + j * kI8Panel);
}

bool Int8Dot() { return CpuHasInt8Dot(); }
#else
bool Int8Dot() { return false; }
#endif

// x's rows [M, K] (float32 or bfloat16) as float32 [M, kp], zero-padded.
template <typename XT>
void I8FloatRows(const XT* x, int64_t M, int64_t K, int64_t kp, float* xf) {
  for (int64_t m = 0; m < M; ++m) {
    ToF32(x + m * K, xf + m * kp, K);
    for (int64_t k = K; k < kp; ++k) xf[m * kp + k] = 0;
  }
}

#if MESHSERVE_I8DOT
// The dot method's x: each row's digits h, l (I8Problem::xq), its scale sx and what the weights' offset adds per
// group. A row with a non-finite element gets sx = NaN: its outputs are NaN. Digit sums are exact in float32
// (|h|, |l| <= 127, at most kI8MaxDotGroup of them).
inline void I8QuantizeRows(const float* xf, int64_t M, int64_t kp, int64_t groups, int64_t group_quads, int8_t* xq,
                           float* sx, int32_t* corr) {
  const int64_t group = 4 * group_quads;
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = xf + m * kp;
    V::F amax = V::Zero(), nan = V::Zero();  // nan: x * 0 summed, NaN iff some x is not finite
    for (int64_t k = 0; k < kp; k += V::kLanes) {
      const V::F v = V::LoadM(xr + k, V::Mask(kp - k));
      amax = V::Max(amax, V::Max(v, V::Sub(V::Zero(), v)));
      nan = V::Add(nan, V::Mul(v, V::Zero()));
    }
    const float a = V::ReduceMax(amax);
    const bool finite = V::ReduceAdd(nan) == 0;
    sx[m] = !finite ? NAN : a > 0 ? a / 127 : 1.0f;
    const V::F inv = V::Set1(finite ? 1 / sx[m] : 0.0f), unit = V::Set1(kI8LowDigit);
    int8_t* h = xq + m * 2 * kp;
    int8_t* l = h + kp;
    for (int64_t g = 0; g < groups; ++g) {
      V::F sh = V::Zero(), sl = V::Zero();
      for (int64_t k = g * group, k1 = Min(kp, k + group); k < k1; k += V::kLanes) {
        const V::M mask = V::Mask(k1 - k);
        const V::F t = V::Mul(V::LoadM(xr + k, mask), inv);  // |t| <= 127 (to rounding): no clamp needed
        const V::F th = I8Dot::Round(t), tl = I8Dot::Round(V::Mul(V::Sub(t, th), unit));
        I8Dot::StoreI8(h + k, th, mask);
        I8Dot::StoreI8(l + k, tl, mask);
        sh = V::Add(sh, th);
        sl = V::Add(sl, tl);
      }
      corr[(m * groups + g) * 2] = finite ? I8Dot::kOffset * static_cast<int32_t>(V::ReduceAdd(sh)) : 0;
      corr[(m * groups + g) * 2 + 1] = finite ? I8Dot::kOffset * static_cast<int32_t>(V::ReduceAdd(sl)) : 0;
    }
  }
}
#endif  // MESHSERVE_I8DOT

template <typename XT, typename Out>
void I8PackedMatmul(const Runner& run, const XT* x, int64_t M, int64_t K, const int8_t* w, int64_t N,
                    const float* scale, int64_t groups, int32_t method, Out* out) {
  const int64_t kp = (K + 3) / 4 * 4;
  I8Problem p{K, kp, N, groups, kp / 4 / groups, scale, nullptr, kp, nullptr, nullptr, nullptr};
  // auto: the dot method wherever it runs (on the AMD EPYC: faster at every row count with the weights in L2; from
  // memory even within noise at 1-4 rows, 10-25% faster from 5-6; docs/native-kernels.md)
  [[maybe_unused]] const bool dot = Int8Dot() && (method == kInt8Dot ||
                                                  (method == kInt8Auto && kp / groups <= kI8MaxDotGroup));
  if constexpr (std::is_same_v<XT, float>)
    if (kp == K) p.xf = x;
  Zeros<float> xf(p.xf ? 0 : static_cast<size_t>(M * kp));
  if (!p.xf) {
    I8FloatRows(x, M, K, kp, xf.get());
    p.xf = xf.get();
  }
#if MESHSERVE_I8DOT
  Zeros<int8_t> xq(dot ? static_cast<size_t>(M * 2 * kp) : 0);
  Zeros<float> sx(dot ? static_cast<size_t>(M) : 0);
  Zeros<int32_t> corr(dot ? static_cast<size_t>(M * groups * 2) : 0);
  if (dot) {
    I8QuantizeRows(p.xf, M, kp, groups, p.group_quads, xq.get(), sx.get(), corr.get());
    p.xq = xq.get();
    p.row_scale = sx.get();
    p.corr = corr.get();
  }
#endif
  const int64_t panels = N / kI8Panel;
  const int64_t per_chunk = ChunkUnits(N, kI8Panel, run.threads);
  const int64_t chunks = (panels + per_chunk - 1) / per_chunk, mblocks = (M + kPackedMBlock - 1) / kPackedMBlock;
  ParallelFor(run, chunks * mblocks, [&](int64_t unit) {
    const int64_t ci = unit % chunks, m0 = unit / chunks * kPackedMBlock;
    const int64_t j0 = ci * per_chunk, j1 = Min<int64_t>(panels, j0 + per_chunk);
    const int64_t m1 = Min<int64_t>(M, m0 + kPackedMBlock);
#if MESHSERVE_I8DOT
    if (dot) return I8DotPanels<Out>(p, m0, m1, j0, j1, w, out);
#endif
    for (int64_t j = j0; j < j1; ++j)
      for (int64_t m = m0; m < m1; m += V::kI8Rows)
        I8WidenRows<Out>(Min<int64_t>(V::kI8Rows, m1 - m), p, p.xf + m * p.ldx, w + j * kp * kI8Panel,
                         scale + j * kI8Panel, out + m * N + j * kI8Panel);
  });
}

// ---------------------------------------------------------------------------------------------------------
// Row-major weights: MatmulRows' structure (matmul.h), the K blocks cut at group ends; each group's sums (float32,
// per thread) are scaled into the total (the output itself for float32 out).

template <int RT, int CB>
inline void I8RowMajorTile(int64_t rows, const float* xt, const int8_t* w, int64_t ldw, int64_t kb, float* acc,
                           int64_t lda, const V::M* masks, bool first) {
  if constexpr (RT > 1)
    if (rows < RT) return I8RowMajorTile<RT - 1, CB>(rows, xt, w, ldw, kb, acc, lda, masks, first);
  WidenTile<RT, CB, int8_t>(xt, w, ldw, kb, acc, lda, masks, first);
}

template <typename Out>
void I8RowMajorMatmul(const Runner& run, const float* x, int64_t M, int64_t K, const int8_t* w, int64_t N,
                      const float* scale, int64_t groups, Out* out) {
  constexpr int RT = V::kI8Rows, CB = CbFor(RT);
  constexpr int64_t panel = V::kLanes * CB;
  const int64_t group = K / groups;
  const int64_t per_chunk = ChunkUnits(N, panel, run.threads);
  const int64_t chunks = ((N + panel - 1) / panel + per_chunk - 1) / per_chunk;
  ParallelFor(run, chunks, [&](int64_t ci) {
    const int64_t c0 = ci * per_chunk * panel, c1 = Min<int64_t>(N, c0 + per_chunk * panel), width = c1 - c0;
    thread_local Scratch acc_buf, tot_buf, xts_buf;
    float* acc = acc_buf.Get<float>(static_cast<size_t>(M * width));
    float* tot;
    int64_t ldt;
    if constexpr (std::is_same_v<Out, float>) {
      tot = out + c0;
      ldt = N;
    } else {
      tot = tot_buf.Get<float>(static_cast<size_t>(M * width));
      ldt = width;
    }
    const int64_t tiles = (M + RT - 1) / RT;
    float* xts = xts_buf.Get<float>(static_cast<size_t>(tiles * RT * kKBlock));
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += kKBlock) {
        const int64_t kb = Min<int64_t>(kKBlock, (g + 1) * group - k0);
        for (int64_t t = 0; t < tiles; ++t)
          PackX(x, K, t * RT, Min<int64_t>(RT, M - t * RT), k0, kb, xts + t * RT * kKBlock);
        for (int64_t n0 = 0; n0 < width; n0 += panel) {
          V::M masks[CB];
          for (int c = 0; c < CB; ++c) masks[c] = V::Mask(width - n0 - V::kLanes * c);
          for (int64_t t = 0; t < tiles; ++t)
            I8RowMajorTile<RT, CB>(Min<int64_t>(RT, M - t * RT), xts + t * RT * kKBlock, w + k0 * N + c0 + n0, N,
                                   kb, acc + t * RT * width + n0, width, masks, k0 == g * group);
        }
      }
      const float* s = scale + g * N + c0;
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < width; n += V::kLanes) {
          const V::M mask = V::Mask(width - n);
          const V::F a = V::LoadM(acc + m * width + n, mask), sv = V::LoadM(s + n, mask);
          float* t = tot + m * ldt + n;
          V::StoreM(t, g == 0 ? V::Mul(a, sv) : V::Fma(a, sv, V::LoadM(t, mask)), mask);
        }
    }
    if constexpr (!std::is_same_v<Out, float>)
      for (int64_t m = 0; m < M; ++m) StoreRow<Out>(tot + m * ldt, out + m * N + c0, width);
  });
}

template <typename XT, typename Out>
void MatmulInt8(const Runner& run, const XT* x, int64_t M, int64_t K, const int8_t* w, int64_t N, bool packed,
                const float* scale, int64_t groups, int32_t method, Out* out) {
  if (packed) return I8PackedMatmul<XT, Out>(run, x, M, K, w, N, scale, groups, method, out);
  Zeros<float> xf(std::is_same_v<XT, float> ? 0 : static_cast<size_t>(M * K));
  const float* xs;
  if constexpr (std::is_same_v<XT, float>) {
    xs = x;
  } else {
    I8FloatRows(x, M, K, K, xf.get());
    xs = xf.get();
  }
  I8RowMajorMatmul<Out>(run, xs, M, K, w, N, scale, groups, out);
}

void MatmulInt8Entry(const Runner& run, Dt in, Dt out, const void* x, int64_t M, int64_t K, const int8_t* w,
                     int64_t N, bool packed, const float* scale, int64_t groups, int32_t method, void* o) {
  auto call = [&](auto* xp, auto* op) { MatmulInt8(run, xp, M, K, w, N, packed, scale, groups, method, op); };
  const void* xv = x;
  if (in == Dt::kF32) {
    if (out == Dt::kF32) return call(static_cast<const float*>(xv), static_cast<float*>(o));
    return call(static_cast<const float*>(xv), static_cast<uint16_t*>(o));
  }
  if (out == Dt::kF32) return call(static_cast<const uint16_t*>(xv), static_cast<float*>(o));
  call(static_cast<const uint16_t*>(xv), static_cast<uint16_t*>(o));
}
