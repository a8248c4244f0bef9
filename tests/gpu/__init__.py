"""The GPU tests (marked gpu): a package, so that a test file here may share its name with one in
tests/ (tests/test_cuda_graphs.py, tests/gpu/test_cuda_graphs.py) under pytest's default imports."""
