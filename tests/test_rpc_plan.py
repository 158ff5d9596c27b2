"""RPC servers without llama.cpp: endpoints, the handshake against a stand-in server, the
layer split as llama.cpp computes it, memory plans, the fewest servers, and what is
reported when a server goes away."""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from specgguf.engine.config import EngineConfig, ModelConfig, SpeculativeConfig
from specgguf.engine.planning import fewest_servers, layer_ranges, make_plan
from specgguf.errors import InsufficientMemoryError, RpcServerError, UsageError
from specgguf.gguf.info import read_model_info, weight_layout
from specgguf.gguf.metadata import TensorInfo
from specgguf.llama import rpc
from specgguf.llama.memory import (
    LOCAL,
    MemoryPlan,
    Place,
    assign_layers,
    check_plan,
    model_memory,
    place_model,
)

from .conftest import free_port


def test_endpoints_in_llama_cpp_format() -> None:
    eps = rpc.parse_endpoints("10.0.0.2:50052, gpu-box:50053,10.0.0.2:50052")
    assert [str(e) for e in eps] == ["10.0.0.2:50052", "gpu-box:50053"]
    for bad, why in [
        ("10.0.0.2", "HOST:PORT"),
        ("host:", "HOST:PORT"),
        (":50052", "HOST:PORT"),
        ("h:0", "1 to 65535"),
        ("h:70000", "1 to 65535"),
        ("h:x", "1 to 65535"),
        ("[::1]:50052", "IPv4"),
        ("::1:50052", "IPv4"),
        ("", "HOST:PORT"),
    ]:
        with pytest.raises(UsageError, match=why):
            rpc.parse_endpoints(bad)


def test_model_config_checks_servers_and_split(tmp_path: Path) -> None:
    m = ModelConfig(tmp_path / "m.gguf", rpc=("a:1,b:2",), tensor_split=(3, 1))
    assert m.rpc == ("a:1", "b:2") and m.tensor_split == (3.0, 1.0)
    with pytest.raises(UsageError, match="HOST:PORT"):
        ModelConfig(tmp_path / "m.gguf", rpc=("a",))
    with pytest.raises(UsageError, match="tensor split"):
        ModelConfig(tmp_path / "m.gguf", tensor_split=(1, -1))
    with pytest.raises(UsageError, match="RPC timeout"):
        EngineConfig(ModelConfig(tmp_path / "m.gguf"), rpc_timeout=0)


# --- the layer split ------------------------------------------------------------------


def llama_cpp_split(n_layer: int, ngl: int, splits: list[float]) -> list[int | None]:
    """llama-model.cpp's loop, transcribed separately in plain floats, as a control."""
    total = sum(splits)
    acc, points = 0.0, []
    for s in splits:
        acc += s
        points.append(acc / total)
    ngl = n_layer + 1 if ngl < 0 else ngl
    start, act = max(n_layer + 1 - ngl, 0), min(ngl, n_layer + 1)
    out: list[int | None] = []
    for il in range(n_layer + 1):
        if il < start or il - start >= act:
            out.append(None)
        else:
            out.append(sum(1 for p in points if p <= (il - start) / act))
    return out


@pytest.mark.parametrize(
    ("n_layer", "ngl", "splits"),
    [
        (2, -1, [1, 1]),
        (2, 2, [1, 1]),
        (28, -1, [1, 1]),
        (28, 20, [3, 1]),
        (80, 70, [1, 1, 1]),
        (80, 0, [1, 1]),
        (32, -1, [24e9, 22e9, 8e9]),
    ],
)
def test_layer_split_as_llama_cpp_computes_it(n_layer: int, ngl: int, splits: list[float]) -> None:
    got = assign_layers(n_layer, ngl, splits)
    assert got == llama_cpp_split(n_layer, ngl, splits)
    assert len(got) == n_layer + 1


def test_layer_split_examples() -> None:
    # 2 blocks + output over two devices: block 1 on the first, the output on the second.
    assert assign_layers(2, 2, [1, 1]) == [None, 0, 1]
    assert assign_layers(2, -1, [1, 1]) == [0, 0, 1]
    assert assign_layers(3, -1, []) == [None] * 4  # no device: all on the CPU
    assert assign_layers(3, -1, [0, 0]) == [0, 0, 1, 1]  # all zero: even shares


# --- weights per layer, plans --------------------------------------------------------


