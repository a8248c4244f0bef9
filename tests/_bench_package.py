"""The benchmark's Python helpers (kbench.bench) without the C core: where kbench itself does not
import (its extension not built), a bare kbench package is put in its place so that kbench.bench
loads alone. Imported first by the benchmark's tests."""
from __future__ import annotations

import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
try:
    import kbench  # noqa: F401
except Exception:  # noqa: BLE001 - the C core is not built here: the benchmark does not need it
    for _k in [k for k in sys.modules if k == "kbench" or k.startswith("kbench.")]:
        del sys.modules[_k]
    _pkg = types.ModuleType("kbench")
    _pkg.__path__ = [str(ROOT / "kbench")]
    sys.modules["kbench"] = _pkg
