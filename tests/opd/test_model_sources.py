"""Model deltas (``write_delta``/``apply_delta``) on tiny saved models, and named sources in
the CLI checks; the real source itself is tests/opd/test_real_model.py."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_qwen2

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from lookahead_opd.integrations import model_sources  # noqa: E402
from lookahead_opd.integrations.cli_support import check_model_ref  # noqa: E402
from lookahead_opd.integrations.deltas import apply_delta, write_delta  # noqa: E402


def _saved(path, seed=0, bump_layer=None):
    model = tiny_qwen2(97, seed)
    if bump_layer is not None:
        with torch.no_grad():
            for p in model.model.layers[bump_layer].parameters():
                p.add_(0.1)
    model.save_pretrained(path)
    return model


def test_a_delta_holds_only_the_changed_blocks_and_rebuilds_the_model(tmp_path):
    from transformers import AutoModelForCausalLM

    _saved(tmp_path / "base")
    trained = _saved(tmp_path / "trained", bump_layer=1)
    names = write_delta(tmp_path / "trained", tmp_path / "base", tmp_path / "d.safetensors")
    assert names and all(n.startswith("model.layers.1.") for n in names)
    out = apply_delta(tmp_path / "base", tmp_path / "d.safetensors", tmp_path / "rebuilt")
    rebuilt = AutoModelForCausalLM.from_pretrained(out)
    for (k, a), (_, b) in zip(trained.state_dict().items(), rebuilt.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    _saved(tmp_path / "other", seed=1)
    with pytest.raises(ValueError, match="was made from weights"):
        apply_delta(tmp_path / "other", tmp_path / "d.safetensors", tmp_path / "bad")


def test_named_sources_in_the_model_checks(tmp_path, monkeypatch):
    monkeypatch.setattr(model_sources.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"smollm2-135m-gguf.*'real' extra"):
        check_model_ref("student", "smollm2-135m-gguf")
    with pytest.raises(ValueError, match="named sources smollm2-135m-gguf"):
        check_model_ref("student", "")
    monkeypatch.chdir(tmp_path)  # a local folder of that name is a folder, not the source
    _saved(tmp_path / "smollm2-135m-gguf")
    check_model_ref("student", "smollm2-135m-gguf")
    assert model_sources.resolve_model("smollm2-135m-gguf") == "smollm2-135m-gguf"


def test_a_lora_delta_is_two_factors_per_weight_and_rebuilds_the_adapted_model(tmp_path):
    pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from lookahead_opd.integrations.deltas import write_lora_delta
    from lookahead_opd.integrations.opd.lora import add_lora

    base = _saved(tmp_path / "base")
    ids = torch.randint(97, (2, 9), generator=torch.Generator().manual_seed(0))
    before = base(ids).logits
    names = add_lora(base, rank=2)
    assert torch.equal(base(ids).logits, before)  # B = 0: the adapter starts as a no-op
    assert len(names) == 2 * 7  # q, k, v, o, gate, up, down in each of the 2 blocks
    assert {n for n, p in base.named_parameters() if p.requires_grad} == {
        n for n, _ in base.named_parameters() if ".lora_" in n}
    with torch.no_grad():
        for n, p in base.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.05)
    adapted = base(ids).logits
    assert not torch.allclose(adapted, before)
    saved = write_lora_delta(base, tmp_path / "base", tmp_path / "lora.safetensors")
    assert saved == sorted(names)
    out = apply_delta(tmp_path / "base", tmp_path / "lora.safetensors", tmp_path / "rebuilt")
    rebuilt = AutoModelForCausalLM.from_pretrained(out)
    torch.testing.assert_close(rebuilt(ids).logits, adapted, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="no LoRA adapters"):
        write_lora_delta(rebuilt, tmp_path / "base", tmp_path / "none.safetensors")
