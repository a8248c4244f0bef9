"""Training calls replayed from real CUDA graphs (kbench/runtime/train_graphs.py) against the same
module un-graphed (cuda_graphs="inference": the same kernels, launched one by one): training steps
with BatchNorm, dropout and an optimizer; bf16 autocast; a backward after a newer replay (the
forward recomputed with the random numbers its replay drew); a Hugging Face GPT-2 trained for a
few steps."""
import copy

import pytest
import torch

import kbench
from kbench.runtime import graphs

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(64, 256)
        self.bn = torch.nn.BatchNorm1d(256)
        self.drop = torch.nn.Dropout(0.2)
        self.ln = torch.nn.LayerNorm(256)
        self.fc2 = torch.nn.Linear(256, 10)

    def forward(self, x):
        h = self.drop(torch.nn.functional.gelu(self.bn(self.fc1(x))))
        return self.fc2(self.ln(h))


def twins(model, x, **kw):
    """(graphed, un-graphed twin, twin's model): the same weights, no model gate."""
    other = copy.deepcopy(model)
    kw = {"budget": "none", "verbose": False, "gate": False, **kw}
    return (kbench.optimize(model, (x,), cuda_graphs=True, **kw),
            kbench.optimize(other, (x,), cuda_graphs="inference", **kw), other)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def step(m, opt, x, y, seed):
    torch.manual_seed(seed)              # the same dropout masks for both
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(m(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def test_training_steps_replayed_with_batchnorm_dropout_and_adamw():
    torch.manual_seed(0)
    model = Net().cuda().train()
    x = torch.randn(128, 64, device="cuda")
    fast, slow, other = twins(model, x)
    oa, ob = torch.optim.AdamW(model.parameters(), 1e-3), torch.optim.AdamW(other.parameters(), 1e-3)
    for i in range(graphs.WARMUP + 5):
        xi = torch.randn(128, 64, device="cuda")
        yi = torch.randint(0, 10, (128,), device="cuda")
        la, lb = step(fast, oa, xi, yi, i), step(slow, ob, xi, yi, i)
        assert rel(la, lb) <= 1e-5, i
    for p, q in zip(model.parameters(), other.parameters()):
        assert rel(p, q) <= 1e-5
    assert rel(model.bn.running_var, other.bn.running_var) <= 1e-5
    runner = fast._kbench_graphs
    (entry,) = runner.train.graphed()
    assert entry.replays == 5 and entry.backward_replays == 5
    assert "training [(128, 64) float32]: graphed" in str(fast.kbench_report)


def test_bf16_autocast_training_replays_match():
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256),
                                torch.nn.LayerNorm(256)).cuda().train()
    x = torch.randn(64, 256, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        fast, slow, other = twins(model, x)
        for i in range(graphs.WARMUP + 3):
            xi = torch.randn(64, 256, device="cuda")
            ga = torch.autograd.grad(fast(xi).float().square().mean(), list(model.parameters()))
            gb = torch.autograd.grad(slow(xi).float().square().mean(), list(other.parameters()))
            for a, b in zip(ga, gb):
                assert rel(a, b) <= 2e-2, i
    assert fast._kbench_graphs.train.graphed()


def test_a_backward_after_a_newer_replay_draws_the_same_dropout_masks():
    torch.manual_seed(2)
    model = Net().cuda().train()
    x = torch.randn(128, 64, device="cuda")
    fast, slow, other = twins(model, x)
    for i in range(graphs.WARMUP + 1):
        for m in (fast, slow):
            torch.manual_seed(i)
            m(x).square().mean().backward()
    x1, x2 = torch.randn(128, 64, device="cuda"), torch.randn(128, 64, device="cuda")
    grads = []
    for m, mod in ((fast, model), (slow, other)):
        mod.zero_grad()
        torch.manual_seed(10)
        first = m(x1).square().mean()
        first.backward(retain_graph=True)
        torch.manual_seed(11)
        m(x2).square().mean().backward()
        first.backward()                  # the graph now holds x2's step: x1's is recomputed
        grads.append([p.grad.clone() for p in mod.parameters()])
    for a, b in zip(*grads):
        assert rel(a, b) <= 1e-5
    assert rel(model.bn.running_mean, other.bn.running_mean) <= 1e-5


def test_hugging_face_gpt2_trains_from_graphs():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=128, vocab_size=512, n_positions=128)
    torch.manual_seed(3)
    model = transformers.GPT2LMHeadModel(config).cuda().train()
    ids = torch.randint(0, 512, (4, 64), device="cuda")
    other = copy.deepcopy(model)
    kw = {"budget": "none", "verbose": False, "gate": False}
    fast = kbench.optimize(model, (ids,), example_kwargs={"labels": ids}, cuda_graphs=True, **kw)
    slow = kbench.optimize(other, (ids,), example_kwargs={"labels": ids}, cuda_graphs="inference", **kw)
    oa, ob = torch.optim.AdamW(model.parameters(), 1e-3), torch.optim.AdamW(other.parameters(), 1e-3)
    for i in range(graphs.WARMUP + 4):
        batch = torch.randint(0, 512, (4, 64), device="cuda")
        losses = []
        for m, o in ((fast, oa), (slow, ob)):
            torch.manual_seed(i)
            o.zero_grad()
            loss = m(batch, labels=batch).loss
            loss.backward()
            o.step()
            losses.append(loss.detach())
        assert rel(*losses) <= 1e-4, i
    runner = fast._kbench_graphs
    assert not isinstance(runner, str), runner
    assert any(e.replays >= 3 for e in runner.train.graphed()), runner.describe()
