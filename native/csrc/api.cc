// The kernel entry points of the C ABI: argument checks, then the active ISA's
// kernel run over the thread pool. The Python binding validates first and
// names the bad argument; these checks only make a bad call from C (or a
// binding bug) return an error code instead of crashing.
#include <math.h>
#include <string.h>

#include <atomic>
#include <vector>

#include "internal.h"

using namespace capstan;

namespace {

// Below this many elements a call runs on the calling thread: waking the pool
// costs more than the work.
constexpr int64_t kGrain = 32768;
constexpr int kMaxChunks = 1024;
// Casts whose destination is at least this large use non-temporal stores:
// the output would not stay in cache anyway, and streaming skips the read of
// every destination line (write-allocate). Smaller outputs stay cacheable for
// whatever consumes them next.
constexpr int64_t kStreamBytes = 4 << 20;

bool valid_dtype(int dt) { return dt == CAPSTAN_F32 || dt == CAPSTAN_BF16 || dt == CAPSTAN_F16; }
int64_t dtype_size(int dt) { return dt == CAPSTAN_F32 ? 4 : 2; }

struct NonfiniteCtx {
  const KernelTable* k;
  const void* src;
  int dt;
  float scale;
  std::atomic<int> found{0};
};

void nonfinite_chunk(void* p, int64_t b, int64_t e, int) {
  auto* c = (NonfiniteCtx*)p;
  // Sub-blocks so one chunk stops soon after another found a NaN.
  constexpr int64_t kStep = 1 << 16;
  for (int64_t s = b; s < e; s += kStep) {
    if (c->found.load(std::memory_order_relaxed)) return;
    if (c->k->nonfinite(c->src, c->dt, c->scale, s, s + kStep < e ? s + kStep : e)) {
      c->found.store(1, std::memory_order_relaxed);
      return;
    }
  }
}

int any_nonfinite(const KernelTable* k, const void* src, int dt, float scale, int64_t n) {
  NonfiniteCtx c;
  c.k = k;
  c.src = src;
  c.dt = dt;
  c.scale = scale;
  parallel_for(n, kGrain, nonfinite_chunk, &c);
  return c.found.load();
}

struct AdamCtx {
  const KernelTable* k;
  AdamArgs a;
};

void adam_chunk(void* p, int64_t b, int64_t e, int) {
  auto* c = (AdamCtx*)p;
  c->k->adam(&c->a, b, e);
}

// One Adam step's buffers and scalars, the scalars rounded where torch.optim's single-tensor AdamW rounds
// them, and the stochastic rounding's hash stream.
void fill_adam_args(AdamArgs* a, void* param, int param_dtype, const void* grad, int grad_dtype, void* exp_avg,
                    void* exp_avg_sq, int moment_dtype, void* out, int out_dtype, int64_t step, double lr,
                    double beta1, double beta2, double eps, double weight_decay, int adamw, double grad_scale,
                    uint64_t seed, int64_t index_base) {
  a->p = param;
  a->pdt = param_dtype;
  a->g = grad;
  a->m = exp_avg;
  a->v = exp_avg_sq;
  a->out = out;
  a->gdt = grad_dtype;
  a->mdt = moment_dtype;
  a->odt = out ? out_dtype : CAPSTAN_NONE;
  // One stream from the 64-bit seed: its key hashes one half mixed with the other.
  a->key_m = sr_hash((uint32_t)seed ^ sr_hash((uint32_t)(seed >> 32)));
  // A bf16 parameter's stream: the moments' key hashed once more with a constant (fallback.sr_key_param).
  a->key_p = sr_hash(a->key_m ^ 0x9E3779B9u);
  // Element i hashes key + index_base + i: the kernels add i, so fold the base into the key (mod 2^32).
  a->key_m += (uint32_t)index_base;
  a->key_p += (uint32_t)index_base;
  a->grad_scale = (float)grad_scale;
  a->unscale = grad_scale != 1.0;
  a->adamw = adamw != 0;
  a->has_wd = weight_decay != 0.0;
  a->decay = (float)(1.0 - lr * weight_decay);
  a->wd = (float)weight_decay;
  a->w1 = (float)(1.0 - beta1);
  a->lerp_hi = !(fabsf(a->w1) < 0.5f);
  a->w1m1 = a->w1 - 1.0f;
  a->b2 = (float)beta2;
  a->c2 = (float)(1.0 - beta2);
  // pow(x, 0.5), not sqrt: torch.optim computes bias_correction2**0.5, and the
  // two may differ in the last bit of the double.
  const double bc2_sqrt = pow(1.0 - pow(beta2, (double)step), 0.5);
  const double neg_step = -(lr / (1.0 - pow(beta1, (double)step)));
  a->bc2_sqrt = (float)bc2_sqrt;
  a->eps = (float)eps;
  a->neg_step = (float)neg_step;
  a->neg_step_r = (float)(neg_step * bc2_sqrt);
  a->eps_r = (float)(eps * bc2_sqrt);
}

// 8-bit moments: the same pattern over block ids (AdamQ8Args).
struct AdamQ8Ctx {
  const KernelTable* k;
  AdamQ8Args q;
};

void adam_q8_chunk(void* p, int64_t b, int64_t e, int) { ((AdamQ8Ctx*)p)->k->adam_q8(&((AdamQ8Ctx*)p)->q, b, e); }

struct CastCtx {
  const KernelTable* k;
  const void* src;
  void* dst;
  int sdt, ddt;
  int stream;
};

void cast_chunk(void* p, int64_t b, int64_t e, int) {
  auto* c = (CastCtx*)p;
  c->k->cast(c->src, c->sdt, c->dst, c->ddt, b, e, c->stream);
}

struct CopyCtx {
  void* dst;
  const void* src;
};

void copy_chunk(void* p, int64_t b, int64_t e, int) {
  auto* c = (CopyCtx*)p;
  memcpy((char*)c->dst + b, (const char*)c->src + b, (size_t)(e - b));
}

struct SumCtx {
  const KernelTable* k;
  void* dst;
  const void* const* srcs;
  int ddt, nsrc, sdt;
};

void sum_chunk(void* p, int64_t b, int64_t e, int) {
  auto* c = (SumCtx*)p;
  c->k->sum(c->dst, c->ddt, c->srcs, c->nsrc, c->sdt, b, e);
}

struct SumsqCtx {
  const KernelTable* k;
  const void* src;
  int dt;
  double partial[kMaxChunks];
};

void sumsq_chunk(void* p, int64_t b, int64_t e, int chunk) {
  auto* c = (SumsqCtx*)p;
  c->partial[chunk] = c->k->sumsq(c->src, c->dt, b, e);
}

// A parameter is fp32, or a bf16 master, which is its own 16-bit copy (no out).
bool valid_param(int param_dtype, const void* out) {
  return param_dtype == CAPSTAN_F32 || (param_dtype == CAPSTAN_BF16 && out == nullptr);
}

}  // namespace

