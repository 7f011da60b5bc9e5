"""The developer command: `python -m e2e.controlplane up|down|status|env` (see the package
docstring). `up` leaves the control plane running in the background; the others attach to it
through its state.json."""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import e2e.controlplane as package  # its docstring is the command's description

from .binaries import cache_dir
from .cluster import ControlPlane
from .errors import ControlPlaneError


def dev_state_dir() -> Path:
    return cache_dir() / "dev-cluster"


def _cmd_up(args: argparse.Namespace) -> int:
    state = Path(args.state_dir)
    if (state / "state.json").exists():
        cp = ControlPlane.attach(state)
        if cp.healthy():
            print(f"# already running ({cp.server}); state in {state}", file=sys.stderr)
            print(f"export KUBECONFIG={cp.kubeconfig}")
            return 0
        print(f"# stale control plane in {state}: stopping what is left and starting afresh",
              file=sys.stderr)
        cp.stop()
    if state.exists():
        shutil.rmtree(state)
    cp = ControlPlane(state, kwok=not args.no_kwok, kuberay=not args.no_kuberay,
                      kueue=args.kueue, die_with_parent=False)
    try:
        cp.start()
    except ControlPlaneError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    t = cp.timings
    print(f"# control plane up in {t['start_total']:.1f}s: "
          + ", ".join(f"{k} {v:.1f}s" for k, v in t.items() if k != "start_total"),
          file=sys.stderr)
    if cp.fake_nodes:
        print(f"# fake nodes: {', '.join(cp.fake_nodes)}", file=sys.stderr)
    print(f"# logs: {cp.logs_dir}; stop with: python -m e2e.controlplane down", file=sys.stderr)
    print(f"export KUBECONFIG={cp.kubeconfig}")
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    state = Path(args.state_dir)
    if not (state / "state.json").exists():
        print(f"# nothing running in {state}", file=sys.stderr)
        return 0
    cp = ControlPlane.attach(state)
    cp.stop()
    if not args.keep:
        shutil.rmtree(state, ignore_errors=True)
    print(f"# stopped{'' if args.keep else ' and removed'} {state}", file=sys.stderr)
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    state = Path(args.state_dir)
    if not (state / "state.json").exists():
        print(f"not running (no {state / 'state.json'})")
        return 1
    cp = ControlPlane.attach(state)
    for name, proc in cp.processes.items():
        print(f"{name:26} pid {proc.pid:<8} {'running' if proc.alive() else 'DEAD':8} {proc.log}")
    ok = cp.healthy()
    print(f"kube-apiserver {cp.server}: {'ready' if ok else 'NOT READY'}")
    print(f"export KUBECONFIG={cp.kubeconfig}")
    return 0 if ok else 1


def _cmd_env(args: argparse.Namespace) -> int:
    print(f"export KUBECONFIG={Path(args.state_dir) / 'kubeconfig'}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.controlplane",
                                     description=package.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--state-dir", default=str(dev_state_dir()),
                        help="where the dev control plane keeps its state (default: %(default)s)")
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start in the background; prints the KUBECONFIG to export")
    up.add_argument("--no-kwok", action="store_true", help="no kwok and no fake nodes")
    up.add_argument("--no-kuberay", action="store_true", help="no KubeRay operator")
    up.add_argument("--kueue", action="store_true", help="also Kueue (framework ray.io/rayjob)")
    up.set_defaults(fn=_cmd_up)
    down = sub.add_parser("down", help="stop it (by PID) and remove its state")
    down.add_argument("--keep", action="store_true", help="keep the state dir and logs")
    down.set_defaults(fn=_cmd_down)
    sub.add_parser("status", help="show processes and readiness").set_defaults(fn=_cmd_status)
    sub.add_parser("env", help="print the export line").set_defaults(fn=_cmd_env)
    args = parser.parse_args(argv)
    return args.fn(args)
