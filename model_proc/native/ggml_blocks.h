// What quant.cpp and quant_dot.cpp both check of a weight held as GGML blocks
// (each module is built on its own; native/__init__.py copies this header
// beside the module's source and counts it in the build's hash).
#pragma once

#include <torch/extension.h>

#include <cstdint>

namespace batchserve {

// blocks: uint8 [N, row_bytes], rows possibly strided, each row's bytes
// contiguous, holding K columns of block type T (T::kQK weights in
// T::kBytes bytes a block).
template <class T>
inline void check_blocks(const at::Tensor& blocks, int64_t K) {
  TORCH_CHECK_VALUE(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 2,
                    "blocks must be a uint8 CPU tensor [N, row_bytes], got ", blocks.scalar_type(), " ",
                    blocks.sizes());
  TORCH_CHECK_VALUE(K > 0 && K % T::kQK == 0, "k = ", K, " is not a positive multiple of the type's ", T::kQK,
                    "-weight block");
  TORCH_CHECK_VALUE(blocks.size(1) == K / T::kQK * T::kBytes, "blocks have ", blocks.size(1),
                    " bytes a row; k = ", K, " needs ", K / T::kQK * T::kBytes);
  TORCH_CHECK_VALUE(blocks.stride(1) == 1 || blocks.size(1) <= 1, "each row's bytes must be contiguous");
}

}  // namespace batchserve
