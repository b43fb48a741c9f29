"""The path-following (search) labeler on tiny models with a stub outcome: it takes exactly the decisions
a plain, cacheless walk of the rule takes, batched or not, and a killed job resumes without loss."""

import copy
import json
import math
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from pad.decoding.attention import FUSED_NAME, use_gqa_sdpa
from pad.decoding.drafters import LookupDrafter, Sampling, SuffixDrafter
from pad.decoding.hf import LayerCapture, eos_ids
from pad.decoding.onednn import use_onednn_linear
from pad.evaluation.tasks import Problem
from pad.pivots import label, search
from pad_kernels import attention, verify_block
from label_folders import assert_same_labels, assert_same_records, read_labels
from tiny import greedy_from_scratch, tiny_pair

CFG = search.SearchConfig(layer=-1, max_new_tokens=14, batch=4)


def _outcome(tokens):
    """Stub task: the 'answer' is the sum of the last four tokens mod 3; 'right' when it is not 0."""
    key = sum(tokens[-4:]) % 3
    return key, key != 0


# Both attention paths the labeler can run on: grouped SDPA, and the fused CPU kernel the CLI switches to.
ATTENTION = ["sdpa", "fused_cpu"] if attention.available() else ["sdpa"]


@pytest.fixture(scope="module", params=ATTENTION)
def setup(request):
    target, draft = tiny_pair("llama", scale=0.5)
    if request.param == "fused_cpu":
        assert use_gqa_sdpa(target, fused_cpu=True) and use_gqa_sdpa(draft, fused_cpu=True)
    g = torch.Generator().manual_seed(0)
    problems = [Problem(f"p{i}", "q", "0") for i in range(6)]
    prompts = [torch.randint(0, 96, (1, 3 + i % 3), generator=g) for i in range(6)]
    return target, draft, problems, prompts


def _taken(target, prompt: list[int], text: list[int], t: int, d: int, max_new: int, layer: int, eos):
    """Draft token d taken at text position t: the new text (the target greedy after it), the target's hidden
    state at the position and ``verify_block``'s result for d there, from plain forwards."""
    tail = [] if d in eos or max_new - t - 1 == 0 else greedy_from_scratch(target, prompt + text[:t] + [d],
                                                                           max_new - t - 1, eos)
    capture = LayerCapture(target, layer)
    capture.keep = 2
    res = verify_block(target(torch.tensor([prompt + text[:t] + [d]])).logits[:, -2:], torch.tensor([[d]]))
    capture.remove()
    return text[:t] + [d] + tail, capture.value[0, 0], res


@torch.inference_mode()
def _walk(target, draft, prompt: list[int], max_new: int, layer: int):
    """The rule, written plainly: full forwards without caches at every step."""
    eos = eos_ids(target, None)
    text = greedy_from_scratch(target, prompt, max_new, eos)
    key, correct = _outcome(text)
    pos, decisions = 0, []
    while True:
        logits = draft(torch.tensor([prompt + text])).logits[0]
        top = logits[len(prompt) - 1 : len(prompt) - 1 + len(text)].argmax(-1).tolist()
        t = next((t for t in range(pos, len(text)) if top[t] != text[t]), None)
        if t is None:
            return text, decisions
        d = top[t]
        new, hidden, res = _taken(target, prompt, text, t, d, max_new, layer, eos)
        q = torch.softmax(logits[len(prompt) - 1 + t].float(), -1)
        # KL(p_target || p_draft) at the decision, in fp64 from both models' plain forwards
        log_p = torch.log_softmax(target(torch.tensor([prompt + text[:t]])).logits[0, -1].double(), -1)
        log_q = torch.log_softmax(logits[len(prompt) - 1 + t].double(), -1)
        new_key, new_correct = _outcome(new)
        decisions.append({"position": t, "same_answer": int(new_key == key), "correct_before": int(correct),
                          "correct_after": int(new_correct), "hidden": hidden,
                          "token_prob": res.token_prob[0, 0], "entropy": res.entropy[0, 0], "draft_prob": q[d],
                          "divergence": (log_p.exp() * (log_p - log_q)).sum()})
        if new_key == key:
            text, correct = new, new_correct
        pos = t + 1


