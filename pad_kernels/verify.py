"""``verify_block``: the fused verification op, its argument checks and backend dispatch.

One call per verification block computes, for B rows of K draft tokens over a vocabulary of V:
per position the entropy, ``p_target(d_i)``, the argmax, the pivot probability and the accept mask; per
row the number accepted and the next token. See ``verify_block_ref`` for the exact rule (the spec).
"""
from __future__ import annotations

import importlib.util
import math
import os
from typing import Optional

import torch

from .types import (FEATURE_NAMES, ROW_RULE_COLUMNS, RULES, SAMPLING_RULES, AcceptRule, FoldedClassifier,
                    VerifyResult, Workspace, empty_result, rule_of_row)
from .verify_ref import verify_block_ref

BACKEND_NAMES = ("torch", "cpu", "triton", "cuda")


def _impl(name: str):
    """The implementation of backend ``name`` (verify_block_ref's signature), imported on first use."""
    if name == "torch":
        return verify_block_ref
    if name == "cpu":
        from .cpu import verify_block_cpu

        return verify_block_cpu
    if name == "triton":
        from .triton.verify_block import verify_block_triton

        return verify_block_triton
    if name == "cuda":
        from .cuda import verify_block_cuda

        return verify_block_cuda
    raise RuntimeError(f"backend {name!r} has no implementation")


def _available(name: str, device: torch.device) -> bool:
    if name == "torch":
        return True
    if name == "cpu":
        from . import cpu

        return device.type == "cpu" and cpu.available()
    if name == "triton":
        # GPU tensors, or CPU tensors through Triton's interpreter (tests); never chosen by auto on CPU.
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            return False
        return importlib.util.find_spec("triton") is not None
    if name == "cuda":
        from . import cuda

        return device.type == "cuda" and cuda.available()
    return False


def available_backends(device: torch.device | str) -> list[str]:
    """Backends that can run on ``device``, fastest first."""
    device = torch.device(device)
    order = {"cuda": ["cuda", "triton", "torch"], "cpu": ["cpu", "torch", "triton"]}.get(device.type, ["torch"])
    return [name for name in order if _available(name, device)]


@torch.compiler.assume_constant_result  # host logic (imports, environment): run once when compiled, not traced
def resolve_backend(backend: str | None, device: torch.device | str) -> str:
    """The backend to use: ``backend``, else ``$PAD_BACKEND``, else the fastest available (``auto``).

    A backend asked for by name that cannot run here raises; ``auto`` falls back quietly.
    """
    name = backend if backend is not None else os.environ.get("PAD_BACKEND", "auto")
    name = name.strip().lower()
    if name == "auto":
        return available_backends(device)[0]
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown verification backend {name!r}; choose auto or one of {', '.join(BACKEND_NAMES)}")
    if name not in available_backends(device):
        raise RuntimeError(
            f"verification backend {name!r} is not available for {torch.device(device).type} tensors "
            f"(available: {', '.join(available_backends(device))})"
        )
    return name


def _check_unit(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and 0.0 <= value <= 1.0):
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")


def check_rule(rule, temperature: float) -> None:
    """Raise ValueError for an unknown rule, settings out of range, or a greedy-only rule with sampling."""
    if not isinstance(rule, AcceptRule) or rule.name not in RULES:
        raise ValueError(f"rule must be a pad_kernels.AcceptRule named one of {', '.join(RULES)}, got {rule!r}")
    a, b = rule.a, rule.b
    if any(not isinstance(v, (int, float)) or math.isnan(v) for v in (a, b)):
        raise ValueError(f"rule settings must be numbers, got {rule!r}")
    if rule.name == "typical" and not (0 <= a <= 1 and b >= 0):
        raise ValueError(f"typical needs 0 <= epsilon <= 1 and delta >= 0, got epsilon={a}, delta={b}")
    if rule.name == "threshold" and not 0 <= a <= 1:
        raise ValueError(f"threshold needs 0 <= tau <= 1, got {a}")
    if rule.name == "fly" and not (a >= 0 and b >= 1 and b == int(b) and b < 2**31):
        raise ValueError(f"fly needs a gate >= 0 and a whole window >= 1, got gate={a}, window={b}")
    if rule.name == "kl" and not (a >= 0 and 0 <= b <= 1):
        raise ValueError(f"kl needs epsilon >= 0 and 0 <= top1 <= 1, got epsilon={a}, top1={b}")
    if rule.name == "topk" and not (0 <= a < 2**31 and a == int(a) and b >= 0):
        raise ValueError(f"topk needs a whole k >= 0 and delta >= 0, got k={a}, delta={b}")
    if temperature > 0 and rule.name not in SAMPLING_RULES:
        raise ValueError(f"the {rule.name} rule is defined for greedy decoding only (temperature 0); "
                         f"with sampling use one of {', '.join(SAMPLING_RULES)}")


