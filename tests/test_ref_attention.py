"""blockdiag_ref.reference_attention against an independent per-document computation."""

import math

import pytest
import torch
import torch.nn.functional as F

from blockdiag_ref import DocLayout, reference_attention


def per_document(q, k, v, doc_ids, left=-1, scale=None):
    """Each document attended on its own with plain float64 math: a causal band inside the document, nothing
    outside it; padding rows stay 0. Independent of DocLayout: runs are found by walking the ids."""
    B, Hq, S, D = q.shape
    group = Hq // k.shape[1]
    scale = 1 / math.sqrt(D) if scale is None else scale
    out = torch.zeros(B, Hq, S, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        ids = doc_ids[b].tolist()
        start = 0
        while start < S:
            end = start + 1
            while end < S and ids[end] == ids[start]:
                end += 1
            if ids[start] != 0:
                n = end - start
                qd = q[b, :, start:end].double()
                kd = k[b, :, start:end].double().repeat_interleave(group, 0)
                vd = v[b, :, start:end].double().repeat_interleave(group, 0)
                i = torch.arange(n)[:, None]
                j = torch.arange(n)[None, :]
                band = (j <= i) & ((j >= i - left) if left >= 0 else True)
                s = (qd @ kd.transpose(-1, -2)) * scale
                p = torch.softmax(s.masked_fill(~band, float("-inf")), dim=-1)
                out[b, :, start:end] = p @ vd
            start = end
    return out


def random_ids(g, B, S):
    """Random rows with single-token documents, middle padding and reused ids."""
    rows = []
    for _ in range(B):
        row = []
        while len(row) < S:
            n = int(torch.randint(1, 6, (1,), generator=g))
            doc = int(torch.randint(0, 4, (1,), generator=g))  # 0 = a padding run, ids reused freely
            row += [doc] * n
        rows.append(row[:S])
    return torch.tensor(rows)


def qkv(g, B, Hq, Hkv, S, D, dtype=torch.float64, Dv=None):
    Dv = D if Dv is None else Dv
    return (
        torch.randn(B, Hq, S, D, generator=g, dtype=dtype),
        torch.randn(B, Hkv, S, D, generator=g, dtype=dtype),
        torch.randn(B, Hkv, S, Dv, generator=g, dtype=dtype),
    )


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize(
    "heads, left",
    [pytest.param((2, 2), -1, id="mha"), pytest.param((4, 2), -1, id="gqa"), pytest.param((3, 1), 2, id="mqa-window2"), pytest.param((2, 2), 0, id="window0")],
)
def test_reference_equals_per_document_attention(seed, heads, left):
    g = torch.Generator().manual_seed(seed)
    S = 23 + seed  # awkward sizes
    ids = random_ids(g, 2, S)
    q, k, v = qkv(g, 2, *heads, S, 5)
    got = reference_attention(q, k, v, ids, enable_gqa=True, window_size=(left, 0))
    assert rel_err(got, per_document(q, k, v, ids, left)) <= 1e-12
    assert torch.all(got[:, :, ids[0] == 0][0] == 0) and torch.all(got.transpose(1, 2)[ids == 0] == 0)


def test_packed_row_equals_stock_causal_sdpa_per_document():
    g = torch.Generator().manual_seed(0)
    layout = DocLayout.from_seqlens([7, 1, 12, 3], pad=2)
    q, k, v = qkv(g, 1, 2, 2, layout.seq_len, 8)
    got = reference_attention(q, k, v, layout)
    for _, s, e in layout.segments.tolist():
        want = F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True)
        assert rel_err(got[:, :, s:e], want) <= 1e-12


def _gqa_error() -> float:
    """The reference with GQA (6 query heads on 2 kv heads) against torch's own SDPA with ``enable_gqa`` run
    per document: query head h reads kv head h // 3, the grouping torch and flash-attn use."""
    g = torch.Generator().manual_seed(1)
    ids = torch.tensor([[1, 1, 1, 2, 2, 0, 3]])
    q, k, v = qkv(g, 1, 6, 2, 7, 4)
    got = reference_attention(q, k, v, ids, enable_gqa=True)
    want = torch.zeros_like(got)
    for s, e in ((0, 3), (3, 5), (6, 7)):
        want[:, :, s:e] = F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True, enable_gqa=True)
    return rel_err(got, want)


def test_gqa_maps_query_heads_to_kv_heads_like_torch():
    assert _gqa_error() <= 1e-12


