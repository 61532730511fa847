// x @ W.T for fp32 rows against weights kept quantized (packed_linear.py lays them out):
//   4-bit: nibbles uint8 [N, K/2], a scale and min per 32-value block [N, K/32]: w = scale * q + min.
//          Blocks go in pairs, 32 bytes for 64 values: 16-bit word l holds values l, l + 16, l + 32, l + 48 from its
//          low nibble up. A row's odd last block is 16 bytes: byte l holds value l low, l + 16 high.
//   8-bit: int8 [N, K], a scale per group of 16 or 32 values [N, K/G]: w = scale * q.
// Scales and mins are float32, or float16 where that holds them exactly (fewer bytes to stream): those are widened to
// float32 a tile of weight rows at a time.
// A tile of a few weight rows by a few input rows is multiplied at a time, so each widened weight vector feeds every
// input row and each input vector every weight row; one transposing reduce per four accumulators ends it.
// Built with decode_attention.cpp by decode_attention.py; registers compiled_spec_cpu::packed_linear_4bit/_8bit.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#define PACKED_KERNEL 1
#endif

namespace {

constexpr int64_t BLOCK = 32;  // values per scale (a 4-bit block, an 8-bit group of 32 or two of 16)
// More rows than this (a prefill) widen the weights tile by tile and take ATen's GEMM: there the FMAs bound.
constexpr int64_t KERNEL_MAX_ROWS = 32;
constexpr int64_t DEQUANTIZED_TILE = 256;  // weight rows widened at a time on that path

// The 4-bit value k of a row's bytes, in the paired layout above.
inline int nibble_at(const uint8_t* row, int64_t k, int64_t K) {
  const int64_t pair = k / 64, i = k % 64;
  if ((pair + 1) * 64 > K) {  // the odd last block
    const uint8_t byte = row[pair * 32 + i % 16];
    return i < 16 ? byte & 15 : byte >> 4;
  }
  const uint8_t byte = row[pair * 32 + 2 * (i % 16) + i / 32];
  return (i / 16) % 2 ? byte >> 4 : byte & 15;
}

#ifdef PACKED_KERNEL
#if defined(__AVX512F__)
using fvec = __m512;
constexpr int LANES = 16;
inline fvec vzero() { return _mm512_setzero_ps(); }
inline fvec vload(const float* p) { return _mm512_loadu_ps(p); }
inline fvec vfma(fvec a, fvec b, fvec c) { return _mm512_fmadd_ps(a, b, c); }
inline fvec vmul(fvec a, fvec b) { return _mm512_mul_ps(a, b); }
inline fvec vset1(float s) { return _mm512_set1_ps(s); }
inline void vstore(float* p, fvec v) { _mm512_storeu_ps(p, v); }

// The block's 16 possible weights, scale * q + min for q = 0..15 (one rounding, as gguf's exact product then add).
inline fvec nibble_table(float scale, float min) {
  return _mm512_fmadd_ps(_mm512_set1_ps(scale),
                         _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_ps(min));
}

// A 4-bit pair of blocks: the permute looks each lane's low nibble up in the block's table, so one shift and one
// permute widen 16 values.
inline void widen_pair(const uint8_t* bytes, const float* scales, const float* mins, fvec* w) {
  const __m512i words = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes)));
  const fvec first = nibble_table(scales[0], mins[0]), second = nibble_table(scales[1], mins[1]);
  w[0] = _mm512_permutexvar_ps(words, first);
  w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(words, 4), first);
  w[2] = _mm512_permutexvar_ps(_mm512_srli_epi32(words, 8), second);
  w[3] = _mm512_permutexvar_ps(_mm512_srli_epi32(words, 12), second);
}

inline void widen_block(const uint8_t* bytes, float scale, float min, fvec* w) {
  const __m512i lanes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  const fvec table = nibble_table(scale, min);
  w[0] = _mm512_permutexvar_ps(lanes, table);
  w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(lanes, 4), table);
}

inline fvec widen_s8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

inline void widen_halves(const at::Half* from, int64_t count, float* to) {
  for (int64_t i = 0; i < count; i += 16) {
    const __mmask16 lanes = count - i >= 16 ? 0xFFFF : (1u << (count - i)) - 1;
    _mm512_mask_storeu_ps(to + i, lanes, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, from + i)));
  }
}

