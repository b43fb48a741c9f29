"""policy="exact" at temperature 0 must reproduce the target's own greedy decoding token for token."""
import pytest
import torch

import pad
from tiny import ARCHS, tiny_pair

NUM_PROMPTS = 30


def _prompts(vocab, seed):
    g = torch.Generator().manual_seed(seed)
    for i in range(NUM_PROMPTS):
        length = int(torch.randint(1, 13, (1,), generator=g))
        yield i, torch.randint(0, vocab, (1, length), generator=g)


@pytest.fixture(scope="module", params=ARCHS)
def pair(request):
    return request.param, *tiny_pair(request.param)


# The fast tier decodes the first 10 prompts of each case; the slow tier the other 20.
PARTS = [pytest.param(range(0, 10), id="prompts0-9"), pytest.param(range(10, NUM_PROMPTS), id="prompts10-29",
                                                                  marks=pytest.mark.slow)]


@pytest.mark.parametrize("part", PARTS)
@pytest.mark.parametrize("k", [1, 3, 8])
def test_exact_greedy_matches_target_generate(pair, k, part):
    arch, target, draft = pair
    vocab = target.config.vocab_size
    blocks_with_mid_eos = 0
    for i, prompt in _prompts(vocab, seed=100 * k + len(arch)):
        if i not in part:
            continue
        # Odd budgets end mid-block; every third prompt stops at an EOS taken from the target's own output.
        max_new = 13 + (i % 5) * 4
        eos = None
        if i % 3 == 0:
            free = target.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                   max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=0)
            eos = int(free[0, prompt.shape[1] + 5 + i % 4])
        expected = target.generate(
            prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=max_new,
            eos_token_id=eos, pad_token_id=0,
        )
        blocks = []
        got = pad.generate(
            target, draft, prompt, policy="exact", num_draft_tokens=k, max_new_tokens=max_new,
            eos_token_id=eos, callback=lambda toks, stats: blocks.append(list(toks)),
        )
        assert got.sequences.tolist() == expected.tolist(), f"{arch} K={k} prompt {i}"
        assert got.stats.new_tokens == expected.shape[1] - prompt.shape[1]
        if eos is not None and blocks and blocks[-1][-1] == eos and len(blocks[-1]) < k + 1:
            blocks_with_mid_eos += 1
    if k > 1:
        # The cases above must really have exercised an EOS in the middle of a block.
        assert blocks_with_mid_eos > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_stop_tokens_resolve_as_transformers_does(arch):
    """Generation config EOS None, model config EOS set: transformers' generate never stops early, so
    pad.generate must not either (it used to fall back to the model config's EOS and stop)."""
    target, draft = tiny_pair(arch)
    vocab = target.config.vocab_size
    g = torch.Generator().manual_seed(7 + len(arch))
    stops_early = 0
    for i in range(6):
        prompt = torch.randint(0, vocab, (1, 4 + i), generator=g)
        free = target.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=24,
                               min_new_tokens=24, pad_token_id=0)
        target.config.eos_token_id = draft.config.eos_token_id = int(free[0, prompt.shape[1] + 3])
        assert target.generation_config.eos_token_id is None
        expected = target.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                   max_new_tokens=24, pad_token_id=0)
        got = pad.generate(target, draft, prompt, policy="exact", num_draft_tokens=3, max_new_tokens=24)
        assert got.sequences.tolist() == expected.tolist(), f"{arch} prompt {i}"
        stops_early += expected.shape[1] == prompt.shape[1] + 4
    # The model config's EOS really is the token at position 4: stopping there would have been the bug.
    assert stops_early == 0 and got.sequences.shape[1] == prompt.shape[1] + 24
