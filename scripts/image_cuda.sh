#!/usr/bin/env bash
# The Dockerfile's default, cuda variant, built and checked on a machine without a GPU, a Docker engine, nvidia's
# container registry or PyTorch's own package index (`make image-cuda`; not part of `make test`: GBs of wheels):
#
#   1. docker-compose.yml through a real compose parser (`docker-compose config`): the four stages reserve one
#      NVIDIA GPU each, nothing else does, and the build arguments are the Dockerfile's defaults;
#   2. mmdebstrap a minimal Debian bookworm without Python (as debian:bookworm-slim, the Dockerfile's default base:
#      the build installs python3 and python3-venv with apt) and import it into buildah as the base image;
#   3. `buildah bud --isolation chroot` of the Dockerfile with nothing but that base: torch 2.13.0 from PyPI (a CUDA
#      build, its CUDA runtime libraries as nvidia-* wheels), bitsandbytes, the project and its gpu extra;
#   4. the image's config (entry point, user, volume, ports), then in it, with `buildah run`: torch.version.cuda
#      matches the bundled CUDA runtime wheel (and libcudart is loaded from it), torch.cuda.is_available() is False
#      without an error, bitsandbytes imports and its own lookup finds its binary for that CUDA version, which loads;
#      `sentinel-node --help` and `join --help`; docker-compose.yml's bootstrap and stage0 (`--device auto`), each in
#      a container of the image: the stage logs the documented CPU fallback line and comes up.
#
# Lines starting with "CUDA " are the report; the last one is "CUDA OK ..." on success. Exit status: 0 passed,
# 77 skipped (no buildah possible here: not root, no apt, no namespaces), anything else failed.
#
#   sudo scripts/image_cuda.sh       # 16-24 minutes on 2 busy cores, most of it pip and the commit of ~6 GB
#
# Environment: IMAGE_CUDA_WHEELS=DIR installs from a wheelhouse in DIR (e.g. one `pip download` made) instead of
# PyPI; IMAGE_CA_BUNDLE (default /etc/ssl/certs/ca-certificates.crt, this machine's) is the CA bundle pip trusts
# in the build; and those of scripts/image_lib.sh (DEBIAN_MIRROR, SMOKE_TMPDIR, SMOKE_KEEP=1).
set -Eeuo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PREFIX=CUDA
BASE_TAG=localhost/sentinel-cuda-base:bookworm
IMAGE_TAG=localhost/sentinel-node:cuda
# shellcheck source=scripts/image_lib.sh
source "$REPO/scripts/image_lib.sh"
trap 'say "FAIL at line $LINENO: $BASH_COMMAND"' ERR

need_buildah docker-compose
started=$SECONDS
start_work sentinel-image-cuda

# --- 1. docker-compose.yml through docker-compose's own parser ------------------------------------------------------
# `config` validates the file against the compose schema and prints it resolved (anchors merged, defaults filled in);
# the check reads that output with docker-compose's own Python (which has PyYAML).
compose_python="$(head -1 "$(command -v docker-compose)" | sed -n 's/^#! *//p')"
[ -x "${compose_python%% *}" ] || compose_python=python3
compose_version="$(docker-compose version --short)"
t=$SECONDS
compose_out="$WORK/compose"
mkdir -p "$compose_out"
for variant in cuda cpu; do # the default, then the README's `VARIANT=cpu docker compose up`
    env -u BASE_IMAGE $([ "$variant" = cuda ] && echo -u VARIANT || echo VARIANT=cpu) \
        docker-compose -f "$REPO/docker-compose.yml" config >"$compose_out/$variant.yml" 2>"$compose_out/err" || {
        cat "$compose_out/err"
        fail "docker-compose $compose_version config rejects docker-compose.yml (VARIANT=$variant)"
    }