inline __m256 fold(fvec v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
#else
using fvec = __m256;
constexpr int LANES = 8;
inline fvec vzero() { return _mm256_setzero_ps(); }
inline fvec vload(const float* p) { return _mm256_loadu_ps(p); }
inline fvec vfma(fvec a, fvec b, fvec c) { return _mm256_fmadd_ps(a, b, c); }
inline fvec vmul(fvec a, fvec b) { return _mm256_mul_ps(a, b); }
inline fvec vset1(float s) { return _mm256_set1_ps(s); }
inline void vstore(float* p, fvec v) { _mm256_storeu_ps(p, v); }

inline fvec nibbles_to_weights(__m256i v, int shift, fvec scale, fvec min) {
  const __m256i q = _mm256_and_si256(_mm256_srli_epi32(v, shift), _mm256_set1_epi32(15));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), scale, min);
}

inline void widen_pair(const uint8_t* bytes, const float* scales, const float* mins, fvec* w) {
  const __m256i words[2] = {_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes))),
                            _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 16)))};
  for (int j = 0; j < 4; ++j) {
    const fvec scale = vset1(scales[j / 2]), min = vset1(mins[j / 2]);
    for (int h = 0; h < 2; ++h) w[2 * j + h] = nibbles_to_weights(words[h], 4 * j, scale, min);
  }
}

inline void widen_block(const uint8_t* bytes, float scale, float min, fvec* w) {
  const __m256i lanes[2] = {_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes))),
                            _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + 8)))};
  const fvec s = vset1(scale), m = vset1(min);
  for (int j = 0; j < 2; ++j)
    for (int h = 0; h < 2; ++h) w[2 * j + h] = nibbles_to_weights(lanes[h], 4 * j, s, m);
}

inline fvec widen_s8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline void widen_halves(const at::Half* from, int64_t count, float* to) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8)
    _mm256_storeu_ps(to + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(from + i))));
  for (; i < count; ++i) to[i] = float(from[i]);
}

inline __m256 fold(fvec v) { return v; }
#endif

// The four accumulators' sums, in order.
inline __m128 sum4(fvec a, fvec b, fvec c, fvec d) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(fold(a), fold(b)), _mm256_hadd_ps(fold(c), fold(d)));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// A weight's float32 scales (or mins) by row: the tensor's own, or a tile's widened from float16 (rows from first).
struct ScaleRows {
  const float* data;
  int64_t first;
  const float* row(int64_t n, int64_t per_row) const { return data + (n - first) * per_row; }
};

// Each format widens a row's span of SPAN values (the last span of a 4-bit row may be a lone 32-value block).
struct FourBit {
  static constexpr int64_t SPAN = 64, SPAN_BYTES = 32, GROUP = BLOCK;
  const uint8_t* nibbles;
  ScaleRows scales, mins;
  int64_t K;
  void widen(int64_t n, int64_t span, fvec* w) const {
    widen_pair(nibbles + n * (K / 2) + span * 32, scales.row(n, K / BLOCK) + span * 2, mins.row(n, K / BLOCK) + span * 2,
               w);
  }
  void widen_last_block(int64_t n, fvec* w) const {
    const int64_t last = K / BLOCK - 1;
    widen_block(nibbles + (n + 1) * (K / 2) - 16, scales.row(n, K / BLOCK)[last], mins.row(n, K / BLOCK)[last], w);
  }
  const void* row_bytes(int64_t n) const { return nibbles + n * (K / 2); }
};

template <int G>
struct EightBit {
  static constexpr int64_t SPAN = 32, SPAN_BYTES = 32, GROUP = G;
  const int8_t* values;
  ScaleRows scales, mins;  // no mins
  int64_t K;
  void widen(int64_t n, int64_t span, fvec* w) const {
    const int8_t* bytes = values + n * K + span * SPAN;
    const float* s = scales.row(n, K / GROUP) + span * (SPAN / GROUP);
    for (int c = 0; c < SPAN / LANES; ++c) w[c] = vmul(widen_s8(bytes + c * LANES), vset1(s[c * LANES / GROUP]));
  }
  void widen_last_block(int64_t, fvec*) const {}
  const void* row_bytes(int64_t n) const { return values + n * K; }
};

