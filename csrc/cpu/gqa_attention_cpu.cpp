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

#include "isa.h"

namespace {

void check(bool ok, const char* msg) { TORCH_CHECK(ok, "pad_kernels cpu gqa_attention: ", msg); }

#define PAD_ISA_KERNELS "gqa_attention_kernels.inc"
#include "isa_variants.inc"
#undef PAD_ISA_KERNELS

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
  check(D % 4 == 0 && Hq / Hkv * Tn <= baseline::kMaxM, "the head dim must be a multiple of 4 and G * T at most 512");
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
    PAD_ISA_CALL(attend<scalar_t>, query.data_ptr<scalar_t>(), key.data_ptr<scalar_t>(), value.data_ptr<scalar_t>(),
                     mask.data_ptr<bool>(), out.data_ptr<scalar_t>(), B, Hq, Hkv, Tn, S, D, qs, ks, vs, ms,
                     static_cast<float>(scale));
  });
}
