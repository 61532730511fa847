// x @ W.T for fp32 rows against weights kept quantized (packed_linear.py lays them out):
//   4-bit: nibbles uint8 [N, K/2] (byte j of a 32-value block holds value j low, value j + 16 high), a float32 scale
//          and min per block [N, K/32]: w = scale * q + min.
//   8-bit: int8 [N, K], a float32 scale per group of 16 or 32 values [N, K/G]: w = scale * q.
// Each 32-value span is widened to float and multiplied by its scale once, then FMA'd into every input row, so the
// weights stream once for all rows; a 4-bit block's min adds min * (the rows' sum over the block) at the end.
// Built with decode_attention.cpp by decode_attention.py; registers compiled_spec_cpu::packed_linear_4bit/_8bit.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define PACKED_KERNEL 1
#endif

namespace {

constexpr int64_t SPAN = 32;  // values per unpacked span: a 4-bit block, one or two 8-bit groups
// More rows than this (a prefill) widen the weights tile by tile and take ATen's GEMM: there the FMAs bound.
constexpr int64_t KERNEL_MAX_ROWS = 32;
constexpr int64_t DEQUANTIZED_TILE = 256;  // weight rows widened at a time on that path

#ifdef PACKED_KERNEL
#if defined(__AVX512F__)
using fvec = __m512;
constexpr int LANES = 16;
constexpr int ROW_CHUNK = 4;  // input rows per pass over a weight row: 4 x 4 accumulators + 2 weights of 32 registers
constexpr int UNROLL = 2;     // spans in flight: M = 1 would otherwise wait on two FMA chains
inline fvec vzero() { return _mm512_setzero_ps(); }
inline fvec vload(const float* p) { return _mm512_loadu_ps(p); }
inline fvec vfma(fvec a, fvec b, fvec c) { return _mm512_fmadd_ps(a, b, c); }
inline fvec vmul(fvec a, fvec b) { return _mm512_mul_ps(a, b); }
inline fvec vadd(fvec a, fvec b) { return _mm512_add_ps(a, b); }
inline fvec vset1(float s) { return _mm512_set1_ps(s); }
inline float vsum(fvec v) { return _mm512_reduce_add_ps(v); }
inline __m512i widen_u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline fvec widen_s8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline fvec low_nibbles(__m512i v) { return _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15))); }
inline fvec high_nibbles(__m512i v) { return _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)); }
#else
using fvec = __m256;
constexpr int LANES = 8;
constexpr int ROW_CHUNK = 2;  // 2 x 4 accumulators + 4 weights of AVX2's 16 registers
constexpr int UNROLL = 1;     // four FMA chains per row already
inline fvec vzero() { return _mm256_setzero_ps(); }
inline fvec vload(const float* p) { return _mm256_loadu_ps(p); }
inline fvec vfma(fvec a, fvec b, fvec c) { return _mm256_fmadd_ps(a, b, c); }
inline fvec vmul(fvec a, fvec b) { return _mm256_mul_ps(a, b); }
inline fvec vadd(fvec a, fvec b) { return _mm256_add_ps(a, b); }
inline fvec vset1(float s) { return _mm256_set1_ps(s); }
inline float vsum(fvec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}
inline __m256i widen_u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline fvec widen_s8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline fvec low_nibbles(__m256i v) { return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15))); }
inline fvec high_nibbles(__m256i v) { return _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)); }
#endif

constexpr int V = SPAN / LANES;  // vectors per span
constexpr int PREFETCH_ROWS = 4;

// One weight row's span b, widened and scaled: w[c] holds values c * LANES ... of the span.
struct FourBit {
  const uint8_t* nibbles;
  const float* scales;
  int64_t row_bytes;
  void span(int64_t b, fvec* w) const {
    const uint8_t* block = nibbles + b * (SPAN / 2);
    __builtin_prefetch(block + PREFETCH_ROWS * row_bytes);
    const fvec s = vset1(scales[b]);
    for (int c = 0; c < V / 2; ++c) {
      const auto bytes = widen_u8(block + c * LANES);
      w[c] = vmul(low_nibbles(bytes), s);
      w[V / 2 + c] = vmul(high_nibbles(bytes), s);
    }
  }
};

template <int GROUP>
struct EightBit {
  const int8_t* values;
  const float* scales;
  int64_t row_bytes;
  void span(int64_t b, fvec* w) const {
    const int8_t* block = values + b * SPAN;
    __builtin_prefetch(block + PREFETCH_ROWS * row_bytes);
    for (int c = 0; c < V; ++c) w[c] = vmul(widen_s8(block + c * LANES), vset1(scales[(b * SPAN + c * LANES) / GROUP]));
  }
};

