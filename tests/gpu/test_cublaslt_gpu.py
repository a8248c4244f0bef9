"""kbench.runtime.cublaslt on a GPU: every epilogue against torch in float32 on the same (rounded)
inputs, GELU as the tanh approximation; DGELU_BGRAD against autograd of gelu_tanh(x·wᵀ + b);
BGRADB against a column sum; M not a multiple of 16, N and K multiples of 8 but not 16 (and odd
sizes where cuBLASLt has an algorithm); a batch; both B layouts; the error for an unaligned aux."""
import pytest
import torch
import torch.nn.functional as F

from kbench.runtime import cublaslt

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

DEV = "cuda"
BF, F16, F32 = torch.bfloat16, torch.float16, torch.float32
# the output's rounding (2^-8 bf16, 2^-11 f16) with room for f32 accumulation order, relative
# to the largest magnitude of the reference
TOL = {BF: 2 ** -7, F16: 2 ** -9, F32: 1e-5}
SHAPES = [(64, 128, 64), (37, 40, 24), (129, 200, 72)]   # (M, N, K)


def rnd(*shape, dtype=BF, scale=1.0):
    return (torch.randn(*shape, device=DEV) * scale).to(dtype)


def close(got, want, dtype, what=""):
    got, want = got.float(), want.float()
    err = (got - want).abs().max().item()
    bound = TOL[dtype] * (want.abs().max().item() + 1e-3)
    assert err <= bound, f"{what}: max |error| {err:.3g} over {bound:.3g} (max |want| {want.abs().max().item():.3g})"


def gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


def test_available_names_the_library():
    ok, why = cublaslt.available()
    assert ok, why
    assert "libcublasLt.so" in why


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [BF, F16])
@pytest.mark.parametrize("b_transposed", [True, False])
@pytest.mark.parametrize("epilogue", ["none", "bias", "relu_bias", "gelu_bias"])
def test_forward_epilogues(shape, dtype, b_transposed, epilogue):
    torch.manual_seed(0)
    m, n, k = shape
    a = rnd(m, k, dtype=dtype)
    b = rnd(n, k, dtype=dtype) if b_transposed else rnd(k, n, dtype=dtype)
    bias = rnd(n, dtype=dtype) if epilogue != "none" else None
    d = cublaslt.matmul(a, b, b_transposed=b_transposed, bias=bias, epilogue=epilogue)
    want = a.float() @ (b.float().t() if b_transposed else b.float())
    if bias is not None:
        want = want + bias.float()
    want = {"relu_bias": torch.relu, "gelu_bias": gelu_tanh}.get(epilogue, lambda x: x)(want)
    assert d.shape == (m, n) and d.dtype == dtype and d.is_contiguous()
    close(d, want, dtype, epilogue)


@pytest.mark.parametrize("shape", SHAPES)
def test_gelu_aux_bias_writes_the_pre_activation(shape):
    torch.manual_seed(1)
    m, n, k = shape
    x, w, b = rnd(m, k), rnd(n, k), rnd(n)
    d, aux = cublaslt.matmul(x, w, b_transposed=True, bias=b, epilogue="gelu_aux_bias")
    h = x.float() @ w.float().t() + b.float()
    close(aux, h, BF, "aux")
    close(d, gelu_tanh(h), BF, "gelu")
    assert aux.shape == (m, n) and aux.stride(0) % 8 == 0
    # a caller's aux, rows 8 elements wider than needed, is written where it says
    buf = torch.full((m, n + 8 + (-n) % 8), 7.0, device=DEV, dtype=BF)
    d2, aux2 = cublaslt.matmul(x, w, b_transposed=True, bias=b, epilogue="gelu_aux_bias", aux=buf[:, :n])
    assert aux2.data_ptr() == buf.data_ptr()
    close(aux2, h, BF, "caller's aux")   # another leading dimension may be another algorithm
    close(d2, gelu_tanh(h), BF, "gelu, caller's aux")
    assert (buf[:, n:] == 7).all()   # the padding is not written


