// Paged attention on the CPU, reading the paged KV cache in place through the block table.
//
// One task per (sequence, KV head, block of new query tokens). A task serves the G query
// heads that share its KV head and its block's new tokens (1 for a decode; up to
// kBlockRows / G of a prefill, so a task's accumulators stay in L1 and a long prefill splits
// into many tasks) as R = tokens * G "query rows": each
// cache block is decoded once into an fp32 tile (FP8 codes decoded exactly in integer
// arithmetic, times 2**exponent: the product `_gather_rows` computes; 16-bit caches
// converted; an fp32 cache is read where it lies) and every query row takes it with an
// online softmax, fp32 accumulation. Query row j of a sequence with n new tokens sits at position
// len - n + j and sees keys <= that position (causal within the step's new tokens); a task
// reads keys up to its block's last position only.
//
// Threads: torch's intra-op threads (at::parallel_for) take tasks from a shared counter,
// costliest first (rows times keys seen), not a contiguous share each: a step that mixes
// one long prefill with decodes left the prefill's tasks all on one thread. A row's result
// does not depend on which thread runs its task, so any thread count gives the same bits.
//
// Portability: no -march flag. The hot function is compiled three times (AVX-512, AVX2+FMA,
// baseline x86-64, by target attributes) and picked at the first call from what the CPU
// supports, so a build cached on one machine runs on any x86-64 machine
// (slimserve_kernels/README.md).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <immintrin.h>
#include <string>
#include <limits>
#include <vector>

