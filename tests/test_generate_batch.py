"""Batched decoding: every row of a [B, P] left-padded batch decodes exactly as it would alone."""
import importlib
import warnings

import pytest
import torch

import pad
import pad.decoding.decoder
import pad_kernels.verify_ref as ref
from schedules import Schedule
from test_generate_pivot import _classifier
from test_sampling_distribution import ALPHA, _p_value, _target_joint, _wrong_residual
from tiny import ARCHS, tiny_model, tiny_pair

BATCHES = 30


def _batch(rows: list[list[int]], pad_id=0):
    """Left-pad token lists -> (input_ids [B, P], attention_mask [B, P])."""
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    return ids, mask


def _cases(vocab, seed):
    """(B, K, rows of prompt tokens, budget, row whose own output gives the EOS or None) per batch."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, K) for B in (2, 3, 8) for K in (1, 3, 8)]
    for i in range(BATCHES):
        B, K = shapes[i % len(shapes)]
        rows = [torch.randint(0, vocab, (int(torch.randint(1, 21, (1,), generator=g)),), generator=g).tolist()
                for _ in range(B)]
        yield i, B, K, rows, 9 + (i % 6) * 3, (i % B if i % 3 == 0 else None)


@pytest.fixture(scope="module", params=ARCHS)
def pair(request):
    return request.param, *tiny_pair(request.param)


def _alone(target, row, max_new, eos):
    prompt = torch.tensor([row])
    out = target.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=max_new,
                          eos_token_id=eos, pad_token_id=0)
    return out[0, len(row):].tolist()


@pytest.mark.parametrize("part", [pytest.param(range(0, 9), id="batches0-8"),  # every (B, K) once: the fast tier
                                  pytest.param(range(9, BATCHES), id="batches9-29", marks=pytest.mark.slow)])
def test_exact_batched_rows_equal_target_generate_alone(pair, part):
    arch, target, draft = pair
    vocab = target.config.vocab_size
    eos_mid_block = shorter_rows = 0
    for i, B, K, rows, max_new, eos_row in _cases(vocab, seed=len(arch)):
        if i not in part:
            continue
        eos = None
        if eos_row is not None:  # an EOS that row eos_row emits at its 6th token: it ends early, others may not
            eos = _alone(target, rows[eos_row], 6, None)[5]
        expected = [_alone(target, r, max_new, eos) for r in rows]
        ids, mask = _batch(rows, pad_id=7)
        blocks = []
        got = pad.generate(target, draft, ids, attention_mask=mask, policy="exact", num_draft_tokens=K,
                           max_new_tokens=max_new, eos_token_id=eos, pad_token_id=3,
                           callback=lambda toks, stats: blocks.append(toks))
        P = ids.shape[1]
        assert got.lengths.tolist() == [len(e) for e in expected], f"{arch} batch {i}"
        for r, e in enumerate(expected):
            assert got.sequences[r, P : P + len(e)].tolist() == e, f"{arch} batch {i} row {r}"
            assert (got.sequences[r, P + len(e):] == 3).all()  # right-padded with pad_token_id
        assert torch.equal(got.sequences[:, :P], ids)  # the input as given
        assert [s.new_tokens for s in got.row_stats] == got.lengths.tolist()
        assert got.stats.new_tokens == sum(got.lengths.tolist())
        assert got.stats.target_forwards == sum(s.target_forwards for s in got.row_stats)
        shorter_rows += len(set(got.lengths.tolist())) > 1
        for block in blocks:  # a row that ended at an EOS with fewer tokens than its block held
            eos_mid_block += any(t and t[-1] == eos and len(t) < K + 1 for t in block)
    assert eos_mid_block > 0 and shorter_rows > 0  # the cases really had rows ending mid-block and early


def test_pivot_rows_at_batch_size_one_and_more_agree():
    target, draft = tiny_pair("qwen2", scale=0.3)
    clf = _classifier(target, 0)
    g = torch.Generator().manual_seed(5)
    for trial in range(4):
        rows = [torch.randint(0, 96, (int(torch.randint(1, 15, (1,), generator=g)),), generator=g).tolist()
                for _ in range(3 + trial)]
        alone = [pad.generate(target, draft, torch.tensor([r]), classifier=clf, sigma=0.5, num_draft_tokens=4,
                              max_new_tokens=20) for r in rows]
        ids, mask = _batch(rows)
        batched = pad.generate(target, draft, ids, attention_mask=mask, classifier=clf, sigma=0.5,
                               num_draft_tokens=4, max_new_tokens=20)
        for r, a in enumerate(alone):
            n = int(batched.lengths[r])
            assert batched.sequences[r, ids.shape[1] : ids.shape[1] + n].tolist() == a.sequences[0, len(rows[r]):].tolist()
            assert batched.row_stats[r].relaxed_accepted == a.stats.relaxed_accepted
            assert batched.row_stats[r].accepted == a.stats.accepted
    assert sum(s.relaxed_accepted for s in batched.row_stats) > 0  # the classifier really accepted tokens


def _batched_pairs(target, draft, rows, samples, backend=None, copies=2000, k=2):
    """Counts [len(rows), V * V] of each row's first two new tokens over ``samples`` draws: every call
    decodes ``copies`` of each row, interleaved, so rows of different lengths share every batch; the
    copies draw their own random numbers (identical copies would show as overdispersion). ``k``: the
    draft length, or a callable making a fresh chooser per call."""
    assert samples % copies == 0
    V = target.config.vocab_size
    counts = torch.zeros(len(rows), V * V, dtype=torch.long)
    ids, mask = _batch(rows * copies)
    P = ids.shape[1]
    for seed in range(samples // copies):
        out = pad.generate(target, draft, ids, attention_mask=mask, policy="exact",
                           num_draft_tokens=k() if callable(k) else k, max_new_tokens=2, temperature=0.8, top_p=0.9,
                           seed=seed, backend=backend).sequences
        pairs = out[:, P] * V + out[:, P + 1]
        for r in range(len(rows)):
            counts[r] += torch.bincount(pairs[r :: len(rows)], minlength=V * V)
    return counts


def _sampling_pair():
    """A target and an unrelated draft over 8 tokens, three prompts of different lengths, and the target's
    joint distribution of each prompt's first two tokens."""
    target = tiny_model("llama", 8, hidden=16, layers=1, seed=3)
    draft = tiny_model("llama", 8, hidden=16, layers=1, seed=4)
    rows = [[1, 5, 2], [6], [3, 3, 0, 7]]
    return target, draft, rows, [_target_joint(target, torch.tensor([r]), 0.8, 0.9) for r in rows]


