"""Option combinations of the command line: each either runs (one problem, for bench) or is refused before
anything loads, with one line naming both options and exit code 2. Walks the policy kinds (target, the hf-*
baselines, exact, pivot, the relaxed rules, drafters, ``:K`` / ``:auto``) against every pair of settings of
``-k``, ``--judge-free``, ``--temperature``, ``--batch-size`` and ``--draft-stop`` (a covering array: every
pair of those flags' values meets every policy kind)."""
import itertools
import json
import re

import pytest

from pad.cli import main
from pad.models.classifier import PivotClassifier
from test_cli import SAMPLE, folders  # noqa: F401 - the tiny model folders

POLICY_KINDS = ["target", "hf-assisted", "hf-lookup", "hf-target", "exact", "pivot@0.3", "threshold@0.2", "fly@0.3,2",
                "kl@0.5,0.9", "exact/lookup", "pivot@0.3/hybrid", "threshold@0.2/suffix:auto", "exact:2"]
FLAGS = {"-k": ("2", "auto"), "--judge-free": (False, True), "--temperature": ("0", "0.7"),
         "--batch-size": ("1", "2"), "--draft-stop": (None, "0.5")}


def covering_rows() -> list[tuple]:
    """Rows of flag values in which every pair of two flags' values occurs (greedy, deterministic)."""
    names = list(FLAGS)
    wanted = {(i, a, j, b) for i, j in itertools.combinations(range(len(names)), 2)
              for a in range(2) for b in range(2)}
    rows = []
    while wanted:
        best = max(itertools.product(range(2), repeat=len(names)),
                   key=lambda r: sum((i, r[i], j, r[j]) in wanted for i, j in itertools.combinations(range(len(r)), 2)))
        wanted -= {(i, best[i], j, best[j]) for i, j in itertools.combinations(range(len(best)), 2)}
        rows.append(best)
    return rows


def flag_args(row) -> list[str]:
    args = []
    for (name, values), v in zip(FLAGS.items(), row):
        value = values[v]
        if value is True:
            args.append(name)
        elif value not in (None, False):
            args += [name, value]
    return args


@pytest.fixture(scope="module")
def classifier(folders, tmp_path_factory):  # noqa: F811 - the fixture imported above
    from transformers import AutoConfig

    hidden = AutoConfig.from_pretrained(folders / "target").hidden_size
    folder = tmp_path_factory.mktemp("clf") / "clf"
    PivotClassifier(hidden, layer=-1).eval().save(folder)
    return str(folder)


@pytest.mark.parametrize("policy", POLICY_KINDS)
def test_bench_combinations_run_or_are_refused_up_front(policy, folders, classifier, tmp_path, monkeypatch, capsys):  # noqa: F811
    import pad.cli
    import pad.evaluation.bench

    monkeypatch.setattr(pad.evaluation.bench, "speed_probe", lambda *a, **k: 100.0)
    loads = []
    real_load_pair = pad.cli._load_pair
    monkeypatch.setattr(pad.cli, "_load_pair", lambda *a, **k: loads.append(1) or real_load_pair(*a, **k))
    ran = refused = 0
    for i, row in enumerate(covering_rows()):
        out = tmp_path / str(i)
        args = ["bench", "--task", "gsm8k", "--data", SAMPLE, "--limit", "1", "--policies", f"target,{policy}"
                if policy != "target" else "target", "--max-new-tokens", "3", "--target", str(folders / "target"),
                "--draft", str(folders / "draft"), "--dtype", "float32", "--classifier", classifier,
                "--out", str(out), *flag_args(row)]
        loads.clear()
        code = main(args)
        err = capsys.readouterr().err
        if code == 0:
            runs = [json.loads(x) for x in next(out.glob("*.runs.jsonl")).read_text().splitlines()]
            assert {r["policy"] for r in runs} == {"target", policy}, args
            assert all(r["problem"] == "gsm8k/dev/0" for r in runs), args
            ran += 1
        else:
            lines = [x for x in err.splitlines() if x.startswith("pad-decoding: error:")]
            assert code == 2 and len(lines) == 1, (args, code, err[-2000:])
            assert re.search(r"error: .*(--\S+|in --policies).* with .*(--\S+|-k|drafter)", lines[0]), lines[0]
            assert not loads and not out.exists(), f"refused after work began: {args}"
            refused += 1
    assert ran and (refused or policy in ("pivot@0.3", "pivot@0.3/hybrid")), (policy, ran, refused)


@pytest.mark.parametrize("args,message", [
    (["--policies", "target,fly@0.3,2", "--temperature", "0.7"], "fly@0.3,2 in --policies with --temperature"),
    (["--policies", "target,kl@0.5,0.9", "--drafter", "lookup"], "kl@0.5,0.9 in --policies with --drafter"),
    (["--policies", "target,exact/lookup", "--draft-stop", "0.5"], "--draft-stop with --policies"),
    (["--policies", "target,exact", "--judge-free"], "--judge-free with --policies without a pivot policy"),
    (["--policies", "target,exact", "--max-draft-tokens", "6"], "--max-draft-tokens with a fixed -k"),
    (["--policies", "target,hf-assisted", "--temperature", "0.7"], "hf-assisted in --policies with --temperature"),
])
def test_bench_refusals_name_both_options(args, message, folders, capsys):  # noqa: F811
    base = ["bench", "--task", "gsm8k", "--data", SAMPLE, "--limit", "1", "--target", str(folders / "target"),
            "--draft", str(folders / "draft"), "--dtype", "float32"]
    assert main(base + args) == 2
    assert message in capsys.readouterr().err


