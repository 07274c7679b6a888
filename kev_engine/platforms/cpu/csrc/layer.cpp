// A Llama-style decoder layer as one call: the same kernels as the op-by-op layer
// (`models.llama.DecoderModel._layer`), on the same values, in the same order, so it gives the
// same bits (tests/test_models.py). The
// residual additions are `add_into` in place of torch's add: the same sum and rounding, without
// an allocation and a dispatch each.
//
// Why: a decode step of few rows is thirty layers of small work, and in Python each layer is a
// dozen kernel calls with views, splits, shape checks and attribute lookups between them: several
// milliseconds of a step, a fifth to a third of it beside the products of a small model. Here the
// layer's weights and constants are held once (`DecoderLayer`, built by `ExactOps.prepare`) and a
// call (`layers_forward`) runs whole layers without returning to Python, the interpreter's lock
// released (the server's event loop and tokenizers run meanwhile).
//
// What it runs: RMSNorm; q, k and v as one product (`Product`: packed, or a GGUF's quantized parts); Qwen3's per-head norms where given;
// the rotary kernel for queries and keys; the new keys and values written to the pool; paged
// attention over it; the output projection and the residual; RMSNorm; gate and up as one packed
// product; silu(gate) * up; the down projection and the residual. The memory layout of a tensor
// between kernels may differ from the Python path's (the rotary reads queries and keys in place
// from the product, a copy is contiguous there): every kernel computes each row (or element) by
// itself, so layout never changes a value.
#include <vector>

#include "exact.h"

namespace {

using Optional = c10::optional<at::Tensor>;

// One of a layer's products: a packed weight (linear.cpp) or quantized parts (quant.cpp).
class Product {
 public:
  static Product packed(at::Tensor weight, int64_t n) {
    Product p;
    p.packed_ = std::move(weight);
    p.n_ = n;
    return p;
  }
  static Product quantized(std::vector<at::Tensor> parts, std::vector<int64_t> types, std::vector<int64_t> widths) {
    Product p;
    p.parts_ = std::move(parts);
    p.types_ = std::move(types);
    p.widths_ = std::move(widths);
    for (const int64_t w : p.widths_) p.n_ += w;
    return p;
  }
  // prompt: the rows that are a prompt's tokens (quant_linear's), or none.
  at::Tensor operator()(const at::Tensor& x, const Optional& bias, const Optional& prompt) const {
    if (parts_.empty()) return linear_packed(x, packed_, n_, bias, "");
    return quant_linear(x, parts_, types_, widths_, bias, "", prompt);
  }

 private:
  at::Tensor packed_;
  std::vector<at::Tensor> parts_;
  std::vector<int64_t> types_, widths_;
  int64_t n_ = 0;
};

// RMSNorm of every row of width weight.size(0): rows [T, ...] → the same shape.
at::Tensor norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const auto rows = x.reshape({-1, weight.size(0)});
  return rms_norm(rows.stride(1) == 1 ? rows : rows.contiguous(), weight, eps).view(x.sizes());
}

class DecoderLayer {
 public:
  // norms: input, post-attention; head_norms: Qwen3's q_norm and k_norm weights (or none);
  // eps: one per norm, in that order; qkv and gate_up: the products of [q | k | v] and
  // [gate | up], o and down likewise; widths: q, k, v, intermediate.
  DecoderLayer(at::Tensor input_norm, at::Tensor post_norm, Optional q_norm, Optional k_norm,
               std::vector<double> eps, Product qkv, Optional qkv_bias, Product o, Optional o_bias,
               Product gate_up, Optional gate_up_bias, Product down, Optional down_bias,
               std::vector<int64_t> widths, int64_t head_dim, int64_t hidden, double scale)
      : input_norm_(std::move(input_norm)), post_norm_(std::move(post_norm)), q_norm_(std::move(q_norm)),
        k_norm_(std::move(k_norm)), eps_(std::move(eps)), qkv_(std::move(qkv)), qkv_bias_(std::move(qkv_bias)),
        o_(std::move(o)), o_bias_(std::move(o_bias)), gate_up_(std::move(gate_up)),
        gate_up_bias_(std::move(gate_up_bias)), down_(std::move(down)), down_bias_(std::move(down_bias)),
        widths_(std::move(widths)), head_dim_(head_dim), hidden_(hidden), scale_(scale) {
    TORCH_CHECK(eps_.size() == 4 && widths_.size() == 4, "DecoderLayer: four eps and four widths");
    TORCH_CHECK(q_norm_.has_value() == k_norm_.has_value(), "DecoderLayer: both head norms or neither");
  }

