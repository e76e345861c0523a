// y = x @ weight^T (+ bias) for a few rows of x on CPU, float32: a decode step's projections.
// At 1-64 rows a BLAS sgemm spends most of its time packing the weight, which is read from
// memory once anyway; here each weight row is streamed once and used for every x row.
//
// Two shapes of inner loop. With AVX-512 and at least 16 rows, x is transposed into a small
// buffer and the rows are the vector lanes: each weight element is broadcast once and feeds one
// FMA per 16 rows, with no horizontal sums at all (the 32 vector registers hold 24 accumulators).
// Otherwise each output is a dot product over k, vectorised along k, four outputs per reduction.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <vector>

namespace {

constexpr int64_t TILE_ROWS = 3;     // rows of x per tile
constexpr int64_t TILE_OUTPUTS = 4;  // weight rows (outputs) per tile: 3 x 4 accumulators fit the registers

// y[r, n] for rows m .. m+rows-1 and outputs n0 .. n0+outputs-1, accumulated over k in plain C++
void tile_plain(const float* x, const float* w, float* y, int64_t m, int64_t rows, int64_t n0, int64_t outputs,
                int64_t K, int64_t N) {
  for (int64_t r = m; r < m + rows; ++r)
    for (int64_t n = n0; n < n0 + outputs; ++n) {
      float sum = 0.f;
      for (int64_t k = 0; k < K; ++k) sum += x[r * K + k] * w[n * K + k];
      y[r * N + n] = sum;
    }
}

#if defined(__AVX2__) && defined(__FMA__)
// [s0 s1 s2 s3] = the horizontal sums of four accumulators
inline __m128 sum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 sums = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1));
}

// ROWS rows of x against four weight rows: ROWS x 4 accumulators, each weight load feeding ROWS FMAs
template <int ROWS>
void tile(const float* x, const float* w, float* y, int64_t m, int64_t n0, int64_t K, int64_t N) {
  const float* weight[4] = {w + n0 * K, w + (n0 + 1) * K, w + (n0 + 2) * K, w + (n0 + 3) * K};
  __m256 acc[ROWS][4];
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m256 w0 = _mm256_loadu_ps(weight[0] + k), w1 = _mm256_loadu_ps(weight[1] + k),
                 w2 = _mm256_loadu_ps(weight[2] + k), w3 = _mm256_loadu_ps(weight[3] + k);
    for (int r = 0; r < ROWS; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + (m + r) * K + k);
      acc[r][0] = _mm256_fmadd_ps(xv, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xv, w1, acc[r][1]);
      acc[r][2] = _mm256_fmadd_ps(xv, w2, acc[r][2]);
      acc[r][3] = _mm256_fmadd_ps(xv, w3, acc[r][3]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    float* out = y + (m + r) * N + n0;
    _mm_storeu_ps(out, sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
    for (int64_t tail = k; tail < K; ++tail)
      for (int j = 0; j < 4; ++j) out[j] += x[(m + r) * K + tail] * weight[j][tail];
  }
}
#endif

#if defined(__AVX512F__)
constexpr int64_t LANES = 16;  // rows per vector in the row-vectorised path

// OUTPUTS weight rows against all rows of x, the rows in VECTORS vectors of 16:
// x_t: [K, VECTORS * 16] (x transposed, zero-padded rows); writes y[r, n0 + j] for r < M.
template <int VECTORS, int OUTPUTS>
void rows_tile(const float* x_t, const float* w, float* y, int64_t n0, int64_t M, int64_t K, int64_t N) {
  constexpr int64_t width = VECTORS * LANES;
  const float* weight[OUTPUTS];
  for (int j = 0; j < OUTPUTS; ++j) weight[j] = w + (n0 + j) * K;
  __m512 acc[OUTPUTS][VECTORS];
  for (int j = 0; j < OUTPUTS; ++j)
    for (int v = 0; v < VECTORS; ++v) acc[j][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 xv[VECTORS];
    for (int v = 0; v < VECTORS; ++v) xv[v] = _mm512_loadu_ps(x_t + k * width + v * LANES);
    for (int j = 0; j < OUTPUTS; ++j) {
      const __m512 b = _mm512_set1_ps(weight[j][k]);
      for (int v = 0; v < VECTORS; ++v) acc[j][v] = _mm512_fmadd_ps(b, xv[v], acc[j][v]);
    }
  }
  alignas(64) float column[width];
  for (int j = 0; j < OUTPUTS; ++j) {
    for (int v = 0; v < VECTORS; ++v) _mm512_store_ps(column + v * LANES, acc[j][v]);
    for (int64_t r = 0; r < M; ++r) y[r * N + n0 + j] = column[r];
  }
}

// 24 accumulators whatever the rows: 12 outputs x 2 vectors (<= 32 rows), 8 x 3, 6 x 4
template <int VECTORS>
void rows_linear(const float* xs, const float* ws, float* ys, int64_t M, int64_t K, int64_t N) {
  constexpr int OUTPUTS = VECTORS == 1 ? 12 : 24 / VECTORS;
  constexpr int64_t width = VECTORS * LANES;
  std::vector<float> x_t(K * width, 0.f);  // [K, width]: a few hundred KB, stays in L2
  for (int64_t r = 0; r < M; ++r)
    for (int64_t k = 0; k < K; ++k) x_t[k * width + r] = xs[r * K + k];
  const int64_t tiles = N / OUTPUTS;
  at::parallel_for(0, tiles + 1, 4, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) {
      if (tile < tiles) {
        rows_tile<VECTORS, OUTPUTS>(x_t.data(), ws, ys, tile * OUTPUTS, M, K, N);
      } else {
        for (int64_t n = tiles * OUTPUTS; n < N; ++n) rows_tile<VECTORS, 1>(x_t.data(), ws, ys, n, M, K, N);
      }
    }
  });
}
#endif

}  // namespace

