// C++ CPU backend of pad_kernels.verify_block: threads over positions, then over rows; the vocabulary
// is read once per position in L1-sized chunks (chunk max, then vectorized exp sums: an online softmax
// at chunk granularity). The arithmetic is pad/verify_math.h, shared with the CUDA kernel.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "pad/verify_math.h"

namespace {

constexpr int64_t kChunk = 2048;  // floats per chunk: 8 KiB, stays in L1 between the two sweeps
constexpr int kFeatures = 2;      // p_target(draft token), entropy

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

// Online softmax over one position's logits [V]; temperature 0 means unscaled.
template <typename T>
pad::RowStats position_stats(const T* x, int64_t V, float temperature) {
  alignas(64) float buf[kChunk];
  pad::RowStats s = pad::row_empty();
  for (int64_t c0 = 0; c0 < V; c0 += kChunk) {
    const int64_t n = std::min(kChunk, V - c0);
    float cmax = -INFINITY;  // NaN is skipped here; it surfaces through the sums below
    if (temperature > 0.0f) {
#pragma omp simd reduction(max : cmax)
      for (int64_t i = 0; i < n; ++i) {
        buf[i] = to_float(x[c0 + i]) / temperature;  // a division, as the reference, not * (1 / T)
        cmax = buf[i] > cmax ? buf[i] : cmax;
      }
    } else {
#pragma omp simd reduction(max : cmax)
      for (int64_t i = 0; i < n; ++i) {
        buf[i] = to_float(x[c0 + i]);
        cmax = buf[i] > cmax ? buf[i] : cmax;
      }
    }
    // The three largest: a chunk whose max is not above the third so far holds none of them (most chunks).
    if (cmax > s.third) {
      float top0 = s.max;
      for (int64_t i = 0; i < n; ++i) pad::top3_push(top0, s.second, s.third, buf[i]);
    }
    if (cmax > s.max) {
      pad::row_rescale(s, cmax);
      s.argmax = c0 + (std::find(buf, buf + n, cmax) - buf);
    } else if (s.argmax < 0) {
      s.argmax = c0;  // only -inf (or NaN) so far: torch's argmax also answers the first index
    }
    const float m = s.max;
    double cs = 0.0, cx = 0.0;  // fp64 accumulators: fp32 lanes of 256 terms lose ~1e-6 relative
#pragma omp simd reduction(+ : cs, cx)
    for (int64_t i = 0; i < n; ++i) {
      const float v = buf[i];
      const bool none = v == -INFINITY;
      const float e = pad::exp_nonpositive(none ? -INFINITY : v - m);  // select the argument, not the call
      cs += e;
      cx += none ? 0.0f : e * (v - m);
    }
    s.sum += cs;
    s.sum_dexp += static_cast<float>(cx);
  }
  return s;
}

template <typename T>
float scaled(const T* x, int64_t v, float temperature) {
  const float f = to_float(x[v]);
  return temperature > 0.0f ? f / temperature : f;
}

template <typename T, typename H>
void verify_kernel(const T* logits, const int64_t* drafts, const H* hidden, const float* w1, const float* b1,
                   const float* w2, float b2, int64_t Hdim, int64_t D, float sigma, float floor_, float temperature,
                   const float* draft_probs, const float* uniforms, const float* exponentials, pad::Rule rule,
                   const int64_t* num_drafts, int64_t B, int64_t K, int64_t V, float* entropy, float* token_prob, int64_t* argmax,
                   float* pivot_prob, bool* accepted, bool* pivot_accepted, int64_t* num_accepted,
                   int64_t* next_token, float* top3_entropy) {
  const int64_t K1 = K + 1;
  std::vector<pad::RowStats> stats(B * K1);
  const bool has_clf = w1 != nullptr;

  // 1. Per position: softmax statistics, entropy, argmax, p(d), pivot probability.
  at::parallel_for(0, B * K1, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(D);
    for (int64_t pos = begin; pos < end; ++pos) {
      const int64_t b = pos / K1, i = pos % K1;
      const T* x = logits + pos * V;
      const pad::RowStats s = position_stats(x, V, temperature);
      stats[pos] = s;
      entropy[pos] = pad::row_entropy(s);
      top3_entropy[pos] = pad::row_top3_entropy(s);
      argmax[pos] = s.argmax;
      if (i == K) continue;
      const int64_t d = drafts[b * K + i];
      const float p = pad::in_vocab(d, V) ? pad::row_prob(s, scaled(x, d, temperature)) : NAN;
      token_prob[b * K + i] = p;
      if (has_clf) {
        const float f[kFeatures] = {p, entropy[pos]};
        const H* h = hidden + pos * Hdim;
        pivot_prob[b * K + i] = pad::pivot_prob([h](int64_t j) { return to_float(h[j]); }, Hdim, f, kFeatures, w1,
                                                b1, w2, b2, D, acc.data());
      } else {
        pivot_prob[b * K + i] = 1.0f;
      }
    }
  });

