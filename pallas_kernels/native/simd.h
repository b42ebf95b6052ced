// `V`: the vector operations the kernels are written in, for the instruction set this copy of kernels.cc is built
// for (MESHSERVE_ISA_ID, see kernels.cc): one `VOps` per instruction set, plus WidenedPairs where it has no bfloat16
// dot product. Included inside that copy's namespace, after the system headers.
//
//   F                     a vector of kLanes float32
//   M, Mask(n)            the first n lanes (tails of rows)
//   Load/Store[M]         float32; LoadBf16[M]/StoreBf16M bfloat16 widened / rounded to nearest even; LoadI8[M] int8
//   I8Quads(p, q)         kLanes columns of packed int8 quads (4 bytes per column: K rows k..k+3) as 4 float32
//                         vectors, q[j] holding row k+j
//   I8ToBf16(p, d)        (native pairs only) 2 kLanes int8 as bfloat16, in order (exact: |w| <= 127)
//   QuadSet1(x)           (native pairs only) bfloat16 x[0..3] in every 64 bits: against a vector of packed quads
//                         (kLanes / 2 columns x 4 K rows), PairDot sums rows k, k+1 in even lanes and k+2, k+3 in
//                         odd ones; AddPairs(a, b) adds each lane pair: a's columns, then b's
//   Fma(a, b, c)          a * b + c; Div(a, b) a / b
//   Exp                   e^x for x <= 0 (softmax), ~1 ulp
//   Pair*                 the bfloat16 pair layout of packed weights (rows k, k+1 of a column side by side):
//                         PairDot(acc, x pair, w pairs) = acc + x[k] w[k, :] + x[k+1] w[k+1, :] over kLanes
//                         columns; one instruction where the CPU has bfloat16 dot products (kNativePairs),
//                         else two FMAs on the halves widened in registers (x then comes as float32: PairX).
//   kAccRegs              vector registers a tile's accumulators may take
//   kWidenPanelMinRows    bfloat16 steps of this many rows widen each panel to float32 once (matmul.h)
//   kF32Rows, kBf16Rows   rows per packed-matmul tile; kBf16SubCols: vectors of columns per bfloat16 tile of
//                         more than one row; kScreenStreams: vocabulary rows per greedy-screen pass; kI8Rows: rows
//                         per int8 tile (matmul_int8.h)
//   kI8PanelMinRows,      rows from which the int8 matmul's widened products widen each panel once (to bfloat16
//   kI8F32PanelMinRows    where x is bfloat16 and the path has native pairs, else to float32), matmul_int8.h
//
// Tails (M) on x86 are masked loads; elsewhere a partial copy through a small buffer.

#if MESHSERVE_X86_AVX512
// ------------------------------------------------------------------------------------------------------------------
struct VOps {
  using F = __m512;
  using M = __mmask16;
  static constexpr int kLanes = 16;
  static constexpr int kAccRegs = 28;  // of 32
  static constexpr int kF32Rows = 14;
#if MESHSERVE_BF16_PAIRS
  static constexpr int kBf16Rows = 6;
#else
  static constexpr int kBf16Rows = 4;  // two registers per widened pair vector
#endif
  static constexpr int kBf16SubCols = 4;  // the whole 64-column panel
  static constexpr int64_t kWidenPanelMinRows = INT64_MAX;  // (measured: the pair tiles win at every height)
  static constexpr int kScreenStreams = 4;
  static constexpr int kI8Rows = 4;
  // Measured on the AMD EPYC (Zen 5, one thread, W1 shapes): bfloat16 panels vs the dot method even at 12 rows,
  // faster from 16; float32 panels no faster than widening per 4-row tile even at 256 rows.
  static constexpr int64_t kI8PanelMinRows = 12, kI8F32PanelMinRows = INT64_MAX;

