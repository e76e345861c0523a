// The inner loops both decode kernels share (paged_decode.cpp, quantized_decode.cpp): dot
// products of a query with key rows, weighted sums of value rows, the softmax's exponentials, row
// prefetches and the checks on their tensors. Header-only: each kernel inlines them.
#pragma once

#include <torch/extension.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

namespace {

// GCC does not vectorise a float reduction without -ffast-math (which would change results
// elsewhere), so the two inner loops are written with the widest vectors the CPU has.
#if defined(__AVX512F__)
inline float dot(const float* a, const float* b, int64_t n) {
  __m512 low = _mm512_setzero_ps(), high = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    low = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), low);
    high = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), high);
  }
  for (; i + 16 <= n; i += 16) low = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), low);
  float sum = _mm512_reduce_add_ps(_mm512_add_ps(low, high));
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// y[0:n] += w[0] v[0] + ... + w[count-1] v[count-1]: y stays in registers across the rows, so it
// is loaded and stored once per call, not once per row; four accumulators are four independent
// FMA chains.
inline void weighted_sum(const float* w, const float* const* v, int64_t count, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    __m512 a0 = _mm512_loadu_ps(y + i), a1 = _mm512_loadu_ps(y + i + 16), a2 = _mm512_loadu_ps(y + i + 32),
           a3 = _mm512_loadu_ps(y + i + 48);
    for (int64_t j = 0; j < count; ++j) {
      const __m512 s = _mm512_set1_ps(w[j]);
      const float* x = v[j] + i;
      a0 = _mm512_fmadd_ps(s, _mm512_loadu_ps(x), a0);
      a1 = _mm512_fmadd_ps(s, _mm512_loadu_ps(x + 16), a1);
      a2 = _mm512_fmadd_ps(s, _mm512_loadu_ps(x + 32), a2);
      a3 = _mm512_fmadd_ps(s, _mm512_loadu_ps(x + 48), a3);
    }
    _mm512_storeu_ps(y + i, a0);
    _mm512_storeu_ps(y + i + 16, a1);
    _mm512_storeu_ps(y + i + 32, a2);
    _mm512_storeu_ps(y + i + 48, a3);
  }
  for (; i + 16 <= n; i += 16) {
    __m512 a = _mm512_loadu_ps(y + i);
    for (int64_t j = 0; j < count; ++j) a = _mm512_fmadd_ps(_mm512_set1_ps(w[j]), _mm512_loadu_ps(v[j] + i), a);
    _mm512_storeu_ps(y + i, a);
  }
  for (; i < n; ++i)
    for (int64_t j = 0; j < count; ++j) y[i] += w[j] * v[j][i];
}
// s[i] = exp(s[i] - peak) for i < n; returns their sum. Cephes' expf polynomial on
// [-ln2/2, ln2/2] times 2^k: within 2 ulp of std::exp, which costs 10x more per score.
// max(floor, x) with x second: a NaN score stays NaN, as SDPA would report it.
inline float exp_shifted(float* s, int64_t n, float peak) {
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f), ln2_high = _mm512_set1_ps(0.693359375f),
               ln2_low = _mm512_set1_ps(-2.12194440e-4f), floor_ = _mm512_set1_ps(-87.3f), shift = _mm512_set1_ps(peak);
  __m512 total = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 x = _mm512_max_ps(floor_, _mm512_sub_ps(_mm512_loadu_ps(s + i), shift));
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(k, ln2_low, _mm512_fnmadd_ps(k, ln2_high, x));
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
    y = _mm512_scalef_ps(y, k);
    _mm512_storeu_ps(s + i, y);
    total = _mm512_add_ps(total, y);
  }
  float sum = _mm512_reduce_add_ps(total);
  for (; i < n; ++i) sum += (s[i] = std::exp(s[i] - peak));
  return sum;
}
// out[j] = the sum of a_j's sixteen lanes, for four accumulators: one horizontal reduction for
// all four, where four separate ones would cost twice the shuffles.
inline void reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3, float* out) {
  // [a0 a1 a0 a1 | ...] then [a0 a1 a2 a3] per 128-bit lane, then the four lanes added
  const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  const __m512 s0123 = _mm512_add_ps(
      _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))),
      _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))));
  const __m256 halves = _mm256_add_ps(_mm512_castps512_ps256(s0123), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s0123), 1)));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(halves), _mm256_extractf128_ps(halves, 1)));
}
// Four dot products of q with four key rows, out[j] = q . k[j], with one reduction (reduce4).
inline void dot4(const float* q, const float* const* k, int64_t n, float* out) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 query = _mm512_loadu_ps(q + i);
    a0 = _mm512_fmadd_ps(query, _mm512_loadu_ps(k[0] + i), a0);
    a1 = _mm512_fmadd_ps(query, _mm512_loadu_ps(k[1] + i), a1);
    a2 = _mm512_fmadd_ps(query, _mm512_loadu_ps(k[2] + i), a2);
    a3 = _mm512_fmadd_ps(query, _mm512_loadu_ps(k[3] + i), a3);
  }
  reduce4(a0, a1, a2, a3, out);
  for (; i < n; ++i)
    for (int j = 0; j < 4; ++j) out[j] += q[i] * k[j][i];
}
#elif defined(__AVX2__) && defined(__FMA__)
inline float dot(const float* a, const float* b, int64_t n) {
  __m256 low = _mm256_setzero_ps(), high = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    low = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), low);
    high = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), high);
  }
  for (; i + 8 <= n; i += 8) low = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), low);
  const __m256 both = _mm256_add_ps(low, high);
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(both), _mm256_extractf128_ps(both, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  half = _mm_add_ss(half, _mm_movehdup_ps(half));
  float sum = _mm_cvtss_f32(half);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

inline void weighted_sum(const float* w, const float* const* v, int64_t count, float* y, int64_t n) {
  int64_t i = 0;  // as the AVX-512 version; eight accumulators, as FMA latency is 4-5 cycles
  for (; i + 64 <= n; i += 64) {
    __m256 a[8];
    for (int r = 0; r < 8; ++r) a[r] = _mm256_loadu_ps(y + i + 8 * r);
    for (int64_t j = 0; j < count; ++j) {
      const __m256 s = _mm256_set1_ps(w[j]);
      const float* x = v[j] + i;
      for (int r = 0; r < 8; ++r) a[r] = _mm256_fmadd_ps(s, _mm256_loadu_ps(x + 8 * r), a[r]);
    }
    for (int r = 0; r < 8; ++r) _mm256_storeu_ps(y + i + 8 * r, a[r]);
  }
  for (; i + 8 <= n; i += 8) {
    __m256 a = _mm256_loadu_ps(y + i);
    for (int64_t j = 0; j < count; ++j) a = _mm256_fmadd_ps(_mm256_set1_ps(w[j]), _mm256_loadu_ps(v[j] + i), a);
    _mm256_storeu_ps(y + i, a);
  }
  for (; i < n; ++i)
    for (int64_t j = 0; j < count; ++j) y[i] += w[j] * v[j][i];
}
inline float exp_shifted(float* s, int64_t n, float peak) {  // as the AVX-512 version
  const __m256 log2e = _mm256_set1_ps(1.44269504088896341f), ln2_high = _mm256_set1_ps(0.693359375f),
               ln2_low = _mm256_set1_ps(-2.12194440e-4f), floor_ = _mm256_set1_ps(-87.3f), shift = _mm256_set1_ps(peak);
  __m256 total = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 x = _mm256_max_ps(floor_, _mm256_sub_ps(_mm256_loadu_ps(s + i), shift));
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(k, ln2_low, _mm256_fnmadd_ps(k, ln2_high, x));
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
    const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(exponent));
    _mm256_storeu_ps(s + i, y);
    total = _mm256_add_ps(total, y);
  }
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(total), _mm256_extractf128_ps(total, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  half = _mm_add_ss(half, _mm_movehdup_ps(half));
  float sum = _mm_cvtss_f32(half);
  for (; i < n; ++i) sum += (s[i] = std::exp(s[i] - peak));
  return sum;
}
// As the AVX-512 dot4: three horizontal adds turn four accumulators into [s0 s1 s2 s3] per
// 128-bit lane, where four separate reductions would cost three times the shuffles.
inline void dot4(const float* q, const float* const* k, int64_t n, float* out) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 query = _mm256_loadu_ps(q + i);
    a0 = _mm256_fmadd_ps(query, _mm256_loadu_ps(k[0] + i), a0);
    a1 = _mm256_fmadd_ps(query, _mm256_loadu_ps(k[1] + i), a1);
    a2 = _mm256_fmadd_ps(query, _mm256_loadu_ps(k[2] + i), a2);
    a3 = _mm256_fmadd_ps(query, _mm256_loadu_ps(k[3] + i), a3);
  }
  const __m256 sums = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1)));
  for (; i < n; ++i)
    for (int j = 0; j < 4; ++j) out[j] += q[i] * k[j][i];
}

