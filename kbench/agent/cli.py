"""python -m kbench agent TASK: the agentic loop (loop.py) from the command line, on a kbench task
or a public suite's (--suite), with kbench's own proposer and, given an endpoint, an LLM's."""
from __future__ import annotations

import argparse
import functools
import sys

from . import llm, loop


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kbench agent", description=__doc__.splitlines()[0])
    p.add_argument("task", help="a kbench task name, or a task of the suite at --suite")
    p.add_argument("--suite", help="a KernelBench or robust-kbench path (see python -m kbench bench --suite)")
    p.add_argument("--generations", type=int, default=3)
    p.add_argument("--per-call", type=int, default=4, help="proposals asked of an LLM per generation")
    p.add_argument("--seconds", type=float, help="stop after the generation that passes this")
    p.add_argument("--device", help="cuda (default when available) or cpu")
    p.add_argument("--dtype", help="default: the task's first dtype")
    p.add_argument("--budget", default="quick", help="the harness's budget (quick, default, full)")
    p.add_argument("--out", default="agent-out", help="candidates and record.jsonl (resumable)")
    p.add_argument("--no-kbench", action="store_true", help="without kbench's own proposer")
    p.add_argument("--endpoint", help="an OpenAI-compatible base URL, e.g. http://localhost:8000/v1")
    p.add_argument("--model", help="the endpoint's model name")
    p.add_argument("--api-key-env", default="OPENAI_API_KEY", help="the variable holding the API key")
    p.add_argument("--llm-verify", action="store_true",
                   help="ask the endpoint's model to review each proposal before the GPU (its FAIL refuses it)")
    p.add_argument("--audit-soft", action="store_true",
                   help="score what the soft verifier refuses too, and report how it did against the harness")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    proposers = [] if args.no_kbench else [loop.KbenchProposer()]
    verifier = None
    if args.llm_verify and not args.endpoint:
        print("error: --llm-verify needs --endpoint and --model", file=sys.stderr)
        return 2
    if args.endpoint:
        if not args.model:
            print("error: --endpoint needs --model", file=sys.stderr)
            return 2
        endpoint = llm.Endpoint(args.endpoint, args.model, api_key_env=args.api_key_env)
        import torch
        on = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
        proposers.append(llm.OpenAIProposer(endpoint, **({"gpu": torch.cuda.get_device_name()} if on else {})))
        if args.llm_verify:
            verifier = functools.partial(llm.llm_verify, endpoint)
    if not proposers:
        print("error: no proposer: drop --no-kbench or give --endpoint and --model", file=sys.stderr)
        return 2
    from ..bench import suites
    from ..bench.tasks import TASKS
    try:
        pool = {t.name: t for t in suites.load(args.suite)} if args.suite else TASKS
        task = pool[args.task]
    except KeyError:
        print(f"error: no task {args.task!r}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import torch
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    got = loop.run(task, proposers, generations=args.generations, per_call=args.per_call, device=device,
                   dtype=args.dtype, out_dir=args.out, budget=args.budget, seconds=args.seconds,
                   progress=lambda line: print(line, file=sys.stderr, flush=True), audit_soft=args.audit_soft,
                   verifier=verifier)
    if args.audit_soft:
        r = got["soft"]
        print(f"soft verification against the harness, over {r['scored']} scored: stopped {r['stopped_wrong']} "
              f"wrong, refused {r['rejected_right']} right, let {r['missed_wrong']} wrong through")
        if "llm" in r:
            v = r["llm"]
            print(f"the LLM verifier, over {v['judged']} it judged: stopped {v['stopped_wrong']} wrong, refused "
                  f"{v['rejected_right']} right, let {v['missed_wrong']} wrong through")
    best = got["best"]
    print(f"{len(got['candidates'])} candidates; best: " +
          (f"{best.proposer} {best.spec} at {best.speedup:.2f}x eager" if best else "none passed"))
    return 0 if best else 1