@pytest.mark.parametrize("chunk", [2, search.DRAFT_CHUNK])
def test_search_takes_the_decisions_of_the_plain_rule(setup, tmp_path, monkeypatch, chunk):
    # The draft scores the text a few positions at a time (2: many passes, each from a cropped cache).
    monkeypatch.setattr(search, "DRAFT_CHUNK", chunk)
    target, draft, problems, prompts = setup
    summary = search.run(problems, prompts, [_outcome] * 6, target, draft, tmp_path, CFG, progress=False)
    index, tensors = read_labels(tmp_path)
    assert [r["problem"] for r in sorted(index, key=lambda r: r["index"])] == [p.id for p in problems]
    kinds = switched = 0
    for problem, prompt in zip(problems, prompts):
        text, decisions = _walk(target, draft, prompt[0].tolist(), CFG.max_new_tokens, CFG.layer)
        t = tensors.get(problem.id, {})
        assert len(decisions) == (len(t["position"]) if t else 0), problem.id
        if not decisions:
            continue
        assert int(t["generated"]) == len(text)  # the final text is the walk's: it switched where it should
        for name in ("position", "same_answer", "correct_before", "correct_after"):
            assert t[name].tolist() == [d[name] for d in decisions], (problem.id, name)
        assert t["label"].tolist() == [1 - d["same_answer"] for d in decisions]
        for name in ("hidden", "token_prob", "entropy", "draft_prob", "divergence"):
            want = torch.stack([torch.as_tensor(d[name]).float() for d in decisions]).half().float()
            torch.testing.assert_close(t[name].float(), want, rtol=2e-3, atol=2e-3)
        kinds += len(set(t["same_answer"].tolist())) == 2
        # A decision after a harmless one is taken on the continuation (the text changed under it).
        switched += any(d["same_answer"] for d in decisions[:-1])
    assert kinds > 0 and switched > 0  # a planted pivot and a harmless token in one problem; a switch
    assert summary["records"] == sum(len(t["position"]) for t in tensors.values())


