"""bench/frontier.py: the frontier table over the run logs of several K, against sums worked out here."""
import contextlib
import importlib.util
import io
import json
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from pad.decoding.generate import DECODE_VERSION
from pad.evaluation.bench import paired_difference

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "frontier.py"
CLF = "c0ffee0123456789"
SAMPLE = Path(__file__).parent / "data" / "gsm8k_sample.jsonl"


def _record(problem, policy, k, rng, **settings):
    return {"problem": f"gsm8k/dev/{problem}", "policy": policy,
            "settings": {"decode": DECODE_VERSION, "dtype": "bfloat16", "max_new_tokens": 512, "k": k,
                         "batch_size": 4, "machine": "m1", "weights": {"target": "t", "draft": "d"},
                         **({"classifier": CLF} if policy.startswith("pivot") else {}), **settings},
            "correct": rng.random() < 0.5, "new_tokens": rng.randint(50, 300), "seconds": rng.uniform(1, 20),
            "target_forwards": rng.randint(10, 50), "drafted": rng.randint(0, 200), "accepted": rng.randint(0, 100),
            "batch_size": 4, "peak_mib": 100.0, "reply": rng.choice(("x = 1", "x = 2"))}


def _run_command(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=300)


_spec = importlib.util.spec_from_file_location("frontier_script", SCRIPT)
frontier = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(frontier)


