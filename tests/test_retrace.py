"""Retracing a search label folder's walks (pad.pivots.retrace) on tiny models: it finds every stored decision
and recomputes what the labeler stores (now with the divergence), resumes, stops a walk that leaves the stored
one, and orders ties within rounding as the stored walk saw them."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from pad.cli import main
from pad.evaluation.tasks import Problem
from pad.pivots import retrace, search, train
from label_folders import read_labels
from tiny import tiny_pair

CFG = search.SearchConfig(layer=-1, max_new_tokens=14, batch=4)
FEATURES = ("divergence", "token_prob", "entropy")


def _outcome(tokens):
    """Stub task: the 'answer' is the sum of the last four tokens mod 3."""
    key = sum(tokens[-4:]) % 3
    return key, key != 0


@pytest.fixture(scope="module")
def labeled(tmp_path_factory):
    """A search folder of 6 problems on tiny models, as the labeler writes it now (with the divergence)."""
    target, draft = tiny_pair("llama", scale=0.5)
    g = torch.Generator().manual_seed(3)
    problems = [Problem(f"p{i}", "q", "0") for i in range(6)]
    prompts = [torch.randint(0, 96, (1, 3 + i % 3), generator=g) for i in range(6)]
    folder = tmp_path_factory.mktemp("labels")
    search.run(problems, prompts, [_outcome] * 6, target, draft, folder, CFG, meta={"method": "search"},
               progress=False)
    return target, draft, folder, {p.id: q[0].tolist() for p, q in zip(problems, prompts)}


def _old_folder(src, dst):
    """A copy of a label folder whose problem files lack the divergence, as folders labeled before it was stored."""
    (dst / "problems").mkdir(parents=True)
    for name in ("meta.json", "index-0of1.jsonl"):
        (dst / name).write_text((src / name).read_text())
    for f in (src / "problems").glob("*.safetensors"):
        t = load_file(str(f))
        stored = t.pop("divergence")
        assert torch.isfinite(stored.float()).all()
        save_file(t, str(dst / "problems" / f.name), metadata={"problem": "x"})
    return dst


def test_retrace_recomputes_what_the_labeler_stored(labeled, tmp_path):
    target, draft, folder, prompts = labeled
    old = _old_folder(folder, tmp_path / "old")
    summary = retrace.run(old, prompts, target, draft, CFG.max_new_tokens, batch=4, progress=False)
    index, labels = read_labels(folder)
    decisions = sum(len(t["position"]) for t in labels.values())
    assert decisions >= 10 and summary == {"problems": len(labels), "decisions": decisions, "matched": decisions}
    lines = [json.loads(x) for x in (old / retrace.FOLDER / "index.jsonl").read_text().splitlines()]
    assert sorted(r["problem"] for r in lines) == sorted(labels) and all(r["lost"] is None for r in lines)
    for r in lines:
        got, want = load_file(str(old / r["file"])), labels[r["problem"]]
        assert got["matched"].tolist() == [1] * len(want["position"])
        for name in FEATURES:  # fp32 models: the two paths differ in summation order only
            torch.testing.assert_close(got[name].float(), want[name].float(), atol=2e-3, rtol=2e-3)
    # The trainer reads it in the folder's order, as if the labeler had stored it.
    data, _ = train.load_shards([old])
    want, _ = train.load_shards([folder])
    assert torch.equal(data["label"], want["label"])
    torch.testing.assert_close(data["divergence"].float(), want["divergence"].float(), atol=2e-3, rtol=2e-3)


def test_an_interrupted_retrace_resumes_without_duplicates(labeled, tmp_path):
    target, draft, folder, prompts = labeled
    old = _old_folder(folder, tmp_path / "old")
    first = retrace.run(old, prompts, target, draft, CFG.max_new_tokens, batch=2, limit=2, progress=False)
    assert first["problems"] == 2 and len(retrace.retraced(old)) == 2
    rest = retrace.run(old, prompts, target, draft, CFG.max_new_tokens, batch=2, progress=False)
    lines = (old / retrace.FOLDER / "index.jsonl").read_text().splitlines()
    assert rest["problems"] == len(read_labels(folder)[1]) - 2 and len(lines) == len(set(lines))
    assert retrace.run(old, prompts, target, draft, CFG.max_new_tokens, progress=False)["problems"] == 0


def test_a_walk_that_leaves_the_stored_one_keeps_what_matched_and_stops(labeled, tmp_path):
    target, draft, folder, prompts = labeled
    old = _old_folder(folder, tmp_path / "old")
    name, t = max(((f.name, load_file(str(f))) for f in (old / "problems").glob("*.safetensors")),
                  key=lambda x: len(x[1]["position"]))
    assert len(t["position"]) >= 3
    t["position"][1] += 1  # the second stored decision now lies one position late: no walk has it there
    save_file(t, str(old / "problems" / name))
    retrace.run(old, prompts, target, draft, CFG.max_new_tokens, progress=False)
    got = load_file(str(old / retrace.FOLDER / name))
    assert got["matched"].tolist() == [1] + [0] * (len(t["position"]) - 1)
    assert torch.isfinite(got["divergence"][:1].float()).all() and torch.isnan(got["divergence"][1:].float()).all()
    line = next(json.loads(x) for x in (old / retrace.FOLDER / "index.jsonl").read_text().splitlines()
                if x and json.loads(x)["file"].endswith(name))
    assert "mismatch" in line["lost"]
    data, _ = train.load_shards([old])  # NaN where a decision has no divergence
    assert int(torch.isnan(data["divergence"].float()).sum()) == len(t["position"]) - 1


def _walk(positions, harmless, stored_prob):
    return retrace.Walk(0, "p", [1], positions, harmless, stored_prob)


def _logits(top: dict, dtype=torch.bfloat16, V=8):
    x = torch.zeros(1, V)
    for token, value in top.items():
        x[0, token] = value
    return x.to(dtype)


def test_a_tie_within_rounding_is_ordered_as_the_stored_walk_saw_it():
    eos = {7}
    # The target's top two (tokens 2 and 5) are tied; its argmax is 2 (lowest index), the draft's 5.
    tied, draft5 = _logits({2: 3.0, 5: 3.0}), _logits({5: 4.0})
    w = _walk([3], [True], [0.3])  # no decision stored at position 0: the walk's target chose 5
    assert retrace._step([w], tied, draft5, eos, 14) == [5] and w.lost is None and w.ties == 1 and w.done == 0
    ulp = 2.0 ** -6  # bf16's spacing at 3: one unit apart is tied too, not only equal logits
    w = _walk([3], [True], [0.3])
    assert retrace._step([w], _logits({2: 3.0 + ulp, 5: 3.0}), draft5, eos, 14) == [5] and w.lost is None
    # Agreement (both 2) where the walk stored a decision: the walk's target chose 5, so the draft's 2 was
    # a mismatch; the stored p_target(2) confirms it, and the harmless draft token goes into the text.
    p2 = float(torch.softmax(tied.float(), -1)[0, 2])
    w = _walk([0], [True], [p2])
    assert retrace._step([w], tied, _logits({2: 4.0}), eos, 14) == [2] and w.done == 1 and w.ties == 1
    assert w.lost is None and abs(w.token_prob[0] - p2) < 1e-6 and w.divergence[0] > 0
    w = _walk([0], [False], [p2])  # the same decision stored as a pivot: the target's token (5) stays
    assert retrace._step([w], tied, _logits({2: 4.0}), eos, 14) == [5] and w.done == 1
    w = _walk([0], [True], [p2 + 0.2])  # a stored p_target that does not fit: not this walk
    retrace._step([w], tied, _logits({2: 4.0}), eos, 14)
    assert w.done == 0 and "no mismatch" in w.lost


def test_no_tie_no_reordering():
    eos = {7}
    clear = _logits({2: 3.0, 5: 2.5})  # half a logit apart: far beyond bf16 rounding at 3
    w = _walk([3], [True], [0.3])
    retrace._step([w], clear, _logits({5: 4.0}), eos, 14)
    assert "a mismatch at 0" in w.lost and w.done == 0
    w = _walk([0], [True], [0.3])
    retrace._step([w], clear, _logits({2: 4.0}), eos, 14)
    assert "no mismatch at 0" in w.lost
    w = _walk([0], [True], [0.3])  # a plain mismatch where one is stored: a decision, its token kept
    assert retrace._step([w], clear, _logits({5: 4.0}), eos, 14) == [5] and w.done == 1 and w.ties == 0
    w = _walk([2], [True], [0.3])  # the text ends (EOS) before a stored decision
    retrace._step([w], _logits({7: 3.0}), _logits({7: 3.0}), eos, 14)
    assert "ended" in w.lost


def test_retrace_cli_refuses_what_it_cannot_retrace(tmp_path, capsys):
    assert main(["retrace", str(tmp_path)]) == 2
    assert "not a pad label folder" in capsys.readouterr().err
    meta = {"task": "gsm8k", "split": "train", "target": "qwen2.5-coder-1.5b-instruct",
            "draft": "qwen2.5-coder-0.5b-instruct", "dtype": "float32", "method": "search"}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    assert main(["retrace", str(tmp_path), "--dtype", "bfloat16"]) == 2
    assert "retrace it with --dtype float32" in capsys.readouterr().err
    (tmp_path / "meta.json").write_text(json.dumps({**meta, "target": "other"}))
    assert main(["retrace", str(tmp_path), "--dtype", "float32"]) == 2
    assert "give them as --target and --draft" in capsys.readouterr().err
    assert main(["retrace", str(tmp_path), "--batch", "0"]) == 2
    assert "--batch must be at least 1" in capsys.readouterr().err


def test_a_rollout_folder_cannot_be_retraced(tmp_path):
    (tmp_path / "meta.json").write_text(json.dumps({"task": "gsm8k", "method": None}))
    with pytest.raises(ValueError, match="only search walks"):
        retrace.stored_walks(tmp_path, {})
