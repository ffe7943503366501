"""`Module`: an nn.Module made cheap to call and to read, for inference hot paths.

- Its call goes straight to forward while no hook is registered on the instance.
  nn.Module's __call__ checks its instance and global hook tables on every call: 0.8 us
  where this costs 0.2, and a decode step at batch 1 makes about 45 module calls. A hook
  registered on an instance is honoured (the call then goes through nn.Module's); hooks
  registered globally (register_module_forward_hook) are not seen by these modules.
- Reading a submodule or a parameter (`self.qkv_proj`, `self.weight`) goes through
  nn.Module.__getattr__, a Python function, on every access: about 85 a step. The first
  read keeps the value in the instance's __dict__, where Python finds it directly. The copy
  goes whenever the attribute is assigned or deleted and whenever the module is converted
  (`to`, `half`, ..., which may replace parameters without assigning them). Buffers are
  not kept.
"""
from __future__ import annotations

from torch import nn

_KEPT = "_kept_attrs"  # names whose values this instance keeps in its __dict__


class Module(nn.Module):
    def __call__(self, *args, **kwargs):
        if self._forward_hooks or self._forward_pre_hooks or self._backward_hooks or self._backward_pre_hooks:
            return nn.Module.__call__(self, *args, **kwargs)
        return self.forward(*args, **kwargs)

    def __getattr__(self, name: str):
        value = nn.Module.__getattr__(self, name)
        d = self.__dict__
        if name in d.get("_parameters", ()) or name in d.get("_modules", ()):
            d[name] = value
            d.setdefault(_KEPT, set()).add(name)
        return value

    def __setattr__(self, name: str, value) -> None:
        self._forget(name)
        nn.Module.__setattr__(self, name, value)
        self._forget(name)  # (registering reads the old value through __getattr__, which kept it again)

    def __delattr__(self, name: str) -> None:
        self._forget(name)
        nn.Module.__delattr__(self, name)
        self._forget(name)

    def _apply(self, fn, recurse: bool = True):
        for name in list(self.__dict__.get(_KEPT, ())):
            self._forget(name)
        return super()._apply(fn, recurse)

    def _forget(self, name: str) -> None:
        kept = self.__dict__.get(_KEPT)
        if kept and name in kept:
            kept.discard(name)
            self.__dict__.pop(name, None)
