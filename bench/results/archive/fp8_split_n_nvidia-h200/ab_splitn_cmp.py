import numpy as np, json, os, sys
out = os.environ.get("OUT", "/tmp")
tags = sys.argv[1:]  # e.g. A B C D, rounds 1 and 2
base = np.load(f"{out}/ab_splitn_{tags[0]}1.npz")
for t in tags[1:]:
    o = np.load(f"{out}/ab_splitn_{t}1.npz")
    print(t, "bitwise equal to", tags[0], [k for k in base.files if k in o.files and not np.array_equal(base[k], o[k], equal_nan=True)] or "all")
r = {t: [json.load(open(f"{out}/ab_splitn_{t}{i}.json")) for i in (1, 2)] for t in tags}
print("%-22s" % "cell" + "".join("%9s" % t for t in tags) + "".join("%8s" % (t + "/" + tags[0]) for t in tags[1:]))
for k in r[tags[0]][0]:
    m = {t: np.mean([x.get(k, np.nan) for x in r[t]]) for t in tags}
    print("%-22s" % k + "".join("%9.4f" % m[t] for t in tags) + "".join("%8.3f" % (m[t] / m[tags[0]]) for t in tags[1:]))
