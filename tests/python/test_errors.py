"""Bad input: a cumulus.Error (a ValueError and a RuntimeError) naming the value, raised before
any work, with the C++ library's message where the check is the library's."""

import numpy as np
import pytest

import cumulus
from conftest import STORIES


def decoder(**kw):
    return cumulus.Decoder(n_kv_heads=2, n_q_heads=4, head_dim=16, **kw)


def test_error_is_a_value_error_and_a_runtime_error_with_its_parts():
    with pytest.raises(cumulus.Error) as e:
        cumulus.Decoder("no_such_method", n_kv_heads=1, n_q_heads=1, head_dim=8)
    assert isinstance(e.value, ValueError) and isinstance(e.value, RuntimeError)
    # The registry's own message (src/methods/registry.cpp), known methods listed.
    assert e.value.message.startswith("method='no_such_method' is unknown (known: dense,")
    assert str(e.value) == f"{e.value.where}: {e.value.message}"


@pytest.mark.parametrize("kw,match", [
    ({"p": 1.5}, r"method 'oracle_topp': parameter p=1.5"),
    ({"q": 1}, r"method 'oracle_topp' has no parameter 'q' \(it has: p\)"),
    ({"p": "high"}, r"p='?high"),
])
def test_bad_method_parameters(kw, match):
    with pytest.raises(cumulus.Error, match=match):
        cumulus.Decoder("oracle_topp", n_kv_heads=1, n_q_heads=1, head_dim=8, **kw)


def test_bad_shapes_and_options():
    with pytest.raises(cumulus.Error, match="n_q_heads=3 must be a multiple of n_kv_heads=2"):
        cumulus.Decoder(n_kv_heads=2, n_q_heads=3, head_dim=16)
    with pytest.raises(cumulus.Error, match="head_dim=12 is not supported"):
        cumulus.Decoder(n_kv_heads=1, n_q_heads=1, head_dim=12)
    with pytest.raises(cumulus.Error, match="f8"):
        decoder(dtype="f8")
    with pytest.raises(cumulus.Error, match="device='cuda'"):
        decoder(device="cuda")
    with pytest.raises(cumulus.Error, match="flexprefill"):
        cumulus.Decoder("flexprefill", n_kv_heads=1, n_q_heads=1, head_dim=8)


def test_bad_arrays_name_the_argument_and_value():
    d = decoder()
    k = np.zeros((3, 2, 16), dtype=np.float32)
    with pytest.raises(cumulus.Error, match=r"Decoder.append: k has shape \[3, 2, 8\]: expected \[n, 2, 16\]"):
        d.append(k[:, :, :8].copy(), k[:, :, :8].copy())
    with pytest.raises(cumulus.Error, match=r"k and v are float64: give float32, or float16"):
        d.append(k.astype(np.float64), k.astype(np.float64))
    with pytest.raises(cumulus.Error, match=r"k is float32 but v is float16"):
        d.append(k, k.astype(np.float16))
    with pytest.raises(cumulus.Error, match=r"k is not C-contiguous \(shape \[3, 2, 16\], strides \[32, 1, 2\] in elements"):
        d.append(np.zeros((3, 16, 2), dtype=np.float32).transpose(0, 2, 1), k)
    with pytest.raises(cumulus.Error, match=r"sequence 0 layer 0 holds no tokens"):
        d.decode(np.zeros((4, 16), dtype=np.float32))
    d.append(k, k)
    assert d.lengths() == [3]
    with pytest.raises(cumulus.Error, match=r"q is float64: give float32"):
        d.decode(np.zeros((4, 16)))
    with pytest.raises(cumulus.Error, match=r"q is not C-contiguous"):
        d.decode(np.zeros((4, 32), dtype=np.float32)[:, ::2])
    with pytest.raises(cumulus.Error, match=r"layer=1 must be in \[0, 1\)"):
        d.decode(np.zeros((4, 16), dtype=np.float32), layer=1)
    with pytest.raises(cumulus.Error, match=r"non-finite|NaN|nan"):
        d.decode(np.full((4, 16), np.nan, dtype=np.float32))
    with pytest.raises(cumulus.Error, match=r"n=5: sequence 0 layer 0 holds only 3 tokens"):
        d.truncate(5)
    with pytest.raises(cumulus.Error, match=r"seq=2 must be in \[0, 1\)"):
        d.append(k, k, seq=2)
    with pytest.raises(cumulus.Error, match=r"out has shape \[4, 8\]"):
        d.decode(np.zeros((4, 16), dtype=np.float32), out=np.zeros((4, 8), dtype=np.float32))
    assert d.lengths() == [3]  # nothing was appended by the failed calls


def test_torch_tensors_on_the_wrong_device_or_layout():
    torch = pytest.importorskip("torch")
    d = decoder()
    k = torch.zeros(3, 2, 16)
    with pytest.raises(cumulus.Error, match="not C-contiguous"):
        d.append(torch.zeros(3, 16, 2).transpose(1, 2), k)
    if torch.cuda.is_available():
        with pytest.raises(cumulus.Error, match="k is on cuda:0"):
            d.append(k.cuda(), k.cuda())


def test_model_errors_carry_the_cpp_message(tmp_path):
    with pytest.raises(cumulus.Error, match="missing.gguf"):
        cumulus.Model(str(tmp_path / "missing.gguf"))
    with pytest.raises(cumulus.Error, match="device='tpu' must be 'cpu' or 'cuda'"):
        cumulus.Model(str(tmp_path / "missing.gguf"), device="tpu")
    with pytest.raises(cumulus.Error, match="threads=0 must be in"):
        cumulus.Model(str(tmp_path / "missing.gguf"), threads=0)


def test_generate_errors_before_any_work(stories_model):
    with pytest.raises(cumulus.Error, match="max_tokens=0 must be >= 1"):
        stories_model.generate("Once", 0)
    with pytest.raises(cumulus.Error, match="method='flexprefill' is a prefill method"):
        stories_model.generate("Once", 4, "flexprefill")
    with pytest.raises(cumulus.Error, match="method='nope' is unknown"):
        stories_model.generate("Once", 4, "nope")
    with pytest.raises(cumulus.Error, match="parameter p=2"):
        stories_model.generate("Once", 4, "oracle_topp", p=2)
    with pytest.raises(cumulus.Error, match=r"prompt\[1\]=512 is not a token id of this model \(vocabulary of 512\)"):
        stories_model.generate([1, 512], 4)
    with pytest.raises(cumulus.Error, match=r"exceeds the model's context of 512 tokens"):
        stories_model.generate("Once", 600)
    with pytest.raises(cumulus.Error, match=r"top_p=0 must be in"):
        stories_model.generate("Once", 4, top_p=0)
    with pytest.raises(cumulus.Error, match=r"tokens\[0\]=-1"):
        stories_model.detokenize([-1])


def test_a_failed_batched_append_changes_nothing():
    d = decoder(batch=2)
    k = np.ones((2, 5, 2, 16), dtype=np.float32)
    k[1, 3, 0, 7] = np.inf
    with pytest.raises(cumulus.Error, match=r"k\[.*\] \(flat index\) is not finite"):
        d.append(k, np.ones_like(k))
    assert d.lengths() == [0, 0]
    with pytest.raises(cumulus.Error, match="not finite|non-finite|NaN|Inf"):
        d.append(k[1], np.ones_like(k[1]), seq=1)  # one sequence: the cache's own check
    assert d.lengths() == [0, 0]
