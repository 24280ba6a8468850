#!/usr/bin/env bash
# Sets up the browser path: Debian chromium, the Pyodide npm package, the Playwright pip package,
# the pure-Python wheels the page loads (jinja2, markupsafe) and the project wheel, all same-origin.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
VENDOR=demo/browser/vendor
PYODIDE_VERSION=0.29.3

# 1. A WebGPU-capable browser (never `playwright install`: it downloads a browser from the internet).
if [ ! -x /usr/bin/chromium ]; then
    if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO=sudo; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium
fi

# 2. Playwright for Python drives /usr/bin/chromium in the browser test.
"$PY" -c "import playwright" 2>/dev/null || "$PY" -m pip install -q "playwright>=1.45"

# 3. Pyodide runtime from the npm registry, unpacked into the demo's vendor folder (git-ignored).
mkdir -p "$VENDOR"
if [ ! -f "$VENDOR/pyodide/pyodide.mjs" ]; then
    tmp=$(mktemp -d)
    (cd "$tmp" && npm pack --silent "pyodide@$PYODIDE_VERSION" >/dev/null)
    rm -rf "$VENDOR/pyodide"
    mkdir -p "$VENDOR/pyodide"
    tar -xzf "$tmp"/pyodide-*.tgz -C "$VENDOR/pyodide" --strip-components=1
    rm -rf "$tmp"
fi

# 4. Pure-Python wheels the page installs from the same origin (the chat template needs jinja2).
#    markupsafe publishes only compiled wheels; built from its sdist with the C speedups disabled
#    (CC=false makes the optional extension fail) it is a py3-none-any wheel that runs in Pyodide.
mkdir -p "$VENDOR/wheels"
if ! ls "$VENDOR"/wheels/jinja2-*.whl >/dev/null 2>&1; then
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.13 --platform any \
        -d "$VENDOR/wheels" "jinja2==3.1.6"
fi
if ! ls "$VENDOR"/wheels/markupsafe-*-py3-none-any.whl >/dev/null 2>&1; then
    CC=false "$PY" -m pip wheel -q --no-deps --no-binary=markupsafe -w "$VENDOR/wheels" "markupsafe==3.0.4"
fi

# 5. The project wheel (pure Python: the same package the page imports).
"$PY" demo/browser/build_wheel.py
echo "browser setup done: $(ls "$VENDOR"/wheels)"
