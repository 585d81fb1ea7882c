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
  // Stochastic rounding with the random bits r16 (capstan::f32_to_bf16_sr).
  static void store_bf16_sr(uint16_t* p, SVec a, uint32_t r16) { *p = capstan::f32_to_bf16_sr(a.v, r16); }
  static void store_bf16_sr2(uint16_t* p, SVec a, SVec b, uint32_t ra, uint32_t rb) {
    store_bf16_sr(p, a, ra);
    store_bf16_sr(p + 1, b, rb);
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
  static SVec max(SVec a, SVec b) { return {a.v > b.v ? a.v : b.v}; }  // maxps's operand order
  static SVec abs(SVec a) { return {capstan::bits_f32(capstan::f32_bits(a.v) & 0x7fffffffu)}; }
  static float hmax(SVec a) { return a.v; }
  // 8-bit moment codes in format F (capstan::Q8Format: its mantissa bits and sign).
  template <class F>
  static SVec load_q8(const uint8_t* p) {
    constexpr bool S = F::is_signed;
    const uint32_t c = *p;
    const float f = capstan::q8_decode_mag<F>(S ? c & 0x7fu : c);
    return {capstan::bits_f32(capstan::f32_bits(f) | (S ? (c & 0x80u) << 24 : 0u))};
  }
  // Random words: sr_hash(key + i); the two moments take one each half (hi16, lo16).
  using Bits = uint32_t;
  static Bits hash_lanes(uint32_t key, int64_t i) { return capstan::sr_hash(key + (uint32_t)i); }
  static Bits hi16(Bits r) { return r >> 16; }
  static Bits lo16(Bits r) { return r & 0xffffu; }
  // y in [-1, 1] (signed) or [0, 1], rounded with the 16 random bits r16 (capstan::q8_encode_mag).
  template <class F>
  static Bits encode_q8(SVec y, Bits r16) {
    constexpr bool S = F::is_signed;
    const uint32_t u = capstan::f32_bits(y.v);
    uint32_t c = capstan::q8_encode_mag<F>(capstan::bits_f32(u & 0x7fffffffu), r16);
    if (S) c |= (u >> 24) & 0x80u;
    return c;
  }
  template <class F>
  static void store_q8_sr(uint8_t* p, SVec y, Bits r16) { *p = (uint8_t)encode_q8<F>(y, r16); }
  static void store_codes4(uint8_t* p, Bits c0, Bits c1, Bits c2, Bits c3) {
    p[0] = (uint8_t)c0;
    p[1] = (uint8_t)c1;
    p[2] = (uint8_t)c2;
    p[3] = (uint8_t)c3;
  }
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
