// Causal prefill attention of one chunk over its sequence's paged KV, bfloat16, on CPU.
//
// torch's CPU flash attention computes bfloat16 attention at about the rate of float32 (the
// embedded model's prefill attention ran at a fifth of the rate of its bfloat16 projections), so
// it took a quarter of a bfloat16 prefill's time. Here both products use AVX512-BF16 (`vdpbf16ps`:
// pairs of bfloat16 products summed into float32 lanes), with the flash-attention recurrence in
// float32 (a running maximum and sum per query row; the probabilities rounded to bfloat16 for the
// second product, as torch's bfloat16 kernel does). The chunk's keys and values are first packed,
// per KV head, in the pairs `vdpbf16ps` reads: keys as channel pairs of 16 keys, values as key
// pairs of 16 channels. Built only where the compiler targets AVX512-BF16;
// `prefill_bf16_available()` says whether this build has it.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "attention_rows.h"

bool prefill_bf16_available() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX512BF16__)
namespace {

constexpr int64_t TILE_KEYS = 16;  // keys a tile: one vector of scores a query row
constexpr int64_t QUERY_ROWS = 16;  // query rows a tile: one accumulator each

// The chunk's keys and values of one KV head, packed for vdpbf16ps (uint32 = two bfloat16):
//   keys:   [tiles, D / 2, TILE_KEYS]: channels 2p, 2p+1 of key j at [tile][p][j]
//   values: [tiles * TILE_KEYS / 2, D]: keys 2m, 2m+1 of channel d at [m][d]
// Keys past `length` are zero (their scores are masked; their values weigh 0).
void pack_head(const uint16_t* keys, const uint16_t* values, const int64_t* table, int64_t block_size,
               int64_t kv_heads, int64_t dim, int64_t head, int64_t length, int64_t tile_lo, int64_t tile_hi,
               uint32_t* packed_keys, uint32_t* packed_values) {
  const int64_t row = kv_heads * dim, pairs = dim / 2;
  for (int64_t tile = tile_lo; tile < tile_hi; ++tile) {
    uint32_t* k_out = packed_keys + tile * pairs * TILE_KEYS;
    uint32_t* v_out = packed_values + tile * TILE_KEYS / 2 * dim;
    for (int64_t j = 0; j < TILE_KEYS; ++j) {
      const int64_t key = tile * TILE_KEYS + j;
      const uint16_t* k = nullptr;
      const uint16_t* v = nullptr;
      if (key < length) {
        const int64_t offset = (table[key / block_size] * block_size + key % block_size) * row + head * dim;
        k = keys + offset;
        v = values + offset;
      }
      const uint32_t* k_pairs = reinterpret_cast<const uint32_t*>(k);
      for (int64_t p = 0; p < pairs; ++p) k_out[p * TILE_KEYS + j] = k ? k_pairs[p] : 0u;
      uint16_t* v_half = reinterpret_cast<uint16_t*>(v_out + j / 2 * dim) + j % 2;
      for (int64_t d = 0; d < dim; ++d) v_half[2 * d] = v ? v[d] : 0;
    }
  }
}

// One task: query rows [r0, r0 + rows) of one query head against keys 0 .. start + r0 + rows - 1.
// query: [T, H, D] bfloat16 rows of this head at `q` (stride H * D); out likewise.
void attend_rows(const uint16_t* q, int64_t q_stride, int64_t rows, int64_t r0, int64_t start, int64_t dim,
                 float scale, const uint32_t* packed_keys, const uint32_t* packed_values, uint16_t* out,
                 int64_t out_stride, float* accumulators /* [QUERY_ROWS, D] */) {
  const int64_t pairs = dim / 2, vectors = dim / 16;
  // each row's channel pairs; a short tile repeats its last row (its scores are not used)
  const uint32_t* query[QUERY_ROWS];
  for (int64_t r = 0; r < QUERY_ROWS; ++r)
    query[r] = reinterpret_cast<const uint32_t*>(q + (r0 + std::min(r, rows - 1)) * q_stride);
  float maximum[QUERY_ROWS], total[QUERY_ROWS];
  for (int64_t r = 0; r < rows; ++r) maximum[r] = -std::numeric_limits<float>::infinity(), total[r] = 0.f;
  std::fill(accumulators, accumulators + rows * dim, 0.f);
  const int64_t last_key = start + r0 + rows - 1;  // the last row's position: it sees keys up to it
  for (int64_t tile = 0; tile * TILE_KEYS <= last_key; ++tile) {
    // scores [rows, TILE_KEYS]
    __m512 s[QUERY_ROWS];
    for (int64_t r = 0; r < QUERY_ROWS; ++r) s[r] = _mm512_setzero_ps();
    const uint32_t* k_tile = packed_keys + tile * pairs * TILE_KEYS;
    for (int64_t p = 0; p < pairs; ++p) {
      const __m512bh k = (__m512bh)_mm512_loadu_si512(k_tile + p * TILE_KEYS);
      for (int64_t r = 0; r < QUERY_ROWS; ++r)
        s[r] = _mm512_dpbf16_ps(s[r], (__m512bh)_mm512_set1_epi32(static_cast<int>(query[r][p])), k);
    }
    const __m512i key_positions = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(tile * TILE_KEYS)),
                                                   _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    const uint32_t* v_tile = packed_values + tile * TILE_KEYS / 2 * dim;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t position = start + r0 + r;
      if (tile * TILE_KEYS > position) continue;  // wholly in this row's future (a later row may see it)
      const __mmask16 seen = _mm512_cmple_epi32_mask(key_positions, _mm512_set1_epi32(static_cast<int>(position)));
      const __m512 scores = _mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), seen,
                                               _mm512_mul_ps(s[r], _mm512_set1_ps(scale)));
      const float peak = std::max(maximum[r], _mm512_reduce_max_ps(scores));
      alignas(64) float weights[TILE_KEYS];
      _mm512_store_ps(weights, scores);
      const float sum = exp_shifted(weights, TILE_KEYS, peak);  // masked keys: exp(-inf) = 0
      const float rescale = std::exp(maximum[r] - peak);    // 0 on the first tile (maximum = -inf)
      maximum[r] = peak;
      total[r] = total[r] * rescale + sum;
      alignas(32) uint16_t probabilities[TILE_KEYS];  // bfloat16; consecutive pairs are the pairs vdpbf16ps reads
      _mm256_store_si256(reinterpret_cast<__m256i*>(probabilities),
                         (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(weights)));
      float* o = accumulators + r * dim;
      const __m512 factor = _mm512_set1_ps(rescale);
      for (int64_t b = 0; b < vectors; ++b) {
        __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(o + 16 * b), factor);
        for (int64_t m = 0; m < TILE_KEYS / 2; ++m) {
          uint32_t pair;
          std::memcpy(&pair, probabilities + 2 * m, sizeof pair);
          acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(static_cast<int>(pair)),
                                 (__m512bh)_mm512_loadu_si512(v_tile + m * dim + 16 * b));
        }
        _mm512_storeu_ps(o + 16 * b, acc);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 inverse = _mm512_set1_ps(1.f / total[r]);
    uint16_t* y = out + (r0 + r) * out_stride;
    for (int64_t b = 0; b < vectors; ++b)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + 16 * b),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(accumulators + r * dim + 16 * b), inverse)));
  }
}

}  // namespace
#endif

