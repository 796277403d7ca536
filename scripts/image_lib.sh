# Helpers shared by scripts/image_smoke.sh (the cpu image) and scripts/image_cuda.sh (the cuda image): sourced, not
# run. Each builds the Dockerfile with buildah on a Debian base made by mmdebstrap, without a Docker engine or a
# container registry, in one temporary work folder that `cleanup` removes.
#
# The sourcing script sets PREFIX (the word its report lines start with, e.g. SMOKE) and REPO before sourcing, then
# calls: need_buildah, start_work NAME, make_base TAG PACKAGES, check_config IMAGE, and the node helpers below.
# Environment: DEBIAN_MIRROR (default http://deb.debian.org/debian), SMOKE_TMPDIR (parent of the work folder,
# default /var/tmp), SMOKE_KEEP=1 keeps the work folder and images.

MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
SKIP=77 # exit status: this machine cannot run buildah

say() { echo "$PREFIX $*"; }
skip() {
    say "SKIP $*"
    exit "$SKIP"
}
fail() {
    say "FAIL $*"
    exit 1
}

# need_buildah [PACKAGE...]: root, buildah and mmdebstrap (and the extra Debian packages), mount namespaces.
need_buildah() {
    [ "$(id -u)" = 0 ] || skip "not root: mmdebstrap and buildah's chroot isolation need root"
    local missing=() apt_started package
    command -v buildah >/dev/null || missing+=(buildah)
    command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
    for package in "$@"; do command -v "$package" >/dev/null || missing+=("$package"); done
    if [ "${#missing[@]}" -gt 0 ]; then
        command -v apt-get >/dev/null || skip "${missing[*]} missing and no apt-get to install them"
        say "installing ${missing[*]} with apt-get"
        apt_started=$SECONDS
        (   # one apt at a time: the suite's browser test may be installing chromium (scripts/ensure_chromium.sh)
            flock 9
            DEBIAN_FRONTEND=noninteractive apt-get update -qq
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
        ) 9>/tmp/sentinel-apt.lock
        say "time apt=$((SECONDS - apt_started))s"
    fi
    unshare --mount --uts --ipc true 2>/dev/null || skip "cannot create mount namespaces here (an unprivileged container?)"
}

node_groups=() # process groups of the nodes started in the image (start_node)
stop_nodes() {   # SIGTERM to each group (as Ctrl-C would), SIGKILL to what is left after 20 s
    local group i
    [ "${#node_groups[@]}" -gt 0 ] || return 0
    for group in "${node_groups[@]}"; do kill -TERM -- "-$group" 2>/dev/null || true; done
    for i in $(seq 20); do
        for group in "${node_groups[@]}"; do kill -0 -- "-$group" 2>/dev/null && break; done || break
        sleep 1
    done
    for group in "${node_groups[@]}"; do kill -KILL -- "-$group" 2>/dev/null || true; done
    node_groups=()
}

cleanup() {
    local rc=$?
    set +e
    stop_nodes
    if [ "${SMOKE_KEEP:-0}" = 1 ]; then
        say "kept $WORK: ${B[*]} images"
        exit "$rc"
    fi
    "${B[@]}" rm --all >/dev/null 2>&1
    "${B[@]}" rmi --all --force >/dev/null 2>&1
    # containers/storage may leave its overlay home (or a layer) mounted; unmount, innermost first
    awk -v w="$WORK/" 'index($2, w) == 1 {print $2}' /proc/mounts | sort -r | while read -r m; do umount -l "$m"; done
    rm -rf "$WORK"
    exit "$rc"
}

# start_work NAME: the work folder (WORK), buildah's storage in it (the command array B), cleanup on exit.
start_work() {
    WORK="$(mktemp -d "${SMOKE_TMPDIR:-/var/tmp}/$1.XXXXXX")"
    export TMPDIR="$WORK/tmp" # buildah's own scratch files (layer diffs) stay in the work folder too
    mkdir -p "$TMPDIR"
    local driver=vfs
    if grep -qw overlay /proc/filesystems 2>/dev/null || modprobe overlay 2>/dev/null; then driver=overlay; fi
    B=(buildah --root "$WORK/storage" --runroot "$WORK/run" --storage-driver "$driver")
    trap cleanup EXIT
    trap 'exit 130' INT TERM
    say "work folder $WORK, buildah $(buildah --version | awk '{print $3}'), storage driver $driver"
}

