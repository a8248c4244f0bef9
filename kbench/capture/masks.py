"""Attention masks that are causal by construction, found in the exported graph before lowering:
a boolean mask built from aranges that keeps key j for query i exactly where j <= i (Hugging
Face's sdpa masks, under torch.export, are such aranges and comparisons) becomes SDPA's
is_causal=True. torch then runs its flash kernel instead of turning the mask into an additive
one in every call and reading it in every tile, forward and backward. An additive float mask
that is 0 where such a boolean mask holds and at most -1e30 elsewhere (finfo.min of f32 or bf16,
-inf: older Hugging Face code fills one with masked_fill or where) is the same mask: those
entries' exponentials are 0 in the softmax, as the masked-out ones of is_causal are. (f16's
finfo.min, -65504, is not far enough below a score to be sure of that, and is left alone.)

The proof is an integer-affine reading of the mask's nodes: each index tensor is c + sum a_d idx_d
over its dims, each boolean one a conjunction of such forms held <= 0. One conjunct must be
j - i <= 0 over the query and key positions; every other must hold on that triangle, which for a
linear form is its three corners. A sliding window's i - j < w holds while the sequence is at most
w long: that rewrite is made where the export's own guards already keep every call that short
(Hugging Face's Mistral branches on the window in Python, so its export has one), never by adding
a guard that would send longer calls to eager."""
from __future__ import annotations

import dataclasses

import sympy
import torch

aten = torch.ops.aten

_SDPA = getattr(getattr(aten, "scaled_dot_product_attention", None), "default", None)
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


@dataclasses.dataclass(frozen=True)
class Affine:
    """An integer tensor whose element at idx is c + sum(coef[d] * idx[d])."""
    c: sympy.Expr
    coef: tuple

    def shifted(self, other, sign=1):
        return Affine(self.c + sign * other.c,
                      tuple(a + sign * b for a, b in zip(self.coef, other.coef)))


@dataclasses.dataclass(frozen=True)
class Conj:
    """A boolean tensor, True where every form in `forms` (Affine) is <= 0."""
    forms: tuple


@dataclasses.dataclass(frozen=True)
class Additive:
    """A float tensor, 0 where every form in `forms` is <= 0 and at most MASKED elsewhere."""
    forms: tuple


@dataclasses.dataclass(frozen=True)
class Const:
    """A tensor of one value everywhere (full, zeros, a scalar tensor)."""
    value: float


MASKED = -1e30   # an additive mask's entry at most this far below 0 masks its score out


def _negated(conj):
    """not (f <= 0) is f >= 1, i.e. 1 - f <= 0, for integer f: only a one-form conjunction has a
    negation that is a conjunction."""
    if not isinstance(conj, Conj) or len(conj.forms) != 1:
        return None
    f = conj.forms[0]
    return Conj((Affine(1 - f.c, tuple(-a for a in f.coef)),))


def _number(x):
    """x as a float where it is a Python number or reads as a Const, else None."""
    if isinstance(x, Const):
        return x.value
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return float(x)
    return None


def _shape(node):
    v = node.meta.get("val") if hasattr(node, "meta") else None
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _expr(s):
    return s.node.expr if isinstance(s, torch.SymInt) else s


def _size1(s):
    return isinstance(s, int) and s == 1 or isinstance(s, torch.SymInt) and s.node.expr == 1


def _aligned(form, rank, shape):
    """form (of a tensor of lower rank) broadcast to `rank` dims, aligned from the right; dims of
    size 1 read index 0, so their coefficients go to 0."""
    if isinstance(form, int):
        return Affine(sympy.Integer(form), (0,) * rank)
    pad = rank - len(form.coef)
    coef = (0,) * pad + form.coef
    return Affine(form.c, tuple(0 if _size1(s) else a for a, s in zip(coef, shape)))


def _remap(x, f):
    """x (Affine, Conj, Additive or Const) with each form's coefficients passed through f."""
    if isinstance(x, Affine):
        return Affine(x.c, f(x.coef))
    if isinstance(x, Const):
        return x
    return type(x)(tuple(Affine(a.c, f(a.coef)) for a in x.forms))


