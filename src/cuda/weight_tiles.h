// How expert weights are laid out on the device where their shape allows ("tiles"). Internal;
// plain C++ (host and device), so the host tests check it without a GPU.
//
// A matrix of `rows` rows of `row_bytes` bytes (any format: the codes as uploaded, NVFP4 in pair
// order) is cut into tiles of 16 rows x 64 bytes, one chunk of the expert-major K loop for one
// warp (128 NVFP4, 64 FP8 or 32 BF16 columns of its 16 rows). Each tile is stored as its 16 rows
// of 64 bytes one after another (1 KB), and the tiles of a 16-row panel follow each other along
// K, then the next panel. The NVFP4 block scales stay row-major.
//
// Why: in the checkpoint's row-major layout one 16-byte load instruction of a warp covers 8 rows x
// 64 bytes (rows K/2 bytes apart). The staged kernels' weight loads alone, with no arithmetic,
// read 2.1-2.8 TB/s that way on an H200 and 4.0-4.2 TB/s in tiles, where the same instruction
// covers 512 contiguous bytes (streaming reads: 4.5 TB/s; tools/probe_weight_loads.cu,
// docs/PERF.md v3.16).
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define MOEINFER_TILES_HD __host__ __device__
#else
#define MOEINFER_TILES_HD
#endif

namespace moeinfer::cuda {

inline constexpr int kTileRows = 16;
inline constexpr int kTileRowBytes = 64;
inline constexpr int kTileBytes = kTileRows * kTileRowBytes;

// Whether a matrix of this shape can be stored in tiles: whole tiles only.
MOEINFER_TILES_HD constexpr bool tiles_fit(int64_t rows, int64_t row_bytes) {
  return rows > 0 && row_bytes > 0 && rows % kTileRows == 0 && row_bytes % kTileRowBytes == 0;
}

// Where byte b of row r lies in the tiled matrix.
MOEINFER_TILES_HD constexpr int64_t tiled_offset(int64_t r, int64_t b, int64_t row_bytes) {
  return r / kTileRows * kTileRows * row_bytes + b / kTileRowBytes * kTileBytes + r % kTileRows * kTileRowBytes +
         b % kTileRowBytes;
}

}  // namespace moeinfer::cuda

#undef MOEINFER_TILES_HD