def _check_inputs(target_logits, draft_tokens, hidden, classifier, sigma, floor, temperature,
                  draft_probs, uniforms, exponentials, draft_logits=None, classifier_bias=None) -> None:
    if target_logits.dim() != 3 or target_logits.shape[1] < 1:
        raise ValueError(f"target_logits must be [B, K+1, V], got shape {tuple(target_logits.shape)}")
    if target_logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"target_logits must be fp32, bf16 or fp16, got {target_logits.dtype}")
    B, K1, V = target_logits.shape
    K = K1 - 1
    device = target_logits.device
    if draft_tokens.shape != (B, K) or draft_tokens.dtype != torch.int64:
        raise ValueError(
            f"draft_tokens must be int64 [B, K] = [{B}, {K}], got {draft_tokens.dtype} {tuple(draft_tokens.shape)}"
        )
    _check_unit("sigma", sigma)
    _check_unit("floor", floor)
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    tensors = {"draft_tokens": draft_tokens}
    if classifier is not None:
        if not isinstance(classifier, FoldedClassifier):
            raise TypeError("classifier must be a pad_kernels.FoldedClassifier (see PivotClassifier.fold())")
        if hidden is None:
            raise ValueError("a classifier needs the target hidden states: pass hidden [B, K+1, H]")
        H = classifier.hidden_size
        if hidden.shape != (B, K1, H):
            raise ValueError(f"hidden must be [B, K+1, H] = [{B}, {K1}, {H}], got {tuple(hidden.shape)}")
        w1, b1, w2, b2 = classifier
        D = w1.shape[1]
        if w1.shape != (H + len(FEATURE_NAMES), D) or b1.shape != (D,) or w2.shape != (D,) or b2.shape != ():
            raise ValueError("classifier weights must be w1 [H+F, D], b1 [D], w2 [D], b2 []")
        tensors.update(hidden=hidden, w1=w1, b1=b1, w2=w2, b2=b2)
        if classifier_bias is not None:
            if tuple(classifier_bias.shape) != (B, K, D) or classifier_bias.dtype != torch.float32:
                raise ValueError(f"classifier_bias must be fp32 [B, K, D] = [{B}, {K}, {D}], got "
                                 f"{classifier_bias.dtype} {tuple(classifier_bias.shape)}")
            tensors["classifier_bias"] = classifier_bias
    elif classifier_bias is not None:
        raise ValueError("classifier_bias is added to a classifier's first layer: pass the classifier too")
    if temperature > 0:
        if draft_probs is None or uniforms is None or exponentials is None:
            raise ValueError("temperature > 0 needs draft_probs [B, K, V], uniforms [B, K] and exponentials [B, V]")
        for name, t, shape in (("draft_probs", draft_probs, (B, K, V)), ("uniforms", uniforms, (B, K)),
                               ("exponentials", exponentials, (B, V))):
            if tuple(t.shape) != shape or not t.is_floating_point():
                raise ValueError(f"{name} must be a float tensor of shape {list(shape)}, got {tuple(t.shape)}")
            tensors[name] = t
    if draft_logits is not None:
        if tuple(draft_logits.shape) != (B, K, V) or draft_logits.dtype != target_logits.dtype:
            raise ValueError(f"draft_logits must be {target_logits.dtype} [B, K, V] = [{B}, {K}, {V}] like "
                             f"target_logits, got {draft_logits.dtype} {tuple(draft_logits.shape)}")
        tensors["draft_logits"] = draft_logits
    for name, t in tensors.items():
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but target_logits is on {device}")
    # Checked on the host for CPU tensors, whatever the backend. On GPU tensors this check would sync the
    # host, so there the kernels guard instead: an id out of range reads nothing and gets p = NaN, which
    # no rule accepts (the reference says the same).
    # Under torch.compile the check would be a data-dependent branch; the kernels' guard stands alone there.
    if device.type == "cpu" and draft_tokens.numel() and not torch.compiler.is_compiling() \
            and (draft_tokens.min() < 0 or draft_tokens.max() >= V):
        raise ValueError(f"draft_tokens must lie in [0, {V})")


