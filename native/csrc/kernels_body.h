// Kernel bodies, written once over a vector type V (SVec, or an ISA's VVec).
//
// Included inside an anonymous namespace by each kernels_<isa>.cc, so every
// instantiation has internal linkage and carries its own unit's ISA flags.
// Each kernel runs the main loop with KV lanes, then the tail with SVec: the
// same IEEE operations in the same order (explicit fma only; the build uses
// -ffp-contract=off),
// so every element-wise kernel gives bit-identical results on every ISA
// (sumsq differs in summation order only).

using capstan::AdamArgs;
using capstan::AdamQ8Args;

// The per-vector helpers below must inline into their loops: gcc left adam_math, once it served two
// moment formats, as a call per vector in the fp32 kernel (twice as slow).
#define CAPSTAN_KERNEL_INLINE inline __attribute__((always_inline))

template <class V>
static inline V load_as_f32(const void* base, int dt, int64_t i) {
  if (dt == CAPSTAN_F32) return V::load((const float*)base + i);
  if (dt == CAPSTAN_BF16) return V::load_bf16((const uint16_t*)base + i);
  return V::load_f16((const uint16_t*)base + i);
}

template <class V>
static inline void store_from_f32(void* base, int dt, int64_t i, V x) {
  if (dt == CAPSTAN_F32) V::store((float*)base + i, x);
  else if (dt == CAPSTAN_BF16) V::store_bf16((uint16_t*)base + i, x);
  else V::store_f16((uint16_t*)base + i, x);
}

// One Adam step on W elements at i, with exactly the roundings of torch.optim's
// single-tensor AdamW (torch/optim/adam.py, _single_tensor_adam) on ATen's
// vectorized CPU kernels, where lerp, addcmul and add(alpha=) use one fused
// multiply-add each (checked op by op against torch 2.13):
//   AdamW: p = p * (1 - lr*wd)             Adam: g = fma(wd, p, g)
//   m = fma(1 - beta1, g - m, m)            (lerp_; weight >= 0.5: fma(w - 1, g - m, g))
//   v = fma((1 - beta2) * g, g, v * beta2)  (mul_ then addcmul_)
//   p = p + (-step_size * m) / (sqrt(v) / sqrt(1 - beta2^t) + eps)   (addcdiv_)
// Kingma & Ba 2015, Algorithm 1, bias corrections folded into step_size and
// the denominator; Loshchilov & Hutter 2019 for the decoupled decay.
// Moments in bf16 (MD): loaded to fp32, updated by the same operations, the
// parameter updated from the fp32 values with sqrt(1 - beta2^t) folded into the
// step and eps (one division, not two: `p + neg_step_r * m / (sqrt(v) + eps_r)`,
// as the 8-bit moments), then the moments stored with stochastic rounding, one
// random word per element (its top half for m, its low half for v). fp32
// moments keep torch.optim's two divisions and its bits.
template <class V>
static CAPSTAN_KERNEL_INLINE void store_moments_bf16(const AdamArgs& a, int64_t i, V m, V v) {
  const typename V::Bits r = V::hash_lanes(a.key_m, i);
  V::store_bf16_sr((uint16_t*)a.m + i, m, V::hi16(r));
  V::store_bf16_sr((uint16_t*)a.v + i, v, V::lo16(r));
}

// The parameter: fp32, or a bf16 master (PD) loaded as fp32 and stored with stochastic rounding from a
// stream of its own (key_p: the top half of its element's word), so that small updates still move it
// in expectation where nearest rounding would drop every update below half a bf16 ulp.
template <class V, int PD>
static CAPSTAN_KERNEL_INLINE V load_param(const AdamArgs& a, int64_t i) {
  if (PD == CAPSTAN_BF16) return V::load_bf16((const uint16_t*)a.p + i);
  return V::load((const float*)a.p + i);
}

// `key` + `r` hashes the element's word: key_p and i where i counts from the stream's base (adam_range),
// a block's key and the element's place in it (the 8-bit kernel).
template <class V, int PD>
static CAPSTAN_KERNEL_INLINE void store_param(const AdamArgs& a, int64_t i, V p, uint32_t key, int64_t r) {
  if (PD == CAPSTAN_BF16) V::store_bf16_sr((uint16_t*)a.p + i, p, V::hi16(V::hash_lanes(key, r)));
  else V::store((float*)a.p + i, p);
}

