"""How the GPU backends cut the vocabulary into slices per position (flash-decoding's split): enough
slices that the grid fills the GPU, none shorter than ``MIN_SPLIT`` logits."""
from __future__ import annotations

import functools

import torch

# Programs (thread blocks) to aim for per streaming multiprocessor: each keeps one chunk of logits in
# flight, so an SM needs several at once to hide the loads' latency (8 fit at once on sm_90 for both
# backends' stats kernels; ``bench/perf_model.py``).
PROGRAMS_PER_SM = 8
MIN_SPLIT = 1024  # logits per slice at least: smaller slices cost more in the merge than they save


def split_plan(positions: int, V: int, sm_count: int | None, splits: int | None = None) -> tuple[int, int]:
    """(S, split_len): the vocabulary cut into S slices of ``split_len`` logits so that ``positions`` x S
    programs fill ``sm_count`` multiprocessors (S = 1 when the positions alone do, or without a GPU);
    ``splits`` asks for a count instead (tests). The last slice may be shorter."""
    if splits is None:
        want = 1 if not sm_count else -(-PROGRAMS_PER_SM * sm_count // max(positions, 1))
        splits = max(1, min(want, V // MIN_SPLIT))
    if splits < 1:
        raise ValueError(f"splits must be at least 1, got {splits}")
    split_len = -(-V // splits) if V else 1
    return max(1, -(-V // split_len)), split_len  # more slices than logits asked for: one logit each


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int | None:
    """Multiprocessors of a CUDA device (read once per device), None for other devices."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else None
