"""Train the pivot classifier on labeled shards (``pad label``) and report how well it separates pivots.

Held-out split by problem (never by position: positions of one problem are alike), inputs standardized
with training statistics, class-balanced cross-entropy, AdamW, the checkpoint with the lowest held-out
loss kept. The report (AUROC; at each sigma the pivot precision and recall and the share of non-pivots
accepted) is saved beside the weights as ``report.json`` and ``report.md``. With few labeled problems one
held-out split says little, so the report can add a cross-validated AUROC (``cross_validate``): every
problem is scored once by a classifier trained, the same way, without it.
"""
from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .classifier import PivotClassifier

SIGMAS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


@dataclass
class TrainConfig:
    epochs: int = 60
    batch_size: int = 256
    lr: float = 1e-3
    weight_decay: float = 1e-2
    heldout: float = 0.15  # share of problems held out
    patience: int = 15  # epochs without a better held-out loss before stopping
    seed: int = 0


def load_shards(dirs, criterion: str = "same-answer") -> tuple[dict, dict]:
    """All labeled positions of the given ``pad label`` folders -> (tensors, meta of the first folder).

    A problem labeled in more than one folder is taken from the first, so no position counts twice.
    Folders of the search method keep both outcomes of each decision; ``criterion`` picks the label
    (``pad.search.pivot_labels``).
    """
    from .search import pivot_labels

    from safetensors.torch import load_file

    parts, metas, seen, read = [], [], set(), set()
    for d in map(Path, dirs):
        if not (d / "meta.json").is_file():
            raise FileNotFoundError(f"{d} is not a pad label folder (meta.json is missing)")
        metas.append(json.loads((d / "meta.json").read_text()))
        for index in sorted(d.glob("index-*.jsonl")):
            for line in index.read_text().splitlines():
                if not line.strip():
                    continue
                rec = json.loads(line)
                read.add(rec["problem"])
                if rec["file"] and rec["problem"] not in seen:
                    seen.add(rec["problem"])
                    t = load_file(str(d / rec["file"]))
                    if "same_answer" in t:
                        t["label"] = pivot_labels(t, criterion)
                    t["problem"] = torch.full_like(t["label"], 0, dtype=torch.int64) + zlib.crc32(rec["problem"].encode())
                    parts.append(t)
    keys = ("target", "draft", "weights", "layer")
    for m in metas[1:]:
        if any(m.get(k) != metas[0].get(k) for k in keys):
            raise ValueError(f"label folders disagree on {keys}: {metas[0]} vs {m}")
    if not parts:
        raise ValueError(f"no labeled positions in {', '.join(map(str, dirs))}")
    data = {k: torch.cat([p[k] for p in parts]) for k in ("hidden", "token_prob", "entropy", "label", "problem")}
    return data, {**metas[0], "folders": [str(d) for d in dirs], "problems_read": len(read)}


def auroc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve (pivot = positive), ties counted half; NaN with one class only."""
    pos, neg = scores[labels == 1], scores[labels == 0]
    if len(pos) == 0 or len(neg) == 0:
        return math.nan
    greater = (pos[:, None] > neg[None, :]).double().sum() + 0.5 * (pos[:, None] == neg[None, :]).double().sum()
    return float(greater / (len(pos) * len(neg)))


def sigma_table(pivot_prob: torch.Tensor, labels: torch.Tensor) -> list[dict]:
    """Per sigma: a token is rejected (called a pivot) when pivot_prob > sigma."""
    rows = []
    for sigma in SIGMAS:
        called = pivot_prob > sigma
        tp = int((called & (labels == 1)).sum())
        rows.append({
            "sigma": sigma,
            "pivot_precision": tp / int(called.sum()) if called.any() else math.nan,
            "pivot_recall": tp / int((labels == 1).sum()) if (labels == 1).any() else math.nan,
            "non_pivots_accepted": float((~called & (labels == 0)).sum() / max(1, int((labels == 0).sum()))),
        })
    return rows


def _inputs(data: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Labeled positions -> the classifier's inputs: hidden [N, H] and (p_target(token), entropy) [N, 2], fp32."""
    return data["hidden"].float(), torch.stack([data["token_prob"].float(), data["entropy"].float()], -1)


