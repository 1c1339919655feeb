"""The reference model's weight count (what `--engine reference` checks before building) is the
count of the weights it then allocates, for every layer kind; refusals come before any pool."""

from __future__ import annotations

import pytest

from kvstrata.build import ModelMemorySpec
from kvstrata.replay import ReferenceModelTooLarge, ReplayOptionError
from kvstrata.replay.reference_engine import (
    ReferenceDims,
    ReferenceModel,
    check_reference_model,
    reference_parameters,
)
from kvstrata.testkit.hf_configs import NEMOTRON_H_8B
from kvstrata.testkit.tiny_models import TINY_MODELS, tiny_system


@pytest.mark.parametrize("kind", sorted(TINY_MODELS))
def test_the_parameter_count_is_the_allocated_weights(kind: str) -> None:
    config = TINY_MODELS[kind]
    system = tiny_system(kind, kv_tokens=64, context_len=32)
    model = ReferenceModel(config, system, seed=1)
    allocated = model.embed.numel() + sum(t.numel() for w in model.weights for t in w.values())
    assert reference_parameters(config, ModelMemorySpec.from_hf_config(config)) == allocated


def test_too_large_and_unusable_configs_are_refused() -> None:
    config = TINY_MODELS["mha"]
    spec = ModelMemorySpec.from_hf_config(config)
    count = reference_parameters(config, spec)
    assert check_reference_model(config, spec, max_parameters=count).parameters == count
    with pytest.raises(ReferenceModelTooLarge) as caught:
        check_reference_model(config, spec, max_parameters=count - 1)
    assert (caught.value.parameters, caught.value.limit) == (count, count - 1)
    bad_heads = {**config, "num_attention_heads": 3, "head_dim": 8}  # 3 over 2 KV heads
    with pytest.raises(ReplayOptionError, match="not a multiple"):
        check_reference_model(bad_heads, ModelMemorySpec.from_hf_config(bad_heads))


def test_cache_free_layers_only_have_their_mlp() -> None:
    # Nemotron-H has MLP-only layers ("none"); its Mamba-2 layers get [heads, head_dim, state].
    config = {**NEMOTRON_H_8B, "vocab_size": 10}
    dims = ReferenceDims.of(config, ModelMemorySpec.from_hf_config(config))
    assert "none" in dims.kinds
    d = 4096
    assert dims.layer_shapes("none") == {"mlp_in": (d, 2 * d), "mlp_out": (2 * d, d)}
    assert dims.state is not None and dims.state[2:] == (128, 64, 128)
    assert dims.layer_shapes("mamba")["a"] == (128, 1, 128)
