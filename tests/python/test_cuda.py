"""The package on CUDA tensors: cumulus.Decoder(device="cuda") against float64 references, and
cumulus.transformers on models on the GPU against transformers' own attention.

These run on a machine with a GPU and a CUDA build of the package (pip install . -C
cmake.define.CUMULUS_CUDA=ON; tools/device/python_gpu.sh runs them on the GPU machine). On
other machines they skip, as the C++ CUDA tests do.
"""

import numpy as np
import pytest

import cumulus

torch = pytest.importorskip("torch", reason="the CUDA tests take torch CUDA tensors")
if not (cumulus.has_cuda and torch.cuda.is_available()):
    pytest.skip("needs a CUDA build of cumulus and a GPU", allow_module_level=True)

import cumulus.transformers as ct  # noqa: E402

from conftest import SMOLLM2, need  # noqa: E402
from test_decoder import attention_ref  # noqa: E402  (float64, GQA groups)


def f16(x):
    return np.asarray(x, dtype=np.float16).astype(np.float32)


@pytest.mark.parametrize("d,kvh,h", [(64, 2, 8), (128, 8, 32), (256, 1, 4)])
def test_dense_decoder_matches_the_float64_reference(d, kvh, h):
    rng = np.random.default_rng(d)
    n = 700
    k = rng.standard_normal((1, n, kvh, d), dtype=np.float32)
    v = rng.standard_normal((1, n, kvh, d), dtype=np.float32)
    q = 2 * rng.standard_normal((1, h, d), dtype=np.float32)
    dec = cumulus.Decoder("dense", n_kv_heads=kvh, n_q_heads=h, head_dim=d, device="cuda", max_tokens=1024)
    assert dec.device == "cuda"
    dec.append(torch.from_numpy(k).cuda(), torch.from_numpy(v).cuda())
    out, stats = dec.decode(torch.from_numpy(q).cuda())
    assert out.is_cuda and out.shape == (1, h, d)
    ref = attention_ref(q[0], f16(k[0]), f16(v[0]))  # the cache stores f16
    np.testing.assert_allclose(out[0].cpu().numpy(), ref, atol=2e-3, rtol=2e-3)
    assert (stats.tokens_attended == n).all()
    assert dec.lengths() == [n]


@pytest.mark.parametrize("method", ["oracle_topp", "sketch_topp", "quest", "tactic", "psa", "streaming"])
def test_gpu_methods_run_batched_and_claims_hold(method):
    rng = np.random.default_rng(7)
    b, n, kvh, h, d = 2, 3000, 2, 8, 128
    k = torch.from_numpy(rng.standard_normal((b, n, kvh, d), dtype=np.float32)).cuda()
    v = torch.from_numpy(rng.standard_normal((b, n, kvh, d), dtype=np.float32)).cuda()
    dec = cumulus.Decoder(method, n_kv_heads=kvh, n_q_heads=h, head_dim=d, batch=b, device="cuda", max_tokens=4096,
                          eval=True)
    dec.append(k, v)
    dec.build_index()
    for _ in range(3):
        kn = torch.randn(b, 1, kvh, d, device="cuda")
        dec.append(kn, torch.randn_like(kn))
        q = 4 * torch.randn(b, h, d, device="cuda")
        out, st = dec.decode(q)
        assert out.shape == (b, h, d) and torch.isfinite(out).all()
        assert (st.tokens_attended > 0).all() and (st.tokens_attended <= n + 3).all()
        claimed, true = st.mass_claimed, st.mass_true
        assert ((true > 0) & (true <= 1 + 1e-5)).all()
        if method == "oracle_topp":  # exact scores: a union holds at least each head's claim
            assert (claimed >= 0.9 - 1e-5).all() and (true >= claimed - 2e-3).all(), (true, claimed)
    assert dec.lengths() == [n + 3, n + 3]
    dec.truncate(n)
    assert dec.lengths() == [n, n]