// How far ahead of the span being read the weight bytes are prefetched (a tile's rows are adjacent, so this reaches a
// tile or more ahead), and how many tiles ahead the scales: one tile's work at 1 input row is shorter than a read
// from memory.
constexpr int64_t PREFETCH_BYTES = 4096;
constexpr int64_t SCALES_AHEAD = 2;

// out[m, n + r] for R weight rows from n and MB input rows from x (x[m] at x + m * K), m < MB, r < R.
template <int R, int MB, class Format>
void multiply_tile(const Format& format, int64_t n, const float* x, int64_t K, float* out, int64_t N) {
  constexpr int VECTORS = Format::SPAN / LANES;
  fvec acc[MB][R];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = vzero();
  auto multiply = [&](const float* xs, int r, const fvec* w, int count) {
    for (int c = 0; c < count; ++c)
      for (int m = 0; m < MB; ++m) acc[m][r] = vfma(w[c], vload(xs + m * K + c * LANES), acc[m][r]);
  };
  const int64_t spans = K / Format::SPAN;
  for (int64_t s = 0; s < spans; ++s) {
    for (int r = 0; r < R; ++r) {
      __builtin_prefetch(static_cast<const char*>(format.row_bytes(n + r)) + s * Format::SPAN_BYTES + PREFETCH_BYTES);
      fvec w[VECTORS];
      format.widen(n + r, s, w);
      multiply(x + s * Format::SPAN, r, w, VECTORS);
    }
  }
  if (spans * Format::SPAN < K) {
    for (int r = 0; r < R; ++r) {
      fvec w[BLOCK / LANES];
      format.widen_last_block(n + r, w);
      multiply(x + spans * Format::SPAN, r, w, BLOCK / LANES);
    }
  }
  constexpr int COUNT = MB * R, PADDED = (COUNT + 3) / 4 * 4;
  fvec all[PADDED];
  for (int i = 0; i < PADDED; ++i) all[i] = i < COUNT ? acc[i / R][i % R] : vzero();
  float sums[PADDED];
  for (int i = 0; i < PADDED; i += 4) _mm_storeu_ps(sums + i, sum4(all[i], all[i + 1], all[i + 2], all[i + 3]));
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) out[m * N + n + r] = sums[m * R + r];
}

// Input rows [0, M) in tiles of up to MOST rows, for R weight rows from n.
template <int R, int MOST, class Format>
void multiply_rows(const Format& format, int64_t n, const float* x, int64_t M, int64_t K, float* out, int64_t N) {
  for (; M >= MOST; M -= MOST, x += MOST * K, out += MOST * N) multiply_tile<R, MOST>(format, n, x, K, out, N);
  if constexpr (MOST > 1)
    if (M > 0) multiply_rows<R, MOST - 1>(format, n, x, M, K, out, N);
}

// Weight rows per tile: four while the tile's accumulators fit the registers (4 x 4 vectors), two up to 8 rows.
// The scales' and mins' memory (mins null for 8-bit); when float16, format's own are unused.
struct ScaleMemory {
  const void* scales;
  const void* mins;
  bool half;
};

template <class Format>
void multiply(const Format& format, ScaleMemory memory, const float* x, int64_t M, int64_t K, float* out, int64_t N) {
  const int64_t rows_per_tile = M <= 4 ? 4 : 2, per_row = K / Format::GROUP;
  const at::Half* half_scales = memory.half ? static_cast<const at::Half*>(memory.scales) : nullptr;
  const at::Half* half_mins = memory.half ? static_cast<const at::Half*>(memory.mins) : nullptr;
  const int64_t row_scale_bytes = per_row * (memory.half ? 2 : 4);
  at::parallel_for(0, (N + rows_per_tile - 1) / rows_per_tile, 4, [&](int64_t begin, int64_t end) {
    Format tile_format = format;
    std::vector<float> widened(half_scales ? 2 * rows_per_tile * per_row : 0);
    for (int64_t tile = begin; tile < end; ++tile) {
      int64_t n = tile * rows_per_tile;
      if (n + (SCALES_AHEAD + 1) * rows_per_tile <= N) {
        const int64_t from = (n + SCALES_AHEAD * rows_per_tile) * row_scale_bytes;
        for (int64_t b = 0; b < rows_per_tile * row_scale_bytes; b += 64) {
          __builtin_prefetch(static_cast<const char*>(memory.scales) + from + b);
          if (memory.mins) __builtin_prefetch(static_cast<const char*>(memory.mins) + from + b);
        }
      }
      if (half_scales) {
        const int64_t count = std::min(rows_per_tile, N - n) * per_row;
        widen_halves(half_scales + n * per_row, count, widened.data());
        tile_format.scales = {widened.data(), n};
        if (half_mins) {
          widen_halves(half_mins + n * per_row, count, widened.data() + count);
          tile_format.mins = {widened.data() + count, n};
        }
      }
      const Format& format = tile_format;
      if (n + rows_per_tile > N)
        for (; n < N; ++n) multiply_rows<1, 8>(format, n, x, M, K, out, N);
      else if (rows_per_tile == 4)
        multiply_rows<4, 4>(format, n, x, M, K, out, N);
      else
        multiply_rows<2, 8>(format, n, x, M, K, out, N);
    }
  });
}
#endif

