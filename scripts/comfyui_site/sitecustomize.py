"""Run this repository's modules as if the patch series were applied to the ComfyUI tree on sys.path.

The main job puts this folder on sys.path; worker processes inherit the path and run this file at
start-up: comfy.ldm.minimax.model resolves to the re-export in patches/overlay, and torchvision /
torchaudio get empty stand-ins where they are not installed (nothing on the H3 path uses them).
"""

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_OVERLAY = os.path.join(_ROOT, "patches", "overlay")
if _OVERLAY not in sys.path:
    sys.path.insert(0, _OVERLAY)
sys.path.append(os.path.join(_ROOT, "tests-unit"))
sys.path.append(os.path.join(_ROOT, "scripts"))
import absent_media_packages  # noqa: E402

absent_media_packages.install()
