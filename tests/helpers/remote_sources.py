"""Real remote sources for the registry's fetch tests: moto's S3 server on a free port, and an
HTTPS server whose certificate a test CA signs (the fetcher trusts it through its ca_file)."""

import datetime
import ipaddress
import logging
import os
import ssl
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import boto3
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from moto.server import ThreadedMotoServer

from lorafleet.cli.infra import free_port

AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
TLS_NAMES = ("localhost", "models.test", "internal.test")
logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's request log


@dataclass(frozen=True, slots=True)
class SourceCA:
    ca_file: Path  # the PEM a fetcher trusts
    cert_file: Path  # the server's chain
    key_file: Path


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def make_ca(directory: Path, names: tuple[str, ...] = TLS_NAMES) -> SourceCA:
    """A CA and a server certificate it signs for ``names`` and 127.0.0.1."""
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("lorafleet test CA"))
        .issuer_name(_name("lorafleet test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    alt = [x509.DNSName(n) for n in names] + [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(names[0]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    (directory / "ca.pem").write_bytes(ca.public_bytes(pem))
    (directory / "server.pem").write_bytes(cert.public_bytes(pem))
    (directory / "server.key").write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return SourceCA(directory / "ca.pem", directory / "server.pem", directory / "server.key")


@dataclass
class Route:
    body: bytes = b""
    status: int = 200
    location: str | None = None  # a redirect's target
    drip_s: float | None = None  # send one byte per drip_s instead of the whole body
    burst: int = 0  # with drip_s: bytes sent at once before the drip begins
    etag: str | None = None
    unsized: bool = False  # no Content-Length: the body ends when the connection closes


class HttpsServer:
    """Serves ``routes`` (path -> Route) over TLS on 127.0.0.1; ``hits`` counts GETs per path."""

    def __init__(self, ca: SourceCA) -> None:
        self.routes: dict[str, Route] = {}
        self.hits: Counter[str] = Counter()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                server.hits[self.path] += 1
                route = server.routes.get(self.path, Route(status=404))
                self.send_response(route.status)
                if route.location is not None:
                    self.send_header("Location", route.location)
                if route.etag is not None:
                    self.send_header("ETag", route.etag)
                if not route.unsized:
                    self.send_header("Content-Length", str(len(route.body)))
                self.end_headers()
                try:
                    if route.drip_s is None:
                        self.wfile.write(route.body)
                        return
                    self.wfile.write(route.body[: route.burst])
                    self.wfile.flush()
                    for i in range(route.burst, len(route.body)):
                        self.wfile.write(route.body[i : i + 1])
                        self.wfile.flush()
                        time.sleep(route.drip_s)
                except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
                    return  # the fetcher gave up, as it should

            def log_message(self, format: str, *args: object) -> None:
                return None

        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(ca.cert_file, ca.key_file)
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._httpd.socket = context.wrap_socket(self._httpd.socket, server_side=True)
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def url(self, host: str = "localhost") -> str:
        return f"https://{host}:{self.port}"

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


class MotoS3:
    """moto's S3-compatible HTTP server, and a boto3 client of it to lay out buckets."""

    def __init__(self) -> None:
        self.port = free_port()
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.client = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=AWS_ENV["AWS_DEFAULT_REGION"],
            aws_access_key_id=AWS_ENV["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=AWS_ENV["AWS_SECRET_ACCESS_KEY"],
        )

    def put_dir(self, bucket: str, prefix: str, files: dict[str, bytes]) -> None:
        """Each file at ``<prefix><name>``, the bucket created when missing."""
        if bucket not in {b["Name"] for b in self.client.list_buckets()["Buckets"]}:
            self.client.create_bucket(Bucket=bucket)
        for name, data in files.items():
            self.client.put_object(Bucket=bucket, Key=f"{prefix}{name}", Body=data)

    def stop(self) -> None:
        self._server.stop()


@contextmanager
def aws_env() -> Iterator[None]:
    """The credentials botocore's chain finds in this process (moto accepts any)."""
    saved = {k: os.environ.get(k) for k in AWS_ENV}
    os.environ.update(AWS_ENV)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
