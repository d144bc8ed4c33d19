"""Linear layers of passes of a few rows in our CUDA kernel (the kernel's own
checks need CUDA: CI has no GPU, so they run on a CUDA machine,
`pytest tests/test_few_rows_matmul.py`)."""

import mlx.core as mx
import mlx.nn as nn
import pytest

from smg_mlx.engine.batch import few_rows_matmul as few

cuda = pytest.mark.skipif(not few.AVAILABLE, reason="the kernel is CUDA's")


def test_larger_weights_take_fewer_rows_and_one_row_is_never_taken():
    sizes = [1 << 20, 1 << 24, (1 << 24) + 1, 1 << 26, (1 << 26) + 1, 1 << 30]
    most = [few.most_rows(n) for n in sizes]
    assert most == sorted(most, reverse=True) and most[0] > most[-1] >= few.LEAST_ROWS >= 2


def test_only_16_bit_weights_whose_rows_are_whole_words_fit():
    assert few.fits(mx.zeros((64, 1024), mx.bfloat16))
    assert few.fits(mx.zeros((64, 1032), mx.float16))
    assert not few.fits(mx.zeros((64, 1028), mx.bfloat16))  # rows not whole 16-byte words
    assert not few.fits(mx.zeros((64, 1024), mx.float32))


@pytest.mark.skipif(few.AVAILABLE, reason="off CUDA only")
def test_off_cuda_no_layer_is_taken():
    model = nn.Sequential(nn.Linear(256, 512, bias=False), nn.Linear(512, 256))
    model.set_dtype(mx.bfloat16)
    assert few.install(model) == 0
    assert all(type(m) is nn.Linear for m in model.layers)


@cuda
@pytest.mark.parametrize("n,k", [(1024, 1024), (1001, 1032), (14336, 4096), (4096, 14336)])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_the_kernel_multiplies_as_mlx_does(n, k, dtype):
    w = (mx.random.normal((n, k), key=mx.random.key(1)) / k**0.5).astype(dtype)
    x = mx.random.normal((few.most_rows(0), k), key=mx.random.key(2)).astype(dtype)
    for rows in range(few.LEAST_ROWS, few.most_rows(w.size) + 1):
        exact = x[:rows].astype(mx.float32) @ w.astype(mx.float32).T
        ours = few.matmul(x[:rows], w).astype(mx.float32)
        # within a 16-bit rounding of each output
        assert mx.all(mx.abs(ours - exact) <= mx.abs(exact) / 128 + 1e-2).item(), rows


@cuda
def test_a_rows_product_does_not_depend_on_the_rows_beside_it():
    w = mx.random.normal((2048, 1024), key=mx.random.key(3)).astype(mx.bfloat16)
    x = mx.random.normal((8, 1024), key=mx.random.key(4)).astype(mx.bfloat16)
    whole = few.matmul(x, w)
    for rows in range(2, 8):
        assert mx.array_equal(few.matmul(x[:rows], w), whole[:rows]).item()
    swapped = few.matmul(x[::-1], w)
    assert mx.array_equal(swapped[::-1], whole).item()


@cuda
def test_a_model_takes_it_at_a_few_rows_with_the_same_outputs():
    mx.random.seed(5)
    model = nn.Sequential(nn.Linear(1024, 4096, bias=True), nn.Linear(4096, 1024, bias=False))
    model.set_dtype(mx.bfloat16)
    x = mx.random.normal((2, 3, 1024)).astype(mx.bfloat16)
    before, one_row = model(x), model(x[:1, :1])
    assert few.install(model) == 2
    assert all(type(m) is few.FewRowsLinear for m in model.layers)
    after = model(x)
    assert mx.allclose(after, before, rtol=1 / 32, atol=mx.abs(before).max().item() / 64).item()
    assert mx.array_equal(model(x[:1, :1]), one_row).item()  # one row stays mlx's



def _model():
    model = nn.Sequential(nn.Linear(1024, 1024, bias=True), nn.Linear(1024, 256, bias=False))
    model.set_dtype(mx.bfloat16)
    return model


@pytest.mark.parametrize("kernel,said", [
    ("fails", "the kernel failed at 2 rows (nvrtc: error: invalid value for --gpu-architecture)"),
    ("differs", "this GPU's differed from mlx's at 2 rows"),
])  # fmt: skip
def test_a_kernel_that_fails_or_differs_leaves_the_products_to_mlx(monkeypatch, caplog, kernel,
                                                                   said):  # fmt: skip
    def matmul(x, w):
        if kernel == "fails":
            raise RuntimeError("nvrtc: error: invalid value for --gpu-architecture")
        return x @ w.T + 1

    monkeypatch.setattr(few, "AVAILABLE", True)  # (as on CUDA, the kernel replaced)
    monkeypatch.setattr(few, "matmul", matmul)
    model = _model()
    assert few.install(model) == 0
    assert all(type(m) is nn.Linear for m in model.layers)
    assert said in caplog.text


def test_products_of_a_few_rows_go_to_the_kernel_and_others_to_mlx(monkeypatch):
    taken = []

    def matmul(x, w):  # the kernel's product, as mlx makes it (CI has no CUDA)
        taken.append(x.shape[0])
        return x @ w.T

    monkeypatch.setattr(few, "AVAILABLE", True)
    monkeypatch.setattr(few, "matmul", matmul)
    model = _model()
    x = mx.random.normal((2, 3, 1024), key=mx.random.key(6)).astype(mx.bfloat16)
    expected = [model(x[:1, :1]), model(x), model(mx.concatenate([x, x, x]))]
    assert few.install(model) == 2
    taken.clear()
    one, six, eighteen = (model(r) for r in (x[:1, :1], x, mx.concatenate([x, x, x])))
    assert taken == [6, 6]  # one row is mlx's, and so are 18
    assert mx.array_equal(one, expected[0]).item() and mx.array_equal(eighteen, expected[2]).item()
    # (mlx adds the bias in its product, rounding once; here it is added after)
    assert mx.allclose(six, expected[1], rtol=1 / 64, atol=1 / 64).item()


@pytest.mark.skipif(few.AVAILABLE, reason="off CUDA only")
def test_its_bench_says_it_needs_cuda_where_there_is_none(capsys):
    from bench import few_rows

    assert few_rows.main([]) == 1
    assert "CUDA" in capsys.readouterr().err
