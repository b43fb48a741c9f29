"""The command line decodes with local model folders and refuses tokenizers that differ."""
import json
import os
import signal
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from pad.cli import main
from label_folders import assert_same_labels
from tiny import tiny_pair

SAMPLE = str(Path(__file__).parent / "data" / "gsm8k_sample.jsonl")


def _tokenizer(words):
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=words[0])


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    target, draft = tiny_pair("llama")
    words = [f"w{i}" for i in range(96)]
    for name, model, vocab in (("target", target, words), ("draft", draft, words),
                               ("other", draft, words[::-1])):
        model.save_pretrained(root / name)
        tok = _tokenizer(vocab)
        tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
        tok.save_pretrained(root / name)
    return root


def test_generate_prints_text_and_stats(folders, capsys):
    code = main(["generate", "--target", str(folders / "target"), "--draft", str(folders / "draft"),
                 "--prompt", "w1 w2 w3", "--max-new-tokens", "12", "-k", "3", "--dtype", "float32", "--json"])
    assert code == 0
    out = capsys.readouterr().out
    stats = json.loads(out[out.index("{"):])
    assert stats["new_tokens"] == 12 and stats["target_forwards"] >= 3
    assert 0.0 <= stats["acceptance_rate"] <= 1.0
    assert out.split()[0].startswith("w")


def test_profile_is_saved_and_read_by_auto_generate(folders, capsys, monkeypatch, tmp_path):
    """pad-decoding profile times both models and saves the costs; a later -k auto decode in a fresh process
    state starts from them and probes nothing."""
    from pad.decoding import draft_length

    monkeypatch.setenv("PAD_CACHE", str(tmp_path))
    monkeypatch.setattr(draft_length, "_COSTS", draft_length.weakref.WeakKeyDictionary())
    code = main(["profile", "--target", str(folders / "target"), "--draft", str(folders / "draft"), "--dtype",
                 "float32", "--batch-sizes", "1,3", "--columns", "4,16", "--max-draft-tokens", "3"])
    out = capsys.readouterr().out
    assert code == 0 and out.count("wrote ") == 2 and "| 3 | 4 | 16 |" in out  # the target's K = 3 block at 3 rows
    saved = sorted((tmp_path / "profiles").glob("*.json"))
    assert len(saved) == 2
    target_profile = next(json.loads(p.read_text()) for p in saved if "target" in json.loads(p.read_text())["model"])
    assert {(b, t, c) for b, t, c, _ in target_profile["observations"]} == {
        (b, t, c) for b in (1, 3) for t in (1, 2, 3, 4) for c in (4, 16)}

    def no_probe(*a, **k):
        raise AssertionError("probed although a profile covers the shapes")

    monkeypatch.setattr(draft_length, "_COSTS", draft_length.weakref.WeakKeyDictionary())
    monkeypatch.setattr(draft_length, "probe", no_probe)
    code = main(["generate", "--target", str(folders / "target"), "--draft", str(folders / "draft"), "--prompt",
                 "w1 w2 w3", "--max-new-tokens", "10", "-k", "auto", "--max-draft-tokens", "3", "--dtype", "float32",
                 "--json"])
    stats = json.loads((out := capsys.readouterr().out)[out.index("{"):])
    assert code == 0 and stats["new_tokens"] == 10 and set(map(int, stats["draft_lengths"])) <= {0, 1, 2, 3}


@pytest.mark.parametrize("policy, drafts", [("target", False), ("draft", False), ("exact", True)])
def test_summary_line_has_no_nan(folders, capsys, policy, drafts):
    code = main(["generate", "--target", str(folders / "target"), "--draft", str(folders / "draft"),
                 "--prompt", "w1 w2", "--max-new-tokens", "5", "-k", "2", "--dtype", "float32", "--policy", policy])
    assert code == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert summary.startswith("5 new tokens") and "nan" not in summary
    assert ("acceptance rate" in summary) == drafts and ("no draft tokens" in summary) != drafts


def test_mismatched_tokenizers_are_refused(folders, capsys):
    code = main(["generate", "--target", str(folders / "target"), "--draft", str(folders / "other"),
                 "--prompt", "w1", "--dtype", "float32"])
    assert code == 2
    assert "cannot be aligned" in capsys.readouterr().err


