"""Shared fixtures for the tokenizer and chat-template parity suites.

The C++ side is driven through build/bin/pd_tokenizer_cli (JSON lines on stdin/stdout); the
references are HF transformers / jinja2 in this process."""
import json
import os
import pathlib
import subprocess

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
ASSETS = REPO / "assets" / "tokenizers"
BIN_DIR = pathlib.Path(os.environ.get("PDSERVE_BIN_DIR", "/work/main/build/bin"))


class TokenizerCli:
    """One pd_tokenizer_cli process; ask() sends a request and waits for its one-line answer."""

    def __init__(self, *args):
        exe = BIN_DIR / "pd_tokenizer_cli"
        if not exe.exists():
            pytest.fail(f"{exe} not built (set PDSERVE_BIN_DIR)")
        self.proc = subprocess.Popen(
            [str(exe), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            encoding="utf-8",
        )
        ready = self.proc.stdout.readline()
        if not ready:
            err = self.proc.stderr.read()
            self.close()
            raise RuntimeError(f"pd_tokenizer_cli {args} failed to start: {err}")
        assert json.loads(ready) == {"ready": True}

    def ask(self, request):
        self.proc.stdin.write(json.dumps(request, ensure_ascii=False) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"pd_tokenizer_cli died (rc={self.proc.poll()}): {self.proc.stderr.read()}")
        return json.loads(line)

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except Exception:
                self.proc.kill()
                self.proc.wait(timeout=10)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream and not stream.closed:
                stream.close()


@pytest.fixture
def cli_factory():
    started = []

    def start(*args):
        cli = TokenizerCli(*args)
        started.append(cli)
        return cli

    yield start
    for cli in started:
        cli.close()
