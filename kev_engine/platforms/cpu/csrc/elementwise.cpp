// The MLP's activation and gate product, silu(gate) * up, for Kev's exact path.
//
// Why a kernel: torch's elementwise loops run vectorized over the flattened tensor and finish
// each thread's share with a scalar loop, and its vector and scalar exp() may differ in the last
// bit. Which elements fall in a scalar tail depends on the tensor's size — on what else is in
// the pass — so a question's activations could change with its neighbours. Here every element
// is computed by the same vector code (a row's last partial vector too, zero-padded), in fp32:
// silu(g) = g * sigmoid(g), sigmoid from e^-|g| (so exp never overflows), times up, rounded once
// to the output dtype. Rows may be strided (GLM's fused gate_up output holds both halves).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "simd.h"

namespace {

using namespace kev;

template <typename T>
inline vf load_part(const T* p, int64_t count) {
  if (count == kLanes) return load_as_float(p);
  T buffer[kLanes] = {};
  std::memcpy(buffer, p, count * sizeof(T));
  return load_as_float(buffer);
}

template <typename T>
inline void store_part(T* p, vf v, int64_t count) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(p, &v, count * sizeof(float));
  } else {
    const vh h = to_bf16(v);
    std::memcpy(p, &h, count * sizeof(T));
  }
}

inline vf silu(vf g) {
  const vf e = vexp(vselect(g < vf{}, g, -g));  // e^-|g|, in (0, 1]
  const vf one = vset(1.0f);
  const vf sigmoid = vselect(g < vf{}, e / (one + e), one / (one + e));
  return g * sigmoid;
}

template <typename T>
void run(const at::Tensor& gate, const at::Tensor& up, at::Tensor& out) {
  const int64_t rows = gate.size(0), width = gate.size(1);
  const T* g = gate.data_ptr<T>();
  const T* u = up.data_ptr<T>();
  T* o = out.data_ptr<T>();
  const int64_t gs = gate.stride(0), us = up.stride(0), os = out.stride(0);
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t c = 0; c < width; c += kLanes) {
        const int64_t count = std::min<int64_t>(kLanes, width - c);
        const vf result = silu(load_part(g + r * gs + c, count)) * load_part(u + r * us + c, count);
        store_part(o + r * os + c, result, count);
      }
    }
  });
}

}  // namespace

// out = silu(gate) * up for gate/up/out [rows, width] (inner dimension contiguous, any row
// stride; out may be gate itself), float32 or bfloat16.
void silu_mul(const at::Tensor& gate, const at::Tensor& up, at::Tensor& out) {
  TORCH_CHECK(gate.device().is_cpu() && up.device().is_cpu() && out.device().is_cpu(), "silu_mul runs on CPU tensors");
  TORCH_CHECK(gate.dim() == 2 && up.sizes() == gate.sizes() && out.sizes() == gate.sizes(),
              "silu_mul: gate, up and out must be [rows, width] of one shape");
  TORCH_CHECK(gate.stride(1) == 1 && up.stride(1) == 1 && out.stride(1) == 1,
              "silu_mul: rows must be contiguous in memory");
  TORCH_CHECK(up.scalar_type() == gate.scalar_type() && out.scalar_type() == gate.scalar_type(),
              "silu_mul: one dtype for gate, up and out");
  switch (gate.scalar_type()) {
    case at::kFloat: run<float>(gate, up, out); break;
    case at::kBFloat16: run<at::BFloat16>(gate, up, out); break;
    default: TORCH_CHECK(false, "silu_mul supports float32 and bfloat16, not ", gate.scalar_type());
  }
}
