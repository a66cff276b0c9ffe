import dataclasses, functools
from lik_cupy._dispatch.config import FwdConfig

@dataclasses.dataclass(frozen=True, kw_only=True)
class Var(FwdConfig):
    tag: str = ""
    pp: bool = False
    rel: bool = False
    wgq: bool = False
    ctas: int = 0
    group: int = -1
    @functools.cached_property
    def name(self):
        return FwdConfig.name.func(self) + ("_" + self.tag if self.tag else "")
    @property
    def wide_registers(self):
        return bool(self.ctas) or FwdConfig.wide_registers.fget(self)
    @functools.cached_property
    def min_blocks(self):
        return self.ctas or FwdConfig.min_blocks.func(self)
    def defines(self):
        d = FwdConfig.defines(self)
        if self.rel: d["LIK_SCALED_RELEASE"] = 1
        if self.pp: d["LIK_PINGPONG"] = 1
        if self.wgq: d["LIK_WGQREG"] = 1
        if self.group >= 0: d["LIK_TREE_GROUP"] = self.group
        d["LIK_NAME"] = self.name
        return d

def var(base, tag, **kw):
    return Var(**{k: getattr(base, k) for k in FwdConfig.__dataclass_fields__} | kw, tag=tag)
