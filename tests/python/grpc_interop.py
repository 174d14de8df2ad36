"""Real grpcio peers for tests/interop_grpc.rs.

Subcommands:
  health ADDR STATUS SERVICE...   grpc.health.v1 Check: every SERVICE has STATUS
  watch ADDR                      Watch(""): print each status until NOT_SERVING
  reflect ADDR                    list and describe services through reflection
  tensorservice ADDR PROTO_DIR    a client generated from proto/ with grpcio-tools
  compat-client ADDR PROTO_DIR    the skytorch Python client protocol (torch.save chunks)
  compat-server PORT_FILE PROTO_DIR  a skytorch Python server (like the seed's)
"""

import asyncio
import io
import os
import random
import subprocess
import sys
import tempfile
import uuid

import grpc


def generate(proto_dir, files):
    """Generates Python modules for `files` (relative to proto_dir) and imports them."""
    out = tempfile.mkdtemp(prefix="tw-pb-")
    from grpc_tools import protoc
    import grpc_tools

    include = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    args = ["protoc", f"-I{proto_dir}", f"-I{include}", f"--python_out={out}", f"--grpc_python_out={out}"] + files
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed for {files}")
    for root, dirs, _ in os.walk(out):
        for d in dirs:
            open(os.path.join(root, d, "__init__.py"), "a").close()
    sys.path.insert(0, out)


def health(addr, status, services):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(addr) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for s in services:
            s = "" if s == "-" else s
            got = stub.Check(health_pb2.HealthCheckRequest(service=s), timeout=10)
            name = health_pb2.HealthCheckResponse.ServingStatus.Name(got.status)
            print(f"{s!r}: {name}")
            assert name == status, f"{s!r} is {name}, expected {status}"
        # An unknown service is NOT_FOUND, as the standard says.
        try:
            stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
            raise AssertionError("unknown service did not fail")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.NOT_FOUND, e
    print("ok")


def watch(addr):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(addr) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for r in stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=30):
            name = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
            print(name, flush=True)
            if name == "NOT_SERVING":
                return


def reflect(addr):
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(addr) as ch:
        db = ProtoReflectionDescriptorDatabase(ch)
        services = sorted(db.get_services())
        print("services:", services)
        for s in ["tensorwire.v1.TensorService", "skytorch.torch.Service", "grpc.health.v1.Health"]:
            assert s in services, f"{s} not listed"
        pool = DescriptorPool(db)
        svc = pool.FindServiceByName("tensorwire.v1.TensorService")
        methods = sorted(m.name for m in svc.methods)
        print("TensorService methods:", methods)
        assert methods == ["Call", "Exchange", "Fetch", "Handshake", "Send"], methods
        chunk = pool.FindMessageTypeByName("skytorch.torch.TensorChunk")
        print("TensorChunk fields:", [f.name for f in chunk.fields])
    print("ok")


