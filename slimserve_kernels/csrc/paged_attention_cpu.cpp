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
//
// Beside it: vec16.h (the 16-lane vectors and their math), fp8_codes.h (FP8 codes decoded
// and written), paged_cache.h (the cache's kinds and strides).
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

#include "fp8_codes.h"
#include "paged_cache.h"
#include "vec16.h"

namespace {

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
