// Scalar kernels: the portable baseline (and the only ISA built on aarch64).
// The dispatcher (dispatch.cc) only calls in here after checking the CPU.

#include "internal.h"

namespace {
#include "simd_scalar.h"
using KV = SVec;
#define KERNEL_TABLE_NAME "scalar"
#include "kernels_body.h"
}  // namespace

const capstan::KernelTable* capstan::kernels_scalar() { return &kTable; }
