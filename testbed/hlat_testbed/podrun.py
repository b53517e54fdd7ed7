"""The last step before a container's process runs: mounts, hostname, working dir, exec.

The kubelet starts ``ip netns exec <pod-ns> unshare --mount --uts --propagation private
python podrun.py <spec.json>``: by the time this runs it is inside the pod's network namespace
(with the pod's resolv.conf and hosts bound over /etc by ``ip netns exec``) and in private mount
and UTS namespaces. It mounts the cgroup file systems at /sys/fs/cgroup read-only (``ip netns
exec`` remounted /sys without them), as a runtime does, in the host's cgroup namespace (a
runtime's default on a cgroup v1 or hybrid host; a private namespace cost a spare takeover 3.5 s
in `bench_recovery`, cause not found). It bind-mounts each volume at its ``mountPath`` (so paths match what the
pod would see on EKS), sets the pod's hostname, and ``exec``s the command, so the pid the kubelet
holds is the container's main process and its exit status is the container's.

Deliberately standard library only and run as a script, not a module: it costs a few
milliseconds per container. Mount points that do not exist are created on the host file
system (mounts are private to the pod; the empty directories are not).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path


def _mount(source: str, target: str, read_only: bool) -> None:
    target_path = Path(target)
    if Path(source).is_dir():
        target_path.mkdir(parents=True, exist_ok=True)
    else:
        target_path.parent.mkdir(parents=True, exist_ok=True)
        target_path.touch(exist_ok=True)
    subprocess.run(["mount", "--bind", source, target], check=True)
    if read_only:
        subprocess.run(["mount", "-o", "remount,bind,ro", target], check=True)


def _mount_cgroups(mounts: list[dict[str, str]]) -> None:
    """The container's view of its cgroups at /sys/fs/cgroup (``ip netns exec`` remounted /sys
    without them). Best effort: a container that cannot see its cgroups still runs (it cannot
    tell an OOM kill: say so)."""
    for m in mounts:
        try:
            Path(m["target"]).mkdir(parents=True, exist_ok=True)
            subprocess.run(["mount", "-t", m["fstype"], "-o", m["options"], m["fstype"],
                            m["target"]], check=True, capture_output=True)
        except (OSError, subprocess.CalledProcessError) as err:
            print(f"hlat podrun: {m['target']} not mounted ({err}); the container cannot "
                  "read its cgroups", file=sys.stderr)
            return


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    _mount_cgroups(spec.get("cgroupMounts", []))
    for mount in spec["mounts"]:
        _mount(mount["source"], mount["target"], mount["readOnly"])
    socket.sethostname(spec["hostname"])
    os.chdir(spec["workingDir"])
    argv: list[str] = spec["argv"]
    os.execvpe(argv[0], argv, spec["env"])


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    except (OSError, subprocess.CalledProcessError) as err:
        print(f"hlat podrun: cannot start container: {err}", file=sys.stderr)
        sys.exit(128)
