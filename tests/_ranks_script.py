"""Run by the real torchrun launcher in tests/test_torch_ranks.py and
tests/test_distributed_exit.py (gloo, 127.0.0.1).

``exit``: GhostClipper(group=) built, destroy_process_group, exit (the path that
aborted with SIGABRT at interpreter shutdown).  ``frozen OUT``: a model whose
trainable and frozen parameters and buffer are initialised differently on each
rank, trained by DP-SGD across the ranks; each rank writes its final state and
the refusals of a DDP-wrapped model and of a step on a batch its loader did
not draw (``wrong_batch``) to OUT/rank<r>.npz.  ``per_layer OUT``:
the same training with per-layer clipping (its state only).
"""
import sys

import numpy as np
import torch
from torch import nn

N, Q, STEPS, C, SIGMA, SEED = 23, 0.2, 10, 0.5, 0.8, (0x5EED0011, 0x5EED0012)


class Shift(nn.Module):
    """x + b with b a buffer: state that is not a parameter."""

    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.randn(6, dtype=torch.float64))

    def forward(self, x):
        return x + self.b


def model(init_seed):
    torch.manual_seed(init_seed)
    m = nn.Sequential(Shift(), nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    m[1].requires_grad_(False)                      # a frozen layer
    return m


def data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(N, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (N,), generator=g)


def train(m, sampler, group=None, clipping="flat"):
    """STEPS DP-SGD steps; returns the final state as {name: float64 array}."""
    from ncdp_fast.torch import GhostClipper
    x, y = data()
    clipper = GhostClipper(m, max_grad_norm=C, noise_multiplier=SIGMA, expected_batch_size=Q * N,
                           seed=SEED[1], offset=0, group=group, clipping=clipping)
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.5)
    for idx in sampler:
        idx = torch.as_tensor(idx, dtype=torch.long)
        nn.functional.cross_entropy(m(x[idx]), y[idx]).backward()
        clipper.privatize_()
        opt.step()
        opt.zero_grad()
    clipper.remove()
    return {k: v.detach().numpy().copy() for k, v in m.state_dict().items()}


def refusals(group):
    """The messages of GhostClipper and make_private given a DDP-wrapped model."""
    from ncdp_fast.torch import GhostClipper, PrivacyEngine
    ddp = nn.parallel.DistributedDataParallel(model(0))
    out = {}
    for what, build in [
            ("clipper", lambda g: GhostClipper(ddp, max_grad_norm=C, noise_multiplier=SIGMA,
                                               expected_batch_size=4.0, group=g)),
            ("engine", lambda g: PrivacyEngine().make_private(
                module=ddp, optimizer=torch.optim.SGD(ddp.parameters(), lr=0.1),
                data_loader=torch.utils.data.DataLoader(torch.utils.data.TensorDataset(
                    *data()), batch_size=4), noise_multiplier=SIGMA, max_grad_norm=C,
                group=g))]:
        for name, g in [("nogroup", None), ("group", group)]:
            try:
                build(g)
                out[f"{what}_{name}"] = "accepted"
            except ValueError as e:
                out[f"{what}_{name}"] = str(e)
    return out


def _run(group=None, seed=None):
    from ncdp_fast.torch import PrivacyEngine
    x, y = data()
    m = model(0)
    engine = PrivacyEngine(accountant="rdp")
    pm, opt, loader = engine.make_private(
        module=m, optimizer=torch.optim.SGD([p for p in m.parameters() if p.requires_grad],
                                            lr=0.1),
        data_loader=torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y),
                                                batch_size=4),
        noise_multiplier=SIGMA, max_grad_norm=C, group=group, seed=seed)
    return engine, pm, opt, loader


def wrong_batch(group):
    """make_private across the ranks, rank 1 stepping on the whole data set
    (more rows than any shard of its loader's batch): every rank refuses the
    step together, before any noise is drawn, and nothing is accounted.
    Returns (message, stream position unchanged, steps accounted)."""
    import torch.distributed as dist
    x, y = data()
    engine, pm, opt, loader = _run(group)
    xb, yb = next(iter(loader))
    if dist.get_rank(group) == 1:
        xb, yb = x, y
    position = pm.clipper.offset
    try:
        nn.functional.cross_entropy(pm(xb), yb).backward()
        opt.step()
        message = "stepped"
    except RuntimeError as e:
        message = str(e)
    return message, pm.clipper.offset == position, engine.accountant.total_steps


def penalty_and_checkpoints(group, directory):
    """Rank 1 adds an L2 penalty to its loss (refused on it: a gradient from
    outside a layer); then each rank resumes its own checkpoint of one run,
    after 1 and 2 steps (refused on both).  Returns the two messages."""
    import torch.distributed as dist
    import ncdp_fast as nf
    rank = dist.get_rank(group)
    engine, pm, opt, loader = _run(group)
    xb, yb = next(iter(loader))
    loss = nn.functional.cross_entropy(pm(xb), yb)
    if rank == 1:
        loss = loss + 1e-3 * sum(p.square().sum() for p in pm.parameters() if p.requires_grad)
    loss.backward()
    try:
        opt.step()
        penalty = "stepped"
    except RuntimeError as e:
        penalty = str(e)
    one, one_pm, one_opt, one_loader = _run(seed=nf.NoiseStream(SEED[1] + 7, 0))
    for k, (xb, yb) in enumerate(one_loader):
        one_opt.zero_grad()
        nn.functional.cross_entropy(one_pm(xb), yb).backward()
        one_opt.step()
        if k == rank:
            one.save_checkpoint(path=f"{directory}/c{rank}.pt", module=one_pm, optimizer=one_opt)
            break
    engine, pm, opt, _ = _run(group)
    try:
        engine.load_checkpoint(path=f"{directory}/c{rank}.pt", module=pm, optimizer=opt)
        resumed = "loaded"
    except ValueError as e:
        resumed = str(e)
    return penalty, resumed


def main():
    import torch.distributed as dist
    from ncdp_fast.torch import DistributedPoissonBatchSampler, GhostClipper
    dist.init_process_group("gloo")
    rank, group = dist.get_rank(), dist.group.WORLD
    if sys.argv[1] == "exit":
        GhostClipper(model(rank), max_grad_norm=C, noise_multiplier=SIGMA,
                     expected_batch_size=4.0, group=group)
    else:
        sampler = DistributedPoissonBatchSampler(N, sample_rate=Q, steps=STEPS, seed=SEED[0],
                                                 offset=0, group=group)
        if sys.argv[1] == "per_layer":
            state = train(model(100 + rank), sampler, group, clipping="per_layer")
            np.savez(f"{sys.argv[2]}/rank{rank}.npz", **state)
        else:
            state = train(model(100 + rank), sampler, group)
            message, unmoved, accounted = wrong_batch(group)
            penalty, resumed = penalty_and_checkpoints(group, sys.argv[2])
            np.savez(f"{sys.argv[2]}/rank{rank}.npz", **state, penalty=np.array(penalty),
                     resumed=np.array(resumed),
                     **{f"refusal:{k}": np.array(v) for k, v in refusals(group).items()},
                     wrong_batch=np.array(message), wrong_batch_unmoved=np.array(unmoved),
                     wrong_batch_accounted=np.array(accounted))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
