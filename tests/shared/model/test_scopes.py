import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from seedfed.shared.model.scopes import Scope, ScopedTensor, build_scope, scope_kinds
from seedfed.shared.protocol.errors import MissingTensorError, ScopeError, UnknownScopeError

from tests.shared.conftest import tiny_llama


def test_full_scope_lists_each_tied_tensor_once_in_name_order(llama):
    scope = build_scope("full", llama)
    names = scope.names
    assert names == sorted(names)
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert scope.numel == sum(p.numel() for p in llama.parameters())


def test_lora_scope_lists_only_adapters(llama):
    model = get_peft_model(llama, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    scope = build_scope("lora", model)
    assert scope.names and all("lora_" in n for n in scope.names)


def test_lora_scope_without_adapters_explains(llama):
    with pytest.raises(ScopeError, match="no LoRA adapters"):
        build_scope("lora", llama)


def test_unknown_scope_lists_known_ones(llama):
    with pytest.raises(UnknownScopeError, match="known scopes: .*full"):
        build_scope("everything", llama)
    assert {"full", "lora", "named"} <= set(scope_kinds())


def test_named_scope_selects_by_substring(llama):
    scope = build_scope("named", llama, patterns=("norm",))
    assert scope.names and all("norm" in n for n in scope.names)


def test_write_checks_all_tensors_before_touching_any(llama):
    scope = build_scope("full", llama)
    state = scope.read()
    first = scope.names[0]
    state[first] = state[first] + 1.0
    del state[scope.names[-1]]
    with pytest.raises(MissingTensorError, match="missing"):
        scope.write(state)
    assert torch.equal(scope.read()[first], build_scope("full", tiny_llama()).read()[first])


def test_write_refuses_wrong_element_count(llama):
    scope = build_scope("full", llama)
    state = scope.read()
    state[scope.names[0]] = torch.zeros(3)
    with pytest.raises(MissingTensorError, match="elements"):
        scope.write(state)


def test_masked_tensor_reads_and_writes_only_its_elements():
    t = torch.arange(10, dtype=torch.float32)
    st = ScopedTensor("w", t, torch.tensor([1, 5]))
    assert st.values().tolist() == [1.0, 5.0] and st.numel == 2
    st.assign(torch.tensor([-1.0, -5.0]))
    assert t.tolist() == [0, -1, 2, 3, 4, -5, 6, 7, 8, 9]


def test_scope_refuses_non_float32(llama):
    with pytest.raises(ScopeError, match="float32"):
        Scope(llama, [ScopedTensor("w", torch.zeros(2, dtype=torch.float16))])



def test_plugin_scopes_register_on_first_use():
    # A fresh interpreter: nothing has imported shared/ternary yet, build_scope must do it.
    code = (
        "from seedfed.shared.model import scopes\n"
        "from tests.shared.conftest import tiny_llama\n"
        "assert 'ternary' not in scopes._REGISTRY\n"
        "s = scopes.build_scope('ternary', tiny_llama())\n"
        "print(s.kind, s.numel > 0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).parents[3], timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["ternary", "True"]
