import pytest

from trainer.run.config import ConfigError, parse_config

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
    (GOOD + "distributed:\n  backend: mpi\n", "<config>:8: distributed.backend must be one of 'auto', 'nccl', 'gloo', got 'mpi'"),
    (GOOD + "model: {}\n", "<config>:7: duplicate key 'model'"),
    ("model:\n  target: {}\ndata:\n  synthetic: {}\n", "needs exactly one of path, tiny, random_8b_shape"),
    ("model:\n  target: {tiny: {}}\n", "data needs train_path or synthetic"),
    ("model: [1, 2\n", "<config>:"),
    (GOOD + "devices:\n  target: [tpu]\n", "has unknown device 'tpu'"),
    (GOOD.replace("data:", "data:\n  workers: 0"), "<config>:6: data.workers must be auto or at least 1"),
    (GOOD.replace("data:", "data:\n  workers: all"), "data.workers must be int or one of 'auto', got 'all'"),
    (GOOD + "eval:\n  batch: 0\n", "<config>:8: eval.batch must be at least 1"),
    # an engine collects the tapped layers in layer order, each once: another order or a repeat is refused
    (GOOD.replace("model:", "model:\n  num_target_layers: 2\n  target_layer_ids: [1, 0]"),
     "<config>:4: model.target_layer_ids [1, 0] must be increasing, each layer once"),
    (GOOD.replace("model:", "model:\n  num_target_layers: 2\n  target_layer_ids: [1, 1]"),
     "model.target_layer_ids [1, 1] must be increasing"),
])
def test_bad_configs_name_the_problem(text, expected):
    with pytest.raises(ConfigError) as exc:
        parse_config(text)
    assert expected in str(exc.value)


def test_every_bundled_preset_loads():
    from pathlib import Path

    from trainer.run.config import load_config

    presets = sorted((Path(__file__).resolve().parents[2] / "trainer" / "configs").glob("*.yaml"))
    assert len(presets) >= 4
    for path in presets:
        cfg = load_config(path)
        assert cfg.optim.total_steps > 0, path


@pytest.mark.parametrize("written, packed, devices, expected", [
    ("", True, ["cuda:0"], True),  # auto: CUDA and one (packed) shape
    ("", False, ["cuda:0"], False),  # auto: bucketed lengths, several shapes
    ("", True, ["cpu"], False),  # auto: never on the CPU
    ("", True, ["cuda:0", "cpu"], False),
    ("false", True, ["cuda:0"], False),
    ("true", False, ["cuda:0"], True),
    ("true", True, ["cpu"], False),
])
def test_compile_target_auto_means_cuda_and_one_shape(written, packed, devices, expected):
    import torch

    from trainer.pipeline.threaded import compiles_target

    text = GOOD.replace("model:", "model:\n  compile_target: " + written) if written else GOOD
    cfg = parse_config(text)
    cfg.data.pack_length = 256 if packed else 0
    assert cfg.model.compile_target == (written == "true" if written else "auto")
    assert compiles_target(cfg, [torch.device(d) for d in devices]) is expected


def test_compile_target_takes_only_a_bool_or_auto():
    with pytest.raises(ConfigError, match="model.compile_target must be"):
        parse_config(GOOD.replace("model:", "model:\n  compile_target: always"))
