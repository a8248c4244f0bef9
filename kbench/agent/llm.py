"""The LLM proposer and verifier: any OpenAI-compatible chat-completions endpoint (a local vLLM or
llama.cpp server, or a hosted API), over plain HTTP with the standard library. The API key is read
from an environment variable at each call and never stored: not in the record, not in logs, not
in errors. An endpoint that is down, slow, rate-limited or answers garbage makes that call fail
with a one-line EndpointError; the caller records it and goes on."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import time
import urllib.error
import urllib.request

MAX_REPLY_BYTES = 4 << 20      # a reply larger than this is garbage, not a kernel
RETRY_STATUS = (429, 500, 502, 503, 504)


class EndpointError(RuntimeError):
    """A chat call that gave no usable answer (the message says why in one line)."""


@dataclasses.dataclass
class Endpoint:
    base_url: str                       # up to /v1, e.g. http://localhost:8000/v1
    model: str
    api_key_env: str | None = "OPENAI_API_KEY"   # the variable's name; None: no key sent
    timeout_s: float = 120.0
    retries: int = 2                    # on 429 and 5xx, with a backoff of backoff_s, 2x, 4x
    backoff_s: float = 2.0

    def key(self) -> str:
        return os.environ.get(self.api_key_env, "") if self.api_key_env else ""


def _redact(text: str, key: str) -> str:
    return text.replace(key, "<api key>") if key else text


def chat(endpoint: Endpoint, messages: list[dict], *, n: int = 1, temperature: float = 0.8,
         max_tokens: int | None = None) -> list[str]:
    """The contents of the endpoint's choices for messages (as many as it returned, up to n)."""
    body = {"model": endpoint.model, "messages": messages, "n": n, "temperature": temperature}
    if max_tokens:
        body["max_tokens"] = max_tokens
    key = endpoint.key()
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    url = endpoint.base_url.rstrip("/") + "/chat/completions"
    if not re.match(r"https?://", url):
        raise EndpointError(f"the endpoint's URL must be http(s)://, got {endpoint.base_url!r}")
    last = ""
    for attempt in range(endpoint.retries + 1):
        if attempt:
            time.sleep(endpoint.backoff_s * 2 ** (attempt - 1))
        req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=endpoint.timeout_s) as resp:   # noqa: S310 - the user's endpoint
                raw = resp.read(MAX_REPLY_BYTES + 1)
        except urllib.error.HTTPError as e:
            last = f"HTTP {e.code} {e.reason}"
            if e.code in RETRY_STATUS:
                continue
            raise EndpointError(_redact(last, key)) from None
        except (urllib.error.URLError, TimeoutError, OSError) as e:
            reason = getattr(e, "reason", e)
            last = f"no answer ({type(reason).__name__}: {reason})"
            if isinstance(reason, (TimeoutError, ConnectionRefusedError)) or "timed out" in str(reason):
                raise EndpointError(_redact(last, key)) from None
            continue
        if len(raw) > MAX_REPLY_BYTES:
            raise EndpointError(f"a reply over {MAX_REPLY_BYTES} bytes")
        try:
            doc = json.loads(raw)
            texts = [c["message"]["content"] for c in doc["choices"]]
        except (ValueError, KeyError, TypeError) as e:
            raise EndpointError(f"malformed reply ({type(e).__name__}): {_redact(raw[:120].decode('utf-8', 'replace'), key)!r}") \
                from None
        if not all(isinstance(t, str) for t in texts) or not texts:
            raise EndpointError("malformed reply: choices without text")
        return texts[:n]
    raise EndpointError(_redact(f"gave up after {endpoint.retries + 1} tries: {last}", key))


def extract_cuda(text: str) -> str | None:
    """The first fenced code block of an answer that defines a kernel (```cuda, ```cpp, ```c++,
    ```c or bare), else None."""
    for m in re.finditer(r"```[ \t]*([\w+]*)[ \t]*\n(.*?)```", text, flags=re.S):
        if "__global__" in m.group(2):
            return m.group(2).strip() + "\n"
    return None


def extract_implementation(text: str) -> tuple[str | None, str]:
    """(source, ".cu" or ".py") of an answer: a CUDA extension (a block with a __global__ kernel
    and no Python), else a Python implementation file (a ```python block defining make, forward
    or ModelNew, kbench bench's file formats; it may hold CUDA for load_inline); (None, "")."""
    for m in re.finditer(r"```[ \t]*([\w+]*)[ \t]*\n(.*?)```", text, flags=re.S):
        lang, body = m.group(1).lower(), m.group(2)
        if lang in ("python", "py") and re.search(r"^(?:def (?:make|forward)\b|class ModelNew\b)", body, re.M):
            return body.strip() + "\n", ".py"
        if lang not in ("python", "py") and "__global__" in body:
            return body.strip() + "\n", ".cu"
    return None, ""


