"""The chunked output-layer cross entropy (megatron/model/fused_cross_entropy.py, training.fused_cross_entropy)
against torch's cross_entropy over the whole logits: equal in fp64, no less accurate in bf16, the same
in the model (tied and untied); and its memory, measured against the memory model's head term."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megatron.engine import fused_lm_loss, lm_loss, training_loss_of
from megatron.launch.launcher import MALLOC_MMAP_THRESHOLD
from megatron.model.fused_cross_entropy import IGNORE_INDEX, chunk_rows_for, linear_cross_entropy
from megatron.model.sizes import head_activation_bytes
from conftest import run_deepy, run_together, tiny_run_config, train_losses
from test_engine import build_model, make_batch

REPO = Path(__file__).resolve().parents[1]


def _inputs(tokens: int, hidden: int, vocab: int, dtype=torch.float64, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen, dtype=dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen, dtype=dtype) * 0.5).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    labels[::7] = IGNORE_INDEX
    return x, w, labels


def _loss_and_grads(fn, x, w, labels, scale: float = 2.0):
    x.grad = w.grad = None
    loss = fn(x, w, labels)
    loss.backward(torch.tensor(scale, dtype=loss.dtype))
    return loss.detach(), x.grad.clone(), w.grad.clone()


def _plain(x, w, labels):
    """torch's cross entropy over the whole logits (the fp64 truth: every caller passes fp64)."""
    return F.cross_entropy(x @ w.t(), labels)


@pytest.mark.parametrize("chunk", [1, 7, 64, 299, 300, 1000])
def test_equals_cross_entropy_in_fp64(chunk):
    x, w, labels = _inputs(300, 24, 500)
    ref = _loss_and_grads(_plain, x, w, labels)
    got = _loss_and_grads(lambda *a: linear_cross_entropy(*a, chunk_rows=chunk), x, w, labels)
    for a, b in zip(got, ref):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-14), (a - b).abs().max()
    assert x.grad[::7].abs().max() == 0  # ignored tokens: no gradient


def test_leading_dimensions_and_only_the_gradients_asked_for():
    x, w, labels = _inputs(2 * 30, 8, 50)
    x3 = x.detach().reshape(2, 30, 8)  # [batch, seq, hidden], no gradient wanted for it
    loss = linear_cross_entropy(x3, w, labels.reshape(2, 30), chunk_rows=16)
    loss.backward()
    assert w.grad is not None and x3.grad is None
    assert torch.allclose(loss, _plain(x.detach(), w.detach(), labels), rtol=1e-12)
    with torch.no_grad():  # evaluation: the loss alone
        assert linear_cross_entropy(x, w, labels).requires_grad is False


def test_bf16_autocast_is_no_less_accurate_than_the_plain_head():
    """Both paths under bf16 autocast (fp32 inputs, as the model gives them), each against the fp64
    truth: the fused errors stay within 1.5x the plain path's (and under 1% relative)."""
    x64, w64, labels = _inputs(512, 64, 1000, seed=3)
    truth = _loss_and_grads(_plain, x64, w64, labels)
    x, w = x64.detach().float().requires_grad_(), w64.detach().float().requires_grad_()
    errors = {}
    for name, fn in (("plain", lambda a, b, c: F.cross_entropy(F.linear(a, b).float(), c)),
                     ("fused", lambda a, b, c: linear_cross_entropy(a, b, c, chunk_rows=100))):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = _loss_and_grads(fn, x, w, labels)
        errors[name] = [float((g.double() - t).norm() / t.norm()) for g, t in zip(got, truth)]
    for plain, fused in zip(errors["plain"], errors["fused"]):
        assert fused <= 1.5 * plain + 1e-6 and fused < 1e-2, errors


@pytest.mark.parametrize("tied", [False, True])
def test_the_models_fused_loss_equals_lm_loss(tied):
    model = build_model(no_weight_tying=not tied)
    batch = make_batch(0, 0, 0)
    results = []
    for loss_fn in (lm_loss, fused_lm_loss):
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch)
        loss.backward()
        results.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (plain, plain_grads), (fused, fused_grads) = results
    assert fused == pytest.approx(plain, rel=1e-6)
    for name, grad in plain_grads.items():
        assert torch.allclose(fused_grads[name], grad, rtol=1e-5, atol=1e-7), name
    assert training_loss_of(True) is fused_lm_loss and training_loss_of(False) is lm_loss
    with pytest.raises(ValueError, match="KV cache"):
        model(batch["tokens"], cache=object(), labels=batch["labels"])


