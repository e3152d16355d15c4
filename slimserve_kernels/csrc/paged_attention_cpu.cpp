// Paged attention on the CPU, reading the paged KV cache in place through the block table.
//
// One task per (sequence, KV head), run under at::parallel_for (torch's intra-op threads).
// A task serves the G query heads that share its KV head and every new query row of the
// sequence (1 for a decode, a few for a short extend) as R = rows * G "query rows": each
// cache block is decoded once into an fp32 tile (FP8 codes decoded exactly in integer
// arithmetic, times 2**exponent: the product `_gather_rows` computes; 16-bit caches
// converted; an fp32 cache is read where it lies) and every query row takes it with an
// online softmax, fp32 accumulation. Query row j of a sequence with n new tokens sits at position
// len - n + j and sees keys <= that position (causal within the step's new tokens).
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
#include <cmath>
#include <cstdint>
#include <cstring>
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

// The value of an e4m3 code, exactly (== fp8_values' table entry, tested for all 256 codes),
// in branch-free integer arithmetic that vectorizes (a table lookup is a gather per element):
// a normal code's exponent and mantissa fields move into fp32's and the bias goes from 7 to
// 127; a subnormal one is mantissa * 2**-9; exponent and mantissa all ones is NaN.
__attribute__((always_inline)) inline float e4m3_value(uint8_t code) {
  const uint32_t mag = code & 0x7Fu, sign = static_cast<uint32_t>(code & 0x80u) << 24;
  const uint32_t normal = (mag << 20) + (120u << 23);
  const float subnormal = static_cast<float>(static_cast<int32_t>(mag & 7u)) * 0x1p-9f;
  // All-ones / all-zeros masks, not ternaries: GCC left the ternary form scalar here.
  const uint32_t is_normal = 0u - static_cast<uint32_t>(mag >= 8u);
  const uint32_t is_nan = 0u - static_cast<uint32_t>(mag == 0x7Fu);
  uint32_t bits = (normal & is_normal) | (bits_as<uint32_t>(subnormal) & ~is_normal);
  bits = (0x7FC00000u & is_nan) | (bits & ~is_nan);
  return bits_as<float>(bits | sign);
}

// dst[i] = value(src[i]) * scale for one FP8 row of the cache.
__attribute__((always_inline)) inline void fp8_row(const uint8_t* __restrict src,
                                                   float* __restrict dst, int64_t d, float scale) {
  for (int64_t i = 0; i < d; ++i) dst[i] = e4m3_value(src[i]) * scale;
}

// Token t of block `block`, head h, as fp32 into dst[0..d).
__attribute__((always_inline)) inline void load_row(const Problem& p, const Cache& c,
                                                     int64_t block, int64_t t, int64_t h,
                                                     float* dst) {
  const int64_t off = block * c.s_block + t * c.s_tok + h * c.s_head;
  const int64_t d = p.d;
  switch (p.kind) {
    case CacheKind::kFp8: {
      const uint8_t* src = static_cast<const uint8_t*>(c.data) + off;
      const float s = exp2i(c.scale[block * c.e_block + t * c.e_tok + h * c.e_head]);
      fp8_row(src, dst, d, s);
      break;
    }
    case CacheKind::kBFloat16: {
      const c10::BFloat16* src = static_cast<const c10::BFloat16*>(c.data) + off;
      for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<float>(src[i]);
      break;
    }
    case CacheKind::kFloat16: {
      const c10::Half* src = static_cast<const c10::Half*>(c.data) + off;
      for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<float>(src[i]);
      break;
    }
    default: {
      const float* src = static_cast<const float*>(c.data) + off;
      for (int64_t i = 0; i < d; ++i) dst[i] = src[i];
    }
  }
}

