// The MLP's activation and gate product, silu(gate) * up, RMSNorm, and rotary embeddings, for
// Kev's CPU kernels.
//
// Why a kernel: torch's elementwise loops run vectorized over the flattened tensor and finish
// each thread's share with a scalar loop, and its vector and scalar exp() may differ in the last
// bit. Which elements fall in a scalar tail depends on the tensor's size — on what else is in
// the pass — so a question's activations could change with its neighbours. Here every element
// is computed by the same vector code (a row's last partial vector too, zero-padded), in fp32:
// silu(g) = g * sigmoid(g), sigmoid from e^-|g| (so exp never overflows), times up, rounded once
// to the output dtype. Rows may be strided (GLM's fused gate_up output holds both halves).
//
// RMSNorm, out = weight * (x * rsqrt(mean(x^2) + eps)), Llama's formula with its roundings: the
// squares summed in fp32 by one vector accumulator over the row (fused multiply-adds, the last
// partial vector zero-padded) and one fixed halving tree, so a row's sum depends on its width
// alone; then x * r rounded to the dtype, times the weight, rounded again. One call per norm
// instead of torch's six elementwise operations, which a decode step with few rows pays for
// sixty times over in dispatch alone.
//
// Rotary, x * cos + rotate_half(x) * sin with rotate_half(x) = (-x2, x1): exactly transformers'
// formula with its roundings (each product rounded to the dtype, then their sum), so it gives
// the bits torch's six operations give, in one call for a layer's queries and keys.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>

#include "pool.h"
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
  // sigmoid: e / (1 + e) where g < 0, else 1 / (1 + e) — one division of the selected numerator
  // (a division is the loop's slowest instruction; the same operands give the same quotient)
  const vf sigmoid = vselect(g < vf{}, e, one) / (one + e);
  return g * sigmoid;
}

template <typename T>
void run(const at::Tensor& gate, const at::Tensor& up, at::Tensor& out) {
  const int64_t rows = gate.size(0), width = gate.size(1);
  const T* g = gate.data_ptr<T>();
  const T* u = up.data_ptr<T>();
  T* o = out.data_ptr<T>();
  const int64_t gs = gate.stride(0), us = up.stride(0), os = out.stride(0);
  kev::parallel_for(0, rows, kev::grain_for(width), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t c = 0; c < width; c += kLanes) {
        const int64_t count = std::min<int64_t>(kLanes, width - c);
        const vf result = silu(load_part(g + r * gs + c, count)) * load_part(u + r * us + c, count);
        store_part(o + r * os + c, result, count);
      }
    }
  });
}

template <typename T>
inline vf rounded(vf v) {  // v rounded to T and back (a no-op for float32)
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    T buffer[kLanes];
    store_part(buffer, v, kLanes);
    return load_as_float(buffer);
  }
}

template <typename T>
void rms_rows(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
  const int64_t rows = x.size(0), width = x.size(1);
  const T* xs = x.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
  T* o = out.data_ptr<T>();
  const int64_t xstride = x.stride(0);
  const float epsilon = static_cast<float>(eps);
  kev::parallel_for(0, rows, kev::grain_for(width), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* row = xs + r * xstride;
      vf acc{};
      for (int64_t c = 0; c < width; c += kLanes) {
        const vf v = load_part(row + c, std::min<int64_t>(kLanes, width - c));
        acc = vfma(v, v, acc);
      }
      const float scale = 1.0f / std::sqrt(hsum(acc) / static_cast<float>(width) + epsilon);
      for (int64_t c = 0; c < width; c += kLanes) {
        const int64_t count = std::min<int64_t>(kLanes, width - c);
        const vf normed = rounded<T>(load_part(row + c, count) * vset(scale));  // to the dtype before the weight
        store_part(o + r * width + c, load_part(w + c, count) * normed, count);
      }
    }
  });
}

template <typename T>
void rotate_rows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  const int64_t rows = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  const int64_t row_stride = x.stride(0), head_stride = x.stride(1);
  const T* xs = x.data_ptr<T>();
  const T* cs = cos.data_ptr<T>();
  const T* ss = sin.data_ptr<T>();
  T* o = out.data_ptr<T>();
  kev::parallel_for(0, rows, kev::grain_for(heads * dim), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* c = cs + r * dim;
      const T* s = ss + r * dim;
      for (int64_t h = 0; h < heads; ++h) {
        const T* in = xs + r * row_stride + h * head_stride;
        T* res = o + (r * heads + h) * dim;
        for (int64_t i = 0; i < half; i += kLanes) {
          const int64_t count = std::min<int64_t>(kLanes, half - i);
          const vf x1 = load_part(in + i, count), x2 = load_part(in + half + i, count);
          const vf first = rounded<T>(x1 * load_part(c + i, count)) + rounded<T>(-x2 * load_part(s + i, count));
          const vf second = rounded<T>(x2 * load_part(c + half + i, count)) +
                            rounded<T>(x1 * load_part(s + half + i, count));
          store_part(res + i, first, count);
          store_part(res + half + i, second, count);
        }
      }
    }
  });
}

