// A transformer layer's elementwise steps, one pass each on CPU: RMSNorm, SiLU(gate) * up, and
// rotary position embedding.
//
// transformers writes RMSNorm as five tensor operations (square, mean, add, rsqrt, two products),
// the gated MLP's activation as two, and rotary embedding as six for each of queries and keys (two
// products, a negation, a concatenation, a product and a sum): each a pass over memory and, at a
// decode step's few rows, a dispatch that costs more than its arithmetic. Profiling a float32
// batch of the embedded model, these passes took about a third of the time its linear layers did.
// Here each step reads its inputs once and writes its output once, in float32 registers, and
// rounds where transformers rounds: a bfloat16 model's normalized row is rounded before the weight
// multiplies it, SiLU's output before the product, each rotary product before the sum. So
// bfloat16 results differ from transformers' by the order of a sum (a unit in the last place), not
// by a rounding step. In float32 the compiler may fuse a product and a sum into one rounding,
// again a unit in the last place. Built with AVX-512 (F and BW) only; `elementwise_available()`
// says whether this build has it.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>

bool elementwise_available() {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
namespace {

constexpr int64_t LANES = 16;
constexpr int64_t SERIAL_ELEMENTS = 1 << 15;  // below this, threads cost more than they save

inline __mmask16 tail_mask(int64_t left) {
  return left >= LANES ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}

inline __m512 load(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }

inline __m512 load(const at::BFloat16* p, __mmask16 mask) {
  const __m256i raw = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// float32 to bfloat16 bits, rounded to nearest even as torch rounds (NaN stays NaN)
inline __m256i to_bfloat16_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(rounded);
}

// the value a tensor of `T` holds for v: v itself in float32, v rounded in bfloat16
inline __m512 as_stored(__m512 v, float*) { return v; }
inline __m512 as_stored(__m512 v, at::BFloat16*) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bfloat16_bits(v)), 16));
}

inline void store(float* p, __m512 v, __mmask16 mask) { _mm512_mask_storeu_ps(p, mask, v); }
inline void store(at::BFloat16* p, __m512 v, __mmask16 mask) { _mm256_mask_storeu_epi16(p, mask, to_bfloat16_bits(v)); }

// e^x to within a unit in the last place: x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor
// series to r^7 (the next term is under 6e-9 of the result), then scaled by 2^n. The clamp keeps
// n finite; past e^88.7 the scaling overflows to inf and below e^-103.9 it reaches 0, as expf
// does, so SiLU(-inf) is NaN and SiLU(-1e4) is -0, as in torch.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(100.0f)), _mm512_set1_ps(-104.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln 2 in two parts: exact n * high
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

template <typename T>
void rms_norm_rows(const T* x, const T* weight, T* out, int64_t rows, int64_t width, float eps) {
  auto body = [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* in = x + row * width;
      T* result = out + row * width;
      __m512 squares = _mm512_setzero_ps();
      for (int64_t i = 0; i < width; i += LANES) {
        const __m512 v = load(in + i, tail_mask(width - i));
        squares = _mm512_fmadd_ps(v, v, squares);
      }
      const float scale = 1.0f / std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(width) + eps);
      const __m512 factor = _mm512_set1_ps(scale);
      for (int64_t i = 0; i < width; i += LANES) {
        const __mmask16 mask = tail_mask(width - i);
        const __m512 normalized = as_stored(_mm512_mul_ps(load(in + i, mask), factor), result);
        store(result + i, _mm512_mul_ps(load(weight + i, mask), normalized), mask);
      }
    }
  };
  if (rows * width < SERIAL_ELEMENTS) body(0, rows);
  else at::parallel_for(0, rows, 1, body);
}

template <typename T>
void silu_mul_elements(const T* gate, const T* up, T* out, int64_t count) {
  auto body = [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; i += LANES) {
      const __mmask16 mask = tail_mask(end - i);
      const __m512 g = load(gate + i, mask);
      const __m512 one = _mm512_set1_ps(1.0f);
      const __m512 activated = as_stored(_mm512_div_ps(g, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g)))), out);
      store(out + i, _mm512_mul_ps(activated, load(up + i, mask)), mask);
    }
  };
  if (count < SERIAL_ELEMENTS) body(0, count);
  else at::parallel_for(0, (count + LANES - 1) / LANES, 256, [&](int64_t begin, int64_t end) {
    body(begin * LANES, std::min(end * LANES, count));
  });
}

