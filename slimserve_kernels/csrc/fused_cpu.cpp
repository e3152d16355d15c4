// Fused float32 elementwise ops of the decoder's forward on the CPU: RMSNorm (with the
// residual add), SiLU-and-mul, and the neox (rotate-half) rotary embedding in place. Each is
// one call where the torch expression runs 3-8 ops (each a dispatch, an allocation and a
// pass over memory); at decode sizes ([32, 256]) the op overhead, not the arithmetic, was
// the cost.
//
// Same bits as the torch expressions they replace (tested): every product and sum is
// rounded on its own (no FMA contraction: the pragma below), the RMSNorm's sum of squares
// follows ATen's cascade_sum order for the vector width of torch's sum kernel (`lanes`: 8 on
// x86, where the sum is dispatched at most to its AVX2 copy), and SiLU's exp is the one
// torch's vectorized silu calls (SLEEF's 1-ulp expf, exported by libtorch_cpu) on the same
// elements (`lanes`: 16 under torch's AVX512 kernels), glibc's expf on the scalar tail.
//
// Portability: no -march flag. Hot loops are compiled for AVX-512, AVX2+FMA and baseline
// x86-64 (target attributes) and picked at the first call from the CPU's features, as in
// paged_attention_cpu.cpp.
#pragma GCC optimize("fp-contract=off")

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

// SLEEF's vector expf inside libtorch_cpu (what at::vec::Vectorized<float>::exp calls).
// Weak: if a torch build lacks them, silu falls back to expf per element (within 1 ulp).
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")
extern "C" __m512 Sleef_expf16_u10(__m512) __attribute__((weak));
extern "C" __m256 Sleef_expf8_u10(__m256) __attribute__((weak));
#pragma GCC pop_options

namespace {

typedef float V16 __attribute__((vector_size(64)));
typedef float V8 __attribute__((vector_size(32)));

template <typename V>
__attribute__((always_inline)) inline V load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}

template <typename V>
__attribute__((always_inline)) inline void store(float* p, V v) {
  std::memcpy(p, &v, sizeof(V));
}

template <typename V>
__attribute__((always_inline)) inline V square(const float* p) {
  const V v = load<V>(p);
  return v * v;
}

// Sum of x[i]**2 over one row in ATen's order (SumKernel.cpp: vectorized_inner_sum ->
// row_sum -> multi_row_sum, num_levels 4, ilp 4) for vectors of V's lane count: the squares
// (x.pow(2), rounded) are summed as vectors in 4 interleaved accumulators with a cascade
// every 2**level_power groups, folded, then the scalar tail and the lanes are added in order.
template <typename V>
__attribute__((always_inline)) inline float sum_squares(const float* x, int64_t h) {
  constexpr int64_t L = sizeof(V) / sizeof(float);
  if (h < L) {  // scalar_inner_sum: row_sum's 4 accumulators over single elements
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t e = 0; e < h / 4 * 4; ++e) acc[e % 4] += x[e] * x[e];
    for (int64_t e = h / 4 * 4; e < h; ++e) acc[0] += x[e] * x[e];
    return ((acc[0] + acc[1]) + acc[2]) + acc[3];
  }
  const int64_t n = h / L;  // whole vectors
  const int64_t groups = n / 4;
  int64_t log2 = 0;  // ceil(log2(groups)) as c10::CeilLog2 (1 for groups <= 2)
  if (groups <= 2) {
    log2 = 1;
  } else {
    while ((int64_t{1} << log2) < groups) ++log2;
  }
  const int64_t power = log2 / 4 > 4 ? log2 / 4 : 4;
  const int64_t step = int64_t{1} << power, mask = step - 1;
  V acc[4][4];
  for (auto& level : acc)
    for (auto& a : level) a = V{};
  int64_t i = 0;
  while (i + step <= groups) {
    for (int64_t j = 0; j < step; ++j, ++i)
      for (int k = 0; k < 4; ++k) acc[0][k] += square<V>(x + (4 * i + k) * L);
    for (int j = 1; j < 4; ++j) {
      for (int k = 0; k < 4; ++k) {
        acc[j][k] += acc[j - 1][k];
        acc[j - 1][k] = V{};
      }
      if ((i & (mask << (j * power))) != 0) break;
    }
  }
  for (; i < groups; ++i)
    for (int k = 0; k < 4; ++k) acc[0][k] += square<V>(x + (4 * i + k) * L);
  for (int j = 1; j < 4; ++j)
    for (int k = 0; k < 4; ++k) acc[0][k] += acc[j][k];
  for (int64_t v = groups * 4; v < n; ++v) acc[0][0] += square<V>(x + v * L);
  V part = acc[0][0];
  for (int k = 1; k < 4; ++k) part += acc[0][k];
  float total = 0.0f;
  for (int64_t e = n * L; e < h; ++e) total += x[e] * x[e];
  for (int64_t l = 0; l < L; ++l) total += part[l];
  return total;
}

