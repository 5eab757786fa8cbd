"""Checkpoint folders: both config formats, sharded weights, and clear errors for what does not fit."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import ModelConfig
from engine.config import ConfigError
from weights.checkpoint import CheckpointError, load_checkpoint


def copy_of(src, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))


def test_transformers_4_and_5_rope_formats_read_the_same():
    base = dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                num_attention_heads=2, max_position_embeddings=64)
    v4 = ModelConfig.from_hf(base | {"rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}})
    v5 = ModelConfig.from_hf(base | {"rope_parameters": {
        "rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}})
    assert v4 == v5 and v4.rope_theta == 500000.0 and v4.rope_scaling.rope_type == "llama3"
    assert v4.num_kv_heads == 2  # num_key_value_heads absent = MHA
    with pytest.raises(ConfigError, match="'yarn' is not supported"):
        ModelConfig.from_hf(base | {"rope_scaling": {"type": "yarn", "factor": 2.0}})
    with pytest.raises(ConfigError, match="missing key 'intermediate_size'"):
        ModelConfig.from_hf({k: v for k, v in base.items() if k != "intermediate_size"})
    with pytest.raises(ConfigError, match="multiple of"):
        ModelConfig.from_hf(base | {"num_attention_heads": 2, "num_key_value_heads": 3, "head_dim": 4})


def test_legacy_config_loads_the_same_model(tiny_dir, tmp_path, make_engine):
    legacy = copy_of(tiny_dir, tmp_path)
    config = json.loads((legacy / "config.json").read_text())
    theta = config.pop("rope_parameters")["rope_theta"]
    edit_config(legacy, rope_parameters=None, rope_theta=theta)
    torch.testing.assert_close(make_engine(legacy).prompt_logits([5, 6, 7]), make_engine().prompt_logits([5, 6, 7]))


def test_sharded_checkpoint_loads(tiny_dir, tmp_path, make_engine):
    sharded = copy_of(tiny_dir, tmp_path)
    tensors = load_file(sharded / "model.safetensors")
    (sharded / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, sharded / file, metadata={"format": "pt"})
    weight_map = {n: f for f, part in halves.items() for n in part}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    torch.testing.assert_close(make_engine(sharded).prompt_logits([5, 6, 7]), make_engine().prompt_logits([5, 6, 7]))


def with_tensors(tiny_dir, tmp_path, edit):
    """A copy of the tiny checkpoint whose tensors `edit` changed in place."""
    broken = copy_of(tiny_dir, tmp_path)
    tensors = load_file(broken / "model.safetensors")
    edit(tensors)
    save_file(tensors, broken / "model.safetensors")
    return broken


def test_missing_tensor_is_named(tiny_dir, tmp_path):
    broken = with_tensors(tiny_dir, tmp_path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.1\.mlp\.up_proj\.weight"):
        load_checkpoint(broken)


def test_wrong_shape_is_named(tiny_dir, tmp_path):
    broken = with_tensors(tiny_dir, tmp_path, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(3, 64)}))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight has shape \(3, 64\), config needs \(16, 64\)"):
        load_checkpoint(broken)


def test_unexpected_tensor_is_named(tiny_dir, tmp_path):
    broken = with_tensors(tiny_dir, tmp_path, lambda t: t.update({"model.layers.0.self_attn.q_norm.weight": torch.zeros(8)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor model\.layers\.0\.self_attn\.q_norm\.weight"):
        load_checkpoint(broken)


def test_unknown_architecture_is_refused(tiny_dir, tmp_path):
    broken = copy_of(tiny_dir, tmp_path)
    edit_config(broken, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(CheckpointError, match="model_type 'gpt2' is not supported"):
        load_checkpoint(broken)


def test_pickle_only_checkpoint_is_refused_without_unpickling(tiny_dir, tmp_path):
    broken = copy_of(tiny_dir, tmp_path)
    (broken / "model.safetensors").unlink()
    (broken / "pytorch_model.bin").write_bytes(b"not even a pickle: it must never be opened")
    with pytest.raises(CheckpointError, match="pytorch_model.bin.*never unpickles.*safetensors"):
        load_checkpoint(broken)


def test_missing_config_is_named(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load_checkpoint(tmp_path)
