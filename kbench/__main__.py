"""python -m kbench {info,bench,cache,agent}: what kbench sees on this machine, the robust benchmark,
the persistent kernel cache, and the agentic loop."""
from __future__ import annotations

import argparse
import sys


def info() -> int:
    import torch

    import kbench
    from kbench.runtime import nvrtc

    print(f"kbench {kbench.__version__} (core {kbench._C.CORE_VERSION})")
    print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
    if torch.cuda.is_available():
        print(f"GPU: {torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))})")
    try:
        path, version = nvrtc.info()
        print(f"NVRTC {version // 1000}.{version % 1000 // 10}: {path}")
    except FileNotFoundError as e:
        print(f"NVRTC: not found ({e})")
    print(f"CUBIN cache: {nvrtc.cache_dir()}")
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m kbench", description=__doc__)
    parser.add_argument("command", choices=["info", "bench", "cache", "agent"],
                        help="info: versions, GPU, NVRTC; bench: the benchmark; cache: ls, clear, export, info; "
                             "agent: the agentic loop on a task")
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "info":
        return info()
    if command == "bench":
        from kbench.bench.cli import main as bench_main
        return bench_main(rest)
    if command == "cache":
        from kbench.tune.cache import cli_main
        return cli_main(rest)
    if command == "agent":
        from kbench.agent.cli import main as agent_main
        return agent_main(rest)
    parser.parse_args([command])
    return 2


if __name__ == "__main__":
    sys.exit(main())
