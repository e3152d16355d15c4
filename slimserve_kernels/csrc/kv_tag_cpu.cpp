// A KV chunk's integrity tag (xxh3_64, seed 0, xxHash's default secret: the digest of the
// `xxhash` package, bit for bit) computed while the chunk's bytes are copied, in one pass.
//
// Why: the export copies the KV into the wire buffer and the import copies it into the paged
// cache; hashing each piece after its copy reads every byte a second time, and on the CPU
// that second pass (~60 GB/s from cache) was 4-6% of a same-node transfer (docs/kv_transfer.md).
// Here each 64-byte stripe is loaded once, stored to the destination and folded into the
// hash from the same register: the copy is memory-bound and the hash's arithmetic hides
// under its loads.
//
// The state streams, so a tag can be fed in any pieces (header, then layer by layer, some
// pieces copied, some only hashed) and gives xxh3_64 of their concatenation. XXH3's long-input
// algorithm (inputs over 240 bytes): eight 64-bit lanes accumulate 64-byte stripes, each
// stripe with the secret at 8 * (its index mod 16) bytes; every 16 stripes the lanes are
// scrambled; the last 64 bytes of the input are folded once more with the secret at 121; the
// lanes are merged with the input's length. Only stripes that are followed by more input are
// folded as regular stripes, so the state holds back the last 1-64 bytes until it knows.
// Inputs of 240 bytes or fewer use other formulas: the state keeps their bytes (`head`) and
// the Python side hashes them with the package.
//
// Portability: no -march flag. The stripe loop is compiled for AVX-512, AVX2 and baseline
// x86-64 (target attributes) and picked at the first call, as in the other csrc files.
#include <torch/extension.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <immintrin.h>

namespace {

constexpr int kStripe = 64;
constexpr int kStripesPerBlock = 16;  // (secret size 192 - 64) / 8
constexpr int kScrambleAt = 192 - 64;
constexpr int kLastAt = 192 - 64 - 7;
constexpr int kMergeAt = 11;
constexpr int64_t kShortMax = 240;
constexpr uint64_t kPrime32_1 = 0x9E3779B1ULL;
constexpr uint64_t kPrime64_1 = 0x9E3779B185EBCA87ULL;

// xxHash's default secret (kSecret), a constant of the algorithm.
alignas(64) const uint8_t kSecret[192] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad,
    0x1c, 0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3,
    0x67, 0x1f, 0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc,
    0xff, 0x72, 0x21, 0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6,
    0x81, 0x3a, 0x26, 0x4c, 0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65,
    0x8b, 0x1b, 0x53, 0x2e, 0xa3, 0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19,
    0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8, 0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9,
    0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d, 0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31,
    0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64, 0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb,
    0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb, 0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0,
    0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e, 0x2b, 0x16, 0xbe, 0x58, 0x7d,
    0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce, 0x45, 0xcb, 0x3a, 0x8f,
    0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e};

// The streaming state, kept in a uint8 tensor the Python side owns (sizeof(State) bytes).
struct State {
  uint64_t acc[8];
  int64_t total;     // bytes fed
  int64_t stripes;   // regular stripes folded
  int64_t held;      // bytes in `tail` not folded yet (1-64 once total > 0)
  uint8_t tail[64];  // the held bytes
  uint8_t last[64];  // the last folded stripe (the final stripe may reach back into it)
  uint8_t head[kShortMax];  // the first 240 bytes (a short input's digest needs them)
};

// One run over `n` bytes at `src` (a multiple of 64, every stripe followed by more input):
// folds each stripe and, when `dst` is set, stores it there. Returns the new stripe count.
using StripeFn = int64_t (*)(uint64_t* acc, int64_t stripes, const uint8_t* src, uint8_t* dst,
                             int64_t n);

inline uint64_t read64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

inline uint64_t fold_1(uint64_t acc_i, uint64_t data_swapped, uint64_t data, uint64_t key) {
  const uint64_t dk = data ^ key;
  return acc_i + data_swapped + (dk & 0xFFFFFFFFULL) * (dk >> 32);
}

