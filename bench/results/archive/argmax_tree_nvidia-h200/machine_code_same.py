# Compile the scores-only forward picks with this tree's cuda_src; hash each cubin's .text sections (machine code).
import hashlib, struct
from lik_cupy import _dispatch as d
from lik_cupy._runtime.nvrtc import nvrtc_compile

def text_sections(elf: bytes):
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    stro = secs[shstrndx][4]
    out = {}
    for s in secs:
        name = elf[stro + s[0]:elf.index(b"\0", stro + s[0])].decode()
        if name.startswith(".text."):
            out[name] = hashlib.sha256(elf[s[4]:s[4] + s[5]]).hexdigest()[:12]
    return out

cells = [("float16", 1024, 1, 1024, False, False), ("float32", 1024, 1, 1024, False, False),
         ("float32", 1024, 1, 1024, True, False), ("float8_e4m3fn", 1024, 1, 1024, False, False),
         ("float16", 32, 32, 180, False, False), ("float32", 32, 1, 300, True, False),
         ("float16", 1024, 1, 1024, False, True), ("float16", 32, 1, 80, False, True)]
for dtype, lq, sq, ld, x3, am in cells:
    cfg = d.choose_forward(90, dtype, 128, lq, am, True, True, sq, ld, False, True, x3)
    c = nvrtc_compile("maxsim_fwd.cu", cfg.defines(), "90a")
    print(cfg.name, text_sections(c.cubin), flush=True)
