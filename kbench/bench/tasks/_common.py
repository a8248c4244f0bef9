"""Helpers shared by the task modules: seeded input distributions and parameter initialisers.
Every initialiser sets every parameter and floating buffer from the generator it is given, so a
(task, init config, seed) triple always builds the same model whatever the global RNG holds.
"""
from __future__ import annotations

import math

import torch

# Input value distributions (docs/DESIGN.md, "Verification"): the usual one, a positive one, a large and a tiny one,
# and "scaled": normal values with a random scale (0.5..3) and shift (N(0,1)) per row (per
# index of all but the last dim). Normalisation tasks use "scaled" by default: on unit-normal
# rows a norm is nearly the identity, so returning the input would pass in bfloat16.
DISTS = ("normal", "uniform", "large", "tiny", "scaled")


def rand(shape, dtype, device, gen, dist: str = "normal") -> torch.Tensor:
    """A random tensor drawn in float32 on `device` from `gen`, then cast to `dtype`."""
    if dist == "uniform":
        t = torch.rand(shape, generator=gen, device=device)
    else:
        t = torch.randn(shape, generator=gen, device=device)
        if dist == "large":
            t = t * 1e3
        elif dist == "tiny":
            t = t * 1e-3
        elif dist == "scaled":
            rows = tuple(shape[:-1]) + (1,)
            scale = torch.rand(rows, generator=gen, device=device) * 2.5 + 0.5
            t = t * scale + torch.randn(rows, generator=gen, device=device)
        elif dist != "normal":
            raise ValueError(f"unknown input distribution {dist!r}")
    return t.to(dtype)


def _is_scale(name: str) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    return leaf in ("weight", "gamma", "scale", "g")


def _normal(p, gen, mean=0.0, std=1.0):
    p.copy_(torch.randn(p.shape, generator=gen) * std + mean)


def init_random(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Matrices and conv filters uniform in ±1/sqrt(fan_in) (outputs stay O(1) through a
    GEMM); 1-D scales around 1, 1-D shifts around 0, both with spread 0.5 so that a kernel
    which drops them is visibly wrong; BatchNorm statistics away from 0 and 1 for the same
    reason."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                bound = 1.0 / math.sqrt(max(1, p[0].numel()))
                p.copy_((torch.rand(p.shape, generator=gen) * 2 - 1) * bound)
            elif _is_scale(name) and p.dim() == 1:
                _normal(p, gen, 1.0, 0.5)
            else:
                _normal(p, gen, 0.0, 0.5)
        for name, b in model.named_buffers():
            if not b.is_floating_point():
                continue
            if name.endswith("running_var"):
                b.copy_(torch.rand(b.shape, generator=gen) + 0.5)
            elif name.endswith("running_mean"):
                _normal(b, gen, 0.0, 0.5)


def init_ones_zeros(model: torch.nn.Module, gen: torch.Generator) -> None:
    """The structured init a freshly constructed model has: 1-D scales 1, shifts 0, running
    statistics (0, 1); matrices still random (all-ones matrices make degenerate outputs)."""
    init_random(model, gen)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 or (p.dim() >= 1 and p.numel() == p.shape[0]):
                p.fill_(1.0 if _is_scale(name) else 0.0)
        for name, b in model.named_buffers():
            if name.endswith("running_var"):
                b.fill_(1.0)
            elif name.endswith("running_mean"):
                b.zero_()


def init_none(model: torch.nn.Module, gen: torch.Generator) -> None:
    """For parameter-free tasks."""


# The two init configs of most tasks with parameters.
STANDARD_INITS = {"random": init_random, "ones_zeros": init_ones_zeros}
NO_PARAMS = {"none": init_none}


def shape_inputs(cfg, dtype, device, gen):
    """make_inputs for single-input tasks whose config gives `shape` (and maybe `dist`)."""
    return [rand(tuple(cfg["shape"]), dtype, device, gen, cfg.get("dist", "normal"))]


def scaled_inputs(cfg, dtype, device, gen):
    """shape_inputs with the "scaled" distribution by default (normalisation tasks)."""
    return [rand(tuple(cfg["shape"]), dtype, device, gen, cfg.get("dist", "scaled"))]


def last_dim(cfg) -> dict:
    """model_args for tasks whose parameters are sized by the input's last dim."""
    return {"H": cfg["shape"][-1]}
