// Internal declarations shared by the translation units of libcapstan.
//
// Everything here is either a plain struct or a `static inline` function:
// the per-ISA translation units are compiled with different -m flags, and a
// non-static inline function would be an ODR-merged symbol that the linker
// may pick from the AVX-512 unit for every caller (SIGILL on older CPUs).
#pragma once

#include <stdint.h>
#include <string.h>

#include "capstan.h"

namespace capstan {

// Scalars of one Adam step, precomputed once per call in double and rounded
// to float exactly where torch.optim's single-tensor AdamW rounds them (a
// Python float becomes a float32 scalar inside the ATen kernel).
struct AdamArgs {
  void* p;            // the parameter: fp32, or a bf16 master (pdt) stored with stochastic rounding
  const void* g;
  void* m;            // moments: fp32, or bf16 (mdt) stored with stochastic rounding
  void* v;
  void* out;
  int gdt, odt, mdt, pdt;
  uint32_t key_m;      // stochastic rounding: the hash stream of both moments (from the call's seed)
  uint32_t key_p;      // and the bf16 parameter's stream (another hash of the seed)
  float grad_scale;   // multiply grads by this (1/loss_scale)
  int unscale;        // grad_scale != 1
  int adamw;          // decoupled weight decay
  int has_wd;
  float decay;        // AdamW: 1 - lr*wd
  float wd;           // Adam: L2 coefficient added to the grad
  float w1;           // lerp weight 1 - beta1
  int lerp_hi;        // ATen lerp takes its second formula when weight >= 0.5
  float w1m1;         // w1 - 1, only for lerp_hi
  float b2, c2;       // beta2, 1 - beta2
  float bc2_sqrt;     // sqrt(1 - beta2^step)
  float eps;
  float neg_step;     // -lr / (1 - beta1^step)
  // 8-bit and bf16 moments: the same update with sqrt(1 - beta2^step) moved out of the denominator
  // (p + neg_step_r * m / (sqrt(v) + eps_r)), one division a value instead of two.
  float neg_step_r;   // neg_step * sqrt(1 - beta2^step)
  float eps_r;        // eps * sqrt(1 - beta2^step)
};

// 8-bit moments (capstan_adam_step_q8): the buffers of one call, cut into segments (one parameter
// each) and each segment into blocks of `block` elements (the last one short) with one fp32 scale
// per block and moment. Block ids run over all segments in order; scale k belongs to block id k.
struct AdamQ8Args {
  AdamArgs a;              // a.m / a.v: the uint8 codes; a.mdt unused
  float* scale_m;          // absmax of exp_avg in each block
  float* scale_v;          // max of sqrt(exp_avg_sq) in each block
  int64_t block;
  int nseg;
  const int64_t* seg_offset;  // where segment k starts in the buffers
  const int64_t* seg_numel;
  const int64_t* seg_index;   // its first element's canonical index (the rounding's random bits)
  const int64_t* seg_first_block;  // block id of its first block; [nseg] = the total
};
constexpr int64_t kQ8MaxBlock = 4096;

// ---- the 8-bit codes ----
// A code is a small float relative to its block's scale: E exponent bits and M mantissa bits, with the
// top binade's first value 1.0 (the scale itself), subnormals below 2^-(2^E - 2), and zero. exp_avg
// takes a sign bit and E4M3 (values down to 2^-17 of the block's absmax); exp_avg_sq stores
// sqrt(exp_avg_sq) as unsigned E4M4 (2^-18 of the block's max): the square root halves the second
// moment's dynamic range, and is what the update divides by. Codes above 1.0 are never produced.
// A code with an exponent keeps small moments from flushing to zero, as the dynamic quantization of
// Dettmers et al. 2022 ("8-bit optimizers via block-wise quantization") does with a lookup table;
// here encoding and decoding are a few integer operations per lane.
template <int E, int M, bool S>
struct Q8Format {
  static constexpr int mbits = M;
  static constexpr bool is_signed = S;  // a sign bit above the E + M magnitude bits
  static constexpr int emin = (1 << E) - 2;                    // smallest normal: 2^-emin
  static constexpr uint32_t min_normal_bits = (uint32_t)(127 - emin) << 23;
  static constexpr uint32_t bias = (uint32_t)(127 - ((1 << E) - 1));  // fp32 exponent - code exponent
  static constexpr uint32_t mag_max = (uint32_t)(((1 << E) - 1) << M);  // the code of 1.0
  static constexpr float sub_unit() { return 1.0f / (float)(1u << (emin + M)); }
  static constexpr float min_normal() { return 1.0f / (float)(1u << emin); }
  // With E = 4 the bias is fp16's (15) and the code is the top 1 + E + M bits of the value's fp16 pattern
  // below its sign: code << fp16_shift is that pattern (the vector decoders convert it with F16C). 0: not so.
  static constexpr int fp16_shift = (E == 4 && bias == 127 - 15) ? 10 - M : 0;
};
using Q8M = Q8Format<4, 3, true>;
using Q8V = Q8Format<4, 4, false>;

// One instruction set's kernels, each over the element range [begin, end).
// The thread pool (threadpool.cc) splits a call into ranges; api.cc validates.
struct KernelTable {
  const char* name;
  void (*adam)(const AdamArgs* a, int64_t begin, int64_t end);
  // stream != 0: non-temporal stores in the vector loop (large casts only).
  void (*cast)(const void* src, int sdt, void* dst, int ddt, int64_t begin, int64_t end,
               int stream);
  void (*sum)(void* dst, int ddt, const void* const* srcs, int nsrc, int sdt, int64_t begin,
              int64_t end);
  double (*sumsq)(const void* src, int dt, int64_t begin, int64_t end);
  // 1 if any element * scale is inf or NaN.
  int (*nonfinite)(const void* src, int dt, float scale, int64_t begin, int64_t end);
  // Adam with 8-bit moments over the block ids [begin, end) (AdamQ8Args).
  void (*adam_q8)(const AdamQ8Args* q, int64_t begin, int64_t end);
};

const KernelTable* kernels_scalar();
const KernelTable* kernels_avx2();
const KernelTable* kernels_avx512();
const KernelTable* kernels_avx512bf16();
const KernelTable* active_kernels();

// ---- thread pool (threadpool.cc) ----
// fn(ctx, begin, end, chunk) runs on every chunk of [0, n); chunk < num_chunks.
using RangeFn = void (*)(void* ctx, int64_t begin, int64_t end, int chunk);
// Splits [0, n) into at most pool_size() chunks of at least `grain` elements,
// chunk boundaries multiple of 64 elements (whole cache lines, whole vectors).
// Returns the number of chunks used.
int parallel_for(int64_t n, int64_t grain, RangeFn fn, void* ctx);
int pool_size();
void pool_resize(int n);

// ---- scalar conversions, bit-identical to c10::BFloat16 / c10::Half ----
static inline uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
static inline float bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
// The integer hash behind stochastic rounding (Wellons' "lowbias32": two
// multiply-xorshift rounds, full avalanche). Each ISA applies these same
// 32-bit operations lane by lane, so a random bit never depends on the ISA.
static inline uint32_t sr_hash(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}
// fp32 -> bf16 with stochastic rounding: add 16 random bits (r16 < 2^16) below
// the kept ones and truncate, so x rounds up with probability (its distance
// from the lower bf16) / (the bf16 step) and the rounding is unbiased. Adam's
// bf16 moments take one sr_hash(key + index) word per element, its top half
// for exp_avg and its low half for exp_avg_sq (as the 8-bit codes do). NaN
// becomes 0xFFFF as in f32_to_bf16; inf stays inf (its low half is zero, the
// carry never reaches the exponent).
static inline uint16_t f32_to_bf16_sr(float f, uint32_t r16) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0xFFFFu;
  return (uint16_t)((u + r16) >> 16);
}
static inline float bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }
// Round to nearest even on the bit pattern. Every NaN becomes 0xFFFF: that is
// what torch's AVX2/AVX-512 conversion (ATen cvtfp32_bf16) writes, so the
// result is bit-identical to x.to(torch.bfloat16) on every CPU our SIMD paths
// run on. (torch's scalar c10::BFloat16 path writes 0x7FC0 instead.)
static inline uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0xFFFFu;
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
// IEEE half <-> float by the FP16 library's bit tricks (the code c10::Half
// uses), exact for every input; needs strict IEEE float ops (-ffp-contract=off).
static inline float f16_to_f32(uint16_t h) {
  const uint32_t w = (uint32_t)h << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const uint32_t exp_offset = 0xE0u << 23;
  const float normalized = bits_f32((two_w >> 4) + exp_offset) * 0x1.0p-112f;
  const uint32_t magic_mask = 126u << 23;
  const float denormalized = bits_f32((two_w >> 17) | magic_mask) - 0.5f;
  const uint32_t cutoff = 1u << 27;
  return bits_f32(sign | (two_w < cutoff ? f32_bits(denormalized) : f32_bits(normalized)));
}
static inline uint16_t f32_to_f16(float f) {
  float base = (__builtin_fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = f32_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = bits_f32((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = f32_bits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  // NaN: keep the top payload bits and make it quiet, like vcvtps2ph.
  const uint32_t nan = 0x7E00u | ((w & 0x007fffffu) >> 13);
  return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? nan : nonsign));
}

// Decode a magnitude code to fp32 (exact).
template <class F>
static inline float q8_decode_mag(uint32_t mag) {
  constexpr int M = F::mbits;
  if ((mag >> M) == 0) return (float)(int32_t)mag * F::sub_unit();
  uint32_t bits = (mag << (23 - M)) + (F::bias << 23);
  float f;
  memcpy(&f, &bits, 4);
  return f;
}
// Encode y in [0, 1] with stochastic rounding from 16 random bits r16: add them at the top of the
// 23 - M mantissa bits the code drops and truncate, so y rounds up with probability (its distance from
// the code below, to 16 bits) / (the gap), unbiased; the carry may step into the next binade, as it
// should. A subnormal y (below 2^-emin) is first offset by 2^-emin into the smallest normal binade,
// whose grid spacing is the subnormals', rounded there, and the offset's code (1 << M) taken off again.
// min(., mag_max) keeps a NaN's code in range.
template <class F>
static inline uint32_t q8_encode_mag(float y, uint32_t r16) {
  constexpr int M = F::mbits;
  uint32_t off = 0;
  if (f32_bits(y) < F::min_normal_bits) {
    y = y + F::min_normal();
    off = 1u << M;
  }
  const uint32_t c = ((f32_bits(y) + (r16 << (7 - M))) >> (23 - M)) - (F::bias << M) - off;
  return c < F::mag_max ? c : F::mag_max;
}

// A block's scale from the max of its magnitudes: below FLT_MIN the block is stored as zeros (its
// reciprocal would overflow); NaN stays NaN, so a broken moment decodes as NaN, never as a number.
static inline float q8_scale(float max_abs) { return max_abs < 0x1p-126f ? 0.0f : max_abs; }
// What the block's values are multiplied by before encoding: 1 / scale, raised by one ulp where
// scale * (1 / scale) < 1, so the block's largest value encodes exactly as 1.0 (the top code). Then a
// block's dequantized values, encoded again to nearest against their max, give back the same codes
// and scale (checkpoints rely on it). 1 for a zero (or NaN) scale.
static inline float q8_inverse(float scale) {
  if (!(scale > 0.0f)) return 1.0f;
  const float inv = 1.0f / scale;
  return inv * scale < 1.0f ? bits_f32(f32_bits(inv) + 1u) : inv;
}

}  // namespace capstan
