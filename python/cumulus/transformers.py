"""cumulus methods inside Hugging Face transformers models (docs/python.md, "transformers").

``enable(model, method, **params)`` registers an attention function ``"cumulus"`` through
transformers' ``AttentionInterface`` (with the SDPA mask through ``AttentionMaskInterface``)
and switches the model to it. Then:

- Every forward that uses a cache gets a :class:`CumulusCache`: ``model.generate``, and the
  model's own forward with ``use_cache=True`` (a prefill call, then one call per token with
  the cache it returned). An empty cache of another class is replaced by one.
- The first call of a cache is the prefill: it runs dense, through SDPA, over the new K/V.
  Each sequence's unpadded K/V then goes into a :class:`cumulus.Decoder`, which builds the
  method's index with the prompt's last queries.
- Every later token goes through the method: its K/V is appended to the decoder, and its
  query is decoded over what the method selects. Several new tokens in one call (a chunk, a
  draft to verify) are decoded one at a time, each over the tokens before it.
- Sliding-window layers (Gemma 3's local layers, Mistral with a window) stay with
  transformers: their own cache layer and SDPA over the window.

A model on the CPU decodes through CPU decoders, a model on a CUDA device through the GPU
decoders (a build with CUDA). Decode steps are not differentiable.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import time
import weakref
from typing import Any

from . import _cumulus
from ._errors import Error

try:
    import torch
    from transformers.cache_utils import Cache, CacheLayerMixin, DynamicSlidingWindowLayer
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError(
        "cumulus.transformers needs torch and transformers (pip install torch transformers)"
    ) from e

__all__ = ["CumulusCache", "LayerStats", "Stats", "disable", "enable", "stats"]

NAME = "cumulus"
_TORCH_DTYPE = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
_KV_DTYPE = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


def _fail(where: str, message: str) -> None:
    raise Error(f"{where}: {message}")


# ----------------------------------------------------------------------------------------
# Statistics


_TOTAL_KEYS = ("steps", "tokens_attended", "claimed_mass", "claimed_count", "kv_read_share", "true_mass",
               "true_count")


@dataclasses.dataclass
class LayerStats:
    """One layer's decode steps through cumulus, summed since ``enable`` or the last reset
    (``cumulus.Decoder.totals`` of every cache's decoder)."""

    layer: int  # the model's layer index
    layer_steps: int = 0  # decode steps of this layer, one per sequence and token
    head_steps: int = 0  # query heads times layer_steps
    tokens_attended_sum: float = 0.0
    claimed_sum: float = 0.0
    claimed_count: int = 0
    true_sum: float = 0.0
    true_count: int = 0
    kv_share_sum: float = 0.0  # each step's share of the dense K/V bytes read, selection included

    @property
    def tokens_attended(self) -> float:
        """Mean tokens attended per head-step."""
        return self.tokens_attended_sum / self.head_steps if self.head_steps else 0.0

    @property
    def claimed_mass(self) -> float | None:
        """Mean attention mass the method claims; None when it makes no claim."""
        return self.claimed_sum / self.claimed_count if self.claimed_count else None

    @property
    def true_mass(self) -> float | None:
        """Mean true mass of the attended sets (``eval=True``); else None."""
        return self.true_sum / self.true_count if self.true_count else None

    @property
    def kv_read_fraction(self) -> float:
        """Mean share of the dense K/V bytes a step read, selection included."""
        return self.kv_share_sum / self.layer_steps if self.layer_steps else 0.0

    def _add(self, t: dict, sign: float = 1.0, n_q_heads: int = 0) -> None:
        self.layer_steps += int(sign * t["steps"])
        self.head_steps += int(sign * t["steps"] * n_q_heads)
        self.tokens_attended_sum += sign * t["tokens_attended"]
        self.claimed_sum += sign * t["claimed_mass"]
        self.claimed_count += int(sign * t["claimed_count"])
        self.true_sum += sign * t["true_mass"]
        self.true_count += int(sign * t["true_count"])
        self.kv_share_sum += sign * t["kv_read_share"]


@dataclasses.dataclass
class Stats:
    """What ``stats(model)`` returns: the method, and one entry per layer that cumulus ran."""

    method: str
    params: dict[str, Any]
    layers: list[LayerStats]

    def _total(self) -> LayerStats:
        t = LayerStats(layer=-1)
        for s in self.layers:
            for f in dataclasses.fields(LayerStats):
                if f.name != "layer":
                    setattr(t, f.name, getattr(t, f.name) + getattr(s, f.name))
        return t

    @property
    def layer_steps(self) -> int:
        return self._total().layer_steps

    @property
    def tokens_attended(self) -> float:
        return self._total().tokens_attended

    @property
    def claimed_mass(self) -> float | None:
        return self._total().claimed_mass

    @property
    def true_mass(self) -> float | None:
        return self._total().true_mass

    @property
    def kv_read_fraction(self) -> float:
        return self._total().kv_read_fraction


class _Box:
    """A cache's decoder, for the statistics: read while the cache lives, folded into the
    model's totals when it goes (weakref.finalize), so no cache is kept alive for them."""

    def __init__(self):
        self.decoder = None
        self.offset: dict[int, dict] = {}  # totals at the last reset, per decoder layer


def _fold(state: "_State", box: _Box) -> None:
    if box.decoder is not None:
        for layer, j in state.decoder_layer.items():
            state.stats[layer]._add(box.decoder.totals(j), n_q_heads=state.n_q_heads)
            if j in box.offset:
                state.stats[layer]._add(box.offset[j], -1.0, state.n_q_heads)
        box.decoder = None
    state.live.discard(box)


# ----------------------------------------------------------------------------------------
# The model's state while enabled


class _State:
    """What enable() attaches to a model: the method, the decoder options, the statistics."""

    def __init__(self, model, method: str, params: dict[str, Any], options: dict[str, Any]):
        self.method = method
        self.params = params  # as given; the decoder fills in the defaults
        self.options = options  # Decoder keywords: dtype, page_size, threads, eval, max_tokens
        cfg = model.config.get_text_config(decoder=True)
        self.n_q_heads = cfg.num_attention_heads
        self.n_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.n_layers = cfg.num_hidden_layers
        self.max_positions = int(getattr(cfg, "max_position_embeddings", 0) or 131072)
        self.window = _sliding_windows(cfg)  # per layer: None (full attention) or the window
        self.full_layers = [i for i, w in enumerate(self.window) if w is None]
        self.decoder_layer = {layer: j for j, layer in enumerate(self.full_layers)}
        self.stats = {layer: LayerStats(layer=layer) for layer in self.full_layers}  # folded caches
        self.live: weakref.WeakSet[_Box] = weakref.WeakSet()  # the caches alive now
        self.pending = None  # the CumulusLayer whose update() ran last, for the attention call
        # Benchmarks (bench/transformers_bench.py): with profile set, the attention calls
        # synchronise the device around their work and add up, in seconds, the time inside
        # the cumulus calls (append, decode) and inside the whole attention function.
        self.profile = False
        self.time_cumulus = 0.0
        self.time_attention = 0.0
        self.original_attn = None
        self.original_forward = None
        self.cache_arg = None

    def reset_stats(self) -> None:
        self.stats = {layer: LayerStats(layer=layer) for layer in self.full_layers}
        for box in list(self.live):
            if box.decoder is not None:
                box.offset = {j: box.decoder.totals(j) for j in self.decoder_layer.values()}

    def current(self) -> dict[int, LayerStats]:
        out = {layer: dataclasses.replace(s) for layer, s in self.stats.items()}
        for box in list(self.live):
            if box.decoder is None:
                continue
            for layer, j in self.decoder_layer.items():
                out[layer]._add(box.decoder.totals(j), n_q_heads=self.n_q_heads)
                if j in box.offset:
                    out[layer]._add(box.offset[j], -1.0, self.n_q_heads)
        return out


def _sliding_windows(cfg) -> list[int | None]:
    n = cfg.num_hidden_layers
    types = getattr(cfg, "layer_types", None)
    window = getattr(cfg, "sliding_window", None)
    if types is None:
        types = ["sliding_attention" if window else "full_attention"] * n
    out: list[int | None] = []
    for i, t in enumerate(types):
        if t == "full_attention":
            out.append(None)
        elif t in ("sliding_attention", "chunked_attention") and window:
            out.append(int(window))
        else:
            _fail("cumulus.transformers.enable", f"layer {i} has attention type {t!r}: only full and "
                  "sliding-window attention layers are supported")
    return out


# ----------------------------------------------------------------------------------------
# The cache


class CumulusLayer(CacheLayerMixin):
    """One full-attention layer of a :class:`CumulusCache`. Its K/V live in the cache's
    :class:`cumulus.Decoder` (layer ``decoder_layer``), not in tensors; ``update`` hands the
    new K/V to the attention call, which appends them."""

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self, cache: "CumulusCache", layer: int):
        super().__init__()
        self._cache = weakref.ref(cache)  # no cycle: the cache and its decoder go when unused
        self.layer = layer
        self.cumulative_length = 0  # tokens seen, padding included, as the masks count them

    @property
    def cache(self) -> "CumulusCache":
        return self._cache()

    def lazy_initialization(self, key_states, value_states) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cache._decoder_for(key_states)
        self.cache.state.pending = self
        self.cumulative_length += key_states.shape[-2]
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cumulative_length + query_length, 0

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return -1

    @property
    def batch_size(self) -> int:
        return self.cache.decoder.batch if self.cache.decoder is not None else -1

    def reset(self) -> None:
        self.cumulative_length = 0

    def crop(self, tokens_to_remove: int) -> None:
        pass  # CumulusCache.crop truncates the decoder, for every layer at once

    def offload(self):
        pass

    def prefetch(self):
        pass

    def reorder_cache(self, beam_idx) -> None:
        _fail("CumulusCache", "beam search (reorder_cache) is not supported: the method's index "
              "is per sequence")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.get_seq_length() > 0:
            _fail("CumulusCache", "batch_repeat_interleave on a filled cache is not supported")

    def batch_select_indices(self, indices) -> None:
        if self.get_seq_length() > 0:
            _fail("CumulusCache", "batch_select_indices on a filled cache is not supported")


