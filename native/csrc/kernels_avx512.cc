// AVX-512 F/BW/VL kernels (integer bf16 rounding): this file alone is compiled with -mavx512f -mavx512bw -mavx512vl -mfma -mf16c.
// The dispatcher (dispatch.cc) only calls in here after checking the CPU.
#include <immintrin.h>

#include "internal.h"

namespace {
#include "simd_scalar.h"
#include "simd_avx512.h"
using KV = VVec;
#define KERNEL_TABLE_NAME "avx512"
#include "kernels_body.h"
}  // namespace

const capstan::KernelTable* capstan::kernels_avx512() { return &kTable; }
