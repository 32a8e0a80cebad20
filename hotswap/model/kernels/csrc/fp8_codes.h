// Decoding float8 e4m3fn codes (FP8 weights, fp8_linear.cpp; the FP8 KV cache,
// paged_attention.cpp) into float32 vectors.
//
// A code: its 7 magnitude bits placed at bits 13..7 of a float16 become that
// float16's exponent and top mantissa bits, and the sign goes to bit 15; the float16 then
// equals the e4m3 value times 2^-8 exactly, subnormals included (both formats' subnormals
// scale alike). The CPU's float16 -> float32 conversion widens a vector of them at once,
// and the 2^8 is folded into the scale the values are multiplied by.
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

}  // namespace hotswap