def test_batched_sampling_keeps_each_rows_target_distribution(monkeypatch):
    target, draft, rows, joints = _sampling_pair()
    counts = _batched_pairs(target, draft, rows, 10_000)
    for r in range(len(rows)):
        assert _p_value(counts[r], joints[r]) > ALPHA, f"row {r}"
    monkeypatch.setattr(ref, "residual_probs", _wrong_residual)
    counts = _batched_pairs(target, draft, rows, 10_000, backend="torch")
    assert min(_p_value(counts[r], joints[r]) for r in range(len(rows))) < ALPHA
    # A seed makes a batched call reproducible.
    ids, mask = _batch(rows)
    a, b = (pad.generate(target, draft, ids, attention_mask=mask, max_new_tokens=12, temperature=1.0, seed=9)
            for _ in range(2))
    assert torch.equal(a.sequences, b.sequences)


@pytest.mark.slow
def test_batched_sampling_with_k_per_block_keeps_each_rows_target_distribution():
    """K chosen per block: a plain target step then a block of one draft, and the reverse (the schedules'
    exactness is in the fast tier: test_draft_length.py)."""
    target, draft, rows, joints = _sampling_pair()
    for ks in ([0, 1], [1, 0]):
        counts = _batched_pairs(target, draft, rows, 10_000, k=lambda: Schedule(ks))
        for r in range(len(rows)):
            assert _p_value(counts[r], joints[r]) > ALPHA, f"schedule {ks} row {r}"


class Spy:
    """Records each Decoder's state after every block: which tokens each row's cache columns hold and
    which of them the row attends to."""

    def __init__(self, monkeypatch):
        self.decoders = []
        real_init, real_forward = pad.decoding.decoder.Decoder.__init__, pad.decoding.decoder.Decoder.forward

        def init(dec, model, vocab, rows, **kwargs):
            real_init(dec, model, vocab, rows, **kwargs)
            dec.spy_tokens = torch.zeros((rows, 0), dtype=torch.long)  # token id of every cache column
            dec.spy_rows = list(range(rows))  # call row of each batch row
            self.decoders.append(dec)

        def forward(dec, ids, fed, keep):
            dec.spy_tokens = torch.cat([dec.spy_tokens, ids.cpu()], 1)
            return real_forward(dec, ids, fed, keep)

        real_drop, real_select, real_compact = (pad.decoding.decoder.Decoder.drop, pad.decoding.decoder.Decoder.select,
                                                pad.decoding.decoder.Decoder.compact)

        def select(dec, rows):
            dec.spy_tokens = dec.spy_tokens[rows]
            dec.spy_rows = [dec.spy_rows[j] for j in rows]
            real_select(dec, rows)

        def compact(dec):
            dec.spy_tokens = dec.spy_tokens[:, : dec.valid_host.shape[1]]  # drop() may have cropped first
            before = [dec.spy_tokens[b][dec.valid_host[b]] for b in range(dec.valid_host.shape[0])]
            real_compact(dec)
            width = dec.valid_host.shape[1]
            dec.spy_tokens = torch.full((len(before), width), -1, dtype=torch.long)
            for b, t in enumerate(before):
                dec.spy_tokens[b, width - len(t):] = t

        def drop(dec, holes):
            real_drop(dec, holes)
            dec.spy_tokens = dec.spy_tokens[:, : dec.valid_host.shape[1]]  # a crop; compaction rewrites it

        monkeypatch.setattr(pad.decoding.decoder.Decoder, "__init__", init)
        monkeypatch.setattr(pad.decoding.decoder.Decoder, "forward", forward)
        monkeypatch.setattr(pad.decoding.decoder.Decoder, "select", select)
        monkeypatch.setattr(pad.decoding.decoder.Decoder, "compact", compact)
        monkeypatch.setattr(pad.decoding.decoder.Decoder, "drop", drop)

    @staticmethod
    def attended(dec, b):
        return dec.spy_tokens[b][dec.valid_host[b]].tolist()