def test_chunks_are_whole_tiles_near_64_mib_of_fp32_logits():
    assert chunk_rows_for(50432) == 320 and chunk_rows_for(32768) == 512
    assert chunk_rows_for(10**7) == 64  # never fewer than one tile


# One process per case: the peak resident memory of one loss + backward above what was held before
# (VmHWM, reset through /proc/self/clear_refs once the inputs and, from a warm-up, their gradients
# exist: backward then adds into them, as into an engine's gradient buffers).
MEASURE = r"""
import sys, torch
from megatron.model.fused_cross_entropy import linear_cross_entropy
torch.set_num_threads(1)
fused, bf16 = sys.argv[1] == "fused", sys.argv[2] == "bf16"
T, H, V = 2048, 64, 32768
x = torch.randn(T, H, requires_grad=True)
head = torch.nn.Linear(H, V, bias=False)
labels = torch.randint(0, V, (T,))

def step(n):
    if fused:
        loss = linear_cross_entropy(x[:n], head.weight, labels[:n])
    else:
        loss = torch.nn.functional.cross_entropy(head(x[:n]).float(), labels[:n])
    loss.backward()

def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key))

with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
    step(8)
    held = status("VmRSS:")
    open("/proc/self/clear_refs", "w").write("5")
    step(T)
print(status("VmHWM:") - held)
"""


# bf16 matmuls are slow on CPUs without bf16 units (about 2 minutes here): that case is slow.
@pytest.mark.parametrize("dtype", ["fp32", pytest.param("bf16", marks=pytest.mark.slow)])
def test_memory_measured_against_the_memory_model(dtype):
    """The plain head holds 3 T V x 4 bytes (fp32 logits, log-softmax, their gradient); the fused one
    one chunk. Measured peak resident memory over the step against ``head_activation_bytes``: within 0.8-1.2 for both, and the fused one under a fifth (its chunk
    is a fixed 64 MiB, the logits grow with the tokens: at the 1.01B shape the model gives 1.4 GB vs 10 GB)."""
    try:
        open("/proc/self/clear_refs", "w").write("5")
    except OSError:
        pytest.skip("this kernel cannot reset the peak resident memory (/proc/self/clear_refs)")
    tokens, hidden, vocab, elem = 2048, 64, 32768, 2 if dtype == "bf16" else 4
    measured = {}
    for kind in ("plain", "fused"):
        # glibc's allocator as the launcher sets it for its ranks: freed large tensors go back to the OS
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=MALLOC_MMAP_THRESHOLD)
        done = subprocess.run([sys.executable, "-c", MEASURE, kind, dtype], capture_output=True, text=True,
                              cwd=REPO, env=env, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        measured[kind] = int(done.stdout.split()[-1])
        predicted = head_activation_bytes(tokens, hidden, vocab, elem, kind == "fused")
        assert 0.8 <= measured[kind] / predicted <= 1.2, (kind, measured[kind], predicted)
    assert measured["fused"] < measured["plain"] / 5, measured


def test_the_config_key_chooses_the_engines_loss(tmp_path, tiny_corpus):
    from megatron.build import build_engine
    from megatron.config import load_config
    from megatron.runtime import Runtime

    runtime = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    for fused in (False, True):
        (tmp_path / str(fused)).mkdir()
        cfg = load_config([str(tiny_run_config(tmp_path / str(fused), tiny_corpus, fused_cross_entropy=fused))],
                          notices=[])
        assert cfg.training.fused_cross_entropy is fused
        engine = build_engine(cfg, build_model(), runtime)
        assert engine.loss_fn is (fused_lm_loss if fused else lm_loss)


def test_deepy_trains_the_same_with_the_fused_loss(tmp_path, tiny_corpus):
    """`fused_cross_entropy: true` through deepy.py train.py (one process): the plain run's losses
    (that the key reaches the engine is the test above)."""
    for name in ("plain", "fused"):
        (tmp_path / name).mkdir()
    configs = [tiny_run_config(tmp_path / name, tiny_corpus, train_iters=6, log_interval=1, eval_interval=6,
                               fused_cross_entropy=name == "fused") for name in ("plain", "fused")]
    for done in run_together(*(lambda c=c: run_deepy("train.py", str(c), timeout=180) for c in configs)):
        assert done.returncode == 0, done.stderr[-2000:]
    plain, fused = (train_losses(c.parent / "logs") for c in configs)
    assert sorted(fused) == list(range(1, 7))
    assert fused == pytest.approx(plain, rel=1e-5)
