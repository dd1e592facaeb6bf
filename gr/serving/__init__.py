"""Serving runtime (DESIGN §7): load an export and rank candidates with prefix caching.

Imports no training code: only torch, onnxruntime, safetensors, gr.hstu and gr.export's reader.
"""
from gr.serving.errors import RequestError
from gr.serving.request import RankRequest
from gr.serving.runtime import Ranker, RankResult, ServingModel
from gr.serving.user_cache import UserCache

__all__ = ["RankRequest", "RankResult", "Ranker", "RequestError", "ServingModel", "UserCache"]
