// meshserve CPU kernels, called from XLA:CPU programs through the XLA FFI (see pallas_kernels/native.py). The
// handlers here check the operands and hand them to the kernels of the instruction set the program asked for (its
// `isa` attribute, chosen at trace time); built for the architecture's baseline, so any CPU can run them, and a
// program whose instruction set this CPU lacks gets an error, never an illegal instruction.
//
// packed matmul: out[M, N] = x[M, K] @ W for weights packed at load into column panels contiguous down K (what a
// single-device CPU engine runs for every step size). matmul: the same on a row-major w[K, N] for small M, for
// weights that are not packed. attention: the ragged paged attention of pallas_kernels/reference.py with an
// online softmax. greedy head: the argmax of the exact logits of a few rows from an int8 screen of the LM head plus
// a recheck of the rows its error bounds leave open. expert mlp: a mixture-of-experts layer's routed experts
// (gate|up, SwiGLU, down, weighted combine), each selected expert's weights read once (in x's dtype, or int8 with
// per-channel scales). int8 matmul: x @ w for int8 weights (packed or row-major) times float32 scales per column or
// per group of rows. latent attention: paged attention over a multi-head latent attention cache (one row per token
// read by every head). lora: a batch's LoRA update, tokens grouped by adapter slot. Work is split between the XLA
// intra-op thread pool's threads and the calling thread.
#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <string>

#include "api.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace meshserve {
namespace {

void Schedule(void* pool, void (*task)(void*), void* arg) {
  static_cast<ffi::ThreadPool*>(pool)->Schedule([task, arg]() { task(arg); });
}

Runner RunnerFor(ffi::ThreadPool& pool) {
  return Runner{&pool, std::max<int64_t>(1, pool.num_threads()), Schedule};
}

// The kernels of `isa`, or why there are none.
ffi::Error Lookup(int32_t isa, const Kernels** k) {
  if (isa < 0 || isa >= kNumIsas) return ffi::Error::InvalidArgument("native kernels: unknown isa " + std::to_string(isa));
  *k = KernelsFor(isa);
  if (!*k)
    return ffi::Error::InvalidArgument(std::string("native kernels: this CPU or build cannot run the ") +
                                       IsaName(isa) + " path (MESHSERVE_CPU_ISA)");
  return ffi::Error::Success();
}

// bf16 x bf16 -> bf16 / f32, or f32 x f32 -> f32.
bool Dtypes(ffi::DataType x, ffi::DataType w, ffi::DataType o, Dt* in, Dt* out) {
  if (x == ffi::DataType::F32 && w == ffi::DataType::F32 && o == ffi::DataType::F32) {
    *in = *out = Dt::kF32;
    return true;
  }
  if (x == ffi::DataType::BF16 && w == ffi::DataType::BF16 && (o == ffi::DataType::BF16 || o == ffi::DataType::F32)) {
    *in = Dt::kBf16;
    *out = o == ffi::DataType::F32 ? Dt::kF32 : Dt::kBf16;
    return true;
  }
  return false;
}

ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> out,
                      int32_t isa) {
  const Kernels* kernels;
  if (ffi::Error e = Lookup(isa, &kernels); e.failure()) return e;
  auto wd = w.dimensions();
  if (wd.size() != 2) return ffi::Error::InvalidArgument("matmul: w must be 2-D [K, N]");
  int64_t K = wd[0], N = wd[1];
  auto xd = x.dimensions();
  if (xd.size() < 1 || xd.back() != K) return ffi::Error::InvalidArgument("matmul: x's last dimension must be K");
  int64_t M = K ? static_cast<int64_t>(x.element_count()) / K : 0;
  if (static_cast<int64_t>(out->element_count()) != M * N)
    return ffi::Error::InvalidArgument("matmul: output must hold M x N elements");
  Dt in, ot;
  if (!Dtypes(x.element_type(), w.element_type(), out->element_type(), &in, &ot))
    return ffi::Error::InvalidArgument("matmul: supported dtypes are f32 x f32 -> f32 and bf16 x bf16 -> bf16/f32");
  if (M == 0 || N == 0) return ffi::Error::Success();
  if (K == 0) {
    std::memset(out->untyped_data(), 0, out->size_bytes());
    return ffi::Error::Success();
  }
  kernels->matmul(RunnerFor(pool), in, ot, x.untyped_data(), M, K, w.untyped_data(), N, out->untyped_data());
  return ffi::Error::Success();
}

