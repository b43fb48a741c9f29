#!/usr/bin/env bash
# The runs behind the frontier of the rules that read both models' distributions (kl, topk) beside the others,
# greedy and sampled, in the order they depend on each other. Every command resumes from its run log
# (bench/results/*.runs.jsonl): rerun the script after an interruption. Hours of decoding: run it alone, on a CPU
# with native bf16 (grep -o avx512_bf16 /proc/cpuinfo), and commit the run logs as they grow. A run log reuses a
# run only on the machine that made it (its settings hold the machine line): on another machine,
# `SEEDS="1 2" bash bench/challengers.sh sampled` runs step 3 alone for the seeds not yet logged, with the
# settings step 1 chose from the logged runs (each seed's policies run on one machine, so pairs stay paired).
set -euo pipefail
only=${1:-all}
[[ $only == all || $only == sampled ]] || { echo "usage: $0 [sampled]" >&2; exit 2; }
cd "$(dirname "$0")/.."
export PAD_WEIGHTS=${PAD_WEIGHTS:-index-gguf}
common=(-k 8 --max-new-tokens 512 --dtype bfloat16 --threads 2 --batch-size 16 --out bench/results)

# 1. Settings, chosen on GSM8K train 7000-7095 (never labeled nor reported; target, exact and pivot ran there
#    before): three of each new rule, spread over the share of exact's mismatches they would accept
#    (python bench/mismatch_stats.py: about 10%, 35% and 60% for kl, 12%, 32% and 57% for topk), and two of
#    typical and of threshold, for the sampled table's "best greedy setting" of each rule.
if [[ $only == all ]]; then
pad-decoding bench --task gsm8k --split train --start 7000 --limit 7096 "${common[@]}" \
  --policies kl@0.2,kl@0.5,kl@1,topk@2,0.1,topk@3,0.3,topk@5,0.5,typical,typical@0.3,0.6,threshold@0.4,threshold@0.2
python bench/frontier.py bench/results/gsm8k_train_k8_bfloat16.runs.jsonl --split train --start 7000 --limit 7096 \
  --batch-size 16 --reference exact --out bench/results/challengers
fi

# The settings step 1 chooses (bench/frontier.py's choose): of each rule, the most accepting setting whose
# accuracy is within 2 points of exact's, then the next more accepting one.
choose() {  # $1: comma-separated rules, $2: settings per rule
  python bench/frontier.py bench/results/gsm8k_train_k8_bfloat16.runs.jsonl --split train --start 7000 \
    --limit 7096 --batch-size 16 --reference exact --choose "$1" --per-rule "$2" | sed -n 's/^chosen: //p'
}
two=$(choose kl,topk 2)
best=$(choose typical,threshold,kl,topk 1)
[[ -n $two && -n $best ]] || { echo "step 1 is incomplete: no settings to choose from" >&2; exit 1; }
echo "chosen: greedy tables $two; sampled table $best"

# 2. The greedy dev tables at K = 8: the chosen settings join the rows already logged (same decode path). The
#    tables (bench/results/challengers/) take the shipped classifier's pivot rows; the older tables in
#    bench/results/ stay those of the classifier before it (docs/results.md).
run=(pad-decoding bench -k 8 --dtype bfloat16 --threads 2 --batch-size 16)
if [[ $only == all ]]; then
"${run[@]}" --task gsm8k --limit 200 --max-new-tokens 512 --out bench/results --policies "$two"
"${run[@]}" --task humaneval --limit 80 --max-new-tokens 384 --out bench/results --policies "$two"
python bench/frontier.py bench/results/gsm8k_dev_k8_bfloat16.runs.jsonl \
  bench/results/gsm8k_dev_k16_bfloat16.runs.jsonl --limit 200 --batch-size 16 --out bench/results/challengers
python bench/frontier.py bench/results/humaneval_dev_k8_bfloat16.runs.jsonl --limit 80 --max-new-tokens 384 \
  --batch-size 16 --out bench/results/challengers
#    Tokens/s side by side (the dev rows were timed on other days): one batch, every rule, one process.
"${run[@]}" --task gsm8k --start 96 --limit 112 --max-new-tokens 512 --out bench/results/side_by_side \
  --policies "target,exact,pivot@0.3,threshold@0.2,typical,$two"
fi

# 3. Sampled: GSM8K dev 0-99 at temperature 0.7, top-p 1, seeds 0-2; each training-free rule at its chosen
#    setting (fly is greedy by definition). Accuracy against exact, the lossless rule when sampling.
for seed in ${SEEDS:-0 1 2}; do
  "${run[@]}" --task gsm8k --limit 100 --max-new-tokens 512 --out bench/results --temperature 0.7 --top-p 1.0 \
    --seed "$seed" --policies "target,exact,pivot@0.3,$best"
done
python bench/frontier.py bench/results/gsm8k_dev_k8_bfloat16_t0.7.runs.jsonl --limit 100 --batch-size 16 \
  --temperature 0.7 --top-p 1.0 --seeds 0,1,2 --out bench/results/challengers
