// y = x W^T (+ b) in float32 on the CPU, over W stored as panels of 32 output columns.
//
// Weight layout ("panels"): W [N, K] (out, in) as P = ceil(N / 32) panels, panel p holding
// columns 32p .. 32p+31 as [K][32] (k-major, the 32 outputs contiguous); the last panel is
// zero-padded. `pack` builds it once at load; the micro-kernel then streams a panel
// sequentially (one 128-byte row of it per k) while MR rows of x are broadcast against it:
// MR x 32 accumulators (MR <= 8: 16 zmm in the AVX-512 copy), an FMA per (row, 16 columns).
// The same kernel also reads a column-major W (W.t() contiguous: k stride N, panel stride 32)
// in place; the last partial panel is then copied into a zero-padded scratch panel.
//
// Reduction order: every output y[m, n] is one chain over k = 0 .. K-1 (acc = fma(x[m, k],
// W[n, k], acc), from 0), then + b[n]. The chain does not depend on M, on which row of a
// micro-tile the row sits in, or on the threads (they split panels and rows, never k), so a
// row's result is the same bits at any batch size: batch-invariant (aten's GEMM is not: MKL
// picks kernels and K blockings by M).
//
// Threads: torch's intra-op threads split the tasks (a chunk of panels x a block of rows), one
// contiguous share each in the order a single thread would run them; a thread done with its
// share takes tasks from the back of another's (`Shares`), so a thread preempted by another
// process (a served replica shares its cores with the HTTP path and Ray) does not hold up
// the whole GEMM at its closing barrier. One thread for small work.
//
// Portability: no -march flag. The kernel is compiled for AVX-512, AVX2+FMA and baseline
// x86-64 (target attributes) and picked at the first call from the CPU's features, as in
// paged_attention_cpu.cpp (slimserve_kernels/README.md). The baseline copy has no FMA
// instruction: it multiplies then adds (its own bits, still batch-invariant).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec16.h"