#else
inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

inline void weighted_sum(const float* w, const float* const* v, int64_t count, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < count; ++j) y[i] += w[j] * v[j][i];
}
inline float exp_shifted(float* s, int64_t n, float peak) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += (s[i] = std::exp(s[i] - peak));
  return sum;
}
#endif

#if !defined(__AVX512F__) && !(defined(__AVX2__) && defined(__FMA__))
inline void dot4(const float* q, const float* const* k, int64_t n, float* out) {
  for (int j = 0; j < 4; ++j) out[j] = dot(q, k[j], n);
}
#endif

// value rows summed per weighted_sum call: enough to amortise the output's load and store
constexpr int64_t ROWS = 16;

// Rows are requested this many tokens ahead of their use: the kernel waits on memory, and the
// hardware prefetcher does not run ahead across page and block boundaries. Over consecutive
// blocks it measured 11 -> 15 GB/s in a microbenchmark; over scattered blocks, no change.
constexpr int64_t PREFETCH_ROWS = 16;

inline void prefetch_row(const float* row, int64_t floats) {
  for (int64_t i = 0; i < floats; i += 16) __builtin_prefetch(row + i, 0, 3);
}

// What both entry points require of their tensors: all on the CPU, query, keys and values in
// float32, the index (block tables or rows) and the lengths in int64.
void check_tensors(const char* name, const char* index_name, const torch::Tensor& query, const torch::Tensor& keys,
                   const torch::Tensor& values, const torch::Tensor& index, const torch::Tensor& lengths) {
  TORCH_CHECK(query.device().is_cpu() && keys.device().is_cpu() && values.device().is_cpu() &&
                  index.device().is_cpu() && lengths.device().is_cpu(),
              name, ": CPU tensors only");
  TORCH_CHECK(query.scalar_type() == torch::kFloat && keys.scalar_type() == torch::kFloat &&
                  values.scalar_type() == torch::kFloat,
              name, ": float32 only");
  TORCH_CHECK(index.scalar_type() == torch::kLong && lengths.scalar_type() == torch::kLong, name, ": int64 ",
              index_name, " and lengths");
}

