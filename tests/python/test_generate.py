"""Model.generate: stories260K's greedy sample from llama2.c (stories260K.md), and the same
text and statistics as `cumulus generate` for the same prompt and method."""

import re
import subprocess

import pytest

import cumulus
from conftest import SMOLLM2, STORIES


def test_greedy_reproduces_the_golden_sample(stories_model, stories_golden_sample):
    r = stories_model.generate("", max_tokens=256)
    assert r.prompt_tokens == [stories_model.bos_id]
    text = stories_model.detokenize(r.tokens)
    assert len(text) >= len(stories_golden_sample)
    assert text[: len(stories_golden_sample)] == stories_golden_sample
    assert r.stop_reason == "length" and r.stats.generated == 256 == len(r.tokens)
    assert r.stats.method == "dense" and r.stats.device == "cpu"
    assert r.stats.claimed_mass is None or r.stats.claimed_mass == pytest.approx(1.0)
    assert r.stats.kv_read_fraction == pytest.approx(1.0)


def cli_generate(cli, model, prompt, max_tokens, method, params=()):
    """The CLI's generated text and its table row (tokens attended, kv read %)."""
    cmd = [str(cli), "generate", "--model", str(model), "--prompt", prompt, "--max-tokens", str(max_tokens),
           "--method", method, "--threads", "2"]
    for p in params:
        cmd += ["--param", p]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    head = f"\n--- {method} ---\n"
    start = out.index(head) + len(head)
    text = out[start : out.index("\n\nmethod ", start)]
    row = next(line for line in out.splitlines() if line.startswith(method + " "))
    kv_read = float(re.search(r"([0-9.]+)%", row).group(1))
    tokens = float(row.split()[-2])
    return text, kv_read, tokens


@pytest.mark.parametrize("method,params", [("dense", {}), ("quest", {"budget": 32}),
                                           ("oracle_topp", {"p": 0.8})])
def test_generate_equals_the_cli_stories260k(cli, stories_model, method, params):
    prompt = "Once upon a time, there was a little dog"
    text, kv_read, tokens = cli_generate(cli, STORIES / "stories260K.bin", prompt, 96, method,
                                         [f"{k}={v}" for k, v in params.items()])
    r = stories_model.generate(prompt, 96, method, **params)
    assert r.text == text
    assert 100 * r.stats.kv_read_fraction == pytest.approx(kv_read, abs=0.051)
    assert r.stats.tokens_attended == pytest.approx(tokens, abs=0.51)
    if method == "quest":
        assert r.stats.claimed_mass is None
        assert r.stats.kv_read_fraction < 1
    if method == "oracle_topp":
        assert r.stats.claimed_mass >= 0.8


def test_generate_equals_the_cli_smollm2(cli, smollm2_model):
    prompt = "The capital of France is"
    text, _, _ = cli_generate(cli, SMOLLM2, prompt, 12, "dense")
    r = smollm2_model.generate(prompt, 12)
    assert r.text == text
    assert smollm2_model.detokenize(r.prompt_tokens) == prompt  # SmolLM2 adds no BOS


def test_stats_in_eval_mode_and_token_prompts(stories_model):
    prompt = stories_model.tokenize("Once upon a time")
    r = stories_model.generate(prompt, 24, "oracle_topp", p=0.7, eval=True)
    assert r.prompt_tokens == prompt
    s = r.stats
    assert s.true_mass is not None and s.claimed_mass is not None
    # Each head claims the mass of its own exact top-p set; its GQA group attends the union,
    # which holds at least that.
    assert s.claimed_mass >= 0.7 - 1e-6
    assert s.true_mass >= s.claimed_mass - 1e-6
    assert s.kv_bytes_read > 0 and 0 < s.kv_read_fraction <= 1
    assert s.head_steps == s.layer_steps * stories_model.n_q_heads
    assert s.decode_tokens_per_s > 0 and s.prefill_tokens_per_s > 0


def test_tactic_seed_goes_through_params(stories_model):
    # `seed` is generate's own keyword (the sampler's); tactic's seed goes in params.
    a = stories_model.generate("Once upon a time", 8, "tactic", params={"seed": 3}, p=1.0)
    b = stories_model.generate("Once upon a time", 8)
    assert a.tokens == b.tokens  # P = 1 attends what dense does


def test_device_cuda_without_cuda_is_a_clear_error():
    if cumulus.has_cuda:
        pytest.skip("this build has the CUDA backend")
    with pytest.raises(cumulus.Error, match="no CUDA backend"):
        cumulus.Model(str(STORIES / "stories260K.bin"), device="cuda")


@pytest.mark.parametrize("method", ["dense", "sketch_topp", "quest"])
def test_logits_rows_are_the_logits_generate_samples_from(stories_model, method):
    """Teacher-forced on generate's own greedy tokens, Model.logits' rows have those tokens as
    their argmax: the two calls run the same prefill, index and decode steps."""
    import numpy as np

    prompt = stories_model.tokenize("Once upon a time, there was a little girl")
    r = stories_model.generate(prompt, max_tokens=24, method=method)
    logits = stories_model.logits(prompt + r.tokens[:-1], prompt_tokens=len(prompt), method=method)
    assert logits.shape == (len(r.tokens), stories_model.vocab_size) and logits.dtype == np.float32
    assert list(logits.argmax(axis=1)) == r.tokens


def test_logits_bad_input(stories_model):
    with pytest.raises(cumulus.Error, match=r"prompt_tokens=0 must be in \[1, 3\]"):
        stories_model.logits([1, 2, 3], prompt_tokens=0)
    with pytest.raises(cumulus.Error, match="tokens is empty"):
        stories_model.logits([])
    with pytest.raises(cumulus.Error, match=r"tokens\[1\]=9999 is not a token id"):
        stories_model.logits([1, 9999])
    with pytest.raises(cumulus.Error, match="method='nope' is unknown"):
        stories_model.logits([1, 2], method="nope")