def _run(*args):
    """The script's main() in this process (a new interpreter costs seconds of imports per call); what a
    command would return: its exit code, stdout and stderr (argparse's errors exit with 2)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = frontier.main([str(a) for a in args])
        except SystemExit as e:
            code = e.code
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def _rows(md: str) -> dict[str, list[str]]:
    return {cells[0]: cells for cells in ([c.strip() for c in line.strip("|").split("|")]
                                          for line in md.splitlines() if line.startswith("| ") and "---" not in line)}


@pytest.mark.parametrize("seed", [0, 1])
def test_frontier_joins_the_logs_of_two_k(tmp_path, seed):
    """Seed 0 runs the script as a command (its imports from the tree), seed 1 its main() in this process."""
    rng = random.Random(seed)
    n = 5  # the problems of the sample file
    k8 = [_record(p, pol, 8, rng) for p in range(n) for pol in ("target", "exact", "pivot@0.15")]
    k8 += [_record(p, "fly", 8, rng) for p in range(n - 1)]  # one problem short: not listed
    k8 += [_record(p, "exact", 8, rng, dtype="float32") for p in range(n)]  # another dtype: ignored
    k8 += [_record(p, "pivot@0.5", 8, rng, classifier="another") for p in range(n)]  # another classifier
    k8 += [_record(n, "exact", 8, rng)]  # a problem past --limit: ignored
    k16 = [_record(p, pol, 16, rng) for p in range(n) for pol in ("exact", "fly@0.3,6")]
    k16 += [_record(0, "exact", 16, rng, machine="m2")]  # a second run of problem 0: the first one counts
    logs = []
    for name, records in (("gsm8k_dev_k8_bfloat16.runs.jsonl", k8), ("gsm8k_dev_k16_bfloat16.runs.jsonl", k16)):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in records))
        logs.append(tmp_path / name)
    proc = (_run_command if seed == 0 else _run)(*logs, "--data", SAMPLE, "--limit", n, "--batch-size", 4,
                                                "--classifier", CLF, "--out", tmp_path, "--stem", "f")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(proc.stdout)
    assert list(rows)[1:] == ["target", "exact K=8", "pivot@0.15 K=8", "exact K=16", "fly@0.3,6 K=16"]
    assert "fly K=8 (4/5)" in proc.stdout and "pivot@0.5" not in rows
    assert "Machines: m1" in proc.stdout and "m2" not in proc.stdout

    def group(policy, k):
        return [next(r for r in k8 + k16 if r["policy"] == policy and r["problem"] == f"gsm8k/dev/{p}"
                     and (policy == "target" or r["settings"]["k"] == k) and r["settings"]["dtype"] == "bfloat16"
                     and r["settings"].get("classifier", CLF) == CLF) for p in range(n)]

    target = group("target", None)
    tps_target = sum(r["new_tokens"] for r in target) / sum(r["seconds"] for r in target)
    for label, policy, k in (("exact K=8", "exact", 8), ("pivot@0.15 K=8", "pivot@0.15", 8),
                             ("exact K=16", "exact", 16), ("fly@0.3,6 K=16", "fly@0.3,6", 16)):
        runs = group(policy, k)
        cells = rows[label]
        assert cells[1] == f"{sum(r['correct'] for r in runs) / n:.1%}"
        assert cells[3] == f"{sum(r['new_tokens'] for r in runs) / sum(r['target_forwards'] for r in runs):.2f}"
        tps = sum(r["new_tokens"] for r in runs) / sum(r["seconds"] for r in runs)
        assert cells[5] == f"{tps:.2f}" and cells[6] == f"{tps / tps_target:.2f}x"
        d, lo, hi = paired_difference([r["correct"] for r in runs], [r["correct"] for r in target])
        assert cells[7] == f"{100 * d:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]"
        lost = sum(t["correct"] and not r["correct"] for r, t in zip(runs, target))
        gained = sum(r["correct"] and not t["correct"] for r, t in zip(runs, target))
        assert cells[8] == f"{lost} / {gained}" and lost - gained == round(-d * n)
        assert cells[9] == f"{sum(r['reply'] == t['reply'] for r, t in zip(runs, target))} / {n}"
    assert rows["target"][9] == f"{n} / {n}"
    assert (tmp_path / "f.md").is_file() and (tmp_path / "f.csv").is_file()
    assert (tmp_path / "f.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_frontier_refuses_logs_without_a_complete_policy_and_mixed_weights(tmp_path):
    rng = random.Random(2)
    log = tmp_path / "gsm8k_dev_k8_bfloat16.runs.jsonl"
    log.write_text("".join(json.dumps(_record(p, "exact", 8, rng)) + "\n" for p in range(3)))
    proc = _run(log, "--data", SAMPLE, "--limit", 4, "--batch-size", 4, "--classifier", CLF)
    assert proc.returncode == 1 and "no policy has runs of all 4 problems" in proc.stderr and "exact K=8" in proc.stderr
    other = [_record(p, "target", 8, rng, weights={"target": "other", "draft": "d"}) for p in range(3)]
    log.write_text(log.read_text() + "".join(json.dumps(r) + "\n" for r in other))
    proc = _run(log, "--data", SAMPLE, "--limit", 3, "--batch-size", 4, "--classifier", CLF)
    assert proc.returncode == 2 and "mix runs of different weights" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_frontier_start_takes_a_span_of_problems(tmp_path):
    rng = random.Random(3)
    runs = {pol: [{**_record(p, pol, 8, rng), "speed_probe": probe} for p in range(2, 5)]
            for pol, probe in (("target", 300.0), ("exact", 330.0))}  # timed on machines 10% apart
    del runs["exact"][1]["reply"]  # a run logged before replies were: exact's replies are not compared
    log = tmp_path / "gsm8k_dev_k8_bfloat16.runs.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for rs in runs.values() for r in rs))
    proc = _run(log, "--data", SAMPLE, "--start", 2, "--limit", 5, "--batch-size", 4, "--classifier", CLF,
                "--out", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "problems 2-4" in proc.stdout and (tmp_path / "gsm8k_dev_2-4_frontier_bfloat16.md").is_file()
    cells = _rows(proc.stdout)["exact K=8"]
    assert cells[1] == f"{sum(r['correct'] for r in runs['exact']) / 3:.1%}" and cells[-1] == "330"
    # timed 10% apart: exact's tokens/s is left out, not compared with the target's
    assert cells[5] == "n/a" and "Tokens/s left out (n/a) for exact K=8" in proc.stdout
    assert cells[9] == "n/a" and _rows(proc.stdout)["target"][9] == "3 / 3"
    proc = _run(log, "--data", SAMPLE, "--start", 1, "--limit", 5, "--batch-size", 4, "--classifier", CLF)
    assert proc.returncode == 1 and "all 4 problems" in proc.stderr  # problem 1 has no runs
    proc = _run(log, "--data", SAMPLE, "--start", 5, "--limit", 5, "--batch-size", 4, "--classifier", CLF)
    assert proc.returncode == 2 and "--start must be" in proc.stderr


def test_sampled_frontier_pools_the_seeds_of_each_problem(tmp_path):
    import scipy.stats

    rng = random.Random(4)
    n, seeds = 5, (0, 1, 2)
    sampled = dict(temperature=0.7, top_p=1.0)
    runs = [_record(p, pol, 8, rng, seed=s, **sampled) for p in range(n) for s in seeds
            for pol in ("target", "exact", "kl@0.5,1")]
    runs += [_record(p, "topk@2,0.1", 8, rng, seed=s, **sampled) for p in range(n) for s in seeds[:2]]  # no seed 2
    runs += [_record(p, "exact", 8, rng) for p in range(n)]  # greedy: not in the sampled table
    runs += [_record(p, "exact", 8, rng, seed=0, temperature=1.0, top_p=1.0) for p in range(n)]  # another T
    log = tmp_path / "gsm8k_dev_k8_bfloat16_t0.7.runs.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in runs))
    proc = _run(log, "--data", SAMPLE, "--limit", n, "--batch-size", 4, "--classifier", CLF, "--temperature", 0.7,
                "--seeds", "0,1,2", "--out", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(proc.stdout)
    assert list(rows)[1:] == ["target", "exact K=8", "kl@0.5,1 K=8"] and "topk@2,0.1 K=8 (10/15)" in proc.stdout
    assert "accuracy - exact K=8 [95% CI]" in proc.stdout and "temperature 0.7, top-p 1, seeds 0,1,2" in proc.stdout
    assert (tmp_path / "gsm8k_dev_5_frontier_bfloat16_t0.7.md").is_file()

    def shares(policy):
        return [sum(r["correct"] for r in runs if r["policy"] == policy and r["problem"] == f"gsm8k/dev/{p}"
                    and r["settings"].get("temperature") == 0.7) / 3 for p in range(n)]

    kl, exact = shares("kl@0.5,1"), shares("exact")
    diff = [a - b for a, b in zip(kl, exact)]
    mean = sum(diff) / n
    half = scipy.stats.t.ppf(0.975, n - 1) * (sum((d - mean) ** 2 for d in diff) / (n - 1)) ** 0.5 / n ** 0.5
    cells = rows["kl@0.5,1 K=8"]
    assert cells[1] == f"{sum(kl) / n:.1%}"  # the mean over the seeds
    assert cells[7] == f"{100 * mean:+.1f} [{100 * (mean - half):+.1f}, {100 * (mean + half):+.1f}]"
    assert cells[8] == f"{sum(a < b for a, b in zip(kl, exact))} / {sum(a > b for a, b in zip(kl, exact))}"
    assert rows["exact K=8"][7] == "+0.0 [+0.0, +0.0]"

    def reply(policy, p, s):
        return next(r["reply"] for r in runs if r["policy"] == policy and r["problem"] == f"gsm8k/dev/{p}"
                    and r["settings"].get("temperature") == 0.7 and r["settings"]["seed"] == s)

    same = sum(reply("kl@0.5,1", p, s) == reply("exact", p, s) for p in range(n) for s in seeds)
    assert cells[9] == f"{same} / {n * len(seeds)}"  # run by run, each problem at each seed
    # The greedy table of the same log ignores the sampled runs: only the greedy exact is there, no target.
    proc = _run(log, "--data", SAMPLE, "--limit", n, "--batch-size", 4, "--classifier", CLF, "--reference", "exact")
    assert proc.returncode == 0 and list(_rows(proc.stdout))[1:] == ["exact K=8"]


def test_choose_takes_the_most_accepting_setting_within_two_points_of_the_reference(tmp_path):
    rng = random.Random(5)
    n = 5
    # policy: (problems right, acceptance); exact gets all 5 right, so "within 2 points" is all 5 right here.
    table = {"exact": (5, 0.5), "kl@0.2": (5, 0.1), "kl@0.5": (5, 0.3), "kl@1": (4, 0.6),
             "topk@2,0.1": (4, 0.2), "topk@3,0.3": (3, 0.4),  # none within: the least accepting first
             "typical": (5, 0.5), "typical@0.3,0.6": (5, 0.7), "threshold@0.4": (5, 0.2)}
    runs = [{**_record(p, pol, 8, rng), "correct": p < right, "drafted": 100, "accepted": round(100 * acc)}
            for pol, (right, acc) in table.items() for p in range(n)]
    log = tmp_path / "gsm8k_dev_k8_bfloat16.runs.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in runs))
    common = (log, "--data", SAMPLE, "--limit", n, "--batch-size", 4, "--classifier", CLF, "--reference", "exact")
    for per_rule, want in ((1, "kl@0.5,topk@2,0.1,typical@0.3,0.6,threshold@0.4"),
                           (2, "kl@0.5,kl@1,topk@2,0.1,topk@3,0.3,typical@0.3,0.6,typical,threshold@0.4")):
        proc = _run(*common, "--choose", "kl,topk,typical,threshold", "--per-rule", per_rule)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.splitlines()[-1] == f"chosen: {want}"
    proc = _run(*common, "--choose", "kl,fly")
    assert proc.returncode == 1 and "no complete row of the rule fly" in proc.stderr
    proc = _run(*common, "--choose", "kl", "--per-rule", 0)
    assert proc.returncode == 2 and "--per-rule must be" in proc.stderr


def test_frontier_joins_drafters_judged_by_classifiers_of_their_own(tmp_path):
    """Lookup's log judged by one classifier, hybrid's by another: one table with both drafters' pivot rows
    (each its own runs), and a policy run with both classifiers refused rather than mixed."""
    rng = random.Random(6)
    n, other = 4, "0d14e495a3355b7e"
    lookup = [_record(p, pol, 8, rng) for p in range(n) for pol in ("exact/lookup", "pivot@0.1/lookup")]
    hybrid = [_record(p, pol, 8, rng, classifier=other) for p in range(n) for pol in ("exact/hybrid", "pivot@0.3/hybrid")]
    hybrid += [_record(p, "pivot@0.3/hybrid", 8, rng, classifier="ignored") for p in range(n)]  # a third: not read
    logs = []
    for name, records in (("gsm8k_dev_k8_lookup.runs.jsonl", lookup), ("gsm8k_dev_k8_hybrid.runs.jsonl", hybrid)):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in records))
        logs.append(tmp_path / name)
    proc = _run(*logs, "--task", "gsm8k", "--data", SAMPLE, "--limit", n, "--batch-size", 4,
                "--classifier", f"{CLF},{other}", "--reference", "exact/lookup K=8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(proc.stdout)
    assert list(rows)[1:] == ["exact/lookup K=8", "pivot@0.1/lookup K=8", "exact/hybrid K=8", "pivot@0.3/hybrid K=8"]
    assert f"pivot classifier {CLF}, {other}" in proc.stdout
    for label, policy, clf in (("pivot@0.1/lookup K=8", "pivot@0.1/lookup", CLF),
                               ("pivot@0.3/hybrid K=8", "pivot@0.3/hybrid", other)):
        runs = [r for r in lookup + hybrid if r["policy"] == policy and r["settings"]["classifier"] == clf]
        assert rows[label][3] == f"{sum(r['new_tokens'] for r in runs) / sum(r['target_forwards'] for r in runs):.2f}"
    # one policy judged by both classifiers given: refused
    both = [_record(p, "pivot@0.1/lookup", 8, rng, classifier=other) for p in range(n)]
    logs[1].write_text(logs[1].read_text() + "".join(json.dumps(r) + "\n" for r in both))
    proc = _run(*logs, "--task", "gsm8k", "--data", SAMPLE, "--limit", n, "--batch-size", 4,
                "--classifier", f"{CLF},{other}", "--reference", "exact/lookup K=8")
    assert proc.returncode == 2 and "pivot@0.1/lookup K=8 was run with the classifiers" in proc.stderr
    assert "Traceback" not in proc.stderr