def verify_block(
    target_logits: torch.Tensor,  # [B, K+1, V] fp32/bf16/fp16: row i scores the token after position i
    draft_tokens: torch.Tensor,  # [B, K] int64
    hidden: torch.Tensor | None = None,  # [B, K+1, H] target hidden states at the classifier's layer
    classifier: FoldedClassifier | None = None,
    *,
    sigma: float = 0.0,
    floor: float = 0.0,
    temperature: float = 0.0,
    draft_probs: torch.Tensor | None = None,  # [B, K, V] draft distributions, needed when temperature > 0
    uniforms: torch.Tensor | None = None,  # [B, K] U(0,1) draws for the acceptance test
    exponentials: torch.Tensor | None = None,  # [B, V] Exp(1) draws for the correction/bonus token
    rule: AcceptRule = AcceptRule(),
    num_drafts: torch.Tensor | None = None,  # [B] int64 in [0, K]: each row's own draft length (draft_stop)
    draft_logits: torch.Tensor | None = None,  # [B, K, V] the draft's logits (dtype of target_logits)
    backend: str | None = None,
    out: VerifyResult | Workspace | None = None,
    row_rules: torch.Tensor | None = None,  # [B, 6] fp32 (pack_row_rules): each row's rule, sigma, prefix, kind
    logit_rows: torch.Tensor | None = None,  # [B, K+1] int64: target_logits [R, V] read by row index; -1: none
    classifier_bias: torch.Tensor | None = None,  # [B, K, D] fp32: each draft position's addition to b1
) -> VerifyResult:
    """Verify one block of draft tokens against the target's logits.

    With ``temperature > 0`` the random draws are inputs so every backend picks the same tokens; any of
    ``uniforms`` / ``exponentials`` left as None is drawn here from torch's global generator.
    ``classifier=None`` means no pivot override (``pivot_prob`` is 1.0). ``rule`` adds a training-free
    relaxation (``AcceptRule``: typical, threshold, fly, kl, topk); a token is accepted when the exact rule,
    the classifier or the rule accepts it. ``draft_logits``: the draft's logits at the K drafted positions,
    from which ``divergence`` (KL(p || q)) is computed in the same pass; the kl rule needs them.
    ``num_drafts``: rows that stopped drafting early (positions from ``num_drafts[b]`` on are padding, never
    accepted; the token after a row's last draft is its bonus).
    ``K = 0`` is allowed: it only picks the next token (autoregressive decoding); so is ``B = 0`` (empty results).
    ``out``: caller-owned outputs to write (contiguous, the shapes and dtypes of ``VerifyResult`` on the logits'
    device), or a ``Workspace`` to take them from; nothing is allocated for the outputs then.
    ``row_rules`` (``pack_row_rules``): each row decided with its own rule, sigma, exact prefix and exact test
    (greedy or sampled; sampled rows need temperature > 0) in place of ``rule`` and ``sigma``: one call for a
    batch whose requests choose different policies. ``logit_rows``: ``target_logits`` is [R, V] (and
    ``draft_probs``, when sampling, [R, V] the same way) and position (b, i) reads row ``logit_rows[b, i]``, -1
    where it has none (allowed only at or past the row's own drafts: see ``verify_block_ref``), so a serving
    engine's packed logits are read where they lie, without a copy. ``classifier_bias``: added to the
    classifier's first layer at each draft position (``FoldedClassifier``): what the caller knows of a draft
    (where it came from), folded through that layer.
    """
    checked_logits, checked_probs = target_logits, draft_probs
    if logit_rows is not None:
        _check_logit_rows(logit_rows, target_logits, draft_tokens, draft_probs, draft_logits, num_drafts)
        B, K = draft_tokens.shape
        # Shape checks below see the block as it will be read: zero-stride views, nothing copied.
        checked_logits = target_logits[0].expand(B, K + 1, target_logits.shape[1])
        checked_probs = draft_probs[0].expand(B, K, draft_probs.shape[1]) if draft_probs is not None else None
    if temperature > 0:
        V = checked_logits.shape[-1]
        if uniforms is None:
            uniforms = torch.rand(checked_logits.shape[0], checked_logits.shape[1] - 1, device=target_logits.device)
        if exponentials is None:
            exponentials = torch.empty(checked_logits.shape[0], V, device=target_logits.device).exponential_()
    _check_inputs(checked_logits, draft_tokens, hidden, classifier, sigma, floor, temperature,
                  checked_probs, uniforms, exponentials, draft_logits, classifier_bias)
    check_rule(rule, temperature)
    if row_rules is not None:
        _check_row_rules(row_rules, checked_logits.shape[0], temperature)
    if rule.needs_draft_logits and draft_logits is None:
        raise ValueError(f"the {rule.name} rule reads the draft's distribution: pass draft_logits [B, K, V]")
    if num_drafts is not None:
        B, K1 = checked_logits.shape[:2]
        if num_drafts.shape != (B,) or num_drafts.dtype != torch.int64 or num_drafts.device != target_logits.device:
            raise ValueError(f"num_drafts must be int64 [B] = [{B}] on {target_logits.device}, got "
                             f"{num_drafts.dtype} {tuple(num_drafts.shape)} on {num_drafts.device}")
        # Checked on the host for CPU tensors only (a GPU check would sync); kernels clamp to [0, K].
        if num_drafts.device.type == "cpu" and B and not torch.compiler.is_compiling() \
                and (num_drafts.min() < 0 or num_drafts.max() > K1 - 1):
            raise ValueError(f"num_drafts must lie in [0, {K1 - 1}]")
    w1, b1, w2, b2 = classifier if classifier is not None else (None, None, None, None)
    if out is not None:
        B, K1 = checked_logits.shape[:2]
        out = _check_out(out.result(B, K1 - 1) if isinstance(out, Workspace) else out, B, K1 - 1,
                         target_logits.device)
        verify_block_out_op(
            target_logits, draft_tokens, hidden if classifier is not None else None, w1, b1, w2, b2, classifier_bias,
            float(sigma), float(floor), float(temperature), draft_probs, uniforms, exponentials, rule.code,
            float(rule.a), float(rule.b), num_drafts, draft_logits, row_rules, logit_rows,
            resolve_backend(backend, target_logits.device), *out,
        )
        return out
    out = verify_block_op(
        target_logits, draft_tokens, hidden if classifier is not None else None, w1, b1, w2, b2, classifier_bias,
        float(sigma), float(floor), float(temperature), draft_probs, uniforms, exponentials, rule.code, float(rule.a),
        float(rule.b), num_drafts, draft_logits, row_rules, logit_rows, resolve_backend(backend, target_logits.device),
    )
    return VerifyResult(*out)


