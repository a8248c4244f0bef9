"""Judging a result against float64 by eager's own error: a 16-bit computation (or a gradient made
of rounding noise) is as right as eager's if it is no further from the float64 recomputation than
twice eager is, or within a fixed tolerance."""


def rel(a, b, floor=1e-6) -> float:
    """max |a - b| over max |b| (at least floor)."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(floor))


def assert_grads_as_exact_as_eager(inputs, model, twin, exact, tol):
    """inputs: (ours, eager's, float64's) gradient of each input; then every parameter of model
    (kbench's), twin (eager's) and exact (a float64 copy), after a backward of each. A gradient that
    is zero in exact arithmetic is judged on the parameters' gradient scale (floor)."""
    scale = max(float(q.grad.abs().max()) for q in exact.parameters())
    pairs = [("input", *g) for g in inputs] + [
        (n, p.grad, q.grad, r.grad)
        for (n, p), q, r in zip(model.named_parameters(), twin.parameters(), exact.parameters())]
    for n, ours, eager, ref in pairs:
        mine, theirs = rel(ours, ref, floor=1e-3 * scale), rel(eager, ref, floor=1e-3 * scale)
        assert mine <= max(tol, 2 * theirs), (n, mine, theirs)
