// x @ weight.T for a few fp32 rows against float16 weights: the drafts' matrices streamed at half the bytes.
// Built with decode_attention.cpp by decode_attention.py; registers compiled_spec_cpu::half_weight_linear.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define HALF_WEIGHT_KERNEL 1
#endif

namespace {

// A decode step's draft depth d runs over k + d rows per sequence (6 at k=3), times the batch. More rows than this (a
// prefill's drafts) widen the weights and take ATen's GEMM: there the FMAs bound, not the bytes.
constexpr int64_t KERNEL_MAX_ROWS = 64;
constexpr int64_t WIDENED_TILE = 256;  // weight rows widened at a time for more rows than that

#ifdef HALF_WEIGHT_KERNEL
constexpr int64_t BLOCK = 4;  // weight rows per task: four independent accumulator chains per input row

// Vector policies: one input row streams faster through 8-lane vectors (measured: 1536x576 in 46 against 60-73 us on
// one AVX-512 thread); several rows through 16-lane ones where the CPU has them, up to 4 at a time (4 x 4 accumulators
// and 4 weight vectors in AVX-512's 32 registers; 2 in AVX2's 16).
struct Lanes8 {
  using vec = __m256;
  static constexpr int64_t LANES = 8;
  static constexpr int MOST_ROWS = 2;
  static vec weights_at(const c10::Half* row, int64_t k) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k)));
  }
  static vec load(const float* p) { return _mm256_loadu_ps(p); }
  static vec zero() { return _mm256_setzero_ps(); }
  static vec fma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(vec v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
  }
};

#if defined(__AVX512F__)
struct Lanes16 {
  using vec = __m512;
  static constexpr int64_t LANES = 16;
  static constexpr int MOST_ROWS = 4;
  static vec weights_at(const c10::Half* row, int64_t k) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k)));
  }
  static vec load(const float* p) { return _mm512_loadu_ps(p); }
  static vec zero() { return _mm512_setzero_ps(); }
  static vec fma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(vec v) { return _mm512_reduce_add_ps(v); }
};
using ManyRows = Lanes16;
#else
using ManyRows = Lanes8;
#endif

// out[m, n..n+ROWS) for ROWS weight rows starting at n and M input rows. k runs in steps of V::LANES.
template <class V, int ROWS, int M>
void weight_rows(const float* x, const c10::Half* weight, float* out, int64_t n, int64_t K, int64_t N) {
  typename V::vec acc[M][ROWS];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < ROWS; ++r) acc[m][r] = V::zero();
  const c10::Half* first = weight + n * K;
  for (int64_t k = 0; k < K; k += V::LANES) {
    typename V::vec w[ROWS];
    for (int r = 0; r < ROWS; ++r) {
      // The next block's rows, at this k: the hardware prefetcher alone streamed 12-17 GB/s here, this 20-25.
      __builtin_prefetch(first + (BLOCK + r) * K + k);
      w[r] = V::weights_at(first + r * K, k);
    }
    for (int m = 0; m < M; ++m) {
      const typename V::vec xv = V::load(x + m * K + k);
      for (int r = 0; r < ROWS; ++r) acc[m][r] = V::fma(w[r], xv, acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < ROWS; ++r) out[m * N + n + r] = V::sum(acc[m][r]);
}

template <class V, int M>
void block_of_rows(const float* x, const c10::Half* weight, float* out, int64_t n, int64_t K, int64_t N) {
  if (n + BLOCK <= N) {
    weight_rows<V, BLOCK, M>(x, weight, out, n, K, N);
  } else {
    for (; n < N; ++n) weight_rows<V, 1, M>(x, weight, out, n, K, N);
  }
}

// Input rows [0, M) in groups of up to MOST, for one block of weight rows from n.
template <class V, int MOST = V::MOST_ROWS>
void rows_of_block(const float* x, const c10::Half* weight, float* out, int64_t n, int64_t M, int64_t K, int64_t N) {
  for (; M >= MOST; M -= MOST, x += MOST * K, out += MOST * N) block_of_rows<V, MOST>(x, weight, out, n, K, N);
  if constexpr (MOST > 1)
    if (M > 0) rows_of_block<V, MOST - 1>(x, weight, out, n, M, K, N);
}
#endif

at::Tensor half_weight_linear(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "half_weight_linear: x must be float32, got ", x.scalar_type());
  TORCH_CHECK(weight.scalar_type() == at::kHalf && weight.dim() == 2,
              "half_weight_linear: weight must be a 2-d float16 tensor, got ", weight.scalar_type(), " ", weight.sizes());
  const int64_t K = weight.size(1), N = weight.size(0);
  TORCH_CHECK(x.size(-1) == K, "half_weight_linear: x has ", x.size(-1), " features, weight ", K);
  const int64_t M = x.numel() / K;
#ifdef HALF_WEIGHT_KERNEL
  if (M <= KERNEL_MAX_ROWS && K % ManyRows::LANES == 0) {
    const at::Tensor rows = x.contiguous();
    const at::Tensor w = weight.contiguous();
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = N;
    at::Tensor out = at::empty(shape, x.options());
    const float* xp = rows.data_ptr<float>();
    const c10::Half* wp = w.data_ptr<c10::Half>();
    float* op = out.data_ptr<float>();
    const int64_t blocks = (N + BLOCK - 1) / BLOCK;
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        if (M == 1)
          block_of_rows<Lanes8, 1>(xp, wp, op, b * BLOCK, K, N);
        else
          rows_of_block<ManyRows>(xp, wp, op, b * BLOCK, M, K, N);
      }
    });
    return out;
  }
#endif
  // More rows (a prefill's drafts): the weight widened a tile of rows at a time into one buffer, each tile's columns
  // of the output written in place by ATen's GEMM. No float32 copy of the whole matrix is made or kept.
  const at::Tensor rows = x.reshape({-1, K}).contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor out = at::empty(shape, x.options());
  at::Tensor out2d = out.view({-1, N});
  at::Tensor tile = at::empty({std::min(WIDENED_TILE, N), K}, x.options());
  for (int64_t n0 = 0; n0 < N; n0 += WIDENED_TILE) {
    const int64_t count = std::min(WIDENED_TILE, N - n0);
    at::Tensor widened = tile.narrow(0, 0, count);
    widened.copy_(weight.narrow(0, n0, count));
    at::Tensor columns = out2d.narrow(1, n0, count);
    at::mm_out(columns, rows, widened.t());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(compiled_spec_cpu, CPU, m) { m.impl("half_weight_linear", half_weight_linear); }
