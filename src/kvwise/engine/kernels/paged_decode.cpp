// Decode attention over the paged pool on CPU: one query token per sequence, read block by block
// in place through the block table. SDPA needs the keys gathered and padded first; this reads
// each key and value row once, straight from the pool, and keeps GQA heads sharing a row
// together so the row is loaded once for the whole group.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "attention_rows.h"

// query:   [B, H, D] float32
// keys:    [num_blocks, block_size, KVH, D] float32 (one layer of the pool), values alike
// tables:  [B, max_blocks] int64, each sequence's blocks in order (padding past its length unread)
// lengths: [B] int64, keys 0 .. length-1 are seen (the query is the sequence's last token)
// scale:   multiplies q.k; softcap > 0: scores become tanh(s / softcap) * softcap (Gemma 2)
// window > 0: only the last `window` keys are seen (sliding-window layers)
// returns  [B, H, D]
torch::Tensor paged_decode(torch::Tensor query, torch::Tensor keys, torch::Tensor values, torch::Tensor tables,
                           torch::Tensor lengths, double scale, double softcap, int64_t window) {
  TORCH_CHECK(query.dim() == 3 && keys.dim() == 4 && values.sizes() == keys.sizes() && tables.dim() == 2 &&
                  lengths.dim() == 1,
              "paged_decode: bad shapes");
  check_tensors("paged_decode", "tables", query, keys, values, tables, lengths);
  TORCH_CHECK(query.size(1) > 0 && keys.size(1) > 0 && keys.size(2) > 0, "paged_decode: empty heads or blocks");
  query = query.contiguous();
  keys = keys.contiguous();
  values = values.contiguous();
  tables = tables.contiguous();
  lengths = lengths.contiguous();
  const int64_t batch = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t block_size = keys.size(1), kv_heads = keys.size(2), max_blocks = tables.size(1);
  TORCH_CHECK(keys.size(3) == dim && heads % kv_heads == 0 && tables.size(0) == batch && lengths.size(0) == batch,
              "paged_decode: query, pool and tables disagree");
  const int64_t group = heads / kv_heads, row = kv_heads * dim, num_blocks = keys.size(0);
  const int64_t* length_of = lengths.data_ptr<int64_t>();
  const int64_t* table_of = tables.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(length_of[b] >= 1 && length_of[b] <= max_blocks * block_size, "paged_decode: length out of range");
    for (int64_t i = 0; i < (length_of[b] + block_size - 1) / block_size; ++i)
      TORCH_CHECK(table_of[b * max_blocks + i] >= 0 && table_of[b * max_blocks + i] < num_blocks,
                  "paged_decode: block id out of range");
  }
  auto output = torch::empty_like(query);
  const float* q_all = query.data_ptr<float>();
  const float* k_pool = keys.data_ptr<float>();
  const float* v_pool = values.data_ptr<float>();
  float* out_all = output.data_ptr<float>();
  const float scale_f = static_cast<float>(scale), cap = static_cast<float>(softcap);

  // A task is one sequence, all heads, so each key and value row (every head's, contiguous) is
  // read in one sweep the prefetcher follows; with fewer sequences than threads, one kv head's
  // group of query heads per task instead.
  const int64_t heads_per_task = batch >= 2 * at::get_num_threads() ? heads : group;
  const int64_t tasks_per_sequence = heads / heads_per_task;
  // Longest sequences first, handed out one at a time: lengths differ several-fold, and a static
  // split would leave one thread idle while another still works through the long ones.
  const int64_t tasks = batch * tasks_per_sequence;
  const std::vector<int64_t> order = longest_first(tasks, tasks_per_sequence, length_of);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> scores;
    std::vector<int64_t> offsets;  // [length] row offsets of the current task's tokens
    for (int64_t taken = next++; taken < tasks; taken = next++) {
      const int64_t task = order[taken];
      const int64_t b = task / tasks_per_sequence, head0 = task % tasks_per_sequence * heads_per_task;
      const int64_t length = length_of[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, length - window) : 0, n = length - first;
      const int64_t* table = table_of + b * max_blocks;
      const float* q = q_all + (b * heads + head0) * dim;
      scores.resize(heads_per_task * n);  // [heads_per_task, n]
      // where token t's row starts in a layer's pool, one division per block rather than two per
      // row and pass (a 64-bit division costs as much as the dot products of a key)
      offsets.resize(length);
      for (int64_t b0 = first / block_size * block_size; b0 < length; b0 += block_size) {
        const int64_t start = table[b0 / block_size] * block_size * row;
        for (int64_t j = std::max(b0, first); j < std::min(b0 + block_size, length); ++j)
          offsets[j] = start + (j - b0) * row;
      }
      auto key_row = [&](int64_t t) { return k_pool + offsets[t]; };
      int64_t t = first;
      for (; t + 4 <= length; t += 4) {  // four keys at a time share the query loads and one reduction
        const float* rows[4] = {key_row(t), key_row(t + 1), key_row(t + 2), key_row(t + 3)};
        if (t + PREFETCH_ROWS + 4 <= length)
          for (int64_t j = 0; j < 4; ++j) prefetch_row(key_row(t + PREFETCH_ROWS + j), row);
        for (int64_t h = 0; h < heads_per_task; ++h) {
          const int64_t offset = (head0 + h) / group * dim;
          const float* k[4] = {rows[0] + offset, rows[1] + offset, rows[2] + offset, rows[3] + offset};
          dot4(q + h * dim, k, dim, scores.data() + h * n + (t - first));
        }
      }
      for (; t < length; ++t) {
        const float* k = key_row(t);
        for (int64_t h = 0; h < heads_per_task; ++h)
          scores[h * n + (t - first)] = dot(q + h * dim, k + (head0 + h) / group * dim, dim);
      }
      std::vector<float> totals(heads_per_task);
      softmax_numerators(scores.data(), heads_per_task, n, scale_f, cap, totals.data());
      float* out = out_all + (b * heads + head0) * dim;
      std::fill(out, out + heads_per_task * dim, 0.f);
      auto value_row = [&](int64_t t) { return v_pool + offsets[t]; };
      for (t = first; t < length; t += ROWS) {  // ROWS rows per pass: the output stays in registers
        const int64_t count = std::min<int64_t>(ROWS, length - t);
        const float* rows[ROWS];
        for (int64_t j = 0; j < count; ++j) rows[j] = value_row(t + j);
        for (int64_t j = t + PREFETCH_ROWS; j < std::min(t + PREFETCH_ROWS + ROWS, length); ++j)
          prefetch_row(value_row(j), row);
        for (int64_t h = 0; h < heads_per_task; ++h) {
          const int64_t offset = (head0 + h) / group * dim;
          const float* v[ROWS];
          for (int64_t j = 0; j < count; ++j) v[j] = rows[j] + offset;
          weighted_sum(scores.data() + h * n + (t - first), v, count, out + h * dim, dim);
        }
      }
      normalise(out, totals.data(), heads_per_task, dim);
    }
  });
  return output;
}

