/* capstan native library: the flat C ABI.
 *
 * Every function is extern "C", prefixed capstan_, takes raw pointers plus
 * element counts and dtype codes, and returns an int error code (CAPSTAN_OK on
 * success). No torch or Python headers: the Python side (capstan.native._lib)
 * loads this with ctypes, declares argtypes once, and validates every call
 * before it gets here; the checks in C are a second line of defence that turn
 * a bad call into an error code instead of a crash.
 *
 * Bump CAPSTAN_ABI_VERSION whenever a signature or a constant below changes;
 * the loader refuses a library whose version differs from the binding's.
 */
#ifndef CAPSTAN_H
#define CAPSTAN_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define CAPSTAN_ABI_VERSION 5

/* The library is built with -fvisibility=hidden; only the ABI is exported. */
#define CAPSTAN_API __attribute__((visibility("default")))

/* Error codes. */
#define CAPSTAN_OK 0
#define CAPSTAN_EINVAL 1    /* bad argument (null pointer, negative size, ...) */
#define CAPSTAN_EDTYPE 2    /* unsupported dtype or dtype combination */
#define CAPSTAN_ENOMEM 3    /* allocation failed */
#define CAPSTAN_EIO 4       /* an OS call failed; errno is reported separately */
#define CAPSTAN_ESHORT 5    /* read hit end of file before nbytes */
#define CAPSTAN_EISA 6      /* ISA not compiled in or not supported by this CPU */
#define CAPSTAN_EHANDLE 7   /* unknown async I/O handle */

/* Element types. */
#define CAPSTAN_F32 0
#define CAPSTAN_BF16 1
#define CAPSTAN_F16 2
#define CAPSTAN_NONE (-1)   /* "no buffer" (e.g. no 16-bit copy-out) */

/* ISA codes (capstan_set_isa / capstan_get_isa). */
#define CAPSTAN_ISA_SCALAR 0
#define CAPSTAN_ISA_AVX2 1
#define CAPSTAN_ISA_AVX512 2
#define CAPSTAN_ISA_AVX512BF16 3  /* AVX-512 plus the BF16 and DQ extensions */

/* CPU feature bits (capstan_cpu_features). */
#define CAPSTAN_CPU_AVX2 (1u << 0)
#define CAPSTAN_CPU_FMA (1u << 1)
#define CAPSTAN_CPU_F16C (1u << 2)
#define CAPSTAN_CPU_AVX512F (1u << 3)
#define CAPSTAN_CPU_AVX512BW (1u << 4)
#define CAPSTAN_CPU_AVX512VL (1u << 5)
#define CAPSTAN_CPU_AVX512BF16 (1u << 6)
#define CAPSTAN_CPU_AVX512DQ (1u << 7)

/* Async I/O operations and open flags. */
#define CAPSTAN_AIO_READ 0
#define CAPSTAN_AIO_WRITE 1
#define CAPSTAN_AIO_FSYNC 2
#define CAPSTAN_OPEN_READ 0
#define CAPSTAN_OPEN_WRITE 1  /* read-write, create if missing */
#define CAPSTAN_OPEN_TRUNC 2  /* read-write, create, truncate */

/* ---- library, dispatch, threads (dispatch.cc) ---- */
CAPSTAN_API int capstan_abi_version(void);
CAPSTAN_API uint32_t capstan_cpu_features(void);
CAPSTAN_API uint32_t capstan_compiled_isas(void);      /* bit (1 << isa) per compiled ISA */
CAPSTAN_API int capstan_best_isa(void);                /* best ISA this CPU and build allow */
CAPSTAN_API int capstan_set_isa(int isa);
CAPSTAN_API int capstan_get_isa(void);
CAPSTAN_API const char* capstan_isa_name(int isa);
CAPSTAN_API int capstan_set_num_threads(int n);
CAPSTAN_API int capstan_get_num_threads(void);
CAPSTAN_API const char* capstan_strerror(int code);

/* ---- kernels (api.cc) ---- */
/* One Adam/AdamW step over n master params: param_dtype CAPSTAN_F32, or CAPSTAN_BF16 (a bf16 master,
 * updated in fp32 and stored with stochastic rounding from its own hash stream of (seed, index_base +
 * element index); it is its own 16-bit copy, so out must be NULL).
 * grad has dtype grad_dtype; it is multiplied by grad_scale (1/loss_scale)
 * first. The moments exp_avg and exp_avg_sq have moment_dtype: CAPSTAN_F32, or
 * CAPSTAN_BF16, updated in fp32 and stored with stochastic rounding whose
 * random bits are a hash of (seed, index_base + element index): the same bits
 * on every ISA and thread split, a new stream for each seed; a buffer stepped
 * in slices gets the bits of one whole call when each slice passes its offset. With check_overflow, all
 * scaled grads are checked for inf/NaN before anything is written: on overflow
 * *overflow = 1 and no buffer changes.
 * With out != NULL the updated param is also written to out (out_dtype). */
