"""pad bench on tiny models: every policy runs on the same problems and the table is consistent."""
import json
import math
from pathlib import Path

import pytest
import scipy.stats
import torch

from pad import PivotClassifier, machine
from pad.evaluation import bench, tasks
from test_cli import _tokenizer
from test_generate_pivot import _classifier
from tiny import tiny_pair

DATA = Path(__file__).parent / "data"


def test_parse_policies():
    specs = bench.parse_policies("target, exact,pivot@0.3,hf-assisted")
    assert [(s.name, s.policy, s.sigma) for s in specs] == [
        ("target", "target", 0.0), ("exact", "exact", 0.0), ("pivot@0.3", "pivot", 0.3), ("hf-assisted", "hf-assisted", 0.0)]
    for bad in ("fast", "pivot@x", "pivot@1.5", ""):
        with pytest.raises(ValueError):
            bench.parse_policies(bad)
    # A policy's own draft length after a colon, also after settings that hold commas.
    specs = bench.parse_policies("target,exact:2,exact:auto,pivot@0.3:4,typical@0.09,0.3:8,hf-assisted:6")
    assert [(s.name, s.policy, s.k) for s in specs] == [
        ("target", "target", None), ("exact:2", "exact", 2), ("exact:auto", "exact", "auto"),
        ("pivot@0.3:4", "pivot", 4), ("typical@0.09,0.3:8", "typical", 8), ("hf-assisted:6", "hf-assisted", 6)]
    assert specs[4].parsed.rule.b == 0.3
    for bad in ("target:2", "exact:0", "exact:x", "hf-assisted:auto", "exact:2,exact:2"):
        with pytest.raises(ValueError):
            bench.parse_policies(bad)


def test_parse_policies_with_their_drafters():
    specs = bench.parse_policies("exact/lookup:auto,pivot@0.3/hybrid,typical@0.09,0.3/suffix:4,exact,hf-lookup:6")
    assert [(s.name, s.policy, s.drafter, s.k) for s in specs] == [
        ("exact/lookup:auto", "exact", "lookup", "auto"), ("pivot@0.3/hybrid", "pivot", "hybrid", None),
        ("typical@0.09,0.3/suffix:4", "typical", "suffix", 4), ("exact", "exact", None, None),
        ("hf-lookup:6", "hf-lookup", None, 6)]
    assert specs[1].sigma == 0.3 and specs[2].parsed.rule.b == 0.3
    for bad, said in (("exact/ngram", "unknown drafter 'ngram'"), ("target/lookup", "takes no draft length or drafter"),
                      ("hf-assisted/lookup", "takes no pad drafter")):
        with pytest.raises(ValueError, match=said):
            bench.parse_policies(bad)


def test_bench_runs_draft_free_rows_beside_transformers_prompt_lookup(tmp_path):
    """exact with lookup, suffix and hybrid give the target's answers; hf-lookup runs; the log names drafters."""
    target, draft, tok, problems = _bench_setup()
    problems = problems[:2]
    specs = bench.parse_policies("target,exact/lookup,exact/suffix:3,exact/hybrid,hf-lookup")
    log = tmp_path / "runs.jsonl"
    rows = bench.run("gsm8k", problems, target, draft, tok, specs, num_draft_tokens=4, max_new_tokens=10,
                     progress=False, log=log, batch_size=2)
    by = {r["policy"]: r for r in rows}
    for name in ("exact/lookup", "exact/suffix:3", "exact/hybrid"):
        assert by[name]["new_tokens"] == by["target"]["new_tokens"] and by[name]["accuracy"] == by["target"]["accuracy"]
    assert by["hf-lookup"]["new_tokens"] > 0
    settings = {r["policy"]: r["settings"] for r in (json.loads(line) for line in log.read_text().splitlines())}
    assert settings["exact/lookup"]["drafter"] == "lookup" and settings["exact/hybrid"]["drafter"] == "hybrid"
    assert "drafter" not in settings["target"] and settings["hf-lookup"]["batch_size"] == 1


def test_bench_keys_pivot_runs_with_draft_free_proposals_by_who_judges_them(tmp_path):
    """pivot@1 (floor 0) with lookup gives the target's replies unless judge_free; a judge_free run of the same
    policy is not taken from the other's records."""
    target, draft, tok, problems = _bench_setup()
    problems = problems[:2]
    clf = PivotClassifier(target.config.hidden_size, layer=-1).eval()
    specs = bench.parse_policies("target,pivot@1/lookup")
    log = tmp_path / "runs.jsonl"
    kw = dict(num_draft_tokens=4, max_new_tokens=10, progress=False, log=log, classifier=clf, floor=0.0)
    by = {r["policy"]: r for r in bench.run("gsm8k", problems, target, draft, tok, specs, **kw)}
    assert by["pivot@1/lookup"]["new_tokens"] == by["target"]["new_tokens"]
    assert (by["pivot@1/lookup"]["same_reply_vs_target"], by["pivot@1/lookup"]["replies_compared"]) == (2, 2)
    judged = {r["policy"]: r for r in bench.run("gsm8k", problems, target, draft, tok, specs, judge_free=True, **kw)}
    records = [json.loads(line) for line in log.read_text().splitlines()]
    pivot = [r["settings"]["judge_free"] for r in records if r["policy"] == "pivot@1/lookup"]
    assert sorted(pivot) == [False, False, True, True] and len(records) == 6  # the target's runs reused
    assert judged["pivot@1/lookup"]["acceptance_rate"] == 1.0  # every lookup draft passed
    replies = {(r["policy"], r["settings"].get("judge_free"), r["problem"]): r["reply"] for r in records}
    same = sum(replies["pivot@1/lookup", True, p.id] == replies["target", None, p.id] for p in problems)
    assert (judged["pivot@1/lookup"]["same_reply_vs_target"], judged["pivot@1/lookup"]["replies_compared"]) == (same, 2)
    assert judged["target"]["same_reply_vs_target"] == 2


