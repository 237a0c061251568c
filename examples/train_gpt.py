"""Train a small GPT with torch.compile(model, backend="flash") on a byte-level corpus.

The model is plain torch.nn code with attention, LayerNorm and the loss spelled out the
naive way; the flash backend rewrites them into flash.attention, flash.(add_)layer_norm
and flash.cross_entropy, or flash.linear_cross_entropy together with the lm-head (the
counts are printed after the first step). Samples come from
torch_flash.data.MultiEpochDatasetResampler: shuffled epochs of fixed-length blocks of
the corpus, where global sample i of the run is a pure function of (seed, i).

    python examples/train_gpt.py                          # CPU preset: about a minute
    python examples/train_gpt.py --preset gpu             # the default when CUDA is there
    python examples/train_gpt.py --backend inductor       # the baseline: no flash rewrites
    torchrun --nproc_per_node=2 examples/train_gpt.py [--grad-compress bf16 | --parallel fsdp]
    torchrun --nproc_per_node=4 examples/train_gpt.py --cp 2     # sequences over 2 ranks, DDP over 2
    python examples/train_gpt.py --ckpt run.pt --save-every 50    # then add --resume to continue

Data parallelism: rank r reads samples r, r + world, r + 2 * world, ... of the resampled
sequence, so step t of every rank (batch B) reads global samples [t * B * world,
(t + 1) * B * world). A checkpoint holds the model, the optimizer and the step; the data
position follows from the step, so a resumed run continues with exactly the samples that
were next (and the same learning rate). There is no dropout, hence no RNG state to save.
Every rank reads the checkpoint file, so under torchrun it must be on a shared filesystem.

Context parallelism (--cp N): the world is N-rank context-parallel groups of consecutive ranks
(rank = dp_rank * N + cp_rank), data parallel across them (dp = world / N). Every rank of a
group reads the same samples (those of its dp rank) and keeps its zigzag share of every
sequence: chunks c and 2N - 1 - c of 2N (torch_flash.context_parallel.sequence_positions;
--block must split into 2N chunks), with their global positions for the position embedding.
Attention runs torch_flash.context_parallel_attention over the group (a ring of
torch.distributed P2P exchanges, causal, exact); everything else is per token. Every rank
holds the same number of tokens, so the global token-mean loss is the mean of the ranks'
local means, and DDP (or FSDP2) over the whole world, which averages gradients over all
cp * dp ranks, gives exactly its gradient: the ring's backward already brings each rank the
gradients that the other ranks' queries send to its keys and values, so rank r's parameter
gradient is d(local mean_r)/dparams through its own tokens, and the sum over a group of those
is the group's gradient of the sum of its local means. The logged loss is the group's mean.
The checkpoint is the same full state dict: a --cp run resumes with or without --cp.
The corpus is --corpus FILE, or generated: lines of "a+b=c" additions.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler

import torch_flash
from torch_flash.data import IdentityMultiEpochDatasetWrapper, MultiEpochDatasetResampler

VOCAB = 256  # bytes

PRESETS = {  # cpu: about a minute on 2 cores, mostly compilation; gpu: a real (small) run
    "cpu": dict(layers=2, d_model=64, heads=4, block=64, batch_size=16, steps=120, lr=3e-3, corpus_chars=200_000),
    "gpu": dict(layers=8, d_model=512, heads=8, block=512, batch_size=32, steps=2000, lr=1e-3,
                corpus_chars=8_000_000),
}


# ---------------------------------------------------------------- model: naive spellings

@dataclass
class GPTConfig:
    layers: int
    d_model: int
    heads: int
    block: int
    vocab: int = VOCAB


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        # context parallelism: a torch_flash.nn.ContextParallelAttention (see enable_context_parallel)
        self.context_parallel = None

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        if self.context_parallel is not None:  # this rank's tokens of the sequence: the ring
            return self.proj(self.context_parallel(q, k, v).transpose(1, 2).reshape(b, t, c))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = torch.softmax(att.masked_fill(future, float("-inf")), dim=-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(),
                                 nn.Linear(4 * cfg.d_model, cfg.d_model))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """forward(tokens (B, S), targets (B, S)) -> mean next-token loss."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.block, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:  # GPT-2's initialisation, residual projections scaled by depth
                std = 0.02 / math.sqrt(2 * cfg.layers) if name.endswith(("proj.weight", "mlp.2.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, tokens, targets, positions=None):
        """positions (S,): the tokens' places in the sequence (default 0..S-1; under context
        parallelism those of the rank's share)."""
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), targets.reshape(-1))


