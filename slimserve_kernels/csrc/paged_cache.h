// The paged KV cache of one layer as the CPU kernels read and write it: its element kind,
// its strides and its FP8 scales, viewed from the tensors the engine passes.
#pragma once

#include <torch/extension.h>

#include <cstdint>

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