def test_bench_runs_each_policy_at_its_own_draft_length(tmp_path):
    """exact at K = 2 and auto beside the target: the same answers, the K each asked for in the run log."""
    target, draft, tok, problems = _bench_setup()
    problems = problems[:2]
    specs = bench.parse_policies("target,exact:2,exact:auto")
    log = tmp_path / "runs.jsonl"
    rows = bench.run("gsm8k", problems, target, draft, tok, specs, num_draft_tokens=5, max_new_tokens=10,
                     max_draft_tokens=4, progress=False, log=log)
    by = {r["policy"]: r for r in rows}
    assert by["exact:2"]["new_tokens"] == by["exact:auto"]["new_tokens"] == by["target"]["new_tokens"]
    assert by["exact:2"]["mean_draft_length"] <= 2 and 0 <= by["exact:auto"]["mean_draft_length"] <= 4
    records = [json.loads(line) for line in log.read_text().splitlines()]
    settings = {r["policy"]: r["settings"] for r in records}
    assert settings["exact:2"]["k"] == 2 and settings["exact:auto"]["k"] == "auto"
    assert settings["exact:auto"]["max_draft_tokens"] == 4 and "max_draft_tokens" not in settings["exact:2"]
    assert all(r["timed_blocks_time"] > 0 for r in records if r["policy"] == "exact:auto")


def test_bench_runs_all_policies_side_by_side(tmp_path):
    target, draft, tok, problems = _bench_setup()
    specs = bench.parse_policies("target,exact,pivot@0.6,hf-assisted")
    rows = bench.run("gsm8k", problems, target, draft, tok, specs, num_draft_tokens=3, max_new_tokens=12,
                     classifier=_classifier(target, 0), progress=False)
    by = {r["policy"]: r for r in rows}
    assert by["target"]["speedup_vs_target"] == 1.0 and by["target"]["target_forwards_per_token"] == 1.0
    assert all(r["problems"] == 3 for r in rows)
    # The exact policy emits the target's tokens, so the same answers and the same number of tokens.
    assert by["exact"]["new_tokens"] == by["target"]["new_tokens"] and by["exact"]["accuracy"] == by["target"]["accuracy"]
    assert by["pivot@0.6"]["acceptance_rate"] >= by["exact"]["acceptance_rate"]
    assert by["exact"]["target_forwards_per_token"] < 1.0
    assert math.isnan(by["hf-assisted"]["acceptance_rate"]) and by["hf-assisted"]["new_tokens"] > 0
    paths = bench.write(rows, tmp_path, "gsm8k_sample", "header line")
    table = paths[1].read_text()
    assert "| exact |" in table and "n/a" in table and paths[0].read_text().startswith("policy,")


def test_interrupted_bench_resumes_from_its_run_log(tmp_path, monkeypatch):
    target, draft, tok, problems = _bench_setup()
    specs = bench.parse_policies("target,exact,pivot@0.6")
    log = tmp_path / "runs.jsonl"
    kwargs = dict(num_draft_tokens=3, max_new_tokens=12, progress=False, settings={"target": "t"}, log=log)
    clean = bench.run("gsm8k", problems, target, draft, tok, specs, classifier=_classifier(target, 0), **kwargs)
    lines = log.read_text().splitlines()
    assert len(lines) == 9
    probes = {json.loads(line)["speed_probe"] for line in lines}  # beside every run; one, as the run is short
    assert len(probes) == 1 and probes.pop() > 0
    # Each record keeps the reply it was scored on, and the score follows from it.
    for record in map(json.loads, lines):
        problem = next(p for p in problems if p.id == record["problem"])
        assert record["correct"] == tasks.correct("gsm8k", problem, record["reply"])
        assert len(tok(record["reply"], add_special_tokens=False).input_ids) == record["new_tokens"]
    log.write_text("\n".join(lines[:5]) + "\n" + lines[5][:20])  # killed while writing the sixth record
    real = bench.generate
    calls = []
    # Warm-up decodes (WARMUP_TOKENS new tokens) are not runs: count only the timed ones.
    monkeypatch.setattr(bench, "generate", lambda *a, **k: (k["max_new_tokens"] == bench.WARMUP_TOKENS
                                                            or calls.append(k["policy"].name)) and None or real(*a, **k))
    resumed = bench.run("gsm8k", problems, target, draft, tok, specs, classifier=_classifier(target, 0), **kwargs)
    assert len(calls) == 4 and len(log.read_text().splitlines()) == 9  # only the 4 missing runs, no duplicate
    for a, b in zip(clean, resumed):
        assert a["policy"] == b["policy"] and a["new_tokens"] == b["new_tokens"] and a["accuracy"] == b["accuracy"]
    # Another classifier reruns only the pivot policy; other settings rerun everything.
    calls.clear()
    bench.run("gsm8k", problems, target, draft, tok, specs, classifier=_classifier(target, 1), **kwargs)
    assert calls == ["pivot"] * 3
    calls.clear()
    with pytest.warns(UserWarning) as told:
        bench.run("gsm8k", problems, target, draft, tok, specs, classifier=_classifier(target, 1),
                  **{**kwargs, "settings": {"target": "other"}})
    assert sorted(calls) == ["exact"] * 3 + ["pivot"] * 3 + ["target"] * 3
    # The rerun is named once per policy, with the setting that keeps the logged runs from being reused.
    notes = [str(w.message) for w in told if "under other settings" in str(w.message)]
    assert len(notes) == 3 and all("target: 't' there, 'other' here): such runs are done again" in n for n in notes)
    assert {n.split(" holds ")[1].split(" on ")[0] for n in notes} == {"target", "exact", "pivot@0.6"}
    # Another prompt wording or another version of the utility reruns everything too.
    for patch in (lambda: monkeypatch.setattr(tasks, "GSM8K_SYSTEM", tasks.GSM8K_SYSTEM + " Be brief."),
                  lambda: monkeypatch.setitem(tasks.UTILITY_VERSION, "gsm8k", tasks.UTILITY_VERSION["gsm8k"] + 1)):
        patch()
        calls.clear()
        bench.run("gsm8k", problems, target, draft, tok, specs, classifier=_classifier(target, 1), **kwargs)
        assert sorted(calls) == ["exact"] * 3 + ["pivot"] * 3 + ["target"] * 3