def enable_context_parallel(model: GPT, group) -> None:
    """Every attention layer attends over the sequence split across `group` (zigzag layout)."""
    from torch_flash.nn import ContextParallelAttention

    for block in model.blocks:
        block.attn.context_parallel = ContextParallelAttention(group, causal=True, layout="zigzag")


# ---------------------------------------------------------------- data

def make_corpus(num_chars: int, seed: int) -> bytes:
    """Lines "a+b=c\\n" with a, b drawn uniformly from [0, 1000): the sums are learnable."""
    rng = np.random.default_rng(seed)
    pairs = rng.integers(0, 1000, size=(num_chars // 8 + 1, 2)).tolist()
    return "".join(f"{a}+{b}={a + b}\n" for a, b in pairs)[:num_chars].encode()


class TokenBlocks(Dataset):
    """Sample i: the (block + 1) bytes starting at i * block, as int64 (inputs and shifted
    targets overlap by one). Deterministic and int-indexed, as the resampler needs."""

    def __init__(self, data: bytes, block: int):
        self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.block = block

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tokens[i * self.block: (i + 1) * self.block + 1].long()


class Indexed(Dataset):
    """(i, dataset[i]): the batch carries the global sample indices it was read from."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        return i, self.dataset[i]


class ShardSampler(Sampler[int]):
    """Rank `rank`'s share of [0, length): rank, rank + world, ..., from its start-th item on."""

    def __init__(self, length: int, rank: int, world: int, start: int = 0):
        self.indices = range(start * world + rank, length - length % world, world)

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


# ---------------------------------------------------------------- distributed + checkpoint

def setup_distributed(device: str) -> tuple[int, int, torch.device, bool]:
    """Process group from torchrun's environment (gloo on CPU, nccl on GPU), or the one the
    caller already initialised; (rank, world, device, whether this call created it)."""
    created = not dist.is_initialized()
    if created and "RANK" not in os.environ:
        return 0, 1, torch.device(device), False
    if device != "cuda":
        local = None
    else:
        local = int(os.environ["LOCAL_RANK"]) if "LOCAL_RANK" in os.environ else dist.get_rank() % torch.cuda.device_count()
        torch.cuda.set_device(local)
    if created:
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size(), torch.device(device, local), created


def context_parallel_groups(cp: int, rank: int, world: int):
    """(cp group of this rank, cp rank, dp rank, dp size): groups of cp consecutive ranks.
    Every rank creates every group (new_group is collective), in the same order."""
    if world % cp:
        raise SystemExit(f"--cp {cp} does not divide the world size {world}")
    mine = None
    for first in range(0, world, cp):
        # its own group even when cp == world: the ring's P2P traffic then never shares a
        # communicator with DDP's gradient all-reduce, which runs during the same backward
        group = dist.new_group(list(range(first, first + cp)))
        if first <= rank < first + cp:
            mine = group
    return mine, rank % cp, rank // cp, world // cp


def wrap_parallel(model: nn.Module, args, world: int, device: torch.device) -> nn.Module:
    """DDP (optionally with compressed gradients) or FSDP2 when world > 1."""
    if world == 1:
        return model
    if args.parallel == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 else None
        # the mesh on the training device: fully_shard's default takes CUDA wherever there is a
        # GPU, and a CPU run of two processes on a one-GPU host failed setting device 1
        kw = {"mesh": init_device_mesh(device.type, (world,))}
        if mp:
            kw["mp_policy"] = mp
        for block in model.blocks:
            fully_shard(block, **kw)
        return fully_shard(model, **kw)
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    if args.grad_compress:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(dist.group.WORLD, getattr(default_hooks, f"{args.grad_compress}_compress_hook"))
    return ddp


def _state_dict_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # full (unsharded) tensors on the CPU: one file that loads into any world size or wrapper
    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def save_checkpoint(path: str, model: nn.Module, optimizer, step: int, rank: int) -> None:
    """Collective (FSDP gathers the shards); rank 0 writes the file atomically."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    opts = _state_dict_options()
    state = {"model": get_model_state_dict(model, options=opts),
             "optimizer": get_optimizer_state_dict(model, optimizer, options=opts), "step": step}
    if rank == 0:
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)
    if dist.is_initialized():
        dist.barrier()


def load_checkpoint(path: str, model: nn.Module, optimizer) -> int:
    """Loads model and optimizer state in place; returns the step to continue from."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    state = torch.load(path, map_location="cpu", weights_only=True)
    set_model_state_dict(model, state["model"], options=_state_dict_options())
    set_optimizer_state_dict(model, optimizer, state["optimizer"], options=_state_dict_options())
    return state["step"]


# ---------------------------------------------------------------- training

def learning_rate(step: int, args) -> float:
    """Linear warmup, then cosine decay to a tenth: a function of the step alone."""
    warmup = max(1, args.steps // 20)
    if step < warmup:
        return args.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, args.steps - warmup)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), help="sizes (default: gpu with CUDA, else cpu)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    for name, kind in (("layers", int), ("d-model", int), ("heads", int), ("block", int), ("batch-size", int),
                       ("steps", int), ("lr", float), ("corpus-chars", int)):
        p.add_argument(f"--{name}", type=kind, help="override the preset (batch size is per rank)")
    p.add_argument("--corpus", help="a text file to train on (default: generated additions)")
    p.add_argument("--seed", type=int, default=0, help="model initialisation and generated corpus")
    p.add_argument("--data-seed", type=int, default=42, help="the resampler's shuffling seed")
    p.add_argument("--parallel", choices=("ddp", "fsdp"), default="ddp", help="under torchrun")
    p.add_argument("--cp", type=int, default=1,
                   help="context parallelism: each sequence split over groups of CP ranks (zigzag), "
                        "--parallel over the world (cp * dp ranks)")
    p.add_argument("--grad-compress", choices=("bf16", "fp16"),
                   help="DDP: all-reduce gradients in bf16 (NCCL only) or fp16 through PyTorch's comm hooks")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 autocast (FSDP: bf16 parameters); default on for CUDA")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="torch.compile(backend=BACKEND); --no-compile runs eagerly")
    p.add_argument("--backend", default="flash",
                   help="torch.compile backend (inductor: the same compile without the rewrites)")
    p.add_argument("--workers", type=int, default=0, help="DataLoader workers")
    p.add_argument("--ckpt", help="checkpoint file (written by rank 0)")
    p.add_argument("--save-every", type=int, default=0, help="save every N steps (and at the end)")
    p.add_argument("--resume", action="store_true", help="continue from --ckpt")
    p.add_argument("--interrupt-at", type=int, help="save and stop after this step (a simulated preemption)")
    p.add_argument("--log-indices", help="append per-step JSON lines {step, indices, loss} (.rank<r> per rank)")
    p.add_argument("--log-every", type=int, default=10)
    args = p.parse_args(argv)
    preset = PRESETS[args.preset or ("gpu" if args.device == "cuda" else "cpu")]
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.bf16 is None:
        args.bf16 = args.device == "cuda"
    if (args.resume or args.interrupt_at or args.save_every) and not args.ckpt:
        p.error("--resume, --interrupt-at and --save-every need --ckpt")
    if args.resume and not os.path.exists(args.ckpt):
        p.error(f"--resume: no checkpoint at {args.ckpt}")
    if args.cp < 1 or args.block % (2 * args.cp):
        p.error(f"--cp {args.cp}: --block {args.block} must split into 2 * cp equal chunks (zigzag)")
    if args.grad_compress and args.parallel != "ddp":
        p.error("--grad-compress is a DDP communication hook")
    if args.grad_compress == "bf16" and args.device != "cuda":
        p.error("--grad-compress bf16: PyTorch's bf16 hook needs NCCL (CUDA); use fp16 with gloo")
    return args


