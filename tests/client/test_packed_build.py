"""A ternary device builds its packed model without the fp32 model (`build_packed_model`).

The result must be bit-identical to the old path (the whole fp32 model loaded, converted to
BitLinear, then packed): same codes, gammas, masks, latents, other tensors, checksum and logits
once the same published snapshot is loaded. A subprocess measures the start-up memory on a
Llama whose fp32 ternary matrices are about 226 MB.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save as save_safetensors
from seedfed.client.backends.base import DeviceStateError
from seedfed.client.ternary import PackedTernary
from seedfed.shared.model.factory import build_model
from seedfed.shared.model.replay import checksum
from seedfed.shared.model.ternary import (
    TernaryFormatError,
    TernaryScope,
    bitlinear_modules,
    build_packed_model,
    load_published_ternary,
    mask_config,
    publish_ternary,
)
from seedfed.shared.protocol.errors import ScopeError
from seedfed.shared.protocol.task import TaskSpec
from torch import nn

from tests.fleet_helpers import ternary_spec

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXTS = ["hello world", "ab"]


def _published(spec: TaskSpec) -> tuple[bytes, str]:
    """Version 0 of the task as the coordinator publishes it (bytes, checksum), with the
    masked latents moved off their initial values so a wrong copy would show."""
    scope = build_model(spec, initialize=True).scope
    assert isinstance(scope, TernaryScope)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for t in scope:
            t.tensor.add_(torch.randn(t.tensor.shape, generator=gen) * 1e-3)
    return save_safetensors(publish_ternary(scope.read(), scope)), checksum(scope)


def _old_device(spec: TaskSpec, data: bytes, check: str) -> tuple[nn.Module, TernaryScope]:
    """What PackedTernary did before: the fp32 model, converted, packed, latents dropped."""
    from seedfed.client.sync import read_snapshot

    model = build_model(spec, initialize=False).model
    for _, m in bitlinear_modules(model):
        m.to_packed(keep_latents=False)
    config = mask_config(spec.scope_options)
    scope = load_published_ternary(model, read_snapshot(data), config=config, epoch=0,
                                   expected_checksum=check)
    return model, scope


def _assert_same(old: nn.Module, new: nn.Module) -> None:
    old_state, new_state = old.state_dict(), new.state_dict()
    assert sorted(old_state) == sorted(new_state)
    for k, v in old_state.items():
        assert new_state[k].dtype == v.dtype, k
        assert torch.equal(new_state[k], v), k
    old_buf, new_buf = dict(old.named_buffers()), dict(new.named_buffers())
    assert sorted(old_buf) == sorted(new_buf)  # non-persistent ones (rotary inv_freq) too
    for k, v in old_buf.items():
        assert torch.equal(new_buf[k], v), k
    for (n0, m0), (n1, m1) in zip(bitlinear_modules(old), bitlinear_modules(new), strict=True):
        assert n0 == n1 and m1.is_packed and m0.act_bits == m1.act_bits
        assert m0.mask_epoch == m1.mask_epoch
        assert torch.equal(m0.codes(), m1.codes()), n0
    old_ties = {n for n, _ in old.named_parameters(remove_duplicate=False)}
    assert old_ties == {n for n, _ in new.named_parameters(remove_duplicate=False)}
    assert len(list(old.parameters())) == len(list(new.parameters()))  # same tying


def _variant(tiny_llama: Path, root: Path, kind: str) -> Path:
    """The tiny Llama as is, saved in shards (with an index), or with tied embeddings."""
    if kind == "single":
        return tiny_llama
    from transformers import AutoModelForCausalLM

    out = root / kind
    shutil.copytree(tiny_llama, out)
    (out / "model.safetensors").unlink()
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    if kind == "sharded":
        model.save_pretrained(out, max_shard_size="20KB")
        assert (out / "model.safetensors.index.json").is_file()
    else:
        model.config.tie_word_embeddings = True
        model.tie_weights()
        model.save_pretrained(out)
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["tie_word_embeddings"] is True
    return out


@pytest.mark.parametrize("kind", ["single", "sharded", "tied"])
def test_packed_build_is_bit_identical(tiny_llama: Path, tmp_path: Path, kind: str) -> None:
    spec = ternary_spec(_variant(tiny_llama, tmp_path, kind))
    data, check = _published(spec)
    old_model, old_scope = _old_device(spec, data, check)

    device = PackedTernary(spec)
    device.load_snapshot(data, 0, check)
    assert device.scope is not None
    _assert_same(old_model, device.model)
    assert checksum(device.scope) == checksum(old_scope) == check
    assert device.model.config.pad_token_id == old_model.config.pad_token_id
    enc = device.tokenizer(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        old_logits = old_model(**enc).logits
        new_logits = device.model(**enc).logits
    assert torch.equal(old_logits, new_logits)


def test_act_bits_from_scope_options(tiny_llama: Path) -> None:
    spec = ternary_spec(tiny_llama)
    spec = replace(spec, scope_options={**spec.scope_options.to_dict(), "act_bits": None})
    data, check = _published(spec)
    old_model, _ = _old_device(spec, data, check)
    device = PackedTernary(spec)
    device.load_snapshot(data, 0, check)
    assert {m.act_bits for _, m in bitlinear_modules(device.model)} == {None}
    _assert_same(old_model, device.model)


def test_no_codes_before_the_first_snapshot(tiny_llama: Path) -> None:
    device = PackedTernary(ternary_spec(tiny_llama))
    layers = bitlinear_modules(device.model)
    assert layers and all(m.packed is None and m.latent is None for _, m in layers)
    assert not any(p.is_meta for p in device.model.parameters())
    with pytest.raises(DeviceStateError, match="no snapshot"):
        _ = device.bundle
    with pytest.raises(DeviceStateError, match="no snapshot"):
        _ = device.trainer
    with pytest.raises(ScopeError, match="first snapshot"), torch.no_grad():
        device.model(input_ids=torch.tensor([[5, 6, 7]]))


def test_only_safetensors(tiny_llama: Path, tmp_path: Path) -> None:
    out = tmp_path / "bin"
    shutil.copytree(tiny_llama, out)
    (out / "model.safetensors").unlink()
    with pytest.raises(TernaryFormatError, match="safetensors"):
        build_packed_model(out)


def test_a_causal_lm_ternary_task_refuses_train_head() -> None:
    # a seq_cls ternary task is accepted (tests/shared/model/ternary/test_classifier.py); a causal
    # LM has no classification head to train
    with pytest.raises(ValueError, match="train_head applies to seq_cls"):
        TaskSpec(model_path="x", model_kind="causal_lm", scope="ternary", format="ternary",
                 scope_options={"train_head": True})


# --- memory: a device's start-up stays far below the fp32 model ------------------------------

HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 768, 2048, 8, 512
#: fp32 bytes of the Linear matrices that become BitLinear (q, k, v, o, gate, up, down).
LINEAR_BYTES = 4 * LAYERS * (4 * HIDDEN * HIDDEN + 3 * HIDDEN * INTERMEDIATE)

_CHILD = textwrap.dedent("""
    import json, resource, sys
    from pathlib import Path
    import torch
    from seedfed.client.ternary import PackedTernary
    from seedfed.shared.model.factory import build_model
    from seedfed.shared.protocol.task import TaskSpec
    from seedfed.shared.model.ternary import bitlinear_modules

    def status(key):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
        raise KeyError(key)

    def start(spec, mode):
        if mode == "packed":
            return PackedTernary(spec)
        model = build_model(spec, initialize=False).model  # the path devices took before
        for _, m in bitlinear_modules(model):
            m.to_packed(keep_latents=False)
        return model

    torch.set_num_threads(1)
    spec = TaskSpec.from_dict(json.loads(sys.argv[1]))
    snapshot, check, warm, mode = Path(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    # The same start on a tiny model first: every import and one-time allocation happens
    # there, so what follows measures the model's data only.
    start(TaskSpec.from_dict({**spec.to_dict(), "model_path": warm}), mode)
    # Peak RSS from here on: reset the high-water mark where the kernel allows it.
    try:
        Path("/proc/self/clear_refs").write_text("5")
        reset = True
    except OSError:
        reset = False
    def peak():
        return status("VmHWM") if reset else resource.getrusage(
            resource.RUSAGE_SELF).ru_maxrss * 1024
    before, max_before = status("VmRSS"), peak()
    device = start(spec, mode)
    built = peak()
    if mode == "packed":
        device.load_snapshot(snapshot.read_bytes(), 0, check)
    print(json.dumps({"before": before, "max_before": max_before, "built": built,
                      "peak": peak(), "reset": reset}))
""")


def _startup(spec: TaskSpec, snapshot: Path, check: str, warm: Path, mode: str,
             ) -> dict[str, int]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(spec.to_dict()),
                          str(snapshot), check, str(warm), mode], capture_output=True,
                         text=True, env=env, timeout=180, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    got: dict[str, int] = json.loads(out.stdout.strip().splitlines()[-1])
    # Without a resettable high-water mark, growth counts from the peak so far.
    got["growth"] = got["peak"] - (got["before"] if got["reset"] else got["max_before"])
    return got


def _write_llama(path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.fleet_helpers import _char_tokenizer

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                      num_hidden_layers=LAYERS, num_attention_heads=12, num_key_value_heads=12,
                      max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)  # HF's own init: the values do not matter here
    model.save_pretrained(path)
    _char_tokenizer().save_pretrained(path)
    return path


def test_startup_memory_stays_below_the_fp32_model(tiny_llama: Path, tmp_path: Path) -> None:
    spec = ternary_spec(_write_llama(tmp_path / "model"))
    spec = replace(spec, scope_options={"fraction": 0.01, "epoch_rounds": 2})
    data, check = _published(spec)
    snapshot = tmp_path / "snapshot.safetensors"
    snapshot.write_bytes(data)
    del data
    new = _startup(spec, snapshot, check, tiny_llama, "packed")
    old = _startup(spec, snapshot, check, tiny_llama, "fp32")
    mb = 1 / 2**20
    figures = (f"fp32 ternary matrices {LINEAR_BYTES * mb:.0f} MB, snapshot "
               f"{snapshot.stat().st_size * mb:.0f} MB; packed start: RSS before "
               f"{new['before'] * mb:.0f} MB, peak after build {new['built'] * mb:.0f} MB, after "
               f"snapshot {new['peak'] * mb:.0f} MB, growth {new['growth'] * mb:.0f} MB; old fp32 "
               f"path (build + pack, no snapshot): growth {old['growth'] * mb:.0f} MB; "
               f"peak reset={new['reset']}")
    print(figures)
    assert old["growth"] > LINEAR_BYTES, figures  # the measurement sees the fp32 model
    assert new["growth"] < 0.5 * LINEAR_BYTES, figures
