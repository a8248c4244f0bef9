"""The agentic loop's parts (issue: pluggable proposers, soft verification): so far the soft
verifier, which judges a CUDA source before anything of it runs on a GPU (soft.py)."""
