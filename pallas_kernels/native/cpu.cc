// Which instruction sets this CPU and OS run, read from the CPU itself (cpuid and xgetbv on x86-64, the kernel's
// hwcaps on aarch64), and the kernels for each. Built for the architecture's baseline: it runs on any CPU.
#include <cstdlib>
#include <cstring>

#include "api.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#elif defined(__aarch64__)
#include <sys/auxv.h>
#endif

namespace meshserve {
namespace {

#if defined(__x86_64__)
struct X86Features {
  bool avx2 = false, avx512 = false, avx512_bf16 = false, amx = false, avx512_vnni = false;
};

uint64_t Xcr0() {
  uint32_t eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}

X86Features ReadX86() {
  X86Features f;
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool fma = c & (1u << 12), osxsave = c & (1u << 27), avx = c & (1u << 28), f16c = c & (1u << 29);
  if (!osxsave || !avx) return f;
  const uint64_t xcr0 = Xcr0();
  if ((xcr0 & 0x6) != 0x6) return f;  // the OS saves SSE and AVX state
  unsigned max_leaf = __get_cpuid_max(0, nullptr);
  if (max_leaf < 7) return f;
  __cpuid_count(7, 0, a, b, c, d);
  const unsigned b7 = b, d7 = d;
  f.avx2 = (b7 & (1u << 5)) && fma && f16c;
  const bool zmm_state = (xcr0 & 0xE0) == 0xE0;  // opmask, ZMM0-15 upper halves, ZMM16-31
  // F (16), DQ (17), BW (30), VL (31)
  f.avx512 = f.avx2 && zmm_state && (b7 & (1u << 16)) && (b7 & (1u << 17)) && (b7 & (1u << 30)) && (b7 & (1u << 31));
  f.avx512_vnni = f.avx512 && (c & (1u << 11));  // leaf 7 ECX bit 11
  __cpuid_count(7, 1, a, b, c, d);
  f.avx512_bf16 = f.avx512 && (a & (1u << 5));
  const bool tile_state = (xcr0 & (3ull << 17)) == (3ull << 17);  // XTILECFG, XTILEDATA
  if (f.avx512_bf16 && tile_state && (d7 & (1u << 24)) && (d7 & (1u << 22))) {  // AMX-TILE, AMX-BF16
    // Linux hands out the tile data state only on request (once per process).
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    f.amx = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }
  return f;
}

const X86Features& X86() {
  static const X86Features f = ReadX86();
  return f;
}
#endif

#if defined(__aarch64__)
#ifndef HWCAP_ASIMD
#define HWCAP_ASIMD (1 << 1)
#endif
#ifndef HWCAP2_BF16
#define HWCAP2_BF16 (1 << 14)
#endif
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#endif

}  // namespace

bool CpuRuns(int32_t isa) {
  switch (isa) {
    case kGeneric:
      return true;
#if defined(__x86_64__)
    case kAvx2: return X86().avx2;
    case kAvx512: return X86().avx512;
    case kAvx512Bf16: return X86().avx512_bf16;
    case kAmx: return X86().amx;
#elif defined(__aarch64__)
    case kNeon: return getauxval(AT_HWCAP) & HWCAP_ASIMD;
    case kNeonBf16: return (getauxval(AT_HWCAP) & HWCAP_ASIMD) && (getauxval(AT_HWCAP2) & HWCAP2_BF16);
#endif
    default:
      return false;
  }
}

bool CpuHasInt8Dot() {
#if defined(__x86_64__)
  return X86().avx512_vnni;
#elif defined(__aarch64__)
  return (getauxval(AT_HWCAP) & HWCAP_ASIMD) && (getauxval(AT_HWCAP) & HWCAP_ASIMDDP);
#else
  return false;
#endif
}

bool CpuOneStream() {
  static const bool one = [] {
    if (const char* env = std::getenv("MESHSERVE_CPU_STREAMS")) {
      if (!std::strcmp(env, "one")) return true;
      if (!std::strcmp(env, "several")) return false;
    }
#if defined(__x86_64__)
    unsigned a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return false;
    char vendor[13] = {};
    std::memcpy(vendor, &b, 4);
    std::memcpy(vendor + 4, &d, 4);
    std::memcpy(vendor + 8, &c, 4);
    return !std::strcmp(vendor, "AuthenticAMD");
#else
    return false;
#endif
  }();
  return one;
}

const char* IsaName(int32_t isa) {
  static const char* const kNames[kNumIsas] = {"generic", "avx2", "avx512", "avx512_bf16", "amx", "neon",
                                               "neon_bf16"};
  return isa >= 0 && isa < kNumIsas ? kNames[isa] : "unknown";
}

const Kernels* KernelsFor(int32_t isa) {
  if (!CpuRuns(isa)) return nullptr;
  const Kernels* (*table)() = nullptr;
  switch (isa) {
    case kGeneric: table = KernelsGeneric; break;
    case kAvx2: table = KernelsAvx2; break;
    case kAvx512: table = KernelsAvx512; break;
    case kAvx512Bf16: table = KernelsAvx512Bf16; break;
    case kAmx: table = KernelsAmx; break;
    case kNeon: table = KernelsNeon; break;
    case kNeonBf16: table = KernelsNeonBf16; break;
    default: break;
  }
  return table ? table() : nullptr;  // a weak function this build lacks is null
}

}  // namespace meshserve
