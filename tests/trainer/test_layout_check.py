"""The drafter's layout is checked in one place (trainer.run.layout.checked_layout); DrafterConfig holds
what it returns as one Layout value and refuses what it refuses, with the same words."""

from __future__ import annotations

import pytest

from trainer.models.drafter import DrafterConfig
from trainer.run.layout import FULL, SLIDING, Layout, LayoutError, checked_layout


def _config(**layout) -> DrafterConfig:
    return DrafterConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, vocab_size=64, block_size=4, mask_token_id=63,
                         target_layer_ids=[0, 1], num_target_layers=4, layout=Layout(**layout))


def test_a_layout_without_sliding_or_causal_layers_is_the_default_one():
    assert checked_layout(Layout([FULL] * 3, 8, [False] * 3, False), 3) == Layout()
    assert _config(layer_types=[FULL] * 3, sliding_window=8, causal=[False] * 3).layout == Layout()


def test_a_served_layout_is_kept_and_read_by_the_config():
    layout = checked_layout(Layout([SLIDING, SLIDING, FULL], 5, [True, True, False], True), 3)
    assert layout == Layout([SLIDING, SLIDING, FULL], 5, [True, True, False], True)
    config = _config(layer_types=[SLIDING, SLIDING, FULL], sliding_window=5, causal=[True, True, False],
                     attention_sink=True)
    assert config.layout == layout and config.layout.kinds(3) == [(5, True), (5, True), (None, False)]


def test_a_checkpoint_holds_the_layout_under_its_flat_names_and_reads_it_back():
    config = _config(layer_types=[SLIDING, SLIDING, FULL], sliding_window=5, attention_sink=True)
    saved = config.to_dict()
    assert "layout" not in saved and (saved["layer_types"], saved["sliding_window"], saved["attention_sink"]) == (
        [SLIDING, SLIDING, FULL], 5, True)
    assert DrafterConfig.from_dict(saved) == config
    older = {k: v for k, v in saved.items() if k not in ("layer_types", "sliding_window", "causal", "attention_sink")}
    assert DrafterConfig.from_dict(older).layout == Layout()  # a checkpoint from before layouts: the 2025 one


@pytest.mark.parametrize("layout, field, message", [
    (dict(layer_types=[FULL, SLIDING]), "layer_types", "must list 3 of"),
    (dict(layer_types=[SLIDING, FULL, FULL]), "sliding_window", "sliding layers need a positive sliding_window, got None"),
    (dict(causal=[True, False]), "causal", r"causal \[True, False\] must list 3 layers"),
    (dict(causal=[True, False, True]), "causal", "neither every layer alike nor causal exactly on the sliding layers"),
])
def test_what_the_check_refuses_the_config_refuses_in_the_same_words(layout, field, message):
    with pytest.raises(LayoutError, match=message) as e:
        checked_layout(Layout(**layout), 3)
    assert e.value.field == field
    with pytest.raises(ValueError, match=message):
        _config(**layout)