// A [n, d] fp32 view of `block`'s tokens for head h: the cache itself for an fp32 cache,
// else `tile` filled with the decoded rows. Row stride back in *stride.
__attribute__((always_inline)) inline const float* block_rows(const Problem& p, const Cache& c,
                                                               int64_t block, int64_t h,
                                                               int64_t n, float* tile,
                                                               int64_t* stride) {
  if (p.kind == CacheKind::kFloat32) {
    *stride = c.s_tok;
    return static_cast<const float*>(c.data) + block * c.s_block + h * c.s_head;
  }
  for (int64_t t = 0; t < n; ++t) load_row(p, c, block, t, h, tile + t * p.d);
  *stride = p.d;
  return tile;
}

constexpr int kLanes = 16;

// 16 floats as one vector value (GCC/Clang vector extension): one zmm in the AVX-512 copy, two
// ymm / four xmm in the others. Loops over `float acc[16]` arrays were left half scalar by
// GCC's vectorizer here (perf: scalar FMAs and stack round trips in the dot's sum and the V
// accumulation were most of a decode's kernel time).
typedef float Vec16 __attribute__((vector_size(64)));
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

// Sum of the 16 lanes by halving: 16 -> 8 -> 4 lanes as vector adds, then 4 scalars.
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

__attribute__((always_inline)) inline float dot(const float* a, const float* b, int64_t d) {
  Vec16 acc = {};
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes) acc += load16(a + i) * load16(b + i);
  float s = lane_sum(acc);
  for (; i < d; ++i) s += a[i] * b[i];
  return s;
}

// exp(x) for x <= 0 (a score minus its row's running max), within ~2 ulp of expf, in
// arithmetic that vectorizes (glibc's expf is a call per element): Cephes' range reduction
// x = n ln2 + r (n = x log2(e) rounded to nearest by the 1.5 * 2**23 trick, which also
// leaves n in the low mantissa bits: GCC did not vectorize a float -> int cast here) and
// degree-6 polynomial, 2**n from exponent bits. Below -87 the result is 0 (expf's is
// < 2**-125, next to the row max's 1 in the sum).
__attribute__((always_inline)) inline float exp_nonpositive(float x) {
  const uint32_t keep = 0u - static_cast<uint32_t>(x >= -87.0f);  // a mask: no branch
  x = std::max(x, -87.0f);
  constexpr float kShift = 0x1.8p23f;
  const float shifted = x * 1.44269504088896341f + kShift;
  const float n = shifted - kShift;
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const int32_t n_int = bits_as<int32_t>(shifted) - bits_as<int32_t>(kShift);
  const uint32_t scale = static_cast<uint32_t>(n_int + 127) << 23;
  return bits_as<float>(bits_as<uint32_t>(y * bits_as<float>(scale)) & keep);
}

// pr[t] = exp(pr[t] - m) for t < n -> their sum.
__attribute__((always_inline)) inline float softmax_numerators(float* __restrict pr, int64_t n,
                                                               float m) {
  for (int64_t t = 0; t < n; ++t) pr[t] = exp_nonpositive(pr[t] - m);
  float sum = 0.0f;
  for (int64_t t = 0; t < n; ++t) sum += pr[t];
  return sum;
}

// acc[0..d) += sum over t < n of w[t] * v[t * stride + i], 16 columns at a time so the
// partial sums stay in a register across the block's keys.
__attribute__((always_inline)) inline void weighted_rows(float* __restrict acc,
                                                         const float* __restrict w,
                                                         const float* __restrict v,
                                                         int64_t n, int64_t stride, int64_t d) {
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes) {
    Vec16 a = load16(acc + i);
    for (int64_t t = 0; t < n; ++t) a += w[t] * load16(v + t * stride + i);
    store16(acc + i, a);
  }
  for (; i < d; ++i)
    for (int64_t t = 0; t < n; ++t) acc[i] += w[t] * v[t * stride + i];
}

