"""The patch guard on the field's broken patch, its fix, and the other ways a patch goes wrong."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_ops.patching import DiffError, apply_hunks, check_patch, definitions, parse_unified_diff
from dflash_ops.patching import diff as diff_module

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "patches"
RELEASE = FIXTURES / "release"
IMPORT_CHECK = Path(__file__).resolve().parents[2] / "dflash_ops" / "helpers" / "import_check.py"
DATA = "trainer/data.py"


def fixture_diff(name: str) -> str:
    return (FIXTURES / name).read_text()


@pytest.fixture
def release(tmp_path):
    root = tmp_path / "release"
    shutil.copytree(RELEASE, root)
    return root


def test_field_patch_that_swallows_methods_is_refused(release):
    before = (release / DATA).read_text()
    broken = fixture_diff("broken_warmup_inside_class.diff")
    compile(apply_hunks(before, parse_unified_diff(broken)[0].hunks), DATA, "exec")  # Python says nothing

    report = check_patch(release, broken)
    assert not report.ok
    messages = [str(p) for p in report.problems]
    assert any("BatchPrefetcher.stop (was line 41) → select_target_warmup_shapes.stop" in m for m in messages)
    assert any("BatchPrefetcher.__iter__ (was line 34) → select_target_warmup_shapes.__iter__" in m for m in messages)
    unreachable = {p.message.split()[1] for p in report.problems if p.kind == "unreachable"}
    assert unreachable == {"select_target_warmup_shapes.__iter__", "select_target_warmup_shapes.stop"}
    stop_line = next(p.line for p in report.problems if "→ select_target_warmup_shapes.stop" in p.message)
    assert report.new_contents[DATA].splitlines()[stop_line - 1] == "    def stop(self):"
    assert (release / DATA).read_text() == before  # the release is never written


def test_field_patch_in_its_corrected_form_is_accepted(release, tmp_path):
    report = check_patch(release, fixture_diff("fixed_warmup_at_module_level.diff"))
    assert report.ok, report.summary()
    assert report.touched == [DATA] and report.notes == []
    names = [d.qualname for d in definitions(report.new_contents[DATA])]
    assert "BatchPrefetcher.stop" in names and "select_target_warmup_shapes" in names

    patched = tmp_path / "patched"
    shutil.copytree(release, patched)
    report.write_to(patched)
    out = subprocess.run([sys.executable, str(IMPORT_CHECK), str(patched), "trainer.data"], capture_output=True)
    assert out.returncode == 0 and json.loads(out.stdout)["ok"] is True
    assert not list(patched.rglob("__pycache__"))


def test_allow_moves_reports_moves_but_still_refuses_unreachable(release):
    report = check_patch(release, fixture_diff("broken_warmup_inside_class.diff"), allow_moves=True)
    assert {p.kind for p in report.problems} == {"unreachable"}
    assert any("→ select_target_warmup_shapes.stop" in str(n) for n in report.notes)


def test_allow_moves_accepts_a_reachable_move(release):
    diff = """--- a/trainer/data.py
+++ b/trainer/data.py
@@ -4,7 +4,7 @@
 import threading
 
 
-def bucket_of(length, edges):
+def bucket_index(length, edges):
     for i, edge in enumerate(edges):
         if length <= edge:
             return i
"""
    refused = check_patch(release, diff)
    assert [str(p) for p in refused.problems] == ["trainer/data.py:7: def bucket_of disappears"]
    allowed = check_patch(release, diff, allow_moves=True)
    assert allowed.ok and [p.kind for p in allowed.notes] == ["removed"]


def start_hunk(old: str, new: str) -> str:
    """A diff of trainer/data.py that replaces line 24 (`old`, in BatchPrefetcher.start) by `new`."""
    return f"""--- a/trainer/data.py
+++ b/trainer/data.py
@@ -23,3 +23,3 @@
     def start(self):
-        {old}
+        {new}
         return self