def test_batched_across_problems_writes_what_one_at_a_time_writes(setup, tmp_path, monkeypatch):
    target, draft, problems, prompts = setup
    calls = []
    kernel = attention.gqa_attention
    monkeypatch.setattr(attention, "gqa_attention", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    for b in (1, 4):
        # One problem at a time without guessed tokens, against batched with them.
        cfg = search.SearchConfig(layer=-1, max_new_tokens=14, batch=b, lookahead=0 if b == 1 else 4)
        search.run(problems, prompts, [_outcome] * 6, target, draft, tmp_path / f"b{b}", cfg, progress=False)
    assert_same_labels(tmp_path / "b1", tmp_path / "b4")
    assert bool(calls) == (target.config._attn_implementation == FUSED_NAME)  # the path under test ran


def test_on_onednn_linear_layers_it_writes_what_it_writes_on_dense_ones(setup, tmp_path):
    # The CLI runs the labeler in fp32 on oneDNN's linear layers (pad.decoding.onednn): only rounding differs.
    target, draft, problems, prompts = setup
    fast = [copy.deepcopy(m) for m in (target, draft)]
    assert all(use_onednn_linear(m) > 0 for m in fast)
    search.run(problems, prompts, [_outcome] * 6, target, draft, tmp_path / "dense", CFG, progress=False)
    search.run(problems, prompts, [_outcome] * 6, *fast, tmp_path / "onednn", CFG, progress=False)
    assert_same_labels(tmp_path / "dense", tmp_path / "onednn")
    assert read_labels(tmp_path / "onednn")[1]  # decisions were taken


FREE = {"lookup": LookupDrafter, "suffix": SuffixDrafter}


@torch.inference_mode()
def _free_walk(target, prompt: list[int], max_new: int, layer: int, drafter: str, k: int):
    """The block rule of a draft-free drafter, written plainly: at each block's start a new drafter reads
    prompt + text so far; the first draft unlike the text is a decision; a harmless one keeps the block going
    over the continuation, a pivot ends it; a block whose drafts all match ends with the target's token."""
    eos = eos_ids(target, None)
    text = greedy_from_scratch(target, prompt, max_new, eos)
    key, correct = _outcome(text)
    t, block, decisions = 0, None, []
    while t < len(text):
        if block is None:
            fresh = FREE[drafter]()
            fresh.start(SimpleNamespace(prompts=[prompt + text[:t]]), Sampling(), torch.device("cpu"))
            tokens, n = fresh.matches(k)[0]
            block = (t, tokens, n) if tokens else None
            t += not tokens
            continue
        start, tokens, n = block
        j = t - start
        if j == len(tokens) or tokens[j] == text[t]:
            block = None if j == len(tokens) else block
            t += 1
            continue
        d = tokens[j]
        new, hidden, res = _taken(target, prompt, text, t, d, max_new, layer, eos)
        new_key, new_correct = _outcome(new)
        decisions.append({"position": t, "same_answer": int(new_key == key), "correct_before": int(correct),
                          "correct_after": int(new_correct), "hidden": hidden,
                          "token_prob": res.token_prob[0, 0], "entropy": res.entropy[0, 0],
                          "source": search.SOURCE_IDS[drafter], "match": n, "offset": j})
        if new_key == key:
            text, correct = new, new_correct
        else:
            block = None
        t += 1
    return text, decisions


@pytest.mark.parametrize("drafter", sorted(FREE))
def test_search_on_draft_free_proposals_takes_the_decisions_of_the_block_rule(setup, tmp_path, drafter):
    target, draft, problems, prompts = setup
    # (24 tokens: the tiny model's texts repeat enough there for suffix's matches to miss both ways)
    cfg = search.SearchConfig(layer=-1, max_new_tokens=24, batch=4, drafter=drafter, proposal_tokens=4)
    # No draft model: a draft-free drafter's proposals need none (the CLI does not load it).
    summary = search.run(problems, prompts, [_outcome] * 6, target, None, tmp_path, cfg, progress=False)
    index, tensors = read_labels(tmp_path)
    assert sorted(r["problem"] for r in index) == sorted(p.id for p in problems)
    kinds = switched = inside = 0
    for problem, prompt in zip(problems, prompts):
        text, decisions = _free_walk(target, prompt[0].tolist(), cfg.max_new_tokens, cfg.layer, drafter, 4)
        t = tensors.get(problem.id, {})
        assert len(decisions) == (len(t["position"]) if t else 0), problem.id
        if not decisions:
            continue
        assert int(t["generated"]) == len(text)
        for name in ("position", "same_answer", "correct_before", "correct_after", "source", "match", "offset"):
            assert t[name].tolist() == [d[name] for d in decisions], (problem.id, name)
        for name in ("hidden", "token_prob", "entropy"):
            want = torch.stack([torch.as_tensor(d[name]).float() for d in decisions]).half().float()
            torch.testing.assert_close(t[name].float(), want, rtol=2e-3, atol=2e-3)
        # A proposal is deterministic (probability 1, entropy 0), and has no distribution to diverge from.
        assert t["draft_prob"].tolist() == [1.0] * len(decisions) and not t["draft_entropy"].any()
        assert all(math.isnan(x) for x in t["divergence"].tolist())
        kinds += len(set(t["same_answer"].tolist())) == 2
        switched += any(d["same_answer"] for d in decisions[:-1])
        inside += any(d["offset"] > 0 for d in decisions)  # a decision past a proposal's first token
    assert kinds > 0 and switched > 0 and inside > 0
    assert summary["records"] == sum(len(t["position"]) for t in tensors.values())
    assert json.loads((tmp_path / "meta.json").read_text())["drafter"] == drafter


def test_search_config_refuses_an_unknown_drafter():
    with pytest.raises(ValueError, match="unknown drafter 'ngram'"):
        search.SearchConfig(drafter="ngram")
    with pytest.raises(ValueError, match="proposal_tokens"):
        search.SearchConfig(drafter="lookup", proposal_tokens=0)
    # A folder labeled on the model's drafts records no drafter (folders from before draft-free drafters resume).
    assert "drafter" not in search.SearchConfig().settings()


def test_search_of_the_draft_models_tokens_refuses_to_run_without_it(setup, tmp_path):
    target, _, problems, prompts = setup
    with pytest.raises(ValueError, match="need the draft model"):
        search.run(problems, prompts, [_outcome] * 6, target, None, tmp_path, CFG, progress=False)
    assert not (tmp_path / "meta.json").exists()


# (the draft-free drafters' texts hold fewer decisions: killed late, the last problem is still in its greedy text)
@pytest.mark.parametrize("drafter,killed_at", [("model", k) for k in (1 / 4, 1 / 2, 3 / 4)]
                         + [(d, k) for d in sorted(FREE) for k in (1 / 3, 2 / 3)])
def test_killed_job_resumes_without_loss_or_duplicates(setup, tmp_path, monkeypatch, killed_at, drafter):
    target, draft, problems, prompts = setup
    CFG = search.SearchConfig(layer=-1, max_new_tokens=14 if drafter == "model" else 24, batch=4, drafter=drafter,
                              proposal_tokens=4)
    total = {"n": 0}

    def counting(tokens):
        total["n"] += 1
        return _outcome(tokens)

    search.run(problems, prompts, [counting] * 6, target, draft, tmp_path / "clean", CFG, progress=False)
    calls = {"n": 0}

    def dying(tokens):  # killed part way through the clean run's work
        calls["n"] += 1
        if calls["n"] > int(total["n"] * killed_at):
            raise KeyboardInterrupt
        return _outcome(tokens)

    out = tmp_path / "killed"
    with pytest.raises(KeyboardInterrupt):
        search.run(problems, prompts, [dying] * 6, target, draft, out, CFG, progress=False)
    finished = read_labels(out)[0] if (out / "index-0of1.jsonl").exists() else []
    assert len(finished) < 6 and (killed_at < 1 / 2 or finished)
    saved = {int(f.stem): load_file(str(f)) for f in (out / "partial").glob("*.safetensors")}
    in_flight = [int(t["pos"]) for t in saved.values()]
    assert in_flight and max(in_flight) >= 0
    resumed = {"n": 0}

    def again(tokens):
        resumed["n"] += 1
        return _outcome(tokens)

    submitted = []
    real_submit = search.Continuations.submit
    monkeypatch.setattr(search.Continuations, "submit",
                        lambda self, job: (submitted.append(job), real_submit(self, job)))
    summary = search.run(problems, prompts, [again] * 6, target, draft, out, CFG, progress=False)
    # A problem resumed after a decision is not prefilled whole: its next decision feeds its text up to there.
    for i, t in saved.items():
        if int(t["pos"]) >= 0:
            job = next(job for job in submitted if job.key[0] == i)
            position, text = job.key[1], prompts[i][0].tolist() + t["text"].tolist()
            assert position >= int(t["pos"]) and job.prefix is None
            assert job.first == text[: prompts[i].shape[1] + position] + [job.draft_token]
    assert summary["skipped_done"] == len(finished)
    # Every decision taken before the kill was kept: the resumed run redoes only the interrupted one, plus
    # one outcome per resumed text (a greedy text saved unfinished, position -1, has had none yet).
    assert resumed["n"] == total["n"] - (calls["n"] - 1) + sum(pos >= 0 for pos in in_flight)
    assert not list((out / "partial").glob("*"))
    assert sorted(r["problem"] for r in read_labels(out)[0]) == sorted(p.id for p in problems)  # each once
    assert_same_labels(tmp_path / "clean", out)


def test_criteria():
    t = {"same_answer": torch.tensor([1, 0, 0, 1], dtype=torch.int8),
         "correct_before": torch.tensor([1, 1, 0, 1], dtype=torch.int8),
         "correct_after": torch.tensor([1, 0, 1, 0], dtype=torch.int8)}
    assert search.pivot_labels(t, "same-answer").tolist() == [0, 1, 1, 0]
    assert search.pivot_labels(t, "correct").tolist() == [0, 1, 0, 1]
    with pytest.raises(ValueError, match="unknown criterion"):
        search.pivot_labels(t, "vibes")


@pytest.mark.parametrize("how", ["killed", "interrupted"])
def test_greedy_texts_cut_short_go_on_from_where_they_were_saved(setup, tmp_path, monkeypatch, how):
    # killed: no warning (the texts saved every GREEDY_SAVE_SECONDS, here after every step, survive);
    # interrupted: Ctrl-C, the texts are saved on the way out.
    target, draft, problems, prompts = setup
    search.run(problems, prompts, [_outcome] * 6, target, draft, tmp_path / "clean", CFG, progress=False)
    monkeypatch.setattr(search, "GREEDY_SAVE_SECONDS", 0.0 if how == "killed" else float("inf"))
    error = RuntimeError if how == "killed" else KeyboardInterrupt
    real_step, steps = search.Continuations.step, {"n": 0}

    def dying_step(self):  # stopped while the first greedy texts are half decoded (a join, then 2 steps)
        steps["n"] += 1
        if steps["n"] > 3:
            raise error
        return real_step(self)

    monkeypatch.setattr(search.Continuations, "step", dying_step)
    out = tmp_path / "killed"
    with pytest.raises(error):
        search.run(problems, prompts, [_outcome] * 6, target, draft, out, CFG, progress=False)
    monkeypatch.setattr(search.Continuations, "step", real_step)
    saved = {}
    for f in (out / "partial").glob("*.safetensors"):
        t = load_file(str(f))
        assert int(t["pos"]) == -1 and "position" not in t  # a greedy text in progress, no decision yet
        saved[int(f.stem)] = t["text"].tolist()
    assert len(saved) == CFG.batch and all(0 < len(v) < CFG.max_new_tokens for v in saved.values())
    eos = eos_ids(target, None)
    for i, text in saved.items():  # what was saved is the start of the problem's greedy text
        whole = greedy_from_scratch(target, prompts[i][0].tolist(), CFG.max_new_tokens, eos)
        assert whole[: len(text)] == text
    submitted = []
    real_submit = search.Continuations.submit
    monkeypatch.setattr(search.Continuations, "submit",
                        lambda self, job: (submitted.append(job), real_submit(self, job)))
    search.run(problems, prompts, [_outcome] * 6, target, draft, out, CFG, progress=False)
    resumed = {job.key[0]: job for job in submitted if job.key[1] == "greedy"}
    assert resumed.keys() == saved.keys()  # each goes on from its saved text, none starts over
    for i, job in resumed.items():
        assert job.first == prompts[i][0].tolist() + saved[i]
        assert job.budget == CFG.max_new_tokens - len(saved[i])
    assert not [job for job in submitted if job.key[1] is None and job.key[0] in saved]
    assert not list((out / "partial").glob("*"))
    assert sorted(r["problem"] for r in read_labels(out)[0]) == sorted(p.id for p in problems)  # each once
    assert_same_labels(tmp_path / "clean", out)


def test_problems_finished_in_another_folder_are_left_out(setup, tmp_path):
    target, draft, problems, prompts = setup
    meta = {"task": "gsm8k", "split": "train"}
    search.run(problems, prompts, [_outcome] * 6, target, draft, tmp_path / "all", CFG, meta=meta, progress=False)
    # Another folder finished the even problems (as shard 0 of 2: its index is index-0of2.jsonl).
    search.run(problems, prompts, [_outcome] * 6, target, draft, tmp_path / "other", CFG, shard=(0, 2), meta=meta,
               progress=False)
    skip = label.finished_problems(tmp_path / "other", "gsm8k", "train")
    assert skip == {p.id for p in problems[::2]}
    # Problem 2 was in flight here when the other folder finished it: its checkpoint goes.
    stale = tmp_path / "here" / "partial" / "000002.safetensors"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"in flight")
    summary = search.run(problems, prompts, [_outcome] * 6, target, draft, tmp_path / "here", CFG, meta=meta,
                         progress=False, skip=skip)
    assert (summary["skipped_elsewhere"], summary["skipped_done"], summary["problems"]) == (3, 0, 3)
    assert not stale.exists()
    index, tensors = read_labels(tmp_path / "here")
    assert sorted(r["problem"] for r in index) == sorted(p.id for p in problems[1::2])
    everything = read_labels(tmp_path / "all")[1]
    for pid, t in tensors.items():  # the odd problems' records are what a run over all of them wrote
        assert_same_records(everything[pid], t)  # in other batches: features to rounding (label_folders)
    with pytest.raises(ValueError, match="gsm8k/train, not humaneval/test"):
        label.finished_problems(tmp_path / "other", "humaneval", "test")
    with pytest.raises(FileNotFoundError, match="not a label folder"):
        label.finished_problems(tmp_path / "nowhere", "gsm8k", "train")


