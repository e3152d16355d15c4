// 16-lane float vectors (GCC/Clang vector extensions) and the bit helpers the CPU kernels
// share: loads and stores, lane reductions, the 16-key transpose-and-sum, a vector exp.
// Header-only, every function inline: each kernel is one translation unit (one extension
// module) compiled for three instruction sets by target attributes, and these inline into
// each copy with that copy's instructions.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

template <typename To, typename From>
__attribute__((always_inline)) inline To bits_as(From x) {  // std::bit_cast (C++20)
  To y;
  std::memcpy(&y, &x, sizeof(y));
  return y;
}

// 2**e exactly: from its bits where it is a normal float (e >= -126; every exponent kv_write
// stores, [-100, 127], and their negations but -127), else ldexp (a libm call).
__attribute__((always_inline)) inline float exp2i(int e) {
  return e >= -126 ? bits_as<float>(static_cast<uint32_t>(e + 127) << 23) : std::ldexp(1.0f, e);
}

// 16 floats as one vector value (GCC/Clang vector extension): one zmm in the AVX-512 copy, two
// ymm / four xmm in the others. Loops over `float acc[16]` arrays were left half scalar by
// GCC's vectorizer here (perf: scalar FMAs and stack round trips in the dot's sum and the V
// accumulation were most of a decode's kernel time).
typedef float Vec16 __attribute__((vector_size(64)));
typedef int32_t Vec16i __attribute__((vector_size(64)));
typedef float Vec8 __attribute__((vector_size(32)));
typedef float Vec4 __attribute__((vector_size(16)));

__attribute__((always_inline)) inline Vec16 load16(const float* p) {
  Vec16 v;
  std::memcpy(&v, p, sizeof(v));  // unaligned load
  return v;
}

__attribute__((always_inline)) inline void store16(float* p, Vec16 v) {
  std::memcpy(p, &v, sizeof(v));
}

__attribute__((always_inline)) inline Vec16 splat16(float x) { return Vec16{} + x; }

__attribute__((always_inline)) inline Vec16 select16(Vec16i mask, Vec16 a, Vec16 b) {
  return bits_as<Vec16>((bits_as<Vec16i>(a) & mask) | (bits_as<Vec16i>(b) & ~mask));
}

// Sum / max of the 16 lanes by halving: 16 -> 8 -> 4 lanes as vector ops, then 4 scalars.
__attribute__((always_inline)) inline float lane_sum(Vec16 v) {
  Vec8 lo, hi;
  std::memcpy(&lo, &v, sizeof(lo));
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof(lo), sizeof(hi));
  const Vec8 s8 = lo + hi;
  Vec4 lo4, hi4;
  std::memcpy(&lo4, &s8, sizeof(lo4));
  std::memcpy(&hi4, reinterpret_cast<const char*>(&s8) + sizeof(lo4), sizeof(hi4));
  const Vec4 s4 = lo4 + hi4;
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

__attribute__((always_inline)) inline float lane_max(Vec16 v) {
  Vec8 lo, hi;
  std::memcpy(&lo, &v, sizeof(lo));
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof(lo), sizeof(hi));
  const Vec8 s8 = lo > hi ? lo : hi;
  Vec4 lo4, hi4;
  std::memcpy(&lo4, &s8, sizeof(lo4));
  std::memcpy(&hi4, reinterpret_cast<const char*>(&s8) + sizeof(lo4), sizeof(hi4));
  const Vec4 s4 = lo4 > hi4 ? lo4 : hi4;
  return std::max(std::max(s4[0], s4[2]), std::max(s4[1], s4[3]));
}

// lane i of the result: a[2i] + a[2i + 1] style pair sums of two vectors (masks below).
__attribute__((always_inline)) inline Vec16 pair_sum(Vec16 a, Vec16 b, Vec16i lo, Vec16i hi) {
  return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
}

// part[t] are key t's 16 partial dot products -> lane t = their sum, for 16 keys at once:
// a transpose-and-add tree (15 adds, 30 two-vector shuffles for 16 keys) instead of one
// 16-lane reduction per key. After level 1 lane L holds a partial of part[L & 1] of its pair,
// after level 2 of part[L & 3] of its four, ..., after level 4 the whole sum of part[L].
__attribute__((always_inline)) inline Vec16 sum_each(Vec16* part) {
  const Vec16i m1 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
  const Vec16i m2 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
  const Vec16i m3 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
  const Vec16i m4 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  for (int i = 0; i < 8; ++i) part[i] = pair_sum(part[2 * i], part[2 * i + 1], m1, m1 + 1);
  for (int i = 0; i < 4; ++i) part[i] = pair_sum(part[2 * i], part[2 * i + 1], m2, m2 + 2);
  for (int i = 0; i < 2; ++i) part[i] = pair_sum(part[2 * i], part[2 * i + 1], m3, m3 + 4);
  return pair_sum(part[0], part[1], m4, m4 + 8);
}

// exp(x) for x <= 0 (a score minus its row's running max; -inf -> 0), within ~2 ulp of expf,
// 16 lanes at a time (glibc's expf is a call per element): Cephes' range reduction
// x = n ln2 + r (n = x log2(e) rounded to nearest by the 1.5 * 2**23 trick, which also
// leaves n in the low mantissa bits) and degree-6 polynomial, 2**n from exponent bits.
// Below -87 the result is 0 (expf's is < 2**-125, next to the row max's 1 in the sum).
__attribute__((always_inline)) inline Vec16 exp_nonpositive(Vec16 x) {
  const Vec16i keep = x >= -87.0f;  // lanes of all ones / zeros: no branch
  x = select16(keep, x, splat16(-87.0f));
  constexpr float kShift = 0x1.8p23f;
  const Vec16 shifted = x * 1.44269504088896341f + kShift;
  const Vec16 n = shifted - kShift;
  Vec16 r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  Vec16 y = splat16(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const Vec16i n_int = bits_as<Vec16i>(shifted) - bits_as<int32_t>(kShift);
  const Vec16 scale = bits_as<Vec16>((n_int + 127) << 23);
  return bits_as<Vec16>(bits_as<Vec16i>(y * scale) & keep);
}

__attribute__((always_inline)) inline float exp_nonpositive(float x) {
  return exp_nonpositive(splat16(x))[0];
}

}  // namespace
