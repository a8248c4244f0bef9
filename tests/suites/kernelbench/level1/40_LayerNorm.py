import torch
import torch.nn as nn


class Model(nn.Module):
    """
    Simple model that performs Layer Normalization.
    """
    def __init__(self, normalized_shape: tuple):
        super(Model, self).__init__()
        self.ln = nn.LayerNorm(normalized_shape=normalized_shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(x)


batch_size = 6
features = 4
dim1 = 8
dim2 = 5


def get_inputs():
    x = torch.randn(batch_size, features, dim1, dim2) * 2 + 0.5
    return [x]


def get_init_inputs():
    return [(features, dim1, dim2)]
