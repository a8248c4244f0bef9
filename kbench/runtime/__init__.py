"""The runtime: a captured graph run region by region (plan.py), each compute region through a
backend (interp.py: the C interpreter; cuda.py: generated kernels), EXTERN regions and values
between regions through torch (torch_eval.py), wrapped as autograd nodes (autograd.py, and
joint.py for a loss whose gradients come from its forward) inside the OptimizedModule
(module.py) that replaces the user's model; fast.py loads the C++ hot path, nvrtc.py finds and
runs NVRTC."""
