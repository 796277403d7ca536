#!/usr/bin/env bash
# Smoke test of the Dockerfile on a machine without a Docker engine or a reachable container registry:
#
#   1. mmdebstrap a minimal Debian bookworm (python3, python3-venv) into a buildah base image;
#   2. build a wheelhouse from this machine's pip (torch 2.13.0 CPU, hivemind's wheel, every dependency);
#   3. `buildah bud --isolation chroot` the Dockerfile's cpu variant on that base, installing from the wheelhouse;
#   4. check the image's config (entry point, user, volume, ports), then `buildah run` it: `sentinel-node --help`,
#      and docker-compose.yml's own bootstrap and verifier0 services, each in a container of the image: the
#      verifier waits for the multiaddrs the bootstrap's entry point writes to the shared /swarm, joins (real
#      hivemind DHTs and p2pd daemons), `swarm status` finds both online, both serve Prometheus metrics.
#      SMOKE_DEMO=1 also runs `sentinel-node demo --steps 2` (a whole swarm training two steps) in the image.
#
# Everything (rootfs, buildah's storage, the wheelhouse) lives in one temporary folder removed at the end.
# Lines starting with "SMOKE " are what tests/test_image.py reads; the last one is "SMOKE OK ..." on success.
# Exit status: 0 passed, 77 skipped (this machine cannot run buildah: not root, no apt to install it, or no
# namespaces), anything else failed.
#
#   sudo scripts/image_smoke.sh            # about 4 minutes on 2 idle cores
#
# Environment: DEBIAN_MIRROR (default http://deb.debian.org/debian), SMOKE_TMPDIR (parent of the work folder,
# default /var/tmp), SMOKE_KEEP=1 keeps the work folder and images, SMOKE_PYTHON (the pip that builds the
# wheelhouse), SMOKE_DEMO=1 (above).
set -Eeuo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PREFIX=SMOKE
BASE_TAG=localhost/sentinel-smoke-base:bookworm
IMAGE_TAG=localhost/sentinel-node:cpu-smoke
TORCH_VERSION=2.13.0
# shellcheck source=scripts/image_lib.sh
source "$REPO/scripts/image_lib.sh"
trap 'say "FAIL at line $LINENO: $BASH_COMMAND"' ERR

# --- 0. can this machine run buildah at all? ---------------------------------------------------------------------
need_buildah
started=$SECONDS
start_work sentinel-image-smoke

# --- 1. the base image: a minimal Debian bookworm (mmdebstrap) -----------------------------------------------------
make_base "$BASE_TAG" python3,python3-venv,ca-certificates

# --- 2. the wheelhouse: what the image installs, from this machine's pip (its local wheels and caches) ----------
t=$SECONDS
py="${SMOKE_PYTHON:-}"
if [ -z "$py" ]; then
    if [ -x "$REPO/.venv/bin/python" ]; then py="$REPO/.venv/bin/python"; else py="$(command -v python3 || true)"; fi
fi
wheels_args=()
if [ -n "$py" ] && "$py" -c 'import sys, platform; sys.exit(sys.version_info[:2] != (3, 11)
        or platform.machine() != "x86_64" or platform.libc_ver()[0] != "glibc")' 2>/dev/null; then
    mkdir -p "$WORK/wheels"
    "$py" -c 'import sys, tomllib; print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]))' \
        "$REPO/pyproject.toml" >"$WORK/requirements.txt"
    # the CPU build of torch: a wheel pip finds offline (its find-links), else one from PyTorch's CPU index
    torch_req="torch==$TORCH_VERSION+cpu"
    "$py" -m pip download --quiet --no-deps --no-index --dest "$WORK/wheels" "$torch_req" >"$WORK/wheels.log" 2>&1 ||
        "$py" -m pip download --quiet --no-deps --timeout 30 --retries 1 --dest "$WORK/wheels" \
            --index-url https://download.pytorch.org/whl/cpu "$torch_req" >>"$WORK/wheels.log" 2>&1 || {
        tail -20 "$WORK/wheels.log"
        fail "no $torch_req wheel: not on this machine, and PyTorch's CPU index did not answer"
    }
    # the rest, from pip's indexes (hivemind from its wheel; sdists are built into wheels here)
    "$py" -m pip wheel --quiet --wheel-dir "$WORK/wheels" --find-links "$WORK/wheels" --only-binary hivemind,torch \
        "$torch_req" -r "$WORK/requirements.txt" "setuptools>=77" wheel >>"$WORK/wheels.log" 2>&1 || {
        tail -20 "$WORK/wheels.log"
        fail "could not build the wheelhouse with $py"
    }
    wheels_args=(--volume "$WORK/wheels:/wheels:ro" --build-arg WHEELS=/wheels)
    say "time wheelhouse=$((SECONDS - t))s ($(find "$WORK/wheels" -name '*.whl' | wc -l) wheels, $(du -sh "$WORK/wheels" | cut -f1))"
