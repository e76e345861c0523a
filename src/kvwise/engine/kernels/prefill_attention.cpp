// Causal prefill attention of one chunk over its sequence's paged KV, on CPU, in float32 or
// bfloat16.
//
// torch's CPU flash attention ran the embedded model's prefill attention at about half the
// float32 peak of two cores, and bfloat16 at the same rate as float32 (a fifth of the rate of its
// bfloat16 projections). Here a query tile of 16 rows meets a key tile of 16 keys: float32 in
// FMAs, one key vector against a broadcast query channel; bfloat16 with AVX512-BF16 (`vdpbf16ps`:
// pairs of bfloat16 products summed into float32 lanes), for both products. The flash-attention
// recurrence (a running maximum and sum per query row) is float32; in bfloat16 the probabilities
// are rounded to bfloat16 for the second product, as torch's bfloat16 kernel does. The chunk's
// keys and values are first packed per KV head in the layout those instructions read.
// `prefill_attention_available(bfloat16)` says whether this build has the dtype's path
// (float32: AVX-512; bfloat16: AVX512-BF16).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "attention_rows.h"

bool prefill_attention_available(bool bfloat16) {
#if defined(__AVX512BF16__)
  return true;
#elif defined(__AVX512F__)
  return !bfloat16;
#else
  return false;
#endif
}

#if defined(__AVX512F__)
namespace {

constexpr int64_t TILE_KEYS = 16;   // keys a tile: one vector of scores a query row
constexpr int64_t QUERY_ROWS = 16;  // query rows a tile: one score accumulator each
// keys a softmax update covers (four key tiles): the update's fixed costs (a maximum, a sum, an
// exponential, a pass over the output row) shared by 64 keys rather than 16
constexpr int64_t GROUP_TILES = 4, GROUP_KEYS = GROUP_TILES * TILE_KEYS;

// The chunk's keys and values of one KV head, packed (keys past `length` are zero: their scores
// are masked and their values weigh 0):
//   float32:  keys [tiles, D, TILE_KEYS] (channel d of key j at [tile][d][j]), values [keys, D]
//   bfloat16, as uint32 pairs: keys [tiles, D / 2, TILE_KEYS] (channels 2p, 2p+1 of key j at
//             [tile][p][j]), values [tiles * TILE_KEYS / 2, D] (keys 2m, 2m+1 of channel d at [m][d])
template <bool BF16>
void pack_head(const void* keys, const void* values, const int64_t* table, int64_t block_size, int64_t kv_heads,
               int64_t dim, int64_t head, int64_t length, int64_t tile_lo, int64_t tile_hi, void* packed_keys,
               void* packed_values) {
  using Element = std::conditional_t<BF16, uint16_t, float>;
  const int64_t row = kv_heads * dim;
  for (int64_t tile = tile_lo; tile < tile_hi; ++tile)
    for (int64_t j = 0; j < TILE_KEYS; ++j) {
      const int64_t key = tile * TILE_KEYS + j;
      const Element* k = nullptr;
      const Element* v = nullptr;
      if (key < length) {
        const int64_t offset = (table[key / block_size] * block_size + key % block_size) * row + head * dim;
        k = static_cast<const Element*>(keys) + offset;
        v = static_cast<const Element*>(values) + offset;
      }
      if constexpr (BF16) {
        const int64_t pairs = dim / 2;
        uint32_t* k_out = static_cast<uint32_t*>(packed_keys) + tile * pairs * TILE_KEYS;
        const uint32_t* k_pairs = reinterpret_cast<const uint32_t*>(k);
        for (int64_t p = 0; p < pairs; ++p) k_out[p * TILE_KEYS + j] = k ? k_pairs[p] : 0u;
        uint16_t* v_half = static_cast<uint16_t*>(packed_values) + (tile * TILE_KEYS / 2 + j / 2) * 2 * dim + j % 2;
        for (int64_t d = 0; d < dim; ++d) v_half[2 * d] = v ? v[d] : 0;
      } else {
        float* k_out = static_cast<float*>(packed_keys) + tile * dim * TILE_KEYS;
        for (int64_t d = 0; d < dim; ++d) k_out[d * TILE_KEYS + j] = k ? k[d] : 0.f;
        float* v_out = static_cast<float*>(packed_values) + key * dim;
        for (int64_t d = 0; d < dim; ++d) v_out[d] = v ? v[d] : 0.f;
      }
    }
}

// s[r] = query row r . keys of one tile (raw, unscaled), r < QUERY_ROWS
inline void tile_scores(const float* const* query, const float* k_tile, int64_t dim, __m512* s) {
  for (int64_t d = 0; d < dim; ++d) {
    const __m512 k = _mm512_loadu_ps(k_tile + d * TILE_KEYS);
    for (int64_t r = 0; r < QUERY_ROWS; ++r) s[r] = _mm512_fmadd_ps(_mm512_set1_ps(query[r][d]), k, s[r]);
  }
}

// Output vectors a pass over the values updates at once: independent FMA chains, so the pass runs
// at the FMA's throughput rather than its latency.
constexpr int64_t SPAN = 4;

// acc[i] (output vectors b0 + i) += sum over `steps` of weight(step) * vector(step, b0 + i):
// SPAN vectors at a time where the head has them, the rest one by one
template <class Step>
inline void accumulate_span(int64_t vectors, int64_t steps, float rescale, float* o, Step step) {
  const __m512 factor = _mm512_set1_ps(rescale);
  int64_t b0 = 0;
  for (; b0 + SPAN <= vectors; b0 += SPAN) {
    __m512 acc[SPAN];
    for (int64_t i = 0; i < SPAN; ++i) acc[i] = _mm512_mul_ps(_mm512_loadu_ps(o + 16 * (b0 + i)), factor);
    for (int64_t n = 0; n < steps; ++n)
      for (int64_t i = 0; i < SPAN; ++i) acc[i] = step(n, b0 + i, acc[i]);
    for (int64_t i = 0; i < SPAN; ++i) _mm512_storeu_ps(o + 16 * (b0 + i), acc[i]);
  }
  for (; b0 < vectors; ++b0) {
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(o + 16 * b0), factor);
    for (int64_t n = 0; n < steps; ++n) acc = step(n, b0, acc);
    _mm512_storeu_ps(o + 16 * b0, acc);
  }
}