  static F Zero() { return _mm512_setzero_ps(); }
  static F Set1(float a) { return _mm512_set1_ps(a); }
  static F Load(const float* p) { return _mm512_loadu_ps(p); }
  static void Store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static M Mask(int64_t n) { return n >= 16 ? 0xFFFF : n <= 0 ? 0 : static_cast<M>((1u << n) - 1); }
  static F LoadM(const float* p, M m) { return _mm512_maskz_loadu_ps(m, p); }
  static void StoreM(float* p, F v, M m) { _mm512_mask_storeu_ps(p, m, v); }
  static F Add(F a, F b) { return _mm512_add_ps(a, b); }
  static F Sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F Mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F Div(F a, F b) { return _mm512_div_ps(a, b); }
  static F Max(F a, F b) { return _mm512_max_ps(a, b); }
  static F Fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static float ReduceAdd(F v) { return _mm512_reduce_add_ps(v); }
  static float ReduceMax(F v) { return _mm512_reduce_max_ps(v); }
  static F Exp(F x) {
    // exp(x) = 2^n * 2^f, n = round(x*log2e), |f| <= 1/2; 2^f = e^(f ln2) by its Taylor series to degree 7.
    x = _mm512_max_ps(x, _mm512_set1_ps(-150.0f));
    const F t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const F n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const F g = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));
    return _mm512_scalef_ps(ExpPoly(g), n);
  }
  static F ExpPoly(F g) {
    F p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.0f));
    return _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.0f));
  }
  static F Widen(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
  static F LoadBf16(const uint16_t* p) { return Widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static F LoadBf16M(const uint16_t* p, M m) { return Widen(_mm256_maskz_loadu_epi16(m, p)); }
  static __m256i ToBf16(F v) {
#if MESHSERVE_BF16_PAIRS
    return (__m256i)_mm512_cvtneps_pbh(v);
#else  // round to nearest even; NaN stays a quiet NaN
    const __m512i b = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(r);
#endif
  }
  static void StoreBf16M(uint16_t* p, F v, M m) { _mm256_mask_storeu_epi16(p, m, ToBf16(v)); }
  static F LoadI8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static F LoadI8M(const int8_t* p, M m) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
  }
  static void I8Quads(const int8_t* p, F (&q)[4]) {  // byte j of each 32-bit lane, sign-extended
    const __m512i v = _mm512_loadu_si512(p);
    q[0] = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 24), 24));
    q[1] = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 16), 24));
    q[2] = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 8), 24));
    q[3] = _mm512_cvtepi32_ps(_mm512_srai_epi32(v, 24));
  }

#if MESHSERVE_BF16_PAIRS
  static constexpr bool kNativePairs = true;
  using PairX = uint16_t;
  using XPair = __m512bh;
  using WPair = __m512bh;
  static XPair PairSet1(const uint16_t* x) {
    int32_t v;
    std::memcpy(&v, x, 4);
    return (__m512bh)_mm512_set1_epi32(v);
  }
  static WPair PairLoad(const uint16_t* w) { return (__m512bh)_mm512_loadu_si512(w); }
  static F PairDot(F acc, XPair x, WPair w) { return _mm512_dpbf16_ps(acc, x, w); }
  static void I8ToBf16(const int8_t* p, uint16_t* d) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    const __m512 hi =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
    _mm512_storeu_si512(d, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
  static XPair QuadSet1(const uint16_t* x) {
    int64_t v;
    std::memcpy(&v, x, 8);
    return (__m512bh)_mm512_set1_epi64(v);
  }
  static F AddPairs(F a, F b) {
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    return _mm512_add_ps(_mm512_permutex2var_ps(a, even, b), _mm512_permutex2var_ps(a, odd, b));
  }
  // Rows k (r0) and k+1 (r1; null: zeros) of kLanes columns of a row-major weight, into the pair layout.
  static WPair PairRows(const uint16_t* r0, const uint16_t* r1, M m) {
    const __m256i a = _mm256_maskz_loadu_epi16(m, r0);
    const __m256i b = r1 ? _mm256_maskz_loadu_epi16(m, r1) : _mm256_setzero_si256();
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                         6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return (__m512bh)_mm512_permutexvar_epi16(idx, _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1));
  }
