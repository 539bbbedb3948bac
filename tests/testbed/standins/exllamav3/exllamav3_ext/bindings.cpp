// STAND-IN binding (testbed only): a torch op over the kernel in add_one.cu.
#include <torch/extension.h>
#include <cuda_runtime.h>

void add_one_launch(float *x, int64_t n, cudaStream_t stream);

void add_one(torch::Tensor x) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == torch::kFloat32, "x: float32 CUDA tensor");
  add_one_launch(x.data_ptr<float>(), x.numel(), nullptr);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("add_one", &add_one, "x += 1 (in place)"); }
