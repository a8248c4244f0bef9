"""Stand-in targets for the sandbox's worker process in CPU tests (tests/test_sandbox.py): they speak
the sandbox's protocol (kbench/tune/sandbox_worker.py) and touch neither torch nor CUDA, so a
worker starts in a few tens of milliseconds."""
import os
import subprocess
import time


def serve(conn, **kwargs):
    conn.send({"ready": True, "pid": os.getpid()})
    while True:
        try:
            header, blobs = conn.recv()
        except EOFError:
            return
        op = header.get("op")
        if op == "exit":
            return
        if op == "spawn":    # a child of its own: a kill of the worker must take it too
            child = subprocess.Popen(["sleep", "600"])
            conn.send({"fate": "ok", "child": child.pid})
        elif op == "sleep":
            time.sleep(header["seconds"])
            conn.send({"fate": "ok"})
        elif op == "echo":
            conn.send({"fate": "ok", "header": header, "blobs": [len(b) for b in blobs], "pid": os.getpid()})
        elif op == "die":
            os._exit(3)
        else:
            conn.send({"error": f"unknown op {op!r}"})


def never_ready(conn, **kwargs):
    time.sleep(600)
