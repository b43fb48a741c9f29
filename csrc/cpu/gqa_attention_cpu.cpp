// C++ CPU kernel of grouped-query attention for steps that feed a few new tokens per row over a long
// cache (decode steps, verification blocks, the search labeler's guessed steps).
//
// One task per (row, key/value head): the G query heads that share a key/value head and the T new
// tokens form M = G * T queries, so each cached key and value is read once per task (SDPA's CPU kernels
// read them once per query head, with only T queries each). Scores, softmax and the weighted sum of
// values are fp32 whatever the input dtype; column tiles that no query of the task may see (left
// padding, rejected draft tokens) are skipped. A query that may see no column gets zeros.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "pad/verify_math.h"

namespace {

// Eight fp32 lanes (one AVX2 register, half an AVX-512 one): lanes hold queries. Eight rather than
// sixteen because M = G * T is small (18 for six query heads a group and 3 tokens) and a CPU that
// splits 512-bit operations in two (AMD Zen 4) computes as many lanes a cycle either way.
typedef float v8 __attribute__((vector_size(32)));
constexpr int64_t kLanes = 8;
constexpr int64_t kTile = 32;   // cache columns converted to fp32 at a time (16 KiB of keys at D = 128)
constexpr int kBlock = 3;       // query vectors a micro-kernel keeps in registers (x 4 columns or dims)
constexpr int64_t kMaxM = 512;  // queries per key/value head (G * T) this kernel takes; more go to SDPA

inline v8 load(const float* p) { v8 x; std::memcpy(&x, p, sizeof x); return x; }
inline void store(float* p, v8 x) { std::memcpy(p, &x, sizeof x); }

void check(bool ok, const char* msg) { TORCH_CHECK(ok, "pad_kernels cpu gqa_attention: ", msg); }

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
template <>
inline void to_float<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t w = static_cast<uint32_t>(bits[i]) << 16;  // bf16 is the top half of an fp32
    float f;
    std::memcpy(&f, &w, sizeof f);
    dst[i] = f;
  }
}

// n cache rows of D elements, ``stride`` apart, as fp32 rows of ``dst`` [n4][D]; rows n..n4 are zeros.
template <typename T>
inline void load_tile(const T* src, int64_t stride, int64_t n, int64_t n4, int64_t D, float* dst) {
  for (int64_t s = 0; s < n; ++s) to_float(src + s * stride, dst + s * D, D);
  std::fill(dst + n * D, dst + n4 * D, 0.0f);
}

// acc[c][i] += sum_x a[x][lanes i] * b[c * b_row + x * b_x] for c < 4: the micro-kernel of both products.
// a: [X][Mp] (queries in lanes, from lane offset 0), b: 4 rows of X scalars.
// Scores: a = scaled queries [D][Mp], b = key rows of 4 columns; values: a = weights [n][Mp], b = the
// values of 4 dims over the tile's columns (row stride 1 element, column stride D).
template <int NV>
inline void micro(const float* a, int64_t Mp, const float* b, int64_t b_row, int64_t b_x, int64_t X, v8 (&acc)[4][kBlock]) {
  for (int64_t x = 0; x < X; ++x) {
    v8 q[NV];
    for (int i = 0; i < NV; ++i) q[i] = load(a + x * Mp + i * kLanes);
    for (int c = 0; c < 4; ++c) {
      const float w = b[c * b_row + x * b_x];
      for (int i = 0; i < NV; ++i) acc[c][i] += q[i] * w;
    }
  }
}

template <int NV>
void scores_tile(const float* qt, int64_t Mp, const float* kf, int64_t D, int64_t n, float* sc) {
  // sc [n][Mp] (columns of the tile; n a multiple of 4, kf padded with zero rows)
  for (int64_t s = 0; s < n; s += 4) {
    v8 acc[4][kBlock] = {};
    micro<NV>(qt, Mp, kf + s * D, D, 1, D, acc);
    for (int c = 0; c < 4; ++c)
      for (int i = 0; i < NV; ++i) store(sc + (s + c) * Mp + i * kLanes, acc[c][i]);
  }
}

template <int NV>
void values_tile(const float* p, int64_t Mp, const float* vf, int64_t D, int64_t n, float* acc_t) {
  // acc_t [D][Mp] += sum over the tile's n columns of p[s][m] * vf[s][d] (D a multiple of 4)
  for (int64_t d = 0; d < D; d += 4) {
    v8 acc[4][kBlock];
    for (int c = 0; c < 4; ++c)
      for (int i = 0; i < NV; ++i) acc[c][i] = load(acc_t + (d + c) * Mp + i * kLanes);
    micro<NV>(p, Mp, vf + d, 1, D, n, acc);
    for (int c = 0; c < 4; ++c)
      for (int i = 0; i < NV; ++i) store(acc_t + (d + c) * Mp + i * kLanes, acc[c][i]);
  }
}

