"""Run from outside the source tree in a venv where only the built wheel is installed: the package data (the
shipped classifier), the compiled CPU backend and the command line all come from the wheel.

    python .ci/wheel_smoke.py WORKDIR
"""
import json
import subprocess
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import pad
import pad_kernels
from pad.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET, shipped_classifier
from pad_kernels import cpu

work = Path(sys.argv[1])
for module in (pad, pad_kernels):
    assert "site-packages" in module.__file__, f"{module.__name__} comes from {module.__file__}, not the wheel"
assert cpu.available() and cpu.isa() in ("avx512", "avx2", "baseline"), "the compiled CPU backend did not install"
clf = pad.PivotClassifier.load(shipped_classifier(DEFAULT_TARGET, DEFAULT_DRAFT))
assert clf.checksum() == "5bb6d08638e95490", clf.checksum()

# A tiny random target and draft with one word-level tokenizer.
words = [f"w{i}" for i in range(64)]
tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
for name, seed in (("target", 0), ("draft", 1)):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    LlamaForCausalLM(cfg).save_pretrained(work / name)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=words[0]).save_pretrained(work / name)

out = subprocess.run(["pad-decoding", "generate", "--target", str(work / "target"), "--draft", str(work / "draft"),
                      "--prompt", "w1 w2 w3", "--max-new-tokens", "16", "-k", "4", "--dtype", "float32", "--json"],
                     capture_output=True, text=True, check=True).stdout
stats = json.loads(out[out.index("{"):])
assert stats["new_tokens"] == 16 and stats["target_forwards"] >= 4, stats
subprocess.run(["pad-decoding", "doctor", "--check"], check=True)
print(f"wheel smoke: ok (CPU backend {cpu.isa()}, classifier {clf.checksum()}, {stats['new_tokens']} tokens decoded)")
