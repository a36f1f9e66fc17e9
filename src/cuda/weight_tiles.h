// How expert weights are laid out on the device where their shape allows ("tiles"). Internal;
// plain C++ (host and device), so the host tests check it without a GPU.
//
// A matrix of `rows` rows of `row_bytes` bytes (any format: the codes as uploaded, NVFP4 in pair
// order) is cut into tiles of 16 rows x 64 bytes, one chunk of the expert-major K loop for one
// warp (128 NVFP4, 64 FP8 or 32 BF16 columns of its 16 rows). Each tile is stored as its 16 rows
// of 64 bytes one after another (1 KB), and the tiles of a 16-row panel follow each other along
// K, then the next panel. An NVFP4 matrix's block scales are tiled with it: a tile's 16 rows x 8
// scale codes (one per 16 of its 128 columns) stored as 128 bytes in the order a warp reads them
// (tiled_scale_offset), in the same order of tiles.
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

// Where NVFP4 block scale j (columns 16j .. 16j + 15) of row r lies in the tiled scales of a matrix
// of `per_row` scales per row (a multiple of 8 wherever its codes tile). Within a scale tile, lane
// l = 4g + c of a warp (rows g and g + 8, columns 32c .. 32c + 31 of the weight tile) finds its
// four codes at bytes 4l .. 4l + 3: codes 2c and 2c + 1 of row g, then of row g + 8. So one 4-byte
// load per lane and chunk, a warp's 128 bytes in a row, where row-major codes took two loads of
// two bytes from 16 rows.
inline constexpr int kScaleTileBytes = kTileRows * kTileRowBytes / 8;
MOEINFER_TILES_HD constexpr int64_t tiled_scale_offset(int64_t r, int64_t j, int64_t per_row) {
  const int64_t row = r % kTileRows, code = j % 8;
  return r / kTileRows * kTileRows * per_row + j / 8 * kScaleTileBytes + row % 8 * 16 + code / 2 * 4 + row / 8 * 2 +
         code % 2;
}

}  // namespace moeinfer::cuda

#undef MOEINFER_TILES_HD
