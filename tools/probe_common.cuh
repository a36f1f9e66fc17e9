// What the probes in tools/ share (not part of the library): a CUDA status check that exits with
// the failing call named, the streaming 16-byte load the kernels use for weights (no L1 line),
// stand-in work, the streaming read that a probe's GB/s are compared with, and the median time of
// 9 launches after a warm-up.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(call)                                                                                \
  do {                                                                                             \
    cudaError_t e_ = (call);                                                                       \
    if (e_ != cudaSuccess) {                                                                       \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                                                \
    }                                                                                              \
  } while (0)

namespace probe {

__device__ __forceinline__ uint4 load_stream(const uint8_t* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// Stand-in work for a kernel's decode and MMAs: `fmas` FMAs in four independent chains seeded from
// x (so that the work waits for the bytes x came from), added into acc.
__device__ __forceinline__ void fma_work(uint32_t x, int fmas, float (&acc)[4]) {
  float f[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) f[i] = __uint_as_float((x >> i & 0x007FFFFFu) | 0x3F800000u);
  for (int i = 0; i < fmas; i += 4) {
#pragma unroll
    for (int j = 0; j < 4; ++j) f[j] = fmaf(f[j], 0.999f, 0.001f);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) acc[i] += f[i];
}

// A plain streaming read of `count` 16-byte units, 4 in flight per thread (__ldcs: no L1 line,
// evict first): the reference rate a probe reports its kernels against. Launch it with 8 blocks of
// 256 threads per SM.
__global__ void stream_kernel(const uint4* data, int64_t count, float* sink) {
  uint32_t x = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count; i += 4 * stride) {
    uint4 v[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = i + j * stride < count ? __ldcs(data + i + j * stride) : uint4{};
#pragma unroll
    for (int j = 0; j < 4; ++j) x ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
  }
  if (x == 12345u) sink[blockIdx.x] = static_cast<float>(x);  // never true; keeps the reads
}

// The median of 9 timed launches (CUDA events) after one warm-up, in ms.
template <typename Launch>
float median_ms(Launch launch) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  launch();  // warm-up
  std::vector<float> ms;
  for (int i = 0; i < 9; ++i) {
    CHECK(cudaEventRecord(a));
    launch();
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float t = 0;
    CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  CHECK(cudaGetLastError());
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace probe
