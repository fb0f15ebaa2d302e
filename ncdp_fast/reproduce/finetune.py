"""``ncdp-fast reproduce dp-finetune``: is the last layer enough?  Full private
fine-tuning of EfficientNet-Lite0 on Fashion-MNIST with
:class:`ncdp_fast.torch.PrivacyEngine` against last-layer NoisySGD on the frozen
network's features, at epsilon in {1, 4, 8}, delta = 1e-5 (the question of paper
000, /work/shared/seeds/000_82fe6240ae4b04be.txt: fine-tuning the last layer of a
pretrained network as the benchmark of private fine-tuning).

Arms, each (epsilon, delta)-DP for its own training set by its own accountant
(Poisson sampling; PLD accounting in both: the engine's "prv" is dp-accounting's
PLD accountant, as is NoisySGDClassifier's "pld"):

* ``full fine-tuning``: every weight of the ImageNet-pretrained EfficientNet-Lite0
  (batch norms folded into the convolutions with their ImageNet statistics, so the
  network starts as the pretrained feature extractor; :func:`finetune_model`) plus a
  zero-initialised 10-way head, trained by DP-SGD through
  ``PrivacyEngine.make_private_with_epsilon`` (book-keeping clipping,
  :class:`ncdp_fast.torch.GhostClipper`), SGD with momentum, on ``--train-size``
  images at ``--resolution``;
* ``last layer (same images)``: NoisySGD (:class:`ncdp_fast.train.NoisySGDClassifier`)
  on the 1280-d penultimate features of the *same* images at the *same* resolution
  (the frozen pretrained network, :func:`ncdp_fast.datasets.efficientnet_features`,
  rows normalised to unit norm as in ``nc-real``);
* ``last layer (all 60000, cached)``: the same on every training image, from the
  cached features of ``make data`` (``--cache-resolution``, 96 by default) when
  they are present under ``$NCDP_DATA_DIR``: what the last layer costs so little
  that it can afford (skipped, and said so, when the cache is missing);
* ``last layer, non-private``: the same images' features, no clipping, no noise
  (the reference the private arms approach).

Test accuracy on ``--test-size`` test images (the same subset for every arm).

Cost, and the choice it forces: a private full fine-tuning step of this network
costs several times a forward pass (bench/test_bench_finetune.py), and the
project's machine has 2 CPU cores shared with other jobs, so the default is a
fixed random subset of 1000 training images at 32 x 32 (the 28 x 28 images
barely upsampled; the network's last feature map is 1 x 1), batches of 100
expected (q = 0.1), 1 epoch (10 private steps) per epsilon: the whole
reproduction then fits in 25 minutes there.  Consequence: full fine-tuning gets
10 noisy steps on 1000 small images -- far less data, resolution and steps than
it would get on a GPU -- so this answers "is the last layer enough *at this
budget*", not in general; the last-layer arm on the same 1000 images is the
controlled comparison (same data, same privacy, same resolution), the
60000-image arm shows what the cheap method buys instead.
``--train-size/--epochs/--resolution`` scale it up where time allows.

Options: --out (bench/results), --quick (200 training images, 1 epoch, epsilon 8
only, 32 x 32), --seed (default from the OS, recorded), --eps, --delta,
--train-size, --test-size, --resolution, --batch, --epochs, --lr, --momentum,
--max-grad-norm, --ll-epochs, --ll-lr, --cache-resolution, --tag, --synthetic (random
images, no data needed, for tests), --blocks / --no-pretrained (a truncated /
untrained network, for tests).
"""
from __future__ import annotations

import time
import warnings

import numpy as np

from ._common import Progress, axes, cpu_meta, derive_seed, log, master_seed, parser
# Re-exported: bench_finetune and the tests build the network from here.
from ._efficientnet_model import finetune_model, plain_convs  # noqa: F401

NAME = "dp_finetune"
ARMS = ("full fine-tuning", "last layer (same images)", "last layer (all 60000, cached)",
        "last layer, non-private")


# ---------------------------------------------------------------- the reproduction