// The update of one vector of elements, in registers: p, m and v (loaded as fp32) in place.
template <class V, int MD>
static CAPSTAN_KERNEL_INLINE void adam_math(const AdamArgs& a, V& p, V g, V& m, V& v) {
  if (a.unscale) g = g * V::set1(a.grad_scale);
  if (a.has_wd) {
    if (a.adamw) p = p * V::set1(a.decay);
    else g = V::fma(V::set1(a.wd), p, g);
  }
  if (a.lerp_hi) m = V::fma(V::set1(a.w1m1), g - m, g);
  else m = V::fma(V::set1(a.w1), g - m, m);
  v = V::fma(V::set1(a.c2) * g, g, v * V::set1(a.b2));
  if (MD == CAPSTAN_F32) {
    V denom = V::sqrt(v) / V::set1(a.bc2_sqrt) + V::set1(a.eps);
    p = p + (V::set1(a.neg_step) * m) / denom;
  } else {
    p = p + (V::set1(a.neg_step_r) * m) / (V::sqrt(v) + V::set1(a.eps_r));
  }
}

template <class V, int GD, int OD, int MD, int PD>
static CAPSTAN_KERNEL_INLINE void adam_one(const AdamArgs& a, int64_t i) {
  V p = load_param<V, PD>(a, i);
  V m = load_as_f32<V>(a.m, MD, i);
  V v = load_as_f32<V>(a.v, MD, i);
  adam_math<V, MD>(a, p, load_as_f32<V>(a.g, GD, i), m, v);
  store_param<V, PD>(a, i, p, a.key_p, i);
  if (MD == CAPSTAN_F32) {
    V::store((float*)a.m + i, m);
    V::store((float*)a.v + i, v);
  } else {
    store_moments_bf16<V>(a, i, m, v);
  }
  if (OD != CAPSTAN_NONE) store_from_f32<V>(a.out, OD, i, p);
}

#ifndef CAPSTAN_ADAM_PREFETCH
#define CAPSTAN_ADAM_PREFETCH 1024
#endif
template <int GD, int MD, int PD>
static inline void adam_prefetch(const AdamArgs* a, int64_t i) {
  if (CAPSTAN_ADAM_PREFETCH) {
    // One core's hardware prefetchers keep too few of the 4 read streams'
    // lines in flight; fetch each a fixed distance ahead.
    constexpr int64_t msz = MD == CAPSTAN_F32 ? 4 : 2;
    constexpr int64_t d = CAPSTAN_ADAM_PREFETCH / 4;  // elements of fp32 ahead
    __builtin_prefetch((const char*)a->p + (i + d) * (PD == CAPSTAN_F32 ? 4 : 2));
    __builtin_prefetch((const char*)a->m + (i + d) * msz);
    __builtin_prefetch((const char*)a->v + (i + d) * msz);
    __builtin_prefetch((const char*)a->g + (i + d) * (GD == CAPSTAN_F32 ? 4 : 2));
  }
}

