"""A real S3 API server for tests: moto in server mode on 127.0.0.1, ephemeral port (installed by the test extra).

``S3Server().start()`` serves until ``stop()``; ``restart()`` serves again on the same port with the same
objects (moto keeps them in this process). ``env()`` is what a client (this process and forked ranks) needs:
s3fs/botocore read the endpoint and the dummy credentials from the environment, as on a real cluster.
"""
from __future__ import annotations

import uuid

import logging

from moto.server import ThreadedMotoServer

logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise


class S3Server:
    def __init__(self):
        self.port = 0
        self._server = None

    def start(self) -> "S3Server":
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()
        self.port = self._server._server.server_port
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.port}", "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_MAX_ATTEMPTS": "1"}  # botocore's own retries off: fsdp_plugin's bounded retries are tested


def new_bucket() -> str:
    """Create a fresh bucket on the server the environment points to; return ``s3://<name>``."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()  # a cached client may point at another test module's server
    name = f"t{uuid.uuid4().hex[:16]}"
    s3fs.S3FileSystem().mkdir(name)
    return f"s3://{name}"
