// Ragged paged attention (same contract as pallas_kernels/reference.py), written in V. A unit of work is one
// sequence's block of up to kQueryBlock query tokens against one KV head: rows = tokens x the q heads sharing that
// KV head. Keys stream in chunks of kKeys through an online softmax; memory per unit is O(rows x head_dim). A
// quantized cache (int8, float8_e4m3) is widened and scaled row by row as its keys and values enter the chunk.
constexpr int64_t kQueryBlock = 64;
constexpr int kKeys = 64;

// A float8_e4m3fn element (its bits), as a quantized KV cache stores it.
struct E4m3 {
  uint8_t bits;
};

template <typename KT>
constexpr bool kQuantizedKv = std::is_same_v<KT, int8_t> || std::is_same_v<KT, E4m3>;

// A cache row of n elements (n % 16 == 0) as float32: float32 and bfloat16 as they are, quantized values times the
// row's scale.
inline void KvRowToF32(const float* src, float, float* dst, int64_t n) { ToF32(src, dst, n); }
inline void KvRowToF32(const uint16_t* src, float, float* dst, int64_t n) { ToF32(src, dst, n); }
inline void KvRowToF32(const int8_t* src, float scale, float* dst, int64_t n) {
  const V::F s = V::Set1(scale);
  for (int64_t i = 0; i < n; i += V::kLanes) V::Store(dst + i, V::Mul(V::LoadI8(src + i), s));
}
// float8_e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal (m * 2^-9). A normal
// magnitude's 7 bits shifted into float32's exponent and mantissa fields and rebiased (+120) are its float32 bits.
// The NaN encodings (0x7F, 0xFF) are never written (quantisation saturates at 448). Plain C++ the compiler vectorises
// for each instruction set: both cases computed, picked by a bit mask (a conditional would keep it scalar).
inline void KvRowToF32(const E4m3* src, float scale, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const int32_t b = src[i].bits, mag = b & 0x7F;
    const float subnormal = static_cast<float>(mag) * 0x1p-9f;
    int32_t subnormal_bits;
    std::memcpy(&subnormal_bits, &subnormal, sizeof subnormal_bits);
    const int32_t normal = -static_cast<int32_t>(mag >= 8);  // all ones where normal
    const int32_t bits = ((((mag << 20) + (120 << 23)) & normal) | (subnormal_bits & ~normal)) | ((b & 0x80) << 24);
    float v;
    std::memcpy(&v, &bits, sizeof v);
    dst[i] = v * scale;
  }
}

struct Unit {
  int32_t seq, head, t0, nt;
};