// x: [M, K] float32, weight: [N, K] float32 (nn.Linear's layout), bias: [N] or None -> [M, N]
torch::Tensor small_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "small_linear: bad shapes");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "small_linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && weight.scalar_type() == torch::kFloat, "small_linear: float32 only");
  x = x.contiguous();
  weight = weight.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* xs = x.data_ptr<float>();
  const float* ws = weight.data_ptr<float>();
  float* ys = y.data_ptr<float>();
#if defined(__AVX512F__)
  if (M >= LANES && M <= 4 * LANES) {
    switch ((M + LANES - 1) / LANES) {
      case 1: rows_linear<1>(xs, ws, ys, M, K, N); break;
      case 2: rows_linear<2>(xs, ws, ys, M, K, N); break;
      case 3: rows_linear<3>(xs, ws, ys, M, K, N); break;
      default: rows_linear<4>(xs, ws, ys, M, K, N); break;
    }
    if (bias.has_value() && bias->defined()) y.add_(bias->to(y.dtype()));
    return y;
  }
#endif
  // threads split the outputs, so each reads its own share of the weight once
  at::parallel_for(0, (N + TILE_OUTPUTS - 1) / TILE_OUTPUTS, 16, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      const int64_t n0 = block * TILE_OUTPUTS, outputs = std::min(TILE_OUTPUTS, N - n0);
#if defined(__AVX2__) && defined(__FMA__)
      if (outputs == TILE_OUTPUTS) {
        int64_t m = 0;
        for (; m + TILE_ROWS <= M; m += TILE_ROWS) tile<TILE_ROWS>(xs, ws, ys, m, n0, K, N);
        for (; m < M; ++m) tile<1>(xs, ws, ys, m, n0, K, N);
        continue;
      }
#endif
      tile_plain(xs, ws, ys, 0, M, n0, outputs, K, N);
    }
  });
  if (bias.has_value() && bias->defined()) y.add_(bias->to(y.dtype()));
  return y;
}
