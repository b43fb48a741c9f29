"""Tiny random HuggingFace causal LMs built from configs (no downloads) for the decode-loop tests."""
import copy

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

ARCHS = ("llama", "qwen2", "gpt2")


def tiny_model(arch: str, vocab: int = 96, *, hidden: int = 32, layers: int = 2, seed: int = 0):
    """A random model in fp32 eval mode, without special tokens (tests pass eos_token_id themselves)."""
    torch.manual_seed(seed)
    special = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if arch == "gpt2":
        cfg = GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=4, n_positions=512, **special)
        model = GPT2LMHeadModel(cfg)
    else:
        cls_cfg, cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
        cfg = cls_cfg(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, **special)
        model = cls(cfg)
    model.generation_config.eos_token_id = None
    return model.eval()


def noisy_copy(model, scale: float, seed: int):
    """A draft that agrees with ``model`` often but not always: its weights plus Gaussian noise."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std().clamp_min(1e-3))
    return draft.eval()


# Noise that gives a greedy acceptance rate between about 0.5 and 0.9 for each architecture.
NOISE = {"llama": 0.1, "qwen2": 0.1, "gpt2": 0.6}


def tiny_pair(arch: str = "llama", vocab: int = 96, *, scale: float | None = None, seed: int = 0):
    target = tiny_model(arch, vocab, seed=seed)
    return target, noisy_copy(target, NOISE[arch] if scale is None else scale, seed + 1)


def greedy_from_scratch(model, ids: list[int], n: int, eos=()) -> list[int]:
    """Reference greedy decoding: a full forward without any cache at every step; stops after an EOS."""
    out = []
    while len(out) < n:
        token = int(model(torch.tensor([ids + out])).logits[0, -1].argmax())
        out.append(token)
        if token in eos:
            break
    return out
