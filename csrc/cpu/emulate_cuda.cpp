// The CUDA backend's three kernels (csrc/cuda/verify_block.cu) run on the CPU, one simulated thread block
// at a time: the same per-thread functions of pad/verify_math.h, the same slices, the same reduction
// trees, so the tests can hold the GPU's arithmetic and its reduction orders to the reference without a
// GPU. Slow (it is a test tool), and it stands beside the kernels: a change to one is a change to both.
#include <torch/extension.h>

#include <vector>

#include "pad/verify_math.h"

namespace {

template <typename T>
struct ScaledLogits {  // as verify_block.cu's
  const T* x;
  float temperature;
  float operator()(int64_t v) const {
    const float f = static_cast<float>(x[v]);
    return temperature > 0.0f ? f / temperature : f;
  }
};

// block_reduce of verify_block.cu: thread t takes t + stride for stride = threads / 2, ..., 1.
template <typename V, typename Merge>
V tree(std::vector<V> lanes, Merge merge) {
  for (size_t stride = lanes.size() / 2; stride > 0; stride /= 2)
    for (size_t t = 0; t < stride; ++t) lanes[t] = merge(lanes[t], lanes[t + stride]);
  return lanes[0];
}

pad::RowStats merge_stats(const pad::RowStats& a, const pad::RowStats& b) { return pad::row_merge(a, b); }
pad::Race merge_races(const pad::Race& a, const pad::Race& b) { return pad::race_merge(a, b); }

template <typename T, typename H>
void emulate(const T* logits, const int64_t* drafts, const H* hidden, const float* w1, const float* b1,
             const float* w2, float b2, const float* clf_bias, const float* draft_probs, const float* uniforms,
             const float* exponentials,
             float* entropy, float* top3_entropy, int64_t* argmax, float* token_prob, float* pivot_prob,
             bool* accepted, bool* pivot_accepted, int64_t* num_accepted, int64_t* next_token, int64_t B,
             int64_t K, int64_t V, int64_t Hdim, int64_t D, float sigma, float floor_, float temperature,
             pad::Rule rule, const int64_t* num_drafts, const T* draft_logits, float* divergence,
             const float* row_rules, const int64_t* logit_rows, int64_t splits, int64_t split_len,
             int64_t race_splits, int64_t race_len, int64_t threads) {
  const int64_t K1 = K + 1;
  const bool has_clf = w1 != nullptr, sampling = temperature > 0.0f;
  std::vector<pad::RowStats> parts(B * K1 * splits), lanes(threads);
  std::vector<pad::RowStats> stats(B * K1);

  // Kernel 1: grid (position, slice).
  for (int64_t pos = 0; pos < B * K1; ++pos) {
    const int64_t b = pos / K1, i = pos % K1, row = pad::logit_row(logit_rows, b, i, K);
    if (row < 0) {
      for (int64_t sp = 0; sp < splits; ++sp) parts[pos * splits + sp] = pad::row_empty();
      continue;
    }
    const ScaledLogits<T> x{logits + row * V, temperature};
    const int64_t d = i < K ? drafts[b * K + i] : -1;
    const bool ranked = pad::row_rule(row_rules, b, rule, 0.0f, false).rule.kind == pad::kRuleTopk && pad::in_vocab(d, V);
    const bool has_draft = i < K && draft_logits != nullptr;
    const ScaledLogits<T> y{has_draft ? draft_logits + (b * K + i) * V : nullptr, temperature};
    for (int64_t sp = 0; sp < splits; ++sp) {
      for (int64_t t = 0; t < threads; ++t)
        lanes[t] = pad::thread_row_stats(x, y, has_draft, ranked ? d : -1, ranked ? x(d) : 0.0f,
                                         pad::vocab_slice(sp, split_len, V), t, threads);
      parts[pos * splits + sp] = tree(lanes, merge_stats);
    }
  }

  // Kernel 2: one block per row.
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < K1; ++i) {
      const int64_t pos = b * K1 + i, row = pad::logit_row(logit_rows, b, i, K);
      for (int64_t t = 0; t < threads; ++t) lanes[t] = pad::thread_slice_stats(&parts[pos * splits], splits, t, threads);
      const pad::RowStats s = stats[pos] = tree(lanes, merge_stats);
      if (row < 0) {
        entropy[pos] = top3_entropy[pos] = NAN;
        argmax[pos] = -1;
        if (i < K) {
          token_prob[b * K + i] = NAN;
          divergence[b * K + i] = -1.0f;
        }
        continue;
      }
      entropy[pos] = pad::row_entropy(s);
      top3_entropy[pos] = pad::row_top3_entropy(s);
      argmax[pos] = s.argmax;
      if (i < K) {
        const int64_t d = drafts[b * K + i];
        token_prob[b * K + i] = pad::in_vocab(d, V) ? pad::row_prob(s, ScaledLogits<T>{logits + row * V, temperature}(d)) : NAN;
        divergence[b * K + i] = draft_logits != nullptr ? pad::row_divergence(s) : -1.0f;
      }
    }
    for (int64_t i0 = 0; i0 < K; i0 += pad::kTile) {
      const int np = K - i0 < pad::kTile ? static_cast<int>(K - i0) : pad::kTile;
      if (!has_clf) {
        for (int p = 0; p < np; ++p) pivot_prob[b * K + i0 + p] = 1.0f;
        continue;
      }
      std::vector<std::vector<float>> part(threads, std::vector<float>(pad::kTile, 0.0f));
      float h[pad::kTile][pad::kHChunk];
      for (int64_t j0 = 0; j0 < D; j0 += threads)
        for (int64_t t = 0; t < threads; ++t) {
          const int64_t j = j0 + t;
          if (j >= D) continue;
          float acc[pad::kTile];
          pad::clf_unit_begin(acc, b1, clf_bias != nullptr ? clf_bias + (b * K + i0) * D : nullptr, np, D, j);
          for (int64_t k0 = 0; k0 < Hdim; k0 += pad::kHChunk) {
            const int nk = Hdim - k0 < pad::kHChunk ? static_cast<int>(Hdim - k0) : pad::kHChunk;
            for (int p = 0; p < pad::kTile; ++p)
              for (int k = 0; k < pad::kHChunk; ++k)
                h[p][k] = p < np && k < nk ? static_cast<float>(hidden[(b * K1 + i0 + p) * Hdim + k0 + k]) : 0.0f;
            pad::clf_unit_chunk(acc, h, nk, w1 + k0 * D, D, j);
          }
          pad::clf_unit_end(part[t].data(), acc, np, token_prob + b * K + i0, entropy + b * K1 + i0, w1 + Hdim * D,
                            w2, D, j);
        }
      for (int p = 0; p < np; ++p) {
        std::vector<float> sums(threads);
        for (int64_t t = 0; t < threads; ++t) sums[t] = part[t][p];
        pivot_prob[b * K + i0 + p] = pad::sigmoid(tree(sums, [](float x, float y) { return x + y; }) + b2);
      }
    }
    for (int64_t i = 0; i < K; ++i)
      if (pad::logit_row(logit_rows, b, i, K) < 0) pivot_prob[b * K + i] = NAN;
    const pad::RowRule rr = pad::row_rule(row_rules, b, rule, sigma, sampling);
    const int64_t n = pad::accept_row(b, K, V, drafts, argmax, token_prob, pivot_prob, draft_probs, logit_rows,
                                      uniforms, has_clf, rr, floor_, entropy, top3_entropy, stats.data(), divergence,
                                      pad::row_drafts(num_drafts, b, K), accepted, pivot_accepted);
    num_accepted[b] = n;
    const int64_t row = pad::logit_row(logit_rows, b, n, K);
    if (row < 0 || !rr.sampled) next_token[b] = row < 0 ? -1 : argmax[b * K1 + n];
  }
  if (!sampling) return;

  // Kernel 3: grid (row, slice); the row's last block merges its slices' races.
  std::vector<pad::Race> race_lanes(threads), race_parts(race_splits);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = num_accepted[b], pos = b * K1 + n, row = pad::logit_row(logit_rows, b, n, K);
    if (row < 0 || (row_rules != nullptr && row_rules[b * 6 + 5] == 0.0f)) continue;  // as draw_kernel
    const pad::RowStats& s = stats[pos];
    const int64_t q_row = logit_rows == nullptr ? b * K + n : row;
    const float* q = n < pad::row_drafts(num_drafts, b, K) ? draft_probs + q_row * V : nullptr;
    for (int64_t sp = 0; sp < race_splits; ++sp) {
      for (int64_t t = 0; t < threads; ++t)
        race_lanes[t] = pad::thread_race(s, ScaledLogits<T>{logits + row * V, temperature}, q, exponentials + b * V,
                                         pad::vocab_slice(sp, race_len, V), t, threads);
      race_parts[sp] = tree(race_lanes, merge_races);
    }
    for (int64_t t = 0; t < threads; ++t) race_lanes[t] = pad::thread_slice_races(race_parts.data(), race_splits, t, threads);
    next_token[b] = pad::race_winner(tree(race_lanes, merge_races));
  }
}

}  // namespace