// bf16 moments, a tile at a time: the update with the moments kept in fp32 in L1 (mb, vb), then their
// stochastic rounding, the same operations per element as adam_one. One loop carrying the update's
// sqrt and two divisions and both moments' hashes and roundings ran at half the fp32 kernel's pace on
// AVX2 (Zen 3): too long a body for the out-of-order window to overlap iterations (one division fewer
// made it 1.4x faster, where the fp32 kernel did not change). Tiled, it is 1.7x faster; with one
// division in the update, one random word for both moments and two vectors to a store, 1.38x more
// (in L2; at 100M parameters 93-101% of a copy of its bytes, docs/benchmarks.md).
constexpr int64_t kAdamTile = 512;
template <int GD, int OD, int PD>
static void adam_tiles_bf16(const AdamArgs* a, int64_t begin, int64_t end) {
  alignas(64) float mb[kAdamTile];
  alignas(64) float vb[kAdamTile];
  for (int64_t i0 = begin; i0 + KV::W <= end; i0 += kAdamTile) {
    const int64_t n = (end - i0 < kAdamTile ? end - i0 : kAdamTile) / KV::W * KV::W;
    for (int64_t j = 0; j < n; j += KV::W) {
      adam_prefetch<GD, CAPSTAN_BF16, PD>(a, i0 + j);
      KV p = load_param<KV, PD>(*a, i0 + j);
      KV m = KV::load_bf16((const uint16_t*)a->m + i0 + j);
      KV v = KV::load_bf16((const uint16_t*)a->v + i0 + j);
      adam_math<KV, CAPSTAN_BF16>(*a, p, load_as_f32<KV>(a->g, GD, i0 + j), m, v);
      store_param<KV, PD>(*a, i0 + j, p, a->key_p, i0 + j);
      if (OD != CAPSTAN_NONE) store_from_f32<KV>(a->out, OD, i0 + j, p);
      KV::store(mb + j, m);
      KV::store(vb + j, v);
    }
    int64_t j = 0;
    for (; j + 2 * KV::W <= n; j += 2 * KV::W) {  // two vectors a store: one pack where two took two each
      const typename KV::Bits r0 = KV::hash_lanes(a->key_m, i0 + j);
      const typename KV::Bits r1 = KV::hash_lanes(a->key_m, i0 + j + KV::W);
      KV::store_bf16_sr2((uint16_t*)a->m + i0 + j, KV::load(mb + j), KV::load(mb + j + KV::W), KV::hi16(r0),
                         KV::hi16(r1));
      KV::store_bf16_sr2((uint16_t*)a->v + i0 + j, KV::load(vb + j), KV::load(vb + j + KV::W), KV::lo16(r0),
                         KV::lo16(r1));
    }
    for (; j < n; j += KV::W) store_moments_bf16<KV>(*a, i0 + j, KV::load(mb + j), KV::load(vb + j));
  }
}

template <int GD, int OD, int MD, int PD>
static void adam_range_t(const AdamArgs* a, int64_t begin, int64_t end) {
  int64_t i = begin;
  if (MD == CAPSTAN_BF16) {
    adam_tiles_bf16<GD, OD, PD>(a, begin, end);
    i = begin + (end - begin) / KV::W * KV::W;
  }
  for (; i + KV::W <= end; i += KV::W) {
    adam_prefetch<GD, MD, PD>(a, i);
    adam_one<KV, GD, OD, MD, PD>(*a, i);
  }
  for (; i < end; ++i) adam_one<SVec, GD, OD, MD, PD>(*a, i);
}

template <int GD, int MD>
static void adam_range_g(const AdamArgs* a, int64_t begin, int64_t end) {
  // A bf16 master is its own 16-bit copy: never an out (api.cc refuses one).
  if (a->pdt == CAPSTAN_BF16) return adam_range_t<GD, CAPSTAN_NONE, MD, CAPSTAN_BF16>(a, begin, end);
  switch (a->odt) {
    case CAPSTAN_NONE: return adam_range_t<GD, CAPSTAN_NONE, MD, CAPSTAN_F32>(a, begin, end);
    case CAPSTAN_BF16: return adam_range_t<GD, CAPSTAN_BF16, MD, CAPSTAN_F32>(a, begin, end);
    case CAPSTAN_F16: return adam_range_t<GD, CAPSTAN_F16, MD, CAPSTAN_F32>(a, begin, end);
    default: return adam_range_t<GD, CAPSTAN_F32, MD, CAPSTAN_F32>(a, begin, end);
  }
}

template <int MD>
static void adam_range_m(const AdamArgs* a, int64_t begin, int64_t end) {
  switch (a->gdt) {
    case CAPSTAN_BF16: return adam_range_g<CAPSTAN_BF16, MD>(a, begin, end);
    case CAPSTAN_F16: return adam_range_g<CAPSTAN_F16, MD>(a, begin, end);
    default: return adam_range_g<CAPSTAN_F32, MD>(a, begin, end);
  }
}

// The kernels read the arguments from a local copy: stores through the float buffers could alias the
// caller's AdamArgs, and the compiler reloads every scalar and flag after each store (on AVX2 the
// fp32 kernel in L2 ran 1.31x faster with the copy; adam_q8_t likewise).
static void adam_range(const AdamArgs* args, int64_t begin, int64_t end) {
  const AdamArgs local = *args;
  const AdamArgs* a = &local;
  if (a->mdt == CAPSTAN_BF16) return adam_range_m<CAPSTAN_BF16>(a, begin, end);
  return adam_range_m<CAPSTAN_F32>(a, begin, end);
}

