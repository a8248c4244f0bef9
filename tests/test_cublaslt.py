"""kbench.runtime.cublaslt without a GPU: a missing library is a clear error, and every argument check
raises before the library is needed (CPU tensors stand in: only their metadata is read)."""
import pytest
import torch

from kbench import _C
from kbench.runtime import cublaslt

BF = torch.bfloat16


def test_missing_library_names_every_attempt():
    with pytest.raises(FileNotFoundError, match="cuBLASLt \\(libcublasLt\\) not found") as e:
        _C.lt_open(["/nonexistent/libcublasLt.so.13", "/nonexistent/libcublasLt.so.12"])
    assert "/nonexistent/libcublasLt.so.13" in str(e.value) and "/nonexistent/libcublasLt.so.12" in str(e.value)
    with pytest.raises(FileNotFoundError, match="libm.so.6 has no cublasLtCreate"):
        _C.lt_open(["libm.so.6"])


@pytest.fixture
def no_library(monkeypatch):
    monkeypatch.setattr(cublaslt, "library_candidates", lambda: ["/nonexistent/libcublasLt.so.13"])
    cublaslt.handle.cache_clear()
    yield
    cublaslt.handle.cache_clear()


def test_unavailable_says_why(no_library):
    ok, why = cublaslt.available()
    assert not ok and "cuBLASLt is not available" in why and "/nonexistent/libcublasLt.so.13" in why
    a, w = torch.zeros(4, 8, dtype=BF), torch.zeros(16, 8, dtype=BF)
    with pytest.raises(RuntimeError, match="cuBLASLt is not available"):
        cublaslt.matmul(a, w, b_transposed=True)


def test_candidates_end_with_the_sonames(monkeypatch):
    monkeypatch.setenv("KBENCH_CUBLASLT", "/opt/x/libcublasLt.so.13")
    names = cublaslt.library_candidates()
    assert names[0] == "/opt/x/libcublasLt.so.13"
    assert names[-2:] == ["libcublasLt.so.13", "libcublasLt.so.12"]


def z(*shape, dtype=BF):
    return torch.zeros(*shape, dtype=dtype)


M, N, K = 6, 10, 4
A, W, BIAS = z(M, K), z(N, K), z(N)
H = z(M, 16)[:, :N]   # a pre-activation with rows 16 elements apart


@pytest.mark.parametrize("call,exc,match", [
    (dict(a=z(M, K, dtype=torch.float64)), ValueError, "bf16, f16 or f32 operands; a is torch.float64"),
    (dict(a=z(M, K, dtype=torch.int32)), ValueError, "a is torch.int32"),
    (dict(b=z(N, K, dtype=torch.float16)), ValueError, "every operand must be one dtype"),
    (dict(bias=z(N, dtype=torch.float32), epilogue="bias"), ValueError, "bias: every operand must be one dtype"),
    (dict(a=z(M, K, 2)), ValueError, None),                                      # a 3-D a against 2-D b: batch 6 of [K, 2]
    (dict(a=z(2, 3, M, K)), ValueError, "4 dimensions"),
    (dict(b=z(N, K + 1)), ValueError, "b is \\[5, 10\\]; \\[4, 10\\] expected"),
    (dict(b_transposed=False), ValueError, "b is \\[10, 4\\]; \\[4, 4\\] expected"),
    (dict(a=z(M, 2 * K)[:, ::2]), ValueError, "needs its rows or its columns contiguous"),
    (dict(epilogue="gelu"), ValueError, "unknown epilogue 'gelu'"),
    (dict(epilogue="bias"), ValueError, "epilogue bias needs a bias"),
    (dict(bias=BIAS), ValueError, "epilogue none takes no bias"),
    (dict(bias=z(N + 1), epilogue="gelu_bias"), ValueError, "bias must be a contiguous vector of 10"),
    (dict(bias=z(2 * N)[::2], epilogue="gelu_bias"), ValueError, "bias must be a contiguous vector"),
    (dict(epilogue="dgelu"), ValueError, "epilogue dgelu needs an aux matrix"),
    (dict(epilogue="dgelu", aux=z(M, N + 1)), ValueError, "aux must be shaped like d"),
    (dict(epilogue="dgelu", aux=z(N, M).t()), ValueError, "aux must be shaped like d"),
    # cuBLASLt's rule for the aux matrix: its leading dimension a multiple of 8
    (dict(epilogue="dgelu", aux=z(M, 12)[:, :N]), ValueError, "aux: leading dimension 12: cuBLASLt needs a multiple of 8"),
    (dict(epilogue="gelu_aux_bias", bias=BIAS, aux=z(M, N)), ValueError, "leading dimension 10"),
    (dict(epilogue="dgelu_bgrad", aux=H, bgrad=z(M)), ValueError, "bgrad must be a contiguous vector of 10"),
    (dict(epilogue="bgradb", bgrad=z(N)), ValueError, "bgrad must be a contiguous vector of 6"),
    (dict(epilogue="bgradb", aux=H), ValueError, "epilogue bgradb takes no aux matrix"),
    (dict(a=z(3, M, K), epilogue="dgelu_bgrad", aux=z(3, M, 16)[..., :N]), ValueError, "no batch"),
    (dict(a=z(3, M, K), b=z(2, N, K)), ValueError, "b has a batch of 2, another operand 3"),
    (dict(tf32=True), ValueError, "tf32 is for f32 operands only"),
    (dict(b=[[0.0]]), TypeError, "b must be a torch.Tensor"),
])
def test_bad_arguments_raise_before_anything_runs(monkeypatch, call, exc, match):
    def no_library():
        raise RuntimeError("cuBLASLt is not available: (test)")
    monkeypatch.setattr(cublaslt, "handle", no_library)
    kw = dict(a=A, b=W, b_transposed=True)
    kw.update(call)
    with pytest.raises(exc, match=match):
        cublaslt.matmul(kw.pop("a"), kw.pop("b"), **kw)


@pytest.mark.parametrize("call", [
    dict(),
    dict(b=z(K, N), b_transposed=False),
    dict(a=z(K, M).t()),                                              # a transposed view
    dict(epilogue="gelu_aux_bias", bias=BIAS),                        # aux made with rows 16 apart
    dict(epilogue="gelu_aux_bias", bias=BIAS, aux=H),
    dict(epilogue="dgelu_bgrad", aux=H),
    dict(a=z(M, N).t(), b=z(M, K), b_transposed=False, epilogue="bgradb"),   # dW = dYᵀ X, dY [M, N]
    dict(a=z(3, M, K), epilogue="relu_bias", bias=BIAS),              # one weight for the batch
    dict(a=z(M, K, dtype=torch.float32), b=z(N, K, dtype=torch.float32), tf32=True),
])
def test_good_arguments_pass_the_checks(monkeypatch, call):
    def no_library():
        raise RuntimeError("cuBLASLt is not available: (test)")
    monkeypatch.setattr(cublaslt, "handle", no_library)
    kw = dict(a=A, b=W, b_transposed=True)
    kw.update(call)
    with pytest.raises(RuntimeError, match="not available: \\(test\\)"):
        cublaslt.matmul(kw.pop("a"), kw.pop("b"), **kw)

