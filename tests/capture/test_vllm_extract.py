"""vLLM's extract_hidden_states route, without vLLM: the id conversion, the connector-file conversion against
SmolLM2's real weights, and `capture-remote --vllm-route extract` against a stand-in server that writes files in
vLLM's connector format (`{"hidden_states": [T, n, H], "token_ids": [T]}` + a `.lock`) from transformers' states.

The stand-in computes what vLLM 0.32.0's model hands the connector: for aux id j, the residual stream after decoder
layer j - 1 (transformers' `hidden_states[j]` for j < L; for j = L the last layer's output *before* the final norm,
taken with a hook, since transformers' last entry is post-norm). The live test (tests/live/test_vllm_extract.py)
checks the same files from a real vLLM.
"""

from __future__ import annotations

import fcntl
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hstap.capture.engine_session import EngineCaptureConfig
from hstap.capture.vllm_extract import (
    PLAN_NAME,
    FinalNorm,
    Refused,
    plan_for,
    read_connector_file,
    to_sample,
    vllm_layer_ids,
    write_plan,
)
from hstap.cli import main
from hstap.data import SkipReport, render_all
from hstap.errors import HstapError
from hstap.store import open_store
from hstap.store.compare import compare_stores

CONVERSATIONS = [
    [("user", "What is the capital of France?"), ("assistant", "The capital of France is Paris.")],
    [("user", "Name three primary colors."), ("assistant", "Red, yellow and blue."),
     ("user", "And the secondary ones?"), ("assistant", "Green, orange and purple.")],
    [("system", "You answer in one word."), ("user", "Opposite of hot?"), ("assistant", "Cold.")],
]


def test_canonical_layer_k_is_vllm_aux_id_k_plus_1_and_the_last_layer_is_added_for_the_teacher():
    assert vllm_layer_ids([1, 14, 26], 30) == [2, 15, 27, 30]
    assert vllm_layer_ids([26, 1, 14], 30) == [2, 15, 27, 30]  # vLLM stacks in layer order, whatever the config says
    assert vllm_layer_ids([1, 29], 30) == [2, 30]  # layer 29 is the teacher's input too: asked once
    with pytest.raises(HstapError, match=r"--capture-layers \[30\]: expected canonical ids in \[0, 29\]"):
        vllm_layer_ids([30], 30)


def test_the_route_refuses_a_model_type_vllm_gives_no_aux_states_for(tmp_path: Path):
    """Mixtral: vLLM 0.32.0's MixtralForCausalLM does not implement SupportsEagle3 (no aux outputs)."""
    plan_dir = tmp_path  # a directory holding config.json alone is a checkpoint for the flags
    (plan_dir / "config.json").write_text(json.dumps({"model_type": "mixtral", "num_hidden_layers": 4, "hidden_size": 8,
                                                      "rms_norm_eps": 1e-5}))
    capture = EngineCaptureConfig(out=tmp_path / "cap", layers=[1], num_layers=4, hidden_size=8)
    with pytest.raises(HstapError) as err:
        plan_for(capture, str(plan_dir))
    assert "model_type 'mixtral'" in str(err.value) and "use --vllm-route extension" in str(err.value)
    assert "\n" not in str(err.value)


