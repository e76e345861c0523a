// Key and value rows used where they lie, converted to float32 in registers: the decode kernel's
// path for int8, fp8 and KIVI codes and for bfloat16 pool blocks (quantized_decode.cpp).
//
// A score is the query's dot product with a row's raw codes; the row's scale and minimum are
// applied to the score afterwards (int8, fp8: one scale per token) or folded into the query (KIVI
// keys: one scale and minimum per channel for the whole block). A value row's scale folds into
// its softmax weight, and its minimum into one weighted sum per channel group. So each code is
// converted once for up to four query heads of its KV head (a larger group takes it in runs of
// four), and nothing full-precision is written to memory. Staging each block as float32 and
// reading it back cost more time than a float32 pool spends waiting on its larger rows.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include <cstdint>

namespace {

// How a row's 16 consecutive channels are stored.
enum class Codes { SIGNED8, UNSIGNED8, UNSIGNED4, UNSIGNED2, FP8, BFLOAT16 };

// Channels a call of `channels` widens: 16 a vector, and packed codes a whole 16-byte load at a
// time (32 4-bit or 64 2-bit codes), so the shifts and interleaves run once for all of them.
template <Codes C>
constexpr int VECTORS = C == Codes::UNSIGNED4 ? 2 : C == Codes::UNSIGNED2 ? 4 : 1;

// channels d .. d + 16 * VECTORS - 1 of a row as float32, 16 a vector (packed codes: the first
// code of each byte in its low bits, kv/packing.py; float8 e4m3fn decoded by its bit fields;
// bfloat16: the high half of a float32)
template <Codes C>
inline void channels(const uint8_t* row, int64_t d, __m512* out) {
  const auto bytes_to_floats = [](__m128i bytes) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)); };
  if constexpr (C == Codes::SIGNED8) {
    out[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d))));
  } else if constexpr (C == Codes::UNSIGNED8) {
    out[0] = bytes_to_floats(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d)));
  } else if constexpr (C == Codes::UNSIGNED4) {  // low and high nibbles, interleaved back
    const __m128i mask = _mm_set1_epi8(15);
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d / 2));
    const __m128i low = _mm_and_si128(bytes, mask), high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    out[0] = bytes_to_floats(_mm_unpacklo_epi8(low, high));
    out[1] = bytes_to_floats(_mm_unpackhi_epi8(low, high));
  } else if constexpr (C == Codes::UNSIGNED2) {  // the four 2-bit fields, interleaved back
    const __m128i mask = _mm_set1_epi8(3);
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d / 4));
    const __m128i f0 = _mm_and_si128(bytes, mask), f1 = _mm_and_si128(_mm_srli_epi16(bytes, 2), mask);
    const __m128i f2 = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask),
                  f3 = _mm_and_si128(_mm_srli_epi16(bytes, 6), mask);
    const __m128i low01 = _mm_unpacklo_epi8(f0, f1), low23 = _mm_unpacklo_epi8(f2, f3);
    const __m128i high01 = _mm_unpackhi_epi8(f0, f1), high23 = _mm_unpackhi_epi8(f2, f3);
    out[0] = bytes_to_floats(_mm_unpacklo_epi16(low01, low23));
    out[1] = bytes_to_floats(_mm_unpackhi_epi16(low01, low23));
    out[2] = bytes_to_floats(_mm_unpacklo_epi16(high01, high23));
    out[3] = bytes_to_floats(_mm_unpackhi_epi16(high01, high23));
  } else if constexpr (C == Codes::FP8) {  // float8 e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d)));
    const __m512i magnitude = _mm512_and_si512(bytes, _mm512_set1_epi32(0x7F));
    // normal: exponent and mantissa moved into float32's fields, the bias raised from 7 to 127
    __m512 x = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(magnitude, 20), _mm512_set1_epi32(120 << 23)));
    // subnormal (exponent 0): mantissa / 8 * 2^-6
    const __mmask16 subnormal = _mm512_testn_epi32_mask(magnitude, _mm512_set1_epi32(0x78));
    x = _mm512_mask_mul_ps(x, subnormal, _mm512_cvtepi32_ps(magnitude), _mm512_set1_ps(1.f / 512));
    // the NaN pattern, never written, reads as 0 (as the Python decoder reads it)
    x = _mm512_maskz_mov_ps(_mm512_cmpneq_epi32_mask(magnitude, _mm512_set1_epi32(0x7F)), x);
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(bytes, _mm512_set1_epi32(0x80)), 24);
    out[0] = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(x), sign));
  } else {
    const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2 * d));
    out[0] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
  }
}

