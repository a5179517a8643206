#!/usr/bin/env python3
"""A training step's attention through each torch layer, and a small model's training step,
fa4_aot beside torch SDPA (its flash and cuDNN backends) in one process, on an sm_90 GPU.

Attention step (forward + backward through autograd, causal, bf16, q k v (b, s, h, 64)
leaves that require grad; SDPA takes their (b, h, s, d) transposes, as a model's
attention does): at three sizes, from tiny (where the host decides) to medium, per layer

- ``host``: the issuing thread's time for one step (the GPU idle when it starts, its
  synchronize untimed). The host's speed drifts by a third between seconds on the H200's
  machine, so the layers take turns: ``--blocks`` blocks of ``--steps`` steps each, the
  layers in alternating order within a block; a layer's figure is the median over blocks
  of each block's median, and "x sdpa_flash" the median over blocks of the block's ratio
  (the layers of one block met the same host);
- ``wall``: ``--steps`` steps back to back, then one synchronize, per step;

and, for fa4_aot at the tiny size, the cProfile of its steps (the functions whose own time
is largest), to say where the host time goes.

Model step: a 12-layer GPT-2-small-like model (d_model 768, 12 heads of 64, MLP 4x, pre-
LayerNorm, 1024 tokens, batch 8, bf16 autocast-free: parameters bf16), AdamW, the same
initialization and batch for each attention; ms per step over ``--model-steps`` steps
after warm-up, and the first step's losses (equal within bf16 noise).

    PYTHONPATH=$PWD python benchmarks/host_path_step.py [--blocks 16] [--steps 25] [--model-steps 20] [--out JSON]
"""

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from fa4_aot.torch import flash_attn_func

sys.path.insert(0, str(Path(__file__).resolve().parent))
import timing  # noqa: E402 (beside this file)

SIZES = [(1, 128, 8), (4, 512, 12), (8, 1024, 12)]  # (batch, seqlen, heads), head_dim 64


def sdpa(backend):
    def attend(q, k, v):  # (b, s, h, d) in and out
        with sdpa_kernel(backend):
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True)
        return o.transpose(1, 2)
    return attend


LAYERS = {"fa4_aot": lambda q, k, v: flash_attn_func(q, k, v, causal=True),
          "sdpa_flash": sdpa(SDPBackend.FLASH_ATTENTION), "sdpa_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION)}


def attention_step(attend, size):
    """One forward + backward of ``attend`` at ``size``, warmed up."""
    b, s, h = size
    q, k, v = (torch.randn(b, s, h, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn(b, s, h, 64, device="cuda", dtype=torch.bfloat16)

    def step():
        attend(q, k, v).backward(grad)

    for _ in range(20):
        step()
    torch.cuda.synchronize()
    return step


def wall_per_call(fn, calls):
    """Seconds per call of ``calls`` calls back to back, one synchronize at the end."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls


def profile(step, steps):
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    return text.getvalue()


class Block(torch.nn.Module):
    def __init__(self, attend, d=768, heads=12):
        super().__init__()
        self.attend, self.heads = attend, heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        x = x + self.proj(self.attend(q, k, v).reshape(b, s, d))
        return x + self.mlp(self.ln2(x))


def model_step(attend, steps, vocab=50304, layers=12, batch=8, seqlen=1024):
    torch.manual_seed(0)
    emb = torch.nn.Embedding(vocab, 768)
    blocks = torch.nn.ModuleList(Block(attend) for _ in range(layers))
    head = torch.nn.Linear(768, vocab, bias=False)
    model = torch.nn.ModuleList([emb, blocks, torch.nn.LayerNorm(768), head]).to("cuda", torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    g = torch.Generator(device="cuda").manual_seed(1)
    tokens = torch.randint(0, vocab, (batch, seqlen + 1), device="cuda", generator=g)

    def step():
        x = emb(tokens[:, :-1])
        for blk in blocks:
            x = blk(x)
        logits = head(model[2](x))
        loss = F.cross_entropy(logits.float().view(-1, vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    first = step().item()
    for _ in range(3):
        step()
    return wall_per_call(step, steps) * 1e3, first


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--blocks", type=int, default=16)
    p.add_argument("--steps", type=int, default=25, help="steps a block, per layer")
    p.add_argument("--model-steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2, help="rounds of the model steps")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    res = {"attention": {}, "model": {}, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    lines = ["| size (b, s, h) | layer | host us/step, median of blocks (range) | x sdpa_flash (range) | "
             "wall us/step |", "|---|---|---|---|---|"]
    for size in SIZES:
        steps = {name: attention_step(attend, size) for name, attend in LAYERS.items()}
        blocks = timing.host_blocks({name: steps[name] for name in LAYERS}, args.blocks, args.steps)
        for name, step in steps.items():
            ratios = [x / y for x, y in zip(blocks[name], blocks["sdpa_flash"])]
            wall = wall_per_call(step, 4 * args.steps) * 1e6
            res["attention"][f"{size}|{name}"] = {"host_blocks": blocks[name], "ratio_blocks": ratios, "wall": wall}
            lines.append(f"| {size} | {name} | {statistics.median(blocks[name]):.0f} ({min(blocks[name]):.0f}-"
                         f"{max(blocks[name]):.0f}) | {statistics.median(ratios):.3f} ({min(ratios):.2f}-"
                         f"{max(ratios):.2f}) | {wall:.0f} |")
            print(lines[-1], flush=True)
        if size == SIZES[0]:
            res["profile"] = profile(steps["fa4_aot"], 200)
    for r in range(args.rounds):
        for name in (["fa4_aot", "sdpa_flash"] if r % 2 == 0 else ["sdpa_flash", "fa4_aot"]):
            ms, loss = model_step(LAYERS[name], args.model_steps)
            res["model"].setdefault(name, []).append((ms, loss))
            print(f"r{r} model {name}: {ms:.2f} ms a step, first loss {loss:.5f}", flush=True)
    lines += ["", "| model | ms/step | first loss |", "|---|---|---|"]
    for name, runs in res["model"].items():
        lines.append(f"| {name} | {statistics.median(m for m, _ in runs):.2f} "
                     f"({min(m for m, _ in runs):.2f}-{max(m for m, _ in runs):.2f}) | {runs[0][1]:.5f} |")
    res["table"] = "\n".join(lines)
    print(res["table"])
    print(res.get("profile", ""))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