done
PREFIX=$PREFIX $compose_python - "$compose_out" "$REPO/Dockerfile" "$compose_version" <<'EOF' ||
import os, re, sys, yaml
folder, dockerfile, version = sys.argv[1:]
prefix = os.environ["PREFIX"]
defaults = dict(re.findall(r"^ARG (\w+)=(.*)$", open(dockerfile).read(), re.M))
gpu = [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
ok = True
for variant in ("cuda", "cpu"):
    services = yaml.safe_load(open(f"{folder}/{variant}.yml"))["services"]
    reserving, plain = [], []
    for name, service in sorted(services.items()):
        devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices")
        (reserving if devices else plain).append(name)
        if name.startswith("stage") and devices != gpu:
            print(f"{prefix} compose: {name} reserves {devices}, not {gpu}")
            ok = False
        args = service["build"]["args"]
        want_args = {"VARIANT": variant, "BASE_IMAGE": defaults["BASE_IMAGE"]}
        if service["image"] != f"sentinel-node:{variant}" or args != want_args:
            print(f"{prefix} compose: {name} builds {service['image']} with {args}, not {want_args}")
            ok = False
    stages = [n for n in services if n.startswith("stage")]
    ok = ok and sorted(reserving) == sorted(stages) == ["stage0", "stage1", "stage2", "stage3"]
    if variant == "cuda":
        print(f"{prefix} compose: docker-compose {version} config: {', '.join(reserving)} reserve "
              f"driver={gpu[0]['driver']} count={gpu[0]['count']} capabilities={gpu[0]['capabilities']}; "
              f"{', '.join(plain)} reserve nothing")
    print(f"{prefix} compose: {'VARIANT unset' if variant == 'cuda' else 'VARIANT=cpu'}: every service is image "
          f"sentinel-node:{variant}, build args VARIANT={variant} BASE_IMAGE={defaults['BASE_IMAGE']}")
sys.exit(not ok)
EOF
    fail "docker-compose.yml's GPU reservations or build arguments are not as documented"
say "time compose=$((SECONDS - t))s"

# --- 2. the base: a minimal Debian bookworm without Python (mmdebstrap), like debian:bookworm-slim ----------------
make_base "$BASE_TAG" ca-certificates

# --- 3. the build: the Dockerfile's defaults, from PyPI (or IMAGE_CUDA_WHEELS) ---------------------------------------
build_args=()
if [ -n "${IMAGE_CUDA_WHEELS:-}" ]; then
    wheels="$(cd "$IMAGE_CUDA_WHEELS" && pwd)"
    build_args=(--volume "$wheels:/wheels:ro" --build-arg WHEELS=/wheels)
    say "build installs from the wheelhouse $wheels ($(find "$wheels" -name '*.whl' | wc -l) wheels)"
else
    say "build installs from PyPI"
fi
# pip in the build trusts what this machine trusts (its system CA bundle), for a network behind a TLS-intercepting
# proxy; IMAGE_CA_BUNDLE names another bundle, IMAGE_CA_BUNDLE= none (pip's own certifi then)
ca_bundle="${IMAGE_CA_BUNDLE-/etc/ssl/certs/ca-certificates.crt}"
if [ -n "$ca_bundle" ] && [ -f "$ca_bundle" ]; then
    build_args+=(--volume "$(readlink -f "$ca_bundle"):/etc/ssl/build-ca.crt:ro" --build-arg CA_BUNDLE=/etc/ssl/build-ca.crt)
fi
t=$SECONDS
stamp() { # each line of the build's output, after the seconds since the build started
    local line
    while IFS= read -r line; do printf '%4d %s\n' "$((SECONDS - t))" "$line"; done
}
"${B[@]}" bud --isolation chroot --pull=never --layers=false --build-arg BASE_IMAGE="$BASE_TAG" "${build_args[@]}" \
    --tag "$IMAGE_TAG" --file "$REPO/Dockerfile" "$REPO" 2>&1 | stamp >"$WORK/build.log" || {
    tail -40 "$WORK/build.log"
    fail "buildah bud failed"
}
build_s=$((SECONDS - t))
# each step's share of the build: the seconds from its STEP line to the next one (the last one to the end, commit)
awk -v end="$build_s" -v p="$PREFIX" '
    / STEP [0-9]+\/[0-9]+: / { if (name) printf "%s build step %3ds: %s\n", p, $1 - at, name; at = $1; name = substr($0, index($0, "STEP")); sub(/; \\.*/, "", name); name = substr(name, 1, 90) }
    END { if (name) printf "%s build step %3ds: %s (and the commit)\n", p, end - at, name }' "$WORK/build.log"
sed -n 's/^ *[0-9]* \(Python 3\|torch [0-9]\)/CUDA build: \1/p' "$WORK/build.log"
size="$("${B[@]}" images --format '{{.Size}}' "$IMAGE_TAG")"
say "time build=${build_s}s (image $IMAGE_TAG, $size)"

# --- 4. the image's config and what runs in it -------------------------------------------------------------------------
check_config "$IMAGE_TAG"
t=$SECONDS
ctr="$("${B[@]}" from --pull=never "$IMAGE_TAG")"
run() { "${B[@]}" run --isolation chroot "$ctr" -- "$@"; }
say "run id: $(run id -un):$(run id -gn), HOME=$(run sh -c 'echo $HOME'), data owned by $(run stat -c %U /data)"
say "run sizes: /opt/venv $(run du -sh /opt/venv | cut -f1), of which $(run sh -c \
    'cd /opt/venv/lib/python3*/site-packages && du -sh nvidia torch triton bitsandbytes' |
    awk '{printf "%s%s %s", (NR > 1 ? ", " : ""), $2, $1}')"