// Scalar stripe: lane i takes (data_i ^ key_i) lo32 * hi32 and lane i^1's raw data.
inline void fold_scalar(uint64_t* acc, const uint8_t* p, const uint8_t* key) {
  uint64_t d[8];
  for (int i = 0; i < 8; ++i) d[i] = read64(p + 8 * i);
  for (int i = 0; i < 8; ++i) acc[i] = fold_1(acc[i], d[i ^ 1], d[i], read64(key + 8 * i));
}

inline void scramble_scalar(uint64_t* acc) {
  for (int i = 0; i < 8; ++i) {
    uint64_t a = acc[i];
    a ^= a >> 47;
    a ^= read64(kSecret + kScrambleAt + 8 * i);
    acc[i] = a * kPrime32_1;
  }
}

int64_t stripes_baseline(uint64_t* acc, int64_t s, const uint8_t* src, uint8_t* dst, int64_t n) {
  for (int64_t o = 0; o < n; o += kStripe) {
    if (dst) std::memcpy(dst + o, src + o, kStripe);
    fold_scalar(acc, src + o, kSecret + 8 * (s % kStripesPerBlock));
    if (++s % kStripesPerBlock == 0) scramble_scalar(acc);
  }
  return s;
}

__attribute__((target("avx2"))) int64_t stripes_avx2(uint64_t* acc, int64_t s,
                                                     const uint8_t* src, uint8_t* dst,
                                                     int64_t n) {
  __m256i a[2] = {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc)),
                  _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + 4))};
  const __m256i prime = _mm256_set1_epi32(static_cast<int>(kPrime32_1));
  for (int64_t o = 0; o < n; o += kStripe) {
    const uint8_t* key = kSecret + 8 * (s % kStripesPerBlock);
    for (int h = 0; h < 2; ++h) {
      const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + o + 32 * h));
      if (dst) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + o + 32 * h), d);
      const __m256i dk =
          _mm256_xor_si256(d, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(key + 32 * h)));
      const __m256i prod = _mm256_mul_epu32(dk, _mm256_srli_epi64(dk, 32));
      const __m256i swapped = _mm256_shuffle_epi32(d, _MM_SHUFFLE(1, 0, 3, 2));
      a[h] = _mm256_add_epi64(prod, _mm256_add_epi64(a[h], swapped));
    }
    if (++s % kStripesPerBlock == 0) {
      for (int h = 0; h < 2; ++h) {
        __m256i x = _mm256_xor_si256(a[h], _mm256_srli_epi64(a[h], 47));
        x = _mm256_xor_si256(x, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                    kSecret + kScrambleAt + 32 * h)));
        const __m256i lo = _mm256_mul_epu32(x, prime);
        const __m256i hi = _mm256_mul_epu32(_mm256_srli_epi64(x, 32), prime);
        a[h] = _mm256_add_epi64(lo, _mm256_slli_epi64(hi, 32));
      }
    }
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc), a[0]);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + 4), a[1]);
  return s;
}

__attribute__((target("avx512f"))) int64_t stripes_avx512(uint64_t* acc, int64_t s,
                                                         const uint8_t* src, uint8_t* dst,
                                                         int64_t n) {
  __m512i a = _mm512_loadu_si512(acc);
  const __m512i prime = _mm512_set1_epi32(static_cast<int>(kPrime32_1));
  const __m512i scramble_key = _mm512_loadu_si512(kSecret + kScrambleAt);
  for (int64_t o = 0; o < n; o += kStripe) {
    const __m512i d = _mm512_loadu_si512(src + o);
    if (dst) _mm512_storeu_si512(dst + o, d);
    const __m512i dk =
        _mm512_xor_si512(d, _mm512_loadu_si512(kSecret + 8 * (s % kStripesPerBlock)));
    const __m512i prod = _mm512_mul_epu32(dk, _mm512_srli_epi64(dk, 32));
    const __m512i swapped = _mm512_shuffle_epi32(d, static_cast<_MM_PERM_ENUM>(_MM_SHUFFLE(1, 0, 3, 2)));
    a = _mm512_add_epi64(prod, _mm512_add_epi64(a, swapped));
    if (++s % kStripesPerBlock == 0) {
      __m512i x = _mm512_xor_si512(a, _mm512_srli_epi64(a, 47));
      x = _mm512_xor_si512(x, scramble_key);
      const __m512i lo = _mm512_mul_epu32(x, prime);
      const __m512i hi = _mm512_mul_epu32(_mm512_srli_epi64(x, 32), prime);
      a = _mm512_add_epi64(lo, _mm512_slli_epi64(hi, 32));
    }
  }
  _mm512_storeu_si512(acc, a);
  return s;
}

