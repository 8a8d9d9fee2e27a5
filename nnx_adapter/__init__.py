"""The NNX adapter: the one place Linen meets NNX."""

from nnx_adapter._adapter import Cache
from nnx_adapter._adapter import EagerToNNX
from nnx_adapter._adapter import Fp8State
from nnx_adapter._adapter import RuleState
from nnx_adapter._decoder import Decoder
from nnx_adapter._decoder import init_decoder
from nnx_adapter._decoder import linen_to_nnx
from nnx_adapter._decoder import nnx_to_linen
from nnx_adapter._decoding import decoding_model
from nnx_adapter._decoding import greedy_generate
from nnx_adapter._sharding import ShardedNNXTraining
from nnx_adapter._train import NNXFrontend
from nnx_adapter._train import TrainState
from nnx_adapter._train import accumulate_gradients
from nnx_adapter._train import apply_gradients
from nnx_adapter._train import decoder_loss
from nnx_adapter._train import init_train_state
from nnx_adapter._train import make_train_step
from nnx_adapter._train import train_step

__all__ = [
    "Cache",
    "Decoder",
    "EagerToNNX",
    "Fp8State",
    "NNXFrontend",
    "RuleState",
    "ShardedNNXTraining",
    "TrainState",
    "accumulate_gradients",
    "apply_gradients",
    "decoder_loss",
    "decoding_model",
    "init_decoder",
    "greedy_generate",
    "init_train_state",
    "linen_to_nnx",
    "make_train_step",
    "nnx_to_linen",
    "train_step",
]
