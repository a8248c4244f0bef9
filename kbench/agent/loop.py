"""The agentic loop: generations of proposals -> soft verification -> the robust harness
(hardware verification and timing; files run in its worker processes) -> selection. The best
verified implementations (with their roofline fractions) and the last generation's feedback
(each passing candidate's speedup, roofline fraction and profile; failures, soft findings) go
into the next generation's prompts. Every candidate is one line of a JSONL record, which also makes a
run resumable: a candidate already in the record is not scored again."""
from __future__ import annotations

import ast
import contextlib
import dataclasses
import hashlib
import inspect
import json
import os
import time

from . import soft
from .llm import Proposal


class KbenchProposer:
    """kbench's own generator: captured regions, genomes, the search's mutation and crossover,
    proposed as kbench.optimize at a larger search budget each generation (the evolution over
    genomes runs inside it), so the loop runs end to end with no LLM."""
    name = "kbench"
    BUDGETS = ("fast", "default", "max")

    def __init__(self):
        self.asked = 0

    def propose(self, task_code: str, best=(), feedback=(), n: int = 1) -> list[Proposal]:
        if self.asked >= len(self.BUDGETS):
            return []
        budget = self.BUDGETS[self.asked]
        self.asked += 1
        return [Proposal(None, proposer=self.name, spec=f"kbench:{budget}")]


@dataclasses.dataclass
class Candidate:
    key: str                # sha256 of the proposal (its source, or its built-in spec)
    proposer: str
    generation: int
    spec: str               # "kbench:<budget>" or the implementation file scored
    status: str             # PASS, FAIL, ERROR (the harness's), SOFT (refused before the GPU), NONE
    speedup: float | None = None     # over eager, at the timed configs
    ms: float | None = None
    feedback: str = ""      # the first failure, finding or error: what the next prompt hears
    source: str | None = None
    soft: str = ""          # the soft verifier's fatal findings ("" where it found none)
    llm: str = ""           # the LLM verifier's verdict: "PASS: reasons", "FAIL: reasons", "none: why"
    roofline: float | None = None    # the fraction of the roofline reached at the first timed config
    profile: dict | str | None = None   # harness row's "profile": a summary or "profile unavailable: why"


def cuda_in(source: str, suffix: str) -> list[str]:
    """The CUDA sources of an implementation: the file itself (.cu), or a Python file's string
    literals that define kernels (load_inline), found by parsing, never by running it."""
    if suffix != ".py":
        return [source]
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and "__global__" in n.value]


def proposal_key(prop: Proposal) -> str:
    """A proposal's identity in the record: its source (or built-in spec) and file kind."""
    what = prop.source if prop.source is not None else prop.spec
    return hashlib.sha256(f"{prop.suffix}\0{what}".encode()).hexdigest()


def _impl_ms(row: dict, name: str):
    for t in row.get("timings", []):
        e = t.get("impls", {}).get(name) or {}
        if e.get("median_ms") is not None:
            return e["median_ms"]
    return None


def _impl_roofline(row: dict, name: str):
    for t in row.get("timings", []):
        frac = ((t.get("impls", {}).get(name) or {}).get("roofline") or {}).get("fraction")
        if frac is not None:
            return frac
    return None


PROFILE_TEXT_CHARS = 400


def profile_text(p) -> str:
    """A profile summary (harness.profile_row) as a few lines for a prompt, at most
    PROFILE_TEXT_CHARS characters; "" where there is none."""
    if not p:
        return ""
    if isinstance(p, str):
        return p[:PROFILE_TEXT_CHARS]
    what = "kernels" if p.get("device") == "cuda" else "ops"
    head = (f"profile at {p.get('config', '?')}: {p.get('launches', 0)} "
            f"{'launches' if what == 'kernels' else 'op calls'}, {p.get('device_ms', 0.0):.4g} ms "
            f"{'on the device' if what == 'kernels' else 'in ops'}, {p.get('host_ms', 0.0):.4g} ms host time")
    top = "; ".join(f"{t['name'][:60]} {t['self_ms']:.4g} ms x{t['count']}" for t in p.get("top", []))
    return (head + (f"\n  top {what} by self time: {top}" if top else ""))[:PROFILE_TEXT_CHARS]