// dot[m] = x[m] . (the weight row without its mins) for MB input rows x[m] = x + m * K.
template <int MB, class Row>
void dot_rows(const Row& row, const float* x, int64_t K, float* dot) {
  fvec acc[MB][UNROLL * V];
  for (int m = 0; m < MB; ++m)
    for (int c = 0; c < UNROLL * V; ++c) acc[m][c] = vzero();
  const int64_t spans = K / SPAN;
  int64_t b = 0;
  for (; b + UNROLL <= spans; b += UNROLL) {
    for (int u = 0; u < UNROLL; ++u) {
      fvec w[V];
      row.span(b + u, w);
      for (int m = 0; m < MB; ++m)
        for (int c = 0; c < V; ++c)
          acc[m][u * V + c] = vfma(w[c], vload(x + m * K + (b + u) * SPAN + c * LANES), acc[m][u * V + c]);
    }
  }
  for (; b < spans; ++b) {
    fvec w[V];
    row.span(b, w);
    for (int m = 0; m < MB; ++m)
      for (int c = 0; c < V; ++c) acc[m][c] = vfma(w[c], vload(x + m * K + b * SPAN + c * LANES), acc[m][c]);
  }
  for (int m = 0; m < MB; ++m) {
    fvec total = acc[m][0];
    for (int c = 1; c < UNROLL * V; ++c) total = vadd(total, acc[m][c]);
    dot[m] = vsum(total);
  }
}
#endif

void check_rows(const at::Tensor& x, const at::Tensor& scales, int64_t K, const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, op, ": x must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.size(-1) == K, op, ": x has ", x.size(-1), " features, the weight ", K);
  TORCH_CHECK(K % SPAN == 0, op, ": the weight's row length ", K, " is not a multiple of ", SPAN);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 2, op, ": scales must be 2-d float32");
}

at::Tensor output_for(const at::Tensor& x, int64_t N) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return at::empty(shape, x.options());
}

// Rows [n0, n0 + rows) of the weight as float32, for the GEMM path.
at::Tensor widen_4bit(const uint8_t* nibbles, const float* scales, const float* mins, int64_t n0, int64_t rows, int64_t K) {
  at::Tensor tile = at::empty({rows, K}, at::kFloat);
  float* out = tile.data_ptr<float>();
  const int64_t blocks = K / SPAN;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t at_block = (n0 + r) * blocks + b;
        const uint8_t* block = nibbles + at_block * (SPAN / 2);
        float* o = out + r * K + b * SPAN;
        const float s = scales[at_block], m = mins[at_block];
        for (int j = 0; j < SPAN / 2; ++j) {
          o[j] = s * float(block[j] & 15) + m;
          o[j + SPAN / 2] = s * float(block[j] >> 4) + m;
        }
      }
  });
  return tile;
}

at::Tensor widen_8bit(const int8_t* values, const float* scales, int64_t n0, int64_t rows, int64_t K, int64_t group) {
  at::Tensor tile = at::empty({rows, K}, at::kFloat);
  float* out = tile.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t k = 0; k < K; ++k) out[r * K + k] = scales[((n0 + r) * K + k) / group] * float(values[(n0 + r) * K + k]);
  });
  return tile;
}

template <class Widen>
at::Tensor gemm_over_tiles(const at::Tensor& x, int64_t N, Widen widen) {
  const int64_t K = x.size(-1);
  at::Tensor out = output_for(x, N);
  const at::Tensor rows = x.reshape({-1, K});
  at::Tensor out2d = out.view({-1, N});
  for (int64_t n0 = 0; n0 < N; n0 += DEQUANTIZED_TILE) {
    const int64_t count = std::min(DEQUANTIZED_TILE, N - n0);
    out2d.narrow(1, n0, count).copy_(at::mm(rows, widen(n0, count).t()));
  }
  return out;
}