else
    say "no Python 3.11 on x86_64 glibc here to build a wheelhouse with: the build downloads from the indexes"
fi

# --- 3. the build: the Dockerfile's cpu variant ---------------------------------------------------------------------
t=$SECONDS
"${B[@]}" bud --isolation chroot --pull=never --layers=false \
    --build-arg VARIANT=cpu --build-arg BASE_IMAGE="$BASE_TAG" "${wheels_args[@]}" \
    --tag "$IMAGE_TAG" --file "$REPO/Dockerfile" "$REPO" >"$WORK/build.log" 2>&1 || {
    tail -40 "$WORK/build.log"
    fail "buildah bud failed"
}
grep -E '^torch [0-9]' "$WORK/build.log" | sed 's/^/SMOKE build: /'
grep -E '^bytecode for ' "$WORK/build.log" | sed 's/^/SMOKE build: /'
size="$("${B[@]}" images --format '{{.Size}}' "$IMAGE_TAG")"
say "time build=$((SECONDS - t))s (image $IMAGE_TAG, $size)"

# --- 4. the image's config and a run of it --------------------------------------------------------------------------
check_config "$IMAGE_TAG"

t=$SECONDS
ctr="$("${B[@]}" from --pull=never "$IMAGE_TAG")"
run() { "${B[@]}" run --isolation chroot "$ctr" -- "$@"; }
say "run id: $(run id -un):$(run id -gn), HOME=$(run sh -c 'echo $HOME'), data owned by $(run stat -c %U /data)"
run python -c 'import torch, hivemind; print("SMOKE run versions: torch", torch.__version__, "hivemind",
    hivemind.__version__, "cuda", torch.version.cuda)'
# the image compiles only what the commands import (scripts/compile_imports.py): a node's imports must all be there,
# or every container start compiles them again (its user cannot write to the venv)
bytecode="$(run python /opt/sentinel-node/scripts/compile_imports.py --check)" ||
    fail "modules a node imports have no bytecode in the image (scripts/compile_imports.py): $bytecode"
say "run $bytecode"
help="$(run sentinel-node --help)" || fail "sentinel-node --help failed"
for command in join demo simulate swarm bench; do
    grep -qE "^  $command " <<<"$help" || fail "sentinel-node --help lists no '$command': $help"
done
say "run help: sentinel-node --help lists join, demo, simulate, swarm, bench"
run sentinel-node join --help | grep -q -- '--initial-peers' || fail "join --help has no --initial-peers"

