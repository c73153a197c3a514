"""One recipe stage each, through the stage library's public entry point; and what `--redo` deletes first.

    result = STAGE_RUNNERS["synth"](configs, shared, fresh=False)     # SynthResult; it prints its own progress

Prompts (Magpie) and embedded synth share one loaded target; it is let go, with the device's cached memory, before
training loads its own. Synth through an engine the recipe starts (`serve:`) runs between `served`'s start
and stop (hstap.serve.supervisor): the engine's memory is free again before training.
"""

from __future__ import annotations

import gc
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from hstap.errors import HstapError

SERVE_HINTS = {  # how the exported drafter is served (the chain of 3 the recipe evaluates), docs/recipe.md
    "sglang": "python -m sglang.launch_server --model-path TARGET --speculative-algorithm EAGLE3 "
              "--speculative-draft-model-path {out} --speculative-num-steps 3 --speculative-eagle-topk 1 "
              "--speculative-num-draft-tokens 4",
    "vllm": "vllm serve TARGET --speculative-config "
            "'{{\"method\": \"eagle3\", \"model\": \"{out}\", \"num_speculative_tokens\": 3}}'",
}


def free_device_memory() -> None:
    """Drop what the last stage left and hand the CUDA allocator's cache back, so the next stage (or an engine in
    another process) finds the device's memory free."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


class SharedTarget:
    """The embedded target, loaded once for the stages that generate with it (Magpie prompts, embedded synth)."""

    def __init__(self) -> None:
        self.key: tuple[str, str] | None = None
        self.target = None

    def get(self, model: str, device: str):
        if self.key != (model, device):
            from hstap.models import load_target

            self.release()
            self.target, self.key = load_target(model, device=device), (model, device)
        return self.target

    def release(self) -> None:
        self.target = self.key = None
        free_device_memory()


def run_prompts(configs: dict, shared: SharedTarget, fresh: bool):
    from hstap.synth.prompts import build_prompts

    cfg = configs["prompts"]
    target = shared.get(cfg.model, cfg.device) if "magpie" in cfg.weights() else None
    return build_prompts(cfg, target=target)


def run_synth_stage(configs: dict, shared: SharedTarget, fresh: bool):
    from hstap.synth.run import run_synth

    cfg, serve = configs["synth"], configs["serve"]
    if serve is not None:
        shared.release()  # the engine needs the device's memory
        from hstap.serve.supervisor import served

        with served(serve):
            return run_synth(cfg)
    if cfg.backend == "server":
        return run_synth(cfg)
    return run_synth(cfg, target=shared.get(cfg.model, cfg.device))


def run_capture_stage(configs: dict, shared: SharedTarget, fresh: bool):
    from hstap.capture.run import run_capture

    shared.release()
    return run_capture(configs["capture"])


def run_train_stage(configs: dict, shared: SharedTarget, fresh: bool):
    """Continue the run in OUT/drafter from its checkpoint if it has one; otherwise, or when `fresh`, start afresh
    there (`--overwrite`: a run killed before its first checkpoint left nothing worth keeping)."""
    from hstap.train import checkpoint
    from hstap.train.run import run_train

    shared.release()
    cfg = configs["train"]
    resume = not fresh and checkpoint.exists(Path(cfg.out))
    result = run_train(cfg.model_copy(update={"resume": resume, "overwrite": not resume}))
    result.drafter = None  # the weights are on disk; the next stages load their own
    return result


def run_eval_stage(configs: dict, shared: SharedTarget, fresh: bool):
    from hstap.evaluate.run import run_eval

    shared.release()
    return run_eval(configs["eval"])


def run_export_stage(configs: dict, shared: SharedTarget, fresh: bool) -> Path:
    from hstap.export.write import export_drafter

    cfg = configs["export"]
    out = export_drafter(cfg.drafter, cfg.format, cfg.out, dtype=cfg.dtype, include_embedding=cfg.with_embedding,
                         force=True)  # the recipe's own directory: a re-run replaces it
    print(f"exported {cfg.drafter} as {cfg.format} ({cfg.dtype}) to {out}, checked against the drafter\n"
          f"  serve: {SERVE_HINTS[cfg.format].format(out=out)}")
    return out


STAGE_RUNNERS: dict[str, Callable] = {"prompts": run_prompts, "synth": run_synth_stage, "capture": run_capture_stage,
                                      "train": run_train_stage, "eval": run_eval_stage, "export": run_export_stage}


def outputs(stage: str, configs: dict) -> list[Path]:
    """What `--redo STAGE` deletes before the stage runs again: the outputs its own resume would continue. Train
    starts afresh with `--overwrite` (which deletes only the files a run writes), eval and export replace theirs."""
    cfg = configs[stage]
    if stage == "prompts":
        return [cfg.out, cfg.provenance_path()]
    if stage == "synth":
        return [cfg.out, cfg.out.with_suffix(".failed.jsonl")]
    return [cfg.out] if stage == "capture" else []


def clear_outputs(stage: str, configs: dict, out: Path) -> None:
    """Delete `outputs(stage)`; only inside the recipe's `out`, where the recipe put them (a path the file points
    elsewhere is the user's to delete)."""
    root = Path(out).resolve()
    for path in map(Path, outputs(stage, configs)):
        if (path.exists() or path.is_symlink()) and not path.resolve().is_relative_to(root):
            raise HstapError(f"--redo {stage}: {path} is outside the recipe's out {out}: not deleted; move it away "
                             "yourself and run again")
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
