// Tier entries into the paged pool: one memcpy per (block, keys or values, layer).
//
// A restored prefix arrives as one tensor per block, [layers, 2, block_size, kv_heads, head_dim],
// and lands in the pool [2, layers, blocks, block_size, kv_heads, head_dim], where one block of one
// layer's keys (or values) is a contiguous run. torch's copy_ per block pays its dispatch and
// iterator set-up for every block, which more than doubles a 2,000-token restore against a plain
// copy of its bytes; here each run is a memcpy, the blocks split over the threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <vector>

void write_blocks(torch::Tensor pool, torch::Tensor block_ids, std::vector<torch::Tensor> entries) {
  TORCH_CHECK(pool.device().is_cpu() && pool.is_contiguous() && pool.dim() >= 3 && pool.size(0) == 2,
              "write_blocks: the pool must be a contiguous CPU tensor [2, layers, blocks, ...]");
  TORCH_CHECK(block_ids.device().is_cpu() && block_ids.scalar_type() == torch::kLong && block_ids.dim() == 1,
              "write_blocks: block_ids must be a CPU int64 vector");
  TORCH_CHECK(block_ids.size(0) == static_cast<int64_t>(entries.size()), "write_blocks: one entry per block id");
  // ids are distinct (the caller allocated them), so the threads write disjoint blocks
  const int64_t layers = pool.size(1), blocks = pool.size(2);
  const int64_t run = pool.numel() / (2 * layers * blocks) * pool.element_size();  // bytes of one block of one layer
  const int64_t* ids = block_ids.data_ptr<int64_t>();
  for (size_t i = 0; i < entries.size(); ++i) {
    const auto& entry = entries[i];
    TORCH_CHECK(ids[i] >= 0 && ids[i] < blocks, "write_blocks: block id ", ids[i], " out of range");
    bool same_block = entry.dim() == pool.dim() - 1 && entry.size(0) == layers && entry.size(1) == 2;
    for (int64_t d = 2; same_block && d < entry.dim(); ++d) same_block = entry.size(d) == pool.size(d + 1);
    TORCH_CHECK(entry.device().is_cpu() && entry.is_contiguous() && entry.scalar_type() == pool.scalar_type() &&
                    same_block,
                "write_blocks: entry ", i, " must be a contiguous CPU [layers, 2, ...] block of the pool's dtype");
  }
  auto* target = static_cast<char*>(pool.data_ptr());
  at::parallel_for(0, static_cast<int64_t>(entries.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const auto* source = static_cast<const char*>(entries[i].data_ptr());
      for (int64_t layer = 0; layer < layers; ++layer)
        for (int64_t part = 0; part < 2; ++part)  // the entry's [layer, part] run goes to the pool's [part, layer, block]
          std::memcpy(target + ((part * layers + layer) * blocks + ids[i]) * run, source + (layer * 2 + part) * run,
                      run);
    }
  });
}