run python - <<'EOF' || fail "torch's CUDA build or bitsandbytes' CUDA binary is not as expected"
import ctypes
import importlib.metadata as md
import re
import sys
import warnings

failed = []
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import torch

    try:
        available, count = torch.cuda.is_available(), torch.cuda.device_count()
    except Exception as e:  # the check is that there is none
        available, count = f"raised {type(e).__name__}: {e}", None
print(f"CUDA torch: {torch.__version__}, torch.version.cuda={torch.version.cuda}, "
      f"built for {torch._C._cuda_getArchFlags()}")
if not torch.version.cuda or not torch.__version__.startswith("2.13.0"):
    failed.append("torch is not 2.13.0's CUDA build")
print(f"CUDA torch.cuda.is_available()={available}, device_count()={count}, "
      f"warnings: {[str(w.message) for w in caught] or 'none'}")
if available is not False or count != 0:
    failed.append("torch.cuda.is_available() should be False without an error on a machine without a GPU")

# the CUDA runtime the wheel bundles: the nvidia-cuda-runtime wheel (its name has a -cuNN suffix before CUDA 13),
# whose major.minor must be torch's, and the libcudart that torch loaded must be that wheel's
runtime = {d.metadata["Name"]: d.version for d in md.distributions() if re.fullmatch(
    r"nvidia[-_]cuda[-_]runtime([-_]cu\d+)?", d.metadata["Name"] or "")}
maps = open("/proc/self/maps").read()
cudart = sorted({line.split()[-1] for line in maps.splitlines() if "libcudart.so" in line})
print(f"CUDA runtime wheel: {runtime}, libcudart loaded from {cudart}")
if [".".join(v.split(".")[:2]) for v in runtime.values()] != [torch.version.cuda]:
    failed.append(f"the bundled CUDA runtime {runtime} is not torch's CUDA {torch.version.cuda}")
if not cudart or not all("/site-packages/nvidia/" in path for path in cudart):
    failed.append("torch did not load libcudart from the nvidia wheel")
try:
    cudnn = torch.backends.cudnn.version()
except Exception as e:
    cudnn = f"{type(e).__name__}: {e}"
