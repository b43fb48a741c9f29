// Torch binding of the CUDA backend: checks shapes, dtypes and devices, then launches the torch-free
// kernels of verify_block.cu on the current stream.
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "verify_block_cuda.h"

namespace {

pad_cuda::DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return pad_cuda::DType::kFloat32;
    case at::kHalf: return pad_cuda::DType::kFloat16;
    case at::kBFloat16: return pad_cuda::DType::kBFloat16;
    default: TORCH_CHECK(false, "pad_kernels cuda verify_block: logits and hidden must be fp32, fp16 or bf16");
  }
}

const float* fptr(const c10::optional<at::Tensor>& t) { return t.has_value() ? t->data_ptr<float>() : nullptr; }

void verify_block_cuda_out(const at::Tensor& logits, const at::Tensor& draft_tokens,
                           const c10::optional<at::Tensor>& hidden, const c10::optional<at::Tensor>& w1,
                           const c10::optional<at::Tensor>& b1, const c10::optional<at::Tensor>& w2,
                           const c10::optional<at::Tensor>& b2, const c10::optional<at::Tensor>& clf_bias,
                           double sigma, double floor_, double temperature,
                           const c10::optional<at::Tensor>& draft_probs, const c10::optional<at::Tensor>& uniforms,
                           const c10::optional<at::Tensor>& exponentials, int64_t rule, double rule_a,
                           double rule_b, const c10::optional<at::Tensor>& num_drafts,
                           const c10::optional<at::Tensor>& draft_logits, const c10::optional<at::Tensor>& row_rules,
                           const c10::optional<at::Tensor>& logit_rows, at::Tensor& entropy, at::Tensor& token_prob,
                           at::Tensor& argmax, at::Tensor& pivot_prob, at::Tensor& accepted, at::Tensor& pivot_accepted,
                           at::Tensor& num_accepted, at::Tensor& next_token, at::Tensor& top3_entropy,
                           at::Tensor& divergence, int64_t splits, int64_t split_len, int64_t race_splits,
                           int64_t race_split_len) {
  const bool by_rows = logit_rows.has_value();
  TORCH_CHECK(logits.is_cuda() && logits.dim() == (by_rows ? 2 : 3) && logits.is_contiguous(),
              "pad_kernels cuda verify_block: logits must be contiguous [B, K+1, V] (or [R, V] with logit_rows) on a "
              "CUDA device");
  const c10::cuda::CUDAGuard guard(logits.device());
  TORCH_CHECK(draft_tokens.is_cuda() && draft_tokens.scalar_type() == at::kLong && draft_tokens.dim() == 2,
              "pad_kernels cuda verify_block: draft_tokens must be int64 [B, K]");
  const int64_t B = draft_tokens.size(0), K = draft_tokens.size(1);
  TORCH_CHECK(by_rows || (logits.size(0) == B && logits.size(1) == K + 1),
              "pad_kernels cuda verify_block: logits must be [B, K+1, V]");
  TORCH_CHECK(!by_rows || (logit_rows->is_cuda() && logit_rows->scalar_type() == at::kLong &&
                           logit_rows->is_contiguous() && logit_rows->numel() == B * (K + 1)),
              "pad_kernels cuda verify_block: logit_rows must be contiguous int64 [B, K+1] on CUDA");
  TORCH_CHECK(!row_rules.has_value() || (row_rules->is_cuda() && row_rules->scalar_type() == at::kFloat &&
                                         row_rules->is_contiguous() && row_rules->numel() == B * 6),
              "pad_kernels cuda verify_block: row_rules must be contiguous fp32 [B, 6] on CUDA");
  pad_cuda::VerifyArgs a{};
  a.logits = logits.data_ptr();
  a.logits_dtype = dtype_of(logits);
  a.drafts = draft_tokens.data_ptr<int64_t>();
  a.B = B;
  a.K = K;
  a.V = logits.size(-1);
  a.row_rules = fptr(row_rules);
  a.logit_rows = by_rows ? logit_rows->data_ptr<int64_t>() : nullptr;
  a.H = 1;
  a.D = 1;
  if (w1.has_value()) {
    TORCH_CHECK(hidden.has_value() && hidden->is_cuda() && hidden->is_contiguous(), "hidden must be contiguous on CUDA");
    a.hidden = hidden->data_ptr();
    a.hidden_dtype = dtype_of(*hidden);
    a.H = hidden->size(2);
    a.D = w1->size(1);
    TORCH_CHECK(w1->is_cuda() && w1->scalar_type() == at::kFloat && w1->size(0) == a.H + 2, "w1 must be fp32 [H+2, D]");
    a.w1 = fptr(w1);
    a.b1 = fptr(b1);
    a.w2 = fptr(w2);
    a.b2 = fptr(b2);
    TORCH_CHECK(!clf_bias.has_value() || (clf_bias->is_cuda() && clf_bias->scalar_type() == at::kFloat &&
                                          clf_bias->is_contiguous() && clf_bias->numel() == B * K * a.D),
                "pad_kernels cuda verify_block: classifier_bias must be contiguous fp32 [B, K, D] on CUDA");
    a.clf_bias = fptr(clf_bias);
  } else {
    TORCH_CHECK(!clf_bias.has_value(), "pad_kernels cuda verify_block: classifier_bias needs a classifier");
    a.hidden_dtype = pad_cuda::DType::kFloat32;
  }
  a.draft_probs = fptr(draft_probs);
  a.uniforms = fptr(uniforms);
  a.exponentials = fptr(exponentials);
  TORCH_CHECK(temperature <= 0.0 || (a.draft_probs && a.uniforms && a.exponentials),
              "temperature > 0 needs draft_probs, uniforms and exponentials");
  a.entropy = entropy.data_ptr<float>();
  a.token_prob = token_prob.data_ptr<float>();
  a.pivot_prob = pivot_prob.data_ptr<float>();
  a.argmax = argmax.data_ptr<int64_t>();
  a.accepted = accepted.data_ptr<bool>();
  a.pivot_accepted = pivot_accepted.data_ptr<bool>();
  a.num_accepted = num_accepted.data_ptr<int64_t>();
  a.next_token = next_token.data_ptr<int64_t>();
  a.top3_entropy = top3_entropy.data_ptr<float>();
  a.divergence = divergence.data_ptr<float>();
  TORCH_CHECK(!draft_logits.has_value() || (draft_logits->is_cuda() && draft_logits->is_contiguous() &&
                                            draft_logits->scalar_type() == logits.scalar_type() &&
                                            draft_logits->numel() == B * K * a.V),
              "pad_kernels cuda verify_block: draft_logits must be contiguous [B, K, V] of the logits' dtype");
  a.draft_logits = draft_logits.has_value() ? draft_logits->data_ptr() : nullptr;
  TORCH_CHECK(!num_drafts.has_value() || (num_drafts->is_cuda() && num_drafts->scalar_type() == at::kLong &&
                                          num_drafts->is_contiguous() && num_drafts->numel() == B),
              "pad_kernels cuda verify_block: num_drafts must be contiguous int64 [B] on CUDA");
  a.num_drafts = num_drafts.has_value() ? num_drafts->data_ptr<int64_t>() : nullptr;
  a.rule = pad::Rule{static_cast<int>(rule), static_cast<float>(rule_a), static_cast<float>(rule_b)};
  for (const auto& [S, len] : {std::pair{splits, split_len}, std::pair{race_splits, race_split_len}})
    TORCH_CHECK(S >= 1 && S <= 65535 && len >= 1 && S * len >= a.V && (S - 1) * len < a.V,
                "pad_kernels cuda verify_block: the vocabulary must be cut into 1 to 65535 non-empty slices");
  a.splits = splits;
  a.split_len = split_len;
  a.race_splits = race_splits;
  a.race_split_len = race_split_len;
  // From torch's caching allocator: no cudaMalloc per block, and graph-private memory under capture.
  const at::Tensor scratch = at::empty({static_cast<int64_t>(pad_cuda::scratch_bytes(B, K, splits, race_splits))},
                                       logits.options().dtype(at::kByte));
  a.scratch = scratch.data_ptr();
  a.sigma = static_cast<float>(sigma);
  a.floor_ = static_cast<float>(floor_);
  a.temperature = static_cast<float>(temperature);
  const cudaError_t err = pad_cuda::verify_block(a, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "pad_kernels cuda verify_block launch failed: ", cudaGetErrorString(err));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pad_kernels CUDA backend of verify_block";
  m.def("verify_block_out", &verify_block_cuda_out, "Fused verification of one block into preallocated outputs");
}