namespace {

enum class CacheKind : int { kFloat32 = 0, kFp8 = 1, kBFloat16 = 2, kFloat16 = 3 };

// The paged cache of one layer as the kernel reads it: [num_blocks, block_size, Hkv, D]
// (D contiguous), scales [num_blocks, block_size, Hkv] for FP8.
struct Cache {
  const void* data;
  const int8_t* scale;  // FP8 only
  int64_t s_block, s_tok, s_head;  // element strides of the cache
  int64_t e_block, e_tok, e_head;  // element strides of the scales
};

// The new query tokens [j0, j1) of sequence b, against KV head h; cost: its tokens times
// the keys its last token sees.
struct Task {
  int64_t b, h, j0, j1, cost;
};

struct Problem {
  const float* q;  // [T, Hq, D], D contiguous
  int64_t q_tok, q_head;  // element strides of q
  float* out;  // [T, Hq, D]
  Cache k, v;
  const int32_t* block_tables;  // [B, max_blocks]
  const int32_t* seq_lens;  // [B]
  const int32_t* query_start;  // [B + 1], or null: one query row per sequence
  int64_t max_blocks, block_size, hq, hkv, d;
  float sm_scale;
  CacheKind kind;
};

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

enum class Isa { kAvx512, kAvx2, kBaseline };

constexpr int kLanes = 16;  // also the keys scored together (one vector of scores)

// Rows [t0, t0 + n) of `block`'s tokens for head h as an [n, d] fp32 view: the cache itself
// for an fp32 cache, else `tile` filled with the decoded rows (FP8: value * 2**-8, unscaled;
// the caller applies the per-token 2**e). Row stride back in *stride.
template <Isa I>
__attribute__((always_inline)) inline const float* chunk_rows(const Problem& p, const Cache& c,
                                                               int64_t block, int64_t t0,
                                                               int64_t n, int64_t h, int64_t d,
                                                               float* tile, int64_t* stride) {
  const int64_t off = block * c.s_block + t0 * c.s_tok + h * c.s_head;
  *stride = d;
  switch (p.kind) {
    case CacheKind::kFp8: {
      const uint8_t* src = static_cast<const uint8_t*>(c.data) + off;
      if constexpr (I == Isa::kAvx512) fp8_rows_avx512(src, c.s_tok, n, d, tile);
      else if constexpr (I == Isa::kAvx2) fp8_rows_avx2(src, c.s_tok, n, d, tile);
      else fp8_rows_baseline(src, c.s_tok, n, d, tile);
      return tile;
    }
    case CacheKind::kBFloat16: {
      const c10::BFloat16* src = static_cast<const c10::BFloat16*>(c.data) + off;
      for (int64_t t = 0; t < n; ++t)
        for (int64_t i = 0; i < d; ++i) tile[t * d + i] = static_cast<float>(src[t * c.s_tok + i]);
      return tile;
    }
    case CacheKind::kFloat16: {
      const c10::Half* src = static_cast<const c10::Half*>(c.data) + off;
      for (int64_t t = 0; t < n; ++t)
        for (int64_t i = 0; i < d; ++i) tile[t * d + i] = static_cast<float>(src[t * c.s_tok + i]);
      return tile;
    }
    default:
      *stride = c.s_tok;
      return static_cast<const float*>(c.data) + off;
  }
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

// Lane t: q . keys[t] for t < n (0 past n), 16 columns at a time per key, one vector of
// partial sums per key, all summed at once by sum_each.
__attribute__((always_inline)) inline Vec16 scores(const float* __restrict q,
                                                   const float* __restrict keys, int64_t stride,
                                                   int64_t n, int64_t d) {
  Vec16 part[kLanes];
  const int64_t d16 = d - d % kLanes;
  for (int64_t t = 0; t < kLanes; ++t) {
    Vec16 a = {};
    if (t < n) {
      const float* k = keys + t * stride;
      for (int64_t i = 0; i < d16; i += kLanes) a += load16(q + i) * load16(k + i);
      for (int64_t i = d16; i < d; ++i) a[0] += q[i] * k[i];
    }
    part[t] = a;
  }
  return sum_each(part);
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

// For each of R rows r: acc[r][0..d) += sum over t < n of w[r][t] * v[t * stride + i]. 64
// columns of R rows at a time, keys outer: 4R independent accumulators (one chain of 16
// dependent FMAs per column vector was latency-bound, ~4 cycles an FMA), each V vector
// loaded once for the R rows.
template <int R>
__attribute__((always_inline)) inline void weighted_rows(float* const* acc,
                                                         const float* const* w,
                                                         const float* __restrict v,
                                                         int64_t n, int64_t stride, int64_t d) {
  constexpr int kCols = 4;  // vectors of 16 columns per pass
  int64_t i = 0;
  for (; i + kCols * kLanes <= d; i += kCols * kLanes) {
    Vec16 a[R][kCols];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kCols; ++c) a[r][c] = load16(acc[r] + i + c * kLanes);
    for (int64_t t = 0; t < n; ++t) {
      const float* vt = v + t * stride + i;
      for (int c = 0; c < kCols; ++c) {
        const Vec16 x = load16(vt + c * kLanes);
        for (int r = 0; r < R; ++r) a[r][c] += w[r][t] * x;
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kCols; ++c) store16(acc[r] + i + c * kLanes, a[r][c]);
  }
  for (; i + kLanes <= d; i += kLanes)
    for (int r = 0; r < R; ++r) {
      Vec16 a = load16(acc[r] + i);
      for (int64_t t = 0; t < n; ++t) a += w[r][t] * load16(v + t * stride + i);
      store16(acc[r] + i, a);
    }
  for (; i < d; ++i)
    for (int r = 0; r < R; ++r)
      for (int64_t t = 0; t < n; ++t) acc[r][i] += w[r][t] * v[t * stride + i];
}

// Lane t < n: 2**e of token t0 + t's FP8 scale (1 elsewhere and for other caches).
__attribute__((always_inline)) inline Vec16 token_scales(const Problem& p, const Cache& c,
                                                         int64_t block, int64_t t0, int64_t n,
                                                         int64_t h) {
  Vec16 s = splat16(1.0f);
  if (p.kind != CacheKind::kFp8) return s;
  const int8_t* e = c.scale + block * c.e_block + t0 * c.e_tok + h * c.e_head;
  int32_t ex[kLanes] = {};  // lanes past n: 2**0
  for (int64_t t = 0; t < n; ++t) ex[t] = e[t * c.e_tok];
  Vec16i v;
  std::memcpy(&v, ex, sizeof(v));
  int32_t low = 0;  // any exponent below -126 (never written by kv_write: [-100, 127])
  for (int t = 0; t < kLanes; ++t) low |= ex[t] < -126;
  if (low) {
    for (int64_t t = 0; t < n; ++t) s[t] = exp2i(ex[t]);
    return s;
  }
  return bits_as<Vec16>((v + 127) << 23);  // exp2i's bit form, 16 lanes at once
}

// One (sequence, KV head): every query row of the sequence times the G heads of the group.
// Keys go in chunks of up to 16 of one block: each chunk's K and V decoded once into fp32
// tiles, then per query row one vector of 16 scores (no per-key horizontal sum), its softmax
// update with one vector exp, and the P.V accumulation. Inlined into one copy per
// instruction set below.
template <Isa I, int kD>
__attribute__((always_inline)) inline void attend(const Problem& p, const Task& t,
                                                  std::vector<float>& scratch) {
  // kD: the head dim as a constant (64, 128: loops over D unroll and the 16 keys' dot
  // products interleave), 0 for any other.
  const int64_t g = p.hq / p.hkv, d = kD ? kD : p.d, bs = p.block_size;
  const int64_t b = t.b, h = t.h;
  const int64_t len = p.seq_lens[b];
  const int64_t q0 = (p.query_start ? p.query_start[b] : b) + t.j0;  // the block's first row
  const int64_t n_new = p.query_start ? p.query_start[b + 1] - p.query_start[b] : 1;
  const int64_t rows = (t.j1 - t.j0) * g;  // row r: query token j0 + r / g, head h * g + r % g
  const int64_t kv_end = len - n_new + t.j1;  // keys past the block's last position: unseen
  scratch.resize(static_cast<size_t>(rows * (d + kLanes + 2) + 2 * kLanes * d));
  float* acc = scratch.data();  // [rows, d]
  float* weight = acc + rows * d;  // [rows, 16]: this chunk's P times V's 2**e
  float* row_max = weight + rows * kLanes;  // [rows]
  float* row_sum = row_max + rows;  // [rows]
  float* k_tile = row_sum + rows;  // [16, d]
  float* v_tile = k_tile + kLanes * d;  // [16, d]
  std::fill(acc, acc + rows * d, 0.0f);
  std::fill(row_max, row_max + rows, -std::numeric_limits<float>::infinity());
  std::fill(row_sum, row_sum + rows, 0.0f);
  const bool fp8 = p.kind == CacheKind::kFp8;
  const float unit = fp8 ? kFp8Unit : 1.0f;  // undoes the FP8 tiles' 2**-8
  const Vec16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const int32_t* table = p.block_tables + b * p.max_blocks;
  for (int64_t start = 0; start < kv_end; start += bs) {
    const int64_t block = table[start / bs];
    const int64_t in_block = std::min(bs, kv_end - start);
    for (int64_t c0 = 0; c0 < in_block; c0 += kLanes) {
      const int64_t n = std::min<int64_t>(kLanes, in_block - c0), first = start + c0;
      int64_t ks, vs;
      const float* keys = chunk_rows<I>(p, p.k, block, c0, n, h, d, k_tile, &ks);
      // (raw * 256) * 2**e * sm_scale: the reference's (q . (value * 2**e)) * sm_scale,
      // each factor a power of two but the last.
      const Vec16 k_mul = token_scales(p, p.k, block, c0, n, h);
      const Vec16 v_mul = token_scales(p, p.v, block, c0, n, h);
      int64_t last_seen = 0;  // keys of the chunk that some row sees
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t j = t.j0 + r / g;
        // Keys past this row's position are masked (causal within the new tokens).
        const int64_t seen = std::min(n, len - n_new + j + 1 - first);
        float* w = weight + r * kLanes;
        if (seen <= 0) {
          store16(w, Vec16{});
          continue;
        }
        last_seen = std::max(last_seen, seen);
        const float* q = p.q + (q0 + r / g) * p.q_tok + (h * g + r % g) * p.q_head;
        Vec16 s = scores(q, keys, ks, n, d) * unit * k_mul * p.sm_scale;
        s = select16(lane < static_cast<int32_t>(seen), s,
                     splat16(-std::numeric_limits<float>::infinity()));
        const float m = std::max(row_max[r], lane_max(s));
        const Vec16 pr = exp_nonpositive(s - m);
        const float correction = exp_nonpositive(row_max[r] - m);  // 0 at the first chunk
        row_sum[r] = row_sum[r] * correction + lane_sum(pr);
        row_max[r] = m;
        store16(w, pr * v_mul);
        float* a = acc + r * d;
        for (int64_t i = 0; i < d; ++i) a[i] *= correction;
      }
      if (last_seen == 0) continue;
      const float* values = chunk_rows<I>(p, p.v, block, c0, last_seen, h, d, v_tile, &vs);
      int64_t r = 0;
      for (; r + 2 <= rows; r += 2) {
        float* const a[2] = {acc + r * d, acc + (r + 1) * d};
        const float* const w[2] = {weight + r * kLanes, weight + (r + 1) * kLanes};
        weighted_rows<2>(a, w, values, last_seen, vs, d);
      }
      if (r < rows) {
        float* const a[1] = {acc + r * d};
        const float* const w[1] = {weight + r * kLanes};
        weighted_rows<1>(a, w, values, last_seen, vs, d);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* o = p.out + ((q0 + r / g) * p.hq + h * g + r % g) * d;
    const float inv = unit / row_sum[r];  // unit: the FP8 V tiles' 2**-8
    for (int64_t i = 0; i < d; ++i) o[i] = acc[r * d + i] * inv;
  }
}

// The same code compiled for three instruction sets, picked at run time by what the CPU
// supports (target_clones' "arch=" clones dispatch on the CPU model, not its features, and
// picked the baseline on a Sapphire Rapids).
template <Isa I>
__attribute__((always_inline)) inline void attend_any_d(const Problem& p, const Task& t,
                                                        std::vector<float>& scratch) {
  if (p.d == 64) return attend<I, 64>(p, t, scratch);
  if (p.d == 128) return attend<I, 128>(p, t, scratch);
  attend<I, 0>(p, t, scratch);
}

__attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,f16c")))
void attend_avx512(const Problem& p, const Task& t, std::vector<float>& scratch) {
  attend_any_d<Isa::kAvx512>(p, t, scratch);
}

__attribute__((target("avx2,fma,f16c")))
void attend_avx2(const Problem& p, const Task& t, std::vector<float>& scratch) {
  attend_any_d<Isa::kAvx2>(p, t, scratch);
}

void attend_baseline(const Problem& p, const Task& t, std::vector<float>& scratch) {
  attend_any_d<Isa::kBaseline>(p, t, scratch);
}

using AttendFn = void (*)(const Problem&, const Task&, std::vector<float>&);

// Query rows per prefill task (tokens * G): its fp32 accumulators, [rows, D], stay in L1.
constexpr int64_t kBlockRows = 64;
// Below this many (query row, key) pairs in all a call runs on the calling thread: waking a
// second thread costs more than it saves (a 1-sequence decode over a short context).
constexpr int64_t kMinThreadedCost = 1 << 14;

// Every (sequence, KV head, block of new tokens), costliest first: a block's rows times the
// keys its last row sees (causal: a sequence's later blocks cost more).
std::vector<Task> plan_tasks(const Problem& p, int64_t b, int64_t* total_cost) {
  const int64_t g = p.hq / p.hkv, block = std::max<int64_t>(1, kBlockRows / g);
  std::vector<Task> tasks;
  *total_cost = 0;  // (query row, key) pairs: each task's cost times the G heads
  for (int64_t s = 0; s < b; ++s) {
    const int64_t n = p.query_start ? p.query_start[s + 1] - p.query_start[s] : 1;
    const int64_t len = p.seq_lens[s];
    for (int64_t j0 = 0; j0 < n; j0 += block) {
      const int64_t j1 = std::min(n, j0 + block), cost = (j1 - j0) * (len - n + j1);
      for (int64_t h = 0; h < p.hkv; ++h) tasks.push_back(Task{s, h, j0, j1, cost});
      *total_cost += cost * g * p.hkv;
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const Task& x, const Task& y) { return x.cost > y.cost; });
  return tasks;
}

// SLIMSERVE_CPU_ISA=avx2 | baseline caps the pick (tests run each copy on one machine).
AttendFn pick_attend() {
  __builtin_cpu_init();
  const char* cap = std::getenv("SLIMSERVE_CPU_ISA");
  const std::string want = cap ? cap : "";
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  if (avx512 && want != "avx2" && want != "baseline") return attend_avx512;
  if (avx2 && want != "baseline") return attend_avx2;
  return attend_baseline;
}

const char* isa_name() {
  const AttendFn f = pick_attend();
  return f == attend_avx512 ? "avx512" : f == attend_avx2 ? "avx2" : "baseline";
}

CacheKind cache_kind(const at::Tensor& c) {
  switch (c.scalar_type()) {
    case at::kFloat: return CacheKind::kFloat32;
    case at::kFloat8_e4m3fn: return CacheKind::kFp8;
    case at::kBFloat16: return CacheKind::kBFloat16;
    case at::kHalf: return CacheKind::kFloat16;
    default: TORCH_CHECK(false, "paged_attention: unsupported cache dtype ", c.scalar_type());
  }
}

Cache view_cache(const at::Tensor& c, const c10::optional<at::Tensor>& scale, bool fp8) {
  TORCH_CHECK(c.dim() == 4 && c.stride(3) == 1, "cache: [num_blocks, block_size, Hkv, D], D contiguous");
  Cache v{c.data_ptr(), nullptr, c.stride(0), c.stride(1), c.stride(2), 0, 0, 0};
  if (fp8) {
    TORCH_CHECK(scale.has_value() && scale->scalar_type() == at::kChar && scale->dim() == 3,
                "an FP8 cache needs int8 scales [num_blocks, block_size, Hkv]");
    v.scale = scale->data_ptr<int8_t>();
    v.e_block = scale->stride(0), v.e_tok = scale->stride(1), v.e_head = scale->stride(2);
  }
  return v;
}

}  // namespace

// q [T, Hq, D] float32 -> [T, Hq, D] float32. query_start None: T == B, one row per sequence.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const c10::optional<at::Tensor>& k_scale,
                           const c10::optional<at::Tensor>& v_scale,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens,
                           const c10::optional<at::Tensor>& query_start, double sm_scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.stride(2) == 1,
              "q: float32 [T, Hq, D], D contiguous");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "k_cache and v_cache differ");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                  block_tables.dim() == 2, "block_tables: contiguous int32 [B, max_blocks]");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(), "seq_lens: int32");
  const CacheKind kind = cache_kind(k_cache);
  const bool fp8 = kind == CacheKind::kFp8;
  const int64_t b = block_tables.size(0), hq = q.size(1), d = q.size(2);
  const int64_t hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d && hq % hkv == 0, "head dims: q ", q.sizes(), " cache ",
              k_cache.sizes());
  TORCH_CHECK(seq_lens.numel() == b, "seq_lens: [B]");
  if (query_start.has_value()) {
    TORCH_CHECK(query_start->scalar_type() == at::kInt && query_start->numel() == b + 1 &&
                    query_start->is_contiguous(), "query_start_loc: int32 [B + 1]");
  } else {
    TORCH_CHECK(q.size(0) == b, "a decode has one query row per sequence");
  }
  at::Tensor out = at::empty(q.sizes(), q.options());
  Problem p{q.data_ptr<float>(), q.stride(0), q.stride(1), out.data_ptr<float>(), view_cache(k_cache, k_scale, fp8),
            view_cache(v_cache, v_scale, fp8),
            block_tables.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(),
            query_start.has_value() ? query_start->data_ptr<int32_t>() : nullptr,
            block_tables.size(1), k_cache.size(1), hq, hkv, d,
            static_cast<float>(sm_scale), kind};
  static const AttendFn attend_task = pick_attend();
  int64_t cost = 0;
  const std::vector<Task> tasks = plan_tasks(p, b, &cost);
  const int64_t n_tasks = static_cast<int64_t>(tasks.size());
  std::atomic<int64_t> next{0};
  // One index per thread; each takes the next task until none is left (see the top).
  const int64_t threads = cost < kMinThreadedCost ? 1 : at::get_num_threads();
  const int64_t workers = std::min<int64_t>(threads, n_tasks);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<float> scratch;
    for (int64_t i = next++; i < n_tasks; i = next++) attend_task(p, tasks[i], scratch);
  });
  return out;
}

