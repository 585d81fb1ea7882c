// AVX-512 kernels with the AVX512_BF16 conversions: this file alone is compiled
// with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16 -mfma -mf16c.
// The same kernels as kernels_avx512.cc; only the fp32->bf16 stores differ
// (see simd_avx512.h). The dispatcher (dispatch.cc) only calls in here after
// checking the CPU for all of those extensions.
#include <immintrin.h>

#include "internal.h"

#define CAPSTAN_AVX512_BF16_HW 1
namespace {
#include "simd_scalar.h"
#include "simd_avx512.h"
using KV = VVec;
#define KERNEL_TABLE_NAME "avx512bf16"
#include "kernels_body.h"
}  // namespace

const capstan::KernelTable* capstan::kernels_avx512bf16() { return &kTable; }
