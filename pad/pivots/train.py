"""Train the pivot classifier on labeled shards (``pad label``) and report how well it separates pivots.

Held-out split by problem (never by position: positions of one problem are alike), inputs standardized
with training statistics, class-balanced losses. Two kinds (``TrainConfig.model``): ``mlp`` (AdamW, the
checkpoint with the lowest held-out loss kept) and ``linear`` (logistic regression whose L2 strength is
chosen by cross-validation over the training problems, then fit on all of them by L-BFGS); ``auto`` keeps
the kind with the higher cross-validated AUROC (``select_and_train``). The report (AUROC; at each sigma the
pivot precision and recall and the share of non-pivots accepted) is saved beside the weights as
``report.json`` and ``report.md``. One held-out split says little, so the report adds a cross-validated
AUROC (``cross_validate``): every problem is scored once by a classifier trained, the same way, without
it, with a 95% bootstrap interval over problems, each single feature's AUROC over the same positions and
the interval of the difference to the best of them.
"""
from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from pad_kernels import FEATURE_NAMES

from ..models.classifier import PivotClassifier
from .replay import KS as REPLAY_KS, SIGMAS as REPLAY_SIGMAS, TAUS as REPLAY_TAUS, replay_table, tokens_per_forward

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
    model: str = "mlp"  # mlp | linear (auto: see select_and_train)
    l2_grid: tuple = (1e-4, 1e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0)  # linear: L2 strengths tried
    inner_folds: int = 3  # linear: folds of the training problems that choose the L2 strength
    bootstrap: int = 2000  # resamples of problems for the report's intervals
    features: tuple = ()  # candidate features read after the op's (classifier.CANDIDATE_FEATURES)


MODELS = ("mlp", "linear", "auto")
OUTCOMES = ("same_answer", "correct_before", "correct_after")  # kept from search folders, for replay
WALKS = ("position", "text_length")  # a position's index in its generated text (for search: the walk's final one)