class CumulusCache(Cache):
    """A transformers ``Cache`` whose full-attention layers live in one
    :class:`cumulus.Decoder`: cumulus's paged KV cache and the method's index, per sequence.
    Sliding-window layers keep transformers' own ``DynamicSlidingWindowLayer``.

    ``model.generate`` and forwards with ``use_cache=True`` make one for an enabled model;
    make one yourself with ``CumulusCache(model)`` to hold it across calls. The method and its
    parameters are those of ``enable`` when the cache was made."""

    def __init__(self, model):
        state = getattr(model, "_cumulus_state", None)
        if state is None:
            _fail("CumulusCache", "the model is not enabled: call cumulus.transformers.enable(model) first")
        self.state = state
        self.method = state.method
        self.params = dict(state.params)
        self.options = dict(state.options)
        self.decoder: _cumulus.Decoder | None = None
        self._box = _Box()
        weakref.finalize(self, _fold, state, self._box)
        layers = [
            CumulusLayer(self, i) if w is None else DynamicSlidingWindowLayer(sliding_window=w)
            for i, w in enumerate(state.window)
        ]
        super().__init__(layers=layers)

    def _decoder_for(self, key_states) -> None:
        if self.decoder is not None:
            if key_states.shape[0] != self.decoder.batch:
                _fail("CumulusCache", f"batch of {key_states.shape[0]} sequences; this cache holds "
                      f"{self.decoder.batch}")
            return
        opts = dict(self.options)
        cuda = key_states.device.type == "cuda"
        if opts.get("dtype") is None:
            # The GPU stores 16-bit K/V only: a float32 model's K/V are stored as f16 there.
            opts["dtype"] = _KV_DTYPE.get(key_states.dtype, "f32")
            if cuda and opts["dtype"] == "f32":
                opts["dtype"] = "f16"
        if cuda:
            opts["device"] = "cuda"
            # The device caches are sized at max_tokens up front: the model's context by default.
            opts.setdefault("max_tokens", self.state.max_positions)
        s = self.state
        self.decoder = _cumulus.Decoder(
            self.method, n_kv_heads=s.n_kv_heads, n_q_heads=s.n_q_heads, head_dim=s.head_dim,
            n_layers=len(s.full_layers), batch=int(key_states.shape[0]), params=self.params, **opts)
        self._box.decoder = self.decoder
        s.live.add(self._box)

    def reset(self):
        super().reset()
        _fold(self.state, self._box)
        self.decoder = None

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            _fail("CumulusCache.crop", f"tokens_to_remove={tokens_to_remove}: give a negative count "
                  "(tokens to drop), as transformers does")
        k = -tokens_to_remove
        for layer in self.layers:
            if isinstance(layer, CumulusLayer):
                if k > layer.cumulative_length:
                    _fail("CumulusCache.crop", f"cannot drop {k} of {layer.cumulative_length} tokens")
                layer.cumulative_length -= k
            else:
                layer.crop(tokens_to_remove)
        if self.decoder is not None and k:
            for seq, n in enumerate(self.decoder.lengths(0)):
                self.decoder.truncate(n - k, seq=seq)


