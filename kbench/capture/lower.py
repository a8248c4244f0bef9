"""The ATen graph of an ExportedProgram -> a types.Captured (capture's second half): size
symbols from the user inputs' dims (unified by export's guards, pinned where asked), a
builder.Builder walk with ops.LOWER as its table (FX nodes named in `keep` stay torch calls),
and the Captured that the runtime reads, with each value's provenance."""
from __future__ import annotations

import sympy
import torch
from torch.export.graph_signature import InputKind, OutputKind

from ..dtypes import TORCH_TO_IR
from ..errors import CaptureError
from . import masks
from . import symbols as symbolic
from .builder import Builder, Multi, NeedStatic, Sym, TorchSide, V
from .ops import LOWER
from .types import Captured, OutputTree, SymExpr


# the key under which capture's export leaves its count of in-place writes to each user input
# (export._input_writes) in the exported graph_module's meta
INPUT_WRITES = "kbench_input_writes"

_INPUT_KIND = {InputKind.PARAMETER: "param", InputKind.BUFFER: "buffer",
               InputKind.CONSTANT_TENSOR: "const"}


def lower(ep, inputs, static_reason, model=None, pin=(), keep=(), gemm=False):
    """The ExportedProgram as a Captured graph; NeedStatic (with .dims set) when some size
    cannot be written. pin: user-input dims (input, dim) to hold at their example sizes, as if
    the export had made them static (the same program lowered again, without re-exporting).
    keep: FX node names (a dict: name -> why) to run as one EXTERN call each, as eager runs
    them, instead of their IR decomposition (a region whose kernel lost to eager's op).
    gemm: matrix products (mm, bmm, addmm, matmul, linear, baddbmm) as MATMUL nodes, not torch calls."""
    try:
        return _lower(ep, inputs, static_reason, model, pin, keep, gemm)
    except NeedStatic as e:
        for i, n in enumerate(n for n in ep.graph.nodes if n.op == "placeholder"
                              and n.name in {s.arg.name for s in ep.graph_signature.input_specs
                                             if s.kind == InputKind.USER_INPUT}):
            for d, s in enumerate(n.meta["val"].shape):
                if isinstance(s, torch.SymInt) and s.node.expr.free_symbols & e.syms:
                    e.dims.append((i, d))
        raise


