from gr.postfix_dnn.base import PostfixDNN
from gr.postfix_dnn.mmoe import MMoERankingHead
from gr.postfix_dnn.retrieval import RetrievalHead

__all__ = ["MMoERankingHead", "PostfixDNN", "RetrievalHead"]