CAPSTAN_API int capstan_adam_step(void* param, int param_dtype, const void* grad, int grad_dtype, void* exp_avg,
                      void* exp_avg_sq, int moment_dtype, uint64_t seed, int64_t index_base, int64_t n,
                      int64_t step,
                      double lr, double beta1, double beta2, double eps, double weight_decay, int adamw,
                      double grad_scale, int check_overflow, void* out, int out_dtype,
                      int* overflow);
/* One Adam/AdamW step with 8-bit moments (block-wise quantized; capstan::Q8Format in internal.h).
 * The buffers hold nseg segments (one parameter each): segment k is the n = seg_numel[k] elements at
 * seg_offset[k], cut into ceil(n / block) blocks of `block` elements (a power of two in 16..4096; the
 * last block short). exp_avg and exp_avg_sq are uint8 codes, scale_m and scale_v one fp32 per block,
 * the segments' blocks in order (segment 0's first). Each element's moments are decoded with its
 * block's scales, updated as capstan_adam_step updates fp32 ones (the parameter from the fp32 values,
 * with sqrt(1 - beta2^step) folded into the step size and eps: one division, not two),
 * then each block gets new scales -- the absmax of exp_avg and the max of sqrt(exp_avg_sq) -- and both
 * are re-encoded with stochastic rounding whose random bits hash (seed, seg_index[k] + element index in
 * the segment). Elements between segments are not touched. param_dtype, check_overflow, out: as
 * capstan_adam_step (a bf16 parameter's random bits hash the same canonical index as the moments'). */
CAPSTAN_API int capstan_adam_step_q8(void* param, int param_dtype, const void* grad, int grad_dtype, uint8_t* exp_avg,
                         uint8_t* exp_avg_sq, float* scale_m, float* scale_v, int64_t block, int nseg,
                         const int64_t* seg_offset, const int64_t* seg_numel, const int64_t* seg_index,
                         uint64_t seed, int64_t step, double lr, double beta1, double beta2, double eps,
                         double weight_decay, int adamw, double grad_scale, int check_overflow, void* out,
                         int out_dtype, int* overflow);
/* dst = src converted (round to nearest even); same dtype = copy. */
CAPSTAN_API int capstan_cast(const void* src, int src_dtype, void* dst, int dst_dtype, int64_t n);
CAPSTAN_API int capstan_copy(void* dst, const void* src, int64_t nbytes);
/* dst = sum of nsrc buffers of src_dtype, accumulated in fp32, stored as dst_dtype. */
CAPSTAN_API int capstan_sum(void* dst, int dst_dtype, const void* const* srcs, int nsrc, int src_dtype,
                int64_t n);
/* *out = sum of squares (fp32 within blocks, double across blocks). */
CAPSTAN_API int capstan_sumsq(const void* src, int dtype, int64_t n, double* out);
/* *out = 1 if any element is inf or NaN. */
CAPSTAN_API int capstan_nonfinite(const void* src, int dtype, int64_t n, int* out);

/* ---- async file I/O (aio.cc) ---- */
CAPSTAN_API void* capstan_alloc_aligned(int64_t nbytes, int64_t alignment);
CAPSTAN_API void capstan_free_aligned(void* ptr);
CAPSTAN_API int capstan_file_open(const char* path, int mode, int direct, int* fd_out, int* direct_out,
                      int* err);
CAPSTAN_API int capstan_file_close(int fd, int* err);
CAPSTAN_API int capstan_aio_create(int nthreads, void** engine_out);
CAPSTAN_API int capstan_aio_destroy(void* engine);
CAPSTAN_API int capstan_aio_submit(void* engine, int fd, int op, void* buf, int64_t nbytes, int64_t offset,
                       int64_t* handle_out);
CAPSTAN_API int capstan_aio_poll(void* engine, int64_t handle, int* done);
CAPSTAN_API int capstan_aio_wait(void* engine, int64_t handle, int64_t* done_bytes, int* err);

#ifdef __cplusplus
}
#endif
#endif
