"""cumulus.transformers against transformers itself: small random models built from configs
(nothing downloaded), and SmolLM2's GGUF loaded by transformers' own GGUF reader.

The references are transformers' eager attention (dense) and cumulus's C++ runtime; neither
is the Python integration under test.
"""

import math

import pytest

import cumulus

torch = pytest.importorskip("torch", reason="cumulus.transformers needs torch (pip install torch)")
transformers = pytest.importorskip("transformers")
import cumulus.transformers as ct  # noqa: E402

from conftest import SMOLLM2, need  # noqa: E402

# Dense through cumulus (f32 K/V) against eager attention: the same products in another
# order, so float32 rounding only. Observed: <= 3e-7 on these models.
LOGIT_ATOL = 1e-4


def _small(kind: str):
    """A random-weight model of each family, tiny (about 100K parameters)."""
    common = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**common)
        cls = transformers.Qwen2ForCausalLM
    elif kind == "qwen3":
        cfg = transformers.Qwen3Config(**common, head_dim=16)
        cls = transformers.Qwen3ForCausalLM
    elif kind == "mistral":
        cfg = transformers.MistralConfig(**common, sliding_window=None)
        cls = transformers.MistralForCausalLM
    elif kind == "gemma3":
        # Two sliding layers of window 16, then a full one: Gemma 3's 5:1 pattern, shortened.
        cfg = transformers.Gemma3TextConfig(**{**common, "num_hidden_layers": 3}, head_dim=32,
                                            sliding_window=16, query_pre_attn_scalar=24,
                                            layer_types=["sliding_attention", "sliding_attention",
                                                         "full_attention"])
        cls = transformers.Gemma3ForCausalLM
    else:
        raise ValueError(kind)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls(cfg).eval()
    # Random init gives nearly uniform attention; larger q/k projections make it peaked, as
    # trained models are, so that sparse methods select something.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(4.0)
    return model


def _generate(model, ids, n, **kw):
    kw.setdefault("do_sample", False)
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, min_new_tokens=n, output_logits=True,
                              return_dict_in_generate=True, **kw)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral", "gemma3"])
def test_dense_generates_eager_tokens(kind):
    model = _small(kind)
    ids = torch.randint(0, 320, (1, 50), generator=torch.Generator().manual_seed(1))
    ref = _generate(model, ids, 40)
    ct.enable(model, "dense")
    assert model.config._attn_implementation == "cumulus"
    got = _generate(model, ids, 40)
    assert torch.equal(ref.sequences, got.sequences)
    err = max((a - b).abs().max().item() for a, b in zip(ref.logits, got.logits))
    assert err <= LOGIT_ATOL, err
    s = ct.stats(model)
    full = [i for i, t in enumerate(getattr(model.config, "layer_types", None) or ["full"] * 2)
            if t in ("full", "full_attention")]
    assert [layer.layer for layer in s.layers] == full
    # 39 decode steps (the last token is sampled, not decoded), every layer through cumulus.
    assert all(layer.layer_steps == 39 for layer in s.layers)
    assert s.kv_read_fraction == pytest.approx(1.0)
    # Dense attends every cached token: 50 prompt tokens + 1..39 decoded.
    assert s.tokens_attended == pytest.approx(50 + 20)
    ct.disable(model)
    assert model.config._attn_implementation == "eager"
    again = _generate(model, ids, 40)
    assert torch.equal(ref.sequences, again.sequences)


def test_sampled_decoding_matches_eager():
    """Sampling (temperature, top-k, top-p) draws the same tokens from the same generator when
    the logits agree to float32 rounding."""
    model = _small("llama")
    ids = torch.randint(0, 320, (2, 30), generator=torch.Generator().manual_seed(7))
    kw = dict(do_sample=True, temperature=0.8, top_k=50, top_p=0.95)
    torch.manual_seed(11)
    ref = _generate(model, ids, 32, **kw)
    ct.enable(model, "dense")
    torch.manual_seed(11)
    got = _generate(model, ids, 32, **kw)
    assert torch.equal(ref.sequences, got.sequences)
    assert not torch.equal(got.sequences, _generate(model, ids, 32).sequences)  # it did sample


def test_left_padded_batch_matches_eager():
    model = _small("llama")
    g = torch.Generator().manual_seed(2)
    long, short = torch.randint(0, 320, (1, 40), generator=g), torch.randint(0, 320, (1, 25), generator=g)
    ids = torch.cat([long, torch.cat([torch.zeros(1, 15, dtype=torch.long), short], 1)])
    mask = torch.ones_like(ids)
    mask[1, :15] = 0
    ref = _generate(model, ids, 32, attention_mask=mask, pad_token_id=0)
    ct.enable(model, "dense")
    got = _generate(model, ids, 32, attention_mask=mask, pad_token_id=0)
    assert torch.equal(ref.sequences, got.sequences)
    err = max((a - b).abs().max().item() for a, b in zip(ref.logits, got.logits))
    assert err <= LOGIT_ATOL, err


