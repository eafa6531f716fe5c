"""pd-serve's GPU placement: nodes spread over the visible GPUs by index, every GPU left
visible to every node (no CUDA_VISIBLE_DEVICES per node), an explicit device kept."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest

from pdserve import local_cluster
from pdserve.local_cluster import LocalCluster
from pdserve.node_placement import node_devices


def test_one_p_one_d_on_two_gpus_prefill_on_0_decode_on_1() -> None:
    devices, share = node_devices("auto", 1, 1, 2)
    assert devices == {"prefill": ["cuda:0"], "decode": ["cuda:1"]}
    assert share == 1


def test_more_nodes_than_gpus_share_round_robin() -> None:
    devices, share = node_devices("cuda", 2, 2, 2)
    assert devices == {"prefill": ["cuda:0", "cuda:1"], "decode": ["cuda:0", "cuda:1"]}
    assert share == 2


def test_colocated_and_one_gpu() -> None:
    assert node_devices("auto", 0, 1, 1) == ({"prefill": [], "decode": ["cuda:0"]}, 1)
    assert node_devices("auto", 1, 1, 1) == ({"prefill": ["cuda:0"], "decode": ["cuda:0"]}, 2)


def test_cpu_and_explicit_device_are_kept() -> None:
    assert node_devices("cpu", 1, 1, 4) == (None, 1)
    assert node_devices("auto", 1, 1, 0) == (None, 1)
    assert node_devices("cuda:1", 1, 1, 2) == (None, 2)  # both on the one device given


def test_start_keeps_listed_gpus_visible_and_passes_the_index(monkeypatch) -> None:
    """With CUDA_VISIBLE_DEVICES=3,5 the nodes inherit it unchanged and get --device cuda:0 /
    cuda:1 (indices into the listed GPUs), not one hidden id each."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    spawned: list[tuple[list[str], dict | None]] = []

    class FakePopen:
        def __init__(self, cmd, **kwargs) -> None:
            spawned.append((cmd, kwargs.get("env")))
            self.stdout = iter([f"pd-node listening on 127.0.0.1:{9000 + len(spawned)}\n"])

        def poll(self):
            return None

    monkeypatch.setattr(local_cluster.subprocess, "Popen", FakePopen)
    monkeypatch.setattr(local_cluster.subprocess, "run", _prepared_ok(spawned))
    monkeypatch.setattr(local_cluster.sys, "stderr", open(os.devnull, "w"))  # noqa: SIM115
    args = types.SimpleNamespace(
        device="auto",
        prefill=1,
        decode=1,
        registry=None,
        port=0,
        metrics_port=0,
        model="m",
        prefill_tp=None,
        decode_tp=None,
        tensor_parallel_size=1,
        host="127.0.0.1",
        http_port=0,
    )
    cluster = LocalCluster(args, ["--model", "m"], [])
    cluster.start()
    assert spawned[0][0][-3:] == ["-m", "engine.model.prepare", "m"]  # before any node
    by_module = {cmd[cmd.index("-m") + 1]: (cmd, env) for cmd, env in spawned}
    for module, device in (("prefill_node.cli", "cuda:0"), ("decode_node.cli", "cuda:1")):
        cmd, env = by_module[module]
        assert env is None or env.get("CUDA_VISIBLE_DEVICES") == "3,5"  # inherited, unchanged
        assert cmd[-2:] == ["--device", device]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3,5"
    assert sys.executable in by_module["router.cli"][0]


def _prepared_ok(calls: list) -> object:
    def run(cmd, **kwargs) -> subprocess.CompletedProcess:
        calls.append((cmd, kwargs.get("env")))
        return subprocess.CompletedProcess(cmd, 0)

    return run


@pytest.mark.parametrize(("model", "prepared"), [("m", True), ("synthetic:tiny-llama", False)])
def test_the_model_is_prepared_once_before_the_nodes_start(monkeypatch, model, prepared) -> None:
    """pd-serve converts a GGUF model once, in one child, before any node starts (the nodes then
    only read the cache); a model it cannot read stops it there, with no node started."""
    runs: list = []
    monkeypatch.setattr(local_cluster.subprocess, "run", _prepared_ok(runs))
    args = types.SimpleNamespace(model=model, host="127.0.0.1")
    LocalCluster(args, [], [])._prepare_model()
    assert [cmd[1:] for cmd, _ in runs] == (
        [["-m", "engine.model.prepare", model]] if prepared else []
    )

    def fails(cmd, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.CompletedProcess(cmd, 2)

    def no_node(*args, **kwargs):
        raise AssertionError("a node started though the model could not be read")

    monkeypatch.setattr(local_cluster.subprocess, "run", fails)
    monkeypatch.setattr(local_cluster.subprocess, "Popen", no_node)
    args = types.SimpleNamespace(model="nope", device="cpu", prefill=1, decode=1, host="127.0.0.1")
    with pytest.raises(RuntimeError, match="cannot load the model 'nope'"):
        LocalCluster(args, [], []).start()


def test_tensor_parallel_nodes_take_consecutive_gpus() -> None:
    """A TP 2 prefill node beside a TP 1 decode node on 2 GPUs: the prefill node's ranks on
    cuda:0 and cuda:1 (its --devices), the decode node back on cuda:0 (2 ranks share it)."""
    devices, share = node_devices("auto", 1, 1, 2, prefill_tp=2, decode_tp=1)
    assert devices == {"prefill": ["cuda:0,cuda:1"], "decode": ["cuda:0"]}
    assert share == 2
    devices, share = node_devices("cuda", 1, 1, 4, prefill_tp=2, decode_tp=2)
    assert devices == {"prefill": ["cuda:0,cuda:1"], "decode": ["cuda:2,cuda:3"]} and share == 1
    with pytest.raises(ValueError, match="tensor-parallel size 4 needs 4 GPUs; 2 visible"):
        node_devices("auto", 0, 1, 2, decode_tp=4)