// raw[g][t - lo] = query[g] . row t, for rows [lo, hi) that start `stride` bytes apart at `rows`,
// and G query rows of `dim` floats (a multiple of 16). Four rows at a time share one horizontal
// reduction (reduce4).
template <Codes C, int G>
inline void row_dots(const float* const* query, const uint8_t* rows, int64_t stride, int64_t lo, int64_t hi,
                     int64_t dim, float* const* raw) {
  constexpr int V = VECTORS<C>;
  int64_t t = lo;
  for (; t + 4 <= hi; t += 4) {
    __m512 acc[G][4];
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < 4; ++j) acc[g][j] = _mm512_setzero_ps();
    const uint8_t* row = rows + t * stride;
    for (int64_t d = 0; d < dim; d += 16 * V) {
      __m512 k[4][V];
      for (int j = 0; j < 4; ++j) channels<C>(row + j * stride, d, k[j]);
      for (int v = 0; v < V; ++v)
        for (int g = 0; g < G; ++g) {
          const __m512 x = _mm512_loadu_ps(query[g] + d + 16 * v);
          for (int j = 0; j < 4; ++j) acc[g][j] = _mm512_fmadd_ps(x, k[j][v], acc[g][j]);
        }
    }
    for (int g = 0; g < G; ++g) reduce4(acc[g][0], acc[g][1], acc[g][2], acc[g][3], raw[g] + (t - lo));
  }
  for (; t < hi; ++t) {
    __m512 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; d += 16 * V) {
      __m512 k[V];
      channels<C>(rows + t * stride, d, k);
      for (int v = 0; v < V; ++v)
        for (int g = 0; g < G; ++g) acc[g] = _mm512_fmadd_ps(_mm512_loadu_ps(query[g] + d + 16 * v), k[v], acc[g]);
    }
    for (int g = 0; g < G; ++g) raw[g][t - lo] = _mm512_reduce_add_ps(acc[g]);
  }
}

// out[g][d] += sum over rows t in [lo, hi) of weight[g][(t - lo) * groups + d / width] * row t's
// channel d: rows as in row_dots, `groups` weights a row (one per channel group of `width`, a
// multiple of 16). Where one vector covers a load, two rows a step go to separate accumulators,
// so each query head has at least two FMA chains in flight.
template <Codes C, int G>
inline void row_sums(const float* const* weight, int64_t groups, int64_t width, const uint8_t* rows, int64_t stride,
                     int64_t lo, int64_t hi, int64_t dim, float* const* out) {
  constexpr int V = VECTORS<C>, P = V == 1 ? 2 : 1;
  for (int64_t d = 0; d < dim; d += 16 * V) {
    __m512 acc[P][G][V];
    for (int g = 0; g < G; ++g)
      for (int v = 0; v < V; ++v) {
        acc[0][g][v] = _mm512_loadu_ps(out[g] + d + 16 * v);
        for (int p = 1; p < P; ++p) acc[p][g][v] = _mm512_setzero_ps();
      }
    const auto add_row = [&](int p, int64_t t) {
      __m512 x[V];
      channels<C>(rows + t * stride, d, x);
      for (int v = 0; v < V; ++v) {
        const int64_t at = (t - lo) * groups + (d + 16 * v) / width;
        for (int g = 0; g < G; ++g) acc[p][g][v] = _mm512_fmadd_ps(_mm512_set1_ps(weight[g][at]), x[v], acc[p][g][v]);
      }
    };
    int64_t t = lo;
    for (; t + P <= hi; t += P)
      for (int p = 0; p < P; ++p) add_row(p, t + p);
    for (; t < hi; ++t) add_row(0, t);
    for (int g = 0; g < G; ++g)
      for (int v = 0; v < V; ++v) {
        __m512 sum = acc[0][g][v];
        for (int p = 1; p < P; ++p) sum = _mm512_add_ps(sum, acc[p][g][v]);
        _mm512_storeu_ps(out[g] + d + 16 * v, sum);
      }
  }
}