  // 2. Per row: the accepted prefix, then the correction or bonus token.
  const bool sampling = temperature > 0.0f;
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t k_row = pad::row_drafts(num_drafts, b, K);
      const int64_t n = pad::accept_row(b, K, V, drafts, argmax, token_prob, pivot_prob, draft_probs, uniforms,
                                        sampling, has_clf, sigma, floor_, rule, entropy, top3_entropy, k_row,
                                        accepted, pivot_accepted);
      num_accepted[b] = n;
      if (!sampling) {
        next_token[b] = argmax[b * K1 + n];
        continue;
      }
      const pad::RowStats& s = stats[b * K1 + n];
      const T* x = logits + (b * K1 + n) * V;
      const float* q = n < k_row ? draft_probs + (b * K + n) * V : nullptr;  // past the drafts q is 0: bonus
      const float* e = exponentials + b * V;
      pad::Race race = pad::race_empty();
      for (int64_t v = 0; v < V; ++v)
        pad::race_push(race, pad::row_prob(s, scaled(x, v, temperature)), q ? q[v] : 0.0f, e[v], v);
      next_token[b] = pad::race_winner(race);
    }
  });
}

void check(bool ok, const char* msg) { TORCH_CHECK(ok, "pad_kernels cpu verify_block: ", msg); }