namespace {

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

// reference.kv_write for an FP8 or float32 cache, bit for bit: k, v [T, Hkv, D] float32 (D
// contiguous) into slot slot_mapping[t] (int64; < 0 = skip); FP8 quantized per (token, head)
// with a power-of-two exponent into k_scale / v_scale.
void kv_write(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
              const at::Tensor& v_cache, const c10::optional<at::Tensor>& k_scale,
              const c10::optional<at::Tensor>& v_scale, const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.scalar_type() == at::kFloat &&
                  v.scalar_type() == at::kFloat && k.stride(2) == 1 && v.stride(2) == 1,
              "k, v: float32 [T, Hkv, D], D contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == k.size(0), "slot_mapping: int64 [T]");
  const CacheKind kind = cache_kind(k_cache);
  TORCH_CHECK(kind == CacheKind::kFloat32 || kind == CacheKind::kFp8,
              "kv_write: float32 or FP8 caches only");
  const bool fp8 = kind == CacheKind::kFp8;
  const Cache kc = view_cache(k_cache, k_scale, fp8), vc = view_cache(v_cache, v_scale, fp8);
  const int64_t t_n = k.size(0), hkv = k.size(1), d = k.size(2), bs = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == hkv && k_cache.size(3) == d && v_cache.sizes() == k_cache.sizes(),
              "cache heads / head dim differ from k's");
  const int64_t slots = k_cache.size(0) * bs;
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < t_n; ++t) TORCH_CHECK(slot[t] < slots, "slot ", slot[t], " out of range");
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  at::parallel_for(0, t_n * hkv, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / hkv, h = i % hkv;
      if (slot[t] < 0) continue;
      const int64_t block = slot[t] / bs, off = slot[t] % bs;
      const float* rows[2] = {kp + t * k.stride(0) + h * k.stride(1),
                              vp + t * v.stride(0) + h * v.stride(1)};
      const Cache* caches[2] = {&kc, &vc};
      for (int j = 0; j < 2; ++j) {
        const Cache& c = *caches[j];
        const int64_t at = block * c.s_block + off * c.s_tok + h * c.s_head;
        if (!fp8) {
          std::memcpy(static_cast<float*>(const_cast<void*>(c.data)) + at, rows[j], d * 4);
          continue;
        }
        int8_t* e = const_cast<int8_t*>(c.scale) + block * c.e_block + off * c.e_tok + h * c.e_head;
        quantize_row(rows[j], d, static_cast<uint8_t*>(const_cast<void*>(c.data)) + at, e);
      }
    }
  });
}

// The kernels run without the GIL, as ATen's own Python bindings do: a served replica's
// event loop (requests in, deltas out) keeps running while its step thread computes.
// The arguments are converted (and the result returned) with the GIL held.
using NoGil = pybind11::call_guard<pybind11::gil_scoped_release>;
constexpr NoGil kNoGil{};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("kv_write", &kv_write, kNoGil, "kv_write into a float32 or FP8 paged cache (CPU)");
  m.def("paged_attention", &paged_attention, kNoGil, "paged attention over a paged KV cache (CPU)");
  m.def("isa", &isa_name, "the instruction set the kernel runs with on this CPU");
}
