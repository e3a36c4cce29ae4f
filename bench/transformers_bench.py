#!/usr/bin/env python3
"""Decode speed of a transformers model with cumulus.transformers against transformers' own
SDPA, in one process, on the CPU or a GPU: a table and JSON.

  # SmolLM2's GGUF on the CPU, a real prompt
  python3 bench/transformers_bench.py --gguf models/SmolLM2-135M-Instruct.Q4_1.gguf \\
      --prompt-file ../shared/data/text/pg1342_pride_and_prejudice.txt --contexts 4000
  # a random-weight llama3-8b-shaped model on the GPU (bf16), random prompt tokens
  python3 bench/transformers_bench.py --shape llama3-8b --device cuda --dtype bf16 \\
      --contexts 32768,131072 --methods dense,sketch_topp

For each context, each round runs every configuration in turn (SDPA, then each cumulus
method), so all meet the same machine: a prefill (dense SDPA in every configuration; not
timed), then --new-tokens greedy decode steps through the model's forward with its cache,
each timed to the end of its device work, after one untimed warm-up run of every
configuration. The table gives the median tokens/s over rounds
and the ratio to SDPA of the same round set. A last pass per cumulus method repeats the
steps with the device synchronised around cumulus's calls: the time inside cumulus's calls
(append + decode, attention included) and inside the whole attention function per step, so
what Python and the integration add is the difference.
"""

import argparse
import gc
import inspect
import json
import pathlib
import statistics
import sys
import time

