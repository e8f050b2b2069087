"""quantkit writes `quantization_config` as plain data; compressed-tensors' own pydantic models are the oracle."""

from __future__ import annotations

import copy

import pytest
from compressed_tensors.quantization import QuantizationConfig

from quantkit.formats.compressed_tensors import build_quantization_config
from quantkit.quant.schemes import SCHEMES, get_scheme


@pytest.mark.parametrize("name", sorted(SCHEMES))
@pytest.mark.parametrize("actorder", [None, "static", "group"])
def test_config_is_what_compressed_tensors_validates_and_dumps(name, actorder):
    ours = build_quantization_config(get_scheme(name, 64), ["lm_head"], actorder=actorder)
    theirs_input = copy.deepcopy(ours)
    if actorder == "group":
        # compressed-tensors >= 0.20 no longer accepts actorder=group; everything else must still match.
        del theirs_input["config_groups"]["group_0"]["weights"]["actorder"]
    dumped = QuantizationConfig.model_validate(theirs_input).model_dump(exclude_none=False)
    # The three keys quantkit adds beside the model's dump (transformers reads quant_method).
    expected = {k: v for k, v in ours.items() if k not in ("sparsity_config", "transform_config", "version")}
    if actorder == "group":
        expected = copy.deepcopy(expected)
        del expected["config_groups"]["group_0"]["weights"]["actorder"]
    assert dumped == expected


def test_override_groups_validate_and_target_modules_by_name():
    names = ["model.layers.1.mlp.up_proj", "model.layers.0.self_attn.q_proj"]
    ours = build_quantization_config(get_scheme("FP8_BLOCK"), ["lm_head"], overrides={"FP8_DYNAMIC": names})
    dumped = QuantizationConfig.model_validate(ours).model_dump(exclude_none=False)
    assert dumped["config_groups"] == ours["config_groups"]
    assert ours["config_groups"]["group_1"]["targets"] == sorted(names)
    assert ours["config_groups"]["group_1"]["weights"]["strategy"] == "channel"
    assert ours["format"] == "float-quantized"


def test_version_is_the_installed_compressed_tensors():
    import compressed_tensors

    assert build_quantization_config(get_scheme("W4A16"), [])["version"] == compressed_tensors.__version__
