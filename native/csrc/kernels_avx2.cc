// AVX2 + FMA + F16C kernels: this file alone is compiled with -mavx2 -mfma -mf16c.
// The dispatcher (dispatch.cc) only calls in here after checking the CPU.
#include <immintrin.h>

#include "internal.h"

namespace {
#include "simd_scalar.h"
#include "simd_avx2.h"
using KV = VVec;
#define KERNEL_TABLE_NAME "avx2"
#include "kernels_body.h"
}  // namespace

const capstan::KernelTable* capstan::kernels_avx2() { return &kTable; }
