// Attention for the few query rows of a CPU decode pass, reading only the cache positions each row may attend to.
// Built and loaded by decode_attention.py; registers compiled_spec_cpu::decode_attention.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();

float sum_lanes(Vec v) {
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, v);
}

// Each of rows rows of scores (ld apart, count long) becomes its softmax.
void softmax_rows(float* scores, int64_t rows, int64_t count, int64_t ld) {
  for (int64_t h = 0; h < rows; ++h) {
    float* row = scores + h * ld;
    float highest = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < count; ++j) highest = std::max(highest, row[j]);
    const Vec top(highest);
    Vec sum(0.f);
    int64_t j = 0;
    for (; j + W <= count; j += W) {
      const Vec weight = (Vec::loadu(row + j) - top).exp();
      weight.store(row + j);
      sum = sum + weight;
    }
    float total = sum_lanes(sum);
    for (; j < count; ++j) {
      row[j] = std::exp(row[j] - highest);
      total += row[j];
    }
    const float inverse = 1.f / total;
    for (j = 0; j + W <= count; j += W) (Vec::loadu(row + j) * Vec(inverse)).store(row + j);
    for (; j < count; ++j) row[j] *= inverse;
  }
}

// Up to HB query heads of one kv head at a time (N vectors of Vec::size() floats per row): each key and value row
// is read into registers once for all of them, which halved the time of one head at a time.
template <int N, int HB>
struct Heads {
  // scores[h * ld + j] = query row h . key row at positions[j]
  static void score(const float* query, const float* keys, int64_t stride, const int64_t* positions, int64_t count,
                    float* scores, int64_t ld) {
    for (int64_t j = 0; j < count; ++j) {
      const float* key = keys + positions[j] * stride;
      Vec k[N];
      for (int n = 0; n < N; ++n) k[n] = Vec::loadu(key + n * W);
      for (int h = 0; h < HB; ++h) {
        const float* q = query + h * N * W;
        Vec sum = Vec::loadu(q) * k[0];
        for (int n = 1; n < N; ++n) sum = at::vec::fmadd(Vec::loadu(q + n * W), k[n], sum);
        scores[h * ld + j] = sum_lanes(sum);
      }
    }
  }

  // out row h = sum over j of weights[h * ld + j] * value row at positions[j], C vectors of the row at a time
  static void mix(const float* weights, int64_t ld, const float* values, int64_t stride, const int64_t* positions,
                  int64_t count, float* out, int64_t out_stride) {
    // C(HB + 1) + 1 registers: the accumulators, a value row's C vectors and a weight, within AVX2's 16.
    constexpr int C = N % 4 == 0 && HB < 3 ? 4 : 2;
    for (int c = 0; c < N; c += C) {
      Vec acc[HB][C];
      for (int h = 0; h < HB; ++h)
        for (int i = 0; i < C; ++i) acc[h][i] = Vec(0.f);
      for (int64_t j = 0; j < count; ++j) {
        const float* value = values + positions[j] * stride + c * W;
        Vec v[C];
        for (int i = 0; i < C; ++i) v[i] = Vec::loadu(value + i * W);
        for (int h = 0; h < HB; ++h) {
          const Vec w(weights[h * ld + j]);
          for (int i = 0; i < C; ++i) acc[h][i] = at::vec::fmadd(w, v[i], acc[h][i]);
        }
      }
      for (int h = 0; h < HB; ++h)
        for (int i = 0; i < C; ++i) acc[h][i].store(out + h * out_stride + (c + i) * W);
    }
  }
};

// Any head size: one head, one float at a time past the whole vectors.
void score_any(const float* query, const float* keys, int64_t stride, const int64_t* positions, int64_t count,
               float* scores, int64_t dim) {
  for (int64_t j = 0; j < count; ++j) {
    const float* key = keys + positions[j] * stride;
    Vec sum(0.f);
    int64_t d = 0;
    for (; d + W <= dim; d += W) sum = at::vec::fmadd(Vec::loadu(query + d), Vec::loadu(key + d), sum);
    float total = sum_lanes(sum);
    for (; d < dim; ++d) total += query[d] * key[d];
    scores[j] = total;
  }
}

void mix_any(const float* weights, const float* values, int64_t stride, const int64_t* positions, int64_t count,
             float* out, int64_t dim) {
  std::fill(out, out + dim, 0.f);
  for (int64_t j = 0; j < count; ++j) {
    const float* value = values + positions[j] * stride;
    for (int64_t d = 0; d < dim; ++d) out[d] += weights[j] * value[d];
  }
}

constexpr int64_t MAX_HEADS_AT_ONCE = 3;

template <int N, int HB>
void attend_block(const float* query, const float* keys, const float* values, int64_t stride,
                  const int64_t* positions, int64_t count, float* weights, int64_t ld, float* out) {
  Heads<N, HB>::score(query, keys, stride, positions, count, weights, ld);
  softmax_rows(weights, HB, count, ld);
  Heads<N, HB>::mix(weights, ld, values, stride, positions, count, out, N * W);
}

template <int N>
void attend_heads(int64_t heads, const float* query, const float* keys, const float* values, int64_t stride,
                  const int64_t* positions, int64_t count, float* weights, int64_t ld, float* out) {
  switch (heads) {
    case 1:
      return attend_block<N, 1>(query, keys, values, stride, positions, count, weights, ld, out);
    case 2:
      return attend_block<N, 2>(query, keys, values, stride, positions, count, weights, ld, out);
    default:
      return attend_block<N, 3>(query, keys, values, stride, positions, count, weights, ld, out);
  }
}