def train(data: dict, meta: dict, cfg: TrainConfig = TrainConfig(), progress: bool = True):
    """-> (best PivotClassifier, report dict)."""
    from tqdm.auto import tqdm

    torch.manual_seed(cfg.seed)
    hidden, features = _inputs(data)
    labels = data["label"].long()
    problems = data["problem"].unique()
    g = torch.Generator().manual_seed(cfg.seed)
    held = problems[torch.randperm(len(problems), generator=g)[: max(1, round(cfg.heldout * len(problems)))]]
    is_held = torch.isin(data["problem"], held)
    tr, ho = ~is_held, is_held
    if labels[tr].unique().numel() < 2:
        raise ValueError("the training split needs both pivots and non-pivots")

    clf = PivotClassifier(hidden.shape[1], layer=meta.get("layer", -8), target_model=meta.get("target"),
                          draft_model=meta.get("draft"), weights=meta.get("weights"))
    x = torch.cat([hidden, features], -1)
    with torch.no_grad():
        clf.input_mean.copy_(x[tr].mean(0))
        clf.input_scale.copy_(x[tr].std(0).clamp_min(1e-4))
    counts = torch.bincount(labels[tr], minlength=2).float()
    loss_fn = nn.CrossEntropyLoss(weight=counts.sum() / (2 * counts))  # class-balanced
    opt = torch.optim.AdamW(clf.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    idx = tr.nonzero().flatten()
    best, best_loss, best_epoch, stale, history = None, math.inf, 0, 0, []
    bar = tqdm(range(cfg.epochs), desc="train", unit="epoch", disable=not progress)
    for epoch in bar:
        clf.train()
        for batch in idx[torch.randperm(len(idx), generator=g)].split(cfg.batch_size):
            opt.zero_grad()
            loss = loss_fn(clf(hidden[batch], features[batch]), labels[batch])
            loss.backward()
            opt.step()
        clf.eval()
        with torch.no_grad():
            held_loss = float(loss_fn(clf(hidden[ho], features[ho]), labels[ho])) if ho.any() else float(loss)
        history.append(held_loss)
        bar.set_postfix(heldout_loss=f"{held_loss:.4f}")
        if held_loss < best_loss - 1e-6:
            best_loss, best_epoch, stale = held_loss, epoch + 1, 0
            best = {k: v.clone() for k, v in clf.state_dict().items()}
        else:
            stale += 1
            if stale >= cfg.patience:
                break
    clf.load_state_dict(best)
    clf.eval()
    with torch.no_grad():
        prob = clf.pivot_prob(hidden[ho], features[ho])
    report = {
        "positions": {"train": int(tr.sum()), "heldout": int(ho.sum())},
        "problems": {"train": int(len(problems) - len(held)), "heldout": int(len(held))},
        "pivots": {"train": int(labels[tr].sum()), "heldout": int(labels[ho].sum())},
        "best_heldout_loss": best_loss,
        "best_epoch": best_epoch,
        "epochs_run": len(history),
        "heldout_auroc": auroc(prob, labels[ho]),
        "sigmas": sigma_table(prob, labels[ho]),
        "config": cfg.__dict__,
        "label_meta": meta,
    }
    return clf, report


def cross_validate(data: dict, meta: dict, cfg: TrainConfig = TrainConfig(), folds: int = 5,
                   progress: bool = True) -> dict:
    """Grouped k-fold estimate: problems split into ``folds`` groups; each group's positions are scored by
    ``train`` run on the other groups (with its own held-out split for early stopping), and AUROC and the
    sigma table are computed over all these out-of-fold scores together."""
    from tqdm.auto import tqdm

    problems = data["problem"].unique()
    if not 2 <= folds <= len(problems):
        raise ValueError(f"cross-validation needs 2 <= folds <= problems with labels ({len(problems)}), got {folds}")
    g = torch.Generator().manual_seed(cfg.seed + 1)
    groups = problems[torch.randperm(len(problems), generator=g)].tensor_split(folds)
    prob = torch.full(data["label"].shape, math.nan)
    for group in tqdm(groups, desc="cross-validate", unit="fold", disable=not progress):
        test = torch.isin(data["problem"], group)
        try:
            clf, _ = train({k: v[~test] for k, v in data.items()}, meta, cfg, progress=False)
        except ValueError as e:
            raise ValueError(f"a cross-validation fold cannot be trained ({e}); use fewer folds") from e
        with torch.no_grad():
            prob[test] = clf.pivot_prob(*_inputs({k: v[test] for k, v in data.items()}))
    labels = data["label"].long()
    # What the classifier must beat: each feature alone, as a score over the same positions.
    baselines = {"1 - p_target(token)": auroc(1 - data["token_prob"].float(), labels),
                 "entropy": auroc(data["entropy"].float(), labels)}
    return {"folds": folds, "positions": len(labels), "pivots": int(labels.sum()),
            "auroc": auroc(prob, labels), "sigmas": sigma_table(prob, labels), "baselines": baselines}


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def report_markdown(report: dict) -> str:
    fmt = lambda v: "n/a" if isinstance(v, float) and math.isnan(v) else f"{v:.3f}"  # noqa: E731
    meta = report.get("label_meta", {})
    lines = [
        f"Label folders {', '.join(meta.get('folders', []))}: {meta.get('problems_read', 'n/a')} problems read, "
        f"{report['problems']['train'] + report['problems']['heldout']} with labeled positions.",
        "",
        f"Trained on {report['positions']['train']} labeled positions from {_count(report['problems']['train'], 'problem')} "
        f"({report['pivots']['train']} pivots); held out {report['positions']['heldout']} positions from "
        f"{_count(report['problems']['heldout'], 'problem')} ({report['pivots']['heldout']} pivots).",
        "",
        f"Held-out AUROC {fmt(report['heldout_auroc'])}; best held-out loss {report['best_heldout_loss']:.4f} "
        f"at epoch {report['best_epoch']} of {report['epochs_run']} run.",
        "",
        *_sigma_lines(report["sigmas"], fmt),
    ]
    cv = report.get("cross_validation")
    if cv:
        lines += [
            "",
            f"Cross-validated over {cv['folds']} folds of problems (each problem scored by a classifier trained "
            f"without it): AUROC {fmt(cv['auroc'])} on {cv['positions']} positions ({cv['pivots']} pivots). "
            "A single feature as the score, over the same positions: "
            + ", ".join(f"{name} AUROC {fmt(v)}" for name, v in cv["baselines"].items()) + ".",
            "",
            *_sigma_lines(cv["sigmas"], fmt),
        ]
    return "\n".join(lines) + "\n"


def _sigma_lines(rows: list[dict], fmt) -> list[str]:
    return ["| sigma | pivot precision | pivot recall | non-pivots accepted |", "|---|---|---|---|"] + [
        f"| {r['sigma']} | {fmt(r['pivot_precision'])} | {fmt(r['pivot_recall'])} | {fmt(r['non_pivots_accepted'])} |"
        for r in rows]


def _nan_to_none(value):
    """NaN (an undefined precision or AUROC) -> None, so that report.json is strict JSON (null)."""
    if isinstance(value, dict):
        return {k: _nan_to_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_nan_to_none(v) for v in value]
    return None if isinstance(value, float) and math.isnan(value) else value


def save(clf: PivotClassifier, report: dict, out_dir, command: str | None = None) -> Path:
    out = clf.save(out_dir)
    (out / "report.json").write_text(json.dumps(_nan_to_none(report), indent=2, allow_nan=False) + "\n")
    text = report_markdown(report)
    if command:
        text = f"Command: `{command}`\n\n" + text
    (out / "report.md").write_text(text)
    return out