def tensorservice(addr, proto_dir):
    generate(proto_dir, ["tensorwire/v1/wire.proto", "tensorwire/v1/service.proto"])
    import numpy as np
    from tensorwire.v1 import service_pb2, service_pb2_grpc, wire_pb2

    Frame, H = service_pb2.Frame, wire_pb2.FrameHeader
    with grpc.insecure_channel(addr, options=[("grpc.max_receive_message_length", 64 << 20)]) as ch:
        stub = service_pb2_grpc.TensorServiceStub(ch)
        w = stub.Handshake(Frame(header=H(hello=wire_pb2.Hello(version=1, agent="python-grpcio"))), timeout=10)
        assert w.header.HasField("welcome"), w
        print("welcome:", w.header.welcome.agent, "chunk", w.header.welcome.chunk_size)

        x = np.arange(300_000, dtype=np.float32).reshape(600, 500)
        data = x.tobytes()
        half = len(data) // 2

        def frames():
            yield Frame(header=H(request=wire_pb2.Request(method=wire_pb2.METHOD_SEND)))
            info = wire_pb2.TensorInfo(dtype=wire_pb2.DTYPE_FLOAT32, shape=list(x.shape), device="cpu",
                                       name="from-python", codec=wire_pb2.CODEC_RAW)
            for i, (off, part) in enumerate([(0, data[:half]), (half, data[half:])]):
                c = wire_pb2.Chunk(tensor_id=1, index=i, offset=off, total_bytes=len(data), last=i == 1,
                                   raw_len=len(part), info=info if i == 0 else None)
                yield Frame(header=H(chunk=c), payload=part)

        r = stub.Send(frames(), timeout=30)
        assert r.header.HasField("reply"), r
        assert r.header.reply.received_count == 1, r.header.reply
        print("send:", r.header.reply.message)

        def fetch(params):
            req = Frame(header=H(request=wire_pb2.Request(method=wire_pb2.METHOD_FETCH, params=params)))
            tensors, buf, info = [], None, None
            for f in stub.Fetch(req, timeout=30):
                kind = f.header.WhichOneof("kind")
                if kind == "chunk":
                    c = f.header.chunk
                    if c.HasField("info"):
                        info, buf = c.info, bytearray(c.total_bytes)
                    assert c.compression == wire_pb2.COMPRESSION_NONE
                    buf[c.offset:c.offset + len(f.payload)] = f.payload
                    if c.last:
                        tensors.append((info, bytes(buf)))
                elif kind == "error":
                    raise AssertionError(f"server error: {f.header.error}")
                elif kind == "reply":
                    break
            return tensors

        [(info, raw)] = fetch({"name": "from-python"})
        assert list(info.shape) == [600, 500] and info.dtype == wire_pb2.DTYPE_FLOAT32, info
        assert raw == data, "fetched bytes differ"
        got = fetch({"shape": "4,5", "count": "3"})
        assert len(got) == 3 and all(list(i.shape) == [4, 5] for i, _ in got), got
        print("fetch: ok")
    print("ok")


def seed_chunks(tensor, chunk_size=1 << 20, shuffle=False):
    """The seed's serialize_tensor_to_chunks: torch.save bytes in chunks, metadata first."""
    import torch

    buf = io.BytesIO()
    torch.save(tensor, buf)
    data = buf.getvalue()
    tid = str(uuid.uuid4())
    parts = [data[i:i + chunk_size] for i in range(0, len(data), chunk_size)] or [b""]
    out = []
    for i, p in enumerate(parts):
        meta = {}
        if i == 0:
            meta = {"shape": str(list(tensor.shape)), "dtype": str(tensor.dtype), "device": str(tensor.device),
                    "size_bytes": str(len(data))}
        out.append(dict(tensor_id=tid, chunk_number=i, data=p, total_chunks=len(parts), is_last=i == len(parts) - 1,
                        metadata=meta))
    if shuffle:
        random.Random(7).shuffle(out)
    return tid, out


class SeedAssembler:
    """The seed's TensorAssembler: buffers by tensor_id, any order, torch.load at the end."""

    def __init__(self):
        self.parts = {}

    def add(self, c):
        import torch

        d = self.parts.setdefault(c.tensor_id, {})
        d[c.chunk_number] = c.data
        if len(d) == c.total_chunks:
            data = b"".join(d[i] for i in range(c.total_chunks))
            del self.parts[c.tensor_id]
            return torch.load(io.BytesIO(data), weights_only=True)
        return None