# docker-compose.yml's wiring, run from the compose file itself: its bootstrap and its verifier0, each in a
# container of the image with their own /data and a shared /swarm. The verifier starts first and waits for
# /swarm/initial-peers, which the bootstrap's entry point writes from what it prints; then `swarm status` (the
# compose file's own example) must find both in the DHT, and both serve metrics. buildah run shares this machine's
# network namespace, so the compose ports 31337 and 9400 are swapped for free ones.
read -r boot_p2p boot_metrics verifier_p2p verifier_metrics < <(free_ports 4)
mapfile -d '' -t boot_argv < <(compose_argv "$ctr" bootstrap "$boot_p2p" "$boot_metrics")
mapfile -d '' -t verifier_argv < <(compose_argv "$ctr" verifier0 "$verifier_p2p" "$verifier_metrics")
[ "${#boot_argv[@]}" -gt 4 ] && [ "${#verifier_argv[@]}" -gt 4 ] || fail "cannot read docker-compose.yml's services"
mkdir -p "$WORK/swarm"
chown "$(run id -u)" "$WORK/swarm"
c=$SECONDS
start_node "$IMAGE_TAG" verifier "${verifier_argv[@]}"
wait_for 30 grep -q "waiting for the bootstrap" "$WORK/verifier.out" || {
    node_log verifier
    fail "the compose verifier did not wait for the bootstrap"
}
start_node "$IMAGE_TAG" bootstrap "${boot_argv[@]}"
wait_for 120 test -s "$WORK/swarm/initial-peers" || {
    node_log bootstrap
    fail "the compose bootstrap wrote no /swarm/initial-peers"
}
say "compose initial-peers: $(cat "$WORK/swarm/initial-peers")"
wait_for 120 grep -q " is up" "$WORK/verifier.out" || {
    node_log verifier
    fail "the compose verifier did not join"
}
boot_id="$(awk '/^node .* is up/ {print $2; exit}' "$WORK/bootstrap.out")"
verifier_id="$(awk '/^node .* is up/ {print $2; exit}' "$WORK/verifier.out")"
say "compose nodes up ($((SECONDS - c))s): bootstrap $boot_id, verifier $verifier_id"
status_ctr="$("${B[@]}" from --pull=never --name smoke-status "$IMAGE_TAG")"
status_ok() {
    "${B[@]}" run --isolation chroot -v "$WORK/swarm:/swarm" "$status_ctr" -- \
        sh -c 'sentinel-node swarm status --json --initial-peers "$(cat /swarm/initial-peers)"' \
        >"$WORK/status.json" 2>"$WORK/status.err" &&
        python3 - "$WORK/status.json" "$boot_id" "$verifier_id" <<'EOF'
import json, sys
status, boot, verifier = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3]
bootstraps = {a["peer_id"]: a["state"] for a in status["bootstraps"]}
verifiers = {a["peer_id"]: a["state"] for a in status["verifiers"]}
sys.exit(not (bootstraps.get(boot) == "online" and verifiers.get(verifier) == "online"))
EOF
}
wait_for 60 status_ok || {
    cat "$WORK/status.json" "$WORK/status.err"
    fail "swarm status does not list the compose bootstrap and verifier online"
}
say "compose swarm status: bootstrap $boot_id online, verifier $verifier_id online"
for port in "$boot_metrics" "$verifier_metrics"; do
    python3 -c 'import sys, urllib.request
text = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics", timeout=10).read().decode()
print("SMOKE compose metrics:", next(line for line in text.splitlines() if line.startswith("sentinel_node_info")))' \
        "$port" || fail "no metrics on port $port"
done
stop_nodes
say "time compose=$((SECONDS - c))s"

if [ "${SMOKE_DEMO:-0}" = 1 ]; then
    # A whole swarm inside one container: the demo's bootstrap, stages, verifiers and trainer, two steps (60-90 s).
    d=$SECONDS
    demo_json="$(run timeout 300 sentinel-node demo --steps 2 --attack none --json 2>"$WORK/demo.err")" || {
        tail -40 "$WORK/demo.err"
        fail "sentinel-node demo inside the image failed"
    }
    say "run demo ($((SECONDS - d))s): $demo_json"
    python3 - "$demo_json" <<'EOF' || fail "the demo's summary is not what a healthy two-step run gives"
import json, math, sys
s = json.loads(sys.argv[1].strip().splitlines()[-1])
mb = s["microbatches"]
ok = (
    s["steps"] == 2
    and math.isfinite(s["first_loss"]) and math.isfinite(s["last_loss"])
    and mb["succeeded"] > 0 and mb["failed"] == 0 and mb["consistent"]
    and s["excluded"] == [] and s["honest_excluded"] == []
    and s["verifier_checks"] > 0
)
print(f"SMOKE demo checked: steps={s['steps']} loss {s['first_loss']} -> {s['last_loss']}, "
      f"microbatches {mb['succeeded']}/{mb['sent']} succeeded, verifier checks {s['verifier_checks']}")
sys.exit(not ok)
EOF
fi
say "time run=$((SECONDS - t))s"
say "OK total=$((SECONDS - started))s"
