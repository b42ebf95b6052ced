// Paged attention over a multi-head latent attention cache (pallas_kernels/mla.py `latent_attention_reference`):
// one row of D values per token (DeepSeek's compressed latent and its RoPE key) that every query head reads, its key
// the whole row and its value the first Dv values. A unit of work is one sequence's block of query tokens against a
// block of heads; its rows (tokens x heads) share each chunk of kKeys latent rows, read (and widened, a quantized
// cache's scaled) once for all of them: the absorbed form's point, one latent read per token serving every head.
// Uses attention.h's row widening and chunk size; memory per unit is O(rows x D).
constexpr int64_t kLatentRows = 64;  // rows (tokens x heads) per unit: at most this many heads, then tokens

struct LatentUnit {
  int32_t seq, t0, nt, h0, nh;
};

template <typename QT, typename KT>
void AttendLatentUnit(const LatentShape& a, const LatentUnit& u, const QT* q, const KT* cache, const float* scales,
                      const int32_t* kv_lens, const int32_t* pages, const int32_t* cu, QT* out) {
  constexpr int L = V::kLanes, kVecs = kKeys / L;
  const int64_t d = a.d, dv = a.dv, nh = u.nh, rows = u.nt * nh;
  thread_local Scratch scratch;
  float* qs = scratch.Get<float>(static_cast<size_t>(rows * d + rows * dv + 2 * kKeys * d + kKeys + 2 * rows));
  float* acc = qs + rows * d;   // [rows, dv]
  float* kc = acc + rows * dv;  // [kKeys, d]: the chunk's rows (keys; their first dv values the values)
  float* kt = kc + kKeys * d;   // [d, kKeys]
  float* sc = kt + kKeys * d;   // [kKeys]
  float* m = sc + kKeys;        // [rows]
  float* l = m + rows;          // [rows]
  for (int64_t r = 0; r < rows; ++r) {
    ToF32(q + ((u.t0 + r / nh) * a.h + u.h0 + r % nh) * d, qs + r * d, d);
    m[r] = -1e30f;
    l[r] = 0.0f;
  }
  std::memset(acc, 0, rows * dv * sizeof(float));
  const int64_t kv_len = kv_lens[u.seq];
  const int64_t first_pos = kv_len - (cu[u.seq + 1] - cu[u.seq]) + (u.t0 - cu[u.seq]);
  const int64_t hi = Min<int64_t>(first_pos + u.nt, kv_len);
  const int32_t* seq_pages = pages + u.seq * a.max_pages;
  const bool transposed = rows >= 8;  // as attention.h: scores by broadcast-FMAs against the chunk transposed
  for (int64_t j0 = 0; j0 < hi; j0 += kKeys) {
    const int n = static_cast<int>(Min<int64_t>(kKeys, hi - j0));
    for (int c = 0; c < n; ++c) {
      const int64_t pos = j0 + c;
      const int64_t row = static_cast<int64_t>(seq_pages[pos / a.page_size]) * a.page_size + pos % a.page_size;
      KvRowToF32(cache + row * d, kQuantizedKv<KT> ? scales[row] : 0.0f, kc + c * d, d);
    }
    if (n < kKeys) std::memset(kc + n * d, 0, (kKeys - n) * d * sizeof(float));
    if (transposed)
      for (int c = 0; c < kKeys; ++c)
        for (int64_t e = 0; e < d; ++e) kt[e * kKeys + c] = kc[c * d + e];
    for (int64_t r = 0; r < rows; ++r) {
      const int last = static_cast<int>(Min<int64_t>(n - 1, first_pos + r / nh - j0));  // causal, in the chunk
      if (last < 0) continue;
      const int nv = last / L + 1;
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
        for (int c = 0; c <= last; ++c) {
          V::F t = V::Mul(V::Load(qr), V::Load(kc + c * d));
          for (int64_t w = L; w < d; w += L) t = V::Fma(V::Load(qr + w), V::Load(kc + c * d + w), t);
          sc[c] = V::ReduceAdd(t);
        }
        for (int v = 0; v < nv; ++v) s[v] = V::Load(sc + L * v);
      }
      const V::F scale = V::Set1(a.sm_scale);
      for (int v = 0; v < nv; ++v) s[v] = V::Mul(s[v], scale);
      const bool partial = last < nv * L - 1;  // keys past `last` in the last vector: out of the max, weighed 0
      if (partial) {
        for (int v = 0; v < nv; ++v) V::Store(sc + L * v, s[v]);
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
        for (int c = last + 1; c < nv * L; ++c) sc[c] = 0.0f;
        for (int v = 0; v < nv; ++v) s[v] = V::Load(sc + L * v);
      }
      for (int v = 0; v < nv; ++v) sum = V::Add(sum, s[v]);
      const float alpha = std::exp(m[r] - m_new);
      l[r] = alpha * l[r] + V::ReduceAdd(sum);
      m[r] = m_new;
      float* ar = acc + r * dv;
      const V::F av = V::Set1(alpha);
      for (int64_t w = 0; w < dv; w += L) {
        V::F o = V::Mul(V::Load(ar + w), av);
        for (int c = 0; c <= last; ++c) o = V::Fma(V::Set1(sc[c]), V::Load(kc + c * d + w), o);
        V::Store(ar + w, o);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = l[r] > 0 ? 1.0f / l[r] : 0.0f;
    float* ar = acc + r * dv;
    for (int64_t e = 0; e < dv; ++e) ar[e] *= inv;
    StoreRow<QT>(ar, out + ((u.t0 + r / nh) * a.h + u.h0 + r % nh) * dv, dv);
  }
}

template <typename QT, typename KT>
void LatentAttention(const Runner& run, const LatentShape& a, int64_t t, const QT* q, const void* cache,
                     const float* scales, const int32_t* kv_lens, const int32_t* pages, const int32_t* cu,
                     int64_t num_seqs, void* out) {
  const int64_t nh = Min<int64_t>(a.h, kLatentRows), head_blocks = (a.h + nh - 1) / nh;
  const int64_t block = Max<int64_t>(1, kLatentRows / nh);  // query tokens per unit
  int64_t count = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t start = cu[s], end = Min<int64_t>(cu[s + 1], t);
    if (end > start) count += (end - start + block - 1) / block * head_blocks;
  }
  Zeros<LatentUnit> units(static_cast<size_t>(count));
  int64_t i = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int32_t start = cu[s], end = static_cast<int32_t>(Min<int64_t>(cu[s + 1], t));
    for (int32_t t0 = start; t0 < end; t0 += static_cast<int32_t>(block))
      for (int64_t h0 = 0; h0 < a.h; h0 += nh)
        units.get()[i++] = {static_cast<int32_t>(s), t0, static_cast<int32_t>(Min<int64_t>(block, end - t0)),
                            static_cast<int32_t>(h0), static_cast<int32_t>(Min<int64_t>(nh, a.h - h0))};
  }
  // Rows of padding tokens are zero.
  const int64_t used = num_seqs > 0 ? Min<int64_t>(Max<int64_t>(cu[num_seqs], 0), t) : 0;
  QT* o = static_cast<QT*>(out);
  std::memset(o + used * a.h * a.dv, 0, (t - used) * a.h * a.dv * sizeof(QT));
  const KT* rows = static_cast<const KT*>(cache);
  ParallelFor(run, count, [&](int64_t k) {
    AttendLatentUnit<QT, KT>(a, units.get()[k], q, rows, scales, kv_lens, pages, cu, o);
  });
}