// The same loads and stores as the stripe loops, without the hash: the copy of a chunk
// that needs no tag (a verified one), and the baseline its tag's cost is measured against.
using CopyFn = void (*)(uint8_t* dst, const uint8_t* src, int64_t n);

void copy_baseline(uint8_t* dst, const uint8_t* src, int64_t n) { std::memcpy(dst, src, n); }

__attribute__((target("avx2"))) void copy_avx2(uint8_t* dst, const uint8_t* src, int64_t n) {
  int64_t o = 0;
  for (; o + kStripe <= n; o += kStripe)
    for (int h = 0; h < 2; ++h)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + o + 32 * h),
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + o + 32 * h)));
  std::memcpy(dst + o, src + o, n - o);
}

__attribute__((target("avx512f"))) void copy_avx512(uint8_t* dst, const uint8_t* src,
                                                   int64_t n) {
  int64_t o = 0;
  for (; o + kStripe <= n; o += kStripe) _mm512_storeu_si512(dst + o, _mm512_loadu_si512(src + o));
  std::memcpy(dst + o, src + o, n - o);
}

// SLIMSERVE_CPU_ISA=avx2 | baseline caps the pick (tests run each copy on one machine).
int pick_isa() {  // 2 = AVX-512, 1 = AVX2, 0 = baseline
  static const int isa = [] {
    __builtin_cpu_init();
    const char* cap = std::getenv("SLIMSERVE_CPU_ISA");
    const std::string want = cap ? cap : "";
    if (__builtin_cpu_supports("avx512f") && want != "avx2" && want != "baseline") return 2;
    if (__builtin_cpu_supports("avx2") && want != "baseline") return 1;
    return 0;
  }();
  return isa;
}

const char* isa_name() {
  const int i = pick_isa();
  return i == 2 ? "avx512" : i == 1 ? "avx2" : "baseline";
}

StripeFn stripe_fn() {
  static const StripeFn fns[3] = {stripes_baseline, stripes_avx2, stripes_avx512};
  return fns[pick_isa()];
}

CopyFn copy_fn() {
  static const CopyFn fns[3] = {copy_baseline, copy_avx2, copy_avx512};
  return fns[pick_isa()];
}

State* state_of(const torch::Tensor& t) {
  TORCH_CHECK(t.is_cpu() && t.scalar_type() == torch::kUInt8 && t.is_contiguous() &&
                  t.numel() == static_cast<int64_t>(sizeof(State)),
              "kv_tag: state must be a contiguous CPU uint8 tensor of ", sizeof(State),
              " bytes");
  return reinterpret_cast<State*>(t.data_ptr<uint8_t>());
}

const uint8_t* bytes_of(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.is_cpu() && t.is_contiguous(), "kv_tag: ", what, " must be contiguous on the CPU");
  return static_cast<const uint8_t*>(t.data_ptr());
}

uint8_t* writable(const torch::Tensor& t, const char* what) {
  return static_cast<uint8_t*>(const_cast<void*>(static_cast<const void*>(bytes_of(t, what))));
}

int64_t nbytes(const torch::Tensor& t) { return t.numel() * t.element_size(); }

