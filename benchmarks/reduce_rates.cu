// How fast an H200 adds fp32 tiles into global memory: the backward's dQ reduce ceiling.
//
// The backward adds a 64-row fp32 dQ tile per CTA step into an accumulator in L2/HBM
// (docs/perf-notes.md, session 5: the reduce bounds the step). This measures the three
// ways a kernel can do that, each CTA adding 16 KB pieces:
//   bulk   one thread issues cp.reduce.async.bulk .add.f32 of a 16 KB shared-memory tile
//          (what the dQ writer warp does today, minus the tensor map), IN_FLIGHT at once
//   red2   every thread issues red.global.add.v2.f32 from registers (a wgmma fragment
//          holds column pairs)
//   red4   the same with .v4
// against two targets: "spread" (each CTA adds into its own pieces, a 256 MB buffer:
// mostly HBM) and "shared" (all CTAs add into the same 16 pieces, 256 KB: one L2
// region, as the CTAs of one head do when they walk the query tiles in lockstep).
//
// Build and run on the H200 (CUDA's compiler is in the device image):
//   nvcc -arch=sm_90a -O3 -o /tmp/reduce_rates benchmarks/reduce_rates.cu && /tmp/reduce_rates
// Prints GB/s of fp32 data added, per method and target (median of 5 timed launches).

#include <cstdio>
#include <cstdint>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>

#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
  printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); return 1; } } while (0)

constexpr int PIECE_BYTES = 16384;  // one 64 x 64 fp32 dQ tile
constexpr int PIECE_FLOATS = PIECE_BYTES / 4;
constexpr int THREADS = 128;
constexpr int IN_FLIGHT = 2;  // bulk reduces a CTA keeps outstanding (the writer has 1-2)

__device__ __forceinline__ size_t piece_offset(int i, int iters, size_t pieces, bool shared) {
  size_t p = shared ? (size_t)(i % 16) : ((size_t)blockIdx.x * iters + i) % pieces;
  return p * PIECE_FLOATS;
}

__global__ void bulk_kernel(float* dst, int iters, size_t pieces, bool shared) {
  __shared__ __align__(128) float tile[PIECE_FLOATS];
  for (int j = threadIdx.x; j < PIECE_FLOATS; j += blockDim.x) tile[j] = 1.0f;
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t src = static_cast<uint32_t>(__cvta_generic_to_shared(tile));
    for (int i = 0; i < iters; ++i) {
      float* target = dst + piece_offset(i, iters, pieces, shared);
      asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
                   :: "l"(target), "r"(src), "r"(PIECE_BYTES) : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
      asm volatile("cp.async.bulk.wait_group.read %0;" :: "n"(IN_FLIGHT - 1) : "memory");
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  }
}

__global__ void red2_kernel(float* dst, int iters, size_t pieces, bool shared) {
  for (int i = 0; i < iters; ++i) {
    float* base = dst + piece_offset(i, iters, pieces, shared);
    for (int j = threadIdx.x * 2; j < PIECE_FLOATS; j += THREADS * 2) {
      asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" :: "l"(base + j), "f"(1.0f), "f"(1.0f) : "memory");
    }
  }
}

__global__ void red4_kernel(float* dst, int iters, size_t pieces, bool shared) {
  for (int i = 0; i < iters; ++i) {
    float* base = dst + piece_offset(i, iters, pieces, shared);
    for (int j = threadIdx.x * 4; j < PIECE_FLOATS; j += THREADS * 4) {
      asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};"
                   :: "l"(base + j), "f"(1.0f), "f"(1.0f), "f"(1.0f), "f"(1.0f) : "memory");
    }
  }
}

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const size_t buffer_bytes = 256ull << 20;
  const size_t pieces = buffer_bytes / PIECE_BYTES;
  float* dst = nullptr;
  CHECK(cudaMalloc(&dst, buffer_bytes));
  CHECK(cudaMemset(dst, 0, buffer_bytes));
  const int ctas = sms, iters = 512;
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  const char* names[] = {"bulk", "red2", "red4"};
  printf("%d CTAs of %d threads, %d pieces of %d KB each, %d bulk reduces in flight\n",
         ctas, THREADS, iters, PIECE_BYTES / 1024, IN_FLIGHT);
  printf("| method | target | GB/s added |\n|---|---|---|\n");
  for (int shared = 0; shared < 2; ++shared) {
    for (int m = 0; m < 3; ++m) {
      std::vector<float> ms;
      for (int rep = 0; rep < 6; ++rep) {
        CHECK(cudaEventRecord(start));
        if (m == 0) bulk_kernel<<<ctas, THREADS>>>(dst, iters, pieces, shared);
        if (m == 1) red2_kernel<<<ctas, THREADS>>>(dst, iters, pieces, shared);
        if (m == 2) red4_kernel<<<ctas, THREADS>>>(dst, iters, pieces, shared);
        CHECK(cudaEventRecord(stop));
        CHECK(cudaEventSynchronize(stop));
        CHECK(cudaGetLastError());
        float t = 0;
        CHECK(cudaEventElapsedTime(&t, start, stop));
        if (rep > 0) ms.push_back(t);  // the first launch warms up
      }
      std::sort(ms.begin(), ms.end());
      double bytes = (double)ctas * iters * PIECE_BYTES;
      printf("| %s | %s | %.0f |\n", names[m], shared ? "shared (16 pieces)" : "spread (256 MB)",
             bytes / (ms[ms.size() / 2] * 1e-3) / 1e9);
    }
  }
  return 0;
}
