"""Why the graphed trainer's capture fails on a GPU where bench/train_throughput.py --graph captures: the GPU test
tests/train/test_graphed.py::test_replayed_steps_equal_eager_steps_and_accumulate_like_backward, with variants.

    python lab/graphed_diag.py VARIANT     # base | warn-error | del-loss | plain-mm | gc | no-eager-first | trainer

Prints whether the two shapes captured and, with warn-error, where autograd saw an AccumulateGrad node on
another stream (the warning turned into an exception: its traceback names the step)."""

from __future__ import annotations

import gc
import sys
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, for tests/'s helpers
from hstap.train import graphed as G  # noqa: E402
from hstap.train import shared  # noqa: E402
from hstap.train.graphed import GraphedTTT, bucket_length, pad_batch  # noqa: E402
from hstap.train.ttt import TTTModel, autocast, batch_tensors  # noqa: E402
from tests.train.test_attention import _tiny_drafter  # noqa: E402
from tests.train.test_graphed import _batch  # noqa: E402

variant = sys.argv[1]
G.first_line = lambda e: (traceback.print_exception(e), str(e).splitlines()[0] if str(e) else type(e).__name__)[1]
if variant == "warn-error":
    warnings.filterwarnings("error", message=".*AccumulateGrad node's stream.*")
if variant == "plain-mm":
    shared.ENABLED = False
if variant == "gc":
    orig = G.GraphedTTT._capture

    def capture(self, batch, ac):
        gc.collect()
        return orig(self, batch, ac)
    G.GraphedTTT._capture = capture
torch.manual_seed(0)
drafter, t2d_ids = _tiny_drafter()
drafter = drafter.cuda()
model = TTTModel(drafter, t2d_ids.cuda(), steps=3, decay=0.8)
batches = [_batch(2, s, [s, s - 3], seed=k).to("cuda") for k, s in enumerate((30, 100, 31, 97))]
device = torch.device("cuda")
try:
    if variant == "trainer":  # as hstap train --cuda-graphs --grad-accum 2 runs it: an eager model first, then
        # a fresh one graphed with padded rows, AdamW steps and gradients zeroed in place
        for batch in batches[:2]:
            with autocast(device):
                model(*batch_tensors(batch))[0].backward()
        torch.manual_seed(1)
        drafter, t2d_ids = _tiny_drafter()
        drafter = drafter.cuda()
        model = TTTModel(drafter, t2d_ids.cuda(), steps=3, decay=0.8)
        opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-3)
        graphed = GraphedTTT(model, grad_scale=1 / 2, batch_tokens=512)
        losses = []
        for step in range(6):
            for batch in batches[2 * (step % 2): 2 * (step % 2) + 2]:
                losses.append(graphed(batch, autocast(device))[0])
            opt.step()
            opt.zero_grad(set_to_none=False)
    else:
        if variant != "no-eager-first":
            for batch in batches:
                with autocast(device):
                    loss = model(*batch_tensors(pad_batch(batch, bucket_length(batch.input_ids.shape[1]))))[0]
                (loss / 4).backward()
            drafter.zero_grad(set_to_none=True)
            if variant == "del-loss":
                del loss  # the last eager graph, and the AccumulateGrad nodes it made on the default stream
        graphed = GraphedTTT(model, grad_scale=1 / 4)
        losses = [graphed(batch, autocast(device))[0] for batch in batches]
    torch.cuda.synchronize()
    print(f"{variant}: graphs {len(graphed.graphs)}, failure {graphed.failure!r}, losses {[float(x) for x in losses]}")
except Exception:
    print(f"{variant}: raised")
    traceback.print_exc()