template <typename T>
void add_rows(at::Tensor& out, const at::Tensor& residual) {
  const int64_t rows = out.size(0), width = out.size(1), stride = residual.stride(0);
  const T* res = residual.data_ptr<T>();
  T* o = out.data_ptr<T>();
  kev::parallel_for(0, rows, kev::grain_for(width, 65536), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t c = 0; c < width; c += kLanes) {
        const int64_t count = std::min<int64_t>(kLanes, width - c);
        store_part(o + r * width + c, load_part(o + r * width + c, count) + load_part(res + r * stride + c, count),
                   count);
      }
    }
  });
}

}  // namespace

// out += residual for out [rows, width] (contiguous) and residual [rows, width] (contiguous rows,
// any row stride) of one dtype, float32 or bfloat16: each sum in fp32, rounded once to the dtype
// (to nearest even), which is torch's `residual + out` bit for bit. Why: a decoder layer adds its
// attention's and its MLP's output to the residual stream; torch's add costs more in dispatch
// and allocation than in arithmetic at a decode step's few rows, twice per layer.
void add_into(at::Tensor& out, const at::Tensor& residual) {
  TORCH_CHECK(out.device().is_cpu() && residual.device().is_cpu(), "add_into runs on CPU tensors");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && residual.sizes() == out.sizes() && residual.stride(1) == 1,
              "add_into: out must be contiguous [rows, width] and residual of its shape with contiguous rows, got ",
              out.sizes(), " and ", residual.sizes());
  TORCH_CHECK(residual.scalar_type() == out.scalar_type(), "add_into: one dtype for out and residual, got ",
              out.scalar_type(), " and ", residual.scalar_type());
  switch (out.scalar_type()) {
    case at::kFloat: add_rows<float>(out, residual); break;
    case at::kBFloat16: add_rows<at::BFloat16>(out, residual); break;
    default: TORCH_CHECK(false, "add_into supports float32 and bfloat16, not ", out.scalar_type());
  }
}

// x [rows, heads, dim] rotated by cos, sin [rows, dim] (every head of a row by its row's), one
// dtype (float32 or bfloat16), dim even; a new contiguous tensor. x's head vectors must be
// contiguous, its rows and heads may be strided: a layer's queries and keys are read in place
// from the packed q/k/v product, without a copy of each first.
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && cos.device().is_cpu() && sin.device().is_cpu(), "rotary runs on CPU tensors");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "rotary: x must be [rows, heads, dim] with dim even and each head's dim contiguous, got ", x.sizes(),
              " with strides ", x.strides());
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == x.size(0) && cos.size(1) == x.size(2) && cos.is_contiguous() &&
                  sin.sizes() == cos.sizes() && sin.is_contiguous(),
              "rotary: cos and sin must be contiguous [", x.size(0), ", ", x.size(2), "], got ", cos.sizes(), " and ",
              sin.sizes());
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rotary: one dtype for x, cos and sin");
  auto out = at::empty(x.sizes(), x.options());
  switch (x.scalar_type()) {
    case at::kFloat: rotate_rows<float>(x, cos, sin, out); break;
    case at::kBFloat16: rotate_rows<at::BFloat16>(x, cos, sin, out); break;
    default: TORCH_CHECK(false, "rotary supports float32 and bfloat16, not ", x.scalar_type());
  }
  return out;
}

// out [rows, width] = RMSNorm of x [rows, width] (inner dimension contiguous, any row stride)
// with weight [width] of x's dtype, float32 or bfloat16; out is contiguous and may not be x.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "rms_norm runs on CPU tensors");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm: x must be [rows, width] with contiguous rows");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(),
              "rms_norm: weight [", x.size(1), "] expected, got ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rms_norm: one dtype for x and weight, got ",
              x.scalar_type(), " and ", weight.scalar_type());
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  switch (x.scalar_type()) {
    case at::kFloat: rms_rows<float>(x, weight, eps, out); break;
    case at::kBFloat16: rms_rows<at::BFloat16>(x, weight, eps, out); break;
    default: TORCH_CHECK(false, "rms_norm supports float32 and bfloat16, not ", x.scalar_type());
  }
  return out;
}

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
