"""The agentic loop (kbench/agent/loop.py) end to end on the CPU: kbench's own proposer and an
LLM proposer against a local chat-completions test double (tests/test_llm_endpoint.py's),
through soft verification and the robust harness. A right proposal passes and is the best; a
wrong one fails the harness; one with a shared-memory race is refused before anything runs;
the next generation's prompt carries the best source with its roofline fraction, each passing
candidate's speedup and profile, and the failures; a second run resumes from the record without
scoring anything again."""
import json

import torch

from kbench.agent import llm, loop
from kbench.bench.tasks import TASKS
from test_llm_endpoint import answer, endpoint, server  # noqa: F401 - the fixture

RIGHT = "```python\nimport torch\n\ndef make(model, example_inputs):\n    return lambda x: torch.softmax(x, dim=-1)\n```"
WRONG = "```python\ndef make(model, example_inputs):\n    return lambda x: x * 1.0\n```"
RACY = """```cuda
#include <torch/extension.h>
__global__ void k(float *y, const float *x) {
    __shared__ float m[1];
    if (threadIdx.x == 0) m[0] = x[0];
    y[threadIdx.x] = x[threadIdx.x] - m[0];
}
torch::Tensor forward(torch::Tensor x) { return x; }
```"""


def test_the_loop_end_to_end_on_the_cpu(server, tmp_path, monkeypatch):  # noqa: F811 - the fixture
    monkeypatch.setenv("KB_TEST_KEY", "sk-loop-secret")

    class Broken:   # the profiler of this process fails: kbench's built-in runs here, files do not
        def __init__(self, *a, **k):
            raise RuntimeError("no profiler today")
    monkeypatch.setattr(torch.autograd.profiler, "profile", Broken)
    server.script += [(200, answer(RIGHT, WRONG, RACY), 0), (200, answer("no code today"), 0)]
    proposers = [loop.KbenchProposer(), llm.OpenAIProposer(endpoint(server))]
    lines = []
    db = str(tmp_path / "cache.sqlite")
    got = loop.run(TASKS["softmax"], proposers, generations=2, per_call=3, device="cpu", out_dir=str(tmp_path),
                   budget="quick", progress=lines.append, cache_path=db)
    by = {}
    for c in got["candidates"]:
        by.setdefault((c.proposer, c.status), []).append(c)
    assert sorted(by) == [("kbench", "PASS"), ("openai", "FAIL"), ("openai", "NONE"), ("openai", "PASS"),
                          ("openai", "SOFT")], sorted(by)
    assert "missing barrier" in by[("openai", "SOFT")][0].feedback
    assert [c.spec for c in by[("kbench", "PASS")]] == ["kbench:fast", "kbench:default"]
    best = got["best"]
    assert best is not None and best.status == "PASS" and best.speedup > 0 and best.roofline > 0
    # a passing file's profile, taken in its worker: the ops by self time, each op call a launch
    right = by[("openai", "PASS")][0]
    prof = right.profile
    assert prof["device"] == "cpu" and prof["config"] == "n16_h64" and prof["host_ms"] > 0, prof
    assert any("softmax" in t["name"] for t in prof["top"]) and prof["device_ms"] > 0
    assert prof["launches"] >= sum(t["count"] for t in prof["top"]) >= 1
    # the profiler that raised (this process's) cost the built-in its profile, not its pass
    assert all(c.profile.startswith("profile unavailable: RuntimeError: no profiler today")
               for c in by[("kbench", "PASS")])
    # the second generation's prompt: the best so far with its roofline fraction, how each
    # passing candidate ran, and what the others met
    prompt = server.seen[1]["body"]["messages"][1]["content"]
    assert "torch.softmax(x, dim=-1)" in prompt or "kbench:" in prompt
    assert "% of the roofline):" in prompt
    assert f"- a openai candidate: PASS, {right.speedup:.2f}x eager, {right.roofline:.0%} of the roofline" in prompt
    assert "profile at n16_h64: " in prompt and "top ops by self time: aten::" in prompt
    assert "- a kbench candidate: PASS" in prompt and "profile unavailable: RuntimeError" in prompt
    assert "FAIL" in prompt and "missing barrier" in prompt
    record = [json.loads(x) for x in (tmp_path / "record.jsonl").read_text().splitlines()]
    assert len(record) == len(got["candidates"]) and len(lines) == len(record)
    assert [r["profile"] for r in record if r["key"] == right.key] == [prof]

    # the cache holds the same record, and its export writes it out with the search's (the data set)
    from kbench.tune.cache import cli_main
    out = tmp_path / "export.jsonl"
    assert cli_main(["--path", db, "export", str(out), "--no-cubins"]) == 0
    exported = [json.loads(x) for x in out.read_text().splitlines()]
    agent = [x for x in exported if x["kind"] == "agent"]
    assert sorted(x["key"] for x in agent) == sorted(x["key"] for x in record)
    assert {x["task"] for x in agent} == {"softmax"} and {x["status"] for x in agent} >= {"PASS", "SOFT"}
    assert [x["profile"] for x in agent if x["key"] == right.key] == [prof]
    # every prompt and reply of the LLM proposer, beside the record and in the export; never the key
    said = [json.loads(x) for x in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    assert [x["generation"] for x in said] == [0, 1] and said[0]["messages"][1]["role"] == "user"
    assert "no code today" in said[1]["replies"][0]
    prompts = [x for x in exported if x["kind"] == "agent_prompt"]
    assert sorted(x["key"] for x in prompts) == sorted(x["key"] for x in said)
    assert "sk-loop-secret" not in out.read_text() + (tmp_path / "prompts.jsonl").read_text()

    # a second run with kbench's proposer alone scores nothing again: both come from the record
    again = loop.run(TASKS["softmax"], [loop.KbenchProposer()], generations=2, device="cpu", out_dir=str(tmp_path),
                     cache_path=db)
    assert [c.status for c in again["candidates"]] == ["PASS", "PASS"]
    assert len((tmp_path / "record.jsonl").read_text().splitlines()) == len(record)
    assert cli_main(["--path", db, "export", str(out), "--no-cubins"]) == 0
    assert sum(json.loads(x)["kind"] == "agent" for x in out.read_text().splitlines()) == len(agent)


def test_agent_cli_refuses_what_it_cannot_run(capsys):
    from kbench.__main__ import main
    assert main(["agent", "softmax", "--no-kbench"]) == 2 and "no proposer" in capsys.readouterr().err
    assert main(["agent", "softmax", "--endpoint", "http://127.0.0.1:9/v1"]) == 2
    assert "needs --model" in capsys.readouterr().err
    assert main(["agent", "no_such_task", "--device", "cpu"]) == 2 and "no task" in capsys.readouterr().err


RACY_RIGHT = '''```python
import torch
KERNEL = """
__global__ void k(float *y, const float *x) {
    __shared__ float m[1];
    if (threadIdx.x == 0) m[0] = x[0];
    y[threadIdx.x] = m[0];
}
"""

def make(model, example_inputs):
    return lambda x: torch.softmax(x, dim=-1)   # the kernel above is never built
```'''
WRONG_CLEAN = "```python\ndef make(model, example_inputs):\n    return lambda x: x + 0.0\n```"


def test_soft_audit_measures_the_verifier_against_the_harness(server, tmp_path):  # noqa: F811 - the fixture
    """With audit_soft, what the soft verifier refuses is scored anyway: a proposal whose
    load_inline string races (found by parsing, never run) but whose Python is right counts as a
    right one refused; a clean but wrong one as a wrong one let through."""
    server.script.append((200, answer(RACY_RIGHT, WRONG_CLEAN), 0))
    got = loop.run(TASKS["softmax"], [llm.OpenAIProposer(endpoint(server))], generations=1, per_call=2,
                   device="cpu", out_dir=str(tmp_path), audit_soft=True)
    racy, wrong = got["candidates"]
    assert "missing barrier" in racy.soft and racy.status == "PASS"
    assert wrong.soft == "" and wrong.status == "FAIL"
    assert got["soft"] == {"scored": 2, "stopped_wrong": 0, "rejected_right": 1, "missed_wrong": 1}


def test_the_llm_verifier_refuses_before_the_gpu_and_is_measured(server, tmp_path):  # noqa: F811 - the fixture
    """With a verifier, each proposal is reviewed over the endpoint before the harness: a FAIL
    refuses it (status SOFT, the reasons fed back), no verdict never blocks; the verifier is
    measured against the harness apart from the static checks."""
    unsure = RIGHT.replace("import torch", "import torch  # the same, said otherwise")
    verdicts = [(200, answer("PASS\nlooks right"), 0), (200, answer("FAIL\nadds zero instead of a softmax"), 0)]
    server.script += [(200, answer(RIGHT, WRONG_CLEAN, unsure), 0), *verdicts, (200, answer("maybe?"), 0)]
    verify = lambda code, src: llm.llm_verify(endpoint(server), code, src)   # noqa: E731
    got = loop.run(TASKS["softmax"], [llm.OpenAIProposer(endpoint(server))], generations=1, per_call=3,
                   device="cpu", out_dir=str(tmp_path / "a"), verifier=verify)
    right, wrong, no_verdict = got["candidates"]
    assert right.status == "PASS" and right.llm == "PASS: looks right"
    assert wrong.status == "SOFT" and "adds zero" in wrong.feedback and wrong.llm.startswith("FAIL")
    assert no_verdict.status == "PASS" and no_verdict.llm.startswith("none: no verdict")
    sent = server.seen[2]["body"]["messages"][1]["content"]     # the task's code and the proposal went
    assert "Softmax over the last dim" in sent and "x + 0.0" in sent
    # measured against the harness as the static checks are (scored anyway under audit_soft)
    judged = [loop.Candidate("a", "openai", 0, "", "PASS", llm="PASS: fine"),
              loop.Candidate("b", "openai", 0, "", "FAIL", llm="FAIL: wrong offset"),
              loop.Candidate("c", "openai", 0, "", "PASS", llm="FAIL: imagined race"),
              loop.Candidate("d", "openai", 0, "", "FAIL", llm="PASS: fine"),
              loop.Candidate("e", "openai", 0, "", "PASS", llm="none: no verdict")]
    assert loop.soft_report(judged)["llm"] == {"judged": 4, "stopped_wrong": 1, "rejected_right": 1,
                                               "missed_wrong": 1}
    assert "llm" not in loop.soft_report(judged[4:])


def test_a_passing_candidates_feedback_is_a_few_bounded_lines():
    """What the next prompt hears of a passing candidate: its speedup, roofline fraction (where the
    row had one) and profile, cut to a bound whatever the kernels are called."""
    prof = {"device": "cuda", "config": "n16_h64", "launches": 3, "device_ms": 0.0123, "host_ms": 0.05,
            "top": [{"name": "softmax_kernel_" + "v" * 300, "self_ms": 0.01, "count": 2}] * 5}
    c = loop.Candidate("k", "openai", 0, "f.cu", "PASS", speedup=1.5, roofline=0.42, profile=prof)
    text = loop.passing_feedback(c)
    head, body = text.split("\n", 1)
    assert head == "a openai candidate: PASS, 1.50x eager, 42% of the roofline"
    assert body.startswith("  profile at n16_h64: 3 launches, 0.0123 ms on the device, 0.05 ms host time\n"
                           "  top kernels by self time: softmax_kernel_vvv")
    assert len(body) <= 2 + loop.PROFILE_TEXT_CHARS and text.count("\n") == 2
    bare = loop.Candidate("k", "kbench", 0, "kbench:fast", "PASS", speedup=0.9)
    assert loop.passing_feedback(bare) == "a kbench candidate: PASS, 0.90x eager"
