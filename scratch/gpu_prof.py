import cProfile, pstats, time, tempfile, zmq, sys, subprocess, os, multiprocessing as mp
BACKEND = os.environ.get("BK", "cuda")
def inproc():
    from daemon.backends import select_backend
    from daemon.device_state import DeviceLimits, DeviceState
    from daemon.handlers import DEVICE_HANDLERS
    from daemon.jobs import Job
    from daemon.sessions import SessionRef
    from daemon.sharing import ShareRegistry
    from protos.schema import OPS, decode_args
    from protos.messages import encode_result, encode_request, parse_request, unpack
    drv, _ = select_backend(BACKEND, sim_devices=1, sim_memory=1<<26)
    st = DeviceState(drv, 0, drv.device_info(0), DeviceLimits(max_payload=1<<20), ShareRegistry())
    ref = SessionRef("t", 1, "x", 1)
    job = Job(b"p", 1, OPS["alloc"], decode_args(OPS["alloc"], {"size": 4096}), ref, 0, ())
    h = DEVICE_HANDLERS["alloc"](st, job).result["buffer"]["handle"]
    hdr = encode_request(5, "read", "t", {"buffer": h, "size": 64, "device": 0})
    def one():
        r = parse_request(unpack(hdr)); a = decode_args(r.spec, r.args)
        j = Job(b"p", r.id, r.spec, a, ref, 0, ())
        out = DEVICE_HANDLERS["read"](st, j); encode_result(j.request_id, out.result)
    N=20000
    for _ in range(1000): one()
    t=time.perf_counter()
    for _ in range(N): one()
    print("in-process decode+read handler+encode us", (time.perf_counter()-t)/N*1e6)
    buf = st.buffer(st.session(ref), h)
    out = bytearray(64); mv = memoryview(out)
    t=time.perf_counter()
    for _ in range(N): drv.memcpy_dtoh(mv, buf.ptr, 64)
    print("bare driver.memcpy_dtoh 64B us", (time.perf_counter()-t)/N*1e6)
    cProfile.runctx("for _ in range(N): one()", globals(), locals(), "/tmp/ip.prof")
    pstats.Stats("/tmp/ip.prof").sort_stats("tottime").print_stats(12)

def client(ep, tok, handle, n, q):
    s = zmq.Context().socket(zmq.DEALER); s.connect(ep + "-dev0")
    from protos.messages import encode_request
    h = encode_request(1, "read", tok, {"buffer": handle, "size": 64, "device": 0})
    for _ in range(200): s.send(h); s.recv_multipart()
    t = time.perf_counter()
    for _ in range(n): s.send(h); s.recv_multipart()
    q.put(n / (time.perf_counter() - t))

if __name__ == "__main__":
    if sys.argv[1:] == ["daemon"]:
        import daemon.worker as W
        orig = W.DeviceWorker._loop
        def loop(self):
            p = cProfile.Profile(); p.enable()
            try: orig(self)
            finally: p.disable(); p.dump_stats(f"/tmp/w{self.device}.prof")
        if os.environ.get("PROF"): W.DeviceWorker._loop = loop
        from daemon.cli import main
        sys.exit(main(["--backend", BACKEND, "--endpoint", os.environ["EP"], "--log-level", "ERROR", "--sim-devices", "1"]))
    inproc()
    for prof in ("", "1"):
        d = tempfile.mkdtemp(prefix="cuctxd"); ep = f"ipc://{d}/s.sock"
        p = subprocess.Popen([sys.executable, __file__, "daemon"], env={**os.environ, "EP": ep, "PROF": prof})
        from client import Client
        for _ in range(300):
            try: c = Client(ep, heartbeat=False, timeout=2); break
            except Exception: time.sleep(0.1)
        b = c.alloc(1024)
        ctx = mp.get_context("spawn"); q = ctx.Queue()
        for nproc in (1, 8):
            ps = [ctx.Process(target=client, args=(ep, c._token, b.handle, 5000, q)) for _ in range(nproc)]
            [x.start() for x in ps]; rates = [q.get() for _ in ps]; [x.join() for x in ps]
            print(f"prof={prof!r} {nproc} clients: {sum(rates):.0f} req/s")
        c.close(); p.terminate(); p.wait()
    pstats.Stats("/tmp/w0.prof").sort_stats("tottime").print_stats(25)
