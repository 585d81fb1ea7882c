// libcapstan_cuda: pinned host memory, stream copies with events, cast kernels.
//
// A separate library so the CPU library never depends on the CUDA runtime:
// it is compiled only where nvcc exists (native/build_native.py; cudart is
// linked statically) and loaded only where torch sees a GPU (capstan.native.cuda).
// Same conventions as csrc/capstan.h: extern "C", capstan_cuda_ prefix, int
// error codes (0 ok, else the cudaError_t value + 1000 or a CAPSTAN_* code),
// streams and events passed as opaque pointers (a torch stream's cuda_stream
// integer can be passed as the stream).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "capstan.h"

#define CAPSTAN_CUDA_ABI_VERSION 1
#define CAPSTAN_CUDA_API extern "C" __attribute__((visibility("default")))

static int err_code(cudaError_t e) { return e == cudaSuccess ? CAPSTAN_OK : 1000 + (int)e; }

CAPSTAN_CUDA_API int capstan_cuda_abi_version(void) { return CAPSTAN_CUDA_ABI_VERSION; }

CAPSTAN_CUDA_API const char* capstan_cuda_strerror(int code) {
  if (code >= 1000) return cudaGetErrorString((cudaError_t)(code - 1000));
  switch (code) {
    case CAPSTAN_OK: return "ok";
    case CAPSTAN_EINVAL: return "invalid argument";
    case CAPSTAN_EDTYPE: return "unsupported dtype";
    default: return "unknown error";
  }
}

CAPSTAN_CUDA_API int capstan_cuda_device_count(int* out) {
  if (!out) return CAPSTAN_EINVAL;
  return err_code(cudaGetDeviceCount(out));
}

// Page-locked host memory: lets cudaMemcpyAsync overlap with compute.
CAPSTAN_CUDA_API int capstan_cuda_host_alloc(int64_t nbytes, void** out) {
  if (!out || nbytes <= 0) return CAPSTAN_EINVAL;
  return err_code(cudaHostAlloc(out, (size_t)nbytes, cudaHostAllocPortable));
}

CAPSTAN_CUDA_API int capstan_cuda_host_free(void* p) { return err_code(cudaFreeHost(p)); }

CAPSTAN_CUDA_API int capstan_cuda_stream_create(void** out) {
  if (!out) return CAPSTAN_EINVAL;
  return err_code(cudaStreamCreateWithFlags((cudaStream_t*)out, cudaStreamNonBlocking));
}

CAPSTAN_CUDA_API int capstan_cuda_stream_destroy(void* s) {
  return err_code(cudaStreamDestroy((cudaStream_t)s));
}

CAPSTAN_CUDA_API int capstan_cuda_event_create(void** out) {
  if (!out) return CAPSTAN_EINVAL;
  return err_code(cudaEventCreateWithFlags((cudaEvent_t*)out, cudaEventDisableTiming));
}

CAPSTAN_CUDA_API int capstan_cuda_event_destroy(void* e) {
  return err_code(cudaEventDestroy((cudaEvent_t)e));
}

CAPSTAN_CUDA_API int capstan_cuda_event_record(void* e, void* stream) {
  return err_code(cudaEventRecord((cudaEvent_t)e, (cudaStream_t)stream));
}

// *done = 1 when all work before the record has finished.
CAPSTAN_CUDA_API int capstan_cuda_event_query(void* e, int* done) {
  if (!done) return CAPSTAN_EINVAL;
  cudaError_t r = cudaEventQuery((cudaEvent_t)e);
  if (r == cudaErrorNotReady) {
    *done = 0;
    return CAPSTAN_OK;
  }
  *done = r == cudaSuccess;
  return err_code(r);
}

CAPSTAN_CUDA_API int capstan_cuda_event_synchronize(void* e) {
  return err_code(cudaEventSynchronize((cudaEvent_t)e));
}

// kind: 0 host->device, 1 device->host, 2 device->device.
CAPSTAN_CUDA_API int capstan_cuda_memcpy_async(void* dst, const void* src, int64_t nbytes, int kind,
                                               void* stream) {
  if (!dst || !src || nbytes < 0 || kind < 0 || kind > 2) return CAPSTAN_EINVAL;
  const cudaMemcpyKind k[] = {cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost,
                              cudaMemcpyDeviceToDevice};
  return err_code(cudaMemcpyAsync(dst, src, (size_t)nbytes, k[kind], (cudaStream_t)stream));
}

__device__ __forceinline__ float load_f32(const void* p, int dt, int64_t i) {
  if (dt == CAPSTAN_F32) return ((const float*)p)[i];
  if (dt == CAPSTAN_BF16) return __bfloat162float(((const __nv_bfloat16*)p)[i]);
  return __half2float(((const __half*)p)[i]);
}

__device__ __forceinline__ void store_f32(void* p, int dt, int64_t i, float x) {
  if (dt == CAPSTAN_F32) ((float*)p)[i] = x;
  else if (dt == CAPSTAN_BF16) ((__nv_bfloat16*)p)[i] = __float2bfloat16_rn(x);
  else ((__half*)p)[i] = __float2half_rn(x);
}

// Grid-stride loop: any n with a bounded grid.
__global__ void cast_kernel(const void* src, int sdt, void* dst, int ddt, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    store_f32(dst, ddt, i, load_f32(src, sdt, i));
}

CAPSTAN_CUDA_API int capstan_cuda_cast(const void* src, int src_dtype, void* dst, int dst_dtype,
                                       int64_t n, void* stream) {
  if (!src || !dst || n < 0) return CAPSTAN_EINVAL;
  for (int dt : {src_dtype, dst_dtype})
    if (dt != CAPSTAN_F32 && dt != CAPSTAN_BF16 && dt != CAPSTAN_F16) return CAPSTAN_EDTYPE;
  if (n == 0) return CAPSTAN_OK;
  const int threads = 256;
  int64_t blocks = (n + threads - 1) / threads;
  if (blocks > 65535) blocks = 65535;
  cast_kernel<<<(unsigned)blocks, threads, 0, (cudaStream_t)stream>>>(src, src_dtype, dst, dst_dtype, n);
  return err_code(cudaGetLastError());
}
