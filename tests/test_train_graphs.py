"""CUDA graphs for training calls without a GPU (kbench/runtime/train_graphs.py): warm-up, capture
and replays of forward + backward through one autograd node, each hazard's guard — two forwards
before one backward, a second backward (retain_graph), a backward after a newer replay,
create_graph, gradient accumulation, outputs given no gradient, a tensor changed between forward
and backward — on the interp backend with a stand-in graph (tests/_train_graph_standin.py). Every
result is compared bit for bit with the same module un-graphed. On a GPU, with real graphs:
tests/gpu/test_train_graphs_gpu.py."""
import copy

import pytest
import torch

import kbench
from kbench.runtime import graphs, train_graphs
from tests._train_graph_standin import fake_capture_for


class Net(torch.nn.Module):
    def __init__(self, bn=False):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.norm = torch.nn.BatchNorm1d(32) if bn else torch.nn.LayerNorm(32)
        self.fc2 = torch.nn.Linear(32, 4)
        self.side = torch.nn.Linear(16, 3)     # reaches only the second output

    def forward(self, x):
        h = torch.nn.functional.gelu(self.norm(self.fc1(x)))
        return self.fc2(h), self.side(x).tanh()


def pair(bn=False, option=True):
    """(graphed module, its un-graphed twin on a copy of the same weights, the twin's model, runner)."""
    torch.manual_seed(0)
    model = Net(bn).train()
    twin_model = copy.deepcopy(model)
    x = torch.randn(8, 16)
    kw = dict(backend="interp", budget="none", verbose=False)
    opt = kbench.optimize(model, (x,), **kw)
    twin = kbench.optimize(twin_model, (x,), cuda_graphs=False, **kw)
    slot = "_kbench_fast_program" if opt._kbench_spec.plain else "_kbench_fast_flat"
    runner = graphs.GraphRunner(opt, opt.__dict__[slot], option, capture=fake_capture_for(opt._kbench_orig))
    opt.__dict__.update({"_kbench_graphs": runner, slot: runner})
    return opt, twin, twin_model, runner


