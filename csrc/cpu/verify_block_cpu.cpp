// C++ CPU backend of pad_kernels.verify_block: threads over positions, then over rows; the vocabulary
// is read once per position in L1-sized chunks (chunk max, then vectorized exp sums: an online softmax
// at chunk granularity). The arithmetic is pad/verify_math.h, shared with the CUDA kernel; the loops
// (verify_block_kernels.inc) are compiled per instruction set and chosen at run time (isa.h).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "pad/verify_math.h"

#include "isa.h"

namespace {

#define PAD_ISA_KERNELS "verify_block_kernels.inc"
#include "isa_variants.inc"
#undef PAD_ISA_KERNELS

void check(bool ok, const char* msg) { TORCH_CHECK(ok, "pad_kernels cpu verify_block: ", msg); }

void verify_block_cpu_out(const at::Tensor& logits, const at::Tensor& draft_tokens,
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
                          at::Tensor& next_token, at::Tensor& top3_entropy, at::Tensor& divergence) {
  const bool by_rows = logit_rows.has_value();
  check(logits.device().is_cpu() && logits.dim() == (by_rows ? 2 : 3) && logits.is_contiguous(),
        "logits must be contiguous [B, K+1, V] (or [R, V] with logit_rows) on the CPU");
  check(draft_tokens.dim() == 2, "draft_tokens must be [B, K]");
  const int64_t B = draft_tokens.size(0), K = draft_tokens.size(1), V = logits.size(-1);
  if (by_rows)
    check(logit_rows->scalar_type() == at::kLong && logit_rows->is_contiguous() && logit_rows->numel() == B * (K + 1),
          "logit_rows must be contiguous int64 [B, K+1]");
  else
    check(logits.size(0) == B && logits.size(1) == K + 1, "logits must be [B, K+1, V]");
  if (row_rules.has_value())
    check(row_rules->scalar_type() == at::kFloat && row_rules->is_contiguous() && row_rules->numel() == B * 6,
          "row_rules must be contiguous fp32 [B, 6]");
  check(draft_tokens.scalar_type() == at::kLong && draft_tokens.is_contiguous() && draft_tokens.size(0) == B &&
            draft_tokens.size(1) == K, "draft_tokens must be contiguous int64 [B, K]");
  const bool has_clf = w1.has_value();
  int64_t Hdim = 0, D = 1;
  if (has_clf) {
    check(hidden.has_value() && hidden->is_contiguous() && hidden->dim() == 3, "hidden must be contiguous [B, K+1, H]");
    Hdim = hidden->size(2);
    D = w1->size(1);
    check(w1->scalar_type() == at::kFloat && w1->is_contiguous() && w1->size(0) == Hdim + baseline::kFeatures,
          "w1 must be contiguous fp32 [H+2, D]");
    check(b1->numel() == D && w2->numel() == D && b2->numel() == 1 && b1->scalar_type() == at::kFloat &&
              w2->scalar_type() == at::kFloat && b2->scalar_type() == at::kFloat, "b1, w2 must be fp32 [D], b2 []");
  }
  if (clf_bias.has_value())
    check(has_clf && clf_bias->scalar_type() == at::kFloat && clf_bias->is_contiguous() &&
              clf_bias->numel() == B * K * D,
          "classifier_bias needs a classifier and must be contiguous fp32 [B, K, D]");
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
  if (draft_logits.has_value())
    check(draft_logits->scalar_type() == logits.scalar_type() && draft_logits->is_contiguous() &&
              draft_logits->numel() == B * K * V, "draft_logits must be contiguous [B, K, V] of the logits' dtype");
  auto ptr = [](const c10::optional<at::Tensor>& t) { return t.has_value() ? t->data_ptr<float>() : nullptr; };
  const float b2v = has_clf ? b2->item<float>() : 0.0f;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "pad_verify_logits", [&] {
    using logit_t = scalar_t;
    const auto run = [&](auto* hidden_ptr) {
      PAD_ISA_CALL(verify_kernel, logits.data_ptr<logit_t>(), draft_tokens.data_ptr<int64_t>(), hidden_ptr, ptr(w1), ptr(b1),
                    ptr(w2), b2v, ptr(clf_bias), Hdim, D, (float)sigma, (float)floor_, (float)temperature,
                    ptr(draft_probs), ptr(uniforms), ptr(exponentials), pad::Rule{(int)rule, (float)rule_a, (float)rule_b},
                    num_drafts.has_value() ? num_drafts->data_ptr<int64_t>() : nullptr,
                    draft_logits.has_value() ? draft_logits->data_ptr<logit_t>() : nullptr,
                    row_rules.has_value() ? row_rules->data_ptr<float>() : nullptr,
                    by_rows ? logit_rows->data_ptr<int64_t>() : nullptr, B, K, V,
                    entropy.data_ptr<float>(), token_prob.data_ptr<float>(), argmax.data_ptr<int64_t>(),
                    pivot_prob.data_ptr<float>(), accepted.data_ptr<bool>(), pivot_accepted.data_ptr<bool>(),
                    num_accepted.data_ptr<int64_t>(), next_token.data_ptr<int64_t>(), top3_entropy.data_ptr<float>(),
                    divergence.data_ptr<float>());
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
                         const c10::optional<at::Tensor>& b2, const c10::optional<at::Tensor>& clf_bias,
                         double sigma, double floor_, double temperature,
                         const c10::optional<at::Tensor>& draft_probs, const c10::optional<at::Tensor>& uniforms,
                         const c10::optional<at::Tensor>& exponentials, int64_t rule, double rule_a, double rule_b,
                         const c10::optional<at::Tensor>& num_drafts, const c10::optional<at::Tensor>& draft_logits,
                         const c10::optional<at::Tensor>& row_rules, const c10::optional<at::Tensor>& logit_rows,
                         at::Tensor& entropy, at::Tensor& token_prob, at::Tensor& argmax, at::Tensor& pivot_prob,
                         at::Tensor& accepted, at::Tensor& pivot_accepted, at::Tensor& num_accepted,
                         at::Tensor& next_token, at::Tensor& top3_entropy, at::Tensor& divergence, int64_t splits,
                         int64_t split_len, int64_t race_splits, int64_t race_split_len, int64_t threads);

// csrc/cpu/gqa_attention_cpu.cpp
void gqa_attention_out(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                       const at::Tensor& mask, double scale, at::Tensor& out);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pad_kernels C++ CPU backend of verify_block, and grouped-query attention for few-token steps";
  m.def("verify_block_out", &verify_block_cpu_out, "Fused verification of one block into preallocated outputs");
  m.def("emulate_cuda_verify", &emulate_cuda_verify, "The CUDA backend's kernels, simulated block by block on the CPU");
  m.def("gqa_attention_out", &gqa_attention_out, "Grouped-query attention of a few new tokens per row");
  m.def("isa", [] { return std::string(pad_cpu::isa_name(pad_cpu::active_isa())); },
        "The instruction set the vocabulary and attention loops run: avx512, avx2 or baseline");
  m.def("best_isa", [] { return std::string(pad_cpu::isa_name(pad_cpu::best_isa())); },
        "The widest instruction set this CPU and build support");
  m.def("set_isa", &pad_cpu::set_isa, "Run the loops in this instruction set (auto, avx512, avx2, baseline)");
}
