"""On the GPU machine the benchmarks borrow (not part of the series; bench/README.md says how it is used).

* ``av``: a stand-in where PyAV is not installed (comfy_api imports it; nothing on the H3 path uses it):
  every name of it is a placeholder.
* ``H3SP_EMULATED_GPU_GIB=G``: this process sees a G GiB GPU. torch's allocator refuses more
  (set_per_process_memory_fraction) and ``torch.cuda.mem_get_info``, which ComfyUI's memory planning reads,
  reports that card: total G, free G minus what this process holds. Several processes sharing one GPU
  then each plan and run as on a card of their own. Workers inherit the variable.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types


class _Placeholder(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {})


class _Absent(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "av":
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Placeholder(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


if importlib.util.find_spec("av") is None:
    sys.meta_path.append(_Absent())

_cap = os.environ.get("H3SP_EMULATED_GPU_GIB")
if _cap:
    import torch

    _limit = int(float(_cap) * 2**30)
    _real = torch.cuda.mem_get_info

    def mem_get_info(device=None):
        free, _ = _real(device)
        return max(0, min(free, _limit - torch.cuda.memory_reserved(device))), _limit

    def _cap_allocator():
        for i in range(torch.cuda.device_count()):
            torch.cuda.set_per_process_memory_fraction(min(1.0, _limit / torch.cuda.get_device_properties(i).total_memory), i)

    torch.cuda.mem_get_info = torch.cuda.memory.mem_get_info = mem_get_info
    torch.cuda._lazy_call(_cap_allocator)
