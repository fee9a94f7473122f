#!/usr/bin/env bash
# The source folders stand in layers (docs/architecture.md, "Layers"): a folder includes
# only itself and the folders of lower layers, so planning never reaches up into the
# executor and no two folders need each other. Fails naming the file and the include.
set -u
SRC=$2
/usr/bin/python3 - "$SRC" <<'PY'
import pathlib, re, sys

src = pathlib.Path(sys.argv[1])
layers = [["core"], ["attention", "data", "parallel", "trace"], ["model"], ["cp"], ["pp"], ["packing"],
          ["runtime"], ["profile", "train"], ["app"]]
layer = {d: i for i, ds in enumerate(layers) for d in ds}
# The one include across: the deck schema lists the attention kernel variants that
# run.attention takes, from their one table (a header without Kokkos).
allowed = {("core/deck_schema.cpp", "attention/flops.hpp")}
# The Python module takes the planning library alone.
plan_only = {"core", "attention", "data", "trace", "model", "cp", "pp", "packing"}
bad = []
inc = re.compile(r'^\s*#\s*include\s+"([a-z_]+)/([^"]+)"', re.M)
for f in sorted(src.glob("src/*/**/*")) + sorted(src.glob("python/*.cpp")):
    if f.suffix not in (".cpp", ".hpp", ".cu", ".h"):
        continue
    rel = f.relative_to(src).as_posix()
    top = rel.split("/")[1] if rel.startswith("src/") else "python"
    for m in inc.finditer(f.read_text(errors="replace")):
        to = m.group(1)
        if to not in layer or to == top:
            continue  # generated headers (wlb/version.hpp) and the folder itself
        if top == "python":
            ok = to in plan_only
        else:
            ok = layer[to] < layer[top] or (rel[4:], f"{to}/{m.group(2)}") in allowed
        if not ok:
            bad.append(f"{rel}: includes {to}/{m.group(2)}")
if top_unknown := sorted({p.name for p in (src / "src").iterdir() if p.is_dir()} - set(layer)):
    bad.append(f"src/: folders without a layer: {', '.join(top_unknown)} (add them to tests/cli/test_layers.sh "
               "and docs/architecture.md)")
for b in bad:
    print("FAIL:", b)
if bad:
    sys.exit(1)
print(f"layers hold: {sum(len(l) for l in layers)} folders in {len(layers)} layers")
PY
