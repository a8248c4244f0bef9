"""The OpenAI-compatible proposer and verifier (kbench/agent/llm.py) against a test double: a
local HTTP server started here that speaks the chat-completions protocol and returns recorded
answers — not a model. Good replies, several choices, malformed ones, rate limits, a server that
is slow or down, an answer with no kernel; the key reaches the server and nothing else."""
import http.server
import json
import threading
import time

import pytest

from kbench.agent import llm

KERNEL = "```cuda\n#include <torch/extension.h>\n__global__ void k(float *y) { y[0] = 1; }\n```"


class Double(http.server.BaseHTTPRequestHandler):
    """Answers POST /v1/chat/completions from the server's `script`: a list of (status, body or
    callable, delay) consumed one per request; what it was sent goes to `seen`."""

    def do_POST(self):   # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
        status, reply, delay = self.server.script.pop(0) if self.server.script else (500, "empty script", 0)
        time.sleep(delay)
        data = (json.dumps(reply) if isinstance(reply, dict) else reply).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def log_message(self, *a):
        pass


@pytest.fixture
def server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Double)
    srv.script, srv.seen = [], []
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def answer(*texts):
    return {"choices": [{"index": i, "message": {"role": "assistant", "content": t}} for i, t in enumerate(texts)]}


def endpoint(server, **kw):
    return llm.Endpoint(f"http://127.0.0.1:{server.server_address[1]}/v1", "test-model", api_key_env="KB_TEST_KEY",
                        **{"timeout_s": 2.0, "backoff_s": 0.01, **kw})


def test_proposals_from_several_choices_and_the_key_stays_out_of_the_record(server, monkeypatch):
    monkeypatch.setenv("KB_TEST_KEY", "sk-secret-123")
    server.script.append((200, answer(KERNEL, "I would rather not.", KERNEL.replace("y[0] = 1", "y[0] = 2")), 0))
    record = []
    prop = llm.OpenAIProposer(endpoint(server), record=record)
    out = prop.propose("def forward_fn(x):\n    return x.relu()", best=[("__global__ void old() {}", 0.5, 0.8)],
                       feedback=["kernel 2: error: identifier undefined"], n=3)
    assert [p.source is not None for p in out] == [True, False, True]
    assert "__global__ void k" in out[0].source and "no ```cuda block" in out[1].error
    sent = server.seen[0]
    assert sent["path"] == "/v1/chat/completions" and sent["auth"] == "Bearer sk-secret-123"
    assert sent["body"]["model"] == "test-model" and sent["body"]["n"] == 3
    user = sent["body"]["messages"][1]["content"]
    assert "return x.relu()" in user and "0.5 ms, 80% of the roofline" in user and "identifier undefined" in user
    assert "3 different approaches" in user
    assert "sk-secret-123" not in json.dumps(record) and len(record[0]["replies"]) == 3


def test_rate_limit_is_retried_then_answered(server):
    server.script += [(429, "slow down", 0), (503, "busy", 0), (200, answer(KERNEL), 0)]
    assert llm.chat(endpoint(server), [{"role": "user", "content": "hi"}]) == [KERNEL]
    assert len(server.seen) == 3


@pytest.mark.parametrize("status,reply,match", [
    (200, "this is not json", "malformed reply"),
    (200, {"choices": [{"message": {"content": None}}]}, "choices without text"),
    (200, {"nothing": []}, "malformed reply"),
    (401, "no key", "HTTP 401"),
    (500, "down", "gave up after 2 tries: HTTP 500"),
])
def test_garbage_and_refusals_are_one_line_errors(server, status, reply, match):
    server.script += [(status, reply, 0)] * 2
    prop = llm.OpenAIProposer(endpoint(server, retries=1))
    out = prop.propose("x", n=1)
    assert len(out) == 1 and out[0].source is None and match in out[0].error and "\n" not in out[0].error
    assert prop.record[0]["error"]


def test_a_slow_or_absent_endpoint_fails_in_bounded_time(server, monkeypatch):
    monkeypatch.setenv("KB_TEST_KEY", "sk-secret-456")
    server.script.append((200, answer(KERNEL), 3.0))
    t = time.perf_counter()
    with pytest.raises(llm.EndpointError, match="no answer") as e:
        llm.chat(endpoint(server, timeout_s=0.5), [{"role": "user", "content": "hi"}])
    assert time.perf_counter() - t < 2.5 and "sk-secret-456" not in str(e.value)
    dead = llm.Endpoint("http://127.0.0.1:9/v1", "m", api_key_env=None, timeout_s=1.0, retries=0)
    with pytest.raises(llm.EndpointError, match="no answer|gave up"):
        llm.chat(dead, [{"role": "user", "content": "hi"}])
    with pytest.raises(llm.EndpointError, match="http"):
        llm.chat(llm.Endpoint("file:///etc/passwd", "m"), [])


def test_llm_verifier_verdicts(server):
    ep = endpoint(server)
    server.script += [(200, answer("PASS\nlooks right"), 0), (200, answer("**FAIL**\nmissing __syncthreads"), 0),
                      (200, answer("Maybe?"), 0), (500, "x", 0), (500, "x", 0), (500, "x", 0)]
    assert llm.llm_verify(ep, "f", "k") == (True, "looks right")
    assert llm.llm_verify(ep, "f", "k") == (False, "missing __syncthreads")
    ok, why = llm.llm_verify(ep, "f", "k")
    assert ok is None and "Maybe" in why
    ok, why = llm.llm_verify(ep, "f", "k")
    assert ok is None and "HTTP 500" in why
    assert server.seen[0]["body"]["temperature"] == 0.0


def test_extract_cuda_takes_the_block_with_a_kernel():
    text = "Here:\n```python\nprint(1)\n```\nand\n```c++\n__global__ void k() {}\n```\n"
    assert llm.extract_cuda(text) == "__global__ void k() {}\n"
    assert llm.extract_cuda("no code") is None