// o[0 .. dim) = o * rescale + sum over keys j < `keys` of weights[j] * value j
inline void weigh_values(const float* weights, const float* values, int64_t keys, int64_t dim, float rescale,
                         float* o) {
  accumulate_span(dim / 16, keys, rescale, o, [&](int64_t j, int64_t b, __m512 acc) {
    return _mm512_fmadd_ps(_mm512_set1_ps(weights[j]), _mm512_loadu_ps(values + j * dim + 16 * b), acc);
  });
}

#if defined(__AVX512BF16__)
// as tile_scores, for channel pairs of bfloat16 (query rows as uint32 pairs)
inline void tile_scores(const uint32_t* const* query, const uint32_t* k_tile, int64_t dim, __m512* s) {
  for (int64_t p = 0; p < dim / 2; ++p) {
    const __m512bh k = (__m512bh)_mm512_loadu_si512(k_tile + p * TILE_KEYS);
    for (int64_t r = 0; r < QUERY_ROWS; ++r)
      s[r] = _mm512_dpbf16_ps(s[r], (__m512bh)_mm512_set1_epi32(static_cast<int>(query[r][p])), k);
  }
}

// as weigh_values, with the weights rounded to bfloat16 and the values in key pairs (`keys` a
// multiple of 16)
inline void weigh_values(const float* weights, const uint32_t* values, int64_t keys, int64_t dim, float rescale,
                         float* o) {
  alignas(64) uint16_t rounded[GROUP_KEYS];  // consecutive pairs are the pairs vdpbf16ps reads
  for (int64_t j = 0; j < keys; j += 16)
    _mm256_store_si256(reinterpret_cast<__m256i*>(rounded + j), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(weights + j)));
  uint32_t pairs[GROUP_KEYS / 2];
  std::memcpy(pairs, rounded, keys * sizeof(uint16_t));
  accumulate_span(dim / 16, keys / 2, rescale, o, [&](int64_t m, int64_t b, __m512 acc) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[m])),
                            (__m512bh)_mm512_loadu_si512(values + m * dim + 16 * b));
  });
}
#endif

