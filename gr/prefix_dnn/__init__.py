from gr.prefix_dnn.base import PrefixDNN, check_token_wise
from gr.prefix_dnn.mlp_encoder import MLPTokenEncoder, mlp

__all__ = ["MLPTokenEncoder", "PrefixDNN", "check_token_wise", "mlp"]