def same_params(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def same_grads(a, b):
    for p, q in zip(a.parameters(), b.parameters()):
        if (p.grad is None) != (q.grad is None) or (p.grad is not None and not torch.equal(p.grad, q.grad)):
            return False
    return True


def loss_of(out):
    return out[0].square().mean() + out[1].mean()


def warm_up(opt, twin, n=graphs.WARMUP):
    for _ in range(n):
        x = torch.randn(8, 16)
        for m in (opt, twin):
            loss_of(m(x)).backward()


def captured(bn=False):
    """pair(), past its warm-up and capture, with no gradients held."""
    opt, twin, twin_model, runner = pair(bn)
    warm_up(opt, twin, graphs.WARMUP + 1)
    for m in (opt._kbench_orig, twin_model):
        m.zero_grad()
    return opt, twin, twin_model, runner


def test_training_steps_are_replayed_and_give_the_un_graphed_bits():
    opt, twin, twin_model, runner = pair(bn=True)
    model = opt._kbench_orig
    sgd, sgd2 = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(twin_model.parameters(), lr=0.1)
    for step in range(graphs.WARMUP + 3):
        x = torch.randn(8, 16)
        for m, o in ((opt, sgd), (twin, sgd2)):
            o.zero_grad()
            loss_of(m(x)).backward()
            o.step()
        assert same_params(model, twin_model), step
        assert torch.equal(model.norm.running_mean, twin_model.norm.running_mean)
    (entry,) = runner.train.graphed()
    assert entry.replays == 3 and entry.backward_replays == 3
    assert runner.train.entries[entry.key].fwd.replays == 3
    text = str(opt.kbench_report)
    assert "CUDA graphs: training [(8, 16) float32]: graphed (forward + 1 backward graph(s)); 3 replay(s)" in text


def test_gradient_accumulation_adds_and_never_aliases_the_graphs_buffers():
    opt, twin, twin_model, runner = pair()
    warm_up(opt, twin)
    model = opt._kbench_orig
    for m in (model, twin_model):
        m.zero_grad(set_to_none=False)
    for _ in range(3):                       # three micro-batches, one optimizer step
        x = torch.randn(8, 16)
        for m in (opt, twin):
            loss_of(m(x)).backward()
    assert runner.train.graphed()[0].backward_replays == 3
    assert same_grads(model, twin_model)
    entry = runner.train.graphed()[0]
    held = {g.data_ptr() for b in entry.backward.values() for g in b.results if g is not None}
    assert not held & {p.grad.data_ptr() for p in model.parameters()}


def test_a_gradient_a_hook_keeps_is_not_rewritten_by_the_next_replay():
    opt, twin, _, runner = pair()
    warm_up(opt, twin, graphs.WARMUP + 1)
    kept = {opt: [], twin: []}
    for _ in range(graphs.WARMUP + 2):           # inputs that want gradients: a signature of their own
        x = torch.randn(8, 16)
        for m in (opt, twin):
            xi = x.clone().requires_grad_()
            xi.register_hook(kept[m].append)     # the very tensor autograd hands the input
            loss_of(m(xi)).backward()
    (entry,) = [e for e in runner.train.graphed() if e.key[1] == (True,)]
    assert entry.backward_replays == 2
    for a, b in zip(kept[opt], kept[twin]):
        assert torch.equal(a, b)


def test_two_forwards_before_one_backward():
    opt, twin, twin_model, runner = captured()
    x1, x2 = torch.randn(8, 16), torch.randn(8, 16)
    a, b = opt(x1), opt(x2)                  # the second runs un-graphed: the first's backward is pending
    (loss_of(a) + 2 * loss_of(b)).backward()
    c, d = twin(x1), twin(x2)
    (loss_of(c) + 2 * loss_of(d)).backward()
    assert same_grads(opt._kbench_orig, twin_model)
    assert runner.skipped.get(train_graphs.PENDING) == 1


def test_a_forward_whose_outputs_were_dropped_is_not_pending():
    opt, twin, _, runner = pair()
    warm_up(opt, twin, graphs.WARMUP + 1)
    replays = runner.replays
    opt(torch.randn(8, 16))                  # outputs dropped, never differentiated
    opt(torch.randn(8, 16))
    assert runner.replays == replays + 2 and train_graphs.PENDING not in runner.skipped


def test_a_second_backward_with_retain_graph():
    opt, twin, twin_model, runner = captured()
    x = torch.randn(8, 16)
    for m in (opt, twin):
        loss = loss_of(m(x))
        loss.backward(retain_graph=True)
        loss.backward()
    assert same_grads(opt._kbench_orig, twin_model)


def test_a_backward_after_a_newer_replay_recomputes_its_forward():
    opt, twin, twin_model, runner = captured(bn=True)
    x1, x2 = torch.randn(8, 16), torch.randn(8, 16)
    for m in (opt, twin):
        first = loss_of(m(x1))
        first.backward(retain_graph=True)
        loss_of(m(x2)).backward()            # replays the graph: its activations are x2's now
        first.backward()                     # x1's again: recomputed from x1
    assert same_grads(opt._kbench_orig, twin_model)
    # the recomputation put BatchNorm's statistics back: two forwards' updates, not three
    assert torch.equal(opt._kbench_orig.norm.running_mean, twin_model.norm.running_mean)


def test_create_graph_gives_differentiable_gradients():
    opt, twin, twin_model, runner = captured()
    x = torch.randn(8, 16)
    for m in (opt, twin):
        xi = x.clone().requires_grad_()
        (gx,) = torch.autograd.grad(loss_of(m(xi)), xi, create_graph=True)
        gx.square().sum().backward()         # a gradient penalty
    assert same_grads(opt._kbench_orig, twin_model)


def test_an_output_given_no_gradient_leaves_what_only_it_reaches_without_one():
    opt, twin, twin_model, runner = captured()
    x = torch.randn(8, 16)
    for _ in range(2):   # the first meets the pattern (recomputed), the next call captures its graph
        for m in (opt, twin):
            m(x)[0].sum().backward()             # the second output gets none
        assert opt._kbench_orig.side.weight.grad is None and twin_model.side.weight.grad is None
        assert same_grads(opt._kbench_orig, twin_model)
    (entry,) = runner.train.graphed()
    assert len(entry.backward) == 2 and entry.backward_replays == 2   # the warm-up's last, and this one


class Tagged(torch.nn.Module):
    """An embedding of ids held in a buffer (BERT's token types): its backward saves the buffer."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(4, 16)
        self.register_buffer("ids", torch.tensor([0, 1, 2, 3, 0, 1, 2, 3]))
        self.fc = torch.nn.Linear(16, 4)

    def forward(self, x):
        h = self.fc(x + self.emb(self.ids)[:, None, :].sum(1))
        return h, h.tanh()


def test_a_buffer_written_between_steps_leaves_later_backward_captures_working():
    torch.manual_seed(0)
    model = Tagged()
    x = torch.randn(8, 16)
    opt = kbench.optimize(model, (x,), backend="interp", budget="none", verbose=False)
    runner = graphs.GraphRunner(opt, opt.__dict__["_kbench_fast_program"], True,
                                capture=fake_capture_for(model))
    opt.__dict__.update({"_kbench_graphs": runner, "_kbench_fast_program": runner})
    for _ in range(graphs.WARMUP + 1):
        loss_of(opt(x)).backward()
    model.ids.copy_(model.ids.clone())       # a tracked write (the model gate's restore, a user's)
    for _ in range(2):
        opt(x)[0].sum().backward()           # a new pattern: recomputed, then captured at the next call
    (entry,) = runner.train.graphed()
    assert all(not isinstance(b, str) for b in entry.backward.values()), entry.backward
    assert len(entry.backward) == 2


def test_a_parameter_changed_between_forward_and_backward_raises():
    opt, twin, _, runner = pair()
    warm_up(opt, twin, graphs.WARMUP + 1)
    out = opt(torch.randn(8, 16))
    with torch.no_grad():
        opt._kbench_orig.fc1.weight.add_(1)
    with pytest.raises(RuntimeError, match="changed in place between its forward and its backward"):
        loss_of(out).backward()


def test_inputs_that_want_gradients_get_them():
    opt, twin, twin_model, runner = pair()
    for _ in range(graphs.WARMUP + 2):
        x = torch.randn(8, 16)
        xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
        for m, xi in zip((opt, twin), xs):
            loss_of(m(xi)).backward()
        assert torch.equal(xs[0].grad, xs[1].grad)
    assert runner.train.graphed()[0].replays == 2


def test_a_parameter_hook_keeps_training_un_graphed():
    opt, twin, _, runner = pair()
    opt._kbench_orig.fc2.weight.register_hook(lambda g: g * 2)
    warm_up(opt, twin, graphs.WARMUP + 2)
    assert not runner.train.graphed()
    assert any("gradient hook" in line for line in runner.describe())


def test_inference_option_leaves_training_calls_un_graphed():
    opt, twin, _, runner = pair(option="inference")
    assert runner.train is None
    warm_up(opt, twin, graphs.WARMUP + 2)
    assert runner.skipped == {graphs.WANTS_GRAD: graphs.WARMUP + 2}


def test_new_parameters_drop_the_training_graphs_and_a_pending_backward_recomputes():
    opt, twin, twin_model, runner = captured()
    x = torch.randn(8, 16)
    out = opt(x)
    ref = twin(x)
    runner._drop("a test")                   # as a replaced parameter does at the next call
    loss_of(out).backward()
    loss_of(ref).backward()
    assert same_grads(opt._kbench_orig, twin_model)
    assert not runner.train.graphed()


class Twice(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 4)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.fc(x))
        return h, h                               # one tensor, two outputs


def test_outputs_sharing_memory_and_subclass_parameters_are_not_graphed():
    torch.manual_seed(0)
    model = Twice()
    x = torch.randn(8, 16)
    opt = kbench.optimize(model, (x,), backend="interp", budget="none", verbose=False)
    runner = graphs.GraphRunner(opt, opt.__dict__["_kbench_fast_program"], True, capture=fake_capture_for(model))
    opt.__dict__.update({"_kbench_graphs": runner, "_kbench_fast_program": runner})
    for _ in range(graphs.WARMUP + 2):
        a, b = opt(x)
        (a.sum() + b.sum()).backward()
    assert not runner.train.graphed()
    assert any("share memory" in line for line in runner.describe()), runner.describe()

    class Marked(torch.Tensor):
        pass
    assert "tensor subclass" in train_graphs.blockers([torch.zeros(2).as_subclass(Marked)])
    assert train_graphs.blockers([torch.nn.Parameter(torch.zeros(2)), torch.zeros(2)]) == ""


def test_fresh_copies_are_one_allocation_per_dtype_and_never_the_graphs_memory():
    sources = [torch.randn(3, 5), None, torch.randn(7), torch.randn(4, 6).t(), torch.randn(2, dtype=torch.float64),
               torch.randn(9)]
    got = train_graphs.fresh_copies(sources)
    assert got[1] is None
    for g, s in zip(got, sources):
        if s is not None:
            assert g.dtype == s.dtype and g.shape == s.shape and g.stride() == s.stride()
            torch.testing.assert_close(g, s, rtol=0, atol=0)
            assert g.untyped_storage().data_ptr() != s.untyped_storage().data_ptr()
    dense_f32 = [got[0], got[2], got[5]]
    assert len({g.untyped_storage().data_ptr() for g in dense_f32}) == 1
    assert all(g.data_ptr() % 64 == 0 for g in dense_f32)
    sources[0].add_(1)   # the graph's buffer rewritten by a later replay: the copies keep their values
    assert not torch.equal(got[0], sources[0])
