"""Spec-Bench as a task: its questions read, the first N per category, a bench run without answers, and the
per-category closeness of each policy's replies to the target's (bench/specbench.py)."""
import importlib.util
import json
import math
from pathlib import Path

import pytest

from pad.evaluation import bench, tasks
from test_bench import _bench_setup

ROOT = Path(__file__).resolve().parents[1]


def _questions(path: Path) -> Path:
    """A Spec-Bench-shaped file: 3 categories, ids and two turns as in data/spec_bench/question.jsonl."""
    rows = [(81 + i, "writing", f"w{i} w{i + 1} w{i + 2}") for i in range(3)]
    rows += [(200 + i, "translation", f"w{10 + i} w{10 + i}") for i in range(4)]
    rows += [(300, "rag", "w5 w6 w7 w5 w6")]
    path.write_text("".join(json.dumps({"question_id": q, "category": c, "turns": [t, "a second turn"]}) + "\n"
                            for q, c, t in rows))
    return path


def test_questions_load_by_category(tmp_path):
    problems = tasks.load("specbench", path=_questions(tmp_path / "q.jsonl"))
    assert [p.id for p in problems[:2]] == ["specbench/writing/81", "specbench/writing/82"]
    assert problems[3].category == "translation" and problems[3].question == "w10 w10"
    kept = tasks.per_category(problems, 2)
    assert [p.id for p in kept] == ["specbench/writing/81", "specbench/writing/82", "specbench/translation/200",
                                    "specbench/translation/201", "specbench/rag/300"]
    assert [p.id for p in tasks.in_categories(kept, ["rag", "writing"])] == [
        "specbench/writing/81", "specbench/writing/82", "specbench/rag/300"]
    with pytest.raises(ValueError, match="no problems of category qa; the categories here: writing, translation, rag"):
        tasks.in_categories(kept, ["rag", "qa"])
    assert tasks.messages("specbench", problems[0]) == [{"role": "user", "content": "w0 w1 w2"}]
    assert tasks.correct("specbench", problems[0], "anything") is None
    with pytest.raises(ValueError, match="no answers to score"):
        tasks.outcome("specbench", problems[0], "anything")


def test_bench_on_specbench_scores_nothing_and_compares_replies(tmp_path):
    target, draft, tok, _ = _bench_setup()
    problems = tasks.per_category(tasks.load("specbench", path=_questions(tmp_path / "q.jsonl")), 1)
    specs = bench.parse_policies("target,exact/lookup,threshold@0.2/hybrid")
    log = tmp_path / "runs.jsonl"
    rows = bench.run("specbench", problems, target, draft, tok, specs, num_draft_tokens=3, max_new_tokens=8,
                     progress=False, log=log)
    assert all(math.isnan(r["accuracy"]) and math.isnan(r["accuracy_vs_target"]) for r in rows)
    spec = importlib.util.spec_from_file_location("specbench_script", ROOT / "bench" / "specbench.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    table = script.table(records, lambda s: tok(s, add_special_tokens=False).input_ids)
    by = {(r["category"], r["policy"]): r for r in table}
    assert [r["category"] for r in table if r["policy"] == "target"] == ["writing", "translation", "rag", "all"]
    for cat in ("writing", "translation", "rag", "all"):
        # exact's replies are the target's (greedy, fp32): identical, similarity 1
        assert by[cat, "exact/lookup"]["identical"] == 1.0 and by[cat, "exact/lookup"]["similarity"] == 1.0
        assert by[cat, "target"]["tokens_per_target_forward"] == pytest.approx(1.0)
        assert by[cat, "target"]["speedup"] == 1.0
        assert by[cat, "exact/lookup"]["speedup"] == pytest.approx(
            by[cat, "exact/lookup"]["tokens_per_s"] / by[cat, "target"]["tokens_per_s"])
    assert by["all", "target"]["new_tokens"] == sum(r["new_tokens"] for r in records if r["policy"] == "target")
    assert "| rag | threshold@0.2/hybrid |" in script.markdown(table)
    # against exact with the same drafter: its ratios and reply comparisons, the header naming it
    against = {(r["category"], r["policy"]): r for r in script.table(
        records, lambda s: tok(s, add_special_tokens=False).input_ids, "exact/lookup")}
    for cat in ("writing", "translation", "rag", "all"):
        assert against[cat, "exact/lookup"]["speedup"] == 1.0
        assert against[cat, "target"]["speedup"] == pytest.approx(
            by[cat, "target"]["tokens_per_s"] / by[cat, "exact/lookup"]["tokens_per_s"])
        assert against[cat, "target"]["identical"] == 1.0
        assert against[cat, "threshold@0.2/hybrid"]["identical"] == by[cat, "threshold@0.2/hybrid"]["identical"]
    assert "| x exact/lookup | tokens / target forward | identical to exact/lookup |" in script.markdown(
        list(against.values()), "exact/lookup")
    assert script.main([str(log), "--reference", "exact/suffix"]) == 2  # a reference the log lacks: refused


def test_similarity_is_difflibs_ratio_over_tokens():
    spec = importlib.util.spec_from_file_location("specbench_script", ROOT / "bench" / "specbench.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.similarity([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert script.similarity([1, 2, 3, 4], [1, 2, 9, 4]) == pytest.approx(2 * 3 / 8)
    assert script.similarity([], [5]) == 0.0 and script.similarity([], []) == 1.0