template <typename QT>
void LatentAttentionOf(const Runner& run, KvFormat kv_format, const LatentShape& a, int64_t t, const void* q,
                       const void* cache, const float* scales, const int32_t* kv_lens, const int32_t* pages,
                       const int32_t* cu, int64_t num_seqs, void* out) {
  const QT* qt = static_cast<const QT*>(q);
  if (kv_format == KvFormat::kInt8)
    return LatentAttention<QT, int8_t>(run, a, t, qt, cache, scales, kv_lens, pages, cu, num_seqs, out);
  if (kv_format == KvFormat::kE4m3)
    return LatentAttention<QT, E4m3>(run, a, t, qt, cache, scales, kv_lens, pages, cu, num_seqs, out);
  LatentAttention<QT, QT>(run, a, t, qt, cache, nullptr, kv_lens, pages, cu, num_seqs, out);
}

void LatentAttentionEntry(const Runner& run, Dt dt, KvFormat kv_format, const LatentShape& a, int64_t t,
                          const void* q, const void* cache, const float* scales, const int32_t* kv_lens,
                          const int32_t* pages, const int32_t* cu, int64_t num_seqs, void* out) {
  if (dt == Dt::kF32)
    return LatentAttentionOf<float>(run, kv_format, a, t, q, cache, scales, kv_lens, pages, cu, num_seqs, out);
  LatentAttentionOf<uint16_t>(run, kv_format, a, t, q, cache, scales, kv_lens, pages, cu, num_seqs, out);
}