template <typename QT, typename KT>
void AttendUnit(const AttnShape& a, const Unit& u, const QT* q, const KT* kv, const float* scales,
                const int32_t* kv_lens, const int32_t* pages, const int32_t* cu, QT* out) {
  constexpr int L = V::kLanes, kVecs = kKeys / L;
  const int64_t g = a.hq / a.hkv, d = a.d, dv = d / L, rows = u.nt * g;
  thread_local Scratch scratch;
  float* qs = scratch.Get<float>(static_cast<size_t>(2 * rows * d + 2 * rows + 3 * kKeys * d + kKeys));
  float* acc = qs + rows * d;  // [rows, d]
  float* kc = acc + rows * d;  // [kKeys, d]
  float* vc = kc + kKeys * d;  // [kKeys, d]
  float* kt = vc + kKeys * d;  // [d, kKeys]
  float* sc = kt + kKeys * d;  // [kKeys] one row's scores, then weights (64-byte aligned: d % 16 == 0)
  float* m = sc + kKeys;       // [rows]
  float* l = m + rows;         // [rows]
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t tok = u.t0 + r / g, head = u.head * g + r % g;
    ToF32(q + (tok * a.hq + head) * d, qs + r * d, d);
    m[r] = -1e30f;
    l[r] = 0.0f;
  }
  std::memset(acc, 0, rows * d * sizeof(float));
  const int64_t kv_len = kv_lens[u.seq];
  const int64_t q_len = cu[u.seq + 1] - cu[u.seq];
  const int64_t first_pos = kv_len - q_len + (u.t0 - cu[u.seq]);
  const int64_t hi = Min<int64_t>(first_pos + u.nt, kv_len);
  const int64_t lo = a.window > 0 ? Max<int64_t>(first_pos - a.window + 1, 0) : 0;
  const int32_t* seq_pages = pages + u.seq * a.max_pages;
  const int64_t h2 = 2 * a.hkv;
  // Many rows share each key chunk (prefill): scores as broadcast-FMAs against K transposed. Few (decode):
  // one dot product per key.
  const bool transposed = rows >= 8;
  for (int64_t j0 = lo; j0 < hi; j0 += kKeys) {
    const int n = static_cast<int>(Min<int64_t>(kKeys, hi - j0));
    for (int c = 0; c < n; ++c) {
      const int64_t pos = j0 + c;
      const int64_t row =  // of this key's K; its V is the next row
          (static_cast<int64_t>(seq_pages[pos / a.page_size]) * a.page_size + pos % a.page_size) * h2 + 2 * u.head;
      const float k_scale = kQuantizedKv<KT> ? scales[row] : 0.0f;
      const float v_scale = kQuantizedKv<KT> ? scales[row + 1] : 0.0f;
      KvRowToF32(kv + row * d, k_scale, kc + c * d, d);
      KvRowToF32(kv + (row + 1) * d, v_scale, vc + c * d, d);
    }
    if (n < kKeys) std::memset(kc + n * d, 0, (kKeys - n) * d * sizeof(float));
    if (transposed)
      for (int c = 0; c < kKeys; ++c)
        for (int64_t e = 0; e < d; ++e) kt[e * kKeys + c] = kc[c * d + e];
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pos_r = first_pos + r / g;
      // Keys this row may see: first <= c <= last (causal, inside the chunk, inside the window).
      const int last = static_cast<int>(Min<int64_t>(n - 1, pos_r - j0));
      if (last < 0) continue;
      const int first = a.window > 0 ? static_cast<int>(Max<int64_t>(0, pos_r - a.window + 1 - j0)) : 0;
      if (first > last) continue;
      const int nv = last / L + 1;  // score vectors holding a visible key
      const float* qr = qs + r * d;
      V::F s[kVecs];
      if (transposed) {
        for (int v = 0; v < kVecs; ++v) s[v] = V::Zero();
        for (int64_t e = 0; e < d; ++e) {
          const V::F qe = V::Set1(qr[e]);
          for (int v = 0; v < kVecs; ++v)
            if (v < nv) s[v] = V::Fma(qe, V::Load(kt + e * kKeys + L * v), s[v]);
        }
      } else {
        for (int c = first; c <= last; ++c) {
          V::F t = V::Mul(V::Load(qr), V::Load(kc + c * d));
          for (int64_t w = 1; w < dv; ++w) t = V::Fma(V::Load(qr + L * w), V::Load(kc + c * d + L * w), t);
          sc[c] = V::ReduceAdd(t);
        }
        for (int v = 0; v < nv; ++v) s[v] = V::Load(sc + L * v);
      }
      // Scaled (and soft-capped) scores; keys outside [first, last] (a chunk the causal edge or the window cuts)
      // out of the max and weighed zero, through the scores' copy in sc.
      const V::F scale = V::Set1(a.sm_scale);
      for (int v = 0; v < nv; ++v) s[v] = V::Mul(s[v], scale);
      const bool partial = first > 0 || last < nv * L - 1;
      if (a.soft_cap > 0 || partial) {
        for (int v = 0; v < nv; ++v) V::Store(sc + L * v, s[v]);
        if (a.soft_cap > 0)
          for (int c = first; c <= last; ++c) sc[c] = a.soft_cap * std::tanh(sc[c] / a.soft_cap);
        for (int c = 0; c < first; ++c) sc[c] = -INFINITY;
        for (int c = last + 1; c < nv * L; ++c) sc[c] = -INFINITY;
        for (int v = 0; v < nv; ++v) s[v] = V::Load(sc + L * v);
      }
      V::F mx = V::Set1(-1e30f);
      for (int v = 0; v < nv; ++v) mx = V::Max(mx, s[v]);
      const float m_new = Max(m[r], V::ReduceMax(mx));
      const V::F mv = V::Set1(m_new);
      V::F sum = V::Zero();
      for (int v = 0; v < nv; ++v) {
        s[v] = V::Exp(V::Sub(s[v], mv));
        V::Store(sc + L * v, s[v]);
      }
      if (partial) {
        for (int c = 0; c < first; ++c) sc[c] = 0.0f;
        for (int c = last + 1; c < nv * L; ++c) sc[c] = 0.0f;
        for (int v = 0; v < nv; ++v) s[v] = V::Load(sc + L * v);
      }
      for (int v = 0; v < nv; ++v) sum = V::Add(sum, s[v]);
      const float alpha = std::exp(m[r] - m_new);
      l[r] = alpha * l[r] + V::ReduceAdd(sum);
      m[r] = m_new;
      float* ar = acc + r * d;
      const V::F av = V::Set1(alpha);
      for (int64_t w = 0; w < dv; ++w) {
        V::F o = V::Mul(V::Load(ar + L * w), av);
        for (int c = first; c <= last; ++c) o = V::Fma(V::Set1(sc[c]), V::Load(vc + c * d + L * w), o);
        V::Store(ar + L * w, o);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t tok = u.t0 + r / g, head = u.head * g + r % g;
    // A sink joins the denominator only (no value): l counts weights relative to m. A row with no key (m still
    // -1e30) then gets exp(huge) = inf and stays zero, as without a sink.
    const float denom = a.sinks ? l[r] + std::exp(a.sinks[head] - m[r]) : l[r];
    const float inv = denom > 0 ? 1.0f / denom : 0.0f;
    float* ar = acc + r * d;
    for (int64_t e = 0; e < d; ++e) ar[e] *= inv;
    StoreRow<QT>(ar, out + (tok * a.hq + head) * d, d);
  }
}

