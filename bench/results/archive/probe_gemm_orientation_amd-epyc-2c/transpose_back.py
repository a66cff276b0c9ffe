import numpy as np, time
rng=np.random.default_rng(0)
D=rng.standard_normal((180000,128),np.float32); q=rng.standard_normal((32,128),np.float32)
S1=np.empty((32,180000),np.float32)
qT=np.ascontiguousarray(q.T)
def t(f,n=7):
    f(); ts=[]
    for _ in range(n):
        t0=time.perf_counter(); f(); ts.append(time.perf_counter()-t0)
    return round(1e3*np.median(ts),1), round(1e3*min(ts),1)
for rnd in range(2):
    for b in (1024, 2048, 4096):
        tmp = np.empty((b, 32), np.float32)
        def g(b=b):
            for i in range(0,180000,b): np.matmul(q, D[i:i+b].T, out=S1[:, i:i+b])
        def h(b=b, tmp=tmp):
            for i in range(0,180000,b):
                m = min(b, 180000 - i)
                np.matmul(D[i:i+m], qT, out=tmp[:m])
                np.copyto(S1[:, i:i+m], tmp[:m].T)
        print(rnd, b, "q@D.T", t(g), "D@qT + transpose copy", t(h), flush=True)
s_ref = np.empty_like(S1); np.matmul(q, D.T, out=s_ref)
h()
print("max diff vs one GEMM", float(np.abs(S1 - s_ref).max()))
g()
print("q@D.T pieces diff", float(np.abs(S1 - s_ref).max()))
