"""Policy(ep=...): expert parallelism of a mixture-of-experts model through the
library (README: --ep).  On two ranks, Policy(ep=2) on the Mixtral fixture (4
experts: 2 per rank) scores and trains as the same policy without it: the
log-probs bitwise under batch_invariant (the experts' rows and the per-token
sums are computed alike, only on another rank), the loss and grad norm of one
step within fp32 rounding (rel 1e-5: without batch invariance an expert GEMM
over more rows may round each of its outputs differently, a few ulps of
2^-23 each, and the loss and the norm sum about 10^3 such terms with the
errors uncorrelated; tests/mpi/test_parity.c bounds the gradients
themselves from the model's sizes, tests/tolerance.h); the
refusals name the option and the values."""

import os

import pytest
from conftest import REPO, WORLD, make_seqs

import meshlm

MIXTRAL = os.path.join(REPO, "tests", "fixtures", "mixtral")


def run(ep, batch_invariant):
    """Log-probs of this rank's sequences, then one training step's result."""
    with meshlm.Policy(MIXTRAL, ep=ep, batch_invariant=batch_invariant, max_grad_norm=0) as p:
        seqs = make_seqs(4, seed=3, vocab=262)[p.info["dp_rank"]::p.info["dp_size"]]
        lp, _ = p.logprobs(seqs)
        r = p.train_step(seqs)
        return lp, r["loss"], r["grad_norm"]


@pytest.mark.skipif(WORLD != 2, reason="expert parallelism over two ranks")
def test_ep_matches_dp():
    lp_ep, loss_ep, norm_ep = run(2, True)
    lp, loss, norm = run(1, True)
    assert len(lp_ep) == len(lp) > 0
    for a, b in zip(lp_ep, lp):
        assert a.tobytes() == b.tobytes()
    _, loss_ep, norm_ep = run(2, False)
    _, loss, norm = run(1, False)
    assert loss_ep == pytest.approx(loss, rel=1e-5)
    assert norm_ep == pytest.approx(norm, rel=1e-5)


def test_ep_errors(model_dir):
    with pytest.raises(meshlm.MeshlmError, match=r"meshlm_options.ep 0; expected >= 1"):
        meshlm.Policy(MIXTRAL, ep=0)
    with pytest.raises(meshlm.MeshlmError, match=r"--ep \(ep_size\) 3: .* is not a multiple of it"):
        meshlm.Policy(MIXTRAL, ep=3)
    if WORLD == 2:
        with pytest.raises(meshlm.MeshlmError, match="LlamaForCausalLM has no mixture-of-experts"):
            meshlm.Policy(model_dir, ep=2)