constexpr int64_t kF32Panel = 32, kBf16Panel = 64, kBf16KAlign = 32;

ffi::Error MatmulPackedImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                            ffi::Result<ffi::AnyBuffer> out, int32_t isa) {
  const Kernels* kernels;
  if (ffi::Error e = Lookup(isa, &kernels); e.failure()) return e;
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
  Dt in, ot;
  if (!Dtypes(x.element_type(), w.element_type(), out->element_type(), &in, &ot))
    return ffi::Error::InvalidArgument("packed matmul: supported are f32 x f32 -> f32 and bf16 x bf16 -> bf16/f32");
  if (in == Dt::kF32 ? kw != K : kw != (K + kBf16KAlign - 1) / kBf16KAlign * kBf16KAlign)
    return ffi::Error::InvalidArgument(in == Dt::kF32 ? "packed matmul: f32 w must hold K rows"
                                                      : "packed matmul: bf16 w must hold K rows padded to a multiple of 32");
  if (!M || !N) return ffi::Error::Success();
  if (!K) {
    std::memset(out->untyped_data(), 0, out->size_bytes());
    return ffi::Error::Success();
  }
  kernels->matmul_packed(RunnerFor(pool), in, ot, x.untyped_data(), M, K, w.untyped_data(), panels, kw,
                            out->untyped_data());
  return ffi::Error::Success();
}

constexpr int64_t kI8Panel = 64, kI8MaxDotGroup = 65536;

ffi::Error MatmulInt8Impl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S8> w, ffi::Buffer<ffi::F32> scale,
                          ffi::Result<ffi::AnyBuffer> out, int32_t isa, int32_t method) {
  const Kernels* kernels;
  if (ffi::Error e = Lookup(isa, &kernels); e.failure()) return e;
  auto xd = x.dimensions(), wd = w.dimensions(), sd = scale.dimensions();
  if (xd.size() < 1) return ffi::Error::InvalidArgument("int8 matmul: x must have a last dimension K");
  const int64_t K = xd.back(), kp = (K + 3) / 4 * 4;
  const bool packed = wd.size() == 4;
  if (packed ? wd[2] != kI8Panel || wd[3] != 4 || wd[1] * 4 != kp : wd.size() != 2 || wd[0] != K)
    return ffi::Error::InvalidArgument(
        "int8 matmul: w must be [K, N] or packed [N/64, Kp/4, 64, 4] (Kp: K rounded up to 4) for x's K");
  const int64_t N = packed ? wd[0] * kI8Panel : wd[1];
  const int64_t groups = sd.size() == 2 ? sd[0] : 1;
  if (sd.size() < 1 || sd.size() > 2 || sd.back() != N || groups < 1 || K % groups)
    return ffi::Error::InvalidArgument("int8 matmul: scale must be [N] or [G, N] with G dividing K");
  if (packed && groups > 1 && (K / groups) % 4)
    return ffi::Error::InvalidArgument("int8 matmul: packed w takes groups of a multiple of 4 rows");
  const int64_t M = K ? static_cast<int64_t>(x.element_count()) / K : 0;
  if (static_cast<int64_t>(out->element_count()) != M * N)
    return ffi::Error::InvalidArgument("int8 matmul: output must hold M x N elements");
  auto xt = x.element_type(), ot = out->element_type();
  const bool f32_or_bf16 = (xt == ffi::DataType::F32 || xt == ffi::DataType::BF16) &&
                           (ot == ffi::DataType::F32 || ot == ffi::DataType::BF16);
  if (!f32_or_bf16) return ffi::Error::InvalidArgument("int8 matmul: x and out must be f32 or bf16");
  if (method < kInt8Auto || method > kInt8Dot)
    return ffi::Error::InvalidArgument("int8 matmul: unknown method " + std::to_string(method));
  if (method == kInt8Dot && (!kernels->int8_dot() || kp / groups > kI8MaxDotGroup))
    return ffi::Error::InvalidArgument(std::string("int8 matmul: the dot method needs at most 65536 rows per group "
                                                   "and int8 dot products on the ") + IsaName(isa) +
                                       " path of this CPU");
  if (!M || !N) return ffi::Error::Success();
  if (!K) {
    std::memset(out->untyped_data(), 0, out->size_bytes());
    return ffi::Error::Success();
  }
  const Dt in = xt == ffi::DataType::F32 ? Dt::kF32 : Dt::kBf16, o = ot == ffi::DataType::F32 ? Dt::kF32 : Dt::kBf16;
  kernels->matmul_int8(RunnerFor(pool), in, o, x.untyped_data(), M, K, w.typed_data(), N, packed,
                       scale.typed_data(), groups, method, out->untyped_data());
  return ffi::Error::Success();
}

