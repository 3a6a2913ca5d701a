"""The CPU's Gram triangle from BLAS's symmetric product (``lightning_dp.clipping.symmetric_gram``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from threadpoolctl import ThreadpoolController

from lightning_dp.clipping import rows, symmetric_gram
from lightning_dp.clipping.symmetric_gram import has_triangle_gram, triangle_gram


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layout", ["contiguous", "strided", "transposed"])
def test_triangle_gram_is_the_lower_triangle_of_the_product(dtype: torch.dtype, layout: str) -> None:
    """Each sample's ``x x^T`` below and on the diagonal (float64 product), exact zeros above, whatever the layout of
    ``x``, which is left as it was."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 9, 40, generator=gen, dtype=dtype)
    if layout == "strided":
        x = torch.randn(3, 9, 80, generator=gen, dtype=dtype)[..., ::2]
    elif layout == "transposed":
        x = torch.randn(3, 40, 9, generator=gen, dtype=dtype).transpose(1, 2)
    before = x.clone()
    gram = triangle_gram(x)
    full = x.double() @ x.double().transpose(1, 2)
    assert gram.dtype == dtype and gram.shape == (3, 9, 9)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(gram.double(), full.tril(), rtol=tol, atol=tol)
    assert bool(gram.triu(1).eq(0).all())
    assert torch.equal(x, before)


def test_triangle_gram_takes_grad_requiring_tensors() -> None:
    """A factor that requires grad is read detached."""
    x = torch.randn(2, 5, 7, requires_grad=True)
    torch.testing.assert_close(triangle_gram(x), (x @ x.transpose(1, 2)).detach().tril())


def _blas_threads() -> set[int]:
    return {lib["num_threads"] for lib in ThreadpoolController().info() if lib["user_api"] == "blas"}


@pytest.mark.parametrize("raises", [False, True])
def test_triangle_gram_uses_as_many_blas_threads_as_torch(raises: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """BLAS runs with torch's intra-op threads, whatever it was set to, and gets its setting back after, also when
    BLAS raises."""
    seen: list[set[int]] = []
    syrk = symmetric_gram._SYRK[torch.float32]

    def spying(*args: object, **kwargs: object) -> object:
        seen.append(_blas_threads())
        if raises:
            raise RuntimeError("BLAS failed")
        return syrk(*args, **kwargs)

    monkeypatch.setitem(symmetric_gram._SYRK, torch.float32, spying)
    threads = torch.get_num_threads()
    with ThreadpoolController().limit(limits=3, user_api="blas"):
        try:
            torch.set_num_threads(1)
            if raises:
                with pytest.raises(RuntimeError, match="BLAS failed"):
                    triangle_gram(torch.randn(2, 4, 6))
            else:
                triangle_gram(torch.randn(2, 4, 6))
        finally:
            torch.set_num_threads(threads)
        assert _blas_threads() == {3}
    assert seen == ([{1}] if raises else [{1}, {1}])


def test_triangle_gram_takes_blas_copy_of_its_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where scipy hands BLAS a copy of the output (its ``c`` not usable in place), the copy's triangle is taken, not
    the zeros it was given."""
    syrk = symmetric_gram._SYRK[torch.float32]

    def copying(alpha: float, a: np.ndarray, trans: int, c: np.ndarray, overwrite_c: int) -> np.ndarray:
        return syrk(alpha, a, trans=trans, c=c.copy(order="F"), overwrite_c=1)

    monkeypatch.setitem(symmetric_gram._SYRK, torch.float32, copying)
    x = torch.randn(2, 5, 7)
    torch.testing.assert_close(triangle_gram(x), (x @ x.transpose(1, 2)).tril())


def test_which_tensors_take_the_triangle(monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 and float64 on the CPU paths only; other dtypes raise."""
    assert has_triangle_gram(torch.zeros(1, 2, 2)) and has_triangle_gram(torch.zeros(1, 2, 2, dtype=torch.float64))
    assert not has_triangle_gram(torch.zeros(1, 2, 2, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="float32 or float64"):
        triangle_gram(torch.zeros(1, 2, 2, dtype=torch.float16))
    monkeypatch.setattr(rows, "CPU_PATH_DEVICES", frozenset())
    assert not has_triangle_gram(torch.zeros(1, 2, 2))
