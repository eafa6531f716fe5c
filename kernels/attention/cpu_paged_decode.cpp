// Paged decode attention on CPU: one query token per request over its blocks of the cache,
// read in place (no gather), fp32 math. Built at first use by cpu_paged_decode.py.
//
//   q            [B, H, D]             this step's queries (one token per request)
//   k/v_cache    [NB, BS, KVH, D]      the paged cache (q's dtype)
//   block_tables [B, MB] int32         request b's blocks
//   seq_lens     [B] int32             request b's context, this token's key included
//   -> out       [B, H, D]             softmax(q . K^T * scale) . V per head, in q's dtype
//
// One task per (request, KV head): its G = H / KVH query heads share each key and value row
// as it is loaded. Per task: scores for all keys (fp32), the softmax (not online: all scores,
// then their max, then exp by a polynomial of about 1 ulp), then the weighted sum of V. The
// inner loops are written on 16-float vectors (GCC/Clang vector extensions, no intrinsics);
// sums run in lanes folded in a fixed tree (no -ffast-math), so a request's output does not
// depend on the batch it runs in.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kMaxGroup = 16;  // query heads per KV head (checked)

inline float to_float(float x) { return x; }
inline float to_float(double x) { return static_cast<float>(x); }
inline float to_float(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_float(at::Half x) { return static_cast<float>(x); }

// 16 floats as one GCC/Clang vector (an AVX-512 register, or two AVX2 ones): the inner loops
// are written on it so they are SIMD whatever the auto-vectoriser decides.
typedef float f32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline f32x16 load16(const at::BFloat16* p) {  // bf16 is the top half of a float's bits
  u16x16 half;
  std::memcpy(&half, p, sizeof(half));
  const u32x16 bits = __builtin_convertvector(half, u32x16) << 16;
  f32x16 v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}
template <typename T>
inline f32x16 load16(const T* p) {  // fp16, fp64: element by element
  float tmp[kLanes];
  for (int64_t j = 0; j < kLanes; ++j) tmp[j] = to_float(p[j]);
  return load16(tmp);
}
inline void store16(float* p, f32x16 v) { std::memcpy(p, &v, sizeof(v)); }

// The sum of the lanes as a tree, halves added pairwise (16 -> 8 -> 4 -> 2 -> 1): a fixed
// order, in registers.
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
inline float fold(f32x16 v) {
  f32x8 lo8, hi8;
  std::memcpy(&lo8, &v, sizeof(lo8));
  std::memcpy(&hi8, reinterpret_cast<const char*>(&v) + sizeof(lo8), sizeof(hi8));
  const f32x8 a = lo8 + hi8;
  f32x4 lo4, hi4;
  std::memcpy(&lo4, &a, sizeof(lo4));
  std::memcpy(&hi4, reinterpret_cast<const char*>(&a) + sizeof(lo4), sizeof(hi4));
  const f32x4 b = lo4 + hi4;
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// scores[g * stride] = q_g . k for the group's query heads: k loaded and converted once, one
// accumulator per head (independent chains).
template <typename T>
void dots(const float* q, const T* k, int64_t d, int64_t group, float* scores, int64_t stride) {
  f32x16 acc[kMaxGroup];
  for (int64_t g = 0; g < group; ++g) acc[g] = f32x16{};
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes) {
    const f32x16 kv = load16(k + i);
    for (int64_t g = 0; g < group; ++g) acc[g] += load16(q + g * d + i) * kv;
  }
  for (int64_t g = 0; g < group; ++g) {
    float sum = fold(acc[g]);
    for (int64_t t = i; t < d; ++t) sum += q[g * d + t] * to_float(k[t]);
    scores[g * stride] = sum;
  }
}

// exp(x) for x <= 0 (a softmax's x - max), vectorisable (std::exp is a scalar libm call and
// was most of the kernel's time): x = n ln2 + r, |r| <= ln2 / 2, exp(r) by Cephes' expf
// polynomial (about 1 ulp), 2^n by building the float's exponent. Below -87, exp underflows
// the normal floats: clamped there (a weight of ~1e-38 against the max's 1).
typedef int32_t i32x16 __attribute__((vector_size(64)));

inline f32x16 exp_nonpositive(f32x16 x) {
  const f32x16 low = f32x16{} - 87.0f;
  x = x < low ? low : x;
  const f32x16 t = x * 1.44269504088896341f + 0.5f;
  i32x16 n = __builtin_convertvector(t, i32x16);  // truncates toward zero: floor below
  n -= (__builtin_convertvector(n, f32x16) > t) ? 1 : 0;
  const f32x16 nf = __builtin_convertvector(n, f32x16);
  const f32x16 r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  f32x16 p = f32x16{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const f32x16 e = p * r * r + r + 1.0f;
  const i32x16 bits = (n + 127) << 23;
  f32x16 two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return e * two_n;
}

inline float exp_nonpositive(float x) {  // a tail element: the same arithmetic, one lane
  float lanes[kLanes] = {};
  lanes[0] = x;
  float out[kLanes];
  store16(out, exp_nonpositive(load16(lanes)));
  return out[0];
}

// Exponentiate s[0..len) against its max in place; returns their sum (lanes: fixed order).
float softmax_numerators(float* s, int64_t len) {
  const float top = *std::max_element(s, s + len);
  f32x16 lanes{};
  int64_t l = 0;
  for (; l + kLanes <= len; l += kLanes) {
    const f32x16 e = exp_nonpositive(load16(s + l) - top);
    store16(s + l, e);
    lanes += e;
  }
  for (int64_t t = l; t < len; ++t) s[t] = exp_nonpositive(s[t] - top);
  float sum = fold(lanes);
  for (; l < len; ++l) sum += s[l];
  return sum;
}

// acc_g += p[g * stride] * v for the group's heads: v loaded and converted once.
template <typename T>
void axpys(const float* p, int64_t stride, const T* v, int64_t d, int64_t group, float* acc) {
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes) {
    const f32x16 vv = load16(v + i);
    for (int64_t g = 0; g < group; ++g) {
      float* a = acc + g * d + i;
      store16(a, load16(a) + p[g * stride] * vv);
    }
  }
  for (; i < d; ++i) {
    const float x = to_float(v[i]);
    for (int64_t g = 0; g < group; ++g) acc[g * d + i] += p[g * stride] * x;
  }
}

template <typename T>
void decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& seq_lens, float scale,
            at::Tensor& out) {
  const int64_t num_reqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, max_blocks = block_tables.size(1);
  const int64_t num_blocks = k_cache.size(0);
  const T* qp = q.const_data_ptr<T>();
  const T* kp = k_cache.const_data_ptr<T>();
  const T* vp = v_cache.const_data_ptr<T>();
  const int32_t* tables = block_tables.const_data_ptr<int32_t>();
  const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
  T* op = out.mutable_data_ptr<T>();
  const int64_t row_stride = num_kv_heads * head_dim;  // one token's K (or V) in a block

  // Every length and block id checked here, before the threads start: nothing in the
  // parallel region throws. The messages are formatted with snprintf: TORCH_CHECK's own
  // formatting of numbers (an ostringstream built in this extension) crashed on a machine
  // whose libstdc++ differs from torch's.
  char message[160];
  for (int64_t b = 0; b < num_reqs; ++b) {
    const int64_t len = lens[b];
    if (len <= 0 || (len + block_size - 1) / block_size > max_blocks) {
      std::snprintf(message, sizeof(message), "request %lld: seq_len %lld does not fit its "
                    "block table", static_cast<long long>(b), static_cast<long long>(len));
      TORCH_CHECK(false, static_cast<const char*>(message));
    }
    for (int64_t i = 0; i < (len + block_size - 1) / block_size; ++i) {
      const int32_t id = tables[b * max_blocks + i];
      if (id < 0 || id >= num_blocks) {
        std::snprintf(message, sizeof(message), "request %lld: block id %d outside the "
                      "cache's %lld blocks", static_cast<long long>(b), id,
                      static_cast<long long>(num_blocks));
        TORCH_CHECK(false, static_cast<const char*>(message));
      }
    }
  }
  at::parallel_for(0, num_reqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), inv_sum(group), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / num_kv_heads, h = task % num_kv_heads;
      const int64_t len = lens[b];
      const int32_t* table = tables + b * max_blocks;
      auto offset = [&](int64_t l) {  // key l's row of this KV head, in the cache
        const int64_t slot = static_cast<int64_t>(table[l / block_size]) * block_size + l % block_size;
        return slot * row_stride + h * head_dim;
      };
      const int64_t q_off = (b * num_heads + h * group) * head_dim;
      for (int64_t i = 0; i < group * head_dim; ++i) qf[i] = to_float(qp[q_off + i]) * scale;
      scores.assign(group * len, 0.f);
      for (int64_t l = 0; l < len; ++l) {
        const T* k = kp + offset(l);
        dots(qf.data(), k, head_dim, group, &scores[l], len);
      }
      for (int64_t g = 0; g < group; ++g) {
        inv_sum[g] = 1.f / softmax_numerators(&scores[g * len], len);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t l = 0; l < len; ++l) {
        const T* v = vp + offset(l);
        axpys(&scores[l], len, v, head_dim, group, acc.data());
      }
      for (int64_t g = 0; g < group; ++g) {
        for (int64_t i = 0; i < head_dim; ++i) {
          op[q_off + g * head_dim + i] = static_cast<T>(acc[g * head_dim + i] * inv_sum[g]);
        }
      }
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "q [B, H, D], k_cache and v_cache [num_blocks, block_size, KVH, D]");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "CPU tensors only");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q and the cache must share a dtype");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "q and the cache must be contiguous");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0,
              "head_dim must match and num_heads be a multiple of num_kv_heads");
  TORCH_CHECK(q.size(1) / k_cache.size(2) <= kMaxGroup,
              "at most 16 query heads per KV head");  // kMaxGroup
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  block_tables.is_contiguous() && seq_lens.is_contiguous(),
              "block_tables and seq_lens must be contiguous int32");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0) &&
                  seq_lens.numel() == q.size(0),
              "one block table and one length per request");
  at::Tensor out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode<scalar_t>(q, k_cache, v_cache, block_tables, seq_lens, static_cast<float>(scale), out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(pdserve_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor seq_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