at::Tensor packed_linear_4bit(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& scales,
                              const at::Tensor& mins) {
  TORCH_CHECK(nibbles.scalar_type() == at::kByte && nibbles.dim() == 2, "packed_linear_4bit: nibbles must be 2-d uint8");
  const int64_t N = nibbles.size(0), K = nibbles.size(1) * 2, blocks = K / SPAN;
  check_rows(x, scales, K, "packed_linear_4bit");
  TORCH_CHECK(scales.sizes() == at::IntArrayRef({N, blocks}) && mins.sizes() == scales.sizes() &&
                  mins.scalar_type() == at::kFloat, "packed_linear_4bit: scales and mins must be [", N, ", ", blocks, "]");
  const at::Tensor q = nibbles.contiguous(), s = scales.contiguous(), mn = mins.contiguous();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float *sp = s.data_ptr<float>(), *mp = mn.data_ptr<float>();
  const int64_t M = x.numel() / K;
#ifdef PACKED_KERNEL
  if (M <= KERNEL_MAX_ROWS) {
    const at::Tensor rows = x.contiguous();
    const float* xp = rows.data_ptr<float>();
    // The rows' sums over each block, for the mins.
    std::vector<float> block_sums(M * blocks);
    for (int64_t i = 0; i < M * blocks; ++i) {
      float total = 0.f;
      for (int64_t j = 0; j < SPAN; ++j) total += xp[i * SPAN + j];
      block_sums[i] = total;
    }
    at::Tensor out = output_for(x, N);
    float* op = out.data_ptr<float>();
    at::parallel_for(0, N, 8, [&](int64_t begin, int64_t end) {
      float dot[ROW_CHUNK];
      for (int64_t n = begin; n < end; ++n) {
        const FourBit row{qp + n * (K / 2), sp + n * blocks, K / 2};
        const float* row_mins = mp + n * blocks;
        int64_t m = 0;
        for (; m + ROW_CHUNK <= M; m += ROW_CHUNK) {
          dot_rows<ROW_CHUNK>(row, xp + m * K, K, dot);
          for (int i = 0; i < ROW_CHUNK; ++i) op[(m + i) * N + n] = dot[i];
        }
        for (; m < M; ++m) {
          dot_rows<1>(row, xp + m * K, K, dot);
          op[m * N + n] = dot[0];
        }
        for (m = 0; m < M; ++m) {
          float min_term = 0.f;
          for (int64_t b = 0; b < blocks; ++b) min_term += row_mins[b] * block_sums[m * blocks + b];
          op[m * N + n] += min_term;
        }
      }
    });
    return out;
  }
#endif
  return gemm_over_tiles(x, N, [&](int64_t n0, int64_t count) { return widen_4bit(qp, sp, mp, n0, count, K); });
}

at::Tensor packed_linear_8bit(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales) {
  TORCH_CHECK(values.scalar_type() == at::kChar && values.dim() == 2, "packed_linear_8bit: values must be 2-d int8");
  const int64_t N = values.size(0), K = values.size(1);
  check_rows(x, scales, K, "packed_linear_8bit");
  TORCH_CHECK(scales.size(0) == N && scales.size(1) > 0 && K % scales.size(1) == 0,
              "packed_linear_8bit: scales must be [", N, ", K / group]");
  const int64_t group = K / scales.size(1);
  TORCH_CHECK(group == 16 || group == 32, "packed_linear_8bit: groups of 16 or 32 values, got ", group);
  const at::Tensor q = values.contiguous(), s = scales.contiguous();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = s.data_ptr<float>();
  const int64_t M = x.numel() / K;
#ifdef PACKED_KERNEL
  if (M <= KERNEL_MAX_ROWS) {
    const at::Tensor rows = x.contiguous();
    const float* xp = rows.data_ptr<float>();
    at::Tensor out = output_for(x, N);
    float* op = out.data_ptr<float>();
    auto run = [&](auto row_of) {
      at::parallel_for(0, N, 8, [&](int64_t begin, int64_t end) {
        float dot[ROW_CHUNK];
        for (int64_t n = begin; n < end; ++n) {
          const auto row = row_of(n);
          int64_t m = 0;
          for (; m + ROW_CHUNK <= M; m += ROW_CHUNK) {
            dot_rows<ROW_CHUNK>(row, xp + m * K, K, dot);
            for (int i = 0; i < ROW_CHUNK; ++i) op[(m + i) * N + n] = dot[i];
          }
          for (; m < M; ++m) {
            dot_rows<1>(row, xp + m * K, K, dot);
            op[m * N + n] = dot[0];
          }
        }
      });
    };
    if (group == 16)
      run([&](int64_t n) { return EightBit<16>{qp + n * K, sp + n * (K / 16), K}; });
    else
      run([&](int64_t n) { return EightBit<32>{qp + n * K, sp + n * (K / 32), K}; });
    return out;
  }
#endif
  return gemm_over_tiles(x, N, [&](int64_t n0, int64_t count) { return widen_8bit(qp, sp, n0, count, K, group); });
}

}  // namespace

TORCH_LIBRARY_IMPL(compiled_spec_cpu, CPU, m) {
  m.impl("packed_linear_4bit", packed_linear_4bit);
  m.impl("packed_linear_8bit", packed_linear_8bit);
}
