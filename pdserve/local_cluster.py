"""`pd-serve`: one command that runs a local pdserve cluster.

    pd-serve                      router on 127.0.0.1:50051 + 1 prefill + 1 decode node
    pd-serve --prefill 2 --decode 2
    pd-serve --prefill 0          colocated serving (decode nodes prefill locally)
    pd-serve --prefill-tp 2 --decode-tp 1    prefill nodes of 2 ranks (GPUs), decode of 1
    pd-serve --registry redis://127.0.0.1:6379/0 --policy prefix_aware

First it holds every fixed port it will use (the router's --port and --http-port, the nodes'
--metrics-port N + i): a taken one fails it at once, naming the port and the flag that moves
it (`pdserve.port_reservations`). Then it resolves the model (`python -m engine.model.prepare`:
a GGUF file is converted once into the shared cache, so the nodes only read it), starts the
decode nodes, then the prefill nodes (each on a free port; each prints the line
"pd-<role> listening on HOST:PORT ..."), then the router pointed at them (with --registry: the
nodes register there and the router discovers them); prints where the router listens. Each flag
goes, as given, to the processes it concerns (`pdserve.cli.forwarded_argv`: engine and node
flags to every node, routing flags to the router, common ones to both). Ctrl-C or SIGTERM stops
every process it started (SIGTERM, then SIGKILL after a grace period); if any of them dies, it
stops the rest and exits non-zero, saying how it ended (its exit code, or the signal that
killed it: SIGKILL is most often the kernel's out-of-memory killer). Torch-free: the nodes load
the model, not this process.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from pdserve.cli import (
    NODE,
    ROUTER,
    ArgumentParser,
    build_parser,
    forwarded_argv,
    setup_logging,
)
from pdserve.config import CacheConfig
from pdserve.engine_config import kv_cache_dtype_tp_refusal
from pdserve.node_placement import node_devices, num_gpus
from pdserve.port_reservations import PortReservations, PortTaken

_LISTENING = re.compile(r"listening on (\S+)")
_HTTP_URL = re.compile(r"\(http (\S+)\)")
WAIT_REPORT_S = 10.0  # how often pd-serve says what it is still waiting for
PREPARE_TIMEOUT_S = 1800.0  # a first start converts a GGUF model (seconds for the default one)
NODE_START_TIMEOUT_S = 600.0
STOP_GRACE_S = 15.0


@dataclass
class _Child:
    name: str
    process: subprocess.Popen[str]
    address: str | None = None
    http_url: str | None = None  # the router's HTTP API
    ready: threading.Event = field(default_factory=threading.Event)


def _pump(child: _Child) -> None:
    """Echo the child's stdout with its name; note its address from the listening line."""
    assert child.process.stdout is not None  # spawned with stdout=PIPE
    for line in child.process.stdout:
        if child.address is None and (match := _LISTENING.search(line)):
            child.address = match.group(1)
            if url := _HTTP_URL.search(line):
                child.http_url = url.group(1)
            child.ready.set()
        sys.stderr.write(f"[{child.name}] {line}")
    child.ready.set()  # EOF: it exited (address stays None)


def _node_argv(forwarded: list[str], gpu_share: int, metrics_port: int = 0) -> list[str]:
    """A node's argv: pd-serve's node flags as given, on a free port; a GPU shared by
    `gpu_share` nodes gives each that share of --gpu-memory-utilization; `metrics_port`
    (0: off) its own /metrics port."""
    argv = [*forwarded, "--port", "0", "--metrics-port", str(metrics_port)]
    if gpu_share > 1:
        utilization = CacheConfig.gpu_memory_utilization
        for i, token in enumerate(forwarded[:-1]):
            if token == "--gpu-memory-utilization":
                utilization = float(forwarded[i + 1])
        argv += ["--gpu-memory-utilization", str(utilization / gpu_share)]
    return argv


def _router_argv(
    forwarded: list[str],
    args: argparse.Namespace,
    prefill_addrs: list[str],
    decode_addrs: list[str],
) -> list[str]:
    """With a registry the router finds the nodes there; else it gets their addresses."""
    argv = [*forwarded, "--port", str(args.port)]
    if args.registry is None:
        for addr in prefill_addrs:
            argv += ["--prefill", addr]
        for addr in decode_addrs:
            argv += ["--decode", addr]
    return argv


