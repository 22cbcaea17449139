"""The zoo builds and trains one step with plain torch (the reference every zoo test relies on)."""

from __future__ import annotations

import torch
from zoo_models import Case

from ampnb.batch import as_batch, step_loss


def test_each_model_gives_a_finite_loss_and_gradients(case: Case):
    batch = as_batch(case.batch, case.loss_fn)
    loss = step_loss(batch.call(case.model), batch, case.loss_fn)
    loss.backward()
    assert loss.ndim == 0 and torch.isfinite(loss)
    grads = [p.grad for p in case.model.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    assert case.model.training  # as transformers builds them: dropout on
