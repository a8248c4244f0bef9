"""The agentic loop's parts (docs/DESIGN.md, "Verification"): the soft verifier, which judges a
CUDA source before anything of it runs on a GPU (soft.py, cubin.py), and the LLM proposer and
verifier over any OpenAI-compatible endpoint (llm.py). The loop that drives them is not built yet."""
