"""The ``model`` drafter: a small causal LM drafting autoregressively in its own KV cache."""
from __future__ import annotations

import math

import torch

from ..decoder import Decoder, left_pad
from ..sampling import sampling_probs, warp_logits
from .base import Proposal, Sampling


class ModelDrafter:
    """Drafts with ``model`` (sharing the target's tokenizer), greedy or sampled as the decode is.

    draft_stop: a row stops drafting in a block after a draft token whose top probability under the draft
    is below it (that token is still proposed); the block drafts on while any row goes on.
    Rows that another source proposes for (``use_rows``: the hybrid drafter) still feed the
    model, which runs over the whole batch; their model drafts are not proposed.
    """

    name = "model"
    has_logits = True

    def __init__(self, model, draft_stop: float | None = None):
        if draft_stop is not None and not (isinstance(draft_stop, (int, float)) and 0.0 <= draft_stop <= 1.0):
            raise ValueError(f"draft_stop must be None or a probability in [0, 1], got {draft_stop!r}")
        self.model = model
        self.draft_stop = draft_stop
        self.cost = None  # a cost model with predict(rows, tokens, columns), set by num_draft_tokens="auto"
        self.clock = None  # times forwards into ``cost`` (``ForwardClock``), set with it

    def start(self, batch, sampling: Sampling, device: torch.device, needs_logits: bool = False) -> None:
        # Its cache grows in place: a draft step feeds one token a row, where transformers' cache would copy the
        # whole cache every step (bench/README.md, "What a draft token costs").
        self.decoder = Decoder(self.model, batch.vocab, len(batch), grow_in_place=True)
        self.sampling, self.device, self.needs_logits = sampling, device, needs_logits
        self.pending = [list(p) for p in batch.prompts]  # committed tokens the model has not seen, per batch row
        self.ran = False  # whether the model drafted in the current block

    @property
    def width(self) -> int:
        return self.decoder.width

    def _forward(self, ids, fed) -> torch.Tensor:
        if self.clock is None:
            return self.decoder.forward(ids, fed, 1)
        return self.clock.forward(self.decoder, ids, fed, 1, self.cost)

    def propose(self, batch, k: int) -> Proposal:
        """k drafts per row, autoregressively; the first forward also feeds the committed tokens the model
        lacks. With draft_stop, one host sync per draft step."""
        b, s = len(batch), self.sampling
        ids, fed = left_pad(self.pending, self.decoder.device)
        drafts, probs, logits_kept = [], [], []
        stops = torch.full((b,), k, dtype=torch.long) if self.draft_stop is not None else None
        for step in range(k):
            logits = self._forward(ids, fed)[:, -1]  # [b, V]
            if self.needs_logits:  # the distribution the draft samples from, as the target's is warped
                logits_kept.append(warp_logits(logits, s.temperature, s.top_p).to(self.device))
            if s.generator is not None:
                q = sampling_probs(logits, s.temperature, s.top_p).to(self.device)  # the generator's device
                ids = torch.multinomial(q, 1, generator=s.generator)
                probs.append(q)
            else:
                ids = logits.argmax(-1, keepdim=True)
            fed = torch.ones((b, 1), dtype=torch.bool)
            drafts.append(ids)
            if stops is not None:
                top = (q if s.generator is not None else torch.softmax(logits.float(), -1)).max(-1).values.cpu()
                stops = torch.where((stops == k) & (top < self.draft_stop), step + 1, stops)
                if bool((stops <= step + 1).all()):
                    break
        k = len(drafts)  # fewer than asked when every row stopped (each length is then <= that)
        self.ran, self.k, self.used = True, k, [True] * b
        return Proposal(
            torch.cat(drafts, 1).to(self.device),
            lengths=stops,
            probs=torch.stack(probs, 1) if probs else None,
            logits=torch.stack(logits_kept, 1) if logits_kept else None,
            forwards=stops.tolist() if stops is not None else [k] * b,
        )

    def commit(self, batch, proposal: Proposal | None, accepted: list[int], kept: list[list[int]]) -> None:
        """The model fed [pending..., d_1..d_{k-1}]: each row keeps its accepted drafts there (those it was
        proposed from this model); the rest become holes and the committed tokens it lacks wait."""
        if not self.ran:
            for j, tokens in enumerate(kept):
                self.pending[j] = self.pending[j] + tokens
            return
        k = self.k
        holes = torch.zeros((len(kept), max(k - 1, 0)), dtype=torch.bool)
        for j, tokens in enumerate(kept):
            held = min(accepted[j], len(tokens) - 1, k - 1) if self.used[j] else 0
            holes[j, held:] = True
            self.pending[j] = tokens[held:]
        self.decoder.drop(holes)
        self.ran = False

    def use_rows(self, used: list[bool]) -> None:
        """Which rows' model drafts are proposed in the current block (the rest come from elsewhere)."""
        self.used = used

    def select(self, keep: list[int]) -> None:
        self.decoder.select(keep)
        self.pending = [self.pending[j] for j in keep]

    def seconds(self, k: int, rows: int) -> float:
        """The model's forwards for k drafts: the first over the tokens it has not seen, k - 1 over one. The
        catch-up beyond one token is left out: ``catch_up`` weighs it."""
        if not k:
            return 0.0
        if self.cost is None:
            return math.nan
        columns = self.decoder.width
        return self.cost.predict(rows, 1, columns) + (k - 1) * self.cost.predict(rows, 1, columns + 1)

    def catch_up(self, rows: int) -> float:
        """Extra seconds of feeding the committed tokens the model has not seen (beyond one per row)."""
        pending = max(map(len, self.pending))
        if self.cost is None or pending <= 1:
            return 0.0
        columns = self.decoder.width
        return max(0.0, self.cost.predict(rows, pending, columns) - self.cost.predict(rows, 1, columns))

    def finish(self, batch) -> None:
        pass
