// The exact build's kernels as one Python extension (kernels.py builds and loads it).
#include <omp.h>

#include "exact.h"
#include "pool.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_pack", &linear_pack, "A weight [N, K] in the layout linear_packed reads (see linear.cpp)");
  m.def("linear_packed", &linear_packed, "input @ weight.T (+ bias) from a packed weight, batch-invariant",
        pybind11::arg("input"), pybind11::arg("packed"), pybind11::arg("n"), pybind11::arg("bias") = pybind11::none(),
        pybind11::arg("path") = "");
  m.def("quant_linear", &quant_linear, "input @ W.T (+ bias) from GGUF quantized parts, batch-invariant (quant.cpp)",
        pybind11::arg("input"), pybind11::arg("parts"), pybind11::arg("types"), pybind11::arg("widths"),
        pybind11::arg("bias") = pybind11::none(), pybind11::arg("path") = "",
        pybind11::arg("prompt") = pybind11::none());
  m.def("quant_prompt_decoded", &quant_prompt_decoded,
        "Whether a prompt's rows take the decoded weights' arithmetic in this build (quant.cpp)");
  m.def("quant_rows", &quant_rows, "Rows of a GGUF quantized weight as float32 (quant.cpp)");
  m.def("quant_path", &quant_path, "How this build computes block-scaled products: avx512 or scalar (quant.cpp)");
  m.def("linear_paths", &linear_paths, "Which instructions compute each dtype on this machine");
  m.def("set_bf16_path", &set_bf16_path, "The bf16 path of products that name none (see linear.cpp)");
  m.def("paged_attention", &paged_attention, "Every row of a pass over its paged KV (see attention.cpp)");
  m.def("paged_write_transposed", &paged_write_transposed, "Store new keys/values in an exact pool");
  m.def("silu_mul", &silu_mul, "out = silu(gate) * up (see elementwise.cpp)");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row, batch-invariant (see elementwise.cpp)");
  m.def("add_into", &add_into, "out += residual in place, rounded as torch's add (see elementwise.cpp)");
  m.def("rotary", &rotary, "Rotary embeddings, transformers' formula in one call (see elementwise.cpp)");
  m.def("rows_linear", &rows_linear, "input @ weight.T for few rows, float32 (see rows_linear.cpp)");
  m.def("set_threads", &kev::set_threads, "Kev's kernels' threads from now on, 0: torch's count (see pool.h)");
  m.def("serial_torch_here", [] { omp_set_num_threads(1); },
        "torch's own ops on the calling thread run on that thread alone (its OpenMP count, not the process's)");
  bind_layer(m);
}
