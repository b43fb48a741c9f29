"""A draft model's forward as one plain loop over its layers, without transformers' per-call machinery.

At one row a draft token's forward reads the draft's weights once; with quantized weights that is most of a
step, and much of the rest is Python, most of it transformers' generic forward (mask and output plumbing,
kwargs and hooks through some ten module calls per layer), spent again for every draft token.
``use_lean_forward(model)`` replaces the model's forward with ``LeanForward``: the same computation for the
Llama / Qwen2 family (embedding; per layer RMSNorm, q/k/v with their biases, rotary positions, attention over the
KV cache, o; RMSNorm, gated SiLU MLP; final RMSNorm and the output layer over the last positions kept), with
q, k and v as one matrix and gate and up as one (views of which become the layers' own weights: no copy, and
one kernel call where there were three and two). The model's own norm, rotary and output modules are called,
so what they compute stays transformers'; attention is ``pad.decoding.attention.fused_cpu_attention``.

Hooks on the model's inner modules do not run (the draft's are never hooked: the classifier reads the target).
It takes the arguments ``Decoder.forward`` passes (ids, a 2D mask, positions, a ``DynamicCache``, the
positions to keep) and returns the logits and the cache; ``supports`` says which models it takes, and tests
compare it with transformers' forward on every path the decode takes (tests/test_draft_forward.py).
"""
from __future__ import annotations

import torch
from torch import nn

from .attention import fused_cpu_attention
from .hf import decoder_layers, text_config
from .int8 import PackedLinear, joined_rows

FAMILIES = ("llama", "qwen2")


def supports(model) -> str | None:
    """None if ``LeanForward`` computes what ``model``'s own forward does, else why not (a sentence)."""
    cfg = text_config(model)
    if getattr(cfg, "model_type", None) not in FAMILIES:
        return f"model type {getattr(cfg, 'model_type', None)!r} is not one of {FAMILIES}"
    if getattr(cfg, "hidden_act", "silu") != "silu" or getattr(cfg, "mlp_bias", False):
        return "its MLP is not a gated SiLU without biases"
    if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or ()):
        return "it has sliding-window layers"
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        return "its checkpoint splits linear layers (pretraining_tp)"
    base = getattr(model, "model", None)
    if base is None or not all(hasattr(base, a) for a in ("embed_tokens", "norm", "rotary_emb")):
        return f"{type(model).__name__} has no .model with embed_tokens, norm and rotary_emb"
    for layer in decoder_layers(model):
        a, m = layer.self_attn, layer.mlp
        projections = (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj)
        if not all(type(p) is nn.Linear or isinstance(p, PackedLinear) for p in projections):
            return "its projections are not nn.Linear or pad's packed layers"
        if (a.q_proj.bias is None) != (a.k_proj.bias is None) or (a.q_proj.bias is None) != (a.v_proj.bias is None):
            return "only some of q, k, v have biases"
        if m.gate_proj.bias is not None or m.up_proj.bias is not None:
            return "its gate and up layers have biases"
    return None


def joinable(layers: list[nn.Module]) -> bool:
    """Whether ``concatenated`` takes ``layers``: nn.Linear all with or all without biases, or packed layers
    that ``PackedLinear.joinable`` takes."""
    if isinstance(layers[0], PackedLinear):
        return type(layers[0]).joinable(layers)
    return all(type(p) is nn.Linear and (p.bias is None) == (layers[0].bias is None) for p in layers)


def concatenated(layers: list[nn.Module]) -> nn.Module:
    """One layer computing ``layers`` (all nn.Linear, or ``PackedLinear.joined``) side by side: [..., in] ->
    [..., sum of outs]. Each layer's weights become views of the new layer's, so no weights are held twice."""
    if isinstance(layers[0], PackedLinear):
        return type(layers[0]).joined(layers)
    if not joinable(layers):
        raise ValueError("only nn.Linear layers that all have, or all lack, biases are joined")
    joined = nn.Linear(layers[0].in_features, sum(p.out_features for p in layers), bias=layers[0].bias is not None,
                       device="meta")
    for name in ("weight", "bias") if layers[0].bias is not None else ("weight",):
        whole = joined_rows(layers, [getattr(p, name).detach() for p in layers],
                            lambda layer, view, n=name: setattr(layer, n, nn.Parameter(view, requires_grad=False)))
        setattr(joined, name, nn.Parameter(whole, requires_grad=False))
    return joined


