"""Evaluation: tasks and their scoring, the code sandbox, the end-to-end benchmark."""
