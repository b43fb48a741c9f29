"""A quick check of every ``verify_block`` backend against the reference on the devices at hand.

``pad-decoding doctor --check`` runs it: on a machine with a GPU it is the first proof that the Triton and
CUDA kernels compute what the reference does there. Each case: fresh seeded random inputs (a verification
block with a classifier, greedy and sampling, fp32 and bf16; with the draft's logits, by turns the exact, kl
and topk rules), outputs poisoned before the backend writes
them; integer outputs (argmax, accept masks, counts, next tokens) must equal the reference's, float outputs
lie within ``ATOL + RTOL * |reference|``. The test suite holds the backends to a stricter rule.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .types import AcceptRule, FoldedClassifier, empty_result
from .verify import available_backends, verify_block
from .verify_ref import verify_block_ref

RTOL, ATOL = 1e-4, 1e-5
# (B, K, V, H): one decode-sized block and one batch over a vocabulary that is not a multiple of any tile.
SHAPES = ((1, 8, 151936, 1536), (3, 4, 32003, 896))
POISON = {torch.float32: float("nan"), torch.int64: -7, torch.bool: True}
RULES = (AcceptRule(), AcceptRule.kl(0.5), AcceptRule.topk(3, 0.3))  # taken in turn by the cases


@dataclass
class CheckResult:
    device: str
    backend: str
    case: str
    ok: bool
    detail: str = ""


def make_case(B, K, V, H, dtype, sampling, device, seed):
    """Random ``verify_block`` arguments: (args, kwargs) on ``device``; drafts mostly the target's choices."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, K + 1, V, generator=g) * 4).to(dtype)
    drafts = logits[:, :K].float().argmax(-1)
    wrong = torch.rand(B, K, generator=g) < 0.3
    drafts[wrong] = torch.randint(0, V, (int(wrong.sum()),), generator=g)
    hidden = torch.randn(B, K + 1, H, generator=g).to(dtype)
    D = 128
    clf = FoldedClassifier(torch.randn(H + 2, D, generator=g) / H**0.5, torch.randn(D, generator=g) * 0.1,
                           torch.randn(D, generator=g) / D**0.5, torch.tensor(0.2))
    draft_logits = (logits[:, :K].float() + torch.randn(B, K, V, generator=g)).to(dtype)
    kwargs = dict(sigma=0.5, floor=1e-4, rule=RULES[seed % len(RULES)], draft_logits=draft_logits)
    if sampling:
        kwargs.update(temperature=0.8, draft_probs=torch.softmax(draft_logits.float() / 0.8, -1),
                      uniforms=torch.rand(B, K, generator=g), exponentials=torch.empty(B, V).exponential_(generator=g))
    move = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t  # noqa: E731
    clf = FoldedClassifier(*(move(t) for t in clf))
    return (move(logits), move(drafts), move(hidden), clf), {k: move(v) for k, v in kwargs.items()}


def compare(got, expected) -> str:
    """'' when ``got`` matches ``expected`` (two VerifyResults), else what differs."""
    for name, g, e in zip(expected._fields, got, expected):
        if e.is_floating_point():
            if not torch.isfinite(g).all():
                return f"{name} has non-finite or unwritten elements"
            if not torch.allclose(g.double(), e.double(), rtol=RTOL, atol=ATOL):
                return f"{name}: largest difference {(g.double() - e.double()).abs().max().item():.3g}"
        elif not torch.equal(g.cpu(), e.cpu()):
            return f"{name}: {g.tolist()} != {e.tolist()}"
    return ""


def devices() -> list[str]:
    """The CPU, and every CUDA device torch sees."""
    return ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]


def run(progress=None) -> list[CheckResult]:
    """Every available backend but the reference, on every device, on each case; ``progress(result)`` is
    called after each."""
    results = []
    for device in devices():
        for backend in available_backends(torch.device(device)):
            if backend == "torch" or (backend == "triton" and device == "cpu"):
                continue  # the reference itself; Triton on the CPU is its interpreter, which the tests cover
            for seed, ((B, K, V, H), dtype, sampling) in enumerate(
                    (shape, dtype, sampling) for shape in SHAPES for dtype in (torch.float32, torch.bfloat16)
                    for sampling in (False, True)):
                case = (f"B={B} K={K} V={V} H={H} {str(dtype).removeprefix('torch.')} "
                        f"{'sampling' if sampling else 'greedy'} {RULES[seed % len(RULES)].name}")
                args, kwargs = make_case(B, K, V, H, dtype, sampling, device, seed)
                try:
                    expected = verify_block_ref(*args, **kwargs)
                    out = empty_result(B, K, torch.device(device))
                    for t in out:
                        t.fill_(POISON[t.dtype])
                    got = verify_block(*args, **kwargs, backend=backend, out=out)
                    detail = compare(got, expected)
                except Exception as e:  # noqa: BLE001 - a failing backend is a result to report, not a crash
                    detail = f"{type(e).__name__}: {e}"
                results.append(CheckResult(device, backend, case, not detail, detail))
                if progress is not None:
                    progress(results[-1])
    return results
