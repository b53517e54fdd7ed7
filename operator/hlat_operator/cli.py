"""`hlat-operator`: run the PretrainJob operator (kopf underneath) until SIGTERM/SIGINT.

    hlat-operator [--namespace NS ...| --all-namespaces] [--liveness URL] [--metrics-port P]

Credentials: in a pod, its service account; elsewhere `$KUBECONFIG` (the local rig:
`export KUBECONFIG=$(hlat-cluster kubeconfig --operator)`). Settings come from
`HLAT_OPERATOR_*` (see config.py); the flags override the namespace and the ports. Logs go to
stderr. `--namespace` may repeat and takes globs (`'test-*'`), as kopf does.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from hlat_operator.config import OperatorSettings, SettingsError


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="hlat-operator", description=__doc__.splitlines()[0])
    where = p.add_mutually_exclusive_group()
    where.add_argument("-n", "--namespace", action="append", default=None,
                       help="watch only this namespace (repeatable; globs allowed)")
    where.add_argument("-A", "--all-namespaces", action="store_true",
                       help="watch every namespace (the default unless "
                            "HLAT_OPERATOR_NAMESPACE is set)")
    p.add_argument("--liveness", default=None, metavar="URL",
                   help="liveness endpoint, e.g. http://0.0.0.0:8081/healthz "
                        "(default: that, on HLAT_OPERATOR_LIVENESS_PORT; 'none' disables)")
    p.add_argument("--metrics-port", type=int, default=None, metavar="P",
                   help="Prometheus port (default HLAT_OPERATOR_METRICS_PORT; 0 disables)")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return p.parse_args(list(sys.argv[1:] if argv is None else argv))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for noisy in ("kubernetes", "urllib3", "aiohttp.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if not args.verbose:
        logging.getLogger("kopf").setLevel(logging.WARNING)
    try:
        settings = OperatorSettings.from_env()
    except SettingsError as err:
        print(f"hlat-operator: {err}", file=sys.stderr)
        return 2
    namespaces: list[str] = []
    if args.namespace:
        namespaces = list(args.namespace)
    elif settings.namespace and not args.all_namespaces:
        namespaces = [n.strip() for n in settings.namespace.split(",") if n.strip()]
    if len(namespaces) == 1 and not any(c in namespaces[0] for c in "*?[!"):
        settings = settings.model_copy(update={"namespace": namespaces[0]})
    liveness = args.liveness
    if liveness is None:
        liveness = f"http://0.0.0.0:{settings.liveness_port}/healthz"
    elif liveness.lower() in ("", "none", "off"):
        liveness = None

    import kopf

    from hlat_operator import handlers, late_apis

    if settings.leader_election:
        lead(settings, liveness)
    insights = late_apis.insights()  # kopf's record of what it watches, read by late_apis
    handlers.configure(settings, args.metrics_port, insights, namespaces)
    kopf.run(
        insights=insights,
        standalone=True,
        clusterwide=not namespaces,
        namespaces=namespaces,
        liveness_endpoint=liveness,
    )
    return 0


def lead(settings: OperatorSettings, liveness: str | None) -> None:
    """Wait until this replica holds the leader Lease (answering liveness probes meanwhile),
    then keep renewing it; losing it ends the process at once (fencing: the Deployment
    restarts it as a standby)."""
    import os
    import socket
    import uuid

    from hlat_operator.handlers import api_client
    from hlat_operator.leader import Elector

    identity = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    elector = Elector(api_client(), settings.leader_election_namespace,
                      settings.leader_election_name, identity,
                      settings.leader_lease_seconds, settings.leader_renew_deadline_seconds,
                      settings.leader_retry_seconds)
    logging.getLogger("hlat_operator").info(
        "%s: standby until it holds the Lease %s/%s", identity,
        settings.leader_election_namespace, settings.leader_election_name)
    with _Healthz(liveness):
        elector.acquire()
    elector.keep(on_lost=lambda: os._exit(1))


class _Healthz:
    """A /healthz answering 200 while a standby waits (kopf serves it once leading)."""

    def __init__(self, url: str | None) -> None:
        from http.server import HTTPServer

        self.url = url
        self.server: HTTPServer | None = None

    def __enter__(self) -> _Healthz:
        if not self.url:
            return self
        import threading
        from http.server import BaseHTTPRequestHandler, HTTPServer
        from urllib.parse import urlparse

        where = urlparse(self.url)

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b'{"standby": true}')

            def log_message(self, *_: object) -> None:
                return

        self.server = HTTPServer((where.hostname or "0.0.0.0", where.port or 80), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *_: object) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


if __name__ == "__main__":
    sys.exit(main())
