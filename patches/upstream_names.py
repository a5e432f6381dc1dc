"""Write tests-unit/minimax_h3_test/data/upstream_minimax_model_names.json from the pinned base.

The compatibility test checks that every name upstream's comfy/ldm/minimax/model.py defined at top
level is still importable from the re-export; this records those names once, from the source
(no import: ComfyUI need not be importable here). Run: python patches/upstream_names.py $COMFYUI_DIR
"""

import ast
import hashlib
import json
import os
import sys

SOURCE = "comfy/ldm/minimax/model.py"
OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                   "tests-unit", "minimax_h3_test", "data", "upstream_minimax_model_names.json")


def top_level_names(source):
    """(defined, imported): names bound at module level by def/class/assignment, and by import."""
    defined, imported = [], []
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.append(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                defined.extend(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            imported.extend((a.asname or a.name).split(".")[0] for a in node.names)
    return defined, sorted(set(imported))


def main(comfyui_dir):
    with open(os.path.join(comfyui_dir, SOURCE), "rb") as f:
        raw = f.read()
    defined, imported = top_level_names(raw.decode("utf-8"))
    doc = {
        "source": SOURCE,
        "base": "ComfyUI 0f1fa67ad8a68b62c65ebc97a7bf485df2459c3a (v0.33.0)",
        "sha256": hashlib.sha256(raw).hexdigest(),
        "generated_by": "python patches/upstream_names.py $COMFYUI_DIR",
        "public": [n for n in defined if not n.startswith("_")],
        "private": [n for n in defined if n.startswith("_")],
        "imported_only": imported,
    }
    with open(OUT, "w", encoding="utf-8", newline="\n") as f:
        f.write(json.dumps(doc, indent=2) + "\n")
    print(f"{OUT}: {len(doc['public'])} public, {len(doc['private'])} private names")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python patches/upstream_names.py COMFYUI_DIR")
    main(sys.argv[1])