def test_forward_with_cache_prefill_then_one_token_per_call():
    model = _small("qwen2")
    ids = torch.randint(0, 320, (2, 60), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(ids).logits  # eager, teacher-forced, no cache
        ct.enable(model, "dense")
        out = model(ids[:, :30], use_cache=True)
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        assert isinstance(cache, ct.CumulusCache)
        rows = [out.logits[:, -1]]
        for t in range(30, 59):
            out = model(ids[:, t:t + 1], **{ct_cache_arg(model): cache}, use_cache=True)
            rows.append(out.logits[:, -1])
        model(ids[:, 59:60], **{ct_cache_arg(model): cache}, use_cache=True)
    got = torch.stack(rows, 1)
    assert (got - ref[:, 29:59]).abs().max().item() <= LOGIT_ATOL
    assert cache.get_seq_length() == 60
    assert cache.decoder.lengths(0) == [60, 60]


def ct_cache_arg(model):
    return model._cumulus_state.cache_arg


def test_a_chunk_after_the_prefill_is_decoded_token_by_token():
    model = _small("llama")
    ids = torch.randint(0, 320, (1, 48), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = model(ids).logits
        ct.enable(model, "dense")
        cache = ct.CumulusCache(model)
        arg = ct_cache_arg(model)
        model(ids[:, :32], **{arg: cache}, use_cache=True)
        out = model(ids[:, 32:], **{arg: cache}, use_cache=True)
    assert (out.logits - ref[:, 32:]).abs().max().item() <= LOGIT_ATOL
    assert ct.stats(model).layer_steps == 2 * 16


def _decode_methods():
    return [m.name for m in cumulus.methods() if m.decodes]


@pytest.mark.parametrize("method", _decode_methods())
def test_every_decode_method_runs_and_its_claims_hold(method):
    model = _small("llama")
    ids = torch.randint(0, 320, (1, 600), generator=torch.Generator().manual_seed(5))
    ct.enable(model, method, eval=True)
    got = _generate(model, ids, 8)
    assert got.sequences.shape == (1, 608)
    s = ct.stats(model)
    assert s.method == method and s.layer_steps == 2 * 7
    assert 0 < s.tokens_attended <= 607
    assert 0 < s.kv_read_fraction
    assert s.true_mass is not None and 0 < s.true_mass <= 1 + 1e-6
    info = next(m for m in cumulus.methods() if m.name == method)
    if s.claimed_mass is not None and info.target_param:
        # A claim is a lower bound on the mass over what was read: the attended union holds at
        # least what the method claims (the C++ contract, methods/method.h).
        target = s.params.get(info.target_param, next(p.default for p in info.params
                                                      if p.name == info.target_param))
        assert s.true_mass >= s.claimed_mass - 1e-3, (s.true_mass, s.claimed_mass)
        assert s.claimed_mass >= float(target) - 1e-3 or method in ("tactic", "lfps", "psa")


def test_enable_again_switches_the_method():
    model = _small("llama")
    ids = torch.randint(0, 320, (1, 800), generator=torch.Generator().manual_seed(6))
    ct.enable(model, "dense")
    _generate(model, ids, 4)
    assert ct.stats(model).tokens_attended == pytest.approx(800 + 2)  # 3 steps over 801..803 tokens
    ct.enable(model, "oracle_topp", p=0.5)
    assert ct.stats(model).layer_steps == 0
    _generate(model, ids, 4)
    s = ct.stats(model)
    assert s.method == "oracle_topp" and s.params == {"p": 0.5}
    assert s.tokens_attended < 800
    assert s.claimed_mass >= 0.5 - 1e-6


def test_stats_reset():
    model = _small("llama")
    ct.enable(model, "dense")
    _generate(model, torch.zeros(1, 10, dtype=torch.long), 3)
    assert ct.stats(model, reset=True).layer_steps == 4
    assert ct.stats(model).layer_steps == 0


def test_bad_input_is_refused_before_any_change():
    model = _small("llama")
    with pytest.raises(cumulus.Error, match="method='nope' is unknown"):
        ct.enable(model, "nope")
    with pytest.raises(cumulus.Error, match="flexprefill"):
        ct.enable(model, "flexprefill")
    with pytest.raises(cumulus.Error, match="p="):
        ct.enable(model, "sketch_topp", p=1.5)
    with pytest.raises(cumulus.Error, match="unknown parameter|not a parameter|has no parameter"):
        ct.enable(model, "sketch_topp", q=3)
    with pytest.raises(cumulus.Error, match="kv_dtype='f8'"):
        ct.enable(model, "dense", kv_dtype="f8")
    with pytest.raises(cumulus.Error, match="not a transformers"):
        ct.enable(torch.nn.Linear(2, 2), "dense")
    with pytest.raises(cumulus.Error, match="not enabled"):
        ct.stats(model)
    with pytest.raises(cumulus.Error, match="not enabled"):
        ct.CumulusCache(model)
    assert model.config._attn_implementation == "eager" and "forward" not in vars(model)


def test_a_filled_cache_of_another_class_is_refused():
    model = _small("llama")
    ids = torch.zeros(1, 8, dtype=torch.long)
    with torch.no_grad():
        out = model(ids, use_cache=True)
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        ct.enable(model, "dense")
        with pytest.raises(cumulus.Error, match="filled DynamicCache"):
            model(ids[:, :1], **{ct_cache_arg(model): cache}, use_cache=True)


# --- Real weights: SmolLM2's GGUF read by transformers (and gguf-py) -------------------------

PROMPT, STEPS = 1500, 48  # sketch_topp attends densely up to min_context=1024


@pytest.fixture(scope="module")
def smollm2_hf():
    pytest.importorskip("gguf", reason="transformers reads GGUF through the gguf package")
    pytest.importorskip("accelerate", reason="transformers loads GGUF files through accelerate")
    path = need(SMOLLM2, "SmolLM2 GGUF (scripts/fetch-model.sh)")
    torch.set_num_threads(2)
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                             dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def smollm2_tokens(smollm2_model):
    from conftest import SHARED

    text = need(SHARED / "data" / "text" / "pg1342_pride_and_prejudice.txt", "Pride and Prejudice").read_text()
    return smollm2_model.tokenize(text[:40000])[: PROMPT + STEPS]


def _teacher_forced(model, ids):
    """Logits after the prompt and after each later token, through the enabled model's cache."""
    arg = ct_cache_arg(model)
    x = torch.tensor([ids])
    with torch.no_grad():
        cache = ct.CumulusCache(model)
        rows = [model(x[:, :PROMPT], **{arg: cache}, use_cache=True).logits[0, -1]]
        for t in range(PROMPT, len(ids) - 1):
            rows.append(model(x[:, t:t + 1], **{arg: cache}, use_cache=True).logits[0, -1])
    return torch.stack(rows).double()


def _kl(p_logits, q_logits):
    """Mean KL(p || q) of the next-token distributions, rows in float64."""
    lp, lq = torch.log_softmax(p_logits, -1), torch.log_softmax(q_logits, -1)
    return (lp.exp() * (lp - lq)).sum(-1).mean().item()


def test_smollm2_transformers_and_cumulus_runtime_agree(smollm2_hf, smollm2_model, smollm2_tokens):
    """transformers (its GGUF reader, its Llama) with cumulus dense against cumulus's own C++
    runtime (f32 weights, f32 K/V) on the same text: the same next-token distributions, up to
    float32 rounding. Each side computes everything except the attention independently."""
    import cumulus as c

    ct.enable(smollm2_hf, "dense")
    hf = _teacher_forced(smollm2_hf, smollm2_tokens)
    ours = c.Model(str(SMOLLM2), threads=2, weights="f32", kv_dtype="f32")
    native = torch.from_numpy(ours.logits(smollm2_tokens[:-1], prompt_tokens=PROMPT)).double()
    assert native.shape == hf.shape
    kl = _kl(hf, native)
    # Observed 6e-11 here; a wrong rope, norm or tied head moves it by orders of magnitude.
    assert kl < 1e-6, kl
    assert (hf.argmax(-1) == native.argmax(-1)).float().mean().item() >= 0.97


def test_smollm2_sketch_topp_kl_within_published_figures(smollm2_hf, smollm2_tokens):
    """sketch_topp against dense, both through transformers: docs/results.md publishes a mean
    KL of 0.00152 on Pride and Prejudice at 8K for SmolLM2 (0.00142 on Moby Dick)."""
    ct.enable(smollm2_hf, "dense")
    dense = _teacher_forced(smollm2_hf, smollm2_tokens)
    ct.enable(smollm2_hf, "sketch_topp", p=0.9)
    sparse = _teacher_forced(smollm2_hf, smollm2_tokens)
    s = ct.stats(smollm2_hf)
    kl = _kl(dense, sparse)
    assert kl <= 0.00152, kl
    assert s.layer_steps == smollm2_hf.config.num_hidden_layers * (STEPS - 1)
    assert s.kv_read_fraction < 1.0
    assert not math.isnan(kl)
    ct.disable(smollm2_hf)