// row_dots and row_sums for `count` query heads (any number: four at a time), codes chosen at
// run time
template <Codes C>
inline void row_dots_for(int64_t count, const float* const* query, const uint8_t* rows, int64_t stride, int64_t lo,
                         int64_t hi, int64_t dim, float* const* raw) {
  for (; count >= 4; count -= 4, query += 4, raw += 4) row_dots<C, 4>(query, rows, stride, lo, hi, dim, raw);
  if (count == 3) row_dots<C, 3>(query, rows, stride, lo, hi, dim, raw);
  if (count == 2) row_dots<C, 2>(query, rows, stride, lo, hi, dim, raw);
  if (count == 1) row_dots<C, 1>(query, rows, stride, lo, hi, dim, raw);
}

template <Codes C>
inline void row_sums_for(int64_t count, const float* const* weight, int64_t groups, int64_t width,
                         const uint8_t* rows, int64_t stride, int64_t lo, int64_t hi, int64_t dim, float* const* out) {
  for (; count >= 4; count -= 4, weight += 4, out += 4)
    row_sums<C, 4>(weight, groups, width, rows, stride, lo, hi, dim, out);
  if (count == 3) row_sums<C, 3>(weight, groups, width, rows, stride, lo, hi, dim, out);
  if (count == 2) row_sums<C, 2>(weight, groups, width, rows, stride, lo, hi, dim, out);
  if (count == 1) row_sums<C, 1>(weight, groups, width, rows, stride, lo, hi, dim, out);
}

inline void dispatch_dots(Codes codes, int64_t count, const float* const* query, const uint8_t* rows,
                          int64_t stride, int64_t lo, int64_t hi, int64_t dim, float* const* raw) {
  switch (codes) {
    case Codes::SIGNED8: return row_dots_for<Codes::SIGNED8>(count, query, rows, stride, lo, hi, dim, raw);
    case Codes::UNSIGNED8: return row_dots_for<Codes::UNSIGNED8>(count, query, rows, stride, lo, hi, dim, raw);
    case Codes::UNSIGNED4: return row_dots_for<Codes::UNSIGNED4>(count, query, rows, stride, lo, hi, dim, raw);
    case Codes::UNSIGNED2: return row_dots_for<Codes::UNSIGNED2>(count, query, rows, stride, lo, hi, dim, raw);
    case Codes::FP8: return row_dots_for<Codes::FP8>(count, query, rows, stride, lo, hi, dim, raw);
    case Codes::BFLOAT16: return row_dots_for<Codes::BFLOAT16>(count, query, rows, stride, lo, hi, dim, raw);
  }
}

inline void dispatch_sums(Codes codes, int64_t count, const float* const* weight, int64_t groups, int64_t width,
                          const uint8_t* rows, int64_t stride, int64_t lo, int64_t hi, int64_t dim,
                          float* const* out) {
  switch (codes) {
    case Codes::SIGNED8:
      return row_sums_for<Codes::SIGNED8>(count, weight, groups, width, rows, stride, lo, hi, dim, out);
    case Codes::UNSIGNED8:
      return row_sums_for<Codes::UNSIGNED8>(count, weight, groups, width, rows, stride, lo, hi, dim, out);
    case Codes::UNSIGNED4:
      return row_sums_for<Codes::UNSIGNED4>(count, weight, groups, width, rows, stride, lo, hi, dim, out);
    case Codes::UNSIGNED2:
      return row_sums_for<Codes::UNSIGNED2>(count, weight, groups, width, rows, stride, lo, hi, dim, out);
    case Codes::FP8:
      return row_sums_for<Codes::FP8>(count, weight, groups, width, rows, stride, lo, hi, dim, out);
    case Codes::BFLOAT16:
      return row_sums_for<Codes::BFLOAT16>(count, weight, groups, width, rows, stride, lo, hi, dim, out);
  }
}

}  // namespace

#endif  // __AVX512F__