// One row: out = (x * rsqrt(mean(x**2) + eps)) * w, as torch's composite rms_norm rounds it.
// residual non-null: x is first replaced by residual + x (written back into residual).
template <typename V>
__attribute__((always_inline)) inline void norm_row(const float* x, float* residual,
                                                    const float* w, float* out, int64_t h,
                                                    float eps, int lanes) {
  const float* src = x;
  if (residual != nullptr) {
    for (int64_t e = 0; e < h; ++e) residual[e] = residual[e] + x[e];
    src = residual;
  }
  const float ss = lanes == 16 ? sum_squares<V16>(src, h) : sum_squares<V8>(src, h);
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(h) + eps);
  for (int64_t e = 0; e < h; ++e) {
    const float y = src[e] * r;
    out[e] = y * w[e];
  }
}

struct Rows {  // a [A, B, H] float32 view, H contiguous; rows r = a * B + b
  float* data;
  int64_t b, sa, sb;
  float* row(int64_t r) const { return data + (r / b) * sa + (r % b) * sb; }
};

using NormFn = void (*)(Rows, float*, const float*, float*, int64_t, int64_t, int64_t, float,
                        int);

#define NORM_BODY                                                                \
  for (int64_t r = r0; r < r1; ++r)                                              \
    norm_row<V16>(x.row(r), residual ? residual + r * h : nullptr, w, out + r * h, h, eps, \
                  lanes);

__attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma"))) void norm_avx512(
    Rows x, float* residual, const float* w, float* out, int64_t r0, int64_t r1, int64_t h,
    float eps, int lanes) {
  NORM_BODY
}

__attribute__((target("avx2,fma"))) void norm_avx2(Rows x, float* residual, const float* w,
                                                   float* out, int64_t r0, int64_t r1,
                                                   int64_t h, float eps, int lanes) {
  NORM_BODY
}

void norm_baseline(Rows x, float* residual, const float* w, float* out, int64_t r0, int64_t r1,
                   int64_t h, float eps, int lanes) {
  NORM_BODY
}

// out[e] = silu(g[e]) * u[e], silu(g) = g / (1 + exp(-g)) as torch's silu then mul. Torch's
// vectorized loop takes 2 * lanes elements at a time and the rest one by one (expf); SLEEF's
// vector expf does the former here too, so each element's exp is the one torch computes.
template <int kIsa>
__attribute__((always_inline)) inline void silu_row(const float* g, const float* u, float* out,
                                                    int64_t n, int lanes) {
  int64_t e = 0;
  const int64_t block = 2 * lanes;
  const int64_t vec_end = n / block * block;
  if constexpr (kIsa == 2) {
    if (Sleef_expf16_u10 != nullptr && lanes == 16) {
      for (; e < vec_end; e += 16) {
        const V16 x = load<V16>(g + e);
        const V16 ex = reinterpret_cast<V16>(Sleef_expf16_u10(reinterpret_cast<__m512>(-x)));
        store<V16>(out + e, (x / (1.0f + ex)) * load<V16>(u + e));
      }
    }
  }
  if constexpr (kIsa >= 1) {
    if (Sleef_expf8_u10 != nullptr && lanes == 8) {
      for (; e < vec_end; e += 8) {
        const V8 x = load<V8>(g + e);
        const V8 ex = reinterpret_cast<V8>(Sleef_expf8_u10(reinterpret_cast<__m256>(-x)));
        store<V8>(out + e, (x / (1.0f + ex)) * load<V8>(u + e));
      }
    }
  }
  for (; e < n; ++e) {
    const float s = g[e] / (1.0f + std::exp(-g[e]));
    out[e] = s * u[e];
  }
}

