"""Pivot labeling on tiny random models with a stub utility: labels follow the rule, and a job killed
mid-way resumes without losing or duplicating a record."""

import pytest
import torch

from pad.evaluation.tasks import Problem
from pad.pivots import label
from label_folders import read_labels
from tiny import greedy_from_scratch, tiny_pair

CFG = label.LabelConfig(layer=-1, max_new_tokens=14, max_rollout_tokens=6)


def _stub_utility(tokens):
    """Deterministic 'answer is right' from the text: depends on where the continuation went."""
    return sum(tokens[-4:]) % 3 != 0


@pytest.fixture(scope="module")
def setup():
    target, draft = tiny_pair("llama", scale=0.5)
    g = torch.Generator().manual_seed(0)
    problems = [Problem(f"p{i}", "q", "0") for i in range(6)]
    prompts = [torch.randint(0, 96, (1, 4), generator=g) for _ in problems]
    return target, draft, problems, prompts


@pytest.mark.parametrize("rollouts", [0, 2])
def test_labels_follow_the_rollout_rule(setup, tmp_path, rollouts):
    target, draft, problems, prompts = setup
    cfg = label.LabelConfig(layer=-1, max_new_tokens=14, max_rollout_tokens=6, rollouts=rollouts)
    summary = label.run(problems, prompts, [_stub_utility] * 6, target, draft, tmp_path, cfg, progress=False)
    index, tensors = read_labels(tmp_path)
    assert [r["problem"] for r in index] == [p.id for p in problems]
    assert summary["records"] == sum(r["records"] for r in index) > 0
    labels = torch.cat([t["label"] for t in tensors.values()])
    assert 0 < int(labels.sum()) < labels.numel()  # both classes occur
    for t in tensors.values():
        rd, rt = t["rate_draft"].float(), t["rate_target"].float()
        assert (rt > 0).all()
        assert torch.equal(t["label"].bool(), rd < rt * cfg.ratio)
        assert ((t["label"] == 1) | (rd >= cfg.keep)).all()
        if rollouts:
            assert set((rd * rollouts).tolist()) <= set(range(rollouts + 1))
        assert t["hidden"].dtype == torch.float16 and t["hidden"].shape == (t["label"].numel(), 32)
        assert ((t["token_prob"] >= 0) & (t["token_prob"] <= 1)).all()
    # Features against a plain forward over prompt + the target's greedy text (found by a cacheless decode).
    for problem, prompt in zip(problems, prompts):
        if problem.id not in tensors:
            continue
        t = tensors[problem.id]
        with torch.inference_mode():
            seq = prompt[0].tolist() + greedy_from_scratch(target, prompt[0].tolist(), int(t["generated"]))
            logits = [m(torch.tensor([seq])).logits[0, prompt.shape[1] - 1 :, :96].double() for m in (target, draft)]
        pos = t["position"].long()
        d_tok = logits[1][pos].argmax(-1)
        for (prob, ent), lg in (((t["token_prob"], t["entropy"]), logits[0]), ((t["draft_prob"], t["draft_entropy"]), logits[1])):
            ref = torch.softmax(lg[pos], -1)
            torch.testing.assert_close(prob.double(), ref.gather(-1, d_tok[:, None])[:, 0], atol=2e-3, rtol=2e-3)
            torch.testing.assert_close(ent.double(), -(ref * ref.clamp_min(1e-300).log()).sum(-1), atol=5e-3, rtol=2e-3)


