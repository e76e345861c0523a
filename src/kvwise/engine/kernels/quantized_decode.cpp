// Decode attention over block tables that mix full-precision blocks of the pool with quantized
// blocks (int8, fp8, KIVI 4/2-bit), read where they lie, and over a bfloat16 pool. Int8, fp8 and
// KIVI codes and bfloat16 rows are widened to float32 in registers where they are used
// (quantized_rows.h); other layouts (a head or channel group not a whole number of vectors) are
// dequantized into a small per-thread buffer (one block of the heads a task reads: a few KB, so
// it stays in L1) just before use. Either way the KV is read from memory as it is stored, never
// as a full-precision copy, and plain, quantized and mixed sequences share one call.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "attention_rows.h"
#include "quantized_rows.h"

namespace {

// How a role (keys or values) of the quantized pool is stored; the numbers are the Python side's
// (engine/quantized_kernel.py).
// NONE: no quantized pool (every table entry is a pool block).
enum Kind : int64_t { NONE = -1, SCALED_INT8 = 0, SCALED_FP8 = 1, PER_CHANNEL = 2, PER_TOKEN = 3 };

// float32 value of each float8 e4m3fn bit pattern (NaN patterns, never written, read as 0, as
// the Python decoder does)
struct Fp8Table {
  float value[256];
  Fp8Table() {
    for (int bits = 0; bits < 256; ++bits) {
      const int sign = bits >> 7, exponent = (bits >> 3) & 15, mantissa = bits & 7;
      float magnitude;
      if (exponent == 15 && mantissa == 7)
        magnitude = 0.f;
      else if (exponent == 0)
        magnitude = std::ldexp(mantissa / 8.f, -6);
      else
        magnitude = std::ldexp(1.f + mantissa / 8.f, exponent - 7);
      value[bits] = sign ? -magnitude : magnitude;
    }
  }
};
const Fp8Table fp8_table;

inline float half_to_float(const at::Half& h) { return static_cast<float>(h); }

// The widest head the stage buffers below hold (checked when a role is made).
constexpr int64_t MAX_DIM = 512;

// Calls visit(kv_head, first, count) for each run of a task's query heads [0, heads) that read
// one KV head (query head head0 + h reads KV head (head0 + h) / group), at most four at a time:
// the register paths (quantized_rows.h) hold four heads' accumulators.
template <class Visit>
inline void for_each_head_run(int64_t head0, int64_t heads, int64_t group, Visit visit) {
  for (int64_t h = 0; h < heads;) {
    const int64_t kv = (head0 + h) / group, end = std::min({heads, (kv + 1) * group - head0, h + 4});
    visit(kv, h, end - h);
    h = end;
  }
}

// n float16 values as float32 (F16C/AVX-512 converts 16 at a time).
inline void halves_to_floats(const at::Half* __restrict h, float* __restrict out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + i))));
#endif
  for (; i < n; ++i) out[i] = half_to_float(h[i]);
}

// Packed 2- or 4-bit codes (the first code of each byte in its low bits, kv/packing.py) as one
// byte each: n codes.
template <int BITS>
inline void unpack_codes(const uint8_t* __restrict packed, uint8_t* __restrict codes, int64_t n) {
  int64_t d = 0;
#if defined(__SSE2__)
  const __m128i mask = _mm_set1_epi8((1 << BITS) - 1);
  if (BITS == 4) {
    for (; d + 16 <= n; d += 16) {  // 8 bytes: low nibbles and high nibbles, interleaved back
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(packed + d / 2));
      const __m128i low = _mm_and_si128(bytes, mask), high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + d), _mm_unpacklo_epi8(low, high));
    }
  } else if (BITS == 2) {
    for (; d + 16 <= n; d += 16) {  // 4 bytes: the four 2-bit fields, interleaved back
      int32_t four;
      std::memcpy(&four, packed + d / 4, sizeof four);
      const __m128i bytes = _mm_cvtsi32_si128(four);
      const __m128i f0 = _mm_and_si128(bytes, mask), f1 = _mm_and_si128(_mm_srli_epi16(bytes, 2), mask);
      const __m128i f2 = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask),
                    f3 = _mm_and_si128(_mm_srli_epi16(bytes, 6), mask);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + d),
                       _mm_unpacklo_epi16(_mm_unpacklo_epi8(f0, f1), _mm_unpacklo_epi8(f2, f3)));
    }
  }
