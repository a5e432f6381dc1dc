"""Empty stand-ins for torchvision / torchaudio, installed only when they are not importable.

comfy.model_base imports model packages that import them at module level; nothing on the H3, LoRA
or sampling path uses them, and PyPI's wheels cannot load against the CPU torch build used here.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

NAMES = ("torchvision", "torchaudio")


class AbsentMediaPackages(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names):
        self.names = names

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.names:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def install():
    absent = [n for n in NAMES if importlib.util.find_spec(n) is None]
    if absent and not any(isinstance(f, AbsentMediaPackages) for f in sys.meta_path):
        sys.meta_path.append(AbsentMediaPackages(absent))