def compat_client(addr, proto_dir):
    generate(proto_dir, ["skytorch/torch/service.proto"])
    import torch
    from skytorch.torch import service_pb2 as pb, service_pb2_grpc as pbg

    opts = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
    with grpc.insecure_channel(addr, options=opts) as ch:
        stub = pbg.ServiceStub(ch)
        tensors = [torch.randn(100, 100), torch.randn(1024, 1024), torch.arange(10, dtype=torch.int64),
                   torch.randn(8, 8, dtype=torch.float64).t()]
        ids, chunks = [], []
        for i, t in enumerate(tensors):
            tid, cs = seed_chunks(t, shuffle=(i == 1))
            ids.append(tid)
            chunks += cs
        r = stub.ReceiveTensors(iter(pb.TensorChunk(**c) for c in chunks), timeout=60)
        assert r.success and r.received_count == len(tensors), r
        print("ReceiveTensors:", r.message)
        # Fetch each back by its tensor_id and compare.
        for tid, t in zip(ids, tensors):
            asm, got = SeedAssembler(), []
            for c in stub.SendTensors(pb.TensorRequest(count=1, parameters={"name": tid}), timeout=60):
                x = asm.add(c)
                if x is not None:
                    got.append(x)
            assert len(got) == 1 and torch.equal(got[0], t), (tid, got)
        print("SendTensors by name: torch.equal ok")
        # The seed's own example: count=2, shape 50,50.
        asm, got = SeedAssembler(), []
        first_meta = None
        for c in stub.SendTensors(pb.TensorRequest(count=2, parameters={"shape": "50,50"}), timeout=60):
            if c.chunk_number == 0 and first_meta is None:
                first_meta = dict(c.metadata)
            x = asm.add(c)
            if x is not None:
                got.append(x)
        assert len(got) == 2 and all(g.shape == (50, 50) for g in got), got
        assert first_meta["shape"] == "[50, 50]" and first_meta["dtype"] == "torch.float32", first_meta
        assert first_meta["device"] == "cpu" and int(first_meta["size_bytes"]) > 10000, first_meta
        print("SendTensors shape=50,50:", first_meta)
        # Bidirectional: the default exchange echoes.
        asm, got = SeedAssembler(), []
        out = []
        for t in tensors[:2]:
            out += seed_chunks(t)[1]
        for c in stub.StreamTensors(iter(pb.TensorChunk(**c) for c in out), timeout=60):
            x = asm.add(c)
            if x is not None:
                got.append(x)
        assert len(got) == 2 and all(torch.equal(a, b) for a, b in zip(got, tensors[:2])), got
        print("StreamTensors: torch.equal ok")
        # A malicious pickle is refused with a clear error, and the server keeps serving.
        evil = b"\x80\x02cos\nsystem\nq\x00X\x02\x00\x00\x00idq\x01\x85q\x02Rq\x03."
        try:
            stub.ReceiveTensors(iter([pb.TensorChunk(tensor_id="evil", chunk_number=0, data=evil, total_chunks=1,
                                                     is_last=True)]), timeout=30)
            raise AssertionError("malicious data accepted")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e
            print("malicious pickle:", e.details())
        r = stub.ReceiveTensors(iter(pb.TensorChunk(**c) for c in seed_chunks(torch.ones(3))[1]), timeout=30)
        assert r.success and r.received_count == 1
    print("ok")


def compat_server(port_file, proto_dir):
    generate(proto_dir, ["skytorch/torch/service.proto"])
    import torch
    from skytorch.torch import service_pb2 as pb, service_pb2_grpc as pbg

    class Servicer(pbg.ServiceServicer):
        def _process_tensor(self, t):
            return t * 2 + 1

        def _get_tensor_to_send(self, index, parameters):
            shape = [int(s) for s in parameters.get("shape", "2,3").split(",")]
            n = 1
            for s in shape:
                n *= s
            return torch.arange(n, dtype=torch.float32).reshape(shape) + index

        async def ReceiveTensors(self, request_iterator, context):
            asm, n = SeedAssembler(), 0
            async for c in request_iterator:
                if asm.add(c) is not None:
                    n += 1
            return pb.TensorResponse(success=True, message=f"Received {n} tensors", received_count=n)

        async def SendTensors(self, request, context):
            for i in range(request.count):
                for c in seed_chunks(self._get_tensor_to_send(i, dict(request.parameters)), chunk_size=1 << 16)[1]:
                    yield pb.TensorChunk(**c)

        async def StreamTensors(self, request_iterator, context):
            asm = SeedAssembler()
            async for c in request_iterator:
                t = asm.add(c)
                if t is not None:
                    for out in seed_chunks(self._process_tensor(t))[1]:
                        yield pb.TensorChunk(**out)

    async def main():
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
        pbg.add_ServiceServicer_to_server(Servicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        with open(port_file + ".tmp", "w") as f:
            f.write(str(port))
        os.rename(port_file + ".tmp", port_file)
        await server.wait_for_termination()

    asyncio.run(main())


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "health":
        health(args[0], args[1], args[2:])
    elif cmd == "watch":
        watch(args[0])
    elif cmd == "reflect":
        reflect(args[0])
    elif cmd == "tensorservice":
        tensorservice(args[0], args[1])
    elif cmd == "compat-client":
        compat_client(args[0], args[1])
    elif cmd == "compat-server":
        compat_server(args[0], args[1])
    else:
        raise SystemExit(f"unknown command {cmd}")
