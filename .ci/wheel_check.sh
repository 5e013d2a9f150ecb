#!/usr/bin/env bash
# The package as a user gets it: build the sdist and the wheel from this tree (python -m build),
# check their metadata (twine check), install the wheel (not editable) into a fresh virtual
# environment and run the `lowprec` command from outside the source tree, so that a module or data
# file missing from the wheel fails here instead of on a user's machine.
#
# usage: bash .ci/wheel_check.sh PYTHON   (PYTHON: an interpreter with build and twine installed)
set -euo pipefail
cd "$(dirname "$0")/.."
python=${1:?usage: wheel_check.sh PYTHON}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$python" -m build --outdir "$work/dist" . >"$work/build.log" 2>&1 \
    || { cat "$work/build.log"; exit 1; }
"$python" -m twine check --strict "$work"/dist/*
wheel=$(ls "$work"/dist/lowprec-*.whl)
sdist=$(ls "$work"/dist/lowprec-*.tar.gz)
echo "built $(basename "$sdist") and $(basename "$wheel")"
# The wheel carries every module under src/lowprec and the type marker. (Its listing is read
# whole first: `unzip | grep -q` under pipefail fails when grep stops reading early.)
unzip -Z1 "$wheel" | sort >"$work/files"
grep -qx 'lowprec/py.typed' "$work/files" || { echo "py.typed is not in the wheel"; exit 1; }
missing=$(cd src && find lowprec -name '*.py' | sort | comm -23 - "$work/files")
[ -z "$missing" ] || { echo "modules missing from the wheel:"; echo "$missing"; exit 1; }

# torch first, as .ci/run does, so that pip takes the CPU build on this machine's disk.
python3 -m venv "$work/venv"
"$work/venv/bin/python" -m pip install --quiet --disable-pip-version-check torch==2.13.0
"$work/venv/bin/python" -m pip install --quiet --disable-pip-version-check "$wheel[cli]"
cd "$work"  # outside the source tree: only the installed wheel can be imported
expected=$("$work/venv/bin/python" -c "
import lowprec, pathlib
assert 'site-packages' in pathlib.Path(lowprec.__file__).parts, lowprec.__file__
print(lowprec.__version__)")
version=$("$work/venv/bin/lowprec" --version)
echo "$version"
[ "$version" = "lowprec $expected" ] || { echo "expected 'lowprec $expected'"; exit 1; }
# Five steps of the main job: FP32 against BF16 + Kahan, stepped eagerly (the compiled step is the
# tests' to check; this checks that the installed command runs its task end to end).
"$work/venv/bin/lowprec" compare --steps 5 --recipes fp32,bf16-kahan --no-fused --eval-batches 1 \
    --no-plot --no-progress --out "$work/out" >"$work/compare.log" 2>&1 \
    || { cat "$work/compare.log"; exit 1; }
grep -E '^(Recommended|JSON):' "$work/compare.log"
test -s "$work/out/compare.json"
echo "wheel check: passed"