def load_shards(dirs, criterion: str = "same-answer", only=None) -> tuple[dict, dict]:
    """All labeled positions of the given ``pad label`` folders -> (tensors, meta of the first folder, with
    ``problems_read`` and the sorted ``problem_ids`` read, so a classifier's report says exactly which
    problems it saw while its folders go on growing).

    Tensors are [N] (``hidden`` [N, H]), the positions of a problem contiguous and in the folder's order
    (for search folders, walk order); when every folder is a search folder, both outcomes of each
    decision are kept too (``OUTCOMES``); ``WALKS`` says where each position sits in its generated text.
    ``divergence`` comes from the files, or for folders labeled before it was stored from their retrace
    (``pad.pivots.retrace``), with NaN where a decision has none.

    A problem labeled in more than one folder is taken from the first, so no position counts twice; folders
    of different drafters (meta ``drafter``, ``pad.pivots.search``) judge different proposals and are all read.
    Folders of the search method keep both outcomes of each decision; ``criterion`` picks the label
    (``pad.pivots.search.pivot_labels``). ``only`` (problem ids, for example a report's ``problem_ids``)
    reads those problems alone.
    """
    from .retrace import FOLDER, retraced
    from .search import PROPOSAL_DEFAULTS, SOURCE_IDS, pivot_labels

    from safetensors.torch import load_file

    only = None if only is None else set(only)
    parts, metas, seen, read = [], [], set(), set()
    for d in map(Path, dirs):
        if not (d / "meta.json").is_file():
            raise FileNotFoundError(f"{d} is not a pad label folder (meta.json is missing)")
        metas.append(json.loads((d / "meta.json").read_text()))
        retraced_here, drafter = retraced(d), folder_drafter(metas[-1])
        for index in sorted(d.glob("index-*.jsonl")):
            for line in index.read_text().splitlines():
                if not line.strip():
                    continue
                rec = json.loads(line)
                if only is not None and rec["problem"] not in only:
                    continue
                read.add(rec["problem"])
                if rec["file"] and (drafter, rec["problem"]) not in seen:
                    seen.add((drafter, rec["problem"]))
                    t = load_file(str(d / rec["file"]))
                    if "divergence" not in t and rec["problem"] in retraced_here:
                        t["divergence"] = load_file(str(d / FOLDER / Path(rec["file"]).name))["divergence"]
                    if "same_answer" in t:
                        t["label"] = pivot_labels(t, criterion)
                    if "position" in t and "generated" in t:  # for replay.tokens_per_forward
                        t["text_length"] = t["generated"].expand(len(t["label"])).clone()
                    # problem: one walk (a problem's decisions under one drafter, contiguous: the replay walks
                    # it); group: the problem, whichever drafter (splits and folds keep a problem's walks together)
                    walk = rec["problem"] if drafter == "model" else f"{drafter}/{rec['problem']}"
                    t["problem"] = torch.full_like(t["label"], 0, dtype=torch.int64) + zlib.crc32(walk.encode())
                    t["group"] = torch.full_like(t["label"], 0, dtype=torch.int64) + zlib.crc32(rec["problem"].encode())
                    parts.append(t)
    keys = ("target", "draft", "weights", "layer")
    for m in metas[1:]:
        if any(m.get(k) != metas[0].get(k) for k in keys):
            raise ValueError(f"label folders disagree on {keys}: {metas[0]} vs {m}")
    if not parts:
        raise ValueError(f"no labeled positions in {', '.join(map(str, dirs))}")
    keys = ["hidden", "token_prob", "entropy", "label", "problem", "group"]
    keys += [k for k in ("draft_prob", "draft_entropy", *OUTCOMES, *WALKS) if all(k in p for p in parts)]
    data = {k: torch.cat([p[k] for p in parts]) for k in keys}
    # Where each decision's proposal came from: folders from before draft-free drafters hold the model's only.
    for name, default in PROPOSAL_DEFAULTS.items():
        data[name] = torch.cat([p[name].to(torch.int32) if name in p else torch.full(p["label"].shape, default,
                                                                                      dtype=torch.int32)
                                for p in parts])
    data["from_lookup"] = (data["source"] == SOURCE_IDS["lookup"]).float()  # the source as candidate features
    data["from_suffix"] = (data["source"] == SOURCE_IDS["suffix"]).float()
    if any("divergence" in p for p in parts):  # NaN where a decision has none (not retraced, or lost)
        data["divergence"] = torch.cat([p.get("divergence", torch.full(p["label"].shape, math.nan, dtype=torch.float16))
                                        for p in parts])
    return data, {**metas[0], "folders": [str(d) for d in dirs], "problems_read": len(read),
                       "problem_ids": sorted(read)}


def auroc(scores: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None) -> float | torch.Tensor:
    """Area under the ROC curve (pivot = positive), ties counted half; NaN with one class only.

    scores, labels [N]; ``weights`` [N] or [R, N] (per-position multiplicities, for example of a bootstrap
    resample) gives one AUROC per row as a tensor [R]. Rank based: O(N log N), not pairwise.
    """
    order = torch.argsort(scores.double())
    s, y = scores.double()[order], labels[order] == 1
    _, group = torch.unique_consecutive(s, return_inverse=True)  # tied scores share a group
    w = torch.ones(1, len(s), dtype=torch.float64) if weights is None else weights.double().reshape(-1, len(s))[:, order]
    G = int(group.max()) + 1 if len(s) else 0
    pos = torch.zeros(w.shape[0], G, dtype=torch.float64).index_add_(1, group[y], w[:, y])
    neg = torch.zeros(w.shape[0], G, dtype=torch.float64).index_add_(1, group[~y], w[:, ~y])
    below = neg.cumsum(1) - neg  # negative weight strictly below each group
    total = pos.sum(1) * neg.sum(1)
    area = (pos * (below + 0.5 * neg)).sum(1) / total
    area = torch.where(total > 0, area, torch.full_like(area, math.nan))
    return float(area[0]) if weights is None or weights.dim() == 1 else area