// ---- Adam with 8-bit moments (capstan_adam_step_q8) ----
// adam_math cut in two for a block held in L1: the moments first (decode with the block's old scales,
// update, sqrt(v)), kept in fp32 (mb, rb at j) for the block's new scales; then, in the pass that
// encodes them, the parameter. The moments see the same operations in the same order as adam_math;
// the parameter's update takes one division, not two (adam_q8_param). One pass carrying decode, sqrt
// and two divisions was too long for the out-of-order window to overlap many iterations; split, and
// the codes packed four vectors at a time, the kernel ran 1.19x faster on AVX2 (Zen 3); the parameter
// moved into the encoding pass with one division, and AdamArgs copied to a local, 1.12x more
// (docs/benchmarks.md, "The bf16 and 8-bit kernels on an AVX2 machine").
template <class V, int GD, int PD>
static inline void adam_q8_moments(const AdamArgs& a, int64_t i, float sm, float sv, float* mb, float* rb,
                                   int64_t j, V& max_m, V& max_r) {
  V m = V::template load_q8<capstan::Q8M>((const uint8_t*)a.m + i) * V::set1(sm);
  V r = V::template load_q8<capstan::Q8V>((const uint8_t*)a.v + i) * V::set1(sv);
  V v = r * r;
  V g = load_as_f32<V>(a.g, GD, i);
  if (a.unscale) g = g * V::set1(a.grad_scale);
  if (a.has_wd && !a.adamw) g = V::fma(V::set1(a.wd), load_param<V, PD>(a, i), g);
  if (a.lerp_hi) m = V::fma(V::set1(a.w1m1), g - m, g);
  else m = V::fma(V::set1(a.w1), g - m, m);
  v = V::fma(V::set1(a.c2) * g, g, v * V::set1(a.b2));
  r = V::sqrt(v);
  V::store(mb + j, m);
  V::store(rb + j, r);
  max_m = V::max(max_m, V::abs(m));
  max_r = V::max(max_r, r);
}

// The parameter from its updated moments (m, r = sqrt(v) in registers): p + neg_step_r * m / (r + eps_r),
// torch.optim's update with sqrt(1 - beta2^step) taken out of the denominator into the step: one division
// a value where fp32 moments take torch.optim's two (the rounding differs in the last bits of the update,
// below what 8-bit moments keep). Run in the encoding pass, whose integer work hides the division.
// A bf16 master rounds with key_p's word of its canonical index: the block's key `kp` plus j.
template <class V, int OD, int PD>
static inline void adam_q8_param(const AdamArgs& a, int64_t i, V m, V r, uint32_t kp, int64_t j) {
  V p = load_param<V, PD>(a, i);
  if (a.has_wd && a.adamw) p = p * V::set1(a.decay);
  p = p + (V::set1(a.neg_step_r) * m) / (r + V::set1(a.eps_r));
  store_param<V, PD>(a, i, p, kp, j);
  if (OD != CAPSTAN_NONE) store_from_f32<V>(a.out, OD, i, p);
}