// q [T, Hq, D] (f32 or bf16) over kv [P, page, 2Hkv, D] in q's dtype (bf16 also as uint16 bits) with an empty
// scales operand, or quantized: int8 or float8_e4m3fn (also as uint8 bits) values with float32 scales [P, page, 2Hkv].
ffi::Error AttentionImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer kv, ffi::AnyBuffer kv_scales,
                         ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> page_indices,
                         ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::F32> sinks,
                         ffi::Result<ffi::AnyBuffer> out, float sm_scale, float soft_cap, int64_t window, int32_t isa) {
  const Kernels* kernels;
  if (ffi::Error e = Lookup(isa, &kernels); e.failure()) return e;
  auto qd = q.dimensions(), kd = kv.dimensions(), pd = page_indices.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || pd.size() != 2)
    return ffi::Error::InvalidArgument("attention: expected q[T,Hq,D], kv_pages[P,page,2Hkv,D], page_indices[S,M]");
  AttnShape a{qd[1], kd[2] / 2, qd[2], kd[1], pd[1], sm_scale, soft_cap, window};
  const int64_t t = qd[0], seqs = pd[0];
  if (kd[3] != a.d || a.d % 16 || a.hkv == 0 || a.hq % a.hkv)
    return ffi::Error::InvalidArgument("attention: head_dim must match and be a multiple of 16; Hq % Hkv == 0");
  if (static_cast<int64_t>(kv_lens.element_count()) != seqs ||
      static_cast<int64_t>(cu_q_lens.element_count()) != seqs + 1)
    return ffi::Error::InvalidArgument("attention: kv_lens[S] and cu_q_lens[S+1] must match page_indices[S, M]");
  const int64_t num_sinks = static_cast<int64_t>(sinks.element_count());
  if (num_sinks != 0 && num_sinks != a.hq)
    return ffi::Error::InvalidArgument("attention: sinks must be empty or one float32 per query head [Hq]");
  if (num_sinks) a.sinks = sinks.typed_data();
  const int64_t n = std::clamp<int64_t>(num_seqs.typed_data()[0], 0, seqs);
  auto qt = q.element_type(), kt = kv.element_type();
  if (qt != ffi::DataType::F32 && qt != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("attention: q must be f32 or bf16");
  const Dt dt = qt == ffi::DataType::F32 ? Dt::kF32 : Dt::kBf16;
  KvFormat format = KvFormat::kAsQuery;
  if (kt == ffi::DataType::S8)
    format = KvFormat::kInt8;
  else if (kt == ffi::DataType::F8E4M3FN || kt == ffi::DataType::U8)
    format = KvFormat::kE4m3;
  else if (!(kt == qt || (dt == Dt::kBf16 && kt == ffi::DataType::U16)))
    return ffi::Error::InvalidArgument(
        "attention: the cache must be in q's dtype (bf16 also as uint16 bits), int8 or float8_e4m3fn (or uint8 bits)");
  const float* scales = nullptr;
  if (format != KvFormat::kAsQuery) {
    auto sd = kv_scales.dimensions();
    if (kv_scales.element_type() != ffi::DataType::F32 || sd.size() != 3 || sd[0] != kd[0] || sd[1] != kd[1] ||
        sd[2] != kd[2])
      return ffi::Error::InvalidArgument("attention: a quantized cache needs float32 scales [P, page, 2Hkv]");
    scales = static_cast<const float*>(kv_scales.untyped_data());
  }
  kernels->attention(RunnerFor(pool), dt, format, a, t, q.untyped_data(), kv.untyped_data(), scales,
                     kv_lens.typed_data(), page_indices.typed_data(), cu_q_lens.typed_data(), n, out->untyped_data());
  return ffi::Error::Success();
}