// Over the query vectors [0, nv) in blocks of kBlock, the last one narrower.
template <typename T>
void attend(const T* q, const T* k, const T* v, const bool* mask, T* out, int64_t B, int64_t Hq, int64_t Hkv,
            int64_t Tn, int64_t S, int64_t D, const int64_t* qs, const int64_t* ks, const int64_t* vs,
            const int64_t* ms, float scale) {
  const int64_t G = Hq / Hkv, M = G * Tn, nv = (M + kLanes - 1) / kLanes, Mp = nv * kLanes;
  const int64_t tiles = (S + kTile - 1) / kTile;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    // Queries in lanes: qt [D][Mp] scaled queries, sc [S'][Mp] scores then weights, acc_t [D][Mp].
    std::vector<float> qt(D * Mp), sc(tiles * kTile * Mp), acc_t(D * Mp), tile(kTile * D);
    std::vector<char> live(tiles);
    std::vector<float> mx(Mp), total(Mp);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, g = task % Hkv;
      std::fill(qt.begin(), qt.end(), 0.0f);
      // Query m = j * T + t is head g * G + j at new token t.
      for (int64_t j = 0; j < G; ++j)
        for (int64_t t = 0; t < Tn; ++t) {
          const T* src = q + b * qs[0] + (g * G + j) * qs[1] + t * qs[2];
          for (int64_t d = 0; d < D; ++d) qt[d * Mp + j * Tn + t] = static_cast<float>(src[d]) * scale;
        }
      const T* kb = k + b * ks[0] + g * ks[1];
      const T* vb = v + b * vs[0] + g * vs[1];
      const bool* mb = mask + b * ms[0];
      // 1. Scores of the live tiles (a column some query of the task may see); -inf where masked.
      for (int64_t tl = 0; tl < tiles; ++tl) {
        const int64_t s0 = tl * kTile, n = std::min(kTile, S - s0), n4 = (n + 3) / 4 * 4;
        bool any = false;
        for (int64_t t = 0; t < Tn && !any; ++t)
          for (int64_t s = 0; s < n; ++s) any |= mb[t * ms[1] + (s0 + s) * ms[2]];
        live[tl] = any;
        float* st = sc.data() + s0 * Mp;
        if (!any) continue;
        load_tile(kb + s0 * ks[2], ks[2], n, n4, D, tile.data());
        for (int64_t i = 0; i < nv; i += kBlock) {
          const float* a = qt.data() + i * kLanes;
          float* o = st + i * kLanes;
          switch (std::min<int64_t>(kBlock, nv - i)) {
            case 3: scores_tile<3>(a, Mp, tile.data(), D, n4, o); break;
            case 2: scores_tile<2>(a, Mp, tile.data(), D, n4, o); break;
            default: scores_tile<1>(a, Mp, tile.data(), D, n4, o); break;
          }
        }
        for (int64_t s = 0; s < n; ++s)
          for (int64_t t = 0; t < Tn; ++t)
            if (!mb[t * ms[1] + (s0 + s) * ms[2]])
              for (int64_t j = 0; j < G; ++j) st[s * Mp + j * Tn + t] = -INFINITY;
      }
      // 2. Softmax over the live columns, queries in lanes: the weights replace the scores.
      std::fill(mx.begin(), mx.end(), -INFINITY);
      std::fill(total.begin(), total.end(), 0.0f);
      for (int64_t tl = 0; tl < tiles; ++tl) {
        if (!live[tl]) continue;
        const int64_t s0 = tl * kTile, n = std::min(kTile, S - s0);
        for (int64_t s = s0; s < s0 + n; ++s) {
          const float* row = sc.data() + s * Mp;
#pragma omp simd
          for (int64_t m = 0; m < Mp; ++m) mx[m] = row[m] > mx[m] ? row[m] : mx[m];
        }
      }
      for (int64_t m = 0; m < Mp; ++m) mx[m] = mx[m] == -INFINITY ? 0.0f : mx[m];  // sees nothing: weights 0
      for (int64_t tl = 0; tl < tiles; ++tl) {
        if (!live[tl]) continue;
        const int64_t s0 = tl * kTile, n = std::min(kTile, S - s0), n4 = (n + 3) / 4 * 4;
        for (int64_t s = s0; s < s0 + n4; ++s) {
          float* row = sc.data() + s * Mp;
          if (s >= s0 + n) {  // padding columns of the last tile weigh nothing
            std::fill_n(row, Mp, 0.0f);
            continue;
          }
#pragma omp simd
          for (int64_t m = 0; m < Mp; ++m) {
            const float e = pad::exp_nonpositive(row[m] - mx[m]);
            row[m] = e;
            total[m] += e;
          }
        }
      }
      // 3. Weighted sum of the values of the live tiles.
      std::fill(acc_t.begin(), acc_t.end(), 0.0f);
      for (int64_t tl = 0; tl < tiles; ++tl) {
        if (!live[tl]) continue;
        const int64_t s0 = tl * kTile, n = std::min(kTile, S - s0), n4 = (n + 3) / 4 * 4;
        load_tile(vb + s0 * vs[2], vs[2], n, n4, D, tile.data());
        const float* p = sc.data() + s0 * Mp;
        for (int64_t i = 0; i < nv; i += kBlock) {
          float* o = acc_t.data() + i * kLanes;
          switch (std::min<int64_t>(kBlock, nv - i)) {
            case 3: values_tile<3>(p + i * kLanes, Mp, tile.data(), D, n4, o); break;
            case 2: values_tile<2>(p + i * kLanes, Mp, tile.data(), D, n4, o); break;
            default: values_tile<1>(p + i * kLanes, Mp, tile.data(), D, n4, o); break;
          }
        }
      }
      // 4. Normalize into out [B, T, Hq, D].
      for (int64_t j = 0; j < G; ++j)
        for (int64_t t = 0; t < Tn; ++t) {
          const int64_t m = j * Tn + t;
          const float inv = total[m] > 0.0f ? 1.0f / total[m] : 0.0f;
          T* dst = out + ((b * Tn + t) * Hq + g * G + j) * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(acc_t[d * Mp + m] * inv);
        }
    }
  });
}

}  // namespace