def test_user_errors_are_one_line_and_bugs_keep_their_traceback(folders, monkeypatch, capsys):
    import pad.decoding.speculative as speculative

    args = ["generate", "--target", str(folders / "target"), "--draft", str(folders / "draft"), "--prompt", "w1",
            "--dtype", "float32", "--max-new-tokens", "2"]
    assert main([*args, "-k", "0"]) == 2  # a user error: one line, no traceback
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("pad-decoding: error: num_draft_tokens") and "Traceback" not in err
    with pytest.raises(ValueError, match="num_draft_tokens"):  # --debug: the traceback of a user error too
        main(["--debug", *args, "-k", "0"])

    def bug(*a, **k):
        raise RuntimeError("an internal invariant broke")

    monkeypatch.setattr(speculative, "decode", bug)
    with pytest.raises(RuntimeError, match="an internal invariant broke"):  # a bug is never hidden
        main(args)


@pytest.mark.parametrize("command", ["bench", "label"])
def test_bad_task_and_missing_data_are_clear_errors(folders, tmp_path, capsys, command):
    models = ["--target", str(folders / "target"), "--draft", str(folders / "draft"), "--dtype", "float32"]
    extra = ["--out", str(tmp_path / "out")] if command == "label" else []
    assert main([command, "--task", "mmlu", *models, *extra]) == 2
    assert "unknown task 'mmlu'; choose one of gsm8k, humaneval" in capsys.readouterr().err
    assert main([command, "--task", "gsm8k", "--data", str(tmp_path / "none.jsonl"), *models, *extra]) == 2
    assert "none.jsonl does not exist" in capsys.readouterr().err


def test_classifier_for_another_pair_is_refused(folders, tmp_path, capsys):
    from pad import PivotClassifier

    PivotClassifier(32, layer=-1, target_model="qwen2.5-coder-1.5b-instruct",
                    draft_model="qwen2.5-coder-0.5b-instruct").save(tmp_path / "clf")
    code = main(["bench", "--task", "gsm8k", "--data", SAMPLE, "--policies", "pivot@0.5",
                 "--classifier", str(tmp_path / "clf"), "--target", str(folders / "target"), "--draft",
                 str(folders / "draft"), "--dtype", "float32"])
    assert code == 2
    err = capsys.readouterr().err
    assert "trained for target 'qwen2.5-coder-1.5b-instruct'" in err and "the target is" in err
    # Without --classifier, a pair with no shipped classifier is told so.
    code = main(["bench", "--task", "gsm8k", "--data", SAMPLE, "--policies", "pivot@0.5",
                 "--target", str(folders / "target"), "--draft", str(folders / "draft"), "--dtype", "float32"])
    assert code == 2 and "no classifier ships for target" in capsys.readouterr().err


@pytest.mark.parametrize("flags, native", [("fpu avx2 fma", False), ("avx2 avx512f avx512_bf16", True),
                                           ("avx2 amx_bf16 amx_tile", True), (None, False)])
def test_auto_dtype_is_bf16_only_with_native_bf16(tmp_path, monkeypatch, flags, native):
    import torch

    from pad import machine

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpuinfo = tmp_path / "cpuinfo"
    if flags is not None:
        cpuinfo.write_text(f"processor\t: 0\nmodel name\t: test cpu\nflags\t\t: {flags}\n")
    assert machine.native_bf16(cpuinfo) is native
    monkeypatch.setattr(machine, "native_bf16", lambda: native)
    assert machine.default_dtype() == ("bfloat16" if native else "float32")


def test_dtype_auto_is_resolved_before_loading(folders, monkeypatch):
    from pad import machine
    from pad.models import registry

    real_load, seen = registry.load, []
    monkeypatch.setattr(registry, "load", lambda name, dtype, source=None: seen.append(dtype) or real_load(name, dtype=dtype))
    for native, want in ((False, "float32"), (True, "bfloat16")):
        monkeypatch.setattr(machine, "native_bf16", lambda native=native: native)
        seen.clear()
        assert main(["generate", "--target", str(folders / "target"), "--draft", str(folders / "draft"),
                     "--prompt", "w1 w2", "--max-new-tokens", "4", "-k", "2"]) == 0
        assert seen == [want, want]