@pytest.mark.parametrize("k", [2, 3])
def test_hf_assisted_drafts_k_tokens_like_the_exact_policy(k):
    # With a draft equal to the target every draft token is accepted, so the number of target forwards
    # shows the draft length transformers used (its own default is 20 tokens, whatever generate() is told).
    import copy

    import torch

    from pad import generate
    from tiny import tiny_model

    target = tiny_model("llama")
    draft = copy.deepcopy(target)
    draft.generation_config.num_assistant_tokens = 20
    ids = torch.tensor([[5, 17, 3, 40]])
    new, seconds, forwards = bench._hf_assisted(target, draft, ids, k, 12, None)
    ours = generate(target, draft, ids, policy="exact", num_draft_tokens=k, max_new_tokens=12)
    assert new == ours.sequences[0, 4:].tolist() and len(new) == 12 and seconds > 0
    assert ours.stats.target_forwards == -(-12 // (k + 1))
    assert forwards == ours.stats.target_forwards
    assert draft.generation_config.num_assistant_tokens == 20  # the draft's own settings are restored


def _bench_setup():
    target, draft = tiny_pair("llama", scale=0.3)
    tok = _tokenizer([f"w{i}" for i in range(96)])
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    problems = tasks.load("gsm8k", path=DATA / "gsm8k_sample.jsonl", limit=3)
    return target, draft, tok, problems


def test_each_policy_warms_up_before_its_first_timed_run(tmp_path, monkeypatch):
    target, draft, tok, problems = _bench_setup()
    specs = bench.parse_policies("target,exact,pivot@0.6,hf-assisted")
    calls = []
    real_generate, real_hf = bench.generate, bench._hf_assisted
    monkeypatch.setattr(bench, "generate", lambda *a, **k: calls.append((k["policy"].name, k["max_new_tokens"]))
                        or real_generate(*a, **k))
    monkeypatch.setattr(bench, "_hf_assisted", lambda t, d, ids, k, n, eos: calls.append(("hf-assisted", n))
                        or real_hf(t, d, ids, k, n, eos))
    kwargs = dict(num_draft_tokens=3, max_new_tokens=12, progress=False, log=tmp_path / "runs.jsonl")
    bench.run("gsm8k", problems, target, draft, tok, specs, classifier=_classifier(target, 0), **kwargs)
    warm = bench.WARMUP_TOKENS
    # Problem 1: each policy warms up, then runs timed; problems 2 and 3: timed runs only.
    first = [c for s in ("target", "exact", "pivot", "hf-assisted") for c in ((s, warm), (s, 12))]
    rest = [(s, 12) for s in ("target", "exact", "pivot", "hf-assisted")] * 2
    assert calls == first + rest
    # Runs reused from the log are not timed, so nothing warms up.
    calls.clear()
    bench.run("gsm8k", problems, target, draft, tok, specs, classifier=_classifier(target, 0), **kwargs)
    assert calls == []


def test_the_speed_probe_is_retaken_as_a_run_goes_on(tmp_path, monkeypatch):
    target, draft, tok, problems = _bench_setup()
    specs = bench.parse_policies("target,exact")
    taken = []
    monkeypatch.setattr(bench, "speed_probe", lambda dtype: taken.append(dtype) or 100.0 + len(taken))
    kwargs = dict(num_draft_tokens=3, max_new_tokens=12, progress=False)
    bench.run("gsm8k", problems, target, draft, tok, specs, log=tmp_path / "a.jsonl", **kwargs)
    assert taken == ["float32"]  # once: the run is far shorter than PROBE_EVERY
    assert {json.loads(line)["speed_probe"] for line in (tmp_path / "a.jsonl").read_text().splitlines()} == {101.0}
    taken.clear()
    monkeypatch.setattr(bench, "PROBE_EVERY", 0.0)  # every fresh group of runs takes its own
    bench.run("gsm8k", problems, target, draft, tok, specs, log=tmp_path / "b.jsonl", **kwargs)
    records = [json.loads(line) for line in (tmp_path / "b.jsonl").read_text().splitlines()]
    assert len(taken) == len(records) == 2 * len(problems)
    assert sorted(r["speed_probe"] for r in records) == [101.0 + i for i in range(len(records))]


def test_runs_of_another_decode_version_are_not_reused(tmp_path, monkeypatch):
    target, draft, tok, problems = _bench_setup()
    specs = bench.parse_policies("exact")
    kwargs = dict(num_draft_tokens=3, max_new_tokens=12, progress=False, log=tmp_path / "runs.jsonl")
    bench.run("gsm8k", problems, target, draft, tok, specs, **kwargs)
    calls = []
    real = bench.generate
    monkeypatch.setattr(bench, "generate", lambda *a, **k: calls.append(k["max_new_tokens"]) or real(*a, **k))
    bench.run("gsm8k", problems, target, draft, tok, specs, **kwargs)
    assert calls == []
    monkeypatch.setattr(bench, "DECODE_VERSION", bench.DECODE_VERSION + 1)
    bench.run("gsm8k", problems, target, draft, tok, specs, **kwargs)
    assert calls == [bench.WARMUP_TOKENS] + [12] * 3
    assert {json.loads(line)["settings"]["decode"] for line in (tmp_path / "runs.jsonl").read_text().splitlines()} \
        == {bench.DECODE_VERSION - 1, bench.DECODE_VERSION}


def test_a_run_log_of_other_weights_is_refused(tmp_path):
    target, draft, tok, problems = _bench_setup()
    specs = bench.parse_policies("exact")
    kwargs = dict(num_draft_tokens=3, max_new_tokens=12, progress=False, log=tmp_path / "runs.jsonl")
    gguf = {"target": "gguf-q4_k_m-bf16:sha256:aaaa", "draft": "gguf-q4_k_m-bf16:sha256:bbbb"}
    bench.run("gsm8k", problems[:1], target, draft, tok, specs, settings={"weights": gguf}, **kwargs)
    hub = {**gguf, "target": "hub:Qwen/X@0123"}
    with pytest.raises(ValueError, match=r"other target weights \(gguf-q4_k_m-bf16:sha256:aaaa\).*\(hub:Qwen/X@0123\)"):
        bench.run("gsm8k", problems[:1], target, draft, tok, specs, settings={"weights": hub}, **kwargs)


def test_batched_bench_keeps_per_problem_results(tmp_path):
    target, draft, tok, problems = _bench_setup()
    problems = tasks.load("gsm8k", path=DATA / "gsm8k_sample.jsonl", limit=5)
    specs = bench.parse_policies("target,exact,hf-target,hf-assisted")
    kwargs = dict(num_draft_tokens=3, max_new_tokens=12, progress=False)
    alone = bench.run("gsm8k", problems, target, draft, tok, specs, log=tmp_path / "b1.jsonl", **kwargs)
    batched = bench.run("gsm8k", problems, target, draft, tok, specs, log=tmp_path / "b3.jsonl", batch_size=3,
                        **kwargs)
    logs = {b: [json.loads(x) for x in (tmp_path / f"b{b}.jsonl").read_text().splitlines()] for b in (1, 3)}
    for b, log in logs.items():
        assert len(log) == 5 * 4 and len({(r["problem"], r["policy"]) for r in log}) == 20
    # Every row decodes as it would alone: the same reply for each problem and policy at B = 1 and B = 3,
    # and transformers' batched target-only generate gives the target's own replies.
    replies = {b: {(r["problem"], r["policy"]): r["reply"] for r in log} for b, log in logs.items()}
    assert replies[1] == replies[3]
    assert all(replies[3][p.id, "hf-target"] == replies[3][p.id, "target"] for p in problems)
    by = {b: {r["policy"]: r for r in rows} for b, rows in ((1, alone), (3, batched))}
    assert [by[3][p]["batch_size"] for p in ("target", "exact", "hf-target", "hf-assisted")] == [3, 3, 3, 1]
    assert by[1]["exact"]["batch_size"] == 1 and by[3]["exact"]["peak_mib"] > 0
    for policy in ("target", "exact", "hf-assisted"):
        for col in ("accuracy", "acceptance_rate", "mean_accepted_length", "new_tokens"):
            a, b = by[1][policy][col], by[3][policy][col]
            assert a == b or (math.isnan(a) and math.isnan(b)), (policy, col)
    # hf-target keeps finished rows in its batch: more target forwards per token than the target alone.
    assert by[3]["hf-target"]["target_forwards_per_token"] >= 1.0
    with pytest.raises(ValueError, match="batch size"):
        bench.run("gsm8k", problems, target, draft, tok, specs, batch_size=0, **kwargs)


def test_paired_difference_interval():
    same = [True, False, True, True]
    assert bench.paired_difference(same, same) == (0.0, 0.0, 0.0)
    # 5 wins out of 5: exact McNemar p = 2 * 0.5**5 = 0.0625, so the interval must reach below 0; the lower
    # bound of pi solves pi**5 = 0.025 by hand
    d, low, high = bench.paired_difference([True] * 5, [False] * 5)
    assert (d, high) == (1.0, 1.0) and low == pytest.approx(2 * 0.025 ** 0.2 - 1, abs=1e-12) and low < 0
    # 0 wins and 4 losses among 96 problems (p = 0.125): pi's upper bound solves (1 - pi)**4 = 0.025
    d, low, high = bench.paired_difference([False] * 4 + [True] * 92, [True] * 96)
    assert d == pytest.approx(-4 / 96) and low == pytest.approx(-4 / 96)
    assert high == pytest.approx(4 / 96 * (2 * (1 - 0.025 ** 0.25) - 1), abs=1e-12) and high > 0
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        a = (torch.rand(400, generator=g) < 0.7).tolist()
        b = [x if torch.rand(1, generator=g) < 0.85 else not x for x in a]  # mostly the same outcomes: paired
        x = sum(u and not v for u, v in zip(a, b))
        m = x + sum(v and not u for u, v in zip(a, b))
        ci = scipy.stats.binomtest(x, m).proportion_ci(0.95, method="exact")  # Clopper-Pearson
        d, low, high = bench.paired_difference(a, b)
        assert d == pytest.approx((sum(a) - sum(b)) / 400)
        assert low == pytest.approx(m / 400 * (2 * ci.low - 1), abs=1e-9)
        assert high == pytest.approx(m / 400 * (2 * ci.high - 1), abs=1e-9)
        p = scipy.stats.binomtest(x, m).pvalue  # the interval excludes 0 exactly when McNemar rejects
        assert (low > 0 or high < 0) == (p < 0.05)
    with pytest.raises(ValueError):
        bench.paired_difference([True], [True, False])


def test_table_and_plot_show_the_paired_difference(tmp_path):
    nan = float("nan")
    rows = [{"policy": name, "problems": 10, "accuracy": acc, "acceptance_rate": nan, "mean_accepted_length": tpf,
             "target_forwards_per_token": 1 / tpf, "new_tokens": 100, "tokens_per_s": tps, "speedup_vs_target": 1.0,
             "batch_size": 1, "peak_mib": nan, "accuracy_vs_target": acc - 0.5, "accuracy_vs_target_low": low,
             "accuracy_vs_target_high": high, "lost_vs_target": lost, "gained_vs_target": gained,
             "speed_probe": 300.0}
            for name, acc, tpf, tps, low, high, lost, gained in (
                ("target", 0.5, 1.0, 4.0, 0.0, 0.0, 0, 0), ("exact", 0.5, 2.5, 7.0, 0.0, 0.0, 1, 1),
                ("typical@0.09,0.3", 0.45, 3.1, 8.0, -0.15, 0.05, 2, 1))]
    paths = bench.write(rows, tmp_path, "t", "header line", plot=True)
    text = paths[1].read_text()
    assert "| typical@0.09,0.3 |" in text and "-5.0 [-15.0, +5.0] | 2 / 1 |" in text and "exact McNemar" in text
    assert "| 300 |" in text and "do not compare" not in text
    png = paths[2].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    # 66/80 against 67/80, one problem lost and none gained: the interval's low end is the point itself, which
    # in float lies 1 ulp above it
    edge = [dict(rows[0], accuracy=67 / 80), dict(rows[2], policy="threshold@0.4", accuracy=66 / 80,
                                                  accuracy_vs_target=-1 / 80, accuracy_vs_target_low=-1 / 80,
                                                  accuracy_vs_target_high=0.95 / 80, lost_vs_target=1,
                                                  gained_vs_target=0)]
    assert 66 / 80 - (67 / 80 - 1 / 80) < 0
    assert bench.write(edge, tmp_path, "edge", "header line", plot=True)[2].read_bytes()[:4] == b"\x89PNG"
    # rows timed on machines of different speeds have no tokens/s: that panel is left out, not drawn empty
    assert [key for key, _ in bench.plot_axes(rows)] == ["tokens_per_s", "mean_accepted_length"]
    untimed = [dict(r, tokens_per_s=nan, speedup_vs_target=nan) for r in rows]
    assert [key for key, _ in bench.plot_axes(untimed)] == ["mean_accepted_length"]
    assert [key for key, _ in bench.plot_axes(untimed[:1] + rows[1:2])] == ["tokens_per_s", "mean_accepted_length"]
    png = bench.write(untimed, tmp_path, "untimed", "header line", plot=True)[2].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[16:20] < paths[2].read_bytes()[16:20]  # narrower: one panel


def test_interval_bars_sit_on_the_reference_accuracy():
    # A sampled table's differences are against exact, not the target: the bar of a row is exact's accuracy
    # plus the interval of the row's difference from exact (a bar placed on the target's accuracy, 0.10 lower
    # here, would put every interval 10 points too low).
    def row(policy, accuracy, low, high, reference):
        return {"policy": policy, "accuracy": accuracy, "accuracy_vs_target_low": low,
                "accuracy_vs_target_high": high, "reference": reference}

    rows = [row("target", 0.50, -0.20, 0.02, "exact K=8"), row("exact K=8", 0.60, 0.0, 0.0, "exact K=8"),
            row("kl@0.2 K=8", 0.55, -0.12, 0.03, "exact K=8"), row("fly K=8", 0.4, float("nan"), float("nan"),
                                                                  "exact K=8")]
    bounds = bench.interval_bounds(rows)
    assert set(bounds) == {"target", "kl@0.2 K=8"}  # not the reference itself, not a row without an interval
    assert bounds["target"] == pytest.approx((0.40, 0.62)) and bounds["kl@0.2 K=8"] == pytest.approx((0.48, 0.63))
    # each bar holds its point when the difference is the row's accuracy minus the reference's
    assert all(lo <= r["accuracy"] <= hi for r in rows if r["policy"] in bounds for lo, hi in [bounds[r["policy"]]])
    # a greedy table's reference is the target (older rows carry no reference: the target too)
    greedy = [dict(r, reference="target") for r in rows[:1]] + [
        {k: v for k, v in row("exact K=8", 0.60, -0.05, 0.25, "target").items() if k != "reference"}]
    greedy_bounds = bench.interval_bounds(greedy)
    assert list(greedy_bounds) == ["exact K=8"] and greedy_bounds["exact K=8"] == pytest.approx((0.45, 0.75))


def test_coinciding_points_share_one_label():
    rows = [{"policy": name, "accuracy": acc, "tokens_per_s": tps}
            for name, acc, tps in (("target", 0.5, 4.0), ("exact", 0.5, 7.001), ("pivot@0.15", 0.5, 6.999),
                                   ("fly", 0.5, 7.1), ("typical", 0.45, 7.0), ("draft", 0.2, float("nan")))]
    assert sorted(bench.point_labels(rows, "tokens_per_s")) == [
        (4.0, 0.5, "target"), (7.0, 0.45, "typical"), (7.001, 0.5, "exact = pivot@0.15"), (7.1, 0.5, "fly")]


def test_a_rules_settings_at_one_k_form_one_curve():
    nan = float("nan")
    rows = [{"policy": name, "accuracy": acc, "mean_accepted_length": tpf}
            for name, acc, tpf in (("target", 0.6, 1.0), ("exact K=8", 0.6, 6.6), ("hf-assisted K=8", 0.6, 6.6),
                                   ("typical K=8", 0.49, 8.2), ("typical@0.3,0.6 K=8", 0.58, 7.0),
                                   ("threshold@0.4 K=8", 0.63, 6.75), ("threshold@0.2 K=8", 0.55, 7.3),
                                   ("threshold@0.2 K=16", 0.5, 9.9), ("pivot@0.3 K=8", 0.58, 7.2),
                                   ("pivot@0.15 K=8", 0.61, 6.7), ("pivot@0.5 K=8", 0.5, nan),
                                   ("fly K=8", 0.52, 7.4))]
    assert bench.rule_curves(rows, "mean_accepted_length") == {
        ("typical", "K=8"): [(7.0, 0.58), (8.2, 0.49)],
        ("threshold", "K=8"): [(6.75, 0.63), (7.3, 0.55)],
        ("pivot", "K=8"): [(6.7, 0.61), (7.2, 0.58)]}  # fly and threshold at K=16 have one point each


def test_a_rules_settings_with_two_drafters_form_two_curves():
    # a cross-drafter table: pivot with suffix and with hybrid are two curves, never one through both, and
    # exact with a drafter is exact (a single point), not a rule of its own
    rows = [{"policy": name, "accuracy": acc, "mean_accepted_length": tpf}
            for name, acc, tpf in (("exact/suffix K=8", 0.85, 2.57), ("pivot@0.1/suffix K=8", 0.85, 2.58),
                                   ("pivot@0.2/suffix K=8", 0.84, 2.63), ("exact/hybrid K=8", 0.85, 6.33),
                                   ("pivot@0.3/hybrid K=8", 0.838, 6.39), ("pivot@0.5/hybrid K=8", 0.812, 6.49),
                                   ("typical/hybrid K=8", 0.85, 6.84), ("typical@0.3,0.6/hybrid K=8", 0.86, 6.7),
                                   ("threshold@0.2/suffix K=8", 0.825, 2.59))]
    assert bench.rule_curves(rows, "mean_accepted_length") == {
        ("pivot", "/suffix K=8"): [(2.58, 0.85), (2.63, 0.84)],
        ("pivot", "/hybrid K=8"): [(6.39, 0.838), (6.49, 0.812)],
        ("typical", "/hybrid K=8"): [(6.7, 0.86), (6.84, 0.85)]}


def test_speed_probe_rows_and_their_spread(monkeypatch):
    def record(seconds, probe=None):
        return {"correct": True, "new_tokens": 10, "seconds": seconds, "target_forwards": 2, "drafted": 8,
                "accepted": 8, **({} if probe is None else {"speed_probe": probe})}

    t = bench.PolicyTotals()
    for r in (record(10.0, 100.0), record(30.0, 200.0), record(5.0)):  # the last one predates the probe
        t.add(r)
    assert t.row("exact")["speed_probe"] == pytest.approx((10 * 100 + 30 * 200) / 40)  # weighted as tok/s
    old = bench.PolicyTotals()
    old.add(record(5.0))
    assert math.isnan(old.row("target")["speed_probe"])
    assert t.row("exact")["probe_mixed"]  # its runs were timed 2x apart, one without a probe
    assert not old.row("target")["probe_mixed"]


def _timed(name, probes, seconds=10.0):
    t = bench.PolicyTotals()
    for p in probes:
        t.add({"correct": True, "new_tokens": 10, "seconds": seconds, "target_forwards": 2, "drafted": 8, "accepted": 8,
               **({} if p is None else {"speed_probe": p})})
    return name, t


@pytest.mark.parametrize("probes, shown", [
    # the target's probe is the reference: within 5% stays, a machine 2x as fast or one without a probe goes
    ({"target": [300.0], "exact": [310.0], "pivot": [600.0], "fly": [None]}, {"target", "exact"}),
    # a row whose own runs were timed apart goes; with no target probe the median is the reference
    ({"target": [None], "exact": [300.0, 302.0], "pivot": [300.0, 600.0], "fly": [305.0]}, {"exact", "fly"}),
    # a target partly timed before the probe existed still sets the reference, and goes itself
    ({"target": [None, 300.0], "exact": [301.0], "pivot": [600.0]}, {"exact"}),
    # logs older than the probe: nothing to check against, every speed stays
    ({"target": [None], "exact": [None]}, {"target", "exact"}),
])
def test_tables_never_compare_speeds_across_machines(probes, shown, tmp_path):
    totals = dict(_timed(name, p) for name, p in probes.items())
    correct = {name: [True, False] for name in probes}  # the pairing of accuracies is not what this tests
    rows = bench.summary_rows(totals, correct)
    assert {r["policy"] for r in rows if not math.isnan(r["tokens_per_s"])} == shown
    target_shown = "target" in shown
    for r in rows:
        assert math.isnan(r["speedup_vs_target"]) == (r["policy"] not in shown or not target_shown)
    table = bench.markdown(rows, "h")
    left = sorted(set(probes) - shown)
    assert (f"Tokens/s left out (n/a) for" in table) == bool(left)
    for name in left:
        line = next(l for l in table.splitlines() if l.startswith(f"| {name} |"))
        assert "n/a" in line.split("|")[6]  # the tokens/s cell
    paths = bench.write(rows, tmp_path, "t", "h", plot=True)  # the plot leaves their points out of tokens/s
    assert paths[-1].suffix == ".png" and paths[-1].stat().st_size > 0


def test_speed_probe_is_machine_speed(monkeypatch):
    # GFLOP/s from a clock that advances 10 ms between its readings: 2 * 144 * 1536 * 8960 flops / 0.01 s
    clock = iter(i * 0.01 for i in range(100))
    monkeypatch.setattr(machine.time, "perf_counter", lambda: next(clock))
    assert machine.speed_probe("float32") == pytest.approx(2 * 144 * 1536 * 8960 / 0.01 / 1e9)


@pytest.mark.parametrize("seed", range(3))
def test_label_offsets_never_overlap_and_keep_inside(seed):
    g = torch.Generator().manual_seed(seed)
    n = 12
    anchors = [tuple(v) for v in (torch.rand(n, 2, generator=g) * torch.tensor([200.0, 60.0])).tolist()]
    anchors[1] = anchors[0]  # two policies on one point
    sizes = [tuple(v) for v in (torch.rand(n, 2, generator=g) * torch.tensor([80.0, 4.0]) + torch.tensor([20.0, 8.0])).tolist()]
    offsets = bench.label_offsets(anchors, sizes, right=250.0)
    boxes = [(x + dx, y + dy, x + dx + w, y + dy + h) for (x, y), (dx, dy), (w, h) in zip(anchors, offsets, sizes)]
    for i in range(n):
        assert boxes[i][2] <= 250.0 or boxes[i][0] == anchors[i][0] + 3.0  # left of the bound unless no room
        for j in range(i):
            a, b = boxes[i], boxes[j]
            assert not (a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]), (i, j)