#endif
  // Rows k and k+1 of kLanes columns in the pair layout, widened to float32 (also where the CPU has a pair dot
  // product: lora.h's stacks in pairs keep x in float32).
  static void SplitPairs(const uint16_t* w, F* even, F* odd) {
    const __m512i v = _mm512_loadu_si512(w);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
};

#elif MESHSERVE_X86_AVX2
// ------------------------------------------------------------------------------------------------------------------
alignas(32) const int32_t kTailLanes[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};

struct VOps {
  using F = __m256;
  using M = int;  // lanes in use
  static constexpr int kLanes = 8;
  static constexpr int kAccRegs = 12;  // of 16
  static constexpr int kF32Rows = 3;
  static constexpr int kBf16Rows = 3;
  static constexpr int kBf16SubCols = 4;  // half a panel: 12 accumulators for 3 rows
  static constexpr int64_t kWidenPanelMinRows = 24;
  static constexpr int kScreenStreams = 2;
  static constexpr int kI8Rows = 3;
  // Measured on the AMD EPYC: float32 panels as fast as 3-row tiles at 4 rows, 0.7x their time at 8.
  static constexpr int64_t kI8PanelMinRows = INT64_MAX, kI8F32PanelMinRows = 6;

  static F Zero() { return _mm256_setzero_ps(); }
  static F Set1(float a) { return _mm256_set1_ps(a); }
  static F Load(const float* p) { return _mm256_loadu_ps(p); }
  static void Store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static M Mask(int64_t n) { return n >= 8 ? 8 : n <= 0 ? 0 : static_cast<int>(n); }
  static __m256i LaneMask(M n) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kTailLanes + 8 - n)); }
  static F LoadM(const float* p, M n) { return n == 8 ? Load(p) : _mm256_maskload_ps(p, LaneMask(n)); }
  static void StoreM(float* p, F v, M n) {
    if (n == 8)
      Store(p, v);
    else
      _mm256_maskstore_ps(p, LaneMask(n), v);
  }
  static F Add(F a, F b) { return _mm256_add_ps(a, b); }
  static F Sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F Mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F Div(F a, F b) { return _mm256_div_ps(a, b); }
  static F Max(F a, F b) { return _mm256_max_ps(a, b); }
  static F Fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static float ReduceAdd(F v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static float ReduceMax(F v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static F Exp(F x) {
    // As the AVX-512 path: x clamped where 2^n stays a normal float (e^-87 ~ 1.6e-38; softmax never needs less).
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const F t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
    const F n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const F g = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.693147180559945309f));
    F p = _mm256_set1_ps(1.0f / 5040);
    p = _mm256_fmadd_ps(p, g, _mm256_set1_ps(1.0f / 720));
    p = _mm256_fmadd_ps(p, g, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, g, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, g, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, g, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, g, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, g, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  }
  static F Widen(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
  static F LoadBf16(const uint16_t* p) { return Widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static F LoadBf16M(const uint16_t* p, M n) {
    if (n == 8) return LoadBf16(p);
    alignas(16) uint16_t b[8] = {};
    std::memcpy(b, p, n * sizeof(uint16_t));
    return Widen(_mm_load_si128(reinterpret_cast<const __m128i*>(b)));
  }
  static __m128i ToBf16(F v) {  // round to nearest even; NaN stays a quiet NaN
    const __m256i b = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(0x40)), nan);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  }
  static void StoreBf16M(uint16_t* p, F v, M n) {
    const __m128i h = ToBf16(v);
    if (n == 8) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
    } else {
      alignas(16) uint16_t b[8];
      _mm_store_si128(reinterpret_cast<__m128i*>(b), h);
      std::memcpy(p, b, n * sizeof(uint16_t));
    }
  }
  static F LoadI8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static F LoadI8M(const int8_t* p, M n) {
    if (n == 8) return LoadI8(p);
    alignas(8) int8_t b[8] = {};
    std::memcpy(b, p, n);
    return LoadI8(b);
  }
  static void I8Quads(const int8_t* p, F (&q)[4]) {  // byte j of each 32-bit lane, sign-extended
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    q[0] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 24), 24));
    q[1] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 16), 24));
    q[2] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 8), 24));
    q[3] = _mm256_cvtepi32_ps(_mm256_srai_epi32(v, 24));
  }

  static void SplitPairs(const uint16_t* w, F* even, F* odd) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    *even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    *odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
};