def test_bench_table_from_its_run_log_loads_no_weights(folders, tmp_path, monkeypatch, capsys):
    from pad.models import registry

    args = ["bench", "--task", "gsm8k", "--data", SAMPLE, "--limit", "2", "--policies", "target,exact", "-k", "2",
            "--max-new-tokens", "6", "--target", str(folders / "target"), "--draft", str(folders / "draft"),
            "--dtype", "float32", "--out", str(tmp_path)]
    assert main(args) == 0
    first = capsys.readouterr().out
    monkeypatch.setattr(registry, "load", lambda *a, **k: pytest.fail("weights loaded for logged runs"))
    assert main(args) == 0
    table = lambda out: out[out.index("| policy"):out.index("wrote")]  # noqa: E731
    assert table(capsys.readouterr().out) == table(first)
    # One more problem: now the models are needed.
    with pytest.raises(pytest.fail.Exception, match="weights loaded"):
        main([a if a != "2" else "3" for a in args])


def test_label_folder_of_another_prompt_or_utility_is_refused(folders, tmp_path, monkeypatch, capsys):
    from pad.evaluation import tasks

    argv = ["label", "--method", "rollout", "--task", "gsm8k", "--data", SAMPLE, "--limit", "1", "--max-new-tokens", "4",
            "--max-rollout-tokens", "4", "--target", str(folders / "target"), "--draft", str(folders / "draft"),
            "--dtype", "float32", "--out", str(tmp_path / "labels")]
    assert main(argv) == 2  # the default --layer -8 on a 2-layer model
    assert "layer -8 does not exist: the model has 2 decoder layers" in capsys.readouterr().err
    argv += ["--layer", "-1"]
    assert main(argv) == 0
    assert main(argv) == 0  # same prompt: resumes (nothing left to do)
    capsys.readouterr()
    with monkeypatch.context() as m:
        m.setattr(tasks, "GSM8K_SYSTEM", tasks.GSM8K_SYSTEM + " Be brief.")
        assert main(argv) == 2
        assert "labeled with other settings" in capsys.readouterr().err
    monkeypatch.setitem(tasks.UTILITY_VERSION, "gsm8k", tasks.UTILITY_VERSION["gsm8k"] + 1)
    assert main(argv) == 2
    assert "labeled with other settings" in capsys.readouterr().err


def test_rollout_options_with_the_search_method_are_refused(folders, tmp_path, capsys):
    models = ["--target", str(folders / "target"), "--draft", str(folders / "draft"), "--dtype", "float32"]
    assert main(["label", "--task", "gsm8k", "--data", SAMPLE, "--only-draft-wrong", "--out", str(tmp_path), *models]) == 2
    assert "belong to --method rollout (the default is search)" in capsys.readouterr().err