def test_label_offsets_default_and_right_edge():
    assert bench.label_offsets([(10.0, 10.0)], [(30.0, 8.0)]) == [(3.0, 3.0)]
    assert bench.label_offsets([(240.0, 10.0)], [(30.0, 8.0)], right=250.0) == [(-33.0, 3.0)]


def test_sampled_bench_repeats_its_seed_and_logs_it_apart(tmp_path):
    target, draft, tok, problems = _bench_setup()
    specs = bench.parse_policies("target,exact,kl@inf,0,topk@0,1")  # kl and topk at their exact-equal settings
    log = tmp_path / "runs.jsonl"
    kwargs = dict(num_draft_tokens=3, max_new_tokens=12, progress=False, log=log, batch_size=2)

    def replies(**sampling):
        bench.run("gsm8k", problems, target, draft, tok, specs, **kwargs, **sampling)
        return {(r["problem"], r["policy"]): r["reply"] for r in map(json.loads, log.read_text().splitlines())
                if r["settings"].get("seed") == sampling.get("seed") and "temperature" in r["settings"]}

    first = replies(temperature=1.0, seed=0)
    assert len(first) == 3 * 4 and len(log.read_text().splitlines()) == 12
    for p in problems:  # the relaxed rules at their exact-equal settings sample exact's very tokens
        assert first[p.id, "kl@inf,0"] == first[p.id, "topk@0,1"] == first[p.id, "exact"]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert all(r["settings"]["temperature"] == 1.0 and r["settings"]["top_p"] == 1.0 for r in records)
    # A fresh log, the same seed: the same samples, whatever ran before in the process.
    log.unlink()
    bench.run("gsm8k", problems[1:], target, draft, tok, specs[:1], **{**kwargs, "batch_size": 1},
              temperature=1.0, seed=5)
    log.unlink()
    assert replies(temperature=1.0, seed=0) == first
    second = replies(temperature=1.0, seed=1)  # another seed: other samples, logged beside the first
    assert second != first and len(log.read_text().splitlines()) == 24
    # Greedy runs reuse no sampled record (and the other way round).
    bench.run("gsm8k", problems, target, draft, tok, specs[:1], **kwargs)
    greedy = [json.loads(x) for x in log.read_text().splitlines()][24:]
    assert len(greedy) == 3 and all("temperature" not in r["settings"] for r in greedy)
    for bad in ("fly", "hf-assisted"):
        with pytest.raises(ValueError, match="in --policies with --temperature"):
            bench.run("gsm8k", problems, target, draft, tok, bench.parse_policies(f"target,{bad}"), **kwargs,
                      temperature=0.7)