#endif
  constexpr int per_byte = 8 / BITS;
  for (; d < n; ++d) codes[d] = (packed[d / per_byte] >> (d % per_byte * BITS)) & ((1 << BITS) - 1);
}

inline void unpack(int64_t bits, const uint8_t* packed, uint8_t* codes, int64_t n) {
  if (bits == 4)
    unpack_codes<4>(packed, codes, n);
  else if (bits == 2)
    unpack_codes<2>(packed, codes, n);
  else
    std::memcpy(codes, packed, n);
}

// x[d] = codes[d] * scale[d] + minimum[d] (per channel)
inline void affine(const uint8_t* __restrict codes, const float* __restrict scale, const float* __restrict minimum,
                   float* __restrict x, int64_t n) {
  int64_t d = 0;
#if defined(__AVX512F__)
  for (; d + 16 <= n; d += 16) {
    const __m512 c = _mm512_cvtepi32_ps(
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + d))));
    _mm512_storeu_ps(x + d, _mm512_fmadd_ps(c, _mm512_loadu_ps(scale + d), _mm512_loadu_ps(minimum + d)));
  }
#endif
  for (; d < n; ++d) x[d] = codes[d] * scale[d] + minimum[d];
}

// x[d] = codes[d] * scale + minimum (one group)
inline void affine_group(const uint8_t* __restrict codes, float scale, float minimum, float* __restrict x,
                         int64_t n) {
  int64_t d = 0;
#if defined(__AVX512F__)
  const __m512 s = _mm512_set1_ps(scale), m = _mm512_set1_ps(minimum);
  for (; d + 16 <= n; d += 16) {
    const __m512 c = _mm512_cvtepi32_ps(
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + d))));
    _mm512_storeu_ps(x + d, _mm512_fmadd_ps(c, s, m));
  }
#endif
  for (; d < n; ++d) x[d] = codes[d] * scale + minimum;
}

// x[d] = int8 codes[d] * scale
inline void scaled_int8(const int8_t* __restrict codes, float scale, float* __restrict x, int64_t n) {
  int64_t d = 0;
#if defined(__AVX512F__)
  const __m512 s = _mm512_set1_ps(scale);
  for (; d + 16 <= n; d += 16) {
    const __m512 c = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + d))));
    _mm512_storeu_ps(x + d, _mm512_mul_ps(c, s));
  }
#endif
  for (; d < n; ++d) x[d] = codes[d] * scale;
}

// One role's quantized pool (codec.py's Encoded, as kv/blocks.py stores it per block):
//   codes:   [num_blocks, KVH, block_size, D * bits / 8] uint8
//   SCALED:  scale [num_blocks, KVH, block_size] float16
//   PER_CHANNEL (KIVI keys, one group per block and head): scale, minimum [num_blocks, KVH, D] float16
//   PER_TOKEN (KIVI values, channel groups of `width`): scale, minimum [num_blocks, KVH, block_size, D / width] float16
struct QuantizedRole {
  int64_t kind, bits, width;
  const uint8_t* codes;
  const at::Half* scale;
  const at::Half* minimum;
  int64_t num_blocks, kv_heads, block_size, dim, packed;