// Block ids [begin, end): each block updated, its scales set to the new absmax of m and max of sqrt(v),
// then both re-encoded against them with stochastic rounding: element i of segment s draws one random
// word from its canonical index seg_index[s] + i, whose top 16 bits round m and low 16 bits sqrt(v).
// A zero block keeps scale 0 and codes 0.
template <int GD, int OD, int PD>
static void adam_q8_t(const AdamQ8Args* q, int64_t begin, int64_t end) {
  alignas(64) float mb[capstan::kQ8MaxBlock];
  alignas(64) float rb[capstan::kQ8MaxBlock];
  // A copy, not a reference: stores through the float buffers could alias q->a, and the compiler would
  // reload every scalar and flag after each store; a local it can keep in registers and hoist.
  const AdamArgs a = q->a;
  int s = 0;
  while (q->seg_first_block[s + 1] <= begin) ++s;
  for (int64_t b = begin; b < end; ++b) {
    while (q->seg_first_block[s + 1] <= b) ++s;
    const int64_t within = (b - q->seg_first_block[s]) * q->block;
    const int64_t lo = q->seg_offset[s] + within;
    const int64_t left = q->seg_numel[s] - within;
    const int64_t n = left < q->block ? left : q->block;
    KV max_m = KV::set1(0.0f), max_r = KV::set1(0.0f);
    SVec tmax_m = SVec::set1(0.0f), tmax_r = SVec::set1(0.0f);
    int64_t j = 0;
    for (; j + KV::W <= n; j += KV::W) {
      if (CAPSTAN_ADAM_PREFETCH) {
        // As adam_range_t: the read streams a fixed distance ahead (the codes' lines hold 64 elements).
        constexpr int64_t d = CAPSTAN_ADAM_PREFETCH / 4;
        __builtin_prefetch((const char*)a.p + (lo + j + d) * (PD == CAPSTAN_F32 ? 4 : 2));
        __builtin_prefetch((const char*)a.g + (lo + j + d) * (GD == CAPSTAN_F32 ? 4 : 2));
        if (((lo + j) & 63) < KV::W) {
          __builtin_prefetch((const uint8_t*)a.m + lo + j + d);
          __builtin_prefetch((const uint8_t*)a.v + lo + j + d);
        }
      }
      adam_q8_moments<KV, GD, PD>(a, lo + j, q->scale_m[b], q->scale_v[b], mb, rb, j, max_m, max_r);
    }
    for (; j < n; ++j)
      adam_q8_moments<SVec, GD, PD>(a, lo + j, q->scale_m[b], q->scale_v[b], mb, rb, j, tmax_m, tmax_r);
    const float am = capstan::q8_scale(SVec::max(SVec::set1(KV::hmax(max_m)), tmax_m).v);
    const float ar = capstan::q8_scale(SVec::max(SVec::set1(KV::hmax(max_r)), tmax_r).v);
    q->scale_m[b] = am;
    q->scale_v[b] = ar;
    const float im = capstan::q8_inverse(am), ir = capstan::q8_inverse(ar);
    const uint32_t key = a.key_m + (uint32_t)(q->seg_index[s] + within);
    const uint32_t kp = a.key_p + (uint32_t)(q->seg_index[s] + within);
    uint8_t* cm = (uint8_t*)a.m + lo;
    uint8_t* cv = (uint8_t*)a.v + lo;
    j = 0;
    using B = typename KV::Bits;
    for (; j + 4 * KV::W <= n; j += 4 * KV::W) {  // four vectors at a time: fewer shuffles to pack the codes
      // The parameters first, then the codes, each reading mb and rb from L1: holding the eight vectors
      // across both spilled them (16 registers on AVX2), and ran no faster.
      for (int k = 0; k < 4; ++k) {
        const int64_t o = j + k * KV::W;
        adam_q8_param<KV, OD, PD>(a, lo + o, KV::load(mb + o), KV::load(rb + o), kp, o);
      }
      const B r0 = KV::hash_lanes(key, j), r1 = KV::hash_lanes(key, j + KV::W);
      const B r2 = KV::hash_lanes(key, j + 2 * KV::W), r3 = KV::hash_lanes(key, j + 3 * KV::W);
      const KV vm = KV::set1(im), vr = KV::set1(ir);
      KV::store_codes4(cm + j, KV::template encode_q8<capstan::Q8M>(KV::load(mb + j) * vm, KV::hi16(r0)),
                       KV::template encode_q8<capstan::Q8M>(KV::load(mb + j + KV::W) * vm, KV::hi16(r1)),
                       KV::template encode_q8<capstan::Q8M>(KV::load(mb + j + 2 * KV::W) * vm, KV::hi16(r2)),
                       KV::template encode_q8<capstan::Q8M>(KV::load(mb + j + 3 * KV::W) * vm, KV::hi16(r3)));
      KV::store_codes4(cv + j, KV::template encode_q8<capstan::Q8V>(KV::load(rb + j) * vr, KV::lo16(r0)),
                       KV::template encode_q8<capstan::Q8V>(KV::load(rb + j + KV::W) * vr, KV::lo16(r1)),
                       KV::template encode_q8<capstan::Q8V>(KV::load(rb + j + 2 * KV::W) * vr, KV::lo16(r2)),
                       KV::template encode_q8<capstan::Q8V>(KV::load(rb + j + 3 * KV::W) * vr, KV::lo16(r3)));
    }
    for (; j + KV::W <= n; j += KV::W) {
      const typename KV::Bits r = KV::hash_lanes(key, j);
      const KV m = KV::load(mb + j), rt = KV::load(rb + j);
      KV::template store_q8_sr<capstan::Q8M>(cm + j, m * KV::set1(im), KV::hi16(r));
      KV::template store_q8_sr<capstan::Q8V>(cv + j, rt * KV::set1(ir), KV::lo16(r));
      adam_q8_param<KV, OD, PD>(a, lo + j, m, rt, kp, j);
    }
    for (; j < n; ++j) {
      const uint32_t r = SVec::hash_lanes(key, j);
      const SVec m = SVec::load(mb + j), rt = SVec::load(rb + j);
      SVec::store_q8_sr<capstan::Q8M>(cm + j, m * SVec::set1(im), SVec::hi16(r));
      SVec::store_q8_sr<capstan::Q8V>(cv + j, rt * SVec::set1(ir), SVec::lo16(r));
      adam_q8_param<SVec, OD, PD>(a, lo + j, m, rt, kp, j);
    }
  }
}

