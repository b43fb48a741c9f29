#!/usr/bin/env bash
# The runs behind the frontier of the rules that read both models' distributions (kl, topk) beside the others,
# greedy and sampled, in the order they depend on each other. Every command resumes from its run log
# (bench/results/*.runs.jsonl): rerun the script after an interruption. Hours of decoding: run it alone, on a CPU
# with native bf16 (grep -o avx512_bf16 /proc/cpuinfo), and commit the run logs as they grow.
set -euo pipefail
cd "$(dirname "$0")/.."
export PAD_WEIGHTS=${PAD_WEIGHTS:-index-gguf}
common=(-k 8 --max-new-tokens 512 --dtype bfloat16 --threads 2 --batch-size 16 --out bench/results)

# 1. Settings, chosen on GSM8K train 7000-7095 (never labeled nor reported; target, exact and pivot ran there
#    before): three of each new rule, spread over the share of exact's mismatches they would accept
#    (python bench/mismatch_stats.py: about 10%, 35% and 60% for kl, 12%, 32% and 57% for topk), and two of
#    typical and of threshold, for the sampled table's "best greedy setting" of each rule.
pad-decoding bench --task gsm8k --split train --start 7000 --limit 7096 "${common[@]}" \
  --policies kl@0.2,kl@0.5,kl@1,topk@2,0.1,topk@3,0.3,topk@5,0.5,typical,typical@0.3,0.6,threshold@0.4,threshold@0.2
python bench/frontier.py bench/results/gsm8k_train_k8_bfloat16.runs.jsonl --split train --start 7000 --limit 7096 \
  --batch-size 16 --out bench/results

# 2. and 3. (greedy dev tables with two settings of kl and topk; the sampled table at temperature 0.7, seeds 0-2)
#    take the settings step 1's table chooses: see bench/README.md, "Rules that read both models".