# ----------------------------------------------------------------------------------------
# The attention function


def _valid_columns(mask, b: int, kv_len: int):
    """The key columns that sequence b's last query row may attend: a bool tensor [kv_len]."""
    if mask is None:
        return None
    row = mask[b, 0, -1, -kv_len:] if mask.dim() == 4 else mask[b, -kv_len:]
    return row if row.dtype == torch.bool else row == 0


def _to_decoder(x, dtype: str):
    """[B, H, T, D] -> [B, T, H, D], C-contiguous, in the storage dtype (CPU) or float32."""
    x = x.detach().transpose(1, 2)
    if x.dtype != _TORCH_DTYPE[dtype] or x.device.type == "cuda":
        x = x.float()
    return x.contiguous()


def _scaled_q(q, module, scaling, head_dim: int):
    """The decoder's softmax scale is 1/sqrt(head_dim); another scale is folded into q."""
    q = q.detach().float()
    if scaling is not None and not math.isclose(scaling * math.sqrt(head_dim), 1.0, rel_tol=1e-7):
        q = q * (scaling * math.sqrt(head_dim))
    return q.contiguous()


def cumulus_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                      scaling: float | None = None, **kwargs):
    """The attention function registered as ``"cumulus"``: query [B, Hq, T, D], key and value
    [B, Hkv, T, D] (the new tokens, as CumulusLayer.update returns them). Returns
    ([B, T, Hq, D], None)."""
    state: _State | None = getattr(module, "_cumulus_state", None)
    layer_obj = state.pending if state is not None else None
    if layer_obj is None or layer_obj.layer != module.layer_idx:
        # A sliding-window layer, a forward without a cache, or a cache of another class.
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    state.pending = None
    cache: CumulusCache = layer_obj.cache
    dec = cache.decoder
    layer = state.decoder_layer[module.layer_idx]
    B, Hq, T, D = query.shape
    dtype = dec.dtype
    lengths = dec.lengths(layer)
    if all(n == 0 for n in lengths):
        # The prefill: dense over the new K/V, then each sequence's unpadded K/V and the
        # method's index.
        out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                        scaling=scaling, **kwargs)
        k, v = _to_decoder(key, dtype), _to_decoder(value, dtype)
        q_all = _scaled_q(query.transpose(1, 2), module, scaling, D)  # [B, T, Hq, D]
        want = dec.prompt_queries
        if dec.device == "cuda":
            # The GPU caches append every sequence at once: no padding.
            for b in range(B):
                valid = _valid_columns(attention_mask, b, T)
                if valid is not None and not bool(valid.all()):
                    _fail("cumulus.transformers", f"sequence {b} is padded: on cuda the sequences of a batch "
                          "must be of one length (no padding)")
            dec.append(k, v, layer=layer)
            dec.build_index(layer=layer, prompt_q=q_all[:, -want:].contiguous() if want > 0 else None)
            return out, None
        for b in range(B):
            valid = _valid_columns(attention_mask, b, T)
            kb, vb, qb = (k[b], v[b], q_all[b]) if valid is None else (k[b][valid], v[b][valid], q_all[b][valid])
            if kb.shape[0] == 0:
                _fail("cumulus.transformers", f"sequence {b} has no unmasked token in its prompt")
            dec.append(kb.contiguous(), vb.contiguous(), layer=layer, seq=b)
            rows = qb[-want:].contiguous() if want > 0 else None
            dec.build_index(layer=layer, prompt_q=rows, seq=b)
        return out, None
    # Decode: each new token in turn, appended then decoded over the method's selection.
    if state.profile:
        _sync(query)
        t0 = time.perf_counter()
        out = _decode_rows(state, module, layer_obj, query, key, value, attention_mask, scaling, dec, layer, lengths)
        _sync(query)
        state.time_attention += time.perf_counter() - t0
        return out
    return _decode_rows(state, module, layer_obj, query, key, value, attention_mask, scaling, dec, layer, lengths)