// Decode attention over rows listed one by one: a sequence whose KV heads hold different tokens
// (after an eviction, kvwise's head pages) reads, per KV head, its own rows in place.
// query:   [B, H, D] float32
// keys:    [N, D] float32, every row of the pool (all layers: a row is a cell), values alike
// rows:    [B, KVH, R] int64, each sequence's rows per KV head (padding past its length unread)
// lengths: [B, KVH] int64, rows 0 .. length-1 are seen
// scale, softcap: as paged_decode; returns [B, H, D]
torch::Tensor paged_decode_rows(torch::Tensor query, torch::Tensor keys, torch::Tensor values, torch::Tensor rows,
                                torch::Tensor lengths, double scale, double softcap) {
  TORCH_CHECK(query.dim() == 3 && keys.dim() == 2 && values.sizes() == keys.sizes() && rows.dim() == 3 &&
                  lengths.dim() == 2,
              "paged_decode_rows: bad shapes");
  check_tensors("paged_decode_rows", "rows", query, keys, values, rows, lengths);
  query = query.contiguous();
  keys = keys.contiguous();
  values = values.contiguous();
  rows = rows.contiguous();
  lengths = lengths.contiguous();
  const int64_t batch = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t kv_heads = rows.size(1), width = rows.size(2), num_rows = keys.size(0);
  TORCH_CHECK(keys.size(1) == dim && heads % kv_heads == 0 && rows.size(0) == batch && lengths.size(0) == batch &&
                  lengths.size(1) == kv_heads,
              "paged_decode_rows: query, pool and rows disagree");
  const int64_t group = heads / kv_heads;
  const int64_t* length_of = lengths.data_ptr<int64_t>();
  const int64_t* rows_of = rows.data_ptr<int64_t>();
  for (int64_t task = 0; task < batch * kv_heads; ++task) {
    TORCH_CHECK(length_of[task] >= 1 && length_of[task] <= width, "paged_decode_rows: length out of range");
    for (int64_t t = 0; t < length_of[task]; ++t)
      TORCH_CHECK(rows_of[task * width + t] >= 0 && rows_of[task * width + t] < num_rows,
                  "paged_decode_rows: row out of range");
  }
  auto output = torch::empty_like(query);
  const float* q_all = query.data_ptr<float>();
  const float* k_pool = keys.data_ptr<float>();
  const float* v_pool = values.data_ptr<float>();
  float* out_all = output.data_ptr<float>();
  const float scale_f = static_cast<float>(scale), cap = static_cast<float>(softcap);
  // a task is one KV head of one sequence with its group of query heads; longest first
  const int64_t tasks = batch * kv_heads;
  const std::vector<int64_t> order = longest_first(tasks, 1, length_of);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> scores;
    for (int64_t taken = next++; taken < tasks; taken = next++) {
      const int64_t task = order[taken], n = length_of[task];
      const int64_t* row = rows_of + task * width;
      const float* q = q_all + task * group * dim;  // the group's query heads are consecutive
      scores.resize(group * n);
      int64_t t = 0;
      for (; t + 4 <= n; t += 4) {
        const float* k[4] = {k_pool + row[t] * dim, k_pool + row[t + 1] * dim, k_pool + row[t + 2] * dim,
                             k_pool + row[t + 3] * dim};
        if (t + PREFETCH_ROWS + 4 <= n)
          for (int64_t j = 0; j < 4; ++j) prefetch_row(k_pool + row[t + PREFETCH_ROWS + j] * dim, dim);
        for (int64_t h = 0; h < group; ++h) {
          float four[4];
          dot4(q + h * dim, k, dim, four);
          for (int64_t j = 0; j < 4; ++j) scores[h * n + t + j] = four[j];
        }
      }
      for (; t < n; ++t)
        for (int64_t h = 0; h < group; ++h) scores[h * n + t] = dot(q + h * dim, k_pool + row[t] * dim, dim);
      for (int64_t i = 0; i < group * n; ++i) scores[i] *= scale_f;
      if (cap > 0.f)
        for (int64_t i = 0; i < group * n; ++i) scores[i] = std::tanh(scores[i] / cap) * cap;
      float* out = out_all + task * group * dim;
      std::fill(out, out + group * dim, 0.f);
      for (int64_t h = 0; h < group; ++h) {
        float* s = scores.data() + h * n;
        const float total = exp_shifted(s, n, *std::max_element(s, s + n));
        for (t = 0; t < n; t += ROWS) {
          const int64_t count = std::min<int64_t>(ROWS, n - t);
          const float* v[ROWS];
          for (int64_t j = 0; j < count; ++j) v[j] = v_pool + row[t + j] * dim;
          weighted_sum(s + t, v, count, out + h * dim, dim);
        }
        const float inverse = 1.f / total;
        for (int64_t d = 0; d < dim; ++d) out[h * dim + d] *= inverse;
      }
    }
  });
  return output;
}