def _lower(ep, inputs, static_reason, model, pin=(), keep=(), gemm=False):
    sig = ep.graph_signature
    ph = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    user_specs = [s for s in sig.input_specs if s.kind == InputKind.USER_INPUT]
    user_nodes = [ph[s.arg.name] for s in user_specs]

    # symbols: one per varying user-input dim, in order of appearance, merged by the guards
    example, order = {}, {}
    for t, n in zip(inputs, user_nodes):
        for d, s in enumerate(n.meta["val"].shape):
            if isinstance(s, torch.SymInt) and s.node.expr.is_Symbol:
                example.setdefault(s.node.expr, int(t.shape[d]))
                order.setdefault(s.node.expr, len(order))
    shape_env = symbolic.shape_env(ep)
    guards = list(getattr(shape_env, "guards", None) or []) if shape_env is not None else []
    subst = symbolic.unify(guards, example, order)
    pinned = set()
    if pin:
        subst, pinned = symbolic.pin_symbols(subst, user_nodes, inputs, pin)
    sym_of, examples, sources, input_syms = {}, [], [], []
    for t, n in zip(inputs, user_nodes):
        row = []
        for d, s in enumerate(n.meta["val"].shape):
            e = s.node.expr.xreplace(subst) if isinstance(s, torch.SymInt) else None
            if e is not None and e.is_Symbol:
                if e not in sym_of:
                    sym_of[e] = len(sym_of)
                    examples.append(int(t.shape[d]))
                    sources.append(str(e))
                row.append(sym_of[e])
            else:
                row.append(None)
        input_syms.append(row)
    if len(sym_of) > 16:
        raise NeedStatic(f"{len(sym_of)} varying sizes (the IR has 16 symbols)")

    keep = dict(keep) if isinstance(keep, dict) else dict.fromkeys(keep, "")
    b = Builder(LOWER, sym_of, subst, examples, keep, gemm)
    _check_sizes(b, ep)
    b.notes += masks.causal_attention(ep.graph, b.expr, {s: examples[i] for s, i in sym_of.items()},
                                      lambda e: symbolic.holds_for_sizes(sympy.Le(e, 0), shape_env))
    for i, (t, row) in enumerate(zip(inputs, input_syms)):
        for d, s in enumerate(row):
            if s is None and static_reason is None and t.shape[d] in (0, 1):
                b.notes.append(f"input {i} dim {d} has size {t.shape[d]} in the example: torch.export "
                               "fixes sizes 0 and 1 (use an example of size >= 2 to let it vary)")
    for n, t in zip(user_nodes, inputs):
        dims = tuple(b.dim(s) for s in n.meta["val"].shape)
        if None in dims:
            raise NeedStatic(f"input {n.name} has sizes {tuple(n.meta['val'].shape)}",
                             set().union(*(b.expr(s).free_symbols for s in n.meta["val"].shape)))
        b.env[n] = b.add("input", [], TORCH_TO_IR[t.dtype], dims, name=n.name, kind="user")
        b.origin[b.env[n].id] = n.name
    constants = {}
    for s in sig.input_specs:
        if s.kind == InputKind.USER_INPUT:
            continue
        n = ph[s.arg.name]
        val = n.meta.get("val")
        kind = _INPUT_KIND.get(s.kind)
        if kind and isinstance(val, torch.Tensor) and b.rep_dims(val) is not None:
            b.env[n] = b.add("input", [], TORCH_TO_IR[val.dtype], b.rep_dims(val), name=s.target, kind=kind)
            b.origin[b.env[n].id] = n.name
            if kind == "const":
                constants[s.target] = ep.constants[s.target]
        else:   # custom objects, tokens, tensors of other dtypes: held for extern calls
            b.env[n] = _held(ep, model, s)

    out_node = None
    for node in ep.graph.nodes:
        if node.op == "call_function":
            b.visit(node)
        elif node.op == "get_attr":
            b.env[node] = getattr(ep.graph_module, node.target)
        elif node.op == "output":
            out_node = node

    leaves, graph_outs, mutations = [], [], []
    for spec, arg in zip(sig.output_specs, out_node.args[0]):
        v = b.val(arg)
        if spec.kind in (OutputKind.USER_OUTPUT, OutputKind.LOSS_OUTPUT):
            if isinstance(v, V):
                leaves.append(("out", len(graph_outs)))
                graph_outs.append(v)
            elif isinstance(v, Sym):
                leaves.append(("sym", SymExpr(v.expr, sym_of)))
            elif isinstance(v, (TorchSide, Multi)) or isinstance(v, torch.Tensor):
                val = getattr(arg, "meta", {}).get("val")
                if isinstance(val, torch.Tensor) and 0 in val.shape:
                    raise CaptureError(f"output {arg.name} has a size-0 dim (sizes {list(val.shape)}): empty "
                                       "tensors run in eager PyTorch")
                what = getattr(val, "dtype", type(v).__name__)
                raise CaptureError(f"output {getattr(arg, 'name', arg)} is a {what} value, which "
                                   "kbench cannot return")
            else:
                leaves.append(("value", v))
        elif spec.kind in (OutputKind.BUFFER_MUTATION, OutputKind.USER_INPUT_MUTATION,
                           getattr(OutputKind, "PARAMETER_MUTATION", None)):
            if not isinstance(v, V):
                raise CaptureError(f"the model updates {spec.target} in place with a value kbench "
                                   "cannot carry")
            kind = {OutputKind.BUFFER_MUTATION: "buffer",
                    OutputKind.USER_INPUT_MUTATION: "user"}.get(spec.kind, "param")
            mutations.append((len(graph_outs), kind, spec.target))
            graph_outs.append(v)

    names = [f"s{i}" for i in range(len(sym_of))]
    graph, idmap, others = b.emit(graph_outs, [b.env[n].id for n in user_nodes],
                                  list(zip(names, examples)))
    _check_not_empty(graph)
    kept_guards = []
    for g in guards:
        e0 = getattr(g, "expr", g)
        e = e0.xreplace(subst)
        if e in (sympy.true, True) or not e.free_symbols or any(x not in sym_of for x in e.free_symbols):
            continue
        if pinned and e0.free_symbols & pinned and symbolic.holds_for_sizes(e, shape_env):
            continue   # Min(5, 5*s1) == 5: an export with the pinned dims static never makes it
        kept_guards.append(SymExpr(e, sym_of))
    kept_guards += [SymExpr(g, sym_of) for g in dict.fromkeys(b.size_guards)]
    try:
        out_spec = ep.call_spec.out_spec
    except Exception:  # noqa: BLE001
        out_spec = None
    if out_spec is not None and getattr(out_spec, "num_leaves", len(leaves)) != len(leaves):
        out_spec = None
    return Captured(
        graph=graph,
        input_names=[n.name for n in user_nodes],
        input_syms=input_syms,
        param_names=[name for _, name in others],
        externs=b.externs,
        static_reason=static_reason,
        output_tree=OutputTree(out_spec, leaves),
        example_symvals=list(examples),
        input_kinds=["user"] * len(user_nodes) + [k for k, _ in others],
        constants=constants,
        mutations=mutations,
        symbol_sources=sources,
        guards=kept_guards,
        input_dtypes=[t.dtype for t in inputs],
        device=inputs[0].device if inputs else None,
        notes=b.notes,
        value_names={idmap[i]: nm for i, nm in b.value_names.items() if i in idmap},
        origin={idmap[i]: nm for i, nm in b.origin.items() if i in idmap},
        calls=b.node_calls(idmap),
        kept={name: why for name, why in keep.items() if name in {n.name for n in ep.graph.nodes}},
        input_writes=dict(ep.graph_module.meta.get(INPUT_WRITES, {})),
    )


