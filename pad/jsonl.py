"""Append-only JSONL logs that survive a kill: each record is fsync'd, and a line torn by a kill is dropped
(its record is redone) when the log is read back."""
from __future__ import annotations

import json
import os
from pathlib import Path


def read(path: Path) -> list[dict]:
    """The complete records of ``path`` ([] if it does not exist); cuts a torn last line off the file."""
    if not path.exists():
        return []
    text = path.read_text()
    if text and not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
        path.write_text(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def append(path: Path, record: dict) -> None:
    """Append one record; the fsync'd line is the commit point of whatever the record describes."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())
