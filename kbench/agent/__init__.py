"""The agentic loop (loop.py, `python -m kbench agent`): proposals from kbench's own generator and
from any OpenAI-compatible endpoint (llm.py), judged before any GPU by the soft verifier (soft.py,
cubin.py), then by the robust harness on the hardware."""
