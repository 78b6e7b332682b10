"""The packed linear maps (src/aiayn/speed/packed.py) compute the model's linear maps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from aiayn.speed.packed import PackedWeights, step_linear


@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_step_linear_computes_the_linear_map_for_any_number_of_rows(rows, relu, with_bias):
    torch.manual_seed(rows)
    weight, bias = torch.randn(48, 32), torch.randn(48) if with_bias else None
    project = step_linear(weight, bias, relu=relu)  # packed for 256 rows, used with others
    x = torch.randn(rows, 1, 32)
    expected = F.linear(x, weight, bias)
    with torch.inference_mode():
        result = project(x)
    torch.testing.assert_close(result, expected.relu() if relu else expected, rtol=1e-5, atol=1e-5)


def test_packed_weights_are_reused_until_a_weight_changes_in_place():
    layer = torch.nn.Linear(32, 48)
    packed = PackedWeights()
    x = torch.randn(5, 1, 32)
    with torch.inference_mode():
        first = packed.linear("layer", [layer])(x)
    stored = dict(packed._packed)
    with torch.inference_mode():
        packed.linear("layer", [layer])
    assert all(packed._packed[name][1] is stored[name][1] for name in stored)  # not repacked
    with torch.no_grad():
        layer.weight.mul_(2.0)  # an in-place update, as an optimizer step or load_state_dict makes
    with torch.inference_mode():
        second = packed.linear("layer", [layer])(x)
    torch.testing.assert_close(first, F.linear(x, layer.weight / 2.0, layer.bias), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(second, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