# ------------------------------------------------------------------------------------ proposer

@dataclasses.dataclass
class Proposal:
    source: str | None      # an implementation file's text (suffix says which), None where there is none
    error: str = ""         # why there is none
    proposer: str = "openai"
    suffix: str = ".cu"     # ".cu" (a torch extension) or ".py" (kbench bench's Python formats)
    spec: str = ""          # instead of a source: a built-in implementation ("kbench:fast")


PROMPT = """You write CUDA kernels that replace a PyTorch function. Answer with one fenced ```cuda
block holding a complete torch extension source: the kernels and a host function `forward` taking
the function's arguments (torch::Tensor and scalars) and returning its result, bound with
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m). It must compute exactly what the PyTorch code computes
(float32 tolerance) for every input size, and be as fast as you can make it on an {gpu}."""


class OpenAIProposer:
    """Proposals from a chat endpoint: the task's torch code, the best kernels so far with their
    times and roofline fractions, and the last round's feedback (each passing kernel's speedup,
    roofline fraction and profiler summary; compiler errors, verdicts); each call
    asks for n answers with a diversity instruction. Every prompt and reply goes to `record`
    (a list of dicts) without the key."""
    name = "openai"

    def __init__(self, endpoint: Endpoint, gpu: str = "NVIDIA H100", record: list | None = None):
        self.endpoint, self.gpu = endpoint, gpu
        self.record = record if record is not None else []

    def messages(self, task_code: str, best: list[tuple[str, float, float | None]], feedback: list[str],
                 n: int) -> list[dict]:
        parts = [f"The PyTorch code:\n```python\n{task_code.strip()}\n```"]
        for i, (src, ms, roof) in enumerate(best[:3]):
            frac = f", {roof:.0%} of the roofline" if roof is not None else ""
            parts.append(f"A verified kernel so far ({ms:.4g} ms{frac}):\n```cuda\n{src.strip()}\n```")
        if feedback:
            parts.append("The last round's kernels (how the passing ones ran, what the others met):\n"
                         + "\n".join(f"- {f}" for f in feedback[:20]))
        if n > 1:
            parts.append(f"Give one of {n} different approaches (memory layout, parallel decomposition, "
                         "vector width, fusion): do not repeat the kernels above.")
        return [{"role": "system", "content": PROMPT.format(gpu=self.gpu)},
                {"role": "user", "content": "\n\n".join(parts)}]

    def propose(self, task_code: str, best=(), feedback=(), n: int = 4) -> list[Proposal]:
        msgs = self.messages(task_code, list(best), list(feedback), n)
        entry = {"proposer": self.name, "model": self.endpoint.model, "messages": msgs, "replies": [], "error": ""}
        self.record.append(entry)
        try:
            texts = chat(self.endpoint, msgs, n=n)
        except EndpointError as e:
            entry["error"] = str(e)
            return [Proposal(None, f"endpoint: {e}")]
        entry["replies"] = texts
        out = []
        for t in texts:
            src, suffix = extract_implementation(t)
            out.append(Proposal(src, "" if src else "no ```cuda block with a __global__ kernel in the reply",
                                suffix=suffix or ".cu"))
        return out


VERIFY_PROMPT = """You review an implementation (a CUDA kernel, or Python that builds one) that must compute
exactly what the PyTorch code computes.
Check that it compiles, computes the same values (indexing, reductions, edge sizes, dtypes) and
accesses memory safely (bounds, races, barriers). Answer PASS or FAIL on the first line, then the
reasons, one per line."""


def llm_verify(endpoint: Endpoint, task_code: str, source: str) -> tuple[bool | None, str]:
    """The LLM verifier's opinion: (True, reasons) for PASS, (False, reasons) for FAIL, (None, why)
    where there is none (the endpoint failed or answered neither): no opinion never blocks a
    kernel, which the hardware verification judges anyway."""
    msgs = [{"role": "system", "content": VERIFY_PROMPT},
            {"role": "user", "content": f"```python\n{task_code.strip()}\n```\n\n```cuda\n{source.strip()}\n```"}]
    try:
        text = chat(endpoint, msgs, n=1, temperature=0.0)[0]
    except EndpointError as e:
        return None, f"no verdict: {e}"
    first, _, rest = text.strip().partition("\n")
    word = re.sub(r"[^A-Z]", "", first.upper())
    if word.startswith("PASS"):
        return True, rest.strip()
    if word.startswith("FAIL"):
        return False, rest.strip()
    return None, f"no verdict: the answer began {first[:60]!r}"