// Feeds n bytes at src (stored to dst as well when dst is set).
void feed(State* st, const uint8_t* src, uint8_t* dst, int64_t n) {
  if (st->total < kShortMax) {
    const int64_t k = std::min<int64_t>(n, kShortMax - st->total);
    std::memcpy(st->head + st->total, src, k);
  }
  st->total += n;
  if (st->held + n <= kStripe) {  // nothing is known to follow yet: hold it
    std::memcpy(st->tail + st->held, src, n);
    if (dst) std::memcpy(dst, src, n);
    st->held += n;
    return;
  }
  const StripeFn run = stripe_fn();
  if (st->held > 0) {  // complete the held stripe: more input follows it, so it is regular
    const int64_t fill = kStripe - st->held;
    std::memcpy(st->tail + st->held, src, fill);
    if (dst) {
      std::memcpy(dst, src, fill);
      dst += fill;
    }
    src += fill;
    n -= fill;
    st->stripes = run(st->acc, st->stripes, st->tail, nullptr, kStripe);
    std::memcpy(st->last, st->tail, kStripe);
  }
  // n > 0 here. Fold every stripe that is followed by more input; hold the last 1-64 bytes.
  const int64_t body = ((n - 1) / kStripe) * kStripe;
  if (body > 0) {
    st->stripes = run(st->acc, st->stripes, src, dst, body);
    std::memcpy(st->last, src + body - kStripe, kStripe);
  }
  std::memcpy(st->tail, src + body, n - body);
  if (dst) std::memcpy(dst + body, src + body, n - body);
  st->held = n - body;
}

uint64_t mul128_fold64(uint64_t a, uint64_t b) {
  const unsigned __int128 p = static_cast<unsigned __int128>(a) * b;
  return static_cast<uint64_t>(p) ^ static_cast<uint64_t>(p >> 64);
}

}  // namespace

// A fresh state (xxh3_64's initial lanes), as a uint8 tensor.
torch::Tensor state_new() {
  auto t = torch::zeros({static_cast<int64_t>(sizeof(State))}, torch::kUInt8);
  static const uint64_t init[8] = {0xC2B2AE3DULL,         0x9E3779B185EBCA87ULL,
                                   0xC2B2AE3D27D4EB4FULL, 0x165667B19E3779F9ULL,
                                   0x85EBCA77C2B2AE63ULL, 0x85EBCA77ULL,
                                   0x27D4EB2F165667C5ULL, 0x9E3779B1ULL};
  std::memcpy(state_of(t)->acc, init, sizeof(init));
  return t;
}

// Hashes src's bytes (any contiguous CPU tensor).
void update(torch::Tensor state, torch::Tensor src) {
  feed(state_of(state), bytes_of(src, "src"), nullptr, nbytes(src));
}

// Copies src's bytes into dst (same byte size, both contiguous) and hashes them, one pass.
void copy(torch::Tensor state, torch::Tensor dst, torch::Tensor src) {
  TORCH_CHECK(nbytes(dst) == nbytes(src), "kv_tag.copy: dst has ", nbytes(dst),
              " bytes, src ", nbytes(src));
  feed(state_of(state), bytes_of(src, "src"), writable(dst, "dst"), nbytes(src));
}

// Copies n bytes at src to dst (when dst is set), hashing them into st (when st is set).
static void put(State* st, const uint8_t* src, uint8_t* dst, int64_t n) {
  if (st != nullptr) {
    feed(st, src, dst, n);
  } else if (dst != nullptr) {
    copy_fn()(dst, src, n);
  }
}

static State* maybe_state(const c10::optional<torch::Tensor>& state) {
  return state.has_value() ? state_of(*state) : nullptr;
}