class _Reader:
    """Reads FX nodes as Affine / Conj / Additive / Const (None: not provably such), memoized."""

    def __init__(self):
        self.memo = {}

    def __call__(self, x):
        if isinstance(x, bool):
            return Conj(()) if x else None
        if isinstance(x, (int, float)):
            return x
        if not isinstance(x, torch.fx.Node):
            return None
        if x not in self.memo:
            got = self._read(x)
            shape = _shape(x)
            if isinstance(got, (Affine, Conj, Additive)):   # a dim of size 1 is read at index 0 only
                got = _remap(got, lambda c: tuple(0 if _size1(s) else a for a, s in zip(c, shape)))
            self.memo[x] = got
        return self.memo[x]

    def _read(self, n):
        shape = _shape(n)
        if n.op != "call_function" or shape is None:
            return None
        val = n.meta["val"]
        t, a = n.target, n.args
        rank = len(shape)
        if t in (aten.arange.default, aten.arange.start, aten.arange.start_step):
            if val.dtype.is_floating_point or val.dtype == torch.bool:
                return None
            start = a[0] if t is not aten.arange.default else 0
            step = a[2] if t is aten.arange.start_step and len(a) > 2 else 1
            if not isinstance(start, int) or not isinstance(step, int):
                return None
            return _aligned(Affine(sympy.Integer(start), (step,)), 1, shape)
        if t is aten.add.Tensor and n.kwargs.get("alpha", 1) == 1 and val.dtype.is_floating_point:
            x, y = self(a[0]), self(a[1])    # two additive masks: masked where either is
            if isinstance(x, Additive) and isinstance(y, Additive):
                return Additive(tuple(_aligned(f, rank, shape) for f in x.forms + y.forms))
            return None
        if t in (aten.add.Tensor, aten.sub.Tensor) and n.kwargs.get("alpha", 1) == 1:
            x, y = self(a[0]), self(a[1])
            if not isinstance(x, (Affine, int)) or not isinstance(y, (Affine, int)):
                return None
            x, y = _aligned(x, rank, shape), _aligned(y, rank, shape)
            return x.shifted(y, 1 if t is aten.add.Tensor else -1)
        if t in _COMPARE:
            x, y = self(a[0]), self(a[1])
            if not isinstance(x, (Affine, int)) or not isinstance(y, (Affine, int)):
                return None
            x, y = _aligned(x, rank, shape), _aligned(y, rank, shape)
            lo, hi, strict = _COMPARE[t]    # lo < hi (strict) or lo <= hi, as lo - hi (+1) <= 0
            form = (x, y)[lo].shifted((x, y)[hi], -1)
            return Conj((Affine(form.c + 1, form.coef) if strict else form,))
        if t in _AND:
            x, y = self(a[0]), self(a[1])
            if not isinstance(x, Conj) or not isinstance(y, Conj):
                return None
            return Conj(tuple(_aligned(f, rank, shape) for f in x.forms + y.forms))
        if t in _ALL_TRUE and val.dtype == torch.bool:
            fill = a[1] if t is aten.full.default else (a[2] if t is aten.new_full.default else True)
            return Conj(()) if fill is True or fill == 1 else None
        if t in _NOT and val.dtype == torch.bool:
            return _negated(self(a[0]))
        if val.dtype.is_floating_point:
            got = self._float_mask(t, a, rank, shape)
            if got is not _UNKNOWN:
                return got
        x = self(a[0]) if a else None
        if isinstance(x, Const):
            return x if t in _SAME | _RESHAPE | {aten.unsqueeze.default, aten.expand.default,
                                                aten.slice.Tensor} else None
        if isinstance(x, Additive) and not val.dtype.is_floating_point:
            return None
        if isinstance(x, Conj) and val.dtype != torch.bool:
            return None
        if isinstance(x, Affine) and val.dtype not in (torch.int32, torch.int64):
            return None   # a narrower integer could wrap; a float or a boolean is no index
        if not isinstance(x, (Affine, Conj, Additive)):
            return None
        if t in _SAME:
            return x if len(_shape(a[0])) == rank else None
        if t in _RESHAPE:   # only size-1 dims inserted or removed: the other dims keep their order
            kept_in = [d for d, s in enumerate(_shape(a[0])) if not _size1(s)]
            kept_out = [d for d, s in enumerate(shape) if not _size1(s)]
            if len(kept_in) != len(kept_out) or any(
                    sympy.sympify(_expr(_shape(a[0])[i])) != sympy.sympify(_expr(shape[o]))
                    for i, o in zip(kept_in, kept_out)):
                return None
            src = dict(zip(kept_out, kept_in))
            return _remap(x, lambda c: tuple(c[src[d]] if d in src else 0 for d in range(rank)))
        if t is aten.unsqueeze.default:
            d = a[1] % rank
            return _remap(x, lambda c: c[:d] + (0,) + c[d:])
        if t is aten.expand.default:
            return _remap(x, lambda c: (0,) * (rank - len(c)) + c)
        if t is aten.slice.Tensor:
            d = a[1] % rank if len(a) > 1 else 0
            start = a[2] if len(a) > 2 and a[2] is not None else 0
            step = a[4] if len(a) > 4 else 1
            if not isinstance(start, int) or start < 0 or not isinstance(step, int):
                return None

            def sliced(form):   # the element at idx' is the input's at start + step * idx'
                return Affine(form.c + form.coef[d] * start,
                              form.coef[:d] + (form.coef[d] * step,) + form.coef[d + 1:])
            return sliced(x) if isinstance(x, Affine) else type(x)(tuple(sliced(f) for f in x.forms))
        return None

    def _float_mask(self, t, a, rank, shape):
        """A float node as a Const or an Additive mask; _UNKNOWN where t is none of their makers
        (the caller then reads it as a movement of its input)."""
        if t in _FULL:
            value = {aten.full.default: 1, aten.full_like.default: 1, aten.new_full.default: 2,
                     aten.scalar_tensor.default: 0}.get(t)
            got = _number(a[value]) if value is not None and len(a) > value else 0.0
            return Const(got) if got is not None else None
        if t in _MASKED_FILL or t in _WHERE:
            # (cond, where True, where False): masked_fill(x, cond, v) is v where cond, x elsewhere
            cond, yes, no = (a[1], a[2], a[0]) if t in _MASKED_FILL else a[:3]
            cond, yes, no = self(cond), self(yes), self(no)
            got = _select(cond, yes, no, rank, shape)
            return got if got is not None else _select(_negated(cond), no, yes, rank, shape)
        return _UNKNOWN