# make_base TAG PACKAGES: a minimal Debian bookworm with PACKAGES (comma-separated), imported as image TAG.
# mmdebstrap, not debootstrap: half the CPU time (34 against 73 CPU-s here, 36 against 63 s alone; debootstrap is a
# shell script that forks for every file it looks at), no apt caches or lists left in the image, and the root
# filesystem comes as a tar stream, unpacked straight into the image instead of into a folder copied in after.
make_base() {
    local tag=$1 packages=$2 t=$SECONDS ctr mnt
    ctr="$("${B[@]}" from scratch)"
    mnt="$("${B[@]}" mount "$ctr")"
    mmdebstrap --quiet --variant=minbase --include="$packages" bookworm - "$MIRROR" 2>"$WORK/mmdebstrap.log" |
        tar -C "$mnt" --numeric-owner -xf - || {
        tail -20 "$WORK/mmdebstrap.log"
        fail "mmdebstrap from $MIRROR failed"
    }
    "${B[@]}" umount "$ctr" >/dev/null
    "${B[@]}" config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --cmd /bin/bash "$ctr"
    "${B[@]}" commit --quiet --rm "$ctr" "$tag" >/dev/null
    say "time base=$((SECONDS - t))s (mmdebstrap, image $tag)"
}

# check_config IMAGE: the entry point, default command, user, workdir, volume and ports the Dockerfile documents.
check_config() {
    local config
    config="$("${B[@]}" inspect --type image "$1")"
    PREFIX="$PREFIX" python3 - "$config" <<'EOF' || fail "unexpected image config"
import json, os, sys
c = json.loads(sys.argv[1])["OCIv1"]["config"]
want = {
    "Entrypoint": ["sentinel-node"],
    "Cmd": ["--help"],
    "User": "sentinel",
    "WorkingDir": "/data",
    "Volumes": ["/data"],
    "ExposedPorts": ["31337/tcp", "9400/tcp"],
}
got = {k: sorted(c.get(k) or {}) if k in ("Volumes", "ExposedPorts") else c.get(k) for k in want}
for k, v in want.items():
    print(f"{os.environ['PREFIX']} config {k}={json.dumps(got[k])}")
sys.exit(got != want)
EOF
}

# free_ports N: N free TCP ports on loopback (buildah run shares this machine's network namespace).
free_ports() {
    python3 -c 'import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*[s.getsockname()[1] for s in socks])' "$1"
}

# compose_argv CTR SERVICE P2P_PORT METRICS_PORT: docker-compose.yml's entry point and command of SERVICE, read in
# container CTR (which has PyYAML), NUL-separated, with the ports 31337 and 9400 swapped for the given ones.
compose_argv() {
    local ctr=$1
    shift
    "${B[@]}" run --isolation chroot -v "$REPO/docker-compose.yml:/compose.yml:ro" "$ctr" -- python -c '
import sys, yaml
name, p2p, metrics = sys.argv[1:]
service = yaml.safe_load(open("/compose.yml"))["services"][name]
argv = [str(a).replace("$$", "$") for a in service["entrypoint"] + service["command"]]
argv = [metrics if a == "9400" else a.replace("/tcp/31337", f"/tcp/{p2p}") for a in argv]
sys.stdout.write("\0".join(argv))
' "$@"
}

# start_node IMAGE NAME ARGV...: a container of IMAGE running ARGV in the background, in its own process group,
# with $WORK/swarm as /swarm; its output goes to $WORK/NAME.out and .err.
start_node() {
    local image=$1 name=$2 node
    shift 2
    node="$("${B[@]}" from --pull=never --name "smoke-$name" "$image")"
    setsid "${B[@]}" run --isolation chroot -v "$WORK/swarm:/swarm" "$node" -- "$@" \
        >"$WORK/$name.out" 2>"$WORK/$name.err" </dev/null &
    node_groups+=("$!")
}

wait_for() { # SECONDS COMMAND...: until COMMAND succeeds
    local deadline=$((SECONDS + $1))
    shift
    until "$@"; do
        [ "$SECONDS" -lt "$deadline" ] || return 1
        sleep 1
    done
}

node_log() { # NAME: its stdout and the tail of its stderr, for a failure
    echo "--- $1 stdout"
    cat "$WORK/$1.out"
    echo "--- $1 stderr"
    tail -30 "$WORK/$1.err"
}
