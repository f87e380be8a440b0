"""The drafter's layout is checked in one place (trainer.run.layout.checked_layout); DrafterConfig holds
what it returns and refuses what it refuses, with the same words."""

from __future__ import annotations

import pytest

from trainer.models.drafter import DrafterConfig
from trainer.run.layout import FULL, SLIDING, Layout, LayoutError, checked_layout


def _config(**layout) -> DrafterConfig:
    return DrafterConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, vocab_size=64, block_size=4, mask_token_id=63,
                         target_layer_ids=[0, 1], num_target_layers=4, **layout)


def test_a_layout_without_sliding_or_causal_layers_is_the_default_one():
    assert checked_layout([FULL] * 3, 8, [False] * 3, False, 3) == Layout(None, None, None, False)
    assert _config(layer_types=[FULL] * 3, sliding_window=8, causal=[False] * 3).layout == Layout(None, None, None)


def test_a_served_layout_is_kept_and_read_by_the_config():
    layout = checked_layout([SLIDING, SLIDING, FULL], 5, [True, True, False], True, 3)
    assert layout == Layout([SLIDING, SLIDING, FULL], 5, [True, True, False], True)
    config = _config(layer_types=[SLIDING, SLIDING, FULL], sliding_window=5, causal=[True, True, False],
                     attention_sink=True)
    assert config.layout == layout and config.kinds() == [(5, True), (5, True), (None, False)]


@pytest.mark.parametrize("layout, message", [
    (dict(layer_types=[FULL, SLIDING]), "must list 3 of"),
    (dict(layer_types=[SLIDING, FULL, FULL]), "sliding layers need a positive sliding_window, got None"),
    (dict(causal=[True, False]), r"causal \[True, False\] must list 3 layers"),
    (dict(causal=[True, False, True]), "neither every layer alike nor causal exactly on the sliding layers"),
])
def test_what_the_check_refuses_the_config_refuses_in_the_same_words(layout, message):
    args = {"layer_types": None, "sliding_window": None, "causal": None, **layout}
    with pytest.raises(LayoutError, match=message):
        checked_layout(args["layer_types"], args["sliding_window"], args["causal"], False, 3)
    with pytest.raises(ValueError, match=message):
        _config(**layout)
