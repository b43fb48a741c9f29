"""Pivot labels and the pivot classifier: labeling (rollout and search), continuations, training."""
