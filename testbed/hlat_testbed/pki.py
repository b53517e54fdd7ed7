"""Certificates, keys and kubeconfigs for one local cluster.

Every component authenticates as Kubernetes expects it to, so RBAC and the Node authorizer
apply to the rig exactly as on a real cluster:

- one CA signs the API server's serving certificate and every client certificate;
- the admin is in ``system:masters``; the scheduler and controller manager use their
  well-known user names (bound by the API server's bootstrap RBAC);
- each node's kubelet is ``system:node:<name>`` in ``system:nodes``, so the Node authorizer and
  the NodeRestriction admission plugin limit it to its own Node, Lease and pods;
- CoreDNS is an ordinary user bound to a small ClusterRole (see ``bootstrap.py``);
- a separate RSA key signs service-account tokens (the API server's TokenRequest).

ECDSA P-256 keys keep generation fast; the service-account key is RSA (RS256, what every
token consumer accepts).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from hlat_testbed.config import K8S_CLUSTER_DOMAIN, SERVICE_CIDR, ClusterConfig

_VALIDITY = dt.timedelta(days=365)

PrivateKey = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey


@dataclass(frozen=True)
class Identity:
    """A client identity: its user name and groups become the certificate's CN and O."""

    name: str
    user: str
    groups: tuple[str, ...] = ()


ADMIN = Identity("admin", "hlat-admin", ("system:masters",))
SCHEDULER = Identity("scheduler", "system:kube-scheduler")
CONTROLLER_MANAGER = Identity("controller-manager", "system:kube-controller-manager")
COREDNS = Identity("coredns", "hlat:coredns")


def node_identity(node: str) -> Identity:
    return Identity(f"node-{node}", f"system:node:{node}", ("system:nodes",))


def _pem_key(key: PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    path.chmod(0o600)


def _name(cn: str, orgs: tuple[str, ...] = ()) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs]
    return x509.Name([*attrs, x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _builder(subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey
             ) -> x509.CertificateBuilder:
    now = dt.datetime.now(dt.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + _VALIDITY)
    )


def self_signed_loopback(directory: Path, common_name: str) -> None:
    """`tls.crt`/`tls.key` in `directory`, self-signed, for a server on 127.0.0.1 or localhost
    (a component's webhook or metrics endpoint on the rig); kept when both are present."""
    crt, key_path = directory / "tls.crt", directory / "tls.key"
    if crt.exists() and key_path.exists():
        return
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name(common_name)
    sans = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (_builder(name, name, key.public_key())
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .sign(key, hashes.SHA256()))
    _write(key_path, _pem_key(key))
    crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


class CertificateAuthority:
    """The cluster CA, loaded from or created in ``pki_dir``."""

    def __init__(self, pki_dir: Path) -> None:
        self.dir = pki_dir
        self.cert_path = pki_dir / "ca.crt"
        key_path = pki_dir / "ca.key"
        if self.cert_path.exists():
            loaded = serialization.load_pem_private_key(key_path.read_bytes(), None)
            assert isinstance(loaded, ec.EllipticCurvePrivateKey)
            self.key = loaded
            self.cert = x509.load_pem_x509_certificate(self.cert_path.read_bytes())
            return
        self.key = ec.generate_private_key(ec.SECP256R1())
        name = _name("hlat-local-ca")
        self.cert = (
            _builder(name, name, self.key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False,
                                         False), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        _write(key_path, _pem_key(self.key))
        _write(self.cert_path, self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, stem: str, subject: x509.Name, *, server_sans: list[x509.GeneralName]
              | None = None) -> tuple[Path, Path]:
        """Write ``<stem>.crt``/``<stem>.key`` (a client cert, or a server cert with SANs)."""
        crt, key_path = self.dir / f"{stem}.crt", self.dir / f"{stem}.key"
        if crt.exists() and key_path.exists():
            return crt, key_path
        key = ec.generate_private_key(ec.SECP256R1())
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server_sans else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = _builder(subject, self.cert.subject, key.public_key()).add_extension(
            x509.ExtendedKeyUsage([usage]), critical=False
        )
        if server_sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(server_sans), False)
        cert = builder.sign(self.key, hashes.SHA256())
        _write(key_path, _pem_key(key))
        _write(crt, cert.public_bytes(serialization.Encoding.PEM))
        return crt, key_path


def api_server_sans(config: ClusterConfig) -> list[x509.GeneralName]:
    """Every name a client may use for the API server: bridge address, service IP, DNS names."""
    service_ip = ipaddress.IPv4Network(SERVICE_CIDR).network_address + 1
    ips = [config.host_ip, "127.0.0.1", str(service_ip)]
    dns = ["localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
           f"kubernetes.default.svc.{K8S_CLUSTER_DOMAIN}"]
    return [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips] + [x509.DNSName(d)
                                                                         for d in dns]


def write_kubeconfig(path: Path, server: str, ca: Path, user: str, *, cert: Path | None = None,
                     key: Path | None = None, token: str | None = None,
                     namespace: str = "default") -> Path:
    """A one-context kubeconfig that authenticates with a client certificate or a token."""
    credentials: dict[str, str] = (
        {"token": token} if token else {"client-certificate": str(cert), "client-key": str(key)}
    )
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "hlat", "cluster": {"server": server,
                                                  "certificate-authority": str(ca)}}],
        "users": [{"name": user, "user": credentials}],
        "contexts": [{"name": "hlat", "context": {"cluster": "hlat", "user": user,
                                                  "namespace": namespace}}],
        "current-context": "hlat",
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    path.chmod(0o600)
    return path


def client_kubeconfig(config: ClusterConfig, identity: Identity) -> Path:
    """Issue (or reuse) ``identity``'s client certificate and write its kubeconfig."""
    ca = CertificateAuthority(config.pki_dir)
    crt, key = ca.issue(identity.name, _name(identity.user, identity.groups))
    return write_kubeconfig(config.kubeconfig(identity.name), config.api_url, ca.cert_path,
                            identity.user, cert=crt, key=key)


def ensure_service_account_key(pki_dir: Path) -> tuple[Path, Path]:
    """The RSA key pair that signs and verifies service-account tokens."""
    key_path, pub_path = pki_dir / "sa.key", pki_dir / "sa.pub"
    if not key_path.exists():
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        _write(key_path, _pem_key(key))
        _write(pub_path, key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return key_path, pub_path


def ensure_pki(config: ClusterConfig) -> None:
    """Create the CA, the API server's serving cert, the SA key and every fixed identity."""
    ca = CertificateAuthority(config.pki_dir)
    ca.issue("apiserver", _name("kube-apiserver"), server_sans=api_server_sans(config))
    ensure_service_account_key(config.pki_dir)
    for identity in (ADMIN, SCHEDULER, CONTROLLER_MANAGER, COREDNS):
        client_kubeconfig(config, identity)
    config.admin_kubeconfig.write_text(config.kubeconfig(ADMIN.name).read_text())
    config.admin_kubeconfig.chmod(0o600)
