// y = x @ weight^T (+ bias) for a few rows of x on CPU, bfloat16: a decode step's projections.
//
// torch's bfloat16 linear goes through oneDNN, whose set-up costs about 50 us a call whatever the
// size: at one row, the embedded model's 210 projections a step spent twice as long in it as
// reading their weights takes. Here each weight row is streamed once and multiplied with AVX512-BF16
// (`vdpbf16ps`: pairs of bfloat16 products summed into float32 lanes), so the products and sums are
// float32, as oneDNN's are; the output is rounded to bfloat16 once. Built only where the compiler
// targets AVX512-BF16; `small_linear_bf16_available()` says whether this build has it.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>

bool small_linear_bf16_available() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX512BF16__)
namespace {

constexpr int64_t OUTPUTS = 4;  // weight rows per tile: ROWS x 4 accumulators and 4 weight vectors in registers

// y[m0 .. m0+ROWS-1, n0 .. n0+outputs-1]: the weight tile is read once for ROWS rows of x
template <int ROWS>
void tile(const uint16_t* x, const uint16_t* w, const float* bias, at::BFloat16* y, int64_t m0, int64_t n0,
          int64_t outputs, int64_t K, int64_t N) {
  __m512 acc[ROWS][OUTPUTS];
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < OUTPUTS; ++j) acc[r][j] = _mm512_setzero_ps();
  const uint16_t* rows[OUTPUTS];
  for (int j = 0; j < OUTPUTS; ++j) rows[j] = w + (n0 + std::min<int64_t>(j, outputs - 1)) * K;  // a short tile repeats its last row
  for (int64_t k = 0; k < K; k += 32) {
    const __mmask32 mask = K - k >= 32 ? ~__mmask32(0) : (__mmask32(1) << (K - k)) - 1;
    __m512bh weights[OUTPUTS];
    for (int j = 0; j < OUTPUTS; ++j) weights[j] = (__m512bh)_mm512_maskz_loadu_epi16(mask, rows[j] + k);
    for (int r = 0; r < ROWS; ++r) {
      const __m512bh xs = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + (m0 + r) * K + k);
      for (int j = 0; j < OUTPUTS; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xs, weights[j]);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < outputs; ++j) {
      const float sum = _mm512_reduce_add_ps(acc[r][j]) + (bias ? bias[n0 + j] : 0.f);
      y[(m0 + r) * N + n0 + j] = at::BFloat16(sum);
    }
}

}  // namespace
#endif

torch::Tensor small_linear_bf16(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(small_linear_bf16_available(), "small_linear_bf16: this build has no AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "small_linear_bf16: bad shapes");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "small_linear_bf16: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && weight.scalar_type() == torch::kBFloat16,
              "small_linear_bf16: bfloat16 only");
  x = x.contiguous();
  weight = weight.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  auto y = torch::empty({M, N}, x.options());
  torch::Tensor bias_float;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "small_linear_bf16: the bias must have one value per output");
    bias_float = bias->to(torch::kFloat).contiguous();
  }
#if defined(__AVX512BF16__)
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* ws = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  const float* bs = bias_float.defined() ? bias_float.data_ptr<float>() : nullptr;
  at::BFloat16* ys = y.data_ptr<at::BFloat16>();
  // threads split the outputs, so each reads its own share of the weight once
  at::parallel_for(0, (N + OUTPUTS - 1) / OUTPUTS, 16, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      const int64_t n0 = block * OUTPUTS, outputs = std::min(OUTPUTS, N - n0);
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) tile<4>(xs, ws, bs, ys, m, n0, outputs, K, N);
      switch (M - m) {
        case 3: tile<3>(xs, ws, bs, ys, m, n0, outputs, K, N); break;
        case 2: tile<2>(xs, ws, bs, ys, m, n0, outputs, K, N); break;
        case 1: tile<1>(xs, ws, bs, ys, m, n0, outputs, K, N); break;
        default: break;
      }
    }
  });
#endif
  return y;
}