// heads (at most MAX_HEADS_AT_ONCE) query rows of dim floats at query, their outputs at out; weights: heads rows of
// ld floats to work in.
void attend_rows(int64_t heads, int64_t dim, const float* query, const float* keys, const float* values,
                 int64_t stride, const int64_t* positions, int64_t count, float* weights, int64_t ld, float* out) {
  switch (dim / W * (dim % W == 0)) {
    case 2:
      return attend_heads<2>(heads, query, keys, values, stride, positions, count, weights, ld, out);
    case 4:
      return attend_heads<4>(heads, query, keys, values, stride, positions, count, weights, ld, out);
    case 8:
      return attend_heads<8>(heads, query, keys, values, stride, positions, count, weights, ld, out);
    case 16:
      return attend_heads<16>(heads, query, keys, values, stride, positions, count, weights, ld, out);
  }
  for (int64_t h = 0; h < heads; ++h) {
    score_any(query + h * dim, keys, stride, positions, count, weights + h * ld, dim);
    softmax_rows(weights + h * ld, 1, count, ld);
    mix_any(weights + h * ld, values, stride, positions, count, out + h * dim, dim);
  }
}

// q [B, T, heads, D], keys and values [B, S, kv_heads, D], attend [B, 1, T, S] bool -> [B, T, heads, D].
// The query heads of one kv head share each key and value row they read. A row that may attend to nothing
// gets zeros.
at::Tensor decode_attention(const at::Tensor& q_in, const at::Tensor& keys_in, const at::Tensor& values_in,
                            const at::Tensor& attend_in) {
  TORCH_CHECK(q_in.scalar_type() == at::kFloat && keys_in.scalar_type() == at::kFloat &&
                  values_in.scalar_type() == at::kFloat,
              "decode_attention takes float32 tensors");
  TORCH_CHECK(attend_in.scalar_type() == at::kBool, "decode_attention: attend must be bool");
  TORCH_CHECK(q_in.dim() == 4 && keys_in.dim() == 4 && values_in.dim() == 4 && attend_in.dim() == 4,
              "decode_attention takes 4-d tensors");
  const auto q = q_in.contiguous();
  const auto keys = keys_in.contiguous();
  const auto values = values_in.contiguous();
  const auto attend = attend_in.contiguous();
  const int64_t batch = q.size(0), rows = q.size(1), heads = q.size(2), dim = q.size(3);
  const int64_t length = keys.size(1), kv_heads = keys.size(2);
  TORCH_CHECK(keys.sizes() == values.sizes() && keys.size(0) == batch && keys.size(3) == dim,
              "decode_attention: keys and values must both be [B, S, kv_heads, D] for q ", q.sizes(), "; got ",
              keys.sizes(), " and ", values.sizes());
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "decode_attention: heads (", heads,
              ") must be a multiple of kv_heads (", kv_heads, ")");
  TORCH_CHECK(attend.size(0) == batch && attend.size(1) == 1 && attend.size(2) == rows && attend.size(3) == length,
              "decode_attention: attend must be [B, 1, T, S] = [", batch, ", 1, ", rows, ", ", length, "]; got ",
              attend.sizes());
  const int64_t group = heads / kv_heads;
  const float scale = 1.f / std::sqrt(static_cast<float>(dim));
  auto out = at::empty_like(q);
  const float* q_data = q.data_ptr<float>();
  const float* key_data = keys.data_ptr<float>();
  const float* value_data = values.data_ptr<float>();
  const bool* attend_data = attend.data_ptr<bool>();
  float* out_data = out.data_ptr<float>();

  const int64_t stride = kv_heads * dim;  // floats from one cache position to the next, in one kv head
  at::parallel_for(0, batch * rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query(group * dim), weights(MAX_HEADS_AT_ONCE * length);
    std::vector<int64_t> positions(length);
    for (int64_t item = begin; item < end; ++item) {
      // The rows of one kv head follow each other, so a thread reads that head's keys and values from its caches.
      const int64_t b = item / (rows * kv_heads), h = (item / rows) % kv_heads, t = item % rows;
      const bool* mask = attend_data + (b * rows + t) * length;
      int64_t count = 0;
      for (int64_t s = 0; s < length; ++s) {
        if (mask[s]) positions[count++] = s;
      }
      const int64_t first = (b * rows + t) * heads + h * group;  // the row's first query head of kv head h
      float* out_rows = out_data + first * dim;
      if (count == 0) {
        std::fill(out_rows, out_rows + group * dim, 0.f);
        continue;
      }
      const float* q_rows = q_data + first * dim;
      for (int64_t d = 0; d < group * dim; ++d) query[d] = q_rows[d] * scale;
      const float* keys_of_head = key_data + (b * length * kv_heads + h) * dim;
      const float* values_of_head = value_data + (b * length * kv_heads + h) * dim;
      for (int64_t g = 0; g < group; g += MAX_HEADS_AT_ONCE) {
        attend_rows(std::min(MAX_HEADS_AT_ONCE, group - g), dim, query.data() + g * dim, keys_of_head, values_of_head,
                    stride, positions.data(), count, weights.data(), length, out_rows + g * dim);
      }
    }
  });
  return out;
}

}  // namespace

// The op is declared in decode_attention.py, with its fake implementation.
TORCH_LIBRARY_IMPL(compiled_spec_cpu, CPU, m) { m.impl("decode_attention", decode_attention); }