@pytest.mark.parametrize("lengths", ["fixed", "schedule"])
@pytest.mark.parametrize("compact_at", [0.5, 0.0])
@pytest.mark.parametrize("policy,temperature", [("exact", 0.0), ("exact", 1.0), ("pivot", 0.0)])
def test_cache_invariant_after_every_block(monkeypatch, policy, temperature, compact_at, lengths):
    """Fixed K = 4, or a K per block with K = 0 blocks (plain target steps: the draft does not run, so it
    falls one more token behind per such block and catches up at the next block that drafts)."""
    target, draft = tiny_pair("llama", scale=0.5)
    chooser = Schedule([0, 0, 2, 0, 4, 0, 0, 0, 1, 3]) if lengths == "schedule" else None
    k = chooser if chooser is not None else 4
    monkeypatch.setattr(pad.decoding.decoder, "COMPACT_AT", compact_at)  # 0: gather the holes out after every block
    clf = _classifier(target, 1) if policy == "pivot" else None
    spy = Spy(monkeypatch)
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(0, 96, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(5)]
    committed = [list(r) for r in rows]
    checked = {"blocks": 0, "compactions": 0}

    def check(tokens, stats):
        tgt, drf = spy.decoders
        for r, t in enumerate(tokens):
            committed[r] += t
        for b, r in enumerate(tgt.spy_rows):
            # The target attends to exactly the row's prompt and committed tokens but the newest (unseen).
            assert spy.attended(tgt, b) == committed[r][:-1], f"block {checked['blocks']} row {r}"
            # The draft to a prefix of them: it has not seen the newest one or two, nor the tokens of the K = 0
            # blocks since it last ran (nothing at all before its first block).
            d = spy.attended(drf, b) if drf.valid_host.shape[1] else []
            chosen = chooser.chosen if chooser is not None else [4]
            behind = len(chosen) - max((i + 1 for i, c in enumerate(chosen) if c), default=0)
            if behind == len(chosen):
                assert d == []
            else:
                assert d == committed[r][: len(d)]
                assert len(committed[r]) - 2 - behind <= len(d) <= len(committed[r]) - 1 - behind
        checked["blocks"] += 1

    ids, mask = _batch(rows)
    out = pad.generate(target, draft, ids, attention_mask=mask, policy=policy, classifier=clf, sigma=0.6,
                       num_draft_tokens=k, max_new_tokens=40, temperature=temperature, seed=1, callback=check)
    tgt, drf = spy.decoders
    for r in range(len(rows)):
        assert committed[r] == rows[r] + out.sequences[r, ids.shape[1] : ids.shape[1] + out.lengths[r]].tolist()
    assert checked["blocks"] == max(s.target_forwards for s in out.row_stats)
    if chooser is not None:
        assert chooser.chosen.count(0) >= 5 and out.stats.draft_lengths[0] == chooser.chosen.count(0)
    if compact_at == 0.0 and chooser is None:
        assert tgt.compactions > 0 and drf.compactions > 0
        # Gathering the holes out changes no token: the same call without it decodes the same.
        monkeypatch.setattr(pad.decoding.decoder, "COMPACT_AT", 2.0)
        again = pad.generate(target, draft, ids, attention_mask=mask, policy=policy, classifier=clf, sigma=0.6,
                             num_draft_tokens=4, max_new_tokens=40, temperature=temperature, seed=1)
        assert spy.decoders[-2].compactions == 0 and torch.equal(again.sequences, out.sequences)


