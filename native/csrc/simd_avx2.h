// 8-lane float vector for AVX2 + FMA + F16C. Compiled only into
// kernels_avx2.cc (the only unit built with -mavx2 -mfma -mf16c).
#pragma once

#include <immintrin.h>

#include "internal.h"

struct VVec {
  __m256 v;
  static constexpr int W = 8;
  static VVec set1(float x) { return {_mm256_set1_ps(x)}; }
  static VVec load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static VVec load_bf16(const uint16_t* p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(w, 16))};
  }
  static VVec load_f16(const uint16_t* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p))};
  }
  static void store(float* p, VVec a) { _mm256_storeu_ps(p, a.v); }
  // Integer round-to-nearest-even, same bits as capstan::f32_to_bf16.
  static void store_bf16(uint16_t* p, VVec a) { _mm_storeu_si128((__m128i*)p, to_bf16(a)); }
  static __m128i to_bf16(VVec a) {
    __m256i u = _mm256_castps_si256(a.v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    __m256i nan = _mm256_set1_epi32(0xFFFF);  // see capstan::f32_to_bf16
    __m256i isnan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                       _mm256_set1_epi32(0x7f800000));
    r = _mm256_blendv_epi8(r, nan, isnan);
    // packus works per 128-bit lane: [r0..3 r0..3 | r4..7 r4..7]; gather lanes 0 and 2.
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
    return _mm256_castsi256_si128(packed);
  }
  // sr_hash(key + i + lane) for lanes 0..7: the random words of elements i..i+7.
  static __m256i hash_lanes(uint32_t key, int64_t i) {
    __m256i x = _mm256_add_epi32(_mm256_set1_epi32((int)(key + (uint32_t)i)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7feb352d));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32((int)0x846ca68bu));
    return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  }
  // Stochastic rounding with the random bits r16 per lane: the lane-wise form of capstan::f32_to_bf16_sr.
  static void store_bf16_sr(uint16_t* p, VVec a, __m256i r16) {
    __m256i r = round_sr(a, r16);
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
    _mm_storeu_si128((__m128i*)p, _mm256_castsi256_si128(packed));
  }
  // Two vectors (a at p, b at p + 8) in one pack and one store.
  static void store_bf16_sr2(uint16_t* p, VVec a, VVec b, __m256i ra, __m256i rb) {
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(round_sr(a, ra), round_sr(b, rb)), 0xD8);
    _mm256_storeu_si256((__m256i*)p, packed);
  }
  // The rounded bf16 patterns as 32-bit lanes, NaN as 0xFFFF.
  static __m256i round_sr(VVec a, __m256i r16) {
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(a.v), r16), 16);
    __m256i isnan = _mm256_castps_si256(_mm256_cmp_ps(a.v, a.v, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0xFFFF), isnan);
  }
  // 8-bit moment codes: the lane-wise forms of SVec::load_q8 / store_q8_sr. A code with a 4-bit exponent
  // (capstan::Q8Format) is an fp16 value with its low 10 - M mantissa bits dropped (the same exponent bias
  // and subnormals), so decoding is a shift into fp16 and F16C's exact conversion: 5 operations for 8
  // codes where the integer decode took 11 (the same values, bit for bit).
  template <class F>
  static VVec load_q8(const uint8_t* p) {
    static_assert(F::fp16_shift > 0, "a code format that is not a truncated fp16");
    __m128i c = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)p));
    if (F::is_signed) c = _mm_add_epi16(c, _mm_and_si128(c, _mm_set1_epi16(0x80)));  // the sign to bit 8
    return {_mm256_cvtph_ps(_mm_slli_epi16(c, F::fp16_shift))};
  }
  using Bits = __m256i;
  static Bits hi16(Bits r) { return _mm256_srli_epi32(r, 16); }
  static Bits lo16(Bits r) { return _mm256_and_si256(r, _mm256_set1_epi32(0xffff)); }
  // The codes of y (lane-wise capstan::q8_encode_mag plus the sign) as 32-bit lanes.
  template <class F>
  static Bits encode_q8(VVec y, Bits r16) {
    constexpr int M = F::mbits;
    constexpr bool S = F::is_signed;
    __m256i raw = _mm256_castps_si256(y.v);
    __m256i u = _mm256_and_si256(raw, _mm256_set1_epi32(0x7fffffff));
    __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)F::min_normal_bits), u);
    __m256 z = _mm256_add_ps(_mm256_castsi256_ps(u), _mm256_and_ps(_mm256_castsi256_ps(small),
                                                                   _mm256_set1_ps(F::min_normal())));
    __m256i c = _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(z), _mm256_slli_epi32(r16, 7 - M)), 23 - M);
    c = _mm256_sub_epi32(c, _mm256_set1_epi32((int)(F::bias << M)));
    c = _mm256_sub_epi32(c, _mm256_and_si256(small, _mm256_set1_epi32(1 << M)));
    c = _mm256_min_epu32(c, _mm256_set1_epi32((int)F::mag_max));
    if (S) c = _mm256_or_si256(c, _mm256_and_si256(_mm256_srli_epi32(raw, 24), _mm256_set1_epi32(0x80)));
    return c;
  }
  template <class F>
  static void store_q8_sr(uint8_t* p, VVec y, Bits r16) {
    __m256i c = encode_q8<F>(y, r16);
    __m256i w16 = _mm256_permute4x64_epi64(_mm256_packus_epi32(c, c), 0xD8);
    _mm_storel_epi64((__m128i*)p, _mm_packus_epi16(_mm256_castsi256_si128(w16), _mm256_castsi256_si128(w16)));
  }
  // Four vectors of codes (each lane 0..255) as 4W bytes in order: two packs to 16 bits and one to 8
  // leave each 128-bit half holding 4 codes of each vector in turn; one lane permute puts them in order
  // (4 shuffles per 32 codes where store_q8_sr takes 3 per 8).
  static void store_codes4(uint8_t* p, Bits c0, Bits c1, Bits c2, Bits c3) {
    __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(c0, c1), _mm256_packus_epi32(c2, c3));
    b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i*)p, b);
  }
  static void store_f16(uint16_t* p, VVec a) { _mm_storeu_si128((__m128i*)p, to_f16(a)); }
  static __m128i to_f16(VVec a) {
    return _mm256_cvtps_ph(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  // Non-temporal stores for large casts (see simd_avx512.h); p 32-byte aligned.
  static void stream2(float* p, VVec a, VVec b) {
    _mm256_stream_ps(p, a.v);
    _mm256_stream_ps(p + W, b.v);
  }
  static void stream2_bf16(uint16_t* p, VVec a, VVec b) {
    _mm256_stream_si256((__m256i*)p, _mm256_set_m128i(to_bf16(b), to_bf16(a)));
  }
  static void stream2_f16(uint16_t* p, VVec a, VVec b) {
    _mm256_stream_si256((__m256i*)p, _mm256_set_m128i(to_f16(b), to_f16(a)));
  }
  static void fence() { _mm_sfence(); }
  static VVec fma(VVec a, VVec b, VVec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
  static VVec sqrt(VVec a) { return {_mm256_sqrt_ps(a.v)}; }
  static VVec max(VVec a, VVec b) { return {_mm256_max_ps(a.v, b.v)}; }
  static VVec abs(VVec a) { return {_mm256_and_ps(a.v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)))}; }
  static float hmax(VVec a) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
  }
  static float hsum(VVec a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
  }
  static bool any_nonfinite(VVec a) {
    __m256i e = _mm256_and_si256(_mm256_castps_si256(a.v), _mm256_set1_epi32(0x7f800000));
    __m256i m = _mm256_cmpeq_epi32(e, _mm256_set1_epi32(0x7f800000));
    return !_mm256_testz_si256(m, m);
  }
};
static inline VVec operator+(VVec a, VVec b) { return {_mm256_add_ps(a.v, b.v)}; }
static inline VVec operator-(VVec a, VVec b) { return {_mm256_sub_ps(a.v, b.v)}; }
static inline VVec operator*(VVec a, VVec b) { return {_mm256_mul_ps(a.v, b.v)}; }
static inline VVec operator/(VVec a, VVec b) { return {_mm256_div_ps(a.v, b.v)}; }
