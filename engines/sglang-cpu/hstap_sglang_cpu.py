"""Lets the CUDA-linked torchvision wheel import beside the CPU torch in SGLang's CPU environment (`.venv-sglang`).

SGLang 0.5.20 imports torchvision at module level (`srt/utils/common.py:98`, `from torchvision.io import
decode_jpeg`; `srt/configs/deepseek_ocr.py:7-8`), but the only torchvision 0.28 wheel on PyPI (the one matching
torch 2.13) is linked against CUDA torch: its C++ operators do not load, and `torchvision/__init__.py` then dies in
`torchvision._meta_registrations` ("operator torchvision::nms does not exist") while registering fake kernels for
them. A text model never runs those operators, so that one module is pre-registered empty; the rest of torchvision
(transforms, io) imports as usual. Run at interpreter start-up by `hstap_sglang_cpu.pth`, which engines/sglang.sh
copies into the venv's site-packages.
"""

import sys
import types

sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))
