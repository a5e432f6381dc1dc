"""Empty torchvision / torchaudio stand-ins where they are not installed (this CPU test machine).

scripts/test.sh puts this folder on PYTHONPATH; worker processes inherit the path and run it too.
Nothing in the series needs it: a ComfyUI install has both packages.
"""

import os
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import absent_media_packages  # noqa: E402

absent_media_packages.install()
