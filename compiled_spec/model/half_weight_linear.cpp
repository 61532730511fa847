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

#ifdef HALF_WEIGHT_KERNEL
constexpr int64_t BLOCK = 4;  // weight rows per task: four independent accumulator chains per input row

__m256 weights_at(const c10::Half* row, int64_t k) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k)));
}

float lanes_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}

// out[m, n..n+ROWS) for ROWS weight rows starting at n and M input rows (M <= 2: 2 x 4 accumulators and 4 weight
// vectors fit AVX2's 16 registers). k runs in steps of 8; K % 8 == 0.
template <int ROWS, int M>
void weight_rows(const float* x, const c10::Half* weight, float* out, int64_t n, int64_t K, int64_t N) {
  __m256 acc[M][ROWS];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < ROWS; ++r) acc[m][r] = _mm256_setzero_ps();
  const c10::Half* first = weight + n * K;
  for (int64_t k = 0; k < K; k += 8) {
    __m256 w[ROWS];
    for (int r = 0; r < ROWS; ++r) {
      // The next block's rows, at this k: the hardware prefetcher alone streamed 12-17 GB/s here, this 20-25.
      __builtin_prefetch(first + (BLOCK + r) * K + k);
      w[r] = weights_at(first + r * K, k);
    }
    for (int m = 0; m < M; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * K + k);
      for (int r = 0; r < ROWS; ++r) acc[m][r] = _mm256_fmadd_ps(w[r], xv, acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < ROWS; ++r) out[m * N + n + r] = lanes_sum(acc[m][r]);
}

template <int M>
void block_of_rows(const float* x, const c10::Half* weight, float* out, int64_t n, int64_t K, int64_t N) {
  if (n + BLOCK <= N) {
    weight_rows<BLOCK, M>(x, weight, out, n, K, N);
  } else {
    for (; n < N; ++n) weight_rows<1, M>(x, weight, out, n, K, N);
  }
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
  if (M <= KERNEL_MAX_ROWS && K % 8 == 0) {
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
        int64_t m = 0;
        for (; m + 2 <= M; m += 2) block_of_rows<2>(xp + m * K, wp, op + m * N, b * BLOCK, K, N);
        if (m < M) block_of_rows<1>(xp + m * K, wp, op + m * N, b * BLOCK, K, N);
      }
    });
    return out;
  }
#endif
  return at::linear(x, weight.to(at::kFloat));
}

}  // namespace

TORCH_LIBRARY_IMPL(compiled_spec_cpu, CPU, m) { m.impl("half_weight_linear", half_weight_linear); }
