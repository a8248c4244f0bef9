"""An honest implementation (softmax over the last dim, the kernel-file contract)."""
import torch


def forward(x):
    return torch.softmax(x, -1)
