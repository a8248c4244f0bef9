"""model.kbench_report: one row per region — its ops, schedule, verified envelope, eager vs
kernel time and status — as a text table for print() and HTML for Jupyter. The eager column is
what eager PyTorch runs for the region's ops (their ATen calls, runtime/eager.py); a region that
holds part of an op has none, and a footnote says why."""
from __future__ import annotations

import html
from dataclasses import dataclass, field

from .capture.modes import describe_mode
from .runtime.plan import Status


def _state_lines(module) -> list:
    """What the report says of the Python state the forward read (capture/guards.py)."""
    d = module.__dict__
    lines = []
    if d.get("_kbench_stale"):
        lines.append(f"python state: the model itself runs, as the forward changes Python state ({d['_kbench_stale']})")
    elif d.get("_kbench_state") is not None:
        lines.append(f"python state: {len(d['_kbench_state'])} values the forward read (attributes, submodules, "
                     "globals) are checked at each call; a change is captured again")
    for why, _ in d.get("_kbench_variants", ()):
        lines.append(f"python state: {why}: served by a capture of its own")
    return lines


def _graph_lines(module) -> list:
    """The CUDA-graph mode's lines: module._kbench_graphs is its runner (runtime/graphs.py), or
    why it has none."""
    graphs = module.__dict__.get("_kbench_graphs")
    if graphs is None:
        return []
    if isinstance(graphs, str):
        return [f"CUDA graphs: off ({graphs})"]
    return graphs.describe()


def _mode_lines(module) -> list:
    """The lines of what serves a module's calls: its CUDA graphs and its parameter cache
    (runtime/param_cache.py)."""
    cache = module.__dict__.get("_kbench_pcache")
    return _graph_lines(module) + (cache.describe() if cache is not None else [])


def _ms(v) -> str:
    return f"{v:.4f} ms" if isinstance(v, (int, float)) else "?"


@dataclass
class Row:
    region: int
    kind: str
    ops: str
    status: str             # as printed: "kernel", "eager (compile failed: ...)", "torch"
    genome: str = ""
    envelope: str = ""
    eager_ms: float | None = None
    kernel_ms: float | None = None
    on_backend: bool = False   # a generated kernel or the interpreter runs it (not torch)
    eager_note: str = ""       # why the eager column is empty (a footnote)

    @property
    def speedup(self) -> float | None:
        if self.eager_ms and self.kernel_ms:
            return self.eager_ms / self.kernel_ms
        return None


