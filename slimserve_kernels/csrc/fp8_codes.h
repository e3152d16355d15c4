// FP8 (e4m3) codes of the paged KV cache: decoding rows of codes to fp32 (exactly, three
// instruction-set copies) and quantizing a row into codes with a power-of-two scale, bit for
// bit as slimserve_kernels/reference.py does.
#pragma once

#include <c10/util/Float8_e4m3fn.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "vec16.h"

namespace {

// The value of an e4m3 code times 2**-8, exactly (fp8_values' entry / 256, tested for all 256
// codes), in branch-free integer arithmetic that vectorizes (a table lookup is a gather per
// element): a normal code's exponent and mantissa fields move into fp32's and the bias goes
// from 7 to 127 + 8; a subnormal one is mantissa * 2**-17; exponent and mantissa all ones is
// NaN. The 2**-8 is the AVX copies' unit (fp8_rows_avx512): the 256 goes back in with the
// per-token scale, a power of two, so products and sums round as with the exact values.
__attribute__((always_inline)) inline float e4m3_unit(uint8_t code) {
  const uint32_t mag = code & 0x7Fu, sign = static_cast<uint32_t>(code & 0x80u) << 24;
  const uint32_t normal = (mag << 20) + (112u << 23);
  const float subnormal = static_cast<float>(static_cast<int32_t>(mag & 7u)) * 0x1p-17f;
  // All-ones / all-zeros masks, not ternaries: GCC left the ternary form scalar here.
  const uint32_t is_normal = 0u - static_cast<uint32_t>(mag >= 8u);
  const uint32_t is_nan = 0u - static_cast<uint32_t>(mag == 0x7Fu);
  uint32_t bits = (normal & is_normal) | (bits_as<uint32_t>(subnormal) & ~is_normal);
  bits = (0x7FC00000u & is_nan) | (bits & ~is_nan);
  return bits_as<float>(bits | sign);
}

constexpr float kFp8Unit = 256.0f;  // an FP8 tile holds value * 2**-8 (e4m3_unit)

// dst[t * d + i] = e4m3_unit(src[t * stride + i]) for t < n, i < d: n FP8 rows of a block.
// Baseline copy: the integer decode above, vectorized by GCC.
void fp8_rows_baseline(const uint8_t* __restrict src, int64_t stride, int64_t n, int64_t d,
                       float* __restrict dst) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t i = 0; i < d; ++i) dst[t * d + i] = e4m3_unit(src[t * stride + i]);
}

// AVX copies: an e4m3 code moved into fp16's fields is the fp16 of its value * 2**-8
// (sign to bit 15, exponent and mantissa to bits 7..13: bias 7 against fp16's 15, and a
// subnormal code lands on the fp16 subnormal with the same mantissa), which the hardware
// widens exactly (vcvtph2ps, subnormals included); a sign-extended code shifted left by 7
// and masked with 0xBF80 is that fp16. Exponent and mantissa all ones become an fp16 NaN.
// 3 integer ops and 2 conversions per 32 codes against ~12 ops per 16 in the baseline form.
__attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,f16c")))
void fp8_rows_avx512(const uint8_t* __restrict src, int64_t stride, int64_t n, int64_t d,
                     float* __restrict dst) {
  const __m512i fields = _mm512_set1_epi16(static_cast<int16_t>(0xBF80));
  const __m512i all_ones = _mm512_set1_epi16(0x3F80), nan = _mm512_set1_epi16(0x7E00);
  for (int64_t t = 0; t < n; ++t) {
    const uint8_t* s = src + t * stride;
    float* o = dst + t * d;
    int64_t i = 0;
    for (; i + 32 <= d; i += 32) {
      __m512i h = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i)));
      h = _mm512_and_si512(_mm512_slli_epi16(h, 7), fields);
      const __mmask32 is_nan = _mm512_cmpeq_epi16_mask(_mm512_and_si512(h, all_ones), all_ones);
      h = _mm512_mask_mov_epi16(h, is_nan, nan);
      _mm512_storeu_ps(o + i, _mm512_cvtph_ps(_mm512_castsi512_si256(h)));
      _mm512_storeu_ps(o + i + 16, _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)));
    }
    for (; i < d; ++i) o[i] = e4m3_unit(s[i]);
  }
}

__attribute__((target("avx2,fma,f16c")))
void fp8_rows_avx2(const uint8_t* __restrict src, int64_t stride, int64_t n, int64_t d,
                   float* __restrict dst) {
  const __m256i fields = _mm256_set1_epi16(static_cast<int16_t>(0xBF80));
  const __m256i all_ones = _mm256_set1_epi16(0x3F80), nan = _mm256_set1_epi16(0x7E00);
  for (int64_t t = 0; t < n; ++t) {
    const uint8_t* s = src + t * stride;
    float* o = dst + t * d;
    int64_t i = 0;
    for (; i + 16 <= d; i += 16) {
      __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
      h = _mm256_and_si256(_mm256_slli_epi16(h, 7), fields);
      const __m256i is_nan = _mm256_cmpeq_epi16(_mm256_and_si256(h, all_ones), all_ones);
      h = _mm256_blendv_epi8(h, nan, is_nan);
      _mm256_storeu_ps(o + i, _mm256_cvtph_ps(_mm256_castsi256_si128(h)));
      _mm256_storeu_ps(o + i + 8, _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
    }
    for (; i < d; ++i) o[i] = e4m3_unit(s[i]);
  }
}

// reference.fp8_scale_exponent for one row: e = ceil(log2(amax / 448)) from amax = m * 2**E
// (m in [0.5, 1), 448 = 0.875 * 2**9), amax floored at 2**-100, e clamped to [-100, 127].
int8_t fp8_exponent(const float* x, int64_t d) {
  float amax = 0.0f;
  for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::fabs(x[i]));
  int big_e;
  const float m = std::frexp(std::max(amax, 0x1p-100f), &big_e);
  return static_cast<int8_t>(std::clamp(big_e - 9 + (m > 0.875f ? 1 : 0), -100, 127));
}

// reference.quantize_fp8 of one row into the cache: x * 2**-e clamped to +-448, cast with
// c10's own float -> e4m3fn rounding (what the reference's .to() does).
void quantize_row(const float* x, int64_t d, uint8_t* dst, int8_t* e_dst) {
  const int8_t e = fp8_exponent(x, d);
  const float inv = exp2i(-e);
  for (int64_t i = 0; i < d; ++i) {
    const float y = std::clamp(x[i] * inv, -448.0f, 448.0f);
    dst[i] = c10::Float8_e4m3fn(y).x;
  }
  *e_dst = e;
}

}  // namespace