def passing_feedback(c: Candidate) -> str:
    """What the next prompt hears of a passing candidate: speedup, roofline fraction, profile."""
    parts = [f"a {c.proposer} candidate: PASS"]
    if c.speedup is not None:
        parts.append(f"{c.speedup:.2f}x eager")
    if c.roofline is not None:
        parts.append(f"{c.roofline:.0%} of the roofline")
    prof = profile_text(c.profile)
    return ", ".join(parts) + (f"\n  {prof}" if prof else "")


def evaluate(task, prop: Proposal, generation: int, env, *, dtype: str, out_dir: str,
             audit_soft: bool = False, verifier=None, task_code: str = "") -> Candidate:
    """One proposal through soft verification and the harness. audit_soft: a proposal the soft
    verifier refuses is scored anyway (its status is then the harness's), to measure the verifier.
    verifier: (task_code, source) -> (True | False | None, reasons), the LLM verifier (llm_verify
    on an endpoint): its FAIL refuses a proposal before the GPU as the static checks do; no
    verdict (the endpoint failed, or answered neither) never blocks one."""
    from ..bench import harness, impls
    key = proposal_key(prop)
    cand = Candidate(key, prop.proposer, generation, prop.spec, "NONE", source=prop.source)
    if prop.source is None and not prop.spec:
        cand.feedback = prop.error or "no proposal"
        return cand
    if prop.source is not None:
        findings = [f for src in cuda_in(prop.source, prop.suffix) for f in soft.analyze(src) if f.fatal]
        if findings:
            cand.soft = "; ".join(f"{f.kind} in {f.where}: {f.detail}" for f in findings)
            cand.status, cand.feedback = "SOFT", cand.soft
            if not audit_soft:
                return cand
        if verifier is not None:
            ok, reasons = verifier(task_code, prop.source)
            cand.llm = ("PASS" if ok else "FAIL" if ok is False else "none") + (f": {reasons[:300]}" if reasons else "")
            if ok is False and not cand.soft:
                cand.status, cand.feedback = "SOFT", f"the LLM verifier: {cand.llm}"
                if not audit_soft:
                    return cand
        os.makedirs(out_dir, exist_ok=True)
        cand.spec = os.path.join(out_dir, f"cand-{key[:16]}{prop.suffix}")
        with open(cand.spec, "w") as f:
            f.write(prop.source)
        name, factory = os.path.basename(cand.spec), cand.spec
    else:
        builtin, _, budget = prop.spec.partition(":")
        name, factory = impls.resolve(builtin, budget=budget or None)
    try:
        row = harness.score(task, name, factory, dtype=dtype, backward=False, env=env, baselines=("eager",),
                            profile=True)
    except Exception as e:  # noqa: BLE001 - a harness error is this candidate's, the loop goes on
        cand.status, cand.feedback = "ERROR", f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        return cand
    cand.status = row["status"]
    cand.speedup, cand.ms = row.get("speedup_vs_eager"), _impl_ms(row, name)
    cand.roofline, cand.profile = _impl_roofline(row, name), row.get("profile")
    refused = cand.soft or (f"the LLM verifier: {cand.llm}" if cand.llm.startswith("FAIL") else "")
    cand.feedback = refused or ((row["failures"] or row["task_problems"] or row["flags"] or [""])[0])[:300]
    return cand


def soft_report(cands) -> dict:
    """How the soft verifier did against the harness, over candidates scored by both (a run with
    audit_soft): wrong ones it stopped before the GPU, right ones it refused, wrong ones it let
    through (the harness caught them)."""
    both = [c for c in cands if c.status in ("PASS", "FAIL")]
    out = {"scored": len(both),
           "stopped_wrong": sum(1 for c in both if c.soft and c.status == "FAIL"),
           "rejected_right": sum(1 for c in both if c.soft and c.status == "PASS"),
           "missed_wrong": sum(1 for c in both if not c.soft and c.status == "FAIL")}
    judged = [c for c in both if (c.llm or "").startswith(("PASS", "FAIL"))]
    if judged:   # the LLM verifier, where it gave verdicts, on the same terms
        out["llm"] = {"judged": len(judged),
                      "stopped_wrong": sum(1 for c in judged if c.llm.startswith("FAIL") and c.status == "FAIL"),
                      "rejected_right": sum(1 for c in judged if c.llm.startswith("FAIL") and c.status == "PASS"),
                      "missed_wrong": sum(1 for c in judged if c.llm.startswith("PASS") and c.status == "FAIL")}
    return out


