"""pad: Pivot-Aware Speculative Decoding for HuggingFace causal LMs."""
__version__ = "0.1.0"

from .decoding.attention import use_gqa_sdpa
from .decoding.fast_draft import use_fast_draft
from .decoding.generate import POLICIES, GenerationResult, generate
from .decoding.int8 import use_int8_weights
from .decoding.onednn import use_onednn_linear
from .decoding.policy import Policy, parse_policy
from .decoding.stats import GenerationStats
from .models.classifier import PivotClassifier

__all__ = ["POLICIES", "GenerationResult", "GenerationStats", "PivotClassifier", "Policy", "generate", "parse_policy",
           "use_fast_draft", "use_gqa_sdpa", "use_int8_weights", "use_onednn_linear", "__version__"]