SHAPES = {
    # llama3-8b: 32 layers, 32 query heads, 8 kv heads, head_dim 128, vocab 128256.
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0),
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--gguf", help="a GGUF file transformers can read (needs gguf, accelerate)")
    src.add_argument("--shape", choices=sorted(SHAPES), help="a random-weight Llama model of this shape")
    ap.add_argument("--prompt-file", help="text for the prompt (default: random token ids)")
    ap.add_argument("--contexts", default="4000", help="comma list of prompt lengths in tokens")
    ap.add_argument("--new-tokens", type=int, default=32, help="decode steps timed per configuration and round")
    ap.add_argument("--methods", default="dense,sketch_topp", help="comma list of cumulus decode methods")
    ap.add_argument("--param", action="append", default=[], help="METHOD:KEY=VALUE, repeatable")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16", "f16"])
    ap.add_argument("--threads", type=int, default=0, help="torch and cumulus threads on the CPU (0: default)")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    methods = a.methods.split(",")
    if any(not m for m in methods):
        ap.error(f"--methods {a.methods!r} has an empty item")
    try:
        contexts = [int(c) for c in a.contexts.split(",")]
    except ValueError:
        ap.error(f"--contexts {a.contexts!r}: give a comma list of whole numbers")
    if any(c < 1 for c in contexts) or a.new_tokens < 1 or a.rounds < 1:
        ap.error("--contexts >= 1 each, --new-tokens >= 1 and --rounds >= 1")
    params: dict[str, dict[str, str]] = {m: {} for m in methods}
    for p in a.param:
        method, _, kv = p.partition(":")
        key, eq, value = kv.partition("=")
        if method not in params or not key or not eq:
            ap.error(f"--param {p!r}: give METHOD:KEY=VALUE with METHOD in --methods")
        params[method][key] = value

    import torch
    import transformers

    import cumulus
    import cumulus.transformers as ct

    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no GPU")
    if a.threads:
        torch.set_num_threads(a.threads)
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[a.dtype]
    dev = torch.device(a.device)
    need = max(contexts) + a.new_tokens + 1
    if a.gguf:
        path = pathlib.Path(a.gguf)
        if not path.is_file():
            ap.error(f"--gguf {a.gguf}: no such file")
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
        model = model.to(dev).eval()
        name = path.name
    else:
        cfg = transformers.LlamaConfig(**SHAPES[a.shape], max_position_embeddings=need)
        torch.manual_seed(0)
        torch.set_default_dtype(dtype)
        with dev:
            model = transformers.LlamaForCausalLM(cfg).eval()
        torch.set_default_dtype(torch.float32)
        name = f"random {a.shape}"
    model.set_attn_implementation("sdpa")
    vocab = model.config.get_text_config(decoder=True).vocab_size
    if a.prompt_file:
        if not a.gguf:
            ap.error("--prompt-file needs --gguf (its tokenizer)")
        tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        all_ids = tok(pathlib.Path(a.prompt_file).read_text(), return_tensors="pt").input_ids
        if all_ids.shape[1] < max(contexts):
            ap.error(f"--prompt-file gives {all_ids.shape[1]} tokens, fewer than {max(contexts)}")
    else:
        all_ids = torch.randint(0, vocab, (1, max(contexts)), generator=torch.Generator().manual_seed(1))

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def run(config: str, ids, profile: bool = False) -> tuple[float, float, float]:
        """Seconds of the decode steps, and (profile) seconds inside cumulus and attention."""
        if config == "sdpa":
            if hasattr(model, "_cumulus_state"):
                ct.disable(model)
            model.set_attn_implementation("sdpa")
            arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        else:
            ct.enable(model, config, **params[config])
            model._cumulus_state.profile = profile
            arg = model._cumulus_state.cache_arg
        with torch.no_grad():
            out = model(ids, use_cache=True, logits_to_keep=1)
            cache = out.cache if hasattr(out, "cache") else out.past_key_values
            nxt = out.logits[:, -1:].argmax(-1)
            del out
            sync()
            t0 = time.perf_counter()
            for _ in range(a.new_tokens):
                out = model(nxt, **{arg: cache}, use_cache=True)
                nxt = out.logits[:, -1:].argmax(-1)
            sync()
            total = time.perf_counter() - t0
        inside = attention = 0.0
        if config != "sdpa":
            st = model._cumulus_state
            inside, attention = st.time_cumulus, st.time_attention
            st.profile = False
        del cache, out, nxt
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        return total, inside, attention

    configs = ["sdpa"] + methods
    rows = []
    extra = "" if dev.type == "cuda" else f"  cpu simd {cumulus.simd_target()}  threads {torch.get_num_threads()}"
    gpu = torch.cuda.get_device_name() if dev.type == "cuda" else ""
    print(f"model {name}  device {a.device} {gpu}  dtype {a.dtype}  decode {a.new_tokens} steps  rounds {a.rounds}  "
          f"torch {torch.__version__}  transformers {transformers.__version__}{extra}", flush=True)
    print(f"{'context':>8} {'attention':<14} {'tok/s':>9} {'vs sdpa':>8} {'ms/step':>8} {'in cumulus':>11} "
          f"{'in attn fn':>11} {'K/V read':>9}", flush=True)
    # Warm-up: every configuration once at the first context (kernel selection, allocator,
    # lazy initialisation), not timed.
    warm_n, a.new_tokens = a.new_tokens, min(a.new_tokens, 4)
    for c in configs:
        run(c, all_ids[:, :contexts[0]].to(dev))
    a.new_tokens = warm_n
    for n in contexts:
        ids = all_ids[:, :n].to(dev)
        times = {c: [] for c in configs}
        fraction = {}
        for _ in range(a.rounds):
            for c in configs:
                times[c].append(run(c, ids)[0])
                if c != "sdpa":
                    fraction[c] = ct.stats(model).kv_read_fraction
        prof = {c: run(c, ids, profile=True) for c in methods}
        base = statistics.median(times["sdpa"])
        for c in configs:
            med = statistics.median(times[c])
            row = {"context": n, "attention": c, "tokens_per_s": a.new_tokens / med, "vs_sdpa": base / med,
                   "ms_per_step": 1e3 * med / a.new_tokens, "kv_read_fraction": fraction.get(c),
                   "ms_in_cumulus_per_step": 1e3 * prof[c][1] / a.new_tokens if c in prof else None,
                   "ms_in_attention_fn_per_step": 1e3 * prof[c][2] / a.new_tokens if c in prof else None,
                   "rounds_s": times[c]}
            rows.append(row)
            fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
            print(f"{n:>8} {c:<14} {row['tokens_per_s']:>9.2f} {row['vs_sdpa']:>7.2f}x {row['ms_per_step']:>8.2f} "
                  f"{fmt(row['ms_in_cumulus_per_step'], '.2f'):>11} {fmt(row['ms_in_attention_fn_per_step'], '.2f'):>11} "
                  f"{fmt(row['kv_read_fraction'], '.3f'):>9}", flush=True)
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps({
            "model": name, "device": a.device, "gpu": gpu, "dtype": a.dtype, "decode_steps": a.new_tokens,
            "rounds": a.rounds, "torch": torch.__version__, "transformers": transformers.__version__,
            "simd": cumulus.simd_target(), "params": params, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