def _load_record(path: str | None) -> dict:
    done = {}
    if path and os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    d = json.loads(line)
                    done[d["key"]] = Candidate(**{k: d.get(k) for k in Candidate.__dataclass_fields__})
                except (ValueError, KeyError, TypeError):
                    continue   # a line cut by an interrupted run
    return done


def _keep_prompts(entries, generation: int, task_name: str, said, cache) -> None:
    """An LLM proposer's prompts and replies (its record: the key is never in it) into
    prompts.jsonl beside the record and into kbench's cache, each once."""
    kept = []
    for e in entries:
        body = dict(e, kind="agent_prompt", generation=generation)
        body["key"] = "prompt:" + hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()
        said.write(json.dumps(body, default=str) + "\n")
        kept.append(body)
    said.flush()
    cache.record_agent(task_name, kept)


def run(task, proposers, *, generations: int = 3, per_call: int = 4, device: str = "cpu", dtype: str | None = None,
        out_dir: str = "agent-out", budget: str = "quick", record_path: str | None = None,
        seconds: float | None = None, progress=None, audit_soft: bool = False, cache_path: str | None = None,
        verifier=None) -> dict:
    """Runs the loop on a bench Task. Returns {"best": the fastest PASS Candidate or None,
    "candidates": every Candidate, "soft": soft_report}; the record (JSONL) at record_path, by
    default in out_dir, and each new candidate in kbench's cache too (cache_path, default the
    user's; `python -m kbench cache export` writes it out with the search record). audit_soft:
    score what the soft verifier refuses too (see soft_report). verifier: the LLM verifier (see
    evaluate)."""
    from ..bench import harness
    from ..tune.cache import open_cache
    record_path = record_path or os.path.join(out_dir, "record.jsonl")
    os.makedirs(os.path.dirname(record_path) or ".", exist_ok=True)
    done = _load_record(record_path)
    try:
        task_code = inspect.getsource(task.module)
    except (TypeError, OSError):
        task_code = f"# task {task.name}: {task.description}"
    dtype = dtype or task.dtypes[0]
    t0, cands, best, feedback = time.monotonic(), [], [], []
    prompts_path = os.path.join(os.path.dirname(record_path) or ".", "prompts.jsonl")
    with harness.Env(device, budget) as env, open(record_path, "a") as rec, open(prompts_path, "a") as said, \
            contextlib.closing(open_cache(cache_path)) as cache:
        for g in range(generations):
            proposals = []
            for p in proposers:
                asked = len(getattr(p, "record", ()))
                try:
                    shown = [(c.source or c.spec, c.ms or 0.0, c.roofline) for c in best]
                    proposals += p.propose(task_code, best=shown, feedback=feedback, n=per_call)
                except Exception as e:  # noqa: BLE001 - a proposer that fails: the others go on
                    proposals.append(Proposal(None, f"proposer failed: {type(e).__name__}: {e}",
                                              proposer=getattr(p, "name", "?")))
                _keep_prompts(getattr(p, "record", [])[asked:], g, task.name, said, cache)
            feedback, failed = [], []
            for prop in proposals:
                cand = done.get(proposal_key(prop)) if prop.source is not None or prop.spec else None
                if cand is None:
                    cand = evaluate(task, prop, g, env, dtype=dtype, out_dir=out_dir, audit_soft=audit_soft,
                                    verifier=verifier, task_code=task_code)
                    rec.write(json.dumps(dataclasses.asdict(cand)) + "\n")
                    rec.flush()
                    cache.record_agent(task.name, [dataclasses.asdict(cand)])
                    done[cand.key] = cand
                cands.append(cand)
                if cand.status == "PASS":
                    feedback.append(passing_feedback(cand))
                elif cand.feedback:
                    failed.append(f"a {cand.proposer} candidate: {cand.status}: {cand.feedback}")
                if progress:
                    progress(f"generation {g}: {cand.proposer} {cand.status} "
                             f"{'' if cand.speedup is None else f'{cand.speedup:.2f}x eager'}")
            feedback += failed   # the passing first: the prompt keeps the first twenty
            passed = {c.key: c for c in cands if c.status == "PASS" and c.speedup is not None}
            best = sorted(passed.values(), key=lambda c: -c.speedup)[:3]
            if seconds is not None and time.monotonic() - t0 > seconds:
                break
    return {"best": best[0] if best else None, "candidates": cands, "soft": soft_report(cands)}