// Copies src [A, B, ...] plane by plane (src[a, b] contiguous, any strides over A and B:
// a chunk's token range of a longer export) into dst (contiguous, the planes back to back),
// hashing them in that order when a state is given; one call per chunk, not one per plane.
void copy_planes(c10::optional<torch::Tensor> state, torch::Tensor dst, torch::Tensor src) {
  TORCH_CHECK(src.is_cpu() && src.dim() >= 2,
              "kv_tag.copy_planes: src must be a CPU tensor of 2+ dims");
  const int64_t a = src.size(0), b = src.size(1), size = src.element_size();
  TORCH_CHECK(a * b == 0 || src[0][0].is_contiguous(),
              "kv_tag.copy_planes: src's planes must be contiguous");
  const int64_t plane = a * b == 0 ? 0 : src[0][0].numel() * size;
  TORCH_CHECK(nbytes(dst) == a * b * plane, "kv_tag.copy_planes: dst has ", nbytes(dst),
              " bytes, src ", a * b * plane);
  if (a * b == 0) return;
  State* st = maybe_state(state);
  uint8_t* out = writable(dst, "dst");
  const auto* base = static_cast<const uint8_t*>(src.data_ptr());
  const int64_t s0 = src.stride(0) * size, s1 = src.stride(1) * size;
  pybind11::gil_scoped_release released;  // the arguments are checked: copy without the GIL
  for (int64_t i = 0; i < a; ++i)
    for (int64_t j = 0; j < b; ++j, out += plane) put(st, base + i * s0 + j * s1, out, plane);
}

// An import's write of one chunk into a paged cache, all layers in one call: src holds the
// chunk's [L, P, n, ...] (contiguous bytes: its K/V, or its scales), cache is
// [L, P, num_blocks, block_size, ...] (contiguous), runs [R, 3] int64 rows (j, block, k):
// the chunk's blocks j .. j+k-1 go to cache blocks block .. block+k-1 (ascending j, not
// overlapping). With a state every src byte is hashed in order, the blocks not written too.
void copy_blocks(c10::optional<torch::Tensor> state, torch::Tensor src, torch::Tensor cache,
                 torch::Tensor runs) {
  TORCH_CHECK(cache.is_cpu() && cache.is_contiguous() && cache.dim() >= 4,
              "kv_tag.copy_blocks: cache must be a contiguous CPU tensor [L, P, blocks, bs, ...]");
  TORCH_CHECK(runs.scalar_type() == torch::kInt64 && runs.dim() == 2 && runs.size(1) == 3 &&
                  runs.is_contiguous(),
              "kv_tag.copy_blocks: runs must be a contiguous int64 [R, 3] of (j, block, k)");
  const int64_t layers = cache.size(0), planes = cache.size(1), num_blocks = cache.size(2);
  const int64_t bs = cache.size(3);
  const int64_t token = cache.stride(3) * cache.element_size();  // bytes per token and plane
  const int64_t total = nbytes(src);
  TORCH_CHECK(token > 0 && total % (layers * planes * token) == 0, "kv_tag.copy_blocks: src's ",
              total, " bytes are not [", layers, ", ", planes, ", n] tokens of ", token, " bytes");
  const int64_t n = total / (layers * planes * token);
  const int64_t* r = runs.data_ptr<int64_t>();
  const int64_t nruns = runs.size(0);
  for (int64_t i = 0, end = 0; i < nruns; ++i) {
    const int64_t j = r[3 * i], block = r[3 * i + 1], k = r[3 * i + 2];
    TORCH_CHECK(j >= end && k > 0 && (j + k) * bs <= n && block >= 0 && block + k <= num_blocks,
                "kv_tag.copy_blocks: run ", i, " (", j, ", ", block, ", ", k,
                ") out of order or outside the chunk's ", n, " tokens or the cache's ",
                num_blocks, " blocks");
    end = j + k;
  }
  State* st = maybe_state(state);
  const uint8_t* s = bytes_of(src, "src");
  uint8_t* c = writable(cache, "cache");
  const int64_t plane_bytes = n * token, block_bytes = bs * token;
  pybind11::gil_scoped_release released;  // the arguments are checked: copy without the GIL
  for (int64_t l = 0; l < layers; ++l)
    for (int64_t p = 0; p < planes; ++p) {
      const uint8_t* from = s + (l * planes + p) * plane_bytes;
      uint8_t* to = c + (l * planes + p) * num_blocks * block_bytes;
      int64_t at = 0;  // bytes of this plane done
      for (int64_t i = 0; i < nruns; ++i) {
        const int64_t j = r[3 * i], block = r[3 * i + 1], k = r[3 * i + 2];
        if (j * block_bytes > at) put(st, from + at, nullptr, j * block_bytes - at);
        put(st, from + j * block_bytes, to + block * block_bytes, k * block_bytes);
        at = (j + k) * block_bytes;
      }
      if (at < plane_bytes) put(st, from + at, nullptr, plane_bytes - at);
    }
}