// q [T, H, D] (f32 or bf16) over a latent cache [P, page, 1, D] in q's dtype (bf16 also as uint16 bits) with an
// empty scales operand, or quantized (int8, float8_e4m3fn or its uint8 bits) with float32 scales [P, page, 1];
// out [T, H, Dv].
ffi::Error LatentAttentionImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer cache, ffi::AnyBuffer scales_buf,
                               ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> page_indices,
                               ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> num_seqs,
                               ffi::Result<ffi::AnyBuffer> out, float sm_scale, int64_t value_dim, int32_t isa) {
  const Kernels* kernels;
  if (ffi::Error e = Lookup(isa, &kernels); e.failure()) return e;
  auto qd = q.dimensions(), kd = cache.dimensions(), pd = page_indices.dimensions(), od = out->dimensions();
  if (qd.size() != 3 || kd.size() != 4 || pd.size() != 2 || od.size() != 3)
    return ffi::Error::InvalidArgument("latent attention: expected q[T,H,D], pages[P,page,1,D], page_indices[S,M], "
                                       "out[T,H,Dv]");
  LatentShape a{qd[1], qd[2], value_dim, kd[1], pd[1], sm_scale};
  const int64_t t = qd[0], seqs = pd[0];
  if (kd[2] != 1 || kd[3] != a.d || a.d % 16 || a.dv % 16 || a.dv <= 0 || a.dv > a.d || od[0] != t ||
      od[1] != a.h || od[2] != a.dv)
    return ffi::Error::InvalidArgument("latent attention: one row of D per token, D and Dv multiples of 16 with "
                                       "Dv <= D, out [T, H, Dv]");
  if (static_cast<int64_t>(kv_lens.element_count()) != seqs ||
      static_cast<int64_t>(cu_q_lens.element_count()) != seqs + 1)
    return ffi::Error::InvalidArgument("latent attention: kv_lens[S] and cu_q_lens[S+1] must match page_indices");
  const int64_t n = std::clamp<int64_t>(num_seqs.typed_data()[0], 0, seqs);
  auto qt = q.element_type(), kt = cache.element_type();
  if ((qt != ffi::DataType::F32 && qt != ffi::DataType::BF16) || out->element_type() != qt)
    return ffi::Error::InvalidArgument("latent attention: q and out must both be f32 or both bf16");
  const Dt dt = qt == ffi::DataType::F32 ? Dt::kF32 : Dt::kBf16;
  KvFormat format = KvFormat::kAsQuery;
  if (kt == ffi::DataType::S8)
    format = KvFormat::kInt8;
  else if (kt == ffi::DataType::F8E4M3FN || kt == ffi::DataType::U8)
    format = KvFormat::kE4m3;
  else if (!(kt == qt || (dt == Dt::kBf16 && kt == ffi::DataType::U16)))
    return ffi::Error::InvalidArgument("latent attention: the cache must be in q's dtype (bf16 also as uint16 "
                                       "bits), int8 or float8_e4m3fn (or uint8 bits)");
  const float* scales = nullptr;
  if (format != KvFormat::kAsQuery) {
    auto sd = scales_buf.dimensions();
    if (scales_buf.element_type() != ffi::DataType::F32 || sd.size() != 3 || sd[0] != kd[0] || sd[1] != kd[1] ||
        sd[2] != 1)
      return ffi::Error::InvalidArgument("latent attention: a quantized cache needs float32 scales [P, page, 1]");
    scales = static_cast<const float*>(scales_buf.untyped_data());
  }
  kernels->latent_attention(RunnerFor(pool), dt, format, a, t, q.untyped_data(), cache.untyped_data(), scales,
                            kv_lens.typed_data(), page_indices.typed_data(), cu_q_lens.typed_data(), n,
                            out->untyped_data());
  return ffi::Error::Success();
}