namespace {

constexpr int64_t kPanel = 32;  // output columns per panel
constexpr int64_t kMaxRows = 8;  // rows of x per micro-tile
// Software prefetch distance in k rows of a panel: 2 KiB ahead at 3+ rows; at 1-2 rows a
// k row takes a few cycles, so 6 KiB.
template <int MR>
constexpr int64_t kAhead = MR <= 2 ? 48 : 16;

// The operands of one call. W element (n, k) sits at w[(n / 32) * w_panel + k * w_k + n % 32].
struct Problem {
  const float* x;  // [M, K], row stride x_row, k contiguous
  const float* w;
  const float* bias;  // [N] or null
  float* y;  // [M, N] contiguous
  int64_t m, k, n, x_row, w_panel, w_k;
};

// acc[r][2j + h] = sum_k x[r, k] * panel_j[k, 16h .. 16h+16), r < MR, j < NP: one FMA chain
// per output in k order. NP panels side by side keep >= 8 chains in flight at few rows (an
// FMA's latency is 4 cycles on 2 ports: one row of one panel would wait on its 2 chains).
template <int MR, int NP, bool PF>
__attribute__((always_inline)) inline void tile(const float* __restrict x, int64_t x_row,
                                                const float* __restrict panel, int64_t w_panel,
                                                int64_t w_k, int64_t k_n,
                                                Vec16 (&acc)[MR][2 * NP]) {
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 2 * NP; ++j) acc[r][j] = Vec16{};
  for (int64_t k = 0; k < k_n; ++k) {
    Vec16 w[2 * NP];
    for (int j = 0; j < NP; ++j) {
      w[2 * j] = load16(panel + j * w_panel + k * w_k);
      w[2 * j + 1] = load16(panel + j * w_panel + k * w_k + 16);
      if (PF) {  // the panel's first pass: fetch kAhead rows ahead (the next panel at the end)
        __builtin_prefetch(panel + j * w_panel + (k + kAhead<MR>) * w_k);
        __builtin_prefetch(panel + j * w_panel + (k + kAhead<MR>) * w_k + 16);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const float a = x[r * x_row + k];
      for (int j = 0; j < 2 * NP; ++j)
        acc[r][j] = acc[r][j] + a * w[j];  // contracted to one FMA (checked in the objdump)
    }
  }
}

// y[m0 + r, n0 + c] = acc + bias for the first `cols` columns of each of the tile's rows.
template <int MR, int NP>
__attribute__((always_inline)) inline void store_tile(const Problem& p, int64_t m0, int64_t n0,
                                                      int64_t cols, Vec16 (&acc)[MR][2 * NP]) {
  constexpr int64_t width = NP * kPanel;
  for (int r = 0; r < MR; ++r) {
    float* y = p.y + (m0 + r) * p.n + n0;
    if (cols == width) {
      for (int j = 0; j < 2 * NP; ++j) {
        Vec16 v = acc[r][j];
        if (p.bias != nullptr) v += load16(p.bias + n0 + 16 * j);
        store16(y + 16 * j, v);
      }
      continue;
    }
    float out[width];
    for (int j = 0; j < 2 * NP; ++j) store16(out + 16 * j, acc[r][j]);
    for (int64_t c = 0; c < cols; ++c) y[c] = out[c] + (p.bias != nullptr ? p.bias[n0 + c] : 0.0f);
  }
}

// Rows m0 .. m0+MR of x against NP panels starting at `panel` (column n0), cols valid columns.
template <int MR, int NP, bool PF>
__attribute__((always_inline)) inline void rows_panels(const Problem& p, int64_t m0,
                                                       const float* panel, int64_t w_panel,
                                                       int64_t w_k, int64_t n0, int64_t cols) {
  Vec16 acc[MR][2 * NP];
  tile<MR, NP, PF>(p.x + m0 * p.x_row, p.x_row, panel, w_panel, w_k, p.k, acc);
  store_tile<MR, NP>(p, m0, n0, cols, acc);
}

// The last MR (< 8) rows against panels [0, count) of a chunk: NP(MR) panels at a time so
// that MR * 2 * NP >= 8 chains run, the rest one panel at a time.
template <int MR, bool PF>
__attribute__((always_inline)) inline void tail_rows(const Problem& p, int64_t m0,
                                                     const float* panel, int64_t w_panel,
                                                     int64_t w_k, int64_t n0, int64_t count,
                                                     int64_t cols_last) {
  constexpr int NP = MR == 1 ? 4 : MR <= 3 ? 2 : 1;
  int64_t j = 0;
  if (NP > 1)
    for (; j + NP <= count && (j + NP < count || cols_last == kPanel); j += NP)
      rows_panels<MR, NP, PF>(p, m0, panel + j * w_panel, w_panel, w_k, n0 + j * kPanel,
                          NP * kPanel);
  for (; j < count; ++j)
    rows_panels<MR, 1, PF>(p, m0, panel + j * w_panel, w_panel, w_k, n0 + j * kPanel,
                       j + 1 < count ? kPanel : cols_last);
}

// Every row of x against `count` consecutive panels from `panel` (column n0); the last one
// has cols_last valid columns. Full 8-row tiles go panel by panel (a panel stays in L1 across
// the row tiles), then the leftover rows.
__attribute__((always_inline)) inline void chunk(const Problem& p, const float* panel,
                                                 int64_t w_panel, int64_t w_k, int64_t n0,
                                                 int64_t count, int64_t cols_last) {
  const int64_t full = p.m / kMaxRows * kMaxRows;
  for (int64_t j = 0; j < count; ++j) {
    const int64_t cols = j + 1 < count ? kPanel : cols_last;
    const float* pj = panel + j * w_panel;
    if (full > 0) rows_panels<8, 1, true>(p, 0, pj, w_panel, w_k, n0 + j * kPanel, cols);
    for (int64_t m0 = kMaxRows; m0 < full; m0 += kMaxRows)
      rows_panels<8, 1, false>(p, m0, pj, w_panel, w_k, n0 + j * kPanel, cols);
  }
  if (full == 0) {  // the panels' first pass
    switch (p.m) {
      case 7: tail_rows<7, true>(p, 0, panel, w_panel, w_k, n0, count, cols_last); break;
      case 6: tail_rows<6, true>(p, 0, panel, w_panel, w_k, n0, count, cols_last); break;
      case 5: tail_rows<5, true>(p, 0, panel, w_panel, w_k, n0, count, cols_last); break;
      case 4: tail_rows<4, true>(p, 0, panel, w_panel, w_k, n0, count, cols_last); break;
      case 3: tail_rows<3, true>(p, 0, panel, w_panel, w_k, n0, count, cols_last); break;
      case 2: tail_rows<2, true>(p, 0, panel, w_panel, w_k, n0, count, cols_last); break;
      case 1: tail_rows<1, true>(p, 0, panel, w_panel, w_k, n0, count, cols_last); break;
      default: break;
    }
    return;
  }
  switch (p.m - full) {
    case 7: tail_rows<7, false>(p, full, panel, w_panel, w_k, n0, count, cols_last); break;
    case 6: tail_rows<6, false>(p, full, panel, w_panel, w_k, n0, count, cols_last); break;
    case 5: tail_rows<5, false>(p, full, panel, w_panel, w_k, n0, count, cols_last); break;
    case 4: tail_rows<4, false>(p, full, panel, w_panel, w_k, n0, count, cols_last); break;
    case 3: tail_rows<3, false>(p, full, panel, w_panel, w_k, n0, count, cols_last); break;
    case 2: tail_rows<2, false>(p, full, panel, w_panel, w_k, n0, count, cols_last); break;
    case 1: tail_rows<1, false>(p, full, panel, w_panel, w_k, n0, count, cols_last); break;
    default: break;
  }
}

constexpr int64_t kChunk = 4;  // panels per chunk (L2-resident at K <= ~4k)
constexpr int64_t kRowBlock = 256;  // rows of x per task (a multiple of kMaxRows)

// Panels [begin, end) in chunks. A partial last panel of a column-major W (not padded in
// memory) runs alone from a zero-padded scratch copy; a packed W's last panel is padded.
__attribute__((always_inline)) inline void panels(const Problem& p, int64_t begin, int64_t end) {
  const bool packed = p.w_k == kPanel;
  const int64_t tail_cols = p.n - (p.n - 1) / kPanel * kPanel;  // of the last panel
  const int64_t last = (p.n - 1) / kPanel;
  const int64_t stop = !packed && tail_cols < kPanel && end > last ? last : end;
  for (int64_t pi = begin; pi < stop; pi += kChunk) {
    const int64_t count = std::min(kChunk, stop - pi);
    const int64_t cols_last = pi + count - 1 == last ? tail_cols : kPanel;
    chunk(p, p.w + pi * p.w_panel, p.w_panel, p.w_k, pi * kPanel, count, cols_last);
  }
  if (stop < end) {
    std::vector<float> scratch(p.k * kPanel, 0.0f);
    const float* src = p.w + last * p.w_panel;
    for (int64_t k = 0; k < p.k; ++k)
      for (int64_t j = 0; j < tail_cols; ++j) scratch[k * kPanel + j] = src[k * p.w_k + j];
    chunk(p, scratch.data(), 0, kPanel, last * kPanel, 1, tail_cols);
  }
}

// The same code compiled for three instruction sets, picked at run time by what the CPU
// supports (see paged_attention_cpu.cpp for why not target_clones).
__attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma")))
void panels_avx512(const Problem& p, int64_t begin, int64_t end) {
  panels(p, begin, end);
}

__attribute__((target("avx2,fma")))
void panels_avx2(const Problem& p, int64_t begin, int64_t end) {
  panels(p, begin, end);
}

void panels_baseline(const Problem& p, int64_t begin, int64_t end) { panels(p, begin, end); }

using PanelsFn = void (*)(const Problem&, int64_t, int64_t);

PanelsFn pick() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq"))
    return panels_avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return panels_avx2;
  return panels_baseline;
}