def _data(args, rng):
    """(train images, train labels, test images, test labels) of the subsets and the
    indices of the test subset (into the full test split)."""
    if args.synthetic:
        g = np.random.default_rng(0)
        n, m = args.train_size, args.test_size
        return (g.integers(0, 256, (n, 28, 28), dtype=np.uint8), g.integers(0, 10, n),
                g.integers(0, 256, (m, 28, 28), dtype=np.uint8), g.integers(0, 10, m), None)
    from ..datasets import load_fashion_mnist
    Xtr, ytr = load_fashion_mnist("train")
    Xte, yte = load_fashion_mnist("test")
    # Subsets drawn without looking at the data (a public permutation).
    tr = np.sort(rng.permutation(len(ytr))[:args.train_size])
    te = np.sort(rng.permutation(len(yte))[:args.test_size])
    return Xtr[tr], ytr[tr], Xte[te], yte[te], te


def _normalize(X):
    X = np.asarray(X, np.float32)
    return X / np.maximum(np.linalg.norm(X, axis=1, keepdims=True), np.float32(1e-12))


def _features(images, args, what):
    """Penultimate features of the frozen pretrained network (what the cache holds),
    at the fine-tuning resolution; the truncated/untrained test networks use their
    own ``features``."""
    import torch
    t0 = time.perf_counter()
    if args.blocks is None and not args.no_pretrained:
        from ..datasets import efficientnet_features
        X = efficientnet_features(images, resolution=args.resolution)
    else:
        from ..datasets._efficientnet import preprocess
        model = finetune_model(resolution=args.resolution, pretrained=False,
                               blocks=args.blocks, batchnorm="fold").eval()
        with torch.no_grad():
            X = model.features(preprocess(images, args.resolution)).numpy()
    log(f"  features of {len(images)} {what} images: {time.perf_counter() - t0:.1f} s")
    return _normalize(X)