def test_interrupted_job_resumes_without_loss_or_duplicates(setup, tmp_path):
    target, draft, problems, prompts = setup
    clean = tmp_path / "clean"
    label.run(problems, prompts, [_stub_utility] * 6, target, draft, clean, CFG, progress=False)
    calls = {"n": 0}

    def dying(tokens):
        calls["n"] += 1
        if calls["n"] == 25:
            raise KeyboardInterrupt  # killed in the middle of a problem
        return _stub_utility(tokens)

    out = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        label.run(problems, prompts, [dying] * 6, target, draft, out, CFG, progress=False)
    partial, _ = read_labels(out)
    assert 0 < len(partial) < len(problems)
    with open(out / "index-0of1.jsonl", "a") as f:
        f.write('{"problem": "p9", "ind')  # and a torn index line, as a kill during the write leaves
    summary = label.run(problems, prompts, [_stub_utility] * 6, target, draft, out, CFG, progress=False)
    assert summary["skipped_done"] == len(partial)
    index, tensors = read_labels(out)
    assert sorted(r["problem"] for r in index) == sorted(p.id for p in problems)  # each exactly once
    _, expected = read_labels(clean)
    assert tensors.keys() == expected.keys()
    for pid in expected:
        for key in expected[pid]:
            assert torch.equal(tensors[pid][key], expected[pid][key]), (pid, key)


def test_start_skips_the_first_problems(setup, tmp_path):
    target, draft, problems, prompts = setup
    label.run(problems, prompts, [_stub_utility] * 6, target, draft, tmp_path / "all", CFG, progress=False)
    label.run(problems, prompts, [_stub_utility] * 6, target, draft, tmp_path / "late", CFG, progress=False, start=4)
    (all_index, all_tensors), (index, tensors) = read_labels(tmp_path / "all"), read_labels(tmp_path / "late")
    assert index == [{**r, "seconds": index[i]["seconds"]} for i, r in enumerate(all_index[4:])]
    for pid, t in tensors.items():
        assert all(torch.equal(t[k], all_tensors[pid][k]) for k in t)
    # Problems finished in another folder are left out too (rollouts share the rule with the search labeler).
    summary = label.run(problems, prompts, [_stub_utility] * 6, target, draft, tmp_path / "rest", CFG,
                        progress=False, start=1, skip={"p0", "p2", "p3"})
    assert (summary["skipped_elsewhere"], summary["problems"]) == (2, 3)
    assert [r["problem"] for r in read_labels(tmp_path / "rest")[0]] == ["p1", "p4", "p5"]


def test_changed_settings_are_refused(setup, tmp_path):
    target, draft, problems, prompts = setup
    label.run(problems[:1], prompts[:1], [_stub_utility], target, draft, tmp_path, CFG, progress=False)
    with pytest.raises(ValueError, match="other settings"):
        label.run(problems[:1], prompts[:1], [_stub_utility], target, draft, tmp_path,
                  label.LabelConfig(layer=-1, max_new_tokens=20, max_rollout_tokens=6), progress=False)


def test_parse_shard():
    assert label.parse_shard("2/4") == (2, 4) and label.parse_shard(None) == (0, 1)
    for bad in ("4/4", "x", "1/0", "-1/2"):
        with pytest.raises(ValueError):
            label.parse_shard(bad)


def test_only_draft_wrong_labels_exactly_the_problems_the_draft_gets_wrong(setup, tmp_path):
    from pad.decoding.hf import eos_ids

    target, draft, problems, prompts = setup
    utility = lambda tokens: sum(tokens[-3:]) % 4 != 0  # noqa: E731
    label.run(problems, prompts, [utility] * 6, target, draft, tmp_path / "all", CFG, progress=False)
    cfg = label.LabelConfig(**{**CFG.__dict__, "only_draft_wrong": True})
    label.run(problems, prompts, [utility] * 6, target, draft, tmp_path / "some", cfg, progress=False)
    (all_index, all_tensors), (index, tensors) = read_labels(tmp_path / "all"), read_labels(tmp_path / "some")
    with torch.inference_mode():
        wrong = [not utility(greedy_from_scratch(draft, p[0].tolist(), CFG.max_new_tokens, eos_ids(target, None)))
                 for p in prompts]
    # The case has power: labeled positions on both sides of the filter.
    assert any(r["records"] for w, r in zip(wrong, all_index) if w)
    assert any(r["records"] for w, r in zip(wrong, all_index) if not w)
    assert [r["problem"] for r in index] == [p.id for p in problems]
    for problem, is_wrong, record, full in zip(problems, wrong, index, all_index):
        assert record["records"] == (full["records"] if is_wrong else 0)
        if is_wrong and full["file"]:
            for k, v in all_tensors[problem.id].items():
                assert torch.equal(tensors[problem.id][k], v), k


