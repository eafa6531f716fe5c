"""A `pd-prefill` / `pd-decode` launcher run as a child process (the tiny model), and the line
it prints once it listens. (Re-exported by node_harness.)"""

from __future__ import annotations

import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

MODEL = "synthetic:tiny-llama"  # 2 layers, vocab 512, eos 2

LISTENING = re.compile(r"^(pd-\w+) listening on (\S+):(\d+) \(kv (\S+)\)$")
LAUNCH_TIMEOUT_S = 120.0


@dataclass
class NodeProcess:
    """A `pd-prefill` / `pd-decode` launcher run as a child process, and its listening line."""

    process: subprocess.Popen
    match: re.Match

    @classmethod
    def launch(cls, module: str, *flags: str) -> NodeProcess:
        """Run `python -m module` with the tiny model; return once it printed its line."""
        argv = [sys.executable, "-m", module, "--model", MODEL, "--device", "cpu"]
        argv += ["--dtype", "float32", "--num-kv-blocks", "16", "--log-level", "warning", *flags]
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        with ThreadPoolExecutor(1) as pool:
            line = pool.submit(process.stdout.readline).result(timeout=LAUNCH_TIMEOUT_S)
        match = LISTENING.match(line.rstrip("\n"))
        if match is None:
            process.kill()
            raise AssertionError(f"{module} printed {line!r}; stderr: {process.stderr.read()}")
        return cls(process, match)

    @property
    def address(self) -> str:
        return f"{self.match[2]}:{self.match[3]}"

    def stop(self, signum: int) -> tuple[int, str]:
        """Send `signum`; the exit code and whatever else it printed to stdout."""
        self.process.send_signal(signum)
        try:
            out, _ = self.process.communicate(timeout=LAUNCH_TIMEOUT_S)
        finally:
            if self.process.poll() is None:
                self.process.kill()
        return self.process.returncode, out
