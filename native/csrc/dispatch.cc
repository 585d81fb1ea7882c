// Runtime ISA dispatch, library identity and thread count.
//
// The build compiles kernels_avx2.cc / kernels_avx512*.cc only for an x86-64
// target (the target's architecture decides, not the host's) and defines
// CAPSTAN_HAVE_AVX2 / CAPSTAN_HAVE_AVX512 / CAPSTAN_HAVE_AVX512BF16 for this file when it does. Other
// targets (aarch64) get the scalar kernels and no CPU probe: features are 0.
// At first use the best ISA that is both compiled in and supported by the CPU
// (and the OS: __builtin_cpu_supports checks XCR0) is chosen; the
// environment variable CAPSTAN_NATIVE_ISA=scalar|avx2|avx512|avx512bf16 overrides it, and
// capstan_set_isa() changes it at run time (the tests force every path).
#include <stdlib.h>
#include <string.h>

#include <atomic>

#include "internal.h"

namespace capstan {
namespace {

uint32_t detect_features() {
  uint32_t f = 0;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2")) f |= CAPSTAN_CPU_AVX2;
  if (__builtin_cpu_supports("fma")) f |= CAPSTAN_CPU_FMA;
  // F16C has no __builtin_cpu_supports name in every gcc; CPUID.1:ECX bit 29.
  {
    unsigned a, b, c, d;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(1), "c"(0));
    if (c & (1u << 29)) f |= CAPSTAN_CPU_F16C;
  }
  if (__builtin_cpu_supports("avx512f")) f |= CAPSTAN_CPU_AVX512F;
  if (__builtin_cpu_supports("avx512bw")) f |= CAPSTAN_CPU_AVX512BW;
  if (__builtin_cpu_supports("avx512vl")) f |= CAPSTAN_CPU_AVX512VL;
  if (__builtin_cpu_supports("avx512dq")) f |= CAPSTAN_CPU_AVX512DQ;
#if defined(__GNUC__) && __GNUC__ >= 10
  if (__builtin_cpu_supports("avx512bf16")) f |= CAPSTAN_CPU_AVX512BF16;
#endif
#endif
  return f;
}

bool cpu_has(int isa) {
  const uint32_t f = capstan_cpu_features();
  const uint32_t avx2 = CAPSTAN_CPU_AVX2 | CAPSTAN_CPU_FMA | CAPSTAN_CPU_F16C;
  const uint32_t avx512 = CAPSTAN_CPU_AVX512F | CAPSTAN_CPU_AVX512BW | CAPSTAN_CPU_AVX512VL |
                          CAPSTAN_CPU_FMA | CAPSTAN_CPU_F16C;
  if (isa == CAPSTAN_ISA_SCALAR) return true;
  if (isa == CAPSTAN_ISA_AVX2) return (f & avx2) == avx2;
  if (isa == CAPSTAN_ISA_AVX512) return (f & avx512) == avx512;
  const uint32_t bf16 = avx512 | CAPSTAN_CPU_AVX512DQ | CAPSTAN_CPU_AVX512BF16;
  if (isa == CAPSTAN_ISA_AVX512BF16) return (f & bf16) == bf16;
  return false;
}

const KernelTable* table_for(int isa) {
  switch (isa) {
    case CAPSTAN_ISA_SCALAR: return kernels_scalar();
#ifdef CAPSTAN_HAVE_AVX2
    case CAPSTAN_ISA_AVX2: return kernels_avx2();
#endif
#ifdef CAPSTAN_HAVE_AVX512
    case CAPSTAN_ISA_AVX512: return kernels_avx512();
#endif
#ifdef CAPSTAN_HAVE_AVX512BF16
    case CAPSTAN_ISA_AVX512BF16: return kernels_avx512bf16();
#endif
    default: return nullptr;
  }
}

int parse_isa(const char* s) {
  if (!s) return -1;
  if (!strcmp(s, "scalar")) return CAPSTAN_ISA_SCALAR;
  if (!strcmp(s, "avx2")) return CAPSTAN_ISA_AVX2;
  if (!strcmp(s, "avx512")) return CAPSTAN_ISA_AVX512;
  if (!strcmp(s, "avx512bf16")) return CAPSTAN_ISA_AVX512BF16;
  return -1;
}

std::atomic<int> g_isa{-1};

int initial_isa() {
  const int env = parse_isa(getenv("CAPSTAN_NATIVE_ISA"));
  // An unusable override is ignored here; the Python loader reports it.
  if (env >= 0 && table_for(env) && cpu_has(env)) return env;
  return capstan_best_isa();
}

}  // namespace

const KernelTable* active_kernels() {
  int isa = g_isa.load(std::memory_order_acquire);
  if (isa < 0) {
    isa = initial_isa();
    g_isa.store(isa, std::memory_order_release);
  }
  return table_for(isa);
}

}  // namespace capstan

using namespace capstan;

extern "C" {

int capstan_abi_version(void) { return CAPSTAN_ABI_VERSION; }

uint32_t capstan_cpu_features(void) {
  static const uint32_t f = detect_features();
  return f;
}

uint32_t capstan_compiled_isas(void) {
  uint32_t m = 0;
  for (int isa = CAPSTAN_ISA_SCALAR; isa <= CAPSTAN_ISA_AVX512BF16; ++isa)
    if (table_for(isa)) m |= 1u << isa;
  return m;
}

int capstan_best_isa(void) {
  for (int isa = CAPSTAN_ISA_AVX512BF16; isa > CAPSTAN_ISA_SCALAR; --isa)
    if (table_for(isa) && cpu_has(isa)) return isa;
  return CAPSTAN_ISA_SCALAR;
}

int capstan_set_isa(int isa) {
  if (!table_for(isa) || !cpu_has(isa)) return CAPSTAN_EISA;
  g_isa.store(isa, std::memory_order_release);
  return CAPSTAN_OK;
}

int capstan_get_isa(void) {
  active_kernels();
  return g_isa.load(std::memory_order_acquire);
}

const char* capstan_isa_name(int isa) {
  switch (isa) {
    case CAPSTAN_ISA_SCALAR: return "scalar";
    case CAPSTAN_ISA_AVX2: return "avx2";
    case CAPSTAN_ISA_AVX512: return "avx512";
    case CAPSTAN_ISA_AVX512BF16: return "avx512bf16";
    default: return "unknown";
  }
}

int capstan_set_num_threads(int n) {
  // api.cc keeps per-chunk partial sums in a fixed array of 1024.
  if (n < 1 || n > 1024) return CAPSTAN_EINVAL;
  pool_resize(n);
  return CAPSTAN_OK;
}

int capstan_get_num_threads(void) { return pool_size(); }

const char* capstan_strerror(int code) {
  switch (code) {
    case CAPSTAN_OK: return "ok";
    case CAPSTAN_EINVAL: return "invalid argument";
    case CAPSTAN_EDTYPE: return "unsupported dtype";
    case CAPSTAN_ENOMEM: return "out of memory";
    case CAPSTAN_EIO: return "I/O error";
    case CAPSTAN_ESHORT: return "short read (end of file)";
    case CAPSTAN_EISA: return "instruction set not compiled in or not supported by this CPU";
    case CAPSTAN_EHANDLE: return "unknown async I/O handle";
    default: return "unknown error";
  }
}

}  // extern "C"