// query [B, Hq, T, D] (any strides, last dim contiguous), key/value [B, Hkv, S, D] (likewise), mask
// [B, 1 or Hq... , T, S] bool with True where a query may attend (its head dim must broadcast: size 1),
// out [B, T, Hq, D] contiguous, the layout transformers' attention functions return.
void gqa_attention_out(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                       const at::Tensor& mask, double scale, at::Tensor& out) {
  check(query.dim() == 4 && key.dim() == 4 && value.dim() == 4, "query, key and value must be 4-D");
  check(query.device().is_cpu() && key.device().is_cpu() && value.device().is_cpu() && mask.device().is_cpu(),
        "tensors must be on the CPU");
  const int64_t B = query.size(0), Hq = query.size(1), Tn = query.size(2), D = query.size(3);
  const int64_t Hkv = key.size(1), S = key.size(2);
  check(key.sizes() == value.sizes() && key.size(0) == B && key.size(3) == D, "key and value must be [B, Hkv, S, D]");
  check(Hkv > 0 && Hq % Hkv == 0, "query heads must be a multiple of key/value heads");
  check(D % 4 == 0 && Hq / Hkv * Tn <= kMaxM, "the head dim must be a multiple of 4 and G * T at most 512");
  check(query.scalar_type() == key.scalar_type() && key.scalar_type() == value.scalar_type() &&
            out.scalar_type() == query.scalar_type(), "query, key, value and out must share one dtype");
  check(query.stride(3) == 1 && key.stride(3) == 1 && value.stride(3) == 1, "the head dim must be contiguous");
  check(mask.scalar_type() == at::kBool && mask.dim() == 4 && mask.size(0) == B && mask.size(1) == 1 &&
            mask.size(2) == Tn && mask.size(3) == S, "mask must be bool [B, 1, T, S]");
  check(out.is_contiguous() && out.sizes() == at::IntArrayRef({B, Tn, Hq, D}), "out must be contiguous [B, T, Hq, D]");
  const int64_t qs[3] = {query.stride(0), query.stride(1), query.stride(2)};
  const int64_t ks[3] = {key.stride(0), key.stride(1), key.stride(2)};
  const int64_t vs[3] = {value.stride(0), value.stride(1), value.stride(2)};
  const int64_t ms[3] = {mask.stride(0), mask.stride(2), mask.stride(3)};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "gqa_attention_cpu", [&] {
    attend<scalar_t>(query.data_ptr<scalar_t>(), key.data_ptr<scalar_t>(), value.data_ptr<scalar_t>(),
                     mask.data_ptr<bool>(), out.data_ptr<scalar_t>(), B, Hq, Hkv, Tn, S, D, qs, ks, vs, ms,
                     static_cast<float>(scale));
  });
}