def test_group_seed_depends_on_the_seed_and_the_first_problem():
    assert bench.group_seed(0, "a") == bench.group_seed(0, "a")
    assert len({bench.group_seed(s, p) for s in range(3) for p in ("a", "b")}) == 6


@pytest.mark.parametrize("df", [1, 2, 3, 6, 10, 99])
def test_t_quantile(df):
    tolerance = 4e-3 if df < 6 else 2e-4 if df < 10 else 2e-5
    assert bench._t_quantile(0.975, df) == pytest.approx(scipy.stats.t.ppf(0.975, df), abs=tolerance)


def test_paired_mean_difference_is_the_t_interval_over_problems():
    g = torch.Generator().manual_seed(4)
    a = (torch.randint(0, 4, (100,), generator=g) / 3).tolist()  # shares of 3 seeds
    b = [min(1.0, x + (1 / 3 if torch.rand(1, generator=g) < 0.2 else 0)) for x in a]
    d, low, high = bench.paired_mean_difference(a, b)
    diff = torch.tensor(a, dtype=torch.float64) - torch.tensor(b, dtype=torch.float64)
    half = scipy.stats.t.ppf(0.975, 99) * float(diff.std()) / 10
    assert d == pytest.approx(float(diff.mean())) and high - d == pytest.approx(half, rel=1e-4)
    assert low == pytest.approx(d - (high - d)) and high < 0  # b is never worse: a real loss
    rows = bench.summary_rows({"exact": bench.PolicyTotals(), "x": bench.PolicyTotals()}, {"exact": b, "x": a},
                              reference="exact")
    x = rows[1]
    assert x["reference"] == "exact" and x["interval"] == "t over problems"
    assert x["accuracy_vs_target"] == pytest.approx(d) and x["lost_vs_target"] == sum(u < v for u, v in zip(a, b))
    assert x["gained_vs_target"] == 0
    with pytest.raises(ValueError):
        bench.paired_mean_difference([0.5], [0.5])


