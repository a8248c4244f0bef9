"""Tuning: the tuner (tuner.py) that gives each region of a CUDA executor its verified kernel,
the schedule search (search.py, over csrc/tune/evolve.c), the timing primitives the search and
the benchmark share (timing.py), and the persistent kernel cache (cache.py)."""
