// The fast build's kernels as one Python extension (kernels.py builds and loads it).
#include <torch/extension.h>

#include "pool.h"

at::Tensor paged_decode(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                        const at::Tensor& tables, const at::Tensor& lens, double scale);
void paged_write(at::Tensor& keys, at::Tensor& values, const at::Tensor& key, const at::Tensor& value,
                 const at::Tensor& block_ids, const at::Tensor& offsets);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "Decode rows over their paged KV blocks (see paged_decode.cpp)");
  m.def("set_threads", &kev::set_threads, "Kev's kernels' threads from now on, 0: torch's count (see pool.h)");
  m.def("paged_write", &paged_write, "Store new keys/values at their (block, offset) slots (see paged_decode.cpp)");
}