def _check_row_rules(row_rules, B: int, temperature: float) -> None:
    """Shape, dtype, and on CPU tensors each row's settings (``check_rule``, sigma in [0, 1])."""
    if row_rules.shape != (B, len(ROW_RULE_COLUMNS)) or row_rules.dtype != torch.float32:
        raise ValueError(f"row_rules must be fp32 [B, {len(ROW_RULE_COLUMNS)}] = [{B}, {len(ROW_RULE_COLUMNS)}] "
                         f"(pack_row_rules), got {row_rules.dtype} {tuple(row_rules.shape)}")
    if row_rules.device.type != "cpu" or torch.compiler.is_compiling():
        return  # a GPU check would sync the host: pack_row_rules builds them checked
    for b in range(B):
        code = row_rules[b, 0].item()
        if code != int(code) or not 0 <= code < len(RULES):
            raise ValueError(f"row_rules[{b}] has no rule code {code}")
        rule, sigma, until, sampled = rule_of_row(row_rules, b)
        check_rule(rule, temperature if sampled else 0.0)
        _check_unit(f"row_rules[{b}] sigma", sigma)
        if until < 0 or (sampled and not temperature > 0):
            raise ValueError(f"row_rules[{b}]: exact_until must be >= 0, and a sampled row needs temperature > 0")


