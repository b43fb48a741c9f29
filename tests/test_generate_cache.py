"""Both KV caches persist across blocks: every forward is fed only unseen tokens, and after every block
each cache holds exactly committed tokens (the target all but the last one, which it has not seen yet)."""
import functools
import inspect

import pytest
import torch

import pad
from test_generate_pivot import _classifier
from tiny import tiny_pair


class Recorder:
    """Wraps a model's forward to log (cached length at entry, fed ids) and replay what its cache holds."""

    def __init__(self, model):
        self.calls, self.view, self.cache, self.model = [], [], None, model
        inner = model.forward
        # The cache's argument name in this transformers (5.24 renamed past_key_values to cache).
        name = "cache" if "cache" in inspect.signature(inner).parameters else "past_key_values"

        @functools.wraps(inner)  # the same signature, so the decoder calls it as it calls the model
        def forward(*args, input_ids=None, **kwargs):
            cache = kwargs.get(name)
            past = cache.get_seq_length() if cache is not None else 0
            ids = input_ids[0].tolist()
            self.calls.append((past, ids))
            assert past <= len(self.view)
            self.view = self.view[:past] + ids  # what the cache holds after this forward
            out = inner(*args, input_ids=input_ids, **kwargs)
            self.cache = out[name]
            return out

        model.forward = forward

    @property
    def fed(self) -> int:
        return sum(len(ids) for _, ids in self.calls)

    def cached(self) -> list[int]:
        return self.view[: self.cache.get_seq_length()]

    def close(self):
        del self.model.forward


@pytest.mark.parametrize("policy,temperature,k", [("exact", 0.0, 3), ("exact", 1.0, 5), ("pivot", 0.0, 4),
                                                  ("pivot", 0.8, 2)])
def test_no_reprefill_and_caches_hold_committed_tokens(policy, temperature, k):
    target, draft = tiny_pair("llama")
    clf = _classifier(target, 1) if policy == "pivot" else None
    rec_t, rec_d = Recorder(target), Recorder(draft)
    g = torch.Generator().manual_seed(k)
    for trial in range(4):
        prompt = torch.randint(0, 96, (1, 3 + trial), generator=g)
        P = prompt.shape[1]
        rec_t.calls, rec_d.calls, rec_t.view, rec_d.view = [], [], [], []
        committed = prompt[0].tolist()
        last = {"drafted": 0, "accepted": 0, "draft_cropped": 0, "blocks": 0}

        def check_block(tokens, stats):
            committed.extend(tokens)
            k_b, n_b = stats.drafted - last["drafted"], stats.accepted - last["accepted"]
            last.update(drafted=stats.drafted, accepted=stats.accepted, blocks=last["blocks"] + 1)
            # The target cache holds the committed tokens except the newest; the draft's is a prefix of them.
            assert rec_t.cached() == committed[:-1]
            assert rec_d.cached() == committed[: len(rec_d.cached())] and len(rec_d.cached()) <= len(committed) - 1
            if len(tokens) == n_b + 1:  # the block was not cut short by the token budget
                rejected = stats.drafted - stats.accepted
                assert rec_t.fed == P + (len(committed) - P - 1) + rejected
                last["draft_cropped"] += max(0, k_b - 1 - n_b)
                assert rec_d.fed == len(rec_d.cached()) + last["draft_cropped"]

        out = pad.generate(target, draft, prompt, policy=policy, classifier=clf, sigma=0.5, num_draft_tokens=k,
                           max_new_tokens=29, temperature=temperature, seed=trial, callback=check_block)
        assert out.sequences[0].tolist() == committed
        assert last["blocks"] == out.stats.target_forwards
        # Only the first forward of each model starts from an empty cache: the prompt is prefilled once.
        for rec in (rec_t, rec_d):
            assert [past for past, _ in rec.calls].count(0) == 1
        assert len(rec_t.calls) == out.stats.target_forwards and len(rec_d.calls) == out.stats.draft_forwards
    rec_t.close()
    rec_d.close()