def test_weight_layout_of_tied_embeddings() -> None:
    q8 = 8  # GGML_TYPE_Q8_0: 34 bytes per 32 values
    ts = [
        TensorInfo("token_embd.weight", (64, 100), q8, 0),
        TensorInfo("blk.0.attn_q.weight", (64, 64), q8, 0),
        TensorInfo("blk.1.attn_q.weight", (64, 64), q8, 0),
        TensorInfo("output_norm.weight", (64,), 0, 0),
    ]
    layout = weight_layout(ts, 2)
    assert layout is not None
    embd = 64 * 100 // 32 * 34
    assert layout.input == embd and layout.blocks == (64 * 64 // 32 * 34,) * 2
    # No output.weight: llama.cpp loads the embedding again for the output layer.
    assert layout.tied == embd and layout.output == 64 * 4 + embd
    assert layout.total == embd + 2 * 64 * 64 // 32 * 34 + 64 * 4
    assert weight_layout([TensorInfo("x", (4,), 9999, 0)], 1) is None  # unknown type


def test_tiny_model_layout_matches_its_file(tiny_models: dict[str, Path]) -> None:
    info = read_model_info(tiny_models["target"])
    assert info.layout is not None and len(info.layout.blocks) == 2
    assert 0 < info.file_size - info.layout.total < 64 * 1024  # metadata and padding


def servers(*gib: float) -> list[Place]:
    return [Place(f"10.0.0.{i + 2}:50052", "rpc", int(g * 2**30)) for i, g in enumerate(gib)]


def test_remote_layers_leave_this_machine(tiny_models: dict[str, Path]) -> None:
    info = read_model_info(tiny_models["target"])
    mem = model_memory(info, n_ctx=1024)
    assert info.layout is not None
    p = place_model(info, mem, servers(1, 1), n_gpu_layers=2)
    assert p.layers == (LOCAL, "10.0.0.2:50052", "10.0.0.3:50052")
    a, b = p.shares["10.0.0.2:50052"], p.shares["10.0.0.3:50052"]
    assert a.weights == info.layout.blocks[1] and a.kv_cache == mem.kv_cache // 2
    assert b.weights == info.layout.output and b.kv_cache == 0
    assert a.compute == b.compute == mem.activations
    local = p.shares[LOCAL]
    assert local.weights == mem.weights - info.layout.blocks[1] - info.layout.output
    assert local.kv_cache == mem.kv_cache - mem.kv_cache // 2


def test_plan_refusal_names_the_server() -> None:
    from specgguf.llama.memory import ModelPlacement, Share

    gib = 2**30
    placed = ModelPlacement(
        "big.gguf", (), {LOCAL: Share(gib, 0, 0), "10.0.0.2:50052": Share(30 * gib, gib, 0)}
    )
    plan = MemoryPlan((Place(LOCAL, "local", 8 * gib), *servers(24)), (placed,))
    with pytest.raises(InsufficientMemoryError) as ei:
        check_plan(plan)
    msg = str(ei.value)
    assert "need about 31.00 GiB on RPC server 10.0.0.2:50052 but 24.00 GiB is free" in msg
    assert "big.gguf: weights 30.00 GiB + KV cache 1.00 GiB" in msg
    assert ei.value.remote and not ei.value.gpu and "this machine" not in msg


def tiny_config(tiny: dict[str, Path], **target: object) -> EngineConfig:
    return EngineConfig(
        ModelConfig(tiny["target"], n_ctx=1024, **target),  # type: ignore[arg-type]
        ModelConfig(tiny["draft-partial"], n_ctx=1024),
        SpeculativeConfig("auto"),
    )


def test_plan_with_stand_in_servers(tiny_models: dict[str, Path]) -> None:
    cfg = tiny_config(tiny_models, rpc=("a:1", "b:2"), tensor_split=(0, 1))
    p = make_plan(cfg, server_free=[1 << 30], local_free=8 << 30, gpus=[])
    assert p.fits
    # A split of 0,1: every offloaded layer on the second server.
    assert p.plan.models[0].layers == ("b:2", "b:2", "b:2")
    assert layer_ranges(p.plan, 0) == [(LOCAL, "input"), ("b:2", "layers 0-1, output")]
    assert layer_ranges(p.plan, 1) == [(LOCAL, "input, layers 0-1, output")]
    assert p.plan.need("a:1") == 0
    with pytest.raises(UsageError, match="3 proportions"):
        make_plan(
            tiny_config(tiny_models, rpc=("a:1", "b:2"), tensor_split=(1, 1, 1)),
            server_free=[1 << 30],
            local_free=8 << 30,
            gpus=[],
        )


def test_fewest_servers(tiny_models: dict[str, Path]) -> None:
    cfg = tiny_config(tiny_models)
    info = read_model_info(tiny_models["target"])
    t_mem = model_memory(info, n_ctx=1024)
    need = make_plan(cfg, local_free=1 << 40, gpus=[]).plan.need(LOCAL)
    # Room for everything here: no server.
    found = fewest_servers(cfg, 1 << 30, local_free=need, gpus=[])
    assert found is not None and found.config.target.rpc == ()
    # Room here for the draft and the target's input layer, metadata and compute buffers,
    # not one block more: one server that holds all the blocks, the output and their KV.
    assert info.layout is not None
    d_need = need - t_mem.total
    remote_weights = sum(info.layout.blocks) + info.layout.output
    local = d_need + t_mem.compute + t_mem.weights - remote_weights
    remote = remote_weights + t_mem.kv_cache
    found = fewest_servers(cfg, remote + t_mem.activations + 4096, local_free=local, gpus=[])
    assert found is not None and found.fits
    assert found.config.target.rpc == ("server-1:50052",)
    assert found.config.target.n_gpu_layers == 3  # both blocks and the output
    assert found.plan.models[0].layers == ("server-1:50052",) * 3
    assert not make_plan(cfg, local_free=local, gpus=[]).fits  # control: no server
    # Servers too small for even one block: none suffice.
    assert fewest_servers(cfg, 1024, local_free=local, gpus=[], max_servers=3) is None


# --- the handshake ---------------------------------------------------------------------


class FakeServer:
    """A TCP server on 127.0.0.1 that answers like an rpc-server (HELLO, DEVICE_COUNT,
    GET_DEVICE_MEMORY) with the given version and devices, or stays silent."""

    def __init__(
        self,
        version: tuple[int, int, int] = (7, 0, 0),
        devices: tuple[tuple[int, int], ...] = ((5 << 30, 8 << 30),),
        silent: bool = False,
        garbage: bool = False,
    ) -> None:
        self.version, self.devices, self.silent, self.garbage = version, devices, silent, garbage
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.port = self.sock.getsockname()[1]
        self.requests: list[int] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                self._client(conn)

    def _client(self, conn: socket.socket) -> None:
        def recv(n: int) -> bytes:
            buf = b""
            while len(buf) < n:
                chunk = conn.recv(n - len(buf))
                if not chunk:
                    raise EOFError
                buf += chunk
            return buf

        def reply(data: bytes) -> None:
            conn.sendall(struct.pack("<Q", len(data)) + data)

        try:
            while True:
                cmd, size = struct.unpack("<BQ", recv(9))
                payload = recv(size)
                self.requests.append(cmd)
                if self.silent:
                    recv(1)  # until the client gives up
                if self.garbage:
                    conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
                    return
                if cmd == 14:
                    reply(bytes([*self.version, 0]) + bytes(24))
                elif cmd == 15:
                    reply(struct.pack("<I", len(self.devices)))
                elif cmd == 11:
                    (i,) = struct.unpack("<I", payload)
                    reply(struct.pack("<QQ", *self.devices[i]))
        except (EOFError, OSError):
            return

    def close(self) -> None:
        self.sock.close()

    @property
    def endpoint(self) -> rpc.Endpoint:
        return rpc.Endpoint("127.0.0.1", self.port)


@pytest.fixture
def fake() -> Iterator[type[FakeServer]]:
    made: list[FakeServer] = []

    def make(**kw: object) -> FakeServer:
        s = FakeServer(**kw)  # type: ignore[arg-type]
        made.append(s)
        return s

    yield make  # type: ignore[misc]
    for s in made:
        s.close()


def test_probe_reads_version_and_memory(fake: type[FakeServer]) -> None:
    s = fake(devices=((5 << 30, 8 << 30), (1 << 30, 2 << 30)))
    info = rpc.probe(s.endpoint, timeout=5)
    assert info.version == (7, 0, 0)
    assert [(d.memory_free, d.memory_total) for d in info.devices] == [
        (5 << 30, 8 << 30),
        (1 << 30, 2 << 30),
    ]
    assert info.memory_free == 6 << 30
    assert s.requests == [14, 15, 11, 11]  # HELLO, DEVICE_COUNT, GET_DEVICE_MEMORY x 2


def test_probe_refusals_name_the_server(fake: type[FakeServer]) -> None:
    port = free_port()
    with pytest.raises(RpcServerError, match=f"RPC server 127.0.0.1:{port}: connection refused"):
        rpc.probe(rpc.Endpoint("127.0.0.1", port), timeout=5)
    old = fake(version=(6, 0, 0))
    with pytest.raises(RpcServerError, match=r"speaks RPC protocol 6\.0\.0") as ei:
        rpc.probe(old.endpoint, timeout=5)
    assert ei.value.exit_code == 6 and ei.value.endpoint == str(old.endpoint)
    busy = fake(silent=True)
    with pytest.raises(RpcServerError, match="one client at a time"):
        rpc.probe(busy.endpoint, timeout=0.5)
    other = fake(garbage=True)
    with pytest.raises(RpcServerError, match="did not answer as an rpc-server"):
        rpc.probe(other.endpoint, timeout=5)
    with pytest.raises(RpcServerError, match="reports no device"):
        rpc.probe(fake(devices=()).endpoint, timeout=5)
    with pytest.raises(RpcServerError, match="cannot resolve host"):
        rpc.probe(rpc.Endpoint("no-such-host.invalid", 50052), timeout=5)


def test_plan_asks_the_servers(fake: type[FakeServer], tiny_models: dict[str, Path]) -> None:
    a, b = fake(devices=((1 << 30, 4 << 30),)), fake(devices=((3 << 30, 4 << 30),))
    cfg = tiny_config(tiny_models, rpc=(str(a.endpoint), str(b.endpoint)))
    p = make_plan(cfg, local_free=8 << 30, gpus=[])
    free = {pl.name: pl.free for pl in p.plan.places}
    assert free[str(a.endpoint)] == 1 << 30 and free[str(b.endpoint)] == 3 << 30
    # By free memory, 1:3 (split points 0.25, 1 for layers at 0, 1/3, 2/3): block 0 on the
    # first, block 1 and the output on the second (an even split would put block 1 on the
    # first too).
    assert p.plan.models[0].layers == (str(a.endpoint),) + (str(b.endpoint),) * 2


# --- a server lost after loading -------------------------------------------------------


def test_lost_server_is_singled_out(fake: type[FakeServer]) -> None:
    alive = fake()
    gone = rpc.Endpoint("127.0.0.1", free_port())
    msg = "/x/ggml-rpc.cpp:566: Remote RPC server crashed or returned malformed response"
    err = rpc.lost_error(msg, [alive.endpoint, gone])
    assert err.endpoints == [str(gone)] and err.exit_code == 9
    assert str(err) == (
        f"RPC server {gone} stopped answering (connection refused now; "
        "llama.cpp: Remote RPC server crashed or returned malformed response)"
    )
    # The endpoint in llama.cpp's own message wins; none singled out: all named.
    named = rpc.lost_error(
        f"x.cpp:1: Failed to connect to {alive.endpoint}", [alive.endpoint, gone]
    )
    assert named.endpoints == [str(alive.endpoint)]
    both = rpc.lost_error(msg, [alive.endpoint])
    assert both.endpoints == [str(alive.endpoint)] and "llama.cpp:" in both.detail


def test_a_server_still_listening_as_it_dies_is_singled_out_once_it_stops(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A killed rpc-server closes its connection to the client before its listening
    socket: a connection opened in between still succeeds. The server that stops
    accepting within the settle time is the one named, not every server."""
    import types

    msg = "/x/ggml-rpc.cpp:566: Remote RPC server crashed or returned malformed response"
    # A fake clock that only lost_error's waits move on: the dying server closes at the
    # fifth wait (0.5 s), the settle time is 2 s, whatever the machine's load.
    now = [0.0]
    waits: list[float] = []
    on_wait: list[Callable[[], None]] = []

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        now[0] += seconds
        if len(waits) == 5:
            for f in on_wait:
                f()

    monkeypatch.setattr(rpc, "time", types.SimpleNamespace(monotonic=lambda: now[0], sleep=sleep))
    with socket.create_server(("127.0.0.1", 0)) as live:
        dying = socket.create_server(("127.0.0.1", 0))
        ends = [rpc.Endpoint("127.0.0.1", s.getsockname()[1]) for s in (live, dying)]
        on_wait.append(dying.close)
        try:
            err = rpc.lost_error(msg, ends)
        finally:
            dying.close()
    assert err.endpoints == [str(ends[1])]
    assert err.detail.startswith("connection refused now")
    assert waits == [0.1] * 5  # asked again every 0.1 s until it stopped accepting
    # Both still listening after the settle time: both named, once it has passed.
    now[0], waits[:], on_wait[:] = 0.0, [], []
    with socket.create_server(("127.0.0.1", 0)) as a, socket.create_server(("127.0.0.1", 0)) as b:
        ends = [rpc.Endpoint("127.0.0.1", s.getsockname()[1]) for s in (a, b)]
        assert rpc.lost_error(msg, ends).endpoints == [str(e) for e in ends]
        assert 2.0 <= now[0] < 2.15  # the settle time, 2 s, and no longer
        # Without the wait (settle 0) the same moment names both: the CI failure.
        now[0], waits[:] = 0.0, []
        assert rpc.lost_error(msg, ends, settle=0).endpoints == [str(e) for e in ends]
        assert waits == []


def test_keep_alive_sets_dead_peer_timeouts(fake: type[FakeServer]) -> None:
    s = fake()
    other = fake()
    with (
        socket.create_connection(("127.0.0.1", s.port)) as c,
        socket.create_connection(("127.0.0.1", other.port)) as untouched,
    ):
        assert rpc.keep_alive([s.endpoint], timeout=12) == 1
        assert c.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert untouched.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 0
        if hasattr(socket, "TCP_KEEPIDLE"):
            assert c.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 4
            assert c.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 2
            assert c.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 4
        if hasattr(socket, "TCP_USER_TIMEOUT"):
            assert c.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 12000


def test_flag_errors_name_the_flag(tiny_models: dict[str, Path]) -> None:
    from .helpers import run_cli

    m = str(tiny_models["target"])
    for args, want in [
        (["--rpc", "10.0.0.2"], "--rpc: an RPC server is HOST:PORT, not '10.0.0.2'"),
        (["--rpc", "a:1", "-ts", "3,x"], "--tensor-split takes proportions"),
        (["--rpc", "a:1", "-ts", "1,-1"], "--tensor-split takes proportions"),
        (["--rpc-draft", "a:1", "--drafter", "none"], "--rpc-draft places the draft"),
        (["--rpc", "a:1", "--rpc-timeout", "0"], "--rpc-timeout"),
    ]:
        res = run_cli("run", "-m", m, *args, "-n", "1", "hi")
        assert res.returncode == 2, (args, res.stderr)
        assert want in res.stderr.decode(), (args, res.stderr)
    # A split without anywhere to put layers (no GPU, no server) is refused in preflight.
    res = run_cli("plan", "-m", m, "-ts", "1,1", "--local-mem", "8")
    assert res.returncode == 2 and "2 proportions" in res.stderr.decode(), res.stderr


def test_named_local_devices_follow_the_servers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """-devd names this machine's devices; the RPC servers' devices still come first, as
    llama.cpp orders them, and "none" leaves the servers alone."""
    import dataclasses

    from specgguf.engine.preflight import model_devices
    from specgguf.llama import runtime

    gib = 1 << 30
    fake = [runtime.Device("CPU", "cpu", "cpu", 64 * gib, 64 * gib)] + [
        runtime.Device(f"CUDA{i}", "gpu", "gpu", (i + 1) * gib, 24 * gib) for i in range(2)
    ]
    real = runtime.build_info()
    monkeypatch.setattr(
        runtime, "build_info", lambda: dataclasses.replace(real, devices=tuple(fake))
    )
    ep = rpc.parse_endpoints("10.0.0.2:50052")[0]
    servers = {str(ep): rpc.RpcServerInfo(ep, rpc.RPC_PROTO_VERSION, (rpc.RpcDevice(0, gib, gib),))}
    gpus = [Place("CUDA0", "gpu", gib, 24 * gib), Place("CUDA1", "gpu", 2 * gib, 24 * gib)]

    def names(**kw: object) -> list[str]:
        m = ModelConfig(tmp_path / "m.gguf", rpc=(str(ep),), **kw)  # type: ignore[arg-type]
        return [p.name for p in model_devices(m, servers, gpus)]

    assert names() == [str(ep), "CUDA0", "CUDA1"]
    assert names(devices=("CUDA1",)) == [str(ep), "CUDA1"]
    assert names(devices=()) == [str(ep)]
    only = ModelConfig(tmp_path / "m.gguf", rpc=(str(ep),), devices=("CUDA1",))
    (cuda1,) = model_devices(only, servers, [])[1:]
    assert cuda1.free == 2 * gib  # its own free memory, not the default list's
    with pytest.raises(UsageError, match="2 devices"):
        model_devices(
            ModelConfig(tmp_path / "m.gguf", rpc=(str(ep),), devices=("CUDA1",),
                        tensor_split=(1, 1, 1)),
            servers, gpus,
        )  # fmt: skip