template <int GD>
static void adam_q8_g(const AdamQ8Args* q, int64_t begin, int64_t end) {
  if (q->a.pdt == CAPSTAN_BF16) return adam_q8_t<GD, CAPSTAN_NONE, CAPSTAN_BF16>(q, begin, end);
  switch (q->a.odt) {
    case CAPSTAN_NONE: return adam_q8_t<GD, CAPSTAN_NONE, CAPSTAN_F32>(q, begin, end);
    case CAPSTAN_BF16: return adam_q8_t<GD, CAPSTAN_BF16, CAPSTAN_F32>(q, begin, end);
    case CAPSTAN_F16: return adam_q8_t<GD, CAPSTAN_F16, CAPSTAN_F32>(q, begin, end);
    default: return adam_q8_t<GD, CAPSTAN_F32, CAPSTAN_F32>(q, begin, end);
  }
}

static void adam_q8_range(const AdamQ8Args* q, int64_t begin, int64_t end) {
  switch (q->a.gdt) {
    case CAPSTAN_BF16: return adam_q8_g<CAPSTAN_BF16>(q, begin, end);
    case CAPSTAN_F16: return adam_q8_g<CAPSTAN_F16>(q, begin, end);
    default: return adam_q8_g<CAPSTAN_F32>(q, begin, end);
  }
}

// Non-temporal store of 2*W elements (a, then b) at i; dst + i 64-byte aligned.
template <class V>
static inline void stream2_from_f32(void* base, int dt, int64_t i, V a, V b) {
  if (dt == CAPSTAN_F32) V::stream2((float*)base + i, a, b);
  else if (dt == CAPSTAN_BF16) V::stream2_bf16((uint16_t*)base + i, a, b);
  else V::stream2_f16((uint16_t*)base + i, a, b);
}

// With `stream`, the vector loop writes with non-temporal stores: a large cast
// then moves bytes read + bytes written, instead of also reading every
// destination line first (write-allocate), which capped casts near 60% of
// memcpy's bandwidth. The head runs scalar up to a 64-byte boundary of dst.
// Same conversions either way: only the store instruction differs.
// Software prefetch distance (bytes of src) in the streamed loop: one core's
// hardware prefetchers alone left the f32->16-bit casts read-latency bound.
// 2 KiB rather than 1 KiB since the avx512bf16 unit: on a quiet machine every
// cast then reached 82-101% of memcpy, against 77-93% at 1 KiB (docs/benchmarks.md).
#ifndef CAPSTAN_CAST_PREFETCH
#define CAPSTAN_CAST_PREFETCH 2048
#endif
template <int SD, int DD>
static void cast_t(const void* src, void* dst, int64_t begin, int64_t end, int stream) {
  constexpr int64_t dsz = DD == CAPSTAN_F32 ? 4 : 2;
  constexpr int64_t ssz = SD == CAPSTAN_F32 ? 4 : 2;
  int64_t i = begin;
  if (stream && KV::W > 1 && ((uintptr_t)dst % dsz) == 0) {
    for (; i < end && ((uintptr_t)dst + i * dsz) % 64 != 0; ++i)
      store_from_f32<SVec>(dst, DD, i, load_as_f32<SVec>(src, SD, i));
    for (; i + 2 * KV::W <= end; i += 2 * KV::W) {
      if (CAPSTAN_CAST_PREFETCH) {
        __builtin_prefetch((const char*)src + i * ssz + CAPSTAN_CAST_PREFETCH);
        __builtin_prefetch((const char*)src + (i + KV::W) * ssz + CAPSTAN_CAST_PREFETCH);
      }
      KV a = load_as_f32<KV>(src, SD, i), b = load_as_f32<KV>(src, SD, i + KV::W);
      stream2_from_f32<KV>(dst, DD, i, a, b);
    }
    KV::fence();
  }
  for (; i + KV::W <= end; i += KV::W) store_from_f32<KV>(dst, DD, i, load_as_f32<KV>(src, SD, i));
  for (; i < end; ++i) store_from_f32<SVec>(dst, DD, i, load_as_f32<SVec>(src, SD, i));
}

