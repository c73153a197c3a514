"""Replace the package's shipped drafter with one a GPU session trained, and record the session in its provenance.

    python lab/ship_drafter.py /tmp/run/drafter_bf16 --run-dir /tmp/run/drafter \
        --spec-log lab/logs/h200-DATE/spec_b1.jsonl --note "lab/logs/h200-DATE (the Nth GPU run)" \
        --command "bash lab/h200_recipe.sh start" [--name smollm2-recipe]

DRAFTER is the bf16 copy without the embedding that the recipe ships back (`ship_drafter` in
lab/h200_recipe.sh); --run-dir holds that run's metrics.jsonl and train_config.json (steps, tokens, settings);
--spec-log is the MT-bench log of that drafter (`bench/spec_decode.py --log`), whose τ and speedups are recorded.
Refused when the new drafter is for another target or layers, or when the run did not start from the shipped one
(`--init-from NAME`, or `--continued-from PATH` for a second training in one session from the drafter its first
training shipped) and `--from-zero` is not given: a shipped drafter's history must stay one chain of sessions.
"""

from __future__ import annotations

import argparse
import datetime
import json
import lzma
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # for bench/spec_decode.py's summary

from spec_decode import summary  # noqa: E402

from hstap.drafter import DrafterConfig  # noqa: E402
from hstap.drafter.integrity import checksum_record, load_weights, write_checksum  # noqa: E402
from hstap.drafter.shipped import PACKED, SHIPPED  # noqa: E402
from hstap.train.run import load_metrics  # noqa: E402


def session_record(run_dir: Path, note: str, command: str) -> dict:
    cfg = json.loads((run_dir / "train_config.json").read_text())
    trains = [r for r in load_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    tokens = trains[-1].get("tokens") if trains else 0  # cumulative in the run (runs before 2026-12-02: absent)
    return {"date": datetime.date.today().isoformat(), "run": note, "command": command,
            "init_from": cfg.get("init_from"), "data": cfg.get("data"), "steps": trains[-1]["step"] if trains else 0,
            "tokens_trained": tokens, "lr": cfg.get("lr"), "ttt_steps": cfg.get("ttt_steps"),
            "draft_vocab": cfg.get("draft_vocab"), "tokens_per_s": trains[-1].get("tokens_per_s") if trains else None}


def mt_bench(spec_log: Path) -> dict:
    records = [json.loads(line) for line in spec_log.read_text().splitlines() if line.strip()]
    figures = {m: f for m, f in summary(records).items() if m != "vanilla"}
    return {"prompts": len(records), "tau": {m: round(f["tau"], 2) for m, f in figures.items()},
            "speedup": {m: round(f["speedup"], 2) for m, f in figures.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("drafter", type=Path)
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--spec-log", type=Path, required=True)
    ap.add_argument("--note", required=True, help="where the session's logs are")
    ap.add_argument("--command", required=True, help="the command that trained it")
    ap.add_argument("--name", default="smollm2-recipe")
    ap.add_argument("--from-zero", action="store_true", help="start a new history (the run did not --init-from NAME)")
    ap.add_argument("--continued-from", metavar="PATH",
                    help="the run's --init-from was this path: the drafter a first training of the same device "
                         "session had shipped (a second segment of that session; ship the first one before it)")
    args = ap.parse_args()
    dest = SHIPPED / args.name
    new = DrafterConfig.load(args.drafter / "config.json")
    session = session_record(args.run_dir, args.note, args.command)
    provenance = json.loads((dest / "provenance.json").read_text()) if (dest / "provenance.json").exists() else {}
    if (dest / "config.json").exists():
        old = DrafterConfig.load(dest / "config.json")
        if (old.target_fingerprint, old.aux_layer_ids) != (new.target_fingerprint, new.aux_layer_ids):
            raise SystemExit(f"{args.drafter}: target {new.target_fingerprint} layers {new.aux_layer_ids}, the shipped "
                             f"{args.name} is for {old.target_fingerprint} layers {old.aux_layer_ids}")
    if not args.from_zero and session["init_from"] not in (args.name, args.continued_from):
        raise SystemExit(f"{args.run_dir} started from {session['init_from']!r}, not {args.name!r}: pass --from-zero "
                         "to replace the shipped drafter's history")
    sessions = [] if args.from_zero else provenance.get("sessions", [])
    sessions.append(session)
    provenance.update(sessions=sessions, mt_bench=mt_bench(args.spec_log),
                      total={"steps": sum(s["steps"] for s in sessions),
                             "tokens_trained": sum(s["tokens_trained"] or 0 for s in sessions)})
    checked = checksum_record(args.drafter / "model.safetensors")
    load_weights(args.drafter)  # its own checksum (when it has one), header and finite numbers: never ship a NaN
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(args.drafter / "config.json", dest / "config.json")
    with open(args.drafter / "model.safetensors", "rb") as f_in, \
            lzma.open(dest / f"{PACKED}.tmp", "wb", preset=9 | lzma.PRESET_EXTREME) as f_out:
        shutil.copyfileobj(f_in, f_out, 1 << 20)
    (dest / f"{PACKED}.tmp").replace(dest / PACKED)
    write_checksum(dest, checked)  # the unpacked weights' checksum, which every load of the shipped drafter checks
    (dest / "provenance.json").write_text(json.dumps(provenance, indent=2) + "\n")
    print(f"{dest}: {(dest / PACKED).stat().st_size / 1e6:.1f} MB, {len(sessions)} session(s), "
          f"{provenance['total']['tokens_trained']:,} tokens in all; MT-bench τ {provenance['mt_bench']['tau']}")


if __name__ == "__main__":
    main()
