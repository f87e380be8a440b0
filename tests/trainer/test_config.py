import pytest

from trainer.train.config import ConfigError, parse_config

GOOD = """
model:
  target:
    tiny: {layers: 2}
data:
  synthetic: {n_train: 10}
"""


def test_good_config_and_defaults():
    cfg = parse_config(GOOD)
    assert cfg.model.target.tiny.layers == 2 and cfg.optim.lr == 6e-4 and cfg.model.block_size == 16


@pytest.mark.parametrize("text, expected", [
    (GOOD + "optim:\n  learning_rate: 1\n", "<config>:8: unknown key 'optim.learning_rate'"),
    (GOOD + "optim:\n  totl_steps: 3\n", "did you mean 'total_steps'"),
    (GOOD + "optim:\n  lr: fast\n", "<config>:8: optim.lr must be float, got 'fast'"),
    (GOOD.replace("model:", "model:\n  attention: magic"), "<config>:3: model.attention must be one of 'auto', 'flex', 'sdpa', got 'magic'"),
    (GOOD + "pipeline:\n  kind: threads\n", "<config>:8: pipeline.kind must be one of 'reference', 'threaded', got 'threads'"),
    (GOOD + "model: {}\n", "<config>:7: duplicate key 'model'"),
    ("model:\n  target: {}\ndata:\n  synthetic: {}\n", "needs exactly one of path, tiny, random_8b_shape"),
    ("model:\n  target: {tiny: {}}\n", "data needs train_path or synthetic"),
    ("model: [1, 2\n", "<config>:"),
    (GOOD + "devices:\n  target: [tpu]\n", "has unknown device 'tpu'"),
])
def test_bad_configs_name_the_problem(text, expected):
    with pytest.raises(ConfigError) as exc:
        parse_config(text)
    assert expected in str(exc.value)


def test_every_bundled_preset_loads():
    from pathlib import Path

    from trainer.train.config import load_config

    presets = sorted((Path(__file__).resolve().parents[2] / "trainer" / "configs").glob("*.yaml"))
    assert len(presets) >= 4
    for path in presets:
        cfg = load_config(path)
        assert cfg.optim.total_steps > 0, path