"""


def test_syntax_error_is_refused_with_file_and_line(release):
    report = check_patch(release, start_hunk("self.thread.start()", "self.thread.start("))
    assert [(p.kind, p.file, p.line) for p in report.problems] == [("syntax", DATA, 24)]
    assert "SyntaxError" in str(report.problems[0])


def test_hunk_that_does_not_apply_is_refused(release):
    report = check_patch(release, start_hunk("self.thread.launch()", "self.thread.start()"))
    assert len(report.problems) == 1
    message = str(report.problems[0])
    assert message == ("trainer/data.py:23: hunk #1 (@@ -23,3 +23,3 @@) does not apply: "
                       "at line 24 expected '        self.thread.launch()', found '        self.thread.start()'")


def test_hunk_found_at_an_offset_applies(release):
    shifted = "# a new first line\n" + (release / DATA).read_text()
    (release / DATA).write_text(shifted)
    report = check_patch(release, fixture_diff("fixed_warmup_at_module_level.diff"))
    assert report.ok, report.summary()
    assert report.new_contents[DATA].startswith("# a new first line\n")


def test_new_file_and_deletion(release):
    (release / "trainer" / "old_helpers.py").write_text("X = 1\n")
    create = """diff --git a/trainer/warmup.py b/trainer/warmup.py
new file mode 100644
--- /dev/null
+++ b/trainer/warmup.py
@@ -0,0 +1,2 @@
+def shapes():
+    return []
"""
    delete = """--- a/trainer/old_helpers.py
+++ /dev/null
@@ -1 +0,0 @@
-X = 1
"""
    report = check_patch(release, create + delete)
    assert report.ok, report.summary()
    assert report.new_contents == {"trainer/warmup.py": "def shapes():\n    return []\n", "trainer/old_helpers.py": None}
    report.write_to(release)
    assert not (release / "trainer" / "old_helpers.py").exists()
    assert (release / "trainer" / "warmup.py").read_text() == "def shapes():\n    return []\n"

    again = check_patch(release, create)
    assert [p.message for p in again.problems] == ["the diff creates this file but it already exists"]


def test_deleting_a_module_with_definitions_needs_allow_moves(release):
    lines = (release / DATA).read_text().splitlines()
    delete = f"--- a/{DATA}\n+++ /dev/null\n@@ -1,{len(lines)} +0,0 @@\n" + "".join(f"-{l}\n" for l in lines)
    refused = check_patch(release, delete)
    assert "class BatchPrefetcher disappears" in {p.message for p in refused.problems}
    assert check_patch(release, delete, allow_moves=True).ok


def test_missing_file_and_malformed_diff(release):
    report = check_patch(release, "--- a/trainer/nope.py\n+++ b/trainer/nope.py\n@@ -1 +1 @@\n-a\n+b\n")
    assert [str(p) for p in report.problems] == ["trainer/nope.py: no such file in the release"]
    assert not check_patch(release, "just prose\n").ok
    with pytest.raises(DiffError, match="relative to the release root"):
        parse_unified_diff("--- a/../etc/passwd\n+++ b/../etc/passwd\n@@ -1 +1 @@\n-a\n+b\n")
    for reserved in (".helpers/0123abcd/release_store.py", ".dflash-release.json", ".dflash-delta.json"):
        with pytest.raises(DiffError, match="reserved for the release machinery"):
            parse_unified_diff(f"--- /dev/null\n+++ b/{reserved}\n@@ -0,0 +1 @@\n+x\n")
    with pytest.raises(DiffError, match="ends early"):
        parse_unified_diff("--- a/x.py\n+++ b/x.py\n@@ -1,3 +1,3 @@\n a\n-b\n")


def test_no_newline_at_end_of_file():
    diff = "--- a/x\n+++ b/x\n@@ -1,2 +1,2 @@\n a\n-b\n\\ No newline at end of file\n+c\n\\ No newline at end of file\n"
    assert apply_hunks("a\nb", parse_unified_diff(diff)[0].hunks) == "a\nc"
    diff2 = "--- a/x\n+++ b/x\n@@ -1,2 +1,2 @@\n a\n-b\n\\ No newline at end of file\n+c\n"
    assert apply_hunks("a\nb", parse_unified_diff(diff2)[0].hunks) == "a\nc\n"


def test_definition_tree_and_reachability():
    source = """
class A:
    def f(self):
        def inner():
            pass
        return inner
        def after_return():
            pass

    if True:
        def g(self):
            raise ValueError
            class Dead:
                def m(self):
                    pass

for x in []:
    continue
    def loop_dead():
        pass