  // Rows [first_token, last_token) of `block` for kv heads [head_lo, head_hi), into `out` laid out
  // as a pool block: [block_size, KVH, D] float32 (other heads' rows are left as they are).
  void stage(int64_t block, int64_t head_lo, int64_t head_hi, int64_t first_token, int64_t last_token,
             float* out) const {
    const int64_t row = kv_heads * dim;
    float channel_scale[MAX_DIM], channel_minimum[MAX_DIM];
    uint8_t unpacked[MAX_DIM];
    for (int64_t h = head_lo; h < head_hi; ++h) {
      const int64_t block_head = block * kv_heads + h;
      const uint8_t* head_codes = codes + block_head * block_size * packed;
      if (kind == PER_CHANNEL) {  // one range per channel for the whole block: converted once
        halves_to_floats(scale + block_head * dim, channel_scale, dim);
        halves_to_floats(minimum + block_head * dim, channel_minimum, dim);
      }
      for (int64_t t = first_token; t < last_token; ++t) {
        const uint8_t* c = head_codes + t * packed;
        float* x = out + t * row + h * dim;
        const int64_t token = block_head * block_size + t;
        if (kind == SCALED_INT8) {
          scaled_int8(reinterpret_cast<const int8_t*>(c), half_to_float(scale[token]), x, dim);
        } else if (kind == SCALED_FP8) {
          const float s = half_to_float(scale[token]);
          for (int64_t d = 0; d < dim; ++d) x[d] = fp8_table.value[c[d]] * s;
        } else if (kind == PER_CHANNEL) {
          unpack(bits, c, unpacked, dim);
          affine(unpacked, channel_scale, channel_minimum, x, dim);
        } else {  // PER_TOKEN
          unpack(bits, c, unpacked, dim);
          const int64_t groups = dim / width;
          const at::Half* s = scale + token * groups;
          const at::Half* m = minimum + token * groups;
          for (int64_t g = 0; g < groups; ++g)
            affine_group(unpacked + g * width, half_to_float(s[g]), half_to_float(m[g]), x + g * width, width);
        }
      }
    }
  }

#if defined(__AVX512F__)
  // Whether this role's blocks are read in registers (quantized_rows.h) rather than staged: int8
  // fp8 and KIVI codes (keys per channel, values per token) where a head is whole 16-byte loads of
  // codes and channel groups are whole vectors. Other layouts are staged.
  bool in_registers(bool as_keys) const {
    const int64_t span = bits == 8 ? 16 : 16 * 8 / bits;  // channels a load widens
    if (dim % span != 0) return false;
    if (kind == SCALED_INT8 || kind == SCALED_FP8) return true;
    return as_keys ? kind == PER_CHANNEL : kind == PER_TOKEN && width % 16 == 0;
  }

  Codes code_layout() const {
    if (kind == SCALED_INT8) return Codes::SIGNED8;
    if (kind == SCALED_FP8) return Codes::FP8;
    return bits == 8 ? Codes::UNSIGNED8 : bits == 4 ? Codes::UNSIGNED4 : Codes::UNSIGNED2;
  }

  // s[h * n + t - lo] = q_h . key t, for a task's query heads h < heads (query head head0 + h, its
  // query at q + h * dim) and tokens [lo, hi) of `block`. int8 and fp8: the raw dot times the token's
  // scale. KIVI keys: the query prescaled by the block's channel scales, plus q . minimum.
  // scratch: 4 * dim + block_size floats.
  void score(int64_t block, const float* q, int64_t head0, int64_t heads, int64_t group, int64_t lo, int64_t hi,
             float* s, int64_t n, float* scratch) const {
    for_each_head_run(head0, heads, group, [&](int64_t kv, int64_t first, int64_t count) {
      const int64_t block_head = block * kv_heads + kv;
      const float* query[4];
      float* raw[4];
      float offset[4] = {0.f, 0.f, 0.f, 0.f};
      for (int64_t j = 0; j < count; ++j) query[j] = q + (first + j) * dim, raw[j] = s + (first + j) * n;
      if (kind == PER_CHANNEL) {  // q'[d] = q[d] * scale[d]; offset = q . minimum
        float channel_scale[MAX_DIM], channel_minimum[MAX_DIM];
        halves_to_floats(scale + block_head * dim, channel_scale, dim);
        halves_to_floats(minimum + block_head * dim, channel_minimum, dim);
        for (int64_t j = 0; j < count; ++j) {
          float* prescaled = scratch + j * dim;
          for (int64_t d = 0; d < dim; ++d) prescaled[d] = query[j][d] * channel_scale[d];
          offset[j] = dot(query[j], channel_minimum, dim);
          query[j] = prescaled;
        }
      }
      dispatch_dots(code_layout(), count, query, codes_of(block_head), packed, lo, hi, dim, raw);
      if (kind == SCALED_INT8 || kind == SCALED_FP8) {
        float* token_scale = scratch + 4 * dim;
        halves_to_floats(scale + block_head * block_size + lo, token_scale, hi - lo);
        for (int64_t j = 0; j < count; ++j)
          for (int64_t t = 0; t < hi - lo; ++t) raw[j][t] *= token_scale[t];
      } else {
        for (int64_t j = 0; j < count; ++j)
          for (int64_t t = 0; t < hi - lo; ++t) raw[j][t] += offset[j];
      }
    });
  }

