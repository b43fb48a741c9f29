"""Counters of one generation and the rates derived from them."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class GenerationStats:
    target_forwards: int = 0
    draft_forwards: int = 0
    drafted: int = 0  # draft tokens proposed to the target
    accepted: int = 0  # draft tokens committed (pivot-accepted included)
    pivot_accepted: int = 0  # committed only because the classifier allowed it
    new_tokens: int = 0
    prompt_tokens: int = 0
    wall_time: float = 0.0  # seconds

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
        }

    def summary(self) -> str:
        drafts = (f"acceptance rate {self.acceptance_rate:.1%} ({self.accepted}/{self.drafted}, "
                  f"{self.pivot_accepted} pivot-accepted)" if self.drafted else "no draft tokens")
        per_forward = f"{self.mean_accepted_length:.2f}" if self.target_forwards else "n/a"
        return (
            f"{self.new_tokens} new tokens in {self.wall_time:.2f} s ({self.tokens_per_second:.2f} tok/s); "
            f"{drafts}; mean accepted length {per_forward}; "
            f"target forwards {self.target_forwards}, draft forwards {self.draft_forwards}"
        )
