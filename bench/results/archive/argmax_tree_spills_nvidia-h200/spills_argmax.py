import sys
from concurrent.futures import ProcessPoolExecutor
sys.path.insert(0, "/work/main")
import lik_cupy._dispatch.select as sel
from lik_cupy._runtime.nvrtc import nvrtc_compile, resource_usage

def one(a):
    c, arch, group = a
    d = c.defines() | ({"LIK_TREE_GROUP": group} if group else {})
    try:
        o = nvrtc_compile("maxsim_fwd.cu", d, c.target(arch))
        return c.name, arch, group, resource_usage(o.log, c.name)
    except Exception as e:
        return c.name, arch, group, {"error": str(e)[-200:]}

if __name__ == "__main__":
    archs = [int(a) for a in sys.argv[1].split(",")]
    group = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    jobs = [(c, a, group) for a in archs for c in sel.all_forward_configs(a) if c.argmax]
    print(len(jobs), "argmax configs", flush=True)
    with ProcessPoolExecutor(2) as ex:
        for name, arch, g, r in ex.map(one, jobs, chunksize=4):
            bad = "error" in r or r["spill_stores"] or r["stack"] or r["wgmma_serialized"]
            print("PROBLEM" if bad else "ok", name, arch, g, r, flush=True)