template <typename QT, typename KT>
void RaggedPagedAttention(const Runner& run, const AttnShape& a, int64_t t, const QT* q, const void* kv,
                          const float* scales, const int32_t* kv_lens, const int32_t* pages, const int32_t* cu,
                          int64_t num_seqs, void* out) {
  int64_t count = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t start = cu[s], end = Min<int64_t>(cu[s + 1], t);
    if (end > start) count += (end - start + kQueryBlock - 1) / kQueryBlock * a.hkv;
  }
  Zeros<Unit> units(static_cast<size_t>(count));
  int64_t i = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int32_t start = cu[s], end = static_cast<int32_t>(Min<int64_t>(cu[s + 1], t));
    for (int32_t t0 = start; t0 < end; t0 += kQueryBlock)
      for (int64_t h = 0; h < a.hkv; ++h)
        units.get()[i++] = {static_cast<int32_t>(s), static_cast<int32_t>(h), t0,
                            static_cast<int32_t>(Min<int64_t>(kQueryBlock, end - t0))};
  }
  // Rows of padding tokens are zero.
  const int64_t used = num_seqs > 0 ? Min<int64_t>(Max<int64_t>(cu[num_seqs], 0), t) : 0;
  QT* o = static_cast<QT*>(out);
  std::memset(o + used * a.hq * a.d, 0, (t - used) * a.hq * a.d * sizeof(QT));
  const KT* cache = static_cast<const KT*>(kv);
  ParallelFor(run, count,
              [&](int64_t k) { AttendUnit<QT, KT>(a, units.get()[k], q, cache, scales, kv_lens, pages, cu, o); });
}

template <typename QT>
void AttentionOf(const Runner& run, KvFormat kv_format, const AttnShape& a, int64_t t, const void* q, const void* kv,
                 const float* scales, const int32_t* kv_lens, const int32_t* pages, const int32_t* cu,
                 int64_t num_seqs, void* out) {
  const QT* qt = static_cast<const QT*>(q);
  if (kv_format == KvFormat::kInt8)
    return RaggedPagedAttention<QT, int8_t>(run, a, t, qt, kv, scales, kv_lens, pages, cu, num_seqs, out);
  if (kv_format == KvFormat::kE4m3)
    return RaggedPagedAttention<QT, E4m3>(run, a, t, qt, kv, scales, kv_lens, pages, cu, num_seqs, out);
  RaggedPagedAttention<QT, QT>(run, a, t, qt, kv, nullptr, kv_lens, pages, cu, num_seqs, out);
}

void AttentionEntry(const Runner& run, Dt dt, KvFormat kv_format, const AttnShape& a, int64_t t, const void* q,
                    const void* kv, const float* kv_scales, const int32_t* kv_lens, const int32_t* pages,
                    const int32_t* cu, int64_t num_seqs, void* out) {
  if (dt == Dt::kF32)
    return AttentionOf<float>(run, kv_format, a, t, q, kv, kv_scales, kv_lens, pages, cu, num_seqs, out);
  AttentionOf<uint16_t>(run, kv_format, a, t, q, kv, kv_scales, kv_lens, pages, cu, num_seqs, out);
}
