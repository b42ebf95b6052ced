// meshserve's CPU kernels for one instruction set. This file is compiled once per instruction set of the
// architecture (pallas_kernels/native.py passes -DMESHSERVE_ISA_ID=<api.h Isa> and that set's compiler flags), and
// every copy lands in one library: each in its own namespace, defining nothing outside it but its table, so no
// code built for one instruction set can stand in for another's. cpu.cc picks the table at run time from what the
// CPU reports.
//
//   matmul.h       packed matmul (any rows) and small-M matmul on row-major weights, AMX where built for it
//   matmul_int8.h  int8 weights with float32 scales: widened to float32, or int8 dot products where the CPU has them
//   attention.h    ragged paged attention with an online softmax
//   mla.h          paged attention over a latent (multi-head latent attention) cache, every head per row read
//   greedy_head.h  greedy LM head: argmax of the exact logits from an int8 screen plus an exact recheck
//   moe.h          grouped expert MLP (mixture of experts): each selected expert's weights read once per call
//   lora.h         LoRA update of a batch mixing adapters: each used adapter's A and B read once, up to its rank
//   simd.h         the vector operations all of them are written in; parallel.h work sharing and buffers
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "api.h"

#ifndef MESHSERVE_ISA_ID
#error "build with -DMESHSERVE_ISA_ID=<meshserve::Isa>"
#endif

#if MESHSERVE_ISA_ID == 1
#define MESHSERVE_X86_AVX2 1
#elif MESHSERVE_ISA_ID == 2
#define MESHSERVE_X86_AVX512 1
#elif MESHSERVE_ISA_ID == 3
#define MESHSERVE_X86_AVX512 1
#define MESHSERVE_BF16_PAIRS 1
#elif MESHSERVE_ISA_ID == 4
#define MESHSERVE_X86_AVX512 1
#define MESHSERVE_BF16_PAIRS 1
#define MESHSERVE_AMX 1
#elif MESHSERVE_ISA_ID == 5
#define MESHSERVE_NEON 1
#elif MESHSERVE_ISA_ID == 6
#define MESHSERVE_NEON 1
#define MESHSERVE_BF16_PAIRS 1
#elif MESHSERVE_ISA_ID != 0
#error "unknown MESHSERVE_ISA_ID"
#endif

#if MESHSERVE_X86_AVX2 || MESHSERVE_X86_AVX512
#include <immintrin.h>
#elif MESHSERVE_NEON
#include <arm_neon.h>
#endif

#if MESHSERVE_ISA_ID == 0
#define MESHSERVE_NS generic
#define MESHSERVE_TABLE KernelsGeneric
#elif MESHSERVE_ISA_ID == 1
#define MESHSERVE_NS avx2
#define MESHSERVE_TABLE KernelsAvx2
#elif MESHSERVE_ISA_ID == 2
#define MESHSERVE_NS avx512
#define MESHSERVE_TABLE KernelsAvx512
#elif MESHSERVE_ISA_ID == 3
#define MESHSERVE_NS avx512_bf16
#define MESHSERVE_TABLE KernelsAvx512Bf16
#elif MESHSERVE_ISA_ID == 4
#define MESHSERVE_NS amx
#define MESHSERVE_TABLE KernelsAmx
#elif MESHSERVE_ISA_ID == 5
#define MESHSERVE_NS neon
#define MESHSERVE_TABLE KernelsNeon
#elif MESHSERVE_ISA_ID == 6
#define MESHSERVE_NS neon_bf16
#define MESHSERVE_TABLE KernelsNeonBf16
#endif

namespace meshserve {
namespace MESHSERVE_NS {
namespace {

#include "simd.h"
#include "parallel.h"
#include "matmul.h"
#include "matmul_int8.h"
#include "attention.h"
#include "mla.h"
#include "greedy_head.h"
#include "moe.h"
#include "lora.h"

#define MESHSERVE_STR2(x) #x
#define MESHSERVE_STR(x) MESHSERVE_STR2(x)
const Kernels kTable = {MESHSERVE_STR(MESHSERVE_NS), V::kNativePairs, MatmulEntry, MatmulPackedEntry, AttentionEntry,
                        GreedyHeadEntry, ExpertMlpEntry, MatmulInt8Entry, Int8Dot, LatentAttentionEntry,
                        LoraEntry, LoraInt8Entry};

}  // namespace
}  // namespace MESHSERVE_NS

const Kernels* MESHSERVE_TABLE() { return &MESHSERVE_NS::kTable; }

}  // namespace meshserve
