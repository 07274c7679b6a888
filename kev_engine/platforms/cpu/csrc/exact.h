// The exact build's kernels, declared once: bind_exact.cpp binds them, layer.cpp calls them.
#pragma once

#include <torch/extension.h>

#include <string>
#include <vector>

at::Tensor linear_pack(const at::Tensor& weight);
at::Tensor linear_packed(const at::Tensor& input, const at::Tensor& packed, int64_t n,
                         const c10::optional<at::Tensor>& bias, const std::string& path);
void linear_packed_into(const void* x, int64_t m, int64_t k, const void* w, int64_t n, const float* bias, void* out,
                        int64_t ldo, bool f32, int path);
int linear_bf16_path(const std::string& name);
constexpr int kPathAmx = 0, kPathAvx512Bf16 = 1;  // linear_bf16_path's values (linear.cpp's Bf16Path)
void store_bf16_rows(const float* c, int64_t ldc, int64_t rows, const float* bias, at::BFloat16* out, int64_t ldo,
                     int64_t cols);
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
void amx_configure_tiles();
#endif
std::string linear_paths();
void set_bf16_path(const std::string& name);
at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                           const at::Tensor& tables, const at::Tensor& cu_seqlens, const at::Tensor& past,
                           double scale);
void paged_write_transposed(at::Tensor& keys, at::Tensor& values, const at::Tensor& key, const at::Tensor& value,
                            const at::Tensor& block_ids, const at::Tensor& offsets);
void silu_mul(const at::Tensor& gate, const at::Tensor& up, at::Tensor& out);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
void add_into(at::Tensor& out, const at::Tensor& residual);
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor quant_linear(const at::Tensor& input, const std::vector<at::Tensor>& parts, const std::vector<int64_t>& types,
                        const std::vector<int64_t>& widths, const c10::optional<at::Tensor>& bias,
                        const std::string& path, const c10::optional<at::Tensor>& prompt);
// Whether this build computes a prompt's rows on decoded weights (quant.cpp): with AVX512-BF16.
bool quant_prompt_decoded();
at::Tensor quant_rows(const at::Tensor& tiled, int64_t type, int64_t n, int64_t k, const at::Tensor& ids);
// How this build computes block-scaled products (quant_scaled.cpp): "avx512" (register tiles) or "scalar"
// (a lane at a time, what a build without AVX-512 has).
std::string quant_path();
at::Tensor rows_linear(const at::Tensor& input, const at::Tensor& weight);
void bind_layer(pybind11::module& m);  // layer.cpp's DecoderLayer