"""
    got = {d.qualname: d.reachable for d in definitions(source)}
    assert got == {"A": True, "A.f": True, "A.f.inner": True, "A.f.after_return": False, "A.g": True,
                   "A.g.Dead": False, "A.g.Dead.m": False, "loop_dead": False}


def test_import_check_reports_failures(tmp_path):
    (tmp_path / "good.py").write_text("VALUE = 1\n")
    (tmp_path / "bad.py").write_text("import good\nraise RuntimeError('boom at import')\n")
    (tmp_path / "broken.py").write_text("def f(:\n")
    out = subprocess.run([sys.executable, str(IMPORT_CHECK), str(tmp_path), "good", "bad", "broken", "missing_mod"],
                         capture_output=True)
    assert out.returncode == 1
    results = {r["module"]: r for r in json.loads(out.stdout)["results"]}
    assert results["good"]["ok"]
    assert results["bad"]["error"] == "RuntimeError: boom at import" and results["bad"]["line"] == 2
    assert results["broken"]["error"].startswith("SyntaxError") and results["broken"]["line"] == 1
    assert results["missing_mod"]["error"].startswith("ModuleNotFoundError")


def test_static_import_check_runs_no_code_and_still_finds_what_would_fail(tmp_path):
    marker = tmp_path / "ran"
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\nVALUE = 1\n")
    (pkg / "util.py").write_text("def helper():\n    pass\nclass C:\n    def moved(self):\n        pass\n")
    (tmp_path / "side_effects.py").write_text(f"import json\nopen({str(marker)!r}, 'w').close()\nraise SystemExit(3)\n")
    (tmp_path / "uses.py").write_text("from pkg import VALUE\nfrom pkg.util import helper\n")
    (tmp_path / "moved.py").write_text("import os\nfrom pkg.util import moved\n")
    (tmp_path / "missing.py").write_text("try:\n    import json\nexcept ImportError:\n    pass\nimport no_such_pkg_xyz\n")
    (tmp_path / "lazy.py").write_text("def f():\n    import no_such_pkg_xyz\n")
    (tmp_path / "broken.py").write_text("x = 1\ndef f(:\n")
    names = ["pkg", "side_effects", "uses", "moved", "missing", "lazy", "broken", "absent"]
    out = subprocess.run([sys.executable, str(IMPORT_CHECK), "--static", str(tmp_path), *names], capture_output=True)
    assert out.returncode == 1 and not marker.exists()
    results = {r["module"]: r for r in json.loads(out.stdout)["results"]}
    assert [n for n in names if results[n]["ok"]] == ["pkg", "side_effects", "uses", "lazy"]
    assert results["moved"]["error"] == "ImportError: cannot import name 'moved' from 'pkg.util'"
    assert results["moved"]["line"] == 2
    assert results["missing"]["error"].startswith("ModuleNotFoundError") and results["missing"]["line"] == 5
    assert results["broken"]["error"].startswith("SyntaxError") and results["broken"]["line"] == 2
    assert results["absent"]["error"].startswith("ModuleNotFoundError")
    assert not list(tmp_path.rglob("__pycache__"))


def test_line_endings_and_odd_characters_survive_a_patch(tmp_path):
    """Only the diff's lines change: CRLF files stay CRLF, a lone CR or a form feed is kept."""
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "crlf.py").write_bytes(b"x = 1\r\ny = 2\r\nz = 3\r\n")
    (tmp_path / "t" / "cr.txt").write_bytes(b"s = 'a\rb'\ny = 2\n")
    (tmp_path / "t" / "ff.py").write_bytes(b"x = 1\n\x0c\ny = 2\n")
    diff = ("--- a/t/crlf.py\n+++ b/t/crlf.py\n@@ -2 +2 @@\n-y = 2\n+y = 5\n"
            "--- a/t/cr.txt\n+++ b/t/cr.txt\n@@ -2 +2 @@\n-y = 2\n+y = 5\n"
            "--- a/t/ff.py\n+++ b/t/ff.py\n@@ -1,3 +1,3 @@\n x = 1\n \x0c\n-y = 2\n+y = 5\n")
    report = check_patch(tmp_path, diff)
    assert report.ok, report.summary()
    report.write_to(tmp_path)
    assert (tmp_path / "t" / "crlf.py").read_bytes() == b"x = 1\r\ny = 5\r\nz = 3\r\n"
    assert (tmp_path / "t" / "cr.txt").read_bytes() == b"s = 'a\rb'\ny = 5\n"
    assert (tmp_path / "t" / "ff.py").read_bytes() == b"x = 1\n\x0c\ny = 5\n"
    crlf_diff = "--- a/t/ff.py\r\n+++ b/t/ff.py\r\n@@ -3 +3 @@\r\n-y = 5\r\n+y = 6\r\n"
    assert check_patch(tmp_path, crlf_diff).new_contents == {"t/ff.py": "x = 1\n\x0c\ny = 6\n"}


