// One-lane "vector" type: lets kernels_body.h serve as the scalar kernels and
// as the tail loop of every SIMD kernel, so each formula is written once.
#pragma once

#include "internal.h"

struct SVec {
  float v;
  static constexpr int W = 1;
  static SVec set1(float x) { return {x}; }
  static SVec load(const float* p) { return {*p}; }
  static SVec load_bf16(const uint16_t* p) { return {capstan::bf16_to_f32(*p)}; }
  static SVec load_f16(const uint16_t* p) { return {capstan::f16_to_f32(*p)}; }
  static void store(float* p, SVec a) { *p = a.v; }
  static void store_bf16(uint16_t* p, SVec a) { *p = capstan::f32_to_bf16(a.v); }
  static void store_f16(uint16_t* p, SVec a) { *p = capstan::f32_to_f16(a.v); }
  // Stochastic rounding of element i (capstan::f32_to_bf16_sr).
  static void store_bf16_sr(uint16_t* p, SVec a, uint32_t key, int64_t i) {
    *p = capstan::f32_to_bf16_sr(a.v, key, i);
  }
  // No non-temporal stores in the scalar unit: plain stores, no fence.
  static void stream2(float* p, SVec a, SVec b) { store(p, a); store(p + 1, b); }
  static void stream2_bf16(uint16_t* p, SVec a, SVec b) { store_bf16(p, a); store_bf16(p + 1, b); }
  static void stream2_f16(uint16_t* p, SVec a, SVec b) { store_f16(p, a); store_f16(p + 1, b); }
  static void fence() {}
  static SVec sqrt(SVec a) { return {__builtin_sqrtf(a.v)}; }
  // Exact fused multiply-add: one instruction in the AVX units (-mfma), libm's
  // correctly rounded fmaf in the scalar unit; same result either way.
  static SVec fma(SVec a, SVec b, SVec c) { return {__builtin_fmaf(a.v, b.v, c.v)}; }
  // Sum of the lanes (one lane here).
  static float hsum(SVec a) { return a.v; }
  // True if any lane is inf or NaN.
  static bool any_nonfinite(SVec a) {
    return (capstan::f32_bits(a.v) & 0x7f800000u) == 0x7f800000u;
  }
};
static inline SVec operator+(SVec a, SVec b) { return {a.v + b.v}; }
static inline SVec operator-(SVec a, SVec b) { return {a.v - b.v}; }
static inline SVec operator*(SVec a, SVec b) { return {a.v * b.v}; }
static inline SVec operator/(SVec a, SVec b) { return {a.v / b.v}; }