def test_problem_bytes_is_what_the_caches_hold(setup):
    from pad.decoding.hf import forward_tail, returned_cache

    target, draft, _, _ = setup
    ids = torch.randint(0, 96, (1, 11), generator=torch.Generator().manual_seed(7))
    held = []
    with torch.inference_mode():
        for model in (target, draft):
            cache = returned_cache(forward_tail(model, ids, 1, use_cache=True))
            held.append(sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values)))
    # Its text's cache in both models, and its row of the running batch (the target's again).
    assert search.problem_bytes(target, draft, 4, 7) == 2 * held[0] + held[1]


def _memory(monkeypatch, answers):
    """Make the labeler see ``answers(call number)`` bytes of memory left; returns the trims it asked for."""
    calls, trims = {"n": 0}, []

    def available():
        calls["n"] += 1
        return answers(calls["n"])

    monkeypatch.setattr(search, "available_memory", available)
    monkeypatch.setattr(search, "release_free_memory", lambda: trims.append(calls["n"]) or True)
    return trims


def test_batch_is_cut_to_what_memory_holds(setup, tmp_path, monkeypatch):
    target, draft, problems, prompts = setup
    search.run(problems, prompts, [_outcome] * 6, target, draft, tmp_path / "clean", CFG, progress=False)
    need = search.problem_bytes(target, draft, max(p.shape[1] for p in prompts), CFG.max_new_tokens)
    _memory(monkeypatch, lambda n: search.ADMIT_MEMORY + int(2.5 * need))
    made = []
    engine = search.Continuations
    monkeypatch.setattr(search, "Continuations", lambda *a, **k: made.append(a[4]) or engine(*a, **k))
    with pytest.warns(UserWarning, match="--batch 4 does not fit .* labeling 2 problems at a time"):
        search.run(problems, prompts, [_outcome] * 6, target, draft, tmp_path / "cut", CFG, progress=False)
    assert made == [2]
    assert_same_labels(tmp_path / "clean", tmp_path / "cut")
    _memory(monkeypatch, lambda n: search.ADMIT_MEMORY + need // 2)
    with pytest.raises(search.LowMemory, match="one problem in flight needs up to"):
        search.run(problems, prompts, [_outcome] * 6, target, draft, tmp_path / "none", CFG, progress=False)


def test_new_problems_wait_while_memory_is_short(setup, tmp_path, monkeypatch):
    target, draft, problems, prompts = setup
    search.run(problems, prompts, [_outcome] * 6, target, draft, tmp_path / "clean", CFG, progress=False)
    # Plenty at start (the batch is not cut), then less than ADMIT_MEMORY but more than LOW_MEMORY.
    trims = _memory(monkeypatch, lambda n: 1 << 40 if n == 1 else (search.LOW_MEMORY + search.ADMIT_MEMORY) // 2)
    out, started = tmp_path / "short", []
    submit = search.Continuations.submit

    def spy(engine, job):
        if job.key[1] is None:  # a problem's first job: it joins now; every earlier one has finished
            index = out / "index-0of1.jsonl"
            started.append((job.key[0], len(index.read_text().splitlines()) if index.exists() else 0))
        return submit(engine, job)

    monkeypatch.setattr(search.Continuations, "submit", spy)
    search.run(problems, prompts, [_outcome] * 6, target, draft, out, CFG, progress=False)
    assert started == [(i, i) for i in range(6)]  # one problem at a time
    assert trims  # short of memory, it first handed freed memory back
    assert_same_labels(tmp_path / "clean", out)


def test_low_memory_stops_the_job_which_resumes_without_loss(setup, tmp_path, monkeypatch):
    target, draft, problems, prompts = setup
    search.run(problems, prompts, [_outcome] * 6, target, draft, tmp_path / "clean", CFG, progress=False)
    _memory(monkeypatch, lambda n: 1 << 40 if n < 12 else search.LOW_MEMORY // 2)
    out = tmp_path / "stopped"
    with pytest.raises(search.LowMemory, match="progress is saved: run the same command with a smaller --batch"):
        search.run(problems, prompts, [_outcome] * 6, target, draft, out, CFG, progress=False)
    assert list((out / "partial").glob("*.safetensors"))  # problems in flight were saved
    monkeypatch.undo()
    summary = search.run(problems, prompts, [_outcome] * 6, target, draft, out, CFG, progress=False)
    assert summary["problems"] + summary["skipped_done"] == 6
    assert not list((out / "partial").glob("*"))
    assert_same_labels(tmp_path / "clean", out)