print(f"CUDA cuDNN {cudnn}, nvidia wheels: " + ", ".join(sorted(
    f"{d.metadata['Name']} {d.version}" for d in md.distributions() if d.metadata["Name"].startswith("nvidia"))))

import bitsandbytes
from bitsandbytes import cextension
from bitsandbytes.cuda_specs import CUDASpecs, get_cuda_version_string, get_cuda_version_tuple

# bitsandbytes' own choice of binary for torch's CUDA version, as it makes it on a GPU (the compute capability does
# not enter the choice), then loaded: every library it links (libcudart, cuBLAS, cuSPARSE) resolves
specs = CUDASpecs((8, 6), get_cuda_version_string(), get_cuda_version_tuple())
path = cextension.get_cuda_bnb_library_path(specs)
try:
    lib = ctypes.CDLL(str(path))
    loaded = f"loads, CUDA entry points {'present' if hasattr(lib, 'get_context') else 'MISSING'}"
except OSError as e:
    lib, loaded = None, f"does not load: {e}"
print(f"CUDA bitsandbytes {bitsandbytes.__version__}: backend here {cextension.BNB_BACKEND}; for CUDA "
      f"{torch.version.cuda} it picks {path.name} ({'exists' if path.exists() else 'MISSING'}), which {loaded}")
if path.name != f"libbitsandbytes_cuda{get_cuda_version_string()}.so" or lib is None or not hasattr(lib, "get_context"):
    failed.append("bitsandbytes has no loadable binary for torch's CUDA version")
for problem in failed:
    print(f"CUDA FAIL {problem}")
sys.exit(bool(failed))
EOF

help="$(run sentinel-node --help)" || fail "sentinel-node --help failed"
for command in join demo simulate swarm bench; do
    grep -qE "^  $command " <<<"$help" || fail "sentinel-node --help lists no '$command': $help"
done
run sentinel-node join --help | grep -q -- '--device' || fail "join --help has no --device"
say "run help: sentinel-node --help lists join, demo, simulate, swarm, bench; join --help lists --device"

# docker-compose.yml's bootstrap and stage0 (`--device auto`), each in a container of the image, ports swapped for
# free ones (buildah run shares this machine's network): the stage must say, in one line, that it found no GPU and
# computes on the CPU, then join the bootstrap.
read -r boot_p2p boot_metrics stage_p2p stage_metrics < <(free_ports 4)
mapfile -d '' -t boot_argv < <(compose_argv "$ctr" bootstrap "$boot_p2p" "$boot_metrics")
mapfile -d '' -t stage_argv < <(compose_argv "$ctr" stage0 "$stage_p2p" "$stage_metrics")
[[ " ${stage_argv[*]} " == *" --device auto "* ]] || fail "docker-compose.yml's stage0 does not pass --device auto"
mkdir -p "$WORK/swarm"
chown "$(run id -u)" "$WORK/swarm"
c=$SECONDS
start_node "$IMAGE_TAG" bootstrap "${boot_argv[@]}"
start_node "$IMAGE_TAG" stage0 "${stage_argv[@]}"
fallback() { grep -m1 -- "--device auto: " "$WORK/stage0.err" 2>/dev/null; }
wait_for 180 fallback >/dev/null || {
    node_log stage0
    fail "the compose stage0 logged no --device auto fallback"
}
say "stage fallback: $(fallback | sed 's/^.*\] //')"
wait_for 120 grep -q "^node .* is up" "$WORK/stage0.out" || {
    node_log stage0
    fail "the compose stage0 did not come up"
}
say "stage up ($((SECONDS - c))s): $(grep -m1 -o "^node .* is up" "$WORK/stage0.out")"
[ "$(grep -c -- "--device auto: " "$WORK/stage0.err")" = 1 ] || fail "the fallback was logged more than once"
stop_nodes
say "time run=$((SECONDS - t))s"
say "OK total=$((SECONDS - started))s"
