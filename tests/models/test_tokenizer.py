"""`load_tokenizer` parses a directory's tokenizer once per process, hands every caller a copy of its own, and
parses again when a file of the directory changes."""

from __future__ import annotations

import json
import os
import shutil

import transformers

from hstap.models import load_tokenizer
from hstap.models.target import resolve_model_dir


def test_one_parse_per_directory_each_caller_its_own_copy_and_a_changed_file_parsed_again(tmp_path, monkeypatch):
    real, _ = resolve_model_dir("smollm2")
    model = tmp_path / "model"
    shutil.copytree(real, model, copy_function=os.symlink)  # links: the weights are not copied
    parses = []
    parse = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *a, **kw: parses.append(a[0]) or parse(*a, **kw))

    first, second = load_tokenizer(str(model)), load_tokenizer(str(model))
    assert len(parses) == 1 and first is not second
    chat = [{"role": "user", "content": "Name three rivers."}]
    assert second.apply_chat_template(chat) == first.apply_chat_template(chat)
    assert second.pad_token == first.pad_token == "<|im_end|>"
    first.padding_side = "left"  # one caller's setting stays its own
    assert second.padding_side == load_tokenizer(str(model)).padding_side == "right" and len(parses) == 1

    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").unlink()  # a file of its own: the edit must not write through the link
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 1234}))
    assert load_tokenizer(str(model)).model_max_length == 1234 and len(parses) == 2
