"""Batched continuations over a shared, left-padded cache equal plain decoding from scratch."""
import pytest
import torch
from scipy.stats import chisquare

from pad.decoding.hf import returned_cache
from pad.pivots.rollout import Start, continue_batch
from tiny import ARCHS, greedy_from_scratch, tiny_model


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_rows_equal_decoding_from_scratch(arch):
    model = tiny_model(arch)
    g = torch.Generator().manual_seed(ARCHS.index(arch))
    seq = torch.randint(0, 96, (1, 20), generator=g)
    with torch.inference_mode():
        cache = returned_cache(model(seq, use_cache=True))
        lengths = [1, 20, 7, 13, 7, 3]
        tokens = torch.randint(0, 96, (len(lengths),), generator=g).tolist()
        prefix = lambda i: seq[0, : lengths[i]].tolist() + [tokens[i]]  # noqa: E731
        # An EOS the decode really meets mid-row, and one row that starts on an EOS.
        free = [greedy_from_scratch(model, prefix(i), 9, set()) for i in range(len(lengths))]
        row, stop = next((i, j) for i in (0, 1, 2, 3, 5) for j in range(1, 9)
                         if free[i][j] not in free[i][:j] and free[i][j] != tokens[i])
        eos = {free[row][stop]}
        tokens[4] = next(iter(eos))
        got = continue_batch(model, cache, [Start(n, t) for n, t in zip(lengths, tokens)], vocab=96,
                             max_new_tokens=9, eos=eos)
        want = [[] if tokens[i] in eos else greedy_from_scratch(model, prefix(i), 9, eos) for i in range(len(lengths))]
        assert got == want
        assert len(got[row]) == stop + 1 and got[4] == []
        # The last rows in the batch meet an EOS together (the batch empties before the token budget).
        both = continue_batch(model, cache, [Start(lengths[row], tokens[row])] * 2, vocab=96, max_new_tokens=9, eos=eos)
        assert both == [want[row]] * 2
        assert cache.get_seq_length() == 20  # the shared cache is left as it was


def test_sampled_first_token_follows_the_tempered_softmax():
    model = tiny_model("qwen2", vocab=8, hidden=16)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # spread the logits so that the temperature matters
    seq = torch.tensor([[1, 5, 2, 7, 3]])
    temperature = 0.8
    with torch.inference_mode():
        cache = returned_cache(model(seq, use_cache=True))
        probs = torch.softmax(model(torch.tensor([[1, 5, 2, 4]])).logits[0, -1].double() / temperature, -1)
        n = 4000
        rows = continue_batch(model, cache, [Start(3, 4)] * n, vocab=8, max_new_tokens=1, eos=set(),
                              temperature=temperature, generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(torch.tensor([r[0] for r in rows]), minlength=8).double()
    assert chisquare(counts.numpy(), (probs * n).numpy()).pvalue > 1e-3
    # The test has power: the untempered softmax is rejected.
    untempered = torch.softmax(model(torch.tensor([[1, 5, 2, 4]])).logits[0, -1].double(), -1).detach()
    assert chisquare(counts.numpy(), (untempered * n).numpy()).pvalue < 1e-3


def test_bad_start_length_is_a_clear_error():
    model = tiny_model("llama")
    with torch.inference_mode():
        cache = returned_cache(model(torch.tensor([[1, 2, 3]]), use_cache=True))
    with pytest.raises(ValueError, match="start length"):
        continue_batch(model, cache, [Start(4, 1)], vocab=96, max_new_tokens=2, eos=set())