  // hidden [T, hidden] → [T, hidden]; cos, sin [T, head_dim]; keys, values: this layer's pool;
  // slot_blocks, slot_offsets: each new token's slot; tables, cu_seqlens, past: the pass's
  // segments (attention.cpp's arguments); prompt: the rows that are a prompt's tokens, or none
  // (quant_linear's).
  at::Tensor forward(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin, at::Tensor keys,
                     at::Tensor values, const at::Tensor& slot_blocks, const at::Tensor& slot_offsets,
                     const at::Tensor& tables, const at::Tensor& cu_seqlens, const at::Tensor& past,
                     const Optional& prompt) const {
    TORCH_CHECK(hidden.dim() == 2 && hidden.size(1) == hidden_, "DecoderLayer: hidden must be [tokens, ", hidden_,
                "]");
    const int64_t tokens = hidden.size(0);
    const int64_t q_width = widths_[0], k_width = widths_[1], v_width = widths_[2], inter = widths_[3];
    const auto normed = norm_rows(hidden, input_norm_, eps_[0]);
    const auto qkv = qkv_(normed, qkv_bias_, prompt);
    auto query = qkv.narrow(1, 0, q_width).view({tokens, -1, head_dim_});
    auto key = qkv.narrow(1, q_width, k_width).view({tokens, -1, head_dim_});
    const auto value = qkv.narrow(1, q_width + k_width, v_width).view({tokens, -1, head_dim_});
    if (q_norm_.has_value()) {
      query = norm_rows(query, *q_norm_, eps_[2]);
      key = norm_rows(key, *k_norm_, eps_[3]);
    }
    query = rotary(query, cos, sin);  // [T, heads, dim], read in place from the product
    key = rotary(key, cos, sin);      // [T, kv_heads, dim]
    paged_write_transposed(keys, values, key.transpose(0, 1), value.transpose(0, 1), slot_blocks, slot_offsets);
    const auto attended = paged_attention(query, keys, values, tables, cu_seqlens, past, scale_);
    auto mixed = o_(attended.view({tokens, -1}), o_bias_, prompt);
    add_into(mixed, hidden);
    const auto both = gate_up_(norm_rows(mixed, post_norm_, eps_[1]), gate_up_bias_, prompt);
    auto product = at::empty({tokens, inter}, both.options());
    silu_mul(both.narrow(1, 0, inter), both.narrow(1, inter, inter), product);
    auto out = down_(product, down_bias_, prompt);
    add_into(out, mixed);
    return out;
  }

 private:
  at::Tensor input_norm_, post_norm_;
  Optional q_norm_, k_norm_;
  std::vector<double> eps_;
  Product qkv_;
  Optional qkv_bias_;
  Product o_;
  Optional o_bias_;
  Product gate_up_;
  Optional gate_up_bias_;
  Product down_;
  Optional down_bias_;
  std::vector<int64_t> widths_;
  int64_t head_dim_, hidden_;
  double scale_;
};

// Consecutive layers of one pass in one call: each layer's forward on the previous one's output,
// keys[i] and values[i] layer i's pool. Why one call: a return to Python between layers costs the
// interpreter's work and its lock, and between two calls from Python the pool's workers stop
// spinning and sleep (pool.h). Within the call, too, a decode step's worker sleeps where the one-row
// work between two products (norms, rotary, attention: 5-50 µs, cold in cache after the product's
// stream of weights) outlasts its spin; spinning through those gaps measured slower with another
// program on a core (docs/benchmarks.md, "Where a decode step's time goes").
at::Tensor layers_forward(const std::vector<DecoderLayer*>& layers, at::Tensor hidden, const at::Tensor& cos,
                          const at::Tensor& sin, const std::vector<at::Tensor>& keys,
                          const std::vector<at::Tensor>& values, const at::Tensor& slot_blocks,
                          const at::Tensor& slot_offsets, const at::Tensor& tables, const at::Tensor& cu_seqlens,
                          const at::Tensor& past, const Optional& prompt) {
  TORCH_CHECK(keys.size() == layers.size() && values.size() == layers.size(),
              "layers_forward: one pool's keys and values per layer");
  for (size_t i = 0; i < layers.size(); ++i)
    hidden = layers[i]->forward(hidden, cos, sin, keys[i], values[i], slot_blocks, slot_offsets, tables, cu_seqlens,
                                past, prompt);
  return hidden;
}

}  // namespace

void bind_layer(pybind11::module& m) {
  pybind11::class_<Product>(m, "Product", "One product of a DecoderLayer: packed, or quantized parts (layer.cpp)")
      .def_static("packed", &Product::packed, "linear_pack's weight of n outputs")
      .def_static("quantized", &Product::quantized, "quant_linear's parts, their GGML types and widths");
  pybind11::class_<DecoderLayer>(m, "DecoderLayer", "A Llama-style decoder layer in one call (see layer.cpp)")
      .def(pybind11::init<at::Tensor, at::Tensor, Optional, Optional, std::vector<double>, Product, Optional,
                          Product, Optional, Product, Optional, Product, Optional, std::vector<int64_t>,
                          int64_t, int64_t, double>());
  m.def("layers_forward", &layers_forward, "consecutive DecoderLayers of one pass in one call (see layer.cpp)",
        pybind11::arg("layers"), pybind11::arg("hidden"), pybind11::arg("cos"), pybind11::arg("sin"),
        pybind11::arg("keys"), pybind11::arg("values"), pybind11::arg("slot_blocks"), pybind11::arg("slot_offsets"),
        pybind11::arg("tables"), pybind11::arg("cu_seqlens"), pybind11::arg("past"),
        pybind11::arg("prompt") = pybind11::none(), pybind11::call_guard<pybind11::gil_scoped_release>());
}
