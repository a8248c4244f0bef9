import torch
import a_module_that_does_not_exist  # noqa: F401


class Model(torch.nn.Module):
    """Its import fails."""
    def forward(self, x):
        return x


def get_inputs():
    return [torch.randn(4)]


def get_init_inputs():
    return []