#define SILU_BODY(ISA) \
  for (int64_t r = r0; r < r1; ++r) silu_row<ISA>(gu + r * sg, gu + r * sg + n, out + r * n, n, lanes);

__attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma"))) void silu_avx512(
    const float* gu, int64_t sg, float* out, int64_t r0, int64_t r1, int64_t n, int lanes) {
  SILU_BODY(2)
}

__attribute__((target("avx2,fma"))) void silu_avx2(const float* gu, int64_t sg, float* out,
                                                   int64_t r0, int64_t r1, int64_t n,
                                                   int lanes) {
  SILU_BODY(1)
}

void silu_baseline(const float* gu, int64_t sg, float* out, int64_t r0, int64_t r1, int64_t n,
                   int lanes) {
  SILU_BODY(0)
}

// Rotate-half RoPE of one head in place: for i < D/2,
//   x[i]       <- x[i] * cos[i] - x[i + D/2] * sin[i]
//   x[i + D/2] <- x[i + D/2] * cos[i + D/2] + x[i] * sin[i + D/2]
// (torch: xf * cos + cat(-x2, x1) * sin; each product rounded, then the sum).
__attribute__((always_inline)) inline void rope_head(float* __restrict x, const float* c,
                                                     const float* s, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    const float lo = a * c[i] + (-b) * s[i];
    const float hi = b * c[i + half] + a * s[i + half];
    x[i] = lo;
    x[i + half] = hi;
  }
}

struct Rope {
  float* x;  // [T, H, D]
  int64_t st, sh, h, d;
  const int64_t* pos;
  const float* cos;  // [P, D] rows, stride sc
  const float* sin;
  int64_t sc;
};

#define ROPE_BODY                                                        \
  for (int64_t t = t0; t < t1; ++t) {                                    \
    const float* c = p.cos + p.pos[t] * p.sc;                            \
    const float* s = p.sin + p.pos[t] * p.sc;                            \
    for (int64_t j = 0; j < p.h; ++j) rope_head(p.x + t * p.st + j * p.sh, c, s, p.d / 2); \
  }

__attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma"))) void rope_avx512(
    const Rope& p, int64_t t0, int64_t t1) {
  ROPE_BODY
}

__attribute__((target("avx2,fma"))) void rope_avx2(const Rope& p, int64_t t0, int64_t t1) {
  ROPE_BODY
}

void rope_baseline(const Rope& p, int64_t t0, int64_t t1) { ROPE_BODY }

int pick_isa() {  // 2 = AVX-512, 1 = AVX2 + FMA, 0 = baseline
  static const int isa = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq"))
      return 2;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
    return 0;
  }();
  return isa;
}

const char* isa_name() {
  const int i = pick_isa();
  return i == 2 ? "avx512" : i == 1 ? "avx2" : "baseline";
}

// Rows of ~16k elements per task: a decode's [32, 256] runs inline on the calling thread.
int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_elems)); }

Rows as_rows(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu(), "float32 CPU tensor expected");
  TORCH_CHECK(x.dim() == 2 || x.dim() == 3, "x: [T, H] or [T, B, H]");
  TORCH_CHECK(x.stride(-1) == 1, "x: last dim contiguous");
  if (x.dim() == 2) return Rows{x.data_ptr<float>(), 1, x.stride(0), 0};
  return Rows{x.data_ptr<float>(), x.size(1), x.stride(0), x.stride(1)};
}

at::Tensor norm_impl(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                     const at::Tensor& w, double eps, int64_t lanes) {
  const Rows rows = as_rows(x);
  const int64_t h = x.size(-1), n = x.numel() / std::max<int64_t>(1, h);
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == h,
              "weight: float32 [H], contiguous");
  TORCH_CHECK(lanes == 16 || lanes == 8, "lanes: 16 or 8");
  float* res = nullptr;
  if (residual.has_value()) {
    TORCH_CHECK(residual->scalar_type() == at::kFloat && residual->is_contiguous() &&
                    residual->sizes() == x.sizes(),
                "residual: float32, contiguous, x's shape");
    res = residual->data_ptr<float>();
  }
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (n == 0 || h == 0) return out;
  static const NormFn fns[3] = {norm_baseline, norm_avx2, norm_avx512};
  const NormFn fn = fns[pick_isa()];
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, n, grain(h), [&](int64_t r0, int64_t r1) {
    fn(rows, res, wp, op, r0, r1, h, e, static_cast<int>(lanes));
  });
  return out;
}

}  // namespace