// query:  [T, H, D] bfloat16, the chunk's queries at positions start .. start + T - 1
// keys:   [num_blocks, block_size, KVH, D] bfloat16 (one layer of the pool, the chunk's own keys
//         already written), values alike
// table:  [blocks] int64, the sequence's blocks in order (at least (start + T) / block_size)
// returns [T, H, D] bfloat16: causal attention, each query seeing keys 0 .. its position
torch::Tensor prefill_bf16(torch::Tensor query, torch::Tensor keys, torch::Tensor values, torch::Tensor table,
                           int64_t start, double scale) {
#if defined(__AVX512BF16__)
  TORCH_CHECK(query.dim() == 3 && keys.dim() == 4 && values.sizes() == keys.sizes() && table.dim() == 1,
              "prefill_bf16: bad shapes");
  TORCH_CHECK(query.device().is_cpu() && keys.device().is_cpu() && values.device().is_cpu() && table.device().is_cpu(),
              "prefill_bf16: CPU tensors only");
  TORCH_CHECK(query.scalar_type() == torch::kBFloat16 && keys.scalar_type() == torch::kBFloat16 &&
                  values.scalar_type() == torch::kBFloat16 && table.scalar_type() == torch::kLong,
              "prefill_bf16: bfloat16 query, keys and values, int64 table");
  query = query.contiguous();
  keys = keys.contiguous();
  values = values.contiguous();
  table = table.contiguous();
  const int64_t tokens = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t num_blocks = keys.size(0), block_size = keys.size(1), kv_heads = keys.size(2);
  TORCH_CHECK(keys.size(3) == dim && dim % 16 == 0, "prefill_bf16: head_dim a multiple of 16");
  TORCH_CHECK(heads % kv_heads == 0, "prefill_bf16: query heads a multiple of KV heads");
  TORCH_CHECK(start >= 0 && tokens >= 1, "prefill_bf16: no queries");
  const int64_t length = start + tokens;
  TORCH_CHECK(table.size(0) * block_size >= length, "prefill_bf16: the table is shorter than the sequence");
  const int64_t* blocks = table.data_ptr<int64_t>();
  for (int64_t i = 0; i < (length + block_size - 1) / block_size; ++i)
    TORCH_CHECK(blocks[i] >= 0 && blocks[i] < num_blocks, "prefill_bf16: block id out of range");

  const int64_t tiles = (length + TILE_KEYS - 1) / TILE_KEYS, group = heads / kv_heads;
  const int64_t head_keys = tiles * (dim / 2) * TILE_KEYS, head_values = tiles * TILE_KEYS / 2 * dim;
  std::vector<uint32_t> packed_keys(kv_heads * head_keys), packed_values(kv_heads * head_values);
  const auto* k_pool = reinterpret_cast<const uint16_t*>(keys.data_ptr());
  const auto* v_pool = reinterpret_cast<const uint16_t*>(values.data_ptr());
  at::parallel_for(0, kv_heads * tiles, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t task = lo; task < hi;) {  // runs of tiles of one head
      const int64_t head = task / tiles, tile_lo = task % tiles, tile_hi = std::min(tiles, tile_lo + (hi - task));
      pack_head(k_pool, v_pool, blocks, block_size, kv_heads, dim, head, length, tile_lo, tile_hi,
                packed_keys.data() + head * head_keys, packed_values.data() + head * head_values);
      task += tile_hi - tile_lo;
    }
  });

  auto output = torch::empty_like(query);
  const auto* q_all = reinterpret_cast<const uint16_t*>(query.data_ptr());
  auto* out_all = reinterpret_cast<uint16_t*>(output.data_ptr());
  // tasks: (query head, tile of QUERY_ROWS query rows), the last rows (most keys) handed out first
  const int64_t row_tiles = (tokens + QUERY_ROWS - 1) / QUERY_ROWS, tasks = heads * row_tiles;
  std::atomic<int64_t> next{0};
  const float scale_f = static_cast<float>(scale);
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> accumulators(QUERY_ROWS * dim);
    for (int64_t taken = next++; taken < tasks; taken = next++) {
      const int64_t row_tile = row_tiles - 1 - taken / heads, head = taken % heads, kv = head / group;
      const int64_t r0 = row_tile * QUERY_ROWS, rows = std::min(QUERY_ROWS, tokens - r0);
      attend_rows(q_all + head * dim, heads * dim, rows, r0, start, dim, scale_f, packed_keys.data() + kv * head_keys,
                  packed_values.data() + kv * head_values, out_all + head * dim, heads * dim, accumulators.data());
    }
  });
  return output;
#else
  TORCH_CHECK(false, "prefill_bf16: this build has no AVX512-BF16");
  return query;
#endif
}