// One task: query rows [r0, r0 + rows) of one query head against keys 0 .. start + r0 + rows - 1.
// q: this head's first query row ([T, H, D], stride H * D); out likewise; accumulators [QUERY_ROWS, D].
template <bool BF16>
void attend_rows(const void* q, int64_t q_stride, int64_t rows, int64_t r0, int64_t start, int64_t dim, float scale,
                 const void* packed_keys, const void* packed_values, void* out, int64_t out_stride,
                 float* accumulators) {
  using Element = std::conditional_t<BF16, uint16_t, float>;
  using Packed = std::conditional_t<BF16, uint32_t, float>;  // what the packed tiles hold
  // each row's channels (bfloat16: as pairs); a short tile repeats its last row (scores unused)
  const Packed* query[QUERY_ROWS];
  for (int64_t r = 0; r < QUERY_ROWS; ++r)
    query[r] = reinterpret_cast<const Packed*>(static_cast<const Element*>(q) + (r0 + std::min(r, rows - 1)) * q_stride);
  const int64_t key_tile_size = (BF16 ? dim / 2 : dim) * TILE_KEYS, value_tile_size = BF16 ? TILE_KEYS / 2 * dim : TILE_KEYS * dim;
  float maximum[QUERY_ROWS], total[QUERY_ROWS];
  for (int64_t r = 0; r < rows; ++r) maximum[r] = -std::numeric_limits<float>::infinity(), total[r] = 0.f;
  std::fill(accumulators, accumulators + rows * dim, 0.f);
  const int64_t last_key = start + r0 + rows - 1;  // the last row's position: it sees keys up to it
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const int64_t last_tile = last_key / TILE_KEYS;
  for (int64_t tile0 = 0; tile0 <= last_tile; tile0 += GROUP_TILES) {
    const int64_t tiles = std::min(GROUP_TILES, last_tile - tile0 + 1), keys = tiles * TILE_KEYS;
    alignas(64) float scores[QUERY_ROWS][GROUP_KEYS];  // raw q . k of the group's keys
    for (int64_t g = 0; g < tiles; ++g) {
      __m512 s[QUERY_ROWS];
      for (int64_t r = 0; r < QUERY_ROWS; ++r) s[r] = _mm512_setzero_ps();
      tile_scores(query, static_cast<const Packed*>(packed_keys) + (tile0 + g) * key_tile_size, dim, s);
      for (int64_t r = 0; r < QUERY_ROWS; ++r) _mm512_store_ps(scores[r] + g * TILE_KEYS, s[r]);
    }
    const Packed* v_group = static_cast<const Packed*>(packed_values) + tile0 * value_tile_size;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t position = start + r0 + r;
      if (tile0 * TILE_KEYS > position) continue;  // wholly in this row's future (a later row may see it)
      float* weights = scores[r];
      __mmask16 seen[GROUP_TILES];
      float peak = maximum[r];
      for (int64_t g = 0; g < tiles; ++g) {
        const __m512i key_positions =
            _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>((tile0 + g) * TILE_KEYS)), lanes);
        seen[g] = _mm512_cmple_epi32_mask(key_positions, _mm512_set1_epi32(static_cast<int>(position)));
        const __m512 scaled = _mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), seen[g],
                                                 _mm512_mul_ps(_mm512_load_ps(weights + g * TILE_KEYS), _mm512_set1_ps(scale)));
        _mm512_store_ps(weights + g * TILE_KEYS, scaled);
        peak = std::max(peak, _mm512_reduce_max_ps(scaled));
      }
      exp_shifted(weights, keys, peak);
      // exp_shifted floors its exponent (a masked key would weigh about 1e-38): masked keys weigh
      // exactly 0, so not even an inf or NaN in a later value reaches this row
      __m512 sums = _mm512_setzero_ps();
      for (int64_t g = 0; g < tiles; ++g) {
        const __m512 exact = _mm512_maskz_mov_ps(seen[g], _mm512_load_ps(weights + g * TILE_KEYS));
        _mm512_store_ps(weights + g * TILE_KEYS, exact);
        sums = _mm512_add_ps(sums, exact);
      }
      const float rescale = std::exp(maximum[r] - peak);  // 0 on the first group (maximum = -inf)
      maximum[r] = peak;
      total[r] = total[r] * rescale + _mm512_reduce_add_ps(sums);
      weigh_values(weights, v_group, keys, dim, rescale, accumulators + r * dim);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 inverse = _mm512_set1_ps(1.f / total[r]);
    Element* y = static_cast<Element*>(out) + (r0 + r) * out_stride;
    for (int64_t b = 0; b < dim / 16; ++b) {
      const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(accumulators + r * dim + 16 * b), inverse);
      if constexpr (BF16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + 16 * b), (__m256i)_mm512_cvtneps_pbh(x));
      else
        _mm512_storeu_ps(y + 16 * b, x);
    }
  }
}

