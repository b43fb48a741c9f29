"""bench/label_chain.py: each round accepts the first draft mismatch after the last one and continues greedily,
exactly as a cache-free reference does it one problem at a time (fp32 tiny models)."""
import importlib.util
import math
import random
from pathlib import Path

import pytest
import torch

from tiny import greedy_from_scratch, tiny_pair

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "label_chain.py"
_spec = importlib.util.spec_from_file_location("label_chain", SCRIPT)
label_chain = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(label_chain)


def _outcome(tokens):
    """The answer: the text's last token's residue mod 3; right when it is 0."""
    return tokens[-1] % 3, tokens[-1] % 3 == 0


@torch.no_grad()
def _reference(target, draft, prompt, rounds, budget):
    """Cache-free: greedy text, then per round the first mismatch after the last, continued from scratch."""
    text = greedy_from_scratch(target, prompt, budget)
    rows, start = [{"round": 0, "position": -1, "text": text}], 0
    for r in range(1, rounds + 1):
        tops = draft(torch.tensor([prompt + text[:-1]])).logits[0, len(prompt) - 1 :].argmax(-1).tolist()
        t = next((t for t in range(start, len(text) - 1) if tops[t] != text[t]), None)
        if t is None:
            break
        text = text[:t] + [tops[t]] + greedy_from_scratch(target, prompt + text[:t] + [tops[t]], budget - t - 1)
        p = torch.softmax(target(torch.tensor([prompt + text[:t]])).logits[0, -1], -1)[tops[t]]
        rows.append({"round": r, "position": t, "text": text, "token_prob": float(p)})
        start = t + 1
    return rows


@pytest.mark.parametrize("seed", range(2))
def test_chains_match_a_cache_free_reference(seed):
    target, draft = tiny_pair("qwen2", seed=seed)
    rng = random.Random(seed)
    prompts = [[rng.randrange(96) for _ in range(rng.randint(1, 8))] for _ in range(4)]
    budget, rounds = 30, 3
    rows = label_chain.chains(target, draft, 96, set(), prompts, [_outcome] * len(prompts), rounds=rounds,
                              max_new_tokens=budget, batch=3, layer=-1, progress=False)
    got = {(r["problem"], r["round"]): r for r in rows}
    expected = 0
    for i, prompt in enumerate(prompts):
        ref = _reference(target, draft, prompt, rounds, budget)
        expected += len(ref)
        for j, want in enumerate(ref):
            row = got[(i, want["round"])]
            assert (row["position"], row["text_length"]) == (want["position"], len(want["text"]))
            assert row["correct"] == _outcome(want["text"])[1]
            assert row["same_answer"] == (j == 0 or _outcome(want["text"])[0] == _outcome(ref[j - 1]["text"])[0])
            if j:
                assert row["token_prob"] == pytest.approx(want["token_prob"], abs=1e-5)
            else:
                assert math.isnan(row["token_prob"])
    assert len(rows) == expected and expected > len(prompts)  # some rounds were taken


def test_summary_counts_transitions():
    # Problem 0: right, wrong, right (derailed, then steered back); problem 1: wrong, wrong.
    nan = float("nan")
    rows = [{"problem": 0, "round": 0, "correct": True, "token_prob": nan},
            {"problem": 0, "round": 1, "correct": False, "token_prob": 0.3},
            {"problem": 0, "round": 2, "correct": True, "token_prob": 0.1},
            {"problem": 1, "round": 0, "correct": False, "token_prob": nan},
            {"problem": 1, "round": 1, "correct": False, "token_prob": 0.05}]
    table = label_chain.summary(rows)
    assert "| 0 | 2 | 1/1 = 100.0% [" in table and "| 0/1 = 0.0% [" in table
    assert "| 1 | 2 | 0/1 = 0.0% [" in table
    assert "right -> wrong 1/1 = 100.0% [" in table and "wrong -> right 1/2 = 50.0% [" in table
    assert "Problems right in round 0: right -> wrong 1/1 = 100.0% [" in table and "wrong -> right 1/1 = 100.0% [" in table
    assert "Problems wrong in round 0: right -> wrong n/a, wrong -> right 0/1 = 0.0% [" in table
    assert "p_target(token) >= 0.2 on right texts: right -> wrong 1/1 = 100.0% [" in table
    assert "p_target(token) < 0.2 on right texts: right -> wrong n/a." in table
    assert "Problems right in round 0 that were ever wrong: 1; right in their last round: 1." in table


def test_summarize_reads_rows_written_before(tmp_path, capsys):
    import json

    rows = [{"problem": "p0", "round": 0, "correct": True, "token_prob": None},
            {"problem": "p0", "round": 1, "correct": False, "token_prob": 0.4}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert label_chain.main(["--summarize", str(path)]) == 0
    assert "right -> wrong 1/1 = 100.0% [" in capsys.readouterr().out
