"""Attention-backend resolution: a pure function, table-tested over devices x spec x choice."""
from __future__ import annotations

import itertools

import pytest

from blockspec.args import (BACKENDS, ArgsError, BackendInfo, DeviceInfo,
                            resolve_attention_backends)

DEVICES = {"cpu": DeviceInfo("cpu"), "sm80": DeviceInfo("cuda", 80), "sm90": DeviceInfo("cuda", 90),
           "sm100": DeviceInfo("cuda", 100), "sm120": DeviceInfo("cuda", 120)}

# A registry shaped like a fuller engine's, to exercise the preference and capability rules.
FULL = {
    "torch_native": BackendInfo("torch_native", ("cpu", "cuda")),
    "triton": BackendInfo("triton", ("cuda",), min_capability=80, needs_available="triton"),
    "fa3": BackendInfo("fa3", ("cuda",), min_capability=90, noncausal_blocks=False),
}
ORDER = ("fa3", "triton", "torch_native")


def resolve(dev, spec, registry=FULL, order=ORDER, available=frozenset({"triton"}), **explicit):
    kw = dict(attention_backend=None, prefill_attention_backend=None, decode_attention_backend=None,
              speculative_draft_attention_backend=None)
    kw.update(explicit)
    return resolve_attention_backends(DEVICES[dev], speculative_algorithm="DFLASH" if spec else None,
                                      backends=registry, auto_order=order, available=available, **kw)


# (device, spec) -> expected auto (prefill, decode, draft)
AUTO = {
    ("cpu", False): ("torch_native", "torch_native", None),
    ("cpu", True): ("torch_native", "torch_native", "torch_native"),
    ("sm80", False): ("triton", "triton", None),
    ("sm80", True): ("triton", "triton", "triton"),
    ("sm90", False): ("fa3", "fa3", None),
    ("sm90", True): ("fa3", "fa3", "triton"),      # fa3 cannot run a bidirectional draft block
    ("sm100", False): ("fa3", "fa3", None),
    ("sm100", True): ("fa3", "fa3", "triton"),
    ("sm120", False): ("fa3", "fa3", None),
    ("sm120", True): ("fa3", "fa3", "triton"),
}


@pytest.mark.parametrize("dev, spec, explicit", list(itertools.product(DEVICES, [False, True], [False, True])))
def test_table(dev, spec, explicit):
    if not explicit:
        r = resolve(dev, spec)
        assert (r.prefill, r.decode, r.draft) == AUTO[(dev, spec)]
        return
    # explicit choices are never overridden
    r = resolve(dev, spec, attention_backend="torch_native",
                speculative_draft_attention_backend="torch_native" if spec else None)
    assert (r.prefill, r.decode) == ("torch_native", "torch_native")
    assert r.draft == ("torch_native" if spec else None)
    if dev != "cpu":
        r = resolve(dev, spec, prefill_attention_backend="triton", decode_attention_backend="torch_native")
        assert (r.prefill, r.decode) == ("triton", "torch_native")


def test_errors_name_flag_and_choices():
    with pytest.raises(ArgsError, match=r"--attention-backend: unknown attention backend 'flashinfer'; "
                                        r"choices: auto, fa3, torch_native, triton"):
        resolve("sm90", False, attention_backend="flashinfer")
    with pytest.raises(ArgsError, match="'fa3' is not available on cuda sm80"):
        resolve("sm80", False, decode_attention_backend="fa3")
    with pytest.raises(ArgsError, match="'triton' is not available on cpu"):
        resolve("cpu", True, speculative_draft_attention_backend="triton")
    with pytest.raises(ArgsError, match="'triton' is not available"):
        resolve("sm90", False, attention_backend="triton", available=frozenset())


def test_shipped_registry_resolves_everywhere():
    for dev, spec in itertools.product(DEVICES, [False, True]):
        r = resolve(dev, spec, registry=BACKENDS, order=("torch_native",))
        assert r.decode in BACKENDS and (r.draft in BACKENDS if spec else r.draft is None)


# ---- the draft attention flag selects the draft's implementation ---------------------------
def test_draft_attention_flag_selects_the_draft_implementation(monkeypatch, tmp_path):
    """--speculative-draft-attention-backend picks the backend the draft's attention runs in,
    through the same registry as the target's: a recording backend set for the draft alone sees
    every draft layer (and no target layer), and the output stays target-only exact."""
    from blockspec import Engine
    from blockspec.args import BACKENDS
    from blockspec import attention
    from blockspec.attention.torch_native import TorchNativeAttention
    from tests.spec_fixtures import draft_config, make_spec_target, write_draft

    calls = []

    class Recording(TorchNativeAttention):
        name = "recording"

        def attend(self, q, k_cache, v_cache, meta, **kw):
            calls.append((meta.mode.value, q.shape[1]))
            return super().attend(q, k_cache, v_cache, meta, **kw)

    monkeypatch.setitem(BACKENDS, "recording", BackendInfo("recording", ("cpu",)))
    monkeypatch.setitem(attention.FACTORIES, "recording", Recording)
    _, target = make_spec_target(tmp_path, offset=2.0, mix=0.3, pull=3.5)
    draft = write_draft(tmp_path / "d", draft_config("dflash", hidden=32, vocab=24, target_layers=7,
                                                     block_size=4), std=0.05)
    sp = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    ref = Engine(model_path=str(target), device="cpu").generate(input_ids=[3, 5, 7], sampling_params=sp)
    e = Engine(model_path=str(target), device="cpu", speculative_algorithm="DFLASH",
               speculative_draft_model_path=str(draft), speculative_draft_attention_backend="recording")
    assert e.backends.draft == "recording" and e.backends.decode == "torch_native"
    assert type(e.drafter.attn) is Recording and type(e.runner.decode_attn) is not Recording
    out = e.generate(input_ids=[3, 5, 7], sampling_params=sp)
    assert out["output_ids"] == ref["output_ids"]
    assert calls and {mode for mode, _ in calls} == {"draft"}
    assert {heads for _, heads in calls} == {4}                       # the draft's 4 query heads
    assert len(calls) % 2 == 0                                         # both draft layers, each step


def test_draft_attention_flag_refuses_unknown_and_unsuitable_values(tmp_path):
    from blockspec import Engine

    with pytest.raises(ArgsError, match="unknown attention backend 'nope'"):
        Engine(device="cpu", speculative_algorithm="DFLASH", speculative_draft_model_path=str(tmp_path),
               speculative_draft_attention_backend="nope")
    with pytest.raises(ArgsError, match="'triton' is not available on cpu"):
        Engine(device="cpu", speculative_algorithm="DFLASH", speculative_draft_model_path=str(tmp_path),
               speculative_draft_attention_backend="triton")
