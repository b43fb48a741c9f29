"""pad: Pivot-Aware Speculative Decoding for HuggingFace causal LMs."""
__version__ = "0.1.0"

from .attention import use_gqa_sdpa
from .classifier import PivotClassifier
from .generate import POLICIES, GenerationResult, generate
from .policy import Policy, parse_policy
from .stats import GenerationStats

__all__ = ["POLICIES", "GenerationResult", "GenerationStats", "PivotClassifier", "Policy", "generate", "parse_policy",
           "use_gqa_sdpa", "__version__"]
