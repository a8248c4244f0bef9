import torch
import torch.nn as nn
import torch.nn.functional as F


def forward_fn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """A linear layer followed by ReLU."""
    return F.relu(F.linear(x, weight, bias))


class Model(nn.Module):
    """
    A linear layer followed by ReLU.
    """

    def __init__(self, input_size: int = 16, output_size: int = 8):
        super(Model, self).__init__()
        linear = nn.Linear(input_size, output_size)
        self.weight = nn.Parameter(linear.weight.data.clone())
        self.bias = nn.Parameter(linear.bias.data.clone())

    def forward(self, x, fn=forward_fn):
        return fn(x, self.weight, self.bias)


def get_inputs(batch_size: int = 4, input_size: int = 16):
    x = torch.randn(batch_size, input_size)
    return [x]


input_names = ["x"]
