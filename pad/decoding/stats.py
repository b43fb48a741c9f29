"""Counters of one generation and the rates derived from them."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields


@dataclass
class GenerationStats:
    target_forwards: int = 0
    draft_forwards: int = 0
    drafted: int = 0  # draft tokens proposed to the target
    accepted: int = 0  # draft tokens committed (relaxed-accepted included)
    # committed only because the policy's relaxed rule allowed it (the pivot classifier, typical, threshold
    # or fly): draft tokens the exact rule would have rejected
    relaxed_accepted: int = 0
    new_tokens: int = 0
    prompt_tokens: int = 0
    wall_time: float = 0.0  # seconds
    draft_lengths: dict = field(default_factory=dict)  # K -> blocks decoded with K drafts (0: a plain target step)
    # num_draft_tokens="auto" (the whole call only): the chooser's predicted and the measured seconds of its
    # blocks, summed, and the mean of |predicted - measured| / measured per block
    predicted_time: float = 0.0
    timed_blocks_time: float = 0.0
    block_time_error: float = math.nan

    @property
    def pivot_accepted(self) -> int:
        """The name ``relaxed_accepted`` had before the training-free rules counted there too."""
        return self.relaxed_accepted

    @classmethod
    def from_dict(cls, d: dict) -> "GenerationStats":
        """The counters of ``to_dict`` (derived rates ignored); reads ``pivot_accepted`` of older logs."""
        d = dict(d)
        if "pivot_accepted" in d and "relaxed_accepted" not in d:
            d["relaxed_accepted"] = d["pivot_accepted"]
        d = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        if "draft_lengths" in d:  # JSON made its keys strings
            d["draft_lengths"] = {int(k): v for k, v in d["draft_lengths"].items()}
        return cls(**d)

    @property
    def mean_draft_length(self) -> float:
        """Mean K over the blocks (K = 0 blocks included); NaN without blocks."""
        blocks = sum(self.draft_lengths.values())
        return sum(k * n for k, n in self.draft_lengths.items()) / blocks if blocks else math.nan

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted (eta); NaN when nothing was drafted."""
        return self.accepted / self.drafted if self.drafted else float("nan")

    @property
    def mean_accepted_length(self) -> float:
        """New tokens per target forward (accepted + 1 per block); NaN without target forwards."""
        return self.new_tokens / self.target_forwards if self.target_forwards else float("nan")

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_time if self.wall_time > 0 else float("nan")

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "tokens_per_second": self.tokens_per_second,
            "mean_draft_length": self.mean_draft_length,
        }

    def summary(self) -> str:
        drafts = (f"acceptance rate {self.acceptance_rate:.1%} ({self.accepted}/{self.drafted}, "
                  f"{self.relaxed_accepted} by the relaxed rule)" if self.drafted else "no draft tokens")
        per_forward = f"{self.mean_accepted_length:.2f}" if self.target_forwards else "n/a"
        text = (
            f"{self.new_tokens} new tokens in {self.wall_time:.2f} s ({self.tokens_per_second:.2f} tok/s); "
            f"{drafts}; mean accepted length {per_forward}; "
            f"target forwards {self.target_forwards}, draft forwards {self.draft_forwards}"
        )
        if len(self.draft_lengths) > 1 or self.timed_blocks_time:
            histogram = ", ".join(f"{k}: {n}" for k, n in sorted(self.draft_lengths.items()))
            text += f"; mean K {self.mean_draft_length:.2f} (blocks per K: {histogram})"
        if self.timed_blocks_time:
            text += (f"; block time predicted {self.predicted_time:.2f} s, measured {self.timed_blocks_time:.2f} s "
                     f"(mean error per block {self.block_time_error:.0%})")
        return text