const PanelsFn kPanels = pick();

const char* isa_name() {
  return kPanels == panels_avx512 ? "avx512" : kPanels == panels_avx2 ? "avx2" : "baseline";
}

// Tasks [0, n) as one contiguous share per thread. A thread runs its own share from the front,
// then takes tasks from the back of the others'. A share's (front, back) sit in one atomic
// word, so each task is claimed exactly once.
class Shares {
 public:
  static constexpr int64_t kMaxTasks = int64_t{1} << 32;  // front and back: 32 bits each

  Shares(int64_t n, int64_t parts) : slots_(static_cast<size_t>(parts)) {
    for (int64_t t = 0; t < parts; ++t)
      slots_[t].word.store(pack(n * t / parts, n * (t + 1) / parts));
  }

  // Thread t's next task, or -1 when every share is empty.
  int64_t next(int64_t t) {
    const int64_t parts = static_cast<int64_t>(slots_.size());
    int64_t i = take(t, true);
    for (int64_t s = 1; i < 0 && s < parts; ++s) i = take((t + s) % parts, false);
    return i;
  }

 private:
  static uint64_t pack(int64_t front, int64_t back) {
    return static_cast<uint64_t>(front) << 32 | static_cast<uint64_t>(back);
  }

  int64_t take(int64_t share, bool front) {
    std::atomic<uint64_t>& slot = slots_[share].word;
    uint64_t cur = slot.load();
    for (;;) {
      const int64_t f = static_cast<int64_t>(cur >> 32);
      const int64_t b = static_cast<int64_t>(cur & 0xFFFFFFFFu);
      if (f >= b) return -1;
      if (slot.compare_exchange_weak(cur, front ? pack(f + 1, b) : pack(f, b - 1)))
        return front ? f : b - 1;
    }
  }