// One (sequence, KV head): every query row of the sequence times the G heads of the group.
// Inlined into one copy per instruction set below.
__attribute__((always_inline)) inline void attend(const Problem& p, int64_t b, int64_t h,
                                                  std::vector<float>& scratch) {
  const int64_t g = p.hq / p.hkv, d = p.d, bs = p.block_size;
  const int64_t len = p.seq_lens[b];
  const int64_t q0 = p.query_start ? p.query_start[b] : b;
  const int64_t n_new = p.query_start ? p.query_start[b + 1] - q0 : 1;
  const int64_t rows = n_new * g;  // row r: query token r / g, head h * g + r % g
  scratch.resize(static_cast<size_t>(rows * (d + bs + 2) + 2 * bs * d));
  float* acc = scratch.data();  // [rows, d]
  float* prob = acc + rows * d;  // [rows, bs]
  float* row_max = prob + rows * bs;  // [rows]
  float* row_sum = row_max + rows;  // [rows]
  float* k_tile = row_sum + rows;  // [bs, d]
  float* v_tile = k_tile + bs * d;  // [bs, d]
  std::fill(acc, acc + rows * d, 0.0f);
  std::fill(row_max, row_max + rows, -std::numeric_limits<float>::infinity());
  std::fill(row_sum, row_sum + rows, 0.0f);
  const int32_t* table = p.block_tables + b * p.max_blocks;
  for (int64_t start = 0; start < len; start += bs) {
    const int64_t block = table[start / bs];
    const int64_t n = std::min(bs, len - start);
    int64_t ks, vs;
    const float* keys = block_rows(p, p.k, block, h, n, k_tile, &ks);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t j = r / g;
      const float* q = p.q + (q0 + j) * p.q_tok + (h * g + r % g) * p.q_head;
      // Keys past this row's position are masked (causal within the new tokens).
      const int64_t seen = std::min(n, len - n_new + j + 1 - start);
      float* pr = prob + r * bs;
      float m = row_max[r];
      for (int64_t t = 0; t < seen; ++t) {
        pr[t] = dot(q, keys + t * ks, d) * p.sm_scale;
        m = std::max(m, pr[t]);
      }
      if (seen <= 0) {
        for (int64_t t = 0; t < n; ++t) pr[t] = 0.0f;
        continue;
      }
      const float correction = std::exp(row_max[r] - m);  // 0 at the first block (-inf)
      const float sum = softmax_numerators(pr, seen, m);
      for (int64_t t = seen; t < n; ++t) pr[t] = 0.0f;
      row_sum[r] = row_sum[r] * correction + sum;
      row_max[r] = m;
      float* a = acc + r * d;
      for (int64_t i = 0; i < d; ++i) a[i] *= correction;
    }
    const float* values = block_rows(p, p.v, block, h, n, v_tile, &vs);
    for (int64_t r = 0; r < rows; ++r) weighted_rows(acc + r * d, prob + r * bs, values, n, vs, d);
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* o = p.out + ((q0 + r / g) * p.hq + h * g + r % g) * d;
    const float inv = 1.0f / row_sum[r];
    for (int64_t i = 0; i < d; ++i) o[i] = acc[r * d + i] * inv;
  }
}

// The same code compiled for three instruction sets, picked at run time by what the CPU
// supports (target_clones' "arch=" clones dispatch on the CPU model, not its features, and
// picked the baseline on a Sapphire Rapids).
__attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,f16c")))
void attend_avx512(const Problem& p, int64_t b, int64_t h, std::vector<float>& scratch) {
  attend(p, b, h, scratch);
}

__attribute__((target("avx2,fma,f16c")))
void attend_avx2(const Problem& p, int64_t b, int64_t h, std::vector<float>& scratch) {
  attend(p, b, h, scratch);
}

void attend_baseline(const Problem& p, int64_t b, int64_t h, std::vector<float>& scratch) {
  attend(p, b, h, scratch);
}

using AttendFn = void (*)(const Problem&, int64_t, int64_t, std::vector<float>&);

AttendFn pick_attend() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq"))
    return attend_avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return attend_avx2;
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
  at::parallel_for(0, b * hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t i = begin; i < end; ++i) attend_task(p, i / hkv, i % hkv, scratch);
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("kv_write", &kv_write, "kv_write into a float32 or FP8 paged cache (CPU)");
  m.def("paged_attention", &paged_attention, "paged attention over a paged KV cache (CPU)");
  m.def("isa", &isa_name, "the instruction set the kernel runs with on this CPU");
}