ffi::Error GreedyHeadImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S8> q,
                          ffi::Buffer<ffi::F32> bounds, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> num_rows,
                          ffi::Result<ffi::Buffer<ffi::S32>> tokens, ffi::Result<ffi::Buffer<ffi::S32>> candidates,
                          int32_t layout, int32_t isa) {
  const Kernels* kernels;
  if (ffi::Error e = Lookup(isa, &kernels); e.failure()) return e;
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
  } else if (layout != 1 && layout != 2) {
    return ffi::Error::InvalidArgument("greedy head: layout must be 0 (packed), 1 ([K, N]) or 2 ([N, K])");
  } else if (wd.size() != 2 || (layout == 1 ? (wd[0] != K || wd[1] != N) : (wd[0] != N || wd[1] != K))) {
    return ffi::Error::InvalidArgument("greedy head: w must be [K, N] (layout 1) or [N, K] (layout 2)");
  }
  if (static_cast<int64_t>(tokens->element_count()) != M || static_cast<int64_t>(candidates->element_count()) != M)
    return ffi::Error::InvalidArgument("greedy head: tokens and candidates must be [M]");
  const int64_t rows = std::clamp<int64_t>(num_rows.typed_data()[0], 0, M);
  std::memset(tokens->untyped_data(), 0, M * sizeof(int32_t));
  std::memset(candidates->untyped_data(), 0, M * sizeof(int32_t));
  if (!rows || !N) return ffi::Error::Success();
  kernels->greedy_head(RunnerFor(pool), bf16 ? Dt::kBf16 : Dt::kF32, x.untyped_data(), rows, K, Kq,
                          q.typed_data(), bounds.typed_data(), bounds.typed_data() + N, hw, tokens->typed_data(),
                          candidates->typed_data());
  return ffi::Error::Success();
}

// Quantized experts: int8 gate/up/down with float32 scales per output channel and slot; else the scale operands are
// empty and the weights in x's dtype. Row-major ([S, E, I], [S, I, E]) or packed per slot (5-D: [S, I/P, Kp/step,
// P, step] and [S, E/P, Kp/step, P, step], P and step those of the weights' dtype, as the packed matmuls').
ffi::Error ExpertMlpImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> slots,
                         ffi::Buffer<ffi::F32> weights, ffi::AnyBuffer gate, ffi::AnyBuffer up, ffi::AnyBuffer down,
                         ffi::AnyBuffer gate_scale, ffi::AnyBuffer up_scale, ffi::AnyBuffer down_scale,
                         ffi::Result<ffi::AnyBuffer> out, int32_t isa) {
  const Kernels* kernels;
  if (ffi::Error e = Lookup(isa, &kernels); e.failure()) return e;
  auto xd = x.dimensions(), sd = slots.dimensions(), wd = weights.dimensions();
  auto gd = gate.dimensions(), ud = up.dimensions(), dd = down.dimensions();
  const auto t = x.element_type();
  if (!(t == ffi::DataType::F32 || t == ffi::DataType::BF16) || out->element_type() != t)
    return ffi::Error::InvalidArgument("expert mlp: x and out must both be f32 or both bf16");
  const bool packed = gd.size() == 5;
  const bool int8 = gate.element_type() == ffi::DataType::S8;
  if (xd.size() != 2 || sd.size() != 2 || wd.size() != 2 || (gd.size() != 3 && !packed) || ud.size() != gd.size() ||
      dd.size() != gd.size())
    return ffi::Error::InvalidArgument("expert mlp: expected x[T, E], slots[T, k], weights[T, k], gate/up[S, E, I], "
                                       "down[S, I, E] (or all three packed, 5-D)");
  const int64_t T = xd[0], E = xd[1], topk = sd[1], S = gd[0];
  int64_t I, kpe = 0, kpi = 0;
  if (packed) {
    // (P, step, K alignment) of the packed layout: f32 (32, 1, 1), bf16 (64, 2, 32), int8 (64, 4, 4)
    const int64_t panel = int8 || t == ffi::DataType::BF16 ? 64 : 32, step = int8 ? 4 : t == ffi::DataType::F32 ? 1 : 2;
    const int64_t align = int8 ? 4 : t == ffi::DataType::F32 ? 1 : 32;
    I = gd[1] * panel;
    kpe = gd[2] * step;
    kpi = dd[2] * step;
    auto same = [](auto d, std::initializer_list<int64_t> want) {
      return std::equal(d.begin(), d.end(), want.begin(), want.end());
    };
    if (!same(gd, {S, gd[1], gd[2], panel, step}) || !same(ud, {S, gd[1], gd[2], panel, step}) ||
        !same(dd, {S, E / panel, dd[2], panel, step}) || E % panel || kpe != (E + align - 1) / align * align ||
        kpi != (I + align - 1) / align * align)
      return ffi::Error::InvalidArgument(
          "expert mlp: packed experts must be gate/up [S, I/P, Kp/step, P, step] over E and down [S, E/P, Kp/step, "
          "P, step] over I (P x step: 32 x 1 for f32, 64 x 2 for bf16, 64 x 4 for int8; Kp: K padded to 1, 32, 4)");
  } else {
    I = gd[2];
    if (gd[1] != E || ud[0] != S || ud[1] != E || ud[2] != I || dd[0] != S || dd[1] != I || dd[2] != E)
      return ffi::Error::InvalidArgument(
          "expert mlp: shapes do not match (x[T, E], slots/weights[T, k], gate/up[S, E, I], down[S, I, E])");
  }
  if (sd[0] != T || wd[0] != T || wd[1] != topk)
    return ffi::Error::InvalidArgument("expert mlp: slots and weights must be [T, k] for x[T, E]");
  const auto wt = int8 ? ffi::DataType::S8 : t;
  if (gate.element_type() != wt || up.element_type() != wt || down.element_type() != wt)
    return ffi::Error::InvalidArgument("expert mlp: gate, up and down must all be in x's dtype or all int8");
  auto scale_ok = [&](const ffi::AnyBuffer& s, int64_t n) {
    auto d = s.dimensions();
    return int8 ? s.element_type() == ffi::DataType::F32 && d.size() == 2 && d[0] == S && d[1] == n
                : s.element_count() == 0;
  };
  if (!scale_ok(gate_scale, I) || !scale_ok(up_scale, I) || !scale_ok(down_scale, E))
    return ffi::Error::InvalidArgument("expert mlp: int8 experts need float32 scales gate/up [S, I], down [S, E]; "
                                       "others none");
  if (static_cast<int64_t>(out->element_count()) != T * E)
    return ffi::Error::InvalidArgument("expert mlp: out must be [T, E]");
  if (!T || !E) return ffi::Error::Success();
  if (!S || !I || !topk) {
    std::memset(out->untyped_data(), 0, out->size_bytes());
    return ffi::Error::Success();
  }
  auto scale = [&](const ffi::AnyBuffer& s) { return int8 ? static_cast<const float*>(s.untyped_data()) : nullptr; };
  kernels->expert_mlp(RunnerFor(pool), t == ffi::DataType::F32 ? Dt::kF32 : Dt::kBf16, x.untyped_data(), T, E,
                      slots.typed_data(), weights.typed_data(), topk, gate.untyped_data(), up.untyped_data(),
                      down.untyped_data(), scale(gate_scale), scale(up_scale), scale(down_scale), S, I, kpe, kpi,
                      out->untyped_data());
  return ffi::Error::Success();
}

