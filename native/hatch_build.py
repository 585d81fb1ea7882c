"""Hatch build hook: compile libcapstan.

Runs for wheels and editable installs alike. The library is written into
src/capstan/native/lib/ in the source tree: an editable install imports from
src/ through a .pth file, so that is where the import finds it; a wheel
ships it via `force_include`. The wheel is tagged py3-none-<platform>
because the library is native code but uses no Python C API.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build_native  # noqa: E402


class CustomBuildHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict) -> None:
        if self.target_name != "wheel":
            return
        if os.environ.get("CAPSTAN_NATIVE_TARGET"):
            # The wheel is tagged for this host; a cross build would mislabel it.
            raise RuntimeError("capstan-native: wheels build for the host only; unset "
                               "CAPSTAN_NATIVE_TARGET (use build_native.py --target --out)")
        out = Path(self.root) / "src" / "capstan" / "native" / "lib"
        build_native.build_all(out)
        build_data["pure_python"] = False
        platform_tag = sysconfig.get_platform().replace("-", "_").replace(".", "_")
        build_data["tag"] = f"py3-none-{platform_tag}"
        if version != "editable":
            for f in out.iterdir():
                if f.suffix in (".so", ".json"):
                    build_data["force_include"][str(f)] = f"capstan/native/lib/{f.name}"
