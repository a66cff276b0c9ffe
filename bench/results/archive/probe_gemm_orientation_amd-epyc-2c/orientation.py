import numpy as np, time
rng=np.random.default_rng(0)
D=rng.standard_normal((180000,128),np.float32); q=rng.standard_normal((32,128),np.float32)
S2=np.empty((180000,32),np.float32); S1=np.empty((32,180000),np.float32)
qT=np.ascontiguousarray(q.T)
def t(f,n=7):
    f(); ts=[]
    for _ in range(n):
        t0=time.perf_counter(); f(); ts.append(time.perf_counter()-t0)
    return round(1e3*np.median(ts),1), round(1e3*min(ts),1)
res = {}
for rnd in range(2):
    for b in (1024, 2048, 4096):
        def f(b=b):
            for i in range(0,180000,b): np.matmul(D[i:i+b], qT, out=S2[i:i+b])
        def g(b=b):
            for i in range(0,180000,b): np.matmul(q, D[i:i+b].T, out=S1[:, i:i+b])
        def h(b=b):  # D-major product written transposed into S1's columns
            for i in range(0,180000,b): np.matmul(D[i:i+b], qT, out=S1[:, i:i+b].T)
        print(rnd, b, "D@qT", t(f), "q@D.T", t(g), "D@qT into S1.T", t(h), flush=True)
