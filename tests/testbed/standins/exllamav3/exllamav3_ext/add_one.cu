// STAND-IN kernel (testbed only): proves nvcc compiled device code for the requested arch.
#include <cuda_runtime.h>
#include <cstdint>

__global__ void add_one_kernel(float *x, int64_t n) {
  int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i < n) x[i] += 1.0f;
}

void add_one_launch(float *x, int64_t n, cudaStream_t stream) {
  const int threads = 256;
  const int64_t blocks = (n + threads - 1) / threads;
  add_one_kernel<<<blocks, threads, 0, stream>>>(x, n);
}