// api.cc routes same-dtype casts to memcpy; here one side is always fp32.
static void cast_range(const void* src, int sdt, void* dst, int ddt, int64_t begin, int64_t end,
                       int stream) {
  if (sdt == CAPSTAN_F32 && ddt == CAPSTAN_BF16) return cast_t<CAPSTAN_F32, CAPSTAN_BF16>(src, dst, begin, end, stream);
  if (sdt == CAPSTAN_F32 && ddt == CAPSTAN_F16) return cast_t<CAPSTAN_F32, CAPSTAN_F16>(src, dst, begin, end, stream);
  if (sdt == CAPSTAN_BF16 && ddt == CAPSTAN_F32) return cast_t<CAPSTAN_BF16, CAPSTAN_F32>(src, dst, begin, end, stream);
  if (sdt == CAPSTAN_F16 && ddt == CAPSTAN_F32) return cast_t<CAPSTAN_F16, CAPSTAN_F32>(src, dst, begin, end, stream);
  if (sdt == CAPSTAN_BF16 && ddt == CAPSTAN_F16) return cast_t<CAPSTAN_BF16, CAPSTAN_F16>(src, dst, begin, end, stream);
  if (sdt == CAPSTAN_F16 && ddt == CAPSTAN_BF16) return cast_t<CAPSTAN_F16, CAPSTAN_BF16>(src, dst, begin, end, stream);
}

// dst = ((src0 + src1) + src2) + ... in fp32, element-wise.
template <class V>
static inline void sum_one(void* dst, int ddt, const void* const* srcs, int nsrc, int sdt, int64_t i) {
  V acc = load_as_f32<V>(srcs[0], sdt, i);
  for (int k = 1; k < nsrc; ++k) acc = acc + load_as_f32<V>(srcs[k], sdt, i);
  store_from_f32<V>(dst, ddt, i, acc);
}

static void sum_range(void* dst, int ddt, const void* const* srcs, int nsrc, int sdt, int64_t begin,
                      int64_t end) {
  int64_t i = begin;
  for (; i + KV::W <= end; i += KV::W) sum_one<KV>(dst, ddt, srcs, nsrc, sdt, i);
  for (; i < end; ++i) sum_one<SVec>(dst, ddt, srcs, nsrc, sdt, i);
}

// Sum of squares: fp32 lane accumulators over blocks of 4096 elements (error
// grows with the block, not the buffer), block sums added in double.
static double sumsq_range(const void* src, int dt, int64_t begin, int64_t end) {
  constexpr int64_t kBlock = 4096;
  double total = 0.0;
  for (int64_t b = begin; b < end; b += kBlock) {
    const int64_t e = b + kBlock < end ? b + kBlock : end;
    KV acc = KV::set1(0.0f);
    int64_t i = b;
    for (; i + KV::W <= e; i += KV::W) {
      KV x = load_as_f32<KV>(src, dt, i);
      acc = acc + x * x;
    }
    float s = KV::hsum(acc);
    for (; i < e; ++i) {
      SVec x = load_as_f32<SVec>(src, dt, i);
      s += x.v * x.v;
    }
    total += (double)s;
  }
  return total;
}

static int nonfinite_range(const void* src, int dt, float scale, int64_t begin, int64_t end) {
  const bool scaled = scale != 1.0f;
  int64_t i = begin;
  for (; i + KV::W <= end; i += KV::W) {
    KV x = load_as_f32<KV>(src, dt, i);
    if (scaled) x = x * KV::set1(scale);
    if (KV::any_nonfinite(x)) return 1;
  }
  for (; i < end; ++i) {
    SVec x = load_as_f32<SVec>(src, dt, i);
    if (scaled) x = x * SVec::set1(scale);
    if (SVec::any_nonfinite(x)) return 1;
  }
  return 0;
}

static const capstan::KernelTable kTable = {
    KERNEL_TABLE_NAME, adam_range, cast_range, sum_range, sumsq_range, nonfinite_range, adam_q8_range,
};