def within_problem_auroc(scores: torch.Tensor, labels: torch.Tensor, problems: torch.Tensor) -> tuple[float, int]:
    """AUROC over the (pivot, non-pivot) pairs of the same problem only -> (area, pairs); NaN without pairs.

    A decode chooses between the mismatches of the problem at hand: a score that only knows which problems
    are fragile (many pivots) ranks well pooled over problems and no better than chance here. scores,
    labels, problems: [N]; each problem's AUROC weighted by its number of pairs, ties counted half.
    """
    area, pairs = 0.0, 0
    for p in problems.unique():
        m = problems == p
        n_pos = int((labels[m] == 1).sum())
        n = n_pos * (int(m.sum()) - n_pos)
        if n:
            area += auroc(scores[m], labels[m]) * n
            pairs += n
    return (area / pairs if pairs else math.nan), pairs


def single_features(data: dict) -> dict[str, torch.Tensor]:
    """Each stored feature as a pivot score, oriented so that higher means "more likely a pivot" by its
    meaning (a less likely or more uncertain token), not by the labels."""
    out = {"1 - p_target(token)": 1 - data["token_prob"].float(), "entropy": data["entropy"].float()}
    if "draft_prob" in data:
        out["1 - p_draft(token)"] = 1 - data["draft_prob"].float()
        out["draft entropy"] = data["draft_entropy"].float()
    return out


def bootstrap(scores: dict[str, torch.Tensor], labels: torch.Tensor, problems: torch.Tensor, reference: str,
              resamples: int = 2000, seed: int = 0) -> dict:
    """95% percentile intervals of each score's AUROC and of its difference to ``reference``'s, resampling
    problems with replacement (positions of one problem move together; the same resamples for all)."""
    ids, inverse = problems.unique(return_inverse=True)
    g = torch.Generator().manual_seed(seed)
    draws = torch.randint(0, len(ids), (resamples, len(ids)), generator=g)
    counts = torch.zeros(resamples, len(ids), dtype=torch.float64).scatter_add_(
        1, draws, torch.ones(resamples, len(ids), dtype=torch.float64))
    weights = counts[:, inverse]  # [R, N]
    areas = {name: auroc(s, labels, weights) for name, s in scores.items()}
    ci = lambda a: [float(x) for x in torch.nanquantile(a, torch.tensor([0.025, 0.975], dtype=a.dtype))]  # noqa: E731
    return {"resamples": resamples,
            "auroc_ci": {name: ci(a) for name, a in areas.items()},
            "difference_ci": {name: ci(areas[name] - areas[reference]) for name in scores if name != reference}}


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