void verify_block_cpu_out(const at::Tensor& logits, const at::Tensor& draft_tokens,
                          const c10::optional<at::Tensor>& hidden, const c10::optional<at::Tensor>& w1,
                          const c10::optional<at::Tensor>& b1, const c10::optional<at::Tensor>& w2,
                          const c10::optional<at::Tensor>& b2, double sigma, double floor_, double temperature,
                          const c10::optional<at::Tensor>& draft_probs, const c10::optional<at::Tensor>& uniforms,
                          const c10::optional<at::Tensor>& exponentials, int64_t rule, double rule_a, double rule_b,
                          const c10::optional<at::Tensor>& num_drafts, at::Tensor& entropy, at::Tensor& token_prob, at::Tensor& argmax, at::Tensor& pivot_prob,
                          at::Tensor& accepted, at::Tensor& pivot_accepted, at::Tensor& num_accepted,
                          at::Tensor& next_token, at::Tensor& top3_entropy) {
  check(logits.device().is_cpu() && logits.dim() == 3 && logits.is_contiguous(), "logits must be contiguous [B, K+1, V] on the CPU");
  const int64_t B = logits.size(0), K = logits.size(1) - 1, V = logits.size(2);
  check(draft_tokens.scalar_type() == at::kLong && draft_tokens.is_contiguous() && draft_tokens.size(0) == B &&
            draft_tokens.size(1) == K, "draft_tokens must be contiguous int64 [B, K]");
  const bool has_clf = w1.has_value();
  int64_t Hdim = 0, D = 1;
  if (has_clf) {
    check(hidden.has_value() && hidden->is_contiguous() && hidden->dim() == 3, "hidden must be contiguous [B, K+1, H]");
    Hdim = hidden->size(2);
    D = w1->size(1);
    check(w1->scalar_type() == at::kFloat && w1->is_contiguous() && w1->size(0) == Hdim + kFeatures,
          "w1 must be contiguous fp32 [H+2, D]");
    check(b1->numel() == D && w2->numel() == D && b2->numel() == 1 && b1->scalar_type() == at::kFloat &&
              w2->scalar_type() == at::kFloat && b2->scalar_type() == at::kFloat, "b1, w2 must be fp32 [D], b2 []");
  }
  const bool sampling = temperature > 0.0;
  if (sampling) {
    check(draft_probs.has_value() && uniforms.has_value() && exponentials.has_value(),
          "temperature > 0 needs draft_probs, uniforms and exponentials");
    for (const at::Tensor* t : {&*draft_probs, &*uniforms, &*exponentials})
      check(t->scalar_type() == at::kFloat && t->is_contiguous(), "random draws and draft_probs must be contiguous fp32");
  }
  if (num_drafts.has_value())
    check(num_drafts->scalar_type() == at::kLong && num_drafts->is_contiguous() && num_drafts->numel() == B,
          "num_drafts must be contiguous int64 [B]");
  auto ptr = [](const c10::optional<at::Tensor>& t) { return t.has_value() ? t->data_ptr<float>() : nullptr; };
  const float b2v = has_clf ? b2->item<float>() : 0.0f;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "pad_verify_logits", [&] {
    using logit_t = scalar_t;
    const auto run = [&](auto* hidden_ptr) {
      verify_kernel(logits.data_ptr<logit_t>(), draft_tokens.data_ptr<int64_t>(), hidden_ptr, ptr(w1), ptr(b1),
                    ptr(w2), b2v, Hdim, D, (float)sigma, (float)floor_, (float)temperature, ptr(draft_probs),
                    ptr(uniforms), ptr(exponentials), pad::Rule{(int)rule, (float)rule_a, (float)rule_b},
                    num_drafts.has_value() ? num_drafts->data_ptr<int64_t>() : nullptr, B, K, V,
                    entropy.data_ptr<float>(), token_prob.data_ptr<float>(), argmax.data_ptr<int64_t>(),
                    pivot_prob.data_ptr<float>(), accepted.data_ptr<bool>(), pivot_accepted.data_ptr<bool>(),
                    num_accepted.data_ptr<int64_t>(), next_token.data_ptr<int64_t>(), top3_entropy.data_ptr<float>());
    };
    if (!has_clf) {
      run(static_cast<const float*>(nullptr));
    } else {
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, hidden->scalar_type(), "pad_verify_hidden",
                                      [&] { run(hidden->data_ptr<scalar_t>()); });
    }
  });
}

}  // namespace

// csrc/cpu/emulate_cuda.cpp
void emulate_cuda_verify(const at::Tensor& logits, const at::Tensor& draft_tokens,
                         const c10::optional<at::Tensor>& hidden, const c10::optional<at::Tensor>& w1,
                         const c10::optional<at::Tensor>& b1, const c10::optional<at::Tensor>& w2,
                         const c10::optional<at::Tensor>& b2, double sigma, double floor_, double temperature,
                         const c10::optional<at::Tensor>& draft_probs, const c10::optional<at::Tensor>& uniforms,
                         const c10::optional<at::Tensor>& exponentials, int64_t rule, double rule_a, double rule_b,
                         const c10::optional<at::Tensor>& num_drafts, at::Tensor& entropy, at::Tensor& token_prob,
                         at::Tensor& argmax, at::Tensor& pivot_prob, at::Tensor& accepted, at::Tensor& pivot_accepted,
                         at::Tensor& num_accepted, at::Tensor& next_token, at::Tensor& top3_entropy, int64_t splits,
                         int64_t split_len, int64_t race_splits, int64_t race_split_len, int64_t threads);

// csrc/cpu/gqa_attention_cpu.cpp
void gqa_attention_out(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                       const at::Tensor& mask, double scale, at::Tensor& out);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pad_kernels C++ CPU backend of verify_block, and grouped-query attention for few-token steps";
  m.def("verify_block_out", &verify_block_cpu_out, "Fused verification of one block into preallocated outputs");
  m.def("emulate_cuda_verify", &emulate_cuda_verify, "The CUDA backend's kernels, simulated block by block on the CPU");
  m.def("gqa_attention_out", &gqa_attention_out, "Grouped-query attention of a few new tokens per row");
}
