"""One keep-alive client, one request at a time: median end-to-end time and the response's queue_us and compute_us."""
import json, socket, statistics, time

def client(port, payloads, n=1500, params=True):
    s = socket.create_connection(("127.0.0.1", port)); s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    f = s.makefile('rb')
    e2e, qus, cus = [], [], []
    for i in range(n):
        t0 = time.perf_counter()
        s.sendall(payloads[i % len(payloads)])
        head = b''
        while True:
            line = f.readline(); head += line
            if line == b'\r\n': break
        hl = dict(x.split(b': ', 1) for x in head.split(b'\r\n')[1:] if b': ' in x)
        body = f.read(int(hl[b'content-length']))
        t1 = time.perf_counter()
        if i >= 200:
            e2e.append(t1 - t0)
            if params:
                h = json.loads(body[:int(hl[b'inference-header-content-length'])])
                qus.append(h['parameters']['queue_us']); cus.append(h['parameters']['compute_us'])
    s.close()
    m = statistics.median
    return m(e2e) * 1e3, (m(qus) / 1e3 if qus else 0), (m(cus) / 1e3 if cus else 0)