#elif MESHSERVE_NEON
// ------------------------------------------------------------------------------------------------------------------
struct VOps {
  using F = float32x4_t;
  using M = int;
  static constexpr int kLanes = 4;
  static constexpr int kAccRegs = 24;  // of 32
  static constexpr int kF32Rows = 3;
  static constexpr int kBf16Rows = 4;
  static constexpr int kBf16SubCols = 4;  // a quarter panel: 16 accumulators for 4 rows
  static constexpr int64_t kWidenPanelMinRows = 24;
  static constexpr int kScreenStreams = 4;
  static constexpr int kI8Rows = 4;
  // Not measured on an aarch64 CPU: as the x86-64 paths (pair panels as AVX-512 BF16; float32 as AVX2, whose tiles
  // are as narrow).
  static constexpr int64_t kI8PanelMinRows = 12, kI8F32PanelMinRows = 6;

  static F Zero() { return vdupq_n_f32(0.0f); }
  static F Set1(float a) { return vdupq_n_f32(a); }
  static F Load(const float* p) { return vld1q_f32(p); }
  static void Store(float* p, F v) { vst1q_f32(p, v); }
  static M Mask(int64_t n) { return n >= 4 ? 4 : n <= 0 ? 0 : static_cast<int>(n); }
  static F LoadM(const float* p, M n) {
    if (n == 4) return Load(p);
    float b[4] = {};
    std::memcpy(b, p, n * sizeof(float));
    return vld1q_f32(b);
  }
  static void StoreM(float* p, F v, M n) {
    if (n == 4) return Store(p, v);
    float b[4];
    vst1q_f32(b, v);
    std::memcpy(p, b, n * sizeof(float));
  }
  static F Add(F a, F b) { return vaddq_f32(a, b); }
  static F Sub(F a, F b) { return vsubq_f32(a, b); }
  static F Mul(F a, F b) { return vmulq_f32(a, b); }
  static F Div(F a, F b) { return vdivq_f32(a, b); }
  static F Max(F a, F b) { return vmaxq_f32(a, b); }
  static F Fma(F a, F b, F c) { return vfmaq_f32(c, a, b); }
  static float ReduceAdd(F v) { return vaddvq_f32(v); }
  static float ReduceMax(F v) { return vmaxvq_f32(v); }
  static F Exp(F x) {
    x = vminq_f32(vmaxq_f32(x, vdupq_n_f32(-87.0f)), vdupq_n_f32(88.0f));
    const F t = vmulq_f32(x, vdupq_n_f32(1.44269504088896341f));
    const F n = vrndnq_f32(t);
    const F g = vmulq_f32(vsubq_f32(t, n), vdupq_n_f32(0.693147180559945309f));
    F p = vdupq_n_f32(1.0f / 5040);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 720), p, g);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 120), p, g);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 24), p, g);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 6), p, g);
    p = vfmaq_f32(vdupq_n_f32(0.5f), p, g);
    p = vfmaq_f32(vdupq_n_f32(1.0f), p, g);
    p = vfmaq_f32(vdupq_n_f32(1.0f), p, g);
    const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
    return vmulq_f32(p, vreinterpretq_f32_s32(e));
  }
  static F LoadBf16(const uint16_t* p) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16)); }
  static F LoadBf16M(const uint16_t* p, M n) {
    if (n == 4) return LoadBf16(p);
    uint16_t b[4] = {};
    std::memcpy(b, p, n * sizeof(uint16_t));
    return LoadBf16(b);
  }
  static uint16x4_t ToBf16(F v) {  // round to nearest even; NaN stays a quiet NaN
    const uint32x4_t b = vreinterpretq_u32_f32(v);
    const uint32x4_t lsb = vandq_u32(vshrq_n_u32(b, 16), vdupq_n_u32(1));
    uint32x4_t r = vshrq_n_u32(vaddq_u32(b, vaddq_u32(lsb, vdupq_n_u32(0x7FFF))), 16);
    const uint32x4_t ok = vceqq_f32(v, v);
    r = vbslq_u32(ok, r, vorrq_u32(vshrq_n_u32(b, 16), vdupq_n_u32(0x40)));
    return vmovn_u32(r);
  }
  static void StoreBf16M(uint16_t* p, F v, M n) {
    if (n == 4) return vst1_u16(p, ToBf16(v));
    uint16_t b[4];
    vst1_u16(b, ToBf16(v));
    std::memcpy(p, b, n * sizeof(uint16_t));
  }
  static F LoadI8(const int8_t* p) {
    int32_t word;
    std::memcpy(&word, p, 4);
    const int8x8_t b = vreinterpret_s8_s32(vdup_n_s32(word));
    return vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(b))));
  }
  static F LoadI8M(const int8_t* p, M n) {
    if (n == 4) return LoadI8(p);
    int8_t b[4] = {};
    std::memcpy(b, p, n);
    return LoadI8(b);
  }
  static void I8Quads(const int8_t* p, F (&q)[4]) {  // byte j of each 32-bit lane, sign-extended
    const int32x4_t v = vreinterpretq_s32_s8(vld1q_s8(p));
    q[0] = vcvtq_f32_s32(vshrq_n_s32(vshlq_n_s32(v, 24), 24));
    q[1] = vcvtq_f32_s32(vshrq_n_s32(vshlq_n_s32(v, 16), 24));
    q[2] = vcvtq_f32_s32(vshrq_n_s32(vshlq_n_s32(v, 8), 24));
    q[3] = vcvtq_f32_s32(vshrq_n_s32(v, 24));
  }