// Task ids 0 .. tasks-1, longest sequence first (task t belongs to sequence t / tasks_per_sequence):
// lengths differ several-fold, and handing the long ones out first keeps both threads busy to the end.
inline std::vector<int64_t> longest_first(int64_t tasks, int64_t tasks_per_sequence, const int64_t* length_of) {
  std::vector<int64_t> order(tasks);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
    return length_of[x / tasks_per_sequence] > length_of[y / tasks_per_sequence];
  });
  return order;
}

// scores [heads, n] -> scaled, capped (softcap > 0) and exponentiated against each head's peak;
// totals[h] their sum (the softmax's denominator, applied by `normalise` at the end).
inline void softmax_numerators(float* scores, int64_t heads, int64_t n, float scale, float cap, float* totals) {
  // two loops, so the common one (no cap) vectorises
  for (int64_t i = 0; i < heads * n; ++i) scores[i] *= scale;
  if (cap > 0.f)
    for (int64_t i = 0; i < heads * n; ++i) scores[i] = std::tanh(scores[i] / cap) * cap;
  for (int64_t h = 0; h < heads; ++h) {
    float* s = scores + h * n;
    totals[h] = exp_shifted(s, n, *std::max_element(s, s + n));
  }
}

// out [heads, dim] /= totals[h]
inline void normalise(float* out, const float* totals, int64_t heads, int64_t dim) {
  for (int64_t h = 0; h < heads; ++h) {
    const float inverse = 1.f / totals[h];
    for (int64_t d = 0; d < dim; ++d) out[h * dim + d] *= inverse;
  }
}

}  // namespace
