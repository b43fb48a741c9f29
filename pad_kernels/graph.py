"""``VerifyGraph``: ``verify_block`` for one fixed shape, captured once in a CUDA graph and replayed per
block, so a verification step costs one graph launch instead of two or three kernel launches and their
host-side argument handling. The op allocates no outputs (a ``Workspace``) and never syncs with the host
on GPU tensors, which is what capture needs. On other devices the same object runs the op eagerly on the
same static buffers (the path the CPU tests exercise)."""
from __future__ import annotations

import torch

from .types import AcceptRule, FoldedClassifier, VerifyResult, Workspace
from .verify import verify_block


class VerifyGraph:
    """Verification blocks of exactly ``B`` rows, ``K`` drafts and a vocabulary of ``V``.

    The settings (classifier, sigma, floor, temperature, rule, backend) are fixed at construction. Each
    call copies its inputs into static buffers and replays the captured graph (CUDA) or runs the op on
    them (elsewhere); the returned ``VerifyResult`` is the same tensors every call, overwritten by the
    next, so copy what must outlive a block. With ``temperature > 0`` the random draws are inputs
    (``uniforms`` [B, K], ``exponentials`` [B, V]): a captured graph would otherwise replay the same ones.
    """

    def __init__(self, B: int, K: int, V: int, *, dtype: torch.dtype, device, hidden_size: int | None = None,
                 classifier: FoldedClassifier | None = None, sigma: float = 0.0, floor: float = 0.0,
                 temperature: float = 0.0, rule: AcceptRule = AcceptRule(), draft_stop: bool = False,
                 backend: str | None = None):
        device = torch.device(device)
        if classifier is not None and hidden_size is None:
            raise ValueError("a classifier needs hidden_size (the target hidden states' width)")
        self.shape = (B, K, V)
        self.logits = torch.zeros(B, K + 1, V, dtype=dtype, device=device)
        self.drafts = torch.zeros(B, K, dtype=torch.int64, device=device)
        self.hidden = torch.zeros(B, K + 1, hidden_size, dtype=dtype, device=device) if classifier is not None else None
        self.num_drafts = torch.full((B,), K, dtype=torch.int64, device=device) if draft_stop else None
        self.sampling = temperature > 0
        if self.sampling:
            self.draft_probs = torch.full((B, K, V), 1.0 / V, device=device)
            self.uniforms = torch.zeros(B, K, device=device)
            self.exponentials = torch.ones(B, V, device=device)
        self.classifier = classifier.to(device) if classifier is not None else None
        self.settings = dict(sigma=sigma, floor=floor, temperature=temperature, rule=rule, backend=backend)
        self.out = Workspace(B, K, device).result(B, K)
        self.graph = None
        self._run()  # checks every setting once, eagerly; on CUDA also the warm-up before capture
        if device.type == "cuda":
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):  # compile and allocate outside the capture
                self._run()
            torch.cuda.current_stream(device).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self._run()

    def _run(self) -> None:
        draws = dict(draft_probs=self.draft_probs, uniforms=self.uniforms,
                     exponentials=self.exponentials) if self.sampling else {}
        verify_block(self.logits, self.drafts, self.hidden, self.classifier, **self.settings, **draws,
                     num_drafts=self.num_drafts, out=self.out)

    def __call__(self, target_logits: torch.Tensor, draft_tokens: torch.Tensor, hidden: torch.Tensor | None = None,
                 *, draft_probs: torch.Tensor | None = None, uniforms: torch.Tensor | None = None,
                 exponentials: torch.Tensor | None = None, num_drafts: torch.Tensor | None = None) -> VerifyResult:
        """Shapes as ``verify_block``'s and exactly those given at construction."""
        inputs = {"target_logits": (self.logits, target_logits), "draft_tokens": (self.drafts, draft_tokens),
                  "hidden": (self.hidden, hidden), "num_drafts": (self.num_drafts, num_drafts)}
        if self.sampling:
            inputs.update(draft_probs=(self.draft_probs, draft_probs), uniforms=(self.uniforms, uniforms),
                          exponentials=(self.exponentials, exponentials))
        for name, (static, given) in inputs.items():
            if (static is None) != (given is None):
                raise ValueError(f"this graph was built {'without' if static is None else 'with'} {name}")
            exact_dtype = name not in ("draft_probs", "uniforms", "exponentials")  # the op reads those as fp32
            if static is not None and (given.shape != static.shape or given.device != static.device
                                       or (exact_dtype and given.dtype != static.dtype)):
                raise ValueError(f"{name} must be {static.dtype} {list(static.shape)} on {static.device} for this "
                                 f"graph, got {given.dtype} {list(given.shape)} on {given.device}")
        for static, given in inputs.values():
            if static is not None:
                static.copy_(given)
        if self.graph is not None:
            self.graph.replay()
        else:
            self._run()
        return self.out
