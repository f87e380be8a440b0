"""An export stands alone (issue 48): its model code imports only torch, transformers, the standard
library and the files written beside it, so `AutoModel.from_pretrained(dir, trust_remote_code=True)`
loads it in a python where neither `trainer` nor `dflash_ops` can be imported, and it drafts what the
trained drafter drafts. Marked deps_floor: .ci/run runs it again under each transformers floor
(.ci/deps-venv), where the export is written and loaded by that venv's transformers."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer.models.drafter import DFlashDrafter, DrafterConfig, propose
from trainer.models.export import MODEL_CODE_PACKAGES, ModelCodeError, export_checkpoint, model_code
from trainer.run import checkpoint as ckpt
from trainer.run.layout import FULL, SLIDING, Layout

VOCAB, MASK_ID, HIDDEN = 97, 96, 32
SHAPE = dict(hidden_size=HIDDEN, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             vocab_size=VOCAB, block_size=4, mask_token_id=MASK_ID, target_layer_ids=[1, 2], num_target_layers=4)
DRAFTERS = {
    # the 2026 layout: sliding causal layers beside a full one, attention sinks, its own mask embedding
    "dflash": dict(num_hidden_layers=3, layout=Layout([SLIDING, SLIDING, FULL], 4, [True, True, False], True),
                   mask_embedding=True),
    "dflash2": dict(num_hidden_layers=2, kind="dflash2", conv_kernel_size=3, conv_group_size=8, selector_rank=4,
                    selector_top_k=3, input_embedding_scale=1.5, final_logit_softcapping=30.0),
}
BLOCKED = ("trainer", "trainer_tools", "dflash_ops", "tests")
REPO = Path(__file__).resolve().parents[2]

# Run with `python -I` (no PYTHONPATH, no user site, not the script's directory) from an empty cwd; the
# editable install of this repository in the venv is refused by a finder in front of sys.meta_path.
LOADER = f"""
import sys
BLOCKED = {BLOCKED!r}

class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError("No module named %r" % name, name=name)
        return None

sys.meta_path.insert(0, Blocked())
try:
    import trainer
    blocked = False
except ModuleNotFoundError:
    blocked = True
import torch
from transformers import AutoModel

inputs, out, *exports = sys.argv[1:]
x = torch.load(inputs, weights_only=True)
results = {{}}
for export in exports:
    model = AutoModel.from_pretrained(export, trust_remote_code=True, dtype=torch.float32)
    with torch.no_grad():
        block = model.embed_block(lambda ids: x["embed"][ids], x["ids"])
        hidden = model(x["ctx"], block, x["start"])
        draft = model.propose(hidden[:, 1:], lambda h: h @ x["head"].T, x["ids"][:, 0])
    results[export] = {{"hidden": hidden, "draft": draft, "class": type(model).__name__}}
torch.save({{"exports": results, "blocked": blocked,
            "loaded": sorted({{m.partition(".")[0] for m in sys.modules}} & set(BLOCKED))}}, out)
"""


def trained_like(kind: str) -> DFlashDrafter:
    """A drafter of that kind with every weight random (sinks, mask embedding, convolutions, selector)."""
    torch.manual_seed(3)
    drafter = DFlashDrafter(DrafterConfig(**SHAPE, **DRAFTERS[kind]))
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0.0, 0.2)
    return drafter


def export(drafter: DFlashDrafter, root: Path, kind: str) -> Path:
    opt = torch.optim.AdamW(drafter.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    path, _ = ckpt.CheckpointManager(root / f"run-{kind}", 2).save(3, drafter.state_dict(), drafter.config.to_dict(),
                                                                   {"optimizer": opt.state_dict(),
                                                                    "scheduler": sched.state_dict()}, {})
    return export_checkpoint(path, root / kind, dtype=torch.float32)


@pytest.mark.deps_floor
def test_an_export_loads_and_drafts_where_this_repository_cannot_be_imported(tmp_path):
    """An export of each kind, loaded by one python (its own directory name: its own remote-code module)."""
    drafters = {kind: trained_like(kind) for kind in sorted(DRAFTERS)}
    outs = {kind: export(drafter, tmp_path, kind) for kind, drafter in drafters.items()}
    torch.manual_seed(4)
    start = 6
    x = {"ctx": torch.randn(2, start, 2 * HIDDEN), "embed": torch.randn(VOCAB, HIDDEN),
         "head": torch.randn(VOCAB, HIDDEN), "ids": torch.tensor([[11] + [MASK_ID] * 3, [40] + [MASK_ID] * 3]),
         "start": start}
    torch.save(x, tmp_path / "inputs.pt")
    (tmp_path / "loader.py").write_text(LOADER)
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_MODULES_CACHE=str(tmp_path / "hf-modules"), HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-I", str(tmp_path / "loader.py"), str(tmp_path / "inputs.pt"),
                           str(tmp_path / "out.pt"), *map(str, outs.values())], capture_output=True, text=True, cwd=cwd,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = torch.load(tmp_path / "out.pt", weights_only=True)
    assert theirs["blocked"] and theirs["loaded"] == []
    for kind, drafter in drafters.items():
        loaded = theirs["exports"][str(outs[kind])]
        assert loaded["class"] == "DFlashDraftModel", kind
        with torch.no_grad():
            block = drafter.embed_block(lambda ids: x["embed"][ids], x["ids"])
            hidden = drafter.draft_block(x["ctx"], block, start)
            draft = propose(drafter, lambda h: h @ x["head"].T, hidden[:, 1:], x["ids"][:, 0])
        assert torch.allclose(loaded["hidden"], hidden, atol=1e-5), kind
        assert torch.equal(loaded["draft"], draft), kind


def imports_of(source: str) -> tuple[set[str], set[str]]:
    """(top-level packages imported absolutely, modules imported relatively) of a file's source."""
    absolute, relative = set(), set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            absolute.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            (relative if node.level else absolute).add(node.module.split(".")[0] if not node.level else node.module)
    return absolute, relative