def test_gqa_check_catches_tiled_heads(monkeypatch):
    """Planted change: the reference maps query head h to kv head h % Hkv (tiling) instead of h // group."""
    tiled = lambda t, repeats, dim: t.repeat(*[repeats if d == dim % t.dim() else 1 for d in range(t.dim())])  # noqa: E731
    monkeypatch.setattr(torch.Tensor, "repeat_interleave", tiled)
    assert _gqa_error() > 1e-3


def test_value_head_dim_may_differ_and_scale_is_honoured():
    g = torch.Generator().manual_seed(2)
    ids = torch.tensor([[1, 1, 1, 1, 2, 2]])
    q, k, v = qkv(g, 1, 2, 2, 6, 4, Dv=3)
    got = reference_attention(q, k, v, ids, scale=0.3)
    assert got.shape == (1, 2, 6, 3)
    assert rel_err(got, per_document(q, k, v, ids, scale=0.3)) <= 1e-12


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_returns_query_dtype_computed_in_float64(dtype):
    g = torch.Generator().manual_seed(3)
    ids = torch.tensor([[1, 1, 1, 0]])
    q, k, v = (t.to(dtype) for t in qkv(g, 1, 1, 1, 4, 4))
    got = reference_attention(q, k, v, ids)
    assert got.dtype == dtype
    assert torch.equal(got, per_document(q, k, v, ids).to(dtype))


def test_padding_rows_are_zero_and_padding_keys_get_zero_grad():
    g = torch.Generator().manual_seed(4)
    ids = torch.tensor([[0, 1, 1, 0, 2, 2, 0]])
    q, k, v = (t.requires_grad_() for t in qkv(g, 1, 2, 1, 7, 4))
    out = reference_attention(q, k, v, ids, enable_gqa=True)
    out.pow(2).sum().backward()
    pad = ids[0] == 0
    assert torch.all(out[0, :, pad] == 0)
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
        assert torch.all(t.grad[0, :, pad] == 0)


def test_gradients_match_per_document_autograd():
    g = torch.Generator().manual_seed(5)
    ids = random_ids(g, 2, 17)
    q, k, v = qkv(g, 2, 4, 2, 17, 3)
    leaves1 = [t.clone().requires_grad_() for t in (q, k, v)]
    leaves2 = [t.clone().requires_grad_() for t in (q, k, v)]
    w = torch.randn(2, 4, 17, 3, generator=g, dtype=torch.float64)
    (reference_attention(*leaves1, ids, enable_gqa=True, window_size=(3, 0)) * w).sum().backward()
    (per_document(*leaves2, ids, left=3) * w).sum().backward()
    for a, b in zip(leaves1, leaves2):
        assert rel_err(a.grad, b.grad) <= 1e-12


@pytest.mark.parametrize(
    "shapes, kwargs, match",
    [
        pytest.param(((1, 2, 4, 4), (1, 2, 4, 4), (1, 2, 4, 4)), {}, r"expected B=1 and S=5", id="wrong-S"),
        pytest.param(((2, 4, 4), (2, 4, 4), (2, 4, 4)), {}, "expected 4 dims", id="3-d"),
        pytest.param(((1, 3, 5, 4), (1, 2, 5, 4), (1, 2, 5, 4)), {"enable_gqa": True}, "Hq a multiple of Hkv, got Hq=3, Hkv=2", id="hq-not-multiple"),
        pytest.param(((1, 4, 5, 4), (1, 2, 5, 4), (1, 2, 5, 4)), {}, "needs enable_gqa=True", id="gqa-off"),
        pytest.param(((1, 2, 5, 4), (1, 2, 5, 3), (1, 2, 5, 4)), {}, "same head dim D, got 4 and 3", id="head-dims"),
        pytest.param(((1, 2, 5, 4), (1, 2, 5, 4), (1, 1, 5, 4)), {}, r"same \[B, Hkv, S\]", id="kv-heads"),
        pytest.param(((1, 2, 5, 4), (1, 2, 5, 4), (1, 2, 5, 4)), {"window_size": (2, 1)}, "right must be <= 0", id="window-right"),
    ],
)
def test_reference_errors(shapes, kwargs, match):
    q, k, v = (torch.zeros(s, dtype=torch.float64) for s in shapes)
    with pytest.raises(ValueError, match=match):
        reference_attention(q, k, v, torch.ones(1, 5, dtype=torch.long), **kwargs)
