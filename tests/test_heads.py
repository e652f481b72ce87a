"""postrl.heads.ScalarHead: the learned scalar head that GAE's value head, PCL's prompt value model and SPA's
progress estimator share."""

from __future__ import annotations

import json

import torch

from postrl.heads import ScalarHead


def test_made_on_first_features_predicts_zero_and_leaves_the_global_generator_alone():
    h = ScalarHead(lr=1e-2, units=4)
    assert not h.made and h.state_dict() == {}
    state = torch.random.get_rng_state()
    out = h(torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(0)))
    assert torch.equal(torch.random.get_rng_state(), state)  # the hidden layer's init uses its own seed
    assert h.made and out.shape == (3, 5) and torch.equal(out, torch.zeros(3, 5))  # zero output layer
    again = ScalarHead(lr=1e-2, units=4)
    again.make(7)
    assert all(torch.equal(a, b) for a, b in zip(h.parameters(), again.parameters()))  # (name, H, units) fix it


def test_fits_and_round_trips_through_json_with_its_optimizer():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(32, 6, generator=g), torch.randn(6, generator=g)
    y = x @ w
    h = ScalarHead(lr=0.1)
    for _ in range(200):
        loss = ((h(x) - y) ** 2).mean()
        h.optimizer.zero_grad()
        loss.backward()
        h.optimizer.step()
    assert float(loss.detach()) < 1e-2  # a linear target is learned
    restored = ScalarHead(lr=0.1)
    restored.load_state_dict(json.loads(json.dumps(h.state_dict())))  # as in trainer_state.json
    assert torch.allclose(restored(x), h(x))
    for head in (h, restored):  # the optimizer's moments came along: the next step is the same
        loss = ((head(x) - y) ** 2).mean()
        head.optimizer.zero_grad()
        loss.backward()
        head.optimizer.step()
    assert torch.allclose(restored(x), h(x))