def _select(keep, kept, other, rank, shape):
    """The float tensor that is `kept` where Conj `keep` holds and `other` elsewhere, as an
    Additive mask: kept 0 (or an Additive, whose mask then narrows) and other at most MASKED."""
    low = _number(other)
    if not isinstance(keep, Conj) or low is None or low > MASKED:
        return None
    forms = tuple(_aligned(f, rank, shape) for f in keep.forms)
    if _number(kept) == 0:
        return Additive(forms)
    if isinstance(kept, Additive):
        return Additive(tuple(_aligned(f, rank, shape) for f in kept.forms) + forms)
    return None


_UNKNOWN = object()
_FULL = {aten.full.default, aten.full_like.default, aten.new_full.default, aten.scalar_tensor.default,
         aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default}
_MASKED_FILL = {aten.masked_fill.Scalar, aten.masked_fill.Tensor}
_WHERE = {aten.where.self, aten.where.Scalar, aten.where.ScalarSelf, aten.where.ScalarOther}
_NOT = {aten.bitwise_not.default, aten.logical_not.default}
# comparison -> (index of the lesser side, of the greater, strict)
_COMPARE = {aten.le.Tensor: (0, 1, False), aten.lt.Tensor: (0, 1, True),
            aten.ge.Tensor: (1, 0, False), aten.gt.Tensor: (1, 0, True),
            aten.le.Scalar: (0, 1, False), aten.lt.Scalar: (0, 1, True),
            aten.ge.Scalar: (1, 0, False), aten.gt.Scalar: (1, 0, True)}
_RESHAPE = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.squeeze.dim,
            aten.squeeze.dims, aten.squeeze.default}
_AND = {aten.__and__.Tensor, aten.bitwise_and.Tensor, aten.logical_and.default}
_ALL_TRUE = {aten.new_ones.default, aten.ones.default, aten.full.default, aten.new_full.default}
# ops whose result, element for element, is their first input's
_SAME = {aten.alias.default, aten.clone.default, aten._to_copy.default, aten.to.dtype,
         aten.to.dtype_layout, aten.contiguous.default, aten.detach.default, aten.lift_fresh_copy.default}