def test_summary_rows_count_the_replies_equal_to_the_reference():
    """Replies equal word for word, per problem in order; a policy without replies, or a reference without
    them, gets none (n/a); replies over other problems are refused."""
    totals = {name: bench.PolicyTotals() for name in ("exact", "x", "y")}
    correct = {name: [True, False, True] for name in totals}
    replies = {"exact": ["a", "b", "c"], "x": ["a", "b ", "c"]}
    rows = {r["policy"]: r for r in bench.summary_rows(totals, correct, "exact", replies)}
    assert (rows["x"]["same_reply_vs_target"], rows["x"]["replies_compared"]) == (2, 3)
    assert rows["exact"]["same_reply_vs_target"] == 3 and math.isnan(rows["y"]["same_reply_vs_target"])
    table = bench.markdown(list(rows.values()), "h")
    assert "replies = exact" in table and "| 2 / 3 |" in table and "Replies = exact:" in table
    assert all(math.isnan(r["same_reply_vs_target"]) for r in bench.summary_rows(totals, correct, "exact", {"x": ["a"]}))
    with pytest.raises(ValueError, match="same problems"):
        bench.summary_rows(totals, correct, "exact", {"exact": ["a", "b", "c"], "x": ["a", "b"]})


def test_paired_script_separates_who_judges_draft_free_proposals(tmp_path, capsys):
    """bench/paired.py: pivot records with a lookup-capable drafter are rows by judge_free (absent: judged, as
    before the choice); each pair's difference is (only a right - only b right) / problems; several logs' rows
    are named after their folders."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("paired", Path(__file__).resolve().parents[1] / "bench" / "paired.py")
    paired = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(paired)
    right = {"target": [1, 1, 1, 0, 1], "pivot@0.3/hybrid": [1, 0, 1, 1, 1], "old": [0, 0, 1, 0, 1]}
    records = []
    for name, outcomes in right.items():
        settings = {"drafter": "hybrid", "judge_free": False} if name == "pivot@0.3/hybrid" else (
            {"drafter": "hybrid"} if name == "old" else {})
        records += [{"problem": f"p{i}", "policy": "pivot@0.3/hybrid" if name == "old" else name,
                     "settings": settings, "correct": bool(c)} for i, c in enumerate(outcomes)]
    rows = paired.outcomes(records)
    assert sorted(rows) == ["pivot@0.3/hybrid", "pivot@0.3/hybrid --judge-free", "target"]
    text = paired.table(rows, ["target", "pivot@0.3/hybrid", "pivot@0.3/hybrid --judge-free"])
    assert "| target | pivot@0.3/hybrid | 5 | +0.0 [" in text and "| 1 / 1 |" in text
    assert "| target | pivot@0.3/hybrid --judge-free | 5 | +40.0 [" in text and "| 2 / 0 |" in text
    with pytest.raises(ValueError, match="no scored records for exact"):
        paired.table(rows, ["target", "exact"])
    with pytest.raises(ValueError, match="logged twice"):
        paired.outcomes(records + records[:1])
    # Rows of two logs (the same problems, other settings) are named after their logs' folders.
    for folder, name, outcomes in (("xeon", "target", [1, 1, 0]), ("here", "target", [1, 0, 0])):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "runs.jsonl").write_text("".join(
            json.dumps({"problem": f"p{i}", "policy": name, "settings": {}, "correct": bool(c)}) + "\n"
            for i, c in enumerate(outcomes)))
    logs = [tmp_path / "xeon" / "runs.jsonl", tmp_path / "here" / "runs.jsonl"]
    assert sorted(paired.logged_rows(logs)) == ["target [here]", "target [xeon]"]
    paired.main([*map(str, logs), "--rows", "target [here],target [xeon]"])
    assert "| target [here] | target [xeon] | 3 | -33.3 [" in capsys.readouterr().out
    with pytest.raises(ValueError, match="different folders"):
        paired.logged_rows([logs[0], logs[0]])


def test_suffix_runs_never_see_a_reply_to_the_same_problem(tmp_path):
    """The suffix drafter's counts of earlier outputs start empty in every batch: a run after other suffix
    runs of the same problems (another policy, its own warm-up, an earlier bench in this process) decodes
    as a fresh drafter does, instead of copying their replies."""
    from pad import generate
    from pad.decoding.drafters import SuffixDrafter

    target, draft, tok, problems = _bench_setup()
    log = tmp_path / "runs.jsonl"
    bench.run("gsm8k", problems, target, draft, tok, bench.parse_policies("exact/suffix:4,exact/suffix:3,target"),
              num_draft_tokens=4, max_new_tokens=24, progress=False, log=log, batch_size=1)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    got = {(r["problem"], r["policy"]): (r["target_forwards"], r["drafted"], r["accepted"]) for r in records}
    for p in problems:
        for k in (4, 3):
            out = generate(target, None, tasks.prompt_ids(tok, "gsm8k", p), policy="exact", drafter=SuffixDrafter(),
                           num_draft_tokens=k, max_new_tokens=24,
                           eos_token_id=None if tok.eos_token_id is None else [tok.eos_token_id])  # as the bench
            s = out.row_stats[0]
            assert got[(p.id, f"exact/suffix:{k}")] == (s.target_forwards, s.drafted, s.accepted)
    assert sum(c[1] for c in got.values()) > 0  # the runs did propose
    assert [r["settings"].get("suffix_counts") for r in records] == ["per batch", "per batch", None] * 3
