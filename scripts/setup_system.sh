#!/usr/bin/env bash
# System packages that the code_exec reward's sandbox needs (docs/rewards.md, "What it needs from the host"), and
# the browser of the viewer's tests:
#   bubblewrap  - builds the namespaces (user, PID, mount, network, ...) for every program
#   libseccomp2 - compiles the seccomp filter (loaded through ctypes; no Python binding needed)
#   python3     - a system interpreter with ctypes that an unprivileged sandbox user can run (a pyenv or venv
#                 interpreter under /root is not readable by it)
#   chromium    - headless Chromium for the trajectory viewer's browser tests (tests/integration/
#                 test_viewer_browser.py drives it with --dump-dom and --screenshot; docs/viewer.md)
#   fonts-dejavu-core - a font for its screenshots
# Idempotent: installs only what is missing, with one `apt-get update` at most. Run as root (or with sudo).
set -euo pipefail

need=()
command -v bwrap >/dev/null 2>&1 || need+=(bubblewrap)
{ ldconfig -p 2>/dev/null | grep 'libseccomp\.so\.2' >/dev/null; } || need+=(libseccomp2)  # no -q: an early exit would fail the pipe (pipefail)
{ command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; } || need+=(chromium)
[ -e /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || need+=(fonts-dejavu-core)
{ [ -x /usr/bin/python3 ] && /usr/bin/python3 -c 'import ctypes, json, resource' 2>/dev/null; } || need+=(python3)

if [ ${#need[@]} -gt 0 ]; then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    echo "setup_system: installing ${need[*]}"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# bubblewrap runs as an unprivileged uid, so the kernel must allow it user namespaces. As root, code_exec falls
# back to running bubblewrap as root (each program still drops to its own uid); without root it refuses to start.
as_user=()
[ "$(id -u)" -ne 0 ] || as_user=(setpriv --reuid 65534 --regid 65534 --clear-groups)
if ! (cd / && "${as_user[@]}" bwrap --unshare-all --ro-bind / / --proc /proc --dev /dev true) 2>/dev/null; then
    echo "setup_system: note: unprivileged user namespaces are off here (sysctl kernel.unprivileged_userns_clone," \
         "user.max_user_namespaces); code_exec works as root only" >&2
fi