def test_mlp_backward_dgelu_bgrad_and_bgradb_match_autograd():
    """An MLP's backward through gelu_tanh(x·w1ᵀ + b1)·w2ᵀ: the grad into the GELU output
    dY = dZ·w2 with DGELU_BGRAD gives dH = dY·gelu'(H) and db1; then dX = dH·w1 and
    dW1 = dHᵀ·X (BGRADB: db1 again, as the column sum of dH)."""
    torch.manual_seed(2)
    m, k, n, p = 96, 72, 120, 40
    x, w1, b1, w2 = rnd(m, k), rnd(n, k, scale=0.2), rnd(n), rnd(p, n, scale=0.2)
    dz = rnd(m, p)
    _, h = cublaslt.matmul(x, w1, b_transposed=True, bias=b1, epilogue="gelu_aux_bias")
    dh, db1 = cublaslt.matmul(dz, w2, b_transposed=False, epilogue="dgelu_bgrad", aux=h)
    # autograd of gelu_tanh at the saved pre-activation, in f32 from the same bf16 values
    hf = h.float().requires_grad_()
    gelu_tanh(hf).backward(dz.float() @ w2.float())
    close(dh, hf.grad, BF, "dH")
    close(db1, hf.grad.sum(0), BF, "db1")
    dh_only = cublaslt.matmul(dz, w2, b_transposed=False, epilogue="dgelu", aux=h)
    close(dh_only, hf.grad, BF, "dH (dgelu)")
    dx = cublaslt.matmul(dh, w1, b_transposed=False)
    close(dx, dh.float() @ w1.float(), BF, "dX")
    dw1, db1_b = cublaslt.matmul(dh.t(), x, b_transposed=False, epilogue="bgradb")
    close(dw1, dh.float().t() @ x.float(), BF, "dW1")
    close(db1_b, dh.float().sum(0), BF, "db1 (bgradb)")


def test_bgradb_is_the_column_sum_of_dy():
    torch.manual_seed(3)
    dy, x = rnd(200, 56), rnd(200, 24)
    dw, db = cublaslt.matmul(dy.t(), x, b_transposed=False, epilogue="bgradb")
    assert dw.shape == (56, 24) and db.shape == (56,)
    close(dw, dy.float().t() @ x.float(), BF, "dW")
    close(db, dy.float().sum(0), BF, "db")


def test_batch_with_a_shared_weight_and_a_batched_b():
    torch.manual_seed(4)
    bsz, m, n, k = 3, 37, 40, 24
    x, w, b = rnd(bsz, m, k), rnd(n, k), rnd(n)
    d, aux = cublaslt.matmul(x, w, b_transposed=True, bias=b, epilogue="gelu_aux_bias")
    h = x.float() @ w.float().t() + b.float()
    assert d.shape == aux.shape == (bsz, m, n)
    close(aux, h, BF, "aux")
    close(d, gelu_tanh(h), BF, "d")
    bb = rnd(bsz, k, n)
    close(cublaslt.matmul(x, bb, b_transposed=False), torch.bmm(x.float(), bb.float()), BF, "bmm")


def test_transposed_views_and_tf32():
    torch.manual_seed(5)
    a_t, b = rnd(24, 37), rnd(40, 24)   # a = a_tᵀ, column-major
    close(cublaslt.matmul(a_t.t(), b, b_transposed=True), a_t.float().t() @ b.float().t(), BF, "aᵀ")
    a, w = rnd(64, 128, dtype=F32), rnd(96, 128, dtype=F32)
    want = (a.double() @ w.double().t()).float()
    close(cublaslt.matmul(a, w, b_transposed=True), want, F32, "f32")
    d = cublaslt.matmul(a, w, b_transposed=True, tf32=True)
    err = (d - want).abs().max().item()
    assert err < 2e-2 * want.abs().max().item()


@pytest.mark.parametrize("epilogue", ["none", "bias"])
def test_odd_sizes_are_right_or_refused(epilogue):
    """N and K odd: 2-byte aligned rows. cuBLASLt either has an algorithm (the result must be
    right) or says it has none (NotImplementedError), never a wrong result."""
    torch.manual_seed(6)
    m, n, k = 33, 51, 19
    x, w, b = rnd(m, k), rnd(n, k), rnd(n)
    try:
        d = cublaslt.matmul(x, w, b_transposed=True, bias=b if epilogue == "bias" else None, epilogue=epilogue)
    except NotImplementedError as e:
        assert "has no algorithm" in str(e)
        return
    want = x.float() @ w.float().t() + (b.float() if epilogue == "bias" else 0)
    close(d, want, BF, epilogue)


def test_unaligned_aux_ld_is_refused_before_running():
    x, w, b = rnd(16, 32), rnd(10, 32), rnd(10)
    aux = torch.empty(16, 12, device=DEV, dtype=BF)[:, :10]
    with pytest.raises(ValueError, match="aux: leading dimension 12: cuBLASLt needs a multiple of 8"):
        cublaslt.matmul(x, w, b_transposed=True, bias=b, epilogue="gelu_aux_bias", aux=aux)


def test_runs_on_the_current_stream():
    torch.manual_seed(7)
    x, w = rnd(512, 256), rnd(512, 256)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        d = cublaslt.matmul(x, w, b_transposed=True)
        ws_key = (x.device.index, s.cuda_stream)
    s.synchronize()
    assert ws_key in cublaslt._workspaces   # the side stream got its own workspace
    close(d, x.float() @ w.float().t(), BF, "side stream")