def _check_not_empty(graph):
    """A size-0 dim fixed in the graph (an empty example input: torch.export fixes sizes 0 and 1;
    a slice past the end): eager's empty results, its sum of 0 and its mean of nan over an empty
    dim, its error for the max of one, are eager's to give; a kernel launched on no elements or
    reducing an empty row has none of them. The model runs in eager (CaptureError), and a call
    with an empty tensor into a varying size goes to eager at run time (OptimizedModule._bind).
    An empty value that only torch reads (an empty constant Hugging Face's attention passes to
    its mask code) is torch's business: it stays."""
    nodes = [graph.node(i) for i in range(graph.num_nodes)]
    read_by_kbench = set()
    for node in nodes:
        if node["op"] != "extern":
            read_by_kbench.update(node["inputs"])
    for i, node in enumerate(nodes):
        if 0 in node["dims"] and (node["op"] not in ("input", "extern") or i in read_by_kbench):
            what = f"input {node['name']!r}" if node["op"] == "input" else f"a {node['op']} in the graph"
            raise CaptureError(f"{what} has a size-0 dim (sizes {node['dims']}): empty tensors run in eager "
                               "PyTorch")


def _check_sizes(b, ep):
    """Every size the IR would carry must be coef * symbols: find all that are not at once, so
    that capture fixes all the input dims involved in one re-export."""
    bad, why = set(), None
    for node in ep.graph.nodes:
        val = node.meta.get("val")
        for t in val if isinstance(val, (list, tuple)) else [val]:
            if isinstance(t, torch.Tensor) and t.dtype in TORCH_TO_IR:
                for s in t.shape:
                    try:
                        b.dim(s)
                    except NeedStatic as e:
                        bad |= e.syms
                        why = why or str(e)
    if bad:
        raise NeedStatic(why, bad)


def _held(ep, model, spec):
    if spec.target in getattr(ep, "constants", {}):
        return ep.constants[spec.target]
    if model is not None and spec.target:
        try:
            return model.get_parameter(spec.target) if spec.kind == InputKind.PARAMETER \
                else model.get_buffer(spec.target)
        except AttributeError:
            pass
    return ep.state_dict.get(spec.target)



