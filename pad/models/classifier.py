"""The pivot classifier: a tiny MLP over what the target's verification pass already computed."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from pad_kernels import FEATURE_NAMES, FoldedClassifier

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
FORMAT = "pad-pivot-classifier"
FORMAT_VERSION = 1
KINDS = ("mlp", "linear")
# Features a classifier may read after FEATURE_NAMES (``pad-decoding train --features``, or ``--compare-feature``
# to measure what they add). The source features say where a draft token came from (``pad.pivots.search``
# records; ``source_features`` in decoding): from a lookup, from a suffix match (both 0: the draft model), the
# match's length and the token's place in its proposal (-1: the model's). The op does not compute them: the
# decode folds them through the first layer into its per-position ``classifier_bias`` (``source_bias``). The
# divergence is computed by the op but not fed to its classifier: a classifier reading it does not fold.
SOURCE_FEATURES = ("from_lookup", "from_suffix", "match", "offset")
CANDIDATE_FEATURES = ("divergence", *SOURCE_FEATURES)


class PivotClassifier(nn.Module):
    """Scores how likely a draft token is a pivot (taking it makes the final answer worse).

    Inputs per draft token: the target hidden state ``h`` [H] at decoder layer ``layer`` (Python
    indexing over the decoder blocks: -8 is the eighth block from the top; the block's output is used)
    and the features ``f`` [F] = (``p_target(token)``, entropy of ``p_target``). Both are first
    standardized with the buffers ``input_mean`` / ``input_scale`` [H + F] (set by training).
    ``kind="mlp"``: ``h -> Linear(H, 64)``, ``f -> Linear(F, 16)``, concat -> ``Linear(80, 128) -> ReLU ->
    Linear(128, 2)``; logit 1 is the pivot class, so ``pivot_prob = softmax(logits)[1]``.
    ``kind="linear"``: logistic regression, ``pivot_prob = sigmoid(Linear(H + F, 1)([h; f]))`` (logits
    ``[0, score]``). Both fold exactly into the op's one-hidden-layer form (``fold``).
    """

    def __init__(
        self,
        hidden_size: int,
        *,
        layer: int = -8,
        feature_names=FEATURE_NAMES,
        hidden_dim: int = 64,
        feature_dim: int = 16,
        mlp_dim: int = 128,
        target_model: str | None = None,
        draft_model: str | None = None,
        weights: dict | None = None,
        kind: str = "mlp",
    ):
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"unknown classifier kind {kind!r}; choose one of {', '.join(KINDS)}")
        extra = tuple(feature_names)[len(FEATURE_NAMES):]
        if tuple(feature_names)[: len(FEATURE_NAMES)] != FEATURE_NAMES or not set(extra) <= set(CANDIDATE_FEATURES):
            raise ValueError(f"feature_names must be {FEATURE_NAMES} (what the verification op computes), followed by "
                             f"candidate features among {CANDIDATE_FEATURES}, got {feature_names}")
        if hidden_size < 1:
            raise ValueError(f"hidden_size must be >= 1, got {hidden_size}")
        self.hidden_size = int(hidden_size)
        self.layer = int(layer)
        self.feature_names = tuple(feature_names)
        self.target_model = target_model
        self.draft_model = draft_model
        # {"target": identity, "draft": identity} of the weights its labels were made with (see
        # pad.models.registry.weights_identity); None when unknown.
        self.weights = dict(weights) if weights else None
        self.kind = kind
        num_features = len(self.feature_names)
        if kind == "linear":
            self.linear = nn.Linear(hidden_size + num_features, 1)
        else:
            self.hidden_proj = nn.Linear(hidden_size, hidden_dim)
            self.feature_proj = nn.Linear(num_features, feature_dim)
            self.mlp = nn.Sequential(nn.Linear(hidden_dim + feature_dim, mlp_dim), nn.ReLU(), nn.Linear(mlp_dim, 2))
        self.register_buffer("input_mean", torch.zeros(hidden_size + num_features))
        self.register_buffer("input_scale", torch.ones(hidden_size + num_features))

    @property
    def config(self) -> dict:
        from pad import __version__

        # A config without "kind" is an MLP (the only kind of the first classifiers).
        dims = {} if self.kind == "linear" else {
            "hidden_dim": self.hidden_proj.out_features,
            "feature_dim": self.feature_proj.out_features,
            "mlp_dim": self.mlp[0].out_features,
        }
        return {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            **({"kind": self.kind} if self.kind != "mlp" else {}),
            "hidden_size": self.hidden_size,
            "layer": self.layer,
            "feature_names": list(self.feature_names),
            **dims,
            "target_model": self.target_model,
            "draft_model": self.draft_model,
            "weights": self.weights,
            "pad_version": __version__,
        }

    def forward(self, hidden: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """hidden [..., H], features [..., F] -> logits [..., 2] (index 1: pivot)."""
        x = (torch.cat([hidden, features], -1).to(self.input_mean.dtype) - self.input_mean) / self.input_scale
        if self.kind == "linear":
            score = self.linear(x)
            return torch.cat([torch.zeros_like(score), score], -1)
        h, f = x.split([self.hidden_size, len(self.feature_names)], -1)
        return self.mlp(torch.cat([self.hidden_proj(h), self.feature_proj(f)], -1))

    def pivot_prob(self, hidden: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """hidden [..., H], features [..., F] -> probability of the pivot class [...]."""
        return torch.softmax(self(hidden, features), -1)[..., 1]

    @property
    def source_names(self) -> tuple[str, ...]:
        """The source features it reads (``SOURCE_FEATURES``, in its order after ``FEATURE_NAMES``)."""
        return tuple(n for n in self.feature_names if n in SOURCE_FEATURES)

    def fold(self) -> FoldedClassifier:
        """Fold standardization and the three linear maps before the ReLU into one ``Linear(H + F, D)``.
        The first layer's columns of source features fold apart (``source_bias``); a classifier reading the
        divergence does not fold (the op does not feed it to the classifier).

        The two output logits fold into one score ``logit_pivot - logit_other``, so ``sigmoid(score)``
        equals ``softmax(logits)[1]``. Computed in fp64, returned as fp32 on the module's device. The result
        is kept until a weight changes (each tensor's version counter), so decoding many prompts folds once.
        """
        return self._folded()[0]

    def source_bias(self, sources: torch.Tensor) -> torch.Tensor:
        """sources [..., S] (``source_names``' values per draft position) -> [..., D], the first layer's share
        of them: ``verify_block``'s ``classifier_bias`` with ``fold()``, so that the op's pivot probability is
        this classifier's."""
        weights = self._folded()[1]
        if weights is None or sources.shape[-1] != weights.shape[0]:
            raise ValueError(f"this classifier reads the source features {self.source_names}: sources must be "
                             f"[..., {len(self.source_names)}], got {tuple(sources.shape)}")
        return sources.to(weights) @ weights

    def _folded(self) -> tuple[FoldedClassifier, torch.Tensor | None]:
        extra = [n for n in self.feature_names[len(FEATURE_NAMES):] if n not in SOURCE_FEATURES]
        if extra:
            raise ValueError(f"this classifier reads {tuple(extra)}, which verify_block does not give the "
                             f"classifier: it can be cross-validated, not decoded with")
        state = [*self.parameters(), *self.buffers()]
        key = tuple((t.data_ptr(), t._version, t.device) for t in state)
        cached = self.__dict__.get("_folded_cache")
        if cached is None or cached[0] != key:
            cached = (key, self._fold())
            self.__dict__["_folded_cache"] = cached
        return cached[1]

    @torch.no_grad()
    def _fold(self) -> tuple[FoldedClassifier, torch.Tensor | None]:
        """(the op's classifier, the source features' first-layer weights [S, D] or None), from the
        first layer over all inputs, W [D, H + F + S] and b [D]."""
        if self.kind == "linear":
            # score = relu(s) - relu(-s) with s = w . x + b: W = [w, -w], b1 = [b, -b], w2 = [1, -1].
            w = self.linear.weight[0].double() / self.input_scale.double()
            b = self.linear.bias[0].double() - w @ self.input_mean.double()
            one = torch.ones((), dtype=torch.float64, device=w.device)
            w, b, w2, b2 = torch.stack([w, -w]), torch.stack([b, -b]), torch.stack([one, -one]), 0 * one
        else:
            first, out = self.mlp[0], self.mlp[2]
            wm = first.weight.double()  # [D, 64 + 16]
            wm_h, wm_f = wm[:, : self.hidden_proj.out_features], wm[:, self.hidden_proj.out_features :]
            w = torch.cat([wm_h @ self.hidden_proj.weight.double(), wm_f @ self.feature_proj.weight.double()], 1)
            b = wm_h @ self.hidden_proj.bias.double() + wm_f @ self.feature_proj.bias.double() + first.bias.double()
            # Standardization: W ((x - mean) / scale) = (W / scale) x - (W / scale) mean.
            w = w / self.input_scale.double()
            b = b - w @ self.input_mean.double()
            w2 = out.weight[1].double() - out.weight[0].double()
            b2 = out.bias[1].double() - out.bias[0].double()
        op = self.hidden_size + len(FEATURE_NAMES)
        folded = FoldedClassifier(*(t.float() for t in (w[:, :op].t().contiguous(), b, w2, b2)))
        return folded, (w[:, op:].t().float().contiguous() if self.source_names else None)

    def check_target(self, model) -> None:
        """Raise ValueError if this classifier cannot read ``model``'s hidden states."""
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        if cfg.hidden_size != self.hidden_size:
            raise ValueError(
                f"classifier expects target hidden size {self.hidden_size}, but the target has {cfg.hidden_size}"
                f" (trained for target {self.target_model!r})"
            )
        n = cfg.num_hidden_layers
        if not -n <= self.layer < n:
            raise ValueError(f"classifier reads decoder layer {self.layer}, but the target has {n} layers")

    def check_pair(self, target_name: str | None, draft_name: str | None, weights: dict | None = None) -> None:
        """Raise ValueError if this classifier was trained for other models than the names given, or, with
        ``weights`` ({"target": identity, "draft": identity}), for other weights of them.

        Names compare by their last path component, case-insensitively, so that a registry name, a hub id
        and a local folder of the same model agree; a classifier without recorded names accepts any.
        """
        from ..models.registry import check_weights

        check_weights(self.weights or {}, weights or {}, "this classifier's training data")
        for role, mine, given in (("target", self.target_model, target_name), ("draft", self.draft_model, draft_name)):
            if mine and given and _model_key(mine) != _model_key(given):
                raise ValueError(
                    f"this classifier was trained for target {self.target_model!r} and draft {self.draft_model!r}, "
                    f"but the {role} is {given!r}; train one for this pair (pad-decoding label, then train)"
                )

    def checksum(self) -> str:
        """A short SHA-256 of the config and weights: which classifier produced a benchmark row."""
        import hashlib

        # The weights' identity is recorded beside the checksum wherever both matter, so the checksum of a
        # classifier stays the same when that metadata is added.
        h = hashlib.sha256(json.dumps({k: v for k, v in self.config.items() if k not in ("pad_version", "weights")},
                                      sort_keys=True).encode())
        for name, tensor in sorted(self.state_dict().items()):
            h.update(name.encode())
            h.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()[:16]

    def save(self, directory: str | os.PathLike) -> Path:
        """Write ``config.json`` and ``model.safetensors`` into ``directory`` (created if missing)."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(directory / WEIGHTS_NAME), metadata={"format": FORMAT})
        (directory / CONFIG_NAME).write_text(json.dumps(self.config, indent=2) + "\n")
        return directory

    @classmethod
    def load(cls, directory: str | os.PathLike, map_location: str | torch.device = "cpu") -> "PivotClassifier":
        """Load a classifier saved by ``save``; raises a clear error for a missing or corrupted folder."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        directory = Path(directory)
        for name in (CONFIG_NAME, WEIGHTS_NAME):
            if not (directory / name).is_file():
                raise FileNotFoundError(f"{directory} is not a pad classifier folder: {name} is missing")
        try:
            config = json.loads((directory / CONFIG_NAME).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"corrupted classifier config {directory / CONFIG_NAME}: {e}") from None
        if not isinstance(config, dict) or config.get("format") != FORMAT:
            raise ValueError(f"{directory / CONFIG_NAME} is not a pad classifier config (format {FORMAT!r})")
        if config.get("version") != FORMAT_VERSION:
            raise ValueError(f"classifier format version {config.get('version')} is not supported (expected {FORMAT_VERSION})")
        try:
            kind = config.get("kind", "mlp")
            dims = {} if kind == "linear" else {k: config[k] for k in ("hidden_dim", "feature_dim", "mlp_dim")}
            model = cls(
                config["hidden_size"],
                layer=config["layer"],
                feature_names=config["feature_names"],
                kind=kind,
                **dims,
                target_model=config.get("target_model"),
                draft_model=config.get("draft_model"),
                weights=config.get("weights"),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"corrupted classifier config {directory / CONFIG_NAME}: missing or bad field {e}") from None
        try:
            state = load_file(str(directory / WEIGHTS_NAME), device=str(map_location))
        except (SafetensorError, OSError, ValueError) as e:
            raise ValueError(f"corrupted classifier weights {directory / WEIGHTS_NAME}: {e}") from None
        expected = model.state_dict()
        if set(state) != set(expected) or any(state[k].shape != expected[k].shape for k in expected):
            raise ValueError(f"classifier weights {directory / WEIGHTS_NAME} do not match its config")
        if not all(torch.isfinite(t).all() for t in state.values()):
            raise ValueError(f"classifier weights {directory / WEIGHTS_NAME} hold non-finite values")
        model.load_state_dict(state)
        return model.to(map_location).eval()


def _model_key(name: str) -> str:
    return str(name).rstrip("/\\").replace("\\", "/").rsplit("/", 1)[-1].lower()