  // out[h * dim + d] += sum over tokens t in [lo, hi) of w[h * n + t - lo] * value t of `block`,
  // for a task's query heads h < heads. Each token's scale (per channel group) folds into its
  // weight; KIVI's minimums add once per channel group. scratch: (4 + 2) * block_size * dim / 16
  // floats.
  void accumulate(int64_t block, const float* w, int64_t head0, int64_t heads, int64_t group, int64_t lo,
                  int64_t hi, int64_t n, float* out, float* scratch) const {
    const int64_t group_width = kind == PER_TOKEN ? width : dim, groups = dim / group_width;
    const int64_t rows = hi - lo, per_head = rows * groups;
    float* weights = scratch;  // [4, rows, groups]
    float* token_scale = scratch + 4 * per_head;
    float* token_minimum = token_scale + per_head;  // [rows, groups] each
    for_each_head_run(head0, heads, group, [&](int64_t kv, int64_t first, int64_t count) {
      const int64_t token0 = (block * kv_heads + kv) * block_size + lo;
      halves_to_floats(scale + token0 * groups, token_scale, per_head);
      if (kind == PER_TOKEN) halves_to_floats(minimum + token0 * groups, token_minimum, per_head);
      const float* weight[4];
      float* sums[4];
      for (int64_t j = 0; j < count; ++j) {
        const float* p = w + (first + j) * n;
        float* scaled = weights + j * per_head;
        for (int64_t t = 0; t < rows; ++t)
          for (int64_t g = 0; g < groups; ++g) scaled[t * groups + g] = p[t] * token_scale[t * groups + g];
        weight[j] = scaled;
        sums[j] = out + (first + j) * dim;
        if (kind == PER_TOKEN)
          for (int64_t g = 0; g < groups; ++g) {
            float shift = 0.f;
            for (int64_t t = 0; t < rows; ++t) shift += p[t] * token_minimum[t * groups + g];
            for (int64_t d = g * group_width; d < (g + 1) * group_width; ++d) sums[j][d] += shift;
          }
      }
      dispatch_sums(code_layout(), count, weight, groups, group_width, codes_of(block * kv_heads + kv), packed, lo, hi,
                    dim, sums);
    });
  }
#endif

  const uint8_t* codes_of(int64_t block_head) const { return codes + block_head * block_size * packed; }
};

QuantizedRole role_of(int64_t kind, int64_t bits, int64_t width, const torch::Tensor& codes,
                      const torch::Tensor& scale, const torch::Tensor& minimum, int64_t kv_heads, int64_t block_size,
                      int64_t dim, const char* name) {
  TORCH_CHECK(kind >= NONE && kind <= PER_TOKEN, "quantized_decode: unknown ", name, " kind ", kind);
  if (kind == NONE) return QuantizedRole{NONE, 8, 0, nullptr, nullptr, nullptr, 0, kv_heads, block_size, dim, 0};
  TORCH_CHECK(bits == 2 || bits == 4 || bits == 8, "quantized_decode: ", name, " codes of 2, 4 or 8 bits");
  TORCH_CHECK(dim <= MAX_DIM, "quantized_decode: head_dim above ", MAX_DIM);
  TORCH_CHECK((kind != SCALED_INT8 && kind != SCALED_FP8) || bits == 8, "quantized_decode: int8/fp8 are 8-bit");
  TORCH_CHECK(codes.scalar_type() == torch::kByte && codes.dim() == 4 && codes.is_contiguous() &&
                  codes.size(1) == kv_heads && codes.size(2) == block_size && codes.size(3) * 8 == dim * bits,
              "quantized_decode: ", name, " codes must be [blocks, kv_heads, block_size, D * bits / 8] uint8");
  TORCH_CHECK(scale.scalar_type() == torch::kHalf && scale.is_contiguous(), "quantized_decode: ", name,
              " scales must be contiguous float16");
  const int64_t blocks = codes.size(0);
  int64_t expected = blocks * kv_heads * block_size;  // SCALED
  if (kind == PER_CHANNEL) expected = blocks * kv_heads * dim;
  if (kind == PER_TOKEN) {
    TORCH_CHECK(width >= 1 && dim % width == 0, "quantized_decode: ", name, " channel groups must divide D");
    expected = blocks * kv_heads * block_size * (dim / width);
  }
  TORCH_CHECK(scale.numel() == expected, "quantized_decode: ", name, " scales have the wrong size");
  const bool has_minimum = kind == PER_CHANNEL || kind == PER_TOKEN;
  if (has_minimum)
    TORCH_CHECK(minimum.scalar_type() == torch::kHalf && minimum.is_contiguous() && minimum.numel() == expected,
                "quantized_decode: ", name, " minimums must match its scales");
  return QuantizedRole{kind,
                       bits,
                       width,
                       codes.data_ptr<uint8_t>(),
                       scale.data_ptr<at::Half>(),
                       has_minimum ? minimum.data_ptr<at::Half>() : nullptr,
                       blocks,
                       kv_heads,
                       block_size,
                       dim,
                       codes.size(3)};
}

