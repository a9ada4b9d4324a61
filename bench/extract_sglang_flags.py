"""Extract the CLI flags of SGLang's server parser on a CPU box (no GPU, torchvision stubbed)."""
import argparse
import importlib.abc
import importlib.machinery
import json
import sys
import types
from unittest import mock


class _Stub(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return mock.MagicMock(name=f"{self.__name__}.{name}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.partition(".")[0] == "torchvision":  # a package: the import system sets __path__
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _Stub(spec.name)
        m.__version__ = "0.26.0"  # type: ignore[attr-defined]
        return m

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
import sglang  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

p = argparse.ArgumentParser()
ServerArgs.add_cli_args(p)
flags = sorted({o for a in p._actions for o in a.option_strings if o.startswith("--")})
json.dump({"sglang": sglang.__version__, "flags": flags}, sys.stdout, indent=0)