  struct alignas(64) Slot {  // one cache line each: a claim does not stall the others'
    std::atomic<uint64_t> word{0};
  };
  std::vector<Slot> slots_;
};

// How y's work is cut: `blocks` blocks of rows times chunks of `width` panels (one panel
// a task when all rows fit one block, as many tasks as the panels, as in a panel split).
struct Tasks {
  int64_t blocks, width, count;
};

Tasks tasks_of(int64_t m, int64_t panels_n) {
  const int64_t blocks = (m + kRowBlock - 1) / kRowBlock;
  const int64_t width = blocks == 1 ? 1 : kChunk;
  return Tasks{blocks, width, blocks * ((panels_n + width - 1) / width)};
}

// All of y over `threads` threads: task i is panel chunk i / blocks x row block i % blocks
// (chunk-major: a share runs as the panel split did, each chunk over every row).
void split(const Problem& p, int64_t panels_n, const Tasks& tasks, int64_t threads) {
  TORCH_CHECK(tasks.count < Shares::kMaxTasks, "linear: too many tasks to split");
  Shares shares(tasks.count, threads);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t i = shares.next(t); i >= 0; i = shares.next(t)) {
        const int64_t c = i / tasks.blocks, r0 = i % tasks.blocks * kRowBlock;
        Problem rows = p;  // rows [r0, r0 + kRowBlock) of x and y
        rows.x += r0 * p.x_row, rows.y += r0 * p.n, rows.m = std::min(kRowBlock, p.m - r0);
        kPanels(rows, c * tasks.width, std::min(panels_n, (c + 1) * tasks.width));
      }
  });
}

// W [N, K] float32 (any strides) -> panels [ceil(N / 32), K, 32], the tail zero-padded.
at::Tensor pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.device().is_cpu(),
              "pack: W must be a 2-D float32 CPU tensor [N, K]");
  const int64_t n = w.size(0), k = w.size(1), p = (n + kPanel - 1) / kPanel;
  at::Tensor padded = at::zeros({p * kPanel, k}, w.options());
  padded.narrow(0, 0, n).copy_(w);
  // [P, 32, K] -> [P, K, 32]
  return padded.view({p, kPanel, k}).transpose(1, 2).contiguous();
}