template <bool BF16>
torch::Tensor prefill(const torch::Tensor& query, const torch::Tensor& keys, const torch::Tensor& values,
                      const int64_t* blocks, int64_t start, float scale) {
  using Packed = std::conditional_t<BF16, uint32_t, float>;
  const int64_t tokens = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t block_size = keys.size(1), kv_heads = keys.size(2), length = start + tokens;
  const int64_t tiles = (length + TILE_KEYS - 1) / TILE_KEYS, group = heads / kv_heads;
  const int64_t head_keys = tiles * (BF16 ? dim / 2 : dim) * TILE_KEYS;
  const int64_t head_values = tiles * (BF16 ? TILE_KEYS / 2 : TILE_KEYS) * dim;
  // the whole prefix, packed again for each chunk and layer: a copy of its keys and values (the
  // attention itself reads each key tile once per query tile, so the copy is a small share)
  std::vector<Packed> packed_keys(kv_heads * head_keys), packed_values(kv_heads * head_values);
  at::parallel_for(0, kv_heads * tiles, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t task = lo; task < hi;) {  // runs of tiles of one head
      const int64_t head = task / tiles, tile_lo = task % tiles, tile_hi = std::min(tiles, tile_lo + (hi - task));
      pack_head<BF16>(keys.data_ptr(), values.data_ptr(), blocks, block_size, kv_heads, dim, head, length, tile_lo,
                      tile_hi, packed_keys.data() + head * head_keys, packed_values.data() + head * head_values);
      task += tile_hi - tile_lo;
    }
  });
  auto output = torch::empty_like(query);
  const int64_t element = query.element_size();
  const char* q_all = static_cast<const char*>(query.data_ptr());
  char* out_all = static_cast<char*>(output.data_ptr());
  // tasks: (query head, tile of QUERY_ROWS rows), one KV head's at a time (its packed keys and
  // values, 0.5 MB at 1,024 tokens of float32, stay in L2 while both threads read them), the last
  // rows (most keys) first
  const int64_t row_tiles = (tokens + QUERY_ROWS - 1) / QUERY_ROWS, tasks = heads * row_tiles;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> accumulators(QUERY_ROWS * dim);
    for (int64_t taken = next++; taken < tasks; taken = next++) {
      const int64_t kv = taken / (row_tiles * group), within = taken % (row_tiles * group);
      const int64_t row_tile = row_tiles - 1 - within / group, head = kv * group + within % group;
      const int64_t r0 = row_tile * QUERY_ROWS, rows = std::min(QUERY_ROWS, tokens - r0);
      attend_rows<BF16>(q_all + head * dim * element, heads * dim, rows, r0, start, dim, scale,
                        packed_keys.data() + kv * head_keys, packed_values.data() + kv * head_values,
                        out_all + head * dim * element, heads * dim, accumulators.data());
    }
  });
  return output;
}

}  // namespace
#endif

// query:  [T, H, D] float32 or bfloat16, the chunk's queries at positions start .. start + T - 1
// keys:   [num_blocks, block_size, KVH, D] (one layer of the pool, the chunk's own keys already
//         written), values alike, in the query's dtype
// table:  [blocks] int64, the sequence's blocks in order (covering start + T keys)
// returns [T, H, D]: causal attention, each query seeing keys 0 .. its position
torch::Tensor prefill_attention(torch::Tensor query, torch::Tensor keys, torch::Tensor values, torch::Tensor table,
                                int64_t start, double scale) {
  TORCH_CHECK(query.dim() == 3 && keys.dim() == 4 && values.sizes() == keys.sizes() && table.dim() == 1,
              "prefill_attention: bad shapes");
  TORCH_CHECK(query.device().is_cpu() && keys.device().is_cpu() && values.device().is_cpu() && table.device().is_cpu(),
              "prefill_attention: CPU tensors only");
  const bool bf16 = query.scalar_type() == torch::kBFloat16;
  TORCH_CHECK((bf16 || query.scalar_type() == torch::kFloat) && keys.scalar_type() == query.scalar_type() &&
                  values.scalar_type() == query.scalar_type() && table.scalar_type() == torch::kLong,
              "prefill_attention: float32 or bfloat16 query, keys and values of one dtype, int64 table");
  TORCH_CHECK(prefill_attention_available(bf16), "prefill_attention: this build has no ",
              bf16 ? "AVX512-BF16" : "AVX-512");
  query = query.contiguous();
  keys = keys.contiguous();
  values = values.contiguous();
  table = table.contiguous();
  const int64_t tokens = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t num_blocks = keys.size(0), block_size = keys.size(1), kv_heads = keys.size(2);
  TORCH_CHECK(keys.size(3) == dim && dim % 16 == 0, "prefill_attention: head_dim a multiple of 16");
  TORCH_CHECK(heads % kv_heads == 0, "prefill_attention: query heads a multiple of KV heads");
  TORCH_CHECK(start >= 0 && tokens >= 1, "prefill_attention: no queries");
  const int64_t length = start + tokens;
  TORCH_CHECK(table.size(0) * block_size >= length, "prefill_attention: the table is shorter than the sequence");
  const int64_t* blocks = table.data_ptr<int64_t>();
  for (int64_t i = 0; i < (length + block_size - 1) / block_size; ++i)
    TORCH_CHECK(blocks[i] >= 0 && blocks[i] < num_blocks, "prefill_attention: block id out of range");
#if defined(__AVX512BF16__)
  if (bf16) return prefill<true>(query, keys, values, blocks, start, static_cast<float>(scale));
#endif
#if defined(__AVX512F__)
  if (!bf16) return prefill<false>(query, keys, values, blocks, start, static_cast<float>(scale));
#endif
  return query;  // unreachable: prefill_attention_available refused above
}