def test_label_features_equal_verify_blocks_own_features(setup, tmp_path):
    """At every labeled position, the stored features are what verify_block computes when the target
    verifies that draft token after that prefix (a fresh forward without cache, as in decoding)."""
    from pad.decoding.hf import LayerCapture, eos_ids
    from pad_kernels import verify_block

    target, draft, problems, prompts = setup
    label.run(problems, prompts, [_stub_utility] * 6, target, draft, tmp_path, CFG, progress=False)
    index, tensors = read_labels(tmp_path)
    checked = 0
    with torch.inference_mode():
        for problem, prompt in zip(problems, prompts):
            if problem.id not in tensors:
                continue
            t = tensors[problem.id]
            new = greedy_from_scratch(target, prompt[0].tolist(), CFG.max_new_tokens, eos_ids(target, None))
            for i, pos in enumerate(t["position"].tolist()):
                prefix = prompt[0].tolist() + new[:pos]
                d = int(draft(torch.tensor([prefix])).logits[0, -1].argmax())
                assert d != new[pos]  # a labeled position is a mismatch
                capture = LayerCapture(target, CFG.layer)
                capture.keep = 2
                logits = target(torch.tensor([prefix + [d]])).logits[:, -2:]
                capture.remove()
                res = verify_block(logits, torch.tensor([[d]]), backend="torch")
                torch.testing.assert_close(t["hidden"][i].float(), capture.value[0, 0].half().float())
                torch.testing.assert_close(t["token_prob"][i].float(), res.token_prob[0, 0].half().float())
                torch.testing.assert_close(t["entropy"][i].float(), res.entropy[0, 0].half().float())
                q = torch.softmax(draft(torch.tensor([prefix])).logits[0, -1].float(), -1)
                torch.testing.assert_close(t["draft_prob"][i].float(), q[d].half().float())
                # the divergence KL(p_target || p_draft), in fp64 from the two plain forwards
                log_p = torch.log_softmax(logits[0, 0].double(), -1)
                log_q = torch.log_softmax(draft(torch.tensor([prefix])).logits[0, -1].double(), -1)
                kl = (log_p.exp() * (log_p - log_q)).sum()
                torch.testing.assert_close(t["divergence"][i].double(), kl, atol=2e-3, rtol=2e-3)
                checked += 1
    assert checked >= 5


def test_label_folder_of_other_weights_is_refused(setup, tmp_path):
    target, draft, problems, prompts = setup
    weights = {"target": "hub:org/t@1", "draft": "hub:org/d@1"}
    label.run(problems[:1], prompts[:1], [_stub_utility], target, draft, tmp_path, CFG, progress=False,
              meta={"weights": weights})
    with pytest.raises(ValueError, match=r"label folder .* other draft weights \(hub:org/d@1\)"):
        label.run(problems[:2], prompts[:2], [_stub_utility] * 2, target, draft, tmp_path, CFG, progress=False,
                  meta={"weights": {**weights, "draft": "gguf-q4_k_m-bf16:sha256:00"}})


def test_batched_greedy_decodes_write_the_same_records(setup, tmp_path):
    target, draft, problems, prompts = setup
    cfg = label.LabelConfig(**{**CFG.__dict__, "only_draft_wrong": False})
    for b in (1, 4):
        label.run(problems, prompts, [_stub_utility] * 6, target, draft, tmp_path / f"b{b}", cfg, progress=False,
                  decode_batch=b)
    (i1, t1), (i4, t4) = read_labels(tmp_path / "b1"), read_labels(tmp_path / "b4")
    assert [{**r, "seconds": 0} for r in i1] == [{**r, "seconds": 0} for r in i4]
    assert t1.keys() == t4.keys() and sum(r["records"] for r in i1) > 0
    for pid in t1:
        for k in t1[pid]:
            assert torch.equal(t1[pid][k], t4[pid][k]), (pid, k)
