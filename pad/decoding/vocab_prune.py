"""A draft model that scores only a frequent part of its vocabulary (FR-Spec, arXiv 2502.14856).

The default draft's output layer (151936 x 896) is its largest matrix; most of its rows are tokens a reply
almost never holds. ``use_pruned_head(draft, ids)`` keeps the rows of ``ids`` (the most frequent tokens of
text that is no benchmark's test set: ``bench/token_frequencies.py`` writes ``pad/vocab/*.json``, shipped with
the package) and gives every other token a logit of -inf, so the draft proposes tokens of the subset only and
its distribution, when sampling, is over the subset. Lossless either way: the target decides every token, and
rejection sampling keeps the target's distribution for any draft distribution (tests/test_vocab_prune.py).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

VOCAB_DIR = Path(__file__).resolve().parents[1] / "vocab"


class PrunedHead(nn.Module):
    """An output layer scoring only ``ids`` ([N] token ids): [..., H] -> [..., V] logits, -inf outside ``ids``.
    Its rows live in an ``nn.Linear`` of their own (``inner``), so weight transforms such as
    ``pad.use_int8_weights`` apply to it."""

    def __init__(self, head: nn.Linear, ids: torch.Tensor):
        super().__init__()
        ids = torch.as_tensor(ids, dtype=torch.long).unique(sorted=True)
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= head.out_features:
            raise ValueError(f"token ids must be a non-empty subset of [0, {head.out_features})")
        self.out_features = head.out_features
        self.inner = nn.Linear(head.in_features, ids.numel(), bias=head.bias is not None,
                               dtype=head.weight.dtype, device=head.weight.device)
        with torch.no_grad():
            self.inner.weight.copy_(head.weight[ids])
            if head.bias is not None:
                self.inner.bias.copy_(head.bias[ids])
        self.register_buffer("ids", ids.to(head.weight.device))
        self.weight = _Shape(self.out_features, head.in_features)  # vocab_size() reads weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.inner(x)
        out = scores.new_full((*x.shape[:-1], self.out_features), float("-inf"))
        out[..., self.ids] = scores
        return out


class _Shape:
    """What code reading an output layer's ``weight.shape`` sees (the full vocabulary)."""

    def __init__(self, *shape: int):
        self.shape = torch.Size(shape)


def use_pruned_head(model: nn.Module, ids) -> int:
    """Replace ``model``'s output layer (``get_output_embeddings``) with a ``PrunedHead`` keeping ``ids``; the
    input embedding keeps its own weights. Marks the model (``model.pad_vocab = N``) so that its measured forward
    costs are kept apart. Returns N."""
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear:
        raise ValueError(f"the output layer is a {type(head).__name__}, not an nn.Linear: prune before other changes")
    pruned = PrunedHead(head, ids)
    model.set_output_embeddings(pruned)
    model.pad_vocab = pruned.inner.out_features
    return model.pad_vocab


def frequent_ids(n: int, name: str = "qwen2.5") -> torch.Tensor:
    """The ``n`` most frequent token ids of the shipped counts ``pad/vocab/<name>.json`` (most frequent first)."""
    path = VOCAB_DIR / f"{name}.json"
    if not path.is_file():
        raise FileNotFoundError(f"no token frequencies at {path}: python bench/token_frequencies.py writes them")
    ids = json.loads(path.read_text())["ids"]
    if not 1 <= n <= len(ids):
        raise ValueError(f"the shipped frequencies rank {len(ids)} tokens; choose 1 to {len(ids)}, got {n}")
    return torch.tensor(ids[:n], dtype=torch.long)
