// The Python module of kvwise's CPU kernels: one build, one load.
#include <torch/extension.h>

torch::Tensor paged_decode(torch::Tensor query, torch::Tensor keys, torch::Tensor values, torch::Tensor tables,
                           torch::Tensor lengths, double scale, double softcap, int64_t window);
torch::Tensor paged_decode_rows(torch::Tensor query, torch::Tensor keys, torch::Tensor values, torch::Tensor rows,
                                torch::Tensor lengths, double scale, double softcap);
torch::Tensor quantized_decode(torch::Tensor query, torch::Tensor keys, torch::Tensor values, torch::Tensor tables,
                               torch::Tensor lengths, double scale, double softcap, int64_t window,
                               int64_t key_kind, int64_t key_bits, int64_t key_width, torch::Tensor key_codes,
                               torch::Tensor key_scale, torch::Tensor key_minimum, int64_t value_kind,
                               int64_t value_bits, int64_t value_width, torch::Tensor value_codes,
                               torch::Tensor value_scale, torch::Tensor value_minimum);
torch::Tensor small_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias);
torch::Tensor small_linear_bf16(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias);
bool small_linear_bf16_available();
torch::Tensor prefill_attention(torch::Tensor query, torch::Tensor keys, torch::Tensor values, torch::Tensor table,
                                int64_t start, double scale);
bool prefill_attention_available(bool bfloat16);
void write_blocks(torch::Tensor pool, torch::Tensor block_ids, std::vector<torch::Tensor> entries);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor silu_mul(torch::Tensor gate, torch::Tensor up);
torch::Tensor rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
bool elementwise_available();

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the GIL is released: the server's event loop keeps streaming while the engine thread is here
  m.def("paged_decode", &paged_decode, "decode attention over a paged KV pool (CPU, float32)",
        py::call_guard<py::gil_scoped_release>());
  m.def("paged_decode_rows", &paged_decode_rows, "decode attention over rows listed per KV head (CPU, float32)",
        py::call_guard<py::gil_scoped_release>());
  m.def("quantized_decode", &quantized_decode,
        "decode attention over tables of pool blocks and quantized blocks read in place (CPU, float32)",
        py::call_guard<py::gil_scoped_release>());
  m.def("small_linear", &small_linear, "x @ weight.T + bias for a few rows of x (CPU, float32)",
        py::call_guard<py::gil_scoped_release>());
  m.def("small_linear_bf16", &small_linear_bf16, "x @ weight.T + bias for a few rows of x (CPU, bfloat16, AVX512-BF16)",
        py::call_guard<py::gil_scoped_release>());
  m.def("small_linear_bf16_available", &small_linear_bf16_available, "whether this build has AVX512-BF16");
  m.def("prefill_attention", &prefill_attention,
        "causal prefill attention of one chunk over its paged KV (CPU, float32 or bfloat16)",
        py::call_guard<py::gil_scoped_release>());
  m.def("prefill_attention_available", &prefill_attention_available,
        "whether this build has the dtype's path (float32: AVX-512, bfloat16: AVX512-BF16)");
  m.def("rms_norm", &rms_norm, "weight * x / sqrt(mean(x^2) + eps) over the last dimension (CPU, AVX-512)",
        py::call_guard<py::gil_scoped_release>());
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up (CPU, AVX-512)", py::call_guard<py::gil_scoped_release>());
  m.def("rotary", &rotary, "x * cos + rotate_half(x) * sin, out laid out [batch, tokens, heads, dim] (CPU, AVX-512)",
        py::call_guard<py::gil_scoped_release>());
  m.def("elementwise_available", &elementwise_available, "whether this build has rms_norm and silu_mul");
  m.def("write_blocks", &write_blocks, "tier entries [layers, 2, ...] into pool blocks [2, layers, blocks, ...] (CPU)",
        py::call_guard<py::gil_scoped_release>());
}