def _inputs(data: dict, extra: tuple = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """Labeled positions -> the classifier's inputs: hidden [N, H] and (p_target(token), entropy, *extra) [N, F],
    fp32."""
    return data["hidden"].float(), torch.stack([data[k].float() for k in ("token_prob", "entropy", *extra)], -1)


def _logistic(x: torch.Tensor, y: torch.Tensor, l2: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Class-balanced logistic regression on standardized x [N, D] (fp64), labels y [N] in {0, 1}:
    minimizes mean weighted log-loss + l2 / 2 * |w|^2 (the bias is not penalized) by L-BFGS -> (w [D], b)."""
    counts = torch.bincount(y, minlength=2).double()
    sample = (counts.sum() / (2 * counts))[y]
    sample = sample / sample.sum()
    yf = y.double()
    w = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros((), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], lr=1, max_iter=500, tolerance_grad=1e-9, tolerance_change=1e-12,
                            history_size=20, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = (sample * nn.functional.binary_cross_entropy_with_logits(x @ w + b, yf, reduction="none")).sum()
        loss = loss + 0.5 * l2 * (w * w).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    return w.detach(), b.detach()


def _choose_l2(x: torch.Tensor, y: torch.Tensor, problems: torch.Tensor, cfg: TrainConfig) -> tuple[float, dict]:
    """The L2 strength with the highest pooled out-of-fold AUROC over ``cfg.inner_folds`` folds of problems
    (ties: the stronger one) -> (l2, {l2: AUROC})."""
    ids = problems.unique()
    folds = min(cfg.inner_folds, len(ids))
    g = torch.Generator().manual_seed(cfg.seed + 2)
    groups = ids[torch.randperm(len(ids), generator=g)].tensor_split(folds)
    scores = {l2: torch.full(y.shape, math.nan, dtype=torch.float64) for l2 in cfg.l2_grid}
    for group in groups:
        test = torch.isin(problems, group)
        if y[~test].unique().numel() < 2:
            continue  # a fold whose rest has one class only scores nothing
        for l2 in cfg.l2_grid:
            w, b = _logistic(x[~test], y[~test], l2)
            scores[l2][test] = x[test] @ w + b
    table = {}
    for l2, sc in scores.items():
        seen = ~torch.isnan(sc)
        table[l2] = auroc(sc[seen], y[seen]) if seen.any() else math.nan
    best = max(sorted(cfg.l2_grid, reverse=True), key=lambda l2: -math.inf if math.isnan(table[l2]) else table[l2])
    return best, table


def train(data: dict, meta: dict, cfg: TrainConfig = TrainConfig(), progress: bool = True):
    """-> (trained PivotClassifier of kind ``cfg.model``, report dict)."""
    from tqdm.auto import tqdm

    if cfg.model not in ("mlp", "linear"):
        raise ValueError(f"train() fits an mlp or a linear classifier, got {cfg.model!r} (auto: select_and_train)")
    torch.manual_seed(cfg.seed)
    hidden, features = _inputs(data, cfg.features)
    labels = data["label"].long()
    problems = data["group"].unique()
    g = torch.Generator().manual_seed(cfg.seed)
    held = problems[torch.randperm(len(problems), generator=g)[: max(1, round(cfg.heldout * len(problems)))]]
    is_held = torch.isin(data["group"], held)
    tr, ho = ~is_held, is_held
    if labels[tr].unique().numel() < 2:
        raise ValueError("the training split needs both pivots and non-pivots")

    clf = PivotClassifier(hidden.shape[1], layer=meta.get("layer", -8), target_model=meta.get("target"),
                          draft_model=meta.get("draft"), weights=meta.get("weights"), kind=cfg.model,
                          feature_names=FEATURE_NAMES + tuple(cfg.features))
    x = torch.cat([hidden, features], -1)
    with torch.no_grad():
        clf.input_mean.copy_(x[tr].mean(0))
        clf.input_scale.copy_(x[tr].std(0).clamp_min(1e-4))
    counts = torch.bincount(labels[tr], minlength=2).float()
    loss_fn = nn.CrossEntropyLoss(weight=counts.sum() / (2 * counts))  # class-balanced
    fit = {}
    if cfg.model == "linear":
        xs = ((x.double() - clf.input_mean.double()) / clf.input_scale.double())
        l2, table = _choose_l2(xs[tr], labels[tr], data["group"][tr], cfg)
        w, b = _logistic(xs[tr], labels[tr], l2)
        with torch.no_grad():
            clf.linear.weight.copy_(w[None].float())
            clf.linear.bias.copy_(b[None].float())
            best_loss = float(loss_fn(clf(hidden[ho], features[ho]), labels[ho])) if ho.any() else math.nan
        fit = {"l2": l2, "l2_auroc": {str(k): v for k, v in table.items()}}
    else:
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
        fit = {"best_epoch": best_epoch, "epochs_run": len(history)}
    clf.eval()
    with torch.no_grad():
        prob = clf.pivot_prob(hidden[ho], features[ho])
    report = {
        "model": cfg.model,
        "positions": {"train": int(tr.sum()), "heldout": int(ho.sum())},
        "problems": {"train": int(len(problems) - len(held)), "heldout": int(len(held))},
        "pivots": {"train": int(labels[tr].sum()), "heldout": int(labels[ho].sum())},
        "best_heldout_loss": best_loss,
        **fit,
        "heldout_auroc": auroc(prob, labels[ho]),
        "sigmas": sigma_table(prob, labels[ho]),
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.__dict__.items()},
        "label_meta": meta,
    }
    return clf, report


def out_of_fold(data: dict, meta: dict, cfg: TrainConfig, folds: int, progress: bool = True) -> torch.Tensor:
    """Each position's pivot probability [N] from a classifier trained (``train``) without its problem's fold;
    the folds of problems depend only on the problems and ``cfg.seed``."""
    from tqdm.auto import tqdm

    problems = data["group"].unique()
    if not 2 <= folds <= len(problems):
        raise ValueError(f"cross-validation needs 2 <= folds <= problems with labels ({len(problems)}), got {folds}")
    g = torch.Generator().manual_seed(cfg.seed + 1)
    groups = problems[torch.randperm(len(problems), generator=g)].tensor_split(folds)
    prob = torch.full(data["label"].shape, math.nan)
    for group in tqdm(groups, desc="cross-validate", unit="fold", disable=not progress):
        test = torch.isin(data["group"], group)
        try:
            clf, _ = train({k: v[~test] for k, v in data.items()}, meta, cfg, progress=False)
        except ValueError as e:
            raise ValueError(f"a cross-validation fold cannot be trained ({e}); use fewer folds") from e
        with torch.no_grad():
            prob[test] = clf.pivot_prob(*_inputs({k: v[test] for k, v in data.items()}, cfg.features))
    return prob


def decodable_features(names: str | None) -> tuple[str, ...]:
    """``--features``' comma-separated names -> the tuple a decodable classifier reads after the op's features:
    source features only (the op computes the divergence but does not feed it to the classifier)."""
    from ..models.classifier import SOURCE_FEATURES

    out = tuple(n.strip() for n in names.split(",")) if names else ()
    for n in out:
        if n not in SOURCE_FEATURES:
            raise ValueError(f"--features takes source features ({', '.join(SOURCE_FEATURES)}), got {n!r} "
                             f"(--compare-feature measures any candidate feature)")
    if len(set(out)) != len(out):
        raise ValueError(f"--features names a feature twice: {names}")
    return tuple(n for n in SOURCE_FEATURES if n in out)  # the classifier's order, whatever the command's


def compare_feature(data: dict, meta: dict, cfg: TrainConfig, name: str, folds: int = 5,
                    progress: bool = True) -> dict:
    """What a candidate feature adds (``name``; several comma-separated: added together): out-of-fold AUROC of
    ``cfg.model`` without and with it, on the same positions (those where it is known) and folds, and the 95%
    bootstrap interval over problems of the difference (with - without)."""
    from ..models.classifier import CANDIDATE_FEATURES

    names = tuple(n.strip() for n in name.split(","))
    for n in names:
        if n not in CANDIDATE_FEATURES:
            raise ValueError(f"unknown candidate feature {n!r}; choose among {', '.join(CANDIDATE_FEATURES)}")
        if n not in data:
            raise ValueError(f"the label folders hold no {n} (pad-decoding retrace adds it to search folders)")
    known = torch.stack([torch.isfinite(data[n].float()) for n in names]).all(0)
    if not known.any():
        raise ValueError(f"no labeled position has a {name}")
    sub = {k: v[known] for k, v in data.items() if k not in (*OUTCOMES, *WALKS)}
    labels = sub["label"].long()
    scores = {"without": out_of_fold(sub, meta, replace(cfg, features=()), folds, progress),
              "with": out_of_fold(sub, meta, replace(cfg, features=names), folds, progress)}
    if len(names) == 1:  # a feature alone as the score
        scores[name] = sub[name].float()
    boot = bootstrap(scores, labels, sub["group"], "without", cfg.bootstrap, cfg.seed)
    return {"feature": name, "model": cfg.model, "folds": folds, "positions": int(known.sum()),
            "positions_without_it": int((~known).sum()), "problems": len(sub["group"].unique()),
            "pivots": int(labels.sum()),
            "auroc": {k: auroc(v, labels) for k, v in scores.items()},
            "auroc_ci": boot["auroc_ci"],
            "difference": auroc(scores["with"], labels) - auroc(scores["without"], labels),
            "difference_ci": boot["difference_ci"]["with"], "bootstrap_resamples": cfg.bootstrap,
            "per_source": per_source_auroc({"without": scores["without"], "with": scores["with"]}, sub)}


def folder_drafter(meta: dict) -> str:
    """The drafter whose proposals a label folder's ``meta.json`` (``meta``) says it judged; the draft model's
    for folders labeled before the choice existed."""
    return meta.get("drafter", "model")


def per_source_auroc(scores: dict[str, torch.Tensor], data: dict) -> dict:
    """Per proposal source present in ``data`` (its ``source``, ``pad.pivots.search.SOURCE_IDS``): positions,
    pivots and each score's AUROC over that source's positions, beside ``1 - p_target(token)`` alone; empty
    when the positions come from one source only."""
    from .search import SOURCE_IDS

    present = data["source"].unique().tolist()
    if len(present) < 2:
        return {}
    labels = data["label"].long()
    out = {}
    for name, i in SOURCE_IDS.items():
        m = data["source"] == i
        if not m.any():
            continue
        out[name] = {"positions": int(m.sum()), "pivots": int(labels[m].sum()),
                     "auroc": {k: auroc(v[m], labels[m]) for k, v in
                               {**scores, "1 - p_target(token)": 1 - data["token_prob"].float()}.items()}}
    return out


def cross_validate(data: dict, meta: dict, cfg: TrainConfig = TrainConfig(), folds: int = 5,
                   progress: bool = True) -> dict:
    """Grouped k-fold estimate: problems split into ``folds`` groups; each group's positions are scored by
    ``train`` run on the other groups (with its own held-out split for early stopping), and AUROC and the
    sigma table are computed over all these out-of-fold scores together."""
    problems = data["problem"].unique()
    prob = out_of_fold(data, meta, cfg, folds, progress)
    labels = data["label"].long()
    # What the classifier must beat: each feature alone, as a score over the same positions. The best is
    # taken over both orientations of each feature (chosen after seeing the labels: kind to the baselines).
    features = single_features(data)
    baselines = {name: auroc(f, labels) for name, f in features.items()}
    best = max(baselines, key=lambda n: max(baselines[n], 1 - baselines[n]))
    oriented = features[best] if baselines[best] >= 0.5 else -features[best]
    boot = bootstrap({"classifier": prob, **features, "best single feature": oriented}, labels, data["group"],
                     "classifier", cfg.bootstrap, cfg.seed)
    out = {"model": cfg.model, "folds": folds, "positions": len(labels), "pivots": int(labels.sum()),
           "problems": len(problems), "auroc": auroc(prob, labels), "auroc_ci": boot["auroc_ci"]["classifier"],
           "baselines": baselines, "baselines_ci": {n: boot["auroc_ci"][n] for n in baselines},
           "best_single_feature": {"name": best, "auroc": max(baselines[best], 1 - baselines[best]),
                                   "difference": auroc(prob, labels) - max(baselines[best], 1 - baselines[best]),
                                   # classifier minus best feature; the bootstrap stores feature - classifier
                                   "difference_ci": sorted(-v for v in boot["difference_ci"]["best single feature"])},
           "bootstrap_resamples": cfg.bootstrap, "sigmas": sigma_table(prob, labels)}
    within = {name: within_problem_auroc(s, labels, data["problem"]) for name, s in {"classifier": prob, **features}.items()}
    out["within_problems"] = {"pairs": within["classifier"][1], "auroc": {n: a for n, (a, _) in within.items()}}
    out["per_source"] = per_source_auroc({"classifier": prob}, data)
    if all(k in data for k in OUTCOMES):
        # What the out-of-fold scores would do to the answers (pad.pivots.replay), beside the threshold rule
        # on p_target(token); problems read without a decision count as unchanged.
        read = max(meta.get("problems_read", 0), len(problems))
        ks = REPLAY_KS if all(k in data for k in WALKS) else ()
        out["replay"] = {
            "problems": read,
            "pivot@sigma": replay_table(prob, REPLAY_SIGMAS, data, read, resamples=cfg.bootstrap, seed=cfg.seed, ks=ks),
            "threshold@tau": replay_table(data["token_prob"].float(), REPLAY_TAUS, data, read, higher_accepts=True,
                                          resamples=cfg.bootstrap, seed=cfg.seed, ks=ks)}
        if ks:  # tokens per forward rejecting every mismatch (exact) and exactly the pivots (a perfect classifier)
            walk = lambda reject, k: tokens_per_forward(reject, data["position"], data["text_length"],  # noqa: E731
                                                        data["problem"], k)
            out["replay"]["tokens_per_forward"] = {
                "exact": {str(k): walk(torch.ones_like(labels, dtype=torch.bool), k) for k in ks},
                "perfect classifier": {str(k): walk(labels == 1, k) for k in ks}}
    return out


def select_and_train(data: dict, meta: dict, cfg: TrainConfig = TrainConfig(), folds: int = 5,
                     progress: bool = True):
    """``cfg.model`` mlp or linear: cross-validate, then train it. ``auto``: cross-validate both on the same
    folds and train the one with the higher cross-validated AUROC. -> (classifier, report with
    ``cross_validation`` and, for auto, ``model_selection``)."""

    if cfg.model not in MODELS:
        raise ValueError(f"unknown model {cfg.model!r}; choose one of {', '.join(MODELS)}")
    kinds = ("mlp", "linear") if cfg.model == "auto" else (cfg.model,)
    cvs = {k: cross_validate(data, meta, replace(cfg, model=k), folds, progress) for k in kinds} if folds else {}
    chosen = max(kinds, key=lambda k: cvs[k]["auroc"]) if cvs else kinds[0]
    clf, report = train(data, meta, replace(cfg, model=chosen), progress)
    if cvs:
        report["cross_validation"] = cvs[chosen]
    if cfg.model == "auto":
        report["model_selection"] = {"chosen": chosen, "cross_validated_auroc": {k: cv["auroc"] for k, cv in cvs.items()}}
    return clf, report


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def report_markdown(report: dict) -> str:
    fmt = lambda v: "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.3f}"  # noqa: E731
    ci = lambda pair: f"[{fmt(pair[0])}, {fmt(pair[1])}]"  # noqa: E731
    meta = report.get("label_meta", {})
    kind = report.get("model", "mlp")
    if kind == "linear":
        fit = f"Logistic regression, L2 strength {report['l2']} chosen by cross-validation over the training problems"
    else:
        fit = f"MLP, best held-out loss at epoch {report['best_epoch']} of {report['epochs_run']} run"
    lines = [
        f"Label folders {', '.join(meta.get('folders', []))}: {meta.get('problems_read', 'n/a')} problems read, "
        f"{report['problems']['train'] + report['problems']['heldout']} with labeled positions.",
        "",
        f"Trained on {report['positions']['train']} labeled positions from {_count(report['problems']['train'], 'problem')} "
        f"({report['pivots']['train']} pivots); held out {report['positions']['heldout']} positions from "
        f"{_count(report['problems']['heldout'], 'problem')} ({report['pivots']['heldout']} pivots).",
        "",
        f"{fit}. Held-out AUROC {fmt(report['heldout_auroc'])}; held-out loss {fmt(report['best_heldout_loss'])}.",
        "",
        *_sigma_lines(report["sigmas"], fmt),
    ]
    sel = report.get("model_selection")
    if sel:
        lines += ["", "Kind chosen by cross-validated AUROC: " + ", ".join(
            f"{k} {fmt(v)}" for k, v in sel["cross_validated_auroc"].items()) + f" -> {sel['chosen']}."]
    cv = report.get("cross_validation")
    if cv:
        auc = f"AUROC {fmt(cv['auroc'])}" + (f" (95% bootstrap interval over problems {ci(cv['auroc_ci'])})"
                                            if "auroc_ci" in cv else "")
        lines += [
            "",
            f"Cross-validated over {cv['folds']} folds of problems (each problem scored by a classifier trained "
            f"without it): {auc} on {cv['positions']} positions ({cv['pivots']} pivots). "
            "A single feature as the score, over the same positions: "
            + ", ".join(f"{name} AUROC {fmt(v)}" for name, v in cv["baselines"].items()) + ".",
        ]
        best = cv.get("best_single_feature")
        if best:
            lines += ["", f"Best single feature: {best['name']} ({fmt(best['auroc'])}); the classifier minus it: "
                          f"{best['difference']:+.3f}, 95% interval {ci(best['difference_ci'])} "
                          f"({cv['bootstrap_resamples']} resamples of problems)."]
        inside = cv.get("within_problems")
        if inside:
            lines += ["", f"Within problems (only the {inside['pairs']} pivot / non-pivot pairs of the same problem, "
                          "the choice a decode faces): " + ", ".join(
                              f"{name} AUROC {fmt(v)}" for name, v in inside["auroc"].items()) + "."]
        lines += _per_source_lines(cv.get("per_source"), fmt)
        lines += ["", *_sigma_lines(cv["sigmas"], fmt)]
        rep = cv.get("replay")
        if rep:
            walks = rep.get("tokens_per_forward")
            ks = list(walks["exact"]) if walks else []
            per_k = lambda tpf: "".join(f" {tpf[k]:.2f} ({tpf[k] / walks['exact'][k]:.2f}x) |" for k in ks)  # noqa: E731
            lines += ["", f"Replay of the search walks over {rep['problems']} problems with these out-of-fold scores "
                          "(`pad.pivots.replay`: a preview from the labels, not a decode): accuracy change against "
                          "the target's own text, 95% interval over problems"
                      + ("; tokens per target forward on the walked texts at each K, against rejecting every "
                         "mismatch (exact)." if ks else "."), "",
                      "| rule | mismatches accepted | accuracy change | 95% interval |"
                      + "".join(f" tokens / forward, K = {k} |" for k in ks), "|---|---|---|---|" + "---|" * len(ks)]
            lines += [f"| {name} | | | |" + per_k(tpf) for name, tpf in (walks or {}).items()]
            lines += [f"| {rule.split('@')[0]}@{r['threshold']:g} | {r['mismatches_accepted']:.3f} | "
                      f"{100 * r['accuracy_change']:+.1f} pts | [{100 * r['accuracy_change_ci'][0]:+.1f}, "
                      f"{100 * r['accuracy_change_ci'][1]:+.1f}] |" + (per_k(r["tokens_per_forward"]) if ks else "")
                      for rule in ("pivot@sigma", "threshold@tau") for r in rep[rule]]
    cmp = report.get("feature_comparison")
    if cmp:
        name, auc, aci = cmp["feature"], cmp["auroc"], cmp["auroc_ci"]
        alone = (f"; {name} alone as the score {fmt(auc[name])} {ci(aci[name])}" if name in auc else "")
        lines += ["", f"Candidate feature {name} ({cmp['model']}, the same {cmp['folds']} folds of problems, on the "
                      f"{cmp['positions']} positions that have it, {_count(cmp['problems'], 'problem')}, "
                      f"{cmp['pivots']} pivots; {cmp['positions_without_it']} positions without it left out): cross-validated AUROC "
                      f"without it {fmt(auc['without'])} {ci(aci['without'])}, with it {fmt(auc['with'])} "
                      f"{ci(aci['with'])}; with minus without {cmp['difference']:+.4f}, 95% interval "
                      f"[{cmp['difference_ci'][0]:+.4f}, {cmp['difference_ci'][1]:+.4f}] "
                      f"({cmp['bootstrap_resamples']} resamples of problems){alone}."]
        lines += _per_source_lines(cmp.get("per_source"), fmt)
    return "\n".join(lines) + "\n"


def _per_source_lines(per_source: dict | None, fmt) -> list[str]:
    """A table of AUROC per proposal source (``per_source_auroc``); nothing for one source."""
    if not per_source:
        return []
    names = list(next(iter(per_source.values()))["auroc"])
    lines = ["", "Per proposal source (out-of-fold scores over each source's positions):", "",
             "| source | positions | pivots | " + " | ".join(f"AUROC {n}" for n in names) + " |",
             "|---|---|---|" + "---|" * len(names)]
    return lines + [f"| {src} | {r['positions']} | {r['pivots']} | " + " | ".join(fmt(r["auroc"][n]) for n in names)
                    + " |" for src, r in per_source.items()]


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
