"""How the classifier's cross-validated AUROC grows with the number of labeled problems: random subsets
of the problems of some ``pad label`` folders, each cross-validated as ``pad-decoding train`` does.

    python bench/label_curve.py labels/gsm8k-train-search labels/gsm8k-train-search-fp32 \
        --problems-of pad/classifiers/qwen2.5-coder-1.5b-0.5b/report.json
"""
from __future__ import annotations

import argparse
import json
from dataclasses import replace

import torch

from pad.pivots.train import TrainConfig, cross_validate, load_shards


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--sizes", default="25,50,75", help="comma-separated numbers of problems (all of them: added)")
    ap.add_argument("--draws", type=int, default=2, help="random subsets per size")
    ap.add_argument("--model", default="linear", choices=("linear", "mlp"))
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--problems-of", help="a classifier's report.json: only the problems it was trained on")
    args = ap.parse_args(argv)
    only = json.load(open(args.problems_of))["label_meta"]["problem_ids"] if args.problems_of else None
    data, meta = load_shards(args.dirs, only=only)
    problems = data["problem"].unique()
    sizes = sorted({int(s) for s in args.sizes.split(",") if int(s) < len(problems)} | {len(problems)})
    print(f"{len(problems)} problems with decisions, {len(data['label'])} decisions, {int(data['label'].sum())} pivots")
    print("| problems | draw | pivots | cross-validated AUROC | best single feature | its AUROC |\n|---|---|---|---|---|---|")
    for n in sizes:
        for draw in range(args.draws if n < len(problems) else 1):
            keep = problems[torch.randperm(len(problems), generator=torch.Generator().manual_seed(draw))[:n]]
            sub = {k: v[torch.isin(data["problem"], keep)] for k, v in data.items()}
            cv = cross_validate(sub, meta, replace(TrainConfig(), model=args.model, bootstrap=200, seed=draw),
                                args.folds, progress=False)
            best = cv["best_single_feature"]
            print(f"| {n} | {draw} | {int(sub['label'].sum())} | {cv['auroc']:.3f} | {best['name']} | {best['auroc']:.3f} |",
                  flush=True)


if __name__ == "__main__":
    main()