def test_tokens_fed_per_row_without_reprefill(monkeypatch):
    """Per row: the target is fed prompt + committed + rejected drafts, less the newest committed token."""
    target, draft = tiny_pair("llama", scale=0.5)
    fed = {}
    real_select = pad.decoding.decoder.Decoder.select

    def select(dec, rows):  # remember what leaving rows were fed
        for j in set(range(len(dec.spy_rows))) - set(rows):
            fed.setdefault(id(dec), {})[dec.spy_rows[j]] = int(dec.tokens_fed[j])
        dec.spy_rows = [dec.spy_rows[j] for j in rows]
        real_select(dec, rows)

    real_init = pad.decoding.decoder.Decoder.__init__

    def init(dec, model, vocab, rows, **kwargs):
        real_init(dec, model, vocab, rows, **kwargs)
        dec.spy_rows = list(range(rows))
        decs.append(dec)

    decs, ks = [], []
    module = importlib.import_module("pad.decoding.speculative")  # the module (pad.generate is the function)
    real_verify = module.verify_block

    def verify(target_logits, draft_tokens, *args, **kwargs):
        ks.append(draft_tokens.shape[1])  # drafts the target verified for every live row in this block
        return real_verify(target_logits, draft_tokens, *args, **kwargs)

    monkeypatch.setattr(pad.decoding.decoder.Decoder, "__init__", init)
    monkeypatch.setattr(pad.decoding.decoder.Decoder, "select", select)
    monkeypatch.setattr(module, "verify_block", verify)
    rows = [[5, 9, 11], [40], [3, 1, 4, 1, 5, 9, 2, 6], [8, 8]]
    ids, mask = _batch(rows)
    out = pad.generate(target, draft, ids, attention_mask=mask, num_draft_tokens=3, max_new_tokens=27)
    tgt = decs[0]
    for j, r in enumerate(tgt.spy_rows):  # rows still in the batch at the end
        fed.setdefault(id(tgt), {})[r] = int(tgt.tokens_fed[j])
    uncut = 0
    for r, s in enumerate(out.row_stats):
        verified = sum(ks[: s.target_forwards])  # rows only leave: row r took part in the first blocks
        # Each target forward feeds the row's newest committed token and the block's drafts; the first one
        # the prompt instead of that token: nothing is ever fed twice.
        assert fed[id(tgt)][r] == len(rows[r]) + verified + s.target_forwards - 1
        if s.new_tokens == s.accepted + s.target_forwards:  # no block cut short by the budget
            uncut += 1  # then: prompt + committed + rejected drafts, less the newest committed token
            assert fed[id(tgt)][r] == len(rows[r]) + s.new_tokens + (verified - s.accepted) - 1
    assert uncut > 0  # the second identity was really checked
    assert len(set(ks)) > 1  # blocks of different lengths (near the budget)


def test_bad_batches():
    target, draft = tiny_pair("llama")
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    with pytest.raises(ValueError, match="right padding"):
        pad.generate(target, draft, ids, attention_mask=torch.tensor([[1, 1, 1], [1, 1, 0]]))
    with pytest.raises(ValueError, match="row 1 of the batch is only padding"):
        pad.generate(target, draft, ids, attention_mask=torch.tensor([[1, 1, 1], [0, 0, 0]]))
    with pytest.raises(ValueError, match="attention_mask must have the shape of input_ids"):
        pad.generate(target, draft, ids, attention_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match="only 0"):
        pad.generate(target, draft, ids, attention_mask=torch.full((2, 3), 2))


@pytest.mark.parametrize("policy", ["exact", "target", "draft"])
def test_warns_when_the_caches_of_a_whole_call_exceed_the_memory_left(monkeypatch, policy):
    target, draft = tiny_pair("llama")
    module = importlib.import_module("pad.decoding.generate")
    ids, mask = _batch([[1, 2, 3], [4, 5, 6, 7, 8]])

    def kv(model):  # keys and values of every layer, fp32
        c = model.config
        return 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 4

    models = {"target": [target], "draft": [draft]}.get(policy, [target, draft])
    need = 2 * (5 + 6) * sum(kv(m) for m in models)  # both rows as long as the longest prompt + 6 new tokens
    for free, warns in ((need - 1, True), (need, False), (None, False)):
        monkeypatch.setattr(module, "available_memory", lambda free=free: free)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = pad.generate(target, draft, ids, attention_mask=mask, policy=policy, max_new_tokens=6)
        said = [str(w.message) for w in caught if "KV cache" in str(w.message)]
        assert len(said) == int(warns), (free, said)
        if warns:
            assert said[0].startswith("2 rows of up to 11 tokens need up to"), said[0]
        assert out.sequences.shape[0] == 2  # a warning, not a refusal: rows that stop early need less