def test_hstap_serve_launches_vllm_with_the_extract_method_its_ids_and_hstaps_connector(tmp_path: Path):
    """The engine command of `hstap serve --vllm-route extract`: vLLM's ids (canonical + 1, and L), the connector
    writing into DIR/vllm-hidden-states, no dev endpoint and no forced eager mode; the flags hstap sets refused."""
    from hstap.serve.config import ServeConfig
    from hstap.serve.supervisor import Supervisor

    cfg = ServeConfig(engine="vllm", vllm_route="extract", model="smollm2", capture_dir=tmp_path / "cap",
                      capture_layers="1,14,26", run_dir=tmp_path / "run", extra=["--", "--dtype", "bfloat16"])
    argv, env = Supervisor(cfg).command()
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert spec == {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                    "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [2, 15, 27, 30]}}}
    assert kv["kv_connector"] == "HstapHiddenStatesConnector"
    assert kv["kv_connector_module_path"] == "hstap.capture.vllm_extract_connector"
    assert kv["kv_connector_extra_config"]["shared_storage_path"] == str((tmp_path / "cap").resolve() /
                                                                         "vllm-hidden-states")
    assert "--no-enable-prefix-caching" in argv and argv[-2:] == ["--dtype", "bfloat16"]
    assert "--enforce-eager" not in argv and "--worker-extension-cls" not in argv and env == {}
    for flag in (["-sc", "{}"], ["--kv-transfer-config={}"], ["--enable-prefix-caching"]):
        with pytest.raises(HstapError, match="breaks capture"):
            Supervisor(cfg.model_copy(update={"extra": flag})).command()
    with pytest.raises(HstapError, match="--vllm-route extract needs --capture-dir"):
        Supervisor(cfg.model_copy(update={"capture_dir": None, "capture_layers": None})).command()


@pytest.fixture(scope="module")
def bf16_target():
    from hstap.models import load_target

    return load_target("smollm2", dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan") / "cap"
    capture = EngineCaptureConfig.for_checkpoint("smollm2", "auto", out, "vllm")
    return plan_for(capture, "smollm2")


def vllm_file_tensors(target, ids: list[int], vllm_ids: list[int]) -> dict[str, torch.Tensor]:
    """What vLLM's connector writes for a prefill of `ids` (see the module docstring)."""
    model = target.model
    last = {}
    handle = model.model.layers[-1].register_forward_hook(lambda m, a, out: last.__setitem__("h", out))
    try:
        with torch.no_grad():
            hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    finally:
        handle.remove()
    L = model.config.num_hidden_layers
    cols = [hs[j][0] if j < L else (last["h"][0] if isinstance(last["h"], tuple) else last["h"])[0] for j in vllm_ids]
    return {"hidden_states": torch.stack(cols, dim=1).contiguous(), "token_ids": torch.tensor(ids, dtype=torch.long)}


@pytest.fixture(scope="module")
def data(tmp_path_factory, tokenizer):
    d = tmp_path_factory.mktemp("data")
    path = d / "synth.jsonl"
    path.write_text("".join(json.dumps({"id": f"conv-{i}", "messages": [{"role": r, "content": c} for r, c in t]})
                            + "\n" for i, t in enumerate(CONVERSATIONS)))
    return path, render_all(f"jsonl:{path}", tokenizer, SkipReport(), max_tokens=256)


def test_a_connector_file_becomes_the_canonical_layers_and_the_normed_teacher(bf16_target, plan, data):
    """Against transformers on the same tokens: hidden.k = hidden_states[k + 1] exactly, teacher.hidden = the
    final norm's output exactly (same weights, same rounding as vLLM's RMSNorm and transformers' LlamaRMSNorm)."""
    sample = data[1][1]
    raw = vllm_file_tensors(bf16_target, sample.input_ids, plan.vllm_ids)
    out = to_sample(raw, sample.input_ids, sample.loss_mask, plan, FinalNorm(plan))
    with torch.no_grad():
        hs = bf16_target.model(torch.tensor([sample.input_ids]), output_hidden_states=True).hidden_states
    assert sorted(out) == ["hidden.1", "hidden.14", "hidden.26", "input_ids", "loss_mask", "teacher.hidden"]
    for k in plan.layers:
        assert torch.equal(out[f"hidden.{k}"], hs[k + 1][0]), k
        assert not torch.equal(out[f"hidden.{k}"], hs[k][0])  # an off-by-one would be caught
    assert out["teacher.hidden"].dtype == torch.bfloat16
    assert torch.equal(out["teacher.hidden"], hs[-1][0])
    assert out["input_ids"].tolist() == sample.input_ids and out["loss_mask"].tolist() == sample.loss_mask


def test_a_file_of_other_tokens_or_another_layer_count_is_refused(bf16_target, plan, data):
    a, b = data[1][0], data[1][2]
    raw = vllm_file_tensors(bf16_target, a.input_ids, plan.vllm_ids)
    with pytest.raises(Refused) as err:
        to_sample(raw, b.input_ids, b.loss_mask, plan, FinalNorm(plan))
    assert err.value.kind == "token_mismatch"
    short = {"hidden_states": raw["hidden_states"][:, :3], "token_ids": raw["token_ids"]}
    with pytest.raises(Refused) as err:
        to_sample(short, a.input_ids, a.loss_mask, plan, FinalNorm(plan))
    assert err.value.kind == "bad_shape" and "[2, 15, 27, 30]" in str(err.value)


def test_the_reader_waits_for_the_connectors_lock_and_gives_up_on_a_file_that_never_comes(tmp_path: Path):
    path = tmp_path / "req-1.safetensors"
    lock = open(f"{path}.lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)  # what the connector holds from scheduling until the file is written

    def write_late():
        time.sleep(0.5)
        save_file({"hidden_states": torch.zeros(2, 1, 4), "token_ids": torch.tensor([5, 6])}, str(path))
        lock.close()

    writer = threading.Thread(target=write_late)
    start = time.monotonic()
    writer.start()
    got = read_connector_file(path, wait_s=5)
    writer.join()
    assert time.monotonic() - start >= 0.45 and got["token_ids"].tolist() == [5, 6]
    with pytest.raises(Refused) as err:
        read_connector_file(tmp_path / "never.safetensors", wait_s=0.3)
    assert err.value.kind == "missing_file" and "same machine or shared storage" in str(err.value)


class _FakeExtractServer:
    """Answers `/v1/completions` like a vLLM server of the extract route: writes the connector file (lock held while
    writing), returns its path in `kv_transfer_params`. `wrong_tokens`: sample ids whose file holds other tokens."""

    def __init__(self, target, plan, samples, storage: Path, wrong_tokens: set[str] = frozenset(),
                 no_path: bool = False) -> None:
        self.files = {tuple(s.input_ids): (s.id, vllm_file_tensors(target, s.input_ids, plan.vllm_ids))
                      for s in samples}
        self.storage, self.wrong, self.no_path, self.requests = storage, wrong_tokens, no_path, 0
        self._count = threading.Lock()  # requests arrive on several threads: one file name each
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                return None

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.end_headers()
                self.wfile.write(json.dumps(fake.answer(body["prompt"])).encode())

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def answer(self, prompt: list[int]) -> dict:
        with self._count:
            self.requests += 1
            path = self.storage / f"cmpl-{self.requests}.safetensors"
        sid, tensors = self.files[tuple(prompt)]
        if sid in self.wrong:
            tensors = {**tensors, "token_ids": tensors["token_ids"] + 1}
        self.storage.mkdir(parents=True, exist_ok=True)
        with open(f"{path}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            save_file(tensors, str(path))
        params = None if self.no_path else {"hidden_states_path": str(path)}
        return {"choices": [{"text": "x"}], "kv_transfer_params": params}

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _capture_remote(url: str, data: Path, out: Path, *extra: str) -> int:
    return main(["capture-remote", "--vllm-route", "extract", "--url", url, "--data", f"jsonl:{data}",
                 "--capture-dir", str(out), "--max-tokens", "256", "--settle", "2", *extra])


def test_capture_remote_turns_the_files_into_a_store_that_matches_hstaps_own_capture(bf16_target, plan, data,
                                                                                      tmp_path: Path, capsys):
    """The store has canonical ids and the same manifest as `hstap capture`: `hstap compare` says MATCH against an
    embedded bf16 capture of the same conversations — bit for bit, with one sample per forward (padding a batch
    changes bf16 rounding) —; consumed files are deleted; a re-run resumes (sends nothing); it trains."""
    path, samples = data
    out = tmp_path / "cap"
    write_plan(plan.model_copy(update={"storage": out / "vllm-hidden-states"}))
    server = _FakeExtractServer(bf16_target, plan, samples, out / "vllm-hidden-states")
    try:
        assert _capture_remote(server.url, path, out) == 0
        report = capsys.readouterr().out
        assert "sent 3 samples (0 already in the store); 3 stored" in report and '"captured": 3' in report
        assert list((out / "vllm-hidden-states").iterdir()) == []
        store = open_store(out)
        assert sorted(store.ids()) == ["conv-0", "conv-1", "conv-2"]
        assert store.manifest.meta.layer_ids == [1, 14, 26] and store.manifest.meta.teacher.kind == "hidden"
        assert store.manifest.meta.extra["vllm_aux_ids"] == [2, 15, 27, 30]
        assert _capture_remote(server.url, path, out) == 0
        assert "sent 0 samples (3 already in the store); 3 stored" in capsys.readouterr().out
        assert server.requests == 3
    finally:
        server.close()
    ref = tmp_path / "ref"
    assert main(["capture", "--data", f"jsonl:{path}", "--out", str(ref), "--teacher", "hidden",
                 "--target-dtype", "bf16", "--max-tokens", "256", "--batch-tokens", "1"]) == 0
    capsys.readouterr()
    assert main(["compare", str(out), str(ref)]) == 0, capsys.readouterr().out
    assert "verdict: MATCH" in capsys.readouterr().out
    stats = compare_stores(out, ref).tensors
    assert sorted(stats) == ["hidden.1", "hidden.14", "hidden.26", "teacher.hidden"]
    assert all(s.max_abs == 0 for s in stats.values()), {n: s.max_abs for n, s in stats.items()}
    # the store trains like any `--teacher hidden` store (its teacher is the recomputed final norm)
    assert main(["train", "--store", str(out), "--out", str(tmp_path / "run"), "--max-steps", "1"]) == 0


def test_files_with_other_tokens_are_counted_and_never_stored(bf16_target, plan, data, tmp_path: Path, capsys):
    path, samples = data
    out = tmp_path / "cap"
    write_plan(plan.model_copy(update={"storage": out / "vllm-hidden-states"}))
    server = _FakeExtractServer(bf16_target, plan, samples, out / "vllm-hidden-states", wrong_tokens={"conv-1"})
    try:
        assert _capture_remote(server.url, path, out) == 1
    finally:
        server.close()
    report = capsys.readouterr().out
    assert "2 stored" in report and '"token_mismatch": 1' in report and "1 never reached the store" in report
    assert "conv-1: the file's" in report
    assert sorted(open_store(out).ids()) == ["conv-0", "conv-2"]


def test_answers_without_a_file_path_and_a_directory_without_a_plan_are_one_line_errors(bf16_target, plan, data,
                                                                                        tmp_path: Path, capsys):
    path, samples = data
    out = tmp_path / "cap"
    assert _capture_remote("http://127.0.0.1:9", path, out) == 2
    err = capsys.readouterr().err
    assert f"no {PLAN_NAME}" in err and err.count("\n") == 1
    write_plan(plan.model_copy(update={"storage": out / "vllm-hidden-states"}))
    assert main(["capture-remote", "--url", "http://127.0.0.1:9", "--data", f"jsonl:{path}",
                 "--capture-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert "pass --vllm-route extract" in err and err.count("\n") == 1
    server = _FakeExtractServer(bf16_target, plan, samples, out / "vllm-hidden-states", no_path=True)
    try:
        assert _capture_remote(server.url, path, out) == 2
    finally:
        server.close()
    err = capsys.readouterr().err
    assert "3 prefills answered, none stored" in err and "no_path" in err and err.count("\n") == 1
