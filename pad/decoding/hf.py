"""What the decode loop needs from a HuggingFace causal LM, through its public API and hooks only."""
from __future__ import annotations

import inspect

import torch
import transformers
from torch import nn

# Vocabularies padded to different sizes (Qwen checkpoints: 151936 vs 152064) align on the shared range;
# sizes further apart than padding explains (256 ids or 1%) mean the models do not share a tokenizer.
MAX_VOCAB_PADDING = (256, 0.01)
_NEGATIVE_CROP = int(transformers.__version__.split(".")[0]) >= 5


def text_config(model):
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def vocab_size(model) -> int:
    """Rows of the output embedding, i.e. the logits' last dim."""
    out = model.get_output_embeddings()
    return out.weight.shape[0] if out is not None else text_config(model).vocab_size


def kv_shape(model) -> tuple[int, int, int]:
    """(layers, key/value heads, head dim) of the model's KV cache: a layer's keys are [B, heads, S, head dim]."""
    c = text_config(model)
    heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return c.num_hidden_layers, heads, head_dim


def kv_bytes_per_token(model) -> int:
    """Bytes one token adds to the model's KV cache: keys and values of every layer, in the model's dtype."""
    layers, heads, head_dim = kv_shape(model)
    return 2 * layers * heads * head_dim * next(model.parameters()).element_size()


def eos_ids(model, eos_token_id) -> set[int]:
    """The stop tokens, resolved as transformers' ``generate`` resolves them.

    ``eos_token_id`` (int or list) if given, else the model's generation config, even when that says None
    (then ``generate`` never stops early, so neither do we); the model config only for a model without a
    generation config.
    """
    if eos_token_id is None:
        gen = getattr(model, "generation_config", None)
        source = gen if gen is not None else text_config(model)
        eos_token_id = getattr(source, "eos_token_id", None)
    if eos_token_id is None:
        return set()
    return {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(t) for t in eos_token_id}


def shared_vocab_size(target, draft) -> int:
    """Size of the token range both models score; raises if their vocabularies cannot be aligned. One of them
    None (a decode or a label walk with one model): the other's own size.

    Without tokenizers this compares sizes and special tokens; ``check_tokenizers`` compares the tokens.
    """
    if target is None or draft is None:
        return vocab_size(target if target is not None else draft)
    vt, vd = vocab_size(target), vocab_size(draft)
    shared = min(vt, vd)
    if max(vt, vd) - shared > max(MAX_VOCAB_PADDING[0], MAX_VOCAB_PADDING[1] * shared):
        raise ValueError(
            f"draft and target vocabularies cannot be aligned: {vd} vs {vt} tokens; "
            "speculative decoding needs two models that share a tokenizer"
        )
    for attr in ("eos_token_id", "bos_token_id"):
        a, b = getattr(text_config(target), attr, None), getattr(text_config(draft), attr, None)
        if a is not None and b is not None and a != b:
            raise ValueError(
                f"draft and target vocabularies cannot be aligned: {attr} is {b} in the draft and {a} in the target"
            )
    return shared


def check_tokenizers(target_tokenizer, draft_tokenizer, size: int) -> None:
    """Raise ValueError unless both tokenizers map every id below ``size`` that they know to the same token."""
    vt, vd = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    inv_t = {i: tok for tok, i in vt.items() if i < size}
    inv_d = {i: tok for tok, i in vd.items() if i < size}
    diff = [i for i in inv_t.keys() & inv_d.keys() if inv_t[i] != inv_d[i]]
    missing = inv_t.keys() ^ inv_d.keys()
    if diff or missing:
        example = (diff or sorted(missing))[0]
        raise ValueError(
            f"draft and target tokenizers differ on {len(diff)} ids and {len(missing)} ids only one knows "
            f"(for example id {example}: {inv_t.get(example)!r} vs {inv_d.get(example)!r}); they cannot be aligned"
        )


def decoder_layers(model) -> nn.ModuleList:
    """The model's list of decoder blocks (the ModuleList with one entry per hidden layer)."""
    n = text_config(model).num_hidden_layers
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == n:
            return module
    raise ValueError(f"cannot find the {n} decoder layers of {type(model).__name__}")


def decoder_layer(model, layer: int) -> nn.Module:
    """Decoder block ``layer`` (Python indexing); a clear ValueError when the model has no such block."""
    layers = decoder_layers(model)
    if not -len(layers) <= layer < len(layers):
        raise ValueError(f"layer {layer} does not exist: the model has {len(layers)} decoder layers "
                         f"(use {-len(layers)} .. {len(layers) - 1})")
    return layers[layer]


class LayerCapture:
    """Forward hook that keeps the last ``keep`` positions of one decoder block's output.

    Only the latest forward's tail is kept, never every layer or the whole sequence.
    """

    def __init__(self, model, layer: int):
        self.keep = 1
        self.value: torch.Tensor | None = None  # [B, keep, H]
        self._handle = decoder_layer(model, layer).register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        hidden = output[0] if isinstance(output, (tuple, list)) else output
        self.value = hidden[:, -self.keep :]

    def remove(self) -> None:
        self._handle.remove()


def crop_cache(cache, length: int) -> None:
    """Drop cached positions beyond ``length`` (a DynamicCache's ``crop`` changed meaning in transformers 5)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra if _NEGATIVE_CROP else length)


# forward function -> the names of its parameters; inspect.signature is too slow for every forward.
_FORWARD_PARAMETERS: dict = {}


def _forward_parameters(model) -> frozenset:
    # The instance's forward when hooks replaced it (accelerate does), else the class's.
    forward = model.__dict__.get("forward", type(model).forward)
    key = getattr(forward, "__func__", forward)
    if key not in _FORWARD_PARAMETERS:
        _FORWARD_PARAMETERS[key] = frozenset(inspect.signature(model.forward).parameters)
    return _FORWARD_PARAMETERS[key]


def forward_tail(model, ids: torch.Tensor, keep: int, cache=None, **kwargs):
    """``model(ids, **kwargs)`` with logits for the last ``keep`` positions only (computed only there when
    the model takes ``logits_to_keep``). ``cache``: the KV cache to extend, under the argument name this
    transformers takes (``cache`` from 5.24, ``past_key_values`` before); read the extended one back with
    ``returned_cache``."""
    params = _forward_parameters(model)
    if "logits_to_keep" in params:
        kwargs["logits_to_keep"] = keep
    if cache is not None:
        kwargs["cache" if "cache" in params else "past_key_values"] = cache
    out = model(input_ids=ids, **kwargs)
    out.logits = out.logits[:, -keep:]
    return out


def returned_cache(out):
    """The KV cache a forward returned (``cache`` from transformers 5.24, ``past_key_values`` before)."""
    return out["cache"] if "cache" in out else out.past_key_values
