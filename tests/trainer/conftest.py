import pytest
import torch

from trainer.models.drafter import DFlashDrafter, DrafterConfig
from trainer.models.target import FrozenHead, default_target_layer_ids, freeze, tiny_target
from trainer.run.config import TinyTargetConfig

VOCAB = 97
MASK_ID = 96


@pytest.fixture(scope="session")
def tiny():
    """A tiny random Qwen3 target, its frozen head and a 2-layer drafter (block size 8)."""
    torch.manual_seed(0)
    target = freeze(tiny_target(TinyTargetConfig(layers=4, hidden=32, heads=4, kv_heads=2, head_dim=8,
                                                 intermediate=64), VOCAB))
    layer_ids = default_target_layer_ids(4, 2)
    cfg = DrafterConfig.from_target(target.config, num_layers=2, block_size=8, mask_token_id=MASK_ID,
                                    target_layer_ids=layer_ids)
    torch.manual_seed(1)
    drafter = DFlashDrafter(cfg)
    return target, FrozenHead.from_target(target, "cpu"), drafter, layer_ids


@pytest.fixture(scope="module")
def components(tmp_path_factory):
    """A tiny run's components (a random target and drafter, synthetic held-out conversations)."""
    from tests.trainer.tiny_config import tiny_config
    from trainer.run.config import parse_config
    from trainer.train.components import build_components

    cfg = parse_config(tiny_config("data: {synthetic: {n_eval: 4}}"))
    return build_components(cfg, tmp_path_factory.mktemp("run"), lambda *_: None)


@pytest.fixture
def fx_trace_threads(monkeypatch):
    """Names of the threads that ran an FX trace (make_fx, AOTAutograd, eager flex with grad)."""
    import threading

    names = []
    original = torch.fx._symbolic_trace.Tracer.trace

    def recording_trace(self, *args, **kwargs):
        names.append(threading.current_thread().name)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.fx._symbolic_trace.Tracer, "trace", recording_trace)
    return names


@pytest.fixture(scope="session")
def qwen3_model_dir(tmp_path_factory):
    """A tiny Qwen3 target directory in the hub's format (trainer_tools.fixtures.hub_model)."""
    from trainer_tools.fixtures.hub_model import write_hub_model

    return write_hub_model(tmp_path_factory.mktemp("hub") / "Qwen3-tiny", "qwen3")


@pytest.fixture(scope="session")
def llama3_model_dir(tmp_path_factory):
    """A tiny Llama target directory with the Llama-3 chat template and no pad token."""
    from trainer_tools.fixtures.hub_model import write_hub_model

    return write_hub_model(tmp_path_factory.mktemp("hub") / "Llama3-tiny", "llama3")


class FamilyDirs(dict):
    """family -> its tiny fp32 hub-format model directory, written on first use (a test of one family
    does not build the others; under an older transformers a family it lacks cannot be built)."""

    def __init__(self, root):
        super().__init__()
        self.root = root

    def __missing__(self, family):
        from trainer_tools.fixtures.hub_model import write_hub_model

        self[family] = path = write_hub_model(self.root / family, family, dtype="float32")
        return path


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory):
    """A tiny fp32 hub-format model directory of every target family (trainer_tools.fixtures.hub_model.FAMILIES)."""
    return FamilyDirs(tmp_path_factory.mktemp("families"))


@pytest.fixture(scope="session")
def agent_fixture(request, tmp_path_factory):
    """The agent fixture (trainer_tools.fixtures.agent): model, files, traces. Its model is fitted
    once (about a minute of CPU) and kept in pytest's cache under the hash of the code that makes
    it, so a later session reuses it; a lock lets parallel workers build it once."""
    import fcntl
    import hashlib
    from pathlib import Path

    import trainer_tools.fixtures as fixtures
    from trainer_tools.fixtures.agent import write_agent_fixture

    sources = sorted(Path(fixtures.__file__).parent.glob("*.py"))
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sources)).hexdigest()[:16]
    cache = Path(request.config.cache.mkdir(f"agent-fixture-{digest}"))
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        paths = write_agent_fixture(cache)
    out = tmp_path_factory.mktemp("agent")  # traces and files a test may not change in the shared cache
    import shutil

    return {"model": paths["model"], "files": Path(shutil.copytree(paths["files"], out / "files")),
            "traces": Path(shutil.copy(paths["traces"], out / "traces.jsonl"))}