def test_the_model_code_is_the_trainers_own_with_relative_imports_of_each_other():
    code = model_code()
    assert {"modeling_dflash.py", "drafter.py", "dflash2.py", "layout.py"} <= set(code)
    for name, source in code.items():
        absolute, relative = imports_of(source)
        assert {p for p in absolute if p not in sys.stdlib_module_names} <= set(MODEL_CODE_PACKAGES), name
        assert {f"{m}.py" for m in relative} <= set(code), name
    sources = {"modeling_dflash.py": "trainer/models/hf_modeling.py", "drafter.py": "trainer/models/drafter.py",
               "dflash2.py": "trainer/models/dflash2.py", "layout.py": "trainer/run/layout.py"}
    for name, source in sources.items():  # the trainer's files: only where they import each other differs
        assert without_own_imports(code[name]) == without_own_imports((REPO / source).read_text()), name


def without_own_imports(source: str) -> str:
    """The source's syntax tree with the module of each relative or trainer import left out."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("trainer.")):
            node.module, node.level = None, 0
    return ast.dump(tree)


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_a_module_the_model_code_reaches_is_copied_and_one_it_may_not_import_is_refused(tmp_path):
    write(tmp_path, {"pkg/__init__.py": "", "pkg/models/__init__.py": "", "pkg/run/__init__.py": "",
                     "pkg/models/entry.py": "import torch\nfrom pkg.models.parts import (\n    a,\n    b,\n)  # why\n"
                                            "\n\ndef f():\n    from ..run.lower import c  # lazy, relative\n",
                     "pkg/models/parts.py": "import json\n\nfrom pkg.run.lower import c\na = b = c\n",
                     "pkg/run/lower.py": "c = 'τ'\n"})
    code = model_code("pkg.models.entry", "modeling", root=tmp_path)
    assert sorted(code) == ["lower.py", "modeling.py", "parts.py"]
    assert code["modeling.py"] == "import torch\nfrom .parts import a, b  # why\n\n\ndef f():\n" \
                                  "    from .lower import c  # lazy, relative\n"
    assert code["parts.py"] == "import json\n\nfrom .lower import c\na = b = c\n"
    assert code["lower.py"] == "c = 'τ'\n"

    write(tmp_path, {"pkg/models/entry.py": "from pkg.models.parts import a\n"})  # lower.py only through parts.py
    with pytest.raises(ModelCodeError, match=r"entry.py: the exported model code needs pkg.run.lower, which "
                                             r"pkg.models.entry does not import itself"):
        model_code("pkg.models.entry", "modeling", root=tmp_path)
    write(tmp_path, {"pkg/models/entry.py": "from pkg.models.parts import a\nfrom pkg.run.lower import c\n"})

    write(tmp_path, {"pkg/run/lower.py": "import numpy\nc = 1\n"})  # planted: a package the export lacks
    with pytest.raises(ModelCodeError, match=r"pkg/run/lower.py:1: the exported model code may import only the "
                                             r"standard library, torch, transformers .* not numpy"):
        model_code("pkg.models.entry", "modeling", root=tmp_path)
    write(tmp_path, {"pkg/run/lower.py": "import pkg.models.parts\nc = 1\n"})  # a form that cannot be relative
    with pytest.raises(ModelCodeError, match=r"lower.py:1: .* only as `from pkg.PACKAGE.MODULE import NAME` "
                                             r"\(here: pkg.models.parts\)"):
        model_code("pkg.models.entry", "modeling", root=tmp_path)
    write(tmp_path, {"pkg/run/lower.py": "c = 1\n", "pkg/run/parts.py": "", "pkg/models/parts.py":
                     "from pkg.run.parts import *\na = b = 1\n"})  # two modules, one file name
    with pytest.raises(ModelCodeError, match=r"would write two modules as parts.py"):
        model_code("pkg.models.entry", "modeling", root=tmp_path)