// bfloat16 rows [lo, hi) of a pool block, heads [head_lo, head_hi), as float32 into `out`
// ([block_size, KVH, D], the block's layout): a bfloat16 is the high half of a float32.
inline void widen(const uint16_t* block, int64_t head_lo, int64_t head_hi, int64_t lo, int64_t hi, int64_t kv_heads,
                  int64_t dim, float* out) {
  const int64_t row = kv_heads * dim;
  for (int64_t t = lo; t < hi; ++t)
    for (int64_t h = head_lo; h < head_hi; ++h) {
      const uint16_t* x = block + t * row + h * dim;
      uint32_t* y = reinterpret_cast<uint32_t*>(out + t * row + h * dim);
      for (int64_t d = 0; d < dim; ++d) y[d] = static_cast<uint32_t>(x[d]) << 16;
    }
}

inline void prefetch_bytes(const char* start, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(start + i, 0, 3);
}

}  // namespace

// query:   [B, H, D] float32
// keys:    [num_blocks, block_size, KVH, D] float32 or bfloat16 (one layer of the pool), values alike
// tables:  [B, max_blocks] int64: id >= 0 a pool block, id < 0 the quantized block -id - 1
// lengths: [B] int64, keys 0 .. length-1 are seen (the query is the sequence's last token)
// scale, softcap, window: as paged_decode
// key_* / value_*: each role's quantized pool (QuantizedRole above; `minimum` unused by int8/fp8;
//          kind NONE: no quantized pool, the tensors unused)
// returns  [B, H, D]
torch::Tensor quantized_decode(torch::Tensor query, torch::Tensor keys, torch::Tensor values, torch::Tensor tables,
                               torch::Tensor lengths, double scale, double softcap, int64_t window,
                               int64_t key_kind, int64_t key_bits, int64_t key_width, torch::Tensor key_codes,
                               torch::Tensor key_scale, torch::Tensor key_minimum, int64_t value_kind,
                               int64_t value_bits, int64_t value_width, torch::Tensor value_codes,
                               torch::Tensor value_scale, torch::Tensor value_minimum) {
  TORCH_CHECK(query.dim() == 3 && keys.dim() == 4 && values.sizes() == keys.sizes() && tables.dim() == 2 &&
                  lengths.dim() == 1,
              "quantized_decode: bad shapes");
  TORCH_CHECK(query.device().is_cpu() && keys.device().is_cpu() && values.device().is_cpu() &&
                  tables.device().is_cpu() && lengths.device().is_cpu(),
              "quantized_decode: CPU tensors only");
  TORCH_CHECK(query.scalar_type() == torch::kFloat, "quantized_decode: a float32 query");
  TORCH_CHECK((keys.scalar_type() == torch::kFloat || keys.scalar_type() == torch::kBFloat16) &&
                  values.scalar_type() == keys.scalar_type(),
              "quantized_decode: a float32 or bfloat16 pool");
  TORCH_CHECK(tables.scalar_type() == torch::kLong && lengths.scalar_type() == torch::kLong,
              "quantized_decode: int64 tables and lengths");
  query = query.contiguous();
  keys = keys.contiguous();
  values = values.contiguous();
  tables = tables.contiguous();
  lengths = lengths.contiguous();
  const int64_t batch = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t block_size = keys.size(1), kv_heads = keys.size(2), max_blocks = tables.size(1);
  TORCH_CHECK(keys.size(3) == dim && heads % kv_heads == 0 && tables.size(0) == batch && lengths.size(0) == batch,
              "quantized_decode: query, pool and tables disagree");
  const QuantizedRole key_role = role_of(key_kind, key_bits, key_width, key_codes, key_scale, key_minimum, kv_heads,
                                         block_size, dim, "key");
  const QuantizedRole value_role = role_of(value_kind, value_bits, value_width, value_codes, value_scale,
                                           value_minimum, kv_heads, block_size, dim, "value");
  TORCH_CHECK(key_role.num_blocks == value_role.num_blocks, "quantized_decode: key and value pools disagree");
  const int64_t group = heads / kv_heads, row = kv_heads * dim, num_blocks = keys.size(0);
  const int64_t* length_of = lengths.data_ptr<int64_t>();
  const int64_t* table_of = tables.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(length_of[b] >= 1 && length_of[b] <= max_blocks * block_size, "quantized_decode: length out of range");
    for (int64_t i = 0; i < (length_of[b] + block_size - 1) / block_size; ++i) {
      const int64_t id = table_of[b * max_blocks + i];
      TORCH_CHECK(id < num_blocks && -id - 1 < key_role.num_blocks, "quantized_decode: block id out of range");
    }
  }
  auto output = torch::empty_like(query);
  const float* q_all = query.data_ptr<float>();
  const bool wide = keys.scalar_type() == torch::kBFloat16;  // widened block by block
  const char* k_pool = static_cast<const char*>(keys.data_ptr());
  const char* v_pool = static_cast<const char*>(values.data_ptr());
  const int64_t element = keys.element_size();
  float* out_all = output.data_ptr<float>();
  const float scale_f = static_cast<float>(scale), cap = static_cast<float>(softcap);

  // tasks as in paged_decode: a sequence with all its heads, or one KV head's query heads when
  // there are fewer sequences than threads; longest first, handed out one at a time
  const int64_t heads_per_task = batch >= 2 * at::get_num_threads() ? heads : group;
  const int64_t tasks_per_sequence = heads / heads_per_task;
  const int64_t tasks = batch * tasks_per_sequence;
  const std::vector<int64_t> order = longest_first(tasks, tasks_per_sequence, length_of);
  std::atomic<int64_t> next{0};
