import sys, numpy as np, json, os
out = os.environ.get("OUT", "/tmp")
a, b = np.load(f"{out}/ab_release_A1.npz"), np.load(f"{out}/ab_release_B1.npz")
print("bitwise equal:", {k: bool(np.array_equal(a[k], b[k], equal_nan=True)) for k in a.files})
r = {t: json.load(open(f"{out}/ab_release_{t}.json")) for t in ("A1", "B1", "A2", "B2")}
print("%-22s %8s %8s %8s %8s %6s" % ("cell", "off1", "on1", "off2", "on2", "on/off"))
for k in r["A1"]:
    off = (r["A1"][k] + r["A2"][k]) / 2; on = (r["B1"][k] + r["B2"][k]) / 2
    print("%-22s %8.4f %8.4f %8.4f %8.4f %6.3f" % (k, r["A1"][k], r["B1"][k], r["A2"][k], r["B2"][k], on / off))