// Same arguments as the CUDA binding's verify_block_out (CPU tensors, fp32 classifier and draws), plus the
// simulated block size `threads` (a power of 2).
void emulate_cuda_verify(const at::Tensor& logits, const at::Tensor& draft_tokens,
                         const c10::optional<at::Tensor>& hidden, const c10::optional<at::Tensor>& w1,
                         const c10::optional<at::Tensor>& b1, const c10::optional<at::Tensor>& w2,
                         const c10::optional<at::Tensor>& b2, const c10::optional<at::Tensor>& clf_bias,
                         double sigma, double floor_, double temperature,
                         const c10::optional<at::Tensor>& draft_probs, const c10::optional<at::Tensor>& uniforms,
                         const c10::optional<at::Tensor>& exponentials, int64_t rule, double rule_a, double rule_b,
                         const c10::optional<at::Tensor>& num_drafts, const c10::optional<at::Tensor>& draft_logits,
                         const c10::optional<at::Tensor>& row_rules, const c10::optional<at::Tensor>& logit_rows,
                         at::Tensor& entropy, at::Tensor& token_prob, at::Tensor& argmax, at::Tensor& pivot_prob,
                         at::Tensor& accepted, at::Tensor& pivot_accepted, at::Tensor& num_accepted,
                         at::Tensor& next_token, at::Tensor& top3_entropy, at::Tensor& divergence, int64_t splits,
                         int64_t split_len, int64_t race_splits, int64_t race_split_len, int64_t threads) {
  const bool by_rows = logit_rows.has_value();
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == (by_rows ? 2 : 3) && logits.is_contiguous(),
              "logits must be contiguous [B, K+1, V] (or [R, V] with logit_rows)");
  const int64_t B = draft_tokens.size(0), K = draft_tokens.size(1), V = logits.size(-1);
  TORCH_CHECK(!by_rows || (logit_rows->scalar_type() == at::kLong && logit_rows->is_contiguous() &&
                           logit_rows->numel() == B * (K + 1)), "logit_rows must be contiguous int64 [B, K+1]");
  TORCH_CHECK(!row_rules.has_value() || (row_rules->scalar_type() == at::kFloat && row_rules->is_contiguous() &&
                                         row_rules->numel() == B * 6), "row_rules must be contiguous fp32 [B, 6]");
  for (const auto& [S, len] : {std::pair{splits, split_len}, std::pair{race_splits, race_split_len}})
    TORCH_CHECK(S >= 1 && len >= 1 && S * len >= V && (S - 1) * len < V, "the vocabulary must be cut into non-empty slices");
  TORCH_CHECK(threads > 0 && (threads & (threads - 1)) == 0, "threads must be a power of 2");
  const bool has_clf = w1.has_value();
  TORCH_CHECK(!has_clf || (hidden.has_value() && hidden->is_contiguous()), "a classifier needs contiguous hidden");
  TORCH_CHECK(!clf_bias.has_value() || (has_clf && clf_bias->scalar_type() == at::kFloat &&
                                        clf_bias->is_contiguous() && clf_bias->numel() == B * K * w1->size(1)),
              "classifier_bias needs a classifier and must be contiguous fp32 [B, K, D]");
  TORCH_CHECK(!draft_logits.has_value() || (draft_logits->scalar_type() == logits.scalar_type() &&
                                            draft_logits->is_contiguous() && draft_logits->numel() == B * K * V),
              "draft_logits must be contiguous [B, K, V] of the logits' dtype");
  auto ptr = [](const c10::optional<at::Tensor>& t) { return t.has_value() ? t->data_ptr<float>() : nullptr; };
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "pad_emulate_logits", [&] {
    using logit_t = scalar_t;
    const auto run = [&](auto* hidden_ptr) {
      emulate(logits.data_ptr<logit_t>(), draft_tokens.data_ptr<int64_t>(), hidden_ptr, ptr(w1), ptr(b1), ptr(w2),
              has_clf ? b2->item<float>() : 0.0f, ptr(clf_bias), ptr(draft_probs), ptr(uniforms), ptr(exponentials),
              entropy.data_ptr<float>(), top3_entropy.data_ptr<float>(), argmax.data_ptr<int64_t>(),
              token_prob.data_ptr<float>(), pivot_prob.data_ptr<float>(), accepted.data_ptr<bool>(),
              pivot_accepted.data_ptr<bool>(), num_accepted.data_ptr<int64_t>(), next_token.data_ptr<int64_t>(), B, K,
              V, has_clf ? hidden->size(2) : 0, has_clf ? w1->size(1) : 1, (float)sigma, (float)floor_,
              (float)temperature, pad::Rule{(int)rule, (float)rule_a, (float)rule_b},
              num_drafts.has_value() ? num_drafts->data_ptr<int64_t>() : nullptr,
              draft_logits.has_value() ? draft_logits->data_ptr<logit_t>() : nullptr, divergence.data_ptr<float>(),
              row_rules.has_value() ? row_rules->data_ptr<float>() : nullptr,
              by_rows ? logit_rows->data_ptr<int64_t>() : nullptr, splits, split_len, race_splits, race_split_len,
              threads);
    };
    if (!has_clf) {
      run(static_cast<const float*>(nullptr));
    } else {
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, hidden->scalar_type(), "pad_emulate_hidden",
                                      [&] { run(hidden->data_ptr<scalar_t>()); });
    }
  });
}