// x [T, H] or [T, B, H] (H contiguous) -> rms_norm(x) * w, contiguous.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, int64_t lanes) {
  return norm_impl(x, c10::nullopt, w, eps, lanes);
}

// residual += x in place, then -> rms_norm(residual) * w.
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& w,
                        double eps, int64_t lanes) {
  return norm_impl(x, residual, w, eps, lanes);
}

// gate_up [T, 2I] (rows I-contiguous) -> silu(gate_up[:, :I]) * gate_up[:, I:], [T, I].
at::Tensor silu_and_mul(const at::Tensor& gate_up, int64_t lanes) {
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat && gate_up.device().is_cpu(),
              "gate_up: float32 CPU");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "gate_up: [T, 2I], last dim contiguous");
  TORCH_CHECK(lanes == 16 || lanes == 8, "lanes: 16 or 8");
  const int64_t t = gate_up.size(0), n = gate_up.size(1) / 2, sg = gate_up.stride(0);
  at::Tensor out = at::empty({t, n}, gate_up.options().memory_format(at::MemoryFormat::Contiguous));
  if (t == 0 || n == 0) return out;
  using Fn = void (*)(const float*, int64_t, float*, int64_t, int64_t, int64_t, int);
  static const Fn fns[3] = {silu_baseline, silu_avx2, silu_avx512};
  const Fn fn = fns[pick_isa()];
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, t, grain(2 * n), [&](int64_t r0, int64_t r1) {
    fn(gp, sg, op, r0, r1, n, static_cast<int>(lanes));
  });
  return out;
}

// x [T, H, D] (D contiguous, any T/H strides) rotated in place at positions [T] int64 from
// cos/sin [P, D] (rows D-contiguous).
void rotary_(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos,
             const at::Tensor& sin) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu() && x.dim() == 3 &&
                  x.stride(2) == 1,
              "x: float32 CPU [T, H, D], D contiguous");
  const int64_t t = x.size(0), d = x.size(2);
  TORCH_CHECK(d % 2 == 0, "rotary: D even");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 &&
                  positions.is_contiguous() && positions.size(0) == t,
              "positions: int64 [T], contiguous");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(1) == d &&
                  cos.stride(1) == 1 && sin.strides() == cos.strides(),
              "cos/sin: float32 [P, D], same strides, D contiguous");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_pos = cos.size(0);
  for (int64_t i = 0; i < t; ++i)
    TORCH_CHECK(pos[i] >= 0 && pos[i] < max_pos, "rotary: position ", pos[i],
                " outside the table [0, ", max_pos, ")");
  if (t == 0 || x.size(1) == 0) return;
  const Rope p{x.data_ptr<float>(), x.stride(0), x.stride(1), x.size(1), d, pos,
               cos.data_ptr<float>(), sin.data_ptr<float>(), cos.stride(0)};
  using Fn = void (*)(const Rope&, int64_t, int64_t);
  static const Fn fns[3] = {rope_baseline, rope_avx2, rope_avx512};
  const Fn fn = fns[pick_isa()];
  at::parallel_for(0, t, grain(x.size(1) * d), [&](int64_t t0, int64_t t1) { fn(p, t0, t1); });
}

// The kernels run without the GIL, as ATen's own Python bindings do: a served replica's
// event loop (requests in, deltas out) keeps running while its step thread computes.
// The arguments are converted (and the result returned) with the GIL held.
using NoGil = pybind11::call_guard<pybind11::gil_scoped_release>;
constexpr NoGil kNoGil{};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, kNoGil, "RMSNorm of float32 rows (CPU)");
  m.def("add_rms_norm", &add_rms_norm, kNoGil, "residual += x; RMSNorm(residual) (CPU)");
  m.def("silu_and_mul", &silu_and_mul, kNoGil, "silu(gate) * up of [T, 2I] (CPU)");
  m.def("rotary_", &rotary_, kNoGil, "neox rotary embedding in place (CPU)");
  m.def("isa", &isa_name, "the instruction set the kernels run with on this CPU");
}