#if defined(__AVX512F__)
  const bool keys_in_registers = key_role.in_registers(true), values_in_registers = value_role.in_registers(false);
  const bool pool_in_registers = wide && dim % 16 == 0;
#else
  const bool keys_in_registers = false, values_in_registers = false, pool_in_registers = false;
#endif
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    // scratch: score's 4 * dim + block_size floats, accumulate's 6 * block_size * dim / 16
    std::vector<float> scores, staged(block_size * row), scratch(4 * dim + block_size + 6 * block_size * (dim / 16 + 1));
    for (int64_t taken = next++; taken < tasks; taken = next++) {
      const int64_t task = order[taken];
      const int64_t b = task / tasks_per_sequence, head0 = task % tasks_per_sequence * heads_per_task;
      const int64_t head_lo = head0 / group, head_hi = (head0 + heads_per_task - 1) / group + 1;
      const int64_t length = length_of[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, length - window) : 0, n = length - first;
      const int64_t* table = table_of + b * max_blocks;
      const float* q = q_all + (b * heads + head0) * dim;
      scores.resize(heads_per_task * n);  // [heads_per_task, n]
      // The next block of the table, requested ahead of its use: the pool block's rows, or the
      // task's heads' codes of a quantized one.
      auto prefetch_next = [&](const char* pool, const QuantizedRole& role, int64_t i) {
        if ((i + 1) * block_size >= length) return;
        const int64_t id = table[i + 1];
        if (id >= 0)
          prefetch_bytes(pool + id * block_size * row * element, block_size * row * element);
        else if (role.kind != NONE)
          prefetch_bytes(reinterpret_cast<const char*>(role.codes_of((-id - 1) * kv_heads + head_lo)),
                         (head_hi - head_lo) * block_size * role.packed);
      };
      // The rows of block `i` from token `lo` to `hi` (within the block) as float32 rows laid out
      // as a pool block: the pool's block, or the block staged for those tokens and heads.
      auto block_rows = [&](const char* pool, const QuantizedRole& role, int64_t i, int64_t lo, int64_t hi) {
        const int64_t id = table[i];
        if (id < 0) {
          role.stage(-id - 1, head_lo, head_hi, lo, hi, staged.data());
          return static_cast<const float*>(staged.data());
        }
        const char* block = pool + id * block_size * row * element;
        if (!wide) return reinterpret_cast<const float*>(block);
        widen(reinterpret_cast<const uint16_t*>(block), head_lo, head_hi, lo, hi, kv_heads, dim, staged.data());
        return static_cast<const float*>(staged.data());
      };
      for (int64_t i = first / block_size; i * block_size < length; ++i) {
        const int64_t start = i * block_size, lo = std::max(start, first) - start;
        const int64_t hi = std::min(start + block_size, length) - start;
        float* s = scores.data() + (start + lo - first);
        prefetch_next(k_pool, key_role, i);
        const int64_t id = table[i];
#if defined(__AVX512F__)
        if (id < 0 && keys_in_registers) {
          key_role.score(-id - 1, q, head0, heads_per_task, group, lo, hi, s, n, scratch.data());
          continue;
        }
        if (id >= 0 && pool_in_registers) {
          const uint8_t* block = reinterpret_cast<const uint8_t*>(k_pool + id * block_size * row * element);
          for_each_head_run(head0, heads_per_task, group, [&](int64_t kv, int64_t h, int64_t count) {
            const float* query[4];
            float* raw[4];
            for (int64_t j = 0; j < count; ++j) query[j] = q + (h + j) * dim, raw[j] = s + (h + j) * n;
            dispatch_dots(Codes::BFLOAT16, count, query, block + kv * dim * element, row * element, lo, hi, dim, raw);
          });
          continue;
        }
#endif
        const float* rows = block_rows(k_pool, key_role, i, lo, hi);
        int64_t t = lo;
        for (; t + 4 <= hi; t += 4)
          for (int64_t h = 0; h < heads_per_task; ++h) {
            const float* base = rows + (head0 + h) / group * dim;
            const float* k[4] = {base + t * row, base + (t + 1) * row, base + (t + 2) * row, base + (t + 3) * row};
            dot4(q + h * dim, k, dim, s + h * n + (t - lo));
          }
        for (; t < hi; ++t)
          for (int64_t h = 0; h < heads_per_task; ++h)
            s[h * n + (t - lo)] = dot(q + h * dim, rows + t * row + (head0 + h) / group * dim, dim);
      }
      std::vector<float> totals(heads_per_task);
      softmax_numerators(scores.data(), heads_per_task, n, scale_f, cap, totals.data());
      float* out = out_all + (b * heads + head0) * dim;
      std::fill(out, out + heads_per_task * dim, 0.f);
      for (int64_t i = first / block_size; i * block_size < length; ++i) {
        const int64_t start = i * block_size, lo = std::max(start, first) - start;
        const int64_t hi = std::min(start + block_size, length) - start;
        const float* w = scores.data() + (start + lo - first);
        prefetch_next(v_pool, value_role, i);
        const int64_t id = table[i];
#if defined(__AVX512F__)
        if (id < 0 && values_in_registers) {
          value_role.accumulate(-id - 1, w, head0, heads_per_task, group, lo, hi, n, out, scratch.data());
          continue;
        }
        if (id >= 0 && pool_in_registers) {
          const uint8_t* block = reinterpret_cast<const uint8_t*>(v_pool + id * block_size * row * element);
          for_each_head_run(head0, heads_per_task, group, [&](int64_t kv, int64_t h, int64_t count) {
            const float* weight[4];
            float* sums[4];
            for (int64_t j = 0; j < count; ++j) weight[j] = w + (h + j) * n, sums[j] = out + (h + j) * dim;
            dispatch_sums(Codes::BFLOAT16, count, weight, 1, dim, block + kv * dim * element, row * element, lo, hi,
                          dim, sums);
          });
          continue;
        }
#endif
        const float* rows = block_rows(v_pool, value_role, i, lo, hi);
        for (int64_t t = lo; t < hi; t += ROWS) {
          const int64_t count = std::min<int64_t>(ROWS, hi - t);
          for (int64_t h = 0; h < heads_per_task; ++h) {
            const float* v[ROWS];
            for (int64_t j = 0; j < count; ++j) v[j] = rows + (t + j) * row + (head0 + h) / group * dim;
            weighted_sum(w + h * n + (t - lo), v, count, out + h * dim, dim);
          }
        }
      }
      normalise(out, totals.data(), heads_per_task, dim);
    }
  });
  return output;
}
