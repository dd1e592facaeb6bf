"""Serving runtime (docs/design.md §7): load an export and rank candidates with prefix caching.

Imports no training code: only torch, onnxruntime, safetensors, gr.hstu and gr.export's reader. Public
names load lazily, so the commands read the runtime's options (``gr.serving.options``) without it.
"""

from typing import TYPE_CHECKING

from gr.utils.lazy import lazy_getattr

if TYPE_CHECKING:
    from gr.serving.errors import RequestError as RequestError
    from gr.serving.errors import ScoringError as ScoringError
    from gr.serving.request import EventsRequest as EventsRequest
    from gr.serving.request import GenerateRequest as GenerateRequest
    from gr.serving.request import IdOptions as IdOptions
    from gr.serving.request import RankRequest as RankRequest
    from gr.serving.request import RecommendRequest as RecommendRequest
    from gr.serving.runtime import Ranker as Ranker
    from gr.serving.runtime import RankResult as RankResult
    from gr.serving.runtime import RecommendResult as RecommendResult
    from gr.serving.runtime import ServingModel as ServingModel
    from gr.serving.user_cache import UserCache as UserCache

_EXPORTS = {
    "EventsRequest": "gr.serving.request",
    "GenerateRequest": "gr.serving.request",
    "IdOptions": "gr.serving.request",
    "RankRequest": "gr.serving.request",
    "RankResult": "gr.serving.runtime",
    "Ranker": "gr.serving.runtime",
    "RecommendRequest": "gr.serving.request",
    "RecommendResult": "gr.serving.runtime",
    "RequestError": "gr.serving.errors",
    "ScoringError": "gr.serving.errors",
    "ServingModel": "gr.serving.runtime",
    "UserCache": "gr.serving.user_cache",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
