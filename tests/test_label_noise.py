"""bench/label_noise.py: a null continuation (the text's own token where the labeler puts the draft's) of an
fp32 greedy text must give back that text, at every position, whichever rows share its batch."""
import importlib.util
import random
from pathlib import Path

import pytest
import torch

from pad.decoding.hf import eos_ids
from tiny import greedy_from_scratch, tiny_model

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "label_noise.py"
_spec = importlib.util.spec_from_file_location("label_noise", SCRIPT)
label_noise = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(label_noise)


@pytest.mark.parametrize("seed", range(2))
def test_null_continuations_give_back_the_fp32_text(seed):
    model = tiny_model("qwen2", seed=seed)
    rng = random.Random(seed)
    eos = eos_ids(model, None)
    prompts = [[rng.randrange(96) for _ in range(rng.randint(1, 8))] for _ in range(5)]
    budget = 40
    texts = [greedy_from_scratch(model, p, budget, eos) for p in prompts]
    # The answer: the text's last three tokens; right when it ends in an even token.
    outcomes = [lambda tokens: (tuple(tokens[-3:]), tokens[-1] % 2 == 0) for _ in prompts]
    rows = label_noise.null_continuations(model, 96, eos, prompts, outcomes, positions=4, max_new_tokens=budget,
                                          batch=3, seed=seed, layer=-1, progress=False)
    assert len(rows) == 4 * len(prompts)
    assert all(0 <= r["position"] <= len(texts[r["problem"]]) - 2 for r in rows)
    assert len({(r["problem"], r["position"]) for r in rows}) == len(rows)
    assert all(r["same_text"] and r["same_answer"] for r in rows)
    assert [r["correct_before"] for r in rows] == [texts[r["problem"]][-1] % 2 == 0 for r in rows]
    table = label_noise.summary(rows)
    assert f"| all | 0/{len(rows)} = 0.0% [0.0%," in table


def test_summary_counts_changed_texts_and_answers():
    rows = [{"same_text": s, "same_answer": a, "correct_before": c}
            for s, a, c in ((True, True, True), (False, True, True), (False, False, True), (False, False, False))]
    table = label_noise.summary(rows)
    assert "| all | 3/4 = 75.0% [" in table and "| 2/4 = 50.0% [" in table
    assert "| text right | 2/3 = 66.7% [" in table and "| text wrong | 1/1 = 100.0% [" in table