GIT_HEADER = "diff --git a/trainer/data.py b/trainer/data.py\n"
TEXT_CHANGE = "--- a/trainer/data.py\n+++ b/trainer/data.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n"


@pytest.mark.parametrize("section, what", [
    ("diff --git a/old.py b/new.py\nsimilarity index 100%\nrename from old.py\nrename to new.py\n", "a rename"),
    ("diff --git a/run.sh b/run.sh\nold mode 100644\nnew mode 100755\n", "a mode change"),
    ("diff --git a/w.bin b/w.bin\nindex 1234567..89abcde 100644\nBinary files a/w.bin and b/w.bin differ\n",
     "a binary change"),
    ("diff --git a/w.bin b/w.bin\nindex 1234567..89abcde 100644\nGIT binary patch\nliteral 3\nKcmZQz\n\n",
     "a binary change"),
    ("diff --git a/a.py b/c.py\ncopy from a.py\ncopy to c.py\n", "a copy"),
    ("diff --git a/go.sh b/go.sh\nnew file mode 100755\n--- /dev/null\n+++ b/go.sh\n@@ -0,0 +1 @@\n+echo\n",
     "file mode 100755"),
    ("diff --git a/empty.py b/empty.py\nnew file mode 100644\nindex 0000000..e69de29\n", "has no text hunks"),
])
def test_a_git_diff_with_changes_beyond_text_is_refused_not_half_applied(section, what):
    """Each section sits between ordinary text changes: none of it may be dropped silently."""
    with pytest.raises(DiffError, match=what):
        parse_unified_diff(GIT_HEADER + TEXT_CHANGE + section + GIT_HEADER + TEXT_CHANGE)


def test_git_sections_of_plain_text_changes_and_new_regular_files_still_parse():
    diff = (GIT_HEADER + "index 1111111..2222222 100644\n" + TEXT_CHANGE +
            "diff --git a/new.py b/new.py\nnew file mode 100644\nindex 0000000..3333333\n"
            "--- /dev/null\n+++ b/new.py\n@@ -0,0 +1 @@\n+y = 1\n"
            "diff --git a/gone.py b/gone.py\ndeleted file mode 100644\nindex 4444444..0000000\n"
            "--- a/gone.py\n+++ /dev/null\n@@ -1 +0,0 @@\n-z = 1\n")
    assert [(p.old_path, p.new_path) for p in parse_unified_diff(diff)] == [
        ("trainer/data.py", "trainer/data.py"), (None, "new.py"), ("gone.py", None)]


def test_many_hunks_each_match_at_their_stated_line_or_the_nearest_one():
    source = "".join(f"line {i}\n" for i in range(60_000))
    hunks = "".join(f"@@ -{i + 1} +{i + 1} @@\n-line {i}\n+LINE {i}\n" for i in range(0, 60_000, 10))
    patch = parse_unified_diff("--- a/f\n+++ b/f\n" + hunks)[0]
    calls = []
    real = diff_module._find

    def counting(source_lines, old, wanted, floor):
        at = real(source_lines, old, wanted, floor)
        calls.append(at - wanted)
        return at

    diff_module._find = counting
    try:
        out = apply_hunks(source, patch.hunks)
    finally:
        diff_module._find = real
    assert calls == [0] * 6000
    lines = out.splitlines()
    assert lines[0] == "LINE 0" and lines[10] == "LINE 10" and lines[11] == "line 11" and len(lines) == 60_000
    repeated = "a\nx\na\nx\na\n"
    one = parse_unified_diff("--- a/f\n+++ b/f\n@@ -3 +3 @@\n-x\n+y\n")[0]  # stated line 3 is 'a': nearest x
    assert apply_hunks(repeated, one.hunks) == "a\ny\na\nx\na\n"