// x, slots, then per part (1 to 4 projections of x: api.h LoraPart) a, b, ranks; out: per part y.
ffi::Error LoraImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> slots, ffi::RemainingArgs args,
                    ffi::RemainingRets rets, int32_t isa, int32_t a_layout, int32_t b_layout) {
  const Kernels* kernels;
  if (ffi::Error e = Lookup(isa, &kernels); e.failure()) return e;
  const int64_t G = static_cast<int64_t>(args.size()) / 3;
  if (args.size() % 3 || G < 1 || G > 4 || static_cast<int64_t>(rets.size()) != G)
    return ffi::Error::InvalidArgument(
        "lora: takes x, slots and 1 to 4 parts of (a, b, ranks), and returns one output per part");
  auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("lora: x must be [T, K], a [S, R, K], b [S, R, N]");
  const int64_t T = xd[0], K = xd[1];
  const auto t = x.element_type();
  if (t != ffi::DataType::F32 && t != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("lora: x, a, b and out must all be float32 or all bfloat16");
  if (static_cast<int64_t>(slots.element_count()) != T)
    return ffi::Error::InvalidArgument("lora: slots must be [T] and ranks [S]");
  if (a_layout < kLoraRows || a_layout > kLoraBlocks || (b_layout != kLoraRows && b_layout != kLoraStrips))
    return ffi::Error::InvalidArgument("lora: A's layout must be rows, pairs or blocks, B's rows or strips");
  if ((a_layout != kLoraRows || b_layout != kLoraRows) && t != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("lora: stacks in pairs, blocks or strips need bfloat16");
  LoraPart parts[4];
  int64_t S = 0, R = 0;
  for (int64_t p = 0; p < G; ++p) {
    auto a = args.get<ffi::AnyBuffer>(3 * p);
    auto b = args.get<ffi::AnyBuffer>(3 * p + 1);
    auto ranks = args.get<ffi::Buffer<ffi::S32>>(3 * p + 2);
    auto out = rets.get<ffi::AnyBuffer>(p);
    if (a.has_error() || b.has_error() || ranks.has_error() || out.has_error())
      return ffi::Error::InvalidArgument("lora: each part's ranks must be int32");
    auto ad = a->dimensions(), bd = b->dimensions();
    if (ad.size() != 3 || bd.size() != 3)
      return ffi::Error::InvalidArgument("lora: x must be [T, K], a [S, R, K], b [S, R, N]");
    if (!p) S = ad[0], R = ad[1];
    const int64_t N = bd[2];
    if (ad[0] != S || ad[1] != R || ad[2] != K || bd[0] != S || bd[1] != R)
      return ffi::Error::InvalidArgument(
          "lora: x [T, K], a [S, R, K] and b [S, R, N] disagree (or the parts' S and R)");
    if (static_cast<int64_t>(ranks->element_count()) != S)
      return ffi::Error::InvalidArgument("lora: slots must be [T] and ranks [S]");
    if (a->element_type() != t || b->element_type() != t || (*out)->element_type() != t)
      return ffi::Error::InvalidArgument("lora: x, a, b and out must all be float32 or all bfloat16");
    if (static_cast<int64_t>((*out)->element_count()) != T * N)
      return ffi::Error::InvalidArgument("lora: out must be [T, N]");
    if (b_layout == kLoraStrips && (R % 2 || N % 16))
      return ffi::Error::InvalidArgument("lora: B in strips needs an even R and N a multiple of 16");
    parts[p] = {a->untyped_data(), b->untyped_data(), ranks->typed_data(), N, (*out)->untyped_data()};
  }
  if (a_layout == kLoraPairs && (R % 2 || K % 16))
    return ffi::Error::InvalidArgument("lora: A in pairs needs an even R and K a multiple of 16");
  if (a_layout == kLoraBlocks && (R % 4 || K % 32 || !kernels->pair_dot))
    return ffi::Error::InvalidArgument("lora: A in blocks needs R a multiple of 4, K of 32, and a path with bfloat16 "
                                       "pair dot products");
  if (!T) return ffi::Error::Success();
  kernels->lora(RunnerFor(pool), t == ffi::DataType::F32 ? Dt::kF32 : Dt::kBf16, x.untyped_data(), T, K,
                slots.typed_data(), parts, G, a_layout, b_layout, S, R);
  return ffi::Error::Success();
}

// x, slots, then per part (1 to 4 projections of x: api.h LoraInt8Part) a, b, scale, ranks; out: per part y.
ffi::Error LoraInt8Impl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> slots, ffi::RemainingArgs args,
                        ffi::RemainingRets rets, int32_t isa) {
  const Kernels* kernels;
  if (ffi::Error e = Lookup(isa, &kernels); e.failure()) return e;
  const int64_t G = static_cast<int64_t>(args.size()) / 4;
  if (args.size() % 4 || G < 1 || G > 4 || static_cast<int64_t>(rets.size()) != G)
    return ffi::Error::InvalidArgument(
        "int8 lora: takes x, slots and 1 to 4 parts of (a, b, scale, ranks), and returns one output per part");
  auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("int8 lora: x must be [T, K]");
  const int64_t T = xd[0], K = xd[1];
  const auto t = x.element_type();
  if (t != ffi::DataType::F32 && t != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("int8 lora: x must be float32 or bfloat16");
  if (static_cast<int64_t>(slots.element_count()) != T)
    return ffi::Error::InvalidArgument("int8 lora: slots must be [T]");
  LoraInt8Part parts[4];
  int64_t S = 0, R = 0;
  for (int64_t p = 0; p < G; ++p) {
    auto a = args.get<ffi::Buffer<ffi::S8>>(4 * p);
    auto b = args.get<ffi::Buffer<ffi::S8>>(4 * p + 1);
    auto scale = args.get<ffi::Buffer<ffi::F32>>(4 * p + 2);
    auto ranks = args.get<ffi::Buffer<ffi::S32>>(4 * p + 3);
    auto out = rets.get<ffi::AnyBuffer>(p);
    if (a.has_error() || b.has_error() || scale.has_error() || ranks.has_error() || out.has_error())
      return ffi::Error::InvalidArgument(
          "int8 lora: each part's a, b must be int8, scale float32 and ranks int32");
    auto ad = a->dimensions(), bd = b->dimensions(), sd = scale->dimensions();
    if (ad.size() != 5 || bd.size() != 2 || sd.size() != 2)
      return ffi::Error::InvalidArgument(
          "int8 lora: x must be [T, K], a [S, R/32, Kq, 32, 4], b [S, R * N], scale [S, R]");
    if (!p) S = ad[0], R = ad[1] * 32;
    const int64_t N = R ? bd[1] / R : 0;
    if (ad[0] != S || ad[1] * 32 != R || ad[2] != (K + 3) / 4 || ad[3] != 32 || ad[4] != 4 || bd[0] != S ||
        bd[1] != R * N || sd[0] != S || sd[1] != R)
      return ffi::Error::InvalidArgument(
          "int8 lora: x [T, K], a [S, R/32, Kq, 32, 4], b [S, R * N] and scale [S, R] disagree (or the parts' S "
          "and R)");
    if (N % 16) return ffi::Error::InvalidArgument("int8 lora: N must be a multiple of 16");
    if (static_cast<int64_t>(ranks->element_count()) != S)
      return ffi::Error::InvalidArgument("int8 lora: ranks must be [S]");
    if ((*out)->element_type() != t)
      return ffi::Error::InvalidArgument("int8 lora: x and out must both be float32 or both bfloat16");
    if (static_cast<int64_t>((*out)->element_count()) != T * N)
      return ffi::Error::InvalidArgument("int8 lora: out must be [T, N]");
    parts[p] = {a->typed_data(), b->typed_data(), scale->typed_data(), ranks->typed_data(), N,
                (*out)->untyped_data()};
  }
  if (!T) return ffi::Error::Success();
  kernels->lora_int8(RunnerFor(pool), t == ffi::DataType::F32 ? Dt::kF32 : Dt::kBf16, x.untyped_data(), T, K,
                     slots.typed_data(), parts, G, S, R);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace meshserve

// For pallas_kernels/native.py: the instruction sets this CPU runs in this build (bit i: api.h Isa i), and names.
extern "C" __attribute__((visibility("default"))) int32_t MeshserveCpuIsas() {
  int32_t bits = 0;
  for (int32_t i = 0; i < meshserve::kNumIsas; ++i)
    if (meshserve::KernelsFor(i)) bits |= 1 << i;
  return bits;
}

extern "C" __attribute__((visibility("default"))) const char* MeshserveIsaName(int32_t isa) {
  return meshserve::IsaName(isa);
}

// Whether path `isa`'s int8 matmul has the dot-product method on this CPU.
extern "C" __attribute__((visibility("default"))) int32_t MeshserveInt8Dot(int32_t isa) {
  const meshserve::Kernels* k = isa >= 0 && isa < meshserve::kNumIsas ? meshserve::KernelsFor(isa) : nullptr;
  return k && k->int8_dot();
}

// Whether path `isa` multiplies bfloat16 pairs by the CPU's dot product (lora.h then wants A row-major).
extern "C" __attribute__((visibility("default"))) int32_t MeshservePairDot(int32_t isa) {
  const meshserve::Kernels* k = isa >= 0 && isa < meshserve::kNumIsas ? meshserve::KernelsFor(isa) : nullptr;
  return k && k->pair_dot;
}

// Both matmuls: (pool, x, w) -> out, with the instruction-set path as an attribute.
static auto MatmulBinding() {
  return ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
      .Attr<int32_t>("isa");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshserveMatmul, meshserve::MatmulImpl, MatmulBinding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshserveRaggedPagedAttention, meshserve::AttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("window")
                                  .Attr<int32_t>("isa"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshserveLatentAttention, meshserve::LatentAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("value_dim")
                                  .Attr<int32_t>("isa"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshserveMatmulPacked, meshserve::MatmulPackedImpl, MatmulBinding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshserveGreedyHead, meshserve::GreedyHeadImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int32_t>("layout")
                                  .Attr<int32_t>("isa"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshserveMatmulInt8, meshserve::MatmulInt8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("isa")
                                  .Attr<int32_t>("method"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshserveExpertMlp, meshserve::ExpertMlpImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("isa"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshserveLora, meshserve::LoraImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int32_t>("isa")
                                  .Attr<int32_t>("a_layout")
                                  .Attr<int32_t>("b_layout"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshserveLoraInt8, meshserve::LoraInt8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int32_t>("isa"));
