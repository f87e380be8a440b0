"""Import modules from a code tree and report failures as JSON (python3.8+, stdlib only).

  import_check.py ROOT MODULE...

Runs in the container's venv against a patched tree before it becomes a release. Prints one
JSON document {"ok": bool, "root": ROOT, "results": [{"module", "ok", "error", "file",
"line", "traceback"}]}; exit status 0 when every module imports, 1 otherwise, 2 on bad input.
"""

import importlib
import json
import os
import sys
import traceback


def import_one(name):
    try:
        importlib.import_module(name)
    except BaseException as e:  # a module may call sys.exit or raise anything at import
        frames = traceback.extract_tb(e.__traceback__)
        where = frames[-1] if frames else None
        result = {
            "module": name, "ok": False, "error": "%s: %s" % (type(e).__name__, e),
            "file": where.filename if where else None, "line": where.lineno if where else None,
            "traceback": "".join(traceback.format_exception(type(e), e, e.__traceback__)[-12:]),
        }
        if isinstance(e, SyntaxError):
            result["file"], result["line"] = e.filename, e.lineno
        return result
    return {"module": name, "ok": True, "error": None, "file": None, "line": None, "traceback": None}


def main(argv):
    if len(argv) < 2 or not os.path.isdir(argv[0]):
        sys.stderr.write("usage: import_check.py ROOT MODULE... (ROOT must be a directory)\n")
        return 2
    root = os.path.abspath(argv[0])
    sys.path.insert(0, root)
    sys.dont_write_bytecode = True  # never leave __pycache__ in a release tree
    results = [import_one(name) for name in argv[1:]]
    ok = all(r["ok"] for r in results)
    sys.stdout.write(json.dumps({"ok": ok, "root": root, "results": results}, sort_keys=True) + "\n")
    sys.stdout.flush()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