void check_rows(const at::Tensor& x, const at::Tensor& scales, int64_t K, const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, op, ": x must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.size(-1) == K, op, ": x has ", x.size(-1), " features, the weight ", K);
  TORCH_CHECK(K % BLOCK == 0, op, ": the weight's row length ", K, " is not a multiple of ", BLOCK);
  TORCH_CHECK((scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf) && scales.dim() == 2, op,
              ": scales must be 2-d float32 or float16");
}

at::Tensor output_for(const at::Tensor& x, int64_t N) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return at::empty(shape, x.options());
}

// Rows [n0, n0 + rows) of the weight as float32, for the GEMM path.
void widen_4bit(const uint8_t* nibbles, const float* scales, const float* mins, int64_t n0, int64_t rows, int64_t K,
                float* out) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t n = n0 + r;
      for (int64_t k = 0; k < K; ++k) {
        const int64_t block = n * (K / BLOCK) + k / BLOCK;
        out[r * K + k] = scales[block] * float(nibble_at(nibbles + n * (K / 2), k, K)) + mins[block];
      }
    }
  });
}

void widen_8bit(const int8_t* values, const float* scales, int64_t n0, int64_t rows, int64_t K, int64_t group,
                float* out) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t k = 0; k < K; ++k) out[r * K + k] = scales[((n0 + r) * K + k) / group] * float(values[(n0 + r) * K + k]);
  });
}

#ifdef PACKED_KERNEL
// Rows [n0, n0 + rows) of the weight as float32 through the kernel's vector widening (the scalar loops above are the
// fallback): format's scales and mins are float32 rows from 0.
template <class Format>
void widen_rows(const Format& format, int64_t n0, int64_t rows, int64_t K, float* out) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    constexpr int VECTORS = Format::SPAN / LANES;
    const int64_t spans = K / Format::SPAN;
    for (int64_t r = begin; r < end; ++r) {
      float* row = out + r * K;
      fvec w[VECTORS > BLOCK / LANES ? VECTORS : BLOCK / LANES];
      for (int64_t s = 0; s < spans; ++s) {
        format.widen(n0 + r, s, w);
        for (int c = 0; c < VECTORS; ++c) vstore(row + s * Format::SPAN + c * LANES, w[c]);
      }
      if (spans * Format::SPAN < K) {
        format.widen_last_block(n0 + r, w);
        for (int c = 0; c < BLOCK / LANES; ++c) vstore(row + spans * Format::SPAN + c * LANES, w[c]);
      }
    }
  });
}
#endif

template <class Widen>
at::Tensor gemm_over_tiles(const at::Tensor& x, int64_t N, Widen widen) {
  const int64_t K = x.size(-1);
  at::Tensor out = output_for(x, N);
  const at::Tensor rows = x.reshape({-1, K}).contiguous();
  at::Tensor out2d = out.view({-1, N});
  // One tile buffer per call: an allocation per tile cost a fresh mapping and its page faults each time.
  at::Tensor tile = at::empty({std::min(DEQUANTIZED_TILE, N), K}, at::kFloat);
  for (int64_t n0 = 0; n0 < N; n0 += DEQUANTIZED_TILE) {
    const int64_t count = std::min(DEQUANTIZED_TILE, N - n0);
    widen(n0, count, tile.data_ptr<float>());
    at::Tensor columns = out2d.narrow(1, n0, count);
    at::mm_out(columns, rows, tile.narrow(0, 0, count).t());  // BLAS writes the strided columns in place
  }
  return out;
}