#if MESHSERVE_BF16_PAIRS
  static constexpr bool kNativePairs = true;
  using PairX = uint16_t;
  using XPair = bfloat16x8_t;
  using WPair = bfloat16x8_t;
  static XPair PairSet1(const uint16_t* x) {
    uint32_t v;
    std::memcpy(&v, x, 4);
    return vreinterpretq_bf16_u32(vdupq_n_u32(v));
  }
  static WPair PairLoad(const uint16_t* w) { return vreinterpretq_bf16_u16(vld1q_u16(w)); }
  static F PairDot(F acc, XPair x, WPair w) { return vbfdotq_f32(acc, x, w); }
  static void I8ToBf16(const int8_t* p, uint16_t* d) {  // the high half of each float32
    const int16x8_t v = vmovl_s8(vld1_s8(p));
    auto bf16 = [](int16x4_t h) { return vshrn_n_u32(vreinterpretq_u32_f32(vcvtq_f32_s32(vmovl_s16(h))), 16); };
    vst1q_u16(d, vcombine_u16(bf16(vget_low_s16(v)), bf16(vget_high_s16(v))));
  }
  static XPair QuadSet1(const uint16_t* x) {
    uint64_t v;
    std::memcpy(&v, x, 8);
    return vreinterpretq_bf16_u64(vdupq_n_u64(v));
  }
  static F AddPairs(F a, F b) { return vpaddq_f32(a, b); }
  // Rows k (r0) and k+1 (r1; null: zeros) of kLanes columns of a row-major weight, into the pair layout; columns
  // past the first n are zero.
  static WPair PairRows(const uint16_t* r0, const uint16_t* r1, M n) {
    const uint16x4x2_t z = vzip_u16(LoadU16(r0, n), r1 ? LoadU16(r1, n) : vdup_n_u16(0));
    return vreinterpretq_bf16_u16(vcombine_u16(z.val[0], z.val[1]));
  }
  static uint16x4_t LoadU16(const uint16_t* p, M n) {
    if (n == 4) return vld1_u16(p);
    uint16_t b[4] = {};
    std::memcpy(b, p, n * sizeof(uint16_t));
    return vld1_u16(b);
  }