// The same copy without the hash (the benchmark's baseline for `copy`).
void copy_only(torch::Tensor dst, torch::Tensor src) {
  TORCH_CHECK(nbytes(dst) == nbytes(src), "kv_tag.copy_only: byte sizes differ");
  copy_fn()(writable(dst, "dst"), bytes_of(src, "src"), nbytes(src));
}

int64_t total(torch::Tensor state) { return state_of(state)->total; }

// A copy of the input's first min(total, 240) bytes: all of a short input, which xxh3
// hashes by other formulas (the Python side gives them to the package).
torch::Tensor head(torch::Tensor state) {
  const State* st = state_of(state);
  const int64_t n = std::min<int64_t>(st->total, kShortMax);
  auto out = torch::empty({n}, torch::kUInt8);
  std::memcpy(out.data_ptr<uint8_t>(), st->head, n);
  return out;
}

// xxh3_64 of everything fed, as the int64 with the digest's bits; only for totals over 240
// bytes (the Python side hashes shorter inputs from `head`).
int64_t digest(torch::Tensor state) {
  const State* st = state_of(state);
  TORCH_CHECK(st->total > kShortMax, "kv_tag.digest: ", st->total,
              " bytes is a short input (hash its head instead)");
  uint8_t final_stripe[kStripe];  // the input's last 64 bytes
  std::memcpy(final_stripe, st->last + st->held, kStripe - st->held);
  std::memcpy(final_stripe + kStripe - st->held, st->tail, st->held);
  uint64_t acc[8];
  std::memcpy(acc, st->acc, sizeof(acc));
  fold_scalar(acc, final_stripe, kSecret + kLastAt);
  uint64_t h = static_cast<uint64_t>(st->total) * kPrime64_1;
  for (int i = 0; i < 4; ++i) {
    const uint8_t* key = kSecret + kMergeAt + 16 * i;
    h += mul128_fold64(acc[2 * i] ^ read64(key), acc[2 * i + 1] ^ read64(key + 8));
  }
  h ^= h >> 37;
  h *= 0x165667919E3779F9ULL;
  h ^= h >> 32;
  return static_cast<int64_t>(h);
}

using NoGil = pybind11::call_guard<pybind11::gil_scoped_release>;
constexpr NoGil kNoGil{};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("state_new", &state_new, "a fresh xxh3_64 streaming state (uint8 tensor)");
  m.def("update", &update, kNoGil, "hash src's bytes");
  m.def("copy", &copy, kNoGil, "copy src's bytes into dst and hash them, one pass");
  m.def("copy_planes", &copy_planes, "copy src's planes back to back into dst (and hash them)");
  m.def("copy_blocks", &copy_blocks, "copy a chunk's blocks into a paged cache (and hash them)");
  m.def("copy_only", &copy_only, kNoGil, "the same copy without the hash (a baseline)");
  m.def("total", &total, "bytes fed");
  m.def("head", &head, "the first min(total, 240) bytes fed");
  m.def("digest", &digest, "xxh3_64 of the bytes fed (over 240 bytes), as int64 bits");
  m.def("isa", &isa_name, "the instruction set the stripe loop runs with on this CPU");
}