def main(argv=None) -> list[float]:
    """Runs training; returns this rank's losses of the steps it ran."""
    args = parse_args(argv)
    rank, world, device, created = setup_distributed(args.device)
    say = print if rank == 0 else (lambda *a, **k: None)
    positions, cp_group, dp_rank, dp = None, None, rank, world
    if args.cp > 1:
        from torch_flash.context_parallel import sequence_positions

        if world == 1:
            raise SystemExit(f"--cp {args.cp}: launch {args.cp} * dp ranks (torchrun)")
        cp_group, cp_rank, dp_rank, dp = context_parallel_groups(args.cp, rank, world)
        positions = sequence_positions(args.block, args.cp, cp_rank, "zigzag", device)

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    cfg = GPTConfig(args.layers, args.d_model, args.heads, args.block)
    model = GPT(cfg)
    if cp_group is not None:
        enable_context_parallel(model, cp_group)
    model = wrap_parallel(model.to(device), args, world, device)
    # weight decay on matrices only (GPT-2), not on norms, biases
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
    step = load_checkpoint(args.ckpt, model, optimizer) if args.resume else 0
    compiled = torch.compile(model, backend=args.backend) if args.compile else model

    corpus = Path(args.corpus).read_bytes() if args.corpus else make_corpus(args.corpus_chars, args.seed)
    blocks = IdentityMultiEpochDatasetWrapper(TokenBlocks(corpus, args.block))
    # data parallel over dp: the ranks of one context-parallel group read the same samples
    data = MultiEpochDatasetResampler(blocks, num_samples=args.steps * args.batch_size * dp, seed=args.data_seed)
    loader = DataLoader(Indexed(data), batch_size=args.batch_size, drop_last=True, num_workers=args.workers,
                        sampler=ShardSampler(len(data), dp_rank, dp, start=step * args.batch_size),
                        pin_memory=device.type == "cuda")
    say(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, world {world}"
        f"{' ' + args.parallel if world > 1 else ''}{f' (cp {args.cp} x dp {dp})' if args.cp > 1 else ''}, "
        f"{len(blocks)} blocks of {args.block} bytes per epoch, "
        f"{data.num_epochs} epochs, steps {step}..{args.steps}")

    log = None
    if args.log_indices:
        log = open(args.log_indices if world == 1 else f"{args.log_indices}.rank{rank}", "a")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.bf16 else nullcontext()
    losses = []
    for indices, batch in loader:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args)
        batch = batch.to(device, non_blocking=True)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        if positions is not None:  # this rank's share of every sequence
            inputs, targets = inputs[:, positions], targets[:, positions]
        with autocast:
            # the mean over this rank's tokens; DDP's gradient average over the world makes it
            # the global token-mean (see the module docstring)
            loss = compiled(inputs, targets, positions)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if not losses:  # compiled now: report the rewrites, time from here on
            say("flash rewrites:", dict(sorted(torch_flash.counters.items())))
            start, tokens = time.perf_counter(), 0
        else:
            tokens += inputs.numel() * world
        if cp_group is not None:  # the loss of the whole sequences: the group's mean
            loss = loss.detach().clone()
            dist.all_reduce(loss, group=cp_group)
            loss /= args.cp
        losses.append(loss.detach())  # .item() only where printed or logged: it waits for the GPU
        if log:
            log.write(json.dumps({"step": step, "indices": indices.tolist(), "loss": loss.item()}) + "\n")
        if step % args.log_every == 0 or step == args.steps:
            speed = f"{tokens / (time.perf_counter() - start):,.0f} tok/s" if tokens else "(compiled)"
            say(f"step {step:5d}  loss {loss.item():.4f}  lr {learning_rate(step - 1, args):.2e}  {speed}")
        stop = step == args.interrupt_at or step == args.steps
        if args.ckpt and (stop or (args.save_every and step % args.save_every == 0)):
            save_checkpoint(args.ckpt, model, optimizer, step, rank)
            say(f"saved step {step} to {args.ckpt}")
        if stop:
            break
    if log:
        log.close()
    if dist.is_initialized():
        # leave together: one CI run (FSDP2 over gloo, a loaded machine) aborted a rank at exit
        # ("terminate called without an active exception") when it tore its connections down
        # while the other rank was still finishing
        dist.barrier()
        if created:  # a caller's process group stays theirs
            dist.destroy_process_group()
    return [loss.item() for loss in losses]


if __name__ == "__main__":
    main()
