"""The size symbols of an ExportedProgram for lower.py: torch's ShapeEnv,
products unified by the guards that equate them, symbols pinned to their example sizes, and
whether a size relation holds for every size torch allows."""
from __future__ import annotations

import sympy
import torch


def shape_env(ep):
    """torch's ShapeEnv behind the exported graph's fake tensors (None: a graph without one)."""
    for n in ep.graph.nodes:
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor):
            fm = getattr(v, "fake_mode", None)
            if fm is not None and getattr(fm, "shape_env", None) is not None:
                return fm.shape_env
    return None


def factors(side):
    """(coef, [symbols with multiplicity]) of a monomial, or None."""
    c, rest = side.as_coeff_Mul()
    if not c.is_Integer:
        return None
    fs = []
    for f in sympy.Mul.make_args(rest):
        if f.is_Symbol:
            fs.append(f)
        elif f.is_Pow and f.base.is_Symbol and f.exp.is_Integer and f.exp > 0:
            fs += [f.base] * int(f.exp)
        elif f != 1:
            return None
    return int(c), fs


def unify(guards, example, order):
    """Merges symbols that a guard says are equal as products (s0*s1 == s2*s3 comes from
    logits.view(-1, V) against targets.view(-1)), pairing them by example value when that is
    unambiguous; the runtime then binds both inputs to the same symbols (a stricter guard)."""
    parent = {}

    def find(s):
        while parent.get(s, s) != s:
            s = parent[s]
        return s

    for g in guards:
        e = getattr(g, "expr", g)
        if not isinstance(e, sympy.Eq):
            continue
        sides = [factors(side.xreplace({s: find(s) for s in side.free_symbols})) for side in e.args]
        if None in sides or sides[0][0] != sides[1][0]:
            continue
        a, b = list(sides[0][1]), list(sides[1][1])
        for s in list(a):
            if s in b:
                a.remove(s)
                b.remove(s)
        va, vb = [example.get(s) for s in a], [example.get(s) for s in b]
        if not a or None in va or None in vb or len(set(va)) != len(va) or sorted(va) != sorted(vb):
            continue
        for sb in b:
            ra, rb = find(a[va.index(example[sb])]), find(sb)
            if ra != rb:
                lo, hi = sorted((ra, rb), key=lambda s: order.get(s, 1 << 30))
                parent[hi] = lo
    return {s: find(s) for s in parent}


def pin_symbols(subst, user_nodes, inputs, pin):
    """subst extended so that the symbols of the pinned user-input dims (and every symbol unified
    with one) are their example sizes: what an export with those dims static gives, where the
    sizes derived from them become numbers and the guards on them hold trivially."""
    values = {}
    for i, d in pin:
        s = user_nodes[i].meta["val"].shape[d]
        if isinstance(s, torch.SymInt):
            e = s.node.expr.xreplace(subst) if subst else s.node.expr
            if e.is_Symbol:
                values[e] = sympy.Integer(int(inputs[i].shape[d]))
    if not values:
        return subst, set()
    out = {k: v.xreplace(values) for k, v in subst.items()}
    for k, v in values.items():
        out.setdefault(k, v)
    return out, {k for k, v in out.items() if v.is_number}


def holds_for_sizes(e, shape_env) -> bool:
    """Is the size relation e true whatever sizes its symbols take in torch's ranges for them (as
    torch decides before recording a guard)? False when that cannot be shown."""
    evaluate = getattr(shape_env, "_maybe_evaluate_static", None)
    if evaluate is not None:
        try:
            r = evaluate(e)
            if r is not None:
                return r in (sympy.true, True)
        except Exception:  # noqa: BLE001 - a private torch helper: keeping the guard is safe
            pass
    pos = {x: sympy.Symbol(f"_size{i}", integer=True, positive=True) for i, x in enumerate(e.free_symbols)}
    try:
        return e.xreplace(pos) in (sympy.true, True)
    except TypeError:
        return False
