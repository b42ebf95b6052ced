// The seam between the FFI handlers (ffi.cc), the CPU check (cpu.cc), both built for the architecture's baseline,
// and the kernels (kernels.cc), built once per instruction set, each copy in its own namespace. Only plain data and
// declarations live here: nothing in this header is compiled into code, so no function can be shared between
// translation units built with different instruction sets (the linker keeps one copy of an inline function, and
// it could be the AVX-512 one).
#pragma once

#include <cstdint>

namespace meshserve {

// Instruction-set paths, best last per architecture. The ids are the `isa` attribute of every FFI call
// (pallas_kernels/native.py ISAS); "generic" is portable C++ and exists everywhere.
enum Isa : int32_t {
  kGeneric = 0,
  kAvx2 = 1,        // x86-64-v3: AVX2 + FMA + F16C; bfloat16 widened to float32 in registers
  kAvx512 = 2,      // x86-64-v4: AVX-512 F/BW/VL/DQ; bfloat16 widened
  kAvx512Bf16 = 3,  // + AVX512_BF16: bfloat16 pair dot products (vdpbf16ps)
  kAmx = 4,         // + AMX-TILE/AMX-BF16: bfloat16 tiles for steps of many rows
  kNeon = 5,        // aarch64 Advanced SIMD; bfloat16 widened
  kNeonBf16 = 6,    // + FEAT_BF16: bfloat16 pair dot products (bfdot)
  kNumIsas = 7,
};

// The caller's worker threads, as plain C (the FFI's thread pool, or none).
struct Runner {
  void* pool;
  int64_t threads;  // workers that may run chunks at once, the caller included
  void (*schedule)(void* pool, void (*task)(void*), void* arg);
};

enum class Dt : int32_t { kF32 = 0, kBf16 = 1 };

// A KV cache's elements: q's dtype, or quantized (int8 / float8_e4m3fn bits) with a float32 scale per row.
enum class KvFormat : int32_t { kAsQuery = 0, kInt8 = 1, kE4m3 = 2 };
// How the int8 matmul multiplies (matmul_int8.h; pallas_kernels/native.py INT8_METHODS): auto picks by rows.
enum Int8Method : int32_t { kInt8Auto = 0, kInt8Widen = 1, kInt8Dot = 2 };

struct AttnShape {
  int64_t hq, hkv, d, page_size, max_pages;
  float sm_scale, soft_cap;
  int64_t window;  // 0: none
  const float* sinks = nullptr;  // [hq]: each query head's sink logit in its softmax's denominator (GPT-OSS); null: none
};

// A latent (multi-head latent attention) cache: h query heads, rows of d values, the first dv of them the values.
struct LatentShape {
  int64_t h, d, dv, page_size, max_pages;
  float sm_scale;
};

// The LM head as the model holds it, for the greedy head's exact recheck.
struct HeadWeight {
  const void* data;
  bool bf16;
  int32_t layout;  // 0: packed panels, 1: [K, N], 2: [N, K] (a tied embedding table)
  int64_t K, N, panel_len;
};

// How a LoRA stack holds each slot (Kernels::lora; lora.h has the forms, pallas_kernels/lora.py writes them):
// row-major, or (bfloat16) a form its tiles read as fewer, longer streams.
enum LoraLayout : int32_t {
  kLoraRows = 0,    // A [R, K], B [R, N] row-major
  kLoraPairs = 1,   // A: rows 2j and 2j + 1 side by side along K (paths that widen bfloat16)
  kLoraBlocks = 2,  // A: blocks of 4 rank rows, 32 columns of each side by side (paths with pair dot products)
  kLoraStrips = 3,  // B: strips of 64 columns, each strip's rows in pairs
};

// One projection of a LoRA call (Kernels::lora): its stacks (in the call's dtype and layouts), its slots' ranks and its
// output.
struct LoraPart {
  const void* a;
  const void* b;
  const int32_t* ranks;
  int64_t N;
  void* y;
};

// One projection of an int8 LoRA call (Kernels::lora_int8): its stacks, its slots' ranks and its output.
struct LoraInt8Part {
  const int8_t* a;
  const int8_t* b;
  const float* scale;
  const int32_t* ranks;
  int64_t N;
  void* y;
};

// One instruction set's kernels. Operands are validated by the caller (ffi.cc); bfloat16 travels as uint16_t bits.
struct Kernels {
  const char* name;
  // Whether this path multiplies bfloat16 pairs by the CPU's dot product (simd.h kNativePairs): lora.h then rounds
  // x @ A^T to bfloat16 before B in pairs.
  bool pair_dot;
  // out[M, N] = x[M, K] @ w[K, N], w row-major; `in` is x's and w's dtype; f32 in gives f32 out.
  void (*matmul)(const Runner&, Dt in, Dt out, const void* x, int64_t M, int64_t K, const void* w, int64_t N,
                 void* o);
  // The same on w packed into panels (pallas_kernels/native.py `pack_weight`); kw: K rows held (bf16: padded).
  void (*matmul_packed)(const Runner&, Dt in, Dt out, const void* x, int64_t M, int64_t K, const void* w,
                        int64_t panels, int64_t kw, void* o);
  // Ragged paged attention (pallas_kernels/reference.py); q and out in `dt`, kv in `dt` (kAsQuery) or quantized
  // with kv_scales [P, page, 2Hkv] (one per row of kv; null for kAsQuery).
  void (*attention)(const Runner&, Dt dt, KvFormat kv_format, const AttnShape& a, int64_t t, const void* q,
                    const void* kv, const float* kv_scales, const int32_t* kv_lens, const int32_t* pages,
                    const int32_t* cu, int64_t num_seqs, void* out);
  // Greedy LM head by screening: tokens/candidates for the first `rows` rows of x[., K] (x in `dt`).
  void (*greedy_head)(const Runner&, Dt dt, const void* x, int64_t rows, int64_t K, int64_t Kq, const int8_t* q,
                      const float* scale, const float* bound, const HeadWeight& w, int32_t* tokens,
                      int32_t* candidates);
  // Grouped expert MLP (moe.h): out[T, E] = sum_k weights[t, k] * SwiGLU expert slots[t, k] of x[t] (slot < 0 or
  // >= S: none), gate/up [S, E, I], down [S, I, E]; x and out in `dt`, weights float32; the expert weights in `dt`
  // (scales null), or int8 with float32 scales per output channel and slot (gate/up [S, I], down [S, E]). kpe > 0:
  // the weights are packed, gate/up [S, I/P, kpe/step, P, step] and down [S, E/P, kpi/step, P, step] (the packed
  // matmuls' layouts per slot, float or int8; kpe, kpi: E and I padded as that layout pads K).
  void (*expert_mlp)(const Runner&, Dt dt, const void* x, int64_t T, int64_t E, const int32_t* slots,
                     const float* weights, int64_t topk, const void* gate, const void* up, const void* down,
                     const float* gate_scale, const float* up_scale, const float* down_scale, int64_t S, int64_t I,
                     int64_t kpe, int64_t kpi, void* out);
  // out[M, N] = (x[M, K] @ w) * scale accumulated in float32 (matmul_int8.h): w int8, packed (`packed`: [N/64,
  // Kp/4, 64, 4], Kp = K rounded up to 4) or row-major [K, N]; scale float32 [G, N], G groups of K/G rows (packed
  // with G > 1: K/G a multiple of 4); x in `in`, out in `out`. kInt8Dot needs int8_dot() (row-major w: widened).
  void (*matmul_int8)(const Runner&, Dt in, Dt out, const void* x, int64_t M, int64_t K, const int8_t* w, int64_t N,
                      bool packed, const float* scale, int64_t groups, int32_t method, void* o);
  // Whether this path's int8 matmul has the int8 dot-product method on this CPU (AVX512_VNNI; aarch64 dotprod).
  bool (*int8_dot)();
  // Paged attention over a latent cache (mla.h; pallas_kernels/mla.py): q [T, H, D] and out [T, H, Dv] in `dt`,
  // cache [P, page, 1, D] in `dt` (kAsQuery) or quantized with kv_scales [P, page, 1] (null for kAsQuery).
  void (*latent_attention)(const Runner&, Dt dt, KvFormat kv_format, const LatentShape& a, int64_t t, const void* q,
                           const void* cache, const float* kv_scales, const int32_t* kv_lens, const int32_t* pages,
                           const int32_t* cu, int64_t num_seqs, void* out);
  // LoRA update (lora.h) of G (1 to 4) projections of one x at once (q|k|v, gate|up): per part, y[T, N] = (x[t] @
  // a[s][:r, :]^T) @ b[s][:r, :] per token, s = slots[t], r = the part's ranks[s] (s < 0 or >= S, or r = 0: zeros);
  // a [S, R, K] (A transposed) and b [S, R, N], each slot as a_layout and b_layout say (LoraLayout: A rows, pairs or
  // blocks, B rows or strips; the forms bfloat16 only, their shapes checked by ffi.cc); x, a, b and y in `dt`.
  void (*lora)(const Runner&, Dt dt, const void* x, int64_t T, int64_t K, const int32_t* slots, const LoraPart* parts,
               int64_t G, int32_t a_layout, int32_t b_layout, int64_t S, int64_t R);
  // The same on int8 stacks (lora.h "int8 adapter stacks") for G (1 to 4) projections of one x at once (q|k|v,
  // gate|up): each part's a [S, R/32, Kq, 32, 4], b [S, R * N] (lora.h's strips; R a multiple of 32, N of 16), scale
  // [S, R] float32, ranks [S] and y [T, N]; x and y in `dt`.
  void (*lora_int8)(const Runner&, Dt dt, const void* x, int64_t T, int64_t K, const int32_t* slots,
                    const LoraInt8Part* parts, int64_t G, int64_t S, int64_t R);
};

// Each defined by kernels.cc built for that instruction set. Weak: a library links the copies its compiler could
// build for its architecture, and an absent one reads as null.
#define MESHSERVE_WEAK __attribute__((weak))
MESHSERVE_WEAK const Kernels* KernelsGeneric();
MESHSERVE_WEAK const Kernels* KernelsAvx2();
MESHSERVE_WEAK const Kernels* KernelsAvx512();
MESHSERVE_WEAK const Kernels* KernelsAvx512Bf16();
MESHSERVE_WEAK const Kernels* KernelsAmx();
MESHSERVE_WEAK const Kernels* KernelsNeon();
MESHSERVE_WEAK const Kernels* KernelsNeonBf16();

// cpu.cc: whether this CPU and OS can run `isa`'s code, its name, and its kernels (null if this CPU cannot run
// them or this build has none); whether it has int8 dot products (x86-64: AVX512_VNNI with the AVX-512 state
// saved; aarch64: the dotprod extension), which the kernels built for AVX-512 or NEON check before using them;
// MESHSERVE_CPU_STREAMS=one|several overrides CpuOneStream (for measurements).
bool CpuRuns(int32_t isa);
bool CpuHasInt8Dot();
// Whether packed weights stream faster as one sequential stream per panel than as several (matmul.h PackedTile):
// AMD's x86-64 CPUs (measured on a Zen 5 EPYC), not Intel's (a Xeon: several) nor, unmeasured, others.
bool CpuOneStream();
const char* IsaName(int32_t isa);
const Kernels* KernelsFor(int32_t isa);

}  // namespace meshserve
