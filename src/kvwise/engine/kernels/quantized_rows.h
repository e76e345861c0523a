// Key and value rows used where they lie, converted to float32 in registers: the decode kernel's
// path for int8 and KIVI codes and for bfloat16 pool blocks (quantized_decode.cpp).
//
// A score is the query's dot product with a row's raw codes; the row's scale and minimum are
// applied to the score afterwards (int8: one scale per token) or folded into the query (KIVI
// keys: one scale and minimum per channel for the whole block). A value row's scale folds into
// its softmax weight, and its minimum into one weighted sum per channel group. So each code is
// converted once per KV head, used by every query head of the group, and nothing full-precision
// is written to memory: the earlier path staged each block as float32 and read it back, and
// spent more time there than a float32 pool spends waiting on its four-times-larger rows.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace {

// How a row's 16 consecutive channels are stored.
enum class Codes { SIGNED8, UNSIGNED8, UNSIGNED4, UNSIGNED2, BFLOAT16 };

// channels d .. d+15 of a row as float32 (packed codes: the first code of each byte in its low
// bits, kv/packing.py; bfloat16: the high half of a float32)
template <Codes C>
inline __m512 channels16(const uint8_t* row, int64_t d) {
  if constexpr (C == Codes::SIGNED8) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d))));
  } else if constexpr (C == Codes::UNSIGNED8) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d))));
  } else if constexpr (C == Codes::UNSIGNED4) {  // 8 bytes: low nibbles and high nibbles, interleaved back
    const __m128i mask = _mm_set1_epi8(15);
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + d / 2));
    const __m128i low = _mm_and_si128(bytes, mask), high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(low, high)));
  } else if constexpr (C == Codes::UNSIGNED2) {  // 4 bytes: the four 2-bit fields, interleaved back
    const __m128i mask = _mm_set1_epi8(3);
    int32_t four;
    std::memcpy(&four, row + d / 4, sizeof four);
    const __m128i bytes = _mm_cvtsi32_si128(four);
    const __m128i f0 = _mm_and_si128(bytes, mask), f1 = _mm_and_si128(_mm_srli_epi16(bytes, 2), mask);
    const __m128i f2 = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask),
                  f3 = _mm_and_si128(_mm_srli_epi16(bytes, 6), mask);
    return _mm512_cvtepi32_ps(
        _mm512_cvtepu8_epi32(_mm_unpacklo_epi16(_mm_unpacklo_epi8(f0, f1), _mm_unpacklo_epi8(f2, f3))));
  } else {
    const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2 * d));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
  }
}

// raw[g][t - lo] = query[g] . row t, for rows [lo, hi) that start `stride` bytes apart at `rows`,
// and G query rows of `dim` floats (a multiple of 16). Four rows at a time share one horizontal
// reduction (reduce4).
template <Codes C, int G>
inline void row_dots(const float* const* query, const uint8_t* rows, int64_t stride, int64_t lo, int64_t hi,
                     int64_t dim, float* const* raw) {
  int64_t t = lo;
  for (; t + 4 <= hi; t += 4) {
    __m512 acc[G][4];
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < 4; ++j) acc[g][j] = _mm512_setzero_ps();
    const uint8_t* row = rows + t * stride;
    for (int64_t d = 0; d < dim; d += 16) {
      const __m512 k0 = channels16<C>(row, d), k1 = channels16<C>(row + stride, d),
                   k2 = channels16<C>(row + 2 * stride, d), k3 = channels16<C>(row + 3 * stride, d);
      for (int g = 0; g < G; ++g) {
        const __m512 x = _mm512_loadu_ps(query[g] + d);
        acc[g][0] = _mm512_fmadd_ps(x, k0, acc[g][0]);
        acc[g][1] = _mm512_fmadd_ps(x, k1, acc[g][1]);
        acc[g][2] = _mm512_fmadd_ps(x, k2, acc[g][2]);
        acc[g][3] = _mm512_fmadd_ps(x, k3, acc[g][3]);
      }
    }
    for (int g = 0; g < G; ++g) reduce4(acc[g][0], acc[g][1], acc[g][2], acc[g][3], raw[g] + (t - lo));
  }
  for (; t < hi; ++t) {
    __m512 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; d += 16) {
      const __m512 k = channels16<C>(rows + t * stride, d);
      for (int g = 0; g < G; ++g) acc[g] = _mm512_fmadd_ps(_mm512_loadu_ps(query[g] + d), k, acc[g]);
    }
    for (int g = 0; g < G; ++g) raw[g][t - lo] = _mm512_reduce_add_ps(acc[g]);
  }
}

// out[g][d] += sum over rows t in [lo, hi) of weight[g][(t - lo) * groups + d / width] * row t's
// channel d: rows as in row_dots, `groups` weights a row (one per channel group of `width`, a
// multiple of 16). Even and odd rows go to separate accumulators: two FMA chains per query head.
template <Codes C, int G>
inline void row_sums(const float* const* weight, int64_t groups, int64_t width, const uint8_t* rows, int64_t stride,
                     int64_t lo, int64_t hi, int64_t dim, float* const* out) {
  for (int64_t d = 0; d < dim; d += 16) {
    const int64_t group = d / width;
    __m512 even[G], odd[G];
    for (int g = 0; g < G; ++g) {
      even[g] = _mm512_loadu_ps(out[g] + d);
      odd[g] = _mm512_setzero_ps();
    }
    int64_t t = lo;
    for (; t + 2 <= hi; t += 2) {
      const __m512 v0 = channels16<C>(rows + t * stride, d), v1 = channels16<C>(rows + (t + 1) * stride, d);
      const int64_t at = (t - lo) * groups + group;
      for (int g = 0; g < G; ++g) {
        even[g] = _mm512_fmadd_ps(_mm512_set1_ps(weight[g][at]), v0, even[g]);
        odd[g] = _mm512_fmadd_ps(_mm512_set1_ps(weight[g][at + groups]), v1, odd[g]);
      }
    }
    if (t < hi) {
      const __m512 v = channels16<C>(rows + t * stride, d);
      for (int g = 0; g < G; ++g)
        even[g] = _mm512_fmadd_ps(_mm512_set1_ps(weight[g][(t - lo) * groups + group]), v, even[g]);
    }
    for (int g = 0; g < G; ++g) _mm512_storeu_ps(out[g] + d, _mm512_add_ps(even[g], odd[g]));
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
    case Codes::BFLOAT16:
      return row_sums_for<Codes::BFLOAT16>(count, weight, groups, width, rows, stride, lo, hi, dim, out);
  }
}

}  // namespace

#endif  // __AVX512F__