def test_hf_baselines_run_at_the_default_k_under_auto(folders, tmp_path, monkeypatch, capsys):  # noqa: F811
    """-k auto with transformers' baselines: they run at K = 8, and the command says so before it starts;
    the command ends with the line naming the fastest policy and the table."""
    import pad.evaluation.bench

    monkeypatch.setattr(pad.evaluation.bench, "speed_probe", lambda *a, **k: 100.0)
    args = ["bench", "--task", "gsm8k", "--data", SAMPLE, "--limit", "1", "--policies", "target,hf-assisted",
            "-k", "auto", "--max-new-tokens", "3", "--target", str(folders / "target"), "--draft",
            str(folders / "draft"), "--dtype", "float32", "--out", str(tmp_path)]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert "hf-assisted runs at K = 8 under -k auto" in err
    run = [json.loads(x) for x in next(tmp_path.glob("*.runs.jsonl")).read_text().splitlines()]
    assert {r["settings"]["k"] for r in run if r["policy"] == "hf-assisted"} == {8}
    last = out.strip().splitlines()[-1]
    assert last.startswith("fastest here: hf-assisted at ") and "x the target" in last and last.endswith(".md")


@pytest.mark.parametrize("args,message", [
    (["--policy", "target", "--draft-stop", "0.5"], "--policy target with --draft-stop"),
    (["--policy", "fly@0.3,2", "--temperature", "0.7"], "--policy fly@0.3,2 with --temperature"),
    (["--policy", "exact", "--judge-free"], "--policy exact with --judge-free"),
    (["--policy", "kl@0.5,0.9", "--drafter", "suffix"], "--policy kl@0.5,0.9 with --drafter"),
    (["--policy", "exact", "--drafter", "lookup", "--draft-stop", "0.5"], "--drafter with --draft-stop"),
    (["--policy", "exact", "--max-draft-tokens", "6"], "-k with --max-draft-tokens"),
])
def test_generate_refuses_before_loading(args, message, folders, monkeypatch, capsys):  # noqa: F811
    import pad.cli

    monkeypatch.setattr(pad.cli, "_load_pair", lambda *a, **k: pytest.fail("models loaded for a refused command"))
    base = ["generate", "--target", str(folders / "target"), "--draft", str(folders / "draft"), "--prompt", "w1 w2",
            "--dtype", "float32"]
    assert main(base + args) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("policies,needs", [
    ("target,exact/suffix,threshold@0.2/lookup,hf-lookup,hf-target", False),
    ("target,exact/suffix,exact/hybrid", True),
    ("target,exact/lookup,draft", True),
    ("target,hf-assisted", True),
])
def test_bench_loads_the_draft_only_where_a_policy_runs_it(policies, needs, folders, tmp_path, monkeypatch):  # noqa: F811
    """A benchmark of draft-free policies decodes with the target alone (no draft in memory), and its replies are
    those of the same command with the draft loaded."""
    import pad.cli
    import pad.evaluation.bench

    monkeypatch.setattr(pad.evaluation.bench, "speed_probe", lambda *a, **k: 100.0)
    asked = []
    real_load_pair = pad.cli._load_pair
    monkeypatch.setattr(pad.cli, "_load_pair", lambda a, need_draft=True: asked.append(need_draft)
                        or real_load_pair(a, need_draft))

    def replies(out):
        args = ["bench", "--task", "gsm8k", "--data", SAMPLE, "--limit", "2", "--batch-size", "2", "--policies",
                policies, "-k", "3", "--max-new-tokens", "6", "--target", str(folders / "target"), "--draft",
                str(folders / "draft"), "--dtype", "float32", "--out", str(out)]
        assert main(args) == 0
        runs = [json.loads(x) for x in next(out.glob("*.runs.jsonl")).read_text().splitlines()]
        return {(r["policy"], r["problem"]): r["reply"] for r in runs}

    got = replies(tmp_path / "a")
    assert asked == [needs]
    monkeypatch.setattr(pad.evaluation.bench, "needs_draft_model", lambda *a, **k: True)
    assert replies(tmp_path / "b") == got and asked == [needs, True]


@pytest.mark.parametrize("args,needs", [
    ([], True),  # the default policy drafts with the model
    (["--policy", "draft"], True),
    (["--policy", "exact", "--drafter", "hybrid"], True),
    (["--policy", "target"], False),
    (["--policy", "exact", "--drafter", "lookup"], False),
    (["--policy", "threshold@0.2", "--drafter", "suffix"], False),
])
def test_generate_loads_the_draft_only_where_its_policy_runs_it(args, needs, folders, monkeypatch, capsys):  # noqa: F811
    """The generate command's rule is the bench's (``runs_draft_model``): a decode that never drafts with the model
    leaves it unloaded, and its reply is the one decoded with the draft in memory."""
    import pad.cli
    import pad.decoding.generate

    asked = []
    real_load_pair = pad.cli._load_pair
    monkeypatch.setattr(pad.cli, "_load_pair", lambda a, need_draft=True: asked.append(need_draft)
                        or real_load_pair(a, need_draft))
    base = ["generate", "--target", str(folders / "target"), "--draft", str(folders / "draft"), "--prompt",
            "w1 w2 w3 w1 w2", "--max-new-tokens", "8", "-k", "3", "--dtype", "float32", *args]
    assert main(base) == 0
    reply = capsys.readouterr().out.splitlines()[0]  # the text; the stats line below it holds timings
    assert asked == [needs]
    monkeypatch.setattr(pad.decoding.generate, "runs_draft_model", lambda *a, **k: True)
    assert main(base) == 0
    assert capsys.readouterr().out.splitlines()[0] == reply and asked == [needs, True]