extern "C" {

int capstan_adam_step(void* param, int param_dtype, const void* grad, int grad_dtype, void* exp_avg,
                      void* exp_avg_sq, int moment_dtype, uint64_t seed, int64_t index_base, int64_t n,
                      int64_t step,
                      double lr, double beta1, double beta2, double eps, double weight_decay, int adamw,
                      double grad_scale, int check_overflow, void* out, int out_dtype,
                      int* overflow) {
  if (!param || !grad || !exp_avg || !exp_avg_sq || !overflow || n < 0 || step < 1)
    return CAPSTAN_EINVAL;
  if (!valid_dtype(grad_dtype) || !valid_param(param_dtype, out)) return CAPSTAN_EDTYPE;
  if (moment_dtype != CAPSTAN_F32 && moment_dtype != CAPSTAN_BF16) return CAPSTAN_EDTYPE;
  if (out ? !valid_dtype(out_dtype) : out_dtype != CAPSTAN_NONE) return CAPSTAN_EDTYPE;
  *overflow = 0;
  if (n == 0) return CAPSTAN_OK;
  const KernelTable* k = active_kernels();
  const float scale = (float)grad_scale;
  // Check every grad before writing anything: an overflowed step must leave
  // params, moments and the 16-bit copy exactly as they were.
  if (check_overflow && any_nonfinite(k, grad, grad_dtype, scale, n)) {
    *overflow = 1;
    return CAPSTAN_OK;
  }
  AdamCtx c;
  c.k = k;
  fill_adam_args(&c.a, param, param_dtype, grad, grad_dtype, exp_avg, exp_avg_sq, moment_dtype, out, out_dtype,
                 step, lr, beta1, beta2, eps, weight_decay, adamw, grad_scale, seed, index_base);
  parallel_for(n, kGrain, adam_chunk, &c);
  return CAPSTAN_OK;
}

int capstan_adam_step_q8(void* param, int param_dtype, const void* grad, int grad_dtype, uint8_t* exp_avg,
                         uint8_t* exp_avg_sq, float* scale_m, float* scale_v, int64_t block, int nseg,
                         const int64_t* seg_offset, const int64_t* seg_numel, const int64_t* seg_index,
                         uint64_t seed, int64_t step, double lr, double beta1, double beta2, double eps,
                         double weight_decay, int adamw, double grad_scale, int check_overflow, void* out,
                         int out_dtype, int* overflow) {
  if (!param || !grad || !exp_avg || !exp_avg_sq || !scale_m || !scale_v || !overflow || step < 1 ||
      nseg < 0 || (nseg > 0 && (!seg_offset || !seg_numel || !seg_index)))
    return CAPSTAN_EINVAL;
  if (block < 16 || block > kQ8MaxBlock || (block & (block - 1)) != 0) return CAPSTAN_EINVAL;
  for (int s = 0; s < nseg; ++s)
    if (seg_offset[s] < 0 || seg_numel[s] < 0 || seg_index[s] < 0) return CAPSTAN_EINVAL;
  if (!valid_dtype(grad_dtype) || !valid_param(param_dtype, out)) return CAPSTAN_EDTYPE;
  if (out ? !valid_dtype(out_dtype) : out_dtype != CAPSTAN_NONE) return CAPSTAN_EDTYPE;
  *overflow = 0;
  const KernelTable* k = active_kernels();
  const float scale = (float)grad_scale;
  if (check_overflow) {
    for (int s = 0; s < nseg; ++s) {
      const char* g = (const char*)grad + seg_offset[s] * dtype_size(grad_dtype);
      if (any_nonfinite(k, g, grad_dtype, scale, seg_numel[s])) {
        *overflow = 1;
        return CAPSTAN_OK;
      }
    }
  }
  std::vector<int64_t> first;
  try {
    first.assign((size_t)nseg + 1, 0);
  } catch (...) {
    return CAPSTAN_ENOMEM;
  }
  for (int s = 0; s < nseg; ++s) first[s + 1] = first[s] + (seg_numel[s] + block - 1) / block;
  if (first[nseg] == 0) return CAPSTAN_OK;
  AdamQ8Ctx c;
  c.k = k;
  fill_adam_args(&c.q.a, param, param_dtype, grad, grad_dtype, exp_avg, exp_avg_sq, CAPSTAN_NONE, out, out_dtype,
                 step, lr, beta1, beta2, eps, weight_decay, adamw, grad_scale, seed, 0);
  c.q.scale_m = scale_m;
  c.q.scale_v = scale_v;
  c.q.block = block;
  c.q.nseg = nseg;
  c.q.seg_offset = seg_offset;
  c.q.seg_numel = seg_numel;
  c.q.seg_index = seg_index;
  c.q.seg_first_block = first.data();
  // Whole blocks per thread: a block's scale needs all of its elements.
  const int64_t grain = kGrain / block > 1 ? kGrain / block : 1;
  parallel_for(first[nseg], grain, adam_q8_chunk, &c);
  return CAPSTAN_OK;
}

int capstan_cast(const void* src, int src_dtype, void* dst, int dst_dtype, int64_t n) {
  if (!src || !dst || n < 0) return CAPSTAN_EINVAL;
  if (!valid_dtype(src_dtype) || !valid_dtype(dst_dtype)) return CAPSTAN_EDTYPE;
  if (src_dtype == dst_dtype) return capstan_copy(dst, src, n * dtype_size(src_dtype));
  CastCtx c{active_kernels(), src, dst, src_dtype, dst_dtype,
            n * dtype_size(dst_dtype) >= kStreamBytes};
  parallel_for(n, kGrain, cast_chunk, &c);
  return CAPSTAN_OK;
}

int capstan_copy(void* dst, const void* src, int64_t nbytes) {
  if (!src || !dst || nbytes < 0) return CAPSTAN_EINVAL;
  CopyCtx c{dst, src};
  // Grain in bytes: a 4-byte element grain keeps the same per-thread work.
  parallel_for(nbytes, kGrain * 4, copy_chunk, &c);
  return CAPSTAN_OK;
}

int capstan_sum(void* dst, int dst_dtype, const void* const* srcs, int nsrc, int src_dtype,
                int64_t n) {
  if (!dst || !srcs || nsrc < 1 || n < 0) return CAPSTAN_EINVAL;
  for (int i = 0; i < nsrc; ++i)
    if (!srcs[i]) return CAPSTAN_EINVAL;
  if (!valid_dtype(dst_dtype) || !valid_dtype(src_dtype)) return CAPSTAN_EDTYPE;
  SumCtx c{active_kernels(), dst, srcs, dst_dtype, nsrc, src_dtype};
  parallel_for(n, kGrain, sum_chunk, &c);
  return CAPSTAN_OK;
}

int capstan_sumsq(const void* src, int dtype, int64_t n, double* out) {
  if (!src || !out || n < 0) return CAPSTAN_EINVAL;
  if (!valid_dtype(dtype)) return CAPSTAN_EDTYPE;
  SumsqCtx c;
  c.k = active_kernels();
  c.src = src;
  c.dt = dtype;
  int used = parallel_for(n, kGrain, sumsq_chunk, &c);
  double total = 0.0;
  for (int i = 0; i < used; ++i) total += c.partial[i];  // fixed order: deterministic
  *out = total;
  return CAPSTAN_OK;
}

int capstan_nonfinite(const void* src, int dtype, int64_t n, int* out) {
  if (!src || !out || n < 0) return CAPSTAN_EINVAL;
  if (!valid_dtype(dtype)) return CAPSTAN_EDTYPE;
  *out = any_nonfinite(active_kernels(), src, dtype, 1.0f, n);
  return CAPSTAN_OK;
}

}  // extern "C"