def test_cuda_decoder_refuses_cpu_arrays_and_other_dtypes():
    dec = cumulus.Decoder("dense", n_kv_heads=1, n_q_heads=1, head_dim=64, device="cuda", max_tokens=64)
    with pytest.raises(cumulus.Error, match="is on cpu: this Decoder works on cuda tensors"):
        dec.append(torch.zeros(1, 4, 1, 64), torch.zeros(1, 4, 1, 64))
    with pytest.raises(cumulus.Error, match="give float32 on cuda"):
        dec.append(torch.zeros(1, 4, 1, 64, device="cuda", dtype=torch.float16),
                   torch.zeros(1, 4, 1, 64, device="cuda", dtype=torch.float16))
    with pytest.raises(cumulus.Error, match="exceed max_tokens=64"):
        dec.append(torch.zeros(1, 65, 1, 64, device="cuda"), torch.zeros(1, 65, 1, 64, device="cuda"))
    with pytest.raises(cumulus.Error, match="stores K/V as f16 or bf16"):
        cumulus.Decoder("dense", n_kv_heads=1, n_q_heads=1, head_dim=64, device="cuda", dtype="f32")


def _small_llama():
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval().cuda()  # head_dim 64
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(4.0)
    return model


def test_transformers_dense_on_cuda_against_eager():
    model = _small_llama()
    ids = torch.randint(0, 320, (1, 300), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.no_grad():
        ref = model(ids).logits[0, 199:299].double()
        ct.enable(model, "dense")
        arg = model._cumulus_state.cache_arg
        cache = ct.CumulusCache(model)
        rows = [model(ids[:, :200], **{arg: cache}, use_cache=True).logits[0, -1]]
        for t in range(200, 299):
            rows.append(model(ids[:, t:t + 1], **{arg: cache}, use_cache=True).logits[0, -1])
    got = torch.stack(rows).double()
    # The GPU stores K/V as f16 (a float32 model's too): rounding of the keys and values.
    assert (got - ref).abs().max().item() < 2e-2
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.97
    assert cache.decoder.device == "cuda"


@pytest.mark.parametrize("method", [m.name for m in cumulus.methods() if m.decodes and m.name != "dense"])
def test_transformers_generate_on_cuda_every_gpu_method(method):
    model = _small_llama()
    ids = torch.randint(0, 320, (1, 2000), generator=torch.Generator().manual_seed(2)).cuda()
    try:
        ct.enable(model, method)
    except cumulus.Error as e:
        assert "not yet on cuda" in str(e)  # the CPU-only methods say so, before any work
        return
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert out.shape == (1, 2008)
    s = ct.stats(model)
    assert s.layer_steps == 2 * 7 and 0 < s.tokens_attended <= 2007


def test_smollm2_on_cuda_kl_against_sdpa():
    import transformers

    pytest.importorskip("gguf")
    path = need(SMOLLM2, "SmolLM2 GGUF (scripts/fetch-model.sh)")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float16).eval().cuda()
    m = cumulus.Model(str(path), threads=2)
    from conftest import SHARED

    text = need(SHARED / "data" / "text" / "pg1342_pride_and_prejudice.txt", "Pride and Prejudice").read_text()
    ids = torch.tensor([m.tokenize(text[:80000])[:4048]]).cuda()

    def forced(prompt=4000):
        arg = model._cumulus_state.cache_arg if hasattr(model, "_cumulus_state") else "past_key_values"
        with torch.no_grad():
            out = model(ids[:, :prompt], use_cache=True)
            cache = out.cache if hasattr(out, "cache") else out.past_key_values
            rows = [out.logits[0, -1]]
            for t in range(prompt, ids.shape[1] - 1):
                out = model(ids[:, t:t + 1], **{arg: cache}, use_cache=True)
                rows.append(out.logits[0, -1])
        return torch.log_softmax(torch.stack(rows).double(), -1)

    model.set_attn_implementation("sdpa")
    sdpa = forced()
    ct.enable(model, "dense")
    dense = forced()
    # gpu_dense_mib=0: select at every size (SmolLM2's 4K-token layers are far below the
    # default's 256 MiB, under which the GPU attends densely).
    ct.enable(model, "sketch_topp", p=0.9, gpu_dense_mib=0)
    sparse = forced()
    kl = lambda p, q: (p.exp() * (p - q)).sum(-1).mean().item()  # noqa: E731
    assert kl(sdpa, dense) < 1e-4, kl(sdpa, dense)
    assert kl(dense, sparse) <= 0.00152, kl(dense, sparse)  # docs/results.md: SmolLM2 at 8K
    assert ct.stats(model).kv_read_fraction < 1.0
