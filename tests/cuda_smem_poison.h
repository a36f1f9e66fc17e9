// Test helpers: shared memory filled with NaN bytes before a kernel runs, so that a kernel reading
// shared memory it never wrote reads NaN (0xFF bytes: a NaN in bf16, fp16 and fp32).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace moeinfer::testing {

// Fills the shared memory of every SM with 0xFF: 4 blocks per SM, each of the most dynamic
// shared memory a block may opt into.
cudaError_t poison_shared_memory(cudaStream_t stream);

// The first `words` 32-bit words of a block's shared memory, as a kernel that writes none of it
// finds them, into `out` (host memory): a check that the poison is still there when the next
// kernel starts.
cudaError_t read_unwritten_shared_memory(uint32_t* out, int words);

}  // namespace moeinfer::testing