def _finetune(args, eps, Xtr, ytr, Xte, yte, seed):
    """One private full fine-tuning run; returns (accuracy, record)."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from ..datasets._efficientnet import preprocess
    from ..torch import PrivacyEngine
    torch.manual_seed(seed % 2**63)
    model = finetune_model(num_classes=10, resolution=args.resolution,
                           pretrained=not args.no_pretrained, blocks=args.blocks,
                           batchnorm="fold")
    x = preprocess(Xtr, args.resolution).contiguous()
    loader = DataLoader(TensorDataset(x, torch.as_tensor(ytr)), batch_size=args.batch)
    # The head learns from zero at --lr; the pretrained body moves --body-lr-factor as
    # fast (the noise, sigma C sqrt(p) / B in norm, is spread over its 3.4 M weights).
    head = list(model._fc.parameters())
    body = [p for n, p in model.named_parameters() if not n.startswith("_fc.")]
    opt = torch.optim.SGD([dict(params=body, lr=args.lr * args.body_lr_factor),
                           dict(params=head, lr=args.lr)], lr=args.lr, momentum=args.momentum)
    engine = PrivacyEngine(accountant="prv")
    model, opt, loader = engine.make_private_with_epsilon(
        module=model, optimizer=opt, data_loader=loader, target_epsilon=eps,
        target_delta=args.delta, epochs=args.epochs, max_grad_norm=args.max_grad_norm,
        seed=seed)
    crit = nn.CrossEntropyLoss()
    steps = args.epochs * len(loader)
    progress = Progress(f"eps={eps:g} full fine-tuning", steps)
    for epoch in range(args.epochs):
        for xb, yb in loader:
            opt.zero_grad(set_to_none=True)
            out = model(xb)
            # An empty Poisson batch is still a step (pure noise): its loss is a
            # zero that keeps the graph; the mean of nothing would be NaN.
            loss = crit(out, yb) if len(yb) else out.sum() * 0.0
            loss.backward()
            opt.step()
            progress.step(f"epoch {epoch + 1}/{args.epochs}, loss {float(loss.detach()):.3f}")
    train_s = progress.seconds
    acc = _accuracy(model, Xte, yte, args.resolution)
    spent = engine.get_epsilon(args.delta)
    return acc, dict(sigma=opt.noise_multiplier, steps=steps, epsilon_spent=spent,
                     sample_rate=engine.sample_rate, train_s=train_s,
                     seconds=progress.seconds)


def _accuracy(model, images, labels, resolution, batch=250):
    import torch

    from ..datasets._efficientnet import preprocess
    model.eval()
    right = 0
    with torch.no_grad():
        for s in range(0, len(labels), batch):
            out = model(preprocess(images[s:s + batch], resolution))
            right += int((out.argmax(1).numpy() == labels[s:s + batch]).sum())
    model.train()
    return right / max(len(labels), 1)


def _last_layer(args, eps, X, y, Xt, yt, seed, *, batch, epochs, lr):
    """NoisySGD on features (eps None: the same steps without clipping noise)."""
    from .._mix import poisson_batches
    from ..train import NoisySGDClassifier, linear_steps
    t0 = time.perf_counter()
    q = min(1.0, batch / X.shape[0])
    if eps is None:
        steps = max(1, round(epochs / q))
        plan = poisson_batches(X.shape[0], sample_rate=q, steps=steps, seed=seed % 2**63)
        W = linear_steps(X, y, num_classes=10, steps=steps, lr=lr, loss="ce",
                         max_grad_norm=1e30, noise_multiplier=0.0, projection_radius=None,
                         fit_intercept=False, seed=0, batches=plan,
                         expected_batch_size=q * len(y))[0]
        W = np.asarray(W)
        acc = float(np.mean(np.argmax(Xt @ W.T, axis=1) == yt))
        return acc, dict(sigma=0.0, steps=steps, epsilon_spent=float("inf"), sample_rate=q,
                         seconds=time.perf_counter() - t0)
    clf = NoisySGDClassifier(epsilon=eps, delta=args.delta, sample_rate=q, epochs=epochs, lr=lr,
                             accountant="pld", num_classes=10, seed=seed % 2**63).fit(X, y)
    acc = float(np.mean(np.asarray(clf.predict(Xt)) == yt))
    return acc, dict(sigma=clf.noise_multiplier_, steps=clf.steps_,
                     epsilon_spent=clf.epsilon_, sample_rate=q,
                     seconds=time.perf_counter() - t0)


def _cached(args, te):
    """All cached training features and the test subset's, or None when missing."""
    if args.synthetic or args.no_cache:
        return None
    from ..datasets import load_features
    try:
        X, y = load_features("fashion-mnist", "efficientnet-lite0", "train",
                             resolution=args.cache_resolution)
        Xt, yt = load_features("fashion-mnist", "efficientnet-lite0", "test",
                               resolution=args.cache_resolution)
    except FileNotFoundError as e:
        log(f"  last layer (all 60000, cached): skipped ({e})")
        return None
    return _normalize(X), y, _normalize(Xt[te]), yt[te]