def _sync(x) -> None:
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)


def _decode_rows(state, module, layer_obj, query, key, value, attention_mask, scaling, dec, layer, lengths):
    B, Hq, T, D = query.shape
    dtype = dec.dtype
    cuda = dec.device == "cuda"
    # On CPU the mask is checked against the cache; on cuda the prefill refused padding, and
    # reading the mask back would make every layer wait for the device.
    if attention_mask is not None and not cuda:
        for b in range(B):
            valid = _valid_columns(attention_mask, b, layer_obj.cumulative_length)
            n_valid = int(valid.sum())
            if n_valid != lengths[b] + T or not bool(valid[-T:].all()):
                _fail("cumulus.transformers", f"sequence {b}: the attention mask lets the last new token "
                      f"see {n_valid} tokens; the cache holds {lengths[b]} + {T} new. Only causal "
                      "masks with left padding are supported")
    k, v = _to_decoder(key, dtype), _to_decoder(value, dtype)  # [B, T, Hkv, D]
    q = _scaled_q(query, module, scaling, D)  # [B, Hq, T, D]
    out = torch.empty((B, T, Hq, D), dtype=torch.float32, device=query.device)
    # One token (the common case): k, v, q and out need no slicing, and out is written in place.
    step = out.view(B, Hq, D) if T == 1 else torch.empty((B, Hq, D), dtype=torch.float32, device=query.device)
    # Per-step statistics only where the totals lack them: the true mass on cuda (eval).
    want = dec.eval and cuda
    for t in range(T):
        if T == 1:
            kt, vt, qt = k, v, q.view(B, Hq, D)
        else:
            kt, vt, qt = k[:, t:t + 1].contiguous(), v[:, t:t + 1].contiguous(), q[:, :, t].contiguous()
        if state.profile:
            _sync(query)
            t0 = time.perf_counter()
        dec.append(kt, vt, layer=layer)
        dec.decode(qt, layer=layer, out=step, stats=want)
        if state.profile:
            _sync(query)
            state.time_cumulus += time.perf_counter() - t0
        if T > 1:
            out[:, t].copy_(step)
    return out.to(query.dtype), None


