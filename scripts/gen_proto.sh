#!/usr/bin/env bash
# Regenerate the checked-in Python code for proto/asteria/v1/*.proto.
#
#   scripts/gen_proto.sh           rewrite asteria_server/protocol/generated/
#   scripts/gen_proto.sh --check   regenerate into a temp dir; exit 1 with a diff summary if the
#                                  checked-in files differ (CI runs this)
#
# Needs the pinned generators of pyproject.toml's `dev` extra (pip install -e '.[dev]'): protoc
# and the gRPC plugin from grpcio-tools, the .pyi stubs from mypy-protobuf. The pins are read from
# pyproject.toml, so they live in one place, and the installed versions must match them exactly.
#
# Import strategy: protoc runs with `-I proto`, so each file keeps its canonical name
# (asteria/v1/preconditioner.proto) and proto package (asteria.v1), and the output lands in
# generated/asteria/v1/. protoc writes imports between generated modules as absolute
# `asteria.v1` imports (e.g. the _grpc.py imports `from asteria.v1 import preconditioner_pb2`),
# which would look for a top-level `asteria` package. This script rewrites exactly those import
# lines to `asteria_server.protocol.generated.asteria.v1` and writes the packages' __init__.py
# files, so the generated code imports from inside our package without touching sys.path.
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
PROTO_ROOT=proto
OUT_DIR=asteria_server/protocol/generated

mode="write"
case "${1:-}" in
    "") ;;
    --check) mode="check" ;;
    -h | --help)
        sed -n '2,8p' "$0"
        exit 0
        ;;
    *)
        echo "usage: $0 [--check]" >&2
        exit 2
        ;;
esac

# The pinned generator versions must be installed, and the plugins must be next to that Python.
scripts_dir="$(
    "$PYTHON" - <<'EOF'
import importlib.metadata as md
import re
import sys
import sysconfig
import tomllib

with open("pyproject.toml", "rb") as f:
    dev = tomllib.load(f)["project"]["optional-dependencies"]["dev"]
for name in ("grpcio-tools", "mypy-protobuf"):
    pins = [r for r in dev if re.fullmatch(rf"{name}==[\w.]+", r)]
    if len(pins) != 1:
        sys.exit(f"gen_proto: pyproject.toml's dev extra must pin {name}==VERSION exactly once")
    wanted = pins[0].split("==")[1]
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        have = "not installed"
    if have != wanted:
        sys.exit(
            f"gen_proto: needs {name}=={wanted} (found {have}); run: pip install -e '.[dev]'"
        )
print(sysconfig.get_path("scripts"))
EOF
)"
for plugin in protoc-gen-mypy protoc-gen-mypy_grpc; do
    if [ ! -x "$scripts_dir/$plugin" ]; then
        echo "gen_proto: $scripts_dir/$plugin not found; run: pip install -e '.[dev]'" >&2
        exit 1
    fi
done

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
gen="$tmp/generated"
mkdir -p "$gen"

protos=()
while IFS= read -r -d '' f; do protos+=("${f#"$PROTO_ROOT"/}"); done < <(
    find "$PROTO_ROOT" -name '*.proto' -print0 | LC_ALL=C sort -z
)
if [ "${#protos[@]}" -eq 0 ]; then
    echo "gen_proto: no .proto files under $PROTO_ROOT" >&2
    exit 1
fi

"$PYTHON" -m grpc_tools.protoc \
    -I "$PROTO_ROOT" \
    --plugin=protoc-gen-mypy="$scripts_dir/protoc-gen-mypy" \
    --plugin=protoc-gen-mypy_grpc="$scripts_dir/protoc-gen-mypy_grpc" \
    --python_out="$gen" \
    --grpc_python_out="$gen" \
    --mypy_out="$gen" \
    --mypy_grpc_out="$gen" \
    "${protos[@]}" 2>"$tmp/protoc.log" || {
    cat "$tmp/protoc.log" >&2
    exit 1
}

# Point imports of sibling generated modules into our package; write the __init__.py files.
"$PYTHON" - "$gen" <<'EOF'
import pathlib
import re
import sys

gen = pathlib.Path(sys.argv[1])
prefix = "asteria_server.protocol.generated."
# `from asteria.v1 import x_pb2 as ...` (protoc, grpc plugin) and `import asteria.v1.x_pb2`
# (mypy-protobuf); only the top-level proto package `asteria` is ours to rewrite.
pattern = re.compile(r"^(\s*)(from|import) (asteria\.)", re.MULTILINE)
for path in sorted(gen.rglob("*.py*")):
    text = path.read_text()
    new = pattern.sub(lambda m: f"{m[1]}{m[2]} {prefix}{m[3]}", text)
    # Dotted module paths elsewhere: mypy-protobuf's annotations, and the module name protoc
    # passes to BuildTopDescriptorsAndMessages (the generated classes' __module__).
    new = re.sub(r"(?<![\w.])asteria\.v1\.(\w+_pb2)\b", rf"{prefix}asteria.v1.\1", new)
    if new != text:
        path.write_text(new)
leftover = [
    str(p)
    for p in gen.rglob("*.py*")
    if re.search(r"^\s*(from|import) asteria\.", p.read_text(), re.MULTILINE)
]
if leftover:
    sys.exit(f"gen_proto: unrewritten `asteria.` imports in {leftover}")
doc = '"""Generated from proto/ by scripts/gen_proto.sh. Do not edit."""\n'
for pkg in [gen, *sorted(p for p in gen.rglob("*") if p.is_dir())]:
    (pkg / "__init__.py").write_text(doc)
EOF

if [ "$mode" = check ]; then
    if diff -r -x __pycache__ "$gen" "$OUT_DIR" >"$tmp/summary" 2>&1; then
        echo "gen_proto: $OUT_DIR is up to date"
        exit 0
    fi
    echo "gen_proto: $OUT_DIR differs from what $PROTO_ROOT generates:" >&2
    diff -rq -x __pycache__ "$gen" "$OUT_DIR" | sed "s|$gen|<regenerated>|g" >&2 || true
    echo "--- first lines of the diff (< regenerated, > checked in):" >&2
    head -n 40 "$tmp/summary" | sed "s|$gen|<regenerated>|g" >&2
    echo "run scripts/gen_proto.sh and check the result in" >&2
    exit 1
fi

rm -rf "$OUT_DIR"
mkdir -p "$(dirname "$OUT_DIR")"
cp -R "$gen" "$OUT_DIR"
echo "gen_proto: wrote $OUT_DIR"
