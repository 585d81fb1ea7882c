// 16-lane float vector for AVX-512 F/BW/VL (+F16C for the half conversions).
// Compiled only into kernels_avx512.cc and kernels_avx512bf16.cc.
//
// bf16 stores use integer round-to-nearest-even (6 integer ops per 16 lanes).
// kernels_avx512bf16.cc defines CAPSTAN_AVX512_BF16_HW and converts with
// AVX512_BF16's vcvtne(2)ps2bf16 instead, the same rounding in one
// instruction, except on two kinds of input: it flushes denormals to zero and
// keeps NaN payloads, where torch's .to(torch.bfloat16) rounds denormals and
// writes 0xFFFF for NaN. A vector holding either (one vfpclassps test) takes
// the integer path, so both ISAs give the same bits; on this project's VM the
// instruction (with the 2 KiB prefetch) lifts a large fp32->bf16 cast from ~72% to 81-85% of memcpy.
#pragma once

#include <immintrin.h>

#include "internal.h"

struct VVec {
  __m512 v;
  static constexpr int W = 16;
  static VVec set1(float x) { return {_mm512_set1_ps(x)}; }
  static VVec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static VVec load_bf16(const uint16_t* p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
  }
  static VVec load_f16(const uint16_t* p) {
    return {_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p))};
  }
  static void store(float* p, VVec a) { _mm512_storeu_ps(p, a.v); }
  static void store_bf16(uint16_t* p, VVec a) { _mm256_storeu_si256((__m256i*)p, to_bf16(a)); }
  static __m256i to_bf16(VVec a) {
#ifdef CAPSTAN_AVX512_BF16_HW
    if (__builtin_expect(!special_bf16(a), 1)) return (__m256i)_mm512_cvtneps_pbh(a.v);
#endif
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_bf16(a), 16));
  }
#ifdef CAPSTAN_AVX512_BF16_HW
  // Any lane the instruction would convert differently from torch: a denormal, quiet or signaling NaN.
  static bool special_bf16(VVec a) { return _mm512_fpclass_ps_mask(a.v, 0x20 | 0x01 | 0x80) != 0; }