# ----------------------------------------------------------------------------------------
# enable / disable / stats


def _registered() -> None:
    ALL_ATTENTION_FUNCTIONS.register(NAME, cumulus_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


def _attention_modules(model):
    for m in model.modules():
        if hasattr(m, "layer_idx") and hasattr(m, "num_key_value_groups"):
            yield m


def _cache_argument(forward) -> str:
    names = inspect.signature(forward).parameters
    for name in ("cache", "past_key_values"):
        if name in names:
            return name
    _fail("cumulus.transformers.enable", "the model's forward takes no cache argument "
          "('cache' or 'past_key_values')")
    return ""


def _wrapped_forward(model, state: _State, forward):
    arg = state.cache_arg
    params = list(inspect.signature(forward).parameters)
    position = params.index(arg)

    def forward_with_cumulus_cache(*args, **kwargs):
        if len(args) > position:  # the cache given by position
            args = list(args)
            kwargs[arg] = args.pop(position)
            kwargs.update(zip(params[position + 1:], args[position:]))
            args = args[:position]
        cache = kwargs.get(arg)
        if cache is None and arg == "cache" and "past_key_values" in kwargs:
            cache = kwargs.pop("past_key_values")
        use_cache = kwargs.get("use_cache")
        if use_cache is None:
            use_cache = getattr(model.config, "use_cache", True)
        if cache is None:
            if use_cache:
                cache = CumulusCache(model)
        elif not isinstance(cache, CumulusCache):
            if cache.get_seq_length() != 0:
                _fail("cumulus.transformers", f"the model got a filled {type(cache).__name__}; an "
                      "enabled model decodes over a CumulusCache (pass none, or CumulusCache(model))")
            cache = CumulusCache(model)
        kwargs[arg] = cache
        return forward(*args, **kwargs)

    return forward_with_cumulus_cache


def _method_info(method: str):
    for m in _cumulus.methods():
        if m.name == method:
            return m
    names = ", ".join(m.name for m in _cumulus.methods() if m.decodes)
    _fail("cumulus.transformers.enable", f"method={method!r} is unknown (decode methods: {names})")


def enable(model, method: str = "sketch_topp", *, params: dict | None = None, kv_dtype: str | None = None,
           page_size: int = 16, threads: int | None = None, eval: bool = False,
           max_tokens: int | None = None, **method_params) -> None:
    """Puts the decode ``method`` into ``model``'s full-attention layers.

    - ``params`` / keywords: the method's parameters (``p=0.9``), checked now.
    - ``kv_dtype``: the decoders' K/V storage, ``"f32"``, ``"f16"`` or ``"bf16"``; default the
      model's dtype.
    - ``page_size``, ``threads``, ``max_tokens``: as :class:`cumulus.Decoder`.
    - ``eval=True``: every step also measures the true mass of the attended sets.

    Calling it again switches the method (for caches made from then on) and resets the
    statistics. Raises :class:`cumulus.Error` before changing anything."""
    where = "cumulus.transformers.enable"
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "get_text_config"):
        _fail(where, f"model is a {type(model).__name__}, not a transformers PreTrainedModel")
    info = _method_info(method)
    if not info.decodes:
        _fail(where, f"method={method!r} is a {info.kind} method, not a decode method")
    mp = dict(params or {})
    for k, v in method_params.items():
        if k in mp:
            _fail(where, f"method parameter {k!r} given twice (in params and as a keyword)")
        mp[k] = v
    if kv_dtype is not None and kv_dtype not in _TORCH_DTYPE:
        _fail(where, f"kv_dtype={kv_dtype!r} must be 'f32', 'f16' or 'bf16'")
    cfg = config.get_text_config(decoder=True)
    for name in ("attn_logit_softcapping",):
        if getattr(cfg, name, None):
            _fail(where, f"config.{name}={getattr(cfg, name)}: soft-capped attention logits are not supported")
    devices = {str(p.device) for p in model.parameters()}
    if len(devices) != 1 or not (devices <= {"cpu"} or next(iter(devices)).startswith("cuda")):
        _fail(where, f"the model's parameters are on {sorted(devices)}: cumulus runs a model on the CPU or "
              "on one CUDA device")
    device = next(iter(devices)).split(":")[0]
    if device == "cuda" and not _cumulus.has_cuda:
        _fail(where, "the model is on cuda but this build of cumulus has no CUDA backend (pip install . -C "
              "cmake.define.CUMULUS_CUDA=ON)")
    options = {"dtype": kv_dtype, "page_size": page_size, "threads": threads, "eval": eval}
    if max_tokens is not None:
        options["max_tokens"] = max_tokens
    state = _State(model, method, mp, options)
    if not state.full_layers:
        _fail(where, "the model has no full-attention layer: nothing for cumulus to decode")
    # A decoder of the model's shape checks the method's parameters and the options now.
    probe = _cumulus.Decoder(method, n_kv_heads=state.n_kv_heads, n_q_heads=state.n_q_heads,
                             head_dim=state.head_dim, page_size=page_size, threads=threads, eval=eval,
                             params=mp, device=device, max_tokens=16,
                             dtype=kv_dtype or ("f16" if device == "cuda" else "f32"))
    state.params = dict(mp)
    del probe
    _registered()
    old: _State | None = getattr(model, "_cumulus_state", None)
    if old is not None:
        state.original_attn = old.original_attn
        state.original_forward = old.original_forward
        state.cache_arg = old.cache_arg
        model.forward = _wrapped_forward(model, state, state.original_forward)
    else:
        state.original_attn = config._attn_implementation
        state.original_forward = model.forward
        state.cache_arg = _cache_argument(model.forward)
        model.forward = _wrapped_forward(model, state, model.forward)
    model._cumulus_state = state
    for m in _attention_modules(model):
        m._cumulus_state = state
    _set_attn(model, NAME)


def _set_attn(model, name: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # pragma: no cover - older transformers
        model.config._attn_implementation = name


def disable(model) -> None:
    """Gives the model back its attention implementation and forward. Caches made while it was
    enabled are of no further use."""
    state: _State | None = getattr(model, "_cumulus_state", None)
    if state is None:
        _fail("cumulus.transformers.disable", "the model is not enabled")
    _set_attn(model, state.original_attn or "sdpa")
    del model.forward  # the instance attribute; the class's forward shows again
    for m in _attention_modules(model):
        if hasattr(m, "_cumulus_state"):
            del m._cumulus_state
    del model._cumulus_state


def stats(model, *, reset: bool = False) -> Stats:
    """Per layer: tokens attended, claimed mass, true mass (``eval=True``) and K/V read over
    the decode steps since ``enable`` (or the last ``reset=True``)."""
    state: _State | None = getattr(model, "_cumulus_state", None)
    if state is None:
        _fail("cumulus.transformers.stats", "the model is not enabled")
    current = state.current()
    out = Stats(method=state.method, params=dict(state.params), layers=[current[i] for i in state.full_layers])
    if reset:
        state.reset_stats()
    return out