// x [..., K] float32 times W -> [..., N]. `w` is panels [P, K, 32] from pack(), or a
// column-major [N, K] (stride (1, N)). `n` is W's N (panels are padded). The reshape and
// the contiguity fix are done here: a Python wrapper doing them cost ~3 us a call, ~60 us of
// a 1.7 ms batch-1 decode step over its 17 linears.
at::Tensor linear(const at::Tensor& x_in, const at::Tensor& w, int64_t n,
                  const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x_in.dim() >= 1 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
              "linear: x must be a float32 CPU tensor [..., K]");
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.device().is_cpu(), "linear: W float32 CPU");
  const int64_t k = x_in.size(-1);
  at::Tensor x = x_in.reshape({-1, k});
  if (x.stride(1) != 1 && k > 1) x = x.contiguous();
  const int64_t m = x.size(0);
  Problem p{};
  p.x = x.data_ptr<float>();
  p.m = m, p.k = k, p.n = n, p.x_row = x.stride(0);
  if (w.dim() == 3) {
    TORCH_CHECK(w.is_contiguous() && w.size(1) == k && w.size(2) == kPanel &&
                    w.size(0) == (n + kPanel - 1) / kPanel,
                "linear: packed W must be [ceil(N / 32), K, 32] contiguous");
    p.w_panel = k * kPanel, p.w_k = kPanel;
  } else {
    TORCH_CHECK(w.dim() == 2 && w.size(0) == n && w.size(1) == k &&
                    (w.stride(0) == 1 || n == 1) && (w.stride(1) == n || k == 1),
                "linear: W must be packed or column-major [N, K] with strides (1, N)");
    p.w_panel = kPanel, p.w_k = n;
  }
  p.w = w.data_ptr<float>();
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == at::kFloat && b.numel() == n, "linear: bias must be [N] float32");
    p.bias = b.data_ptr<float>();
  }
  std::vector<int64_t> shape = x_in.sizes().vec();
  shape.back() = n;
  at::Tensor y = at::empty(shape, x.options());
  p.y = y.data_ptr<float>();
  if (m == 0 || n == 0) return y;
  const int64_t panels_n = (n + kPanel - 1) / kPanel;
  // A thread per >= ~64k multiply-adds (m * k * 32 per panel): a fork costs a few
  // microseconds.
  const int64_t grain = std::max<int64_t>(1, 2048 / std::max<int64_t>(1, m * k));
  const Tasks tasks = tasks_of(m, panels_n);
  const int64_t threads = std::min<int64_t>(
      {at::get_num_threads(), (panels_n + grain - 1) / grain, tasks.count});
  if (threads <= 1 || at::in_parallel_region()) {
    kPanels(p, 0, panels_n);
  } else {
    split(p, panels_n, tasks, threads);
  }
  return y;
}

}  // namespace

// The kernels run without the GIL, as ATen's own Python bindings do: a served replica's
// event loop (requests in, deltas out) keeps running while its step thread computes.
// The arguments are converted (and the result returned) with the GIL held.
using NoGil = pybind11::call_guard<pybind11::gil_scoped_release>;
constexpr NoGil kNoGil{};

// The tasks `Shares(n, parts)` hands out to a given sequence of claims (thread ids), -1 where
// none is left: the work split's rules, checked by tests/kernels/test_cpu_linear.py.
std::vector<int64_t> shares_claims(int64_t n, int64_t parts, const std::vector<int64_t>& order) {
  TORCH_CHECK(n >= 0 && n < Shares::kMaxTasks && parts > 0 && parts <= 4096,
              "shares_claims: n in [0, 2**32), parts in [1, 4096]");
  Shares shares(n, parts);
  std::vector<int64_t> out;
  for (const int64_t t : order) {
    TORCH_CHECK(t >= 0 && t < parts, "shares_claims: thread ", t, " out of range");
    out.push_back(shares.next(t));
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("shares_claims", &shares_claims, "the tasks Shares(n, parts) gives a sequence of claims");
  m.def("pack", &pack, kNoGil, "W [N, K] float32 -> panels [ceil(N / 32), K, 32] (zero-padded)");
  m.def("linear", &linear, kNoGil, "x [..., K] @ W^T (+ b) over packed or column-major W (CPU float32)");
  m.def("isa", &isa_name, "the instruction set the kernel runs with on this CPU");
}
