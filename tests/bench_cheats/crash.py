"""Not a cheat, a crash: the process running this implementation exits in its first call."""
import os


def forward(x):
    os._exit(3)