@dataclass
class Report:
    backend: str
    rows: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    @classmethod
    def from_module(cls, module) -> "Report":
        plan = module._kbench_plan
        executor = module._kbench_executor
        rep = cls(executor.name)
        for info in plan.regions:
            untimed = info.eager is not None and info.kind != "EXTERN" and info.eager_ms is None
            note = info.eager.note if untimed else ""
            rep.rows.append(Row(info.index, info.kind, info.ops, info.status_text, info.genome, info.envelope,
                                info.eager_ms, info.kernel_ms,
                                on_backend=info.status.kernel or info.status is Status.INTERP, eager_note=note))
        capture_note = module.__dict__.get("_kbench_capture_note")
        if capture_note:
            rep.notes.append(f"capture: {capture_note}")
        if module.__dict__.get("_kbench_tuning_note"):
            rep.notes.append(module.__dict__["_kbench_tuning_note"])
        if module.__dict__.get("_kbench_gate"):
            rep.notes.append(module.__dict__["_kbench_gate"])
        spec = module.__dict__.get("_kbench_spec")
        for line in spec.describe() if spec is not None else ():
            rep.notes.append(f"input: {line}")
        rep.notes += _state_lines(module)
        rep.notes += _mode_lines(module)
        for mode, other in module.__dict__.get("_kbench_modes", {}).items():
            what = describe_mode(mode)
            rep.notes.append(f"{what}: " + (f"runs in eager ({other})" if isinstance(other, str)
                                                 else "served by a capture of its own"))
            if not isinstance(other, str):
                rep.notes += [f"{what}: {line}" for line in _mode_lines(other)]
        if plan.nvrtc:
            rep.notes.append(f"NVRTC: {plan.nvrtc}")
        if plan.static_reason:
            rep.notes.append(f"sizes: {plan.static_reason}")
        if any(info.backward for info in plan.regions):
            saving = [f"region {info.index}: {info.saved}" for info in plan.regions if info.saved]
            reading = [f"region {info.index}: output {', '.join(map(str, info.saved_outputs))}"
                       for info in plan.regions if info.saved_outputs]
            rep.notes.append("saved for backward: each region's inputs, and the row statistics (max, sum, mean, "
                             "variance) its rows are computed from (" + (", ".join(saving) or "none here") + "); "
                             "the backward kernels recompute the other forward values they need (fewer bytes "
                             "than keeping intermediates)"
                             + ("; where that reads fewer bytes, they read the region's outputs instead ("
                                + ", ".join(reading) + ")" if reading else ""))
        for need, how in module.__dict__.get("_kbench_loss", {}).items():
            rep.notes.append(f"loss gradients in the forward (gradients wanted: {need}): {how}")
        for info in plan.regions:
            x = info.extra
            if x.get("candidates"):
                rep.notes.append(f"region {info.index} search: {x['candidates']} candidates in {x['search_s']}s"
                                 + (f" on {x['tuned_on']}" if x.get("tuned_on") else "")
                                 + f", default {_ms(x.get('default_ms'))} → best {_ms(x.get('best_ms'))}"
                                 + (f" ({x['search_note']})" if x.get("search_note") else "")
                                 + (f"; re-timed {x['confirmed']}" if x.get("confirmed") else ""))
            if info.backward:
                rep.notes.append(f"region {info.index} backward: {info.backward}")
        if any(r.eager_ms is not None for r in rep.rows) and any(info.eager is not None for info in plan.regions):
            led = sorted({n for info in plan.regions if info.eager is not None and info.eager_ms is not None
                          for n in info.eager.torch_led})
            rep.notes.append("eager ms: what eager runs for the region's ops, each ATen call whole (one "
                             "layer_norm, not its decomposition)"
                             + (f"; {', '.join(led[:4])}{', ...' if len(led) > 4 else ''}: torch's call runs "
                                "either way, and the part a region holds (a bias add) is in it, not in the "
                                "region's eager time" if led else ""))
        for r in rep.rows:
            if r.eager_note:
                rep.notes.append(f"* region {r.region}: {r.eager_note}")
        for reason in sorted(module._kbench_reasons):
            rep.notes.append(f"fallback: {reason}")
        return rep

    @property
    def kernels(self) -> int:
        """Compute regions that run on kbench's backend (a kernel, or the interpreter)."""
        return sum(1 for r in self.rows if r.on_backend)

    def _cells(self):
        head = ["#", "kind", "ops", "genome", "envelope", "eager ms", "kernel ms", "×", "status"]
        body = []
        for r in self.rows:
            ops = r.ops if len(r.ops) <= 40 else r.ops[:37] + "..."
            body.append([str(r.region), r.kind, ops, r.genome, r.envelope,
                         f"{r.eager_ms:.4f}" if r.eager_ms is not None else ("*" if r.eager_note else ""),
                         f"{r.kernel_ms:.4f}" if r.kernel_ms is not None else "",
                         f"{r.speedup:.2f}" if r.speedup else "", r.status])
        return head, body

    def __str__(self) -> str:
        head, body = self._cells()
        widths = [max(len(x) for x in col) for col in zip(head, *body)]
        line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
        compute = sum(1 for r in self.rows if r.kind != "EXTERN")
        out = [f"kbench report — backend {self.backend}: {self.kernels} of {compute} compute region(s) on "
               f"{self.backend}, {len(self.rows) - compute} run by torch",
               line(head), line(["-" * w for w in widths])]
        out += [line(b) for b in body]
        out += self.notes
        return "\n".join(out)

    def _repr_html_(self) -> str:
        head, body = self._cells()
        th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
        trs = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in b) + "</tr>" for b in body)
        notes = "".join(f"<li>{html.escape(n)}</li>" for n in self.notes)
        return (f"<b>kbench report</b> — backend {html.escape(self.backend)}: {self.kernels} kernel(s)"
                f"<table><tr>{th}</tr>{trs}</table><ul>{notes}</ul>")