def main(argv: list[str]) -> int:
    """``ncdp-fast reproduce dp-finetune [--quick] [--out DIR] [--seed S] ...``"""
    ap = parser("ncdp-fast reproduce dp-finetune", __doc__,
                "200 training images, 1 epoch, epsilon 8 only, 32 x 32")
    ap.add_argument("--eps", default=None, help="comma-separated epsilons (default 1,4,8)")
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--train-size", type=int, default=None, help="default 1000 (quick 200)")
    ap.add_argument("--test-size", type=int, default=None, help="default 1000 (quick 200)")
    ap.add_argument("--resolution", type=int, default=None, help="default 32 (quick 32)")
    ap.add_argument("--batch", type=int, default=None,
                    help="expected Poisson batch size (default train-size / 10)")
    ap.add_argument("--epochs", type=int, default=None, help="fine-tuning epochs (default 1)")
    ap.add_argument("--lr", type=float, default=0.5, help="fine-tuning SGD step of the head")
    ap.add_argument("--body-lr-factor", type=float, default=0.02,
                    help="the pretrained body's step as a fraction of --lr")
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--ll-epochs", type=float, default=10.0, help="last-layer epochs")
    ap.add_argument("--ll-lr", type=float, default=2.0, help="last-layer step (unit-norm rows)")
    ap.add_argument("--cache-resolution", type=int, default=96)
    ap.add_argument("--no-cache", action="store_true", help="skip the all-60000 cached arm")
    ap.add_argument("--tag", default=None,
                    help="report name suffix (dp_finetune_<tag>), to keep a larger run's "
                         "tables next to the default one's")
    ap.add_argument("--synthetic", action="store_true",
                    help="random images and labels of the same shapes (tests; no data needed)")
    ap.add_argument("--blocks", type=int, default=None, help="truncated network (tests)")
    ap.add_argument("--no-pretrained", action="store_true", help="untrained network (tests)")
    args = ap.parse_args(argv)
    q = args.quick
    eps_list = [float(e) for e in (args.eps or ("8" if q else "1,4,8")).split(",")]
    args.train_size = args.train_size or (200 if q else 1000)
    args.test_size = args.test_size or (200 if q else 1000)
    args.resolution = args.resolution or 32
    args.batch = args.batch or max(1, args.train_size // 10)
    args.epochs = args.epochs or 1
    master = master_seed(args.seed)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch")
    t_all = time.perf_counter()
    log(f"dp-finetune: seed {master}; {args.train_size} training / {args.test_size} test "
         f"images at {args.resolution}x{args.resolution}; epsilons {eps_list}, delta "
         f"{args.delta}")
    rng = np.random.default_rng(derive_seed(master, 0))
    Xtr, ytr, Xte, yte, te = _data(args, rng)
    F, Ft = _features(Xtr, args, "training"), _features(Xte, args, "test")
    cached = _cached(args, te if te is not None else np.arange(len(yte)))
    ll = dict(batch=args.batch, epochs=args.ll_epochs, lr=args.ll_lr)
    rows = []

    def add(eps, arm, n, acc, rec):
        row = dict(epsilon=eps, arm=arm, n_train=n, accuracy=100.0 * acc, **rec)
        rows.append(row)
        log(f"  eps={'inf' if eps is None else f'{eps:g}'} {arm}: accuracy "
             f"{100 * acc:.2f}% (sigma {rec['sigma']:.3f}, {rec['steps']} steps, epsilon "
             f"spent {rec['epsilon_spent']:.3f}, {rec['seconds']:.1f} s)")

    acc, rec = _last_layer(args, None, F, ytr, Ft, yte, derive_seed(master, 1), **ll)
    add(None, ARMS[3], len(ytr), acc, rec)
    for i, eps in enumerate(eps_list):
        acc, rec = _last_layer(args, eps, F, ytr, Ft, yte, derive_seed(master, 2, i), **ll)
        add(eps, ARMS[1], len(ytr), acc, rec)
        if cached is not None:
            X, y, Xt, yt = cached
            acc, rec = _last_layer(args, eps, X, y, Xt, yt, derive_seed(master, 3, i),
                                   batch=1024, epochs=args.ll_epochs, lr=args.ll_lr)
            add(eps, ARMS[2], len(y), acc, rec)
        acc, rec = _finetune(args, eps, Xtr, ytr, Xte, yte, derive_seed(master, 4, i))
        add(eps, ARMS[0], len(ytr), acc, rec)
    total = time.perf_counter() - t_all
    log(f"dp-finetune: done in {total:.0f} s")
    _report(args, rows, eps_list, master, total, cached is not None)
    return 0


def _report(args, rows, eps_list, master, total, have_cache):
    from .._report import save_figure, write_report
    meta = dict(cpu_meta(), seed=master, total_s=round(total, 1), quick=args.quick, synthetic=args.synthetic,
                train_size=args.train_size, test_size=args.test_size,
                resolution=args.resolution, batch=args.batch, epochs=args.epochs, lr=args.lr,
                momentum=args.momentum, body_lr_factor=args.body_lr_factor,
                max_grad_norm=args.max_grad_norm, delta=args.delta,
                ll_epochs=args.ll_epochs, ll_lr=args.ll_lr,
                cache_resolution=args.cache_resolution if have_cache else None,
                blocks=args.blocks, pretrained=not args.no_pretrained)
    for r in rows:
        r["epsilon_label"] = "inf (non-private)" if r["epsilon"] is None else f"{r['epsilon']:g}"
    notes = [
        ("SYNTHETIC random images (a smoke run, not a result); " if args.synthetic else "")
        + f"Fashion-MNIST: a fixed random subset of {args.train_size} training images "
        f"(of 60000) and {args.test_size} test images (the same for every arm), "
        f"{args.resolution}x{args.resolution}, seed {master}",
        f"full fine-tuning: EfficientNet-Lite0 "
        f"{'UNTRAINED' if args.no_pretrained else 'ImageNet-pretrained'}"
        f"{'' if args.blocks is None else f' first {args.blocks} blocks'}, batch norms folded "
        f"(ImageNet statistics), every weight trainable, ncdp_fast.torch.PrivacyEngine."
        f"make_private_with_epsilon (Poisson q = {args.batch / args.train_size:g}, "
        f"{args.epochs} epochs, C = {args.max_grad_norm:g}, SGD momentum {args.momentum:g}, "
        f"lr {args.lr:g} for the head, {args.lr * args.body_lr_factor:g} for the body)",
        f"last layer: NoisySGD (ncdp_fast.train, PLD) on the frozen network's unit-norm "
        f"1280-d features, {args.ll_epochs:g} epochs, lr {args.ll_lr:g}; same images: batch "
        f"{args.batch}; all 60000: batch 1024 on the cached {args.cache_resolution}x"
        f"{args.cache_resolution} features"
        + ("" if have_cache else " (cache missing: not run)"),
        f"delta = {args.delta:g}; 'epsilon spent' is each arm's own accountant after training",
        f"the compute budget (2 shared CPU cores, <= 25 min in all) fixes the subset, "
        f"resolution and epochs of full fine-tuning: it answers 'is the last layer enough' "
        f"at this budget, not with a GPU's; run times are on a machine shared with other "
        f"jobs",
        f"total run time {total:.0f} s"]
    cols = [("epsilon_label", "epsilon", None), ("arm", "arm", None),
            ("n_train", "training images", None), ("accuracy", "test accuracy %", "{:.2f}"),
            ("sigma", "noise multiplier", "{:.3f}"), ("steps", "steps", None),
            ("sample_rate", "q", "{:.4f}"), ("epsilon_spent", "epsilon spent", "{:.3f}"),
            ("seconds", "seconds", "{:.1f}")]
    name = NAME + (f"_{args.tag}" if args.tag else "")
    write_report(name, args.out, meta, rows, cols, notes=notes)
    fig, ax = axes()
    for arm, style in zip(ARMS[:3], ("o-", "s--", "^:")):
        pts = [(r["epsilon"], r["accuracy"]) for r in rows if r["arm"] == arm]
        if pts:
            ax.plot(*zip(*pts), style, label=arm + ("" if arm == ARMS[2] else
                                                     f" ({args.train_size} images)"))
    ref = [r["accuracy"] for r in rows if r["arm"] == ARMS[3]]
    if ref:
        ax.axhline(ref[0], color="gray", lw=0.8, label="last layer, non-private")
    ax.set_xscale("log")
    ax.minorticks_off()
    ax.set_xticks(eps_list, [f"{e:g}" for e in eps_list])
    accs = [r["accuracy"] for r in rows]
    ax.set_ylim(max(0.0, min(accs) - 5), min(100.0, max(accs) + 5))
    ax.set_xlabel("epsilon (delta = %g)" % args.delta)
    ax.set_ylabel("test accuracy %")
    ax.set_title(("SYNTHETIC smoke run: " if args.synthetic else "")
                 + f"Fashion-MNIST, EfficientNet-Lite0, {args.resolution}px")
    ax.legend(fontsize=8)
    log(f"plot: {save_figure(fig, name, args.out)}")