class SideBySide:
    """``layers`` on one input -> their outputs: one matmul of them ``concatenated`` where ``joinable``."""

    def __init__(self, layers: list[nn.Module]):
        self.layers, self.sizes = layers, [p.out_features for p in layers]
        self.joined = concatenated(layers) if joinable(layers) else None

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.joined is None:
            return [p(x) for p in self.layers]
        return self.joined(x).split(self.sizes, -1)


class LeanForward:
    """``model``'s forward for the arguments the decode passes: ``input_ids`` [B, T], ``attention_mask`` [B, S + T]
    (1: attend; None: every column), ``position_ids`` [B, T], the ``DynamicCache`` of S columns to extend (None:
    a new one), ``logits_to_keep`` n -> an output with ``logits`` [B, n, V] and ``past_key_values``."""

    def __init__(self, model):
        why = supports(model)
        if why is not None:
            raise ValueError(f"the lean draft forward does not take this model: {why}")
        self.model, self.base = model, model.model
        self.layers = []
        for layer in decoder_layers(model):
            a, m = layer.self_attn, layer.mlp
            self.layers.append((layer, SideBySide([a.q_proj, a.k_proj, a.v_proj]),
                                SideBySide([m.gate_proj, m.up_proj])))
        self.head_dim = self.layers[0][0].self_attn.head_dim

    def __call__(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None,
                 logits_to_keep: int = 0, use_cache: bool = True, **unused):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        from .decoder import growing_cache

        cache = past_key_values if past_key_values is not None else (growing_cache() or _dynamic_cache())
        B, T = input_ids.shape
        past = cache.get_seq_length()
        if position_ids is None:
            position_ids = torch.arange(past, past + T, device=input_ids.device).expand(B, T)
        h = self.base.embed_tokens(input_ids)
        cos, sin = self.base.rotary_emb(h, position_ids)  # [B, T, D]
        cos, sin = cos[:, None], sin[:, None]
        mask = attention_mask_4d(attention_mask, B, T, past, h.device)
        for i, (layer, qkv, gate_up) in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in qkv(x))
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
            k, v = cache.update(k, v, i)
            out, _ = fused_cpu_attention(attn, q, k, v, mask, scaling=attn.scaling)
            h = h + attn.o_proj(out.reshape(B, T, -1))
            gate, up = gate_up(layer.post_attention_layernorm(h))
            h = h + layer.mlp.down_proj(layer.mlp.act_fn(gate) * up)
        keep = T if not logits_to_keep else logits_to_keep
        logits = self.model.get_output_embeddings()(self.base.norm(h[:, -keep:]))
        return CausalLMOutputWithPast(logits=logits, past_key_values=cache)


def attention_mask_4d(mask, B: int, T: int, past: int, device) -> torch.Tensor | None:
    """A 2D mask [B, past + T] (or None) -> [B, 1, T, past + T] bool: column s is seen by new token t when the
    2D mask allows it and s <= past + t; each new token always sees itself, so a hole (a token no one attends
    to) has a finite output. None for one new token without a mask (it sees every column)."""
    if mask is None and T == 1:
        return None
    columns = torch.arange(past + T, device=device)
    own = (past + torch.arange(T, device=device))[:, None]
    seen = columns[None, :] <= own  # [T, S]
    if mask is not None:
        seen = seen[None] & mask.bool()[:, None, :]
    seen = seen | (columns[None, :] == own)
    return seen.expand(B, T, past + T)[:, None]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), -1)


def _dynamic_cache():
    from transformers import DynamicCache

    return DynamicCache()


def use_lean_forward(model) -> bool:
    """Run ``model``'s forward as ``LeanForward`` (after any weight transform: its layers join q/k/v and
    gate/up as they are then). Returns False, changing nothing, where ``supports`` says no."""
    if supports(model) is not None:
        return False
    model.forward = LeanForward(model)
    model.pad_forward = "lean"
    return True
