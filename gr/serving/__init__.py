"""Serving runtime (docs/design.md §7): load an export and rank candidates with prefix caching.

Imports no training code: only torch, onnxruntime, safetensors, gr.hstu and gr.export's reader.
"""

from gr.serving.errors import RequestError, ScoringError
from gr.serving.request import GenerateRequest, IdOptions, RankRequest, RecommendRequest
from gr.serving.runtime import Ranker, RankResult, RecommendResult, ServingModel
from gr.serving.user_cache import UserCache

__all__ = [
    "GenerateRequest",
    "IdOptions",
    "RankRequest",
    "RankResult",
    "Ranker",
    "RecommendRequest",
    "RecommendResult",
    "RequestError",
    "ScoringError",
    "ServingModel",
    "UserCache",
]