def _check_logit_rows(logit_rows, target_logits, draft_tokens, draft_probs, draft_logits, num_drafts) -> None:
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be [B, K], got shape {tuple(draft_tokens.shape)}")
    B, K = draft_tokens.shape
    if target_logits.dim() != 2 or target_logits.shape[0] < 1:
        raise ValueError(f"with logit_rows, target_logits must be [R, V] (R >= 1), got {tuple(target_logits.shape)}")
    if logit_rows.shape != (B, K + 1) or logit_rows.dtype != torch.int64 or logit_rows.device != target_logits.device:
        raise ValueError(f"logit_rows must be int64 [B, K+1] = [{B}, {K + 1}] on {target_logits.device}, got "
                         f"{logit_rows.dtype} {tuple(logit_rows.shape)} on {logit_rows.device}")
    if draft_probs is not None and (draft_probs.dim() != 2 or draft_probs.shape != target_logits.shape):
        raise ValueError(f"with logit_rows, draft_probs must be [R, V] like target_logits, got "
                         f"{tuple(draft_probs.shape)}")
    if draft_logits is not None:
        raise ValueError("draft_logits cannot be read by logit_rows: pass the [B, K+1, V] block instead")
    # Checked on the host for CPU tensors only (a GPU check would sync): the kernels read rows as given.
    if logit_rows.device.type == "cpu" and B and not torch.compiler.is_compiling():
        R = target_logits.shape[0]
        if logit_rows.min() < -1 or logit_rows.max() >= R:
            raise ValueError(f"logit_rows must lie in [-1, {R})")
        own = num_drafts if num_drafts is not None else torch.full((B,), K, dtype=torch.int64)
        if (logit_rows[:, :K] < 0).logical_and(torch.arange(K)[None] < own[:, None]).any():
            raise ValueError("every draft position of a row's own drafts needs a row of logits (-1 is allowed "
                             "only at or past num_drafts)")


def _check_out(out, B: int, K: int, device) -> VerifyResult:
    if not isinstance(out, VerifyResult):
        raise TypeError(f"out must be a pad_kernels.VerifyResult or Workspace, got {type(out).__name__}")
    for name, got, want in zip(VerifyResult._fields, out, empty_result(B, K, "meta")):
        if got.shape != want.shape or got.dtype != want.dtype or got.device != torch.device(device) \
                or not got.is_contiguous():
            raise ValueError(f"out.{name} must be a contiguous {want.dtype} tensor of shape {list(want.shape)} on "
                             f"{device}, got {got.dtype} {list(got.shape)} on {got.device}")
    return out


# The custom ops' annotations stay plain names (Optional[Tensor]): torch 2.5 evaluates them as strings in its
# own namespace, where an alias of ours would not resolve.
Tensor = torch.Tensor