def test_distribution_and_command_are_named_pad_decoding():
    """``pad`` on the package index is an unrelated editor with a ``pad`` command: ours is pad-decoding."""
    import importlib.metadata
    import subprocess
    import sys

    dist = importlib.metadata.distribution("pad-decoding")
    scripts = {e.name: e.value for e in dist.entry_points if e.group == "console_scripts"}
    assert scripts == {"pad-decoding": "pad.cli:main"}
    out = subprocess.run([sys.executable, "-m", "pad", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("usage: pad-decoding")


def test_label_by_search_writes_a_folder_train_reads_with_either_criterion(folders, tmp_path, capsys, monkeypatch):
    """pad-decoding label --method search writes a folder that train reads, with both criteria."""
    from safetensors.torch import load_file
    from torch import nn

    from pad.decoding.onednn import OneDNNLinear
    from pad.pivots import search, train

    out = tmp_path / "search"
    argv = ["label", "--method", "search", "--task", "gsm8k", "--data", SAMPLE, "--limit", "4", "--max-new-tokens",
            "40", "--target", str(folders / "target"), "--draft", str(folders / "draft"), "--dtype", "float32",
            "--layer", "-1", "--batch", "3", "--out", str(out)]
    run, models = search.run, []
    monkeypatch.setattr(search, "run", lambda *a, **k: models.extend(a[3:5]) or run(*a, **k))
    assert main(argv) == 0
    # In fp32 on the CPU both models ran on oneDNN's linear layers.
    assert len(models) == 2 and all(any(type(m) is OneDNNLinear for m in model.modules())
                                    and not any(type(m) is nn.Linear for m in model.modules()) for model in models)
    assert "labeled 4 problems" in capsys.readouterr().out
    meta = json.loads((out / "meta.json").read_text())
    assert meta["method"] == "search" and meta["weights"]["target"].startswith("folder:") and "batch" not in meta
    index = [json.loads(line) for line in (out / "index-0of1.jsonl").read_text().splitlines()]
    assert len(index) == 4 and sum(r["records"] for r in index) > 0
    shard = load_file(str(out / next(r["file"] for r in index if r["file"])))
    assert {"hidden", "token_prob", "entropy", "same_answer", "correct_before", "correct_after"} <= shard.keys()
    # Another batch size resumes the same folder (it changes no record).
    assert main([*argv[:-4], "--batch", "2", "--out", str(out)]) == 0
    assert "(4 already done, 0 done in --skip-labeled folders)" in capsys.readouterr().out
    # A folder of other settings (say another dtype) leaves out what this one finished.
    assert main([*argv[:-2], "--out", str(tmp_path / "other"), "--skip-labeled", str(out)]) == 0
    assert "labeled 0 problems (0 already done, 4 done in --skip-labeled folders)" in capsys.readouterr().out
    same, _ = train.load_shards([out], criterion="same-answer")
    right, _ = train.load_shards([out], criterion="correct")
    assert len(same["label"]) == len(right["label"]) == sum(r["records"] for r in index)
    assert (right["label"] <= same["label"]).all()  # a right answer turned wrong always changed the answer


def test_label_by_search_on_lookup_proposals_records_their_source(folders, tmp_path, capsys, monkeypatch):
    import pad.cli
    from pad.pivots import search, train

    asked = []  # lookup proposals need no draft model: the label command does not load it
    real_load_pair = pad.cli._load_pair
    monkeypatch.setattr(pad.cli, "_load_pair", lambda a, need_draft=True: asked.append(need_draft)
                        or real_load_pair(a, need_draft))
    out = tmp_path / "lookup"
    argv = ["label", "--method", "search", "--drafter", "lookup", "--proposal-tokens", "6", "--task", "gsm8k",
            "--data", SAMPLE, "--limit", "3", "--max-new-tokens", "40", "--target", str(folders / "target"),
            "--draft", str(folders / "draft"), "--dtype", "float32", "--layer", "-1", "--batch", "3", "--out", str(out)]
    assert main(argv) == 0
    assert asked == [False]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["drafter"] == "lookup" and meta["proposal_tokens"] == 6
    data, _ = train.load_shards([out])
    assert len(data["label"]) > 0
    assert (data["source"] == search.SOURCE_IDS["lookup"]).all() and (data["offset"] >= 0).all()
    assert (data["offset"] < 6).all() and (data["match"] >= 1).all()
    capsys.readouterr()
    # Rollouts label the draft model's tokens only; another drafter in the same folder is refused.
    rollout = [a if a != "search" else "rollout" for a in argv[:-1]] + [str(tmp_path / "r")]
    assert main(rollout) == 2
    assert "--drafter lookup|suffix labels with --method search" in capsys.readouterr().err
    assert main([a if a != "lookup" else "suffix" for a in argv]) == 2
    assert "labeled with other settings" in capsys.readouterr().err


def test_bench_start_skips_the_problems_before_it(folders, tmp_path, capsys):
    args = ["bench", "--task", "gsm8k", "--data", SAMPLE, "--policies", "target", "--max-new-tokens", "4",
            "--target", str(folders / "target"), "--draft", str(folders / "draft"), "--dtype", "float32",
            "--out", str(tmp_path)]
    assert main(args + ["--start", "1", "--limit", "3"]) == 0
    runs = [json.loads(line) for line in (tmp_path / "gsm8k_dev_k8_float32.runs.jsonl").read_text().splitlines()]
    assert [r["problem"] for r in runs] == ["gsm8k/dev/1", "gsm8k/dev/2"]
    assert "gsm8k, 2 problems" in (tmp_path / "gsm8k_dev_1-2_k8_float32.md").read_text()
    capsys.readouterr()
    for start, limit in (("3", "3"), ("-1", "2")):
        assert main(args + ["--start", start, "--limit", limit]) == 2
        assert "--start must be at least 0 and below --limit" in capsys.readouterr().err


def test_terminated_label_job_saves_its_texts_and_the_same_command_resumes(folders, tmp_path, monkeypatch, capsys):
    """SIGTERM, how job launchers stop work, leaves the way Ctrl-C does: the greedy texts being decoded are
    saved, the exit code is 130, and the same command finishes with the records of an uninterrupted run."""
    from safetensors.torch import load_file

    from pad.pivots import search

    argv = ["label", "--method", "search", "--task", "gsm8k", "--data", SAMPLE, "--limit", "4", "--max-new-tokens",
            "40", "--target", str(folders / "target"), "--draft", str(folders / "draft"), "--dtype", "float32",
            "--layer", "-1", "--batch", "3", "--out"]
    assert main([*argv, str(tmp_path / "clean")]) == 0
    monkeypatch.setattr(search, "GREEDY_SAVE_SECONDS", float("inf"))  # nothing saved but on the way out
    real_step, steps = search.Continuations.step, {"n": 0}

    def terminated_step(self):  # a join, then 2 steps: the first greedy texts are half decoded
        steps["n"] += 1
        if steps["n"] == 4:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_step(self)

    monkeypatch.setattr(search.Continuations, "step", terminated_step)
    before = signal.getsignal(signal.SIGTERM)
    out = tmp_path / "terminated"
    capsys.readouterr()
    assert main([*argv, str(out)]) == 130
    assert "interrupted; the same command goes on" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is put back
    index = out / "index-0of1.jsonl"
    assert steps["n"] == 4 and not (index.exists() and index.read_text())  # stopped before a problem finished
    saved = [load_file(str(f)) for f in (out / "partial").glob("*.safetensors")]
    assert len(saved) == 3 and all(int(t["pos"]) == -1 and 0 < len(t["text"]) < 40 for t in saved)
    monkeypatch.setattr(search.Continuations, "step", real_step)
    assert main([*argv, str(out)]) == 0
    assert not list((out / "partial").glob("*"))

    assert_same_labels(tmp_path / "clean", out)


def test_sampled_bench_logs_apart_and_names_its_seed(folders, tmp_path, capsys):
    args = ["bench", "--task", "gsm8k", "--data", SAMPLE, "--limit", "2", "--policies", "target,exact", "-k", "2",
            "--max-new-tokens", "6", "--target", str(folders / "target"), "--draft", str(folders / "draft"),
            "--dtype", "float32", "--out", str(tmp_path), "--temperature", "0.7", "--seed", "1"]
    assert main(args) == 0
    runs = [json.loads(line) for line in (tmp_path / "gsm8k_dev_k2_float32_t0.7.runs.jsonl").read_text().splitlines()]
    assert len(runs) == 4 and {(r["settings"]["temperature"], r["settings"]["seed"]) for r in runs} == {(0.7, 1)}
    assert "temperature 0.7, top-p 1, seed 1" in (tmp_path / "gsm8k_dev_2_k2_float32_t0.7_s1.md").read_text()
    capsys.readouterr()
    for bad in (["--temperature", "-1"], ["--top-p", "0"]):
        assert main(args[:-4] + bad) == 2
        assert "--temperature must be at least 0" in capsys.readouterr().err
    assert main(args[:-4] + ["--policies", "target,fly", "--temperature", "0.7"]) == 2
    assert "in --policies with --temperature" in capsys.readouterr().err


def test_retrace_cli_adds_the_divergence_to_an_old_search_folder(folders, tmp_path, capsys):
    import torch
    from safetensors.torch import load_file, save_file

    out = tmp_path / "labels"
    models = ["--target", str(folders / "target"), "--draft", str(folders / "draft"), "--dtype", "float32"]
    assert main(["label", "--method", "search", "--task", "gsm8k", "--data", SAMPLE, "--limit", "4",
                 "--max-new-tokens", "30", *models, "--layer", "-1", "--batch", "3", "--out", str(out)]) == 0
    stored = {}
    for f in sorted((out / "problems").glob("*.safetensors")):  # as a folder labeled before the divergence
        t = load_file(str(f))
        stored[f.name] = t.pop("divergence")
        save_file(t, str(f))
    assert stored and sum(len(v) for v in stored.values()) >= 3
    capsys.readouterr()
    assert main(["retrace", str(out), "--data", SAMPLE, *models, "--batch", "2"]) == 0
    decisions = sum(len(v) for v in stored.values())
    assert f"{decisions} of {decisions} decisions matched" in capsys.readouterr().out
    for name, want in stored.items():
        torch.testing.assert_close(load_file(str(out / "retrace" / name))["divergence"].float(), want.float(),
                                   atol=2e-3, rtol=2e-3)
