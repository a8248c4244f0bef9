"""Bias+activation: bias add then Mish."""
import torch.nn.functional as F

from ._bias_act import BiasAct, bytes_moved, init_configs, input_configs, make_inputs, model_args  # noqa: F401


class Model(BiasAct):
    act = staticmethod(F.mish)