#endif
  // Rows k and k+1 of kLanes columns in the pair layout, widened to float32 (also where the CPU has a pair dot
  // product: lora.h's stacks in pairs keep x in float32).
  static void SplitPairs(const uint16_t* w, F* even, F* odd) {
    const uint32x4_t v = vreinterpretq_u32_u16(vld1q_u16(w));
    *even = vreinterpretq_f32_u32(vshlq_n_u32(v, 16));
    *odd = vreinterpretq_f32_u32(vandq_u32(v, vdupq_n_u32(0xFFFF0000u)));
  }
};

#else
// ------------------------------------------------------------------------------------------------------------------
// Portable C++: four-lane vectors of the compiler's vector extension (SSE2 on x86-64, Advanced SIMD on aarch64).
struct VOps {
  typedef float F __attribute__((vector_size(16)));
  typedef int32_t I __attribute__((vector_size(16)));
  typedef uint32_t U __attribute__((vector_size(16)));
  using M = int;
  static constexpr int kLanes = 4;
  static constexpr int kAccRegs = 8;
  static constexpr int kF32Rows = 1;
  static constexpr int kBf16Rows = 2;
  static constexpr int kBf16SubCols = 4;
  static constexpr int64_t kWidenPanelMinRows = 24;
  static constexpr int kScreenStreams = 2;
  static constexpr int kI8Rows = 2;
  static constexpr int64_t kI8PanelMinRows = INT64_MAX, kI8F32PanelMinRows = INT64_MAX;  // (1-row float32 tiles)

