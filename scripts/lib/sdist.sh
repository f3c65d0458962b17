# shellcheck shell=bash
# One file out of a vLLM release's sdist on PyPI, for the scripts that cache vLLM (vLLM's toy
# proxy and its push router are in no wheel). pip cannot download an sdist without building its
# metadata, which needs vLLM's build dependencies: the index's JSON API names the file and its
# sha256, and the file is read straight from the index's files host. The file must carry an
# Apache-2.0 licence header; it is written unchanged to OUT, outside this repository.
#
# Usage: fetch_sdist_member PYTHON VERSION MEMBER OUT   (MEMBER relative to vllm-VERSION/)
fetch_sdist_member() {
    local python=$1 version=$2 member=$3 out=$4
    mkdir -p "$(dirname "$out")"
    "$python" - "$version" "$member" "$out" "${PIP_INDEX_URL:-https://pypi.org/simple}" <<'PY'
import hashlib, io, json, sys, tarfile, urllib.request
version, member, out, index = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].rstrip("/")
req = urllib.request.Request(f"{index}/vllm/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
files = json.load(urllib.request.urlopen(req, timeout=120))["files"]
f = next(f for f in files if f["filename"] == f"vllm-{version}.tar.gz")
data = urllib.request.urlopen(f["url"], timeout=600).read()
if hashlib.sha256(data).hexdigest() != f["hashes"]["sha256"]:
    sys.exit(f"vllm-{version}.tar.gz: sha256 differs from the index's")
path = f"vllm-{version}/{member}"
src = tarfile.open(fileobj=io.BytesIO(data)).extractfile(path).read()
if b"SPDX-License-Identifier: Apache-2.0" not in src[:200]:
    sys.exit(f"{path}: no Apache-2.0 header")
open(out, "wb").write(src)
print(f"{path} -> {out}")
PY
}