#endif
  // Integer round-to-nearest-even (same bits as capstan::f32_to_bf16), result
  // in the high 16 bits of each lane: u + 0x7fff + ((u >> 16) & 1); NaN
  // (unordered with itself) becomes 0xFFFF.
  static __m512i round_bf16(VVec a) {
    __m512i u = _mm512_castps_si512(a.v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
    __mmask16 isnan = _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q);
    return _mm512_mask_mov_epi32(r, isnan, _mm512_set1_epi32(-1));
  }
  // sr_hash(key + i + lane) for lanes 0..15: the random words of elements i..i+15.
  static __m512i hash_lanes(uint32_t key, int64_t i) {
    __m512i x = _mm512_add_epi32(_mm512_set1_epi32((int)(key + (uint32_t)i)),
                                 _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7feb352d));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32((int)0x846ca68bu));
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  }
  // Stochastic rounding with the random bits r16 per lane: the lane-wise form of capstan::f32_to_bf16_sr.
  static void store_bf16_sr(uint16_t* p, VVec a, __m512i r16) {
    __m512i r = _mm512_add_epi32(_mm512_castps_si512(a.v), r16);
    __mmask16 isnan = _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, isnan, _mm512_set1_epi32(-1));
    _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
  }
  static void store_bf16_sr2(uint16_t* p, VVec a, VVec b, __m512i ra, __m512i rb) {
    store_bf16_sr(p, a, ra);
    store_bf16_sr(p + W, b, rb);
  }
  // 8-bit moment codes: the lane-wise forms of SVec::load_q8 / store_q8_sr; decoded through fp16, as
  // simd_avx2.h explains.
  template <class F>
  static VVec load_q8(const uint8_t* p) {
    static_assert(F::fp16_shift > 0, "a code format that is not a truncated fp16");
    __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p));
    if (F::is_signed) c = _mm256_add_epi16(c, _mm256_and_si256(c, _mm256_set1_epi16(0x80)));  // the sign to bit 8
    return {_mm512_cvtph_ps(_mm256_slli_epi16(c, F::fp16_shift))};
  }
  using Bits = __m512i;
  static Bits hi16(Bits r) { return _mm512_srli_epi32(r, 16); }
  static Bits lo16(Bits r) { return _mm512_and_si512(r, _mm512_set1_epi32(0xffff)); }
  // The codes of y (lane-wise capstan::q8_encode_mag plus the sign) as 32-bit lanes.
  template <class F>
  static Bits encode_q8(VVec y, Bits r16) {
    constexpr int M = F::mbits;
    constexpr bool S = F::is_signed;
    __m512i raw = _mm512_castps_si512(y.v);
    __m512i u = _mm512_and_si512(raw, _mm512_set1_epi32(0x7fffffff));
    __mmask16 small = _mm512_cmplt_epi32_mask(u, _mm512_set1_epi32((int)F::min_normal_bits));
    __m512 au = _mm512_castsi512_ps(u);
    __m512 z = _mm512_mask_add_ps(au, small, au, _mm512_set1_ps(F::min_normal()));
    __m512i c = _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(z), _mm512_slli_epi32(r16, 7 - M)), 23 - M);
    c = _mm512_sub_epi32(c, _mm512_set1_epi32((int)(F::bias << M)));
    c = _mm512_mask_sub_epi32(c, small, c, _mm512_set1_epi32(1 << M));
    c = _mm512_min_epu32(c, _mm512_set1_epi32((int)F::mag_max));
    if (S) c = _mm512_or_si512(c, _mm512_and_si512(_mm512_srli_epi32(raw, 24), _mm512_set1_epi32(0x80)));
    return c;
  }
  template <class F>
  static void store_q8_sr(uint8_t* p, VVec y, Bits r16) {
    _mm_storeu_si128((__m128i*)p, _mm512_cvtepi32_epi8(encode_q8<F>(y, r16)));
  }
  // Four vectors of codes (each lane 0..255) as 4W bytes in order (vpmovdb narrows each in one).
  static void store_codes4(uint8_t* p, Bits c0, Bits c1, Bits c2, Bits c3) {
    _mm_storeu_si128((__m128i*)p, _mm512_cvtepi32_epi8(c0));
    _mm_storeu_si128((__m128i*)(p + W), _mm512_cvtepi32_epi8(c1));
    _mm_storeu_si128((__m128i*)(p + 2 * W), _mm512_cvtepi32_epi8(c2));
    _mm_storeu_si128((__m128i*)(p + 3 * W), _mm512_cvtepi32_epi8(c3));
  }
  static void store_f16(uint16_t* p, VVec a) {
    _mm256_storeu_si256((__m256i*)p, to_f16(a));
  }
  // Non-temporal stores for large casts: the destination lines are written
  // whole without being read first (no write-allocate). p must be 64-byte
  // aligned; fence() after a run.
  // The stream2 forms write 2*W elements: one whole 64-byte line per store.
  static void stream2(float* p, VVec a, VVec b) {
    _mm512_stream_ps(p, a.v);
    _mm512_stream_ps(p + W, b.v);
  }
  static void stream2_bf16(uint16_t* p, VVec a, VVec b) {
#ifdef CAPSTAN_AVX512_BF16_HW
    // vcvtne2ps2bf16 puts its second operand in the low half: b, a gives a's lanes first.
    if (__builtin_expect(!special_bf16(a) && !special_bf16(b), 1)) {
      _mm512_stream_si512((__m512i*)p, (__m512i)_mm512_cvtne2ps_pbh(b.v, a.v));
      return;
    }
#endif
    // One vpermt2w gathers the 32 high halves of a's and b's lanes, in order.
    const __m512i odd = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33,
                                         31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    _mm512_stream_si512((__m512i*)p, _mm512_permutex2var_epi16(round_bf16(a), odd, round_bf16(b)));
  }
  static void stream2_f16(uint16_t* p, VVec a, VVec b) {
    _mm512_stream_si512((__m512i*)p, _mm512_inserti64x4(_mm512_castsi256_si512(to_f16(a)), to_f16(b), 1));
  }
  static void fence() { _mm_sfence(); }
  static __m256i to_f16(VVec a) {
    return _mm512_cvtps_ph(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static VVec fma(VVec a, VVec b, VVec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  static VVec sqrt(VVec a) { return {_mm512_sqrt_ps(a.v)}; }
  static VVec max(VVec a, VVec b) { return {_mm512_max_ps(a.v, b.v)}; }
  static VVec abs(VVec a) { return {_mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a.v), _mm512_set1_epi32(0x7fffffff)))}; }
  static float hmax(VVec a) {
    __m256 s8 = _mm256_max_ps(_mm512_castps512_ps256(a.v),
                              _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1)));
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
  }
  static float hsum(VVec a) {
    // Fixed pairwise order (not _mm512_reduce_add_ps, whose order is unspecified).
    __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(a.v),
                              _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1)));
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
  }
  static bool any_nonfinite(VVec a) {
    __m512i e = _mm512_and_si512(_mm512_castps_si512(a.v), _mm512_set1_epi32(0x7f800000));
    return _mm512_cmpeq_epi32_mask(e, _mm512_set1_epi32(0x7f800000)) != 0;
  }
};
static inline VVec operator+(VVec a, VVec b) { return {_mm512_add_ps(a.v, b.v)}; }
static inline VVec operator-(VVec a, VVec b) { return {_mm512_sub_ps(a.v, b.v)}; }
static inline VVec operator*(VVec a, VVec b) { return {_mm512_mul_ps(a.v, b.v)}; }
static inline VVec operator/(VVec a, VVec b) { return {_mm512_div_ps(a.v, b.v)}; }