// x rotated by the angles whose cosines and sines are cos, sin (transformers' rotate_half form:
// the first half of each row pairs with the second). x: [batch, heads, tokens, dim] with rows
// contiguous; cos, sin: [batch, tokens, dim]; out: [batch, tokens, heads, dim] contiguous. Each
// product and the sum are rounded to T, as transformers' three tensor operations round them.
template <typename T>
void rotate_rows(const T* x, const T* cos, const T* sin, T* out, int64_t batch, int64_t heads, int64_t tokens,
                 int64_t dim, int64_t stride_b, int64_t stride_h, int64_t stride_t) {
  const int64_t half = dim / 2, rows = batch * heads * tokens;
  auto body = [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / (tokens * heads), t = row / heads % tokens, h = row % heads;
      const T* in = x + b * stride_b + h * stride_h + t * stride_t;
      const T* c = cos + (b * tokens + t) * dim;
      const T* s = sin + (b * tokens + t) * dim;
      T* result = out + row * dim;
      for (int64_t i = 0; i < half; i += LANES) {
        const __mmask16 mask = tail_mask(half - i);
        const __m512 first = load(in + i, mask), second = load(in + half + i, mask);
        const __m512 low = _mm512_add_ps(as_stored(_mm512_mul_ps(first, load(c + i, mask)), result),
                                         as_stored(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), second), load(s + i, mask)), result));
        const __m512 high = _mm512_add_ps(as_stored(_mm512_mul_ps(second, load(c + half + i, mask)), result),
                                          as_stored(_mm512_mul_ps(first, load(s + half + i, mask)), result));
        store(result + i, low, mask);
        store(result + half + i, high, mask);
      }
    }
  };
  if (rows * dim < SERIAL_ELEMENTS) body(0, rows);
  else at::parallel_for(0, rows, 16, body);
}

}  // namespace
#endif

// x [rows, width] (any leading shape, contiguous), weight [width], both float32 or both bfloat16:
// weight * (x / sqrt(mean(x^2) + eps)), the normalized x rounded to x's dtype first
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(elementwise_available(), "rms_norm: this build has no AVX-512");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu() && x.is_contiguous() && weight.is_contiguous() &&
                  weight.dim() == 1,
              "rms_norm: x and weight must be contiguous CPU tensors, weight one row");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() &&
                  (x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16),
              "rms_norm: x and weight must both be float32 or both bfloat16");
  const int64_t width = weight.size(0);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == width, "rms_norm: x's last dimension must be weight's length");
  auto out = torch::empty_like(x);
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const int64_t rows = width ? x.numel() / width : 0;
  if (x.scalar_type() == torch::kFloat)
    rms_norm_rows(x.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), rows, width, static_cast<float>(eps));
  else
    rms_norm_rows(x.data_ptr<at::BFloat16>(), weight.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), rows,
                  width, static_cast<float>(eps));
#endif
  return out;
}

// SiLU(gate) * up, elementwise, float32 or bfloat16 (SiLU's output rounded to the dtype first)
torch::Tensor silu_mul(torch::Tensor gate, torch::Tensor up) {
  TORCH_CHECK(elementwise_available(), "silu_mul: this build has no AVX-512");
  TORCH_CHECK(gate.device().is_cpu() && up.device().is_cpu() && gate.is_contiguous() && up.is_contiguous() &&
                  gate.sizes() == up.sizes(),
              "silu_mul: gate and up must be contiguous CPU tensors of one shape");
  TORCH_CHECK(gate.scalar_type() == up.scalar_type() &&
                  (gate.scalar_type() == torch::kFloat || gate.scalar_type() == torch::kBFloat16),
              "silu_mul: gate and up must both be float32 or both bfloat16");
  auto out = torch::empty_like(gate);
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (gate.scalar_type() == torch::kFloat)
    silu_mul_elements(gate.data_ptr<float>(), up.data_ptr<float>(), out.data_ptr<float>(), gate.numel());
  else
    silu_mul_elements(gate.data_ptr<at::BFloat16>(), up.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(),
                      gate.numel());
#endif
  return out;
}

// x [batch, heads, tokens, dim] (rows contiguous) rotated by cos, sin [batch, tokens, dim]:
// x * cos + rotate_half(x) * sin, as transformers' apply_rotary_pos_emb computes it. The result
// is [batch, heads, tokens, dim] laid out as [batch, tokens, heads, dim], the layout the paged
// attention stores keys in.
torch::Tensor rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(elementwise_available(), "rotary: this build has no AVX-512");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 4 && x.stride(3) == 1 && x.size(3) % 2 == 0,
              "rotary: x must be a CPU tensor [batch, heads, tokens, dim] with contiguous rows of even width");
  const int64_t batch = x.size(0), heads = x.size(1), tokens = x.size(2), dim = x.size(3);
  TORCH_CHECK(cos.device().is_cpu() && sin.device().is_cpu() && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.dim() == 3 && cos.sizes() == sin.sizes() &&
                  cos.size(0) == batch && cos.size(1) == tokens && cos.size(2) == dim,
              "rotary: cos and sin must be contiguous [batch, tokens, dim]");
  TORCH_CHECK(x.scalar_type() == cos.scalar_type() && x.scalar_type() == sin.scalar_type() &&
                  (x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16),
              "rotary: x, cos and sin must all be float32 or all bfloat16");
  auto out = torch::empty({batch, tokens, heads, dim}, x.options());
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (x.scalar_type() == torch::kFloat)
    rotate_rows(x.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), out.data_ptr<float>(), batch, heads,
                tokens, dim, x.stride(0), x.stride(1), x.stride(2));
  else
    rotate_rows(x.data_ptr<at::BFloat16>(), cos.data_ptr<at::BFloat16>(), sin.data_ptr<at::BFloat16>(),
                out.data_ptr<at::BFloat16>(), batch, heads, tokens, dim, x.stride(0), x.stride(1), x.stride(2));
#endif
  return out.transpose(1, 2);
}
