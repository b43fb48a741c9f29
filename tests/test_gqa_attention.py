"""pad_kernels.attention: the C++ grouped-query attention against its fp32 spec and against SDPA."""
import pytest
import torch

from pad_kernels import attention
from pad_kernels.attention import gqa_attention, gqa_attention_ref

pytestmark = pytest.mark.skipif(not attention.available(), reason="the C++ CPU extension is not built")

# (B, Hq, Hkv, T, S, D): tile edges (S = 1, 31, 32, 33), one and many tokens, G = 1, 2, 6, the default
# target's heads (12 over 2, D = 128) at the search labeler's and the batched decode's shapes.
SHAPES = [(1, 2, 2, 1, 1, 8), (3, 4, 2, 3, 31, 8), (2, 6, 1, 5, 33, 16), (1, 12, 2, 9, 32, 128),
          (3, 12, 2, 3, 257, 128), (2, 8, 4, 16, 70, 64), (1, 12, 2, 40, 100, 64)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _inputs(shape, dtype, seed):
    B, Hq, Hkv, T, S, D = shape
    g = torch.Generator().manual_seed(seed)
    # The query as transformers passes it: a transposed view of [B, T, Hq, D].
    q = (torch.randn(B, T, Hq, D, generator=g) * 2).to(dtype).transpose(1, 2)
    k = (torch.randn(B, Hkv, S, D, generator=g) * 2).to(dtype)
    v = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    # Causal over the new tokens, then left padding, holes and (row 0) a query that sees nothing.
    mask = torch.ones(B, 1, T, S, dtype=torch.bool).tril(S - T)
    mask &= torch.rand(B, 1, 1, S, generator=g) > 0.2
    mask[:, :, :, : S // 3] = False
    mask[0, 0, 0] = False
    return q, k, v, mask


def _poisoned(q):
    B, Hq, T, D = q.shape
    return torch.full((B, T, Hq, D), float("nan"), dtype=q.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_equals_the_spec(shape, dtype):
    seed = SHAPES.index(shape) * 10 + DTYPES.index(dtype)
    q, k, v, mask = _inputs(shape, dtype, seed)
    scale = shape[-1] ** -0.5
    out = _poisoned(q)
    got = gqa_attention(q, k, v, mask, scale, out=out)
    assert got is out and not out.isnan().any()  # every element written
    exact = gqa_attention_ref(q.float(), k.float(), v.float(), mask, scale)  # unrounded fp32
    assert torch.equal(got[0, 0], torch.zeros_like(got[0, 0]))  # the query that sees no column
    if dtype == torch.float32:
        torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-5)
        return
    # Half precision: the fp32 tolerance above plus twice the rounding of the spec's own result to that
    # dtype and half an ulp (the kernel computes in fp32 and rounds once: an fp32 difference can move a
    # value across a rounding boundary).
    half_ulp = {torch.bfloat16: 2**-8, torch.float16: 2**-11}[dtype]
    limit = 2 * (gqa_attention_ref(q, k, v, mask, scale).float() - exact).abs() + half_ulp * exact.abs() + 1e-5
    assert ((got.float() - exact).abs() <= limit).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_agrees_with_sdpa(dtype):
    q, k, v, mask = _inputs((3, 12, 2, 3, 200, 128), dtype, seed=100 + DTYPES.index(dtype))
    mask[0, 0, 0] = True  # SDPA's answer for a query that sees nothing is its own convention
    scale = 128**-0.5
    exact = gqa_attention_ref(q.float(), k.float(), v.float(), mask, scale)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    sdpa_err = (sdpa.transpose(1, 2).float() - exact).abs().max()
    err = (gqa_attention(q, k, v, mask, scale).float() - exact).abs().max()
    assert err <= max(2 * sdpa_err, 1e-5)


def test_hand_made():
    # One visible column: the output is its value row exactly; two equal scores: the mean of their values.
    q = torch.zeros(1, 2, 2, 4)
    k = torch.zeros(1, 1, 3, 4)
    v = torch.tensor([[[[1.0, 2, 3, 4], [5, 6, 7, 8], [-1, 0, 1, 2]]]])
    mask = torch.tensor([[[[False, True, False], [True, False, True]]]])
    out = gqa_attention(q, k, v, mask, 1.0)
    for h in range(2):
        torch.testing.assert_close(out[0, 0, h], v[0, 0, 1], rtol=0, atol=0)
        torch.testing.assert_close(out[0, 1, h], (v[0, 0, 0] + v[0, 0, 2]) / 2, rtol=0, atol=0)
    # A score far above the rest takes all the weight; query head h reads key/value head h // G.
    q = torch.zeros(1, 4, 1, 4)
    q[0, :, 0, 0] = 10.0
    k = torch.zeros(1, 2, 2, 4)
    k[0, 0, 1, 0] = 10.0  # head 0 prefers column 1
    k[0, 1, 0, 0] = 10.0  # head 1 prefers column 0
    v = torch.arange(16.0).reshape(1, 2, 2, 4)
    out = gqa_attention(q, k, v, torch.ones(1, 1, 1, 2, dtype=torch.bool), 1.0)
    torch.testing.assert_close(out[0, 0, :2], v[0, 0, 1].expand(2, 4), rtol=0, atol=1e-30)
    torch.testing.assert_close(out[0, 0, 2:], v[0, 1, 0].expand(2, 4), rtol=0, atol=1e-30)


def test_padding_changes_nothing():
    """A row's result does not depend on masked columns or on other rows (bitwise, fp32): what lets the
    search labeler's batched records equal its one-at-a-time records."""
    q, k, v, mask = _inputs((2, 12, 2, 3, 90, 64), torch.float32, seed=7)
    mask[:, :, :, :40] = False
    alone = gqa_attention(q[:1], k[:1, :, 40:], v[:1, :, 40:], mask[:1, :, :, 40:], 0.125)
    garbage = torch.randn(k.shape, generator=torch.Generator().manual_seed(8))
    k2, v2 = k.clone(), v.clone()
    k2[:, :, :40], v2[:, :, :40] = garbage[:, :, :40], -garbage[:, :, :40]
    together = gqa_attention(q, k2, v2, mask, 0.125)
    assert torch.equal(together[:1], alone)


def test_refuses_what_it_does_not_take():
    q, k, v, mask = _inputs((1, 4, 2, 2, 10, 8), torch.float32, seed=9)
    assert attention.supports(q, k, v, mask)
    assert not attention.supports(q, k, v, mask.long())  # additive or integer masks go to SDPA
    assert not attention.supports(q, k, v, None)
    assert not attention.supports(q, k.double(), v, mask)
    assert not attention.supports(q, k[:, :, :, :4], v[:, :, :, :4], mask)  # another head dim
    assert not attention.supports(q.expand(2, 4, 2, 8), k, v, mask.expand(2, 1, 2, 10))  # rows differ
    assert not attention.supports(q[..., :6], k[..., :6], v[..., :6], mask)  # D not a multiple of 4
    assert not attention.supports(q, k[:, :1].expand(1, 3, 10, 8), v[:, :1].expand(1, 3, 10, 8), mask)  # 4 % 3
    big = torch.zeros(1, 8, 65, 8)  # G * T = 520 > 512
    assert not attention.supports(big, k[:, :1], v[:, :1], torch.ones(1, 1, 65, 10, dtype=torch.bool))
    with pytest.raises(ValueError, match="does not take"):
        gqa_attention(q, k, v, mask.long(), 1.0)