@torch.library.custom_op("pad_kernels::verify_block", mutates_args=())
def verify_block_op(
    target_logits: Tensor, draft_tokens: Tensor, hidden: Optional[Tensor], w1: Optional[Tensor],
    b1: Optional[Tensor], w2: Optional[Tensor], b2: Optional[Tensor], classifier_bias: Optional[Tensor],
    sigma: float, floor: float,
    temperature: float, draft_probs: Optional[Tensor], uniforms: Optional[Tensor],
    exponentials: Optional[Tensor], rule: int, rule_a: float, rule_b: float, num_drafts: Optional[Tensor],
    draft_logits: Optional[Tensor], row_rules: Optional[Tensor], logit_rows: Optional[Tensor], backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``verify_block`` as a registered op (``torch.ops.pad_kernels.verify_block``) for torch.compile and
    CUDA graphs; arguments are checked by ``verify_block``, outputs in ``VerifyResult`` order."""
    classifier = FoldedClassifier(w1, b1, w2, b2) if w1 is not None else None
    return tuple(_impl(backend)(
        target_logits, draft_tokens, hidden, classifier, sigma=sigma, floor=floor, temperature=temperature,
        draft_probs=draft_probs, uniforms=uniforms, exponentials=exponentials,
        rule=AcceptRule(RULES[rule], rule_a, rule_b), num_drafts=num_drafts, draft_logits=draft_logits,
        row_rules=row_rules, logit_rows=logit_rows, classifier_bias=classifier_bias,
    ))


@verify_block_op.register_fake
def _verify_block_fake(target_logits, draft_tokens, hidden, w1, b1, w2, b2, classifier_bias, sigma, floor,
                       temperature, draft_probs, uniforms, exponentials, rule, rule_a, rule_b, num_drafts, draft_logits,
                       row_rules, logit_rows, backend):
    B, K = draft_tokens.shape
    return tuple(empty_result(B, K, target_logits.device))


@torch.library.custom_op("pad_kernels::verify_block_out", mutates_args=VerifyResult._fields)
def verify_block_out_op(
    target_logits: Tensor, draft_tokens: Tensor, hidden: Optional[Tensor], w1: Optional[Tensor],
    b1: Optional[Tensor], w2: Optional[Tensor], b2: Optional[Tensor], classifier_bias: Optional[Tensor],
    sigma: float, floor: float,
    temperature: float, draft_probs: Optional[Tensor], uniforms: Optional[Tensor],
    exponentials: Optional[Tensor], rule: int, rule_a: float, rule_b: float, num_drafts: Optional[Tensor],
    draft_logits: Optional[Tensor], row_rules: Optional[Tensor], logit_rows: Optional[Tensor], backend: str,
    entropy: Tensor, token_prob: Tensor, argmax: Tensor, pivot_prob: Tensor, accepted: Tensor,
    pivot_accepted: Tensor, num_accepted: Tensor, next_token: Tensor, top3_entropy: Tensor, divergence: Tensor,
) -> None:
    """``verify_block`` writing into caller-owned outputs (``torch.ops.pad_kernels.verify_block_out``): no
    allocation for the outputs, fixed addresses per (B, K) for CUDA graphs."""
    out = VerifyResult(entropy, token_prob, argmax, pivot_prob, accepted, pivot_accepted, num_accepted, next_token,
                       top3_entropy, divergence)
    classifier = FoldedClassifier(w1, b1, w2, b2) if w1 is not None else None
    kwargs = dict(sigma=sigma, floor=floor, temperature=temperature, draft_probs=draft_probs, uniforms=uniforms,
                  exponentials=exponentials, rule=AcceptRule(RULES[rule], rule_a, rule_b), num_drafts=num_drafts,
                  draft_logits=draft_logits, row_rules=row_rules, logit_rows=logit_rows,
                  classifier_bias=classifier_bias)
    if backend == "torch":  # the reference allocates its results: copy them over
        for o, r in zip(out, verify_block_ref(target_logits, draft_tokens, hidden, classifier, **kwargs)):
            o.copy_(r)
    else:
        _impl(backend)(target_logits, draft_tokens, hidden, classifier, **kwargs, out=out)


@verify_block_out_op.register_fake
def _verify_block_out_fake(*args) -> None:
    return None