at::Tensor packed_linear_4bit(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& scales,
                              const at::Tensor& mins) {
  TORCH_CHECK(nibbles.scalar_type() == at::kByte && nibbles.dim() == 2, "packed_linear_4bit: nibbles must be 2-d uint8");
  const int64_t N = nibbles.size(0), K = nibbles.size(1) * 2, blocks = K / BLOCK;
  check_rows(x, scales, K, "packed_linear_4bit");
  TORCH_CHECK(scales.sizes() == at::IntArrayRef({N, blocks}) && mins.sizes() == scales.sizes() &&
                  mins.scalar_type() == scales.scalar_type(),
              "packed_linear_4bit: scales and mins must be [", N, ", ", blocks, "] of one dtype");
  const at::Tensor q = nibbles.contiguous(), s = scales.contiguous(), mn = mins.contiguous();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const int64_t M = x.numel() / K;
#ifdef PACKED_KERNEL
  if (M <= KERNEL_MAX_ROWS) {
    const at::Tensor rows = x.contiguous();
    at::Tensor out = output_for(x, N);
    const bool half = s.scalar_type() == at::kHalf;
    const ScaleRows own_scales{half ? nullptr : s.data_ptr<float>(), 0}, own_mins{half ? nullptr : mn.data_ptr<float>(), 0};
    multiply(FourBit{qp, own_scales, own_mins, K}, {s.data_ptr(), mn.data_ptr(), half}, rows.data_ptr<float>(), M, K,
             out.data_ptr<float>(), N);
    return out;
  }
#endif
  const at::Tensor s32 = s.to(at::kFloat), mn32 = mn.to(at::kFloat);
  const float *sp = s32.data_ptr<float>(), *mp = mn32.data_ptr<float>();
#ifdef PACKED_KERNEL
  const FourBit wide{qp, {sp, 0}, {mp, 0}, K};
  return gemm_over_tiles(x, N, [&](int64_t n0, int64_t count, float* tile) { widen_rows(wide, n0, count, K, tile); });
#else
  return gemm_over_tiles(x, N, [&](int64_t n0, int64_t count, float* tile) { widen_4bit(qp, sp, mp, n0, count, K, tile); });
#endif
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
  const int64_t M = x.numel() / K;
#ifdef PACKED_KERNEL
  if (M <= KERNEL_MAX_ROWS) {
    const at::Tensor rows = x.contiguous();
    at::Tensor out = output_for(x, N);
    const float* xp = rows.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const bool half = s.scalar_type() == at::kHalf;
    const ScaleRows own{half ? nullptr : s.data_ptr<float>(), 0};
    const ScaleMemory memory{s.data_ptr(), nullptr, half};
    if (group == 16)
      multiply(EightBit<16>{qp, own, {}, K}, memory, xp, M, K, op, N);
    else
      multiply(EightBit<32>{qp, own, {}, K}, memory, xp, M, K, op, N);
    return out;
  }
#endif
  const at::Tensor s32 = s.to(at::kFloat);
  const float* sp = s32.data_ptr<float>();
#ifdef PACKED_KERNEL
  if (group == 16) {
    const EightBit<16> wide{qp, {sp, 0}, {}, K};
    return gemm_over_tiles(x, N, [&](int64_t n0, int64_t count, float* tile) { widen_rows(wide, n0, count, K, tile); });
  }
  const EightBit<32> wide{qp, {sp, 0}, {}, K};
  return gemm_over_tiles(x, N, [&](int64_t n0, int64_t count, float* tile) { widen_rows(wide, n0, count, K, tile); });
#else
  return gemm_over_tiles(x, N, [&](int64_t n0, int64_t count, float* tile) { widen_8bit(qp, sp, n0, count, K, group, tile); });
#endif
}

}  // namespace

TORCH_LIBRARY_IMPL(compiled_spec_cpu, CPU, m) {
  m.impl("packed_linear_4bit", packed_linear_4bit);
  m.impl("packed_linear_8bit", packed_linear_8bit);
}