def _client_command() -> str:
    """pd-client as this environment has it: `.venv/bin/pd-client` from the repository's root
    (the README's form), else its full path, else the bare name."""
    client = Path(sys.executable).parent / "pd-client"
    if not client.exists():
        return "pd-client"
    relative = os.path.relpath(client)
    return relative if not relative.startswith("..") else str(client)


def describe_exit(code: int) -> str:
    """How a child ended, from its `Popen.returncode`: "exited with code 2", or "killed by
    SIGKILL (out of memory?)" (a negative code: the signal's number)."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    hint = (
        " (out of memory? the kernel's OOM killer sends SIGKILL)" if -code == signal.SIGKILL else ""
    )
    return f"killed by {name}{hint}"


class LocalCluster:
    def __init__(
        self, args: argparse.Namespace, node_argv: list[str], router_argv: list[str]
    ) -> None:
        """`node_argv` / `router_argv`: the flags pd-serve forwards to each (as given)."""
        self.args = args
        self.node_argv = node_argv
        self.router_argv = router_argv
        self.children: list[_Child] = []
        self.router: _Child | None = None
        self.ports = PortReservations(args.host)

    def reserve_ports(self) -> None:
        """Hold every fixed port the cluster will use (PortTaken when one is in use)."""
        args, ports = self.args, self.ports
        ports.reserve(args.port, "the router's gRPC API", "--port N")
        ports.reserve(args.http_port, "the router's HTTP API", "--http-port N (0: off)")
        for slot in range(args.decode + args.prefill) if args.metrics_port else ():
            ports.reserve(
                args.metrics_port + slot, f"node {slot}'s /metrics (--metrics-port N gives node "
                "i the port N + i)", "another --metrics-port N (0: off)",
            )  # fmt: skip

    def _spawn(self, name: str, module: str, argv: list[str]) -> _Child:
        process = subprocess.Popen(
            [sys.executable, "-u", "-m", module, *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        child = _Child(name, process)
        self.children.append(child)
        threading.Thread(target=_pump, args=(child,), daemon=True).start()
        return child

    def _await_ready(self, children: list[_Child], what: str) -> list[str]:
        """Waits for each child's listening line, saying every WAIT_REPORT_S what for."""
        start_s = time.monotonic()
        deadline = start_s + NODE_START_TIMEOUT_S
        addresses: list[str] = []
        for child in children:
            while not child.ready.wait(min(WAIT_REPORT_S, max(0.0, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    break
                print(
                    f"pd-serve: waiting for {child.name} ({what}; "
                    f"{time.monotonic() - start_s:.0f} s so far)", file=sys.stderr, flush=True,
                )  # fmt: skip
            if child.address is None:
                code = child.process.poll()
                how = "still running" if code is None else describe_exit(code)
                raise RuntimeError(f"{child.name} did not start ({how}); see its log above")
            addresses.append(child.address)
        return addresses

    def _prepare_model(self) -> None:
        """Resolve the model in a child process (pd-serve stays torch-free; its progress and
        errors go to our stderr): a GGUF is converted once, before any node starts."""
        model = self.args.model
        if model.startswith("synthetic:"):
            return  # random weights: nothing to read or convert
        argv = [sys.executable, "-m", "engine.model.prepare", model]
        try:
            done = subprocess.run(argv, stdout=subprocess.DEVNULL, timeout=PREPARE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"preparing {model} took over {PREPARE_TIMEOUT_S:g} s") from None
        if done.returncode != 0:
            raise RuntimeError(f"cannot load the model {model!r} (see the line above)")

    def start(self) -> str:
        args = self.args
        self._prepare_model()
        roles = [("decode", i) for i in range(args.decode)] + [
            ("prefill", i) for i in range(args.prefill)
        ]
        tp = {"prefill": args.prefill_tp or args.tensor_parallel_size,
              "decode": args.decode_tp or args.tensor_parallel_size}  # fmt: skip
        devices, share = node_devices(args.device, args.prefill, args.decode, num_gpus(),
                                      tp["prefill"], tp["decode"])  # fmt: skip
        started: dict[str, list[_Child]] = {"decode": [], "prefill": []}
        if args.metrics_port:  # the nodes bind them now
            self.ports.release(args.metrics_port + slot for slot in range(len(roles)))
        for slot, (role, index) in enumerate(roles):  # decode first: tickets come from them
            metrics_port = args.metrics_port + slot if args.metrics_port else 0
            argv = _node_argv(self.node_argv, share, metrics_port)
            argv += ["--tensor-parallel-size", str(tp[role])]  # (the last one given wins)
            if devices is not None:  # every listed GPU stays visible (cuda_ipc maps peers)
                flag = "--device" if tp[role] == 1 else "--devices"
                argv += [flag, devices[role][index]]
            child = self._spawn(f"{role}-{index}", f"{role}_node.cli", argv)
            started[role].append(child)
        print(
            f"pd-serve: started {args.decode} decode and {args.prefill} prefill node(s); waiting "
            f"for them to load {args.model}", file=sys.stderr, flush=True,
        )  # fmt: skip
        loading = f"loading {args.model}"
        decode_addrs = self._await_ready(started["decode"], loading)
        prefill_addrs = self._await_ready(started["prefill"], loading)
        router_argv = _router_argv(self.router_argv, args, prefill_addrs, decode_addrs)
        self.ports.release([args.port, args.http_port])  # the router binds them now
        self.router = self._spawn("router", "router.cli", router_argv)
        return self._await_ready([self.router], "connecting to the nodes")[0]

    def wait(self) -> int:
        """Block until a child exits; return its exit code."""
        while True:
            for child in self.children:
                code = child.process.poll()
                if code is not None:
                    print(f"pd-serve: {child.name} {describe_exit(code)}", file=sys.stderr)
                    return code if code > 0 else 1
            time.sleep(0.2)

    def stop(self) -> None:
        self.ports.release_all()
        for child in self.children:
            if child.process.poll() is None:
                child.process.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for child in self.children:
            try:
                child.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait(5)


def build_serve_parser() -> ArgumentParser:
    parser = build_parser("serve", description="Run a local pdserve cluster: router + nodes.")
    group = parser.add_argument_group("cluster")
    group.add_argument(
        "--prefill", type=int, default=1, help="prefill nodes (0: colocated) (default: 1)"
    )
    group.add_argument("--decode", type=int, default=1, help="decode nodes (>= 1) (default: 1)")
    group.add_argument("--prefill-tp", type=int, default=None, metavar="N",
                       help="tensor-parallel size of each prefill node (default: "
                       "--tensor-parallel-size)")  # fmt: skip
    group.add_argument("--decode-tp", type=int, default=None, metavar="N",
                       help="tensor-parallel size of each decode node (default: "
                       "--tensor-parallel-size)")  # fmt: skip
    return parser


def _args_refusal(args: argparse.Namespace) -> str | None:
    """Why pd-serve cannot start these nodes, before it starts any, or None."""
    if args.decode < 1 or args.prefill < 0:
        return "need --decode >= 1 and --prefill >= 0"
    if min(args.prefill_tp or 1, args.decode_tp or 1) < 1:
        return "--prefill-tp and --decode-tp must be >= 1"
    tp = args.tensor_parallel_size
    largest = max(args.prefill_tp or tp, args.decode_tp or tp)
    return kv_cache_dtype_tp_refusal(args.kv_cache_dtype, largest)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_serve_parser()
    args = parser.parse_args(argv)
    setup_logging(args, "serve")
    if (refusal := _args_refusal(args)) is not None:
        print(f"pd-serve: {refusal}", file=sys.stderr)
        return 2
    cluster = LocalCluster(
        args, forwarded_argv(parser, argv, NODE), forwarded_argv(parser, argv, ROUTER)
    )
    stopping = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stopping.set()
        raise KeyboardInterrupt

    # Both explicitly: a process started in a non-interactive shell's background inherits
    # SIGINT ignored, and Python then installs no KeyboardInterrupt for it.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, on_signal)
    code = 0
    try:
        cluster.reserve_ports()
        address = cluster.start()
        mode = (
            "colocated" if args.prefill == 0 else f"{args.prefill} prefill + {args.decode} decode"
        )
        print(f"pd-serve: router listening on {address} ({mode}, model {args.model})", flush=True)
        if http_url := cluster.router and cluster.router.http_url:
            print(f"pd-serve: OpenAI-compatible API on {http_url}/v1 "
                  f"(metrics: {http_url}/metrics)", flush=True)  # fmt: skip
        print(f'pd-serve: try  {_client_command()} --addr {address} "Hello"', flush=True)
        code = cluster.wait()
    except KeyboardInterrupt:
        code = 0
    except (RuntimeError, ValueError, PortTaken) as exc:  # a node that did not start; no room
        print(f"pd-serve: {exc}", file=sys.stderr)
        code = 1
    finally:
        cluster.stop()
    print("pd-serve: stopped every process it started", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