  static F Zero() { return F{0, 0, 0, 0}; }
  static F Set1(float a) { return F{a, a, a, a}; }
  static F Load(const float* p) {
    F v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
  static void Store(float* p, F v) { std::memcpy(p, &v, sizeof v); }
  static M Mask(int64_t n) { return n >= 4 ? 4 : n <= 0 ? 0 : static_cast<int>(n); }
  static F LoadM(const float* p, M n) {
    F v = Zero();
    std::memcpy(&v, p, n * sizeof(float));
    return v;
  }
  static void StoreM(float* p, F v, M n) { std::memcpy(p, &v, n * sizeof(float)); }
  static F Add(F a, F b) { return a + b; }
  static F Sub(F a, F b) { return a - b; }
  static F Mul(F a, F b) { return a * b; }
  static F Div(F a, F b) { return a / b; }
  static F Max(F a, F b) {
    F r;
    for (int i = 0; i < 4; ++i) r[i] = a[i] > b[i] ? a[i] : b[i];
    return r;
  }
  static F Fma(F a, F b, F c) { return a * b + c; }
  static float ReduceAdd(F v) { return (v[0] + v[2]) + (v[1] + v[3]); }
  static float ReduceMax(F v) {
    float m = v[0];
    for (int i = 1; i < 4; ++i) m = v[i] > m ? v[i] : m;
    return m;
  }
  static F Exp(F x) {
    F p, n;
    I e;
    for (int i = 0; i < 4; ++i) {
      const float xi = x[i] < -87.0f ? -87.0f : x[i] > 88.0f ? 88.0f : x[i];
      const float t = xi * 1.44269504088896341f;
      n[i] = (t + 12582912.0f) - 12582912.0f;  // round to nearest (|t| < 2^22)
      e[i] = (static_cast<int32_t>(n[i]) + 127) << 23;
      p[i] = (t - n[i]) * 0.693147180559945309f;
    }
    const F g = p;
    p = Set1(1.0f / 5040);
    p = p * g + 1.0f / 720;
    p = p * g + 1.0f / 120;
    p = p * g + 1.0f / 24;
    p = p * g + 1.0f / 6;
    p = p * g + 0.5f;
    p = p * g + 1.0f;
    p = p * g + 1.0f;
    F scale;
    std::memcpy(&scale, &e, sizeof scale);
    return p * scale;
  }
  static F Widen(const uint16_t* p, int n) {
    U u = {0, 0, 0, 0};
    for (int i = 0; i < n; ++i) u[i] = static_cast<uint32_t>(p[i]) << 16;
    F v;
    std::memcpy(&v, &u, sizeof v);
    return v;
  }
  static F LoadBf16(const uint16_t* p) { return Widen(p, 4); }
  static F LoadBf16M(const uint16_t* p, M n) { return Widen(p, n); }
  static void StoreBf16M(uint16_t* p, F v, M n) {
    for (int i = 0; i < n; ++i) {
      uint32_t b;
      const float f = v[i];
      std::memcpy(&b, &f, 4);
      p[i] = f != f ? static_cast<uint16_t>((b >> 16) | 0x40) : static_cast<uint16_t>((b + 0x7FFF + ((b >> 16) & 1)) >> 16);
    }
  }
  static F LoadI8(const int8_t* p) { return F{float(p[0]), float(p[1]), float(p[2]), float(p[3])}; }
  static F LoadI8M(const int8_t* p, M n) {
    F v = Zero();
    for (int i = 0; i < n; ++i) v[i] = p[i];
    return v;
  }
  static void I8Quads(const int8_t* p, F (&q)[4]) {
    for (int j = 0; j < 4; ++j) q[j] = F{float(p[j]), float(p[4 + j]), float(p[8 + j]), float(p[12 + j])};
  }

  static void SplitPairs(const uint16_t* w, F* even, F* odd) {
    U u;
    std::memcpy(&u, w, sizeof u);
    const U e = u << 16, o = u & 0xFFFF0000u;
    std::memcpy(even, &e, sizeof e);
    std::memcpy(odd, &o, sizeof o);
  }
};
#endif

#if MESHSERVE_BF16_PAIRS
using V = VOps;
#else
// bfloat16 pairs where the CPU has no bfloat16 dot product: SplitPairs widens rows k and k+1 of kLanes columns to
// float32 in registers, and a pair dot product is two FMAs (x then comes as float32).
template <typename Ops>
struct WidenedPairs : Ops {
  using F = typename Ops::F;
  static constexpr bool kNativePairs = false;
  using PairX = float;
  struct XPair {
    F even, odd;
  };
  struct WPair {
    F even, odd;
  };
  static XPair PairSet1(const float* x) { return {Ops::Set1(x[0]), Ops::Set1(x[1])}; }
  static WPair PairLoad(const uint16_t* w) {
    WPair p;
    Ops::SplitPairs(w, &p.even, &p.odd);
    return p;
  }
  static F PairDot(F acc, XPair x, WPair w) { return Ops::Fma(x.odd, w.odd, Ops::Fma(x.even, w.even, acc)); }
};
using V = WidenedPairs<VOps>;
#endif

// Shared by every path, written in V.
inline void StoreF32(float* p, V::F v, V::M m) { V::StoreM(p, v, m); }
inline void StoreF32(uint16_t* p, V::F v, V::M m) { V::StoreBf16M(p, v, m); }

// float32 <- float32 or bfloat16, n elements.
inline void ToF32(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void ToF32(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + V::kLanes <= n; i += V::kLanes) V::Store(dst + i, V::LoadBf16(src + i));
  if (i < n) V::StoreM(dst + i, V::LoadBf16M(src + i, V::Mask(n - i)), V::Mask(n - i));
}

// float32 -> float32 or bfloat16 (rounded to nearest even), n elements.
template <typename Out>
inline void StoreRow(const float* src, Out* dst, int64_t n) {
  int64_t i = 0;
  for (; i + V::kLanes <= n; i += V::kLanes) StoreF32(dst + i, V::Load(src + i), V::Mask(V::kLanes));
  if (i < n) StoreF32(dst + i, V::LoadM(src + i, V::Mask(n - i)), V::Mask(n - i));
}
