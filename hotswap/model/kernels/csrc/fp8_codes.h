// Decoding float8 codes into float32 vectors: e4m3fn (FP8 weights, fp8_linear.cpp; the FP8
// KV cache, paged_attention.cpp) and e5m2 (the KV cache with --kv-cache-dtype fp8_e5m2).
//
// e4m3fn:
// A code: its 7 magnitude bits placed at bits 13..7 of a float16 become that
// float16's exponent and top mantissa bits, and the sign goes to bit 15; the float16 then
// equals the e4m3 value times 2^-8 exactly, subnormals included (both formats' subnormals
// scale alike). The CPU's float16 -> float32 conversion widens a vector of them at once,
// and the 2^8 is folded into the scale the values are multiplied by.
//
// e5m2: a code is the high byte of the float16 of the same value (same exponent bias, two
// of float16's ten mantissa bits), so the code shifted left by 8 is that float16 exactly,
// subnormals, infinities and NaNs included: no factor to fold.
#pragma once

#include "common.h"

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace hotswap {

constexpr float kHalfShift = 256.f;  // 2^8: a decoded float16 is the code's value / 2^8

inline float code_value(uint8_t code) {  // the code's value / 2^8, exactly
  const uint16_t bits = static_cast<uint16_t>(((code & 0x80) << 8) | ((code & 0x7F) << 7));
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// kLanes codes as float32 (each the code's value / 2^8). Sign-extended to 16 bits and
// shifted left by 7, a code's sign lands on bit 15 (and a copy on bit 14, cleared) and its
// magnitude on bits 13..7.
inline FVec widen_codes(const uint8_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m256i c = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i half = _mm256_and_si256(_mm256_slli_epi16(c, 7), _mm256_set1_epi16(-0x4001));
  return FVec(_mm512_cvtph_ps(half));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m128i c = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i half = _mm_and_si128(_mm_slli_epi16(c, 7), _mm_set1_epi16(-0x4001));
  return FVec(_mm256_cvtph_ps(half));
#else
  float values[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) values[i] = code_value(p[i]);
  return FVec::loadu(values);
#endif
}

inline float e5m2_value(uint8_t code) {  // the code's value, exactly
  return static_cast<float>(c10::Half(static_cast<uint16_t>(code << 8), c10::Half::from_bits()));
}

// kLanes e5m2 codes as float32: zero-extended to 16 bits and shifted into the high byte.
inline FVec widen_e5m2(const uint8_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return FVec(_mm512_cvtph_ps(_mm256_slli_epi16(c, 8)));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m128i c = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return FVec(_mm256_cvtph_ps(_mm_slli_epi16(c, 8)));
#else
  float values[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) values[i] = e5m2_value(p[i]);
  return FVec::loadu(values);
#endif
}

// An FP8 KV cache's element type (c10::Float8_e4m3fn or c10::Float8_e5m2, one byte each):
// its codes decoded as float32 values / kShift, kShift to fold into the scales.
template <typename F>
struct Fp8Kv;
template <>
struct Fp8Kv<c10::Float8_e4m3fn> {
  static constexpr float kShift = kHalfShift;
  static float value(uint8_t code) { return code_value(code); }
  static FVec widen(const uint8_t* p) { return widen_codes(p); }
};
template <>
struct Fp8Kv<c10::Float8_e5m2> {
  static constexpr float kShift = 1.f;
  static float value(uint8_t code) { return e5m2_value(code); }
  static FVec widen(const uint8_t* p) { return widen_e5m2(p); }
};
template <typename C>
constexpr bool kIsFp8Kv = std::is_same_v<C, c10::Float8_e4m3fn> || std::is_same_v<C, c10::Float8_e5m2>;

}  // namespace hotswap
