"""cumulus.Decoder against a float64 numpy reference of softmax attention: dense, and every
adaptive method at full budget (P = 1), at awkward sizes; batches, truncation, K/V given in the
storage dtype, eval mode's claims against the true mass."""

import numpy as np
import pytest

import cumulus


def attention_ref(q, k, v):
    """softmax(q . k / sqrt(d)) v in float64. q [H, D]; k, v [n, KVH, D]: query head h reads kv head h // (H / KVH)."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    h, d = q.shape
    group = h // k.shape[1]
    out = np.empty((h, d))
    for i in range(h):
        s = k[:, i // group, :] @ q[i] / np.sqrt(d)
        w = np.exp(s - s.max())
        out[i] = (w / w.sum()) @ v[:, i // group, :]
    return out


def stored(x, dtype):
    """What the cache keeps of float32 values (round to nearest even)."""
    return x.astype(np.float16).astype(np.float64) if dtype == "f16" else x.astype(np.float64)


def rel_err(a, b):
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def kv(rng, n, kvh, d):
    return (rng.standard_normal((n, kvh, d), dtype=np.float32),
            rng.standard_normal((n, kvh, d), dtype=np.float32))


@pytest.mark.parametrize("n", [1, 17, 255])
@pytest.mark.parametrize("kvh,h", [(1, 1), (2, 6), (2, 8)])
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_dense_equals_the_float64_reference(n, kvh, h, dtype):
    rng = np.random.default_rng(n * 100 + h)
    d = 64
    k, v = kv(rng, n, kvh, d)
    q = 2 * rng.standard_normal((h, d), dtype=np.float32)
    dec = cumulus.Decoder("dense", n_kv_heads=kvh, n_q_heads=h, head_dim=d, dtype=dtype, threads=2)
    dec.append(k, v)
    out, stats = dec.decode(q)
    assert out.shape == (h, d) and out.dtype == np.float32
    ref = attention_ref(q, stored(k, dtype), stored(v, dtype))
    assert rel_err(out, ref) < 1e-5
    assert (stats.tokens_attended == n).all()
    assert stats.bytes_read.sum() == pytest.approx(n * kvh * 2 * d * (4 if dtype == "f32" else 2))


FULL_BUDGET = [
    ("oracle_topp", {"p": 1.0}),
    ("oracle_topk", {"k": 4096}),
    ("streaming", {"window": 4096}),
    ("quest", {"budget": 4096}),
    ("tactic", {"p": 1.0}),
    ("psa", {"threshold": 1.0}),
    ("lfps", {"budget": 4096, "epsilon": 1.0}),
    ("sketch_topp", {"p": 1.0, "candidate_p": 1.0, "min_context": 0}),
]


@pytest.mark.parametrize("method,params", FULL_BUDGET, ids=[m for m, _ in FULL_BUDGET])
def test_every_method_at_full_budget_equals_the_reference(method, params):
    rng = np.random.default_rng(7)
    kvh, h, d, n = 2, 6, 64, 300
    k, v = kv(rng, n, kvh, d)
    dec = cumulus.Decoder(method, n_kv_heads=kvh, n_q_heads=h, head_dim=d, dtype="f32", threads=2, **params)
    dec.append(k[:-3], v[:-3])
    # The prompt's last queries, for the methods that learn from them (lfps).
    rows = dec.prompt_queries
    dec.build_index(prompt_q=rng.standard_normal((rows, h, d), dtype=np.float32) if rows else None)
    for t in range(n - 3, n):  # decode steps after the prompt: one appended token each
        dec.append(k[t : t + 1], v[t : t + 1])
        q = 2 * rng.standard_normal((h, d), dtype=np.float32)
        out, stats = dec.decode(q)
        assert rel_err(out, attention_ref(q, k[: t + 1], v[: t + 1])) < 1e-5, (method, t)
    assert dec.lengths() == [n]


@pytest.mark.parametrize("kvh,h", [(4, 4), (2, 8)])
def test_claims_against_the_true_mass(kvh, h):
    rng = np.random.default_rng(3)
    d, n = 64, 500
    k, v = kv(rng, n, kvh, d)
    dec = cumulus.Decoder("oracle_topp", n_kv_heads=kvh, n_q_heads=h, head_dim=d, eval=True, threads=2, p=0.6)
    dec.append(k, v)
    q = 3 * rng.standard_normal((h, d), dtype=np.float32)
    out, stats = dec.decode(q)
    assert (stats.mass_claimed >= 0.6 - 1e-6).all()
    if kvh == h:  # each head attends its own exact top-p set: the claim is its true mass
        np.testing.assert_allclose(stats.mass_true, stats.mass_claimed, atol=1e-4)
    else:  # a GQA group attends the union of its heads' sets, which holds at least as much
        assert (stats.mass_true >= stats.mass_claimed - 1e-4).all()
    assert (stats.tokens_attended < n).all()
    # The output error stays under Tactic's bound 2 (1 - p) max ||v|| (Appendix A).
    vmax = np.linalg.norm(stored(v, "f16"), axis=2).max()
    assert (stats.out_err <= 2 * (1 - stats.mass_true) * vmax + 1e-4).all()
    # The selection: per kv head, what its group attended, sorted.
    sel = stats.selection()
    assert len(sel) == kvh and all((np.diff(s) > 0).all() for s in sel)
    assert max(len(s) for s in sel) == stats.tokens_attended.max()


def test_dense_decoder_methods_without_claims_read_nan():
    dec = cumulus.Decoder("quest", n_kv_heads=1, n_q_heads=2, head_dim=8, budget=16)
    k = np.ones((40, 1, 8), dtype=np.float32)
    dec.append(k, k)
    _, stats = dec.decode(np.ones((2, 8), dtype=np.float32))
    assert np.isnan(stats.mass_claimed).all() and np.isnan(stats.mass_true).all()


def test_batch_equals_one_decoder_per_sequence():
    rng = np.random.default_rng(11)
    b, kvh, h, d = 3, 2, 4, 32
    batched = cumulus.Decoder("oracle_topp", batch=b, n_kv_heads=kvh, n_q_heads=h, head_dim=d, p=0.9)
    singles = [cumulus.Decoder("oracle_topp", n_kv_heads=kvh, n_q_heads=h, head_dim=d, p=0.9) for _ in range(b)]
    k = rng.standard_normal((b, 50, kvh, d), dtype=np.float32)
    v = rng.standard_normal((b, 50, kvh, d), dtype=np.float32)
    batched.append(k, v)
    for i, s in enumerate(singles):
        s.append(k[i], v[i])
    # Sequences grow apart: one more token for sequence 1 only.
    extra = rng.standard_normal((1, kvh, d), dtype=np.float32)
    batched.append(extra, extra, seq=1)
    singles[1].append(extra, extra)
    assert batched.lengths() == [50, 51, 50]
    q = rng.standard_normal((b, h, d), dtype=np.float32)
    out, stats = batched.decode(q)
    assert out.shape == (b, h, d) and stats.tokens_attended.shape == (b, h)
    for i, s in enumerate(singles):
        o, st = s.decode(q[i])
        np.testing.assert_array_equal(out[i], o)
        np.testing.assert_array_equal(stats.tokens_attended[i], st.tokens_attended)


def test_truncate_returns_to_a_prefix_and_layers_are_separate():
    rng = np.random.default_rng(5)
    kvh, h, d = 2, 4, 16
    dec = cumulus.Decoder("tactic", n_layers=2, n_kv_heads=kvh, n_q_heads=h, head_dim=d, dtype="f32", p=1.0)
    k, v = kv(rng, 40, kvh, d)
    dec.append(k, v, layer=0)
    dec.append(k[:10], v[:10], layer=1)
    assert dec.lengths(0) == [40] and dec.lengths(1) == [10]
    q = rng.standard_normal((h, d), dtype=np.float32)
    dec.decode(q, layer=0)
    dec.truncate(10)
    assert dec.lengths(0) == [10]
    for layer in (0, 1):
        out, _ = dec.decode(q, layer=layer)
        assert rel_err(out, attention_ref(q, k[:10], v[:10])) < 1e-5


def test_stored_dtype_appends_bit_for_bit_and_out_is_written_in_place():
    rng = np.random.default_rng(9)
    k, v = kv(rng, 33, 1, 64)
    a = cumulus.Decoder(n_kv_heads=1, n_q_heads=3, head_dim=64, dtype="f16")
    b = cumulus.Decoder(n_kv_heads=1, n_q_heads=3, head_dim=64, dtype="f16")
    a.append(k, v)
    b.append(k.astype(np.float16), v.astype(np.float16))
    q = rng.standard_normal((3, 64), dtype=np.float32)
    out = np.zeros((3, 64), dtype=np.float32)
    got, _ = b.decode(q, out=out)
    assert got is out
    np.testing.assert_array_equal(a.decode(q)[0], out)


def test_torch_cpu_tensors_through_dlpack():
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    k = torch.randn(20, 2, 32, generator=g)
    v = torch.randn(20, 2, 32, generator=g)
    q = torch.randn(4, 32, generator=g)
    dec = cumulus.Decoder(n_kv_heads=2, n_q_heads=4, head_dim=32, dtype="bf16")
    dec.append(k.to(torch.bfloat16), v.to(torch.bfloat16))
    out = torch.empty(4, 32)
    dec.decode(q, out=out)
    ref = attention_ref(q.numpy(), k.to(torch.bfloat16).double().numpy(), v.to(torch.bfloat16).double().numpy())
    assert rel_err(out.numpy(), ref) < 1e-5