def _holds(e, example):
    """e <= 0 for every size (True), for the example only (False), or not even there (None):
    e is linear in the size symbols, each at least 1."""
    e = sympy.expand(e)
    at_example = e.subs(example)
    if not at_example.is_number or at_example > 0:
        return None
    syms = sorted(e.free_symbols, key=str)
    if not syms:
        return True
    poly = sympy.Poly(e, *syms)
    if poly.total_degree() <= 1 and all(poly.coeff_monomial(s) <= 0 for s in syms) \
            and e.subs({s: 1 for s in syms}) <= 0:
        return True
    return False


def causal_attention(graph, expr, example, holds=lambda e: False) -> list:
    """Rewrites, in place, every SDPA call of `graph` whose mask (boolean, or additive) is provably
    causal over equal query and key lengths to attn_mask=None, is_causal=True. expr: a size
    (SymInt or int) as a sympy expression over the capture's symbols; example: {symbol: example
    size}; holds(e): e <= 0 for every size the capture serves (symbols.holds_for_sizes over the
    export's ranges, which its guards narrow). A mask that is causal only for some sizes (a sliding
    window as long as the sequence) is rewritten where those are all the sizes served: the rewrite
    never narrows what the capture serves. Returns one note per call rewritten."""
    if _SDPA is None:
        return []
    read, notes = _Reader(), []
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target is not _SDPA:
            continue
        bound = dict(zip(_SDPA_ARGS, n.args))
        bound.update(n.kwargs)
        mask = bound.get("attn_mask")
        if not isinstance(mask, torch.fx.Node) or bound.get("is_causal"):
            continue
        q, k = _shape(bound["query"]), _shape(bound["key"])
        mshape = _shape(mask)
        if q is None or k is None or mshape is None or len(mshape) < 2:
            continue
        try:
            length = sympy.simplify(expr(q[-2]))
            if length != sympy.simplify(expr(k[-2])):
                continue   # torch's is_causal aligns the triangle top-left; a cache's mask is bottom-right
            got = read(mask)
            if isinstance(got, Additive) if mask.meta["val"].dtype.is_floating_point else \
                    mask.meta["val"].dtype == torch.bool:
                got = Conj(got.forms) if isinstance(got, Additive) else got
            else:
                got = None
            needed = _causal_needs(got, len(mshape), length, example)
            if needed is not None and not all(holds(e) for e in needed):
                needed = None
        except Exception:  # noqa: BLE001 - a mask this reading cannot follow stays as it is
            needed = None
        if needed is None:
            continue
        kwargs = {name: bound[name] for name in _SDPA_ARGS[4:] if name in bound}
        kwargs.update(attn_mask=None, is_causal=True)
        n.args, n.kwargs = tuple(bound[name] for name in _SDPA_ARGS[:3]), kwargs
        notes.append(f"{n.name}: its mask {mask.name} is causal; SDPA runs with is_causal=True"
                     + (f" (the export's guards hold {', '.join(f'{g} <= 0' for g in needed)})" if needed else ""))
    return notes


def _causal_needs(conj, rank, length, example):
    """The relations (each e <= 0) under which conj, a mask over (..., query i, key j) of `length`
    both ways, is exactly j <= i; None where it is not (or is not provably) so."""
    if not isinstance(conj, Conj):
        return None
    qi, kj = rank - 2, rank - 1
    forms = []
    for f in conj.forms:
        if any(a != 0 for d, a in enumerate(f.coef) if d not in (qi, kj)):
            return None   # a mask that differs across batch or heads
        forms.append((sympy.sympify(f.c), sympy.sympify(f.coef[qi]), sympy.sympify(f.coef[kj])))
    causal = [f for f in forms if f[0] == 0 and f[2] > 0 and f[1] == -f[2]]
    if not causal:
        return None
    last = length - 1
    needs = []
    for c, ai, aj in forms:
        if (c, ai, aj) == causal[0]:
            continue
        for i, j in ((0, 0), (last, 0), (last, last)):   # the triangle 0 <= j <= i <= last
            e = c + ai * i + aj * j
            held = _holds(e, example)
            if held is None:
                return None
            if held is False:
                needs.append(sympy.expand(e))
    return needs
